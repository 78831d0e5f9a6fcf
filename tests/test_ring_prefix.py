"""Prefix stores and warm prefixes on ring-buffer layers (Gemma 3, and Gemma 4 with its shared-KV
layers), against fresh prefills.

A stored block carries every position of the global layer and only the last positions the
sliding-window layers' rings held (window 8, ring 72 slots, max_len 256). Each test serves a
conversation from a stored block and compares it with a fresh prefill from an empty slot:
logits within test_gemma3's tolerances and the same greedy tokens. Prefixes run past the ring
(so it wrapped before the block was taken), and partial matches either keep what the block's
rings serve (`KVCache.ring_limit`, the rewind rule) or start over.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from conftest import random_ids
from tiny import gemma4_supported, make_tiny_model

from kvedge.calibrate.calibrate import collect_kv
from kvedge.configs import load_warm_prefix_config
from kvedge.contract import RING_MARGIN, ExportRecipe
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import WarmPrefix, read_warm_file, write_warm_file
from kvedge.runtime.sessions import HistoryPolicy

ATOL = {"fp": 1e-4, "int8": 2e-3}  # test_gemma3's (float32 cache) and test_kv_int8's (INT8)
MAX_LEN = 256
WINDOW = 8  # tests/tiny.py GEMMA3
RING = WINDOW + RING_MARGIN
BUDGET = 2**20
LONG_TEXT = "A KV cache stores keys and values of past tokens so decoding does not recompute them. " * 4


def exports(root, family: str) -> dict:
    """{"fp": float32 export, "int8": INT8-cache export} of tests/tiny.py's `family` (portable)."""
    source = make_tiny_model(root / "hf", family, seed=1)
    export_model(source, root / "fp", ExportRecipe(max_len=MAX_LEN))
    export_model(source, root / "int8", ExportRecipe(max_len=MAX_LEN, kv_dtype="int8"))
    return {"fp": root / "fp", "int8": root / "int8"}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma 3's exports."""
    return exports(tmp_path_factory.mktemp("gemma3-prefix"), "gemma3")


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def rings(request, tmp_path_factory):
    """The tiny Gemma 3's exports, and the tiny Gemma 4's (window 8 too; its last 3 layers read an
    earlier layer's KV and store none, so no block, file or store holds them)."""
    if request.param == "gemma4" and not gemma4_supported():
        pytest.skip("Gemma 4 needs transformers 5.25")
    return exports(tmp_path_factory.mktemp(f"{request.param}-prefix"), request.param)


def greedy(model: Model, logits: np.ndarray, n: int = 12) -> list[int]:
    """`n` greedy tokens after `logits`, decoded in slot 0."""
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = decode_one_token(model.backend, model.cache, 0, [tokens[-1]])[0]
    return tokens


def check_served(model: Model, reference: Model, ids: list[int], reused: int, atol: float) -> None:
    """`model` brings slot 0 to `ids` reusing exactly `reused` tokens, and then gives the logits
    and greedy tokens of a fresh prefill of `ids` in `reference`."""
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == reused
    reference.cache.reset(0)
    expected = prefill(reference.backend, reference.cache, 0, [ids])[0]
    np.testing.assert_allclose(logits, expected, atol=atol, rtol=0)
    assert greedy(model, logits) == greedy(reference, expected)
    model.sessions[0].reset(model.cache)  # the greedy steps were not the session's


@pytest.mark.parametrize("kind", ["fp", "int8"])
def test_store_serves_returning_conversations_past_the_ring(rings, kind):
    """A (150 tokens: the rings wrapped, they hold 78..149) loses slot 0 to B, then comes back
    whole, then with a shorter partial match the rings still serve (140), then one they do not
    (80: its query needs 73..79): that one starts over."""
    model, reference = Model(rings[kind], prefix_cache_bytes=BUDGET), Model(rings[kind])
    a, b, tail = random_ids(150, seed=1), random_ids(60, seed=2), random_ids(9, seed=3)
    model.prepare(0, a)
    model.prepare(0, b)  # A is saved to the store as B replaces it
    assert len(model.prefixes.run_time) == 1 and model.prefixes.run_time.entries[0].ring_from == 150 - RING
    check_served(model, reference, a + tail, 150, ATOL[kind])
    assert model.prefixes.run_time.hits == 1
    model.prepare(0, b)
    check_served(model, reference, a[:140] + tail, 140, ATOL[kind])
    model.prepare(0, b)
    lowest = 150 - RING + WINDOW - 1  # 85: the shortest match the stored rings serve
    check_served(model, reference, a[:lowest] + tail, lowest, ATOL[kind])
    model.prepare(0, b)
    check_served(model, reference, a[: lowest - 1] + tail, 0, ATOL[kind])


