"""Speculative decoding with a draft model: a smaller or cheaper export with the same tokenizer
(e.g. `--variant ort --weights int4` of the target's model) proposes the next k tokens greedily;
the target verifies them in one call as for prompt lookup (kvedge.runtime.speculate).

The draft has its own cache, one slot per target slot (the same pool design: a `KVCache` of its
geometry, bound by its own backend), and never touches the target's cache, prefix store or warm
prefixes. Before each proposal the draft slot is brought to the target's context, the
conversation and the reply so far with the pending token last (`Draft.sync`)::

    keep      the common prefix of the token ids the draft slot holds and the context (less the
              last token: its logits are the first proposal's)
    rewind    the rest by lowering the slot's valid length (`KVCache.truncate`)
    prefill   the context's tokens past what was kept, in one call (a chunk at a time)
    decode    k - 1 greedy steps: d1 = argmax after the context, d2 after d1, ..

and after the verify, rewound to the context plus the proposals the target kept
(`DraftProposer.kept`), so it holds only tokens the target's slot holds. A greedy draft is a
point-mass proposal, so `speculate.accept`'s rejection rule keeps sampled replies in
distribution, as for lookup.

Gemma 3's ring layers keep the last `window + ring_margin` positions: a rewind further back than
the margin allows (`KVCache.rewind_limit`) turns the draft off for the rest of the turn; at the
start of a turn the draft slot starts over instead (a prefill, as the target's own).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvedge.contract import TOKENIZER_FILE, Manifest, sha256_files
from kvedge.errors import KvedgeError
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.interface import Backend
from kvedge.runtime.sessions import common_prefix
from kvedge.runtime.speculate import Adaptive

log = logging.getLogger(__name__)


class LoadedModel(Protocol):
    """What a draft (and the tokenizer check) uses of a `kvedge.runtime.model.Model`, which
    imports this module."""

    folder: Path
    manifest: Manifest
    cache: KVCache
    backend: Backend

    def close(self) -> None: ...


def tokenizer_fingerprint(folder: Path, manifest: Manifest) -> str:
    """What token ids mean in the export in `folder`: the sha256 of its tokenizer file with its
    vocabulary size (the logits' width)."""
    return f"{sha256_files([folder / TOKENIZER_FILE])[:16]}/vocab {manifest.vocab_size}"


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    mine = tokenizer_fingerprint(target.folder, target.manifest)
    theirs = tokenizer_fingerprint(draft.folder, draft.manifest)
    if mine != theirs:
        raise KvedgeError(
            f"draft {draft.folder} has another tokenizer than the target {target.folder}: fingerprint "
            f"{theirs} against {mine}; a draft must be an export with the target's tokenizer "
            "(e.g. the same model with --weights int4)"
        )


class Draft:
    """A loaded draft model (a `kvedge.runtime.model.Model` with one slot per target slot) and
    how to keep its slots in step with the target's."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.folder = model.folder.resolve()
        self.sync_s = 0.0  # seconds the last `sync` took

    @property
    def max_len(self) -> int:
        return self.model.manifest.geometry.max_len

    def close(self) -> None:
        self.model.close()

    def sync(self, slot: int, context: Sequence[int], restart: bool) -> np.ndarray | None:
        """Bring `slot` to hold `context` and return the logits after it [vocab]; None when a ring
        layer cannot rewind to what the slot shares with it, unless `restart` (then the slot
        starts over)."""
        cache, backend = self.model.cache, self.model.backend
        keep = min(common_prefix(cache.token_ids(slot), context), len(context) - 1)
        if cache.rewind_limit(slot, keep) != keep:
            if not restart:
                return None
            keep = 0
        cache.truncate(slot, keep)
        started = time.perf_counter()
        logits = prefill(backend, cache, slot, [list(context[keep:])])[0]
        self.sync_s = time.perf_counter() - started
        return logits

    def propose(self, slot: int, context: Sequence[int], k: int, restart: bool) -> list[int] | None:
        """k greedy tokens after `context` (the slot then holds context + the first k - 1 of
        them); None as `sync`."""
        k = min(k, self.max_len - len(context) + 1)
        if k < 1:
            return None
        logits = self.sync(slot, context, restart)
        if logits is None:
            return None
        tokens = [int(np.argmax(logits))]
        while len(tokens) < k:
            logits = decode_one_token(self.model.backend, self.model.cache, slot, [tokens[-1]])[0]
            tokens.append(int(np.argmax(logits)))
        return tokens

    def rewind(self, slot: int, length: int) -> bool:
        """Keep the first `length` tokens of `slot` (or all it holds, if fewer); False when its
        ring layers cannot rewind that far."""
        cache = self.model.cache
        length = min(length, cache.length(slot))
        if cache.rewind_limit(slot, length) != length:
            return False
        cache.truncate(slot, length)
        return True


@dataclass
class DraftProposer(Adaptive):
    """One turn's proposals from `draft` in its slot `slot` (the target's slot number)."""

    draft: Draft | None = None
    slot: int = 0
    off: bool = False  # a rewind the draft's rings could not make: no more proposals this turn
    started: bool = False  # the first proposal of the turn may start the draft slot over
    context: int = 0  # tokens of the context of the last proposal

    def proposals(self, history: Sequence[int], k: int) -> list[int]:
        assert self.draft is not None
        if self.off or len(history) > self.draft.max_len:
            return []
        tokens = self.draft.propose(self.slot, history, k, restart=not self.started)
        if not self.started:  # the draft prefilled the turn's prompt: the prompt's cost
            self.unweighed_s = self.draft.sync_s
        self.started = True
        if tokens is None:
            self._turn_off("its ring layers cannot rewind that far")
            return []
        self.context = len(history)
        return tokens

    def kept(self, proposals: int) -> None:
        assert self.draft is not None
        if not self.draft.rewind(self.slot, self.context + proposals):
            self._turn_off("its ring layers cannot rewind past the rejected proposals")

    def _turn_off(self, why: str) -> None:
        self.off = True
        log.info("slot %d: draft proposals off for the rest of the turn: %s", self.slot, why)
