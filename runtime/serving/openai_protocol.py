"""The OpenAI wire format: request models (validated once, here), the mapping to sampling settings,
the response and stream-chunk bodies, and the one error type with its one body builder.

Fields that would change the result but are not implemented (log-probabilities, penalties, tools,
response formats, n > 1, ...) are refused with a 400 naming the field, unless they hold their
neutral value; fields that change nothing (``user``, ``metadata``, ...) are accepted and ignored;
any other field is refused as unrecognised, as OpenAI's own API does.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from treeflash_export.config import MIN_TOP_P, SEED_MAX, SEED_MIN
from treeflash_export.errors import TreeFlashError

# The bounds of what a request may carry (docs/openai-server.md lists them). Numbers are bounded to what
# the engine stores (seed: int64; token budgets: int32, then the slot's cache); stop strings to a count and
# length that keep matching them cheap next to a round.
MAX_TOKENS = 2**31 - 1
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_BYTES = 4 * 2**20  # the default of --max-request-bytes


class APIError(TreeFlashError):
    """Every refused request: status, OpenAI's error type and code, and the field it is about."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(exc: APIError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def from_validation(exc: ValidationError) -> APIError:
    """pydantic's first complaint as a 400 (never FastAPI's 422), naming the field."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "union["))]
    # a field's alternatives (string or ids) show up as extra path parts: the field itself is named
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid value")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return APIError(400, f"{where}: {message}" if where and not message.startswith(where) else message, param=param)


# Fields not implemented, with the values that leave the result as it is (accepted).
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0), "reasoning_effort": (None,), "web_search_options": (None,),
}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier", "verbosity"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None  # None: the served model
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)  # OpenAI's default; 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)  # below MIN_TOP_P it acts as MIN_TOP_P
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # None: a fresh random seed per request
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False  # extension (as vLLM's): generate max_tokens, past end-of-turn and EOS

    @model_validator(mode="after")
    def _check(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise APIError(400, f"{name!r} is not supported by this server", param=name, code="unsupported_field")
            if name not in UNSUPPORTED and name not in IGNORED:
                raise APIError(400, f"unrecognized request argument supplied: {name}", param=name)
        if self.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise APIError(400, f"stop: a stop string may hold at most {MAX_STOP_CHARS} characters, got one of "
                                f"{longest}", param="stop")
        return self

    @property
    def engine_top_p(self) -> float:
        """top_p as the engine stores it (float32): below MIN_TOP_P only the most probable token is kept
        either way (it alone holds more than MIN_TOP_P of the mass for any vocabulary under a million)."""
        return max(self.top_p, MIN_TOP_P)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def new_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Common):
    # a string, token ids, or either as a batch of one (batches of several are refused)
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]

    def new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: one prompt per request, got a batch of {len(p)}", param="prompt")
            p = p[0]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name etc.: not part of the templates this serves
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _check(self):
        for name in ("tool_calls", "function_call", "audio"):
            if (self.model_extra or {}).get(name):
                raise APIError(400, f"messages: {name!r} is not supported by this server", param="messages",
                               code="unsupported_field")
        return self

    def to_template(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        # "developer" is OpenAI's newer name for the system role; chat templates know "system"
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _one_budget(self):
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree: give one", param="max_completion_tokens")
        return self

    def new_tokens(self) -> int | None:
        """None: as many as fit (OpenAI's chat default: up to the context)."""
        return self.max_completion_tokens or self.max_tokens


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(data: dict) -> str | None:
    """The top-level field holding a string with an unpaired UTF-16 surrogate (JSON escapes such as
    "\\ud800" decode to one; no tokenizer or UTF-8 response can carry it), or None."""
    for key, value in data.items():
        try:
            json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return key.encode("utf-8", "backslashreplace").decode("utf-8")  # the name itself may hold one
    return None


def parse(model: type[_Common], body: bytes, check_ids: Callable[[int, "_Common"], None] | None = None) -> _Common:
    """The request body -> a checked request, or an APIError (invalid JSON included). Standard JSON only:
    NaN and Infinity, integers past Python's digit limit, nesting past the recursion limit and unpaired
    surrogates are 400s like any other malformed body. check_ids(n, model) sees the length of a prompt of
    token ids before its ids are validated one by one (and may refuse it)."""
    try:
        data = json.loads(body or b"null", parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the body is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body) and (bad := _lone_surrogate(data)) is not None:
        raise APIError(400, f"{bad}: a string holds an unpaired UTF-16 surrogate (\\ud800-\\udfff); send valid "
                            f"Unicode", param=bad, code="invalid_unicode")
    ids = data.get("prompt")
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]  # a batch of one
    if check_ids is not None and isinstance(ids, list) and ids and not isinstance(ids[0], str):
        check_ids(len(ids), model)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


# ---------------------------------------------------------------- responses

FINISH = {"stop_token": "stop", "stopped": "stop", "max_new_tokens": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, spec: dict) -> dict:
    """OpenAI's usage, plus ``treeflash``: the request's speculative figures (see docs/openai-server.md)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "treeflash": spec}


def completion_body(rid: str, model: str, text: str, finish: str, use: dict, chat: bool) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
               "finish_reason": finish} if chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk_body(rid: str, model: str, text: str | None, finish: str | None, chat: bool, *, role: bool = False,
               use: dict | None = None) -> dict:
    """One stream chunk: a piece of text (or the finish reason), or with ``use`` the usage chunk (no choices)."""
    if use is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body
