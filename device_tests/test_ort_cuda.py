"""onnxruntime CUDA provider against the CPU reference on tiny exported models.

logits       CUDA vs CPU within 1e-3 over a prefill and 16 greedy decode steps
cache        decoding with the cache equals a full recompute without it (on CUDA)
decode time  per-step decode at context 1536 vs 64 (max_len 2048): the ratio is recorded
memory       GPU memory used after load + 1536 tokens vs the planner's "cuda" estimate
"""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest
from tiny import make_tiny_model

from kvedge.export.export import ExportOptions, export_model
from kvedge.planner import check_fits
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

pytestmark = pytest.mark.ort_cuda

ATOL = 1e-3  # CUDA fp32 matmuls may use TF32-free but differently ordered reductions


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    source = make_tiny_model(root / "hf", "llama")
    export_model(source, root / "out", ExportOptions(max_len=2048))
    return root / "out"


def _ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def test_cuda_matches_cpu(exported, record):
    cpu, gpu = Model(exported), Model(exported, device="cuda")
    ids = _ids(20)
    a = prefill(cpu.backend, cpu.cache, 0, [ids])[0]
    b = prefill(gpu.backend, gpu.cache, 0, [ids])[0]
    worst = 0.0
    for _ in range(16):
        worst = max(worst, float(np.abs(a - b).max()))
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)
        token = int(np.argmax(a))
        assert token == int(np.argmax(b))
        a = decode_one_token(cpu.backend, cpu.cache, 0, [token])[0]
        b = decode_one_token(gpu.backend, gpu.cache, 0, [token])[0]
    record("cuda_vs_cpu_max_abs_logit_diff", worst)


def test_cache_on_equals_cache_off(exported, record):
    gpu = Model(exported, device="cuda")
    ids = _ids(40, seed=1)
    cached = [prefill(gpu.backend, gpu.cache, 0, [ids[:20]])[0]]
    cached += [decode_one_token(gpu.backend, gpu.cache, 0, [t])[0] for t in ids[20:]]
    fresh = []
    for n in range(20, 41):
        cache = KVCache(gpu.manifest.geometry, 1)
        fresh.append(prefill(gpu.backend, cache, 0, [ids[:n]])[0])
    diff = float(np.abs(np.stack(cached) - np.stack(fresh)).max())
    record("cuda_cache_on_vs_off_max_abs_diff", diff)
    assert diff < ATOL


def _decode_ms(model: Model, context: int, steps: int = 32) -> float:
    model.cache.reset(0)
    logits = prefill(model.backend, model.cache, 0, [_ids(context, seed=2)])[0]
    token = int(np.argmax(logits))
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(decode_one_token(model.backend, model.cache, 0, [token])[0]))
    return (time.perf_counter() - start) / steps * 1e3


def test_decode_time_at_long_and_short_context(exported, record):
    gpu = Model(exported, device="cuda")
    _decode_ms(gpu, 64, steps=4)  # warm-up
    short, long = _decode_ms(gpu, 64), _decode_ms(gpu, 1536)
    record("cuda_decode_ms_context_64", short)
    record("cuda_decode_ms_context_1536", long)
    record("cuda_decode_ratio_1536_over_64", long / short)


def _gpu_used_bytes() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0]) << 20


def test_gpu_memory_vs_the_planner(exported, record):
    before = _gpu_used_bytes()
    gpu = Model(exported, device="cuda")
    prefill(gpu.backend, gpu.cache, 0, [_ids(1536, seed=3)])
    used = _gpu_used_bytes() - before
    planned = check_fits(exported, 1, 1 << 40, backend="cuda").total
    record("cuda_gpu_memory_used_bytes", used)
    record("cuda_planned_bytes", planned)
    assert used <= planned, f"GPU memory {used} exceeds the planner's {planned}"
