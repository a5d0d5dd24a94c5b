"""The OpenAI wire format: request models (validated once, here), the mapping to sampling settings,
the response and stream-chunk bodies, and the one error type with its one body builder.

Fields that would change the result but are not implemented (log-probabilities, penalties, tools,
response formats, n > 1, ...) are refused with a 400 naming the field, unless they hold their
neutral value; fields that change nothing (``user``, ``metadata``, ...) are accepted and ignored;
any other field is refused as unrecognised, as OpenAI's own API does.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from treeflash_export.errors import TreeFlashError


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
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = None  # None: a fresh random seed per request
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
        if any(not s for s in self.stop_strings):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return self

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
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_budget(self):
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree: give one", param="max_completion_tokens")
        return self

    def new_tokens(self) -> int | None:
        """None: as many as fit (OpenAI's chat default: up to the context)."""
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[_Common], body: bytes) -> _Common:
    """The request body -> a checked request, or an APIError (invalid JSON included)."""
    import json

    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
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
