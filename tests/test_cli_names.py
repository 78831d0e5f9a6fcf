"""One name per concept: every option of every `kvedge` command and every service config key is
listed below with what it means, and a name used for two concepts, or a concept with two names,
fails. Old spellings are hidden options that must warn, naming the new one, and still work."""

from __future__ import annotations

import logging
from collections import defaultdict

import click
import pytest

from kvedge.cli import OLD_OPTIONS, main
from kvedge.serve.config import KEYS, RENAMED

# concept: (what it means, the service config key that holds it or None)
CONCEPTS = {
    "model": ("an export folder written by `kvedge export`", "model"),
    "out": ("where the command writes what it makes (a folder, or eval-kv's JSON file)", None),
    "force": ("replace what --out already holds", None),
    "no_memory_check": ("export: skip the memory preflight", None),
    "max_len": ("tokens one sequence's cache holds (export bakes it in; plan: the rows)", None),
    "logits": ("logits of the last position only, or all", None),
    "variant": ("graph form: portable (standard ops, TensorRT) or ort (onnxruntime fused)", None),
    "precision": ("the dtype the graph computes in", None),
    "weights": ("weight storage: float32, float16, int8, int4", None),
    "block_size": ("rows per quantization block of int8/int4 weights", None),
    "outlier_channels": ("input channels of each quantized matmul kept float32", None),
    "head_bits": ("bits of the quantized LM head", None),
    "decode_matmuls": ("what runs a decode step's quantized matmuls in ort graphs", None),
    "kv_dtype": ("KV cache dtype", None),
    "kv_group_size": ("INT8 cache: channels per scale per token", None),
    "kv_key8_layers": ("int4 cache: the layers whose keys keep 8-bit codes", None),
    "target": ("what export builds: onnx, or also a TensorRT engine", None),
    "max_prefill": ("TensorRT: longest prefill chunk", None),
    "max_batch": ("TensorRT: most sequences per call", None),
    "workspace": ("TensorRT: builder workspace limit", None),
    "max_new_tokens": ("longest reply of one CLI turn", None),
    "temperature": ("sampling temperature (0 = greedy)", "temperature"),
    "top_k": ("sampling: top-k (0 = off)", "top_k"),
    "top_p": ("sampling: nucleus probability", "top_p"),
    "repetition_penalty": ("sampling: repetition penalty", "repetition_penalty"),
    "seed": ("sampling seed", None),
    "stop": ("stop string", None),
    "threads": ("CPU threads a run uses", "threads"),
    "device": ("where the model runs: cpu, cuda (onnxruntime) or tensorrt", "device"),
    "history_policy": ("what to do when a conversation outgrows the cache", "history_policy"),
    "n_sink": ("window policy: tokens never evicted", "n_sink"),
    "warm_prefixes": ("warm-prefix YAML: fixed prompts whose KV is kept on disk", "warm_prefixes"),
    "warm_dir": ("folder of the warm prefix files", "warm_dir"),
    "raw": ("send the prompt without the chat template", None),
    "json_schema": ("constrain the answer to a JSON Schema file", None),
    "regex": ("constrain the answer to a regular expression", None),
    "grammar": ("constrain the answer to a Lark grammar file", None),
    "logprobs": ("log each token's log probability and the N most likely", None),
    "lenient_schemas": (
        "JSON schemas: ignore what the constraint library does not implement, read oneOf as anyOf",
        "lenient_schemas",
    ),
    "system": ("system prompt", None),
    "url": ("a running `kvedge serve` to talk to", None),
    "service_config": ("the service YAML (configs/services/)", None),
    "host": ("bind address", "host"),
    "port": ("TCP port", "port"),
    "slots": ("KV slots: sequences held at once", "slots"),
    "queue_size": ("requests that may wait for a slot", "queue_size"),
    "check": ("validate and load once, then exit", None),
    "print_systemd_unit": ("print a systemd unit and exit", None),
    "json": ("print the output as JSON", None),
    "profile": ("board profile (configs/devices/): a Jetson module's memory and our advice", None),
    "memory_budget": ("bytes the model may use", "memory_budget"),
    "reserve": ("bytes kept for the OS out of a profile's memory", None),
    "prompts": ("a prompt set file (.jsonl/.txt)", None),
    "method": ("calibration method", None),
    "percentile": ("calibration percentile", None),
    "scales": ("a scales folder from `kvedge calibrate`", None),
    "int8_model": ("an export of the same model with the INT8 cache", None),
    "weights_model": ("an export of the same model with int8/int4 weights", None),
    "llama_cpp": ("also compare llama.cpp's q8_0 and q4_0 caches", None),
    "contexts": ("eval-kv: the long documents at N tokens", None),
    "simulated": ("eval-kv: a per-token scheme simulated on the float32 cache", None),
    "limit": ("use the first N prompts", None),
    "tokens": ("teacher-forced continuation length", None),
    "work": ("bench: artifacts folder reused across runs", None),
    "source": ("the model to export: HF folder or GGUF", None),
    "rounds": ("bench: alternating rounds", None),
    "steps": ("bench: decode steps per case", None),
    "kvedge_systems": ("bench: kvedge systems to measure", None),
    "peer": ("bench: peer systems to compare", None),
    "no_peers": ("bench: kvedge systems only", None),
    "quick": ("bench: one round, no quality or memory runs", None),
    "warm": ("bench: systems that get the warm-prefix section", None),
    "no_warm": ("bench: same as --warm none", None),
    "verbose": ("log level", None),
    "version": ("print the version", None),
    # service config only
    "model_name": ("the id /v1/models reports", "model_name"),
    "api_key_env": ("environment variable holding the bearer key", "api_key_env"),
    "max_body_bytes": ("largest request body", "max_body_bytes"),
    "default_max_tokens": ("a request's max_tokens when it gives none", "default_max_tokens"),
    "max_reply_tokens": ("largest max_tokens a request may ask", "max_reply_tokens"),
    "max_prompt_tokens": ("longest conversation a request may send", "max_prompt_tokens"),
    "max_messages": ("most messages in a request", "max_messages"),
    "max_connections": ("open connections at once", "max_connections"),
    "allowed_hosts": ("Host header names accepted beside loopback names and IP addresses", "allowed_hosts"),
    "cors_origins": ("origins whose web pages may call the API", "cors_origins"),
    "header_timeout_s": ("seconds for a request head", "header_timeout_s"),
    "body_timeout_s": ("seconds for a request body", "body_timeout_s"),
    "reply_overflow": ("a reply that may not fit the context: reject or clip", "reply_overflow"),
    "batch_decode": ("decode all active slots in one call", "batch_decode"),
    "shutdown_grace_s": ("seconds streams get on SIGTERM", "shutdown_grace_s"),
    "warmup_tokens": ("greedy decode steps before ready", "warmup_tokens"),
    "prefix_cache_bytes": ("bytes of conversation prefixes kept in memory", "prefix_cache_bytes"),
    "prefix_dir": ("folder of run-time prefix files kept across restarts", "prefix_dir"),
    "prefix_disk_bytes": ("bytes of run-time prefix files on disk", "prefix_disk_bytes"),
    "prefix_disk_min_tokens": ("shortest run-time prefix written to disk", "prefix_disk_min_tokens"),
    "kv_memory": ("GPU devices: where the KV cache pool lives (mapped host or device memory)", "kv_memory"),
    "ui": ("serve the chat page at GET /", "ui"),
    "speculate": ("speculative decoding: off, prompt lookup or the draft model", "speculate"),
    "draft": ("an export with the same tokenizer whose proposals the model verifies", "draft"),
}

