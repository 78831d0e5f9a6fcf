"""The INT8 KV cache in memory: int8 buffers plus float16 per-token scales, quantized in the graph.

References: the numpy quantizer (`kvedge.quant.quantize_tokens`) for what the graph stores, the
float32 export of the same weights for quality, and a full re-prefill of the same INT8 export
for the cache contract (positions, masks, reuse), which must hold as tightly as with a float
cache because the graph attends over exactly the dequantized values it stores.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import (
    GEMMA3_INT8_TOLERANCE,
    assert_cached_decode_equals_reprefill,
    assert_turns_equal_fresh_sessions,
    random_ids,
    require_onnxruntime,
)

from kvedge.cli import main
from kvedge.contract import CacheGeometry, ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.quant import dequantize_tokens, quantize_tokens
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import read_warm_file, write_warm_file
from kvedge.runtime.sessions import HistoryPolicy

# Same INT8 graph on both sides; the only differences are float summation order, which can move
# a value across a rounding boundary (one code step, ~1% of a head's range) once in a while.
ATOL = 2e-3
MAX_LEN = 256


# (family, cache group size, graph variant). "ort" graphs run kvedge's own attention kernel
# (kvedge/runtime/csrc): head_dim 16 takes its generic path, 32 and 64 its vectorized one.
INT8_CASES = [
    ("llama", 0, "portable"),
    ("qwen2", 0, "portable"),
    ("llama-hd32", 16, "portable"),
    ("llama", 0, "ort"),
    ("llama-hd32", 16, "ort"),
    ("qwen2-hd64", 32, "ort"),
    ("qwen3", 0, "portable"),
    ("qwen3", 0, "ort"),
    ("phi3", 0, "portable"),
    ("phi3", 0, "ort"),
    ("smollm3", 0, "portable"),
    ("smollm3", 0, "ort"),
    ("gemma3", 0, "ort"),  # sliding-window layers (window 8): the kernel's local_window_size
]
HEAD_DIMS = {  # config overrides giving the named head_dim
    "hd32": {"num_attention_heads": 2, "num_key_value_heads": 1},
    "hd64": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
}


def export_int8(root, case: tuple[str, int, str]):
    """(float32 export, int8 export) of one tiny model, both under `root`."""
    from tiny import make_tiny_model  # here, not above: the kernel tests run where torch is absent

    family, group, variant = case
    overrides = HEAD_DIMS.get(family.partition("-")[2], {})
    source = make_tiny_model(root / "hf", family.split("-")[0], **overrides)
    # the float32 reference in the INT8 export's cache layout: Gemma 3's portable graph keeps its
    # sliding-window layers in rings, the ort variant full length
    reference = variant if family == "gemma3" else "portable"
    export_model(source, root / "fp", ExportRecipe(max_len=MAX_LEN, variant=reference))
    options = ExportRecipe(max_len=MAX_LEN, kv_dtype="int8", kv_group_size=group, variant=variant)
    export_model(source, root / "int8", options)
    return root / "fp", root / "int8"


@pytest.fixture(scope="module", params=INT8_CASES, ids=lambda case: "-".join(map(str, case)))
def int8_pair(request, tmp_path_factory):
    """(float32 export, int8 export) of one tiny model; "hd32" has head_dim 32, so group 16 gives
    two scales per token per head (a Slice, MatMul and scale per channel group) instead of one."""
    if request.param[0] == "gemma3":
        require_onnxruntime(*GEMMA3_INT8_TOLERANCE)
    return export_int8(tmp_path_factory.mktemp("int8-" + "-".join(map(str, request.param))), request.param)


def test_pool_is_int8_with_float16_scales_counted_exactly(int8_pair):
    model = Model(int8_pair[1], slots=3)
    g = model.manifest.geometry
    assert model.cache.pool.dtype == np.int8 and model.cache.scales.dtype == np.float16
    assert model.cache.scales.shape == (
        g.num_layers,
        2,
        3,
        g.num_kv_heads,
        g.max_len,
        g.head_dim // g.group_size,
    )
    assert model.cache.nbytes == g.pool_bytes(3)
    fp = Model(int8_pair[0]).manifest.geometry
    assert g.bytes_per_token() / fp.bytes_per_token() == (1 + 2 / g.group_size) / 4


def test_real_model_geometry_is_under_027_of_fp32():
    fp = CacheGeometry(num_layers=30, num_kv_heads=3, head_dim=64, max_len=2048)  # SmolLM2-135M
    for group in (32, 64):
        ratio = fp.with_dtype("int8", group).pool_bytes(4) / fp.pool_bytes(4)
        assert ratio <= 0.27, (group, ratio)


def test_graph_stores_what_the_numpy_quantizer_computes(int8_pair):
    """Layer 0's K/V depend only on tokens and positions, so the INT8 cache must hold exactly the
    numpy quantization of the float32 export's layer-0 K/V (up to one step at rounding ties)."""
    fp, q = Model(int8_pair[0]), Model(int8_pair[1])
    ids = random_ids(40, seed=1)
    prefill(fp.backend, fp.cache, 0, [ids[:25]])
    decode_one_token(fp.backend, fp.cache, 0, [ids[25]])
    prefill(q.backend, q.cache, 0, [ids[:25]])
    decode_one_token(q.backend, q.cache, 0, [ids[25]])
    n, group = 26, q.manifest.geometry.group_size
    codes, scales = quantize_tokens(fp.cache.pool[0, :, 0, :, :n], group)
    np.testing.assert_allclose(q.cache.scales[0, :, 0, :, :n], scales, rtol=1e-3)
    diff = np.abs(q.cache.pool[0, :, 0, :, :n].astype(int) - codes)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    back = dequantize_tokens(q.cache.pool[0, :, 0, :, :n], q.cache.scales[0, :, 0, :, :n], group)
    step = scales.astype(np.float32).repeat(group, axis=-1)
    assert (np.abs(back - fp.cache.pool[0, :, 0, :, :n]) <= step * 1.5).all()


