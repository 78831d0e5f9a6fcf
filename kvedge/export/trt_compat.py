"""What the oldest TensorRT kvedge claims takes from an ONNX graph, read without TensorRT.

kvedge claims TensorRT from `OLDEST_TENSORRT` (10.3, JetPack 6.2) on. Its ONNX importer is
onnx-tensorrt; the newest release branch of onnx/onnx-tensorrt, and the closest to 10.3, is 10.1-GA
(`TABLE_SOURCE`). Two things from it decide here:

- its operator table (docs/operators.md, kept as tests/data/onnx_tensorrt_10.1_operators.md),
  read by `parse_operator_table`: per op whether it is supported, the data types it takes and
  its restrictions, plus the opset range and the types TensorRT has at all;
- what the table leaves out and the importer's source at that commit says, kept below as a short
  explicit list with file and line (`IMPORTER_DTYPES`, `QUANTIZED_TYPES`, `OPSET21_TYPE_ONLY`,
  `_qdq_problems`, `_attribute_problems`, `_uint8_problems`).

`check_graph(model, table)` reads every node (subgraphs included), the model's opsets and the
element type of every tensor (graph inputs/outputs, initializers, and the rest through ONNX
shape inference), and returns one line per problem naming the node, its op and the reason; []
means nothing in the graph is refused by the table or by the importer's source. Which tensors an
op's "Supported Types" column speaks of: the inputs and outputs bound to the op's main type
variable in the ONNX schema (`T`, else the first input's; Cast both sides). A static reading is
strong evidence, not a parse by TensorRT 10.3 itself: only a Jetson's parser is that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.defs import OpSchema

from kvedge.contract.engine import OLDEST_TENSORRT
from kvedge.export.graph import all_graphs

TABLE_SOURCE = (
    "onnx-tensorrt release/10.1-GA (96e781103cfc4adf4a6bb557e94bac8e693f6f4c) docs/operators.md, "
    f"for TensorRT {OLDEST_TENSORRT}"
)

# The table's type names -> ONNX element types. "INF64" is the table's own typo (ConstantOfShape).
TABLE_TYPES = {
    "DOUBLE": TensorProto.DOUBLE,
    "FLOAT32": TensorProto.FLOAT,
    "FP32": TensorProto.FLOAT,
    "FLOAT16": TensorProto.FLOAT16,
    "FP16": TensorProto.FLOAT16,
    "BFLOAT16": TensorProto.BFLOAT16,
    "BF16": TensorProto.BFLOAT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "INF64": TensorProto.INT64,
    "FP8": TensorProto.FLOAT8E4M3FN,
    "INT8": TensorProto.INT8,
    "INT4": TensorProto.INT4,
    "UINT8": TensorProto.UINT8,
    "BOOL": TensorProto.BOOL,
}

# The importer's source at 10.1-GA, beyond the table (paths in onnx/onnx-tensorrt):
# importerUtils.cpp:314-335 (convertDtype): the only ONNX element types a tensor can be imported as.
IMPORTER_DTYPES = frozenset(
    {
        TensorProto.DOUBLE,
        TensorProto.FLOAT,
        TensorProto.INT8,
        TensorProto.UINT8,
        TensorProto.FLOAT16,
        TensorProto.BFLOAT16,
        TensorProto.BOOL,
        TensorProto.INT32,
        TensorProto.INT64,
        TensorProto.FLOAT8E4M3FN,
        TensorProto.INT4,
    }
)
# onnxOpImporters.cpp:1424-1462, 1513-1519, 1593-1597: the only types Q/DQ quantize to (a UINT8
# zero point is silently replaced by INT8, which changes the codes' meaning: refused here).
QUANTIZED_TYPES = frozenset({TensorProto.INT8, TensorProto.INT4, TensorProto.FLOAT8E4M3FN})
# ModelImporter.cpp:729-742 sets no upper opset bound (it only warns below 7), and the op importers
# read the opset-21 forms of these ops as before: opset 21 added INT4/UINT4 to their types, and to
# Q/DQ `block_size` (the importer infers the block from the scale's shape, onnxOpImporters.cpp:
# 1542-1563) and `output_dtype` (read at 1430-1441). The table's range stops at 20, so a graph at
# opset 21 is taken when every op it uses is either older than 21 or one of these.
OPSET21_TYPE_ONLY = frozenset(
    {
        "Cast",
        "CastLike",
        "Constant",
        "ConstantOfShape",
        "DequantizeLinear",
        "Flatten",
        "Identity",
        "Pad",
        "QuantizeLinear",
        "Reshape",
        "Shape",
        "Size",
        "Squeeze",
        "Transpose",
        "Unsqueeze",
    }
)
# Ops whose "Supported Types" speak of other type variables than the main one.
TYPED_PARAMS = {"Cast": ("T1", "T2"), "CastLike": ("T1", "T2"), "ConstantOfShape": ("T2",), "If": ("V",)}


@dataclass(frozen=True)
class OperatorSupport:
    """One row of the operator table."""

    supported: bool
    dtypes: frozenset[int]  # ONNX element types
    restrictions: str  # the row's text, "" when none


@dataclass(frozen=True)
class OperatorTable:
    """onnx-tensorrt's docs/operators.md, parsed (`parse_operator_table`)."""

    opsets: tuple[int, int]  # inclusive range of default-domain opsets the header states
    dtypes: frozenset[int]  # the ONNX element types TensorRT supports at all
    ops: dict[str, OperatorSupport]
    source: str


