"""Constrained decoding: the mask logic on tiny models and tokenizers built in code, checked with
a JSON Schema validator and Python's own regex engine, never by hand."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvedge.errors import KvedgeError
from kvedge.runtime.constrain import Constraint, Grammars
from kvedge.runtime.model import Model, SamplingConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "open": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "rank", "open"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)\."
MESSAGES = [{"role": "user", "content": "Hello! What is the capital of France?"}]


def sampled(model: Model, constraint: Constraint, seed: int, slot: int = 0) -> list:
    config = SamplingConfig(max_new_tokens=120, temperature=1.0, seed=seed, constraint=constraint)
    return list(model.chat(MESSAGES, config, slot=slot))


def text_of(events) -> str:
    return "".join(e.text for e in events)


def test_json_schema_output_validates_for_every_seed(tiny_llama):
    model = tiny_llama.model()
    for seed in range(12):
        events = sampled(model, Constraint.json_schema(SCHEMA), seed)
        assert events[-1].finish_reason == "stop", (seed, text_of(events))
        jsonschema.validate(json.loads(text_of(events)), SCHEMA)


def test_regex_output_matches_for_every_seed(tiny_llama):
    model = tiny_llama.model()
    outputs = set()
    for seed in range(12):
        events = sampled(model, Constraint("regex", REGEX), seed)
        assert re.fullmatch(REGEX, text_of(events)), (seed, text_of(events))
        outputs.add(text_of(events))
    assert len(outputs) > 1  # sampling still chooses among what the grammar allows


def test_unconstrained_output_does_not_match(tiny_llama):
    """The random model left alone does not write the pattern: the mask is what makes it."""
    model = tiny_llama.model()
    texts = [
        text_of(model.chat(MESSAGES, SamplingConfig(max_new_tokens=30, temperature=1.0, seed=s)))
        for s in range(4)
    ]
    assert not any(re.fullmatch(REGEX, t) for t in texts)


def test_constraints_in_batched_decode_equal_each_row_alone(tiny_llama):
    constraints = [Constraint.json_schema(SCHEMA), Constraint("regex", REGEX), None]
    alone = tiny_llama.model()
    want = [
        [(e.text, e.token, e.finish_reason) for e in sampled(alone, c, seed)] if c else None
        for seed, c in enumerate(constraints)
    ]
    want[2] = [
        (e.text, e.token, e.finish_reason)
        for e in alone.chat(MESSAGES, SamplingConfig(max_new_tokens=20, temperature=1.0, seed=2))
    ]
    model = tiny_llama.model(slots=3)
    ids = model.encode_chat(MESSAGES)
    configs = [
        SamplingConfig(max_new_tokens=120, temperature=1.0, seed=s, constraint=c)
        for s, c in enumerate(constraints)
    ]
    configs[2] = SamplingConfig(max_new_tokens=20, temperature=1.0, seed=2)
    turns = [model.begin(slot, ids, config) for slot, config in enumerate(configs)]
    got: list[list] = [[] for _ in turns]
    calls = 0
    while not all(t.done for t in turns):
        result = model.step([t for t in turns if not t.done])
        calls += len(result.decode_calls)
        for i, turn in enumerate(turns):
            if turn in result.events:
                e = result.events[turn]
                got[i].append((e.text, e.token, e.finish_reason))
    assert got == want
    assert calls < sum(len(w) for w in want) - 3  # rows really were decoded together


def test_a_token_spanning_punctuation_is_allowed_where_its_bytes_fit(tiny_llama):
    """The tiny tokenizer has merged tokens such as '.' + 'Paris'-pieces; a regex that pins the
    text exactly is still reachable, and every seed writes exactly it."""
    model = tiny_llama.model()
    target = '{"answer": "Paris.", "q": "How are you?"}'
    for seed in range(4):
        events = sampled(model, Constraint("regex", re.escape(target)), seed)
        assert text_of(events) == target
        assert len(events) < len(target)  # multi-character tokens were used


def byte_fallback_tokenizer(path) -> None:
    """A sentencepiece-style tokenizer: a few word pieces, then <0xNN> tokens for every byte."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "é", "▁caf", "{", '"', ":", "}", '":', "▁the"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.save(str(path))
    return tok


@pytest.mark.parametrize("pattern", [r"caf(é|e) [αβγ]{2}", r'\{"k": "[ñü€]+"\}'])
def test_byte_fallback_tokens_build_multibyte_characters(tmp_path, pattern):
    """Random logits over a byte-fallback vocabulary: characters outside the word pieces can only
    be written byte by byte, and the masked samples still spell text the pattern accepts."""
    tok = byte_fallback_tokenizer(tmp_path / "tokenizer.json")
    vocab = tok.get_vocab_size()
    grammars = Grammars(tmp_path / "tokenizer.json", vocab, [2])
    rng = np.random.default_rng(0)
    for seed in range(10):
        matcher = grammars.matcher(Constraint("regex", pattern))
        ids: list[int] = []
        while not matcher.stopped:
            logits = matcher.apply(rng.normal(size=vocab).astype(np.float32) * 3)
            token = int(np.argmax(logits))
            if token == 2:
                break
            matcher.accept(token)
            ids.append(token)
        text = tok.decode(ids)
        assert re.fullmatch(pattern, text), (seed, text)


def test_bad_constraints_are_refused_by_name(tiny_llama):
    model = tiny_llama.model()
    with pytest.raises(KvedgeError, match="not valid JSON"):
        model.begin(0, [5, 6], SamplingConfig(constraint=Constraint("json_schema", "{not json")))
    with pytest.raises(KvedgeError, match="regex"):
        model.begin(0, [5, 6], SamplingConfig(constraint=Constraint("regex", "(unclosed")))
    with pytest.raises(KvedgeError, match="constraint kind 'xml'"):
        Constraint("xml", "<a/>")
    with pytest.raises(KvedgeError, match="logprobs"):
        SamplingConfig(logprobs=99)


def test_logprobs_are_the_models_log_softmax(tiny_llama):
    model = tiny_llama.model()
    config = SamplingConfig(max_new_tokens=3, temperature=0.0, logprobs=3)
    events = list(model.chat(MESSAGES, config))
    logits = model.prepare(0, model.encode_chat(MESSAGES))
    z = logits.astype(np.float64)
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    first = events[0]
    assert first.token == int(np.argmax(logits))
    assert first.logprob == pytest.approx(logp[first.token], abs=1e-5)
    assert [t for t, _ in first.top_logprobs] == list(np.argsort(-logp)[:3])
    assert first.top_logprobs[0][1] == pytest.approx(first.logprob, abs=1e-9)


def test_cli_generate_with_a_schema_a_regex_and_bad_options(tiny_llama, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))

    def kvedge(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "kvedge", "generate", "--model", str(tiny_llama.out), "Hello!"]
        return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)

    done = kvedge(
        "--json-schema", str(schema), "--temperature", "1", "--seed", "4", "--max-new-tokens", "120"
    )
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMA)
    done = kvedge("--regex", REGEX, "--temperature", "1", "--seed", "5", "--logprobs", "2")
    assert done.returncode == 0 and re.fullmatch(REGEX, done.stdout.strip()), done.stderr
    assert "top:" in done.stderr
    for args, message in [
        (("--regex", "("), "unclosed group"),
        (("--json-schema", str(tmp_path / "missing.json")), "cannot read it"),
        (("--regex", "a", "--json-schema", str(schema)), "at most one of"),
    ]:
        done = kvedge(*args)
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


