"""4-bit KV remedies simulated on the float32 cache (a one-off study; see README.md).

    python study.py CONTEXT TOKENS NAME[,NAME...] [FLOAT32_EXPORT]

NAME is a key of SIMS; NAME@R keeps the last R positions float32 until they leave that window.
"""

import sys

import numpy as np

from kvedge.calibrate import evaluate as ev
from kvedge.calibrate.calibrate import builtin_prompts, collect_kv, document_prompts
from kvedge.quant import hadamard
from kvedge.runtime.cache import KVCache
from kvedge.runtime.model import Model


def fq(x, bits, g, asym, rot):
    if bits >= 16:
        return x
    d = x.shape[-1]
    if rot is not None:
        x = x @ rot
    xg = x.reshape(*x.shape[:-1], d // g, g)
    if asym:
        lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
        levels = 2**bits - 1
        s = np.maximum((hi - lo) / levels, 2**-14).astype(np.float16).astype(np.float32)
        z = lo.astype(np.float16).astype(np.float32)
        q = np.clip(np.rint((xg - z) / s), 0, levels)
        y = q * s + z
    else:
        qmax = 2 ** (bits - 1) - 1
        s = np.maximum(np.abs(xg).max(-1, keepdims=True) / qmax, 2**-14).astype(np.float16).astype(np.float32)
        y = np.clip(np.rint(xg / s), -qmax, qmax) * s
    y = y.reshape(x.shape)
    return y @ rot.T if rot is not None else y


class Sim:
    def __init__(self, name, kbits=4, vbits=4, g=32, asym=False, had=False, sinks=0):
        self.name, self.kbits, self.vbits, self.g, self.asym, self.sinks = name, kbits, vbits, g, asym, sinks
        self.rot = hadamard(64) if had else None

        def code(b):
            return b / 8 + (4 if asym else 2) / g if b < 16 else 4

        self.ratio = (code(kbits) + code(vbits)) / 8

    def __call__(self, block, start=0):
        skip = max(0, self.sinks - start)
        if skip >= block.shape[3]:
            return
        b = block[:, :, :, skip:]
        b[:, 0] = fq(b[:, 0], self.kbits, self.g, self.asym, self.rot)
        b[:, 1] = fq(b[:, 1], self.vbits, self.g, self.asym, self.rot)


SIMS = {
    "sym": Sim("int4 sym g32"),
    "k8v4": Sim("K int8 V int4 sym g32", kbits=8),
    "k4v8": Sim("K int4 V int8 sym g32", vbits=8),
    "asym": Sim("int4 asym g32", asym=True),
    "asymhad": Sim("int4 asym g32 had", asym=True, had=True),
    "had16": Sim("int4 sym g16 had", g=16, had=True),
    "hadsink": Sim("int4 sym g32 had sinks4", had=True, sinks=4),
    "asymhadsink": Sim("int4 asym g32 had sinks4", asym=True, had=True, sinks=4),
    "asym16had": Sim("int4 asym g16 had", asym=True, had=True, g=16),
    "had": Sim("int4 sym g32 had", had=True),
    "k8v4had": Sim("K int8 V int4 sym g32 had", kbits=8, had=True),
    "k4v8had": Sim("K int4 V int8 sym g32 had", vbits=8, had=True),
}


class Smooth(Sim):
    """K divided per channel by amp**alpha (pair amplitude, calibrated), then per-token quant."""

    def __init__(self, name, alpha=1.0, **kw):
        super().__init__(name, **kw)
        self.alpha = alpha
        self.c = None

    def __call__(self, block, start=0):
        skip = max(0, self.sinks - start)
        if skip >= block.shape[3]:
            return
        b = block[:, :, :, skip:]
        c = (AMP**self.alpha)[:, :, None, :]  # [layers, kvh, 1, d]
        b[:, 0] = fq(b[:, 0] / c, self.kbits, self.g, self.asym, self.rot) * c
        b[:, 1] = fq(b[:, 1], self.vbits, self.g, self.asym, self.rot)


class Chan(Sim):
    """K per channel static (pair amplitude * beta / 7), V per token."""

    def __init__(self, name, beta=1.0, **kw):
        super().__init__(name, **kw)
        self.beta = beta

    def __call__(self, block, start=0):
        b = block
        s = (AMP * self.beta / 7)[:, :, None, :]
        b[:, 0] = np.clip(np.rint(b[:, 0] / s), -7, 7) * s
        b[:, 1] = fq(b[:, 1], self.vbits, self.g, self.asym, self.rot)


class Layers(Sim):
    """int4 K except the listed layers (int8)."""

    def __init__(self, name, keep, **kw):
        super().__init__(name, **kw)
        self.keep = keep

    def __call__(self, block, start=0):
        for layer in range(block.shape[0]):
            kb = 8 if layer in self.keep else self.kbits
            block[layer, 0] = fq(block[layer, 0], kb, self.g, self.asym, self.rot)
            block[layer, 1] = fq(block[layer, 1], self.vbits, self.g, self.asym, self.rot)


SIMS.update(
    {
        "had8": Sim("int4 sym g8 had", g=8, had=True),
        "chan1": Chan("K4 chan b1 V8", vbits=8),
        "chan07": Chan("K4 chan b.7 V8", beta=0.7, vbits=8),
        "lay0": Layers("K4 V8 had, L0 K8", {0}, vbits=8, had=True),
        "lay01": Layers("K4 V8 had, L0-1 K8", {0, 1}, vbits=8, had=True),
        "layl": Layers("K4 V8 had, L29 K8", {29}, vbits=8, had=True),
        "symsink": Sim("int4 sym g32 sinks4", sinks=4),
        "symsink16": Sim("int4 sym g32 sinks16", sinks=16),
        "k4v8sink": Sim("K4 V8 g32 sinks4", vbits=8, sinks=4),
        "sm1": Smooth("int4 g32 K smooth a1", alpha=1.0),
        "sm05": Smooth("int4 g32 K smooth a.5", alpha=0.5),
        "sm1had": Smooth("int4 g32 K smooth a1 had", alpha=1.0, had=True),
        "sm05had": Smooth("int4 g32 K smooth a.5 had", alpha=0.5, had=True),
        "sm1k8": Smooth("K8 V4 g32 had", alpha=0.0, kbits=8, had=True),
        "v4g16": Sim("K8 V4 g16", kbits=8, g=16),
        "v4g16had": Sim("K8 V4 g16 had", kbits=8, g=16, had=True),
        "sm05had16": Smooth("int4 g16 K smooth a.5 had", alpha=0.5, had=True, g=16),
        "sm1had16": Smooth("int4 g16 K smooth a1 had", alpha=1.0, had=True, g=16),
        "sm1k4v8": Smooth("K4 smooth a1 V8", alpha=1.0, vbits=8),
        "sm05k4v8had": Smooth("K4 smooth a.5 had V8", alpha=0.5, vbits=8, had=True),
    }
)
context, tokens = int(sys.argv[1]), int(sys.argv[2])
names = sys.argv[3].split(",")
model = Model(sys.argv[4] if len(sys.argv) > 4 else "/tmp/kv/f32")
prompts = document_prompts(model, context)

K, V, n = collect_kv(model, builtin_prompts("calibration"))
d = K.shape[-1]
half = d // 2
pair = np.sqrt(K[..., :half] ** 2 + K[..., half:] ** 2)  # [layers, tokens, kvh, half]
amp = np.abs(pair).max(axis=1)  # [layers, kvh, half]
AMP = np.maximum(np.concatenate([amp, amp], -1), 1e-3).astype(np.float32)
print("calibration tokens", n, "amp range", AMP.min(), AMP.max(), flush=True)


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
    """KIVI: tokens are quantized in aligned blocks of T positions once a block is complete;
    the open block (and R more) stays float32."""

    T, R = 32, 0

    def commit(self, slots, tokens, counts):
        old = [self.length(s) for s in slots]
        fn, self.round_trip = self.round_trip, None
        super().commit(slots, tokens, counts)
        self.round_trip = fn
        for s, o in zip(slots, old, strict=False):
            a = max(0, o - self.R) // self.T * self.T
            b = max(0, self.length(s) - self.R) // self.T * self.T
            if b > a:
                fn(self.memory.get(self.pool, s, slice(a, b)), a)


def fq_chan(x, bits, T, rot=None):
    """x [layers, kvh, n, d], n a multiple of T: one scale per channel per T tokens."""
    if rot is not None:
        x = x @ rot
    L, H, n, d = x.shape
    xb = x.reshape(L, H, n // T, T, d)
    qmax = 2 ** (bits - 1) - 1
    s = np.maximum(np.abs(xb).max(3, keepdims=True) / qmax, 2**-14).astype(np.float16).astype(np.float32)
    y = (np.clip(np.rint(xb / s), -qmax, qmax) * s).reshape(L, H, n, d)
    return y @ rot.T if rot is not None else y


class Kivi(Sim):
    def __call__(self, block, start=0):
        block[:, 0] = fq_chan(block[:, 0], self.kbits, 32, self.rot)
        block[:, 1] = fq(block[:, 1], self.vbits, self.g, self.asym, None)


SIMS.update(
    {
        "i8had": Sim("int8 g32 had", kbits=8, vbits=8, had=True),
        "i8": Sim("int8 g32", kbits=8, vbits=8),
        "kivi": Kivi("K4 per-channel/32 tokens, V4 g32"),
        "kivih": Kivi("K4 per-channel/32 tokens had, V4 g32", had=True),
        "kivik4v8": Kivi("K4 per-channel/32 tokens, V8", vbits=8),
    }
)


def cands(*a, **k):
    out = []
    for n in names:
        base, _, r = n.partition("@")
        c = (Blocked if base.startswith("kivi") else Recent)(model.manifest.geometry, 4)
        c.R = int(r or 0)
        c.round_trip = SIMS[base]
        n = base
        out.append((SIMS[n].name + (f" recent{c.R}" if c.R else ""), model.backend, c, SIMS[n].ratio))
    return out


ev._candidates = cands
res = ev.evaluate(model, None, prompts, tokens=tokens, schemes=())
for r in res:
    print(
        f"{r.scheme:<32} {context:>6} KL {r.kl_mean:.5f} p99 {r.kl_p99:.4f} top1 {r.top1_agreement:.2%} "
        f"match {r.greedy_match_mean:.1f} bytes {r.kv_bytes_ratio:.3f}",
        flush=True,
    )
