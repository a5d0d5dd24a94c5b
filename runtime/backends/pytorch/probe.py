"""Adapters that wrap the round's stage functions from outside: the stage timer (benchmarks: seconds
per stage, eagerly or inside a CUDA graph) and the cost probe (the self-tuning tree's timing of a
round's parts). Neither changes what a round computes."""

from __future__ import annotations

import contextlib
import time

import torch

from treeflash_export.config import SamplingConfig, TreeConfig

from ...sampling import GREEDY
from .graphs import kept, round_key
from .stages import STAGES, RoundStages

# The timer's name for each stage method (the plain step's context is drafter work).
STAGE_NAMES = {"draft": "draft", "expand": "expand", "build": "tree", "verify": "verify", "accept": "accept",
               "accept_plain": "accept", "keep_context": "draft"}


@contextlib.contextmanager
def stage_timer(stages: RoundStages, totals: dict[str, float], sync, marks: list | None = None):
    """While active, each outermost stage call adds its seconds to totals[name] (synchronised around
    it); with ``marks`` and a CUDA capture running, CUDA events recorded into the graph instead
    (name, start, end), read after replays."""
    depth = [0]

    def wrap(name, fn):
        def timed(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)  # a stage inside another (the probe's drafter pass) counts there
            if marks is not None and not torch.cuda.is_current_stream_capturing():
                return fn(*args, **kwargs)  # a graph's warm-up: only the captured events time it
            depth[0] += 1
            try:
                if marks is not None:
                    start, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
                    start.record()
                    out = fn(*args, **kwargs)
                    end.record()
                    marks.append((name, start, end))
                    return out
                sync()
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                sync()
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
                return out
            finally:
                depth[0] -= 1
        return timed

    methods = [m for m in STAGES if m in STAGE_NAMES]
    for m in methods:
        setattr(stages, m, wrap(STAGE_NAMES[m], getattr(stages, m)))
    try:
        yield totals
    finally:
        for m in methods:
            vars(stages).pop(m, None)  # the class's own methods again


class CostProbe:
    """Times whole rounds over slots 0..b-1 holding a dummy prompt (inside ``runner.probing``): the
    tuner's probe protocol (treeflash_runtime.tuner.prior). Parts: 'ar' (a plain step), 'round'
    (setting=...: a whole round at that setting; tree=...: the TreeConfig the tuner's plans will
    carry for it). With CUDA graphs on, each is captured once and its replay is timed: the rounds
    that serve are replays, whose cost an eager call would overstate. A tree round is captured in
    the form the tuner's greedy rounds take (reporting its nodes) and kept in the runner's graphs:
    exploring it later replays that graph, timed and at a replay's cost, instead of running eagerly
    (several times slower on a GPU, and untimed)."""

    def __init__(self, runner):
        self.runner = runner
        self.memo: dict = {}

    @torch.inference_mode()
    def time_part(self, part: str, b: int, **params) -> float:
        """Seconds of one call over slots 0..b-1, synchronised; the committed state is put back after,
        so every call times the same lengths."""
        r = self.runner
        st = r.state
        if part == "ar":
            tree = TreeConfig(mode="ar").resolved(r.block_size)
        elif part == "round":
            s = params["setting"]
            tree = params.get("tree") or TreeConfig(mode=s.mode, tree_size=s.tree_size, top_m=s.top_m,
                                                    top_k=s.top_k).resolved(r.block_size)
        else:
            raise ValueError(f"unknown part {part!r}")
        bound = 0 if r.compiled or r.use_graphs else min(max(r.slots.host_len[:b]) + max(tree.tree_size, r.block_size),
                                                          r.slot_size)
        with kept(st.past_len, st.root, st.pending, st.pending_count, st.out, st.active,
                  after=r.forget_pending_bound) as restore:
            run = lambda: r.stages.run(b, tree, GREEDY, bound)  # noqa: E731
            if r.use_graphs and tree.mode != "ar":
                key = round_key(b, tree, GREEDY, True, None)  # the runner's key for the tuner's round
                if key not in r.graphs:
                    r.capture_round(key, b, tree, GREEDY, {"report": True})
                    restore()
                run = self.memo[key] = r.graphs[key]
            elif r.use_graphs:
                key = (part, b, tree)
                if key not in self.memo:
                    self.memo[key] = r.graphs.capture(run, (), restore)
                    restore()
                run = self.memo[key]
            r.sync()
            t0 = time.perf_counter()
            run()
            r.sync()
            return time.perf_counter() - t0


@contextlib.contextmanager
def probing(runner, b: int, prompt_tokens: int = 64):
    """Slots 0..b-1 hold a dummy prompt of ``prompt_tokens`` tokens while a CostProbe times a round's
    parts; every slot is freed after, so no request may hold one."""
    if bool(runner.state.active[:b].any()):
        raise RuntimeError("internal error: the cost probe needs free slots; a request holds one")
    ids = torch.arange(1, prompt_tokens + 1, device=runner.device) % runner.vocab_size
    try:
        for slot in range(b):
            runner.admit(slot, SamplingConfig())
        runner.prefill_many([(slot, ids, True) for slot in range(b)])
        yield CostProbe(runner)
    finally:
        for slot in reversed(range(b)):
            runner.release(slot)
