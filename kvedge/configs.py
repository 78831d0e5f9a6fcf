"""Typed configs loaded from YAML under `configs/`, validated once at load, and the one validator
every kvedge YAML goes through (service configs, in `kvedge/serve/config.py`, use it too).

Each kind is a frozen `msgspec.Struct` that refuses unknown keys; `parse` converts the plain
YAML data into it, and a mismatch becomes a `KvedgeError` naming the file, the dotted key, the
value and what is allowed there (worded from the field's type and `msgspec.Meta` constraints,
or its `Meta(description=...)`). Checks between fields follow the conversion, in the loader.

`configs/devices/NAME.yaml`, a Jetson module as NVIDIA publishes it::

    name: orin-nano-8gb                 # must equal the file name
    description: Jetson Orin Nano 8GB
    memory_bytes: 8589934592            # DRAM shared by CPU and GPU
    memory_bandwidth_gbps: 68.0         # GB/s, the published peak
    compute_capability: "8.7"           # major.minor, quoted
    gpu: {cuda_cores: 1024, tensor_cores: 32}

What to run on a device is not written here: `kvedge plan MODEL --profile NAME` computes it from
the profile's memory (`kvedge.planner.recommend`), the one answer README and docs/JETSON.md state.

`configs/models/NAME.yaml`, a model recipe::

    name: smollm2-135m
    source: default          # where the weights come from: an HF repo id, a folder, a .gguf or
                             # "default"; informational until `kvedge export` reads recipes
    architecture: {family, num_layers, num_heads, num_kv_heads, head_dim, hidden_size,
                   intermediate_size, vocab_size, tie_word_embeddings, attention_bias,
                   max_position_embeddings, param_count}
                   # hybrids (lfm2, qwen3_5_text) also: layer_types, conv_kernel; qwen3_5_text:
                   # linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
                   # linear_value_head_dim (HF's names; `ModelRecipe.geometry` turns them into
                   # KV layers and per-slot states as `kvedge export` does); gemma4_text also:
                   # sliding_window, sliding_window_pattern and `GEMMA4_FIELDS`
    export: {max_len, logits, weights, kv_dtype, max_prefill, max_batch}
             # the export's choices, under ExportRecipe's names (any of its fields may be given;
             # those left out take its defaults), and the TensorRT profile (ProfileSizes')

`configs/warmup/NAME.yaml`, warm prefixes: fixed prompts whose KV `kvedge warm-prefixes` (or
start-up) computes once and keeps on disk (see `kvedge/runtime/warm_prefixes.py`)::

    prefixes:
      - name: assistant            # file name: <warm dir>/assistant.kvw
        messages:                  # rendered with the model's chat template
          - {role: system, content: "You are ..."}
      - name: notes
        text: "raw text"           # or raw text, tokenized without special tokens

Every key is required unless shown with a default below; unknown keys are refused. Errors are
raised as `KvedgeError` when the file is loaded, never later. A key that was renamed still reads,
with a warning naming the new one (`RENAMED`, every kind of file's).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_type_hints

import msgspec
import yaml

from kvedge.contract import (
    HYBRID_LAYER_TYPES,
    RING_MARGIN,
    ROLES,
    SUPPORTED_MODEL_TYPES,
    CacheGeometry,
    ExportRecipe,
    StateSpec,
    shared_kv_geometry,
)
from kvedge.contract.engine import ProfileSizes
from kvedge.declare import describe, is_mapping, strip
from kvedge.errors import KvedgeError

log = logging.getLogger(__name__)

# configs/ as installed package data (setup.py ships it as kvedge._configs), else the source
# checkout's (an editable install included); other files are passed as paths
_INSTALLED = Path(__file__).resolve().parent / "_configs"
CONFIG_ROOT = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parents[1] / "configs"
BOARDS_DIR = CONFIG_ROOT / "devices"
MODELS_DIR = CONFIG_ROOT / "models"

FAMILIES = tuple(SUPPORTED_MODEL_TYPES)  # what `kvedge export` supports
LAYER_TYPES = tuple(dict.fromkeys(t for types in HYBRID_LAYER_TYPES.values() for t in types))
# Qwen3.5's Gated DeltaNet sizes (HF's names), which it needs and no other family takes
DELTANET_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
# Gemma 4's sizes (HF's names), which it needs and no other family takes
GEMMA4_FIELDS = (
    "global_head_dim",
    "num_kv_shared_layers",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "use_double_wide_mlp",
)
PREFIX_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # a warm prefix's name is its file name

T = TypeVar("T")
Count = Annotated[int, msgspec.Meta(ge=1)]
Text = Annotated[str, msgspec.Meta(min_length=1)]


class Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A config section: immutable, and a key it does not declare is an error, not ignored."""


