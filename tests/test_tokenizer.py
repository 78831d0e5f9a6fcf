"""Chat template and streaming detokenisation without transformers."""

from __future__ import annotations

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