# Small equivalents of what JSONSchemaBench's real schemas hold (kvedge.runtime.json_schema),
# written here: each compiles as the spec reads it, and every sampled output validates.
ONE_OF_TYPES = {
    "$defs": {"name": {"type": "string", "maxLength": 5}, "count": {"type": "integer", "minimum": 0}},
    "type": "object",
    "properties": {"v": {"oneOf": [{"$ref": "#/$defs/name"}, {"$ref": "#/$defs/count"}]}},
    "required": ["v"],
    "additionalProperties": False,
}
ONE_OF_TAGGED = {
    "type": "object",
    "properties": {
        "shape": {
            "type": "object",
            "oneOf": [
                {
                    "properties": {"kind": {"const": "dot"}},
                    "required": ["kind"],
                    "additionalProperties": False,
                },
                {
                    "properties": {
                        "kind": {"enum": ["box", "bar"]},
                        "side": {"type": "integer", "maximum": 9},
                    },
                    "required": ["kind", "side"],
                    "additionalProperties": False,
                },
            ],
        }
    },
    "required": ["shape"],
    "additionalProperties": False,
}
ONE_OF_RANGES = {
    "oneOf": [{"type": "integer", "maximum": -1}, {"type": "integer", "minimum": 0, "maximum": 99}]
}
UNKNOWN_FORMAT = {
    "type": "object",
    "properties": {"home": {"type": "string", "format": "url", "maxLength": 12}, "at": {"format": "no-such"}},
    "required": ["home"],
    "additionalProperties": False,
}
DEPENDENCIES = {
    "type": "object",
    "properties": {
        "card": {"type": "integer", "maximum": 99},
        "name": {"type": "string", "maxLength": 4},
        "zip": {"type": "integer", "maximum": 99},
    },
    "dependencies": {"card": ["name"]},
    "dependentRequired": {"name": ["zip"]},
    "additionalProperties": False,
}
NOT_UNIQUE = {
    "type": "array",
    "items": {"type": "integer", "maximum": 9},
    "maxItems": 3,
    "uniqueItems": False,
}
SPEC_CASES = {
    "oneOf of $ref'd types": ONE_OF_TYPES,
    "oneOf tagged by a required const": ONE_OF_TAGGED,
    "oneOf of integer ranges": ONE_OF_RANGES,
    "unknown format": UNKNOWN_FORMAT,
    "dependencies": DEPENDENCIES,
    "uniqueItems false": NOT_UNIQUE,
}


