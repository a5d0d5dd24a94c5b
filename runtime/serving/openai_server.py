"""`treeflash-serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the in-flight
batching engine on the torch backend.

The app only wires routes, errors and the model's life: requests are checked in openai_protocol,
handed to the engine thread through async_engine, and streamed back as server-sent events. The
model loads in a thread after the server listens, so /health answers 503 until the first (warm-up)
generation works. Bodies are JSON only and bounded (--max-request-bytes) before they are parsed. On
SIGTERM uvicorn stops accepting connections and the requests in flight get --shutdown-timeout seconds;
then each still running or waiting ends with an error its client sees (an error event and [DONE], or a
503), and the engine stops.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import sys
import threading
import time
from typing import Callable

import click

from treeflash_export.errors import ConfigError, TreeFlashError

try:  # the serve extra; this module is the server, so it needs them from the start
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from fastapi.routing import APIRoute
    from starlette.exceptions import HTTPException
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"treeflash-serve needs the serve extra: pip install 'treeflash-export[serve]' ({exc})") from exc

from ..options import check_model_options, load_session, model_options
from .openai_protocol import (MAX_REQUEST_BYTES, APIError, ChatCompletionRequest, CompletionRequest, chunk_body,
                              completion_body, error_body, new_id, parse)


class _Route(APIRoute):
    """A /v1 route whose unexpected exception (a bug) is logged and answered as an APIError: Starlette's
    handler for Exception re-raises after answering, and uvicorn then drops the kept-alive connection,
    which a pooled client's next request would find closed."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request):
            try:
                return await handler(request)
            except (APIError, HTTPException, RequestValidationError):
                raise
            except Exception as exc:  # noqa: BLE001 turned into the request's error, traceback logged
                logging.getLogger("uvicorn.error").exception("treeflash-serve: internal error")
                raise APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error") from None

        return guarded


class ServerState:
    """What the routes read: the served name, the engine once loaded, why not otherwise."""

    def __init__(self, served_model: str, api_key: str | None, closing: Callable[[], bool]):
        self.served_model, self.api_key, self.closing = served_model, api_key, closing
        self.engine = None  # an AsyncEngine once the model is loaded and warm
        self.load_error: str | None = None

    def ready(self):
        """The engine, or a 503 that says why not."""
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", type="server_error",
                           code="load_failed")
        if self.engine is None:
            raise APIError(503, "the model is loading: retry shortly", type="server_error", code="loading")
        if self.closing():
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if not self.engine.alive():
            raise APIError(503, "the engine has stopped", type="server_error", code="engine_dead")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.served_model!r}",
                           param="model", code="model_not_found")


