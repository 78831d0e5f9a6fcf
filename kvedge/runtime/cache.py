"""The KV cache: one preallocated pool, a valid length per slot, nothing inferred from contents.

Memory layout (made at construction and reused forever; in host memory each array alone in whole
pages, `kvedge.runtime.backends.memory.page_aligned`, so a GPU backend can page-lock it in place, or, with
`--kv-memory device`, in device memory, `kvedge.runtime.backends.cuda.DeviceMemory`; the cache reaches
the arrays only through its memory's `get` / `set` / `slots`, explicit copies on the device)::

    pool     [layers, 2 (K, V), slots, kv_heads, max_len, head_dim]   geometry dtype
    scales   [layers, 2 (K, V), slots, kv_heads, max_len, groups]     float16, int8 caches only
    lengths  [slots]             int64   valid tokens in each slot
    tokens   [slots, max_len]    int64   the token id held at each valid position

`pool[layer, 0, a:b]` is a contiguous [b-a, kv_heads, max_len, head_dim] view, which is what the
backend binds as a layer's past K for a batch of consecutive slots (with `scales[layer, 0, a:b]`
as its past K scales in an int8 cache). Slots past `lengths[s]` hold stale but finite data; the
graph masks them by length, so a rewind is just a smaller length and nothing is ever cleared.

Geometries with ring layers (Gemma 3's sliding-window layers, `CacheGeometry.ring_layers`) keep
those layers apart, in a second allocation of ring_len = window + margin positions per slot::

    pool          [full layers, 2, slots, kv_heads, max_len, head_dim]
    ring          [ring layers, 2, slots, kv_heads, ring_len, ring_dim]
    ring_scales   [ring layers, 2, slots, kv_heads, ring_len, groups]     int8 caches only

Position p of a ring layer sits at ring index p % ring_len; the graph derives each ring index's
position from the valid length (docs/design/kv-contract.md, "Ring-buffer layers"), so the length stays
the only state. A ring holds the last ring_len positions only: a rewind is possible only where
the positions the next query needs are still there (`rewind_limit`). A `KVBlock` copied out of a
ring geometry (prefix stores, warm prefixes) carries every position of the full layers and, for
the ring layers, only the last positions the slot still held, laid out by position; writing it
back puts them at p % ring_len and sets `ring_start`. Window eviction, which moves a run of
positions, still refuses ring geometries by name.

An int4 cache (`CacheGeometry.packed`, kvedge/kv4.py) has no pool: its arrays are `parts`
(`CacheGeometry.packed_arrays`: codes and scales of max_len positions, and float32 K and V window
rings of window_len positions, position p at p % window_len). Its window is kept as ring layers
are (`ring_start`, `ring_limit`), and so are its blocks: a `KVBlock` of it carries every
position's codes and scales (`parts`) and the window rows of the run's positions the windows still
hold (`ring`). Window eviction refuses it by name (its keys are codes of Hadamard-rotated keys).

Hybrid models (LFM2) hold, besides the KV of their attention layers, a fixed-size state per slot
and state layer (`CacheGeometry.states`), in host memory::

    states[name]  [state layers, slots, *shape]   the state after the slot's valid tokens

A state cannot be cut back: it is valid at one position only, the slot's valid length. So the
cache keeps snapshots of it (`snapshot`: at the end of a prompt and of a reply, the positions a
later turn resumes from) and a rewind may land only on one (`resume_limit`: the latest known
state at or before the asked length; the tokens after it are computed again). A stored prefix
(prefix stores, warm prefixes) carries the states at the positions it can be resumed from
(`known_states`); writing it back restores the KV up to one of them and the state exactly there
(`write`'s `states`). Window eviction, which moves a run of keys, is refused for such geometries.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvedge.contract import KV_SCALE_DTYPE, CacheGeometry, IONames
from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.quant import dequantize_tokens, quantize_tokens
from kvedge.runtime.backends.memory import HostMemory
from kvedge.runtime.rope import rotate_keys

if TYPE_CHECKING:
    from kvedge.runtime.backends.cuda import DeviceMemory

# snapshots of a slot's states kept (the end of its last prompts and replies)
MAX_SNAPSHOTS = 4

# per-slot states at positions of a run: {position: {kind: [state layers, *shape]}}
Snapshots = Mapping[int, Mapping[str, np.ndarray]]
# where a layer's cache lives: per tensor (`IONames.past` order) its (array, index in the array's
# first axis, kind: 0 K, 1 V on the second), and whether the layer is a ring
Home = tuple[tuple[tuple[np.ndarray, int, int], ...], bool]


class KVBlock(NamedTuple):
    """The KV of a run of n tokens, as a slot stores it (copied out, or for writing in). With ring
    layers, `kv` holds the full layers only and `ring` the ring layers' last r <= n positions of
    the run (r = 0: none), in position order. An int4 cache's block has no `kv`: `parts` holds
    every position's codes and scales, and `ring` its windows' rows of the run's last r <= n
    positions (r <= window_len), in position order, under the same rule as ring layers'."""

    kv: np.ndarray | None  # [full layers, 2 (K, V), kv_heads, n, head_dim] cache dtype (None: int4)
    scales: np.ndarray | None = None  # [full layers, 2, kv_heads, n, groups] float16 (int8 caches only)
    # [ring layers, 2, kv_heads, r, ring_dim] (ring geometries), [layers, 2, kv_heads, r, head_dim]
    # float32 (int4: the K and V windows' rows)
    ring: np.ndarray | None = None
    ring_scales: np.ndarray | None = None  # [ring layers, 2, kv_heads, r, groups] float16 (int8 + rings)
    # int4 only: per array of `CacheGeometry.packed_arrays` but the windows, [its layers, 1,
    # kv_heads, n, last] of its dtype (codes uint8, scales float16)
    parts: tuple[np.ndarray, ...] = ()

    @property
    def count(self) -> int:
        return (self.kv if self.kv is not None else self.parts[0]).shape[3]

    @property
    def ring_count(self) -> int:
        """Positions the ring layers (an int4 cache's windows) hold: the last ring_count of the run."""
        return 0 if self.ring is None else self.ring.shape[3]

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """Every array it holds, in the order a warm file stores them."""
        return tuple(
            a for a in (self.kv, *self.parts, self.ring, self.scales, self.ring_scales) if a is not None
        )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def head(self, count: int) -> KVBlock:
        """The first `count` tokens (views); the ring layers keep the ones of them they hold."""
        return self._run(0, count)

    def tail(self, start: int) -> KVBlock:
        """Tokens start.. (views); the ring layers keep the ones of them they hold."""
        return self._run(start, self.count)

    def copy(self) -> KVBlock:
        return self._map(lambda a: a.copy())

    def _run(self, start: int, stop: int) -> KVBlock:
        held = self.count - self.ring_count  # the first position the rings hold
        ring = slice(max(0, start - held), max(0, stop - held))
        return self._map(lambda a: a[:, :, :, start:stop], lambda a: a[:, :, :, ring])

    def _map(
        self,
        each: Callable[[np.ndarray], np.ndarray],
        rings: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> KVBlock:
        """`each` applied to every array (`rings` to the ring layers' and windows', if given)."""
        rings = rings or each
        return KVBlock(
            None if self.kv is None else each(self.kv),
            None if self.scales is None else each(self.scales),
            None if self.ring is None else rings(self.ring),
            None if self.ring_scales is None else rings(self.ring_scales),
            tuple(each(a) for a in self.parts),
        )


class KVCache:
    """Fixed pool of cache slots. A slot holds one sequence; its fill is `lengths[slot]`."""

    def __init__(
        self, geometry: CacheGeometry, slots: int = 1, memory: HostMemory | DeviceMemory | None = None
    ) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise KvedgeError(f"slots={slots!r} must be a positive integer")
        self.geometry = geometry
        self.slots = slots
        # Where the arrays live, and the one way in and out of them (`get`, `set`, `slots`): host
        # memory (`HostMemory`: numpy arrays, each alone in whole pages, every page written now,
        # so a cache that does not fit fails at load and a GPU backend can page-lock exactly
        # these pages, once), or device memory (`kvedge.runtime.backends.cuda.DeviceMemory`).
        self.memory = memory or HostMemory()
        allocate = self.memory.allocate
        ring = bool(geometry.ring_layers)
        self.pool = self.scales = self.ring = self.ring_scales = None
        self.parts: list[np.ndarray] = []  # an int4 cache's arrays (`_packed_homes`)
        try:
            if geometry.packed:
                self._homes = self._packed_homes(geometry, slots)
            else:
                self.pool = allocate(geometry.pool_shape(slots), geometry.np_dtype)
                self.scales = (
                    allocate(geometry.scale_pool_shape(slots), KV_SCALE_DTYPE, 1)
                    if geometry.quantized
                    else None
                )
                self.ring = allocate(geometry.ring_shape(slots), geometry.np_dtype) if ring else None
                self.ring_scales = (
                    allocate(geometry.ring_scale_shape(slots), KV_SCALE_DTYPE, 1)
                    if ring and geometry.quantized
                    else None
                )
        except BaseException:
            self.memory.close()  # what was allocated before the failure (device memory) goes back
            raise
        if not geometry.packed:  # each layer's `Home`
            full = (self.pool,) if self.scales is None else (self.pool, self.scales)
            rings = (self.ring,) if self.ring_scales is None else (self.ring, self.ring_scales)
            self._homes: list[Home] = [
                (tuple((a, j, kind) for a in arrays for kind in (0, 1)), ring)
                for arrays, j, ring in (
                    (rings, geometry.ring_layers.index(i), True)
                    if i in geometry.ring_layers
                    else (full, geometry.full_layers.index(i), False)
                    for i in range(geometry.num_layers)
                )
            ]
        # per-slot states (hybrid models): {kind: [state layers, slots, *shape]}, zero at length 0
        if geometry.states and not isinstance(self.memory, HostMemory):
            self.memory.close()
            raise KvedgeError(
                "--kv-memory device does not hold per-slot states (LFM2, Qwen3.5) yet; use --kv-memory mapped"
            )
        # in whole pages, as the pool: a GPU backend page-locks and binds them in place
        self.states = {s.kind: self.memory.allocate(s.pool_shape(slots), s.np_dtype) for s in geometry.states}
        # {slot: {position: {kind: [state layers, *shape]}}}: the states at earlier positions
        self.snapshots: list[dict[int, dict[str, np.ndarray]]] = [{} for _ in range(slots)]
        self.tokens = np.full((slots, geometry.max_len), 0, np.int64)
        self.lengths = np.zeros(slots, np.int64)
        # ring layers: the lowest position each slot's rings still hold (every one from it up to
        # the valid length). A write at position p overwrites p - ring_len, and writes past a
        # later rewind's length count too, so this is tracked, not derived from the length alone.
        self.ring_start = np.zeros(slots, np.int64)
        self._views: dict[tuple[int, int], list[tuple[np.ndarray, ...]]] = {}  # layer_views, made once
        # Optional hook run on each block of new K/V [layers, 2, kv_heads, n, head_dim] as it
        # becomes valid, with the block's first position: `kvedge.quant.RoundTrip` uses it to
        # measure INT8 schemes.
        self.round_trip: Callable[[np.ndarray, int], None] | None = None

    def _packed_homes(self, g: CacheGeometry, slots: int) -> list[Home]:
        """An int4 cache's arrays (`parts`) and each layer's home in them: per array of
        `CacheGeometry.packed_arrays`, [its layers, 1, slots, kv_heads, positions, last], so the
        memory's one way in (`get`, `set`, `slots`) serves it as the pool. Each layer's tensors
        come in `packed_parts` order, as `packed_arrays` lists the arrays."""
        homes: list[list[tuple[np.ndarray, int, int]]] = [[] for _ in range(g.num_layers)]
        for layers, (dtype, positions, last) in g.packed_arrays():
            fill = 1 if dtype == np.dtype(KV_SCALE_DTYPE) else 0
            shape = (len(layers), 1, slots, g.num_kv_heads, positions, last)
            array = self.memory.allocate(shape, dtype, fill)
            self.parts.append(array)
            for j, i in enumerate(layers):
                homes[i].append((array, j, 0))
        return [(tuple(home), False) for home in homes]

    @property
    def nbytes(self) -> int:
        arrays = (self.pool, self.scales, self.ring, self.ring_scales, *self.parts, *self.states.values())
        return sum(a.nbytes for a in arrays if a is not None)

    def __len__(self) -> int:
        return self.slots

    def close(self) -> None:
        """Give back the arrays' memory where it is the GPU's (`DeviceMemory`), after whatever
        reads it has stopped; the cache is unusable after. Safe to call twice."""
        self.memory.close()

    def length(self, slot: int) -> int:
        return int(self.lengths[slot])

    def room(self, slot: int) -> int:
        return self.geometry.max_len - self.length(slot)

    def token_ids(self, slot: int) -> np.ndarray:
        """The valid tokens of `slot` (a read-only view)."""
        view = self.tokens[slot, : self.length(slot)]
        view.flags.writeable = False
        return view

    def layer_views(self, first: int, count: int) -> list[tuple[np.ndarray, ...]]:
        """Per layer views of slots first..first+count-1, in `IONames.past` order: (K, V) each
        [count, kv_heads, L, head_dim], then for int8 caches (K scales, V scales) each
        [count, kv_heads, L, groups]; L = max_len, or ring_len for a ring layer. An int4 cache's:
        `CacheGeometry.packed_parts` (codes, scales, then the windows)."""
        views = self._views.get((first, count))
        if views is not None:  # the pool never moves, so views made once stay valid
            return views
        end = first + count
        if not 0 <= first < end <= self.slots:
            raise KvedgeError(f"slots {first}..{end - 1} are outside the pool of {self.slots}")
        views = [
            tuple(self.memory.slots(a, j, kind, first, end) for a, j, kind in home) for home, _ in self._homes
        ]
        self._views[(first, count)] = views
        return views

    def state_views(self, first: int, count: int) -> dict[str, np.ndarray]:
        """{graph input name: view} of the states of slots first..first+count-1, each state layer's
        [count, *shape] (contiguous), named as `IONames.past_state`; {} without states."""
        names = IONames()
        return {
            names.state(names.past_state, spec.kind, layer): self.states[spec.kind][j, first : first + count]
            for spec in self.geometry.states
            for j, layer in enumerate(spec.layers)
        }

    def write_states(
        self, slots: Sequence[int], counts: Sequence[int], present: dict[str, np.ndarray] | None
    ) -> None:
        """Each row's state after its real tokens (`present`: {graph output name: [batch, *shape]})
        into its slot; rows of no tokens keep theirs."""
        if not self.states:
            return
        if present is None:
            raise KvedgeError("this model keeps per-slot states, and the step returned none")
        names = IONames()
        for spec in self.geometry.states:
            for j, layer in enumerate(spec.layers):
                new = present[names.state(names.present_state, spec.kind, layer)]
                for row, (slot, count) in enumerate(zip(slots, counts, strict=True)):
                    if count:
                        self.states[spec.kind][j, slot] = new[row]

    def snapshot(self, slot: int) -> None:
        """Keep `slot`'s states at its valid length, where a later turn may resume (at most
        MAX_SNAPSHOTS per slot, the latest kept)."""
        if not self.states:
            return
        kept = self.snapshots[slot]
        kept[self.length(slot)] = {kind: array[:, slot].copy() for kind, array in self.states.items()}
        self._trim_snapshots(slot)

    def _trim_snapshots(self, slot: int) -> None:
        kept = self.snapshots[slot]
        for position in sorted(kept)[:-MAX_SNAPSHOTS]:
            del kept[position]

    def known_states(self, slot: int, upto: int) -> dict[int, dict[str, np.ndarray]]:
        """`slot`'s states at the positions up to `upto` where they are known (its snapshots, whose
        arrays are never written to, and a copy of those at its valid length): what a prefix copied
        out of the slot carries. {} without states."""
        if not self.states:
            return {}
        known = {p: dict(states) for p, states in self.snapshots[slot].items() if p <= upto}
        if self.length(slot) <= upto:
            known[self.length(slot)] = {kind: array[:, slot].copy() for kind, array in self.states.items()}
        return known

    def resume(self, slot: int, states: Snapshots) -> None:
        """Set `slot`'s states to those `states` (a stored prefix's) carry at its valid length, and
        keep the ones they carry below it as snapshots."""
        length = self.length(slot)
        if length not in states:
            raise KvedgeError(
                f"slot {slot} holds {length} tokens; the stored prefix carries states at "
                f"{sorted(states)} only"
            )
        for kind, array in self.states.items():
            array[:, slot] = states[length][kind]
        kept = self.snapshots[slot]
        for position, carried in states.items():
            if position <= length:
                kept[position] = {kind: np.array(carried[kind]) for kind in self.states}
        self._trim_snapshots(slot)

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
        # per layer, in `IONames.present` order: (K, V) [batch, kvh, seq, d], then for int8
        # caches (K scales, V scales) [batch, kvh, seq, groups]
        present: Sequence[tuple[np.ndarray, ...]],
        states: dict[str, np.ndarray] | None = None,  # {present state name: [batch, *shape]}
    ) -> None:
        """Write the first counts[r] new tokens of row r at the end of slot slots[r] (a ring
        layer: the last ring_len of them, each at its position modulo ring_len), and each row's
        new `states` (per-slot state models)."""
        self._refuse_packed("appending a portable graph's new K/V")
        ring_len = self.geometry.ring_len
        with self.memory.batched():  # a device pool waits once for all the copies
            self._write(slots, counts, present, ring_len)
        self.write_states(slots, counts, states)
        self.commit(slots, tokens, counts)

    def _write(
        self,
        slots: Sequence[int],
        counts: Sequence[int],
        present: Sequence[tuple[np.ndarray, ...]],
        ring_len: int,
    ) -> None:
        """`append`'s copies of the new tokens' K/V (and scales) into the pool."""
        for row, (slot, count) in enumerate(zip(slots, counts, strict=True)):
            if count == 0:
                continue
            self.check_room(slot, count)
            start = self.length(slot)
            # (cache columns, columns of the new tokens) a full layer and a ring layer write
            columns = {False: (slice(start, start + count), slice(0, count))}
            if ring_len:
                kept = np.arange(max(start, start + count - ring_len), start + count)  # positions
                columns[True] = (kept % ring_len, kept - start)
                self.ring_start[slot] = max(self.ring_start[slot], start + count - ring_len)
            for (home, ring), outputs in zip(self._homes, present, strict=True):
                to, source = columns[ring]
                for (array, index, kind), new in zip(home, outputs, strict=True):
                    self.memory.set(array, slot, to, new[row][:, source], layer=index, kind=kind)

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
            if self.geometry.packed:  # the graph wrote every token of the call, a row's padding
                # and a row of none included, into its window ring: what it held there is gone
                written = self.length(slot) + tokens.shape[1]
                self.ring_start[slot] = max(self.ring_start[slot], written - self.geometry.window_len)
            if count == 0:
                continue
            self.check_room(slot, count)
            start = self.length(slot)
            if self.round_trip is not None:
                self._refuse_ring("measuring INT8 round trips")
                self.round_trip(self.memory.get(self.pool, slot, slice(start, start + count)), start)
            self.tokens[slot, start : start + count] = tokens[row, :count]
            self.lengths[slot] = start + count

    def rewind_limit(self, slot: int, length: int) -> int:
        """How far `slot` may rewind towards `length` tokens: `resume_limit` with what the slot's
        rings hold (`ring_start`) and where its states are known (its snapshots, its length)."""
        known = (*self.snapshots[slot], self.length(slot)) if self.states else None
        return self.resume_limit(length, int(self.ring_start[slot]), known)

    def resume_limit(self, length: int, ring_from: int = 0, state_at: Collection[int] | None = None) -> int:
        """The most of the first `length` positions of a slot or a stored prefix a turn can resume
        from, recomputing the rest. With per-slot states, the latest position at or before
        `length` where they are known (`state_at`; 0 if none); then `ring_limit` at it. The one
        rule for rewinding a slot and for copying in a stored prefix (`Model._usable`)."""
        if self.states:
            length = max((p for p in state_at or () if p <= length), default=0)
        return self.ring_limit(ring_from, length)

    def ring_limit(self, ring_from: int, length: int) -> int:
        """`length` if rings holding positions ring_from .. length - 1 hold every one the next
        query needs, else 0: a ring layer's query at position `length` sees positions
        length - window + 1 .. length - 1. The one rule for rewinding a slot and for copying in
        a stored block (`KVBlock.ring_count`: it holds count - ring_count ..)."""
        g = self.geometry
        if g.packed and length:  # the int4 window: the float_window positions before `length`
            return length if max(0, length - g.float_window) >= ring_from else 0
        if not g.ring_layers or length == 0:
            return length
        return length if max(0, length - g.window + 1) >= ring_from else 0

    def truncate(self, slot: int, length: int) -> None:
        """Rewind `slot` to its first `length` tokens (the rest becomes invisible)."""
        if not 0 <= length <= self.length(slot):
            raise KvedgeError(f"cannot truncate slot {slot} to {length}: it holds {self.length(slot)} tokens")
        if self.states and length not in (0, self.length(slot), *self.snapshots[slot]):
            raise KvedgeError(
                f"cannot truncate slot {slot} to {length}: its states are known at "
                f"{sorted(self.snapshots[slot])} and its length {self.length(slot)} only (rewind to "
                "one, `rewind_limit`)"
            )
        if self.rewind_limit(slot, length) != length:
            g = self.geometry
            rings, needed = ("int4 window", g.float_window) if g.packed else ("ring layers", g.window - 1)
            raise KvedgeError(
                f"cannot truncate slot {slot} to {length}: its {rings} hold positions from "
                f"{self.ring_start[slot]} on, not the {needed} before {length}; rewind to 0"
            )
        if self.states and length != self.length(slot):
            self._restore(slot, length)
        self.lengths[slot] = length
        if length == 0:
            self.ring_start[slot] = 0

    def _restore(self, slot: int, length: int) -> None:
        """Put back `slot`'s states at `length` (zero at 0, else a snapshot's), forgetting the
        snapshots past it."""
        kept = self.snapshots[slot]
        for kind, array in self.states.items():
            array[:, slot] = kept[length][kind] if length else 0
        for position in [p for p in kept if p > length]:
            del kept[position]

    def _refuse_states(self, what: str) -> None:
        """Refuse `what`, which moves or copies a run of KV, where slots also hold states."""
        if self.states:
            raise KvedgeError(
                f"{what} is not supported for models with per-slot states (LFM2's convolution layers): "
                "a state cannot be cut or moved with the KV"
            )

    def _refuse_packed(self, what: str) -> None:
        """Refuse `what`, a portable graph's path, on an int4 cache (ort graphs only)."""
        if self.geometry.packed:
            raise KvedgeError(
                f"{what} is not supported for the int4 cache (--kv-dtype int4): its graph writes "
                "the cache in place (--variant ort)"
            )

    def _refuse_ring(self, what: str) -> None:
        """Refuse `what`, which reads or moves a slot's positions as one run, on ring layers."""
        if self.geometry.ring_layers:
            raise KvedgeError(
                f"{what} is not supported for models with sliding-window ring layers (Gemma 3): "
                "a ring layer keeps only its last positions, at position modulo ring length"
            )

    def reset(self, slot: int) -> None:
        self.truncate(slot, 0)

    def evict(self, slot: int, start: int, count: int, inv_freq: np.ndarray) -> None:
        """Drop tokens start..start+count-1 of `slot`; later tokens move back by `count` positions.

        The moved keys are re-rotated by -count (see `kvedge.runtime.rope`), so the slot then
        holds exactly what a fresh run over the kept tokens would have written.
        """
        self._refuse_ring("window eviction (history_policy 'window')")
        if self.geometry.packed:
            raise KvedgeError(
                "window eviction (history_policy 'window') is not supported for the int4 cache "
                "(--kv-dtype int4): moving keys re-rotates them, and its keys are codes of "
                "Hadamard-rotated keys; use history_policy 'truncate', or export with --kv-dtype int8"
            )
        self._refuse_states("window eviction (history_policy 'window')")
        length = self.length(slot)
        if not (0 <= start and count > 0 and start + count <= length):
            raise KvedgeError(f"cannot evict {count} tokens at {start} from slot {slot} holding {length}")
        moved = length - start - count
        kept, dest = slice(start + count, length), slice(start, start + moved)
        get, put = self.memory.get, self.memory.set
        kv = get(self.pool, slot, kept).copy()  # [layers, 2, kv_heads, moved, head_dim], off the pool
        if self.scales is None:
            rotate_keys(kv[:, 0], -count, inv_freq)
        else:  # int8: V codes and scales move as they are; K is dequantized, rotated, requantized
            scales = get(self.scales, slot, kept).copy()  # [layers, 2, kv_heads, moved, groups]
            keys = dequantize_tokens(kv[:, 0], scales[:, 0], self.geometry.group_size)
            rotate_keys(keys, -count, inv_freq)
            kv[:, 0], scales[:, 0] = quantize_tokens(keys, self.geometry.group_size)
            put(self.scales, slot, dest, scales)
        put(self.pool, slot, dest, kv)
        self.tokens[slot, start : start + moved] = self.tokens[slot, start + count : length].copy()
        self.lengths[slot] = length - count

    def view(self, slot: int, start: int, stop: int) -> KVBlock:
        """The KV (and scales) of positions start..stop-1 of `slot`: of the full layers (an int4
        cache's codes and scales), views of a host pool and copies of a device pool; for ring
        layers (an int4 cache's windows), a copy of the positions of the run the rings still hold
        (from `ring_start` on; they wrap around the ring)."""
        if not 0 <= start < stop <= self.length(slot):
            raise KvedgeError(
                f"cannot read tokens {start}..{stop} from slot {slot} holding {self.length(slot)}"
            )
        get, run, g = self.memory.get, slice(start, stop), self.geometry
        # rings hold ring_start .. length - 1, and ring_start >= length - ring_len >= stop - ring_len
        ring_len = g.window_len if g.packed else g.ring_len
        held = np.arange(min(max(start, int(self.ring_start[slot])), stop), stop) % max(ring_len, 1)
        if g.packed:  # windows [layers, 1, kv_heads, r, d] each, as [layers, 2, kv_heads, r, d]
            windows = np.concatenate([get(a, slot, held) for a in self.parts[-2:]], axis=1)
            return KVBlock(None, ring=windows, parts=tuple(get(a, slot, run) for a in self.parts[:-2]))
        scales = None if self.scales is None else get(self.scales, slot, run)
        if self.ring is None:
            return KVBlock(get(self.pool, slot, run), scales)
        ring_scales = None if self.ring_scales is None else get(self.ring_scales, slot, held)
        return KVBlock(get(self.pool, slot, run), scales, get(self.ring, slot, held), ring_scales)

    def read(self, slot: int, count: int) -> KVBlock:
        """A copy of the first `count` tokens' KV (and scales) of `slot`."""
        return self.view(slot, 0, count).copy()

    def write(
        self,
        slot: int,
        block: KVBlock,
        token_ids: Sequence[int],
        start: int = 0,
        states: Snapshots | None = None,
    ) -> None:
        """Make `slot` hold its first `start` tokens, then `block` (as `read` or `view` return it)
        for `token_ids`; whatever it held after `start` is dropped. Ring layers take the block's
        last positions that fit the ring, and `ring_start` becomes the lowest position from which
        the rings hold every one up to the new length (`ring_limit` then says what is usable).
        With per-slot states the slot's snapshots past `start` are dropped and it resumes from the
        `states` the stored prefix carries at the new length (`resume`); a prefix copied in pieces
        gives them with its last piece."""
        count = len(token_ids)
        g = self.geometry
        if not 0 <= start <= self.length(slot):
            raise KvedgeError(f"cannot write at {start} in slot {slot} holding {self.length(slot)} tokens")
        if start + count > g.max_len:
            raise ContextOverflow(f"a KV block of {count} tokens at {start} exceeds max_len {g.max_len}")
        if g.packed:
            self._write_packed(slot, block, start, count)
        else:
            self._write_block(slot, block, start, count)
        self.tokens[slot, start : start + count] = token_ids
        self.lengths[slot] = start + count
        if self.states:
            for position in [p for p in self.snapshots[slot] if p > start]:
                del self.snapshots[slot][position]
        if self.states and states is not None:
            self.resume(slot, states)

    def _write_block(self, slot: int, block: KVBlock, start: int, count: int) -> None:
        """`write`'s copies of a block of a cache with a pool (float or int8)."""
        g = self.geometry
        expected = (len(g.full_layers), 2, g.num_kv_heads, count, g.head_dim)
        if block.kv is None:
            raise KvedgeError(f"KV block of an int4 cache does not fit this {g.dtype} cache")
        if block.kv.shape != expected or block.kv.dtype != g.np_dtype:
            raise KvedgeError(
                f"KV block {block.kv.shape} {block.kv.dtype} does not fit this cache "
                f"(expected {expected} {g.dtype})"
            )
        if (block.scales is None) != (self.scales is None):
            raise KvedgeError(f"KV block scales do not match this {g.dtype} cache")
        held = block.ring_count
        ring = (len(g.ring_layers), 2, g.num_kv_heads, held, g.ring_dim)
        if (block.ring is None) != (self.ring is None) or (block.ring_scales is None) != (
            self.ring_scales is None
        ):
            raise KvedgeError(
                f"KV block ring layers do not match this cache (ring layers {list(g.ring_layers)})"
            )
        if block.ring is not None and (
            block.ring.shape != ring or held > count or block.ring.dtype != g.np_dtype
        ):
            raise KvedgeError(
                f"KV block ring {block.ring.shape} {block.ring.dtype} does not fit this cache and a "
                f"{count}-token run (expected {ring[:3]} + (at most {count}, {g.ring_dim}) {g.dtype})"
            )
        end = start + count
        put = self.memory.set
        put(self.pool, slot, slice(start, end), block.kv)
        if self.scales is not None:
            put(self.scales, slot, slice(start, end), block.scales)
        if self.ring is not None:
            kept = min(held, g.ring_len)  # positions end - kept .. end - 1 fit in the ring
            to = np.arange(end - kept, end) % g.ring_len
            put(self.ring, slot, to, block.ring[:, :, :, held - kept :])
            if self.ring_scales is not None:
                put(self.ring_scales, slot, to, block.ring_scales[:, :, :, held - kept :])
            self._ring_written(slot, start, count, held, g.ring_len)

    def _write_packed(self, slot: int, block: KVBlock, start: int, count: int) -> None:
        """`write`'s copies of an int4 cache's block: codes and scales at their positions, the
        window rows the block holds at position modulo window_len (as ring layers')."""
        g, h = self.geometry, self.geometry.num_kv_heads
        expected = [
            (len(layers), 1, h, count, last, dtype) for layers, (dtype, _, last) in g.packed_arrays()[:-2]
        ]
        held = block.ring_count
        found = [(*a.shape, a.dtype) for a in block.parts]
        windows = (g.num_layers, 2, h, held, g.head_dim, np.dtype(np.float32))
        if block.kv is not None or found != expected or block.ring is None:
            raise KvedgeError(
                f"KV block (codes and scales {found}, KV {None if block.kv is None else block.kv.shape}) "
                f"does not fit this int4 cache and a {count}-token run (expected codes and scales "
                f"{expected}, and windows)"
            )
        if (*block.ring.shape, block.ring.dtype) != windows or held > count:
            raise KvedgeError(
                f"KV block windows {block.ring.shape} {block.ring.dtype} do not fit this int4 cache and "
                f"a {count}-token run (expected {windows[:3]} + (at most {count}, {g.head_dim}) float32)"
            )
        end, put = start + count, self.memory.set
        for array, part in zip(self.parts[:-2], block.parts, strict=True):
            put(array, slot, slice(start, end), part)
        kept = min(held, g.window_len)  # positions end - kept .. end - 1 fit in the window ring
        to = np.arange(end - kept, end) % g.window_len
        for kind, array in enumerate(self.parts[-2:]):
            put(array, slot, to, block.ring[:, kind : kind + 1, :, held - kept :])
        self._ring_written(slot, start, count, held, g.window_len)

    def _ring_written(self, slot: int, start: int, count: int, held: int, ring_len: int) -> None:
        """`ring_start` after a block of `count` positions at `start` whose last `held` went into
        rings of `ring_len` positions: the slot's own positions below `start` (ring_start ..
        start - 1) still count where the block's ring covers the whole run, and survive down to
        end - ring_len."""
        end = start + count
        below = min(int(self.ring_start[slot]), start) if held == count else end - held
        self.ring_start[slot] = max(end - ring_len, below)
