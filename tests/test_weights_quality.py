"""Quantized weights keep the answer: the export's block grids on weights that already sit on a
llama.cpp grid (SmolLM2's GGUF: Q4_1 projections, Q8_0 embedding), on a tiny model built so.

Two sources of error are kept apart. The weight scheme is checked with onnxruntime's QDQ fusion
off (DequantizeLinear + float MatMul, what the graph says): Q4_1/Q8_0 weights must come back
exactly, so logits match transformers to float32 rounding (atol 1e-3 on logits of ~10; measured
~1e-5). The symmetric grid the export used before is off by up to half a step (scale ~ range/255,
0.04 here) on every weight and misses that bound by ~100x. With the fusion on (the default
session), onnxruntime's MatMulNBits also rounds activations to int8 per block of 32; that part
is measured on the real model, docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import random_ids, unfused_logits
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM

from kvedge.calibrate.calibrate import builtin_prompts
from kvedge.calibrate.evaluate import evaluate, weights_label
from kvedge.contract import ExportRecipe, Manifest
from kvedge.errors import ArtifactMismatch
from kvedge.export.export import export_model
from kvedge.export.quantize import EXPORT_GRIDS, quantize_blockwise
from kvedge.runtime.model import Model

BLOCK = 32
ATOL = 1e-4


def q4_1_grid(w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """w [N, K] moved onto llama.cpp Q4_1 blocks along K: min + d * k, k in 0..15, both ends used."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.min(axis=-1, keepdims=True), blocks.max(axis=-1, keepdims=True)
    d = ((high - low) / 15).astype(np.float16).astype(np.float32)  # GGUF stores d and min as fp16
    low = low.astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint((blocks - low) / d), 0, 15)
    codes[..., 0], codes[..., 1] = 0, 15  # a real Q4_1 block reaches both ends
    return (low + d * codes).reshape(n, k).astype(np.float32)


