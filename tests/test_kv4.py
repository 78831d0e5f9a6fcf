"""kvedge.Int4CacheAttention (kvedge/runtime/csrc/kvedge_ops.cc) against its numpy twin, kvedge/kv4.py.

The two compute kr = RoPE(k) H in another float order (butterflies against a matrix product), so
a value at a rounding tie may take the other code, or a scale search's near-tie the other
multiplier, once in a while: codes agree on >= 99.9% of values and every dequantized value is
within one level of the twin's; the attention within ATOL of the reference (float64).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvedge import kv4
from kvedge.errors import KvedgeError

HEADS, KV_HEADS, D = 9, 3, 64  # SmolLM2's attention: groups of 3 query heads
ATOL = 5e-5  # float summation order, e^x by a polynomial, a rare code at a tie (measured <= 1.1e-5)
LENGTH, RING = 128, 48


@pytest.fixture(scope="module", autouse=True)
def kernel_library():
    from kvedge.runtime import kernels

    try:
        kernels.library_path()
    except KvedgeError as exc:
        pytest.skip(str(exc))


def layer(key_bits: int, window: int = 32, threads: int = 1, **attributes):
    """One kvedge.Int4CacheAttention node in its own session."""
    from kvedge.bench.kernel import int4_session

    return int4_session(HEADS, KV_HEADS, key_bits, window, threads, **attributes)


def cache(rng, past: list[int], key_bits: int, length: int = LENGTH, ring: int = RING) -> list[np.ndarray]:
    """A consistent state: every past position's codes, the last `ring` of them float in the ring."""
    b = len(past)
    kr = rng.standard_normal((b, KV_HEADS, length, D), np.float32)
    vr = rng.standard_normal((b, KV_HEADS, length, D), np.float32)
    kw, vw = np.zeros((2, b, KV_HEADS, ring, D), np.float32)
    for r, n in enumerate(past):
        for j in range(n):
            kw[r, :, j % ring], vw[r, :, j % ring] = kr[r, :, j], vr[r, :, j]
    return [*kv4.quantize_keys(kr, key_bits), *kv4.quantize_values(vr), kw, vw]


