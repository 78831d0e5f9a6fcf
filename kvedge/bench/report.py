"""Benchmark output: the targets as ratios, a printed table, a PNG plot.

A ratio "a vs b" on a case is the median over rounds of (b's time / a's time) in the same round:
above 1 means a is faster. Targets:

    unused slots      decode 64 at max_len 2048 / the same at an exact-size cache      <= 1.10
    flat growth       decode 1536 / decode 64 (float32 weights; reported for all; the
                      longest context when the run has no 1536)                       <= 1.30
    no allocation     RSS growth < 2 MiB and Python heap growth < 16 KiB over the
                      allocation run (a context-proportional buffer would add ~40 MiB)
    prefill           kvedge vs onnxruntime-genai, same weight precision                >= 1.0
                      INT8-cache systems: >= 1.2, up to 2048 tokens, and the
                      ort ones >= the portable graph with the same weights               >= 1.0
    int4 decode       kvedge int4 vs onnxruntime-genai int4 (>= 1.0), vs llama.cpp (>= 1.4), every
                      context (64 to 2000)
    fp32 decode       kvedge float32 vs onnxruntime-genai fp32                           >= 1.0
    int8 cache        kvedge with --kv-dtype int8 vs the same graph with the fp32 cache,
                      decode at the longest context                                     >= 1.0
    second form       a two-form ort export vs its one-form twin (--decode-matmuls
                      onnxruntime), decode at every context: what the decode form's
                      bytes buy                                                          report

Warm prefixes (method in `kvedge.bench.warm`), per kvedge system measured:

    warm TTFT         cold / warm-prefix time to first token, 300-token system prompt
                      + 20-token user message                                            >= 10
    long TTFT         the same for a 2048-token prompt                                   report

Speculative decoding (method in `kvedge.bench.speculate`), per kvedge system measured
with prompt lookup and with a draft model: tokens/s with speculation / without, greedy replies
equal to plain decoding's (met only when they are)

    a quote / b rewrite   a reply quoting or rewriting its prompt                      >= 1.6
    c chat                open chat: never slower than without                         >= 0.97

Other thread counts: each system at the count vs at the first, prefill at the longest prompt
and decode at the longest context                                                        report
    warm start-up     recomputing 4 warm prefixes / loading + verifying their files      >= 20
    turn growth       reuse-path TTFT at turn 8 / at turn 1 (full re-prefill's beside)   <= 1.30
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvedge.bench.systems import SystemSpec
from kvedge.files import MiB

FLAT_GROWTH_CONTEXT = 1536  # the flat-growth target's long context


def speedup(results: Any, a: str, b: str, case: str) -> float | None:
    """Median over rounds of time_b / time_a for `case` (e.g. "decode:512"); None if missing."""
    ta, tb = results.rounds.get(a, {}).get(case), results.rounds.get(b, {}).get(case)
    if not ta or not tb or len(ta) != len(tb):  # a system that crashed mid-run has fewer rounds
        return None
    return float(np.median(np.asarray(tb) / np.asarray(ta)))


def _target(name: str, value: float | None, goal: str, met: bool | None, note: str = "") -> dict[str, Any]:
    return {"target": name, "value": value, "goal": goal, "met": met, "note": note}


def evaluate_targets(results: Any, specs: list[SystemSpec]) -> list[dict[str, Any]]:
    """Target rows at the first thread count, then report rows for the other counts."""
    again = [s for s in specs if s.threads_of]  # the same systems at other thread counts
    specs = [s for s in specs if not s.threads_of]
    kvedge = [s for s in specs if s.kind == "kvedge" and not s.reference_for]
    contexts = sorted({c for figures in results.decode.values() for c in figures})
    lengths = sorted({n for figures in results.prefill.values() for n in figures})
    return [
        *_twin_rows(results, specs, contexts),
        *_growth_rows(results, kvedge, contexts),
        *_allocation_rows(results),
        *_peer_rows(results, specs, kvedge, contexts, lengths),
        *_int8_cache_rows(results, kvedge, contexts),
        *_second_form_rows(results, kvedge, contexts),
        *_llama_prefill_rows(results, specs, kvedge, lengths),
        *warm_targets(results.warm),
        *speculation_targets(results.speculation),
        *_thread_rows(results, again, contexts, lengths),
    ]


def _twin_rows(results: Any, specs: list[SystemSpec], contexts: list[int]) -> list[dict[str, Any]]:
    """Unused slots cost nothing: each max_len twin against its reference."""
    rows = []
    for twin in (s for s in specs if s.reference_for):
        ratio = speedup(results, twin.name, twin.reference_for, f"decode:{contexts[0]}")
        rows.append(
            _target(
                f"unused slots: {twin.reference_for}, ctx {contexts[0]}, max_len 2048 vs {twin.max_len}",
                ratio,
                "<= 1.10",
                ratio is not None and ratio <= 1.10,
            )
        )
    return rows


def _growth_rows(results: Any, kvedge: list[SystemSpec], contexts: list[int]) -> list[dict[str, Any]]:
    """Decode time flat in the context: far context over the first, per round, median."""
    rows = []
    for spec in kvedge if len(contexts) >= 2 else []:
        figures = results.rounds[spec.name]
        far = FLAT_GROWTH_CONTEXT if FLAT_GROWTH_CONTEXT in contexts else contexts[-1]
        low, high = figures[f"decode:{contexts[0]}"], figures[f"decode:{far}"]
        ratio = float(np.median(np.asarray(high) / np.asarray(low)))
        fp32 = spec.weights == "float32"
        rows.append(
            _target(
                f"flat growth: {spec.name}, decode {far} / {contexts[0]}",
                ratio,
                "<= 1.30" if fp32 else "report",
                (ratio <= 1.30) if fp32 else None,
            )
        )
    return rows


def _allocation_rows(results: Any) -> list[dict[str, Any]]:
    rows = []
    for name, alloc in results.allocation.items():
        ok = alloc["rss_growth_mib"] < 2 and alloc["heap_growth_kib"] < 16
        rows.append(
            _target(
                f"no allocation: {name}, {alloc['steps']} steps, "
                f"ctx {alloc['context_from']}->{alloc['context_to']}",
                alloc["rss_growth_mib"],
                "RSS growth < 2 MiB, heap growth < 16 KiB",
                ok,
                f"heap growth {alloc['heap_growth_kib']:.1f} KiB",
            )
        )
    return rows


def _faster(results: Any, label: str, spec_name: str, other: str, case: str, floor: float) -> dict[str, Any]:
    """A speed-ratio target row: `spec_name` over `other` on `case`, met at >= `floor`; not
    judged when `other` crashed before finishing the case."""
    ratio = speedup(results, spec_name, other, case)
    if ratio is None and other in getattr(results, "crashed", {}):
        return _target(f"{label}: {spec_name} vs {other}", None, f">= {floor}", None, "peer crashed")
    return _target(
        f"{label}: {spec_name} vs {other}", ratio, f">= {floor}", ratio is not None and ratio >= floor
    )


def _peer_rows(
    results: Any, specs: list[SystemSpec], kvedge: list[SystemSpec], contexts: list[int], lengths: list[int]
) -> list[dict[str, Any]]:
    """Each kvedge system against its peers (onnxruntime-genai, llama.cpp, transformers) and the
    INT8-cache ort graph against the portable float32-cache one."""
    names = {s.name for s in specs}
    peers = {"float32": "onnxruntime-genai fp32", "int4": "onnxruntime-genai int4"}
    llama = next((s.name for s in specs if s.kind == "llama.cpp"), None)
    hf = next((s.name for s in specs if s.kind == "transformers"), None)
    rows = []
    for spec in kvedge:
        peer = peers.get(spec.weights)
        int8_cache = spec.extra.get("kv_dtype") == "int8"
        if peer in names:  # the INT8-cache kernel's prefill by a margin
            for n in lengths:
                rows.append(
                    _faster(
                        results, f"prefill {n}", spec.name, peer, f"prefill:{n}", 1.2 if int8_cache else 1.0
                    )
                )
        portable = next(
            (
                s
                for s in kvedge
                if (s.weights, s.extra.get("variant"), s.extra.get("kv_dtype"))
                == (spec.weights, "portable", "float32")
            ),
            None,
        )
        if int8_cache and spec.extra.get("variant") == "ort" and portable is not None:
            for n in lengths:
                rows.append(_faster(results, f"prefill {n}", spec.name, portable.name, f"prefill:{n}", 1.0))
        if spec.weights == "int4":
            for c in contexts:
                if peer in names:
                    rows.append(_faster(results, f"int4 decode {c}", spec.name, peer, f"decode:{c}", 1.0))
                if llama:
                    rows.append(_faster(results, f"int4 decode {c}", spec.name, llama, f"decode:{c}", 1.4))
        if spec.weights == "float32":
            for c in contexts:
                if peer in names:
                    rows.append(_faster(results, f"fp32 decode {c}", spec.name, peer, f"decode:{c}", 1.0))
            if hf and contexts:
                ratio = speedup(
                    results, spec.name, hf, f"decode:{contexts[1] if len(contexts) > 1 else contexts[0]}"
                )
                rows.append(
                    _target(f"fp32 decode: {spec.name} vs {hf}", ratio, "report (~3x expected)", None)
                )
    return rows


def _int8_cache_rows(results: Any, kvedge: list[SystemSpec], contexts: list[int]) -> list[dict[str, Any]]:
    """Each INT8-cache system against the same graph, weights and decode matmuls with a float32 cache."""
    rows = []
    for spec in kvedge:
        twin = next(
            (
                s
                for s in kvedge
                if s.extra.get("kv_dtype") == "float32"
                and (s.weights, s.extra.get("variant"), s.extra.get("decode_matmuls"))
                == (spec.weights, spec.extra.get("variant"), spec.extra.get("decode_matmuls"))
            ),
            None,
        )
        if spec.extra.get("kv_dtype") == "int8" and twin is not None and contexts:
            case = f"decode:{contexts[-1]}"
            rows.append(
                _faster(results, f"int8 cache decode {contexts[-1]}", spec.name, twin.name, case, 1.0)
            )
    return rows


def _second_form_rows(results: Any, kvedge: list[SystemSpec], contexts: list[int]) -> list[dict[str, Any]]:
    """Each two-form export (decode matmuls "kvedge") against its one-form twin, the same export
    with "onnxruntime" decode matmuls: the decode speed its second copy of the weights buys, and
    that copy's bytes."""
    rows = []
    for spec in (s for s in kvedge if s.extra.get("decode_matmuls") == "kvedge"):
        same = (spec.weights, spec.extra.get("variant"), spec.extra.get("kv_dtype"), "onnxruntime")
        twin = next(
            (
                s
                for s in kvedge
                if (s.weights, s.extra.get("variant"), s.extra.get("kv_dtype"), s.extra.get("decode_matmuls"))
                == same
            ),
            None,
        )
        if twin is None:
            continue
        extra = f"+{(spec.artifact_bytes - twin.artifact_bytes) / MiB:.1f} MiB of files"
        for c in contexts:
            ratio = speedup(results, spec.name, twin.name, f"decode:{c}")
            rows.append(
                _target(f"second form decode {c}: {spec.name} vs {twin.name}", ratio, "report", None, extra)
            )
    return rows


