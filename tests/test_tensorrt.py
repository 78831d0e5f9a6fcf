"""The TensorRT path on a machine without TensorRT or a GPU: what it says and refuses, and
`TrtBackend`'s buffer plumbing run against fakes.

The fakes stand in for `tensorrt` and cuda-python's runtime: device pointers are host
pointers (as on a Jetson, where both are one DRAM) and the fake engine computes with
onnxruntime CPU, reading and writing exactly the addresses and shapes the backend bound. That
checks allocation sizes, pool offsets, dtype conversion and profile switching; whether TensorRT
itself builds and runs the graph is device_tests/test_tensorrt.py's job.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import inspect
import json
import logging
import mmap
import subprocess
import sys
import types
from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest
from conftest import random_ids
from cuda_standin import CudaRuntime
from tiny import make_tiny_model

from kvedge.contract import ONNX_FILE, VERIFY_TOKENS, ExportRecipe, Manifest
from kvedge.contract.engine import ENGINE_FILE, ENGINE_MANIFEST_FILE, EngineManifest, GpuInfo
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.export.tensorrt import TIMING_CACHE_FILE, EngineOptions, profile_shapes, require_tensorrt
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import SamplingConfig, decode_one_token, prefill, verify, verify_rows
from kvedge.runtime.interface import Backend, graph_last_index, step_logits


def portable(exported) -> Manifest:
    manifest = Manifest.load(exported.out)
    if manifest.variant != "portable":
        pytest.skip("TensorRT takes the portable graph only")
    return manifest


# the CLI in a Python where neither TensorRT flavour imports, whatever this machine has
WITHOUT_TENSORRT = (
    "import sys; sys.modules['tensorrt'] = sys.modules['tensorrt_rtx'] = None; "
    "from kvedge.cli import main; main()"
)


def test_export_tensorrt_without_tensorrt_says_what_to_install(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_TENSORRT,
            "export",
            "--target",
            "tensorrt",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "TensorRT is not installed" in done.stderr and "JetPack" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before the slow ONNX export


def test_tensorrt_refuses_graphs_it_cannot_take():
    with pytest.raises(KvedgeError, match="runs the portable graph .*only, not --variant 'ort'"):
        require_tensorrt("ort", "last")
    with pytest.raises(KvedgeError, match="needs --logits rows or last, not 'all'"):
        require_tensorrt("portable", "all")


def test_engine_profiles(tiny_llama):
    manifest = portable(tiny_llama)
    g, names = manifest.geometry, manifest.names
    prefill_profile, decode_profile = profile_shapes(manifest, EngineOptions(max_prefill=64, max_batch=4))
    assert prefill_profile[names.input_ids] == ((1, 1), (1, 64), (4, 64))
    assert decode_profile[names.input_ids] == ((1, 1), (4, 1), (4, 1))
    # logits rows: up to VERIFY_TOKENS per sequence on prefill (a speculative verify), one on decode
    assert prefill_profile[names.last_index] == ((1, 1), (1, 1), (4, VERIFY_TOKENS))
    assert decode_profile[names.last_index] == ((1, 1), (4, 1), (4, 1))
    assert decode_profile[names.past_lengths] == ((1,), (4,), (4,))
    one, four = (1, g.num_kv_heads, g.max_len, g.head_dim), g.layer_shape(4)
    last_layer = names.layer(names.past_value, g.num_layers - 1)
    # opt batch agrees across inputs (the real builder refuses otherwise): 1 prefilling, 4 decoding
    assert prefill_profile[last_layer] == (one, one, four)
    assert decode_profile[last_layer] == (one, four, four)
    assert len(prefill_profile) == 4 + 2 * g.num_layers
    with pytest.raises(KvedgeError, match=r"--max-prefill 500 is not allowed; allowed: 1..128"):
        EngineOptions(max_prefill=500).check(manifest)
    # a "last" graph's last_index [batch] has no rows axis
    last = dataclasses.replace(manifest, logits="last")
    prefill_last, decode_last = profile_shapes(last, EngineOptions(max_prefill=64, max_batch=4))
    assert prefill_last[names.last_index] == ((1,), (1,), (4,))
    assert decode_last[names.last_index] == ((1,), (4,), (4,))


def engine_manifest(manifest: Manifest, **changes) -> EngineManifest:
    fields = dict(
        source_fingerprint=manifest.source_fingerprint,
        onnx_fingerprint=manifest.onnx_fingerprint,
        tensorrt_version="10.3.0",
        device_name="Orin",
        compute_capability="8.7",
        multiprocessors=8,
        max_batch=2,
        max_prefill=64,
        precision=manifest.precision,
        strongly_typed=True,
        workspace_bytes=1 << 30,
    )
    return EngineManifest(**{**fields, **changes})


def test_engine_manifest_refuses_another_tensorrt_device_or_model(tmp_path, tiny_llama):
    manifest = Manifest.load(tiny_llama.out)
    (tmp_path / ENGINE_MANIFEST_FILE).write_text(engine_manifest(manifest).to_json())
    loaded = EngineManifest.load(tmp_path)
    assert loaded == engine_manifest(manifest)
    loaded.check_model(manifest)
    loaded.check_runtime("10.3.0", GpuInfo("Orin", "8.7", 8))
    with pytest.raises(
        ArtifactMismatch, match="built with TensorRT 10.3.0, this machine has TensorRT 10.7.0"
    ):
        loaded.check_runtime("10.7.0", GpuInfo("Orin", "8.7", 8))
    with pytest.raises(
        ArtifactMismatch, match=r"built for Orin \(sm_87, 8 SMs\), this machine has Orin \(sm_87, 16"
    ):
        loaded.check_runtime("10.3.0", GpuInfo("Orin", "8.7", 16))
    with pytest.raises(ArtifactMismatch, match="rebuild the engine"):
        engine_manifest(manifest, onnx_fingerprint="0" * 64).check_model(manifest)
    # each refusal names the command a Jetson can run: `kvedge engine` (no torch), not export
    refusals = []
    for call in (
        lambda: loaded.check_runtime("10.7.0", GpuInfo("Orin", "8.7", 8), folder=tmp_path),
        lambda: loaded.check_runtime("10.3.0", GpuInfo("Orin", "8.7", 16), folder=tmp_path),
        lambda: EngineManifest.load(tmp_path / "absent"),
    ):
        with pytest.raises(KvedgeError) as refused:
            call()
        refusals.append(str(refused.value))
    for refusal in refusals:
        assert "kvedge engine " in refusal and "--target tensorrt" not in refusal, refusal
    assert refusals[0].endswith(f"rebuild the engine on this device with `kvedge engine {tmp_path}`")
    assert refusals[2].endswith(f"build one on this device with `kvedge engine {tmp_path / 'absent'}`")


def test_engine_manifest_of_the_wrong_type_or_format_is_refused(tmp_path, tiny_llama):
    good = json.loads(engine_manifest(Manifest.load(tiny_llama.out)).to_json())
    cases = [
        ("[]", "expected a JSON object, found a list"),
        (json.dumps({**good, "max_batch": "2"}), r"Expected `int`, got `str` - at `\$.max_batch`"),
        (json.dumps({**good, "format_version": 7}), "format version 7 does not match this kvedge"),
        (
            json.dumps({**good, "format": "kvedge-manifest"}),
            "format 'kvedge-manifest' is not 'kvedge-engine'",
        ),
    ]
    for text, message in cases:
        (tmp_path / ENGINE_MANIFEST_FILE).write_text(text)
        with pytest.raises(ArtifactMismatch, match=message):
            EngineManifest.load(tmp_path)


def test_engine_rows_speculation_and_which_calls_fit(tmp_path, tiny_llama):
    """An engine manifest written before `max_rows` existed (the same format version) loads as
    one logits row per sequence, as those engines were built: it still decodes, and refuses
    speculation saying why and what to do. `call_refusal` bounds every call by the profiles."""
    manifest = Manifest.load(tiny_llama.out)
    data = json.loads(engine_manifest(manifest).to_json())
    del data["max_rows"]
    (tmp_path / ENGINE_MANIFEST_FILE).write_text(json.dumps(data))
    old = EngineManifest.load(tmp_path)
    old.check_model(manifest)
    assert old.max_rows == 1 and old.call_refusal(2, 64, 1) is None
    refusal = old.verify_refusal()
    needs = f"its prefill profile takes 1 logits row per sequence, a verify needs up to {VERIFY_TOKENS}"
    assert needs in refusal
    assert "it decodes one token per step" in refusal
    assert "rebuild the engine on this device with `kvedge engine" in refusal
    assert "(1 rows)" in old.call_refusal(1, 5, 2)
    built = engine_manifest(manifest, max_rows=VERIFY_TOKENS)  # max_batch 2, max_prefill 64
    assert built.verify_refusal() is None
    assert built.call_refusal(2, 64, VERIFY_TOKENS) is None and built.call_refusal(2, 1, 1) is None
    refusals = {
        (3, 1, 1): "a call of 3 rows x 1 tokens exceeds the engine's profiles (2 rows x 64 tokens)",
        (1, 65, 1): "a call of 1 rows x 65 tokens exceeds",
        (1, 12, VERIFY_TOKENS + 1): f"asking for {VERIFY_TOKENS + 1} logits rows per sequence exceeds the "
        f"engine's profile for it ({VERIFY_TOKENS} rows)",
        (1, 1, 2): "a call of 1 tokens asking for 2 logits rows per sequence exceeds the engine's "
        "profile for it (1 rows)",  # the decode profile
    }
    for call, message in refusals.items():
        assert message in built.call_refusal(*call), call


def test_step_logits_and_last_index_forms(tiny_llama):
    """The rule both backends return logits by (`interface.step_logits`): a row per sequence
    [batch, vocab] for last_index [batch], every row asked for [batch, rows, vocab] for
    last_index [batch, rows], a copy either way; and last_index in the form the graph takes."""
    logits = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)  # [batch, rows, vocab]
    one = step_logits(logits[:, :1], np.array([4, 7]))
    np.testing.assert_array_equal(one, logits[:, 0])
    rows = step_logits(logits, np.array([[0, 1, 2], [3, 4, 5]]))
    np.testing.assert_array_equal(rows, logits)
    column = step_logits(logits[:, :1], np.array([[4], [7]]))
    assert column.shape == (2, 1, 5)
    assert not any(np.shares_memory(out, logits) for out in (one, rows, column))
    manifest = Manifest.load(tiny_llama.out)
    assert manifest.logits == "rows"
    assert graph_last_index(manifest, np.array([4, 7])).shape == (2, 1)
    assert graph_last_index(manifest, np.array([[0, 1, 2], [3, 4, 5]])).shape == (2, 3)
    assert graph_last_index(dataclasses.replace(manifest, logits="last"), np.array([4, 7])).shape == (2,)


# --- TrtBackend against fakes ------------------------------------------------------------------


def _array(address: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype).reshape(shape)


class FakeContext:
    """Runs the ONNX graph on onnxruntime CPU over the addresses and shapes bound to it, holding
    the calls to TensorRT 10's contract: a profile set once per context and used by no other
    context, input shapes within the context's profile, 256-byte aligned addresses (False where
    TensorRT refuses), an integer stream handle; its destruction is logged with CUDA's calls."""

    def __init__(self, engine, strategy="static"):
        self.engine, self.shapes, self.addresses, self.profile = engine, {}, {}, None
        self.strategy, self.device_memory = strategy, None

    def set_device_memory(self, memory, size):
        assert self.strategy == "user_managed", "a context made kSTATIC allocates its own"
        assert size >= self.engine.device_memory_size_v2 and memory % 256 == 0
        self.device_memory = (memory, size)

    def set_optimization_profile_async(self, index, stream):
        assert isinstance(stream, int), "TensorRT's Python API takes the stream as an int"
        if self.engine.profiles_in_use.get(index, id(self)) != id(self):
            return False  # a profile is one context's at a time
        self.engine.profiles_in_use[index] = id(self)
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        assert self.profile is not None, "set a profile first"
        self.engine.setter_calls += 1
        names = self.engine.manifest.names
        if name == names.input_ids and self.profile == 1 and shape[1] > 1:
            return False  # the decode profile's seq axis is 1..1
        if name == names.input_ids:
            batch, seq = shape
            if batch > self.engine.max_batch or seq > self.engine.max_prefill:
                return False  # the batch axis is 1..max_batch, the seq axis 1..max_prefill
        if name == names.last_index and len(shape) == 2:
            if shape[1] > (1 if self.profile == 1 else self.engine.max_rows):
                return False  # the "rows" axis: 1..max_rows on prefill, 1..1 on decode
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        self.engine.setter_calls += 1
        if address % 256:
            return False
        offset = self.engine.cudart.device_offset
        if name in HOST_LOCATED and offset:  # TensorRT would read it as host memory: it must be
            assert address < offset, f"{name} is host-located but was bound at device address {address:#x}"
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream):
        assert isinstance(stream, int), "TensorRT's Python API takes the stream as an int"
        assert self.strategy == "static" or self.device_memory is not None, "USER_MANAGED: no memory set"
        names = self.engine.manifest.names
        assert self.profile == (1 if self.shapes[names.input_ids][1] == 1 else 0), "decode on 1, prefill on 0"
        self.engine.runs.append(self.profile)
        self.engine.calls.append(self.shapes[names.input_ids])
        where = self.engine.host_address
        feeds = {
            i.name: _array(
                where(i.name, self.addresses[i.name]),
                self.shapes[i.name],
                self.engine.get_tensor_dtype(i.name),
            ).astype(ONNX_TYPES[i.type])
            for i in self.engine.session.get_inputs()
        }
        outputs = self.engine.session.run(None, feeds)
        for meta, value in zip(self.engine.session.get_outputs(), outputs, strict=True):
            address = where(meta.name, self.addresses[meta.name])
            _array(address, value.shape, self.engine.get_tensor_dtype(meta.name))[...] = value
        return True

    def __del__(self):
        self.engine.profiles_in_use.pop(self.profile, None)
        self.engine.cudart.log("context destroyed", self.profile)


