"""onnxruntime CUDA provider against the CPU reference on a tiny exported model."""

from __future__ import annotations

import numpy as np
import pytest
from tiny import make_tiny_model

from kvedge.export.export import ExportOptions, export_model
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model

pytestmark = pytest.mark.ort_cuda

ATOL = 1e-3  # CUDA fp32 matmuls may use TF32-free but differently ordered reductions


def test_cuda_matches_cpu(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "llama")
    export_model(source, tmp_path / "out", ExportOptions(max_len=128))
    cpu, gpu = Model(tmp_path / "out"), Model(tmp_path / "out", device="cuda")
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 300, 20)]
    a = prefill(cpu.backend, cpu.cache, 0, [ids])[0]
    b = prefill(gpu.backend, gpu.cache, 0, [ids])[0]
    for _ in range(16):
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)
        token = int(np.argmax(a))
        assert token == int(np.argmax(b))
        a = decode_one_token(cpu.backend, cpu.cache, 0, [token])[0]
        b = decode_one_token(gpu.backend, gpu.cache, 0, [token])[0]
