"""Service configuration: `configs/services/*.yaml` -> one frozen `ServiceConfig`, validated once.

File format (every key optional except `model`, which may come from `--model` instead)::

    model: artifacts/smollm2-135m   # artifact folder from `kvedge export`, relative to the working dir
    model_name: null                # id reported by /v1/models and in responses; null = folder name
    host: 127.0.0.1                 # anything but a loopback address requires api_key_env
    port: 8000
    slots: 4                        # KV slots preallocated at start-up = conversations served at once
    queue_size: 8                   # requests that may wait for a slot; beyond that: 429
    api_key_env: null               # name of the environment variable holding the bearer key
                                    # (printable ASCII, no spaces)
    max_body_bytes: 1048576         # larger request bodies get 413
    default_max_tokens: 256         # completion length when a request gives no max_tokens
    max_reply_tokens: 4096          # a request's max_tokens above this gets 400, whatever the policy
    max_prompt_tokens: 8192         # a conversation (before truncation) of more tokens gets 400
    max_messages: 512               # a request with more messages gets 400, before it is tokenized
    max_connections: 256            # open connections at once; one more closes the oldest that
                                    # is waiting for a request head, or itself if none is (the
                                    # request queue, queue_size, is separate)
    allowed_hosts: []               # Host header names accepted beside loopback names, IP
                                    # addresses and `host`; "*" = any (DNS rebinding: a page's
                                    # own name is refused)
    cors_origins: []                # origins whose web pages may call the API (CORS); none = no
                                    # cross-origin browser calls
    header_timeout_s: 10            # a connection whose request head is not complete by then is closed
    body_timeout_s: 30              # a request body not received in full by then gets 408
    reply_overflow: reject          # a reply that may not fit the context: reject (prompt + max_tokens
                                    # must fit, OpenAI's rule: else 400) | clip (only the prompt must
                                    # fit; the reply stops at the context end, finish_reason "length")
    threads: null                   # onnxruntime intra-op threads; null = all cores
    device: cpu                     # cpu | cuda (onnxruntime-gpu) | tensorrt (the folder's model.engine)
    kv_memory: mapped               # GPU devices: the KV cache pool in mapped pinned host memory
                                    # (mapped) or in GPU memory (device); docs/JETSON.md
    batch_decode: true              # decode all active slots in one call per round (false: one by one)
    speculate: "off"                # lookup: speculative decoding by prompt lookup, where the export
                                    # verifies (--logits rows); draft: the `draft` export proposes
                                    # (the default when draft is set); a request's "speculate"
                                    # overrides it ("draft" only where a draft is loaded)
    draft: null                     # an export with the same tokenizer, loaded at start, whose
                                    # proposals the model verifies; null = none
    temperature: 0                  # what a request that leaves them out samples with: greedy by
    top_p: 1                        # default, as `kvedge generate` (tests/test_real_model.py: the
    top_k: 0                        # default model's answers); the chat page shows them
    repetition_penalty: 1
    shutdown_grace_s: 10            # on SIGTERM, streams get this long to finish, then are cancelled
    warmup_tokens: 8                # warm-up: greedy decode steps run before /health reports ready;
                                    # 0 = none
    history_policy: error           # conversations longer than the cache: error | window | truncate
    n_sink: 4                       # window: tokens at the start that are never evicted
    warm_prefixes: null             # warm-prefix YAML (configs/warmup/...): fixed prompts whose KV is
                                    # loaded from warm_dir (rebuilt there if missing) before ready
    warm_dir: null                  # folder of the warm prefix files (needed with warm_prefixes)
    memory_budget: null             # bytes the service may use; null = what it may allocate at start-up
    prefix_cache_bytes: 0           # in-memory store of conversation prefixes seen at run time, kept
                                    # when their slot goes to another conversation (LRU); 0 = off
    prefix_dir: null                # folder where conversations' KV is written as turns end and read
                                    # back after a restart (kvedge.runtime.prefix_disk), one subfolder
                                    # per export (its graph fingerprint, 16 hex); null = off
    prefix_disk_bytes: 1073741824   # the budget of each export's subfolder; least recently used
                                    # removed first
    prefix_disk_min_tokens: 64      # prefixes shorter than this are never written (flash wear)
    ui: null                        # the chat page at GET /: true | false | null = on for a loopback
                                    # host, off otherwise (the page is public: see `ui_default`)
    lenient_schemas: false          # response_format schemas: compile what the constraint library
                                    # does not implement by ignoring it (uniqueItems, not, if/then,
                                    # ...) and a oneOf whose branches may overlap as anyOf, so a
                                    # reply may break those parts; false = refuse them (400 naming
                                    # them). Unknown formats are always ignored, as the spec says

Command-line flags override the file. Every error names where the value came from (file or flag),
the key and what is allowed. Old key names still read, with a warning naming the new one:
`context_policy` (now `reply_overflow`), `warmup_config` (now `warm_prefixes`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

import msgspec
from msgspec import Meta

from kvedge.configs import find_problem, move_renamed, read_yaml, renamed
from kvedge.contract import MANIFEST_FILE
from kvedge.declare import Flag, declared, from_values
from kvedge.errors import KvedgeError
from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.options import RunOptions
from kvedge.runtime.speculate import legacy_draft

log = logging.getLogger(__name__)
REPLY_OVERFLOW = ("clip", "reject")
RENAMED = renamed("service")  # old key: new key (kvedge.configs.RENAMED)
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_NOT_BLANK = r"\S"
# What a bearer key may hold: a client sends it in an HTTP header, which carries ASCII (a key with
# other characters would match no request), after "Bearer " (so no spaces). RFC 6750's token68 is
# narrower; keys with other printable characters already in use work with every client we know.
_BEARER_KEY = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class ServiceOptions:
    """The service's own options: its HTTP server, a request's limits, start-up and shutdown.
    `ServiceConfig` holds them beside the model's (`RunOptions`) and a request's sampling defaults
    (`SamplingConfig`'s), declared there.

    Each field's type states what a file or flag may give it; a `Meta(description=...)` is the
    "allowed:" text of its error message."""

    model: Annotated[
        Path,
        Meta(description="an artifact folder written by `kvedge export`"),
        Flag("Artifact folder; overrides the config's."),
    ]
    model_name: Annotated[  # None only until load_service_config fills in the folder name
        Annotated[str, Meta(pattern=_NOT_BLANK)] | None,
        Meta(description="a non-empty string, or null for the folder name"),
    ] = None
    host: Annotated[
        str,
        Meta(pattern=_NOT_BLANK, description="an IP address or host name, e.g. 127.0.0.1"),
        Flag("Bind address (others than loopback need api_key_env).", metavar="TEXT"),
    ] = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535), Flag("TCP port.")] = 8000
    queue_size: Annotated[int, Meta(ge=0, le=4096), Flag("Requests that may wait for a slot before 429.")] = 8
    api_key_env: Annotated[
        Annotated[str, Meta(pattern=_ENV_NAME)] | None,
        Meta(description="an environment variable name such as KVEDGE_API_KEY, or null"),
    ] = None
    max_body_bytes: Annotated[int, Meta(ge=1024, le=64 * 2**20)] = 2**20
    default_max_tokens: Annotated[int, Meta(ge=1, le=1_000_000, description="an integer >= 1")] = 256
    max_reply_tokens: Annotated[int, Meta(ge=1, le=1_000_000, description="an integer in 1..1000000")] = 4096
    max_prompt_tokens: Annotated[int, Meta(ge=1, le=1_000_000, description="an integer in 1..1000000")] = 8192
    max_messages: Annotated[int, Meta(ge=1, le=100_000, description="an integer in 1..100000")] = 512
    max_connections: Annotated[int, Meta(ge=1, le=65_536, description="an integer in 1..65536")] = 256
    allowed_hosts: Annotated[
        tuple[Annotated[str, Meta(pattern=r"^(\*|[A-Za-z0-9._:\[\]-]+)$")], ...],
        Meta(description='a list of host names (no port), or ["*"] for any'),
    ] = ()
    cors_origins: Annotated[
        tuple[Annotated[str, Meta(pattern=r"^(\*|https?://[^/\s]+)$")], ...],
        Meta(description='a list of origins such as "http://kiosk.local:8080", or ["*"]'),
    ] = ()
    header_timeout_s: Annotated[
        float, Meta(gt=0, le=3600, description="a number of seconds in (0, 3600]")
    ] = 10.0
    body_timeout_s: Annotated[float, Meta(gt=0, le=3600, description="a number of seconds in (0, 3600]")] = (
        30.0
    )
    reply_overflow: Annotated[Literal[REPLY_OVERFLOW], Meta(description=f"one of {list(REPLY_OVERFLOW)}")] = (
        "reject"
    )
    batch_decode: Annotated[bool, Meta(description="true or false")] = True
    shutdown_grace_s: Annotated[float, Meta(ge=0, le=3600, description="a number of seconds in 0..3600")] = (
        10.0
    )
    warmup_tokens: Annotated[
        int, Meta(ge=0, le=1_000_000, description="an integer >= 0 (0 = no warm-up)")
    ] = 8
    memory_budget: Annotated[
        Annotated[int, Meta(ge=1, le=2**50)] | None,
        Meta(
            description="a number of bytes, or null for what the service may allocate at start-up "
            "(MemAvailable, or a cgroup or ulimit limit where lower)"
        ),
    ] = None
    ui: Annotated[  # None only until load_service_config applies `ui_default`
        bool | None,
        Meta(description="true, false, or null (on for a loopback host, off otherwise)"),
        Flag("Serve the chat page at / (default: on for a loopback host only)."),
    ] = None
    # kvedge.runtime.json_schema: what a lenient compilation ignores
    lenient_schemas: Annotated[bool, Meta(description="true or false")] = False
    api_key: str | None = field(default=None, repr=False)  # read from $api_key_env, never logged


class ServiceMethods:
    """What a `ServiceConfig` derives from its fields."""

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """What a request samples with where it gives no value of its own."""
        return {key: getattr(self, key) for key in SAMPLING_DEFAULTS}

    def run_options(self, slots: int | None = None) -> RunOptions:
        """The model's options this config gives (`slots`: another count, e.g. 1 for --check); the
        warm-prefix file is read here."""
        values = {key: getattr(self, key) for key in declared(RunOptions)}
        return from_values(RunOptions, values, **({} if slots is None else {"slots": slots}))


# A request's sampling where it gives none; "draft" is speculate's default where a draft is set
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")
SERVICE_DEFAULTS = {"slots": 4}  # a service serves conversations at once; `Model` loads one slot


def _service_fields() -> list[tuple[str, Any, Any]]:
    """ServiceOptions' fields, then RunOptions' and SamplingConfig's declared options (their
    keys, types and defaults; `SERVICE_DEFAULTS` where the service's differ)."""
    hints = get_type_hints(ServiceOptions, include_extras=True)
    own = [
        (f.name, hints[f.name])
        if f.default is dataclasses.MISSING
        else (f.name, hints[f.name], field(default=f.default, repr=f.repr))
        for f in dataclasses.fields(ServiceOptions)
    ]
    sampling = declared(SamplingConfig)
    options = [*declared(RunOptions).values(), *(sampling[k] for k in (*SAMPLING_DEFAULTS, "speculate"))]
    given = [(o.key, o.hint, field(default=SERVICE_DEFAULTS.get(o.key, o.default))) for o in options]
    return [*own, *given]


# What `kvedge serve` runs with. Build it with `load_service_config`, which validates; its fields
# are a file's keys, each declared once where it is read (ServiceOptions, RunOptions, SamplingConfig).
ServiceConfig = dataclasses.make_dataclass(
    "ServiceConfig", _service_fields(), bases=(ServiceMethods,), frozen=True
)
ServiceConfig.__module__ = __name__
ServiceConfig.__doc__ = (
    "What `kvedge serve` runs with: `ServiceOptions`, `RunOptions`' options and a request's sampling "
    "defaults. Build it with `load_service_config`, which validates."
)


KEYS = tuple(f.name for f in dataclasses.fields(ServiceConfig) if f.name != "api_key")  # a file's keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name may resolve anywhere


def ui_default(host: str) -> bool:
    """Whether the chat page is served when the config does not say. On a loopback host, yes: only
    this device reaches it (a kiosk's browser). On any other address, no: such a bind always has
    an API key, so the page could do nothing without it, but a static page anyone on the network
    can open is one more thing a service exposes, and an API server should grow one only when
    asked (`ui: true` or `--ui`, e.g. for a phone on the same network)."""
    return is_loopback(host)


def load_service_config(
    path: Path | None, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ServiceConfig:
    """Read `path` (optional), apply the non-None `overrides` (from flags), validate everything once."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}  # key -> where its value came from, as the user wrote it
    if path is not None:
        values, origin = _read_yaml(path)
    for key, value in overrides.items():
        if key not in KEYS:
            raise KvedgeError(f"unknown service option {key!r}; allowed: {sorted(KEYS)}")
        if value is not None:
            values[key] = value
            origin[key] = "--" + key.replace("_", "-")

    if values.get("speculate") is False:  # YAML 1.1 reads an unquoted `off` as false
        values["speculate"] = "off"
    _legacy_draft(values, origin)
    if values.get("draft") is not None and "speculate" not in values:
        values["speculate"] = "draft"
    if "model" not in values:
        where = f"set `model` in {path} or pass --model" if path else "pass --model or --config"
        raise KvedgeError(f"no model folder given: {where}")
    try:
        config = msgspec.convert(values, ServiceConfig, dec_hook=_path)
    except msgspec.ValidationError as exc:
        problem = find_problem(exc, values, ServiceConfig)
        where = origin.get(problem.key, problem.key)
        raise KvedgeError(f"{where}={problem.value!r} is not allowed; allowed: {problem.allowed}") from None

    if not (config.model / MANIFEST_FILE).is_file():
        raise KvedgeError(
            f"{origin['model']}={str(values['model'])!r}: no {MANIFEST_FILE} there; export a model with "
            "`kvedge export --out DIR` first"
        )
    if config.default_max_tokens > config.max_reply_tokens:
        where = origin.get("default_max_tokens") or origin["max_reply_tokens"]
        raise KvedgeError(
            f"{where}: default_max_tokens ({config.default_max_tokens}) is more than max_reply_tokens "
            f"({config.max_reply_tokens}); allowed: default_max_tokens <= max_reply_tokens"
        )
    if config.kv_memory == "device" and config.device == "cpu":
        where = origin.get("kv_memory", "kv_memory")
        raise KvedgeError(
            f"{where}=device puts the cache in GPU memory: it needs device cuda or tensorrt, not cpu"
        )
    if config.speculate == "draft" and config.draft is None:
        raise KvedgeError(f"{origin['speculate']}=draft needs the draft's export: set draft (a folder)")
    if config.draft is not None and not (config.draft / MANIFEST_FILE).is_file():
        raise KvedgeError(
            f"{origin['draft']}={str(config.draft)!r}: no {MANIFEST_FILE} there; export the draft with "
            "`kvedge export --out DIR` first"
        )
    if (config.warm_prefixes is None) != (config.warm_dir is None):
        raise KvedgeError("warm_prefixes and warm_dir go together: set both or neither")
    if config.warm_prefixes is not None and not config.warm_prefixes.is_file():
        raise KvedgeError(f"{origin['warm_prefixes']}={str(config.warm_prefixes)!r}: no such file")
    config = dataclasses.replace(
        config,
        model_name=config.model_name or config.model.resolve().name,
        ui=ui_default(config.host) if config.ui is None else config.ui,
    )
    return dataclasses.replace(config, api_key=_api_key(config, origin, environ))


def _legacy_draft(values: dict[str, Any], origin: dict[str, str]) -> None:
    """The retired `speculate: draft:DIR` as `speculate: draft` and `draft: DIR`, with a warning."""
    try:
        folder = legacy_draft(values.get("speculate"))
    except KvedgeError as exc:
        raise KvedgeError(f"{origin['speculate']}: {exc}") from None
    if folder is None:
        return
    where = origin["speculate"]
    log.warning(
        "%s: speculate: draft:DIR is deprecated; write draft: %s (speculate: draft is then the default)",
        where,
        folder,
    )
    if values.get("draft") is not None and Path(values["draft"]) != folder:
        raise KvedgeError(
            f"{where}={values['speculate']!r} and {origin['draft']}={values['draft']!r} name two "
            "drafts; keep draft"
        )
    values["speculate"], values["draft"] = "draft", folder
    origin.setdefault("draft", where)


def _path(kind: type, value: Any) -> Any:
    """msgspec's hook for the Path fields: a non-blank string (or a Path, from a flag)."""
    if kind is not Path:
        raise NotImplementedError(kind)
    if not isinstance(value, str | Path) or not str(value).strip():
        raise ValueError("not a path")
    return Path(value)


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's keys and values, old key names moved to the new ones (with a warning), and
    where each value came from."""
    data = read_yaml(path)
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise KvedgeError(
            f"{path}: a service config is a mapping of keys to values; allowed keys: {sorted(KEYS)}"
        )
    moved = move_renamed(data, "service", path)
    values, origin = {}, {}
    for key, value in data.items():
        if key not in KEYS:
            raise KvedgeError(f"{path}: unknown key {str(key)!r}; allowed keys: {sorted(KEYS)}")
        values[key], origin[key] = value, f"{path}: {moved.get(key, key)}"
    return values, origin


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
    key = key.strip()
    if not _BEARER_KEY.fullmatch(key):
        held = "a non-ASCII character" if not key.isascii() else "a space or a control character"
        raise KvedgeError(
            f"{origin['api_key_env']}={config.api_key_env!r}: the key that environment variable holds "
            f"has {held} (the key is not shown), so no client could send it in an HTTP header; allowed: "
            "printable ASCII characters, no spaces"
        )
    return key
