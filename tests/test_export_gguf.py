"""A GGUF source's quantized blocks stored as they are (`kvedge.export.graph.weights.SourceBlocks`):
a tiny random Llama written as a GGUF file with Q4_0, Q4_1 and Q8_0 tensors, exported. Their
codes stop short of the ends of their range (`short_of_the_ends`), as llama.cpp's weighted
searches leave them, so a requantization of the dequantized floats would not find those blocks
again (Q4_1: up to 7% of the largest weight off); gguf's own quantizer reaches both ends, where
kvedge's affine and extreme grids happen to reproduce it exactly.

The graph's blocks (DequantizeLinear's codes and scales, the offsets of its second product) give
gguf's own dequantizer's values exactly: every product of a code and a float16 d is exact in
float32, and Q4_1's offset m + 8 d is a float32 number for such blocks (`gguf_blocks`'
docstring), so the one rounding left, of code x scale + offset, is the one gguf's d x u + m
makes. The export's logits are then transformers' on the same file up to float32 summation order.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from conftest import assert_same_values, decode_logits, graph_weight, random_ids, stored, unfused_logits
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from tiny import CHATML, make_tiny_gguf, make_tiny_model

from kvedge.bench.gguf_file import write_gguf
from kvedge.contract import HEAD_TABLE, ExportRecipe, Manifest
from kvedge.errors import KvedgeError
from kvedge.export.export import differences, export_model
from kvedge.export.gguf_blocks import block_form, read_gguf_weights
from kvedge.export.graph import DecoderSpec
from kvedge.export.graph.weights import source_blocks
from kvedge.export.quantize import QuantizedWeight, concat_columns, positive_blocks
from kvedge.export.source import load_hf, resolve_source
from kvedge.runtime.embeddings import TableEmbeddings

# GGUF types per tensor: both 4-bit forms in each layer (Q4_0's d is negative in about half of
# its blocks, which portable graphs store on positive scales), the tied embedding Q8_0
KINDS = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q4_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
    "token_embd": "Q8_0",
}
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16  # tests/tiny.py's llama
SOFTMAX_SCALE = HEAD_DIM**-0.5  # 1/4, folded into Wq: exact on d
ATOL = 1e-5  # logits up to 3: float32 summation order alone (exact weights; measured 1.5e-6)
# with onnxruntime's int8 activations (MatMulNBits, kvedge.QuantMatMul): measured 0.02; a block
# stored wrongly moves logits by about their own size
INT8_ACTIVATIONS_ATOL = 0.1
# a float16 graph's logits against the float32 graph's: float16 activations (2**-11 relative) on
# logits up to 2.5, measured 1.6e-3 to 2.7e-3 with or without kept channels (seeds 6-8)
FLOAT16_ATOL = 0.01
MATMULS = {  # graph matmul -> its GGUF tensors, side by side along N
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.o": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}


def short_of_the_ends(w: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """gguf's blocks of w [N, K] with every code kept off the ends of its range: 4-bit codes in
    1..14, Q8_0's in -120..120 (the values d x code (+ m) of those codes)."""
    data = quantize(w, kind)  # [N, row bytes]
    size = GGML_QUANT_SIZES[kind][1]
    blocks = data.reshape(-1, size).copy()
    if kind == GGMLQuantizationType.Q8_0:
        codes = blocks[:, 2:].view(np.int8)
        blocks[:, 2:] = np.clip(codes, -120, 120).view(np.uint8)
    else:  # Q4_0 (d, 16 bytes), Q4_1 (d, m, 16 bytes): two codes a byte
        packed = blocks[:, size - 16 :]
        low, high = np.clip(packed & 0xF, 1, 14), np.clip(packed >> 4, 1, 14)
        blocks[:, size - 16 :] = low | (high << 4)
    return blocks.reshape(data.shape)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", KINDS, quantizer=short_of_the_ends)


@pytest.fixture(scope="module")
def portable_int4(gguf_file):
    out = gguf_file.parent / "portable-int4"
    export_model(gguf_file, out, ExportRecipe(max_len=64, logits="all", weights="int4"))
    return out


