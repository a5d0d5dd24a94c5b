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
from .text import StopText, longest_token_chars


@dataclass
class Outcome:
    finish_reason: str  # stop | length | cancelled | error
    usage: dict  # OpenAI's usage with the treeflash field
    error: str = ""  # with finish_reason "error": the message, its HTTP status, OpenAI error type and code
    status: int = 500
    type: str = "server_error"
    code: str | None = None


@dataclass(frozen=True)
class Abort:
    """Why the server ended a request itself (a timeout, a shutdown): what its client is told."""

    message: str
    status: int
    code: str
    metric: str  # its finish_reason in the metrics


def spec_stats(accept_lengths: list[int], drafted: list[int]) -> dict:
    """A request's speculative figures from its rounds (tokens gained, drafted nodes verified): the usage's
    ``treeflash`` field. A round that verified no drafted node (plain decoding) is not a draft."""
    rounds, gained = len(accept_lengths), sum(accept_lengths)
    hist: dict[int, int] = {}
    for g, d in zip(accept_lengths, drafted):
        if d > 0:
            hist[g - 1] = hist.get(g - 1, 0) + 1
    drafts, draft_tokens, accepted = sum(hist.values()), sum(drafted), gained - rounds
    return {"rounds": rounds, "drafted_nodes": draft_tokens, "accepted_tokens": accepted,
            "mean_tokens_per_round": gained / rounds if rounds else 0.0,
            "num_drafts": drafts,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
            "rounds_by_tree_nodes": _count(d + 1 for d in drafted)}


def _count(values) -> dict[str, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return {str(k): out[k] for k in sorted(out)}


class Generation:
    """One request from the event loop's side: ``pieces()`` yields its text as rounds arrive, then
    ``outcome`` holds how it ended."""

    def __init__(self, owner: "AsyncEngine", request: Request, text: StopText):
        self.owner, self.request, self.text = owner, request, text
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Outcome | None]] = asyncio.Queue()
        self.outcome: Outcome | None = None
        self.aborted: Abort | None = None
        self.timer: asyncio.TimerHandle | None = None  # the request timeout

    async def pieces(self):
        while self.outcome is None:
            piece, outcome = await self.queue.get()
            if piece:
                yield piece
            self.outcome = outcome
        if self.timer is not None:
            self.timer.cancel()

    async def result(self) -> tuple[str, Outcome]:
        return "".join([p async for p in self.pieces()]), self.outcome

    def cancel(self) -> None:
        if not self.request.done:
            self.owner.engine.cancel(self.request)

    def abort(self, why: Abort) -> None:
        """Ends the request with an error its client is told (unless it has ended already)."""
        if not self.request.done and self.aborted is None:
            self.aborted = why
            self.cancel()

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
    def __init__(self, session, metrics: ServingMetrics, max_queue: int, request_timeout: float | None = None):
        """session: a Session whose runner has request slots (session_from_checkpoints(..., max_batch=B));
        request_timeout: seconds from submission after which a request ends with an error (None: never)."""
        self.session, self.metrics, self.max_queue = session, metrics, max_queue
        self.request_timeout = request_timeout
        self.engine = Engine(session.runner, policy=session.tuner)
        self.in_flight: set[Generation] = set()
        runner = session.runner
        self.max_prompt_tokens = runner.capacity - self.engine.max_tree_size
        # No text longer than this is tokenized: it cannot fit (text.longest_token_chars)
        self.max_prompt_chars = max(self.max_prompt_tokens, 0) * longest_token_chars(session.tokenizer)
        metrics.positions(runner.block_size - 1)

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

    def abort_all(self, why: Abort) -> None:
        """Ends every request in flight, running or waiting, with an error its client is told."""
        for gen in list(self.in_flight):
            gen.abort(why)

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
        self.check_prompt_length(len(prompt_ids), req)  # before looking at every id
        bad = next((t for t in prompt_ids if not 0 <= t < runner.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary (0..{runner.vocab_size - 1})",
                           param="prompt")
        budget = req.new_tokens() or largest_budget(len(prompt_ids), self.engine.max_tree_size, runner.capacity)
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        stops = () if req.ignore_eos else tuple(self.session.stop_token_ids)
        sampling = SamplingConfig(temperature=req.temperature, top_p=req.engine_top_p, max_new_tokens=budget,
                                  seed=seed, stop_token_ids=stops)
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
        if self.request_timeout is not None:
            gen.timer = gen.loop.call_later(self.request_timeout, gen.abort, Abort(
                f"the request took longer than --request-timeout ({self.request_timeout:g} s) and was cancelled",
                408, "request_timeout", "timeout"))
        return gen

    def check_prompt_length(self, n: int, req, unit: str = "tokens") -> None:
        """A prompt of n tokens (or, with unit "characters", a text of n characters, which holds at least
        n / longest_token_chars tokens) that cannot fit a slot is refused. req: the request or its class."""
        runner = self.session.runner
        most = self.max_prompt_tokens if unit == "tokens" else self.max_prompt_chars
        if n > most:
            capacity, tree = runner.capacity, self.engine.max_tree_size
            chat = "messages" in (req if isinstance(req, type) else type(req)).model_fields
            raise APIError(400, f"the prompt is {n} {unit} but a request slot holds {capacity} tokens with a tree "
                                f"of {tree}: at most {capacity - tree} prompt tokens"
                                + ("" if unit == "tokens" else f" (at most {most} characters)")
                                + "; shorten it, or serve with a larger --max-seq-len",
                           param="messages" if chat else "prompt", code="context_length_exceeded")

    def finished(self, gen: Generation, request: Request) -> Outcome:
        """In the engine thread, once per request: its outcome, recorded in the metrics."""
        self.in_flight.discard(gen)
        completion = len(gen.text.tokens)
        spec = spec_stats(request.accept_lengths, request.drafted)
        metric, outcome = None, {}
        if request.state == FAILED:
            reason, outcome = "error", {"error": f"internal error: {request.error}"}
        elif request.state == CANCELLED and gen.aborted is not None:
            why = gen.aborted
            reason, metric = "error", why.metric
            outcome = {"error": why.message, "status": why.status, "code": why.code,
                       "type": "timeout_error" if why.status == 408 else "server_error"}
        elif request.state == CANCELLED:
            reason = "cancelled"
        else:
            reason = FINISH.get(request.stop_reason, "stop")
        times, first = request.token_times, request.first_token_at
        self.metrics.record(metric or reason, len(request.prompt_ids), completion, spec,
                            ttft_s=first - request.submitted_at if first else None,
                            itl_s=_token_gaps(times, [1, *request.accept_lengths], completion),
                            e2e_s=times[-1] - request.submitted_at if times else None,
                            accept_lengths=request.accept_lengths)
        return Outcome(reason, usage(len(request.prompt_ids), completion, spec), **outcome)


def _token_gaps(times: list[float], counts: list[int], completion: int) -> list[float]:
    """One inter-token latency per returned token after the first: a round that brought k tokens t seconds
    after the one before gives k gaps of t / k (tokens past a stop or the budget are not returned)."""
    gaps, left = [], completion - 1
    for i in range(1, min(len(times), len(counts))):
        k = min(counts[i], left)
        if k <= 0:
            break
        gaps += [(times[i] - times[i - 1]) / counts[i]] * k
        left -= k
    return gaps
