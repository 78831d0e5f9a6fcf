"""onnxruntime backend: binds the cache pool's buffers to the graph with I/O binding.

Past K/V inputs are bound by pointer to views of the `KVCache` pool, so no cache byte is copied
into onnxruntime. Decode outputs (logits [b, 1, vocab] and new K/V [b, kv_heads, 1, head_dim]
per layer) go to scratch buffers allocated once per batch size; prefill outputs are allocated per
call, proportional to the prompt chunk, never to the context.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvedge.contract import ONNX_FILE, Manifest
from kvedge.errors import ArtifactMismatch, KvedgeError

log = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


@dataclass
class StepOutput:
    logits: np.ndarray  # [batch, vocab] float32: next-token logits for each row
    present: list[tuple[np.ndarray, np.ndarray]]  # per layer ([batch, kvh, seq, d] K, V)


class OrtBackend:
    """One onnxruntime session over an exported artifact folder."""

    def __init__(
        self, folder: Path, manifest: Manifest, threads: int | None = None, provider: str = "cpu"
    ) -> None:
        if provider not in PROVIDERS:
            raise KvedgeError(f"--provider {provider!r} is not supported; allowed: {sorted(PROVIDERS)}")
        if PROVIDERS[provider] not in ort.get_available_providers():
            raise KvedgeError(
                f"onnxruntime provider {PROVIDERS[provider]} is not available here "
                f"(have: {ort.get_available_providers()})"
            )
        self.manifest = manifest
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        self.threads = options.intra_op_num_threads
        self.session = ort.InferenceSession(str(folder / ONNX_FILE), options, providers=[PROVIDERS[provider]])
        self._check_io()
        self._decode_scratch: dict[int, tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]] = {}

    def _check_io(self) -> None:
        names, geometry = self.manifest.names, self.manifest.geometry
        want = {names.input_ids, names.position_ids, names.past_lengths}
        if self.manifest.logits == "last":
            want.add(names.last_index)
        for i in range(geometry.num_layers):
            want |= {names.layer(names.past_key, i), names.layer(names.past_value, i)}
        have = {i.name for i in self.session.get_inputs()}
        if have != want:
            raise ArtifactMismatch(
                f"graph inputs do not match the manifest: graph only {sorted(have - want)[:4]}, "
                f"manifest only {sorted(want - have)[:4]}"
            )

    def _scratch(self, batch: int) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        if batch not in self._decode_scratch:
            g = self.manifest.geometry
            shape = (batch, g.num_kv_heads, 1, g.head_dim)
            self._decode_scratch[batch] = (
                np.zeros((batch, 1, self.manifest.vocab_size), np.float32),
                [(np.zeros(shape, g.np_dtype), np.zeros(shape, g.np_dtype)) for _ in range(g.num_layers)],
            )
        return self._decode_scratch[batch]

    def run(
        self,
        input_ids: np.ndarray,  # [batch, seq] int64
        position_ids: np.ndarray,  # [batch, seq] int64
        past_lengths: np.ndarray,  # [batch] int64
        last_index: np.ndarray,  # [batch] int64
        past: list[tuple[np.ndarray, np.ndarray]],  # per layer [batch, kvh, max_len, d] views
    ) -> StepOutput:
        names = self.manifest.names
        batch, seq = input_ids.shape
        binding = self.session.io_binding()
        binding.bind_cpu_input(names.input_ids, input_ids)
        binding.bind_cpu_input(names.position_ids, position_ids)
        binding.bind_cpu_input(names.past_lengths, past_lengths)
        if self.manifest.logits == "last":
            binding.bind_cpu_input(names.last_index, last_index)
        for i, (k, v) in enumerate(past):
            _bind_array(binding, names.layer(names.past_key, i), k, output=False)
            _bind_array(binding, names.layer(names.past_value, i), v, output=False)

        if seq == 1:
            logits, present = self._scratch(batch)
            _bind_array(binding, names.logits, logits, output=True)
            for i, (k, v) in enumerate(present):
                _bind_array(binding, names.layer(names.present_key, i), k, output=True)
                _bind_array(binding, names.layer(names.present_value, i), v, output=True)
            self.session.run_with_iobinding(binding)
        else:
            binding.bind_output(names.logits)
            for i in range(len(past)):
                binding.bind_output(names.layer(names.present_key, i))
                binding.bind_output(names.layer(names.present_value, i))
            self.session.run_with_iobinding(binding)
            outs = binding.copy_outputs_to_cpu()
            logits = outs[0]
            present = [(outs[1 + 2 * i], outs[2 + 2 * i]) for i in range(len(past))]
        if self.manifest.logits == "all":
            logits = logits[np.arange(batch), last_index][:, None]
        return StepOutput(logits=logits[:, 0].copy(), present=present)


def _bind_array(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool) -> None:
    if not array.flags.c_contiguous:
        raise KvedgeError(f"{name}: buffer is not contiguous and cannot be bound in place")
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
