"""Memory planner: KV bytes equal what the runtime allocates, the table is right for
hand-computed cases, and what does not fit is refused saying by how much."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorrt_claims import ACCEPTED, MAX_LEN
from tiny import card_architecture, make_tiny_model

from kvedge.configs import BOARDS_DIR, load_board, load_recipe
from kvedge.contract import KV_DTYPES, CacheGeometry, ExportRecipe, StateSpec
from kvedge.contract.engine import device_refusal
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.files import human
from kvedge.machine import available_memory
from kvedge.planner import (
    CPU_HELD,
    MAX_SLOTS,
    OVERHEADS,
    QUALITY_BAR,
    RECOMMENDED_DEVICES,
    SECOND_FORM_DECODE_GAIN,
    Budget,
    ModelFootprint,
    board_budget,
    check_fits,
    device_forms,
    estimate,
    footprint,
    kv_bytes,
    live_budget,
    make_plan,
    measured_kl,
    model_refusal,
    parse_bytes,
    plan_report,
    recipe_weight_bytes,
    recommend,
    render,
    state_bytes,
    weight_form,
    what_fits,
    with_form,
)
from kvedge.planner import budget as planner_budget
from kvedge.runtime.cache import MAX_SNAPSHOTS, KVCache

RUNTIME = OVERHEADS["cpu"].runtime_bytes


def kvedge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("dtype", sorted(KV_DTYPES))
def test_kv_bytes_equal_what_kvcache_allocates(dtype):
    model = footprint("smollm2-135m")
    for slots, context in ((1, 64), (3, 128), (2, 1000)):
        geometry = CacheGeometry(num_layers=30, num_kv_heads=3, head_dim=64, max_len=context).with_dtype(
            dtype
        )  # SmolLM2-135M, written out (int8: a float16 scale per 32 channels)
        assert kv_bytes(model, slots, context, dtype) == KVCache(geometry, slots).nbytes


def test_export_plan_equals_the_loaded_models_allocation(tiny_llama):
    model = footprint(tiny_llama.out)
    files = [tiny_llama.out / "model.onnx", tiny_llama.out / "model.onnx.data"]
    assert model.weights_bytes == sum(f.stat().st_size for f in files if f.exists())
    for slots in (1, 3):
        loaded = tiny_llama.model(slots)
        assert check_fits(tiny_llama.out, slots, budget_bytes=1 << 40).kv == loaded.cache.nbytes


HAND = ModelFootprint(
    name="hand",
    origin="test",
    weights_bytes=1000,
    weights_note="",
    geometry=CacheGeometry(num_layers=2, num_kv_heads=1, head_dim=4, max_len=16),  # 64 B per token
    num_heads=2,
    hidden_size=8,
    intermediate_size=16,
    vocab_size=10,
    logits="last",
    max_context=64,
    fixed_context=False,
)
# Worked by hand (4 bytes per float; the prefill chunk is the whole context here):
#   context 16, prefill of one row: 4 * (8*2*16*32 + 3*16*16 + 4*16*8 + 10) + 2*16*64 = 39,976
#   context 32, prefill of one row: 4 * (8*2*32*64 + 3*32*16 + 4*32*8 + 10) + 2*32*64 = 145,448
#   (decode of 4 rows is smaller: 4 * (8*4*2*17 + 3*4*16 + 4*4*8 + 4*10) + 2*4*64 = 6,304 at 16)
#   kv: 64 B x context x slots; load (1.3 - 1) x 1000 = 300 (CPU_HELD, float32); weights 1000; + runtime
EXPECTED = [
    [1000 + 300 + 1024 + 39976, 1000 + 300 + 4096 + 39976],
    [1000 + 300 + 2048 + 145448, 1000 + 300 + 8192 + 145448],
]


def test_table_matches_hand_computed_totals():
    plan = make_plan(HAND, Budget(RUNTIME + 150_000, 0, "test"), "cpu", slots=(1, 4), contexts=(16, 32))
    assert [[cell.total - RUNTIME for cell in row] for row in plan.cells] == EXPECTED
    assert [[plan.fits(cell) for cell in row] for row in plan.cells] == [[True, True], [True, False]]
    table = render(plan).splitlines()
    assert table[-2].split()[:3] == [
        "16",
        f"{(RUNTIME + 40452) / 2**30:.2f}",
        f"{(RUNTIME + 43524) / 2**30:.2f}",
    ]
    assert table[-1].split()[:3] == ["32", f"{(RUNTIME + 144900) / 2**30:.2f}", "-"]


# HAND with one KV layer of two and a conv state [2, 8] float32 (64 B) on the other
HYBRID = dataclasses.replace(
    HAND,
    geometry=CacheGeometry(
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        max_len=16,
        kv_layers=(1,),
        states=(StateSpec("conv", (0,), (2, 8)),),
    ),  # 32 B per token
)


def test_a_hybrids_cell_counts_its_states_once_per_slot():
    """Worked by hand, 1 slot x 16 tokens: weights 1000, load 300, kv 16 x 32 = 512, states 64 x
    (1 + 4 snapshots) = 320, activations 4 * (8*2*16*32 + 3*16*16 + 4*16*8 + 10) + 2*16*32 + 2*64
    (the new states, like the new K/V) = 39,080; 4 slots: states 1,280, kv 2,048, whatever the
    context."""
    assert MAX_SNAPSHOTS == 4
    plan = make_plan(HYBRID, Budget(1 << 30, 0, "test"), "cpu", slots=(1, 4), contexts=(16,))
    one, four = plan.cells[0]
    assert (one.kv, one.states, one.activations) == (512, 320, 39_080)
    assert one.total - RUNTIME == 1000 + 300 + 512 + 320 + 39_080
    assert (four.kv, four.states) == (2048, 1280) and state_bytes(HYBRID, 4) == 1280
    assert "states 320 B" in one.breakdown() and "states" not in estimate(HAND, 1, 16).breakdown()
    # what fits instead weighs the states: 3 slots' KV fit (1,300 + 39,080 + 3 x 512 = 41,916) but not
    # with their states (+ 3 x 320); 2 slots do (42,044), and a float16 cache (- 768) would not
    tight = Budget(RUNTIME + 42_044, 0, "test")
    assert what_fits(make_plan(HYBRID, tight, "cpu", slots=(3,), contexts=(16,))).options == (
        ("--slots", "2"),
    )


@pytest.mark.parametrize("name", ["lfm2-1.2b", "qwen3.5-0.8b"])
def test_a_hybrids_kv_and_states_are_what_kvcache_allocates(name):
    model = footprint(name)
    for slots, context in ((1, 64), (3, 128)):
        geometry = dataclasses.replace(model.geometry, max_len=context)
        live = slots * geometry.state_bytes_per_slot()
        assert kv_bytes(model, slots, context) + live == KVCache(geometry, slots).nbytes
        assert state_bytes(model, slots) == live * (1 + MAX_SNAPSHOTS)


def test_plan_prints_a_hybrids_state_bytes_beside_its_kv_per_token():
    """`kvedge plan RECIPE`: KV per token counts the attention layers only (Qwen3.5-4B: 8 of 32, 65,536
    bytes float32, well under a dense model's), and the states line says what a slot holds whatever
    its length; the JSON cells carry the states."""
    text = plan_report("qwen3.5-4b", profile="orin-nano-8gb", device="cpu", slots="1")
    assert "kv cache     float32: 65,536 bytes per token per slot (8 of 32 layers hold KV)" in text
    assert (
        "states       52,690,944 bytes per slot whatever its length (conv [3, 8192] + recurrent "
        "[32, 128, 128] float32 on 24 layers); 251.2 MiB with the runtime's 4 snapshots"
    ) in text
    dense = footprint("qwen3-1.7b").geometry.bytes_per_token()
    assert footprint("qwen3.5-0.8b").geometry.bytes_per_token() * 9 < dense  # 24,576 against 229,376
    lfm2 = plan_report("lfm2-1.2b", budget="8GiB", slots="1")
    assert "24,576 bytes per token per slot (6 of 16 layers hold KV)" in lfm2
    assert (
        "states       163,840 bytes per slot whatever its length (conv [2, 2048] float32 on 10 layers)"
        in lfm2
    )
    rows = json.loads(plan_report("qwen3.5-0.8b", budget="8GiB", slots="2", max_lens="2048", as_json=True))
    assert rows[0]["rows"][0]["states"] == 2 * 20_201_472 * (1 + MAX_SNAPSHOTS)
    assert rows[0]["rows"][0]["kv"] == 2 * 2048 * 24_576
    assert "states" not in plan_report("qwen3-0.6b", budget="8GiB", slots="1").split("budget")[0]


def test_plan_of_a_hybrid_export_prints_its_states(tmp_path):
    """`kvedge plan DIR`: an exported LFM2's manifest geometry, states and KV layers included."""
    export_model(make_tiny_model(tmp_path / "hf", "lfm2"), tmp_path / "out", ExportRecipe(max_len=64))
    done = kvedge("plan", str(tmp_path / "out"), "--memory-budget", "1GiB")
    assert done.returncode == 0, done.stderr
    model = footprint(tmp_path / "out")
    g = model.geometry
    assert f"bytes per token per slot ({g.num_layers} of {g.model_layers} layers hold KV)" in done.stdout
    assert (
        f"states       {g.state_bytes_per_slot():,} bytes per slot whatever its length (conv" in done.stdout
    )
    assert estimate(model, 2, 64).states == 2 * g.state_bytes_per_slot() * (1 + MAX_SNAPSHOTS)


@pytest.mark.parametrize("name", ["lfm2-1.2b", "lfm2.5-1.2b", "qwen3.5-0.8b", "qwen3.5-4b"])
@pytest.mark.parametrize("device", ["cuda", "tensorrt"])
def test_a_hybrid_is_planned_on_the_gpu_with_nothing_recommended(name, device):
    """onnxruntime's CUDA provider and TensorRT bind per-slot states as they bind the pool: the
    plan is the device's, with the states beside the KV, its forms float16 ones too; and nothing
    is recommended, since only the float32 form's quality is known for a hybrid."""
    text = plan_report(name, profile="orin-nano-8gb", device=device)
    assert f"device       {device} (" in text and "states       " in text and "per-slot states" not in text
    assert [form for form in device_forms(footprint(name).form, device) if form.half]
    assert recommend("orin-nano-8gb", name, device) is None
    assert text.splitlines()[-1].startswith(f"recommended for orin-nano-8gb on --device {device}: nothing; ")


def test_a_hybrids_quantized_forms_count_as_unmeasured():
    """The KL tables were measured on a dense model: for a hybrid only the float32 form is known
    (the float32 model itself); what fits instead says "quality unmeasured" for the others."""
    assert measured_kl(ExportRecipe(), float32_only=True) == 0.0
    for form in (
        ExportRecipe(weights="int8"),
        ExportRecipe(weights="int4"),
        ExportRecipe(kv_dtype="int8"),
        ExportRecipe(precision="float16"),
    ):
        assert measured_kl(form) is not None and measured_kl(form, float32_only=True) is None
    text = plan_report("qwen3.5-4b", profile="orin-nano-8gb", device="cpu")
    assert "(quality unmeasured)" in text and "KL 0." not in text


def test_check_fits_says_by_how_much():
    assert check_fits(HAND, 1, RUNTIME + 150_000, context=32).total == RUNTIME + 148_796
    with pytest.raises(KvedgeError) as error:
        check_fits(HAND, 4, RUNTIME + 150_000, context=32)
    message = str(error.value)
    assert "hand: 4 slots x 32 tokens (float32 cache)" in message
    assert "4,940 B over" in message and "at most 1 slot fit at this context" in message
    with pytest.raises(KvedgeError, match="not even 1 slot fits"):
        check_fits(HAND, 1, 1000)


def test_context_beyond_the_model_is_refused():
    with pytest.raises(KvedgeError, match="context 128 exceeds what hand supports; allowed: 1..64"):
        make_plan(HAND, Budget(1 << 40, 0, "test"), contexts=(16, 128))


def test_live_budget_is_what_this_process_may_allocate(tmp_path, monkeypatch):
    """MemAvailable, or a cgroup's limit less its usage where that is less (a container's)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemFree:  100 kB\nMemAvailable:    6000000 kB\n")
    none = tmp_path / "none"
    budget = live_budget(reserve_bytes=1 << 20, available=available_memory(meminfo, none, none, none))
    assert (budget.total_bytes, budget.usable) == (6_000_000 * 1024, 6_000_000 * 1024 - (1 << 20))
    assert budget.source == "MemAvailable of this machine"
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "memory.max").write_text(str(3 << 30))
    (tmp_path / "cg" / "memory.current").write_text(str(1 << 30))
    (tmp_path / "cgroup").write_text("0::/\n")
    budget = live_budget(available=available_memory(meminfo, tmp_path / "cg", tmp_path / "cgroup", none))
    assert budget.total_bytes == 2 << 30 and budget.source.startswith("cgroup ")
    monkeypatch.setattr(planner_budget, "available_memory", lambda: None)  # no /proc, no limit
    with pytest.raises(KvedgeError, match="cannot read MemAvailable from /proc/meminfo, nor a cgroup"):
        live_budget()


def test_parse_bytes():
    assert [parse_bytes(t) for t in ("6GiB", "512MiB", "1.5G", "64k", "123")] == [
        6 << 30,
        512 << 20,
        3 << 29,
        64 << 10,
        123,
    ]
    with pytest.raises(KvedgeError, match="size '6 TB' is not allowed; allowed: bytes or a number with KiB"):
        parse_bytes("6 TB")


def test_plan_report_for_a_device_and_per_kv_dtype():
    text = plan_report(  # the ort graph takes all three caches; onnxruntime CPU runs each
        "smollm2-135m",
        profile="orin-nano-8gb",
        device="cpu",
        form=ExportRecipe(variant="ort"),
        kv_dtypes=["float32", "float16", "int8"],
        slots="1,4",
    )
    assert text.count("budget       6.50 GiB = orin-nano-8gb 8.00 GiB - reserve 1.50 GiB") == 3
    assert "float32: 46,080 bytes per token" in text and "float16: 23,040 bytes per token" in text
    assert "int8: 12,240 bytes per token" in text  # 30 layers x 2 x 3 heads x (64 codes + 2 x 2-byte scales)
    rows = json.loads(plan_report("smollm2-135m", budget="4GiB", slots="1", max_lens="2048", as_json=True))
    assert rows[0]["rows"][0]["kv"] == 30 * 2 * 3 * 64 * 4 * 2048 and rows[0]["rows"][0]["fits"]
    with pytest.raises(
        KvedgeError, match="--kv-dtype 'int2' is not allowed; allowed: float32, float16, int8, int4"
    ):
        plan_report("smollm2-135m", kv_dtypes=["int2"])
    with pytest.raises(KvedgeError, match="--kv-dtype int4 runs kvedge's own CPU attention kernel"):
        plan_report("smollm2-135m", kv_dtypes=["int4"])  # the portable graph has no 4-bit cache
    with pytest.raises(KvedgeError, match="--slots '1,x' is not allowed"):
        plan_report("smollm2-135m", slots="1,x")
    with pytest.raises(  # a cache the recipe's graph is not exported with, refused as export refuses it
        KvedgeError, match=r"--kv-dtype float16 with float32 compute is built for --variant ort only"
    ):
        plan_report("smollm2-135m", kv_dtypes=["float16"])


def test_cli_plan(tmp_path, tiny_llama):
    done = kvedge("plan", "smollm2-135m", "--profile", "orin-nano-8gb", "--slots", "1,2")
    assert done.returncode == 0, done.stderr
    assert "<- recipe max_len" in done.stdout and "device       cuda (CUDA/TensorRT" in done.stdout

    export = kvedge("plan", str(tiny_llama.out), "--memory-budget", "1MiB")
    assert export.returncode == 0, export.stderr
    assert "<- this export" in export.stdout and "nothing above fits" in export.stdout
    with pytest.raises(KvedgeError, match="--weights and its options apply to recipes only"):
        plan_report(tiny_llama.out, form=ExportRecipe(weights="float16"))

    bad = yaml.safe_load((BOARDS_DIR / "orin-nano-8gb.yaml").read_text())
    bad["memory_bytes"] = "lots"
    path = tmp_path / "orin-nano-8gb.yaml"
    path.write_text(yaml.safe_dump(bad))
    refused = kvedge("plan", "smollm2-135m", "--profile", str(path))
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"{path}: memory_bytes: 'lots' is not allowed" in refused.stderr


def test_float16_weight_export_counts_half_the_file_and_the_widened_copy(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "llama")
    export_model(source, tmp_path / "f32", ExportRecipe(max_len=64))
    export_model(source, tmp_path / "f16", ExportRecipe(max_len=64, weights="float16"))
    f32, f16 = footprint(tmp_path / "f32"), footprint(tmp_path / "f16")
    assert 0.45 < f16.weights_bytes / f32.weights_bytes < 0.56
    assert f32.widened_bytes == 0 and f16.widened_bytes == 2 * f16.weights_bytes
    cpu = estimate(f16, 1, 64)
    assert cpu.weights == f16.weights_bytes
    assert cpu.load == int(CPU_HELD["float32", "float16"] * f16.weights_bytes) - f16.weights_bytes
    gpu = estimate(f16, 1, 64, device="tensorrt")
    assert gpu.load == f16.weights_bytes + 2 * f16.weights_bytes  # the host copy, and the float32 one


# --- every weight form export makes, and what fits when nothing does ----------------------------


def test_plan_takes_every_weight_form():
    sizes = {
        w: footprint("smollm2-135m", ExportRecipe(weights=w)).weights_bytes
        for w in ("float32", "float16", "int8", "int4")
    }
    assert sizes["float32"] == 2 * sizes["float16"] == 134_515_008 * 4
    assert sizes["float32"] > sizes["int8"] > sizes["int4"]  # the embedding table stays float32
    # the ort graph's two decode forms: kvedge's QuantMatMul holds the codes again; onnxruntime's one copy
    two = footprint("smollm2-135m", ExportRecipe(weights="int4", variant="ort")).weights_bytes
    one = footprint(
        "smollm2-135m", ExportRecipe(weights="int4", variant="ort", decode_matmuls="onnxruntime")
    ).weights_bytes
    assert two > one
    for weights in ("int8", "int4"):
        done = kvedge("plan", "smollm2-135m", "--profile", "orin-nano-8gb", "--weights", weights)
        assert done.returncode == 0, done.stderr
        head = "" if weights == "int8" else ", int8 head"  # the head is never below 8 bits by default
        assert f"bits each, {weights} portable (block 32, 8 float32 channels{head})" in done.stdout
    old = kvedge("plan", "smollm2-135m", "--device", "orin-nano-8gb", "--weights-dtype", "int8")
    assert old.returncode == 0, old.stderr
    assert "use --profile orin-nano-8gb" in old.stderr and "use --weights" in old.stderr
    assert "budget       6.50 GiB = orin-nano-8gb" in old.stdout and "int8 portable" in old.stdout


def test_plan_says_what_the_second_form_of_the_weights_costs_and_buys(tmp_path):
    """An ort int8/int4 export holds its weights twice, a prefill and a decode form: `kvedge plan`
    says under its bytes how many are the decode form and the decode speed they were measured to
    buy against one form (`SECOND_FORM_DECODE_GAIN`); a one-form export or recipe says nothing."""
    gain = "decode {:.2f}x as fast as one form at 64 tokens of context, {:.2f}x at 2000".format

    def below_weights(*options: str) -> str:
        done = kvedge("plan", "smollm2-135m", "--memory-budget", "8GiB", *options)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        return lines[1 + next(i for i, line in enumerate(lines) if line.startswith("weights"))]

    for weights in ("int8", "int4"):
        two = ExportRecipe(weights=weights, variant="ort")
        one = dataclasses.replace(two, decode_matmuls="onnxruntime")
        decode = footprint("smollm2-135m", two).weights_bytes - footprint("smollm2-135m", one).weights_bytes
        line = below_weights("--weights", weights, "--variant", "ort")
        assert line == (
            f"{'':13}{human(decode)} of these are the decode form: {gain(*SECOND_FORM_DECODE_GAIN[weights])} "
            "(measured: SmolLM2-135M, an AVX2 CPU; at Qwen3-1.7B's shape, int8, 0.85-1.06x); "
            "--decode-matmuls onnxruntime keeps one form"
        )
    assert below_weights(
        "--weights", "int4", "--variant", "ort", "--decode-matmuls", "onnxruntime"
    ).startswith("device")
    assert below_weights().startswith("device")  # float32 weights: one form
    source = make_tiny_model(tmp_path / "hf", "llama")
    for form in (two, one):
        export_model(source, tmp_path / form.decode, dataclasses.replace(form, max_len=32))
    done = kvedge("plan", str(tmp_path / "kvedge"), "--memory-budget", "8GiB")
    assert done.returncode == 0, done.stderr
    assert f"\n{'':13}prefill and decode forms: {gain(*SECOND_FORM_DECODE_GAIN['int4'])} " in done.stdout
    assert "decode form" not in footprint(tmp_path / "onnxruntime").forms_note


def test_a_model_that_does_not_fit_is_shown_the_smallest_change_that_does():
    # Phi-3.5-mini (3.8B, untied: an 8-bit embedding table beside its int4 head) on an Orin Nano
    # 8GB, onnxruntime on its CPU: no form at 2048 tokens; the smallest change that keeps the
    # context and a measured KL within the bar, 1 slot x 512
    done = kvedge("plan", "phi-3.5-mini", "--profile", "orin-nano-8gb", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    first, advice = done.stdout.split("nothing above fits; the smallest change that does: ")
    assert all(cell == "-" for line in first.splitlines()[-4:] for cell in line.split()[1:6])
    assert advice.startswith("--weights int4 --kv-dtype int8 (KL 0.0003 vs")
    assert "int4 portable (block 32, 8 float32 channels, int8 head)" in advice
    assert "kv cache     int8" in advice
    fitting = [line.split() for line in advice.splitlines() if line.split()[:1] == ["512"]]
    assert fitting and fitting[0][1] != "-"  # 1 slot x 512 tokens fits
    assert "recommended" not in advice  # the CPU's export is README's, by measured speed
    text = plan_report("phi-4-mini", profile="orin-nano-8gb", device="tensorrt")
    assert text.splitlines()[-1] == (
        "recommended for orin-nano-8gb on --device tensorrt: nothing; no form of phi-4-mini whose "
        "quality was measured within KL 0.002 fits 1 slot of 2048 tokens"
    )
    # Llama-3.2-3B on an Orin NX 16GB, cuda: --weights float16 in a float32 graph would hold a
    # float32 copy too (25.4 GiB); the float16 graph halves weights and cache and fits
    budget = Budget(16 << 30, 1536 << 20, "orin-nx-16gb")
    plan = make_plan(footprint("llama-3.2-3b"), budget, "cuda")
    assert what_fits(plan).options == (("--precision", "float16"),)
    widened = make_plan(footprint("llama-3.2-3b", ExportRecipe(weights="float16")), budget, "cuda")
    assert not widened.anything_fits and widened.corner.load == 3 * widened.corner.weights


def test_what_fits_saves_the_fewest_bytes_and_never_grows_a_part():
    """Of the changes that fit, the one that saves the fewest bytes at the plan's smallest cell,
    keeping the context and a KL within the bar where one does; never one that makes the weights
    (with what loading them holds) or the cache per token bigger, nor a form the device refuses."""
    for model, profile, device in (
        ("llama-3.2-3b", "orin-nano-8gb", "cuda"),
        ("llama-3.2-3b", "orin-nano-8gb", "tensorrt"),
        ("qwen3-1.7b", "orin-nano-8gb", "cpu"),
        ("phi-4-mini", "orin-nx-16gb", "tensorrt"),
    ):
        fp = footprint(model)
        contexts = (fp.max_context,)
        plan = make_plan(fp, board_budget(load_board(profile)), device, slots=(16,), contexts=contexts)
        change = what_fits(plan)
        assert change is not None and change.plan.anything_fits and change.plan.refusal is None, model
        new, old = change.plan.corner, plan.corner
        assert new.weights + new.load <= old.weights + old.load and new.kv <= old.kv, (model, change.options)
        assert "--weights float16" not in change.describe() or "--precision float16" in change.describe()
    plan = make_plan(footprint("llama-3.2-3b"), board_budget(load_board("orin-nano-8gb")), "tensorrt")
    assert what_fits(plan).options == (("--weights", "int4"),)


def test_the_forms_weighed_include_the_4_bit_head():
    """The default head is 8 bits; a 4-bit one saves bytes at a measured cost in KL, so the forms
    what_fits weighs hold both (before, (None, 8) gave the default twice and never a 4-bit head)."""
    forms = device_forms(ExportRecipe(weights="int4"), "tensorrt")
    heads = {(f.precision, f.weights, f.lm_head_bits) for f in forms}
    for precision in ("float32", "float16"):
        assert {(precision, "int4", 8), (precision, "int4", 4)} <= heads
    assert all(device_refusal("tensorrt", f.variant, f.kv_dtype, f.logits) is None for f in forms)
    assert measured_kl(ExportRecipe(weights="int4", head_bits=4)) > 0.002


def test_a_form_the_device_refuses_gets_one_line_and_the_variant_switch():
    """Llama-3.2-1B int4 --variant ort: tensorrt builds portable graphs only and cuda runs no ort
    graph over a float32 cache, so neither gets a table or a smallest change for it: one line
    saying why, then the nearest form it runs, --variant portable, with its own table."""
    for device in ("tensorrt", "cuda"):
        text = plan_report(
            "llama-3.2-1b",
            profile="orin-nano-8gb",
            device=device,
            form=ExportRecipe(weights="int4", variant="ort"),
        )
        refused, rest = text.split("\n\n", 1)
        assert len(refused.splitlines()) == 1 and f"--device {device} " in refused
        assert rest.startswith(f"the nearest form --device {device} runs: --variant portable (KL 4.8e-08 vs")
        assert rest.count("total GiB by max_len") == 1 and "int4 portable (block 32" in rest
        assert "int4 ort" not in rest
    rows = json.loads(
        plan_report(
            "llama-3.2-1b",
            profile="orin-nano-8gb",
            device="tensorrt",
            form=ExportRecipe(variant="ort"),
            as_json=True,
        )
    )
    assert (
        rows[0]["refused"].startswith("--device tensorrt runs the portable graph") and rows[0]["rows"] == []
    )
    assert rows[0]["fits_with"] is None


def test_what_fits_tries_the_smallest_change_first():
    budget = lambda extra: Budget(RUNTIME + extra, 0, "test")  # noqa: E731
    # weights + load 1,300, activations 145,448 at 32 tokens (EXPECTED), KV 64 B a token float32
    plan = make_plan(HAND, budget(1300 + 145_448 + 3 * 2048), slots=(4,), contexts=(32,))
    assert not plan.anything_fits
    assert what_fits(plan).options == (("--slots", "3"),)
    plan = make_plan(HAND, budget(1300 + 145_448 + 1024), slots=(1,), contexts=(32,))
    assert what_fits(plan).options == (("--kv-dtype", "float16"),)  # 32 x 32 B fits, 32 x 64 B not
    plan = make_plan(HAND, budget(1300 + 39_976 + 16 * 64), slots=(1,), contexts=(32, 64))
    assert what_fits(plan).options == (("--max-len", "16"),)  # no weights to shrink: a shorter context
    assert what_fits(make_plan(HAND, budget(1 << 30), slots=(1,), contexts=(32,))) is None


def test_plan_and_export_take_one_recipe_type():
    """`kvedge plan`'s weight options parse into the exporter's own type: one set of rules."""
    with pytest.raises(
        KvedgeError, match=r"--block-size 7 is not allowed; allowed: \[16, 32, 64, 128, 256\]"
    ):
        weight_form({"weights": "int4", "block_size": 7})
    assert weight_form({"weights": "int4", "variant": "ort"}) == ExportRecipe(weights="int4", variant="ort")
    assert weight_form({}) is None


SIZE_CHECKS = [
    ExportRecipe(weights="int8"),
    ExportRecipe(weights="int4"),
    ExportRecipe(weights="int4", precision="float16"),
    ExportRecipe(weights="int4", variant="ort"),
    ExportRecipe(weights="int4", variant="ort", decode_matmuls="onnxruntime"),
    ExportRecipe(weights="int8", variant="ort", outlier_channels=0, head_bits=8),
    ExportRecipe(weights="int4", variant="ort", kv_dtype="float16"),  # the CUDA form: one form
    ExportRecipe(weights="int4", precision="float16", kv_dtype="int8"),  # what `recommend` gives
]


def mid_model(root: Path, tied: bool = True):
    """(source, its Architecture, root): a random llama big enough that its matrices, not the
    graph's own bytes, make the file."""
    from kvedge.configs import Architecture

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    source = make_tiny_model(root / "hf", "llama", tie_word_embeddings=tied, **shape)
    config = json.loads((source / "config.json").read_text())
    import safetensors.numpy

    params = sum(a.size for a in safetensors.numpy.load_file(source / "model.safetensors").values())
    arch = Architecture(
        family="llama",
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["hidden_size"] // config["num_attention_heads"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=config["tie_word_embeddings"],
        attention_bias=False,
        max_position_embeddings=config["max_position_embeddings"],
        param_count=params,
    )
    return source, arch, root


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory):
    return mid_model(tmp_path_factory.mktemp("mid"))


