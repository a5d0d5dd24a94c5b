"""The engine loop: each step admits, prefills this step's prompt chunks in one pass, runs one
batched round over the occupied slots, streams every running request's new tokens and retires the
finished ones.

``run`` serves a list of requests to the end (offline batches, the in-process benchmark);
``start`` runs the loop in a background thread that serves requests submitted from other
threads (the Triton model's ``execute``), as the Triton vLLM backend does.
"""

from __future__ import annotations

import threading
import time

import torch

from treeflash_export.errors import ConfigError

from ..loop import Emitter, required_capacity
from .scheduler import CANCELLED, FAILED, FINISHED, RUNNING, Request, Scheduler


class Engine:
    def __init__(self, runner, prefill_chunk: int = 256, max_active: int | None = None, tuner=None):
        """runner: a backends.torch_backend.TorchRunner with its deployment tree; max_active: requests served at once (default and at
        most its max_batch, the number of slots); tuner: the self-tuning tree
        (treeflash_runtime.tuner.online.TreeTuner), which picks each round's tree for its batch bucket
        within the deployment's tree (None: the deployment's tree and its tree sizes by batch)."""
        self.runner, self.tuner = runner, tuner
        if tuner is not None:
            tuner.serve(runner)
        self.scheduler = Scheduler(min(max_active or runner.max_batch, runner.max_batch), prefill_chunk)
        self._emitters: dict[int, Emitter] = {}
        self.rounds_by_batch: dict[int, int] = {}  # running slots in a round -> rounds run so far
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ requests

    def check(self, request: Request) -> None:
        """A request that cannot run is refused before it takes a slot (one error for it alone)."""
        request.sampling.validate()
        n = len(request.prompt_ids)
        if n < 1:
            raise ConfigError("the prompt is empty")
        tree_size = self.runner.max_tree_size
        need = required_capacity(n, request.sampling.max_new_tokens, tree_size)
        if need > self.runner.capacity:
            most = self.runner.capacity - n + 1 - tree_size
            raise ConfigError(f"prompt ({n}) + max new tokens ({request.sampling.max_new_tokens}) + tree ({tree_size}) "
                              f"needs {need} cache slots but a slot holds {self.runner.capacity}: "
                              + (f"ask for at most {most} tokens" if most >= 1 else "shorten the prompt"))

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

    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        with self._lock:
            admitted = self.scheduler.admit()
        sched, runner = self.scheduler, self.runner
        for request in admitted:
            if request.state == CANCELLED:
                self._finish(request, CANCELLED, "cancelled")
                continue
            if not self._isolated([request], lambda: runner.admit(request.slot, request.sampling))[0]:
                continue
            self._emitters[id(request)] = Emitter(request.sampling, request.on_tokens)
            if self.tuner is not None:
                self.tuner.admitted(id(request), alone=sched.occupied == 1)
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
            if self.tuner is not None:
                b = runner.bucket_for(sched.occupied)
                runner.set_bucket_tree(b, self.tuner.next_tree(b, [id(r) for r in running]))
            t_round = time.perf_counter()
            gained = runner.step(sched.occupied)
            if self.tuner is not None:
                self.tuner.round_took(time.perf_counter() - t_round, b)
            self.rounds_by_batch[len(running)] = self.rounds_by_batch.get(len(running), 0) + 1
            tree = runner._bucket_tree(runner.bucket_for(sched.occupied))  # the tree this round verified
            for request in running:
                request.accept_lengths.append(len(gained[request.slot]))
                request.drafted.append(0 if tree.mode == "ar" else tree.tree_size - 1)
                if self.tuner is not None:
                    self.tuner.after_round(runner, request.slot, len(gained[request.slot]), gained[request.slot],
                                           request=id(request))
                self._emit(request, gained[request.slot])
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
        slot, occupied = self.scheduler.retire(request)
        self.runner.release(slot, occupied)
        self._emitters.pop(id(request), None)
        if self.tuner is not None:
            self.tuner.retired(id(request))
        self._finish(request, state, reason)

    def _finish(self, request: Request, state: str, reason: str) -> None:
        request.state, request.stop_reason = state, reason
        if request.on_done is not None:
            request.on_done(request)

    def close(self) -> None:
        """Keeps what the self-tuning tree learnt (the next process starts from it) and turns its extra
        work off on the runner (node reports, the drafter's context in plain steps)."""
        if self.tuner is not None:
            self.tuner.save()
            self.tuner.release(self.runner)

    def run(self, requests: list[Request], progress=None) -> list[Request]:
        """Serves these requests to the end, in this thread. progress(request) after each one ends."""
        if self.tuner is not None:  # again after an earlier run's close
            self.tuner.serve(self.runner)
        for request in requests:
            if progress is not None:
                request.on_done = _then(request.on_done, progress)
            self.submit(request)
        try:
            return self.drain(requests)
        finally:
            self.close()

    def drain(self, requests: list[Request]) -> list[Request]:
        """Steps in this thread until these (submitted) requests are done."""
        while not all(r.done for r in requests):
            if not self.step():
                raise RuntimeError("internal error: the engine stalled with requests left")
        return requests

    # ------------------------------------------------------------------ background serving

    def start(self) -> None:
        """The loop in a daemon thread: it sleeps while there is nothing to do."""
        if self._thread is not None:
            return
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


def _then(first, second):
    def both(request):
        if first is not None:
            first(request)
        second(request)
    return both
