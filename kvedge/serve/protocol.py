"""The OpenAI wire format: request validation, response and chunk bodies.

Request fields of `POST /v1/chat/completions`:

    honoured   messages, model (echoed as the served model's id), max_tokens / max_completion_tokens,
               temperature ([0, 2]; below 1e-3 greedy), top_p ((0, 1]), stop (string
               or up to 4), seed, stream, stream_options.include_usage, response_format (text, json_object,
               json_schema), tools, tool_choice, parallel_tool_calls, logprobs, top_logprobs (0..20),
               chat_template_kwargs.enable_thinking;
               kvedge extensions: top_k, repetition_penalty, speculate ("lookup" | "off" | "draft",
               the draft the service loaded; default: the service's `speculate`)
    ignored    user, metadata, store, service_tier
    accepted only at their neutral value (else 400)
               n (1), presence_penalty / frequency_penalty (0), logit_bias ({}),
               functions ([]), function_call ("none")
    anything else: 400 naming the argument

Messages: role system, user, assistant (developer is read as system), tool; content a string or a
list of text parts; an assistant message may carry `tool_calls` (content then may be null), a
tool message answers one by `tool_call_id`. Tools and reasoning: kvedge/serve/tools.py.

`POST /v1/completions` (raw prompt, no chat template): prompt (one string), max_tokens,
temperature, top_p, stop, seed, stream, stream_options, logprobs (0..5), echo (false), n (1),
and the kvedge extensions above.

Every error is `{"error": {"message", "type", "param", "code"}}` with a 4xx status (5xx only for
the server's own faults); messages never name files or internals.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvedge.contract import ROLES
from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.model import Constraint
from kvedge.runtime.sampling import SAMPLING_BOUNDS
from kvedge.runtime.speculate import SPECULATE_MODES
from kvedge.serve import tools as toolkit
from kvedge.serve.tools import Tool, ToolError

MAX_STOP = 4
INT64 = 2**63
MAX_TOP_LOGPROBS = SamplingConfig.max_top_logprobs
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
API_ROLES = sorted({*ROLES, *ROLE_ALIASES})
IGNORED = {"user", "metadata", "store", "service_tier"}
# argument: (its neutral values, what we say)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "only n=1 is supported"),
    "presence_penalty": ((0, 0.0), "presence_penalty is not supported; use repetition_penalty"),
    "frequency_penalty": ((0, 0.0), "frequency_penalty is not supported; use repetition_penalty"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "functions": (([],), "the legacy functions argument is not supported; use tools"),
    "function_call": (("none",), "the legacy function_call argument is not supported; use tool_choice"),
}
SAMPLING = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "top_k",
    "repetition_penalty",
    "speculate",
}
HONOURED = SAMPLING | {
    "messages",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "parallel_tool_calls",
}
COMPLETION_ARGS = SAMPLING | {"prompt", "logprobs", "echo", "n", "suffix", "best_of"}
TEMPLATE_KWARGS = ("enable_thinking",)


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
    messages: tuple[dict[str, Any], ...]
    max_tokens: int | None  # None: the service's default, clipped to the room left
    temperature: float | None  # None: the service's default, as top_p, top_k, repetition_penalty
    top_p: float | None
    top_k: int | None
    repetition_penalty: float | None
    stop: tuple[str, ...]
    seed: int | None  # already mapped into 0..2**64-1
    stream: bool
    include_usage: bool
    speculate: str | None  # None: the service's default (`ServiceConfig.speculate`)
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"  # "none", "auto", "required" or a function name
    parallel_tool_calls: bool = True  # False: at most one call per reply (`parallel_default`)
    constraint: Constraint | None = None  # from response_format
    logprobs: int | None = None  # None: off; k: log probabilities with the k most likely
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int | None
    temperature: float | None  # None: the service's default, as top_p, top_k, repetition_penalty
    top_p: float | None
    top_k: int | None
    repetition_penalty: float | None
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    speculate: str | None  # None: the service's default (`ServiceConfig.speculate`)
    logprobs: int | None


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return (_int(value) or isinstance(value, float)) and math.isfinite(value)


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raise ApiError(400) naming the first bad argument."""
    _check_arguments(body, HONOURED)
    try:
        tools = toolkit.parse_tools(body.get("tools"))
        tool_choice = toolkit.parse_tool_choice(body.get("tool_choice"), tools)
        constraint = toolkit.response_constraint(body.get("response_format"))
    except ToolError as exc:
        raise _bad(exc.param, str(exc)) from None
    if constraint is not None and tool_choice != "none":
        raise _bad("response_format", "response_format and tools cannot be combined; give one")
    logprobs = _optional(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
    top = _optional(
        body,
        "top_logprobs",
        lambda v: _int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
        f"an integer in 0..{MAX_TOP_LOGPROBS}",
        None,
    )
    if top is not None and not logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    kwargs = _optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    if set(kwargs) - set(TEMPLATE_KWARGS) or not all(isinstance(v, bool) for v in kwargs.values()):
        raise _bad(
            "chat_template_kwargs", f"chat_template_kwargs allows only {list(TEMPLATE_KWARGS)} (booleans)"
        )
    max_tokens = _optional(body, "max_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1", None)
    max_completion = _optional(
        body, "max_completion_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1", None
    )
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _bad("max_tokens", "max_tokens and max_completion_tokens differ; give one")
    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        **_sampling_fields(body),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_optional(
            body,
            "parallel_tool_calls",
            lambda v: isinstance(v, bool),
            "true or false",
            parallel_default(tool_choice),
        ),
        constraint=constraint,
        logprobs=(top or 0) if logprobs else None,
        template_kwargs=dict(kwargs),
    )


