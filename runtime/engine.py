"""The engine loop, the one loop every front end runs (treeflash-run, --prompts-file, Triton,
treeflash-serve, the benchmarks; one sequence is an engine with one request). Each step admits,
prefills this step's prompt chunks in one pass, asks the policy for the round's plan, has the runner
execute it, hands the report back to the policy, streams every running request's new tokens and
retires the finished ones:

    plan = policy.plan(bucket, requests)     # a RoundPlan: the tree (or plain decoding), reports, probe
    report = runner.step(plan)               # a RoundReport: tokens per slot, nodes, wall time
    policy.learn(report, requests)

``run`` serves a list of requests to the end (offline batches, one sequence, the benchmarks);
``start`` runs the loop in a background thread that serves requests submitted from other threads
(the Triton model's ``execute``, the OpenAI server), as the Triton vLLM backend does.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import torch

from treeflash_export.config import SamplingConfig, TreeConfig

from .backends.slots import tree_sizes_by_bucket
from .plan import PREFILL_CHUNK, FixedPlans, check_fits, checked_tree
from .scheduler import CANCELLED, FAILED, FINISHED, RUNNING, Request, Scheduler


class Emitter:
    """Collects a request's emitted tokens, applies stop tokens and the token budget, and streams."""

    def __init__(self, sampling: SamplingConfig, on_tokens: Callable[[list[int]], bool | None] | None):
        self.tokens: list[int] = []
        self.stop = set(sampling.stop_token_ids)
        self.budget = sampling.max_new_tokens
        self.on_tokens = on_tokens
        self.reason = ""

    def emit(self, new: list[int]) -> bool:
        """Returns True when generation must end."""
        take = []
        for t in new:
            take.append(t)
            if t in self.stop:
                self.reason = "stop_token"
                break
            if len(self.tokens) + len(take) >= self.budget:
                self.reason = "max_new_tokens"
                break
        self.tokens.extend(take)
        # A callback that returns True ends generation after these tokens (stop words, cancelled streams).
        if self.on_tokens is not None and take and self.on_tokens(take) and not self.reason:
            self.reason = "stopped"
        return bool(self.reason)


