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
import gc
import inspect
import json
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

from kvedge.contract import ONNX_FILE, Manifest
from kvedge.contract.engine import ENGINE_FILE, ENGINE_MANIFEST_FILE, DeviceInfo, EngineManifest
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import ExportOptions, export_model
from kvedge.export.tensorrt import EngineOptions, profile_shapes, require_tensorrt
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.interface import Backend


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
    with pytest.raises(KvedgeError, match="need the portable graph .*not --variant 'ort'"):
        require_tensorrt("ort", "last")
    with pytest.raises(KvedgeError, match="need --logits rows or last, not 'all'"):
        require_tensorrt("portable", "all")


def test_engine_profiles(tiny_llama):
    manifest = portable(tiny_llama)
    g, names = manifest.geometry, manifest.names
    prefill_profile, decode_profile = profile_shapes(manifest, EngineOptions(max_prefill=64, max_batch=4))
    assert prefill_profile[names.input_ids] == ((1, 1), (1, 64), (4, 64))
    assert decode_profile[names.input_ids] == ((1, 1), (4, 1), (4, 1))
    assert prefill_profile[names.last_index] == ((1, 1), (1, 1), (4, 1))  # rows: one per sequence
    assert decode_profile[names.past_lengths] == ((1,), (4,), (4,))
    one, four = (1, g.num_kv_heads, g.max_len, g.head_dim), g.layer_shape(4)
    last_layer = names.layer(names.past_value, g.num_layers - 1)
    # opt batch agrees across inputs (the real builder refuses otherwise): 1 prefilling, 4 decoding
    assert prefill_profile[last_layer] == (one, one, four)
    assert decode_profile[last_layer] == (one, four, four)
    assert len(prefill_profile) == 4 + 2 * g.num_layers
    with pytest.raises(KvedgeError, match=r"--max-prefill 500 is not allowed; allowed: 1..128"):
        EngineOptions(max_prefill=500).check(manifest)


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
    loaded.check_runtime("10.3.0", DeviceInfo("Orin", "8.7", 8))
    with pytest.raises(
        ArtifactMismatch, match="built with TensorRT 10.3.0, this machine has TensorRT 10.7.0"
    ):
        loaded.check_runtime("10.7.0", DeviceInfo("Orin", "8.7", 8))
    with pytest.raises(
        ArtifactMismatch, match=r"built for Orin \(sm_87, 8 SMs\), this machine has Orin \(sm_87, 16"
    ):
        loaded.check_runtime("10.3.0", DeviceInfo("Orin", "8.7", 16))
    with pytest.raises(ArtifactMismatch, match="rebuild the engine"):
        engine_manifest(manifest, onnx_fingerprint="0" * 64).check_model(manifest)


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

    def __init__(self, engine):
        self.engine, self.shapes, self.addresses, self.profile = engine, {}, {}, None

    def set_optimization_profile_async(self, index, stream):
        assert isinstance(stream, int), "TensorRT's Python API takes the stream as an int"
        if self.engine.profiles_in_use.get(index, id(self)) != id(self):
            return False  # a profile is one context's at a time
        self.engine.profiles_in_use[index] = id(self)
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        assert self.profile is not None, "set a profile first"
        if name == self.engine.manifest.names.input_ids and self.profile == 1 and shape[1] > 1:
            return False  # the decode profile's seq axis is 1..1
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        if address % 256:
            return False
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream):
        assert isinstance(stream, int), "TensorRT's Python API takes the stream as an int"
        names = self.engine.manifest.names
        assert self.profile == (1 if self.shapes[names.input_ids][1] == 1 else 0), "decode on 1, prefill on 0"
        self.engine.runs.append(self.profile)
        feeds = {
            i.name: _array(
                self.addresses[i.name], self.shapes[i.name], self.engine.get_tensor_dtype(i.name)
            ).astype(ONNX_TYPES[i.type])
            for i in self.engine.session.get_inputs()
        }
        outputs = self.engine.session.run(None, feeds)
        for meta, value in zip(self.engine.session.get_outputs(), outputs, strict=True):
            _array(self.addresses[meta.name], value.shape, self.engine.get_tensor_dtype(meta.name))[...] = (
                value
            )
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
        self.session = ort.InferenceSession(str(folder / ONNX_FILE), providers=["CPUExecutionProvider"])
        names = manifest.names
        args = self.session.get_inputs() + self.session.get_outputs()
        self.dtypes = {arg.name: ONNX_TYPES[arg.type] for arg in args}
        # TensorRT 8 turned int64 inputs into int32: exercise the conversion
        self.dtypes.update({n: np.int32 for n in (names.input_ids, names.position_ids, names.past_lengths)})

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    def create_execution_context(self):
        return FakeContext(self)


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
        self.limits: dict = {}
        self.timing_seeds: list[bytes] = []

    @staticmethod
    def module_attributes() -> dict:
        return dict(
            Builder=FakeBuilder,
            OnnxParser=lambda network, logger: types.SimpleNamespace(
                parse_from_file=lambda path: path.endswith("model.onnx"), num_errors=0
            ),
            MemoryPoolType=types.SimpleNamespace(WORKSPACE="workspace"),
            NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=STRONGLY_TYPED),
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
        cache = types.SimpleNamespace(serialize=lambda: b"timing")
        return types.SimpleNamespace(
            set_memory_pool_limit=lambda pool, size: builder.limits.update({pool: size}),
            set_flag=builder.flags.add,
            add_optimization_profile=lambda profile: None,
            create_timing_cache=lambda seed: builder.timing_seeds.append(seed) or cache,
            set_timing_cache=lambda cache, ignore_mismatch: None,
            get_timing_cache=lambda: cache,
        )

    def build_serialized_network(self, network, config):
        return b"plan"


