"""Host memory mapped for the GPU (`MappedHost`): the cache pool's pages, page-locked and mapped
into the device's address space, so the GPU backends read and write the cache where it is.

`TrtBackend` and `OrtBackend` on CUDA use it. The CUDA runtime bindings it calls are imported on
demand through `kvedge.accel`, which the engine builder (`kvedge.export.tensorrt`) shares.
Nothing here is imported unless a GPU path is taken.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvedge.accel import cuda_call, import_cudart
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.memory import ALL, DeviceArray, owned_mapping

log = logging.getLogger(__name__)


class MappedHost:
    """Host memory the GPU reads and writes where it is: page-locked and mapped into the device's
    address space, so a kernel given its device address reaches the host pages themselves and
    nothing is copied. On Jetson, CPU and GPU share one DRAM, so this is the GPU's own memory;
    on a discrete GPU the same memory is reached over PCIe: correct, but every access crosses
    the bus.

    Only memory kvedge owns is mapped, each piece once (`kvedge.runtime.backends.memory`):
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
        self._can_register: bool | None = None  # HostRegisterSupported, asked at the first register
        self._mappings: list[_Mapping] = []  # in the order made
        # Released also when this object is dropped without `close` (a Model never closed): its
        # arrays would otherwise be freed while CUDA still has them registered, and the next
        # allocation at those addresses refused (712). It holds the list, not this object.
        self._release = weakref.finalize(self, _release_unclosed, self.cudart, self._mappings)

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
        mapped page-locks that whole array, once; a `DeviceArray` is bound where it is."""
        if isinstance(view, DeviceArray):  # a device pool (`DeviceMemory`): the device's already
            return view.address
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
                "(kvedge.runtime.backends.memory.page_aligned or MappedHost.empty): it may share pages with "
                "other arrays, which CUDA cannot register twice; the GPU backends map only their own"
            )
        root, start, size = owned
        for mapping in self._mappings:
            if mapping.start == start:
                return mapping.device
        self._check_register()
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

    def _check_register(self) -> None:
        """Refuse registration on a GPU that cannot page-lock memory in place. Only the mapped
        cache pool needs it: `empty`'s buffers are cudaHostAlloc's, and a `--kv-memory device`
        pool is the device's, so one driver answer does not refuse the whole GPU path."""
        if self._can_register is None:
            self._can_register = bool(
                self._call(
                    self.cudart.cudaDeviceGetAttribute(
                        self.cudart.cudaDeviceAttr.cudaDevAttrHostRegisterSupported, 0
                    ),
                    "cudaDeviceGetAttribute(HostRegisterSupported)",
                )
            )
        if not self._can_register:
            raise KvedgeError(
                "this GPU cannot page-lock host memory in place (cudaDevAttrHostRegisterSupported is 0), "
                "which the mapped cache pool needs: run with --kv-memory device (`kv_memory: device` in a "
                "service config), whose pool is GPU memory"
            )

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
        failures = _release(self.cudart, self._mappings)
        if failures:
            raise failures[0]


def _release(cudart: Any, mappings: list[_Mapping]) -> list[KvedgeError]:
    """Unregister or free `mappings`, newest first, emptying the list; the failures, in order."""
    failures = []
    while mappings:
        mapping = mappings.pop()
        if mapping.allocated:
            call, what = cudart.cudaFreeHost, "cudaFreeHost"
        else:
            call, what = cudart.cudaHostUnregister, "cudaHostUnregister"
        try:
            cuda_call(cudart, call(mapping.start), f"{what}({mapping.start:#x})")
        except KvedgeError as exc:
            failures.append(exc)
        # the registered array's last reference here goes only now, after the unregister
        del mapping
    return failures


def _release_unclosed(cudart: Any, mappings: list[_Mapping]) -> None:
    """`_release` for a `MappedHost` dropped without `close`: nobody is left to raise to."""
    if mappings:
        log.warning("a MappedHost was dropped without close(); releasing its %d mappings", len(mappings))
    for failure in _release(cudart, mappings):
        log.warning("%s", failure)