class Engine:
    def __init__(self, runner, policy=None, prefill_chunk: int = PREFILL_CHUNK, max_active: int | None = None):
        """runner: a backends.base.Runner; policy: what plans each round (the self-tuning tree,
        treeflash_runtime.tuner.online.TreeTuner, or plan.FixedPlans; None: the runner's deployment
        tree per bucket); max_active: requests served at once (default and at most the runner's
        slots)."""
        self.runner = runner
        self.policy = policy if policy is not None else FixedPlans(runner.deployment)
        self.scheduler = Scheduler(min(max_active or runner.max_batch, runner.max_batch), prefill_chunk)
        self._emitters: dict[int, Emitter] = {}
        self.rounds_by_batch: dict[int, int] = {}  # running slots in a round -> rounds run so far
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._started = False

    @property
    def max_tree_size(self) -> int:
        """The largest tree a round may build: what every request's cache must leave room for."""
        return self.policy.max_tree_size

    # ------------------------------------------------------------------ requests

    def check(self, request: Request) -> None:
        """A request that cannot run is refused before it takes a slot (one error for it alone)."""
        request.sampling.validate()
        check_fits(len(request.prompt_ids), request.sampling.max_new_tokens, self.max_tree_size,
                   self.runner.capacity, client=self.runner.max_batch > 1)

    def submit(self, request: Request) -> Request:
        self.check(request)
        with self._lock:
            self.scheduler.submit(request)
            self._lock.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Ends the request at the next step; its slot goes to the next request. One still waiting for a
        slot leaves the queue at once (and is reported done in the caller's thread)."""
        request.cancel_requested = True
        with self._lock:
            withdrawn = self.scheduler.withdraw(request)
            self._lock.notify()
        if withdrawn:
            self._finish(request, CANCELLED, "cancelled")

    # ------------------------------------------------------------------ the loop

    def prepare(self) -> None:
        """Before the first admission (at the latest the first step): the policy may measure the
        runner now (a cost probe takes the slots), so callers that time generation call it first."""
        self._begin()

    def _begin(self) -> None:
        if not self._started:
            self._started = True
            self.policy.start()

    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        self._begin()
        with self._lock:
            admitted = self.scheduler.admit()
        sched, runner, policy = self.scheduler, self.runner, self.policy
        for request in admitted:
            if request.state == CANCELLED:
                self._finish(request, CANCELLED, "cancelled")
                continue
            if not self._isolated([request], lambda: runner.admit(request.slot, request.sampling))[0]:
                continue
            self._emitters[id(request)] = Emitter(request.sampling, request.on_tokens)
            policy.admitted(id(request), alone=sched.occupied == 1)
        for request in [r for r in sched.slots if r.wants_cancel()]:
            self._retire(request, CANCELLED, "cancelled")
        chunks = sched.prefills()
        prefilled, firsts = self._isolated([c.request for c in chunks], lambda: runner.prefill_many([
            (c.request.slot, torch.tensor(c.request.prompt_ids[c.start : c.end], dtype=torch.long,
                                          device=runner.device), c.last) for c in chunks])) if chunks else (False, None)
        if prefilled:  # every chunk of this step in one pass
            for chunk, first in zip(chunks, firsts):
                request = chunk.request
                request.prefilled = chunk.end
                if chunk.last:
                    request.state = RUNNING
                    request.first_token_at = time.perf_counter()
                    self._emit(request, [first])
        running = [r for r in sched.running() if not r.stop_reason]  # a first token may already end one
        if running:
            plan = policy.plan(runner.bucket_for(sched.occupied), [id(r) for r in running])
            report = runner.step(plan)
            policy.learn(report, [(r.slot, id(r)) for r in running])
            self.rounds_by_batch[len(running)] = self.rounds_by_batch.get(len(running), 0) + 1
            for request in running:
                gained = report.gained[request.slot]
                request.accept_lengths.append(len(gained))
                request.drafted.append(report.drafted)
                self._emit(request, gained)
        for request in sorted((r for r in sched.slots if r.stop_reason), key=lambda r: -r.slot):
            self._retire(request, FINISHED, request.stop_reason)
        return bool(admitted or chunks or running)

    def _isolated(self, requests: list[Request], fn):
        """fn() for these requests alone (their admission or prefill): if it raises, they fail and
        leave their slots, and the step goes on for the others. Returns (whether it ran, its result)."""
        try:
            return True, fn()
        except Exception as exc:  # noqa: BLE001 one request's failure must not end the others'
            for request in sorted(requests, key=lambda r: -r.slot):  # packed slots: the highest first
                request.error = f"{type(exc).__name__}: {exc}"
                self._retire(request, FAILED, "error")
            return False, None

    def _emit(self, request: Request, tokens: list[int]) -> None:
        emitter = self._emitters[id(request)]
        request.token_times.append(time.perf_counter())
        if emitter.emit(tokens):
            request.stop_reason = emitter.reason
        request.tokens = emitter.tokens

    def _retire(self, request: Request, state: str, reason: str) -> None:
        slot, _ = self.scheduler.retire(request)
        self.runner.release(slot)
        self._emitters.pop(id(request), None)
        self.policy.retired(id(request))
        self._finish(request, state, reason)

    def _finish(self, request: Request, state: str, reason: str) -> None:
        request.state, request.stop_reason = state, reason
        if request.on_done is not None:
            request.on_done(request)

    def close(self) -> None:
        """Keeps what the policy learnt (the next process starts from it)."""
        self.policy.close()
        self._started = False

    def run(self, requests: list[Request], progress=None) -> list[Request]:
        """Serves these requests to the end, in this thread. progress(request) after each one ends."""
        for request in requests:
            if progress is not None:
                request.on_done = _then(request.on_done, progress)
            self.submit(request)
        try:
            return self.drain(requests)
        finally:
            self.close()

    def drain(self, requests: list[Request]) -> list[Request]:
        """Steps in this thread until these (submitted) requests are done. A step that fails fails
        every request it held (their slots are freed) before the error goes on."""
        try:
            while not all(r.done for r in requests):
                if not self.step():
                    raise RuntimeError("internal error: the engine stalled with requests left")
        except BaseException as exc:
            self._fail_all(f"{type(exc).__name__}: {exc}")
            raise
        return requests

    # ------------------------------------------------------------------ background serving

    def start(self) -> None:
        """The loop in a daemon thread: it sleeps while there is nothing to do."""
        if self._thread is not None:
            return
        self._begin()
        self._thread = threading.Thread(target=self._serve, name="treeflash-engine", daemon=True)
        self._thread.start()

    def running_in_background(self) -> bool:
        return self._thread is not None

    def alive(self) -> bool:
        """The background loop is serving (False before start, after stop, or once its thread died)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.close()

    def _serve(self) -> None:
        while not self._stopping:
            with self._lock:
                while self.scheduler.idle() and not self._stopping:
                    self._lock.wait()
            if self._stopping:
                break
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 a failed step fails its requests, never the server
                self._fail_all(f"{type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> None:
        for request in list(self.scheduler.slots):
            request.error = message
            self._retire(request, FAILED, "error")


def fixed_plans(runner, tree: TreeConfig, table: dict[int, int] | None = None) -> FixedPlans:
    """A fixed tree for every bucket of the runner (checked and resolved against its pair), smaller
    where ``table`` (batch size -> tree size, --tree-size-by-batch) says so."""
    tree = checked_tree(runner, tree)
    sizes = tree_sizes_by_bucket(runner.buckets, tree, table or {})
    return FixedPlans({b: dataclasses.replace(tree, tree_size=n) for b, n in sizes.items()})


def _then(first, second):
    def both(request):
        if first is not None:
            first(request)
        second(request)
    return both