def ggufs_values(path) -> dict[str, np.ndarray]:
    """{GGUF name: gguf's dequantization [N, K] float32}, Q and K rows back in Hugging Face's
    order (transformers' reverse permutation) and Q times the softmax scale the graph folds in."""
    values = {}
    for tensor in GGUFReader(str(path)).tensors:
        w = dequantize(tensor.data, tensor.tensor_type)
        kind = tensor.name.split(".")[-2]
        if kind in ("attn_q", "attn_k"):
            n = HEADS if kind == "attn_q" else KV_HEADS
            w = w.reshape(n, HEAD_DIM // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        values[tensor.name] = w * np.float32(SOFTMAX_SCALE) if kind == "attn_q" else w
    return values


def test_the_graphs_blocks_are_ggufs_own(gguf_file, portable_int4):
    """Every matmul's weight, as the graph stores it, is gguf's dequantization, bit for bit; the
    tied Q8_0 embedding is the head's 8-bit blocks, the portable graph's scales all > 0."""
    manifest = Manifest.load(portable_int4)
    assert manifest.weight_source_blocks == {"Q4_0": 6, "Q4_1": 8, "Q8_0": 1}
    assert manifest.weight_head_bits == manifest.embedding.bits == 8  # --head-bits left unset
    want, tensors = ggufs_values(gguf_file), stored(portable_int4)
    for i in range(LAYERS):
        for matmul, parts in MATMULS.items():
            out = f"model.layers.{i}.{matmul}"
            expected = np.concatenate([want[f"blk.{i}.{part}.weight"] for part in parts]).T
            assert_same_values(graph_weight(tensors, out), np.ascontiguousarray(expected), out)
    head = np.ascontiguousarray(want["token_embd.weight"].T)  # [hidden, vocab]
    assert_same_values(graph_weight(tensors, HEAD_TABLE), head, "head")
    codes = tensors[f"{HEAD_TABLE}.weight_q"]
    assert codes.dtype == np.int8 and codes.min() < -8  # 8-bit codes
    scales = [t for name, t in tensors.items() if name.endswith(".weight_scale")]
    assert len(scales) == 4 * LAYERS + 1 and all((s > 0).all() for s in scales)
    assert "model.layers.0.attn.qkv.side_weight" in tensors  # Q4_0's flipped blocks took offsets


def test_the_runtime_embeddings_are_the_ggufs_q8_0_rows(gguf_file, portable_int4):
    table = TableEmbeddings.of(portable_int4, Manifest.load(portable_int4))
    ids = np.arange(320).reshape(4, 80)
    want = ggufs_values(gguf_file)["token_embd.weight"]  # [vocab, hidden]
    assert_same_values(table(ids).reshape(320, -1), want, "embeddings")


def test_logits_are_transformers_on_the_same_file(gguf_file, portable_int4):
    """DequantizeLinear feeding a float MatMul (`unfused_logits`): the exported weights exactly,
    against transformers' float32 model loaded from the GGUF (its own dequantization)."""
    hf, _ = load_hf(resolve_source(gguf_file))
    ids = random_ids(24, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    got = unfused_logits(portable_int4, ids)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    assert np.abs(ref).max() > 2  # far from uniform: the tolerance means something


def test_the_ort_graphs_decode_form_keeps_them_too(gguf_file):
    """--variant ort int4 (two forms: MatMulNBits, kvedge.QuantMatMul for decode steps): the same
    blocks kept (GGUF's d is a float16, as QuantMatMul stores it); its logits, with onnxruntime's
    int8 activations, stay near transformers' (`INT8_ACTIVATIONS_ATOL`)."""
    out = gguf_file.parent / "ort-int4"
    manifest = export_model(gguf_file, out, ExportRecipe(max_len=64, variant="ort", weights="int4"))
    assert manifest.weight_source_blocks == {"Q4_0": 6, "Q4_1": 8, "Q8_0": 1}
    want, tensors = ggufs_values(gguf_file), stored(out)
    for matmul, parts in MATMULS.items():  # the prefill form's DequantizeLinear, in its If branch
        expected = np.concatenate([want[f"blk.1.{part}.weight"] for part in parts]).T
        assert_same_values(
            graph_weight(tensors, f"model.layers.1.{matmul}"), np.ascontiguousarray(expected), matmul
        )
    hf, _ = load_hf(resolve_source(gguf_file))
    ids = random_ids(12, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0, 3:].numpy()
    got = decode_logits(out, ids, start=4)  # a prefill of 4, then one decode step per token
    np.testing.assert_allclose(got, ref, atol=INT8_ACTIVATIONS_ATOL, rtol=0)


def test_a_portable_graph_of_the_sources_blocks_keeps_no_float_channel(gguf_file, portable_int4, tmp_path):
    """A portable graph is computed weight-only (TensorRT, onnxruntime's CUDA kernels; on the CPU
    its product inputs are split in two parts the int8 grid holds), where a kept channel only
    spares its weight row the grid's rounding; the GGUF's blocks are its weights exactly, so an
    export of nothing but them keeps none unless --outlier-channels asks
    (`ExportRecipe.kept_channels_of`), and computes the same products. Float16 graph here, the
    float32 one at the end."""
    recipe = ExportRecipe(max_len=64, logits="all", precision="float16", weights="int4")
    ask = dataclasses.replace(recipe, outlier_channels=8)
    plain = export_model(gguf_file, tmp_path / "plain", recipe)
    asked = export_model(gguf_file, tmp_path / "asked", ask)
    assert plain.weight_source_blocks == asked.weight_source_blocks == {"Q4_0": 6, "Q4_1": 8, "Q8_0": 1}
    assert (plain.weight_outlier_channels, asked.weight_outlier_channels) == (0, 8)
    kept = {name: [t for t in stored(tmp_path / name) if t.endswith(".kept")] for name in ("plain", "asked")}
    assert kept["plain"] == [] and len(kept["asked"]) == 4 * LAYERS + 1
    assert differences(recipe, plain) == differences(ask, asked) == []
    assert differences(ask, plain) == ["weight_outlier_channels is 0, the recipe gives 8"]
    ids = random_ids(24, seed=6)
    exact = unfused_logits(portable_int4, ids)  # float32: transformers' within ATOL
    for name in ("plain", "asked"):
        np.testing.assert_allclose(unfused_logits(tmp_path / name, ids), exact, atol=FLOAT16_ATOL, rtol=0)
    # a matrix requantized here (the Q8_0 head at 4 bits) keeps the channels, in every matrix
    head4_recipe = dataclasses.replace(recipe, head_bits=4)
    head4 = export_model(gguf_file, tmp_path / "head4", head4_recipe)
    assert head4.weight_outlier_channels == 8 and differences(head4_recipe, head4) == []
    # so does a float32 graph, and an ort graph keeps them: onnxruntime's CPU kernel rounds its
    # activations to int8 per block, and a kept channel spares its block that
    assert Manifest.load(portable_int4).weight_outlier_channels == 0
    ort = export_model(gguf_file, tmp_path / "ort", ExportRecipe(max_len=64, variant="ort", weights="int4"))
    assert ort.weight_outlier_channels == 32


def test_what_cannot_be_kept_is_requantized_and_named(gguf_file, tmp_path, caplog):
    """An explicit --head-bits 4 requantizes the Q8_0 head; an int8 export keeps the Q8_0 head
    and requantizes the 4-bit projections; the log line says how many were kept and why not."""
    caplog.set_level(logging.INFO, logger="kvedge.export.export")
    head4 = export_model(gguf_file, tmp_path / "head4", ExportRecipe(max_len=64, weights="int4", head_bits=4))
    assert head4.weight_source_blocks == {"Q4_0": 6, "Q4_1": 8} and head4.weight_head_bits == 4
    assert (
        "kept 14 of 15 quantized matrices as the source's blocks (Q4_0 6, Q4_1 8); requantized 1 "
        "(model.embed_tokens.weight): Q8_0 is 8-bit blocks of 32, the graph stores 4-bit blocks of 32"
    ) in caplog.text
    int8 = export_model(gguf_file, tmp_path / "int8", ExportRecipe(max_len=64, weights="int8"))
    assert int8.weight_source_blocks == {"Q8_0": 1}
    assert (
        "requantized 6 (model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.v_proj.weight"
        in caplog.text
    )
    assert "Q4_0 is 4-bit blocks of 32, the graph stores 8-bit blocks of 32" in caplog.text
    # blocks of 32 split exactly into blocks of 16 (larger blocks: tests/test_export_awq_gptq.py)
    block16 = export_model(
        gguf_file, tmp_path / "b16", ExportRecipe(max_len=64, weights="int4", block_size=16)
    )
    assert block16.weight_source_blocks == {"Q4_0": 6, "Q4_1": 8, "Q8_0": 1}


def test_positive_blocks_hold_q4_0s_values():
    """Q4_0's d < 0 where a block's extreme is positive: stored on scale -d with codes -q - 1 and
    offset -d, the same values bit for bit; a block of d = 0 takes scale 1, codes 0."""
    w = np.random.default_rng(7).standard_normal((8, 64)).astype(np.float32)  # [N, K]
    w[0, :32] = 0.0
    data = quantize(w, GGMLQuantizationType.Q4_0)
    qw = block_form(data, GGMLQuantizationType.Q4_0, 64, 8)
    assert (qw.scale < 0).any() and (qw.scale == 0).any() and qw.offset is None
    positive = positive_blocks(qw)
    assert (positive.scale > 0).all() and positive.q.min() >= -8 and positive.q.max() <= 7
    assert_same_values(positive.dequantize(), qw.dequantize(), "positive")
    assert positive_blocks(positive) is positive


def test_blocks_side_by_side_keep_their_own_columns():
    rng = np.random.default_rng(8)

    def blocks(n: int, offsets: bool) -> QuantizedWeight:  # [64, n] int4, blocks of 32
        offset = rng.random((2, n), np.float32) if offsets else None
        return QuantizedWeight(
            rng.integers(-8, 8, (64, n)).astype(np.int8), rng.random((2, n), np.float32), offset, 4, 32, 0
        )

    a, b = blocks(3, offsets=False), blocks(2, offsets=True)
    both = concat_columns([a, b])
    assert_same_values(both.dequantize(), np.concatenate([a.dequantize(), b.dequantize()], 1), "concat")
    assert_same_values(both.columns(slice(3, 5)).dequantize(), b.dequantize(), "columns")
    with pytest.raises(KvedgeError, match=r"cannot join weights of \(bits, block size, K\)"):
        concat_columns([a, QuantizedWeight(a.q[:32], a.scale[:1], None, 4, 32, 0.0)])


def test_blocks_mapped_wrongly_are_requantized_not_kept(gguf_file):
    """A layout mistake (here Q's columns left in GGUF's permuted order) is caught against the
    weights transformers reads, and that matrix requantized, naming why."""
    hf, _ = load_hf(resolve_source(gguf_file))
    weights = {k: v.numpy() for k, v in hf.state_dict().items()}
    gguf = read_gguf_weights(gguf_file)
    name = "model.layers.0.self_attn.q_proj.weight"
    order = np.arange(64).reshape(HEADS, 2, HEAD_DIM // 2).swapaxes(1, 2).reshape(-1)
    blocks = {**gguf.tensors, name: gguf.tensors[name].columns(order)}
    chosen = source_blocks(
        DecoderSpec.from_config(hf.config),
        blocks,
        gguf.types,
        weights,
        ExportRecipe(weights="int4"),
    )
    assert set(chosen.requantized) == {name} and len(chosen.kept) == 14
    assert chosen.requantized[name].startswith("Q4_0 blocks dequantize ")


def test_the_benchs_gguf_writer_writes_llama_as_the_converter_does(tmp_path):
    """`write_gguf` (bench/scale.py --gguf) of a Llama folder: the tensors of tests/tiny.py's file
    (llama.cpp's converter's names and Q/K permutation, float32), byte for byte."""
    want = make_tiny_gguf(tmp_path / "tiny.gguf", {}, seed=4)
    got = write_gguf(tmp_path / "tiny-hf", tmp_path / "written.gguf", chat_template=CHATML)
    written = {t.name: t for t in GGUFReader(str(got)).tensors}
    tensors = GGUFReader(str(want)).tensors
    assert sorted(written) == sorted(t.name for t in tensors)
    for tensor in tensors:
        assert written[tensor.name].data.tobytes() == tensor.data.tobytes(), tensor.name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_written_gguf_reads_back_as_its_folder(tmp_path, family):
    """The file `write_gguf` writes from a folder, Q8_0, read back as transformers reads it: every
    weight of the folder within its Q8_0 rounding, the hyperparameters the same. (transformers
    reads no head_dim from a Qwen3 GGUF: its default, 128, is every Qwen3's.)"""
    folder = make_tiny_model(
        tmp_path / "hf", family, seed=4, **({"head_dim": 128} if family == "qwen3" else {})
    )
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0", chat_template=CHATML)
    whole, _ = load_hf(resolve_source(folder))
    back, _ = load_hf(resolve_source(path))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(back.config, key) == getattr(whole.config, key), key
    state = back.state_dict()
    for name, value in whole.state_dict().items():
        step = np.abs(value.numpy()).max() / 127  # Q8_0: at most half a step of a block's absmax / 127
        np.testing.assert_allclose(state[name].numpy(), value.numpy(), atol=step, rtol=0, err_msg=name)


def test_a_written_gguf_takes_its_eos_and_template_from_the_tokenizer_where_the_config_has_none(tmp_path):
    """The scale bench's random checkpoints declare no eos_token_id in config.json (an export of
    their GGUF refused: "the model declares no eos token id"): the tokenizer's own is written."""
    folder = make_tiny_model(tmp_path / "hf", "llama", seed=4)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = config["bos_token_id"] = None
    (folder / "config.json").write_text(json.dumps(config))
    fields = GGUFReader(str(write_gguf(folder, tmp_path / "m.gguf"))).fields
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert fields["tokenizer.ggml.eos_token_id"].contents() == vocab["<|im_end|>"]
    assert fields["tokenizer.chat_template"].contents() == (folder / "chat_template.jinja").read_text()
