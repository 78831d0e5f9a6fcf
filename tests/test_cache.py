"""The KV contract: cache-on equals cache-off, batches, positions, rewinds, overflow."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_ids

from kvedge.bench.measure import rss_bytes
from kvedge.contract import CacheGeometry
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
    with pytest.raises(KvedgeError, match="dtype='int4'.*allowed"):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=8, max_len=8, dtype="int4")


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
