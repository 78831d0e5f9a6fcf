"""What a JSON-schema constraint costs per decoded token, at batch 1 and 4, in one run.

Each round starts the same prompt in a batch of unconstrained turns and in a batch of constrained
ones and steps the two batches alternately, so machine noise falls on both; the overhead is the
median over step pairs of constrained / unconstrained step time, taken while every turn decodes.
The schema's summary must be long, so constrained turns keep decoding for the measured window.
Also measured: building the tokenizer's llguidance view (once per model) and compiling a new
schema (once per distinct schema; cached after).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.runtime.model import Constraint, Model, SamplingConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 400},
        "summary": {"type": "string", "minLength": 300, "maxLength": 600},
    },
    "required": ["title", "summary"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Write a long JSON description of the history of Rome."}]


def paired_steps(
    model: Model, batch: int, constraint: Constraint, tokens: int
) -> tuple[list[float], list[float]]:
    """Step a batch of unconstrained turns (slots 0..batch-1) and a batch of constrained ones
    (the next `batch` slots) alternately, so each pair of steps shares the machine's state; the
    seconds of every step in which all turns of both batches decode."""
    ids = model.encode_chat(PROMPT)
    free = [model.begin(s, ids, SamplingConfig(max_new_tokens=tokens, temperature=0.0)) for s in range(batch)]
    masked = [
        model.begin(
            batch + s, ids, SamplingConfig(max_new_tokens=tokens, temperature=0.0, constraint=constraint)
        )
        for s in range(batch)
    ]
    times: tuple[list[float], list[float]] = ([], [])
    while not any(t.done for t in free + masked):
        decoding = all(not t.prefilling and t.pending is not None for t in free + masked)
        for turns, out in ((free, times[0]), (masked, times[1])):
            started = time.perf_counter()
            model.step(turns)
            if decoding:
                out.append(time.perf_counter() - started)
    for turn in free + masked:
        model.end(turn)
    return times


def measure_constrained(
    model_dir: Path, threads: int = 1, rounds: int = 3, tokens: int = 64
) -> dict[str, Any]:
    model = Model(model_dir, slots=8, threads=threads)
    started = time.perf_counter()
    model.grammars.tokenizer()
    tokenizer_s = time.perf_counter() - started
    constraint = Constraint.json_schema(SCHEMA)
    started = time.perf_counter()
    model.grammars.compile(constraint)
    compile_s = time.perf_counter() - started
    figures: dict[str, Any] = {"tokenizer_build_s": tokenizer_s, "schema_compile_s": compile_s}
    for batch in (1, 4):
        free: list[float] = []
        masked: list[float] = []
        for _ in range(rounds):
            a, b = paired_steps(model, batch, constraint, tokens)
            free += a
            masked += b
        ratios = np.asarray(masked) / np.asarray(free)  # [pairs]
        figures[f"batch{batch}"] = {
            "unconstrained_ms": 1000 * float(np.median(free)),
            "constrained_ms": 1000 * float(np.median(masked)),
            "overhead": float(np.median(ratios)) - 1,  # median over step pairs
            "pairs": len(ratios),
        }
    return figures


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(measure_constrained(args.model, args.threads, args.rounds), indent=2))


if __name__ == "__main__":
    main()
