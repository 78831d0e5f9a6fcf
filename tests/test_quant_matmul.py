"""kvedge.QuantMatMul, the decode step's matmul over blocked 4-/8-bit weights with the block
minimums and the kept float channels fused in (`kvedge/runtime/csrc/kvedge_ops.cc`, layout:
`kvedge.export.quantize.pack_quant_matmul`): every vector path against the scalar path and the
formula in double precision (the C++ self-test, built for AVX-512 VNNI, AVX2 with and without
AVX-VNNI, plain x86-64 and, under qemu, a Jetson Orin's NEON), and the op in onnxruntime on
weights from `quantize_blockwise(half_params=True)` against numpy: the op's formula in float64
(1e-5 of max |y|: float summation order only) and x @ w_hat within the int8 activations' error.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_kv_int8 import NEEDS_AARCH64, SELFTEST, build_and_run_selftest, run_selftest

from kvedge.export.quantize import pack_quant_matmul, quantize_blockwise
from kvedge.runtime import kernels

QMM_OP = "QuantMatMul"
QMM_CASES = 441  # csrc/selftest.cc's `qmm` cases
NEEDS_GXX = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")


def check_selftest(out: str, path: str) -> None:
    assert out.count("ok  ") == QMM_CASES and "FAIL" not in out
    assert out.count(f"quant matmul ({path})") == QMM_CASES  # the path meant, not a fallback


@SELFTEST
@NEEDS_GXX
def test_quant_matmul_selftest_native(selftests):
    """This machine's vector path (AVX2 on CI's CPU) and the scalar path against the formula in
    double precision: bits 4 and 8, blocks of 16 to 256, 1, 2, 3, 5, 6 and 8 rows (tiles of 1 to
    4 rows), 0, 1, 2, 3, 5, 7 and 32 kept channels, with and without minimums, N of 1 to 32
    tiles, items of the op's size and of 1, 3 and 5 tiles on 2 and 3 threads."""
    out = run_selftest(selftests, "qmm")
    assert out.count("ok  ") == QMM_CASES and "FAIL" not in out


def cpu_flags() -> set[str]:
    """This x86 CPU's feature flags (empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not cpuinfo.exists():
        return set()
    return set(
        next(
            (
                line.split(":")[1].split()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    )


@SELFTEST
@NEEDS_GXX
@pytest.mark.parametrize(
    "flags, needs, path",
    [
        (["-march=haswell"], "avx2", "avx2"),  # vpmaddubsw: 8-bit codes as two nibbles (int16 saturation)
        (["-march=haswell", "-mavxvnni"], "avx_vnni", "avx2-vnni"),
        (["-march=x86-64"], "sse2", "scalar"),
    ],
)
def test_quant_matmul_selftest_other_x86_paths(selftests, flags, needs, path):
    """The AVX2 paths and the scalar-only build, where this CPU runs them."""
    if needs not in cpu_flags() or "avx2" not in cpu_flags():
        pytest.skip(f"this CPU lacks {needs} (or is no x86-64 with AVX2)")
    out = build_and_run_selftest(["g++", *flags], [], selftests, ("qmm",))
    check_selftest(out, path)


@SELFTEST
@NEEDS_AARCH64
def test_quant_matmul_selftest_neon(selftests):
    """sdot (s8 x s8): 8-bit codes centred by xor 0x80, 4-bit ones less zc times the block's sum of
    xq; built for a Jetson Orin's CPU and run under qemu."""
    check_selftest(run_selftest(selftests, "qmm", orin=True), "neon-dotprod")


