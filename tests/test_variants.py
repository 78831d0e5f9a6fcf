"""Graph variants and weight-only quantization: the quantizer's math, what onnxruntime fuses,
the manifest fields, and a loose quality check of quantized weights (speed and the real quality
figures live in `kvedge bench`).

Quantized-weight tolerance: mean KL(p_hf || p_kvedge) of next-token distributions over 33
positions of a tiny random model. Measured ~1e-4 (int8) and ~1.2e-2 (int4, block 32); the
bounds leave 10x / 4x margin and still catch a wrong scale or nibble order (KL > 0.5).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from conftest import FUSES_MATMULNBITS, export_once, optimized_ops, random_ids, require_onnxruntime
from onnx import numpy_helper
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM

from kvedge.bench.measure import kl_and_top1
from kvedge.contract import MANIFEST_FILE, ExportRecipe, Manifest
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.export.graph import all_graphs
from kvedge.export.quantize import pack_int4, quantize_blockwise, weight_tensor
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

MAX_KL = {"int8": 2e-3, "int4": 5e-2}


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("variants") / "hf", "llama")


@pytest.fixture(scope="module")
def exports(tiny_source, tmp_path_factory):
    """(variant, weights) -> artifact folder, built on demand once per module."""
    return export_once(
        tiny_source, tmp_path_factory.mktemp("variant_exports"), "variant", "weights", max_len=64
    )


def test_quantizer_puts_the_extreme_on_qmin_and_reports_its_error():
    w = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32)
    w[3, 0], w[40, 1] = -9.0, 7.5  # block 0 of column 0, block 1 of column 1
    qw = quantize_blockwise(w, bits=4, block_size=32)
    assert qw.q.shape == (64, 5) and qw.scale.shape == (2, 5)
    assert qw.q.min() >= -8 and qw.q.max() <= 7
    assert qw.q[3, 0] == -8 and qw.q[40, 1] == -8  # the signed extreme maps to qmin exactly
    error = np.abs(qw.dequantize() - w)
    assert qw.max_error == pytest.approx(float(error.max()))
    assert (error.reshape(2, 32, 5) <= np.abs(qw.scale)[:, None, :] + 1e-6).all()
    int8 = quantize_blockwise(w, bits=8, block_size=32)
    assert int8.max_error < qw.max_error / 8


def test_zero_block_and_bad_shapes():
    qw = quantize_blockwise(np.zeros((32, 2), np.float32), bits=4, block_size=32)
    assert (qw.scale == 1).all() and (qw.q == 0).all() and qw.max_error == 0
    with pytest.raises(KvedgeError, match=r"\[48, 3\] weight in blocks of 32"):
        quantize_blockwise(np.zeros((48, 3), np.float32), bits=4, block_size=32)


def test_int4_packing_is_the_onnx_layout():
    q = np.array([[-8, 7, 0], [1, -1, 3]], np.int8)
    assert pack_int4(q) == bytes([0x78, 0x10, 0x3F])  # low nibble first: (-8, 7), (0, 1), (-1, 3)
    qw = quantize_blockwise(np.random.default_rng(1).standard_normal((32, 3)).astype(np.float32), 4, 16)
    assert (numpy_helper.to_array(weight_tensor("w", qw)).astype(np.int8) == qw.q).all()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(variant="tensorrt"), r"--variant 'tensorrt' is not allowed; allowed: \['ort', 'portable'\]"),
        (
            dict(weights="int3"),
            r"--weights 'int3' is not allowed; allowed: \['float16', 'float32', 'int4', 'int8'\]",
        ),
        (dict(weights="int4", block_size=48), r"--block-size 48 is not allowed; allowed: \[16, 32"),
        (
            dict(weights="int4", outlier_channels=5),
            r"--outlier-channels 5 is not allowed; allowed: \[0, 8, 16, 32, 64\]",
        ),
        (
            dict(outlier_channels=8),
            "--outlier-channels 8 applies to --weights int8 or int4 only, not --weights float32",
        ),
        (dict(weights="float16", head_bits=8), "--head-bits 8 applies to --weights int8 or int4 only"),
        (
            dict(weights="int8", head_bits=4),
            r"--head-bits 4 is not allowed with --variant portable --weights int8; allowed: \[8\]",
        ),
        (
            dict(variant="ort", weights="int8", head_bits=2),
            r"--head-bits 2 is not allowed with --variant ort --weights int8; allowed: \[8, 4\]",
        ),
    ],
)
def test_bad_export_options_are_named(options, message):
    with pytest.raises(KvedgeError, match=message):
        ExportRecipe(**options)


def test_block_size_must_divide_the_model(tiny_source, tmp_path):
    with pytest.raises(
        KvedgeError, match=r"--block-size 64 does not divide the model's intermediate_size \(96\)"
    ):
        export_model(tiny_source, tmp_path / "out", ExportRecipe(max_len=32, weights="int4", block_size=64))


@pytest.mark.parametrize("variant", ["portable", "ort"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_matmuls_fuse_into_matmulnbits(exports, tmp_path, variant, weights):
    """Every projection and the LM head run as onnxruntime's n-bit matmul; no DequantizeLinear is left."""
    require_onnxruntime(*FUSES_MATMULNBITS)
    folder = exports(variant, weights)
    manifest = Manifest.load(folder)
    ops = optimized_ops(folder, tmp_path)
    layers = manifest.geometry.num_layers
    assert ops["MatMulNBits"] == 4 * layers + 1  # qkv, o, gate_up, down per layer; LM head
    assert ops["DequantizeLinear"] == 0
    assert manifest.opset == 21 and manifest.weights_dtype == weights and manifest.weight_block_size == 32


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_portable_side_weights_are_stored_output_major_and_folded_by_onnxruntime(exports, tmp_path, weights):
    """Portable graphs store each projection's and the LM head's second-product weight [N, *]
    behind a Transpose, which TensorRT keeps once for both profiles (`quant_matmul._side_weight`).
    onnxruntime folds those Transposes at load: none is run."""
    folder = exports("portable", weights)
    graph = onnx.load(str(folder / "model.onnx")).graph
    stored = {t.name: tuple(t.dims) for t in graph.initializer if t.name.endswith(".side_weight")}
    transposed = [n for n in graph.node if n.op_type == "Transpose" and n.input[0] in stored]
    layers = Manifest.load(folder).geometry.num_layers
    assert len(transposed) == 4 * layers + 1  # qkv, o, gate_up, down; the LM head
    assert stored["logits.rows_vocab.side_weight"][0] == Manifest.load(folder).vocab_size  # [N, *]
    codes = {t.name: tuple(t.dims) for t in graph.initializer if t.name.endswith(".weight_q")}  # [K, N]
    for node in transposed:
        matmul = next(n for n in graph.node if n.op_type == "MatMul" and node.output[0] in n.input)
        assert matmul.input[1] == node.output[0]  # the weight side of x @ w
        prefix = node.input[0].removesuffix(".side_weight")
        assert stored[node.input[0]][0] == codes[f"{prefix}.weight_q"][1]  # [N, *]
    before = Counter(node.op_type for node in graph.node)
    assert optimized_ops(folder, tmp_path)["Transpose"] <= before["Transpose"] - len(transposed)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_lm_head_is_stored_at_eight_bits_at_least(exports, weights):
    """int4 exports, ort and portable (TensorRT's) alike, keep the tied LM head at int8 (its 4-bit
    copy cost most of their KL); the projections keep the export's bits."""
    graphs = all_graphs(onnx.load(str(exports("ort", weights) / "model.onnx")).graph)
    stored = {t.name: t.data_type for g in graphs for t in g.initializer if t.name.endswith(".weight_q")}
    projection = onnx.TensorProto.INT4 if weights == "int4" else onnx.TensorProto.INT8
    assert stored.pop("logits.rows_vocab.weight_q") == onnx.TensorProto.INT8
    assert stored and set(stored.values()) == {projection}
    portable = onnx.load(str(exports("portable", weights) / "model.onnx")).graph  # TensorRT's
    head = next(t for t in portable.initializer if t.name == "logits.rows_vocab.weight_q")
    assert head.data_type == onnx.TensorProto.INT8


