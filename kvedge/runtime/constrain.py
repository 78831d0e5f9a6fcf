"""Constrained decoding: a JSON schema, a regular expression or a Lark grammar applied as a token
mask in the sampling step, with llguidance (the grammar engine llama.cpp, vLLM and SGLang use).

How a turn uses it (`generate.Turn`)::

    start_mask()   before the model call whose logits the turn samples from: the mask of allowed
                   next tokens is computed in a worker thread while onnxruntime runs (both drop
                   the GIL), so it costs nothing on the critical path when it is the shorter
    apply(logits)  waits for that mask, sets every disallowed token's logit to -inf
    accept(token)  advances the grammar; `stopped` once the grammar admits no more text (the turn
                   then ends with "stop"), and eos is allowed only where the grammar may end

Mask: one bit per token id, [ceil(vocab / 32)] int32 words, bit t % 32 of word t // 32 (little
endian), as llguidance writes it. Grammars are compiled once per distinct source text and kept
(`GRAMMAR_CACHE` of them); the tokenizer's llguidance view is built once per model, on first use
(docs/PERFORMANCE.md, "Batched decode and constraints in the service", says what both cost).

Why llguidance: it works from `tokenizer.json` text with no torch and no transformers (numpy in,
numpy out), computes a mask in well under a decode step for a 49k vocabulary (the same page),
handles byte-fallback tokens and tokens that span JSON punctuation (it matches the bytes of every
token against the grammar's lexer), and takes JSON Schema, regex and Lark from one API. xgrammar
needs its own tokenizer info built from a transformers tokenizer and targets torch tensors;
outlines-core compiles a regex index per schema up front (seconds for large schemas).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.errors import KvedgeError
from kvedge.runtime import json_schema

KINDS = ("json_schema", "json_object", "regex", "lark")
GRAMMAR_CACHE = 64  # compiled grammars kept per model
ANY_JSON_OBJECT = '{"type": "object"}'
# JSON is written as json.dumps writes it (and chat templates' tojson): ", " and ": ", no newlines
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `source`: a JSON Schema (JSON text), a regular expression or a
    Lark grammar; `json_object` needs none (any JSON object). `lenient` (json_schema only): what
    llguidance does not implement is ignored and an overlapping oneOf read as anyOf, so the output
    may break those parts (kvedge.runtime.json_schema)."""

    kind: str
    source: str = ""
    lenient: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KvedgeError(f"constraint kind {self.kind!r} is not supported; allowed: {list(KINDS)}")
        if self.kind != "json_object" and not self.source:
            raise KvedgeError(f"a {self.kind} constraint needs its text")
        if self.lenient and self.kind != "json_schema":
            raise KvedgeError(f"lenient applies to json_schema constraints, not {self.kind}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, lenient: bool = False) -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order is output order
        return cls("json_schema", text, lenient)

    def grammar(self) -> Compiled:
        """The llguidance grammar text (not yet validated) and what of the schema it ignores as the
        spec says to; raises KvedgeError naming what is wrong."""
        import llguidance

        try:
            if self.kind == "regex":
                return Compiled(llguidance.LLMatcher.grammar_from_regex(self.source))
            if self.kind == "lark":
                return Compiled(llguidance.LLMatcher.grammar_from_lark(self.source))
            prepared = json_schema.prepare(self.schema())
            options = {"lenient": self.lenient, "coerce_one_of": self.lenient}  # over any x-guidance
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                prepared.schema, defaults=JSON_STYLE, overrides=options
            )
            return Compiled(grammar, prepared.ignored)
        except (ValueError, TypeError) as exc:
            raise KvedgeError(f"the {self.kind} constraint does not compile: {exc}") from None

    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema (json_schema and json_object kinds)."""
        text = ANY_JSON_OBJECT if self.kind == "json_object" else self.source
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise KvedgeError(f"the JSON schema is not valid JSON ({exc})") from None
        if not isinstance(schema, dict | bool):
            raise KvedgeError("a JSON schema must be an object (or true/false)")
        return schema

    def refusal(self, message: str) -> str:
        """Why llguidance refused the grammar (its `message`), in words that name what to change."""
        if self.kind in ("json_schema", "json_object"):
            message = json_schema.refusal(message, json_schema.prepare(self.schema()))
        return f"the {self.kind} constraint is not supported: {message}"


@dataclass(frozen=True)
class Compiled:
    grammar: str  # llguidance's grammar text
    # what of the schema the grammar does not enforce: unknown formats ('format=url'), and under
    # `lenient` the keywords llguidance ignored ('uniqueItems', 'oneOf=anyOf')
    ignored: tuple[str, ...] = ()


class Grammars:
    """The model's side of constrained decoding: its tokenizer as llguidance sees it, compiled
    grammars, and the worker thread that computes masks while the model runs."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, list(eos_ids)
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                try:
                    import llguidance
                except ImportError:
                    raise KvedgeError(
                        "constrained decoding needs llguidance: pip install llguidance"
                    ) from None
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_json.read_text(), n_vocab=self.vocab_size, eos_token=self.eos_ids
                )
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvedge-mask")
            return self._tokenizer

    def compile(self, constraint: Constraint) -> Compiled:
        """The constraint's grammar, validated against this tokenizer (cached)."""
        import llguidance

        tokenizer = self.tokenizer()
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                return compiled
        compiled = constraint.grammar()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled.grammar, tokenizer)
        if is_error:
            raise KvedgeError(constraint.refusal(messages[0]))
        if messages:  # warnings: what a lenient compilation ignored
            ignored = [*compiled.ignored, *json_schema.lenient_notes(messages)]
            compiled = Compiled(compiled.grammar, json_schema.notes(ignored))
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, constraint: Constraint) -> Matcher:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), self.compile(constraint).grammar, log_level=0)
        if matcher.is_error():
            raise KvedgeError(f"the {constraint.kind} constraint cannot start: {matcher.get_error()}")
        assert self._worker is not None
        return Matcher(matcher, self.vocab_size, self._worker)

    def accepts(self, constraint: Constraint, tokens: Sequence[int]) -> bool:
        """Whether `tokens` are a whole output of `constraint`: the grammar may end after them (a
        turn cut by max_new_tokens or the context may stop short of that)."""
        matcher = self.matcher(constraint)
        for token in tokens:
            matcher.accept(token)
        return bool(matcher.matcher.is_accepting())


class Matcher:
    """One turn's grammar state."""

    def __init__(self, matcher: Any, vocab_size: int, worker: ThreadPoolExecutor) -> None:
        self.matcher, self.vocab_size, self.worker = matcher, vocab_size, worker
        self.bits = np.zeros((vocab_size + 31) // 32, np.int32)  # [words] the next token's mask
        self._pending: Future | None = None

    @property
    def stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def start_mask(self) -> None:
        """Compute the next token's mask in the worker thread (call before the model runs)."""
        if self._pending is None:
            self._pending = self.worker.submit(self._fill)

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """`logits` [vocab] with every token the grammar does not allow next set to -inf (a copy)."""
        self.start_mask()
        assert self._pending is not None
        self._pending.result()
        self._pending = None
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: logits.size]  # [vocab]
        if not allowed.any():
            raise KvedgeError(f"the constraint allows no next token ({self.error or 'dead end'})")
        return np.where(allowed.astype(bool), logits, -np.inf)

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar takes in a row from its state now (which stays)."""
        if self._pending is not None:  # the worker may be reading the matcher: let it finish
            self._pending.result()
        return int(self.matcher.validate_tokens(list(tokens)))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise KvedgeError(f"the constraint refused token {token} ({self.error})")
