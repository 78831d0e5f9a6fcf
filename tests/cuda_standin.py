"""A stand-in for cuda-python's CUDA runtime bindings (`cuda.bindings.runtime`) where there is no
GPU: the calls kvedge makes, held to the contract the CUDA Runtime API reference documents for
them, so a test fails where CUDA would:

    cudaHostRegister          712 (cudaErrorHostMemoryAlreadyRegistered) when any page of the
                              range is page-locked already, by cudaHostRegister or cudaHostAlloc:
                              the driver locks whole pages, so the range is rounded out to pages
    cudaHostUnregister        713 (cudaErrorHostMemoryNotRegistered) unless the pointer starts a
                              registered range
    cudaHostAlloc             page-aligned memory of its own (not zeroed, as CUDA's is not)
    cudaFreeHost              cudaErrorInvalidValue unless the pointer came from cudaHostAlloc
    cudaHostGetDevicePointer  cudaErrorInvalidValue unless the pointer is in mapped memory; the
                              device address is the host address plus `device_offset`: 0 (the
                              default) as on an integrated GPU such as a Jetson's, where both are
                              one DRAM, so fakes can read it; nonzero as on a discrete GPU
    cudaStreamCreate          a handle object with __int__ only, as cuda-python's cudaStream_t:
                              TensorRT's Python API takes the integer

Every call is appended to `events` in order (name, first argument), for tests of release order;
`log` lets a fake of another API (a TensorRT context) write into the same record.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import types

PAGE = mmap.PAGESIZE


class cudaError_t(enum.IntEnum):  # noqa: N801 (cuda-python's name)
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorHostMemoryNotRegistered = 713


class Stream:
    """cuda-python's cudaStream_t: an object that gives its handle through int()."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __int__(self) -> int:
        return self._handle


class CudaRuntime:
    cudaError_t = cudaError_t
    cudaDeviceAttr = types.SimpleNamespace(cudaDevAttrHostRegisterSupported=100)
    cudaHostAllocMapped = 2
    cudaHostRegisterMapped = 2

    def __init__(self, device_name: bytes = b"Orin\x00", device_offset: int = 0) -> None:
        self.device_name, self.device_offset = device_name, device_offset
        self.events: list[tuple[str, object]] = []
        self.registered: dict[int, int] = {}  # start -> bytes, as given
        self.allocated: dict[int, mmap.mmap] = {}  # start -> its memory
        self.streams: set[int] = set()

    def log(self, name: str, what: object = None) -> None:
        self.events.append((name, what))

    @staticmethod
    def _pages(start: int, size: int) -> range:
        return range(start // PAGE, -(-(start + size) // PAGE))

    def _locked_pages(self) -> set[int]:
        locked: set[int] = set()
        for start, size in self.registered.items():
            locked.update(self._pages(start, size))
        for start, memory in self.allocated.items():
            locked.update(self._pages(start, len(memory)))
        return locked

    def _mapped(self, address: int) -> bool:
        ranges = list(self.registered.items()) + [(s, len(m)) for s, m in self.allocated.items()]
        return any(start <= address < start + size for start, size in ranges)

    # -- memory ----------------------------------------------------------------------------

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> tuple:
        self.log("cudaHostRegister", ptr)
        if size <= 0 or flags != self.cudaHostRegisterMapped:
            return (cudaError_t.cudaErrorInvalidValue,)
        if self._locked_pages() & set(self._pages(ptr, size)):
            return (cudaError_t.cudaErrorHostMemoryAlreadyRegistered,)
        self.registered[ptr] = size
        return (cudaError_t.cudaSuccess,)

    def cudaHostUnregister(self, ptr: int) -> tuple:
        self.log("cudaHostUnregister", ptr)
        if self.registered.pop(ptr, None) is None:
            return (cudaError_t.cudaErrorHostMemoryNotRegistered,)
        return (cudaError_t.cudaSuccess,)

    def cudaHostAlloc(self, size: int, flags: int) -> tuple:
        memory = mmap.mmap(-1, -(-size // PAGE) * PAGE)
        start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        memory.write(b"\xa5" * len(memory))  # what was there before: CUDA does not zero it
        self.allocated[start] = memory
        self.log("cudaHostAlloc", start)
        return cudaError_t.cudaSuccess, start

    def cudaFreeHost(self, ptr: int) -> tuple:
        self.log("cudaFreeHost", ptr)
        if self.allocated.pop(ptr, None) is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        return (cudaError_t.cudaSuccess,)

    def cudaHostGetDevicePointer(self, ptr: int, flags: int) -> tuple:
        if flags != 0 or not self._mapped(ptr):
            return cudaError_t.cudaErrorInvalidValue, 0
        return cudaError_t.cudaSuccess, ptr + self.device_offset

    # -- device, streams, errors -----------------------------------------------------------

    def cudaGetErrorString(self, error: int) -> tuple:
        return cudaError_t.cudaSuccess, cudaError_t(error).name.encode()

    def cudaGetDeviceProperties(self, index: int) -> tuple:
        props = types.SimpleNamespace(name=self.device_name, major=8, minor=7, multiProcessorCount=8)
        return cudaError_t.cudaSuccess, props

    def cudaDeviceGetAttribute(self, attribute: int, device: int) -> tuple:
        return cudaError_t.cudaSuccess, 1

    def cudaStreamCreate(self) -> tuple:
        handle = 0x7000 + len(self.streams)
        self.streams.add(handle)
        self.log("cudaStreamCreate", handle)
        return cudaError_t.cudaSuccess, Stream(handle)

    def cudaStreamSynchronize(self, stream: Stream) -> tuple:
        ok = int(stream) in self.streams
        return (cudaError_t.cudaSuccess if ok else cudaError_t.cudaErrorInvalidValue,)

    def cudaStreamDestroy(self, stream: Stream) -> tuple:
        self.log("cudaStreamDestroy", int(stream))
        if int(stream) not in self.streams:
            return (cudaError_t.cudaErrorInvalidValue,)
        self.streams.remove(int(stream))
        return (cudaError_t.cudaSuccess,)
