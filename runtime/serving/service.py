"""Serving one request of the `treeflash` Triton model: parse and check its inputs, run the round
loop, stream replies. Free of Triton imports, so it runs (and is tested) without a server; the
model.py adapter in the repository only converts tensors and replies.

A request's tensors carry a leading batch axis of 1 (the model's max_batch_size is 1). Every
problem with a request is a RequestError whose message goes back to the client as the error
of that request; the model keeps serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from treeflash_export.config import SamplingConfig
from treeflash_export.errors import ConfigError, TreeFlashError
from treeflash_export.export.triton_repo import NUMPY_DTYPES, SERVING_INPUTS, SERVING_OUTPUTS

from ..factory import Session, session_from_artifacts
from ..loop import generate
from ..plan import largest_budget, required_capacity
from .text import IncrementalText, encode_prompt


class RequestError(TreeFlashError):
    """A request the model cannot serve; the message names the input and what is allowed."""


@dataclass(frozen=True)
class Inputs:
    """A Triton request's inputs, parsed and checked (the engine's request is scheduler.Request)."""

    prompt: str
    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    random_seed: int = 0
    end_id: int | None = None  # None: the model's EOS ids; -1: no end token
    stop_words: tuple[str, ...] = ()


@dataclass
class Reply:
    text: str  # streamed: this response's new text; otherwise the whole text
    token_ids: list[int]  # this response's tokens
    new_tokens: int  # so far
    rounds: int  # so far
    mean_accepted: float
    stop_reason: str = ""  # set on the final reply only
    final: bool = False

    def outputs(self) -> dict[str, np.ndarray]:
        """The response tensors, by SERVING_OUTPUTS name, each with a leading batch axis of 1."""
        values = {"text_output": [self.text.encode("utf-8")], "output_ids": self.token_ids,
                  "new_tokens": [self.new_tokens], "rounds": [self.rounds], "mean_accepted": [self.mean_accepted],
                  "stop_reason": [self.stop_reason.encode("utf-8")]}
        return {s.name: np.array([values[s.name]], dtype=NUMPY_DTYPES[s.dtype]).reshape(1, -1) for s in SERVING_OUTPUTS}


def _values(name: str, arr, dtype: str) -> list:
    arr = np.asarray(arr)
    if dtype == "string":
        if arr.dtype != object and arr.dtype.kind not in "SU":
            raise RequestError(f"input {name!r} must be TYPE_STRING, got {arr.dtype}")
        return [v.decode("utf-8", errors="strict") if isinstance(v, bytes) else str(v) for v in arr.reshape(-1)]
    if arr.dtype != NUMPY_DTYPES[dtype]:
        raise RequestError(f"input {name!r} must be {dtype}, got {arr.dtype}")
    return arr.reshape(-1).tolist()


def parse_request(inputs: dict[str, np.ndarray]) -> Inputs:
    """Tensors by name -> Inputs; names, dtypes and counts are checked against SERVING_INPUTS."""
    specs = {s.name: s for s in SERVING_INPUTS}
    unknown = sorted(set(inputs) - set(specs))
    if unknown:
        raise RequestError(f"unknown input {unknown[0]!r}; the inputs are {', '.join(specs)}")
    got = {}
    for name, spec in specs.items():
        if name not in inputs:
            if not spec.optional:
                raise RequestError(f"missing input {name!r} ({spec.doc})")
            continue
        try:
            vals = _values(name, inputs[name], spec.dtype)
        except UnicodeDecodeError:
            raise RequestError(f"input {name!r} is not valid UTF-8") from None
        if name != "stop_words" and len(vals) != 1:
            raise RequestError(f"input {name!r} must hold one value (a batch of one request), got {len(vals)}")
        got[name] = vals if name == "stop_words" else vals[0]
    if got["max_tokens"] < 1:
        raise RequestError(f"max_tokens must be >= 1, got {got['max_tokens']}")
    if not got["text_input"]:
        raise RequestError("text_input is empty")
    if got.get("end_id", 0) < -1:
        raise RequestError(f"end_id must be a token id, or -1 for none; got {got['end_id']}")
    if any(not w for w in got.get("stop_words", ())):
        raise RequestError("stop_words must not contain an empty string")
    return Inputs(got["text_input"], got["max_tokens"], bool(got.get("stream", False)),
                   float(got.get("temperature", 0.0)), float(got.get("top_p", 1.0)),
                   int(got.get("random_seed", 0)), got.get("end_id"), tuple(got.get("stop_words", ())))


@dataclass
class _Progress:
    calls: int = 0
    tokens: int = 0

    def stats(self) -> dict:
        rounds = max(self.calls - 1, 0)  # the first tokens come from prefill
        return {"new_tokens": self.tokens, "rounds": rounds,
                "mean_accepted": (self.tokens - 1) / rounds if rounds else 0.0}


class _Stream:
    """One request's replies: text pieces and tokens as rounds arrive (streamed), stop words, and
    the final reply with the statistics."""

    def __init__(self, req: Inputs, tokenizer, send: Callable[[Reply], None]):
        self.req, self.send = req, send
        self.text, self.progress = IncrementalText(tokenizer, req.stop_words), _Progress()

    def on_tokens(self, new: list[int]) -> bool:
        """New tokens; True when a stop word ends the request."""
        before = len(self.text.tokens)
        piece = self.text.add(new)
        kept = self.text.tokens[before:]  # after a stop word: only the tokens up to it
        self.progress.calls += 1
        self.progress.tokens += len(kept)
        if self.req.stream:
            self.send(Reply(piece, kept, **self.progress.stats()))
        return self.text.stopped

    def finish(self, stop_reason: str) -> Reply:
        rest, text, stats = self.text.flush(), self.text, self.progress.stats()
        final = Reply(rest if self.req.stream else text.text, [] if self.req.stream else list(text.tokens),
                      len(text.tokens), stats["rounds"], stats["mean_accepted"],
                      "stop_word" if text.stopped else stop_reason, final=True)
        self.send(final)
        return final


@dataclass
class Service:
    """One loaded session serving requests one at a time."""

    session: Session
    tree_size: int = field(init=False)

    def __post_init__(self):
        self.tree_size = self.session.tree.resolved(self.session.runner.block_size).tree_size

    @classmethod
    def from_artifact(cls, folder, backend: str, device: str = "auto", verify_checksums: bool = True) -> "Service":
        return cls(session_from_artifacts(str(folder), {}, backend=backend, device=device,
                                          verify_checksums=verify_checksums))

    def warm_up(self) -> None:
        self.handle({"text_input": np.array([[b"warm-up"]], dtype=object),
                     "max_tokens": np.array([[2]], dtype=np.int32)}, lambda reply: None)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        S, N = self.session.runner.capacity, self.tree_size
        if prompt_len + N > S:
            raise RequestError(f"the prompt is {prompt_len} tokens but this model's cache holds {S} (with a tree "
                               f"of {N}): at most {S - N} prompt tokens; shorten it, or serve an artifact built "
                               f"with a larger --max-seq-len")
        need = required_capacity(prompt_len, max_tokens, N)
        if need > S:
            raise RequestError(f"max_tokens {max_tokens} with a prompt of {prompt_len} tokens needs {need} cache "
                               f"slots but this model's cache holds {S}: ask for at most "
                               f"{largest_budget(prompt_len, N, S)} tokens")

    def prepare(self, inputs: dict[str, np.ndarray]) -> tuple[Inputs, list[int], SamplingConfig]:
        """A request's tensors -> (the request, its prompt ids, its sampling), or a RequestError."""
        req = parse_request(inputs)
        sess = self.session
        ids = encode_prompt(sess.tokenizer, req.prompt)
        self.check_fits(len(ids), req.max_tokens)
        if req.end_id is None:
            stops = sess.stop_token_ids
        else:
            stops = () if req.end_id == -1 else (req.end_id,)
        sampling = SamplingConfig(temperature=req.temperature, top_p=req.top_p, max_new_tokens=req.max_tokens,
                                  seed=req.random_seed, stop_token_ids=tuple(stops))
        try:
            sampling.validate()
        except ConfigError as exc:  # its messages name the CLI options: give the input names instead
            raise RequestError(str(exc).replace("--top-p", "top_p").replace("--", "")) from None
        return req, ids, sampling

    def handle(self, inputs: dict[str, np.ndarray], send: Callable[[Reply], None]) -> Reply:
        """Serve one request; ``send`` receives every reply (in streaming mode one per round, then a
        final one with the statistics; otherwise only the final one, with the whole text)."""
        req, ids, sampling = self.prepare(inputs)
        stream = _Stream(req, self.session.tokenizer, send)
        result = generate(self.session.runner, ids, self.session.tree, sampling, on_tokens=stream.on_tokens)
        return stream.finish(result.stop_reason)


