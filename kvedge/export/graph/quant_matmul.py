"""Weight matmuls with blocked integer weights (`quantize.py`): DequantizeLinear -> MatMul, the
blocks' offsets and the kept float32 channels in a small second product (its inputs made by
kvedge.SideInputs or by standard ops), or one kvedge.QuantMatMul in the decode form. The blocks
are a source's own where the export keeps them (`weights.SourceBlocks`), else quantized here.
"""

from __future__ import annotations

import numpy as np

from kvedge.contract import KVEDGE_OPS_DOMAIN, QUANT_MATMUL_OP, SIDE_INPUTS_OP
from kvedge.export.graph.builder import Builder
from kvedge.export.quantize import (
    EXPORT_GRIDS,
    QuantizedWeight,
    pack_quant_matmul,
    positive_blocks,
    quantize_blockwise,
    weight_tensor,
)


def matmul_weight(
    g: Builder,
    x: str,
    w: np.ndarray,
    out: str,
    bits: int,
    block_size: int,
    keep: np.ndarray | None = None,
    rank: int = 3,
    blocks: QuantizedWeight | None = None,
) -> str:
    """x @ w for w [K, N], stored float32 or as blocked integers behind DequantizeLinear: `blocks`
    (w's own from the source, `block_weight`) or w quantized here; the blocks' offsets and the
    float32 input channels `keep` [kept] (their rows taken from w) ride in one small second
    product (see `quantize.py`), whose input [x's block sums | x[keep]] and the masked x are
    made by kvedge.SideInputs in one pass over x, or by standard ops (`side_inputs` unset) on x
    of `rank` (3: [b, s, K]; 2: [rows, K])."""
    if bits == 32:
        return g.op("MatMul", [x, g.const(f"{out}.weight", w)], out)
    qw = block_weight(g, w, bits, block_size, blocks)
    g.quant_errors.append(qw.max_error)
    keep = np.zeros(0, np.int64) if keep is None else keep.astype(np.int64)  # [kept]
    if g.decode_form and w.shape[1] % 64 == 0:
        return _quant_matmul(g, x, w, qw, out, keep)
    g.initializer(weight_tensor(f"{out}.weight_q", qw))
    scale = g.fconst(f"{out}.weight_scale", qw.scale)  # its type is DequantizeLinear's output's
    deq = g.op("DequantizeLinear", [f"{out}.weight_q", scale], f"{out}.weight", axis=0, block_size=block_size)
    rows: list[np.ndarray] = []  # [*, N] the second product's weights
    if qw.offset is not None:
        rows.append(qw.offset)
    if keep.size:
        rows.append(w[keep] - _kept_offsets(qw, keep))
    if not rows:
        return _product(g, x, deq, w.shape[0], block_size, out, rank)
    if g.side_inputs:
        made = g.op(
            SIDE_INPUTS_OP,
            [x, g.const(f"{out}.kept", keep)],
            f"{out}.side",
            outputs=[f"{out}.side", f"{out}.masked"] if keep.size else [f"{out}.side"],
            domain=KVEDGE_OPS_DOMAIN,
            block_size=block_size if qw.offset is not None else 0,
        )
        side, quantized_in = made if keep.size else (made, x)
    else:
        side, quantized_in = _side_inputs(
            g, x, w.shape[0], out, block_size, qw.offset is not None, keep, rank
        )
    scaled = _product(g, quantized_in, deq, w.shape[0], block_size, f"{out}.scaled", rank)
    shift = g.op("MatMul", [side, _side_weight(g, np.concatenate(rows), out)], f"{out}.shift")
    return g.op("Add", [scaled, shift], out)


