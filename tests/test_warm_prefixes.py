"""Warm prefixes: computed once, persisted, reloaded; every bad file refused and rebuilt."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import MAX_LEN, flip_byte, truncate

from kvedge.configs import load_warm_prefix_config
from kvedge.contract import CacheGeometry, ExportRecipe, StateSpec
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.cache import KVBlock
from kvedge.runtime.generate import SamplingConfig, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import (
    MAGIC,
    STALE_TEMP_AGE_S,
    WARM_VERSION,
    WarmPrefix,
    read_warm_file,
    remove_stale_temps,
    write_warm_file,
)

ATOL = 1e-4
SYSTEM = "You are a helpful assistant on a Jetson. " * 2
CONFIG = f"""
prefixes:
  - name: assistant
    messages:
      - {{role: system, content: "{SYSTEM}"}}
  - name: notes
    text: "The quick brown fox jumps over the lazy dog."
"""


@pytest.fixture()
def warm(tmp_path):
    path = tmp_path / "warmup.yaml"
    path.write_text(CONFIG)
    return load_warm_prefix_config(path), tmp_path / "warm"


def boot(tiny_llama, warm) -> Model:
    config, folder = warm
    return Model(tiny_llama.out, slots=2, warm_prefixes=config, warm_dir=folder)


def test_first_boot_builds_then_reboot_loads(tiny_llama, warm):
    first = boot(tiny_llama, warm)
    assert first.prefixes.warm_report.rebuilt == {"assistant": "missing", "notes": "missing"}
    again = boot(tiny_llama, warm)
    report = again.prefixes.warm_report
    assert report.loaded == ["assistant", "notes"] and not report.rebuilt
    for a, b in zip(first.prefixes.warm.prefixes, again.prefixes.warm.prefixes, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.block.kv, b.block.kv)


def test_session_starting_with_warm_prefix_reuses_it_exactly(tiny_llama, warm):
    model = boot(tiny_llama, warm)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello! How are you?"}]
    ids = model.tokenizer.encode_chat(messages)
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == len(model.prefixes.warm.prefixes[0].token_ids)
    reference = tiny_llama.model()
    expected = prefill(reference.backend, reference.cache, 0, [ids])[0]
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)
    events = list(model.chat(messages, SamplingConfig(max_new_tokens=5)))
    assert events[-1].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "damage,reason",
    [
        (truncate, "bytes, header promises"),
        (flip_byte, "checksum mismatch"),
        (lambda p: p.write_bytes(b"garbage"), "truncated"),
        (lambda p: p.unlink(), "missing"),
    ],
)
def test_damaged_file_is_refused_and_rebuilt(tiny_llama, warm, damage, reason):
    boot(tiny_llama, warm)
    path = warm[1] / "assistant.kvw"
    good = path.read_bytes()
    damage(path)
    model = boot(tiny_llama, warm)
    assert reason in model.prefixes.warm_report.rebuilt["assistant"]
    assert model.prefixes.warm_report.loaded == ["notes"]
    assert path.read_bytes() == good


def test_mismatched_files_are_refused_naming_both_sides(tiny_llama, warm):
    model = boot(tiny_llama, warm)
    prefix = model.prefixes.warm.prefixes[0]
    geometry = model.manifest.geometry
    path = warm[1] / "assistant.kvw"
    fingerprint = model.manifest.source_fingerprint
    cases = [
        (dict(fingerprint="f" * 64), "model is 'ffffffffffffffff', expected"),
        (dict(geometry=dataclasses.replace(geometry, num_kv_heads=1)), '"num_kv_heads": 1'),
        (dict(geometry=dataclasses.replace(geometry, dtype="float16")), '"dtype": "float16"'),
        (dict(ids=prefix.token_ids[:-1]), "token ids is"),
    ]
    for change, message in cases:
        bad = WarmPrefix(
            prefix.name,
            change.get("ids", prefix.token_ids),
            prefix.block.head(len(change.get("ids", prefix.token_ids))),
        )
        write_warm_file(path, bad, change.get("geometry", geometry), change.get("fingerprint", fingerprint))
        with pytest.raises(KvedgeError, match=message):
            read_warm_file(path, geometry, fingerprint, prefix.token_ids)
        rebooted = boot(tiny_llama, warm)
        assert "assistant" in rebooted.prefixes.warm_report.rebuilt
        graph = model.manifest.onnx_fingerprint  # the rewritten file is valid
        read_warm_file(path, geometry, fingerprint, prefix.token_ids, graph_fingerprint=graph)


def test_warm_file_of_another_export_of_the_same_model_is_refused_and_recomputed(tiny_llama, warm, tmp_path):
    """Same source, same cache geometry, int8 weights: the float32 export's K/V are not this graph's."""
    float_model = boot(tiny_llama, warm)
    int8_out = tmp_path / "int8"
    export_model(
        tiny_llama.source,
        int8_out,
        ExportRecipe(max_len=MAX_LEN, variant=float_model.manifest.variant, weights="int8"),
    )
    int8_model = Model(int8_out, slots=2, warm_prefixes=warm[0], warm_dir=warm[1])
    mine, theirs = int8_model.manifest, float_model.manifest
    assert (mine.source_fingerprint, mine.geometry) == (theirs.source_fingerprint, theirs.geometry)
    why = int8_model.prefixes.warm_report.rebuilt["assistant"]
    graphs = f"graph {theirs.onnx_fingerprint[:16]!r}, this model's graph is {mine.onnx_fingerprint[:16]!r}"
    assert f"made by {graphs}" in why
    assert int8_model.prefixes.warm_report.rebuilt.keys() == {"assistant", "notes"}
    recomputed = int8_model.prefixes.warm.prefixes[0]
    ids = list(recomputed.token_ids)
    reference = Model(int8_out, slots=1)
    prefill(reference.backend, reference.cache, 0, [ids])
    np.testing.assert_array_equal(recomputed.block.kv, reference.cache.read(0, len(ids)).kv)
    assert not np.array_equal(recomputed.block.kv, float_model.prefixes.warm.prefixes[0].block.kv)
    again = boot(tiny_llama, warm)  # and back: the float32 export recomputes its own
    assert "made by graph" in again.prefixes.warm_report.rebuilt["assistant"]


def test_warm_file_of_an_older_version_is_refused_as_old(tmp_path):
    geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
    block = KVBlock(np.ones((2, 2, 2, 3, 16), np.float32))
    path = tmp_path / "p.kvw"
    write_warm_file(path, WarmPrefix("p", (1, 2, 3), block), geometry, "x", graph_fingerprint="g")
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, WARM_VERSION - 1)
    path.write_bytes(bytes(data))
    with pytest.raises(
        ArtifactMismatch,
        match=f"format version {WARM_VERSION - 1} does not match this kvedge \\({WARM_VERSION}\\)",
    ):
        read_warm_file(path, geometry, "x", [1, 2, 3], graph_fingerprint="g")


def test_a_state_models_warm_file_carries_its_states_and_ends_where_they_are_known(tmp_path):
    """Per-slot states (LFM2) are stored at the positions of `state_at`, the end always; a prefix
    without its end's states is refused when written, one whose file lost them when read."""
    conv = StateSpec("conv", (0, 2), (2, 8))
    geometry = CacheGeometry(
        num_layers=1, num_kv_heads=2, head_dim=16, max_len=128, kv_layers=(1,), states=(conv,)
    )
    block = KVBlock(np.ones((1, 2, 2, 5, 16), np.float32))
    states = {p: {"conv": np.full((2, 2, 8), p, np.float32)} for p in (3, 5)}
    path = tmp_path / "p.kvw"
    write_warm_file(path, WarmPrefix("p", (1, 2, 3, 4, 5), block, states=states), geometry, "x")
    loaded = read_warm_file(path, geometry, "x", [1, 2, 3, 4, 5])
    assert loaded.state_at == (3, 5)
    for position in (3, 5):
        np.testing.assert_array_equal(loaded.states[position]["conv"], states[position]["conv"])
    with pytest.raises(KvedgeError, match="states at \\[3\\].*5 included"):
        write_warm_file(path, WarmPrefix("p", (1, 2, 3, 4, 5), block, states={3: states[3]}), geometry, "x")


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(data_bytes="64"), r"Expected `int`, got `str` - at `\$.data_bytes`"),
        (dict(count=-1), r"Expected `int` >= 0 - at `\$.count`"),
        (dict(token_ids=[1, "2"]), r"Expected `int`, got `str` - at `\$.token_ids\[1\]`"),
        (dict(geometry=[2, 2, 16]), r"Expected `object`, got `array` - at `\$.geometry`"),
    ],
)
def test_warm_file_header_of_the_wrong_type_is_refused_naming_the_field(tmp_path, change, message):
    header = dict(
        name="p",
        model_fingerprint="x",
        scales_fingerprint="",
        geometry={"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"},
        count=1,
        token_ids=[1],
        data_bytes=2 * 2 * 2 * 16 * 4,
        kvedge_version="0",
    )
    raw = json.dumps({**header, **change}).encode()
    path = tmp_path / "p.kvw"
    path.write_bytes(
        struct.pack("<8sII", MAGIC, WARM_VERSION, len(raw)) + raw + bytes(header["data_bytes"] + 32)
    )
    geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
    with pytest.raises(ArtifactMismatch, match=message):
        read_warm_file(path, geometry, "x", [1])
    path.write_bytes(struct.pack("<8sII", MAGIC, WARM_VERSION, 2) + b"[]" + bytes(32))
    with pytest.raises(ArtifactMismatch, match="expected a JSON object, found a list"):
        read_warm_file(path, geometry, "x", [1])


