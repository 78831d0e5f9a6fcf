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

What is bound where is one pure description, `binding_plan` (per name: the buffer, pool view /
step buffer / per-call array, the memory onnxruntime is told it is in, and its bytes), which
both providers bind from and tests check without a GPU:

- cpu: everything is host memory, bound as "cpu".
- cuda (UNVERIFIED ON HARDWARE: written against onnxruntime's and cuda-python's documented
  APIs without a GPU; device_tests/ checks it): the pool is page-locked and mapped once
  (`kvedge.runtime.backends.cuda.MappedHost`, the same helper `TrtBackend` uses) and its views are bound
  as "cuda" at their device addresses, so the GPU reads the cache where it is and nothing
  cache-sized is copied between host and device, ever. Decode's step buffers (ids, lengths,
  logits, the portable graph's one-token K/V) are mapped pinned buffers bound as "cuda" too:
  a few bytes per row that the GPU reads and writes in place, at addresses fixed for the
  binding's life, which CUDA graph replay needs. The step inputs among them are bound again
  before every step (`Bound.rebind`): onnxruntime copies an input at bind time wherever a
  consumer reads it on another device (shape arithmetic it keeps on the CPU, say), and a copy
  made once would hold the first step's tokens and lengths forever. Every device address bound
  is 256-byte aligned (`kvedge.runtime.backends.memory`), TF32 is off (`cuda_provider_options`), and
  onnxruntime older than `ONNXRUNTIME_CUDA_FLOOR` is refused. Prefill's inputs and outputs are
  per-call and prompt-sized, bound as "cpu": onnxruntime copies them once per call. On Jetson the mapped
  memory is the GPU's own DRAM; on a discrete GPU every cache read crosses PCIe (correct, slow).
  Portable graphs and the float16-cache `ort` graph run on cuda (`cuda_refusal` says why the
  other in-place ones cannot); the latter's GroupQueryAttention writes the new K/V into the
  mapped pool on the device, so nothing of the cache crosses per step in either direction. A
  hybrid's per-slot states (`KVCache.state_views`) are bound as the pool's views are (page-locked,
  mapped, 256-byte aligned at every slot); its new states go to decode's step buffers on the
  device or to prefill's per-call host arrays, and `KVCache.write_states` copies them into the
  slots.

CUDA graph capture of decode (`cuda_graph=True`, cuda only): onnxruntime's CUDA EP option
`enable_cuda_graph` captures a run and replays it at the same addresses and shapes; each decode
binding runs with its own `gpu_graph_id` run option (1, 2, ...), prefill with -1 (never
captured). A graph can be captured only if its shapes and host-side values do not change from
step to step, and if no step copies between host and device; `cuda_graph_refusal` says which
exports qualify (the float16-cache `ort` graph only, see there).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvedge.contract import ONNX_FILE, PREFILL_CHUNK, VERIFY_TOKENS, Manifest
from kvedge.contract.engine import device_refusal
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.runtime import kernels
from kvedge.runtime.backends.cuda import MappedHost
from kvedge.runtime.backends.memory import check_alignment, data_address
from kvedge.runtime.embeddings import HostInputs
from kvedge.runtime.interface import (
    MAX_DECODE_BINDINGS,
    StepOutput,
    graph_last_index,
    step_logits,
    step_values,
)

log = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
INSTALL_ONNXRUNTIME_GPU = (
    "install onnxruntime-gpu in place of onnxruntime (`pip install 'kvedge[gpu]'`; on a Jetson, "
    "NVIDIA's Jetson build, docs/JETSON.md)"
)
PHASES = ("decode", "prefill", "verify")  # `binding_plan`'s
# short in-place calls (a verify, a draft's catch-up, a prompt's last chunk: up to VERIFY_TOKENS
# tokens) keep their bindings too, by shape and slot; beyond this many, start over
MAX_SHORT_BINDINGS = VERIFY_TOKENS
MAX_PLANS = 64  # binding plans kept by call shape (phase, batch, seq, rows); beyond, start over
# the oldest onnxruntime the cuda backend opens with (`onnxruntime_cuda_refusal`)
ONNXRUNTIME_CUDA_FLOOR = (1, 20)
# the oldest onnxruntime whose GroupQueryAttention local_window_size counts the query's own key,
# as kvedge's windowed ort graphs (Gemma 3) and transformers do (microsoft/onnxruntime#25927):
# 1.23.2, the newest with Python 3.10 wheels, is off by up to 2.5 in Gemma 3's logits, silently
ONNXRUNTIME_WINDOW_FLOOR = (1, 24)
# onnxruntime run option selecting a captured CUDA graph; -1: this run is neither captured nor replayed
CUDA_GRAPH_ID = "gpu_graph_id"

