"""CUDA graphs: each captured pass replayed from static inputs in one memory pool.

A round's graph is keyed only by what changes its kernels: (bucket, tree setting, sampling kind,
whether it reports its nodes), and for a plain step that keeps the drafter's context whether it
appends or flushes that context. A fixed deployment (no reports, no context) therefore captures one
round per bucket and sampling kind, whatever else the policy does.
"""

from __future__ import annotations

import contextlib

import torch

from treeflash_export.config import TreeConfig


def round_key(b: int, tree: TreeConfig, kind: int, report: bool, context: str | None) -> tuple:
    """A round graph's key. report counts for tree rounds only; context (None, "append", "flush")
    for plain steps only."""
    plain = tree.mode == "ar"
    return ("round", b, tree, kind, bool(report) and not plain, context if plain else None)


class GraphCache:
    """Captured passes by key, sharing one memory pool."""

    def __init__(self):
        self.graphs: dict[tuple, Captured] = {}
        self._pool = None

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def __getitem__(self, key) -> "Captured":
        return self.graphs[key]

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self):
        return iter(self.graphs)

    def keys(self):
        return self.graphs.keys()

    def capture(self, fn, args, reset) -> "Captured":
        """fn(*args) as a replayable graph in this cache's memory pool. (The CPU tests put an eager
        stand-in here, so that the functions and arguments CUDA captures run, and are checked, on CPU.)"""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return Captured(fn, args, self._pool, reset)

    def add(self, key, fn, args, reset) -> "Captured":
        self.graphs[key] = self.capture(fn, args, reset)
        return self.graphs[key]


@contextlib.contextmanager
def kept(*tensors: torch.Tensor, after=None):
    """The state in ``tensors`` is put back when the block ends; the block gets restore() to put it
    back earlier too (before each warm-up or replay of a scratch pass). after(): called on each
    restore (the host's knowledge of what was put back may be stale)."""
    saved = [t.clone() for t in tensors]

    def restore():
        for dst, src in zip(tensors, saved):
            dst.copy_(src)
        if after is not None:
            after()

    try:
        yield restore
    finally:
        restore()


class Captured:
    """fn(*args) captured once in a CUDA graph with static copies of its tensor arguments;
    calling copies the new arguments in and replays. fn's effects are its writes to state."""

    def __init__(self, fn, args, pool, reset, warmup: int = 2):
        """reset() puts the scratch state back before each warm-up run and before the capture."""
        self.args = [a.clone() for a in args]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
            for _ in range(warmup):
                reset()
                fn(*self.args)
        torch.cuda.current_stream().wait_stream(stream)
        reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn(*self.args)
        reset()

    def __call__(self, *args) -> None:
        for dst, src in zip(self.args, args):
            dst.copy_(src)
        self.graph.replay()
