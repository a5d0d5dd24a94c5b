"""The lowest release of every requirement in pyproject.toml, as pip constraints.

``make test-oldest`` installs the project under these constraints, so the suite runs on the floors
the project declares (every dependency and every extra), not only on the newest releases:

    python tests/floors.py > constraints.txt

A requirement whose lower bound is ``>=X`` (alone or in a range) is pinned to ``==X``; an exact pin is
kept; one with no lower bound is an error, since its oldest release is unknown.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def floor_pin(requirement: str) -> str:
    """``"onnx>=1.17"`` -> ``"onnx==1.17"``; extras are dropped (constraints cannot carry them)."""
    m = _REQ.match(requirement)
    if m is None:
        raise ValueError(f"cannot read the requirement {requirement!r}")
    name, specs = m.group(1), [s.strip() for s in m.group(3).split(",") if s.strip()]
    for spec in specs:
        if spec.startswith("==") and "*" not in spec:
            return f"{name}{spec}"
    for spec in specs:
        if spec.startswith(">="):
            return f"{name}=={spec[2:].strip()}"
    raise ValueError(f"{requirement!r} has no lower bound (>= or ==), so its oldest release is unknown")


def floor_pins(pyproject: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """One pin per requirement of the project and of its extras, except the extras in ``skip``."""
    text = pyproject.read_text()
    if tomllib is None:
        raise RuntimeError("reading pyproject.toml needs Python 3.11 or later (tomllib)")
    project = tomllib.loads(text)["project"]
    requirements = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra not in skip:
            requirements += reqs
    return sorted({floor_pin(r) for r in requirements}, key=str.lower)


def main(argv: list[str]) -> int:
    # TensorRT itself cannot be installed without its GPU libraries, so its extra is left out
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(floor_pins(pyproject, skip=("tensorrt",))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
