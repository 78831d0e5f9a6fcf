"""The GPU backends' memory, checked without a GPU: what kvedge allocates, what it page-locks,
at which addresses, aligned how, released when and in what order.

CUDA itself is `cuda_standin.CudaRuntime`, a stand-in that holds kvedge's calls to the CUDA
runtime's documented contract (712 for a range any page of which is page-locked already, 713 for
unregistering what is not registered, freeing only what cudaHostAlloc gave); it records every
call in order. That CUDA behaves so on a device is device_tests/'s to show.
"""

from __future__ import annotations

import gc
import mmap
import weakref

import numpy as np
import pytest
from cuda_standin import CudaRuntime

from kvedge.contract import CacheGeometry
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.cuda import MappedHost
from kvedge.runtime.backends.memory import ALIGNMENT, PAGE, check_alignment, owned_mapping, page_aligned
from kvedge.runtime.cache import KVCache

INT8 = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=64, max_len=128, dtype="int8", group_size=32)
RINGS = CacheGeometry(
    num_layers=3, num_kv_heads=1, head_dim=16, max_len=64, ring_layers=(1,), window=16, ring_margin=16
)


def cache_arrays(cache: KVCache) -> list[np.ndarray]:
    return [a for a in (cache.pool, cache.scales, cache.ring, cache.ring_scales) if a is not None]