RUNTIME = {
    "--model": "model",
    "--max-new-tokens": "max_new_tokens",
    "--temperature": "temperature",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--repetition-penalty": "repetition_penalty",
    "--seed": "seed",
    "--stop": "stop",
    "--threads": "threads",
    "--device": "device",
    "--kv-memory": "kv_memory",
    "--history-policy": "history_policy",
    "--n-sink": "n_sink",
    "--warm-prefixes": "warm_prefixes",
    "--warm-dir": "warm_dir",
}
QUANTIZED = ("--block-size", "--outlier-channels", "--head-bits", "--decode-matmuls")
# command: {visible option: concept}
COMMANDS = {
    "": {"--verbose": "verbose", "--version": "version"},
    "export": {
        "--out": "out",
        "--max-len": "max_len",
        "--logits": "logits",
        "--force": "force",
        "--no-memory-check": "no_memory_check",
        "--variant": "variant",
        "--precision": "precision",
        "--weights": "weights",
        **{flag: flag[2:].replace("-", "_") for flag in QUANTIZED},
        "--kv-dtype": "kv_dtype",
        "--kv-group-size": "kv_group_size",
        "--kv-key8-layers": "kv_key8_layers",
        "--target": "target",
        "--max-prefill": "max_prefill",
        "--max-batch": "max_batch",
        "--workspace": "workspace",
    },
    "engine": {"--max-prefill": "max_prefill", "--max-batch": "max_batch", "--workspace": "workspace"},
    "generate": {
        **RUNTIME,
        "--raw": "raw",
        "--json-schema": "json_schema",
        "--lenient-schemas": "lenient_schemas",
        "--regex": "regex",
        "--grammar": "grammar",
        "--logprobs": "logprobs",
        "--speculate": "speculate",
        "--draft": "draft",
    },
    "chat": {**RUNTIME, "--system": "system", "--url": "url", "--speculate": "speculate", "--draft": "draft"},
    "warm-prefixes": {"--model": "model", "--warm-prefixes": "warm_prefixes", "--warm-dir": "warm_dir"},
    "prefixes": {},  # list and clear take --prefix-dir (prefix_dir)
    "serve": {
        "--config": "service_config",
        "--model": "model",
        "--host": "host",
        "--port": "port",
        "--slots": "slots",
        "--queue-size": "queue_size",
        "--threads": "threads",
        "--device": "device",
        "--ui": "ui",
        "--kv-memory": "kv_memory",
        "--check": "check",
        "--print-systemd-unit": "print_systemd_unit",
    },
    "info": {"--json": "json"},
    "plan": {
        "--profile": "profile",
        "--memory-budget": "memory_budget",
        "--reserve": "reserve",
        "--device": "device",
        "--kv-dtype": "kv_dtype",
        "--weights": "weights",
        "--variant": "variant",
        "--precision": "precision",
        **{flag: flag[2:].replace("-", "_") for flag in QUANTIZED},
        "--slots": "slots",
        "--max-len": "max_len",
        "--json": "json",
    },
    "doctor": {"--json": "json"},
    "calibrate": {
        "--model": "model",
        "--out": "out",
        "--prompts": "prompts",
        "--method": "method",
        "--kv-group-size": "kv_group_size",
        "--percentile": "percentile",
        "--kv-dtype": "kv_dtype",
        "--force": "force",
    },
    "eval-kv": {
        "--model": "model",
        "--scales": "scales",
        "--int8-model": "int8_model",
        "--weights-model": "weights_model",
        "--llama-cpp": "llama_cpp",
        "--threads": "threads",
        "--prompts": "prompts",
        "--limit": "limit",
        "--context": "contexts",
        "--simulate": "simulated",
        "--tokens": "tokens",
        "--out": "out",
    },
    "bench": {
        "--out": "out",
        "--work": "work",
        "--source": "source",
        "--threads": "threads",
        "--device": "device",
        "--rounds": "rounds",
        "--steps": "steps",
        "--kvedge": "kvedge_systems",
        "--peer": "peer",
        "--no-peers": "no_peers",
        "--quick": "quick",
        "--warm": "warm",
        "--no-warm": "no_warm",
    },
}
# (command, old spelling): (arguments that parse with it, new option, the value it must give the new one)
DEPRECATED = {
    ("generate", "--context-policy"): (
        ["x", "--model", "m", "--context-policy", "window"],
        "--history-policy",
        "window",
    ),
    ("generate", "--warmup"): (["x", "--model", "m", "--warmup", "w.yaml"], "--warm-prefixes", "w.yaml"),
    ("chat", "--context-policy"): (["--context-policy", "truncate"], "--history-policy", "truncate"),
    ("chat", "--warmup"): (["--warmup", "w.yaml"], "--warm-prefixes", "w.yaml"),
    ("warm-prefixes", "--config"): (
        ["--model", "m", "--warm-dir", "d", "--config", "w.yaml"],
        "--warm-prefixes",
        "w.yaml",
    ),
    ("plan", "--backend"): (["m", "--backend", "gpu"], "--device", "cuda"),
    ("plan", "--budget"): (["m", "--budget", "6GiB"], "--memory-budget", "6GiB"),
    ("plan", "--weights-dtype"): (["m", "--weights-dtype", "int8"], "--weights", "int8"),
    ("plan", "--context"): (["m", "--context", "1024"], "--max-len", "1024"),
    ("calibrate", "--group-size"): (
        ["--model", "m", "--out", "o", "--group-size", "16"],
        "--kv-group-size",
        "16",
    ),
    ("eval-kv", "--json"): (["--model", "m", "--json", "r.json"], "--out", "r.json"),
}


