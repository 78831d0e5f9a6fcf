"""One word per thing in the Python API too: the glossary at the top of docs/ARCHITECTURE.md names
each thing with the identifiers that hold it, and every one of them must exist; a retired
spelling (`OLD_NAMES`) must not come back as a public module, class, function or attribute, and
no name a module defines may hold a retired word (`RETIRED_WORDS`) inside it (`EngineFailed`
holds "engine", which means a TensorRT engine only).
tests/test_cli_names.py does the same for command-line options and service config keys."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import click
import msgspec
import pytest

import kvedge
from kvedge.cli import main
from kvedge.contract.engine import DEVICES
from kvedge.runtime.backends.memory import KV_MEMORY
from kvedge.serve.config import KEYS

REPO = Path(kvedge.__file__).resolve().parents[1]
# retired spelling: the one that replaced it
OLD_NAMES = {
    "Engine": "Scheduler",
    "WarmupConfig": "WarmPrefixConfig",
    "WarmupReport": "WarmPrefixReport",
    "load_warmup_config": "load_warm_prefix_config",
    "warm_up": "load_warm_prefixes",
    "warmup_report": "warm_report",
    "warm_prefix_report": "warm_report",
    "PrefixLRU": "RunTimePrefixStore",
    "PrefixStore": "WarmPrefixStore",
    "prefix_lru": "run_time",
    "run_time_store": "run_time",
    "warm_store": "warm",
    "DeviceProfile": "BoardProfile",
    "load_device": "load_board",
    "device_budget": "board_budget",
    "DeviceInfo": "GpuInfo",
    "EngineFailed": "SchedulerFailed",  # "engine" is a TensorRT engine only
}
OLD_MODULES = {
    "kvedge.serve.engine": "kvedge.serve.scheduler",
    "kvedge.runtime.warmup": "kvedge.runtime.warm_prefixes",
}


def modules() -> dict[str, object]:
    """Every kvedge module, imported, by name (one whose optional dependency is missing skipped)."""
    found = {"kvedge": kvedge}
    for info in pkgutil.walk_packages(kvedge.__path__, "kvedge."):
        if info.name.endswith(".__main__") or info.name == "kvedge.runtime._kvedge_ops":
            continue  # importing it runs the CLI; the kernel library is no Python module
        try:
            found[info.name] = importlib.import_module(info.name)
        except ImportError as exc:
            if exc.name and exc.name.split(".")[0] == "kvedge":
                raise
    return found


MODULES = modules()


def members(cls: type) -> set[str]:
    """A class's own names: attributes, methods, fields and what its methods set on `self`."""
    names = set(vars(cls)) | set(getattr(cls, "__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    if issubclass(cls, msgspec.Struct):
        names |= set(cls.__struct_fields__)
    try:
        names |= set(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]+)?=", inspect.getsource(cls)))
    except (OSError, TypeError):
        pass
    return {n for n in names if not n.startswith("_")}


def public_names(module_names) -> dict[str, str]:
    """`name: where` for every public module, class, function, constant and class member."""
    names = {}
    for name in module_names:
        module = MODULES[name]
        names[name.rsplit(".", 1)[-1]] = name
        for attr, obj in vars(module).items():
            if attr.startswith("_") or inspect.ismodule(obj):
                continue
            if getattr(obj, "__module__", name) != name and (inspect.isclass(obj) or callable(obj)):
                continue  # imported from elsewhere: counted where it is defined
            names[attr] = f"{name}.{attr}"
            if inspect.isclass(obj):
                names.update({m: f"{name}.{attr}.{m}" for m in members(obj)})
    return names


ALL_NAMES = public_names(list(MODULES))
# string constants (ENGINE_FILE, SUFFIX...): the file names and suffixes the code writes
VALUES = {v for m in MODULES.values() for k, v in vars(m).items() if k.isupper() and isinstance(v, str)}


def test_no_public_name_uses_a_retired_spelling():
    assert {old: ALL_NAMES[old] for old in OLD_NAMES if old in ALL_NAMES} == {}, "use the new names"
    assert set(OLD_MODULES) & set(MODULES) == set()
    assert set(OLD_NAMES.values()) <= set(ALL_NAMES), "OLD_NAMES names a new spelling that does not exist"
    assert set(OLD_MODULES.values()) <= set(MODULES)


# retired words inside identifiers (tuples of words, read across snake_case and CamelCase):
# what replaced them, and the identifiers that keep them in the glossary's remaining sense
RETIRED_WORDS: dict[tuple[str, ...], tuple[str, frozenset[str]]] = {
    ("engine",): (
        "scheduler, where it is not a TensorRT engine",
        frozenset(
            {
                # a bare `engine` is kept where it is one: the command, its module, a built engine
                "kvedge/cli.py: engine",
                "kvedge/contract/engine.py: engine",
                "kvedge/export/tensorrt.py: engine",
                "kvedge/planner/recommend.py: engine",
                "kvedge/runtime/backends/trt.py: engine",
                "ENGINE_FILE",
                "ENGINE_FORMAT",
                "ENGINE_MANIFEST_FILE",
                "ENGINE_VERSION",
                "EngineManifest",
                "EngineOptions",
                "build_engine",
                "_build_engine",
                "deserialize_engine",
                "engine_command",
                "engine_manifest",
                "engine_options",
            }
        ),
    ),
    ("prefix", "cache"): ("prefix stores", frozenset({"prefix_cache_bytes"})),  # a config key, kept
    # the run-time store was named by its eviction order (`PrefixLRU`); LRU stays a word of prose
    ("lru",): ("run time (`RunTimePrefixStore`, `PrefixStores.run_time`, `RunTimeEntry`)", frozenset()),
    ("device", "profile"): ("board", frozenset()),
    ("device", "budget"): ("board", frozenset()),
}


def words(identifier: str) -> list[str]:
    """An identifier's words, lower case, split at underscores and at CamelCase humps:
    `EngineFailed` and `engine_failed` are both ["engine", "failed"], `LRUEntry` ["lru", "entry"]."""
    parts = identifier.split("_")
    return [w.lower() for part in parts for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", part)]


def retired_words_in(identifier: str, where: str = "") -> list[str]:
    """The retired words `identifier` (in the file `where`) holds outside the names that keep
    them, a kept name being an identifier or `file: identifier`."""
    said = words(identifier)
    return [
        " ".join(retired)
        for retired, (_, kept) in RETIRED_WORDS.items()
        if identifier not in kept
        and f"{where}: {identifier}" not in kept
        and any(tuple(said[i : i + len(retired)]) == retired for i in range(len(said)))
    ]


def defined_names(source: str) -> set[str]:
    """Every identifier a module defines: classes, functions, arguments, assigned names and
    attributes, import aliases. Names it only reads (another library's API) are not its words."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            found.add(node.asname)
    return found


def retired_words(root: Path) -> list[str]:
    """`file: identifier (word)` for every module path and defined identifier under `root` that
    holds a retired word."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        names = {*path.relative_to(root.parent).with_suffix("").parts, *defined_names(path.read_text())}
        found += [f"{where}: {n} ({w})" for n in sorted(names) for w in retired_words_in(n, where)]
    return found


def test_no_identifier_holds_a_retired_word():
    found = retired_words(REPO / "kvedge")
    assert not found, "retired words inside names; RETIRED_WORDS says what replaced each:\n" + "\n".join(
        found
    )


def test_a_retired_word_inside_a_name_is_found(tmp_path):
    assert words("EngineFailed") == words("engine_failed") == ["engine", "failed"]
    assert words("LRUEntry") == ["lru", "entry"] and words("GpuInfo2") == ["gpu", "info", "2"]
    for made_up in (
        "EngineFailed",
        "engine_failed",
        "SchedulerEngine",
        "ENGINE_ERROR",
        "prefix_cache_hits",
        "LRUEntry",
    ):
        assert retired_words_in(made_up), made_up
    for kept in ("EngineManifest", "prefix_cache_bytes", "Scheduler", "engineer", "prefix_disk"):
        assert retired_words_in(kept) == [], kept
    package = tmp_path / "pkg"
    (package / "serve").mkdir(parents=True)
    (package / "serve" / "engine.py").write_text(
        "import numpy as np\n\n\nclass EngineFailed(Exception):\n    pass\n\n\n"
        "def step(engine_state, x=np.zeros(1)):\n    x.engine_id = 1\n    return np.prefix_cache_hits\n"
    )
    assert retired_words(package) == [
        "pkg/serve/engine.py: EngineFailed (engine)",
        "pkg/serve/engine.py: engine (engine)",
        "pkg/serve/engine.py: engine_id (engine)",
        "pkg/serve/engine.py: engine_state (engine)",
    ]


def glossary() -> list[tuple[str, list[str]]]:
    """(word, the backticked identifiers of its first two columns) per glossary row."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return [(cells[0][2:], re.findall(r"`([^`]+)`", cells[0] + cells[1])) for cells in rows[1:]]


def options() -> dict[str, click.Option]:
    commands = [main, *main.commands.values()]
    return {o: p for c in commands for p in c.params if isinstance(p, click.Option) for o in p.opts}


def resolves(token: str) -> bool:
    """Whether a glossary identifier names something that exists: a `kvedge` command and its
    options, an option (with one of its values), a file or folder, a file name the code writes,
    a Python name (dotted: a module, then attributes), a service config key or a --device value."""
    words = token.split()
    if words[0] == "kvedge":
        command = main.commands.get(words[1])
        return command is not None and all(
            any(w in p.opts for p in command.params if isinstance(p, click.Option)) for w in words[2:]
        )
    if words[0].startswith("--"):
        option = options().get(words[0])
        choices = getattr(option.type, "choices", None) if option else None
        return option is not None and all(w in (choices or [w]) for w in words[1:])
    if "/" in token:
        return any(list(root.glob(token.replace("NAME", "*"))) for root in (REPO, REPO / "kvedge"))
    if token in VALUES:
        return True
    path = re.sub(r"\[.*\]$", "", token).split(".")
    if len(path) == 1:
        return token in ALL_NAMES or token in KEYS or token in DEVICES or token in KV_MEMORY
    roots = [m for n, m in MODULES.items() if n.rsplit(".", 1)[-1] == path[0]]
    roots += [getattr(m, path[0]) for n, m in MODULES.items() if ALL_NAMES.get(path[0]) == f"{n}.{path[0]}"]
    return any(walk(root, path[1:]) for root in roots)


def walk(obj: object, attrs: list[str]) -> bool:
    """Whether `obj.a.b...` exists; an instance attribute (set in `__init__`) ends the walk."""
    for attr in attrs:
        if inspect.isclass(obj) and attr in members(obj) and not hasattr(obj, attr):
            return attr == attrs[-1]
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


@pytest.mark.parametrize("word, names", glossary(), ids=[w for w, _ in glossary()])
def test_every_glossary_identifier_exists(word, names):
    assert [n for n in names if not resolves(n)] == []


def test_the_glossary_is_short_and_its_resolver_can_fail():
    assert 10 <= len(glossary()) <= 15  # "state" (hybrid models) made it 15
    for missing in (
        "PrefixLRU",
        "serve/engine.py",
        "kvedge warmup --nope",
        "--kv-memory disk",
        "Model.nope",
    ):
        assert not resolves(missing), missing
