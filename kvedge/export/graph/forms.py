"""The ONNX model around the builders' nodes: one form, or a prefill form and a decode form as the
two branches of one `If` on the step's length; and walking a model's graphs (its branches too).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kvedge.contract import (
    KVEDGE_OPS_DOMAIN,
    VERIFY_TOKENS,
    ExportRecipe,
    GraphInterface,
    TensorSpec,
    kvedge_ops,
)
from kvedge.export.graph.builder import Builder
from kvedge.export.graph.options import MS_DOMAIN, graph_opset


def onnx_model(builders: list[Builder], interface: GraphInterface, options: ExportRecipe) -> onnx.ModelProto:
    """The model around the builders' nodes, its inputs and outputs declared as `interface` states
    them: one builder's nodes as the graph, or (prefill form, decode form) as the branches of one
    `If` on the step's length (`two_forms`). The graph is filled in place in the model (a graph
    made apart is copied whole into it: every inline weight once more)."""
    opsets = [helper.make_opsetid("", graph_opset(options))]
    if options.variant == "ort":
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    if kvedge_ops(options.variant, interface.geometry.dtype, options.weights, options.decode):
        opsets.append(helper.make_opsetid(KVEDGE_OPS_DOMAIN, 1))
    model = helper.make_model(onnx.GraphProto(), opset_imports=opsets, producer_name="kvedge")
    inputs = [value_info(t) for t in interface.inputs()]
    outputs = [value_info(t) for t in interface.outputs()]
    g = builders[0]
    if len(builders) == 1:
        fill_graph(model.graph, "kvedge_decoder", g.nodes, inputs, outputs, g.initializers)
    else:
        two_forms(builders[0], builders[1], interface, inputs, outputs, model.graph)
    # IR 8 is what onnxruntime and TensorRT 8.6+ both read; opset 21 (int4/int8 types) needs IR 10.
    model.ir_version = 8 if graph_opset(options) < 21 else 10
    if g.quant_errors:
        helper.set_model_props(model, {"kvedge.max_quant_error": f"{max(g.quant_errors):.6g}"})
    return model


def fill_graph(
    graph: onnx.GraphProto,
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto],
) -> None:
    """`graph` (empty, inside a model or an attribute) made as helper.make_graph makes one, so
    it is not copied into its place after."""
    graph.name = name
    graph.node.extend(nodes)
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    graph.initializer.extend(initializers)


def two_forms(
    prefill: Builder,
    decode: Builder,
    interface: GraphInterface,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    graph: onnx.GraphProto,
) -> None:
    """`graph` (empty) as one graph running `decode`'s nodes for a step of up to VERIFY_TOKENS
    tokens per row (a decode step, a speculative verify, whose rows the decode form computes as
    decode steps would) and `prefill`'s for longer steps: If(input_ids.shape[1] <= VERIFY_TOKENS).
    A prompt chunk that short runs the decode form too, whose matmuls cost about MatMulNBits' at a
    few rows (both read the weights once). Initializers both forms hold alike (the same name and
    serialized tensor: with the data file, the same bytes at the same offset, `ExternalData`) live
    in the outer graph, each form's own in its branch (onnxruntime fuses DequantizeLinear -> MatMul
    into MatMulNBits only over a branch's own initializers). A branch's values are renamed with
    the form's name, so no name is defined twice; the graph inputs they read are the outer
    graph's."""
    own = {t.name: t for t in decode.initializers}
    shared = {
        t.name
        for t in prefill.initializers
        if t.name in own and own[t.name].SerializeToString() == t.SerializeToString()
    }

    def branch(g: Builder, form: str, into: onnx.GraphProto) -> None:
        made = {out for node in g.nodes for out in node.output if out}
        nodes = []
        for node in g.nodes:
            renamed = onnx.NodeProto()
            renamed.CopyFrom(node)
            renamed.name = f"{node.name}@{form}"
            renamed.input[:] = [f"{v}@{form}" if v in made else v for v in node.input]
            renamed.output[:] = [f"{v}@{form}" if v else v for v in node.output]
            nodes.append(renamed)
        outs = [value_info(t, f"{t.name}@{form}") for t in interface.outputs()]
        locals_ = [t for t in g.initializers if t.name not in shared]
        fill_graph(into, f"kvedge_{form}", nodes, [], outs, locals_)

    ids = interface.names.input_ids
    steps = [
        helper.make_node("Shape", [ids], ["form.step_length"], name="form/Shape", start=1, end=2),  # [1]
        helper.make_node(
            "LessOrEqual", ["form.step_length", "form.decode_tokens"], ["form.is_decode1"], name="form/AtMost"
        ),
        helper.make_node("Squeeze", ["form.is_decode1"], ["form.is_decode"], name="form/Squeeze"),
    ]
    initializers = [t for t in prefill.initializers if t.name in shared]
    initializers.append(numpy_helper.from_array(np.array([VERIFY_TOKENS], np.int64), "form.decode_tokens"))
    fill_graph(graph, "kvedge_decoder", steps, inputs, outputs, initializers)
    choice = graph.node.add(op_type="If", name="form/If")
    choice.input.append("form.is_decode")
    choice.output.extend(t.name for t in interface.outputs())
    # each branch made inside its attribute, in helper.make_node's order (attributes by name)
    for key, g, form in (("else_branch", prefill, "prefill"), ("then_branch", decode, "decode")):
        branch(g, form, choice.attribute.add(name=key, type=onnx.AttributeProto.GRAPH).g)


def all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """`graph` and every graph inside its nodes' attributes (an If's branches), depth first."""
    found = [graph]
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                found += all_graphs(sub)
    return found


def decode_step_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The graphs a decode step runs: `graph` and, of a two-form graph's If, the decode form (the
    then branch, `two_forms`)."""
    found = [graph]
    for node in graph.node:
        if node.op_type == "If":
            then = next(a for a in node.attribute if a.name == "then_branch")
            found += decode_step_graphs(then.g)
    return found


def value_info(tensor: TensorSpec, name: str | None = None) -> onnx.ValueInfoProto:
    """A graph input/output declared as the contract's `GraphInterface` states it (under `name`
    when given: a branch's output)."""
    elem = helper.np_dtype_to_tensor_dtype(tensor.dtype)
    return helper.make_tensor_value_info(name or tensor.name, elem, list(tensor.dims))
