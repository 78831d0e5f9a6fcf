"""Multi-turn sessions, context policies and warm prefixes against full re-prefill references."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import random_ids
from tiny import make_tiny_model

from kvedge.contract import CacheGeometry, ExportRecipe, Manifest
from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.cache import KVBlock, KVCache
from kvedge.runtime.generate import SamplingConfig, TurnState, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import RunTimePrefixStore
from kvedge.runtime.sessions import HistoryPolicy

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
    export_model(source, root / "out", ExportRecipe(max_len=512))
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


def test_a_turn_is_prefilling_then_generating_then_finished(long_llama):
    """`Turn.state` through one turn: a prompt of three chunks prefills a chunk a step, its last
    chunk's step samples the first token (pending), each later step one more, until the limit."""
    model = Model(long_llama)
    turn = model.begin(0, random_ids(70, seed=5), SamplingConfig(max_new_tokens=3))
    turn.chunk = 32
    states = [turn.state]
    while turn.state is not TurnState.FINISHED:
        model.step([turn])
        states.append(turn.state)
        assert (turn.pending is not None) == (turn.state is TurnState.GENERATING)
    assert states == [TurnState.PREFILLING] * 3 + [TurnState.GENERATING] * 2 + [TurnState.FINISHED]
    assert turn.finish_reason == "length" and turn.produced == 3


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
    model = Model(long_llama, policy=HistoryPolicy(mode="truncate"))
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
        KvedgeError, match="history_policy='slide' is not allowed; allowed: \\['error', 'window'"
    ):
        HistoryPolicy(mode="slide")


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
    if Manifest.load(tiny.out).geometry.ring_layers:
        pytest.skip("window eviction is refused for ring layers (tests/test_gemma3.py)")
    policy = HistoryPolicy(mode="window", n_sink=4, evict_chunk=32)
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


def test_multi_turn_reuse_equals_reprefill(tiny):
    """Each turn prefills only its new suffix onto the kept cache; the logits must equal a fresh
    prefill of the whole conversation (every family and graph variant)."""
    model, reference = tiny.model(), tiny.model()
    messages = [{"role": "system", "content": "Be brief."}]
    for turn, question in enumerate(QUESTIONS[6:8]):  # short ones: 128 slots hold them
        messages.append({"role": "user", "content": question})
        ids = model.tokenizer.encode_chat(messages)
        logits = model.prepare(0, ids)
        assert turn == 0 or model.sessions[0].reused_tokens > 0
        np.testing.assert_allclose(logits, fresh_logits(reference, ids), atol=ATOL, rtol=0)
        messages.append({"role": "assistant", "content": f"Answer {turn}."})


def test_window_logits_exact_on_one_layer_model(tmp_path):
    """With one layer every cache entry is a function of token and position only, so the whole
    output after eviction must equal a fresh run over exactly the kept tokens."""
    source = make_tiny_model(tmp_path / "hf", "llama", num_hidden_layers=1)
    export_model(source, tmp_path / "out", ExportRecipe(max_len=64))
    model = Model(tmp_path / "out", policy=HistoryPolicy(mode="window", n_sink=2, evict_chunk=16))
    reference = Model(tmp_path / "out")
    events = list(
        model.chat([{"role": "user", "content": " ".join(QUESTIONS[:3])}], SamplingConfig(max_new_tokens=150))
    )
    assert model.sessions[0].evicted > 0 and events[-1].finish_reason in ("stop", "length")
    ids = random_ids(5, seed=13)
    logits = model.prepare(0, model.sessions[0].history + ids)
    kept = [int(t) for t in model.cache.token_ids(0)]
    np.testing.assert_allclose(logits, fresh_logits(reference, kept), atol=ATOL, rtol=0)


# Run-time prefix store (RunTimePrefixStore): pure tests on a small cache, then end to end on tiny models.
GEOMETRY = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=32, max_len=128)
INT8 = GEOMETRY.with_dtype("int8", 16)
BLOCK = 8  # tokens per arena block in the pure tests


def filled(geometry: CacheGeometry, ids: list[int], seed: int, slots: int = 2) -> KVCache:
    """A cache whose slot 0 holds `ids` with random KV (and scales)."""
    rng = np.random.default_rng(seed)
    shape = (geometry.num_layers, 2, geometry.num_kv_heads, len(ids), geometry.head_dim)
    kv = (rng.standard_normal(shape) * 50).astype(geometry.np_dtype)
    scales = None
    if geometry.quantized:
        scales = rng.random((*shape[:-1], geometry.scale_groups)).astype(np.float16)
    cache = KVCache(geometry, slots)
    cache.write(0, KVBlock(kv, scales), ids)
    return cache


