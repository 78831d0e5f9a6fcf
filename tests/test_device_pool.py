"""The cache pool in device memory (`--kv-memory device`, `kvedge.runtime.backends.cuda.DeviceMemory`)
holds, after every CPU-side path, exactly what the mapped pool (`HostMemory`) holds: the portable
graph's new K/V written in, a rewind, window eviction (float and INT8), a stored block read out
and written back (prefix store round trip), a warm prefix saved to its file and loaded, ring
layers wrapping, and the INT8 round-trip hook. Equality is exact: both only move bytes (eviction
computes the same numpy arithmetic on the same inputs), so any difference is a copy gone wrong.

CUDA is `cuda_standin.CudaRuntime`: device memory the CPU cannot address (its addresses lie above
user space), copies held to cudaMemcpy / cudaMemcpy2D's documented contract (kinds, pitches,
every byte inside one allocation), cudaFree only of what cudaMalloc gave. That CUDA behaves so on
a device, and what the device pool costs or saves per decode step, is device_tests/'s to show.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import random_ids
from cuda_standin import DEVICE_BASE, CudaRuntime

from kvedge.cli import main
from kvedge.contract import CacheGeometry, ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.backends.cuda import DeviceMemory, MappedHost
from kvedge.runtime.backends.memory import (
    ALIGNMENT,
    ALL,
    DeviceArray,
    check_alignment,
    check_kv_memory,
    data_address,
)
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import RunTimePrefixStore, WarmPrefix, read_warm_file, write_warm_file

FLOAT = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=64)
HALF = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=64, dtype="float16")
INT8 = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=64, max_len=64, dtype="int8", group_size=32)
RINGS = CacheGeometry(
    num_layers=3, num_kv_heads=1, head_dim=16, max_len=64, ring_layers=(1,), window=16, ring_margin=16
)
RINGS_INT8 = CacheGeometry(
    num_layers=3,
    num_kv_heads=1,
    head_dim=32,
    max_len=64,
    ring_layers=(1,),
    window=16,
    ring_margin=16,
    dtype="int8",
    group_size=32,
)
GEOMETRIES = {"float32": FLOAT, "float16": HALF, "int8": INT8, "rings": RINGS, "rings_int8": RINGS_INT8}
SLOTS = 3


def pair(geometry: CacheGeometry) -> tuple[KVCache, KVCache, CudaRuntime]:
    cuda = CudaRuntime()
    return KVCache(geometry, SLOTS), KVCache(geometry, SLOTS, DeviceMemory(cuda)), cuda


def arrays(cache: KVCache) -> list:
    return [a for a in (cache.pool, cache.scales, cache.ring, cache.ring_scales) if a is not None]


def assert_same(host: KVCache, device: KVCache) -> None:
    """Every byte of every array, every slot; and the bookkeeping."""
    for mapped, on_device in zip(arrays(host), arrays(device), strict=True):
        assert isinstance(on_device, DeviceArray) and on_device.shape == mapped.shape
        for slot in range(SLOTS):
            np.testing.assert_array_equal(device.memory.get(on_device, slot, ALL), mapped[:, :, slot])
    for name in ("lengths", "tokens", "ring_start"):
        np.testing.assert_array_equal(getattr(device, name), getattr(host, name))


def present(geometry: CacheGeometry, rng, batch: int, seq: int) -> list[tuple[np.ndarray, ...]]:
    """New K/V (and scales) per layer as the portable graph returns them: [batch, kvh, seq, last]."""
    out = []
    for _ in range(geometry.num_layers):
        kv = rng.standard_normal((2, batch, geometry.num_kv_heads, seq, geometry.head_dim))
        if geometry.quantized:
            codes = rng.integers(-127, 128, kv.shape).astype(np.int8)
            scales = rng.uniform(0.01, 1, (*kv.shape[:-1], geometry.scale_groups)).astype(np.float16)
            out.append((codes[0], codes[1], scales[0], scales[1]))
        else:
            out.append(tuple(kv.astype(geometry.np_dtype)))
    return out


def append_both(host, device, rng, slots, counts) -> None:
    seq = max(counts)
    tokens = rng.integers(0, 300, (len(slots), seq))
    new = present(host.geometry, rng, len(slots), seq)
    host.append(slots, tokens, counts, new)
    device.append(slots, tokens, counts, new)


def assert_blocks_equal(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", GEOMETRIES)
def test_device_pool_matches_mapped_pool_on_every_cpu_path(name, tmp_path):
    geometry = GEOMETRIES[name]
    host, device, cuda = pair(geometry)
    rng = np.random.default_rng(0)
    assert_same(host, device)  # both start zero, scales one

    # the portable graph's new K/V: a prefill batch of uneven rows, then decode steps; the
    # ring layers wrap (40 > ring_len 32)
    append_both(host, device, rng, [0, 1, 2], [23, 40, 5])
    for _ in range(3):
        append_both(host, device, rng, [0, 1], [1, 1])
    assert_same(host, device)

    # a rewind, then new tokens over the stale positions
    rewind = host.rewind_limit(0, 20)
    for cache in (host, device):
        cache.truncate(0, rewind)
    append_both(host, device, rng, [0], [6])
    assert_same(host, device)

    # the prefix store round trip: out of slot 1, into slot 2 past a kept start
    stored = {}
    for label, cache in (("host", host), ("device", device)):
        lru = RunTimePrefixStore(geometry, 4 * geometry.bytes_per_token() * 16, block_tokens=16)
        lru.save(cache, 1)
        entry, shared = lru.best_match(cache.token_ids(1))
        lru.load(cache, 2, entry, shared)
        stored[label] = cache.read(2, cache.length(2))
    assert_blocks_equal(stored["host"], stored["device"])
    assert_same(host, device)

    # a warm prefix: read out of a slot (compute_prefix), to its file and back into another
    ids = tuple(int(t) for t in host.token_ids(1))
    for label, cache in (("host", host), ("device", device)):
        path = tmp_path / f"{label}.kvw"
        write_warm_file(path, WarmPrefix("p", ids, cache.read(1, len(ids))), geometry, "model")
        warm = read_warm_file(path, geometry, "model", ids)
        cache.write(0, warm.block, ids)
    assert (tmp_path / "host.kvw").read_bytes() == (tmp_path / "device.kvw").read_bytes()
    assert_same(host, device)

    # window eviction (not for ring layers: refused by name on both)
    inv_freq = np.geomspace(1, 1e-4, geometry.head_dim // 2)
    if geometry.ring_layers:
        for cache in (host, device):
            with pytest.raises(KvedgeError, match="window eviction"):
                cache.evict(0, 4, 8, inv_freq)
    else:
        for cache in (host, device):
            cache.evict(0, 4, 8, inv_freq)
        assert_same(host, device)
    assert_blocks_equal(host.view(0, 2, host.length(0)), device.view(0, 2, device.length(0)))

    device.close()
    assert not cuda.device and [n for n, _ in cuda.events].count("cudaFree") == len(arrays(device))


def test_round_trip_hook_sees_the_same_blocks():
    host, device, _ = pair(FLOAT)
    seen = {"host": [], "device": []}
    for label, cache in (("host", host), ("device", device)):
        cache.round_trip = lambda block, start, label=label: seen[label].append((block.copy(), start))
    append_both(host, device, np.random.default_rng(1), [0], [9])
    (a, start_a), (b, start_b) = seen["host"][0], seen["device"][0]
    assert start_a == start_b == 0 and a.shape == (2, 2, 2, 9, 16)
    np.testing.assert_array_equal(a, b)


def test_device_arrays_are_cudamalloc_memory_bound_where_they_are():
    """The pool is cudaMalloc'd, zeroed (scales filled with 1), and never page-locked: its views
    bind at their device address, a whole number of 256-byte aligned slot strides apart."""
    cuda = CudaRuntime()
    cache = KVCache(INT8, SLOTS, DeviceMemory(cuda))
    assert [n for n, _ in cuda.events if n == "cudaMalloc"] == ["cudaMalloc"] * 2
    assert all(a.address >= DEVICE_BASE and a.address % ALIGNMENT == 0 for a in arrays(cache))
    host = MappedHost(cuda)
    layer = cache.layer_views(1, 2)[1]  # layer 1: K, V, K scales, V scales of slots 1..2
    for view, array, kind in zip(layer, [cache.pool] * 2 + [cache.scales] * 2, (0, 1, 0, 1), strict=True):
        assert view.shape == (2, *array.shape[3:]) and view.flags.c_contiguous
        expected = array.address + ((1 * 2 + kind) * SLOTS + 1) * array.strides[2]
        assert host.device_address(view) == expected
        check_alignment("view", host.device_address(view), view)
    row = layer[0][1:2]  # slot 2 alone, as the in-place prefill binds a batch row by row
    assert row.shape == (1, *cache.pool.shape[3:]) and row.address == layer[0].address + layer[0].strides[0]
    plain = np.zeros(4)
    assert data_address(row) == row.address and data_address(plain) == plain.ctypes.data
    with pytest.raises(TypeError, match="only \\[first:end\\] of its leading axis"):
        layer[0][0]
    assert cuda.registered == {} and host.nbytes == 0  # nothing page-locked
    np.testing.assert_array_equal(cache.memory.get(cache.scales, 2, ALL), 1)
    # a CPU-side write reaches the device only through the copies, and is synchronized
    before = len(cuda.events)
    cache.memory.set(cache.pool, 0, slice(3, 5), 7, layer=1, kind=0)
    names = [n for n, _ in cuda.events[before:]]
    assert names == ["cudaMemcpy2D", "cudaDeviceSynchronize"]
    got = cache.memory.get(cache.pool, 0, slice(2, 6), layer=1, kind=0)  # [kv_heads, 4, head_dim]
    assert got.shape == (2, 4, 64) and (got[:, 1:3] == 7).all() and (got[:, [0, 3]] == 0).all()
    cache.close()
    cache.close()  # twice: nothing left
    assert cuda.device == {}


def test_the_standin_holds_copies_to_cudas_contract():
    """What would fail on a device fails here: a plain int for the copy kind (cuda-python's
    signature wants a cudaMemcpyKind), rows past an allocation, width past a pitch, freeing
    twice."""
    cuda = CudaRuntime()
    address = cuda.cudaMalloc(64)[1]
    host = np.zeros(64, np.uint8)
    with pytest.raises(TypeError, match="cudaMemcpyKind"):
        cuda.cudaMemcpy(address, host.ctypes.data, 64, 1)
    kind = cuda.cudaMemcpyKind.cudaMemcpyHostToDevice
    assert cuda.cudaMemcpy(address, host.ctypes.data, 65, kind)[0] == 1
    assert cuda.cudaMemcpy2D(address, 16, host.ctypes.data, 16, 17, 2, kind)[0] == 12
    assert cuda.cudaMemcpy(host.ctypes.data, address, 64, kind)[0] == 1  # host named as device
    assert cuda.cudaFree(address)[0] == 0 and cuda.cudaFree(address)[0] == 1


def test_kv_memory_is_checked_when_given():
    check_kv_memory("device", "cuda")
    check_kv_memory("mapped", "cpu")
    with pytest.raises(
        KvedgeError, match=r"--kv-memory 'pinned' is not supported; allowed: \['mapped', 'device'\]"
    ):
        check_kv_memory("pinned", "cuda")
    with pytest.raises(KvedgeError, match="needs --device cuda or tensorrt, not 'cpu'"):
        check_kv_memory("device", "cpu")


def test_cli_refuses_a_device_pool_on_the_cpu_without_a_traceback(tmp_path):
    result = CliRunner().invoke(main, ["generate", "hi", "--model", str(tmp_path), "--kv-memory", "device"])
    assert result.exit_code != 0 and "needs --device cuda or tensorrt" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_service_config_refuses_a_device_pool_on_the_cpu(tmp_path):
    from kvedge.contract import MANIFEST_FILE
    from kvedge.serve.config import load_service_config

    (tmp_path / MANIFEST_FILE).write_text("{}")
    assert load_service_config(None, {"model": tmp_path}).kv_memory == "mapped"
    config = load_service_config(None, {"model": tmp_path, "device": "cuda", "kv_memory": "device"})
    assert config.kv_memory == "device"
    with pytest.raises(KvedgeError, match="--kv-memory=device puts the cache in GPU memory: it needs device"):
        load_service_config(None, {"model": tmp_path, "kv_memory": "device"})
    with pytest.raises(KvedgeError, match=r"--kv-memory='pinned' is not allowed; allowed: .*mapped"):
        load_service_config(None, {"model": tmp_path, "kv_memory": "pinned"})


def test_a_pool_that_does_not_fit_gives_back_what_was_allocated():
    """cudaMalloc of the scales fails (out of memory): the pool allocated before it is freed."""
    cuda = CudaRuntime()
    malloc = cuda.cudaMalloc
    cuda.cudaMalloc = lambda size: (
        malloc(size) if not cuda.device else (cuda.cudaError_t.cudaErrorMemoryAllocation, None)
    )
    with pytest.raises(KvedgeError, match=r"cudaMalloc\(\d+ bytes\) failed: cudaErrorMemoryAllocation"):
        KVCache(INT8, SLOTS, DeviceMemory(cuda))
    assert cuda.device == {} and [n for n, _ in cuda.events].count("cudaFree") == 1


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("pool")
    export_model(make_tiny_model(root / "hf", "llama"), root / "out", ExportRecipe(max_len=64))
    return root / "out"


def test_a_tiny_models_cache_operations_match(tiny_export):
    """A tiny Llama's real K/V (its prefill on onnxruntime CPU, then one decode step's new K/V as
    the portable graph returns them) through both pools: written in as a warm prefix is, appended,
    saved to and loaded from the prefix store, evicted with the model's RoPE frequencies."""
    model = Model(tiny_export, slots=1)
    ids = random_ids(24)
    logits = prefill(model.backend, model.cache, 0, [ids])
    g = model.manifest.geometry
    host, device = KVCache(g, SLOTS), KVCache(g, SLOTS, DeviceMemory(CudaRuntime()))
    token = np.array([[int(np.argmax(logits[0]))]])
    for cache in (host, device):
        cache.write(0, model.cache.read(0, len(ids)), ids)
    out = model.backend.run(token, np.array([[24]]), np.array([24]), np.array([0]), host.layer_views(0, 1))
    assert out.present is not None  # the portable graph: the runtime writes the new K/V
    for cache in (host, device):
        cache.append([0], token, [1], out.present)
        lru = RunTimePrefixStore(g, 2 * g.bytes_per_token() * 16, block_tokens=16)
        lru.save(cache, 0)
        lru.load(cache, 1, *lru.best_match(cache.token_ids(0)))
        cache.evict(1, 4, 6, model.inv_freq)
        cache.truncate(0, 10)
    assert_same(host, device)
    np.testing.assert_array_equal(device.read(0, 10).kv, model.cache.read(0, 10).kv)
    model.close()


