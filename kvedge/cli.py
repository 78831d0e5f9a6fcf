"""`kvedge` command line: thin click commands over library functions."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import getpass
import json
import logging
import os
import select
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvedge import __version__
from kvedge.contract import PREFILL_CHUNK, WEIGHT_FORM_KEYS, CacheGeometry, ExportRecipe, Manifest
from kvedge.contract.engine import DEVICES
from kvedge.declare import click_options, from_values
from kvedge.errors import KvedgeError
from kvedge.files import human
from kvedge.runtime.speculate import SPECULATE_MODES, legacy_draft

if TYPE_CHECKING:
    from kvedge.runtime.generate import Event

log = logging.getLogger("kvedge")


# Import names that are not their distribution's name (the others are, with "_" read as "-").
DISTRIBUTIONS = {"llama_cpp": "llama-cpp-python", "tensorrt_rtx": "tensorrt-rtx-cu12", "cuda": "cuda-python"}


def missing_package(module: str) -> KvedgeError:
    """The one line for an optional package `module` that is not installed: which of kvedge's
    extras brings it (as setup.cfg declares them, read from the installed metadata)."""
    import importlib.metadata
    import re

    top = module.split(".")[0]
    distribution = DISTRIBUTIONS.get(top, top).replace("_", "-").lower()
    try:
        requirements = importlib.metadata.requires("kvedge") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        requirements = []
    extras = []
    for requirement in requirements:
        found = re.match(r"([A-Za-z0-9_.-]+).*\bextra\s*==\s*[\'\"]([^\'\"]+)", requirement)
        if found and found[1].replace("_", "-").lower() == distribution and found[2] != "dev":
            extras.append(found[2])
    if not extras:
        return KvedgeError(f"this command needs {top}, which is not installed: pip install {distribution}")
    others = ", ".join(f"kvedge[{extra}]" for extra in extras[1:])
    also = f"; also in {others}" if others else ""
    return KvedgeError(
        f"this command needs the {extras[0]} extra ({top} is not installed): "
        f"pip install 'kvedge[{extras[0]}]'{also}"
    )


def require(*modules: str) -> None:
    """Refuse at once, naming the extra, a command that will need `modules` late in its run."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise missing_package(module)


def starting(what: str) -> None:
    """A long command's first line, on stderr at once: imports and loading take seconds, the
    work minutes, and silence reads as a hang."""
    click.echo(f"kvedge: {what} ...", err=True)


def user_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a KvedgeError, a missing optional package, or a file this user may not read or write,
    into one line on stderr and exit status 1, without a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KvedgeError as exc:
            raise click.ClickException(str(exc)) from None
        except ModuleNotFoundError as exc:  # an optional package; kvedge's own modules are a bug
            if exc.name is None or exc.name.split(".")[0] == "kvedge":
                raise
            raise click.ClickException(str(missing_package(exc.name))) from None
        except PermissionError as exc:  # typically the service user and files another user made
            raise click.ClickException(
                f"{exc.filename}: {exc.strerror} for user {getpass.getuser()} "
                "(docs/JETSON.md, 'The service': what the service user must be able to read)"
            ) from None

    return wrapper


def choice_option(flag: str, choices: Sequence[str], default: str, help: str) -> Any:
    """`--flag` taking one of `choices`, showing its default in --help."""
    return click.option(flag, type=click.Choice(list(choices)), default=default, show_default=True, help=help)


# Former option names, one table for every command: (command, old flag) -> the flag that replaced
# it. Each still works, warning once and naming the new flag (`add_old_spellings`); config files'
# former keys are `kvedge.configs.RENAMED`. plan's --backend and a board profile given
# as plan's --device changed values as well as names: `_plan_backend`, `_plan_device`.
OLD_OPTIONS = {
    ("generate", "--context-policy"): "--history-policy",
    ("generate", "--warmup"): "--warm-prefixes",
    ("chat", "--context-policy"): "--history-policy",
    ("chat", "--warmup"): "--warm-prefixes",
    ("warm-prefixes", "--config"): "--warm-prefixes",
    ("plan", "--budget"): "--memory-budget",
    ("plan", "--weights-dtype"): "--weights",
    ("plan", "--context"): "--max-len",
    ("calibrate", "--group-size"): "--kv-group-size",
    ("eval-kv", "--json"): "--out",
}


def old_spelling(old: str, new: str, dest: str, type: Any = None) -> click.Option:
    """A hidden option `old`, the former name of `new`, kept for scripts that still use it: it warns
    naming `new`, and `new`'s option (with `callback=or_old_spelling`) takes its value unless given."""

    def store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            log.warning("%s is deprecated; use %s", old, new)
            ctx.meta[("old spelling", dest)] = value

    # a name of its own: sharing `dest` with `new`'s option, it was handed `new`'s value and warned
    # about the very flag given
    return click.Option(
        [old, f"old_spelling_{dest}"], type=type, hidden=True, expose_value=False, callback=store
    )


def add_old_spellings(group: click.Group, table: dict[tuple[str, str], str]) -> None:
    """Give each command of `table` a hidden option per old flag, typed as the new flag's option,
    which then takes the old flag's value unless given itself (`or_old_spelling`)."""
    for (name, old), new in table.items():
        command = group.commands[name]
        option = next(p for p in command.params if isinstance(p, click.Option) and new in p.opts)
        if option.callback is None:
            option.callback = or_old_spelling
        command.params.append(old_spelling(old, new, option.name, type=option.type))


