"""One backend choice (`--device cpu|cuda|tensorrt`) and the binding plan.

Without a GPU here: the refusals are checked as a user meets them (one line naming what to
install or build), and the decode step's binding plan is checked on onnxruntime's real I/O
binding: what is bound where, that the pool is read and written in place, and that no
cache-sized array is made per step. The CUDA plan (`binding_plan(..., "cuda", ...)`) is the same
pure description the CUDA path binds from, so it is checked here too: every past/present tensor
is the pool, bound by device address, and nothing cache-sized is bound as host memory or
copied per step. That onnxruntime honours it on a GPU is device_tests/'s to check.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import random_ids

from kvedge.contract import EXPORTED_KV_DTYPES, LOGITS_MODES, VARIANTS
from kvedge.contract.engine import device_refusal
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.ort import (
    CALL,
    POOL,
    STEP,
    OrtBackend,
    binding_plan,
    cuda_provider_options,
    cuda_refusal,
    onnxruntime_cuda_refusal,
    preload_cuda_libraries,
)
from kvedge.runtime.generate import decode_one_token, prefill, verify
from kvedge.runtime.model import Model


def cli(*args: str) -> subprocess.CompletedProcess:
    # neither TensorRT flavour imports, whatever this machine has
    hide = "import sys; sys.modules['tensorrt'] = None; from kvedge.cli import main; main()"
    return subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=300)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_device_refusals_name_what_to_install_or_build(tiny_llama):
    unknown = cli("generate", "--model", str(tiny_llama.out), "--device", "npu", "hi")
    assert unknown.returncode == 2 and "'npu' is not one of 'cpu', 'cuda', 'tensorrt'" in unknown.stderr
    with pytest.raises(
        KvedgeError, match=r"--device 'npu' is not supported; allowed: \['cpu', 'cuda', 'tensorrt'\]"
    ):
        Model(tiny_llama.out, device="npu")
    out = str(tiny_llama.out)
    cuda = one_line_error(cli("generate", "--model", out, "--device", "cuda", "hi"))
    engine = one_line_error(cli("chat", "--model", out, "--device", "tensorrt"))
    if tiny_llama.model().manifest.in_place:  # refused for what it is, before any package is named
        assert "--device cuda cannot run this 'ort'-variant export" in cuda
        assert "--device tensorrt runs the portable graph (standard ONNX ops) only" in engine
        return
    assert "CUDAExecutionProvider is not available here" in cuda and "onnxruntime-gpu" in cuda
    assert "--device tensorrt needs" in engine and f"on this device with `kvedge engine {out}`" in engine
    (tiny_llama.out / "model.engine").write_bytes(b"an engine")
    try:
        trt = one_line_error(cli("generate", "--model", out, "--device", "tensorrt", "hi"))
        assert "TensorRT is not installed" in trt and "JetPack" in trt
    finally:
        (tiny_llama.out / "model.engine").unlink()


def test_one_rule_says_which_device_runs_which_export():
    """`device_refusal`, which the runtime and the planner both ask: the CPU runs every export;
    cuda the portable graph and the float16-cache `ort` graph; tensorrt the portable graph without
    "all" logits. The exporter's own TensorRT check, which builds no engine for what it refuses,
    refuses exactly the same."""
    from kvedge.export.tensorrt import _check_graph

    for variant, kv_dtype, logits in itertools.product(VARIANTS, EXPORTED_KV_DTYPES, LOGITS_MODES):
        assert device_refusal("cpu", variant, kv_dtype, logits) is None
        cuda = device_refusal("cuda", variant, kv_dtype, logits)
        assert (cuda is None) == (variant == "portable" or kv_dtype == "float16"), (variant, kv_dtype)
        try:
            _check_graph(variant, logits)
            built = True
        except KvedgeError:
            built = False
        assert (device_refusal("tensorrt", variant, kv_dtype, logits) is None) == built, (variant, logits)
    with pytest.raises(KvedgeError, match=r"--device 'npu' is not allowed; allowed: \['cpu', 'cuda'"):
        device_refusal("npu", "portable", "float32", "rows")


def test_serve_config_takes_a_device(tiny_llama, tmp_path):
    from kvedge.serve.config import load_service_config

    assert load_service_config(None, {"model": tiny_llama.out}).device == "cpu"
    assert load_service_config(None, {"model": tiny_llama.out, "device": "tensorrt"}).device == "tensorrt"
    (tmp_path / "service.yaml").write_text(f"model: {tiny_llama.out}\ndevice: gpu\n")
    with pytest.raises(KvedgeError, match="device.*one of \\['cpu', 'cuda', 'tensorrt'\\]"):
        load_service_config(tmp_path / "service.yaml", {})


def test_decode_binding_plan_reads_and_writes_the_pool_in_place(tiny_llama):
    """Decode binds by pointer once: logits and (in-place graphs) present K/V are the pool's
    own memory, per-step scratch is one token wide, the past inputs are the pool (changing the
    pool changes the next logits with no rebinding), and 40 steps allocate nothing cache-sized."""
    model = tiny_llama.model(slots=2)
    backend, cache, g = model.backend, model.cache, model.manifest.geometry
    logits = prefill(backend, cache, 0, [random_ids(30, seed=3)])
    decode_one_token(backend, cache, 0, [int(np.argmax(logits))])
    bindings = list(backend._decode_bindings.values())  # the one-row binding, and reserve()'s of both slots
    (step,) = [b for b in bindings if b.input_ids.shape[0] == 1]
    outputs = step.binding.get_outputs()  # onnxruntime's own record of what is bound
    assert {value.device_name() for value in outputs} == {"cpu"}
    addresses = [value.data_ptr() for value in outputs]
    # the plan the binding was made from is the pure one, and onnxruntime holds what it says
    assert step.plan == binding_plan(model.manifest, "cpu", "decode", 1)
    planned = [bound for bound in step.plan if bound.output]
    assert [bound.name for bound in planned] == [spec.name for spec in model.manifest.graph_outputs()]
    assert [(b.memory, list(b.shape), b.nbytes) for b in planned] == [
        (value.device_name(), value.shape(), int(np.prod(value.shape())) * np.dtype(b.dtype).itemsize)
        for b, value in zip(planned, outputs, strict=True)
    ]
    owned = {array.ctypes.data for array in step.owned}
    for bound, address in zip(planned, addresses, strict=True):  # STEP: made once with the binding
        assert (address in owned) == (bound.buffer == STEP), bound
    assert {bound.buffer for bound in planned[1:]} == {POOL if model.manifest.in_place else STEP}
    assert addresses[0] == step.logits.ctypes.data  # [1, 1, vocab], rewritten each step
    views = cache.layer_views(0, 1)  # per layer (K, V) [1, kvh, max_len, d] views of the pool
    if model.manifest.in_place:
        assert addresses[1:] == [view.ctypes.data for layer in views for view in layer]
    else:  # the new token's K/V [1, kvh, 1, d] per layer, copied into the pool by KVCache.append
        one_token = g.num_kv_heads * g.head_dim * np.dtype(g.dtype).itemsize
        assert [value.shape() for value in outputs[1:]] == [[1, g.num_kv_heads, 1, g.head_dim]] * (
            2 * g.num_layers
        )
        assert all(np.prod(value.shape()) * 4 == one_token for value in outputs[1:])

    slot_bytes = g.num_kv_heads * g.max_len * g.head_dim * np.dtype(g.dtype).itemsize  # one layer's K
    token = int(np.argmax(logits))
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(40):
            token = int(np.argmax(decode_one_token(backend, cache, 0, [token])[0]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - start < slot_bytes, (peak - start, slot_bytes)  # a copy of one view would not fit
    assert list(backend._decode_bindings.values()) == bindings  # nothing rebound
    assert [value.data_ptr() for value in step.binding.get_outputs()] == addresses

    # the bound past inputs are the pool itself: change it, and the same binding sees it
    n = int(cache.lengths[0])
    ids, lengths = np.array([[token]], np.int64), np.array([n], np.int64)

    def run() -> np.ndarray:
        return backend.run(ids, lengths[:, None].copy(), lengths, np.zeros(1, np.int64), views).logits.copy()

    before = run()
    np.testing.assert_array_equal(run(), before)
    cache.pool[:, 1, 0, :, : n // 2] *= 2  # V of the first half of slot 0, every layer
    assert np.abs(run() - before).max() > 1e-4
    assert list(backend._decode_bindings.values()) == bindings


def test_bench_and_plan_take_the_device(tiny_llama):
    from kvedge.bench import BenchConfig
    from kvedge.bench.systems import SystemSpec
    from kvedge.planner import OVERHEADS, check_fits

    with pytest.raises(KvedgeError, match=r"--device 'npu' is not supported; allowed: \['cpu', 'cuda'"):
        BenchConfig(device="npu")
    spec = SystemSpec("kvedge portable", "kvedge", tiny_llama.out, "float32", device="cuda")
    in_place = tiny_llama.model().manifest.in_place
    refused = "cannot run this 'ort'" if in_place else "CUDAExecutionProvider is not"
    with pytest.raises(KvedgeError, match=refused):
        spec.build(1)
    assert SystemSpec("kvedge", "kvedge", tiny_llama.out, "float32").build(1).backend.manifest
    # the planner's overheads by device: cuda and tensorrt are the GPU preset
    assert OVERHEADS["cuda"] == OVERHEADS["tensorrt"] != OVERHEADS["cpu"]
    gpu = check_fits(tiny_llama.out, 1, 1 << 40, device="tensorrt")
    assert gpu.runtime == OVERHEADS["tensorrt"].runtime_bytes


def test_short_calls_keep_their_binding_and_rewrite_its_values(tiny_llama):
    """In-place graphs keep the binding of a call of up to VERIFY_TOKENS tokens (a verify, a
    draft's catch-up) per shape and slot, as decode's: later calls of that shape, with other
    tokens at another past length, give the logits decode steps give for those tokens (to
    1e-4: a float cache's attention adds up one row and several differently, ~1e-6)."""
    model = tiny_llama.model(slots=2)
    backend, cache = model.backend, model.cache
    ids = random_ids(24, seed=5)
    prefill(backend, cache, 1, [ids[:12]])
    for past in (12, 14, 13):  # the same shape each time: 5 tokens, logits at each
        cache.truncate(1, 12)
        if past > 12:
            prefill(backend, cache, 1, [ids[12:past]])
        rows = verify(backend, cache, 1, ids[past : past + 5])[0].logits[0]
        if model.manifest.in_place:  # one binding for the 5-token calls (and one per prefill shape)
            assert [key[:3] for key in backend._short_bindings].count((1, 5, 5)) == 1
        steps = [decode_one_token(backend, cache, 1, [token])[0] for token in ids[past : past + 5]]
        np.testing.assert_allclose(rows, np.stack(steps), atol=1e-4, rtol=0)


def test_cuda_binding_plan_binds_the_pool_and_copies_nothing_cache_sized(tiny_llama):
    """For provider "cuda" (no GPU needed: the plan is pure): decode binds every past/present
    tensor to the pool on the device and everything else to step buffers on the device, so
    onnxruntime copies nothing between host and device per step; prefill adds only per-call,
    prompt-sized host arrays. In-place exports are refused, naming why."""
    manifest = tiny_llama.model().manifest
    g = manifest.geometry
    if manifest.in_place:  # float32 GroupQueryAttention has no CUDA kernel: it would copy the cache
        with pytest.raises(
            KvedgeError, match=r"--device cuda cannot run this 'ort'-variant export.*portable"
        ):
            binding_plan(manifest, "cuda", "decode", 1)
        return
    names = manifest.names
    layer_names = {
        names.layer(template, i)
        for template in names.past(g.quantized) + names.present(g.quantized)
        for i in range(g.num_layers)
    }
    slot_bytes = g.num_kv_heads * g.max_len * g.head_dim * np.dtype(g.dtype).itemsize  # one layer's K
    for batch in (1, 2):
        decode = binding_plan(manifest, "cuda", "decode", batch)
        assert {b.name for b in decode} == {
            s.name for s in manifest.graph_inputs() + manifest.graph_outputs()
        }
        assert {b.memory for b in decode} == {"cuda"} and CALL not in {b.buffer for b in decode}
        pool = [b for b in decode if b.buffer == POOL]
        assert {b.name for b in pool} == {b.name for b in decode if b.name in layer_names and not b.output}
        assert all(b.shape == (batch, g.num_kv_heads, g.max_len, g.head_dim) for b in pool)
        # the portable graph's present: the new token only, one token wide, into a step buffer
        present = [b for b in decode if b.output and b.name in layer_names]
        assert present and all(b.buffer == STEP and b.shape[2] == 1 for b in present)
        assert all(b.nbytes < slot_bytes for b in decode if b.buffer == STEP)
        # the CPU plan is the same buffers, on the host
        cpu = binding_plan(manifest, "cpu", "decode", batch)
        assert [(b.name, b.buffer, b.shape) for b in cpu] == [(b.name, b.buffer, b.shape) for b in decode]
        assert {b.memory for b in cpu} == {"cpu"}

    prefill = binding_plan(manifest, "cuda", "prefill", 1, seq=8)
    assert [b for b in prefill if b.buffer == POOL] == [
        b for b in binding_plan(manifest, "cuda", "decode", 1) if b.buffer == POOL
    ]
    calls = [b for b in prefill if b.buffer == CALL]
    assert {b.memory for b in calls} == {"cpu"} and STEP not in {b.buffer for b in prefill}
    longer = [b for b in binding_plan(manifest, "cuda", "prefill", 1, seq=16) if b.buffer == CALL]
    for short, long in zip(calls, longer, strict=True):  # per call: follows the prompt, never the context
        assert long.nbytes in (short.nbytes, 2 * short.nbytes) and short.nbytes < slot_bytes, short
    # a verify's (kept, as decode's): every buffer on the device, the per-call ones verify-sized
    verify = binding_plan(manifest, "cuda", "verify", 1, seq=5, rows=5)
    assert {b.memory for b in verify} == {"cuda"} and CALL not in {b.buffer for b in verify}
    assert [b for b in verify if b.buffer == POOL] == [b for b in prefill if b.buffer == POOL]
    assert {b.name: b.shape for b in verify}[names.input_ids] == (1, 5)
    assert {b.name: b.shape for b in verify}[names.logits][:2] == (1, 5)
    with pytest.raises(
        KvedgeError, match=r"binding phase 'chunk' is unknown; allowed: \['decode', 'prefill', 'verify'\]"
    ):
        binding_plan(manifest, "cuda", "chunk", 1)


def test_cuda_graph_refusals(tiny_llama):
    """`cuda_graph` is refused where no capture could be right, before anything loads."""
    with pytest.raises(
        KvedgeError, match=r"^cuda_graph \(CUDA graph capture\) applies to --device cuda only$"
    ):
        Model(tiny_llama.out, cuda_graph=True)
    manifest = tiny_llama.model().manifest
    want = "cannot run this 'ort'-variant export" if manifest.in_place else "cannot capture a portable graph"
    with pytest.raises(KvedgeError, match=want):
        OrtBackend(tiny_llama.out, manifest, provider="cuda", cuda_graph=True)


def test_step_inputs_are_bound_again_before_every_decode_step(tiny_llama, monkeypatch):
    """onnxruntime copies an input at bind time wherever one of its consumers reads it on another
    device (IOBinding::BindInput -> utils::CopyOneInputAcrossDevices): bound once, a step input
    would be read as the first step left it. The plan marks exactly the inputs decode rewrites per
    step (`rebind`), on cpu and cuda alike, and nothing of prefill (bound anew each call); the
    decode step binds those again before every run, as onnxruntime's own IOBinding records."""
    manifest = tiny_llama.model().manifest
    step_inputs = {spec.name for spec in manifest.graph_inputs() if spec.layer is None}
    providers = ["cpu"] + ([] if cuda_refusal(manifest) else ["cuda"])
    for provider in providers:
        for batch in (1, 2):
            plan = binding_plan(manifest, provider, "decode", batch)
            assert {b.name for b in plan if b.rebind} == step_inputs
            assert all(b.buffer == STEP and not b.output for b in plan if b.rebind)
        assert not [b for b in binding_plan(manifest, provider, "prefill", 1, seq=8) if b.rebind]

    model = tiny_llama.model()
    bound: list[str] = []
    make = model.backend.session.io_binding

    def recording_binding() -> ort.IOBinding:
        binding = make()
        real = binding.bind_input
        binding.bind_input = lambda name, *args: bound.append(name) or real(name, *args)
        return binding

    monkeypatch.setattr(model.backend.session, "io_binding", recording_binding)
    model.backend._decode_bindings.clear()
    logits = prefill(model.backend, model.cache, 0, [random_ids(12, seed=5)])
    token = int(np.argmax(logits))
    steps = []
    for step in range(4):
        bound.clear()
        steps.append(token)
        token = int(np.argmax(decode_one_token(model.backend, model.cache, 0, [token])[0]))
        if step:  # the first step made the binding; each later one binds the step inputs again
            assert sorted(bound) == sorted(step_inputs), bound
    # and what each step read was that step's token: the same logits as a fresh prefill
    model.cache.reset(0)
    fresh = prefill(model.backend, model.cache, 0, [random_ids(12, seed=5) + steps])
    assert int(np.argmax(fresh)) == token


def test_cuda_floor_and_provider_options():
    """onnxruntime-gpu older than 1.20 (no GroupQueryAttention prefill on top of a past) is
    refused naming both versions; TF32 is off on the CUDA provider."""
    message = onnxruntime_cuda_refusal("1.19.2")
    assert "onnxruntime 1.19.2 is older than 1.20" in message and "onnxruntime-gpu>=1.20" in message
    for version in ("1.20.0", "1.20.1", "1.31.1", "2.0.0", "1.21.0.dev20250101"):
        assert onnxruntime_cuda_refusal(version) is None, version
    assert cuda_provider_options(False) == {"use_tf32": "0"}
    assert cuda_provider_options(True) == {"use_tf32": "0", "enable_cuda_graph": "1"}


def test_preloading_cuda_libraries_is_harmless_without_cuda(capfd):
    """The cuda backend preloads onnxruntime-gpu's CUDA and cuDNN libraries (onnxruntime 1.21+'s
    preload_dlls, for pip-installed CUDA); on a CPU onnxruntime the same call loads and prints
    nothing (onnxruntime 1.23's preload_dlls warned there), so a CPU-only install that reaches it
    is unharmed."""
    assert hasattr(ort, "preload_dlls")  # the constraints' onnxruntime has it: the call is made
    before = Path("/proc/self/maps").read_text()
    preload_cuda_libraries()
    assert "libcudart" not in Path("/proc/self/maps").read_text().replace(before, "")
    assert capfd.readouterr() == ("", "")


def test_a_closed_model_refuses_to_run_and_closes_twice(tiny_llama):
    with tiny_llama.model() as model:
        prefill(model.backend, model.cache, 0, [random_ids(4)])
    with pytest.raises(KvedgeError, match="backend was closed"):
        prefill(model.backend, model.cache, 0, [random_ids(4)])
    model.close()
