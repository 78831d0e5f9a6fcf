"""Prefill, decode and sampling over a `KVCache` and a backend.

Positions continue from each slot's valid length: a token written at cache index i has
position i. The graph reads `past_lengths` to mask stale slots, so the valid length alone
decides what the model sees.

Sampling, applied in this order to one row's logits z (float64):

    repetition penalty  z[t] = z[t] / p if z[t] > 0 else z[t] * p, for every token t already seen
    greedy              temperature == 0: argmax z
    temperature         z = z / T
    top-k               keep the k largest
    top-p               keep the smallest set of most likely tokens with probability mass >= p
    draw                from softmax(z) with the row's numpy Generator (seeded: reproducible)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvedge.contract import PREFILL_CHUNK
from kvedge.errors import ContextOverflow, KvedgeError
from kvedge.runtime.backend import OrtBackend, StepOutput
from kvedge.runtime.cache import KVCache
from kvedge.runtime.tokenizer import TextStream


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (
                "max_new_tokens",
                self.max_new_tokens,
                isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
                ">= 1",
            ),
            ("temperature", self.temperature, 0.0 <= self.temperature <= 100.0, "0..100 (0 = greedy)"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            (
                "repetition_penalty",
                self.repetition_penalty,
                0.0 < self.repetition_penalty <= 10.0,
                "in (0, 10]",
            ),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise KvedgeError(f"{name}={value!r} is not allowed; allowed: {allowed}")


def sample(logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator, seen: Sequence[int]) -> int:
    """Pick the next token from one row's logits [vocab]."""
    z = logits.astype(np.float64)
    if config.repetition_penalty != 1.0 and len(seen):
        ids = np.unique(np.asarray(seen, np.int64))
        z[ids] = np.where(z[ids] > 0, z[ids] / config.repetition_penalty, z[ids] * config.repetition_penalty)
    if config.temperature == 0.0:
        return int(np.argmax(z))
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
    return int(rng.choice(probs.size, p=probs))


RoomFn = Callable[[int, int], None]  # (slot, tokens about to be written): make room or raise


def prefill(
    backend: OrtBackend,
    cache: KVCache,
    first_slot: int,
    prompts: Sequence[Sequence[int]],
    chunk: int = PREFILL_CHUNK,
    make_room: RoomFn | None = None,
) -> np.ndarray:
    """Append each prompt to slot first_slot+r and return next-token logits [batch, vocab].

    Rows of different lengths are right-padded; causal masking keeps padding invisible to real
    tokens, and only each row's real tokens are written to its slot. Without `make_room`, a
    prompt that does not fit is refused before anything is written; with it (a window policy),
    room is made chunk by chunk.
    """
    batch = len(prompts)
    if batch == 0 or any(len(p) == 0 for p in prompts):
        raise KvedgeError("prefill needs at least one prompt and no empty prompt")
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
    backend: OrtBackend, cache: KVCache, first_slot: int, tokens: Sequence[int | None]
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
    )
    _keep(cache, out, slots, input_ids, busy.astype(np.int64).tolist())
    return out.logits


def can_idle(backend: OrtBackend, cache: KVCache, slot: int) -> bool:
    """Whether `slot` may be an idle row of a `decode_one_token` call."""
    return not backend.manifest.in_place or cache.room(slot) > 0


def _run(
    backend: OrtBackend, cache: KVCache, slots: list[int], rows: list[list[int]], counts: list[int]
) -> np.ndarray:
    width = max(1, max(counts))
    input_ids = np.zeros((len(rows), width), np.int64)  # [batch, seq]
    for r, row in enumerate(rows):
        input_ids[r, : len(row)] = row
    past_lengths = cache.lengths[slots].copy()  # [batch]
    position_ids = past_lengths[:, None] + np.arange(width, dtype=np.int64)[None, :]  # [batch, seq]
    # Padding rows and columns get in-range positions; their outputs are discarded.
    np.minimum(position_ids, cache.geometry.max_len - 1, out=position_ids)
    count_arr = np.asarray(counts, np.int64)  # [batch]
    last_index = np.maximum(count_arr - 1, 0)  # [batch]
    for slot, count in zip(slots, counts, strict=True):  # before the run: in-place graphs write
        cache.check_room(slot, count)
    out = backend.run(
        input_ids, position_ids, past_lengths, last_index, cache.layer_views(slots[0], len(slots)), count_arr
    )
    _keep(cache, out, slots, input_ids, counts)
    return out.logits


