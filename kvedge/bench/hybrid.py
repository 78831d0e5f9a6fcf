"""Speed of the hybrid models (LFM2, Qwen3.5) at a real shape, with random weights: kvedge's export
against transformers on the CPU, side by side in one run.

There is no model hub here, so the model is built from a published config.json (or a config of
fewer layers, `--layers`) with random weights: this measures time and bytes, not answers. For each
context length the benchmark prefills that many random tokens, then times decode steps (median
ms per token over `--steps`), alternating kvedge and transformers round by round; it also times a
prefill of `--prefill` tokens from an empty cache. The figure the issue holds kvedge to: a state
layer's decode time does not grow with the context, so decode at the longest context stays within
1.15x of the shortest (only the attention layers read a longer past).

    python bench/hybrid.py CONFIG_JSON [--layers N] [--contexts 64 512 2048] [--prefill 2048]
                           [--threads 2] [--steps 16] [--rounds 2] [--out DIR] [--llama-cpp]
                           [--variant portable|ort]
    python bench/hybrid.py CONFIG_JSON --save-model DIR   # only the model, for bench/restart.py

Writes hybrid.json and prints a table; the results folder is bench/results/<date>-<commit>-hybrid-...
(`kvedge.bench.results`). With --llama-cpp, llama.cpp too, on a float32 GGUF of the same weights
written as its converter writes them (`kvedge.bench.gguf_file`; llama-cpp-python, the bench extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.bench.results import RESULTS_ROOT, results_folder
from kvedge.contract import VARIANTS

log = logging.getLogger(__name__)


def build_model(
    config_json: Path, layers: int | None, folder: Path, seed: int = 0, tokenizer_vocab: bool = False
) -> dict[str, Any]:
    """A random-weight model of `config_json` (its text part; the first `layers` layers, keeping
    the layer pattern) saved in `folder` with SmolLM2's tokenizer (the ids are random); with
    `tokenizer_vocab`, its vocabulary cut to that tokenizer's, so that every id it samples
    decodes to text (for a chat through the service). Returns the config as used."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvedge.export.source import default_gguf

    data = json.loads(config_json.read_text())
    data = data.get("text_config", data) if data.get("model_type") == "qwen3_5" else data
    if layers:
        data["num_hidden_layers"] = layers
        data["layer_types"] = list(data["layer_types"])[:layers]
    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer_vocab:
        data["vocab_size"] = len(tokenizer)
    config = AutoConfig.for_model(**data)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return config.to_dict()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Kvedge:
    """kvedge's export of the model, one slot."""

    def __init__(self, folder: Path, threads: int, max_len: int) -> None:
        from kvedge.runtime.model import Model

        self.model = Model(folder, threads=threads)

    def prefill(self, ids: list[int]) -> float:
        from kvedge.runtime.generate import prefill

        self.model.cache.reset(0)
        return timed(lambda: prefill(self.model.backend, self.model.cache, 0, [ids]))

    def decode(self, ids: list[int], steps: int) -> list[float]:
        from kvedge.runtime.generate import decode_one_token

        self.prefill(ids)
        return [
            timed(lambda: decode_one_token(self.model.backend, self.model.cache, 0, [7]))
            for _ in range(steps)
        ]


class Transformers:
    """transformers' model on the CPU (its reference kernels), with its own cache."""

    def __init__(self, folder: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def _prefill(self, ids: list[int]):
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids]), use_cache=True)

    def prefill(self, ids: list[int]) -> float:
        return timed(lambda: self._prefill(ids))

    def decode(self, ids: list[int], steps: int) -> list[float]:
        cache = self._prefill(ids).past_key_values
        token = self.torch.tensor([[7]])
        times = []
        with self.torch.no_grad():
            for _ in range(steps):
                start = time.perf_counter()
                cache = self.model(token, past_key_values=cache, use_cache=True).past_key_values
                times.append(time.perf_counter() - start)
        return times