ONNX_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(int64)": np.int64,
}


class FakeEngine:
    def __init__(self, folder, manifest, cudart):
        self.manifest, self.cudart = manifest, cudart
        self.profiles_in_use: dict[int, int] = {}  # profile -> id() of the context holding it
        self.runs: list[int] = []  # the profile of each execute_async_v3
        self.calls: list[tuple[int, ...]] = []  # and its input_ids shape [batch, seq]
        self.setter_calls = 0  # set_input_shape and set_tensor_address, every context
        self.session = ort.InferenceSession(str(folder / ONNX_FILE), providers=["CPUExecutionProvider"])
        built = EngineManifest.load(folder)  # built together with its manifest
        self.max_rows, self.max_batch, self.max_prefill = built.max_rows, built.max_batch, built.max_prefill
        names = manifest.names
        args = self.session.get_inputs() + self.session.get_outputs()
        self.dtypes = {arg.name: ONNX_TYPES[arg.type] for arg in args}
        # TensorRT 8 turned int64 inputs into int32: exercise the conversion
        self.dtypes.update({n: np.int32 for n in (names.input_ids, names.position_ids, names.past_lengths)})

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    device_memory_size_v2 = 4096  # activation bytes a context needs for its largest profile

    def get_tensor_location(self, name):
        return "host" if name in HOST_LOCATED else "device"

    def is_shape_inference_io(self, name):
        return name in HOST_LOCATED

    def create_execution_context(self, strategy="static"):
        return FakeContext(self, strategy)

    def host_address(self, name, address):
        """Where a bound tensor is in this process: a host-located one at its (host) address, one
        in the stand-in's device memory (`cudaMalloc`: a `--kv-memory device` pool) at its
        backing, a mapped one at its device address less the stand-in's offset."""
        if name in HOST_LOCATED:
            return address
        backing = self.cudart._on_device(address, 1)
        return backing if backing is not None else address - self.cudart.device_offset


