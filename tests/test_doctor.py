"""`kvedge doctor` on this machine (saying what is absent) and on a fake Jetson file tree."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from kvedge.contract import Manifest
from kvedge.doctor import doctor_report, run_checks
from kvedge.errors import KvedgeError
from kvedge.runtime.backend import OrtBackend
from kvedge.runtime.model import Model

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None


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
    assert "JetPack 6.x line" in doctor_report(root=root)


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
    with pytest.raises(KvedgeError, match="CUDAExecutionProvider is not available here"):
        Model(tiny_llama.out, device="cuda")
    manifest = Manifest.load(tiny_llama.out)
    with pytest.raises(KvedgeError, match="'tensorrt' is not supported; allowed: \\['cpu', 'cuda'\\]"):
        OrtBackend(tiny_llama.out, manifest, provider="tensorrt")
