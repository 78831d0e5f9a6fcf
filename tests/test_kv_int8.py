"""The INT8 KV cache in memory: int8 buffers plus float16 per-token scales, quantized in the graph.

References: the numpy quantizer (`kvedge.quant.quantize_tokens`) for what the graph stores, the
float32 export of the same weights for quality, and a full re-prefill of the same INT8 export
for the cache contract (positions, masks, reuse), which must hold as tightly as with a float
cache because the graph attends over exactly the dequantized values it stores.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import random_ids
from tiny import make_tiny_model

from kvedge.cli import main
from kvedge.contract import CacheGeometry
from kvedge.errors import KvedgeError
from kvedge.export.export import ExportOptions, export_model
from kvedge.quant import dequantize_tokens, quantize_tokens
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import read_warm_file, write_warm_file
from kvedge.runtime.sessions import ContextPolicy

# Same INT8 graph on both sides; the only differences are float summation order, which can move
# a value across a rounding boundary (one code step, ~1% of a head's range) once in a while.
ATOL = 2e-3
MAX_LEN = 256


@pytest.fixture(scope="module", params=[("llama", 0), ("qwen2", 0), ("llama-hd32", 16)], ids=str)
def int8_pair(request, tmp_path_factory):
    """(float32 export, int8 export) of one tiny model; "hd32" has head_dim 32, so group 16 gives
    two scales per token per head (a Slice, MatMul and scale per channel group) instead of one."""
    family, group = request.param
    root = tmp_path_factory.mktemp(f"int8-{family}-{group}")
    overrides = {"num_attention_heads": 2, "num_key_value_heads": 1} if family.endswith("hd32") else {}
    source = make_tiny_model(root / "hf", family.split("-")[0], **overrides)
    export_model(source, root / "fp", ExportOptions(max_len=MAX_LEN))
    export_model(source, root / "int8", ExportOptions(max_len=MAX_LEN, kv_dtype="int8", kv_group_size=group))
    return root / "fp", root / "int8"


def test_pool_is_int8_with_float16_scales_counted_exactly(int8_pair):
    model = Model(int8_pair[1], slots=3)
    g = model.manifest.geometry
    assert model.cache.pool.dtype == np.int8 and model.cache.scales.dtype == np.float16
    assert model.cache.scales.shape == (
        g.num_layers,
        2,
        3,
        g.num_kv_heads,
        g.max_len,
        g.head_dim // g.group_size,
    )
    assert model.cache.nbytes == g.pool_bytes(3)
    fp = Model(int8_pair[0]).manifest.geometry
    assert g.bytes_per_token() / fp.bytes_per_token() == (1 + 2 / g.group_size) / 4


def test_real_model_geometry_is_under_027_of_fp32():
    fp = CacheGeometry(num_layers=30, num_kv_heads=3, head_dim=64, max_len=2048)  # SmolLM2-135M
    for group in (32, 64):
        ratio = fp.with_dtype("int8", group).pool_bytes(4) / fp.pool_bytes(4)
        assert ratio <= 0.27, (group, ratio)


def test_graph_stores_what_the_numpy_quantizer_computes(int8_pair):
    """Layer 0's K/V depend only on tokens and positions, so the INT8 cache must hold exactly the
    numpy quantization of the float32 export's layer-0 K/V (up to one step at rounding ties)."""
    fp, q = Model(int8_pair[0]), Model(int8_pair[1])
    ids = random_ids(40, seed=1)
    prefill(fp.backend, fp.cache, 0, [ids[:25]])
    decode_one_token(fp.backend, fp.cache, 0, [ids[25]])
    prefill(q.backend, q.cache, 0, [ids[:25]])
    decode_one_token(q.backend, q.cache, 0, [ids[25]])
    n, group = 26, q.manifest.geometry.group_size
    codes, scales = quantize_tokens(fp.cache.pool[0, :, 0, :, :n], group)
    np.testing.assert_allclose(q.cache.scales[0, :, 0, :, :n], scales, rtol=1e-3)
    diff = np.abs(q.cache.pool[0, :, 0, :, :n].astype(int) - codes)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    back = dequantize_tokens(q.cache.pool[0, :, 0, :, :n], q.cache.scales[0, :, 0, :, :n], group)
    step = scales.astype(np.float32).repeat(group, axis=-1)
    assert (np.abs(back - fp.cache.pool[0, :, 0, :, :n]) <= step * 1.5).all()


def test_quality_against_the_float32_cache(int8_pair):
    """Teacher-forced next-token distributions of the INT8 cache vs float32 (same weights)."""
    fp, q = Model(int8_pair[0]), Model(int8_pair[1])
    ids = random_ids(100, seed=2)
    a = [prefill(fp.backend, fp.cache, 0, [ids[:20]])[0]]
    b = [prefill(q.backend, q.cache, 0, [ids[:20]])[0]]
    for t in ids[20:]:
        a.append(decode_one_token(fp.backend, fp.cache, 0, [t])[0])
        b.append(decode_one_token(q.backend, q.cache, 0, [t])[0])
    la, lb = (
        x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
        for x in (np.array(a, np.float64), np.array(b, np.float64))
    )
    kl = (np.exp(la) * (la - lb)).sum(-1)
    # measured ~1e-5 on these random tiny models; 1e-3 is where a broken scale or code shows
    assert kl.mean() < 1e-3, kl.mean()
    assert (np.argmax(a, -1) == np.argmax(b, -1)).mean() >= 0.95