def commands() -> dict[str, click.Command]:
    """Every command by its path ("" for the group), hidden (deprecated) commands left out."""
    found = {"": main}
    found.update({name: cmd for name, cmd in main.commands.items() if not cmd.hidden})
    return found


def flag(param: click.Option) -> str:
    return max(param.opts, key=len)


def options(command: click.Command, hidden: bool) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and p.hidden == hidden]


def test_every_option_is_listed_with_its_concept():
    for name, command in commands().items():
        assert {flag(p) for p in options(command, hidden=False)} == set(COMMANDS.get(name, {})), name
        assert {(name, flag(p)) for p in options(command, hidden=True)} <= set(DEPRECATED), name
    assert set(COMMANDS) == set(commands())
    used = {c for table in COMMANDS.values() for c in table.values()}
    assert used | {c for c, (_, key) in CONCEPTS.items() if key} == set(CONCEPTS)  # no stale entries


def test_one_name_per_concept_and_one_concept_per_name():
    meanings, names = defaultdict(set), defaultdict(set)
    for table in COMMANDS.values():
        for option, concept in table.items():
            meanings[option].add(concept)
            names[concept].add(option)
    for concept, (_, key) in CONCEPTS.items():
        if key:
            meanings["--" + key.replace("_", "-")].add(concept)
            names[concept].add("--" + key.replace("_", "-"))
    assert {o: c for o, c in meanings.items() if len(c) > 1} == {}, "a name used for two concepts"
    assert {c: n for c, n in names.items() if len(n) > 1} == {}, "a concept with two names"


