"""Multi-turn sessions, context policies and warm prefixes against full re-prefill references."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import random_ids
from tiny import make_tiny_model

from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.export.export import ExportOptions, export_model
from kvedge.runtime.generate import SamplingConfig, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.sessions import ContextPolicy

ATOL = 1e-4  # fp32 both sides, same graph; measured differences ~1e-6 (see test_parity)
GREEDY = SamplingConfig(max_new_tokens=12)
QUESTIONS = [
    "Hello! How are you today?",
    "What is the capital of France?",
    "Tell me about the KV cache.",
    "Jetson Orin boards share memory.",
    "The quick brown fox jumps over the lazy dog.",
    "Thank you, I am fine.",
    "How are you?",
    "Paris?",
    "What does a cache store?",
    "Goodbye!",
]


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    source = make_tiny_model(root / "hf", "llama", seed=3)
    export_model(source, root / "out", ExportOptions(max_len=512))
    return root / "out"


def fresh_logits(reference: Model, ids: list[int]) -> np.ndarray:
    """Next-token logits of a full re-prefill of `ids` from an empty slot."""
    reference.cache.reset(0)
    return prefill(reference.backend, reference.cache, 0, [ids])[0]


def reply(model: Model, messages, slot: int = 0) -> str:
    return "".join(event.text for event in model.chat(messages, GREEDY, slot=slot))


def test_ten_turns_reuse_equals_full_reprefill_and_repeats(long_llama):
    def converse() -> list[str]:
        model, reference = Model(long_llama), Model(long_llama)
        messages = [{"role": "system", "content": "Be brief."}]
        replies = []
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            ids = model.tokenizer.encode_chat(messages)
            logits = model.prepare(0, ids)
            if turn:  # from turn 2 on, the previous turns come from the cache
                assert model.sessions[0].reused_tokens > len(ids) // 2
            np.testing.assert_allclose(logits, fresh_logits(reference, ids), atol=ATOL, rtol=0)
            replies.append(reply(model, messages))
            messages.append({"role": "assistant", "content": replies[-1]})
        return replies

    first = converse()
    assert first == converse()
    assert len(set(first)) > 1


def test_edited_history_and_regeneration_follow_the_prefix_rule(long_llama):
    model, reference = Model(long_llama), Model(long_llama)
    messages = [{"role": "user", "content": q} for q in QUESTIONS[:1]]
    messages.append({"role": "assistant", "content": reply(model, messages)})
    messages.append({"role": "user", "content": QUESTIONS[1]})
    reply(model, messages)
    edited = [{"role": "user", "content": "An edited first question?"}, *messages[1:]]
    ids = model.tokenizer.encode_chat(edited)
    np.testing.assert_allclose(model.prepare(0, ids), fresh_logits(reference, ids), atol=ATOL, rtol=0)
    regenerate = model.tokenizer.encode_chat(edited)  # same conversation again: regenerate the answer
    np.testing.assert_allclose(model.prepare(0, regenerate), fresh_logits(reference, ids), atol=ATOL, rtol=0)
    assert model.sessions[0].reused_tokens == len(ids) - 1


def test_tampered_slot_is_detected_and_reprefilled(long_llama, caplog):
    model, reference = Model(long_llama), Model(long_llama)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    messages.append({"role": "assistant", "content": reply(model, messages)})
    messages.append({"role": "user", "content": QUESTIONS[1]})
    model.cache.tokens[0, 3] += 1  # the record no longer matches what the session left
    ids = model.tokenizer.encode_chat(messages)
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.model"):
        logits = model.prepare(0, ids)
    assert "re-prefilling" in caplog.text
    assert model.sessions[0].reused_tokens == 0
    np.testing.assert_allclose(logits, fresh_logits(reference, ids), atol=ATOL, rtol=0)


def test_interleaved_sessions_equal_each_run_alone(long_llama):
    together = Model(long_llama, slots=3)
    conversations = [[{"role": "system", "content": f"You are assistant {i}."}] for i in range(3)]
    for turn in range(3):
        for slot, messages in enumerate(conversations):
            messages.append({"role": "user", "content": QUESTIONS[(turn * 3 + slot) % len(QUESTIONS)]})
            messages.append({"role": "assistant", "content": reply(together, messages, slot=slot)})
    for conversation in conversations:
        alone, messages = Model(long_llama), []
        for message in conversation:
            if message["role"] == "assistant":
                assert reply(alone, messages) == message["content"]
            messages.append(message)


def test_error_policy_names_the_counts_and_keeps_serving(long_llama):
    model = Model(long_llama)
    long_text = " ".join(QUESTIONS * 12)
    with pytest.raises(
        ContextOverflow, match=r"the conversation has \d+ tokens; the cache holds at most 512"
    ):
        list(model.chat([{"role": "user", "content": long_text}], GREEDY))
    assert model.cache.length(0) == 0
    events = list(model.chat([{"role": "user", "content": QUESTIONS[0]}], GREEDY))
    assert events[-1].finish_reason in ("stop", "length") and events[-1].completion_tokens >= 1


def test_truncate_policy_drops_oldest_turns_keeping_system(long_llama):
    model = Model(long_llama, policy=ContextPolicy(mode="truncate"))
    system = {"role": "system", "content": "Be brief."}
    messages = [system]
    for question in QUESTIONS * 3:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": question * 2}]
    messages.append({"role": "user", "content": "Last question?"})
    assert len(model.tokenizer.encode_chat(messages)) > 512
    kept, ids = model._truncate_turns(messages, model.tokenizer.encode_chat(messages), GREEDY.max_new_tokens)
    assert kept[0] == system and kept[-1] == messages[-1] and kept[1]["role"] == "user"
    assert len(ids) <= 512 - GREEDY.max_new_tokens
    assert reply(model, messages) == reply(Model(long_llama), kept)


def test_bad_policy_is_named():
    with pytest.raises(
        KvedgeError, match="context_policy='slide' is not allowed; allowed: \\['error', 'window'"
    ):
        ContextPolicy(mode="slide")


def kept_layer0(model: Model, reference: Model) -> None:
    """Layer 0's K/V depend only on token and position: after eviction they must equal a fresh run."""
    kept = [int(t) for t in model.cache.token_ids(0)]
    reference.cache.reset(0)
    prefill(reference.backend, reference.cache, 0, [kept])
    n = len(kept)
    np.testing.assert_allclose(
        model.cache.pool[0, :, 0, :, :n], reference.cache.pool[0, :, 0, :, :n], atol=ATOL, rtol=0
    )


