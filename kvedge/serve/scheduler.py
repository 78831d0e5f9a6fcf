"""The scheduler: one thread owns the `Model` and steps every active job once per round, decoding
the jobs' slots together in one batched call.

Life of a request (a `Job`, its conversation tokenized once by the app)::

    submit   handler thread: refused with QueueFull (-> 429) when `queue_size` jobs already wait
             beyond the free slots, with NotReady (-> 503) before warm-up ends or while draining
    admit    scheduler thread: the oldest waiting job takes the free slot `Model.pick_slot` chooses
             (the longest shared prefix, then least recently used) and `Model.begin`s its turn
    step     scheduler thread, once per round: `Model.step` over every active job's turn, which
             prefills the next chunk of each new prompt and decodes every other turn's pending
             token in batched calls; each job gets its event, exactly as when run alone
    finish   on the final event, an error, or `cancel`: `Model.end` notes what the slot holds,
             the slot is free again and keeps its tokens for a later turn of the same conversation

Every onnxruntime call happens on this one thread (the model is not shared), so no lock is held
while the model runs; the lock only guards the queue and the slot lists. A job that is cancelled
while active is dropped at the start of the next round, at most one prefill chunk or decode step
later. Errors reach the app as events carrying the exception; the app turns them into HTTP.

Faults stay with the request that met them: whatever one turn's sampling raises ends that turn
(`Turn.sample`), a failed model call ends the turns in it (`step_turns`), and anything else a
round raises ends that round's jobs, their slots reset, while the scheduler goes on. Should the
thread end anyway, every job still waiting or running gets an error event and `on_failure` stops
the service, which exits non-zero so its service manager restarts it. `heartbeat` is called every
round, and at least every `HEARTBEAT_S` (or `heartbeat_s`) while idle: the systemd watchdog's
ping, so a scheduler that stops stepping (a hang in a model call) is restarted too.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvedge.errors import KvedgeError, ModelFault
from kvedge.runtime.model import Event, Model, SamplingConfig, Turn
from kvedge.serve.metrics import Metrics

log = logging.getLogger(__name__)

WARMUP_MESSAGES = ({"role": "user", "content": "Hello! What can you do?"},)
STATES = ("loading", "warming", "ready", "draining", "stopped", "failed")
HEARTBEAT_S = 1.0  # the longest the scheduler thread waits for work before calling `heartbeat`


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"queue full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    def __init__(self, state: str) -> None:
        super().__init__(state)
        self.state = state


class ShuttingDown(Exception):
    """The job was cut off because the server is shutting down."""


class SchedulerFailed(Exception):
    """The job was cut off because the scheduler thread failed (the service then exits)."""


@dataclass(eq=False)
class Job:
    """One chat completion request on its way through the scheduler."""

    ids: Sequence[int]  # the rendered conversation
    config: SamplingConfig
    deliver: Callable[[Event], None]  # called on the scheduler thread; must not block
    submitted: float = field(default_factory=time.monotonic)
    slot: int | None = None
    turn: Turn | None = None
    produced: int = 0
    first_token_at: float | None = None  # monotonic time of the first event
    cancelled: bool = False
    done: bool = False


def decode_warmup(steps: int) -> Callable[[Model], None]:
    """A warm-up that runs `steps` greedy decode steps on slot 0, so onnxruntime has planned and
    allocated its prefill and decode buffers before the first real request."""

    def warm(model: Model) -> None:
        done = 0
        with model.scratch(0):  # no conversation's: never kept as a prefix
            while done < steps:
                config = SamplingConfig(max_new_tokens=steps - done, temperature=0.0)
                done += sum(1 for _ in model.chat(WARMUP_MESSAGES, config, slot=0))

    return warm


class Scheduler:
    """The slot pool and the scheduler thread. `load` builds the Model (on the scheduler thread)."""

    def __init__(
        self,
        load: Callable[[], Model],
        queue_size: int,
        metrics: Metrics,
        decode_warmup: Callable[[Model], None] | None = None,
        on_failure: Callable[[], None] = lambda: None,
        batch_decode: bool = True,
        on_ready: Callable[[], None] = lambda: None,
        heartbeat: Callable[[], None] = lambda: None,
        heartbeat_s: float | None = None,  # the longest wait between heartbeats (<= HEARTBEAT_S)
    ) -> None:
        self._load, self._decode_warmup = load, decode_warmup
        self.queue_size = queue_size
        self.batch_decode = batch_decode
        self.metrics = metrics
        self.on_failure, self.on_ready, self.heartbeat = on_failure, on_ready, heartbeat
        self._idle_wait_s = min(HEARTBEAT_S, heartbeat_s or HEARTBEAT_S)
        self.model: Model | None = None
        self.state = "loading"
        self.failure: str | None = None  # with state "failed": what failed, for the exit message
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._free: list[int] = []
        self._seconds_per_job = 1.0  # moving average, for Retry-After
        self._deadline: float | None = None  # when draining: cancel what is left at this time
        self._stopping = False
        self.ready_s = 0.0  # from the scheduler's start to ready: model, warm prefixes, prefix index, warm-up
        self._thread = threading.Thread(target=self._main, name="kvedge-scheduler", daemon=True)

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

    def busy(self) -> bool:
        """Whether any job waits or runs."""
        with self._cond:
            return bool(self._waiting or self._active)

    def gauges(self) -> dict[str, float]:
        model = self.model
        with self._cond:
            waiting, active = len(self._waiting), len(self._active)
        if model is None:
            slots = held = allocated = 0
            prefixes = {}  # their gauges stay at 0 until the model is loaded
        else:
            slots, held, allocated = model.slots, model.kv_bytes_in_use(), model.kv_bytes_allocated
            prefixes = model.prefix_stats()
        return {
            **{f"kvedge_prefix_{name}": value for name, value in prefixes.items()},
            "kvedge_ready": int(self.state == "ready"),
            "kvedge_ready_seconds": self.ready_s,
            "kvedge_queue_depth": waiting,
            "kvedge_slots_in_use": active,
            "kvedge_slots_total": slots,
            "kvedge_kv_bytes_in_use": held,
            "kvedge_kv_bytes_allocated": allocated,
        }

    def _retry_after(self) -> int:
        slots = max(1, self.model.slots if self.model is not None else 1)
        rounds = (len(self._waiting) + 1) / slots
        return max(1, min(60, math.ceil(self._seconds_per_job * rounds)))

    # -- the scheduler thread ----------------------------------------------------------------

    def _main(self) -> None:
        model = None
        started = time.monotonic()
        try:
            model = self._load()
            with self._cond:
                self.model = model
                self._free = list(range(model.slots))
                if self.state == "loading":
                    self.state = "warming"
            if self._decode_warmup is not None:
                warming = time.monotonic()
                self._decode_warmup(model)
                log.info("warm-up done in %.2f s", time.monotonic() - warming)
            if model.prefixes.disk is not None:
                model.prefixes.disk.yield_cpu()  # what it has not checked yet waits behind the turns
            with self._cond:
                if self.state == "warming":
                    self.state = "ready"
                    self.ready_s = time.monotonic() - started
        except Exception as exc:
            if isinstance(exc, KvedgeError):
                log.error("cannot start the model: %s", exc)
            else:
                log.exception("cannot start the model")
            self.state, self.failure = "failed", "the model could not be loaded"
            try:
                if model is not None:
                    model.close()
            finally:
                self.on_failure()
            return
        log.info("ready: %d slots, %.2f s after start", len(self._free), self.ready_s)
        self.on_ready()
        try:
            self._schedule()
        except BaseException as exc:
            log.critical("the scheduler thread failed; the service stops", exc_info=exc)
            self.state, self.failure = "failed", f"the scheduler thread failed: {exc!r}"
            self._abandon(Event(text="", finish_reason="error", error=SchedulerFailed(str(exc))))
            self.on_failure()
        finally:
            try:
                model.close()  # on the thread that ran it: nothing else steps it
            finally:
                if self.state != "failed":
                    self.state = "stopped"

    def _schedule(self) -> None:
        while True:
            self.heartbeat()
            with self._cond:
                self._cancel_past_deadline()
                admitted = self._admit()
                if not self._active:
                    if self._stopping:
                        return
                    self._cond.wait(timeout=self._idle_wait_s if self._deadline is None else 0.2)
                    continue
                active = list(self._active)
            try:
                self._round(admitted, active)
            except Exception as exc:  # a fault no turn caught: it ends this round's jobs only
                log.error("a scheduler round failed; ending its %d requests", len(active), exc_info=exc)
                for job in active:
                    if not job.done:
                        if job.turn is not None and not job.turn.done:
                            job.turn.finish("error", error=exc)  # so `Model.end` resets the slot
                        self._finish(job, Event(text="", finish_reason="error", error=exc))

    def _round(self, admitted: list[Job], active: list[Job]) -> None:
        """Begin the admitted jobs' turns, drop the cancelled ones, step the rest once."""
        for job in admitted:
            self._begin(job)
        for job in active:
            if job.cancelled and not job.done:
                self._finish(job, None)
        live = [job for job in active if not job.done]
        for group in [live] if self.batch_decode else [[job] for job in live]:
            self._step(group)

    def _admit(self) -> list[Job]:
        """Give waiting jobs the free slots `Model.pick_slot` chooses (lock held)."""
        assert self.model is not None
        admitted = []
        while self._waiting and self._free:
            job = self._waiting.popleft()
            job.slot = self.model.pick_slot(job.ids, self._free)
            self._free.remove(job.slot)
            self._active.append(job)
            admitted.append(job)
        return admitted

    def _begin(self, job: Job) -> None:
        assert self.model is not None and job.slot is not None
        try:
            job.turn = self.model.begin(job.slot, job.ids, job.config)
        except Exception as exc:
            if not isinstance(exc, KvedgeError):
                log.exception("slot %d: cannot start the turn", job.slot)
            self._finish(job, Event(text="", finish_reason="error", error=exc))

    def _step(self, jobs: list[Job]) -> None:
        """One `Model.step` over `jobs`: each gets the event its turn produced, if any."""
        assert self.model is not None
        turns = {job.turn: job for job in jobs if job.turn is not None}
        result = self.model.step(list(turns), batch=self.batch_decode)
        for busy, idle in result.decode_calls:
            self.metrics.decode_call(busy, idle)
        now = time.monotonic()
        emitted = [(turn, event) for turn in result.events for event in result.emitted(turn)]
        for turn, event in emitted:
            job = turns[turn]
            if event.error is not None:
                if isinstance(event.error, ModelFault):
                    log.error("slot %s: generation failed: %s", job.slot, event.error)
                elif not isinstance(event.error, KvedgeError):
                    log.error("slot %s: generation failed", job.slot, exc_info=event.error)
                self._finish(job, event)
                continue
            if job.produced == 0:
                job.first_token_at = now
                self.metrics.first_token(now - job.submitted)
                self.metrics.add("kvedge_prompt_tokens_total", len(job.ids))
                self.metrics.add("kvedge_prefix_cache_hit_tokens_total", turn.reused_tokens)
                self.metrics.add("kvedge_prefix_cache_hits_total", int(turn.reused_tokens > 0))
            job.produced += 1
            self.metrics.token(now)
            job.deliver(event)
            if event.finish_reason is not None:
                self._finish(job, event)

    def _finish(self, job: Job, outcome: Event | None) -> None:
        """Release the job's slot; `outcome` is its final event (delivered already unless it is an
        error), or None when it was cancelled."""
        if job.turn is not None and self.model is not None:
            self.model.end(job.turn)
        now = time.monotonic()
        with self._cond:
            job.done = True
            if job in self._active:
                self._active.remove(job)
                self._free.append(job.slot)
            self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * (now - job.submitted)
        if outcome is None:
            self.metrics.add("kvedge_requests_cancelled_total")
        elif outcome.error is not None:
            job.deliver(outcome)

    def _cancel_past_deadline(self) -> None:
        """While draining, after the grace period: end every job with ShuttingDown (lock held)."""
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        self._abandon(
            Event(text="", finish_reason="error", error=ShuttingDown("the server is shutting down"))
        )

    def _abandon(self, outcome: Event) -> None:
        """End every waiting and running job with `outcome`, an error event; their slots are free
        again. Nothing here may leave a client waiting, so a slot that cannot be ended cleanly is
        still given back."""
        with self._cond:
            while self._waiting:
                job = self._waiting.popleft()
                job.done = True
                job.deliver(outcome)
            for job in list(self._active):
                try:
                    if job.turn is not None and self.model is not None:
                        self.model.end(job.turn)
                except Exception:
                    log.exception("slot %s: cannot end its turn", job.slot)
                job.done = True
                self._active.remove(job)
                self._free.append(job.slot)
                job.deliver(outcome)
                self.metrics.add("kvedge_requests_cancelled_total")
