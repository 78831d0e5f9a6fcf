"""onnxruntime backend: binds the cache pool's buffers to the graph with I/O binding.

Past K/V inputs are bound by pointer to views of the `KVCache` pool, so no cache byte is copied
into onnxruntime. What happens to the new K/V depends on the manifest's graph variant:

- portable: the graph returns them as outputs and the runtime copies them into the pool
  (`KVCache.append`).
- in place (ort): the same pool view is bound as a layer's past input and its present output,
  so the graph writes the new K/V into the cache itself and the runtime only advances lengths
  (`KVCache.commit`). onnxruntime's GroupQueryAttention takes s > 1 new tokens on top of a
  non-empty past only for batch 1, and writes every column it is given; so multi-row prefill
  runs one row at a time with exactly that row's real tokens, and no padding is ever written.

Decode (one token per row) runs through an I/O binding made once per (batch, slot range) and
reused: token ids, lengths, logits [b, 1, vocab], the pool views and (portable) the new-K/V
scratch [b, kv_heads, 1, head_dim] per layer are bound by pointer once, and a step only rewrites
the few input values, so it allocates nothing. Prefill outputs are allocated per call,
proportional to the prompt chunk, never to the context.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import onnxruntime as ort

from kvedge.contract import ONNX_FILE, Manifest
from kvedge.contract.engine import DEVICES, ENGINE_FILE
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.runtime import kernels

log = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
INSTALL_ONNXRUNTIME_GPU = (
    "install onnxruntime-gpu in place of onnxruntime (`pip install 'kvedge[gpu]'`; on a Jetson, "
    "NVIDIA's Jetson build, docs/JETSON.md)"
)
MAX_DECODE_BINDINGS = 8  # default: distinct (batch, slot range) decode bindings kept; beyond, start over


@dataclass
class StepOutput:
    logits: np.ndarray  # [batch, vocab] float32: next-token logits for each row
    # Per layer, the new tokens' cache tensors in `IONames.present` order ((K, V) [batch, kvh,
    # seq, d], then K, V scales [batch, kvh, seq, groups] for int8 caches); None when the graph
    # wrote them into the cache in place.
    present: list[tuple[np.ndarray, ...]] | None


@runtime_checkable
class Backend(Protocol):
    """What the runtime asks of a backend: `generate` runs steps, `Model` reserves memory at load.
    `OrtBackend` (here) and `kvedge.runtime.trt_backend.TrtBackend` implement it."""

    manifest: Manifest  # the graph's interface: `graph_inputs()`, `graph_outputs()`, `in_place`

    def run(
        self,
        input_ids: np.ndarray,  # [batch, seq] int64, row r right-padded beyond counts[r]
        position_ids: np.ndarray,  # [batch, seq] int64
        past_lengths: np.ndarray,  # [batch] int64
        last_index: np.ndarray,  # [batch] int64
        past: list[tuple[np.ndarray, ...]],  # per layer views of the pool, `KVCache.layer_views`
        counts: np.ndarray | None = None,  # [batch] int64 real tokens per row; default last_index + 1
    ) -> StepOutput:
        """One step over `past`: next-token logits per row, and the new K/V unless written in place."""
        ...

    def reserve(self, past: list[tuple[np.ndarray, ...]], max_len: int) -> None:
        """Take now, at load, the memory later steps over `past` (all slots' views) will need."""
        ...


def open_backend(
    folder: Path,
    manifest: Manifest,
    device: str = "cpu",
    threads: int | None = None,
    max_decode_bindings: int = MAX_DECODE_BINDINGS,
) -> Backend:
    """The backend `device` (a `DEVICES` name) runs on; where a piece is missing, a KvedgeError
    in one line naming what to install or build."""
    if device not in DEVICES:
        raise KvedgeError(f"--device {device!r} is not supported; allowed: {list(DEVICES)}")
    if device != "tensorrt":
        return OrtBackend(
            folder, manifest, threads=threads, provider=device, max_decode_bindings=max_decode_bindings
        )
    if not (folder / ENGINE_FILE).is_file():
        raise KvedgeError(
            f"--device tensorrt needs {folder / ENGINE_FILE}; build it on this device with "
            "`kvedge export --target tensorrt`"
        )
    from kvedge.runtime.trt_backend import TrtBackend

    return TrtBackend(folder, manifest)


class OrtBackend:
    """One onnxruntime session over an exported artifact folder."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        threads: int | None = None,
        provider: str = "cpu",
        optimized_model_path: Path | None = None,
        max_decode_bindings: int = MAX_DECODE_BINDINGS,
    ) -> None:
        if provider not in PROVIDERS:
            raise KvedgeError(f"--provider {provider!r} is not supported; allowed: {sorted(PROVIDERS)}")
        if PROVIDERS[provider] not in ort.get_available_providers():
            raise KvedgeError(
                f"onnxruntime provider {PROVIDERS[provider]} is not available here "
                f"(have: {ort.get_available_providers()}); {INSTALL_ONNXRUNTIME_GPU}"
            )
        self.manifest = manifest
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        if optimized_model_path is not None:  # for inspecting fusions (tests, benchmarks)
            options.optimized_model_filepath = str(optimized_model_path)
        self.threads = options.intra_op_num_threads
        if manifest.uses_kvedge_ops:
            options.register_custom_ops_library(str(kernels.library_path()))
        self.session = ort.InferenceSession(str(folder / ONNX_FILE), options, providers=[PROVIDERS[provider]])
        self._check_io()
        self._step_names = [spec.name for spec in manifest.graph_inputs() if spec.layer is None]
        self._outputs = manifest.graph_outputs()
        self._decode_bindings: dict[tuple, _DecodeBinding] = {}
        self.max_decode_bindings = max_decode_bindings

    def _check_io(self) -> None:
        """Refuse a graph whose inputs or outputs differ from the manifest's `graph_inputs()` /
        `graph_outputs()` in name, element type or any fixed dimension."""
        for kind, specs, args in (
            ("input", self.manifest.graph_inputs(), self.session.get_inputs()),
            ("output", self.manifest.graph_outputs(), self.session.get_outputs()),
        ):
            have = {arg.name: arg for arg in args}
            want = {spec.name: spec for spec in specs}
            if have.keys() != want.keys():
                raise ArtifactMismatch(
                    f"graph {kind}s do not match the manifest: graph only {sorted(have - want.keys())[:4]}, "
                    f"manifest only {sorted(want - have.keys())[:4]}"
                )
            for spec in specs:
                arg = have[spec.name]
                dtype = _ORT_TYPES.get(arg.type)
                if dtype is None or dtype != spec.dtype or not _dims_agree(spec.dims, arg.shape):
                    graph = f"[{', '.join(str(d) for d in arg.shape)}] {arg.type if dtype is None else dtype}"
                    raise ArtifactMismatch(
                        f"graph {kind} {spec.name}: the manifest says {spec.describe()}, the graph has "
                        f"{graph}; re-export the model"
                    )

    def _step_inputs(self, input_ids, position_ids, past_lengths, last_index) -> list[tuple[str, np.ndarray]]:
        """(name, value) of the graph's per-call inputs; which exist is `Manifest.graph_inputs`'s call."""
        names = self.manifest.names
        values = {
            names.input_ids: input_ids,
            names.position_ids: position_ids,
            names.past_lengths: past_lengths,
            names.last_index: last_index,
        }
        return [(name, values[name]) for name in self._step_names]

    def run(
        self,
        input_ids: np.ndarray,  # [batch, seq] int64, row r right-padded beyond counts[r]
        position_ids: np.ndarray,  # [batch, seq] int64
        past_lengths: np.ndarray,  # [batch] int64
        last_index: np.ndarray,  # [batch] int64
        past: list[tuple[np.ndarray, ...]],  # per layer views, `KVCache.layer_views`
        counts: np.ndarray | None = None,  # [batch] int64 real tokens per row; default last_index + 1
    ) -> StepOutput:
        """Run one step. Logits of a row with no real tokens are zeros (in-place variant)."""
        batch, seq = input_ids.shape
        counts = last_index + 1 if counts is None else np.asarray(counts, np.int64)
        if seq == 1 and bool((counts == 1).all()):
            return self._decode(input_ids, position_ids, past_lengths, past)
        if not self.manifest.in_place:
            return self._prefill_portable(input_ids, position_ids, past_lengths, last_index, past)
        if batch == 1 and int(counts[0]) == seq:
            return StepOutput(self._prefill_in_place(input_ids, past_lengths, last_index, past), None)
        logits = np.zeros((batch, self.manifest.vocab_size), np.float32)
        for r in range(batch):
            n = int(counts[r])
            if n:
                logits[r] = self._prefill_in_place(
                    input_ids[r : r + 1, :n],
                    past_lengths[r : r + 1],
                    np.array([n - 1], np.int64),
                    [tuple(a[r : r + 1] for a in views) for views in past],
                )[0]
        return StepOutput(logits, None)

    def reserve(self, past: list[tuple[np.ndarray, ...]], max_len: int) -> None:
        """Throwaway decode steps of every row at long pasts (`past`: pool views of all slots),
        so onnxruntime's arena grows to its largest decode working set now, at load, rather than
        step by step as conversations grow. One step at max_len - 1 for in-place graphs; portable
        graphs slice the past to the longest valid length, so their buffers take every size up
        to max_len, and a step at each of max_len - 1, max_len / 2, / 4 and / 8 leaves the arena
        with chunks of those sizes too. Measured over 900 portable float32 decode steps (context
        164 -> 1064): RSS +15.0 MiB with no reserve; with the pool resident from construction,
        +2.2 MiB with the max_len step alone, +1.3 MiB with the four.

        Nothing becomes valid in the cache: a portable graph returns the new K/V to scratch, an
        in-place graph writes them at column max_len - 1, beyond every slot's valid length."""
        batch = past[0][0].shape[0]
        lengths = [max_len - 1]
        if not self.manifest.in_place:
            lengths += [n for n in (max_len // 2, max_len // 4, max_len // 8) if n >= 1]
        for length in lengths:
            longest = np.full(batch, length, np.int64)  # [batch]
            ids = np.zeros((batch, 1), np.int64)  # [batch, 1]
            self.run(ids, longest[:, None].copy(), longest, np.zeros(batch, np.int64), past)

    def _decode(self, input_ids, position_ids, past_lengths, past) -> StepOutput:
        """One token per row through a binding made once per (batch, slots) and then reused."""
        # the buffer address without a ctypes object: made every step, it would churn the heap
        key = (input_ids.shape[0], past[0][0].__array_interface__["data"][0], past[0][0].strides)
        step = self._decode_bindings.get(key)
        if step is None:
            if len(self._decode_bindings) >= self.max_decode_bindings:
                self._decode_bindings.clear()
            step = self._decode_bindings[key] = self._make_decode_binding(past)
        step.input_ids[...] = input_ids
        step.past_lengths[...] = past_lengths
        step.position_ids[...] = position_ids  # bound only where the graph takes positions
        self.session.run_with_iobinding(step.binding)
        return StepOutput(step.logits[:, 0].copy(), step.present)

    def _make_decode_binding(self, past: list[tuple[np.ndarray, ...]]) -> _DecodeBinding:
        names, g = self.manifest.names, self.manifest.geometry
        batch = past[0][0].shape[0]
        binding = self.session.io_binding()
        logits, *present = self._outputs
        step = _DecodeBinding(
            binding=binding,
            input_ids=np.zeros((batch, 1), np.int64),
            position_ids=np.zeros((batch, 1), np.int64),
            past_lengths=np.zeros(batch, np.int64),
            last_index=np.zeros(batch, np.int64),
            logits=np.zeros(logits.shape(batch, 1), logits.dtype),
            present=None,
            past=past,
        )
        inputs = self._step_inputs(step.input_ids, step.position_ids, step.past_lengths, step.last_index)
        self._bind_inputs(binding, inputs, past, by_pointer=True)
        _bind_array(binding, names.logits, step.logits, output=True)
        templates = names.present(g.quantized)
        if self.manifest.in_place:
            outputs = past
        else:  # scratch for the new token's K/V [batch, kvh, 1, d or groups], per layer
            layers = [[spec for spec in present if spec.layer == i] for i in range(g.num_layers)]
            outputs = step.present = [
                tuple(np.zeros(spec.shape(batch, 1), spec.dtype) for spec in specs) for specs in layers
            ]
        self._bind_layers(binding, templates, outputs, output=True)
        return step

    def _bind_inputs(self, binding, inputs: list[tuple[str, np.ndarray]], past, by_pointer=False) -> None:
        for name, array in inputs:
            if by_pointer:  # the caller keeps `array` alive and rewrites it before each run
                _bind_array(binding, name, array, output=False)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
        self._bind_layers(
            binding, self.manifest.names.past(self.manifest.geometry.quantized), past, output=False
        )

    def _bind_layers(self, binding, templates, per_layer: list[tuple[np.ndarray, ...]], output: bool) -> None:
        """Bind each layer's arrays by pointer to that layer's names (`templates`, in order)."""
        names = self.manifest.names
        for i, arrays in enumerate(per_layer):
            for template, array in zip(templates, arrays, strict=True):
                _bind_array(binding, names.layer(template, i), array, output=output)

    def _select_last(self, logits: np.ndarray, last_index: np.ndarray) -> np.ndarray:
        """[batch, 1 or seq, vocab] -> [batch, vocab] at each row's last real token (a copy)."""
        if self.manifest.logits == "all":
            logits = logits[np.arange(logits.shape[0]), last_index][:, None]
        return logits[:, 0].copy()

    def _prefill_portable(self, input_ids, position_ids, past_lengths, last_index, past) -> StepOutput:
        binding = self.session.io_binding()
        self._bind_inputs(binding, self._step_inputs(input_ids, position_ids, past_lengths, last_index), past)
        for spec in self._outputs:  # logits, then each layer's present tensors
            binding.bind_output(spec.name)
        self.session.run_with_iobinding(binding)
        outs = binding.copy_outputs_to_cpu()
        n = len(self.manifest.names.present(self.manifest.geometry.quantized))
        present = [tuple(outs[1 + n * i : 1 + n * (i + 1)]) for i in range(len(past))]
        return StepOutput(logits=self._select_last(outs[0], last_index), present=present)

    def _prefill_in_place(self, input_ids, past_lengths, last_index, past) -> np.ndarray:
        """One call whose rows all hold only real tokens; returns logits [batch, vocab]."""
        names = self.manifest.names
        binding = self.session.io_binding()
        self._bind_inputs(binding, self._step_inputs(input_ids, None, past_lengths, last_index), past)
        logits = np.empty(self._outputs[0].shape(*input_ids.shape), np.float32)  # [batch, 1 or seq, vocab]
        _bind_array(binding, names.logits, logits, output=True)
        self._bind_layers(binding, names.present(self.manifest.geometry.quantized), past, output=True)
        self.session.run_with_iobinding(binding)
        return self._select_last(logits, last_index)


@dataclass
class _DecodeBinding:
    """A decode step's I/O binding: every buffer bound by pointer once, values rewritten per step."""

    binding: ort.IOBinding
    input_ids: np.ndarray  # [batch, 1] int64
    position_ids: np.ndarray  # [batch, 1] int64 (bound where the graph takes positions)
    past_lengths: np.ndarray  # [batch] int64
    last_index: np.ndarray  # [batch] int64, zeros: one token per row
    logits: np.ndarray  # [batch, 1, vocab] float32
    present: list[tuple[np.ndarray, ...]] | None  # portable: per layer [batch, kvh, 1, d or groups]
    past: list[tuple[np.ndarray, ...]]  # the bound pool views, kept alive with the binding


# onnxruntime's element type names -> numpy dtypes, for checking a session against the manifest
_ORT_TYPES = {
    f"tensor({name})": np.dtype(dtype)
    for name, dtype in (
        ("float", np.float32),
        ("float16", np.float16),
        ("int8", np.int8),
        ("int64", np.int64),
    )
}


def _dims_agree(dims: tuple, graph_shape: list) -> bool:
    """Every fixed dimension of the manifest's equal to the graph's; every varying one varying there."""
    if len(dims) != len(graph_shape):
        return False
    return all(
        graph == dim if isinstance(dim, int) else not isinstance(graph, int)
        for dim, graph in zip(dims, graph_shape, strict=True)
    )


def _bind_array(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool) -> None:
    if not array.flags.c_contiguous:
        raise KvedgeError(f"{name}: buffer is not contiguous and cannot be bound in place")
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