def kept_rows(folder) -> tuple[dict[str, int], dict[str, int]]:
    """({quantized matmul: input channels its int8 mask zeroes}, {quantized matmul: float32 weight
    rows its second product holds for single channels}). Standard ops (portable graphs): the
    channels a Gather takes from x (`quant_matmul._side_inputs`); ort graphs: kvedge.SideInputs
    gathers its `kept` channels and masks them where it has a second output."""
    graphs = all_graphs(onnx.load(str(folder / "model.onnx")).graph)  # a two-form graph's prefill form
    nodes = [node for g in graphs for node in g.node]
    initializers = [t for g in graphs for t in g.initializer]
    masks, rows = {}, {}
    kept = {t.name: t for t in initializers if t.name.endswith(".kept")}
    for node in nodes:
        if node.op_type == "Gather" and node.input[1].endswith(".kept"):  # standard ops: x[..., kept]
            rows[node.input[1].removesuffix(".kept")] = numpy_helper.to_array(kept[node.input[1]]).size
        if node.op_type == "SideInputs":
            name, count = node.input[1].removesuffix(".kept"), numpy_helper.to_array(kept[node.input[1]]).size
            rows[name] = count
            if len(node.output) == 2:
                masks[name] = count
    for t in initializers:
        if t.name.endswith(".int8_mask"):
            masks[t.name.removesuffix(".int8_mask")] = int((numpy_helper.to_array(t) == 0).sum())
    masked = [n.input[0] for n in nodes if n.op_type == "Mul" and n.input[1].endswith(".int8_mask")]
    assert not masked or len(masked) == len(masks)  # one mask Mul per kept set (standard ops)
    return masks, rows


