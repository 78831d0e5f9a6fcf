"""Where the cache pool should live on this GPU: mapped pinned host memory (what kvedge does today,
`kvedge.runtime.backends.cuda.MappedHost`) or device memory (cudaMalloc: `--kv-memory device`,
`kvedge.runtime.backends.cuda.DeviceMemory`, whose decode time test_ort_cuda.py and test_tensorrt.py
record beside the mapped pool's). CUDA for Tegra recommends device memory for buffers only
the GPU uses, since Orin's GPU does not cache pinned host memory; on a discrete GPU mapped memory
is read over PCIe.

The probe: a one-node graph (ReduceSum) that reads a whole buffer the size of a SmolLM2-135M
float32 cache at a context of 64 and of 1536 tokens (30 layers x K, V x 3 kv heads x 64 x 4 bytes
per token), bound as "cuda" at a mapped address, at a cudaMalloc address and at a
cudaMallocManaged address (which a Jetson's GPU caches and numpy can still address), run 50
times each on onnxruntime's CUDA provider. Every read must give the same sum; the figures are
milliseconds per read and GB/s, per placement and context: the decode step reads its cache
once, so this is the floor each placement puts under decode at that context.
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
import pytest
from artifacts import POOL_READER, take

from kvedge.accel import cuda_call, import_cudart
from kvedge.runtime.backends.cuda import MappedHost
from kvedge.runtime.backends.memory import page_aligned

pytestmark = pytest.mark.ort_cuda

TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32 cache: bytes per token over all layers
RUNS = 50


def _reader(folder) -> ort.InferenceSession:
    """The one-node ReduceSum graph (device_tests/artifacts.py): cache [n] float32 -> total [1]."""
    path = take(POOL_READER, folder)
    return ort.InferenceSession(str(path), providers=[("CUDAExecutionProvider", {"use_tf32": "0"})])


def _read_ms(session: ort.InferenceSession, address: int, count: int) -> tuple[float, float]:
    """(ms per read, the sum) of `count` float32 at device `address`."""
    binding = session.io_binding()
    binding.bind_input("cache", "cuda", 0, np.float32, [count], address)
    binding.bind_output("total", "cpu")
    session.run_with_iobinding(binding)  # warm-up
    start = time.perf_counter()
    for _ in range(RUNS):
        session.run_with_iobinding(binding)
    elapsed = (time.perf_counter() - start) / RUNS * 1e3
    return elapsed, float(binding.copy_outputs_to_cpu()[0][0])


@pytest.mark.parametrize("context", [64, 1536])
def test_pool_placement_read_time(context, tmp_path, record):
    cudart = import_cudart()
    session = _reader(tmp_path)
    count = context * TOKEN_BYTES // 4
    values = np.random.default_rng(0).standard_normal(count).astype(np.float32)  # [count]
    host = MappedHost(cudart)
    allocated = []  # device and managed buffers, freed after the session
    times = {}
    try:
        mapped = page_aligned((count,), np.float32)
        mapped[...] = values
        times["mapped"] = _read_ms(session, host.device_address(mapped), count)
        # managed memory: the CPU may touch it between kernels, so the pool could stay numpy
        flags = cudart.cudaMemAttachGlobal
        for name, allocate in (
            ("device", lambda: cudart.cudaMalloc(values.nbytes)),
            ("managed", lambda: cudart.cudaMallocManaged(values.nbytes, flags)),
        ):
            address = int(cuda_call(cudart, allocate(), name))
            allocated.append(address)
            kind = cudart.cudaMemcpyKind.cudaMemcpyDefault
            cuda_call(
                cudart, cudart.cudaMemcpy(address, values.ctypes.data, values.nbytes, kind), "cudaMemcpy"
            )
            times[name] = _read_ms(session, address, count)
    finally:
        session = None
        host.close()
        for address in allocated:
            cuda_call(cudart, cudart.cudaFree(address), "cudaFree")
    gb = values.nbytes / 1e9
    record(f"pool_placement.context_{context}.bytes", values.nbytes)
    for name, (ms, total) in times.items():
        assert total == pytest.approx(times["mapped"][1], rel=1e-5), name
        record(f"pool_placement.context_{context}.{name}_ms", ms)
        record(f"pool_placement.context_{context}.{name}_GBps", gb / (ms / 1e3))
