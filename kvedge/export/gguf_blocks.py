"""A GGUF file's quantized tensors as kvedge's own blocks (`quantize.QuantizedWeight`), kept as
they are: no dequantize-then-requantize, so the export adds no second rounding to the GGUF's.

GGUF stores a matrix ne = [K, N] row-major: N rows (output features) of K contiguous input
features, each row cut into blocks along K. That is kvedge's block layout for the transpose of
the Hugging Face Linear weight [N, K]: a QuantizedWeight q [K, N], scale and offset [K/bs, N],
value q * scale + offset. Per GGUF block, with d, dmin, m float16 numbers, u the unsigned codes,
v the signed ones, s and t the K-quants' sub-block scales and minimums (small integers)::

    type   GGUF value per element       kvedge bits, bs  q         scale       offset
    Q8_0   d v        v int8            8, 32            v         d           -
    Q4_0   d (u - 8)  u 0..15           4, 32            u - 8     d           -
    Q4_1   d u + m    u 0..15           4, 32            u - 8     d           m + 8 d
    Q5_0   d (u - 16) u 0..31           8, 32            u - 16    d           -
    Q5_1   d u + m    u 0..31           8, 32            u - 16    d           m + 16 d
    Q2_K   d s u - dmin t, u 0..3       4, 16            u - 2     d s         2 d s - dmin t
    Q3_K   d (s - 32) v, v -4..3        4, 16            v         d (s - 32)  -
    Q4_K   d s u - dmin t, u 0..15      4, 32            u - 8     d s         8 d s - dmin t
    Q5_K   d s u - dmin t, u 0..31      8, 32            u - 16    d s         16 d s - dmin t
    Q6_K   d s v, s int8, v -32..31     8, 16            v         d s         -
    Q8_K   d v, d float32, v int8       8, 256           v         d           -

(K-quants: super-blocks of 256, s and t of 4 bits per 16 (Q2_K), 6 bits per 32 (Q4_K, Q5_K).)
Unsigned codes are centred on their range (u - 2**(b-1)), as kvedge's own grids are, which keeps
|q| small where onnxruntime's kernel rounds activations; the offset carries the minimum (for
Q4_1 and Q4_K, offset + qmin * scale is the GGUF minimum itself and q - qmin its code u). Every
product above is exact in float32 (at most 24 significant bits: an 11-bit float16 times a 6-bit
scale times a 6-bit code; Q8_K's float32 d times v is rounded once, as in llama.cpp), so a form
without an offset dequantizes to gguf's own float32 values bit for bit. A form with
an offset does too where the offset is a float32 number, as it is when its two terms are of like
magnitude (a quantizer's minimum near -2**(b-1) steps); where it is not (a minimum tiny beside
the step, or the reverse), the offset is rounded once, and each value differs from gguf's by at
most 2**-23 (|offset| + |w|). `max_error` is 0: the export adds nothing to the GGUF's own error.

Not mapped, refused naming the tensor: the codebook types (IQ*, whose levels are not evenly
spaced), MXFP4 / NVFP4 (float4 levels), TQ1_0 / TQ2_0 and Q1_0 (ternary and binary models),
Q8_1 (llama.cpp's activation type) and the integer types. F32, F16 and BF16 tensors are returned
as float32 arrays in their Hugging Face shape (norms [H], a float matrix [N, K]).

The export (`kvedge export` from a GGUF file, int8/int4 weights) stores a matrix's blocks as they
are where their bits and block size are the graph's (`kvedge.export.graph.weights.source_blocks`):
Q4_0, Q4_1 and Q4_K in an int4 graph of blocks of 32; Q8_0, Q5_0, Q5_1 and Q5_K in an int8 one
and as the LM head (8 bits unless --head-bits 4). The rest are requantized from transformers'
dequantization, as every weight of a Hugging Face folder is: Q2_K, Q3_K and Q6_K (blocks of 16:
kept only with --block-size 16), Q8_K (blocks of 256), blocks of other bits than the graph's (a
Q4 matrix in an int8 graph, a Q8_0 one in an int4 graph, a Q6_K LM head) and the types above
without a block form.

Names: GGUF tensor names (`blk.3.attn_q.weight`) map to Hugging Face state-dict names
(`model.layers.3.self_attn.q_proj.weight`) per `general.architecture`, as transformers' GGUF
loader maps them. llama.cpp's converter permutes the rows of attn_q and attn_k of "llama" models
(Llama, Mistral, SmolLM2) for its interleaved RoPE; that permutation is undone here on the output
features N (the columns of q, scale and offset), which leaves every block along K whole. Other
architectures (Qwen2, Qwen3, Phi-3, Gemma 3, LFM2, Qwen3.5) are stored unpermuted. Gemma 3's and
Qwen3.5's GGUFs store norms as 1 + w (Qwen3.5's Gated DeltaNet norm excepted); they are returned
as w, as transformers does. The hybrids' depthwise convolution kernels, [C, k] in the file, are
returned as [C, 1, k]; Qwen3.5's A = -exp(A_log) as A_log. llama.cpp's converter reorders the value
heads of every Gated DeltaNet tensor that has them from grouped (by key head) to tiled
(`ValueHeads`); they are put back: output rows by column, and the output projection's input
features a block at a time where a value head is whole blocks (else it is returned as float, to
be requantized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import Q4_K, dequantize

from kvedge.errors import KvedgeError
from kvedge.export.quantize import QuantizedWeight

Blocks = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # q [n, E] int8, scale and offset [n, E/bs]

FLOAT_TYPES = ("F32", "F16", "BF16")

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>, the Llama layout
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ARCHITECTURE_NAMES = {  # general.architecture -> where its layer names differ from LAYER_NAMES
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "lfm2": {
        "attn_norm": "operator_norm",
        "ffn_norm": "ffn_norm",
        "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm",
        "attn_output": "self_attn.out_proj",
        "ffn_gate": "feed_forward.w1",
        "ffn_up": "feed_forward.w3",
        "ffn_down": "feed_forward.w2",
        "shortconv.conv": "conv.conv",
        "shortconv.in_proj": "conv.in_proj",
        "shortconv.out_proj": "conv.out_proj",
    },
    "qwen35": {
        "post_attention_norm": "post_attention_layernorm",
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_conv1d": "linear_attn.conv1d",
        "ssm_norm": "linear_attn.norm",
        "ssm_out": "linear_attn.out_proj",
    },
}
ARCHITECTURE_GLOBALS = {"lfm2": {"token_embd_norm": "model.embedding_norm"}}  # beside GLOBAL_NAMES
WHOLE_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>, parameters not named <module>.weight/.bias
    "qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
}
# where llama.cpp writes norms as 1 + w (transformers reads w): every "...norm.weight" but these
UNIT_OFFSET_NORMS = {"gemma3": (), "qwen35": (".linear_attn.norm.weight",)}
CONV_WEIGHTS = (".conv.conv.weight", ".linear_attn.conv1d.weight")  # [C, k] in GGUF, [C, 1, k] in HF
PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp's LlamaModel permutes attn_q / attn_k rows
DERIVED_TABLES = ("rope_freqs", "rope_factors_long", "rope_factors_short")  # from the config in HF


@dataclass(frozen=True)
class GgufWeights:
    """A GGUF file's tensors under their Hugging Face names."""

    architecture: str  # general.architecture, e.g. "llama"
    tensors: Mapping[str, QuantizedWeight | np.ndarray]  # QuantizedWeight [K, N]; float32 in HF shape
    types: dict[str, str]  # every tensor's name (skipped ones too) -> GGUF type, e.g. "Q4_1"


