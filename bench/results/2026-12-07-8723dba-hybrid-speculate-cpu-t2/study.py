"""What speculation costs on a hybrid model at a real shape: a decode step, a verify of n tokens,
and the run of the c kept tokens a partial take adds (`kvedge.runtime.generate._roll_back`).
Random weights, so acceptance is not measured here; these are the prices a take pays.

    python study.py EXPORT [EXPORT ...]   # each an export of Qwen3.5-0.8B's shape (max_len 2048)

prints the table (study.log) and writes study.json: per export, its variant, decode_ms, and per n
verify_ms and run_ms.
"""

import json
import statistics
import sys
import time

import numpy as np

from kvedge.runtime.generate import decode_one_token, prefill, verify
from kvedge.runtime.model import Model

CONTEXT = 512
ROUNDS = 5


def median_ms(fn, rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def study(folder: str) -> dict:
    rng = np.random.default_rng(0)
    with Model(folder, threads=2) as model:
        backend, cache = model.backend, model.cache
        prompt = [int(t) for t in rng.integers(10, 40000, CONTEXT)]
        prefill(backend, cache, 0, [prompt])
        cache.snapshot(0)
        token = [int(rng.integers(10, 40000))]

        def one_decode():
            decode_one_token(backend, cache, 0, token)
            cache.truncate(0, CONTEXT)  # back to the snapshot

        decode = median_ms(one_decode, 9)
        found = {"variant": model.manifest.variant, "context": CONTEXT, "threads": 2, "decode_ms": decode}
        found["verify_ms"], found["run_ms"] = {}, {}
        print(f"{folder}: {model.manifest.variant}, context {CONTEXT}, 2 threads")
        print(f"decode step: {decode:.1f} ms")
        print(
            "n | verify of n ms | run of n kept ms (prefill, then back to the snapshot) "
            "| verify / decode | run / decode"
        )
        for n in (1, 2, 3, 5, 9):
            tokens = [int(t) for t in rng.integers(10, 40000, n)]
            v = median_ms(lambda tokens=tokens: verify(backend, cache, 0, tokens))

            def run(tokens=tokens):
                prefill(backend, cache, 0, [tokens])
                cache.truncate(0, CONTEXT)

            r = median_ms(run)
            print(f"{n} | {v:.1f} | {r:.1f} | {v / decode:.2f} | {r / decode:.2f}", flush=True)
            found["verify_ms"][n], found["run_ms"][n] = v, r
    return found


if __name__ == "__main__":
    results = {folder: study(folder) for folder in sys.argv[1:]}
    with open("study.json", "w") as f:
        json.dump(results, f, indent=2)
