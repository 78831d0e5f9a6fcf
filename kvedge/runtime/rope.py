"""Re-rotating cached keys when a sliding window moves them to new positions.

Cached keys are stored after RoPE. RoPE rotates each channel pair (x1, x2) = (k[i], k[i + d/2])
by the angle p * f_i (HF rotate_half layout, f = inv_freq from the manifest). Rotations compose,
so a key written at position p is moved to position p + delta by one more rotation:

    x1' = x1 cos(delta f) - x2 sin(delta f)
    x2' = x2 cos(delta f) + x1 sin(delta f)

This equals computing the key at p + delta directly (up to fp32 rounding, ~1e-7 relative),
which is what makes window eviction exact against a fresh run over the kept tokens. Any
attention scaling (YaRN) was applied once at write time and is not applied again.
"""

from __future__ import annotations

import numpy as np


def rotate_keys(keys: np.ndarray, delta: int, inv_freq: np.ndarray) -> None:
    """Rotate `keys` [..., head_dim] in place by `delta` positions. `inv_freq` [head_dim/2], or
    any shape broadcasting against keys[..., :head_dim/2], e.g. per layer [layers, 1, 1, d/2]
    (`RopeSpec.key_frequencies`) for keys [layers, kv_heads, n, d]."""
    half = keys.shape[-1] // 2
    angle = delta * inv_freq.astype(np.float64)  # [..., head_dim/2]
    cos, sin = np.cos(angle).astype(keys.dtype), np.sin(angle).astype(keys.dtype)
    x1, x2 = keys[..., :half].copy(), keys[..., half:].copy()
    keys[..., :half] = x1 * cos - x2 * sin
    keys[..., half:] = x2 * cos + x1 * sin
