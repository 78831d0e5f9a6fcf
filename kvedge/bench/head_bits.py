"""Smaller LM heads for a tied model, simulated: their KL against the model as it is (figures for docs).

    python bench/head_bits.py [SOURCE] [--prompts 8] [--tokens 64] [--calibration-tokens 64]
                              [--top 1024 4096 8192 11264 16384] [--stored-bits 8.5] [--out DIR]

Not built: this measures whether a head stored at fewer bits would be good enough before an export
form is made for it. In torch, float32 compute, the tied table (the LM head and the embeddings
alike, one table) is replaced by what kvedge would store and the model is run again:

    int4 b32, int4 b16   every row int4 in blocks of 32 or 16 along the hidden size, on the export's
                         grids (`kvedge.export.quantize.quantize_blockwise`, every scale > 0); a
                         float16 scale and minimum per block: 4 + 32 / block bits a parameter
    top T                the T token ids of most probability mass on the calibration set (its
                         prompts plus --calibration-tokens greedy tokens each, every position's
                         softmax, plus the tokens themselves as embeddings) keep the source's rows,
                         the rest int4 b32
    lowest T             the T lowest token ids keep the source's rows (a BPE vocabulary's order
                         is roughly frequency), the rest int4 b32

The reference is the unchanged model, so the source's own rows cost --stored-bits a parameter
(8.5: the default model's GGUF stores its table as Q8_0, a float16 scale per 32 codes) and add no
KL of their own. KL(reference || form) and top-1 agreement are taken at every position of
--prompts held-out prompts plus --tokens greedy tokens each, teacher-forced.
Writes head_bits.json into a new results folder (`kvedge.bench.results`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvedge.bench.measure import kl_and_top1
from kvedge.bench.results import RESULTS_ROOT, results_folder
from kvedge.calibrate.calibrate import Prompt, builtin_prompts
from kvedge.errors import KvedgeError
from kvedge.export.quantize import EXPORT_GRIDS, calibration_ids, quantize_blockwise
from kvedge.export.source import load_hf, resolve_source

log = logging.getLogger(__name__)

HALF_PARAMS_BITS = 32  # a float16 scale and a float16 minimum per block


def int4_bits(block_size: int) -> float:
    """Bits a parameter of int4 blocks of `block_size` with a float16 scale and minimum each."""
    return 4 + HALF_PARAMS_BITS / block_size


def int4_rows(table: torch.Tensor, block_size: int) -> torch.Tensor:
    """`table` [vocab, hidden] as kvedge's int4 blocks of `block_size` along hidden would hold it."""
    weight = table.numpy().T  # [K = hidden, N = vocab], the export's layout
    quantized = quantize_blockwise(weight, 4, block_size, EXPORT_GRIDS, positive_scales=True)
    return torch.from_numpy(np.ascontiguousarray(quantized.dequantize().T))


