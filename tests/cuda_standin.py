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
    cudaMalloc                device memory the CPU cannot address: its addresses lie above the
                              x86-64 / aarch64 user address space (2**47), so a numpy view made
                              from one would fault as a real device pointer does; 256-byte
                              aligned, not zeroed; 0 bytes refused (kvedge asks at least 1)
    cudaDeviceSynchronize     recorded in `events`: a copy into device memory from pageable host
                              memory may return before the DMA lands, so the order is checked
    cudaFree                  cudaErrorInvalidValue unless the pointer starts an allocation
                              (0 is a no-op, as in CUDA)
    cudaMemset                cudaErrorInvalidValue unless the range lies in one allocation
    cudaMemcpy, cudaMemcpy2D  `kind` must be a `cudaMemcpyKind` (cuda-python's Cython signature
                              raises TypeError for anything else); each side must be the memory
                              `kind` names, every byte in one allocation when on the device
                              (CUDA calls a mismatch undefined behaviour: here it is
                              cudaErrorInvalidValue); cudaMemcpy2D answers
                              cudaErrorInvalidPitchValue when width exceeds either pitch

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
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidPitchValue = 12
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorHostMemoryNotRegistered = 713
    cudaErrorNotSupported = 801


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801 (cuda-python's name)
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


DEVICE_BASE = 1 << 47  # above every user-space address on x86-64 and aarch64 Linux (47/48-bit)
DEVICE_SPACING = 1 << 21  # each allocation at its own 2 MiB boundary (CUDA aligns to >= 256)


class Stream:
    """cuda-python's cudaStream_t: an object that gives its handle through int()."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __int__(self) -> int:
        return self._handle


class CudaRuntime:
    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaDeviceAttr = types.SimpleNamespace(cudaDevAttrHostRegisterSupported=99)  # driver_types.h
    cudaHostAllocMapped = 2
    cudaHostRegisterMapped = 2

    def __init__(
        self, device_name: bytes = b"Orin\x00", device_offset: int = 0, host_register: bool = True
    ) -> None:
        self.device_name, self.device_offset = device_name, device_offset
        self.host_register = host_register  # cudaDevAttrHostRegisterSupported's answer
        self.events: list[tuple[str, object]] = []
        self.registered: dict[int, int] = {}  # start -> bytes, as given
        self.allocated: dict[int, mmap.mmap] = {}  # start -> its memory
        self.streams: set[int] = set()
        self.device: dict[int, tuple[mmap.mmap, int]] = {}  # device start -> (its backing, bytes asked)
        self._next_device = DEVICE_BASE

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
        if not self.host_register:  # as a GPU answering HostRegisterSupported 0
            return (cudaError_t.cudaErrorNotSupported,)
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

    # -- device memory ---------------------------------------------------------------------

    def cudaMalloc(self, size: int) -> tuple:
        self.log("cudaMalloc", size)
        if size <= 0:
            return cudaError_t.cudaErrorInvalidValue, None  # cuda-python answers None on failure
        backing = mmap.mmap(-1, -(-size // PAGE) * PAGE)
        backing.write(b"\x5a" * len(backing))  # not zeroed, as CUDA's is not
        start = self._next_device
        self._next_device += -(-size // DEVICE_SPACING) * DEVICE_SPACING
        self.device[start] = backing, size
        return cudaError_t.cudaSuccess, start

    def cudaFree(self, ptr: int) -> tuple:
        self.log("cudaFree", ptr)
        if ptr == 0:
            return (cudaError_t.cudaSuccess,)
        if self.device.pop(ptr, None) is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        return (cudaError_t.cudaSuccess,)

    def _on_device(self, address: int, count: int) -> int | None:
        """The host address backing device bytes [address, address + count), when one allocation
        holds them all, else None."""
        for start, (backing, size) in self.device.items():
            if start <= address and address + count <= start + size:
                return ctypes.addressof(ctypes.c_char.from_buffer(backing)) + address - start
        return None

    def _resolve(self, address: int, count: int, device: bool) -> int | None:
        """Where the stand-in reaches `count` bytes at `address`, which `device` says is device
        memory (else host memory), or None when it is not that memory."""
        if device:
            return self._on_device(address, count)
        return address if 0 < address and address + count <= DEVICE_BASE else None

    def _sides(self, dst: int, src: int, kind: cudaMemcpyKind) -> tuple[bool, bool]:
        if not isinstance(kind, cudaMemcpyKind):
            raise TypeError(
                f"Argument 'kind' has incorrect type (expected cudaMemcpyKind, got {type(kind).__name__})"
            )
        if kind == cudaMemcpyKind.cudaMemcpyDefault:
            return dst >= DEVICE_BASE, src >= DEVICE_BASE
        return kind in (1, 3), kind in (2, 3)

    def cudaMemset(self, devPtr: int, value: int, count: int) -> tuple:
        self.log("cudaMemset", devPtr)
        target = self._on_device(devPtr, count)
        if target is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        ctypes.memset(target, value, count)
        return (cudaError_t.cudaSuccess,)

    def cudaMemcpy(self, dst: int, src: int, count: int, kind: cudaMemcpyKind) -> tuple:
        return self.cudaMemcpy2D(dst, count, src, count, count, 1, kind)

    def cudaMemcpy2D(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: cudaMemcpyKind
    ) -> tuple:
        dst_device, src_device = self._sides(dst, src, kind)
        self.log("cudaMemcpy2D", (dst, src, width, height, kind.name))
        if width > dpitch or width > spitch:
            return (cudaError_t.cudaErrorInvalidPitchValue,)
        rows = []
        for row in range(height):
            to = self._resolve(dst + row * dpitch, width, dst_device)
            source = self._resolve(src + row * spitch, width, src_device)
            if to is None or source is None:
                return (cudaError_t.cudaErrorInvalidValue,)
            rows.append((to, source))
        for to, source in rows:
            ctypes.memmove(to, source, width)
        return (cudaError_t.cudaSuccess,)

    def cudaDeviceSynchronize(self) -> tuple:
        self.log("cudaDeviceSynchronize")
        return (cudaError_t.cudaSuccess,)

    # -- device, streams, errors -----------------------------------------------------------

    def cudaGetErrorString(self, error: int) -> tuple:
        return cudaError_t.cudaSuccess, cudaError_t(error).name.encode()

    def cudaGetDeviceProperties(self, index: int) -> tuple:
        props = types.SimpleNamespace(name=self.device_name, major=8, minor=7, multiProcessorCount=8)
        return cudaError_t.cudaSuccess, props

    def cudaDeviceGetAttribute(self, attribute: int, device: int) -> tuple:
        if attribute == self.cudaDeviceAttr.cudaDevAttrHostRegisterSupported:
            return cudaError_t.cudaSuccess, int(self.host_register)
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
