"""device_tests/ on a runtime-only install (what a Jetson has: no torch, transformers or onnx):
the artifacts made here by `make device-artifacts` (device_tests/artifacts.py), then
`pytest device_tests` in a subprocess with the export extra blocked. Without a GPU every test
must be collected and skip for a device reason, none stop at an import; without the artifacts
the skip names the make target. Also: taking an artifact from the folder, and reading a graph's
nodes without onnx (device_tests/graph_nodes.py) as onnx reads them."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_rough_edges import BLOCK, EXPORT_EXTRA

ROOT = Path(__file__).resolve().parents[1]
DEVICE_TESTS = ROOT / "device_tests"
sys.path.insert(0, str(DEVICE_TESTS))
import artifacts  # noqa: E402  (device_tests/ is no package)
from graph_nodes import graph_nodes  # noqa: E402

# a machine without a GPU says so first; one with a GPU but without the software names what is missing
DEVICE_REASONS = (
    "no GPU: this machine has no NVIDIA device node",
    "no CUDAExecutionProvider in onnxruntime",
    "tensorrt is not importable",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """What `make device-artifacts` makes, made by the command that target runs."""
    recipe = re.search(r"^device-artifacts:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe and "device_tests/artifacts.py --out $(DEVICE_ARTIFACTS)" in recipe.group(1)
    out = tmp_path_factory.mktemp("device") / "device_artifacts"
    done = subprocess.run(
        [sys.executable, "device_tests/artifacts.py", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # it ends saying how the folder reaches the device and what runs there
    assert f"  rsync -a {out}/ orin:/opt/kvedge/device_artifacts/\n" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("  device_tests/run.sh device_artifacts"), done.stdout
    return out


def _device_tests(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`pytest device_tests` with the export extra blocked, and its report (conftest.py's)."""
    if "CUDAExecutionProvider" in ort.get_available_providers() or importlib.util.find_spec("tensorrt"):
        pytest.skip("a GPU stack is installed here: device_tests would run, not skip")
    run = "import pytest\nsys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', 'device_tests']))\n"
    report = tmp_path / "report.json"
    environ = {k: v for k, v in os.environ.items() if k != artifacts.ENV}
    done = subprocess.run(
        [sys.executable, "-c", BLOCK.format(blocked=EXPORT_EXTRA) + run],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**environ, "PYTHONPATH": str(ROOT), "KVEDGE_DEVICE_REPORT": str(report), **env},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in ("ModuleNotFoundError", "ImportError"):
        assert text not in done.stdout, done.stdout[-3000:]
    written = json.loads(report.read_text())
    assert written["artifacts"] == env.get(artifacts.ENV)
    return done, written["tests"]


def _test_names() -> set[str]:
    """file::function of every test function in device_tests/."""
    names = set()
    for path in DEVICE_TESTS.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names |= {f"{path.name}::{node.name}" for node in tree.body if isinstance(node, ast.FunctionDef)}
    return {name for name in names if name.split("::")[1].startswith("test_")}


def _collected(outcomes: dict[str, str]) -> set[str]:
    return {nodeid.removeprefix("device_tests/").split("[")[0] for nodeid in outcomes}


def test_device_tests_start_with_the_artifacts_and_no_export_extra(folder, tmp_path):
    _, outcomes = _device_tests({artifacts.ENV: str(folder)}, tmp_path)
    assert _collected(outcomes) == _test_names()
    for nodeid, outcome in outcomes.items():
        assert outcome.startswith("skipped: "), (nodeid, outcome)
        assert any(reason in outcome for reason in DEVICE_REASONS), (nodeid, outcome)
        assert artifacts.TARGET not in outcome, (nodeid, outcome)


def test_without_the_artifacts_the_skip_names_the_make_target(tmp_path):
    _, outcomes = _device_tests({}, tmp_path)
    assert _collected(outcomes) == _test_names()
    for nodeid, outcome in outcomes.items():
        assert outcome.startswith("skipped: ") and f"`{artifacts.TARGET}`" in outcome, (nodeid, outcome)
        assert artifacts.ENV in outcome, (nodeid, outcome)


def test_a_folder_without_an_index_is_named(tmp_path):
    _, outcomes = _device_tests({artifacts.ENV: str(tmp_path)}, tmp_path)
    for outcome in outcomes.values():
        assert f"{artifacts.ENV}={tmp_path} has no {artifacts.INDEX_FILE}" in outcome, outcome


def test_take_copies_an_export_that_runs_and_refuses_another_recipe(folder, tmp_path, monkeypatch):
    from kvedge.runtime.generate import prefill
    from kvedge.runtime.model import Model

    index = json.loads((folder / artifacts.INDEX_FILE).read_text())
    assert index["format"] == artifacts.FORMAT and index["exports"] == artifacts.EXPORTS
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*artifacts.EXPORTS, artifacts.POOL_READER, artifacts.INDEX_FILE]
    )
    monkeypatch.setenv(artifacts.ENV, str(folder))
    copy = artifacts.take("portable-128", tmp_path)
    assert copy.parent == tmp_path  # the test's own copy: engines are built into it
    with Model(copy) as model:
        assert prefill(model.backend, model.cache, 0, [[5, 6, 7]]).shape[-1] == model.manifest.vocab_size
    session = ort.InferenceSession(str(artifacts.take(artifacts.POOL_READER, tmp_path)))
    assert session.run(None, {"cache": np.ones(10, np.float32)})[0].tolist() == [10.0]

    changed = tmp_path / "changed"
    changed.mkdir()
    for name, recipe, fmt, wanted in (
        ("portable-128", {"max_len": 64}, artifacts.FORMAT, "this checkout's recipe is {'max_len': 128}"),
        ("portable-128", artifacts.EXPORTS["portable-128"], 99, "format 99, this checkout reads format 2"),
    ):
        moved = {**index, "format": fmt, "exports": {**index["exports"], name: recipe}}
        (changed / artifacts.INDEX_FILE).write_text(json.dumps(moved))
        monkeypatch.setenv(artifacts.ENV, str(changed))
        with pytest.raises(ValueError, match=re.escape(wanted)):
            artifacts.take(name, tmp_path / str(fmt))
    moved = {**index, "sources": {**index["sources"], "qwen3_5": {"family": "qwen3_5", "seed": 5}}}
    (changed / artifacts.INDEX_FILE).write_text(json.dumps(moved))
    with pytest.raises(ValueError, match=re.escape("made qwen3_5-256 from {'family': 'qwen3_5', 'seed': 5}")):
        artifacts.take("qwen3_5-256", tmp_path / "sources")


