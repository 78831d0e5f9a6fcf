"""Warm prefixes and multi-turn reuse, measured side by side in one run (issue 5 figures).

    python bench/warm.py --model artifacts/smollm2-135m [--repeats 7] [--json out.json]

1. Time to first token for a ~300-token system prompt + ~20-token user message: warm prefix
   vs cold (empty slot), alternating, medians.
2. Start-up with 4 warm prefixes on disk (load + verify) vs recomputing them.
3. Turn-N time to first token in a growing conversation: reuse path vs full re-prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.model import Model
from kvedge.runtime.warmup import PrefixSpec, WarmupConfig, warm_up

SYSTEM = (
    "You are the offline assistant of an NVIDIA Jetson Orin device deployed in a warehouse. "
    "You help operators with inventory questions, robot status, safety rules and maintenance. "
    "Always answer briefly and precisely, in plain language, and never invent numbers. "
    "Safety rules: forklifts have right of way; aisles 3 to 7 are closed on Sundays; helmets "
    "are mandatory in zone B; report spills immediately on channel 4. Maintenance: robots are "
    "charged between 02:00 and 04:00; a robot with a red light must be stopped and reported; "
    "firmware updates happen on the first Monday of each month. Inventory: stock levels are "
    "synced every 15 minutes; when a count disagrees, trust the last manual count and open a "
    "ticket. Escalation: for anything involving injury, call the supervisor first. "
) * 2
USER = "Robot 12 shows a red light near aisle 5. What should I do right now?"
ONE_TOKEN = SamplingConfig(max_new_tokens=1)


def ttft(model: Model, messages, slot: int = 0) -> float:
    started = time.perf_counter()
    for _ in model.chat(messages, ONE_TOKEN, slot=slot):
        break
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    specs = tuple(PrefixSpec(name=f"p{i}", messages=(("system", SYSTEM + f" Site {i}."),)) for i in range(3))
    config = WarmupConfig(prefixes=(PrefixSpec(name="main", messages=(("system", SYSTEM),)), *specs))

    plain_started = time.perf_counter()
    cold = Model(args.model, slots=2)
    plain_s = time.perf_counter() - plain_started
    build_t, load_t = [], []
    for _ in range(3):  # warm-up stage alone, on a loaded model: recompute (empty folder) vs load
        folder = Path(tempfile.mkdtemp())
        started = time.perf_counter()
        warm_up(cold, config, folder)
        build_t.append(time.perf_counter() - started)
        started = time.perf_counter()
        warm_up(cold, config, folder)
        load_t.append(time.perf_counter() - started)
    started = time.perf_counter()
    warm = Model(args.model, slots=2, warmup=config, warm_dir=folder)
    boot_warm_s = time.perf_counter() - started
    prompt_tokens = len(warm.tokenizer.encode_chat(messages))
    prefix_tokens = len(warm.prefixes.prefixes[0].token_ids)

    warm_t, cold_t = [], []
    for _ in range(args.repeats):
        warm.sessions[0].reset(warm.cache)
        warm_t.append(ttft(warm, messages))
        cold.sessions[0].reset(cold.cache)
        cold_t.append(ttft(cold, messages))

    turns, reuse_t, full_t = [], [], []
    conversation = [{"role": "system", "content": "Be brief."}]
    for turn in range(8):
        conversation.append({"role": "user", "content": f"Question {turn}: " + USER})
        reuse_t.append(ttft(warm, conversation, slot=1))
        cold.sessions[1].reset(cold.cache)
        full_t.append(ttft(cold, conversation, slot=1))
        turns.append(len(warm.tokenizer.encode_chat(conversation)))
        reply = "".join(e.text for e in warm.chat(conversation, SamplingConfig(max_new_tokens=24), slot=1))
        conversation.append({"role": "assistant", "content": reply})

    result = {
        "prompt_tokens": prompt_tokens,
        "warm_prefix_tokens": prefix_tokens,
        "ttft_cold_ms": 1000 * statistics.median(cold_t),
        "ttft_warm_ms": 1000 * statistics.median(warm_t),
        "ttft_speedup": statistics.median(cold_t) / statistics.median(warm_t),
        "warmup_recompute_4_prefixes_s": statistics.median(build_t),
        "warmup_load_4_prefixes_s": statistics.median(load_t),
        "warmup_stage_speedup": statistics.median(build_t) / statistics.median(load_t),
        "boot_no_prefixes_s": plain_s,
        "boot_with_4_warm_files_s": boot_warm_s,
        "boot_speedup_vs_recompute": (plain_s + statistics.median(build_t)) / boot_warm_s,
        "turns": [
            {"turn": i + 1, "conversation_tokens": n, "ttft_reuse_ms": 1000 * r, "ttft_full_ms": 1000 * f}
            for i, (n, r, f) in enumerate(zip(turns, reuse_t, full_t, strict=True))
        ],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
