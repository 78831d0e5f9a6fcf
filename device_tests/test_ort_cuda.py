"""onnxruntime CUDA provider against the CPU reference on tiny exported models (max_len 2048),
each test run for both exports cuda takes (`kvedge.runtime.backends.ort.cuda_refusal`): the portable
float32 graph, and the in-place `--variant ort --kv-dtype float16` graph (GroupQueryAttention in
float16 writing the new K/V into the mapped pool on the device; the recommended CUDA export).

binding      decode binds logits and the cache tensors as "cuda" at mapped addresses, the pool is
             page-locked and mapped; the optimized graph copies no past/present tensor, and the
             float16 in-place graph no tensor at all (a CUDA graph could hold no copy)
logits       CUDA vs CPU over a prefill and 16 greedy decode steps: within 1e-3 (float32), within
             the float16 bound of tests/test_kv_float16.py (4 x 2**-11 x the logits' range),
             greedy tokens equal
cache        decoding with the cache equals a full recompute without it (on CUDA)
decode time  per-step decode at context 1536 vs 64, CUDA and CPU, and with a CUDA graph where
             kvedge allows one (the float16 in-place graph: its replayed logits must equal the
             uncaptured ones at both contexts; the portable graph's refusal, and what
             onnxruntime itself says of capturing it, are recorded)
memory       device and host memory at load and at the first decode after 1536 tokens, vs the
             planner's "cuda" terms, and the host memory mapped for the GPU (the pool lives there)
close        models opened and closed in turn in one process map their pools anew (no 712 from
             a freed pool's pages still locked) and give every page lock back
in place     one decode binding, run after the pool and the step inputs changed, reads the new
             values: nothing was copied at bind time (`Bound.rebind`)
pool         the pool mapped (default) vs in device memory (`--kv-memory device`): equal logits,
             equal bytes through the device pool's copies (read, write, rewind), and decode per
             step at context 64 and 1536 with each ("<export>.pool_<mapped|device>_decode_ms_...")
speculation  greedy replies with `speculate="lookup"` equal plain decoding token for token on
             CUDA (device_tests/speculation.py), decode tokens/s of both
             ("<export>.cuda.speculate_tokens_per_s", "<export>.cuda.plain_tokens_per_s")

Figures are recorded per export: "<export>.<figure>", export "portable" or "ort16".
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
import pytest
from artifacts import take
from graph_nodes import graph_nodes
from memory import MemoryLog
from speculation import check_speculation

from kvedge.contract import ONNX_FILE, Manifest
from kvedge.errors import KvedgeError
from kvedge.planner import check_fits
from kvedge.runtime.backends.ort import OrtBackend
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

pytestmark = pytest.mark.ort_cuda

ATOL = 1e-3  # CUDA fp32 matmuls (TF32 off: `cuda_provider_options`) reduce in another order
FP16_UNIT = 2.0**-11
EXPORTS = {"portable": "portable-2048", "ort16": "ort16-2048"}  # name -> device_tests/artifacts.py's


@pytest.fixture(scope="module", params=sorted(EXPORTS))
def exported(request, tmp_path_factory):
    return take(EXPORTS[request.param], tmp_path_factory.mktemp(f"cuda-{request.param}"))


def _name(folder) -> str:
    return "ort16" if Manifest.load(folder).in_place else "portable"


def _tolerance(folder, reference: np.ndarray) -> float:
    """1e-3 for float32 attention; the float16 bound for the float16 cache (module docstring)."""
    if Manifest.load(folder).geometry.dtype == "float16":
        return 4 * FP16_UNIT * float(reference.max() - reference.min())
    return ATOL


def _ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def test_decode_binds_the_mapped_pool_and_copies_no_cache(exported, tmp_path, record):
    manifest = Manifest.load(exported)
    optimized = tmp_path / "optimized.onnx"
    backend = OrtBackend(exported, manifest, provider="cuda", optimized_model_path=optimized)
    cache = KVCache(manifest.geometry, 1)
    logits = prefill(backend, cache, 0, [_ids(20)])
    decode_one_token(backend, cache, 0, [int(np.argmax(logits))])
    (step,) = backend._decode_bindings.values()
    outputs = step.binding.get_outputs()
    name = _name(exported)
    record(f"{name}.cuda_decode_output_devices", sorted({value.device_name() for value in outputs}))
    assert {value.device_name() for value in outputs} == {"cuda"}
    assert backend.host.nbytes >= cache.nbytes  # the pool is page-locked and mapped
    if manifest.in_place:  # present K/V are the pool itself, written by the op on the device
        views = cache.layer_views(0, 1)
        assert [value.data_ptr() for value in outputs[1:]] == [
            backend.host.device_address(view) for layer in views for view in layer
        ]
    # Memcpy nodes onnxruntime inserted between host and device: none may carry the cache
    nodes = graph_nodes(optimized)
    copies = [(node.op_type, list(node.inputs)) for node in nodes if node.op_type.startswith("Memcpy")]
    record(f"{name}.cuda_memcpy_nodes", copies)
    # nodes onnxruntime left on the CPU (shape arithmetic is allowed there, not a copy)
    on_cpu = sorted({n.op_type for n in nodes if n.domain != "kvedge" and "Memcpy" not in n.op_type})
    record(f"{name}.optimized_op_types", on_cpu)
    layer_names = {
        spec.name for spec in manifest.graph_inputs() + manifest.graph_outputs() if spec.layer is not None
    }
    assert not [c for c in copies if layer_names & set(c[1])], copies
    if manifest.in_place:  # capturable: onnxruntime refuses a CUDA graph with any Memcpy node
        assert not copies, copies
    backend.close()


def test_cuda_matches_cpu(exported, record):
    with Model(exported) as cpu, Model(exported, device="cuda") as gpu:
        ids = _ids(20)
        a = prefill(cpu.backend, cpu.cache, 0, [ids])[0]
        b = prefill(gpu.backend, gpu.cache, 0, [ids])[0]
        worst, atol = 0.0, _tolerance(exported, a)
        for _ in range(16):
            worst = max(worst, float(np.abs(a - b).max()))
            np.testing.assert_allclose(b, a, atol=atol, rtol=0)
            token = int(np.argmax(a))
            assert token == int(np.argmax(b))
            a = decode_one_token(cpu.backend, cpu.cache, 0, [token])[0]
            b = decode_one_token(gpu.backend, gpu.cache, 0, [token])[0]
    record(f"{_name(exported)}.cuda_vs_cpu_max_abs_logit_diff", worst)
    record(f"{_name(exported)}.cuda_vs_cpu_tolerance", atol)


def test_cache_on_equals_cache_off(exported, record):
    with Model(exported, device="cuda") as gpu:
        ids = _ids(40, seed=1)
        cached = [prefill(gpu.backend, gpu.cache, 0, [ids[:20]])[0]]
        cached += [decode_one_token(gpu.backend, gpu.cache, 0, [t])[0] for t in ids[20:]]
        fresh = []
        for n in range(20, 41):
            gpu.cache.reset(0)  # the pool stays where it is mapped; only its valid length restarts
            fresh.append(prefill(gpu.backend, gpu.cache, 0, [ids[:n]])[0])
    diff = float(np.abs(np.stack(cached) - np.stack(fresh)).max())
    record(f"{_name(exported)}.cuda_cache_on_vs_off_max_abs_diff", diff)
    assert diff < _tolerance(exported, np.stack(fresh))


def _decode_ms(model: Model, context: int, steps: int = 32) -> float:
    model.cache.reset(0)
    logits = prefill(model.backend, model.cache, 0, [_ids(context, seed=2)])[0]
    token = int(np.argmax(logits))
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(decode_one_token(model.backend, model.cache, 0, [token])[0]))
    return (time.perf_counter() - start) / steps * 1e3


def test_decode_time_at_long_and_short_context(exported, record):
    for device in ("cuda", "cpu"):
        with Model(exported, device=device) as model:
            _decode_ms(model, 64, steps=4)  # warm-up
            short, long = _decode_ms(model, 64), _decode_ms(model, 1536)
        name = _name(exported)
        record(f"{name}.{device}_decode_ms_context_64", short)
        record(f"{name}.{device}_decode_ms_context_1536", long)
        record(f"{name}.{device}_decode_ratio_1536_over_64", long / short)


def test_decode_time_with_the_pool_mapped_and_in_device_memory(exported, record):
    """The pool in mapped pinned host memory (the default) and in device memory (`--kv-memory
    device`): the same logits (the same kernels over the same bytes: expected equal, held to the
    CUDA-vs-CPU tolerance in case a kernel does not reduce deterministically), the device pool's
    CPU-side copies (a prefix read out and written into another slot, a rewind) giving what the
    mapped pool holds, and decode per step at context 64 and 1536 with each, so the first GPU
    run says which should be the default (docs/JETSON.md)."""
    name, ids = _name(exported), _ids(40, seed=4)
    models = {
        memory: Model(exported, slots=2, device="cuda", kv_memory=memory) for memory in ("mapped", "device")
    }
    try:
        logits = {m: prefill(model.backend, model.cache, 0, [ids])[0] for m, model in models.items()}
        atol = _tolerance(exported, logits["mapped"])  # same kernels, same bytes: expected equal
        record(
            f"{name}.pool_device_vs_mapped_max_abs_logit_diff",
            float(np.abs(logits["device"] - logits["mapped"]).max()),
        )
        np.testing.assert_allclose(logits["device"], logits["mapped"], atol=atol, rtol=0)
        blocks = {}
        for m, model in models.items():
            model.cache.write(1, model.cache.read(0, 30), ids[:30])  # a prefix, as the store moves one
            model.cache.truncate(0, 25)
            blocks[m] = (model.cache.read(0, 25), model.cache.read(1, 30))
        for got, want in zip(blocks["device"], blocks["mapped"], strict=True):
            np.testing.assert_allclose(
                got.kv.astype(np.float32), want.kv.astype(np.float32), atol=atol, rtol=0
            )
        for context in (64, 1536):
            for m, model in models.items():
                _decode_ms(model, context, steps=4)  # warm-up at this context
                record(f"{name}.pool_{m}_decode_ms_context_{context}", _decode_ms(model, context))
    finally:
        for model in models.values():
            model.close()


def _teacher_forced(model: Model, ids: list[int], context: int, steps: int = 8) -> np.ndarray:
    """Decode logits [steps, vocab] after a prefill of ids[:context], forced with ids[context:]."""
    model.cache.reset(0)
    prefill(model.backend, model.cache, 0, [ids[:context]])
    forced = ids[context : context + steps]
    return np.stack([decode_one_token(model.backend, model.cache, 0, [t])[0] for t in forced])


def test_decode_time_with_a_cuda_graph(exported, record):
    """With a CUDA graph where kvedge allows one (the float16 in-place export): replayed decode
    steps, at a context other than the one captured, give the uncaptured steps' logits, and their
    time is the figure. Otherwise the refusal is the figure, with what onnxruntime says when
    asked to capture the graph anyway."""
    name = _name(exported)
    try:
        model = Model(exported, device="cuda", cuda_graph=True)
    except KvedgeError as exc:
        record(f"{name}.cuda_graph_refused_by_kvedge", str(exc))
        try:
            provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"})
            ort.InferenceSession(str(exported / ONNX_FILE), providers=[provider])
            record(
                f"{name}.cuda_graph_onnxruntime_session", "created (kvedge's refusal stands: shapes follow A)"
            )
        except Exception as ort_exc:  # onnxruntime's own reason, whatever its type
            record(f"{name}.cuda_graph_onnxruntime_session", f"{type(ort_exc).__name__}: {ort_exc}"[:400])
        pytest.skip(f"no CUDA graph for this export: {exc}")
    with model, Model(exported, device="cuda") as plain:
        _decode_ms(model, 64, steps=4)  # warm-up: onnxruntime captures after its first runs
        ids = _ids(1600, seed=4)
        for context in (100, 1536):  # neither is the context the graph was captured at
            replayed, uncaptured = _teacher_forced(model, ids, context), _teacher_forced(plain, ids, context)
            diff = float(np.abs(replayed - uncaptured).max())
            record(f"{name}.cuda_graph_vs_plain_max_abs_diff_context_{context}", diff)
            assert diff < ATOL, (context, diff)
        short, long = _decode_ms(model, 64), _decode_ms(model, 1536)
    record(f"{name}.cuda_graph_decode_ms_context_64", short)
    record(f"{name}.cuda_graph_decode_ms_context_1536", long)


def test_memory_at_load_and_first_decode_vs_the_planner(exported, record):
    """Device and host memory from before load to after it, and to the first decode after a
    1536-token prefill (device_tests/memory.py), against the planner's "cuda" terms."""
    log = MemoryLog(record, f"{_name(exported)}.cuda")
    gpu = Model(exported, device="cuda")
    log.mark("load")
    logits = prefill(gpu.backend, gpu.cache, 0, [_ids(1536, seed=3)])
    decode_one_token(gpu.backend, gpu.cache, 0, [int(np.argmax(logits[0]))])
    used = log.mark("first_decode")["device"]
    planned = log.planned(check_fits(exported, 1, 1 << 40, device="cuda"))["total"]
    record(f"{_name(exported)}.cuda_mapped_host_bytes", gpu.backend.host.nbytes)
    record(f"{_name(exported)}.cuda_cache_pool_bytes", gpu.cache.nbytes)
    gpu.close()
    assert used <= planned, f"memory {used} exceeds the planner's {planned}"


