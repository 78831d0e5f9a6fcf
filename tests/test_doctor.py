"""`kvedge doctor` on this machine (saying what is absent) and on a fake Jetson file tree; which
JetPack line an L4T release is; the cuda-python / driver decision, as pure functions and through
the whole report with a stand-in libcuda."""

from __future__ import annotations

import configparser
import ctypes.util
import grp
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from kvedge import cudart
from kvedge.contract import Manifest
from kvedge.doctor import (
    JETPACK_LINES,
    cuda_python_mismatch,
    cuda_python_pin,
    describe_l4t,
    doctor_report,
    driver_cuda,
    jetpack_line,
    parse_l4t,
    run_checks,
    runtime_mismatch,
    service_user,
)
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.ort import OrtBackend
from kvedge.runtime.model import Model

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
HAVE_LIBCUDA = ctypes.util.find_library("cuda") is not None
REPO = Path(__file__).resolve().parents[1]
# /etc/nv_tegra_release's first line as each JetPack writes it (GCID and date vary by build)
JP62 = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 2025"
JP72 = "# R39 (release), REVISION: 2.0, GCID: 43318301, BOARD: generic, EABI: aarch64, DATE: Mon Jun  1 2026"


def kvedge(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_doctor_reports_absence_on_a_bare_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvpmodel, jetson_clocks, nvcc, dpkg-query, nvidia-smi
    checks = {c.name: c for c in run_checks(root=tmp_path)}  # an empty file tree
    for name in ("jetson", "l4t", "jetpack", "power mode", "clocks", "gpu", "memory"):
        assert not checks[name].present and checks[name].detail, name
    assert checks["jetson"].detail == "no /proc/device-tree/model: not a Jetson"
    assert checks["onnxruntime"].present and "CPUExecutionProvider" in checks["onnxruntime"].detail
    # pip install built the kernel library on this machine (CI has a compiler)
    assert checks["kernels"].present and "_kvedge_ops" in checks["kernels"].detail, checks["kernels"]
    if not HAVE_TENSORRT:
        assert not checks["tensorrt"].present and "JetPack ships it" in checks["tensorrt"].detail
    if not HAVE_LIBCUDA:  # no driver and no L4T: nothing to pin cuda-python against
        assert not checks["cuda driver"].present
        assert "libcuda.so.1 did not load" in checks["cuda driver"].detail


def _fake_jetson(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "proc/device-tree/model").write_bytes(
        b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit\x00"
    )
    (root / "proc/device-tree/compatible").write_bytes(
        b"nvidia,p3768-0000+p3767-0005\x00nvidia,p3767-0005\x00nvidia,tegra234\x00"
    )
    (root / "etc/nv_tegra_release").write_text(
        "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Jan 2025\n"
    )
    (root / "proc/meminfo").write_text("MemTotal:        7802004 kB\nMemAvailable:    6291456 kB\n")
    tools = {
        "nvpmodel": "echo 'NV Power Mode: 15W'; echo 0",
        "jetson_clocks": "echo 'SOC family:tegra234  Machine:NVIDIA Jetson Orin Nano'\n"
        "echo 'GPU MinFreq=306000000 MaxFreq=624750000 CurrentFreq=306000000'\n"
        "echo 'EMC MinFreq=204000000 MaxFreq=2133000000 CurrentFreq=2133000000 FreqOverride=0'",
        "dpkg-query": "echo -n '6.2+b77'",
        "nvcc": "echo 'Cuda compilation tools, release 12.6, V12.6.68'",
    }
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return root


def test_doctor_reads_a_jetson(tmp_path, monkeypatch):
    root = _fake_jetson(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/bin{os.pathsep}/usr/bin")
    checks = {c.name: c.value for c in run_checks(root=root)}
    assert checks["jetson"] == "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit"
    assert checks["l4t"] == "R36.4.3"
    assert checks["jetpack"] == "6.2+b77"
    assert checks["power mode"] == "15W"
    assert (
        checks["clocks"].startswith("GPU MinFreq=306000000 MaxFreq=624750000") and "EMC" in checks["clocks"]
    )
    assert checks["gpu"] == "integrated (tegra234)"
    assert checks["cuda"] == "12.6"
    assert checks["memory"] == "6.00 GiB available of 7.44 GiB"
    assert "JetPack 6.2 line" in doctor_report(root=root)


def grp_names() -> set[str]:
    return {g.gr_name for g in grp.getgrall()}


def test_the_service_user_must_be_in_the_gpu_nodes_group(tmp_path):
    """`kvedge doctor`'s service user line: the unit's user must be in the group of every GPU
    device node others may not open, else its first CUDA call finds no GPU."""
    root = _fake_jetson(tmp_path)
    (root / "dev/nvgpu/igpu0").mkdir(parents=True)
    video = grp.getgrnam("video").gr_gid if os.geteuid() == 0 and "video" in grp_names() else os.getgid()
    for node in ("nvmap", "nvhost-ctrl-gpu", "nvgpu/igpu0/ctrl"):  # L4T R36's, root:video 0660
        (root / "dev" / node).touch()
        os.chown(root / "dev" / node, -1, video)
        (root / "dev" / node).chmod(0o660)
    (root / "dev/nvidiactl").touch()
    (root / "dev/nvidiactl").chmod(0o666)  # anyone may open it: no group needed
    group = grp.getgrgid(video).gr_name
    lacking = service_user(root, "kvedge", lambda user: {"kvedge"})
    assert lacking.value == "kvedge" and lacking.detail.startswith(f"MISSING group {group}, "), lacking
    assert f"({group}: /dev/nvmap, /dev/nvhost-ctrl-gpu, /dev/nvgpu/igpu0/ctrl)" in lacking.detail
    assert lacking.detail.endswith(f"`sudo usermod -aG {group} kvedge`")
    ok = service_user(root, "kvedge", lambda user: {"kvedge", group})
    assert ok.detail == f"GPU device node groups: {group}", ok
    absent = service_user(root, "kvedge", lambda user: None)
    assert not absent.present
    assert "useradd --system --home-dir /nonexistent --groups video kvedge" in absent.detail
    assert service_user(tmp_path, "kvedge", lambda user: {"kvedge"}).detail.endswith("none needed")


def test_a_newer_cuda_minor_is_a_mismatch_on_tegra_only():
    """A discrete GPU's driver runs a newer runtime of its major (minor version compatibility);
    Tegra's does not: CUDA 12.8's libcudart on JetPack 6.2's 12.6 driver is named there."""
    assert runtime_mismatch(12080, 12060, tegra=False) is None
    assert runtime_mismatch(12080, 12060, tegra=True) == (
        "MISMATCH: a CUDA 12.8 runtime needs a CUDA 12.8 driver (Tegra has no minor version "
        "compatibility): set KVEDGE_CUDART to a libcudart of CUDA 12.6"
    )
    assert runtime_mismatch(12060, 12060, tegra=True) is None and runtime_mismatch(12060, 0, True) is None
    assert runtime_mismatch(13000, 12060, tegra=False).startswith("MISMATCH: a CUDA 13 runtime needs")


def test_cli_doctor():
    done = kvedge("doctor")
    assert done.returncode == 0, done.stderr
    for name in ("jetson", "l4t", "power mode", "cuda", "onnxruntime", "tensorrt", "memory"):
        assert name in done.stdout
    as_json = kvedge("doctor", "--json")
    assert {c["name"] for c in json.loads(as_json.stdout)} >= {"jetson", "tensorrt", "memory"}


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="onnxruntime has CUDA here"
)
def test_gpu_provider_plumbing_refuses_what_is_absent(tiny_llama):
    manifest = Manifest.load(tiny_llama.out)
    absent = "cannot run this 'ort'" if manifest.in_place else "CUDAExecutionProvider is not available here"
    with pytest.raises(KvedgeError, match=absent):  # an export cuda cannot run: said before what is absent
        Model(tiny_llama.out, device="cuda")
    with pytest.raises(KvedgeError, match="'tensorrt' is not supported; allowed: \\['cpu', 'cuda'\\]"):
        OrtBackend(tiny_llama.out, manifest, provider="tensorrt")


@pytest.mark.parametrize(
    ("text", "jetpack"),
    [
        (
            JP62,
            "JetPack 6.2 line (JetPack 6.1, 6.2 and 6.2.1 run L4T R36.4): Ubuntu 22.04, Python 3.10, "
            "CUDA 12.6, TensorRT 10.3",
        ),
        (JP72, "JetPack 7.2 line (Orin and Thor): Ubuntu 24.04, Python 3.12, CUDA 13.2, TensorRT 10.16"),
        (
            "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64",
            "JetPack 6.x line;",
        ),
        (
            "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64",
            "JetPack 5.x line;",
        ),
        ("# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64", "JetPack 7.0/7.1"),
        ("# R40 (release), REVISION: 1.0", "JetPack line unknown;"),
    ],
)
def test_the_jetpack_line_of_an_l4t_release(text, jetpack):
    major, revision = parse_l4t(text)
    described = describe_l4t(major, revision, "3.10" if major == 36 else "3.12")
    assert described.startswith(jetpack), described
    if jetpack_line(major, revision) is None:  # the lines kvedge supports are named instead
        assert described.endswith("kvedge supports JetPack 6.2 (L4T R36.4), JetPack 7.2 (L4T R39.2)")
    assert parse_l4t("Ubuntu 22.04.5 LTS") is None


def test_a_python_other_than_the_lines_own_is_named():
    assert describe_l4t(36, "4.3", "3.12").endswith(
        "; this is Python 3.12: JetPack's tensorrt module is built for 3.10"
    )
    assert "this is Python" not in describe_l4t(39, "2.0", "3.12")


JP6_PIN = "pip install 'cuda-python>=12.6,<13'"


@pytest.mark.parametrize(
    ("cuda_python", "libcuda", "l4t", "problem"),
    [
        # JetPack 6.2 with `pip install cuda-python` unpinned: 13.x on a CUDA 12.6 driver
        (
            "13.0.1",
            None,
            JP62,
            f"cuda-python 13.0.1 needs a CUDA 13 driver; this device's driver supports CUDA 12.6: {JP6_PIN}",
        ),
        (
            "13.0.1",
            "12.6",
            JP62,
            f"cuda-python 13.0.1 needs a CUDA 13 driver; this device's driver supports CUDA 12.6: {JP6_PIN}",
        ),
        ("12.9.10", None, JP62, None),  # the jp6 extra's resolution: CUDA minor version compatibility
        ("13.4.4", None, JP72, None),  # the jp7 extra's resolution on JetPack 7.2
        ("12.9.10", None, JP72, None),  # an older major on a newer driver runs
        ("13.4.4", "13.0", None, None),  # an x86_64 CUDA 13 driver, no L4T
        (
            "13.4.4",
            "12.8",
            None,
            "cuda-python 13.4.4 needs a CUDA 13 driver; this device's driver supports "
            "CUDA 12.8: pip install 'cuda-python>=12.8,<13'",
        ),
        ("13.4.4", "13.2", JP62, None),  # the driver's own answer outranks the L4T table
        ("13.4.4", None, None, None),  # no driver found: nothing to decide
        (None, "12.6", JP62, None),  # nothing installed: nothing to decide
    ],
)
def test_the_cuda_python_driver_decision(cuda_python, libcuda, l4t, problem):
    driver = driver_cuda(libcuda, parse_l4t(l4t) if l4t else None)
    assert cuda_python_mismatch(cuda_python, driver[0] if driver else None) == problem
    if libcuda is None and l4t is not None:
        assert driver[1].startswith("L4T R")  # says where the version came from


def test_the_jetpack_extras_install_no_cuda_python():
    """On a Jetson kvedge drives JetPack's own libcudart through ctypes (`kvedge.cudart`): the jp6
    and jp7 extras bring no PyPI cuda-python, whose aarch64 runtime is built for SBSA servers."""
    extras = configparser.ConfigParser()
    extras.read(REPO / "setup.cfg")
    by_line = {"6.2": "jp6", "7.2": "jp7"}
    assert {line.jetpack for line in JETPACK_LINES} == set(by_line)
    for extra in by_line.values():
        pins = [p for p in extras["options.extras_require"][extra].split("\n") if p.strip()]
        assert not [p for p in pins if p.startswith(("cuda-python", "cuda-bindings"))], extra


def test_the_x86_gpu_extras_pin_cuda_12():
    """PyPI's onnxruntime-gpu is a CUDA 12 build: the gpu and trt extras pin cuda-python (and
    TensorRT's wheel) to CUDA 12, doctor's pin for a 12.0 driver; unpinned, pip took 13.x."""
    extras = configparser.ConfigParser()
    extras.read(REPO / "setup.cfg")
    for extra in ("gpu", "trt"):
        pins = [p for p in extras["options.extras_require"][extra].split("\n") if p.strip()]
        assert [p for p in pins if p.startswith("cuda-python")] == [cuda_python_pin("12.0")], extra
    assert "tensorrt-cu12>=10.0" in extras["options.extras_require"]["trt"]


FAKE_LIBCUDA = """
/* cuDriverGetVersion as the CUDA Driver API documents it: CUDA_ERROR_INVALID_VALUE (1) for a
   NULL pointer, else the version as 1000 * major + 10 * minor and CUDA_SUCCESS (0). */
int cuDriverGetVersion(int *version) {
    if (!version) return 1;
    *version = VERSION;
    return 0;
}
"""


def _stand_ins(tmp_path: Path, driver: int | None, cuda_python: str) -> dict:
    """An environment whose dynamic loader finds a libcuda.so.1 answering `driver` (none: an
    empty folder) and whose Python sees cuda-python `cuda_python` installed (its metadata only):
    the driver and the package this machine has not."""
    lib, site = tmp_path / "lib", tmp_path / "site"
    lib.mkdir(parents=True)
    info = site / f"cuda_python-{cuda_python}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cuda-python\nVersion: {cuda_python}\n")
    if driver is not None:
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            pytest.skip("no C compiler to build the stand-in libcuda.so.1")
        source = tmp_path / "libcuda.c"
        source.write_text(FAKE_LIBCUDA.replace("VERSION", str(driver)))
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), str(source)], check=True
        )
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "LD_LIBRARY_PATH": str(lib), "PYTHONPATH": pythonpath}


