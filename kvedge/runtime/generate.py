"""Prefill, decode and sampling over a `KVCache` and a backend, and the one decode loop.

Positions continue from each slot's valid length: a token written at cache index i has
position i. The graph reads `past_lengths` to mask stale slots, so the valid length alone
decides what the model sees.

The loop (`step_turns`, driven only by `Model.step`), one step of every unfinished `Turn`::

    prefilling   run the next chunk of its prompt (`prefill`); after the last, sample the first token
    decoding     write its pending token, all such turns in as few `decode_one_token` calls over
                 contiguous slot ranges as `decode_ranges` allows, then sample the next
    sampling     (`Turn.sample`) the constraint's mask (computed while the graph ran), `sample`,
                 eos / stop string / grammar complete / max_new_tokens / no room -> finish

Sampling, applied in this order to one row's logits z (float64):

    repetition penalty  z[t] = z[t] / p if z[t] > 0 else z[t] * p, for every token t already seen;
                        p in its `SAMPLING_BOUNDS` (kvedge.runtime.sampling), so z stays finite
    greedy              temperature < `GREEDY_BELOW` (0 included): argmax z, which must be finite
    temperature         z = z / T
    top-k               keep the k largest
    top-p               keep the smallest set of most likely tokens with probability mass >= p
    draw                from softmax(z) with the row's numpy Generator (seeded: reproducible)
    finite              a NaN or infinite chosen logit, or a distribution that is not finite, ends
                        the turn with `ModelFault` (a broken model or cache file, never the
                        request's fault); checked on what sampling computes anyway, not by a scan
                        of every logit each step
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

import numpy as np
from msgspec import Meta

from kvedge.contract import PREFILL_CHUNK
from kvedge.declare import Flag
from kvedge.errors import ContextOverflow, KvedgeError, ModelFault
from kvedge.runtime.cache import KVCache
from kvedge.runtime.constrain import Constraint, Matcher
from kvedge.runtime.interface import Backend, StepOutput
from kvedge.runtime.sampling import SAMPLING_BOUNDS, RepetitionPenalty, Temperature, TopK, TopP
from kvedge.runtime.speculate import SPECULATE_MODES, Adaptive, Speculate, accept, check_mode
from kvedge.runtime.tokenizer import TextStream

# Temperatures below this sample greedily: at 1e-3 a logit 0.05 below the best is already e^-50
# as likely, so sampling is argmax but for exact ties, while z / T for a tiny T overflows float64
# (1e-308 made every probability NaN).
GREEDY_BELOW = 1e-3


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: Annotated[
        int, Meta(ge=1, description="an integer >= 1"), Flag("Most tokens of the reply.")
    ] = 256
    temperature: Temperature = 0.0
    top_k: TopK = 0  # 0: off
    top_p: TopP = 1.0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Annotated[int | None, Flag("Seed of sampled decoding (default: a fresh one).")] = None
    stop: Annotated[tuple[str, ...], Flag("Stop string (repeatable).")] = ()
    constraint: Constraint | None = None  # output must match it (kvedge.runtime.constrain)
    logprobs: int | None = None  # None: off; k: each token's log probability and the k most likely
    # "lookup": speculative decoding with prompt-lookup proposals (kvedge.runtime.speculate), where
    # the export can verify them; "draft": the proposals of the draft loaded with the model
    # (RunOptions.draft; kvedge.runtime.draft); "off". Replies are the same either way (sampled:
    # in distribution)
    speculate: Annotated[
        Speculate,
        Meta(description=f"one of {list(SPECULATE_MODES)}"),
        Flag(
            "lookup: propose the tokens that followed the reply's last words earlier in the "
            "conversation and verify them in one step (the same reply, faster where it repeats its "
            "input: quoting, rewriting; off where proposals keep failing); draft: the draft export "
            "proposes; needs a --logits rows export.",
            default_text="draft with a draft, else off",
        ),
    ] = "off"
    max_top_logprobs: ClassVar[int] = 20

    def __post_init__(self) -> None:
        checks = [
            (
                "max_new_tokens",
                self.max_new_tokens,
                isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
                ">= 1",
            ),
            *(
                (name, getattr(self, name), getattr(self, name) in bounds, bounds.allowed)
                for name, bounds in SAMPLING_BOUNDS.items()
            ),
            (
                "logprobs",
                self.logprobs,
                self.logprobs is None
                or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= self.max_top_logprobs),
                f"None or 0..{self.max_top_logprobs}",
            ),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise KvedgeError(f"{name}={value!r} is not allowed; allowed: {allowed}")
        check_mode(self.speculate)


def sample(
    logits: np.ndarray,
    config: SamplingConfig,
    rng: np.random.Generator,
    seen: Sequence[int],
    proposal: int | None = None,
) -> int:
    """Pick the next token from one row's logits [vocab]. With a speculative `proposal`, sampled
    decoding keeps it by the rejection rule (`speculate.accept`): the token's distribution is
    the same; greedy picks the argmax whatever was proposed. Raises `ModelFault` when nothing
    can be drawn (the distribution is not finite, or no token is left)."""
    z = logits.astype(np.float64)
    if config.repetition_penalty != 1.0 and len(seen):
        ids = np.unique(np.asarray(seen, np.int64))
        z[ids] = np.where(z[ids] > 0, z[ids] / config.repetition_penalty, z[ids] * config.repetition_penalty)
    if config.temperature < GREEDY_BELOW:
        token = int(np.argmax(z))  # a NaN or +inf anywhere is what argmax picks
        if not np.isfinite(z[token]):
            raise ModelFault(f"the model produced a non-finite logit ({z[token]} at token {token})")
        return token
    probs = _distribution(z, config) if np.isfinite(z.max()) else z
    if not (np.isfinite(probs).all() and probs.sum() > 0):
        raise ModelFault(
            f"the sampling distribution is not finite (temperature {config.temperature!r}, "
            f"repetition_penalty {config.repetition_penalty!r}, top_k {config.top_k}, top_p {config.top_p})"
        )
    if proposal is not None:
        return accept(probs, proposal, rng)
    return int(rng.choice(probs.size, p=probs))


def _distribution(z: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """The sampling distribution [vocab] float64 of penalized logits `z`: temperature, top-k, top-p."""
    z = z / config.temperature
    if 0 < config.top_k < z.size:
        kth = np.partition(z, -config.top_k)[-config.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if config.top_p < 1.0:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < config.top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


RoomFn = Callable[[int, int], None]  # (slot, tokens about to be written): make room or raise


def prefill(
    backend: Backend,
    cache: KVCache,
    first_slot: int,
    prompts: Sequence[Sequence[int]],
    chunk: int = PREFILL_CHUNK,
    make_room: RoomFn | None = None,
) -> np.ndarray:
    """Append each prompt to slot first_slot+r and return next-token logits [batch, vocab].

    Rows of different lengths are right-padded; causal masking keeps padding invisible to real
    tokens, and only each row's real tokens are written to its slot. Calls take `chunk` tokens
    of each row, at most the backend's `max_prefill`. Without `make_room`, a prompt that does
    not fit is refused before anything is written; with it (a window policy), room is made chunk
    by chunk.
    """
    batch = len(prompts)
    if batch == 0 or any(len(p) == 0 for p in prompts):
        raise KvedgeError("prefill needs at least one prompt and no empty prompt")
    chunk = min(chunk, backend.max_prefill or chunk)
    slots = list(range(first_slot, first_slot + batch))
    if make_room is None:
        for slot, prompt in zip(slots, prompts, strict=True):
            cache.check_room(slot, len(prompt))
    logits = np.zeros((batch, backend.manifest.vocab_size), np.float32)
    longest = max(len(p) for p in prompts)
    for start in range(0, longest, chunk):
        counts = [max(0, min(chunk, len(p) - start)) for p in prompts]
        if make_room is not None:
            for slot, count in zip(slots, counts, strict=True):
                if count:
                    make_room(slot, count)
        step = _run(backend, cache, slots, [list(p[start : start + chunk]) for p in prompts], counts)
        for row, prompt in enumerate(prompts):
            if start < len(prompt) <= start + chunk:
                logits[row] = step[row]
    return logits


def decode_one_token(
    backend: Backend, cache: KVCache, first_slot: int, tokens: Sequence[int | None]
) -> np.ndarray:
    """Append one token per row and return next-token logits [batch, vocab].

    A row whose token is None is idle: it rides along so that the busy slots of a contiguous
    range decode in one call (the pool binds only contiguous slot ranges), nothing is committed
    to its slot and its logits mean nothing. Portable graphs run it at past length 0, so it does
    not widen the batch's attention; in-place graphs write every row's new K/V at the row's past
    length, so an idle row runs at its slot's valid length, writing one column of stale space
    (masked by length), and needs room for it (`can_idle`).
    """
    slots = list(range(first_slot, first_slot + len(tokens)))
    busy = np.array([t is not None for t in tokens])  # [batch]
    for slot, token in zip(slots, tokens, strict=True):
        if token is not None:
            cache.check_room(slot, 1)
        elif not can_idle(backend, cache, slot):
            raise KvedgeError(f"slot {slot} is full, so it cannot idle in an in-place decode call")
    input_ids = np.array([[0 if t is None else t] for t in tokens], np.int64)  # [batch, 1]
    past_lengths = cache.lengths[slots].copy()  # [batch]
    if not backend.manifest.in_place:
        past_lengths[~busy] = 0
    out = backend.run(
        input_ids,
        past_lengths[:, None].copy(),  # position_ids [batch, 1]
        past_lengths,
        np.zeros(len(slots), np.int64),  # last_index [batch]
        cache.layer_views(first_slot, len(slots)),
        states=cache.state_views(first_slot, len(slots)),
    )
    _keep(cache, out, slots, input_ids, busy.astype(np.int64).tolist())
    return out.logits


def can_idle(backend: Backend, cache: KVCache, slot: int) -> bool:
    """Whether `slot` may be an idle row of a `decode_one_token` call."""
    return not backend.manifest.in_place or cache.room(slot) > 0


def _run(
    backend: Backend, cache: KVCache, slots: list[int], rows: list[list[int]], counts: list[int]
) -> np.ndarray:
    input_ids, position_ids, past_lengths = _padded(cache, slots, rows)
    count_arr = np.asarray(counts, np.int64)  # [batch]
    last_index = np.maximum(count_arr - 1, 0)  # [batch]
    out = backend.run(
        input_ids,
        position_ids,
        past_lengths,
        last_index,
        cache.layer_views(slots[0], len(slots)),
        count_arr,
        states=cache.state_views(slots[0], len(slots)),
    )
    _keep(cache, out, slots, input_ids, counts)
    return out.logits


def _padded(
    cache: KVCache, slots: list[int], rows: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A call's inputs for rows[r] after slot slots[r]'s valid tokens: (input ids [batch, width]
    right-padded, position ids [batch, width], past lengths [batch]). Padding gets in-range
    positions; its outputs are discarded. Refuses a row that does not fit its slot, before the
    call: in-place graphs write."""
    for slot, row in zip(slots, rows, strict=True):
        cache.check_room(slot, len(row))
    width = max(1, max(len(row) for row in rows))
    input_ids = np.zeros((len(rows), width), np.int64)  # [batch, width]
    for r, row in enumerate(rows):
        input_ids[r, : len(row)] = row
    past_lengths = cache.lengths[slots].copy()  # [batch]
    position_ids = past_lengths[:, None] + np.arange(width, dtype=np.int64)[None, :]  # [batch, width]
    np.minimum(position_ids, cache.geometry.max_len - 1, out=position_ids)
    return input_ids, position_ids, past_lengths