def section(name: str, *owners: type) -> type[Strict]:
    """A config section whose keys are the fields of the dataclasses `owners`, with their types and
    defaults: a file names the owners' fields as they are declared, and nothing here restates
    them (`filled` makes an owner of it)."""
    keys = []
    for owner in owners:
        hints = get_type_hints(owner, include_extras=True)
        for f in dataclasses.fields(owner):
            default = () if f.default is dataclasses.MISSING else (f.default,)
            keys.append((f.name, hints[f.name], *default))
    return msgspec.defstruct(name, keys, bases=(Strict,), frozen=True, forbid_unknown_fields=True)


def filled(owner: type[T], values: msgspec.Struct) -> T:
    """The dataclass `owner` from the keys of a `section` that are its fields."""
    return owner(**{f.name: getattr(values, f.name) for f in dataclasses.fields(owner)})


# Former keys of kvedge's YAML files, one table for every kind: (kind, old key) -> new key; a dotted
# key is a key of a section. Each still reads, with a warning naming the new key (`move_renamed`).
# The CLI's former flags are `kvedge.cli.OLD_OPTIONS`.
RENAMED = {
    ("service", "context_policy"): "reply_overflow",
    ("service", "warmup_config"): "warm_prefixes",
    ("model", "export.weights_dtype"): "export.weights",  # ExportRecipe's name, as `--weights`
}


def renamed(kind: str) -> dict[str, str]:
    """Old key: new key, of the files of `kind` ("service", "model")."""
    return {old: new for (of, old), new in RENAMED.items() if of == kind}


def move_renamed(data: Any, kind: str, path: Path) -> dict[str, str]:
    """Move each old key in `data` (a file of `kind`, as parsed; changed in place) to its new
    name, warning once for each; an old key given beside its new one is refused. Returns new key:
    old key, of the keys moved, so that errors name the key as written."""
    moved = {}
    for old, new in renamed(kind).items():
        *parents, old_key = old.split(".")
        new_key = new.split(".")[-1]  # a rename stays in its section
        values = data
        for parent in parents:
            values = values.get(parent) if isinstance(values, dict) else None
        if not isinstance(values, dict) or old_key not in values:
            continue
        if new_key in values:
            raise KvedgeError(f"{path}: {old!r} is the old name of {new!r}; keep only {new!r}")
        log.warning("%s: key %r is deprecated; write %r (same values)", path, old, new)
        values[new_key] = values.pop(old_key)
        moved[new] = old
    return moved


# --- the validator -------------------------------------------------------------------------------

_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")  # msgspec: "<what> - at `$.a[0].b`"
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_MISSING = object()


@dataclass(frozen=True)
class ConfigProblem:
    """The first thing wrong in a config, in the user's terms."""

    key: str  # dotted path: "gpu.cuda_cores", "prefixes[0].name"; "" for the whole document
    kind: str  # "missing" | "unknown" | "mapping" | "value" | "other" (msgspec's words in `allowed`)
    value: Any  # what the config holds at `key`
    allowed: str  # what is allowed there, in words ("unknown": the keys allowed beside it)

    def message(self, where: str) -> str:
        """The error text; `where` names the file ("path: ")."""
        at = f"{where}{self.key}: " if self.key else where
        if self.kind == "missing":
            return f"{at}missing (required)"
        if self.kind == "unknown":
            return f"{at}unknown key; allowed keys: {self.allowed}"
        if self.kind == "mapping":
            return f"{at}expected a mapping of keys, got {type(self.value).__name__}"
        if self.kind == "other":
            return f"{at}{self.allowed}"
        return f"{at}{self.value!r} is not allowed; allowed: {self.allowed}"


def parse(data: Any, schema: type[T], path: Path) -> T:
    """`data` (parsed YAML) as a `schema` instance, or a KvedgeError naming `path`, key and allowed."""
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise KvedgeError(find_problem(exc, data, schema).message(f"{path}: ")) from None