def parallel_default(tool_choice: str) -> bool:
    """parallel_tool_calls when the request does not give it: true (OpenAI's default), except for
    a named function, where it is false: a client that names the function asks for that call
    (LangChain's `bind_tools(tool_choice=...)` and `with_structured_output` read only the first),
    so the reply ends after it. A small model otherwise goes on writing calls until max_tokens
    cuts one. `parallel_tool_calls: true` given explicitly still allows several."""
    return tool_choice in ("auto", "required", "none")


def parse_completion_request(body: Any) -> CompletionRequest:
    """`/v1/completions`: validate a decoded JSON body; raise ApiError(400) naming what is wrong."""
    _check_arguments(body, COMPLETION_ARGS)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "prompt must be a non-empty string (one prompt per request)")
    for key, neutral in (("echo", False), ("n", 1), ("best_of", 1), ("suffix", None)):
        value = body.get(key)
        if value is not None and not (value == neutral and type(value) is type(neutral)):
            raise _bad(key, f"{key}={_show(value)} is not supported", code="unsupported_parameter")
    logprobs = _optional(body, "logprobs", lambda v: _int(v) and 0 <= v <= 5, "an integer in 0..5", None)
    return CompletionRequest(
        prompt=prompt,
        max_tokens=_optional(body, "max_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1", None),
        **_sampling_fields(body),
        logprobs=logprobs,
    )


def _check_arguments(body: Any, honoured: set[str]) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
    for key, value in body.items():
        if key in honoured or key in IGNORED:
            continue
        if key in NEUTRAL:
            neutral, message = NEUTRAL[key]
            if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
                raise _bad(key, message, code="unsupported_parameter")
            continue
        raise _bad(key, f"unrecognized request argument: {key!r}", code="unknown_parameter")


def _sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "model must be a string")
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if set(options) - {"include_usage"} or not isinstance(include_usage, bool | None):
        raise _bad("stream_options", "stream_options allows only include_usage (a boolean)")
    seed = _optional(body, "seed", lambda v: _int(v) and -INT64 <= v < 2 * INT64, "a 64-bit integer", None)
    return {
        # None: the service's default (`ServiceConfig.sampling_defaults`)
        **{name: _sampled(body, name) for name in SAMPLING_BOUNDS},
        "stop": parse_stop(body.get("stop")),
        "seed": None if seed is None else seed % (2 * INT64),
        "stream": stream,
        "include_usage": bool(include_usage),
        "speculate": _optional(
            body, "speculate", lambda v: v in SPECULATE_MODES, f"one of {list(SPECULATE_MODES)}", None
        ),
    }


def _sampled(body: dict[str, Any], name: str) -> float | int | None:
    """A sampling field within its `SAMPLING_BOUNDS` (the bounds SamplingConfig checks), float but
    for top_k; None: not given."""
    bounds = SAMPLING_BOUNDS[name]
    kind = _int if bounds.integer else _number
    # a JSON integer may be any size; numpy's top_k takes an int64
    value = _optional(body, name, lambda v: kind(v) and v in bounds and v < INT64, bounds.allowed, None)
    return value if value is None or bounds.integer else float(value)


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


def parse_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise _bad(param, f"message {i} must be an object with role and content")
        role = message.get("role")
        if role == "function" or message.get("function_call"):
            raise _bad(
                param, "legacy function messages are not supported; use tools", code="unsupported_parameter"
            )
        chat_role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else None
        if chat_role not in ROLES:
            raise _bad(f"{param}.role", f"message {i}: role {_show(role)} is not one of {API_ROLES}")
        calls = message.get("tool_calls")
        if calls and role == "assistant":
            content = message.get("content")
            text = None if content is None else _content(content, i)
            out.append({"role": "assistant", "content": text, "tool_calls": _tool_calls(calls, i)})
            continue
        if calls:
            raise _bad(f"{param}.tool_calls", f"message {i}: only assistant messages carry tool_calls")
        entry = {"role": chat_role, "content": _content(message.get("content"), i)}
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{param}.tool_call_id", f"message {i}: a tool message needs its tool_call_id")
            asked = {c["id"] for m in out if m.get("tool_calls") for c in m["tool_calls"]}
            if call_id not in asked:
                raise _bad(
                    param,
                    f"message {i}: a tool message must answer a tool call of an earlier assistant message",
                )
            entry["tool_call_id"] = call_id
        out.append(entry)
    return tuple(out)


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls, arguments decoded to objects."""
    param = f"messages.[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(param, f"message {i}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise _bad(
                f"{param}.[{j}]",
                f"message {i}: tool call {j} needs function.name and function.arguments (a string)",
            )
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            raise _bad(
                f"{param}.[{j}].function.arguments",
                f"message {i}: tool call {j}: arguments must be a JSON object",
            )
        out.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": name, "arguments": decoded},
            }
        )
    return out


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


def completion_id(prefix: str = "chatcmpl-") -> str:
    return prefix + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens reused from a slot or stored prefix."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    id: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage: dict[str, Any],
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
    }


def chunk_body(
    id: str,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    choices: bool = True,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; `choices=False` makes OpenAI's usage-only final chunk."""
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }
    body: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice] if choices else [],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def text_completion_body(
    id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `text_completion` (whole, or one streamed chunk when `usage` is None)."""
    body: dict[str, Any] = {
        "id": id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def token_logprob(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, Any]:
    """One entry of a chat completion's logprobs.content."""
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())} for t, p in top],
    }
