"""`kvedge eval-kv`: quality of INT8 KV schemes against the fp32 cache.

For each held-out prompt (never the calibration set), the fp32-cache model writes a greedy
continuation of `tokens` tokens. Every scheme is teacher-forced on exactly those tokens in
lockstep, each with its own cache, and at every position we compare next-token
distributions with the fp32 cache's:

    KL(p_fp32 || p_scheme)   mean and 99th percentile over all positions of all prompts
    top-1 agreement          fraction of positions where both argmaxes agree
    greedy match length      per prompt, positions before the first argmax disagreement
                             (= how long free-running greedy decoding stays identical)

KV bytes of the simulated schemes are computed: INT8 codes plus scales (static scales are a few
KB per model; a dynamic per-token scale costs 2 bytes, float16, per group of channels per
token). The real INT8 cache (`--int8-model`, an export with `--kv-dtype int8`) runs its own graph
on int8 buffers; its bytes ratio is the allocated pool's, measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from kvedge.calibrate.calibrate import Prompt, prompt_ids
from kvedge.errors import KvedgeError
from kvedge.quant import RoundTrip, Scales, Scheme
from kvedge.runtime.backend import OrtBackend
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

log = logging.getLogger(__name__)
SCALE_BYTES = 2  # a dynamic scale is stored as float16


def default_schemes(group_size: int, head_dim: int) -> tuple[Scheme, ...]:
    """Calibrated per-group static K, per-token dynamic K, and the per-tensor baseline."""
    small = min(32, head_dim)
    return (
        Scheme(k="static-group", v="dynamic-token", group_size=group_size, v_group_size=min(64, head_dim)),
        Scheme(k="dynamic-token", v="dynamic-token", group_size=group_size, v_group_size=small),
        Scheme(k="static-tensor", v="static-tensor", group_size=group_size),
    )


@dataclass
class SchemeQuality:
    scheme: str
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    greedy_match_mean: float
    greedy_match_min: int
    kv_bytes_ratio: float  # INT8 cache bytes incl. scales / fp32 cache bytes


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kv_bytes_ratio(scheme: Scheme, head_dim: int) -> float:
    """INT8 bytes per cached value incl. scales, over fp32's 4. Dynamic scales are float16 (2 bytes
    per group per token); static scales are a few KB per model and amortise to ~0."""
    k = 1.0 + (SCALE_BYTES / scheme.v_group_size if scheme.k == "dynamic-token" else 0.0)
    v = 1.0 + (SCALE_BYTES / scheme.v_group_size if scheme.v == "dynamic-token" else 0.0)
    return (k + v) / 8.0


def evaluate(
    model: Model,
    scales: Scales | None,
    prompts: list[Prompt],
    tokens: int = 256,
    schemes: tuple[Scheme, ...] | None = None,
    batch: int = 4,
    int8_model: Model | None = None,
) -> list[SchemeQuality]:
    """Compare every scheme (simulated on `model`'s fp32 cache with `scales`) and the real INT8
    cache of `int8_model` (an export of the same weights with --kv-dtype int8) with the fp32
    cache over `prompts` (see the module docstring)."""
    geometry = model.manifest.geometry
    if geometry.quantized:
        raise KvedgeError(f"eval-kv needs the float32-cache export as --model, not a {geometry.dtype} one")
    candidates: list[tuple[str, OrtBackend, KVCache, float]] = []  # name, backend, cache, bytes ratio
    if scales is not None:
        for scheme in schemes or default_schemes(scales.manifest.group_size, geometry.head_dim):
            cache = KVCache(geometry, batch)
            cache.round_trip = RoundTrip(scheme, scales)
            candidates.append((scheme.name, model.backend, cache, kv_bytes_ratio(scheme, geometry.head_dim)))
    if int8_model is not None:
        model.manifest.check_compatible(int8_model.manifest, "--int8-model", cache_dtype=False)
        cache = KVCache(int8_model.manifest.geometry, batch)
        name = f"INT8 cache in memory (per-token, g{cache.geometry.group_size})"
        candidates.append((name, int8_model.backend, cache, cache.nbytes / KVCache(geometry, batch).nbytes))
    if not candidates:
        raise KvedgeError("nothing to evaluate: give scales (--scales) and/or an INT8 export (--int8-model)")
    eos = list(model.manifest.eos_token_ids)
    reference = KVCache(geometry, batch)
    runs = [(model.backend, reference)] + [(backend, cache) for _, backend, cache, _ in candidates]
    kls: list[list[np.ndarray]] = [[] for _ in candidates]
    agree: list[list[np.ndarray]] = [[] for _ in candidates]
    match: list[list[int]] = [[] for _ in candidates]
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    for group in tqdm(groups, desc="eval-kv", unit="batch"):
        ids = [prompt_ids(model, p)[: geometry.max_len - tokens - 1] for p in group]
        for _, cache in runs:
            cache.lengths[:] = 0
        logits = [prefill(backend, cache, 0, ids) for backend, cache in runs]
        first_miss = np.full((len(candidates), len(group)), tokens)
        for step in range(tokens):
            ref = log_softmax(logits[0])
            p = np.exp(ref)
            top = ref.argmax(axis=-1)
            for s in range(len(candidates)):
                q = log_softmax(logits[1 + s])
                kls[s].append((p * (ref - q)).sum(axis=-1))
                same = q.argmax(axis=-1) == top
                agree[s].append(same)
                first_miss[s] = np.where(~same & (first_miss[s] == tokens), step, first_miss[s])
            if step == tokens - 1:
                break
            ref_masked = logits[0].copy()
            ref_masked[:, eos] = -np.inf  # keep writing: a continuation of exactly `tokens` tokens
            forced = [int(t) for t in ref_masked.argmax(axis=-1)]
            logits = [decode_one_token(backend, cache, 0, forced) for backend, cache in runs]
        for s in range(len(candidates)):
            match[s].extend(int(m) for m in first_miss[s])
    results = []
    for s, (name, _, _, ratio) in enumerate(candidates):
        kl = np.concatenate(kls[s])
        results.append(
            SchemeQuality(
                scheme=name,
                kl_mean=float(kl.mean()),
                kl_p99=float(np.percentile(kl, 99)),
                top1_agreement=float(np.concatenate(agree[s]).mean()),
                greedy_match_mean=float(np.mean(match[s])),
                greedy_match_min=int(np.min(match[s])),
                kv_bytes_ratio=ratio,
            )
        )
    return results