class GgufFile:
    """A GGUF file's tensors under their Hugging Face names (`entries`), each read from the file
    when asked for and not kept: `blocks` gives kvedge's block form, `floats` the float32 weight
    transformers dequantizes. Plain reads, not the reader's memory map, whose touched pages would
    count as the process's memory. Refuses an architecture or tensor name it cannot map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        reader = GGUFReader(str(path))
        self.architecture = _architecture(reader, path)
        self.heads = int(_field(reader, f"{self.architecture}.attention.head_count"))
        # LFM2's is a list, a count per layer
        self.kv_heads = _field(reader, f"{self.architecture}.attention.head_count_kv", self.heads)
        self.value_heads = _value_heads(reader, self.architecture)
        self.entries: dict[str, ReaderTensor] = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name, self.architecture)
            if name is not None:
                self.entries[name] = tensor
        self.types = {name: tensor.tensor_type.name for name, tensor in self.entries.items()}

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as the reader shapes them (its memory map's dtype and shape)."""
        tensor = self.entries[name]
        data = np.empty(tensor.data.shape, tensor.data.dtype)  # the map's shape: no page is read
        with self.path.open("rb") as handle:
            handle.seek(tensor.data_offset)
            if handle.readinto(memoryview(data.reshape(-1).view(np.uint8))) != data.nbytes:
                raise EOFError(f"{self.path}: tensor {tensor.name!r} runs past the end of the file")
        return data

    def blocks(self, name: str) -> QuantizedWeight | np.ndarray:
        """Tensor `name` in kvedge's block form [K, N] (`tensor_weight`), or float32 in the HF
        shape for a float type, as transformers holds it (`_hf_layout`)."""
        return self._hf_layout(name, tensor_weight(self.entries[name], self.path, self.raw(name)))

    def floats(self, name: str) -> np.ndarray:
        """Tensor `name` as transformers loads it: dequantized by gguf to float32, in the HF
        shape and layout."""
        tensor = self.entries[name]
        values = np.asarray(dequantize(self.raw(name), tensor.tensor_type), np.float32)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        return self._hf_layout(name, values.reshape(shape))

    def _hf_layout(self, name: str, weight: QuantizedWeight | np.ndarray) -> QuantizedWeight | np.ndarray:
        """A tensor read from the file put as transformers holds it: "llama" models' attn_q and
        attn_k unpermuted, float norms, kernels and A_log as in `_float_layout`, Qwen3.5's value
        heads back in order."""
        if self.architecture in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rotary(weight, self.heads)
        elif self.architecture in PERMUTED_ARCHITECTURES and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rotary(weight, int(self.kv_heads))
        if isinstance(weight, np.ndarray):
            weight = _float_layout(name, weight, self.architecture)
        if self.value_heads is not None:
            weight = self.value_heads.untile(name, weight)
        return weight