@pytest.mark.parametrize("form", SIZE_CHECKS, ids=ExportRecipe.describe_weights)
def test_recipe_weight_bytes_match_a_real_export(mid_llama, form):
    """The planner's bytes for a weight form against the files `kvedge export` writes: within 1% +
    96 KiB, what the planner leaves out (the graph's nodes, 76 KiB with the INT8 cache's, RoPE
    tables [max_len, head_dim/2] x 2, small constants; and block offsets it assumes present)."""
    source, arch, root = mid_llama
    out = root / f"{form.describe_weights()} {form.decode} {form.kv_dtype}".replace(" ", "_")
    options = dict(max_len=64, weights=form.weights, variant=form.variant, precision=form.precision)
    options.update(outlier_channels=form.outlier_channels, head_bits=form.head_bits, kv_dtype=form.kv_dtype)
    export_model(source, out, ExportRecipe(**options, decode_matmuls=form.decode_matmuls))
    on_disk = footprint(out).weights_bytes
    planned = recipe_weight_bytes(arch, form)
    assert abs(planned - on_disk) <= 0.01 * on_disk + 96 * 1024, (planned, on_disk)


@pytest.mark.parametrize(
    "family",
    ["lfm2", "qwen3_5"],
)
def test_a_hybrids_weight_bytes_match_a_real_export(tmp_path, family):
    """A hybrid's layers project differently (LFM2's convolution in [3 hidden] and out; Qwen3.5's
    Gated DeltaNet in and out, and its attention's output gate): int8 and int4 exports' files against
    the planner's bytes, within the bounds above."""
    from tiny import tiny_config

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3_5":
        shape.update(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_value_heads=8)
    source = make_tiny_model(tmp_path / "hf", family, **shape)
    config = tiny_config(family, **shape)
    import safetensors.numpy

    params = sum(a.size for a in safetensors.numpy.load_file(source / "model.safetensors").values())
    delta = {}
    if family == "qwen3_5":
        delta = dict(
            conv_kernel=config.linear_conv_kernel_dim,
            linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads,
            linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim,
        )
    arch = card_architecture(
        config,
        params,
        layer_types=tuple(config.layer_types),
        **(delta or {"conv_kernel": config.conv_L_cache}),
    )
    for weights in ("int8", "int4"):
        form = ExportRecipe(max_len=64, weights=weights)
        export_model(source, tmp_path / weights, form)
        on_disk = footprint(tmp_path / weights).weights_bytes
        planned = recipe_weight_bytes(arch, form)
        assert abs(planned - on_disk) <= 0.01 * on_disk + 96 * 1024, (weights, planned, on_disk)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_an_untied_tables_bytes_are_planned(tmp_path, precision):
    """An untied model's input table in a quantized export: 8-bit blocks in embeddings.bin (not
    float32 beside the graph), as the planner counts it, within the same bounds."""
    source, arch, _ = mid_model(tmp_path, tied=False)
    assert not arch.tie_word_embeddings
    form = ExportRecipe(max_len=64, weights="int4", precision=precision)
    manifest = export_model(source, tmp_path / "out", form)
    assert manifest.embedding.file == "embeddings.bin" and manifest.embedding.bits == 8
    on_disk = footprint(tmp_path / "out").weights_bytes
    table = (tmp_path / "out" / "embeddings.bin").stat().st_size
    assert table < 0.4 * arch.vocab_size * arch.hidden_size * 4  # not a float32 table
    planned = recipe_weight_bytes(arch, form)
    assert abs(planned - on_disk) <= 0.01 * on_disk + 96 * 1024, (planned, on_disk)


