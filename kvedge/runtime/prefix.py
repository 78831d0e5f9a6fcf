"""Prefixes: the `.kvw` file (a prompt's KV on disk across reboots, for the warm prefixes and the
run-time store's disk tier alike) and the run-time prefix store in memory (`RunTimePrefixStore`).

Warm file (`<name>.kvw`, one per prefix)::

    offset 0   8 bytes   magic b"KVEDGEWM"
               u32 LE    format version (WARM_VERSION)
               u32 LE    header length H
    16         H bytes   JSON header (below), space-padded so the data starts 64-byte aligned
    16+H       N bytes   `KVBlock` arrays in the cache dtype: KV of the full layers (every layer
                         without ring layers) [full layers, 2 (K, V), kv_heads, count, head_dim],
                         then of the ring layers [ring layers, 2, kv_heads, ring_count, ring_dim];
                         for int8 caches then their float16 scales, same order, [..., groups];
                         an int4 cache's instead: its codes and scales, per array of
                         `CacheGeometry.packed_arrays` but the windows [its layers, 1, kv_heads,
                         count, last] (uint8, float16), then its window rows [layers, 2,
                         kv_heads, ring_count, head_dim] float32 (`KVBlock.arrays`, `_layout`);
                         then per-slot states (hybrid models, `CacheGeometry.states`): for each
                         position of `state_at`, each state kind's [state layers, *shape]
    16+H+N     32 bytes  sha256 of every byte before it

Header: name, model_fingerprint (source fingerprint from the model manifest), graph_fingerprint
(the manifest's onnx_fingerprint: the graph that computed the K/V, so an export of the same source
with other weights, another variant or other export code never takes it), scales_fingerprint
("" for a cache without static scales), geometry (layers, kv heads, head dim, dtype, the scale
group size for int8, key8_layers and float_window for int4, and for ring geometries ring_layers,
window and ring_margin), count, ring_count (the ring layers, or an int4 cache's windows, hold the
prefix's last ring_count positions, in position order, so the data do not depend on ring_len; 0
without either), state_at (the positions, counted
from the chain's first token, where the file carries the per-slot states a turn resumes from: its
end always, and earlier snapshots of the slot it came from; empty without states), token_ids,
data_bytes, kvedge_version, and for a run-time prefix's segment (`kvedge.runtime.prefix_disk`)
parent and start (`WarmHeader`; each field's type is checked on load). A file is used only if its
magic, version (an older one is refused as such), size, checksum, fingerprints, geometry (a
different ring layout is named field by field) and token ids all match what is expected now
(`kvedge.contract.header.check_header`), and its K/V (and scales) are finite: a NaN or inf
under a valid checksum was computed or written wrong, and would poison every reply; otherwise it is
recomputed and rewritten. A prefix of a model with per-slot states is usable only up to a position
in `state_at` (`KVCache.resume_limit`): a state cannot be cut back.
The graph is keyed, not the backend that ran it: a TensorRT engine is built from the folder's
graph (`EngineManifest.check_model` refuses any other) and computes the same function, differing
from onnxruntime only in arithmetic precision (as onnxruntime on CPU and on CUDA do), so one
export's warm folder serves all of its devices.
Files are written to a temporary name in the same folder, flushed, fsync'ed and renamed, so a
crash mid-write never leaves a file under the final name. The writer holds an exclusive flock on
its temp file from just after creating it until after the rename, so `remove_stale_temps` (run by
every warm-up) removes a crash's leftovers but never a temp file another process is writing: it
takes only temps it can lock at once and older than STALE_TEMP_AGE_S (the instant between a
writer's create and lock). Loading memory-maps the data.

Run-time prefixes (`RunTimePrefixStore`, off unless given a byte budget): when a slot is about to drop at
least one block of tokens for another conversation, what it holds is copied into an arena
allocated once at start-up, so a later conversation starting with the same tokens (the first
user coming back after their slot was taken, a system prompt nobody declared) copies that KV in
like a warm prefix instead of prefilling it. It is exact for the same reason a warm prefix is:
a token's KV depends only on the tokens before it. Layout, B = RUN_TIME_BLOCK_TOKENS::

    kv      [layers, 2 (K, V), blocks, kv_heads, B, head_dim]   cache dtype
    scales  [layers, 2, blocks, kv_heads, B, groups]            float16 (int8 caches only)
    blocks  = budget // (B * bytes per token): the arena never exceeds the budget

An entry is a token sequence and the blocks holding it (its block i holds tokens iB..iB+B-1).
Saving evicts the least recently used entries until enough blocks are free (a hit, or saving
tokens an entry already holds, counts as a use); an entry the new one extends is dropped first.
A sequence longer than the whole arena is kept up to what fits: its head is the reusable part.

Ring geometries (Gemma 3): the arena holds the full layers as above, and the ring layers in a
second arena indexed by the same blocks, `ring` [ring layers, 2, blocks, kv_heads, B, ring_dim]
(plus `ring_scales`), so block bytes and the budget count every layer. An entry's ring layers
hold only what the slot's rings held when it was saved, positions ring_from .. n - 1 (at most
ring_len), each at its own block offset; the ring part of earlier blocks is unused. A prefix of
m tokens of the entry is usable only where those positions cover what the query at m needs
(`KVCache.ring_limit`, the rewind rule), so a conversation sharing a short head of a long entry
prefills from 0 unless its slot or a warm prefix serves it.

The int4 cache (`CacheGeometry.packed`): one arena [blocks, block bytes] uint8. A block holds B
positions' codes and scales (each array of `KVBlock.parts` for B positions, one after another,
viewed as [its layers, 1, blocks, kv_heads, B, last]) or a piece of one entry's window rows: the
float32 rows of positions ring_from .. n - 1 (at most window_len: what the slot's windows held),
their bytes laid over as many blocks as they need (`RunTimeEntry.windows`). So the budget counts
the windows an entry holds, not a window per block (a window row is ~7x a position's codes);
usable as ring layers' (`KVCache.ring_limit`).

Per-slot states (LFM2): each block has room for one state snapshot, `states[kind]` [state layers,
blocks, *shape], counted in the block's bytes; an entry keeps the states its slot knew
(`KVCache.known_states`) at its latest len(blocks) positions (`RunTimeEntry.state_at`, the i-th in
its block i), and is usable up to one of them (`KVCache.resume_limit`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import mmap
import os
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol, TypeVar

import msgspec
import numpy as np

from kvedge import __version__
from kvedge.contract import KV_SCALE_DTYPE, CacheGeometry
from kvedge.contract.header import Header, check_header, convert, decode_json
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.files import FILE_MODE, new_file
from kvedge.runtime.cache import KVBlock, KVCache, Snapshots
from kvedge.runtime.sessions import common_prefix

log = logging.getLogger(__name__)

MAGIC = b"KVEDGEWM"
# 2: ring geometries store the full layers' KV, then the ring layers' last ring_count positions
# (header field ring_count), which a version-1 reader would size as every layer's
# 3: graph_fingerprint, without which a version-2 file made by another export of the same source
# (float32 vs int4 weights, the same cache) would be taken as this one's
# 4: per-slot states after the KV at the positions of `state_at` (hybrid models), which a
# version-3 reader would neither check nor restore
WARM_VERSION = 4
SUFFIX = ".kvw"
STALE_TEMP_AGE_S = 60.0  # a temp file younger than this may be a writer's not yet locked
_PREAMBLE = struct.Struct("<8sII")
_ALIGN = 64
_DIGEST = 32
RING_FIELDS = ("ring_layers", "window", "ring_margin")  # `CacheGeometry.artifact_key`'s ring layout
RUN_TIME_BLOCK_TOKENS = 32  # arena granularity: at most B - 1 tokens of space wasted per entry


@dataclass(frozen=True)
class WarmPrefix:
    """A prefix's tokens and KV, as a slot stores them (the arrays may be memory-mapped)."""

    name: str
    token_ids: tuple[int, ...]
    block: KVBlock
    parent: str = ""  # a segment's: the file holding the tokens before its first (kvedge.runtime.prefix_disk)
    start: int = 0  # the position of its first token (the parent chain's length)
    # per-slot states (hybrid models) where a turn can resume, at positions start+1 .. its end
    states: Snapshots = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.block.nbytes + sum(a.nbytes for at in self.states.values() for a in at.values())

    @property
    def ring_from(self) -> int:
        """The ring layers hold positions ring_from .. its end."""
        return self.start + self.block.count - self.block.ring_count

    @property
    def state_at(self) -> tuple[int, ...]:
        return tuple(sorted(self.states))