def _product(g: Builder, x: str, deq: str, k: int, block_size: int, out: str, rank: int) -> str:
    """x @ deq (the dequantized weight [K, N]). In a float32 portable graph, x is first split in
    two parts that onnxruntime's int8 activations hold: a = x rounded per block of `block_size`
    onto the int8 grid the CPU kernel would use (its absmax / 127), exact on that grid again, and
    the remainder b = x - a, which the kernel rounds at 1/127 of x's rounding error. Both go
    through one product as rows [2, .., K] summed after it: weight-only quantization again on the
    CPU (float activations computed exactly as TensorRT computes them: a + b = x), where the
    fused kernel alone rounds every activation block to int8 and tips near-tied answers
    (docs/PERFORMANCE.md, "Activations of portable quantized graphs"). Twice the rows cost a
    prompt about twice its matmul time and a decode step little (it reads the weights once)."""
    if not g.portable or g.half:
        return g.op("MatMul", [x, deq], out)
    blocks = g.op("Reshape", [x, g.ints(*[0] * (rank - 1), k // block_size, block_size)], f"{out}.act_blocks")
    amax = g.reduce("ReduceMax", g.op("Abs", [blocks], f"{out}.act_abs"), -1, f"{out}.act_amax")
    step = g.op("Div", [amax, g.scalar(127.0)], f"{out}.act_step")
    step = g.op("Max", [step, g.scalar(1e-30)], f"{out}.act_step_pos")
    codes = g.op("Round", [g.op("Div", [blocks, step], f"{out}.act_scaled")], f"{out}.act_codes")
    on_grid = g.op("Mul", [codes, step], f"{out}.act_on_grid")
    a = g.op("Reshape", [on_grid, g.op("Shape", [x], f"{out}.act_shape")], f"{out}.act_a")
    b = g.op("Sub", [x, a], f"{out}.act_b")
    first = g.ints(0)
    parts = [g.op("Unsqueeze", [part, first], f"{out}.act_{n}_row") for n, part in (("a", a), ("b", b))]
    rows = g.op("Concat", parts, f"{out}.act_parts", axis=0)  # [2, .., K]
    return g.reduce("ReduceSum", g.op("MatMul", [rows, deq], f"{out}.parts"), 0, out, keepdims=0)


def _kept_offsets(qw: QuantizedWeight, keep: np.ndarray) -> np.ndarray:
    """The block offsets [kept, N] of input channels `keep` (0 where the weight has none)."""
    if qw.offset is None:
        return np.zeros((keep.size, qw.q.shape[1]), np.float32)
    return qw.offset[keep // qw.block_size]


def _side_weight(g: Builder, rows: np.ndarray, out: str) -> str:
    """The second product's weight `rows` [*, N] as the MatMul's input. Portable graphs store it
    [N, *] behind a Transpose: TensorRT for RTX's builder then keeps one copy for both
    optimization profiles, where it stores a [*, N] constant twice, in the layouts its prefill and
    its decode kernels read (docs/PERFORMANCE.md, "TensorRT engine bytes"); the product is the
    same, and a builder that folds the Transpose has the constant it had. The LM head's too: the
    runtime reads its embedding rows in either layout (`EmbeddingTable.side`)."""
    if not g.portable:
        return g.fconst(f"{out}.side_weight", rows)
    stored = g.fconst(f"{out}.side_weight", np.ascontiguousarray(rows.T))  # [N, *]
    return g.op("Transpose", [stored], f"{out}.side_rows", perm=[1, 0])  # [*, N]


def block_weight(
    g: Builder, w: np.ndarray, bits: int, block_size: int, blocks: QuantizedWeight | None = None
) -> QuantizedWeight:
    """The blocks the graph stores for w [K, N]: `blocks` (the source's own, kept as they are) with
    every scale > 0 where the graph needs it (`positive_blocks`), else w quantized here.

    A float16 graph keeps the float32 graph's codes, its scales and offsets rounded to float16
    when stored (`fconst`), relative 2**-11 like any float16 weight. The decode form
    (kvedge.QuantMatMul) stores float16 scales and minimums: it quantizes w onto such a grid, and
    stores a source's blocks as they are where they have one (a GGUF's Q4_0, Q4_1 and Q8_0: d is
    a float16), else with their scales and minimums rounded to float16."""
    if blocks is not None:
        return positive_blocks(blocks) if g.portable else blocks
    return quantize_blockwise(
        w,
        bits,
        block_size,
        EXPORT_GRIDS,
        half_params=g.decode_form,
        positive_scales=g.portable,
    )


def _quant_matmul(g: Builder, x: str, w: np.ndarray, qw: QuantizedWeight, out: str, keep: np.ndarray) -> str:
    """x @ w as one kvedge.QuantMatMul (the decode form; `quantize.QuantMatMulWeight`): the
    block offsets and the kept channels' float rows (w[kept] less their block's offset, float16
    at the end of each tile's records) ride in the op, read in the same pass as the codes."""
    rows = w[keep] - _kept_offsets(qw, keep)  # [kept, N]
    packed = pack_quant_matmul(qw, rows)
    inputs = [x, g.const(f"{out}.qmm_weights", packed.weights)]
    if keep.size:
        inputs.append(g.const(f"{out}.kept", keep))
    return g.op(
        QUANT_MATMUL_OP,
        inputs,
        out,
        domain=KVEDGE_OPS_DOMAIN,
        bits=qw.bits,
        block_size=qw.block_size,
        minimums=int(packed.has_minimums),
    )


def _side_inputs(
    g: Builder, x: str, k: int, out: str, block_size: int, offsets: bool, keep: np.ndarray, rank: int
) -> tuple[str, str]:
    """kvedge.SideInputs' outputs (side, masked x) from standard ops, none of them a matrix over
    K: x's block sums (when the weight has `offsets`) from a ReduceSum over x reshaped to
    [.., K/block, block], then x's kept channels gathered, concatenated; and x times a 0/1 mask.
    `rank`: x's rank (3 for [b, s, K], 2 for the LM head's [rows, K])."""
    parts: list[str] = []  # [.., *] the side input's columns
    if offsets:
        shape = g.ints(*[0] * (rank - 1), k // block_size, block_size)
        blocks = g.op("Reshape", [x, shape], f"{out}.blocks")
        parts.append(g.reduce("ReduceSum", blocks, -1, f"{out}.block_sums", keepdims=0))
    quantized_in = x
    if keep.size:
        mask = np.ones(k, np.float32)
        mask[keep] = 0.0
        quantized_in = g.op("Mul", [x, g.fconst(f"{out}.int8_mask", mask)], f"{out}.masked")
        parts.append(g.op("Gather", [x, g.const(f"{out}.kept", keep)], f"{out}.kept_x", axis=-1))
    side = parts[0] if len(parts) == 1 else g.op("Concat", parts, f"{out}.side", axis=-1)
    return side, quantized_in