class BatchedService(Service):
    """A session whose runner has request slots (backends.pytorch.TorchRunner): requests are handed to
    the in-flight batching engine, which serves them in a background thread; each streams through
    its own ``send`` (the Triton model's response sender)."""

    def __post_init__(self):
        super().__post_init__()
        from ..engine import Engine

        self.engine = Engine(self.session.runner, policy=self.session.tuner)
        self.tree_size = self.engine.max_tree_size

    @classmethod
    def from_artifact(cls, folder, backend: str = "torch", device: str = "auto", verify_checksums: bool = True, *,
                      max_batch: int = 8, tree_size_by_batch: dict[int, int] | None = None,
                      tune: bool = False) -> "BatchedService":
        """tune: the self-tuning tree chooses each round's tree within the artifact's (not with a table)."""
        return cls(session_from_artifacts(str(folder), {}, backend="torch", device=device,
                                          verify_checksums=verify_checksums, max_batch=max_batch,
                                          tree_size_by_batch=tree_size_by_batch,
                                          tune=tune and not tree_size_by_batch))

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def submit(self, inputs: dict[str, np.ndarray], send: Callable[[Reply], None],
               on_error: Callable[[str], None], cancelled: Callable[[], bool] | None = None):
        """Queues one request and returns at once (a bad request raises RequestError here). Its replies
        go to ``send``; if the engine fails it, ``on_error`` gets the message instead of a final reply."""
        from ..engine import FAILED, Request as EngineRequest

        req, ids, sampling = self.prepare(inputs)
        stream = _Stream(req, self.session.tokenizer, send)

        def done(r):
            if r.state == FAILED:
                on_error(f"internal error: {r.error}")
            else:
                stream.finish(r.stop_reason)

        return self.engine.submit(EngineRequest(ids, sampling, on_tokens=stream.on_tokens, on_done=done,
                                                cancelled_by=cancelled))

    def handle(self, inputs: dict[str, np.ndarray], send: Callable[[Reply], None]) -> Reply:
        """One request served to the end in this thread (warm-up, tests): through the engine."""
        finals, errors = [], []
        request = self.submit(inputs, lambda reply: (send(reply), reply.final and finals.append(reply)), errors.append)
        if not self.engine.running_in_background():
            self.engine.drain([request])
        while not request.done:  # the background loop serves it
            time.sleep(0.005)
        if errors:
            raise TreeFlashError(errors[0])
        return finals[-1]

