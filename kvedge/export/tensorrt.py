"""TensorRT engines from an exported artifact folder (`kvedge export --target tensorrt`).

Built with Jetson's (or x86 CUDA's) `tensorrt` where it is installed, else with TensorRT for
RTX's `tensorrt_rtx` (`pip install 'kvedge[trtcheck]'`), whose parser and builder run ahead of
time without a GPU. CI builds every TensorRT-claimed export with the latter
(tests/test_tensorrt_acceptance.py): same ONNX importer, same profiles, same code below. Where
the two APIs differ, `_Flavour` names it. An RTX-built engine does not load on a Jetson
(`EngineManifest.check_runtime` refuses another flavour); there the build is redone with JetPack's
TensorRT, which device_tests/test_tensorrt.py checks against the CPU.

Files added to the artifact folder: `model.engine` and `engine_manifest.json` (the contract both
this builder and `kvedge.runtime.backends.trt` follow, in `kvedge.contract.engine`), and::

    timing.cache          TensorRT's timing cache, reused by the next build on the same device

Every network is strongly typed (`NetworkDefinitionCreationFlag.STRONGLY_TYPED`, TensorRT 10 and
TensorRT for RTX alike; TensorRT 11 has no other kind): each tensor has the dtype the ONNX graph
gives it, so the engine computes in the export's precision (`kvedge export --precision`), float32
islands included, and the engine CI builds with TensorRT for RTX is the one a Jetson builds. No
FP16 builder flag, no per-layer precision: weak typing was deprecated in TensorRT 10.12 and
removed in 11. The engine manifest records the graph's precision and the network's flag. The
two optimization profiles (prefill, decode) are made from the manifest's graph inputs by
`profile_shapes`; the prefill profile takes up to `VERIFY_TOKENS` logits rows per sequence (a
speculative verify), and the engine manifest records that as `max_rows`; the cache inputs keep
the exported static length L so the runtime binds its preallocated pool in place, as it does
with onnxruntime. What the parser rejects is refused with the parser's own reason
(`TensorRT cannot parse ...`), never from a list written beforehand.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvedge.accel import current_device, import_cudart, import_tensorrt_builder
from kvedge.contract import ONNX_FILE, PREFILL_CHUNK, Manifest
from kvedge.contract.engine import (
    DECODE_PROFILE,
    ENGINE_FILE,
    ENGINE_MANIFEST_FILE,
    PREFILL_PROFILE,
    TENSORRT_FLAVOURS,
    EngineManifest,
    GpuInfo,
    ProfileSizes,
    device_refusal,
    logits_rows,
)
from kvedge.errors import KvedgeError
from kvedge.files import new_file

log = logging.getLogger(__name__)

TIMING_CACHE_FILE = "timing.cache"
DEFAULT_WORKSPACE = 1 << 30  # builder scratch; 1 GiB leaves room for weights on an 8 GB Orin Nano
# What an engine built by TensorRT for RTX without a GPU records as its device
AHEAD_OF_TIME = GpuInfo("no GPU (TensorRT for RTX, built ahead of time)", "any", 0)
# Jetson's TensorRT: strongly typed networks arrived in TensorRT 9; JetPack 6.1/6.2 carry 10.3,
# JetPack 6.0 (TensorRT 8.6) cannot build kvedge's engines
MIN_TENSORRT_MAJOR = 10


def require_tensorrt(variant: str, logits: str) -> str:
    """Everything a TensorRT build needs that can be checked before exporting: graph options
    TensorRT can take, and the packages. Returns the flavour that will build."""
    _check_graph(variant, logits)
    trt, flavour = import_tensorrt_builder()
    _Flavour(flavour).require(trt)
    return flavour


def _check_graph(variant: str, logits: str) -> None:
    """Refuses, before an export, a graph `--device tensorrt` would refuse to run (the runtime's
    and the planner's rule, `device_refusal`: the ort variant's onnxruntime ops, which the parser
    refuses too (tests/test_tensorrt_acceptance.py), and "all" logits). The cache dtype does not
    matter to it."""
    refusal = device_refusal("tensorrt", variant, "float32", logits)
    if refusal is not None:
        raise KvedgeError(refusal)


@dataclass(frozen=True)
class EngineOptions(ProfileSizes):
    workspace_bytes: int = DEFAULT_WORKSPACE

    def check(self, manifest: Manifest) -> None:
        max_len = manifest.geometry.max_len
        if not isinstance(self.max_prefill, int) or not 1 <= self.max_prefill <= max_len:
            raise KvedgeError(f"--max-prefill {self.max_prefill!r} is not allowed; allowed: 1..{max_len}")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise KvedgeError(f"--max-batch {self.max_batch!r} is not allowed; allowed: 1 or more")
        if self.workspace_bytes < 64 << 20:
            raise KvedgeError(
                f"--workspace {self.workspace_bytes} bytes is too small; allowed: 64 MiB or more"
            )
        _check_graph(manifest.variant, manifest.logits)


Shape = tuple[int, ...]


def profile_shapes(manifest: Manifest, options: EngineOptions) -> list[dict[str, tuple[Shape, Shape, Shape]]]:
    """(min, opt, max) shape of every graph input, for the prefill profile and the decode profile
    (`kvedge.contract.engine`): "batch" axes 1..max_batch, "seq" axes 1..max_prefill or 1,
    "rows" axes 1..`logits_rows` or 1."""
    b, p, r = options.max_batch, options.max_prefill, logits_rows(manifest)
    profiles: list[dict[str, tuple[Shape, Shape, Shape]]] = [{}, {}]
    # opt: one sequence prefilling a chunk (one logits row), every row decoding. The builder
    # requires one value per named axis at opt, so the cache inputs' "batch" follows the step inputs'.
    for profile, seq, rows, opt_batch in ((PREFILL_PROFILE, p, r, 1), (DECODE_PROFILE, 1, 1, b)):
        for spec in manifest.graph_inputs():
            low, opt, high = spec.shape(1, 1), spec.shape(opt_batch, seq), spec.shape(b, seq, rows)
            profiles[profile][spec.name] = (low, opt, high)
    return profiles


@dataclass(frozen=True)
class _Flavour:
    """Where `tensorrt` (JetPack's TensorRT 10) and `tensorrt_rtx` (TensorRT for RTX 1.x) differ."""

    name: str  # a `TENSORRT_FLAVOURS` key

    @property
    def rtx(self) -> bool:
        return self.name == "tensorrt_rtx"

    def require(self, trt: Any) -> None:
        """TensorRT asks CUDA which GPU it builds for; TensorRT for RTX builds without one."""
        self.check_version(trt)
        if not self.rtx:
            import_cudart()

    def check_version(self, trt: Any) -> None:
        """TensorRT must build strongly typed networks; TensorRT for RTX (versioned 1.x) does."""
        if not self.rtx and int(trt.__version__.split(".")[0]) < MIN_TENSORRT_MAJOR:
            raise KvedgeError(
                f"TensorRT {trt.__version__} cannot build kvedge's strongly typed engines; they need "
                f"TensorRT {MIN_TENSORRT_MAJOR} or newer (JetPack 6.1 and later: TensorRT 10.3)"
            )

    @staticmethod
    def network_flags(trt: Any) -> int:
        """Strongly typed: the same flag on both flavours (TensorRT 11 keeps it, ignored, as
        every network there is strongly typed); explicit batch is the only kind since 10."""
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)

    def gpu(self) -> GpuInfo:
        return AHEAD_OF_TIME if self.rtx else current_device()

    def has_timing_cache(self) -> bool:
        # TensorRT for RTX keeps the calls but makes them no-ops (deprecated since RTX 1.2)
        return not self.rtx