class LlamaCpp:
    """llama.cpp (`systems.LlamaCppSystem`: llama-cpp-python, the bench extra, its defaults) on a
    float32 GGUF of the same weights, written as its converter writes them (`gguf_file`)."""

    def __init__(self, gguf: Path, threads: int, max_len: int) -> None:
        from kvedge.bench.systems import LlamaCppSystem

        self.llm = LlamaCppSystem(gguf, threads, max_len).llm

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        return timed(lambda: self.llm.eval(ids))

    def decode(self, ids: list[int], steps: int) -> list[float]:
        self.prefill(ids)
        return [timed(lambda: self.llm.eval([7])) for _ in range(steps)]


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from kvedge.contract import ExportRecipe, Manifest
    from kvedge.export.export import export_model

    config = build_model(args.config, args.layers, work / "hf")
    max_len = max([*args.contexts, args.prefill]) + args.steps + 8
    started = time.perf_counter()
    export_model(work / "hf", work / "out", ExportRecipe(max_len=max_len, variant=args.variant))
    export_s = time.perf_counter() - started
    geometry = Manifest.load(work / "out").geometry
    rng = np.random.default_rng(0)
    ids = rng.integers(16, 40000, max(args.contexts + [args.prefill])).tolist()
    systems = {
        "kvedge": Kvedge(work / "out", args.threads, max_len),
        "transformers": Transformers(work / "hf", args.threads),
    }
    if args.llama_cpp:
        from kvedge.bench.gguf_file import write_gguf

        gguf = write_gguf(work / "hf", work / "model.gguf")
        systems["llama.cpp"] = LlamaCpp(gguf, args.threads, max_len)
    decode: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.contexts} for name in systems}
    prefill: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(args.rounds):  # alternating, so drift in the machine's speed hits both
        for name, system in systems.items():
            for context in args.contexts:
                decode[name][context] += system.decode(ids[:context], args.steps)
                log.info("round %d %s: decode at %d", r + 1, name, context)
            prefill[name].append(system.prefill(ids[: args.prefill]))
            log.info("round %d %s: prefill %d", r + 1, name, args.prefill)
    rows = {
        name: {
            "decode_ms": {str(c): 1000 * statistics.median(decode[name][c]) for c in args.contexts},
            "prefill_s": min(prefill[name]),
        }
        for name in systems
    }
    for row in rows.values():
        first, last = (row["decode_ms"][str(c)] for c in (args.contexts[0], args.contexts[-1]))
        row["decode_ratio_longest_to_shortest"] = last / first
    return {
        "config": str(args.config),
        "variant": args.variant,
        "model_type": config["model_type"],
        "layers": config["num_hidden_layers"],
        "layer_types": config["layer_types"],
        "threads": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
        "export_s": export_s,
        "kv_bytes_per_token": geometry.bytes_per_token(),
        "state_bytes_per_slot": geometry.state_bytes_per_slot(),
        "systems": rows,
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="a published config.json (LFM2, Qwen3.5)")
    parser.add_argument("--layers", type=int, default=None, help="the first N layers only")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_ROOT)
    parser.add_argument("--variant", choices=VARIANTS, default="portable", help="kvedge's graph variant")
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also llama.cpp (llama-cpp-python, the bench extra) on a float32 GGUF of the same weights",
    )
    parser.add_argument(
        "--save-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="only save the random-weight model as a Hugging Face folder, its vocabulary cut to the "
        "tokenizer's so that replies decode (for bench/restart.py after `kvedge export DIR`)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.save_model is not None:
        config = build_model(args.config, args.layers, args.save_model, tokenizer_vocab=True)
        print(f"{config['model_type']}, {config['num_hidden_layers']} layers, vocab {config['vocab_size']}")
        return args.save_model
    folder = results_folder("hybrid", [args.threads], root=args.out)  # named by the code that runs
    with tempfile.TemporaryDirectory() as work:
        data = measure(args, Path(work))
    folder.mkdir(parents=True)
    (folder / "hybrid.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"{data['model_type']}, {data['layers']} layers, {args.threads} threads; {folder}")
    print(
        f"{'system':<14}"
        + "".join(f"{'decode@' + str(c):>14}" for c in args.contexts)
        + f"{'ratio':>8}{'prefill':>10}"
    )
    for name, row in data["systems"].items():
        cells = "".join(f"{row['decode_ms'][str(c)]:>11.1f} ms" for c in args.contexts)
        print(f"{name:<14}{cells}{row['decode_ratio_longest_to_shortest']:>8.2f}{row['prefill_s']:>9.2f}s")
    return folder