# tensors the fake engine reads from host memory (TensorRT's shape inputs); a test sets it
HOST_LOCATED: set[str] = set()


# TensorRT 10.3's NvInfer.h: kEXPLICIT_BATCH = 0 (deprecated, ignored), kSTRONGLY_TYPED = 1
STRONGLY_TYPED = 1


class FakeBuilder:
    """Records what build_engine asks of TensorRT's builder. Its module has no BuilderFlag and no
    layer access: a strongly typed build sets neither a precision flag nor a layer's precision."""

    last: FakeBuilder | None = None

    def __init__(self, logger):
        FakeBuilder.last = self
        self.network_flags: int | None = None
        self.shapes: list[dict] = []
        self.flags: set[str] = set()
        self.cleared: set[str] = set()
        self.limits: dict = {}
        self.attached: object | None = None  # the timing cache set on the config
        self.stale = False  # TensorRT refuses a timing cache made elsewhere (set answers False)
        self.timing_seeds: list[bytes] = []
        self.added: list = []  # the profiles added to the config, in order

    @staticmethod
    def module_attributes() -> dict:
        return dict(
            Builder=FakeBuilder,
            OnnxParser=lambda network, logger: types.SimpleNamespace(
                parse_from_file=lambda path: path.endswith("model.onnx"), num_errors=0
            ),
            MemoryPoolType=types.SimpleNamespace(WORKSPACE="workspace"),
            NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=STRONGLY_TYPED),
            BuilderFlag=types.SimpleNamespace(TF32="tf32"),
        )

    def create_network(self, flags):
        self.network_flags = flags
        return types.SimpleNamespace(get_flag=lambda flag: bool(flags & (1 << flag)))

    def create_optimization_profile(self):
        shapes: dict = {}
        self.shapes.append(shapes)
        return types.SimpleNamespace(
            set_shape=lambda name, low, opt, high: shapes.update({name: (low, opt, high)})
        )

    def create_builder_config(self):
        builder = self

        def create_timing_cache(seed: bytes):
            builder.timing_seeds.append(seed)
            return types.SimpleNamespace(seed=seed, serialize=lambda: b"timing")

        def set_timing_cache(cache, ignore_mismatch: bool) -> bool:  # False: made elsewhere
            if builder.stale and cache.seed:
                return False
            builder.attached = cache
            return True

        return types.SimpleNamespace(
            set_memory_pool_limit=lambda pool, size: builder.limits.update({pool: size}),
            set_flag=builder.flags.add,
            clear_flag=builder.cleared.add,
            # TensorRT answers the new profile's index (-1 for an invalid one)
            add_optimization_profile=lambda profile: builder.added.append(profile) or len(builder.added) - 1,
            create_timing_cache=create_timing_cache,
            set_timing_cache=set_timing_cache,
            get_timing_cache=lambda: builder.attached,  # None while none is set
        )

    def build_serialized_network(self, network, config):
        return b"plan"