def feeds(rng, past: list[int], tokens: int, state: list[np.ndarray]) -> dict[str, np.ndarray]:
    angles = np.arange(state[0].shape[2])[:, None] * 10000.0 ** (-np.arange(D // 2) / (D // 2))
    arrays = [rng.standard_normal((len(past), tokens, (HEADS + 2 * KV_HEADS) * D), np.float32)]
    arrays += [
        np.array(past, np.int64),
        *state,
        np.cos(angles).astype(np.float32),
        np.sin(angles).astype(np.float32),
    ]
    return dict(
        zip(["qkv", "lengths", "kc", "ks", "vc", "vs", "kw", "vw", "cos", "sin"], arrays, strict=True)
    )


def reference(
    f: dict[str, np.ndarray], key_bits: int, window: int = 32, **attributes
) -> tuple[np.ndarray, ...]:
    args = list(f.values())
    return kv4.attend(
        *args, num_heads=HEADS, kv_num_heads=KV_HEADS, key_bits=key_bits, window=window, **attributes
    )


def assert_codes_agree(got: list[np.ndarray], want: tuple[np.ndarray, ...], key_bits: int) -> None:
    """Codes of the kernel and the twin: >= 99.9% identical, each dequantized value within one
    level (its larger scale) of the other's; the ring's float rows to float rounding."""
    kc, ks, vc, vs, kw, vw = got
    d = D
    codes = np.concatenate([kv4.unpack(kc, key_bits, d), kv4.unpack(vc, 4, d)], -1)
    twin = np.concatenate([kv4.unpack(want[0], key_bits, d), kv4.unpack(want[2], 4, d)], -1)
    assert (codes == twin).mean() >= 0.999, (codes != twin).sum()
    gap = kv4.LEVELS_V[-1] - kv4.LEVELS_V[-2]  # the widest gap between value levels; keys': 1
    for a, b, s, t, level in (
        (
            kv4.dequantize_keys(kc, ks, key_bits),
            kv4.dequantize_keys(want[0], want[1], key_bits),
            ks,
            want[1],
            1.0,
        ),
        (kv4.dequantize_values(vc, vs), kv4.dequantize_values(want[2], want[3]), vs, want[3], gap),
    ):
        step = np.maximum(s, t).astype(np.float32).repeat(d // s.shape[-1], -1)
        assert (np.abs(a - b) <= level * step * 1.001).all()
    np.testing.assert_allclose(kw, want[4], atol=1e-6, rtol=2e-6)  # float rounding of H
    np.testing.assert_allclose(vw, want[5], atol=1e-6, rtol=2e-6)


def test_levels_are_the_studys_lloyd_max():
    """LEVELS_V against the 4-bit study's lloyd_max(16) recomputed (the study's algorithm)."""
    x = np.linspace(-6, 6, 240001)
    w = np.exp(-0.5 * x * x)
    c = np.linspace(-2.5, 2.5, 16)
    for _ in range(300):
        idx = np.searchsorted((c[1:] + c[:-1]) / 2, x)
        c = np.bincount(idx, w * x, 16) / np.bincount(idx, w, 16)
    np.testing.assert_allclose(kv4.LEVELS_V, ((c - c[::-1]) / 2).astype(np.float32), rtol=0, atol=1e-6)
    assert (kv4.LEVELS_V == -kv4.LEVELS_V[::-1]).all()


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_packing_round_trips(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, (3, 5, 32)).astype(np.uint8)
    packed = kv4.pack(codes, bits)
    assert packed.shape == (3, 5, kv4.row_bytes(32, bits)) and packed.dtype == np.uint8
    np.testing.assert_array_equal(kv4.unpack(packed, bits, 32), codes)
    if bits == 5:  # byte 16 + i holds bit 4 of codes 8i .. 8i + 7, code 8i + t at bit t
        assert packed[0, 0, 16] == sum(((codes[0, 0, t] >> 4) & 1) << t for t in range(8))


def test_scale_search_beats_the_absmax_scale():
    """The searched scale's squared error is at most the plain absmax scale's (m = 1, the last)."""
    x = np.random.default_rng(0).standard_normal((200, 64)).astype(np.float32)
    for searched, plain in (
        (
            kv4.dequantize_keys(*kv4.quantize_keys(x, 5), 5),
            kv4._keys5(x, kv4.f16(np.abs(x).max(-1, keepdims=True) / 15.5))[1],
        ),
        (
            kv4.dequantize_values(*kv4.quantize_values(x)),
            kv4._values4(x, kv4.f16(np.abs(x).max(-1, keepdims=True) / kv4.LEVELS_V[-1]))[1],
        ),
    ):
        assert (((searched - x) ** 2).sum(-1) <= ((plain - x) ** 2).sum(-1) + 1e-6).all()


CASES = [  # key_bits, window, new tokens, local_window_size
    (5, 32, 1, -1),
    (5, 32, 20, -1),
    (5, 0, 1, -1),
    (5, 0, 20, -1),
    (8, 32, 1, -1),
    (8, 32, 20, -1),
    (8, 0, 4, -1),
    (5, 32, 4, 16),
    (5, 32, 20, 40),
]


@pytest.mark.parametrize("key_bits,window,tokens,local", CASES)
def test_kernel_equals_the_numpy_twin(key_bits, window, tokens, local):
    """A batch of 2 rows at different past lengths (70: past the 48-position ring; 5), 1 new token
    (the decode rows), 4 (query blocks of several tokens) or 20 (the prefill tiles)."""
    rng = np.random.default_rng(key_bits * 100 + window + tokens)
    past = [70, 5]
    f = feeds(rng, past, tokens, cache(rng, past, key_bits))
    attributes = {"local_window_size": local} if local > 0 else {}
    got = layer(key_bits, window, **attributes).run(None, f)
    want = reference(f, key_bits, window, **attributes)
    np.testing.assert_allclose(got[0], want[0], atol=ATOL, rtol=0)
    assert_codes_agree(got[1:], want[1:], key_bits)
    for r, n in enumerate(past):  # nothing past the new tokens written
        np.testing.assert_array_equal(got[1][r, :, n + tokens :], f["kc"][r, :, n + tokens :])


def test_prefill_equals_one_token_calls():
    """n tokens in one call (tiles) and n one-token calls (decode rows): the same codes, scales and
    ring to the bit (each token is quantized alone), the same attention up to float order."""
    rng = np.random.default_rng(7)
    session = layer(5, 32)
    start = feeds(rng, [3], 30, cache(rng, [3], 5))
    whole = session.run(None, start)
    state = [start[n] for n in ("kc", "ks", "vc", "vs", "kw", "vw")]
    outs = []
    for t in range(30):
        step = dict(start, qkv=start["qkv"][:, t : t + 1], lengths=np.array([3 + t], np.int64))
        step.update(zip(("kc", "ks", "vc", "vs", "kw", "vw"), state, strict=True))
        out, *state = session.run(None, step)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), whole[0], atol=1e-5, rtol=0)
    for a, b in zip(state, whole[1:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_steps_attend_each_token_as_a_one_token_call():
    """decode_steps 4: a call of 4 tokens gives the 4 one-token calls' outputs, bit for bit."""
    rng = np.random.default_rng(8)
    f = feeds(rng, [60, 9], 4, cache(rng, [60, 9], 5))
    got = layer(5, 32, decode_steps=4).run(None, f)
    one = layer(5, 32)
    state = [f[n] for n in ("kc", "ks", "vc", "vs", "kw", "vw")]
    for t in range(4):
        step = dict(f, qkv=f["qkv"][:, t : t + 1], lengths=f["lengths"] + t)
        step.update(zip(("kc", "ks", "vc", "vs", "kw", "vw"), state, strict=True))
        out, *state = one.run(None, step)
        np.testing.assert_array_equal(got[0][:, t : t + 1], out)
    for a, b in zip(state, got[1:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_in_place_binding_and_a_split_decode_on_threads():
    """The state bound in place (I/O binding) ends as the unbound call's outputs; a decode step over
    a long cache (split into blocks on onnxruntime's threads) is the same on 1 and 3 threads, bit
    for bit, and equals the twin."""
    from kvedge.bench.kernel import bound

    rng = np.random.default_rng(9)
    past = [1100, 700]
    f = feeds(rng, past, 1, cache(rng, past, 5, length=1200))
    want = layer(5, 32, threads=1).run(None, f)
    np.testing.assert_array_equal(layer(5, 32, threads=3).run(None, f)[0], want[0])
    np.testing.assert_allclose(want[0], reference(f, 5)[0], atol=ATOL, rtol=0)
    session = layer(5, 32, threads=3)
    state = {n: f[n].copy() for n in ("kc", "ks", "vc", "vs", "kw", "vw")}
    out = np.zeros_like(want[0])
    binding = bound(
        session,
        {**f, **state},
        {"out": out, **{n + "_out": a for n, a in state.items()}},
    )
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(out, want[0])
    for a, b in zip(state.values(), want[1:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_attributes_and_overflow_are_refused_by_name():
    with pytest.raises(Exception, match="key_bits 6 is not supported; allowed: 5, 8"):
        layer(6)
    rng = np.random.default_rng(10)
    f = feeds(rng, [4], 1, cache(rng, [4], 5))
    with pytest.raises(Exception, match="window 64 is more than the ring's 48 positions"):
        layer(5, 64).run(None, f)
    f["lengths"] = np.array([LENGTH], np.int64)
    with pytest.raises(
        Exception, match=f"past length {LENGTH} \\+ 1 new tokens does not fit {LENGTH} positions"
    ):
        layer(5).run(None, f)
