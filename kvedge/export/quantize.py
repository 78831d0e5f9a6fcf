"""Weight-only block quantization for the exported graph (offline; the runtime never quantizes).

Three grids (`GRIDS`) per block of `block_size` consecutive input features (rows k of W [K, N])
and output column n, with signed integers qmin = -2**(bits-1), qmax = 2**(bits-1) - 1::

    extreme   m      = the block's element of largest magnitude, sign kept
              scale  = m / qmin                    (m maps exactly onto qmin; 0 blocks get scale 1)
              offset = 0
    absmax    scale  = max |w| / qmax, offset = 0  (llama.cpp Q8_0's grid)
    affine    scale  = (max - min) / (qmax - qmin)  (constant blocks: scale 1)
              offset = min - qmin * scale          (min maps exactly onto qmin, max onto qmax)

    q     = clip(round((w - offset) / scale), qmin, qmax)
    w_hat = q * scale + offset

Putting the extreme on qmin (the side with one more level) gives int4 16 usable levels
instead of 15, as llama.cpp Q4_0 and onnxruntime's MatMulNBits quantizer do. Its scale is
negative where m > 0, which TensorRT refuses (a DequantizeLinear scale must be > 0); graphs it
reads (`positive_scales`) hold such a grid's same values on a positive scale, one level up::

    q s + o = (-q - 1)(-s) + (o - s)   and   qmin <= q <= qmax  iff  qmin <= -q - 1 <= qmax

(-q alone would need qmax + 1), so that block takes an offset of |s|. The affine grid
spans the block's own range, so no level is spent on the side the block does not reach; it is
llama.cpp's Q4_1 / Q8_1 form (a float minimum per block), and on weights that already sit on
such a grid (a Q4_1 GGUF dequantized, SmolLM2's case) it reproduces them exactly at 8 bits and
at 4. `quantize_blockwise` gives each block the grid with the smallest squared error (on
SmolLM2: affine for the projections, absmax for the Q8_0 LM head, which then needs no offset).
An export from a GGUF file quantizes none of the matrices whose blocks fit the graph: it stores
the file's own (`gguf_blocks`; Q4_0's blocks of d < 0 moved onto positive scales by
`positive_blocks`, the same rule as above), so no second rounding is added to the GGUF's.

Graph form (ONNX opset 21): `DequantizeLinear(q [K, N] int4|int8, scale [K/block, N] float32,
axis=0, block_size=block)` feeding `MatMul(x, w_hat)`. onnxruntime fuses that pair into its
4-/8-bit `MatMulNBits` kernel; TensorRT 10 reads it as weight-only quantization. The offset
cannot ride in DequantizeLinear (its zero point is an integer, and TensorRT takes only zero), so
it is a second, small product::

    x @ w_hat = x @ (q * scale) + block_sums(x) @ offset,   block_sums(x) [.., K/block]

Activations: onnxruntime's fused kernel (accuracy level 4, the only fast one: docs/PERFORMANCE.md,
"Quantized weights") also rounds each activation block of
`block_size` to int8 with its own absmax scale, so one large channel coarsens its 31
neighbours. The export measures, on the built-in calibration prompts, the largest |x| of every
input channel of every quantized matmul and keeps the `OUTLIER_CHANNELS` largest in float32
(LLM.int8()'s decomposition): they are zeroed before the int8 kernel and multiplied by their
exact float32 weight rows in the small second product, which now reads::

    x @ w = (x * mask) @ (q * scale) + x @ [B | S] @ [offset ; w[kept] - offset[kept block]]

with x @ B x's block sums [.., K/block] and x @ S its kept channels [.., kept].
Each kept channel costs 4 bytes x N per matmul per token (2 in a float16 graph);
`--outlier-channels` chooses how many (`OUTLIER_CHOICES`; 0 keeps none: no mask, and the second
product holds the offsets only). Portable graphs (TensorRT reads them) make the block sums with a
ReduceSum over x reshaped to [.., K/block, block], the kept channels with a Gather and the mask
with a Mul: no matrix over K is stored. "ort" graphs on the CPU make x * mask and x @ [B | S]
with kvedge's own op `kvedge.SideInputs` (`kvedge/runtime/csrc/kvedge_ops.cc`) in one pass over
x, where a MatMul over the [K, K/block + kept] 0/1 matrix [B | S] would read 25 MB a token on
SmolLM2-135M (`kvedge.contract.kvedge_ops` says which graphs).

int4 tensors are packed two per byte, the first element in the low nibble (the ONNX layout).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from tqdm import tqdm

from kvedge.contract import OUTLIER_CHANNELS
from kvedge.errors import KvedgeError

GRIDS = ("extreme", "absmax", "affine")  # see the module docstring
EXPORT_GRIDS = GRIDS  # what the export offers each block


@dataclass(frozen=True)
class QuantizedWeight:
    q: np.ndarray  # [K, N] int8 holding values in [qmin, qmax]
    scale: np.ndarray  # [K / block_size, N] float32
    offset: np.ndarray | None  # [K / block_size, N] float32; None when every block's offset is 0
    bits: int
    block_size: int
    max_error: float  # max |w - w_hat| over the tensor

    def dequantize(self) -> np.ndarray:
        """w_hat [K, N] float32."""
        k, n = self.q.shape
        blocks = self.q.reshape(k // self.block_size, self.block_size, n).astype(np.float32)
        hat = blocks * self.scale[:, None, :]
        if self.offset is not None:
            hat += self.offset[:, None, :]
        return hat.reshape(k, n)

    def columns(self, index: np.ndarray | slice) -> QuantizedWeight:
        """Output columns `index` of this weight (the Hugging Face weight's rows), each with its
        blocks: blocks run along K, so choosing, reordering or splitting columns is exact."""
        offset = None if self.offset is None else np.ascontiguousarray(self.offset[:, index])
        return QuantizedWeight(
            np.ascontiguousarray(self.q[:, index]),
            np.ascontiguousarray(self.scale[:, index]),
            offset,
            self.bits,
            self.block_size,
            self.max_error,
        )

    def block_rows(self, order: np.ndarray) -> QuantizedWeight:
        """This weight with its input features reordered a block at a time: block i of the
        result is block order[i] of this one (blocks run along K, so whole blocks move exactly)."""
        k, n = self.q.shape
        q = self.q.reshape(k // self.block_size, self.block_size, n)[order].reshape(k, n)
        offset = None if self.offset is None else np.ascontiguousarray(self.offset[order])
        return QuantizedWeight(
            q, np.ascontiguousarray(self.scale[order]), offset, self.bits, self.block_size, self.max_error
        )

    def split(self, block_size: int) -> QuantizedWeight:
        """The same values in blocks of `block_size`, which divides this weight's: each block's
        scale and offset repeated for its parts, the codes unchanged (exact)."""
        if self.block_size % block_size:
            raise ValueError(f"blocks of {self.block_size} do not split into blocks of {block_size}")
        parts = self.block_size // block_size
        if parts == 1:
            return self
        offset = None if self.offset is None else np.repeat(self.offset, parts, axis=0)
        return QuantizedWeight(
            self.q, np.repeat(self.scale, parts, axis=0), offset, self.bits, block_size, self.max_error
        )

    def scaled(self, factor: float) -> QuantizedWeight:
        """w_hat * factor, on the same codes: scale and offset multiplied, exactly where `factor`
        is a power of two (and the products stay normal), else each rounded once."""
        f = np.float32(factor)
        offset = None if self.offset is None else self.offset * f
        return QuantizedWeight(
            self.q, self.scale * f, offset, self.bits, self.block_size, self.max_error * abs(float(f))
        )


def concat_columns(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """`parts` side by side along N ([K, N1 + N2 + ...], a fused projection): each column keeps its
    blocks; a part without offsets takes zero ones where another has some."""
    shown = [(p.bits, p.block_size, p.q.shape[0]) for p in parts]
    first = parts[0]
    if len(set(shown)) > 1:
        raise KvedgeError(f"cannot join weights of (bits, block size, K) {shown}: they must all be alike")
    offsets = None
    if any(p.offset is not None for p in parts):
        offsets = np.concatenate([np.zeros_like(p.scale) if p.offset is None else p.offset for p in parts], 1)
    return QuantizedWeight(
        np.concatenate([p.q for p in parts], axis=1),
        np.concatenate([p.scale for p in parts], axis=1),
        offsets,
        first.bits,
        first.block_size,
        max(p.max_error for p in parts),
    )


def positive_blocks(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` with every scale > 0 and the same values, for graphs TensorRT reads (`positive_scales`):
    a block of scale s < 0 takes codes -q - 1 on scale -s with offset o - s (`_positive`; exact
    where o is 0, as in a GGUF's Q4_0), a block of scale 0 (all of its values its offset) codes 0
    on scale 1. Blocks quantized here are made so (`quantize_blockwise`); a GGUF's may not be."""
    negative, zero = qw.scale < 0, qw.scale == 0  # [K/bs, N]
    if not (negative.any() or zero.any()):
        return qw
    scale, offset = _positive(qw.scale, np.zeros_like(qw.scale) if qw.offset is None else qw.offset)
    flipped = np.repeat(negative, qw.block_size, axis=0)  # [K, N]
    q = np.where(flipped, -qw.q.astype(np.int16) - 1, qw.q)
    q = np.where(np.repeat(zero, qw.block_size, axis=0), 0, q).astype(np.int8)
    scale = np.where(zero, 1.0, scale).astype(np.float32)
    return QuantizedWeight(q, scale, offset if offset.any() else None, qw.bits, qw.block_size, qw.max_error)


def _grid(blocks: np.ndarray, grid: str, qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset), each [K/bs, N] float32, of one grid for blocks [K/bs, bs, N]."""
    zero = np.zeros((blocks.shape[0], blocks.shape[2]), np.float32)
    if grid == "extreme":
        where = np.abs(blocks).argmax(axis=1)[:, None, :]  # [K/bs, 1, N]
        extreme = np.take_along_axis(blocks, where, axis=1)[:, 0, :]  # [K/bs, N], signed
        return np.where(extreme == 0, 1.0, extreme / qmin).astype(np.float32), zero
    if grid == "absmax":
        top = np.abs(blocks).max(axis=1)
        return np.where(top == 0, 1.0, top / qmax).astype(np.float32), zero
    low, high = blocks.min(axis=1), blocks.max(axis=1)
    scale = np.where(high == low, 1.0, (high - low) / (qmax - qmin)).astype(np.float32)
    return scale, (low - qmin * scale).astype(np.float32)


# values of w quantized at once (`quantize_blockwise`): 16 MiB of float32, whose temporaries (the
# blocks, each grid's codes and errors) stay near 100 MiB however large w is
CHUNK_VALUES = 1 << 22


def quantize_blockwise(
    w: np.ndarray,
    bits: int,
    block_size: int,
    grids: tuple[str, ...] = ("extreme",),
    half_params: bool = False,
    positive_scales: bool = False,
    chunk_values: int = CHUNK_VALUES,
) -> QuantizedWeight:
    """Quantize w [K, N] (K = input features, a multiple of block_size) in blocks along K, each
    block on whichever of `grids` gives it the smallest squared error (the first on a tie).
    `half_params`: each block's scale and minimum (offset + qmin * scale, the value of qmin) are
    float16 numbers, as kvedge.QuantMatMul stores them (`pack_quant_matmul`), and the codes are
    chosen on that grid. `positive_scales`: every scale > 0, for TensorRT, whose importer
    refuses a DequantizeLinear scale <= 0; a grid of negative scale (the extreme grid's m / qmin
    where m > 0) is offered as the same values on its positive scale with one level of offset
    (`_positive`), so each block keeps the error it has without the constraint.

    Columns are independent (blocks run along K), so w is quantized a few columns at a time,
    about `chunk_values` values each, into the result's arrays: an LM head of 311M values (Qwen3's)
    then holds no full-size float32 temporary beside w (the same codes at any chunk size)."""
    k, n = w.shape
    if k % block_size:
        raise KvedgeError(
            f"cannot quantize a [{k}, {n}] weight in blocks of {block_size}: {k} is not a multiple"
        )
    if not grids or set(grids) - set(GRIDS):
        raise KvedgeError(f"quantization grids {grids!r} are not supported; allowed: {list(GRIDS)}")
    q = np.empty((k, n), np.int8)
    scale = np.empty((k // block_size, n), np.float32)
    offset = np.empty((k // block_size, n), np.float32)
    max_error = 0.0
    step = max(1, chunk_values // max(k, 1))
    for start in range(0, n, step):
        part = slice(start, min(n, start + step))
        codes, scale[:, part], offset[:, part], error = _quantize_columns(
            w[:, part], bits, block_size, grids, half_params, positive_scales
        )
        q[:, part] = codes
        max_error = max(max_error, error)
    return QuantizedWeight(q, scale, offset if offset.any() else None, bits, block_size, max_error)


def _quantize_columns(
    w: np.ndarray, bits: int, block_size: int, grids: tuple[str, ...], half: bool, positive: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """`quantize_blockwise` of w [K, n] (`half`: half_params, `positive`: positive_scales): codes
    int8 [K, n], scale and offset [K/bs, n], and max |w - w_hat|."""
    k, n = w.shape
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    blocks = w.astype(np.float32).reshape(k // block_size, block_size, n)
    best: tuple[np.ndarray, ...] | None = None  # (q, scale, offset, squared error [K/bs, n])
    for grid in grids:
        scale, offset = _grid(blocks, grid, qmin, qmax)
        if positive:
            scale, offset = _positive(scale, offset)
        if half:
            scale, offset = _half_grid(scale, offset, qmin)
        q = np.clip(np.rint((blocks - offset[:, None, :]) / scale[:, None, :]), qmin, qmax)
        err = np.square(q * scale[:, None, :] + offset[:, None, :] - blocks).sum(axis=1)
        if best is None:
            best = (q, scale, offset, err)
            continue
        better = err < best[3]
        best = (
            np.where(better[:, None, :], q, best[0]),
            np.where(better, scale, best[1]),
            np.where(better, offset, best[2]),
            np.minimum(err, best[3]),
        )
    q, scale, offset, _ = best
    hat = q * scale[:, None, :] + offset[:, None, :]
    max_error = float(np.abs(hat - blocks).max()) if w.size else 0.0
    return q.astype(np.int8).reshape(k, n), scale.astype(np.float32), offset.astype(np.float32), max_error


def _positive(scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) [K/bs, N] with every scale > 0 and the same levels: where s < 0, code q's
    value q s + o is code (-q - 1)'s on scale -s with offset o - s (the module docstring)."""
    return np.abs(scale), np.where(scale < 0, offset - scale, offset).astype(np.float32)


