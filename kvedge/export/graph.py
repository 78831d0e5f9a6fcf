"""Build the KV-bound decoder graph in ONNX, op by op, from a Hugging Face state dict.

Why build by hand instead of tracing with `torch.onnx.export`: the op list is ours to choose
(only ops TensorRT's ONNX parser accepts, in the portable variant), tied embeddings are stored
once, and the KV binding below is exact rather than whatever a tracer makes of a cache class.

The contract (declared from `kvedge.contract.GraphInterface`, names from `IONames`)::

    inputs  input_ids      [b, s]                     int64
            position_ids   [b, s]                     int64  (portable only: index into the RoPE tables)
            past_lengths   [b]                        int64  (valid slots of each row's cache)
            last_index     [b] ("last"), [b, r] ("rows") int64  (not when logits="all")
            past K/V per layer [b, kv_heads, L, d]    L = max_len, fixed
    outputs logits         [b, 1 | r | s, vocab] ("last" | "rows" | "all")
            present K/V per layer                     portable: [b, kv_heads, s, d], the new tokens
                                                      only, K after RoPE; ort: [b, kv_heads, L, d],
                                                      the past buffer itself, written in place

Two variants share everything but attention:

`portable` (ONNX opset 17; 21 with quantized weights): standard ops only, for TensorRT and any
runtime. Per layer, with g = heads / kv_heads query heads sharing each KV head and
A = max(past_lengths) the longest valid past in the batch::

    past_k, past_v = past[..., :A, :]                               (Slice: the valid part only)
    q4       = rope(q) * d**-0.5 reshaped to [b, kv_heads, g*s, d]   (scale folded into Wq)
    scores   = concat(q4 @ past_k^T, q4 @ new_k^T) + mask            [b, kv_heads, g*s, A+s]
    probs    = softmax(scores)
    out      = probs[..., :A] @ past_v + probs[..., A:] @ new_v

GQA is a reshape of Q, never a repeat of K/V. The mask is computed once per call from
`past_lengths` (slot j of row b is visible iff j < past_lengths[b]) plus a causal mask over the
new tokens; stale data beyond a row's valid length is masked with -inf, so the runtime must keep
buffers finite (they are zero-initialised and only ever written with finite K/V). Slicing to A
makes the work follow the valid length, not max_len; the price is a copy of the valid K/V.

`ort` (opset 17 + com.microsoft; 21 with quantized weights): onnxruntime's GroupQueryAttention
with packed QKV, rotary applied inside the op from the same cos/sin tables, and the past buffer
bound as both input and output (`past_present_share_buffer`), so the new K/V are written into
the cache in place and attention reads only the valid slots::

    seqlens_k              = past_lengths + s - 1                    [b] int32
    total_sequence_length  = max(past_lengths) + s                   scalar int32

GroupQueryAttention takes positions from `seqlens_k` (position of new token i = past length + i,
the same rule as the portable graph), so `position_ids` is not a graph input there. It accepts
s > 1 with a non-empty past only for batch 1; the runtime splits such calls by row.

`ort` with a float16 cache (`--kv-dtype float16`, the form onnxruntime's CUDA provider runs: its
GroupQueryAttention kernels take float16/bfloat16 only): the packed QKV is cast to float16 before
the op and its output back to float32, the cache and the RoPE tables are float16, the rest of the
graph is unchanged. The cache holds half the float32 cache's bytes; the only error is fp16
rounding of Q, K, V and the tables. Its seqlens_k and total_sequence_length are made so that the
decode step can be captured as a CUDA graph (`_GroupQueryAttention`)::

    seqlens_k              = past_lengths + rowlength(input_ids) - 1     [b] int32, on the device
    total_sequence_length  = max_len                                     constant int32

`ort` with the INT8 cache (`--kv-dtype int8`): GroupQueryAttention's own 8-bit cache has static
scales only, so attention is kvedge's onnxruntime kernel `kvedge.Int8CacheAttention`
(`kvedge/runtime/csrc/kvedge_ops.cc`, loaded by the runtime): the same inputs as above plus the
K/V scale buffers, in place; it quantizes the new tokens per token exactly as the portable INT8
graph does and reads each KV head's int8 codes once per step for its whole query group.

Weights: float32, or blocked int8/int4 `DequantizeLinear -> MatMul` (see `quantize.py`) for every
projection and the LM head, their block offsets and kept float32 channels in a second small
product whose inputs `ort` graphs make with kvedge's op `kvedge.SideInputs` (not over a float16
cache, the CUDA form: `kvedge.contract.kvedge_ops`); the embedding table stays float32 (one row is
read per token).
float16 (`--weights float16`): the projections and the embedding table (the tied LM head) are
stored float16, about half the bytes, each widened by one `Cast` to float32, so arithmetic stays
float32 and the only error is fp16 rounding of the weights (relative 2**-11). onnxruntime and
TensorRT fold the Cast when they load the graph; what the memory then holds is theirs to choose.

The float16 graph (`--precision float16`, portable only; `GraphOptions.half`): what TensorRT's
strongly typed builder computes in float16, written as such. Weights (float16, or int8/int4
blocks dequantized to float16: the float32 graph's codes, their scales, offsets and kept channels'
rows stored float16), the residual stream, the projections, RoPE and
the MLP are float16; float32 islands, each opened and closed by a Cast (`_Builder.widen`,
`narrow`), are where float16 would fail: every RMSNorm (x**2 and its mean: activations of a few
hundred square past float16's 65504; normed and weighted in float32, as transformers does),
softmax (scores widened, the -inf mask added and the probabilities narrowed after), and the
logits (the LM head computes in float16, its output widened: the graph's logits are float32 in
both precisions). The cache is float16 (attention over it in float16 but for the softmax) or
int8: then attention runs in float32 exactly as in a float32 graph, its packed QKV widened and
its output narrowed, since a query times int8 codes before scaling can pass 65504. The graph's
inputs and outputs are those of `GraphInterface` for the export's cache dtype.

Families differ before attention only (`DecoderSpec`, `_prepare_weights`), so the three attention
implementations above serve them all: Qwen3's per-head Q/K RMSNorm is applied to the packed QKV,
ahead of every variant's RoPE; Phi-3's fused projections are split and its partial rotary becomes
full rotary over a permuted head (`rotary_frequencies`); SmolLM3's layers without RoPE skip the
rotation (portable), run GroupQueryAttention with do_rotary=0, or give the INT8 kernel tables of
angle 0. Gemma 3's (1 + w) norms are folded into the weights, its extra norms and GELU-tanh are
ops around attention; its sliding-window layers are where attention differs: the portable graph
reads them from ring-buffer caches of window + margin slots through a mask derived from the valid
length (`_PortableAttention._ring`, docs/ARCHITECTURE.md "Ring-buffer layers"), the ort graph
keeps them full length with GroupQueryAttention's local_window_size, or over the INT8 cache the
kernel's attribute of the same name and meaning; all with their own RoPE tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvedge.contract import (
    DECODE_MATMULS,
    EXPORTED_KV_DTYPES,
    INT8_ATTENTION_OP,
    KVEDGE_OPS_DOMAIN,
    LOGITS_MODES,
    PRECISIONS,
    QUANT_MATMUL_OP,
    SIDE_INPUTS_OP,
    VARIANTS,
    CacheGeometry,
    GraphInterface,
    IONames,
    TensorSpec,
    export_kv_dtypes,
    export_weight_formats,
    kvedge_ops,
)
from kvedge.errors import KvedgeError
from kvedge.export.quantize import (
    EXPORT_GRIDS,
    HEAD_BITS,
    HEAD_MIN_BITS,
    OUTLIER_CHANNELS,
    OUTLIER_CHOICES,
    WEIGHT_FORMATS,
    QuantizedWeight,
    check_format,
    pack_quant_matmul,
    quantize_blockwise,
    weight_tensor,
)

OPSET = 17  # float32 and float16 weights
# caches attention reads and writes in float16: GroupQueryAttention's (`ort`), or a float16
# graph's (`--precision float16`, portable)
HALF_KV_DTYPES = ("float16",)
QUANTIZED_OPSET = 21  # blocked DequantizeLinear (block_size) needs opset 21
MS_DOMAIN = "com.microsoft"
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")  # longrope: short factors only
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # act(gate(x)) * up(x); Gemma 3 uses the tanh GELU


@dataclass(frozen=True)
class DecoderSpec:
    """The numbers the graph needs from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    head_dim: int
    rotary_dim: int  # leading channels of each head that RoPE rotates (Phi-4-mini: 0.75 head_dim)
    qk_norm: bool  # RMSNorm over each head of Q and K before RoPE (Qwen3, Gemma 3)
    unrotated_layers: tuple[int, ...]  # layers without RoPE (SmolLM3's NoPE layers)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma 3)
    query_scale: float = 0.0  # softmax scale; 0 means head_dim**-0.5 (Gemma 3: query_pre_attn_scalar**-0.5)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma 3: sqrt(hidden_size), float32)
    # Gemma 3: every RMSNorm weighs by (1 + w), and each sublayer's output is normed again before
    # the residual add (post_attention_layernorm / post_feedforward_layernorm; the MLP's input
    # norm is pre_feedforward_layernorm)
    gemma_norms: bool = False
    local_layers: tuple[int, ...] = ()  # sliding-window layers (Gemma 3's "sliding_attention")
    window: int = 0  # keys a sliding-window layer's query sees, itself included

    @classmethod
    def from_config(cls, config: Any) -> DecoderSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        gemma = config.model_type == "gemma3_text"
        rope = (getattr(config, "rope_parameters", None) or {}) if not gemma else {}
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in GATED_ACTIVATIONS:
            raise KvedgeError(
                f"hidden_act {act!r} is not supported; the MLP is gated with one of {list(GATED_ACTIVATIONS)}"
            )
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise KvedgeError(
                    f"{name}={getattr(config, name)!r} is not supported (Gemma 2 style softcapping)"
                )
        if getattr(config, "use_bidirectional_attention", False):
            raise KvedgeError("use_bidirectional_attention=True is not supported: the graph is causal")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            qk_norm=config.model_type in ("qwen3", "gemma3_text"),
            # SmolLM3: no_rope_layers[i] is 1 where layer i uses RoPE
            unrotated_layers=tuple(
                i for i, rope in enumerate(getattr(config, "no_rope_layers", None) or []) if not rope
            ),
            activation=act,
            query_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else 0.0,
            # HF: torch.tensor(hidden_size**0.5), float32, times the float32 embedding
            embed_scale=float(np.float32(config.hidden_size**0.5)) if gemma else 1.0,
            gemma_norms=gemma,
            local_layers=local_layers(config),
            window=int(config.sliding_window) if local_layers(config) else 0,
        )

    @property
    def softmax_scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class GraphOptions:
    """How to build the graph; invalid values fail here, naming the allowed ones."""

    logits: str = "rows"  # contract.LOGITS_MODES
    variant: str = "portable"  # see VARIANTS
    weights: str = "float32"  # see quantize.WEIGHT_FORMATS
    block_size: int = 32  # quantization block along the input features
    outlier_channels: int | None = None  # --outlier-channels; None: see kept_channels
    lm_head_bits: int | None = None  # --head-bits; None: see head_bits
    decode_matmuls: str | None = None  # --decode-matmuls (contract.DECODE_MATMULS); None: see decode
    precision: str = "float32"  # --precision (contract.PRECISIONS): the dtype the graph computes in

    def __post_init__(self) -> None:
        if self.logits not in LOGITS_MODES:
            raise KvedgeError(f"--logits {self.logits!r} is not allowed; allowed: {list(LOGITS_MODES)}")
        if self.variant not in VARIANTS:
            raise KvedgeError(f"--variant {self.variant!r} is not supported; allowed: {sorted(VARIANTS)}")
        check_format(self.weights, self.block_size)
        self._check_precision()
        for flag, value in (
            ("--outlier-channels", self.outlier_channels),
            ("--head-bits", self.lm_head_bits),
        ):
            if value is not None and not self.quantized:
                raise KvedgeError(
                    f"{flag} {value!r} applies to --weights int8 or int4 only, not --weights {self.weights}"
                )
        if self.decode_matmuls is not None and not (self.quantized and self.variant == "ort"):
            raise KvedgeError(
                f"--decode-matmuls {self.decode_matmuls!r} applies to --variant ort --weights int8 or "
                f"int4 only, not --variant {self.variant} --weights {self.weights}"
            )
        if self.decode_matmuls is not None and self.decode_matmuls not in DECODE_MATMULS:
            raise KvedgeError(
                f"--decode-matmuls {self.decode_matmuls!r} is not allowed; allowed: {list(DECODE_MATMULS)}"
            )
        if self.outlier_channels is not None and self.outlier_channels not in OUTLIER_CHOICES:
            raise KvedgeError(
                f"--outlier-channels {self.outlier_channels!r} is not allowed; "
                f"allowed: {list(OUTLIER_CHOICES)}"
            )
        if self.lm_head_bits is not None:
            allowed = list(HEAD_BITS) if self.variant == "ort" else [self.bits]
            if self.lm_head_bits not in allowed:
                raise KvedgeError(
                    f"--head-bits {self.lm_head_bits!r} is not allowed with --variant {self.variant} "
                    f"--weights {self.weights}; allowed: {allowed}"
                    + ("" if self.variant == "ort" else " (TensorRT takes the projections' bits)")
                )

    def _check_precision(self) -> None:
        if self.precision not in PRECISIONS:
            raise KvedgeError(f"--precision {self.precision!r} is not allowed; allowed: {list(PRECISIONS)}")
        if self.half and self.variant != "portable":
            raise KvedgeError(
                f"--precision float16 is built for --variant portable only (the graph TensorRT "
                f"builds strongly typed); --variant {self.variant} computes in float32 (its float16 "
                "form for onnxruntime's CUDA provider is --kv-dtype float16); allowed with "
                f"--variant {self.variant}: --precision float32"
            )
        allowed = export_weight_formats(self.precision)
        if self.weights not in allowed:
            raise KvedgeError(
                f"--weights {self.weights} is not allowed with --precision {self.precision}: a float16 "
                f"graph computes with float16 weights, float32 storage would only be cast down; "
                f"allowed: {list(allowed)}"
            )

    @property
    def half(self) -> bool:
        """The graph computes in float16 (`--precision float16`, `_Builder`'s float type)."""
        return self.precision == "float16"

    @property
    def opset(self) -> int:
        return QUANTIZED_OPSET if self.quantized else OPSET

    @property
    def bits(self) -> int:
        return WEIGHT_FORMATS[self.weights]

    @property
    def head_bits(self) -> int:
        """The LM head's bits: --head-bits, else in ort graphs never below `HEAD_MIN_BITS`
        (`quantize.py`); portable graphs keep the export's bits (their int8 head was refused by
        TensorRT until their scales were kept positive; an 8-bit head there is not yet measured)."""
        if self.lm_head_bits is not None:
            return self.lm_head_bits
        return max(self.bits, HEAD_MIN_BITS) if self.variant == "ort" else self.bits

    @property
    def decode(self) -> str:
        """What a decode step's quantized matmuls run (`DECODE_MATMULS`): --decode-matmuls, else
        kvedge's op in ort int8/int4 graphs; "" for graphs it does not apply to."""
        if not (self.quantized and self.variant == "ort"):
            return ""
        return self.decode_matmuls or "kvedge"

    @property
    def kept_channels(self) -> int:
        """Input channels of each quantized matmul kept float32 (`quantize.py`): --outlier-channels,
        else `OUTLIER_CHANNELS`; 0 for float weights."""
        if not self.quantized:
            return 0
        return OUTLIER_CHANNELS if self.outlier_channels is None else self.outlier_channels

    @property
    def quantized(self) -> bool:
        """Blocked integer weights (int8, int4), as opposed to float storage."""
        return self.bits < 16


