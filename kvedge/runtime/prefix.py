"""Warm prefixes: the KV of fixed prompts, computed once and kept on disk across reboots.

Warm file (`<name>.kvw`, one per prefix)::

    offset 0   8 bytes   magic b"KVEDGEWM"
               u32 LE    format version (WARM_VERSION)
               u32 LE    header length H
    16         H bytes   JSON header (below), space-padded so the data starts 64-byte aligned
    16+H       N bytes   KV [layers, 2 (K, V), kv_heads, count, head_dim] in the cache dtype, then for
                         int8 caches their scales [layers, 2, kv_heads, count, groups] float16
    16+H+N     32 bytes  sha256 of every byte before it

Header: name, model_fingerprint (source fingerprint from the model manifest), scales_fingerprint
("" for a cache without static scales), geometry (layers, kv heads, head dim, dtype, and the
scale group size for int8), count, token_ids, data_bytes,
kvedge_version (`WarmHeader`; each field's type is checked on load). A file is used only if its
magic, version, size, checksum, fingerprints, geometry and token ids all match what is expected
now (`kvedge.contract.header.check_header`); otherwise it is recomputed and rewritten.
Files are written to a temporary name in the same folder, flushed, fsync'ed and renamed, so a
crash mid-write never leaves a file under the final name. Loading memory-maps the data.

Run-time prefixes (`PrefixLRU`, off unless given a byte budget): when a slot is about to drop at
least one block of tokens for another conversation, what it holds is copied into an arena
allocated once at start-up, so a later conversation starting with the same tokens (the first
user coming back after their slot was taken, a system prompt nobody declared) copies that KV in
like a warm prefix instead of prefilling it. It is exact for the same reason a warm prefix is:
a token's KV depends only on the tokens before it. Layout, B = LRU_BLOCK_TOKENS::

    kv      [layers, 2 (K, V), blocks, kv_heads, B, head_dim]   cache dtype
    scales  [layers, 2, blocks, kv_heads, B, groups]            float16 (int8 caches only)
    blocks  = budget // (B * bytes per token): the arena never exceeds the budget

An entry is a token sequence and the blocks holding it (its block i holds tokens iB..iB+B-1).
Saving evicts the least recently used entries until enough blocks are free (a hit, or saving
tokens an entry already holds, counts as a use); an entry the new one extends is dropped first.
A sequence longer than the whole arena is kept up to what fits: its head is the reusable part.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import stat
import struct
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from kvedge import __version__
from kvedge.contract import KV_SCALE_DTYPE, CacheGeometry
from kvedge.contract.header import Header, check_header, convert, decode_json
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.runtime.cache import KVBlock, KVCache
from kvedge.runtime.sessions import common_prefix

log = logging.getLogger(__name__)

MAGIC = b"KVEDGEWM"
WARM_VERSION = 1
SUFFIX = ".kvw"
_PREAMBLE = struct.Struct("<8sII")
_ALIGN = 64
_DIGEST = 32
LRU_BLOCK_TOKENS = 32  # arena granularity: at most B - 1 tokens of space wasted per entry


@dataclass(frozen=True)
class WarmPrefix:
    """A prefix's tokens and KV, as a slot stores them (the arrays may be memory-mapped)."""

    name: str
    token_ids: tuple[int, ...]
    block: KVBlock

    @property
    def nbytes(self) -> int:
        return self.block.nbytes


@dataclass(frozen=True)
class WarmHeader:
    """A warm file's JSON header (module docstring), typed: loading checks every field's type."""

    name: str
    model_fingerprint: str
    scales_fingerprint: str
    geometry: dict[str, int | str]  # `CacheGeometry.artifact_key(holds_cache=True)`
    count: Annotated[int, msgspec.Meta(ge=0)]
    token_ids: tuple[int, ...]
    data_bytes: Annotated[int, msgspec.Meta(ge=0)]
    kvedge_version: str


