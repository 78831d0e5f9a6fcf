"""Run-time prefixes on disk: the KV of conversations that left memory, kept across restarts.

When a run-time prefix leaves memory (its slot is taken and no `PrefixLRU` keeps it, the LRU
evicts it, or the model closes), `PrefixDisk.save` writes it under `prefix_dir` as a warm file
(`kvedge.runtime.prefix`: same format, fingerprints, checksum, atomic write), named by its
tokens: `<sha256 of the token ids, 24 hex>.kvw`. Files are created mode 0600 (less the umask):
a conversation's KV is as private as its text, and only the service user (configs/kvedge.service,
`User=kvedge`, which owns the folder) reads them back.

Flash wear: a prefix shorter than `min_tokens` is never written, nor one a file already holds
(the same tokens, or a longer run starting with them); a file is written once and never updated.
`bytes_written` counts every byte written.

Budget: the files' bytes stay within `budget_bytes`; the least recently used file (used: written
or loaded; at boot, by modification time) is removed first, and a prefix larger than the whole
budget is not written.

Boot reads the folder's index: each file's header only (magic, version, fingerprints, geometry,
token ids, size), and removes leftovers of writers that died mid-write. A file whose header does
not fit this model is refused, named in one log line and removed. A match is memory-mapped and
checked in full (`read_warm_file`: checksum, fingerprints, token ids, finite values) when a
conversation needs it; a file that fails is refused the same way and the turn prefills cold.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvedge.contract import CacheGeometry
from kvedge.errors import ArtifactMismatch
from kvedge.runtime.cache import KVBlock
from kvedge.runtime.prefix import (
    SUFFIX,
    WarmPrefix,
    read_warm_file,
    read_warm_header,
    remove_stale_temps,
    write_warm_file,
)
from kvedge.runtime.sessions import common_prefix

log = logging.getLogger(__name__)

FILE_MODE = 0o600  # the service user only
FOLDER_MODE = 0o700
MIN_TOKENS = 64  # shorter prefixes cost less to prefill again than to write to flash and read back


@dataclass(frozen=True)
class DiskEntry:
    path: Path
    token_ids: tuple[int, ...]
    ring_from: int  # the ring layers hold positions ring_from .. n - 1 (0 without ring layers)
    nbytes: int


class PrefixDisk:
    """Run-time prefixes as warm files in `folder`, within `budget_bytes` (module docstring)."""

    def __init__(
        self,
        folder: Path,
        budget_bytes: int,
        geometry: CacheGeometry,
        model_fingerprint: str,
        graph_fingerprint: str,
        min_tokens: int = MIN_TOKENS,
    ) -> None:
        self.folder, self.budget_bytes, self.min_tokens = (
            Path(folder),
            budget_bytes,
            min_tokens,
        )  # RunOptions checks
        self.geometry = geometry
        self.model_fingerprint, self.graph_fingerprint = model_fingerprint, graph_fingerprint
        self.entries: OrderedDict[str, DiskEntry] = OrderedDict()  # least recently used first
        self.refused: dict[str, str] = {}  # file name -> why
        self.bytes_written = 0
        self.nbytes = 0  # of the files indexed; kept, not summed: /metrics reads it from another thread
        self.hits = 0
        self.folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        remove_stale_temps(self.folder)
        paths = [p for p in self.folder.glob(f"*{SUFFIX}") if p.is_file()]
        for path in sorted(paths, key=lambda p: p.stat().st_mtime):
            self._index(path)
        self._trim(0)

    def __len__(self) -> int:
        return len(self.entries)

    def best_match(
        self, ids: Sequence[int], usable: Callable[[int, int], int] | None = None
    ) -> tuple[DiskEntry | None, int]:
        """The file sharing the most leading tokens with `ids`, and how many it shares; with
        `usable(ring_from, shared)`, how many of them a turn can use (`Model._usable`)."""
        best, count = None, 0
        for entry in self.entries.values():
            shared = common_prefix(entry.token_ids, ids)
            if usable is not None:
                shared = usable(entry.ring_from, shared)
            if shared > count:
                best, count = entry, shared
        return best, count

    def save(self, token_ids: Sequence[int], block: KVBlock) -> bool:
        """Write `block`, the KV of `token_ids` as a slot holds it, unless it is short, already
        held, or larger than the budget; whether a file was written. A failed write (a full disk)
        is logged and the prefix dropped."""
        ids = tuple(int(t) for t in token_ids)
        if len(ids) < self.min_tokens or block.nbytes > self.budget_bytes:
            return False
        for name, entry in list(self.entries.items()):
            shared = common_prefix(entry.token_ids, ids)
            if shared == len(ids) and entry.ring_from <= len(ids) - block.ring_count:  # held already
                self.entries.move_to_end(name)
                return False
            if shared == len(entry.token_ids):  # the new one extends it
                self._remove(name)
        self._trim(block.nbytes)
        digest = hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:24]
        path = self.folder / f"{digest}{SUFFIX}"
        prefix = WarmPrefix(name=path.stem, token_ids=ids, block=block)
        try:
            write_warm_file(
                path,
                prefix,
                self.geometry,
                self.model_fingerprint,
                graph_fingerprint=self.graph_fingerprint,
                mode=FILE_MODE,
            )
            size = path.stat().st_size
        except OSError as exc:
            log.warning("prefix file %s not written (%s); prefix dropped", path, exc.strerror or exc)
            return False
        self.bytes_written += size
        self._add(DiskEntry(path, ids, len(ids) - block.ring_count, size))
        self._trim(0)
        return True

    def load(self, entry: DiskEntry) -> WarmPrefix | None:
        """The file's prefix, memory-mapped and checked in full; None (the file refused, logged
        and removed) if it fails."""
        try:
            prefix = read_warm_file(
                entry.path,
                self.geometry,
                self.model_fingerprint,
                entry.token_ids,
                graph_fingerprint=self.graph_fingerprint,
            )
        except (ArtifactMismatch, OSError) as exc:
            self._refuse(entry.path, _why(exc))
            return None
        self.entries.move_to_end(entry.path.name)
        self.hits += 1
        return prefix

    def clear(self) -> int:
        """Remove every prefix file; how many there were."""
        count = len(self.entries)
        for name in list(self.entries):
            self._remove(name)
        return count

    def _index(self, path: Path) -> None:
        try:
            header = read_warm_header(path)
        except (ArtifactMismatch, OSError) as exc:
            self._refuse(path, _why(exc))
            return
        key = self.geometry.artifact_key(holds_cache=True)
        mismatch = [
            f"{what} {found!r}, this model's is {wanted!r}"
            for what, found, wanted in (
                ("model", header.model_fingerprint[:16], self.model_fingerprint[:16]),
                ("graph", header.graph_fingerprint[:16], self.graph_fingerprint[:16]),
                ("geometry", header.geometry, key),
            )
            if found != wanted
        ]
        if mismatch or header.count != len(header.token_ids):
            self._refuse(path, "; ".join(mismatch) or "count does not match its token ids")
            return
        self._add(DiskEntry(path, header.token_ids, header.count - header.ring_count, path.stat().st_size))

    def _trim(self, incoming: int) -> None:
        """Remove the least recently used files until `incoming` more bytes fit the budget."""
        while self.entries and self.nbytes + incoming > self.budget_bytes:
            self._remove(next(iter(self.entries)))

    def _add(self, entry: DiskEntry) -> None:
        self.entries[entry.path.name] = entry
        self.nbytes += entry.nbytes

    def _remove(self, name: str) -> None:
        entry = self.entries.pop(name, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            entry.path.unlink(missing_ok=True)

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("prefix file %s refused (%s); removed, the turn prefills instead", path, why)
        self.refused[path.name] = why
        self._remove(path.name)
        path.unlink(missing_ok=True)  # one refused at boot was never indexed


@dataclass(frozen=True)
class PrefixFile:
    """One file of a prefix folder, as `kvedge prefixes list` shows it."""

    name: str
    tokens: int
    nbytes: int
    problem: str | None  # why its header cannot be read, or None


def list_prefix_files(folder: Path) -> list[PrefixFile]:
    """The prefix files in `folder` (headers only), oldest first; none if it does not exist."""
    found = []
    paths = [p for p in Path(folder).glob(f"*{SUFFIX}") if p.is_file()]
    for path in sorted(paths, key=lambda p: p.stat().st_mtime):
        try:
            header, problem = read_warm_header(path), None
        except (ArtifactMismatch, OSError) as exc:
            header, problem = None, _why(exc)
        tokens = 0 if header is None else header.count
        found.append(PrefixFile(path.name, tokens, path.stat().st_size, problem))
    return found


def clear_prefix_files(folder: Path) -> int:
    """Remove every prefix file in `folder` (a running service then prefills those
    conversations); how many there were."""
    paths = [p for p in Path(folder).glob(f"*{SUFFIX}") if p.is_file()]
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def _why(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ArtifactMismatch) else f"cannot read it: {exc.strerror or exc}"