def q8_0_grid(w: np.ndarray) -> np.ndarray:
    """w [N, K] moved onto llama.cpp Q8_0 blocks along K: d * q, q in -127..127."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    return (d * np.clip(np.rint(blocks / d), -127, 127)).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize(("half", "positive"), [(False, True), (True, False)])
def test_a_large_matrix_is_quantized_in_chunks_to_the_same_blocks(half, positive):
    """`quantize_blockwise` takes a few columns at a time: the blocks equal one pass's, and what it
    allocates beside w peaks near its results (codes a quarter of w, a scale and an offset per
    32), not at the five full-size float32 temporaries of one pass (measured 5.2x w; chunked 1.1x
    on [576, 49152])."""
    import tracemalloc

    w = np.random.default_rng(3).standard_normal((256, 65536), dtype=np.float32)  # 64 MiB
    args = (w, 4, BLOCK, EXPORT_GRIDS, half, positive)
    whole = quantize_blockwise(*args, chunk_values=w.size)
    tracemalloc.start()
    try:
        chunked = quantize_blockwise(*args, chunk_values=1 << 18)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for name in ("q", "scale", "offset"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name), err_msg=name)
    assert chunked.max_error == whole.max_error
    assert peak < 0.6 * w.nbytes, peak / w.nbytes


@pytest.mark.parametrize("bits", [8, 4])
def test_q4_1_blocks_come_back_exactly(bits):
    rng = np.random.default_rng(0)
    w = q4_1_grid(rng.standard_normal((40, 96)).astype(np.float32), rng)  # [N, K]
    qw = quantize_blockwise(np.ascontiguousarray(w.T), bits, BLOCK, EXPORT_GRIDS)
    assert qw.offset is not None and qw.max_error < 1e-6
    old = quantize_blockwise(np.ascontiguousarray(w.T), bits, BLOCK)  # the signed-extreme grid alone
    assert old.max_error > 100 * qw.max_error


def test_q8_0_blocks_come_back_exactly_without_offsets():
    w = q8_0_grid(np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32))
    qw = quantize_blockwise(np.ascontiguousarray(w.T), 8, BLOCK, EXPORT_GRIDS)
    assert qw.offset is None and qw.max_error < 1e-6  # absmax, no second product in the graph


def test_each_block_takes_its_closest_grid():
    w = np.random.default_rng(2).standard_normal((128, 7)).astype(np.float32)
    w[:32, 0] += 3.0  # a block far from zero: the affine grid wins there
    best = quantize_blockwise(w, 4, BLOCK, EXPORT_GRIDS)
    errors = {
        grid: np.square(quantize_blockwise(w, 4, BLOCK, (grid,)).dequantize() - w).reshape(4, BLOCK, 7).sum(1)
        for grid in EXPORT_GRIDS
    }
    best_error = np.square(best.dequantize() - w).reshape(4, BLOCK, 7).sum(1)
    np.testing.assert_allclose(best_error, np.minimum.reduce(list(errors.values())), rtol=1e-5)
    assert errors["affine"][0, 0] < errors["extreme"][0, 0] / 4


@pytest.mark.parametrize("bits", [8, 4])
def test_positive_scales_hold_the_signed_extreme_grid_one_level_up(bits):
    """TensorRT's form (`positive_scales`): a block whose extreme is positive (extreme grid scale
    s < 0, codes q) is stored on scale -s with offset -s and codes -q - 1: the same values."""
    w = np.random.default_rng(5).standard_normal((128, 9)).astype(np.float32)
    signed = quantize_blockwise(w, bits, BLOCK)
    positive = quantize_blockwise(w, bits, BLOCK, positive_scales=True)
    flipped = signed.scale < 0  # [K/bs, N]
    assert flipped.any() and (~flipped).any() and (positive.scale > 0).all()
    np.testing.assert_array_equal(positive.scale, np.abs(signed.scale))
    np.testing.assert_array_equal(positive.offset, np.where(flipped, -signed.scale, 0))
    rows = np.repeat(flipped, BLOCK, axis=0)  # [K, N]
    np.testing.assert_array_equal(positive.q, np.where(rows, -signed.q - 1, signed.q))
    np.testing.assert_allclose(positive.dequantize(), signed.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_positive_scales_cost_no_error(bits):
    """Every block keeps the error it has on the export's grids without the constraint, also
    where the extreme grid of negative scale is its best (dropping that grid instead gave
    SmolLM2's 4-bit LM head 0.67% more squared error)."""
    w = np.random.default_rng(6).standard_normal((256, 16)).astype(np.float32)
    signed = quantize_blockwise(w, bits, BLOCK, EXPORT_GRIDS)
    positive = quantize_blockwise(w, bits, BLOCK, EXPORT_GRIDS, positive_scales=True)
    assert (signed.scale < 0).any() and (positive.scale > 0).all()
    errors = [np.square(qw.dequantize() - w).reshape(-1, BLOCK, 16).sum(1) for qw in (signed, positive)]
    np.testing.assert_allclose(errors[1], errors[0], rtol=1e-5)
    assert positive.max_error == pytest.approx(signed.max_error, rel=1e-5)


@pytest.fixture(scope="module")
def gguf_like_source(tmp_path_factory):
    """A tiny llama whose projections are Q4_1 values and whose (tied) embedding is Q8_0 values."""
    folder = make_tiny_model(tmp_path_factory.mktemp("gguf_like") / "hf", "llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    rng = np.random.default_rng(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(torch.from_numpy(q4_1_grid(p.numpy(), rng)))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.from_numpy(q8_0_grid(p.numpy())))
    model.save_pretrained(folder)
    return folder


def test_int8_export_reproduces_gguf_grids(gguf_like_source, tmp_path):
    out = tmp_path / "int8"
    export_model(gguf_like_source, out, ExportRecipe(max_len=64, logits="all", weights="int8"))
    hf = AutoModelForCausalLM.from_pretrained(gguf_like_source, dtype="float32").eval()
    ids = random_ids(24, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(unfused_logits(out, ids), ref, atol=ATOL, rtol=0)


def test_eval_compares_a_quantized_weight_export_with_the_float32_model(gguf_like_source, tmp_path):
    """`eval-kv --weights-model`: the same teacher-forced KL / top-1 as for INT8 caches; a
    different model is refused by name. Bound: the fused kernel's int8 activations on this tiny
    model (measured KL ~1e-4)."""
    fp32, int8 = tmp_path / "fp32", tmp_path / "int8"
    export_model(gguf_like_source, fp32, ExportRecipe(max_len=64, variant="ort"))
    export_model(gguf_like_source, int8, ExportRecipe(max_len=64, variant="ort", weights="int8"))
    prompts = builtin_prompts("heldout")[:2]
    (result,) = evaluate(Model(fp32), None, prompts, tokens=16, batch=2, weights_models=(Model(int8),))
    details = "block 32, 32 outlier channels, 8-bit head, kvedge decode matmuls"
    assert result.scheme == f"ort int8 weights ({details}), float32 cache"
    assert 0.0 <= result.kl_mean < 2e-3 and result.top1_agreement >= 0.9, result
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    export_model(other, tmp_path / "other-int8", ExportRecipe(max_len=64, variant="ort", weights="int8"))
    with pytest.raises(ArtifactMismatch, match="--weights-model was made from model"):
        evaluate(Model(fp32), None, prompts, tokens=4, weights_models=(Model(tmp_path / "other-int8"),))


def test_weight_exports_differing_in_channels_or_head_bits_are_named_apart(gguf_like_source, tmp_path):
    """`eval-kv --weights-model` rows name the block size, kept channels, head bits and decode
    matmuls the manifest records, so two int4 exports that differ only there are told apart."""
    export_model(gguf_like_source, tmp_path / "fp32", ExportRecipe(max_len=64, variant="ort"))
    flags = {"default": {}, "no-outliers": dict(outlier_channels=0), "head4": dict(head_bits=4)}
    for name, options in flags.items():
        int4 = ExportRecipe(max_len=64, variant="ort", weights="int4", **options)
        export_model(gguf_like_source, tmp_path / name, int4)
    models = tuple(Model(tmp_path / name) for name in flags)
    prompts = builtin_prompts("heldout")[:1]
    results = evaluate(Model(tmp_path / "fp32"), None, prompts, tokens=2, weights_models=models)
    assert [r.scheme for r in results] == [
        "ort int4 weights (block 32, 32 outlier channels, 8-bit head, kvedge decode matmuls), float32 cache",
        "ort int4 weights (block 32, 0 outlier channels, 8-bit head, kvedge decode matmuls), float32 cache",
        "ort int4 weights (block 32, 32 outlier channels, 4-bit head, kvedge decode matmuls), float32 cache",
    ]
    unrecorded = dataclasses.replace(
        models[0].manifest, weight_outlier_channels=None, weight_head_bits=None, weight_decode_matmuls=None
    )
    assert weights_label(unrecorded) == "ort int4 weights (block 32)"  # exported before kvedge recorded them
    assert weights_label(Manifest.load(tmp_path / "fp32")) == "ort float32 weights"
