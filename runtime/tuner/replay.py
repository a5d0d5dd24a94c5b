"""A tuned generation's rounds, recorded and replayed through the acceptance model.

Speed figures on a small machine move by several percent between runs, so a change to how the tuner
predicts is hard to judge by timing alone. What the predictions are worth needs no timing: record,
in order, what the acceptance model was taught (each round's nodes, the request stream they fed,
whether the deployment's calibration took them), where the averages restarted, and each tree round's
setting, why it ran and the tokens it gained. Then replay that through an acceptance model (the
current one, or a variant) and compare, round by round, the tokens it would have predicted before
the round with the tokens the round gained. It takes seconds, and every variant sees the same rounds.

    recording = Recording()
    recording.attach(tuner)                  # a TreeTuner: from now on its rounds are recorded
    recording.request("prompt 3")            # before each generation (a label for the summary)
    ...
    recording.save("rounds.json")
    rows = replay(Recording.load("rounds.json"), AcceptanceModel())
    print(summary(rows))

`treeflash-bench --record FILE` records its auto rows; `python -m treeflash_runtime.tuner.replay
FILE...` prints the summary of each file under the current acceptance model. The replay's realised
factor learns from the recorded rounds of trees predicted best (as the tuner's does), not from score
probes (their predictions are not recorded), so its scaled predictions can differ from the live
ones; the unscaled ones are the live ones exactly.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from treeflash_export.fsutil import atomic_write_text

from .acceptance import AcceptanceModel, Observation, RequestStream
from .auto import UNPREDICTED
from .setting import Setting


@dataclass(frozen=True)
class Row:
    """One tree round of a replay: its request's label, why it ran (None: the choice), the tokens the
    replayed model predicted for it before the round (unscaled, and scaled by its realised factor),
    and the tokens it gained."""

    label: str
    reason: str | None
    predicted: float
    scaled: float
    gained: int


class Recording:
    """The events of a tuned run, in order (see the module's notes)."""

    def __init__(self, events: list | None = None, block_size: int | None = None):
        self.events: list = list(events or [])
        self.block_size = block_size  # the drafter's block (the chain's predictions and every cap use it)
        self._streams: dict[int, tuple[int, RequestStream]] = {}  # id -> (key, the stream, kept alive)

    # ---- recording ---------------------------------------------------------------------------
    def attach(self, tuner) -> "Recording":
        """Records the rounds of this TreeTuner (and what its acceptance model is taught) from now on."""
        tuner.recorder = self
        tuner.auto.acceptance.recorder = self
        self.block_size = tuner.auto.block_size
        return self

    def request(self, label: str) -> None:
        """A new request (one generation) begins: its rounds are summarised under ``label``."""
        self._streams = {}
        self.events.append(["request", str(label)])

    def _key(self, stream: RequestStream | None) -> int | None:
        if stream is None:
            return None
        got = self._streams.get(id(stream))
        if got is None:
            got = self._streams[id(stream)] = (len(self._streams), stream)
        return got[0]

    def restart(self) -> None:
        self.events.append(["restart"])

    def observe(self, obs: Observation, stream: RequestStream | None, deployment: bool) -> None:
        arr = lambda a: None if a is None else np.asarray(a).tolist()  # noqa: E731
        self.events.append(["observe", {"mode": obs.mode, "scores": arr(obs.scores), "accepted": arr(obs.accepted),
                                        "top_m": obs.top_m, "top_k": obs.top_k, "depth": arr(obs.depth),
                                        "m_rank": arr(obs.m_rank), "k_rank": arr(obs.k_rank)},
                            self._key(stream), bool(deployment)])

    def round(self, s: Setting, reason: str | None, stream: RequestStream | None) -> None:
        """A tree round is about to run (plain decoding rounds are not recorded)."""
        self.events.append(["round", list(s), reason, self._key(stream)])

    def gained(self, tokens: int) -> None:
        self.events.append(["gained", int(tokens)])

    # ---- files -----------------------------------------------------------------------------------
    def save(self, path) -> Path:
        return atomic_write_text(Path(path), json.dumps({"version": 1, "block_size": self.block_size,
                                                         "events": self.events}))

    @classmethod
    def load(cls, path) -> "Recording":
        d = json.loads(Path(path).read_text())
        if not isinstance(d, dict) or d.get("version") != 1 or not isinstance(d.get("events"), list):
            raise ValueError(f"{path}: not a recording of tuned rounds")
        return cls(d["events"], d.get("block_size"))


def _observation(d: dict) -> Observation:
    arr = lambda k, t: None if d.get(k) is None else np.asarray(d[k], dtype=t)  # noqa: E731
    return Observation(mode=d["mode"], scores=arr("scores", float), accepted=arr("accepted", bool),
                       top_m=int(d["top_m"]), top_k=int(d["top_k"]), depth=arr("depth", int),
                       m_rank=arr("m_rank", int), k_rank=arr("k_rank", int))


def replay(recording: Recording, model: AcceptanceModel) -> list[Row]:
    """Feeds the recording to ``model`` (a fresh acceptance model, or a variant with the same methods)
    and returns a Row per recorded tree round that the model could predict."""
    block_size = recording.block_size
    streams: dict[int, RequestStream] = {}
    rows: list[Row] = []
    label, pending = "", None

    def stream_of(key):
        return None if key is None else streams.setdefault(key, RequestStream())

    for event in recording.events:
        kind = event[0]
        if kind == "request":
            label, streams, pending = event[1], {}, None
        elif kind == "restart":
            model.restart_averages()
        elif kind == "observe":
            model.observe(_observation(event[1]), stream_of(event[2]), event[3])
        elif kind == "round":
            s, reason, stream = Setting(*event[1]), event[2], stream_of(event[3])
            raw = model.expected(s, stream, block_size, raw=True)
            pending = None if raw is None else (s, reason, raw, model.expected(s, stream, block_size))
        elif kind == "gained" and pending is not None:
            s, reason, raw, scaled = pending
            rows.append(Row(label, reason, raw, scaled, event[1]))
            if reason not in UNPREDICTED:
                model.observe_gain(raw, event[1])
            pending = None
    return rows


def summary(rows: list[Row]) -> dict:
    """Over the rows of trees that ran because they were predicted best (not UNPREDICTED): rounds, the
    mean tokens predicted (unscaled and scaled) and gained, and each prediction's mean error and bias
    (predicted - gained)."""
    rows = [r for r in rows if r.reason not in UNPREDICTED]
    if not rows:
        return {"rounds": 0}
    p, s, g = (np.array([getattr(r, k) for r in rows], dtype=float) for k in ("predicted", "scaled", "gained"))
    return {"rounds": len(rows), "predicted": float(p.mean()), "scaled": float(s.mean()), "gained": float(g.mean()),
            "bias": float((p - g).mean()), "error": float(np.abs(p - g).mean()),
            "scaled_bias": float((s - g).mean()), "scaled_error": float(np.abs(s - g).mean())}


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m treeflash_runtime.tuner.replay RECORDING.json...", file=sys.stderr)
        return 2
    every: list[Row] = []
    for path in paths:
        rows = replay(Recording.load(path), AcceptanceModel())
        every += rows
        _print(path, summary(rows))
    if len(paths) > 1:
        _print("all", summary(every))
    return 0


def _print(name: str, s: dict) -> None:
    if not s["rounds"]:
        print(f"{name}: no tree round predicted best")
        return
    print(f"{name}: {s['rounds']} rounds, gained {s['gained']:.2f} tokens a round; predicted {s['predicted']:.2f} "
          f"(bias {s['bias']:+.3f}, mean error {s['error']:.3f}), scaled {s['scaled']:.2f} "
          f"(bias {s['scaled_bias']:+.3f}, mean error {s['scaled_error']:.3f})")


if __name__ == "__main__":
    raise SystemExit(main())
