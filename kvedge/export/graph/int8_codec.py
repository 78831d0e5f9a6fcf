"""The INT8 cache's quantization in graph ops, for the portable graph's attention."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from kvedge.export.graph.builder import Builder


class Int8Codec:
    """The INT8 cache's math in graph ops (`kvedge.quant`: quantize_tokens / dequantize_tokens).

    The codes are computed in float with Div, Round and Clip: the scales are per token at run
    time, which QuantizeLinear (and TensorRT's Q/DQ layers) take only as constants. The int8
    tensors themselves enter and leave the graph only through DequantizeLinear / QuantizeLinear
    with scale 1 and zero point 0, exact for integers in [-127, 127]: TensorRT 10.x's importer
    takes INT8 only as Q/DQ's quantized side (`kvedge.export.trt_compat`), not through Cast,
    Reshape, Split or Slice.
    """

    def __init__(
        self, g: Builder, kv_heads: int, d: int, group_size: int, attend: str, prefix: str = "int8"
    ) -> None:
        self.g, self.groups, self.attend = g, d // group_size, attend
        self.heads = g.ints(kv_heads, kv_heads)  # splits [b, 2 kvh, ...] into K and V
        self.ones = g.ints(*[1] * self.groups)  # splits [b, kvh, groups, A] into groups
        self.widths = g.ints(*[group_size] * self.groups)  # splits [..., d] into channel groups
        # Slice bounds of group j over (cache length, channels): [0, j gs] .. [A, (j + 1) gs]
        self.length_and_channels = g.ints(2, 3)
        self.starts = [g.ints(0, j * group_size) for j in range(self.groups)]
        self.ends = [
            g.op("Concat", [attend, g.ints((j + 1) * group_size)], f"{prefix}.ends_g{j}", axis=0)
            for j in range(self.groups)
        ]
        self.to_groups = g.ints(0, 0, 0, self.groups, group_size)  # [b, kvh, n, d] -> [..., groups, gs]
        self.to_channels = g.ints(0, 0, 0, d)
        self.qmax = g.const(f"{prefix}.qmax", np.array(127.0, np.float32))
        self.qmin = g.const(f"{prefix}.qmin", np.array(-127.0, np.float32))
        self.floor = g.const(f"{prefix}.scale_floor", np.array(2.0**-14, np.float32))
        self.unit = g.const(f"{prefix}.unit_scale", np.array(1.0, np.float32))  # Q/DQ of the codes themselves
        self.zero = g.const(f"{prefix}.zero_point", np.array(0, np.int8))

    def write(self, k: str, v: str, outputs: list[str], name: str) -> tuple[str, str]:
        """New K and V [b, kvh, n, d] float -> the layer's four present outputs (`IONames.present`
        order: K, V codes int8; K, V scales [b, kvh, n, groups] float16). Returns the dequantized
        K and V, i.e. exactly what later reads of the cache give. K and V go through one chain of
        ops (concatenated along heads): at one token per step, per-op overhead is the cost."""
        g = self.g
        both = g.op("Concat", [k, v], f"{name}.kv", axis=1)  # [b, 2 kvh, n, d]
        grouped = g.op("Reshape", [both, self.to_groups], f"{name}.grouped")  # [b, 2 kvh, n, groups, gs]
        absmax = g.reduce("ReduceMax", g.op("Abs", [grouped], f"{name}.abs"), -1, f"{name}.absmax")
        scale = g.op(
            "Max", [g.op("Div", [absmax, self.qmax], f"{name}.raw_scale"), self.floor], f"{name}.s32"
        )
        scale16 = g.op("Cast", [scale], f"{name}.s16", to=TensorProto.FLOAT16)  # [b, 2 kvh, n, groups, 1]
        stored = g.op("Cast", [scale16], f"{name}.stored_scale", to=TensorProto.FLOAT)
        levels = g.op(
            "Clip",
            [
                g.op("Round", [g.op("Div", [grouped, stored], f"{name}.ratio")], f"{name}.round"),
                self.qmin,
                self.qmax,
            ],
            f"{name}.levels",
        )  # integers in [-127, 127], as float
        parts = g.op(
            "Split",
            [g.op("Reshape", [levels, self.to_channels], f"{name}.levels_bhsd"), self.heads],
            f"{name}.levels_kv",
            outputs=2,
            axis=1,
        )  # K, V levels [b, kvh, n, d] float
        for part, output in zip(parts, outputs[:2], strict=True):
            g.op("QuantizeLinear", [part, self.unit, self.zero], f"{name}.codes", outputs=[output])
        g.op(
            "Split",
            [g.op("Squeeze", [scale16, g.ints(-1)], f"{name}.scales"), self.heads],
            f"{name}.scales_kv",
            outputs=outputs[2:],
            axis=1,
        )
        deq = g.op(
            "Reshape", [g.op("Mul", [levels, stored], f"{name}.deq5"), self.to_channels], f"{name}.deq"
        )
        k_deq, v_deq = g.op("Split", [deq, self.heads], f"{name}.deq_kv", outputs=2, axis=1)
        return k_deq, v_deq

    def _past(self, codes: str, scales: str, name: str) -> tuple[list[str], list[str]]:
        """The valid part of a cached tensor, per channel group: codes [b, kvh, max_len, d] int8
        and scales [b, kvh, max_len, groups] float16 -> ([b, kvh, A, group_size] float per group,
        [b, kvh, 1, A] scale per group). The codes are widened by one DequantizeLinear (scale 1),
        then one Slice per group cuts the valid length and the group's channels; the scales are
        folded into the scores (K) and probabilities (V), never multiplied into K/V."""
        g = self.g
        widened = g.op("DequantizeLinear", [codes, self.unit, self.zero], f"{name}.codes")  # [b, kvh, L, d]
        valid = g.op("Slice", [scales, g.ints(0), self.attend, g.ints(2)], f"{name}.scales")
        scale = g.op(
            "Transpose",
            [g.op("Cast", [valid], f"{name}.scale", to=TensorProto.FLOAT)],
            f"{name}.scale_t",
            perm=[0, 1, 3, 2],
        )  # [b, kvh, groups, A]
        if self.groups == 1:
            factors = [scale]
        else:
            factors = g.op("Split", [scale, self.ones], f"{name}.scale_parts", outputs=self.groups, axis=2)
        parts = [
            g.op("Slice", [widened, self.starts[j], self.ends[j], self.length_and_channels], f"{name}.g{j}")
            for j in range(self.groups)
        ]
        return parts, factors

    def past_scores(self, q: str, codes: str, scales: str, name: str) -> str:
        """q [b, kvh, gs, d] against the cached keys -> scores [b, kvh, gs, A] = the sum over
        channel groups of (q_g @ codes_g^T) * scale_g."""
        g = self.g
        keys, factors = self._past(codes, scales, name)
        queries = (
            [q]
            if self.groups == 1
            else g.op("Split", [q, self.widths], f"{name}.q_parts", outputs=self.groups, axis=-1)
        )
        terms = [
            g.op(
                "Mul",
                [
                    g.op(
                        "MatMul",
                        [qj, g.op("Transpose", [kj], f"{name}.g{j}_T", perm=[0, 1, 3, 2])],
                        f"{name}.g{j}_raw",
                    ),
                    sj,
                ],
                f"{name}.g{j}_scores",
            )
            for j, (qj, kj, sj) in enumerate(zip(queries, keys, factors, strict=True))
        ]
        return terms[0] if self.groups == 1 else g.op("Sum", terms, f"{name}.scores")

    def past_context(self, probs: str, codes: str, scales: str, name: str) -> str:
        """probs [b, kvh, gs, A] applied to the cached values -> [b, kvh, gs, d]: per channel
        group (probs * scale_g) @ codes_g, concatenated."""
        g = self.g
        values, factors = self._past(codes, scales, name)
        parts = [
            g.op("MatMul", [g.op("Mul", [probs, sj], f"{name}.g{j}_weighted"), vj], f"{name}.g{j}_context")
            for j, (vj, sj) in enumerate(zip(values, factors, strict=True))
        ]
        return parts[0] if self.groups == 1 else g.op("Concat", parts, f"{name}.context", axis=-1)
