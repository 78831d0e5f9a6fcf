"""Decode and prefill speed of one model's exports at a long context, side by side: what a cache
form (--kv-dtype float32, int8, int4) costs or saves once a conversation is long.

    python bench/kv_long.py --context 6144 --out DIR NAME=EXPORT [NAME=EXPORT ...]

Every export loads once (one onnxruntime thread each, `--threads`) and prefills the same built-in
document prompt of `--context` tokens (`kvedge.calibrate.calibrate.document_prompts`). Then, in
`--rounds` alternating rounds, each times `--steps` decode steps from there and rewinds back, and
a prefill of `--prefill` tokens into a second slot: the exports take turns, so a loaded machine
slows them alike. Medians go to DIR/kv_long.json with the cache bytes of each; the ratios are
against the first export. Exports of one model and max_len only (their token ids must agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvedge.calibrate.calibrate import document_prompts, prompt_ids
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", help="NAME=EXPORT_FOLDER, the first the baseline")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--context", type=int, default=6144)
    parser.add_argument("--prefill", type=int, default=1024, help="tokens of the timed prefill")
    parser.add_argument("--steps", type=int, default=24, help="decode steps a round (at most 32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not 1 <= args.steps <= 32:  # an int4 cache rewinds 32 positions and keeps its window
        parser.error(f"--steps {args.steps}: allowed 1..32")
    models = {}
    for item in args.exports:
        name, _, folder = item.partition("=")
        models[name] = Model(Path(folder), slots=2, threads=args.threads)
    first = next(iter(models.values()))
    ids = prompt_ids(first, document_prompts(first, args.context)[0])
    timed = ids[: args.prefill]
    for model in models.values():
        prefill(model.backend, model.cache, 0, [ids])
    decode = {name: [] for name in models}
    fill = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            for step in range(args.steps):
                decode_one_token(model.backend, model.cache, 0, [ids[step % len(ids)]])
            decode[name].append((time.perf_counter() - start) / args.steps * 1000)
            model.cache.truncate(0, len(ids))
            model.cache.reset(1)
            start = time.perf_counter()
            prefill(model.backend, model.cache, 1, [timed])
            fill[name].append(len(timed) / (time.perf_counter() - start))
    base = next(iter(models))
    rows = []
    for name, model in models.items():
        g = model.manifest.geometry
        row = {
            "name": name,
            "kv_dtype": g.dtype,
            "decode_ms": statistics.median(decode[name]),
            "decode_ms_rounds": decode[name],
            "prefill_tok_s": statistics.median(fill[name]),
            "prefill_tok_s_rounds": fill[name],
            "cache_bytes_at_context": g.bytes_held(len(ids)),
        }
        row["decode_vs_first"] = row["decode_ms"] / statistics.median(decode[base])
        row["prefill_vs_first"] = row["prefill_tok_s"] / statistics.median(fill[base])
        rows.append(row)
        print(
            f"{name:<12} {g.dtype:<8} decode {row['decode_ms']:7.2f} ms ({row['decode_vs_first']:.2f}x) "
            f"prefill {row['prefill_tok_s']:7.1f} tok/s ({row['prefill_vs_first']:.2f}x) "
            f"cache {row['cache_bytes_at_context'] / 2**20:7.1f} MiB at {len(ids)}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    setup = {k: v for k, v in vars(args).items() if k not in ("out",)}
    (args.out / "kv_long.json").write_text(
        json.dumps({"args": setup, "context": len(ids), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
