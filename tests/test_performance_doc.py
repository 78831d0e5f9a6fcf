"""docs/PERFORMANCE.md's and README.md's figures come from results folders committed in the repository.

Every `bench/results/<folder>` the pages name exists with its JSON and is named
<YYYY-MM-DD>-<commit>-<what> (`kvedge.bench.results`; a "-dirty" run names no commit, so it is
not citable). A table whose first header is one of KINDS holds figures: its
source is the last results folder named between the heading above it and the table, and every
cell is checked against that folder's JSON:

    system      `kvedge bench` figures: rows are system names as the JSON spells them, columns
                one of COLUMNS' headers ("ms @C" is "@C")
    `kvedge export ...`   README's export table: as "system", rows the `kvedge export` options of
                the export the bench measured (`export_system`)
    kvedge vs   speed-ups, rows "A vs B", recomputed from the JSON's per-round times with
                `kvedge.bench.report.speedup` (what the bench's targets use)
    mode        bench/serve.py's JSON: rows are its modes ("batched", "one at a time")
    batch       bench/serve.py's JSON: the cost of one decode call over that many rows
    head        bench/head_bits.py's JSON: rows are its head forms ("int4 b32", "top 11264")
    hybrid      bench/hybrid.py's JSON: rows are its systems ("kvedge", "transformers")
    scale form  bench/scale.py's JSON: rows are its export forms ("cpu", "nano") and "genai int4"

A cell matches when the JSON's value, rounded to the cell's decimals, gives the cell; "-" and a
cell in parentheses ("(reference)") are not figures.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvedge.bench.prepare import KvedgeBuild
from kvedge.bench.report import speedup
from kvedge.contract import ExportRecipe

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "PERFORMANCE.md"
DOCS = (DOC, ROOT / "README.md")
EXPORTS = "`kvedge export ...`"  # README's export table
FOLDER = re.compile(r"bench/results/([A-Za-z0-9._-]*[A-Za-z0-9])")  # a trailing "." ends a sentence
# <date>-<commit>-<what>: what may name a card ("qwen3-1.7b") and a GGUF type ("q8_0")
CITABLE = re.compile(r"(\d{4}-\d{2}-\d{2})-[0-9a-f]{7,40}-(?!dirty)[a-z0-9._-]*[a-z0-9]")
NUMBER = re.compile(r"-?\d+(?:\.(\d+))?%?")
KINDS = ("system", "kvedge vs", "mode", "batch", "workload", "head", "hybrid", "scale form", EXPORTS)
NOT_CITED = {"scratch"}  # the git-ignored folder for runs not meant to be kept


def _system(data: dict, row: str) -> dict:
    return next(s for s in data["systems"] if s["name"] == row)


# header -> value of (the JSON, the row's label) for "system" tables
COLUMNS: dict[str, Callable[[dict, str], float]] = {
    "peak RSS MiB": lambda d, r: d["memory"][r],
    "weights MB/token": lambda d, r: _system(d, r)["weight_bytes_per_token"] / 1e6,
    "KV KB/token": lambda d, r: _system(d, r)["kv_bytes_per_token"] / 1e3,
    "RSS growth MiB": lambda d, r: d["allocation"][r]["rss_growth_mib"],
    "heap growth KiB": lambda d, r: d["allocation"][r]["heap_growth_kib"],
    "KL vs float32": lambda d, r: d["quality"][r]["mean_kl"],
    "top-1": lambda d, r: 100 * d["quality"][r]["top1_agreement"],
    "files MiB": lambda d, r: _system(d, r)["artifact_bytes"] / 2**20,
}


def export_system(row: str) -> str:
    """The bench's name for the export a README row's `kvedge export` options make (no options:
    the default export)."""
    flags = re.findall(r"--([a-z-]+) ([a-z0-9]+)", row)
    return KvedgeBuild(ExportRecipe(**{flag.replace("-", "_"): value for flag, value in flags})).system_name


SERVE_COLUMNS: dict[str, Callable[[dict, str], float]] = {
    "1 stream alone tok/s": lambda d, r: d[r]["alone_tokens_per_s"],
    "streams together tok/s": lambda d, r: d[r]["together_tokens_per_s"],
    "TTFT together ms": lambda d, r: 1000 * d[r]["together_ttft_s"],
}


# bench/speculate.py's speculate.json: a row is "<export folder> <workload>"
SPECULATE_COLUMNS = {
    "plain tok/s": lambda f: f["plain_tokens_per_s"],
    "lookup tok/s": lambda f: f["lookup_tokens_per_s"],
    "draft tok/s": lambda f: f["draft_tokens_per_s"],
    "ratio": lambda f: f["speedup"],
    "tokens / call": lambda f: f["tokens_per_call"],
    "proposals taken": lambda f: 100 * f["taken_share"],
    "greedy equal": lambda f: float(f["greedy_equal"]),  # the doc's yes / no
}


# bench/head_bits.py's head_bits.json: a row is one form of the tied table
HEAD_COLUMNS = {
    "bits / head param": lambda r: r["bits_per_head_param"],
    "KL": lambda r: r["mean_kl"],
    "top-1": lambda r: 100 * r["top1_agreement"],
}


# bench/hybrid.py's hybrid.json: a row is a system
HYBRID_COLUMNS = {
    "decode ratio": lambda r: r["decode_ratio_longest_to_shortest"],
    "prefill s": lambda r: r["prefill_s"],
}


# bench/scale.py's scale.json: a row is an export form (its "forms" entry and its run) or the
# onnxruntime-genai build ("genai int4": its "genai" entry and its run)
SCALE_COLUMNS = {
    "export s": lambda f, r: f["export"]["wall_s"],
    "export peak GiB": lambda f, r: f["export"]["peak_rss"] / 2**30,
    "files MiB": lambda f, r: f["files"] / 2**20,
    "bits / param": lambda f, r: f["bits_per_parameter"],
    "run peak GiB": lambda f, r: r["peak_rss"] / 2**30,
    "planned / run": lambda f, r: f["planned_over_measured"],
    "ms / token": lambda f, r: r["median_decode_ms"],
    "prefill s": lambda f, r: r["median_prefill_s"],
}


def figure(data: dict, kind: str, header: str, row: str) -> float:
    """The JSON's value for one table cell."""
    if kind == "scale form":
        assert header in SCALE_COLUMNS, f"'scale form' column {header!r}: not in scale.json"
        form = data["genai"] if row == "genai int4" else data["forms"][row]
        if row == "genai int4":
            form = {**form, "export": form["build"]}
        return SCALE_COLUMNS[header](form, data["runs"][row])
    if kind == "hybrid":
        system = data["systems"][row]
        if match := re.fullmatch(r"decode ms @(\d+)", header):
            return system["decode_ms"][match[1]]
        assert header in HYBRID_COLUMNS, f"'hybrid' column {header!r}: not in hybrid.json"
        return HYBRID_COLUMNS[header](system)
    if kind == "workload":
        export, workload = row.split(" ")
        assert header in SPECULATE_COLUMNS, f"'workload' column {header!r}: not in speculate.json"
        return SPECULATE_COLUMNS[header](data["exports"][export][workload])
    if kind == EXPORTS:
        kind, row = "system", export_system(row)
    decode, prefill = re.fullmatch(r"(?:ms )?@(\d+)", header), re.fullmatch(r"prefill (\d+)", header)
    if kind == "kvedge vs":
        a, b = row.split(" vs ")
        case = f"decode:{decode[1]}" if decode else f"prefill:{prefill[1]}" if prefill else None
        assert case, f"'kvedge vs' column {header!r}: expected '@<context>' or 'prefill <length>'"
        ratio = speedup(SimpleNamespace(rounds=data["rounds"]), a, b, case)
        assert ratio is not None, f"no per-round times for {row!r} at {case}"
        return ratio
    if kind == "mode":
        return SERVE_COLUMNS[header](data, row)
    if kind == "head":
        assert header in HEAD_COLUMNS, f"'head' column {header!r}: not in head_bits.json"
        return HEAD_COLUMNS[header](next(r for r in data["rows"] if r["head"] == row))
    if kind == "batch":
        assert header == "ms per decode call", f"'batch' column {header!r}: expected 'ms per decode call'"
        return 1000 * data["decode_call_s"][row]
    if decode:
        return data["decode"][row][decode[1]]
    if match := re.fullmatch(r"prefill (\d+) tok/s", header):
        return data["prefill"][row][match[1]]["tokens_per_s"]
    if match := re.fullmatch(r"TTFT (\d+) ms", header):
        return data["prefill"][row][match[1]]["ttft_ms"]
    assert header in COLUMNS, f"column {header!r} has no JSON figure; known: {sorted(COLUMNS)}"
    return COLUMNS[header](data, row)