def _types(cell: str, where: str) -> frozenset[int]:
    names = [name for name in re.split(r",\s*|\s+and\s+", cell.strip()) if name]
    unknown = [name for name in names if name not in TABLE_TYPES]
    if unknown:
        raise ValueError(f"{where}: unknown type name(s) {unknown}; known: {sorted(TABLE_TYPES)}")
    return frozenset(TABLE_TYPES[name] for name in names)


def parse_operator_table(text: str, source: str = TABLE_SOURCE) -> OperatorTable:
    """onnx-tensorrt's docs/operators.md -> `OperatorTable`. Raises ValueError naming what it
    cannot read (the opset range, the type list, a row, a type name)."""
    opsets = re.search(r"range of opset (\d+) to opset (\d+)", text)
    dtypes = re.search(r"supports the following ONNX data types: ([A-Za-z0-9, ]+)", text)
    if opsets is None or dtypes is None:
        raise ValueError(f"{source}: no opset range or data type list in the header")
    ops = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or cells[0] == "Operator" or set(cells[0]) <= {"-"}:
            continue
        if cells[1] not in ("Y", "N"):
            raise ValueError(f"{source}: row {line!r}: Supported is {cells[1]!r}, not Y or N")
        op = cells[0]
        ops[op] = OperatorSupport(
            supported=cells[1] == "Y",
            dtypes=_types(cells[2], f"{source}: {op}") if len(cells) > 2 else frozenset(),
            restrictions=cells[3] if len(cells) > 3 else "",
        )
    if not ops:
        raise ValueError(f"{source}: no operator rows")
    return OperatorTable(
        opsets=(int(opsets[1]), int(opsets[2])),
        dtypes=_types(dtypes[1].replace(" and ", ", "), f"{source}: header"),
        ops=ops,
        source=source,
    )


def _dtype_name(elem: int) -> str:
    return TensorProto.DataType.Name(elem)


class _Scope:
    """What is known of a graph's tensors: element types and constant values, outer scopes included."""

    def __init__(self, graph: onnx.GraphProto, outer: _Scope | None = None) -> None:
        self.types: dict[str, int] = dict(outer.types) if outer else {}
        self.consts: dict[str, np.ndarray] = dict(outer.consts) if outer else {}
        self.constant_nodes: set[str] = set(outer.constant_nodes) if outer else set()
        self.ranks: dict[str, int] = dict(outer.ranks) if outer else {}
        for info in [*graph.input, *graph.output, *graph.value_info]:
            if info.type.HasField("tensor_type"):
                self.types[info.name] = info.type.tensor_type.elem_type
                if info.type.tensor_type.HasField("shape"):
                    self.ranks[info.name] = len(info.type.tensor_type.shape.dim)
        for tensor in graph.initializer:
            if tensor.data_location == TensorProto.EXTERNAL:
                raise ValueError(
                    f"initializer {tensor.name} is not loaded: load the model with its external data"
                )
            self.types[tensor.name] = tensor.data_type
            self.ranks[tensor.name] = len(tensor.dims)
            self.consts[tensor.name] = numpy_helper.to_array(tensor)
        for node in graph.node:
            if node.op_type == "Constant":
                self.constant_nodes.update(node.output)