def _llama_prefill_rows(
    results: Any, specs: list[SystemSpec], kvedge: list[SystemSpec], lengths: list[int]
) -> list[dict[str, Any]]:
    llama = next((s.name for s in specs if s.kind == "llama.cpp"), None)
    rows = []
    for spec in kvedge if llama else []:
        if spec.weights == "int4":
            for n in lengths:
                ratio = speedup(results, spec.name, llama, f"prefill:{n}")
                rows.append(
                    _target(f"prefill {n}: {spec.name} vs {llama}", ratio, "report (~2x expected)", None)
                )
    return rows


def _thread_rows(
    results: Any, again: list[SystemSpec], contexts: list[int], lengths: list[int]
) -> list[dict[str, Any]]:
    """Report rows: each system at another thread count against its first."""
    rows = []
    for spec in again:
        for case in ([f"prefill:{lengths[-1]}"] if lengths else []) + (
            [f"decode:{contexts[-1]}"] if contexts else []
        ):
            ratio = speedup(results, spec.name, spec.threads_of, case)
            what = case.replace(":", " ")
            rows.append(_target(f"threads: {spec.name} vs {spec.threads_of}, {what}", ratio, "report", None))
    return rows


def warm_targets(warm: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Target rows of the warm-prefix section, from `kvedge.bench.warm.measure_warm` figures."""
    rows: list[dict[str, Any]] = []
    for name, w in warm.items():
        ttft = w["ttft_speedup"]
        rows.append(
            _target(
                f"warm TTFT: {name}, {w['system_prompt_tokens']}-token system prompt + "
                f"{w['user_message_tokens']}-token message, cold / warm prefix",
                ttft,
                ">= 10",
                ttft >= 10,
                f"{w['ttft_cold_median_ms']:.0f} vs {w['ttft_warm_median_ms']:.0f} ms; "
                f"{w['new_tokens']} of {w['prompt_tokens']} tokens prefilled when warm",
            )
        )
        if "long_ttft_speedup" in w:
            rows.append(
                _target(
                    f"long TTFT: {name}, {w['long_prompt_tokens']}-token prompt, cold / warm prefix",
                    w["long_ttft_speedup"],
                    "report",
                    None,
                    f"{w['long_ttft_cold_median_ms']:.0f} vs {w['long_ttft_warm_median_ms']:.0f} ms; "
                    f"{w['long_new_tokens']} of {w['long_prompt_tokens']} tokens prefilled when warm",
                )
            )
        stage = w["warmup_speedup"]
        rows.append(
            _target(
                f"warm start-up: {name}, {w['warm_prefixes']} prefixes, recompute / load + verify",
                stage,
                ">= 20",
                stage >= 20,
                f"{np.median(w['warmup_recompute_s']):.2f} vs {np.median(w['warmup_load_s']):.3f} s",
            )
        )
        rows.append(
            _target(
                f"warm boot: {name}, Model() recomputing / loading {w['warm_prefixes']} prefixes",
                w["boot_speedup"],
                "report",
                None,
                f"{w['boot_recompute_s']:.2f} vs {w['boot_load_s']:.2f} s, graph loading included",
            )
        )
        first, last = w["turns"][0], w["turns"][-1]
        growth = w["turn_growth_reuse"]
        rows.append(
            _target(
                f"turn growth: {name}, reuse TTFT turn {last['turn']} / turn 1",
                growth,
                "<= 1.30",
                growth <= 1.30,
                f"full re-prefill {w['turn_growth_full']:.1f}x; conversation "
                f"{first['conversation_tokens']}->{last['conversation_tokens']} tokens, "
                f"new {first['new_tokens']}, {last['new_tokens']}",
            )
        )
    return rows


SPECULATION_GOALS = {"a-quote": 1.6, "b-rewrite": 1.6, "c-chat": 0.97}  # tokens/s ratio


def speculation_targets(speculation: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Target rows of the speculation section, from `kvedge.bench.speculate.measure_speculation`
    figures per system (or target + draft) and workload."""
    rows: list[dict[str, Any]] = []
    for name, workloads in speculation.items():
        for workload, f in workloads.items():
            goal = SPECULATION_GOALS.get(workload)
            met = None if goal is None else f["speedup"] >= goal and f["greedy_equal"]
            rows.append(
                _target(
                    f"speculation: {name}, {workload}, with / without",
                    f["speedup"],
                    "report" if goal is None else f">= {goal}",
                    met,
                    f"{f['tokens_per_call']:.2f} tokens/call, {100 * f['taken_share']:.0f}% of "
                    f"proposals taken, greedy equal: {f['greedy_equal']}",
                )
            )
    return rows


def format_target(row: dict[str, Any]) -> str:
    mark = {True: "MET ", False: "MISS", None: "    "}[row["met"]]
    value = "-" if row["value"] is None else f"{row['value']:.3f}"
    return f"{mark} {value:>8}  {row['goal']:<14} {row['target']} {row['note']}"


def table(results: Any) -> str:
    """Plain-text tables: per-system figures, then the targets."""
    lengths = sorted({n for v in results.prefill.values() for n in v})
    contexts = sorted({c for v in results.decode.values() for c in v})
    head = (
        ["system", "thr"]
        + [f"pf{n} tok/s" for n in lengths]
        + [f"TTFT{lengths[0]} ms" if lengths else "TTFT"]
        + [f"dec{c} ms" for c in contexts]
        + ["bound%", "files MiB", "RSS MiB", "KL", "top1"]
    )
    rows = [head]
    for system in results.systems:
        name = system["name"]
        none = "crashed" if system.get("crashed") else "-"  # a cell without a figure
        pf, dec = results.prefill.get(name, {}), results.decode.get(name, {})
        roof = results.roofline.get(name, {})
        mid = contexts[len(contexts) // 2] if contexts else None
        quality = results.quality.get(name, {})
        rows.append(
            [name, str(system["threads"])]
            + [f"{pf[n]['tokens_per_s']:.0f}" if n in pf else none for n in lengths]
            + [f"{pf[lengths[0]]['ttft_ms']:.0f}" if lengths and lengths[0] in pf else none]
            + [f"{dec[c]:.1f}" if c in dec else none for c in contexts]
            + [
                f"{100 * roof[mid]['fraction_of_bound']:.0f}" if mid in roof else none,
                f"{system['artifact_bytes'] / MiB:.1f}" if system.get("artifact_bytes") else "-",
                f"{results.memory[name]:.0f}" if name in results.memory else none,
                f"{quality['mean_kl']:.4f}" if quality else none,
                f"{quality['top1_agreement']:.3f}" if quality else none,
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    m = results.machine
    lines.append(
        f"copy bandwidth {m['copy_bandwidth_gb_s']:.1f} GB/s; bound% = roofline bound / measured at ctx "
        f"{contexts[len(contexts) // 2] if contexts else '-'}; "
        f"load average at start {m['load_average'][0]:.1f}; "
        f"CPU flags: {' '.join(m.get('cpu_flags', [])) or '-'}"
    )
    for name, where in results.crashed.items():
        lines.append(f"crashed: {name}, in {where}")
    for name, w in results.warm.items():
        reuse = " ".join(f"{t['ttft_reuse_ms']:.0f}" for t in w["turns"])
        full = " ".join(f"{t['ttft_full_ms']:.0f}" for t in w["turns"])
        long = (
            f"; {w['long_prompt_tokens']}-token prompt: cold {w['long_ttft_cold_median_ms']:.0f} ms, "
            f"warm {w['long_ttft_warm_median_ms']:.0f} ms"
            if "long_ttft_speedup" in w
            else ""
        )
        lines.append(
            f"warm prefixes, {name}: TTFT cold {w['ttft_cold_median_ms']:.0f} ms, warm "
            f"{w['ttft_warm_median_ms']:.0f} ms{long}; TTFT per turn, reuse: {reuse} ms; "
            f"full re-prefill: {full} ms"
        )
    lines.append("")
    lines.extend(format_target(t) for t in results.targets)
    return "\n".join(lines)


def plot(results: Any, path: Path) -> None:
    """ms/token vs context (left) and prefill tokens/s vs prompt length (right), one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for system in results.systems:
        if system["reference_for"]:
            continue
        name = system["name"]
        dec = results.decode.get(name, {})
        if dec:
            xs = sorted(dec)
            left.plot(xs, [dec[x] for x in xs], marker="o", label=name)
        pf = results.prefill.get(name, {})
        if pf:
            xs = sorted(pf)
            right.plot(xs, [pf[x]["tokens_per_s"] for x in xs], marker="o", label=name)
    left.set(
        xlabel="context (tokens), max_len 2048", ylabel="decode ms/token (lower is better)", title="Decode"
    )
    right.set(xlabel="prompt tokens", ylabel="prefill tokens/s (higher is better)", title="Prefill")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    m = results.machine
    fig.suptitle(
        f"{m['cpu']}, threads: {m['threads']}, batch 1 "
        f"(median of {results.config['rounds']} alternating rounds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