def test_models_open_and_close_in_turn_without_712(exported, record):
    """Three models in one process, each closed before the next (the last by `with`): each maps
    its own pool (a freed pool's pages may come back at the same address; unregistered at close,
    CUDA takes them again instead of answering 712) and gives every page lock and buffer back."""
    for _ in range(2):
        model = Model(exported, device="cuda", slots=2)
        prefill(model.backend, model.cache, 1, [_ids(8)])
        assert model.backend.host.nbytes >= model.cache.nbytes
        model.close()
        assert model.backend.host.nbytes == 0
    with Model(exported, device="cuda") as model:
        logits = prefill(model.backend, model.cache, 0, [_ids(8)])
        decode_one_token(model.backend, model.cache, 0, [int(np.argmax(logits))])
        host = model.backend.host
    assert host.nbytes == 0
    record(f"{_name(exported)}.cuda_open_close_cycles", 3)


def test_decode_binding_reads_the_pool_and_step_inputs_as_they_are_now(exported):
    """The same decode binding, run twice after the pool and the step inputs change in place:
    it reads the new values (neither the pool nor a step input was copied at bind time)."""
    with Model(exported, device="cuda") as gpu:
        cache, backend = gpu.cache, gpu.backend
        prefill(backend, cache, 0, [_ids(30, seed=6)])
        n = int(cache.lengths[0])
        views = cache.layer_views(0, 1)

        def step(token: int) -> np.ndarray:
            ids, lengths = np.array([[token]], np.int64), np.array([n], np.int64)
            return backend.run(
                ids, lengths[:, None].copy(), lengths, np.zeros(1, np.int64), views
            ).logits.copy()

        first = step(5)
        assert len(backend._decode_bindings) == 1
        assert np.abs(step(6) - first).max() > 1e-4  # another token, the same binding
        cache.pool[:, 1, 0, :, : n // 2] *= 2  # V of the first half of the slot, every layer
        assert np.abs(step(5) - first).max() > 1e-4
        assert len(backend._decode_bindings) == 1


def test_speculative_greedy_replies_equal_plain(exported, record):
    with Model(exported, slots=2, device="cuda") as model:
        check_speculation(model, record, f"{_name(exported)}.cuda")
