"""Warm prefixes and multi-turn reuse on one kvedge export: a `kvedge bench` section.

Everything runs on one `Model` (2 slots, `threads` threads, no run-time prefix store), already
warmed up, in this order:

    start-up   4 warm prefixes (the system prompt below and 3 variants), per round: `load_warm_prefixes`
               into an empty folder (recompute + write the files) vs `load_warm_prefixes` again over those
               files (load + verify). Target: median over rounds of recompute / load >= 20.
               Whole boots (`Model(...)` with the files vs with an empty folder, graph loading
               included) are measured once and reported, not judged.
    TTFT       a SYSTEM_TOKENS-token system prompt + a USER_TOKENS-token user message (content
               tokens by the model's tokenizer), time from `Model.chat` until the first token is
               picked (tokenizing included): from an empty slot (cold) vs with the system
               prompt's warm prefix (warm), 2 * rounds + 1 pairs, the order flipping every pair.
               Target: median of per-pair cold / warm >= 10.
    long TTFT  the same with a long system prompt (a document, a long chat history): the prompt
               rendered to LONG_PROMPT_TOKENS tokens (at most max_len - 1), cold vs with its warm
               prefix, `rounds` pairs. Reported, not judged.
    turns      a conversation of TURNS user messages (about USER_TOKENS tokens each) with greedy
               replies of up to REPLY_TOKENS tokens kept in the slot, per round: each turn's TTFT on
               the reuse path (the slot holds the earlier turns, only the new ones are prefilled)
               and by full re-prefill (an empty slot). Every turn adds about the same number of
               new tokens while the conversation grows ~10x, so a TTFT proportional to the new
               tokens stays flat. Target: median over rounds of reuse TTFT at the last turn / at
               the first <= 1.30 (the flat-growth bound of decode); full re-prefill's ratio is
               reported beside it.

Figures are returned as a JSON-able dict (raw per-round lists, medians, ratios); targets are
judged in `kvedge.bench.report.warm_targets`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvedge.configs import Message, PrefixSpec, WarmPrefixConfig
from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.model import Model
from kvedge.runtime.tokenizer import ChatTokenizer
from kvedge.runtime.warm_prefixes import WarmPrefixStore

SYSTEM_TOKENS = 300
USER_TOKENS = 20
WARM_PREFIXES = 4
TURNS = 8
LONG_PROMPT_TOKENS = 2048
REPLY_TOKENS = 24
SYSTEM_TEXT = (
    "You are the offline assistant of an NVIDIA Jetson Orin device deployed in a warehouse. "
    "You help operators with inventory questions, robot status, safety rules and maintenance. "
    "Always answer briefly and precisely, in plain language, and never invent numbers. "
    "Safety rules: forklifts have right of way; aisles 3 to 7 are closed on Sundays; helmets "
    "are mandatory in zone B; report spills immediately on channel 4. Maintenance: robots are "
    "charged between 02:00 and 04:00; a robot with a red light must be stopped and reported; "
    "firmware updates happen on the first Monday of each month. Inventory: stock levels are "
    "synced every 15 minutes; when a count disagrees, trust the last manual count and open a "
    "ticket. Escalation: for anything involving injury, call the supervisor first."
)
USER_TEXT = (
    "Robot 12 shows a red light near aisle 5 and the forklift behind it cannot pass. What should "
    "I do right now, and whom do I call first?"
)
ONE_TOKEN = SamplingConfig(max_new_tokens=1)
Messages = list[dict[str, str]]


def sized_text(tokenizer: ChatTokenizer, base: str, tokens: int) -> str:
    """The shortest run of `base`'s words (repeated as needed) that is at least `tokens` tokens."""
    words = base.split()

    def text(n: int) -> str:
        return " ".join(words[i % len(words)] for i in range(n))

    low, high = 1, tokens  # every word is at least one token
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.encode(text(mid), add_special_tokens=False)) >= tokens:
            high = mid
        else:
            low = mid + 1
    return text(low)


def ttft(model: Model, messages: Messages, slot: int = 0, reset: bool = False) -> float:
    """Seconds from `Model.chat` to the first token; `reset` empties the slot first (untimed)."""
    if reset:
        model.sessions[slot].reset(model.cache)
    started = time.perf_counter()
    for _ in model.chat(messages, ONE_TOKEN, slot=slot):
        break
    return time.perf_counter() - started


