"""Memory kvedge owns: page-aligned arrays that a GPU backend may page-lock, and the alignment a
bound address must have.

The GPU backends give the device the cache pool's own pages (`kvedge.runtime.backends.cuda.MappedHost`),
so the pool must be memory kvedge allocated, not an array numpy placed somewhere in its heap:

- CUDA page-locks whole pages (cudaHostRegister rounds the range out to them) and refuses a range
  any page of which is registered already (cudaErrorHostMemoryAlreadyRegistered, 712). Two small
  numpy arrays can share a page, and an array allocated after another was freed can land on the
  freed one's pages, still registered if nothing unregistered them.
- TensorRT requires every tensor address to be aligned to 256 bytes
  (`IExecutionContext::setTensorAddress`); numpy places array data at 16-byte alignment only.

So every cache array (pool, scales, ring layers) is its own anonymous mapping (`page_aligned`):
it starts on a page, spans whole pages, and shares none with anything else; it lives as long
as a reference to it does, and whoever registers it keeps one until it unregisters. A view at a
slot or layer offset is aligned when the slot stride is (`check_alignment`): the pool is
[layers, 2, slots, kv_heads, L, d], so a view's offset is a whole number of slot strides of
kv_heads x L x d x itemsize bytes.

The same cache can live in device memory instead (`--kv-memory device`): `HostMemory` and
`kvedge.runtime.backends.cuda.DeviceMemory` answer the cache's reads and writes alike, and a
`DeviceArray` stands where a bound numpy view would (shape, dtype, strides, its device address).
"""

from __future__ import annotations

import contextlib
import math
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvedge.errors import KvedgeError

PAGE = mmap.PAGESIZE
ALIGNMENT = 256  # bytes: TensorRT's requirement for a tensor address, and onnxruntime CUDA's allocations