def _report_line(env: dict, root: Path, name: str) -> str:
    script = (
        "import sys; from pathlib import Path; from kvedge.doctor import doctor_report; "
        "print(doctor_report(root=Path(sys.argv[1])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return next(line.strip() for line in done.stdout.splitlines() if line.strip().startswith(f"{name}  "))


@pytest.mark.skipif(HAVE_LIBCUDA, reason="a real libcuda here; the stand-in is for machines without one")
def test_doctor_names_the_mismatch_in_one_line(tmp_path):
    jetson = _fake_jetson(tmp_path)  # L4T R36.4.3: JetPack 6.2
    env = _stand_ins(tmp_path, driver=12060, cuda_python="13.0.1")
    want = (
        "cuda-python  13.0.1  (MISMATCH: cuda-python 13.0.1 needs a CUDA 13 driver; this device's driver "
        f"supports CUDA 12.6: {JP6_PIN})"
    )
    assert _report_line(env, jetson, "cuda-python") == want
    assert _report_line(env, jetson, "cuda driver") == "cuda driver  12.6  (libcuda.so.1 cuDriverGetVersion)"
    # the same device whose libcuda does not load (a container without the driver mounted): L4T says
    bare = _stand_ins(tmp_path / "no-driver", driver=None, cuda_python="13.0.1")
    assert _report_line(bare, jetson, "cuda-python") == want
    # JetPack 7.2's driver runs it
    (jetson / "etc/nv_tegra_release").write_text(JP72 + "\n")
    fine = _stand_ins(tmp_path / "jp7", driver=13020, cuda_python="13.0.1")
    assert (
        _report_line(fine, jetson, "cuda-python")
        == "cuda-python  13.0.1  (cuda-python, runs on this driver (CUDA 13.2))"
    )


def _real_libcudart() -> str | None:
    given = os.environ.get("KVEDGE_CUDART")
    found = [given] if given else [path for path, _ in cudart._candidates() if os.path.isabs(path)]
    return found[0] if found else None


@pytest.mark.skipif(HAVE_LIBCUDA, reason="a real libcuda here; the stand-in is for machines without one")
@pytest.mark.skipif(_real_libcudart() is None, reason="no libcudart: pip install nvidia-cuda-runtime-cu12")
@pytest.mark.parametrize("driver", [12060, 11080])
def test_doctor_names_the_cuda_runtime_it_drives_and_the_drivers_version(tmp_path, driver):
    """A real libcudart through ctypes over the stand-in libcuda.so.1: the runtime's version, the
    driver's as the runtime reads it, the library and where it was found, CUDA's answer to
    cudaGetDeviceCount (the stand-in is no driver), and a runtime newer than the driver named."""
    library = _real_libcudart()
    env = {**_stand_ins(tmp_path, driver=driver, cuda_python="12.9.10"), "KVEDGE_CUDART": library}
    env.pop("KVEDGE_CUDA_RUNTIME", None)
    line = _report_line(env, tmp_path, "cuda runtime")
    version = int(line.split()[2].rstrip(",").split(".")[0])
    has = driver // 1000
    assert line.startswith(f"cuda runtime  {version}.") and f", driver {has}.{driver % 1000 // 10}  " in line
    assert f"(ctypes over {library} ($KVEDGE_CUDART); cudaGetDeviceCount failed: " in line
    mismatch = f"MISMATCH: a CUDA {version} runtime needs a CUDA {version} driver: set KVEDGE_CUDART"
    assert (mismatch in line) == (version > has)


def test_an_onnxruntime_that_does_not_import_is_said_and_tensorrt_paths_do_without_it(tmp_path):
    """JetPack 6's onnxruntime-gpu wheels under numpy 2 fail to import ("_ARRAY_API not found").
    doctor said "not installed", and the runtime imported onnxruntime eagerly, so even
    `--device tensorrt` died on it. A stand-in package that fails as those wheels do shows both."""
    package = tmp_path / "onnxruntime"
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise ImportError("numpy.core.multiarray failed to import: _ARRAY_API not found")\n'
    )
    script = (
        "import sys\n"
        "import kvedge.runtime.model, kvedge.runtime.registry, kvedge.serve.app\n"
        "assert 'onnxruntime' not in sys.modules, 'imported eagerly'\n"
        "from kvedge.doctor import onnxruntime\n"
        "check = onnxruntime()\n"
        "print(check.value, '|', check.detail)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    value, detail = done.stdout.strip().split(" | ", 1)
    assert value == "None" and "installed, but `import onnxruntime` fails" in detail
    assert "_ARRAY_API not found" in detail and "pip install 'numpy<2'" in detail
    assert "not installed" not in detail


def test_the_jp6_extra_pins_numpy_1():
    extras = configparser.ConfigParser()
    extras.read(REPO / "setup.cfg")
    assert "numpy>=1.26,<2" in extras["options.extras_require"]["jp6"].split("\n")