def test_cached_decode_equals_full_reprefill(int8_pair):
    model, reference = Model(int8_pair[1], slots=2), Model(int8_pair[1])
    ids = random_ids(60, seed=3)
    prefill(model.backend, model.cache, 1, [ids[:17]])
    for n in range(17, 60):
        logits = decode_one_token(model.backend, model.cache, 1, [ids[n]])[0]
        if n % 7 == 0:
            reference.cache.reset(0)
            np.testing.assert_allclose(
                logits, prefill(reference.backend, reference.cache, 0, [ids[: n + 1]])[0], atol=ATOL, rtol=0
            )


def test_multi_turn_reuse_equals_fresh_session(int8_pair):
    model = Model(int8_pair[1])
    messages = [{"role": "system", "content": "Be brief."}]
    for turn, question in enumerate(["Hello!", "What is a KV cache?", "And INT8?", "Thanks."]):
        messages.append({"role": "user", "content": question})
        ids = model.tokenizer.encode_chat(messages)
        logits = model.prepare(0, ids)
        assert turn == 0 or model.sessions[0].reused_tokens > 0
        fresh = Model(int8_pair[1])
        np.testing.assert_allclose(logits, fresh.prepare(0, ids), atol=ATOL, rtol=0)
        messages.append({"role": "assistant", "content": f"Answer {turn}."})


def test_window_eviction_requantizes_rerotated_keys(int8_pair):
    """After eviction the kept keys are dequantized, re-rotated and quantized again: layer 0 must
    equal a fresh INT8 run over the kept tokens within one quantization step."""
    policy = ContextPolicy(mode="window", n_sink=4, evict_chunk=32)
    model, reference = Model(int8_pair[1], policy=policy), Model(int8_pair[1])
    ids = random_ids(MAX_LEN, seed=4)
    model.prepare(0, ids)
    logits = model.prepare(0, ids + random_ids(10, seed=5))
    kept = [int(t) for t in model.cache.token_ids(0)]
    assert model.sessions[0].evicted == 32 and np.isfinite(logits).all()
    prefill(reference.backend, reference.cache, 0, [kept])
    n, group = len(kept), model.manifest.geometry.group_size

    def layer0(m):
        return dequantize_tokens(m.cache.pool[0, :, 0, :, :n], m.cache.scales[0, :, 0, :, :n], group)

    step = reference.cache.scales[0, :, 0, :, :n].astype(np.float32).repeat(group, axis=-1)
    assert (np.abs(layer0(model) - layer0(reference)) <= 2.5 * step).all()


def test_warm_file_round_trip_and_dtype_refusal(int8_pair, tmp_path):
    model, fp = Model(int8_pair[1]), Model(int8_pair[0])
    ids = random_ids(20, seed=6)
    prefill(model.backend, model.cache, 0, [ids])
    from kvedge.runtime.prefix import WarmPrefix

    block = model.cache.read(0, len(ids))
    assert block.kv.dtype == np.int8 and block.scales.dtype == np.float16
    path = tmp_path / "p.kvw"
    geometry, fingerprint = model.manifest.geometry, model.manifest.source_fingerprint
    write_warm_file(path, WarmPrefix("p", tuple(ids), block), geometry, fingerprint)
    loaded = read_warm_file(path, geometry, fingerprint, ids)
    np.testing.assert_array_equal(loaded.block.kv, block.kv)
    np.testing.assert_array_equal(loaded.block.scales, block.scales)
    with pytest.raises(KvedgeError, match='"dtype": "int8"'):
        read_warm_file(path, fp.manifest.geometry, fingerprint, ids)
    other = model.cache
    other.write(0, loaded.block, ids)
    with pytest.raises(KvedgeError, match="does not fit"):
        fp.cache.write(0, loaded.block, ids)


def test_bad_int8_options_are_refused_by_name(tmp_path):
    with pytest.raises(KvedgeError, match="needs --variant portable"):
        ExportOptions(kv_dtype="int8", variant="ort")
    with pytest.raises(KvedgeError, match="allowed: \\['float32', 'int8'\\]"):
        ExportOptions(kv_dtype="int4")
    with pytest.raises(KvedgeError, match="applies to --kv-dtype int8 only"):
        ExportOptions(kv_group_size=16)
    with pytest.raises(
        KvedgeError, match="group_size=24 is not allowed for head_dim 64; allowed: \\[16, 32, 64\\]"
    ):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=64, max_len=16, dtype="int8", group_size=24)
    result = CliRunner().invoke(
        main, ["export", "--out", str(tmp_path / "x"), "--kv-dtype", "int8", "--variant", "ort"]
    )
    assert result.exit_code != 0 and "needs --variant portable" in result.output
    assert "Traceback" not in result.output


def test_eval_kv_measures_the_real_int8_cache_and_calibration_refuses_it(int8_pair, tmp_path):
    fp_dir, int8_dir = int8_pair
    args = ["eval-kv", "--model", str(fp_dir), "--int8-model", str(int8_dir), "--limit", "2", "--tokens", "8"]
    result = CliRunner().invoke(main, [*args, "--json", str(tmp_path / "q.json")])
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "q.json").read_text())["schemes"]
    geometry = Model(int8_dir).manifest.geometry
    assert row["scheme"].startswith("INT8 cache in memory")
    assert row["kv_bytes_ratio"] == pytest.approx((1 + 2 / geometry.group_size) / 4)
    assert row["kl_mean"] < 1e-3 and row["top1_agreement"] >= 0.9
    swapped = CliRunner().invoke(main, ["eval-kv", "--model", str(int8_dir), "--int8-model", str(fp_dir)])
    assert swapped.exit_code != 0 and "needs the float32-cache export" in swapped.output
    refused = CliRunner().invoke(main, ["calibrate", "--model", str(int8_dir), "--out", str(tmp_path / "s")])
    assert refused.exit_code != 0 and "calibration reads float K/V" in refused.output
    assert not (tmp_path / "s").exists()
