"""kvedge's ctypes CUDA runtime (`kvedge.cudart`) against real libcudart libraries, without a GPU.

The libraries are whatever this machine has: NVIDIA's nvidia-cuda-runtime-cu12 wheel (the dev
extra installs it, so CI has one), $KVEDGE_CUDART, a CUDA toolkit's. With no driver every entry
point must answer an error code (35, cudaErrorInsufficientDriver, or 100, cudaErrorNoDevice)
through cuda-python's `(error, value...)` convention, never crash or raise a ctypes error; the
versions need no driver. The argument types are read against the cuda_runtime_api.h found beside
the libraries (the wheel ships its headers): a wrong size_t / unsigned int / pointer would pass
silently on a GPU until it corrupted a call. What a device then does with the calls is
device_tests/'s to show.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kvedge import cudart
from kvedge.accel import current_device, describe_cudart, import_cudart
from kvedge.doctor import cuda_runtime
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.cuda import DeviceMemory, MappedHost
from kvedge.runtime.backends.memory import page_aligned

NO_DRIVER = {cudart.cudaError_t.cudaErrorInsufficientDriver, cudart.cudaError_t.cudaErrorNoDevice}


def _wheel_folders() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return [root / "cuda_runtime" for root in roots] + [root / "cu13" for root in roots]


def real_libraries() -> list[str]:
    """Every distinct libcudart this machine offers, $KVEDGE_CUDART first."""
    given = [os.environ["KVEDGE_CUDART"]] if os.environ.get("KVEDGE_CUDART") else []
    found: dict[str, str] = {}
    for path in given + [path for path, _ in cudart._candidates()]:
        if os.path.isabs(path):
            found.setdefault(os.path.realpath(path), path)
    return list(found.values())


LIBRARIES = real_libraries()


@pytest.fixture(params=LIBRARIES or [None], ids=lambda p: p and Path(p).name)
def library(request, monkeypatch) -> str:
    """A real libcudart, the one kvedge drives (KVEDGE_CUDART, KVEDGE_CUDA_RUNTIME=ctypes)."""
    if request.param is None:
        pytest.skip("no libcudart: `pip install nvidia-cuda-runtime-cu12` or set KVEDGE_CUDART")
    monkeypatch.setenv("KVEDGE_CUDART", request.param)
    monkeypatch.setenv("KVEDGE_CUDA_RUNTIME", "ctypes")
    return request.param


@pytest.fixture
def no_driver(library) -> cudart.CudaRuntime:
    runtime = import_cudart()
    if runtime.cudaDriverGetVersion() != (cudart.cudaError_t.cudaSuccess, 0):
        pytest.skip("a CUDA driver is installed here: device_tests/ cover it")
    return runtime


def test_versions_need_no_driver(no_driver, library):
    """cudaRuntimeGetVersion is the library's own (12090 for the 12.9 wheel), cudaDriverGetVersion
    answers 0 with no driver, both with cudaSuccess."""
    error, version = no_driver.cudaRuntimeGetVersion()
    assert error == cudart.cudaError_t.cudaSuccess
    major = re.search(r"libcudart\.so\.(\d+)", os.path.realpath(library))
    if major:
        assert version // 1000 == int(major.group(1))
    if "cuda_runtime" in library:
        release = importlib.metadata.version("nvidia-cuda-runtime-cu12").split(".")
        assert cudart.version_text(version) == ".".join(release[:2])
    assert no_driver.cudaDriverGetVersion() == (cudart.cudaError_t.cudaSuccess, 0)


def test_every_entry_point_answers_an_error_without_a_driver(no_driver):
    pinned = np.zeros(4096, np.uint8)
    host = pinned.ctypes.data
    kind = cudart.cudaMemcpyKind
    calls = {
        "cudaGetDeviceCount": (),
        "cudaSetDevice": (0,),
        "cudaDeviceGetAttribute": (cudart.cudaDeviceAttr.cudaDevAttrHostRegisterSupported, 0),
        "cudaGetDeviceProperties": (0,),
        "cudaDeviceSynchronize": (),
        "cudaMemGetInfo": (),
        "cudaMalloc": (1 << 20,),
        "cudaMallocManaged": (1 << 20, cudart.cudaMemAttachGlobal),
        "cudaFree": (0,),
        "cudaMemset": (0x1000, 0, 16),
        "cudaMemcpy": (host, host + 2048, 1024, kind.cudaMemcpyHostToHost),
        "cudaMemcpy2D": (host, 64, host + 2048, 64, 32, 8, kind.cudaMemcpyDefault),
        "cudaHostAlloc": (4096, cudart.cudaHostAllocMapped),
        "cudaFreeHost": (host,),
        "cudaHostRegister": (host, 4096, cudart.cudaHostRegisterMapped),
        "cudaHostUnregister": (host,),
        "cudaHostGetDevicePointer": (host, 0),
        "cudaStreamCreate": (),
        "cudaStreamSynchronize": (0,),
        "cudaStreamDestroy": (0,),
    }
    versions = {"cudaRuntimeGetVersion", "cudaDriverGetVersion"}
    assert set(calls) - {"cudaGetDeviceProperties"} | versions == set(cudart.PROTOTYPES)
    for name, args in calls.items():
        result = getattr(no_driver, name)(*args)
        assert isinstance(result, tuple) and result[0] in NO_DRIVER, (name, result)
        assert all(isinstance(value, int) or value is None for value in result[1:]), (name, result)
        error, message = no_driver.cudaGetErrorString(result[0])
        assert error == cudart.cudaError_t.cudaSuccess and message and isinstance(message, bytes)
    assert (
        no_driver.cudaGetErrorString(35)[1] == b"CUDA driver version is insufficient for CUDA runtime version"
    )
    with pytest.raises(TypeError, match="expected cudaMemcpyKind"):  # as cuda-python refuses an int
        no_driver.cudaMemcpy(host, host + 2048, 1024, 0)


def test_gpu_paths_fail_naming_the_call_without_a_driver(no_driver, library):
    """What the GPU backends do first, on the ctypes runtime with no driver: a KvedgeError naming
    the CUDA call and CUDA's message, no ctypes traceback."""
    driver = r"failed: (CUDA driver version is insufficient|no CUDA-capable device)"
    with pytest.raises(KvedgeError, match=r"^cudaDeviceGetAttribute\(HostRegisterSupported\) " + driver):
        MappedHost().register(page_aligned((4, 256), np.uint8))
    with pytest.raises(KvedgeError, match=r"^cudaMalloc\(1024 bytes\) " + driver):
        DeviceMemory().allocate((4, 256), np.uint8)
    with pytest.raises(KvedgeError, match=r"^cudaGetDeviceProperties " + driver):
        current_device()
    assert describe_cudart(import_cudart()) == f"ctypes over {library} ($KVEDGE_CUDART)"