def test_plan_prints_bits_per_parameter_and_plans_the_float16_graph():
    """`kvedge plan --precision float16` plans TensorRT's float16 graph (scales, offsets and kept
    rows float16), and the weights line says what each parameter costs: Llama-3.2-3B int4 at
    5.15 bits in a float16 graph, 6.29 in a float32 one (float32 scales and offsets)."""
    lines = {}
    for precision in ("float32", "float16"):
        done = kvedge(
            "plan",
            "llama-3.2-3b",
            "--profile",
            "orin-nano-8gb",
            "--weights",
            "int4",
            "--precision",
            precision,
        )
        assert done.returncode == 0, done.stderr
        lines[precision] = next(line for line in done.stdout.splitlines() if line.startswith("weights"))
    assert (
        "3,212,749,824 params at 6.57 bits each, int4 portable (block 32, 8 float32 channels, int8 head)"
        in lines["float32"]
    )
    assert (
        "3,212,749,824 params at 5.53 bits each, int4 portable (block 32, 8 float16 channels, int8 head)"
        in lines["float16"]
    )
    done = kvedge("plan", "llama-3.2-3b", "--weights", "float32", "--precision", "float16")
    assert done.returncode != 0 and "--weights float32 is not allowed with --precision float16" in done.stderr
    assert "Traceback" not in done.stderr


