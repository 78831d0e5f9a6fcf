"""kvedge.SideInputs, the op that makes the side inputs of "ort" graphs' quantized matmuls
(`kvedge/runtime/csrc/kvedge_ops.cc`, `kvedge/export/quantize.py`): its rows against exact
arithmetic (the C++ self-test), the op in onnxruntime against numpy, and whole ort int8/int4
graphs against the same graphs with the op rewritten into the standard ops it replaces.

Graph equality: none. The op adds each block's channels from first to last, one addition at a
time, as onnxruntime's float32 MatMul adds x times a 0/1 column (its products by 0 add exact zeros),
and zeroes the kept channels as the Mul by 0/1 does, so the logits equal the standard-op graph's to
the bit. That is what the graphs need: MatMulNBits rounds activations to int8, so one changed float
rounding moves an output by a whole int8 level and the change grows layer by layer. Block sums in
8 float32 lanes (1e-7 relative from the in-order sum) moved SmolLM2-135M's int8-weight logits by
0.18 and flipped its near-tie answer to the known-good question (tests/test_real_model.py); on
these tiny models they moved logits by 2.3e-7 of their range, so equality is what catches it.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import (
    FUSES_MATMULNBITS,
    decode_logits,
    export_once,
    optimized_ops,
    random_ids,
    require_onnxruntime,
    save_graph,
)
from onnx import TensorProto, helper, numpy_helper
from test_kv_int8 import NEEDS_AARCH64, SELFTEST, run_selftest
from tiny import make_tiny_model

from kvedge.contract import ONNX_FILE, SIDE_INPUTS_OP, ExportRecipe, Manifest
from kvedge.export.export import export_model
from kvedge.export.graph import all_graphs
from kvedge.runtime import kernels

SIDE_CASES = 14  # csrc/selftest.cc's `side` cases


@SELFTEST
@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_side_rows_match_exact_sums(selftests):
    """SideRows against in-order float32 block sums, kept channels and masked x, all exactly: every
    export block size, a block that is no multiple of 8, no blocks, no kept channels, no masked
    output, rows cut into ragged items."""
    out = run_selftest(selftests, "side")
    assert out.count("ok  ") == SIDE_CASES and "FAIL" not in out


@SELFTEST
@NEEDS_AARCH64
def test_side_rows_neon_match_exact_sums(selftests):
    out = run_selftest(selftests, "side", orin=True)
    assert out.count("ok  ") == SIDE_CASES and "FAIL" not in out


def side_session(x_shape: list[int], kept: np.ndarray, block_size: int, masked: bool) -> ort.InferenceSession:
    """One kvedge.SideInputs node on x of `x_shape` (any leading dims) and the initializer `kept`."""
    outputs = ["side", "masked"] if masked else ["side"]
    node = helper.make_node(SIDE_INPUTS_OP, ["x", "kept"], outputs, domain="kvedge", block_size=block_size)
    graph = helper.make_graph(
        [node],
        "side",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", x_shape[-1]])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(kept.astype(np.int64), "kept")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("kvedge", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(kernels.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    "kept, block_size, masked",
    [([5, 0, 95, 33], 32, True), ([], 16, False), ([7, 64], 0, True), ([], 96, True)],
)
def test_side_inputs_op_matches_numpy(kept, block_size, masked):
    """[block sums | x[kept]] and x with the kept channels zeroed, over [b, s, K] and a prefill's
    rows (several work items)."""
    kept = np.array(kept, np.int64)
    session = side_session([2, 3, 96], kept, block_size, masked)
    for shape in ([2, 3, 96], [1, 700, 96]):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        got = session.run(None, {"x": x})
        sums = x.reshape(*shape[:-1], -1, block_size).sum(-1) if block_size else x[..., :0]
        np.testing.assert_allclose(got[0][..., : sums.shape[-1]], sums, rtol=0, atol=1e-5)
        assert (got[0][..., sums.shape[-1] :] == x[..., kept]).all()
        if masked:
            want = x.copy()
            want[..., kept] = 0.0
            assert (got[1] == want).all()


def test_side_inputs_op_refuses_bad_channels():
    with pytest.raises(Exception, match="kept channel 96 is outside x's 96 channels"):
        side_session([1, 1, 96], np.array([3, 96]), 32, True).run(
            None, {"x": np.zeros((1, 1, 96), np.float32)}
        )
    with pytest.raises(Exception, match="x has 96 channels, not a multiple of block_size 64"):
        side_session([1, 1, 96], np.array([3]), 64, True).run(None, {"x": np.zeros((1, 1, 96), np.float32)})


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("side") / "hf", "llama")


@pytest.fixture(scope="module")
def exports(tiny_source, tmp_path_factory):
    """(weights, kv_dtype, outlier_channels) -> ort artifact folder, built once per module."""
    root = tmp_path_factory.mktemp("side_exports")
    return export_once(
        tiny_source, root, "weights", "kv_dtype", "outlier_channels", max_len=64, variant="ort"
    )


def with_standard_ops(folder, out):
    """A copy of the artifact `folder` in `out` whose kvedge.SideInputs nodes (in the prefill form
    of a two-form graph) are the standard ops they replace (`quantize.py`): side = x @ [K, K/block
    + kept] 0/1 (block-sum columns, then one column per kept channel), masked = x * a 0/1 mask."""
    shutil.copytree(folder, out)
    model = onnx.load(str(out / ONNX_FILE))
    for graph in all_graphs(model.graph):
        stored = {t.name: t for t in graph.initializer}
        nodes = []
        for node in graph.node:
            if node.op_type != SIDE_INPUTS_OP:
                nodes.append(node)
                continue
            x, kept_name = node.input
            kept = numpy_helper.to_array(model_initializer(model, kept_name))
            block = next(a.i for a in node.attribute if a.name == "block_size")
            prefix = node.output[0].split("@")[0].removesuffix(".side")  # a branch's values end @form
            k = stored[f"{prefix}.weight_q"].dims[0]
            columns = [np.repeat(np.eye(k // block, dtype=np.float32), block, axis=0)] if block else []
            select = np.zeros((k, kept.size), np.float32)
            select[kept, np.arange(kept.size)] = 1.0
            matrix = numpy_helper.from_array(np.concatenate([*columns, select], axis=1), f"{prefix}.side_in")
            graph.initializer.append(matrix)
            nodes.append(helper.make_node("MatMul", [x, matrix.name], [node.output[0]]))
            if len(node.output) > 1:
                mask = np.ones(k, np.float32)
                mask[kept] = 0.0
                graph.initializer.append(numpy_helper.from_array(mask, f"{prefix}.int8_mask"))
                nodes.append(helper.make_node("Mul", [x, f"{prefix}.int8_mask"], [node.output[1]]))
        del graph.node[:]
        graph.node.extend(nodes)
    return save_graph(model, out)


def model_initializer(model, name: str):
    """The initializer `name` from whichever of the model's graphs holds it."""
    return next(t for g in all_graphs(model.graph) for t in g.initializer if t.name == name)


