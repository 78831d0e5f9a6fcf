"""`kvedge bench`: kvedge and its peers side by side, in one process, alternating.

Method. Every system is loaded once and warmed up (one 256-token prefill + 4 decode steps).
Then, for each round, for each measurement case, every system runs the case once, the order of
systems rotating from round to round; a case's figure is the median over rounds, and a ratio is
the median over rounds of the per-round ratio (the machine is shared and noisy; ratios of
neighbouring runs are what we quote). Cases, all batch 1, greedy, same random token ids:

    prefill P   fresh sequence, P prompt tokens, until the first token is picked: tokens/s and
                time to first token (P = 128, 512, 1024, 2048)
    decode C    every system prefilled to C tokens (untimed), then `steps` decode steps taken
                in turn, one step of each system after the other, so load changes hit all
                systems alike: median ms/token (C = 64, 512, 1536, 2000; caches sized
                max_len = 2048, which holds 2000 + the steps).
                transformers `generate` cannot be stepped from outside: it runs its steps as
                one block after the others.

Exact-size twins (kvedge exported with max_len = 128) run decode 64 only: they are the
denominator of "no work over unused slots". Peak RSS is measured per system in a fresh process
(prefill 1024 + 16 steps); allocation growth over 1000 decode steps likewise (kvedge only).
Warm prefixes (warm vs cold TTFT, warm-file start-up, turn-N TTFT; `kvedge.bench.warm`)
are measured after the other systems are unloaded, for every kvedge system (`warm="all"`), the
first one only (`"first"`, what `--quick` does) or none.

Peers run in a child process each (`kvedge.bench.systems.ChildSystem`): one that crashes (a
segfault in its native code) is reported as crashed, with the case and the signal, in the table
and the JSON (`crashed`), and the run goes on without it; cases it did not finish in every round
have no figures. The JSON's `machine.cpu_flags` records the CPU features that decide which
kernels run (x86: avx2, fma, avx512*, amx*; aarch64: the Features line).

Several thread counts (`threads=(1, 2)`) measure every system at each, side by side, as systems
of their own ("kvedge ort int4 @2 threads"); a decode case measures one count at a time, at 1
thread stepping the systems in turn, at more each system's steps as one block (`thread_groups`
says why); targets, quality, warm prefixes, memory and
allocation are judged at the first count, the others are reported against it.

A kvedge system is an export, named 'variant:weights[:kv_dtype[:decode_matmuls]]' (`kvedge_system`):
'ort:int4:int8' holds its weights in two forms, 'ort:int4:int8:onnxruntime' in one. Every system
records its artifact bytes, the model files it loads (`measure.artifact_bytes`).

Output: <out>/bench.json, <out>/bench.png (ms/token vs context; prefill tokens/s), a printed
table; <out> defaults to a new bench/results/<date>-<commit>-<what> (`kvedge.bench.results`);
see docs/PERFORMANCE.md for the latest figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.bench import measure
from kvedge.bench.prepare import KvedgeBuild, Workdir
from kvedge.bench.report import evaluate_targets, plot, table
from kvedge.bench.results import code_revision, results_folder
from kvedge.bench.speculate import measure_speculation
from kvedge.bench.systems import ChildSystem, System, SystemCrashed, SystemSpec
from kvedge.bench.warm import measure_warm
from kvedge.contract import ONNX_FILE, ExportRecipe, Manifest
from kvedge.contract.engine import DEVICES
from kvedge.declare import from_values
from kvedge.errors import KvedgeError

log = logging.getLogger(__name__)

PREFILL_LENGTHS = (128, 512, 1024, 2048)
DECODE_CONTEXTS = (64, 512, 1536, 2000)
MAX_LEN = 2048  # the cache size of every system but the exact-size twins
EXACT_SIZE_MAX_LEN = 128  # holds decode-64 plus its steps
DEFAULT_KVEDGE = (
    "portable:float32",
    "ort:float32",
    "ort:int8",
    "ort:int4",
    "portable:int4",
    "portable:float32:int8",
    "portable:int4:int8",
    "ort:float32:int8",
    "ort:int4:int8",
)
PEERS = ("transformers", "onnxruntime-genai", "llama.cpp")
# the kvedge systems speculative decoding is measured on
SPECULATION_SYSTEMS = ("ort:int4:int8", "portable:float32")
# (target, draft): a draft model proposing for the target, both systems of the run
SPECULATION_DRAFT = ("portable:float32", "ort:int4:int8")
WARM = ("all", "first", "none")  # which kvedge systems get the warm-prefix section
QUALITY_PROMPTS = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city",
    "To bake a simple loaf of bread you need flour, water, salt and yeast. First,",
    "Photosynthesis is the process by which green plants use sunlight to",
    "In Python, a list comprehension is a compact way to build a list. For example,",
    "The capital of France is Paris, and the capital of Germany is",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "A KV cache stores the keys and values of past tokens so that a transformer",
    "The three primary colors of light are red, green and",
    "Dear customer, thank you for your order. Unfortunately, the item you requested",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
    "Machine learning models are trained on data. Overfitting happens when a model",
    "The Pacific Ocean is the largest and deepest of Earth's oceans. It covers",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Shakespeare wrote many plays, including Hamlet, Macbeth and",
    "To stay healthy, doctors recommend regular exercise, a balanced diet and",
    "The speed of light in a vacuum is about 300,000 kilometres per second, which means",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He said",
    "A good password should be long, unique and hard to guess. Many people",
    "The mitochondria is often called the powerhouse of the cell because it",
)


@dataclass(frozen=True)
class BenchConfig:
    out: Path | None = None  # None: a new bench/results/<date>-<commit>-<what> (`results_folder`)
    work: Path = Path("artifacts/bench")
    source: str | None = None  # HF folder or GGUF; default: SmolLM2-135M-Instruct GGUF
    threads: int | tuple[int, ...] = 0  # per system, 0: all cores; several: each count side by side
    device: str = "cpu"  # kvedge systems' backend: one of DEVICES
    rounds: int = 3
    steps: int = 24  # decode steps per case (the first 2 are dropped as warm-up)
    kvedge: tuple[str, ...] = DEFAULT_KVEDGE  # "variant:weights[:kv_dtype[:decode_matmuls]]"
    peers: tuple[str, ...] = PEERS
    block_size: int = 32
    prefill_lengths: tuple[int, ...] = PREFILL_LENGTHS
    decode_contexts: tuple[int, ...] = DECODE_CONTEXTS
    memory: bool = True  # peak RSS per system, in a child process each
    allocation_steps: int = 1000  # 0: skip the allocation-growth measurement
    quality: bool = True  # KL / top-1 of quantized weights against float32
    exact_size: bool = True  # exact-size twins for the unused-slots target
    warm: str = "all"  # warm prefixes and multi-turn reuse for kvedge systems: one of WARM
    # speculative decoding against plain, on these kvedge systems where measured (`kvedge.bench.speculate`)
    speculation: tuple[str, ...] = SPECULATION_SYSTEMS
    # a draft model against plain: (target system, draft system) where both are measured; None: off
    speculation_draft: tuple[str, str] | None = SPECULATION_DRAFT
    debug_crashing_peer: bool = False  # tests only: add a peer whose process segfaults in decode
    seed: int = 0
    command: str = ""  # recorded in the JSON

    def __post_init__(self) -> None:
        counts = (self.threads,) if isinstance(self.threads, int) else tuple(self.threads)
        if (
            not counts
            or len(set(counts)) != len(counts)
            or not all(isinstance(t, int) and t >= 0 for t in counts)
        ):
            raise KvedgeError(
                f"threads={self.threads!r}: give one or more distinct counts >= 0 (0: all cores)"
            )
        if self.rounds < 1 or self.steps < 3:
            raise KvedgeError(f"rounds={self.rounds}, steps={self.steps}: need rounds >= 1 and steps >= 3")
        if self.device not in DEVICES:
            raise KvedgeError(f"--device {self.device!r} is not supported; allowed: {list(DEVICES)}")
        for item in self.kvedge:
            kvedge_system(item, self.block_size)
        for peer in self.peers:
            if peer not in PEERS:
                raise KvedgeError(f"peer {peer!r} is unknown; allowed: {list(PEERS)}")
        if self.warm not in WARM:
            raise KvedgeError(f"warm={self.warm!r} is not allowed; allowed: {list(WARM)}")
        if max(self.prefill_lengths, default=0) > MAX_LEN:
            raise KvedgeError(f"prefill lengths {list(self.prefill_lengths)} exceed max_len {MAX_LEN}")
        longest = max(self.decode_contexts, default=0)
        if longest + self.steps + 1 > MAX_LEN:
            raise KvedgeError(
                f"decode at context {longest} + {self.steps} steps does not fit max_len {MAX_LEN}"
            )
        if self.out is None:  # frozen: the one place the default is filled in
            object.__setattr__(self, "out", results_folder(self.device, self.thread_counts))

    @property
    def thread_counts(self) -> tuple[int, ...]:
        counts = (self.threads,) if isinstance(self.threads, int) else tuple(self.threads)
        return tuple(t or os.cpu_count() or 1 for t in counts)

    @property
    def thread_count(self) -> int:
        """The first thread count: the one targets are judged at."""
        return self.thread_counts[0]


@dataclass
class Results:
    config: dict[str, Any]
    machine: dict[str, Any]
    systems: list[dict[str, Any]] = field(default_factory=list)
    prefill: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    decode: dict[str, dict[int, float]] = field(default_factory=dict)
    rounds: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # raw per-round figures
    roofline: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    quality: dict[str, dict[str, float]] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    allocation: dict[str, dict[str, float]] = field(default_factory=dict)
    warm: dict[str, dict[str, Any]] = field(default_factory=dict)  # system -> `measure_warm` figures
    # system (or "<target> + draft <draft>") -> workload -> `measure_speculation` figures
    speculation: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    crashed: dict[str, str] = field(default_factory=dict)  # system -> the case and how its process died
    targets: list[dict[str, Any]] = field(default_factory=list)


def run_benchmark(config: BenchConfig, echo: Callable[[str], None] = print) -> Results:
    """Prepare artifacts, measure every system, write JSON + PNG into config.out, print a table."""
    threads = config.thread_count
    work = Workdir(config.work, config.source)
    specs, skipped = _specs(config, work)
    bandwidth = measure.copy_bandwidth()
    results = Results(config=_jsonable(asdict(config)), machine=_machine(threads, bandwidth), skipped=skipped)
    for reason in skipped.values():
        echo(f"skipped: {reason}")
    rng = np.random.default_rng(config.seed)
    vocab = Manifest.load(next(s.path for s in specs if s.kind == "kvedge")).vocab_size
    longest = max((*config.prefill_lengths, *config.decode_contexts))
    tokens = [int(t) for t in rng.integers(100, vocab - 100, longest)]

    echo(f"loading {len(specs)} systems ({', '.join(map(str, config.thread_counts))} threads)")
    guarded = partial(_guarded, crashed=results.crashed, echo=echo)
    systems = _load_systems(specs, threads, tokens, guarded)
    results.rounds = _measure_rounds(config, specs, systems, tokens, threads, guarded, results.crashed, echo)
    _summarize(results, config, specs, bandwidth, threads)
    _measure_quality(results, config, specs, systems, guarded, echo)
    for system in systems.values():
        if isinstance(system, ChildSystem):
            system.close()
    systems.clear()  # unload before the warm-prefix and memory runs
    _measure_fresh(results, config, specs, tokens, threads, guarded, echo)

    results.targets = evaluate_targets(results, specs)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "bench.json").write_text(json.dumps(_jsonable(asdict(results)), indent=2))
    plot(results, config.out / "bench.png")
    echo(table(results))
    echo(f"wrote {config.out / 'bench.json'} and {config.out / 'bench.png'}")
    return results


Guarded = Callable[[str, str, Callable[[], Any]], Any]


def _guarded(
    name: str, case: str, call: Callable[[], Any], crashed: dict[str, str], echo: Callable[[str], None]
) -> Any:
    """call(), or None when `name`'s process dies in it (recorded in `crashed`)."""
    try:
        return call()
    except SystemCrashed as exc:
        crashed[name] = f"{case}: {exc}"
        echo(f"{name} crashed in {case}: {exc}")
        return None


