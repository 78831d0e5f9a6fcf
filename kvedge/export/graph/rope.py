"""RoPE: the cos/sin tables, the channel order that makes partial rotary full rotary over a permuted
head, and the rotation in graph ops (HF's rotate_half convention).
"""

from __future__ import annotations

import numpy as np

from kvedge.errors import KvedgeError
from kvedge.export.graph.builder import Builder


def rotary_frequencies(inv_freq: np.ndarray, head_dim: int) -> np.ndarray:
    """The model's frequencies [rotary_dim/2] widened to [head_dim/2] with zeros.

    Partial rotary (HF rotates channel pairs (i, i + r/2) of the first r = rotary_dim channels and
    passes the rest through) is exported as full rotary over a permuted head: `prepare_weights`
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


def rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray | None:
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


def position_angles(g: Builder, positions: str, cos_table: str, sin_table: str, name: str) -> tuple[str, str]:
    """cos, sin of the new tokens' `positions` [b, s] from tables [L, d/2] -> [b, 1, s, d/2] each."""
    return tuple(
        g.op(
            "Unsqueeze",
            [g.op("Gather", [table, positions], f"{name}.pos_{kind}", axis=0), g.ints(1)],
            f"{name}.{kind}4",
        )
        for kind, table in (("cos", cos_table), ("sin", sin_table))
    )


def rotate_half(g: Builder, x: str, cos4: str, sin4: str, half_split: str, name: str) -> str:
    """x [b, n, s, d] rotated by angles [b, 1, s, d/2] (HF's rotate_half convention; `half_split`
    is the shared [d/2, d/2] constant)."""
    x1, x2 = g.op("Split", [x, half_split], f"{name}.halves", outputs=2, axis=-1)
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