# Where a bound buffer lives (`Bound.buffer`)
POOL = "pool"  # a view of the KVCache pool, bound by pointer: read, and written in place, where it is
STEP = "step"  # allocated with a decode binding, rewritten each step, bound once: a few tokens' worth
CALL = "call"  # made for one prefill call, proportional to the prompt chunk, never to the context


@dataclass(frozen=True)
class Bound:
    """One graph input or output of a step's I/O binding."""

    name: str
    output: bool
    buffer: str  # POOL, STEP or CALL
    memory: str  # the memory onnxruntime is told it is in: "cpu", or "cuda" (GPU-addressable)
    shape: tuple[int, ...]
    dtype: np.dtype
    # bound again before every step: an input whose values change per step. onnxruntime copies
    # an input at bind time to where its consumers read it when that is not where it is bound
    # (IOBinding::BindInput -> utils::CopyOneInputAcrossDevices), so an input bound once would
    # leave later steps reading the first step's values wherever a consumer sits elsewhere
    rebind: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def preload_cuda_libraries() -> None:
    """Loads the CUDA and cuDNN libraries onnxruntime-gpu was built for from NVIDIA's pip packages
    (nvidia-cudnn-cu12 and the like, `onnxruntime-gpu[cuda,cudnn]`) where they are installed, as
    onnxruntime 1.21+ asks of its users (`onnxruntime.preload_dlls`): without it a pip-only CUDA
    install falls back to the CPU. It searches the default library paths after them, so JetPack's
    system CUDA loads as before. Nothing happens on an onnxruntime older than 1.21 (no
    preload_dlls) or one without the CUDA provider (1.23's preload_dlls warns there)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None and PROVIDERS["cuda"] in ort.get_available_providers():
        preload(cuda=True, cudnn=True, msvc=False)


def cuda_refusal(manifest: Manifest) -> str | None:
    """Why this export cannot run on onnxruntime's CUDA provider without copying the cache every
    step, or None: `kvedge.contract.engine.device_refusal`'s answer for cuda, which the planner
    asks too. Portable graphs and the float16-cache `ort` graph (`--kv-dtype float16`) run there."""
    return device_refusal("cuda", manifest.variant, manifest.geometry.dtype, manifest.logits)


def cuda_graph_refusal(manifest: Manifest) -> str | None:
    """Why this export's decode step cannot be captured as a CUDA graph, or None. A captured graph
    replays the capture's kernels at the capture's shapes and addresses, and cannot hold a copy
    between host and device. A portable graph slices the past to the batch's longest valid length
    every step (shapes that follow the context). The float16-cache `ort` graph qualifies: its
    decode step binds the whole pool [b, kv_heads, max_len, head_dim] and fixed step buffers, and
    GroupQueryAttention's inputs are made on the device from those buffers, its one host-side
    input (total_sequence_length) a constant (kvedge.export.graph.inplace `GroupQueryAttention`)."""
    if not manifest.in_place:
        return (
            "cuda_graph cannot capture a portable graph: it slices the past to the longest valid "
            "length, so its shapes change every step and a replay would reuse the first step's"
        )
    return cuda_refusal(manifest)


def onnxruntime_release(version: str) -> tuple[int, int]:
    """(major, minor) of an onnxruntime version string ("1.23.2", "1.32.0.dev20261101")."""
    major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    return major, minor


def onnxruntime_window_refusal(manifest: Manifest, version: str) -> str | None:
    """Why this onnxruntime would compute the manifest's graph wrong, or None: an ort graph with
    sliding-window layers on GroupQueryAttention (float32 / float16 cache; the INT8 cache's
    windows are kvedge's own kernel) needs `ONNXRUNTIME_WINDOW_FLOOR`."""
    windowed = manifest.variant == "ort" and manifest.rope.local_layers and not manifest.geometry.quantized
    if not windowed or onnxruntime_release(version) >= ONNXRUNTIME_WINDOW_FLOOR:
        return None
    floor = ".".join(str(n) for n in ONNXRUNTIME_WINDOW_FLOOR)
    return (
        f"onnxruntime {version} counts GroupQueryAttention's sliding window one key short of what "
        f"this export's sliding-window layers need (fixed in {floor}): install onnxruntime>={floor}, "
        "or export with --variant portable (a ring cache) or --kv-dtype int8 (kvedge's kernel)"
    )


def onnxruntime_cuda_refusal(version: str) -> str | None:
    """Why this onnxruntime cannot run kvedge's CUDA path, or None: older than
    `ONNXRUNTIME_CUDA_FLOOR`, where GroupQueryAttention first takes new tokens on top of a
    non-empty past ("continuous decoding", onnxruntime PR #21523, first released in 1.20.0),
    which the float16 in-place export's chunked prefill runs. One floor for every cuda export:
    the Jetson builds (1.19.2 .. 1.25.1 on NVIDIA's jp6/cu126 index) include newer ones."""
    if onnxruntime_release(version) >= ONNXRUNTIME_CUDA_FLOOR:
        return None
    floor = ".".join(str(n) for n in ONNXRUNTIME_CUDA_FLOOR)
    return (
        f"onnxruntime {version} is older than {floor}, the first whose CUDA GroupQueryAttention "
        f"prefills on top of a cached past; install onnxruntime-gpu>={floor} ({INSTALL_ONNXRUNTIME_GPU})"
    )


def cuda_provider_options(cuda_graph: bool) -> dict[str, str]:
    """onnxruntime CUDA provider options. TF32 off (onnxruntime turns it on by default): a float32
    graph (or a float32 island of a float16 graph: norms, softmax, logits) is float32 because
    kvedge promises float32 results, and TF32 matmuls round inputs to 10 mantissa bits, about
    1e-3 relative, the size of the tolerance parity is checked at."""
    options = {"use_tf32": "0"}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return options


def binding_plan(
    manifest: Manifest, provider: str, phase: str, batch: int, seq: int = 1, rows: int = 1
) -> tuple[Bound, ...]:
    """What a `phase` ("decode": one token per row; "prefill": `seq` tokens, logits at `rows`
    positions of each row; "verify": the same, bound once and kept as decode's) step of `batch`
    rows binds on `provider`, in the graph's input then output order. Pool views are bound where
    they are, on the provider's device; decode's and verify's step buffers too; prefill's
    per-call arrays on the CPU, where onnxruntime copies them once per call."""
    if phase not in PHASES:
        raise KvedgeError(f"binding phase {phase!r} is unknown; allowed: {list(PHASES)}")
    if provider == "cuda" and (refusal := cuda_refusal(manifest)):
        raise KvedgeError(refusal)
    device = "cuda" if provider == "cuda" else "cpu"
    decode = phase == "decode"
    kept = phase != "prefill"
    seq = 1 if decode else seq
    plan = []
    for output, specs in ((False, manifest.graph_inputs()), (True, manifest.graph_outputs())):
        for spec in specs:
            if spec.layer is not None and (not output or (manifest.in_place and not spec.state)):
                buffer = POOL
            else:
                buffer = STEP if kept else CALL
            where = "cpu" if buffer == CALL else device
            shape, dtype = spec.shape(batch, seq, 1 if decode else rows), np.dtype(spec.dtype)
            plan.append(Bound(spec.name, output, buffer, where, shape, dtype, buffer == STEP and not output))
    return tuple(plan)


def disabled_optimizers(manifest: Manifest) -> list[str]:
    """onnxruntime graph rewrites this export must not get. The INT8 cache's exact Q/DQ (scale 1)
    beside quantized weights' DequantizeLinear: the S8->U8 rewrite then leaves a QuantizeLinear
    with an int8 output and a uint8 zero point, and the session refuses to load (seen with 1.23
    and 1.30). Elsewhere the rewrite stays: decode is slower without it (docs/PERFORMANCE.md,
    "Tried and dropped")."""
    if manifest.geometry.quantized and manifest.weights_dtype in ("int8", "int4"):
        return ["QDQS8ToU8Transformer"]
    return []


class OrtBackend:
    """One onnxruntime session over an exported artifact folder."""

    max_batch: int | None = None  # onnxruntime takes any batch
    max_prefill: int | None = None  # and any length

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        threads: int | None = None,
        provider: str = "cpu",
        optimized_model_path: Path | None = None,
        max_decode_bindings: int = MAX_DECODE_BINDINGS,
        cuda_graph: bool = False,
    ) -> None:
        if provider not in PROVIDERS:
            raise KvedgeError(f"--provider {provider!r} is not supported; allowed: {sorted(PROVIDERS)}")
        if cuda_graph and provider != "cuda":
            raise KvedgeError("cuda_graph (CUDA graph capture) applies to --device cuda only")
        if cuda_graph and (refusal := cuda_graph_refusal(manifest)):
            raise KvedgeError(refusal)
        if PROVIDERS[provider] not in ort.get_available_providers():
            raise KvedgeError(
                f"onnxruntime provider {PROVIDERS[provider]} is not available here "
                f"(have: {ort.get_available_providers()}); {INSTALL_ONNXRUNTIME_GPU}"
            )
        if provider == "cuda" and (refusal := onnxruntime_cuda_refusal(ort.__version__)):
            raise KvedgeError(refusal)
        if refusal := onnxruntime_window_refusal(manifest, ort.__version__):
            raise KvedgeError(refusal)
        binding_plan(manifest, provider, "decode", 1)  # refuses what the provider cannot bind
        self.manifest = manifest
        self.provider = provider
        # the GPU reads the pool and the step buffers where they are (module docstring)
        self.host = MappedHost() if provider == "cuda" else None
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        if optimized_model_path is not None:  # for inspecting fusions (tests, benchmarks)
            options.optimized_model_filepath = str(optimized_model_path)
        self.threads = options.intra_op_num_threads
        if manifest.uses_kvedge_ops:
            options.register_custom_ops_library(str(kernels.library_path()))
        provider_options = {}
        if provider == "cuda":
            provider_options = cuda_provider_options(cuda_graph)
            preload_cuda_libraries()
        self.session = ort.InferenceSession(
            str(folder / ONNX_FILE),
            options,
            providers=[(PROVIDERS[provider], provider_options)],
            disabled_optimizers=disabled_optimizers(manifest),
        )
        if PROVIDERS[provider] not in self.session.get_providers():  # onnxruntime fell back to the CPU
            raise KvedgeError(
                f"onnxruntime could not start {PROVIDERS[provider]} (it ran {self.session.get_providers()}): "
                "the CUDA and cuDNN libraries it was built for are missing or do not match; see its log above"
            )
        self.cuda_graph = cuda_graph
        self._prefill_options = _run_options(-1) if cuda_graph else None
        self._graph_ids = 0  # the last gpu_graph_id given to a decode binding; never reused
        self._check_io()
        self._step_names = [spec.name for spec in manifest.graph_inputs() if spec.layer is None]
        self.lookups = HostInputs.of(folder, manifest)  # None: the graph gathers all its own
        self._outputs = manifest.graph_outputs()
        self._state_names = {spec.name for spec in manifest.graph_inputs() if spec.state}
        self._decode_bindings: dict[tuple, _KeptBinding] = {}
        self.max_decode_bindings = max_decode_bindings
        self._plans: dict[tuple, tuple[Bound, ...]] = {}  # `_plan`'s, by call shape
        self._short_bindings: dict[tuple, _KeptBinding] = {}  # `_short_call`'s
        if any(state.kind == "recurrent" for state in manifest.geometry.states):
            # a Gated DeltaNet graph's triangular inverse is exact up to PREFILL_CHUNK tokens a call
            self.max_prefill = PREFILL_CHUNK

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

    def _plan(self, phase: str, batch: int, seq: int = 1, rows: int = 1) -> tuple[Bound, ...]:
        """`binding_plan` of this backend's graph and provider, made once per call shape: a
        verify's or a prefill's binding otherwise spent milliseconds of Python on it per call."""
        key = (phase, batch, seq, rows)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = binding_plan(self.manifest, self.provider, phase, batch, seq, rows)
        return plan

    def _step_inputs(
        self, input_ids, position_ids, past_lengths, last_index, counts=None
    ) -> list[tuple[str, np.ndarray]]:
        """(name, value) of the graph's per-call inputs; which exist is `Manifest.graph_inputs`'s call."""
        values = step_values(
            self.manifest, self.lookups, input_ids, position_ids, past_lengths, last_index, counts
        )
        return [(name, values[name]) for name in self._step_names]

    def run(
        self,
        input_ids: np.ndarray,  # [batch, seq] int64, row r right-padded beyond counts[r]
        position_ids: np.ndarray,  # [batch, seq] int64
        past_lengths: np.ndarray,  # [batch] int64
        last_index: np.ndarray,  # [batch] int64, or [batch, rows] (`verify_refusal` is None)
        past: list[tuple[np.ndarray, ...]],  # per layer views, `KVCache.layer_views`
        counts: np.ndarray | None = None,  # [batch] int64 real tokens per row; default last_index + 1
        states: dict[str, np.ndarray] | None = None,  # `KVCache.state_views` of the rows' slots
    ) -> StepOutput:
        """Run one step. Logits of a row with no real tokens are zeros (in-place variant). With
        last_index [batch, rows] the logits are [batch, rows, vocab], at those positions."""
        if self.session is None:
            raise KvedgeError("this onnxruntime backend was closed")
        batch, seq = input_ids.shape
        if last_index.ndim == 2 and (refusal := self.verify_refusal()):
            raise KvedgeError(refusal)
        counts = last_index.reshape(batch, -1)[:, -1] + 1 if counts is None else np.asarray(counts, np.int64)
        if seq == 1 and last_index.ndim == 1 and bool((counts == 1).all()):
            return self._decode(input_ids, position_ids, past_lengths, past, states)
        if not self.manifest.in_place:
            return self._prefill_portable(
                input_ids, position_ids, past_lengths, last_index, past, counts, states
            )
        if batch == 1 and int(counts[0]) == seq:
            logits, new_states = self._prefill_in_place(input_ids, past_lengths, last_index, past, states)
            return StepOutput(logits, None, new_states)
        logits = np.zeros((batch, *last_index.shape[1:], self.manifest.vocab_size), np.float32)
        new_states = {name: np.zeros_like(view) for name, view in self._present_names(states)}
        for r in range(batch):
            n = int(counts[r])
            if n:
                row_logits, row_states = self._prefill_in_place(
                    input_ids[r : r + 1, :n],
                    past_lengths[r : r + 1],
                    last_index[r : r + 1],
                    [tuple(a[r : r + 1] for a in views) for views in past],
                    {name: view[r : r + 1] for name, view in (states or {}).items()},
                )
                logits[r] = row_logits[0]
                for name, value in (row_states or {}).items():
                    new_states[name][r] = value[0]
        return StepOutput(logits, None, new_states or None)

    def verify_refusal(self) -> str | None:
        """Why this graph cannot verify a speculative step, or None (`Manifest.verify_refusal`)."""
        return self.manifest.verify_refusal()

    def reserve(
        self, past: list[tuple[np.ndarray, ...]], max_len: int, states: dict[str, np.ndarray] | None = None
    ) -> None:
        """Throwaway decode steps of every row at long pasts (`past`: pool views of all slots),
        so onnxruntime's arena grows to its largest decode working set now, at load, rather than
        step by step as conversations grow. One step at max_len - 1 for in-place graphs; portable
        graphs slice the past to the longest valid length, so their buffers take every size up
        to max_len, and a step at each of max_len - 1, max_len / 2, / 4 and / 8 leaves the arena
        with chunks of those sizes too: what RSS grew by over 900 decode steps with and without
        them is in docs/PERFORMANCE.md, "Allocation".

        Nothing becomes valid in the cache: a portable graph returns the new K/V to scratch, an
        in-place graph writes them at column max_len - 1, beyond every slot's valid length."""
        batch = past[0][0].shape[0]
        lengths = [max_len - 1]
        if not self.manifest.in_place:
            lengths += [n for n in (max_len // 2, max_len // 4, max_len // 8) if n >= 1]
        for length in lengths:
            longest = np.full(batch, length, np.int64)  # [batch]
            ids = np.zeros((batch, 1), np.int64)  # [batch, 1]
            self.run(ids, longest[:, None].copy(), longest, np.zeros(batch, np.int64), past, states=states)

    def _decode(self, input_ids, position_ids, past_lengths, past, states=None) -> StepOutput:
        """One token per row through a binding made once per (batch, slots) and then reused."""
        # the buffer address without a ctypes object: made every step, it would churn the heap
        key = (input_ids.shape[0], data_address(past[0][0]), past[0][0].strides)
        step = self._decode_bindings.get(key)
        if step is None:
            if len(self._decode_bindings) >= self.max_decode_bindings:
                self._drop_bindings(self._decode_bindings)
            step = self._decode_bindings[key] = self._make_binding(past, states=states)
        step.input_ids[...] = input_ids
        if step.input_lengths is not None:
            step.input_lengths[...] = 1
        if self.lookups is not None:
            for name, value in self.lookups(input_ids).items():
                step.looked_up[name][...] = value
        step.past_lengths[...] = past_lengths
        step.position_ids[...] = position_ids  # bound only where the graph takes positions
        for args in step.rebind:  # the same buffers, bound again: what they hold now (`Bound.rebind`)
            step.binding.bind_input(*args)
        self.session.run_with_iobinding(step.binding, step.run_options)
        return StepOutput(step.logits[:, 0].copy(), step.present, step.states)

    def _make_binding(
        self, past: list[tuple[np.ndarray, ...]], seq: int = 0, rows: int = 1, states: dict | None = None
    ) -> _KeptBinding:
        """A binding kept for decode steps of the rows of `past`, or with `seq` > 0 for in-place
        calls of `seq` tokens with logits at `rows` positions (`_short_call`)."""
        names, g = self.manifest.names, self.manifest.geometry
        batch = past[0][0].shape[0]
        plan = self._plan("verify", batch, seq, rows) if seq else self._plan("decode", batch)
        arrays = self._pool_arrays(past, states)
        owned = {bound.name: self._step_buffer(bound) for bound in plan if bound.buffer == STEP}
        arrays.update(owned)
        binding = self.session.io_binding()
        rebind = [self._bind(binding, bound, arrays[bound.name]) for bound in plan if bound.rebind]
        for bound in plan:
            if not bound.rebind:
                self._bind(binding, bound, arrays[bound.name])
        present = None
        if not self.manifest.in_place:  # the new token's K/V [batch, kvh, 1, d or groups], per layer
            templates = names.cache_present(g)
            present = [tuple(arrays[names.layer(t, i)] for t in templates) for i in range(g.num_layers)]
        run_options = self._prefill_options if seq else None  # CUDA graphs capture decode steps only
        if self.cuda_graph and not seq:
            self._graph_ids += 1
            run_options = _run_options(self._graph_ids)
        unbound = np.zeros((batch, max(seq, 1)), np.int64)  # a step input this graph does not take
        return _KeptBinding(
            binding=binding,
            input_ids=arrays[names.input_ids],
            looked_up={name: arrays[name] for name in (self.lookups.names if self.lookups else [])},
            position_ids=arrays.get(names.position_ids, unbound),
            past_lengths=arrays[names.past_lengths],
            last_index=arrays.get(names.last_index, unbound[:, 0]),
            logits=arrays[names.logits],
            present=present,
            input_lengths=arrays.get(names.input_lengths),
            states=self._present_states(arrays),
            past=past,
            owned=list(owned.values()),
            plan=plan,
            run_options=run_options,
            rebind=rebind,
        )

    def _step_buffer(self, bound: Bound) -> np.ndarray:
        """A zeroed buffer for `bound`, where its device reads it: mapped pinned memory on cuda."""
        if bound.memory == "cuda":
            return self.host.empty(bound.shape, bound.dtype)
        return np.zeros(bound.shape, bound.dtype)

    def _drop_bindings(self, kept: dict[tuple, _KeptBinding]) -> None:
        """Forget the bindings in `kept`, giving back their step buffers."""
        for step in kept.values():
            if self.host is not None:
                for array in step.owned:
                    self.host.release(array)
        kept.clear()

    def _pool_arrays(
        self, past: list[tuple[np.ndarray, ...]], states: dict | None = None
    ) -> dict[str, np.ndarray]:
        """name -> pool view of every past input and, in place, every present output; and the
        slots' `states` (`KVCache.state_views`), which a graph with states must be given."""
        names, g = self.manifest.names, self.manifest.geometry
        templates = [names.cache_past(g)] + ([names.cache_present(g)] if self.manifest.in_place else [])
        arrays = {
            names.layer(template, i): view
            for per_layer in templates
            for i, views in enumerate(past)
            for template, view in zip(per_layer, views, strict=True)
        }
        if self.manifest.geometry.states:
            if not states:
                raise KvedgeError(f"{self.manifest.model_type} keeps per-slot states: a step needs them")
            arrays.update(states)
        return arrays

    def _present_states(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The present state outputs among `arrays`, by name; None for a graph without states."""
        names = self.manifest.interface.states(self.manifest.names.present_state)
        return {spec.name: arrays[spec.name] for spec in names} if names else None

    def _bind(self, binding: ort.IOBinding, bound: Bound, array: np.ndarray) -> tuple:
        """Bind `array` by pointer as `bound` says: its host address on the CPU, its device
        address (256-byte aligned) on cuda. The caller keeps `array` alive while the binding is
        used. Returns the arguments bound, to bind again."""
        if not array.flags.c_contiguous or array.shape != bound.shape or array.dtype != bound.dtype:
            raise KvedgeError(
                f"{bound.name}: buffer {list(array.shape)} {array.dtype} (contiguous: "
                f"{array.flags.c_contiguous}) cannot be bound in place as {list(bound.shape)} {bound.dtype}"
            )
        if bound.memory == "cpu":
            address = data_address(array)  # not array.ctypes.data: a ctypes object per call
        else:
            address = self.host.device_address(array)
            pool = array if bound.buffer == POOL else None
            check_alignment(bound.name, address, pool, state=bound.name in self._state_names)
        args = (bound.name, bound.memory, 0, array.dtype, list(array.shape), address)
        (binding.bind_output if bound.output else binding.bind_input)(*args)
        return args

    def _bind_call(
        self,
        binding: ort.IOBinding,
        plan: tuple[Bound, ...],
        arrays: dict[str, np.ndarray],
    ) -> None:
        """Bind a prefill call: pool views and the arrays in `arrays` by pointer, per-call inputs
        as copies onnxruntime owns, and per-call outputs missing from `arrays` to buffers
        onnxruntime allocates on the CPU (read with `copy_outputs_to_cpu`, in plan order)."""
        for bound in plan:
            array = arrays.get(bound.name)
            if bound.buffer == CALL and not bound.output:
                binding.bind_cpu_input(bound.name, np.ascontiguousarray(array, bound.dtype))
            elif array is None:
                binding.bind_output(bound.name, bound.memory)
            else:
                self._bind(binding, bound, array)

    def _select_last(self, logits: np.ndarray, last_index: np.ndarray) -> np.ndarray:
        """The graph's logits [batch, 1 | rows | seq, vocab] -> [batch, vocab] at each row's
        last_index [batch], or [batch, rows, vocab] at last_index [batch, rows] (a copy)."""
        rows = last_index.reshape(logits.shape[0], -1)  # [batch, rows]
        if self.manifest.logits == "all":
            logits = logits[np.arange(logits.shape[0])[:, None], rows]
        return step_logits(logits, last_index)

    def _prefill_portable(
        self, input_ids, position_ids, past_lengths, last_index, past, counts=None, states=None
    ) -> StepOutput:
        rows = last_index.size // len(last_index)
        plan = self._plan("prefill", *input_ids.shape, rows)
        arrays = dict(self._step_inputs(input_ids, position_ids, past_lengths, last_index, counts))
        arrays.update(self._pool_arrays(past, states))
        binding = self.session.io_binding()
        self._bind_call(binding, plan, arrays)  # logits, then each layer's present tensors: per call
        self.session.run_with_iobinding(binding, self._prefill_options)
        outs = binding.copy_outputs_to_cpu()
        n = len(self.manifest.names.cache_present(self.manifest.geometry))
        present = [tuple(outs[1 + n * i : 1 + n * (i + 1)]) for i in range(len(past))]
        named = dict(zip((b.name for b in plan if b.output), outs, strict=True))
        return StepOutput(self._select_last(outs[0], last_index), present, self._present_states(named))

    def _prefill_in_place(self, input_ids, past_lengths, last_index, past, states=None) -> tuple:
        """One call whose rows all hold only real tokens; returns (logits [batch, vocab], the new
        states by name or None)."""
        names = self.manifest.names
        rows = last_index.size // len(last_index)
        if input_ids.shape[1] <= VERIFY_TOKENS:
            return self._short_call(input_ids, past_lengths, last_index, past, rows, states)
        plan = self._plan("prefill", *input_ids.shape, rows)
        arrays = dict(self._step_inputs(input_ids, None, past_lengths, last_index))
        arrays.update(self._pool_arrays(past, states))
        logits = arrays[names.logits] = np.empty(self._outputs[0].shape(*input_ids.shape, rows), np.float32)
        for name, view in self._present_names(states):  # the new states: buffers of their own
            arrays[name] = np.empty_like(view)
        binding = self.session.io_binding()
        self._bind_call(binding, plan, arrays)
        self.session.run_with_iobinding(binding, self._prefill_options)
        # [batch, 1 or seq, vocab] -> [batch, vocab]
        return self._select_last(logits, last_index), self._present_states(arrays)

    def _present_names(self, states: dict | None) -> list[tuple[str, np.ndarray]]:
        """(present state name, its past state's view in `states`) per state layer."""
        if not states:
            return []
        interface, names = self.manifest.interface, self.manifest.names
        pairs = zip(interface.states(names.past_state), interface.states(names.present_state), strict=True)
        return [(out.name, states[past.name]) for past, out in pairs]

    def _short_call(self, input_ids, past_lengths, last_index, past, rows: int, states=None) -> tuple:
        """`_prefill_in_place` of up to VERIFY_TOKENS tokens through a binding kept per (shape,
        slots), as decode's: binding every cache buffer per call cost a verify a large share of a
        decode step in Python (docs/PERFORMANCE.md, "Speculative decoding by prompt lookup")."""
        key = (*input_ids.shape, rows, data_address(past[0][0]), past[0][0].strides)
        step = self._short_bindings.get(key)
        if step is None:
            if len(self._short_bindings) >= MAX_SHORT_BINDINGS:
                self._drop_bindings(self._short_bindings)
            step = self._short_bindings[key] = self._make_binding(past, input_ids.shape[1], rows, states)
        step.input_ids[...] = input_ids
        if step.input_lengths is not None:
            step.input_lengths[...] = input_ids.shape[1]  # every token real (`run` splits padded rows)
        if self.lookups is not None:
            for name, value in self.lookups(input_ids).items():
                step.looked_up[name][...] = value
        step.past_lengths[...] = past_lengths
        step.last_index[...] = graph_last_index(self.manifest, last_index).reshape(step.last_index.shape)
        for args in step.rebind:  # `Bound.rebind`, as in `_decode`
            step.binding.bind_input(*args)
        self.session.run_with_iobinding(step.binding, step.run_options)
        states = None if step.states is None else {name: a.copy() for name, a in step.states.items()}
        return self._select_last(step.logits, last_index), states  # copies: the buffers are the binding's

    def close(self) -> None:
        """Stop onnxruntime, then give back the mapped memory (cuda), in that order: the bindings
        and the session that read the pool and the step buffers on the device go first. The
        backend is unusable afterwards; safe to call twice."""
        self._decode_bindings.clear()
        self._short_bindings.clear()
        self.session = None
        if self.host is not None:
            self.host.close()


@dataclass
class _KeptBinding:
    """A kept I/O binding (a decode step's, or a short in-place call's: `_short_call`): every
    buffer bound by pointer once, values rewritten per call."""

    binding: ort.IOBinding
    input_ids: np.ndarray  # [batch, 1 or seq] int64
    # by name, the inputs the runtime looks up (`HostInputs`): inputs_embeds [batch, 1 or seq,
    # hidden], per_layer_inputs [batch, 1 or seq, layers x P]
    looked_up: dict[str, np.ndarray]
    position_ids: np.ndarray  # [batch, 1 or seq] int64 (bound where the graph takes positions)
    past_lengths: np.ndarray  # [batch] int64
    last_index: np.ndarray  # [batch] or [batch, rows] int64 (zeros for decode: its one position)
    logits: np.ndarray  # [batch, 1 or rows, vocab] float32
    present: list[tuple[np.ndarray, ...]] | None  # portable: per layer [batch, kvh, 1, d or groups]
    input_lengths: np.ndarray | None  # [batch] int64, graphs with per-slot states
    states: dict[str, np.ndarray] | None  # present states by name [batch, *shape] (graphs with states)
    past: list[tuple[np.ndarray, ...]]  # the bound pool views, kept alive with the binding
    owned: list[np.ndarray]  # the step buffers made for this binding (plan's STEP entries)
    plan: tuple[Bound, ...]  # what is bound where, `binding_plan`
    run_options: ort.RunOptions | None  # cuda_graph: this binding's gpu_graph_id
    rebind: list[tuple]  # bind_input arguments of the plan's `rebind` inputs, bound before each step


def _run_options(graph_id: int) -> ort.RunOptions:
    """Run options selecting CUDA graph `graph_id` (-1: run without capture or replay)."""
    options = ort.RunOptions()
    options.add_run_config_entry(CUDA_GRAPH_ID, str(graph_id))
    return options


# onnxruntime's element type names -> numpy dtypes, for checking a session against the manifest
_ORT_TYPES = {
    f"tensor({name})": np.dtype(dtype)
    for name, dtype in (
        ("float", np.float32),
        ("float16", np.float16),
        ("int8", np.int8),
        ("uint8", np.uint8),
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
