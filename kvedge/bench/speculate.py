"""What speculative decoding buys, per workload, in one run: decode tokens/s with
`speculate="lookup"` (or a draft model, `draft=`: `speculate="draft:DIR"`) against without, the
same target model, batch 1, greedy.

Workloads (`WORKLOADS`, written down in bench/speculate.py): (a) answer from a given passage,
quoting it; (b) rewrite a given paragraph with a few words changed; (c) open chat. Each round
runs every workload plain and speculative, the order alternating from round to round, in a slot
emptied before each reply (no prefix reuse between the two), and measures decode only: tokens
after the first / seconds after the first token. The ratio is the median over rounds of the
per-round ratio (the machine is shared and noisy). Also reported: tokens per model call during
decode (1.0 without speculation; the target's calls: a draft's own are in the time, not counted),
the share of proposed tokens the model took, and whether the speculative reply was token for
token the plain one (greedy: it must be).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.bench.results import code_revision, results_folder
from kvedge.runtime.model import Model, SamplingConfig

PASSAGE = (
    "The water pump must be primed before its first use. Open the bleed valve on the top of the "
    "housing, fill the housing with clean water through the priming port until water flows out of "
    "the bleed valve, then close the valve and replace the port cap. Never run the pump dry: the "
    "mechanical seal overheats within thirty seconds and must then be replaced. If the pump does "
    "not deliver water within two minutes of starting, switch it off, check that the suction hose "
    "is submerged and free of kinks, and prime it again. The filter basket should be cleaned every "
    "month, or every week when the water carries sand."
)
PARAGRAPH = (
    "Our team met on Monday to plan the spring release. We agreed that the new search page will "
    "ship first, followed by the export feature two weeks later. Anna will write the release notes "
    "and Tom will update the help pages. Testing starts on the first of March and ends when every "
    "open bug marked critical is closed. The launch party will be held in the small meeting room."
)
WORKLOADS: dict[str, str] = {
    "a-quote": (
        f"Here is a passage from a manual:\n\n{PASSAGE}\n\nWhat should I do if the pump does not "
        "deliver water? Answer with the exact words of the manual."
    ),
    "b-rewrite": (
        f"Rewrite this paragraph exactly as it is, but change Monday to Tuesday, Anna to Maria and "
        f"March to April:\n\n{PARAGRAPH}"
    ),
    "c-chat": "Tell me about the history of the bicycle.",
}


def timed_reply(model: Model, text: str, config: SamplingConfig) -> dict[str, Any]:
    """One reply in slot 0, emptied first: its tokens, decode tokens/s, model calls while decoding,
    tokens proposed and taken."""
    model.sessions[0].reset(model.cache)
    turn = model.begin(0, model.encode_chat([{"role": "user", "content": text}]), config)
    tokens: list[int] = []
    calls = proposed = taken = 0
    first_at = None
    while not turn.done:
        result = model.step([turn])
        if first_at is not None:
            calls += len(result.decode_calls) + len(result.verify_calls)
        proposed += sum(p for p, _ in result.verify_calls)
        taken += sum(k - 1 for _, k in result.verify_calls)
        for event in result.emitted(turn):
            if event.error is not None:
                raise event.error
            tokens.append(event.token)
        if first_at is None and tokens:
            first_at = time.perf_counter()
    seconds = time.perf_counter() - (first_at or time.perf_counter())
    decoded = len(tokens) - 1
    return {
        "tokens": tokens,
        "tokens_per_s": decoded / seconds if seconds > 0 else 0.0,
        "tokens_per_call": decoded / calls if calls else 0.0,
        "proposed": proposed,
        "taken": taken,
    }


def measure_speculation(
    model_dir: Path,
    threads: int = 1,
    rounds: int = 3,
    max_new_tokens: int = 128,
    echo: Callable[[str], None] = print,
    draft: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Per workload: plain and speculative decode tokens/s (medians), their ratio (median of the
    rounds' ratios), tokens per call, share of proposals taken, and greedy equality. Speculative
    is prompt lookup, or with `draft` the draft model in that folder proposing."""
    figures: dict[str, dict[str, Any]] = {}
    mode = "lookup" if draft is None else f"draft:{draft}"
    kind = "lookup" if draft is None else "draft"  # the figures' key: lookup_tokens_per_s, ..
    with Model(model_dir, slots=1, threads=threads) as model:
        plain_config = SamplingConfig(max_new_tokens=max_new_tokens)
        fast_config = SamplingConfig(max_new_tokens=max_new_tokens, speculate=mode)
        timed_reply(model, WORKLOADS["c-chat"], fast_config)  # warm-up: both graph paths' buffers
        for name, text in WORKLOADS.items():
            runs: dict[str, list[dict[str, Any]]] = {"plain": [], "fast": []}
            for r in range(rounds):
                order = [("plain", plain_config), ("fast", fast_config)]
                for which, config in order if r % 2 == 0 else order[::-1]:
                    runs[which].append(timed_reply(model, text, config))
            plain, fast = runs["plain"], runs["fast"]
            ratios = [  # a reply of one token decodes nothing: no ratio
                f["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else float("nan")
                for p, f in zip(plain, fast, strict=True)
            ]
            proposed = sum(f["proposed"] for f in fast)
            figures[name] = {
                "plain_tokens_per_s": float(np.median([p["tokens_per_s"] for p in plain])),
                f"{kind}_tokens_per_s": float(np.median([f["tokens_per_s"] for f in fast])),
                "speedup": float(np.median(ratios)),
                "tokens_per_call": float(np.median([f["tokens_per_call"] for f in fast])),
                "taken_share": sum(f["taken"] for f in fast) / proposed if proposed else 0.0,
                "reply_tokens": len(plain[0]["tokens"]),
                "greedy_equal": all(f["tokens"] == plain[0]["tokens"] for f in plain + fast),
            }
            f = figures[name]
            echo(
                f"  {name}: {f['plain_tokens_per_s']:.1f} -> {f[kind + '_tokens_per_s']:.1f} tokens/s "
                f"({f['speedup']:.2f}x), {f['tokens_per_call']:.2f} tokens/call, "
                f"{100 * f['taken_share']:.0f}% of proposals taken, greedy equal: {f['greedy_equal']}"
            )
    return figures


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, nargs="+")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, help="results folder (default: a new dated one)")
    parser.add_argument("--draft", type=Path, help="a draft model's folder: it proposes, not lookup")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    for folder in args.model:
        print(folder if args.draft is None else f"{folder}, draft {args.draft}")
        out[folder.name] = measure_speculation(
            folder, args.threads, args.rounds, args.max_new_tokens, draft=args.draft
        )
    kind = "speculate-cpu" if args.draft is None else "speculate-draft-cpu"
    results = args.out or results_folder(kind, [args.threads])
    results.mkdir(parents=True, exist_ok=True)
    machine = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "code": code_revision(),
        "command": "python bench/speculate.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    (results / "speculate.json").write_text(json.dumps({"machine": machine, "exports": out}, indent=2))
    print(f"wrote {results / 'speculate.json'}")


if __name__ == "__main__":
    main()