def test_every_service_config_key_is_listed():
    assert set(KEYS) == {key for _, key in CONCEPTS.values() if key}
    assert set(RENAMED.values()) <= set(KEYS) and not set(RENAMED) & set(KEYS)


def test_old_option_spellings_come_from_one_table():
    """Every hidden option is a row of `kvedge.cli.OLD_OPTIONS` (plan's --backend, whose values
    changed too, aside), and every row is checked below."""
    hidden = {(name, flag(p)) for name, command in commands().items() for p in options(command, hidden=True)}
    assert hidden == set(OLD_OPTIONS) | {("plan", "--backend")}
    assert {where: new for where, (_, new, _) in DEPRECATED.items() if where in OLD_OPTIONS} == OLD_OPTIONS


@pytest.mark.parametrize("where", sorted(DEPRECATED), ids="-".join)
def test_old_spellings_warn_and_still_work(where, caplog):
    command_name, old = where
    args, new, value = DEPRECATED[where]
    command = main.commands[command_name]
    with caplog.at_level(logging.WARNING, logger="kvedge"):
        ctx = command.make_context(command_name, list(args))
    assert any(old in r.message and "deprecated" in r.message and new in r.message for r in caplog.records)
    param = next(p for p in command.params if new in getattr(p, "opts", ()))
    given = ctx.meta.get(("old spelling", "device")) if old == "--backend" else ctx.params[param.name]
    assert str(given) == value


@pytest.mark.parametrize("where", sorted(w for w in DEPRECATED if w[1] != "--backend"), ids="-".join)
def test_the_new_spelling_gives_no_warning(where, caplog):
    """The hidden old option once shared its name with the new one, so `--memory-budget 1GiB`
    warned "--budget is deprecated; use --memory-budget", about the very flag given."""
    command_name, old = where
    args, new, value = DEPRECATED[where]
    command = main.commands[command_name]
    given = [new if arg == old else arg for arg in args]
    with caplog.at_level(logging.WARNING, logger="kvedge"):
        ctx = command.make_context(command_name, given)
    assert not [r.message for r in caplog.records if "deprecated" in r.message]
    param = next(p for p in command.params if new in getattr(p, "opts", ()))
    assert str(ctx.params[param.name]) == value  # (--backend's old values differ: not here)


def test_a_board_profile_given_as_plan_device_is_read_as_profile(caplog):
    plan = main.commands["plan"]
    with caplog.at_level(logging.WARNING, logger="kvedge"):
        ctx = plan.make_context("plan", ["m", "--device", "orin-nano-8gb"])
    assert ctx.params["profile"] == "orin-nano-8gb" and ctx.params["device"] is None
    assert "--device orin-nano-8gb (a board profile) is deprecated; use --profile" in caplog.text
    assert plan.make_context("plan", ["m", "--device", "tensorrt"]).params["device"] == "tensorrt"
    with pytest.raises(click.BadParameter, match="'npu' is not allowed; allowed: cpu, cuda, tensorrt"):
        plan.make_context("plan", ["m", "--device", "npu"])


def test_the_hidden_warmup_command_is_deprecated():
    assert main.commands["warmup"].hidden and "warm-prefixes" in main.commands["warmup"].deprecated