def test_window_eviction_matches_fresh_run_over_kept_tokens(tiny):
    policy = ContextPolicy(mode="window", n_sink=4, evict_chunk=32)
    model, reference = Model(tiny.out, policy=policy), tiny.model()
    ids = random_ids(128, seed=11)
    model.prepare(0, ids)
    assert model.cache.length(0) == 128 and model.sessions[0].evicted == 0
    more = ids + random_ids(10, seed=12)
    logits = model.prepare(0, more)
    kept = [int(t) for t in model.cache.token_ids(0)]
    assert model.sessions[0].evicted == 32 and len(kept) == 128 - 32 + 10
    assert kept[:4] == ids[:4] and kept[4:] == more[36:]
    kept_layer0(model, reference)
    assert np.isfinite(logits).all()


def test_window_logits_exact_on_one_layer_model(tmp_path):
    """With one layer every cache entry is a function of token and position only, so the whole
    output after eviction must equal a fresh run over exactly the kept tokens."""
    source = make_tiny_model(tmp_path / "hf", "llama", num_hidden_layers=1)
    export_model(source, tmp_path / "out", ExportOptions(max_len=64))
    model = Model(tmp_path / "out", policy=ContextPolicy(mode="window", n_sink=2, evict_chunk=16))
    reference = Model(tmp_path / "out")
    events = list(
        model.chat([{"role": "user", "content": " ".join(QUESTIONS[:3])}], SamplingConfig(max_new_tokens=150))
    )
    assert model.sessions[0].evicted > 0 and events[-1].finish_reason in ("stop", "length")
    ids = random_ids(5, seed=13)
    logits = model.prepare(0, model.sessions[0].history + ids)
    kept = [int(t) for t in model.cache.token_ids(0)]
    np.testing.assert_allclose(logits, fresh_logits(reference, kept), atol=ATOL, rtol=0)
