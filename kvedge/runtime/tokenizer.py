"""Tokenizer and chat template, without transformers: `tokenizers` + a sandboxed jinja2.

The chat template is rendered the way transformers renders it (trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`), so the ids equal `apply_chat_template`'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvedge.contract import CHAT_TEMPLATE_FILE, ROLES, TOKENIZER_FILE, Manifest
from kvedge.errors import KvedgeError


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    """transformers' `tojson` (plain json.dumps, keys in order), not jinja2's HTML-safe one, so
    templates that write tools and tool calls render the same text as apply_chat_template."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise KvedgeError(f"chat template refused the conversation: {message}")


def _max_token_bytes(tokenizer: Tokenizer) -> int:
    """At least the UTF-8 bytes of text one token can stand for: the longest vocabulary entry as
    stored (never shorter than its text: byte-level BPE's "Ġ" is 2 bytes for 1, "▁" 3 for 1,
    "<0x0A>" 6 for 1), times 3 when a normalizer runs first (NFC and NFKC shrink text by up to
    3x: three Hangul jamo of 3 bytes compose into one syllable of 3)."""
    longest = max(len(token.encode()) for token in tokenizer.get_vocab(with_added_tokens=True))
    return longest * (3 if tokenizer.normalizer is not None else 1)


class ChatTokenizer:
    def __init__(self, folder: Path, manifest: Manifest) -> None:
        path = folder / TOKENIZER_FILE
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
            raise KvedgeError(f"{path}: not a readable tokenizer ({exc}); re-export the model") from None
        self.special_tokens = dict(manifest.special_tokens)
        # at load, not on the first request: the vocabulary's walk took 52 ms for SmolLM2's 49k
        # tokens, the whole of a fresh service's first-request delay; more for 128k-262k
        self.max_token_bytes = _max_token_bytes(self.tokenizer)
        self.template = None
        self._source = ""
        path = folder / CHAT_TEMPLATE_FILE
        if manifest.chat_template and path.is_file():
            self._source = path.read_text()
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            try:
                self.template = env.from_string(self._source)
            except jinja2.TemplateError as exc:
                raise KvedgeError(f"{path}: chat template does not parse ({exc})") from exc

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without encoding: a prompt far over a limit is
        refused at the cost of counting its bytes (a 1 MB message took 0.8 s to tokenize)."""
        return -(-len(text.encode(errors="replace")) // self.max_token_bytes)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def template_source(self) -> str:
        """The chat template's text ("" without one): what it can render (tools, thinking)."""
        return self._source

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the model's chat template writes it; `tools` (OpenAI function
        definitions) and `template_kwargs` (e.g. enable_thinking) are passed to the template, as
        transformers' apply_chat_template does. An assistant message may carry `tool_calls`
        instead of content."""
        if self.template is None:
            raise KvedgeError("this model has no chat template; use raw prompts (--raw)")
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise KvedgeError(f"message {i}: role {role!r} is not one of {ROLES}")
            content = message.get("content")
            if not (isinstance(content, str) or (content is None and message.get("tool_calls"))):
                raise KvedgeError(f"message {i}: content must be a string")
        variables = {**self.special_tokens, **template_kwargs}
        if tools:
            variables["tools"] = list(tools)
        return self.template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        # The template writes any BOS itself, as transformers' apply_chat_template assumes.
        return self.encode(self.render(messages, tools=tools, **template_kwargs), add_special_tokens=False)


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back what may still change.

    Text is held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD) or could
    be the start of a stop string; `finish` releases the rest, cut at the first stop string.
    """

    def __init__(self, tokenizer: ChatTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                self.stopped = True
                return self._emit(text[:at])
        if text.endswith("\ufffd"):
            return ""
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._emit(text[: max(self.sent, len(text) - hold)])

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def _emit(self, text: str) -> str:
        delta = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return delta