def _seconds(work: Callable[..., object], *args: Any, **kwargs: Any) -> float:
    started = time.perf_counter()
    work(*args, **kwargs)
    return time.perf_counter() - started


def _ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def measure_warm(
    folder: Path, threads: int, rounds: int, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """All three measurements on the export in `folder` (see the module docstring)."""
    model = Model(folder, slots=2, threads=threads)
    tokenizer = model.tokenizer
    system = sized_text(tokenizer, SYSTEM_TEXT, SYSTEM_TOKENS)
    user = sized_text(tokenizer, USER_TEXT, USER_TOKENS)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    variants = [f"Site {i}. {system}" for i in range(1, WARM_PREFIXES)]
    config = WarmPrefixConfig(
        prefixes=tuple(
            PrefixSpec(name=f"prefix{i}", messages=(Message(role="system", content=text),))
            for i, text in enumerate([system, *variants])
        )
    )
    figures: dict[str, Any] = {
        "threads": threads,
        "rounds": rounds,
        "system_prompt_tokens": len(tokenizer.encode(system, add_special_tokens=False)),
        "user_message_tokens": len(tokenizer.encode(user, add_special_tokens=False)),
        "prompt_tokens": len(tokenizer.encode_chat(messages)),
        "warm_prefixes": WARM_PREFIXES,
    }
    with tempfile.TemporaryDirectory(prefix="kvedge-warm-") as tmp:
        figures.update(_start_up(model, config, Path(tmp), threads, rounds))
        echo(f"  start-up: recompute / load {figures['warmup_speedup']:.0f}x")
        warm_store, _ = model.load_warm_prefixes(config, Path(tmp) / "round0")
        figures.update(_first_token(model, messages, warm_store, 2 * rounds + 1))
        echo(f"  TTFT: cold / warm {figures['ttft_speedup']:.1f}x")
        figures.update(_long_first_token(model, messages, Path(tmp) / "long", rounds))
        cold, warm = figures["long_ttft_cold_median_ms"], figures["long_ttft_warm_median_ms"]
        echo(f"  TTFT, {figures['long_prompt_tokens']}-token prompt: cold {cold:.0f} ms, warm {warm:.0f} ms")
    figures.update(_turns(model, user, rounds))
    echo(
        f"  turns: reuse growth {figures['turn_growth_reuse']:.2f}x, full {figures['turn_growth_full']:.2f}x"
    )
    return figures


def _start_up(model: Model, config: WarmPrefixConfig, tmp: Path, threads: int, rounds: int) -> dict[str, Any]:
    recompute, load = [], []
    for r in range(rounds):
        recompute.append(_seconds(model.load_warm_prefixes, config, tmp / f"round{r}"))  # an empty folder
        load.append(_seconds(model.load_warm_prefixes, config, tmp / f"round{r}"))  # the files just written
    boot = {"folder": model.folder, "slots": 2, "threads": threads, "warm_prefixes": config}
    boot_load = _seconds(Model, **boot, warm_dir=tmp / "round0")
    boot_recompute = _seconds(Model, **boot, warm_dir=tmp / "boot")
    return {
        "warmup_recompute_s": recompute,
        "warmup_load_s": load,
        "warmup_speedup": _ratio(recompute, load),
        "boot_recompute_s": boot_recompute,
        "boot_load_s": boot_load,
        "boot_speedup": boot_recompute / boot_load,
    }


def _first_token(model: Model, messages: Messages, warm_store: WarmPrefixStore, pairs: int) -> dict[str, Any]:
    stores = {"cold": WarmPrefixStore(), "warm": warm_store}
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    reused: dict[str, int] = {}

    def run(kind: str) -> float:
        model.prefixes.warm = stores[kind]
        seconds = ttft(model, messages, reset=True)
        reused[kind] = model.sessions[0].reused_tokens
        return seconds

    for kind in stores:  # untimed: onnxruntime sizes its buffers for both shapes
        run(kind)
    for i in range(pairs):
        for kind in ("warm", "cold") if i % 2 else ("cold", "warm"):
            times[kind].append(run(kind))
    model.prefixes.warm = WarmPrefixStore()
    cold, warm = times["cold"], times["warm"]
    return {
        "warm_prefix_tokens": reused["warm"],
        "new_tokens": len(model.tokenizer.encode_chat(messages)) - reused["warm"],
        "cold_reused_tokens": reused["cold"],
        "ttft_cold_ms": [1e3 * t for t in cold],
        "ttft_warm_ms": [1e3 * t for t in warm],
        "ttft_cold_median_ms": 1e3 * statistics.median(cold),
        "ttft_warm_median_ms": 1e3 * statistics.median(warm),
        "ttft_speedup": _ratio(cold, warm),
    }


def _long_first_token(model: Model, messages: Messages, folder: Path, pairs: int) -> dict[str, Any]:
    """`_first_token` with the system prompt grown until the rendered prompt is LONG_PROMPT_TOKENS
    (or max_len) tokens, a few less where the last word's tokens would overshoot; keys "long_*"."""
    tokenizer = model.tokenizer
    # one position stays free: the fit rule (HistoryPolicy.check_prompt) keeps room for a reply
    target = min(LONG_PROMPT_TOKENS, model.manifest.geometry.max_len - 1)
    around = len(tokenizer.encode_chat(messages)) - len(
        tokenizer.encode(messages[0]["content"], add_special_tokens=False)
    )  # template and user message
    system = sized_text(tokenizer, SYSTEM_TEXT, target - around)
    while len(tokenizer.encode_chat([{"role": "system", "content": system}, messages[1]])) > target:
        system = system.rsplit(" ", 1)[0]
    long_messages = [{"role": "system", "content": system}, messages[1]]
    config = WarmPrefixConfig(
        prefixes=(PrefixSpec(name="long", messages=(Message(role="system", content=system),)),)
    )
    store, _ = model.load_warm_prefixes(config, folder)
    figures = _first_token(model, long_messages, store, pairs)
    return {"long_prompt_tokens": len(tokenizer.encode_chat(long_messages))} | {
        f"long_{key}": value for key, value in figures.items()
    }


def _turns(model: Model, user: str, rounds: int) -> dict[str, Any]:
    reply_config = SamplingConfig(max_new_tokens=REPLY_TOKENS)
    reuse: list[list[float]] = []  # [round][turn] seconds
    full: list[list[float]] = []
    sizes: list[tuple[int, int]] = []  # (conversation tokens, new tokens) per turn, round 0
    for r in range(rounds):
        conversation = [{"role": "system", "content": "Be brief."}]
        model.sessions[0].reset(model.cache)
        reuse.append([])
        full.append([])
        for turn in range(TURNS):
            conversation.append({"role": "user", "content": f"{turn + 1}. {user}"})
            reuse[r].append(ttft(model, conversation, slot=0))
            if r == 0:
                total = len(model.tokenizer.encode_chat(conversation))
                sizes.append((total, total - model.sessions[0].reused_tokens))
            full[r].append(ttft(model, conversation, slot=1, reset=True))
            reply = "".join(event.text for event in model.chat(conversation, reply_config, slot=0))
            conversation.append({"role": "assistant", "content": reply})
    return {
        "turns": [
            {
                "turn": t + 1,
                "conversation_tokens": sizes[t][0],
                "new_tokens": sizes[t][1],
                "ttft_reuse_ms": 1e3 * statistics.median(run[t] for run in reuse),
                "ttft_full_ms": 1e3 * statistics.median(run[t] for run in full),
            }
            for t in range(TURNS)
        ],
        "turn_ttft_reuse_ms": [[1e3 * t for t in run] for run in reuse],
        "turn_ttft_full_ms": [[1e3 * t for t in run] for run in full],
        "turn_growth_reuse": statistics.median(run[-1] / run[0] for run in reuse),
        "turn_growth_full": statistics.median(run[-1] / run[0] for run in full),
    }


def main(argv: list[str] | None = None) -> None:
    """`python bench/warm.py`: this section alone on one export (no peers, no other systems)."""
    from kvedge.bench.report import format_target, warm_targets

    parser = argparse.ArgumentParser(description="The warm-prefix section of `kvedge bench` on one export.")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    figures = measure_warm(args.model, args.threads, args.rounds)
    text = json.dumps(figures, indent=2)
    print(text)
    for row in warm_targets({args.model.name: figures}):
        print(format_target(row))
    if args.json:
        args.json.write_text(text)
