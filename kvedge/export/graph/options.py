"""What to build: the numbers the graph takes from a Hugging Face config (`DecoderSpec`), the
opset an export's choices (`kvedge.contract.ExportRecipe`) take, and the checks that refuse
combinations no graph is built for.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvedge.contract import CacheGeometry, ExportRecipe, family_refusal, shared_kv_sources
from kvedge.errors import KvedgeError

OPSET = 17  # float32 and float16 weights
# caches attention reads and writes in float16: GroupQueryAttention's (`ort`), or a float16
# graph's (`--precision float16`, portable)
HALF_KV_DTYPES = ("float16",)
QUANTIZED_OPSET = 21  # blocked DequantizeLinear (block_size) needs opset 21
MS_DOMAIN = "com.microsoft"
# longrope: short factors only; proportional: Gemma 4's global layers, frequencies past its rotary part 0
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
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
class Gemma4Spec:
    """What Gemma 4's text decoder adds to Gemma 3's (transformers' Gemma4TextModel; the note in
    docs/design/model-families.md): the full layers' own head_dim, layers reading an earlier
    layer's KV, per-layer embeddings, V normed per head, a scalar per layer, softcapped logits."""

    global_head_dim: int  # head_dim of the "full_attention" layers (sliding ones: DecoderSpec.head_dim)
    shared_layers: tuple[int, ...]  # layers storing no KV (the last num_kv_shared_layers)
    shared_sources: tuple[int, ...]  # the layer whose KV each reads: the last earlier one of its type
    per_layer: int  # hidden_size_per_layer_input; 0: no per-layer embeddings
    per_layer_vocab: int  # vocab_size_per_layer_input
    softcap: float  # final_logit_softcapping; 0: none

    @classmethod
    def from_config(cls, config: Any) -> Gemma4Spec | None:
        if config.model_type != "gemma4_text":
            return None
        if config.enable_moe_block:
            raise KvedgeError(
                "Gemma 4 with enable_moe_block=True (the MoE variants, e.g. 26B-A4B) is not supported yet"
            )
        if config.attention_k_eq_v:
            raise KvedgeError(
                "Gemma 4 with attention_k_eq_v=True (values from the key projection, the 31B's global "
                "layers) is not supported yet"
            )
        if not hasattr(config, "kv_sharing_modes"):
            raise KvedgeError(
                "Gemma 4 needs transformers 5.25 or newer (this one's Gemma4TextConfig has no "
                "kv_sharing_modes): pip install 'transformers>=5.25'"
            )
        kinds = list(config.layer_types)
        shared = tuple(i for i, mode in enumerate(config.kv_sharing_modes) if mode == "reuse")
        sources = shared_kv_sources([kind == "sliding_attention" for kind in kinds], shared)
        full = cls.layer_config(config, "full_attention")
        sliding = cls.layer_config(config, "sliding_attention")
        if full.num_key_value_heads != sliding.num_key_value_heads:
            raise KvedgeError(
                f"Gemma 4 with {full.num_key_value_heads} KV heads on its global layers and "
                f"{sliding.num_key_value_heads} on its sliding ones is not supported yet"
            )
        return cls(
            global_head_dim=int(full.head_dim),
            shared_layers=shared,
            shared_sources=sources,
            per_layer=int(config.hidden_size_per_layer_input or 0),
            per_layer_vocab=int(config.vocab_size_per_layer_input or 0),
            softcap=float(config.final_logit_softcapping or 0.0),
        )

    @staticmethod
    def layer_config(config: Any, kind: str) -> Any:
        """transformers' per-layer config of layer type `kind` (its head_dim, KV heads)."""
        return config.per_layer_config[kind]


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
    # Gemma 4 (`Gemma4Spec`): per-layer head_dim, shared KV, per-layer embeddings; None: none
    gemma4: Gemma4Spec | None = None

    @classmethod
    def from_config(cls, config: Any) -> DecoderSpec:
        head_dim = attention_sizes(config)[0]
        lfm2 = config.model_type == "lfm2"
        qwen35 = config.model_type == "qwen3_5_text"
        gemma4 = Gemma4Spec.from_config(config)
        gemma = config.model_type == "gemma3_text" or gemma4 is not None
        rope = (getattr(config, "rope_parameters", None) or {}) if not gemma else {}
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in GATED_ACTIVATIONS:
            raise KvedgeError(
                f"hidden_act {act!r} is not supported; the MLP is gated with one of {list(GATED_ACTIVATIONS)}"
            )
        for name in ("final_logit_softcapping", "attn_logit_softcapping")[gemma4 is not None :]:
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
            qk_norm=config.model_type in ("qwen3", "gemma3_text", "lfm2", "qwen3_5_text", "gemma4_text"),
            # SmolLM3: no_rope_layers[i] is 1 where layer i uses RoPE
            unrotated_layers=tuple(
                i for i, rope in enumerate(getattr(config, "no_rope_layers", None) or []) if not rope
            ),
            activation=act,
            # Gemma 4: no softmax scale (HF's scaling 1.0; its Q norm sets the magnitude)
            query_scale=(1.0 if gemma4 else float(config.query_pre_attn_scalar) ** -0.5) if gemma else 0.0,
            # HF: torch.tensor(hidden_size**0.5), float32, times the float32 embedding
            embed_scale=float(np.float32(config.hidden_size**0.5)) if gemma else 1.0,
            gemma_norms=gemma,
            local_layers=local_layers(config),
            window=int(config.sliding_window) if local_layers(config) else 0,
            num_layers=config.num_hidden_layers,
            conv_layers=conv_layers(config),
            conv_kernel=int(config.conv_L_cache) if lfm2 else 0,
            delta=DeltaNetSpec.from_config(config),
            # Gemma 3 and Qwen3.5 norms weigh by (1 + w); Gemma 4's by w
            unit_offset_norms=qwen35 or config.model_type == "gemma3_text",
            attention_gate=qwen35,
            gemma4=gemma4,
        )

    @property
    def softmax_scale(self) -> float:
        return self.query_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_head_dim(self, layer: int) -> int:
        """Model layer `layer`'s head_dim: a Gemma 4 global layer's own, else head_dim."""
        if self.gemma4 and layer not in self.local_layers:
            return self.gemma4.global_head_dim
        return self.head_dim


