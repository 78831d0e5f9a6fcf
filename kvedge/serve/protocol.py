"""The OpenAI chat-completions wire format: request validation, response and chunk bodies.

Request fields of `POST /v1/chat/completions`:

    honoured   messages, model (echoed as the served model's id), max_tokens / max_completion_tokens,
               temperature (0..2, default 1), top_p (0 < p <= 1), stop (string or up to 4), seed,
               stream, stream_options.include_usage;
               kvedge extensions: top_k, repetition_penalty
    ignored    user, metadata, store, service_tier, parallel_tool_calls
    accepted only at their neutral value (else 400)
               n (1), presence_penalty / frequency_penalty (0), logprobs (false), top_logprobs,
               logit_bias ({}), tools / functions ([]), tool_choice ("none"), response_format (text)
    anything else: 400 naming the argument

Messages: role system, user, assistant (developer is read as system); content a string or a list
of text parts. Tool messages and tool calls are refused (this runtime has no tool support).

Every error is `{"error": {"message", "type", "param", "code"}}` with a 4xx status (5xx only for
the server's own faults); messages never name files or internals.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvedge.runtime.tokenizer import ROLES

MAX_STOP = 4
INT64 = 2**63
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
API_ROLES = sorted({*ROLES, *ROLE_ALIASES} - {"tool"})  # the chat roles, less tool (no tool support)
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# argument: (its neutral values, what we say)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "only n=1 is supported"),
    "presence_penalty": ((0, 0.0), "presence_penalty is not supported; use repetition_penalty"),
    "frequency_penalty": ((0, 0.0), "frequency_penalty is not supported; use repetition_penalty"),
    "logprobs": ((False,), "logprobs are not supported"),
    "top_logprobs": ((), "logprobs are not supported"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "tools": (([],), "tools are not supported"),
    "functions": (([],), "function calling is not supported"),
    "tool_choice": (("none",), "tools are not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "response_format": (({"type": "text"},), "only response_format {'type': 'text'} is supported"),
}
HONOURED = {
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "top_k",
    "repetition_penalty",
}


class ApiError(Exception):
    """An error the client gets back as an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, str], ...]
    max_tokens: int | None  # None: the service's default, clipped to the room left
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    stop: tuple[str, ...]
    seed: int | None  # already mapped into 0..2**64-1
    stream: bool
    include_usage: bool


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return (_int(value) or isinstance(value, float)) and math.isfinite(value)


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raise ApiError(400) naming the first bad argument."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    for key, value in body.items():
        if key in HONOURED or key in IGNORED:
            continue
        if key in NEUTRAL:
            neutral, message = NEUTRAL[key]
            if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
                raise _bad(key, message, code="unsupported_parameter")
            continue
        raise _bad(key, f"unrecognized request argument: {key!r}", code="unknown_parameter")

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "model must be a string")
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if set(options) - {"include_usage"} or not isinstance(include_usage, bool | None):
        raise _bad("stream_options", "stream_options allows only include_usage (a boolean)")

    max_tokens = _optional(body, "max_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1", None)
    max_completion = _optional(
        body, "max_completion_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1", None
    )
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _bad("max_tokens", "max_tokens and max_completion_tokens differ; give one")
    seed = _optional(body, "seed", lambda v: _int(v) and -INT64 <= v < 2 * INT64, "a 64-bit integer", None)

    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        temperature=float(
            _optional(body, "temperature", lambda v: _number(v) and 0 <= v <= 2, "a number in 0..2", 1.0)
        ),
        top_p=float(_optional(body, "top_p", lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)),
        top_k=_optional(body, "top_k", lambda v: _int(v) and 0 <= v < INT64, "an integer >= 0 (0 = off)", 0),
        repetition_penalty=float(
            _optional(
                body, "repetition_penalty", lambda v: _number(v) and 0 < v <= 10, "a number in (0, 10]", 1.0
            )
        ),
        stop=parse_stop(body.get("stop")),
        seed=None if seed is None else seed % (2 * INT64),
        stream=stream,
        include_usage=bool(include_usage),
    )


def _optional(body: dict[str, Any], key: str, ok, allowed: str, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not ok(value):
        raise _bad(key, f"{key}={_show(value)} is not allowed; allowed: {allowed}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise _bad("stop", f"stop must be a string or a list of at most {MAX_STOP} strings")


def parse_messages(messages: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise _bad(param, f"message {i} must be an object with role and content")
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise _bad(param, "tool and function messages are not supported", code="unsupported_parameter")
        chat_role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else None
        if chat_role not in API_ROLES:
            raise _bad(f"{param}.role", f"message {i}: role {_show(role)} is not one of {API_ROLES}")
        out.append({"role": chat_role, "content": _content(message.get("content"), i)})
    return tuple(out)


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _bad(
                    f"messages.[{i}].content",
                    f"message {i}: only text content parts ({{'type': 'text', 'text': ...}}) are supported",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages.[{i}].content", f"message {i}: content must be a string or a list of text parts")


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    id: str, model: str, text: str, finish_reason: str, usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
    }


def chunk_body(
    id: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    choices: bool = True,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; `choices=False` makes OpenAI's usage-only final chunk."""
    body: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        if choices
        else [],
    }
    if usage is not None:
        body["usage"] = usage
    return body
