"""What to build: the numbers the graph takes from a Hugging Face config (`DecoderSpec`), the
opset an export's choices (`kvedge.contract.ExportRecipe`) take, and the checks that refuse
combinations no graph is built for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvedge.contract import CacheGeometry, ExportRecipe
from kvedge.errors import KvedgeError

OPSET = 17  # float32 and float16 weights
# caches attention reads and writes in float16: GroupQueryAttention's (`ort`), or a float16
# graph's (`--precision float16`, portable)
HALF_KV_DTYPES = ("float16",)
QUANTIZED_OPSET = 21  # blocked DequantizeLinear (block_size) needs opset 21
MS_DOMAIN = "com.microsoft"
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")  # longrope: short factors only
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # act(gate(x)) * up(x); Gemma 3 uses the tanh GELU


@dataclass(frozen=True)
class DeltaNetSpec:
    """Qwen3.5's Gated DeltaNet layers ("linear_attention" in `layer_types`): a causal convolution
    of `kernel` over Q, K, V ([2 k_heads k_dim + v_heads v_dim] channels), then a recurrent state
    [v_heads, k_dim, v_dim] per layer updated by the gated delta rule."""

    layers: tuple[int, ...]
    kernel: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @classmethod
    def from_config(cls, config: Any) -> DeltaNetSpec | None:
        if config.model_type != "qwen3_5_text":
            return None
        kinds = list(config.layer_types)
        unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
        if unknown:
            raise KvedgeError(
                f"layer types {unknown} are not supported; allowed: linear_attention, full_attention"
            )
        if config.linear_num_value_heads % config.linear_num_key_heads:
            raise KvedgeError(
                f"linear_num_value_heads {config.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {config.linear_num_key_heads}"
            )
        return cls(
            layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
            kernel=int(config.linear_conv_kernel_dim),
            k_heads=int(config.linear_num_key_heads),
            v_heads=int(config.linear_num_value_heads),
            k_dim=int(config.linear_key_head_dim),
            v_dim=int(config.linear_value_head_dim),
        )


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
    num_layers: int = 0  # the model's layers; 0: as many as the cache geometry's KV layers
    # LFM2: layers that are a gated short convolution (`layer_types` "conv"), not attention; each
    # keeps its last conv_kernel - 1 inputs as a per-slot state
    conv_layers: tuple[int, ...] = ()
    conv_kernel: int = 0
    # Qwen3.5: Gated DeltaNet layers (None: none); every RMSNorm but the DeltaNet's gated one weighs
    # by (1 + w) (`unit_offset_norms`); attention's output is gated by sigmoid of a second half of
    # each head's q_proj rows (`attention_gate`)
    delta: DeltaNetSpec | None = None
    unit_offset_norms: bool = False
    attention_gate: bool = False

    @classmethod
    def from_config(cls, config: Any) -> DecoderSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        lfm2 = config.model_type == "lfm2"
        qwen35 = config.model_type == "qwen3_5_text"
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
            intermediate_size=lfm2_intermediate_size(config) if lfm2 else config.intermediate_size,
            num_heads=config.num_attention_heads,
            rms_norm_eps=float(config.norm_eps if lfm2 else config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            qk_norm=config.model_type in ("qwen3", "gemma3_text", "lfm2", "qwen3_5_text"),
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
            num_layers=config.num_hidden_layers,
            conv_layers=conv_layers(config),
            conv_kernel=int(config.conv_L_cache) if lfm2 else 0,
            delta=DeltaNetSpec.from_config(config),
            unit_offset_norms=qwen35,
            attention_gate=qwen35,
        )

    @property
    def softmax_scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)


def graph_opset(recipe: ExportRecipe) -> int:
    """The ONNX opset the graph of `recipe` is built at: blocked DequantizeLinear needs 21."""
    return QUANTIZED_OPSET if recipe.quantized else OPSET


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


def conv_layers(config: Any) -> tuple[int, ...]:
    """LFM2's short-convolution layers ("conv" in `layer_types`); () for other families."""
    if config.model_type != "lfm2":
        return ()
    kinds = list(config.layer_types)
    unknown = sorted(set(kinds) - {"conv", "full_attention"})
    if unknown:
        raise KvedgeError(f"layer types {unknown} are not supported; allowed: conv, full_attention")
    return tuple(i for i, kind in enumerate(kinds) if kind == "conv")


def lfm2_intermediate_size(config: Any) -> int:
    """LFM2's MLP width as transformers' Lfm2MLP computes it from the config (2/3 of
    intermediate_size, times block_ffn_dim_multiplier, rounded up to block_multiple_of)."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def check_states(geometry: CacheGeometry, recipe: ExportRecipe) -> None:
    """Per-slot states (LFM2's and Qwen3.5's state layers) are built for float32 graphs only."""
    if not geometry.states:
        return
    if recipe.half:
        raise KvedgeError(
            "--precision float16 is not built for models with convolution layers (LFM2) yet: their "
            "states are float32; use --precision float32"
        )


def check_ring(geometry: CacheGeometry, variant: str) -> None:
    """Ring-buffer layers are built for the portable graph only: GroupQueryAttention (and kvedge's
    INT8 kernel) write K/V at the valid length, not at a position modulo the ring."""
    if geometry.ring_layers and variant != "portable":
        raise KvedgeError(
            f"--variant {variant!r} does not support sliding-window ring layers (Gemma 3): its "
            "attention writes the cache in place at the valid length, with no ring; use --variant portable"
        )