class TiedHead:
    """A tied model whose table can be swapped for another form and back."""

    def __init__(self, source: str | None) -> None:
        self.model, self.tokenizer = load_hf(resolve_source(source))
        self.model.eval()
        self.table = self.model.get_input_embeddings().weight
        if self.model.get_output_embeddings().weight.data_ptr() != self.table.data_ptr():
            name = source or "the default model"
            raise KvedgeError(f"{name} is not tied: its LM head is not its embedding table")
        self.stored = self.table.detach().clone()

    def greedy(self, ids: list[int], tokens: int) -> torch.Tensor:
        return self.model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)[0]

    def chat(self, prompt: Prompt) -> list[int]:
        """A held-out prompt's ids, ending with the assistant's turn opened."""
        ids = self.tokenizer.apply_chat_template(
            prompt["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return list(ids)

    def logits(self, sequence: torch.Tensor) -> np.ndarray:
        return self.model(sequence[None]).logits[0].numpy()

    def compare(self, form: torch.Tensor, sequences: list[torch.Tensor], reference: list[np.ndarray]):
        """(mean KL, top-1 fraction) of the model with `form` as its table, against `reference`."""
        self.table.data.copy_(form)
        try:
            pairs = zip(sequences, reference, strict=True)
            kl, agree = zip(*(kl_and_top1(ref, self.logits(s)) for s, ref in pairs), strict=True)
        finally:
            self.table.data.copy_(self.stored)
        return float(np.concatenate(kl).mean()), float(np.concatenate(agree).mean())


def calibration_mass(head: TiedHead, tokens: int) -> torch.Tensor:
    """Per token id: its softmax probability summed over every position of the calibration
    prompts (`calibration_ids`, the export's) and their greedy continuations, plus 1 for each time
    it is an input token."""
    mass = torch.zeros(head.stored.shape[0], dtype=torch.float64)
    for ids in tqdm(calibration_ids(head.tokenizer), desc="calibration mass", unit="prompt"):
        sequence = head.greedy(ids, tokens)
        mass += torch.softmax(torch.from_numpy(head.logits(sequence)).double(), -1).sum(0)
        mass.index_add_(0, sequence, torch.ones(len(sequence), dtype=torch.float64))
    return mass


def forms(head: TiedHead, tops: list[int], stored_bits: float, mass_order: torch.Tensor) -> Iterator[tuple]:
    """(name, bits a head parameter, table) of each form measured."""
    vocab = head.stored.shape[0]
    yield "stored", stored_bits, head.stored
    int4 = {bs: int4_rows(head.stored, bs) for bs in (32, 16)}
    for bs, rows in int4.items():
        yield f"int4 b{bs}", int4_bits(bs), rows
    for order, name in ((mass_order, "top"), (torch.arange(vocab), "lowest")):
        for top in (t for t in tops if t < vocab):
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[order[:top]] = True
            bits = (top * stored_bits + (vocab - top) * int4_bits(32)) / vocab
            yield f"{name} {top}", bits, torch.where(keep[:, None], head.stored, int4[32])


def measure(
    source: str | None,
    prompts: int,
    tokens: int,
    calibration_tokens: int,
    tops: list[int],
    stored_bits: float,
) -> dict:
    torch.set_grad_enabled(False)
    head = TiedHead(source)
    held_out = builtin_prompts("heldout")[:prompts]
    sequences = [head.greedy(head.chat(prompt), tokens) for prompt in held_out]
    reference = [head.logits(s) for s in sequences]
    log.info("reference: %d positions", sum(len(r) for r in reference))
    mass = calibration_mass(head, calibration_tokens)
    rows = []
    for name, bits, table in forms(head, tops, stored_bits, torch.argsort(mass, descending=True)):
        kl, top1 = head.compare(table, sequences, reference)
        rows.append({"head": name, "bits_per_head_param": bits, "mean_kl": kl, "top1_agreement": top1})
        log.info("%s: %.2f bits, KL %.5f, top-1 %.2f%%", name, bits, kl, 100 * top1)
    vocab, hidden = head.stored.shape
    return {
        "source": source or "default",
        "vocab": vocab,
        "hidden": hidden,
        "params": sum(p.numel() for p in head.model.parameters()),
        "positions": sum(len(r) for r in reference),
        "prompts": prompts,
        "tokens": tokens,
        "calibration_tokens": calibration_tokens,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", nargs="?", default=None, help="a tied model (default: SmolLM2's GGUF)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calibration-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, nargs="*", default=[1024, 4096, 8192, 11264, 16384])
    parser.add_argument("--stored-bits", type=float, default=8.5)
    parser.add_argument("--out", type=Path, default=RESULTS_ROOT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data = measure(
        args.source, args.prompts, args.tokens, args.calibration_tokens, args.top, args.stored_bits
    )
    folder = results_folder("head-bits", [], root=args.out)
    folder.mkdir(parents=True)
    (folder / "head_bits.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"{data['positions']} positions, KL against the model as stored; {folder}")
    print(f"{'head':<14}{'bits':>6}{'KL':>10}{'top-1':>9}")
    for row in data["rows"]:
        kl, top1 = row["mean_kl"], 100 * row["top1_agreement"]
        print(f"{row['head']:<14}{row['bits_per_head_param']:>6.2f}{kl:>10.5f}{top1:>8.2f}%")
    return folder