def fake_modules(folder, manifest, cudart: CudaRuntime | None = None) -> dict[str, types.ModuleType]:
    runtime = cudart or CudaRuntime()

    def logger(severity):
        return None

    logger.WARNING = 2

    def deserialize(plan):  # the engine file, mapped: its bytes as they are on disk
        assert isinstance(plan, mmap.mmap) and plan[:] == (folder / ENGINE_FILE).read_bytes()
        return FakeEngine(folder, manifest, runtime)

    tensorrt = types.SimpleNamespace(
        __version__="10.3.0",
        Logger=logger,
        TensorLocation=types.SimpleNamespace(DEVICE="device", HOST="host"),
        ExecutionContextAllocationStrategy=types.SimpleNamespace(
            STATIC="static", USER_MANAGED="user_managed"
        ),
        nptype=lambda dtype: dtype,
        Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=deserialize),
        **FakeBuilder.module_attributes(),
    )
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    return {"tensorrt": tensorrt, "cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.runtime": runtime}


def install_fakes(monkeypatch, modules: dict[str, types.ModuleType]) -> None:
    """`modules` in sys.modules, and kvedge told to drive cuda-python's runtime (the stand-in)
    rather than a libcudart this machine may have (`kvedge.accel.import_cudart`)."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("KVEDGE_CUDA_RUNTIME", "cuda-python")


@contextlib.contextmanager
def fake_engine(
    folder, manifest: Manifest, monkeypatch, device_offset: int = 0, host_register: bool = True, **changes
) -> Iterator[CudaRuntime]:
    """A fake `model.engine` and its manifest (`engine_manifest(manifest, **changes)`) in
    `folder`, TensorRT and the CUDA runtime faked in sys.modules (device addresses `device_offset`
    from host ones: 0 as on a Jetson), for the block's TrtBackend; the files are removed afterwards."""
    (folder / ENGINE_MANIFEST_FILE).write_text(engine_manifest(manifest, **changes).to_json())
    (folder / ENGINE_FILE).write_bytes(b"fake plan")
    try:
        cudart = CudaRuntime(device_offset=device_offset, host_register=host_register)
        install_fakes(monkeypatch, fake_modules(folder, manifest, cudart))
        yield cudart
    finally:
        (folder / ENGINE_MANIFEST_FILE).unlink()
        (folder / ENGINE_FILE).unlink()


def _trt_matches_onnxruntime(folder, manifest: Manifest, monkeypatch, atol: float) -> None:
    """TrtBackend over the fake engine against OrtBackend on the CPU: logits and the whole pool."""
    from kvedge.runtime.backends.trt import TrtBackend
    from kvedge.runtime.model import Model

    with fake_engine(folder, manifest, monkeypatch) as cudart:
        trt = TrtBackend(folder, manifest)
        cpu = Model(folder, slots=3)
        trt_cache = KVCache(manifest.geometry, 3)
        assert isinstance(trt, Backend) and isinstance(cpu.backend, Backend)
        trt.reserve(trt_cache.layer_views(0, 3), manifest.geometry.max_len, trt_cache.state_views(0, 3))
        prompts = [random_ids(100, seed=1), random_ids(37, seed=2)]  # 100 > max_prefill: two chunks
        a = prefill(cpu.backend, cpu.cache, 1, prompts, chunk=64)  # the same chunks: equal sums
        b = prefill(trt, trt_cache, 1, prompts, chunk=64)
        for _ in range(6):
            np.testing.assert_allclose(b, a, atol=atol, rtol=0)
            tokens = [int(t) for t in np.argmax(a, axis=-1)]
            a = decode_one_token(cpu.backend, cpu.cache, 1, tokens)
            b = decode_one_token(trt, trt_cache, 1, tokens)
        np.testing.assert_array_equal(trt_cache.lengths, cpu.cache.lengths)
        np.testing.assert_allclose(trt_cache.pool, cpu.cache.pool, atol=atol, rtol=0)
        if manifest.geometry.quantized:
            np.testing.assert_array_equal(trt_cache.scales, cpu.cache.scales)
        for kind, states in cpu.cache.states.items():  # hybrid models: every slot's states
            np.testing.assert_allclose(trt_cache.states[kind], states, atol=atol, rtol=0)
        with pytest.raises(KvedgeError, match="exceeds the engine's profiles"):
            prefill(trt, trt_cache, 0, [[5]] * 3)
        # one context per profile, each set once: prefill ran on 0, decode on 1, no switching
        engine = trt.engine
        assert sorted(engine.profiles_in_use) == [0, 1] and 0 in engine.runs and 1 in engine.runs
        assert engine.profiles_in_use == {profile: id(c) for profile, c in trt.contexts.items()}
        # the two contexts share one activation buffer (they never run at once), not one each
        shared = {c.device_memory for c in trt.contexts.values()}
        assert shared == {(trt.scratch, engine.device_memory_size_v2)} and trt.scratch in cudart.device
        _closes_in_order(trt, cudart)


def _closes_in_order(trt, cudart: CudaRuntime) -> None:
    """`close` stops TensorRT before it gives the memory back: both contexts are destroyed before
    the first unregister or free, every page lock and buffer is released, the stream last."""
    before = len(cudart.events)
    del cudart.events[:before]
    trt.close()
    gc.collect()
    events = [name for name, _ in cudart.events]
    released = [
        i for i, name in enumerate(events) if name in ("cudaHostUnregister", "cudaFreeHost", "cudaFree")
    ]
    assert events.count("context destroyed") == 2 and released, events
    assert max(i for i, name in enumerate(events) if name == "context destroyed") < min(released), events
    assert events[-1] == "cudaStreamDestroy" and cudart.registered == {} and cudart.allocated == {}
    assert cudart.device == {}  # the contexts' activation buffer too
    trt.close()  # twice: nothing left
    with pytest.raises(KvedgeError, match="was closed"):
        trt.run(
            np.zeros((1, 1), np.int64),
            np.zeros((1, 1), np.int64),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            [],
        )


