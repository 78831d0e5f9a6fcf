"""Gemma 4 in the planner and configs/models: the cards' cache is the one `kvedge export` makes,
their parameters are transformers' count, the weight bytes planned are the files an export
writes, and the per-layer table sits on a line of its own, out of the totals."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
import yaml
from tiny import card_architecture, gemma4_supported, make_tiny_model, tiny_config

from kvedge.configs import Architecture, load_recipe
from kvedge.contract import PER_LAYER_FILE, ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model, gemma4_geometry
from kvedge.planner import device_forms, estimate, footprint, make_plan, recipe_weight_bytes, render
from kvedge.planner.budget import board_budget
from kvedge.planner.recommend import measured_kl, quality_note, recommend
from kvedge.planner.weights import per_layer_bytes

pytestmark = pytest.mark.skipif(
    not gemma4_supported(), reason="Gemma 4 needs transformers 5.25 (kv_sharing_modes); this one is older"
)

CARDS = {"gemma-4-e2b": 36_864, "gemma-4-e4b": 114_688}  # float32 cache bytes per token


@pytest.mark.parametrize("card", sorted(CARDS))
def test_a_cards_cache_and_parameters_are_the_exports_and_transformers(card):
    """The recipe's cache equals the exporter's from the same numbers as a transformers config, in
    both variants (shared layers hold none, sliding layers on rings of head_dim 256, the ort
    variant's max_len long), and its param_count is what transformers builds from them."""
    from kvedge.bench.checkpoint import hf_config
    from kvedge.export.streamed import skeleton

    config, params = hf_config(card)
    recipe = load_recipe(card)
    geometry = recipe.geometry()
    assert geometry == gemma4_geometry(config, recipe.export.max_len, "portable")
    ort = recipe.geometry(variant="ort")
    assert ort == gemma4_geometry(config, recipe.export.max_len, "ort") and ort.ring_len == ort.max_len
    assert geometry.bytes_per_token() == CARDS[card]
    assert len(geometry.shared_layers) == config.num_kv_shared_layers and geometry.ring_dim == 256
    model = skeleton(config)
    tied = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    assert tied == {"lm_head.weight"}
    assert sum(p.numel() for n, p in model.named_parameters() if n not in tied) == params
    table = model.model.embed_tokens_per_layer.weight.numel()
    assert recipe.architecture.per_layer_params == table


def _architecture(config, params: int) -> Architecture:
    """`config` (a tiny Gemma 4 whose layers alternate sliding and global) as a recipe's."""
    sliding, full = (config.per_layer_config[kind] for kind in ("sliding_attention", "full_attention"))
    return card_architecture(
        config,
        params,
        family="gemma4_text",
        num_kv_heads=sliding.num_key_value_heads,
        head_dim=sliding.head_dim,
        sliding_window=config.sliding_window,
        sliding_window_pattern=2,
        global_head_dim=full.head_dim,
        num_kv_shared_layers=config.num_kv_shared_layers,
        hidden_size_per_layer_input=config.hidden_size_per_layer_input,
        vocab_size_per_layer_input=config.vocab_size_per_layer_input,
        use_double_wide_mlp=config.use_double_wide_mlp,
    )


@pytest.fixture(scope="module")
def mid_gemma4(tmp_path_factory):
    """(source, its Architecture, root): a random Gemma 4 wide enough that its matrices make the
    files (every K a multiple of 32), with shared layers of each kind, double-wide MLPs and
    per-layer inputs."""
    root = tmp_path_factory.mktemp("mid-gemma4")
    shape = dict(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        layer_types=["sliding_attention", "full_attention"] * 3,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=32,
    )
    source = make_tiny_model(root / "hf", "gemma4", **shape)
    params = sum(a.size for a in safetensors.numpy.load_file(source / "model.safetensors").values())
    return source, _architecture(tiny_config("gemma4", **shape), params), root


@pytest.mark.parametrize("weights", ["float32", "float16", "int8", "int4"])
def test_planned_weight_and_table_bytes_match_an_export(mid_gemma4, weights):
    """Each layer's projections at its own head_dim and MLP width, Q alone on a shared layer, the
    per-layer gate, projection and model projection: planned within 1% + 48 KiB a layer (the
    graph's own nodes, which the planner leaves out: a Gemma 4 layer's ring attention, shared
    reads and per-layer input make about 48 KiB of them here, against tests/test_planner.py's
    96 KiB for a whole Llama); the per-layer table's file to the byte, and out of the weights."""
    source, arch, root = mid_gemma4
    form = ExportRecipe(max_len=64, weights=weights)
    out = root / weights
    export_model(source, out, form)
    found = footprint(out)
    assert found.per_layer_bytes == (out / PER_LAYER_FILE).stat().st_size == per_layer_bytes(arch, form)
    planned = recipe_weight_bytes(arch, form)
    assert abs(planned - found.weights_bytes) <= 0.01 * found.weights_bytes + 48 * 1024 * arch.num_layers, (
        planned,
        found.weights_bytes,
    )


def test_the_table_is_on_its_own_line_and_out_of_the_totals():
    """E2B int4 on an Orin Nano: the plan names the table's file and bytes on a line of its own,
    and no total counts it; the KV line says how many layers hold KV and how many read another's."""
    model = footprint("gemma-4-e2b", ExportRecipe(weights="int4"))
    assert model.per_layer_bytes == 2 * 2_348_810_240 + 128  # float16 beside quantized weights
    cell = estimate(model, 1, 4096, device="tensorrt")
    assert cell.mapped == model.per_layer_bytes
    assert cell.total == cell.weights + cell.load + cell.kv + cell.activations + cell.runtime
    text = render(make_plan(model, board_budget(load_recipe_board()), "tensorrt"))
    assert "per-layer    4.38 GiB per_layer_embeddings.npy (float16), mapped" in text
    assert "(15 of 35 layers hold KV; 20 read an earlier layer's)" in text


def load_recipe_board():
    from kvedge.configs import load_board

    return load_board("orin-nano-8gb")


def test_the_planner_offers_only_what_export_builds_and_recommends_only_what_was_measured():
    """Gemma 4's graphs compute in float32 or float16 (portable), and the ort one takes no float16
    cache: the forms the planner weighs are those, the ort float16 cache refused as the export
    refuses it, and since only the float32 form's quality is measured on Gemma 4 no smaller form,
    float16 included, is recommended: each is offered with its quality unmeasured."""
    model = footprint("gemma-4-e2b")
    assert model.float32_only
    for device in ("cpu", "cuda", "tensorrt"):
        forms = device_forms(model.form, device, model.family)
        assert forms and not [f for f in forms if (f.variant, f.kv_dtype) == ("ort", "float16")]
    assert {f.variant for f in device_forms(model.form, "cpu", model.family)} == {"portable", "ort"}
    trt = device_forms(model.form, "tensorrt", model.family)
    assert {f.precision for f in trt} == {"float32", "float16"}
    # the float16 graph with int4 weights and the INT8 cache, TensorRT's recommended form elsewhere
    half = [f for f in trt if f.half and (f.weights, f.kv_dtype) == ("int4", "int8")]
    assert half and all(measured_kl(f, model.float32_only) is None for f in half)
    assert "unmeasured" in quality_note(half[0], model.float32_only)
    assert footprint("gemma-4-e2b", ExportRecipe(precision="float16")).form.half
    found = recommend("agx-orin-64gb", "gemma-4-e2b", "tensorrt")
    assert found is not None and found.kl == 0.0 and not found.form.quantized and not found.form.half
    assert recommend("orin-nano-8gb", "gemma-4-e2b", "tensorrt") is None
    plan = ["plan", "gemma-4-e2b", "--profile", "orin-nano-8gb", "--device", "tensorrt"]
    done = subprocess.run(
        [sys.executable, "-m", "kvedge", *plan], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # what fits the Orin Nano is a float16 graph, named with its quality unmeasured
    assert "the smallest change that does: --precision float16 " in done.stdout
    assert "(quality unmeasured)" in done.stdout and "kv cache     float16:" in done.stdout


@pytest.mark.parametrize(
    "change, key",
    [
        ({"global_head_dim": None}, "architecture.global_head_dim: missing"),
        ({"num_kv_shared_layers": 35}, "architecture.num_kv_shared_layers: 35 is not allowed"),
        ({"num_kv_shared_layers": 32}, "architecture.num_kv_shared_layers: 32 is not allowed: each shared"),
    ],
)
def test_a_gemma4_card_missing_or_wrong_is_refused_by_key(tmp_path, change, key):
    data = yaml.safe_load(load_recipe("gemma-4-e2b").path.read_text())
    data["architecture"].update(change)
    data["architecture"] = {k: v for k, v in data["architecture"].items() if v is not None}
    path = tmp_path / "gemma-4-e2b.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(KvedgeError, match=key):
        load_recipe(path)


def test_gemma4_fields_on_another_family_are_refused(tmp_path):
    data = yaml.safe_load(load_recipe("llama-3.2-1b").path.read_text())
    data["architecture"]["num_kv_shared_layers"] = 4
    path = tmp_path / "llama-3.2-1b.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(KvedgeError, match="num_kv_shared_layers: only for 'gemma4_text', not 'llama'"):
        load_recipe(path)


@pytest.mark.parametrize("card", sorted(CARDS))
def test_the_projections_planned_are_transformers_matrices(card):
    """The planner's [K, N] products (each layer's Q, K and V at its head_dim, Q alone on a shared
    layer, the shared layers' double-wide MLPs, the per-layer gate, projection and model
    projection) hold what transformers' matrices hold, the tables aside."""
    from kvedge.bench.checkpoint import hf_config
    from kvedge.export.streamed import skeleton
    from kvedge.planner.weights import layer_matmuls

    config, _ = hf_config(card)
    tables = ("embed_tokens.weight", "embed_tokens_per_layer.weight")
    matrices = [
        p
        for n, p in skeleton(config).named_parameters()
        if p.dim() == 2 and not n.endswith(tables) and "lm_head" not in n
    ]
    a = load_recipe(card).architecture
    assert sum(k * n for k, n in layer_matmuls(a)) == sum(p.numel() for p in matrices)
    fused = 2 * len(a.kv_layers) + a.num_layers  # K and V into Q where stored; up into gate
    assert len(layer_matmuls(a)) == len(matrices) - fused


def test_info_names_the_layers_that_hold_kv_the_rings_the_shared_and_the_table(tmp_path):
    """`kvedge info` on a Gemma 4 export shows the saving: which layers hold KV, the rings at their
    own head_dim, which layers store none and whose KV they read, the table mapped from its file."""
    source = make_tiny_model(tmp_path / "hf", "gemma4", seed=3)
    export_model(source, tmp_path / "out", ExportRecipe(max_len=128))
    done = subprocess.run(
        [sys.executable, "-m", "kvedge", "info", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.strip().split("  ", 1) for line in done.stdout.splitlines())
    assert lines["KV layers"] == "0, 1, 2, 3"
    assert lines["ring layers"] == "3 of 4 hold the last 72 tokens (window 8 + 64) of 16 dim"
    assert lines["shared KV"] == "layers 4, 5, 6 store none and read layer 1 or 3's"
    assert lines["per-layer"].startswith("per_layer_embeddings.npy [320, 112] float32,")


def test_the_ort_cache_is_planned_at_full_length():
    """The ort variant's sliding layers hold max_len positions (rings that never wrap, as its
    export makes them): planned at full length, not at the portable rings' window + 64; Gemma 3's
    ort graph, with no rings at all, likewise."""
    for card, layers in (("gemma-4-e2b", 15), ("gemma-3-1b", 26)):
        portable = footprint(card, ExportRecipe(weights="int4"))
        ort = footprint(card, ExportRecipe(variant="ort", weights="int4"))
        g = ort.geometry
        assert g.num_layers == layers and g.bytes_per_slot() == g.bytes_per_token() * g.max_len
        assert portable.geometry.bytes_per_slot() < 0.5 * g.bytes_per_slot()


def test_the_text_part_of_a_gemma4_checkpoint_exports_and_matches_it(tmp_path):
    """A checkpoint saved as Gemma 4's multimodal model (Gemma4ForConditionalGeneration: a vision
    tower beside model.language_model.*) exports its text decoder, read a tensor at a time with
    the tower left unread, and its logits at each decode step past the ring are the checkpoint's
    own on text (within tests/test_gemma4.py's 1e-4)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from kvedge.export.source import load_hf, resolve_source, stream_source
    from kvedge.runtime.generate import decode_one_token, prefill
    from kvedge.runtime.model import Model

    text = tiny_config("gemma4")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    vision.update(num_key_value_heads=2, head_dim=16, global_head_dim=16)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=vision))
    model.eval().save_pretrained(tmp_path / "vl")
    make_tiny_model(tmp_path / "text", "gemma4")  # its tokenizer files
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tmp_path / "text" / name).exists():
            (tmp_path / "vl" / name).write_bytes((tmp_path / "text" / name).read_bytes())
    streamed = stream_source(resolve_source(tmp_path / "vl"))
    assert streamed is not None and streamed.streamed
    assert not [name for name in streamed.weights if "vision" in name]
    export_model(tmp_path / "vl", tmp_path / "out", ExportRecipe(max_len=256))
    ids = torch.randint(3, text.vocab_size, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    exported = Model(tmp_path / "out")
    found = [prefill(exported.backend, exported.cache, 0, [ids[:40]])[0]]  # then past the ring (72)
    found += [decode_one_token(exported.backend, exported.cache, 0, [t])[0] for t in ids[40:]]
    assert abs(np.stack(found) - expected[39:]).max() < 1e-4
    whole, _ = load_hf(resolve_source(tmp_path / "vl"))  # loaded whole, as a quantized one would be
    with torch.no_grad():
        assert abs(whole(torch.tensor([ids])).logits[0].numpy() - expected).max() < 1e-5
    tensors = safetensors.numpy.load_file(tmp_path / "vl" / "model.safetensors")
    del tensors["model.language_model.norm.weight"]
    safetensors.numpy.save_file(tensors, tmp_path / "vl" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KvedgeError, match="1 of the model's tensors are not in its files .first: model.norm"):
        export_model(tmp_path / "vl", tmp_path / "cut", ExportRecipe(max_len=256))