@pytest.mark.parametrize("channels", [0, 8, 16])
def test_outlier_channels_and_head_bits_reach_the_graph(tiny_source, tmp_path, channels):
    """--outlier-channels sets each quantized matmul's kept rows (0: no mask, no kept rows, only
    the block offsets' product); --head-bits 4 stores the ort LM head at 4 bits; both recorded."""
    out = tmp_path / "out"
    options = ExportRecipe(max_len=64, variant="ort", weights="int4", outlier_channels=channels, head_bits=4)
    export_model(tiny_source, out, options)
    masks, rows = kept_rows(out)
    layers = Manifest.load(out).geometry.num_layers
    if channels:
        assert len(masks) == 4 * layers + 1 and set(masks.values()) == {channels}
    else:
        assert masks == {}
    assert rows and set(rows.values()) == {channels}
    graphs = all_graphs(onnx.load(str(out / "model.onnx")).graph)
    stored = {t.name: t.data_type for g in graphs for t in g.initializer if t.name.endswith(".weight_q")}
    assert stored["logits.rows_vocab.weight_q"] == onnx.TensorProto.INT4
    manifest = Manifest.load(out)
    assert (manifest.weight_outlier_channels, manifest.weight_head_bits) == (channels, 4)


def test_default_channels_and_head_bits_are_the_stated_ones(tiny_source, exports, tmp_path):
    """No --outlier-channels / --head-bits: 32 channels (8 in a portable graph) and an int8 head,
    the same bytes as asking for them; float exports record 0 for both."""
    default = exports("ort", "int4")
    explicit = tmp_path / "explicit"
    options = ExportRecipe(max_len=64, variant="ort", weights="int4", outlier_channels=32, head_bits=8)
    export_model(tiny_source, explicit, options)
    for name in ("model.onnx", "model.onnx.data"):
        assert (explicit / name).read_bytes() == (default / name).read_bytes()
    masks, rows = kept_rows(default)
    assert set(masks.values()) == set(rows.values()) == {32}
    int4 = Manifest.load(default)
    assert (int4.weight_outlier_channels, int4.weight_head_bits) == (32, 8)
    portable = Manifest.load(exports("portable", "int4"))
    assert (portable.weight_outlier_channels, portable.weight_head_bits) == (8, 8)
    half = ExportRecipe(max_len=64, weights="int4", precision="float16")
    assert (half.kept_channels, half.lm_head_bits) == (8, 8)
    fp32 = Manifest.load(exports("ort", "float32"))
    assert (fp32.weight_outlier_channels, fp32.weight_head_bits) == (0, 0)
    data = json.loads((default / MANIFEST_FILE).read_text())
    old = {k: v for k, v in data.items() if k not in ("weight_outlier_channels", "weight_head_bits")}
    assert Manifest.from_dict(old).weight_outlier_channels is None  # written before the fields


