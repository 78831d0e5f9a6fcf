"""The code's shape, read from the source.

No function in kvedge/ runs over 80 lines: counted from its `def` line to its last line, docstring
and comments included, as a reader scrolls it. Decorators are not counted: a click command's
option decorators declare its interface, they are not steps of its body. No module of
kvedge/planner/ runs over 400 lines (it was one module of 1,230 lines, split by role).

Export choices are declared once (`kvedge.contract.ExportRecipe`): a second class declaring them
drifts from the first (the planner's copy once had `head_bits` and `lm_head_bits` swapped), and
one declaring them under other names drifts unseen (configs' `ExportSettings` renamed `weights`).

docs/ARCHITECTURE.md stays a map a newcomer reads in 20 minutes (under 350 lines; the design notes
live in docs/design/), and every docs/ path kvedge/ and tests/ cite exists, with the section they
name where they name one: a note moved to another file leaves no citation pointing at nothing.

No diary in kvedge/: no tracker number ("issue 18") and no commit of ours (a short hash) in its
Python; figures and their history live in docs/PERFORMANCE.md, which a comment cites. A full
40-digit hash pins another project's source (onnx-tensorrt's operator table) and stays. No
sentence of a docstring or comment says "measured" beside a figure (a decimal, or a number with a
unit) unless it cites docs/PERFORMANCE.md: the measurement is copied there, not here. A method's
own parameters read as figures too ("measured on 256 MiB"): say those without "measured"."""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from pathlib import Path

import kvedge
from kvedge.contract import ExportRecipe

MAX_LINES = 80
PACKAGE = Path(kvedge.__file__).parent


DIARY = re.compile(r"\b[Ii]ssues? #?\d+\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b")


def diary_lines(root: Path) -> list[str]:
    """`file:line text` for every line of Python under `root` naming a tracker issue or a short
    commit hash."""
    return [
        f"{path.relative_to(root.parent)}:{n} {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if DIARY.search(line)
    ]


def test_no_diary_in_kvedge():
    assert diary_lines(PACKAGE) == []


def test_a_diary_line_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("X = 1  # measured at a2cf855\nY = 2  # see issue 18\nZ = 0x7fffffff\n")
    assert [line.split()[0] for line in diary_lines(package)] == ["pkg/a.py:1", "pkg/a.py:2"]


# a figure: a decimal or a number with a unit, standing alone (not a name's digits: SmolLM2,
# Qwen3-1.7B, int8); "measured" but not "not measured" or "unmeasured"
FIGURE = re.compile(r"(?<![\w.-])(?:\d+\.\d+|\d[\d,]*\s?(?:ms|s|MiB|GiB|KiB|MB|GB|KB|%|x)(?!\w))")
MEASURED = re.compile(r"(?<!not )\bmeasured\b", re.IGNORECASE)
PERFORMANCE = "docs/PERFORMANCE.md"


def prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment block in `path`: consecutive whole-line
    comments are one block; a trailing comment is one of its own. C++: its `//` comments alike."""
    text = path.read_text()
    lines = text.splitlines()
    blocks: list[tuple[int, str]] = []
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if doc := ast.get_docstring(node):
                    blocks.append((node.body[0].lineno, doc))
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        comments = [(t.start[0], t.string[1:]) for t in tokens if t.type == tokenize.COMMENT]
        marker = "#"
    else:
        comments = [(n, line.split("//", 1)[1]) for n, line in enumerate(lines, 1) if "//" in line]
        marker = "//"
    previous = -1
    for n, comment in comments:
        whole_line = lines[n - 1].lstrip().startswith(marker)
        if whole_line and previous == n - 1:
            blocks[-1] = (blocks[-1][0], f"{blocks[-1][1]}\n{comment}")
        else:
            blocks.append((n, comment))
        previous = n if whole_line else -1
    return blocks


def measured_figures(root: Path) -> list[str]:
    """`file:line sentence` for every sentence of a docstring or comment under `root` that says
    "measured" beside a figure and cites no docs/PERFORMANCE.md section."""
    found = []
    for path in sorted(p for pattern in CITING for p in root.rglob(pattern) if "third_party" not in p.parts):
        for number, block in prose(path):
            for paragraph in re.split(r"\n\s*\n", block):
                for sentence in re.split(r"(?<=[.;])\s+", " ".join(paragraph.split())):
                    if MEASURED.search(sentence) and FIGURE.search(sentence) and PERFORMANCE not in sentence:
                        found.append(f"{path.relative_to(root.parent).as_posix()}:{number} {sentence}")
    return found


def test_no_measurement_is_copied_into_kvedge():
    found = measured_figures(PACKAGE)
    assert not found, "figures belong in docs/PERFORMANCE.md; cite its section:\n" + "\n".join(found)


def test_a_copied_measurement_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        '"""Decode took 31 ms a token, measured on SmolLM2. A row costs more.\n\nNot measured: 1 GiB."""\n'
        "X = 1.3  # measured 1.28-1.31 per form\n"
        "# bytes held, as measured:\n# 2.6x the files\n"
        "Y = 2  # unmeasured: 0.5 ms; measured on SmolLM2-135M and Qwen3-1.7B\n"
        'Z = 4  # 0.4x, measured (docs/PERFORMANCE.md, "Threads")\n'
    )
    (package / "k.cc").write_text("int k = 1;  // the tiles beat rows (measured 2.5x at 48 rows)\n")
    assert [line.split(" ", 1)[0] for line in measured_figures(package)] == [
        "pkg/a.py:1",  # the docstring's first sentence, not its "Not measured" one
        "pkg/a.py:4",
        "pkg/a.py:5",  # the two comment lines read as one sentence
        "pkg/k.cc:1",
    ]


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


MAX_PLANNER_MODULE_LINES = 400


def test_no_planner_module_is_over_400_lines():
    modules = sorted((PACKAGE / "planner").glob("*.py"))
    assert modules, "kvedge/planner/ is a package of modules"
    found = {
        path.name: lines
        for path in modules
        if (lines := len(path.read_text().splitlines())) > MAX_PLANNER_MODULE_LINES
    }
    assert not found, f"kvedge/planner/ modules over {MAX_PLANNER_MODULE_LINES} lines; split them: {found}"


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


# A copy of ExportRecipe under other names (configs' ExportSettings had `weights_dtype` for
# `weights`): a class annotating two or more of its fields, one at least renamed. A field restates a
# recipe field named as it is, or named with its words and more (weights_dtype, lm_head_bits) when
# its default is the recipe's own default for it: a name that only contains the words measures
# something else (weights_bytes).
# None is known: the planner's footprint reads its precision and weights from its form or manifest.
KNOWN_COPIES: set[str] = set()


def recipe_copies(root: Path) -> dict[str, list[str]]:
    """`file:Class` -> the fields restating ExportRecipe's, for every class under `root` with two
    or more of them, one renamed (`ExportRecipe` and `Manifest`, `DECLARED_BY`, aside)."""
    defaults = dataclasses.asdict(ExportRecipe())  # after construction: what a field left None comes to
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            restated, renamed = [], False
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                name = item.target.id
                for field, default in defaults.items():
                    if name == field:
                        restated.append(name)
                    elif set(field.split("_")) < set(name.split("_")) and _literal(item.value) == (default,):
                        restated.append(name)
                        renamed = True
            where = f"{path.relative_to(root.parent).as_posix()}:{node.name}"
            if len(restated) >= 2 and renamed and where not in DECLARED_BY:
                found[where] = restated
    return found


def _literal(node: ast.expr | None) -> tuple[object, ...]:
    """(the value,) of a literal default; () for none, or one that is not a literal."""
    try:
        return () if node is None else (ast.literal_eval(node),)
    except ValueError:
        return ()


def test_no_class_restates_the_export_recipe_under_other_names():
    assert set(recipe_copies(PACKAGE)) == KNOWN_COPIES


def test_a_renamed_copy_of_the_export_recipe_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "class Settings:\n    max_len: int = 2048\n    logits: str = 'rows'\n"
        "    weights_dtype: str = 'float32'\n\n"
        "class Sizes:\n    max_len: int\n    weights_bytes: int = 0\n\n"
        "class Named:\n    max_len: int\n    logits: str\n"
    )
    assert recipe_copies(tmp_path / "pkg") == {"pkg/m.py:Settings": ["max_len", "logits", "weights_dtype"]}


ROOT = PACKAGE.parent
MAX_ARCHITECTURE_LINES = 350
# a docs/ path, then the section it names where it names one: `docs/X.md, "Section"`
DOC_CITATION = re.compile(r"""(?<![\w/])(docs/[\w/.-]*\w)(?:,?[ \t]+["']([^"'\n]+)["'])?""")
# docs/ paths of other projects: onnx-tensorrt's operator table (kvedge/export/trt_compat.py)
ELSEWHERE = {"docs/operators.md"}
CITING = ("*.py", "*.cc", "*.h")


def headings(doc: Path) -> list[str]:
    """The text of every Markdown heading in `doc`, outside code blocks."""
    found, fenced = [], False
    for line in doc.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (match := re.match(r"#+ (.+)", line)):
            found.append(match.group(1))
    return found


def broken_citations(root: Path, folders: tuple[str, ...], skip: Path | None = None) -> list[str]:
    """`file:line cited` for every docs/ path in the files under `folders` (but `skip`) that `root`
    lacks, or whose section no heading of the file starts with."""
    broken = []
    for folder in folders:
        for path in sorted(p for pattern in CITING for p in (root / folder).rglob(pattern)):
            if "third_party" in path.parts or path == skip:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for match in DOC_CITATION.finditer(line):
                    cited, section = match.groups()
                    doc = root / cited
                    if cited in ELSEWHERE:
                        continue
                    if not doc.exists() or (
                        section and not any(h.startswith(section) for h in headings(doc))
                    ):
                        broken.append(f"{path.relative_to(root).as_posix()}:{number} {match.group(0)}")
    return broken


# a relative Markdown link, then the section it names where it names one: `[X.md](X.md), "Section"`
DOC_LINK = re.compile(r"""\]\(([^)#\s:]+)(?:#[^)]*)?\)(?:,?\s+"([^"]+)")?""")


def broken_links(root: Path) -> list[str]:
    """`file -> link` for every relative link in README.md and docs/ that leads nowhere, or to a
    Markdown file no heading of which starts with the section named after it."""
    broken = []
    for doc in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for match in DOC_LINK.finditer(doc.read_text()):
            target, section = doc.parent / match.group(1), match.group(2)
            if not target.exists() or (
                section
                and target.suffix == ".md"
                and not any(h.startswith(" ".join(section.split())) for h in headings(target))
            ):
                named = f', "{" ".join(section.split())}"' if section else ""
                broken.append(f"{doc.relative_to(root).as_posix()} -> {match.group(1)}{named}")
    return broken


def test_every_link_between_docs_resolves():
    broken = broken_links(ROOT)
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_architecture_is_a_map_under_350_lines():
    lines = len((ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines())
    assert lines < MAX_ARCHITECTURE_LINES, (
        f"docs/ARCHITECTURE.md has {lines} lines; keep it under {MAX_ARCHITECTURE_LINES}: a topic's "
        "details go to docs/design/<topic>.md, with a paragraph and a link on the map"
    )


def test_every_cited_doc_and_section_exists():
    broken = broken_citations(ROOT, ("kvedge", "tests"), skip=Path(__file__))  # its examples are fake
    assert not broken, "citations of docs that do not exist:\n" + "\n".join(broken)


def test_a_citation_of_a_missing_doc_or_section_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "MAP.md").write_text("# Map\n\n## Layers\n\n```\n## not a heading\n```\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        '# docs/MAP.md, "Layers" and docs/MAP.md\n'
        '# docs/MAP.md "Rings"\n'
        "# docs/MAP.md, 'not a heading'\n"
        "# docs/GONE.md\n"
        "# the other project's docs/operators.md\n"
    )
    assert broken_citations(tmp_path, ("pkg",)) == [
        'pkg/m.py:2 docs/MAP.md "Rings"',
        "pkg/m.py:3 docs/MAP.md, 'not a heading'",
        "pkg/m.py:4 docs/GONE.md",
    ]


def test_a_link_to_a_missing_doc_or_section_is_found(tmp_path):
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "README.md").write_text("[map](docs/MAP.md), [gone](docs/GONE.md)\n")
    (tmp_path / "docs" / "MAP.md").write_text("# Map\n\n## Two forms of one graph\n")
    (tmp_path / "docs" / "design" / "note.md").write_text(
        '[the map](../MAP.md), "Two forms\nof one graph"; [the map](../MAP.md), "Rings"\n'
    )
    assert broken_links(tmp_path) == [
        "README.md -> docs/GONE.md",
        'docs/design/note.md -> ../MAP.md, "Rings"',
    ]