def _half_grid(scale: np.ndarray, offset: np.ndarray, qmin: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) moved onto float16 scales and minimums (float16 cannot hold a scale over
    65504; a block that needs one is refused)."""
    with np.errstate(over="ignore"):
        scale16 = np.maximum(scale.astype(np.float16), np.float16(2.0**-24))  # 0 would divide
        minimum16 = (offset + qmin * scale).astype(np.float16)
    if not (np.isfinite(scale16).all() and np.isfinite(minimum16).all()):
        raise KvedgeError(
            f"a weight block needs a scale or minimum beyond float16's range (largest scale "
            f"{float(np.abs(scale).max()):.6g}, allowed up to 65504)"
        )
    scale = scale16.astype(np.float32)
    return scale, (minimum16.astype(np.float32) - qmin * scale).astype(np.float32)


@dataclass(frozen=True)
class QuantMatMulWeight:
    """A QuantizedWeight in kvedge.QuantMatMul's layout (kvedge/runtime/csrc/kvedge_ops.cc): one
    stream, tile after tile of 64 output columns, each tile one contiguous run of its records (one
    per block of `bs` input channels, in order) and then its kept channels' rows, so a step reads
    each matrix front to back once.

        weights  uint8 [N/64, tile_bytes], tile_bytes = (K/bs) record + 128 kept:
                 K/bs records, each
                   codes     4 groups of 16 columns x (bs bits / 8) vectors of 64 bytes
                   scales    64 float16
                   minimums  64 float16 (only when `has_minimums`)
                 then kept rows, each 64 float16 (the tile's columns of one kept channel's row,
                 in kept order)
                 codes u = q - qmin (0 .. 2**bits - 1); in vector v of group g, byte 4 c + t holds
                 column 16 g + c's codes:  4 bits: u[8v + t] (low nibble) and u[8v + 4 + t] (high
                 nibble);  8 bits: u[4v + t]. w_hat = scale * (u + qmin) + offset, where
                 offset = minimum - qmin * scale (0 without minimums).
    """

    weights: np.ndarray
    has_minimums: bool


def pack_quant_matmul(qw: QuantizedWeight, kept_rows: np.ndarray | None = None) -> QuantMatMulWeight:
    """`qw` (quantized with `half_params`; N a multiple of 64) in kvedge.QuantMatMul's layout, with
    `kept_rows` [kept, N] (the kept channels' rows of w less their block's offset) stored float16
    at the end of each tile."""
    k, n = qw.q.shape
    bs, qmin = qw.block_size, -(2 ** (qw.bits - 1))
    if n % 64:
        raise KvedgeError(f"kvedge.QuantMatMul takes N in multiples of 64 columns, not {n}")
    tiles, blocks = n // 64, k // bs

    def per_tile(a: np.ndarray) -> np.ndarray:  # [K/bs, N] float -> [N/64, K/bs, 128] bytes
        half = a.astype(np.float16).reshape(blocks, tiles, 64).transpose(1, 0, 2)
        return np.ascontiguousarray(half).view(np.uint8)

    u = (qw.q.astype(np.int16) - qmin).astype(np.uint8)  # [K, N]
    u = u.reshape(blocks, bs, tiles, 4, 16).transpose(2, 0, 3, 1, 4)  # [N/64, K/bs, 4, bs, 16]
    if qw.bits == 4:  # k = 8v + 4h + t -> byte (v, c, t): low nibble h = 0, high h = 1
        u = u.reshape(tiles, blocks, 4, bs // 8, 2, 4, 16).transpose(0, 1, 2, 3, 6, 4, 5)
        codes = u[..., 0, :] | (u[..., 1, :] << 4)  # [N/64, K/bs, 4, bs/8, 16, 4]
    else:  # k = 4v + t -> byte (v, c, t)
        codes = u.reshape(tiles, blocks, 4, bs // 4, 4, 16).transpose(0, 1, 2, 3, 5, 4)
    parts = [codes.reshape(tiles, blocks, -1), per_tile(qw.scale)]
    if qw.offset is not None:
        parts.append(per_tile(qw.offset + qmin * qw.scale))
    records = np.concatenate(parts, axis=2).reshape(tiles, -1)  # [N/64, K/bs record]
    kept = np.zeros((0, n), np.float16) if kept_rows is None else kept_rows.astype(np.float16)  # [kept, N]
    tails = np.ascontiguousarray(kept.reshape(len(kept), tiles, 64).transpose(1, 0, 2))  # [N/64, kept, 64]
    weights = np.concatenate([records, tails.view(np.uint8).reshape(tiles, -1)], axis=1)
    return QuantMatMulWeight(np.ascontiguousarray(weights), qw.offset is not None)


def pack_int4(q: np.ndarray, chunk_values: int = CHUNK_VALUES) -> bytes:
    """Signed 4-bit values (int8 array in [-8, 7]) packed two per byte, first in the low nibble
    (two's complement: a value's low 4 bits), `chunk_values` values at a time."""
    flat = np.ascontiguousarray(q).reshape(-1).view(np.uint8)
    packed = np.empty((flat.size + 1) // 2, np.uint8)
    step = max(2, chunk_values - chunk_values % 2)
    for start in range(0, flat.size, step):
        part = flat[start : start + step] & np.uint8(0xF)
        if part.size % 2:
            part = np.append(part, np.uint8(0))
        packed[start // 2 : start // 2 + part.size // 2] = part[0::2] | (part[1::2] << np.uint8(4))
    return packed.tobytes()


def weight_tensor(name: str, qw: QuantizedWeight) -> TensorProto:
    """The quantized integers as an ONNX initializer (INT4 packed, or INT8)."""
    if qw.bits == 4:
        return helper.make_tensor(name, TensorProto.INT4, list(qw.q.shape), pack_int4(qw.q), raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(qw.q), name)


def calibration_ids(tokenizer: Any, max_tokens: int = 256) -> list[list[int]]:
    """Token ids of kvedge's built-in calibration prompts (chat turns), for `input_outliers`."""
    text = resources.files("kvedge.calibrate").joinpath("data/calibration.jsonl").read_text()
    ids = []
    for line in filter(str.strip, text.splitlines()):
        messages = json.loads(line)["messages"]
        if getattr(tokenizer, "chat_template", None):
            row = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        else:
            row = tokenizer(" ".join(m["content"] for m in messages)).input_ids
        ids.append(list(row)[:max_tokens])
    return ids