@dataclass(frozen=True)
class WarmHeader:
    """A warm file's JSON header (module docstring), typed: loading checks every field's type."""

    name: str
    model_fingerprint: str
    graph_fingerprint: str
    scales_fingerprint: str
    # `CacheGeometry.artifact_key(holds_cache=True)`: states are lists of [kind, layers, shape, dtype]
    geometry: dict[str, int | str | list[Any]]
    count: Annotated[int, msgspec.Meta(ge=0)]
    ring_count: Annotated[int, msgspec.Meta(ge=0)]
    token_ids: tuple[int, ...]
    state_at: tuple[int, ...]  # positions of the per-slot states carried (hybrid models)
    data_bytes: Annotated[int, msgspec.Meta(ge=0)]
    kvedge_version: str
    # Segments of a run-time prefix (kvedge.runtime.prefix_disk) only; absent from a warm prefix's
    # file, so no version change: only PrefixDisk reads a prefix_dir, and it reads both.
    parent: str = ""
    start: Annotated[int, msgspec.Meta(ge=0)] = 0


@dataclass(frozen=True)
class WarmFile:
    """A warm file's bytes before they are written (`warm_file`): its preamble and header, and
    its data as arrays of its own (copies: the slot they came from may change meanwhile)."""

    head: bytes
    parts: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(part.nbytes for part in self.parts) + _DIGEST