def create_app(load: Callable[[], object], served_model: str, *, api_key: str | None = None, max_queue: int = 128,
               closing: Callable[[], bool] = lambda: False, on_load_error: Callable[[str], None] | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, request_timeout: float | None = None,
               shutdown_timeout: float | None = None):
    """load() -> a Session with request slots; it runs in a thread once the server is up. Once closing()
    turns true, requests still in flight after shutdown_timeout seconds end with an error (None: never)."""
    from contextlib import asynccontextmanager

    from .async_engine import Abort, AsyncEngine
    from .metrics import CONTENT_TYPE, ServingMetrics

    state = ServerState(served_model, api_key, closing)
    metrics = ServingMetrics(running=lambda: state.engine.running() if state.engine else 0,
                             waiting=lambda: state.engine.waiting() if state.engine else 0, model_name=served_model)

    def load_in_thread():
        try:
            engine = AsyncEngine(load(), metrics, max_queue, request_timeout)
            engine.start()
            state.engine = engine
            logging.getLogger("uvicorn.error").info("treeflash-serve: %r is ready", served_model)
        except Exception as exc:  # noqa: BLE001 any failure to load is reported, by /health and the CLI
            state.load_error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, TreeFlashError) else str(exc)
            if on_load_error is not None:
                on_load_error(state.load_error)

    async def end_after_shutdown_timeout():
        """Once the server is closing, what still runs after shutdown_timeout ends with an error event (and
        [DONE]) or a 503 (uvicorn's own deadline, a little later, would cut the streams mid-body)."""
        while not closing():
            await asyncio.sleep(0.05)
        await asyncio.sleep(shutdown_timeout)
        if state.engine is not None:
            state.engine.abort_all(Abort(f"the server is shutting down (--shutdown-timeout {shutdown_timeout:g} s "
                                         f"passed)", 503, "shutting_down", "shutdown"))

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=load_in_thread, name="treeflash-load", daemon=True).start()
        ender = asyncio.create_task(end_after_shutdown_timeout()) if shutdown_timeout is not None else None
        yield
        if ender is not None:
            ender.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop)

    key = None if api_key is None else f"Bearer {api_key}".encode()

    def check_key(request: Request) -> None:
        # a constant-time compare: the time taken says nothing about how much of a guess was right
        if key is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(), key):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def read_request(request: Request, model, engine):
        """The body as a checked request: JSON only (a page in a browser cannot send it without a CORS
        preflight), at most max_request_bytes, refused before parsing (by Content-Length, or counted while
        it arrives)."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json, got {media or 'none'!r}",
                           code="unsupported_media_type")
        too_large = APIError(413, f"the request body is larger than --max-request-bytes ({max_request_bytes} bytes)",
                             code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            raise too_large
        body, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise too_large
            body.append(chunk)
        return parse(model, b"".join(body), engine.check_prompt_length)

    app = FastAPI(title="treeflash-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)], route_class=_Route)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        # a body left unread (too large) cannot be skipped on a kept-alive connection: say it closes
        headers = {"Connection": "close"} if exc.status == 413 else None
        return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # unknown routes and methods, in OpenAI's shape
        what = "not_found" if exc.status_code == 404 else None
        return await api_error(request, APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                 f"{exc.detail}", code=what))

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):  # a bug: still OpenAI's shape (uvicorn logs the traceback)
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                 type="server_error"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return await api_error(request, APIError(400, str(exc.errors()[0].get("msg", exc))))

    @app.get("/health")
    async def health():
        state.ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": state.served_model, "object": "model", "created": int(time.time()), "owned_by": "treeflash"}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def model(name: str):
        state.check_model(name)
        return model_card()

    @v1.post("/completions")
    async def completions(request: Request):
        engine = state.ready()
        req = await read_request(request, CompletionRequest, engine)
        state.check_model(req.model)
        prompt = req.prompt_input()
        from .text import encode_prompt

        if isinstance(prompt, str):  # no text is tokenized that could not fit
            engine.check_prompt_length(len(prompt), req, unit="characters")
        ids = prompt if isinstance(prompt, list) else await asyncio.to_thread(
            encode_prompt, engine.session.tokenizer, prompt)
        return await _respond(request, engine.submit(ids, req), req, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        from jinja2 import TemplateError

        from .text import encode_chat

        engine = state.ready()
        req = await read_request(request, ChatCompletionRequest, engine)
        state.check_model(req.model)
        messages = [m.to_template() for m in req.messages]
        engine.check_prompt_length(sum(len(m["content"]) for m in messages), req, unit="characters")
        try:
            ids = await asyncio.to_thread(encode_chat, engine.session.tokenizer, messages)
        except (ConfigError, TemplateError) as exc:
            raise APIError(400, f"messages: the chat template refused them ({exc})", param="messages") from None
        return await _respond(request, engine.submit(ids, req), req, chat=True)

    async def _respond(request: Request, gen, req, chat: bool):
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, gen))
        if req.stream:
            return StreamingResponse(_events(gen, req, chat, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text, outcome = await gen.result()
        finally:
            watcher.cancel()
            gen.cancel()  # the handler itself was cancelled: the request goes too
        if outcome.finish_reason == "error":
            raise _outcome_error(outcome)
        rid = new_id("chatcmpl" if chat else "cmpl")
        return completion_body(rid, state.served_model, text, outcome.finish_reason, outcome.usage, chat)

    async def _events(gen, req, chat: bool, watcher):
        rid, model, first = new_id("chatcmpl" if chat else "cmpl"), state.served_model, True
        try:
            async for piece in gen.pieces():
                yield _sse(chunk_body(rid, model, piece, None, chat, role=first))
                first = False
            outcome = gen.outcome
            if outcome.finish_reason == "cancelled":
                return  # the client is gone
            if outcome.finish_reason == "error":
                yield _sse(error_body(_outcome_error(outcome)))
            else:
                yield _sse(chunk_body(rid, model, None if chat else "", outcome.finish_reason, chat, role=first))
                if req.include_usage:
                    yield _sse(chunk_body(rid, model, None, None, chat, use=outcome.usage))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            gen.cancel()

    app.include_router(v1)
    app.state.treeflash = state
    return app


def _outcome_error(outcome) -> APIError:
    return APIError(outcome.status, outcome.error, type=outcome.type, code=outcome.code)


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(receive, gen) -> None:
    """Waits for the client to go (the request body is already read) and cancels its generation."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gen.cancel()
            return