def test_lru_keeps_its_arena_within_the_budget_over_many_saves():
    budget = 5 * BLOCK * GEOMETRY.bytes_per_token() + 123  # room for 5 blocks, not 6
    lru = RunTimePrefixStore(GEOMETRY, budget, block_tokens=BLOCK)
    assert lru.capacity_blocks == 5 and lru.kv.nbytes <= budget
    rng = np.random.default_rng(0)
    for i in range(200):
        ids = random_ids(int(rng.integers(1, 60)), seed=100 + i)
        lru.save(filled(GEOMETRY, ids, seed=i), 0)
        assert lru.nbytes <= lru.capacity_bytes <= budget
        used = [b for entry in lru.entries.values() for b in entry.blocks]
        assert sorted(used + lru.free) == list(range(5))  # every block owned exactly once
        kept = min(len(ids), 5 * BLOCK)  # a sequence longer than the arena keeps its head
        entry, shared = lru.best_match(ids)
        assert shared == kept and list(entry.token_ids) == ids[:kept]
    assert lru.evictions > 100


def test_lru_evicts_the_least_recently_used_entry():
    lru = RunTimePrefixStore(
        GEOMETRY, 4 * BLOCK * GEOMETRY.bytes_per_token(), block_tokens=BLOCK
    )  # 2 x 16 tokens
    a, b, c = (random_ids(16, seed=s) for s in (1, 2, 3))
    lru.save(filled(GEOMETRY, a, seed=1), 0)
    lru.save(filled(GEOMETRY, b, seed=2), 0)
    target = KVCache(GEOMETRY, 1)
    lru.load(target, 0, *lru.best_match(a + [7]))  # a hit makes `a` the most recent
    lru.save(filled(GEOMETRY, c, seed=3), 0)
    assert lru.best_match(b)[1] == 0 and lru.best_match(a)[1] == 16 and lru.best_match(c)[1] == 16
    lru.save(filled(GEOMETRY, a, seed=1), 0)  # saving what an entry holds counts as a use too
    lru.save(filled(GEOMETRY, b, seed=2), 0)
    assert lru.best_match(c)[1] == 0 and lru.best_match(a)[1] == 16
    assert (lru.hits, lru.hit_tokens, lru.evictions) == (1, 16, 2)


def test_lru_longer_sequence_replaces_the_entry_it_extends():
    lru = RunTimePrefixStore(GEOMETRY, 20 * BLOCK * GEOMETRY.bytes_per_token(), block_tokens=BLOCK)
    ids = random_ids(40, seed=5)
    lru.save(filled(GEOMETRY, ids[:20], seed=5), 0)
    lru.save(filled(GEOMETRY, ids, seed=5), 0)
    lru.save(filled(GEOMETRY, ids[:30], seed=5), 0)  # already held by the longer entry
    assert len(lru) == 1 and lru.nbytes == 5 * BLOCK * GEOMETRY.bytes_per_token()


@pytest.mark.parametrize("geometry", [GEOMETRY, INT8], ids=["float32", "int8"])
def test_lru_load_copies_exactly_what_was_saved(geometry):
    ids = random_ids(45, seed=6)
    source = filled(geometry, ids, seed=6)
    lru = RunTimePrefixStore(geometry, 10 * BLOCK * geometry.bytes_per_token(), block_tokens=BLOCK)
    lru.save(source, 0)
    target = filled(geometry, ids[:11] + random_ids(20, seed=7), seed=7, slots=1)
    entry, shared = lru.best_match(ids[:37] + [1, 2])
    lru.load(target, 0, entry, shared, start=11)  # the target already holds the first 11 tokens
    assert shared == 37 and target.length(0) == 37 and list(target.token_ids(0)) == ids[:37]
    expected, got = source.read(0, 37), target.read(0, 37)
    np.testing.assert_array_equal(got.kv[:, :, :, 11:], expected.kv[:, :, :, 11:])
    if geometry.quantized:
        np.testing.assert_array_equal(got.scales[:, :, :, 11:], expected.scales[:, :, :, 11:])


def test_lru_budget_below_one_block_is_named():
    with pytest.raises(KvedgeError, match=r"prefix_cache_bytes=1000 is less than one block of 32 tokens"):
        RunTimePrefixStore(GEOMETRY, 1000)
    assert not RunTimePrefixStore(GEOMETRY, 0)  # 0: off


