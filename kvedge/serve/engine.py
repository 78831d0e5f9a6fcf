"""The engine: one thread owns the `Model` and steps every active job once per round, decoding
the jobs' slots together in one batched call.

Life of a request (a `Job`)::

    submit   handler thread: refused with QueueFull (-> 429) when `queue_size` jobs already wait
             beyond the free slots, with NotReady (-> 503) before warm-up ends or while draining
    admit    engine thread: the oldest waiting job takes the free slot whose held tokens share the
             longest prefix with its conversation (ties and no match: least recently used)
    prefill  engine thread, one job at a time: the job's first step calls `Model.chat` on the slot,
             which rewinds it to that prefix, prefills the rest and samples the first token
    decode   engine thread, once per round: every job with a token pending (the one its last
             event showed) is decoded in one `decode_one_token` call over a contiguous slot range
             (`decode_ranges`); each job's generator gets its row of logits with `send` and does
             its own sampling, stop strings, limits and events, exactly as when run alone.
             With `batch_decode` off, each job decodes alone instead (`next()`), one after another
    finish   on the final event, an error, or `cancel`: the generator is closed, the slot is free
             again and keeps its tokens for a later turn of the same conversation

Every onnxruntime call happens on this one thread (the backend is not shared), so no lock is held
while the model runs; the lock only guards the queue and the slot lists. A job that is cancelled
while active is dropped at the start of the next round, at most one round later.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvedge.errors import KvedgeError
from kvedge.runtime.generate import Event, SamplingConfig, can_idle, decode_one_token
from kvedge.runtime.model import Model
from kvedge.runtime.sessions import common_prefix
from kvedge.serve.metrics import Metrics
from kvedge.serve.protocol import ApiError

log = logging.getLogger(__name__)

WARMUP_MESSAGES = ({"role": "user", "content": "Hello! What can you do?"},)
STATES = ("loading", "warming", "ready", "draining", "stopped", "failed")
# A run of more idle slots than this between two busy ones is cheaper as a second decode call:
# on SmolLM2-135M (1 thread) a call costs ~31 ms and each more row 3.5-4.5 ms (docs/PERFORMANCE.md).
MAX_IDLE_ROWS = 8


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"queue full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    def __init__(self, state: str) -> None:
        super().__init__(state)
        self.state = state


@dataclass(eq=False)
class Job:
    """One chat completion request on its way through the engine."""

    messages: Sequence[dict[str, str]]
    ids: Sequence[int]  # the rendered conversation, used to pick a slot
    config: SamplingConfig
    deliver: Callable[[Event | ApiError], None]  # called on the engine thread; must not block
    submitted: float = field(default_factory=time.monotonic)
    slot: int | None = None
    reused: int = 0  # prompt tokens reused from the slot or a warm prefix
    steps: Generator[Event, np.ndarray | None, None] | None = None  # Model.chat's stream
    pending: int | None = None  # the token the last event showed, still to be decoded into the slot
    produced: int = 0
    cancelled: bool = False
    done: bool = False


def pick_slot(
    free: Sequence[int], ids: Sequence[int], held: Callable[[int], np.ndarray], last_used: Sequence[float]
) -> tuple[int, int]:
    """(slot, shared tokens): the free slot sharing the longest token prefix with `ids`, and among
    equals (no match included) the least recently used."""
    shared = {slot: common_prefix(held(slot), ids) for slot in free}
    slot = max(free, key=lambda s: (shared[s], -last_used[s]))
    return slot, shared[slot]


def decode_ranges(
    busy: Sequence[int], can_idle: Callable[[int], bool], max_idle: int = MAX_IDLE_ROWS
) -> list[tuple[int, int]]:
    """(first slot, count) ranges, one per decode call, covering the `busy` slots in as few calls
    as possible: the slots between two busy ones ride along idle when each `can_idle` and there
    are at most `max_idle` of them; otherwise a new range starts."""
    ranges: list[tuple[int, int]] = []
    for slot in sorted(busy):
        if ranges:
            first, count = ranges[-1]
            gap = range(first + count, slot)
            if len(gap) <= max_idle and all(can_idle(s) for s in gap):
                ranges[-1] = (first, slot - first + 1)
                continue
        ranges.append((slot, 1))
    return ranges


def decode_warmup(steps: int) -> Callable[[Model], None]:
    """A warm-up that runs `steps` greedy decode steps on slot 0, so onnxruntime has planned and
    allocated its prefill and decode buffers before the first real request."""

    def warm(model: Model) -> None:
        done = 0
        while done < steps:
            config = SamplingConfig(max_new_tokens=steps - done, temperature=0.0)
            done += sum(1 for _ in model.chat(WARMUP_MESSAGES, config, slot=0))

    return warm


class Engine:
    """The slot pool and the scheduler thread. `load` builds the Model (on the engine thread)."""

    def __init__(
        self,
        load: Callable[[], Model],
        queue_size: int,
        metrics: Metrics,
        warmup: Callable[[Model], None] | None = None,
        on_failure: Callable[[], None] = lambda: None,
        batch_decode: bool = True,
    ) -> None:
        self._load, self._warmup = load, warmup
        self.queue_size = queue_size
        self.batch_decode = batch_decode
        self.metrics = metrics
        self.on_failure = on_failure
        self.model: Model | None = None
        self.state = "loading"
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._free: list[int] = []
        self._last_used: list[float] = []
        self._seconds_per_job = 1.0  # moving average, for Retry-After
        self._deadline: float | None = None  # when draining: cancel what is left at this time
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="kvedge-engine", daemon=True)

    # -- called from request handlers -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.state != "ready":
                raise NotReady(self.state)
            if len(self._waiting) >= self.queue_size + len(self._free):
                raise QueueFull(self._retry_after())
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop `job` (client gone): at once if it waits, at its next turn if it runs."""
        with self._cond:
            if job.done or job.cancelled:
                return
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.done = True
                self.metrics.add("kvedge_requests_cancelled_total")
            self._cond.notify()

    def drain(self, grace_s: float) -> None:
        """Stop taking requests; what is still running after `grace_s` is cancelled."""
        with self._cond:
            if self.state in ("loading", "warming", "ready"):
                self.state = "draining"
            deadline = time.monotonic() + grace_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.drain(0.0)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def gauges(self) -> dict[str, float]:
        model = self.model
        with self._cond:
            waiting, active = len(self._waiting), len(self._active)
        if model is None:
            slots = held = allocated = 0
        else:
            slots = model.cache.slots
            held = int(model.cache.lengths.sum()) * model.manifest.geometry.bytes_per_token()
            allocated = model.cache.nbytes
        return {
            "kvedge_ready": int(self.state == "ready"),
            "kvedge_queue_depth": waiting,
            "kvedge_slots_in_use": active,
            "kvedge_slots_total": slots,
            "kvedge_kv_bytes_in_use": held,
            "kvedge_kv_bytes_allocated": allocated,
        }

    def _retry_after(self) -> int:
        slots = max(1, len(self._last_used))
        rounds = (len(self._waiting) + 1) / slots
        return max(1, min(60, math.ceil(self._seconds_per_job * rounds)))

    # -- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            model = self._load()
            with self._cond:
                self.model = model
                self._free = list(range(model.cache.slots))
                self._last_used = [0.0] * model.cache.slots
                if self.state == "loading":
                    self.state = "warming"
            if self._warmup is not None:
                started = time.monotonic()
                self._warmup(model)
                log.info("warm-up done in %.2f s", time.monotonic() - started)
            with self._cond:
                if self.state == "warming":
                    self.state = "ready"
        except Exception as exc:
            if isinstance(exc, KvedgeError):
                log.error("cannot start the model: %s", exc)
            else:
                log.exception("cannot start the model")
            self.state = "failed"
            self.on_failure()
            return
        log.info("ready: %d slots", len(self._free))
        self._schedule()
        self.state = "stopped"

    def _schedule(self) -> None:
        while True:
            with self._cond:
                self._cancel_past_deadline()
                self._admit()
                if not self._active:
                    if self._stopping:
                        return
                    self._cond.wait(timeout=None if self._deadline is None else 0.2)
                    continue
                active = list(self._active)
            if not self.batch_decode:
                for job in active:
                    self._step(job)
                continue
            for job in active:  # drop the cancelled, prefill the new
                if job.cancelled or job.steps is None:
                    self._step(job)
            self._decode(
                [job for job in active if not (job.done or job.cancelled) and job.pending is not None]
            )

    def _admit(self) -> None:
        assert self.model is not None
        while self._waiting and self._free:
            job = self._waiting.popleft()
            slot, _ = pick_slot(self._free, job.ids, self.model.cache.token_ids, self._last_used)
            self._free.remove(slot)
            job.slot = slot
            self._active.append(job)

    def _decode(self, jobs: list[Job]) -> None:
        """One decode step for each of `jobs`, in as few batched calls as `decode_ranges` allows."""
        model = self.model
        assert model is not None
        by_slot = {job.slot: job for job in jobs}
        for first, count in decode_ranges(list(by_slot), lambda s: can_idle(model.backend, model.cache, s)):
            rows = [by_slot.get(slot) for slot in range(first, first + count)]
            try:
                logits = decode_one_token(
                    model.backend, model.cache, first, [None if job is None else job.pending for job in rows]
                )  # [count, vocab]
            except Exception:
                log.exception("slots %d..%d: batched decode failed", first, first + count - 1)
                for job in rows:
                    if job is not None:
                        self._finish(
                            job, ApiError(500, "internal error while generating", type="server_error")
                        )
                continue
            self.metrics.decode_call(len(rows) - rows.count(None), rows.count(None))
            for job, row in zip(rows, logits, strict=True):
                if job is not None:
                    self._step(job, row)

    def _step(self, job: Job, logits: np.ndarray | None = None) -> None:
        """Advance `job` by one event: its first step (prefill and first token), or one decode step,
        done by the job's own generator or, given `logits` [vocab], already done by `_decode`.
        Those logits are always handed over, so that the stream's history includes the token the
        call wrote; a job cancelled meanwhile is dropped at the next round."""
        if job.cancelled and logits is None:
            self._finish(job, None)
            return
        assert self.model is not None and job.slot is not None
        decoding = job.steps is not None
        try:
            if job.steps is None:  # the first step: Model.chat rewinds the slot and prefills
                job.steps = self.model.chat(job.messages, job.config, slot=job.slot)
            event = next(job.steps) if logits is None else job.steps.send(logits)
        except StopIteration:
            self._finish(job, ApiError(500, "generation ended without a result", type="server_error"))
            return
        except KvedgeError as exc:  # e.g. the chat template refuses the conversation
            self._finish(job, ApiError(400, str(exc), param="messages", code="invalid_conversation"))
            return
        except Exception:
            log.exception("slot %s: generation failed", job.slot)
            self._finish(job, ApiError(500, "internal error while generating", type="server_error"))
            return
        if decoding and logits is None:  # the generator decoded the pending token alone
            self.metrics.decode_call(1)
        now = time.monotonic()
        if job.produced == 0:
            self.metrics.first_token(now - job.submitted)
            self.metrics.add("kvedge_prompt_tokens_total", len(job.ids))
            job.reused = self.model.sessions[job.slot].reused_tokens  # slot or warm prefix
            self.metrics.add("kvedge_prefix_cache_hit_tokens_total", job.reused)
            self.metrics.add("kvedge_prefix_cache_hits_total", int(job.reused > 0))
        job.produced += 1
        job.pending = event.token if event.finish_reason is None else None
        self.metrics.token(now)
        job.deliver(event)
        if event.finish_reason is not None:
            self._finish(job, event)

    def _finish(self, job: Job, outcome: Event | ApiError | None) -> None:
        """Release the job's slot; `outcome` is its final event, an error to deliver, or None."""
        if job.steps is not None:
            job.steps.close()
        now = time.monotonic()
        with self._cond:
            job.done = True
            if job in self._active:
                self._active.remove(job)
                self._free.append(job.slot)
                self._last_used[job.slot] = now
            self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * (now - job.submitted)
        if isinstance(outcome, ApiError):
            job.deliver(outcome)
        elif outcome is None:
            self.metrics.add("kvedge_requests_cancelled_total")

    def _cancel_past_deadline(self) -> None:
        """While draining, after the grace period: end every job with a 503 (lock held)."""
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        shutting_down = ApiError(
            503, "the server is shutting down", type="server_error", code="shutting_down"
        )
        while self._waiting:
            job = self._waiting.popleft()
            job.done = True
            job.deliver(shutting_down)
        for job in list(self._active):
            if job.steps is not None:
                job.steps.close()
            job.done = True
            self._active.remove(job)
            self._free.append(job.slot)
            job.deliver(shutting_down)
            self.metrics.add("kvedge_requests_cancelled_total")