def check_graph(model: onnx.ModelProto, table: OperatorTable) -> list[str]:
    """Everything in `model` (loaded with its external data: scales and zero points are read)
    that `table` and the importer's source refuse, one line each ("<node> (<op>): <reason>");
    [] when nothing is."""
    problems, opset = _opset_problems(model, table)
    inferred = onnx.shape_inference.infer_shapes(model)
    problems += _tensor_problems(inferred.graph, table)
    problems += _graph_problems(inferred.graph, _Scope(inferred.graph), opset, table)
    return problems


def _opset_problems(model: onnx.ModelProto, table: OperatorTable) -> tuple[list[str], int]:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    low, high = table.opsets
    if low <= opset <= high or opset == high + 1:
        return [], opset
    return [
        f"model: opset {opset} is outside {low}-{high} ({table.source}) and its one-opset extension"
    ], opset


def _tensor_problems(graph: onnx.GraphProto, table: OperatorTable) -> list[str]:
    """Every tensor's element type against what TensorRT has (table header) and the importer imports."""
    problems = []
    for sub in all_graphs(graph):
        tensors = [(i.name, i.type.tensor_type.elem_type) for i in [*sub.input, *sub.output, *sub.value_info]]
        tensors += [(t.name, t.data_type) for t in sub.initializer]
        for name, elem in tensors:
            if elem not in table.dtypes or elem not in IMPORTER_DTYPES:
                problems.append(f"tensor {name}: {_dtype_name(elem)} is not a TensorRT type ({table.source})")
    return problems


def _graph_problems(graph: onnx.GraphProto, scope: _Scope, opset: int, table: OperatorTable) -> list[str]:
    problems = _uint8_problems(graph, scope)
    for node in graph.node:
        problems += [
            f"{node.name or node.output[0]} ({node.op_type}): {why}"
            for why in _node(node, scope, opset, table)
        ]
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                problems += _graph_problems(sub, _Scope(sub, scope), opset, table)
    return problems


def _node(node: onnx.NodeProto, scope: _Scope, opset: int, table: OperatorTable) -> list[str]:
    """Why TensorRT 10.1/10.3's importer refuses `node` (empty when it does not)."""
    if node.domain not in ("", "ai.onnx"):
        return [f"domain {node.domain!r} is not ONNX's: the importer would look for a plugin"]
    row = table.ops.get(node.op_type)
    if row is None or not row.supported:
        return [f"not supported by {table.source}" + ("" if row else " (not in the table)")]
    schema = onnx.defs.get_schema(node.op_type, opset)
    problems = []
    if (
        opset > table.opsets[1]
        and schema.since_version > table.opsets[1]
        and node.op_type not in OPSET21_TYPE_ONLY
    ):
        problems.append(f"changed in opset {schema.since_version}, past the table's {table.opsets[1]}")
    for name, elem in _typed_tensors(node, schema, scope):
        if elem is None:
            problems.append(f"{name}: element type unknown after shape inference, cannot check")
        elif elem not in row.dtypes:
            allowed = ", ".join(sorted(_dtype_name(t) for t in row.dtypes))
            problems.append(f"{name} is {_dtype_name(elem)}; {node.op_type} takes {allowed}")
    problems += _restriction_problems(node, row.restrictions, scope)
    if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
        problems += _qdq_problems(node, scope)
    return problems + _attribute_problems(node)


def _typed_tensors(node: onnx.NodeProto, schema: OpSchema, scope: _Scope) -> list[tuple[str, int | None]]:
    """(name, element type) of the node's tensors the table's "Supported Types" speak of."""
    main = (
        "T"
        if any(p.type_str == "T" for p in schema.inputs)
        else (schema.inputs or schema.outputs)[0].type_str
    )
    wanted = TYPED_PARAMS.get(node.op_type, (main,))
    found = []
    for formals, actual in ((schema.inputs, node.input), (schema.outputs, node.output)):
        for i, name in enumerate(actual):
            if not name or not formals:
                continue
            formal = formals[min(i, len(formals) - 1)]
            if formal.type_str in wanted:
                found.append((name, scope.types.get(name)))
    return found