# tokens per calibration batch: its prompts run together, right-padded (`input_outliers`)
CALIBRATION_BATCH_TOKENS = 4096


def input_outliers(
    model: Any,
    token_ids: list[list[int]],
    channels: int = OUTLIER_CHANNELS,
    weights: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """{Linear module name: its `channels` input channels of largest max |x| over `token_ids`,
    ascending [channels] int64}, from float32 forward passes of the Hugging Face `model`; the LM
    head's ("lm_head") from the decoder's output. Prompts run in batches of up to
    CALIBRATION_BATCH_TOKENS tokens, right-padded, the padding left out of every maximum (a causal
    model's real tokens never see it). A skeleton `model` (`kvedge.export.streamed`) reads each
    block's `weights` as it runs them."""
    import torch

    from kvedge.export.streamed import streaming

    peaks: dict[str, torch.Tensor] = {}  # name -> [in_features] max |x|
    real: list[torch.Tensor] = []  # [b, s] bool: the running batch's real tokens

    def fold(name: str, x: torch.Tensor) -> None:
        if tuple(x.shape[:2]) != tuple(real[0].shape):
            raise KvedgeError(f"calibration: {name} reads {list(x.shape)}, not [batch, tokens, ...]")
        peak = x.detach()[real[0]].abs().reshape(-1, x.shape[-1]).amax(dim=0)
        peaks[name] = torch.maximum(peaks[name], peak) if name in peaks else peak

    decoder = getattr(model, model.base_model_prefix)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    handles = [m.register_forward_pre_hook(lambda _, args, n=n: fold(n, args[0])) for n, m in linears]
    head = isinstance(getattr(model, "lm_head", None), torch.nn.Linear)
    # minutes at a billion parameters: the bar moves a decoder layer of a batch at a time
    batches = list(calibration_batches(token_ids))
    layers = _decoder_layers(decoder)
    bar = tqdm(total=len(batches) * max(len(layers), 1), desc="export channel calibration", unit="layer")

    def step(*_: Any) -> None:  # a forward hook's non-None return would replace the layer's output
        bar.update(1)

    handles += [layer.register_forward_hook(step) for layer in layers]
    try:
        with torch.no_grad(), streaming(model, weights) if weights is not None else contextlib.nullcontext():
            for i, (ids, mask) in enumerate(batches):
                bar.set_postfix_str(f"batch {i + 1}/{len(batches)}, {len(ids)} prompts")
                real[:] = [mask.bool()]
                hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
                if head:
                    fold("lm_head", hidden)
                if not layers:
                    bar.update(1)
    finally:
        bar.close()
        for handle in handles:
            handle.remove()
    return {
        name: np.sort(torch.topk(peak, min(channels, peak.numel())).indices.numpy()).astype(np.int64)
        for name, peak in peaks.items()
    }


def _decoder_layers(decoder: Any) -> list[Any]:
    """The decoder's layers (its ModuleList named "layers", a composite's text model's too), in
    order; [] where it has none."""
    import torch

    for name, module in decoder.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return list(module)
    return []


def calibration_batches(token_ids: list[list[int]]) -> Iterator[tuple[Any, Any]]:
    """(ids [b, s] int64, attention mask [b, s] int64) batches of the prompts, longest first,
    each right-padded to its longest and of at most CALIBRATION_BATCH_TOKENS tokens (padded)."""
    import torch

    rows = sorted((ids for ids in token_ids if ids), key=len, reverse=True)
    while rows:
        width = len(rows[0])
        take = max(1, CALIBRATION_BATCH_TOKENS // width)
        batch, rows = rows[:take], rows[take:]
        ids = torch.zeros((len(batch), width), dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for r, row in enumerate(batch):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(row)] = 1
        yield ids, mask
