"""`kvedge` command line: thin click commands over library functions."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from kvedge import __version__
from kvedge.errors import KvedgeError

log = logging.getLogger("kvedge")


def user_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a KvedgeError into one line on stderr and exit status 2, without a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KvedgeError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


def runtime_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by the commands that load a model and generate."""
    options = [
        click.option(
            "--model",
            "model_dir",
            required=True,
            type=click.Path(path_type=Path),
            help="Folder written by `kvedge export`.",
        ),
        click.option("--max-new-tokens", default=256, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float),
        click.option("--seed", default=None, type=int),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option(
            "--threads", default=None, type=int, help="onnxruntime intra-op threads (default: all cores)."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _sampling(kwargs: dict[str, Any]):
    from kvedge.runtime.generate import SamplingConfig

    return SamplingConfig(
        max_new_tokens=kwargs["max_new_tokens"],
        temperature=kwargs["temperature"],
        top_k=kwargs["top_k"],
        top_p=kwargs["top_p"],
        repetition_penalty=kwargs["repetition_penalty"],
        seed=kwargs["seed"],
        stop=tuple(kwargs["stop"]),
    )


def _print_stream(events: Iterator[Any]) -> Any:
    last = None
    for event in events:
        click.echo(event.text, nl=False)
        sys.stdout.flush()
        last = event
    click.echo()
    return last


@click.group()
@click.version_option(__version__)
@click.option("-v", "--verbose", count=True, help="-v: info logs, -vv: debug logs.")
def main(verbose: int) -> None:
    """kvedge: an edge LLM runtime with an exact, preallocated KV cache."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("source", required=False, type=click.Path(path_type=Path))
@click.option(
    "--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Artifact folder to write."
)
@click.option(
    "--max-len", default=2048, show_default=True, type=int, help="Cache length (tokens) per sequence."
)
@click.option(
    "--logits",
    type=click.Choice(["last", "all"]),
    default="last",
    show_default=True,
    help="Return logits for the last position only, or all.",
)
@click.option("--force", is_flag=True, help="Overwrite a non-empty output folder.")
@user_errors
def export(source: Path | None, out_dir: Path, max_len: int, logits: str, force: bool) -> None:
    """Export SOURCE (HF folder or GGUF file; default: SmolLM2-135M-Instruct) to ONNX."""
    from kvedge.export.export import ExportOptions, export_model

    options = ExportOptions(max_len=max_len, logits=logits, force=force)
    manifest = export_model(source, out_dir, options)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    click.echo(
        f"wrote {out_dir} ({size / 2**20:.1f} MiB): {manifest.architecture}, "
        f"{manifest.geometry.num_layers} layers, max_len {manifest.geometry.max_len}, "
        f"KV {manifest.geometry.bytes_per_slot() / 2**20:.1f} MiB per sequence"
    )


@main.command()
@click.argument("prompt")
@runtime_options
@click.option("--raw", is_flag=True, help="Send PROMPT as is, without the chat template.")
@user_errors
def generate(prompt: str, raw: bool, model_dir: Path, **kwargs: Any) -> None:
    """Answer PROMPT in one chat turn, streamed to stdout."""
    from kvedge.runtime.model import Model

    config = _sampling(kwargs)
    model = Model(model_dir, threads=kwargs["threads"])
    last = _print_stream(model.stream(prompt, config, raw=raw))
    log.info(
        "%d prompt + %d completion tokens, first token %.0f ms, %.1f tokens/s (%s)",
        last.prompt_tokens,
        last.completion_tokens,
        1000 * (last.time_to_first_token_s or 0),
        last.completion_tokens / max(last.seconds, 1e-9),
        last.finish_reason,
    )


@main.command()
@runtime_options
@click.option("--system", default=None, help="System prompt (default: the model template's own).")
@user_errors
def chat(model_dir: Path, system: str | None, **kwargs: Any) -> None:
    """Interactive multi-turn chat. /reset starts over, /exit quits."""
    from kvedge.runtime.model import Model

    config = _sampling(kwargs)
    model = Model(model_dir, threads=kwargs["threads"])
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ")
        except (EOFError, click.Abort):
            click.echo()
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(start)
            click.echo("(conversation reset)")
            continue
        messages.append({"role": "user", "content": line})
        click.echo("assistant> ", nl=False)
        reply = []
        for event in model.chat(messages, config):
            reply.append(event.text)
            click.echo(event.text, nl=False)
            sys.stdout.flush()
        click.echo()
        messages.append({"role": "assistant", "content": "".join(reply)})


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@user_errors
def info(model_dir: Path, as_json: bool) -> None:
    """Summarise an exported artifact folder."""
    from kvedge.contract import Manifest

    manifest = Manifest.load(model_dir)
    if as_json:
        click.echo(manifest.to_json())
        return
    g = manifest.geometry
    rows = [
        ("architecture", f"{manifest.architecture} ({manifest.model_type})"),
        ("source", manifest.source),
        ("fingerprint", manifest.source_fingerprint[:16]),
        (
            "cache",
            f"{g.num_layers} layers x {g.num_kv_heads} kv heads x {g.head_dim} dim, "
            f"max_len {g.max_len}, {g.dtype}",
        ),
        ("KV bytes", f"{g.bytes_per_token()} per token, {g.bytes_per_slot() / 2**20:.1f} MiB per sequence"),
        ("graph", f"opset {manifest.opset}, logits: {manifest.logits}"),
        ("names", f"{manifest.names.past_key} -> {manifest.names.present_key}"),
        ("eos ids", ", ".join(map(str, manifest.eos_token_ids))),
        (
            "rope",
            json.dumps(
                {"theta": manifest.rope.theta, "type": manifest.rope.rope_type, **manifest.rope.scaling}
            ),
        ),
        ("format", f"{manifest.format} v{manifest.format_version}, kvedge {manifest.kvedge_version}"),
    ]
    for key, value in rows:
        click.echo(f"{key:>12}  {value}")
