"""The hybrid models from GGUF files: LFM2 (`lfm2`) and Qwen3.5 (`qwen35`) written as llama.cpp's
converter writes them (`tiny.make_tiny_hybrid_gguf`: its names and transforms, checked bit for bit
against the converter itself), read by `gguf_blocks` and exported.

A float32 file holds the Hugging Face weights exactly (Qwen3.5's A_log up to one rounding of
log(-(-exp(a)))), so its export answers as the folder's does: logits at every position within
tests/test_hybrid.py's 1e-4, and the same greedy tokens. A Q8_0 file's blocks are kept as they are
(`SourceBlocks`): every one dequantizes to what transformers reads from the file, which the
export's logits then equal but for onnxruntime's rounding of the split activations' residual
(`SPLIT_ATOL`).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Exported, random_ids
from tiny import make_tiny_hybrid_gguf

from kvedge.contract import ExportRecipe, Manifest
from kvedge.export.export import export_model
from kvedge.export.gguf_blocks import read_gguf_weights
from kvedge.export.quantize import QuantizedWeight
from kvedge.export.source import load_hf, resolve_source
from kvedge.runtime.generate import decode_one_token, prefill

ATOL = 1e-4  # tests/test_hybrid.py's: both sides float32 on the same weights
# onnxruntime's int8 kernel rounds the residual x - a of a portable graph's split activations to
# int8 per block (`kvedge.export.graph.quant_matmul`): measured 3.2e-4 on logits up to 2; a block
# kept in a wrong order or scale moves them by 1e-1
SPLIT_ATOL = 2e-3
# Qwen3.5 with key and value heads of 32 (whole Q8_0 blocks, so the Gated DeltaNet's output
# projection keeps its blocks when its value heads are put back in order), two value heads a key head
FAMILIES = {"lfm2": {}, "qwen3_5": {"linear_key_head_dim": 32, "linear_value_head_dim": 32}}
MAX_LEN = 128


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def files(request, tmp_path_factory):
    """(float32 GGUF, Q8_0 GGUF) of one family's tiny model; the Hugging Face folder beside each."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    overrides = FAMILIES[request.param]
    f32 = make_tiny_hybrid_gguf(root / "f32.gguf", request.param, None, seed=5, **overrides)
    q8 = make_tiny_hybrid_gguf(root / "q8.gguf", request.param, "Q8_0", seed=5, **overrides)
    return f32, q8


def every_position(exported: Exported, ids: list[int]) -> np.ndarray:
    """[len(ids) - len(ids) // 2 + 1, vocab]: the export's logits after each token from the middle on, half of
    `ids` prefilled in one call, the rest teacher-forced decode steps (test_hybrid.py's check)."""
    model = exported.model()
    half = len(ids) // 2
    got = [prefill(model.backend, model.cache, 0, [ids[:half]])[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[half:]]
    return np.stack(got)


def test_a_gguf_reads_as_transformers_reads_it(files):
    """Every tensor of both files under its Hugging Face name and layout, equal to the weight
    transformers loads from the same file (quantized ones dequantized): names, the value heads'
    order, norms' 1 + w, the squeezed kernels and A_log all undone."""
    for path in files:
        read = read_gguf_weights(path)
        model, _ = load_hf(resolve_source(path))
        state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        assert set(read.tensors) == set(state) - {"lm_head.weight"}  # the tiny models tie it
        for name, weight in read.tensors.items():
            got = weight.dequantize().T if isinstance(weight, QuantizedWeight) else weight
            assert got.shape == state[name].shape, name
            np.testing.assert_allclose(got, state[name], rtol=1e-6, atol=0, err_msg=name)


def test_a_float32_gguf_answers_as_its_folder_does(files, tmp_path):
    """Logits at every position and 64 greedy tokens, against transformers on the folder."""
    f32, _ = files
    export_model(f32, tmp_path / "out", ExportRecipe(max_len=MAX_LEN))
    exported = Exported(f32.parent / "f32-hf", tmp_path / "out")
    ids = random_ids(40, seed=6)
    ref = exported.hf_logits(ids)
    np.testing.assert_allclose(every_position(exported, ids), ref[len(ids) // 2 - 1 :], atol=ATOL, rtol=0)
    assert np.abs(ref).max() > 1  # far from uniform: the tolerance means something
    want, got = exported.greedy_pair(random_ids(16, seed=2))
    assert got == want


def test_a_q8_0_gguf_keeps_its_blocks_and_transformers_logits(files, tmp_path):
    """--weights int8 from the Q8_0 file: every quantized matrix is the file's own blocks (none
    requantized, no float channel kept), and the logits are transformers' on that file."""
    _, q8 = files
    export_model(q8, tmp_path / "int8", ExportRecipe(max_len=MAX_LEN, weights="int8"))
    manifest = Manifest.load(tmp_path / "int8")
    assert set(manifest.weight_source_blocks) == {"Q8_0"} and not manifest.weight_outlier_channels
    exported = Exported(q8.parent / "q8-hf", tmp_path / "int8")
    exported.hf, _ = load_hf(resolve_source(q8))  # the file's weights, as transformers dequantizes them
    ids = random_ids(40, seed=7)
    ref = exported.hf_logits(ids)
    got = every_position(exported, ids)
    np.testing.assert_allclose(got, ref[len(ids) // 2 - 1 :], atol=SPLIT_ATOL, rtol=0)
