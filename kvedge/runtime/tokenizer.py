"""Tokenizer and chat template, without transformers: `tokenizers` + a sandboxed jinja2.

The chat template is rendered the way transformers renders it (trim_blocks, lstrip_blocks,
`raise_exception`, `strftime_now`), so the ids equal `apply_chat_template`'s.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
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


PIECE_CHARS = 4096  # characters `fewest_tokens` tokenizes at a time
# a space after a non-space: every byte-level pre-tokenizer split falls there (`_cuts_at_spaces`)
_CUT = re.compile(r"\S ")


def _max_token_bytes(vocab: list[str], added: list[str], byte_level: bool, normalized: bool) -> int:
    """At least the UTF-8 bytes of text one token can stand for: the longest vocabulary entry's
    bytes (a byte-level entry is one character per byte: "Ġ" is the byte 0x20; otherwise as
    stored, never shorter than its text: "▁" is 3 bytes for 1, "<0x0A>" 6 for 1; an added token
    is its text), times 3 when a normalizer runs first (NFC and NFKC shrink text by up to 3x:
    three Hangul jamo of 3 bytes compose into one syllable of 3)."""
    longest = max(len(token) if byte_level else len(token.encode()) for token in vocab)
    longest = max([longest, *(len(text.encode()) for text in added)])
    return longest * (3 if normalized else 1)


def _byte_of_char() -> dict[int, int]:
    """GPT-2's byte-level alphabet: the byte each character of a byte-level entry stands for (by
    code point)."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in kept]
    return {b: b for b in kept} | {256 + i: b for i, b in enumerate(moved)}


