"""GGUF tensors kept in kvedge's block form (kvedge/export/gguf_blocks.py): each form dequantizes
to gguf's reference dequantizer's values (bit for bit, or within one rounding of the block's
offset where the module docstring says so), names and the rotary permutation as transformers
maps them, and the types without a block form refused by name.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from kvedge.errors import KvedgeError
from kvedge.export.gguf_blocks import (
    ARCHITECTURE_GLOBALS,
    ARCHITECTURE_NAMES,
    GLOBAL_NAMES,
    LAYER_NAMES,
    WHOLE_NAMES,
    block_form,
    hf_name,
    read_gguf_weights,
)
from kvedge.export.quantize import QuantizedWeight
from kvedge.export.source import default_gguf

T = GGMLQuantizationType
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf.quants can quantize these
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)  # dequantize only: raw blocks built here
HALF_AT = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # d, dmin
OFFSET_TYPES = (T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K)


def write_gguf(path, arch: str, tensors: dict, heads: int = 4, kv_heads: int = 2) -> None:
    """A GGUF file of `tensors` {name: float32 array, or (raw block bytes [N, row bytes], type)}."""
    writer = GGUFWriter(str(path), arch)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def raw_blocks(kind: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks [n, row bytes] of `kind`, its float16 d (and dmin) set to weight-like sizes."""
    rng = np.random.default_rng(seed)
    elements, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (n * k // elements, size), dtype=np.uint8)
    for at in HALF_AT[kind]:
        half = (np.abs(rng.standard_normal(len(blocks))) * 1e-3).astype(np.float16)
        blocks[:, at : at + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def rotary_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (n_head already the K heads for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def as_hf(weight: QuantizedWeight | np.ndarray) -> np.ndarray:
    return weight.dequantize().T if isinstance(weight, QuantizedWeight) else weight


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), float(np.abs(got - want).max())


def assert_within_offset_rounding(qw: QuantizedWeight, want: np.ndarray) -> None:
    """At most 2**-23 (|offset| + |w|) from gguf's value (one rounding of the offset, one of w)."""
    offset = np.repeat(qw.offset, qw.block_size, axis=0).T  # [N, K]
    got = qw.dequantize().T
    assert np.all(np.abs(got - want) <= 2.0**-23 * (np.abs(offset) + np.abs(want))), float(
        np.abs(got - want).max()
    )


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf_round_trips(kind):
    w = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32) * 0.05  # [N, K]
    data = quantize(w, kind)
    qw = block_form(data, kind, 256, 48)
    assert qw.q.shape == (256, 48) and qw.scale.shape == (256 // qw.block_size, 48)
    assert qw.q.min() >= -(2 ** (qw.bits - 1)) and qw.q.max() < 2 ** (qw.bits - 1)
    assert (qw.offset is not None) == (kind in OFFSET_TYPES) and qw.max_error == 0.0
    assert_same_bits(qw.dequantize().T, dequantize(data, kind))


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_blocks_round_trip(kind):
    data = raw_blocks(kind, 16, 512)
    qw = block_form(data, kind, 512, 16)
    want = dequantize(data, kind)
    if kind in OFFSET_TYPES:
        assert_within_offset_rounding(qw, want)
    else:
        assert_same_bits(qw.dequantize().T, want)
    expected = {T.Q2_K: (4, 16), T.Q3_K: (4, 16), T.Q4_K: (4, 32), T.Q5_K: (8, 32), T.Q6_K: (8, 16)}
    assert (qw.bits, qw.block_size) == expected[kind]


@pytest.mark.parametrize("kind", OFFSET_TYPES, ids=lambda t: t.name)
def test_offset_forms_are_exact_where_the_offset_is_a_float32(kind):
    """Weight-like blocks (a minimum near -8 steps, as quantizers make) leave the offset exact."""
    rng = np.random.default_rng(2)
    if kind in QUANTIZABLE:
        data = quantize(rng.standard_normal((32, 256)).astype(np.float32) * 0.05, kind)
    else:  # sub-scales and sub-minimums of one size: the offset's two terms are close
        data = raw_blocks(kind, 32, 256, seed=3)
        size = GGML_QUANT_SIZES[kind][1]
        blocks = data.reshape(-1, size)
        if kind == T.Q2_K:
            blocks[:, 0:16] = rng.integers(8, 16, (len(blocks), 16), dtype=np.uint8) * 17
        else:
            blocks[:, 4:16] = rng.integers(32, 64, (len(blocks), 12), dtype=np.uint8)
        d, dmin = HALF_AT[kind]
        blocks[:, dmin : dmin + 2] = blocks[:, d : d + 2]
    assert_same_bits(block_form(data, kind, 256, 32).dequantize().T, dequantize(data, kind))


def test_an_inexact_offset_is_rounded_once():
    """Q4_1 with d = 1 and m = 3 * 2**-24: m + 8 d is no float32, so the offset is rounded."""
    codes = np.arange(32, dtype=np.uint8) % 16
    half = np.array([1.0, 3 * 2.0**-24], np.float16).view(np.uint8)
    blocks = np.concatenate([half, codes[:16] | (codes[16:] << 4)])[None, :].repeat(4, axis=0)
    qw = block_form(blocks, T.Q4_1, 32, 4)
    want = dequantize(blocks, T.Q4_1)
    assert not np.array_equal(qw.dequantize().T, want)
    assert_within_offset_rounding(qw, want)


def test_q8_k_blocks_are_d_times_q():
    rng = np.random.default_rng(4)
    d = (rng.standard_normal(8) * 1e-3).astype(np.float32)  # 2 rows of 4 blocks of 256
    q = rng.integers(-128, 128, (8, 256), dtype=np.int8)
    blocks = np.concatenate([d[:, None].view(np.uint8), q.view(np.uint8), np.zeros((8, 32), np.uint8)], 1)
    qw = block_form(blocks.reshape(2, -1), T.Q8_K, 1024, 2)
    assert (qw.bits, qw.block_size, qw.offset) == (8, 256, None)
    assert_same_bits(qw.dequantize().T, (q.astype(np.float32) * d[:, None]).reshape(2, 1024))


def test_a_file_reads_under_hf_names_with_q_and_k_unpermuted(tmp_path):
    rng = np.random.default_rng(5)
    heads, kv_heads, head_dim, hidden = 4, 2, 8, 64
    q = quantize(rng.standard_normal((heads * head_dim, hidden)).astype(np.float32), T.Q8_0)
    k = quantize(rng.standard_normal((kv_heads * head_dim, hidden)).astype(np.float32), T.Q4_1)
    k_bias = rng.standard_normal(kv_heads * head_dim).astype(np.float32)
    down = raw_blocks(T.Q6_K, hidden, 256)
    norm = rng.standard_normal(hidden).astype(np.float32)
    embed = rng.standard_normal((10, hidden)).astype(np.float16)
    tensors = {
        "token_embd.weight": embed,
        "blk.0.attn_q.weight": (q, T.Q8_0),
        "blk.0.attn_k.weight": (k, T.Q4_1),
        "blk.0.attn_k.bias": k_bias,
        "blk.0.ffn_down.weight": (down, T.Q6_K),
        "blk.0.ffn_norm.weight": norm,
        "rope_freqs.weight": np.ones(head_dim // 2, np.float32),
    }
    for arch, permuted in (("llama", True), ("qwen2", False)):
        write_gguf(tmp_path / f"{arch}.gguf", arch, tensors, heads, kv_heads)
        read = read_gguf_weights(tmp_path / f"{arch}.gguf")
        t = read.tensors
        assert read.architecture == arch and read.types["model.layers.0.self_attn.k_proj.weight"] == "Q4_1"
        assert sorted(t) == [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ]
        undo = (lambda w, n: rotary_permute(w, n)) if permuted else (lambda w, n: w)
        attn = "model.layers.0.self_attn"
        assert_same_bits(undo(as_hf(t[f"{attn}.q_proj.weight"]), heads), dequantize(q, T.Q8_0))
        assert_same_bits(undo(as_hf(t[f"{attn}.k_proj.weight"]), kv_heads), dequantize(k, T.Q4_1))
        assert_same_bits(undo(t["model.layers.0.self_attn.k_proj.bias"], kv_heads), k_bias)
        assert_same_bits(as_hf(t["model.layers.0.mlp.down_proj.weight"]), dequantize(down, T.Q6_K))
        assert_same_bits(t["model.embed_tokens.weight"], embed.astype(np.float32))
        assert_same_bits(t["model.layers.0.post_attention_layernorm.weight"], norm)


def test_gemma3_norms_are_read_as_transformers_reads_them(tmp_path):
    stored = np.linspace(0.5, 2.0, 64, dtype=np.float32)  # llama.cpp writes Gemma's 1 + w
    write_gguf(tmp_path / "g.gguf", "gemma3", {"blk.0.post_ffw_norm.weight": stored})
    got = read_gguf_weights(tmp_path / "g.gguf").tensors["model.layers.0.post_feedforward_layernorm.weight"]
    assert_same_bits(got, stored - np.float32(1.0))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURE_NAMES))
def test_names_are_the_inverse_of_ggufs_own_map(arch):
    """gguf's TensorNameMap (HF -> GGUF, the map llama.cpp's converter and transformers use) sends
    every HF name hf_name gives back to the GGUF name it came from."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    to_gguf = gguf.get_tensor_name_map(model_arch, 4)
    in_arch = {gguf.TENSOR_NAMES[t].format(bid=3) for t in gguf.MODEL_TENSORS[model_arch]}
    layer_names = {**LAYER_NAMES, **ARCHITECTURE_NAMES[arch], **WHOLE_NAMES.get(arch, {})}
    names = [*GLOBAL_NAMES, *ARCHITECTURE_GLOBALS.get(arch, {}), *(f"blk.3.{n}" for n in layer_names)]
    checked = [n for n in names if n in in_arch]
    assert len(checked) >= 10
    for name in checked:
        whole = name.endswith(tuple(WHOLE_NAMES.get(arch, {})))  # ssm_a: the parameter itself
        hf = hf_name(name if whole else f"{name}.weight", arch)
        assert to_gguf.get_name(hf if whole else hf.removesuffix(".weight")) == name, (name, hf)


@pytest.mark.parametrize("kind", (T.IQ4_NL, T.MXFP4, T.TQ2_0), ids=lambda t: t.name)
def test_types_without_a_block_form_are_refused_by_name(tmp_path, kind):
    elements, size = GGML_QUANT_SIZES[kind]
    data = np.zeros((8, 256 // elements * size), np.uint8)
    write_gguf(tmp_path / "x.gguf", "llama", {"blk.2.ffn_up.weight": (data, kind)})
    with pytest.raises(KvedgeError) as err:
        read_gguf_weights(tmp_path / "x.gguf")
    message = str(err.value)
    assert "'blk.2.ffn_up.weight'" in message and f"is {kind.name}," in message
    assert "allowed: ['F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1'" in message


def test_unknown_architectures_and_names_are_refused(tmp_path):
    write_gguf(tmp_path / "a.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(KvedgeError, match=r"architecture 'gpt2' has no tensor name map; allowed: \['gemma3'"):
        read_gguf_weights(tmp_path / "a.gguf")
    with pytest.raises(KvedgeError, match=r"'blk.0.ffn_gate_exps.weight' has no Hugging Face name for"):
        hf_name("blk.0.ffn_gate_exps.weight", "qwen2")


@pytest.fixture(scope="module")
def smol():
    return read_gguf_weights(default_gguf())


def test_default_model_tensors_equal_ggufs_dequantizer(smol):
    """SmolLM2's Q4_1 projections, Q8_0 embedding and F32 norms, all bit for bit."""
    reader = gguf.GGUFReader(default_gguf())
    heads = {"attn_q": 9, "attn_k": 3}  # llama.attention.head_count, head_count_kv
    assert len(smol.tensors) == len(reader.tensors) == 272
    for tensor in reader.tensors:
        got = as_hf(smol.tensors[hf_name(tensor.name, "llama")])
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in heads:
            got = rotary_permute(got, heads[kind])
        assert_same_bits(got, dequantize(tensor.data, tensor.tensor_type))
    assert sorted(set(smol.types.values())) == ["F32", "Q4_1", "Q8_0"]
    assert smol.types["model.embed_tokens.weight"] == "Q8_0"


@pytest.mark.real_model
def test_default_model_tensors_equal_transformers_weights(smol, default_hf):
    """Every weight transformers loads from the GGUF (load_hf), bit for bit; lm_head is tied."""
    model, _ = default_hf
    state = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    assert set(state) - set(smol.tensors) == {"lm_head.weight"} and set(smol.tensors) <= set(state)
    for name, weight in smol.tensors.items():
        assert_same_bits(as_hf(weight), state[name])
