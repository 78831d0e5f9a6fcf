"""The TensorRT engine contract: what `kvedge export --target tensorrt` writes and `TrtBackend` reads.

Files added to the artifact folder::

    model.engine          serialized engine
    engine_manifest.json  `EngineManifest`: format + version, what it was built from and with,
                          and for which GPU

One engine, two optimization profiles (B = max_batch, P = max_prefill, L = the export's max_len,
R = max_rows), over the graph inputs `Manifest.graph_inputs()` lists::

    PREFILL_PROFILE  "batch" axes 1..B, "seq" axes 1..P, "rows" axes 1..R
    DECODE_PROFILE   "batch" axes 1..B, "seq" axes 1, "rows" axes 1
    both             past K/V [1..B, kv_heads, L, head_dim]: only the batch axis varies

"rows" is the second axis of a "rows"-logits graph's last_index [batch, rows] and logits [batch,
rows, vocab]: R = `VERIFY_TOKENS` there (`logits_rows`), so a speculative verify of n <= R tokens
runs on the prefill profile and gets n logits rows per sequence; a prompt chunk asks for one.
Engines built before kvedge recorded `max_rows` took one row in both profiles, and their
manifests load with max_rows 1: they decode one token per step (`EngineManifest.verify_refusal`).

The runtime sizes its input/output buffers for (B, P, R) from the same graph specs and picks the
profile by the call's sequence length (`profile_for`; `EngineManifest.call_refusal` says which
calls fit). An engine runs only on the TensorRT version and the GPU
it was built for: `EngineManifest.check_runtime` refuses any other, naming both sides.

Two TensorRT flavours build engines (`TENSORRT_FLAVOURS`): Jetson's (and x86 CUDA's) `tensorrt`,
which `TrtBackend` runs, and TensorRT for RTX's `tensorrt_rtx`, whose builder runs ahead of time
without a GPU, so CI proves the graph parses and builds. The engine manifest records which one
built the engine; an engine of one flavour never loads under the other. Both build strongly typed
networks: the engine computes in the dtypes of the graph, whose precision the manifest records.

Which `--device` runs which export is `device_refusal`'s to say, from the graph's variant, cache
dtype and logits mode (an `ExportRecipe` and a `Manifest` both give them): the runtime refuses what
it refuses, and the planner never plans or recommends it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from kvedge import __version__
from kvedge.contract.header import Header, check_header, decode_json, read_artifact
from kvedge.contract.manifest import (
    PACKED_KV_DTYPES,
    PREFILL_CHUNK,
    QUANTIZED_KV_DTYPES,
    VERIFY_TOKENS,
    Manifest,
)
from kvedge.errors import ArtifactMismatch, KvedgeError

ENGINE_FILE = "model.engine"
ENGINE_MANIFEST_FILE = "engine_manifest.json"
ENGINE_FORMAT = "kvedge-engine"
# 2: strongly typed engines; `precision` (the graph's) and `strongly_typed` replace version 1's
# `fp16` (the weakly typed builder's FP16 flag)
ENGINE_VERSION = 2
PREFILL_PROFILE, DECODE_PROFILE = 0, 1


@dataclass(frozen=True)
class ProfileSizes:
    """The profiles' sizes an engine is built with (B and P above): `kvedge engine`'s flags, and a
    model recipe's TensorRT profile (configs/models). Apart from `ExportRecipe`: one export is
    built into engines of other sizes without exporting again. A field's type states what a
    recipe may give it; the builder checks them against the export (`EngineOptions.check`)."""

    # longest prefill chunk: the runtime prefills in chunks of it
    max_prefill: Annotated[int, Meta(ge=1)] = PREFILL_CHUNK
    max_batch: Annotated[int, Meta(ge=1)] = 1  # most sequences per call


def build_here(folder: str | Path = "DIR") -> str:
    """The command that builds export `folder`'s engine on this device. `kvedge engine` needs no
    torch, so a Jetson has it; `kvedge export --target tensorrt` needs torch, which it has not."""
    return f"`kvedge engine {folder}`"


def rebuild(folder: str | Path = "DIR") -> str:
    return f"rebuild the engine on this device with {build_here(folder)}"


REBUILD = rebuild()

# `--device`: what runs an artifact: onnxruntime on the CPU or CUDA, or its TensorRT engine
DEVICES = ("cpu", "cuda", "tensorrt")
# the cache dtype of the one in-place export onnxruntime's CUDA provider runs (`device_refusal`)
CUDA_IN_PLACE_KV_DTYPE = "float16"
# Python module -> product name. Same ONNX importer code; RTX is strongly typed and builds ahead of time.
TENSORRT_FLAVOURS = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT for RTX"}
# The oldest TensorRT kvedge claims (JetPack 6.2's). Its ONNX importer is checked statically
# against every TensorRT-claimed graph (`kvedge.export.trt_compat`); docs name it from here.
OLDEST_TENSORRT = "10.3"


def device_refusal(device: str, variant: str, kv_dtype: str, logits: str) -> str | None:
    """Why `device` cannot run an export of graph `variant` over a `kv_dtype` cache returning
    `logits`, or None. The CPU runs every export. cuda: the portable graph, and of the in-place
    `ort` graphs only the float16-cache one: onnxruntime's CUDA GroupQueryAttention has float16 and
    bfloat16 kernels only and kvedge's INT8 attention kernel is CPU-only, so the float32- and
    int8-cache `ort` graphs' attention would run on the CPU with each layer's whole past copied to
    the host and the present back every step. tensorrt: the portable graph (TensorRT's parser
    refuses the `ort` graph's onnxruntime ops) with "rows" or "last" logits ("all" is [batch, seq,
    vocab] for every prompt position, more than a small device holds). A graph with per-slot
    states (hybrid models: LFM2, Qwen3.5) runs wherever its variant does: every backend binds
    them as it binds the pool."""
    if device not in DEVICES:
        raise KvedgeError(f"--device {device!r} is not allowed; allowed: {list(DEVICES)}")
    if device == "cuda" and variant == "ort" and kv_dtype != CUDA_IN_PLACE_KV_DTYPE:
        if kv_dtype in (*QUANTIZED_KV_DTYPES, *PACKED_KV_DTYPES):
            attention = f"kvedge's {kv_dtype.upper()} attention kernel, CPU only"
        else:
            attention = (
                f"GroupQueryAttention over a {kv_dtype} cache, whose CUDA kernels take float16/bfloat16 only"
            )
        return (
            f"--device cuda cannot run this {variant!r}-variant export: its attention ({attention}) "
            "would run on the CPU with the whole cache copied every step; for cuda export with --variant "
            f"ort --kv-dtype {CUDA_IN_PLACE_KV_DTYPE} (the cache written in place on the device) or "
            "--variant portable"
        )
    if device == "tensorrt" and variant != "portable":
        return (
            f"--device tensorrt runs the portable graph (standard ONNX ops) only, not --variant {variant!r} "
            "(TensorRT's parser refuses its onnxruntime ops); export with --variant portable"
        )
    if device == "tensorrt" and logits == "all":
        return (
            "--device tensorrt needs --logits rows or last, not 'all': [batch, seq, vocab] logits for "
            "every prompt position would not fit a small device"
        )
    return None


def profile_for(seq: int) -> int:
    """The optimization profile a call of `seq` tokens per row runs on."""
    return DECODE_PROFILE if seq == 1 else PREFILL_PROFILE


def logits_rows(manifest: Manifest) -> int:
    """Logits rows per sequence the prefill profile of an engine over `manifest`'s graph takes:
    a "rows" graph's verify asks for up to `VERIFY_TOKENS`; a "last" graph returns one."""
    return VERIFY_TOKENS if manifest.logits == "rows" else 1


