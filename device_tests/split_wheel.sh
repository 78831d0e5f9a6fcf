#!/usr/bin/env bash
# Put onnxruntime-gpu 1.31.1 (255 MB, built for CUDA 13) into wheels/ as parts of under 60 MB,
# small enough to carry to a device machine one per call; device_tests/run.sh joins them and
# checks the whole wheel's sha256 before installing. Run on a machine that reaches PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WHEEL=onnxruntime_gpu-1.31.1-cp311-cp311-manylinux_2_28_x86_64.whl
mkdir -p wheels
[ -f "wheels/$WHEEL" ] || "$PYTHON" -m pip download onnxruntime-gpu==1.31.1 --no-deps \
    --python-version 3.11 --platform manylinux_2_28_x86_64 --only-binary=:all: -d wheels
(cd wheels && sha256sum -c - <<<"$(grep -o '^[0-9a-f]\{64\}' ../device_tests/onnxruntime_gpu.sha256)  $WHEEL")
split -b 55M -d "wheels/$WHEEL" "wheels/$WHEEL.part-"
rm "wheels/$WHEEL"
ls -l wheels/
