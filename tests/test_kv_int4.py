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
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

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


def test_prefix_copies_are_refused_by_name(int4_pair):
    model = Model(int4_pair[1])
    model.prepare(0, random_ids(30, seed=8))
    with pytest.raises(KvedgeError, match="not supported for the int4 cache yet"):
        model.cache.read(0, 30)


def test_key_layer_calibration_ranks_layers_and_names_the_export_flags(int4_pair, tmp_path):
    """`kvedge calibrate --kv-dtype int4`: a layer's cost is the KL with its keys alone at 5 bits,
    the costliest kept at 8 bits, and the report carries what it was made from."""
    from click.testing import CliRunner

    from kvedge.calibrate.calibrate import builtin_prompts
    from kvedge.calibrate.key_layers import KEY_LAYERS_FORMAT, FiveBitKeys, key_layers
    from kvedge.cli import main

    fp = Model(int4_pair[0])
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
