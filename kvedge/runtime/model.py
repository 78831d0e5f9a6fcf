"""The runtime's public API: load an artifact folder once, then stream chat turns."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from kvedge.contract import ONNX_FILE, Manifest, sha256_files
from kvedge.errors import ArtifactMismatch, ContextOverflow, KvedgeError
from kvedge.runtime.backend import OrtBackend
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import PREFILL_CHUNK, Event, SamplingConfig, decode_stream, prefill
from kvedge.runtime.prefix import PrefixLRU
from kvedge.runtime.sessions import ChatSession, ContextPolicy, RoomMaker, common_prefix
from kvedge.runtime.tokenizer import ChatTokenizer, TextStream
from kvedge.runtime.warmup import PrefixStore, WarmupConfig, WarmupReport, warm_up

log = logging.getLogger(__name__)

__all__ = ["Model", "common_prefix"]


class Model:
    """An exported model with its tokenizer, a preallocated cache of `slots` sequences, one
    `ChatSession` per slot, optionally warm prefixes loaded (or rebuilt) at start-up, and
    optionally a store of `prefix_cache_bytes` for prefixes seen at run time (`PrefixLRU`)."""

    def __init__(
        self,
        folder: str | Path,
        slots: int = 1,
        threads: int | None = None,
        provider: str = "cpu",
        policy: ContextPolicy | None = None,
        warmup: WarmupConfig | None = None,
        warm_dir: str | Path | None = None,
        verify: bool = True,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise KvedgeError(f"model folder {str(self.folder)!r} does not exist")
        self.manifest = Manifest.load(self.folder)
        if verify:
            self._verify_graph()
        self.policy = policy or ContextPolicy()
        # one decode binding per contiguous slot range, so batched decode never rebuilds one
        ranges = min(64, max(8, slots * (slots + 1) // 2))
        self.backend = OrtBackend(
            self.folder, self.manifest, threads=threads, provider=provider, max_decode_bindings=ranges
        )
        self.tokenizer = ChatTokenizer(self.folder, self.manifest)
        self.cache = KVCache(self.manifest.geometry, slots)
        self.backend.reserve(self.cache.layer_views(0, slots), self.manifest.geometry.max_len)
        self.sessions = [ChatSession(slot) for slot in range(slots)]
        self.prefix_lru = PrefixLRU(self.manifest.geometry, prefix_cache_bytes)
        self.inv_freq = np.asarray(self.manifest.rope.inv_freq, np.float64)
        if self.policy.mode == "window" and self.inv_freq.size != self.manifest.geometry.head_dim // 2:
            raise KvedgeError(
                "context_policy 'window' needs RoPE frequencies in the manifest; re-export the model"
            )
        self.prefixes = PrefixStore()
        self.warmup_report: WarmupReport | None = None
        if warmup is not None:
            if warm_dir is None:
                raise KvedgeError("a warm-up config needs a warm cache folder (--warm-dir)")
            self.prefixes, self.warmup_report = warm_up(self, warmup, warm_dir)
            for session in self.sessions:
                session.reset(self.cache)
        log.info(
            "loaded %s: %d slots x %d tokens, KV pool %.1f MiB, %d warm prefixes, prefix LRU %.1f MiB",
            self.folder,
            slots,
            self.manifest.geometry.max_len,
            self.cache.nbytes / 2**20,
            len(self.prefixes),
            self.prefix_lru.capacity_bytes / 2**20,
        )

    def _verify_graph(self) -> None:
        onnx_files = [self.folder / ONNX_FILE]
        data = self.folder / (ONNX_FILE + ".data")
        if data.exists():
            onnx_files.append(data)
        found = sha256_files(onnx_files)
        if found != self.manifest.onnx_fingerprint:
            raise ArtifactMismatch(
                f"{self.folder / ONNX_FILE}: graph fingerprint {found[:16]} does not match the "
                f"manifest's {self.manifest.onnx_fingerprint[:16]}; re-export the model"
            )

    def stream(
        self, prompt: str, config: SamplingConfig, raw: bool = False, slot: int = 0
    ) -> Iterator[Event]:
        """One turn on its own: `prompt` as a user message (or raw text), ignoring earlier turns."""
        if raw:
            ids = self.tokenizer.encode(prompt)
            self.sessions[slot].reset(self.cache)
            return self._turn(slot, ids, config)
        return self.chat([{"role": "user", "content": prompt}], config, slot=slot)

    def chat(
        self, messages: Sequence[dict[str, str]], config: SamplingConfig, slot: int = 0
    ) -> Iterator[Event]:
        """Answer the conversation `messages` in `slot`, reusing whatever prefix the slot holds."""
        messages = list(messages)
        ids = self.tokenizer.encode_chat(messages)
        if self.policy.mode == "truncate":
            messages, ids = self._truncate_turns(messages, ids, config.max_new_tokens)
        return self._turn(slot, ids, config)

    def prepare(self, slot: int, ids: Sequence[int]) -> np.ndarray:
        """Bring `slot` to hold `ids` (reusing what it can) and return next-token logits [vocab]."""
        session = self.sessions[slot]
        if not session.verify(self.cache):
            log.warning(
                "slot %d: cache holds %d tokens, session expected %d (or other tokens); re-prefilling",
                slot,
                self.cache.length(slot),
                len(session.expected),
            )
            session.reset(self.cache)
        ids = list(ids)
        if session.evicted and common_prefix(session.history, ids) == len(session.history):
            new = ids[len(session.history) :]  # windowed slot: append the new turn to what is kept
            session.reused_tokens = len(session.history)
            if not new:
                raise KvedgeError("the conversation has no new tokens after the cached history")
        else:
            if session.evicted:
                log.info("slot %d: history changed before the window; re-prefilling", slot)
                session.reset(self.cache)
            held = self.cache.token_ids(slot)
            keep = common_prefix(held, ids)
            if self.prefix_lru and len(held) - keep >= self.prefix_lru.block_tokens:
                self.prefix_lru.save(self.cache, slot)  # another conversation is about to replace it
            keep = self._copy_prefix(slot, ids, keep)
            keep = min(keep, len(ids) - 1)  # the last prompt token is run to get the logits
            self.cache.truncate(slot, keep)
            session.history = ids[:keep]
            session.reused_tokens = keep
            new = ids[keep:]
        make_room = None
        if self.policy.mode == "window":
            make_room = RoomMaker(self.cache, self.policy, self.inv_freq, session)
        elif len(new) > self.cache.room(slot):
            raise ContextOverflow(
                f"the conversation has {len(ids)} tokens; the cache holds at most "
                f"{self.manifest.geometry.max_len} (max_len). Start a new conversation or use "
                "context_policy 'window' or 'truncate'"
            )
        chunk = PREFILL_CHUNK
        if make_room is not None:
            chunk = max(1, min(PREFILL_CHUNK, (self.manifest.geometry.max_len - self.policy.n_sink) // 2))
        try:
            logits = prefill(self.backend, self.cache, slot, [new], chunk=chunk, make_room=make_room)[0]
        except BaseException:
            session.reset(self.cache)  # a half-written turn is never reused
            raise
        session.record(self.cache, new)
        return logits

    def _copy_prefix(self, slot: int, ids: list[int], keep: int) -> int:
        """Copy in the warm or run-time prefix that shares the most leading tokens with `ids`, if
        it shares more than the `keep` the slot holds; return how many the slot now shares."""
        warm, warm_shared = self.prefixes.best_match(ids)
        entry, lru_shared = self.prefix_lru.best_match(ids)
        if entry is not None and lru_shared > max(keep, warm_shared):
            self.prefix_lru.load(self.cache, slot, entry, lru_shared, start=keep)
            return lru_shared
        if warm is not None and warm_shared > keep:
            self.cache.write(slot, warm.block.head(warm_shared), ids[:warm_shared])
            return warm_shared
        return keep

    def _turn(self, slot: int, ids: list[int], config: SamplingConfig) -> Iterator[Event]:
        started = time.perf_counter()
        session = self.sessions[slot]
        logits = self.prepare(slot, ids)
        make_room = RoomMaker(self.cache, self.policy, self.inv_freq, session)
        seen = list(session.history)
        generated_from = len(seen)
        events = decode_stream(
            self.backend,
            self.cache,
            slot,
            logits,
            config,
            self.manifest.eos_token_ids,
            TextStream(self.tokenizer, config.stop),
            seen,
            make_room,
            len(ids),
            started,
        )
        return self._recorded(session, events, seen, generated_from)

    def _recorded(
        self, session: ChatSession, events: Iterator[Event], seen: list[int], start: int
    ) -> Iterator[Event]:
        """Pass events through; whenever the stream ends (even abandoned), note what the slot holds."""
        try:
            yield from events
        finally:
            written = seen[start:]  # tokens appended to the slot during decoding
            session.record(self.cache, written)

    def _truncate_turns(
        self, messages: list[dict[str, str]], ids: list[int], reserve: int
    ) -> tuple[list[dict[str, str]], list[int]]:
        """Drop the oldest whole turns (keeping system messages) until prompt + reply fit."""
        budget = self.manifest.geometry.max_len - min(reserve, self.manifest.geometry.max_len // 2)
        while len(ids) > budget:
            first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
            later_user = next(
                (i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None
            )
            if later_user is None:
                raise ContextOverflow(
                    f"the last turn alone has {len(ids)} tokens; at most {budget} fit "
                    f"(max_len {self.manifest.geometry.max_len} minus {reserve} reserved for the reply)"
                )
            log.info("truncate: dropping %d oldest messages", later_user - first)
            messages = messages[:first] + messages[later_user:]
            ids = self.tokenizer.encode_chat(messages)
        return messages, ids
