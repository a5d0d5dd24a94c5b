"""User-facing errors: one line that names the problem and the fix."""


class TreeFlashError(Exception):
    """An error caused by the user's input or environment, printed without a traceback."""


class CheckpointError(TreeFlashError):
    """A checkpoint is missing, unreadable, of an unknown layout, or does not match its pair."""


class ConfigError(TreeFlashError):
    """A setting is out of range or inconsistent with the models."""
