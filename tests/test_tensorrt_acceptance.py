"""TensorRT's real ONNX parser and builder on every export kvedge says TensorRT can take.

TensorRT for RTX (`tensorrt_rtx`, the `trtcheck` extra, which `make` installs) parses and builds
ahead of time without a GPU, with the same ONNX importer as Jetson's TensorRT 10. Each case
exports a tiny model, asks the parser for its errors (none allowed), then builds an engine through
`build_engine`, the code `kvedge export --target tensorrt` runs, with the same two optimization
profiles. A pass here is strong evidence for Jetson, not proof: docs/JETSON.md keeps the
difference (explicit quantization only, slightly different type coverage). Every network is
strongly typed on both flavours, so the engine built here computes in the dtypes a Jetson's
does: each case checks the network's own flag, the engine manifest, and that the network's
inputs and outputs carry the graph's dtypes (a float16 graph's cache float16, its logits float32)
and that no input is a shape tensor (the runtime binds none as one).

What the parser rejects is refused with the parser's own words: the cases below that expect a
refusal check the message `build_engine` raises carries the parser's reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import save_graph
from onnx import numpy_helper
from tensorrt_claims import ACCEPTED, MAX_LEN
from tiny import make_tiny_model

from kvedge.contract import HEAD_TABLE, ONNX_FILE, VERIFY_TOKENS, ExportRecipe, Manifest
from kvedge.contract.engine import DECODE_PROFILE, ENGINE_FILE, PREFILL_PROFILE, EngineManifest, GpuInfo
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.export.tensorrt import (
    EngineOptions,
    _parse,
    add_profiles,
    build_engine,
    parse_errors,
    profile_shapes,
)
from kvedge.runtime.backends.trt import deserialize_engine

trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT for RTX: pip install 'kvedge[trtcheck]'")

MAX_PREFILL, MAX_BATCH = 64, 2


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("trt-accept") / "hf", "llama")


def check_strongly_typed(out) -> None:
    """The parsed network is strongly typed and its inputs and outputs carry the graph interface's
    dtypes (`Manifest.graph_inputs` / `graph_outputs`), as TensorRT itself reports them."""
    parsed = _parse(out)
    network = parsed.network
    assert parsed.errors == [] and parsed.strongly_typed
    assert network.get_flag(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    manifest = Manifest.load(out)
    found = [network.get_input(i) for i in range(network.num_inputs)]
    found += [network.get_output(i) for i in range(network.num_outputs)]
    dtypes = {tensor.name: np.dtype(trt.nptype(tensor.dtype)) for tensor in found}
    wanted = {spec.name: np.dtype(spec.dtype) for spec in manifest.graph_inputs() + manifest.graph_outputs()}
    # TensorRT takes int64 ids and lengths as int64 (or int32 on TensorRT 8); the rest must agree
    assert {n: d for n, d in dtypes.items() if d.kind == "f"} == {
        n: d for n, d in wanted.items() if d.kind == "f"
    }
    assert dtypes[manifest.names.logits] == np.float32
    # No input is a shape tensor (whose values TensorRT needs on the host, per profile, through
    # set_shape_input): the builder gives none and the runtime binds every step input as data,
    # although the portable graph feeds past_lengths through ReduceMax into Slice.
    shape_inputs = [t.name for t in found[: network.num_inputs] if t.is_shape_tensor]
    assert shape_inputs == [], f"shape-tensor inputs: {shape_inputs}"


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_tensorrt_parses_and_builds(case, source, tmp_path):
    out = tmp_path / case
    export_model(source, out, ACCEPTED[case])
    assert parse_errors(out) == []
    check_strongly_typed(out)
    engine = build_engine(out, out, MAX_PREFILL, 256 << 20, max_batch=MAX_BATCH)
    assert (out / ENGINE_FILE).stat().st_size > 100_000
    assert engine.tensorrt_flavour == "tensorrt_rtx" and engine.tensorrt_version == trt.__version__
    assert engine.strongly_typed and engine.precision == ACCEPTED[case].precision
    assert EngineManifest.load(out) == engine
    # the engine's profiles are the ones the runtime sizes its buffers from
    runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    built = deserialize_engine(runtime, out / ENGINE_FILE)  # the binding takes the mapped file
    if built is not None:  # needs a GPU to deserialize; without one the build is the proof
        assert built.num_optimization_profiles == 2


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_prefill_profile_takes_a_verify_of_verify_rows(precision, source, tmp_path):
    """Speculative verification on TensorRT: TensorRT's builder takes the profiles `build_engine`
    gives it (the same `add_profiles`) with last_index [1..B, 1..VERIFY_TOKENS] on prefill and
    [1..B, 1] on decode, the parsed network's logits [batch, rows, vocab] leave "rows" dynamic,
    the engine builds, and its manifest records max_rows. Where a GPU lets TensorRT load the
    engine, the engine's own profile shapes and a verify-shaped call's logits shape are read
    back; without one (here) the build is the proof and device_tests/ the rest."""
    out = tmp_path / precision
    export_model(source, out, ExportRecipe(max_len=MAX_LEN, precision=precision))
    manifest, names = Manifest.load(out), Manifest.load(out).names
    parsed = _parse(out)
    config = parsed.builder.create_builder_config()
    options = EngineOptions(MAX_PREFILL, MAX_BATCH)
    profiles = add_profiles(parsed.builder, config, manifest, options)
    taken = [[tuple(d) for d in profile.get_shape(names.last_index)] for profile in profiles]
    assert taken[PREFILL_PROFILE] == [(1, 1), (1, 1), (MAX_BATCH, VERIFY_TOKENS)]
    assert taken[DECODE_PROFILE] == [(1, 1), (MAX_BATCH, 1), (MAX_BATCH, 1)]
    assert config.num_optimization_profiles == 2
    network = parsed.network
    outputs = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
    assert tuple(outputs[names.logits].shape) == (-1, -1, manifest.vocab_size)
    engine = build_engine(out, out, MAX_PREFILL, 256 << 20, max_batch=MAX_BATCH)
    assert engine.max_rows == VERIFY_TOKENS and EngineManifest.load(out).verify_refusal() is None
    built = deserialize_engine(trt.Runtime(trt.Logger(trt.Logger.ERROR)), out / ENGINE_FILE)
    if built is None:  # needs a GPU to deserialize
        return
    assert [tuple(d) for d in built.get_tensor_profile_shape(names.last_index, PREFILL_PROFILE)] == taken[0]
    assert [tuple(d) for d in built.get_tensor_profile_shape(names.last_index, DECODE_PROFILE)] == taken[1]
    context = built.create_execution_context()
    for spec in manifest.graph_inputs():  # a verify of VERIFY_TOKENS tokens on the prefill profile
        assert context.set_input_shape(spec.name, spec.shape(1, VERIFY_TOKENS, VERIFY_TOKENS))
    assert tuple(context.get_tensor_shape(names.logits)) == (1, VERIFY_TOKENS, manifest.vocab_size)


@pytest.mark.parametrize(
    "precision, kv_dtype", [("float32", "float32"), ("float32", "int8"), ("float16", "float16")]
)
def test_tensorrt_parses_and_builds_gemma3_ring_layers(precision, kv_dtype, tmp_path):
    """Gemma 3's portable graph: ring-buffer sliding-window layers (Mod, Min, And in the mask),
    GELU-tanh, sandwich norms; float32 and INT8 caches, and the float16 graph."""
    source = make_tiny_model(tmp_path / "hf", "gemma3")
    out = tmp_path / kv_dtype
    export_model(source, out, ExportRecipe(max_len=MAX_LEN, kv_dtype=kv_dtype, precision=precision))
    assert parse_errors(out) == []
    check_strongly_typed(out)
    engine = build_engine(out, out, MAX_PREFILL, 256 << 20, max_batch=MAX_BATCH)
    assert (out / ENGINE_FILE).stat().st_size > 100_000 and engine.precision == precision


@pytest.mark.parametrize(
    "precision, kv_dtype, weights",
    [
        ("float32", "float32", "float32"),
        ("float32", "int8", "int4"),
        ("float16", "float16", "float16"),
        ("float16", "int8", "int4"),  # the form the planner recommends for TensorRT elsewhere
    ],
)
def test_tensorrt_parses_and_builds_gemma4(precision, kv_dtype, weights, tmp_path):
    """Gemma 4's portable graph: rings of the sliding layers' own head_dim, global layers of
    theirs, shared-KV layers reading their source layer's K and V, per-layer inputs as a graph
    input (float32, narrowed in a float16 graph), softcapped logits; float32 and float16 graphs."""
    source = make_tiny_model(tmp_path / "hf", "gemma4")
    out = tmp_path / kv_dtype
    recipe = ExportRecipe(
        max_len=MAX_LEN, precision=precision, kv_dtype=kv_dtype, weights=weights, block_size=16
    )
    export_model(source, out, recipe)
    assert parse_errors(out) == []
    check_strongly_typed(out)
    engine = build_engine(out, out, MAX_PREFILL, 256 << 20, max_batch=MAX_BATCH)
    assert (out / ENGINE_FILE).stat().st_size > 100_000 and engine.precision == precision


@pytest.mark.parametrize(
    "family, weights, precision",
    [
        ("lfm2", "float32", "float32"),
        ("lfm2", "int4", "float32"),
        ("lfm2", "float16", "float16"),  # its convolution states in float16 too
        ("qwen3_5", "float32", "float32"),
        ("qwen3_5", "float16", "float16"),  # its Gated DeltaNet layers float32 islands
    ],
)
def test_tensorrt_parses_and_builds_hybrid_states(family, weights, precision, tmp_path):
    """The hybrid models' portable graphs: LFM2's short-convolution layers and Qwen3.5's Gated
    DeltaNet layers, whose per-slot states enter and leave as tensors (Concat, Slice taps and
    GatherND at each row's input length; CumSum, Where, the triangular inverse's MatMuls), KV on
    the attention layers only."""
    source = make_tiny_model(tmp_path / "hf", family)
    out = tmp_path / weights
    export_model(source, out, ExportRecipe(max_len=MAX_LEN, weights=weights, precision=precision))
    assert parse_errors(out) == []
    check_strongly_typed(out)
    engine = build_engine(out, out, MAX_PREFILL, 256 << 20, max_batch=MAX_BATCH)
    assert (out / ENGINE_FILE).stat().st_size > 100_000 and engine.precision == precision


def test_what_the_parser_rejects_is_refused_with_its_reason(source, tmp_path):
    """A weight scale <= 0, as int8/int4 exports held before their scales were kept positive
    (`quantize_blockwise(positive_scales=True)`): the parser's reason reaches the user."""
    reason = "Scale coefficients must all be positive"
    out = tmp_path / "negative-scale"
    export_model(source, out, ExportRecipe(max_len=MAX_LEN, weights="int8"))
    model = onnx.load(str(out / ONNX_FILE))
    scale = next(t for t in model.graph.initializer if t.name.endswith(".weight_scale"))
    values = numpy_helper.to_array(scale).copy()
    values.flat[0] = -values.flat[0]
    scale.CopyFrom(numpy_helper.from_array(values, scale.name))
    save_graph(model, out)
    errors = parse_errors(out)
    assert errors and reason in errors[0]
    with pytest.raises(KvedgeError, match=f"TensorRT for RTX {trt.__version__} cannot parse .*{reason}"):
        build_engine(out, out, MAX_PREFILL, 256 << 20)


