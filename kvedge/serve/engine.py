"""The engine: one thread owns the `Model` and interleaves decode steps across its KV slots.

Life of a request (a `Job`)::

    submit   handler thread: refused with QueueFull (-> 429) when `queue_size` jobs already wait
             beyond the free slots, with NotReady (-> 503) before warm-up ends or while draining
    admit    engine thread: the oldest waiting job takes the free slot whose held tokens share the
             longest prefix with its conversation (ties and no match: least recently used)
    step     engine thread, round robin: one step per active job per round. The first step calls
             `Model.chat` on the slot, which rewinds it to that prefix and prefills the rest; each
             later step is one `next()`, i.e. one decode step. Events go to the job's `deliver`
    finish   on the final event, an error, or `cancel`: the generator is closed, the slot is free
             again and keeps its tokens for a later turn of the same conversation

Every onnxruntime call happens on this one thread (the backend is not shared), so no lock is held
while the model runs; the lock only guards the queue and the slot lists. A job that is cancelled
while active is dropped at its next turn, at most one round later.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvedge.errors import KvedgeError
from kvedge.runtime.generate import Event, SamplingConfig
from kvedge.runtime.model import Model
from kvedge.runtime.sessions import common_prefix
from kvedge.serve.metrics import Metrics
from kvedge.serve.protocol import ApiError

log = logging.getLogger(__name__)

WARMUP_MESSAGES = ({"role": "user", "content": "Hello! What can you do?"},)
STATES = ("loading", "warming", "ready", "draining", "stopped", "failed")


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
    steps: Iterator[Event] | None = None
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
    ) -> None:
        self._load, self._warmup = load, warmup
        self.queue_size = queue_size
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
            for job in active:
                self._step(job)

    def _admit(self) -> None:
        assert self.model is not None
        while self._waiting and self._free:
            job = self._waiting.popleft()
            slot, _ = pick_slot(self._free, job.ids, self.model.cache.token_ids, self._last_used)
            self._free.remove(slot)
            job.slot = slot
            self._active.append(job)

    def _step(self, job: Job) -> None:
        if job.cancelled:
            self._finish(job, None)
            return
        assert self.model is not None and job.slot is not None
        try:
            if job.steps is None:  # the first step: Model.chat rewinds the slot and prefills
                job.steps = iter(self.model.chat(job.messages, job.config, slot=job.slot))
            event = next(job.steps, None)
        except KvedgeError as exc:  # e.g. the chat template refuses the conversation
            self._finish(job, ApiError(400, str(exc), param="messages", code="invalid_conversation"))
            return
        except Exception:
            log.exception("slot %s: generation failed", job.slot)
            self._finish(job, ApiError(500, "internal error while generating", type="server_error"))
            return
        if event is None:
            self._finish(job, ApiError(500, "generation ended without a result", type="server_error"))
            return
        now = time.monotonic()
        if job.produced == 0:
            self.metrics.first_token(now - job.submitted)
            self.metrics.add("kvedge_prompt_tokens_total", len(job.ids))
            job.reused = self.model.sessions[job.slot].reused_tokens  # slot or warm prefix
            self.metrics.add("kvedge_prefix_cache_hit_tokens_total", job.reused)
            self.metrics.add("kvedge_prefix_cache_hits_total", int(job.reused > 0))
        job.produced += 1
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
