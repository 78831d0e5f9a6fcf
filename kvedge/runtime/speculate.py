"""Speculative decoding by prompt lookup: propose the tokens that followed the conversation's
last few tokens where they occurred before, verify them in one forward pass, keep what the
model would have produced anyway.

A step of a turn whose pending token p (sampled, not yet in the slot of valid length L) has
proposals d1..dk (`propose`)::

    verify     run [p, d1..dk] at positions L..L+k in one call with logits at every one of
               them ("rows"-logits graph): row i is the next-token distribution after d_i (row 0
               after p), exactly what k+1 decode steps would compute
    accept     row by row, as the decode loop would sample: greedy, t_i = argmax(row i); go on
               while t_i == d_{i+1}. Sampled, the standard rejection rule with the proposal
               distribution q = a point mass at d_{i+1} (prompt lookup is deterministic):
               accept d_{i+1} with probability min(1, p(d)/q(d)) = p(d); on rejection draw from
               normalize(max(0, p - q)) = p with d removed; either way each emitted token has
               the distribution p (`accept`). Row i + 1 is read only after acceptance at i.
    roll back  the c = i + 1 tokens p, d1..d_i become valid (the slot's length moves L -> L + c);
               nothing else: a portable graph's new K/V of the rejected tokens are never copied
               into the pool, an in-place graph's sit beyond the valid length, masked by it and
               overwritten by the next write. Gemma 3's ring layers are portable-only, so nothing
               rejected reaches a ring either. The slot's token ids, the prefix store and warm
               prefixes only ever see valid tokens. A model with per-slot states (LFM2, Qwen3.5)
               has no valid length to lower in them: the verify's new states (after all k + 1
               tokens) are kept only when everything was taken; otherwise the slot's states are
               still those at L, and the c tokens run again to carry them to L + c, charged to
               the step (`Adaptive.rolled_back`).

Adaptive k (`Adaptive`, every proposer's policy): k starts at `FIRST_LOOKUP` for prompt
lookup and `FIRST_DRAFT` for a draft model, grows (to `MAX_DRAFT`) while every proposal is taken
and falls to one more than was taken otherwise.

Proposing pauses where it does not pay, so a conversation that does not repeat itself decodes as
without speculation, but for the lookup itself (microseconds; a draft catches up on the tokens
it missed in one call when it resumes). Each speculative step's seconds (proposing and
verifying; not a draft's prefill of the turn's prompt, which is the prompt's cost, not the
step's: `unweighed_s`) are weighed against what its tokens would have cost decoded:

    costs     the model keeps its decode steps' seconds by the rows decoded together, D(B); a
              step of B turns whose D(B) was never measured proposes nothing, so all B decode
              and measure it (`Costs`)
    worth     in a step of B turns a decoded token costs D(B) / B (`Costs.share_s`; alone, a
              decode call); when v of them verify, the B - v left decode in a call dearer per
              row, and the v share the difference (`Costs.broken_s`)
    pause     the turn keeps the seconds it saved (`Adaptive.saved_s`); a step that loses more
              pauses proposing for as many steps as make the loss `LOSS_BUDGET` of their time
              (D(B) / B each; at most `MAX_PAUSE`)
    ramp      a full take below `MAX_DRAFT` (k ramping up: 1, 3, 5, ..) only carries its loss
              to the next step, while the turn's own steps say a full take of MAX_DRAFT would
              pay (`Adaptive.may_pay`); beside other turns, proposals start at the fewest that
              could pay if all were taken (`Adaptive.least_k`)

Where a verify costs nearly a decode step per row (int4 weights on a CPU without AVX-512),
partial takes do not pay; where it costs little more than one step (float weights, a GPU), they
do. Beside other turns' batched decode call, a verify call of its own costs a whole call against
a row's share, so it pays only for long takes. Turns in neighbouring slots that verify in the
same step share one call, their rows right-padded to the longest, where the model measured that
call no dearer than theirs apart (`Costs.groups`): the weights are read once for all rows
(docs/PERFORMANCE.md, "Several replies decoding together"). Before any
decode is measured, a verify that took nothing pauses for 1, 2, 4, .. steps (`MISSES`).

Proposers: `Lookup` (prompt lookup, here) and `kvedge.runtime.draft.DraftProposer` (a smaller
model with the same tokenizer decoding greedily: a point mass too, so `accept` stays exact).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from kvedge.contract import VERIFY_TOKENS
from kvedge.errors import KvedgeError

Speculate = Literal["off", "lookup", "draft"]  # "draft": the draft loaded with the model (RunOptions.draft)
SPECULATE_MODES: tuple[str, ...] = get_args(Speculate)
# the retired form naming the draft in the mode, "draft:DIR": flags and service configs still
# read it (`legacy_draft`), with a warning; a request never did need the folder
LEGACY_DRAFT = "draft:"
# most tokens proposed per step, by what a verify of 9 costs in decode steps (docs/PERFORMANCE.md,
# "Speculative decoding by prompt lookup"); TensorRT engines are built for verifies of
# VERIFY_TOKENS, and ort graphs compute them exactly as decode steps
MAX_DRAFT = VERIFY_TOKENS - 1
# k of a turn's first proposal: a draft model's proposals are mostly taken (96% in open chat on
# SmolLM2-135M); prompt lookup's first probes of a reply mostly fail in open chat, and a failed
# verify of 4 costs 1.7-2.0 decode steps with int4 weights against 0.9-1.2 for one (the same
# section; a full take grows k by 2: 1, 3, 5, 7, 8)
FIRST_DRAFT = 4
FIRST_LOOKUP = 1
# suffix lengths looked up, longest first: 2 matched common pairs of open chat ("of the") and
# proposed wrongly a third of its steps on SmolLM2-135M; after an edit, 3 resyncs one token later
MIN_NGRAM, MAX_NGRAM = 3, 5
MISSES = 1  # verifies in a row that took nothing before lookup pauses (unmeasured costs)
MAX_PAUSE = 256  # steps
# of a turn's decode time that speculative steps which do not pay may lose: a loss pauses
# proposing for as many steps as make it this share of their time
LOSS_BUDGET = 0.02
TIMINGS = 8  # a turn's latest speculative steps that say what a verify of n tokens costs
DECODE_WEIGHT = 0.2  # of the latest call in the running average of a call shape's seconds


def check_mode(mode: object) -> str:
    """`mode` if it is one of SPECULATE_MODES, else a KvedgeError naming them."""
    if mode not in SPECULATE_MODES:
        raise KvedgeError(f"speculate={mode!r} is not allowed; allowed: {list(SPECULATE_MODES)}")
    return str(mode)


def legacy_draft(value: object) -> Path | None:
    """DIR of the retired "draft:DIR" form of a speculate value, else None; refuses "draft:" with
    no folder. The one reader of that form: `--speculate` and the service config's `speculate`
    turn it into speculate "draft" and the draft folder (`RunOptions.draft`), warning."""
    if not isinstance(value, str) or not value.startswith(LEGACY_DRAFT):
        return None
    folder = value[len(LEGACY_DRAFT) :].strip()
    if not folder:
        raise KvedgeError(f"speculate={value!r} names no draft folder; allowed: {list(SPECULATE_MODES)}")
    return Path(folder)


def lookup(history: np.ndarray, k: int, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM) -> list[int]:
    """`k` tokens that followed the latest earlier occurrence of the longest suffix of
    `history` [tokens] int64 of max_ngram .. min_ngram tokens; [] when none occurs before. A
    continuation that reaches the end of `history` goes on with the proposal itself: a match
    p tokens back proposes the last p tokens again, and again (a loop, or a list, repeating)."""
    if len(history) <= min_ngram:  # no room for a match before the end
        return []
    longest = min(max_ngram, len(history) - 1)
    # where an earlier occurrence of the last 1, 2, .. tokens ends: the last token's earlier
    # places, kept while the tokens before them go on matching (a few places, not every window
    # of the history, since this runs every decode step: docs/PERFORMANCE.md, "Speculative
    # decoding by prompt lookup")
    ends = [np.flatnonzero(history[:-1] == history[-1])]  # [places]
    for back in range(1, longest):
        places = ends[-1][ends[-1] >= back]
        ends.append(places[history[places - back] == history[-1 - back]])
    for n in range(longest, min_ngram - 1, -1):
        if ends[n - 1].size:
            start = int(ends[n - 1][-1]) + 1  # the latest
            period = len(history) - start  # >= 1: the match ends before the history does
            return [int(history[start + i % period]) for i in range(k)]
    return []


def accept(probs: np.ndarray, proposal: int, rng: np.random.Generator) -> int:
    """One token with distribution `probs` [vocab] given a proposal drawn from a point mass:
    `proposal` with probability probs[proposal], else a draw from the rest, renormalized."""
    p = float(probs[proposal])
    if rng.random() < p:
        return proposal
    rest = probs.copy()
    rest[proposal] = 0.0
    return int(rng.choice(rest.size, p=rest / rest.sum()))


def _average_into(table: dict, key: object, seconds: float) -> None:
    """table[key] moves `DECODE_WEIGHT` of the way to `seconds` (its first value: `seconds`)."""
    last = table.get(key)
    table[key] = seconds if last is None else last + DECODE_WEIGHT * (seconds - last)


@dataclass
class Costs:
    """A model's decode seconds by the rows decoded together (running averages), measured on its
    own decode steps and shared by its turns' proposers: what speculative steps are weighed
    against."""

    calls: dict[int, float] = field(default_factory=dict)  # busy rows -> a decode step's seconds
    # (rows, tokens per row) -> a verify call's seconds: turns in neighbouring slots may verify
    # together, their rows right-padded to the longest (`groups`)
    verifies: dict[tuple[int, int], float] = field(default_factory=dict)

    def decoded(self, seconds: float, rows: int = 1) -> None:
        """Decoding `rows` turns' tokens took `seconds` (a step's decode calls together, idle rows
        riding along included)."""
        _average_into(self.calls, rows, seconds)

    def verified(self, seconds: float, rows: int, width: int) -> None:
        """A verify call of `rows` rows of up to `width` tokens took `seconds`."""
        _average_into(self.verifies, (rows, width), seconds)

    def groups(self, widths: Sequence[int]) -> bool:
        """Whether verifies of `widths` tokens in neighbouring slots run as one call (rows padded
        to the longest) rather than a call each: when that call was never measured (to measure
        it), or was measured no dearer than the separate calls, once each of those was measured.
        One call reads the weights once for all rows (SmolLM2-135M float32, one core: 4 rows of
        5 took 2.98 decode steps, one row 1.27), but computes every row's padding too. (In-place
        graphs run a padded call row by row, `OrtBackend.run`: their turns verify apart.)"""
        if len(widths) < 2:
            return False
        together = self.verifies.get((len(widths), max(widths)))
        if together is None:
            return True
        if any((1, width) not in self.verifies for width in widths):
            return False
        return together <= sum(self.verifies[1, width] for width in widths)

    def call_s(self, rows: int) -> float:
        """D(rows): a decode call's seconds, 0 for no rows. A row count not measured lies on the
        line through the two measured counts nearest it (one measured: that call's seconds);
        0 before any call is measured (`measured`)."""
        if rows <= 0 or not self.calls:
            return 0.0
        if rows in self.calls:
            return self.calls[rows]
        near = sorted(self.calls, key=lambda n: (abs(n - rows), n))[:2]
        if len(near) == 1:
            return self.calls[near[0]]
        (a, b), (da, db) = near, (self.calls[near[0]], self.calls[near[1]])
        return max(0.0, da + (db - da) * (rows - a) / (b - a))

    def knows(self, rows: int) -> bool:
        """Whether a decode call of `rows` rows was measured."""
        return rows in self.calls

    @property
    def measured(self) -> bool:
        return bool(self.calls)

    def share_s(self, batch: int = 1) -> float:
        """A token's seconds decoded in a step of `batch` turns: D(batch) / batch."""
        return self.call_s(batch) / max(1, batch)

    def broken_s(self, batch: int = 1, verifying: int = 1) -> float:
        """Seconds a turn verifying in a step of `batch` turns, `verifying` of which verify, costs
        the turns left decoding: their call of batch - verifying rows is dearer per row than one
        of all (a call's fixed cost over fewer rows), (D(B - v) - (B - v) D(B) / B) / v; 0 when
        every turn verifies."""
        verifying = max(1, min(verifying, batch))
        left = batch - verifying
        return max(0.0, self.call_s(left) - left * self.share_s(batch)) / verifying


@dataclass
class Adaptive:
    """One turn's proposer state: how many to propose next, and counts for reports. Subclasses
    say what to propose (`proposals`)."""

    k: int = FIRST_DRAFT
    misses: int = 0  # verifies in a row that took nothing
    unweighed_s: float = 0.0  # seconds of the last `proposals` not the step's (a draft's prompt)
    pause: int = 0  # steps left without lookup
    backoff: int = 1  # the next pause
    verifies: int = 0
    proposed: int = 0
    accepted: int = 0
    costs: Costs = field(default_factory=Costs)
    saved_s: float = 0.0  # seconds this turn's speculative steps saved against decoding, net
    # (tokens verified, seconds) of the turn's latest speculative steps: what a verify of n costs
    timings: list[tuple[int, float]] = field(default_factory=list)

    def propose(self, history: Sequence[int], room: int, batch: int = 1) -> list[int]:
        """Proposals to follow `history` (the conversation and the reply, the pending token
        last), at most `room`, in a step of `batch` turns; [] while paused."""
        self.unweighed_s = 0.0
        if self.pause:
            self.pause -= 1
            return []
        k = min(max(self.k, self.least_k(batch)), room)
        if k < 1:
            return []
        return self.proposals(history, k)

    def may_pay(self, batch: int = 1, verifying: int = 1) -> bool:
        """Whether a full take of MAX_DRAFT could pay in such a step: its tokens' worth against
        the seconds the line through this turn's recent steps (tokens verified -> seconds) gives
        a verify of that many; True while the steps seen are all of one size."""
        sizes = np.array([n for n, _ in self.timings], np.float64)
        if sizes.size == 0 or np.ptp(sizes) == 0:
            return True
        slope, intercept = np.polyfit(sizes, [t for _, t in self.timings], 1)
        n = MAX_DRAFT + 1
        return n * self.costs.share_s(batch) - self.costs.broken_s(batch, verifying) > intercept + slope * n

    def least_k(self, batch: int = 1) -> int:
        """The fewest proposals that could pay in a step of `batch` turns if all were taken: a
        verify costs at least a decode call of one row, and beside other turns the tokens it
        makes are worth a share of their decode call (`update`). 1 alone or unmeasured."""
        share = self.costs.share_s(batch)
        if share <= 0:
            return 1
        need = self.costs.call_s(1) + self.costs.broken_s(batch, 1)
        return max(1, min(MAX_DRAFT, math.ceil(need / share) - 1))

    def proposals(self, history: Sequence[int], k: int) -> list[int]:
        """At most `k` tokens to follow `history`."""
        raise NotImplementedError

    def kept(self, proposals: int) -> None:
        """The target's slot kept the first `proposals` proposals of the last verify (those taken,
        but a reply's last token, which is never written). Nothing to do for prompt lookup."""

    def update(
        self, proposed: int, accepted: int, seconds: float | None = None, batch: int = 1, verifying: int = 1
    ) -> None:
        """A verify of `proposed` tokens took `accepted` of them; the step (proposing and
        verifying) took `seconds`, if measured, in a step of `batch` turns past their prompts,
        `verifying` of which verified."""
        self.verifies += 1
        self.proposed += proposed
        self.accepted += accepted
        if accepted == proposed:
            self.k = min(MAX_DRAFT, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
        if seconds and self.costs.measured:  # the pending token and those taken, decoded
            made = (accepted + 1) * self.costs.share_s(batch) - self.costs.broken_s(batch, verifying)
            self.saved_s += made - seconds
            # a full take below the most k can grow to is k ramping up (1, 3, 5, ..): its loss
            # is carried, to be paid by the longer takes it leads to or by the next pause
            self.timings = [*self.timings[-(TIMINGS - 1) :], (proposed + 1, seconds)]
            ramping = accepted == proposed < MAX_DRAFT and self.may_pay(batch, verifying)
            if self.saved_s < 0 and not ramping:  # lost more than earlier steps saved: decode it back
                share = LOSS_BUDGET * self.costs.share_s(batch)
                steps = -self.saved_s / share if share > 0 else MAX_PAUSE
                self.pause = min(MAX_PAUSE, math.ceil(steps - 1e-9))  # a float's last bits add no step
                self.saved_s = 0.0
            return
        if accepted:
            self.misses, self.backoff = 0, 1
            return
        self.misses += 1
        if self.misses >= MISSES:
            self.pause, self.backoff, self.misses = self.backoff, min(MAX_PAUSE, 2 * self.backoff), 0

    def rolled_back(self, seconds: float) -> None:
        """The last verify's kept tokens were run again (a model with per-slot states:
        `kvedge.runtime.generate.speculate_turns`), taking `seconds` more: charged to that step,
        so the next loss weighs it."""
        if self.costs.measured:
            self.saved_s -= seconds
        if self.timings:
            n, spent = self.timings[-1]
            self.timings[-1] = (n, spent + seconds)


@dataclass
class Lookup(Adaptive):
    """Prompt lookup: what followed the latest earlier occurrence of the conversation's end."""

    k: int = FIRST_LOOKUP

    def proposals(self, history: Sequence[int], k: int) -> list[int]:
        return lookup(np.asarray(history, np.int64), k)