KILL_DURING_WRITE = """
import os, signal, sys
import numpy as np
from kvedge.contract import CacheGeometry
from kvedge.runtime import prefix as warm
from kvedge.runtime.cache import KVBlock
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # die after the bytes, before the rename
geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
block = KVBlock(np.ones((2, 2, 2, 3, 16), np.float32))
warm.write_warm_file(warm.Path(sys.argv[1]), warm.WarmPrefix("assistant", (1, 2, 3), block), geometry, "x")
"""


def test_process_killed_mid_write_never_leaves_a_loadable_file(tiny_llama, warm):
    boot(tiny_llama, warm)
    folder = warm[1]
    target = folder / "assistant.kvw"
    target.unlink()
    done = subprocess.run([sys.executable, "-c", KILL_DURING_WRITE, str(target)], capture_output=True)
    assert done.returncode == -signal.SIGKILL
    leftovers = list(folder.glob(".assistant.kvw.*.tmp"))
    assert leftovers and not target.exists()
    for leftover in leftovers:  # a crash some time ago: its writer's lock went with it
        age(leftover)
    rebooted = boot(tiny_llama, warm)
    assert rebooted.prefixes.warm_report.rebuilt == {"assistant": "missing"}
    assert target.exists() and not any(p.exists() for p in leftovers)


