"""Client of the `treeflash` Triton model: a streamed generation over gRPC, or one response over
HTTP (Triton's generate endpoint: decoupled models take no plain HTTP infer requests).

Both return the same ServerResult; a server-side error becomes a ServerError (one line).
"""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from treeflash_export.errors import TreeFlashError
from treeflash_export.export.triton_repo import MODEL_NAME, NUMPY_DTYPES, SERVING_INPUTS



class ServerError(TreeFlashError):
    """The server refused the request or could not be reached."""


@dataclass
class ServerResult:
    text: str
    token_ids: list[int]
    new_tokens: int
    rounds: int
    mean_accepted: float
    stop_reason: str
    ttft_s: float = 0.0  # send -> first response
    elapsed_s: float = 0.0  # send -> final response
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since send, tokens) per response

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "arrivals"}


def request_inputs(prompt: str, max_tokens: int, *, stream: bool, temperature: float = 0.0, top_p: float = 1.0,
                   random_seed: int = 0, end_id: int | None = None, stop_words: tuple[str, ...] = ()) -> dict:
    """Input values by name (None/empty optional inputs are left out), in SERVING_INPUTS order."""
    values = {"text_input": [prompt], "max_tokens": [max_tokens], "stream": [stream], "temperature": [temperature],
              "top_p": [top_p], "random_seed": [random_seed], "end_id": None if end_id is None else [end_id],
              "stop_words": list(stop_words) or None}
    return {s.name: values[s.name] for s in SERVING_INPUTS if values[s.name] is not None}


def _as_array(name: str, values) -> np.ndarray:
    if isinstance(values, np.ndarray):  # sent as it is (tests send wrong dtypes on purpose)
        return values
    dtype = _dtype(name)
    if dtype == "string":
        values = [v.encode("utf-8") for v in values]
    return np.array([values], dtype=NUMPY_DTYPES[dtype])  # leading batch axis of 1


def _split_server(server: str) -> str:
    host, sep, port = server.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ServerError(f"--server {server!r} must be HOST:PORT")
    return server


def stream_grpc(server: str, inputs: dict, *, model: str = MODEL_NAME, timeout: float = 300.0,
                on_text: Callable[[str], None] | None = None) -> ServerResult:
    """One generation over a gRPC stream; ``on_text`` gets each new piece of text as it arrives."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    replies: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(_split_server(server))
    tensors = []
    for name, values in inputs.items():
        arr = _as_array(name, values)
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        tensors.append(t)
    pieces, ids, arrivals = [], [], []
    try:
        client.start_stream(callback=lambda result, error: replies.put((time.perf_counter(), result, error)))
        t0 = time.perf_counter()
        client.async_stream_infer(model, tensors)
        while True:
            try:
                at, result, error = replies.get(timeout=timeout)
            except queue.Empty:
                raise ServerError(f"no response from {server} within {timeout:.0f} s") from None
            if error is not None:
                raise ServerError(_message(error))
            piece = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
            new = result.as_numpy("output_ids").reshape(-1).tolist()
            pieces.append(piece)
            ids += new
            arrivals.append((at - t0, len(new)))
            if on_text is not None and piece:
                on_text(piece)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return ServerResult("".join(pieces), ids, *_stats(result.as_numpy), ttft_s=arrivals[0][0],
                                    elapsed_s=at - t0, arrivals=arrivals)
    except InferenceServerException as exc:
        # A broken stream says only that it is broken; the cause (e.g. a failed connection) went to the callback.
        raise ServerError(_message(_callback_error(replies) or exc)) from None
    finally:
        client.stop_stream()
        client.close()


def _callback_error(replies: queue.Queue, wait: float = 2.0):
    """The first error the stream's callback received within ``wait`` seconds, or None."""
    deadline = time.monotonic() + wait
    while True:
        try:
            _, _, error = replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if error is not None:
            return error


def generate_http(server: str, inputs: dict, *, model: str = MODEL_NAME, timeout: float = 300.0) -> ServerResult:
    """One non-streamed generation through Triton's HTTP generate endpoint."""
    body = {name: values if name == "stop_words" else values[0] for name, values in inputs.items()}
    body["stream"] = False
    return post_generate(server, body, model=model, timeout=timeout)


def post_generate(server: str, body: dict, *, model: str = MODEL_NAME, timeout: float = 300.0) -> ServerResult:
    """POST a JSON body to the model's generate endpoint (one response)."""
    req = urllib.request.Request(f"http://{_split_server(server)}/v2/models/{model}/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read()).get("error", str(exc))
        except ValueError:
            msg = str(exc)
        raise ServerError(msg) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"cannot reach {server}: {exc}") from None
    elapsed = time.perf_counter() - t0

    def get(name):
        v = out[name]
        return np.array(v if isinstance(v, list) else [v])

    ids = [int(i) for i in np.asarray(out["output_ids"]).reshape(-1)]
    return ServerResult(out["text_output"], ids, *_stats(get), ttft_s=elapsed, elapsed_s=elapsed,
                        arrivals=[(elapsed, len(ids))])


def _dtype(name: str) -> str:
    return next(s.dtype for s in SERVING_INPUTS if s.name == name)


def _stats(get) -> tuple[int, int, float, str]:
    reason = get("stop_reason").reshape(-1)[0]
    return (int(get("new_tokens").reshape(-1)[0]), int(get("rounds").reshape(-1)[0]),
            float(get("mean_accepted").reshape(-1)[0]), reason.decode() if isinstance(reason, bytes) else str(reason))


def _message(exc) -> str:
    msg = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    return " ".join(str(msg).split())
