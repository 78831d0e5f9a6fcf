"""Typed configs loaded from YAML under `configs/`, validated once at load.

Two kinds live here (service configs belong to `kvedge serve`):

`configs/devices/NAME.yaml`, a Jetson module as NVIDIA publishes it::

    name: orin-nano-8gb                 # must equal the file name
    description: Jetson Orin Nano 8GB
    memory_bytes: 8589934592            # DRAM shared by CPU and GPU
    memory_bandwidth_gbps: 68.0         # GB/s, the published peak
    compute_capability: "8.7"           # major.minor, quoted
    gpu: {cuda_cores: 1024, tensor_cores: 32}
    recommended: {weights: [float16, int8], kv: [int8, float16]}   # best first

`configs/models/NAME.yaml`, a model recipe::

    name: smollm2-135m
    source: default          # where the weights come from: an HF repo id, a folder, a .gguf or
                             # "default"; informational until `kvedge export` reads recipes
    architecture: {family, num_layers, num_heads, num_kv_heads, head_dim, hidden_size,
                   intermediate_size, vocab_size, tie_word_embeddings, attention_bias,
                   max_position_embeddings, param_count}
    export: {max_len, logits, weights_dtype, kv_dtype, max_prefill, max_batch}

Every key is required unless shown with a default below; unknown keys are refused. Errors name
the file, the key and what is allowed, and are raised as `KvedgeError` when the file is loaded,
never later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvedge.contract import PREFILL_CHUNK, CacheGeometry
from kvedge.errors import KvedgeError

CONFIG_ROOT = Path(__file__).resolve().parents[1] / "configs"  # the repository's; pass paths otherwise
DEVICES_DIR = CONFIG_ROOT / "devices"
MODELS_DIR = CONFIG_ROOT / "models"

PRECISIONS = ("float32", "float16", "int8", "int4")  # what a recommendation may name
WEIGHT_BYTES = {"float32": 4, "float16": 2}  # what the exporter / TensorRT builder produce today
FAMILIES = ("llama", "qwen2", "mistral")  # what `kvedge export` supports
LOGITS = ("last", "all")


_REQUIRED = object()  # default of a key that must be present


class _Section:
    """Reads one mapping of a YAML file; every error names the file and the dotted key."""

    def __init__(self, data: Any, path: Path, prefix: str = "") -> None:
        self.path, self.prefix = path, prefix
        if not isinstance(data, dict):
            where = f"{prefix.rstrip('.')}: " if prefix else ""
            raise KvedgeError(f"{path}: {where}expected a mapping of keys, got {type(data).__name__}")
        self.data = data
        self.used: set[str] = set()

    def error(self, key: str, problem: str) -> KvedgeError:
        return KvedgeError(f"{self.path}: {self.prefix}{key}: {problem}")

    def _get(self, key: str, default: Any) -> Any:
        self.used.add(key)
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise self.error(key, "missing (required)")
        return default

    def integer(self, key: str, minimum: int = 1, default: Any = _REQUIRED) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, f"{value!r} is not allowed; allowed: an integer >= {minimum}")
        return value

    def number(self, key: str) -> float:
        value = self._get(key, _REQUIRED)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(key, f"{value!r} is not allowed; allowed: a positive number")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, bool):
            raise self.error(key, f"{value!r} is not allowed; allowed: true, false")
        return value

    def text(self, key: str, choices: tuple[str, ...] = (), default: Any = _REQUIRED) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or not value or (choices and value not in choices):
            allowed = ", ".join(choices) if choices else "a non-empty string"
            raise self.error(key, f"{value!r} is not allowed; allowed: {allowed}")
        return value

    def precisions(self, key: str, choices: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, list) or not value or any(v not in choices for v in value):
            raise self.error(key, f"{value!r} is not allowed; allowed: a list of {', '.join(choices)}")
        return tuple(value)

    def section(self, key: str) -> _Section:
        return _Section(self._get(key, _REQUIRED), self.path, f"{self.prefix}{key}.")

    def done(self) -> None:
        """Refuse keys nobody read: a typo must not silently fall back to a default."""
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise self.error(unknown[0], f"unknown key; allowed keys: {', '.join(sorted(self.used))}")


@dataclass(frozen=True)
class DeviceProfile:
    """A Jetson module: published memory, bandwidth and compute capability, and our advice."""

    name: str
    description: str
    memory_bytes: int
    memory_bandwidth_gbps: float
    compute_capability: str  # "8.7"
    cuda_cores: int
    tensor_cores: int
    recommended_weights: tuple[str, ...]  # best first
    recommended_kv: tuple[str, ...]  # best first
    path: Path

    @classmethod
    def from_dict(cls, data: Any, path: Path) -> DeviceProfile:
        top = _Section(data, path)
        gpu, advice = top.section("gpu"), top.section("recommended")
        if isinstance(top.data.get("compute_capability"), float):
            raise top.error("compute_capability", "write it quoted ('8.7'): YAML reads 8.7 as a number")
        capability = top.text("compute_capability")
        major, _, minor = capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise top.error("compute_capability", f"{capability!r} is not allowed; allowed: 'major.minor'")
        profile = cls(
            name=_name(top, path),
            description=top.text("description"),
            memory_bytes=top.integer("memory_bytes"),
            memory_bandwidth_gbps=top.number("memory_bandwidth_gbps"),
            compute_capability=capability,
            cuda_cores=gpu.integer("cuda_cores"),
            tensor_cores=gpu.integer("tensor_cores"),
            recommended_weights=advice.precisions("weights", PRECISIONS),
            recommended_kv=advice.precisions("kv", PRECISIONS),
            path=path,
        )
        for section in (gpu, advice, top):
            section.done()
        return profile


@dataclass(frozen=True)
class Architecture:
    """The numbers of a decoder-only transformer that memory depends on."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    param_count: int


