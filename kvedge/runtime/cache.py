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

from collections.abc import Callable, Sequence

import numpy as np

from kvedge.contract import CacheGeometry
from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.runtime.rope import rotate_keys


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
        # Optional hook run on each block of new K/V [layers, 2, kv_heads, n, head_dim] as it
        # becomes valid, with the block's first position: `kvedge.quant.RoundTrip` uses it to
        # measure INT8 schemes.
        self.round_trip: Callable[[np.ndarray, int], None] | None = None

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
        self.commit(slots, tokens, counts)

    def commit(
        self,
        slots: Sequence[int],
        tokens: np.ndarray,  # [batch, seq] int64, row r right-padded beyond counts[r]
        counts: Sequence[int],
    ) -> None:
        """Make the first counts[r] new tokens of row r valid in slot slots[r].

        Their K/V must already be in the pool at the slot's end: written by `append`, or by a
        graph that writes into the bound buffers in place (the "ort" variant).
        """
        for row, (slot, count) in enumerate(zip(slots, counts, strict=True)):
            if count == 0:
                continue
            self.check_room(slot, count)
            start = self.length(slot)
            if self.round_trip is not None:
                self.round_trip(self.pool[:, :, slot, :, start : start + count], start)
            self.tokens[slot, start : start + count] = tokens[row, :count]
            self.lengths[slot] = start + count

    def truncate(self, slot: int, length: int) -> None:
        """Rewind `slot` to its first `length` tokens (the rest becomes invisible)."""
        if not 0 <= length <= self.length(slot):
            raise KvedgeError(f"cannot truncate slot {slot} to {length}: it holds {self.length(slot)} tokens")
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        self.truncate(slot, 0)

    def evict(self, slot: int, start: int, count: int, inv_freq: np.ndarray) -> None:
        """Drop tokens start..start+count-1 of `slot`; later tokens move back by `count` positions.

        The moved keys are re-rotated by -count (see `kvedge.runtime.rope`), so the slot then
        holds exactly what a fresh run over the kept tokens would have written.
        """
        length = self.length(slot)
        if not (0 <= start and count > 0 and start + count <= length):
            raise KvedgeError(f"cannot evict {count} tokens at {start} from slot {slot} holding {length}")
        moved = length - start - count
        # numpy copies overlapping slices through a temporary, so moving left in place is safe
        self.pool[:, :, slot, :, start : start + moved] = self.pool[:, :, slot, :, start + count : length]
        rotate_keys(self.pool[:, 0, slot, :, start : start + moved], -count, inv_freq)
        self.tokens[slot, start : start + moved] = self.tokens[slot, start + count : length].copy()
        self.lengths[slot] = length - count

    def read(self, slot: int, count: int) -> np.ndarray:
        """A copy of the first `count` tokens' KV of `slot`: [layers, 2, kv_heads, count, head_dim]."""
        if not 0 < count <= self.length(slot):
            raise KvedgeError(f"cannot read {count} tokens from slot {slot} holding {self.length(slot)}")
        return self.pool[:, :, slot, :, :count].copy()

    def write(self, slot: int, kv: np.ndarray, token_ids: Sequence[int]) -> None:
        """Replace `slot`'s contents with `kv` [layers, 2, kv_heads, n, head_dim] for `token_ids`."""
        count = len(token_ids)
        expected = (self.geometry.num_layers, 2, self.geometry.num_kv_heads, count, self.geometry.head_dim)
        if kv.shape != expected:
            raise KvedgeError(f"KV block of shape {kv.shape} does not fit this cache (expected {expected})")
        if count > self.geometry.max_len:
            raise ContextOverflow(f"a KV block of {count} tokens exceeds max_len {self.geometry.max_len}")
        self.pool[:, :, slot, :, :count] = kv
        self.tokens[slot, :count] = token_ids
        self.lengths[slot] = count