def test_quality_against_the_float32_cache(int8_pair):
    """Teacher-forced next-token distributions of the INT8 cache vs float32 (same weights)."""
    fp, q = Model(int8_pair[0]), Model(int8_pair[1])
    ids = random_ids(100, seed=2)
    a = [prefill(fp.backend, fp.cache, 0, [ids[:20]])[0]]
    b = [prefill(q.backend, q.cache, 0, [ids[:20]])[0]]
    for t in ids[20:]:
        a.append(decode_one_token(fp.backend, fp.cache, 0, [t])[0])
        b.append(decode_one_token(q.backend, q.cache, 0, [t])[0])
    la, lb = (
        x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
        for x in (np.array(a, np.float64), np.array(b, np.float64))
    )
    kl = (np.exp(la) * (la - lb)).sum(-1)
    # measured ~1e-5 on these random tiny models; 1e-3 is where a broken scale or code shows
    assert kl.mean() < 1e-3, kl.mean()
    assert (np.argmax(a, -1) == np.argmax(b, -1)).mean() >= 0.95


def test_cached_decode_equals_full_reprefill(int8_pair):
    assert_cached_decode_equals_reprefill(int8_pair[1], 60, 7, ATOL)


def test_multi_turn_reuse_equals_fresh_session(int8_pair):
    questions = ["Hello!", "What is a KV cache?", "And INT8?", "Thanks."]
    assert_turns_equal_fresh_sessions(int8_pair[1], questions, "Answer {turn}.", ATOL)


def test_window_eviction_requantizes_rerotated_keys(int8_pair):
    """After eviction the kept keys are dequantized, re-rotated and quantized again: layer 0 must
    equal a fresh INT8 run over the kept tokens within one quantization step."""
    policy = HistoryPolicy(mode="window", n_sink=4, evict_chunk=32)
    model, reference = Model(int8_pair[1], policy=policy), Model(int8_pair[1])
    ids = random_ids(MAX_LEN, seed=4)
    model.prepare(0, ids)
    logits = model.prepare(0, ids + random_ids(10, seed=5))
    kept = [int(t) for t in model.cache.token_ids(0)]
    assert model.sessions[0].evicted == 32 and np.isfinite(logits).all()
    prefill(reference.backend, reference.cache, 0, [kept])
    n, group = len(kept), model.manifest.geometry.group_size

    def layer0(m):
        return dequantize_tokens(m.cache.pool[0, :, 0, :, :n], m.cache.scales[0, :, 0, :, :n], group)

    step = reference.cache.scales[0, :, 0, :, :n].astype(np.float32).repeat(group, axis=-1)
    assert (np.abs(layer0(model) - layer0(reference)) <= 2.5 * step).all()