@dataclass
class _Mapping:
    """Host range [start, end) page-locked and mapped at device address `device`."""

    start: int
    end: int
    device: int
    array: np.ndarray  # registered: the page_aligned array, kept alive; allocated: the buffer's view
    allocated: bool  # cudaHostAlloc'd here (freed with cudaFreeHost), else cudaHostRegister'd


FILL_CHUNK = 1 << 20  # bytes of host fill copied per cudaMemcpy when a pool starts non-zero (scales)


class DeviceMemory:
    """The cache arrays in device memory (cudaMalloc), the `--kv-memory device` pool: the GPU
    reads them every step where it caches them (CUDA for Tegra's advice for buffers only the GPU
    uses; Orin's GPU does not cache pinned host memory), and the CPU side (prefix store, warm
    prefixes, rewinds, window eviction, the portable graph's new K/V) reaches them only through
    the explicit copies `get` and `set`, which answer as `kvedge.runtime.backends.memory.HostMemory` does.

    A copy is one cudaMemcpy2D per (layer, kind) and run of consecutive positions: `heads` rows
    of n x last elements, the device rows max_len x last apart. The copies run on the legacy
    default stream between steps; both GPU backends synchronize at the end of a step, so no
    kernel is reading or writing the pool then. `close` frees every allocation, newest first,
    after whatever reads them has stopped (`Model.close` orders it)."""

    name = "device"

    def __init__(self, cudart: Any | None = None) -> None:
        self.cudart = cudart or import_cudart()
        self._allocations: list[int] = []  # device addresses, in the order made
        # Freed also when this object is dropped without `close` (a Model never closed); the
        # finalizer holds the list, not this object.
        self._release = weakref.finalize(self, _free_unclosed, self.cudart, self._allocations)
        self._batching = 0  # `batched` blocks open: `set` leaves the wait to the outermost
        self._unsynced = False  # a copy was queued since the last wait

    def _call(self, result: tuple, what: str) -> Any:
        return cuda_call(self.cudart, result, what)

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype, fill: float = 0) -> DeviceArray:
        """A new device array of `shape`, every element `fill`."""
        array = DeviceArray(0, tuple(shape), np.dtype(dtype))
        nbytes = max(1, array.nbytes)
        address = int(self._call(self.cudart.cudaMalloc(nbytes), f"cudaMalloc({nbytes} bytes)"))
        self._allocations.append(address)
        array = DeviceArray(address, array.shape, array.dtype)
        if fill == 0:
            self._call(self.cudart.cudaMemset(address, 0, nbytes), "cudaMemset")
        else:
            chunk = np.full(max(1, min(array.nbytes, FILL_CHUNK) // array.itemsize), fill, array.dtype)
            to_device = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            for offset in range(0, array.nbytes, chunk.nbytes):
                size = min(chunk.nbytes, array.nbytes - offset)
                copy = self.cudart.cudaMemcpy(address + offset, chunk.ctypes.data, size, to_device)
                self._call(copy, "cudaMemcpy")
        self._synchronize()
        return array

    def _synchronize(self) -> None:
        """Wait for what this object queued: cudaMemset and a copy from pageable host memory
        may return before the device memory holds the bytes, and the backends' streams (one
        onnxruntime makes non-blocking) do not wait for the legacy default stream."""
        self._call(self.cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def get(self, array: DeviceArray, slot: int, columns, layer=ALL, kind=ALL) -> np.ndarray:
        """A host copy of the values at `columns`: [layers?, kinds?, heads, n, last]."""
        layers, kinds, positions = self._select(array, layer, kind, columns)
        host = np.empty(
            (len(layers), len(kinds), *array.shape[3:4], len(positions), array.shape[5]), array.dtype
        )
        self._copy(array, slot, layers, kinds, positions, host, to_device=False)
        return host[_dropped(layer, kind)]

    def set(self, array: DeviceArray, slot: int, columns, value: np.ndarray, layer=ALL, kind=ALL) -> None:
        layers, kinds, positions = self._select(array, layer, kind, columns)
        full = (len(layers), len(kinds), array.shape[3], len(positions), array.shape[5])
        given = tuple(
            n for n, axis in zip(full, (layer, kind, ALL, ALL, ALL), strict=True) if isinstance(axis, slice)
        )
        host = np.ascontiguousarray(
            np.broadcast_to(np.asarray(value), given).astype(array.dtype).reshape(full)
        )
        self._copy(array, slot, layers, kinds, positions, host, to_device=True)
        if self._batching:
            self._unsynced = True
        else:
            self._synchronize()

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """The `set`s inside wait for the device once, at the end, not once each: a portable
        graph's step writes its new K/V per layer and kind (60 copies a token on SmolLM2), and a
        device synchronize after each made 60 round trips. A copy from pageable host memory has
        staged its bytes when it returns, so the host values may go before the wait."""
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if not self._batching and self._unsynced:
                self._unsynced = False
                self._synchronize()

    def slots(self, array: DeviceArray, layer: int, kind: int, first: int, end: int) -> DeviceArray:
        """Slots first..end-1 of (`layer`, `kind`): [end - first, heads, L, last] at its address."""
        kinds, slots = array.shape[1:3]
        offset = ((layer * kinds + kind) * slots + first) * array.strides[2]
        return DeviceArray(array.address + offset, (end - first, *array.shape[3:]), array.dtype)

    @staticmethod
    def _select(array: DeviceArray, layer, kind, columns) -> tuple[range, range, np.ndarray]:
        """The layers, kinds and positions (in order) an index names, as numpy would read it."""
        pick = [
            range(n)[axis] if isinstance(axis, slice) else range(n)[axis : axis + 1]
            for n, axis in zip(array.shape[:2], (layer, kind), strict=True)
        ]
        return pick[0], pick[1], np.arange(array.shape[4])[columns].reshape(-1)

    def _copy(self, array, slot, layers, kinds, positions, host: np.ndarray, to_device: bool) -> None:
        """Copy between `host` [layers, kinds, heads, n, last] (contiguous) and the device."""
        _, nkinds, nslots, heads, length, last = array.shape
        element = last * array.itemsize  # bytes of one position of one head
        runs = np.split(np.arange(len(positions)), np.flatnonzero(np.diff(positions) != 1) + 1)
        direction = "HostToDevice" if to_device else "DeviceToHost"
        kind_of_copy = getattr(self.cudart.cudaMemcpyKind, f"cudaMemcpy{direction}")
        host_pitch = len(positions) * element
        for i, a in enumerate(layers):
            for j, k in enumerate(kinds):
                device_row0 = array.address + ((a * nkinds + k) * nslots + slot) * heads * length * element
                host_row0 = host.ctypes.data + (i * len(kinds) + j) * heads * host_pitch
                for run in runs:
                    if not len(run):
                        continue
                    device = device_row0 + int(positions[run[0]]) * element
                    near = host_row0 + int(run[0]) * element
                    ends = (
                        (device, length * element, near, host_pitch)
                        if to_device
                        else (near, host_pitch, device, length * element)
                    )
                    self._call(
                        self.cudart.cudaMemcpy2D(*ends, len(run) * element, heads, kind_of_copy),
                        f"cudaMemcpy2D({direction})",
                    )

    def close(self) -> None:
        """Free every allocation, newest first; each is attempted, then the first failure is
        raised. Safe to call twice."""
        failures = _free(self.cudart, self._allocations)
        if failures:
            raise failures[0]


def _free(cudart: Any, allocations: list[int]) -> list[KvedgeError]:
    """cudaFree each of `allocations`, newest first, emptying the list; the failures, in order."""
    failures = []
    while allocations:
        address = allocations.pop()
        try:
            cuda_call(cudart, cudart.cudaFree(address), f"cudaFree({address:#x})")
        except KvedgeError as exc:
            failures.append(exc)
    return failures


def _free_unclosed(cudart: Any, allocations: list[int]) -> None:
    """`_free` for a `DeviceMemory` dropped without `close`: nobody is left to raise to."""
    if allocations:
        log.warning(
            "a DeviceMemory was dropped without close(); freeing its %d allocations", len(allocations)
        )
    for failure in _free(cudart, allocations):
        log.warning("%s", failure)


def _dropped(layer, kind) -> tuple:
    """The index that drops the layer and kind axes an int selected (numpy's reading of it)."""
    return tuple(0 if not isinstance(axis, slice) else ALL for axis in (layer, kind))
