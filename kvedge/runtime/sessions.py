"""Chat sessions over cache slots: prefix reuse, self-checks, and long-conversation policies.

A session is bound to one slot and remembers what that slot should hold. Each turn:

1. **Check**: the slot's valid length and token record must equal what the session left there.
   On any mismatch the slot is reset and the whole conversation re-prefilled (logged); the
   runtime never continues on a suspect cache.
2. **Reuse**: the slot rewinds to the longest common token prefix of what it holds and the new
   conversation (so resent, edited or regenerated history stays exact); a warm prefix that
   covers more of the conversation is copied in instead. Only the rest is prefilled.
3. **Fit**, by `HistoryPolicy.mode`:
   - `error`: refuse with the token counts.
   - `truncate`: drop the oldest whole turns (the system prompt stays), re-render, re-prefill.
   - `window`: StreamingLLM. Keep the first `n_sink` tokens and the most recent ones; when the
     slot is full, evict `evict_chunk` tokens after the sinks at once. Positions are reassigned
     within the cache: kept keys are re-rotated by the shift (`kvedge.runtime.rope`), which
     keeps the graph unchanged and costs one pass over the cache per eviction, not per token.
     After an eviction the slot's tokens no longer equal the conversation, so the session
     keeps the full (logical) token history separately and appends new turns to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
from msgspec import Meta

from kvedge.declare import Flag
from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.runtime.cache import KVCache

log = logging.getLogger(__name__)

POLICIES = ("error", "window", "truncate")


@dataclass(frozen=True)
class HistoryPolicy:
    mode: Annotated[
        Literal[POLICIES],
        Meta(description=f"one of {list(POLICIES)}"),
        Flag(
            "What to do when a conversation outgrows the cache: error, window (keep the first "
            "--n-sink tokens and the latest) or truncate (drop the oldest turns).",
            key="history_policy",
        ),
    ] = "error"
    n_sink: Annotated[
        int, Meta(ge=0, le=1_000_000, description="an integer >= 0"), Flag("window: tokens never evicted.")
    ] = 4
    evict_chunk: int = 0  # window: tokens evicted at once when full (0: a quarter of max_len)

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise KvedgeError(f"history_policy={self.mode!r} is not allowed; allowed: {list(POLICIES)}")
        if not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise KvedgeError(f"n_sink={self.n_sink!r} must be an integer >= 0")
        if not isinstance(self.evict_chunk, int) or self.evict_chunk < 0:
            raise KvedgeError(f"evict_chunk={self.evict_chunk!r} must be an integer >= 0")

    # The fit rule, one owner: what fits a cache of max_len tokens under this policy. The cache
    # itself only guards its bounds (`KVCache.check_room`).

    def check_prompt(self, prompt_tokens: int, max_len: int) -> None:
        """Refuse, under `error`, a conversation that leaves no room for a reply; the window
        policy makes room itself and truncate has already dropped turns (`truncate_budget`)."""
        if self.mode == "error" and prompt_tokens >= max_len:
            raise ContextOverflow(
                f"the conversation has {prompt_tokens} tokens; the cache holds at most {max_len} "
                "(max_len), leaving no room for a reply. Start a new conversation or use "
                "history_policy 'window' (--history-policy); 'truncate' helps only when the last "
                "user turn alone fits",
                cause="prompt",
            )

    def fit_reply(
        self, prompt_tokens: int, max_len: int, requested: int | None, default: int, overflow: str = "clip"
    ) -> int:
        """How many tokens a reply may have. Under `error` the prompt must leave room; a reply
        that would not fit is cut at the end of the cache ("clip") or refused ("reject"); under
        window and truncate the runtime makes the conversation fit itself."""
        if self.mode != "error":
            return default if requested is None else requested
        self.check_prompt(prompt_tokens, max_len)
        room = max_len - prompt_tokens
        if requested is None:
            return min(default, room)
        if requested > room and overflow == "reject":
            raise ContextOverflow(
                f"the model's context is {max_len} tokens: the messages take {prompt_tokens} and "
                f"max_tokens asks for {requested} more ({prompt_tokens + requested} in total)",
                cause="reply",
            )
        return requested

    def truncate_budget(self, max_len: int, reserve: int) -> int:
        """Prompt tokens the truncate policy keeps: room for `reserve` reply tokens, at most
        half the cache."""
        return max_len - min(reserve, max_len // 2)

    def overflow_last_turn(
        self, prompt_tokens: int, budget: int, max_len: int, reserve: int
    ) -> ContextOverflow:
        return ContextOverflow(
            f"the last turn alone has {prompt_tokens} tokens; at most {budget} fit "
            f"(max_len {max_len} minus {reserve} reserved for the reply)",
            cause="prompt",
        )


def pick_slot(
    free: Sequence[int], ids: Sequence[int], held: Callable[[int], np.ndarray], last_used: Sequence[float]
) -> tuple[int, int]:
    """(slot, shared tokens): the free slot sharing the longest token prefix with `ids`, and among
    equals (no match included) the least recently used."""
    shared = {slot: common_prefix(held(slot), ids) for slot in free}
    slot = max(free, key=lambda s: (shared[s], -last_used[s]))
    return slot, shared[slot]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


@dataclass
class ChatSession:
    """What one slot should hold, as the session left it."""

    slot: int
    expected: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # slot's token record
    history: list[int] = field(default_factory=list)  # every token of the conversation (logical)
    evicted: int = 0  # tokens dropped by the window policy so far
    reused_tokens: int = 0  # prefix tokens reused by the last turn (slot or warm prefix)

    def verify(self, cache: KVCache) -> bool:
        held = cache.token_ids(self.slot)
        return len(held) == len(self.expected) and bool(np.array_equal(held, self.expected))

    def reset(self, cache: KVCache) -> None:
        cache.reset(self.slot)
        self.expected = np.zeros(0, np.int64)
        self.history = []
        self.evicted = 0

    def record(self, cache: KVCache, appended: Sequence[int]) -> None:
        """Note what the slot holds now, after `appended` tokens were fed to it."""
        self.expected = cache.token_ids(self.slot).copy()
        self.history.extend(int(t) for t in appended)


class RoomMaker:
    """Makes room in a slot for n new tokens according to the policy (the `make_room` hook)."""

    def __init__(
        self, cache: KVCache, policy: HistoryPolicy, inv_freq: np.ndarray, session: ChatSession
    ) -> None:
        self.cache, self.policy, self.inv_freq, self.session = cache, policy, inv_freq, session

    def __call__(self, slot: int, count: int) -> None:
        room = self.cache.room(slot)
        if count <= room:
            return
        if self.policy.mode != "window":
            self.cache.check_room(slot, count)  # raises ContextOverflow with the counts
        max_len = self.cache.geometry.max_len
        chunk = self.policy.evict_chunk or max(1, max_len // 4)
        evictable = self.cache.length(slot) - self.policy.n_sink
        evict = min(max(count - room, chunk), evictable)
        if evict < count - room:
            raise ContextOverflow(
                f"{count} new tokens do not fit even after evicting all {evictable} non-sink tokens "
                f"(max_len {max_len}, n_sink {self.policy.n_sink})"
            )
        log.debug("slot %d: window evicts %d tokens after %d sinks", slot, evict, self.policy.n_sink)
        self.cache.evict(slot, self.policy.n_sink, evict, self.inv_freq)
        self.session.evicted += evict
