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
kvedge_version. A file is used only if its magic, version, size, checksum, fingerprints,
geometry and token ids all match what is expected now; otherwise it is recomputed and rewritten.
Files are written to a temporary name in the same folder, flushed, fsync'ed and renamed, so a
crash mid-write never leaves a file under the final name. Loading memory-maps the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvedge import __version__
from kvedge.contract import KV_SCALE_DTYPE, CacheGeometry
from kvedge.errors import ArtifactMismatch
from kvedge.runtime.cache import KVBlock

log = logging.getLogger(__name__)

MAGIC = b"KVEDGEWM"
WARM_VERSION = 1
SUFFIX = ".kvw"
_PREAMBLE = struct.Struct("<8sII")
_ALIGN = 64
_DIGEST = 32


@dataclass(frozen=True)
class WarmPrefix:
    """A prefix's tokens and KV, as a slot stores them (the arrays may be memory-mapped)."""

    name: str
    token_ids: tuple[int, ...]
    block: KVBlock

    @property
    def nbytes(self) -> int:
        return self.block.nbytes


def _geometry_key(geometry: CacheGeometry) -> dict:
    """The parts of the geometry a prefix's KV depends on (not max_len: only count <= max_len)."""
    key = {
        "num_layers": geometry.num_layers,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "dtype": geometry.dtype,
    }
    if geometry.quantized:
        key["group_size"] = geometry.group_size
    return key


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
        "geometry": _geometry_key(geometry),
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
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < _PREAMBLE.size + _DIGEST:
            raise ArtifactMismatch(f"{path.name}: truncated ({size} bytes)")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    magic, version, header_len = _PREAMBLE.unpack_from(mapped, 0)
    if magic != MAGIC:
        raise ArtifactMismatch(f"{path.name}: not a kvedge warm file (magic {magic!r})")
    if version != WARM_VERSION:
        raise ArtifactMismatch(f"{path.name}: format version {version}, this kvedge reads {WARM_VERSION}")
    start = _PREAMBLE.size + header_len
    if start > size - _DIGEST:
        raise ArtifactMismatch(f"{path.name}: truncated header")
    try:
        header = json.loads(bytes(mapped[_PREAMBLE.size : start]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactMismatch(f"{path.name}: unreadable header ({exc})") from exc
    if size != start + header.get("data_bytes", -1) + _DIGEST:
        raise ArtifactMismatch(
            f"{path.name}: {size} bytes, header promises {start + header.get('data_bytes', 0) + _DIGEST}"
        )
    if hashlib.sha256(mapped[: size - _DIGEST]).digest() != mapped[size - _DIGEST :]:
        raise ArtifactMismatch(f"{path.name}: checksum mismatch (corrupt file)")
    checks = [
        ("model", header.get("model_fingerprint"), model_fingerprint),
        ("scales", header.get("scales_fingerprint"), scales_fingerprint),
        ("cache geometry", header.get("geometry"), _geometry_key(geometry)),
        ("token ids", header.get("token_ids"), list(token_ids)),
    ]
    for what, found, expected in checks:
        if found != expected:
            raise ArtifactMismatch(f"{path.name}: {what} is {_short(found)}, expected {_short(expected)}")
    count = header["count"]
    if count > geometry.max_len:
        raise ArtifactMismatch(f"{path.name}: {count} tokens exceed max_len {geometry.max_len}")
    shape = (geometry.num_layers, 2, geometry.num_kv_heads, count, geometry.head_dim)
    kv = np.frombuffer(mapped, dtype=geometry.np_dtype, count=int(np.prod(shape)), offset=start).reshape(
        shape
    )
    scales = None
    if geometry.quantized:
        scale_shape = (*shape[:-1], geometry.scale_groups)
        scales = np.frombuffer(
            mapped, dtype=KV_SCALE_DTYPE, count=int(np.prod(scale_shape)), offset=start + kv.nbytes
        ).reshape(scale_shape)
    return WarmPrefix(name=header["name"], token_ids=tuple(token_ids), block=KVBlock(kv, scales))


def _short(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return repr(text[:16]) if isinstance(value, str) and len(text) > 16 else text[:80]