def test_the_ort_graph_is_refused_by_the_parser_too(source, tmp_path):
    """`require_tensorrt` refuses --variant ort before exporting; the parser agrees."""
    export_model(source, tmp_path / "ort", ExportRecipe(max_len=MAX_LEN, variant="ort"))
    errors = parse_errors(tmp_path / "ort")
    assert errors and "GroupQueryAttention" in " ".join(errors)


def test_each_side_weight_is_stored_once_in_the_engine(source, tmp_path):
    """TensorRT for RTX stores a float constant a MatMul multiplies by once per layout its two
    profiles' kernels read: [*, N] as the graph gives it, and [N, *] for a decode of one row
    (max_batch 1, the default). Portable graphs store the projections' and the LM head's side
    weights [N, *] behind a Transpose (`quant_matmul._side_weight`), which it keeps once: each is
    in the engine once, in one layout (docs/PERFORMANCE.md, "TensorRT engine bytes")."""
    out = tmp_path / "int4"  # 32 kept channels: side weights large enough to find whole
    recipe = ExportRecipe(max_len=MAX_LEN, weights="int4", precision="float16", outlier_channels=32)
    export_model(source, out, recipe)
    build_engine(out, out, MAX_PREFILL, 256 << 20)
    plan = (out / ENGINE_FILE).read_bytes()

    def copies(w: np.ndarray) -> int:  # in either layout, found by 32 bytes from its middle
        return sum(plan.count(probe[len(probe) // 2 :][:32]) for probe in (w.tobytes(), w.T.tobytes()))

    side = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out / ONNX_FILE)).graph.initializer}
    side = {name: w for name, w in side.items() if name.endswith(".side_weight")}
    assert f"{HEAD_TABLE}.side_weight" in side
    assert {name: copies(w) for name, w in side.items()} == dict.fromkeys(side, 1)