def _load_systems(
    specs: list[SystemSpec], threads: int | None, tokens: list[int], guarded: Guarded
) -> dict[str, System]:
    """Every system that loads and runs a warm-up, by name."""
    systems: dict[str, System] = {}
    for spec in specs:
        system = guarded(spec.name, "loading", partial(_build, spec, spec.threads or threads))
        if system is not None and guarded(
            spec.name, "warm-up", partial(system.run, tokens[: min(256, spec.max_len // 2)], 4)
        ):
            systems[spec.name] = system
            log.info("warmed up %s", spec.name)
    return systems


def _measure_rounds(
    config: BenchConfig,
    specs: list[SystemSpec],
    systems: dict[str, System],
    tokens: list[int],
    threads: int | None,
    guarded: Guarded,
    crashed: dict[str, str],
    echo: Callable[[str], None],
) -> dict[str, dict[str, list[float]]]:
    """Prefill and decode seconds, system -> "prefill:n" / "decode:c" -> one figure per round;
    each round starts with the next system, so no system always runs first. A system in `crashed`
    (which `guarded` fills) runs no further case."""
    raw: dict[str, dict[str, list[float]]] = {s.name: {} for s in specs}
    for round_index in range(config.rounds):
        order = specs[round_index % len(specs) :] + specs[: round_index % len(specs)]
        for n in config.prefill_lengths:
            for spec in (s for s in order if not s.reference_for and s.name not in crashed):
                ran = guarded(spec.name, f"prefill {n}", partial(systems[spec.name].run, tokens[:n], 0))
                if ran is not None:
                    raw[spec.name].setdefault(f"prefill:{n}", []).append(ran[0])
        for c in config.decode_contexts:
            here = [
                s
                for s in order
                if s.name not in crashed and (not s.reference_for or c == min(config.decode_contexts))
            ]
            for group in thread_groups(here):
                one = (group[0].threads or threads or os.cpu_count() or 1) == 1  # see thread_groups
                measured = _decode_case(systems, group, tokens[:c], config.steps, guarded, interleave=one)
                for name, seconds in measured.items():
                    raw[name].setdefault(f"decode:{c}", []).append(seconds)
        echo(f"round {round_index + 1}/{config.rounds} done")
    return raw


def _summarize(
    results: Results, config: BenchConfig, specs: list[SystemSpec], bandwidth: float, threads: int | None
) -> None:
    """Each system's medians over the rounds (cases finished in every round only), its roofline and
    its description, into `results`."""

    def complete(figures: dict[str, list[float]], case: str) -> list[float] | None:
        """A case's per-round figures, if the system finished it in every round."""
        values = figures.get(case)
        return values if values and len(values) == config.rounds else None

    for spec in specs:
        figures = results.rounds[spec.name]
        results.prefill[spec.name] = {
            n: {"ttft_ms": 1e3 * float(np.median(v)), "tokens_per_s": n / float(np.median(v))}
            for n in config.prefill_lengths
            if (v := complete(figures, f"prefill:{n}"))
        }
        results.decode[spec.name] = {
            c: 1e3 * float(np.median(v))
            for c in config.decode_contexts
            if (v := complete(figures, f"decode:{c}"))
        }
        results.roofline[spec.name] = {
            c: _roofline(spec, c, ms, bandwidth) for c, ms in results.decode[spec.name].items()
        }
        results.systems.append(
            {
                "name": spec.name,
                "kind": spec.kind,
                "weights": spec.weights,
                "path": str(spec.path),
                "max_len": spec.max_len,
                "threads": spec.threads or threads,
                "weight_bytes_per_token": spec.weight_bytes_per_token,
                "kv_bytes_per_token": spec.kv_bytes_per_token,
                "artifact_bytes": spec.artifact_bytes,
                "reference_for": spec.reference_for,
                "crashed": results.crashed.get(spec.name),
                **spec.extra,
            }
        )


def _measure_quality(
    results: Results,
    config: BenchConfig,
    specs: list[SystemSpec],
    systems: dict[str, System],
    guarded: Guarded,
    echo: Callable[[str], None],
) -> None:
    """KL / top-1 of every live system against a float32 reference, at one thread count."""
    alive = [s for s in specs if s.name not in results.crashed and not s.threads_of]
    reference = _quality_reference(alive)
    if config.quality and reference is None:
        results.skipped["quality"] = (
            "quality needs a float32 reference: transformers among the peers or a kvedge float32 system"
        )
        echo(f"skipped: {results.skipped['quality']}")
    elif config.quality:
        echo("quality: KL / top-1 against float32 weights over 20 prompts")
        results.quality = _quality(reference, alive, systems, guarded)


def _measure_fresh(
    results: Results,
    config: BenchConfig,
    specs: list[SystemSpec],
    tokens: list[int],
    threads: int | None,
    guarded: Guarded,
    echo: Callable[[str], None],
) -> None:
    """What runs after the systems are unloaded: warm prefixes, peak RSS (a fresh process per
    system) and allocation growth, each on one system per thread count."""
    first = [s for s in specs if not s.reference_for and not s.threads_of]
    warm = [s for s in first if s.kind == "kvedge"]
    for spec in {"all": warm, "first": warm[:1], "none": []}[config.warm]:
        echo(f"warm prefixes: {spec.name}")
        try:
            results.warm[spec.name] = measure_warm(spec.path, threads, config.rounds, echo)
        except KvedgeError as exc:  # one section refused: say so, keep the run's other figures
            echo(f"  warm prefixes of {spec.name} skipped: {exc}")
            results.skipped[f"{spec.name} warm prefixes"] = str(exc)
    for spec in warm:
        if spec.extra.get("system") in config.speculation:
            echo(f"speculative decoding (prompt lookup) against plain: {spec.name}")
            results.speculation[spec.name] = measure_speculation(spec.path, threads, config.rounds, echo=echo)
    by_system = {spec.extra.get("system"): spec for spec in warm}
    target, draft = (by_system.get(s) for s in config.speculation_draft or (None, None))
    if target and draft:
        echo(f"speculative decoding (draft model {draft.name}) against plain: {target.name}")
        results.speculation[f"{target.name} + draft {draft.name}"] = measure_speculation(
            target.path, threads, config.rounds, echo=echo, draft=draft.path
        )
    if config.memory:
        echo("peak RSS: one fresh process per system")
        for spec in first:
            if spec.name not in results.crashed:
                rss = guarded(
                    spec.name,
                    "peak RSS",
                    partial(measure.peak_rss_mib, spec, threads, tokens[:1024], 16),
                )
                if rss is not None:
                    results.memory[spec.name] = rss
    if config.allocation_steps:
        echo(f"allocation growth over {config.allocation_steps} decode steps (kvedge)")
        for spec in warm:
            results.allocation[spec.name] = measure.allocation_profile(
                spec, threads, tokens[:64], config.allocation_steps
            )


def _build(spec: SystemSpec, threads: int) -> System:
    """kvedge systems in this process; peers in a child process each, where a crash is theirs alone."""
    return spec.build(threads) if spec.kind == "kvedge" else ChildSystem(spec, threads)


def _started(system: System, ids: list[int]) -> bool:
    system.start(ids)
    return True


def thread_groups(specs: list[SystemSpec]) -> list[list[SystemSpec]]:
    """`specs` split by thread count, groups and their members in the order given.

    A decode case measures one group at a time: 1-thread systems step in turn, and systems at more
    threads take their steps as one block each, one system after the other. Between steps a
    multi-threaded runtime keeps its workers spinning (onnxruntime's pool, ggml's threads), so a
    step interleaved after it competes with them for the cores (docs/PERFORMANCE.md, "One thread
    in the tables"). A block's first 2 steps,
    which may meet the previous system's spinning workers, are dropped as every case's are."""
    groups: dict[int, list[SystemSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.threads, []).append(spec)
    return list(groups.values())


def _decode_case(
    systems: dict[str, System],
    specs: list[SystemSpec],
    ids: list[int],
    steps: int,
    guarded: Guarded,
    interleave: bool = True,
) -> dict[str, float]:
    """Median seconds per decode step at context len(ids), the first 2 steps dropped.

    Steppable systems are prefilled (untimed), then their steps interleave one by one (or, not
    `interleave`, run as one block per system: `thread_groups`); the others (transformers
    `generate`) run their steps as one block. A system whose process dies (`guarded` returns
    None) leaves the case and has no figure in it.
    """
    case = f"decode {len(ids)}"
    stepped = [
        s.name
        for s in specs
        if systems[s.name].steppable and guarded(s.name, case, partial(_started, systems[s.name], ids))
    ]
    times: dict[str, list[float]] = {name: [] for name in stepped}
    turns = [stepped] * steps if interleave else [[name] * steps for name in stepped]
    for turn in turns:
        for name in turn:
            if name not in times:  # its process died earlier in this case
                continue
            seconds = guarded(name, case, systems[name].timed_step)
            if seconds is None:
                del times[name]
            else:
                times[name].append(seconds)
    for spec in specs:
        if spec.name not in times and not systems[spec.name].steppable:
            ran = guarded(spec.name, case, partial(systems[spec.name].run, ids, steps))
            if ran is not None:
                times[spec.name] = ran[1]
    return {name: float(np.median(t[2:])) for name, t in times.items()}


def _kvedge_specs(config: BenchConfig, work: Workdir) -> list[SystemSpec]:
    """The kvedge systems, each exported if needed, with the exact-size twin of a float32 one."""
    specs: list[SystemSpec] = []
    for item in config.kvedge:
        build = KvedgeBuild(kvedge_system(item, config.block_size))
        name = build.system_name
        spec = _kvedge_spec(work.kvedge(build), name, device=config.device)
        specs.append(dataclasses.replace(spec, extra={**spec.extra, "system": item}))
        if config.exact_size and (build.recipe.weights, build.recipe.kv_dtype) == ("float32", "float32"):
            twin = KvedgeBuild(dataclasses.replace(build.recipe, max_len=EXACT_SIZE_MAX_LEN))
            specs.append(
                _kvedge_spec(
                    work.kvedge(twin),
                    f"{name} max_len {EXACT_SIZE_MAX_LEN}",
                    reference_for=name,
                    device=config.device,
                )
            )
    return specs


def _specs(config: BenchConfig, work: Workdir) -> tuple[list[SystemSpec], dict[str, str]]:
    specs = _kvedge_specs(config, work)
    skipped: dict[str, str] = {}
    geometry = Manifest.load(specs[0].path).geometry  # the first system's cache may be INT8
    fp32_kv = dataclasses.replace(geometry, dtype="float32", group_size=0).bytes_per_token()
    if "transformers" in config.peers:
        hf = work.hf_folder()
        specs.append(
            SystemSpec(
                name="transformers eager",
                kind="transformers",
                path=hf,
                weights="float32",
                weight_bytes_per_token=_hf_weight_bytes(hf),
                kv_bytes_per_token=fp32_kv,
                artifact_bytes=measure.artifact_bytes(hf),
            )
        )
    if "onnxruntime-genai" in config.peers:
        if importlib.util.find_spec("onnxruntime_genai") is None:
            skipped["onnxruntime-genai"] = "onnxruntime-genai is not installed (pip install '.[bench]')"
        else:
            for precision in ("fp32", "int4"):
                folder = work.ort_genai(precision)
                specs.append(
                    SystemSpec(
                        name=f"onnxruntime-genai {precision}",
                        kind="onnxruntime-genai",
                        path=folder,
                        weights="float32" if precision == "fp32" else "int4",
                        weight_bytes_per_token=measure.onnx_weight_bytes_per_token(folder / "model.onnx"),
                        kv_bytes_per_token=fp32_kv,
                        artifact_bytes=measure.artifact_bytes(folder),
                    )
                )
    if "llama.cpp" in config.peers:
        if not work.source.gguf_file:
            skipped["llama.cpp"] = "llama.cpp needs a GGUF source"
        elif importlib.util.find_spec("llama_cpp") is None:
            skipped["llama.cpp"] = (
                "llama-cpp-python is not installed (pip install '.[bench]'; it compiles llama.cpp, ~20 min)"
            )
        else:
            gguf = work.source.folder / work.source.gguf_file
            specs.append(
                SystemSpec(
                    name=f"llama.cpp {_gguf_type(gguf)}",
                    kind="llama.cpp",
                    path=gguf,
                    weights=_gguf_type(gguf),
                    weight_bytes_per_token=measure.gguf_weight_bytes(gguf),
                    kv_bytes_per_token=fp32_kv // 2,  # f16 K and V by default
                    artifact_bytes=measure.artifact_bytes(gguf),
                )
            )
    for count in config.thread_counts[1:]:
        specs += [
            dataclasses.replace(s, name=f"{s.name} @{count} threads", threads=count, threads_of=s.name)
            for s in list(specs)
            if not s.reference_for and not s.threads_of
        ]
    if config.debug_crashing_peer:
        specs.append(
            SystemSpec(name="debug crashing peer", kind="debug-crash", path=Path("."), weights="none")
        )
    return specs, skipped


# the ExportRecipe fields a kvedge system names, in order ("variant:weights[:kv_dtype[:decode_matmuls]]")
SYSTEM_KEYS = ("variant", "weights", "kv_dtype", "decode_matmuls")


def kvedge_system(item: str, block_size: int = 32) -> ExportRecipe:
    """'variant:weights[:kv_dtype[:decode_matmuls]]' -> the export it names: the cache defaults to
    float32, the decode matmuls to the recipe's rule (`ExportRecipe.decode`); 'onnxruntime' there is
    the one-form export (`--decode-matmuls onnxruntime`)."""
    parts = item.split(":")
    if not 2 <= len(parts) <= 4:
        raise KvedgeError(
            f"kvedge system {item!r} is not 'variant:weights[:kv_dtype[:decode_matmuls]]' (e.g. "
            "'ort:int4', 'portable:float32:int8', 'ort:int4:int8:onnxruntime')"
        )
    values = {"kv_dtype": "float32", **{k: v for k, v in zip(SYSTEM_KEYS, parts, strict=False) if v}}
    try:
        return from_values(ExportRecipe, values, block_size=block_size)
    except KvedgeError as exc:
        raise KvedgeError(f"kvedge system {item!r}: {exc}") from None


def _kvedge_spec(
    folder: Path, name: str, reference_for: str | None = None, device: str = "cpu"
) -> SystemSpec:
    manifest = Manifest.load(folder)
    return SystemSpec(
        name=name,
        kind="kvedge",
        path=folder,
        weights=manifest.weights_dtype,
        max_len=manifest.geometry.max_len,
        weight_bytes_per_token=measure.onnx_weight_bytes_per_token(folder / ONNX_FILE),
        kv_bytes_per_token=manifest.geometry.bytes_per_token(),
        reference_for=reference_for,
        device=device,
        artifact_bytes=measure.artifact_bytes(folder),
        extra={
            "variant": manifest.variant,
            "kv_dtype": manifest.geometry.dtype,
            "decode_matmuls": manifest.weight_decode_matmuls,
        },
    )


def _hf_weight_bytes(folder: Path) -> int:
    """float32 bytes of every saved tensor (a tied LM head is saved once and read in full)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "np") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += int(np.prod(handle.get_slice(key).get_shape())) * 4
    return total


def _gguf_type(path: Path) -> str:
    """The most common quantization type of the GGUF's matrices, e.g. Q4_1."""
    import gguf

    kinds = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0]


def _roofline(spec: SystemSpec, context: int, ms: float, bandwidth: float) -> dict[str, float]:
    total = spec.weight_bytes_per_token + context * spec.kv_bytes_per_token
    bound_ms = 1e3 * total / bandwidth
    return {"bytes_per_token": total, "bound_ms": bound_ms, "fraction_of_bound": bound_ms / ms}


def _quality_reference(specs: list[SystemSpec]) -> str | None:
    """The float32 reference quality is measured against: transformers, else a kvedge float32
    system with the float32 cache; None when the run has neither."""
    for spec in specs:
        if spec.kind == "transformers":
            return spec.name
    for spec in specs:
        if spec.kind == "kvedge" and spec.weights == "float32" and spec.extra.get("kv_dtype") == "float32":
            return spec.name
    return None


def _all_logits(system: System, prompts: list[list[int]]) -> list[np.ndarray]:
    return [system.next_token_logits(ids) for ids in prompts]


def _quality(
    reference_name: str,
    specs: list[SystemSpec],
    systems: dict[str, Any],
    guarded: Guarded,
) -> dict[str, dict[str, float]]:
    """Every other system against the float32 reference `reference_name` (a system whose process
    dies meanwhile is left out)."""
    from tokenizers import Tokenizer

    first = next(s for s in specs if s.kind == "kvedge")
    tokenizer = Tokenizer.from_file(str(first.path / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in QUALITY_PROMPTS]
    reference = [systems[reference_name].next_token_logits(p) for p in prompts]
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        if spec.name == reference_name or spec.reference_for:
            continue
        logits = guarded(
            spec.name,
            "quality",
            partial(_all_logits, systems[spec.name], prompts),
        )
        if logits is None:
            continue
        kls, agree = [], []
        for ref, got in zip(reference, logits, strict=True):
            kl, top1 = measure.kl_and_top1(ref, got)
            kls.append(kl)
            agree.append(top1)
        out[spec.name] = {
            "reference": reference_name,
            "positions": int(sum(len(k) for k in kls)),
            "mean_kl": float(np.concatenate(kls).mean()),
            "top1_agreement": float(np.concatenate(agree).mean()),
        }
    return out


def _machine(threads: int, bandwidth: float) -> dict[str, Any]:
    versions = {}
    for package in (
        "kvedge",
        "onnxruntime",
        "onnxruntime-genai",
        "llama-cpp-python",
        "torch",
        "transformers",
        "numpy",
    ):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    cpu, cpuinfo = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as handle:
            cpuinfo = handle.read()
        cpu = next(
            line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "code": code_revision(),  # the commit the results folder is named by
        "cpu": cpu,
        "cpu_flags": cpu_flags(cpuinfo),
        "cores": os.cpu_count(),
        "threads": threads,
        "load_average": os.getloadavg(),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "python": sys.version.split()[0],
        "versions": versions,
    }


def cpu_flags(cpuinfo: str) -> list[str]:
    """The CPU features that decide which kernels run, from /proc/cpuinfo's text: on x86 the flags
    avx2, fma, avx512* and amx* (AMX and AVX-512 are where some peers' builds have crashed), on
    aarch64 the whole Features line (asimd, asimddp, sve, i8mm, ...)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return sorted(f for f in value.split() if f in ("avx2", "fma") or f.startswith(("avx512", "amx")))
        if key.strip() == "Features":
            return value.split()
    return []


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value
