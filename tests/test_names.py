"""One word per thing in the Python API too: the glossary at the top of docs/ARCHITECTURE.md names
each thing with the identifiers that hold it, and every one of them must exist; a retired
spelling (`OLD_NAMES`) must not come back as a public module, class, function or attribute.
tests/test_cli_names.py does the same for command-line options and service config keys."""

from __future__ import annotations

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