def test_bad_config_names_file_and_key(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("prefixes:\n  - name: a\n    messages:\n      - {role: wizard, content: hi}\n")
    with pytest.raises(
        KvedgeError,
        match=r"w.yaml: prefixes\[0\].messages\[0\].role: 'wizard' is not allowed; allowed: system, user",
    ):
        load_warm_prefix_config(path)
    path.write_text("prefixes:\n  - name: a\n    text: x\n    messages: []\n")
    with pytest.raises(KvedgeError, match="must be a mapping|exactly one"):
        load_warm_prefix_config(path)
    path.write_text("prefixes:\n  - name: a\n    messages: []\n")
    with pytest.raises(KvedgeError, match=r"w.yaml: prefixes\[0\].messages: \[\] is not allowed"):
        load_warm_prefix_config(path)
    path.write_text("prefixes: []\n")
    with pytest.raises(
        KvedgeError, match=r"w.yaml: prefixes: \[\] is not allowed; allowed: a non-empty list"
    ):
        load_warm_prefix_config(path)
    path.write_text("prefix: []\n")  # unknown key
    with pytest.raises(KvedgeError, match="w.yaml: prefix: unknown key; allowed keys: prefixes"):
        load_warm_prefix_config(path)
    path.write_text("prefixes:\n  - {name: a, text: 5}\n")  # wrong type
    with pytest.raises(
        KvedgeError, match=r"w.yaml: prefixes\[0\].text: 5 is not allowed; allowed: a non-empty"
    ):
        load_warm_prefix_config(path)
    path.write_text("prefixes:\n  - {name: ../etc, text: x}\n")  # out of the allowed names
    with pytest.raises(
        KvedgeError, match=r"w.yaml: prefixes\[0\].name: '../etc' is not allowed; allowed: a str"
    ):
        load_warm_prefix_config(path)
    path.write_text("prefixes:\n  - {name: a, text: x}\n  - {name: a, text: y}\n")
    with pytest.raises(KvedgeError, match=r"w.yaml: prefixes: names must be unique, got \['a', 'a'\]"):
        load_warm_prefix_config(path)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(count=2), "count 2 does not match its 3 token ids"),
        (dict(data_bytes=3 * 2 * 2 * 2 * 16 * 4 - 64), "data bytes, 3 tokens need"),
    ],
)
def test_checksummed_warm_file_whose_header_disagrees_with_itself_is_refused(tmp_path, change, message):
    """A file with a valid checksum, fingerprints and geometry, but a count that is not its number of
    token ids, or a data size that is not what its count needs: refused before any array is made."""
    import hashlib

    geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
    block = KVBlock(np.ones((2, 2, 2, 3, 16), np.float32))
    path = tmp_path / "p.kvw"
    write_warm_file(path, WarmPrefix("p", (1, 2, 3), block), geometry, "x")
    data = path.read_bytes()
    _, _, length = struct.unpack_from("<8sII", data)
    header = json.loads(data[16 : 16 + length])
    raw = json.dumps({**header, **change}).encode().ljust(length)
    assert len(raw) == length
    body = data[:16] + raw + data[16 + length : -32]
    if "data_bytes" in change:  # keep the size consistent with the header's promise
        body = body[: 16 + length + change["data_bytes"]]
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(ArtifactMismatch, match=message):
        read_warm_file(path, geometry, "x", [1, 2, 3])


