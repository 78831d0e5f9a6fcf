"""device_tests/: run only on a machine with an NVIDIA GPU (Jetson or any CUDA machine).

    python -m pytest device_tests -q

Everything here is skipped, with the reason, where no GPU execution provider is available.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnxruntime as ort
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def pytest_collection_modifyitems(config, items):
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        skip = pytest.mark.skip(
            reason=f"no CUDAExecutionProvider in onnxruntime ({ort.get_available_providers()})"
        )
        for item in items:
            item.add_marker(skip)
