#!/usr/bin/env bash
# The device check (`make device-test`; what a GPU machine needs: docs/JETSON.md "Proving it on
# your device"). On an x86-64 Linux machine with an NVIDIA GPU, the CUDA 13 driver, cuBLAS and
# cuDNN 9 for CUDA 13 (NVIDIA's pip packages of them will do: onnxruntime preloads them),
# cuda-python of the driver's CUDA major, and no onnxruntime-gpu:
#   1. join wheels/onnxruntime_gpu-1.31.1-<python tag>-...whl.part-* (made by
#      device_tests/split_wheel.sh), check its sha256 (device_tests/onnxruntime_gpu.sha256), and
#      install it in place of the CPU onnxruntime, without dependencies (the machine may have no
#      network); install wheels/*.whl of kvedge's dependencies that do not import;
#   2. run device_tests/ (for the portable and the `--variant ort --kv-dtype float16` exports:
#      the CUDA binding, CUDA vs CPU logits within 1e-3 (float16 cache: its bound), cache on = off,
#      decode time at context 1536 vs 64 with and without a CUDA graph, GPU memory vs the
#      planner, models opened and closed in turn, the cache read from mapped vs device memory
#      at 64 / 1536 tokens (test_pool_placement.py), decode at 64 / 1536 with the pool mapped
#      and with `--kv-memory device` (onnxruntime and TensorRT); TensorRT tests where TensorRT
#      is present);
#   3. write the JSON report to ${KVEDGE_DEVICE_REPORT:-device_report.json}.
# Where onnxruntime already lists CUDAExecutionProvider (a Jetson with kvedge, NVIDIA's Jetson
# onnxruntime-gpu >= 1.20 and cuda-python of the device's CUDA major: docs/JETSON.md), step 1 is
# skipped and the same tests run (memory figures there come from cudaMemGetInfo: one DRAM).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
TAG=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
WHEEL=onnxruntime_gpu-1.31.1-$TAG-$TAG-manylinux_2_28_x86_64.whl
export KVEDGE_DEVICE_REPORT=${KVEDGE_DEVICE_REPORT:-$PWD/device_report.json}
export PYTHONUNBUFFERED=1

has_cuda() {
    "$PYTHON" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"
}
if ! has_cuda; then
    parts=(wheels/"$WHEEL".part-*)
    [ -e "${parts[0]}" ] || { echo "no wheels/$WHEEL.part-*: run PYVER=${TAG:2:1}.${TAG:3} device_tests/split_wheel.sh first" >&2; exit 2; }
    tmp=$(mktemp -d)
    cat "${parts[@]}" >"$tmp/$WHEEL"
    (cd "$tmp" && grep " $WHEEL\$" "$OLDPWD/device_tests/onnxruntime_gpu.sha256" | sha256sum -c -)
    "$PYTHON" -m pip uninstall -q -y onnxruntime
    "$PYTHON" -m pip install -q --no-deps --no-index "$tmp/$WHEEL"
    rm -rf "$tmp"
    has_cuda || { echo "onnxruntime-gpu installed but CUDAExecutionProvider is not available" >&2; exit 3; }
fi
for module in llguidance msgspec; do
    if ! "$PYTHON" -c "import $module" 2>/dev/null; then
        wheel=$(ls wheels/"$module"-*.whl 2>/dev/null | head -1)
        [ -n "$wheel" ] || { echo "$module is not installed and wheels/ has no wheel of it" >&2; exit 4; }
        "$PYTHON" -m pip install -q --no-deps --no-index "$wheel"
    fi
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m pytest -q -rs -p no:cacheprovider device_tests || status=$?
echo "report: $KVEDGE_DEVICE_REPORT"
exit $status