def or_old_spelling(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    # Options given on the command line are processed before defaulted ones, so `store` has run.
    if ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
        return ctx.meta.get(("old spelling", param.name), value)
    return value


def required_or_old_spelling(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """`or_old_spelling` for a required option (click's `required` would refuse the old spelling)."""
    value = or_old_spelling(ctx, param, value)
    if value is None:
        raise click.MissingParameter(ctx=ctx, param=param)
    return value


model_option = click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder written by `kvedge export`.",
)


def run_options(keys: Sequence[str], **changes: dict[str, Any]) -> Callable[..., Any]:
    """The options `keys` of `RunOptions` (`kvedge.declare.click_options`)."""
    from kvedge.runtime.options import RunOptions

    return click_options(RunOptions, keys, **changes)


def service_options(keys: Sequence[str]) -> Callable[..., Any]:
    """The service's keys `keys` as flags; one not given leaves the config file's value."""
    from kvedge.serve.config import ServiceConfig

    return click_options(ServiceConfig, keys, unset=True)


# the service's keys `kvedge serve` takes as flags (every key is one of its --config file)
SERVICE_FLAGS = ("model", "host", "port", "slots", "queue_size", "threads", "device", "ui", "kv_memory")


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The TensorRT engine's build options, shared by `export --target tensorrt` and `engine`."""
    options = [
        click.option(
            "--max-prefill",
            default=PREFILL_CHUNK,
            show_default=True,
            type=int,
            help="TensorRT engine: longest prefill chunk.",
        ),
        click.option(
            "--max-batch",
            default=1,
            show_default=True,
            type=int,
            help="TensorRT engine: most sequences per call (a service's slots, for their replies to "
            "share calls).",
        ),
        click.option(
            "--workspace", default="1GiB", show_default=True, help="TensorRT engine: builder workspace limit."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _speculate_mode(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--speculate as given (None: "draft" with --draft, else "off"); the retired "draft:DIR" is
    kept for `_speculation`, which reads it."""
    if value is None or value in SPECULATE_MODES:
        return value
    try:
        if legacy_draft(value) is not None:
            return value
    except KvedgeError:
        pass
    raise click.BadParameter(f"{value!r} is not allowed; allowed: {', '.join(SPECULATE_MODES)}")


def _speculation(kwargs: dict[str, Any], remote: bool = False) -> tuple[str, Path | None]:
    """(the turns' speculate mode, the draft folder to load with the model) from --speculate and
    --draft: --draft alone speculates with it; the retired --speculate draft:DIR still works,
    with a warning. Both are written back to `kwargs`, so a second call reads them resolved.
    `remote` (chat --url): "draft" is the service's draft, and none is loaded here."""
    mode, draft = kwargs["speculate"], kwargs["draft"]
    if remote and (draft is not None or legacy_draft(mode) is not None):
        raise click.UsageError(
            "with --url the service's draft proposes (--speculate draft); --draft loads one here"
        )
    if remote:  # `chat` sends --speculate where given (RemoteChat.speculate)
        return mode or "off", None
    if (old := legacy_draft(mode)) is not None:
        log.warning("--speculate draft:DIR is deprecated; use --draft %s", old)
        if draft is not None and draft != old:
            raise click.UsageError(f"--speculate {mode} and --draft {draft} name two drafts; give --draft")
        mode, draft = "draft", old
    if mode is None:
        mode = "draft" if draft is not None else "off"
    if mode == "draft" and draft is None:
        raise click.UsageError("--speculate draft needs the draft's export: --draft DIR")
    kwargs["speculate"], kwargs["draft"] = mode, draft
    return mode, draft


# the options of the commands that load a model and generate: how a reply is sampled, then how
# the model runs
REPLY_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "stop",
    "speculate",
)
RUN_KEYS = (
    "draft",
    "threads",
    "device",
    "kv_memory",
    "history_policy",
    "n_sink",
    "warm_prefixes",
    "warm_dir",
)


def runtime_options(func: Callable[..., Any] | None = None, *, model_required: bool = True) -> Any:
    """Options shared by the commands that load a model and generate."""
    from kvedge.runtime.generate import SamplingConfig

    if func is None:
        return functools.partial(runtime_options, model_required=model_required)
    # a string: the retired "draft:DIR" is read by `_speculate_mode`
    speculate = {
        "default": None,
        "type": click.STRING,
        "callback": _speculate_mode,
        "metavar": "|".join(SPECULATE_MODES),
    }
    func = run_options(RUN_KEYS)(func)
    func = click_options(SamplingConfig, REPLY_KEYS, speculate=speculate)(func)
    return click.option(
        "--model",
        "model_dir",
        required=model_required,
        type=click.Path(path_type=Path),
        help="Folder written by `kvedge export`.",
    )(func)


def _sampling(kwargs: dict[str, Any], remote: bool = False):
    from kvedge.runtime.generate import SamplingConfig

    return from_values(SamplingConfig, kwargs, speculate=_speculation(kwargs, remote)[0])


def _load_model(model_dir: Path, kwargs: dict[str, Any]):
    """The model the runtime flags (`runtime_options`) and --draft name."""
    from kvedge.runtime.model import Model
    from kvedge.runtime.options import RunOptions

    return Model(model_dir, from_values(RunOptions, kwargs, draft=_speculation(kwargs)[1]))


def _print_stream(events: Iterator[Any], logprob_tokenizer: Any = None) -> list[Any]:
    """Echo the events' text (with a tokenizer, each token's log probabilities to stderr too);
    return the events."""
    seen = []
    for event in events:
        click.echo(event.text, nl=False)
        sys.stdout.flush()
        if logprob_tokenizer is not None and event.logprob is not None:
            best = ", ".join(f"{logprob_tokenizer.decode([t])!r} {p:.3f}" for t, p in event.top_logprobs)
            token = logprob_tokenizer.decode([event.token])
            click.echo(f"\n  [{token!r} {event.logprob:.3f}; top: {best}]", err=True)
        seen.append(event)
    click.echo()
    return seen


class BarSafeHandler(logging.StreamHandler):
    """Log lines on stderr that never continue a progress bar's line. On a terminal they go through
    `tqdm.write`, which clears the open bars, writes the line and redraws them. On a pipe (the
    journal, which splits records at newlines only) a bar ends each update with \\r, not a newline,
    and clearing it the same way would leave the bar and the log line in one record: there the
    bar's line is ended with a newline first, and the bar goes on below at its next update."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm  # here, not at the top: `kvedge --help` need not load it

        try:
            message = self.format(record)
            if self.stream.isatty():
                tqdm.write(message, file=self.stream)
            else:
                with tqdm.get_lock():
                    open_bars = [  # as tqdm.write finds the bars it clears
                        bar for bar in tqdm._instances if hasattr(bar, "start_t") and bar.fp == self.stream
                    ]
                    self.stream.write(("\n" if open_bars else "") + message + "\n")
            self.flush()
        except Exception:
            self.handleError(record)


@click.group()
@click.version_option(__version__)
@click.option("-v", "--verbose", count=True, help="-v: info logs, -vv: debug logs.")
def main(verbose: int) -> None:
    """kvedge: an edge LLM runtime with an exact, preallocated KV cache."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", handlers=[BarSafeHandler()]
    )


@main.command()
@click.argument("source", required=False, type=click.Path(path_type=Path))
@click.option(
    "--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Artifact folder to write."
)
@click.option("--force", is_flag=True, help="Overwrite a non-empty output folder.")
@click.option(
    "--no-memory-check",
    "no_memory_check",
    is_flag=True,
    help="Export even where the memory preflight finds less memory available than the export "
    "certainly holds at once (the float32 model and its weights).",
)
@click_options(ExportRecipe)
@choice_option(
    "--target",
    ["onnx", "tensorrt"],
    "onnx",
    "tensorrt: also build model.engine from the ONNX graph (TensorRT and a GPU; or, to check it "
    "builds, TensorRT for RTX without a GPU: kvedge[trtcheck]).",
)
@engine_options
@user_errors
def export(
    source: Path | None,
    out_dir: Path,
    force: bool,
    no_memory_check: bool,
    target: str,
    max_prefill: int,
    max_batch: int,
    workspace: str,
    **recipe_values: Any,
) -> None:
    """Export SOURCE (HF folder or GGUF file; default: SmolLM2-135M-Instruct) to ONNX."""
    starting(f"exporting {source or 'the default model (SmolLM2-135M-Instruct)'} to {out_dir}")
    from kvedge.export.export import export_model

    recipe = from_values(ExportRecipe, recipe_values)
    if target == "tensorrt":  # fail before the slow ONNX export, not after it
        from kvedge.export.tensorrt import require_tensorrt

        require_tensorrt(recipe.variant, recipe.logits)
    manifest = export_model(source, out_dir, recipe, force=force, memory_check=not no_memory_check)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    click.echo(
        f"wrote {out_dir} ({size / 2**20:.1f} MiB): {manifest.architecture}, "
        f"{manifest.variant} {manifest.precision} graph, {manifest.weights_dtype} weights, "
        f"{manifest.geometry.num_layers} layers, max_len {manifest.geometry.max_len}, "
        f"{manifest.geometry.dtype} cache, "
        f"KV {manifest.geometry.bytes_per_slot() / 2**20:.1f} MiB per sequence"
    )
    if target == "tensorrt":
        _build_engine(out_dir, max_prefill, max_batch, workspace)


@main.command()
@click.argument("folder", type=click.Path(path_type=Path))
@engine_options
@user_errors
def engine(folder: Path, max_prefill: int, max_batch: int, workspace: str) -> None:
    """Build FOLDER's TensorRT engine (model.engine) on this machine from the export in FOLDER:
    what `export --target tensorrt` builds, for a folder exported elsewhere (an engine is made
    for one GPU and TensorRT: build it on the device that runs it)."""
    starting(f"building a TensorRT engine from {folder} (minutes on a Jetson)")
    _build_engine(folder, max_prefill, max_batch, workspace)


def _build_engine(folder: Path, max_prefill: int, max_batch: int, workspace: str) -> None:
    from kvedge.export.tensorrt import build_engine
    from kvedge.planner import parse_bytes

    built = build_engine(folder, folder, max_prefill, parse_bytes(workspace), max_batch=max_batch)
    click.echo(f"built {folder}/model.engine: {built.built_with}, {built.gpu.describe()}")


def _constraint(json_schema: Path | None, regex: str | None, grammar: Path | None, lenient: bool = False):
    """The output constraint the options ask for, or None; at most one may be given."""
    from kvedge.runtime.constrain import Constraint

    given = [
        (name, value)
        for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
        if value
    ]
    if len(given) > 1:
        raise KvedgeError(
            f"give at most one of --json-schema, --regex, --grammar (got {', '.join(n for n, _ in given)})"
        )
    if lenient and json_schema is None:
        raise KvedgeError("--lenient-schemas applies to --json-schema; give one or drop it")
    if json_schema is not None:
        return Constraint("json_schema", _read_text(json_schema, "--json-schema"), lenient)
    if grammar is not None:
        return Constraint("lark", _read_text(grammar, "--grammar"))
    return Constraint("regex", regex) if regex else None


def _read_text(path: Path, option: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise KvedgeError(f"{option} {path}: cannot read it ({exc.strerror})") from None


@main.command()
@click.argument("prompt")
@runtime_options
@click.option("--raw", is_flag=True, help="Send PROMPT as is, without the chat template.")
@click.option(
    "--json-schema",
    type=click.Path(path_type=Path),
    default=None,
    help="The answer is JSON valid against this JSON Schema file.",
)
@click.option(
    "--lenient-schemas",
    is_flag=True,
    help="--json-schema: ignore what the constraint library does not implement and read an "
    "overlapping oneOf as anyOf (the answer may then break those parts).",
)
@click.option("--regex", default=None, help="The answer matches this regular expression.")
@click.option(
    "--grammar",
    type=click.Path(path_type=Path),
    default=None,
    help="The answer follows this Lark grammar file.",
)
@click.option(
    "--logprobs",
    type=int,
    default=None,
    help="Log each token's log probability and the N most likely (0-20).",
)
@user_errors
def generate(
    prompt: str,
    raw: bool,
    json_schema: Path | None,
    lenient_schemas: bool,
    regex: str | None,
    grammar: Path | None,
    logprobs: int | None,
    model_dir: Path,
    **kwargs: Any,
) -> None:
    """Answer PROMPT in one chat turn, streamed to stdout. A reply cut short by --max-new-tokens
    or the context is said so on stderr; with --json-schema, --regex or --grammar, an output cut
    before the constraint is complete exits with status 1."""
    if not prompt:
        raise KvedgeError("PROMPT is empty; give the text to answer (a non-empty argument)")
    constraint = _constraint(json_schema, regex, grammar, lenient_schemas)
    config = dataclasses.replace(_sampling(kwargs), constraint=constraint, logprobs=logprobs)
    model = _load_model(model_dir, kwargs)
    if constraint is not None and (ignored := model.grammars.compile(constraint).ignored):
        log.warning("the schema's %s: not enforced", ", ".join(ignored))
    events = _print_stream(
        model.stream(prompt, config, raw=raw), model.tokenizer if logprobs is not None else None
    )
    last = events[-1]
    log.info(
        "%d prompt + %d completion tokens, first token %.0f ms, %.1f tokens/s (%s)",
        last.prompt_tokens,
        last.completion_tokens,
        1000 * (last.time_to_first_token_s or 0),
        last.completion_tokens / max(last.seconds, 1e-9),
        last.finish_reason,
    )
    cut = _cut(last, config.max_new_tokens, model.manifest.geometry.max_len)
    if cut is None:
        return
    tokens = [e.token for e in events if e.token is not None]
    if constraint is not None and not model.grammars.accepts(constraint, tokens):
        option = "--json-schema" if json_schema else "--regex" if regex else "--grammar"
        raise KvedgeError(f"{cut}, before the output was complete: it does not satisfy {option}")
    click.echo(f"kvedge: {cut}", err=True)


def _cut(last: Event, max_new_tokens: int, max_len: int | None) -> str | None:
    """Why the reply that `last` ended was cut short, or None if it was not."""
    if last.finish_reason != "length":
        return None
    # Turn.sample checks max_new_tokens before room: a reply that reached it was cut by it
    if last.completion_tokens >= max_new_tokens:
        return f"the reply was cut at --max-new-tokens {max_new_tokens}"
    context = "the context" if max_len is None else f"the model's context ({max_len} tokens)"
    return f"the reply was cut after {last.completion_tokens} tokens: {context} is full"


# (conversation, stop) -> the reply's events; `stop` is asked between steps and ends the reply
Answer = Callable[[Sequence[dict[str, str]], Callable[[], bool]], Iterator[Any]]


@main.command()
@runtime_options(model_required=False)
@click.option("--system", default=None, help="System prompt (default: the model template's own).")
@click.option("--url", default=None, help="Talk to a running `kvedge serve` (e.g. http://127.0.0.1:8000).")
@user_errors
def chat(model_dir: Path | None, system: str | None, url: str | None, **kwargs: Any) -> None:
    """Interactive multi-turn chat. /reset starts over, /exit quits. Ctrl-C stops a reply (what
    it wrote stays in the conversation); at the prompt, or twice during a reply, it quits."""
    config = _sampling(kwargs, remote=url is not None)
    if url is not None:
        from kvedge.serve.client import RemoteChat

        answer: Answer = RemoteChat(url, config, speculate=kwargs["speculate"]).events
        max_len = None
    elif model_dir is None:
        raise click.UsageError("give --model DIR, or --url of a running `kvedge serve`")
    else:
        model = _load_model(model_dir, kwargs)
        answer, max_len = _local_answer(model, config), model.manifest.geometry.max_len
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    read_line = _terminal_line if sys.stdin.isatty() else _PipeLines(sys.stdin).read
    while True:
        try:
            line = read_line()
        except (EOFError, KeyboardInterrupt, click.Abort):
            click.echo()
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(start)
            click.echo("(conversation reset)")
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _chat_turn(answer, messages, config.max_new_tokens, max_len)
        except KeyboardInterrupt:  # Ctrl-C twice before the reply stopped
            click.echo()
            return
        messages.append({"role": "assistant", "content": reply})


def _terminal_line() -> str:
    """The user's next line from a terminal: click.prompt (and input()'s line editing)."""
    return click.prompt("you", prompt_suffix="> ")


class _PipeLines:
    """The user's lines from a pipe (a program driving `kvedge chat`), each after a "you> "
    prompt; blank lines are skipped, as click.prompt does on a terminal.

    input() would write the prompt and then block in read(2); a SIGINT that lands between the two
    (a driver that sends it as soon as it sees the prompt, on a loaded machine) only sets Python's
    flag, and its KeyboardInterrupt would wait for the next line. Here the wait is a loop of short
    select() calls, between which Python runs the handler: Ctrl-C at the prompt always quits."""

    POLL_S = 0.1

    def __init__(self, stream: Any) -> None:
        self._fd = stream.fileno()
        self._encoding = stream.encoding or "utf-8"
        self._pending = b""
        self._closed = False

    def read(self) -> str:
        while True:
            click.echo("you> ", nl=False)
            line = self._next_line()
            click.echo()  # a terminal echoes the typed line and its newline; a pipe does not
            if line.strip():
                return line

    def _next_line(self) -> str:
        while b"\n" not in self._pending and not self._closed:
            if select.select([self._fd], [], [], self.POLL_S)[0]:
                chunk = os.read(self._fd, 65536)
                self._pending += chunk
                self._closed = not chunk
        if not self._pending:
            raise EOFError
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(self._encoding, errors="replace").removesuffix("\r")


def _local_answer(model: Any, config: Any) -> Answer:
    def answer(messages: Sequence[dict[str, str]], stop: Callable[[], bool]) -> Iterator[Any]:
        events = model.chat(messages, config, stop=stop)  # begins the turn: the slot is reused now
        log.info("chat: %d tokens of the conversation reused from the cache", model.sessions[0].reused_tokens)
        return events

    return answer


def _chat_turn(
    answer: Answer, messages: Sequence[dict[str, str]], max_new_tokens: int, max_len: int | None
) -> str:
    """Stream one reply to stdout and return its text: all of it, or what was shown when Ctrl-C
    stopped it (`ctrl_c_stops`), which the conversation keeps (the model's slot keeps its tokens,
    as the service's does when a client disconnects)."""
    click.echo("assistant> ", nl=False)
    reply, last = [], None
    with ctrl_c_stops() as stopped, contextlib.closing(answer(messages, stopped)) as events:
        for event in events:
            reply.append(event.text)
            click.echo(event.text, nl=False)
            sys.stdout.flush()
            last = event
    click.echo()
    if last is None or last.finish_reason is None:  # Ctrl-C stopped it before its end
        log.info("chat: reply stopped after %d tokens", len(reply))
        click.echo("(stopped: the reply so far stays in the conversation)", err=True)
    else:
        log.info(
            "chat: %d prompt + %d reply tokens (%s)",
            last.prompt_tokens,
            last.completion_tokens,
            last.finish_reason,
        )
        cut = _cut(last, max_new_tokens, max_len)
        if cut is not None:
            click.echo(f"kvedge: {cut}", err=True)
    return "".join(reply)


@contextlib.contextmanager
def ctrl_c_stops() -> Iterator[Callable[[], bool]]:
    """While a reply streams, the first Ctrl-C (SIGINT) only asks it to stop: the runtime and the
    remote client ask the returned function between steps, so the reply ends at a step boundary
    and never in the middle of a cache write (a KeyboardInterrupt could land anywhere). A second
    Ctrl-C before it stopped raises KeyboardInterrupt: the user wants out."""
    pressed = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal pressed
        if pressed:
            raise KeyboardInterrupt
        pressed = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: pressed
    finally:
        signal.signal(signal.SIGINT, previous)


@main.command("warm-prefixes")
@model_option
@run_options(
    ("warm_prefixes", "warm_dir"),
    warm_prefixes={"callback": required_or_old_spelling},
    warm_dir={"required": True},
)
@user_errors
def warm_prefixes_command(model_dir: Path, **run_values: Any) -> None:
    """Compute (or verify) the KV of the fixed prompts in --warm-prefixes and store them in
    --warm-dir."""
    warm_dir = run_values["warm_dir"]
    starting(f"loading {model_dir}, then the warm prefixes of {run_values['warm_prefixes']} in {warm_dir}")
    from kvedge.runtime.model import Model
    from kvedge.runtime.options import RunOptions

    model = Model(model_dir, from_values(RunOptions, run_values))
    report = model.prefixes.warm_report
    for prefix in model.prefixes.warm.prefixes:
        state = f"recomputed ({report.rebuilt[prefix.name]})" if prefix.name in report.rebuilt else "loaded"
        click.echo(f"{prefix.name}: {len(prefix.token_ids)} tokens, {prefix.nbytes / 2**20:.2f} MiB, {state}")
    if report.unwritten:  # this command's job is the files; the service would serve from memory
        names = ", ".join(f"{name} ({why})" for name, why in report.unwritten.items())
        raise KvedgeError(f"{warm_dir}: could not write {len(report.unwritten)} warm prefix files: {names}")
    click.echo(f"warm prefixes ready in {report.seconds:.2f} s: {warm_dir}")


@main.group()
def prefixes() -> None:
    """Run-time prefix files: conversations' KV kept on disk (the service's prefix_dir)."""


prefix_dir_option = run_options(("prefix_dir",), prefix_dir={"required": True})


@prefixes.command("list")
@prefix_dir_option
@user_errors
def prefixes_list(prefix_dir: Path) -> None:
    """List the prefix files in PREFIX_DIR's export subfolders (headers only), oldest first, and
    each subfolder's files and bytes."""
    from kvedge.runtime.prefix_disk import list_prefix_files

    files = list_prefix_files(prefix_dir)
    for export in sorted({f.export for f in files}):
        held = [f for f in files if f.export == export]
        for file in held:
            state = f"unreadable: {file.problem}" if file.problem else f"{file.tokens} tokens"
            click.echo(f"{export}/{file.name}: {state}, {file.nbytes / 2**20:.2f} MiB")
        click.echo(f"{export}: {len(held)} files, {sum(f.nbytes for f in held) / 2**20:.2f} MiB")
    click.echo(f"{len(files)} files, {sum(f.nbytes for f in files) / 2**20:.2f} MiB in {prefix_dir}")


@prefixes.command("clear")
@prefix_dir_option
@user_errors
def prefixes_clear(prefix_dir: Path) -> None:
    """Remove every prefix file in PREFIX_DIR's export subfolders."""
    from kvedge.runtime.prefix_disk import clear_prefix_files

    click.echo(f"removed {clear_prefix_files(prefix_dir)} prefix files from {prefix_dir}")


main.add_command(  # the former name of warm-prefixes, kept for scripts that still use it
    click.Command(
        "warmup",
        callback=warm_prefixes_command.callback,
        params=warm_prefixes_command.params,
        help=warm_prefixes_command.help,
        hidden=True,
        deprecated="Use `kvedge warm-prefixes`.",
    )
)


@main.command()
@click.option(
    "--config", "config_path", type=click.Path(path_type=Path), help="Service YAML (configs/services/)."
)
@service_options(SERVICE_FLAGS)
@click.option("--check", is_flag=True, help="Validate the config and load the model once, then exit.")
@click.option("--print-systemd-unit", is_flag=True, help="Print a systemd unit for this install and exit.")
@user_errors
def serve(config_path: Path | None, check: bool, print_systemd_unit: bool, **overrides: Any) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (flags override --config)."""
    from kvedge.serve.service import serve_command

    text = serve_command(config_path, overrides, check=check, print_unit=print_systemd_unit)
    if text:
        click.echo(text, nl=False)


@main.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@user_errors
def info(model_dir: Path, as_json: bool) -> None:
    """Summarise an exported artifact folder."""
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
            f"max_len {g.max_len}, {g.dtype}"
            + (
                f" (5-bit keys, 8-bit on layers {list(g.key8_layers)}, 4-bit values, the last "
                f"{g.float_window} positions float32)"
                if g.packed
                else ""
            ),
        ),
        ("KV bytes", f"{g.bytes_per_token()} per token, {g.bytes_per_slot() / 2**20:.1f} MiB per sequence"),
        *layer_rows(g),
        *per_layer_rows(manifest, model_dir),
        (
            "graph",
            f"{manifest.variant}, {manifest.precision} compute, opset {manifest.opset}, "
            f"logits: {manifest.logits}, weights: "
            + manifest.weights_dtype
            + (f" (block {manifest.weight_block_size})" if manifest.weight_block_size else "")
            + (
                f", {manifest.weight_outlier_channels} {manifest.precision} channels, "
                f"LM head int{manifest.weight_head_bits}"
                if manifest.weight_head_bits
                else ""
            )
            + (
                f", decode matmuls: {manifest.weight_decode_matmuls}"
                if manifest.weight_decode_matmuls
                else ""
            )
            + (
                ", the source's blocks kept: "
                + ", ".join(f"{n} {kind}" for kind, n in manifest.weight_source_blocks.items())
                if manifest.weight_source_blocks
                else ""
            ),
        ),
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


def layer_rows(g: CacheGeometry) -> list[tuple[str, str]]:
    """`kvedge info`'s lines for a cache not every layer holds at full length: which layers hold
    KV (hybrids, Gemma 4), the ring layers, the shared layers and what they read, and each
    per-slot state (fixed bytes per sequence, not per token)."""
    rows = []
    if g.states or g.shared_layers:
        rows.append(("KV layers", ", ".join(map(str, g.kv_layers)) or "all"))
    if g.ring_layers:
        rows.append(
            (
                "ring layers",
                f"{len(g.ring_layers)} of {g.num_layers} hold the last {g.ring_len} tokens (window "
                f"{g.window} + {g.ring_margin}) of {g.ring_dim} dim",
            )
        )
    if g.shared_layers:
        reads = sorted(set(g.shared_sources))
        rows.append(
            (
                "shared KV",
                f"layers {', '.join(map(str, g.shared_layers))} store none and read layer "
                f"{' or '.join(map(str, reads))}'s",
            )
        )
    for s in g.states:
        rows.append(
            (
                f"{s.kind} state",
                f"layers {', '.join(map(str, s.layers))}: {list(s.shape)} {s.dtype} each, "
                f"{len(s.layers) * s.bytes_per_layer()} bytes per sequence (fixed)",
            )
        )
    return rows


def per_layer_rows(manifest: Manifest, folder: Path) -> list[tuple[str, str]]:
    """`kvedge info`'s line for Gemma 4's per-layer table: its file, shape and bytes, mapped."""
    table = manifest.per_layer
    if table is None:
        return []
    size = (folder / table.file).stat().st_size
    return [
        ("per-layer", f"{table.file} {list(table.shape)} {table.dtype}, {human(size)}, mapped (not loaded)")
    ]


def _plan_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--device is where the model runs, as elsewhere; a board profile given as --device (its
    meaning in `plan` before 0.x) still works, with a warning naming --profile."""
    if value is None or value in DEVICES:
        return value
    from kvedge.configs import BOARDS_DIR, available

    if value in available(BOARDS_DIR) or value.endswith((".yaml", ".yml")):
        log.warning("--device %s (a board profile) is deprecated; use --profile %s", value, value)
        ctx.meta[("old spelling", "profile")] = value
        return None
    raise click.BadParameter(
        f"{value!r} is not allowed; allowed: {', '.join(DEVICES)} (a board profile is --profile NAME)"
    )


def _plan_backend(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--backend, the former name of plan's --device; its "gpu" is now cuda (the same overheads)."""
    if value is not None:
        log.warning("--backend is deprecated; use --device")
        ctx.meta[("old spelling", "device")] = "cuda" if value == "gpu" else value


@main.command()
@click.argument("model")
@click.option(
    "--profile",
    default=None,
    callback=or_old_spelling,
    help="Board profile (configs/devices name or YAML path) whose memory is the budget; "
    "default: this machine's free memory.",
)
@click.option(
    "--memory-budget",
    "budget",
    default=None,
    help="Bytes the model may use instead of a profile's, e.g. 6GiB (the service's memory_budget).",
)
@click.option(
    "--reserve", default=None, help="Bytes kept for the OS (default: 1.5GiB with --profile, else 0)."
)
@click.option(
    "--device",
    default=None,
    metavar="[cpu|cuda|tensorrt]",
    callback=_plan_device,
    help="Where the model runs, as in generate/serve: cpu, cuda or tensorrt (default: cuda with "
    "--profile, else cpu).",
)
@click.option(
    "--backend",
    hidden=True,
    expose_value=False,
    type=click.Choice(["cpu", "gpu", "cuda", "tensorrt"]),
    callback=_plan_backend,
)
@click.option(
    "--kv-dtype", "kv_dtypes", multiple=True, help="Cache dtype, repeatable (default: the model's)."
)
@click_options(
    ExportRecipe,
    WEIGHT_FORM_KEYS,
    unset=True,
    weights={
        "help": "Recipes only: the weight form an export would make (default: the recipe's); "
        "--variant, --precision, --block-size, --outlier-channels, --head-bits and "
        "--decode-matmuls as in export."
    },
)
@click.option("--slots", default=None, help="Slot counts, e.g. 1,2,4 (default 1,2,4,8,16).")
@click.option(
    "--max-len",
    "max_lens",
    default=None,
    help="Cache lengths (tokens per slot) to plan, e.g. 1024,2048 (export's --max-len).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@user_errors
def plan(model: str, profile: str | None, device: str | None, **kwargs: Any) -> None:
    """Which slots x max_len combinations of MODEL (export folder or recipe) fit in memory, and
    when none does, the smallest change that would; for a recipe on cuda or tensorrt, the one form
    to export there. A form the --device cannot run is refused in one line."""
    from kvedge.planner import plan_report, weight_form

    device = device or click.get_current_context().meta.get(("old spelling", "device"))  # --backend
    form = weight_form({k: kwargs.pop(k) for k in WEIGHT_FORM_KEYS})
    click.echo(plan_report(model, profile=profile, device=device, form=form, **kwargs))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@user_errors
def doctor(as_json: bool) -> None:
    """Report the Jetson model, JetPack, power mode, CUDA, onnxruntime, TensorRT and free memory."""
    from kvedge.doctor import doctor_report

    click.echo(doctor_report(as_json))


@main.command()
@model_option
@click.option(
    "--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Folder for the scales."
)
@click.option(
    "--prompts", default=None, type=click.Path(path_type=Path), help=".jsonl/.txt (default: built-in 68)."
)
@click.option(
    "--method", type=click.Choice(["minmax", "percentile", "mse"]), default="mse", show_default=True
)
@click.option(
    "--kv-group-size",
    "group_size",
    default="32",
    show_default=True,
    type=click.Choice(["16", "32", "64", "128"]),
    help="Channels per scale, as export's --kv-group-size.",
)
@click.option("--percentile", default=99.99, show_default=True, type=float)
@click.option(
    "--kv-dtype",
    default="int8",
    show_default=True,
    type=click.Choice(["int8", "int4"]),
    help="int8: static scales and their report. int4: which layers' keys the int4 cache keeps at "
    "8 bits (each layer's KL with its keys alone at 5 bits), for export's --kv-key8-layers.",
)
@click.option("--force", is_flag=True, help="Overwrite existing scales.")
@user_errors
def calibrate(
    model_dir: Path,
    out_dir: Path,
    prompts: Path | None,
    method: str,
    group_size: str,
    percentile: float,
    kv_dtype: str,
    force: bool,
) -> None:
    """Calibrate INT8 KV scales (per channel group) and write a quality report; or, with --kv-dtype
    int4, find the layers whose keys the int4 cache keeps at 8 bits."""
    if kv_dtype == "int4":
        ctx = click.get_current_context()
        flags = {"method": "--method", "group_size": "--kv-group-size", "percentile": "--percentile"}
        given = [
            flag
            for name, flag in flags.items()
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise KvedgeError(f"{', '.join(given)} calibrate INT8 scales, not --kv-dtype int4's key layers")
        _calibrate_key_layers(model_dir, out_dir, prompts, force)
        return
    starting(f"calibrating {model_dir}: {method}, {group_size} channels per scale, into {out_dir}")
    require("matplotlib")  # for the plot, drawn after minutes of calibration
    import numpy as np

    from kvedge.calibrate.calibrate import (
        CalibrationOptions,
        plot_errors,
        read_prompts,
    )
    from kvedge.calibrate.calibrate import (
        calibrate as run_calibration,
    )
    from kvedge.quant import SCALES_MANIFEST
    from kvedge.runtime.model import Model

    if out_dir.suffix in (".npz", ".npy", ".json") or out_dir.is_file():
        raise KvedgeError(
            f"--out {out_dir} names a file; --out is a folder (it gets {SCALES_MANIFEST}, the scale "
            "arrays and a plot), e.g. --out scales/"
        )
    if (out_dir / SCALES_MANIFEST).exists() and not force:
        raise KvedgeError(f"{out_dir} already holds scales; pass --force to overwrite them")
    options = CalibrationOptions(method=method, group_size=int(group_size), percentile=percentile)
    calibration_set = read_prompts(prompts)
    scales = run_calibration(Model(model_dir), calibration_set, options)
    scales.save(out_dir)
    plot = plot_errors(scales, out_dir / "kv_scales.png")
    errors = scales.manifest.layer_errors
    click.echo(
        f"wrote {out_dir}: {scales.manifest.calibration_tokens} tokens from {len(calibration_set)} prompts; "
        f"mean relative error K per-group {np.mean(errors['k_group_rel']):.4f} "
        f"(per-tensor {np.mean(errors['k_tensor_rel']):.4f}), "
        f"V per-token {np.mean(errors['v_token_rel']):.4f}; "
        f"plot {plot}"
    )


def _calibrate_key_layers(model_dir: Path, out_dir: Path, prompts: Path | None, force: bool) -> None:
    """`calibrate --kv-dtype int4` (kvedge.calibrate.key_layers)."""
    from kvedge.calibrate.calibrate import read_prompts
    from kvedge.calibrate.key_layers import CONTEXT, KEY_LAYERS_FILE, LONG_PROMPTS, STEPS, key_layers
    from kvedge.runtime.model import Model

    if (out_dir / KEY_LAYERS_FILE).exists() and not force:
        raise KvedgeError(f"{out_dir} already holds {KEY_LAYERS_FILE}; pass --force to overwrite it")
    calibration_set = read_prompts(prompts)
    starting(
        f"measuring each layer's keys at 5 bits on {model_dir}: {LONG_PROMPTS} prompts of up to "
        f"{CONTEXT} tokens listing the {len(calibration_set)} calibration prompts, {STEPS} steps each, "
        f"into {out_dir}"
    )
    found = key_layers(Model(model_dir), calibration_set)
    path = found.save(out_dir)
    costs = sorted(enumerate(found.layer_kl), key=lambda c: -c[1])[:5]
    click.echo(
        f"wrote {path}: costliest layers (KL with their keys alone at 5 bits) "
        + ", ".join(f"{i} {kl:.5f}" for i, kl in costs)
        + f"; export with --kv-dtype int4 {found.export_flags()}"
    )


def echo_quality(results: list[Any]) -> None:
    """eval-kv's table: one row per scheme and context length."""
    click.echo(
        f"{'scheme':<56} {'context':>7} {'KL mean':>9} {'KL p99':>9} {'top-1':>7} {'greedy':>7} {'bytes':>6}"
    )
    for r in results:
        click.echo(
            f"{r.scheme:<56} {r.context or 'chat':>7} {r.kl_mean:9.5f} {r.kl_p99:9.5f} "
            f"{r.top1_agreement:7.2%} {r.greedy_match_mean:7.1f} {r.kv_bytes_ratio:6.3f}"
        )


@main.command("eval-kv")
@model_option
@click.option(
    "--scales", "scales_dir", default=None, type=click.Path(path_type=Path), help="From `kvedge calibrate`."
)
@click.option(
    "--int8-model",
    "int8_dir",
    default=None,
    type=click.Path(path_type=Path),
    help="An export of the same model with --kv-dtype int8: measure the real INT8 cache too.",
)
@click.option(
    "--weights-model",
    "weights_dirs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="An export of the same model with other weights (--weights int8|int4) or another cache "
    "(--kv-dtype int4), any variant: measure it against --model too (repeatable).",
)
@click.option(
    "--llama-cpp",
    "llama_cpp",
    is_flag=True,
    help="Also compare llama.cpp's q8_0 and q4_0 KV caches with its f16 cache on the model's GGUF source "
    "(needs llama-cpp-python, the [bench] extra).",
)
@click.option("--threads", default=1, show_default=True, type=int, help="llama.cpp threads.")
@click.option(
    "--prompts", default=None, type=click.Path(path_type=Path), help="Held-out set (default: built-in 24)."
)
@click.option("--limit", default=20, show_default=True, type=int, help="Use the first N prompts.")
@click.option(
    "--context",
    "contexts",
    multiple=True,
    type=click.IntRange(min=64),
    help="Instead of the chat prompts: the built-in long documents as prompts of this many tokens "
    "(repeatable: one row per scheme and length; the export's --max-len must hold it plus --tokens).",
)
@click.option(
    "--simulate",
    "simulated",
    multiple=True,
    help="A per-token scheme simulated on --model's float32 cache, e.g. int8-g32, int4-g32, "
    "int4-g16-hadamard-sinks4 (bits, then any of gN, hadamard, sinksN; repeatable).",
)
@click.option(
    "--tokens", default=256, show_default=True, type=int, help="Teacher-forced continuation length."
)
@click.option(
    "--out",
    "json_path",
    default=None,
    type=click.Path(path_type=Path),
    help="Also write the results here (JSON).",
)
@user_errors
def eval_kv(
    model_dir: Path,
    scales_dir: Path | None,
    int8_dir: Path | None,
    weights_dirs: tuple[Path, ...],
    llama_cpp: bool,
    threads: int,
    prompts: Path | None,
    limit: int,
    contexts: tuple[int, ...],
    simulated: tuple[str, ...],
    tokens: int,
    json_path: Path | None,
) -> None:
    """Compare INT8 KV schemes (and real --kv-dtype int8 or quantized-weight exports) with the fp32 model."""
    what = f"long documents at {', '.join(map(str, contexts))} tokens" if contexts else "held-out prompts"
    starting(f"loading {model_dir}, then {tokens} steps on each of up to {limit} {what}")
    from kvedge.calibrate.calibrate import document_prompts, read_prompts
    from kvedge.calibrate.evaluate import evaluate
    from kvedge.quant import Scales, Scheme
    from kvedge.runtime.model import Model

    if tokens < 1 or limit < 1:
        raise KvedgeError(f"--tokens {tokens} and --limit {limit} must be >= 1")
    if contexts and prompts:
        raise KvedgeError("--context prompts are the built-in documents: give --prompts or --context")
    schemes = tuple(Scheme.parse(spec) for spec in simulated) or None
    model = Model(model_dir)
    for context in contexts:
        if context + tokens + 1 > model.manifest.geometry.max_len:
            raise KvedgeError(
                f"--context {context} plus --tokens {tokens} needs an export with --max-len of at least "
                f"{context + tokens + 1}; {model_dir} has {model.manifest.geometry.max_len}"
            )
    scales = Scales.load(scales_dir, model.manifest) if scales_dir else None
    int8_model = Model(int8_dir) if int8_dir else None
    sets = (
        [(context, document_prompts(model, context)[:limit]) for context in contexts]
        if contexts
        else [(None, read_prompts(prompts, default="heldout")[:limit])]
    )
    gguf = None
    if llama_cpp:
        gguf = Path(model.manifest.source)
        if gguf.suffix != ".gguf" or not gguf.is_file():
            raise KvedgeError(
                f"--llama-cpp needs the model's GGUF source; this export was made from "
                f"{model.manifest.source!r}"
            )
    weights_models = tuple(Model(d) for d in weights_dirs)
    results = [
        dataclasses.replace(r, context=context)
        for context, held_out in sets
        for r in evaluate(
            model,
            scales,
            held_out,
            tokens=tokens,
            schemes=schemes,
            int8_model=int8_model,
            llama_cpp_gguf=gguf,
            threads=threads,
            weights_models=weights_models,
        )
    ]
    echo_quality(results)
    if json_path:
        payload = {
            "prompts": len(sets[0][1]),
            "contexts": list(contexts),
            "tokens": tokens,
            "schemes": [dataclasses.asdict(r) for r in results],
        }
        json_path.write_text(json.dumps(payload, indent=2))


@main.command()
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Where bench.json and bench.png go [default: a new "
    "bench/results/<date>-<commit>-<device>-t<threads>; bench/results/scratch/ is git-ignored].",
)
@click.option(
    "--work",
    type=click.Path(path_type=Path),
    default=Path("artifacts/bench"),
    show_default=True,
    help="Artifacts (exports, HF folder, onnxruntime-genai builds), reused when present.",
)
@click.option("--source", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct GGUF).")
@click.option(
    "--threads",
    default=(0,),
    multiple=True,
    show_default=True,
    type=int,
    help="Threads per system (0: all cores); repeat (--threads 1 --threads 2) to measure every system at "
    "each count side by side (targets judged at the first).",
)
@run_options(("device",))
@click.option(
    "--rounds", default=3, show_default=True, type=int, help="Alternating rounds (medians over them)."
)
@click.option("--steps", default=24, show_default=True, type=int, help="Decode steps per case.")
@click.option(
    "--kvedge",
    "kvedge_systems",
    multiple=True,
    help="kvedge system as variant:weights[:kv_dtype[:decode_matmuls]] (repeatable; default: "
    "portable:float32 ort:float32 ort:int8 ort:int4 portable:int4 portable:float32:int8 portable:int4:int8 "
    "ort:float32:int8 ort:int4:int8); e.g. ort:int4:int8:onnxruntime is the one-form export "
    "(--decode-matmuls onnxruntime).",
)
@click.option(
    "--peer",
    "peers",
    multiple=True,
    type=click.Choice(["transformers", "onnxruntime-genai", "llama.cpp"]),
    help="Peer to compare (repeatable; default: all three).",
)
@click.option("--no-peers", is_flag=True, help="kvedge systems only.")
@click.option(
    "--quick", is_flag=True, help="1 round, no quality / memory / allocation runs, warm prefixes: first."
)
@click.option(
    "--warm",
    type=click.Choice(["all", "first", "none"]),
    default=None,
    help="kvedge systems that get the warm-prefix section, ~40 s per system and round "
    "(default: all; first with --quick).",
)
@click.option("--no-warm", is_flag=True, help="Same as --warm none.")
@user_errors
def bench(
    out: Path | None,
    work: Path,
    source: str | None,
    threads: tuple[int, ...],
    device: str,
    rounds: int,
    steps: int,
    kvedge_systems: tuple[str, ...],
    peers: tuple[str, ...],
    no_peers: bool,
    quick: bool,
    warm: str | None,
    no_warm: bool,
) -> None:
    """Benchmark kvedge against transformers, onnxruntime-genai and llama.cpp, side by side."""
    from kvedge.bench import DEFAULT_KVEDGE, PEERS, BenchConfig, run_benchmark

    config = BenchConfig(
        out=out,
        work=work,
        source=source,
        threads=threads,
        device=device,
        rounds=1 if quick else rounds,
        steps=steps,
        kvedge=kvedge_systems or DEFAULT_KVEDGE,
        peers=() if no_peers else (peers or PEERS),
        memory=not quick,
        quality=not quick,
        allocation_steps=0 if quick else 1000,
        warm="none" if no_warm else warm or ("first" if quick else "all"),
        command=" ".join(["kvedge", *sys.argv[1:]]),
    )
    run_benchmark(config, echo=click.echo)


add_old_spellings(main, OLD_OPTIONS)
