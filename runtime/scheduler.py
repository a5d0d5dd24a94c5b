"""In-flight batching: who runs, in which slot, and what the next step does. No tensors here.

A request's life is explicit: waiting -> prefilling -> running -> finished (or cancelled, or
failed). Between rounds the scheduler admits waiting requests into free slots (slots stay
packed: the occupied ones are 0..occupied-1) and retires finished ones at once; a long prompt
is prefilled in chunks between the running slots' rounds (at most ``prefill_chunk`` prompt tokens
a step while others run), so running streams are never stalled by a newcomer's whole prompt.
The runner (backends.base.Runner) owns the device state; the engine (treeflash_runtime.engine)
connects the two.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from treeflash_export.config import SamplingConfig

WAITING, PREFILLING, RUNNING, FINISHED, CANCELLED, FAILED = (
    "waiting", "prefilling", "running", "finished", "cancelled", "failed")
DONE = (FINISHED, CANCELLED, FAILED)


@dataclass(eq=False)
class Request:
    """One generation. on_tokens(new) streams its tokens and may return True to end it (stop words,
    a closed stream); on_done(request) is called once when it leaves (finished, cancelled, failed)."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    on_tokens: Callable[[list[int]], bool | None] | None = None
    on_done: Callable[["Request"], None] | None = None
    state: str = WAITING
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the slot's caches
    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per round
    drafted: list[int] = field(default_factory=list)  # draft nodes verified per round (0: plain decoding)
    stop_reason: str = ""
    error: str = ""
    cancel_requested: bool = False
    cancelled_by: Callable[[], bool] | None = None  # polled each step, e.g. the Triton stream's is_cancelled
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each round's tokens arrived

    @property
    def done(self) -> bool:
        return self.state in DONE

    def wants_cancel(self) -> bool:
        if not self.cancel_requested and self.cancelled_by is not None and self.cancelled_by():
            self.cancel_requested = True
        return self.cancel_requested


@dataclass
class PrefillChunk:
    request: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.request.prompt_ids)


class Scheduler:
    def __init__(self, max_batch: int, prefill_chunk: int):
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.slots: list[Request] = []  # occupied slots, packed: slots[i].slot == i

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def occupied(self) -> int:
        return len(self.slots)

    def idle(self) -> bool:
        return not self.waiting and not self.slots

    def admit(self) -> list[Request]:
        """Waiting requests take the free slots, oldest first; they start prefilling."""
        admitted = []
        while self.waiting and len(self.slots) < self.max_batch:
            request = self.waiting.popleft()
            if request.wants_cancel():
                request.state = CANCELLED
                admitted.append(request)  # the engine reports it done; it holds no slot
                continue
            request.slot, request.state = len(self.slots), PREFILLING
            self.slots.append(request)
            admitted.append(request)
        return admitted

    def prefills(self) -> list[PrefillChunk]:
        """This step's prefill chunks, oldest prompt first. While others run, the chunks share a budget
        of ``prefill_chunk`` tokens (so a round waits for that much prefill at most, and short prompts
        all start at once); when none runs, every prompt still being prefilled gets its next chunk."""
        budget = self.prefill_chunk if self.running() else None
        chunks = []
        for r in self.slots:
            if r.state != PREFILLING:
                continue
            size = self.prefill_chunk if budget is None else min(self.prefill_chunk, budget)
            if size <= 0:
                break
            chunk = PrefillChunk(r, r.prefilled, min(r.prefilled + size, len(r.prompt_ids)))
            chunks.append(chunk)
            if budget is not None:
                budget -= chunk.end - chunk.start
        return chunks

    def withdraw(self, request: Request) -> bool:
        """Takes a request that still waits for a slot out of the queue (its client left): True if it
        was waiting, and it is cancelled now; False if it already holds a slot or has ended."""
        if request.state != WAITING:
            return False
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        request.state = CANCELLED
        return True

    def running(self) -> list[Request]:
        return [r for r in self.slots if r.state == RUNNING]

    def retire(self, request: Request) -> tuple[int, int]:
        """Takes a finished request out of its slot: returns (its slot, occupied before), for the
        runner's release; the last occupied request moves into the freed slot."""
        slot, occupied = request.slot, len(self.slots)
        last = self.slots.pop()
        if last is not request:
            self.slots[slot] = last
            last.slot = slot
        request.slot = None
        return slot, occupied
