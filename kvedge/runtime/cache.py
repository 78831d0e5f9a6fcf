"""The KV cache: one preallocated pool, a valid length per slot, nothing inferred from contents.

Memory layout (one allocation, made at construction and reused forever)::

    pool     [layers, 2 (K, V), slots, kv_heads, max_len, head_dim]   geometry dtype
    lengths  [slots]             int64   valid tokens in each slot
    tokens   [slots, max_len]    int64   the token id held at each valid position

`pool[layer, 0, a:b]` is a contiguous [b-a, kv_heads, max_len, head_dim] view, which is what the
backend binds as a layer's past K for a batch of consecutive slots. Slots past `lengths[s]`
hold stale but finite data; the graph masks them by length, so a rewind is just a smaller
length and nothing is ever cleared.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvedge.contract import CacheGeometry
from kvedge.errors import ContextOverflow, KvedgeError


class KVCache:
    """Fixed pool of cache slots. A slot holds one sequence; its fill is `lengths[slot]`."""

    def __init__(self, geometry: CacheGeometry, slots: int = 1) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise KvedgeError(f"slots={slots!r} must be a positive integer")
        self.geometry = geometry
        self.slots = slots
        self.pool = np.zeros(geometry.pool_shape(slots), geometry.np_dtype)
        self.lengths = np.zeros(slots, np.int64)
        self.tokens = np.zeros((slots, geometry.max_len), np.int64)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def __len__(self) -> int:
        return self.slots

    def length(self, slot: int) -> int:
        return int(self.lengths[slot])

    def room(self, slot: int) -> int:
        return self.geometry.max_len - self.length(slot)

    def token_ids(self, slot: int) -> np.ndarray:
        """The valid tokens of `slot` (a read-only view)."""
        view = self.tokens[slot, : self.length(slot)]
        view.flags.writeable = False
        return view

    def layer_views(self, first: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer (K, V) views of slots first..first+count-1: [count, kv_heads, max_len, head_dim]."""
        end = first + count
        if not 0 <= first < end <= self.slots:
            raise KvedgeError(f"slots {first}..{end - 1} are outside the pool of {self.slots}")
        return [
            (self.pool[layer, 0, first:end], self.pool[layer, 1, first:end])
            for layer in range(self.geometry.num_layers)
        ]

    def check_room(self, slot: int, count: int) -> None:
        if count > self.room(slot):
            raise ContextOverflow(
                f"{count} new tokens do not fit: slot {slot} holds {self.length(slot)} of "
                f"{self.geometry.max_len} (max_len); {self.room(slot)} left"
            )

    def append(
        self,
        slots: Sequence[int],
        tokens: np.ndarray,  # [batch, seq] int64, row r right-padded beyond counts[r]
        counts: Sequence[int],
        present: Sequence[tuple[np.ndarray, np.ndarray]],  # per layer ([batch, kvh, seq, d] K, V)
    ) -> None:
        """Write the first counts[r] new tokens of row r at the end of slot slots[r]."""
        for row, (slot, count) in enumerate(zip(slots, counts, strict=True)):
            if count == 0:
                continue
            self.check_room(slot, count)
            start = self.length(slot)
            for layer, (new_k, new_v) in enumerate(present):
                self.pool[layer, 0, slot, :, start : start + count] = new_k[row, :, :count]
                self.pool[layer, 1, slot, :, start : start + count] = new_v[row, :, :count]
            self.tokens[slot, start : start + count] = tokens[row, :count]
            self.lengths[slot] = start + count

    def truncate(self, slot: int, length: int) -> None:
        """Rewind `slot` to its first `length` tokens (the rest becomes invisible)."""
        if not 0 <= length <= self.length(slot):
            raise KvedgeError(f"cannot truncate slot {slot} to {length}: it holds {self.length(slot)} tokens")
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        self.truncate(slot, 0)
