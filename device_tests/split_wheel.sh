#!/usr/bin/env bash
# Prepare wheels/ for a GPU machine that cannot reach PyPI (docs/JETSON.md "Proving it on your
# device"), for that machine's Python (PYVER, default 3.12):
#   - onnxruntime-gpu 1.31.1 (255 MB, built for CUDA 13) as parts of 55 MiB, for a transfer that
#     limits the size of what it carries; device_tests/run.sh joins them and checks the whole
#     wheel's sha256 (device_tests/onnxruntime_gpu.sha256) before installing;
#   - kvedge's runtime dependencies that such a machine may lack (llguidance, msgspec, at the
#     versions of constraints.txt), whole; run.sh installs them where they do not import.
# Run on a machine that reaches PyPI, then copy the repository with wheels/ to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
PYVER=${PYVER:-3.12}
TAG=cp${PYVER/./}
WHEEL=onnxruntime_gpu-1.31.1-$TAG-$TAG-manylinux_2_28_x86_64.whl
download() {
    # pip matches manylinux_2_N exactly: name the N these wheels are built for (llguidance: 31)
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d wheels "$@"
}
mkdir -p wheels
[ -f "wheels/$WHEEL" ] || download onnxruntime-gpu==1.31.1
(cd wheels && grep " $WHEEL\$" ../device_tests/onnxruntime_gpu.sha256 | sha256sum -c -)
split -b 55M -d "wheels/$WHEEL" "wheels/$WHEEL.part-"
rm "wheels/$WHEEL"
download $(grep -E '^(llguidance|msgspec)==' constraints.txt)
ls -l wheels/
