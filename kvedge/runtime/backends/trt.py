"""TensorRT backend: `Backend` (`run(...) -> StepOutput`, `reserve`) over `model.engine`.

UNVERIFIED ON HARDWARE: written against TensorRT 10's and the CUDA runtime's documented APIs
(called as cuda-python's, `kvedge.accel.import_cudart`); no GPU or TensorRT was available when it
was written. device_tests/test_tensorrt.py compares it with the onnxruntime CPU reference; run
that before trusting it.

Memory, for Jetson's unified memory (CPU and GPU share one DRAM)::

    cache pool   the KVCache's own arrays (pool; for an INT8 cache its float16 scales), each in
                 its own whole pages (`kvedge.runtime.backends.memory`), page-locked once with
                 cudaHostRegister(Mapped) at `reserve` and unregistered at `close`; past K/V [batch, kv_heads,
                 max_len, head_dim] views (int8 caches: then K/V scales [batch, kv_heads, max_len,
                 groups] float16) are bound by device pointer, so the GPU reads the cache in
                 place and nothing cache-sized is copied
    inputs       input_ids, position_ids [B, P]; past_lengths, last_index [B]   engine int dtype
                 (last_index [B, R] in a "rows" engine: up to R = max_rows logits rows per
                 sequence on the prefill profile, for a speculative verify; one on decode's)
    outputs      logits [B, R, vocab] float32; per layer the new tokens only (`KVCache.append`
                 writes them into the pool): present K/V [B, kv_heads, P, head_dim] in the cache
                 dtype, then for int8 caches their scales [B, kv_heads, P, groups] float16
    states       hybrid models (LFM2, Qwen3.5): each state layer's past state [B, *shape], a view
                 of `KVCache.states` (whole pages, page-locked as the pool), bound in place; its
                 new state an output buffer, which `KVCache.write_states` copies back

Inputs and outputs are mapped pinned host buffers (cudaHostAlloc Mapped), allocated once for
the engine's largest profile (B = max_batch, P = max_prefill, R = max_rows): the GPU reads and
writes them directly and the hot path allocates nothing. Every bound address is checked for
TensorRT's 256-byte alignment, and every setter's answer is checked. A step returns logits as
`OrtBackend` does (`interface.step_logits`): [batch, vocab] for last_index [batch], [batch, n,
vocab] for last_index [batch, n]; which calls fit the profiles is `EngineManifest.call_refusal`'s.
On a discrete GPU the same code is correct but every cache read crosses PCIe; it is meant for
Jetson. Not done yet: CUDA graph capture of the decode step.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.accel import cuda_call, current_device, import_cudart, import_tensorrt
from kvedge.contract import Manifest, TensorSpec
from kvedge.contract.engine import DECODE_PROFILE, ENGINE_FILE, PREFILL_PROFILE, EngineManifest, profile_for
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.cuda import MappedHost
from kvedge.runtime.backends.memory import check_alignment
from kvedge.runtime.embeddings import HostInputs
from kvedge.runtime.interface import StepOutput, step_logits, step_values

log = logging.getLogger(__name__)
PROFILE_NAMES = {PREFILL_PROFILE: "prefill", DECODE_PROFILE: "decode"}


class TrtBackend:
    """TensorRT over `model.engine` in an artifact folder: one execution context per optimization
    profile (prefill, decode), each set to its profile once, so no step switches profiles (a
    switch costs a resource update, TensorRT warns)."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.trt, self.cudart = import_tensorrt(), import_cudart()
        self.manifest = manifest
        self.engine_manifest = EngineManifest.load(folder)
        self.engine_manifest.check_model(manifest)
        self.engine_manifest.check_runtime(
            self.trt.__version__, current_device(self.cudart), "tensorrt", folder
        )
        # the profiles' most sequences per call, and tokens per sequence
        self.max_batch: int | None = self.engine_manifest.max_batch
        self.max_prefill: int | None = self.engine_manifest.max_prefill
        self.host = MappedHost(self.cudart)  # the pool, mapped in place, and the step buffers
        self.contexts: dict[int, Any] = {}  # profile -> the execution context that runs it
        # the stream and the contexts' activation buffer: given back by `close`, or by this
        # finalizer when the backend is dropped without it (it holds the dicts, not the backend)
        self._owned: dict[str, Any] = {}
        self._release = weakref.finalize(self, _release_unclosed, self.cudart, self.contexts, self._owned)
        self._owned["stream"] = self._call(self.cudart.cudaStreamCreate(), "cudaStreamCreate")
        # profile -> {tensor: (address, shape)} last given its context: TensorRT keeps both
        # across execute_async_v3, so a step sets only what changed
        self.bound: dict[int, dict[str, tuple[int, tuple[int, ...] | None]]] = {}
        self.engine = self.runtime = None
        try:
            self._load(Path(folder), manifest)
        except BaseException:
            self.close()
            raise

    def _load(self, folder: Path, manifest: Manifest) -> None:
        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        self.engine = deserialize_engine(self.runtime, folder / ENGINE_FILE)
        if self.engine is None:
            raise KvedgeError(f"TensorRT could not load {folder / ENGINE_FILE}; rebuild it")
        # TensorRT gives a profile to one context at a time: context i runs profile i. By default
        # (kSTATIC) each context reserves activation memory for every profile; the two never run
        # at once (`run` synchronizes), so they share one buffer of the largest size instead
        size = max(int(self.engine.device_memory_size_v2), 256)
        self._owned["scratch"] = int(self._call(self.cudart.cudaMalloc(size), f"cudaMalloc({size} bytes)"))
        for profile in (PREFILL_PROFILE, DECODE_PROFILE):
            context = self.engine.create_execution_context(
                self.trt.ExecutionContextAllocationStrategy.USER_MANAGED
            )
            if context is None:
                raise KvedgeError("TensorRT could not create an execution context (out of GPU memory?)")
            context.set_device_memory(self.scratch, size)
            self.contexts[profile] = context
            self.bound[profile] = {}
            what = f"set_optimization_profile_async({profile}) ({PROFILE_NAMES[profile]} profile)"
            try:
                # the binding raises RuntimeError where setOptimizationProfileAsync answers false
                # (python/src/infer/pyCore.cpp); a fake or another version may answer False
                _check(context.set_optimization_profile_async(profile, int(self.stream)), what)
            except RuntimeError as exc:
                raise KvedgeError(f"TensorRT refused {what}: {exc}; see its log above") from None

        self.on_host = self._host_inputs(manifest)
        self.lookups = HostInputs.of(folder, manifest)  # None: the engine gathers all its own
        built = self.engine_manifest
        b, p, r = built.max_batch, built.max_prefill, built.max_rows
        self.buffers: dict[str, tuple[np.ndarray, int]] = {}  # name -> (flat host view, device ptr)
        # per-call inputs and every output get a buffer for the largest call; past K/V are the pool
        self.step_inputs = [spec for spec in manifest.graph_inputs() if spec.layer is None]
        self.outputs = manifest.graph_outputs()  # logits, then each layer's present K, V
        for spec in self.step_inputs + list(self.outputs):
            dtype = np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(spec.name)))
            flat = self.host.empty((int(np.prod(spec.shape(b, p, r))),), dtype)
            self.buffers[spec.name] = flat, self.host.device_address(flat)
            check_alignment(spec.name, self.buffers[spec.name][1])

    @property
    def stream(self) -> Any:
        """The CUDA stream every step runs on; None once closed."""
        return self._owned.get("stream")

    @property
    def scratch(self) -> int | None:
        """The contexts' one activation buffer (device memory), once loaded."""
        return self._owned.get("scratch")

    def _call(self, result: tuple, what: str) -> Any:
        return cuda_call(self.cudart, result, what)

    def _host_inputs(self, manifest: Manifest) -> set[str]:
        """The step inputs this engine reads from host memory (`get_tensor_location` HOST: shape
        inputs, whose values TensorRT needs before it runs), bound at their buffers' host
        addresses; every other tensor must be on the device, where the pool and the outputs are
        bound: an engine that wants one of those on the host is refused, naming it."""
        host = self.trt.TensorLocation.HOST
        on_host = set()
        for spec in [*manifest.graph_inputs(), *manifest.graph_outputs()]:
            if self.engine.get_tensor_location(spec.name) != host:
                continue
            if spec.layer is not None or spec.name not in {s.name for s in manifest.graph_inputs()}:
                raise KvedgeError(
                    f"this engine reads {spec.name!r} from host memory; kvedge binds it in device "
                    "memory (the cache pool and the outputs); rebuild the engine from this export"
                )
            shape_io = self.engine.is_shape_inference_io(spec.name)
            log.info("%s: host memory (shape input: %s), bound at its host address", spec.name, shape_io)
            on_host.add(spec.name)
        return on_host

    def reserve(
        self, past: list[tuple[np.ndarray, ...]], max_len: int, states: dict[str, np.ndarray] | None = None
    ) -> None:
        """Page-lock the cache pool now rather than at the first step, and refuse now a pool
        whose views TensorRT could not take (256-byte alignment, at any slot); every other
        buffer was allocated at construction for the largest profile, so nothing grows later."""
        names, g = self.manifest.names, self.manifest.geometry
        for i, views in enumerate(past):
            for template, view in zip(names.cache_past(g), views, strict=True):
                check_alignment(names.layer(template, i), self.host.device_address(view), view)
        for name, view in (states or {}).items():  # hybrid models: the states, bound in place too
            check_alignment(name, self.host.device_address(view), view, state=True)

    def verify_refusal(self) -> str | None:
        """Why this engine cannot verify a speculative step: the graph's reason
        (`Manifest.verify_refusal`), else its profiles' (`EngineManifest.verify_refusal`), or None."""
        return self.manifest.verify_refusal() or self.engine_manifest.verify_refusal()

    def run(
        self,
        input_ids: np.ndarray,  # [batch, seq] int64
        position_ids: np.ndarray,  # [batch, seq] int64
        past_lengths: np.ndarray,  # [batch] int64
        last_index: np.ndarray,  # [batch] int64, or [batch, rows] (`verify_refusal` is None)
        past: list[tuple[np.ndarray, ...]],  # per layer [batch, kvh, max_len, d] pool views
        counts: np.ndarray | None = None,  # [batch] real tokens per row; portable graphs ignore it
        states: dict[str, np.ndarray] | None = None,  # `KVCache.state_views` of the rows' slots
    ) -> StepOutput:
        """One step; logits [batch, vocab], or [batch, rows, vocab] for last_index [batch, rows]."""
        if self.stream is None:
            raise KvedgeError("this TensorRT backend was closed")
        names, g = self.manifest.names, self.manifest.geometry
        batch, seq = input_ids.shape
        rows = last_index.size // batch  # logits rows asked of each sequence
        if last_index.ndim == 2 and (refusal := self.verify_refusal()):
            raise KvedgeError(refusal)
        if refusal := self.engine_manifest.call_refusal(batch, seq, rows):
            raise KvedgeError(refusal)
        profile = profile_for(seq)
        context = self.contexts[profile]
        values = step_values(
            self.manifest, self.lookups, input_ids, position_ids, past_lengths, last_index, counts
        )
        for spec in self.step_inputs:
            value, (host, device) = values[spec.name], self.buffers[spec.name]
            np.copyto(host[: value.size].reshape(value.shape), value, casting="same_kind")
            address = host.ctypes.data if spec.name in self.on_host else device  # `_host_inputs`
            self._bind(profile, spec.name, address, value.shape)
        for i, views in enumerate(past):
            for template, view in zip(names.cache_past(g), views, strict=True):
                name = names.layer(template, i)
                self._bind(profile, name, self.host.device_address(view), view.shape)
        if g.states and not states:
            raise KvedgeError(f"{self.manifest.model_type} keeps per-slot states: a step needs them")
        for name, view in (states or {}).items():  # [batch, *shape], in place as the pool
            self._bind(profile, name, self.host.device_address(view), view.shape)
        for spec in self.outputs:
            self._bind(profile, spec.name, self.buffers[spec.name][1])

        if not context.execute_async_v3(int(self.stream)):
            raise KvedgeError("TensorRT execute_async_v3 failed; see its log above")
        self._call(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

        logits, *layers = [self._output(spec, batch, seq, rows) for spec in self.outputs if not spec.state]
        per_layer = len(layers) // g.num_layers
        present = [tuple(layers[i * per_layer : (i + 1) * per_layer]) for i in range(g.num_layers)]
        new_states = {spec.name: self._output(spec, batch, seq, rows) for spec in self.outputs if spec.state}
        return StepOutput(step_logits(logits, last_index), present, new_states or None)

    def _bind(self, profile: int, name: str, address: int, shape: tuple[int, ...] | None = None) -> None:
        """Give `profile`'s context tensor `name` at device `address` (and, for an input, its
        `shape`), refusing what TensorRT refuses (it says so with False) or would misread. What
        the context holds already from an earlier step is not set again."""
        context, bound = self.contexts[profile], self.bound[profile]
        shape = None if shape is None else tuple(int(n) for n in shape)
        before_address, before_shape = bound.pop(name, (None, None))  # back only once both took
        check_alignment(name, address)
        if shape is not None and shape != before_shape:
            _check(context.set_input_shape(name, shape), f"set_input_shape({name!r}, {list(shape)})")
        if address != before_address:
            _check(context.set_tensor_address(name, address), f"set_tensor_address({name!r}, {address:#x})")
        bound[name] = address, shape

    def _output(self, spec: TensorSpec, batch: int, seq: int, rows: int) -> np.ndarray:
        """The output `spec` of the last call, a view of its pinned buffer."""
        shape = spec.shape(batch, seq, rows)
        return self.buffers[spec.name][0][: int(np.prod(shape))].reshape(shape)

    def close(self) -> None:
        """Stop using the GPU and give its memory back, in that order: the contexts and the
        engine that read the pool and the step buffers go first, then the mapped memory is
        unregistered and freed, and the contexts' activation buffer, then the stream. The backend
        is unusable afterwards; safe to call twice."""
        if self.stream is None:
            return
        try:
            self._call(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        finally:
            self.contexts.clear()
            self.bound = {}
            self.engine = self.runtime = None
            try:
                try:
                    self.host.close()
                finally:
                    if (scratch := self._owned.pop("scratch", None)) is not None:
                        self._call(self.cudart.cudaFree(scratch), f"cudaFree({scratch:#x})")
            finally:
                stream = self._owned.pop("stream")
                self._call(self.cudart.cudaStreamDestroy(stream), "cudaStreamDestroy")


def _release_unclosed(cudart: Any, contexts: dict[int, Any], owned: dict[str, Any]) -> None:
    """What `close` gives back, for a TrtBackend dropped without it: the contexts go first (the
    last references to them), then their activation buffer, then the stream. Nobody is left to
    raise to; the mapped memory is its `MappedHost`'s own finalizer's."""
    if not owned:
        return
    log.warning("a TrtBackend was dropped without close(); releasing its stream and GPU memory")
    contexts.clear()
    for key, call in (("scratch", cudart.cudaFree), ("stream", cudart.cudaStreamDestroy)):
        if key in owned:
            try:
                cuda_call(cudart, call(owned.pop(key)), call.__name__)
            except KvedgeError as exc:
                log.warning("%s", exc)


def _check(ok: bool, what: str) -> None:
    """TensorRT's setters answer False where they refuse (the reason goes to its logger)."""
    if not ok:
        raise KvedgeError(f"TensorRT refused {what}; see its log above")


def deserialize_engine(runtime: Any, path: Path) -> Any:
    """`runtime.deserialize_cuda_engine` over `path` memory-mapped: TensorRT reads the file's pages
    where they are, so no anonymous copy of the whole engine sits in host memory beside the one it
    makes on the device (page-cache pages, which the kernel can drop); None where TensorRT could
    not load it. The buffer overload every TensorRT 10 binding has (a stream reader is 10.7+)."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return runtime.deserialize_cuda_engine(mapped)
