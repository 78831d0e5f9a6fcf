"""~4-bit KV cache schemes simulated on the float32 cache (issue 57, part 1; see README.md).

    python study.py CONTEXT TOKENS NAME[,NAME...] [FLOAT32_EXPORT]

NAME is a key of SCHEMES; NAME@R keeps the last R positions float32 until they leave that window
(counted in the bytes at CONTEXT + TOKENS positions). Each scheme fake-quantizes every block of
K/V [layers, 2, kv_heads, n, head_dim] as the cache commits it (`KVCache.round_trip`), and
eval-kv's teacher-forced machinery (`kvedge.calibrate.evaluate`) compares it with the float32
cache, as the kv-long study (bench/results/2026-12-07-12c59ab-kv-long-cpu/study.py) did.

Quantizers (all on a head's 64 channels, optionally after the orthonormal Hadamard rotation H):
  codebook   16 levels c_j times one float16 scale s per group of g channels of a token;
             levels "lm" (Lloyd-Max for N(0,1)), "uni" (uniform mid-rise, -7.5..7.5), "uni15"
             (uniform mid-tread -7..7, the kv-long study's "sym"); scale rule "max" (max|x| on
             the outermost level), "rms" (s = RMS of the group), "mse" (s searched per group
             over 24 multipliers of max|x|/c_max, the one with the least squared error, stored
             float16).
  asym       16 uniform levels lo..hi per group, float16 lo and step (4/g bytes a value); "mse"
             searches a shrink of [lo, hi] about its centre.
  prerope    keys: RoPE undone with their positions (HF rotate_half, the manifest's inv_freq),
             quantized per channel, RoPE re-applied. Per-channel scales are static (calibrated
             on the 68 calibration prompts, pre-RoPE, per layer/head/channel min and max) or over
             aligned blocks of T tokens (KIVI). Optional dense-and-sparse: the top-k magnitudes
             of each token's head (pre-RoPE, after removing the channel offset) kept float16
             with an int16 index (4 bytes each).
"""

import os
import sys

import numpy as np

from kvedge.calibrate import evaluate as ev
from kvedge.calibrate.calibrate import builtin_prompts, document_prompts, prompt_ids
from kvedge.quant import hadamard
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import prefill
from kvedge.runtime.model import Model

D = 64
H = hadamard(D)
F16 = np.float16


def f16(x):
    return np.asarray(x, np.float32).astype(F16).astype(np.float32)


def lloyd_max(n=16, iters=300):
    """Lloyd-Max levels for N(0,1) (numerically, on a fine grid)."""
    x = np.linspace(-6, 6, 240001)
    w = np.exp(-0.5 * x * x)
    c = np.linspace(-2.5, 2.5, n)
    for _ in range(iters):
        edges = (c[1:] + c[:-1]) / 2
        idx = np.searchsorted(edges, x)
        c = np.array([np.sum(w[idx == j] * x[idx == j]) / np.sum(w[idx == j]) for j in range(n)])
    return ((c - c[::-1]) / 2).astype(np.float32)  # exactly symmetric


LEVELS = {
    "lm": lloyd_max(16),
    "lm8": lloyd_max(8),
    "lm32": lloyd_max(32),
    "lm4": lloyd_max(4),
    "uni64": np.arange(-31.5, 32.0, 1.0, dtype=np.float32),
    "uni32": np.arange(-15.5, 16.0, 1.0, dtype=np.float32),
    "uni": np.arange(-7.5, 8.0, 1.0, dtype=np.float32),
    "uni15": np.arange(-7.0, 8.0, 1.0, dtype=np.float32),
    "uni8": np.arange(-3.5, 4.0, 1.0, dtype=np.float32),
    "uni256": np.arange(-127.5, 128.0, 1.0, dtype=np.float32),
}
MULTS = np.linspace(0.35, 1.0, 24, dtype=np.float32)


def nearest(u, levels):
    """levels[argmin |u - levels|] for a sorted codebook."""
    edges = (levels[1:] + levels[:-1]) / 2
    return levels[np.searchsorted(edges, u)]


