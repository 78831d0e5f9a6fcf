"""`kvedge serve`: load the config, then serve, check the install, or print the systemd unit."""

from __future__ import annotations

import asyncio
import functools
import getpass
import logging
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvedge.contract import Manifest
from kvedge.errors import KvedgeError
from kvedge.files import human
from kvedge.runtime.model import Model
from kvedge.runtime.prefix_disk import PrefixDisk, list_prefix_files
from kvedge.serve.app import create_app
from kvedge.serve.config import ServiceConfig, load_service_config
from kvedge.serve.metrics import Metrics
from kvedge.serve.scheduler import Scheduler, decode_warmup
from kvedge.serve.systemd import Notifier, gpu_groups, render_unit
from kvedge.serve.ui import page_url

log = logging.getLogger(__name__)


def serve_command(
    config_path: Path | None, overrides: Mapping[str, Any], check: bool = False, print_unit: bool = False
) -> str | None:
    """What the CLI runs. Returns text to print (unit or check summary), or serves until stopped."""
    if print_unit:
        return systemd_unit(config_path, overrides)
    config = load_service_config(config_path, overrides)
    need = check_memory(config)
    if check:
        with load_model(config, slots=1) as model:  # verifies the graph, loads or rebuilds warm files
            prefixes, disk = len(model.prefixes.warm), model.prefixes.disk
            files = "" if disk is None else f", {prefix_files(disk)}"
            others = "" if disk is None else f"{other_exports(disk, config.prefix_dir)}\n"
        kv = model.manifest.geometry.bytes_per_slot() * config.slots
        return (
            f"ok: {config.model_name} on {config.host}:{config.port}, {config.slots} slots "
            f"({kv / 2**20:.1f} MiB KV, {need / 2**20:.0f} MiB planned), queue {config.queue_size}, "
            f"{prefixes} warm prefixes{files}\n{others}"
        )
    serve(config)
    return None


def prefix_files(disk: PrefixDisk) -> str:
    """What the disk tier's folder holds, and the files it refused (and removed) at load."""
    text = (
        f"{len(disk)} prefix files ({disk.nbytes / 2**20:.1f} MiB of prefix_disk_bytes "
        f"{disk.budget_bytes / 2**20:.1f} MiB, on disk, not in memory) in {disk.folder}"
    )
    refused = "; ".join(f"{name} ({why})" for name, why in disk.refused.items())
    return text + (f", {len(disk.refused)} refused and removed: {refused}" if refused else "")


def other_exports(disk: PrefixDisk, prefix_dir: Path) -> str:
    """What the other exports' subfolders of `prefix_dir` hold (left alone, outside this export's
    budget)."""
    others = [f for f in list_prefix_files(prefix_dir) if f.export != disk.folder.name]
    size, exports = sum(f.nbytes for f in others), len({f.export for f in others})
    return (
        f"other exports' subfolders of {prefix_dir} hold {size} bytes ({size / 2**20:.1f} MiB): "
        f"{len(others)} prefix files in {exports} subfolders"
    )


def systemd_unit(config_path: Path | None, overrides: Mapping[str, Any]) -> str:
    """The unit that runs `kvedge serve` with this config file and these flags, paths made
    absolute, as the current user unless that is root (then `kvedge`, a system user), in the GPU
    groups this machine has."""
    flags = []
    for key, value in overrides.items():
        if isinstance(value, bool):  # an on/off flag (--ui / --no-ui) takes no value
            flags.append(f"--{'' if value else 'no-'}{key.replace('_', '-')}")
        elif value is not None:
            value = Path(value).absolute() if key == "model" else value
            flags.append(f"--{key.replace('_', '-')} {value}")
    if config_path is None and not flags:
        config_path = Path("/etc/kvedge/default.yaml")
    grace_s = ServiceConfig.shutdown_grace_s
    if config_path is not None and config_path.is_file():
        grace_s = load_service_config(config_path, overrides).shutdown_grace_s
    user = getpass.getuser()
    config = None if config_path is None else config_path.absolute()
    return render_unit(
        sys.executable, config, Path.cwd(), "kvedge" if user == "root" else user, grace_s, flags, gpu_groups()
    )


def check_memory(config: ServiceConfig) -> int:
    """Refuse at start-up a config whose slots do not fit the memory budget (the planner's figure):
    the model's weights and slots, the run-time prefix store (allocated in full at start-up), the
    prefix files' write queue (`PrefixDisk.queue_bytes`: one slot's KV, where prefix_dir is set)
    and a draft model's weights and slots (`draft: DIR`, loaded at start-up too)."""
    from kvedge.planner import check_fits, estimate, footprint, live_budget

    budget = config.memory_budget or live_budget().usable
    draft = config.draft
    beside, besides = config.prefix_cache_bytes, []
    if config.prefix_cache_bytes:
        besides.append(f"prefix_cache_bytes {config.prefix_cache_bytes}")
    if config.prefix_dir is not None:
        queue = Manifest.load(config.model).geometry.bytes_per_slot()
        beside += queue
        besides.append(f"the prefix files' write queue ({human(queue)}: one slot's KV)")
    if draft is not None:
        fp = footprint(draft)
        draft_bytes = estimate(fp, config.slots, fp.geometry.max_len, device=config.device).total
        beside += draft_bytes
        besides.append(f"the draft model {draft} ({human(draft_bytes)} with its {config.slots} slots)")
    if beside >= budget:
        raise KvedgeError(
            f"{' and '.join(besides)} leave nothing of the memory budget ({budget} bytes) for the model "
            "and its slots"
        )
    try:
        fits = check_fits(config.model, config.slots, budget - beside, device=config.device)
    except KvedgeError as exc:
        if not besides:
            raise
        raise KvedgeError(f"{exc} (the budget left beside {' and '.join(besides)})") from None
    return fits.total + beside