def warm_file(
    prefix: WarmPrefix,
    geometry: CacheGeometry,
    model_fingerprint: str,
    scales_fingerprint: str = "",
    graph_fingerprint: str = "",
) -> WarmFile:
    """`prefix` as the bytes of its warm file (module docstring). `graph_fingerprint` is the graph
    that computed its K/V (`Manifest.onnx_fingerprint`; "" for K/V made by no export)."""
    block, state_at = prefix.block, prefix.state_at
    _check_state_at(prefix.name, geometry, state_at, prefix.start, len(prefix.token_ids))
    layout = _layout(geometry, block.count, block.ring_count)
    if len(block.arrays) != len(layout):
        raise KvedgeError(
            f"warm prefix {prefix.name}: its KV is {len(block.arrays)} arrays, a {geometry.dtype} "
            f"cache's {len(layout)} ({[name for name, _, _ in layout]})"
        )
    parts = [np.array(a, dtype, order="C") for a, (_, _, dtype) in zip(block.arrays, layout, strict=True)]
    for position in state_at:
        parts += [np.array(prefix.states[position][s.kind], s.np_dtype, order="C") for s in geometry.states]
    header = {
        "name": prefix.name,
        "model_fingerprint": model_fingerprint,
        "graph_fingerprint": graph_fingerprint,
        "scales_fingerprint": scales_fingerprint,
        "geometry": geometry.artifact_key(holds_cache=True),
        "count": len(prefix.token_ids),
        "ring_count": block.ring_count,
        "token_ids": list(prefix.token_ids),
        "state_at": list(state_at),
        "data_bytes": sum(part.nbytes for part in parts),
        "kvedge_version": __version__,
    }
    if prefix.parent or prefix.start:
        header.update(parent=prefix.parent, start=prefix.start)
    raw = json.dumps(header, sort_keys=True).encode()
    raw += b" " * ((-(_PREAMBLE.size + len(raw))) % _ALIGN)
    return WarmFile(_PREAMBLE.pack(MAGIC, WARM_VERSION, len(raw)) + raw, tuple(parts))


def write_warm_file(
    path: Path,
    prefix: WarmPrefix,
    geometry: CacheGeometry,
    model_fingerprint: str,
    scales_fingerprint: str = "",
    graph_fingerprint: str = "",
    mode: int = FILE_MODE,
) -> None:
    """Write `prefix` to `path` (`warm_file`, `save_warm_file`)."""
    file = warm_file(prefix, geometry, model_fingerprint, scales_fingerprint, graph_fingerprint)
    save_warm_file(path, file, mode)


def save_warm_file(path: Path, file: WarmFile, mode: int = FILE_MODE) -> os.stat_result:
    """Write `file` to `path` atomically (temp file + fsync + rename), with `mode` less the umask;
    the written file's status."""
    digest = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_file(path.parent, f".{path.name}.", ".tmp", mode)  # 0666: the service user reads it
    try:
        with os.fdopen(fd, "wb") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # until renamed: see remove_stale_temps
            for chunk in [file.head] + [memoryview(part).cast("B") for part in file.parts]:
                digest.update(chunk)
                handle.write(chunk)
            handle.write(digest.digest())
            handle.flush()
            os.fsync(handle.fileno())
            status = os.fstat(handle.fileno())
            os.replace(tmp, path)  # before close drops the lock
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return status