@dataclass
class Table:
    line: int  # 1-based line of its header row in the doc
    source: str | None  # the results folder it cites
    header: list[str]
    rows: list[list[str]]


def _cells(line: str) -> list[str]:
    return [cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> Iterator[Table]:
    """Every markdown table of `text`, with the last results folder named since the heading above."""
    lines, source, i = text.splitlines(), None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            source = None
        elif line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            table = Table(i + 1, source, _cells(line), [])
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                table.rows.append(_cells(lines[i]))
                i += 1
            yield table
            continue
        else:
            found = FOLDER.findall(line)
            source = found[-1] if found else source
        i += 1


def results_json(folder: str) -> dict[str, Any]:
    path = ROOT / "bench" / "results" / folder
    files = sorted(path.glob("*.json"))
    assert len(files) == 1, f"bench/results/{folder}: expected one JSON file, found {files}"
    return json.loads(files[0].read_text())


def check_table(table: Table) -> list[str]:
    """The cells of a figures table that its source's JSON does not give."""
    kind = table.header[0]
    assert table.source, f"line {table.line}: a {kind!r} table names no results folder above it"
    data = results_json(table.source)
    wrong = []
    for row in table.rows:
        for header, cell in zip(table.header[1:], row[1:], strict=True):
            if cell == "-" or cell.startswith("("):
                continue
            cell = {"yes": "1", "no": "0"}.get(cell, cell)
            number = NUMBER.fullmatch(cell)
            assert number, f"line {table.line}, {row[0]!r}, {header!r}: {cell!r} is not a figure"
            decimals = len(number[1] or "")
            value = figure(data, kind, header, row[0])
            if abs(value - float(cell.rstrip("%"))) > 0.5 * 10**-decimals + 1e-9:
                wrong.append(f"{row[0]!r} {header!r}: doc {cell}, {table.source} {value:.{decimals + 2}f}")
    return wrong


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_cited_results_folder_is_committed_and_named_by_date_and_commit(doc):
    cited = set(FOLDER.findall(doc.read_text())) - NOT_CITED
    assert cited, f"{doc.name} names no results folder"
    for folder in sorted(cited):
        name = CITABLE.fullmatch(folder)
        assert name, f"bench/results/{folder}: not <YYYY-MM-DD>-<commit>-<what> (without -dirty)"
        data = results_json(folder)
        if "machine" in data:  # a `kvedge bench` run records when it ran
            assert data["machine"]["date"].startswith(name[1]), (folder, data["machine"]["date"])


def test_every_table_figure_is_in_its_results_folder():
    checked = [t for t in tables(DOC.read_text()) if t.header[0] in KINDS]
    assert len(checked) >= 5, "the decode, prefill, memory, quality and threads tables"
    wrong = [f"line {t.line}: {w}" for t in checked for w in check_table(t)]
    assert not wrong, "figures that differ from their results folder:\n" + "\n".join(wrong)


def test_every_figure_of_the_readme_export_table_is_in_its_results_folder():
    readme = (ROOT / "README.md").read_text()
    table = next(t for t in tables(readme) if t.header[0] == EXPORTS)
    assert {"files MiB", "ms @64", "KL vs float32"} <= set(table.header)
    wrong = check_table(table)
    assert not wrong, "figures that differ from their results folder:\n" + "\n".join(wrong)
    assert export_system("`--variant ort --weights int4 --kv-dtype int8 --decode-matmuls onnxruntime`") == (
        "kvedge ort int4 kv int8 decode onnxruntime"
    )
    assert export_system("(default: portable, float32 weights and cache)") == "kvedge portable float32"


def test_a_wrong_figure_or_a_missing_source_is_caught():
    doc = DOC.read_text()
    decode = next(t for t in tables(doc) if t.header[1:3] == ["@64", "@512"] and t.header[0] == "system")
    assert not check_table(decode)
    decode.rows[0][1] = f"{float(decode.rows[0][1]) + 0.1:.1f}"
    assert check_table(decode) and "'@64'" in check_table(decode)[0]
    with pytest.raises(AssertionError, match="names no results folder"):
        check_table(Table(1, None, ["system", "@64"], [["kvedge portable float32", "17.2"]]))


# rows of the page's "Quality of each export choice" table taken from its quality table's systems
QUALITY_ROWS = {
    "--variant ort --weights int8": "kvedge ort int8",
    "--variant ort --weights int4": "kvedge ort int4 kv int8",
    "--kv-dtype int8": "kvedge ort float32 kv int8",
}


def test_the_planners_quality_figures_are_the_pages():
    """`kvedge.planner` recommends from measured KLs per export choice: its tables and the page's
    "Quality of each export choice" list the same choices and figures, and the figures taken from
    the quality table (which its results folder holds) are that table's."""
    from kvedge.planner import CACHE_KL, PRECISION_KL, WEIGHTS_KL

    doc = tables(DOC.read_text())
    choices = next(t for t in doc if t.header[:2] == ["export choice", "KL vs float32"])
    stated = {row[0].strip("`"): float(row[1]) for row in choices.rows}
    assert stated == {**WEIGHTS_KL, **PRECISION_KL, **CACHE_KL}
    quality = next(t for t in tables(DOC.read_text()) if t.header[:2] == ["system", "KL vs float32"])
    kl = {row[0]: row[1] for row in quality.rows}
    assert {choice: float(kl[system]) for choice, system in QUALITY_ROWS.items()} == {
        choice: stated[choice] for choice in QUALITY_ROWS
    }