@pytest.mark.parametrize("name", SPEC_CASES)
def test_schemas_compile_as_the_spec_reads_them(tiny_llama, name):
    schema = SPEC_CASES[name]
    model = tiny_llama.model()
    for seed in range(6):
        events = sampled(model, Constraint.json_schema(schema), seed)
        assert events[-1].finish_reason == "stop", (seed, text_of(events))
        jsonschema.Draft7Validator(schema).validate(json.loads(text_of(events)))  # 7: `dependencies`


NUMBER_OR_INTEGER = {
    "type": "object",
    "properties": {"n": {"oneOf": [{"type": "number", "maximum": 9}, {"type": "integer", "maximum": 9}]}},
    "required": ["n"],
    "additionalProperties": False,
}
REFUSED = [
    (NUMBER_OR_INTEGER, "oneOf at /properties/n"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "not": {"required": ["a"]}}, "not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if", "then"'),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
]


@pytest.mark.parametrize("schema, named", REFUSED)
def test_what_the_library_cannot_enforce_is_refused_by_name_unless_lenient(tiny_llama, schema, named):
    model = tiny_llama.model()
    with pytest.raises(KvedgeError, match="set lenient_schemas") as refused:
        model.grammars.compile(Constraint.json_schema(schema))
    assert named in str(refused.value)
    assert model.grammars.compile(Constraint.json_schema(schema, lenient=True)).ignored


def test_a_lenient_overlapping_one_of_is_read_as_any_of(tiny_llama):
    """An integer matches both branches, so the output may break "exactly one": why lenient is off
    by default. It does match anyOf, which is what the grammar enforces."""
    model = tiny_llama.model()
    constraint = Constraint.json_schema(NUMBER_OR_INTEGER, lenient=True)
    assert model.grammars.compile(constraint).ignored == ("oneOf=anyOf",)
    any_of = json.loads(json.dumps(NUMBER_OR_INTEGER).replace("oneOf", "anyOf"))
    for seed in range(6):
        events = sampled(model, constraint, seed)
        assert events[-1].finish_reason == "stop", (seed, text_of(events))
        jsonschema.validate(json.loads(text_of(events)), any_of)


def test_unknown_formats_are_named_as_ignored(tiny_llama):
    model = tiny_llama.model()
    compiled = model.grammars.compile(Constraint.json_schema(UNKNOWN_FORMAT))
    assert compiled.ignored == ("format=url", "format=no-such")
    known = {"type": "string", "format": "date"}
    assert model.grammars.compile(Constraint.json_schema(known)).ignored == ()
