"""The export's source read one layer at a time (`kvedge.export.streamed`): each family's streamed
export is byte for byte the export of the model loaded whole; what cannot be streamed is loaded
whole, and says why; the calibration holds one block's weights at a time; bfloat16 widens
exactly; a random checkpoint at a card's real shape (`kvedge.bench.checkpoint`)."""

from __future__ import annotations

import json
import logging
import struct
import sys

import numpy as np
import pytest
import torch
from conftest import MAX_LEN
from tiny import gemma4_supported, make_tiny_gguf, make_tiny_hybrid_gguf, make_tiny_model, tiny_config

from kvedge.bench.checkpoint import hf_config, write_checkpoint
from kvedge.contract import ExportRecipe
from kvedge.export.export import export_model
from kvedge.export.gguf_blocks import GgufFile
from kvedge.export.memory import export_estimate, source_tensors
from kvedge.export.quantize import calibration_batches, input_outliers
from kvedge.export.source import load_hf, resolve_source, stream_source
from kvedge.export.streamed import (
    FolderWeights,
    Stored,
    open_streamed,
    open_streamed_gguf,
    read_tensor,
    skeleton,
    streaming,
)

CASES = [
    ("llama", {}, ExportRecipe(max_len=MAX_LEN, variant="ort", weights="int8")),  # calibrated channels
    ("qwen2", {"tie_word_embeddings": False}, ExportRecipe(max_len=MAX_LEN, variant="ort", weights="int4")),
    ("phi3", {}, ExportRecipe(max_len=MAX_LEN)),  # fused projections split per layer
    ("gemma3", {}, ExportRecipe(max_len=MAX_LEN, weights="int4")),
    ("qwen3_5", {}, ExportRecipe(max_len=MAX_LEN, variant="ort", weights="int8", kv_dtype="int8")),
    ("lfm2", {}, ExportRecipe(max_len=MAX_LEN, precision="float16", weights="int4")),
    ("gemma4", {}, ExportRecipe(max_len=MAX_LEN, weights="int8", block_size=16)),
]


@pytest.mark.parametrize(("family", "overrides", "recipe"), CASES, ids=[c[0] for c in CASES])
def test_a_streamed_export_is_the_export_of_the_model_loaded_whole(tmp_path, family, overrides, recipe):
    if family == "gemma4" and not gemma4_supported():
        pytest.skip("this transformers has no Gemma 4 with shared KV")
    source = make_tiny_model(tmp_path / "hf", family, **overrides)
    assert stream_source(resolve_source(source)).streamed
    export_model(source, tmp_path / "streamed", recipe)
    export_model(source, tmp_path / "whole", recipe, loaded=load_hf(resolve_source(source)))
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    streamed = json.loads((tmp_path / "streamed" / "manifest.json").read_text())
    whole = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert streamed == whole


# GGUF files (tests/tiny.py's, as llama.cpp's converter writes them): a Llama of both 4-bit forms
# and a Q8_0 embedding (its "llama" Q and K rows permuted), LFM2 and Qwen3.5 in Q8_0 and float32
GGUF_KINDS = {"attn_q": "Q4_0", "attn_k": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "token_embd": "Q8_0"}
GGUF_CASES = [
    ("llama", None, ExportRecipe(max_len=MAX_LEN, weights="int4")),  # the file's blocks kept
    ("llama", None, ExportRecipe(max_len=MAX_LEN, variant="ort", weights="int8")),  # requantized, calibrated
    ("lfm2", "Q8_0", ExportRecipe(max_len=MAX_LEN, weights="int8")),
    ("qwen3_5", None, ExportRecipe(max_len=MAX_LEN)),
]


def gguf_source(tmp_path, family: str, kind: str | None):
    if family == "llama":
        return make_tiny_gguf(tmp_path / "tiny.gguf", GGUF_KINDS)
    return make_tiny_hybrid_gguf(tmp_path / "tiny.gguf", family, kind, seed=3)