def test_a_host_located_input_is_bound_at_its_host_address(tiny_llama, monkeypatch):
    """TensorRT reads an engine's shape inputs from host memory (`get_tensor_location` HOST), and
    the portable graph's past_lengths feeds shapes; the backend bound every input at its device
    address, which TensorRT would take for a host pointer. With device addresses apart from host
    ones (a discrete GPU), the fake engine checks the host binding and runs on what it reads."""
    from kvedge.runtime.backends.trt import TrtBackend
    from kvedge.runtime.model import Model

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    names = manifest.names
    HOST_LOCATED.add(names.past_lengths)
    try:
        with fake_engine(folder, manifest, monkeypatch, device_offset=1 << 48):  # above any host address
            trt = TrtBackend(folder, manifest)
            assert trt.on_host == {names.past_lengths}
            cpu, cache = Model(folder, slots=1), KVCache(manifest.geometry, 1)
            trt.reserve(cache.layer_views(0, 1), manifest.geometry.max_len)
            prompt = random_ids(20, seed=3)
            want = prefill(cpu.backend, cpu.cache, 0, [prompt])
            np.testing.assert_allclose(prefill(trt, cache, 0, [prompt]), want, atol=1e-5, rtol=0)
            token = [int(np.argmax(want[0]))]
            want = decode_one_token(cpu.backend, cpu.cache, 0, token)
            np.testing.assert_allclose(decode_one_token(trt, cache, 0, token), want, atol=1e-5, rtol=0)
            trt.close()
            HOST_LOCATED.add(names.layer(names.past_key, 0))
            with pytest.raises(KvedgeError, match=r"reads 'past_key_values.0.key' from host memory"):
                TrtBackend(folder, manifest)
    finally:
        HOST_LOCATED.clear()


def test_trt_backend_plumbing_matches_onnxruntime(tiny_llama, monkeypatch):
    _trt_matches_onnxruntime(tiny_llama.out, portable(tiny_llama), monkeypatch, atol=1e-5)


def test_trt_backend_binds_the_int8_pool_and_its_float16_scales(tmp_path, monkeypatch):
    """The INT8 cache through TrtBackend: int8 codes and float16 scales bound from the pool, the
    new tokens' codes and scales read back in their own dtypes; equal to onnxruntime's run."""
    source = make_tiny_model(tmp_path / "hf", "llama")
    export_model(source, tmp_path / "out", ExportRecipe(max_len=128, kv_dtype="int8"))
    manifest = Manifest.load(tmp_path / "out")
    assert manifest.geometry.quantized
    _trt_matches_onnxruntime(tmp_path / "out", manifest, monkeypatch, atol=1e-5)


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_trt_backend_binds_a_hybrids_states_in_place(family, tmp_path, monkeypatch):
    """LFM2's and Qwen3.5's states through TrtBackend: each state layer's past state bound from
    `KVCache.states` by device pointer, the new states read back from their output buffers and
    written to the slots (rows of a padded prefill, idle decode rows kept); logits, pool and
    states equal onnxruntime's run."""
    source = make_tiny_model(tmp_path / "hf", family)
    export_model(source, tmp_path / "out", ExportRecipe(max_len=128))
    manifest = Manifest.load(tmp_path / "out")
    assert manifest.geometry.states
    _trt_matches_onnxruntime(tmp_path / "out", manifest, monkeypatch, atol=1e-5)


def test_both_backends_implement_the_backend_protocol():
    from kvedge.runtime.backends.ort import OrtBackend
    from kvedge.runtime.backends.trt import TrtBackend

    def parameters(function) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    methods = [name for name, value in vars(Backend).items() if inspect.isfunction(value) and name[0] != "_"]
    assert sorted(methods) == ["close", "reserve", "run", "verify_refusal"]
    for cls in (OrtBackend, TrtBackend):
        for name in methods:
            assert parameters(getattr(cls, name)) == parameters(getattr(Backend, name)), (cls, name)


def test_build_engine_asks_tensorrt_for_the_documented_profiles(tiny_llama, tmp_path, monkeypatch):
    from kvedge.export.tensorrt import build_engine

    manifest = portable(tiny_llama)
    install_fakes(monkeypatch, fake_modules(tiny_llama.out, manifest))
    engine = build_engine(tiny_llama.out, tmp_path, max_prefill=64, workspace_bytes=256 << 20, max_batch=2)
    builder = FakeBuilder.last
    assert builder.shapes == profile_shapes(manifest, EngineOptions(max_prefill=64, max_batch=2))
    # strongly typed, and no builder flag at all (TensorRT 11 has no FP16 flag to set)
    assert builder.network_flags == 1 << STRONGLY_TYPED
    assert builder.limits == {"workspace": 256 << 20} and builder.flags == set()
    assert builder.cleared == {"tf32"}  # on by default in TensorRT 10: float32 matmuls stay float32
    assert engine.strongly_typed and engine.precision == "float32"
    assert (tmp_path / ENGINE_FILE).read_bytes() == b"plan"
    recorded = engine_manifest(manifest, workspace_bytes=256 << 20, max_rows=VERIFY_TOKENS)
    assert EngineManifest.load(tmp_path) == engine == recorded
    build_engine(tiny_llama.out, tmp_path, max_prefill=64, workspace_bytes=256 << 20, max_batch=2)
    assert FakeBuilder.last.timing_seeds == [b"timing"]  # the second build starts from the first's cache


def test_a_timing_cache_from_another_gpu_is_replaced_not_fatal(tiny_llama, tmp_path, monkeypatch, caplog):
    """TensorRT refuses a timing cache made on another GPU or TensorRT (set_timing_cache answers
    False); the build then had none, and `get_timing_cache().serialize()` raised after model.engine
    was written but before its manifest. Now a new cache is started and the build completes."""
    from kvedge.export.tensorrt import build_engine

    manifest = portable(tiny_llama)
    install_fakes(monkeypatch, fake_modules(tiny_llama.out, manifest))
    (tmp_path / TIMING_CACHE_FILE).write_bytes(b"from an Orin NX, TensorRT 10.3")
    original = FakeBuilder.__init__

    def stale(self, logger):
        original(self, logger)
        self.stale = True

    monkeypatch.setattr(FakeBuilder, "__init__", stale)
    with caplog.at_level(logging.WARNING, logger="kvedge.export.tensorrt"):
        engine = build_engine(tiny_llama.out, tmp_path, max_prefill=64)
    assert EngineManifest.load(tmp_path) == engine
    assert FakeBuilder.last.timing_seeds == [b"from an Orin NX, TensorRT 10.3", b""]
    assert (tmp_path / TIMING_CACHE_FILE).read_bytes() == b"timing"  # the new cache, written
    assert "made for another GPU or TensorRT; starting a new timing cache" in caplog.text


