"""device_tests/: run only on a machine with an NVIDIA GPU (Jetson or any CUDA machine), which
needs only the runtime installed: the tiny models come exported (device_tests/artifacts.py).

    make device-artifacts                  # on an x86 machine with the export extra; copy the folder
    KVEDGE_DEVICE_ARTIFACTS=<folder> python -m pytest device_tests -q -rs

Each test says what it needs with a marker; where that is missing it is skipped with the reason:

    ort_cuda   onnxruntime with CUDAExecutionProvider (onnxruntime-gpu) and a CUDA runtime (the
               pool is mapped with it, `kvedge.runtime.backends.cuda.MappedHost`): a libcudart kvedge
               drives through ctypes, or cuda-python (`kvedge.accel.import_cudart`;
               KVEDGE_CUDA_RUNTIME=ctypes or cuda-python runs the tests on that one)
    tensorrt   TensorRT and a CUDA runtime, and a GPU they can see

and every test needs the artifacts: $KVEDGE_DEVICE_ARTIFACTS, or torch here to export them.
Where onnxruntime or kvedge's runtime does not import (device_tests/preflight.py), each test file
is one test that skips with the line that installs it, rather than a collection error.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from artifacts import ENV as ARTIFACTS_ENV
from artifacts import missing as artifacts_missing
from preflight import missing as base_missing

BASE_MISSING = "; ".join(base_missing())
if not BASE_MISSING:
    import onnxruntime as ort

    # CUDA and cuDNN from NVIDIA's pip packages (the `nvidia` namespace) on x86-64; a Jetson's
    # come with JetPack, where preloading only logs what it did not find
    pip_cuda = importlib.util.find_spec("nvidia") is not None and not Path("/etc/nv_tegra_release").exists()
    if pip_cuda and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()


class Unrunnable(pytest.File):
    """A test file whose imports cannot succeed here: one test, skipped naming what to install."""

    def collect(self):
        item = Skipped.from_parent(self, name="imports")
        item.add_marker(pytest.mark.skip(reason=BASE_MISSING))
        yield item


class Skipped(pytest.Item):
    def runtest(self):  # never run: marked skip
        pytest.skip(BASE_MISSING)

    def reportinfo(self):
        return self.path, 0, self.name  # a skip's report needs a line


def pytest_pycollect_makemodule(module_path, parent):
    if BASE_MISSING and module_path.name.startswith("test_"):
        return Unrunnable.from_parent(parent, path=module_path)
    return None


def _cuda_runtime_missing() -> str | None:
    from kvedge.accel import import_cudart
    from kvedge.errors import KvedgeError

    try:
        import_cudart()
    except KvedgeError as exc:
        return f"no CUDA runtime ({exc})"
    return None


# an NVIDIA GPU's device nodes: a discrete GPU's (nvidia0, nvidiactl), a Jetson's (nvmap, nvhost-*,
# nvgpu); a machine without any has no GPU for any test here, whatever is installed
GPU_NODES = ("nvidia*", "nvhost*", "nvmap", "nvgpu")


def _no_gpu() -> str | None:
    if any(next(Path("/dev").glob(pattern), None) for pattern in GPU_NODES):
        return None
    return f"no GPU: this machine has no NVIDIA device node (/dev/{{{','.join(GPU_NODES)}}})"


def _ort_cuda_missing() -> str | None:
    if why := _no_gpu():
        return why
    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return f"no CUDAExecutionProvider in onnxruntime ({providers})"
    return _cuda_runtime_missing()


def _tensorrt_missing() -> str | None:
    if why := _no_gpu():
        return why
    if importlib.util.find_spec("tensorrt") is None:
        return "tensorrt is not importable (JetPack ships it; `pip install tensorrt` on x86_64 CUDA)"
    if _cuda_runtime_missing():
        return _cuda_runtime_missing()
    from kvedge.accel import current_device
    from kvedge.errors import KvedgeError

    try:
        current_device()
    except KvedgeError as exc:
        return f"no GPU visible to CUDA ({exc})"
    return None


MISSING = {"ort_cuda": _ort_cuda_missing, "tensorrt": _tensorrt_missing}


def pytest_configure(config):
    config.addinivalue_line("markers", "ort_cuda: needs onnxruntime's CUDAExecutionProvider")
    config.addinivalue_line("markers", "tensorrt: needs TensorRT, a CUDA runtime and a GPU")


def pytest_collection_modifyitems(config, items):
    if BASE_MISSING:  # every item is `Skipped`, saying what to install
        return
    reasons: dict[str, str | None] = {}
    no_artifacts = artifacts_missing()
    for item in items:
        needs = [name for name in MISSING if name in item.keywords]
        if not needs:
            item.add_marker(pytest.mark.skip(reason="device test without a ort_cuda/tensorrt marker"))
        for name in needs:
            if name not in reasons:
                reasons[name] = MISSING[name]()
        why = [reasons[name] for name in needs if reasons[name]] + ([no_artifacts] if no_artifacts else [])
        if needs and why:
            item.add_marker(pytest.mark.skip(reason="; ".join(why)))


# Figures the tests measure (`record`), written with every test's outcome to $KVEDGE_DEVICE_REPORT
# (device_tests/run.sh sets it) when the session ends.
FIGURES: dict[str, object] = {}
OUTCOMES: dict[str, str] = {}


@pytest.fixture
def record():
    return FIGURES.__setitem__


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome == "skipped":
        OUTCOMES[report.nodeid] = report.outcome + (f": {report.longrepr[2]}" if report.skipped else "")


def pytest_sessionfinish(session, exitstatus):
    import json
    import os
    import platform

    path = os.environ.get("KVEDGE_DEVICE_REPORT")
    if path:
        report = {
            "machine": platform.machine(),
            "onnxruntime": None if BASE_MISSING else ort.__version__,
            "providers": [] if BASE_MISSING else ort.get_available_providers(),
            "missing": BASE_MISSING or None,
            "artifacts": os.environ.get(ARTIFACTS_ENV),  # None: the tests export their own
            "exit_status": int(exitstatus),
            "tests": OUTCOMES,
            "figures": FIGURES,
        }
        Path(path).write_text(json.dumps(report, indent=2, default=str))
