"""The KV contract: cache-on equals cache-off, batches, positions, rewinds, overflow."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_ids

from kvedge.bench.measure import rss_bytes
from kvedge.contract import CacheGeometry, GraphInterface, IONames
from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill

ATOL = 1e-4  # see test_parity: fp32 on both sides, measured ~1e-6


def full_recompute(model, ids: list[int]) -> np.ndarray:
    """Next-token logits of `ids` computed from an empty cache in one pass (cache off)."""
    model.cache.reset(0)
    return prefill(model.backend, model.cache, 0, [ids])[0]


def test_cache_on_equals_cache_off(tiny_llama):
    model = tiny_llama.model()
    ids = random_ids(40, seed=3)
    logits = prefill(model.backend, model.cache, 0, [ids[:8]])[0]
    cached = [logits]
    for t in ids[8:]:
        cached.append(decode_one_token(model.backend, model.cache, 0, [t])[0])
    fresh = tiny_llama.model()
    for n, got in zip(range(8, 41), cached, strict=True):
        np.testing.assert_allclose(got, full_recompute(fresh, ids[:n]), atol=ATOL, rtol=0)


def test_chunked_prefill_equals_one_pass(tiny_llama):
    model = tiny_llama.model()
    ids = random_ids(70, seed=4)
    one = prefill(model.backend, model.cache, 0, [ids])[0]
    model.cache.reset(0)
    chunked = prefill(model.backend, model.cache, 0, [ids], chunk=16)[0]
    np.testing.assert_allclose(chunked, one, atol=ATOL, rtol=0)


def test_mixed_length_batch_rows_equal_alone(tiny_llama):
    prompts = [random_ids(n, seed=10 + n) for n in (5, 23, 12)]
    batched = tiny_llama.model(slots=3)
    logits = prefill(batched.backend, batched.cache, 0, prompts, chunk=8)
    steps = [logits]
    tokens = [int(np.argmax(row)) for row in logits]
    for _ in range(10):
        logits = decode_one_token(batched.backend, batched.cache, 0, tokens)
        steps.append(logits)
        tokens = [int(np.argmax(row)) for row in logits]
    assert list(batched.cache.lengths) == [15, 33, 22]
    for row, prompt in enumerate(prompts):
        alone = tiny_llama.model()
        logits = prefill(alone.backend, alone.cache, 0, [prompt])[0]
        for step in steps:
            np.testing.assert_allclose(step[row], logits, atol=ATOL, rtol=0)
            logits = decode_one_token(alone.backend, alone.cache, 0, [int(np.argmax(logits))])[0]


def test_positions_continue_across_appends(tiny_llama):
    """Three appends of 10 tokens equal one prefill of 30: positions come from the valid length."""
    model = tiny_llama.model()
    ids = random_ids(30, seed=5)
    for start in (0, 10, 20):
        logits = prefill(model.backend, model.cache, 0, [ids[start : start + 10]])[0]
    assert model.cache.length(0) == 30
    assert list(model.cache.token_ids(0)) == ids
    np.testing.assert_allclose(logits, tiny_llama.hf_logits(ids)[-1], atol=ATOL, rtol=0)


def test_truncate_then_reappend_equals_never_written(tiny_llama):
    model = tiny_llama.model()
    kept, dropped, new = random_ids(20, seed=6), random_ids(15, seed=7), random_ids(6, seed=8)
    prefill(model.backend, model.cache, 0, [kept + dropped])
    model.cache.truncate(0, 20)
    got = prefill(model.backend, model.cache, 0, [new])[0]
    np.testing.assert_allclose(got, tiny_llama.hf_logits(kept + new)[-1], atol=ATOL, rtol=0)


def test_stale_slots_beyond_valid_length_are_invisible(tiny_llama):
    """Garbage written past the valid length must not change the output (the seeds' padding bug)."""
    model = tiny_llama.model()
    ids = random_ids(12, seed=9)
    prefill(model.backend, model.cache, 0, [ids])
    model.cache.pool[:, :, 0, :, 12:] = 1e3
    got = decode_one_token(model.backend, model.cache, 0, [7])[0]
    np.testing.assert_allclose(got, tiny_llama.hf_logits(ids + [7])[-1], atol=ATOL, rtol=0)


def test_overflow_is_refused_and_cache_untouched(tiny_llama):
    model = tiny_llama.model()
    max_len = model.manifest.geometry.max_len
    prefill(model.backend, model.cache, 0, [random_ids(max_len - 4)])
    with pytest.raises(ContextOverflow, match="5 new tokens do not fit.*4 left"):
        prefill(model.backend, model.cache, 0, [random_ids(5)])
    assert model.cache.length(0) == max_len - 4


def test_cache_allocates_once_by_geometry():
    geometry = CacheGeometry(num_layers=3, num_kv_heads=2, head_dim=8, max_len=32)
    cache = KVCache(geometry, slots=2)
    assert cache.nbytes == geometry.pool_bytes(2) == 3 * 2 * 2 * 2 * 32 * 8 * 4
    views = cache.layer_views(0, 2)
    assert views[1][0].shape == geometry.layer_shape(2)
    assert all(np.shares_memory(k, cache.pool) and k.flags.c_contiguous for k, _ in views)
    with pytest.raises(KvedgeError, match="cannot truncate slot 0 to 1"):
        cache.truncate(0, 1)


def test_geometry_rejects_bad_values():
    with pytest.raises(KvedgeError, match="max_len=0"):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=8, max_len=0)
    with pytest.raises(KvedgeError, match="dtype='int2'.*allowed"):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=8, max_len=8, dtype="int2")
    with pytest.raises(KvedgeError, match="int4 cache needs one power-of-2 head_dim of at least 16"):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=24, max_len=8, dtype="int4")
    with pytest.raises(
        KvedgeError, match=r"key8_layers=\[1\] must be distinct increasing layer indices in 0..0"
    ):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=16, max_len=8, dtype="int4", key8_layers=(1,))
    with pytest.raises(KvedgeError, match="are for int4 caches only"):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=16, max_len=8, float_window=32)