def codebook(x, levels, g, rule):
    """x [..., d] -> fake-quantized: 16 (or len(levels)) levels times a float16 scale per g channels."""
    shape = x.shape
    xg = x.reshape(-1, g)
    cmax = levels[-1]
    amax = np.abs(xg).max(-1, keepdims=True)
    if rule == "rms":
        s = f16(np.maximum(np.sqrt((xg * xg).mean(-1, keepdims=True)), 1e-6))
        return (nearest(xg / s, levels) * s).reshape(shape)
    if rule == "max":
        s = f16(np.maximum(amax / cmax, 1e-6))
        return (nearest(xg / s, levels) * s).reshape(shape)
    best, err = None, None
    for m in MULTS:
        s = f16(np.maximum(amax * m / cmax, 1e-6))
        y = nearest(xg / s, levels) * s
        e = ((y - xg) ** 2).sum(-1, keepdims=True)
        if best is None:
            best, err = y, e
        else:
            better = e < err
            best = np.where(better, y, best)
            err = np.where(better, e, err)
    return best.reshape(shape)


def asym(x, g, rule, bits=4):
    shape = x.shape
    xg = x.reshape(-1, g)
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    top = 2**bits - 1

    def q(a, b):
        s = f16(np.maximum((b - a) / top, 1e-6))
        z = f16(a)
        return np.clip(np.rint((xg - z) / s), 0, top) * s + z

    if rule == "max":
        return q(lo, hi).reshape(shape)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best, err = None, None
    for m in MULTS:
        y = q(mid - half * m, mid + half * m)
        e = ((y - xg) ** 2).sum(-1, keepdims=True)
        if best is None:
            best, err = y, e
        else:
            better = e < err
            best = np.where(better, y, best)
            err = np.where(better, e, err)
    return best.reshape(shape)


class Tok:
    """One per-token scheme: (kind, levels, g, rule, rotate) for K and for V; ratio = bytes/fp32's."""

    def __init__(self, name, k, v, layers_k=None):
        self.name, self.k, self.v, self.layers_k = name, k, v, layers_k or {}
        self.ratio = (bits_per_value(k) + bits_per_value(v)) / 64  # bits over 2 x 32 bits
        for _layer, spec in self.layers_k.items():  # per-layer key overrides, averaged in
            self.ratio += (bits_per_value(spec) - bits_per_value(k)) / 64 / NUM_LAYERS

    def __call__(self, block, start=0):
        for layer in range(block.shape[0]):
            block[layer, 0] = quant(block[layer, 0], self.layers_k.get(layer, self.k))
            block[layer, 1] = quant(block[layer, 1], self.v)


NUM_LAYERS = 30


def bits_per_value(spec):
    kind = spec[0]
    if kind == "f32":
        return 32
    if kind == "cb":
        _, lv, g, _, _ = spec
        return np.ceil(np.log2(len(LEVELS[lv]))) + 16 / g
    if kind == "asym":
        _, bits, g, _, _ = spec
        return bits + 32 / g
    raise ValueError(spec)


def quant(x, spec):
    kind = spec[0]
    if kind == "f32":
        return x
    rot = spec[-1]
    if rot:
        x = x @ H
    if kind == "cb":
        _, lv, g, rule, _ = spec
        y = codebook(x, LEVELS[lv], g, rule)
    else:
        _, bits, g, rule, _ = spec
        y = asym(x, g, rule, bits)
    return y @ H.T if rot else y


# ---- pre-RoPE per-channel keys (KVQuant-like) ----
INV_FREQ = None  # [d/2], set from the manifest