# --- one recommendation per board ---------------------------------------------------------------


def test_recommend_gives_the_form_holding_the_most_slots_among_measured_ones():
    """`recommend`: a form the device runs, its KL measured within the bar, the most slots at the
    recipe's max_len (one more does not fit); on an Orin Nano 8GB with TensorRT, Llama-3.2-3B as
    the float16 int4 graph with an 8-bit head and the INT8 cache, 6 slots x 2048."""
    found = recommend("orin-nano-8gb", "llama-3.2-3b", "tensorrt")
    assert found.export_flags == "--precision float16 --weights int4 --kv-dtype int8"  # where torch is
    assert found.engine_command == "kvedge engine DIR --max-batch 6"  # on the device: no torch there
    assert (found.cell.slots, found.cell.context) == (6, 2048) and found.kl == pytest.approx(0.000302848)
    # the same form with the 4-bit head is smaller (2 slots more) but costs KL 0.027: never offered
    smaller = dataclasses.replace(found.form, head_bits=4)
    assert recipe_weight_bytes(load_recipe("llama-3.2-3b").architecture, smaller) < found.cell.weights
    assert measured_kl(smaller) > QUALITY_BAR
    for profile in ("orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb"):
        for model in ("qwen3-0.6b", "llama-3.2-1b", "phi-4-mini"):
            for device in RECOMMENDED_DEVICES:
                found = recommend(profile, model, device)
                if found is None:
                    continue
                f = found.form
                assert device_refusal(device, f.variant, f.kv_dtype, f.logits) is None
                assert measured_kl(f) == found.kl <= QUALITY_BAR
                fp = with_form(footprint(model), f)
                assert found.cell == estimate(fp, found.cell.slots, fp.geometry.max_len, device=device)
                assert found.cell.total <= found.budget.usable
                more = estimate(fp, found.cell.slots + 1, fp.geometry.max_len, device=device)
                assert found.cell.slots == MAX_SLOTS or more.total > found.budget.usable