def age(path, seconds: float = STALE_TEMP_AGE_S + 1) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_warm_prefixes_remove_only_the_temp_files_of_dead_writers(tiny_llama, warm):
    """A writer holds an flock on its temp file until it is renamed into place: the sweep at the
    end of load_warm_prefixes leaves a locked one (another `kvedge warm-prefixes` at work) and a fresh one
    (created, not yet locked) alone, and removes an old unlocked one."""
    boot(tiny_llama, warm)
    folder = warm[1]
    live, fresh, dead = (folder / f".assistant.kvw.{what}.tmp" for what in ("live", "fresh", "dead"))
    for path in (live, fresh, dead):
        path.write_bytes(b"half a warm file")
    age(live)
    age(dead)
    with open(live, "rb") as held:  # another open file: flock conflicts as with another process
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        boot(tiny_llama, warm)
        assert live.exists() and fresh.exists() and not dead.exists()
    boot(tiny_llama, warm)
    assert not live.exists() and fresh.exists()


def test_writers_of_one_warm_file_and_sweeps_run_side_by_side(tmp_path):
    """Two writers of the same prefix (two `kvedge warm-prefixes` runs on one folder) while the
    folder is swept again and again: no writer finds its temp file gone, and the file loads."""
    geometry = CacheGeometry(num_layers=4, num_kv_heads=4, head_dim=64, max_len=1024)
    block = KVBlock(np.ones((4, 2, 4, 1000, 64), np.float32))  # 8 MB: a write takes a while
    prefix = WarmPrefix("p", tuple(range(1000)), block)
    path = tmp_path / "p.kvw"
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(8):
                write_warm_file(path, prefix, geometry, "x")
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for writer in writers:
        writer.start()
    sweeps = 0
    while any(writer.is_alive() for writer in writers):
        remove_stale_temps(tmp_path)
        sweeps += 1
    for writer in writers:
        writer.join()
    assert not errors and sweeps > 10
    assert not list(tmp_path.glob("*.tmp"))
    read_warm_file(path, geometry, "x", prefix.token_ids)


def nan_like(prefix: WarmPrefix) -> WarmPrefix:
    block = KVBlock(*(None if a is None else np.full_like(a, np.nan) for a in prefix.block))
    return WarmPrefix(prefix.name, prefix.token_ids, block)