@dataclass(frozen=True)
class GpuInfo:
    name: str  # "Orin" on every Jetson Orin module
    compute_capability: str  # "8.7"
    multiprocessors: int  # tells an Orin Nano (8) from an AGX Orin 64GB (16)

    def describe(self) -> str:
        if not self.multiprocessors:  # an ahead-of-time build, made with no GPU present
            return self.name
        return f"{self.name} (sm_{self.compute_capability.replace('.', '')}, {self.multiprocessors} SMs)"


@dataclass(frozen=True)
class EngineManifest:
    """What `model.engine` was built from, with which TensorRT, for which GPU (engine_manifest.json)."""

    source_fingerprint: str  # the model manifest's: which weights
    onnx_fingerprint: str  # the model manifest's: which graph
    tensorrt_version: str
    device_name: str
    compute_capability: str
    multiprocessors: int
    max_batch: int
    max_prefill: int
    precision: str  # the graph's (`Manifest.precision`): the dtype the engine computes in
    strongly_typed: bool  # what the built network said of itself (`build_engine` builds no other)
    workspace_bytes: int
    tensorrt_flavour: str = "tensorrt"  # a `TENSORRT_FLAVOURS` key; absent in files from before it existed
    # logits rows per sequence the prefill profile takes (`logits_rows`); absent in files from
    # before it existed, whose engines took one in both profiles (same format version: the
    # default says what those engines are, and an older kvedge runs a newer engine as before)
    max_rows: int = 1
    format: str = ENGINE_FORMAT
    format_version: int = ENGINE_VERSION
    kvedge_version: str = __version__

    @property
    def gpu(self) -> GpuInfo:
        return GpuInfo(self.device_name, self.compute_capability, self.multiprocessors)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def load(cls, folder: str | Path) -> EngineManifest:
        path = Path(folder) / ENGINE_MANIFEST_FILE
        if not path.is_file():
            raise KvedgeError(
                f"{folder}: no {ENGINE_MANIFEST_FILE}; build one on this device with {build_here(folder)}"
            )
        data = decode_json(path.read_bytes(), str(path))
        return read_artifact(data, cls, Header(ENGINE_FORMAT, ENGINE_VERSION), str(path), rebuild(folder))

    def check_model(self, manifest: Manifest) -> None:
        """Refuse an engine built from another model or graph than the folder's model.onnx."""
        built = {"graph": self.onnx_fingerprint}
        found = Header(self.format, self.format_version, model=self.source_fingerprint, made_from=built)
        folder = {"graph": manifest.onnx_fingerprint}
        expected = Header(ENGINE_FORMAT, ENGINE_VERSION, model=manifest.source_fingerprint, made_from=folder)
        check_header(ENGINE_FILE, found, expected, REBUILD)

    @property
    def built_with(self) -> str:
        return (
            f"{TENSORRT_FLAVOURS.get(self.tensorrt_flavour, self.tensorrt_flavour)} {self.tensorrt_version}"
        )

    def verify_refusal(self) -> str | None:
        """Why this engine cannot verify a speculative step (up to `VERIFY_TOKENS` logits rows per
        sequence in one call), or None; the graph's own answer is `Manifest.verify_refusal`."""
        if self.max_prefill < VERIFY_TOKENS:
            return (
                f"speculative decoding is off for this TensorRT engine: its prefill profile takes "
                f"{self.max_prefill} tokens per call, a verify up to {VERIFY_TOKENS}; it decodes one "
                f"token per step. To speculate, rebuild it with --max-prefill {VERIFY_TOKENS} or more"
            )
        if self.max_rows >= VERIFY_TOKENS:
            return None
        return (
            f"speculative decoding is off for this TensorRT engine: its prefill profile takes "
            f"{self.max_rows} logits row per sequence, a verify needs up to {VERIFY_TOKENS} (engines "
            "built before kvedge recorded max_rows take one); it decodes one token per step. "
            f"To speculate, {REBUILD}"
        )

    def call_refusal(self, batch: int, seq: int, rows: int) -> str | None:
        """Why a call of `batch` sequences x `seq` tokens asking for `rows` logits rows of each
        does not fit this engine's profiles, or None."""
        if batch > self.max_batch or seq > self.max_prefill:
            return (
                f"a call of {batch} rows x {seq} tokens exceeds the engine's profiles "
                f"({self.max_batch} rows x {self.max_prefill} tokens); rebuild it with a larger "
                "--max-batch or --max-prefill"
            )
        most = 1 if profile_for(seq) == DECODE_PROFILE else self.max_rows
        if rows > most:
            return (
                f"a call of {seq} tokens asking for {rows} logits rows per sequence exceeds the "
                f"engine's profile for it ({most} rows)"
            )
        return None

    def check_runtime(
        self, tensorrt_version: str, gpu: GpuInfo, flavour: str = "tensorrt", folder: str | Path = "DIR"
    ) -> None:
        """Refuse an engine (of export `folder`) built by another TensorRT flavour or version or
        for another GPU, naming both sides and the command that rebuilds it."""
        if (flavour, tensorrt_version) != (self.tensorrt_flavour, self.tensorrt_version):
            raise ArtifactMismatch(
                f"the engine was built with {self.built_with}, this machine has "
                f"{TENSORRT_FLAVOURS.get(flavour, flavour)} {tensorrt_version}; {rebuild(folder)}"
            )
        if gpu != self.gpu:
            raise ArtifactMismatch(
                f"the engine was built for {self.gpu.describe()}, this machine has "
                f"{gpu.describe()}; {rebuild(folder)}"
            )
