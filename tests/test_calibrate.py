"""INT8 KV: quantizer math, calibration, scales files, and quality of a quantized cache."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny import make_tiny_model

from kvedge.calibrate.calibrate import CalibrationOptions, builtin_prompts, calibrate, read_prompts
from kvedge.calibrate.evaluate import evaluate, kv_bytes_ratio
from kvedge.contract import ExportRecipe
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.quant import (
    SCALES_FILE,
    SCALES_MANIFEST,
    RoundTrip,
    Scales,
    Scheme,
    dequantize,
    dynamic_scales,
    expand,
    hadamard,
    quantize,
    scales_from_thresholds,
    thresholds,
)
from kvedge.runtime.model import Model

PROMPTS = [
    {"messages": [{"role": "user", "content": p}]}
    for p in ("Hello! How are you?", "What is the capital of France?", "The quick brown fox.")
]


@pytest.fixture(scope="module")
def scales_dir(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("scales")
    calibrate(Model(tiny_llama.out), PROMPTS, CalibrationOptions(method="mse", group_size=16)).save(folder)
    return folder


@pytest.mark.parametrize("group", [4, 8, 16])
def test_round_trip_error_is_bounded_by_half_a_step_per_group(group):
    x = (
        np.random.default_rng(0).standard_normal((50, 2, 16)).astype(np.float32)
        * np.array([1.0, 8.0], np.float32)[None, :, None]
    )
    scale = scales_from_thresholds(thresholds(x, group, "minmax"))  # [heads, groups]
    per_channel = expand(scale, group)[None]  # [1, heads, d]
    back = dequantize(quantize(x, per_channel), per_channel)
    assert (np.abs(back - x) <= per_channel / 2 + 1e-7).all()
    dyn = expand(dynamic_scales(x, group), group)
    assert (np.abs(dequantize(quantize(x, dyn), dyn) - x) <= dyn / 2 + 1e-7).all()


def test_threshold_methods_order_and_mse_wins_on_its_objective():
    x = np.random.default_rng(1).standard_normal((400, 1, 8)).astype(np.float32)
    x[3, 0, 2] = 40.0  # an outlier that minmax must cover
    t = {m: thresholds(x, 8, m, percentile=99.0) for m in ("minmax", "percentile", "mse")}
    assert t["percentile"][0, 0] < t["minmax"][0, 0] and t["mse"][0, 0] <= t["minmax"][0, 0]

    def mse(th):
        s = scales_from_thresholds(th)[0, 0]
        return float(((dequantize(quantize(x, s), s) - x) ** 2).mean())

    assert mse(t["mse"]) <= mse(t["minmax"])


def test_scales_round_trip_and_refusals(tiny_llama, scales_dir, tmp_path):
    manifest = Model(tiny_llama.out).manifest
    scales = Scales.load(scales_dir, manifest)
    assert scales.k_scale.shape == (2, 2, 1) and scales.manifest.group_size == 16
    assert scales.manifest.calibration_prompts == 3 and len(scales.manifest.layer_errors["k_group_rel"]) == 2
    other = export_model(
        make_tiny_model(tmp_path / "b", "llama", seed=5), tmp_path / "b_out", ExportRecipe(max_len=32)
    )
    # one wording for every artifact (kvedge.contract.header): the field, then both values
    expected = f"model is '{manifest.source_fingerprint[:16]}', expected '{other.source_fingerprint[:16]}'"
    with pytest.raises(ArtifactMismatch, match=expected):
        Scales.load(scales_dir, other)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in scales_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / SCALES_FILE).write_bytes((copy / SCALES_FILE).read_bytes()[:-10])
    with pytest.raises(ArtifactMismatch, match="does not match its manifest"):
        Scales.load(copy, manifest)


def test_scales_manifest_of_the_wrong_shape_or_type_is_refused(tiny_llama, scales_dir, tmp_path):
    manifest = Model(tiny_llama.out).manifest
    data = json.loads((scales_dir / SCALES_MANIFEST).read_text())
    cases = [
        ([data], "expected a JSON object, found a list"),
        ({**data, "group_size": "16"}, r"Expected `int`, got `str` - at `\$.group_size`"),
        (
            {**data, "layer_errors": {"k_rel": ["x"]}},
            r"Expected `float`, got `str` - at `\$.layer_errors\[...\]\[0\]`",
        ),
        ({**data, "format_version": 2}, "format version 2 does not match this kvedge"),
        ({**data, "geometry": {**data["geometry"], "head_dim": 8}}, 'cache geometry is {"head_dim": 8'),
    ]
    for bad, message in cases:
        copy = tmp_path / "copy"
        copy.mkdir(exist_ok=True)
        (copy / SCALES_FILE).write_bytes((scales_dir / SCALES_FILE).read_bytes())
        (copy / SCALES_MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(ArtifactMismatch, match=message):
            Scales.load(copy, manifest)


def test_bad_calibration_sets_are_refused(tmp_path, tiny_llama):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(KvedgeError, match="is empty"):
        read_prompts(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 1}\n')
    with pytest.raises(KvedgeError, match='bad.jsonl:1: each line needs "text"'):
        read_prompts(bad)
    with pytest.raises(KvedgeError, match="unreadable"):
        read_prompts(tmp_path / "missing.txt")
    assert len(builtin_prompts()) >= 64 and len(builtin_prompts("heldout")) >= 20
    assert not {json.dumps(p) for p in builtin_prompts()} & {
        json.dumps(p) for p in builtin_prompts("heldout")
    }


def test_nan_statistics_are_refused_and_nothing_written(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "llama")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] = float("nan")
    model.save_pretrained(source)
    export_model(source, tmp_path / "out", ExportRecipe(max_len=64))
    with pytest.raises(KvedgeError, match="NaN or inf"):
        calibrate(Model(tmp_path / "out"), PROMPTS, CalibrationOptions(group_size=16))
    assert not (tmp_path / "scales").exists()


def test_int8_cache_stays_close_to_fp32(tiny_llama, scales_dir):
    """Stated bound for the tiny random model: mean KL < 0.02 nats and top-1 >= 90% over 24
    teacher-forced positions (random weights make logits peaky; measured ~1e-3)."""
    model = Model(tiny_llama.out)
    scales = Scales.load(scales_dir, model.manifest)
    schemes = (
        Scheme(k="static-group", v="dynamic-token", group_size=16, v_group_size=16),
        Scheme(k="static-tensor", v="static-tensor", group_size=16),
    )
    results = evaluate(model, scales, builtin_prompts("heldout")[:4], tokens=24, schemes=schemes, batch=2)
    for r in results:
        assert 0.0 <= r.kl_mean < 0.02 and r.top1_agreement >= 0.9, r
    assert kv_bytes_ratio(Scheme(), head_dim=64) <= 0.27  # the default scheme on SmolLM2's head_dim


def test_cli_calibrate_and_eval(tiny_llama, tmp_path):
    out = tmp_path / "scales"

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, timeout=600
        )

    done = run("calibrate", "--model", str(tiny_llama.out), "--out", str(out), "--kv-group-size", "16")
    assert done.returncode == 0, done.stderr
    assert (out / "kv_scales.png").stat().st_size > 1000
    again = run("calibrate", "--model", str(tiny_llama.out), "--out", str(out))
    assert again.returncode != 0 and "pass --force" in again.stderr and "Traceback" not in again.stderr
    report = run(
        "eval-kv",
        "--model",
        str(tiny_llama.out),
        "--scales",
        str(out),
        "--limit",
        "2",
        "--tokens",
        "8",
        "--out",
        str(tmp_path / "q.json"),
    )
    assert report.returncode == 0, report.stderr
    assert len(json.loads((tmp_path / "q.json").read_text())["schemes"]) == 3


def test_short_scheme_names_parse_and_bad_ones_name_what_is_allowed():
    scheme = Scheme.parse("int4-g16-hadamard-sinks4")
    assert (scheme.bits, scheme.group_size, scheme.v_group_size, scheme.rotation, scheme.n_sink) == (
        4,
        16,
        16,
        "hadamard",
        4,
    )
    assert scheme.dynamic and scheme.qmax == 7 and scheme.name.startswith("int4 K dynamic-token")
    per_token = Scheme(k="dynamic-token", v="dynamic-token", group_size=32, v_group_size=32)
    assert Scheme.parse("int8") == per_token
    for bad in ("int3", "int4-g7", "int4-rotate", "int4-g32-sinks99"):
        with pytest.raises(KvedgeError, match="not allowed"):
            Scheme.parse(bad)
    with pytest.raises(KvedgeError, match="dynamic-token only"):
        Scheme(k="static-group", bits=4)
    # 4-bit codes two to a byte plus a float16 scale per 32 channels: q4_0's 18 bytes per 32 values
    assert kv_bytes_ratio(Scheme.parse("int4-g32"), head_dim=64) == pytest.approx(18 / 128)


def test_hadamard_is_orthonormal_and_keeps_dot_products():
    h = hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    x, y = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    assert float((x @ h) @ (y @ h)) == pytest.approx(float(x @ y), rel=1e-5)
    with pytest.raises(KvedgeError, match="power-of-2 head_dim, not 48"):
        hadamard(48)


def test_a_4_bit_round_trip_lies_on_its_grid_and_a_rotation_spreads_an_outlier():
    """Per token and group, 4-bit codes in [-7, 7] times a float16 scale; a Hadamard rotation
    quantizes x H, so one outlier channel no longer sets the scale of the whole group."""
    rng = np.random.default_rng(1)
    block = rng.standard_normal((2, 2, 3, 5, 64)).astype(np.float32)  # [layers, K/V, heads, n, d]
    block[..., 7] *= 30  # an outlier channel, as keys have
    plain, rotated = block.copy(), block.copy()
    RoundTrip(Scheme.parse("int4-g32"), None)(plain)
    grid = plain.reshape(*plain.shape[:-1], 2, 32)
    steps = np.abs(grid).max(axis=-1, keepdims=True) / 7
    np.testing.assert_allclose(grid / steps, np.rint(grid / steps), atol=1e-3)
    RoundTrip(Scheme.parse("int4-g32-hadamard"), None)(rotated)
    error = {name: float(np.linalg.norm(x - block)) for name, x in (("plain", plain), ("rotated", rotated))}
    assert error["rotated"] < error["plain"] / 2, error  # measured 15.1 against 34.7
    sinks = block.copy()
    RoundTrip(Scheme.parse("int4-g32-sinks4"), None)(sinks, start=2)
    np.testing.assert_array_equal(sinks[:, :, :, :2], block[:, :, :, :2])  # positions 2, 3
    assert not np.array_equal(sinks[:, :, :, 2:], block[:, :, :, 2:])
    with pytest.raises(KvedgeError, match="needs calibrated scales"):
        RoundTrip(Scheme(), None)
