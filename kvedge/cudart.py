"""The CUDA runtime through ctypes: the machine's own libcudart, called as cuda-python's
`cuda.bindings.runtime` is, so the GPU paths (`kvedge.runtime.backends.cuda`, `kvedge.runtime.backends.trt`,
`kvedge.export.tensorrt`) take either without a change.

Why: PyPI's aarch64 cuda-bindings carries a CUDA runtime of its own, built for SBSA servers, and
on L4T its first call meets a driver it was not built against; jetson-containers builds
cuda-python from source for that reason. JetPack's libcudart is the one NVIDIA built and tested
with JetPack's driver, and the one onnxruntime-gpu and TensorRT on the device load too.

The convention, cuda-python's: every call answers a tuple `(error, value...)`, `error` a
`cudaError_t` (a plain int for a code this module does not name); pointers are ints; a stream is
an int handle. Only the entry points kvedge calls are bound, each with the argument types of its
prototype in `cuda_runtime_api.h` (checked against CUDA 12.9's and 13.0's), so ctypes converts
`size_t` and `unsigned int` arguments as C does and a wrong Python type is a TypeError, never a
corrupted call.

`cudaGetDeviceProperties` answers name, major, minor and multiProcessorCount only. The struct
`cudaDeviceProp` changes size from release to release (1,032 bytes in 12.9, 1,008 in 13.0, and
CUDA 12's library exports the old layout as `cudaGetDeviceProperties`, the new one as `_v2`), so
it is never declared here: the call writes into an opaque buffer far larger than any release's
struct, of which only `name` is read (`char name[256]`, the first field in every release); the
numbers come from cudaDeviceGetAttribute, whose attribute values are fixed.

Which library, in this order (`locate`): $KVEDGE_CUDART (a path); JetPack's (or the CUDA
toolkit's) /usr/local/cuda/lib64, then /usr/local/cuda-*/targets/aarch64-linux/lib; the dynamic
loader's (`ctypes.util.find_library`); NVIDIA's pip wheel (nvidia-cuda-runtime-cu12's
nvidia/cuda_runtime/lib, nvidia-cuda-runtime 13's nvidia/cu13/lib), except on a Tegra
(/etc/nv_tegra_release), where PyPI's aarch64 wheel is the SBSA build named above.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import glob
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvedge.errors import KvedgeError

PATH_ENV = "KVEDGE_CUDART"
TOOLKIT_DIRS = ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/aarch64-linux/lib")
VERSIONED_DIRS = "/usr/local/cuda-*/targets/aarch64-linux/lib"  # newest first
WHEEL_DIRS = (("nvidia", "cu13", "lib"), ("nvidia", "cuda_runtime", "lib"))
TEGRA_RELEASE = Path("/etc/nv_tegra_release")  # L4T's: a Jetson, whose CUDA is JetPack's
PROPS_BUFFER = 8192  # bytes; any release's cudaDeviceProp is about 1 KiB

cudaHostAllocMapped = 0x02  # noqa: N816 (CUDA's names, as cuda-python spells them)
cudaHostRegisterMapped = 0x02  # noqa: N816
cudaMemAttachGlobal = 0x01  # noqa: N816


class cudaError_t(enum.IntEnum):  # noqa: N801
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInitializationError = 3
    cudaErrorInvalidPitchValue = 12
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100
    cudaErrorInvalidDevice = 101
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorHostMemoryNotRegistered = 713


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class cudaDeviceAttr(enum.IntEnum):  # noqa: N801
    cudaDevAttrMultiProcessorCount = 16
    cudaDevAttrCanMapHostMemory = 19
    cudaDevAttrComputeCapabilityMajor = 75
    cudaDevAttrComputeCapabilityMinor = 76
    cudaDevAttrHostRegisterSupported = 99


@dataclass(frozen=True)
class DeviceProperties:
    """The fields of cudaDeviceProp kvedge reads, under cuda-python's names."""

    name: bytes
    major: int
    minor: int
    multiProcessorCount: int  # noqa: N815