def test_warm_file_round_trip_and_dtype_refusal(int8_pair, tmp_path):
    model, fp = Model(int8_pair[1]), Model(int8_pair[0])
    ids = random_ids(20, seed=6)
    prefill(model.backend, model.cache, 0, [ids])
    from kvedge.runtime.prefix import WarmPrefix

    block = model.cache.read(0, len(ids))
    assert block.kv.dtype == np.int8 and block.scales.dtype == np.float16
    path = tmp_path / "p.kvw"
    geometry, fingerprint = model.manifest.geometry, model.manifest.source_fingerprint
    write_warm_file(path, WarmPrefix("p", tuple(ids), block), geometry, fingerprint)
    loaded = read_warm_file(path, geometry, fingerprint, ids)
    np.testing.assert_array_equal(loaded.block.kv, block.kv)
    np.testing.assert_array_equal(loaded.block.scales, block.scales)
    with pytest.raises(KvedgeError, match='"dtype": "int8"'):
        read_warm_file(path, fp.manifest.geometry, fingerprint, ids)
    other = model.cache
    other.write(0, loaded.block, ids)
    with pytest.raises(KvedgeError, match="does not fit"):
        fp.cache.write(0, loaded.block, ids)


def test_bad_int8_options_are_refused_by_name(tmp_path):
    with pytest.raises(KvedgeError, match="allowed: \\['float32', 'int8'\\]"):
        ExportRecipe(kv_dtype="int4")
    with pytest.raises(KvedgeError, match="applies to --kv-dtype int8 only"):
        ExportRecipe(kv_group_size=16)
    with pytest.raises(
        KvedgeError, match="group_size=24 is not allowed for head_dim 64; allowed: \\[16, 32, 64\\]"
    ):
        CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=64, max_len=16, dtype="int8", group_size=24)
    result = CliRunner().invoke(main, ["export", "--out", str(tmp_path / "x"), "--kv-dtype", "int5"])
    assert result.exit_code != 0 and "'int5' is not one of" in result.output
    assert "Traceback" not in result.output


def test_eval_kv_measures_the_real_int8_cache_and_calibration_refuses_it(int8_pair, tmp_path):
    fp_dir, int8_dir = int8_pair
    args = ["eval-kv", "--model", str(fp_dir), "--int8-model", str(int8_dir), "--limit", "2", "--tokens", "8"]
    result = CliRunner().invoke(main, [*args, "--json", str(tmp_path / "q.json")])
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "q.json").read_text())["schemes"]
    geometry = Model(int8_dir).manifest.geometry
    assert row["scheme"].startswith("INT8 cache in memory")
    assert row["kv_bytes_ratio"] == pytest.approx((1 + 2 / geometry.group_size) / 4)
    assert row["kl_mean"] < 1e-3 and row["top1_agreement"] >= 0.9
    swapped = CliRunner().invoke(main, ["eval-kv", "--model", str(int8_dir), "--int8-model", str(fp_dir)])
    assert swapped.exit_code != 0 and "needs the float32-cache export" in swapped.output
    refused = CliRunner().invoke(main, ["calibrate", "--model", str(int8_dir), "--out", str(tmp_path / "s")])
    assert refused.exit_code != 0 and "calibration reads float K/V" in refused.output
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def int8_variants(tmp_path_factory):
    """The same tiny model (head_dim 64, cache group 32: SmolLM2's shapes) exported with the INT8
    cache as the portable graph (standard ops) and the ort graph (kvedge's kernel)."""
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("int8-variants")
    source = make_tiny_model(root / "hf", "llama", **HEAD_DIMS["hd64"])
    for variant in ("portable", "ort"):
        options = ExportRecipe(max_len=MAX_LEN, kv_dtype="int8", kv_group_size=32, variant=variant)
        export_model(source, root / variant, options)
    return root / "portable", root / "ort"


