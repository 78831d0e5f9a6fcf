"""TensorRT and CUDA runtime bindings, imported on demand, and the GPU this process runs on.

Run-time helpers: `TrtBackend` uses all of them, `OrtBackend` on CUDA uses `MappedHost`; the
engine builder (`kvedge.export.tensorrt`) imports `import_tensorrt_builder` and `current_device`
from here, since an engine is built on the device that will run it. Nothing here is imported
unless a GPU path is taken.

Engines run only under Jetson's (or x86 CUDA's) `tensorrt`. They are built with it too, or, where
it is absent, with TensorRT for RTX (`tensorrt_rtx`, `pip install 'kvedge[trtcheck]'`), whose
builder needs no GPU: that build proves the graph parses and builds, and its engine is refused
by `TrtBackend` (another flavour), so on a Jetson the build is redone there.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

from kvedge.contract.engine import DeviceInfo
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
    "cuda-python is not installed: `pip install cuda-python` (the CUDA runtime bindings the GPU "
    "backends map the cache pool with; part of `pip install 'kvedge[gpu]'` and `'kvedge[trt]'`)."
)


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
    """cuda-python's CUDA runtime bindings (`cuda.bindings.runtime`, or `cuda.cudart` before 12.6)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            raise KvedgeError(INSTALL_CUDA_PYTHON) from None
    return runtime


def cuda_call(cudart: Any, result: tuple, what: str) -> Any:
    """Unpack a cuda-python result `(error, value...)`, raising on any error."""
    error, *values = result
    if error != cudart.cudaError_t.cudaSuccess:
        _, message = cudart.cudaGetErrorString(error)
        raise KvedgeError(f"{what} failed: {message.decode() if isinstance(message, bytes) else message}")
    return values[0] if len(values) == 1 else tuple(values)


def current_device(cudart: Any | None = None, index: int = 0) -> DeviceInfo:
    cudart = cudart or import_cudart()
    props = cuda_call(cudart, cudart.cudaGetDeviceProperties(index), "cudaGetDeviceProperties")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return DeviceInfo(name.rstrip("\x00").strip(), f"{props.major}.{props.minor}", props.multiProcessorCount)


class MappedHost:
    """Host memory the GPU reads and writes where it is: page-locked and mapped into the device's
    address space, so a kernel given its device address reaches the host pages themselves and
    nothing is copied. On Jetson, CPU and GPU share one DRAM, so this is the GPU's own memory;
    on a discrete GPU the same memory is reached over PCIe: correct, but every access crosses
    the bus.

    Two kinds of mapping, and `device_address` of any view into either:
      - arrays kvedge already owns (the `KVCache` pool and its scales) are page-locked in place
        once, with cudaHostRegister(Mapped), at the first `device_address` of a view into them;
      - step buffers are allocated here, zeroed (`empty`: cudaHostAlloc(Mapped)), and given back
        with `release`.
    `close` unregisters and frees everything; the arrays from `empty` are invalid afterwards.
    """

    def __init__(self, cudart: Any | None = None) -> None:
        self.cudart = cudart or import_cudart()
        supported = self._call(
            self.cudart.cudaDeviceGetAttribute(
                self.cudart.cudaDeviceAttr.cudaDevAttrHostRegisterSupported, 0
            ),
            "cudaDeviceGetAttribute(HostRegisterSupported)",
        )
        if not supported:
            raise KvedgeError("this GPU cannot map host memory (cudaHostRegister); the GPU backends need it")
        # (host start, host end, device start, allocated here) of every mapping, registered or allocated
        self._mappings: list[tuple[int, int, int, bool]] = []

    def _call(self, result: tuple, what: str) -> Any:
        return cuda_call(self.cudart, result, what)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zeroed array of `shape` in mapped pinned memory, for `device_address` to bind."""
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        host = int(
            self._call(self.cudart.cudaHostAlloc(nbytes, self.cudart.cudaHostAllocMapped), "cudaHostAlloc")
        )
        device = self._call(self.cudart.cudaHostGetDevicePointer(host, 0), "cudaHostGetDevicePointer")
        self._mappings.append((host, host + nbytes, int(device), True))
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(host))
        array = raw[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        array[...] = 0
        return array

    def device_address(self, view: np.ndarray) -> int:
        """The device address of `view`'s first element; a view into memory not yet mapped
        page-locks the whole array it belongs to, once."""
        address = view.ctypes.data
        for start, end, device, _ in self._mappings:
            if start <= address < end:
                return device + (address - start)
        root = view
        while isinstance(root.base, np.ndarray):
            root = root.base
        start = root.ctypes.data & ~(mmap.PAGESIZE - 1)
        end = -(-(root.ctypes.data + root.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._call(
            self.cudart.cudaHostRegister(start, end - start, self.cudart.cudaHostRegisterMapped),
            "cudaHostRegister(cache pool)",
        )
        device = self._call(self.cudart.cudaHostGetDevicePointer(start, 0), "cudaHostGetDevicePointer")
        self._mappings.append((start, end, int(device), False))
        return int(device) + (address - start)

    @property
    def nbytes(self) -> int:
        """Host bytes page-locked and mapped (registered arrays and allocated buffers)."""
        return sum(end - start for start, end, _, _ in self._mappings)

    def release(self, array: np.ndarray) -> None:
        """Free a buffer from `empty`; `array` is invalid afterwards."""
        address = array.ctypes.data
        for mapping in self._mappings:
            if mapping[3] and mapping[0] == address:
                self._mappings.remove(mapping)
                self._call(self.cudart.cudaFreeHost(address), "cudaFreeHost")
                return
        raise KvedgeError(f"buffer at {address:#x} was not allocated by this MappedHost")

    def close(self) -> None:
        """Unregister the registered arrays and free the allocated buffers."""
        for start, _, _, allocated in self._mappings:
            if allocated:
                self.cudart.cudaFreeHost(start)
            else:
                self.cudart.cudaHostUnregister(start)
        self._mappings.clear()
