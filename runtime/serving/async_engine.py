"""The in-flight batching engine seen from asyncio (the OpenAI server's side).

The engine loop runs in its own thread (``Engine.start``). A request's callbacks run in that thread:
they decode the new tokens (``text.StopText``: stop strings end the request in the same step) and
hand each piece to the request's asyncio queue with ``loop.call_soon_threadsafe``, so no handler
ever waits on the engine while holding the event loop. Cancelling (a client gone) marks the request
and the engine retires it at its next step, which frees its slot for a waiting request.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from treeflash_export.config import SamplingConfig
from treeflash_export.errors import ConfigError

from ..engine import Engine
from ..plan import largest_budget
from .metrics import ServingMetrics
from .openai_protocol import FINISH, APIError, usage
from ..scheduler import CANCELLED, FAILED, WAITING, Request
from .text import StopText


@dataclass
class Outcome:
    finish_reason: str  # stop | length | cancelled | error
    usage: dict  # OpenAI's usage with the treeflash field
    error: str = ""


class Generation:
    """One request from the event loop's side: ``pieces()`` yields its text as rounds arrive, then
    ``outcome`` holds how it ended."""

    def __init__(self, owner: "AsyncEngine", request: Request, text: StopText):
        self.owner, self.request, self.text = owner, request, text
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Outcome | None]] = asyncio.Queue()
        self.outcome: Outcome | None = None

    async def pieces(self):
        while self.outcome is None:
            piece, outcome = await self.queue.get()
            if piece:
                yield piece
            self.outcome = outcome

    async def result(self) -> tuple[str, Outcome]:
        return "".join([p async for p in self.pieces()]), self.outcome

    def cancel(self) -> None:
        if not self.request.done:
            self.owner.engine.cancel(self.request)

    # ------------------------------------------------------------------ the engine thread's side

    def on_tokens(self, new: list[int]) -> bool:
        piece = self.text.add(new)
        if piece:
            self._post(piece, None)
        return self.text.stopped  # a stop string ends the request at once

    def on_done(self, request: Request) -> None:
        tail = "" if request.state in (CANCELLED, FAILED) else self.text.flush()
        self._post(tail, self.owner.finished(self, request))

    def _post(self, piece: str, outcome: Outcome | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (piece, outcome))
        except RuntimeError:  # the event loop is closed: the server is gone and nobody is listening
            pass


class AsyncEngine:
    def __init__(self, session, metrics: ServingMetrics, max_queue: int):
        """session: a Session whose runner has request slots (session_from_checkpoints(..., max_batch=B))."""
        self.session, self.metrics, self.max_queue = session, metrics, max_queue
        self.engine = Engine(session.runner, policy=session.tuner)
        self.in_flight: set[Generation] = set()

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Starts the loop thread and serves one short generation (so /health means it works)."""
        self.engine.start()
        warm = Request(self.session.tokenizer("warm-up")["input_ids"] or [0], SamplingConfig(max_new_tokens=2))
        self.engine.submit(warm)
        while not warm.done:
            time.sleep(0.005)
        if warm.state == FAILED:
            raise ConfigError(f"the warm-up generation failed: {warm.error}")

    def alive(self) -> bool:
        return self.engine.alive()

    def stop(self, grace_s: float = 5.0) -> None:
        """Cancels what still runs, lets the engine retire it (up to grace_s), and stops the loop."""
        for gen in list(self.in_flight):
            gen.cancel()
        deadline = time.monotonic() + grace_s
        while any(not g.request.done for g in list(self.in_flight)) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.engine.stop()

    def running(self) -> int:
        return sum(1 for g in list(self.in_flight) if not g.request.done and g.request.state != WAITING)

    def waiting(self) -> int:
        return sum(1 for g in list(self.in_flight) if g.request.state == WAITING)

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids: list[int], req) -> Generation:
        """req: a checked CompletionRequest or ChatCompletionRequest. Refusals are APIErrors."""
        runner = self.session.runner
        if len(self.in_flight) >= runner.max_batch + self.max_queue:  # every slot taken and the queue full
            raise APIError(429, f"the queue is full ({runner.max_batch} requests run, {self.max_queue} wait for a "
                                f"slot): retry later", type="rate_limit_error", code="queue_full")
        bad = next((t for t in prompt_ids if not 0 <= t < runner.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary (0..{runner.vocab_size - 1})",
                           param="prompt")
        n, capacity, tree = len(prompt_ids), runner.capacity, self.engine.max_tree_size
        most = largest_budget(n, tree, capacity)
        if most < 1:
            raise APIError(400, f"the prompt is {n} tokens but a request slot holds {capacity} with a tree of "
                                f"{tree}: at most {capacity - tree} prompt tokens; shorten it, or serve with a larger "
                                f"--max-seq-len", param="messages" if hasattr(req, "messages") else "prompt",
                           code="context_length_exceeded")
        budget = req.new_tokens() or most
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        stops = () if req.ignore_eos else tuple(self.session.stop_token_ids)
        sampling = SamplingConfig(temperature=req.temperature, top_p=req.top_p, max_new_tokens=budget, seed=seed,
                                  stop_token_ids=stops)
        request = Request(list(prompt_ids), sampling)
        gen = Generation(self, request, StopText(self.session.tokenizer, req.stop_strings))
        request.on_tokens, request.on_done = gen.on_tokens, gen.on_done
        self.in_flight.add(gen)  # before the engine thread can end it
        try:
            self.engine.submit(request)  # checks that it fits before it takes a slot
        except ConfigError as exc:
            self.in_flight.discard(gen)
            raise APIError(400, str(exc).replace("max new tokens", "max_tokens"), param="max_tokens",
                           code="context_length_exceeded") from None
        return gen

    def finished(self, gen: Generation, request: Request) -> Outcome:
        """In the engine thread, once per request: its outcome, recorded in the metrics."""
        self.in_flight.discard(gen)
        completion = len(gen.text.tokens)
        lengths = request.accept_lengths
        rounds, gained = len(lengths), sum(lengths)
        spec = {"rounds": rounds, "drafted_nodes": sum(request.drafted), "accepted_tokens": gained - rounds,
                "mean_tokens_per_round": gained / rounds if rounds else 0.0}
        if request.state == FAILED:
            reason = "error"
        elif request.state == CANCELLED:
            reason = "cancelled"
        else:
            reason = FINISH.get(request.stop_reason, "stop")
        times = request.token_times
        first = request.first_token_at
        self.metrics.record(reason, len(request.prompt_ids), completion, spec,
                            ttft_s=first - request.submitted_at if first else None,
                            itl_s=(times[-1] - first) / (completion - 1) if first and completion > 1 else None,
                            e2e_s=times[-1] - request.submitted_at if times else None)
        return Outcome(reason, usage(len(request.prompt_ids), completion, spec), request.error)