def test_int8_kernel_equals_the_portable_int8_graph(int8_variants):
    """kvedge.Int8CacheAttention against the standard-op INT8 graph, which is the reference for the
    INT8 cache's math: same codes and scales stored, same logits up to float summation order
    (ATOL, as for a re-prefill: the kernel sums 8 channels at a time and exponentiates with its own
    polynomial, so a value at a rounding tie may land one code step away), through prefills, and
    batched decodes of rows at different lengths, with and without an idle row."""
    portable, ort = Model(int8_variants[0], slots=2), Model(int8_variants[1], slots=2)
    prompts = [random_ids(37, seed=11), random_ids(90, seed=12)]
    for slot, ids in enumerate(prompts):
        np.testing.assert_allclose(
            prefill(ort.backend, ort.cache, slot, [ids]),
            prefill(portable.backend, portable.cache, slot, [ids]),
            atol=ATOL,
            rtol=0,
        )
    for step, tokens in enumerate(zip(random_ids(20, seed=13), random_ids(20, seed=14), strict=True)):
        rows = list(tokens) if step % 3 else [tokens[0], None]  # every third step slot 1 idles
        got = decode_one_token(ort.backend, ort.cache, 0, rows)
        want = decode_one_token(portable.backend, portable.cache, 0, rows)
        busy = [r for r, t in enumerate(rows) if t is not None]
        np.testing.assert_allclose(got[busy], want[busy], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(ort.cache.lengths, portable.cache.lengths)
    for slot in range(2):
        n = ort.cache.length(slot)
        codes = np.abs(ort.cache.pool[:, :, slot, :, :n].astype(int) - portable.cache.pool[:, :, slot, :, :n])
        assert codes.max() <= 1 and (codes == 0).mean() > 0.999  # a tie may round the other way
        np.testing.assert_allclose(
            ort.cache.scales[:, :, slot, :, :n], portable.cache.scales[:, :, slot, :, :n], rtol=1e-3
        )


def test_int8_kernel_refuses_a_past_that_does_not_fit(int8_variants):
    """The kernel checks each row's past length against the cache before writing anything."""
    model = Model(int8_variants[1])
    views = model.cache.layer_views(0, 1)
    before = model.cache.pool.copy()
    overflow = f"past length {MAX_LEN} \\+ 1 new tokens does not fit {MAX_LEN} positions"
    with pytest.raises(Exception, match=overflow):
        model.backend.run(
            np.zeros((1, 1), np.int64),
            np.array([[MAX_LEN]]),
            np.array([MAX_LEN], np.int64),
            np.zeros(1, np.int64),
            views,
        )
    np.testing.assert_array_equal(model.cache.pool, before)


def test_missing_kernel_library_is_named(tmp_path):
    from kvedge.runtime import kernels

    with pytest.raises(KvedgeError, match="is not built in .*pip install -e .*--variant portable"):
        kernels.library_path(tmp_path)
    (tmp_path / f"{kernels.LIBRARY_STEM}.so").write_bytes(b"not a library")
    with pytest.raises(KvedgeError, match="is not a usable kvedge kernel library"):
        kernels.library_path(tmp_path)


def test_kernel_library_is_the_one_this_python_built(tmp_path):
    """A source tree installed into venvs of several Pythons holds a library per Python; another
    Python's (a `.cpython-3XX-` name not this one's) may be stale and is not taken."""
    import importlib.machinery

    from kvedge.runtime import kernels

    ours = kernels.library_path()
    assert ours.name == kernels.LIBRARY_STEM + importlib.machinery.EXTENSION_SUFFIXES[0], ours
    other = f"{kernels.LIBRARY_STEM}.cpython-39-x86_64-linux-gnu.so"  # sorts before any 3.10+ name
    (tmp_path / other).write_bytes(b"another Python's build")
    with pytest.raises(KvedgeError, match="is not built in"):
        kernels.library_path(tmp_path)
    (tmp_path / ours.name).symlink_to(ours)
    assert kernels.library_path(tmp_path) == tmp_path / ours.name


def split_decode_layer(threads: int):
    """One kvedge.Int8CacheAttention node (SmolLM2's heads: 9 query / 3 KV, head_dim 64, scale
    groups of 32) in its own session on `threads` onnxruntime intra-op threads."""
    from onnx import TensorProto, helper

    from kvedge.bench.kernel import one_node_session
    from kvedge.contract import INT8_ATTENTION_OP, KVEDGE_OPS_DOMAIN

    def info(name: str, elem: int, shape: list) -> object:
        return helper.make_tensor_value_info(name, elem, shape)

    cache, scales = ["b", 3, "L", 64], ["b", 3, "L", 2]
    node = helper.make_node(
        INT8_ATTENTION_OP,
        ["qkv", "lengths", "k", "v", "ks", "vs", "cos", "sin"],
        ["out", "k_out", "v_out", "ks_out", "vs_out"],
        domain=KVEDGE_OPS_DOMAIN,
        num_heads=9,
        kv_num_heads=3,
    )
    inputs = [info("qkv", TensorProto.FLOAT, ["b", "s", 15 * 64]), info("lengths", TensorProto.INT64, ["b"])]
    inputs += [info(n, TensorProto.INT8, cache) for n in ("k", "v")]
    inputs += [info(n, TensorProto.FLOAT16, scales) for n in ("ks", "vs")]
    inputs += [info(n, TensorProto.FLOAT, ["P", 32]) for n in ("cos", "sin")]
    outputs = [info("out", TensorProto.FLOAT, ["b", "s", 9 * 64])]
    outputs += [info(n, TensorProto.INT8, cache) for n in ("k_out", "v_out")]
    outputs += [info(n, TensorProto.FLOAT16, scales) for n in ("ks_out", "vs_out")]
    return one_node_session(node, inputs, outputs, KVEDGE_OPS_DOMAIN, threads)


def test_int8_kernel_split_decode_on_threads_matches_exact_attention():
    """A decode step over long caches (past 1100 and 700 in a batch of 2: the kernel splits each KV
    head's cache into blocks, runs them on onnxruntime's threads and combines their partial
    softmaxes) gives the same output on 1 and 3 threads, bit for bit (the split does not depend on
    the thread count), and equals attention computed in float64 from the cache the op returns
    (1e-5 relative, as the self-test)."""
    rng = np.random.default_rng(5)
    slots, past = 1200, np.array([1100, 700], np.int64)
    angles = np.arange(slots)[:, None] * 10000.0 ** (-np.arange(32) / 32)
    feeds = {
        "qkv": rng.standard_normal((2, 1, 15 * 64), np.float32),
        "lengths": past,
        "k": rng.integers(-127, 128, (2, 3, slots, 64)).astype(np.int8),
        "v": rng.integers(-127, 128, (2, 3, slots, 64)).astype(np.int8),
        "ks": rng.uniform(0.002, 0.03, (2, 3, slots, 2)).astype(np.float16),
        "vs": rng.uniform(0.002, 0.03, (2, 3, slots, 2)).astype(np.float16),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
    }
    out, k, v, ks, vs = split_decode_layer(1).run(None, feeds)
    np.testing.assert_array_equal(split_decode_layer(3).run(None, feeds)[0], out)
    want = np.zeros((2, 9, 64))
    for r, pos in enumerate(past):
        q = feeds["qkv"][r, 0, : 9 * 64].reshape(9, 64).astype(np.float64)
        cos, sin = feeds["cos"][pos], feeds["sin"][pos]
        q = np.concatenate([q[:, :32] * cos - q[:, 32:] * sin, q[:, 32:] * cos + q[:, :32] * sin], axis=1)
        for head in range(9):
            h = head // 3
            keys = k[r, h, : pos + 1] * np.repeat(ks[r, h, : pos + 1].astype(np.float64), 32, axis=1)
            values = v[r, h, : pos + 1] * np.repeat(vs[r, h, : pos + 1].astype(np.float64), 32, axis=1)
            scores = keys @ q[head]
            probs = np.exp(scores - scores.max())
            want[r, head] = probs @ values / probs.sum()
    got = out.reshape(2, 9, 64)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


CSRC = Path(__file__).resolve().parent.parent / "kvedge" / "runtime" / "csrc"


# compiler command line -> the self-test built with it, once per test session: the binary takes
# its case set as an argument, and a build is the slow part (minutes under emulation)
BUILT_SELFTESTS: dict[tuple[str, ...], Path] = {}


def build_and_run_selftest(
    compiler: list[str], runner: list[str], folder: Path, args: tuple[str, ...] = ()
) -> str:
    """`csrc/selftest.cc`'s output for `args`, built with `compiler` into `folder` (the session's
    `selftests` folder: a test's own tmp_path is removed when it passes) unless this session
    built it already, run through `runner`."""
    if tuple(compiler) not in BUILT_SELFTESTS:
        out = folder / f"selftest-{len(BUILT_SELFTESTS)}"
        include = f"-I{CSRC / 'third_party' / 'onnxruntime'}"
        subprocess.run(
            [*compiler, "-O2", "-std=c++17", include, str(CSRC / "selftest.cc"), "-o", str(out)],
            check=True,
            capture_output=True,
        )
        BUILT_SELFTESTS[tuple(compiler)] = out
    binary = BUILT_SELFTESTS[tuple(compiler)]
    run = subprocess.run([*runner, str(binary), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


# A test that builds and runs `csrc/selftest.cc`: a C++ program, no Python or onnxruntime in it, so
# one run proves it for every Python (.ci/python-versions deselects these: -m "not selftest")
SELFTEST = pytest.mark.selftest

# The self-test built for a Jetson Orin's CPU (Cortex-A78AE: the NEON code paths), run under qemu
NEEDS_AARCH64 = pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
    reason="aarch64 check needs Debian's g++-aarch64-linux-gnu and qemu-user",
)


def run_selftest(folder: Path, *args: str, orin: bool = False) -> str:
    """`csrc/selftest.cc`'s output for `args`, built for this machine's CPU or (`orin`) for an Orin's."""
    if orin:
        compiler = ["aarch64-linux-gnu-g++", "-mcpu=cortex-a78ae", "-static"]
        return build_and_run_selftest(compiler, ["qemu-aarch64"], folder, args)
    return build_and_run_selftest(["g++", "-march=native"], [], folder, args)


@SELFTEST
@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_kernel_vector_paths_match_its_scalar_path(selftests):
    """Every vectorized (head_dim, group size) instantiation of the kernel against its
    channel-at-a-time path (`csrc/selftest.cc`; 1e-5 relative: float summation order only), built
    for this machine's CPU."""
    out = run_selftest(selftests)
    assert out.count("ok  ") == DECODE_CASES and "FAIL" not in out


# 15 (head_dim, group size) pairs x 8 (rows, positions, window) shapes, 4 of them windowed
DECODE_CASES = 15 * 8
# 15 (head_dim, group size) pairs x 3 cache blocks x 9 (rows, positions, window) shapes (4 of them
# windowed), then 11 whole calls cut into query tiles or blocks, 10 decode steps with a split
# cache, and 15 whole calls with a sliding window (6 prefills, 9 decode steps)
TILED_CASES = 15 * 3 * 9 + 11 + 10 + 15


@SELFTEST
@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_kernel_tiled_prefill_matches_exact_attention(selftests):
    """The prefill path (tiles of query rows against blocks of dequantized cache rows, online
    softmax) against attention computed in double precision (1e-5 relative), at cache blocks of
    16, 36 and the kernel's own, and whole calls cut into work items: ragged last tiles, past
    lengths that are no multiple of a tile or block, KV groups of 3, 2 and 1, the generic head_dim;
    and decode steps whose cache is split into blocks run on 1 to 5 threads, then combined (the
    op's own split, blocks of 8 to 100 positions, lengths that are no multiple of a block)."""
    out = run_selftest(selftests, "tiled")
    assert out.count("ok  ") == TILED_CASES and "FAIL" not in out


@SELFTEST
@NEEDS_AARCH64
def test_kernel_neon_path_matches_its_scalar_path(selftests):
    """The same self-test built for a Jetson Orin's CPU (Cortex-A78AE: the NEON code path) and run
    under qemu."""
    out = run_selftest(selftests, orin=True)
    assert out.count("ok  ") == DECODE_CASES and "FAIL" not in out


@SELFTEST
@NEEDS_AARCH64
def test_kernel_neon_tiled_prefill_matches_exact_attention(selftests):
    """The tiled prefill self-test built for a Jetson Orin's CPU and run under qemu."""
    out = run_selftest(selftests, "tiled", orin=True)
    assert out.count("ok  ") == TILED_CASES and "FAIL" not in out