def test_store_serves_a_short_head_of_a_short_entry_and_completes_the_slots_rings(rings):
    """An entry shorter than the ring holds every position, so any head of it serves. Loading it
    over a slot that already shares its first 55 tokens copies only the rest, unless that slot's
    own rings no longer hold what the next query needs below 55: then the whole head is copied."""
    model, reference = Model(rings["fp"], prefix_cache_bytes=BUDGET), Model(rings["fp"])
    a, other, tail = random_ids(60, seed=4), random_ids(200, seed=5), random_ids(5, seed=6)
    model.prepare(0, a)
    model.prepare(0, random_ids(40, seed=7))
    assert model.prefixes.run_time.entries[0].ring_from == 0
    check_served(model, reference, a[:20] + tail, 20, ATOL["fp"])
    model.prepare(0, a[:55] + other)  # 255 tokens (its first 55 from the store, a hit)
    assert model.cache.ring_start[0] == 255 - RING  # this slot's rings hold 183 .. 254
    check_served(model, reference, a[:58] + tail, 58, ATOL["fp"])  # 58 reused: needs 51 .. 57
    assert model.prefixes.run_time.hits == 3


@pytest.mark.parametrize("kind", ["fp", "int8"])
def test_disk_tier_serves_an_evicted_entry_after_a_restart(rings, kind, tmp_path):
    """A (150 tokens, rings wrapped) goes from slot 0 to the store, is evicted from it to disk
    (`RunTimePrefixStore.block` gathers its ring positions 78..149), and a new Model serves it from the
    file: whole, and by a partial match the file's rings serve."""
    budget = 160 * Model(rings[kind]).manifest.geometry.bytes_per_token()  # 5 blocks: A, not A and C
    options = {"prefix_cache_bytes": budget, "prefix_dir": tmp_path, "prefix_disk_min_tokens": 100}
    model = Model(rings[kind], **options)
    a, b, c, tail = random_ids(150, seed=1), random_ids(40, seed=2), random_ids(120, seed=8), random_ids(9)
    model.prepare(0, a)
    model.prepare(0, c)  # A to the store
    model.prepare(0, b)  # C to the store: A is evicted to disk
    assert model.prefixes.run_time.evictions == 1 and len(model.prefixes.disk) == 1
    model.close()  # C is written too, B is under the threshold
    again, reference = Model(rings[kind], **options), Model(rings[kind])
    assert len(again.prefixes.disk) == 2
    check_served(again, reference, a + tail, 150, ATOL[kind])
    check_served(again, reference, a[:140] + tail, 140, ATOL[kind])
    assert again.prefixes.disk.hits == 2


@pytest.mark.parametrize("kind", ["fp", "int8"])
def test_warm_prefixes_reloaded_serve_exactly(rings, kind, tmp_path):
    """A warm prefix longer than the ring, built at first boot, written, reloaded by a new Model
    and used: whole, by a partial match its rings serve, and by one they do not."""
    path = tmp_path / "warmup.yaml"
    path.write_text(f'prefixes:\n  - name: notes\n    text: "{LONG_TEXT}"\n')
    config, folder = load_warm_prefix_config(path), tmp_path / "warm"
    first = Model(rings[kind], slots=2, warm_prefixes=config, warm_dir=folder)
    assert first.prefixes.warm_report.rebuilt == {"notes": "missing"}
    model = Model(rings[kind], slots=2, warm_prefixes=config, warm_dir=folder)
    assert model.prefixes.warm_report.loaded == ["notes"]
    block = model.prefixes.warm.prefixes[0].block
    ids = list(model.prefixes.warm.prefixes[0].token_ids)
    assert len(ids) > RING and block.ring_count == RING
    np.testing.assert_array_equal(block.ring, first.prefixes.warm.prefixes[0].block.ring)
    reference, tail = Model(rings[kind]), random_ids(7, seed=8)
    check_served(model, reference, ids + tail, len(ids), ATOL[kind])
    check_served(model, reference, ids[:-20] + tail, len(ids) - 20, ATOL[kind])
    check_served(model, reference, ids[: len(ids) - RING + WINDOW - 2] + tail, 0, ATOL[kind])


