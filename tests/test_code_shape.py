"""The code's shape, read from the source.

No function in kvedge/ runs over 80 lines: counted from its `def` line to its last line, docstring
and comments included, as a reader scrolls it. Decorators are not counted: a click command's
option decorators declare its interface, they are not steps of its body.

Export choices are declared once (`kvedge.contract.ExportRecipe`): a second class declaring them
drifts from the first (the planner's copy once had `head_bits` and `lm_head_bits` swapped)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvedge

MAX_LINES = 80
PACKAGE = Path(kvedge.__file__).parent


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """`file:line name (n lines)` for every function or method under `root` longer than `limit`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_kvedge_is_over_80_lines():
    found = long_functions(PACKAGE)
    assert not found, f"functions over {MAX_LINES} lines; split them into named steps:\n" + "\n".join(found)


def test_long_functions_are_found(tmp_path):
    """The count covers methods, starts at the `def` line and passes exactly 80 lines."""

    def body(n: int, indent: str) -> str:
        return "\n".join(f"{indent}x{i} = {i}" for i in range(n))

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"def fits():\n{body(79, '    ')}\n\n\n"
        f"class C:\n    @staticmethod\n    def over():\n{body(80, '        ')}\n"
    )
    assert long_functions(tmp_path / "pkg") == ["pkg/m.py:85 over (81 lines)"]
    assert long_functions(tmp_path / "pkg", limit=79) == [
        "pkg/m.py:1 fits (80 lines)",
        "pkg/m.py:85 over (81 lines)",
    ]


# fields only an export's choices have (max_len, logits and kv_dtype mean other things elsewhere)
EXPORT_CHOICES = {
    "variant",
    "precision",
    "weights",
    "block_size",
    "outlier_channels",
    "head_bits",
    "decode_matmuls",
    "kv_group_size",
}
# what declares them: the recipe, and the manifest that records what an export was made with
DECLARED_BY = {"kvedge/contract/recipe.py:ExportRecipe", "kvedge/contract/manifest.py:Manifest"}


def classes_declaring(root: Path, fields: set[str], least: int = 2) -> set[str]:
    """`file:Class` for every class under `root` whose body annotates `least` or more of `fields`."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = {
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }
                if len(names & fields) >= least:
                    found.add(f"{path.relative_to(root.parent).as_posix()}:{node.name}")
    return found


def test_export_choices_are_declared_once():
    assert classes_declaring(PACKAGE, EXPORT_CHOICES) == DECLARED_BY


def test_a_second_declaration_of_export_choices_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "class Form:\n    weights: str\n    head_bits: int | None = None\n\n"
        "class Other:\n    weights: bytes\n"
    )
    assert classes_declaring(tmp_path / "pkg", EXPORT_CHOICES) == {"pkg/m.py:Form"}