def read_warm_file(
    path: Path,
    geometry: CacheGeometry,
    model_fingerprint: str,
    token_ids: Sequence[int],
    scales_fingerprint: str = "",
    graph_fingerprint: str = "",
    parent: str = "",
    start: int = 0,
    checked: set[FileIdentity] | None = None,
) -> WarmPrefix:
    """Load and verify a warm file made by the graph `graph_fingerprint` (as `write_warm_file`;
    a segment: of `token_ids` from position `start` on, after the file `parent`); raise
    ArtifactMismatch naming what is wrong. `checked`: the identities of files this process has
    checked in full (or written) and that are unchanged since (`file_identity`); such a file's
    header is checked again, its data are not hashed or scanned again. A file checked in full here
    is added to it."""
    mapped, status = _map(path)
    size, identity = status.st_size, file_identity(status)
    header, offset = _header(path, mapped, size)
    kind, version = Header(MAGIC.decode(), WARM_VERSION), WARM_VERSION
    known = checked is not None and identity in checked
    if not known:
        with memoryview(mapped) as whole:  # hashed where it lies: a slice of the mmap would copy it
            digest = hashlib.sha256(whole[: size - _DIGEST]).digest()
        if digest != mapped[size - _DIGEST :]:
            raise ArtifactMismatch(f"{path.name}: checksum mismatch (corrupt file)")
    key = geometry.artifact_key(True)
    for field in RING_FIELDS:  # named one by one: the whole geometry would be cut short in the message
        if header.geometry.get(field) != key.get(field):
            raise ArtifactMismatch(
                f"{path.name}: ring layout {field} is {header.geometry.get(field)!r}, this cache has "
                f"{key.get(field)!r} (made for another model layout)"
            )
    made_from = {"scales": header.scales_fingerprint, "token ids": header.token_ids}
    made_from.update(parent=header.parent, start=header.start)
    found = Header(kind.format, version, header.model_fingerprint, header.geometry, made_from)
    wanted = {"scales": scales_fingerprint, "token ids": tuple(token_ids), "parent": parent, "start": start}
    expected = Header(kind.format, WARM_VERSION, model_fingerprint, key, wanted)
    check_header(path.name, found, expected)
    if header.graph_fingerprint != graph_fingerprint:  # same source and cache: another export's K/V
        raise ArtifactMismatch(
            f"{path.name}: made by graph {_graph(header.graph_fingerprint)}, this model's graph is "
            f"{_graph(graph_fingerprint)} (another export of the same model: other weights, variant "
            "or export code)"
        )
    count, held = header.count, header.ring_count
    if count != len(header.token_ids):
        raise ArtifactMismatch(
            f"{path.name}: count {count} does not match its {len(header.token_ids)} token ids"
        )
    if header.start + count > geometry.max_len:
        raise ArtifactMismatch(
            f"{path.name}: {count} tokens from position {header.start} exceed max_len {geometry.max_len}"
        )
    if held > (count if geometry.ring_layers or geometry.packed else 0):
        raise ArtifactMismatch(
            f"{path.name}: ring_count {held} must be 0 without ring layers or int4 windows, at most "
            f"count {count} with them"
        )
    _check_state_at(path.name, geometry, header.state_at, header.start, count, ArtifactMismatch)
    kv_bytes = geometry.block_bytes(count, held)
    needed = kv_bytes + len(header.state_at) * geometry.state_bytes_per_slot()
    if header.data_bytes != needed:
        raise ArtifactMismatch(
            f"{path.name}: {header.data_bytes} data bytes, {count} tokens need {needed}"
            + (f" ({held} positions in the ring layers)" if geometry.ring_layers else "")
            + (f" ({held} positions in the int4 windows)" if geometry.packed else "")
            + (f" (states at {len(header.state_at)} positions)" if geometry.states else "")
        )
    arrays = _arrays(mapped, geometry, offset, count, held)
    states = _states(mapped, geometry, offset + kv_bytes, header.state_at)
    if not known:
        carried = ((f"state {kind} at {p}", a) for p, at in states.items() for kind, a in at.items())
        _check_finite(path, [*arrays, *carried])
    if checked is not None:
        checked.add(identity)
    fields = {name: array for name, array in arrays if name != "parts"}
    block = KVBlock(fields.pop("kv", None), parts=tuple(a for name, a in arrays if name == "parts"), **fields)
    return WarmPrefix(header.name, tuple(token_ids), block, header.parent, header.start, states)


def _check_finite(path: Path, arrays: Iterable[tuple[str, np.ndarray]]) -> None:
    """Refuse a file whose float arrays hold a NaN or inf (checked layer by layer: the temporary
    stays small)."""
    for name, array in arrays:
        if array.dtype.kind == "f" and not all(np.isfinite(layer).all() for layer in array):
            raise ArtifactMismatch(
                f"{path.name}: non-finite values in its K/V {name!r} array (NaN or inf under a valid "
                "checksum: computed wrong, not damaged on disk); allowed: finite numbers only"
            )


def _check_state_at(
    where: str,
    geometry: CacheGeometry,
    state_at: Sequence[int],
    start: int,
    count: int,
    error: type[Exception] = KvedgeError,
) -> None:
    """Refuse state positions that are not increasing within start+1 .. start+count with the end
    among them (every stored prefix of a model with per-slot states ends where they are known),
    or any without states."""
    end = start + count
    if not geometry.states:
        if state_at:
            raise error(f"{where}: states at {list(state_at)}, and this cache holds none")
        return
    if list(state_at) != sorted(set(state_at)) or not state_at or state_at[0] <= start or state_at[-1] != end:
        raise error(
            f"{where}: states at {list(state_at)}; a prefix of positions {start}..{end - 1} carries "
            f"them at increasing positions from {start + 1} to {end}, {end} included"
        )


def read_warm_header(path: Path) -> WarmHeader:
    """A warm file's header, checked as far as the header alone allows (magic, version, field
    types, file size), without reading its data: `read_warm_file` checks the rest."""
    mapped, status = _map(path)
    try:
        return _header(path, mapped, status.st_size)[0]
    finally:
        mapped.close()


