"""Measure kvedge-vs-transformers logit parity on the real default model (figures for docs).

    python bench/parity.py [--steps 32] [--variant portable|ort] [--weights float32|int8|int4]

Prints the max absolute logit difference over prefill + teacher-forced decode, the greedy
match length over 64 tokens, and cache-on vs cache-off difference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvedge.contract import ExportRecipe
from kvedge.export.export import export_model
from kvedge.export.source import default_gguf, load_hf, resolve_source
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--artifact", type=Path, default=None, help="existing export (default: export to a temp dir)"
    )
    parser.add_argument("--variant", default="portable", choices=["portable", "ort"])
    parser.add_argument("--weights", default="float32", choices=["float32", "int8", "int4"])
    args = parser.parse_args(argv)
    folder = args.artifact
    if folder is None:
        folder = Path(tempfile.mkdtemp()) / "smol"
        export_model(None, folder, ExportRecipe(max_len=2048, variant=args.variant, weights=args.weights))
    hf, _ = load_hf(resolve_source(default_gguf()))
    model = Model(folder)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "Explain what a KV cache is."}])
    with torch.no_grad():
        seq = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[0]
        ref = hf(seq[None], use_cache=False).logits[0].numpy()
    ids = seq.tolist()
    n = len(prompt)
    got = [prefill(model.backend, model.cache, 0, [prompt])[0]]
    for t in ids[n : n + args.steps - 1]:
        got.append(decode_one_token(model.backend, model.cache, 0, [t])[0])
    diff = np.abs(np.stack(got) - ref[n - 1 : n - 1 + args.steps])
    model.cache.reset(0)
    logits = prefill(model.backend, model.cache, 0, [prompt])[0]
    greedy = []
    for _ in range(64):
        logits[list(model.manifest.eos_token_ids)] = -np.inf
        greedy.append(int(np.argmax(logits)))
        logits = decode_one_token(model.backend, model.cache, 0, [greedy[-1]])[0]
    match = next((i for i, (a, b) in enumerate(zip(greedy, ids[n:], strict=True)) if a != b), 64)
    model.cache.reset(0)
    off = prefill(model.backend, model.cache, 0, [ids[: n + args.steps - 1]])[0]
    print(
        json.dumps(
            {
                "prompt_tokens": n,
                "steps": args.steps,
                "max_abs_logit_diff_vs_hf": float(diff.max()),
                "mean_abs_logit_diff_vs_hf": float(diff.mean()),
                "max_abs_logit": float(np.abs(ref).max()),
                "greedy_match_tokens_of_64": match,
                "cache_on_vs_off_max_abs_diff": float(np.abs(off - got[-1]).max()),
            },
            indent=2,
        )
    )