def test_make_replaces_only_an_artifacts_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=f"exists without an {artifacts.INDEX_FILE}: not replacing it"):
        artifacts.make(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_graph_nodes_reads_the_nodes_onnx_reads(folder, tmp_path):
    """On an export's graph and on the graph onnxruntime optimized from it (what test_ort_cuda.py
    reads for Memcpy nodes on the device)."""
    from kvedge.contract import ONNX_FILE, Manifest
    from kvedge.runtime.backends.ort import OrtBackend

    export = folder / "ort16-2048"
    optimized = tmp_path / "optimized.onnx"
    OrtBackend(export, Manifest.load(export), optimized_model_path=optimized).close()
    for path in (export / ONNX_FILE, optimized):
        graph = onnx.load(str(path), load_external_data=False).graph
        want = [(n.op_type, n.domain, tuple(n.input)) for n in graph.node]
        assert [(n.op_type, n.domain, n.inputs) for n in graph_nodes(path)] == want
        assert len(want) > 10


def test_memory_log_reads_host_memory_and_records_the_planners_terms(folder):
    """device_tests/memory.py's host side and its records, here (the device side needs a GPU:
    cudaMemGetInfo, named in one line without a driver)."""
    from memory import MemoryLog, host_bytes, planned_terms

    from kvedge.errors import KvedgeError
    from kvedge.planner import check_fits

    before = host_bytes()
    touched = np.ones(64 << 20, np.uint8)  # 64 MiB, every page written
    after = host_bytes()
    assert after["VmRSS"] - before["VmRSS"] >= 60 << 20 and after["VmHWM"] >= after["VmRSS"]
    del touched
    estimate = check_fits(folder / "portable-2048", 1, 1 << 40)
    terms = planned_terms(estimate)
    assert terms["total"] == estimate.total == sum(v for k, v in terms.items() if k != "total")
    assert terms["kv"] == estimate.kv > 0
    with pytest.raises(KvedgeError, match="cudaMemGetInfo|libcudart|cuda-python"):
        MemoryLog({}.__setitem__, "no-driver")


# --- device_tests/run.sh with what a Jetson install may lack ----------------------------------


def _closure(dist: str) -> set[str]:
    """`dist` and the distributions it requires here, recursively (markers evaluated)."""
    from packaging.requirements import Requirement

    found, todo = set(), [dist]
    while todo:
        name = todo.pop()
        if name.lower() in found:
            continue
        found.add(name.lower())
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def _bare_python(where: Path, dists: tuple[str, ...] = ()) -> Path:
    """A venv with the standard library only, plus the named distributions of this Python and
    what they require (their files linked in): a runtime install without pytest, or pytest
    alone, without onnxruntime."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    site = next(where.glob("lib/python*/site-packages"))
    for name in {d for dist in dists for d in _closure(dist)}:
        dist = importlib.metadata.distribution(name)
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return where / "bin/python"


def _run_sh(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", artifacts.ENV)}
    return subprocess.run(
        ["bash", "device_tests/run.sh", str(tmp_path / "no-artifacts")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**environ, "KVEDGE_DEVICE_REPORT": str(tmp_path / "report.json"), **env},
    )


def test_run_sh_takes_the_active_venv_and_names_the_fix_for_a_missing_pytest(tmp_path):
    """A runtime-only install has no pytest: run.sh, in the venv that is active, says so with the
    line that installs it (and the same for onnxruntime and kvedge), no traceback."""
    bare = _bare_python(tmp_path / "venv")
    done = _run_sh({"VIRTUAL_ENV": str(tmp_path / "venv")}, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"python: {bare}" in out  # the active interpreter, not python3 on PATH
    assert f"device_tests: pytest is not importable by {bare}" in out
    assert f"{bare} -m pip install pytest (kvedge's device-tests extra)" in out
    assert f"device_tests: onnxruntime is not importable by {bare}" in out
    assert f"{bare} -m pip install '.[serve,jp6]'" in out
    assert "Traceback" not in out and "No module named pytest\n" not in out


def test_run_sh_reaches_pytest_without_onnxruntime_and_every_test_skips_saying_why(tmp_path):
    """A runtime-only install missing onnxruntime (or a wheel that does not import): pytest is
    reached and every test file skips naming the fix, with no collection error."""
    bare = _bare_python(tmp_path / "venv", ("pytest",))
    done = _run_sh({"PYTHON": str(bare)}, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "onnxruntime is not importable" in out and "Traceback" not in out and " error" not in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["missing"].startswith(f"onnxruntime is not importable by {bare}")
    assert {nodeid.split("::")[0] for nodeid in report["tests"]} == {
        f"device_tests/{name.split('::')[0]}" for name in _test_names()
    }
    for nodeid, outcome in report["tests"].items():
        assert outcome.startswith("skipped: ") and "onnxruntime is not importable" in outcome, (
            nodeid,
            outcome,
        )
