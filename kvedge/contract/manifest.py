"""The model manifest: cache geometry, graph I/O names and what the exported graph is.

Everything that crosses the boundary between the exporter and the runtime lives here, so that
both sides compute shapes, byte counts and binding names from one place. The artifact folder it
describes is listed in `kvedge.contract`.

The runtime reads every graph input/output name from `manifest.json`; nothing downstream
hard-codes a name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvedge import __version__
from kvedge.contract.header import Header, decode_json, read_artifact
from kvedge.errors import ArtifactMismatch, KvedgeError

MANIFEST_FORMAT = "kvedge-manifest"
# 2: rope.unrotated_layers (SmolLM3), which a version-1 reader would re-rotate; 3: ring layers and
# local-layer RoPE (Gemma 3), which a version-2 reader would size full-length or re-rotate wrongly;
# 4: inputs_embeds (`EmbeddingTable`), which a version-3 reader would not feed; 5: per-slot
# states (`CacheGeometry.states`, LFM2's convolution layers) and `kv_layers`, which a version-4
# reader would neither bind nor keep across calls; 6: Gemma 4's shared-KV layers, ring layers of
# their own head_dim and per-layer inputs (`PerLayerTable`), which a version-5 reader would ignore
MANIFEST_VERSION = 6
MANIFEST_FILE = "manifest.json"
ONNX_FILE = "model.onnx"
# an untied model's quantized input embeddings (`EmbeddingTable`), beside the graph's files
EMBEDDINGS_FILE = "embeddings.bin"
# Gemma 4's per-layer embedding table (`PerLayerTable`), a .npy file the runtime maps
PER_LAYER_FILE = "per_layer_embeddings.npy"
PER_LAYER_DTYPES = ("float32", "float16")


def per_layer_dtype(weights: str) -> str:
    """The per-layer table's dtype for an export's `--weights`: float32 beside float32 weights,
    else float16 (half the bytes of a table as large as the rest of an E2B model)."""
    return PER_LAYER_DTYPES[0] if weights == "float32" else PER_LAYER_DTYPES[1]


TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

KV_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "int4": np.uint8}
QUANTIZED_KV_DTYPES = ("int8",)  # stored as codes plus one float16 scale per token per channel group
# stored as packed codes (uint8) plus float16 scales and a float32 window of recent positions
# (`CacheGeometry.packed`, the form of kvedge/kv4.py)
PACKED_KV_DTYPES = ("int4",)
# int4 caches: positions before each query kept float32 (`CacheGeometry.float_window`); the
# window carries most of the form's quality (docs/PERFORMANCE.md, "The KV cache at long context")
FLOAT_WINDOW = 32
# positions the window ring keeps beyond it: a slot can rewind this many tokens (a speculative
# verify's rejected ones, a chat template's re-rendered end of turn) and keep its window; a
# longer rewind re-prefills from the start. Half RING_MARGIN: a window position of a 64-channel
# head holds 512 bytes, a coded one 78
WINDOW_MARGIN = 32
KV_SCALE_DTYPE = np.float16
KV_GROUP_SIZES = (16, 32, 64, 128)
# what `kvedge export --kv-dtype` builds graphs for (`export_kv_dtypes` says which with what)
EXPORTED_KV_DTYPES = ("float32", "float16", "int8", "int4")
# `kvedge export --precision`: the dtype the graph computes in (`GraphInterface` for its I/O).
# float16: weights and activations float16, with float32 islands (RMSNorm's reduction, softmax,
# the logits output), for TensorRT's strongly typed builds; the portable variant only.
PRECISIONS = ("float32", "float16")
# Graph variants: what attention is built from, and whether present K/V alias the past buffers.
# Manifests written before the field existed load as "portable" (same format version).
VARIANTS = {"portable": "standard ONNX ops (TensorRT-compatible)", "ort": "onnxruntime fused attention"}
IN_PLACE_VARIANTS = ("ort",)
# kvedge's own onnxruntime kernels (kvedge/runtime/csrc, CPU only), which "ort" graphs use
# (`kvedge_ops`): attention over an INT8 cache, and the side inputs of a quantized matmul
KVEDGE_OPS_DOMAIN = "kvedge"
INT8_ATTENTION_OP = "Int8CacheAttention"
INT4_ATTENTION_OP = "Int4CacheAttention"
SIDE_INPUTS_OP = "SideInputs"
QUANT_MATMUL_OP = "QuantMatMul"
# weight formats -> bits: float32 / float16 storage, or weight-only blocked integers (fewer than 16)
WEIGHT_FORMATS = {"float32": 32, "float16": 16, "int8": 8, "int4": 4}


# --decode-matmuls: what a decode step's quantized matmuls run in "ort" int8/int4 graphs. kvedge:
# kvedge.QuantMatMul in a decode form of its own (faster, the weights held twice); onnxruntime:
# MatMulNBits for every step, one form (docs/design/graph-variants.md "Two forms of one graph").
DECODE_MATMULS = ("kvedge", "onnxruntime")


def export_kv_dtypes(variant: str, precision: str = "float32") -> tuple[str, ...]:
    """The cache dtypes a graph of `variant` computing in `precision` is exported with, its
    default first. float32 graphs: float32 or int8 (and with --variant ort float16, the
    GroupQueryAttention form onnxruntime's CUDA provider runs). float16 graphs (portable only):
    float16, attention computed over it in float16, or int8, whose codes and scales are read and
    written by the same float32 ops as in a float32 graph (products of a query with int8 codes
    before scaling can pass float16's 65504); never float32, which would hold float16 values at
    twice the bytes."""
    if precision == "float16":
        return ("float16", "int8")
    return EXPORTED_KV_DTYPES if variant == "ort" else ("float32", "int8")


def export_weight_formats(precision: str) -> tuple[str, ...]:
    """The `--weights` a graph computing in `precision` is exported with, its default first:
    float16 graphs store float weights as float16 (float32 storage would only be cast down) and
    dequantize int8/int4 blocks to float16; float32 graphs take every format (float16 storage is
    widened to float32 by one Cast per weight)."""
    if precision == "float16":
        return tuple(w for w in WEIGHT_FORMATS if w != "float32")
    return tuple(WEIGHT_FORMATS)


def kvedge_ops(variant: str, kv_dtype: str, weights: str, decode_matmuls: str = "kvedge") -> tuple[str, ...]:
    """The kvedge ops (`KVEDGE_OPS_DOMAIN`) in the graph of an export with these options: in "ort"
    graphs, INT8- or int4-cache attention, and for blocked integer weights the side inputs of each matmul
    (the prefill form) and, with `decode_matmuls` "kvedge", the decode form's matmuls, except
    over a float16 cache: that graph is
    the form onnxruntime's CUDA provider runs, and a CPU-only op between its matmuls would copy
    every activation off the device and back."""
    if variant != "ort":
        return ()
    ops = (INT8_ATTENTION_OP,) if kv_dtype in QUANTIZED_KV_DTYPES else ()
    ops += (INT4_ATTENTION_OP,) if kv_dtype in PACKED_KV_DTYPES else ()
    if WEIGHT_FORMATS[weights] < 16 and kv_dtype != "float16":
        ops += (SIDE_INPUTS_OP, QUANT_MATMUL_OP) if decode_matmuls == "kvedge" else (SIDE_INPUTS_OP,)
    return ops


# Tokens per prefill call: bounds the [g*s, max_len+s] score buffers. The runtime prefills in
# chunks of this, the planner sizes the activation peak for it, and a TensorRT engine's prefill
# profile defaults to it.
PREFILL_CHUNK = 256
# What the logits output holds (`--logits`): "last": each row's last real token, picked by
# last_index [batch]; "rows": the positions last_index [batch, rows] names (one per row for a
# prompt, every proposed position when verifying a speculative step, kvedge.runtime.speculate);
# "all": every position. The default is "rows": the LM head runs on the rows asked for only.
LOGITS_MODES = ("rows", "last", "all")
# The most tokens one speculative verify runs (the pending token and up to VERIFY_TOKENS - 1
# proposals, kvedge.runtime.speculate), so the most logits rows per sequence it asks of a "rows"
# graph; a TensorRT engine's prefill profile takes last_index [batch, 1..VERIFY_TOKENS]
# (`kvedge.contract.engine`). In "ort" graphs a step of up to this many tokens per row computes
# each of them exactly as a one-token decode step would: the two-form graphs' decode form runs it
# (kvedge.QuantMatMul, its rows one at a time in the arithmetic of one), and the INT8-cache
# attention attends its tokens one at a time (its decode_steps attribute).
VERIFY_TOKENS = 9
# Ring positions a sliding-window layer keeps beyond its window (`CacheGeometry.ring_margin`): a
# slot can then rewind up to this many tokens and keep its cache, which covers the few tokens a
# chat template re-renders at the end of a turn; a longer rewind re-prefills from the start.
RING_MARGIN = 64


# Kinds of per-slot state a layer may hold besides attention KV (`StateSpec.kind`). "conv": a
# short causal convolution's last kernel-1 inputs (LFM2's conv layers, Qwen3.5's Gated DeltaNet
# layers), [kernel - 1, channels]; "recurrent": a Gated DeltaNet layer's matrix state per value
# head, [value heads, key dim, value dim].
STATE_KINDS = ("conv", "recurrent")
STATE_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class StateSpec:
    """One kind of fixed-size per-slot state and the layers holding it: each of `layers` (the
    model's layer indices) holds one `shape` array per slot, whatever the slot's length. Unlike KV,
    a state cannot be cut back to a shorter prefix: it is valid at one position only, and the
    runtime keeps snapshots of it where a later turn may resume (`KVCache.snapshot`)."""

    kind: str  # a STATE_KINDS value
    layers: tuple[int, ...]
    shape: tuple[int, ...]  # per slot and layer
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS or self.dtype not in STATE_DTYPES:
            raise KvedgeError(
                f"state {self.kind!r} {self.dtype!r}: allowed kinds {list(STATE_KINDS)}, "
                f"dtypes {list(STATE_DTYPES)}"
            )
        if not self.layers or any(not isinstance(n, int) or n <= 0 for n in self.shape):
            raise KvedgeError(
                f"state {self.kind!r}: layers {list(self.layers)} and shape {list(self.shape)} "
                "must be non-empty and positive"
            )

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def bytes_per_layer(self) -> int:
        """Bytes one slot's state of one layer holds."""
        return int(np.prod(self.shape)) * self.np_dtype.itemsize

    def pool_shape(self, slots: int) -> tuple[int, ...]:
        """Shape of its pool: [layers, slots, *shape]."""
        return (len(self.layers), slots, *self.shape)


@dataclass(frozen=True)
class CacheGeometry:
    """Shape of one model's KV cache and per-slot states: the only place cache shapes and byte
    counts are computed. `num_layers` counts the layers holding KV; in a hybrid model (LFM2) those
    are some of the model's layers (`kv_layers`), and the others hold `states`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_len: int
    dtype: str = "float32"
    # int8 caches: channels of head_dim sharing one scale per token (see kvedge.quant); 0 for float.
    group_size: int = 0
    # Sliding-window layers (Gemma 3's local layers) hold a ring of `ring_len` positions instead of
    # max_len: position p sits at ring index p % ring_len
    # (docs/design/kv-contract.md, "Ring-buffer layers").
    ring_layers: tuple[int, ...] = ()
    window: int = 0  # keys a ring layer's query sees, itself included (HF's sliding_window)
    ring_margin: int = 0  # ring positions beyond the window: how far back a slot can still rewind
    # the model layer of each KV layer, where some layers hold no KV (hybrid models); () when
    # KV layer i is model layer i
    kv_layers: tuple[int, ...] = ()
    states: tuple[StateSpec, ...] = ()  # fixed-size per-slot states (LFM2's convolutions)
    # the ring layers' head_dim where it is not the full layers' (Gemma 4: sliding layers 256,
    # global layers 512); 0: head_dim
    ring_head_dim: int = 0
    # model layers that store no KV and attend over another layer's (Gemma 4's last
    # num_kv_shared_layers), and the model layer whose KV each reads, in the same order
    shared_layers: tuple[int, ...] = ()
    shared_sources: tuple[int, ...] = ()
    # int4 caches (`packed`): the KV layers whose keys keep 8-bit codes (the layers whose keys
    # cost the most at 4-5 bits), and the positions before each query it sees in float32, held
    # in a ring of float_window + RING_MARGIN positions per layer (`window_len`)
    key8_layers: tuple[int, ...] = ()
    float_window: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise KvedgeError(f"cache geometry: {name}={value!r} must be a positive integer")
        if self.dtype not in KV_DTYPES:
            raise KvedgeError(
                f"cache geometry: dtype={self.dtype!r} is not supported; allowed: {sorted(KV_DTYPES)}"
            )
        if not self.quantized and self.group_size != 0:
            raise KvedgeError(f"cache geometry: group_size={self.group_size!r} is only for int8 caches")
        dims = {self.head_dim, self.ring_dim}
        allowed = [g for g in KV_GROUP_SIZES if all(g <= d and d % g == 0 for d in dims)]
        if self.quantized and self.group_size not in allowed:
            raise KvedgeError(
                f"cache geometry: group_size={self.group_size!r} is not allowed for head_dim "
                f"{' and '.join(map(str, sorted(dims)))}; allowed: {allowed}"
            )
        if self.ring_head_dim < 0 or (self.ring_head_dim and not self.ring_layers):
            raise KvedgeError(
                f"cache geometry: ring_head_dim={self.ring_head_dim!r} needs ring layers and must be positive"
            )
        layers = self._check_layers("ring_layers")
        if bool(layers) != (self.window > 0) or self.ring_margin < 0 or (self.ring_margin and not layers):
            raise KvedgeError(
                f"cache geometry: window={self.window!r}, ring_margin={self.ring_margin!r} need ring "
                "layers and a positive window (and none without ring layers)"
            )
        if self.kv_layers and (
            len(self.kv_layers) != self.num_layers or list(self.kv_layers) != sorted(set(self.kv_layers))
        ):
            raise KvedgeError(
                f"cache geometry: kv_layers={list(self.kv_layers)!r} must name {self.num_layers} distinct "
                "increasing model layers"
            )
        kinds = [state.kind for state in self.states]
        stateful = {i for state in self.states for i in state.layers}
        if len(kinds) != len(set(kinds)) or stateful & set(self.kv_layers):
            raise KvedgeError(
                f"cache geometry: states {kinds} must be of distinct kinds, on layers that hold no KV "
                f"(kv_layers {list(self.kv_layers)})"
            )
        self._check_shared()
        self._check_packed()

    def _check_layers(self, name: str) -> tuple[int, ...]:
        """The field `name`, a set of KV layers: distinct, increasing, in range."""
        layers = getattr(self, name)
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise KvedgeError(
                f"cache geometry: {name}={list(layers)!r} must be distinct increasing layer "
                f"indices in 0..{self.num_layers - 1}"
            )
        return layers

    def _check_packed(self) -> None:
        """An int4 cache: power-of-2 heads (its Hadamard rotation), no rings of its own kind, its
        8-bit key layers among its layers; other caches name none of its fields."""
        if not self.packed:
            if self.key8_layers or self.float_window:
                raise KvedgeError(
                    f"cache geometry: key8_layers={list(self.key8_layers)!r}, float_window="
                    f"{self.float_window!r} are for int4 caches only"
                )
            return
        d = self.head_dim
        if d < 16 or d & (d - 1) or self.ring_layers:
            raise KvedgeError(
                f"cache geometry: an int4 cache needs one power-of-2 head_dim of at least 16 and no "
                f"sliding-window ring layers (head_dim {d}, ring layers {list(self.ring_layers)})"
            )
        self._check_layers("key8_layers")
        if not isinstance(self.float_window, int) or not 0 <= self.float_window <= 256:
            raise KvedgeError(f"cache geometry: float_window={self.float_window!r}; allowed: 0..256")

    def _check_shared(self) -> None:
        """Shared layers hold no KV and read a layer that does (`kv_layers`)."""
        shared, sources = self.shared_layers, self.shared_sources
        if not shared and not sources:
            return
        if (
            len(shared) != len(sources)
            or not self.kv_layers
            or set(shared) & set(self.kv_layers)
            or not set(sources) <= set(self.kv_layers)
        ):
            raise KvedgeError(
                f"cache geometry: shared_layers={list(shared)!r} must hold no KV and each read one of "
                f"kv_layers {list(self.kv_layers)} (shared_sources={list(sources)!r})"
            )

    @classmethod
    def default_group_size(cls, head_dim: int) -> int:
        """32 channels per scale: one scale per head (SmolLM2's 64 channels) kept fewer top-1
        tokens of the float32 cache's (docs/PERFORMANCE.md, "The INT8 cache: per token")."""
        return min(32, head_dim)

    def with_dtype(
        self, dtype: str, group_size: int | None = None, key8_layers: Sequence[int] | None = None
    ) -> CacheGeometry:
        """The same cache in another dtype (int8: `group_size`, default one scale per head; int4:
        `key8_layers`, default this one's, and the float window FLOAT_WINDOW)."""
        if dtype in QUANTIZED_KV_DTYPES:
            group_size = (
                group_size or self.group_size or self.default_group_size(min(self.head_dim, self.ring_dim))
            )
        else:
            group_size = 0
        packed = dtype in PACKED_KV_DTYPES
        key8 = tuple(self.key8_layers if key8_layers is None else key8_layers) if packed else ()
        return dataclasses.replace(
            self,
            dtype=dtype,
            group_size=group_size,
            key8_layers=key8,
            float_window=FLOAT_WINDOW if packed else 0,
        )

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def packed(self) -> bool:
        """An int4 cache: packed codes, scales and a float32 window per layer (kvedge/kv4.py)."""
        return self.dtype in PACKED_KV_DTYPES

    @property
    def window_len(self) -> int:
        """Positions of an int4 cache's float32 window ring: float_window + WINDOW_MARGIN (a slot
        can rewind WINDOW_MARGIN tokens and keep it), never more than max_len; 0 otherwise."""
        return min(self.max_len, self.float_window + WINDOW_MARGIN) if self.packed else 0

    def key_bits(self, layer: int) -> int:
        """An int4 cache's key code bits in KV layer `layer`: 8 in `key8_layers`, else 5."""
        return 8 if layer in self.key8_layers else 5

    def packed_parts(self, layer: int) -> tuple[tuple[np.dtype, int, int], ...]:
        """An int4 cache's tensors of KV layer `layer`, in `IONames.past` order, as (dtype,
        positions, last dim): K codes (5d/8 bytes a 5-bit row, d an 8-bit one), V codes (d/2),
        K scales (1 a 5-bit row, one per 32 channels an 8-bit one), V scales (1), then the float32
        K and V windows of `window_len` positions."""
        d, bits, u8, f16 = self.head_dim, self.key_bits(layer), np.dtype(np.uint8), np.dtype(KV_SCALE_DTYPE)
        key_bytes, key_scales = (d, d // min(32, d)) if bits == 8 else (5 * d // 8, 1)
        window = (np.dtype(np.float32), self.window_len, d)
        n = self.max_len
        return ((u8, n, key_bytes), (u8, n, d // 2), (f16, n, key_scales), (f16, n, 1), window, window)

    def packed_arrays(self) -> tuple[tuple[tuple[int, ...], tuple[np.dtype, int, int]], ...]:
        """An int4 cache's arrays (`KVCache.parts`) as (KV layers, (dtype, positions, last)): per
        tensor of `packed_parts`, in its order, the layers of one shape share one array (K codes
        and scales: one for the 5-bit layers, one for the 8-bit ones); the last two are the K and
        V windows. A stored block (`KVBlock.parts`) holds all but the windows, so alike."""
        arrays = []
        for part in range(len(self.packed_parts(0))):
            shapes: dict[tuple[np.dtype, int, int], list[int]] = {}
            for i in range(self.num_layers):
                shapes.setdefault(self.packed_parts(i)[part], []).append(i)
            arrays += [(tuple(layers), shape) for shape, layers in shapes.items()]
        return tuple(arrays)

    @property
    def recurrent(self) -> bool:
        """Some layer keeps a recurrent state (Qwen3.5's Gated DeltaNet): a float16 graph keeps its
        states in float32 (`check_states`)."""
        return any(state.kind == "recurrent" for state in self.states)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(KV_DTYPES[self.dtype])

    @property
    def scale_groups(self) -> int:
        """Scales per token per head of a full layer (int8 caches); 0 for float caches."""
        return self.head_dim // self.group_size if self.quantized else 0

    @property
    def ring_dim(self) -> int:
        """The ring layers' head_dim (`ring_head_dim`, else head_dim)."""
        return self.ring_head_dim or self.head_dim

    @property
    def ring_scale_groups(self) -> int:
        """Scales per token per head of a ring layer (int8 caches); 0 for float caches."""
        return self.ring_dim // self.group_size if self.quantized else 0

    def layer_head_dim(self, layer: int) -> int:
        """KV layer `layer`'s head_dim: the ring layers' own, or head_dim."""
        return self.ring_dim if layer in self.ring_layers else self.head_dim

    def layer_scale_groups(self, layer: int) -> int:
        """Scales per token per head of KV layer `layer` (int8 caches); 0 for float caches."""
        return self.layer_head_dim(layer) // self.group_size if self.quantized else 0

    @property
    def ring_len(self) -> int:
        """Positions of each ring layer: the window plus the margin, never more than max_len; 0 when
        there are no ring layers."""
        return min(self.max_len, self.window + self.ring_margin) if self.ring_layers else 0

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers holding max_len positions (all of them without ring layers)."""
        return tuple(i for i in range(self.num_layers) if i not in self.ring_layers)

    def layer_len(self, layer: int) -> int:
        """Cache positions of `layer`: ring_len for a ring layer, else max_len."""
        return self.ring_len if layer in self.ring_layers else self.max_len

    def scale_pool_shape(self, slots: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the scale pool: [full layers, 2 (K, V), slots, kv_heads, max_len, groups] float16."""
        return (len(self.full_layers), 2, slots, self.num_kv_heads, self.max_len, self.scale_groups)

    def ring_scale_shape(self, slots: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the ring layers' scales: [ring layers, 2, slots, kv_heads, ring_len, groups] float16."""
        return (len(self.ring_layers), 2, slots, self.num_kv_heads, self.ring_len, self.ring_scale_groups)

    def layer_shape(self, batch: int, layer: int = 0) -> tuple[int, int, int, int]:
        """Shape of `layer`'s K (or V) for `batch` rows: [batch, kv_heads, layer_len, head_dim]."""
        return (batch, self.num_kv_heads, self.layer_len(layer), self.layer_head_dim(layer))

    def pool_shape(self, slots: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the full layers' pool: [full layers, 2 (K, V), slots, kv_heads, max_len, head_dim]
        (every layer, without ring layers)."""
        return (len(self.full_layers), 2, slots, self.num_kv_heads, self.max_len, self.head_dim)

    def ring_shape(self, slots: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the ring layers' pool: [ring layers, 2, slots, kv_heads, ring_len, ring_dim]."""
        return (len(self.ring_layers), 2, slots, self.num_kv_heads, self.ring_len, self.ring_dim)

    def _bytes_per_layer_token(self, head_dim: int, layer: int = 0) -> int:
        """KV bytes of one token in one layer of `head_dim` (K and V), scales included (an int4
        cache's: of KV layer `layer`, its codes and scales, not its window)."""
        if self.packed:
            parts = self.packed_parts(layer)[:4]
            return self.num_kv_heads * sum(dtype.itemsize * last for dtype, _, last in parts)
        groups = head_dim // self.group_size if self.quantized else 0
        per_head = head_dim * self.np_dtype.itemsize + groups * np.dtype(KV_SCALE_DTYPE).itemsize
        return 2 * self.num_kv_heads * per_head

    def bytes_per_token(self) -> int:
        """KV bytes one new token writes across all layers (K and V), scales included; a shared
        layer (`shared_layers`) writes none."""
        if self.packed:
            return sum(self._bytes_per_layer_token(self.head_dim, i) for i in range(self.num_layers))
        return len(self.full_layers) * self._bytes_per_layer_token(self.head_dim) + len(
            self.ring_layers
        ) * self._bytes_per_layer_token(self.ring_dim)

    def bytes_held(self, tokens: int) -> int:
        """KV bytes a slot holding `tokens` tokens uses: ring layers hold at most ring_len of them,
        an int4 cache's windows at most window_len."""
        return self.block_bytes(tokens, min(tokens, self.window_len if self.packed else self.ring_len))

    def block_bytes(self, count: int, ring_count: int) -> int:
        """KV bytes of `count` positions in the full layers and `ring_count` in the ring layers
        (a stored block's, `KVBlock`), each layer at its own head_dim, scales included; an int4
        cache's: `count` positions of codes and scales, `ring_count` of its windows."""
        if self.packed:
            return self.bytes_per_token() * count + self.window_bytes(ring_count)
        full = len(self.full_layers) * count * self._bytes_per_layer_token(self.head_dim)
        return full + len(self.ring_layers) * ring_count * self._bytes_per_layer_token(self.ring_dim)

    def window_bytes(self, positions: int) -> int:
        """Bytes of `positions` positions of an int4 cache's float32 K and V windows, all layers."""
        return self.num_layers * 2 * self.num_kv_heads * positions * self.head_dim * 4 if self.packed else 0

    def bytes_per_slot(self) -> int:
        """KV bytes of a full slot plus its fixed states."""
        return self.bytes_held(self.max_len) + self.state_bytes_per_slot()

    def state_bytes_per_slot(self) -> int:
        """Bytes of one slot's fixed-size states (not per token)."""
        return sum(len(s.layers) * s.bytes_per_layer() for s in self.states)

    @property
    def model_layers(self) -> int:
        """The model's layers: KV layers plus state layers plus shared layers."""
        return self.num_layers + len({i for s in self.states for i in s.layers}) + len(self.shared_layers)

    def kv_index(self, layer: int) -> int:
        """The KV layer index of model layer `layer` (its cache names' index); a shared layer's
        is the one of the layer whose KV it reads."""
        if layer in self.shared_layers:
            layer = self.shared_sources[self.shared_layers.index(layer)]
        return self.kv_layers.index(layer) if self.kv_layers else layer

    def pool_bytes(self, slots: int) -> int:
        return self.bytes_per_slot() * slots

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def artifact_key(self, holds_cache: bool) -> dict[str, Any]:
        """The geometry fields an artifact made for this cache depends on (its header's
        "geometry"): layers, kv heads and head_dim; with `holds_cache` (warm prefixes: cache
        bytes) also the dtype and an int8 cache's group size. Never max_len: an artifact holds at
        most max_len tokens, whatever the cache length."""
        key: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
        if holds_cache:
            key["dtype"] = self.dtype
            if self.quantized:
                key["group_size"] = self.group_size
            if self.packed:
                key.update(key8_layers=list(self.key8_layers), float_window=self.float_window)
        if self.ring_layers:
            key.update(ring_layers=list(self.ring_layers), window=self.window, ring_margin=self.ring_margin)
        if self.ring_head_dim:
            key.update(ring_head_dim=self.ring_head_dim)
        if self.shared_layers:
            key.update(
                kv_layers=list(self.kv_layers),
                shared_layers=list(self.shared_layers),
                shared_sources=list(self.shared_sources),
            )
        if self.states:
            key.update(
                kv_layers=list(self.kv_layers),
                states=[[s.kind, list(s.layers), list(s.shape), s.dtype] for s in self.states],
            )
        return key


def shared_kv_sources(local: Sequence[bool], shared: Sequence[int]) -> tuple[int, ...]:
    """The model layer whose KV each of `shared` reads: the last layer of its kind (sliding:
    `local[i]`, or global) before the first shared one (transformers' Gemma4TextModel)."""
    if not shared:
        return ()
    return tuple(max(j for j in range(shared[0]) if local[j] == local[i]) for i in shared)


def shared_kv_geometry(
    local: Sequence[bool],
    shared: tuple[int, ...],
    *,
    num_kv_heads: int,
    head_dim: int,
    global_head_dim: int,
    window: int,
    max_len: int,
    variant: str = "portable",
) -> CacheGeometry:
    """Gemma 4's cache: KV for the layers before its `shared` ones only (those read an earlier
    layer's and store none), its sliding layers (`local[i]`) on rings of their `head_dim`, its
    global layers max_len of `global_head_dim`. The portable variant's rings hold window +
    RING_MARGIN positions; the ort variant's max_len (a margin of max_len - window), so they
    never wrap: its in-place attentions write position p at index p, as over any full-length
    cache, and the rings only keep the sliding layers' head_dim apart. The exporter (from a
    transformers config) and the planner (from a configs/models recipe) both ask here."""
    stored = tuple(i for i in range(len(local)) if i not in shared)
    ring = tuple(k for k, i in enumerate(stored) if local[i])
    margin = RING_MARGIN if variant == "portable" else max(0, max_len - window)
    return CacheGeometry(
        num_layers=len(stored),
        num_kv_heads=num_kv_heads,
        head_dim=global_head_dim,
        max_len=max_len,
        ring_layers=ring,
        window=window if ring else 0,
        ring_margin=margin if ring else 0,
        kv_layers=stored if shared else (),
        ring_head_dim=head_dim if ring and head_dim != global_head_dim else 0,
        shared_layers=shared,
        shared_sources=shared_kv_sources(local, shared),
    )


@dataclass(frozen=True)
class IONames:
    """Graph input/output names. Per-layer names are templates formatted with the layer index."""

    input_ids: str = "input_ids"  # [batch, seq] int64
    # [batch, seq, hidden] in the graph's float type: the token embeddings, where the runtime
    # looks them up (`Manifest.embedding`)
    inputs_embeds: str = "inputs_embeds"
    position_ids: str = "position_ids"  # [batch, seq] int64
    past_lengths: str = "past_lengths"  # [batch] int64: valid cache positions per row
    # [batch] ("last") or [batch, rows] ("rows") int64: the positions whose logits are returned
    last_index: str = "last_index"
    past_key: str = "past_key_values.%d.key"  # [batch, kv_heads, max_len, head_dim]
    past_value: str = "past_key_values.%d.value"  # [batch, kv_heads, max_len, head_dim]
    # int8 caches only: float16 scales [batch, kv_heads, max_len or seq, head_dim / group_size]
    past_key_scale: str = "past_key_values.%d.key_scale"
    past_value_scale: str = "past_key_values.%d.value_scale"
    present_key_scale: str = "present.%d.key_scale"
    present_value_scale: str = "present.%d.value_scale"
    # int4 caches only: float32 [batch, kv_heads, window_len, head_dim], the rotated K and V of
    # the last positions (`CacheGeometry.window_len`), position p at index p % window_len
    past_key_window: str = "past_key_values.%d.key_window"
    past_value_window: str = "past_key_values.%d.value_window"
    present_key_window: str = "present.%d.key_window"
    present_value_window: str = "present.%d.value_window"
    logits: str = "logits"  # [batch, 1 | rows | seq, vocab] float32 (`LOGITS_MODES`)
    # Portable graphs: [batch, kv_heads, seq, head_dim], the new tokens only. In-place variants
    # ("ort"): [batch, kv_heads, max_len, head_dim], the past buffer itself, written in place.
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    # models with per-slot states (`CacheGeometry.states`): [batch] int64, the real tokens of each
    # row (its state is the one after them); per state layer, formatted with (kind, model layer),
    # the state before the call [batch, *shape] and after the row's real tokens [batch, *shape]
    input_lengths: str = "input_lengths"
    # Gemma 4: [batch, seq, layers * P] in the graph's float type, each token's row of the
    # per-layer embedding table, which the runtime reads from its mapped file (`Manifest.per_layer`)
    per_layer_inputs: str = "per_layer_inputs"
    past_state: str = "past_states.%s.%d"
    present_state: str = "present_states.%s.%d"

    def state(self, template: str, kind: str, layer: int) -> str:
        return template % (kind, layer)

    def layer(self, template: str, index: int) -> str:
        return template % index

    def past(self, quantized: bool, windows: bool = False) -> tuple[str, ...]:
        """Per-layer past templates, in the order of `KVCache.layer_views` tuples: K, V, then for
        int8 and int4 caches (`quantized`) their scales, then for int4 (`windows`) the windows."""
        templates = (self.past_key, self.past_value)
        if quantized:
            templates += (self.past_key_scale, self.past_value_scale)
        return templates + ((self.past_key_window, self.past_value_window) if windows else ())

    def present(self, quantized: bool, windows: bool = False) -> tuple[str, ...]:
        """Per-layer present templates, in the order of `StepOutput.present` tuples (`past`'s)."""
        templates = (self.present_key, self.present_value)
        if quantized:
            templates += (self.present_key_scale, self.present_value_scale)
        return templates + ((self.present_key_window, self.present_value_window) if windows else ())

    def cache_past(self, geometry: CacheGeometry) -> tuple[str, ...]:
        """`past`'s templates of `geometry`'s cache."""
        return self.past(geometry.quantized or geometry.packed, geometry.packed)

    def cache_present(self, geometry: CacheGeometry) -> tuple[str, ...]:
        """`present`'s templates of `geometry`'s cache."""
        return self.present(geometry.quantized or geometry.packed, geometry.packed)


Dim = int | str  # a fixed size, or an axis that varies per call: "batch", "seq" or "rows"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: its name, element type and shape."""

    name: str
    dtype: np.dtype
    dims: tuple[Dim, ...]
    layer: int | None = None  # per-layer cache tensors: the layer's index; None for the others
    state: bool = False  # a per-slot state (`CacheGeometry.states`), never written in place

    def shape(self, batch: int, seq: int, rows: int = 1) -> tuple[int, ...]:
        """The concrete shape of a call of `batch` rows x `seq` tokens asking for `rows` logits
        rows per row (a "rows"-logits graph)."""
        sizes = {"batch": batch, "seq": seq, "rows": rows}
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)

    def describe(self) -> str:
        return f"[{', '.join(str(d) for d in self.dims)}] {self.dtype}"


# The stored blocks of a quantized tied LM head, which the runtime reads embedding rows from
# (`EmbeddingTable`): initializers of the graph named HEAD_TABLE + these suffixes.
HEAD_TABLE = "logits.rows_vocab"
HEAD_PARTS = {"codes": ".weight_q", "scale": ".weight_scale", "side": ".side_weight", "kept": ".kept"}


@dataclass(frozen=True)
class StoredTensor:
    """Where one initializer's bytes lie in the export's external data file: `length` bytes at
    `offset`, elements `dtype` (a numpy name; "uint8" for int4 codes packed two per byte, the
    first in the low nibble) of the initializer's `shape`. An onnx tool that re-saves the graph
    moves them: write the manifest's `embedding` again (`kvedge.export.export.head_table`)."""

    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    # sha256 of its first STORED_CHECK_BYTES bytes, which the runtime checks at load: a data file
    # rewritten after the export moves the tensors, and the offsets would read other bytes
    sha256: str = ""


STORED_CHECK_BYTES = 4096


@dataclass(frozen=True)
class EmbeddingTable:
    """The token embeddings of a quantized graph, which the runtime looks up and feeds as
    `inputs_embeds`. With a tied LM head, the head's own stored blocks in the graph's data file:
    the table is stored once (at the head's bits) and no float copy is made. An untied model's
    input table is quantized to 8 bits in blocks of the export's size, in EMBEDDINGS_FILE (its
    float32 table was the largest tensor left at 32 bits: Phi-3.5-mini's 394 MB).

    w [hidden, vocab] = codes x scale (blocks of `block_size` along hidden) + the block's offset
    (the first hidden/block rows of `side`, when `offsets`); the `kept` channels' rows are w
    exactly: side's last rows plus their block's offset. Row t of the embedding is column t of w.
    A portable graph's head stores `side` token-major, [vocab, rows]: TensorRT keeps the head's
    second-product weight once in that layout (`quant_matmul._side_weight`)."""

    file: str  # the file holding it, in the export folder: the graph's data file or EMBEDDINGS_FILE
    bits: int  # 8 or 4
    block_size: int
    offsets: bool
    codes: StoredTensor  # [hidden, vocab] int8, or packed int4 (uint8)
    scale: StoredTensor  # [hidden / block, vocab] float32 or float16
    # [rows, vocab] or token-major [vocab, rows]; rows = (hidden / block if offsets) + kept
    side: StoredTensor | None = None
    kept: StoredTensor | None = None  # [kept] int64

    def side_token_major(self) -> bool:
        """Whether `side` is stored [vocab, rows] (`codes` [hidden, vocab] says which dim is vocab)."""
        vocab = self.codes.shape[1]
        return self.side is not None and self.side.shape[0] == vocab != self.side.shape[1]

    def side_rows(self) -> int:
        """How many rows `side` holds: the blocks' offsets (where `offsets`), then the kept channels."""
        if self.side is None:
            return 0
        return self.side.shape[1] if self.side_token_major() else self.side.shape[0]


@dataclass(frozen=True)
class PerLayerTable:
    """Gemma 4's per-layer embeddings (PLE), kept out of the graph: a table [rows, layers x P]
    (rows: vocab_size_per_layer_input; already times sqrt(P), as transformers scales it) in
    PER_LAYER_FILE, numpy's .npy format (a header, then the rows, C order), which the runtime maps
    read-only and reads one row of per token (`kvedge.runtime.embeddings.PerLayerRows`): only the
    pages of the tokens seen become resident, page cache the kernel may drop, never GPU memory.
    The graph takes the rows as `per_layer_inputs` [batch, seq, layers x P] float32 (a float16
    graph narrows them itself: its table is float16 already)."""

    file: str  # PER_LAYER_FILE
    dtype: str  # a PER_LAYER_DTYPES value: float32 for float32 weights, else float16
    shape: tuple[int, int]  # [rows, layers x P]
    sha256: str  # of its first STORED_CHECK_BYTES bytes: a rewritten file is refused at load


@dataclass(frozen=True)
class GraphInterface:
    """Which inputs and outputs an exported graph has, with their types and shapes: decided here
    once, from the manifest's variant, logits mode and geometry. The exporter declares the graph's
    inputs and outputs from it, the backends check and bind against it.

    Inputs: input_ids [batch, seq]; inputs_embeds [batch, seq, hidden] (where the runtime looks
    the embeddings up: `embeds`); position_ids [batch, seq] (not in place variants: in-place
    graphs take positions from past_lengths); past_lengths [batch]; last_index [batch] (logits
    "last") or [batch, rows] (logits "rows"); per layer, past K, V [batch, kv_heads, L,
    head_dim] in the cache dtype, and for int8 caches K, V scales [batch, kv_heads, L, groups]
    float16, where L = `geometry.layer_len` (max_len, or ring_len for a ring layer).
    Outputs: logits [batch, 1 | rows | seq, vocab] float32 (logits "last" | "rows" | "all");
    per layer, present tensors like the past ones, of length seq (the new tokens, portable) or L
    (the past buffer, in place).

    The dtypes do not depend on the graph's precision beyond the cache dtype it is exported with
    (`export_kv_dtypes`): a float16 graph (`Manifest.precision`) takes and gives its cache as
    float16 (or int8 codes and float16 scales) and widens its logits to float32 at the output,
    so the runtime binds every export alike.
    """

    names: IONames
    geometry: CacheGeometry
    variant: str
    logits: str
    vocab_size: int
    hidden_size: int = 0
    # the inputs_embeds input's dtype ("float32", "float16"), where the runtime looks the
    # embeddings up (`EmbeddingTable`); "": the graph gathers them from input_ids
    embeds: str = ""
    # the per_layer_inputs input's width (layers x P, Gemma 4's per-layer embeddings, float32 at
    # every precision); 0: none
    per_layer: int = 0

    @property
    def in_place(self) -> bool:
        return self.variant in IN_PLACE_VARIANTS

    def inputs(self) -> tuple[TensorSpec, ...]:
        names, int64 = self.names, np.dtype(np.int64)
        specs = [TensorSpec(names.input_ids, int64, ("batch", "seq"))]
        if self.embeds:
            dims = ("batch", "seq", self.hidden_size)
            specs.append(TensorSpec(names.inputs_embeds, np.dtype(self.embeds), dims))
        if self.per_layer:
            dims = ("batch", "seq", self.per_layer)
            specs.append(TensorSpec(names.per_layer_inputs, np.dtype(np.float32), dims))
        if not self.in_place:
            specs.append(TensorSpec(names.position_ids, int64, ("batch", "seq")))
        specs.append(TensorSpec(names.past_lengths, int64, ("batch",)))
        if self.logits == "last":
            specs.append(TensorSpec(names.last_index, int64, ("batch",)))
        elif self.logits == "rows":
            specs.append(TensorSpec(names.last_index, int64, ("batch", "rows")))
        for i in range(self.geometry.num_layers):
            specs += self._cache(names.cache_past(self.geometry), i, self.geometry.layer_len(i))
        if self.geometry.states:
            specs.append(TensorSpec(names.input_lengths, int64, ("batch",)))
            specs += self.states(names.past_state)
        return tuple(specs)

    def states(self, template: str) -> list[TensorSpec]:
        """Every state layer's tensor named by `template` (`IONames.past_state` / `present_state`):
        [batch, *shape], its `layer` the model layer."""
        return [
            TensorSpec(self.names.state(template, s.kind, i), s.np_dtype, ("batch", *s.shape), i, state=True)
            for s in self.geometry.states
            for i in s.layers
        ]

    def outputs(self) -> tuple[TensorSpec, ...]:
        logits_len = {"last": 1, "rows": "rows"}.get(self.logits, "seq")
        specs = [TensorSpec(self.names.logits, np.dtype(np.float32), ("batch", logits_len, self.vocab_size))]
        for i in range(self.geometry.num_layers):
            length = self.geometry.layer_len(i) if self.in_place else "seq"
            specs += self._cache(self.names.cache_present(self.geometry), i, length)
        specs += self.states(self.names.present_state)
        return tuple(specs)

    def _cache(self, templates: tuple[str, ...], layer: int, length: Dim) -> list[TensorSpec]:
        """One layer's cache tensors named by `templates` (`IONames.past` / `present` order)."""
        g = self.geometry
        if g.packed:  # int4: codes and scales of max_len positions, windows of window_len
            return [
                TensorSpec(
                    self.names.layer(template, layer),
                    dtype,
                    ("batch", g.num_kv_heads, length if positions == g.max_len else positions, last),
                    layer,
                )
                for template, (dtype, positions, last) in zip(templates, g.packed_parts(layer), strict=True)
            ]
        d, groups = g.layer_head_dim(layer), g.layer_scale_groups(layer)
        kinds = [(g.np_dtype, d)] * 2 + [(np.dtype(KV_SCALE_DTYPE), groups)] * 2
        return [
            TensorSpec(
                self.names.layer(template, layer), dtype, ("batch", g.num_kv_heads, length, last), layer
            )
            for template, (dtype, last) in zip(templates, kinds, strict=False)
        ]


@dataclass(frozen=True)
class RopeSpec:
    """What positions mean to the graph: the tables are baked in, this records how.

    `inv_freq` [head_dim/2] are the rotation frequencies the tables were made from; the runtime
    uses them to re-rotate cached keys when a sliding window moves them to new positions.
    `unrotated_layers` are layers whose keys carry no position (SmolLM3's NoPE layers): moving
    them must leave them as they are.
    """

    theta: float
    rope_type: str
    scaling: dict[str, Any] = field(default_factory=dict)
    inv_freq: tuple[float, ...] = ()
    attention_scaling: float = 1.0
    unrotated_layers: tuple[int, ...] = ()
    # Gemma 3: the sliding-window layers' RoPE has its own base; `inv_freq` is the other layers'
    local_layers: tuple[int, ...] = ()
    local_inv_freq: tuple[float, ...] = ()

    def key_frequencies(self, num_layers: int) -> np.ndarray:
        """Frequencies each layer's cached keys were rotated with: [layers, 1, 1, head_dim/2]
        float64, broadcasting over (kv_heads, tokens) of the cache; rows of unrotated layers are 0
        (a rotation by angle 0 is the identity, exactly), rows of local layers `local_inv_freq`."""
        freqs = np.tile(np.asarray(self.inv_freq, np.float64), (num_layers, 1))
        if self.local_layers:
            freqs[list(self.local_layers)] = np.asarray(self.local_inv_freq, np.float64)
        freqs[list(self.unrotated_layers)] = 0.0
        return freqs[:, None, None, :]


@dataclass(frozen=True)
class Manifest:
    """Description of an exported artifact folder (`manifest.json`)."""

    architecture: str
    model_type: str
    source: str
    source_fingerprint: str
    geometry: CacheGeometry
    vocab_size: int
    hidden_size: int
    num_heads: int
    opset: int
    logits: str  # a LOGITS_MODES value
    eos_token_ids: tuple[int, ...]
    rope: RopeSpec
    onnx_fingerprint: str
    names: IONames = IONames()
    weights_dtype: str = "float32"  # a WEIGHT_FORMATS key: "float32", "float16", "int8" or "int4"
    weight_block_size: int = 0  # quantization block size; 0 for float32 and float16
    # input channels per quantized matmul kept float32, and the quantized LM head's bits; 0 for
    # float32 and float16; None: not recorded (exported before kvedge recorded them)
    weight_outlier_channels: int | None = None
    weight_head_bits: int | None = None
    # --decode-matmuls (DECODE_MATMULS) of an ort int8/int4 graph over a CPU cache; "" where it
    # does not apply; None: exported before kvedge recorded it (one form: "onnxruntime")
    weight_decode_matmuls: str | None = None
    # the longest step (tokens per row) the decode form of a two-form graph runs (its If: steps
    # of up to this many tokens), VERIFY_TOKENS; 0 where there is no decode form; None: exported
    # before kvedge recorded it, when the decode form took one-token steps only
    decode_form_tokens: int | None = None
    # matrices the graph stores as the source's own blocks, not quantized again, by the source's
    # type: {"Q4_1": 210, "Q8_0": 1} from SmolLM2's GGUF; {} where the export quantized every one
    # (a float source or float weights) or was made before kvedge kept them (same format version:
    # a fact about the weights, which a reader needs nothing of to run the graph)
    weight_source_blocks: dict[str, int] = field(default_factory=dict)
    variant: str = "portable"  # graph variant, see VARIANTS
    # the dtype the graph computes in (PRECISIONS); manifests written before the field existed
    # load as "float32" (same format version: the graph's interface says all a reader binds)
    precision: str = "float32"
    chat_template: bool = False
    special_tokens: dict[str, str] = field(default_factory=dict)  # chat template variables
    # the embeddings the runtime looks up (quantized graphs with a tied LM head); None: the
    # graph gathers them from its own table
    embedding: EmbeddingTable | None = None
    # Gemma 4's per-layer embeddings, which the runtime maps and feeds; None: the model has none
    per_layer: PerLayerTable | None = None
    format: str = MANIFEST_FORMAT
    format_version: int = MANIFEST_VERSION
    kvedge_version: str = __version__

    @property
    def in_place(self) -> bool:
        """True when the graph writes new K/V into the bound past buffers itself."""
        return self.variant in IN_PLACE_VARIANTS

    @property
    def interface(self) -> GraphInterface:
        embeds = "" if self.embedding is None else ("float16" if self.precision == "float16" else "float32")
        return GraphInterface(
            self.names,
            self.geometry,
            self.variant,
            self.logits,
            self.vocab_size,
            self.hidden_size,
            embeds,
            0 if self.per_layer is None else self.per_layer.shape[1],
        )

    def verify_refusal(self) -> str | None:
        """Why this graph cannot verify a speculative step (logits at several positions of a
        row in one call) giving the greedy replies of one-token decode steps, or None."""
        if self.logits not in ("rows", "all"):
            return (
                "speculative decoding needs logits at every proposed position, which this export's "
                f"--logits {self.logits!r} graph does not return; re-export it (default --logits rows)"
            )
        if self.variant == "ort" and self.weights_dtype in ("int8", "int4"):
            return self._quantized_verify_refusal()
        return None

    def _quantized_verify_refusal(self) -> str | None:
        """An ort graph with blocked integer weights quantizes each matmul's activations to int8,
        where a sum rounded another way can move an output by a whole int8 level and a greedy
        reply part at a near tie (docs/design/speculative-decoding.md, "Exact verifies"). Its
        verify is exact only where every op computes a verify's rows as decode steps compute
        them, to the bit: the decode form's kvedge.QuantMatMul (`decode_form_tokens`) and the
        INT8 cache's attention; onnxruntime's MatMulNBits and GroupQueryAttention add up one row
        and several differently, and so may the standard-op attention of Gemma 4's shared-KV
        layers (`kvedge.export.graph.inplace.SharedReads`: its MatMuls' shapes follow the step's)."""
        if self.weight_decode_matmuls != "kvedge":
            why = "its decode steps run onnxruntime's MatMulNBits, which rounds one row and several apart"
        elif (self.decode_form_tokens or 1) < VERIFY_TOKENS:
            why = "it was exported before its decode form took verify steps (re-export it)"
        elif not self.geometry.quantized:
            why = (
                f"onnxruntime's GroupQueryAttention over its {self.geometry.dtype} cache adds up one "
                "new token and several differently (export with --kv-dtype int8: kvedge's attention)"
            )
        elif self.geometry.shared_layers:
            why = (
                "its shared-KV layers' attention (standard ops) adds up one new token and several differently"
            )
        else:
            return None
        return (
            f"speculative decoding is off for this --variant ort --weights {self.weights_dtype} export: "
            f"{why}, so a greedy reply could differ from one decoded token by token at a near tie; "
            "the portable variant, float weights, and --variant ort --weights int8|int4 --kv-dtype int8 "
            "(--decode-matmuls kvedge) speculate"
        )

    def graph_inputs(self) -> tuple[TensorSpec, ...]:
        """The graph's inputs, in graph order (`GraphInterface`)."""
        return self.interface.inputs()

    def graph_outputs(self) -> tuple[TensorSpec, ...]:
        """The graph's outputs, in graph order (`GraphInterface`)."""
        return self.interface.outputs()

    @property
    def uses_kvedge_ops(self) -> bool:
        """True when the graph needs kvedge's kernel library (`kvedge.runtime.kernels`)."""
        decode = self.weight_decode_matmuls or "onnxruntime"
        return bool(kvedge_ops(self.variant, self.geometry.dtype, self.weights_dtype, decode))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest") -> Manifest:
        """`data` (manifest.json, decoded) as a Manifest: format and version first, then every
        field's type (`kvedge.contract.header`); ArtifactMismatch naming what is wrong."""
        kind = Header(MANIFEST_FORMAT, MANIFEST_VERSION)
        manifest = read_artifact(data, cls, kind, where, "re-export the model")
        if manifest.variant not in VARIANTS:
            raise ArtifactMismatch(
                f"{where}: graph variant {manifest.variant!r} is unknown to this kvedge "
                f"(knows {sorted(VARIANTS)}); upgrade kvedge or re-export the model"
            )
        if manifest.precision not in PRECISIONS:
            raise ArtifactMismatch(
                f"{where}: graph precision {manifest.precision!r} is unknown to this kvedge "
                f"(knows {list(PRECISIONS)}); upgrade kvedge or re-export the model"
            )
        return manifest

    @classmethod
    def load(cls, folder: Path) -> Manifest:
        path = Path(folder) / MANIFEST_FILE
        if not path.is_file():
            raise KvedgeError(f"{folder}: no {MANIFEST_FILE}; is this a `kvedge export` folder?")
        return cls.from_dict(decode_json(path.read_bytes(), str(path)), where=str(path))

    def check_compatible(
        self, other: Manifest, what: str, cache_dtype: bool = True, weights: bool = True
    ) -> None:
        """Refuse `other` (describing `what`) unless it was made from the same model and geometry
        (with `cache_dtype=False`, the geometry may differ in its cache dtype only; with
        `weights=False`, the weights may be quantized differently)."""
        if other.source_fingerprint != self.source_fingerprint:
            raise ArtifactMismatch(
                f"{what} was made from model {other.source_fingerprint[:16]}, "
                f"this model is {self.source_fingerprint[:16]}"
            )
        if weights and other.weights_dtype != self.weights_dtype:
            raise ArtifactMismatch(
                f"{what} was made with {other.weights_dtype} weights, "
                f"this model has {self.weights_dtype} weights"
            )
        mine = (
            self.geometry
            if cache_dtype
            else self.geometry.with_dtype(
                other.geometry.dtype, other.geometry.group_size or None, other.geometry.key8_layers
            )
        )
        if other.geometry != mine:
            raise ArtifactMismatch(
                f"{what} has cache geometry {other.geometry.to_dict()}, "
                f"this model has {self.geometry.to_dict()}"
            )


def graph_files(folder: Path) -> list[Path]:
    """The files an export's graph fingerprint (`Manifest.onnx_fingerprint`) covers, those
    present of: model.onnx, model.onnx.data, an untied model's embeddings.bin and Gemma 4's
    per-layer table."""
    names = (ONNX_FILE, ONNX_FILE + ".data", EMBEDDINGS_FILE, PER_LAYER_FILE)
    return [Path(folder) / name for name in names if (Path(folder) / name).is_file()]


def sha256_files(paths: Iterable[Path], chunk: int = 1 << 22) -> str:
    """Fingerprint of the bytes of `paths`, in the order given (names are not hashed)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(chunk):
                digest.update(block)
    return digest.hexdigest()
