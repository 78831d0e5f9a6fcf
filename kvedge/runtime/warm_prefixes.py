"""Warm prefixes: declare fixed prompts in YAML, compute their KV at boot, keep it on disk.

Config: `configs/warmup/*.yaml`, read by `kvedge.configs.load_warm_prefix_config` (format there).

At start-up every declared prefix is loaded from its warm file if the file is valid for this
model (its source and the graph that computed the K/V), cache geometry and prompt, and recomputed
and rewritten otherwise (the reason is logged).

A `messages` prefix holds what every conversation made of those messages and then a user message
starts with: the rendered messages plus the template's opening of the user turn (for ChatML
`<|im_start|>user\n`, 3 tokens), found as the tokens shared by renderings that continue with
differently starting user messages (`USER_PROBES`). Those tokens would otherwise be prefilled on
every first turn; a conversation that continues differently still reuses the shared part.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvedge.configs import PrefixSpec, WarmPrefixConfig
from kvedge.contract import Manifest
from kvedge.errors import ArtifactMismatch, KvedgeError
from kvedge.runtime.cache import KVCache
from kvedge.runtime.generate import prefill
from kvedge.runtime.interface import Backend
from kvedge.runtime.prefix import (
    SUFFIX,
    Usable,
    WarmPrefix,
    best_entry,
    read_warm_file,
    remove_stale_temps,
    write_warm_file,
)
from kvedge.runtime.sessions import common_prefix
from kvedge.runtime.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)
USER_PROBES = ("Hi", "42", "?", "(")  # user messages starting with different kinds of characters


class WarmPrefixStore:
    """Warm prefixes held in memory (memory-mapped from their files), searched by token prefix."""

    def __init__(self, prefixes: list[WarmPrefix] | None = None) -> None:
        self.prefixes = list(prefixes or [])

    def __len__(self) -> int:
        return len(self.prefixes)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.prefixes)

    def best_match(self, ids: list[int], usable: Usable | None = None) -> tuple[WarmPrefix | None, int]:
        """The prefix sharing the most leading tokens with `ids`, and how many it shares; with
        `usable(prefix, shared)`, how many of them a turn can use (`Model._usable`)."""
        return best_entry(self.prefixes, ids, usable)


@dataclass
class WarmPrefixReport:
    loaded: list[str]
    rebuilt: dict[str, str]  # name -> why
    seconds: float
    unwritten: dict[str, str] = field(default_factory=dict)  # rebuilt, not stored: why


def fewest_tokens(tokenizer: ChatTokenizer, spec: PrefixSpec, enough: int) -> int:
    """A lower bound on len(prefix_ids(tokenizer, spec)), counted no further than past `enough`
    (`ChatTokenizer.fewest_tokens`): its text's, or the sum of its messages' (each stands whole,
    trimmed as templates trim it, before the user turn opens)."""
    if spec.text is not None:
        return tokenizer.fewest_tokens(spec.text, enough)
    counted = 0
    for message in spec.messages:
        counted += tokenizer.fewest_tokens(message.content.strip(), enough - counted)
        if counted > enough:
            break
    return counted


def prefix_ids(tokenizer: ChatTokenizer, spec: PrefixSpec) -> list[int]:
    if spec.text is not None:
        return tokenizer.encode(spec.text, add_special_tokens=False)
    messages = [{"role": m.role, "content": m.content} for m in spec.messages]
    try:
        renders = [tokenizer.encode_chat([*messages, {"role": "user", "content": p}]) for p in USER_PROBES]
    except KvedgeError:  # the template refuses a user message here (e.g. two in a row)
        return tokenizer.encode(
            tokenizer.render(messages, add_generation_prompt=False), add_special_tokens=False
        )
    return renders[0][: min(common_prefix(renders[0], other) for other in renders[1:])]


def load_warm_prefixes(
    tokenizer: ChatTokenizer,
    backend: Backend,
    cache: KVCache,
    manifest: Manifest,
    config: WarmPrefixConfig,
    folder: str | Path,
) -> tuple[WarmPrefixStore, WarmPrefixReport]:
    """Load every declared prefix from `folder`, recomputing (in the cache's last slot) and
    rewriting any that is not valid."""
    folder = Path(folder)
    started = time.perf_counter()
    fingerprint, graph = manifest.source_fingerprint, manifest.onnx_fingerprint
    geometry = manifest.geometry
    store, loaded, rebuilt, unwritten = WarmPrefixStore(), [], {}, {}
    for spec in tqdm(config.prefixes, desc="warm prefixes", unit="prefix", disable=len(config.prefixes) < 2):
        fewest = fewest_tokens(tokenizer, spec, geometry.max_len - 1)
        if fewest >= geometry.max_len:  # before tokenizing a text far too long
            raise KvedgeError(
                f"warm prefix {spec.name!r} has at least {fewest} tokens; max_len is {geometry.max_len}"
            )
        ids = prefix_ids(tokenizer, spec)
        if len(ids) >= geometry.max_len:
            raise KvedgeError(
                f"warm prefix {spec.name!r} has {len(ids)} tokens; max_len is {geometry.max_len}"
            )
        path = folder / f"{spec.name}{SUFFIX}"
        prefix, why = None, not_a_regular_file(path)
        if why is None:
            try:
                prefix = read_warm_file(path, geometry, fingerprint, ids, graph_fingerprint=graph)
                loaded.append(spec.name)
            except FileNotFoundError:
                why = "missing"
            except ArtifactMismatch as exc:
                why = str(exc)
            except OSError as exc:
                why = f"cannot read it: {exc.strerror or exc}"
        if prefix is None:
            rebuilt[spec.name] = why
            level = logging.INFO if why == "missing" else logging.WARNING
            log.log(level, "warm prefix %s: recomputing (%s)", spec.name, why)
            prefix = compute_prefix(backend, cache, spec.name, ids)
            try:
                write_warm_file(path, prefix, geometry, fingerprint, graph_fingerprint=graph)
            except OSError as exc:  # e.g. a full disk: serve the prefix from memory
                unwritten[spec.name] = exc.strerror or str(exc)
                log.warning("warm prefix %s: cannot write %s (%s); kept in memory only", spec.name, path, exc)
        store.prefixes.append(prefix)
    remove_stale_temps(folder)
    report = WarmPrefixReport(loaded, rebuilt, time.perf_counter() - started, unwritten)
    log.info("warm prefixes: %d loaded, %d recomputed in %.2f s", len(loaded), len(rebuilt), report.seconds)
    return store, report


def not_a_regular_file(path: Path) -> str | None:
    """Why `path` is not a warm file worth opening, or None. Only regular files (through
    symlinks) are opened: opening a FIFO blocks until a writer comes, a device may never end,
    and a directory cannot be read."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as exc:  # a symlink loop, a folder that cannot be searched...
        return f"cannot read it: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    return None


def compute_prefix(backend: Backend, cache: KVCache, name: str, ids: list[int]) -> WarmPrefix:
    """Run `ids` through the model in a scratch slot (the last one) and copy out their KV (and
    per-slot states at their end)."""
    slot = cache.slots - 1
    cache.reset(slot)
    prefill(backend, cache, slot, [ids])
    block, states = cache.read(slot, len(ids)), cache.known_states(slot, len(ids))
    cache.reset(slot)
    return WarmPrefix(name=name, token_ids=tuple(ids), block=block, states=states)


def describe(report: WarmPrefixReport) -> dict[str, Any]:
    return {"loaded": report.loaded, "rebuilt": report.rebuilt, "seconds": round(report.seconds, 3)}