def test_int4_cache_layout_bytes_and_window_rewinds():
    """The int4 cache's per-layer arrays are what the geometry counts and the graph binds (8-bit
    key layers wider), and its float window bounds a rewind as a ring does."""
    g = CacheGeometry(num_layers=3, num_kv_heads=2, head_dim=64, max_len=256).with_dtype(
        "int4", key8_layers=(1,)
    )
    cache = KVCache(g, slots=2)
    assert cache.nbytes == g.pool_bytes(2)
    per_token = 2 * ((40 + 2 + 32 + 2) * 2 + (64 + 4 + 32 + 2))  # 5-bit K layers, then the 8-bit one
    assert g.bytes_per_token() == per_token
    assert g.bytes_held(256) == 256 * per_token + 3 * 2 * 2 * g.window_len * 64 * 4
    interface = GraphInterface(IONames(), g, "ort", "rows", 10)
    views = cache.layer_views(0, 2)
    specs = [s for s in interface.inputs() if s.layer is not None]
    assert [v.shape for layer in views for v in layer] == [s.shape(2, 1) for s in specs]
    assert [v.dtype for layer in views for v in layer] == [s.dtype for s in specs]
    assert views[1][0].shape[-1] == 64 and views[0][0].shape[-1] == 40 and views[0][4].shape[2] == 64
    tokens = np.zeros((1, 100), np.int64)
    cache.commit([0], tokens, [100])  # the graph wrote positions 0..99: the window holds 36..99
    assert cache.rewind_limit(0, 90) == 90 and cache.rewind_limit(0, 68) == 68
    assert cache.rewind_limit(0, 67) == 0  # 35..66 are gone from the window
    with pytest.raises(KvedgeError, match="its int4 window hold positions from 36 on, not the 32 before 60"):
        cache.truncate(0, 60)
    cache.commit([0, 1], np.zeros((2, 10), np.int64), [0, 5])  # slot 0 rode along: 100..109 written
    assert cache.rewind_limit(0, 100) == 100 and cache.rewind_limit(0, 78) == 78  # 46.. are there
    assert cache.rewind_limit(0, 77) == 0
    rng = np.random.default_rng(0)
    for array in cache.parts:  # every position of every slot distinct
        array[...] = rng.integers(0, 200, array.shape).astype(array.dtype)
    assert cache.read(1, 5).nbytes == g.bytes_held(5) == g.block_bytes(5, 5)
    block = cache.read(0, 100)  # the windows hold 46..99 (100..109 overwrote 36..45)
    assert block.kv is None and block.count == 100 and block.ring_count == 54
    assert [p.shape for p in block.parts] == [(2, 1, 2, 100, 40), (1, 1, 2, 100, 64), (3, 1, 2, 100, 32)] + [
        (2, 1, 2, 100, 1),
        (1, 1, 2, 100, 2),
        (3, 1, 2, 100, 1),
    ]
    assert block.nbytes == g.block_bytes(100, 54)
    k_window, v_window = cache.parts[-2:]
    np.testing.assert_array_equal(block.ring[:, 0], k_window[:, 0, 0][:, :, np.arange(46, 100) % 64])
    np.testing.assert_array_equal(block.ring[:, 1], v_window[:, 0, 0][:, :, np.arange(46, 100) % 64])
    head = cache.view(0, 0, 60)  # positions 46..59 of its run are in the windows
    assert head.ring_count == 14 and head.nbytes == g.block_bytes(60, 14)
    cache.write(1, head, np.arange(60))
    assert cache.ring_start[1] == 46 and cache.rewind_limit(1, 60) == 0
    cache.write(1, block.tail(60), np.arange(60, 100), start=60)
    assert cache.ring_start[1] == 46 and cache.rewind_limit(1, 100) == 100
    again = cache.read(1, 100)
    for a, b in zip(again.arrays, block.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(KvedgeError, match="Hadamard-rotated keys"):
        cache.evict(0, 0, 8, np.ones(32))
    with pytest.raises(KvedgeError, match="appending a portable graph's new K/V is not supported"):
        cache.append([0], tokens[:, :1], [1], [])


def test_load_reserves_decode_memory_without_touching_valid_state(tiny_llama):
    """Model load runs one throwaway decode at the longest past (arena sized once, RSS flat
    later): nothing may become valid, and only stale space past every slot may be written."""
    model = tiny_llama.model(slots=3)
    assert (model.cache.lengths == 0).all()
    written = np.argwhere(model.cache.pool != 0)[:, 4]  # max_len index of every nonzero value
    if model.manifest.in_place:
        assert set(written.tolist()) == {model.manifest.geometry.max_len - 1}
    else:
        assert written.size == 0


def test_pool_is_resident_from_construction():
    """Preallocated means resident: every page of the pool is written when the cache is made,
    so a pool that does not fit fails at load and decoding never faults in pages as it grows
    (np.zeros would map zero pages lazily and RSS would grow with the context)."""
    geometry = CacheGeometry(num_layers=4, num_kv_heads=4, head_dim=64, max_len=8192)  # 64 MiB
    before = rss_bytes()
    cache = KVCache(geometry, slots=2)
    grown = rss_bytes() - before
    assert cache.pool.nbytes == 2 * geometry.bytes_per_slot()
    assert grown >= 0.9 * cache.pool.nbytes, f"pool {cache.pool.nbytes} bytes, RSS grew {grown}"
