"""TensorRT engines from an exported artifact folder (`kvedge export --target tensorrt`).

UNVERIFIED ON HARDWARE: written against TensorRT 10's documented Python API (Builder,
OnnxParser, IBuilderConfig, optimization profiles, timing cache); no GPU and no TensorRT were
available when it was written. docs/JETSON.md keeps the list of what has run on a device, and
device_tests/test_tensorrt.py is the check to run first.

Files added to the artifact folder: `model.engine` and `engine_manifest.json` (the contract both
this builder and `kvedge.runtime.trt_backend` follow, in `kvedge.contract.engine`), and::

    timing.cache          TensorRT's timing cache, reused by the next build on the same device

Engine kernels are FP16 (with --fp16), with float32/int I/O as exported. The two optimization
profiles (prefill, decode) are made from the manifest's graph inputs by `profile_shapes`; the
cache inputs keep the exported static length L so the runtime binds its preallocated pool in
place, as it does with onnxruntime.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvedge.contract import ONNX_FILE, PREFILL_CHUNK, Manifest
from kvedge.contract.engine import (
    DECODE_PROFILE,
    ENGINE_FILE,
    ENGINE_MANIFEST_FILE,
    PREFILL_PROFILE,
    EngineManifest,
)
from kvedge.errors import KvedgeError
from kvedge.runtime.cuda import current_device, import_cudart, import_tensorrt

log = logging.getLogger(__name__)

TIMING_CACHE_FILE = "timing.cache"
DEFAULT_WORKSPACE = 1 << 30  # builder scratch; 1 GiB leaves room for weights on an 8 GB Orin Nano


def require_tensorrt(variant: str, logits: str, kv_dtype: str = "float32") -> None:
    """Everything a TensorRT build needs that can be checked before exporting: graph options
    TensorRT can take, and the packages."""
    _check_graph(variant, logits, kv_dtype)
    import_tensorrt()
    import_cudart()


def _check_graph(variant: str, logits: str, kv_dtype: str = "float32") -> None:
    if kv_dtype != "float32":
        raise KvedgeError(
            f"TensorRT builds take a float32 cache for now, not --kv-dtype {kv_dtype!r} (the TensorRT "
            "backend binds float K/V only); export with --kv-dtype float32"
        )
    if variant != "portable":
        raise KvedgeError(
            f"TensorRT builds need the portable graph (standard ONNX ops), not --variant {variant!r}; "
            "export with --variant portable"
        )
    if logits != "last":
        raise KvedgeError(
            f"TensorRT builds need --logits last, not {logits!r}: [batch, seq, vocab] logits for every "
            "prompt position would not fit a small device"
        )


@dataclass(frozen=True)
class EngineOptions:
    max_prefill: int = PREFILL_CHUNK  # longest prefill chunk: the runtime prefills in chunks of it
    max_batch: int = 1  # most sequences per call
    workspace_bytes: int = DEFAULT_WORKSPACE
    fp16: bool = True

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
        _check_graph(manifest.variant, manifest.logits, manifest.geometry.dtype)


Shape = tuple[int, ...]


def profile_shapes(manifest: Manifest, options: EngineOptions) -> list[dict[str, tuple[Shape, Shape, Shape]]]:
    """(min, opt, max) shape of every graph input, for the prefill profile and the decode profile
    (`kvedge.contract.engine`): "batch" axes 1..max_batch, "seq" axes 1..max_prefill or 1."""
    b, p = options.max_batch, options.max_prefill
    profiles: list[dict[str, tuple[Shape, Shape, Shape]]] = [{}, {}]
    for profile, seq, opt_batch in ((PREFILL_PROFILE, p, 1), (DECODE_PROFILE, 1, b)):
        for spec in manifest.graph_inputs():
            # the cache pool's views are bound whole at every batch size: opt is the largest
            opt = spec.shape(b if spec.layer is not None else opt_batch, seq)
            profiles[profile][spec.name] = (spec.shape(1, 1), opt, spec.shape(b, seq))
    return profiles


def build_engine(
    artifact_dir: str | Path,
    out: str | Path | None = None,
    max_prefill: int = PREFILL_CHUNK,
    workspace_bytes: int = DEFAULT_WORKSPACE,
    fp16: bool = True,
    max_batch: int = 1,
) -> EngineManifest:
    """Build `model.engine` + `engine_manifest.json` into `out` (default: the artifact folder)."""
    folder = Path(artifact_dir)
    out = Path(out) if out else folder
    manifest = Manifest.load(folder)
    options = EngineOptions(max_prefill, max_batch, workspace_bytes, fp16)
    options.check(manifest)
    trt = import_tensorrt()
    device = current_device()

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # TensorRT 10 (JetPack 6.1+) has only explicit batch; 8.6 (JetPack 6.0) must be asked for it
    major = int(trt.__version__.split(".")[0])
    flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(folder / ONNX_FILE)):  # also reads model.onnx.data
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise KvedgeError(f"TensorRT cannot parse {folder / ONNX_FILE}: {errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    if options.fp16:
        config.set_flag(trt.BuilderFlag.FP16)
        _keep_reductions_fp32(trt, network, config)
    for shapes in profile_shapes(manifest, options):
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    cache_path = out / TIMING_CACHE_FILE
    timing = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(timing, ignore_mismatch=False)

    log.info("building a TensorRT %s engine for %s (minutes on a Jetson)", trt.__version__, device.describe())
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise KvedgeError("TensorRT could not build the engine; run `kvedge -v export ...` for its log")

    engine = EngineManifest(
        source_fingerprint=manifest.source_fingerprint,
        onnx_fingerprint=manifest.onnx_fingerprint,
        tensorrt_version=trt.__version__,
        device_name=device.name,
        compute_capability=device.compute_capability,
        multiprocessors=device.multiprocessors,
        max_batch=options.max_batch,
        max_prefill=options.max_prefill,
        fp16=options.fp16,
        workspace_bytes=options.workspace_bytes,
    )
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / ENGINE_FILE, memoryview(plan))
    _write_atomic(cache_path, memoryview(config.get_timing_cache().serialize()))
    _write_atomic(out / ENGINE_MANIFEST_FILE, engine.to_json().encode())
    return engine


def _keep_reductions_fp32(trt: Any, network: Any, config: Any) -> None:
    """Ask for float32 in RMSNorm's x**2 and mean and in softmax: activations of a few hundred
    square past float16's 65504. Preferred, not obeyed, so TensorRT may still fall back."""
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.ELEMENTWISE:
            layer.__class__ = trt.IElementWiseLayer  # the Python API's documented downcast
            keep = layer.op == trt.ElementWiseOperation.POW
        else:
            keep = layer.type in (trt.LayerType.REDUCE, trt.LayerType.SOFTMAX)
        if keep:
            layer.precision = trt.float32
            layer.set_output_type(0, trt.float32)
    config.set_flag(trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS)


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
