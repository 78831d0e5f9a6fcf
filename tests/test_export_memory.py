"""The export's memory preflight (`kvedge.export.memory`): parameters counted from the files'
headers, the export's estimated peak, and what this process may use (MemAvailable, cgroup limits,
ulimit -v); a 3B export refused under a 3 GiB address-space limit in one line, and one line where
an allocation fails past the preflight."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvedge.contract import ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import streamable
from kvedge.export.memory import (
    HEAD_PEAK,
    STREAMED_BASE,
    check_export_memory,
    export_estimate,
    failed_allocation,
    out_of_memory,
    source_parameters,
    source_tensors,
)
from kvedge.export.source import resolve_source
from kvedge.machine import Available, available_memory

GIB = 2**30
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"


def llama_shapes(a: dict) -> dict[str, list[int]]:
    """The tensors of a Llama checkpoint with `a`'s sizes (a configs/models architecture)."""
    h, d, kv = a["hidden_size"], a["head_dim"], a["num_kv_heads"]
    shapes = {"model.embed_tokens.weight": [a["vocab_size"], h], "model.norm.weight": [h]}
    for i in range(a["num_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": [a["num_heads"] * d, h],
                p + "self_attn.k_proj.weight": [kv * d, h],
                p + "self_attn.v_proj.weight": [kv * d, h],
                p + "self_attn.o_proj.weight": [h, a["num_heads"] * d],
                p + "mlp.gate_proj.weight": [a["intermediate_size"], h],
                p + "mlp.up_proj.weight": [a["intermediate_size"], h],
                p + "mlp.down_proj.weight": [h, a["intermediate_size"]],
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
            }
        )
    return shapes


