"""TensorRT engine + TrtBackend against the onnxruntime CPU reference on a tiny exported model.

Never run on hardware yet (see docs/JETSON.md). What each test establishes:

    float32 engine   the graph converts exactly: logits within 1e-3 of onnxruntime CPU
    float16 engine   what users run (`--precision float16`, strongly typed like every engine):
                     logits within 2% of their range of the same graph on onnxruntime CPU, same
                     greedy tokens
    batch of two     the prefill/decode profiles with 2 rows of different lengths
    wrong device     an engine manifest naming another GPU is refused, naming both
    contexts         one execution context per profile, each set once; close releases everything
    memory           device and host memory at load and at the first decode after 1536 tokens,
                     float32 and float16 engines, vs the planner's "tensorrt" terms
    pool             the cache pool mapped (default) vs in device memory (`--kv-memory device`):
                     the same logits, and decode per step at context 64 and 1536 with each
                     ("tensorrt.pool_<mapped|device>_decode_ms_context_<n>")
    speculation      float32 and float16 engines: the engine's own profiles take last_index
                     [1..2, 1..VERIFY_TOKENS] on prefill and [1..2, 1] on decode; a verify of
                     VERIFY_TOKENS tokens returns that many logits rows, equal to the CPU's within
                     the engine's tolerance; greedy replies with `speculate="lookup"` equal plain
                     decoding token for token (device_tests/speculation.py), decode tokens/s of
                     both ("tensorrt.<precision>.speculate_tokens_per_s", "...plain_tokens_per_s")
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from artifacts import take
from memory import MemoryLog
from speculation import check_speculation

from kvedge.contract import VERIFY_TOKENS
from kvedge.contract.engine import DECODE_PROFILE, ENGINE_MANIFEST_FILE, PREFILL_PROFILE
from kvedge.errors import ArtifactMismatch
from kvedge.export.tensorrt import build_engine
from kvedge.planner import check_fits
from kvedge.runtime.backends.cuda import DeviceMemory
from kvedge.runtime.backends.trt import TrtBackend
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill, verify, verify_rows
from kvedge.runtime.model import Model

pytestmark = pytest.mark.tensorrt

MAX_PREFILL = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Where this module's exports are copied (or made): engines are built into the copies."""
    return tmp_path_factory.mktemp("trt")


@pytest.fixture(scope="module")
def exported(folder):
    return take("portable-128", folder)


@pytest.fixture(scope="module")
def exported_half(folder):
    return take("float16-128", folder)


@pytest.fixture(scope="module")
def exported_long(folder):
    return take("portable-2048", folder)


def _engine(folder) -> TrtBackend:
    build_engine(folder, folder, MAX_PREFILL, 256 << 20, max_batch=2)
    return TrtBackend(folder, Model(folder).manifest)


def _compare(cpu: Model, trt: TrtBackend, prompts: list[list[int]], steps: int, atol: float) -> None:
    trt_cache = KVCache(cpu.manifest.geometry, len(prompts))
    a = prefill(cpu.backend, cpu.cache, 0, prompts)
    b = prefill(trt, trt_cache, 0, prompts, chunk=MAX_PREFILL)
    for _ in range(steps):
        np.testing.assert_allclose(b, a, atol=atol, rtol=0)
        tokens = [int(t) for t in np.argmax(a, axis=-1)]
        assert tokens == [int(t) for t in np.argmax(b, axis=-1)]
        a = decode_one_token(cpu.backend, cpu.cache, 0, tokens)
        b = decode_one_token(trt, trt_cache, 0, tokens)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def test_float32_engine_matches_cpu(exported):
    trt = _engine(exported)
    try:
        _compare(Model(exported), trt, [_prompt(100)], steps=16, atol=1e-3)  # 100 > MAX_PREFILL: 2 chunks
    finally:
        trt.close()


def test_float16_engine_matches_cpu_greedy(exported_half):
    trt = _engine(exported_half)
    try:
        cpu = Model(exported_half)
        reference = prefill(cpu.backend, KVCache(cpu.manifest.geometry, 1), 0, [_prompt(20)])
        atol = 0.02 * float(reference.max() - reference.min())
        _compare(cpu, trt, [_prompt(20)], steps=16, atol=atol)
    finally:
        trt.close()


def test_batch_of_two_rows(exported):
    trt = _engine(exported)
    try:
        _compare(Model(exported, slots=2), trt, [_prompt(30, 1), _prompt(11, 2)], steps=8, atol=1e-3)
    finally:
        trt.close()


def test_engine_for_another_device_is_refused(exported):
    build_engine(exported, exported, MAX_PREFILL, 256 << 20, max_batch=1)
    path = exported / ENGINE_MANIFEST_FILE
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "device_name": "Some Other GPU"}))
    with pytest.raises(ArtifactMismatch, match="built for Some Other GPU .* this machine has"):
        TrtBackend(exported, Model(exported).manifest)


def test_one_context_per_profile_released_in_order(exported):
    """Prefill and decode run on their own contexts, each holding its profile from construction
    (no switch per step); close gives every page lock and mapped buffer back."""
    trt = _engine(exported)
    try:
        assert {p: c.active_optimization_profile for p, c in trt.contexts.items()} == {0: 0, 1: 1}
        _compare(Model(exported), trt, [_prompt(20)], steps=4, atol=1e-3)
        assert {p: c.active_optimization_profile for p, c in trt.contexts.items()} == {0: 0, 1: 1}
    finally:
        trt.close()
    assert trt.host.nbytes == 0 and not trt.contexts


