"""Does a conversation survive a restart: turn 6's time to first token, three ways.

    python bench/restart.py --model artifacts/smollm2-135m [--rounds 3] [--threads 2] [--out DIR]

Each round runs real `kvedge serve` processes of one export on 127.0.0.1 (4 slots, greedy,
streamed) through a chat over a device log: a system prompt holding the log (1,000+ tokens of
history by turn 6), then questions with 32-token replies.

    warm     no restart: turns 1-5, then turn 6 on the same service
    restart  with prefix_dir (a fresh folder): turns 1-5, kill -9, a new service on that
             folder, turn 6 (its history read back from the files the first one wrote)
    cold     a new service without prefix files: turn 6, its whole history prefilled

Turn 6's TTFT (request sent to first content delta) for each; for the restarted service its
start-to-ready time (`kvedge_ready_seconds`), the tokens it reused and the bytes on disk
(/metrics), and whether its greedy reply is the warm service's (and the cold one's). The targets
(run-time prefixes on disk): restart within 1.5x of warm with the same reply, at least 5x faster
than cold, at a history of 1,000+ tokens. Writes restart.json and log.txt into
bench/results/<date>-<commit>-restart-cpu-t<threads>/ (`results_folder`), or `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvedge.bench.results import code_revision, results_folder
from kvedge.contract import Manifest
from kvedge.runtime.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

SLOTS = 4
REPLY_TOKENS = 32
READY_TIMEOUT_S = 600
DEVICE_LOG = "\n".join(
    f"12:{i // 60:02d}:{i % 60:02d} sensor-{i % 7} reading {i * 37 % 1000} ok; fan {i * 13 % 90}% "
    f"temp {40 + i % 30}C"
    for i in range(40)
)
QUESTIONS = (
    "Which sensor read highest?",
    "When was the fan fastest?",
    "Any temperature over 65C?",
    "Summarize the log in two lines.",
    "Which entries look odd?",
    "What should I check next?",
)
TARGETS = {"restart_over_warm": 1.5, "cold_over_restart": 5.0}  # at most, at least


class Service:
    """One `kvedge serve` process on a free port, ready (/health 200) when constructed."""

    def __init__(self, model: Path, threads: int, prefix_dir: Path | None, log_file: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = {
            "model": str(model),
            "slots": SLOTS,
            "threads": threads,
            "history_policy": "error",
            "prefix_dir": None if prefix_dir is None else str(prefix_dir),
        }
        folder = Path(tempfile.mkdtemp(prefix="kvedge-restart-"))
        (folder / "service.yaml").write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "kvedge", "-v", "serve", "--config", str(folder / "service.yaml")]
        with open(log_file, "a") as out:
            self.process = subprocess.Popen([*argv, "--port", str(self.port)], stdout=out, stderr=out)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=READY_TIMEOUT_S)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvedge serve did not become ready; see {log_file}")
            time.sleep(0.05)
        shutil.rmtree(folder)

    def _ready(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def turn(self, messages: list[dict[str, str]]) -> tuple[float, str]:
        """(seconds to the first content delta, the reply) of one streamed greedy turn."""
        body = {"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True}
        start, first, text = time.monotonic(), None, []
        with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    first = first or time.monotonic() - start
                    text.append(delta)
        if first is None:
            raise RuntimeError("the service streamed no content")
        return first, "".join(text)

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise RuntimeError(f"/metrics has no {name}")

    def kill(self) -> None:
        """kill -9, once the last turn's files are written (a turn's end queues them for the
        writer thread: a kill within those milliseconds would lose them): no chance to write
        anything more."""
        deadline = time.monotonic() + 60
        while self.metric("kvedge_prefix_disk_queued_bytes") and time.monotonic() < deadline:
            time.sleep(0.01)
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.http.close()


def chat(service: Service, turns: int) -> list[dict[str, str]]:
    """Turns 1..`turns` of the chat, then turn `turns` + 1's question (not yet sent)."""
    messages = [{"role": "system", "content": "You read this device log and answer briefly.\n" + DEVICE_LOG}]
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": service.turn(messages)[1]})
    return [*messages, {"role": "user", "content": QUESTIONS[turns]}]


def one_round(model: Path, threads: int, work: Path, log_file: Path) -> dict[str, Any]:
    """Turn 6's TTFT warm, after a kill -9 and restart, and cold (module docstring), and how
    many tokens its prompt holds."""
    found: dict[str, Any] = {}
    warm = Service(model, threads, None, log_file)
    try:
        messages = chat(warm, 5)
        found["warm_s"], warm_reply = warm.turn(messages)
    finally:
        warm.stop()
    prefixes = work / "prefixes"
    shutil.rmtree(prefixes, ignore_errors=True)
    first = Service(model, threads, prefixes, log_file)
    try:
        messages = chat(first, 5)
        first.kill()
    finally:
        first.stop()
    found["history_tokens"] = len(ChatTokenizer(model, Manifest.load(model)).encode_chat(messages))
    restarted = Service(model, threads, prefixes, log_file)
    try:
        found["restart_s"], restart_reply = restarted.turn(messages)
        found["ready_s"] = restarted.metric("kvedge_ready_seconds")
        found["reused_tokens"] = restarted.metric("kvedge_prefix_cache_hit_tokens_total")
        found["disk_bytes"] = restarted.metric("kvedge_prefix_disk_bytes")
    finally:
        restarted.stop()
    cold = Service(model, threads, None, log_file)
    try:
        found["cold_s"], cold_reply = cold.turn(messages)
    finally:
        cold.stop()
    found["same_reply"] = {"restart": restart_reply == warm_reply, "cold": cold_reply == warm_reply}
    return found


def main(argv: list[str] | None = None) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model", type=Path, required=True, help="an export folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: a new dated one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    out = args.out or results_folder("restart-cpu", [args.threads])
    out.mkdir(parents=True)
    log_file = out / "log.txt"
    manifest = Manifest.load(args.model)
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.rounds):
            rounds.append(one_round(args.model, args.threads, Path(work), log_file))
            log.info("round %d: %s", i + 1, rounds[-1])
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "same_reply"}
    ratios = {
        "restart_over_warm": median["restart_s"] / median["warm_s"],
        "cold_over_restart": median["cold_s"] / median["restart_s"],
    }
    report = {
        "what": "turn 6's TTFT: warm, after kill -9 and restart (prefix_dir), cold",
        "code": code_revision(),
        "model": str(args.model),
        "model_fingerprint": manifest.source_fingerprint,
        "threads": args.threads,
        "slots": SLOTS,
        "history_tokens": median["history_tokens"],
        "cpu_count": os.cpu_count(),
        "rounds": rounds,
        "median": median,
        "ratios": ratios,
        "targets": TARGETS,
        "met": {
            "restart_over_warm": ratios["restart_over_warm"] <= TARGETS["restart_over_warm"],
            "cold_over_restart": ratios["cold_over_restart"] >= TARGETS["cold_over_restart"],
            "same_reply_after_restart": all(r["same_reply"]["restart"] for r in rounds),
        },
    }
    (out / "restart.json").write_text(json.dumps(report, indent=2))
    log.info("medians %s; ratios %s -> %s", median, ratios, out)
