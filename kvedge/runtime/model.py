"""The runtime's public API: load an artifact folder once, then run chat turns in its slots.

One turn, as the CLI (a batch of one) and the service (many slots) both drive it::

    ids  = model.encode_chat(messages, reserve)     # tokenize once (the truncate policy drops turns)
    n    = model.fit_reply(len(ids), max_tokens)    # the fit rule: how long the reply may be
    slot = model.pick_slot(ids, free)               # the free slot sharing the longest prefix
    turn = model.begin(slot, ids, sampling)         # reuse what the slot holds, plan the prefill
    while not turn.done:
        events = model.step([turn, ...]).events     # a prefill chunk or one batched decode step
    model.end(turn)                                 # the slot's session notes what it holds

`Model.chat` runs that loop for one conversation and yields its events.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvedge.contract import (
    ONNX_FILE,
    PREFILL_CHUNK,
    TOKENIZER_FILE,
    CacheGeometry,
    Manifest,
    graph_files,
    sha256_files,
)
from kvedge.errors import ArtifactMismatch, ContextOverflow, KvedgeError
from kvedge.runtime.backends.cuda import DeviceMemory
from kvedge.runtime.cache import KVCache
from kvedge.runtime.constrain import Constraint, Grammars
from kvedge.runtime.draft import Draft, DraftProposer, check_same_tokenizer
from kvedge.runtime.generate import Event, SamplingConfig, StepResult, Turn, step_turns
from kvedge.runtime.interface import Backend
from kvedge.runtime.options import RunOptions
from kvedge.runtime.prefix import RunTimePrefixStore, Stored
from kvedge.runtime.prefix_disk import PrefixDisk, export_folder, reader
from kvedge.runtime.registry import open_backend
from kvedge.runtime.sessions import ChatSession, HistoryPolicy, RoomMaker, common_prefix, pick_slot
from kvedge.runtime.speculate import Adaptive, Costs, Lookup, draft_folder
from kvedge.runtime.tokenizer import ChatTokenizer, TextStream
from kvedge.runtime.warm_prefixes import (
    WarmPrefixConfig,
    WarmPrefixReport,
    WarmPrefixStore,
    load_warm_prefixes,
)

log = logging.getLogger(__name__)

__all__ = ["Constraint", "Event", "Model", "SamplingConfig", "StepResult", "Turn", "common_prefix"]


class Model:
    """An exported model run as its `RunOptions` say (kvedge.runtime.options): on a device
    (onnxruntime CPU or CUDA, or a TensorRT engine) with its tokenizer, a preallocated cache of
    `slots` sequences, one `ChatSession` per slot, optionally warm prefixes loaded (or rebuilt) at
    start-up, a store of `prefix_cache_bytes` for prefixes seen at run time (`RunTimePrefixStore`) and a
    draft model. `kv_memory` (`KV_MEMORY`; GPU devices only): where the cache pool lives:
    "mapped", pinned host memory the GPU reads in place (the default, until hardware measures the
    other), or "device", device memory (cudaMalloc) the CPU side reaches by explicit copies.

    `close()` (or leaving `with Model(...) as model:`) stops the backend and gives back what it
    took on the GPU (page locks on the cache, mapped buffers); the model is unusable after."""

    def __init__(self, folder: str | Path, options: RunOptions | None = None, **fields: Any) -> None:
        """Load the export in `folder` to run with `options`, or with the `RunOptions` `fields`
        name (`Model(folder, slots=2)`), not both."""
        if options is not None and fields:
            raise KvedgeError(f"give RunOptions or its fields ({sorted(fields)}), not both")
        self.options = options = options or RunOptions(**fields)
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise KvedgeError(_not_a_folder(self.folder))
        self.manifest = Manifest.load(self.folder)
        for name in (ONNX_FILE, TOKENIZER_FILE):  # before the slow graph load, and in one line
            path = self.folder / name
            if not path.is_file() or path.stat().st_size == 0:
                state = "is empty" if path.is_file() else "is missing"
                raise KvedgeError(f"{path} {state}: the folder is not a whole export; re-export the model")
        if options.verify:
            self._verify_graph()
        self.policy = options.policy
        _check_ring_features(self.manifest.geometry, self.policy)
        if (
            self.policy.mode == "window"
            and len(self.manifest.rope.inv_freq) != self.manifest.geometry.head_dim // 2
        ):
            raise KvedgeError(
                "history_policy 'window' needs RoPE frequencies in the manifest; re-export the model"
            )
        # one decode binding per contiguous slot range, so batched decode never rebuilds one
        ranges = min(64, max(8, options.slots * (options.slots + 1) // 2))
        self.device = options.device
        self.draft: Draft | None = None  # speculate="draft": proposals of `options.draft`
        # decode calls' seconds, what its turns' speculative steps are weighed against
        self.speculation_costs = Costs()
        self.backend: Backend = open_backend(
            self.folder,
            self.manifest,
            options.device,
            threads=options.threads,
            max_decode_bindings=ranges,
            cuda_graph=options.cuda_graph,
        )
        self.cache: KVCache | None = None
        try:
            self._load(options)
            if options.draft is not None:
                self.load_draft(options.draft)
        except BaseException:
            self.close()  # the GPU memory taken is given back even when loading fails
            raise

    def _load(self, options: RunOptions) -> None:
        """Everything after the backend opened: tokenizer, cache, sessions, warm prefixes."""
        slots, warm, warm_dir = options.slots, options.warm_prefixes, options.warm_dir
        self.tokenizer = ChatTokenizer(self.folder, self.manifest)
        self.grammars = Grammars(
            self.folder / TOKENIZER_FILE, self.manifest.vocab_size, self.manifest.eos_token_ids
        )
        device_memory = DeviceMemory() if options.kv_memory == "device" else None
        self.cache = KVCache(self.manifest.geometry, slots, device_memory)
        self.backend.reserve(
            self.cache.layer_views(0, slots), self.manifest.geometry.max_len, self.cache.state_views(0, slots)
        )
        self.sessions = [ChatSession(slot) for slot in range(slots)]
        self._turns: list[Turn | None] = [None] * slots  # the unfinished turn of each slot
        self._last_used = [0.0] * slots
        self._warned: set[str] = set()  # reasons logged once
        geometry = self.manifest.geometry
        disk = None if options.prefix_dir is None else self._open_prefix_disk(options)
        spill = None if disk is None else lambda ids, block, states: disk.save(ids, reader(block), states)
        self.run_time_store = RunTimePrefixStore(geometry, options.prefix_cache_bytes, spill=spill)
        self.prefix_disk: PrefixDisk | None = disk
        # [layers, 1, 1, d/2], what window eviction re-rotates keys by; ring geometries never evict
        # (`_check_ring_features`), and Gemma 4's layers differ in head_dim
        self.inv_freq = (
            None if geometry.ring_layers else self.manifest.rope.key_frequencies(geometry.num_layers)
        )
        self.warm_store = WarmPrefixStore()
        self.warm_prefix_report: WarmPrefixReport | None = None
        if warm is not None:
            self.warm_store, self.warm_prefix_report = self.load_warm_prefixes(warm, warm_dir)
            for session in self.sessions:
                session.reset(self.cache)
        if disk is not None:
            disk.check_ahead()  # the files a restarted conversation will ask for, before it does
        log.info(
            "loaded %s: %d slots x %d tokens, KV pool %.1f MiB, %d warm prefixes, prefix LRU %.1f MiB, "
            "%d prefix files (%.1f MiB)",
            self.folder,
            slots,
            self.manifest.geometry.max_len,
            self.cache.nbytes / 2**20,
            len(self.warm_store),
            self.run_time_store.capacity_bytes / 2**20,
            0 if disk is None else len(disk),
            0 if disk is None else disk.nbytes / 2**20,
        )

    def _open_prefix_disk(self, options: RunOptions) -> PrefixDisk | None:
        """The disk tier in this export's subfolder of `options.prefix_dir` (`export_folder`:
        other exports' files there are left alone); None, with a warning, where this user cannot
        make or read that folder (on by default: a read-only install still serves)."""
        try:
            return PrefixDisk(
                export_folder(options.prefix_dir, self.manifest.onnx_fingerprint),
                options.prefix_disk_bytes,
                self.manifest.geometry,
                self.manifest.source_fingerprint,
                self.manifest.onnx_fingerprint,
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

    def _verify_graph(self) -> None:
        found = sha256_files(graph_files(self.folder))
        if found != self.manifest.onnx_fingerprint:
            raise ArtifactMismatch(
                f"{self.folder / ONNX_FILE}: graph fingerprint {found[:16]} does not match the "
                f"manifest's {self.manifest.onnx_fingerprint[:16]}; re-export the model"
            )

    def load_warm_prefixes(
        self, config: WarmPrefixConfig, folder: str | Path
    ) -> tuple[WarmPrefixStore, WarmPrefixReport]:
        """Load the warm prefixes `config` declares from `folder`, recomputing any that is not
        valid (in the last slot, which is left empty)."""
        return load_warm_prefixes(self.tokenizer, self.backend, self.cache, self.manifest, config, folder)

    def close(self) -> None:
        """Stop the backend, then release what it holds of the cache (GPU page locks, mapped
        buffers), then the cache's device memory (`kv_memory="device"`); host arrays go with
        this object. Safe to call twice. The draft goes first; should its close raise, this
        model's backend and cache are still released (then the error is raised). Run-time
        prefixes still in memory are written to disk first (`RunOptions.prefix_dir`)."""
        try:
            self.keep_prefixes()
            if getattr(self, "prefix_disk", None) is not None:
                self.prefix_disk.close()  # once every file queued is written
            self.prefix_disk = None  # the cache goes next: nothing is written from it again
            if self.draft is not None:
                self.draft.close()
        finally:
            try:
                self.backend.close()
            finally:
                if self.cache is not None:
                    self.cache.close()

    def prefix_stats(self) -> dict[str, int]:
        """Where the run-time prefixes sit: bytes in memory (`RunTimePrefixStore`) and on disk
        (`PrefixDisk`: bytes, files, bytes written and files refused since start-up), bytes
        copied from slots waiting for the disk's writer thread, and turns that queued nothing
        while it was behind."""
        disk = self.prefix_disk
        return {
            "memory_bytes": self.run_time_store.nbytes,
            "disk_bytes": 0 if disk is None else disk.nbytes,
            "disk_files": 0 if disk is None else len(disk),
            "disk_written_bytes": 0 if disk is None else disk.bytes_written,
            "disk_refused": 0 if disk is None else len(disk.refused),
            "disk_queued_bytes": 0 if disk is None else disk.queued_bytes,
            "disk_deferred": 0 if disk is None else disk.deferred,
        }

    @contextlib.contextmanager
    def scratch(self, slot: int) -> Iterator[None]:
        """Turns run inside (a service's warm-up) are no conversation: nothing of them is written
        to the disk tier, and `slot` is emptied after."""
        disk, self.prefix_disk = self.prefix_disk, None
        try:
            yield
        finally:
            self.prefix_disk = disk
            self.sessions[slot].reset(self.cache)

    def keep_prefixes(self) -> int:
        """Write what the run-time prefix store and the slots hold to the disk tier, least
        recently used first (`PrefixDisk.save` skips short and already written ones); how many
        files were written. Safe to call twice, and before loading finished."""
        disk, cache = getattr(self, "prefix_disk", None), self.cache
        if disk is None or cache is None:
            return 0
        written = 0
        store = self.run_time_store
        for entry in list(store.entries.values()):
            written += disk.save(entry.token_ids, reader(store.block(entry)), store.snapshots(entry))
        for slot in sorted(range(cache.slots), key=lambda s: self._last_used[s]):
            written += self._keep_slot(slot)
        return written

    def _keep_slot(self, slot: int, upto: int | None = None, turn_end: bool = False) -> bool:
        """Write what `slot` holds (its first `upto` tokens) and no prefix file does yet
        (`PrefixDisk.save`; at a `turn_end` it may wait for the next turn's file)."""
        held, session = self.cache.length(slot), self.sessions[slot]
        held = held if upto is None else min(held, upto)
        # a windowed slot's KV is not its tokens' from position 0
        if not held or session.evicted or not session.verify(self.cache):
            return False
        ids = self.cache.token_ids(slot)[:held]
        states = self.cache.known_states(slot, held)
        return self.prefix_disk.save(ids, lambda start: self.cache.view(slot, start, held), states, turn_end)

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what the service and the CLI call ---------------------------------------------------

    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def kv_bytes_allocated(self) -> int:
        return self.cache.nbytes

    def kv_bytes_in_use(self) -> int:
        """Bytes of the pool holding valid tokens, over all slots."""
        return sum(self.manifest.geometry.bytes_held(int(n)) for n in self.cache.lengths)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        reserve: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        limit: int | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The conversation's token ids (`tools` and `template_kwargs` go to the chat template);
        under the truncate policy the oldest whole turns are dropped (system messages stay) until
        it fits with `reserve` tokens left for the reply. A conversation of more than `limit`
        tokens is refused before any truncation, which re-renders it once per dropped turn, and
        one whose rendered text is surely over `limit` (`ChatTokenizer.fewest_tokens`) before it
        is tokenized whole: the rendering holds all the request sends (messages, tools)."""
        messages = list(messages)

        def encode(kept: Sequence[dict[str, Any]]) -> list[int]:
            return self.tokenizer.encode_chat(kept, tools=tools, **template_kwargs)

        if limit is None:
            ids = encode(messages)
        else:
            text = self.tokenizer.render(messages, tools=tools, **template_kwargs)
            _at_least(self.tokenizer, text, limit, "messages take")
            ids = _within(self.tokenizer.encode_rendered(text), limit, "the messages take")
        if self.policy.mode == "truncate":
            messages, ids = self._truncate_turns(messages, ids, reserve, encode)
        return ids

    def encode_prompt(self, text: str, limit: int | None = None) -> list[int]:
        """A raw prompt's token ids (no chat template), refused above `limit` tokens (a prompt
        surely over it before it is tokenized whole: `ChatTokenizer.fewest_tokens`)."""
        if limit is not None:
            _at_least(self.tokenizer, text, limit, "prompt takes")
        return _within(self.tokenizer.encode(text), limit, "the prompt takes")

    def _truncate_turns(
        self,
        messages: list[dict[str, Any]],
        ids: list[int],
        reserve: int,
        encode: Callable[[Sequence[dict[str, Any]]], list[int]] | None = None,
    ) -> tuple[list[dict[str, Any]], list[int]]:
        encode = encode or self.tokenizer.encode_chat
        max_len = self.manifest.geometry.max_len
        budget = self.policy.truncate_budget(max_len, reserve)
        while len(ids) > budget:
            first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
            later_user = next(
                (i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None
            )
            if later_user is None:
                raise self.policy.overflow_last_turn(len(ids), budget, max_len, reserve)
            log.info("truncate: dropping %d oldest messages", later_user - first)
            messages = messages[:first] + messages[later_user:]
            ids = encode(messages)
        return messages, ids

    def fit_reply(
        self, prompt_tokens: int, requested: int | None, default: int = 256, overflow: str = "clip"
    ) -> int:
        """How many tokens a reply to `prompt_tokens` may have (`HistoryPolicy.fit_reply`)."""
        return self.policy.fit_reply(
            prompt_tokens, self.manifest.geometry.max_len, requested, default, overflow
        )

    def pick_slot(self, ids: Sequence[int], free: Sequence[int]) -> int:
        """The free slot sharing the longest token prefix with `ids`; among equals the least
        recently used."""
        return pick_slot(free, ids, self.cache.token_ids, self._last_used)[0]

    def begin(self, slot: int, ids: Sequence[int], config: SamplingConfig) -> Turn:
        """Start a turn answering the conversation `ids` in `slot`: rewind the slot to what it
        shares with `ids` (or copy in a stored prefix that shares more) and plan the prefill of
        the rest. Nothing runs on the model until `step`. An unfinished turn in the slot is
        ended first."""
        if self._turns[slot] is not None:
            self.end(self._turns[slot])
        ids = [int(t) for t in ids]
        self.policy.check_prompt(len(ids), self.manifest.geometry.max_len)
        matcher = None if config.constraint is None else self.grammars.matcher(config.constraint)
        session = self.sessions[slot]
        new = self._reuse(slot, ids)
        window = self.policy.mode == "window"
        chunk = min(PREFILL_CHUNK, self.backend.max_prefill or PREFILL_CHUNK)  # an engine's --max-prefill
        if window:
            chunk = max(1, min(chunk, (self.manifest.geometry.max_len - self.policy.n_sink) // 2))
        turn = Turn(
            slot=slot,
            prompt_tokens=len(ids),
            todo=new,
            chunk=chunk,
            config=config,
            stream=TextStream(self.tokenizer, config.stop),
            seen=list(ids),
            make_room=RoomMaker(self.cache, self.policy, self.inv_freq, session),
            reused_tokens=session.reused_tokens,
            rng=np.random.default_rng(config.seed),
            eos_ids=tuple(self.manifest.eos_token_ids),
            matcher=matcher,
            speculator=self._speculator(config, slot),
        )
        self._turns[slot] = turn
        return turn

    def speculation_refusal(self) -> str | None:
        """Why this model cannot decode speculatively (`SamplingConfig.speculate`), or None: the
        backend's answer (the graph's, and a TensorRT engine's profiles')."""
        return self.backend.verify_refusal()

    def load_draft(self, folder: str | Path) -> Draft:
        """Load the export in `folder` as this model's draft (speculate="draft"): the same device,
        threads and cache memory, one slot per slot of this model, its tokenizer checked against
        this one's. A draft loaded before is closed first."""
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        o = self.options
        draft_model = Model(
            folder, RunOptions(slots=o.slots, threads=o.threads, device=o.device, kv_memory=o.kv_memory)
        )
        try:
            check_same_tokenizer(self, draft_model)
        except BaseException:
            draft_model.close()
            raise
        self.draft = Draft(draft_model)
        log.info("draft %s loaded for %s: %d slots", folder, self.folder, self.slots)
        return self.draft

    def _speculator(self, config: SamplingConfig, slot: int) -> Adaptive | None:
        """A turn's proposals, if `config` asks for them and this model can verify: prompt lookup,
        or the draft loaded with the model ("draft", or "draft:DIR" naming it; a draft is never
        loaded in the middle of a request)."""
        if config.speculate == "off":
            return None
        refusal = self.speculation_refusal()
        if refusal is not None:
            if refusal not in self._warned:
                self._warned.add(refusal)
                log.warning("%s", refusal)
            return None
        if config.speculate == "lookup":
            return Lookup(costs=self.speculation_costs)
        folder = draft_folder(config.speculate)
        if self.draft is None:
            raise KvedgeError(
                f"speculate={config.speculate!r} needs the draft loaded with the model "
                "(RunOptions.draft; --speculate draft:DIR, or the service's speculate: draft:DIR)"
            )
        if folder is not None and Path(folder).resolve() != self.draft.folder:
            raise KvedgeError(
                f"speculate={config.speculate!r} names another draft than the one loaded with the model "
                f"({self.draft.folder}); allowed: 'draft' or 'draft:{self.draft.folder}'"
            )
        return DraftProposer(draft=self.draft, slot=slot, costs=self.speculation_costs)

    def step(self, turns: Sequence[Turn], batch: bool = True) -> StepResult:
        """Advance each turn by one step (`step_turns`; `batch`: decode contiguous slots in one
        call); a turn that finished is ended."""
        result = step_turns(self.backend, self.cache, turns, batch=batch)
        for turn, event in result.events.items():
            if event.finish_reason is not None:
                self.end(turn)
        return result

    def end(self, turn: Turn) -> None:
        """End `turn` (finished, failed or abandoned): its slot's session notes what the slot
        holds, so the next turn there reuses it. Safe to call more than once."""
        if self._turns[turn.slot] is not turn:
            return
        self._turns[turn.slot] = None
        self._last_used[turn.slot] = time.monotonic()
        session = self.sessions[turn.slot]
        if turn.finish_reason == "error":
            session.reset(self.cache)  # a half-written step is never reused
            return
        if not turn.done:
            turn.finish("cancelled")
        session.record(self.cache, turn.written)
        self.cache.snapshot(turn.slot)  # per-slot states: the next turn resumes from the reply's end
        if self.prefix_disk is not None and self.prefix_disk.segments:
            # The prompt, then the reply after it as its own file: the next turn resends the reply
            # as the template renders it, which may tokenize otherwise; the next turn's file then
            # follows the prompt's, and the reply's goes unused until the budget drops it.
            self._keep_slot(turn.slot, turn.prompt_tokens, turn_end=True)
            self._keep_slot(turn.slot, turn_end=True)

    # -- one conversation at a time --------------------------------------------------------

    def stream(
        self, prompt: str, config: SamplingConfig, raw: bool = False, slot: int = 0
    ) -> Iterator[Event]:
        """One turn on its own: `prompt` as a user message (or raw text), ignoring earlier turns."""
        if raw:
            self.sessions[slot].reset(self.cache)
            return self._run(self.begin(slot, self.tokenizer.encode(prompt), config))
        return self.chat([{"role": "user", "content": prompt}], config, slot=slot)

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        config: SamplingConfig,
        slot: int = 0,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[Event]:
        """Answer the conversation `messages` in `slot`, reusing whatever prefix the slot holds.
        `stop`, asked before each step: when true the turn ends there (no final event), what it
        wrote kept in the slot, as when the service's client disconnects."""
        ids = self.encode_chat(messages, config.max_new_tokens)
        return self._run(self.begin(slot, ids, config), stop)

    def prepare(self, slot: int, ids: Sequence[int]) -> np.ndarray:
        """Bring `slot` to hold `ids` (reusing what it can) and return next-token logits [vocab]."""
        turn = self.begin(slot, ids, SamplingConfig(max_new_tokens=1))
        try:
            while turn.todo:
                logits = turn.prefill_chunk(self.backend, self.cache)
        except BaseException:
            turn.finish("error")
            raise
        finally:
            self.end(turn)
        return logits

    def _run(self, turn: Turn, stop: Callable[[], bool] | None = None) -> Iterator[Event]:
        """The turn's events, one `step` at a time; an error is raised. Ending the iteration
        early (or dropping it, or `stop` turning true) ends the turn. A prompt of more than four
        chunks shows a progress bar on stderr while it is prefilled (minutes on a small board)."""
        progress = tqdm(
            total=len(turn.todo),
            desc="prefill",
            unit="token",
            leave=False,
            disable=len(turn.todo) <= 4 * turn.chunk,
        )
        try:
            while not turn.done and not (stop is not None and stop()):
                todo = len(turn.todo)
                events = self.step([turn]).emitted(turn)
                progress.update(todo - len(turn.todo))
                if events:
                    progress.close()
                for event in events:
                    if event.error is not None:
                        raise event.error
                    yield event
        finally:
            progress.close()
            self.end(turn)

    # -- reuse -------------------------------------------------------------------------------

    def _reuse(self, slot: int, ids: list[int]) -> list[int]:
        """Rewind `slot` to the longest prefix of `ids` it holds or can copy in, note it in the
        slot's session, and return the tokens still to prefill (at least the last one, whose
        logits give the first token)."""
        session = self.sessions[slot]
        if not session.verify(self.cache):
            log.warning(
                "slot %d: cache holds %d tokens, session expected %d (or other tokens); re-prefilling",
                slot,
                self.cache.length(slot),
                len(session.expected),
            )
            session.reset(self.cache)
        kept = len(session.history)
        if session.evicted and len(ids) > kept and common_prefix(session.history, ids) == kept:
            session.reused_tokens = kept
            return ids[kept:]  # windowed slot: append the new turn to what is kept
        if session.evicted:  # changed, or resent as it was (a regenerated reply): evicted tokens
            log.info("slot %d: the conversation does not extend the windowed history; re-prefilling", slot)
            session.reset(self.cache)
        held = self.cache.token_ids(slot)
        keep = common_prefix(held, ids)
        if (
            len(held) - keep >= self.run_time_store.block_tokens
        ):  # another conversation is about to replace it
            if self.run_time_store:
                self.run_time_store.save(self.cache, slot)
            elif self.prefix_disk is not None:
                self._keep_slot(slot)
        keep = self._copy_prefix(slot, ids, keep)
        keep = min(keep, len(ids) - 1)  # the last prompt token is run to get the logits
        # a ring layer may have overwritten what it needs; a state is known at a snapshot only
        keep = self.cache.rewind_limit(slot, keep)
        self.cache.truncate(slot, keep)
        session.history = ids[:keep]
        session.reused_tokens = keep
        return ids[keep:]

    def _copy_prefix(self, slot: int, ids: list[int], keep: int) -> int:
        """Copy in the warm or run-time prefix that shares the most usable leading tokens with
        `ids`, if it can resume from more than the slot, which holds the first `keep`; return how
        many the slot now shares (with per-slot states, it resumes from the prefix's states there)."""

        def usable(stored: Stored, shared: int) -> int:
            return self._usable(stored, shared, ids)

        own = self.cache.rewind_limit(slot, min(keep, len(ids) - 1))  # what the slot can resume from

        warm, warm_shared = self.warm_store.best_match(ids, usable)
        entry, lru_shared = self.run_time_store.best_match(ids, usable)
        if self.prefix_disk is not None:
            stored, disk_shared = self.prefix_disk.best_match(ids, usable)
            # a match shorter than a file would be written for is not worth reading (nor waiting
            # for, when its file is still queued): every chat shares its template's first tokens
            worth = max(own, warm_shared, lru_shared, self.prefix_disk.min_tokens - 1)
            if stored is not None and disk_shared > worth:
                chain = self.prefix_disk.load(stored, disk_shared)  # None: refused and logged
                if chain is not None:
                    for part in chain:  # each file carries the states at its end, the last at disk_shared
                        n = min(disk_shared - part.start, len(part.token_ids))
                        run = ids[part.start : part.start + n]
                        self.cache.write(slot, part.block.head(n), run, part.start, part.states)
                    return disk_shared
        if entry is not None and lru_shared > max(own, warm_shared):
            self.run_time_store.load(self.cache, slot, entry, lru_shared, start=min(keep, lru_shared))
            return lru_shared
        if warm is not None and warm_shared > own:
            self.cache.write(slot, warm.block.head(warm_shared), ids[:warm_shared], states=warm.states)
            return warm_shared
        return keep

    def _usable(self, stored: Stored, shared: int, ids: list[int]) -> int:
        """How many of the `shared` leading tokens of a stored prefix a turn on `ids` can copy
        in (`KVCache.resume_limit`, the rewind rule): at most len(ids) - 1 (the last prompt token
        is run for its logits); none where the prefix's ring layers lack what the first query
        needs; with per-slot states, up to the latest position at or before that where it carries
        them."""
        last = min(shared, len(ids) - 1)
        return self.cache.resume_limit(last, stored.ring_from, stored.state_at)


