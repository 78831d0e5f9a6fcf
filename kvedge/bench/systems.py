"""The systems the benchmark compares, behind one small interface.

A `SystemSpec` is plain data (picklable, so a child process can build it for the memory
measurement); `SystemSpec.build(threads)` loads the system and returns a `System`:

    run(ids, steps)          fresh sequence: prefill `ids`, pick the first token greedily, then
                             `steps` greedy decode steps -> (time to first token, [step seconds])
    next_token_logits(ids)   teacher-forced next-token logits at every position [len(ids), vocab]

Systems that can be driven one step at a time (all but transformers, whose `generate` is one
call) are `Steppable`: `start(ids)` prefills and picks the first token, `step()` decodes one;
the benchmark interleaves their decode steps so neighbouring systems see the same machine load.

Each peer is driven the way its users drive it: kvedge through its prefill/decode functions,
Hugging Face transformers through `generate` (eager attention, use_cache=True) timed by a
streamer, onnxruntime-genai through its Generator (max_length = the kvedge max_len, so its
shared past/present buffer has the same size), llama.cpp through llama-cpp-python's `eval`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvedge.errors import KvedgeError

KINDS = ("kvedge", "transformers", "onnxruntime-genai", "llama.cpp")


class System(Protocol):
    def run(self, ids: list[int], steps: int) -> tuple[float, list[float]]: ...

    def next_token_logits(self, ids: list[int]) -> np.ndarray: ...


class Steppable:
    """`run` in terms of `start` (prefill + first token) and `step` (one decode step)."""

    def start(self, ids: list[int]) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def run(self, ids: list[int], steps: int) -> tuple[float, list[float]]:
        started = time.perf_counter()
        self.start(ids)
        ttft = time.perf_counter() - started
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - started)
        return ttft, times


@dataclass(frozen=True)
class SystemSpec:
    """What to load: `path` is a kvedge artifact folder, an HF folder, an ort-genai folder or a GGUF."""

    name: str  # label in tables and plots, e.g. "kvedge ort int4"
    kind: str  # one of KINDS
    path: Path
    weights: str  # "float32", "int8", "int4", "Q4_1", ...
    max_len: int = 2048
    weight_bytes_per_token: int = 0  # weights read per decode token (see roofline in __init__)
    kv_bytes_per_token: int = 0  # cache bytes per valid token read per decode step
    reference_for: str | None = None  # exact-size twin: name of the max_len-2048 system it checks
    device: str = "cpu"  # kvedge systems: the backend `--device` names (`open_backend`)
    extra: dict[str, Any] = field(default_factory=dict)

    def build(self, threads: int) -> System:
        if self.kind == "kvedge":
            return KvedgeSystem(self.path, threads, self.device)
        if self.kind == "transformers":
            return TransformersSystem(self.path, threads)
        if self.kind == "onnxruntime-genai":
            return OrtGenaiSystem(self.path, threads, self.max_len)
        if self.kind == "llama.cpp":
            return LlamaCppSystem(self.path, threads, self.max_len)
        raise KvedgeError(f"system kind {self.kind!r} is unknown; known: {list(KINDS)}")


class KvedgeSystem(Steppable):
    """An exported artifact on kvedge's runtime: backend + one-slot cache, greedy."""

    def __init__(self, folder: Path, threads: int, device: str = "cpu") -> None:
        from kvedge.contract import Manifest
        from kvedge.runtime.backend import open_backend
        from kvedge.runtime.cache import KVCache

        self.manifest = Manifest.load(folder)
        self.backend = open_backend(folder, self.manifest, device, threads=threads)
        self.cache = KVCache(self.manifest.geometry, 1)
        self.backend.reserve(self.cache.layer_views(0, 1), self.manifest.geometry.max_len)  # as Model does

    def start(self, ids: list[int]) -> None:
        from kvedge.runtime.generate import prefill

        self.cache.reset(0)
        self.token = int(np.argmax(prefill(self.backend, self.cache, 0, [ids])[0]))

    def step(self) -> None:
        from kvedge.runtime.generate import decode_one_token

        self.token = int(np.argmax(decode_one_token(self.backend, self.cache, 0, [self.token])[0]))

    def next_token_logits(self, ids: list[int]) -> np.ndarray:
        from kvedge.runtime.generate import decode_one_token, prefill

        self.cache.reset(0)
        rows = [prefill(self.backend, self.cache, 0, [ids[:1]])[0]]
        rows += [decode_one_token(self.backend, self.cache, 0, [t])[0] for t in ids[1:]]
        return np.stack(rows)

    def step_for_profile(self) -> Any:
        """(cache, decode one token) for the allocation measurement."""
        from kvedge.runtime.generate import decode_one_token

        return self.cache, lambda token: decode_one_token(self.backend, self.cache, 0, [token])[0]


class TransformersSystem:
    """transformers `generate`, eager attention, use_cache=True, greedy; steps timed by a streamer."""

    def __init__(self, folder: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, dtype="float32", attn_implementation="eager"
        ).eval()

    def run(self, ids: list[int], steps: int) -> tuple[float, list[float]]:
        stamps: list[float] = []

        class Stamps:  # transformers' streamer protocol: put() per chunk of tokens, then end()
            def put(self, value: Any) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        tokens = self.torch.tensor([ids])
        started = time.perf_counter()
        with self.torch.no_grad():
            self.model.generate(
                tokens,
                attention_mask=self.torch.ones_like(tokens),
                max_new_tokens=steps + 1,
                min_new_tokens=steps + 1,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
                streamer=Stamps(),
            )
        # stamps[0]: the prompt (before prefill); stamps[1]: first token; then one per step
        return stamps[1] - started, list(np.diff(stamps[1:]))

    def next_token_logits(self, ids: list[int]) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids]), use_cache=False).logits[0].numpy()


class OrtGenaiSystem(Steppable):
    """onnxruntime-genai Generator; greedy; max_length fixes its shared KV buffer size."""

    def __init__(self, folder: Path, threads: int, max_len: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(folder))
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}})
        )
        self.model = og.Model(config)
        self.max_len = max_len

    def _generator(self) -> Any:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_len, do_sample=False)
        return self.og.Generator(self.model, params)

    def start(self, ids: list[int]) -> None:
        self.generator = self._generator()
        self.generator.append_tokens(np.asarray(ids, np.int32))
        self.generator.generate_next_token()  # picks the first token from the prompt's logits

    def step(self) -> None:
        self.generator.generate_next_token()  # runs the model on the previous token, then picks

    def next_token_logits(self, ids: list[int]) -> np.ndarray:
        generator = self._generator()
        rows = []
        for t in ids:
            generator.append_tokens(np.asarray([t], np.int32))
            rows.append(np.array(generator.get_logits()).reshape(-1))
        return np.stack(rows)


class LlamaCppSystem(Steppable):
    """llama.cpp through llama-cpp-python `eval` (its defaults otherwise: n_batch 512, f16 KV)."""

    def __init__(self, gguf: Path, threads: int, max_len: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=max_len, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))

    def start(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)
        self.token = int(np.argmax(self._last_logits()))

    def step(self) -> None:
        self.llm.eval([self.token])
        self.token = int(np.argmax(self._last_logits()))

    def next_token_logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        rows = []
        for t in ids:
            self.llm.eval([t])
            rows.append(self._last_logits().copy())
        return np.stack(rows)