def test_trt_backend_raises_what_tensorrt_refuses_naming_the_tensor(tiny_llama, monkeypatch):
    """TensorRT's setters answer False (reason in its log): each answer is checked and a refusal
    names the tensor; the memory taken so far is given back."""
    from kvedge.runtime.backends.trt import TrtBackend

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    with fake_engine(folder, manifest, monkeypatch) as cudart:
        trt = TrtBackend(folder, manifest)
        cache = KVCache(manifest.geometry, 1)
        trt.reserve(cache.layer_views(0, 1), manifest.geometry.max_len)
        refused = manifest.names.layer(manifest.names.past_value, 1)
        accept = FakeContext.set_tensor_address
        monkeypatch.setattr(
            FakeContext, "set_tensor_address", lambda self, n, a: n != refused and accept(self, n, a)
        )
        with pytest.raises(KvedgeError, match=rf"TensorRT refused set_tensor_address\('{refused}', 0x"):
            prefill(trt, cache, 0, [random_ids(5)])
        monkeypatch.setattr(FakeContext, "set_optimization_profile_async", lambda self, i, s: False)
        with pytest.raises(KvedgeError, match=r"TensorRT refused set_optimization_profile_async\(0\)"):
            TrtBackend(folder, manifest)

        def raises(self, index, stream):  # TensorRT 10.3's binding (pyCore.cpp) never answers False
            raise RuntimeError("Error in set optimization profile async.")

        monkeypatch.setattr(FakeContext, "set_optimization_profile_async", raises)
        with pytest.raises(KvedgeError) as refused:
            TrtBackend(folder, manifest)
        assert str(refused.value) == (
            "TensorRT refused set_optimization_profile_async(0) (prefill profile): Error in set "
            "optimization profile async.; see its log above"
        )
        trt.close()
        gc.collect()
        assert cudart.registered == {} and cudart.allocated == {} and not cudart.streams


def test_tensorrt_older_than_10_is_refused_naming_both_versions(tiny_llama, tmp_path, monkeypatch):
    """JetPack 6.0's TensorRT 8.6 has no strongly typed networks (kSTRONGLY_TYPED arrived in 9)."""
    from kvedge.export.tensorrt import build_engine

    manifest = portable(tiny_llama)
    modules = fake_modules(tiny_llama.out, manifest)
    modules["tensorrt"].__version__ = "8.6.2"
    install_fakes(monkeypatch, modules)
    with pytest.raises(
        KvedgeError, match=r"TensorRT 8\.6\.2 cannot build .*strongly typed .*TensorRT 10 or newer"
    ):
        build_engine(tiny_llama.out, tmp_path, max_prefill=64, workspace_bytes=256 << 20)
    with pytest.raises(KvedgeError, match=r"TensorRT 8\.6\.2 cannot build"):
        require_tensorrt("portable", "last")
    assert not (tmp_path / ENGINE_FILE).exists()


def test_a_weakly_typed_version_1_engine_manifest_is_refused_naming_both_versions(tmp_path, tiny_llama):
    """Engines built before strong typing (format version 1, the FP16 flag recorded as `fp16`)."""
    data = json.loads(engine_manifest(Manifest.load(tiny_llama.out)).to_json())
    del data["precision"], data["strongly_typed"]
    (tmp_path / ENGINE_MANIFEST_FILE).write_text(json.dumps({**data, "fp16": True, "format_version": 1}))
    with pytest.raises(
        ArtifactMismatch, match=r"format version 1 does not match this kvedge \(2\); rebuild the engine"
    ):
        EngineManifest.load(tmp_path)


def test_trt_backend_verifies_rows_as_onnxruntime_does(tiny_llama, monkeypatch):
    """A speculative verify through TrtBackend (fake engine, module docstring): last_index
    [1, n] bound on the prefill profile into buffers sized for `max_rows`, logits [1, n, vocab]
    and the new K/V equal to OrtBackend's; one row returned in the same form as OrtBackend's
    for last_index [1] and [1, 1]; a call past the profile refused naming the rows."""
    from kvedge.runtime.backends.ort import OrtBackend
    from kvedge.runtime.backends.trt import TrtBackend

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    with fake_engine(folder, manifest, monkeypatch, max_rows=VERIFY_TOKENS):
        cpu, trt = OrtBackend(folder, manifest), TrtBackend(folder, manifest)
        caches = [KVCache(manifest.geometry, 1), KVCache(manifest.geometry, 1)]
        for backend, cache in zip((cpu, trt), caches, strict=True):
            prefill(backend, cache, 0, [random_ids(20, seed=4)])
        tokens = random_ids(VERIFY_TOKENS, seed=5)
        (want, _), (got, _) = (verify(b, c, 0, tokens) for b, c in zip((cpu, trt), caches, strict=True))
        assert got.logits.shape == want.logits.shape == (1, VERIFY_TOKENS, manifest.vocab_size)
        assert trt.engine.runs[-1] == 0  # the prefill profile
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=0)
        for layer_want, layer_got in zip(want.present, got.present, strict=True):
            for a, b in zip(layer_want, layer_got, strict=True):
                np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        length = caches[0].lengths[[0]].copy()  # [1]: verify made nothing valid
        shapes = []
        for last in (np.zeros(1, np.int64), np.zeros((1, 1), np.int64)):
            step = [np.array([[tokens[0]]]), length[:, None].copy(), length, last]
            a = cpu.run(*step, caches[0].layer_views(0, 1)).logits
            b = trt.run(*step, caches[1].layer_views(0, 1)).logits
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
            shapes.append((a.shape, b.shape))
        vocab = manifest.vocab_size
        assert shapes == [((1, vocab), (1, vocab)), ((1, 1, vocab), (1, 1, vocab))]
        with pytest.raises(KvedgeError, match=f"asking for {VERIFY_TOKENS + 1} logits rows per sequence"):
            verify(trt, caches[1], 0, random_ids(VERIFY_TOKENS + 1))
        trt.close()
        cpu.close()


