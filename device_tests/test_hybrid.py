"""The hybrid models (LFM2: convolution states; Qwen3.5: Gated DeltaNet convolution and recurrent
states) on the GPU against onnxruntime on the CPU, on tiny portable exports (max_len 256). The
states are bound as the pool is: page-locked, mapped, by pointer (`KVCache.state_views`).

ort_cuda logits   CUDA vs CPU over a prefill and 16 greedy decode steps, two rows of different
                  lengths: within 1e-3, greedy tokens equal; each row equals itself run alone
ort_cuda resume   a slot rewound to its snapshot at the end of a prompt and decoded again gives
                  the same logits as the first time (the state restored exactly, on the device)
tensorrt logits   a float32 engine (profiles up to 64 tokens, 2 rows) vs CPU: the same checks

Figures: "<family>.<device>_vs_cpu_max_abs_logit_diff".
"""

from __future__ import annotations

import numpy as np
import pytest
from artifacts import take

from kvedge.contract import PREFILL_CHUNK
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

ATOL = 1e-3  # as test_ort_cuda.py's float32 graphs
FAMILIES = {"lfm2": "lfm2-256", "qwen3_5": "qwen3_5-256"}  # -> device_tests/artifacts.py's export
MAX_PREFILL = 64  # the engine's longest prefill call (test_tensorrt.py's)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request, tmp_path_factory):
    return take(FAMILIES[request.param], tmp_path_factory.mktemp(f"hybrid-{request.param}"))


def _family(folder) -> str:
    return next(family for family, name in FAMILIES.items() if folder.name == name)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 250, n)] for n in (21, 9)]


def _run(backend, cache: KVCache, prompts: list[list[int]], steps: int, chunk: int = PREFILL_CHUNK) -> list:
    """Logits [rows, vocab] after the prompts in slots 0.., then after each of `steps` greedy tokens."""
    logits = [prefill(backend, cache, 0, prompts, chunk=chunk)]
    for _ in range(steps):
        tokens = [int(t) for t in np.argmax(logits[-1], axis=-1)]
        logits.append(decode_one_token(backend, cache, 0, tokens))
    return logits


def _compare(cpu: list, gpu: list, record, name: str) -> None:
    worst = 0.0
    for a, b in zip(cpu, gpu, strict=True):
        worst = max(worst, float(np.abs(a - b).max()))
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)
        assert np.argmax(a, axis=-1).tolist() == np.argmax(b, axis=-1).tolist()
    record(name, worst)


@pytest.mark.ort_cuda
def test_ort_cuda_matches_cpu_and_each_row_alone(exported, record):
    prompts = _prompts()
    with Model(exported, slots=2) as cpu, Model(exported, device="cuda", slots=2) as gpu:
        reference = _run(cpu.backend, cpu.cache, prompts, 16)
        _compare(
            reference,
            _run(gpu.backend, gpu.cache, prompts, 16),
            record,
            f"{_family(exported)}.cuda_vs_cpu_max_abs_logit_diff",
        )
        for row, prompt in enumerate(prompts):
            gpu.cache.reset(0)
            alone = _run(gpu.backend, gpu.cache, [prompt], 16)
            for a, b in zip(reference, alone, strict=True):
                np.testing.assert_allclose(b[0], a[row], atol=ATOL, rtol=0)


@pytest.mark.ort_cuda
def test_ort_cuda_resumes_a_slot_from_its_snapshot(exported):
    prompt = _prompts()[0]
    with Model(exported, device="cuda") as gpu:
        first = _run(gpu.backend, gpu.cache, [prompt], 0)[0]
        gpu.cache.snapshot(0)
        token = int(np.argmax(first))
        once = [decode_one_token(gpu.backend, gpu.cache, 0, [token]) for _ in range(4)]
        gpu.cache.truncate(0, len(prompt))  # back to the snapshot: the states as they were there
        again = [decode_one_token(gpu.backend, gpu.cache, 0, [token]) for _ in range(4)]
    for a, b in zip(once, again, strict=True):
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)


@pytest.mark.tensorrt
def test_tensorrt_engine_matches_cpu(exported, record):
    from kvedge.export.tensorrt import build_engine
    from kvedge.runtime.backends.trt import TrtBackend

    build_engine(exported, exported, MAX_PREFILL, 256 << 20, max_batch=2)
    prompts = _prompts()
    with Model(exported, slots=2) as cpu:
        trt = TrtBackend(exported, cpu.manifest)
        try:
            reference = _run(cpu.backend, cpu.cache, prompts, 16)
            cache = KVCache(cpu.manifest.geometry, 2)
            got = _run(trt, cache, prompts, 16, chunk=MAX_PREFILL)
            _compare(reference, got, record, f"{_family(exported)}.tensorrt_vs_cpu_max_abs_logit_diff")
        finally:
            trt.close()
