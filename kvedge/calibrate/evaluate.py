"""`kvedge eval-kv`: quality of INT8 KV schemes, and of quantized-weight exports, against the fp32
model (float32 weights, fp32 cache).

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
on int8 buffers; its bytes ratio is the allocated pool's, measured. A quantized-weight export
(`--weights-model`, an export of the same model with --weights int8|int4, any cache dtype) is
compared the same way; its bytes column is its cache's, like the INT8 export's; its row is named by
`weights_label` (variant, weights, and block size, kept channels and head bits where recorded).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvedge.calibrate.calibrate import Prompt, prompt_ids
from kvedge.contract import CacheGeometry, Manifest
from kvedge.errors import KvedgeError
from kvedge.quant import RoundTrip, Scales, Scheme
from kvedge.runtime.backends.ort import OrtBackend
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
    context: int | None = None  # the prompts' length in tokens (long documents); None: the chat prompts


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kv_bytes_ratio(scheme: Scheme, head_dim: int) -> float:
    """Bytes per cached value incl. scales (codes of `scheme.bits`, two 4-bit codes a byte), over
    fp32's 4. Dynamic scales are float16 (2 bytes per group per token); static scales are a few KB
    per model and amortise to ~0, as do the first tokens a scheme keeps float32."""
    code = scheme.bits / 8
    k = code + (SCALE_BYTES / scheme.v_group_size if scheme.k == "dynamic-token" else 0.0)
    v = code + (SCALE_BYTES / scheme.v_group_size if scheme.v == "dynamic-token" else 0.0)
    return (k + v) / 8.0


def cache_label(geometry: CacheGeometry) -> str:
    """A cache as a result row names it: its dtype, and an int4 cache's 8-bit key layers and window."""
    if not geometry.packed:
        return f"{geometry.dtype} cache"
    return f"int4 cache (8-bit keys on layers {list(geometry.key8_layers)}, window {geometry.float_window})"


def weights_label(manifest: Manifest) -> str:
    """An export's weights as a result row names them: variant and format, and for blocked integer
    weights what else tells one such export from another, where its manifest records it: block
    size, input channels kept float32, the LM head's bits, what a decode step's matmuls run (exports
    from before kvedge recorded the last three say nothing about them)."""
    label = f"{manifest.variant} {manifest.weights_dtype} weights"
    if not manifest.weight_block_size:  # float32 / float16 storage: nothing more to tell
        return label
    details = [f"block {manifest.weight_block_size}"]
    if manifest.weight_outlier_channels is not None:
        details.append(f"{manifest.weight_outlier_channels} outlier channels")
    if manifest.weight_head_bits is not None:
        details.append(f"{manifest.weight_head_bits}-bit head")
    if manifest.weight_decode_matmuls:
        details.append(f"{manifest.weight_decode_matmuls} decode matmuls")
    return f"{label} ({', '.join(details)})"


def evaluate(
    model: Model,
    scales: Scales | None,
    prompts: list[Prompt],
    tokens: int = 256,
    schemes: tuple[Scheme, ...] | None = None,
    batch: int = 4,
    int8_model: Model | None = None,
    llama_cpp_gguf: Path | None = None,
    threads: int = 1,
    weights_models: tuple[Model, ...] = (),
    simulated: tuple[tuple[str, Callable[[np.ndarray, int], None]], ...] = (),
) -> list[SchemeQuality]:
    """Compare every scheme (simulated on `model`'s fp32 cache; the default ones need `scales`,
    the calibrated static scales), the real INT8
    cache of `int8_model` (an export of the same weights with --kv-dtype int8) and every export
    of `weights_models` (the same model with quantized weights) with the fp32 model over
    `prompts` (see the module docstring). `simulated`: (name, round trip) pairs, each run on the
    fp32 cache as a scheme's `RoundTrip` is (`KVCache.round_trip`)."""
    geometry = model.manifest.geometry
    if geometry.quantized or geometry.packed:
        raise KvedgeError(f"eval-kv needs the float32-cache export as --model, not a {geometry.dtype} one")
    candidates = _candidates(model, scales, schemes, batch, int8_model, weights_models, simulated)
    if not candidates and llama_cpp_gguf is None:
        raise KvedgeError(
            "nothing to evaluate: give scales (--scales), a simulated scheme (--simulate), an INT8 "
            "export (--int8-model), a quantized-weight export (--weights-model) or --llama-cpp"
        )
    eos = list(model.manifest.eos_token_ids)
    reference = KVCache(geometry, batch)
    runs = [(model.backend, reference)] + [(backend, cache) for _, backend, cache, _ in candidates]
    kls: list[list[np.ndarray]] = [[] for _ in candidates]
    agree: list[list[np.ndarray]] = [[] for _ in candidates]
    match: list[list[int]] = [[] for _ in candidates]
    sequences: list[tuple[list[int], list[int]]] = []  # (prompt ids, forced continuation) per prompt
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    # progress per step (a batch's prefill, then each of its decode steps): a batch of long
    # prompts runs for minutes
    progress = tqdm(total=len(groups) * tokens, desc="eval-kv", unit="step")
    for group in groups:
        ids = [prompt_ids(model, p)[: geometry.max_len - tokens - 1] for p in group]
        continuations: list[list[int]] = [[] for _ in group]
        for _, cache in runs:
            for slot in range(cache.slots):
                cache.reset(slot)  # its states too (hybrid models)
        logits = [prefill(backend, cache, 0, ids) for backend, cache in runs]
        progress.update()
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
            for continuation, token in zip(continuations, forced, strict=True):
                continuation.append(token)
            logits = [decode_one_token(backend, cache, 0, forced) for backend, cache in runs]
            progress.update()
        sequences.extend(zip(ids, continuations, strict=True))
        for s in range(len(candidates)):
            match[s].extend(int(m) for m in first_miss[s])
    progress.close()
    results = [
        quality(name, kls[s], agree[s], match[s], ratio) for s, (name, _, _, ratio) in enumerate(candidates)
    ]
    if llama_cpp_gguf is not None:
        results.extend(llama_cpp_cache_quality(llama_cpp_gguf, sequences, threads))
    return results