@dataclass(frozen=True)
class ExportSettings:
    max_len: int = 2048  # cache length per sequence, baked into the graph
    logits: str = "last"
    weights_dtype: str = "float32"  # of the exported graph (TensorRT --fp16 engines halve it)
    kv_dtype: str = "float32"
    max_prefill: int = PREFILL_CHUNK  # TensorRT prefill profile: longest chunk
    max_batch: int = 1  # TensorRT profiles: most rows per call


@dataclass(frozen=True)
class ModelRecipe:
    """How to export one model, and its architecture for planning before any export exists."""

    name: str
    description: str
    source: str
    architecture: Architecture
    export: ExportSettings
    path: Path

    def geometry(self, max_len: int | None = None, kv_dtype: str | None = None) -> CacheGeometry:
        a = self.architecture
        return CacheGeometry(
            num_layers=a.num_layers,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            max_len=max_len or self.export.max_len,
        ).with_dtype(kv_dtype or self.export.kv_dtype)

    @classmethod
    def from_dict(cls, data: Any, path: Path) -> ModelRecipe:
        top = _Section(data, path)
        arch, exp = top.section("architecture"), top.section("export")
        defaults = ExportSettings()
        architecture = Architecture(
            family=arch.text("family", FAMILIES),
            num_layers=arch.integer("num_layers"),
            num_heads=arch.integer("num_heads"),
            num_kv_heads=arch.integer("num_kv_heads"),
            head_dim=arch.integer("head_dim"),
            hidden_size=arch.integer("hidden_size"),
            intermediate_size=arch.integer("intermediate_size"),
            vocab_size=arch.integer("vocab_size"),
            tie_word_embeddings=arch.flag("tie_word_embeddings"),
            attention_bias=arch.flag("attention_bias"),
            max_position_embeddings=arch.integer("max_position_embeddings"),
            param_count=arch.integer("param_count"),
        )
        if architecture.num_heads % architecture.num_kv_heads:
            raise arch.error(
                "num_kv_heads",
                f"{architecture.num_kv_heads} does not divide num_heads={architecture.num_heads}",
            )
        export = ExportSettings(
            max_len=exp.integer("max_len", minimum=16, default=defaults.max_len),
            logits=exp.text("logits", LOGITS, default=defaults.logits),
            weights_dtype=exp.text("weights_dtype", tuple(WEIGHT_BYTES), default=defaults.weights_dtype),
            kv_dtype=exp.text("kv_dtype", default=defaults.kv_dtype),
            max_prefill=exp.integer("max_prefill", default=defaults.max_prefill),
            max_batch=exp.integer("max_batch", default=defaults.max_batch),
        )
        if export.max_len > architecture.max_position_embeddings:
            raise exp.error(
                "max_len",
                f"{export.max_len} is not allowed; allowed: 16..{architecture.max_position_embeddings} "
                "(architecture.max_position_embeddings)",
            )
        if export.max_prefill > export.max_len:
            raise exp.error(
                "max_prefill", f"{export.max_prefill} is not allowed; allowed: 1..{export.max_len}"
            )
        recipe = cls(
            name=_name(top, path),
            description=top.text("description"),
            source=top.text("source"),
            architecture=architecture,
            export=export,
            path=path,
        )
        try:  # the cache dtype is CacheGeometry's to allow; let it name the allowed values
            recipe.geometry()
        except KvedgeError as exc:
            raise exp.error("kv_dtype", str(exc)) from None
        for section in (arch, exp, top):
            section.done()
        return recipe


def _name(top: _Section, path: Path) -> str:
    name = top.text("name")
    if name != path.stem:
        raise top.error("name", f"{name!r} must equal the file name {path.stem!r}")
    return name


def read_yaml(path: Path) -> Any:
    """Parse a YAML file; a missing, unreadable or malformed file is a KvedgeError naming it."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise KvedgeError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise KvedgeError(f"{path}: not valid YAML ({exc})") from None


def _resolve(name_or_path: str | Path, folder: Path, kind: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        if not candidate.is_file():
            raise KvedgeError(f"{kind} config {str(candidate)!r} does not exist")
        return candidate
    path = folder / f"{name_or_path}.yaml"
    if not path.is_file():
        raise KvedgeError(
            f"no {kind} named {str(name_or_path)!r}; allowed: {', '.join(available(folder)) or '(none)'} "
            f"(from {folder}) or a path to a .yaml file"
        )
    return path


def available(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _load(name_or_path: str | Path, folder: Path, kind: str, build: Callable[[Any, Path], Any]) -> Any:
    path = _resolve(name_or_path, folder, kind)
    return build(read_yaml(path), path)


def load_device(name_or_path: str | Path) -> DeviceProfile:
    """A device profile by name (`configs/devices/NAME.yaml`) or path."""
    return _load(name_or_path, DEVICES_DIR, "device", DeviceProfile.from_dict)


def load_recipe(name_or_path: str | Path) -> ModelRecipe:
    """A model recipe by name (`configs/models/NAME.yaml`) or path."""
    return _load(name_or_path, MODELS_DIR, "model recipe", ModelRecipe.from_dict)