_P = ctypes.c_void_p
_OUT_P = ctypes.POINTER(ctypes.c_void_p)
_OUT_INT = ctypes.POINTER(ctypes.c_int)
_OUT_SIZE = ctypes.POINTER(ctypes.c_size_t)
_SIZE, _UINT, _INT = ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
# name -> argument types, from cuda_runtime_api.h; every one returns cudaError_t (an int)
PROTOTYPES: dict[str, list] = {
    "cudaRuntimeGetVersion": [_OUT_INT],
    "cudaDriverGetVersion": [_OUT_INT],
    "cudaGetDeviceCount": [_OUT_INT],
    "cudaSetDevice": [_INT],
    "cudaDeviceGetAttribute": [_OUT_INT, _INT, _INT],  # (value*, cudaDeviceAttr, device)
    "cudaDeviceSynchronize": [],
    "cudaMemGetInfo": [_OUT_SIZE, _OUT_SIZE],
    "cudaMalloc": [_OUT_P, _SIZE],
    "cudaMallocManaged": [_OUT_P, _SIZE, _UINT],
    "cudaFree": [_P],
    "cudaMemset": [_P, _INT, _SIZE],
    "cudaMemcpy": [_P, _P, _SIZE, _INT],
    "cudaMemcpy2D": [_P, _SIZE, _P, _SIZE, _SIZE, _SIZE, _INT],
    "cudaHostAlloc": [_OUT_P, _SIZE, _UINT],
    "cudaFreeHost": [_P],
    "cudaHostRegister": [_P, _SIZE, _UINT],
    "cudaHostUnregister": [_P],
    "cudaHostGetDevicePointer": [_OUT_P, _P, _UINT],
    "cudaStreamCreate": [_OUT_P],
    "cudaStreamSynchronize": [_P],
    "cudaStreamDestroy": [_P],
}


def _candidates() -> list[tuple[str, str]]:
    """(path, how it was found) of every libcudart this machine offers, in the order tried."""
    return [(path, how) for path, how in _everywhere() if not _sbsa_on_tegra(how)]


def _sbsa_on_tegra(how: str) -> bool:
    """A pip wheel's libcudart on a Jetson: PyPI's aarch64 CUDA wheels are SBSA server builds."""
    return how == "NVIDIA's pip wheel" and TEGRA_RELEASE.exists()


def _everywhere() -> list[tuple[str, str]]:
    found = []
    for folder in [*TOOLKIT_DIRS, *sorted(glob.glob(VERSIONED_DIRS), reverse=True)]:
        found += [(path, f"in {folder}") for path in _libraries_in(folder)]
    loader = ctypes.util.find_library("cudart")
    if loader:
        found.append((loader, "the dynamic loader's (ctypes.util.find_library)"))
    for parts in WHEEL_DIRS:
        spec = importlib.util.find_spec(parts[0])
        for root in (spec.submodule_search_locations or []) if spec else []:
            folder = os.path.join(root, *parts[1:])
            found += [(path, "NVIDIA's pip wheel") for path in _libraries_in(folder)]
    return found


def _libraries_in(folder: str) -> list[str]:
    """libcudart.so.N (the soname) before libcudart.so.N.M.P, before the unversioned dev link."""
    names = sorted(glob.glob(os.path.join(folder, "libcudart.so.[0-9]*")), key=lambda p: (len(p), p))
    return names + glob.glob(os.path.join(folder, "libcudart.so"))