def write_warm_file(
    path: Path,
    prefix: WarmPrefix,
    geometry: CacheGeometry,
    model_fingerprint: str,
    scales_fingerprint: str = "",
) -> None:
    """Write `prefix` to `path` atomically (temp file + fsync + rename)."""
    parts = [np.ascontiguousarray(prefix.block.kv, dtype=geometry.np_dtype)]
    if geometry.quantized:
        parts.append(np.ascontiguousarray(prefix.block.scales, dtype=KV_SCALE_DTYPE))
    header = {
        "name": prefix.name,
        "model_fingerprint": model_fingerprint,
        "scales_fingerprint": scales_fingerprint,
        "geometry": geometry.artifact_key(holds_cache=True),
        "count": len(prefix.token_ids),
        "token_ids": list(prefix.token_ids),
        "data_bytes": sum(part.nbytes for part in parts),
        "kvedge_version": __version__,
    }
    raw = json.dumps(header, sort_keys=True).encode()
    raw += b" " * ((-(_PREAMBLE.size + len(raw))) % _ALIGN)
    digest = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            chunks = [_PREAMBLE.pack(MAGIC, WARM_VERSION, len(raw)), raw]
            for chunk in chunks + [memoryview(part).cast("B") for part in parts]:
                digest.update(chunk)
                handle.write(chunk)
            handle.write(digest.digest())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_warm_file(
    path: Path,
    geometry: CacheGeometry,
    model_fingerprint: str,
    token_ids: Sequence[int],
    scales_fingerprint: str = "",
) -> WarmPrefix:
    """Load and verify a warm file; raise ArtifactMismatch naming what is wrong."""
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
    magic, version, header_len = _PREAMBLE.unpack_from(mapped, 0)
    kind = Header(MAGIC.decode(), WARM_VERSION)
    check_header(path.name, Header(magic.decode("latin-1"), version), kind)
    start = _PREAMBLE.size + header_len
    if start > size - _DIGEST:
        raise ArtifactMismatch(f"{path.name}: truncated header")
    header = convert(decode_json(bytes(mapped[_PREAMBLE.size : start]), path.name), WarmHeader, path.name)
    if size != start + header.data_bytes + _DIGEST:
        raise ArtifactMismatch(
            f"{path.name}: {size} bytes, header promises {start + header.data_bytes + _DIGEST}"
        )
    if hashlib.sha256(mapped[: size - _DIGEST]).digest() != mapped[size - _DIGEST :]:
        raise ArtifactMismatch(f"{path.name}: checksum mismatch (corrupt file)")
    made_from = {"scales": header.scales_fingerprint, "token ids": header.token_ids}
    found = Header(kind.format, version, header.model_fingerprint, header.geometry, made_from)
    wanted = {"scales": scales_fingerprint, "token ids": tuple(token_ids)}
    expected = Header(kind.format, WARM_VERSION, model_fingerprint, geometry.artifact_key(True), wanted)
    check_header(path.name, found, expected)
    count = header.count
    if count != len(header.token_ids):
        raise ArtifactMismatch(
            f"{path.name}: count {count} does not match its {len(header.token_ids)} token ids"
        )
    if count > geometry.max_len:
        raise ArtifactMismatch(f"{path.name}: {count} tokens exceed max_len {geometry.max_len}")
    shape = (geometry.num_layers, 2, geometry.num_kv_heads, count, geometry.head_dim)
    needed = count * geometry.bytes_per_token()
    if header.data_bytes != needed:
        raise ArtifactMismatch(f"{path.name}: {header.data_bytes} data bytes, {count} tokens need {needed}")
    kv = np.frombuffer(mapped, dtype=geometry.np_dtype, count=int(np.prod(shape)), offset=start).reshape(
        shape
    )
    scales = None
    if geometry.quantized:
        scale_shape = (*shape[:-1], geometry.scale_groups)
        scales = np.frombuffer(
            mapped, dtype=KV_SCALE_DTYPE, count=int(np.prod(scale_shape)), offset=start + kv.nbytes
        ).reshape(scale_shape)
    return WarmPrefix(name=header.name, token_ids=tuple(token_ids), block=KVBlock(kv, scales))


@dataclass
class LRUEntry:
    key: int
    token_ids: np.ndarray  # [n] int64
    blocks: list[int]  # arena blocks; block i holds tokens i*B .. i*B+B-1