@pytest.mark.parametrize("channels", [32, 0])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_ort_quantized_graph_equals_its_standard_op_form(exports, tmp_path, weights, kv_dtype, channels):
    require_onnxruntime(*FUSES_MATMULNBITS)
    """Prefill and decode logits of the ort graph (one SideInputs per quantized matmul that has
    block offsets or kept channels, each still fused into MatMulNBits) equal to the bit those of
    the same graph with the op rewritten into MatMul + Mul, with and without kept channels."""
    folder = exports(weights, kv_dtype, channels)
    manifest = Manifest.load(folder)
    assert manifest.uses_kvedge_ops
    ops = optimized_ops(folder, tmp_path)
    matmuls = 4 * manifest.geometry.num_layers + 1  # qkv, o, gate_up, down; LM head
    assert ops["MatMulNBits"] == matmuls and ops["DequantizeLinear"] == 0
    # every matmul keeps channels; without, those whose blocks all have offset 0 need no side product
    assert ops[SIDE_INPUTS_OP] == matmuls if channels else 0 < ops[SIDE_INPUTS_OP] <= matmuls
    graphs = all_graphs(onnx.load(str(folder / ONNX_FILE)).graph)
    assert not [t.name for g in graphs for t in g.initializer if t.name.endswith((".side_in", ".int8_mask"))]

    ids = random_ids(32, seed=3)
    got = decode_logits(folder, ids, 20)
    want = decode_logits(with_standard_ops(folder, tmp_path / "standard"), ids, 20)
    np.testing.assert_array_equal(got, want)  # to the bit (module docstring)


def test_float16_cache_keeps_standard_ops(tiny_source, tmp_path):
    """The float16-cache ort graph (the CUDA form) keeps its side inputs in standard ops: the
    kernels are CPU-only."""
    out = tmp_path / "f16"
    export_model(
        tiny_source, out, ExportRecipe(max_len=64, variant="ort", weights="int4", kv_dtype="float16")
    )
    graph = onnx.load(str(out / ONNX_FILE)).graph
    assert SIDE_INPUTS_OP not in {node.op_type for node in graph.node}
    sums = [node for node in graph.node if node.op_type == "ReduceSum"]
    assert [node for node in sums if node.output[0].endswith(".block_sums")]
    assert not Manifest.load(out).uses_kvedge_ops