def make_weight(k: int, n: int, bits: int, block: int, minimums: bool, n_kept: int, seed: int = 0):
    """(initializers {name: array}, w_eff [K, N] float64, parts for the formula): a random weight
    quantized as the export does (`half_params`; the affine grid gives minimums, absmax none),
    kept channels spread over [0, K) with their rows w[kept] - offset as float16. w_eff is what
    the op multiplies by: w_hat = scale q + offset (offset from the float16 minimum in float32),
    the kept rows replaced by offset + the float16 kept rows (stored at the end of each tile)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05 + (0.02 if minimums else 0.0)
    qw = quantize_blockwise(w, bits, block, ("affine",) if minimums else ("absmax",), half_params=True)
    zc = 2 ** (bits - 1)
    kept = np.sort(rng.choice(k, n_kept, replace=False)).astype(np.int64)
    scale = qw.scale  # [K/bs, N] float32 holding float16 values
    offset = np.zeros_like(scale)  # [K/bs, N] float32
    if minimums:
        minimum = (qw.offset - zc * qw.scale).astype(np.float16)  # what the records hold
        offset = minimum.astype(np.float32) + np.float32(zc) * scale
    kept_rows = (w[kept] - offset[kept // block]).astype(np.float16)  # [kept, N]
    packed = pack_quant_matmul(qw, kept_rows)
    assert packed.has_minimums == minimums
    record = 8 * block * bits + (256 if minimums else 128)
    assert packed.weights.shape == (n // 64, k // block * record + 128 * n_kept)
    tails = packed.weights[:, k // block * record :].view(np.float16)  # [N/64, kept * 64]
    np.testing.assert_array_equal(
        tails.reshape(n // 64, n_kept, 64).transpose(1, 0, 2).reshape(n_kept, n), kept_rows
    )
    q = qw.q.astype(np.float64)  # [K, N]
    w_eff = (q.reshape(k // block, block, n) * scale[:, None] + offset[:, None]).reshape(k, n)
    np.testing.assert_allclose(w_eff, qw.dequantize(), rtol=0, atol=1e-6)
    w_eff[kept] = offset[kept // block] + kept_rows
    inits = {"weights": packed.weights}
    if n_kept:
        inits["kept"] = kept
    parts = (q, scale.astype(np.float64), offset.astype(np.float64), kept, kept_rows.astype(np.float64))
    return inits, w_eff, parts


def qmm_session(
    k: int, inits: dict, bits: int, block: int, minimums: int, threads: int = 1
) -> ort.InferenceSession:
    """One kvedge.QuantMatMul node on x [b, s, K] and the initializers `inits`."""
    inputs = ["x", "weights"] + (["kept"] if "kept" in inits else [])
    node = helper.make_node(
        QMM_OP, inputs, ["y"], domain="kvedge", bits=bits, block_size=block, minimums=int(minimums)
    )
    graph = helper.make_graph(
        [node],
        "qmm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, name) for name, a in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("kvedge", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(kernels.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def quantize_rows(x: np.ndarray, block: int, kept: np.ndarray) -> tuple[np.ndarray, ...]:
    """The op's activations of x [M, K] float32: (xq [M, K], xs [M, K/bs], bsum [M, K/bs]) float64,
    xq rounded half to even in float32 arithmetic exactly as the op does it."""
    m, k = x.shape
    masked = x.copy()
    masked[:, kept] = 0.0
    blocks = masked.reshape(m, k // block, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)  # [M, K/bs, 1] float32
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    xq = np.rint(blocks * inverse).reshape(m, k)
    bsum = x.astype(np.float64).reshape(m, k // block, block).sum(-1)
    return xq.astype(np.float64), (amax[..., 0] / np.float32(127.0)).astype(np.float64), bsum


def formula(x: np.ndarray, block: int, parts) -> tuple[np.ndarray, np.ndarray]:
    """(y [M, N] of the op's formula in float64, the int8 activations' error bound [M, N])."""
    q, scale, offset, kept, kept_rows = parts
    k, n = q.shape
    xq, xs, bsum = quantize_rows(x, block, kept)
    m = x.shape[0]
    blocks = q.reshape(k // block, block, n)
    dot = np.einsum("mbk,bkn->mbn", xq.reshape(m, k // block, block), blocks)  # centred: codes - zc
    y = (scale * xs[..., None] * dot + offset * bsum[..., None]).sum(1)
    y += x[:, kept].astype(np.float64) @ kept_rows
    # rounding x to xs * xq moves each channel by at most half a level, xs / 2, times the part of
    # its weight that goes through xq, |scale q| (the offset goes through the exact bsum)
    bound = np.einsum("mb,bn->mn", xs / 2, np.abs(scale[:, None, :] * blocks).sum(1))
    return y, bound


CASES = [  # bits, block_size, K, N, minimums, kept
    (4, 32, 576, 960, True, 32),  # SmolLM2-135M's q/k/v projection
    (8, 32, 576, 1024, False, 32),  # its LM head's form, narrower
    (4, 16, 128, 64, True, 1),
    (8, 64, 256, 128, True, 0),
    (4, 128, 384, 64, False, 7),
    (8, 256, 512, 192, True, 3),
]


@pytest.mark.parametrize("bits, block, k, n, minimums, n_kept", CASES)
def test_quant_matmul_matches_formula_and_dequantized_weight(bits, block, k, n, minimums, n_kept):
    """y over x [1, 1, K], [1, 5, K] and [2, 3, K] (1, 5 and 6 rows) equals the formula in float64
    within 1e-5 of max |y|, and x @ w_eff (float64) within the int8 activations' worst-case error
    (`formula`), of which it uses a real share (the check tells int8 activations from float)."""
    inits, w_eff, parts = make_weight(k, n, bits, block, minimums, n_kept)
    session = qmm_session(k, inits, bits, block, minimums)
    rng = np.random.default_rng(1)
    for shape in ([1, 1, k], [1, 5, k], [2, 3, k]):
        x = rng.standard_normal(shape).astype(np.float32)
        x[..., parts[3]] *= 20.0  # the kept channels are the outliers
        (y,) = session.run(None, {"x": x})
        assert y.shape == (*shape[:-1], n) and y.dtype == np.float32
        rows = x.reshape(-1, k)
        want, bound = formula(rows, block, parts)
        got = y.reshape(-1, n).astype(np.float64)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        exact = rows.astype(np.float64) @ w_eff
        assert (np.abs(got - exact) <= bound + 1e-5 * np.abs(exact).max()).all()
        assert np.abs(got - exact).max() > 0.01 * bound.max()


def test_quant_matmul_splits_n_across_threads():
    """2 threads, N = 4096 (several work items): the same y as 1 thread, to the bit (each column's
    sums run in one order whatever thread computes it)."""
    inits, _, parts = make_weight(576, 4096, 8, 32, False, 32)
    x = np.random.default_rng(2).standard_normal([1, 2, 576]).astype(np.float32)
    (one,) = qmm_session(576, inits, 8, 32, False, threads=1).run(None, {"x": x})
    (two,) = qmm_session(576, inits, 8, 32, False, threads=2).run(None, {"x": x})
    np.testing.assert_array_equal(one, two)
    want, _ = formula(x.reshape(-1, 576), 32, parts)
    assert np.abs(two.reshape(-1, 4096) - want).max() <= 1e-5 * np.abs(want).max()


def test_quant_matmul_zero_rows_and_zero_blocks():
    """No rows: an empty y. A block whose channels are all kept or zero quantizes to 0 (amax 0)."""
    inits, _, parts = make_weight(64, 64, 4, 16, True, 16)
    session = qmm_session(64, inits, 4, 16, True)
    (y,) = session.run(None, {"x": np.zeros([1, 0, 64], np.float32)})
    assert y.shape == (1, 0, 64)
    x = np.random.default_rng(3).standard_normal([1, 1, 64]).astype(np.float32)
    x[..., 16:32] = 0.0
    x[..., parts[3]] = 5.0
    (y,) = session.run(None, {"x": x})
    want, _ = formula(x[0], 16, parts)
    assert np.abs(y[0] - want).max() <= 1e-5 * np.abs(want).max()


def test_quant_matmul_refuses_bad_attributes_and_shapes():
    inits, _, _ = make_weight(64, 128, 4, 32, True, 2)
    with pytest.raises(Exception, match="bits 5 is not supported; allowed: 4, 8"):
        qmm_session(64, inits, 5, 32, True)
    with pytest.raises(Exception, match="block_size 48 is not supported; allowed: 16, 32, 64, 128, 256"):
        qmm_session(64, inits, 4, 48, True)
    with pytest.raises(Exception, match="minimums 2 is not supported; allowed: 0, 1"):
        qmm_session(64, inits, 4, 32, 2)

    def run(k: int, inits: dict, bits: int = 4, block: int = 32, minimums: bool = True) -> None:
        qmm_session(k, inits, bits, block, minimums).run(None, {"x": np.zeros([1, 1, k], np.float32)})

    run(64, inits)
    with pytest.raises(
        Exception,
        match=r"weights must be \[N / 64, 2560\] \(2 records of 1152 bytes, then 2 kept rows of 128\) for 64 "
        r"channels at bits 4, block_size 32, minimums 0, got \[2, 2816\]",
    ):
        run(64, inits, minimums=False)
    with pytest.raises(Exception, match=r"weights must be \[N / 64, 4864\] .* for 64 channels at bits 8"):
        run(64, inits, bits=8)
    with pytest.raises(Exception, match=r"x has 80 channels, not a positive multiple of block_size 32"):
        run(80, inits)
    with pytest.raises(
        Exception, match=r"weights must be \[N / 64, 4096\] \(3 records of 1280 bytes, then 2 kept rows"
    ):
        run(96, inits)
    with pytest.raises(
        Exception, match="kept channel 3 .position 1. is outside x's 64 channels or not above"
    ):
        run(64, {**inits, "kept": np.array([5, 3], np.int64)})
    with pytest.raises(Exception, match="kept channel 64 .position 1. is outside x's 64 channels"):
        run(64, {**inits, "kept": np.array([5, 64], np.int64)})
    # the kept rows are part of each tile: kept and weights must agree on how many
    with pytest.raises(
        Exception, match=r"weights must be \[N / 64, 2560\] \(2 records of 1280 bytes, then 0 kept"
    ):
        run(64, {"weights": inits["weights"]})
    with pytest.raises(Exception, match=r"weights must be \[N / 64, 2944\] .*, then 3 kept rows of 128"):
        run(64, {**inits, "kept": np.array([1, 5, 9], np.int64)})


def matmulnbits_and_ours(bits: int):
    """(x [1, 3, K] float32, MatMulNBits' y, kvedge.QuantMatMul's y, w_hat [K, N] float64) for one
    weight without minimums or kept channels, the same codes and scales given to both ops.
    MatMulNBits runs at accuracy_level 4 (int8 activations). Row 0 of x: every block's amax 127,
    the other channels halfway between two levels (ties, where rounding rules differ)."""
    k, n, block = 576, 256, 32
    inits, w_hat, (q, scale, *_) = make_weight(k, n, bits, block, False, 0)
    u = (q + 2 ** (bits - 1)).astype(np.uint8).T.reshape(n, k // block, block)  # [N, K/bs, bs]
    if bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)  # two along K per byte, the first in the low nibble
    graph = helper.make_graph(
        [
            helper.make_node(
                "MatMulNBits",
                ["x", "B", "scales"],
                ["y"],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=bits,
                block_size=block,
                accuracy_level=4,
            )
        ],
        "nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.ascontiguousarray(u), "B"),
            numpy_helper.from_array(scale.T.astype(np.float32).reshape(-1), "scales"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    nbits = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session = qmm_session(k, inits, bits, block, False)
    rng = np.random.default_rng(4)
    x = rng.standard_normal([1, 3, k]).astype(np.float32)
    x[0, 0] = rng.integers(-100, 100, k) + 0.5
    x[0, 0, ::block] = 127.0
    (theirs,) = nbits.run(None, {"x": x})
    (ours,) = session.run(None, {"x": x})
    return x, theirs, ours, w_hat


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_matmul_and_matmulnbits_multiply_by_the_same_weight(bits):
    """On every platform: both ops within the worst-case error of int8 activations of the exact
    x @ w_hat (float64). Each rounds x to int8 its own way (kvedge: per block, symmetric, half to
    even; onnxruntime's MLAS on x86-64: the same; its aarch64 build: ties away from zero at 8
    bits, KleidiAI's per-row asymmetric codes at 4), and every such way moves a channel by at most
    half a level of the row's symmetric scale, amax / 127 / 2 (a block's amax is at most the row's;
    an asymmetric row's level, (max - min) / 255, is at most 2 amax / 255). A weight packed in
    another layout (nibbles, block order, scales) is off by the size of y itself."""
    x, theirs, ours, w_hat = matmulnbits_and_ours(bits)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)  # [3, K]
    exact = rows @ w_hat  # [3, N]
    half_level = np.abs(rows).max(axis=1, keepdims=True) / 127 / 2  # [3, 1]
    bound = half_level * np.abs(w_hat).sum(axis=0) + 1e-5 * np.abs(exact).max()  # [3, N]
    for y in (theirs, ours):
        assert (np.abs(y.reshape(3, -1) - exact) <= bound).all()
    # a small share of y (6-11% of a row's max |y| here): a misread weight is off by about y itself
    assert (bound.max(axis=1) < 0.2 * np.abs(exact).max(axis=1)).all()


# onnxruntime 1.32's aarch64 build rounds x to int8 otherwise than kvedge by design: at 4 bits in
# KleidiAI's kernel, per row and asymmetric; at 8 bits per block, but ties away from zero
# (vcvtaq), where x86's MLAS and kvedge round them to even (measured: both fail there).
MLAS_X86 = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"),
    reason="premise: x86-64's MLAS, int8 activations per block and ties to even as kvedge's",
)


@MLAS_X86
@pytest.mark.parametrize("bits", [4, 8])
def test_quant_matmul_equals_matmulnbits_without_offsets(bits):
    """Where onnxruntime's MLAS rounds activations as kvedge does (x86-64), the same y as
    MatMulNBits within float summation order (1e-5 of max |y|): the int8 activations are MLAS's
    own (scale amax / 127 per block, x * (127 / amax) rounded half to even, checked on a row of
    ties). Elsewhere the test above is the check."""
    _, want, got, _ = matmulnbits_and_ours(bits)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