Candidate = tuple[str, OrtBackend, KVCache, float]  # name, backend, its cache, cache bytes / fp32's


def _candidates(
    model: Model,
    scales: Scales | None,
    schemes: tuple[Scheme, ...] | None,
    batch: int,
    int8_model: Model | None,
    weights_models: tuple[Model, ...],
    simulated: tuple[tuple[str, Callable[[np.ndarray, int], None]], ...] = (),
) -> list[Candidate]:
    """What `evaluate` compares with the fp32 model, each with a cache of `batch` slots: the
    simulated schemes over `scales`, the real INT8 cache, the quantized-weight exports, and the
    `simulated` round trips (their bytes column 1: what they cost is not theirs to say)."""
    geometry = model.manifest.geometry
    candidates: list[Candidate] = []
    if schemes is None and scales is not None:
        schemes = default_schemes(scales.manifest.group_size, geometry.head_dim)
    for scheme in schemes or ():
        cache = KVCache(geometry, batch)
        cache.round_trip = RoundTrip(scheme, scales)
        candidates.append((scheme.name, model.backend, cache, kv_bytes_ratio(scheme, geometry.head_dim)))
    if int8_model is not None:
        model.manifest.check_compatible(int8_model.manifest, "--int8-model", cache_dtype=False)
        cache = KVCache(int8_model.manifest.geometry, batch)
        name = f"INT8 cache in memory (per-token, g{cache.geometry.group_size})"
        candidates.append((name, int8_model.backend, cache, cache.nbytes / geometry.pool_bytes(batch)))
    for other in weights_models:
        model.manifest.check_compatible(other.manifest, "--weights-model", cache_dtype=False, weights=False)
        cache = KVCache(other.manifest.geometry, batch)
        name = f"{weights_label(other.manifest)}, {cache_label(cache.geometry)}"
        candidates.append((name, other.backend, cache, cache.nbytes / geometry.pool_bytes(batch)))
    for name, round_trip in simulated:
        cache = KVCache(geometry, batch)
        cache.round_trip = round_trip
        candidates.append((name, model.backend, cache, 1.0))
    return candidates


def quality(
    name: str, kls: list[np.ndarray], agree: list[np.ndarray], match: list[int], ratio: float
) -> SchemeQuality:
    """Summarise per-position KL divergences, argmax agreements and per-prompt match lengths."""
    kl = np.concatenate(kls)
    return SchemeQuality(
        scheme=name,
        kl_mean=float(kl.mean()),
        kl_p99=float(np.percentile(kl, 99)),
        top1_agreement=float(np.concatenate(agree).mean()),
        greedy_match_mean=float(np.mean(match)),
        greedy_match_min=int(np.min(match)),
        kv_bytes_ratio=ratio,
    )


def llama_cpp_cache_quality(
    gguf: Path, sequences: list[tuple[list[int], list[int]]], threads: int = 1
) -> list[SchemeQuality]:
    """llama.cpp's q8_0 and q4_0 KV caches against its own f16 cache on the same GGUF and the same
    teacher-forced sequences (llama.cpp writes K/V into its cache before attending, so evaluating
    a whole sequence in one batch reads the quantized cache as decoding would). Bytes: q8_0 packs
    32 values in 34 bytes and q4_0 in 18, against f16's 64 (and our fp32 reference's 128)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise KvedgeError("--llama-cpp needs llama-cpp-python (pip install '.[bench]')") from exc
    longest = max(len(p) + len(c) for p, c in sequences)
    logits: dict[str, list[np.ndarray]] = {}
    kinds = {
        "f16": llama_cpp.GGML_TYPE_F16,
        "q8_0": llama_cpp.GGML_TYPE_Q8_0,
        "q4_0": llama_cpp.GGML_TYPE_Q4_0,
    }
    for name, kv_type in kinds.items():
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=longest,
            n_batch=longest,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            flash_attn=True,  # llama.cpp quantizes V only with flash attention
            type_k=kv_type,
            type_v=kv_type,
            verbose=False,
        )
        logits[name] = []
        for prompt, continuation in tqdm(sequences, desc=f"llama.cpp {name} cache", unit="prompt"):
            llm.reset()
            llm.eval(prompt + continuation)
            start = len(prompt) - 1  # the logits that predict each continuation token
            logits[name].append(np.array(llm.scores[start : start + len(continuation)], np.float32))
        del llm
    aligned = np.concatenate(
        [rows.argmax(axis=-1) == c for rows, (_, c) in zip(logits["f16"], sequences, strict=True)]
    )
    log.info("llama.cpp f16 argmax = kvedge fp32 continuation at %.1f%% of positions", 100 * aligned.mean())
    results = []
    for name, ratio in (("q8_0", 34 / 128), ("q4_0", 18 / 128)):
        kls, agree, match = [], [], []
        for ref_rows, q_rows in zip(logits["f16"], logits[name], strict=True):
            ref, q = log_softmax(ref_rows), log_softmax(q_rows)
            kls.append((np.exp(ref) * (ref - q)).sum(axis=-1))
            same = ref.argmax(axis=-1) == q.argmax(axis=-1)
            agree.append(same)
            match.append(int(np.argmin(same)) if not same.all() else len(same))
        results.append(quality(f"llama.cpp {name} cache vs its f16 cache", kls, agree, match, ratio))
    return results
