"""configs/devices and configs/models: the shipped files load, and bad files are refused naming
the file, the key and what is allowed; a board's service config is what the planner says fits it."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
import yaml

from kvedge.cli import main
from kvedge.configs import (
    BOARDS_DIR,
    DELTANET_FIELDS,
    MODELS_DIR,
    RENAMED,
    Architecture,
    available,
    load_board,
    load_recipe,
    renamed,
)
from kvedge.contract import MANIFEST_FILE, ExportRecipe
from kvedge.contract.engine import ProfileSizes
from kvedge.errors import KvedgeError
from kvedge.planner import recommend
from kvedge.serve.config import RENAMED as RENAMED_SERVICE_KEYS
from kvedge.serve.config import load_service_config

SERVICES_DIR = Path(__file__).resolve().parents[1] / "configs" / "services"


def test_shipped_device_profiles_load():
    assert available(BOARDS_DIR) == ["agx-orin-32gb", "agx-orin-64gb", "orin-nano-8gb", "orin-nx-16gb"]
    nano = load_board("orin-nano-8gb")
    assert (nano.memory_bytes, nano.memory_bandwidth_gbps, nano.compute_capability) == (8 << 30, 68.0, "8.7")
    assert all(load_board(name).compute_capability == "8.7" for name in available(BOARDS_DIR))


def llama_family_params(a: Architecture) -> int:
    """Parameters of a Llama/Qwen2/Mistral/Qwen3/Phi-3/Gemma 3 decoder, from its shape alone (Phi-3's
    fused projections hold the same weights; Qwen3 and Gemma 3 add a head_dim-sized norm on Q and
    on K; Gemma 3 has four hidden-sized norms per layer, not two)."""
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    attention = a.hidden_size * (q + 2 * kv) + q * a.hidden_size + (q + 2 * kv if a.attention_bias else 0)
    layer = attention + 3 * a.hidden_size * a.intermediate_size + 2 * a.hidden_size  # + two RMSNorms
    layer += 2 * a.head_dim if a.family in ("qwen3", "gemma3_text") else 0
    layer += 2 * a.hidden_size if a.family == "gemma3_text" else 0
    embeddings = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    return a.num_layers * layer + embeddings + a.hidden_size  # + final norm


@pytest.mark.parametrize(
    "name",
    [
        "smollm2-135m",
        "qwen2.5-0.5b",
        "tinyllama-1.1b",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "phi-4-mini",
        "phi-3.5-mini",
        "smollm3-3b",
        "gemma-3-1b",
    ],
)
def test_recipe_param_count_matches_its_architecture(name):
    recipe = load_recipe(name)
    assert recipe.architecture.param_count == llama_family_params(recipe.architecture)
    assert recipe.geometry().max_len == recipe.export.max_len


def test_recipe_geometry_is_the_cache_geometry():
    g = load_recipe("smollm2-135m").geometry(max_len=4096, kv_dtype="float16")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.max_len, g.dtype) == (30, 3, 64, 4096, "float16")


HYBRIDS = ["lfm2-1.2b", "lfm2.5-1.2b", "qwen3.5-0.8b", "qwen3.5-4b"]


def hf_config(a: Architecture, **extra):
    """The transformers config of a hybrid recipe's architecture, from the recipe's numbers."""
    from transformers import Lfm2Config, Qwen3_5TextConfig

    common = dict(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings,
        layer_types=list(a.layer_types),
        **extra,
    )
    if a.family == "lfm2":  # the recipe's intermediate_size is the MLP's real width: no adjusting
        return Lfm2Config(**common, conv_L_cache=a.conv_kernel, block_auto_adjust_ff_dim=False)
    return Qwen3_5TextConfig(
        **common,
        head_dim=a.head_dim,
        linear_conv_kernel_dim=a.conv_kernel,
        linear_num_key_heads=a.linear_num_key_heads,
        linear_num_value_heads=a.linear_num_value_heads,
        linear_key_head_dim=a.linear_key_head_dim,
        linear_value_head_dim=a.linear_value_head_dim,
    )


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_recipe_geometry_is_the_one_export_makes(name):
    """A hybrid recipe's cache (KV layers, per-slot states) equals what `kvedge export` makes of a
    transformers config with the same numbers, and its param_count is that model's, counted."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvedge.export.export import geometry_from_config

    recipe = load_recipe(name)
    config = hf_config(recipe.architecture)
    for max_len in (recipe.export.max_len, 64):
        assert recipe.geometry(max_len=max_len) == geometry_from_config(config, max_len)
    assert recipe.geometry().states and recipe.geometry().kv_layers
    with torch.device("meta"):  # sizes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    assert recipe.architecture.param_count == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("lfm2", {}),
        ("lfm2", {"layer_types": ["full_attention", "conv", "full_attention"], "conv_L_cache": 4}),
        ("lfm2", {"conv_L_cache": 1}),  # a width-1 convolution keeps no state
        ("qwen3_5", {}),
        ("qwen3_5", {"linear_conv_kernel_dim": 1, "linear_num_value_heads": 2}),
    ],
)
def test_a_tiny_hybrid_recipe_has_the_exports_geometry(tmp_path, family, overrides):
    """The same check at a small scale, on the tests' tiny configs and their variations."""
    from tiny import tiny_config

    from kvedge.export.export import geometry_from_config

    config = tiny_config(family, **overrides)
    fields = dict(layer_types=list(config.layer_types))
    if family == "lfm2":
        fields.update(conv_kernel=config.conv_L_cache)
    else:
        fields.update(conv_kernel=config.linear_conv_kernel_dim)
        fields.update({k: getattr(config, k) for k in DELTANET_FIELDS})
    data = {
        "name": "tiny",
        "description": "a tiny hybrid",
        "source": "default",
        "architecture": {
            "family": config.model_type,
            "num_layers": config.num_hidden_layers,
            "num_heads": config.num_attention_heads,
            "num_kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "max_position_embeddings": config.max_position_embeddings,
            "param_count": 1,
            **fields,
        },
        "export": {"max_len": 64, "max_prefill": 64},
    }
    recipe = load_recipe(_write(tmp_path, data, "tiny"))
    assert recipe.geometry() == geometry_from_config(config, 64)
    assert recipe.geometry(kv_dtype="int8") == geometry_from_config(config, 64).with_dtype("int8")