def _check_ring_features(geometry: CacheGeometry, policy: HistoryPolicy) -> None:
    """Refuse, at load, window eviction for ring geometries (Gemma 3's sliding-window layers):
    eviction moves the kept positions back and re-rotates their keys, which in a ring layer would
    mean re-laying out what it holds at the new p % ring_len under the local RoPE; not done.
    Prefix stores and warm prefixes work (`KVBlock` carries the ring layers' last positions)."""
    if geometry.states and policy.mode == "window":
        raise KvedgeError(
            "history_policy 'window' (eviction moves a run of keys): not supported for this model's "
            "per-slot states (convolution layers), which cannot be moved with them; use 'error' or 'truncate'"
        )
    if geometry.ring_layers and policy.mode == "window":
        raise KvedgeError(
            "history_policy 'window' (eviction re-rotates a contiguous run of keys): not supported "
            f"for this model's sliding-window ring layers (layers {list(geometry.ring_layers)}, "
            f"{geometry.ring_len} positions each); use 'error' or 'truncate'"
        )


def _within(ids: list[int], limit: int | None, what: str) -> list[int]:
    """`ids`, or ContextOverflow when there are more than `limit` (a service's max_prompt_tokens)."""
    if limit is not None and len(ids) > limit:
        raise ContextOverflow(
            f"{what} {len(ids)} tokens; this server accepts at most {limit} prompt tokens per "
            "request (max_prompt_tokens)",
            cause="prompt",
        )
    return ids


def _at_least(tokenizer: ChatTokenizer, text: str, limit: int, what: str) -> None:
    """ContextOverflow when `text` is surely over `limit` tokens (`fewest_tokens`)."""
    fewest = tokenizer.fewest_tokens(text, limit)
    if fewest > limit:
        size = len(text.encode(errors="replace"))  # counted again only for the message
        raise ContextOverflow(
            f"the {what} at least {fewest} tokens ({size} bytes of text); this server accepts at "
            f"most {limit} prompt tokens per request (max_prompt_tokens)",
            cause="prompt",
        )


def _not_a_folder(path: Path) -> str:
    """Why `path`, given as a model, is not one: a GGUF (or other) file is a source to export."""
    if path.suffix.lower() == ".gguf" and path.is_file():
        command = f"kvedge export {shlex.quote(str(path))} --out DIR"
        return f"{path} is a GGUF file, a source to export first: `{command}`, then use --model DIR"
    if path.exists():
        return f"model {str(path)!r} is not a folder; give the folder `kvedge export` wrote"
    return f"model folder {str(path)!r} does not exist"