def _keep(
    cache: KVCache, out: StepOutput, slots: list[int], input_ids: np.ndarray, counts: list[int]
) -> None:
    """Make the first counts[r] tokens of row r valid in slot slots[r]."""
    if out.present is None:  # the graph wrote the new K/V into the pool itself
        cache.write_states(slots, counts, out.states)
        cache.commit(slots, input_ids, counts)
    else:
        cache.append(slots, input_ids, counts, out.present, out.states)


def _logprobs(logits: np.ndarray, token: int, top: int) -> dict[str, object]:
    """Log-softmax of one row's raw logits [vocab]: the chosen token's and the `top` largest."""
    z = logits.astype(np.float64)
    z -= z.max()
    logp = z - np.log(np.exp(z).sum())  # [vocab]
    best = np.argpartition(-logp, top)[:top] if top else np.zeros(0, np.int64)
    best = best[np.argsort(-logp[best], kind="stable")]
    return {"logprob": float(logp[token]), "top_logprobs": tuple((int(t), float(logp[t])) for t in best)}


# A run of more idle slots than this between two busy ones is cheaper as a second decode call
# (docs/PERFORMANCE.md, "Batched decode and constraints in the service": a call's cost and a row's)
MAX_IDLE_ROWS = 8


def decode_ranges(
    busy: Sequence[int],
    can_idle: Callable[[int], bool],
    max_idle: int = MAX_IDLE_ROWS,
    max_rows: int | None = None,
) -> list[tuple[int, int]]:
    """(first slot, count) ranges, one per decode call, covering the `busy` slots in as few calls
    as possible: the slots between two busy ones ride along idle when each `can_idle`, there are
    at most `max_idle` of them and the call stays within `max_rows` rows (the backend's
    `max_batch`; None: any); otherwise a new range starts."""
    ranges: list[tuple[int, int]] = []
    for slot in sorted(busy):
        if ranges:
            first, count = ranges[-1]
            gap = range(first + count, slot)
            fits = max_rows is None or slot - first + 1 <= max_rows
            if fits and len(gap) <= max_idle and all(can_idle(s) for s in gap):
                ranges[-1] = (first, slot - first + 1)
                continue
        ranges.append((slot, 1))
    return ranges