def test_ort_variant_uses_fused_attention_and_norms(exports, tmp_path):
    folder = exports("ort", "float32")
    layers = Manifest.load(folder).geometry.num_layers
    ops = optimized_ops(folder, tmp_path)
    assert ops["GroupQueryAttention"] == layers and ops["Softmax"] == 0
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * layers  # every residual add + its norm
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert "position_ids" not in {i.name for i in graph.input}  # positions come from past_lengths


@pytest.mark.parametrize("variant", ["portable", "ort"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_stay_close_to_hf(tiny_source, exports, variant, weights):
    hf = AutoModelForCausalLM.from_pretrained(tiny_source, dtype="float32").eval()
    ids = random_ids(52, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()[19:]
    model = Model(exports(variant, weights))
    got = [prefill(model.backend, model.cache, 0, [ids[:20]])[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[20:]]
    kl, _ = kl_and_top1(ref, np.stack(got))
    assert np.isfinite(kl).all() and kl.mean() < MAX_KL[weights]


def test_manifest_variant_defaults_and_refusals(exports, tmp_path):
    data = json.loads((exports("ort", "float32") / MANIFEST_FILE).read_text())
    assert Manifest.from_dict(data).in_place
    old = {k: v for k, v in data.items() if k not in ("variant", "weight_block_size")}
    assert Manifest.from_dict(old).variant == "portable"  # written before the field existed
    with pytest.raises(ArtifactMismatch, match="graph variant 'paged' is unknown to this kvedge"):
        Manifest.from_dict({**data, "variant": "paged"})
    fp32 = Manifest.from_dict(data)
    int4 = Manifest.load(exports("ort", "int4"))
    with pytest.raises(ArtifactMismatch, match="was made with int4 weights, this model has float32 weights"):
        fp32.check_compatible(int4, "warm cache")


FP16_UNIT = 2.0**-11  # float16 unit roundoff: |fp16(w) - w| <= FP16_UNIT * |w|


@pytest.mark.parametrize("variant", ["portable", "ort"])
def test_float16_weights_match_transformers(tiny_source, exports, variant):
    """--weights float16: half the bytes, float32 arithmetic, so the only error is fp16 rounding
    of the weights (relative FP16_UNIT each). Carried through the layers it moves a logit by a
    small multiple of FP16_UNIT x the logits' range: measured 0.74 x on this model, bounded at
    4 x (a float32 graph agrees to ~1e-5; int8 weights move logits ~10 x more)."""
    folder = exports(variant, "float16")
    manifest = Manifest.load(folder)
    assert manifest.weights_dtype == "float16" and manifest.weight_block_size == 0
    graph = onnx.load(str(folder / "model.onnx"))
    stored = {t.name: t.data_type for t in graph.graph.initializer}
    assert stored["model.embed_tokens.weight.f16"] == onnx.TensorProto.FLOAT16
    f32_bytes = (exports(variant, "float32") / "model.onnx.data").stat().st_size
    assert 0.45 < (folder / "model.onnx.data").stat().st_size / f32_bytes < 0.56

    ids = random_ids(52, seed=1)
    model = Model(folder)
    got = [prefill(model.backend, model.cache, 0, [ids[:20]])[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[20:]]
    got = np.stack(got)
    hf = AutoModelForCausalLM.from_pretrained(tiny_source, dtype="float32").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()[19:]
    bound = 4 * FP16_UNIT * float(ref.max() - ref.min())
    np.testing.assert_allclose(got, ref, atol=bound, rtol=0)