@dataclass
class _Parsed:
    """A network parsed from model.onnx; the parser owns the weights, so it lives as long."""

    trt: Any
    flavour: _Flavour
    builder: Any
    network: Any
    parser: Any
    errors: list[str]  # the parser's, one per error; empty when it parsed

    @property
    def strongly_typed(self) -> bool:
        """What the network itself says of its typing."""
        return bool(self.network.get_flag(self.trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))


def _parse(folder: Path) -> _Parsed:
    trt, name = import_tensorrt_builder()
    flavour = _Flavour(name)
    flavour.check_version(trt)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(flavour.network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    errors: list[str] = []
    if not parser.parse_from_file(str(folder / ONNX_FILE)):  # also reads model.onnx.data
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)] or ["no reason given"]
    return _Parsed(trt, flavour, builder, network, parser, errors)


def parse_errors(artifact_dir: str | Path) -> list[str]:
    """What the installed TensorRT ONNX parser reports on the folder's model.onnx: [] = it parses."""
    return _parse(Path(artifact_dir)).errors


def add_profiles(builder: Any, config: Any, manifest: Manifest, options: EngineOptions) -> list[Any]:
    """Give TensorRT's builder `config` the two optimization profiles (`profile_shapes`), in
    their index order; returns TensorRT's profile objects. TensorRT refuses a shape that
    contradicts another by raising, an invalid profile by answering -1."""
    profiles = []
    for index, shapes in enumerate(profile_shapes(manifest, options)):
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        if config.add_optimization_profile(profile) != index:
            raise KvedgeError(f"TensorRT refused optimization profile {index} ({shapes}); see its log above")
        profiles.append(profile)
    return profiles


