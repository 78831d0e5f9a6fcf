"""Weight-only block quantization for the exported graph (offline; the runtime never quantizes).

Math, per block of `block_size` consecutive input features (rows k of W [K, N]) and output
column n, symmetric signed integers with qmin = -2**(bits-1), qmax = 2**(bits-1) - 1::

    m        = the block's element of largest magnitude, sign kept
    scale    = m / qmin                      (m maps exactly onto qmin; 0 blocks get scale 1)
    q        = clip(round(w / scale), qmin, qmax)
    w_hat    = q * scale                     (what DequantizeLinear computes)

Putting the extreme value on qmin (the side with one more level) gives int4 16 usable levels
instead of 15, as llama.cpp Q4_0 and onnxruntime's MatMulNBits quantizer do.

Graph form (ONNX opset 21): `DequantizeLinear(q [K, N] int4|int8, scale [K/block, N] float32,
axis=0, block_size=block)` feeding `MatMul(x, w_hat)`. onnxruntime fuses that pair into its
4-/8-bit `MatMulNBits` kernel; TensorRT 10 reads it as weight-only quantization. int4 tensors
are packed two per byte, the first element in the low nibble (the ONNX layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kvedge.contract import WEIGHT_FORMATS
from kvedge.errors import KvedgeError

BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class QuantizedWeight:
    q: np.ndarray  # [K, N] int8 holding values in [qmin, qmax]
    scale: np.ndarray  # [K / block_size, N] float32
    bits: int
    block_size: int
    max_error: float  # max |w - w_hat| over the tensor

    def dequantize(self) -> np.ndarray:
        """w_hat [K, N] float32."""
        k, n = self.q.shape
        blocks = self.q.reshape(k // self.block_size, self.block_size, n).astype(np.float32)
        return (blocks * self.scale[:, None, :]).reshape(k, n)


def check_format(weights: str, block_size: int) -> None:
    if weights not in WEIGHT_FORMATS:
        raise KvedgeError(f"--weights {weights!r} is not supported; allowed: {sorted(WEIGHT_FORMATS)}")
    if block_size not in BLOCK_SIZES:
        raise KvedgeError(f"--block-size {block_size!r} is not supported; allowed: {list(BLOCK_SIZES)}")


def quantize_blockwise(w: np.ndarray, bits: int, block_size: int) -> QuantizedWeight:
    """Quantize w [K, N] (K = input features, a multiple of block_size) in blocks along K."""
    k, n = w.shape
    if k % block_size:
        raise KvedgeError(
            f"cannot quantize a [{k}, {n}] weight in blocks of {block_size}: {k} is not a multiple"
        )
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    blocks = w.astype(np.float32).reshape(k // block_size, block_size, n)
    where = np.abs(blocks).argmax(axis=1)[:, None, :]  # [K/bs, 1, N]
    extreme = np.take_along_axis(blocks, where, axis=1)[:, 0, :]  # [K/bs, N], signed
    scale = np.where(extreme == 0, 1.0, extreme / qmin).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, None, :]), qmin, qmax).astype(np.int8)
    hat = q.astype(np.float32) * scale[:, None, :]
    max_error = float(np.abs(hat - blocks).max()) if w.size else 0.0
    return QuantizedWeight(q.reshape(k, n), scale, bits, block_size, max_error)


def pack_int4(q: np.ndarray) -> bytes:
    """Signed 4-bit values (int8 array in [-8, 7]) packed two per byte, first in the low nibble."""
    flat = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def weight_tensor(name: str, qw: QuantizedWeight) -> TensorProto:
    """The quantized integers as an ONNX initializer (INT4 packed, or INT8)."""
    if qw.bits == 4:
        return helper.make_tensor(name, TensorProto.INT4, list(qw.q.shape), pack_int4(qw.q), raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(qw.q), name)