@dataclass
class Event:
    """One step of a turn: new text, and when finished, why and the usage counts."""

    text: str
    token: int | None = None
    # "stop" (eos or stop string), "length", or "error" (then `error` says what went wrong)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those reused from the slot or a stored prefix
    time_to_first_token_s: float | None = None
    seconds: float = 0.0
    error: Exception | None = None
    # with SamplingConfig.logprobs: the token's log probability under the model (before sampling
    # settings and constraints) and the most likely tokens with theirs
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class TurnState(enum.Enum):
    """Where a turn is, read from its fields (llama.cpp's `slot_state`): `Turn.state`."""

    PREFILLING = "prefilling"  # prompt tokens not in the slot yet (`todo`), a chunk a step
    GENERATING = "generating"  # a token sampled a step, `pending` until the next step writes it
    FINISHED = "finished"  # `finish_reason` says why: stop, length, cancelled or error


@dataclass(eq=False)
class Turn:
    """One turn of one slot: the prompt tokens still to prefill, then one sampled token per step
    until eos, a stop string or a limit. Made by `Model.begin`, advanced only by `step_turns`
    (through `Model.step`), ended by `Model.end`.

    An eos token ends the turn without being written; the slot then holds exactly the prompt and
    the tokens shown. Every other sampled token is `pending` until the next step writes it."""

    slot: int
    prompt_tokens: int  # the whole conversation's length, for usage
    todo: list[int]  # prompt tokens not in the slot yet, prefilled `chunk` at a time
    chunk: int
    config: SamplingConfig
    stream: TextStream
    seen: list[int]  # the conversation and the tokens sampled so far (repetition penalty)
    make_room: RoomFn  # before a token is written: make room by the context policy, or raise
    reused_tokens: int  # prompt tokens the slot already held or took from a stored prefix
    rng: np.random.Generator
    eos_ids: tuple[int, ...]
    matcher: Matcher | None = None  # the constraint's grammar state, if the turn has one
    speculator: Adaptive | None = None  # speculative decoding's proposals (kvedge.runtime.speculate)
    propose_s: float = 0.0  # seconds the last proposals took (a draft model's steps)
    started: float = field(default_factory=time.perf_counter)
    written: list[int] = field(default_factory=list)  # tokens this turn appended to the slot
    pending: int | None = None
    produced: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def state(self) -> TurnState:
        if self.finish_reason is not None:
            return TurnState.FINISHED
        return TurnState.PREFILLING if self.todo else TurnState.GENERATING

    @property
    def prefilling(self) -> bool:
        return self.state is TurnState.PREFILLING

    def prefill_chunk(self, backend: Backend, cache: KVCache) -> np.ndarray:
        """Prefill the next chunk of the prompt; return the logits after it [vocab]."""
        tokens, self.todo = self.todo[: self.chunk], self.todo[self.chunk :]
        logits = prefill(backend, cache, self.slot, [tokens], chunk=self.chunk, make_room=self.make_room)[0]
        self.written.extend(tokens)
        if not self.todo:  # the prompt's end: a later turn that re-renders the reply resumes here
            cache.snapshot(self.slot)
        return logits

    def wrote_pending(self) -> None:
        """The pending token is in the slot now."""
        assert self.pending is not None
        self.seen.append(self.pending)
        self.written.append(self.pending)
        self.pending = None

    def will_sample(self) -> None:
        """The next model call gives this turn's logits: start the constraint's mask now."""
        if self.matcher is not None:
            self.matcher.start_mask()

    def propose(self, cache: KVCache, batch: int = 1) -> list[int]:
        """Tokens to verify after the pending one this step of `batch` turns ([]: decode as
        usual): no more than the slot has room for with the pending token and the one sampled
        after them, nor than the reply may still take, cut at the first one the constraint
        refuses."""
        if self.speculator is None or self.pending is None:
            return []
        room = min(cache.room(self.slot) - 2, self.config.max_new_tokens - self.produced - 1)
        started = time.perf_counter()
        draft = self.speculator.propose([*self.seen, self.pending], room, batch)
        self.propose_s = time.perf_counter() - started - self.speculator.unweighed_s
        if draft and self.matcher is not None:
            draft = draft[: self.matcher.allowed_prefix(draft)]
        return draft

    def take_verified(
        self, rows: np.ndarray, draft: list[int], seconds: float, batch: int = 1, verifying: int = 1
    ) -> tuple[list[Event], int]:
        """Sample from `rows` [len(draft) + 1, vocab], the logits after the pending token and after
        each proposal (a verify call of `seconds`, in a step of `batch` turns past their prompts,
        `verifying` of which verify), one row at a time as decode steps would, while the token
        sampled is the next proposal. Returns the events and how many of pending + draft the slot
        keeps."""
        events: list[Event] = []
        for i, row in enumerate(rows):
            self.wrote_pending()  # the verify call wrote it; the caller makes it valid
            events.append(self.sample(row, draft[i] if i < len(draft) else None))
            if self.done or i == len(draft) or events[-1].token != draft[i]:
                break
        assert self.speculator is not None
        taken = sum(e.token == d for e, d in zip(events, draft, strict=False))
        self.speculator.update(len(draft), taken, self.propose_s + seconds, batch, verifying)
        self.speculator.kept(len(events) - 1)  # the pending token and these proposals stay
        return events, len(events)

    def sample(self, logits: np.ndarray, proposal: int | None = None) -> Event:
        """Sample the next token from `logits` [vocab] (a speculative `proposal`: see `sample`)
        and say what it means for the stream. Whatever fails here (non-finite logits, the
        constraint, numpy) ends this turn with an "error" event, never the step's other turns."""
        try:
            allowed = logits if self.matcher is None else self.matcher.apply(logits)
            token = sample(allowed, self.config, self.rng, self.seen, proposal)
            if self.matcher is not None:
                self.matcher.accept(token)
        except Exception as exc:
            return self.finish("error", error=exc)
        self.produced += 1
        self.first_token_at = self.first_token_at or time.perf_counter() - self.started
        eos = token in self.eos_ids
        text = "" if eos else self.stream.push(token)
        finish = "stop" if eos or self.stream.stopped else None
        if finish is None and self.matcher is not None and self.matcher.stopped:
            finish = "stop"  # the grammar is complete and admits nothing more
        if finish is None and self.produced >= self.config.max_new_tokens:
            finish = "length"
        if finish is None:
            try:
                self.make_room(self.slot, 1)
            except ContextOverflow:
                finish = "length"
        probs = {} if self.config.logprobs is None or eos else _logprobs(logits, token, self.config.logprobs)
        if finish is None:
            self.pending = token
            return Event(text=text, token=token, **probs)
        event = self.finish(finish, text + self.stream.finish(), None if eos else token)
        return dataclasses.replace(event, **probs)

    def finish(
        self, reason: str, text: str = "", token: int | None = None, error: Exception | None = None
    ) -> Event:
        self.finish_reason, self.pending = reason, None
        return Event(
            text=text,
            token=token,
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.produced,
            cached_tokens=self.reused_tokens,
            time_to_first_token_s=self.first_token_at,
            seconds=time.perf_counter() - self.started,
            error=error,
        )