def test_plan_prints_the_recommendation_and_refuses_one_for_an_export(tiny_llama):
    text = plan_report("llama-3.2-1b", profile="orin-nano-8gb", device="tensorrt")
    assert text.splitlines()[-1] == recommend("orin-nano-8gb", "llama-3.2-1b", "tensorrt").describe()
    assert text.splitlines()[-1].startswith(
        "recommended for orin-nano-8gb on --device tensorrt: kvedge export --precision float16 --weights int4"
    )
    rows = json.loads(plan_report("llama-3.2-1b", profile="orin-nano-8gb", device="tensorrt", as_json=True))
    assert rows[0]["recommended"]["export"].endswith("--kv-dtype int8")
    assert rows[0]["recommended"]["engine"] == "kvedge engine DIR --max-batch 16"
    assert ", then on the device kvedge engine DIR --max-batch 16: 16 slots" in text.splitlines()[-1]
    with pytest.raises(
        KvedgeError, match="is an export, whose form is its files; a recommendation is for a recipe"
    ):
        recommend("orin-nano-8gb", tiny_llama.out)
    assert "recommended" not in plan_report(tiny_llama.out, budget="1GiB")
    with pytest.raises(
        KvedgeError, match=r"--device 'cpu' has no recommendation; allowed: \['cuda', 'tensorrt'\]"
    ):
        recommend("orin-nano-8gb", "llama-3.2-1b", "cpu")
    assert "recommended" not in plan_report("llama-3.2-1b", profile="orin-nano-8gb", device="cpu")