class GgufBlocks(Mapping[str, "QuantizedWeight | np.ndarray"]):
    """`names` of a `GgufFile`, each read (`GgufFile.blocks`) on access."""

    def __init__(self, file: GgufFile, names: list[str]) -> None:
        self.file, self.names, self._names = file, names, set(names)

    def __getitem__(self, name: str) -> QuantizedWeight | np.ndarray:
        if name not in self:
            raise KeyError(name)
        return self.file.blocks(name)

    def __contains__(self, name: object) -> bool:  # without reading it
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def read_gguf_weights(path: str | Path, skip_unmapped: bool = False) -> GgufWeights:
    """Every tensor of the GGUF file at `path` under its Hugging Face name, each read from the
    file when asked for (`GgufFile`): quantized matrices as QuantizedWeight (the transpose of the
    HF weight), float tensors as float32 arrays, attn_q and attn_k of "llama" models unpermuted.
    Refuses an architecture, tensor name or type it cannot map, naming it and what is allowed;
    with `skip_unmapped`, a tensor of a type without a block form is left out of `tensors` (its
    type stays in `types`) instead."""
    file = GgufFile(path)
    names = []
    for name, tensor in file.entries.items():
        if tensor.tensor_type.name not in FLOAT_TYPES and tensor.tensor_type not in BLOCK_FORMS:
            if skip_unmapped:
                continue
            raise no_block_form(tensor, file.path)
        names.append(name)
    return GgufWeights(file.architecture, GgufBlocks(file, names), file.types)


def _float_layout(name: str, weight: np.ndarray, architecture: str) -> np.ndarray:
    """A float tensor as transformers holds it: norms written as 1 + w back to w, a depthwise
    convolution's [C, k] back to [C, 1, k], Qwen3.5's A = -exp(A_log) back to A_log."""
    kept = UNIT_OFFSET_NORMS.get(architecture)
    if kept is not None and name.endswith("norm.weight") and not name.endswith(kept):
        return weight - np.float32(1.0)
    if name.endswith(CONV_WEIGHTS) and weight.ndim == 2:
        return weight[:, None, :]
    if name.endswith(".linear_attn.A_log"):
        return np.log(-weight)
    return weight