def test_warm_file_of_non_finite_values_with_a_valid_checksum_is_refused_and_recomputed(
    tiny_llama, warm, caplog
):
    model = boot(tiny_llama, warm)
    manifest, prefix = model.manifest, model.prefixes.warm.prefixes[0]
    path = warm[1] / "assistant.kvw"
    good = path.read_bytes()
    write_warm_file(
        path,
        nan_like(prefix),
        manifest.geometry,
        manifest.source_fingerprint,
        graph_fingerprint=manifest.onnx_fingerprint,
    )
    with pytest.raises(ArtifactMismatch, match="assistant.kvw: non-finite values in its K/V 'kv' array"):
        read_warm_file(
            path,
            manifest.geometry,
            manifest.source_fingerprint,
            prefix.token_ids,
            graph_fingerprint=manifest.onnx_fingerprint,
        )
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.warm_prefixes"):
        rebooted = boot(tiny_llama, warm)
    assert "non-finite values in its K/V" in rebooted.prefixes.warm_report.rebuilt["assistant"]
    assert rebooted.prefixes.warm_report.loaded == ["notes"]
    assert [r.getMessage() for r in caplog.records if r.name == "kvedge.runtime.warm_prefixes"] == [
        f"warm prefix assistant: recomputing ({rebooted.prefixes.warm_report.rebuilt['assistant']})"
    ]
    assert path.read_bytes() == good
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello! How are you?"}]
    ids = rebooted.tokenizer.encode_chat(messages)
    logits = rebooted.prepare(0, ids)
    assert rebooted.sessions[0].reused_tokens == len(prefix.token_ids)
    cold = tiny_llama.model()
    np.testing.assert_allclose(logits, prefill(cold.backend, cold.cache, 0, [ids])[0], atol=ATOL, rtol=0)


def test_int8_warm_file_with_a_non_finite_scale_is_refused_naming_the_scales(tmp_path):
    geometry = CacheGeometry(
        num_layers=2, num_kv_heads=2, head_dim=16, max_len=128, dtype="int8", group_size=16
    )
    scales = np.ones((2, 2, 2, 3, 1), np.float16)  # [layers, 2, kv_heads, tokens, groups]
    block = KVBlock(np.ones((2, 2, 2, 3, 16), np.int8), scales)
    path = tmp_path / "p.kvw"
    write_warm_file(path, WarmPrefix("p", (1, 2, 3), block), geometry, "x")
    assert read_warm_file(path, geometry, "x", [1, 2, 3]).block.scales.shape == scales.shape
    scales[1, 0, 1, 2, 0] = np.inf
    write_warm_file(path, WarmPrefix("p", (1, 2, 3), block), geometry, "x")
    with pytest.raises(ArtifactMismatch, match="p.kvw: non-finite values in its K/V 'scales' array"):
        read_warm_file(path, geometry, "x", [1, 2, 3])


def test_a_warning_logged_under_a_progress_bar_starts_its_own_line(tiny_llama, warm, tmp_path):
    """On a pipe tqdm ends a bar's updates with \\r, no newline: a log line written as such would
    continue the bar's line, and so would one after a \\r that clears it, for the journal, which
    splits records at newlines only."""
    boot(tiny_llama, warm)
    config = tmp_path / "warmup.yaml"  # written by the warm fixture
    flip_byte(warm[1] / "assistant.kvw")  # the first of two prefixes: warned while the bar is open
    done = subprocess.run(
        [sys.executable, "-m", "kvedge", "warm-prefixes", "--model", str(tiny_llama.out)]
        + ["--warm-prefixes", str(config), "--warm-dir", str(warm[1])],
        capture_output=True,  # bytes: text mode would read each \r as a newline
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.decode().split("\n")
    warned = [line for line in lines if "WARNING" in line]
    assert warned and all(line.startswith("WARNING kvedge.runtime.warm_prefixes: ") for line in warned), lines
    assert any(line.startswith("\rwarm prefixes:   0%") for line in lines), lines  # the bar was open
    assert any("warm prefixes: 100%" in line for line in lines), lines


@pytest.mark.parametrize("field", ["text", "messages"])
def test_a_warm_prefix_far_over_max_len_is_refused_before_tokenizing(long_entry_artifact, tmp_path, field):
    """1 MB of words: counted only until past max_len (512), and refused saying "at least"."""
    text = "word " * 200_000
    prefix = {"text": text} if field == "text" else {"messages": [{"role": "system", "content": text}]}
    path = tmp_path / "warmup.yaml"
    path.write_text(json.dumps({"prefixes": [{"name": "huge", **prefix}]}))  # JSON is YAML
    with pytest.raises(KvedgeError, match="warm prefix 'huge' has at least .* tokens; max_len is 512"):
        Model(long_entry_artifact, warm_prefixes=load_warm_prefix_config(path), warm_dir=tmp_path / "warm")
