"""Service configuration: `configs/services/*.yaml` -> one frozen `ServiceConfig`, validated once.

File format (every key optional except `model`, which may come from `--model` instead)::

    model: artifacts/smollm2-135m   # artifact folder from `kvedge export`, relative to the working dir
    model_name: null                # id reported by /v1/models and in responses; null = folder name
    host: 127.0.0.1                 # anything but a loopback address requires api_key_env
    port: 8000
    slots: 4                        # KV slots preallocated at start-up = conversations served at once
    queue_size: 8                   # requests that may wait for a slot; beyond that: 429
    api_key_env: null               # name of the environment variable holding the bearer key
    max_body_bytes: 1048576         # larger request bodies get 413
    default_max_tokens: 256         # completion length when a request gives no max_tokens
    context_policy: reject          # reject: prompt + max_tokens must fit the context (OpenAI's rule)
                                    # clip: only the prompt must fit; the reply stops at the context end
    threads: null                   # onnxruntime intra-op threads; null = all cores
    batch_decode: true              # decode all active slots in one call per round (false: one by one)
    shutdown_grace_s: 10            # on SIGTERM, streams get this long to finish, then are cancelled
    warmup_tokens: 8                # greedy decode steps run before /health reports ready; 0 = none
    history_policy: error           # conversations longer than the cache: error | window | truncate
    warmup_config: null             # warm-up YAML (configs/warmup/...): prefixes loaded before ready
    warm_dir: null                  # folder of the warm prefix files (needed with warmup_config)
    memory_budget: null             # bytes the service may use; null = MemAvailable at start-up
    prefix_cache_bytes: 0           # in-memory store of conversation prefixes seen at run time, kept
                                    # when their slot goes to another conversation (LRU); 0 = off

Command-line flags override the file. Every error names where the value came from (file or flag),
the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvedge.configs import read_yaml
from kvedge.contract import MANIFEST_FILE
from kvedge.errors import KvedgeError
from kvedge.runtime.sessions import POLICIES

CONTEXT_POLICIES = ("clip", "reject")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and low <= v <= high


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


# key: (check, allowed values as shown to the user)
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (_text, "an artifact folder written by `kvedge export`"),
    "model_name": (_optional(_text), "a non-empty string, or null for the folder name"),
    "host": (_text, "an IP address or host name, e.g. 127.0.0.1"),
    "port": (_int_in(1, 65535), "an integer in 1..65535"),
    "slots": (_int_in(1, 256), "an integer in 1..256"),
    "queue_size": (_int_in(0, 4096), "an integer in 0..4096"),
    "api_key_env": (
        _optional(lambda v: isinstance(v, str) and bool(_ENV_NAME.match(v))),
        "an environment variable name such as KVEDGE_API_KEY, or null",
    ),
    "max_body_bytes": (_int_in(1024, 64 * 2**20), "an integer in 1024..67108864"),
    "default_max_tokens": (_int_in(1, 1_000_000), "an integer >= 1"),
    "context_policy": (lambda v: v in CONTEXT_POLICIES, f"one of {list(CONTEXT_POLICIES)}"),
    "threads": (_optional(_int_in(1, 1024)), "an integer >= 1, or null for all cores"),
    "batch_decode": (lambda v: isinstance(v, bool), "true or false"),
    "shutdown_grace_s": (lambda v: _is_number(v) and 0 <= v <= 3600, "a number of seconds in 0..3600"),
    "warmup_tokens": (_int_in(0, 1_000_000), "an integer >= 0 (0 = no warm-up)"),
    "history_policy": (lambda v: v in POLICIES, f"one of {list(POLICIES)}"),
    "warmup_config": (_optional(_text), "a warm-up YAML file, or null"),
    "warm_dir": (_optional(_text), "a folder for warm prefix files, or null"),
    "memory_budget": (_optional(_int_in(1, 2**50)), "a number of bytes, or null for MemAvailable"),
    "prefix_cache_bytes": (_int_in(0, 2**50), "a number of bytes >= 0 (0 = off)"),
}


@dataclass(frozen=True)
class ServiceConfig:
    """What `kvedge serve` runs with. Build it with `load_service_config`, which validates."""

    model: Path
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 4
    queue_size: int = 8
    api_key_env: str | None = None
    max_body_bytes: int = 2**20
    default_max_tokens: int = 256
    context_policy: str = "reject"
    threads: int | None = None
    batch_decode: bool = True
    shutdown_grace_s: float = 10.0
    warmup_tokens: int = 8
    history_policy: str = "error"
    warmup_config: Path | None = None
    warm_dir: Path | None = None
    memory_budget: int | None = None
    prefix_cache_bytes: int = 0
    api_key: str | None = field(default=None, repr=False)  # read from $api_key_env, never logged

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name may resolve anywhere


def load_service_config(
    path: Path | None, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ServiceConfig:
    """Read `path` (optional), apply the non-None `overrides` (from flags), validate everything once."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if path is not None:
        values = _read_yaml(path)
        origin = {key: f"{path}: {key}" for key in values}
    for key, value in overrides.items():
        if key not in _FIELDS:
            raise KvedgeError(f"unknown service option {key!r}; allowed: {sorted(_FIELDS)}")
        if value is not None:
            values[key] = str(value) if isinstance(value, Path) else value
            origin[key] = "--" + key.replace("_", "-")

    if "model" not in values:
        where = f"set `model` in {path} or pass --model" if path else "pass --model or --config"
        raise KvedgeError(f"no model folder given: {where}")
    for key, value in values.items():
        check, allowed = _FIELDS[key]
        if not check(value):
            raise KvedgeError(f"{origin[key]}={value!r} is not allowed; allowed: {allowed}")

    model = Path(values["model"])
    if not (model / MANIFEST_FILE).is_file():
        raise KvedgeError(
            f"{origin['model']}={values['model']!r}: no {MANIFEST_FILE} there; export a model with "
            "`kvedge export --out DIR` first"
        )
    values["model"] = model
    for key in ("warmup_config", "warm_dir"):
        if values.get(key) is not None:
            values[key] = Path(values[key])
    if (values.get("warmup_config") is None) != (values.get("warm_dir") is None):
        raise KvedgeError("warmup_config and warm_dir go together: set both or neither")
    if values.get("warmup_config") is not None and not values["warmup_config"].is_file():
        raise KvedgeError(f"{origin['warmup_config']}={str(values['warmup_config'])!r}: no such file")
    values["model_name"] = values.get("model_name") or model.resolve().name
    if "shutdown_grace_s" in values:
        values["shutdown_grace_s"] = float(values["shutdown_grace_s"])

    names = {f.name for f in dataclasses.fields(ServiceConfig)}
    config = ServiceConfig(**{k: v for k, v in values.items() if k in names})
    return dataclasses.replace(config, api_key=_api_key(config, origin, environ))


def _read_yaml(path: Path) -> dict[str, Any]:
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise KvedgeError(
            f"{path}: a service config is a mapping of keys to values; allowed keys: {sorted(_FIELDS)}"
        )
    unknown = sorted(str(k) for k in data if k not in _FIELDS)
    if unknown:
        raise KvedgeError(f"{path}: unknown key {unknown[0]!r}; allowed keys: {sorted(_FIELDS)}")
    return dict(data)


def _api_key(config: ServiceConfig, origin: Mapping[str, str], environ: Mapping[str, str]) -> str | None:
    if config.api_key_env is None:
        if not config.loopback:
            raise KvedgeError(
                f"{origin.get('host', '--host')}={config.host!r} is not a loopback address, so an API key "
                "is required: set api_key_env to the name of an environment variable that holds it"
            )
        return None
    key = environ.get(config.api_key_env, "")
    if not key.strip():
        raise KvedgeError(
            f"{origin['api_key_env']}={config.api_key_env!r}: that environment variable is not set or "
            "empty; export it with the bearer key clients must send"
        )
    return key.strip()
