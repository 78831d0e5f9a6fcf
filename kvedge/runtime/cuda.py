"""Host memory mapped for the GPU (`MappedHost`): the cache pool's pages, page-locked and mapped
into the device's address space, so the GPU backends read and write the cache where it is.

`TrtBackend` and `OrtBackend` on CUDA use it. The CUDA runtime bindings it calls are imported on
demand through `kvedge.accel`, which the engine builder (`kvedge.export.tensorrt`) shares.
Nothing here is imported unless a GPU path is taken.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvedge.accel import cuda_call, import_cudart
from kvedge.errors import KvedgeError
from kvedge.runtime.memory import owned_mapping


class MappedHost:
    """Host memory the GPU reads and writes where it is: page-locked and mapped into the device's
    address space, so a kernel given its device address reaches the host pages themselves and
    nothing is copied. On Jetson, CPU and GPU share one DRAM, so this is the GPU's own memory;
    on a discrete GPU the same memory is reached over PCIe: correct, but every access crosses
    the bus.

    Only memory kvedge owns is mapped, each piece once (`kvedge.runtime.memory`):
      - the `KVCache` arrays (pool, scales, ring layers), each its own whole pages from
        `memory.page_aligned`: page-locked in place with cudaHostRegister(Mapped) at the first
        `device_address` of a view into them (or `register`); this object keeps a reference to
        each until it unregisters it, so its pages cannot be freed (and reused) while locked;
      - step buffers allocated here, zeroed (`empty`: cudaHostAlloc(Mapped)), and given back
        with `release`.
    Any other array is refused: its pages may be shared with other arrays and CUDA refuses a
    range part of which is registered already (cudaErrorHostMemoryAlreadyRegistered, 712).
    `close` (after whatever reads this memory on the device has stopped: the caller's to order)
    unregisters and frees everything, newest first; the arrays from `empty` are invalid after.
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
        self._mappings: list[_Mapping] = []  # in the order made

    def _call(self, result: tuple, what: str) -> Any:
        return cuda_call(self.cudart, result, what)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zeroed array of `shape` in mapped pinned memory, for `device_address` to bind."""
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        host = int(
            self._call(self.cudart.cudaHostAlloc(nbytes, self.cudart.cudaHostAllocMapped), "cudaHostAlloc")
        )
        try:
            device = self._call(self.cudart.cudaHostGetDevicePointer(host, 0), "cudaHostGetDevicePointer")
        except KvedgeError:
            self.cudart.cudaFreeHost(host)
            raise
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(host))
        array = raw[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        array[...] = 0
        self._mappings.append(_Mapping(host, host + nbytes, int(device), array, allocated=True))
        return array

    def device_address(self, view: np.ndarray) -> int:
        """The device address of `view`'s first element; a view into a `KVCache` array not yet
        mapped page-locks that whole array, once."""
        address = view.__array_interface__["data"][0]
        for mapping in self._mappings:
            if mapping.start <= address < mapping.end:
                return mapping.device + (address - mapping.start)
        return self.register(view) + (address - owned_mapping(view)[1])

    def register(self, view: np.ndarray) -> int:
        """Page-lock and map the `memory.page_aligned` array `view` looks into (once); returns the
        device address of that array's start."""
        owned = owned_mapping(view)
        if owned is None:
            raise KvedgeError(
                f"memory at {view.__array_interface__['data'][0]:#x} was not allocated by kvedge "
                "(kvedge.runtime.memory.page_aligned or MappedHost.empty): it may share pages with "
                "other arrays, which CUDA cannot register twice; the GPU backends map only their own"
            )
        root, start, size = owned
        for mapping in self._mappings:
            if mapping.start == start:
                return mapping.device
        self._call(
            self.cudart.cudaHostRegister(start, size, self.cudart.cudaHostRegisterMapped),
            f"cudaHostRegister({size} bytes at {start:#x})",
        )
        try:
            device = self._call(self.cudart.cudaHostGetDevicePointer(start, 0), "cudaHostGetDevicePointer")
        except KvedgeError:
            self.cudart.cudaHostUnregister(start)
            raise
        self._mappings.append(_Mapping(start, start + size, int(device), root, allocated=False))
        return int(device)

    @property
    def nbytes(self) -> int:
        """Host bytes page-locked and mapped (registered arrays and allocated buffers)."""
        return sum(mapping.end - mapping.start for mapping in self._mappings)

    def release(self, array: np.ndarray) -> None:
        """Free a buffer from `empty`; `array` is invalid afterwards."""
        address = array.__array_interface__["data"][0]
        for mapping in self._mappings:
            if mapping.allocated and mapping.start == address:
                self._mappings.remove(mapping)
                self._call(self.cudart.cudaFreeHost(address), "cudaFreeHost")
                return
        raise KvedgeError(f"buffer at {address:#x} was not allocated by this MappedHost")

    def close(self) -> None:
        """Unregister the registered arrays and free the allocated buffers, newest first; every
        one is attempted, then the first failure is raised. Safe to call twice."""
        failures = []
        while self._mappings:
            mapping = self._mappings.pop()
            if mapping.allocated:
                call, what = self.cudart.cudaFreeHost, "cudaFreeHost"
            else:
                call, what = self.cudart.cudaHostUnregister, "cudaHostUnregister"
            try:
                self._call(call(mapping.start), f"{what}({mapping.start:#x})")
            except KvedgeError as exc:
                failures.append(exc)
            # the registered array's last reference here goes only now, after the unregister
            del mapping
        if failures:
            raise failures[0]


@dataclass
class _Mapping:
    """Host range [start, end) page-locked and mapped at device address `device`."""

    start: int
    end: int
    device: int
    array: np.ndarray  # registered: the page_aligned array, kept alive; allocated: the buffer's view
    allocated: bool  # cudaHostAlloc'd here (freed with cudaFreeHost), else cudaHostRegister'd