def test_the_per_layer_table_is_read_a_range_of_rows_at_a_time(tmp_path, monkeypatch):
    """Gemma 4's per-layer table (E2B's: 8.8 GiB in float32) is read from a safetensors folder a
    chunk of rows at a time to be written, and the rows a batch's tokens need to calibrate, never
    whole: no read of it holds more rows than the chunk, and the files equal those the export of
    the model loaded whole writes."""
    if not gemma4_supported():
        pytest.skip("this transformers has no Gemma 4 with shared KV")
    import kvedge.export.export as exporting
    import kvedge.export.streamed as streamed

    source = make_tiny_model(tmp_path / "hf", "gemma4")
    width = tiny_config("gemma4").num_hidden_layers * tiny_config("gemma4").hidden_size_per_layer_input
    reads = []

    def spy(stored: Stored) -> np.ndarray:
        reads.append(stored.shape)
        return read_tensor(stored)

    monkeypatch.setattr(exporting, "PER_LAYER_CHUNK_ROWS", 7)  # 320 rows: the last chunk is short
    monkeypatch.setattr(streamed, "read_tensor", spy)
    export_model(source, tmp_path / "streamed", ExportRecipe(max_len=MAX_LEN))
    table = [shape for shape in reads if shape[1:] == (width,)]
    assert table and max(rows for rows, _ in table) == 7 and sum(rows for rows, _ in table) == 320
    export_model(
        source, tmp_path / "whole", ExportRecipe(max_len=MAX_LEN), loaded=load_hf(resolve_source(source))
    )
    name = "per_layer_embeddings.npy"
    assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


@pytest.mark.parametrize(
    ("family", "kind", "recipe"), GGUF_CASES, ids=["llama-int4", "llama-ort-int8", "lfm2-q8_0", "qwen3_5-f32"]
)
def test_a_gguf_is_streamed_and_exports_as_the_model_transformers_loads_whole(tmp_path, family, kind, recipe):
    """A GGUF file read a tensor at a time (each dequantized as transformers does, then dropped;
    the skeleton holds no weight) exports byte for byte as the model transformers loads whole."""
    source = gguf_source(tmp_path, family, kind)
    opened = stream_source(resolve_source(source))
    assert opened.streamed and all(p.device.type == "meta" for p in opened.model.parameters())
    whole, _ = load_hf(resolve_source(source))
    for name, value in whole.state_dict().items():
        np.testing.assert_array_equal(opened.weights[name], value.numpy(), err_msg=name)
    export_model(source, tmp_path / "streamed", recipe)
    export_model(source, tmp_path / "whole", recipe, loaded=(whole, load_hf(resolve_source(source))[1]))
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    streamed = json.loads((tmp_path / "streamed" / "manifest.json").read_text())
    assert streamed == json.loads((tmp_path / "whole" / "manifest.json").read_text())


def test_a_gguf_the_model_does_not_match_is_loaded_whole_and_says_why(tmp_path, caplog):
    source = make_tiny_gguf(tmp_path / "tiny.gguf", GGUF_KINDS)
    config = skeleton_config(tmp_path / "tiny-hf")
    config.intermediate_size *= 2  # the file's ffn tensors are half the size
    caplog.set_level(logging.INFO, logger="kvedge.export.streamed")
    assert open_streamed_gguf(GgufFile(source), config) is None
    assert (
        "blk.0.ffn_gate.weight holds 6,144 values, the model's model.layers.0.mlp.gate_proj.weight 12,288"
        in caplog.text
    )


def test_bfloat16_and_float16_widen_exactly(tmp_path):
    values = torch.randn(3, 5) * 100
    path = tmp_path / "t.safetensors"
    from safetensors.torch import save_file

    save_file(
        {"b": values.to(torch.bfloat16), "h": values.to(torch.float16), "i": torch.arange(4)}, str(path)
    )
    from kvedge.export.streamed import read_header

    stored, _ = read_header(path)
    assert np.array_equal(read_tensor(stored["b"]), values.to(torch.bfloat16).float().numpy())
    assert np.array_equal(read_tensor(stored["h"]), values.to(torch.float16).float().numpy())
    assert read_tensor(stored["i"]).tolist() == [0, 1, 2, 3]
    assert read_tensor(stored["b"]).dtype == np.float32


