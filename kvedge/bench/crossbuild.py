"""One export run by two builds of kvedge, compared by `kvedge eval-kv`'s model-level measures.

    python bench/crossbuild.py record  --model DIR --out ref.npz [--prompts 4] [--tokens 32]
    python bench/crossbuild.py compare --model DIR --reference ref.npz --max-kl-mean K --min-top1 A

The same graph gives other logits on another build of kvedge's kernels or of onnxruntime (AVX-512
VNNI, plain x86-64, aarch64 NEON): the int8 activation and cache codes are rounded from float sums
taken in another order, and a value at a rounding tie lands one code away. Per logit that moves
an int4 export by up to about 1, which says little; what a user gets is the next-token
distribution, so two builds are compared as eval-kv compares a cache with the float32 one
(kvedge/calibrate/evaluate.py, whose `log_softmax` and `quality` this uses):

    record   on the reference build: for each of the first N held-out prompts (eval-kv's set), a
             greedy continuation of T tokens (end of sequence masked, as eval-kv) and the T logit
             rows that predict its tokens (the prefill's last row, then T - 1 decode steps)
    compare  on the other build: the same prompt and continuation teacher-forced; over all
             positions KL(p_reference || p_build) mean and 99th percentile, top-1 agreement, and
             per prompt the positions before the first argmax disagreement; exits 1 when the KL
             mean is above --max-kl-mean or top-1 agreement below --min-top1

File (numpy .npz): fingerprint (the export's onnx_fingerprint; compare refuses another export's),
machine (platform.machine() of the recording build), prompt_<i> int64 [n_i] and forced_<i> int64
[T - 1] for each prompt i, logits float32 [N, T, vocab].
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import numpy as np

from kvedge.calibrate.calibrate import builtin_prompts, prompt_ids
from kvedge.calibrate.evaluate import SchemeQuality, log_softmax, quality
from kvedge.errors import KvedgeError
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model


def continuation_logits(model: Model, prompt: list[int], forced: list[int] | None, tokens: int):
    """(logits [tokens, vocab] float32, continuation [tokens - 1]): slot 0 emptied, `prompt`
    prefilled, then `forced` decoded, or when None the greedy continuation with end of sequence
    masked."""
    model.cache.reset(0)
    rows = [prefill(model.backend, model.cache, 0, [prompt])[0]]
    chosen: list[int] = []
    for step in range(tokens - 1):
        if forced is None:
            masked = rows[-1].copy()
            masked[list(model.manifest.eos_token_ids)] = -np.inf
            chosen.append(int(masked.argmax()))
        else:
            chosen.append(forced[step])
        rows.append(decode_one_token(model.backend, model.cache, 0, [chosen[-1]])[0])
    return np.stack(rows).astype(np.float32), chosen


def record(model: Model, prompts: int, tokens: int) -> dict[str, np.ndarray]:
    """The reference file's arrays (module docstring) for the first `prompts` held-out prompts."""
    held_out = builtin_prompts("heldout")
    if not 1 <= prompts <= len(held_out) or tokens < 1:
        raise KvedgeError(f"--prompts {prompts} must be 1-{len(held_out)} and --tokens {tokens} >= 1")
    arrays: dict[str, np.ndarray] = {
        "fingerprint": np.array(model.manifest.onnx_fingerprint),
        "machine": np.array(platform.machine()),
    }
    logits = []
    for i, prompt in enumerate(held_out[:prompts]):
        ids = prompt_ids(model, prompt)[: model.manifest.geometry.max_len - tokens]
        rows, forced = continuation_logits(model, ids, None, tokens)
        arrays[f"prompt_{i}"], arrays[f"forced_{i}"] = np.array(ids, np.int64), np.array(forced, np.int64)
        logits.append(rows)
    arrays["logits"] = np.stack(logits)
    return arrays


def compare(model: Model, reference: dict[str, np.ndarray], name: str) -> SchemeQuality:
    """`model` teacher-forced on the reference's sequences, measured against its logits."""
    if str(reference["fingerprint"]) != model.manifest.onnx_fingerprint:
        raise KvedgeError(
            f"the reference was recorded on export {str(reference['fingerprint'])[:16]}, "
            f"--model is export {model.manifest.onnx_fingerprint[:16]}: compare one export"
        )
    want = reference["logits"]  # [N, T, vocab]
    kls, agree, match = [], [], []
    for i in range(want.shape[0]):
        forced = [int(t) for t in reference[f"forced_{i}"]]
        got, _ = continuation_logits(model, [int(t) for t in reference[f"prompt_{i}"]], forced, want.shape[1])
        ref, q = log_softmax(want[i]), log_softmax(got)
        kls.append((np.exp(ref) * (ref - q)).sum(axis=-1))
        same = ref.argmax(axis=-1) == q.argmax(axis=-1)
        agree.append(same)
        match.append(int(np.argmin(same)) if not same.all() else len(same))
    return quality(name, kls, agree, match, 1.0)  # one export on both sides: the same cache bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("--model", type=Path, required=True, help="Folder written by `kvedge export`.")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads.")
    parser.add_argument("--out", type=Path, help="record: the reference file to write.")
    parser.add_argument("--prompts", type=int, default=4, help="record: the first N held-out prompts.")
    parser.add_argument("--tokens", type=int, default=32, help="record: positions per prompt.")
    parser.add_argument("--reference", type=Path, help="compare: a file written by record.")
    parser.add_argument("--max-kl-mean", type=float, help="compare: fail above this mean KL (nats).")
    parser.add_argument("--min-top1", type=float, help="compare: fail below this top-1 agreement (0-1).")
    parser.add_argument("--json", type=Path, help="compare: also write the measures here.")
    args = parser.parse_args(argv)
    model = Model(args.model, threads=args.threads)
    if args.action == "record":
        if args.out is None:
            parser.error("record needs --out")
        np.savez(args.out, **record(model, args.prompts, args.tokens))
        return 0
    if args.reference is None or args.max_kl_mean is None or args.min_top1 is None:
        parser.error("compare needs --reference, --max-kl-mean and --min-top1")
    with np.load(args.reference) as loaded:
        reference = dict(loaded)
    name = f"{platform.machine()} against {reference['machine']}"
    result = compare(model, reference, name)
    print(
        f"{name}: KL mean {result.kl_mean:.3g}, KL p99 {result.kl_p99:.3g}, top-1 "
        f"{result.top1_agreement:.2%}, greedy match {result.greedy_match_mean:.1f} "
        f"(min {result.greedy_match_min}) of {reference['logits'].shape[1]} positions"
    )
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(result), indent=2))
    ok = result.kl_mean <= args.max_kl_mean and result.top1_agreement >= args.min_top1
    if not ok:
        print(f"beyond the tolerance: KL mean <= {args.max_kl_mean}, top-1 >= {args.min_top1}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