@pytest.mark.parametrize("geometry", [FLOAT, INT8, RINGS], ids=["float32", "int8", "rings"])
def test_a_steps_new_kv_reaches_a_device_pool_with_one_wait(geometry):
    """A portable graph's step returns its new K/V, which `KVCache.append` copies per layer and
    kind; each copy waited for the device (cudaDeviceSynchronize), 60 round trips a token on
    SmolLM2. Now the step's copies wait once, and the pool holds what a host pool holds."""
    cuda = CudaRuntime()
    device, host = KVCache(geometry, 2, DeviceMemory(cuda)), KVCache(geometry, 2)
    rng = np.random.default_rng(0)
    g, batch, seq = geometry, 2, 3
    shapes = [(batch, g.num_kv_heads, seq, g.head_dim)] * 2
    if g.quantized:
        shapes += [(batch, g.num_kv_heads, seq, g.scale_groups)] * 2
    dtypes = [g.np_dtype] * 2 + [np.float16] * (len(shapes) - 2)
    present = [
        tuple((rng.standard_normal(s) * 20).astype(d) for s, d in zip(shapes, dtypes, strict=True))
        for _ in range(g.num_layers)
    ]
    tokens = np.arange(batch * seq, dtype=np.int64).reshape(batch, seq)
    before = len(cuda.events)
    device.append([0, 1], tokens, [3, 2], present)
    host.append([0, 1], tokens, [3, 2], present)
    names = [name for name, _ in cuda.events[before:]]
    assert names.count("cudaDeviceSynchronize") == 1 and names[-1] == "cudaDeviceSynchronize", names
    assert names.count("cudaMemcpy2D") >= 2 * g.num_layers
    for slot in (0, 1):
        n = int(host.lengths[slot])
        np.testing.assert_array_equal(
            device.memory.get(device.pool, slot, slice(0, n)), host.pool[:, :, slot, :, :n]
        )
    device.close()
