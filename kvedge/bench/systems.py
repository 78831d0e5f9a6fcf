"""The systems the benchmark compares, behind one small interface.

A `SystemSpec` is plain data (picklable, so a child process can build it for the memory
measurement); `SystemSpec.build(threads)` loads the system and returns a `System`:

    run(ids, steps)          fresh sequence: prefill `ids`, pick the first token greedily, then
                             `steps` greedy decode steps -> (time to first token, [step seconds])
    next_token_logits(ids)   teacher-forced next-token logits at every position [len(ids), vocab]

Systems that can be driven one step at a time (all but transformers, whose `generate` is one
call) are `steppable`: `start(ids)` prefills and picks the first token, `timed_step()` decodes
one and says how long it took; the benchmark interleaves their decode steps so neighbouring
systems see the same machine load.

Peers run in a child process each (`ChildSystem`): a crash in their native code (llama-cpp-python
0.3.36 segfaulted in `eval` on a machine with AVX-512/AMX) ends that child only, and every later
call on it raises `SystemCrashed`, which the benchmark reports as "crashed" for that system.

Each peer is driven the way its users drive it: kvedge through its prefill/decode functions,
Hugging Face transformers through `generate` (eager attention, use_cache=True) timed by a
streamer, onnxruntime-genai through its Generator (max_length = the kvedge max_len, so its
shared past/present buffer has the same size), llama.cpp through llama-cpp-python's `eval`.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvedge.errors import KvedgeError

# "debug-crash" is BenchConfig.debug_crashing_peer's test-only peer (CrashingSystem)
KINDS = ("kvedge", "transformers", "onnxruntime-genai", "llama.cpp", "debug-crash")


class System(Protocol):
    steppable: bool  # start / timed_step are available

    def run(self, ids: list[int], steps: int) -> tuple[float, list[float]]: ...

    def next_token_logits(self, ids: list[int]) -> np.ndarray: ...


class SystemCrashed(Exception):
    """A system's child process died while serving a call; the message says how."""


class Steppable:
    """`run` in terms of `start` (prefill + first token) and `step` (one decode step)."""

    steppable = True

    def start(self, ids: list[int]) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def timed_step(self) -> float:
        """One decode step; its seconds."""
        started = time.perf_counter()
        self.step()
        return time.perf_counter() - started

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
    artifact_bytes: int = 0  # the model files it loads (`measure.artifact_bytes`)
    reference_for: str | None = None  # exact-size twin: name of the max_len-2048 system it checks
    threads: int = 0  # 0: the run's (first) thread count
    threads_of: str | None = None  # this system again at another thread count: the first one's name
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
        if self.kind == "debug-crash":
            return CrashingSystem()
        raise KvedgeError(f"system kind {self.kind!r} is unknown; known: {list(KINDS)}")


class KvedgeSystem(Steppable):
    """An exported artifact on kvedge's runtime: backend + one-slot cache, greedy."""

    def __init__(self, folder: Path, threads: int, device: str = "cpu") -> None:
        from kvedge.contract import Manifest
        from kvedge.runtime.cache import KVCache
        from kvedge.runtime.registry import open_backend

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

    steppable = False

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
        self.max_len = max_len + 1  # a prompt of max_len tokens still gets its first token

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


class CrashingSystem(Steppable):
    """Test-only peer (`BenchConfig.debug_crashing_peer`): prefills at once, and its process dies of
    a segmentation fault (a read of address 0) on the first decode step the benchmark times, as a
    peer's native code may. Warm-up and prefill cases (`run`) pass."""

    def start(self, ids: list[int]) -> None:
        pass

    def step(self) -> None:
        pass

    def timed_step(self) -> float:
        ctypes.string_at(0)
        raise AssertionError("unreachable: reading address 0 ends the process")

    def next_token_logits(self, ids: list[int]) -> np.ndarray:
        ctypes.string_at(0)
        raise AssertionError("unreachable: reading address 0 ends the process")


class ChildSystem:
    """A system built and driven in a child process of its own (spawned, so no state is shared):
    a crash there ends the child, and the call raises SystemCrashed instead of taking the
    benchmark down. Times come from the child, taken around the call itself, so the pipe's round
    trip is not counted."""

    def __init__(self, spec: SystemSpec, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(spec, threads, theirs), daemon=True)
        self._process.start()
        theirs.close()
        self.steppable: bool = self._call("build")

    def _call(self, method: str, *args: Any) -> Any:
        try:
            self._conn.send((method, args))
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(10)
            raise SystemCrashed(exit_text(self._process.exitcode)) from None
        if not ok:
            raise KvedgeError(f"{method} failed in the system's process: {value}")
        return value

    def run(self, ids: list[int], steps: int) -> tuple[float, list[float]]:
        return self._call("run", ids, steps)

    def start(self, ids: list[int]) -> None:
        self._call("start", ids)

    def timed_step(self) -> float:
        return self._call("timed_step")

    def next_token_logits(self, ids: list[int]) -> np.ndarray:
        return self._call("next_token_logits", ids)

    def peak_rss_mib(self) -> float:
        """The child's peak resident set size (VmHWM) so far."""
        return self._call("peak_rss_mib")

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("close", ()))
            self._process.join(30)
        self._conn.close()


def exit_text(code: int | None) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it)."""
    if code is None:
        return "its process stopped answering"
    if code < 0:
        return f"its process was killed by {signal.Signals(-code).name}"
    return f"its process exited with status {code}"


def vm_hwm_mib() -> float:
    """This process's peak resident set size. VmHWM, not ru_maxrss: the latter survives fork + exec
    and would report the parent's peak."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB -> MiB


def _serve(spec: SystemSpec, threads: int, conn: Connection) -> None:
    """The child's loop: (method, args) in, (ok, value or error text) out, until "close"."""
    system: Any = None
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent is gone
            return
        if method == "close":
            return
        try:
            if method == "build":
                system = spec.build(threads)
                value = system.steppable
            elif method == "peak_rss_mib":
                value = vm_hwm_mib()
            else:
                value = getattr(system, method)(*args)
        except Exception as exc:  # a Python error in the peer: the parent raises it as KvedgeError
            conn.send((False, f"{type(exc).__name__}: {exc}"))
        else:
            conn.send((True, value))
