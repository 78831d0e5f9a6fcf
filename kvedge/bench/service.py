"""`kvedge serve` throughput: concurrent streams with batched decode vs one slot at a time.

    python bench/serve.py --model artifacts/smollm2-135m [--streams 4] [--tokens 128] [--rounds 3]
                          [--threads 1] [--json out.json]

First, in process: the cost of one `decode_one_token` call by batch size (slots 0..b-1 at ~40
tokens of context), which is what `kvedge.runtime.generate.MAX_IDLE_ROWS` is set from. Then for each
round and each mode (`batch_decode: true`, then false; the order flips every round) a
fresh server process is started on 127.0.0.1 with `slots = streams`, then:

- alone: one streaming request, greedy, `tokens` tokens at most;
- together: `streams` different streaming requests sent at once.

Aggregate tokens/s = completion tokens of all streams / (last stream's end - first request sent);
time to first token is measured at the client. Figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

TOPICS = ["a fox in the snow", "a robot in a warehouse", "a lighthouse keeper", "a trip to Mars"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, folder: Path, slots: int, threads: int, batch_decode: bool):
    port = free_port()
    config = folder / "service.yaml"
    config.write_text(
        yaml.safe_dump(
            {"model": str(model), "slots": slots, "threads": threads, "batch_decode": batch_decode}
        )
    )
    log = open(folder / f"server-{port}.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(
        [sys.executable, "-m", "kvedge", "serve", "--config", str(config), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {(folder / f'server-{port}.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit("server not ready after 120 s")


def stream(url: str, topic: str, tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = None
    usage = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return {"sent": sent, "first": first, "end": time.perf_counter(), "tokens": usage["completion_tokens"]}


def together(url: str, streams: int, tokens: int) -> dict:
    with ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(lambda i: stream(url, TOPICS[i % len(TOPICS)], tokens), range(streams)))
    seconds = max(r["end"] for r in runs) - min(r["sent"] for r in runs)
    total = sum(r["tokens"] for r in runs)
    return {
        "tokens": total,
        "tokens_per_s": total / seconds,
        "ttft_s": statistics.mean(r["first"] - r["sent"] for r in runs),
    }


def step_costs(model: Path, threads: int, batches=(1, 2, 4, 8), steps: int = 20) -> dict[int, float]:
    """Seconds per decode call over slots 0..b-1, each holding the same ~40-token prompt."""
    from kvedge.runtime.generate import decode_one_token, prefill
    from kvedge.runtime.model import Model

    m = Model(model, slots=max(batches), threads=threads)
    ids = m.tokenizer.encode_chat([{"role": "user", "content": f"Write a long story about {TOPICS[0]}."}])
    for slot in range(max(batches)):
        prefill(m.backend, m.cache, slot, [ids])
    costs = {}
    for batch in batches:
        for _ in range(3):  # bindings made, buffers planned
            decode_one_token(m.backend, m.cache, 0, [5] * batch)
        started = time.perf_counter()
        for _ in range(steps):
            decode_one_token(m.backend, m.cache, 0, [5] * batch)
        costs[batch] = (time.perf_counter() - started) / steps
        for slot in range(max(batches)):
            m.cache.truncate(slot, len(ids))
        print(f"decode call, batch {batch}: {costs[batch] * 1000:.1f} ms = {batch / costs[batch]:.1f} tok/s")
    return costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    costs = step_costs(args.model, args.threads)
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for batch in (True, False) if r % 2 == 0 else (False, True):
                mode = "batched" if batch else "one at a time"
                process, url = start_server(args.model, Path(folder), args.streams, args.threads, batch)
                try:
                    alone = together(url, 1, args.tokens)
                    both = together(url, args.streams, args.tokens)
                finally:
                    process.terminate()
                    process.wait(30)
                row = results.setdefault(mode, {})
                for key, value in (
                    ("alone_tokens_per_s", alone["tokens_per_s"]),
                    ("together_tokens_per_s", both["tokens_per_s"]),
                    ("together_ttft_s", both["ttft_s"]),
                    ("together_tokens", both["tokens"]),
                ):
                    row.setdefault(key, []).append(value)
                print(
                    f"round {r + 1} {mode}: alone {alone['tokens_per_s']:.1f} tok/s, {args.streams} "
                    f"streams {both['tokens_per_s']:.1f} tok/s ({both['tokens']} tokens), "
                    f"TTFT {both['ttft_s'] * 1000:.0f} ms",
                    flush=True,
                )
    summary = {mode: {k: statistics.median(v) for k, v in row.items()} for mode, row in results.items()}
    for mode, row in summary.items():
        print(
            f"median {mode}: alone {row['alone_tokens_per_s']:.1f} tok/s, {args.streams} streams "
            f"{row['together_tokens_per_s']:.1f} tok/s, TTFT {row['together_ttft_s'] * 1000:.0f} ms"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "decode_call_s": costs, **summary},
                indent=1,
            )
        )