def rope(k, pos, sign):
    """Rotate k [..., n, d] at positions pos [n] by sign * pos * inv_freq (HF rotate_half)."""
    ang = pos[:, None].astype(np.float64) * INV_FREQ[None, :].astype(np.float64)
    cos, sin = np.cos(ang).astype(np.float32), (sign * np.sin(ang)).astype(np.float32)
    half = k.shape[-1] // 2
    x1, x2 = k[..., :half], k[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


CAL = {}  # "lo", "hi": [layers, kvh, 1, d] pre-RoPE per-channel min and max over calibration


def dense_sparse(x, centre, outliers):
    """Keep the `outliers` largest |x - centre| of each token's head exact (float16): returns
    (x with those set to centre, mask of kept, their float16 values)."""
    if not outliers:
        return x, None, None
    dev = np.abs(x - centre)
    idx = np.argsort(-dev, axis=-1)[..., :outliers]
    mask = np.zeros(x.shape, bool)
    np.put_along_axis(mask, idx, True, axis=-1)
    return np.where(mask, centre, x), mask, f16(x)


class PreRope:
    """Keys: pre-RoPE per-channel 4-bit (static calibrated min/max, or per T-token block
    min/max), with `outliers` per token kept float16; values per token (spec)."""

    def __init__(self, name, v, mode="static", clip=1.0, outliers=0, bits=4, block=32, levels=None):
        self.name, self.v, self.mode, self.clip, self.outliers, self.bits, self.T = (
            name,
            v,
            mode,
            clip,
            outliers,
            bits,
            block,
        )
        self.levels = levels
        kbits = bits + outliers * 32 / D + (32 / block if mode == "block" else 0)
        self.ratio = (kbits + bits_per_value(v)) / 64

    def __call__(self, block, start=0):
        n = block.shape[3]
        pos = np.arange(start, start + n)
        k = rope(block[:, 0], pos, -1.0)  # [layers, kvh, n, d] pre-RoPE
        top = 2**self.bits - 1
        if self.mode == "static":
            lo, hi = CAL["lo"], CAL["hi"]
            mid, half = (lo + hi) / 2, (hi - lo) / 2 * self.clip
            lo, hi = mid - half, mid + half
            centre = mid
        else:  # blocks of T tokens (n a multiple of T: the Blocked cache commits whole blocks)
            L, Hh, _, d = k.shape
            kb = k.reshape(L, Hh, n // self.T, self.T, d)
            centre = np.median(kb, axis=3, keepdims=True)
        kk, mask, keep = dense_sparse(k if self.mode == "static" else kb, centre, self.outliers)
        if self.mode == "block":
            lo, hi = kk.min(3, keepdims=True), kk.max(3, keepdims=True)
        s = f16(np.maximum((hi - lo) / top, 1e-6))
        z = f16(lo)
        y = np.clip(np.rint((kk - z) / s), 0, top) * s + z
        if mask is not None:
            y = np.where(mask, keep, y)
        if self.mode == "block":
            y = y.reshape(k.shape)
        block[:, 0] = rope(y.astype(np.float32), pos, 1.0)
        for layer in range(block.shape[0]):
            block[layer, 1] = quant(block[layer, 1], self.v)


def calibrate_prerope(model):
    """Per layer/head/channel pre-RoPE key min and max over the 68 calibration prompts."""
    lo = hi = None
    for prompt in builtin_prompts("calibration"):
        ids = prompt_ids(model, prompt)
        cache = model.cache
        cache.reset(0)
        prefill(model.backend, cache, 0, [ids])
        kv = cache.memory.get(cache.pool, 0, slice(0, len(ids)))  # [layers, 2, kvh, n, d]
        k = rope(np.array(kv[:, 0]), np.arange(len(ids)), -1.0)
        a, b = k.min(2, keepdims=True), k.max(2, keepdims=True)
        lo = a if lo is None else np.minimum(lo, a)
        hi = b if hi is None else np.maximum(hi, b)
    cache.reset(0)
    CAL["lo"], CAL["hi"] = lo, hi


def cb(lv, g, rule, rot=True):
    return ("cb", lv, g, rule, rot)


V16 = cb("lm", 16, "mse")
V32 = cb("lm", 32, "mse")
SCHEMES = {
    # 1. Lloyd-Max codebook after Hadamard, one float16 scale per group
    "lm16rms": Tok("had LM g16 rms", cb("lm", 16, "rms"), cb("lm", 16, "rms")),
    "lm16mse": Tok("had LM g16 mse", cb("lm", 16, "mse"), cb("lm", 16, "mse")),
    "lm32mse": Tok("had LM g32 mse", cb("lm", 32, "mse"), cb("lm", 32, "mse")),
    "lm64mse": Tok("had LM g64 mse", cb("lm", 64, "mse"), cb("lm", 64, "mse")),
    # 2. uniform grids, MSE-searched clip
    "u15g16max": Tok("had uni15 g16 max (=kv-long had16)", cb("uni15", 16, "max"), cb("uni15", 16, "max")),
    "u16g16mse": Tok("had uni16 g16 mse", cb("uni", 16, "mse"), cb("uni", 16, "mse")),
    "u16g32mse": Tok("had uni16 g32 mse", cb("uni", 32, "mse"), cb("uni", 32, "mse")),
    "u15g32mse": Tok("had uni15 g32 mse", cb("uni15", 32, "mse"), cb("uni15", 32, "mse")),
    "asg32mse": Tok("had asym g32 mse", ("asym", 4, 32, "mse", True), ("asym", 4, 32, "mse", True)),
    "asg16mse": Tok("had asym g16 mse", ("asym", 4, 16, "mse", True), ("asym", 4, 16, "mse", True)),
    # references: keys float / values float, to split the loss
    "k32v_lm16": Tok("K f32, V had LM g16 mse", ("f32",), V16),
    "k_lm16v32": Tok("K had LM g16 mse, V f32", cb("lm", 16, "mse"), ("f32",)),
    # 3. pre-RoPE per-channel keys
    "pre_st": PreRope("K preRoPE chan static, V LM g16", V16),
    "pre_st_o1": PreRope("K preRoPE chan static o1, V LM g16", V16, outliers=1),
    "pre_st_o2": PreRope("K preRoPE chan static o2, V LM g16", V16, outliers=2),
    "pre_blk": PreRope("K preRoPE chan/32 blocks, V LM g16", V16, mode="block"),
    "pre_blk_o1": PreRope("K preRoPE chan/32 blocks o1, V LM g16", V16, mode="block", outliers=1),
    # 4. bit splits
    "k5v3": Tok("K had LM32 g32 mse, V had LM8 g32 mse", cb("lm32", 32, "mse"), cb("lm8", 32, "mse")),
    "k6v3": Tok("K had uni64 g32 mse, V had LM8 g32 mse", cb("uni64", 32, "mse"), cb("lm8", 32, "mse")),
    "k6v3g64": Tok("K had uni64 g32 mse, V had LM8 g64 mse", cb("uni64", 32, "mse"), cb("lm8", 64, "mse")),
    "k5v4": Tok("K had LM32 g32 mse, V had LM g32 mse", cb("lm32", 32, "mse"), V32),
    "k5uv4": Tok("K had uni32 g32 mse, V had LM g32 mse", cb("uni32", 32, "mse"), V32),
    "k6v2": Tok("K had uni64 g32 mse, V had LM4 g32 mse", cb("uni64", 32, "mse"), cb("lm4", 32, "mse")),
}


LAYER_BASES = {  # prefix: (label, K spec, V spec) for the K8-on-some-layers schemes
    "lay": ("K had LM g32 mse", cb("lm", 32, "mse"), V32),
    "lg": ("K had LM g16 mse", cb("lm", 16, "mse"), V32),
    "k5l": ("K had uni32 g32 mse", cb("uni32", 32, "mse"), V32),
    "k5v64l": ("K had uni32 g32 mse", cb("uni32", 32, "mse"), cb("lm", 64, "mse")),
    "k5g64l": ("K had uni32 g64 mse", cb("uni32", 64, "mse"), V32),
    "k5g64v64l": ("K had uni32 g64 mse", cb("uni32", 64, "mse"), cb("lm", 64, "mse")),
}


KEYS_8BIT = cb("uni256", 32, "max")


def layer_scheme(prefix, keep, kbig=KEYS_8BIT):
    """Keys 8-bit (uniform, g32, after H) on the layers `keep`, the base scheme elsewhere."""
    label, kspec, vspec = LAYER_BASES[prefix]
    vlabel = f"V had LM g{vspec[2]} mse"
    return Tok(
        f"{label}, K8 layers {','.join(map(str, sorted(keep)))}; {vlabel}",
        kspec,
        vspec,
        {i: kbig for i in keep},
    )


# per-layer key sensitivity: only layer i's keys quantized (LM g16 mse)
for i in range(NUM_LAYERS):
    SCHEMES[f"only{i}"] = Tok(
        f"K only layer {i} had LM g16 mse", ("f32",), ("f32",), {i: cb("lm", 16, "mse")}
    )


class Recent(KVCache):
    """Positions older than the last R stay float32 until they leave the window."""

    R = 0

    def commit(self, slots, tokens, counts):
        old = [self.length(s) for s in slots]
        fn, self.round_trip = self.round_trip, None
        super().commit(slots, tokens, counts)
        self.round_trip = fn
        for s, o in zip(slots, old, strict=False):
            a, b = max(0, o - self.R), max(0, self.length(s) - self.R)
            if b > a:
                fn(self.memory.get(self.pool, s, slice(a, b)), a)


class Blocked(KVCache):
    """Tokens are quantized in aligned blocks of T positions once a block is complete; the open
    block stays float32 (KIVI)."""

    T, R = 32, 0

    def commit(self, slots, tokens, counts):
        old = [self.length(s) for s in slots]
        fn, self.round_trip = self.round_trip, None
        super().commit(slots, tokens, counts)
        self.round_trip = fn
        for s, o in zip(slots, old, strict=False):
            a = o // self.T * self.T
            b = self.length(s) // self.T * self.T
            if b > a:
                fn(self.memory.get(self.pool, s, slice(a, b)), a)


def main():
    global INV_FREQ
    context, tokens = int(sys.argv[1]), int(sys.argv[2])
    names = sys.argv[3].split(",")
    model = Model(sys.argv[4] if len(sys.argv) > 4 else "/tmp/kv/f32", threads=1)
    INV_FREQ = np.array(model.manifest.rope.inv_freq, np.float32)
    prompts = document_prompts(model, context)
    extra = {}
    for n in names:
        base = n.partition("@")[0]
        for prefix in LAYER_BASES:  # lay10_18: K8 on layers 10 and 18
            if base.startswith(prefix) and base[len(prefix) :].replace("_", "").isdigit():
                extra[base] = layer_scheme(prefix, {int(x) for x in base[len(prefix) :].split("_")})
    SCHEMES.update(extra)
    if any(n.startswith("pre_st") for n in names):
        calibrate_prerope(model)
    positions = context + tokens  # bytes counted at the end of the run

    batch = int(os.environ.get("STUDY_BATCH", "4"))  # slots per cache: 1 keeps 6,144-token runs in memory

    def cands(model, scales, schemes, slots, *rest):
        out = []
        for n in names:
            base, _, r = n.partition("@")
            s = SCHEMES[base]
            blocked = isinstance(s, PreRope) and s.mode == "block"
            c = (Blocked if blocked else Recent)(model.manifest.geometry, slots)
            if not blocked:
                c.R = int(r or 0)
            c.round_trip = s
            ratio = s.ratio
            window = c.R if not blocked else Blocked.T - 1  # worst case open block
            ratio = (ratio * (positions - window) + window) / positions
            out.append((s.name + (f" recent{c.R}" if c.R else ""), model.backend, c, ratio))
        return out

    ev._candidates = cands
    res = ev.evaluate(model, None, prompts, tokens=tokens, schemes=(), batch=batch)
    for r in res:
        print(
            f"{r.scheme:<48} {context:>6} KL {r.kl_mean:.5f} p99 {r.kl_p99:.4f} top1 {r.top1_agreement:.2%} "
            f"match {r.greedy_match_mean:.1f} bytes {r.kv_bytes_ratio:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
