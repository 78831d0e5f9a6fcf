"""The oldest TensorRT kvedge claims (`OLDEST_TENSORRT`, 10.3: JetPack 6.2), checked statically.

Every TensorRT-claimed graph (`tensorrt_claims.ACCEPTED`, plus the families whose graphs differ:
Qwen2's biases, Gemma 3's ring layers, LFM2's convolution states) is read node by node, opset and
tensor type against onnx-tensorrt 10.1-GA's operator table (tests/data, the release branch closest
to 10.3) and the importer-source facts in `kvedge.export.trt_compat`. Needs no TensorRT: this runs
everywhere CI runs. The bad graphs below prove each kind of refusal fires, naming node, op and reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tensorrt_claims import ACCEPTED, MAX_LEN
from tiny import gemma4_supported, make_tiny_model

from kvedge.contract import ONNX_FILE, ExportRecipe
from kvedge.contract.engine import OLDEST_TENSORRT
from kvedge.export.export import export_model
from kvedge.export.trt_compat import TABLE_SOURCE, check_graph, parse_operator_table

TABLE_FILE = Path(__file__).parent / "data" / "onnx_tensorrt_10.1_operators.md"
COMMIT = "96e781103cfc4adf4a6bb557e94bac8e693f6f4c"


@pytest.fixture(scope="module")
def table():
    return parse_operator_table(TABLE_FILE.read_text())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("trt-oldest") / "hf", "llama")


def load(folder: Path) -> onnx.ModelProto:
    return onnx.load(folder / ONNX_FILE)  # with the weights: scales and zero points are read


def test_the_table_is_onnx_tensorrt_10_1_and_reads_as_published(table):
    header = TABLE_FILE.read_text().splitlines()[0]
    assert "onnx/onnx-tensorrt" in header and COMMIT in header and "Apache-2.0" in header
    assert COMMIT in TABLE_SOURCE and OLDEST_TENSORRT == "10.3" and OLDEST_TENSORRT in TABLE_SOURCE
    assert table.opsets == (9, 20)
    assert len(table.ops) == 196 and sum(row.supported for row in table.ops.values()) == 150
    cast = table.ops["Cast"]
    assert cast.dtypes == {
        TensorProto.FLOAT,
        TensorProto.FLOAT16,
        TensorProto.BFLOAT16,
        TensorProto.INT32,
        TensorProto.INT64,
        TensorProto.UINT8,
        TensorProto.BOOL,
    }  # no INT8
    assert table.ops["DequantizeLinear"].dtypes == {
        TensorProto.INT8,
        TensorProto.FLOAT8E4M3FN,
        TensorProto.INT4,
    }
    assert table.ops["DequantizeLinear"].restrictions == "`x_zero_point` must be zero"
    assert not table.ops["Unique"].supported and TensorProto.INT4 in table.dtypes


def test_a_table_it_cannot_read_is_refused_by_name():
    text = TABLE_FILE.read_text()
    with pytest.raises(ValueError, match=r"Cast: unknown type name\(s\) \['INT16'\]"):
        parse_operator_table(
            text.replace("| Cast                      | Y          | FP32,", "| Cast | Y | INT16,")
        )
    with pytest.raises(ValueError, match="no opset range"):
        parse_operator_table(text.replace("range of opset", "range"))


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_every_claimed_graph_is_taken_by_the_oldest_claimed_tensorrt(case, llama, table, tmp_path):
    export_model(llama, tmp_path, ACCEPTED[case])
    problems = check_graph(load(tmp_path), table)
    assert problems == []


@pytest.mark.parametrize(
    ("family", "kv_dtype"),
    [
        ("qwen2", "int8"),
        ("gemma3", "float32"),
        ("gemma3", "int8"),
        ("lfm2", "float32"),
        ("lfm2", "int8"),
        ("qwen3_5", "float32"),
        ("gemma4", "float32"),
        ("gemma4", "int8"),
        ("gemma4", "float16"),  # --precision float16
        ("gemma4", "int8-float16"),  # --precision float16 --weights int4 --kv-dtype int8
    ],
)
def test_the_families_whose_graphs_differ_are_taken_too(family, kv_dtype, table, tmp_path):
    """Qwen2: the finding's model (biases); Gemma 3: ring-buffer layers with their own INT8 codec;
    LFM2 and Qwen3.5: convolution and recurrent layers whose states are graph inputs and outputs;
    Gemma 4: shared-KV layers, rings of their own head_dim, per-layer inputs, and its float16
    graphs (the per-layer inputs narrowed in the graph)."""
    if family == "gemma4" and not gemma4_supported():
        pytest.skip("Gemma 4 needs transformers 5.25 (kv_sharing_modes); this one is older")
    source = make_tiny_model(tmp_path / "hf", family)
    if kv_dtype == "int8-float16":
        recipe = ExportRecipe(
            max_len=MAX_LEN, precision="float16", weights="int4", kv_dtype="int8", block_size=16
        )
    elif kv_dtype == "float16":
        recipe = ExportRecipe(max_len=MAX_LEN, precision="float16")
    else:
        recipe = ExportRecipe(max_len=MAX_LEN, kv_dtype=kv_dtype)
    export_model(source, tmp_path / "out", recipe)
    assert check_graph(load(tmp_path / "out"), table) == []


def test_the_int8_cache_through_cast_is_refused_in_a_real_export(llama, table, tmp_path):
    """Break the real INT8-cache graph back into the form 10.3 does not take (each DequantizeLinear
    of the codes a Cast, each QuantizeLinear a Cast to INT8): the check names those nodes."""
    export_model(llama, tmp_path, ACCEPTED["int8-cache"])
    model = load(tmp_path)
    for node in model.graph.node:
        if node.op_type in ("DequantizeLinear", "QuantizeLinear"):
            to = TensorProto.FLOAT if node.op_type == "DequantizeLinear" else TensorProto.INT8
            node.op_type = "Cast"
            del node.input[1:]
            node.attribute.append(helper.make_attribute("to", to))
    problems = check_graph(model, table)
    reads = [p for p in problems if "past_k.codes" in p and "(Cast)" in p and "is INT8; Cast takes" in p]
    writes = [p for p in problems if "attn.int8.codes" in p and "(Cast)" in p and "is INT8; Cast takes" in p]
    assert reads and writes and len(problems) == len(reads) * 2 + len(writes)


def graph_of(nodes, inputs, outputs, initializers=(), opset=17, domains=()):
    graph = helper.make_graph(nodes, "bad", inputs, outputs, list(initializers))
    imports = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, 1) for d in domains]]
    return helper.make_model(graph, opset_imports=imports, ir_version=8 if opset < 21 else 10)


def tensor(name, elem, shape=(2, 4)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


BAD = {
    # the old INT8 cache read: int8 input sliced, then cast
    "int8-through-slice-and-cast": (
        graph_of(
            [
                helper.make_node("Slice", ["codes", "s", "e", "a"], ["part"], name="read"),
                helper.make_node("Cast", ["part"], ["y"], name="widen", to=TensorProto.FLOAT),
            ],
            [tensor("codes", TensorProto.INT8)],
            [tensor("y", TensorProto.FLOAT, (1, 4))],
            [const("s", [0]), const("e", [1]), const("a", [0])],
        ),
        ["read (Slice): codes is INT8; Slice takes", "widen (Cast): part is INT8; Cast takes"],
    ),
    "custom-domain": (
        graph_of(
            [helper.make_node("GroupQueryAttention", ["x"], ["y"], name="gqa", domain="com.microsoft")],
            [tensor("x", TensorProto.FLOAT)],
            [tensor("y", TensorProto.FLOAT)],
            domains=["com.microsoft"],
        ),
        ["gqa (GroupQueryAttention): domain 'com.microsoft' is not ONNX's"],
    ),
    "unsupported-op": (
        graph_of(
            [helper.make_node("Unique", ["x"], ["y"], name="uniq")],
            [tensor("x", TensorProto.FLOAT)],
            [tensor("y", TensorProto.FLOAT, (None,))],
        ),
        ["uniq (Unique): not supported by onnx-tensorrt release/10.1-GA"],
    ),
    "opset-22": (
        graph_of(
            [helper.make_node("Relu", ["x"], ["y"], name="relu")],
            [tensor("x", TensorProto.FLOAT)],
            [tensor("y", TensorProto.FLOAT)],
            opset=22,
        ),
        ["model: opset 22 is outside 9-20"],
    ),
    "dequantize-nonzero-zero-point-negative-scale": (
        graph_of(
            [helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"], name="dq")],
            [tensor("q", TensorProto.INT8)],
            [tensor("y", TensorProto.FLOAT)],
            [const("scale", np.float32(-0.5)), const("zp", np.int8(3))],
        ),
        [
            "dq (DequantizeLinear): scale scale has coefficients <= 0",
            "dq (DequantizeLinear): zero point zp is not",
        ],
    ),
    "uint8-intermediate": (
        graph_of(
            [
                helper.make_node("Cast", ["x"], ["u"], name="to_u8", to=TensorProto.UINT8),
                helper.make_node("Cast", ["u"], ["y"], name="back", to=TensorProto.FLOAT),
            ],
            [tensor("x", TensorProto.FLOAT)],
            [tensor("y", TensorProto.FLOAT)],
        ),
        ["to_u8 (Cast): u is UINT8 but not a graph output"],
    ),
    "axes-not-an-initializer": (
        graph_of(
            [helper.make_node("Squeeze", ["x", "axes"], ["y"], name="squeeze")],
            [tensor("x", TensorProto.FLOAT, (1, 4)), tensor("axes", TensorProto.INT64, (1,))],
            [tensor("y", TensorProto.FLOAT, (4,))],
        ),
        ["squeeze (Squeeze): `axes` must be an initializer (axes is not)"],
    ),
    "untyped-tensor-type": (
        graph_of(
            [helper.make_node("Add", ["x", "x"], ["y"], name="add")],
            [tensor("x", TensorProto.UINT16)],
            [tensor("y", TensorProto.UINT16)],
        ),
        ["tensor x: UINT16 is not a TensorRT type", "add (Add): x is UINT16; Add takes"],
    ),
    "restriction-not-read": (
        graph_of(
            [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk")],
            [tensor("x", TensorProto.FLOAT)],
            [tensor("v", TensorProto.FLOAT), tensor("i", TensorProto.INT64)],
            [const("k", np.array([2], np.int64))],
        ),
        ["topk (TopK): restriction not checked here: '`sorted` must be 1."],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_refusal_names_node_op_and_reason(case, table):
    model, wanted = BAD[case]
    problems = check_graph(model, table)
    for want in wanted:
        assert any(p.startswith(want) for p in problems), (want, problems)
    # nothing else: every problem is about the nodes and tensors named
    named = {want.split(" ")[0] + " " for want in wanted} | {want.split(":")[0] for want in wanted}
    assert all(any(p.startswith(n) for n in named) for p in problems), problems


def test_opset_21_is_taken_only_for_ops_whose_change_is_types_only(table):
    """The int4 exports are opset 21 (blocked DequantizeLinear), one past the table's range."""
    blocked = graph_of(
        [helper.make_node("DequantizeLinear", ["w", "scale"], ["y"], name="dq", axis=0, block_size=2)],
        [],
        [tensor("y", TensorProto.FLOAT, (4, 2))],
        [const("w", np.zeros((4, 2), np.int8)), const("scale", np.ones((2, 2), np.float32))],
        opset=21,
    )
    assert check_graph(blocked, table) == []
    grouped = graph_of(
        [helper.make_node("GroupNormalization", ["x", "g", "b"], ["y"], name="gn", num_groups=2)],
        [tensor("x", TensorProto.FLOAT, (1, 4, 3))],
        [tensor("y", TensorProto.FLOAT, (1, 4, 3))],
        [const("g", np.ones(4, np.float32)), const("b", np.zeros(4, np.float32))],
        opset=21,
    )
    problems = check_graph(grouped, table)
    assert any(p.startswith("gn (GroupNormalization): changed in opset 21") for p in problems), problems