@dataclass
class StepResult:
    """What one `step_turns` call did: an event per turn that produced one (its last), the events
    a speculative step produced before it, and the decode and verify calls."""

    events: dict[Turn, Event] = field(default_factory=dict)
    earlier: dict[Turn, list[Event]] = field(default_factory=dict)
    decode_calls: list[tuple[int, int]] = field(default_factory=list)  # (busy rows, idle rows)
    verify_calls: list[tuple[int, int]] = field(default_factory=list)  # (proposed, tokens kept)

    def emitted(self, turn: Turn) -> list[Event]:
        """Every event `turn` produced this step, in order."""
        last = self.events.get(turn)
        return [*self.earlier.get(turn, ()), last] if last is not None else []


def step_turns(backend: Backend, cache: KVCache, turns: Sequence[Turn], batch: bool = True) -> StepResult:
    """Advance the unfinished turns by one step: of the turns still prefilling, the one that has
    prefilled the fewest tokens runs its next prompt chunk (one chunk per step, so a new short
    prompt waits for at most the chunk running when it came, not for every long prompt's next
    chunk too); every turn past its prompt with proposals (`Turn.propose`) verifies them, alone
    or with its neighbours' (`verify_groups`, `speculate_turns`); every other writes its pending
    token, decoded together in as few calls over contiguous slot ranges as `decode_ranges` allows
    (with `batch` off, one call per turn), and samples the next. A failure ends the turns it
    touched with an "error" event."""
    result = StepResult()
    prefilling = [turn for turn in turns if turn.prefilling]
    if prefilling:
        turn = min(prefilling, key=lambda t: t.prompt_tokens - t.reused_tokens - len(t.todo))
        if len(turn.todo) <= turn.chunk:  # the last chunk: its logits are sampled
            turn.will_sample()
        try:
            logits = turn.prefill_chunk(backend, cache)
        except Exception as exc:
            result.events[turn] = turn.finish("error", error=exc)
        else:
            if not turn.todo:  # the whole prompt is in: sample the first token
                result.events[turn] = turn.sample(logits)
    generating = [t for t in turns if t.state is TurnState.GENERATING and t not in result.events]
    by_slot = {t.slot: t for t in generating}
    for turn in by_slot.values():
        turn.will_sample()
    # turns past their prompts, decoding or verifying this step: their decode call's rows
    stepping = len(by_slot) if batch else 1
    # what the turns' speculative steps are weighed against: the step's decode seconds by its
    # busy rows (batched: all its calls together, idle rows included; else each call, one row)
    costs = {id(t.speculator.costs): t.speculator.costs for t in by_slot.values() if t.speculator}
    measuring = any(not c.knows(stepping) for c in costs.values())
    proposals: dict[Turn, list[int]] = {}
    for slot, turn in list(by_slot.items()) if not measuring else ():  # all decode: D(stepping)
        try:
            draft = turn.propose(cache, stepping)  # a draft model runs here
        except Exception as exc:
            del by_slot[slot]
            result.events[turn] = turn.finish("error", error=exc)
            continue
        if draft:
            del by_slot[slot]
            proposals[turn] = draft
    verifying = min(stepping, len(proposals))
    together = backend.max_batch if batch and not backend.manifest.in_place else 1
    for group in verify_groups(proposals, together):
        speculate_turns(backend, cache, group, [proposals[t] for t in group], result, stepping, verifying)
    if batch:
        ranges = decode_ranges(
            list(by_slot), lambda s: can_idle(backend, cache, s), max_rows=backend.max_batch
        )
    else:
        ranges = [(slot, 1) for slot in by_slot]
    decode_s, decoded = 0.0, 0
    for first, count in ranges:
        rows = [by_slot.get(slot) for slot in range(first, first + count)]
        try:
            started = time.perf_counter()
            logits = decode_one_token(backend, cache, first, [None if t is None else t.pending for t in rows])
            spent = time.perf_counter() - started
        except Exception as exc:
            for turn in rows:
                if turn is not None:
                    result.events[turn] = turn.finish("error", error=exc)
            continue
        busy = count - rows.count(None)
        result.decode_calls.append((busy, rows.count(None)))
        decode_s, decoded = decode_s + spent, decoded + busy
        if not batch:
            for measured in costs.values():
                measured.decoded(spent, busy)
        for turn, row in zip(rows, logits, strict=True):  # [vocab] each
            if turn is not None:
                turn.wrote_pending()
                result.events[turn] = turn.sample(row)
    if batch and decoded:
        for measured in costs.values():
            measured.decoded(decode_s, decoded)
    return result


