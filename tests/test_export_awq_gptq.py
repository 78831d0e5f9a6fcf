"""AWQ and GPTQ checkpoints' int4 blocks stored as they are (`kvedge.export.awq_gptq`): a tiny
random Llama quantized on a known grid (`tests/tiny.py`'s `packed_grid`), packed as AutoAWQ and
AutoGPTQ / gptqmodel pack it, exported with `kvedge export`.

Every block's values s (u - z) are exact in float32 (`awq_gptq`'s docstring), so the graph's
weights are the checkpoint's dequantized weights bit for bit, and the export's logits are
transformers' on the dequantized float model up to float32 summation order. The tied embedding
lies on an 8-bit grid of its own (`EMBEDDING_STEP`), which the export's int8 LM head keeps exactly:
the logits then test the checkpoint's blocks alone.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import assert_same_values, graph_weight, random_ids, stored, unfused_logits
from safetensors.torch import load_file, save_file
from tiny import make_tiny_packed
from transformers import AutoModelForCausalLM

from kvedge.contract import ExportRecipe, Manifest
from kvedge.errors import KvedgeError
from kvedge.export.awq_gptq import read_packed_weights
from kvedge.export.export import export_model
from kvedge.export.source import load_hf, resolve_source

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "desc_act": False,
    "checkpoint_format": "gptq",
    "true_sequential": True,
}
CHECKPOINTS = {  # name -> (quantization_config, GPTQ sym)
    "awq-g128": (AWQ, False),
    "gptq-sym-g32": ({**GPTQ, "group_size": 32, "sym": True}, True),
    "gptq-asym-g64": ({**GPTQ, "group_size": 64, "sym": False}, False),  # v1: zeros stored less one
}
LAYERS, MATRICES = 2, 14  # 7 projections a layer
SOFTMAX_SCALE = 0.25  # head_dim 16: folded into Wq, exact on the blocks
ATOL = 1e-5  # as tests/test_export_gguf.py: float32 summation order alone (exact weights)
MATMULS = {  # graph matmul -> its projections, side by side along N
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}


def kvedge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def exported(request, tmp_path_factory):
    """(checkpoint folder, its dequantized projections, the int4 export at its group size)."""
    quantization, sym = CHECKPOINTS[request.param]
    folder, dequantized = make_tiny_packed(
        tmp_path_factory.mktemp("packed") / request.param, quantization, sym=sym
    )
    out = folder.parent / "int4"
    block = str(quantization["group_size"])
    done = kvedge(
        "export",
        str(folder),
        "--out",
        str(out),
        "--weights",
        "int4",
        "--block-size",
        block,
        "--max-len",
        "64",
        "--logits",
        "all",
    )
    assert done.returncode == 0, done.stderr
    return folder, dequantized, out


def test_the_graphs_blocks_are_the_checkpoints_own(exported):
    """Every matmul's weight, as the graph stores it, is the checkpoint's s (u - z), bit for bit."""
    folder, dequantized, out = exported
    manifest = Manifest.load(out)
    method = "AWQ" if "awq" in folder.name else "GPTQ"
    assert manifest.weight_source_blocks == {method: MATRICES}
    block = manifest.weight_block_size
    tensors = stored(out)
    for i in range(LAYERS):
        for matmul, parts in MATMULS.items():
            want = [dequantized[f"model.layers.{i}.{part}.weight"] for part in parts]
            if parts[0].endswith("q_proj"):
                want[0] = want[0] * np.float32(SOFTMAX_SCALE)
            expected = np.ascontiguousarray(np.concatenate(want).T)
            assert_same_values(graph_weight(tensors, f"model.layers.{i}.{matmul}", block), expected, matmul)


def test_logits_are_transformers_on_the_dequantized_model(exported):
    """The export's logits (DequantizeLinear feeding a float MatMul, `unfused_logits`) against
    transformers' float32 model holding the dequantized weights; kvedge's own float model of
    the checkpoint (`load_hf`, which the export reads) holds exactly those weights."""
    folder, dequantized, out = exported
    reference = AutoModelForCausalLM.from_pretrained(folder.parent / f"{folder.name}-float", dtype="float32")
    ours, _ = load_hf(resolve_source(folder))
    theirs = reference.state_dict()
    for name, w in ours.state_dict().items():
        assert torch.equal(w, theirs[name]), name
    ids = random_ids(24, seed=6)
    with torch.no_grad():
        ref = reference(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    got = unfused_logits(out, ids)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    assert np.abs(ref).max() > 2  # far from uniform: the tolerance means something


def test_gptq_v2_zeros_are_read_as_they_are(tmp_path):
    """gptqmodel's checkpoint_format gptq_v2 stores z itself: the same grid reads back the same."""
    quantization = {**GPTQ, "group_size": 64, "sym": False, "checkpoint_format": "gptq_v2"}
    folder, dequantized = make_tiny_packed(tmp_path / "v2", quantization)
    weights = read_packed_weights(folder)
    assert weights.types == dict.fromkeys(dequantized, "GPTQ")
    for name, w in dequantized.items():
        assert_same_values(np.ascontiguousarray(weights.tensors[name].dequantize().T), w, name)