# --- the docs state the planner's recommendation ------------------------------------------------

DOCS = [Path(__file__).resolve().parents[1] / name for name in ("README.md", "docs/JETSON.md")]
BOARD = re.compile(r"^\*\*(?P<title>[^*]+)\*\* \(`(?P<board>[a-z0-9-]+)`\)$")
TABLE_HEADER = "| model | export | slots x max_len | GiB |"


def board_tables(text: str) -> dict[str, list[str]]:
    """Each board's table, by the profile named two lines above it:
    **Jetson Orin Nano 8GB** (`orin-nano-8gb`)."""
    lines, found = text.splitlines(), {}
    for i, line in enumerate(lines):
        if (board := BOARD.match(line)) and lines[i + 2] == TABLE_HEADER:
            rows = found[board["board"]] = []
            for row in lines[i + 4 :]:
                if not row.startswith("|"):
                    break
                rows.append(row)
    return found


def recommendation_section(text: str) -> str:
    """From "One answer per board" to the end of the last board's table."""
    start = text.index("One answer per board")
    last = text.index(TABLE_HEADER, text.rindex("**Jetson "))
    end = text.find("\n\n", last)
    return text[start : end if end >= 0 else len(text)]


def recommendation_row(board: str, model: str) -> str:
    """A table row as the docs state `recommend`'s answer on --device tensorrt."""
    found = recommend(board, model, "tensorrt")
    if found is None:
        return f"| {model} | {model_refusal(model, 'tensorrt') or 'nothing measured fits 1 slot'} | - | - |"
    c = found.cell
    command = f"`{f'kvedge export {found.export_flags}'.strip()}`"
    return f"| {model} | {command} | {c.slots} x {c.context} | {c.total / 2**30:.2f} |"


