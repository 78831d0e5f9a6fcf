"""Which backend runs on which `--device`: `open_backend`, the one place that knows both
backends. `kvedge.runtime.backends.ort` (onnxruntime) and `kvedge.runtime.backends.trt` (TensorRT)
import neither this module nor each other; each is imported only when asked for, so a broken
onnxruntime (JetPack 6's wheels under numpy 2: "_ARRAY_API not found") does not stop a
TensorRT engine from loading.
"""

from __future__ import annotations

from pathlib import Path

from kvedge.contract import Manifest
from kvedge.contract.engine import DEVICES, ENGINE_FILE, build_here, device_refusal
from kvedge.errors import KvedgeError
from kvedge.runtime.interface import MAX_DECODE_BINDINGS, Backend


def open_backend(
    folder: Path,
    manifest: Manifest,
    device: str = "cpu",
    threads: int | None = None,
    max_decode_bindings: int = MAX_DECODE_BINDINGS,
    cuda_graph: bool = False,
) -> Backend:
    """The backend `device` (a `DEVICES` name) runs on; where a piece is missing, a KvedgeError
    in one line naming what to install or build. `cuda_graph`: capture decode (cuda only)."""
    if device not in DEVICES:
        raise KvedgeError(f"--device {device!r} is not supported; allowed: {list(DEVICES)}")
    if refusal := device_refusal(device, manifest.variant, manifest.geometry.dtype, manifest.logits):
        raise KvedgeError(refusal)
    if device != "tensorrt":
        from kvedge.runtime.backends.ort import OrtBackend

        return OrtBackend(
            folder,
            manifest,
            threads=threads,
            provider=device,
            max_decode_bindings=max_decode_bindings,
            cuda_graph=cuda_graph,
        )
    if cuda_graph:
        raise KvedgeError("cuda_graph (CUDA graph capture) applies to --device cuda only")
    if not (folder / ENGINE_FILE).is_file():
        raise KvedgeError(
            f"--device tensorrt needs {folder / ENGINE_FILE}; build it on this device with "
            + build_here(folder)
        )
    from kvedge.runtime.backends.trt import TrtBackend

    return TrtBackend(folder, manifest)
