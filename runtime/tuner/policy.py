"""The choice: the candidate setting with the most expected tokens per second, never slower than
plain decoding, with a little hysteresis; and how explicit command-line values constrain it.

rate(s) = E[tokens per round at s] / predicted ms of a round at s   (tokens per ms per slot; all
slots of a bucket share the round, so maximising it per slot maximises the bucket's throughput).
Plain decoding is always scored (1 token per round at the cost of a plain step) unless the user
fixed the mode, so the best candidate is never predicted slower than plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeflash_export.errors import ConfigError

from .acceptance import AcceptanceModel, RequestStream
from .cost import CostModel
from .setting import FIELDS, PLAIN, Setting

MODES = ("treeflash", "marginal", "chain", "ar")


@dataclass(frozen=True)
class Choice:
    """A decision and its figures (for --json). Rates are tokens per second per slot."""

    setting: Setting
    tokens_per_round: float
    round_ms: float
    tokens_per_s: float
    plain_tokens_per_s: float | None
    runner_up: Setting | None = None
    runner_up_tokens_per_round: float | None = None
    runner_up_round_ms: float | None = None
    runner_up_tokens_per_s: float | None = None
    kept: bool = False  # hysteresis kept the current setting although another scored (slightly) higher
    bucket: int = 1

    @property
    def speedup(self) -> float | None:
        """Predicted tokens/s over plain decoding's (None when plain decoding was not a candidate)."""
        return self.tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else None

    def to_json(self) -> dict:
        s, r = self.setting, self.runner_up
        return {"mode": s.mode, "tree_size": s.tree_size, "top_m": s.top_m, "top_k": s.top_k, "bucket": self.bucket,
                "predicted_tokens_per_round": self.tokens_per_round, "predicted_round_ms": self.round_ms,
                "predicted_tokens_per_s": self.tokens_per_s, "predicted_plain_tokens_per_s": self.plain_tokens_per_s,
                "predicted_speedup": self.speedup, "kept_by_hysteresis": self.kept,
                "runner_up": None if r is None else {
                    "mode": r.mode, "tree_size": r.tree_size, "top_m": r.top_m, "top_k": r.top_k,
                    "predicted_tokens_per_round": self.runner_up_tokens_per_round,
                    "predicted_round_ms": self.runner_up_round_ms,
                    "predicted_tokens_per_s": self.runner_up_tokens_per_s}}


def score(cost: CostModel, acceptance: AcceptanceModel, bucket: int, candidates: list[Setting],
          stream: RequestStream | None = None, block_size: int | None = None) -> list[tuple[Setting, float, float]]:
    """(setting, expected tokens per round, predicted round ms) for each candidate with a prediction."""
    out = []
    for s in candidates:
        tokens = acceptance.expected(s, stream, block_size)
        if tokens is not None:
            out.append((s, tokens, cost.round_ms(s, bucket)))
    return out


def choose(cost: CostModel, acceptance: AcceptanceModel, bucket: int, candidates: list[Setting],
           current: Setting | None = None, hysteresis: float = 0.03, stream: RequestStream | None = None,
           block_size: int | None = None, plain: bool = True, margin=0.0) -> Choice:
    """The candidate with the most expected tokens per second at this batch bucket.

    Plain decoding is always a candidate (the fallback by construction) unless plain=False, which
    the caller passes when the user fixed a tree explicitly (explicit values win). The current
    setting is kept while the best beats it by no more than `hysteresis` (a fraction) and it is not
    predicted slower than plain decoding. Ties go to the cheaper round. margin: a tree must be
    predicted this fraction faster than plain decoding to be chosen over it (predictions err, and
    the promise is never to be slower than plain decoding); a number, or a function of the setting
    (a larger margin where fewer rounds support its prediction)."""
    cands = list(dict.fromkeys(([PLAIN] if plain else []) + list(candidates)))
    scored = score(cost, acceptance, bucket, cands, stream, block_size)
    if not scored:
        raise ConfigError("no candidate setting has an acceptance estimate yet; run a round at one first")
    rate = {s: 1000.0 * t / ms if ms > 0 else float("inf") for s, t, ms in scored}
    need = margin if callable(margin) else (lambda s: margin)
    rank = {s: r if s == PLAIN else r / (1.0 + need(s)) for s, r in rate.items()}
    ranked = sorted(scored, key=lambda x: (-rank[x[0]], x[2]))
    plain = rate.get(PLAIN)
    best, kept = ranked[0], False
    if current is not None and current != best[0] and current in rate:
        if rank[current] * (1.0 + hysteresis) >= rank[best[0]] and (plain is None or rank[current] >= rank[PLAIN]):
            best, kept = next(x for x in ranked if x[0] == current), True
    rest = [x for x in ranked if x[0] != best[0]]
    up = rest[0] if rest else None
    return Choice(setting=best[0], tokens_per_round=best[1], round_ms=best[2], tokens_per_s=rate[best[0]],
                  plain_tokens_per_s=plain, kept=kept, bucket=bucket,
                  runner_up=up[0] if up else None, runner_up_tokens_per_round=up[1] if up else None,
                  runner_up_round_ms=up[2] if up else None, runner_up_tokens_per_s=rate[up[0]] if up else None)


def can_pay(cost: CostModel, s: Setting, bucket: int, block_size: int) -> bool:
    """Whether s could beat plain decoding at all: a round gains at most min(N, B) tokens."""
    if s.mode == "ar":
        return True
    return cost.round_ms(s, bucket) < min(s.tree_size, block_size) * cost.round_ms(PLAIN, bucket)


# ---- explicit values and 'auto' ------------------------------------------------------------------
def parse_auto(value, field: str = "tree_size"):
    """A command-line value: None or 'auto' -> None (the tuner chooses); else the mode name or an int >= 1."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if field == "mode":
        if value not in MODES:
            raise ConfigError(f"--mode {value!r} is not a mode: use auto or one of {', '.join(MODES)}")
        return value
    flag = f"--{field.replace('_', '-')} {value!r}: use auto or a whole number >= 1"
    if isinstance(value, (bool, float)):  # int(2.5) would quietly give 2
        raise ConfigError(flag)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(flag) from None
    if n < 1:
        raise ConfigError(flag)
    return n


@dataclass(frozen=True)
class Resolved:
    """The tree settings after explicit values: `fixed` field -> value, `auto` the fields to choose."""

    fixed: dict
    auto: tuple[str, ...]

    @property
    def setting(self) -> Setting | None:
        """The setting when nothing is left to choose (all four fixed), else None."""
        return None if self.auto else Setting(*(self.fixed[f] for f in FIELDS))


def resolve_settings(explicit: dict, defaults: dict, tune: bool = True) -> Resolved:
    """explicit: field -> value given by the user (None: 'auto'); a field absent from `explicit`
    takes defaults[field] (which may itself be None: 'auto'). Explicit values always win. With
    tune=False (a backend that keeps its manifest's settings) the 'auto' fields take `defaults`."""
    unknown = set(explicit) - set(FIELDS)
    if unknown:
        raise ConfigError(f"unknown tree settings {sorted(unknown)}: use {', '.join(FIELDS)}")
    fixed, auto = {}, []
    for f in FIELDS:
        v = explicit[f] if f in explicit else defaults.get(f)
        v = parse_auto(v, f)
        if v is None and not tune:
            v = parse_auto(defaults.get(f), f)
            if v is None:
                raise ConfigError(f"{f} is 'auto' but this backend cannot tune it: give a value")
        if v is None:
            auto.append(f)
        else:
            fixed[f] = v
    return Resolved(fixed=fixed, auto=tuple(auto))