def test_trt_backend_verifies_neighbours_in_one_call_as_onnxruntime_does(tiny_llama, monkeypatch):
    """Three slots' verifies of 2, 9 and 5 tokens in one call (`verify_rows`: right-padded to 9,
    last_index [3, 9]) through TrtBackend (fake engine) on the prefill profile: logits at each
    row's real positions and each row's new K/V equal OrtBackend's; more rows than the engine's
    max_batch refused naming both."""
    from kvedge.runtime.backends.ort import OrtBackend
    from kvedge.runtime.backends.trt import TrtBackend

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    with fake_engine(folder, manifest, monkeypatch, max_rows=VERIFY_TOKENS, max_batch=3):
        cpu, trt = OrtBackend(folder, manifest), TrtBackend(folder, manifest)
        caches = [KVCache(manifest.geometry, 4), KVCache(manifest.geometry, 4)]
        prompts = [random_ids(20, seed=4), random_ids(7, seed=6), random_ids(13, seed=8)]
        for backend, cache in zip((cpu, trt), caches, strict=True):
            prefill(backend, cache, 0, prompts)
        tokens = [random_ids(2, seed=5), random_ids(VERIFY_TOKENS, seed=7), random_ids(5, seed=9)]
        want, ids = verify_rows(cpu, caches[0], 0, tokens)
        got, _ = verify_rows(trt, caches[1], 0, tokens)
        assert ids.shape == (3, VERIFY_TOKENS)
        assert got.logits.shape == want.logits.shape == (3, VERIFY_TOKENS, manifest.vocab_size)
        assert trt.engine.runs[-1] == 0  # the prefill profile
        for r, row in enumerate(tokens):
            n = len(row)
            np.testing.assert_allclose(got.logits[r, :n], want.logits[r, :n], atol=1e-5, rtol=0)
            for layer_want, layer_got in zip(want.present, got.present, strict=True):
                for a, b in zip(layer_want, layer_got, strict=True):  # [rows, kv_heads, n, ...]
                    np.testing.assert_allclose(b[r, :, :n], a[r, :, :n], atol=1e-5, rtol=0)
        with pytest.raises(KvedgeError, match=r"a call of 4 rows x 2 tokens exceeds .*\(3 rows"):
            verify_rows(trt, caches[1], 0, [random_ids(2, seed=s) for s in range(4)])
        trt.close()
        cpu.close()


@pytest.mark.usefixtures("no_loss_pauses")
def test_more_slots_than_the_engine_takes_a_call_decode_in_calls_it_takes(tiny_llama, monkeypatch):
    """`Model(device="tensorrt")` with 3 slots over an engine of max_batch 2 (fake engine; the
    default build is 1): three replies stepping together decode and verify in calls of at most 2
    rows, and each equals its reply decoded alone on the CPU. (Before, the step asked the engine
    for one call of 3 rows and every reply ended in its refusal.)"""
    from kvedge.runtime.model import Model

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    prompts = [random_ids(12, seed=3) * 3, random_ids(10, seed=5) * 2, random_ids(30, seed=7)]

    def replies(model: Model, speculate: str) -> list[list[int]]:
        turns = [
            model.begin(slot, ids, SamplingConfig(max_new_tokens=20, speculate=speculate))
            for slot, ids in enumerate(prompts)
        ]
        got: dict[int, list[int]] = {turn.slot: [] for turn in turns}
        while not all(turn.done for turn in turns):
            result = model.step(turns)
            for turn in turns:
                events = result.emitted(turn)
                assert all(event.finish_reason != "error" for event in events), events[-1].error
                got[turn.slot] += [event.token for event in events]
            assert all(busy + idle <= 2 for busy, idle in result.decode_calls)
        return [got[slot] for slot in range(len(prompts))]

    with Model(folder, slots=1) as cpu:
        alone = []
        for ids in prompts:  # each alone, without speculation
            turn = cpu.begin(0, ids, SamplingConfig(max_new_tokens=20))
            alone.append([])
            while not turn.done:
                alone[-1] += [event.token for event in cpu.step([turn]).emitted(turn)]
    with (
        fake_engine(folder, manifest, monkeypatch, max_rows=VERIFY_TOKENS, max_batch=2),
        Model(folder, device="tensorrt", slots=3) as trt,
    ):
        assert trt.backend.max_batch == 2
        assert replies(trt, "off") == alone
        assert replies(trt, "lookup") == alone
        assert max(batch for batch, _ in trt.backend.engine.calls) == 2  # no call held more
        assert max(rows for rows, _ in trt.speculation_costs.verifies) == 2  # neighbours, two a call


def test_prompts_longer_than_the_engines_max_prefill_prefill_in_chunks_it_takes(tiny_llama, monkeypatch):
    """An engine built with --max-prefill 16 (fake engine; the default is 256, the runtime's
    chunk): a 40-token prompt prefills in chunks of at most 16, through a turn and through
    `prefill` (warm-up, a draft), and the reply equals the CPU's. (Before, every prompt longer
    than 16 tokens ended in the engine's refusal.) Below VERIFY_TOKENS, speculation is off,
    saying why."""
    from kvedge.runtime.model import Model

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    prompt = random_ids(40, seed=1)

    def reply(model: Model) -> list[int]:
        turn = model.begin(0, prompt, SamplingConfig(max_new_tokens=8))
        events = []
        while not turn.done:
            events += model.step([turn]).emitted(turn)
        assert events[-1].finish_reason != "error", events[-1].error
        return [event.token for event in events]

    with Model(folder, slots=2) as cpu:
        want = reply(cpu)
        cpu_logits = prefill(cpu.backend, cpu.cache, 1, [prompt])
    with (
        fake_engine(folder, manifest, monkeypatch, max_prefill=16),
        Model(folder, device="tensorrt", slots=2) as trt,
    ):
        assert trt.backend.max_prefill == 16
        assert reply(trt) == want
        np.testing.assert_allclose(prefill(trt.backend, trt.cache, 1, [prompt]), cpu_logits, atol=1e-4)
        assert max(seq for _, seq in trt.backend.engine.calls) == 16  # no call was longer
    with (
        fake_engine(folder, manifest, monkeypatch, max_prefill=VERIFY_TOKENS - 1),
        Model(folder, device="tensorrt") as trt,
    ):
        said = f"takes {VERIFY_TOKENS - 1} tokens per call, a verify up to {VERIFY_TOKENS}"
        assert said in trt.speculation_refusal()
        assert f"--max-prefill {VERIFY_TOKENS} or more" in trt.speculation_refusal()


