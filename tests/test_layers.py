"""kvedge's layers, read from the source: no import circle between modules, and no module importing
a layer above its own (docs/ARCHITECTURE.md, "Layers").

Every `import kvedge...` / `from kvedge... import` in a module counts, at module level or inside a
function (a lazy import still ties the two modules together). A module belongs to the unit its
first name under `kvedge` gives (`kvedge.runtime.cache` -> runtime, `kvedge.quant` -> quant). A unit
may import itself and the units of lower layers; units of one layer are peers and do not import
each other (export and runtime both stand on contract and accel, not on one another).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvedge

# Lowest first. "kvedge" is the package's own __init__ (its version string).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvedge", "errors", "files", "machine", "declare"),
    ("contract", "cudart"),
    ("quant", "accel", "configs"),
    ("kv4",),
    ("runtime", "export"),
    ("calibrate", "planner", "doctor"),
    ("serve", "bench"),
    ("cli",),
    ("__main__",),
)
PACKAGE = Path(kvedge.__file__).parent


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported kvedge module, dotted
    where: str  # file:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    """`name` (dotted, under root's package) is a module file or a package."""
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def read_imports(root: Path) -> list[Import]:
    """Every import of a module of the package at `root` by a module of it, with file:line. A
    `from package import name` names the submodule where `name` is one, else the package."""
    top = root.name
    found = []
    for path in sorted(root.rglob("*.py")):
        source = module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against the importing module's package
                    package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join([*package, *([base] if base else [])])
                targets = [
                    f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}", root) else base
                    for alias in node.names
                ]
            else:
                continue
            found += [
                Import(source, target, where)
                for target in dict.fromkeys(targets)
                if target == top or target.startswith(top + ".")
            ]
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(module: str, layers=LAYERS) -> int:
    name = unit(module)
    for i, members in enumerate(layers):
        if name in members:
            return i
    raise AssertionError(f"module {module}: unit {name!r} is in no layer; add it to LAYERS")


def upward_imports(imports: list[Import], layers=LAYERS) -> list[str]:
    """Imports of a higher layer, or of a peer unit of the same layer, each with why."""
    bad = []
    for imp in imports:
        mine, theirs = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if unit(imp.source) == unit(imp.target) or theirs < mine:
            continue
        if theirs > mine:
            why = f"{unit(imp.target)} is a layer above {unit(imp.source)}"
        else:
            why = f"{unit(imp.source)} and {unit(imp.target)} are peers, one layer: {list(layers[mine])}"
        bad.append(f"{imp} ({why})")
    return bad


def import_circles(imports: list[Import]) -> list[str]:
    """Each circle of modules importing each other (a strongly connected component of more than
    one module, or a module importing itself), with the imports that close it."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.source, set()).add(imp.target)
        edges.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative: no recursion limit to meet
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(edges):
        if node not in index:
            visit(node)
    circles = []
    for component in components:
        inside = [str(i) for i in imports if i.source in component and i.target in component]
        if len(component) > 1 or inside:
            circles.append(f"circle {sorted(component)}:\n    " + "\n    ".join(inside))
    return circles


def test_kvedge_has_no_import_circle():
    circles = import_circles(read_imports(PACKAGE))
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_kvedge_module_imports_a_layer_above_its_own():
    bad = upward_imports(read_imports(PACKAGE))
    assert not bad, "imports against the layer order (tests/test_layers.py LAYERS):\n" + "\n".join(bad)


def test_every_kvedge_unit_has_a_layer():
    units = {unit(module_name(path, PACKAGE)) for path in PACKAGE.rglob("*.py")}
    placed = {name for members in LAYERS for name in members}
    assert units <= placed, f"units in no layer: {sorted(units - placed)}"


def test_lazy_imports_count(tmp_path):
    """The checks see imports inside functions, name file:line, and catch a circle, an import of a
    higher layer and one between peers, on a package made here."""
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("import os\n\n\ndef f():\n    from pkg.high import b\n")
    (root / "high.py").write_text("from pkg.low import a\nfrom pkg import peer\n")
    (root / "peer.py").write_text("X = 1\n")
    layers = (("pkg",), ("low",), ("high", "peer"))
    imports = read_imports(root)
    assert [str(i) for i in imports] == [
        "pkg/high.py:1: pkg.high imports pkg.low.a",
        "pkg/high.py:2: pkg.high imports pkg.peer",
        "pkg/low/a.py:5: pkg.low.a imports pkg.high",
    ]
    (circle,) = import_circles(imports)
    assert "pkg/low/a.py:5" in circle and "pkg/high.py:1" in circle
    upward = upward_imports(imports, layers)
    assert len(upward) == 2
    assert upward[0].startswith("pkg/high.py:2: pkg.high imports pkg.peer (high and peer are peers")
    assert upward[1].startswith("pkg/low/a.py:5: pkg.low.a imports pkg.high (high is a layer above low")
    with pytest.raises(AssertionError, match="unit 'nowhere' is in no layer"):
        layer_of("pkg.nowhere", layers)
