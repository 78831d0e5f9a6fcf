"""The 4-bit KV cache of kvedge.Int4CacheAttention: its form, its packing, and a numpy reference.

The form the 4-bit cache study found best (docs/PERFORMANCE.md, "The KV cache at long context",
its figures built and simulated). Per attention layer and KV head, head_dim d a power of 2
(>= 16), Hr = `kvedge.quant.hadamard(d)` (orthonormal, symmetric), every vector a row:

    kr = RoPE(k) @ Hr,  vr = v @ Hr,  qr = RoPE(q) @ Hr       (qr . kr = q . k)
    f16(x) = round to float16;  FLOOR = 2**-14;  MULTS = linspace(0.35, 1.0, 24) (float32)

Keys, `key_bits` 5 (one float16 scale per token and head, levels u - 15.5, u in 0..31): for each
m in MULTS in order

    s   = f16(max(absmax(kr) * m / 15.5, FLOOR))
    u   = clip(ceil(kr / s) + 15, 0, 31)            the nearest level; a tie goes to the lower
    err = sum(((u - 15.5) s - kr)^2)                float32

and the first m with the strictly smallest err is kept. Keys, `key_bits` 8 (one scale per group
of g = min(32, d) channels, no search): s = f16(max(absmax(group) / 127.5, FLOOR)), u =
clip(ceil(kr / s) + 127, 0, 255), value (u - 127.5) s.

Values (one scale per token and head): the 16 Lloyd-Max levels of N(0, 1), LEVELS_V, and the
same 24-multiplier search with s = f16(max(absmax(vr) * m / LEVELS_V[15], FLOOR)); code = the
number of midpoints (LEVELS_V[i] + LEVELS_V[i + 1]) / 2 strictly below vr / s; value
LEVELS_V[code] s.

Rows in memory, per token and KV head (uint8):

    4 bits (V)   d / 2 bytes: byte i = code[2i] | code[2i + 1] << 4
    5 bits (K)   those d / 2 bytes of the low 4 bits, then d / 8 bytes: bit t of byte i is bit 4
                 of code[8i + t]  (5d / 8 bytes)
    8 bits (K)   d bytes, byte i = u[i]

Attention: the query at position p attends to the keys j <= p (and j > p - local_window_size
when that is set). Key and value j are the float kr_j, vr_j when j >= p - window (the `window`
positions before p, and p itself), else the dequantized codes; output = softmax(qr . k_j) v_j @
Hr^T. The float rows of the past sit in a ring of R >= window positions, position j at j % R.
Every new token's codes are written at its position; then the last min(s, R) new tokens' kr, vr
go into their ring slots (after the call's attention read the old ones).

`attend` is the reference of the whole op, the kernel's numpy twin (tests/test_kv4.py).
"""

from __future__ import annotations

import numpy as np

from kvedge.quant import SCALE_FLOOR, hadamard

# the study's lloyd_max(16): Lloyd-Max levels for N(0, 1), exactly symmetric
LEVELS_V = np.array(
    [0.128507301, 0.388355941, 0.65720135, 0.94286567, 1.25681007, 1.61865211, 2.06959891, 2.73308468],
    np.float32,
)
LEVELS_V = np.concatenate([-LEVELS_V[::-1], LEVELS_V])
MIDPOINTS_V = (LEVELS_V[1:] + LEVELS_V[:-1]) / np.float32(2)
MULTS = np.linspace(0.35, 1.0, 24, dtype=np.float32)
KEY_BITS = (5, 8)
KEY_GROUP_8BIT = 32  # channels per scale of 8-bit keys (all of them when head_dim is smaller)


def row_bytes(d: int, bits: int) -> int:
    """Bytes of one token's row of `d` codes at `bits` (4: values, 5 or 8: keys)."""
    return {4: d // 2, 5: 5 * d // 8, 8: d}[bits]


def key_groups(d: int, bits: int) -> int:
    """Float16 scales per token and KV head of keys at `bits`."""
    return 1 if bits == 5 else d // min(KEY_GROUP_8BIT, d)


def f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., d] (0 .. 2^bits - 1) -> packed rows [..., row_bytes(d, bits)] uint8."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return codes
    nibbles = (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)
    if bits == 4:
        return nibbles
    high = ((codes >> 4) & 1).reshape(*codes.shape[:-1], -1, 8)
    return np.concatenate([nibbles, (high << np.arange(8, dtype=np.uint8)).sum(-1, dtype=np.uint8)], -1)