def fake_modules(folder, manifest, cudart: CudaRuntime | None = None) -> dict[str, types.ModuleType]:
    runtime = cudart or CudaRuntime()

    def logger(severity):
        return None

    logger.WARNING = 2
    tensorrt = types.SimpleNamespace(
        __version__="10.3.0",
        Logger=logger,
        nptype=lambda dtype: dtype,
        Runtime=lambda logger: types.SimpleNamespace(
            deserialize_cuda_engine=lambda data: FakeEngine(folder, manifest, runtime)
        ),
        **FakeBuilder.module_attributes(),
    )
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    return {"tensorrt": tensorrt, "cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.runtime": runtime}


@contextlib.contextmanager
def fake_engine(folder, manifest: Manifest, monkeypatch) -> Iterator[CudaRuntime]:
    """A fake `model.engine` and its manifest in `folder`, TensorRT and the CUDA runtime faked in
    sys.modules, for the block's TrtBackend; the files are removed afterwards."""
    (folder / ENGINE_MANIFEST_FILE).write_text(engine_manifest(manifest).to_json())
    (folder / ENGINE_FILE).write_bytes(b"fake plan")
    try:
        cudart = CudaRuntime()
        for name, module in fake_modules(folder, manifest, cudart).items():
            monkeypatch.setitem(sys.modules, name, module)
        yield cudart
    finally:
        (folder / ENGINE_MANIFEST_FILE).unlink()
        (folder / ENGINE_FILE).unlink()


def _trt_matches_onnxruntime(folder, manifest: Manifest, monkeypatch, atol: float) -> None:
    """TrtBackend over the fake engine against OrtBackend on the CPU: logits and the whole pool."""
    from kvedge.runtime.model import Model
    from kvedge.runtime.trt_backend import TrtBackend

    with fake_engine(folder, manifest, monkeypatch) as cudart:
        trt = TrtBackend(folder, manifest)
        cpu = Model(folder, slots=3)
        trt_cache = KVCache(manifest.geometry, 3)
        assert isinstance(trt, Backend) and isinstance(cpu.backend, Backend)
        trt.reserve(trt_cache.layer_views(0, 3), manifest.geometry.max_len)
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
        with pytest.raises(KvedgeError, match="exceeds the engine's profiles"):
            prefill(trt, trt_cache, 0, [[5]] * 3)
        # one context per profile, each set once: prefill ran on 0, decode on 1, no switching
        engine = trt.engine
        assert sorted(engine.profiles_in_use) == [0, 1] and 0 in engine.runs and 1 in engine.runs
        assert engine.profiles_in_use == {profile: id(c) for profile, c in trt.contexts.items()}
        _closes_in_order(trt, cudart)


