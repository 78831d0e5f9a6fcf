"""`kvedge serve`: load the config, then serve, check the install, or print the systemd unit."""

from __future__ import annotations

import getpass
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import uvicorn

from kvedge.contract import Manifest
from kvedge.errors import KvedgeError
from kvedge.runtime.model import Model
from kvedge.serve.app import create_app
from kvedge.serve.config import ServiceConfig, load_service_config
from kvedge.serve.engine import Engine, decode_warmup
from kvedge.serve.metrics import Metrics
from kvedge.serve.systemd import render_unit

log = logging.getLogger(__name__)


def serve_command(
    config_path: Path | None, overrides: Mapping[str, Any], check: bool = False, print_unit: bool = False
) -> str | None:
    """What the CLI runs. Returns text to print (unit or check summary), or serves until stopped."""
    if print_unit:
        config = (config_path or Path("/etc/kvedge/default.yaml")).absolute()
        grace_s = ServiceConfig.shutdown_grace_s  # the default; raise TimeoutStopSec with the config's
        return render_unit(sys.executable, config, Path.cwd(), getpass.getuser(), grace_s)
    config = load_service_config(config_path, overrides)
    need = check_memory(config)
    if check:
        model = load_model(config, slots=1)  # verifies the graph, loads or rebuilds warm files
        kv = model.manifest.geometry.bytes_per_slot() * config.slots
        return (
            f"ok: {config.model_name} on {config.host}:{config.port}, {config.slots} slots "
            f"({kv / 2**20:.1f} MiB KV, {need / 2**20:.0f} MiB planned), queue {config.queue_size}, "
            f"{len(model.prefixes)} warm prefixes\n"
        )
    serve(config)
    return None


def check_memory(config: ServiceConfig) -> int:
    """Refuse at start-up a config whose slots do not fit the memory budget (the planner's figure)."""
    from kvedge.planner import check_fits, live_budget

    budget = config.memory_budget or live_budget().usable
    if config.prefix_cache_bytes >= budget:
        raise KvedgeError(
            f"prefix_cache_bytes {config.prefix_cache_bytes} leaves nothing of the memory budget "
            f"({budget} bytes) for the model and its slots"
        )
    # the run-time prefix store is allocated in full at start-up, beside the slots
    fits = check_fits(config.model, config.slots, budget - config.prefix_cache_bytes, backend=config.device)
    return fits.total + config.prefix_cache_bytes


def load_model(config: ServiceConfig, slots: int) -> Model:
    """The service's Model: history policy, and warm prefixes loaded (or rebuilt) before ready."""
    from kvedge.configs import load_warmup_config
    from kvedge.runtime.sessions import HistoryPolicy

    prefixes = load_warmup_config(config.warm_prefixes) if config.warm_prefixes else None
    return Model(
        config.model,
        slots=slots,
        threads=config.threads,
        device=config.device,
        policy=HistoryPolicy(mode=config.history_policy),
        warmup=prefixes,
        warm_dir=config.warm_dir,
        prefix_cache_bytes=config.prefix_cache_bytes,
    )


class _Server(uvicorn.Server):
    """uvicorn, draining the engine before it waits for open responses to finish."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace_s: float) -> None:
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None) -> None:
        self.engine.drain(self.grace_s)
        await super().shutdown(sockets)


def serve(config: ServiceConfig, warmup: Callable[[Model], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT. /health turns ready after the model loads and `warmup` (default:
    `config.warmup_tokens` greedy decode steps) returns; warm-up files can hook in here."""
    manifest = Manifest.load(config.model)  # a broken folder fails here, before the port opens
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
    engine = Engine(
        load=lambda: load_model(config, config.slots),
        queue_size=config.queue_size,
        metrics=metrics,
        warmup=warmup if warmup is not None else decode_warmup(config.warmup_tokens),
        batch_decode=config.batch_decode,
    )
    server = _Server(
        uvicorn.Config(
            create_app(config, engine, metrics),
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=int(config.shutdown_grace_s) + 5,
            limit_concurrency=max(64, 4 * (config.slots + config.queue_size)),
        ),
        engine,
        config.shutdown_grace_s,
    )

    def failed() -> None:
        server.should_exit = True

    engine.on_failure = failed
    server.run()
    if engine.state == "failed":
        raise KvedgeError("the model could not be loaded; see the log above")
