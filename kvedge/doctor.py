"""`kvedge doctor`: what this machine offers kvedge, and what it lacks.

Each check reads one source and never raises: a missing file, tool or package is reported as
absent, with what to do about it when that is known.

    jetson      /proc/device-tree/model
    l4t         /etc/nv_tegra_release ("# R36 (release), REVISION: 4.3, ..." -> R36.4.3)
    jetpack     dpkg's nvidia-jetpack package version
    power mode  `nvpmodel -q`
    clocks      `jetson_clocks --show` (needs root)
    gpu         `nvidia-smi` (discrete GPUs), else the device tree's Tegra SoC (Jetson's integrated GPU)
    cuda        `nvcc --version`, else the libcudart the dynamic loader finds
    onnxruntime version and execution providers
    kernels     kvedge's own onnxruntime kernel library (built by pip install, kvedge.runtime.kernels)
    tensorrt    `import tensorrt`
    cuda-python `import cuda.bindings` (TensorRT buffers)
    memory      MemTotal and MemAvailable from /proc/meminfo (on Jetson the GPU allocates from it)
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import importlib.metadata
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

L4T_TO_JETPACK = {"32": "4.x", "34": "5.0 DP", "35": "5.x", "36": "6.x", "38": "7.x"}  # major lines
TOOL_TIMEOUT_S = 10


@dataclass(frozen=True)
class Check:
    name: str
    value: str | None  # None: absent
    detail: str = ""  # where it came from, or what to do when it is absent

    @property
    def present(self) -> bool:
        return self.value is not None


def _read(path: Path) -> str | None:
    try:
        # device-tree strings are NUL-terminated lists
        return path.read_bytes().decode(errors="replace").replace("\x00", "\n").strip()
    except OSError:
        return None


def _tool(*command: str) -> str | None:
    """stdout+stderr of `command`, or None when it is not installed or fails to run."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout + done.stderr).strip() if done.returncode == 0 else None


def jetson_model(root: Path) -> Check:
    model = _read(root / "proc/device-tree/model")
    if not model:
        return Check("jetson", None, "no /proc/device-tree/model: not a Jetson")
    return Check("jetson", model, "/proc/device-tree/model")


def l4t_release(root: Path) -> Check:
    text = _read(root / "etc/nv_tegra_release")
    found = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text or "")
    if not found:
        return Check("l4t", None, "no /etc/nv_tegra_release: not an L4T (Jetson Linux) system")
    major, revision = found.groups()
    jetpack = L4T_TO_JETPACK.get(major, "unknown")
    return Check("l4t", f"R{major}.{revision}", f"JetPack {jetpack} line (/etc/nv_tegra_release)")


def jetpack_package() -> Check:
    version = _tool("dpkg-query", "-W", "-f=${Version}", "nvidia-jetpack")
    if not version:
        return Check(
            "jetpack", None, "no nvidia-jetpack package (`sudo apt install nvidia-jetpack` on a Jetson)"
        )
    return Check("jetpack", version, "dpkg nvidia-jetpack")


def power_mode() -> Check:
    out = _tool("nvpmodel", "-q")
    found = re.search(r"NV Power Mode:\s*(.+)", out or "")
    if not found:
        return Check("power mode", None, "no nvpmodel (Jetson only)")
    return Check("power mode", found.group(1).strip(), "nvpmodel -q")


def clocks() -> Check:
    out = _tool("jetson_clocks", "--show")
    if out is None:
        absent = shutil.which("jetson_clocks") is None
        return Check(
            "clocks", None, "no jetson_clocks (Jetson only)" if absent else "jetson_clocks --show needs root"
        )
    gpu = re.search(r"^GPU .*$", out, re.MULTILINE)
    emc = re.search(r"^EMC .*$", out, re.MULTILINE)
    summary = "; ".join(m.group(0).strip() for m in (gpu, emc) if m) or out.splitlines()[0]
    return Check("clocks", summary, "jetson_clocks --show")


