#!/usr/bin/env bash
# The device check (`make device-test`; docs/JETSON.md "Proving it on your device"). The flow:
#   1. on an x86 machine with the export extra: `make device-artifacts` exports the tiny models
#      the tests use into device_artifacts/ (device_tests/artifacts.py);
#   2. copy that folder (and this repository) to the GPU machine, which needs only the runtime
#      (`pip install '.[serve]'`: no torch, transformers or onnx; TensorRT engines are built
#      there, from the copied exports, as engines are per device);
#   3. there: `device_tests/run.sh <artifacts folder>` (or KVEDGE_DEVICE_ARTIFACTS=<folder>).
#      Without a folder the tests export their own where torch is installed, else skip naming
#      `make device-artifacts`.
# The Python: $PYTHON, else the active venv's ($VIRTUAL_ENV), else this repository's .venv, else
# python3 on PATH. It needs pytest (kvedge's `device-tests` extra), onnxruntime and kvedge's
# runtime: each one missing is said with the line that installs it (device_tests/preflight.py).
# Without pytest it stops there; otherwise it always reaches pytest, whatever else is missing or
# fails to install: each test skips, with the reason, where what it needs is absent (the base
# above; ort_cuda: onnxruntime's CUDAExecutionProvider; tensorrt: TensorRT):
#   - a Jetson (JetPack 6.2: NVIDIA's Jetson onnxruntime-gpu and TensorRT; JetPack 7.2: TensorRT
#     only, the ort_cuda tests skip), kvedge installed as docs/JETSON.md says: the tests as they are;
#   - an x86-64 Linux machine with an NVIDIA GPU, the CUDA 13 driver, cuBLAS and cuDNN 9 for
#     CUDA 13 (NVIDIA's pip packages of them will do: onnxruntime preloads them), a libcudart
#     (kvedge drives it through ctypes) or cuda-python of the driver's CUDA major (doctor's
#     `cuda runtime` line says which), and no onnxruntime-gpu: where wheels/ holds the parts of
#     onnxruntime_gpu-1.31.1-<python tag>-...whl (made by device_tests/split_wheel.sh), they are
#     joined, checked against device_tests/onnxruntime_gpu.sha256 and installed in place of the
#     CPU onnxruntime, without dependencies (the machine may have no network); wheels/*.whl of
#     kvedge's dependencies that do not import are installed too.
# What runs: for the portable and the `--variant ort --kv-dtype float16` exports, the CUDA
# binding, CUDA vs CPU logits within 1e-3 (float16 cache: its bound), cache on = off, decode time
# at context 1536 vs 64 with and without a CUDA graph, GPU memory vs the planner, models opened and
# closed in turn, the cache read from mapped vs device memory at 64 / 1536 tokens
# (test_pool_placement.py), decode at 64 / 1536 with the pool mapped and with `--kv-memory
# device` (onnxruntime and TensorRT); the TensorRT engine tests; the hybrid models (LFM2,
# Qwen3.5: their states bound as the pool) on CUDA and TensorRT vs the CPU. The JSON report goes to
# ${KVEDGE_DEVICE_REPORT:-device_report.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
    export KVEDGE_DEVICE_ARTIFACTS=$1
fi
if [ -n "${KVEDGE_DEVICE_ARTIFACTS:-}" ]; then
    KVEDGE_DEVICE_ARTIFACTS=$(cd "$KVEDGE_DEVICE_ARTIFACTS" 2>/dev/null && pwd || echo "$KVEDGE_DEVICE_ARTIFACTS")
    echo "artifacts: $KVEDGE_DEVICE_ARTIFACTS"
else
    echo "no artifacts folder (device_tests/run.sh <folder>, made by \`make device-artifacts\`): the tests export their own where torch is installed, else skip"
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
        PYTHON=$VIRTUAL_ENV/bin/python
    elif [ -x .venv/bin/python ]; then
        PYTHON=.venv/bin/python
    else
        PYTHON=python3
    fi
fi
echo "python: $(command -v "$PYTHON")"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" device_tests/preflight.py || exit $?
TAG=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
WHEEL=onnxruntime_gpu-1.31.1-$TAG-$TAG-manylinux_2_28_x86_64.whl
export KVEDGE_DEVICE_REPORT=${KVEDGE_DEVICE_REPORT:-$PWD/device_report.json}
export PYTHONUNBUFFERED=1

has_cuda() {
    "$PYTHON" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null
}
parts=(wheels/"$WHEEL".part-*)
if has_cuda; then
    :
elif [ "$(uname -m)" != x86_64 ] || [ ! -e "${parts[0]}" ]; then
    echo "onnxruntime has no CUDAExecutionProvider and wheels/ has no $WHEEL parts (x86-64 only: PYVER=${TAG:2:1}.${TAG:3} device_tests/split_wheel.sh): the ort_cuda tests skip; the TensorRT tests run where TensorRT is"
else
    tmp=$(mktemp -d)
    cat "${parts[@]}" >"$tmp/$WHEEL"
    if ! (cd "$tmp" && grep " $WHEEL\$" "$OLDPWD/device_tests/onnxruntime_gpu.sha256" | sha256sum -c -); then
        echo "$WHEEL from wheels/ does not match device_tests/onnxruntime_gpu.sha256: not installed; the ort_cuda tests skip"
    elif ! ("$PYTHON" -m pip uninstall -q -y onnxruntime && "$PYTHON" -m pip install -q --no-deps --no-index "$tmp/$WHEEL"); then
        echo "installing $WHEEL failed (above): the ort_cuda tests skip"
    fi
    rm -rf "$tmp"
    has_cuda || echo "onnxruntime-gpu installed but CUDAExecutionProvider is not available (its CUDA libraries?): the ort_cuda tests skip"
fi
for module in llguidance msgspec; do
    if ! "$PYTHON" -c "import $module" 2>/dev/null; then
        wheel=$(ls wheels/"$module"-*.whl 2>/dev/null | head -1 || true)
        if [ -n "$wheel" ]; then
            "$PYTHON" -m pip install -q --no-deps --no-index "$wheel" || echo "installing $wheel failed (above)"
        else
            echo "$module is not installed and wheels/ has no wheel of it: the tests that need it fail"
        fi
    fi
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
status=0
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m pytest -q -rs -p no:cacheprovider device_tests || status=$?
echo "report: $KVEDGE_DEVICE_REPORT"
exit $status