class PrefixLRU:
    """Token sequences seen at run time and their KV, in a preallocated arena under a byte budget
    (layout and policy in the module docstring). A budget of 0 turns it off."""

    def __init__(
        self, geometry: CacheGeometry, budget_bytes: int, block_tokens: int = LRU_BLOCK_TOKENS
    ) -> None:
        self.block_tokens = block_tokens
        self.block_bytes = geometry.bytes_per_token() * block_tokens
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise KvedgeError(f"prefix_cache_bytes={budget_bytes!r} must be an integer >= 0 (0 = off)")
        blocks = budget_bytes // self.block_bytes
        if budget_bytes and not blocks:
            raise KvedgeError(
                f"prefix_cache_bytes={budget_bytes} is less than one block of {block_tokens} tokens "
                f"({self.block_bytes} bytes for this cache); use 0 (off) or at least {self.block_bytes}"
            )
        g = geometry
        shape = (g.num_layers, 2, blocks, g.num_kv_heads, block_tokens, g.head_dim)
        # Written once here so that every page is committed at start-up: first-touch page faults
        # on a request would add ~3 ms per MiB saved (measured, SmolLM2 fp32 geometry).
        self.kv = np.full(shape, 0, g.np_dtype)  # [layers, 2, blocks, kv_heads, B, head_dim]
        self.scales = (  # [layers, 2, blocks, kv_heads, B, groups]
            np.full((*shape[:-1], g.scale_groups), 1, KV_SCALE_DTYPE) if g.quantized else None
        )
        self.free = list(range(blocks - 1, -1, -1))
        self.entries: OrderedDict[int, LRUEntry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self.hits = 0  # conversations that copied tokens in
        self.hit_tokens = 0  # tokens copied in instead of prefilled
        self.evictions = 0  # entries dropped to make room

    @property
    def capacity_blocks(self) -> int:
        return self.kv.shape[2]

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

    def best_match(self, ids: Sequence[int]) -> tuple[LRUEntry | None, int]:
        """The entry sharing the most leading tokens with `ids`, and how many it shares."""
        best, count = None, 0
        for entry in self.entries.values():
            shared = common_prefix(entry.token_ids, ids)
            if shared > count:
                best, count = entry, shared
        return best, count

    def save(self, cache: KVCache, slot: int) -> None:
        """Keep the tokens `slot` holds (as many as the whole arena fits) and their KV."""
        ids = cache.token_ids(slot)[: self.capacity_blocks * self.block_tokens]
        if not len(ids):
            return
        for key, entry in list(self.entries.items()):
            shared = common_prefix(entry.token_ids, ids)
            if shared == len(ids):  # already held, by this entry or one extending it
                self.entries.move_to_end(key)
                return
            if shared == len(entry.token_ids):  # the new sequence extends this entry
                self._drop(key)
        need = -(-len(ids) // self.block_tokens)
        while len(self.free) < need:
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        blocks = [self.free.pop() for _ in range(need)]
        for i, block in enumerate(blocks):
            start = i * self.block_tokens
            n = min(self.block_tokens, len(ids) - start)
            held = cache.view(slot, start, start + n)
            self.kv[:, :, block, :, :n] = held.kv
            if self.scales is not None:
                self.scales[:, :, block, :, :n] = held.scales
        self.entries[self._next_key] = LRUEntry(self._next_key, ids.copy(), blocks)
        self._next_key += 1

    def load(self, cache: KVCache, slot: int, entry: LRUEntry, count: int, start: int = 0) -> None:
        """Make `slot` hold the entry's first `count` tokens, given that it already holds the first
        `start` of them (those are not copied)."""
        if not 0 <= start <= count <= len(entry.token_ids):
            raise KvedgeError(f"cannot load tokens {start}..{count} of a {len(entry.token_ids)}-token entry")
        b = self.block_tokens
        for i in range(start // b, -(-count // b)):
            block = entry.blocks[i]
            lo, hi = max(start, i * b) - i * b, min(count, (i + 1) * b) - i * b
            kv = self.kv[:, :, block, :, lo:hi]
            scales = None if self.scales is None else self.scales[:, :, block, :, lo:hi]
            cache.write(slot, KVBlock(kv, scales), entry.token_ids[i * b + lo : i * b + hi], start=i * b + lo)
        self.entries.move_to_end(entry.key)
        self.hits += 1
        self.hit_tokens += count - start

    def _drop(self, key: int) -> None:
        self.free.extend(reversed(self.entries.pop(key).blocks))