def unpack(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    """Inverse of `pack`: packed rows [..., row_bytes(d, bits)] -> codes [..., d] uint8."""
    if bits == 8:
        return packed.astype(np.uint8)
    codes = np.stack([packed[..., : d // 2] & 15, packed[..., : d // 2] >> 4], -1).reshape(
        *packed.shape[:-1], d
    )
    if bits == 5:
        high = (packed[..., d // 2 :, None] >> np.arange(8, dtype=np.uint8)) & 1
        codes |= high.reshape(*packed.shape[:-1], d) << 4
    return codes


def _searched(x: np.ndarray, cmax: float, rounding) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales [..., 1]) of x [..., d]: the first of MULTS with the least squared error;
    rounding(x, s) -> (codes, values)."""
    amax = np.abs(x).max(-1, keepdims=True)
    best = None
    for m in MULTS:
        s = f16(np.maximum(amax * m / np.float32(cmax), SCALE_FLOOR))
        codes, values = rounding(x, s)
        err = ((values - x) ** 2).sum(-1, keepdims=True, dtype=np.float32)
        if best is None:
            best = [codes, s, err]
        else:
            better = err < best[2]
            best = [
                np.where(better, codes, best[0]),
                np.where(better, s, best[1]),
                np.where(better, err, best[2]),
            ]
    return best[0], best[1]


def _keys5(x: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    u = np.clip(np.ceil(x / s) + 15, 0, 31)
    return u, (u - np.float32(15.5)) * s


def _values4(x: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    codes = np.searchsorted(MIDPOINTS_V, x / s)  # side "left": midpoints strictly below
    return codes, LEVELS_V[codes] * s


def quantize_keys(kr: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """kr [..., d] float32 (rotated) -> (codes [..., row_bytes(d, bits)] uint8, scales [...,
    key_groups(d, bits)] float16)."""
    kr = np.asarray(kr, np.float32)
    d = kr.shape[-1]
    if bits == 5:
        u, s = _searched(kr, 15.5, _keys5)
        return pack(u, 5), s.astype(np.float16)
    g = min(KEY_GROUP_8BIT, d)
    x = kr.reshape(*kr.shape[:-1], d // g, g)
    s = f16(np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(127.5), SCALE_FLOOR))
    u = np.clip(np.ceil(x / s) + 127, 0, 255).reshape(kr.shape)
    return pack(u, 8), s[..., 0].astype(np.float16)


def quantize_values(vr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vr [..., d] float32 (rotated) -> (codes [..., d / 2] uint8, scales [..., 1] float16)."""
    codes, s = _searched(np.asarray(vr, np.float32), LEVELS_V[-1], _values4)
    return pack(codes, 4), s.astype(np.float16)


def dequantize_keys(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """Packed key rows [..., row_bytes] and scales [..., groups] float16 -> kr' [..., d] float32."""
    d = codes.shape[-1] * 8 // 5 if bits == 5 else codes.shape[-1]
    u = unpack(codes, bits, d).astype(np.float32) - np.float32(15.5 if bits == 5 else 127.5)
    return u * np.repeat(scales.astype(np.float32), d // scales.shape[-1], axis=-1)


def dequantize_values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Packed value rows [..., d / 2] and scales [..., 1] float16 -> vr' [..., d] float32."""
    return LEVELS_V[unpack(codes, 4, 2 * codes.shape[-1])] * scales.astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [..., d] rotated by cos, sin [..., d / 2] (rotate_half), in float32 as the kernel."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(np.float32)


def attend(
    qkv: np.ndarray,  # [b, s, (heads + 2 kv_heads) d] float32
    past_lengths: np.ndarray,  # [b] int64
    k_codes: np.ndarray,  # [b, kv_heads, L, row_bytes(d, key_bits)] uint8
    k_scales: np.ndarray,  # [b, kv_heads, L, key_groups(d, key_bits)] float16
    v_codes: np.ndarray,  # [b, kv_heads, L, d / 2] uint8
    v_scales: np.ndarray,  # [b, kv_heads, L, 1] float16
    k_window: np.ndarray,  # [b, kv_heads, R, d] float32, kr of position j at j % R
    v_window: np.ndarray,  # [b, kv_heads, R, d] float32
    cos: np.ndarray,  # [max_positions, d / 2] float32
    sin: np.ndarray,
    *,
    num_heads: int,
    kv_num_heads: int,
    key_bits: int,
    window: int = 32,
    local_window_size: int = -1,
) -> tuple[np.ndarray, ...]:
    """kvedge.Int4CacheAttention in numpy (attention in float64): (attention [b, s, heads d], then
    the six state tensors with the new tokens written), the inputs left unchanged."""
    b, s, _ = qkv.shape
    d, ring = k_window.shape[-1], k_window.shape[2]
    group = num_heads // kv_num_heads
    state = [a.copy() for a in (k_codes, k_scales, v_codes, v_scales, k_window, v_window)]
    kc, ks, vc, vs, kw, vw = state
    hr = hadamard(d)
    x = qkv.astype(np.float32).reshape(b, s, num_heads + 2 * kv_num_heads, d)
    out = np.zeros((b, s, num_heads, d))
    for r in range(b):
        p0 = int(past_lengths[r])
        pos = np.arange(p0, p0 + s)
        if p0 + s > kc.shape[2]:
            raise ValueError(
                f"row {r}: past length {p0} + {s} new tokens does not fit {kc.shape[2]} positions"
            )
        c, sn = cos[pos][:, None], sin[pos][:, None]
        qr = rope(x[r, :, :num_heads], c, sn) @ hr  # [s, heads, d]
        kr = rope(x[r, :, num_heads : num_heads + kv_num_heads], c, sn) @ hr  # [s, kv_heads, d]
        vr = x[r, :, num_heads + kv_num_heads :] @ hr
        new = slice(p0, p0 + s)
        kc[r, :, new], ks[r, :, new] = (a.swapaxes(0, 1) for a in quantize_keys(kr, key_bits))
        vc[r, :, new], vs[r, :, new] = (a.swapaxes(0, 1) for a in quantize_values(vr))
        # [kv_heads, p0 + s, d]: every position as codes, and with the float rows any query reads
        quantized = (
            dequantize_keys(kc[r, :, : p0 + s], ks[r, :, : p0 + s], key_bits).astype(np.float64),
            dequantize_values(vc[r, :, : p0 + s], vs[r, :, : p0 + s]).astype(np.float64),
        )
        floats = tuple(a.copy() for a in quantized)
        for j in range(max(p0 - window, 0), p0 + s):
            past = j < p0
            floats[0][:, j] = k_window[r, :, j % ring] if past else kr[j - p0]
            floats[1][:, j] = v_window[r, :, j % ring] if past else vr[j - p0]
        for t, p in enumerate(pos):
            lo = max(p + 1 - local_window_size, 0) if local_window_size > 0 else 0
            split = max(p - window, lo)  # positions lo .. split - 1 as codes, split .. p float
            k, v = (
                np.concatenate([q[:, lo:split], f[:, split : p + 1]], 1)
                for q, f in zip(quantized, floats, strict=True)
            )
            for head in range(num_heads):
                scores = k[head // group] @ qr[t, head].astype(np.float64)
                w = np.exp(scores - scores.max())
                out[r, t, head] = (w / w.sum()) @ v[head // group] @ hr.T.astype(np.float64)
        for t in range(max(s - ring, 0), s):
            kw[r, :, (p0 + t) % ring], vw[r, :, (p0 + t) % ring] = kr[t], vr[t]
    return (out.reshape(b, s, num_heads * d).astype(np.float32), *state)