def test_doctor_says_which_runtime_it_drove_and_why_no_gpu(no_driver, library):
    check = cuda_runtime()
    assert check.value == f"{cudart.version_text(no_driver.cudaRuntimeGetVersion()[1])}, driver absent"
    assert check.detail.startswith(f"ctypes over {library} ($KVEDGE_CUDART); cudaGetDeviceCount failed: ")


def test_a_wrong_kvedge_cudart_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KVEDGE_CUDA_RUNTIME", raising=False)
    missing = tmp_path / "libcudart.so.12"
    monkeypatch.setenv("KVEDGE_CUDART", str(missing))
    with pytest.raises(KvedgeError) as refused:
        import_cudart()
    assert str(refused.value) == f"KVEDGE_CUDART={missing}: no such file (the path of a libcudart.so)"
    not_a_library = tmp_path / "libcudart.so.13"
    not_a_library.write_text("not ELF")
    monkeypatch.setenv("KVEDGE_CUDART", str(not_a_library))
    with pytest.raises(
        KvedgeError, match=rf"^cannot load the CUDA runtime {not_a_library} \(\$KVEDGE_CUDART\): "
    ):
        import_cudart()
    assert "\n" not in str(refused.value)


def test_a_jetson_never_drives_the_pip_wheels_sbsa_cudart(tmp_path, monkeypatch):
    """PyPI's aarch64 libcudart is built for SBSA servers: on a Tegra (/etc/nv_tegra_release) it
    is passed over, and where it is all there is, the refusal says so and what to install."""
    wheel = tmp_path / "site/nvidia/cuda_runtime/lib"
    wheel.mkdir(parents=True)
    (wheel / "libcudart.so.12").touch()
    (tmp_path / "site/nvidia/__init__.py").touch()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.delenv("KVEDGE_CUDART", raising=False)
    monkeypatch.setattr(cudart, "TOOLKIT_DIRS", ())
    monkeypatch.setattr(cudart, "VERSIONED_DIRS", str(tmp_path / "none-*"))
    monkeypatch.setattr(cudart.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(cudart, "WHEEL_DIRS", (("nvidia", "cuda_runtime", "lib"),))
    monkeypatch.setattr(cudart, "TEGRA_RELEASE", tmp_path / "nv_tegra_release")
    assert cudart.locate() == (str(wheel / "libcudart.so.12"), "NVIDIA's pip wheel")  # x86-64, SBSA
    (tmp_path / "nv_tegra_release").write_text("# R36 (release), REVISION: 4.3\n")
    with pytest.raises(KvedgeError) as refused:
        cudart.locate()
    assert str(refused.value).startswith(
        f"no libcudart of JetPack's found, and NVIDIA's pip wheel ({wheel / 'libcudart.so.12'}) is an SBSA"
    )
    assert "`sudo apt install nvidia-jetpack`" in str(refused.value)


def test_the_runtime_choice_is_checked(monkeypatch):
    monkeypatch.setenv("KVEDGE_CUDA_RUNTIME", "cudart")
    with pytest.raises(
        KvedgeError, match=r"KVEDGE_CUDA_RUNTIME='cudart' is not one of auto, ctypes, cuda-python"
    ):
        import_cudart()
    if importlib.util.find_spec("cuda") is None:
        monkeypatch.setenv("KVEDGE_CUDA_RUNTIME", "cuda-python")
        with pytest.raises(KvedgeError, match="cuda-python is not installed"):
            import_cudart()


# -- the prototypes, read from the header ---------------------------------------------------


def headers() -> list[Path]:
    found = [folder / "include" / "cuda_runtime_api.h" for folder in _wheel_folders()]
    found.append(Path("/usr/local/cuda/include/cuda_runtime_api.h"))
    return [path for path in found if path.is_file()]


C_TYPES = {
    "void *": ctypes.c_void_p,
    "void **": ctypes.POINTER(ctypes.c_void_p),
    "cudaStream_t": ctypes.c_void_p,
    "cudaStream_t *": ctypes.POINTER(ctypes.c_void_p),
    "size_t": ctypes.c_size_t,
    "size_t *": ctypes.POINTER(ctypes.c_size_t),
    "int": ctypes.c_int,
    "int *": ctypes.POINTER(ctypes.c_int),
    "unsigned int": ctypes.c_uint,
    "enum": ctypes.c_int,  # C enums are int-sized
}


def header_argtypes(header: str, name: str) -> list:
    """The ctypes of `name`'s parameters in the header's C prototype (its first declaration)."""
    found = re.search(rf"cudaError_t CUDARTAPI {name}\(([^)]*)\);", header)
    assert found, f"{name} is not declared as returning cudaError_t"
    parameters = [p.split("=")[0].strip() for p in found.group(1).split(",")]
    argtypes = []
    for parameter in parameters:
        if parameter == "void":
            continue
        spelled = re.sub(r"^enum \w+", "enum", re.sub(r"\bconst\s+", "", parameter))
        base, stars, _name = re.fullmatch(r"(.+?)\s*(\**)\s*(\w+)", spelled).groups()
        argtypes.append(C_TYPES[f"{base} {stars}".strip()])
    return argtypes


@pytest.mark.parametrize("path", headers() or [None], ids=lambda p: p and str(p.parent.parent))
def test_prototypes_are_the_headers(path):
    if path is None:
        pytest.skip("no cuda_runtime_api.h: `pip install nvidia-cuda-runtime-cu12`")
    header = path.read_text()
    for name, argtypes in cudart.PROTOTYPES.items():
        assert header_argtypes(header, name) == argtypes, name
    props = re.search(
        r"CUDARTAPI cudaGetDeviceProperties\(struct cudaDeviceProp \*prop, int device\);", header
    )
    error = re.search(r"const char\* CUDARTAPI cudaGetErrorString\(cudaError_t error\);", header)
    assert props and error


def test_the_header_parser_reads_what_kvedge_binds():
    """The parser's own check: a size_t and a pointer swapped would be seen."""
    header = "extern cudaError_t CUDARTAPI cudaHostRegister(void *ptr, size_t size, unsigned int flags);"
    assert header_argtypes(header, "cudaHostRegister") == cudart.PROTOTYPES["cudaHostRegister"]
    swapped = "extern cudaError_t CUDARTAPI cudaMalloc(size_t size, void **devPtr);"
    assert header_argtypes(swapped, "cudaMalloc") != cudart.PROTOTYPES["cudaMalloc"]
