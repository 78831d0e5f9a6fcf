"""The `kvedge` command end to end, as a user runs it (real subprocesses, real files)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny import make_tiny_model

from kvedge.accel import INSTALL_TENSORRT_BUILDER
from kvedge.contract import ExportRecipe
from kvedge.export.export import export_model


def kvedge(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, input=stdin, timeout=300
    )


def test_export_info_generate_chat(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "qwen2")
    out = tmp_path / "artifact"
    done = kvedge("export", str(source), "--out", str(out), "--max-len", "64")
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout and "MiB" in done.stdout

    again = kvedge("export", str(source), "--out", str(out))
    assert again.returncode != 0
    assert "not empty; pass --force" in again.stderr and "Traceback" not in again.stderr

    info = kvedge("info", str(out))
    assert info.returncode == 0
    assert "Qwen2" in info.stdout and "max_len 64" in info.stdout and "past_key_values.%d.key" in info.stdout

    gen = kvedge(
        "generate",
        "--model",
        str(out),
        "Hello!",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.8",
        "--seed",
        "3",
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.strip()
    assert (
        gen.stdout
        == kvedge(
            "generate",
            "--model",
            str(out),
            "Hello!",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.8",
            "--seed",
            "3",
        ).stdout
    )

    chat = kvedge(
        "chat",
        "--model",
        str(out),
        "--max-new-tokens",
        "4",
        stdin="Hello!\nHow are you?\n/reset\nHi\n/exit\n",
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("assistant> ") == 3 and "(conversation reset)" in chat.stdout


def test_user_errors_exit_nonzero_without_traceback(tmp_path):
    for args, message in [
        (("info", str(tmp_path / "nope")), "no manifest.json"),
        (("export", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o")), "does not exist"),
        (("generate", "--model", str(tmp_path), "hi"), "no manifest.json"),
    ]:
        done = kvedge(*args)
        assert done.returncode != 0
        assert message in done.stderr and "Traceback" not in done.stderr


def test_weight_quantization_options(tmp_path):
    """--outlier-channels and --head-bits reach the export (info shows them); values that do not
    apply are refused by name before anything loads."""
    for args, message in [
        (("--weights", "int4", "--outlier-channels", "5"), "allowed: [0, 8, 16, 32, 64]"),
        (("--head-bits", "8"), "--head-bits 8 applies to --weights int8 or int4 only, not --weights float32"),
        (("--weights", "int8", "--head-bits", "4"), "--variant portable --weights int8; allowed: [8]"),
        (("--variant", "ort", "--weights", "int4", "--head-bits", "3"), "--head-bits 3 is not allowed"),
    ]:
        done = kvedge("export", str(tmp_path / "hf"), "--out", str(tmp_path / "bad"), *args)
        assert done.returncode != 0
        assert message in done.stderr and "Traceback" not in done.stderr
    source = make_tiny_model(tmp_path / "hf", "llama")
    out = tmp_path / "artifact"
    args = ("--max-len", "32", "--variant", "ort", "--weights", "int4", "--outlier-channels", "0")
    done = kvedge("export", str(source), "--out", str(out), *args, "--head-bits", "4")
    assert done.returncode == 0, done.stderr
    info = kvedge("info", str(out))
    assert "weights: int4 (block 32), 0 float32 channels, LM head int4" in info.stdout


def test_bad_sampling_option_is_named(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "llama")
    out = tmp_path / "artifact"
    export_model(source, out, ExportRecipe(max_len=32))  # in-process: `kvedge export` is tested above
    done = kvedge("generate", "--model", str(out), "hi", "--top-p", "1.5")
    assert (
        done.returncode != 0 and "top_p=1.5 is not allowed" in done.stderr and "Traceback" not in done.stderr
    )


def test_history_policy_and_warm_prefixes_and_their_old_spellings(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "qwen2")
    out = tmp_path / "artifact"
    export_model(source, out, ExportRecipe(max_len=64))  # in-process: `kvedge export` is tested above
    long_prompt = "word " * 80  # > 64 tokens: refused under `error`, served under `window`
    refused = kvedge("generate", "--model", str(out), long_prompt, "--max-new-tokens", "2")
    assert refused.returncode != 0 and "the cache holds at most 64" in refused.stderr
    for flag in ("--history-policy", "--context-policy"):
        done = kvedge("generate", "--model", str(out), long_prompt, "--max-new-tokens", "2", flag, "window")
        assert done.returncode == 0, done.stderr
        deprecated = "--context-policy is deprecated; use --history-policy" in done.stderr
        assert deprecated == (flag == "--context-policy"), done.stderr

    config = tmp_path / "warm.yaml"
    config.write_text("prefixes:\n  - {name: notes, text: hello there}\n")
    warm_dir = ["--warm-prefixes", str(config), "--warm-dir", str(tmp_path / "warm")]
    built = kvedge("warm-prefixes", "--model", str(out), *warm_dir)
    assert built.returncode == 0 and "notes: " in built.stdout and "recomputed (missing)" in built.stdout
    old = kvedge("warmup", "--model", str(out), *warm_dir)
    assert old.returncode == 0 and "notes: " in old.stdout and ", loaded" in old.stdout
    assert "'warmup' is deprecated. Use `kvedge warm-prefixes`" in old.stderr
    generate = ["-v", "generate", "--model", str(out), "hello there", "--max-new-tokens", "2"]
    for flag in ("--warm-prefixes", "--warmup"):
        done = kvedge(*generate, flag, str(config), "--warm-dir", str(tmp_path / "warm"))
        assert done.returncode == 0 and "1 warm prefixes" in done.stderr, done.stderr
        assert ("--warmup is deprecated; use --warm-prefixes" in done.stderr) == (flag == "--warmup")


def test_a_truncated_gguf_is_refused_in_one_line(tmp_path):
    from kvedge.export.source import default_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_gguf().read_bytes()[:1_000_000])
    done = kvedge("export", str(cut), "--out", str(tmp_path / "out"))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "not a complete GGUF file" in done.stderr and len(done.stderr.strip().splitlines()) <= 3, (
        done.stderr
    )


# `python -m kvedge` where neither TensorRT nor TensorRT for RTX can be imported
WITHOUT_TENSORRT = (
    "import sys; sys.modules['tensorrt'] = sys.modules['tensorrt_rtx'] = None; "
    "from kvedge.cli import main; main(prog_name='kvedge')"
)


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        (None, "no manifest.json; is this a `kvedge export` folder?"),
        (
            ExportRecipe(max_len=256, variant="ort"),
            "--device tensorrt runs the portable graph (standard ONNX ops) only, not --variant 'ort'",
        ),
        (ExportRecipe(max_len=256, logits="all"), "--device tensorrt needs --logits rows or last, not 'all'"),
        (ExportRecipe(max_len=256), INSTALL_TENSORRT_BUILDER),
    ],
    ids=["not-an-export", "ort-variant", "all-logits", "no-tensorrt"],
)
def test_engine_refuses_in_one_line(recipe, message, tmp_path):
    """`kvedge engine FOLDER` on a machine without TensorRT: a folder that is not an export and a
    graph TensorRT cannot run are refused for what they are, before TensorRT is looked for (so
    installing it would not help); a portable export then for TensorRT missing, naming what to
    install. One line each, no traceback (the built engine: tests/test_tensorrt_acceptance.py)."""
    folder = tmp_path / "out"
    if recipe is None:
        folder.mkdir()
    else:
        export_model(make_tiny_model(tmp_path / "hf", "llama"), folder, recipe)
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TENSORRT, "engine", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("Error: ") and message in done.stderr.splitlines()[-1]
    assert not (folder / "model.engine").exists()