def load_model(config: ServiceConfig, slots: int) -> Model:
    """The service's Model (`ServiceConfig.run_options`): warm prefixes loaded (or rebuilt) and the
    draft loaded before ready."""
    return Model(config.model, config.run_options(slots))


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head (request line and
    headers) is not complete `head_timeout_s` after the connection opened or, on a kept-alive
    connection, after the next request's first byte. uvicorn has no such deadline: a client
    sending its head a byte at a time would hold the connection for ever (slowloris). The
    body's deadline is the app's (`read_json`), which can still answer 408.

    It also bounds open connections at `max_connections`, in place of uvicorn's
    `limit_concurrency`, which counts connections still sending their head and then answers 503
    to every request, /health included: 300 slow heads kept a probe from seeing the service for
    25 s. Here a connection beyond the bound closes the oldest one waiting for a request head
    (slow or idle between requests), or itself when every other has a request in progress, so a
    client that sends its request at once is served however many others dawdle. (TCP_NODELAY
    on accepted sockets is asyncio's, given a listening socket made with IPPROTO_TCP:
    `listening_socket`.)"""

    def __init__(self, *args: Any, head_timeout_s: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self.max_connections = max_connections
        self.opened = 0.0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.opened = self.loop.time()
        full = len(self.connections) >= self.max_connections and not self._evict_one()
        super().connection_made(transport)
        if full:
            log.warning(
                "closing a new connection: %d are open, all busy (max_connections)", self.max_connections
            )
            transport.close()
            return
        self._arm_head_timer()

    def waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _evict_one(self) -> bool:
        """Close the oldest open connection that waits for a request head; False if none does."""
        idle = [c for c in self.connections if isinstance(c, HeadDeadlineProtocol) and c.waiting_for_head()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened)
        log.info("max_connections reached: closing the oldest connection waiting for a request head")
        self.connections.discard(oldest)
        oldest.transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a (next) request head is on its way
            self._arm_head_timer()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in
            self._cancel_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection whose request head took more than %g s", self.head_timeout_s)
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn, draining the scheduler before it stops listening: while running requests finish
    (at most `grace_s`), the port stays open, so /health answers 503 "draining" and new
    requests get 503 rather than a refused connection."""

    def __init__(
        self, config: uvicorn.Config, scheduler: Scheduler, grace_s: float, notifier: Notifier
    ) -> None:
        super().__init__(config)
        self.scheduler, self.grace_s, self.notifier = scheduler, grace_s, notifier

    async def shutdown(self, sockets=None) -> None:
        self.notifier.stopping()
        self.scheduler.drain(self.grace_s)
        deadline = time.monotonic() + self.grace_s + 1.0  # the scheduler cancels at grace_s
        while self.scheduler.busy() and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def listening_socket(host: str, port: int) -> socket.socket:
    """The service's socket, bound (uvicorn listens on it): bound before the model loads, so a
    port in use is said in one line at once, not after loading and warm-up (uvicorn binds
    after its start-up, which starts the load)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP;
    # without it a response's second write waited for the client's delayed ACK (40 ms a request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise KvedgeError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what uses it or choose "
            "another --port"
        ) from None
    return sock


def serve(config: ServiceConfig) -> None:
    """Serve until SIGTERM/SIGINT. /health turns ready after the model loads (its warm prefixes
    included) and `config.warmup_tokens` greedy decode steps have run (`decode_warmup`)."""
    manifest = Manifest.load(config.model)  # a broken folder fails here, before the port opens
    listening = listening_socket(config.host, config.port)  # a port in use fails before the load
    if logging.getLogger("kvedge.serve").getEffectiveLevel() > logging.INFO:
        # where it listens and one line per request: a service's record, with or without -v
        logging.getLogger("kvedge.serve").setLevel(logging.INFO)
    log.info(
        "serving %s (%s) on http://%s:%d: %d slots x %d tokens, %.1f MiB KV, queue %d",
        config.model_name,
        manifest.architecture,
        config.host,
        config.port,
        config.slots,
        manifest.geometry.max_len,
        manifest.geometry.bytes_per_slot() * config.slots / 2**20,
        config.queue_size,
    )
    metrics = Metrics()
    notifier = Notifier()
    scheduler = Scheduler(
        load=lambda: load_model(config, config.slots),
        queue_size=config.queue_size,
        metrics=metrics,
        decode_warmup=decode_warmup(config.warmup_tokens),
        batch_decode=config.batch_decode,
        heartbeat=notifier.watchdog,
        heartbeat_s=notifier.heartbeat_s,
    )
    server = _Server(
        uvicorn.Config(
            create_app(config, scheduler, metrics),
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=int(config.shutdown_grace_s) + 5,
            http=functools.partial(
                HeadDeadlineProtocol,
                head_timeout_s=config.header_timeout_s,
                max_connections=config.max_connections,
            ),
        ),
        scheduler,
        config.shutdown_grace_s,
        notifier,
    )

    def failed() -> None:
        server.should_exit = True

    def ready() -> None:
        notifier.ready()
        if config.ui:
            log.info("chat page: %s", page_url(config.host, config.port))
        else:
            log.info("API: %sv1 (chat page off: ui is false)", page_url(config.host, config.port))

    scheduler.on_failure, scheduler.on_ready = failed, ready
    with listening:
        server.run(sockets=[listening])
    if scheduler.state == "failed":
        raise KvedgeError(f"{scheduler.failure}; see the log above")