def check_kv_dtype(kv_dtype: str, variant: str = "portable", precision: str = "float32") -> None:
    """Refuse a cache dtype the `variant` graph computing in `precision` cannot be built with,
    naming the allowed ones (`contract.export_kv_dtypes`)."""
    allowed = list(export_kv_dtypes(variant, precision))
    if kv_dtype in allowed:
        return
    if kv_dtype not in EXPORTED_KV_DTYPES:
        raise KvedgeError(
            f"--kv-dtype {kv_dtype!r} is not allowed with --variant {variant}; allowed: {allowed}"
        )
    if precision == "float16":
        raise KvedgeError(
            f"--kv-dtype {kv_dtype} is not allowed with --precision float16: the cache of a float16 "
            f"graph holds float16 values (or int8 codes); allowed: {allowed}"
        )
    raise KvedgeError(
        f"--kv-dtype {kv_dtype} with float32 compute is built for --variant ort only (the onnxruntime "
        f"CUDA in-place form; --precision float16 makes a portable float16 graph over a float16 "
        f"cache); with --variant {variant}, allowed: {allowed}"
    )


def local_layers(config: Any) -> tuple[int, ...]:
    """Gemma 3's sliding-window layers ("sliding_attention" in `layer_types`); () for other families,
    whose sliding window (Mistral) is refused past its width instead (`geometry_from_config`)."""
    if config.model_type != "gemma3_text":
        return ()
    kinds = list(config.layer_types)
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown:
        raise KvedgeError(
            f"layer types {unknown} are not supported; allowed: sliding_attention, full_attention"
        )
    return tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")


def check_ring(geometry: CacheGeometry, variant: str) -> None:
    """Ring-buffer layers are built for the portable graph only: GroupQueryAttention (and kvedge's
    INT8 kernel) write K/V at the valid length, not at a position modulo the ring."""
    if geometry.ring_layers and variant != "portable":
        raise KvedgeError(
            f"--variant {variant!r} does not support sliding-window ring layers (Gemma 3): its "
            "attention writes the cache in place at the valid length, with no ring; use --variant portable"
        )