def _keep(
    cache: KVCache, out: StepOutput, slots: list[int], input_ids: np.ndarray, counts: list[int]
) -> None:
    """Make the first counts[r] tokens of row r valid in slot slots[r]."""
    if out.present is None:  # the graph wrote the new K/V into the pool itself
        cache.commit(slots, input_ids, counts)
    else:
        cache.append(slots, input_ids, counts, out.present)


@dataclass
class Event:
    """One step of a stream: new text, and when finished, why and the usage counts."""

    text: str
    token: int | None = None
    finish_reason: str | None = None  # "stop" (eos or stop string) or "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token_s: float | None = None
    seconds: float = 0.0


def decode_stream(
    backend: OrtBackend,
    cache: KVCache,
    slot: int,
    logits: np.ndarray,  # [vocab] next-token logits after the prompt
    config: SamplingConfig,
    eos_ids: Sequence[int],
    stream: TextStream,
    seen: list[int],
    make_room: RoomFn,
    prompt_tokens: int,
    started: float,
) -> Generator[Event, np.ndarray | None, None]:
    """Sample, stream and append tokens to `slot` until eos, a stop string, or a length limit.

    An eos token ends the turn without being written; the cache then holds exactly the prompt
    and the tokens shown. `seen` (prompt + history, for the repetition penalty) grows in place.

    After each event that is not the last, the event's token still has to be appended to `slot`.
    `next()` does it here, one row alone. A consumer that decodes many slots in one call (the
    service engine) appends it itself with `decode_one_token` and hands this row's next-token
    logits [vocab] back with `send(logits)`; sampling and stopping stay here either way.
    """
    rng = np.random.default_rng(config.seed)
    first_token_at = None
    produced = 0
    while True:
        token = sample(logits, config, rng, seen)
        produced += 1
        first_token_at = first_token_at or time.perf_counter() - started
        done = token in eos_ids
        text = "" if done else stream.push(token)
        finish = "stop" if done or stream.stopped else None
        if finish is None and produced >= config.max_new_tokens:
            finish = "length"
        if finish is None:
            try:
                make_room(slot, 1)
            except ContextOverflow:
                finish = "length"
        if finish:
            yield Event(
                text=text + stream.finish(),
                token=None if done else token,
                finish_reason=finish,
                prompt_tokens=prompt_tokens,
                completion_tokens=produced,
                time_to_first_token_s=first_token_at,
                seconds=time.perf_counter() - started,
            )
            return
        decoded = yield Event(text=text, token=token)
        seen.append(token)
        logits = decode_one_token(backend, cache, slot, [token])[0] if decoded is None else decoded


def generate(
    backend: OrtBackend,
    cache: KVCache,
    slot: int,
    prompt: Sequence[int],
    config: SamplingConfig,
    eos_ids: Sequence[int],
    stream: TextStream,
) -> Iterator[Event]:
    """Append `prompt` to `slot` and stream the continuation; a prompt that does not fit is refused."""
    started = time.perf_counter()
    if len(prompt) > cache.room(slot):
        raise ContextOverflow(
            f"prompt of {len(prompt)} tokens does not fit: the cache has {cache.room(slot)} of "
            f"{cache.geometry.max_len} slots free"
        )
    seen = list(cache.token_ids(slot)) + list(prompt)
    logits = prefill(backend, cache, slot, [prompt])[0]
    yield from decode_stream(
        backend, cache, slot, logits, config, eos_ids, stream, seen, cache.check_room, len(prompt), started
    )
