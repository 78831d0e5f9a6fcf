"""RMSNorm in graph ops: a float32 island in a float16 graph, and, before it, the residual add
(onnxruntime's fused SkipSimplifiedLayerNormalization in the ort variant)."""

from __future__ import annotations

import numpy as np

from kvedge.export.graph.builder import Builder
from kvedge.export.graph.options import MS_DOMAIN


class Norms:
    """The RMSNorms of one graph, sharing their constants."""

    def __init__(self, g: Builder, epsilon: float, fused: bool) -> None:
        self.g = g
        self.fused = fused  # residual adds fused into the next norm (ort graphs)
        self.epsilon = epsilon
        self.two = g.const("const.two", np.array(2.0, np.float32))  # RMSNorm's island: float32
        self.eps = np.array(epsilon, np.float32)

    def rms_norm(self, x: str, weight: np.ndarray, name: str) -> str:
        """A float32 island in a float16 graph, as transformers computes it: activations of a few
        hundred square past float16's 65504. Pow/ReduceMean/Add/Sqrt/Div/Mul: the pattern
        onnxruntime fuses into one norm kernel."""
        g = self.g
        x = g.widen(x, f"{name}.x32")
        sq = g.op("Pow", [x, self.two], f"{name}.sq")
        mean = g.reduce("ReduceMean", sq, -1, f"{name}.mean")
        var = g.op("Add", [mean, g.const(f"{name}.eps", self.eps)], f"{name}.var")
        root = g.op("Sqrt", [var], name + ".rms")
        normed = g.op("Div", [x, root], f"{name}.normed")
        scaled = g.op("Mul", [normed, g.const(f"{name}.weight", weight)], f"{name}.f32" if g.half else name)
        return g.narrow(scaled, name)

    def residual_norm(self, hidden: str, delta: str | None, weight: np.ndarray, name: str) -> tuple[str, str]:
        """(rms_norm(hidden + delta), hidden + delta): onnxruntime's fused op in the ort variant."""
        g = self.g
        if delta is None:
            return self.rms_norm(hidden, weight, name), hidden
        if not self.fused:
            hidden = g.op("Add", [hidden, delta], f"{name}.residual")
            return self.rms_norm(hidden, weight, name), hidden
        normed, _, _, hidden = g.op(
            "SkipSimplifiedLayerNormalization",
            [delta, hidden, g.const(f"{name}.weight", weight)],
            name,
            outputs=[name, "", "", f"{name}.residual"],
            domain=MS_DOMAIN,
            epsilon=self.epsilon,
        )
        return normed, hidden
