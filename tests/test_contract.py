"""Manifests: round trip, and refusal of mismatched or tampered artifacts naming both sides."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from tiny import make_tiny_model

from kvedge.contract import MANIFEST_FILE, ONNX_FILE, CacheGeometry, ExportRecipe, Manifest
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.model import Model


def test_manifest_round_trip(tiny_llama):
    manifest = Manifest.load(tiny_llama.out)
    again = Manifest.from_dict(json.loads(manifest.to_json()))
    assert again == manifest
    assert manifest.geometry == CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
    assert manifest.names.layer(manifest.names.past_key, 3) == "past_key_values.3.key"


def test_other_model_or_geometry_is_refused_naming_both(tiny_llama):
    manifest = Manifest.load(tiny_llama.out)
    other = dataclasses.replace(manifest, source_fingerprint="f" * 64)
    with pytest.raises(
        ArtifactMismatch,
        match=f"made from model ffffffffffffffff, this model is {manifest.source_fingerprint[:16]}",
    ):
        manifest.check_compatible(other, "scales file")
    longer = dataclasses.replace(manifest, geometry=dataclasses.replace(manifest.geometry, max_len=256))
    with pytest.raises(ArtifactMismatch, match="'max_len': 256.*'max_len': 128"):
        manifest.check_compatible(longer, "warm cache")


def test_tampered_graph_or_version_is_refused(tiny_llama, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama.out, copy)
    with open(copy / ONNX_FILE, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ArtifactMismatch, match="graph fingerprint .* does not match the manifest's"):
        Model(copy)
    data = json.loads((copy / MANIFEST_FILE).read_text())
    data["format_version"] = 99
    (copy / MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ArtifactMismatch, match="format version 99 does not match this kvedge"):
        Model(copy)


def test_fingerprint_follows_the_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "llama", seed=0)
    b = make_tiny_model(tmp_path / "b", "llama", seed=1)
    ma = export_model(a, tmp_path / "out_a", ExportRecipe(max_len=32))
    mb = export_model(b, tmp_path / "out_b", ExportRecipe(max_len=32))
    assert ma.source_fingerprint != mb.source_fingerprint
    with pytest.raises(ArtifactMismatch):
        ma.check_compatible(mb, "b")


def test_unsupported_architecture_names_it_and_lists_supported(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    with pytest.raises(
        KvedgeError, match="architecture 'gpt2' is not supported; supported: llama .*qwen2 .*mistral"
    ):
        export_model(tmp_path / "gpt2", tmp_path / "out", ExportRecipe(max_len=32))
    assert not (tmp_path / "out").exists()


def test_export_refuses_overwrite_and_bad_options(tiny_llama, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(KvedgeError, match="holds keep.txt, not a kvedge export"):
        export_model(tiny_llama.source, tmp_path / "out", ExportRecipe(max_len=32), force=True)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(KvedgeError, match="--max-len 4 is out of range"):
        ExportRecipe(max_len=4)


@pytest.mark.parametrize("field,value", [("max_len", 64), ("num_kv_heads", 1), ("head_dim", 8)])
def test_manifest_geometry_disagreeing_with_the_graph_is_refused_at_load(tiny_llama, tmp_path, field, value):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama.out, copy)
    data = json.loads((copy / MANIFEST_FILE).read_text())
    data["geometry"][field] = value
    (copy / MANIFEST_FILE).write_text(json.dumps(data))
    manifest = Manifest.load(copy)
    layer0 = manifest.names.layer(manifest.names.past_key, 0)
    good, bad = Manifest.load(tiny_llama.out).graph_inputs(), manifest.graph_inputs()
    graph_shape = next(spec for spec in good if spec.name == layer0).describe()
    said = next(spec for spec in bad if spec.name == layer0).describe()
    with pytest.raises(ArtifactMismatch) as refused:
        Model(copy, verify=False)
    message = str(refused.value)
    assert "\n" not in message and f"graph input {layer0}" in message
    assert f"the manifest says {said}, the graph has {graph_shape}" in message


def test_graph_interface_follows_variant_and_logits(tiny_llama):
    manifest = Manifest.load(tiny_llama.out)
    g, names = manifest.geometry, manifest.names
    inputs = {spec.name: spec for spec in manifest.graph_inputs()}
    assert (names.position_ids in inputs) == (not manifest.in_place)
    assert (names.last_index in inputs) == (manifest.logits != "all")
    rows = 2 if manifest.logits == "rows" else 1  # a rows graph's logits follow last_index [batch, rows]
    if names.last_index in inputs:
        assert inputs[names.last_index].shape(3, 5, rows) == (
            (3, rows) if manifest.logits == "rows" else (3,)
        )
    assert inputs[names.layer(names.past_value, 1)].shape(3, 5) == g.layer_shape(3)
    logits, *present = manifest.graph_outputs()
    assert logits.shape(3, 5, rows) == (3, 5 if manifest.logits == "all" else rows, manifest.vocab_size)
    assert len(present) == g.num_layers * len(names.present(g.quantized))
    new_len = g.max_len if manifest.in_place else 5
    assert present[0].shape(3, 5) == (3, g.num_kv_heads, new_len, g.head_dim)


@pytest.mark.parametrize(
    "text,message",
    [
        ("[1, 2]", "expected a JSON object, found a list"),
        ('"manifest"', "expected a JSON object, found a str"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("{", "not valid JSON"),
        (
            '{"format": "kvedge-manifest", "format_version": "1"}',
            r"Expected `int`, got `str` - at `\$.format_version`",
        ),
    ],
)
def test_manifest_that_is_not_a_manifest_object_is_refused(tiny_llama, tmp_path, text, message):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama.out, copy)
    (copy / MANIFEST_FILE).write_text(text)
    with pytest.raises(ArtifactMismatch, match=message):
        Manifest.load(copy)


@pytest.mark.parametrize(
    "path,value,message",
    [
        (("geometry", "max_len"), "128", r"Expected `int`, got `str` - at `\$.geometry.max_len`"),
        (("geometry", "num_layers"), True, r"Expected `int`, got `bool` - at `\$.geometry.num_layers`"),
        (("geometry",), [2, 2, 16, 128], r"Expected `object`, got `array` - at `\$.geometry`"),
        (("eos_token_ids",), 2, r"Expected `array`, got `int` - at `\$.eos_token_ids`"),
        (("names", "logits"), None, r"Expected `str`, got `null` - at `\$.names.logits`"),
        (("geometry", "max_len"), 0, "max_len=0 must be a positive integer"),
    ],
)
def test_manifest_field_of_the_wrong_type_is_refused_naming_it(tiny_llama, path, value, message):
    data = json.loads(Manifest.load(tiny_llama.out).to_json())
    *parents, last = path
    target = data
    for key in parents:
        target = target[key]
    target[last] = value
    with pytest.raises(ArtifactMismatch, match=message):
        Manifest.from_dict(data)