def build_engine(
    artifact_dir: str | Path,
    out: str | Path | None = None,
    max_prefill: int = PREFILL_CHUNK,
    workspace_bytes: int = DEFAULT_WORKSPACE,
    max_batch: int = 1,
) -> EngineManifest:
    """Build `model.engine` + `engine_manifest.json` into `out` (default: the artifact folder),
    strongly typed: the engine computes in the graph's precision (`Manifest.precision`)."""
    folder = Path(artifact_dir)
    out = Path(out) if out else folder
    manifest = Manifest.load(folder)
    options = EngineOptions(max_prefill, max_batch, workspace_bytes)
    options.check(manifest)
    parsed = _parse(folder)
    trt, flavour, builder, network = parsed.trt, parsed.flavour, parsed.builder, parsed.network
    if parsed.errors:
        raise KvedgeError(
            f"{TENSORRT_FLAVOURS[flavour.name]} {trt.__version__} cannot parse {folder / ONNX_FILE}: "
            + "; ".join(parsed.errors)
        )
    if not parsed.strongly_typed:
        raise KvedgeError(f"{TENSORRT_FLAVOURS[flavour.name]} {trt.__version__} made a weakly typed network")
    gpu = flavour.gpu()

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    # TF32 is on by default (10.3 and 10.16; strong typing does not clear it): float32 matmuls
    # would round their inputs to 10 mantissa bits, off from what the graph says by ~1e-3
    config.clear_flag(trt.BuilderFlag.TF32)
    add_profiles(builder, config, manifest, options)
    cache_path = out / TIMING_CACHE_FILE
    if flavour.has_timing_cache():
        _attach_timing_cache(config, cache_path)

    log.info(
        "building a strongly typed %s TensorRT %s engine for %s (minutes on a Jetson)",
        manifest.precision,
        trt.__version__,
        gpu.describe(),
    )
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise KvedgeError("TensorRT could not build the engine; run again with `kvedge -v` for its log")

    engine = EngineManifest(
        source_fingerprint=manifest.source_fingerprint,
        onnx_fingerprint=manifest.onnx_fingerprint,
        tensorrt_version=trt.__version__,
        device_name=gpu.name,
        compute_capability=gpu.compute_capability,
        multiprocessors=gpu.multiprocessors,
        max_batch=options.max_batch,
        max_prefill=options.max_prefill,
        precision=manifest.precision,
        strongly_typed=parsed.strongly_typed,
        workspace_bytes=options.workspace_bytes,
        tensorrt_flavour=flavour.name,
        max_rows=logits_rows(manifest),
    )
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / ENGINE_FILE, memoryview(plan))
    _write_atomic(out / ENGINE_MANIFEST_FILE, engine.to_json().encode())
    timing = config.get_timing_cache() if flavour.has_timing_cache() else None
    if timing is not None:  # after the manifest: the cache only speeds up the next build
        try:
            _write_atomic(cache_path, memoryview(timing.serialize()))
        except OSError as exc:
            log.warning("cannot write %s (%s); the next build starts without it", cache_path, exc)
    return engine


def _attach_timing_cache(config: Any, path: Path) -> None:
    """The timing cache in `path` on `config`, or a new one where TensorRT refuses it (made on
    another GPU or by another TensorRT: a folder copied between Orin modules, a JetPack upgrade;
    `set_timing_cache` answers False and the build would otherwise run without any)."""
    blob = path.read_bytes() if path.is_file() else b""
    timing = config.create_timing_cache(blob)
    if timing is not None and config.set_timing_cache(timing, ignore_mismatch=False):
        return
    log.warning("%s was made for another GPU or TensorRT; starting a new timing cache", path)
    config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    handle, tmp = new_file(path.parent, f".{path.name}.")  # readable by the service user
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