def test_groups_split_into_smaller_blocks_are_kept_larger_ones_requantized(tmp_path, caplog):
    """At the default --block-size 32 an AWQ checkpoint's groups of 64 are kept, each split into
    two blocks on its scale and offset (the same values, bit for bit); blocks larger than
    the checkpoint's groups cannot hold them: every projection is quantized again from the
    dequantized weights (as a GGUF's are), and the log says why."""
    caplog.set_level(logging.INFO, logger="kvedge.export.export")
    folder, dequantized = make_tiny_packed(tmp_path / "awq", {**AWQ, "group_size": 64})
    manifest = export_model(folder, tmp_path / "b32", ExportRecipe(max_len=64, weights="int4"))
    assert manifest.weight_source_blocks == {"AWQ": MATRICES} and manifest.weight_block_size == 32
    tensors = stored(tmp_path / "b32")
    down = graph_weight(tensors, "model.layers.0.mlp.down", 32)
    want = np.ascontiguousarray(dequantized["model.layers.0.mlp.down_proj.weight"].T)
    assert_same_values(down, want, "down_proj in blocks of 32")
    caplog.clear()
    larger = ExportRecipe(max_len=64, weights="int4", block_size=128)
    manifest = export_model(folder, tmp_path / "b128", larger)
    assert manifest.weight_source_blocks == {} and manifest.weight_block_size == 128
    assert (
        "kept 0 of 15 quantized matrices as the source's blocks (none); requantized 14 "
        "(model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight and 12 more): "
        "AWQ is 4-bit blocks of 64, the graph stores 4-bit blocks of 128"
    ) in caplog.text


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


REFUSED = [  # (quantization_config changes, what the one line names)
    ({"desc_act": True}, "GPTQ desc_act true"),
    ({"bits": 3}, "GPTQ bits 3"),
    ({"group_size": -1}, "GPTQ group_size -1"),
    ({"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
    ({"quant_method": "exl2"}, "quant_method 'exl2' is not one kvedge reads"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
]


@pytest.mark.parametrize(("changes", "named"), REFUSED)
def test_formats_it_cannot_read_are_refused_by_name(tmp_path, changes, named):
    folder, _ = make_tiny_packed(tmp_path / "bad", {**GPTQ, "group_size": 32, "sym": True}, sym=True)
    edit_config(folder, **changes)
    with pytest.raises(KvedgeError, match="kvedge reads AWQ") as refused:
        read_packed_weights(folder)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_a_bad_checkpoint_gets_one_line_from_kvedge_export(tmp_path):
    """`kvedge export` of a desc_act checkpoint, and of one whose qzeros are missing or whose
    g_idx permutes the input channels: one line naming it, no traceback."""
    folder, _ = make_tiny_packed(tmp_path / "bad", {**GPTQ, "group_size": 32, "sym": True}, sym=True)
    edit_config(folder, desc_act=True)
    done = kvedge("export", str(folder), "--out", str(tmp_path / "o1"), "--weights", "int4")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "GPTQ desc_act true (g_idx permutes the input channels)" in done.stderr
    edit_config(folder, desc_act=False)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.down_proj"
    tensors[f"{name}.g_idx"] = tensors[f"{name}.g_idx"].flip(0)
    del tensors["model.layers.0.self_attn.k_proj.qzeros"]
    save_file(tensors, str(path))
    with pytest.raises(KvedgeError, match=r"k_proj: GPTQ Linear has no qzeros tensor$"):
        read_packed_weights(folder)
    done = kvedge("export", str(folder), "--out", str(tmp_path / "o2"), "--weights", "int4")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "k_proj: GPTQ Linear has no qzeros tensor" in done.stderr
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.k_proj.qzeros"] = tensors[
        "model.layers.0.self_attn.v_proj.qzeros"
    ].clone()
    save_file(tensors, str(path))
    with pytest.raises(KvedgeError, match=r"down_proj: g_idx is not k // 32 \(input channels permuted"):
        read_packed_weights(folder)
