"""The export at a real model's size, rerunnable without a model hub: a random-weight checkpoint
at a card's shape (configs/models, `kvedge.bench.checkpoint`), exported in each form, planned,
loaded and run, every phase in a child process of its own so that its peak RSS is its own.

    python bench/scale.py CARD [--layers N] [--forms cpu nano ...] [--threads 2] [--context 512]
                          [--steps 16] [--genai] [--out DIR]

Phases and what each reports:
- checkpoint: the random bfloat16 checkpoint (wall, peak RSS, bytes);
- export, one per form (`FORMS`: README's recommended CPU export, the plan's Orin Nano export,
  ...): `kvedge export` (wall, peak RSS, files, bits per parameter of the files);
- plan: the planner's estimate of loading each export for one sequence of its max_len, against
  the peak RSS measured below;
- run: a fresh process loads the export, prefills `--context` random tokens and decodes
  `--steps` (peak RSS, median ms per token);
- genai (with `--genai`, where onnxruntime-genai is installed): its builder's int4 CPU model of
  the same checkpoint (wall, peak RSS, files) and its decode, alternating with kvedge's forms.

Peak RSS is the phase's own ru_maxrss (`os.wait4` in a small process between, `PEAK_OF`).
Random weights measure memory, time and bytes, never answers. Writes scale.json and prints a
table; the results folder is bench/results/<date>-<commit>-scale-<card>-t<threads> (`kvedge.bench.results`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvedge.bench.measure import artifact_bytes
from kvedge.bench.results import RESULTS_ROOT, results_folder

log = logging.getLogger(__name__)

# form name -> `kvedge export` flags
FORMS = {
    "cpu": ["--variant", "ort", "--weights", "int8"],  # README's recommended CPU export
    "cpu-one-form": ["--variant", "ort", "--weights", "int8", "--decode-matmuls", "onnxruntime"],
    "cpu-int4": ["--variant", "ort", "--weights", "int4", "--kv-dtype", "int8"],
    "nano": ["--precision", "float16", "--weights", "int4", "--kv-dtype", "int8"],  # the plan's Orin Nano
    # the portable float32-compute graph with int4 weights: the form of every family (Gemma 4's
    # graph is built for float32 compute only)
    "portable-int4": ["--variant", "portable", "--weights", "int4"],
}


@dataclass(frozen=True)
class Phase:
    """One child process: its wall seconds, peak RSS (bytes) and exit status."""

    wall_s: float
    peak_rss: int
    returncode: int


# The phase runs under a small Python process that reports its exit code and peak RSS: on Linux
# a process's ru_maxrss starts at the peak of the memory it replaced at exec, which is the
# parent's under vfork, so a phase started straight from a large process (a test suite's, 5.6
# GiB in CI) reported that process's peak instead of its own.
PEAK_OF = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def run_phase(command: list[str], log_path: Path) -> Phase:
    """Run `command` with its output in `log_path`; its wall time and its own peak RSS."""
    started = time.perf_counter()
    report = log_path.with_suffix(".peak")
    with log_path.open("wb") as out:
        wrapped = python(PEAK_OF, str(report), *command)
        subprocess.run(wrapped, stdout=out, stderr=subprocess.STDOUT, check=True)
    returncode, peak_kib = map(int, report.read_text().split())
    phase = Phase(time.perf_counter() - started, peak_kib * 1024, returncode)
    if phase.returncode:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {phase.returncode}:\n{tail}")
    return phase


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


CHECKPOINT = """
import logging, sys
from pathlib import Path
from kvedge.bench.checkpoint import write_checkpoint
logging.basicConfig(level=logging.INFO)
layers = int(sys.argv[3]) or None
print(write_checkpoint(sys.argv[1], Path(sys.argv[2]), layers))
"""

GGUF = """
import logging, sys
from pathlib import Path
from kvedge.bench.gguf_file import write_gguf
logging.basicConfig(level=logging.INFO)
write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
"""

RUN = """
import json, statistics, sys
from pathlib import Path
import numpy as np
from kvedge.bench.systems import SystemSpec
spec = SystemSpec("x", sys.argv[1], Path(sys.argv[2]), "", max_len=int(sys.argv[3]))
system = spec.build(int(sys.argv[4]))
ids = np.random.default_rng(0).integers(16, 40000, int(sys.argv[5])).tolist()
ttft, steps = system.run(ids, int(sys.argv[6]))
print(json.dumps({"ttft_s": ttft, "steps_s": steps}))
"""


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from kvedge.planner import check_fits

    hf = work / "hf"
    built = run_phase(python(CHECKPOINT, args.card, str(hf), str(args.layers or 0)), work / "checkpoint.log")
    parameters = int((work / "checkpoint.log").read_text().split()[-1])
    result: dict[str, Any] = {
        "card": args.card,
        "layers": args.layers,
        "parameters": parameters,
        "threads": args.threads,
        "context": args.context,
        "steps": args.steps,
        "max_len": args.max_len,
        "checkpoint": {**asdict(built), "bytes": artifact_bytes(hf)},
        "forms": {},
    }
    source = hf
    if args.gguf:  # the exports read the checkpoint written as a GGUF file
        source = work / f"model-{args.gguf}.gguf"
        written = run_phase(python(GGUF, str(hf), str(source), args.gguf), work / "gguf.log")
        result["gguf"] = {"type": args.gguf, "write": asdict(written), "bytes": source.stat().st_size}
    systems: dict[str, tuple[str, Path]] = {}
    for form in args.forms:
        out = work / form
        command = [sys.executable, "-m", "kvedge", "-v", "export", str(source), "--out", str(out)]
        command += ["--max-len", str(args.max_len), *FORMS[form]]
        log.info("export %s: %s", form, " ".join(FORMS[form]))
        phase = run_phase(command, work / f"export-{form}.log")
        files = artifact_bytes(out)
        planned = check_fits(out, 1, 2**62).total
        result["forms"][form] = {
            "flags": " ".join(FORMS[form]),
            "export": asdict(phase),
            "files": files,
            "bits_per_parameter": 8 * files / parameters,
            "planned_load": planned,
        }
        systems[form] = ("kvedge", out)
    if args.genai:
        genai = work / "genai"
        log.info("onnxruntime-genai builder: int4 cpu")
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(genai)]
        command += ["-p", "int4", "-e", "cpu", "-c", str(work / "genai-cache")]
        phase = run_phase(command, work / "genai.log")
        files = artifact_bytes(genai)
        bits = 8 * files / parameters
        result["genai"] = {"build": asdict(phase), "files": files, "bits_per_parameter": bits}
        systems["genai int4"] = ("onnxruntime-genai", genai)
    result["runs"] = run_systems(args, systems, work)
    for form, row in result["forms"].items():
        row["planned_over_measured"] = row["planned_load"] / result["runs"][form]["peak_rss"]
    return result


def run_systems(args: argparse.Namespace, systems: dict[str, tuple[str, Path]], work: Path) -> dict[str, Any]:
    """Each system's peak RSS, median decode ms per token and prefill seconds (`args.context`
    tokens from an empty cache), `args.rounds` alternating rounds."""
    runs: dict[str, dict[str, Any]] = {
        name: {"peak_rss": 0, "decode_ms": [], "prefill_s": []} for name in systems
    }
    for r in range(args.rounds):
        for name, (kind, path) in systems.items():
            code = python(RUN, kind, str(path), str(args.max_len), str(args.threads), str(args.context))
            log_path = work / f"run-{name.replace(' ', '-')}-{r}.log"
            phase = run_phase([*code, str(args.steps)], log_path)
            timing = json.loads(log_path.read_text().strip().splitlines()[-1])
            runs[name]["peak_rss"] = max(runs[name]["peak_rss"], phase.peak_rss)
            runs[name]["decode_ms"].append(1000 * statistics.median(timing["steps_s"]))
            runs[name]["prefill_s"].append(timing["ttft_s"])
            log.info("round %d %s: %.1f ms/token", r + 1, name, runs[name]["decode_ms"][-1])
    for row in runs.values():
        row["median_decode_ms"] = statistics.median(row["decode_ms"])
        row["median_prefill_s"] = statistics.median(row["prefill_s"])
    return runs


def table(data: dict[str, Any]) -> str:
    """The run as a text table, one row per form (and genai's)."""
    gib = 2**30
    lines = [
        f"{data['card']} ({data['parameters']:,} parameters), {data['threads']} threads, "
        f"decode after {data['context']} tokens"
        + (f", exported from a {data['gguf']['type']} GGUF file" if "gguf" in data else ""),
        f"{'form':<14}{'export s':>9}{'export GiB':>11}{'files MiB':>10}{'bits/p':>7}"
        f"{'run GiB':>8}{'planned/run':>12}{'ms/token':>9}{'prefill s':>10}",
    ]
    for form, row in data["forms"].items():
        run = data["runs"][form]
        lines.append(
            f"{form:<14}{row['export']['wall_s']:>9.0f}{row['export']['peak_rss'] / gib:>11.2f}"
            f"{row['files'] / 2**20:>10.0f}{row['bits_per_parameter']:>7.2f}{run['peak_rss'] / gib:>8.2f}"
            f"{row['planned_over_measured']:>12.2f}{run['median_decode_ms']:>9.1f}{run['median_prefill_s']:>10.2f}"
        )
    if "genai" in data:
        row, run = data["genai"], data["runs"]["genai int4"]
        lines.append(
            f"{'genai int4':<14}{row['build']['wall_s']:>9.0f}{row['build']['peak_rss'] / gib:>11.2f}"
            f"{row['files'] / 2**20:>10.0f}{row['bits_per_parameter']:>7.2f}{run['peak_rss'] / gib:>8.2f}"
            f"{'-':>12}{run['median_decode_ms']:>9.1f}{run['median_prefill_s']:>10.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("card", help="a model card of configs/models, e.g. qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=None, help="the first N layers only")
    parser.add_argument("--forms", nargs="+", choices=sorted(FORMS), default=["cpu", "nano"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=512, help="tokens prefilled before decode")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--genai", action="store_true", help="also onnxruntime-genai's int4 CPU build")
    parser.add_argument(
        "--gguf",
        choices=["Q8_0", "Q4_0", "Q4_1"],
        default=None,
        help="export from the checkpoint written as a GGUF file of this type (as llama.cpp's converter)",
    )
    parser.add_argument("--work", type=Path, default=None, help="keep the checkpoint and exports here")
    parser.add_argument("--out", type=Path, default=RESULTS_ROOT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    name = f"scale-{args.card}" + (f"-{args.gguf.lower()}" if args.gguf else "")
    folder = results_folder(name, [args.threads], root=args.out)
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        data = measure(args, args.work)
    else:
        with tempfile.TemporaryDirectory() as work:
            data = measure(args, Path(work))
    data["date"] = folder.name[:10]
    folder.mkdir(parents=True)
    (folder / "scale.json").write_text(json.dumps(data, indent=2) + "\n")
    print(table(data))
    print(folder)
    return folder
