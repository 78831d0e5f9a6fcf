"""The state dict in the layout the graph is built from: where the families differ before any
attention variant sees the weights (fused projections, partial rotary, Gemma 3's norms, the
softmax scale folded into Wq).
"""

from __future__ import annotations

import numpy as np

from kvedge.contract import CacheGeometry
from kvedge.export.graph.options import DecoderSpec
from kvedge.export.graph.rope import rotary_order


def prepare_weights(
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
    order = rotary_order(d, spec.rotary_dim)
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