def test_rows_of_a_table_are_read_in_runs_of_neighbours(tmp_path, monkeypatch):
    """`FolderWeights.rows` gives the rows asked for, in their order and repeats, reading each
    run of neighbouring rows once and no other row."""
    from safetensors.torch import save_file

    import kvedge.export.streamed as streamed
    from kvedge.export.streamed import FolderWeights, read_header

    table = torch.randn(40, 6).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    save_file({"table": table}, str(path))
    stored, _ = read_header(path)
    reads = []

    def spy(where: Stored) -> np.ndarray:
        reads.append(where.shape[0])
        return read_tensor(where)

    monkeypatch.setattr(streamed, "read_tensor", spy)
    index = np.array([9, 3, 5, 4, 3, 39, 0])
    got = FolderWeights(stored, {}).rows("table", index)
    np.testing.assert_array_equal(got, table.float().numpy()[index])
    assert sorted(reads) == [1, 1, 1, 3]  # 0; 3, 4, 5; 9; 39


def _rewrite(folder, change) -> None:
    """The folder's safetensors file with its tensors changed by `change` (a dict, in place)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            lambda t: t.pop("model.layers.0.mlp.up_proj.weight"),
            "the files lack model.layers.0.mlp.up_proj.weight",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.ones(3)}),
            r"model.norm.weight is \[3\], the model's model.norm.weight is \[64\]",
        ),
        (
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn)}),
            "model.norm.weight is F8_E4M3, which has no exact float32 form here",
        ),
    ],
    ids=["missing", "shape", "dtype"],
)
def test_a_source_that_cannot_be_streamed_is_loaded_whole_and_says_why(tmp_path, caplog, change, why):
    source = make_tiny_model(tmp_path / "hf", "llama")
    _rewrite(source, change)
    caplog.set_level(logging.INFO, logger="kvedge.export.streamed")
    assert stream_source(resolve_source(source)) is None
    assert any(
        "reading the weights whole, not layer by layer" in r.message
        and __import__("re").search(why, r.message)
        for r in caplog.records
    ), caplog.text


def test_a_composite_checkpoints_text_part_is_streamed(tmp_path):
    """A Qwen3.5 checkpoint saved as its vision-language model (model.language_model.* names, a
    vision tower): its text part is streamed under transformers' names, the tower left unread."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config("qwen3_5")
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(
            text_config=text.to_dict(),
            vision_config={
                "depth": 1,
                "hidden_size": 32,
                "num_heads": 2,
                "out_hidden_size": text.hidden_size,
            },
        )
    )
    model.save_pretrained(tmp_path / "vl")
    make_tiny_model(tmp_path / "text", "qwen3_5")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tmp_path / "text" / name).exists():
            (tmp_path / "vl" / name).write_bytes((tmp_path / "text" / name).read_bytes())
    streamed = stream_source(resolve_source(tmp_path / "vl"))
    assert streamed is not None and streamed.streamed
    whole, _ = load_hf(resolve_source(tmp_path / "vl"))
    state = whole.state_dict()
    assert set(streamed.weights) == set(state)
    for name, value in state.items():
        assert np.array_equal(streamed.weights[name], value.numpy()), name