def test_a_decode_step_sets_only_what_changed_on_its_context(tiny_llama, monkeypatch):
    """TensorRT keeps input shapes and tensor addresses across execute_async_v3: a decode step
    over the same slots sets none again (SmolLM2 with the INT8 cache made about 370 Python-to-
    TensorRT calls per step), a step over another batch sets what moved, and logits still match."""
    from kvedge.runtime.backends.trt import TrtBackend
    from kvedge.runtime.model import Model

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    with fake_engine(folder, manifest, monkeypatch, max_batch=2):
        trt, cpu = TrtBackend(folder, manifest), Model(folder, slots=2)
        cache = KVCache(manifest.geometry, 2)
        trt.reserve(cache.layer_views(0, 2), manifest.geometry.max_len)
        prompts = [random_ids(9, seed=1), random_ids(5, seed=2)]
        a, b = prefill(cpu.backend, cpu.cache, 0, prompts), prefill(trt, cache, 0, prompts)
        calls = []
        for _ in range(4):
            tokens = [int(t) for t in np.argmax(a, axis=-1)]
            a = decode_one_token(cpu.backend, cpu.cache, 0, tokens)
            before = trt.engine.setter_calls
            b = decode_one_token(trt, cache, 0, tokens)
            calls.append(trt.engine.setter_calls - before)
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
        inputs = len(trt.step_inputs) + len(manifest.names.past(manifest.geometry.quantized)) * len(
            cache.layer_views(0, 2)
        )
        assert calls[0] == 2 * inputs + len(trt.outputs) and calls[1:] == [0, 0, 0], calls
        before = trt.engine.setter_calls
        decode_one_token(trt, cache, 1, [5])  # one row, from slot 1: shapes and pool views move
        assert 0 < trt.engine.setter_calls - before <= 2 * inputs
        trt.close()
        cpu.close()


@pytest.mark.parametrize("kv_memory", ["mapped", "device"])
def test_a_model_dropped_without_close_gives_back_the_gpu(tiny_llama, monkeypatch, kv_memory):
    """A Model never closed (a script, a test): its TensorRT stream and activation buffer, the
    mapped memory and a `--kv-memory device` pool are released when it is collected, the
    contexts before the memory they were given."""
    from kvedge.runtime.model import Model

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    with fake_engine(folder, manifest, monkeypatch) as cudart:
        model = Model(folder, device="tensorrt", kv_memory=kv_memory)
        prefill(model.backend, model.cache, 0, [random_ids(7, seed=1)])
        assert cudart.streams and cudart.device
        del cudart.events[:]
        del model
        gc.collect()
        assert not cudart.streams and cudart.device == {}, cudart.device
        assert cudart.registered == {} and cudart.allocated == {}
        events = [name for name, _ in cudart.events]
        assert max(i for i, name in enumerate(events) if name == "context destroyed") < events.index(
            "cudaFree"
        )


def test_a_gpu_that_cannot_register_host_memory_still_runs_a_device_pool(tiny_llama, monkeypatch):
    """cudaDevAttrHostRegisterSupported 0 refuses the mapped pool only, naming --kv-memory
    device; with the pool in device memory the engine loads and answers as the CPU does."""
    from kvedge.runtime.model import Model

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    prompt = random_ids(20, seed=4)
    with Model(folder) as cpu:
        want = prefill(cpu.backend, cpu.cache, 0, [prompt])
    with fake_engine(folder, manifest, monkeypatch, host_register=False) as cudart:
        with pytest.raises(KvedgeError, match=r"HostRegisterSupported is 0\).*run with --kv-memory device"):
            Model(folder, device="tensorrt")
        assert cudart.registered == {} and cudart.allocated == {} and cudart.device == {}
        with Model(folder, device="tensorrt", kv_memory="device") as trt:
            np.testing.assert_allclose(prefill(trt.backend, trt.cache, 0, [prompt]), want, atol=1e-4)
        assert "cudaHostRegister" not in [name for name, _ in cudart.events]


def test_tensorrt_speculates_with_an_engine_built_for_it_only(tiny_llama, monkeypatch, caplog):
    """`Model(device="tensorrt")` (fake engine): greedy lookup replies equal plain CPU decoding
    token for token when the engine takes `VERIFY_TOKENS` rows; an engine of one row decodes the
    same reply one token per step, says why once, and refuses a verify."""
    from kvedge.runtime.model import Model

    folder, manifest = tiny_llama.out, portable(tiny_llama)
    prompt = random_ids(12, seed=3) * 3  # repeats: lookup proposes from the first step

    def reply(model: Model, speculate: str) -> tuple[list[int], list]:
        turn = model.begin(0, prompt, SamplingConfig(max_new_tokens=30, speculate=speculate))
        tokens, verifies = [], []
        while not turn.done:
            result = model.step([turn])
            tokens += [event.token for event in result.emitted(turn)]
            verifies += result.verify_calls
        return tokens, verifies

    with Model(folder) as cpu:
        plain, _ = reply(cpu, "off")
    with (
        fake_engine(folder, manifest, monkeypatch, max_rows=VERIFY_TOKENS),
        Model(folder, device="tensorrt") as trt,
    ):
        assert trt.speculation_refusal() is None
        fast, verifies = reply(trt, "lookup")
    assert fast == plain and verifies
    with fake_engine(folder, manifest, monkeypatch), Model(folder, device="tensorrt") as trt:
        assert "it decodes one token per step" in trt.speculation_refusal()
        slow, none = reply(trt, "lookup")
        with pytest.raises(KvedgeError, match="speculative decoding is off for this TensorRT engine"):
            verify(trt.backend, trt.cache, 0, prompt[:3])
    assert slow == plain and not none
    assert "speculative decoding is off for this TensorRT engine" in caplog.text
