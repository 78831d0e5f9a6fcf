"""No function in kvedge/ runs over 80 lines (DEVELOPERS.md): counted from its `def` line to its
last line, docstring and comments included, as a reader scrolls it. Decorators are not counted: a
click command's option decorators declare its interface, they are not steps of its body."""

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