def locate() -> tuple[str, str]:
    """(path of the libcudart to drive, where it was found), or a KvedgeError naming where it looked."""
    given = os.environ.get(PATH_ENV)
    if given:
        if not Path(given).is_file():
            raise KvedgeError(f"{PATH_ENV}={given}: no such file (the path of a libcudart.so)")
        return given, f"${PATH_ENV}"
    found = _candidates()
    if not found:
        refused = [path for path, how in _everywhere() if _sbsa_on_tegra(how)]
        if refused:
            raise KvedgeError(
                f"no libcudart of JetPack's found, and NVIDIA's pip wheel ({refused[0]}) is an SBSA server "
                f"build, not used on a Jetson ({TEGRA_RELEASE}): `sudo apt install nvidia-jetpack` "
                "(/usr/local/cuda/lib64), `pip uninstall nvidia-cuda-runtime-cu12`"
            )
        raise KvedgeError(
            "no libcudart found (in /usr/local/cuda/lib64, /usr/local/cuda-*/targets/aarch64-linux/lib, "
            f"the dynamic loader's path, NVIDIA's nvidia-cuda-runtime wheel): set {PATH_ENV} to one, install "
            "JetPack's CUDA (`sudo apt install nvidia-jetpack`) or `pip install nvidia-cuda-runtime-cu12`"
        )
    return found[0]


def load() -> CudaRuntime:
    """The runtime of `locate()`'s libcudart (one per library per process)."""
    return _load(*locate())


@functools.cache
def _load(path: str, found_by: str) -> CudaRuntime:
    try:
        library = ctypes.CDLL(path)
    except OSError as exc:
        raise KvedgeError(f"cannot load the CUDA runtime {path} ({found_by}): {exc}") from None
    missing = [name for name in PROTOTYPES if not hasattr(library, name)]
    if missing:
        raise KvedgeError(f"{path} is not a CUDA runtime library: it lacks {', '.join(missing)}")
    return CudaRuntime(library, path, found_by)


