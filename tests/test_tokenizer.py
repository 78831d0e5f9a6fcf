"""Chat template and streaming detokenisation without transformers."""

from __future__ import annotations

import json
import random
import time

import pytest
from tiny import make_tiny_model
from transformers import AutoTokenizer

from kvedge.contract import ExportRecipe, Manifest
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.tokenizer import ChatTokenizer, TextStream

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello! How are you?"},
    {"role": "assistant", "content": "Fine, thank you."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_chat_ids_equal_transformers(tiny_llama):
    ours = ChatTokenizer(tiny_llama.out, Manifest.load(tiny_llama.out))
    theirs = AutoTokenizer.from_pretrained(tiny_llama.source)
    expected = theirs.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.encode_chat(CONVERSATION) == list(expected)


def test_bad_roles_are_refused(tiny_llama):
    ours = ChatTokenizer(tiny_llama.out, Manifest.load(tiny_llama.out))
    with pytest.raises(KvedgeError, match="role 'robot' is not one of"):
        ours.encode_chat([{"role": "robot", "content": "hi"}])


def test_stream_holds_back_stop_strings(tiny_llama):
    ours = ChatTokenizer(tiny_llama.out, Manifest.load(tiny_llama.out))
    ids = ours.encode("Hello! How are you today?", add_special_tokens=False)
    stream = TextStream(ours, stop=["are you"])
    text = "".join(stream.push(t) for t in ids) + stream.finish()
    assert stream.stopped
    assert text == "Hello! How "
    plain = TextStream(ours)
    assert "".join(plain.push(t) for t in ids) + plain.finish() == "Hello! How are you today?"


def test_qwen3_thinking_switch_reaches_the_template(tmp_path):
    """`enable_thinking` (the server's chat_template_kwargs) renders as transformers renders it."""
    source = make_tiny_model(tmp_path / "hf", "qwen3")
    export_model(source, tmp_path / "out", ExportRecipe(max_len=64))
    ours = ChatTokenizer(tmp_path / "out", Manifest.load(tmp_path / "out"))
    theirs = AutoTokenizer.from_pretrained(source)
    for thinking in (True, False):
        expected = theirs.apply_chat_template(
            CONVERSATION,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            enable_thinking=thinking,
        )
        assert ours.encode_chat(CONVERSATION, enable_thinking=thinking) == list(expected)
    assert ours.render(CONVERSATION, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in ours.render(CONVERSATION)


# 1 MB of text in the shapes a prompt far over any limit may take
ONE_MB = {
    "words": "word " * 200_000,
    "one long word": "a" * 1_000_000,
    "whitespace runs": (" " * 31 + "\n") * 31_250,
    "CJK": "日本語のテキスト" * 41_667,
    "emoji": "🙂" * 250_000,
    "JSON": json.dumps([{"id": i, "name": f"item {i}", "tags": ["x", "y"]} for i in range(18_000)]),
}


@pytest.fixture(scope="module")
def long_entry(long_entry_artifact) -> ChatTokenizer:
    return ChatTokenizer(long_entry_artifact, Manifest.load(long_entry_artifact))


@pytest.mark.parametrize("shape", ONE_MB)
def test_1_mb_of_any_shape_is_counted_past_a_limit_without_tokenizing_it_whole(long_entry, shape):
    text = ONE_MB[shape]
    assert long_entry.max_token_bytes == 3000  # 1000 bytes, x3 under NFC: by bytes, 334 tokens
    elapsed = []
    for _ in range(3):  # the fastest of three: tokenizing it whole took 0.4-1 s
        started = time.perf_counter()
        fewest = long_entry.fewest_tokens(text, 3000)
        elapsed.append(time.perf_counter() - started)
    assert fewest > 3000 and min(elapsed) < 0.05, (fewest, elapsed)


PARTS = ["word", " ", "   ", "\n", "\n\n ", "\t", "日本語", "🙂", "12345", "3.14", "'s", "don't", ", "]
PARTS += ['{"a": [1, 2]}', "<|im_end|>", "<|im_start|>", "#" * 40, " " * 70, " Hello", "ünïcödé", "e\u0301"]


@pytest.mark.parametrize("seed", range(6))
def test_fewest_tokens_is_never_more_than_the_tokens_alone_or_in_a_conversation(long_entry, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(PARTS) for _ in range(3000 + 2000 * seed))  # 15k-60k characters
    alone = len(long_entry.encode(text, add_special_tokens=False))
    fewest = long_entry.fewest_tokens(text, alone)  # counted to the end, unless it passes `alone`
    assert fewest <= alone
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert fewest <= len(long_entry.encode_chat(conversation))
    assert fewest > 0.6 * alone  # the pieces between the first and last (4096 characters) exactly


def test_a_text_of_exactly_the_limit_is_not_counted_over_it(long_entry):
    text = "The quick brown fox jumps over the lazy dog. " * 700  # 31k characters, in pieces
    tokens = len(long_entry.encode(text, add_special_tokens=False))
    assert long_entry.fewest_tokens(text, tokens) <= tokens
    assert long_entry.fewest_tokens(text, tokens - 1) <= tokens
