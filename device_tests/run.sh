#!/usr/bin/env bash
# The device check (`make device-test`): on an x86-64 machine with an NVIDIA GPU, the CUDA 13
# driver, cuBLAS and cuDNN 9 for CUDA 13 (see ../shared/FINDINGS.md), and no onnxruntime-gpu:
#   1. join wheels/onnxruntime_gpu-1.31.1-...whl.part-* (made by device_tests/split_wheel.sh),
#      check its sha256 (device_tests/onnxruntime_gpu.sha256), and install it in place of the
#      CPU onnxruntime, without dependencies (the machine has CUDA 13; it may have no network);
#   2. run device_tests/ (CUDA vs CPU logits within 1e-3, cache on = cache off, decode time at
#      context 1536 vs 64, GPU memory vs the planner; TensorRT tests where TensorRT is present);
#   3. write the JSON report to ${KVEDGE_DEVICE_REPORT:-device_report.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WHEEL=onnxruntime_gpu-1.31.1-cp311-cp311-manylinux_2_28_x86_64.whl
export KVEDGE_DEVICE_REPORT=${KVEDGE_DEVICE_REPORT:-$PWD/device_report.json}

has_cuda() {
    "$PYTHON" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"
}
if ! has_cuda; then
    parts=(wheels/"$WHEEL".part-*)
    [ -e "${parts[0]}" ] || { echo "no wheels/$WHEEL.part-*: run device_tests/split_wheel.sh first" >&2; exit 2; }
    tmp=$(mktemp -d)
    cat "${parts[@]}" >"$tmp/$WHEEL"
    (cd "$tmp" && sha256sum -c - <"$OLDPWD/device_tests/onnxruntime_gpu.sha256")
    "$PYTHON" -m pip uninstall -q -y onnxruntime
    "$PYTHON" -m pip install -q --no-deps "$tmp/$WHEEL"
    rm -rf "$tmp"
    has_cuda || { echo "onnxruntime-gpu installed but CUDAExecutionProvider is not available" >&2; exit 3; }
fi
status=0
"$PYTHON" -m pytest -q -rs device_tests || status=$?
echo "report: $KVEDGE_DEVICE_REPORT"
exit $status