# ---------------------------------------------------------------- the command


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@model_options
@click.option("--max-batch", type=int, default=8, help="Requests served at once (request slots, each with its own "
              "--max-seq-len cache, all allocated up front); more wait in a queue.")
@click.option("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000)
@click.option("--api-key", default=None, envvar="TREEFLASH_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 routes (also read from TREEFLASH_API_KEY).")
@click.option("--served-model-name", default=None,
              help="The model name clients send. [default: --model, the artifact folder, or SmolLM2-135M-Instruct]")
@click.option("--max-queue", type=int, default=128, help="Requests that may wait for a slot; more get a 429.")
@click.option("--shutdown-timeout", type=float, default=30.0,
              help="On SIGTERM or Ctrl-C: seconds running requests get to finish; then each ends with an error "
              "(streams: an error event and [DONE]; others: 503).")
@click.option("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
              help="Largest request body accepted; a larger one gets 413 before it is read or parsed.")
@click.option("--request-timeout", type=float, default=None,
              help="Seconds a request may take from its arrival, queueing included; then it is cancelled and "
              "ends with an error (408; streams: an error event and [DONE]). [default: none]")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info")
def main(model, drafter, artifacts, verify_checksums, mode, tree_size, top_m, top_k, retune, draft_vocab,
         drafter_temperature,
         max_seq_len, device, dtype, cuda_graphs, fast_kernels, max_batch, host, port, api_key, served_model_name, max_queue,
         shutdown_timeout, max_request_bytes, request_timeout, log_level):
    """Serve a TreeFlash pair with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics). Without --model it serves SmolLM2-135M-Instruct with the demo drafter, offline."""
    import uvicorn

    try:
        check_model_options(model, drafter, artifacts, mode, max_seq_len)
        if max_batch < 1 or max_queue < 0:
            raise TreeFlashError(f"--max-batch must be >= 1 and --max-queue >= 0, got {max_batch} and {max_queue}")
        if max_request_bytes < 1024:
            raise TreeFlashError(f"--max-request-bytes must be at least 1024, got {max_request_bytes}")
        if request_timeout is not None and not request_timeout > 0:
            raise TreeFlashError(f"--request-timeout must be > 0 seconds, got {request_timeout}")
        if not shutdown_timeout >= 0:
            raise TreeFlashError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    name = served_model_name or model or (artifacts and artifacts.rstrip("/")) or "SmolLM2-135M-Instruct"

    def load():
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return load_session(model=model, drafter=drafter, artifacts=artifacts, verify_checksums=verify_checksums,
                            mode=mode, tree_size=tree_size, top_m=top_m, top_k=top_k,
                            drafter_temperature=drafter_temperature, max_seq_len=max_seq_len, device=device,
                            dtype=dtype, cuda_graphs=cuda_graphs, fast_kernels=fast_kernels, max_batch=max_batch,
                            retune=retune, draft_vocab=draft_vocab, log=lambda m: click.echo(m, err=True))

    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    app = create_app(load, name, api_key=api_key, max_queue=max_queue, closing=lambda: server.should_exit,
                     on_load_error=on_load_error, max_request_bytes=max_request_bytes,
                     request_timeout=request_timeout, shutdown_timeout=shutdown_timeout)
    # uvicorn's own deadline comes later: by then the app has ended every request with an error event
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_timeout + 10.0))
    click.echo(f"treeflash-serve: loading {name!r}; serving on http://{host}:{port}/v1 (GET /health answers 200 "
               f"once ready)", err=True)
    # Once it has shut down, uvicorn raises the signal it stopped on again for the handler that was there
    # before it: this one makes that a clean exit (status 0) rather than death by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    server.run()
    if failed:
        click.echo(f"error: {failed[0]}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