def test_readme_and_jetson_doc_state_the_planners_one_recommendation_per_board():
    """README and docs/JETSON.md give each board in configs/devices a table of what to export for
    TensorRT, the same in both, every row `recommend`'s answer; and each form recommended is one
    TensorRT is proven to take (tests/tensorrt_claims.py)."""
    texts = [doc.read_text() for doc in DOCS]
    assert recommendation_section(texts[0]) == recommendation_section(texts[1]), "README and JETSON.md differ"
    stated = [board_tables(text) for text in texts]
    assert sorted(stated[0]) == sorted(p.stem for p in BOARDS_DIR.glob("*.yaml"))
    wrong = []
    for board, rows in stated[0].items():
        for row in rows:
            want = recommendation_row(board, row.split("|")[1].strip())
            if row != want:
                wrong.append(f"{board}: the docs say\n  {row}\nthe planner\n  {want}")
    assert not wrong, "recommendations the planner no longer gives:\n" + "\n".join(wrong)
    for board in stated[0]:
        for row in stated[0][board]:
            found = recommend(board, row.split("|")[1].strip(), "tensorrt")
            assert found is None or dataclasses.replace(found.form, max_len=MAX_LEN) in ACCEPTED.values()


CACHE_HEADER = "| model | KV bytes per token | layers holding KV | state bytes per slot |"


def cache_row(model: str) -> str:
    """A row of the docs' cache table as the planner's footprint of the recipe says it (float32)."""
    g = footprint(model).geometry
    layers = f"{g.num_layers} of {g.model_layers}"
    return f"| {model} | {g.bytes_per_token():,} | {layers} | {g.state_bytes_per_slot():,} |"


def test_the_docs_cache_table_is_the_planners():
    """README and docs/JETSON.md list each recipe of the board tables with its KV bytes per token and
    its per-slot state bytes, from the recipes' geometry: a hybrid's KV covers its attention layers
    only, so Qwen3.5-0.8B's token costs less than a ninth of Qwen3-0.6B's."""
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        start = lines.index(CACHE_HEADER) + 2
        rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
        assert rows == [cache_row(row.split("|")[1].strip()) for row in rows]
        models = {row.split("|")[1].strip() for row in rows}
        assert models == {
            row.split("|")[1].strip() for rows in board_tables(doc.read_text()).values() for row in rows
        }
    assert (
        9 * footprint("qwen3.5-0.8b").geometry.bytes_per_token()
        < footprint("qwen3-0.6b").geometry.bytes_per_token()
    )
