"""`kvedge doctor`: what this machine offers kvedge, and what it lacks.

Each check reads one source and never raises: a missing file, tool or package is reported as
absent, with what to do about it when that is known.

    jetson      /proc/device-tree/model
    l4t         /etc/nv_tegra_release ("# R36 (release), REVISION: 4.3, ..." -> R36.4.3), and the
                JetPack line it belongs to (`JETPACK_LINES`: its Ubuntu, Python, CUDA and TensorRT)
    jetpack     dpkg's nvidia-jetpack package version
    power mode  `nvpmodel -q`
    clocks      `jetson_clocks --show` (needs root)
    gpu         `nvidia-smi` (discrete GPUs), else the device tree's Tegra SoC (Jetson's integrated GPU)
    cuda        `nvcc --version`, else the libcudart the dynamic loader finds
    cuda driver the CUDA version the driver supports: cuDriverGetVersion from libcuda.so.1, else
                the JetPack line's CUDA (L4T ships the driver)
    cuda runtime the CUDA runtime kvedge drives (`kvedge.accel.import_cudart`: a libcudart through
                ctypes, and which, or cuda-python), its version and the driver's as it reads them
                (cudaRuntimeGetVersion, cudaDriverGetVersion), and cudaGetDeviceCount's answer
    onnxruntime version and execution providers
    kernels     kvedge's own onnxruntime kernel library (built by pip install, kvedge.runtime.kernels)
    tensorrt    `import tensorrt`
    cuda-python cuda-python / cuda-bindings installed (optional: the CUDA runtime's fallback), and
                whether the driver can run it: bindings of CUDA major N need a driver for CUDA N
                or newer (`cuda_python_mismatch`)
    memory      MemTotal and MemAvailable from /proc/meminfo (on Jetson the GPU allocates from it)
    service user the unit's user (`kvedge`) and whether it is in the groups of the GPU's device
                nodes that others may not open (L4T's nvhost, nvmap, nvgpu: video, 0660)
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import grp
import importlib.metadata
import json
import pwd
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvedge.cudart import version_text
from kvedge.machine import available_memory, meminfo_bytes

TOOL_TIMEOUT_S = 10
SERVICE_USER = "kvedge"  # the unit's User= when root renders it (kvedge.serve.service.systemd_unit)
# The GPU's device nodes: Tegra's (L4T R36), a DRM render node, a discrete GPU's
GPU_NODES = ("dev/nvmap", "dev/nvhost-*", "dev/nvgpu/*/*", "dev/dri/renderD*", "dev/nvidia*")


@dataclass(frozen=True)
class JetPackLine:
    """What a JetPack release line ships (NVIDIA's JetPack release notes). The driver comes with
    L4T, so its CUDA is the line's."""

    jetpack: str
    l4t: tuple[int, int]  # Jetson Linux release, revision's first number: R36.4.x -> (36, 4)
    ubuntu: str
    python: str  # JetPack's python3; its `tensorrt` module is built for this one only
    cuda: str
    tensorrt: str
    note: str = ""


# The lines kvedge supports. setup.cfg's extras `jp6` / `jp7` pin cuda-python to
# `cuda_python_pin(line.cuda)` (tests/test_doctor.py holds them equal).
JETPACK_LINES = (
    JetPackLine("6.2", (36, 4), "22.04", "3.10", "12.6", "10.3", "JetPack 6.1, 6.2 and 6.2.1 run L4T R36.4"),
    JetPackLine("7.2", (39, 2), "24.04", "3.12", "13.2", "10.16", "Orin and Thor"),
)
OTHER_L4T = {32: "4.x", 34: "5.0 DP", 35: "5.x", 36: "6.x", 38: "7.0/7.1 (Jetson Thor)"}  # major: JetPack


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


def parse_l4t(text: str) -> tuple[int, str] | None:
    """(major, revision) from /etc/nv_tegra_release's first line, e.g. (36, "4.3")."""
    found = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return (int(found.group(1)), found.group(2)) if found else None


def jetpack_line(major: int, revision: str) -> JetPackLine | None:
    minor = int(revision.split(".")[0])
    return next((line for line in JETPACK_LINES if line.l4t == (major, minor)), None)


def describe_l4t(major: int, revision: str, python: str) -> str:
    """Which JetPack line L4T R`major`.`revision` is, with what, and whether `python` (this
    interpreter's major.minor) is the line's own."""
    line = jetpack_line(major, revision)
    if line is None:
        supported = ", ".join(f"JetPack {x.jetpack} (L4T R{x.l4t[0]}.{x.l4t[1]})" for x in JETPACK_LINES)
        name = OTHER_L4T.get(major)
        return f"JetPack {name + ' line' if name else 'line unknown'}; kvedge supports {supported}"
    text = (
        f"JetPack {line.jetpack} line ({line.note}): Ubuntu {line.ubuntu}, Python {line.python}, "
        f"CUDA {line.cuda}, TensorRT {line.tensorrt}"
    )
    if python != line.python:
        text += f"; this is Python {python}: JetPack's tensorrt module is built for {line.python}"
    return text


def l4t_release(root: Path) -> Check:
    found = parse_l4t(_read(root / "etc/nv_tegra_release") or "")
    if not found:
        return Check("l4t", None, "no /etc/nv_tegra_release: not an L4T (Jetson Linux) system")
    major, revision = found
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Check("l4t", f"R{major}.{revision}", describe_l4t(major, revision, python))


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


def import_failure(exc: ImportError) -> str:
    """Why an installed onnxruntime does not import, and what to do where the cause is known."""
    import numpy

    text = f"installed, but `import onnxruntime` fails: {exc}"
    if "_ARRAY_API" in str(exc) or "numpy" in str(exc).lower():
        text += (
            f" (numpy {numpy.__version__}: Jetson AI Lab's jp6 onnxruntime-gpu wheels are built "
            "against numpy 1.x; `pip install 'numpy<2'`, which the jp6 extra pins)"
        )
    return text


def onnxruntime() -> Check:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        if getattr(exc, "name", None) == "onnxruntime":
            return Check(
                "onnxruntime", None, "not installed: `pip install onnxruntime` (CPU) or onnxruntime-gpu"
            )
        return Check("onnxruntime", None, import_failure(exc))
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
    detail = f"{path.name}: the INT8-cache attention and int8/int4 weight matmuls of --variant ort graphs"
    return Check("kernels", f"version {library.OPS_VERSION}", detail)


def tensorrt() -> Check:
    try:
        import tensorrt as trt
    except ImportError:
        return Check(
            "tensorrt", None, "not importable: JetPack ships it; `pip install tensorrt` on x86_64 CUDA"
        )
    return Check("tensorrt", trt.__version__, "import tensorrt")


def libcuda_version(library: str = "libcuda.so.1") -> str | None:
    """The CUDA version the driver supports, "major.minor", from cuDriverGetVersion (which needs
    no cuInit: 1000 * major + 10 * minor), or None when the driver library cannot be loaded."""
    try:
        driver = ctypes.CDLL(library)
    except OSError:
        return None
    version = ctypes.c_int(0)
    if driver.cuDriverGetVersion(ctypes.byref(version)) != 0:  # CUDA_SUCCESS
        return None
    return version_text(version.value)


def driver_cuda(libcuda: str | None, l4t: tuple[int, str] | None) -> tuple[str, str] | None:
    """(CUDA version the driver supports, where that came from): libcuda's own answer, else the
    JetPack line's CUDA (on a Jetson the driver is part of L4T), else None."""
    if libcuda is not None:
        return libcuda, "libcuda.so.1 cuDriverGetVersion"
    line = jetpack_line(*l4t) if l4t else None
    if line is not None:
        return line.cuda, f"L4T R{l4t[0]}.{l4t[1]} (JetPack {line.jetpack}); libcuda.so.1 did not load"
    return None


def cuda_python_pin(driver: str) -> str:
    """The cuda-python requirement for a driver supporting CUDA `driver`: its major, from its
    own minor on (cuda-bindings keeps CUDA minor version compatibility within a major)."""
    major, minor = (int(x) for x in driver.split(".")[:2])
    return f"cuda-python>={major}.{minor},<{major + 1}"


def cuda_python_mismatch(
    cuda_python: str | None, driver: str | None, dist: str = "cuda-python"
) -> str | None:
    """One line naming why `dist` `cuda_python` cannot run on a driver supporting CUDA `driver`,
    and the pin that can; None when it can, or when either is unknown. Bindings for CUDA major N
    need a driver for CUDA N or newer: a CUDA 12 driver answers their first call with
    cudaErrorInsufficientDriver. An older major on a newer driver runs (driver backward
    compatibility)."""
    if cuda_python is None or driver is None:
        return None
    needs, has = int(cuda_python.split(".")[0]), int(driver.split(".")[0])
    if needs <= has:
        return None
    return (
        f"{dist} {cuda_python} needs a CUDA {needs} driver; this device's driver supports CUDA "
        f"{driver}: pip install '{cuda_python_pin(driver)}'"
    )


def installed_cuda_python() -> tuple[str, str] | None:
    """(distribution, version): cuda-python (since 12.6.1 a metapackage of cuda-bindings, same
    major), else cuda-bindings alone."""
    for dist in ("cuda-python", "cuda-bindings"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_driver(root: Path) -> Check:
    found = driver_cuda(libcuda_version(), parse_l4t(_read(root / "etc/nv_tegra_release") or ""))
    if found is None:
        return Check("cuda driver", None, "libcuda.so.1 did not load and this is no known JetPack line")
    return Check("cuda driver", *found)


def cuda_python(root: Path) -> Check:
    installed, driver = installed_cuda_python(), cuda_driver(root).value
    if installed is None:
        how = (
            f"`pip install '{cuda_python_pin(driver)}'`"
            if driver
            else "its major must be the driver's CUDA major"
        )
        return Check(
            "cuda-python",
            None,
            f"not installed (optional: the CUDA runtime where no libcudart is found): {how}",
        )
    dist, version = installed
    problem = cuda_python_mismatch(version, driver, dist)
    if problem:
        return Check("cuda-python", version, "MISMATCH: " + problem)
    if driver is None:
        return Check("cuda-python", version, f"{dist}; no CUDA driver found to run it")
    return Check("cuda-python", version, f"{dist}, runs on this driver (CUDA {driver})")


def runtime_mismatch(runtime: int, driver: int, tegra: bool) -> str | None:
    """Why a CUDA runtime of version `runtime` cannot run on a driver of version `driver` (CUDA's
    1000 * major + 10 * minor), or None. A discrete GPU's driver runs any runtime of its major
    (minor version compatibility); Tegra has none, so there the runtime's minor counts too."""
    newer = runtime > driver if tegra else runtime // 1000 > driver // 1000
    if not driver or not newer:
        return None
    needs = version_text(runtime) if tegra else str(runtime // 1000)
    return (
        f"MISMATCH: a CUDA {needs} runtime needs a CUDA {needs} driver"
        + (" (Tegra has no minor version compatibility)" if tegra else "")
        + f": set KVEDGE_CUDART to a libcudart of CUDA {version_text(driver) if tegra else driver // 1000}"
    )


def cuda_runtime(root: Path = Path("/")) -> Check:
    """The CUDA runtime kvedge drives (`kvedge.accel.import_cudart`), its version and the driver's
    as that runtime reads them, and whether it reaches a GPU, else CUDA's one-line reason."""
    from kvedge.accel import cuda_call, describe_cudart, import_cudart
    from kvedge.errors import KvedgeError

    try:
        runtime = import_cudart()
        version = cuda_call(runtime, runtime.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
        driver = cuda_call(runtime, runtime.cudaDriverGetVersion(), "cudaDriverGetVersion")  # 0: none
    except KvedgeError as exc:
        return Check("cuda runtime", None, str(exc))
    value = f"{version_text(version)}, driver {version_text(driver) if driver else 'absent'}"
    try:
        found = f"{cuda_call(runtime, runtime.cudaGetDeviceCount(), 'cudaGetDeviceCount')} GPU(s)"
    except KvedgeError as exc:
        found = str(exc)
    if problem := runtime_mismatch(version, driver, (root / "etc/nv_tegra_release").exists()):
        found += f"; {problem}"
    return Check("cuda runtime", value, f"{describe_cudart(runtime)}; {found}")


def memory(root: Path) -> Check:
    """MemTotal, and what this process may still allocate (`kvedge.machine.available_memory`:
    MemAvailable, or less under a cgroup's limit or a ulimit, naming which)."""
    total = meminfo_bytes(_read(root / "proc/meminfo") or "", "MemTotal")
    room = available_memory(
        root / "proc/meminfo", root / "sys/fs/cgroup", root / "proc/self/cgroup", root / "proc/self/status"
    )
    if total is None or room is None:
        return Check("memory", None, "cannot read /proc/meminfo")
    return Check("memory", f"{room.bytes / 2**30:.2f} GiB available of {total / 2**30:.2f} GiB", room.what)


def gpu_node_groups(root: Path) -> dict[str, list[str]]:
    """{group: its GPU device nodes} for the nodes in `root` that a group may open and others may
    not (read and write)."""
    found: dict[str, list[str]] = {}
    for pattern in GPU_NODES:
        for node in sorted(root.glob(pattern)):
            try:
                st = node.stat()
                group = grp.getgrgid(st.st_gid).gr_name
            except (OSError, KeyError):
                continue
            if st.st_mode & 0o060 == 0o060 and st.st_mode & 0o006 != 0o006:
                found.setdefault(group, []).append(f"/{node.relative_to(root)}")
    return found


def groups_of(user: str) -> set[str] | None:
    """The groups `user` is in (primary and /etc/group's), or None when there is no such user."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    primary = {g.gr_name for g in grp.getgrall() if g.gr_gid == entry.pw_gid}
    return primary | {g.gr_name for g in grp.getgrall() if user in g.gr_mem}


def service_user(
    root: Path, user: str = SERVICE_USER, member_of: Callable[[str], set[str] | None] = groups_of
) -> Check:
    """Whether the service's user exists and is in the groups of the GPU's device nodes: without
    them its first CUDA call finds no GPU."""
    nodes: Mapping[str, list[str]] = gpu_node_groups(root)
    groups = member_of(user)
    if groups is None:
        return Check(
            "service user",
            None,
            f"no user {user}: `sudo useradd --system --home-dir /nonexistent --groups video {user}` "
            "(docs/JETSON.md, the service)",
        )
    missing = sorted(set(nodes) - groups)
    if missing:
        owns = "; ".join(f"{g}: {', '.join(nodes[g][:3])}" for g in missing)
        return Check(
            "service user",
            user,
            f"MISSING group {', '.join(missing)}, which owns the GPU's device nodes ({owns}): "
            f"`sudo usermod -aG {','.join(missing)} {user}`",
        )
    held = ", ".join(sorted(nodes)) or "none needed"
    return Check("service user", user, f"GPU device node groups: {held}")


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
        lambda: cuda_driver(root),
        lambda: cuda_runtime(root),
        onnxruntime,
        kernels,
        tensorrt,
        lambda: cuda_python(root),
        lambda: memory(root),
        lambda: service_user(root),
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