def sparse_checkpoint(folder: Path, name: str) -> int:
    """A folder whose model.safetensors has `name`'s real shapes in bfloat16 and no data written
    (a sparse file: the header is all the preflight reads); returns the model's param_count."""
    card = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    a = card["architecture"]
    header, offset = {}, 0
    for tensor, shape in llama_shapes(a).items():
        size = 2 * math.prod(shape)
        header[tensor] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    # a vision tower's tensor, as composite checkpoints have: not loaded, not counted
    header["model.visual.blocks.0.attn.qkv.weight"] = {
        "dtype": "BF16",
        "shape": [8, 8],
        "data_offsets": [offset, offset + 128],
    }
    offset += 128
    folder.mkdir()
    raw = json.dumps(header).encode()
    with (folder / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": a["hidden_size"],
        "num_hidden_layers": a["num_layers"],
        "num_attention_heads": a["num_heads"],
        "num_key_value_heads": a["num_kv_heads"],
        "head_dim": a["head_dim"],
        "intermediate_size": a["intermediate_size"],
        "vocab_size": a["vocab_size"],
        "tie_word_embeddings": a["tie_word_embeddings"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return a["param_count"]


def test_parameters_are_counted_from_the_headers_alone(tmp_path):
    count = sparse_checkpoint(tmp_path / "llama3b", "llama-3.2-3b")
    assert source_parameters(resolve_source(tmp_path / "llama3b")) == count == 3_212_749_824
    assert source_parameters(resolve_source(None)) == 134_515_008  # SmolLM2's GGUF tensor table
    tensors = source_tensors(resolve_source(tmp_path / "llama3b"))
    table = 128256 * 3072  # the embedding, read whole to quantize it as the LM head
    assert max(tensors) == table
    int4, ort8 = ExportRecipe(weights="int4"), ExportRecipe(variant="ort", weights="int8")
    assert ort8.two_forms and not int4.two_forms
    assert export_estimate(tensors, int4, True).bytes == STREAMED_BASE + int(
        HEAD_PEAK["one form"] * 4 * table
    )
    assert export_estimate(tensors, ort8, True).bytes == STREAMED_BASE + int(
        HEAD_PEAK["two forms"] * 4 * table
    )
    assert export_estimate(tensors, ExportRecipe(), True) == export_estimate(tensors, int4, True)
    whole = export_estimate(tensors, int4, False)  # loaded whole: the float32 model besides
    assert whole.bytes == export_estimate(tensors, int4, True).bytes + 4 * (count - table)
    assert "loaded whole" in whole.what


def test_a_gguf_file_is_estimated_as_streamed_and_a_packed_folder_as_loaded_whole(tmp_path):
    assert streamable(resolve_source(None))  # SmolLM2's GGUF: read a tensor at a time
    folder = tmp_path / "llama3b"
    sparse_checkpoint(folder, "llama-3.2-3b")
    assert streamable(resolve_source(folder))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    assert not streamable(resolve_source(folder))  # an AWQ checkpoint is loaded whole


def test_what_this_process_may_use_is_the_least_of_every_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:   12000000 kB\n")
    root = tmp_path / "cgroup"
    leaf = root / "a" / "b"
    leaf.mkdir(parents=True)
    (root / "a" / "memory.max").write_text(f"{6 * GIB}\n")  # the limit is the parent's
    (root / "a" / "memory.current").write_text(f"{GIB}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(f"{GIB}\n")
    membership = tmp_path / "self_cgroup"
    membership.write_text("0::/a/b\n")
    found = available_memory(meminfo, root, membership, tmp_path / "none")
    assert found == Available(5 * GIB, f"cgroup {root / 'a'}'s limit less its usage")
    membership.write_text("4:memory:/a/b\n")  # cgroup v1
    (root / "memory" / "a").mkdir(parents=True)
    (root / "memory" / "a" / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (root / "memory" / "a" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert available_memory(meminfo, root, membership, tmp_path / "none").bytes == 3 * GIB
    membership.write_text("")
    assert available_memory(meminfo, root, membership, tmp_path / "none") == Available(
        12000000 * 1024, "MemAvailable"
    )


def test_an_export_over_the_available_memory_is_refused_in_one_line(tmp_path):
    sparse_checkpoint(tmp_path / "llama3b", "llama-3.2-3b")
    source = resolve_source(tmp_path / "llama3b")
    int4 = ExportRecipe(weights="int4")
    with pytest.raises(
        KvedgeError,
        match=r"needs about 14\.73 GiB of memory \(the float32 model of 3,212,749,824 parameters, "
        r"loaded whole, and its largest tensor, 394,002,432 values, in float32 and as the graph's "
        r"weights\), and 6\.00 GiB is available \(a test\)",
    ):
        check_export_memory(source, int4, Available(6 * GIB, "a test"))
    check_export_memory(source, int4, Available(16 * GIB, "a test"))  # passes: loads nothing
    check_export_memory(source, int4, Available(4.5 * GIB, "a test"), streamed=True)  # 4.23 GiB
    with pytest.raises(
        KvedgeError, match=r"about 4\.23 GiB of memory \(its largest tensor, 394,002,432 values"
    ):
        check_export_memory(source, int4, Available(3 * GIB, "a test"), streamed=True)


def in_ulimit(gib: float, command: str) -> subprocess.CompletedProcess:
    """`command` in bash under `ulimit -v` of `gib` GiB."""
    limit = f"ulimit -v {int(gib * 2**20)}; exec {command}"
    return subprocess.run(["bash", "-c", limit], capture_output=True, text=True, timeout=600, env=os.environ)


def one_error(done: subprocess.CompletedProcess) -> str:
    """The one "Error" line of a user error: non-zero, no traceback."""
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def mapped_after(imports: str) -> float:
    """GiB this Python maps once it has imported `imports` (VmPeak): the libraries are most of an
    export's address space, 0.17 GiB without torch, 0.8 GiB with a CPU wheel of torch and 3.5 GiB
    with a CUDA one (CI's Python 3.10 has that)."""
    peak = "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmPeak')][0])"
    done = subprocess.run(
        [sys.executable, "-c", f"{imports}; {peak}"], capture_output=True, text=True, check=True
    )
    return int(done.stdout) / 2**20


def test_a_3b_export_under_a_3_gib_ulimit_is_refused_before_loading(tmp_path):
    """The real limit, the real CLI: `ulimit -v` of 3 GiB beside torch's libraries, then `kvedge
    export` of a 3B checkpoint, streamed, whose estimated peak is 4.23 GiB resident and 1 GiB
    more mapped (its largest tensor alone, 1.47 GiB in float32, is under the limit; the 3B
    export runs under 6 GiB: docs/PERFORMANCE.md, "Exporting at a real size")."""
    sparse_checkpoint(tmp_path / "llama3b", "llama-3.2-3b")
    export = f"{sys.executable} -m kvedge export {tmp_path / 'llama3b'} --weights int4 --out {tmp_path / 'x'}"
    error = one_error(in_ulimit(mapped_after("import kvedge.cli, torch") + 3, export))
    assert "needs about 5.23 GiB" in error and "(ulimit -v less what is mapped)" in error
    assert "--no-memory-check" in error
    assert not (tmp_path / "x").exists()


def test_an_export_that_runs_out_of_memory_anyway_says_so_in_one_line(tmp_path):
    """Past the preflight (--no-memory-check) under `ulimit -v` of the libraries' mapping and 1.2
    GiB more, the 3B checkpoint's first large allocation fails (its 1.47 GiB embedding): one
    line, what was needed, nothing kept."""
    sparse_checkpoint(tmp_path / "llama3b", "llama-3.2-3b")
    export = f"{sys.executable} -m kvedge export {tmp_path / 'llama3b'} --weights int4 --out {tmp_path / 'x'}"
    libraries = mapped_after(
        "import kvedge.cli, kvedge.export.streamed, torch, transformers.models.llama.modeling_llama"
    )
    error = one_error(in_ulimit(libraries + 1.2, export + " --no-memory-check"))
    assert "the export ran out of memory (an allocation of 1.47 GiB failed)" in error, error
    assert "it needs about 5.23 GiB" in error and "is unchanged" in error
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))


def test_a_limit_that_cannot_map_torch_is_out_of_memory_in_one_line(tmp_path):
    """Under a `ulimit -v` that holds the CLI but not torch's libraries (CI's Python 3.10 has a
    CUDA wheel, 3.1 GiB mapped: its import failed past the old preflight with a traceback,
    "libtorch_cpu.so: failed to map segment from shared object"), the preflight maps torch
    first: one line, what was needed, nothing kept."""
    sparse_checkpoint(tmp_path / "llama3b", "llama-3.2-3b")
    export = f"{sys.executable} -m kvedge export {tmp_path / 'llama3b'} --weights int4 --out {tmp_path / 'x'}"
    error = one_error(in_ulimit(mapped_after("import kvedge.cli, kvedge.export.export") + 0.25, export))
    assert "the export ran out of memory (" in error and "it needs about 5.23 GiB" in error, error
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))


def test_a_library_that_could_not_be_mapped_is_out_of_memory():
    assert out_of_memory(ImportError("libtorch_cpu.so: failed to map segment from shared object"))
    assert failed_allocation(ImportError("libtorch_cpu.so: failed to map segment from shared object")) == (
        "libtorch_cpu.so: failed to map segment from shared object"
    )
    assert not out_of_memory(ImportError("No module named 'gguf'"))


def test_a_checkpoint_cut_inside_its_header_is_refused_by_name(tmp_path):
    sparse_checkpoint(tmp_path / "llama3b", "llama-3.2-3b")
    weights = tmp_path / "llama3b" / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(4096)  # the download stopped inside the JSON header
    with pytest.raises(KvedgeError, match=r"llama3b: not a complete safetensors file \(JSONDecodeError"):
        check_export_memory(
            resolve_source(tmp_path / "llama3b"), ExportRecipe(), Available(64 * GIB, "a test")
        )


def test_a_table_read_in_rows_is_not_the_largest_tensor_read_whole(tmp_path):
    """Gemma 4 E2B's per-layer table (2.35 billion values) is read a range of rows at a time from
    safetensors (`export.save_per_layer`): the streamed estimate is set by the next largest, the
    embedding read whole to quantize it as the LM head (E2B's headers, a sparse file); loaded
    whole, the table counts in the float32 model."""
    from tiny import gemma4_supported

    if not gemma4_supported():
        pytest.skip("Gemma 4 needs transformers 5.25")
    from kvedge.bench.checkpoint import hf_config
    from kvedge.export.memory import tensors_read_in_rows
    from kvedge.export.streamed import skeleton

    config, count = hf_config("gemma-4-e2b")
    model = skeleton(config)
    header, offset = {}, 0
    for name, tensor in model.named_parameters():
        if name != "lm_head.weight":  # tied
            size = 2 * tensor.numel()
            header[name] = {
                "dtype": "BF16",
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    folder = tmp_path / "e2b"
    folder.mkdir()
    raw = json.dumps(header).encode()
    with (folder / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    config.save_pretrained(folder)
    source = resolve_source(folder)
    tensors, table = source_tensors(source), 262144 * 35 * 256
    assert sum(tensors) == count and tensors_read_in_rows(source) == [table] and max(tensors) == table
    embedding = 262144 * 1536
    int4 = ExportRecipe(weights="int4")
    streamed = export_estimate(tensors, int4, True, tensors_read_in_rows(source))
    assert streamed.bytes == STREAMED_BASE + int(HEAD_PEAK["one form"] * 4 * embedding)
    assert export_estimate(tensors, int4, True).bytes == STREAMED_BASE + int(
        HEAD_PEAK["one form"] * 4 * table
    )
    whole = export_estimate(tensors, int4, False, tensors_read_in_rows(source))
    assert whole.bytes == STREAMED_BASE + int(HEAD_PEAK["one form"] * 4 * table) + 4 * (count - table)
