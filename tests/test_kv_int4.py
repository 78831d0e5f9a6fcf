"""The int4 KV cache in a model: `kvedge export --variant ort --kv-dtype int4`, run by the runtime.

References: the float32 export of the same weights for quality, and a full re-prefill of the same
int4 export for the cache contract (positions, masks, reuse, batches). The kernel's arithmetic
against its numpy twin is tests/test_kv4.py's; here the whole graph and the cache around it.
Every position's codes depend on that position's K and V only, and the float window on positions
only, so a cached run and a re-prefill see the same cache up to float summation order (a code at
a rounding boundary can move one step).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_cached_decode_equals_reprefill, assert_turns_equal_fresh_sessions, random_ids

from kvedge.contract import CacheGeometry, ExportRecipe
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.cache import KVBlock
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import WarmPrefix, read_warm_file, write_warm_file
from kvedge.runtime.sessions import common_prefix

MAX_LEN = 256
# (family, config overrides, the layers with 8-bit keys): head_dim 16 (llama), 32 (qwen3), 64
INT4_CASES = [
    ("llama", {}, (1,)),
    ("qwen3", {}, ()),
    ("llama-hd64", {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}, (0,)),
]
# a cached run against a re-prefill: measured at most 2.4e-6 (the same codes); a code moved one
# step at a rounding boundary (float summation order upstream) stays under this, as the INT8
# cache's tests allow
ATOL = 2e-3
# mean KL against the float32 cache over 150 teacher-forced positions of these random tiny models:
# measured 3.2e-4 (llama), 6.3e-4 (qwen3), 2.0e-3 (head_dim 64); the INT8 cache's 4e-6..5e-5
KL_BOUND = 5e-3


@pytest.fixture(scope="module", params=INT4_CASES, ids=lambda case: case[0])
def int4_pair(request, tmp_path_factory):
    """(float32 export, int4 export) of one tiny model, both ort graphs."""
    from tiny import make_tiny_model

    family, overrides, key8 = request.param
    root = tmp_path_factory.mktemp("int4-" + family)
    source = make_tiny_model(root / "hf", family.split("-")[0], **overrides)
    export_model(source, root / "fp", ExportRecipe(max_len=MAX_LEN, variant="ort"))
    options = ExportRecipe(max_len=MAX_LEN, variant="ort", kv_dtype="int4", kv_key8_layers=key8)
    export_model(source, root / "int4", options)
    return root / "fp", root / "int4"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_geometry_and_bytes_are_the_exports(int4_pair):
    model = Model(int4_pair[1])
    g = model.manifest.geometry
    assert g.dtype == "int4" and g.float_window == 32 and g.window_len == 64
    assert model.cache.nbytes == g.pool_bytes(1)
    float32 = g.with_dtype("float32")
    assert g.bytes_per_token() / float32.bytes_per_token() < 0.2


def test_quality_against_the_float32_cache(int4_pair):
    """Teacher-forced next-token distributions of the int4 cache vs float32 (same weights), past
    the float window: 150 positions, most of them attending over codes."""
    fp, q = Model(int4_pair[0]), Model(int4_pair[1])
    ids = random_ids(170, seed=2)
    a = [prefill(fp.backend, fp.cache, 0, [ids[:20]])[0]]
    b = [prefill(q.backend, q.cache, 0, [ids[:20]])[0]]
    for t in ids[20:]:
        a.append(decode_one_token(fp.backend, fp.cache, 0, [t])[0])
        b.append(decode_one_token(q.backend, q.cache, 0, [t])[0])
    la, lb = log_softmax(np.array(a)), log_softmax(np.array(b))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    assert kl.mean() < KL_BOUND, kl.mean()
    # up to position 32 every key is in the float window: float32 attention (measured 5e-14)
    assert kl[:13].max() < 1e-9, kl[:13]
    assert kl[13:].mean() > 1e-5  # and past it the codes are read (a window read whole would be 0)
    assert (np.argmax(a, -1) == np.argmax(b, -1)).mean() >= 0.85  # measured 0.89-0.93 (near ties)


def test_cached_decode_equals_full_reprefill(int4_pair):
    assert_cached_decode_equals_reprefill(int4_pair[1], 140, 19, ATOL)  # past the window


def test_batch_rows_equal_each_row_alone(int4_pair):
    model, alone = Model(int4_pair[1], slots=2), Model(int4_pair[1])
    rows = [random_ids(90, seed=4), random_ids(41, seed=5)]
    together = prefill(model.backend, model.cache, 0, rows)
    for r, row in enumerate(rows):
        alone.cache.reset(0)
        np.testing.assert_allclose(
            together[r], prefill(alone.backend, alone.cache, 0, [row])[0], atol=ATOL, rtol=0
        )
    nexts = [7, 9]
    stepped = decode_one_token(model.backend, model.cache, 0, nexts)
    for r, row in enumerate(rows):
        alone.cache.reset(0)
        prefill(alone.backend, alone.cache, 0, [row])
        np.testing.assert_allclose(
            stepped[r], decode_one_token(alone.backend, alone.cache, 0, [nexts[r]])[0], atol=ATOL, rtol=0
        )


def test_multi_turn_reuse_equals_fresh_session(int4_pair):
    """Turns reuse the slot (a rewind of a few tokens keeps the window); a rewind past the window's
    margin starts over, and both give what a fresh model gives."""
    questions = ["Hello!", "What is a KV cache?", "And int4?", "Thanks."]
    model = assert_turns_equal_fresh_sessions(
        int4_pair[1], questions, "Answer {turn} " + "and more " * 6, ATOL
    )
    ids = random_ids(150, seed=6)
    model.prepare(0, ids)
    other = ids[:60] + random_ids(30, seed=7)  # 90 tokens back: the window holds 86.. only
    assert model.cache.rewind_limit(0, 60) == 0
    np.testing.assert_allclose(
        model.prepare(0, other), Model(int4_pair[1]).prepare(0, other), atol=ATOL, rtol=0
    )


def test_bad_int4_options_are_refused_by_name():
    with pytest.raises(KvedgeError, match="--kv-dtype int4 runs kvedge's own CPU attention kernel"):
        ExportRecipe(kv_dtype="int4")  # the portable graph
    with pytest.raises(KvedgeError, match="--kv-dtype int4 runs kvedge's own CPU attention kernel"):
        ExportRecipe(kv_dtype="int4", precision="float16")
    with pytest.raises(KvedgeError, match=r"--kv-key8-layers \[3\] applies to --kv-dtype int4 only"):
        ExportRecipe(variant="ort", kv_dtype="int8", kv_key8_layers=(3,))
    with pytest.raises(
        KvedgeError, match="key8_layers=\\[30\\] must be distinct increasing layer indices in 0..29"
    ):
        CacheGeometry(30, 3, 64, 512).with_dtype("int4", key8_layers=(30,))
    with pytest.raises(KvedgeError, match="int4 cache needs one power-of-2 head_dim"):
        CacheGeometry(32, 8, 96, 512).with_dtype("int4")  # Phi-3.5's heads


def check_continues(model: Model, slot: int, ids: list[int], reference: Model) -> None:
    """`slot` of `model`, holding a prefix of `ids`, prefilled to the end of `ids` and one step
    further gives what a fresh prefill of `ids` in `reference` gives."""
    held = model.cache.length(slot)
    logits = prefill(model.backend, model.cache, slot, [ids[held:]])[0]
    reference.cache.reset(0)
    np.testing.assert_allclose(
        logits, prefill(reference.backend, reference.cache, 0, [ids])[0], atol=ATOL, rtol=0
    )
    np.testing.assert_allclose(
        decode_one_token(model.backend, model.cache, slot, [5])[0],
        decode_one_token(reference.backend, reference.cache, 0, [5])[0],
        atol=ATOL,
        rtol=0,
    )


def test_blocks_travel_between_slots_and_caches_with_their_windows(int4_pair):
    """A slot of 150 tokens (its windows wrapped: they hold 86..149) read out and written into
    another slot and another cache continues as the original; a head whose windows hold the 32
    positions before its end (118: 86..117) resumes, one that does not (100: 86..99) may not."""
    model, other, reference = Model(int4_pair[1], slots=2), Model(int4_pair[1]), Model(int4_pair[1])
    g = model.manifest.geometry
    ids = random_ids(170, seed=9)
    prefill(model.backend, model.cache, 0, [ids[:150]])
    assert model.cache.ring_start[0] == 150 - g.window_len
    block = model.cache.read(0, 150)
    assert block.kv is None and block.count == 150 and block.ring_count == g.window_len
    assert block.nbytes == g.bytes_held(150) == g.block_bytes(150, g.window_len)
    model.cache.write(1, block, ids[:150])
    other.cache.write(0, block, ids[:150])
    assert model.cache.ring_start[1] == other.cache.ring_start[0] == 86
    check_continues(model, 1, ids, reference)
    check_continues(other, 0, ids, reference)
    head = model.cache.view(0, 0, 118)
    assert head.ring_count == 32 and head.nbytes == g.block_bytes(118, 32)
    np.testing.assert_array_equal(head.ring, block.head(118).ring)
    model.cache.reset(1)
    model.cache.write(1, head, ids[:118])
    assert model.cache.rewind_limit(1, 118) == 118
    check_continues(model, 1, ids, reference)
    short = model.cache.view(0, 0, 100)
    assert short.ring_count == 14  # positions 86..99: the query at 100 needs 68..99
    model.cache.reset(1)
    model.cache.write(1, short, ids[:100])
    assert model.cache.ring_start[1] == 86 and model.cache.rewind_limit(1, 100) == 0
    with pytest.raises(KvedgeError, match="int4 window hold positions from 86 on"):
        model.cache.truncate(1, 99)
    written = KVBlock(None, ring=short.ring, parts=short.parts[1:])
    with pytest.raises(KvedgeError, match="does not fit this int4 cache"):
        model.cache.write(1, written, ids[:100])
    with pytest.raises(KvedgeError, match="does not fit this float32 cache"):
        Model(int4_pair[0]).cache.write(0, short, ids[:100])


def test_run_time_store_serves_a_shared_system_prompt(int4_pair):
    """slots=1: a conversation loses the slot to another and a third shares its system prompt;
    it is copied in from the store (codes, and the window rows of the last positions) and gives
    what a fresh model gives. A match the stored windows do not serve starts over."""
    budget = 2**20
    model = Model(int4_pair[1], prefix_cache_bytes=budget)
    system = {"role": "system", "content": "You are a careful assistant for edge devices. " * 3}
    first = model.tokenizer.encode_chat([system, {"role": "user", "content": "Hi"}])
    third = model.tokenizer.encode_chat([system, {"role": "user", "content": "Why?"}])
    shared = common_prefix(first, third)
    assert len(first) - shared < 32 < shared  # the stored windows serve the shared part
    model.prepare(0, first)
    model.prepare(0, random_ids(60, seed=10))  # the first conversation goes to the store
    store = model.prefixes.run_time
    assert len(store) == 1 and store.entries[0].ring_from == len(first) - 64
    logits = model.prepare(0, third)
    assert model.sessions[0].reused_tokens == shared and store.hits == 1
    np.testing.assert_allclose(logits, Model(int4_pair[1]).prepare(0, third), atol=ATOL, rtol=0)
    model.prepare(0, random_ids(60, seed=16))
    again = first[: len(first) - 40] + random_ids(5, seed=11)  # needs positions before the windows
    logits = model.prepare(0, again)
    assert model.sessions[0].reused_tokens == 0 and store.hits == 1
    np.testing.assert_allclose(logits, Model(int4_pair[1]).prepare(0, again), atol=ATOL, rtol=0)
    assert store.nbytes <= store.capacity_bytes <= budget


def test_warm_file_round_trip_and_cache_form_refusal(int4_pair, tmp_path):
    """An int4 slot's warm file reads back as it was written and serves a slot; a float32, int8
    or other-key-layers cache of the same model refuses it, naming the dtype or key layers."""
    model = Model(int4_pair[1])
    g, fingerprint = model.manifest.geometry, model.manifest.source_fingerprint
    ids = random_ids(100, seed=12)
    prefill(model.backend, model.cache, 0, [ids])
    block = model.cache.read(0, 100)
    path = tmp_path / "p.kvw"
    write_warm_file(path, WarmPrefix("p", tuple(ids), block), g, fingerprint)
    loaded = read_warm_file(path, g, fingerprint, ids)
    assert loaded.block.ring_count == g.window_len and len(loaded.block.parts) == len(block.parts)
    for a, b in zip(loaded.block.arrays, block.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    fresh = Model(int4_pair[1])
    fresh.cache.write(0, loaded.block, ids)
    check_continues(fresh, 0, ids + random_ids(9, seed=13), Model(int4_pair[1]))
    fp = Model(int4_pair[0]).manifest.geometry
    for other, named in [(fp, '"dtype": "int4"'), (fp.with_dtype("int8"), '"dtype": "int4"')]:
        with pytest.raises(ArtifactMismatch, match=named):
            read_warm_file(path, other, fingerprint, ids)
    other_keys = g.with_dtype("int4", key8_layers=() if g.key8_layers else (0,))
    with pytest.raises(ArtifactMismatch, match="key8_layers"):
        read_warm_file(path, other_keys, fingerprint, ids)


def test_conversation_survives_a_restart_from_prefix_dir(int4_pair, tmp_path):
    """The disk tier: what a slot held is written as one file when the model closes (the int4
    windows are written whole, as ring layers are) and a new Model resumes from it exactly."""
    options = {"prefix_dir": tmp_path, "prefix_disk_min_tokens": 32}
    model = Model(int4_pair[1], **options)
    ids = random_ids(130, seed=14)
    model.prepare(0, ids)
    model.close()
    again = Model(int4_pair[1], **options)
    assert len(again.prefixes.disk) == 1
    longer = ids + random_ids(8, seed=15)
    logits = again.prepare(0, longer)
    assert again.prefixes.disk.hits == 1 and again.sessions[0].reused_tokens == 130
    np.testing.assert_allclose(logits, Model(int4_pair[1]).prepare(0, longer), atol=ATOL, rtol=0)


def test_warm_prefixes_reloaded_serve_exactly(int4_pair, tmp_path):
    """A warm prefix built at first boot, written, reloaded by a new Model and used: whole, by a
    partial match its windows serve (20 back), and by one they do not (40 back: starts over)."""
    from kvedge.configs import load_warm_prefix_config

    path = tmp_path / "warmup.yaml"
    text = "Keys and values of past tokens. " * 3
    path.write_text(f'prefixes:\n  - name: notes\n    text: "{text}"\n')
    config, folder = load_warm_prefix_config(path), tmp_path / "warm"
    first = Model(int4_pair[1], warm_prefixes=config, warm_dir=folder)
    assert first.prefixes.warm_report.rebuilt == {"notes": "missing"}
    model = Model(int4_pair[1], warm_prefixes=config, warm_dir=folder)
    assert model.prefixes.warm_report.loaded == ["notes"]
    (prefix,) = model.prefixes.warm.prefixes
    ids = list(prefix.token_ids)
    assert len(ids) > 64 and prefix.block.ring_count == 64
    tail = random_ids(7, seed=17)
    for shared, reused in [(len(ids), len(ids)), (len(ids) - 20, len(ids) - 20), (len(ids) - 40, 0)]:
        model.sessions[0].reset(model.cache)
        logits = model.prepare(0, ids[:shared] + tail)
        assert model.sessions[0].reused_tokens == reused
        expected = Model(int4_pair[1]).prepare(0, ids[:shared] + tail)
        np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


def test_window_eviction_is_refused_by_name(int4_pair):
    model = Model(int4_pair[1])
    model.prepare(0, random_ids(30, seed=8))
    with pytest.raises(KvedgeError, match="Hadamard-rotated keys"):
        model.cache.evict(0, 0, 8, np.ones(4))


def test_key_layer_calibration_ranks_layers_and_names_the_export_flags(int4_pair, tmp_path):
    """`kvedge calibrate --kv-dtype int4`: a layer's cost is the KL with its keys alone at 5 bits,
    the costliest kept at 8 bits, and the report carries what it was made from."""
    from click.testing import CliRunner

    from kvedge.calibrate.calibrate import builtin_prompts, prompt_ids
    from kvedge.calibrate.key_layers import KEY_LAYERS_FORMAT, FiveBitKeys, key_layers, long_prompts
    from kvedge.cli import main

    fp = Model(int4_pair[0])
    made = long_prompts(fp, builtin_prompts(), 200)  # the short chat prompts, listed to length
    assert len(made) == 4 and all(150 <= len(prompt_ids(fp, p)) <= 200 for p in made)
    assert len({p["messages"][0]["content"] for p in made}) == 4
    found = key_layers(fp, builtin_prompts()[:4], steps=8)
    g = fp.manifest.geometry
    assert len(found.layer_kl) == g.num_layers and all(kl > 0 for kl in found.layer_kl)
    assert found.key8_layers == [int(np.argmax(found.layer_kl))]  # a tenth of 1-2 layers: one
    assert found.model_fingerprint == fp.manifest.source_fingerprint and found.format == KEY_LAYERS_FORMAT
    block = np.random.default_rng(0).normal(size=(g.num_layers, 2, g.num_kv_heads, 5, g.head_dim))
    before = block.copy()
    FiveBitKeys(0, g.head_dim)(block)
    assert np.array_equal(block[1:], before[1:]) and np.array_equal(block[0, 1], before[0, 1])
    assert 0 < np.abs(block[0, 0] - before[0, 0]).max() < 0.2 * np.abs(before[0, 0]).max()
    runner = CliRunner()
    args = ["calibrate", "--model", str(int4_pair[0]), "--out", str(tmp_path), "--kv-dtype", "int4"]
    refused = runner.invoke(main, [*args, "--method", "minmax"])
    assert refused.exit_code != 0 and "--method calibrate INT8 scales" in refused.output
    with pytest.raises(KvedgeError, match="reads the float32 cache"):
        key_layers(Model(int4_pair[1]), builtin_prompts()[:1], steps=2)