def attention_sizes(config: Any) -> tuple[int, int]:
    """(head_dim, KV heads) of the config's attention layers; Gemma 4's per-layer config gives its
    sliding layers' (its global layers' head_dim: `Gemma4Spec.global_head_dim`)."""
    if config.model_type == "gemma4_text":
        sliding = Gemma4Spec.layer_config(config, "sliding_attention")
        return int(sliding.head_dim), int(sliding.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim, getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def graph_opset(recipe: ExportRecipe) -> int:
    """The ONNX opset the graph of `recipe` is built at: blocked DequantizeLinear needs 21."""
    return QUANTIZED_OPSET if recipe.quantized else OPSET


def local_layers(config: Any) -> tuple[int, ...]:
    """Gemma 3's and 4's sliding-window layers ("sliding_attention" in `layer_types`); () for other
    families, whose sliding window (Mistral) is refused past its width instead (`geometry_from_config`)."""
    if config.model_type not in ("gemma3_text", "gemma4_text"):
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


def check_states(geometry: CacheGeometry, recipe: ExportRecipe) -> CacheGeometry:
    """`geometry` with its per-slot states in the dtype a float16 graph keeps them in: LFM2's
    convolution states in float16, the inputs its float16 convolutions read anyway; Qwen3.5's
    Gated DeltaNet layers are float32 islands between their projections (its recurrent state sums
    a whole conversation's updates), so both their states stay float32."""
    if not recipe.half or not geometry.states or geometry.recurrent:
        return geometry
    states = tuple(dataclasses.replace(state, dtype="float16") for state in geometry.states)
    return dataclasses.replace(geometry, states=states)


def check_ring(geometry: CacheGeometry, variant: str) -> None:
    """Ring-buffer layers that wrap are built for the portable graph only: GroupQueryAttention (and
    kvedge's INT8 kernel) write K/V at the valid length, not at a position modulo the ring. A ring
    of max_len positions (Gemma 4's ort graph, `gemma4_geometry`) never wraps: position p sits at
    index p, where the in-place attentions write it."""
    if geometry.ring_layers and variant != "portable" and geometry.ring_len != geometry.max_len:
        raise KvedgeError(
            f"--variant {variant!r} does not support sliding-window ring layers of {geometry.ring_len} "
            f"positions under max_len {geometry.max_len} (Gemma 3): its attention writes the cache in "
            "place at the valid length, with no ring; use --variant portable"
        )


def check_gemma4(spec: DecoderSpec, recipe: ExportRecipe) -> None:
    """Gemma 4 is built for float32-compute graphs, portable or ort, and for the portable float16
    graph (its per-layer inputs narrowed in the graph, `Decoder.per_layer_inputs`); the ort one
    over a float32 or INT8 cache, not over a float16 cache (the form onnxruntime's CUDA provider
    runs): its shared layers' attention (`inplace.SharedReads`) reads the cache in float32 ops,
    which a float16 cache would have to be widened for. The refusals are
    `contract.FAMILY_REFUSED`'s, which the planner reads too."""
    if spec.gemma4 is None:
        return
    choices = dict(variant=recipe.variant, precision=recipe.precision, kv_dtype=recipe.kv_dtype)
    if refused := family_refusal("gemma4_text", **choices):
        raise KvedgeError(refused)