def find_problem(error: msgspec.ValidationError, data: Any, schema: Any) -> ConfigProblem:
    """Turn msgspec's "Expected `int` >= 1 - at `$.gpu.cuda_cores`" into key, value and allowed."""
    what, at = _AT.match(str(error)).group("what", "path")
    steps: list[str | int] = [name or int(index) for name, index in _STEP.findall(at or "")]
    if what.startswith(("Object missing required field", "Object contains unknown field")):
        keys = ", ".join(sorted(get_type_hints(strip(_hint_at(schema, steps)))))
        steps.append(what.split("`")[1])
        kind = "missing" if what.startswith("Object missing") else "unknown"
        return ConfigProblem(key=_dotted(steps), kind=kind, value=_value_at(data, steps), allowed=keys)
    if at is None and isinstance(data, dict):  # not about one key (a key that is not a string): as is
        return ConfigProblem(key="", kind="other", value=data, allowed=str(error))
    if steps and isinstance(steps[-1], int) and not is_mapping(strip(_hint_at(schema, steps))):
        steps.pop()  # a bad item of a list of plain values: show the list, so all its choices are named
    hint, value = _hint_at(schema, steps), _value_at(data, steps)
    kind = "mapping" if is_mapping(strip(hint)) and not isinstance(value, dict) else "value"
    return ConfigProblem(key=_dotted(steps), kind=kind, value=value, allowed=describe(hint))


def _hint_at(schema: Any, steps: list[str | int]) -> Any:
    hint = schema
    for step in steps:
        outer = strip(hint)
        hint = (
            get_args(outer)[0] if isinstance(step, int) else get_type_hints(outer, include_extras=True)[step]
        )
    return hint


def _dotted(steps: list[str | int]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).lstrip(".")


def _value_at(data: Any, steps: list[str | int]) -> Any:
    for step in steps:
        try:
            data = data[step]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


# --- board profiles ------------------------------------------------------------------------------


class Gpu(Strict):
    cuda_cores: Count
    tensor_cores: Count


class BoardFile(Strict):
    """`configs/devices/NAME.yaml` as written."""

    name: Text
    description: Text
    memory_bytes: Count
    memory_bandwidth_gbps: Annotated[float, msgspec.Meta(gt=0)]
    compute_capability: Annotated[str, msgspec.Meta(pattern=r"^\d+\.\d+$", description="'major.minor'")]
    gpu: Gpu


class BoardProfile(BoardFile, frozen=True):
    """A Jetson module: published memory, bandwidth and compute capability."""

    path: Path  # the file it was loaded from


# --- model recipes -------------------------------------------------------------------------------


