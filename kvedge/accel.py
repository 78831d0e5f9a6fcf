"""The accelerator's Python bindings, imported on demand, and the GPU this process runs on.

Both the engine builder (`kvedge.export.tensorrt`: an engine is built on the device that will run
it) and the runtime's GPU backends (`kvedge.runtime.backends.cuda`, `kvedge.runtime.backends.trt`) import
these helpers, so they live below both. Nothing here imports tensorrt or cuda-python, or loads
libcudart, until a helper is called; each refuses with a KvedgeError saying what to install.
The CUDA runtime is this machine's libcudart through ctypes (`kvedge.cudart`) unless none is
found or $KVEDGE_CUDA_RUNTIME says cuda-python: both answer the same calls the same way.

Engines run only under Jetson's (or x86 CUDA's) `tensorrt`. They are built with it too, or, where
it is absent, with TensorRT for RTX (`tensorrt_rtx`, `pip install 'kvedge[trtcheck]'`), whose
builder needs no GPU: that build proves the graph parses and builds, and its engine is refused
by `TrtBackend` (another flavour), so on a Jetson the build is redone there.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

from kvedge import cudart
from kvedge.contract.engine import GpuInfo
from kvedge.errors import KvedgeError

INSTALL_TENSORRT = (
    "TensorRT is not installed for this Python. On a Jetson it ships with JetPack "
    "(`sudo apt install nvidia-jetpack`; use the system python3, or a venv made with "
    "--system-site-packages); on an x86_64 machine with CUDA: `pip install 'kvedge[trt]'` "
    "(tensorrt and cuda-python). `kvedge doctor` shows what this machine has."
)
INSTALL_TENSORRT_BUILDER = (
    INSTALL_TENSORRT[:-1] + ", and to check a graph parses and builds without a GPU: "
    "`pip install 'kvedge[trtcheck]'` (TensorRT for RTX)."
)
INSTALL_CUDA_PYTHON = (
    "cuda-python is not installed: `pip install cuda-python` of the driver's CUDA major (part of "
    "`pip install 'kvedge[gpu]'` and `'kvedge[trt]'`)"
)
RUNTIME_ENV = "KVEDGE_CUDA_RUNTIME"
RUNTIMES = ("auto", "ctypes", "cuda-python")


def import_tensorrt() -> Any:
    """The `tensorrt` module, or a KvedgeError saying what to install."""
    try:
        import tensorrt
    except ImportError:
        raise KvedgeError(INSTALL_TENSORRT) from None
    return tensorrt


def import_tensorrt_builder() -> tuple[Any, str]:
    """(module, flavour) to build engines with: `tensorrt` where installed, else `tensorrt_rtx`;
    a KvedgeError saying what to install when neither is."""
    try:
        import tensorrt

        return tensorrt, "tensorrt"
    except ImportError:
        pass
    try:
        import tensorrt_rtx

        return tensorrt_rtx, "tensorrt_rtx"
    except ImportError:
        raise KvedgeError(INSTALL_TENSORRT_BUILDER) from None


def import_cudart() -> Any:
    """The CUDA runtime, called as cuda-python's `cuda.bindings.runtime` is: by default this
    machine's libcudart through ctypes (`kvedge.cudart`: JetPack's own on a Jetson), else
    cuda-python's bindings; $KVEDGE_CUDA_RUNTIME=ctypes or cuda-python takes only that one. A
    KvedgeError says what to install, or which library failed to load."""
    choice = os.environ.get(RUNTIME_ENV, "auto")
    if choice not in RUNTIMES:
        raise KvedgeError(f"{RUNTIME_ENV}={choice!r} is not one of {', '.join(RUNTIMES)}")
    if choice == "cuda-python":
        return _import_cuda_python()
    try:
        return cudart.load()
    except KvedgeError as exc:
        if choice == "ctypes" or os.environ.get(cudart.PATH_ENV):
            raise
        missing = str(exc)
    try:
        return _import_cuda_python()
    except KvedgeError as exc:
        raise KvedgeError(f"{missing}; or {exc}") from None


def _import_cuda_python() -> Any:
    """cuda-python's CUDA runtime bindings (`cuda.bindings.runtime`, or `cuda.cudart` before 12.6)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            raise KvedgeError(INSTALL_CUDA_PYTHON) from None
    return runtime


def describe_cudart(runtime: Any) -> str:
    """Which CUDA runtime `runtime` (from `import_cudart`) is: the libcudart and how it was found,
    or cuda-python's distribution and version."""
    if isinstance(runtime, cudart.CudaRuntime):
        return f"ctypes over {runtime.path} ({runtime.found_by})"
    for dist in ("cuda-python", "cuda-bindings"):
        try:
            return f"cuda-python ({dist} {importlib.metadata.version(dist)}, {runtime.__name__})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"cuda-python ({getattr(runtime, '__name__', type(runtime).__name__)})"


def cuda_call(cudart: Any, result: tuple, what: str) -> Any:
    """Unpack a CUDA runtime result `(error, value...)`, raising on any error."""
    error, *values = result
    if error != cudart.cudaError_t.cudaSuccess:
        _, message = cudart.cudaGetErrorString(error)
        raise KvedgeError(f"{what} failed: {message.decode() if isinstance(message, bytes) else message}")
    return values[0] if len(values) == 1 else tuple(values)


def current_device(cudart: Any | None = None, index: int = 0) -> GpuInfo:
    cudart = cudart or import_cudart()
    props = cuda_call(cudart, cudart.cudaGetDeviceProperties(index), "cudaGetDeviceProperties")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return GpuInfo(name.rstrip("\x00").strip(), f"{props.major}.{props.minor}", props.multiProcessorCount)
