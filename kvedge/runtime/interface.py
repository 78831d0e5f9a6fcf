"""What every backend is: the `Backend` protocol the runtime steps through and the `StepOutput`
a step returns. Both backends import it and neither imports the other; `kvedge.runtime.registry`
chooses between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from kvedge.contract import Manifest

MAX_DECODE_BINDINGS = 8  # default: distinct (batch, slot range) decode bindings kept; beyond, start over


@dataclass
class StepOutput:
    # [batch, vocab] float32: next-token logits for each row; [batch, rows, vocab] where the call's
    # last_index was [batch, rows] (a speculative verify, `step_logits`)
    logits: np.ndarray
    # Per layer, the new tokens' cache tensors in `IONames.present` order ((K, V) [batch, kvh,
    # seq, d], then K, V scales [batch, kvh, seq, groups] for int8 caches); None when the graph
    # wrote them into the cache in place.
    present: list[tuple[np.ndarray, ...]] | None
    # models with per-slot states: {present state name: [batch, *shape]}, each row's state after
    # its real tokens (`IONames.present_state`); None without states
    states: dict[str, np.ndarray] | None = None


def graph_last_index(manifest: Manifest, last_index: np.ndarray) -> np.ndarray:
    """last_index [batch] or [batch, rows] as the graph takes it: [batch, rows] in a "rows"
    graph (one row per sequence unless a verify asks for more), [batch] otherwise."""
    return last_index.reshape(len(last_index), -1) if manifest.logits == "rows" else last_index


def step_values(
    manifest: Manifest,
    lookups: Callable[[np.ndarray], dict[str, np.ndarray]] | None,
    input_ids: np.ndarray,
    position_ids: np.ndarray,
    past_lengths: np.ndarray,
    last_index: np.ndarray,
    counts: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """A step's per-call graph inputs by name: the tokens (and, with `lookups`, what the runtime
    looks up of them: `kvedge.runtime.embeddings.HostInputs`), their positions, each row's past
    length, last index and real tokens (`counts`, default every token); which of them the graph
    takes is `Manifest.graph_inputs`'s call."""
    names = manifest.names
    if counts is None:
        counts = np.full(len(input_ids), input_ids.shape[1], np.int64)
    values = {
        names.input_ids: input_ids,
        names.position_ids: position_ids,
        names.past_lengths: past_lengths,
        names.last_index: graph_last_index(manifest, last_index),
        names.input_lengths: np.asarray(counts, np.int64),
    }
    if lookups is not None:
        values.update(lookups(input_ids))
    return values


def step_logits(logits: np.ndarray, last_index: np.ndarray) -> np.ndarray:
    """A step's `StepOutput.logits` from the graph's logits [batch, rows, vocab] at last_index:
    [batch, vocab] (each row's one) for last_index [batch], [batch, rows, vocab] for last_index
    [batch, rows], even when rows is 1; a copy, so the buffer it came from can be reused."""
    return logits.copy() if last_index.ndim == 2 else logits[:, 0].copy()


@runtime_checkable
class Backend(Protocol):
    """What the runtime asks of a backend: `generate` runs steps, `Model` reserves memory at load
    and closes it. `kvedge.runtime.backends.ort.OrtBackend` and `kvedge.runtime.backends.trt.TrtBackend`
    implement it; `kvedge.runtime.registry.open_backend` picks one."""

    manifest: Manifest  # the graph's interface: `graph_inputs()`, `graph_outputs()`, `in_place`
    # most sequences one call may hold, and most tokens of each (a TensorRT engine's profiles,
    # --max-batch and --max-prefill); None: no limit
    max_batch: int | None
    max_prefill: int | None

    def run(
        self,
        input_ids: np.ndarray,  # [batch, seq] int64, row r right-padded beyond counts[r]
        position_ids: np.ndarray,  # [batch, seq] int64
        past_lengths: np.ndarray,  # [batch] int64
        last_index: np.ndarray,  # [batch] int64, or [batch, rows] (`verify_refusal` is None)
        past: list[tuple[np.ndarray, ...]],  # per layer views of the pool, `KVCache.layer_views`
        counts: np.ndarray | None = None,  # [batch] int64 real tokens per row; default last_index + 1
        states: dict[str, np.ndarray] | None = None,  # `KVCache.state_views` of the rows' slots
    ) -> StepOutput:
        """One step over `past` (and the slots' `states`): next-token logits per row
        (`StepOutput.logits`), the new K/V unless written in place, and the new states."""
        ...

    def verify_refusal(self) -> str | None:
        """Why this backend cannot return several logits rows per sequence in one call (verify a
        speculative step), or None."""
        ...

    def reserve(
        self, past: list[tuple[np.ndarray, ...]], max_len: int, states: dict[str, np.ndarray] | None = None
    ) -> None:
        """Take now, at load, the memory later steps over `past` (all slots' views; `states`
        theirs) will need."""
        ...

    def close(self) -> None:
        """Stop running, then give back what was taken for the GPU (page locks, mapped buffers),
        in that order; safe to call twice. The cache arrays themselves are the caller's."""
        ...
