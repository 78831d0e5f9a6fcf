"""The state dict in the layout the graph is built from: where the families differ before any
attention variant sees the weights (fused projections, partial rotary, Gemma 3's norms, the
softmax scale folded into Wq), and which of a quantized source's own blocks the graph keeps.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from kvedge.contract import CacheGeometry, ExportRecipe
from kvedge.export.graph.options import DecoderSpec
from kvedge.export.graph.rope import rotary_order
from kvedge.export.quantize import QuantizedWeight
from kvedge.machine import release_freed_memory

# a float weight in its Hugging Face layout (rows: output features), or blocks [K, N] (`quantize`)
Weight = np.ndarray | QuantizedWeight


# LFM2's names of what other families call by Llama's (the graph is built from Llama's names)
LFM2_NAMES = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    "model.embedding_norm.": "model.norm.",
}


# Qwen3.5's Gated DeltaNet output norm weighs by w, not (1 + w) as its other norms
GATED_NORM = ".linear_attn.norm."


def llama_name(name: str) -> str:
    """`name` (a state-dict key or a Linear's module name) in Llama's terms: LFM2's renamed."""
    for theirs, ours in LFM2_NAMES.items():
        if theirs in f"{name}.":
            return f"{name}.".replace(theirs, ours, 1)[:-1]
    return name


def prepare_weights(
    spec: DecoderSpec, geometry: CacheGeometry, weights: dict[str, Weight]
) -> dict[str, Weight]:
    """`weights` in the layout the graph is built from, per layer:

    - fused projections (Phi-3: `qkv_proj`, `gate_up_proj`) split into the Llama names;
    - partial rotary: Q and K output channels of each head permuted (`rotary_frequencies`), and
      the weights of a per-head Q or K norm (Qwen3.5) with them;
    - Gemma 3's (1 + w) norm weights as plain weights;
    - the softmax scale (head_dim**-0.5, Gemma 3: query_pre_attn_scalar**-0.5) folded into Wq (and
      its bias), or into the Q norm's weight when Q is normed per head (Qwen3, Gemma 3), since the
      norm would undo a scale applied before it. RoPE is linear, so attention needs no scale op.

    A source's kept blocks (`SourceBlocks.kept`) take the same steps: splitting and permuting
    output features leaves every block along K whole, and the softmax scale multiplies each
    block's scale and offset (exact where it is a power of two, as head_dim 64's 1/8; else each
    rounded once, as the float weights are).
    """
    weights = {llama_name(name): w for name, w in weights.items()}
    d, heads, kv_heads = geometry.head_dim, spec.num_heads, geometry.num_kv_heads
    if spec.unit_offset_norms:  # x / rms(x) * (1 + w), in float32 as HF computes it
        for name in [n for n in weights if n.endswith("norm.weight") and GATED_NORM not in n]:
            weights[name] = 1.0 + weights[name].astype(np.float32)
    order = rotary_order(spec.head_dim, spec.rotary_dim)
    for i in range(spec.num_layers or geometry.num_layers):
        p = f"model.layers.{i}"
        for kind in ("weight", "bias"):
            fused = weights.pop(f"{p}.self_attn.qkv_proj.{kind}", None)
            if fused is not None:  # rows: q [heads d], k [kv_heads d], v [kv_heads d]
                parts = _split(fused, [heads * d, (heads + kv_heads) * d])
                for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    weights[f"{p}.self_attn.{name}.{kind}"] = part
            if spec.attention_gate and f"{p}.self_attn.q_proj.{kind}" in weights:
                # Qwen3.5: each head's rows are its query (d), then its output gate (d)
                q_and_gate = weights.pop(f"{p}.self_attn.q_proj.{kind}")
                rows = np.arange(heads * 2 * d).reshape(heads, 2, d)
                weights[f"{p}.self_attn.q_proj.{kind}"] = _take(q_and_gate, rows[:, 0].reshape(-1))
                weights[f"{p}.self_attn.attn_gate.{kind}"] = _take(q_and_gate, rows[:, 1].reshape(-1))
            fused = weights.pop(f"{p}.mlp.gate_up_proj.{kind}", None)
            if fused is not None:  # rows: gate [intermediate], up [intermediate]
                gate, up = _split(fused, [_outputs(fused) // 2])
                weights[f"{p}.mlp.gate_proj.{kind}"], weights[f"{p}.mlp.up_proj.{kind}"] = gate, up
        if order is not None:
            for proj, n in (("q_proj", heads), ("k_proj", kv_heads)):
                per_head = np.arange(n * d).reshape(n, d)[:, order].reshape(-1)  # [n d], permuted per head
                for part in ("weight", "bias"):
                    name = f"{p}.self_attn.{proj}.{part}"
                    if name in weights:
                        weights[name] = _take(weights[name], per_head)
            for norm in ("q_norm", "k_norm"):  # a per-head norm's weights [d] follow its channels
                name = f"{p}.self_attn.{norm}.weight"
                if name in weights:
                    weights[name] = weights[name][order]
        folded = (
            [f"{p}.self_attn.q_norm.weight"]
            if spec.qk_norm
            else [f"{p}.self_attn.q_proj.{part}" for part in ("weight", "bias")]
        )
        for name in folded:
            if name in weights:
                weights[name] = _scaled(weights[name], spec.softmax_scale)
    return weights


LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class LayerWeights(Mapping[str, Weight]):
    """`prepare_weights` of a state dict (`source`: a dict, or one read on each access,
    `kvedge.export.streamed.FolderWeights`) one layer at a time: the layer a name belongs to is
    prepared when a name of it is first asked for and kept until another layer's is, so a graph
    built layer after layer holds one layer's weights; a name outside the layers is prepared on
    each access. Iterating gives the source's names in Llama's terms, before the layout steps."""

    def __init__(self, spec: DecoderSpec, geometry: CacheGeometry, source: Mapping[str, Weight]) -> None:
        self.spec, self.geometry, self.source = spec, geometry, source
        self._raw = {llama_name(name): name for name in source}
        self._layers: dict[int, list[str]] = {}
        for name in source:
            match = LAYER.match(name)
            if match:
                self._layers.setdefault(int(match.group(1)), []).append(name)
        self._held: tuple[int, dict[str, Weight]] = (-1, {})

    def _layer(self, name: str) -> dict[str, Weight] | None:
        match = LAYER.match(name)
        if match is None:
            return None
        i = int(match.group(1))
        if self._held[0] != i:
            self._held = (-1, {})  # the last layer's arrays go before this one's are read
            release_freed_memory()
            raw = {n: self.source[n] for n in self._layers.get(i, [])}
            self._held = (i, prepare_weights(self.spec, self.geometry, raw))
        return self._held[1]

    def __getitem__(self, name: str) -> Weight:
        layer = self._layer(name)
        if layer is not None:
            return layer[name]
        raw = self._raw[name]  # KeyError for a name the source lacks
        return prepare_weights(self.spec, self.geometry, {raw: self.source[raw]})[name]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        layer = self._layer(name)
        return name in layer if layer is not None else name in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def _outputs(w: Weight) -> int:
    return w.q.shape[1] if isinstance(w, QuantizedWeight) else w.shape[0]


def _take(w: Weight, index: np.ndarray | slice) -> Weight:
    """Output features `index` of w: rows of a float weight, columns of blocks."""
    return w.columns(index) if isinstance(w, QuantizedWeight) else w[index]


def _split(w: Weight, at: list[int]) -> list[Weight]:
    edges = [0, *at, _outputs(w)]
    return [_take(w, slice(a, b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _scaled(w: Weight, factor: float) -> Weight:
    return w.scaled(factor) if isinstance(w, QuantizedWeight) else w.astype(np.float32) * factor


def tied_head(spec: DecoderSpec, weights: dict[str, np.ndarray]) -> bool:
    """The LM head is the embedding table (tied, or no lm_head weight stored)."""
    return spec.tie_word_embeddings or "lm_head.weight" not in weights


COMPARED_VALUES = 1 << 22  # a source's blocks dequantized at a time, to compare with the weights


@dataclass(frozen=True)
class SourceBlocks:
    """Which of a quantized source's matrices (a GGUF's blocks, `kvedge.export.gguf_blocks`; an
    AWQ or GPTQ checkpoint's, `kvedge.export.awq_gptq`) the graph stores as they are, and why the
    others are quantized again by the export."""

    kept: Mapping[str, QuantizedWeight]  # HF name -> its blocks [K, N] as the source has them
    types: dict[str, str]  # kept name -> the source's type, e.g. "Q4_1"
    requantized: dict[str, str]  # HF name -> why its blocks are not kept

    def kept_types(self) -> dict[str, int]:
        """{source type: matrices kept}, as the manifest records them (`weight_source_blocks`)."""
        return dict(sorted(Counter(self.types.values()).items()))

    def summary(self) -> str:
        """One line: how many matrices were kept, by type, and which were requantized and why."""
        total = len(self.kept) + len(self.requantized)
        counts = ", ".join(f"{kind} {n}" for kind, n in self.kept_types().items())
        line = f"kept {len(self.kept)} of {total} quantized matrices as the source's blocks"
        line += f" ({counts or 'none'})"
        by_reason: dict[str, list[str]] = {}
        for name, why in self.requantized.items():
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            more = f" and {len(names) - 2} more" if len(names) > 2 else ""
            line += f"; requantized {len(names)} ({', '.join(names[:2])}{more}): {why}"
        return line


def source_blocks(
    spec: DecoderSpec,
    blocks: Mapping[str, Weight],
    types: dict[str, str],
    weights: dict[str, np.ndarray],
    options: ExportRecipe,
) -> SourceBlocks:
    """The source's `blocks` (HF names; `types`: their source types) the graph keeps: each matrix it
    quantizes (the projections at the recipe's bits, the LM head at `lm_head_bits`) whose blocks
    have those bits and the recipe's block size, or a multiple of it (split, exactly: an AWQ
    checkpoint's groups of 128 are kept at the default --block-size 32), and dequantize to the
    float weight the export reads (`weights`: transformers' dequantization of the same file; a
    name or layout mapped wrongly would be caught here and requantized, not kept)."""
    head = "model.embed_tokens.weight" if tied_head(spec, weights) else "lm_head.weight"
    projections = [  # LFM2's feed_forward.w1 is Llama's mlp.gate_proj, ...
        n for n in weights if n.startswith("model.layers.") and llama_name(n).endswith("_proj.weight")
    ]
    wanted = {**dict.fromkeys(projections, options.bits), head: options.lm_head_bits}
    kept, requantized = [], {}
    for name, bits in wanted.items():
        qw = KeptBlocks(blocks, [name], options.block_size).get(name)
        why = _why_requantized(qw, types.get(name, "float"), weights[name], bits, options.block_size)
        if why:
            requantized[name] = why
        else:
            kept.append(name)
    return SourceBlocks(
        KeptBlocks(blocks, kept, options.block_size), {n: types[n] for n in kept}, requantized
    )


class KeptBlocks(Mapping[str, Weight]):
    """`names` of a source's `blocks` (read on each access where they are: `gguf_blocks.GgufBlocks`)
    with blocks of a multiple of `block_size` split to it, exactly (`QuantizedWeight.split`)."""

    def __init__(self, blocks: Mapping[str, Weight], names: list[str], block_size: int) -> None:
        self.blocks, self.names, self.block_size = blocks, names, block_size

    def __getitem__(self, name: str) -> Weight:
        if name not in self:
            raise KeyError(name)
        qw = self.blocks[name]
        if isinstance(qw, QuantizedWeight) and qw.block_size % self.block_size == 0:
            qw = qw.split(self.block_size)
        return qw

    def __contains__(self, name: object) -> bool:  # without reading it
        return name in self.names and name in self.blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _why_requantized(qw: Weight | None, kind: str, w: np.ndarray, bits: int, block_size: int) -> str:
    """Why blocks `qw` of source type `kind` cannot stand for float weight w [N, K] in a graph
    that stores it at `bits` in blocks of `block_size`; "" where they can."""
    if not isinstance(qw, QuantizedWeight):
        return f"{kind} has no kvedge block form"
    if (qw.bits, qw.block_size) != (bits, block_size):
        return (
            f"{kind} is {qw.bits}-bit blocks of {qw.block_size}, the graph stores {bits}-bit blocks "
            f"of {block_size}"
        )
    if qw.q.shape != w.shape[::-1]:
        return f"{kind} blocks hold [{qw.q.shape[1]}, {qw.q.shape[0]}], the weight is {list(w.shape)}"
    # within one rounding of an offset (`gguf_blocks`), with room; a mapping error is of |w|'s order;
    # compared a few columns at a time: an LM head's table is gigabytes in float32
    k, n = qw.q.shape
    columns = max(1, COMPARED_VALUES // k)
    error = 0.0
    for start in range(0, n, columns):
        part = slice(start, start + columns)
        error = max(error, float(np.abs(qw.columns(part).dequantize() - w[part].T).max()))
    if error > 2.0**-20 * float(np.abs(w).max()):
        return f"{kind} blocks dequantize {error:.3g} away from the weights transformers reads"
    return ""