def _decode_ms(trt: TrtBackend, cache: KVCache, logits: np.ndarray, steps: int = 32) -> float:
    token = int(np.argmax(logits[0]))
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(decode_one_token(trt, cache, 0, [token])[0]))
    return (time.perf_counter() - start) / steps * 1e3


def test_decode_time_with_the_pool_mapped_and_in_device_memory(exported_long, record):
    trt = _engine(exported_long)
    memory = DeviceMemory(trt.cudart)
    geometry = Model(exported_long).manifest.geometry
    caches = {"mapped": KVCache(geometry, 1), "device": KVCache(geometry, 1, memory)}
    try:
        for context in (64, 1536):
            logits = {}
            for name, cache in caches.items():
                cache.reset(0)
                logits[name] = prefill(trt, cache, 0, [_prompt(context, 5)], chunk=MAX_PREFILL)
            np.testing.assert_allclose(logits["device"], logits["mapped"], atol=1e-3, rtol=0)
            for name, cache in caches.items():
                _decode_ms(trt, cache, logits[name], steps=4)  # warm-up at this context
                record(
                    f"tensorrt.pool_{name}_decode_ms_context_{context}", _decode_ms(trt, cache, logits[name])
                )
    finally:
        trt.close()  # the engine stops before the device pool goes
        memory.close()


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_memory_at_load_and_first_decode_vs_the_planner(precision, exported_long, folder, record):
    """Device and host memory from before the engine loads to after it, and to the first decode
    after a 1536-token prefill (device_tests/memory.py), against the planner's "tensorrt" terms,
    for the float32 engine and the float16 one users run."""
    model_folder = exported_long if precision == "float32" else take("float16-2048", folder)
    build_engine(model_folder, model_folder, MAX_PREFILL, 256 << 20, max_batch=1)
    log = MemoryLog(record, f"tensorrt.{precision}")
    with Model(model_folder, slots=1, device="tensorrt") as model:
        log.mark("load")
        logits = prefill(model.backend, model.cache, 0, [_prompt(1536, 7)], chunk=MAX_PREFILL)
        decode_one_token(model.backend, model.cache, 0, [int(np.argmax(logits[0]))])
        used = log.mark("first_decode")["device"]
    planned = log.planned(check_fits(model_folder, 1, 1 << 40, device="tensorrt"))["total"]
    assert used <= planned, f"memory {used} exceeds the planner's {planned}"


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_speculative_verify_and_greedy_replies(precision, exported, exported_half, record):
    folder = exported if precision == "float32" else exported_half
    build_engine(folder, folder, MAX_PREFILL, 256 << 20, max_batch=2)
    with Model(folder, slots=2, device="tensorrt") as model:
        trt, names = model.backend, model.manifest.names
        profiles = {
            p: [tuple(d) for d in trt.engine.get_tensor_profile_shape(names.last_index, p)]
            for p in (PREFILL_PROFILE, DECODE_PROFILE)
        }
        assert profiles == {
            PREFILL_PROFILE: [(1, 1), (1, 1), (2, VERIFY_TOKENS)],
            DECODE_PROFILE: [(1, 1), (2, 1), (2, 1)],
        }
        cpu = Model(folder, slots=2)
        prompt, tokens = _prompt(20, 4), _prompt(VERIFY_TOKENS, 5)
        reference = prefill(cpu.backend, cpu.cache, 0, [prompt])
        prefill(trt, model.cache, 0, [prompt], chunk=MAX_PREFILL)
        want, _ = verify(cpu.backend, cpu.cache, 0, tokens)
        got, _ = verify(trt, model.cache, 0, tokens)
        assert got.logits.shape == (1, VERIFY_TOKENS, model.manifest.vocab_size)
        atol = 1e-3 if precision == "float32" else 0.02 * float(reference.max() - reference.min())
        record(
            f"tensorrt.{precision}.verify_max_abs_logit_diff", float(np.abs(got.logits - want.logits).max())
        )
        np.testing.assert_allclose(got.logits, want.logits, atol=atol, rtol=0)
        # two neighbours' verifies in one call (rows of 4 and VERIFY_TOKENS tokens, right-padded)
        second = _prompt(13, 6)
        prefill(cpu.backend, cpu.cache, 1, [second])
        prefill(trt, model.cache, 1, [second], chunk=MAX_PREFILL)
        rows = [tokens[:4], tokens]
        want, _ = verify_rows(cpu.backend, cpu.cache, 0, rows)
        got, _ = verify_rows(trt, model.cache, 0, rows)
        assert got.logits.shape == (2, VERIFY_TOKENS, model.manifest.vocab_size)
        for r, row in enumerate(rows):
            n = len(row)
            np.testing.assert_allclose(got.logits[r, :n], want.logits[r, :n], atol=atol, rtol=0)
        model.cache.reset(0)
        model.cache.reset(1)
        # float16: a verify and a decode step may round apart; parting is allowed at a near tie only
        check_speculation(
            model, record, f"tensorrt.{precision}", near_tie=0.0 if precision == "float32" else atol
        )
