"""Tool calls and reasoning on the OpenAI surface: how tools reach the prompt, which grammar the
reply must follow, and how the reply is read back into content, reasoning and tool calls.

Tool-call format (Hermes / Qwen2.5 / Qwen3)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

How tools reach the prompt depends on the model's chat template (`tool_format`):

    native     the template renders `tools` and writes `<tool_call>` blocks itself (Qwen2.5,
               Qwen3): tools and the history's tool calls go to the template as transformers
               passes them
    fallback   the template knows nothing of tools (SmolLM2's ChatML): kvedge appends a tool
               section to the system message (`FALLBACK_PROMPT`, a new system message when there
               is none) and writes the history's tool calls as the blocks above, in the same
               characters the grammar makes the model write, so a tool round trip reuses the cache
    refused    the template renders tools in another format (Llama 3.1, Mistral): 400, said so

The reply is constrained (`tool_constraint`): with tool_choice "required" or a named function it
must be one or more blocks whose JSON matches {"name": <a given function>, "arguments": <its
parameters schema>}; with "auto" it is either such blocks or plain text that does not start with
"<"; with "none" it is not constrained and not read for calls. JSON in blocks is written with
", " and ": " separators, the way `json.dumps` and chat templates' `tojson` write it.

Reasoning: when the template has a thinking block (`<think>`), text between `<think>` and
`</think>` at the start of the reply is `reasoning_content`; `chat_template_kwargs:
{"enable_thinking": false}` switches thinking off where the template supports the switch.

`ReplyParser` reads a reply as it streams and gives OpenAI deltas; the non-streamed message is
the same deltas put together, so both forms always agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvedge.runtime.constrain import JSON_STYLE
from kvedge.runtime.model import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
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
    """How this chat template takes tools: "native", "fallback" or "refused" (module docstring)."""
    if "tools" not in template:
        return "fallback"
    return "native" if OPEN in template else "refused"


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
    allowed = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    schema = {
        "anyOf": [
            {
                "type": "object",
                # no keys beyond the declared parameters unless the schema allows them itself
                "properties": {
                    "name": {"const": t.name},
                    "arguments": {"additionalProperties": False, **t.parameters},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in allowed
        ],
        "x-guidance": JSON_STYLE,
    }
    more = ' ("\\n" call)*' if parallel else ""
    calls = f'calls: call{more}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'
    start = "start: plain | calls\nplain: /[^<][\\s\\S]*/\n" if choice == "auto" else "start: calls\n"
    return Constraint("lark", start + calls)


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

    def __init__(self, tools: bool, thinking: bool) -> None:
        self.tools, self.thinking = tools, thinking
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

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The remaining deltas, and whether they are tool calls."""
        rest = self.text[self.done :]
        self.done = len(self.text)
        if self.mode == "tool":
            calls = _parse_calls(rest)
            if calls is not None:
                return [{"tool_calls": calls}], True
            return [{"content": rest}], False
        if self.mode in ("start", "reasoning"):
            return ([{"reasoning_content": rest}] if rest else []), False
        return ([{"content": rest}] if rest else []), False

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
                if self.tools:  # a reply that opens with a tool call block is calls, not text
                    stripped = rest.lstrip()
                    if not stripped or (OPEN.startswith(stripped) and len(stripped) < len(OPEN)):
                        return None
                    if stripped.startswith(OPEN):
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


def _parse_calls(text: str) -> list[dict[str, Any]] | None:
    """The tool calls in `text` (blocks, optionally separated by whitespace), or None if it is
    not entirely made of valid blocks."""
    calls = []
    rest = text.strip()
    while rest:
        if not rest.startswith(OPEN) or CLOSE not in rest:
            return None
        body, _, rest = rest[len(OPEN) :].partition(CLOSE)
        rest = rest.lstrip()
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not (
            isinstance(call, dict)
            and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments"), dict)
        ):
            return None
        calls.append(
            {
                "index": len(calls),
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call["arguments"], ensure_ascii=False),
                },
            }
        )
    return calls or None