def page_aligned(shape: tuple[int, ...], dtype: np.dtype, fill: float = 0) -> np.ndarray:
    """A new array of `shape` filled with `fill`, alone in its own whole pages. Every page is
    written now, so the memory is resident from the start: a cache that does not fit fails at
    load, not mid-conversation. The mapping is private and anonymous, the memory one page-locks
    (Python's default for an anonymous mmap is MAP_SHARED: shmem pages, shared with any child)."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    size = max(1, -(-count * dtype.itemsize // PAGE)) * PAGE
    array = np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE), dtype, count).reshape(shape)
    array[...] = fill
    return array


def owned_mapping(view: np.ndarray) -> tuple[np.ndarray, int, int] | None:
    """(the array `page_aligned` made, its first address, its bytes in whole pages) that `view`
    looks into, or None when `view` is memory kvedge did not allocate so."""
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    buffer = root.base.obj if isinstance(root.base, memoryview) else root.base  # frombuffer's
    if not isinstance(buffer, mmap.mmap):
        return None
    return root, root.__array_interface__["data"][0], len(buffer)


def check_alignment(
    name: str, address: int, view: np.ndarray | DeviceArray | None = None, state: bool = False
) -> None:
    """Refuse a bound address that is not a multiple of `ALIGNMENT`, naming the tensor; for a
    pool `view` [slots, kv_heads, L, last] (or a per-slot `state`'s [slots, *shape]) also the
    stride between its slots, so that a view of any slot range is aligned too."""
    if address % ALIGNMENT:
        raise KvedgeError(
            f"{name}: address {address:#x} is {address % ALIGNMENT} bytes past a {ALIGNMENT}-byte "
            "boundary; TensorRT and the CUDA kernels need every bound tensor aligned to it"
        )
    if view is not None and view.strides[0] % ALIGNMENT and state:
        raise KvedgeError(
            f"{name}: a slot's state is {view.strides[0]} bytes, not a multiple of {ALIGNMENT}, so "
            "views at later slots would be misaligned on the GPU; run this model on --device cpu"
        )
    if view is not None and view.strides[0] % ALIGNMENT:
        _, heads, length, last = view.shape
        position = heads * last * view.itemsize  # bytes of one cache position, over the heads
        step = ALIGNMENT // math.gcd(ALIGNMENT, position)
        raise KvedgeError(
            f"{name}: a slot of this cache is {view.strides[0]} bytes ({length} positions), not a "
            f"multiple of {ALIGNMENT}, so views at later slots would be misaligned on the GPU; "
            f"export with a cache length (--max-len, or the ring length of sliding-window layers) "
            f"that is a multiple of {step}"
        )


@dataclass(frozen=True)
class DeviceArray:
    """`shape` of `dtype`, C-contiguous at device `address`: a `DeviceMemory` allocation or a
    slot range of one. The CPU cannot address it; it carries what the binders read of a numpy
    view (shape, dtype, strides, contiguity) and `MappedHost.device_address` gives its address."""

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(int(np.prod(self.shape[i + 1 :])) * self.itemsize for i in range(len(self.shape)))

    @property
    def flags(self) -> Any:
        return _CONTIGUOUS

    def __getitem__(self, index: slice) -> DeviceArray:
        """Rows first..end-1 of the leading axis (a batch's slots), as numpy's `view[a:b]`: the
        one slicing the backends do to a bound view. Anything else needs a copy to the host."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a DeviceArray takes only [first:end] of its leading axis, not {index!r}")
        first, end, _ = index.indices(self.shape[0])
        count = max(0, end - first)
        return DeviceArray(self.address + first * self.strides[0], (count, *self.shape[1:]), self.dtype)


_CONTIGUOUS = type("Flags", (), {"c_contiguous": True})()


def data_address(view: np.ndarray | DeviceArray) -> int:
    """Where `view`'s first element is: a host address, or a `DeviceArray`'s device address."""
    return view.address if isinstance(view, DeviceArray) else view.__array_interface__["data"][0]


ALL = slice(None)
KV_MEMORY = ("mapped", "device")  # where a GPU backend's cache pool lives (`--kv-memory`)


def check_kv_memory(kv_memory: str, device: str) -> None:
    """Refuse a `kv_memory` that is not one of `KV_MEMORY`, or a device pool off the GPU."""
    if kv_memory not in KV_MEMORY:
        raise KvedgeError(f"--kv-memory {kv_memory!r} is not supported; allowed: {list(KV_MEMORY)}")
    if kv_memory == "device" and device not in ("cuda", "tensorrt"):
        raise KvedgeError(
            f"--kv-memory device puts the cache in GPU memory: it needs --device cuda or tensorrt, "
            f"not {device!r} (use --kv-memory mapped there)"
        )


class HostMemory:
    """The cache arrays as numpy arrays in host memory (`page_aligned`): the CPU backend's pool,
    and the GPU backends' "mapped" pool, which `kvedge.runtime.backends.cuda.MappedHost` page-locks in
    place so the device reads these very pages.

    `kvedge.runtime.backends.cuda.DeviceMemory` answers the same calls for a pool in device memory; the
    cache reaches its arrays only through them. Index: `array[layer, kind, slot]` ->
    [..., heads, L, last], then `columns` of L (a slice, or positions in any order); `layer` and
    `kind` an int (that axis dropped) or ALL. Values come and go as [layers?, kinds?, heads,
    n, last], in `columns` order."""

    name = "mapped"

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype, fill: float = 0) -> np.ndarray:
        return page_aligned(shape, dtype, fill)

    def get(self, array: np.ndarray, slot: int, columns, layer=ALL, kind=ALL) -> np.ndarray:
        """The values at `columns` (a view where numpy can give one)."""
        return array[layer, kind, slot][..., columns, :]

    def set(self, array: np.ndarray, slot: int, columns, value: np.ndarray, layer=ALL, kind=ALL) -> None:
        array[layer, kind, slot][..., columns, :] = value

    def slots(self, array: np.ndarray, layer: int, kind: int, first: int, end: int) -> np.ndarray:
        """The bindable view of slots first..end-1: [end - first, heads, L, last]."""
        return array[layer, kind, first:end]

    def batched(self) -> contextlib.AbstractContextManager[None]:
        """Several `set`s as one (`DeviceMemory.batched`); host memory has nothing to wait for."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing to give back: the arrays go with their last reference."""
