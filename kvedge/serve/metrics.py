"""Service metrics in the Prometheus text exposition format (version 0.0.4), written by prometheus_client.

Each `Metrics` has its own `CollectorRegistry`, not the library's process-wide one, so services
and tests in one process never share counts. Counters and the time-to-first-token histogram are
updated by the scheduler thread and the request handlers (prometheus_client's metrics lock
themselves); gauges (queue depth, slots in use, KV bytes) are read from the scheduler when /metrics
is scraped. Tokens per second is the number of tokens generated in the last `RATE_WINDOW_S`
seconds divided by that window, across all slots. Counters and the histogram also carry the
library's `_created` sample (when the series started).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge, Histogram

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_WINDOW_S = 10

# name: help text
GAUGES = {
    "kvedge_ready": "1 once the model is loaded and warmed up, else 0.",
    "kvedge_ready_seconds": "Seconds from start to ready: model, warm prefixes, prefix file index, warm-up.",
    "kvedge_queue_depth": "Requests waiting for a free slot.",
    "kvedge_slots_in_use": "KV slots serving a request right now.",
    "kvedge_slots_total": "KV slots preallocated at start-up.",
    "kvedge_prefix_memory_bytes": "Bytes of run-time prefixes held in memory (prefix_cache_bytes' arena).",
    "kvedge_prefix_disk_bytes": "Bytes of run-time prefix files in this export's subfolder of prefix_dir.",
    "kvedge_prefix_disk_files": "Run-time prefix files in this export's subfolder of prefix_dir.",
    "kvedge_prefix_disk_written_bytes": "Bytes written to prefix files since start-up (flash wear).",
    "kvedge_prefix_disk_refused": "Prefix files refused (damaged or of another export) since start-up.",
    "kvedge_prefix_disk_queued_bytes": "Bytes of prefix files copied from slots, in memory until written.",
    "kvedge_prefix_disk_deferred": "Turns that wrote no prefix file as the writer was a slot behind.",
    "kvedge_kv_bytes_in_use": "KV cache bytes holding valid tokens, idle slots' reusable prefixes included.",
    "kvedge_kv_bytes_allocated": "KV cache bytes preallocated at start-up.",
    "kvedge_tokens_per_second": f"Tokens generated per second over the last {RATE_WINDOW_S} s, all slots.",
}
COUNTERS = {
    "kvedge_completion_tokens_total": "Tokens generated.",
    "kvedge_prompt_tokens_total": "Prompt tokens of started requests (reused or prefilled).",
    "kvedge_prefix_cache_hit_tokens_total": "Prompt tokens reused from a slot's cache instead of prefilled.",
    "kvedge_prefix_cache_hits_total": "Requests that reused at least one token of their slot's cache.",
    "kvedge_requests_cancelled_total": "Requests dropped because the client went away or the server stopped.",
    "kvedge_decode_calls_total": "Decode calls to the model, each one token for one or more requests.",
    "kvedge_decode_rows_total": "Tokens decoded by those calls: divided by the calls, the mean batch.",
    "kvedge_decode_idle_rows_total": "Idle slots run along in those calls (a call covers a slot range).",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._gauges = {name: Gauge(name, text, registry=self.registry) for name, text in GAUGES.items()}
        self._counters = {
            name: prometheus_client.Counter(name, text, registry=self.registry)
            for name, text in COUNTERS.items()
        }
        self._responses = prometheus_client.Counter(
            "kvedge_chat_requests_total",
            "Chat completion requests by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self._ttft = Histogram(
            "kvedge_time_to_first_token_seconds",
            "From a request's arrival to its first generated token (queueing included).",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._tokens = self._counters["kvedge_completion_tokens_total"]
        self._lock = threading.Lock()  # guards _per_second
        self._per_second: Counter[int] = Counter()  # whole second -> tokens generated in it

    def add(self, name: str, value: int = 1) -> None:
        self._counters[name].inc(value)

    def decode_call(self, rows: int, idle_rows: int = 0) -> None:
        self._counters["kvedge_decode_calls_total"].inc()
        self._counters["kvedge_decode_rows_total"].inc(rows)
        self._counters["kvedge_decode_idle_rows_total"].inc(idle_rows)

    def response(self, status: int) -> None:
        self._responses.labels(status=str(status)).inc()

    def token(self, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        self._tokens.inc()
        with self._lock:
            self._per_second[second] += 1
            if len(self._per_second) > 2 * RATE_WINDOW_S:
                for old in [s for s in self._per_second if s <= second - RATE_WINDOW_S]:
                    del self._per_second[old]

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            recent = sum(n for s, n in self._per_second.items() if s > int(now) - RATE_WINDOW_S)
        return recent / RATE_WINDOW_S

    def render(self, gauges: Mapping[str, float]) -> str:
        """The exposition text; `gauges` gives the current value of every name in GAUGES but the rate."""
        for name, value in {**gauges, "kvedge_tokens_per_second": self.tokens_per_second()}.items():
            self._gauges[name].set(value)
        return prometheus_client.generate_latest(self.registry).decode()