@dataclass(frozen=True)
class ValueHeads:
    """Qwen3.5's Gated DeltaNet heads: llama.cpp's converter reorders the value heads of each
    tensor that has them from transformers' grouped order (by key head: [key heads, values per
    key head, d]) to a tiled one ([values per key head, key heads, d]), so that its kernels
    broadcast; `untile` puts them back. Where there are as many value heads as key heads the
    orders are one."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    def order(self, dim: int) -> np.ndarray:
        """[value_heads * dim]: the GGUF index of each transformers index."""
        per_key = self.value_heads // self.key_heads
        tiled = np.arange(self.value_heads * dim).reshape(per_key, self.key_heads, dim)
        return tiled.transpose(1, 0, 2).reshape(-1)

    def untile(self, name: str, weight: QuantizedWeight | np.ndarray) -> QuantizedWeight | np.ndarray:
        """`weight` (HF name `name`) with its value heads in transformers' order."""
        if ".linear_attn." not in name or self.value_heads == self.key_heads:
            return weight
        kind = name.rsplit(".linear_attn.", 1)[1]
        if kind in ("in_proj_qkv.weight", "conv1d.weight"):  # rows: q, k [key heads, key_dim], then v
            qk = 2 * self.key_heads * self.key_dim
            return _take_rows(weight, np.concatenate([np.arange(qk), qk + self.order(self.value_dim)]))
        if kind == "in_proj_z.weight":
            return _take_rows(weight, self.order(self.value_dim))
        if kind in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
            return _take_rows(weight, self.order(1))
        if kind == "out_proj.weight":  # its inputs are the value heads
            order = self.order(self.value_dim)
            if isinstance(weight, np.ndarray):
                return np.ascontiguousarray(weight[:, order])
            if self.value_dim % weight.block_size == 0:
                return weight.block_rows(order[:: weight.block_size] // weight.block_size)
            return np.ascontiguousarray(weight.dequantize().T[:, order])  # heads cut blocks: requantized
        return weight


def _take_rows(weight: QuantizedWeight | np.ndarray, order: np.ndarray) -> QuantizedWeight | np.ndarray:
    """Output features `order` of `weight` (an HF-shaped array's rows; a QuantizedWeight's columns)."""
    if isinstance(weight, np.ndarray):
        return np.ascontiguousarray(weight[order])
    return weight.columns(order)


def _value_heads(reader: GGUFReader, architecture: str) -> ValueHeads | None:
    """Qwen3.5's Gated DeltaNet head counts and sizes (llama.cpp's ssm.* keys), None for others."""
    if architecture != "qwen35":
        return None
    value_heads = int(_field(reader, "qwen35.ssm.time_step_rank"))
    return ValueHeads(
        key_heads=int(_field(reader, "qwen35.ssm.group_count")),
        value_heads=value_heads,
        key_dim=int(_field(reader, "qwen35.ssm.state_size")),
        value_dim=int(_field(reader, "qwen35.ssm.inner_size")) // value_heads,
    )


def _architecture(reader: GGUFReader, path: str | Path) -> str:
    architecture = str(_field(reader, "general.architecture"))
    if architecture not in ARCHITECTURE_NAMES:
        raise KvedgeError(
            f"{path}: GGUF architecture {architecture!r} has no tensor name map; "
            f"allowed: {sorted(ARCHITECTURE_NAMES)}"
        )
    return architecture


def _field(reader: GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    if field is not None:
        return field.contents()
    if default is None:
        raise KvedgeError(f"GGUF file has no {key!r} entry")
    return default


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """The Hugging Face state-dict name of a GGUF tensor, or None for the tables transformers
    derives from the config (rope_freqs, ...). Refuses a name it does not know."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in DERIVED_TABLES:
        return None
    global_names = {**GLOBAL_NAMES, **ARCHITECTURE_GLOBALS.get(architecture, {})}
    if base in global_names and suffix in ("weight", "bias"):
        return f"{global_names[base]}.{suffix}"
    layer_names = {**LAYER_NAMES, **ARCHITECTURE_NAMES[architecture]}
    whole = WHOLE_NAMES.get(architecture, {})
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, rest = parts[1], parts[2]
        if rest in whole:
            return f"model.layers.{layer}.{whole[rest]}"
        module, _, suffix = rest.rpartition(".")
        if module in layer_names and suffix in ("weight", "bias"):
            return f"model.layers.{layer}.{layer_names[module]}.{suffix}"
    known = ", ".join(sorted([*layer_names, *whole]))
    raise KvedgeError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face name for architecture {architecture!r}; "
        f"known: {sorted(global_names)} and blk.N.{{{known}}} (.weight/.bias)"
    )


def tensor_weight(
    tensor: ReaderTensor, path: str | Path, data: np.ndarray | None = None
) -> QuantizedWeight | np.ndarray:
    """One GGUF tensor (its bytes `data`, else the reader's map): a QuantizedWeight [K, N] (K =
    ne[0], the contiguous input features) for a quantized type, a float32 array in the Hugging
    Face shape (ne reversed) for F32/F16/BF16."""
    data = tensor.data if data is None else data
    if tensor.tensor_type.name in FLOAT_TYPES:
        return np.array(dequantize(data, tensor.tensor_type), np.float32)
    if tensor.tensor_type not in BLOCK_FORMS:
        raise no_block_form(tensor, path)
    k = int(tensor.shape[0])
    n = int(np.prod(tensor.shape[1:], dtype=np.int64))
    return block_form(np.asarray(data), tensor.tensor_type, k, n)


def no_block_form(tensor: ReaderTensor, path: str | Path) -> KvedgeError:
    allowed = [*FLOAT_TYPES, *(t.name for t in BLOCK_FORMS)]
    return KvedgeError(
        f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, which has no kvedge block form "
        f"(it would have to be requantized); allowed: {allowed}"
    )


def block_form(data: np.ndarray, kind: GGMLQuantizationType, k: int, n: int) -> QuantizedWeight:
    """A GGUF tensor's raw bytes (N rows of K values, blocks along K; any shape) as kvedge's block
    form [K, N] (the module docstring's table)."""
    bits, block_size, decode = BLOCK_FORMS[kind]
    type_bytes = GGML_QUANT_SIZES[kind][1]
    q, scale, offset = decode(np.ascontiguousarray(data).reshape(-1, type_bytes))

    def columns(a: np.ndarray, rows: int) -> np.ndarray:  # GGUF's [N, rows] order -> [rows, N]
        return np.ascontiguousarray(a.reshape(n, rows).T)

    return QuantizedWeight(
        columns(q, k),
        columns(scale, k // block_size),
        None if offset is None else columns(offset, k // block_size),
        bits,
        block_size,
        0.0,
    )


def unpermute_rotary(weight: QuantizedWeight | np.ndarray, heads: int) -> QuantizedWeight | np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` of attn_q / attn_k: output features (HF
    rows; QuantizedWeight columns) [heads, 2, d/2] in GGUF order back to HF's [heads, d/2, 2]
    pairs, as transformers' `_reverse_permute_weights` does."""
    n = weight.q.shape[1] if isinstance(weight, QuantizedWeight) else weight.shape[0]
    order = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)  # HF row -> GGUF
    if isinstance(weight, np.ndarray):
        return np.ascontiguousarray(weight[order])
    return weight.columns(order)


# Decoders: raw blocks [n, type bytes] uint8 -> (q [n, E] int8, scale [n, E/bs], offset or None)
# in GGUF's element order; the unpacking follows gguf.quants' reference dequantizers.


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16).astype(np.float32)


def _codes(packed: np.ndarray, runs: int, bits: int) -> np.ndarray:
    """Codes of `bits` bits [n, 8 / bits x len] from bytes [n, len] cut into `runs` runs: within
    a run, every byte's lowest `bits` bits first, then the next `bits` of every byte, and so on."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    fields = packed.reshape(len(packed), runs, 1, -1) >> shifts
    return (fields & np.uint8(2**bits - 1)).reshape(len(packed), -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: bit j of the little-endian 32-bit qh [n, 4], as [n, 32] 0/1."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _centred(u: np.ndarray, code_bits: int) -> np.ndarray:
    return (u.astype(np.int16) - 2 ** (code_bits - 1)).astype(np.int8)


def _q8_0(b: np.ndarray) -> Blocks:
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _half(b, 0), None


def _q4_0(b: np.ndarray) -> Blocks:
    return _centred(_codes(b[:, 2:18], 1, 4), 4), _half(b, 0), None


def _q4_1(b: np.ndarray) -> Blocks:
    d, m = _half(b, 0), _half(b, 2)
    return _centred(_codes(b[:, 4:20], 1, 4), 4), d, m + 8 * d


def _q5_0(b: np.ndarray) -> Blocks:
    u = _codes(b[:, 6:22], 1, 4) | (_high_bits(b[:, 2:6]) << 4)
    return _centred(u, 5), _half(b, 0), None


def _q5_1(b: np.ndarray) -> Blocks:
    d, m = _half(b, 0), _half(b, 2)
    u = _codes(b[:, 8:24], 1, 4) | (_high_bits(b[:, 4:8]) << 4)
    return _centred(u, 5), d, m + 16 * d


def _q2_k(b: np.ndarray) -> Blocks:
    sub = b[:, 0:16]  # per 16 values: scale (low nibble), minimum (high nibble)
    scale = _half(b, 80) * (sub & 0x0F).astype(np.float32)
    minimum = _half(b, 82) * (sub >> 4).astype(np.float32)
    return _centred(_codes(b[:, 16:80], 2, 2), 2), scale, 2 * scale - minimum


def _q3_k(b: np.ndarray) -> Blocks:
    sub = _codes(b[:, 96:104], 1, 4) | (_codes(b[:, 104:108], 1, 2) << 4)  # [n, 16] 6-bit
    scale = _half(b, 108) * (sub.astype(np.float32) - 32)
    missing = 1 - _codes(b[:, 0:32], 1, 1).astype(np.int16)  # 4 is subtracted where the bit is 0
    v = _codes(b[:, 32:96], 2, 2).astype(np.int16) - 4 * missing  # [n, 256] in -4..3
    return v.astype(np.int8), scale, None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (d s, dmin t), each [n, 8] float32, one per 32 values."""
    s, t = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _half(b, 0) * s.astype(np.float32), _half(b, 2) * t.astype(np.float32)


def _q4_k(b: np.ndarray) -> Blocks:
    scale, minimum = _k_scales(b)
    return _centred(_codes(b[:, 16:144], 4, 4), 4), scale, 8 * scale - minimum


def _q5_k(b: np.ndarray) -> Blocks:
    scale, minimum = _k_scales(b)
    u = _codes(b[:, 48:176], 4, 4) | (_codes(b[:, 16:48], 1, 1) << 4)
    return _centred(u, 5), scale, 16 * scale - minimum


def _q6_k(b: np.ndarray) -> Blocks:
    u = _codes(b[:, 0:128], 2, 4) | (_codes(b[:, 128:192], 2, 2) << 4)  # [n, 256] 6-bit
    s = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    return _centred(u, 6), _half(b, 208) * s, None


def _q8_k(b: np.ndarray) -> Blocks:
    d = np.ascontiguousarray(b[:, 0:4]).view(np.float32)
    return np.ascontiguousarray(b[:, 4:260]).view(np.int8), d, None


# GGML type -> (kvedge bits, block size, decoder): the module docstring's table
BLOCK_FORMS: dict[GGMLQuantizationType, tuple[int, int, Callable[[np.ndarray], Blocks]]] = {
    GGMLQuantizationType.Q8_0: (8, 32, _q8_0),
    GGMLQuantizationType.Q4_0: (4, 32, _q4_0),
    GGMLQuantizationType.Q4_1: (4, 32, _q4_1),
    GGMLQuantizationType.Q5_0: (8, 32, _q5_0),
    GGMLQuantizationType.Q5_1: (8, 32, _q5_1),
    GGMLQuantizationType.Q2_K: (4, 16, _q2_k),
    GGMLQuantizationType.Q3_K: (4, 16, _q3_k),
    GGMLQuantizationType.Q4_K: (4, 32, _q4_k),
    GGMLQuantizationType.Q5_K: (8, 32, _q5_k),
    GGMLQuantizationType.Q6_K: (8, 16, _q6_k),
    GGMLQuantizationType.Q8_K: (8, 256, _q8_k),
}