def verify_groups(proposals: dict[Turn, list[int]], together: int | None = None) -> list[list[Turn]]:
    """The verify calls of a step's proposing turns: turns in neighbouring slots, at most
    `together` (None: any; 1 for unbatched steps, and for in-place graphs, which run a padded
    call row by row), verify in one call where their model's measured costs say so
    (`Costs.groups`), every other turn in a call of its own."""
    runs: list[list[Turn]] = []
    for turn in sorted(proposals, key=lambda t: t.slot):
        if runs and runs[-1][-1].slot == turn.slot - 1 and (together is None or len(runs[-1]) < together):
            runs[-1].append(turn)
        else:
            runs.append([turn])
    groups: list[list[Turn]] = []
    for run in runs:
        speculator = run[0].speculator
        if speculator is not None and speculator.costs.groups([len(proposals[t]) + 1 for t in run]):
            groups.append(run)
        else:
            groups.extend([turn] for turn in run)
    return groups


def speculate_turns(
    backend: Backend,
    cache: KVCache,
    turns: list[Turn],
    drafts: list[list[int]],
    result: StepResult,
    batch: int = 1,
    verifying: int = 1,
) -> None:
    """Verify each turn's pending token and draft (the turns in neighbouring slots) in one call
    (`verify_rows`), take what the model agrees with (`Turn.take_verified`, each turn charged the
    call's seconds in proportion to its tokens; the step has `batch` turns past their prompts,
    `verifying` of them verifying), and make exactly those tokens valid in each slot: the
    rejected ones' K/V are never made valid (kvedge.runtime.speculate, "roll back")."""
    tokens = [[turn.pending, *draft] for turn, draft in zip(turns, drafts, strict=True)]
    try:
        started = time.perf_counter()
        out, input_ids = verify_rows(backend, cache, turns[0].slot, tokens)
        spent = time.perf_counter() - started
    except Exception as exc:
        for turn in turns:
            result.events[turn] = turn.finish("error", error=exc)
        return
    if (speculator := turns[0].speculator) is not None:  # the turns' model's costs
        speculator.costs.verified(spent, len(turns), input_ids.shape[1])
    total = sum(len(row) for row in tokens)
    keeps: list[int] = []
    for r, (turn, draft) in enumerate(zip(turns, drafts, strict=True)):
        try:
            events, keep = turn.take_verified(
                out.logits[r, : len(tokens[r])], draft, spent * len(tokens[r]) / total, batch, verifying
            )
        except Exception as exc:
            result.events[turn] = turn.finish("error", error=exc)
            keeps.append(0)
            continue
        keeps.append(keep)
        result.verify_calls.append((len(draft), keep))
        result.events[turn] = events[-1]
        if len(events) > 1:
            result.earlier[turn] = events[:-1]
    # a model with per-slot states: the verify's new states are those after every token given, so
    # a row that kept fewer keeps none of the call and runs its kept tokens again (`_roll_back`)
    partial = [bool(cache.states) and 0 < keep < len(row) for keep, row in zip(keeps, tokens, strict=True)]
    try:
        _keep(
            cache,
            out,
            [turn.slot for turn in turns],
            input_ids,
            [0 if p else k for p, k in zip(partial, keeps, strict=True)],
        )
        for turn, row, keep, again in zip(turns, tokens, keeps, partial, strict=True):
            if again:
                _roll_back(backend, cache, turn, row[:keep])
    except Exception as exc:
        for turn in turns:
            result.earlier.pop(turn, None)
            result.events[turn] = turn.finish("error", error=exc)


