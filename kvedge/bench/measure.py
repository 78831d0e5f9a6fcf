"""Machine and model measurements behind the benchmark's figures.

Roofline: a decode step must read every weight once plus the valid KV cache, so

    bytes per token  = weight bytes read per token + context * KV bytes per token
    bound (ms/token) = bytes per token / copy bandwidth
    fraction         = bound / measured ms/token

Copy bandwidth is timed here with numpy (one thread, like most single kernels): the best of
several copies of a 256 MiB float32 array, counting bytes read plus bytes written (the STREAM
"copy" convention). Weight bytes per token count every initializer a step reads in full; a
table only gathered from (embedding rows, RoPE rows) counts as read-per-row, i.e. ~0.

Quality: for each prompt, next-token distributions at every position, teacher-forced, against
the float32 reference: mean KL(p_ref || p) in nats and top-1 agreement (argmax equal).
"""

from __future__ import annotations

import multiprocessing
import resource
import time
import tracemalloc
from pathlib import Path

import numpy as np

from kvedge.bench.systems import ChildSystem, SystemSpec

GATHER_OPS = {"Gather", "GatherBlockQuantized"}
ROW_READ_INPUTS = {"GroupQueryAttention": (7, 8)}  # cos_cache, sin_cache: one row per token


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large numpy copy (read + write counted)."""
    src = np.ones(mib * 2**18, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best


MODEL_FILES = (
    "*.onnx",
    "*.onnx.data",
    "embeddings.bin",
    "*.safetensors",
)  # in a folder: what holds the graph and weights


def artifact_bytes(path: Path) -> int:
    """The bytes of a system's model files on disk: a file's own (a GGUF), or a folder's
    `MODEL_FILES` (a kvedge export's model.onnx + model.onnx.data, an onnxruntime-genai build's,
    an HF folder's safetensors); tokenizers, configs and manifests are not counted."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for pattern in MODEL_FILES for p in path.glob(pattern))


def onnx_weight_bytes_per_token(path: Path) -> int:
    """Bytes of initializers a decode step reads in full (gather-only tables excluded)."""
    import onnx
    from onnx import TensorProto, helper

    from kvedge.export.graph import decode_step_graphs

    model = onnx.load(str(path), load_external_data=False)
    graphs = decode_step_graphs(model.graph)  # a two-form graph's prefill branch is not read
    row_read: set[str] = set()
    consumers: dict[str, set[str]] = {}
    for node in (node for graph in graphs for node in graph.node):
        for index, name in enumerate(node.input):
            consumers.setdefault(name, set()).add(node.op_type)
            if index in ROW_READ_INPUTS.get(node.op_type, ()):
                row_read.add(name)
    total = 0
    for tensor in (tensor for graph in graphs for tensor in graph.initializer):
        ops = consumers.get(tensor.name, set())
        if not ops or ops <= GATHER_OPS or tensor.name in row_read:
            continue
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        if tensor.data_type in (TensorProto.INT4, TensorProto.UINT4):
            total += (count + 1) // 2
        else:
            total += count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def gguf_weight_bytes(path: Path) -> int:
    """All tensor bytes of a GGUF file (a tied model reads its embedding as the LM head too)."""
    import gguf

    return int(sum(t.n_bytes for t in gguf.GGUFReader(str(path)).tensors))


def kl_and_top1(reference: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position KL(p_ref || p) in nats and top-1 agreement, for logits [n, vocab]."""
    ref = reference.astype(np.float64)
    got = logits.astype(np.float64)
    log_p = ref - ref.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = got - got.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    return kl, ref.argmax(-1) == got.argmax(-1)


def peak_rss_mib(spec: SystemSpec, threads: int, prompt: list[int], steps: int) -> float:
    """Peak RSS of a fresh process that loads `spec`, prefills `prompt` and decodes `steps`.

    Raises SystemCrashed when that process dies."""
    child = ChildSystem(spec, threads)
    try:
        child.run(prompt, steps)
        return child.peak_rss_mib()
    finally:
        child.close()


def allocation_profile(spec: SystemSpec, threads: int, prompt: list[int], steps: int) -> dict[str, float]:
    """RSS and Python-heap (tracemalloc) growth over `steps` kvedge decode steps, in a fresh process."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_allocation_child, (spec, threads, prompt, steps))


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def _allocation_child(spec: SystemSpec, threads: int, prompt: list[int], steps: int) -> dict[str, float]:
    system = spec.build(threads)
    system.run(prompt, 0)
    cache, step = system.step_for_profile()
    token = 5
    warmup = min(100, steps // 10)
    for _ in range(warmup):
        token = int(np.argmax(step(token)))
    tracemalloc.start()
    rss_start, heap_start = rss_bytes(), tracemalloc.get_traced_memory()[0]
    start_len = cache.length(0)
    rss_samples = []
    for i in range(steps - warmup):
        token = int(np.argmax(step(token)))
        if i % 100 == 0:
            rss_samples.append(rss_bytes())
    heap_end, heap_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "steps": steps - warmup,
        "context_from": start_len,
        "context_to": cache.length(0),
        "rss_growth_mib": (rss_bytes() - rss_start) / 2**20,
        "rss_max_growth_mib": (max(rss_samples) - rss_start) / 2**20,
        "heap_growth_kib": (heap_end - heap_start) / 1024,
        "heap_peak_above_start_kib": (heap_peak - heap_start) / 1024,
    }