def rotary_frequencies(inv_freq: np.ndarray, head_dim: int) -> np.ndarray:
    """The model's frequencies [rotary_dim/2] widened to [head_dim/2] with zeros.

    Partial rotary (HF rotates channel pairs (i, i + r/2) of the first r = rotary_dim channels and
    passes the rest through) is exported as full rotary over a permuted head: `_prepare_weights`
    reorders Q and K channels so pair i of the rotated part becomes (i, i + d/2), and the pairs past
    r/2 are the pass-through channels with frequency 0 (angle 0 at every position). Q.K is unchanged
    by a permutation applied to both, so every consumer of the tables (the portable graph,
    GroupQueryAttention, the INT8 kernel, window re-rotation from `manifest.rope.inv_freq`) sees
    ordinary rotate_half RoPE over the whole head and stays exact.
    """
    freqs = np.zeros(head_dim // 2, np.float64)
    freqs[: inv_freq.size] = inv_freq
    return freqs


def rope_tables(
    inv_freq: np.ndarray, attention_scaling: float, max_len: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_len, head_dim/2] for positions 0..max_len-1 (HF rotate_half layout).

    `inv_freq` [rotary_dim/2] are the model's frequencies; pass-through pairs beyond them (partial
    rotary, see `rotary_frequencies`) get cos 1 and sin 0: HF applies `attention_scaling` to the
    rotated channels only."""
    freqs = np.outer(np.arange(max_len, dtype=np.float64), inv_freq.astype(np.float64))
    cos = (np.cos(freqs) * attention_scaling).astype(np.float32)
    sin = (np.sin(freqs) * attention_scaling).astype(np.float32)
    passed = head_dim // 2 - inv_freq.size
    if passed:
        cos = np.concatenate([cos, np.ones((max_len, passed), np.float32)], axis=1)
        sin = np.concatenate([sin, np.zeros((max_len, passed), np.float32)], axis=1)
    return cos, sin


class _Builder:
    """Appends nodes and initializers; every op returns the name of its (first) output."""

    def __init__(
        self,
        opset: int,
        side_inputs: bool = False,
        decode_form: bool = False,
        half: bool = False,
        positive_scales: bool = False,
    ) -> None:
        self.opset = opset
        self.side_inputs = side_inputs  # quantized matmuls take their side inputs from kvedge.SideInputs
        # the decode form: quantized matmuls are kvedge.QuantMatMul, quantized onto the float16 scales
        # and minimums it stores (the prefill form keeps float32 ones: exact on a GGUF's grids)
        self.decode_form = decode_form
        # a float16 graph (--precision float16): weights, their scales and the activations between
        # the float32 islands (`widen` ... `narrow`) are float16
        self.half = half
        # weight scales > 0 only (`quantize_blockwise`): portable graphs, which TensorRT reads
        self.positive_scales = positive_scales
        self.float = np.dtype(np.float16 if half else np.float32)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.quant_errors: list[float] = []  # max |w - w_hat| of each quantized weight
        self._count = 0
        self._shared: set[str] = set()

    def op(
        self,
        op_type: str,
        inputs: list[str],
        name: str,
        outputs: int | list[str] = 1,
        **attrs: Any,
    ):
        """Add a node; `outputs` is a count (names derived from `name`) or the output names."""
        self._count += 1
        if isinstance(outputs, list):
            outs = outputs
        else:
            outs = [f"{name}" if outputs == 1 else f"{name}_{i}" for i in range(outputs)]
        node = helper.make_node(op_type, inputs, outs, name=f"{name}/{op_type}_{self._count}", **attrs)
        self.nodes.append(node)
        return outs[0] if len(outs) == 1 else outs

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def ints(self, *values: int) -> str:
        """A shared int64 vector constant, e.g. ints(0) -> [0]."""
        name = "const.i64_" + "_".join(str(v) for v in values)
        if name not in self._shared:
            self._shared.add(self.const(name, np.array(values, np.int64)))
        return name

    def reduce(self, op_type: str, x: str, axis: int, name: str, keepdims: int = 1) -> str:
        """ReduceMean/ReduceMax over one axis: axes are an attribute before opset 18, an input after."""
        if self.opset < 18:
            return self.op(op_type, [x], name, axes=[axis], keepdims=keepdims)
        return self.op(op_type, [x, self.ints(axis)], name, keepdims=keepdims)

    def fconst(self, name: str, array: np.ndarray) -> str:
        """A float constant in the graph's float type (float16 or float32)."""
        return self.const(name, np.asarray(array).astype(self.float))

    def widen(self, x: str, name: str) -> str:
        """x as float32 under `name`: where a float32 island starts (x itself in a float32 graph)."""
        return self.op("Cast", [x], name, to=TensorProto.FLOAT) if self.half else x

    def narrow(self, x: str, name: str) -> str:
        """x (float32) back in the graph's float type under `name`: where an island ends (x itself
        in a float32 graph)."""
        return self.op("Cast", [x], name, to=TensorProto.FLOAT16) if self.half else x

    def float_weight(self, name: str, w: np.ndarray, stored_half: bool = False) -> str:
        """`w` as a float weight under `name`: float16 in a float16 graph; float32 in a float32
        graph, or with `stored_half` (--weights float16) stored float16 under `name`.f16 and
        widened by one Cast."""
        if self.half:
            return self.const(name, w.astype(np.float16))
        if not stored_half:
            return self.const(name, w.astype(np.float32))
        stored = self.const(f"{name}.f16", w.astype(np.float16))
        return self.op("Cast", [stored], name, to=TensorProto.FLOAT)

    def matmul_weight(
        self, x: str, w: np.ndarray, out: str, bits: int, block_size: int, keep: np.ndarray | None = None
    ) -> str:
        """x @ w for w [K, N], stored float32 or as blocked integers behind DequantizeLinear; the
        blocks' offsets and the float32 input channels `keep` [kept] ride in one small second
        product (see `quantize.py`), whose input [x's block sums | x[keep]] and the masked x are
        made by kvedge.SideInputs in one pass over x, or by standard ops (`side_inputs` unset)."""
        if bits == 32:
            return self.op("MatMul", [x, self.const(f"{out}.weight", w)], out)
        # a float16 graph keeps the float32 graph's codes, its scales and offsets rounded to float16
        # when stored (`fconst`), relative 2**-11 like any float16 weight; the decode form chooses
        # its codes on the float16 grid it stores
        qw = quantize_blockwise(
            w,
            bits,
            block_size,
            EXPORT_GRIDS,
            half_params=self.decode_form,
            positive_scales=self.positive_scales,
        )
        self.quant_errors.append(qw.max_error)
        keep = np.zeros(0, np.int64) if keep is None else keep.astype(np.int64)  # [kept]
        if self.decode_form and w.shape[1] % 64 == 0:
            return self._quant_matmul(x, w, qw, out, keep)
        self.initializers.append(weight_tensor(f"{out}.weight_q", qw))
        scale = self.fconst(f"{out}.weight_scale", qw.scale)  # its type is DequantizeLinear's output's
        deq = self.op(
            "DequantizeLinear", [f"{out}.weight_q", scale], f"{out}.weight", axis=0, block_size=block_size
        )
        rows: list[np.ndarray] = []  # [*, N] the second product's weights
        offsets = np.zeros_like(w, np.float32)  # [K, N] each row's block offset
        if qw.offset is not None:
            rows.append(qw.offset)
            offsets = np.repeat(qw.offset, block_size, axis=0)
        if keep.size:
            rows.append(w[keep] - offsets[keep])
        if not rows:
            return self.op("MatMul", [x, deq], out)
        if self.side_inputs:
            made = self.op(
                SIDE_INPUTS_OP,
                [x, self.const(f"{out}.kept", keep)],
                f"{out}.side",
                outputs=[f"{out}.side", f"{out}.masked"] if keep.size else [f"{out}.side"],
                domain=KVEDGE_OPS_DOMAIN,
                block_size=block_size if qw.offset is not None else 0,
            )
            side, quantized_in = made if keep.size else (made, x)
        else:
            side, quantized_in = self._side_inputs(
                x, w.shape[0], out, block_size, qw.offset is not None, keep
            )
        scaled = self.op("MatMul", [quantized_in, deq], f"{out}.scaled")
        shift = self.op(
            "MatMul", [side, self.fconst(f"{out}.side_weight", np.concatenate(rows))], f"{out}.shift"
        )
        return self.op("Add", [scaled, shift], out)

    def _quant_matmul(self, x: str, w: np.ndarray, qw: QuantizedWeight, out: str, keep: np.ndarray) -> str:
        """x @ w as one kvedge.QuantMatMul (the decode form; `quantize.QuantMatMulWeight`): the
        block offsets and the kept channels' float rows (w[kept] less their block's offset, float16
        at the end of each tile's records) ride in the op, read in the same pass as the codes."""
        offset = np.zeros_like(qw.scale) if qw.offset is None else qw.offset  # [K/bs, N]
        rows = w[keep] - np.repeat(offset, qw.block_size, axis=0)[keep]  # [kept, N]
        packed = pack_quant_matmul(qw, rows)
        inputs = [x, self.const(f"{out}.qmm_weights", packed.weights)]
        if keep.size:
            inputs.append(self.const(f"{out}.kept", keep))
        return self.op(
            QUANT_MATMUL_OP,
            inputs,
            out,
            domain=KVEDGE_OPS_DOMAIN,
            bits=qw.bits,
            block_size=qw.block_size,
            minimums=int(packed.has_minimums),
        )

    def _side_inputs(
        self, x: str, k: int, out: str, block_size: int, offsets: bool, keep: np.ndarray
    ) -> tuple[str, str]:
        """kvedge.SideInputs' outputs (side, masked x) from standard ops: x times a [K, K/block +
        kept] 0/1 matrix, block-sum columns (when the weight has `offsets`) then one column per
        kept channel, and x times a 0/1 mask."""
        gather: list[np.ndarray] = []  # [K, *] columns
        if offsets:
            gather.append(np.repeat(np.eye(k // block_size, dtype=np.float32), block_size, axis=0))
        quantized_in = x
        if keep.size:
            mask = np.ones(k, np.float32)
            mask[keep] = 0.0
            quantized_in = self.op("Mul", [x, self.fconst(f"{out}.int8_mask", mask)], f"{out}.masked")
            select = np.zeros((k, keep.size), np.float32)
            select[keep, np.arange(keep.size)] = 1.0
            gather.append(select)
        side = self.op(
            "MatMul", [x, self.fconst(f"{out}.side_in", np.concatenate(gather, axis=1))], f"{out}.side"
        )
        return side, quantized_in


def build_decoder_graph(
    spec: DecoderSpec,
    geometry: CacheGeometry,
    weights: dict[str, np.ndarray],
    cos: np.ndarray,
    sin: np.ndarray,
    names: IONames,
    options: GraphOptions | None = None,
    progress: Callable[[int], None] | None = None,
    outliers: dict[str, np.ndarray] | None = None,
    local_tables: tuple[np.ndarray, np.ndarray] | None = None,
) -> onnx.ModelProto:
    """The decoder as an ONNX model. `weights` uses Hugging Face state-dict names and layouts;
    `outliers` ({Linear name: input channels}, `quantize.input_outliers`) are kept float32 in
    quantized matmuls; `local_tables` (cos, sin [max_len, d/2]) rotate the sliding-window layers
    (`spec.local_layers`: Gemma 3's, their own RoPE base), `cos`/`sin` every other layer."""
    options = options or GraphOptions()
    check_kv_dtype(geometry.dtype, options.variant, options.precision)
    check_ring(geometry, options.variant)
    if spec.local_layers and local_tables is None:
        raise KvedgeError("sliding-window layers need their RoPE tables (local_tables)")
    if spec.local_layers and geometry.ring_layers not in ((), spec.local_layers):
        raise KvedgeError(
            f"ring layers {list(geometry.ring_layers)} are not the model's sliding-window layers "
            f"{list(spec.local_layers)}"
        )
    prepared = _prepare_weights(spec, geometry, weights)
    # Graphs with kvedge.QuantMatMul hold two forms of the decoder (`_onnx_model`): prefill's
    # matmuls stay onnxruntime's MatMulNBits (its many-row kernel), a decode step's are the op.
    forms = (
        (False, True)
        if QUANT_MATMUL_OP in kvedge_ops(options.variant, geometry.dtype, options.weights, options.decode)
        else (False,)
    )
    builders = []
    for decode_form in forms:
        decoder = _Decoder(
            spec, geometry, prepared, cos, sin, names, options, outliers or {}, local_tables, decode_form
        )
        hidden, delta = decoder.embed(), None  # delta: the last sublayer's output, added by the next norm
        for i in range(geometry.num_layers):
            hidden, delta = decoder.layer(i, hidden, delta)
            if progress:
                progress(1 / len(forms))
        decoder.logits(hidden, delta)
        builders.append(decoder.g)
    interface = GraphInterface(names, geometry, options.variant, options.logits, spec.vocab_size)
    return _onnx_model(builders, interface, options)


def _prepare_weights(
    spec: DecoderSpec, geometry: CacheGeometry, weights: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """`weights` in the layout the graph is built from, per layer:

    - fused projections (Phi-3: `qkv_proj`, `gate_up_proj`) split into the Llama names;
    - partial rotary: Q and K output channels of each head permuted (`rotary_frequencies`);
    - Gemma 3's (1 + w) norm weights as plain weights;
    - the softmax scale (head_dim**-0.5, Gemma 3: query_pre_attn_scalar**-0.5) folded into Wq (and
      its bias), or into the Q norm's weight when Q is normed per head (Qwen3, Gemma 3), since the
      norm would undo a scale applied before it. RoPE is linear, so attention needs no scale op.
    """
    weights = dict(weights)
    d, heads, kv_heads = geometry.head_dim, spec.num_heads, geometry.num_kv_heads
    scale = spec.softmax_scale
    if spec.gemma_norms:  # Gemma3RMSNorm: x / rms(x) * (1 + w), in float32 as HF computes it
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = 1.0 + weights[name].astype(np.float32)
    order = _rotary_order(d, spec.rotary_dim)
    for i in range(geometry.num_layers):
        p = f"model.layers.{i}"
        for kind in ("weight", "bias"):
            fused = weights.pop(f"{p}.self_attn.qkv_proj.{kind}", None)
            if fused is not None:  # rows: q [heads d], k [kv_heads d], v [kv_heads d]
                parts = np.split(fused, [heads * d, (heads + kv_heads) * d])
                for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    weights[f"{p}.self_attn.{name}.{kind}"] = part
            fused = weights.pop(f"{p}.mlp.gate_up_proj.{kind}", None)
            if fused is not None:  # rows: gate [intermediate], up [intermediate]
                gate, up = np.split(fused, 2)
                weights[f"{p}.mlp.gate_proj.{kind}"], weights[f"{p}.mlp.up_proj.{kind}"] = gate, up
        if order is not None:
            for proj, n in (("q_proj", heads), ("k_proj", kv_heads)):
                for part in ("weight", "bias"):
                    name = f"{p}.self_attn.{proj}.{part}"
                    if name in weights:  # rows (or entries) per head: [n d, ...] -> permuted per head
                        w = weights[name]
                        weights[name] = w.reshape(n, d, *w.shape[1:])[:, order].reshape(w.shape)
        folded = (
            [f"{p}.self_attn.q_norm.weight"]
            if spec.qk_norm
            else [f"{p}.self_attn.q_proj.{part}" for part in ("weight", "bias")]
        )
        for name in folded:
            if name in weights:
                weights[name] = weights[name].astype(np.float32) * scale
    return weights


def _rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray | None:
    """Channel order of a head that puts HF's partial-rotary pairs (i, i + r/2), i < r/2, at
    (i, i + d/2) and the pass-through channels after them in each half; None for full rotary."""
    if rotary_dim == head_dim:
        return None
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise KvedgeError(
            f"partial rotary over {rotary_dim} of {head_dim} head channels is not supported; "
            "both the rotated and the passed-through parts must have an even width"
        )
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return np.concatenate(
        [
            np.arange(r),
            np.arange(2 * r, 2 * r + rest),
            np.arange(r, 2 * r),
            np.arange(2 * r + rest, head_dim),
        ]
    )


class _Decoder:
    """The decoder's blocks as ops on one `_Builder`: tensors shared by all layers are made at
    construction, then `embed`, `layer` (once per layer) and `logits` add the rest in order."""

    def __init__(
        self,
        spec: DecoderSpec,
        geometry: CacheGeometry,
        weights: dict[str, np.ndarray],
        cos: np.ndarray,
        sin: np.ndarray,
        names: IONames,
        options: GraphOptions,
        outliers: dict[str, np.ndarray],
        local_tables: tuple[np.ndarray, np.ndarray] | None = None,
        decode_form: bool = False,
    ) -> None:
        self.spec, self.weights, self.names, self.options = spec, weights, names, options
        self.outliers = outliers  # {Linear name: input channels kept float32 when quantized}
        self.portable = options.variant == "portable"
        ops = kvedge_ops(options.variant, geometry.dtype, options.weights)
        self.g = g = _Builder(options.opset, SIDE_INPUTS_OP in ops, decode_form, options.half, self.portable)
        # a float16 graph over the INT8 cache runs attention in float32, as a float32 graph does:
        # its codec's products of a query with int8 codes before scaling can pass 65504
        self.wide_attention = options.half and geometry.quantized
        self.two = g.const("const.two", np.array(2.0, np.float32))  # RMSNorm's island: float32
        self.eps = np.array(spec.rms_norm_eps, np.float32)
        batch_seq = g.op("Shape", [names.input_ids], "shape.bs")  # [2] = (b, s)
        self.b_dim = g.op("Slice", [batch_seq, g.ints(0), g.ints(1)], "shape.b")  # [1]
        self.s_dim = g.op("Slice", [batch_seq, g.ints(1), g.ints(2)], "shape.s")  # [1]
        self.attention = self._attention(geometry, cos, sin, local_tables)
        self.mlp_split = g.const("mlp.split", np.array([spec.intermediate_size] * 2, np.int64))
        if spec.activation == "gelu_pytorch_tanh":
            consts = {"cubic": 0.044715, "root": math.sqrt(2.0 / math.pi), "half": 0.5, "one": 1.0}
            self.gelu_consts = {k: g.fconst(f"gelu.{k}", np.array(v)) for k, v in consts.items()}
        if spec.qk_norm:
            d, kv_heads = geometry.head_dim, geometry.num_kv_heads
            self.qkv_split = g.ints(spec.num_heads * d, kv_heads * d, kv_heads * d)
            self.per_head = g.ints(0, 0, -1, d)
            self.merged_heads = g.ints(0, 0, -1)

    def _attention(self, geometry: CacheGeometry, cos: np.ndarray, sin: np.ndarray, local_tables=None):
        """The variant's attention (module docstring), sharing the RoPE tables [L, d/2] (float16
        over a float16 cache: attention computes in the cache's float type); the sliding-window
        layers read a ring (portable) or attend through a local window over a full length cache
        (ort), rotated with `local_tables`."""
        g = self.g
        half = geometry.dtype in HALF_KV_DTYPES
        table_dtype = np.float16 if half else np.float32
        ring, local = None, {}
        if self.spec.local_layers:
            local = dict(
                local_cos=g.const("rope.local_cos", local_tables[0].astype(table_dtype)),
                local_sin=g.const("rope.local_sin", local_tables[1].astype(table_dtype)),
                window=self.spec.window,
            )
        if geometry.ring_layers:  # portable only (`check_ring`)
            ring = _RingSpec(geometry.ring_len, geometry.window, local["local_cos"], local["local_sin"])
        tables = dict(
            cos_table=g.const("rope.cos", cos.astype(table_dtype)),
            sin_table=g.const("rope.sin", sin.astype(table_dtype)),
        )
        ctx = dict(
            g=g,
            heads=self.spec.num_heads,
            kv_heads=geometry.num_kv_heads,
            d=geometry.head_dim,
            length=geometry.max_len,
            names=self.names,
            s_dim=self.s_dim,
        )
        if self.portable:
            return _PortableAttention(
                **ctx, **tables, b_dim=self.b_dim, kv_group_size=geometry.group_size, ring=ring, half=half
            )
        if geometry.quantized:
            return _Int8CacheAttention(**ctx, **tables, **local)
        return _GroupQueryAttention(**ctx, **tables, **local, half=half)

    def w(self, name: str) -> np.ndarray:
        return self.weights[name].astype(np.float32)

    def linear(self, x: str, prefix: str, parts: list[str], out: str) -> str:
        """x @ concat(W_parts)^T + concat(b_parts): fused projections cost one MatMul. The only
        place layer weights enter the graph (float32 or quantized, `_Builder.matmul_weight`)."""
        g, options = self.g, self.options
        mat = np.concatenate([self.w(f"{prefix}.{p}.weight") for p in parts], axis=0)
        if options.weights == "float16":
            weight = g.float_weight(f"{out}.weight", np.ascontiguousarray(mat.T), stored_half=True)
            y = g.op("MatMul", [x, weight], out)
        else:
            keep = self.outliers.get(f"{prefix}.{parts[0]}")  # fused parts share their input
            y = g.matmul_weight(x, np.ascontiguousarray(mat.T), out, options.bits, options.block_size, keep)
        biases = [f"{prefix}.{p}.bias" for p in parts]
        if all(b in self.weights for b in biases):
            bias = np.concatenate([self.w(b) for b in biases])
            y = g.op("Add", [y, g.fconst(f"{out}.bias", bias)], f"{out}.biased")
        elif any(b in self.weights for b in biases):
            raise KvedgeError(f"{prefix}: some of {parts} have a bias and some do not")
        return y

    def rms_norm(self, x: str, weight: np.ndarray, name: str) -> str:
        """A float32 island in a float16 graph, as transformers computes it: activations of a few
        hundred square past float16's 65504. Pow/ReduceMean/Add/Sqrt/Div/Mul: the pattern
        onnxruntime fuses into one norm kernel."""
        g = self.g
        x = g.widen(x, f"{name}.x32")
        sq = g.op("Pow", [x, self.two], f"{name}.sq")
        mean = g.reduce("ReduceMean", sq, -1, f"{name}.mean")
        var = g.op("Add", [mean, g.const(f"{name}.eps", self.eps)], f"{name}.var")
        root = g.op("Sqrt", [var], name + ".rms")
        normed = g.op("Div", [x, root], f"{name}.normed")
        scaled = g.op("Mul", [normed, g.const(f"{name}.weight", weight)], f"{name}.f32" if g.half else name)
        return g.narrow(scaled, name)

    def residual_norm(self, hidden: str, delta: str | None, weight: np.ndarray, name: str) -> tuple[str, str]:
        """(rms_norm(hidden + delta), hidden + delta): onnxruntime's fused op in the ort variant."""
        g = self.g
        if delta is None:
            return self.rms_norm(hidden, weight, name), hidden
        if self.portable:
            hidden = g.op("Add", [hidden, delta], f"{name}.residual")
            return self.rms_norm(hidden, weight, name), hidden
        normed, _, _, hidden = g.op(
            "SkipSimplifiedLayerNormalization",
            [delta, hidden, g.const(f"{name}.weight", weight)],
            name,
            outputs=[name, "", "", f"{name}.residual"],
            domain=MS_DOMAIN,
            epsilon=self.spec.rms_norm_eps,
        )
        return normed, hidden

    def embed(self) -> str:
        """Token embeddings [b, s, H]; the table is kept for a tied LM head."""
        self.embed_table = self.w("model.embed_tokens.weight")  # [vocab, hidden]
        self.embed_name = self.g.float_weight(
            "model.embed_tokens.weight", self.embed_table, stored_half=self.options.weights == "float16"
        )
        rows = self.g.op("Gather", [self.embed_name, self.names.input_ids], "model.embed", axis=0)
        if self.spec.embed_scale == 1.0:
            return rows
        scale = self.g.fconst("model.embed_scale", np.array(self.spec.embed_scale, np.float32))
        return self.g.op("Mul", [rows, scale], "model.embed_scaled")

    def layer(self, i: int, hidden: str, delta: str | None) -> tuple[str, str]:
        """Decoder layer i: attention and MLP blocks. Returns (residual stream, MLP output)."""
        p = f"model.layers.{i}"
        x, hidden = self.residual_norm(
            hidden, delta, self.w(f"{p}.input_layernorm.weight"), f"{p}.input_layernorm"
        )
        qkv = self.linear(
            x, f"{p}.self_attn", ["q_proj", "k_proj", "v_proj"], f"{p}.attn.qkv"
        )  # [b, s, (h+2kvh)d]
        if self.spec.qk_norm:
            qkv = self.qk_norm(qkv, f"{p}.self_attn")
        if self.wide_attention:
            qkv = self.g.widen(qkv, f"{p}.attn.qkv32")
        if i in self.spec.local_layers:
            attn = self.attention.layer(i, qkv, local=True)  # [b, s, heads*d]
        else:
            attn = self.attention.layer(i, qkv, rotate=i not in self.spec.unrotated_layers)
        if self.wide_attention:
            attn = self.g.narrow(attn, f"{p}.attn.merged16")
        delta = self.linear(attn, f"{p}.self_attn", ["o_proj"], f"{p}.attn.o")
        if self.spec.gemma_norms:  # each sublayer's output normed before its residual add
            delta = self.rms_norm(
                delta, self.w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attn_norm"
            )
            x, hidden = self.residual_norm(
                hidden,
                delta,
                self.w(f"{p}.pre_feedforward_layernorm.weight"),
                f"{p}.pre_feedforward_layernorm",
            )
            out = self.mlp(x, f"{p}.mlp")
            return hidden, self.rms_norm(
                out, self.w(f"{p}.post_feedforward_layernorm.weight"), f"{p}.post_feedforward_layernorm"
            )
        x, hidden = self.residual_norm(
            hidden, delta, self.w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm"
        )
        return hidden, self.mlp(x, f"{p}.mlp")

    def qk_norm(self, qkv: str, p: str) -> str:
        """qkv [b, s, (h+2kvh)d] with Q and K RMS-normed per head, before any variant's RoPE (Qwen3);
        V passes through. The Q norm's weight carries the softmax scale (`_prepare_weights`)."""
        g = self.g
        q, k, v = g.op("Split", [qkv, self.qkv_split], f"{p}.qkv_parts", outputs=3, axis=-1)
        normed = [
            g.op(
                "Reshape",
                [
                    self.rms_norm(
                        g.op("Reshape", [x, self.per_head], f"{p}.{part}_heads"),  # [b, s, n, d]
                        self.w(f"{p}.{part}_norm.weight"),
                        f"{p}.{part}_norm",
                    ),
                    self.merged_heads,
                ],
                f"{p}.{part}_normed",
            )
            for part, x in (("q", q), ("k", k))
        ]
        return g.op("Concat", [*normed, v], f"{p}.qkv_normed", axis=-1)

    def mlp(self, x: str, p: str) -> str:
        """Gated MLP: down(act(gate(x)) * up(x)), gate and up as one MatMul; act is SiLU (SwiGLU)
        or Gemma 3's tanh GELU."""
        g = self.g
        gate_up = self.linear(x, p, ["gate_proj", "up_proj"], f"{p}.gate_up")
        gate, up = g.op("Split", [gate_up, self.mlp_split], f"{p}.parts", outputs=2, axis=-1)
        if self.spec.activation == "gelu_pytorch_tanh":
            gated = self.gelu_tanh(gate, p)
        else:
            gated = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sig")], f"{p}.silu")
        act = g.op("Mul", [gated, up], f"{p}.act")
        return self.linear(act, p, ["down_proj"], f"{p}.down")

    def gelu_tanh(self, x: str, p: str) -> str:
        """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), torch's approximate='tanh' (Gelu's
        approximate attribute needs opset 20)."""
        g = self.g
        c = self.gelu_consts
        cube = g.op("Mul", [g.op("Mul", [x, x], f"{p}.gelu.x2"), x], f"{p}.gelu.x3")
        inner = g.op("Add", [x, g.op("Mul", [cube, c["cubic"]], f"{p}.gelu.cx3")], f"{p}.gelu.inner")
        t = g.op("Tanh", [g.op("Mul", [inner, c["root"]], f"{p}.gelu.arg")], f"{p}.gelu.tanh")
        return g.op(
            "Mul",
            [g.op("Mul", [x, c["half"]], f"{p}.gelu.half_x"), g.op("Add", [t, c["one"]], f"{p}.gelu.one_t")],
            f"{p}.gelu",
        )

    def logits(self, hidden: str, delta: str) -> str:
        """The final norm, the LM head and the logits output [b, 1 or s, vocab] float32: a float16
        graph's LM head computes in float16 (TensorRT accumulates its products in float32), its
        logits widened before they leave the graph."""
        g = self.g
        scores = g.widen(self.lm_head(self.final_rows(hidden, delta)), "logits.rows_vocab32")  # [rows, vocab]
        vocab = g.const("const.vocab", np.array([self.spec.vocab_size], np.int64))
        seq = {"last": g.ints(1), "rows": g.ints(-1)}.get(self.options.logits, self.s_dim)
        out_shape = g.op("Concat", [self.b_dim, seq, vocab], "shape.logits", axis=0)
        return g.op("Reshape", [scores, out_shape], self.names.logits)

    def final_rows(self, hidden: str, delta: str) -> str:
        """The normed last hidden state of the rows logits are wanted for: [b, H] at each row's
        last_index ("last"), [b*r, H] at last_index [b, r] ("rows"), or [b*s, H] ("all").
        Portable graphs pick the rows before the norm, so it runs on them only; ort graphs keep
        the fused residual norm."""
        if not self.portable:
            hidden, _ = self.residual_norm(hidden, delta, self.w("model.norm.weight"), "model.norm")
            return self._select_rows(hidden)
        hidden = self.g.op("Add", [hidden, delta], "model.residual")
        return self.rms_norm(self._select_rows(hidden), self.w("model.norm.weight"), "model.norm")

    def _select_rows(self, hidden: str) -> str:
        g = self.g
        if self.options.logits == "last":
            index = g.op("Unsqueeze", [self.names.last_index, g.ints(1)], "logits.index")  # [b, 1]
            return g.op("GatherND", [hidden, index], "logits.last_hidden", batch_dims=1)  # [b, H]
        rows = g.const("shape.rows", np.array([-1, self.spec.hidden_size], np.int64))
        if self.options.logits == "rows":
            index = g.op("Unsqueeze", [self.names.last_index, g.ints(2)], "logits.index")  # [b, r, 1]
            hidden = g.op("GatherND", [hidden, index], "logits.row_hidden", batch_dims=1)  # [b, r, H]
        return g.op("Reshape", [hidden, rows], "logits.rows")

    def lm_head(self, hidden: str) -> str:
        """hidden [rows, H] @ head^T: the embedding table when tied (stored once, float weights)."""
        g, options = self.g, self.options
        tied = self.spec.tie_word_embeddings or "lm_head.weight" not in self.weights
        if options.quantized:
            head = self.embed_table if tied else self.w("lm_head.weight")  # [vocab, H]
            return g.matmul_weight(
                hidden,
                np.ascontiguousarray(head.T),
                "logits.rows_vocab",
                options.head_bits,
                options.block_size,
                self.outliers.get("lm_head"),
            )
        if tied:
            head_name = self.embed_name
        else:
            stored_half = options.weights == "float16"
            head_name = g.float_weight("lm_head.weight", self.w("lm_head.weight"), stored_half)
        return g.op("Gemm", [hidden, head_name], "logits.rows_vocab", transB=1)


def _onnx_model(
    builders: list[_Builder], interface: GraphInterface, options: GraphOptions
) -> onnx.ModelProto:
    """The model around the builders' nodes, its inputs and outputs declared as `interface` states
    them: one builder's nodes as the graph, or (prefill form, decode form) as the branches of one
    `If` on the step's length (`_two_forms`)."""
    inputs = [_value_info(t) for t in interface.inputs()]
    outputs = [_value_info(t) for t in interface.outputs()]
    g = builders[0]
    if len(builders) == 1:
        graph = helper.make_graph(g.nodes, "kvedge_decoder", inputs, outputs, g.initializers)
    else:
        graph = _two_forms(builders[0], builders[1], interface, inputs, outputs)
    opsets = [helper.make_opsetid("", options.opset)]
    if options.variant == "ort":
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    if kvedge_ops(options.variant, interface.geometry.dtype, options.weights, options.decode):
        opsets.append(helper.make_opsetid(KVEDGE_OPS_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="kvedge")
    # IR 8 is what onnxruntime and TensorRT 8.6+ both read; opset 21 (int4/int8 types) needs IR 10.
    model.ir_version = 8 if options.opset < 21 else 10
    if g.quant_errors:
        helper.set_model_props(model, {"kvedge.max_quant_error": f"{max(g.quant_errors):.6g}"})
    return model


def _two_forms(
    prefill: _Builder,
    decode: _Builder,
    interface: GraphInterface,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
) -> onnx.GraphProto:
    """One graph running `decode`'s nodes for a step of one token per row and `prefill`'s for
    longer steps: If(input_ids.shape[1] == 1). Initializers both forms hold alike live in the
    outer graph, each form's own in its branch (onnxruntime fuses DequantizeLinear -> MatMul into
    MatMulNBits only over a branch's own initializers). A branch's values are renamed with the
    form's name, so no name is defined twice; the graph inputs they read are the outer graph's."""
    own = {t.name: t for t in decode.initializers}
    shared = {
        t.name
        for t in prefill.initializers
        if t.name in own and own[t.name].SerializeToString() == t.SerializeToString()
    }

    def branch(g: _Builder, form: str) -> onnx.GraphProto:
        made = {out for node in g.nodes for out in node.output if out}
        nodes = []
        for node in g.nodes:
            renamed = onnx.NodeProto()
            renamed.CopyFrom(node)
            renamed.name = f"{node.name}@{form}"
            renamed.input[:] = [f"{v}@{form}" if v in made else v for v in node.input]
            renamed.output[:] = [f"{v}@{form}" if v else v for v in node.output]
            nodes.append(renamed)
        outs = [_value_info(t, f"{t.name}@{form}") for t in interface.outputs()]
        locals_ = [t for t in g.initializers if t.name not in shared]
        return helper.make_graph(nodes, f"kvedge_{form}", [], outs, locals_)

    ids = interface.names.input_ids
    steps = [
        helper.make_node("Shape", [ids], ["form.step_length"], name="form/Shape", start=1, end=2),  # [1]
        helper.make_node("Equal", ["form.step_length", "form.one"], ["form.is_decode1"], name="form/Equal"),
        helper.make_node("Squeeze", ["form.is_decode1"], ["form.is_decode"], name="form/Squeeze"),
        helper.make_node(
            "If",
            ["form.is_decode"],
            [t.name for t in interface.outputs()],
            name="form/If",
            then_branch=branch(decode, "decode"),
            else_branch=branch(prefill, "prefill"),
        ),
    ]
    initializers = [t for t in prefill.initializers if t.name in shared]
    initializers.append(numpy_helper.from_array(np.array([1], np.int64), "form.one"))
    return helper.make_graph(steps, "kvedge_decoder", inputs, outputs, initializers)


@dataclass(frozen=True)
class _RingSpec:
    """What the portable graph needs to build the ring layers' attention (`_PortableAttention._ring`)."""

    ring_len: int  # slots per ring layer (geometry.ring_len)
    window: int  # keys a query sees, itself included
    cos_table: str  # the ring layers' RoPE tables [max_len, d/2] (Gemma 3: the local base)
    sin_table: str


@dataclass(frozen=True)
class _RingInputs:
    """Per-call tensors shared by every ring layer; the full layers' counterparts live on
    `_PortableAttention` under the same names."""

    cos4: str  # [b, 1, s, d/2]
    sin4: str
    attend: str  # [1] ring slots read: min(max(past_lengths), ring_len)
    mask: str  # [b, 1, g*s, A_r+s]
    split_as: str  # [2] (A_r, s)
    codec: _Int8Codec | None


class _PortableAttention:
    """Standard-op attention over the valid part of the past (see the module docstring)."""

    def __init__(
        self,
        g,
        heads,
        kv_heads,
        d,
        length,
        names,
        s_dim,
        b_dim,
        cos_table,
        sin_table,
        kv_group_size=0,
        ring: _RingSpec | None = None,
        half=False,  # over a float16 cache: float16 but for the softmax (module docstring)
    ) -> None:
        self.g, self.names, self.half = g, names, half
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        groups = heads // kv_heads
        self.half_split = g.ints(d // 2, d // 2)

        # RoPE angles, shared by all layers (ring layers: by all ring layers).
        self.cos4, self.sin4 = self._angles(cos_table, sin_table, "rope")  # [b, 1, s, d/2] each

        # A = longest valid past in the batch: attention reads slots [0, A) only.
        self.attend = longest = g.reduce("ReduceMax", names.past_lengths, 0, "attn.attend_len")  # [1]
        self.codec = _Int8Codec(g, kv_heads, d, kv_group_size, longest) if kv_group_size else None
        self.neg_inf = neg_inf = g.const("const.neg_inf", np.array(-np.inf, np.float32))
        self.zero_f = zero_f = g.const("const.zero_f", np.array(0.0, np.float32))
        slots = g.op(
            "Slice",
            [
                g.const("mask.all_slots", np.arange(length, dtype=np.int64)[None, :]),
                g.ints(0),
                longest,
                g.ints(1),
            ],
            "mask.slots",
        )  # [1, A]
        lengths = g.op("Unsqueeze", [names.past_lengths, g.ints(1)], "mask.lengths")  # [b, 1]
        past_ok = g.op("Less", [slots, lengths], "mask.past_ok")  # [b, A]
        past_bias = g.op("Where", [past_ok, zero_f, neg_inf], "mask.past_bias")
        past_bias4 = g.op("Unsqueeze", [past_bias, g.ints(1, 2)], "mask.past4")
        scalar_s = g.op("Squeeze", [s_dim, g.ints(0)], "shape.s_scalar")
        new_idx = g.op(
            "Range",
            [
                g.const("const.zero_scalar", np.array(0, np.int64)),
                scalar_s,
                g.const("const.one_scalar", np.array(1, np.int64)),
            ],
            "mask.new_idx",
        )
        rows = g.op("Unsqueeze", [new_idx, g.ints(1)], "mask.rows")  # [s, 1]
        causal = g.op(
            "LessOrEqual", [g.op("Unsqueeze", [new_idx, g.ints(0)], "mask.cols"), rows], "mask.causal"
        )
        new_bias = g.op("Where", [causal, zero_f, neg_inf], "mask.new_bias")  # [s, s]
        past_shape = g.op("Concat", [b_dim, g.ints(1), s_dim, longest], "mask.past_shape", axis=0)
        new_shape = g.op("Concat", [b_dim, g.ints(1), s_dim, s_dim], "mask.new_shape", axis=0)
        mask = g.op(
            "Concat",
            [
                g.op("Expand", [past_bias4, past_shape], "mask.past_full"),
                g.op("Expand", [new_bias, new_shape], "mask.new_full"),
            ],
            "mask.bs",
            axis=-1,
        )  # [b, 1, s, A+s]
        self.mask = g.op("Tile", [mask, g.ints(1, 1, groups, 1)], "mask")  # [b, 1, g*s, A+s]
        self.split_as = g.op("Concat", [longest, s_dim], "attn.split_as", axis=0)
        self.ring = None
        if ring is not None:
            self.ring = self._ring(ring, lengths, rows, new_idx, b_dim, s_dim, groups, kv_group_size)
        self.q_shape = g.ints(0, 0, heads, d)
        self.kv_shape = g.ints(0, 0, kv_heads, d)
        self.grouped = g.ints(0, kv_heads, -1, d)
        self.per_head = g.ints(0, heads, -1, d)
        self.merged = g.ints(0, 0, heads * d)
        self.qkv_split = g.ints(heads * d, kv_heads * d, kv_heads * d)

    def _angles(self, cos_table: str, sin_table: str, name: str) -> tuple[str, str]:
        """cos, sin of the new tokens' positions from tables [L, d/2] -> [b, 1, s, d/2] each."""
        g, positions = self.g, self.names.position_ids
        return tuple(
            g.op(
                "Unsqueeze",
                [g.op("Gather", [table, positions], f"{name}.pos_{kind}", axis=0), g.ints(1)],
                f"{name}.{kind}4",
            )
            for kind, table in (("cos", cos_table), ("sin", sin_table))
        )

    def _ring(
        self, spec: _RingSpec, lengths, rows, new_idx, b_dim, s_dim, groups, kv_group_size
    ) -> _RingInputs:
        """The ring layers' angles, valid slice and mask (`_RingSpec`), shared by those layers.

        Slot j of a ring of R slots holds position stored(j) = P - 1 - ((P - 1 - j) mod R) for a
        row of valid length P: the latest position below P that lands on j (negative where none
        has). New token i (position P + i) sees slot j iff j < P and stored(j) > P + i - window,
        and new token k iff k <= i and i - k < window (HF's sliding-window overlay: a key is
        visible iff kv_idx > q_idx - window)."""
        g = self.g
        cos4, sin4 = self._angles(spec.cos_table, spec.sin_table, "ring.rope")
        ring_len = g.ints(spec.ring_len)
        attend = g.op("Min", [self.attend, ring_len], "ring.attend_len")  # [1] A_r = min(A, R)
        slots = g.op(
            "Slice",
            [
                g.const("ring.all_slots", np.arange(spec.ring_len, dtype=np.int64)[None, :]),
                g.ints(0),
                attend,
                g.ints(1),
            ],
            "ring.slots",
        )  # [1, A_r]
        last = g.op("Sub", [lengths, g.ints(1)], "ring.last")  # [b, 1] P - 1
        back = g.op("Mod", [g.op("Sub", [last, slots], "ring.behind"), ring_len], "ring.back", fmod=0)
        stored = g.op("Sub", [last, back], "ring.stored")  # [b, A_r] position held at each slot
        # visible iff i < stored + window - P (i: the new token's index in the call)
        reach = g.op(
            "Sub", [g.op("Add", [stored, g.ints(spec.window)], "ring.stored_w"), lengths], "ring.reach"
        )  # [b, A_r]
        in_window = g.op(
            "Less",
            [
                g.op("Unsqueeze", [new_idx, g.ints(0, 2)], "ring.i3"),  # [1, s, 1]
                g.op("Unsqueeze", [reach, g.ints(1)], "ring.reach3"),  # [b, 1, A_r]
            ],
            "ring.in_window",
        )  # [b, s, A_r]
        held = g.op("Unsqueeze", [g.op("Less", [slots, lengths], "ring.held"), g.ints(1)], "ring.held3")
        past_ok = g.op("And", [in_window, held], "ring.past_ok")  # [b, s, A_r]
        past_bias = g.op("Where", [past_ok, self.zero_f, self.neg_inf], "ring.past_bias")
        cols = g.op("Unsqueeze", [new_idx, g.ints(0)], "ring.cols")  # [1, s]
        distance = g.op("Sub", [rows, cols], "ring.distance")  # [s, s] i - k
        new_ok = g.op(
            "And",
            [
                g.op("LessOrEqual", [cols, rows], "ring.causal"),
                g.op("Less", [distance, g.ints(spec.window)], "ring.near"),
            ],
            "ring.new_ok",
        )
        new_bias = g.op("Where", [new_ok, self.zero_f, self.neg_inf], "ring.new_bias")  # [s, s]
        new_shape = g.op("Concat", [b_dim, s_dim, s_dim], "ring.new_shape", axis=0)
        mask3 = g.op(
            "Concat",
            [past_bias, g.op("Expand", [new_bias, new_shape], "ring.new_full")],
            "ring.mask3",
            axis=-1,
        )  # [b, s, A_r+s]
        mask4 = g.op("Unsqueeze", [mask3, g.ints(1)], "ring.mask4")  # [b, 1, s, A_r+s]
        return _RingInputs(
            cos4=cos4,
            sin4=sin4,
            attend=attend,
            mask=g.op("Tile", [mask4, g.ints(1, 1, groups, 1)], "ring.mask"),  # [b, 1, g*s, A_r+s]
            split_as=g.op("Concat", [attend, s_dim], "ring.split_as", axis=0),
            codec=_Int8Codec(g, self.kv_heads, self.d, kv_group_size, attend, "ring.int8")
            if kv_group_size
            else None,
        )

    def rope(self, x: str, name: str, rotate: bool = True, local: bool = False) -> str:
        """x [b, n, s, d] rotated by the positions' angles (HF rotate_half convention), with the
        ring layers' own tables where `ring`."""
        g = self.g
        if not rotate:  # a layer without RoPE: x itself, under the name the caller wants
            return g.op("Identity", [x], name)
        cos4, sin4 = (self.ring.cos4, self.ring.sin4) if local else (self.cos4, self.sin4)
        x1, x2 = g.op("Split", [x, self.half_split], f"{name}.halves", outputs=2, axis=-1)
        r1 = g.op(
            "Sub",
            [g.op("Mul", [x1, cos4], f"{name}.x1c"), g.op("Mul", [x2, sin4], f"{name}.x2s")],
            f"{name}.r1",
        )
        r2 = g.op(
            "Add",
            [g.op("Mul", [x2, cos4], f"{name}.x2c"), g.op("Mul", [x1, sin4], f"{name}.x1s")],
            f"{name}.r2",
        )
        return g.op("Concat", [r1, r2], name, axis=-1)

    def softmax(self, scores: str, mask: str, p: str) -> str:
        """softmax(scores + mask) over the keys, in float32: the mask is float32 (-inf) and, over a
        float16 cache, the scores are widened for it and the probabilities narrowed after."""
        g = self.g
        if self.half:
            scores = g.op("Cast", [scores], f"{p}.scores32", to=TensorProto.FLOAT)
        masked = g.op("Add", [scores, mask], f"{p}.masked")
        probs = g.op("Softmax", [masked], f"{p}.probs32" if self.half else f"{p}.probs", axis=-1)
        return g.op("Cast", [probs], f"{p}.probs", to=TensorProto.FLOAT16) if self.half else probs

    def layer(self, i: int, qkv: str, rotate: bool = True, local: bool = False) -> str:
        """Layer i's attention; a sliding-window layer (`local`) reads its ring through the ring mask."""
        g, names, p = self.g, self.names, f"model.layers.{i}"
        inputs = self.ring if local else self
        q, k, v = g.op("Split", [qkv, self.qkv_split], f"{p}.attn.qkv_parts", outputs=3, axis=-1)
        q = g.op(
            "Transpose",
            [g.op("Reshape", [q, self.q_shape], f"{p}.attn.q5")],
            f"{p}.attn.q_bhsd",
            perm=[0, 2, 1, 3],
        )
        k = g.op(
            "Transpose",
            [g.op("Reshape", [k, self.kv_shape], f"{p}.attn.k4")],
            f"{p}.attn.k_bhsd",
            perm=[0, 2, 1, 3],
        )
        codec = inputs.codec
        v = g.op(
            "Transpose",
            [g.op("Reshape", [v, self.kv_shape], f"{p}.attn.v4")],
            f"{p}.attn.v_new" if codec else names.layer(names.present_value, i),
            perm=[0, 2, 1, 3],
        )
        q = g.op(
            "Reshape", [self.rope(q, f"{p}.attn.q_rope", rotate, local), self.grouped], f"{p}.attn.q_grouped"
        )  # [b, kvh, g*s, d]
        k = self.rope(
            k, f"{p}.attn.k_new" if codec else names.layer(names.present_key, i), rotate, local
        )  # [b, kvh, s, d]
        past = [names.layer(t, i) for t in names.past(codec is not None)]
        if codec:  # the new tokens attend over exactly what the cache will hold
            k, v = codec.write(k, v, [names.layer(t, i) for t in names.present(True)], f"{p}.attn.int8")
            past_scores = codec.past_scores(q, past[0], past[2], f"{p}.attn.past_k")
        else:
            past = [
                g.op("Slice", [name, g.ints(0), inputs.attend, g.ints(2)], f"{p}.attn.past{n}")
                for n, name in enumerate(past)
            ]  # K, V [b, kvh, A, d]
            past_scores = g.op(
                "MatMul",
                [q, g.op("Transpose", [past[0]], f"{p}.attn.past_kT", perm=[0, 1, 3, 2])],
                f"{p}.attn.past_scores",
            )  # [b, kvh, g*s, A]
        scores = g.op(
            "Concat",
            [
                past_scores,
                g.op(
                    "MatMul",
                    [q, g.op("Transpose", [k], f"{p}.attn.new_kT", perm=[0, 1, 3, 2])],
                    f"{p}.attn.new_scores",
                ),
            ],
            f"{p}.attn.scores",
            axis=-1,
        )
        probs = self.softmax(scores, inputs.mask, f"{p}.attn")
        p_past, p_new = g.op("Split", [probs, inputs.split_as], f"{p}.attn.probs_parts", outputs=2, axis=-1)
        if codec:
            from_past = codec.past_context(p_past, past[1], past[3], f"{p}.attn.past_v")
        else:
            from_past = g.op("MatMul", [p_past, past[1]], f"{p}.attn.from_past")
        attn = g.op(
            "Add",
            [
                from_past,
                g.op("MatMul", [p_new, v], f"{p}.attn.from_new"),
            ],
            f"{p}.attn.context",
        )  # [b, kvh, g*s, d]
        attn = g.op("Reshape", [attn, self.per_head], f"{p}.attn.per_head")  # [b, heads, s, d]
        return g.op(
            "Reshape",
            [g.op("Transpose", [attn], f"{p}.attn.bshd", perm=[0, 2, 1, 3]), self.merged],
            f"{p}.attn.merged",
        )  # [b, s, heads*d]


class _Int8Codec:
    """The INT8 cache's math in graph ops (`kvedge.quant`: quantize_tokens / dequantize_tokens).

    The codes are computed in float with Div, Round and Clip: the scales are per token at run
    time, which QuantizeLinear (and TensorRT's Q/DQ layers) take only as constants. The int8
    tensors themselves enter and leave the graph only through DequantizeLinear / QuantizeLinear
    with scale 1 and zero point 0, exact for integers in [-127, 127]: TensorRT 10.x's importer
    takes INT8 only as Q/DQ's quantized side (`kvedge.export.trt_compat`), not through Cast,
    Reshape, Split or Slice.
    """

    def __init__(
        self, g: _Builder, kv_heads: int, d: int, group_size: int, attend: str, prefix: str = "int8"
    ) -> None:
        self.g, self.groups, self.attend = g, d // group_size, attend
        self.heads = g.ints(kv_heads, kv_heads)  # splits [b, 2 kvh, ...] into K and V
        self.ones = g.ints(*[1] * self.groups)  # splits [b, kvh, groups, A] into groups
        self.widths = g.ints(*[group_size] * self.groups)  # splits [..., d] into channel groups
        # Slice bounds of group j over (cache length, channels): [0, j gs] .. [A, (j + 1) gs]
        self.length_and_channels = g.ints(2, 3)
        self.starts = [g.ints(0, j * group_size) for j in range(self.groups)]
        self.ends = [
            g.op("Concat", [attend, g.ints((j + 1) * group_size)], f"{prefix}.ends_g{j}", axis=0)
            for j in range(self.groups)
        ]
        self.to_groups = g.ints(0, 0, 0, self.groups, group_size)  # [b, kvh, n, d] -> [..., groups, gs]
        self.to_channels = g.ints(0, 0, 0, d)
        self.qmax = g.const(f"{prefix}.qmax", np.array(127.0, np.float32))
        self.qmin = g.const(f"{prefix}.qmin", np.array(-127.0, np.float32))
        self.floor = g.const(f"{prefix}.scale_floor", np.array(2.0**-14, np.float32))
        self.unit = g.const(f"{prefix}.unit_scale", np.array(1.0, np.float32))  # Q/DQ of the codes themselves
        self.zero = g.const(f"{prefix}.zero_point", np.array(0, np.int8))

    def write(self, k: str, v: str, outputs: list[str], name: str) -> tuple[str, str]:
        """New K and V [b, kvh, n, d] float -> the layer's four present outputs (`IONames.present`
        order: K, V codes int8; K, V scales [b, kvh, n, groups] float16). Returns the dequantized
        K and V, i.e. exactly what later reads of the cache give. K and V go through one chain of
        ops (concatenated along heads): at one token per step, per-op overhead is the cost."""
        g = self.g
        both = g.op("Concat", [k, v], f"{name}.kv", axis=1)  # [b, 2 kvh, n, d]
        grouped = g.op("Reshape", [both, self.to_groups], f"{name}.grouped")  # [b, 2 kvh, n, groups, gs]
        absmax = g.reduce("ReduceMax", g.op("Abs", [grouped], f"{name}.abs"), -1, f"{name}.absmax")
        scale = g.op(
            "Max", [g.op("Div", [absmax, self.qmax], f"{name}.raw_scale"), self.floor], f"{name}.s32"
        )
        scale16 = g.op("Cast", [scale], f"{name}.s16", to=TensorProto.FLOAT16)  # [b, 2 kvh, n, groups, 1]
        stored = g.op("Cast", [scale16], f"{name}.stored_scale", to=TensorProto.FLOAT)
        levels = g.op(
            "Clip",
            [
                g.op("Round", [g.op("Div", [grouped, stored], f"{name}.ratio")], f"{name}.round"),
                self.qmin,
                self.qmax,
            ],
            f"{name}.levels",
        )  # integers in [-127, 127], as float
        parts = g.op(
            "Split",
            [g.op("Reshape", [levels, self.to_channels], f"{name}.levels_bhsd"), self.heads],
            f"{name}.levels_kv",
            outputs=2,
            axis=1,
        )  # K, V levels [b, kvh, n, d] float
        for part, output in zip(parts, outputs[:2], strict=True):
            g.op("QuantizeLinear", [part, self.unit, self.zero], f"{name}.codes", outputs=[output])
        g.op(
            "Split",
            [g.op("Squeeze", [scale16, g.ints(-1)], f"{name}.scales"), self.heads],
            f"{name}.scales_kv",
            outputs=outputs[2:],
            axis=1,
        )
        deq = g.op(
            "Reshape", [g.op("Mul", [levels, stored], f"{name}.deq5"), self.to_channels], f"{name}.deq"
        )
        k_deq, v_deq = g.op("Split", [deq, self.heads], f"{name}.deq_kv", outputs=2, axis=1)
        return k_deq, v_deq

    def _past(self, codes: str, scales: str, name: str) -> tuple[list[str], list[str]]:
        """The valid part of a cached tensor, per channel group: codes [b, kvh, max_len, d] int8
        and scales [b, kvh, max_len, groups] float16 -> ([b, kvh, A, group_size] float per group,
        [b, kvh, 1, A] scale per group). The codes are widened by one DequantizeLinear (scale 1),
        then one Slice per group cuts the valid length and the group's channels; the scales are
        folded into the scores (K) and probabilities (V), never multiplied into K/V."""
        g = self.g
        widened = g.op("DequantizeLinear", [codes, self.unit, self.zero], f"{name}.codes")  # [b, kvh, L, d]
        valid = g.op("Slice", [scales, g.ints(0), self.attend, g.ints(2)], f"{name}.scales")
        scale = g.op(
            "Transpose",
            [g.op("Cast", [valid], f"{name}.scale", to=TensorProto.FLOAT)],
            f"{name}.scale_t",
            perm=[0, 1, 3, 2],
        )  # [b, kvh, groups, A]
        if self.groups == 1:
            factors = [scale]
        else:
            factors = g.op("Split", [scale, self.ones], f"{name}.scale_parts", outputs=self.groups, axis=2)
        parts = [
            g.op("Slice", [widened, self.starts[j], self.ends[j], self.length_and_channels], f"{name}.g{j}")
            for j in range(self.groups)
        ]
        return parts, factors

    def past_scores(self, q: str, codes: str, scales: str, name: str) -> str:
        """q [b, kvh, gs, d] against the cached keys -> scores [b, kvh, gs, A] = the sum over
        channel groups of (q_g @ codes_g^T) * scale_g."""
        g = self.g
        keys, factors = self._past(codes, scales, name)
        queries = (
            [q]
            if self.groups == 1
            else g.op("Split", [q, self.widths], f"{name}.q_parts", outputs=self.groups, axis=-1)
        )
        terms = [
            g.op(
                "Mul",
                [
                    g.op(
                        "MatMul",
                        [qj, g.op("Transpose", [kj], f"{name}.g{j}_T", perm=[0, 1, 3, 2])],
                        f"{name}.g{j}_raw",
                    ),
                    sj,
                ],
                f"{name}.g{j}_scores",
            )
            for j, (qj, kj, sj) in enumerate(zip(queries, keys, factors, strict=True))
        ]
        return terms[0] if self.groups == 1 else g.op("Sum", terms, f"{name}.scores")

    def past_context(self, probs: str, codes: str, scales: str, name: str) -> str:
        """probs [b, kvh, gs, A] applied to the cached values -> [b, kvh, gs, d]: per channel
        group (probs * scale_g) @ codes_g, concatenated."""
        g = self.g
        values, factors = self._past(codes, scales, name)
        parts = [
            g.op("MatMul", [g.op("Mul", [probs, sj], f"{name}.g{j}_weighted"), vj], f"{name}.g{j}_context")
            for j, (vj, sj) in enumerate(zip(values, factors, strict=True))
        ]
        return parts[0] if self.groups == 1 else g.op("Concat", parts, f"{name}.context", axis=-1)


class _InPlaceAttention:
    """What the in-place attentions share: the heads, the RoPE tables (cos, sin [L, d/2]) and, for
    sliding-window layers (Gemma 3), their own tables and a window over the full-length cache."""

    def __init__(
        self, g, heads, kv_heads, names, cos_table, sin_table, local_cos=None, local_sin=None, window=0
    ) -> None:
        self.g, self.names, self.heads, self.kv_heads = g, names, heads, kv_heads
        self.cos_table, self.sin_table = cos_table, sin_table
        self.local_cos, self.local_sin, self.window = local_cos, local_sin, window


class _GroupQueryAttention(_InPlaceAttention):
    """onnxruntime's GroupQueryAttention, past and present sharing one buffer (module docstring).

    `half` (a float16 cache, the onnxruntime CUDA form): Q/K/V are cast to float16 before the op
    and its output back to float32, the cache and RoPE tables are float16; the rest of the graph
    is unchanged. Everything the op reads is then fixed in shape and made on the device, so the
    CUDA provider can capture the decode step as a CUDA graph: seqlens_k comes from the token
    ids' own row length (ReduceSum of ones), never from a Shape, whose value would sit in host
    memory and be copied to the device each step; and total_sequence_length, which the CUDA
    kernel reads on the host, is the constant max_len instead of max(past_lengths) + s, which
    would be copied from the device each step (a sync no capture can hold). The op then sizes
    its work from seqlens_k per row; with total > s a prefill counts as a continuation, which
    it takes for batch 1 only, as the runtime already calls it."""

    def __init__(self, g, heads, kv_heads, d, length, names, s_dim, half=False, **tables) -> None:
        super().__init__(g, heads, kv_heads, names, **tables)
        self.half = half
        if half:
            ones = g.op(
                "Cast",
                [g.op("Equal", [names.input_ids] * 2, "gqa.ones_bool")],
                "gqa.ones",
                to=TensorProto.INT32,
            )  # [b, s]
            new = g.op("ReduceSum", [ones, g.ints(1)], "gqa.new_tokens", keepdims=0)  # [b] = s
            past = g.op("Cast", [names.past_lengths], "gqa.past_i32", to=TensorProto.INT32)
            one = g.const("gqa.one_i32", np.array([1], np.int32))
            last = g.op("Sub", [new, one], "gqa.s_minus_1")
            self.seqlens = g.op("Add", [past, last], "gqa.seqlens_k")  # [b] int32
            self.total = g.const("gqa.total_sequence_length", np.array(length, np.int32))  # scalar
            return
        s_minus_1 = g.op("Sub", [s_dim, g.ints(1)], "gqa.s_minus_1")
        seqlens = g.op("Add", [names.past_lengths, s_minus_1], "gqa.seqlens_i64")  # [b]
        self.seqlens = g.op("Cast", [seqlens], "gqa.seqlens_k", to=TensorProto.INT32)
        longest = g.reduce("ReduceMax", names.past_lengths, 0, "gqa.longest_past", keepdims=0)
        total = g.op("Add", [longest, g.op("Squeeze", [s_dim], "gqa.s_scalar")], "gqa.total_i64")
        self.total = g.op("Cast", [total], "gqa.total_sequence_length", to=TensorProto.INT32)  # scalar

    def layer(self, i: int, qkv: str, rotate: bool = True, local: bool = False) -> str:
        """Layer i; a sliding-window layer (`local`) attends to the key at its own position and
        the window - 1 before it: local_window_size = window (onnxruntime 1.32 CPU, checked
        against transformers in tests/test_gemma3.py; window - 1 differs by ~2 in the logits)."""
        g, names, p = self.g, self.names, f"model.layers.{i}.attn"
        tables = [self.cos_table, self.sin_table] if rotate else []
        if local:
            tables = [self.local_cos, self.local_sin]
        if self.half:
            qkv = g.op("Cast", [qkv], f"{p}.qkv16", to=TensorProto.FLOAT16)  # [b, s, (h+2kvh)d]
        merged = g.op(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                names.layer(names.past_key, i),
                names.layer(names.past_value, i),
                self.seqlens,
                self.total,
                *tables,
            ],
            f"{p}.gqa",
            outputs=[
                f"{p}.merged16" if self.half else f"{p}.merged",  # [b, s, heads*d]
                names.layer(names.present_key, i),
                names.layer(names.present_value, i),
            ],
            domain=MS_DOMAIN,
            num_heads=self.heads,
            kv_num_heads=self.kv_heads,
            scale=1.0,  # folded into Wq
            do_rotary=int(rotate),
            rotary_interleaved=0,
            local_window_size=self.window if local else -1,
        )[0]
        return g.op("Cast", [merged], f"{p}.merged", to=TensorProto.FLOAT) if self.half else merged


class _Int8CacheAttention(_InPlaceAttention):
    """kvedge's own onnxruntime kernel (`kvedge/runtime/csrc/kvedge_ops.cc`): GroupQueryAttention's
    counterpart over the INT8 cache, past and present sharing one buffer per tensor."""

    def __init__(self, g, heads, kv_heads, d, length, names, s_dim, **tables) -> None:
        super().__init__(g, heads, kv_heads, names, **tables)
        self.identity_shape = (length, d // 2)
        self.identity: list[str] = []

    def layer(self, i: int, qkv: str, rotate: bool = True, local: bool = False) -> str:
        """Layer i; a sliding-window layer (`local`) attends as GroupQueryAttention's does: to the
        key at its own position and the window - 1 before it (local_window_size = window)."""
        g, names = self.g, self.names
        past = [names.layer(t, i) for t in names.past(True)]  # K, V codes, K, V scales
        tables = [self.local_cos, self.local_sin] if local else self.tables(rotate)
        return g.op(
            INT8_ATTENTION_OP,
            [qkv, names.past_lengths, *past, *tables],
            f"model.layers.{i}.attn.int8",
            outputs=[f"model.layers.{i}.attn.merged", *[names.layer(t, i) for t in names.present(True)]],
            domain=KVEDGE_OPS_DOMAIN,
            num_heads=self.heads,
            kv_num_heads=self.kv_heads,
            local_window_size=self.window if local else -1,
        )[0]

    def tables(self, rotate: bool) -> list[str]:
        """The RoPE tables, or for a layer without RoPE tables of angle 0 (cos 1, sin 0 [L, d/2]):
        the kernel always rotates, and a rotation by 0 is exactly the identity."""
        if rotate:
            return [self.cos_table, self.sin_table]
        if not self.identity:
            self.identity = [
                self.g.const("rope.cos_none", np.ones(self.identity_shape, np.float32)),
                self.g.const("rope.sin_none", np.zeros(self.identity_shape, np.float32)),
            ]
        return self.identity


def all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """`graph` and every graph inside its nodes' attributes (an If's branches), depth first."""
    found = [graph]
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                found += all_graphs(sub)
    return found


def decode_step_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The graphs a decode step runs: `graph` and, of a two-form graph's If, the decode form (the
    then branch, `_two_forms`)."""
    found = [graph]
    for node in graph.node:
        if node.op_type == "If":
            then = next(a for a in node.attribute if a.name == "then_branch")
            found += decode_step_graphs(then.g)
    return found


def _value_info(tensor: TensorSpec, name: str | None = None) -> onnx.ValueInfoProto:
    """A graph input/output declared as the contract's `GraphInterface` states it (under `name`
    when given: a branch's output)."""
    elem = helper.np_dtype_to_tensor_dtype(tensor.dtype)
    return helper.make_tensor_value_info(name or tensor.name, elem, list(tensor.dims))