class Architecture(Strict):
    """The numbers of a decoder-only transformer that memory depends on."""

    family: Literal[FAMILIES]
    num_layers: Count
    num_heads: Count
    num_kv_heads: Count
    head_dim: Count
    hidden_size: Count
    intermediate_size: Count
    vocab_size: Count
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: Count
    param_count: Count
    # Gemma 3: local layers attend over the last `sliding_window` tokens and hold a ring cache;
    # every `sliding_window_pattern`-th layer is global (HF's rule: layer i is local unless
    # (i + 1) % pattern == 0)
    sliding_window: Count | None = None
    sliding_window_pattern: Count | None = None
    # Hybrids (`HYBRID_LAYER_TYPES`): HF's `layer_types`, one per layer: "full_attention" layers
    # hold KV, LFM2's "conv" and Qwen3.5's "linear_attention" layers a fixed state per slot;
    # `conv_kernel` is the short convolution's width (LFM2's conv_L_cache, Qwen3.5's
    # linear_conv_kernel_dim), whose last kernel - 1 inputs the conv state keeps; Qwen3.5's Gated
    # DeltaNet heads size its convolution's channels and its recurrent state
    layer_types: tuple[Literal[LAYER_TYPES], ...] | None = None
    conv_kernel: Count | None = None
    linear_num_key_heads: Count | None = None
    linear_num_value_heads: Count | None = None
    linear_key_head_dim: Count | None = None
    linear_value_head_dim: Count | None = None
    # Gemma 4 (HF's names; its sliding layers follow sliding_window_pattern as Gemma 3's): the
    # global layers' head_dim (head_dim is the sliding layers'); the last num_kv_shared_layers
    # read an earlier layer's KV and store none; per-layer embeddings, a table
    # [vocab_size_per_layer_input, layers x hidden_size_per_layer_input] kept in a file of its
    # own; the shared layers' MLPs twice intermediate_size wide where use_double_wide_mlp
    global_head_dim: Count | None = None
    num_kv_shared_layers: Annotated[int, msgspec.Meta(ge=0)] | None = None
    hidden_size_per_layer_input: Annotated[int, msgspec.Meta(ge=0)] | None = None
    vocab_size_per_layer_input: Count | None = None
    use_double_wide_mlp: bool | None = None

    @property
    def local_layers(self) -> tuple[int, ...]:
        """The sliding-window layers (Gemma 3 and 4: HF's rule, module docstring above)."""
        pattern = self.sliding_window_pattern
        if not (self.sliding_window and pattern):
            return ()
        return tuple(i for i in range(self.num_layers) if (i + 1) % pattern)

    @property
    def shared_layers(self) -> tuple[int, ...]:
        """Gemma 4's layers that read an earlier layer's KV and store none; () for other families."""
        shared = self.num_kv_shared_layers or 0
        return tuple(range(self.num_layers - shared, self.num_layers))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers holding KV: the "full_attention" ones of a hybrid, Gemma 4's unshared ones,
        else every layer."""
        if self.layer_types is None:
            return tuple(range(self.num_layers - (self.num_kv_shared_layers or 0)))  # shared ones last
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def state_layers(self) -> tuple[int, ...]:
        """A hybrid's layers holding a per-slot state instead of KV; () for other families."""
        if self.layer_types is None:
            return ()
        kv = set(self.kv_layers)
        return tuple(i for i in range(self.num_layers) if i not in kv)

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s attention head_dim: Gemma 4's global layers have their own."""
        if self.global_head_dim and layer not in self.local_layers:
            return self.global_head_dim
        return self.head_dim

    def layer_intermediate(self, layer: int) -> int:
        """Layer `layer`'s MLP width: Gemma 4's shared layers' twice it where use_double_wide_mlp."""
        wide = self.use_double_wide_mlp and layer in self.shared_layers
        return 2 * self.intermediate_size if wide else self.intermediate_size

    @property
    def per_layer_params(self) -> int:
        """Gemma 4's per-layer embedding table's values (its own file, not the graph's); 0 else."""
        width = self.hidden_size_per_layer_input or 0
        return (self.vocab_size_per_layer_input or 0) * self.num_layers * width

    def states(self) -> tuple[StateSpec, ...]:
        """The per-slot states `kvedge export` gives a hybrid (`export.lfm2_geometry`,
        `export.qwen35_geometry`): LFM2's conv layers [kernel - 1, hidden]; Qwen3.5's Gated DeltaNet
        layers [kernel - 1, 2 k_heads k_dim + v_heads v_dim] and [v_heads, k_dim, v_dim]."""
        layers, kernel = self.state_layers, self.conv_kernel or 1
        if not layers:
            return ()
        if self.family == "lfm2":
            return (StateSpec("conv", layers, (kernel - 1, self.hidden_size)),) if kernel > 1 else ()
        kh, vh = self.linear_num_key_heads, self.linear_num_value_heads
        kd, vd = self.linear_key_head_dim, self.linear_value_head_dim
        states = (StateSpec("recurrent", layers, (vh, kd, vd)),)
        if kernel > 1:
            states = (StateSpec("conv", layers, (kernel - 1, 2 * kh * kd + vh * vd)), *states)
        return states

    def geometry(self, max_len: int, kv_dtype: str, variant: str = "portable") -> CacheGeometry:
        """The cache `kvedge export` makes of this architecture as `variant` (as
        `export.geometry_from_config`): Gemma 4's by `shared_kv_geometry`; Gemma 3's local layers
        on rings in the portable variant, full length in the ort one (a windowed attention)."""
        if self.family == "gemma4_text":
            local = set(self.local_layers)
            return shared_kv_geometry(
                [i in local for i in range(self.num_layers)],
                self.shared_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                global_head_dim=self.global_head_dim,
                window=self.sliding_window,
                max_len=max_len,
                variant=variant,
            ).with_dtype(kv_dtype)
        ring = self.local_layers if variant == "portable" else ()
        return CacheGeometry(
            num_layers=len(self.kv_layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_len=max_len,
            ring_layers=ring,
            window=self.sliding_window if ring else 0,
            ring_margin=RING_MARGIN if ring else 0,
            kv_layers=self.kv_layers if self.state_layers else (),
            states=self.states(),
        ).with_dtype(kv_dtype)


# configs/models' `export:`: the export's choices and the TensorRT profile its engine is built with
ExportSection = section("ExportSection", ExportRecipe, ProfileSizes)


class RecipeFile(Strict):
    """`configs/models/NAME.yaml` as written."""

    name: Text
    description: Text
    source: Text
    architecture: Architecture
    export: ExportSection


class ModelRecipe(RecipeFile, frozen=True):
    """How to export one model, and its architecture for planning before any export exists."""

    path: Path  # the file it was loaded from

    @property
    def export_recipe(self) -> ExportRecipe:
        """The `export:` section as the export's choices (its TensorRT profile aside)."""
        return filled(ExportRecipe, self.export)

    def geometry(
        self, max_len: int | None = None, kv_dtype: str | None = None, variant: str = "portable"
    ) -> CacheGeometry:
        """The cache `kvedge export` makes for this recipe as `variant` (`Architecture.geometry`)."""
        return self.architecture.geometry(
            max_len or self.export.max_len, kv_dtype or self.export_recipe.kv_dtype, variant
        )


# --- warm prefixes -------------------------------------------------------------------------------


class Message(Strict):
    role: Literal[ROLES]
    content: str


class PrefixSpec(Strict):
    """One warm prefix: chat `messages` or raw `text` (exactly one)."""

    name: Annotated[str, msgspec.Meta(pattern=PREFIX_NAME)]
    messages: tuple[Message, ...] | None = None
    text: Text | None = None


class WarmPrefixConfig(Strict):
    """A warm-prefix file (`configs/warmup/*.yaml`)."""

    prefixes: Annotated[
        tuple[PrefixSpec, ...],
        msgspec.Meta(min_length=1, description="a non-empty list of {name, messages or text}"),
    ]


# --- loading -------------------------------------------------------------------------------------


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


def _refuse(path: Path, key: str, problem: str) -> KvedgeError:
    return KvedgeError(f"{path}: {key}: {problem}")


def _check_name(name: str, path: Path) -> None:
    if name != path.stem:
        raise _refuse(path, "name", f"{name!r} must equal the file name {path.stem!r}")


def load_board(name_or_path: str | Path) -> BoardProfile:
    """A board profile by name (`configs/devices/NAME.yaml`) or path."""
    path = _resolve(name_or_path, BOARDS_DIR, "board")
    data = read_yaml(path)
    if isinstance(data, dict) and isinstance(data.get("compute_capability"), float):
        raise _refuse(path, "compute_capability", "write it quoted ('8.7'): YAML reads 8.7 as a number")
    if isinstance(data, dict) and "recommended" in data:
        raise _refuse(
            path,
            "recommended",
            "no longer read; remove it: `kvedge plan MODEL --profile NAME` computes what to run on a device "
            "from its memory (kvedge.planner.recommend)",
        )
    device = parse(data, BoardFile, path)
    _check_name(device.name, path)
    return BoardProfile(**msgspec.structs.asdict(device), path=path)


def load_recipe(name_or_path: str | Path) -> ModelRecipe:
    """A model recipe by name (`configs/models/NAME.yaml`) or path."""
    path = _resolve(name_or_path, MODELS_DIR, "model recipe")
    data = read_yaml(path)
    move_renamed(data, "model", path)
    recipe = ModelRecipe(**msgspec.structs.asdict(parse(data, RecipeFile, path)), path=path)
    _check_name(recipe.name, path)
    a, export = recipe.architecture, recipe.export
    if a.num_heads % a.num_kv_heads:
        raise _refuse(
            path, "architecture.num_kv_heads", f"{a.num_kv_heads} does not divide num_heads={a.num_heads}"
        )
    _check_hybrid(a, path)
    _check_gemma4(a, path)
    if export.max_len > a.max_position_embeddings:
        raise _refuse(
            path,
            "export.max_len",
            f"{export.max_len} is not allowed; allowed: 16..{a.max_position_embeddings} "
            "(architecture.max_position_embeddings)",
        )
    if export.max_prefill > export.max_len:
        raise _refuse(
            path, "export.max_prefill", f"{export.max_prefill} is not allowed; allowed: 1..{export.max_len}"
        )
    try:  # a cache dtype the card names is CacheGeometry's to allow; let it name the allowed values
        if export.kv_dtype is not None:
            recipe.architecture.geometry(export.max_len, export.kv_dtype)
    except KvedgeError as exc:
        raise _refuse(path, "export.kv_dtype", str(exc)) from None
    try:  # the combination is the export's to allow (`ExportRecipe`)
        recipe.export_recipe  # noqa: B018
    except KvedgeError as exc:
        raise _refuse(path, "export", str(exc)) from None
    return recipe


def _check_hybrid(a: Architecture, path: Path) -> None:
    """A hybrid family's layer types and state sizes are given, and fit; no other family has them."""
    given = [k for k in ("layer_types", "conv_kernel", *DELTANET_FIELDS) if getattr(a, k) is not None]
    if a.family not in HYBRID_LAYER_TYPES:
        if given:
            raise _refuse(
                path,
                f"architecture.{given[0]}",
                f"only for the hybrid families {list(HYBRID_LAYER_TYPES)}, not {a.family!r}",
            )
        return
    needed = ("layer_types", "conv_kernel", *(DELTANET_FIELDS if a.family == "qwen3_5_text" else ()))
    for key in (*needed, *given):
        if key not in needed:
            raise _refuse(
                path, f"architecture.{key}", f"not a field of {a.family!r}; its fields: {list(needed)}"
            )
        if key not in given:
            raise _refuse(path, f"architecture.{key}", f"missing (required for {a.family!r})")
    allowed = HYBRID_LAYER_TYPES[a.family]
    kinds = a.layer_types
    if len(kinds) != a.num_layers or not set(kinds) <= set(allowed) or "full_attention" not in kinds:
        raise _refuse(
            path,
            "architecture.layer_types",
            f"{len(kinds)} layer types {sorted(set(kinds))} is not allowed; allowed: "
            f"num_layers={a.num_layers} of {list(allowed)}, at least one full_attention",
        )
    if a.family == "qwen3_5_text" and (
        allowed[1] not in kinds or a.linear_num_value_heads % a.linear_num_key_heads
    ):
        raise _refuse(
            path,
            "architecture",
            "qwen3_5_text needs linear_attention layers and linear_num_value_heads a multiple of "
            f"linear_num_key_heads (has {a.linear_num_value_heads}, {a.linear_num_key_heads})",
        )


def _check_gemma4(a: Architecture, path: Path) -> None:
    """Gemma 4's sizes are given, with its sliding layers, and each shared layer has an earlier
    layer of its kind to read; no other family has them."""
    given = [k for k in GEMMA4_FIELDS if getattr(a, k) is not None]
    if a.family != "gemma4_text":
        if given:
            raise _refuse(path, f"architecture.{given[0]}", f"only for 'gemma4_text', not {a.family!r}")
        return
    for key in (*GEMMA4_FIELDS, "sliding_window", "sliding_window_pattern"):
        if getattr(a, key) is None:
            raise _refuse(path, f"architecture.{key}", "missing (required for 'gemma4_text')")
    if a.num_kv_shared_layers >= a.num_layers:
        raise _refuse(
            path,
            "architecture.num_kv_shared_layers",
            f"{a.num_kv_shared_layers} is not allowed; allowed: 0..{a.num_layers - 1} (num_layers - 1)",
        )
    shared = a.shared_layers
    kinds = {i in a.local_layers for i in range(shared[0] if shared else a.num_layers)}
    if shared and {i in a.local_layers for i in shared} - kinds:
        raise _refuse(
            path,
            "architecture.num_kv_shared_layers",
            f"{len(shared)} is not allowed: each shared layer reads an earlier layer of its kind "
            f"(sliding or global), and layers 0..{shared[0] - 1} lack one",
        )


def load_warm_prefix_config(path: str | Path) -> WarmPrefixConfig:
    """Read and validate a warm-prefix file; errors name the file, the key and what is allowed."""
    path = Path(path)
    config = parse(read_yaml(path), WarmPrefixConfig, path)
    for i, spec in enumerate(config.prefixes):
        if (spec.messages is None) == (spec.text is None):
            raise _refuse(path, f"prefixes[{i}]", "give exactly one of 'messages' or 'text'")
        if spec.messages == ():
            raise _refuse(path, f"prefixes[{i}].messages", "[] is not allowed; allowed: a non-empty list")
    names = [spec.name for spec in config.prefixes]
    if len(set(names)) != len(names):
        raise _refuse(path, "prefixes", f"names must be unique, got {names}")
    return config
