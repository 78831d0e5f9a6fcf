"""What speculative decoding buys, per workload, in one run: decode tokens/s with
`speculate="lookup"` (or a draft model, `draft=`: `speculate="draft"`) against without, the
same target model, batch 1, greedy.

Workloads (`WORKLOADS`, written down in bench/speculate.py): (a) answer from a given passage,
quoting it; (b) rewrite a given paragraph with a few words changed; (c) open chat. Each round
runs every workload plain and speculative side by side, in two slots emptied first, a step of
one then a step of the other (`paired_replies`; which goes first and in which slot swaps from
round to round), so the shared machine's slow spells fall on both, and measures decode only:
tokens after the first / seconds of the reply's own steps after its first token. The ratio is
the median over rounds of the per-round ratio. Also reported: tokens per model call during
decode (1.0 without speculation; the target's calls: a draft's own are in the time, not counted),
the share of proposed tokens the model took, and whether the speculative reply was token for
token the plain one (greedy: it must be).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.bench.results import code_revision, results_folder
from kvedge.runtime.generate import Turn
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


@dataclass
class TimedReplies:
    """Replies being measured together, their turns stepped as one batch: their tokens, and their
    own steps' seconds, model calls, tokens and proposals once every one has its first token
    (decode only)."""

    turns: list[Turn]
    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    decoded: int = 0
    calls: int = 0
    proposed: int = 0
    taken: int = 0

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in self.turns]

    @property
    def done(self) -> bool:
        return all(turn.done for turn in self.turns)

    def step(self, model: Model) -> None:
        """One step of these replies' unfinished turns, timed."""
        decoding = all(self.tokens)
        started = time.perf_counter()
        result = model.step([turn for turn in self.turns if not turn.done])
        spent = time.perf_counter() - started
        self.proposed += sum(p for p, _ in result.verify_calls)
        self.taken += sum(k - 1 for _, k in result.verify_calls)
        for turn, tokens in zip(self.turns, self.tokens, strict=True):
            for event in result.emitted(turn):
                if event.error is not None:
                    raise event.error
                tokens.append(event.token)
                self.decoded += decoding
        if decoding:
            self.seconds += spent
            self.calls += len(result.decode_calls) + len(result.verify_calls)

    def figures(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "tokens_per_s": self.decoded / self.seconds if self.seconds > 0 else 0.0,
            "tokens_per_call": self.decoded / self.calls if self.calls else 0.0,
            "proposed": self.proposed,
            "taken": self.taken,
        }


def paired_replies(
    model: Model, text: str, configs: Sequence[SamplingConfig], batch: int = 1
) -> list[dict[str, Any]]:
    """`batch` replies to `text` under each of `configs`, config i in slots i * batch onwards
    (emptied first), each config's turns stepped as one batch, a step of each config's in turn
    while it has one left, so the machine's slow spells fall on all of them. Per config: the
    replies' tokens, decode tokens/s (tokens once every reply has its first, over the seconds of
    those steps), tokens per model call while decoding, tokens proposed and taken."""
    ids = model.encode_chat([{"role": "user", "content": text}])
    groups = []
    for i, config in enumerate(configs):
        slots = range(i * batch, (i + 1) * batch)
        for slot in slots:
            model.sessions[slot].reset(model.cache)
        groups.append(TimedReplies([model.begin(slot, ids, config) for slot in slots]))
    while not all(group.done for group in groups):
        for group in groups:
            if not group.done:
                group.step(model)
    for group in groups:
        for turn in group.turns:
            model.end(turn)
    return [group.figures() for group in groups]


def measure_speculation(
    model_dir: Path,
    threads: int = 1,
    rounds: int = 3,
    max_new_tokens: int = 128,
    echo: Callable[[str], None] = print,
    draft: Path | None = None,
    batch: int = 1,
) -> dict[str, dict[str, Any]]:
    """Per workload: plain and speculative decode tokens/s (medians; of `batch` replies decoding
    together, all of them), their ratio (median of the rounds' ratios), tokens per call, share of
    proposals taken, and greedy equality. Speculative is prompt lookup, or with `draft` the draft
    model in that folder proposing."""
    figures: dict[str, dict[str, Any]] = {}
    mode = "lookup" if draft is None else "draft"
    kind = "lookup" if draft is None else "draft"  # the figures' key: lookup_tokens_per_s, ..
    with Model(model_dir, slots=2 * batch, threads=threads, draft=draft) as model:
        plain_config = SamplingConfig(max_new_tokens=max_new_tokens)
        fast_config = SamplingConfig(max_new_tokens=max_new_tokens, speculate=mode)
        paired_replies(model, WORKLOADS["c-chat"], [fast_config, fast_config], batch)  # warm-up: buffers
        for name, text in WORKLOADS.items():
            plain: list[dict[str, Any]] = []
            fast: list[dict[str, Any]] = []
            for r in range(rounds):  # the slots and which steps first swap from round to round
                if r % 2 == 0:
                    p, f = paired_replies(model, text, [plain_config, fast_config], batch)
                else:
                    f, p = paired_replies(model, text, [fast_config, plain_config], batch)
                plain.append(p)
                fast.append(f)
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
                "round_ratios": ratios,
                "reply_tokens": len(plain[0]["tokens"][0]),
                "greedy_equal": all(
                    reply == plain[0]["tokens"][0] for g in plain + fast for reply in g["tokens"]
                ),
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
    parser.add_argument(
        "--batch", type=int, action="append", help="replies decoding together (repeat for several; default 1)"
    )
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    for folder in args.model:
        for batch in args.batch or [1]:
            # no space: a doc table's row is "<export> <workload>"
            name = folder.name if batch == 1 else f"{folder.name}/batch{batch}"
            print(name if args.draft is None else f"{name}, draft {args.draft}")
            out[name] = measure_speculation(
                folder, args.threads, args.rounds, args.max_new_tokens, draft=args.draft, batch=batch
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