def test_the_old_way_fails_as_cuda_would():
    """What `MappedHost` did before: page-lock a numpy array's pages rounded out. Two small arrays
    share a page, so the second registration is refused with 712, as CUDA refuses it."""
    cuda = CudaRuntime()
    # two 400-byte arrays on one page, as malloc often (not always) places small numpy arrays
    buffer = np.zeros(3 * PAGE, np.uint8)
    page = -buffer.ctypes.data % PAGE
    a, b = (buffer[page + i * 400 : page + (i + 1) * 400].view(np.float32) for i in (0, 1))
    assert a.ctypes.data // PAGE == b.ctypes.data // PAGE

    def rounded(array):
        start = array.ctypes.data & ~(PAGE - 1)
        return start, -(-(array.ctypes.data + array.nbytes) // PAGE) * PAGE - start

    assert cuda.cudaHostRegister(*rounded(a), cuda.cudaHostRegisterMapped)[0] == 0
    assert cuda.cudaHostRegister(*rounded(b), cuda.cudaHostRegisterMapped)[0] == 712
    # and kvedge now refuses memory it did not allocate, before CUDA sees it
    with pytest.raises(KvedgeError, match="not allocated by kvedge .*share pages"):
        MappedHost(cuda).device_address(b)


@pytest.mark.parametrize("geometry", [INT8, RINGS], ids=["int8", "rings"])
def test_cache_arrays_are_kvedge_owned_whole_pages(geometry):
    """Each cache array starts on a page, spans whole pages of its own, is filled (scales with
    1) and shares no page with another array."""
    cache = KVCache(geometry, slots=3)
    pages: set[int] = set()
    for array in cache_arrays(cache):
        root, start, size = owned_mapping(array[-1, 1, 2:])
        assert owned_mapping(array)[0] is root and start == array.ctypes.data
        assert start % PAGE == 0 and size % PAGE == 0
        assert array.nbytes <= size < array.nbytes + PAGE
        mine = set(range(start // PAGE, (start + size) // PAGE))
        assert not mine & pages
        pages |= mine
    if cache.scales is not None:
        assert (cache.scales == 1).all() and (cache.pool == 0).all()
    assert owned_mapping(np.zeros(4)) is None and owned_mapping(page_aligned((4,), np.int8)[1:]) is not None


def test_int8_pool_and_scales_registered_once_each_and_released():
    """Every view of an INT8 cache (codes and scales side by side, as in device_tests' tiny
    models) maps with one registration per array; views' device addresses are the array's plus
    their offset; close unregisters both, and a cache made next maps again, at whatever address."""
    cuda = CudaRuntime(device_offset=1 << 44)  # a discrete GPU: device addresses differ
    host = MappedHost(cuda)
    cache = KVCache(INT8, slots=2)
    for first, count in ((0, 2), (1, 1), (0, 1)):
        for layer in cache.layer_views(first, count):
            for view in layer:
                assert host.device_address(view) == view.ctypes.data + (1 << 44)
    assert [name for name, _ in cuda.events] == ["cudaHostRegister"] * 2
    assert set(cuda.registered) == {cache.pool.ctypes.data, cache.scales.ctypes.data}
    assert host.nbytes == sum(owned_mapping(a)[2] for a in cache_arrays(cache))
    host.close()
    assert cuda.registered == {} and host.nbytes == 0
    assert [name for name, _ in cuda.events[2:]] == ["cudaHostUnregister"] * 2
    host.close()  # twice: nothing left to release
    del cache
    gc.collect()
    again = KVCache(INT8, slots=2)  # may land on the freed pages: they are unregistered
    host = MappedHost(cuda)
    host.device_address(again.layer_views(0, 2)[0][0])
    host.close()


def test_a_registered_array_lives_until_unregistered():
    """Its pages cannot be freed (and handed to another allocation) while CUDA has them locked:
    MappedHost holds the array until it unregisters it."""
    cuda = CudaRuntime()
    host = MappedHost(cuda)
    cache = KVCache(INT8, slots=1)
    host.register(cache.pool)
    pool = weakref.ref(owned_mapping(cache.pool)[0])  # the array holding the pages
    del cache
    gc.collect()
    assert pool() is not None
    host.close()
    gc.collect()
    assert pool() is None


def test_a_mapped_host_dropped_without_close_unregisters_before_its_pages_go():
    """A Model dropped without `close` dropped its MappedHost and, with it, the only reference to
    the registered arrays: their pages were freed while CUDA still had them locked, and the next
    pool at those addresses (Linux reuses them at once) was refused with 712."""
    cuda = CudaRuntime()
    host = MappedHost(cuda)
    cache = KVCache(INT8, slots=1)
    host.register(cache.pool)
    buffer = host.empty((4,), np.float32)
    pool = weakref.ref(owned_mapping(cache.pool)[0])
    del cache, host, buffer
    gc.collect()
    assert cuda.registered == {} and cuda.allocated == {} and pool() is None
    assert [name for name, _ in cuda.events[-2:]] == ["cudaFreeHost", "cudaHostUnregister"]
    for _ in range(3):  # new pools, wherever they land, register
        again = KVCache(INT8, slots=1)
        MappedHost(cuda).register(again.pool)
        del again
        gc.collect()
    assert cuda.registered == {}


def test_step_buffers_are_allocated_zeroed_and_freed_once():
    cuda = CudaRuntime()
    host = MappedHost(cuda)
    ids = host.empty((2, 1), np.int64)
    logits = host.empty((2, 1, 10), np.float32)
    assert (ids == 0).all() and (logits == 0).all()  # CUDA does not zero: empty does
    assert host.device_address(logits[1]) == logits.ctypes.data + 40
    check_alignment("logits", host.device_address(logits))
    host.release(ids)
    with pytest.raises(KvedgeError, match="was not allocated by this MappedHost"):
        host.release(ids)
    host.close()
    assert cuda.allocated == {} and [n for n, _ in cuda.events].count("cudaFreeHost") == 2


def test_misaligned_addresses_and_slot_strides_are_refused_naming_the_tensor():
    check_alignment("past_key_values.0.key", 0x7F0000000000)
    with pytest.raises(KvedgeError, match=r"past_key_values.0.key: address 0x7f0000000010 is 16 bytes past"):
        check_alignment("past_key_values.0.key", 0x7F0000000010)
    # [slots, kv_heads, L, d] float32 with L = 100: a slot is 100 x 1 x 8 x 4 = 3200 bytes
    odd = KVCache(CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=8, max_len=100), slots=2)
    view = odd.layer_views(0, 2)[0][0]
    with pytest.raises(KvedgeError, match=r"a slot of this cache is 3200 bytes .*multiple of 8"):
        check_alignment("past_key_values.0.key", view.ctypes.data, view)


@pytest.mark.parametrize("geometry", [INT8, RINGS], ids=["int8", "rings"])
def test_every_view_of_these_geometries_is_aligned(geometry):
    """The pool is [layers, 2, slots, kv_heads, L, last]: a view at any layer, kind and first
    slot is a whole number of slot strides from a page-aligned start, so slot strides that are
    multiples of 256 keep every view aligned."""
    cache = KVCache(geometry, slots=3)
    for first in range(3):
        for count in range(1, 4 - first):
            for layer in cache.layer_views(first, count):
                for view in layer:
                    check_alignment("view", view.ctypes.data, view)
                    assert view.ctypes.data % ALIGNMENT == 0


def test_cache_pages_are_a_private_anonymous_mapping():
    """What one page-locks: MAP_PRIVATE (rw-p in /proc/self/maps), not the shmem of Python's
    default MAP_SHARED (rw-s)."""
    array = page_aligned((3, PAGE), np.uint8)
    start = array.ctypes.data
    for line in open("/proc/self/maps"):
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low <= start < high:
            assert line.split()[1] == "rw-p", line
            return
    raise AssertionError(f"{start:#x} not in /proc/self/maps")


def test_page_size_is_what_mmap_says():
    assert PAGE == mmap.PAGESIZE and PAGE % ALIGNMENT == 0