def test_float16_graphs_store_projection_weights_as_tensorrt_keeps_them_once(source, tmp_path):
    """The same for float weights: a float16 graph stores each projection [N, K] behind a
    Transpose (`Builder.transposed_weight`). The output and down projections are then in the
    engine once (SmolLM2-135M's float16 engine: 481.4 -> 411.9 MiB); the fused QKV and gate/up
    ones, whose products are split, are still kept in both layouts (measured, left so)."""
    out = tmp_path / "float16"
    export_model(source, out, ExportRecipe(max_len=MAX_LEN, precision="float16"))
    build_engine(out, out, MAX_PREFILL, 256 << 20)
    plan = (out / ENGINE_FILE).read_bytes()

    def copies(w: np.ndarray) -> int:  # in either layout, found by 32 bytes from its middle
        return sum(plan.count(probe[len(probe) // 2 :][:32]) for probe in (w.tobytes(), w.T.tobytes()))

    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out / ONNX_FILE)).graph.initializer}
    single = {n: w for n, w in stored.items() if n.endswith((".o.weight.rows", ".down.weight.rows"))}
    assert single and {n: copies(w) for n, w in single.items()} == dict.fromkeys(single, 1)


def test_export_target_tensorrt_end_to_end(source, tmp_path):
    """`kvedge export --target tensorrt --kv-dtype int8` here: graph, engine and engine manifest."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "kvedge", "export", str(source), "--out", str(out), "--target", "tensorrt"]
        + ["--kv-dtype", "int8", "--max-len", str(MAX_LEN), "--max-prefill", "32", "--workspace", "256MiB"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"TensorRT for RTX {trt.__version__}" in done.stdout
    recorded = json.loads((out / "engine_manifest.json").read_text())
    assert recorded["tensorrt_flavour"] == "tensorrt_rtx" and recorded["tensorrt_version"] == trt.__version__
    assert recorded["max_prefill"] == 32 and recorded["strongly_typed"] is True
    assert recorded["precision"] == "float32" and recorded["format_version"] == 2
    assert recorded["max_rows"] == VERIFY_TOKENS
    manifest = Manifest.load(out)
    engine = EngineManifest.load(out)
    engine.check_model(manifest)
    # an RTX engine never loads under Jetson's TensorRT: refused naming both
    with pytest.raises(
        ArtifactMismatch,
        match=f"built with TensorRT for RTX {trt.__version__}, this machine has TensorRT 10.3",
    ):
        engine.check_runtime("10.3.0", GpuInfo("Orin", "8.7", 8), "tensorrt")
    shapes = profile_shapes(manifest, EngineOptions(max_prefill=32))
    assert shapes[0][manifest.names.input_ids][2] == (1, 32)


def test_kvedge_engine_builds_a_folder_exported_elsewhere(source, tmp_path):
    """docs/JETSON.md's way: export on one machine (the form `kvedge plan` recommends for the
    boards), copy the folder, then `kvedge engine FOLDER` builds the engine where the copy is."""
    exported, copied = tmp_path / "x86", tmp_path / "device"
    export_model(source, exported, ACCEPTED["float16-precision-int4-weights-int8-cache"])
    shutil.copytree(exported, copied)
    done = subprocess.run(
        [sys.executable, "-m", "kvedge", "engine", str(copied)]
        + ["--max-prefill", "32", "--max-batch", "2", "--workspace", "256MiB"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].startswith(
        f"built {copied / ENGINE_FILE}: TensorRT for RTX {trt.__version__}"
    )
    engine = EngineManifest.load(copied)
    engine.check_model(Manifest.load(copied))
    assert (engine.max_prefill, engine.max_batch, engine.workspace_bytes) == (32, 2, 256 << 20)
    assert engine.tensorrt_flavour == "tensorrt_rtx" and engine.precision == "float16"
    assert not (exported / ENGINE_FILE).exists()


@pytest.mark.real_model
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_default_model_portable_graph_parses(precision, default_export):
    """SmolLM2-135M, portable, max_len 2048, in both precisions: zero parser errors, strongly
    typed with the graph's dtypes (the build is measured once in docs/JETSON.md, not in CI)."""
    smol = default_export(ExportRecipe(max_len=2048, precision=precision))
    assert parse_errors(smol) == []
    check_strongly_typed(smol)
    assert np.dtype(Manifest.load(smol).geometry.dtype) == np.dtype(precision)