def _header(path: Path, mapped: mmap.mmap, size: int) -> tuple[WarmHeader, int]:
    """The header of the warm file mapped at `mapped` and where its data start."""
    magic, version, header_len = _PREAMBLE.unpack_from(mapped, 0)
    check_header(path.name, Header(magic.decode("latin-1"), version), Header(MAGIC.decode(), WARM_VERSION))
    start = _PREAMBLE.size + header_len
    if start > size - _DIGEST:
        raise ArtifactMismatch(f"{path.name}: truncated header")
    header = convert(decode_json(bytes(mapped[_PREAMBLE.size : start]), path.name), WarmHeader, path.name)
    if size != start + header.data_bytes + _DIGEST:
        raise ArtifactMismatch(
            f"{path.name}: {size} bytes, header promises {start + header.data_bytes + _DIGEST}"
        )
    return header, start


def remove_stale_temps(folder: Path, min_age_s: float = STALE_TEMP_AGE_S) -> None:
    """Remove the temp files in `folder` that writers (`write_warm_file`) left when they died
    mid-write: those nobody holds locked and last written over `min_age_s` ago."""
    for stale in folder.glob(f".*{SUFFIX}.*.tmp"):
        try:
            fd = os.open(stale, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:  # renamed into place since the glob
            continue
        except OSError as exc:
            log.warning("cannot remove %s: %s", stale, exc.strerror or exc)
            continue
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or time.time() - status.st_mtime < min_age_s:
                continue  # not a temp file of ours, or maybe created but not locked yet
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live writer
                continue
            stale.unlink(missing_ok=True)  # missing: its writer renamed it and let go
        except OSError as exc:
            log.warning("cannot remove %s: %s", stale, exc.strerror or exc)
        finally:
            os.close(fd)


FileIdentity = tuple[int, int, int, int]  # device, inode, size, modification time (ns)


def file_identity(status: os.stat_result) -> FileIdentity:
    """What changes when a file is replaced or written to (`read_warm_file`'s `checked`)."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _map(path: Path) -> tuple[mmap.mmap, os.stat_result]:
    """`path` mapped read-only, and its status; a file too short for a preamble and digest is refused."""
    # Non-blocking, and checked on the open file itself: a FIFO or device swapped in after the
    # folder scan neither blocks start-up nor is read.
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ArtifactMismatch(f"{path.name}: not a regular file")
        size = status.st_size
        if size < _PREAMBLE.size + _DIGEST:
            raise ArtifactMismatch(f"{path.name}: truncated ({size} bytes)")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return mapped, status


def _layout(geometry: CacheGeometry, count: int, held: int) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """The arrays of a warm file's data, in order (`KVBlock.arrays`), of a block of `count`
    positions whose ring layers (int4: windows) hold the last `held`: (`KVBlock` field, shape,
    dtype). Every layout but the int4 cache's is version 2's (module docstring)."""
    g, h, scale = geometry, geometry.num_kv_heads, np.dtype(KV_SCALE_DTYPE)
    if g.packed:  # codes and scales [layers, 1, kvh, count, last] per array, then the windows
        *codes, _, (_, (window, _, _)) = g.packed_arrays()
        layout = [("parts", (len(layers), 1, h, count, last), dtype) for layers, (dtype, _, last) in codes]
        return [*layout, ("ring", (g.num_layers, 2, h, held, g.head_dim), window)]
    layout = [("kv", (len(g.full_layers), 2, h, count, g.head_dim), g.np_dtype)]
    if g.ring_layers:
        layout.append(("ring", (len(g.ring_layers), 2, h, held, g.ring_dim), g.np_dtype))
    if g.quantized:
        layout.append(("scales", (len(g.full_layers), 2, h, count, g.scale_groups), scale))
        if g.ring_layers:
            layout.append(("ring_scales", (len(g.ring_layers), 2, h, held, g.ring_scale_groups), scale))
    return layout


def _arrays(
    mapped: mmap.mmap, geometry: CacheGeometry, start: int, count: int, held: int
) -> list[tuple[str, np.ndarray]]:
    """The arrays of a warm file's data (`_layout`), views of `mapped` from `start`, each with its
    `KVBlock` field."""
    offset, arrays = start, []
    for name, shape, dtype in _layout(geometry, count, held):
        array = np.frombuffer(mapped, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        arrays.append((name, array))
        offset += array.nbytes
    return arrays


def _states(mapped: mmap.mmap, geometry: CacheGeometry, start: int, state_at: Sequence[int]) -> Snapshots:
    """The per-slot states of a warm file's data from `start` (views of `mapped`): {position:
    {kind: [state layers, *shape]}}."""
    states, offset = {}, start
    for position in state_at:
        states[position] = {}
        for spec in geometry.states:
            shape = (len(spec.layers), *spec.shape)
            array = np.frombuffer(mapped, spec.np_dtype, int(np.prod(shape)), offset).reshape(shape)
            states[position][spec.kind] = array
            offset += array.nbytes
    return states


def _graph(fingerprint: str) -> str:
    return repr(fingerprint[:16]) if fingerprint else "none (K/V made by no export)"


@dataclass
class RunTimeEntry:
    key: int
    token_ids: np.ndarray  # [n] int64
    blocks: list[int]  # arena blocks; block i holds tokens i*B .. i*B+B-1
    ring_from: int = 0  # the ring layers hold positions ring_from .. n - 1 (0 without rings)
    state_at: tuple[int, ...] = ()  # positions of the states it carries; the i-th in its block i
    windows: list[int] = dataclasses.field(default_factory=list)  # int4: blocks of its window rows


class Stored(Protocol):
    """A stored prefix as matching sees it: RunTimeEntry, prefix_disk.DiskEntry, WarmPrefix."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def ring_from(self) -> int: ...  # the ring layers hold positions ring_from .. its end
    @property
    def state_at(self) -> tuple[int, ...]: ...  # where it carries per-slot states