# Restrictions of the table this module checks, by op, with the exact text each check implements;
# a row whose text differs (another table, or an op kvedge did not use before) is reported as
# unchecked rather than passed unread.
_AXES_INITIALIZER = "`axes` must be an initializer"
_RESTRICTIONS = {
    "Slice": (_AXES_INITIALIZER, 3),
    "Squeeze": (_AXES_INITIALIZER, 1),
    "ReduceMax": (_AXES_INITIALIZER, 1),
    "ReduceMean": (_AXES_INITIALIZER, 1),
    "ReduceSum": (_AXES_INITIALIZER, 1),
    "CumSum": ("`axis` must be an initializer", 1),
    "Unsqueeze": ("`axes` must be a constant tensor", 1),
    "DequantizeLinear": ("`x_zero_point` must be zero", None),  # `_qdq_problems`
    "QuantizeLinear": ("`y_zero_point` must be 0", None),  # `_qdq_problems`
    "Constant": ("`sparse_value`, `value_string`, and `value_strings` attributes are unsupported.", None),
}


def _restriction_problems(node: onnx.NodeProto, text: str, scope: _Scope) -> list[str]:
    if not text:
        return []
    known, axes = _RESTRICTIONS.get(node.op_type, (None, None))
    if text != known:
        return [f"restriction not checked here: {text!r}"]
    if axes is None or len(node.input) <= axes or not node.input[axes]:
        return []
    name = node.input[axes]
    constant = name in scope.consts or (node.op_type == "Unsqueeze" and name in scope.constant_nodes)
    return [] if constant else [f"{text} ({name} is not)"]


def _qdq_problems(node: onnx.NodeProto, scope: _Scope) -> list[str]:
    """onnxOpImporters.cpp:1346-1620 (QuantDequantLinearHelper) at 10.1-GA."""
    if len(node.input) < 2:  # 1369-1371
        return ["needs a scale input"]
    problems = []
    scale = scope.consts.get(node.input[1])
    if scale is not None and not (scale > 0).all():  # 1379-1405
        problems.append(f"scale {node.input[1]} has coefficients <= 0; TensorRT takes positive scales only")
    if scale is not None and scale.size > 1 and scale.ndim != 1:  # 1524-1568: per-tensor, per-axis or blocked
        x_rank = scope.ranks.get(node.input[0])
        if x_rank is not None and scale.ndim != x_rank:
            problems.append(
                f"scale {node.input[1]} of rank {scale.ndim} is neither 1-D nor of x's rank {x_rank}"
            )
    if len(node.input) > 2 and node.input[2]:
        zero = node.input[2]
        if scope.types.get(zero) not in QUANTIZED_TYPES:  # 1442-1462
            problems.append(
                f"zero point {zero} is {_dtype_name(scope.types.get(zero, 0))}, not INT8/INT4/FP8"
            )
        value = scope.consts.get(zero)
        if value is None:  # 1468-1487: only a constant zero point is checked (and must be zero) there
            problems.append(f"zero point {zero} is not an initializer: cannot check it is zero")
        elif value.astype(np.float64).any():  # 1491-1494
            problems.append(f"zero point {zero} is not all zeros: TensorRT quantizes symmetrically only")
        elif scale is not None and value.size != scale.size:  # 1501-1510
            problems.append(f"zero point {zero} and scale {node.input[1]} differ in size")
    dtype = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
    if dtype and dtype not in QUANTIZED_TYPES:  # 1513-1519
        problems.append(f"output_dtype {_dtype_name(dtype)} is not INT8/INT4/FP8")
    return problems


def _attribute_problems(node: onnx.NodeProto) -> list[str]:
    """Attribute values the importer refuses for ops kvedge's graphs use (10.1-GA)."""
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Split" and "num_outputs" in attrs and attrs["num_outputs"].i != len(node.output):
        return ["num_outputs differs from the number of outputs (onnxOpImporters.cpp:5542-5546)"]
    if node.op_type == "Constant" and {"sparse_value", "value_string", "value_strings"} & set(attrs):
        return ["sparse or string Constant (onnxOpCheckers.cpp:205-207)"]
    return []


def _uint8_problems(graph: onnx.GraphProto, scope: _Scope) -> list[str]:
    """ModelImporter.cpp:241-254: a node's UINT8 output must be a graph output."""
    outputs = {o.name for o in graph.output}
    return [
        f"{node.name or node.output[0]} ({node.op_type}): {name} is UINT8 but not a graph output"
        for node in graph.node
        for name in node.output
        if scope.types.get(name) == TensorProto.UINT8 and name not in outputs
    ]