def _closes_in_order(trt, cudart: CudaRuntime) -> None:
    """`close` stops TensorRT before it gives the memory back: both contexts are destroyed before
    the first unregister or free, every page lock and buffer is released, the stream last."""
    before = len(cudart.events)
    del cudart.events[:before]
    trt.close()
    gc.collect()
    events = [name for name, _ in cudart.events]
    released = [i for i, name in enumerate(events) if name in ("cudaHostUnregister", "cudaFreeHost")]
    assert events.count("context destroyed") == 2 and released, events
    assert max(i for i, name in enumerate(events) if name == "context destroyed") < min(released), events
    assert events[-1] == "cudaStreamDestroy" and cudart.registered == {} and cudart.allocated == {}
    trt.close()  # twice: nothing left
    with pytest.raises(KvedgeError, match="was closed"):
        trt.run(
            np.zeros((1, 1), np.int64),
            np.zeros((1, 1), np.int64),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            [],
        )


def test_trt_backend_plumbing_matches_onnxruntime(tiny_llama, monkeypatch):
    _trt_matches_onnxruntime(tiny_llama.out, portable(tiny_llama), monkeypatch, atol=1e-5)


def test_trt_backend_binds_the_int8_pool_and_its_float16_scales(tmp_path, monkeypatch):
    """The INT8 cache through TrtBackend: int8 codes and float16 scales bound from the pool, the
    new tokens' codes and scales read back in their own dtypes; equal to onnxruntime's run."""
    source = make_tiny_model(tmp_path / "hf", "llama")
    export_model(source, tmp_path / "out", ExportOptions(max_len=128, kv_dtype="int8"))
    manifest = Manifest.load(tmp_path / "out")
    assert manifest.geometry.quantized
    _trt_matches_onnxruntime(tmp_path / "out", manifest, monkeypatch, atol=1e-5)


def test_both_backends_implement_the_backend_protocol():
    from kvedge.runtime.backend import OrtBackend
    from kvedge.runtime.trt_backend import TrtBackend

    def parameters(function) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    methods = [name for name, value in vars(Backend).items() if inspect.isfunction(value) and name[0] != "_"]
    assert sorted(methods) == ["close", "reserve", "run"]
    for cls in (OrtBackend, TrtBackend):
        for name in methods:
            assert parameters(getattr(cls, name)) == parameters(getattr(Backend, name)), (cls, name)


def test_build_engine_asks_tensorrt_for_the_documented_profiles(tiny_llama, tmp_path, monkeypatch):
    from kvedge.export.tensorrt import build_engine

    manifest = portable(tiny_llama)
    for name, module in fake_modules(tiny_llama.out, manifest).items():
        monkeypatch.setitem(sys.modules, name, module)
    engine = build_engine(tiny_llama.out, tmp_path, max_prefill=64, workspace_bytes=256 << 20, max_batch=2)
    builder = FakeBuilder.last
    assert builder.shapes == profile_shapes(manifest, EngineOptions(max_prefill=64, max_batch=2))
    # strongly typed, and no builder flag at all (TensorRT 11 has no FP16 flag to set)
    assert builder.network_flags == 1 << STRONGLY_TYPED
    assert builder.limits == {"workspace": 256 << 20} and builder.flags == set()
    assert engine.strongly_typed and engine.precision == "float32"
    assert (tmp_path / ENGINE_FILE).read_bytes() == b"plan"
    assert EngineManifest.load(tmp_path) == engine == engine_manifest(manifest, workspace_bytes=256 << 20)
    build_engine(tiny_llama.out, tmp_path, max_prefill=64, workspace_bytes=256 << 20, max_batch=2)
    assert FakeBuilder.last.timing_seeds == [b"timing"]  # the second build starts from the first's cache


def test_trt_backend_raises_what_tensorrt_refuses_naming_the_tensor(tiny_llama, monkeypatch):
    """TensorRT's setters answer False (reason in its log): each answer is checked and a refusal
    names the tensor; the memory taken so far is given back."""
    from kvedge.runtime.trt_backend import TrtBackend

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
        trt.close()
        gc.collect()
        assert cudart.registered == {} and cudart.allocated == {} and not cudart.streams


def test_tensorrt_older_than_10_is_refused_naming_both_versions(tiny_llama, tmp_path, monkeypatch):
    """JetPack 6.0's TensorRT 8.6 has no strongly typed networks (kSTRONGLY_TYPED arrived in 9)."""
    from kvedge.export.tensorrt import build_engine

    manifest = portable(tiny_llama)
    modules = fake_modules(tiny_llama.out, manifest)
    modules["tensorrt"].__version__ = "8.6.2"
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
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