class CudaRuntime:
    """One libcudart, bound: `cuda.bindings.runtime`'s calls kvedge makes, same arguments, same
    `(error, value...)` answers."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaDeviceAttr = cudaDeviceAttr
    cudaHostAllocMapped = cudaHostAllocMapped
    cudaHostRegisterMapped = cudaHostRegisterMapped
    cudaMemAttachGlobal = cudaMemAttachGlobal

    def __init__(self, library: ctypes.CDLL, path: str, found_by: str) -> None:
        self.library, self.path, self.found_by = library, path, found_by
        for name, argtypes in PROTOTYPES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        library.cudaGetErrorString.argtypes, library.cudaGetErrorString.restype = [_INT], ctypes.c_char_p
        # CUDA 12 exports the pre-12 struct layout as cudaGetDeviceProperties, its own as _v2
        self._properties = (
            getattr(library, "cudaGetDeviceProperties_v2", None) or library.cudaGetDeviceProperties
        )
        self._properties.argtypes, self._properties.restype = [_P, _INT], ctypes.c_int

    def __repr__(self) -> str:
        return f"CudaRuntime({self.path!r}, {self.found_by})"

    def _call(self, name: str, *args) -> cudaError_t | int:
        return _error(getattr(self.library, name)(*args))

    def _out(self, name: str, kind, *args) -> tuple:
        """Call `name` with a new `kind` out-parameter first; (error, its value)."""
        value = kind()
        error = self._call(name, ctypes.byref(value), *args)
        return error, value.value or 0

    # -- versions, devices, errors ---------------------------------------------------------

    def cudaRuntimeGetVersion(self) -> tuple:
        return self._out("cudaRuntimeGetVersion", ctypes.c_int)

    def cudaDriverGetVersion(self) -> tuple:
        return self._out("cudaDriverGetVersion", ctypes.c_int)

    def cudaGetDeviceCount(self) -> tuple:
        return self._out("cudaGetDeviceCount", ctypes.c_int)

    def cudaSetDevice(self, device: int) -> tuple:
        return (self._call("cudaSetDevice", device),)

    def cudaDeviceGetAttribute(self, attr: int, device: int) -> tuple:
        return self._out("cudaDeviceGetAttribute", ctypes.c_int, int(attr), device)

    def cudaGetDeviceProperties(self, device: int) -> tuple:
        buffer = ctypes.create_string_buffer(PROPS_BUFFER)
        error = _error(self._properties(buffer, device))
        if error != cudaError_t.cudaSuccess:
            return error, None
        numbers = []
        for attr in ("ComputeCapabilityMajor", "ComputeCapabilityMinor", "MultiProcessorCount"):
            error, value = self.cudaDeviceGetAttribute(cudaDeviceAttr[f"cudaDevAttr{attr}"], device)
            if error != cudaError_t.cudaSuccess:
                return error, None
            numbers.append(value)
        return cudaError_t.cudaSuccess, DeviceProperties(buffer.raw[:256].split(b"\x00")[0], *numbers)

    def cudaGetErrorString(self, error: int) -> tuple:
        return cudaError_t.cudaSuccess, self.library.cudaGetErrorString(int(error))

    def cudaDeviceSynchronize(self) -> tuple:
        return (self._call("cudaDeviceSynchronize"),)

    def cudaMemGetInfo(self) -> tuple:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        error = self._call("cudaMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        return error, free.value, total.value

    # -- memory ----------------------------------------------------------------------------

    def cudaMalloc(self, size: int) -> tuple:
        return self._out("cudaMalloc", ctypes.c_void_p, size)

    def cudaMallocManaged(self, size: int, flags: int) -> tuple:
        return self._out("cudaMallocManaged", ctypes.c_void_p, size, flags)

    def cudaFree(self, devPtr: int) -> tuple:  # noqa: N803 (the header's parameter names)
        return (self._call("cudaFree", devPtr),)

    def cudaMemset(self, devPtr: int, value: int, count: int) -> tuple:  # noqa: N803
        return (self._call("cudaMemset", devPtr, value, count),)

    def cudaMemcpy(self, dst: int, src: int, count: int, kind: cudaMemcpyKind) -> tuple:
        return (self._call("cudaMemcpy", dst, src, count, _kind(kind)),)

    def cudaMemcpy2D(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: cudaMemcpyKind
    ) -> tuple:
        return (self._call("cudaMemcpy2D", dst, dpitch, src, spitch, width, height, _kind(kind)),)

    def cudaHostAlloc(self, size: int, flags: int) -> tuple:
        return self._out("cudaHostAlloc", ctypes.c_void_p, size, flags)

    def cudaFreeHost(self, ptr: int) -> tuple:
        return (self._call("cudaFreeHost", ptr),)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> tuple:
        return (self._call("cudaHostRegister", ptr, size, flags),)

    def cudaHostUnregister(self, ptr: int) -> tuple:
        return (self._call("cudaHostUnregister", ptr),)

    def cudaHostGetDevicePointer(self, pHost: int, flags: int) -> tuple:  # noqa: N803
        return self._out("cudaHostGetDevicePointer", ctypes.c_void_p, pHost, flags)

    # -- streams: a cudaStream_t is an int handle (TensorRT's Python API takes the int) ------

    def cudaStreamCreate(self) -> tuple:
        return self._out("cudaStreamCreate", ctypes.c_void_p)

    def cudaStreamSynchronize(self, stream: int) -> tuple:
        return (self._call("cudaStreamSynchronize", int(stream)),)

    def cudaStreamDestroy(self, stream: int) -> tuple:
        return (self._call("cudaStreamDestroy", int(stream)),)


def _error(code: int) -> cudaError_t | int:
    try:
        return cudaError_t(code)
    except ValueError:
        return code


def _kind(kind: cudaMemcpyKind) -> int:
    """cuda-python takes only a cudaMemcpyKind here; so does this, so a bare int (a swapped
    argument) fails as it would there."""
    if not isinstance(kind, cudaMemcpyKind):
        raise TypeError(
            f"Argument 'kind' has incorrect type (expected cudaMemcpyKind, got {type(kind).__name__})"
        )
    return int(kind)


def version_text(version: int) -> str:
    """CUDA's encoded version as "major.minor": 12060 -> "12.6" (1000 * major + 10 * minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"
