"""Prefix reuse: what a new turn in a slot can resume from, and where each slot's past is kept.

A turn on token ids `ids` in a slot resumes from the longest usable prefix of `ids` found in:

    the slot itself          the tokens it holds (`KVCache.token_ids`), rewound to the shared part
    the warm-prefix store    fixed prompts computed at start-up or read from `.kvw` files
    the run-time store       slots' pasts kept in an arena when another conversation took them
    the disk tier            run-time prefixes written as files (`prefix_dir`), which outlive
                             the process: a conversation resumes after kill -9 and a restart

and prefills the rest. "Usable" is the rewind rule (`KVCache.resume_limit`): at most len(ids) - 1
tokens (the last prompt token is run for its logits), none where a ring layer lacks what the first
query needs, and for models with per-slot states (convolution and recurrent layers) only up to a
position where a snapshot of those states is held: a state is never cut back to a shorter prefix.
Every store carries the states at such positions with the K/V (`KVBlock`, `Snapshots`), so one
rule restores any state kind.

`PrefixStores` owns the three stores and the decisions about them: where a turn resumes
(`resume`), what is kept when a slot is about to be overwritten or a turn ends (`turn_ended`,
`keep_all`), and their figures (`stats`). `Model` holds one and calls it; nothing else decides
reuse.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

from kvedge.contract import Manifest
from kvedge.runtime.cache import KVCache
from kvedge.runtime.options import RunOptions
from kvedge.runtime.prefix import RunTimePrefixStore, Stored
from kvedge.runtime.prefix_disk import PrefixDisk, export_folder, reader
from kvedge.runtime.sessions import ChatSession, common_prefix
from kvedge.runtime.warm_prefixes import WarmPrefixReport, WarmPrefixStore

log = logging.getLogger(__name__)


class PrefixStores:
    """The warm-prefix store (`warm`, loaded by `Model.load_warm_prefixes`, with its
    `warm_report`), the run-time store of `RunOptions.prefix_cache_bytes` (`run_time`) and the
    disk tier beneath it (`disk`, None without `RunOptions.prefix_dir` or where that folder
    cannot be used), for the slots of `cache` and their `sessions`."""

    def __init__(
        self, cache: KVCache, sessions: Sequence[ChatSession], manifest: Manifest, options: RunOptions
    ) -> None:
        self.cache, self.sessions = cache, sessions
        run_time_bytes = options.prefix_cache_bytes
        self.disk: PrefixDisk | None = None if options.prefix_dir is None else _open_disk(manifest, options)
        disk = self.disk
        spill = None if disk is None else lambda ids, block, states: disk.save(ids, reader(block), states)
        self.run_time = RunTimePrefixStore(manifest.geometry, run_time_bytes, spill=spill)
        self.warm = WarmPrefixStore()
        self.warm_report: WarmPrefixReport | None = None

    def check_ahead(self) -> None:
        """Start checking the disk tier's files, which a restarted conversation will ask for,
        before it does (`PrefixDisk.check_ahead`)."""
        if self.disk is not None:
            self.disk.check_ahead()

    # -- where a turn resumes -----------------------------------------------------------------

    def resume(self, slot: int, ids: list[int]) -> list[int]:
        """Rewind `slot` to the longest prefix of `ids` it holds or can copy in, note it in the
        slot's session, and return the tokens still to prefill (at least the last one, whose
        logits give the first token). What the slot held is kept first if another conversation
        is about to replace a block or more of it."""
        session, cache = self.sessions[slot], self.cache
        if not session.verify(cache):
            log.warning(
                "slot %d: cache holds %d tokens, session expected %d (or other tokens); re-prefilling",
                slot,
                cache.length(slot),
                len(session.expected),
            )
            session.reset(cache)
        kept = len(session.history)
        if session.evicted and len(ids) > kept and common_prefix(session.history, ids) == kept:
            session.reused_tokens = kept
            return ids[kept:]  # windowed slot: append the new turn to what is kept
        if session.evicted:  # changed, or resent as it was (a regenerated reply): evicted tokens
            log.info("slot %d: the conversation does not extend the windowed history; re-prefilling", slot)
            session.reset(cache)
        held = cache.token_ids(slot)
        keep = common_prefix(held, ids)
        if len(held) - keep >= self.run_time.block_tokens:  # another conversation is about to replace it
            if self.run_time:
                self.run_time.save(cache, slot)
            elif self.disk is not None:
                self.keep_slot(slot)
        keep = self._copy_in(slot, ids, keep)
        keep = min(keep, len(ids) - 1)  # the last prompt token is run to get the logits
        # a ring layer may have overwritten what it needs; a state is known at a snapshot only
        keep = cache.rewind_limit(slot, keep)
        cache.truncate(slot, keep)
        session.history = ids[:keep]
        session.reused_tokens = keep
        return ids[keep:]

    def _copy_in(self, slot: int, ids: list[int], keep: int) -> int:
        """Copy in the warm, run-time or disk prefix that shares the most usable leading tokens
        with `ids`, if it can resume from more than the slot, which holds the first `keep`; return
        how many the slot now shares (with per-slot states, it resumes from the prefix's states there)."""
        cache = self.cache

        def usable(stored: Stored, shared: int) -> int:
            return cache.resume_limit(min(shared, len(ids) - 1), stored.ring_from, stored.state_at)

        own = cache.rewind_limit(slot, min(keep, len(ids) - 1))  # what the slot can resume from
        warm, warm_shared = self.warm.best_match(ids, usable)
        entry, run_time_shared = self.run_time.best_match(ids, usable)
        if self.disk is not None:
            stored, disk_shared = self.disk.best_match(ids, usable)
            # a match shorter than a file would be written for is not worth reading (nor waiting
            # for, when its file is still queued): every chat shares its template's first tokens
            worth = max(own, warm_shared, run_time_shared, self.disk.min_tokens - 1)
            if stored is not None and disk_shared > worth:
                chain = self.disk.load(stored, disk_shared)  # None: refused and logged
                if chain is not None:
                    for i, part in enumerate(chain):
                        n = min(disk_shared - part.start, len(part.token_ids))
                        run = ids[part.start : part.start + n]
                        # each file carries the states at its end; the slot resumes from the last
                        # one's, at disk_shared (the others stay on disk, for a later rewind)
                        states = part.states if i == len(chain) - 1 else None
                        cache.write(slot, part.block.head(n), run, part.start, states)
                    return disk_shared
        if entry is not None and run_time_shared > max(own, warm_shared):
            self.run_time.load(cache, slot, entry, run_time_shared, start=min(keep, run_time_shared))
            return run_time_shared
        if warm is not None and warm_shared > own:
            cache.write(slot, warm.block.head(warm_shared), ids[:warm_shared], states=warm.states)
            return warm_shared
        return keep

    # -- what is kept ---------------------------------------------------------------------------

    def turn_ended(self, slot: int, prompt_tokens: int) -> None:
        """A turn of `prompt_tokens` in `slot` ended and its session recorded it: snapshot the
        slot's per-slot states (the next turn resumes from the reply's end), and write the prompt,
        then the reply after it, each as its own file to the disk tier. The next turn resends the
        reply as the template renders it, which may tokenize otherwise: its file then follows the
        prompt's, and the reply's goes unused until the budget drops it."""
        self.cache.snapshot(slot)
        if self.disk is not None and self.disk.segments:
            self.keep_slot(slot, prompt_tokens, turn_end=True)
            self.keep_slot(slot, turn_end=True)

    def keep_slot(self, slot: int, upto: int | None = None, turn_end: bool = False) -> bool:
        """Write what `slot` holds (its first `upto` tokens) and no prefix file does yet
        (`PrefixDisk.save`; at a `turn_end` it may wait for the next turn's file)."""
        cache, session = self.cache, self.sessions[slot]
        held = cache.length(slot) if upto is None else min(cache.length(slot), upto)
        # a windowed slot's KV is not its tokens' from position 0
        if not held or session.evicted or not session.verify(cache):
            return False
        ids = cache.token_ids(slot)[:held]
        states = cache.known_states(slot, held)
        return self.disk.save(ids, lambda start: cache.view(slot, start, held), states, turn_end)

    def keep_all(self, slots_by_age: Sequence[int]) -> int:
        """Write what the run-time store and the slots (least recently used first) hold to the
        disk tier (`PrefixDisk.save` skips short and already written ones); how many files were
        written. Safe to call twice."""
        if self.disk is None:
            return 0
        written = 0
        store = self.run_time
        for entry in list(store.entries.values()):
            written += self.disk.save(entry.token_ids, reader(store.block(entry)), store.snapshots(entry))
        for slot in slots_by_age:
            written += self.keep_slot(slot)
        return written

    @contextlib.contextmanager
    def unkept(self) -> Iterator[None]:
        """Nothing of the turns run inside is written to the disk tier (a service's warm-up)."""
        disk, self.disk = self.disk, None
        try:
            yield
        finally:
            self.disk = disk

    def close(self) -> None:
        """Wait for every file queued to be written, then stop the disk tier: nothing is written
        from the cache after (it is released next). Safe to call twice."""
        if self.disk is not None:
            self.disk.close()
        self.disk = None

    def stats(self) -> dict[str, int]:
        """Where the run-time prefixes sit: bytes in memory (`RunTimePrefixStore`) and on disk
        (`PrefixDisk`: bytes, files, bytes written and files refused since start-up), bytes
        copied from slots waiting for the disk's writer thread, and turns that queued nothing
        while it was behind."""
        disk = self.disk
        return {
            "memory_bytes": self.run_time.nbytes,
            "disk_bytes": 0 if disk is None else disk.nbytes,
            "disk_files": 0 if disk is None else len(disk),
            "disk_written_bytes": 0 if disk is None else disk.bytes_written,
            "disk_refused": 0 if disk is None else len(disk.refused),
            "disk_queued_bytes": 0 if disk is None else disk.queued_bytes,
            "disk_deferred": 0 if disk is None else disk.deferred,
        }

    def describe(self) -> str:
        """One line for the load log: warm prefixes, the run-time budget, the files on disk."""
        disk = self.disk
        files = 0 if disk is None else len(disk)
        on_disk = 0 if disk is None else disk.nbytes / 2**20
        return (
            f"{len(self.warm)} warm prefixes, prefix LRU {self.run_time.capacity_bytes / 2**20:.1f} MiB, "
            f"{files} prefix files ({on_disk:.1f} MiB)"
        )


def _open_disk(manifest: Manifest, options: RunOptions) -> PrefixDisk | None:
    """The disk tier in this export's subfolder of `options.prefix_dir` (`export_folder`: other
    exports' files there are left alone); None, with a warning, where this user cannot make or
    read that folder (on by default: a read-only install still serves)."""
    try:
        return PrefixDisk(
            export_folder(options.prefix_dir, manifest.onnx_fingerprint),
            options.prefix_disk_bytes,
            manifest.geometry,
            manifest.source_fingerprint,
            manifest.onnx_fingerprint,
            options.prefix_disk_min_tokens,
        )
    except OSError as exc:
        log.warning(
            "prefix_dir %s: %s; conversations are kept in memory only (give the service user that "
            "folder, or set prefix_dir: null)",
            options.prefix_dir,
            exc.strerror or exc,
        )
        return None
