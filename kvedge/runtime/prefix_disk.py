"""Run-time prefixes on disk: the KV of conversations, kept across restarts (kill -9 included).

Files are warm files (`kvedge.runtime.prefix`: same format, fingerprints, checksum, atomic
write) in the export's own subfolder of `prefix_dir` (`export_folder`: the first 16 hex digits of
its graph fingerprint, `Manifest.onnx_fingerprint`), named by their tokens:
`prefix_dir/<graph, 16 hex>/<sha256 of the token ids, 24 hex>.kvw`, mode 0600 and the subfolder
0700 (less the umask): a conversation's KV is as private as its text, and only the service user
(configs/kvedge.service, `User=kvedge`, which owns the folder) reads them back. Exports sharing a
prefix_dir (two models, or a model and its re-export) each keep their own subfolder: an export
never reads, refuses or removes a file outside its own.

Segments (caches without ring layers): a conversation is a chain of files, each holding the KV of
the tokens after its `parent`'s (header fields `parent`, `start`; its `token_ids` are its own).
When a turn ends, its prompt past the chain's last file it extends is written (the previous reply
as the template renders it, and the new question), then its reply as generated, as a file after
it. Where the template renders the reply as it was generated (the usual case), the next turn's
prompt follows the reply's file and a restart reuses the whole conversation; where it tokenizes
otherwise, the next prompt's file follows the prompt's and the reply's is left unused, for the
budget to drop. So each token's KV is written once (the reply's twice where it re-tokenizes), and
a process killed at any moment loses at most the turn in flight. An edited or regenerated
conversation branches from the longest chain it extends. A prefix that leaves memory (its slot is
taken, the LRU evicts it, the model closes) is written the same way, if not yet held.
Ring geometries (Gemma 3) and the int4 cache keep each prefix as one file, written when it leaves
memory: a ring layer's (an int4 window's) part of a segment would need positions before its
start. With per-slot states (LFM2) each file ends where the slot's states are known (the end of
a prompt, of a reply, of what the slot held) and carries them there and at the slot's snapshots
inside it (header `state_at`), so a conversation resumes from the latest one its chain carries at
or before what it shares.

Writing: `save` copies the KV out of the slot and queues the file for one writer thread
(`FileWriter`: atomic write, fsync, rename), so the scheduler never waits on the disk, only for a
copy (docs/PERFORMANCE.md, "A conversation after a restart", has both times). The index counts a
queued file at once; a conversation that needs one still queued waits for it; a write that fails (a
full disk) is logged and its prefix dropped, with the segments after it. A process killed with
files queued loses them; the service sends a reply's end only once they are written
(`wait_written`, on that request's worker thread), so what kill -9 can lose is the turn in flight.
The copies queued are bounded (`queue_bytes`: one slot's KV at max_len, counted by the service's
memory plan): a turn that ends while the writer is that far behind queues nothing (`deferred`);
its tokens go into the next file its conversation writes, which starts after the last one held.
A prefix leaving memory (nothing else will hold it) waits for the writer instead.

Flash wear: a prefix shorter than `min_tokens` is never written, nor one a file already holds;
files are never rewritten. `bytes_written` counts every byte written.

Budget: the bytes of the files in the export's subfolder stay within `budget_bytes` (each export
sharing a prefix_dir has its own); the least recently used file goes first with every segment
after it (using a file uses its chain's files, the root last, so a chain's tail goes before its
head). A segment larger than the whole budget is not written.

Boot reads the subfolder's index: each file's header only (magic, version, fingerprints,
geometry, token ids, parent, size), and removes leftovers of writers that died mid-write. A file
there whose header does not fit this model (one copied in from another export's subfolder), or
whose parent is missing, is refused, named in one log line and removed (with the segments after
it). Then a background thread (`check_ahead`; a service lowers it to nice 19 when it turns ready,
`yield_cpu`) checks every file in full (`read_warm_file`: checksum, fingerprints, token ids,
finite values), most recently used first: a
conversation resumed after a restart copies its files in without hashing them, and after a
reboot they are read from flash before it asks. A check holds for the file's identity (device,
inode, size, modification time): a file written to since, or one not checked yet, is checked in
full when a conversation needs it; a file that fails is refused the same way and the turn
prefills cold. Files this process wrote count as checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvedge.contract import CacheGeometry
from kvedge.errors import ArtifactMismatch
from kvedge.runtime.cache import KVBlock, Snapshots
from kvedge.runtime.prefix import (
    SUFFIX,
    FileIdentity,
    Usable,
    WarmFile,
    WarmHeader,
    WarmPrefix,
    best_entry,
    file_identity,
    read_warm_file,
    read_warm_header,
    remove_stale_temps,
    save_warm_file,
    warm_file,
)
from kvedge.runtime.sessions import common_prefix

log = logging.getLogger(__name__)

FILE_MODE = 0o600  # the service user only
FOLDER_MODE = 0o700
MIN_TOKENS = 64  # shorter prefixes cost less to prefill again than to write to flash and read back


def export_folder(prefix_dir: Path, graph_fingerprint: str) -> Path:
    """The subfolder of `prefix_dir` holding the files of the export whose graph fingerprint
    (`Manifest.onnx_fingerprint`) is `graph_fingerprint`: named by its first 16 hex digits."""
    return Path(prefix_dir) / graph_fingerprint[:16]


@dataclass(frozen=True)
class DiskEntry:
    path: Path
    token_ids: tuple[int, ...]  # every token of the chain up to and including this file's
    ring_from: int  # the ring layers hold positions ring_from .. n - 1 (0 without ring layers)
    nbytes: int
    parent: str = ""  # the file before this segment ("" for the first)
    start: int = 0  # position of this file's first token
    state_at: tuple[int, ...] = ()  # where the chain up to this file carries per-slot states


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
        self.segments = not geometry.ring_layers and not geometry.packed
        self.entries: OrderedDict[str, DiskEntry] = OrderedDict()  # least recently used first
        self.refused: dict[str, str] = {}  # file name -> why
        self.bytes_written = 0
        # copies held for the writer at most (a file alone in the queue may be up to one slot)
        self.queue_bytes = geometry.bytes_per_slot()
        self.deferred = 0  # turns that queued nothing as the writer was behind
        self.nbytes = 0  # of the files indexed; kept, not summed: /metrics reads it from another thread
        self.hits = 0
        # files checked in full, or written, by this process and unchanged since: not hashed again
        self.checked: set[FileIdentity] = set()
        self._stop = threading.Event()
        self._ahead: threading.Thread | None = None
        self._ahead_id: int | None = None  # its native thread id
        self._yield = threading.Event()  # `yield_cpu` was called
        self._writer = FileWriter(self._written)
        self.folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        remove_stale_temps(self.folder)
        self._read_index()
        self._trim(0)

    def check_ahead(self) -> None:
        """Check the indexed files in full in a background thread, most recently used first, so
        the turn that needs one copies it in without hashing it: after a reboot this also reads
        it from flash before it is asked for. It runs at the caller's priority (a service's start,
        whose warm-up it shares the cores with) until `yield_cpu`. A file that fails is left for
        the turn that needs it, which refuses it (`load`). `close` stops it."""
        links = [(e.path, e.token_ids[e.start :], e.parent, e.start) for e in reversed(self.entries.values())]
        self._ahead = threading.Thread(
            target=self._check_files, args=(links,), name="kvedge-prefix-check", daemon=True
        )
        self._ahead.start()

    def yield_cpu(self) -> None:
        """From now on `check_ahead`'s thread runs at the lowest CPU priority (nice 19), after
        the turns being served (a service calls this when it turns ready)."""
        self._yield.set()
        if self._ahead_id is not None:
            _lowest_priority(self._ahead_id)

    def wait_written(self) -> None:
        """Wait until every file queued so far is written or has failed, not for files queued
        meanwhile (any thread: it changes nothing here; `flush` also drops the failed ones, on the
        owner's thread)."""
        self._writer.wait_queued()

    def flush(self) -> None:
        """Wait until every file `save` queued is written (or its failure logged and the prefix
        dropped)."""
        self._writer.wait_queued()
        self._reap()

    def close(self) -> None:
        """Stop `check_ahead` (within the file it is checking), then the writer once every file
        queued is written."""
        self._stop.set()
        if self._ahead is not None:
            self._ahead.join()
        self._writer.close()
        self._reap()

    def _check_files(self, links: list[tuple[Path, tuple[int, ...], str, int]]) -> None:
        self._ahead_id = threading.get_native_id()
        if self._yield.is_set():
            _lowest_priority(self._ahead_id)
        began, done = time.monotonic(), 0
        for path, token_ids, parent, start in links:
            if self._stop.is_set():
                return
            try:
                self._read(path, token_ids, parent, start)
                done += 1
            except (ArtifactMismatch, OSError):
                pass
        log.info("checked %d of %d prefix files in %.2f s", done, len(links), time.monotonic() - began)

    def _read(self, path: Path, token_ids: Sequence[int], parent: str, start: int) -> WarmPrefix:
        return read_warm_file(
            path,
            self.geometry,
            self.model_fingerprint,
            token_ids,
            graph_fingerprint=self.graph_fingerprint,
            parent=parent,
            start=start,
            checked=self.checked,
        )

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def queued_bytes(self) -> int:
        """Bytes of the files queued and not yet written (`FileWriter`): held in memory."""
        return self._writer.queued_bytes

    def best_match(self, ids: Sequence[int], usable: Usable | None = None) -> tuple[DiskEntry | None, int]:
        """The file sharing the most leading tokens with `ids`, and how many it shares; with
        `usable(entry, shared)`, how many of them a turn can use (`Model._usable`)."""
        self._reap()
        return best_entry(self.entries.values(), ids, usable)

    def save(
        self,
        token_ids: Sequence[int],
        read: Callable[[int], KVBlock],
        states: Snapshots | None = None,
        turn_end: bool = False,
    ) -> bool:
        """Queue for writing the KV of `token_ids` that no file holds yet: `read(start)` gives it
        from position `start` on, as a slot holds it, and is copied before this returns; the
        writer thread writes it (`FileWriter`), so the caller never waits on the disk. With
        per-slot states, `states` are those known at positions of `token_ids` (`known_states`):
        the file ends at the latest of them and carries those past its start. Nothing is
        queued for a short or already held prefix, a segment larger than the budget, or at a
        `turn_end` while the copies queued would pass `queue_bytes` (`deferred`: the slot still
        holds it for the next turn's file); a prefix leaving memory waits for the writer instead.
        Whether a file was queued. A failed write (a full disk) is logged and the prefix dropped."""
        self._reap()
        ids = tuple(int(t) for t in token_ids)
        states = states or {}
        if self.geometry.states:  # a file ends where its states are known: a turn resumes there
            ids = ids[: max((p for p in states if p <= len(ids)), default=0)]
        if len(ids) < self.min_tokens:
            return False
        whole = None if self.segments else read(0).head(len(ids))
        ring_from = len(ids) - (0 if whole is None else whole.ring_count)
        parent, superseded = None, []
        for entry in list(self.entries.values()):
            shared = common_prefix(entry.token_ids, ids)
            held = (self.segments or entry.ring_from <= ring_from) and (
                not self.geometry.states or len(ids) in entry.state_at
            )
            if shared == len(ids) and held:  # held already
                self._use(entry)
                return False
            if shared == len(entry.token_ids) < len(ids):  # the new one extends it
                if not self.segments:
                    superseded.append(entry.path.name)
                elif parent is None or len(entry.token_ids) > len(parent.token_ids):
                    parent = entry
        start = 0 if parent is None else len(parent.token_ids)
        block = read(start).head(len(ids) - start) if whole is None else whole
        if block.nbytes > self.budget_bytes:
            return False
        queued = self._writer.queued_bytes
        if queued and queued + block.nbytes > self.queue_bytes:
            if turn_end:
                self.deferred += 1  # the next file of this conversation starts where its last held one ends
                return False
            self._writer.wait_queued()  # nothing else will hold these tokens: at most one slot to write
        for name in superseded:
            self._remove(name)
        digest = hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:24]
        path = self.folder / f"{digest}{SUFFIX}"
        name = "" if parent is None else parent.path.name
        carried = {p: at for p, at in states.items() if start < p <= len(ids)}
        prefix = WarmPrefix(path.stem, ids[start:], block, name, start, carried)
        file = warm_file(
            prefix, self.geometry, self.model_fingerprint, graph_fingerprint=self.graph_fingerprint
        )
        if parent is not None:
            self._use(parent)
        self._trim(file.nbytes)
        if parent is not None and parent.path.name not in self.entries:  # trimmed to make room
            return False
        before = () if parent is None else parent.state_at
        state_at = (*before, *sorted(carried))
        self._add(DiskEntry(path, ids, len(ids) - block.ring_count, file.nbytes, name, start, state_at))
        self._writer.put(path, file)
        self._trim(0)
        return True

    def _written(self, status: os.stat_result) -> None:
        """The writer wrote a file (its thread): nothing to check in it, and its bytes count."""
        self.checked.add(file_identity(status))
        self.bytes_written += status.st_size

    def _reap(self) -> None:
        """Drop the prefixes whose writes failed (logged by the writer), with the segments after."""
        while self._writer.failed:
            self._remove(self._writer.failed.popleft())

    def load(self, entry: DiskEntry, count: int) -> list[WarmPrefix] | None:
        """The files holding the entry's first `count` tokens, first to last, each memory-mapped
        and checked in full; None (the failing file refused, logged and removed) if one fails, or
        if one could not be written."""
        chain = self._chain(entry) if entry.path.name in self.entries else []
        for link in chain:
            if link.start < count:
                self._writer.wait(link.path.name)  # a file queued and not yet written
        self._reap()
        if not chain or any(link.path.name not in self.entries for link in chain):
            return None
        loaded = []
        for link in chain:
            if link.start >= count:
                break
            try:
                prefix = self._read(link.path, link.token_ids[link.start :], link.parent, link.start)
            except (ArtifactMismatch, OSError) as exc:
                self._refuse(link.path, _why(exc))
                return None
            loaded.append(prefix)
        self._use(entry)
        self.hits += 1
        return loaded

    def clear(self) -> int:
        """Remove every prefix file; how many there were."""
        count = len(self.entries)
        for name in list(self.entries):
            self._remove(name)
        return count

    def _chain(self, entry: DiskEntry) -> list[DiskEntry]:
        """The entry and the files before it, first to last."""
        chain = [entry]
        while chain[0].parent:
            chain.insert(0, self.entries[chain[0].parent])
        return chain

    def _use(self, entry: DiskEntry) -> None:
        for link in reversed(self._chain(entry)):  # the root last: it goes after its segments
            self.entries.move_to_end(link.path.name)

    def _read_index(self) -> None:
        """Index the folder's files by their headers: parents before their segments, then in the
        order they were last written."""
        headers = {}
        for path in sorted(p for p in self.folder.glob(f"*{SUFFIX}") if p.is_file()):
            try:
                headers[path] = self._check(path, read_warm_header(path))
            except (ArtifactMismatch, OSError) as exc:
                self._refuse(path, _why(exc))
        for path, header in sorted(headers.items(), key=lambda item: item[1].start):
            parent = self.entries.get(header.parent)
            if header.parent in self.refused:  # named already, with the segments after it
                self.refused[path.name] = f"after the refused {header.parent}"
                path.unlink(missing_ok=True)
                continue
            if header.parent and parent is None:
                self._refuse(path, f"the file before it, {header.parent}, is missing")
                continue
            ids = (parent.token_ids if parent else ()) + header.token_ids
            ring_from = len(ids) - header.ring_count
            state_at = (*(parent.state_at if parent else ()), *header.state_at)
            size = path.stat().st_size
            self._add(DiskEntry(path, ids, ring_from, size, header.parent, header.start, state_at))
        for name in sorted(self.entries, key=lambda n: self.entries[n].path.stat().st_mtime):
            self.entries.move_to_end(name)

    def _check(self, path: Path, header: WarmHeader) -> WarmHeader:
        """`header`, if a file of this model's graph and geometry, else ArtifactMismatch."""
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
        if header.count != len(header.token_ids):
            mismatch.append(f"count {header.count} does not match its {len(header.token_ids)} token ids")
        if mismatch:
            raise ArtifactMismatch("; ".join(mismatch))
        return header

    def _trim(self, incoming: int) -> None:
        """Remove the least recently used files until `incoming` more bytes fit the budget."""
        while self.entries and self.nbytes + incoming > self.budget_bytes:
            self._remove(next(iter(self.entries)))

    def _add(self, entry: DiskEntry) -> None:
        self.entries[entry.path.name] = entry
        self.nbytes += entry.nbytes

    def _remove(self, name: str) -> None:
        """Remove the file `name` and the segments after it."""
        entry = self.entries.pop(name, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        self._writer.cancel(entry.path)
        for after in [e.path.name for e in self.entries.values() if e.parent == name]:
            self._remove(after)

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("prefix file %s refused (%s); removed, the turn prefills instead", path, why)
        self.refused[path.name] = why
        self._remove(path.name)
        path.unlink(missing_ok=True)  # one refused at boot was never indexed


@dataclass(frozen=True)
class PrefixFile:
    """One file of a prefix_dir, as `kvedge prefixes list` shows it."""

    export: str  # its subfolder: the first 16 hex digits of its export's graph fingerprint
    name: str
    tokens: int
    nbytes: int
    problem: str | None  # why its header cannot be read, or None


def list_prefix_files(prefix_dir: Path) -> list[PrefixFile]:
    """The prefix files in `prefix_dir`'s export subfolders (headers only), by subfolder, oldest
    first in each; none if it does not exist."""
    found = []
    for path in sorted(_prefix_paths(prefix_dir), key=lambda p: (p.parent.name, p.stat().st_mtime)):
        try:
            header, problem = read_warm_header(path), None
        except (ArtifactMismatch, OSError) as exc:
            header, problem = None, _why(exc)
        tokens = 0 if header is None else header.count
        found.append(PrefixFile(path.parent.name, path.name, tokens, path.stat().st_size, problem))
    return found


def clear_prefix_files(prefix_dir: Path) -> int:
    """Remove every prefix file in `prefix_dir`'s export subfolders (a running service then
    prefills those conversations; the subfolders stay, it writes there); how many there were."""
    paths = _prefix_paths(prefix_dir)
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def _prefix_paths(prefix_dir: Path) -> list[Path]:
    return [p for p in Path(prefix_dir).glob(f"*/*{SUFFIX}") if p.is_file()]


def reader(block: KVBlock) -> Callable[[int], KVBlock]:
    """`PrefixDisk.save`'s `read` over a block of positions 0..n-1 (asked from 0 only when it has
    ring layers or int4 windows: those are written whole)."""
    return block.tail


def _why(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ArtifactMismatch) else f"cannot read it: {exc.strerror or exc}"


def _lowest_priority(thread_id: int) -> None:
    """nice 19 for the thread `thread_id` (Linux: a thread's own priority)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: as it was
        os.setpriority(os.PRIO_PROCESS, thread_id, 19)


@dataclass(eq=False)
class _Job:
    path: Path
    file: WarmFile
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


class FileWriter:
    """One thread writing warm files in the order queued (`save_warm_file`: atomic, fsync'ed), so
    the thread that queues them never waits on the disk. `cancel` removes a file, queued or
    written; a write that fails is logged and its name left in `failed` for the owner to drop.
    A process killed with files queued loses them (their prefixes prefill again)."""

    def __init__(self, written: Callable[[os.stat_result], None]) -> None:
        self.failed: deque[str] = deque()
        self.queued_bytes = 0  # of the files queued and not yet written: copies held in memory
        self._written = written
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: dict[str, _Job] = {}  # by file name, the last queued
        self._lock = threading.Lock()  # a cancel against a write's rename
        self._thread: threading.Thread | None = None
        self._last: _Job | None = None

    def put(self, path: Path, file: WarmFile) -> None:
        job = _Job(path, file)
        with self._lock:
            self._pending[path.name] = job
            self.queued_bytes += file.nbytes
            self._last = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvedge-prefix-writer", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def wait_queued(self) -> None:
        """Wait for the last file queued so far, and so (one writer, in order) for every one."""
        job = self._last
        if job is not None:
            job.done.wait()

    def wait(self, name: str) -> None:
        """Wait for the file named `name` if it is queued or being written."""
        job = self._pending.get(name)
        if job is not None:
            job.done.wait()

    def cancel(self, path: Path) -> None:
        """Remove `path`, and if it is queued or being written, see that it is not kept."""
        with self._lock:
            job = self._pending.get(path.name)
            if job is not None:
                job.cancelled = True
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._write(job)
            finally:
                with self._lock:
                    self.queued_bytes -= job.file.nbytes
                    job.file = None  # type: ignore[assignment]  # its copy of the KV goes now
                    if self._pending.get(job.path.name) is job:
                        del self._pending[job.path.name]
                job.done.set()

    def _write(self, job: _Job) -> None:
        if job.cancelled:
            return
        try:
            status = save_warm_file(job.path, job.file, FILE_MODE)
        except OSError as exc:
            log.warning("prefix file %s not written (%s); prefix dropped", job.path, exc.strerror or exc)
            self.failed.append(job.path.name)
            return
        with self._lock:
            if job.cancelled:  # removed while it was written
                job.path.unlink(missing_ok=True)
                return
        self._written(status)
