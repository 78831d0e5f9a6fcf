"""Tool calls and reasoning on the OpenAI surface: how tools reach the prompt, which grammar the
reply must follow, and how the reply is read back into content, reasoning and tool calls.

Each family of chat templates writes tool calls its own way; a `ToolFormat` describes one family:
how tools and the history's calls reach the template (`prompt`), the grammar of a reply
(`constraint`), where a reply's calls begin (`opening`) and how they are read back (`calls`).
`tool_format` tells the family from the template's text:

    native       Hermes / Qwen2.5 / Qwen3: the template renders `tools` and writes
                     <tool_call>
                     {"name": "get_weather", "arguments": {"city": "Paris"}}
                     </tool_call>
                 blocks itself; tools and the history's calls go to the template as transformers
                 passes them
    fallback     the template knows nothing of tools (SmolLM2's ChatML): kvedge appends a tool
                 section to the system message (`FALLBACK_PROMPT`, a new system message when there
                 is none) and writes the history's tool calls as the blocks above, in the same
                 characters the grammar makes the model write, so a tool round trip reuses the cache
    llama3_json  Llama 3.1 / 3.2 / 3.3: the template renders tools as JSON (in the first user
                 message by default) and a call as the whole reply,
                     {"name": "get_weather", "parameters": {"city": "Paris"}}
                 one call per assistant message (the templates raise on more), so one call per
                 reply; a history message with several calls is given to the template as one
                 assistant message per call. Llama 3.1's built-in tools (`<|python_tag|>`,
                 brave_search, wolfram_alpha, code_interpreter) are not offered: the grammar does
                 not admit `<|python_tag|>`, so the model writes the JSON form above
    mistral      Mistral 7B v0.3, Mistral-Nemo (v3), Mistral Small 3.1 (v7):
                     [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]
                 (v7 templates write "[TOOL_CALLS] [", with a space; the format follows the
                 template). The model writes each call's id (9 letters or digits, as the templates
                 demand and llama.cpp's grammar does), which is the id the client gets, so the
                 round trip renders what the model wrote. Ids the client sends that are not 9
                 letters or digits are mapped, in the calls and the tool messages alike, to 9
                 base62 characters of their SHA-256 (`mistral_id`: deterministic, so a replayed
                 conversation renders the same). `[TOOL_CALLS]` is written as the tokenizer's own
                 token where it has one. Templates with `[ARGS]` (v11: `[TOOL_CALLS]name[ARGS]{...}`,
                 Mistral Small 3.2, Magistral, Devstral) are not read
    refused      any other template that renders tools: 400, said so

The reply is constrained (`ToolFormat.constraint`): with tool_choice "required" or a named
function it is the family's calls, each call's JSON matching {"name": <a given function>,
"arguments" (Llama: "parameters"): <its parameters schema>}; with "auto" it is either such calls
or plain text that does not start with the family's `opening` ("<", "{", "["); with "none" it is
not constrained and not read for calls. JSON is written with ", " and ": " separators, the way
`json.dumps` and chat templates' `tojson` write it, so a call renders back into the same text.
Several calls are allowed with `parallel_tool_calls` (protocol.py: its default is true, but one
call for a named function).

A reply cut short (max_tokens, or the context full: finish_reason "length") in the middle of its
calls gives the calls that completed before the cut (`ToolFormat.completed`) and never the
half-written markup as content.

Reasoning: when the template has a thinking block (`<think>`), text between `<think>` and
`</think>` at the start of the reply is `reasoning_content`; `chat_template_kwargs:
{"enable_thinking": false}` switches thinking off where the template supports the switch.

`ReplyParser` reads a reply as it streams and gives OpenAI deltas; the non-streamed message is
the same deltas put together, so both forms always agree.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvedge.runtime import json_schema
from kvedge.runtime.constrain import JSON_STYLE
from kvedge.runtime.model import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
LLAMA3_HEADER, LLAMA3_CALL = "<|start_header_id|>", '"parameters": '
MISTRAL_MARK, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
FALLBACK_PROMPT = (
    "You can call these functions. To call one, reply with only\n"
    "<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>\n"
    "(one block per call). Otherwise answer normally.\n"
    "Functions:\n{functions}"
)


class ToolError(ValueError):
    """A bad tool definition, tool choice or tool message; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The definition as a chat template receives it (transformers' tools argument)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


def parse_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError("tools", "tools must be a list of {type: function, function: {...}} objects")
    tools = []
    for i, item in enumerate(value):
        where = f"tools.[{i}]"
        function = item.get("function") if isinstance(item, dict) and item.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ToolError(where, f"tool {i} must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"{where}.function.name", f"tool {i}: name {name!r} must match {NAME.pattern}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(
                f"{where}.function.parameters",
                f"tool {name!r}: parameters must be a JSON Schema of type object",
            )
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description", f"tool {name!r}: description must be a string")
        tools.append(Tool(name, description, {"type": "object", **parameters}))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools", f"tool names must be unique, got {names}")
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> str:
    """ "none", "auto", "required", or the name of the one function the reply must call."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise ToolError("tool_choice", f"tool_choice {value!r} needs tools")
        return value
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or {type: function, function: {name}}",
        )
    if name not in {t.name for t in tools}:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools given")
    return name


def tool_format(template: str) -> str:
    """How this chat template takes tools: "native", "fallback", "llama3_json", "mistral" or
    "refused" (module docstring)."""
    if "tools" not in template:
        return "fallback"
    if OPEN in template:
        return "native"
    if LLAMA3_HEADER in template and LLAMA3_CALL in template:
        return "llama3_json"
    if MISTRAL_MARK in template and MISTRAL_ARGS not in template:
        return "mistral"
    return "refused"


def format_for(template: str, encode: Callable[[str], list[int]]) -> ToolFormat | None:
    """The template's `ToolFormat` (None when refused); `encode` gives a text's token ids without
    special tokens added, to find the tokenizer's own `[TOOL_CALLS]` token."""
    kind = tool_format(template)
    if kind in ("native", "fallback"):
        return Hermes(kind)
    if kind == "llama3_json":
        return Llama3Json()
    if kind == "mistral":
        ids = encode(MISTRAL_MARK)
        token = ids[0] if len(ids) == 1 else None
        return Mistral(token, space=MISTRAL_MARK + " [" in template)
    return None


def call_block(name: str, arguments: dict[str, Any]) -> str:
    """A tool call written exactly as the grammar makes the model write it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def prompt_messages(
    messages: list[dict[str, Any]], tools: tuple[Tool, ...], fmt: str
) -> list[dict[str, Any]]:
    """The messages as the template should see them under `fmt` (module docstring)."""
    if fmt == "native":
        return [_native(m) for m in messages]
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            blocks = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            text = (message.get("content") or "") + "\n".join(blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    if tools:
        functions = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools)
        section = FALLBACK_PROMPT.format(functions=functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _native(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {
        "role": "assistant",
        "content": message.get("content") or "",
        "tool_calls": [
            {
                "type": "function",
                "id": c["id"],
                "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            }
            for c in calls
        ],
    }


def tool_constraint(tools: tuple[Tool, ...], choice: str, parallel: bool = True) -> Constraint | None:
    """The grammar of a reply under `choice` (module docstring); one call only unless `parallel`."""
    if choice == "none" or not tools:
        return None
    more = ' ("\\n" call)*' if parallel else ""
    schema = _call_schema(tools, choice, "arguments", {})
    calls = f'calls: call{more}\ncall: "{OPEN}\\n" %json {schema} "\\n{CLOSE}"\n'
    start = "start: plain | calls\nplain: /[^<][\\s\\S]*/\n" if choice == "auto" else "start: calls\n"
    return Constraint("lark", start + calls)


def _call_schema(tools: tuple[Tool, ...], choice: str, arguments: str, extra: dict[str, Any]) -> str:
    """JSON Schema of one call: {"name": <a function allowed by `choice`>, `arguments`: <its
    parameters, read as the spec reads them (json_schema.prepare: unknown formats ignored)>,
    **extra}, keys in that order, written in `JSON_STYLE`."""
    allowed = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    schema = {
        "anyOf": [
            {
                "type": "object",
                # no keys beyond the declared parameters unless the schema allows them itself
                "properties": {
                    "name": {"const": t.name},
                    arguments: {"additionalProperties": False, **json_schema.prepare(t.parameters).schema},
                    **extra,
                },
                "required": ["name", arguments, *extra],
                "additionalProperties": False,
            }
            for t in allowed
        ],
        "x-guidance": JSON_STYLE,
    }
    return json.dumps(schema)


def _openai_call(index: int, call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolFormat:
    """How one family of chat templates takes tools and writes calls (module docstring)."""

    kind: str
    opening: str  # a reply whose text starts so (leading whitespace aside) is calls

    def prompt(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and the tools (None: none) as the template should see them."""
        raise NotImplementedError

    def constraint(self, tools: tuple[Tool, ...], choice: str, parallel: bool) -> Constraint | None:
        """The grammar of a reply under `choice`; several calls only where `parallel` and the
        family writes several."""
        raise NotImplementedError

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI tool calls `text` is made of, or None if it is not entirely calls."""
        raise NotImplementedError

    def completed(self, text: str) -> list[dict[str, Any]]:
        """The calls that completed in `text`, a reply of calls cut short (maybe inside the first)."""
        raise NotImplementedError


class Hermes(ToolFormat):
    """<tool_call> blocks: the template's own ("native") or kvedge's prompt ("fallback")."""

    opening = OPEN

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def prompt(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        native = self.kind == "native" and tools
        return prompt_messages(messages, tools, self.kind), [t.openai() for t in tools] if native else None

    def constraint(self, tools: tuple[Tool, ...], choice: str, parallel: bool) -> Constraint | None:
        return tool_constraint(tools, choice, parallel)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        calls, rest = _parse_calls(text)
        return None if rest or not calls else calls

    def completed(self, text: str) -> list[dict[str, Any]]:
        return _parse_calls(text)[0]


class Llama3Json(ToolFormat):
    """Llama 3.1+ JSON calls: the reply is one {"name": ..., "parameters": {...}} object."""

    kind, opening = "llama3_json", "{"

    def prompt(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        # the templates take one call per assistant message: several become consecutive ones
        out = []
        for message in messages:
            calls = message.get("tool_calls") or [None]
            out.extend(_native({**message, "tool_calls": [c]} if c else message) for c in calls)
        return out, [t.openai() for t in tools] or None

    def constraint(self, tools: tuple[Tool, ...], choice: str, parallel: bool) -> Constraint | None:
        if choice == "none" or not tools:  # one call, whatever `parallel`: the templates take one
            return None
        call = f"call: %json {_call_schema(tools, choice, 'parameters', {})}\n"
        start = "start: plain | call\nplain: /[^{][\\s\\S]*/\n" if choice == "auto" else "start: call\n"
        return Constraint("lark", start + call)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not (
            isinstance(call, dict)
            and isinstance(call.get("name"), str)
            and isinstance(call.get("parameters"), dict)
        ):
            return None
        return [_openai_call(0, "call_" + uuid.uuid4().hex[:24], call["name"], call["parameters"])]

    def completed(self, text: str) -> list[dict[str, Any]]:
        return self.calls(text) or []  # one call per reply: cut, it did not complete


class Mistral(ToolFormat):
    """Mistral v3 / v7 calls: [TOOL_CALLS][{"name", "arguments", "id"}, ...]. `token`: the
    tokenizer's own [TOOL_CALLS] token (None: written as text); `space`: "[TOOL_CALLS] [" (v7)."""

    kind, opening = "mistral", "["

    def __init__(self, token: int | None, space: bool) -> None:
        self.token, self.space = token, space

    def prompt(
        self, messages: list[dict[str, Any]], tools: tuple[Tool, ...]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        out = []
        for message in messages:
            message = _native(message)
            if message.get("tool_calls"):
                calls = [{**c, "id": mistral_id(c["id"])} for c in message["tool_calls"]]
                message = {**message, "tool_calls": calls}
            if message["role"] == "tool":
                message = {**message, "tool_call_id": mistral_id(message["tool_call_id"])}
            out.append(message)
        return out, [t.openai() for t in tools] or None

    def constraint(self, tools: tuple[Tool, ...], choice: str, parallel: bool) -> Constraint | None:
        if choice == "none" or not tools:
            return None
        mark = f"<[{self.token}]>" if self.token is not None else json.dumps(MISTRAL_MARK)
        opening = '" ["' if self.space else '"["'
        more = ' (", " call)*' if parallel else ""
        ident = {"id": {"type": "string", "pattern": MISTRAL_ID.pattern}}
        calls = (
            f'calls: {mark} {opening} call{more} "]"\n'
            f"call: %json {_call_schema(tools, choice, 'arguments', ident)}\n"
        )
        start = "start: plain | calls\nplain: /[^\\[][\\s\\S]*/\n" if choice == "auto" else "start: calls\n"
        return Constraint("lark", start + calls)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        calls, complete = self._read(text)
        return calls if complete and calls else None

    def completed(self, text: str) -> list[dict[str, Any]]:
        return self._read(text)[0]

    def _read(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        """The calls of the list `text` holds, up to the first that is not a whole valid call, and
        whether that is the whole text (the list closed, nothing after it)."""
        # the tokenizer's own [TOOL_CALLS] token is not in the decoded text; a written one is
        text = text.removeprefix(MISTRAL_MARK).lstrip()
        if not text.startswith("["):
            return [], False
        decoder = json.JSONDecoder()
        out: list[dict[str, Any]] = []
        at = 1
        while True:
            try:
                call, at = decoder.raw_decode(text, _skip_space(text, at))
            except ValueError:
                return out, False
            if not (
                isinstance(call, dict)
                and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments"), dict)
                and isinstance(call.get("id"), str)
            ):
                return out, False
            call_id = call["id"]
            if call_id in {c["id"] for c in out}:  # ids must tell calls apart; the model may repeat one
                call_id = mistral_id(f"{call_id}#{len(out)}")
            out.append(_openai_call(len(out), call_id, call["name"], call["arguments"]))
            at = _skip_space(text, at)
            if text[at : at + 1] == "]":
                return out, not text[at + 1 :].strip()
            if text[at : at + 1] != ",":
                return out, False
            at += 1


def _skip_space(text: str, at: int) -> int:
    """The index of the first character at or after `at` that is not JSON whitespace."""
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def mistral_id(call_id: str) -> str:
    """`call_id` if it is 9 letters or digits (what Mistral templates take), else 9 base62
    characters of its SHA-256: the same id maps the same way in every request."""
    if MISTRAL_ID.match(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
    chars = []
    for _ in range(9):
        number, digit = divmod(number, 62)
        chars.append(BASE62[digit])
    return "".join(chars)


def response_constraint(response_format: Any) -> Constraint | None:
    """response_format {"type": "text" | "json_object" | "json_schema", ...} as a constraint."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ToolError("response_format.json_schema", "json_schema needs a 'schema' object")
        return Constraint.json_schema(schema)
    raise ToolError("response_format", "response_format type must be 'text', 'json_object' or 'json_schema'")


class ReplyParser:
    """Reads a reply as it streams into OpenAI message deltas: reasoning_content, content, and
    tool_calls (only when tools are in play)."""

    def __init__(self, tools: bool, thinking: bool, fmt: ToolFormat | None = None) -> None:
        self.tools, self.thinking = tools, thinking
        self.fmt = fmt or Hermes("native")
        self.text = ""  # the whole reply so far
        self.done = 0  # characters of `text` turned into deltas
        self.mode = "start" if thinking else "content"
        self.content_started = False
        self.after_think = False

    def push(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        out: list[dict[str, Any]] = []
        while True:
            step = self._advance()
            if step is None:
                return out
            out.extend(step)

    def finish(self, cut: bool = False) -> tuple[list[dict[str, Any]], bool]:
        """The remaining deltas, and whether they are tool calls. `cut`: the reply was cut short
        (finish_reason "length"), so calls it was writing give only those that completed."""
        rest = self.text[self.done :]
        self.done = len(self.text)
        if self.mode == "tool":
            calls = self.fmt.calls(rest.strip())
            if calls is not None:
                return [{"tool_calls": calls}], True
            if cut:
                calls = self.fmt.completed(rest.strip())
                return ([{"tool_calls": calls}] if calls else []), bool(calls)
            return [{"content": rest}], False
        if self.waiting_for_opening(rest) and cut:  # cut while writing the opening of a call
            return [], False
        if self.mode in ("start", "reasoning"):
            return ([{"reasoning_content": rest}] if rest else []), False
        return ([{"content": rest}] if rest else []), False

    def waiting_for_opening(self, rest: str) -> bool:
        """Whether `rest`, the text not yet turned into deltas, could still open calls."""
        if self.mode != "content" or self.content_started or not self.tools:
            return False
        stripped = rest.lstrip()
        return bool(stripped) and self.fmt.opening.startswith(stripped)

    def _advance(self) -> list[dict[str, Any]] | None:
        """One state change or emission; None when more text is needed."""
        rest = self.text[self.done :]
        if self.mode == "start":
            if rest.startswith(THINK_OPEN):
                self.done += len(THINK_OPEN)
                self.mode = "reasoning"
                return []
            if THINK_OPEN.startswith(rest):
                return None
            self.mode = "content"
            return []
        if self.mode == "reasoning":
            at = rest.find(THINK_CLOSE)
            if at >= 0:
                self.done += at + len(THINK_CLOSE)
                self.mode, self.after_think = "content", True
                return [{"reasoning_content": rest[:at]}] if at else []
            keep = _partial_suffix(rest, THINK_CLOSE)
            if len(rest) - keep == 0:
                return None
            self.done += len(rest) - keep
            return [{"reasoning_content": rest[: len(rest) - keep]}]
        if self.mode == "content":
            if not self.content_started:
                if self.after_think:  # "</think>\n\n": the blank lines only separate the parts
                    stripped = rest.lstrip("\n")
                    if not stripped:
                        return None
                    self.done += len(rest) - len(stripped)
                    rest, self.after_think = stripped, False
                if self.tools:  # a reply that opens with the format's calls is calls, not text
                    opening = self.fmt.opening
                    stripped = rest.lstrip()
                    if not stripped or (opening.startswith(stripped) and len(stripped) < len(opening)):
                        return None
                    if stripped.startswith(opening):
                        self.done += len(rest) - len(stripped)
                        self.mode = "tool"
                        return []
                self.content_started = True
                return []
            if not rest:
                return None
            self.done += len(rest)
            return [{"content": rest}]
        return None  # tool: everything waits for finish()


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could start `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _parse_calls(text: str) -> tuple[list[dict[str, Any]], str]:
    """The tool calls of the valid blocks `text` starts with (separated by whitespace), and the
    text after them: "" when `text` is entirely valid blocks."""
    calls: list[dict[str, Any]] = []
    rest = text.strip()
    while rest:
        if not rest.startswith(OPEN) or CLOSE not in rest:
            break
        body, _, after = rest[len(OPEN) :].partition(CLOSE)
        try:
            call = json.loads(body)
        except ValueError:
            break
        if not (
            isinstance(call, dict)
            and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments"), dict)
        ):
            break
        calls.append(
            _openai_call(len(calls), "call_" + uuid.uuid4().hex[:24], call["name"], call["arguments"])
        )
        rest = after.lstrip()
    return calls, rest