def _roll_back(backend: Backend, cache: KVCache, turn: Turn, kept: list[int]) -> None:
    """Make `kept` (the pending token and the proposals taken) valid in `turn`'s slot by running
    them again: a state cannot be cut back to an earlier position the way a valid length can,
    and the verify left the slot's states where they were before it (its new states went to
    buffers of their own), so this call carries them exactly to the accepted position. Its
    seconds are charged to the turn's speculation (`Adaptive.rolled_back`)."""
    started = time.perf_counter()
    prefill(backend, cache, turn.slot, [kept])
    if turn.speculator is not None:
        turn.speculator.rolled_back(time.perf_counter() - started)


def verify(
    backend: Backend, cache: KVCache, slot: int, tokens: Sequence[int]
) -> tuple[StepOutput, np.ndarray]:
    """`verify_rows` of one slot: the logits [1, n, vocab] after each of `tokens` [n]."""
    return verify_rows(backend, cache, slot, [tokens])


def verify_rows(
    backend: Backend, cache: KVCache, first_slot: int, tokens: Sequence[Sequence[int]]
) -> tuple[StepOutput, np.ndarray]:
    """Run tokens[r] on slot first_slot + r after its valid tokens, all rows in one call, with the
    logits after each token: (the output, its logits [rows, n, vocab] with n the longest row's
    length, row r's beyond len(tokens[r]) meaningless; the input ids [rows, n], right-padded).
    Nothing becomes valid: an in-place graph has written each row's tokens beyond its valid
    length, a portable one returned their K/V."""
    slots = list(range(first_slot, first_slot + len(tokens)))
    input_ids, positions, past_lengths = _padded(cache, slots, tokens)  # [rows, n] each, [rows]
    counts = np.array([len(row) for row in tokens], np.int64)  # [rows]
    # logits at every real position; padding's repeat the row's last real one
    rows = np.minimum(np.arange(input_ids.shape[1], dtype=np.int64)[None, :], counts[:, None] - 1)
    past = cache.layer_views(first_slot, len(slots))
    states = cache.state_views(first_slot, len(slots))
    return backend.run(input_ids, positions, past_lengths, rows, past, counts, states=states), input_ids