def _write(tmp_path: Path, data, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


DEVICE_CASES = [
    (lambda d: d.pop("memory_bytes"), "memory_bytes: missing (required)"),
    (lambda d: d.update(memory_bytes="8GB"), "memory_bytes: '8GB' is not allowed; allowed: an integer >= 1"),
    (lambda d: d.update(memry_bytes=1), "memry_bytes: unknown key; allowed keys: compute_capability, "),
    (lambda d: d.update(memory_bandwidth_gbps=-1), "memory_bandwidth_gbps: -1 is not allowed"),
    (lambda d: d.update(compute_capability=8.7), "compute_capability: write it quoted ('8.7')"),
    (
        lambda d: d.update(compute_capability="sm87"),
        "compute_capability: 'sm87' is not allowed; allowed: 'major.minor'",
    ),
    (lambda d: d["gpu"].update(cuda_cores=0), "gpu.cuda_cores: 0 is not allowed; allowed: an integer >= 1"),
    (  # the advice it held drifted from what fits; the planner computes it now
        lambda d: d.update(recommended={"weights": ["float16", "int8"], "kv": ["int8"]}),
        "recommended: no longer read; remove it: `kvedge plan MODEL --profile NAME` computes",
    ),
    (lambda d: d.update(name="orin"), "name: 'orin' must equal the file name 'orin-nano-8gb'"),
    (
        lambda d: d["gpu"].update(rt_cores=2),
        "gpu.rt_cores: unknown key; allowed keys: cuda_cores, tensor_cores",
    ),
    (lambda d: d.update(gpu=1024), "gpu: expected a mapping of keys, got int"),
]


@pytest.mark.parametrize(("mutate", "message"), DEVICE_CASES)
def test_bad_device_profile_is_refused_naming_file_and_key(tmp_path, mutate, message):
    data = yaml.safe_load((BOARDS_DIR / "orin-nano-8gb.yaml").read_text())
    mutate(data)
    path = _write(tmp_path, data, "orin-nano-8gb")
    with pytest.raises(KvedgeError) as error:
        load_board(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


RECIPE_CASES = [
    (
        lambda d: d["architecture"].update(family="gpt2"),
        "architecture.family: 'gpt2' is not allowed; allowed: llama, qwen2, mistral",
    ),
    (
        lambda d: d["architecture"].update(num_kv_heads=4),
        "architecture.num_kv_heads: 4 does not divide num_heads=9",
    ),
    (
        lambda d: d["architecture"].update(tie_word_embeddings="yes"),
        "architecture.tie_word_embeddings: 'yes' is not allowed; allowed: true, false",
    ),
    (lambda d: d["architecture"].pop("head_dim"), "architecture.head_dim: missing (required)"),
    (
        lambda d: d["export"].update(max_len=100000),
        "export.max_len: 100000 is not allowed; allowed: 16..8192",
    ),
    (
        lambda d: d["export"].update(max_prefill=4096),
        "export.max_prefill: 4096 is not allowed; allowed: 1..2048",
    ),
    (
        lambda d: d["export"].update(logits="first"),
        "export.logits: 'first' is not allowed; allowed: rows, last, all",
    ),
    (
        lambda d: d["export"].update(weights="int3"),
        "export: --weights 'int3' is not allowed; allowed: ['float16', 'float32', 'int4', 'int8']",
    ),
    (
        lambda d: d["export"].update(weights_dtype="float16"),
        "'export.weights_dtype' is the old name of 'export.weights'; keep only 'export.weights'",
    ),
    (
        lambda d: d["export"].update(kv_dtype="int3"),
        "export.kv_dtype: cache geometry: dtype='int3' is not supported; allowed:",
    ),
    (lambda d: d["export"].update(max_len=8), "export.max_len: 8 is not allowed; allowed: an integer >= 16"),
    (
        lambda d: d["export"].update(max_batch=1.5),
        "export.max_batch: 1.5 is not allowed; allowed: an integer >= 1",
    ),
    (lambda d: d["export"].update(max_lenn=1), "export.max_lenn: unknown key"),
    (
        lambda d: d.update(sauce=1),
        "sauce: unknown key; allowed keys: architecture, description, export, name,",
    ),
    (lambda d: d.update(export=[1, 2]), "export: expected a mapping of keys, got list"),
]


HYBRID_CASES = [
    (
        "smollm2-135m",
        lambda a: a.update(conv_kernel=3),
        "architecture.conv_kernel: only for the hybrid families ['lfm2', 'qwen3_5_text'], not 'llama'",
    ),
    ("lfm2-1.2b", lambda a: a.pop("layer_types"), "architecture.layer_types: missing (required for 'lfm2')"),
    ("lfm2-1.2b", lambda a: a.pop("conv_kernel"), "architecture.conv_kernel: missing (required for 'lfm2')"),
    (
        "lfm2-1.2b",
        lambda a: a.update(linear_num_key_heads=16),
        "architecture.linear_num_key_heads: not a field of 'lfm2'; its fields: ['layer_types', "
        "'conv_kernel']",
    ),
    (
        "lfm2-1.2b",
        lambda a: a.update(layer_types=a["layer_types"][:-1]),
        "architecture.layer_types: 15 layer types ['conv', 'full_attention'] is not allowed; allowed: "
        "num_layers=16 of ['full_attention', 'conv'], at least one full_attention",
    ),
    (
        "lfm2-1.2b",
        lambda a: a.update(layer_types=["linear_attention"] * 16),
        "architecture.layer_types: 16 layer types ['linear_attention'] is not allowed",
    ),
    (
        "lfm2-1.2b",
        lambda a: a.update(layer_types=["conv", "mamba"] * 8),
        "architecture.layer_types: ['conv', 'mamba', ",
    ),
    (
        "qwen3.5-0.8b",
        lambda a: a.pop("linear_value_head_dim"),
        "architecture.linear_value_head_dim: missing (required for 'qwen3_5_text')",
    ),
    (
        "qwen3.5-0.8b",
        lambda a: a.update(linear_num_value_heads=24, linear_num_key_heads=16),
        "linear_num_value_heads a multiple of linear_num_key_heads (has 24, 16)",
    ),
    (
        "qwen3.5-0.8b",
        lambda a: a.update(layer_types=["full_attention"] * 24),
        "qwen3_5_text needs linear_attention layers",
    ),
]


@pytest.mark.parametrize(("name", "mutate", "message"), HYBRID_CASES)
def test_a_bad_hybrid_architecture_is_refused(tmp_path, name, mutate, message):
    data = yaml.safe_load((MODELS_DIR / f"{name}.yaml").read_text())
    mutate(data["architecture"])
    path = _write(tmp_path, data, name)
    with pytest.raises(KvedgeError) as error:
        load_recipe(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


@pytest.mark.parametrize(("mutate", "message"), RECIPE_CASES)
def test_bad_recipe_is_refused_naming_file_and_key(tmp_path, mutate, message):
    data = yaml.safe_load((MODELS_DIR / "smollm2-135m.yaml").read_text())
    mutate(data)
    path = _write(tmp_path, data, "smollm2-135m")
    with pytest.raises(KvedgeError) as error:
        load_recipe(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


def test_unreadable_and_unknown_configs_are_refused(tmp_path):
    broken = _write(tmp_path, "name: [unclosed\n", "broken")
    with pytest.raises(KvedgeError, match=f"{broken}: not valid YAML"):
        load_recipe(broken)
    listed = _write(tmp_path, "- 1\n- 2\n", "listed")
    with pytest.raises(KvedgeError, match=f"{listed}: expected a mapping of keys, got list"):
        load_board(listed)
    with pytest.raises(KvedgeError, match="no board named 'orin-nano-4gb'; allowed: agx-orin-32gb, "):
        load_board("orin-nano-4gb")
    with pytest.raises(KvedgeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def commands_in_comments(path: Path) -> dict[str, list[str]]:
    """The command lines of a config's comments (`#   kvedge COMMAND ARGS`), by command."""
    found = {}
    for line in path.read_text().splitlines():
        if line.startswith("#   kvedge "):
            words = shlex.split(line[1:])
            found[words[1]] = words[2:]
    return found


def test_the_jetson_service_config_is_the_planners_recommendation(tmp_path):
    """configs/services/orin-nano-8gb.yaml, the one docs/JETSON.md, "From nothing to a first chat"
    installs, loads, runs on TensorRT, and holds what `recommend` says for the board and
    the recipe its model_name names: its slots, and the two commands its comment gives for the
    model folder (parsed as the CLI parses them): the export's form and max_len, into the folder
    `model` names, and the engine built on the board with --max-batch = slots; the walkthrough
    gives the same two commands."""
    board = "orin-nano-8gb"
    path = SERVICES_DIR / f"{board}.yaml"
    (tmp_path / MANIFEST_FILE).write_text("{}")  # the folder the service checks for; the file's is relative
    config = load_service_config(path, {"model": tmp_path}, environ={})
    assert config.device == "tensorrt" and config.loopback
    found = recommend(board, config.model_name, config.device)
    assert config.slots == found.cell.slots
    commands = commands_in_comments(path)
    export = main.commands["export"].make_context("export", commands["export"]).params
    made = ExportRecipe(**{f.name: export[f.name] for f in dataclasses.fields(ExportRecipe)})
    assert made == found.form and export["max_len"] == found.cell.context
    assert export["source"] is None and load_recipe(config.model_name).source == "default"
    assert export["target"] == "onnx"  # the engine is built where it runs
    engine = main.commands["engine"].make_context("engine", commands["engine"]).params
    folder = Path(yaml.safe_load(path.read_text())["model"])
    assert export["out_dir"] == engine["folder"] == folder and engine["max_batch"] == config.slots
    walkthrough = (SERVICES_DIR.parents[1] / "docs" / "JETSON.md").read_text()
    assert all(shlex.join(["kvedge", name, *args]) in walkthrough for name, args in commands.items())


def test_a_recipe_export_section_is_the_export_recipe_under_its_own_names(tmp_path):
    """`export:` takes ExportRecipe's fields as they are named (and the TensorRT profile,
    ProfileSizes's), so any recipe the export flags make can be written in a card."""
    names = {f.name for owner in (ExportRecipe, ProfileSizes) for f in dataclasses.fields(owner)}
    for card in MODELS_DIR.glob("*.yaml"):
        assert set(yaml.safe_load(card.read_text())["export"]) <= names, card
    data = yaml.safe_load((MODELS_DIR / "smollm2-135m.yaml").read_text())
    data["export"].update(variant="ort", weights="int4", head_bits=8, decode_matmuls="onnxruntime")
    recipe = load_recipe(_write(tmp_path, data, "smollm2-135m"))
    assert recipe.export_recipe == ExportRecipe(
        max_len=2048, logits="last", variant="ort", weights="int4", head_bits=8, decode_matmuls="onnxruntime"
    )
    assert (recipe.export.max_prefill, recipe.export.max_batch) == (256, 1)


def test_a_renamed_recipe_key_still_reads_and_warns(tmp_path, caplog):
    text = (MODELS_DIR / "smollm2-135m.yaml").read_text()
    new, old = "\n  weights: float32\n", "\n  weights_dtype: float16\n"
    assert new in text
    path = _write(tmp_path, text.replace(new, old), "smollm2-135m")
    assert load_recipe(path).export_recipe.weights == "float16"
    assert "'export.weights_dtype' is deprecated; write 'export.weights'" in caplog.text


def test_renamed_keys_come_from_one_table():
    """Every kind of file's former keys are rows of `kvedge.configs.RENAMED`; the service's
    view of it is that table's rows."""
    assert renamed("service") == RENAMED_SERVICE_KEYS
    assert renamed("model") == {"export.weights_dtype": "export.weights"}
    assert {kind for kind, _ in RENAMED} == {"service", "model"}