def gpu(root: Path) -> Check:
    out = _tool("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
    if out:
        return Check("gpu", "; ".join(out.splitlines()), "nvidia-smi")
    compatible = (_read(root / "proc/device-tree/compatible") or "").split()
    soc = next((c.split(",")[1] for c in compatible if c.startswith("nvidia,tegra")), None)
    if soc:
        return Check("gpu", f"integrated ({soc})", "/proc/device-tree/compatible; memory is shared")
    return Check("gpu", None, "no nvidia-smi and not a Jetson: no NVIDIA GPU visible")


def cuda() -> Check:
    out = _tool("nvcc", "--version")
    found = re.search(r"release ([\d.]+)", out or "")
    if found:
        return Check("cuda", found.group(1), "nvcc --version")
    runtime = ctypes.util.find_library("cudart")
    if runtime:
        return Check("cuda", runtime, "libcudart found; nvcc is not on PATH (/usr/local/cuda/bin on JetPack)")
    return Check("cuda", None, "no nvcc and no libcudart: no CUDA toolkit or runtime installed")


def onnxruntime() -> Check:
    try:
        import onnxruntime as ort
    except ImportError:
        return Check("onnxruntime", None, "not installed: `pip install onnxruntime` (CPU) or onnxruntime-gpu")
    providers = ort.get_available_providers()
    detail = "providers: " + ", ".join(providers)
    if "CUDAExecutionProvider" not in providers:
        detail += (
            " (no CUDA: on a Jetson install onnxruntime-gpu from the Jetson AI Lab index, docs/JETSON.md)"
        )
    return Check("onnxruntime", ort.__version__, detail)


def kernels() -> Check:
    from kvedge.errors import KvedgeError
    from kvedge.runtime import kernels as library

    try:
        path = library.library_path()
    except KvedgeError as exc:
        return Check("kernels", None, str(exc))
    detail = f"{path.name}, for --variant ort --kv-dtype int8 graphs"
    return Check("kernels", f"version {library.OPS_VERSION}", detail)


def tensorrt() -> Check:
    try:
        import tensorrt as trt
    except ImportError:
        return Check(
            "tensorrt", None, "not importable: JetPack ships it; `pip install tensorrt` on x86_64 CUDA"
        )
    return Check("tensorrt", trt.__version__, "import tensorrt")


def cuda_python() -> Check:
    for dist in ("cuda-python", "cuda-bindings"):
        try:
            return Check("cuda-python", importlib.metadata.version(dist), f"{dist} (TensorRT buffers)")
        except importlib.metadata.PackageNotFoundError:
            continue
    return Check(
        "cuda-python", None, "not installed: `pip install cuda-python` (needed by the TensorRT backend)"
    )


def memory(root: Path) -> Check:
    text = _read(root / "proc/meminfo") or ""
    fields = dict(re.findall(r"^(MemTotal|MemAvailable):\s+(\d+)\s+kB", text, re.MULTILINE))
    if len(fields) < 2:
        return Check("memory", None, "cannot read /proc/meminfo")
    total, available = (int(fields[k]) * 1024 / 2**30 for k in ("MemTotal", "MemAvailable"))
    return Check("memory", f"{available:.2f} GiB available of {total:.2f} GiB", "/proc/meminfo MemAvailable")


def run_checks(root: Path = Path("/")) -> list[Check]:
    """Every check, in report order. `root` relocates the files read (tests use a fake tree)."""
    checks: list[Callable[[], Check]] = [
        lambda: jetson_model(root),
        lambda: l4t_release(root),
        jetpack_package,
        power_mode,
        clocks,
        lambda: gpu(root),
        cuda,
        onnxruntime,
        kernels,
        tensorrt,
        cuda_python,
        lambda: memory(root),
    ]
    return [check() for check in checks]


def doctor_report(as_json: bool = False, root: Path = Path("/")) -> str:
    checks = run_checks(root)
    if as_json:
        return json.dumps([{**dataclasses.asdict(c), "present": c.present} for c in checks], indent=2)
    width = max(len(c.name) for c in checks)
    return "\n".join(
        f"{c.name:>{width}}  {c.value if c.present else 'absent'}" + (f"  ({c.detail})" if c.detail else "")
        for c in checks
    )
