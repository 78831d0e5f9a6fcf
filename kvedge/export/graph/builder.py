"""`Builder`: appends nodes and initializers to one ONNX graph; every op returns its output's name.
Its float type is float16 in a float16 graph, whose float32 islands open with `widen` and close
with `narrow`. Given the graph's data file (`ExternalData`), it writes each large initializer
there as it is made and keeps only where it lies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvedge.export.graph.external import ExternalData


class Builder:
    """Appends nodes and initializers; every op returns the name of its (first) output."""

    def __init__(
        self,
        opset: int,
        side_inputs: bool = False,
        decode_form: bool = False,
        half: bool = False,
        portable: bool = False,
        sink: ExternalData | None = None,
    ) -> None:
        self.opset = opset
        self.side_inputs = side_inputs  # quantized matmuls take their side inputs from kvedge.SideInputs
        # the decode form: quantized matmuls are kvedge.QuantMatMul, quantized onto the float16 scales
        # and minimums it stores (the prefill form keeps float32 ones: exact on a GGUF's grids)
        self.decode_form = decode_form
        # a float16 graph (--precision float16): weights, their scales and the activations between
        # the float32 islands (`widen` ... `narrow`) are float16
        self.half = half
        # a graph TensorRT reads: weight scales > 0 only (`quantize_blockwise`), side weights
        # stored as TensorRT's builder keeps them once (`quant_matmul._side_weight`)
        self.portable = portable
        self.float = np.dtype(np.float16 if half else np.float32)
        self.sink = sink  # the data file large initializers go to as they are made, or None: all inline
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.quant_errors: list[float] = []  # max |w - w_hat| of each quantized weight
        self._count = 0
        self._shared: set[str] = set()

    def op(
        self,
        op_type: str,
        inputs: list[str],
        name: str,
        outputs: int | list[str] = 1,
        **attrs: Any,
    ):
        """Add a node; `outputs` is a count (names derived from `name`) or the output names."""
        self._count += 1
        if isinstance(outputs, list):
            outs = outputs
        else:
            outs = [f"{name}" if outputs == 1 else f"{name}_{i}" for i in range(outputs)]
        node = helper.make_node(op_type, inputs, outs, name=f"{name}/{op_type}_{self._count}", **attrs)
        self.nodes.append(node)
        return outs[0] if len(outs) == 1 else outs

    def const(self, name: str, array: np.ndarray) -> str:
        if self.sink is not None:  # a large array's buffer goes to the data file as it is
            self.initializers.append(self.sink.keep_array(name, array))
            return name
        return self.initializer(numpy_helper.from_array(np.ascontiguousarray(array), name))

    def initializer(self, tensor: onnx.TensorProto) -> str:
        """Add `tensor` (a large one written to the sink, when there is one); returns its name."""
        self.initializers.append(tensor if self.sink is None else self.sink.keep(tensor))
        return tensor.name

    def ints(self, *values: int) -> str:
        """A shared int64 vector constant, e.g. ints(0) -> [0]."""
        name = "const.i64_" + "_".join(str(v) for v in values)
        if name not in self._shared:
            self._shared.add(self.const(name, np.array(values, np.int64)))
        return name

    def merged_heads(self, context: str, heads: int, d: int, name: str) -> str:
        """An attention's context [b, kv_heads, g*s, d], its query heads grouped by KV head, as
        [b, s, heads*d], the heads side by side as the output projection reads them."""
        per_head = self.op(
            "Reshape", [context, self.ints(0, heads, -1, d)], f"{name}.per_head"
        )  # [b, heads, s, d]
        bshd = self.op("Transpose", [per_head], f"{name}.bshd", perm=[0, 2, 1, 3])
        return self.op("Reshape", [bshd, self.ints(0, 0, heads * d)], f"{name}.merged")

    def scalar(self, value: float) -> str:
        """A shared scalar constant in the graph's float type, e.g. scalar(127.0)."""
        name = f"const.{self.float.name}_{value!r}"
        if name not in self._shared:
            self._shared.add(self.fconst(name, np.array(value)))
        return name

    def reduce(self, op_type: str, x: str, axis: int, name: str, keepdims: int = 1) -> str:
        """ReduceMean/ReduceMax over one axis: axes are an attribute before opset 18, an input after."""
        if self.opset < 18:
            return self.op(op_type, [x], name, axes=[axis], keepdims=keepdims)
        return self.op(op_type, [x, self.ints(axis)], name, keepdims=keepdims)

    def fconst(self, name: str, array: np.ndarray) -> str:
        """A float constant in the graph's float type (float16 or float32)."""
        return self.const(name, np.asarray(array).astype(self.float))

    def widen(self, x: str, name: str) -> str:
        """x as float32 under `name`: where a float32 island starts (x itself in a float32 graph)."""
        return self.op("Cast", [x], name, to=TensorProto.FLOAT) if self.half else x

    def narrow(self, x: str, name: str) -> str:
        """x (float32) back in the graph's float type under `name`: where an island ends (x itself
        in a float32 graph)."""
        return self.op("Cast", [x], name, to=TensorProto.FLOAT16) if self.half else x

    @contextlib.contextmanager
    def float32(self) -> Iterator[None]:
        """Ops added inside are a float32 island of a float16 graph as a whole (constants float32,
        `widen` and `narrow` nothing): open it on a `widen`ed input and `narrow` its result after."""
        saved = self.half, self.float
        self.half, self.float = False, np.dtype(np.float32)
        try:
            yield
        finally:
            self.half, self.float = saved

    def transposed_weight(self, name: str, rows: np.ndarray) -> str:
        """`rows` [N, K] as a float weight [K, N] for a MatMul: stored [N, K] behind a Transpose.
        TensorRT for RTX keeps a [K, N] constant twice when the decode profile computes one row
        (the layouts its prefill and its decode kernels read) and one stored [N, K] once
        (docs/PERFORMANCE.md, "TensorRT engine bytes"); a builder that folds the Transpose has
        the constant it had, and onnxruntime folds it at load."""
        stored = self.fconst(f"{name}.rows", np.ascontiguousarray(rows))
        return self.op("Transpose", [stored], name, perm=[1, 0])

    def float_weight(self, name: str, w: np.ndarray, stored_half: bool = False) -> str:
        """`w` as a float weight under `name`: float16 in a float16 graph; float32 in a float32
        graph, or with `stored_half` (--weights float16) stored float16 under `name`.f16 and
        widened by one Cast."""
        if self.half:
            return self.const(name, w.astype(np.float16))
        if not stored_half:
            return self.const(name, w.astype(np.float32))
        stored = self.const(f"{name}.f16", w.astype(np.float16))
        return self.op("Cast", [stored], name, to=TensorProto.FLOAT)