def returning_user(folder, budget: int, atol: float) -> None:
    """User A's conversation loses its slot to user B; A's next turn must come from the store
    and give the logits of a full re-prefill."""
    model, reference = Model(folder, prefix_cache_bytes=budget), Model(folder)
    a = [
        {"role": "system", "content": "You are assistant A. " * 3},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    a.append({"role": "assistant", "content": reply(model, a)})
    a.append({"role": "user", "content": QUESTIONS[1]})
    held_a = model.cache.length(0)
    reply(model, [{"role": "user", "content": QUESTIONS[2]}])  # user B takes the slot
    assert len(model.prefixes.run_time) == 1 and model.prefixes.run_time.hits == 0
    ids = model.tokenizer.encode_chat(a)
    logits = model.prepare(0, ids)
    assert model.prefixes.run_time.hits == 1 and model.sessions[0].reused_tokens >= held_a - 4
    np.testing.assert_allclose(logits, fresh_logits(reference, ids), atol=atol, rtol=0)
    assert len(model.prefixes.run_time) == 2  # B's conversation was kept in turn
    assert model.prefixes.run_time.nbytes <= budget


def test_returning_conversation_reuses_the_store_exactly(long_llama):
    returning_user(long_llama, 2**20, ATOL)


def test_returning_conversation_reuses_the_store_exactly_int8(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "llama", seed=3)
    export_model(source, tmp_path / "int8", ExportRecipe(max_len=256, kv_dtype="int8"))
    returning_user(tmp_path / "int8", 2**20, 2e-3)  # tolerance of tests/test_kv_int8.py, same reason


def test_service_config_passes_the_store_budget_to_the_model(long_llama):
    from kvedge.serve.config import load_service_config
    from kvedge.serve.service import load_model

    with pytest.raises(
        KvedgeError, match=r"--prefix-cache-bytes=-1 is not allowed; allowed: a number of bytes"
    ):
        load_service_config(None, {"model": long_llama, "prefix_cache_bytes": -1})
    assert load_service_config(None, {"model": long_llama}).prefix_cache_bytes == 0
    config = load_service_config(None, {"model": long_llama, "prefix_cache_bytes": 2**20})
    model = load_model(config, slots=1)
    assert 2**20 - model.prefixes.run_time.block_bytes < model.prefixes.run_time.capacity_bytes <= 2**20


def test_long_prefill_is_chunked_between_decode_steps_of_other_turns(long_llama):
    """`Model.step` runs one prefill chunk of a long prompt per step while another slot keeps
    decoding, and both give exactly the events each gives alone."""
    model, alone = Model(long_llama, slots=2), Model(long_llama)
    long_ids, short_ids = random_ids(3 * 128 + 40, seed=7), random_ids(9, seed=8)
    config = SamplingConfig(max_new_tokens=6)
    want_long = list(alone._run(alone.begin(0, long_ids, config)))
    want_short = list(alone._run(alone.begin(0, short_ids, config)))

    short = model.begin(1, short_ids, config)
    model.step([short])  # its prompt, and its first token
    long = model.begin(0, long_ids, SamplingConfig(max_new_tokens=6))
    long.chunk = 128  # four chunks, so the interleaving is visible on a 512-token cache
    got_long, got_short, steps = [], [], 0
    while not (long.done and short.done):
        result = model.step([t for t in (long, short) if not t.done])
        steps += 1
        got_long += [result.events[long]] if long in result.events else []
        got_short += [result.events[short]] if short in result.events else []
        if steps <= 3:  # the long prompt is still being prefilled, the short turn decodes
            assert long not in result.events and short in result.events
    key = [(e.text, e.token, e.finish_reason) for e in want_long]
    assert [(e.text, e.token, e.finish_reason) for e in got_long] == key
    assert [(e.text, e.token, e.finish_reason) for e in got_short] == [
        (e.text, e.token, e.finish_reason) for e in want_short[1:]
    ]


def test_a_turn_ended_mid_prefill_leaves_a_reusable_prefix(long_llama):
    """Cancelled after two chunks, the slot holds exactly those tokens; the next turn with the
    same conversation reuses them and its logits equal a full re-prefill."""
    model, reference = Model(long_llama), Model(long_llama)
    ids = random_ids(300, seed=9)
    turn = model.begin(0, ids, GREEDY)
    turn.chunk = 100
    model.step([turn])
    model.step([turn])
    model.end(turn)
    assert list(model.cache.token_ids(0)) == ids[:200]
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == 200
    np.testing.assert_allclose(logits, fresh_logits(reference, ids), atol=ATOL, rtol=0)


def test_a_failed_prefill_resets_the_slot(long_llama):
    model = Model(long_llama)
    model.prepare(0, random_ids(50, seed=10))
    turn = model.begin(0, random_ids(60, seed=11), GREEDY)
    turn.todo = [10**9]  # not a token: onnxruntime's Gather refuses it
    event = model.step([turn]).events[turn]
    assert event.finish_reason == "error" and event.error is not None
    assert model.cache.length(0) == 0 and model.sessions[0].history == []
