"""TensorRT backend: `Backend` (`run(...) -> StepOutput`, `reserve`) over `model.engine`.

UNVERIFIED ON HARDWARE: written against TensorRT 10's and cuda-python's documented APIs; no GPU,
TensorRT or cuda-python was available when it was written. device_tests/test_tensorrt.py
compares it with the onnxruntime CPU reference; run that before trusting it.

Memory, for Jetson's unified memory (CPU and GPU share one DRAM)::

    cache pool   the KVCache's own numpy pool (and, for an INT8 cache, its float16 scales pool),
                 page-locked once with cudaHostRegister(Mapped); past K/V [batch, kv_heads,
                 max_len, head_dim] views (int8 caches: then K/V scales [batch, kv_heads, max_len,
                 groups] float16) are bound by device pointer, so the GPU reads the cache in
                 place and nothing cache-sized is copied
    inputs       input_ids, position_ids [B, P]; past_lengths, last_index [B]   engine int dtype
    outputs      logits [B, 1, vocab] float32; per layer the new tokens only (`KVCache.append`
                 writes them into the pool): present K/V [B, kv_heads, P, head_dim] in the cache
                 dtype, then for int8 caches their scales [B, kv_heads, P, groups] float16

Inputs and outputs are mapped pinned host buffers (cudaHostAlloc Mapped), allocated once for
the engine's largest profile (B = max_batch, P = max_prefill): the GPU reads and writes them
directly and the hot path allocates nothing. On a discrete GPU the same code is correct but
every cache read crosses PCIe; it is meant for Jetson. Not done yet: CUDA graph capture of the
decode step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvedge.contract import Manifest, TensorSpec
from kvedge.contract.engine import ENGINE_FILE, EngineManifest, profile_for
from kvedge.errors import KvedgeError
from kvedge.runtime.backend import StepOutput
from kvedge.runtime.cuda import MappedHost, cuda_call, current_device, import_cudart, import_tensorrt


class TrtBackend:
    """One TensorRT execution context over `model.engine` in an artifact folder."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.trt, self.cudart = import_tensorrt(), import_cudart()
        self.manifest = manifest
        self.engine_manifest = EngineManifest.load(folder)
        self.engine_manifest.check_model(manifest)
        self.engine_manifest.check_runtime(self.trt.__version__, current_device(self.cudart), "tensorrt")
        self.host = MappedHost(self.cudart)  # the pool, mapped in place, and the step buffers

        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine((Path(folder) / ENGINE_FILE).read_bytes())
        if self.engine is None:
            raise KvedgeError(f"TensorRT could not load {Path(folder) / ENGINE_FILE}; rebuild it")
        self.context = self.engine.create_execution_context()
        self.stream = self._call(self.cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.profile: int | None = None

        b, p = self.engine_manifest.max_batch, self.engine_manifest.max_prefill
        self.max_batch, self.max_prefill = b, p
        self.buffers: dict[str, tuple[np.ndarray, int]] = {}  # name -> (flat host view, device ptr)
        # per-call inputs and every output get a buffer for the largest call; past K/V are the pool
        self.step_inputs = [spec for spec in manifest.graph_inputs() if spec.layer is None]
        self.outputs = manifest.graph_outputs()  # logits, then each layer's present K, V
        for spec in self.step_inputs + list(self.outputs):
            dtype = np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(spec.name)))
            flat = self.host.empty((int(np.prod(spec.shape(b, p))),), dtype)
            self.buffers[spec.name] = flat, self.host.device_address(flat)

    def _call(self, result: tuple, what: str) -> Any:
        return cuda_call(self.cudart, result, what)

    def reserve(self, past: list[tuple[np.ndarray, ...]], max_len: int) -> None:
        """Page-lock the cache pool now rather than at the first step; every other buffer was
        allocated at construction for the largest profile, so nothing grows later."""
        for views in past:
            for view in views:
                self.host.device_address(view)

    def run(
        self,
        input_ids: np.ndarray,  # [batch, seq] int64
        position_ids: np.ndarray,  # [batch, seq] int64
        past_lengths: np.ndarray,  # [batch] int64
        last_index: np.ndarray,  # [batch] int64
        past: list[tuple[np.ndarray, ...]],  # per layer [batch, kvh, max_len, d] pool views
        counts: np.ndarray | None = None,  # [batch] real tokens per row; portable graphs ignore it
    ) -> StepOutput:
        names, g = self.manifest.names, self.manifest.geometry
        batch, seq = input_ids.shape
        if batch > self.max_batch or seq > self.max_prefill:
            raise KvedgeError(
                f"a call of {batch} rows x {seq} tokens exceeds the engine's profiles "
                f"({self.max_batch} rows x {self.max_prefill} tokens); rebuild it with a larger "
                "--max-batch or --max-prefill"
            )
        profile = profile_for(seq)
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, self.stream)
            self.profile = profile

        values = {
            names.input_ids: input_ids,
            names.position_ids: position_ids,
            names.past_lengths: past_lengths,
            names.last_index: last_index,
        }
        for spec in self.step_inputs:
            value, (host, device) = values[spec.name], self.buffers[spec.name]
            np.copyto(host[: value.size].reshape(value.shape), value, casting="same_kind")
            self.context.set_input_shape(spec.name, value.shape)
            self.context.set_tensor_address(spec.name, device)
        for i, views in enumerate(past):
            for template, view in zip(names.past(g.quantized), views, strict=True):
                name = names.layer(template, i)
                self.context.set_input_shape(name, view.shape)
                self.context.set_tensor_address(name, self.host.device_address(view))
        for spec in self.outputs:
            self.context.set_tensor_address(spec.name, self.buffers[spec.name][1])

        if not self.context.execute_async_v3(self.stream):
            raise KvedgeError("TensorRT execute_async_v3 failed; see its log above")
        self._call(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

        logits, *layers = [self._output(spec, batch, seq) for spec in self.outputs]
        per_layer = len(layers) // g.num_layers
        present = [tuple(layers[i * per_layer : (i + 1) * per_layer]) for i in range(g.num_layers)]
        return StepOutput(logits=logits[:, 0].copy(), present=present)  # "last" logits only

    def _output(self, spec: TensorSpec, batch: int, seq: int) -> np.ndarray:
        """The output `spec` of the last call, a view of its pinned buffer."""
        shape = spec.shape(batch, seq)
        return self.buffers[spec.name][0][: int(np.prod(shape))].reshape(shape)

    def close(self) -> None:
        """Give back pinned and registered memory; the backend is unusable afterwards."""
        self.host.close()
