"""The runtime's public API: load an artifact folder once, then run chat turns in its slots.

One turn, as the CLI (a batch of one) and the service (many slots) both drive it::

    ids  = model.encode_chat(messages, reserve)     # tokenize once (the truncate policy drops turns)
    n    = model.fit_reply(len(ids), max_tokens)    # the fit rule: how long the reply may be
    slot = model.pick_slot(ids, free)               # the free slot sharing the longest prefix
    turn = model.begin(slot, ids, sampling)         # reuse what the slot holds, plan the prefill
    while not turn.done:
        events = model.step([turn, ...]).events     # a prefill chunk or one batched decode step
    model.end(turn)                                 # the slot's session notes what it holds

`Model.chat` runs that loop for one conversation and yields its events.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvedge.contract import (
    ONNX_FILE,
    PREFILL_CHUNK,
    TOKENIZER_FILE,
    CacheGeometry,
    Manifest,
    graph_files,
    sha256_files,
)
from kvedge.errors import ArtifactMismatch, ContextOverflow, KvedgeError
from kvedge.runtime.backends.cuda import DeviceMemory
from kvedge.runtime.cache import KVCache
from kvedge.runtime.constrain import Constraint, Grammars
from kvedge.runtime.draft import Draft, DraftProposer, check_same_tokenizer
from kvedge.runtime.generate import Event, SamplingConfig, StepResult, Turn, step_turns
from kvedge.runtime.interface import Backend
from kvedge.runtime.options import RunOptions
from kvedge.runtime.prefix_stores import PrefixStores
from kvedge.runtime.registry import open_backend
from kvedge.runtime.sessions import ChatSession, HistoryPolicy, RoomMaker, common_prefix, pick_slot
from kvedge.runtime.speculate import Adaptive, Costs, Lookup
from kvedge.runtime.tokenizer import ChatTokenizer, TextStream
from kvedge.runtime.warm_prefixes import (
    WarmPrefixConfig,
    WarmPrefixReport,
    WarmPrefixStore,
    load_warm_prefixes,
)

log = logging.getLogger(__name__)

__all__ = ["Constraint", "Event", "Model", "SamplingConfig", "StepResult", "Turn", "common_prefix"]


class Model:
    """An exported model run as its `RunOptions` say (kvedge.runtime.options): on a device
    (onnxruntime CPU or CUDA, or a TensorRT engine) with its tokenizer, a preallocated cache of
    `slots` sequences, one `ChatSession` per slot, optionally warm prefixes loaded (or rebuilt) at
    start-up, a store of `prefix_cache_bytes` for prefixes seen at run time (`RunTimePrefixStore`) and a
    draft model. `kv_memory` (`KV_MEMORY`; GPU devices only): where the cache pool lives:
    "mapped", pinned host memory the GPU reads in place (the default, until hardware measures the
    other), or "device", device memory (cudaMalloc) the CPU side reaches by explicit copies.

    `close()` (or leaving `with Model(...) as model:`) stops the backend and gives back what it
    took on the GPU (page locks on the cache, mapped buffers); the model is unusable after."""

    def __init__(self, folder: str | Path, options: RunOptions | None = None, **fields: Any) -> None:
        """Load the export in `folder` to run with `options`, or with the `RunOptions` `fields`
        name (`Model(folder, slots=2)`), not both."""
        if options is not None and fields:
            raise KvedgeError(f"give RunOptions or its fields ({sorted(fields)}), not both")
        self.options = options = options or RunOptions(**fields)
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise KvedgeError(_not_a_folder(self.folder))
        self.manifest = Manifest.load(self.folder)
        for name in (ONNX_FILE, TOKENIZER_FILE):  # before the slow graph load, and in one line
            path = self.folder / name
            if not path.is_file() or path.stat().st_size == 0:
                state = "is empty" if path.is_file() else "is missing"
                raise KvedgeError(f"{path} {state}: the folder is not a whole export; re-export the model")
        if options.verify:
            self._verify_graph()
        self.policy = options.policy
        _check_ring_features(self.manifest.geometry, self.policy)
        if (
            self.policy.mode == "window"
            and len(self.manifest.rope.inv_freq) != self.manifest.geometry.head_dim // 2
        ):
            raise KvedgeError(
                "history_policy 'window' needs RoPE frequencies in the manifest; re-export the model"
            )
        # one decode binding per contiguous slot range, so batched decode never rebuilds one
        ranges = min(64, max(8, options.slots * (options.slots + 1) // 2))
        self.device = options.device
        self.draft: Draft | None = None  # speculate="draft": proposals of `options.draft`
        # decode calls' seconds, what its turns' speculative steps are weighed against
        self.speculation_costs = Costs()
        self.backend: Backend = open_backend(
            self.folder,
            self.manifest,
            options.device,
            threads=options.threads,
            max_decode_bindings=ranges,
            cuda_graph=options.cuda_graph,
        )
        self.cache: KVCache | None = None
        try:
            self._load(options)
            if options.draft is not None:
                self.load_draft(options.draft)
        except BaseException:
            self.close()  # the GPU memory taken is given back even when loading fails
            raise

    def _load(self, options: RunOptions) -> None:
        """Everything after the backend opened: tokenizer, cache, sessions, warm prefixes."""
        slots, warm, warm_dir = options.slots, options.warm_prefixes, options.warm_dir
        self.tokenizer = ChatTokenizer(self.folder, self.manifest)
        self.grammars = Grammars(
            self.folder / TOKENIZER_FILE, self.manifest.vocab_size, self.manifest.eos_token_ids
        )
        device_memory = DeviceMemory() if options.kv_memory == "device" else None
        self.cache = KVCache(self.manifest.geometry, slots, device_memory)
        self.backend.reserve(
            self.cache.layer_views(0, slots), self.manifest.geometry.max_len, self.cache.state_views(0, slots)
        )
        self.sessions = [ChatSession(slot) for slot in range(slots)]
        self._turns: list[Turn | None] = [None] * slots  # the unfinished turn of each slot
        self._last_used = [0.0] * slots
        self._warned: set[str] = set()  # reasons logged once
        geometry = self.manifest.geometry
        self.prefixes = PrefixStores(self.cache, self.sessions, self.manifest, options)
        # [layers, 1, 1, d/2], what window eviction re-rotates keys by; ring geometries never evict
        # (`_check_ring_features`), and Gemma 4's layers differ in head_dim
        self.inv_freq = (
            None if geometry.ring_layers else self.manifest.rope.key_frequencies(geometry.num_layers)
        )
        if warm is not None:
            self.prefixes.warm, self.prefixes.warm_report = self.load_warm_prefixes(warm, warm_dir)
            for session in self.sessions:
                session.reset(self.cache)
        self.prefixes.check_ahead()
        log.info(
            "loaded %s: %d slots x %d tokens, KV pool %.1f MiB, %s",
            self.folder,
            slots,
            geometry.max_len,
            self.cache.nbytes / 2**20,
            self.prefixes.describe(),
        )

    def _verify_graph(self) -> None:
        found = sha256_files(graph_files(self.folder))
        if found != self.manifest.onnx_fingerprint:
            raise ArtifactMismatch(
                f"{self.folder / ONNX_FILE}: graph fingerprint {found[:16]} does not match the "
                f"manifest's {self.manifest.onnx_fingerprint[:16]}; re-export the model"
            )

    def load_warm_prefixes(
        self, config: WarmPrefixConfig, folder: str | Path
    ) -> tuple[WarmPrefixStore, WarmPrefixReport]:
        """Load the warm prefixes `config` declares from `folder`, recomputing any that is not
        valid (in the last slot, which is left empty)."""
        return load_warm_prefixes(self.tokenizer, self.backend, self.cache, self.manifest, config, folder)

    def close(self) -> None:
        """Stop the backend, then release what it holds of the cache (GPU page locks, mapped
        buffers), then the cache's device memory (`kv_memory="device"`); host arrays go with
        this object. Safe to call twice. The draft goes first; should its close raise, this
        model's backend and cache are still released (then the error is raised). Run-time
        prefixes still in memory are written to disk first (`RunOptions.prefix_dir`)."""
        try:
            prefixes = getattr(self, "prefixes", None)
            if prefixes is not None:
                self.keep_prefixes()
                prefixes.close()  # once every file queued is written; nothing is written from the cache after
            if self.draft is not None:
                self.draft.close()
        finally:
            try:
                self.backend.close()
            finally:
                if self.cache is not None:
                    self.cache.close()

    def prefix_stats(self) -> dict[str, int]:
        """Where the run-time prefixes sit (`PrefixStores.stats`)."""
        return self.prefixes.stats()

    @contextlib.contextmanager
    def scratch(self, slot: int) -> Iterator[None]:
        """Turns run inside (a service's warm-up) are no conversation: nothing of them is written
        to the disk tier, and `slot` is emptied after."""
        try:
            with self.prefixes.unkept():
                yield
        finally:
            self.sessions[slot].reset(self.cache)

    def keep_prefixes(self) -> int:
        """Write what the run-time prefix store and the slots hold to the disk tier, least
        recently used first (`PrefixStores.keep_all`); how many files were written. Safe to call
        twice."""
        return self.prefixes.keep_all(sorted(range(self.cache.slots), key=lambda s: self._last_used[s]))

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what the service and the CLI call ---------------------------------------------------

    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def kv_bytes_allocated(self) -> int:
        return self.cache.nbytes

    def kv_bytes_in_use(self) -> int:
        """Bytes of the pool holding valid tokens, over all slots."""
        return sum(self.manifest.geometry.bytes_held(int(n)) for n in self.cache.lengths)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        reserve: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        limit: int | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The conversation's token ids (`tools` and `template_kwargs` go to the chat template);
        under the truncate policy the oldest whole turns are dropped (system messages stay) until
        it fits with `reserve` tokens left for the reply. A conversation of more than `limit`
        tokens is refused before any truncation, which re-renders it once per dropped turn, and
        one whose rendered text is surely over `limit` (`ChatTokenizer.fewest_tokens`) before it
        is tokenized whole: the rendering holds all the request sends (messages, tools)."""
        messages = list(messages)

        def encode(kept: Sequence[dict[str, Any]]) -> list[int]:
            return self.tokenizer.encode_chat(kept, tools=tools, **template_kwargs)

        if limit is None:
            ids = encode(messages)
        else:
            text = self.tokenizer.render(messages, tools=tools, **template_kwargs)
            _at_least(self.tokenizer, text, limit, "messages take")
            ids = _within(self.tokenizer.encode_rendered(text), limit, "the messages take")
        if self.policy.mode == "truncate":
            messages, ids = self._truncate_turns(messages, ids, reserve, encode)
        return ids

    def encode_prompt(self, text: str, limit: int | None = None) -> list[int]:
        """A raw prompt's token ids (no chat template), refused above `limit` tokens (a prompt
        surely over it before it is tokenized whole: `ChatTokenizer.fewest_tokens`)."""
        if limit is not None:
            _at_least(self.tokenizer, text, limit, "prompt takes")
        return _within(self.tokenizer.encode(text), limit, "the prompt takes")

    def _truncate_turns(
        self,
        messages: list[dict[str, Any]],
        ids: list[int],
        reserve: int,
        encode: Callable[[Sequence[dict[str, Any]]], list[int]] | None = None,
    ) -> tuple[list[dict[str, Any]], list[int]]:
        encode = encode or self.tokenizer.encode_chat
        max_len = self.manifest.geometry.max_len
        budget = self.policy.truncate_budget(max_len, reserve)
        while len(ids) > budget:
            first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
            later_user = next(
                (i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None
            )
            if later_user is None:
                raise self.policy.overflow_last_turn(len(ids), budget, max_len, reserve)
            log.info("truncate: dropping %d oldest messages", later_user - first)
            messages = messages[:first] + messages[later_user:]
            ids = encode(messages)
        return messages, ids

    def fit_reply(
        self, prompt_tokens: int, requested: int | None, default: int = 256, overflow: str = "clip"
    ) -> int:
        """How many tokens a reply to `prompt_tokens` may have (`HistoryPolicy.fit_reply`)."""
        return self.policy.fit_reply(
            prompt_tokens, self.manifest.geometry.max_len, requested, default, overflow
        )

    def pick_slot(self, ids: Sequence[int], free: Sequence[int]) -> int:
        """The free slot sharing the longest token prefix with `ids`; among equals the least
        recently used."""
        return pick_slot(free, ids, self.cache.token_ids, self._last_used)[0]

    def begin(self, slot: int, ids: Sequence[int], config: SamplingConfig) -> Turn:
        """Start a turn answering the conversation `ids` in `slot`: rewind the slot to what it
        shares with `ids` (or copy in a stored prefix that shares more) and plan the prefill of
        the rest. Nothing runs on the model until `step`. An unfinished turn in the slot is
        ended first."""
        if self._turns[slot] is not None:
            self.end(self._turns[slot])
        ids = [int(t) for t in ids]
        self.policy.check_prompt(len(ids), self.manifest.geometry.max_len)
        matcher = None if config.constraint is None else self.grammars.matcher(config.constraint)
        session = self.sessions[slot]
        new = self.prefixes.resume(slot, ids)
        window = self.policy.mode == "window"
        chunk = min(PREFILL_CHUNK, self.backend.max_prefill or PREFILL_CHUNK)  # an engine's --max-prefill
        if window:
            chunk = max(1, min(chunk, (self.manifest.geometry.max_len - self.policy.n_sink) // 2))
        turn = Turn(
            slot=slot,
            prompt_tokens=len(ids),
            todo=new,
            chunk=chunk,
            config=config,
            stream=TextStream(self.tokenizer, config.stop),
            seen=list(ids),
            make_room=RoomMaker(self.cache, self.policy, self.inv_freq, session),
            reused_tokens=session.reused_tokens,
            rng=np.random.default_rng(config.seed),
            eos_ids=tuple(self.manifest.eos_token_ids),
            matcher=matcher,
            speculator=self._speculator(config, slot),
        )
        self._turns[slot] = turn
        return turn

    def speculation_refusal(self) -> str | None:
        """Why this model cannot decode speculatively (`SamplingConfig.speculate`), or None: the
        backend's answer (the graph's, and a TensorRT engine's profiles')."""
        return self.backend.verify_refusal()

    def load_draft(self, folder: str | Path) -> Draft:
        """Load the export in `folder` as this model's draft (speculate="draft"): the same device,
        threads and cache memory, one slot per slot of this model, its tokenizer checked against
        this one's. A draft loaded before is closed first."""
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        draft_model = Model(folder, self.options.backend_options())
        try:
            check_same_tokenizer(self, draft_model)
            if draft_model.manifest.geometry.states:
                raise KvedgeError(
                    f"draft {folder}: {draft_model.manifest.model_type} keeps per-slot states, which a "
                    "draft would have to rewind after every rejected proposal; choose a draft without "
                    "them (a dense model with this tokenizer), or speculate='lookup'"
                )
        except BaseException:
            draft_model.close()
            raise
        self.draft = Draft(draft_model)
        log.info("draft %s loaded for %s: %d slots", folder, self.folder, self.slots)
        return self.draft

    def _speculator(self, config: SamplingConfig, slot: int) -> Adaptive | None:
        """A turn's proposals, if `config` asks for them and this model can verify: prompt lookup,
        or the draft loaded with the model ("draft"; a draft is never loaded in the middle of a
        request)."""
        if config.speculate == "off":
            return None
        refusal = self.speculation_refusal()
        if refusal is not None:
            if refusal not in self._warned:
                self._warned.add(refusal)
                log.warning("%s", refusal)
            return None
        if config.speculate == "lookup":
            return Lookup(costs=self.speculation_costs)
        if self.draft is None:
            raise KvedgeError(
                "speculate='draft' needs the draft loaded with the model (RunOptions.draft: --draft DIR, "
                "or the service's draft: DIR)"
            )
        return DraftProposer(draft=self.draft, slot=slot, costs=self.speculation_costs)

    def step(self, turns: Sequence[Turn], batch: bool = True) -> StepResult:
        """Advance each turn by one step (`step_turns`; `batch`: decode contiguous slots in one
        call); a turn that finished is ended."""
        result = step_turns(self.backend, self.cache, turns, batch=batch)
        for turn, event in result.events.items():
            if event.finish_reason is not None:
                self.end(turn)
        return result

    def end(self, turn: Turn) -> None:
        """End `turn` (finished, failed or abandoned): its slot's session notes what the slot
        holds, so the next turn there reuses it. Safe to call more than once."""
        if self._turns[turn.slot] is not turn:
            return
        self._turns[turn.slot] = None
        self._last_used[turn.slot] = time.monotonic()
        session = self.sessions[turn.slot]
        if turn.finish_reason == "error":
            session.reset(self.cache)  # a half-written step is never reused
            return
        if not turn.done:
            turn.finish("cancelled")
        session.record(self.cache, turn.written)
        self.prefixes.turn_ended(turn.slot, turn.prompt_tokens)

    # -- one conversation at a time --------------------------------------------------------

    def stream(
        self, prompt: str, config: SamplingConfig, raw: bool = False, slot: int = 0
    ) -> Iterator[Event]:
        """One turn on its own: `prompt` as a user message (or raw text), ignoring earlier turns."""
        if raw:
            self.sessions[slot].reset(self.cache)
            return self._run(self.begin(slot, self.tokenizer.encode(prompt), config))
        return self.chat([{"role": "user", "content": prompt}], config, slot=slot)

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        config: SamplingConfig,
        slot: int = 0,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[Event]:
        """Answer the conversation `messages` in `slot`, reusing whatever prefix the slot holds.
        `stop`, asked before each step: when true the turn ends there (no final event), what it
        wrote kept in the slot, as when the service's client disconnects."""
        ids = self.encode_chat(messages, config.max_new_tokens)
        return self._run(self.begin(slot, ids, config), stop)

    def prepare(self, slot: int, ids: Sequence[int]) -> np.ndarray:
        """Bring `slot` to hold `ids` (reusing what it can) and return next-token logits [vocab]."""
        turn = self.begin(slot, ids, SamplingConfig(max_new_tokens=1))
        try:
            while turn.todo:
                logits = turn.prefill_chunk(self.backend, self.cache)
        except BaseException:
            turn.finish("error")
            raise
        finally:
            self.end(turn)
        return logits

    def _run(self, turn: Turn, stop: Callable[[], bool] | None = None) -> Iterator[Event]:
        """The turn's events, one `step` at a time; an error is raised. Ending the iteration
        early (or dropping it, or `stop` turning true) ends the turn. A prompt of more than four
        chunks shows a progress bar on stderr while it is prefilled (minutes on a small board)."""
        progress = tqdm(
            total=len(turn.todo),
            desc="prefill",
            unit="token",
            leave=False,
            disable=len(turn.todo) <= 4 * turn.chunk,
        )
        try:
            while not turn.done and not (stop is not None and stop()):
                todo = len(turn.todo)
                events = self.step([turn]).emitted(turn)
                progress.update(todo - len(turn.todo))
                if events:
                    progress.close()
                for event in events:
                    if event.error is not None:
                        raise event.error
                    yield event
        finally:
            progress.close()
            self.end(turn)


def _check_ring_features(geometry: CacheGeometry, policy: HistoryPolicy) -> None:
    """Refuse, at load, window eviction for ring geometries (Gemma 3's sliding-window layers):
    eviction moves the kept positions back and re-rotates their keys, which in a ring layer would
    mean re-laying out what it holds at the new p % ring_len under the local RoPE; not done.
    Prefix stores and warm prefixes work (`KVBlock` carries the ring layers' last positions)."""
    if geometry.states and policy.mode == "window":
        raise KvedgeError(
            "history_policy 'window' (eviction moves a run of keys): not supported for this model's "
            "per-slot states (convolution layers), which cannot be moved with them; use 'error' or 'truncate'"
        )
    if geometry.ring_layers and policy.mode == "window":
        raise KvedgeError(
            "history_policy 'window' (eviction re-rotates a contiguous run of keys): not supported "
            f"for this model's sliding-window ring layers (layers {list(geometry.ring_layers)}, "
            f"{geometry.ring_len} positions each); use 'error' or 'truncate'"
        )


def _within(ids: list[int], limit: int | None, what: str) -> list[int]:
    """`ids`, or ContextOverflow when there are more than `limit` (a service's max_prompt_tokens)."""
    if limit is not None and len(ids) > limit:
        raise ContextOverflow(
            f"{what} {len(ids)} tokens; this server accepts at most {limit} prompt tokens per "
            "request (max_prompt_tokens)",
            cause="prompt",
        )
    return ids


def _at_least(tokenizer: ChatTokenizer, text: str, limit: int, what: str) -> None:
    """ContextOverflow when `text` is surely over `limit` tokens (`fewest_tokens`)."""
    fewest = tokenizer.fewest_tokens(text, limit)
    if fewest > limit:
        size = len(text.encode(errors="replace"))  # counted again only for the message
        raise ContextOverflow(
            f"the {what} at least {fewest} tokens ({size} bytes of text); this server accepts at "
            f"most {limit} prompt tokens per request (max_prompt_tokens)",
            cause="prompt",
        )


def _not_a_folder(path: Path) -> str:
    """Why `path`, given as a model, is not one: a GGUF (or other) file is a source to export."""
    if path.suffix.lower() == ".gguf" and path.is_file():
        command = f"kvedge export {shlex.quote(str(path))} --out DIR"
        return f"{path} is a GGUF file, a source to export first: `{command}`, then use --model DIR"
    if path.exists():
        return f"model {str(path)!r} is not a folder; give the folder `kvedge export` wrote"
    return f"model folder {str(path)!r} does not exist"