E = TypeVar("E", bound=Stored)
Usable = Callable[[Stored, int], int]  # (a stored prefix, tokens it shares) -> how many a turn can use


def best_entry(
    entries: Iterable[E], ids: Sequence[int], usable: Usable | None = None
) -> tuple[E | None, int]:
    """Of stored prefixes `entries`, the one sharing the most leading tokens with `ids` (the
    first on a tie), and how many it shares; with `usable(entry, shared)`, how many of them a
    turn can use (`Model._usable`)."""
    best, count = None, 0
    for entry in entries:
        shared = common_prefix(entry.token_ids, ids)
        if usable is not None:
            shared = usable(entry, shared)
        if shared > count:
            best, count = entry, shared
    return best, count


class RunTimePrefixStore:
    """Token sequences seen at run time and their KV, in a preallocated arena under a byte budget
    (layout and policy in the module docstring). A budget of 0 turns it off."""

    def __init__(
        self,
        geometry: CacheGeometry,
        budget_bytes: int,
        block_tokens: int = RUN_TIME_BLOCK_TOKENS,
        spill: Callable[[np.ndarray, KVBlock, Snapshots], object] | None = None,
    ) -> None:
        """`spill(token_ids, block, states)`, if given, is handed each entry evicted to make room
        (the disk tier, `kvedge.runtime.prefix_disk`)."""
        self.block_tokens = block_tokens
        self.spill = spill
        self.geometry = geometry
        # a block's KV, and room for one snapshot of the per-slot states (hybrid models)
        self.block_bytes = geometry.bytes_per_token() * block_tokens + geometry.state_bytes_per_slot()
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise KvedgeError(f"prefix_cache_bytes={budget_bytes!r} must be an integer >= 0 (0 = off)")
        blocks = budget_bytes // self.block_bytes
        if budget_bytes and not blocks:
            raise KvedgeError(
                f"prefix_cache_bytes={budget_bytes} is less than one block of {block_tokens} tokens "
                f"({self.block_bytes} bytes for this cache); use 0 (off) or at least {self.block_bytes}"
            )
        g = geometry
        self.capacity_blocks = blocks
        self.window_blocks = 0  # blocks an int4 entry's window rows take at most
        if g.packed:
            self.window_blocks = -(-g.window_bytes(g.window_len) // g.block_bytes(block_tokens, 0))
            if budget_bytes and blocks <= self.window_blocks:
                least = (self.window_blocks + 1) * self.block_bytes
                raise KvedgeError(
                    f"prefix_cache_bytes={budget_bytes} does not hold one block of {block_tokens} "
                    f"tokens and an int4 cache's window rows ({least} bytes); use 0 (off) or at least {least}"
                )

        def arena(layers: int, last: int, dtype: np.dtype, fill: int) -> np.ndarray | None:
            # Written once here so that every page is committed at start-up, not by first-touch
            # page faults on a request's path (docs/PERFORMANCE.md, "Allocation").
            if not last or g.packed:  # scales of a float cache; an int4 cache's are `codes`
                return None
            return np.full((layers, 2, blocks, g.num_kv_heads, block_tokens, last), fill, dtype)

        scale = np.dtype(KV_SCALE_DTYPE)
        self.kv = arena(len(g.full_layers), g.head_dim, g.np_dtype, 0)  # [full layers, 2, blocks, kvh, B, d]
        self.scales = arena(len(g.full_layers), g.scale_groups, scale, 1)  # [..., B, groups] (int8)
        self.arena, self.codes = self._packed_arena(g, blocks) if g.packed else (None, [])
        self.ring = self.ring_scales = None
        if g.ring_layers:
            self.ring = arena(
                len(g.ring_layers), g.ring_dim, g.np_dtype, 0
            )  # [ring layers, 2, blocks, kvh, B, ring_dim]
            self.ring_scales = arena(len(g.ring_layers), g.ring_scale_groups, scale, 1)  # [..., B, groups]
        # {kind: [state layers, blocks, *shape]}: one snapshot per block (hybrid models)
        self.states = {s.kind: np.full((len(s.layers), blocks, *s.shape), 0, s.np_dtype) for s in g.states}
        self.free = list(range(blocks - 1, -1, -1))
        self.entries: OrderedDict[int, RunTimeEntry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self.hits = 0  # conversations that copied tokens in
        self.hit_tokens = 0  # tokens copied in instead of prefilled
        self.evictions = 0  # entries dropped to make room

    def _packed_arena(self, g: CacheGeometry, blocks: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """An int4 cache's arena [blocks, block bytes] uint8, and its views as the codes and scales
        of `KVBlock.parts`, each [its layers, 1, blocks, kv_heads, B, last] (module docstring)."""
        b = self.block_tokens
        arena = np.zeros((blocks, g.block_bytes(b, 0)), np.uint8)
        codes, offset = [], 0
        for layers, (dtype, _, last) in g.packed_arrays()[:-2]:
            shape = (len(layers), 1, g.num_kv_heads, b, last)
            size = int(np.prod(shape)) * dtype.itemsize
            view = arena[:, offset : offset + size].view(dtype).reshape(blocks, *shape)
            codes.append(view.transpose(1, 2, 0, 3, 4, 5))
            offset += size
        return arena, codes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of arena in use by entries (<= capacity_bytes <= the budget)."""
        return (self.capacity_blocks - len(self.free)) * self.block_bytes

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return self.capacity_blocks > 0

    def best_match(self, ids: Sequence[int], usable: Usable | None = None) -> tuple[RunTimeEntry | None, int]:
        """The entry sharing the most leading tokens with `ids`, and how many it shares; with
        `usable(entry, shared)`, how many of them a turn can use (`Model._usable`)."""
        return best_entry(self.entries.values(), ids, usable)

    def save(self, cache: KVCache, slot: int) -> None:
        """Keep the tokens `slot` holds (as many as the whole arena fits) and their KV."""
        ids = cache.token_ids(slot)[: (self.capacity_blocks - self.window_blocks) * self.block_tokens]
        if not len(ids):
            return
        # the slot's rings (an int4 cache's windows) hold ring_start .. length - 1 (every position
        # without rings)
        rings = self.ring is not None or self.arena is not None
        ring_from = min(int(cache.ring_start[slot]), len(ids)) if rings else 0
        need = -(-len(ids) // self.block_tokens)
        windows = self._window_blocks(len(ids) - ring_from)
        known = cache.known_states(slot, len(ids))
        state_at = tuple(sorted(known)[-need:])  # one per block, the latest
        if self.states and not state_at:
            return  # no position it could be resumed from
        for key, entry in list(self.entries.items()):
            shared = common_prefix(entry.token_ids, ids)
            if shared == len(ids) and entry.ring_from <= ring_from and set(state_at) <= set(entry.state_at):
                self.entries.move_to_end(key)  # already held (rings and states too)
                return
            extended = ring_from <= entry.ring_from and set(entry.state_at) <= set(state_at)
            if shared == len(entry.token_ids) and extended:
                self._drop(key)
        while len(self.free) < need + windows:
            oldest = next(iter(self.entries.values()))
            if self.spill is not None:
                self.spill(oldest.token_ids, self.block(oldest), self.snapshots(oldest))
            self._drop(oldest.key)
            self.evictions += 1
        blocks = [self.free.pop() for _ in range(need)]
        rows = [self.free.pop() for _ in range(windows)]
        if self.arena is not None:
            self._save_packed(cache.view(slot, 0, len(ids)), blocks, rows)
        else:
            self._save_blocks(cache, slot, len(ids), blocks)
        for block, position in zip(blocks, state_at, strict=False):
            for kind, arena in self.states.items():
                arena[:, block] = known[position][kind]
        entry = RunTimeEntry(self._next_key, ids.copy(), blocks, ring_from, state_at, rows)
        self.entries[self._next_key] = entry
        self._next_key += 1

    def _save_blocks(self, cache: KVCache, slot: int, count: int, blocks: list[int]) -> None:
        """The first `count` positions of `slot` into `blocks`, B at a time (caches with a pool)."""
        for i, block in enumerate(blocks):
            start = i * self.block_tokens
            n = min(self.block_tokens, count - start)
            held = cache.view(slot, start, start + n)
            self.kv[:, :, block, :, :n] = held.kv
            if self.scales is not None:
                self.scales[:, :, block, :, :n] = held.scales
            if self.ring is not None:  # the positions of this block the rings held, at their offsets
                self.ring[:, :, block, :, n - held.ring_count : n] = held.ring
                if self.ring_scales is not None:
                    self.ring_scales[:, :, block, :, n - held.ring_count : n] = held.ring_scales

    def _window_blocks(self, rows: int) -> int:
        """Blocks `rows` positions of an int4 cache's window rows take (0 for other caches)."""
        if self.arena is None:
            return 0
        return -(-self.geometry.window_bytes(rows) // self.arena.shape[1])

    def _save_packed(self, whole: KVBlock, blocks: list[int], rows: list[int]) -> None:
        """An int4 slot's run (`whole`: its codes and scales, and its window rows) into `blocks`
        and the window rows' bytes into `rows`, one block's bytes after another."""
        b = self.block_tokens
        for i, block in enumerate(blocks):
            for arena, part in zip(self.codes, whole.parts, strict=True):
                piece = part[:, :, :, i * b : (i + 1) * b]
                arena[:, :, block, :, : piece.shape[3]] = piece
        data = np.frombuffer(np.ascontiguousarray(whole.ring).data, np.uint8)
        size = self.arena.shape[1]
        for j, block in enumerate(rows):
            chunk = data[j * size : (j + 1) * size]
            self.arena[block, : len(chunk)] = chunk

    def _windows(self, entry: RunTimeEntry) -> np.ndarray:
        """An int4 entry's window rows, positions ring_from .. n - 1: [layers, 2, kv_heads, r,
        head_dim] float32 (a copy)."""
        g, r = self.geometry, len(entry.token_ids) - entry.ring_from
        shape = (g.num_layers, 2, g.num_kv_heads, r, g.head_dim)
        data = self.arena[entry.windows].reshape(-1)[: g.window_bytes(r)]
        return data.view(np.float32).reshape(shape).copy()

    def load(self, cache: KVCache, slot: int, entry: RunTimeEntry, count: int, start: int = 0) -> None:
        """Make `slot` hold the entry's first `count` tokens, given that it already holds the first
        `start` of them (those are not copied, unless the slot's rings lack positions below
        `start` that the entry holds and the next query needs: then all are). With per-slot
        states, `count` must be one of `entry.state_at`: the slot resumes from its states there."""
        if not 0 <= start <= count <= len(entry.token_ids):
            raise KvedgeError(f"cannot load tokens {start}..{count} of a {len(entry.token_ids)}-token entry")
        if self.states:  # the last token at least: its piece carries the states the slot resumes from
            start = min(start, count - 1)
        self._copy(cache, slot, entry, count, start)
        if start and cache.rewind_limit(slot, count) != count:
            self._copy(cache, slot, entry, count, 0)
        self.entries.move_to_end(entry.key)
        self.hits += 1
        self.hit_tokens += count - start

    def _copy(self, cache: KVCache, slot: int, entry: RunTimeEntry, count: int, start: int) -> None:
        b = self.block_tokens
        last = -(-count // b) - 1
        windows = None if self.arena is None else self._windows(entry)  # positions ring_from ..
        for i in range(start // b, last + 1):
            block = entry.blocks[i]
            lo, hi = max(start, i * b) - i * b, min(count, (i + 1) * b) - i * b
            held = slice(min(max(lo, entry.ring_from - i * b), hi), hi)  # the ring positions it holds
            if windows is not None:  # int4: codes and scales, and the window rows of lo..hi
                rows = slice(held.start + i * b - entry.ring_from, hi + i * b - entry.ring_from)
                parts = tuple(arena[:, :, block, :, lo:hi] for arena in self.codes)
                piece = KVBlock(None, ring=windows[:, :, :, rows], parts=parts)
            else:
                kv = self.kv[:, :, block, :, lo:hi]
                scales = None if self.scales is None else self.scales[:, :, block, :, lo:hi]
                ring = None if self.ring is None else self.ring[:, :, block, :, held]
                ring_scales = None if self.ring_scales is None else self.ring_scales[:, :, block, :, held]
                piece = KVBlock(kv, scales, ring, ring_scales)
            states = self.snapshots(entry, count) if i == last else None  # the slot resumes at count
            cache.write(slot, piece, entry.token_ids[i * b + lo : i * b + hi], i * b + lo, states)

    def block(self, entry: RunTimeEntry) -> KVBlock:
        """A copy of the entry's KV as a slot stores it: the ring layers hold positions
        ring_from .. n - 1."""
        b, n = self.block_tokens, len(entry.token_ids)

        def gather(arena: np.ndarray | None, first: int = 0) -> np.ndarray | None:
            if arena is None:
                return None
            runs = [
                arena[:, :, block, :, max(first - i * b, 0) : min(n - i * b, b)]
                for i, block in enumerate(entry.blocks)
                if first < (i + 1) * b
            ]
            return np.concatenate(runs or [arena[:, :, 0, :, :0]], axis=3)  # [layers, 2, kvh, tokens, d]

        first = entry.ring_from
        if self.arena is not None:
            return KVBlock(None, ring=self._windows(entry), parts=tuple(gather(a) for a in self.codes))
        return KVBlock(
            gather(self.kv), gather(self.scales), gather(self.ring, first), gather(self.ring_scales, first)
        )

    def snapshots(self, entry: RunTimeEntry, upto: int | None = None) -> dict[int, dict[str, np.ndarray]]:
        """Copies of the states the entry carries, at its positions up to `upto` (all without)."""
        return {
            position: {kind: arena[:, block].copy() for kind, arena in self.states.items()}
            for block, position in zip(entry.blocks, entry.state_at, strict=False)
            if upto is None or position <= upto
        }

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.free.extend(reversed(entry.blocks + entry.windows))