def test_a_block_and_a_warm_file_hold_the_layers_that_store_kv_only(rings, tmp_path):
    """What a store, the disk tier or a warm file keeps of a slot is its layers that store KV: for
    the tiny Gemma 4, 1 global layer at every position and 3 rings, none of its 3 shared layers;
    the file is those bytes and its header."""
    model = Model(rings["fp"])
    g = model.manifest.geometry
    ids = random_ids(100, seed=9)
    prefill(model.backend, model.cache, 0, [ids])
    block = model.cache.read(0, len(ids))
    full = g.num_layers - len(g.ring_layers)
    assert block.kv.shape[:4] == (full, 2, g.num_kv_heads, 100) and block.kv.shape[4] == g.head_dim
    assert block.ring.shape[:4] == (len(g.ring_layers), 2, g.num_kv_heads, RING)
    assert block.ring.shape[4] == g.ring_dim
    assert g.model_layers == g.num_layers + len(g.shared_layers)
    path = tmp_path / "p.kvw"
    write_warm_file(path, WarmPrefix("p", tuple(ids), block), g, model.manifest.source_fingerprint)
    stored = block.kv.nbytes + block.ring.nbytes
    assert stored <= path.stat().st_size < stored + 16384


def test_warm_file_of_another_ring_layout_is_refused_naming_the_field(gemma, tmp_path):
    model = Model(gemma["fp"])
    ids = random_ids(100, seed=9)
    prefill(model.backend, model.cache, 0, [ids])
    block = model.cache.read(0, len(ids))
    assert block.kv.shape[:4] == (1, 2, 2, 100) and block.ring.shape[:4] == (2, 2, 2, RING)
    geometry, fingerprint = model.manifest.geometry, model.manifest.source_fingerprint
    path = tmp_path / "p.kvw"
    write_warm_file(path, WarmPrefix("p", tuple(ids), block), geometry, fingerprint)
    assert read_warm_file(path, geometry, fingerprint, ids).block.ring_count == RING
    for field, value in (("window", 16), ("ring_margin", 32), ("ring_layers", (0,))):
        write_warm_file(
            path,
            WarmPrefix("p", tuple(ids), block),
            dataclasses.replace(geometry, **{field: value}),
            fingerprint,
        )
        shown = list(value) if isinstance(value, tuple) else value
        message = re.escape(f"p.kvw: ring layout {field} is {shown}, this cache has")
        with pytest.raises(ArtifactMismatch, match=message):
            read_warm_file(path, geometry, fingerprint, ids)


def test_blocks_carry_the_positions_the_rings_held(gemma):
    """`read` after a rewind takes the ring positions still held below the new length; `write`
    puts them back at p % ring_len and sets ring_start; `ring_limit` is the rewind rule."""
    model = Model(gemma["fp"])
    prefill(model.backend, model.cache, 0, [random_ids(150, seed=10)])
    cache = model.cache
    block = cache.read(0, 120)  # the rings hold 78 .. 149: of the first 120, 78 .. 119
    assert block.count == 120 and block.ring_count == 42
    target = KVCache(model.manifest.geometry, 1)
    target.write(0, block, cache.token_ids(0)[:120])
    assert target.ring_start[0] == 78 and target.rewind_limit(0, 120) == 120
    assert cache.ring_limit(78, 84) == 0 and cache.ring_limit(78, 85) == 85
    held = np.arange(78, 120) % RING
    np.testing.assert_array_equal(target.ring[:, :, 0][:, :, :, held], cache.ring[:, :, 0][:, :, :, held])
    with pytest.raises(KvedgeError, match=r"KV block ring \(2, 2, 2, 42, 32\) float32 does not fit"):
        target.write(0, block.head(10)._replace(ring=block.ring), cache.token_ids(0)[:10])
    head = block.head(100)
    assert head.count == 100 and head.ring_count == 22
    assert block.head(70).ring_count == 0


def test_window_eviction_and_calibration_are_refused_by_name(gemma):
    with pytest.raises(KvedgeError, match="history_policy 'window'.*not supported for this model's"):
        Model(gemma["fp"], policy=HistoryPolicy(mode="window"))
    with pytest.raises(KvedgeError, match="calibration is not supported for models with sliding-window"):
        collect_kv(Model(gemma["fp"]), [])