def _entries_by_bytes(tokens: list[str], added: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of each byte-level vocabulary entry and added token, longest first, and which
    byte values occur in it (bit b of 256: byte b does). An entry with a character outside the
    alphabet is left out: pre-tokenizing never produces one."""
    outside = {c: 0x3000 for c in range(256)} | _byte_of_char()  # 0x3000: no byte
    points = np.frombuffer("".join(tokens).translate(outside).encode("utf-32-le"), np.uint32)
    lengths = np.array([len(t) for t in tokens], np.int64)  # [entries]
    row = np.repeat(np.arange(len(tokens)), lengths)  # [characters]
    byte = points <= 255
    held = np.zeros((len(tokens), 256), bool)  # [entries, 256]
    held[row[byte], points[byte]] = True
    kept = np.bincount(row[~byte], minlength=len(tokens)) == 0
    texts = [text.encode() for text in added]
    added_held = [np.bincount(np.frombuffer(data, np.uint8), minlength=256) > 0 for data in texts]
    held = np.concatenate([held[kept], np.array(added_held, bool).reshape(-1, 256)])
    lengths = np.concatenate([lengths[kept], np.array([len(data) for data in texts], np.int64)])
    order = np.argsort(-lengths, kind="stable")
    bits = np.packbits(held[order], axis=1, bitorder="little").view(np.uint64)  # [entries, 4]
    return lengths[order], bits


def _component(part: Any) -> dict[str, Any]:
    """A normalizer or pre-tokenizer as tokenizer.json spells it ({} without one)."""
    return {} if part is None else json.loads(part.__getstate__())


# pre-tokenizer regexes (Qwen2 and Qwen3's; Llama 3's) that, like GPT-2's, match no word running
# on from a non-space into a space, and read no character behind a match's start
_SPACE_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _splits_at_spaces(part: dict[str, Any]) -> bool:
    if part.get("type") == "ByteLevel":
        return part.get("use_regex", True)  # GPT-2's regex
    return (
        part.get("type") == "Split"
        and part.get("pattern", {}).get("Regex") in _SPACE_SPLITS
        and part.get("behavior") == "Isolated"
        and not part.get("invert")
    )


def _cuts_at_spaces(tokenizer: Tokenizer, pre_tokenizer: dict[str, Any]) -> bool:
    """Whether text cut just before a space that follows a non-space tokenizes, piece by piece,
    into the same tokens as whole: no normalizer but NFC (a space composes with nothing before
    it), a pre-tokenizer that splits there (GPT-2's byte-level regex or one of `_SPACE_SPLITS`,
    beside byte mapping and digit splits only) and added tokens that hold no whitespace and
    strip none. The model (BPE) then sees the same words either way. Other tokenizers
    (SentencePiece's Metaspace, other normalizers) keep the byte bound alone."""
    parts = pre_tokenizer.get("pretokenizers", [pre_tokenizer])
    return (
        _component(tokenizer.normalizer).get("type", "NFC") == "NFC"
        and any(_splits_at_spaces(part) for part in parts)
        and all(_splits_at_spaces(part) or part.get("type") in ("ByteLevel", "Digits") for part in parts)
        and not any(
            token.lstrip or token.rstrip or any(c.isspace() for c in token.content)
            for token in tokenizer.get_added_tokens_decoder().values()
        )
    )


class ChatTokenizer:
    def __init__(self, folder: Path, manifest: Manifest) -> None:
        path = folder / TOKENIZER_FILE
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
            raise KvedgeError(f"{path}: not a readable tokenizer ({exc}); re-export the model") from None
        self.special_tokens = dict(manifest.special_tokens)
        # at load, not on the first request: the vocabulary's walk was a fresh service's
        # first-request delay (docs/PERFORMANCE.md, "A conversation after a restart"), and grows
        # with the vocabulary
        vocab = list(self.tokenizer.get_vocab(with_added_tokens=False))
        added = [token.content for token in self.tokenizer.get_added_tokens_decoder().values()]
        pre_tokenizer = _component(self.tokenizer.pre_tokenizer)
        byte_level = "ByteLevel" in json.dumps(pre_tokenizer)
        normalized = self.tokenizer.normalizer is not None
        self.max_token_bytes = _max_token_bytes(vocab, added, byte_level, normalized)
        self.cuts_at_spaces = _cuts_at_spaces(self.tokenizer, pre_tokenizer)
        if self.cuts_at_spaces:
            self._entry_bytes, self._entry_bits = _entries_by_bytes(vocab, added)
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

    def fewest_tokens(self, text: str, enough: int) -> int:
        """A lower bound on the tokens `text` takes wherever it stands in a prompt, counted no
        further than past `enough`: a prompt far over a limit is refused without tokenizing it
        whole (docs/PERFORMANCE.md, "Batched decode and constraints in the service").

        Bytes first: no token stands for more than `max_token_bytes`. For SmolLM2 (81) that lets
        81 bytes a token through where ordinary words take about 5, so a text longer than
        `enough` characters is then cut into pieces of about PIECE_CHARS, each just before a
        space that follows a non-space, where the tokenizer splits anyway (`_cuts_at_spaces`),
        and the pieces are tokenized one by one until the count passes `enough`: the cost
        follows the limit, not the text. A piece's tokens are its tokens in the whole text, save
        for the first and last piece, which a template's text around it may join. Those, and any
        stretch with no cut for twice PIECE_CHARS (one long word, a run of spaces, CJK), count
        by their bytes: all but the two tokens at its ends (at most `max_token_bytes` each) lie
        inside the stretch, made of its bytes, so none is longer than the longest entry made of
        those bytes alone (`_bytes_per_token`: 64 for a run of spaces, a few for CJK; under NFC,
        of the normalized bytes). The text not reached counts a byte a character,
        `max_token_bytes` a token.
        """
        at_least = -(-len(text.encode(errors="replace")) // self.max_token_bytes)
        if at_least > enough or not self.cuts_at_spaces or len(text) <= enough:
            return at_least
        counted, start = 0, 0
        normalized = self.tokenizer.normalizer is not None  # NFC (`_cuts_at_spaces`)
        while start < len(text):
            cut = _CUT.search(text, start + PIECE_CHARS)
            end = cut.start() + 1 if cut else len(text)
            piece = text[start:end]
            if start == 0 or end == len(text) or end - start > 2 * PIECE_CHARS:
                data = (unicodedata.normalize("NFC", piece) if normalized else piece).encode(errors="replace")
                inside = len(data) - 2 * self.max_token_bytes
                counted += -(-max(inside, 0) // self._bytes_per_token(data))
            else:
                counted += len(self.encode(piece, add_special_tokens=False))
            start = end
            at_least = counted - (-(len(text) - end) // self.max_token_bytes)
            if at_least > enough:
                break
        return at_least

    def _bytes_per_token(self, data: bytes) -> int:
        """The most bytes a token made only of bytes in `data` has (the longest such entry)."""
        absent = np.bincount(np.frombuffer(data, np.uint8), minlength=256) == 0  # [256]
        outside = np.packbits(absent, bitorder="little").view(np.uint64)  # [4]
        fits = ~(self._entry_bits & outside).any(axis=1)  # [entries]
        return int(self._entry_bytes[fits.argmax()]) if fits.any() else 1

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
        return self.encode_rendered(self.render(messages, tools=tools, **template_kwargs))

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered conversation's ids (`render`): the template writes any BOS itself, as
        transformers' apply_chat_template assumes."""
        return self.encode(text, add_special_tokens=False)


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
