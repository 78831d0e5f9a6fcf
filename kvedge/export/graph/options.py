"""What to build: the numbers the graph takes from a Hugging Face config (`DecoderSpec`), the
export's choices (`GraphOptions`) and the checks that refuse combinations no graph is built for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvedge.contract import (
    DECODE_MATMULS,
    EXPORTED_KV_DTYPES,
    LOGITS_MODES,
    PRECISIONS,
    VARIANTS,
    CacheGeometry,
    export_kv_dtypes,
    export_weight_formats,
)
from kvedge.errors import KvedgeError
from kvedge.export.quantize import (
    HEAD_BITS,
    HEAD_MIN_BITS,
    OUTLIER_CHANNELS,
    OUTLIER_CHOICES,
    WEIGHT_FORMATS,
    check_format,
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
        """The graph computes in float16 (`--precision float16`, `Builder`'s float type)."""
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
