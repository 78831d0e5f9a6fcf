"""What a JSON-schema constraint costs per decoded token, at batch 1 and 4, in one run.

Each round steps the same turns twice, without and with the constraint, in turn (so machine noise
falls on both); a step's time is taken only while every turn of the batch is decoding. The
schema allows long strings, so constrained turns keep decoding for the whole measured window.
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
        "summary": {"type": "string", "maxLength": 400},
    },
    "required": ["title", "summary"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Write a long JSON description of the history of Rome."}]


def step_times(model: Model, batch: int, constraint: Constraint | None, tokens: int) -> list[float]:
    """Seconds of each `Model.step` in which all `batch` turns decode (prefill steps excluded)."""
    config = SamplingConfig(max_new_tokens=tokens, temperature=0.8, seed=0, constraint=constraint)
    ids = model.encode_chat(PROMPT)
    turns = [model.begin(slot, ids, config) for slot in range(batch)]
    times = []
    while not any(t.done for t in turns):
        decoding = all(not t.prefilling and t.pending is not None for t in turns)
        started = time.perf_counter()
        model.step(turns)
        if decoding:
            times.append(time.perf_counter() - started)
    for turn in turns:
        model.end(turn)
    return times


def measure_constrained(
    model_dir: Path, threads: int = 1, rounds: int = 3, tokens: int = 48
) -> dict[str, Any]:
    model = Model(model_dir, slots=4, threads=threads)
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
            free += step_times(model, batch, None, tokens)
            masked += step_times(model, batch, constraint, tokens)
        figures[f"batch{batch}"] = {
            "unconstrained_ms": 1000 * float(np.median(free)),
            "constrained_ms": 1000 * float(np.median(masked)),
            "overhead": float(np.median(masked) / np.median(free)) - 1,
            "steps": [len(free), len(masked)],
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