def test_calibration_holds_one_block_at_a_time_and_equals_the_model_loaded_whole(tmp_path, capsys):
    source = make_tiny_model(tmp_path / "hf", "qwen3")
    whole, tokenizer = load_hf(resolve_source(source))
    model, weights = open_streamed(source, [source / "model.safetensors"], whole.config)
    layer_values = max(sum(p.numel() for p in layer.parameters()) for layer in whole.model.layers)
    held = []

    def count(*_):
        held.append(sum(p.numel() for p in model.parameters() if p.device.type != "meta"))

    hooks = [m.register_forward_pre_hook(count) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ids = [[int(t) for t in row] for row in torch.randint(0, 100, (9, 21)).tolist()] + [[5, 6, 7]]
    got = input_outliers(model, ids, 4, weights)
    for hook in hooks:
        hook.remove()
    assert held and max(held) <= layer_values  # a layer's, never two
    assert all(p.device.type == "meta" for p in model.parameters())  # dropped after the run
    layers = len(whole.model.layers)  # the bar moves a layer of a batch at a time
    assert f"{layers}/{layers} " in capsys.readouterr().err.replace("\r", "\n")
    want = input_outliers(whole, ids, 4)
    assert got.keys() == want.keys() and "lm_head" in got
    for name in got:
        assert np.array_equal(got[name], want[name]), name


def test_calibration_batches_leave_padding_out(tmp_path):
    ids = [[1] * 300, [2] * 10, [3] * 3000, [4] * 10]
    batches = list(calibration_batches(ids))
    assert [tuple(b[0].shape) for b in batches] == [(1, 3000), (3, 300)]  # longest first
    assert [int(b[1].sum()) for b in batches] == [3000, 320]
    assert batches[1][0][1].tolist() == [2] * 10 + [0] * 290  # right-padded


def test_a_random_checkpoint_has_the_cards_shape_and_streams(tmp_path):
    count = write_checkpoint("qwen3-0.6b", tmp_path / "q", layers=2)
    config, card = hf_config("qwen3-0.6b")
    per_layer = (
        card - config.vocab_size * config.hidden_size - config.hidden_size
    ) // config.num_hidden_layers
    assert count == config.vocab_size * config.hidden_size + 2 * per_layer + config.hidden_size
    with (tmp_path / "q" / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    streamed = stream_source(resolve_source(tmp_path / "q"))
    assert streamed is not None
    table = streamed.weights["model.embed_tokens.weight"]
    assert table.shape == (config.vocab_size, config.hidden_size) and 0.015 < table.std() < 0.025


def test_folder_weights_read_on_each_access(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "llama")
    _, weights = open_streamed(source, [source / "model.safetensors"], skeleton_config(source))
    assert isinstance(weights, FolderWeights)
    first = weights["model.norm.weight"]
    assert first is not weights["model.norm.weight"]  # nothing is kept
    assert isinstance(weights._where["model.norm.weight"], Stored)


def skeleton_config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def test_the_skeleton_holds_no_weights():
    model = skeleton(tiny_config("llama"))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())  # the RoPE tables are real
    with streaming(model, {}):
        pass


def test_a_phase_reports_its_own_peak_not_its_parents(tmp_path):
    """On Linux a child's ru_maxrss starts at the peak of the memory it replaced at exec (the
    parent's, under vfork): run_phase's peaks are the phase's, from a large process too."""
    from kvedge.bench.scale import run_phase

    held = np.ones(2**30 // 8)  # 1 GiB resident in this process
    phase = run_phase([sys.executable, "-c", "import numpy; a = numpy.ones(2**25)"], tmp_path / "p.log")
    assert 2**28 < phase.peak_rss < 2**29 + held.nbytes // 4, phase  # 256 MiB and the interpreter


def test_the_exports_peak_memory_does_not_grow_with_depth(tmp_path):
    """The same real-width model (Qwen3-0.6B's shape) at 2 and 10 layers, exported in a child
    process each: the deeper one's peak RSS exceeds the shallower's by well under the 8 layers'
    float32 weights, which a model held whole adds (the export reads one layer at a time)."""
    from kvedge.bench.scale import run_phase

    peaks, layer_bytes = {}, 0
    for layers in (2, 10):
        folder = tmp_path / f"q{layers}"
        write_checkpoint("qwen3-0.6b", folder, layers=layers)
        config, _ = hf_config("qwen3-0.6b", layers)
        h, q, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        d, m = config.head_dim, config.intermediate_size
        layer_bytes = 4 * (h * d * (2 * q + 2 * kv) + 3 * h * m)
        command = [sys.executable, "-m", "kvedge", "export", str(folder), "--weights", "int4"]
        command += ["--max-len", "256", "--out", str(tmp_path / f"out{layers}")]
        peaks[layers] = run_phase(command, tmp_path / f"export{layers}.log").peak_rss
    growth = peaks[10] - peaks[2]
    assert growth < 0.4 * 8 * layer_bytes, (peaks, layer_bytes)
    # the preflight's estimate holds the peak (it is set by the LM head, not by the depth)
    tensors = source_tensors(resolve_source(tmp_path / "q10"))
    estimate = export_estimate(tensors, ExportRecipe(weights="int4"), streamed=True).bytes
    assert max(peaks.values()) <= estimate, (peaks, estimate)
