"""Memory planner: does a model with S cache slots of C tokens fit in a byte budget?

The estimate, per (slots, context, kv dtype)::

    total = weights + load + kv + states + activations + runtime

weights      export folder: bytes of model.onnx (+ model.onnx.data). Recipe: what `kvedge export`
             writes for the weight form (`ExportRecipe`: --weights, --variant, --block-size,
             --outlier-channels, --head-bits, --decode-matmuls). float32/float16: param_count x 4/2.
             int8/int4 (`kvedge/export/quantize.py`, `graph.py`): each projection [K, N] (fused
             QKV, O, fused gate/up, down, and the LM head at its head bits) stores its codes
             (K N bits/8), a float scale per block of `block_size` rows (K/bs x N), the second
             product's rows (block offsets, assumed present, + the kept channels: (K/bs + kept) x
             N floats) and its side inputs (the kept indices; portable: and the [K] mask);
             with `--variant ort` and kvedge's decode matmuls the graph holds
             the decode form too: the codes again with float16 scales and minimums
             and float16 kept rows. A tied embedding table is the head's blocks (the runtime
             looks rows up there); an untied one is 8-bit codes with a float scale and offset
             per block (embeddings.bin); everything else (norms, biases) is param_count less
             the projections, the head and the table, 4 bytes each (2 in a float16 graph).
             Checked against real exports: a random 2-layer llama
             (tests/test_planner.py, five forms) 0.8-2.2% (35-52 KiB) under the files, the
             graph's own bytes and RoPE tables not counted; SmolLM2-135M `--weights int8
             --outlier-channels 0`: planned 294,107,904, files 291,490,818 (+0.9%: its Q8_0 LM
             head needs no block offsets, 3.5 MB the planner assumes).
load         what the backend holds beyond the weight bytes. onnxruntime CPU, measured per form
             (`CPU_HELD`: bytes held once loaded and stepped, as a multiple of the weight files):
             float32 weights 1.3 (MLAS's prepacked copy replaces the file's pages, plus padding);
             float16 weights 2.6 in a float32 graph (its Casts are folded to a float32 copy at
             load, then prepacked) and 2.45 in a float16 graph (no float16 kernels on x86: the
             same widening); int8 / int4 weights 1.8 / 2.05, 2.0 / 2.4 in a float16 graph (the
             MatMulNBits kernels' packed blocks beside the graph's; an ort export with one form
             of its weights or two alike). Measured with onnxruntime
             1.2x on SmolLM2-135M (peak RSS of a fresh process after load and two decode steps,
             less the tokenizer, which `runtime` counts, and the KV pool; every form within 10%:
             tests/test_real_model.py); a larger model's fixed parts weigh less, so these
             over-count it. GPU backends (onnxruntime CUDA, TensorRT): 1.0 x weights,
             ASSUMED (not measured): on unified memory the host copy read from disk and the
             device copy coexist while the model loads (TensorRT reads the engine memory-mapped,
             `backends.trt.deserialize_engine`: page cache the kernel can drop, kept in the term
             until device_tests/memory.py measures it); plus a float32 graph's float32 copy of
             float16-stored weights (`widened_bytes`, 2 x the file: onnxruntime folds the Casts).
kv           `CacheGeometry(max_len=C, dtype=kv).bytes_held(C) x S`: the KV `KVCache` allocates
             (tests/test_planner.py checks it). A quantized cache's scales belong to
             CacheGeometry and appear here with no change to this module. A hybrid model's KV
             covers its attention layers only (`kv_layers`). The runtime's token record (8 bytes
             per cached token) is not cache geometry and sits in the margin of `runtime`.
states       a hybrid model's per-slot states (`CacheGeometry.states`: LFM2's convolution, Qwen3.5's
             Gated DeltaNet layers), fixed whatever the context: S x `state_bytes_per_slot()` x
             (1 + MAX_SNAPSHOTS), the pool `KVCache` allocates plus the snapshots it keeps of each
             slot's states where a later turn may resume (at most MAX_SNAPSHOTS each,
             `KVCache.snapshot`). 0 for other models.
activations  the largest single call: one sequence prefilling a chunk of s = PREFILL_CHUNK tokens,
             or one decode step for all S slots. It is dominated by the attention scores of one
             layer, [kv_heads, g*s, C+s] float32 (the graph never copies the cache). Measured
             with onnxruntime 1.32 CPU, SmolLM2-135M, chunk 256, C = 2048: peak 76-152 MiB
             (arena growth depends on call order), i.e. up to 7.5 score-sized buffers; the
             estimate counts 8, plus 3 MLP-sized and 4 hidden-sized buffers, the logits, and
             the new tokens' K/V twice (the graph's output and the runtime's copy of it); a hybrid's
             present states likewise, per row (not measured; a Gated DeltaNet chunk's own [v heads,
             s, s] buffers, 32 MiB at 256 tokens for 32 heads, are not counted).
runtime      Python + numpy + onnxruntime + tokenizer: 96 MiB (measured 70-75 MiB). A GPU
             backend adds the CUDA context and libraries (cuBLAS, cuDNN or TensorRT): 1 GiB,
             ASSUMED, not measured (no GPU was available when this was written); device_tests
             is where it gets measured.

Checked (cpu preset): SmolLM2-135M float32, max_len 2048, 1/2/4/8 slots each prefilled with 600
tokens then decoding: measured peak RSS 1078/1178/1424/1718 MiB, planned 1045/1135/1315/1675
(3-8% under: the load term, 1.3 x weights, is measured after two decode steps, not 600-token
prefills, whose arena growth the activations term counts at 8 score buffers).

What fits instead: when no cell of a plan fits, `what_fits` offers the smallest change that
makes its smallest cell (fewest slots, shortest context) fit. It weighs fewer slots; every other
form of a recipe that `kvedge export` makes and the chosen `--device` runs (variant, precision,
weights, head bits, cache dtype: `device_forms`; an export's other cache dtypes, a re-export);
a shorter --max-len, alone and with each form. A change must save bytes at that cell and never
make the weights (with what loading them holds) or the cache's bytes per token bigger. The
longest context first (a shorter one changes what the model can do most), then a KL within the
bar (`quality_tier`), then the fewest bytes saved, then the fewest options. A form the device
refuses (`kvedge.contract.engine.device_refusal`, the runtime's rule) gets no table and no smallest
change: one line saying why, and the nearest form it runs (`nearest_runnable`).

What to run: `recommend` gives one form per budget (a board profile) and GPU device (cuda,
tensorrt; `RECOMMENDED_DEVICES` says why not the CPU), the form `kvedge plan` prints last and
the README and docs/JETSON.md state per board: of the forms the device runs whose KL against the
float32 model was measured (`WEIGHTS_KL`, `PRECISION_KL`, `CACHE_KL`, summed over a form's
choices) within `QUALITY_BAR`, the one holding the most slots at the recipe's max_len; ties to
the fewer bytes, then the lower KL. That KLs of separate choices add is an approximation the
bench supports: ort int8 weights 0.0009 + the INT8 cache 0.0003 = 0.0012, measured together 0.0013.

Budgets: a board profile's `memory_bytes` minus a reserve for the kernel, carveouts and the OS
(1.5 GiB by default, an estimate for a headless L4T; a desktop session needs about 1 GiB
more), or what this process may allocate on the live machine (`live_budget`: MemAvailable from
/proc/meminfo, or a container's cgroup limit or a ulimit where lower). On Jetson's unified memory
MemAvailable is the right figure, not cudaMemGetInfo (NVIDIA's "CUDA for Tegra" app note, "Estimating Total
Allocatable Device Memory on an Integrated GPU Device").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvedge.configs import Architecture, BoardProfile, ModelRecipe, load_board, load_recipe
from kvedge.contract import (
    EXPORTED_KV_DTYPES,
    KV_DTYPES,
    MANIFEST_FILE,
    ONNX_FILE,
    PRECISIONS,
    PREFILL_CHUNK,
    QUANTIZED_KV_DTYPES,
    VARIANTS,
    WEIGHT_FORMATS,
    CacheGeometry,
    ExportRecipe,
    Manifest,
    export_kv_dtypes,
    graph_files,
)
from kvedge.contract.engine import DEVICES, device_refusal
from kvedge.contract.recipe import check_kv_dtype
from kvedge.errors import KvedgeError
from kvedge.files import GiB, MiB, human
from kvedge.machine import Available, available_memory
from kvedge.runtime.cache import MAX_SNAPSHOTS

FLOAT32 = 4  # the graph computes activations in float32
SCORE_BUFFERS, MLP_BUFFERS, HIDDEN_BUFFERS, PRESENT_COPIES = 8, 3, 4, 2  # see the module docstring
BOARD_RESERVE = 1536 * MiB
DEFAULT_SLOTS = (1, 2, 4, 8, 16)
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MIN_CONTEXT = 16  # the shortest cache an export takes (configs.ExportSettings.max_len)


# onnxruntime CPU: bytes a session holds once loaded and stepped, as a multiple of the weight
# files, by (graph precision, weights) (module docstring, "load")
CPU_HELD = {
    ("float32", "float32"): 1.3,
    ("float32", "float16"): 2.6,
    ("float32", "int8"): 1.8,
    ("float32", "int4"): 2.05,
    ("float16", "float16"): 2.45,
    ("float16", "int8"): 2.0,
    ("float16", "int4"): 2.4,
}


# What a two-form export's decode form buys (`ExportRecipe.two_forms`): decode ms/token with one
# form (--decode-matmuls onnxruntime) over with two, by weights, at 64 and 2000 tokens of context;
# SmolLM2-135M, INT8 cache, onnxruntime CPU, 1 thread, on an AVX2 machine (kvedge.QuantMatMul's
# "avx2" path; other CPUs' paths unmeasured): docs/PERFORMANCE.md, "Two forms of the weights"
SECOND_FORM_DECODE_GAIN = {"int8": (1.12, 1.06), "int4": (1.23, 1.14)}


def second_form_note(weights: str, decode_bytes: int | None = None) -> str:
    """What the decode form of a two-form export with `weights` costs (`decode_bytes` of its
    files, when known) and buys (`SECOND_FORM_DECODE_GAIN`)."""
    short, long = SECOND_FORM_DECODE_GAIN[weights]
    cost = (
        f"{human(decode_bytes)} of these are the decode form" if decode_bytes else "prefill and decode forms"
    )
    return (
        f"{cost}: decode {short:.2f}x as fast as one form at 64 tokens of context, {long:.2f}x at 2000 "
        "(measured: SmolLM2-135M, an AVX2 CPU); --decode-matmuls onnxruntime keeps one form"
    )


@dataclass(frozen=True)
class Overheads:
    """What a backend costs besides weights, cache and activations."""

    runtime_bytes: int
    note: str
    cpu: bool  # onnxruntime on the CPU: `CPU_HELD`; else a GPU backend's assumed terms

    def load(self, model: ModelFootprint) -> int:
        """Bytes held at load beyond the weight files (module docstring, "load")."""
        if self.cpu:
            held = CPU_HELD[model.precision, model.weights_dtype] * model.weights_bytes
            return int(held) - model.weights_bytes
        return model.weights_bytes + model.widened_bytes

    def load_note(self, model: ModelFootprint) -> str:
        if self.cpu:
            return f"onnxruntime holds {CPU_HELD[model.precision, model.weights_dtype]:g} x weights"
        return "1 x weights" + (" + their float32 copy" if model.widened_bytes else "")


_GPU = Overheads(96 * MiB + GiB, "CUDA/TensorRT on unified memory, assumed, not measured", cpu=False)
# by `--device` (contract.engine.DEVICES): where the model runs
_CPU = Overheads(96 * MiB, "onnxruntime CPU, measured", cpu=True)
OVERHEADS = {device: _CPU if device == "cpu" else _GPU for device in DEVICES}


# model.onnx bytes of the 16 nodes that split a float32 portable graph's quantized product input
# in two (`kvedge.export.graph.quant_matmul._product`): 313,736 over SmolLM2-135M's 121
SPLIT_GRAPH_BYTES = 2600


def quantized_matmul_bytes(k: int, n: int, bits: int, form: ExportRecipe) -> int:
    """Bytes `kvedge export` stores for one quantized w [K, N] (module docstring, `graph.py`'s
    `matmul_weight` and `_quant_matmul`)."""
    blocks, kept = k // form.block_size, form.kept_channels
    codes, real = k * n * bits // 8, 2 if form.half else FLOAT32  # a float16 graph's floats are float16
    total = codes + real * blocks * n + real * (blocks + kept) * n  # scales, second product
    total += 8 * kept  # the kept channels' indices (kvedge.SideInputs', or a Gather's)
    if form.variant == "portable" and kept:  # side inputs from standard ops: the 0/1 mask [K]
        total += real * k
    if form.variant == "portable" and not form.half:  # the nodes splitting its input (`_product`)
        total += SPLIT_GRAPH_BYTES
    if form.two_forms and n % 64 == 0:  # decode form: codes, float16 scale + minimum, float16 rows
        total += codes + 2 * 2 * blocks * n + 2 * kept * n
    return total


def recipe_weight_bytes(a: Architecture, form: ExportRecipe) -> int:
    """The bytes of an export of architecture `a` in weight form `form` (module docstring)."""
    if not form.quantized:
        return a.param_count * form.bits // 8
    h = a.hidden_size
    matmuls = layer_matmuls(a)
    # a tied table is the head's blocks (the runtime looks embeddings up there); an untied model's
    # input table is 8-bit codes with a scale and an offset per block, beside its quantized head
    # (`kvedge.export.export.write_embedding_table`)
    table = h * a.vocab_size
    tables = 1 if a.tie_word_embeddings else 2
    rest = a.param_count - sum(k * n for k, n in matmuls) - tables * table  # float
    quantized = sum(quantized_matmul_bytes(k, n, form.bits, form) for k, n in matmuls)
    real = 2 if form.half else FLOAT32
    head = quantized_matmul_bytes(h, a.vocab_size, form.lm_head_bits, form)
    embeddings = 0 if a.tie_word_embeddings else table + 2 * real * (h // form.block_size) * a.vocab_size
    return real * rest + quantized + head + embeddings


def layer_matmuls(a: Architecture) -> list[tuple[int, int]]:
    """[K, N] of every projection of the layers, as the graph builder makes them (its `linear`
    calls): attention's fused QKV and O (Qwen3.5's output gate too), LFM2's convolution in
    [3 hidden] and out, Qwen3.5's Gated DeltaNet in (QKV, z, b, a fused) and out; every layer's fused
    gate/up and down."""
    q, kv, h, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, a.intermediate_size
    attention = [(h, q + 2 * kv), (q, h)] + ([(h, q)] if a.family == "qwen3_5_text" else [])
    if a.family == "lfm2":
        mixer = [(h, 3 * h), (h, h)]
    elif a.family == "qwen3_5_text":
        kd, vd = (
            a.linear_num_key_heads * a.linear_key_head_dim,
            a.linear_num_value_heads * a.linear_value_head_dim,
        )
        mixer = [(h, 2 * kd + 2 * vd + 2 * a.linear_num_value_heads), (vd, h)]
    else:
        mixer = attention
    kv_layers = set(a.kv_layers)
    return [m for layer in range(a.num_layers) for m in (attention if layer in kv_layers else mixer)] + [
        (h, 2 * i),
        (i, h),
    ] * a.num_layers


def recipe_note(a: Architecture, form: ExportRecipe) -> str:
    """What a recipe's weight bytes are: its parameters, the bits each costs on disk (codes,
    scales, offsets, kept channels and float tensors together) and the form."""
    bits = 8 * recipe_weight_bytes(a, form) / a.param_count
    return f"{a.param_count:,} params at {bits:.2f} bits each, {form.describe_weights()}"


@dataclass(frozen=True)
class ModelFootprint:
    """What the planner needs to know about a model, from an export folder or a recipe."""

    name: str
    origin: str  # the manifest or recipe file it came from
    weights_bytes: int
    weights_note: str
    geometry: CacheGeometry  # at the model's own max_len and kv dtype
    num_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    logits: str  # "last" or "all"
    max_context: int  # longest usable context
    fixed_context: bool  # an export's max_len is baked into its graph
    precision: str = "float32"  # the graph's (PRECISIONS)
    weights_dtype: str = "float32"  # how its weights are stored (WEIGHT_FORMATS)
    widened_bytes: int = 0  # float32 copy of float16-stored weights made at load (module docstring)
    form: ExportRecipe | None = None  # a recipe's export, its cache dtype the geometry's (None: an export)
    architecture: Architecture | None = None  # a recipe's, to plan other weight forms
    manifest: Manifest | None = None  # an export's
    forms_note: str = ""  # a two-form export's: its decode form's bytes and speed (`second_form_note`)

    @classmethod
    def from_export(cls, folder: str | Path) -> ModelFootprint:
        folder = Path(folder)
        manifest = Manifest.load(folder)
        files = graph_files(folder)
        if not (folder / ONNX_FILE).is_file():
            raise KvedgeError(f"{folder}: no {ONNX_FILE}; is this a `kvedge export` folder?")
        two_forms = manifest.weight_decode_matmuls == "kvedge"  # the graph holds kvedge.QuantMatMul
        return cls(
            name=folder.name,
            origin=str(folder / MANIFEST_FILE),
            weights_bytes=(weights := sum(p.stat().st_size for p in files)),
            weights_note=" + ".join(p.name for p in files) + f" ({manifest.weights_dtype})",
            # a float32 graph widens float16-stored weights; a float16 graph computes with them
            precision=manifest.precision,
            weights_dtype=manifest.weights_dtype,
            widened_bytes=widened_bytes(weights, manifest.precision, manifest.weights_dtype),
            geometry=manifest.geometry,
            num_heads=manifest.num_heads,
            hidden_size=manifest.hidden_size,
            # The manifest does not record the MLP width. Llama-family MLPs are 2.7-5.4 x hidden;
            # 4 x is close enough for a term that is small next to the attention scores.
            intermediate_size=4 * manifest.hidden_size,
            vocab_size=manifest.vocab_size,
            logits=manifest.logits,
            max_context=manifest.geometry.max_len,
            fixed_context=True,
            manifest=manifest,
            forms_note=second_form_note(manifest.weights_dtype) if two_forms else "",
        )

    @classmethod
    def from_recipe(cls, recipe: ModelRecipe, form: ExportRecipe | None = None) -> ModelFootprint:
        """`form` overrides the recipe's weights, e.g. int4 (`--weights int4`); its max_len and
        logits are the recipe's, and its cache dtype too where the form's graph takes it."""
        a = recipe.architecture
        model = cls(
            name=recipe.name,
            origin=str(recipe.path),
            weights_bytes=0,  # `with_form`'s
            weights_note="",
            architecture=a,
            geometry=recipe.geometry(),
            num_heads=a.num_heads,
            hidden_size=a.hidden_size,
            intermediate_size=a.intermediate_size,
            vocab_size=a.vocab_size,
            logits=recipe.export.logits,
            max_context=a.max_position_embeddings,
            fixed_context=False,
        )
        return with_form(model, _recipe_form(recipe, form))


def _recipe_form(recipe: ModelRecipe, form: ExportRecipe | None) -> ExportRecipe:
    if form is None:
        return recipe.export_recipe
    e = recipe.export
    form = dataclasses.replace(form, max_len=e.max_len, logits=e.logits)
    try:  # the recipe's cache dtype, where this graph takes it; else the graph's default
        return dataclasses.replace(form, kv_dtype=e.kv_dtype)
    except KvedgeError:
        return form


def with_form(model: ModelFootprint, form: ExportRecipe) -> ModelFootprint:
    """A recipe's footprint exported as `form` (its weights, graph precision and cache dtype)."""
    a = model.architecture
    if a is None:
        raise KvedgeError(f"{model.name} is an export whose weights are its files; other forms need a recipe")
    weights = recipe_weight_bytes(a, form)
    forms_note = ""
    if form.two_forms:  # the decode form's bytes: beyond the same export's with one form
        one_form = dataclasses.replace(form, decode_matmuls="onnxruntime")
        forms_note = second_form_note(form.weights, weights - recipe_weight_bytes(a, one_form))
    return dataclasses.replace(
        model,
        weights_bytes=weights,
        weights_note=recipe_note(a, form),
        precision=form.precision,
        weights_dtype=form.weights,
        widened_bytes=widened_bytes(weights, form.precision, form.weights),
        geometry=model.geometry.with_dtype(form.kv_dtype, form.kv_group_size or None),
        form=form,
        forms_note=forms_note,
    )


def widened_bytes(weights: int, precision: str, weights_dtype: str) -> int:
    """The float32 copy a float32 graph makes of float16-stored weights at load (its Casts of
    constants are folded), 2 x their bytes; a float16 graph computes with them as they are."""
    return 2 * weights if (precision, weights_dtype) == ("float32", "float16") else 0


def footprint(
    model: ModelFootprint | ModelRecipe | str | Path, form: ExportRecipe | None = None
) -> ModelFootprint:
    """`model` as an export folder (has manifest.json), a recipe, or a recipe name or path.

    `form` applies to recipes only: an export's weights are what its files hold.
    """
    if isinstance(model, ModelFootprint):
        found = model
    elif isinstance(model, ModelRecipe):
        return ModelFootprint.from_recipe(model, form)
    elif Path(model).is_dir():
        found = ModelFootprint.from_export(model)
    else:
        return ModelFootprint.from_recipe(load_recipe(model), form)
    if form:
        raise KvedgeError(
            f"--weights and its options apply to recipes only; {found.name} is an export whose weights "
            f"are its files ({found.weights_note})"
        )
    return found


@dataclass(frozen=True)
class Estimate:
    """Bytes one configuration needs, by part."""

    slots: int
    context: int
    kv_dtype: str
    weights: int
    load: int
    kv: int
    activations: int
    runtime: int
    states: int = 0  # a hybrid's per-slot states, their snapshots included (`state_bytes`)

    @property
    def total(self) -> int:
        return self.weights + self.load + self.kv + self.states + self.activations + self.runtime

    def breakdown(self) -> str:
        parts = ("weights", "load", "kv", *(("states",) if self.states else ()), "activations", "runtime")
        return ", ".join(f"{p} {human(getattr(self, p))}" for p in parts)


def kv_bytes(model: ModelFootprint, slots: int, context: int, kv_dtype: str | None = None) -> int:
    """Exact KV pool bytes (a hybrid's attention layers only), asked of CacheGeometry (the only
    place they are computed)."""
    geometry = dataclasses.replace(model.geometry, max_len=context).with_dtype(
        kv_dtype or model.geometry.dtype
    )
    return geometry.bytes_held(context) * slots


def state_bytes(model: ModelFootprint, slots: int) -> int:
    """A hybrid's per-slot states for `slots` slots, whatever the context: the pool and the
    snapshots `KVCache` keeps of each slot (module docstring, "states"); 0 for other models."""
    return slots * model.geometry.state_bytes_per_slot() * (1 + MAX_SNAPSHOTS)


def activation_bytes(model: ModelFootprint, slots: int, context: int) -> int:
    """Peak working set of one call: a prefill chunk of one sequence or a decode step of all slots."""
    chunk = min(PREFILL_CHUNK, context)
    return max(_call_bytes(model, 1, chunk, context), _call_bytes(model, slots, 1, context))


def _call_bytes(model: ModelFootprint, rows: int, seq: int, context: int) -> int:
    scores = rows * model.num_heads * seq * (context + seq)  # [rows, kv_heads, g*seq, context+seq]
    mlp = rows * seq * model.intermediate_size  # gate, up, their product
    hidden = rows * seq * model.hidden_size  # residual, normed input, attention output, ...
    logits = rows * (seq if model.logits == "all" else 1) * model.vocab_size
    present = PRESENT_COPIES * rows * seq * model.geometry.bytes_per_token()  # new K/V, all layers
    present += PRESENT_COPIES * rows * model.geometry.state_bytes_per_slot()  # each row's new states
    return FLOAT32 * (SCORE_BUFFERS * scores + MLP_BUFFERS * mlp + HIDDEN_BUFFERS * hidden + logits) + present


def estimate(
    model: ModelFootprint, slots: int, context: int, kv_dtype: str | None = None, device: str = "cpu"
) -> Estimate:
    if device not in OVERHEADS:
        raise KvedgeError(f"--device {device!r} is not allowed; allowed: {', '.join(OVERHEADS)}")
    if not isinstance(slots, int) or slots < 1:
        raise KvedgeError(f"slots={slots!r} must be a positive integer")
    overheads = OVERHEADS[device]
    return Estimate(
        slots=slots,
        context=context,
        kv_dtype=kv_dtype or model.geometry.dtype,
        weights=model.weights_bytes,
        load=overheads.load(model),
        kv=kv_bytes(model, slots, context, kv_dtype),
        activations=activation_bytes(model, slots, context),
        runtime=overheads.runtime_bytes,
        states=state_bytes(model, slots),
    )


def check_fits(
    model: ModelFootprint | ModelRecipe | str | Path,
    slots: int,
    budget_bytes: int,
    context: int | None = None,
    kv_dtype: str | None = None,
    device: str = "cpu",
) -> Estimate:
    """Return the estimate for `slots` sequences of `context` tokens, or raise saying by how much
    it does not fit. `model` is an export folder (weights come from its file sizes; a Manifest
    alone does not carry them), a recipe, or a recipe name or path. `context` defaults to the
    model's own max_len."""
    fp = footprint(model)
    context = context or fp.geometry.max_len
    need = estimate(fp, slots, context, kv_dtype, device)
    if need.total <= budget_bytes:
        return need
    fitting = next(
        (
            s
            for s in range(slots - 1, 0, -1)
            if estimate(fp, s, context, kv_dtype, device).total <= budget_bytes
        ),
        None,
    )
    if fitting:
        advice = f"at most {fitting} slot{'s' if fitting > 1 else ''} fit at this context"
    else:
        advice = "not even 1 slot fits: a shorter context, a smaller cache dtype or smaller weights"
    raise KvedgeError(
        f"{fp.name}: {slots} slots x {context} tokens ({need.kv_dtype} cache) need {human(need.total)} "
        f"but the budget is {human(budget_bytes)}: {human(need.total - budget_bytes)} over "
        f"({need.breakdown()}); {advice}"
    )


@dataclass(frozen=True)
class Budget:
    total_bytes: int
    reserve_bytes: int
    source: str

    @property
    def usable(self) -> int:
        return self.total_bytes - self.reserve_bytes


def live_budget(reserve_bytes: int = 0, available: Available | None = None) -> Budget:
    """What this process may still allocate on this machine (`kvedge.machine.available_memory`,
    unless given): MemAvailable (right for unified memory, where the GPU allocates from it), or
    less where a container's cgroup or a ulimit says so."""
    room = available or available_memory()
    if room is None:
        raise KvedgeError(
            "cannot read MemAvailable from /proc/meminfo, nor a cgroup or ulimit limit; give --profile "
            "or --memory-budget instead"
        )
    return Budget(room.bytes, reserve_bytes, f"{room.what} of this machine")


def board_budget(profile: BoardProfile, reserve_bytes: int = BOARD_RESERVE) -> Budget:
    return Budget(profile.memory_bytes, reserve_bytes, profile.name)


@dataclass(frozen=True)
class Plan:
    model: ModelFootprint
    budget: Budget
    device: str
    kv_dtype: str
    contexts: tuple[int, ...]
    slots: tuple[int, ...]
    cells: tuple[tuple[Estimate, ...], ...]  # [context][slots]

    def fits(self, cell: Estimate) -> bool:
        return cell.total <= self.budget.usable

    @property
    def anything_fits(self) -> bool:
        return any(self.fits(cell) for row in self.cells for cell in row)

    @property
    def refusal(self) -> str | None:
        """Why the plan's device cannot run its model over its cache dtype, or None."""
        return refusal(self.model, self.device, self.kv_dtype)

    @property
    def corner(self) -> Estimate:
        """The plan's smallest cell: its fewest slots at its shortest context."""
        return self.cells[self.contexts.index(min(self.contexts))][self.slots.index(min(self.slots))]


def refusal(model: ModelFootprint, device: str, kv_dtype: str) -> str | None:
    """Why `device` cannot run `model` over a `kv_dtype` cache (`device_refusal`, the runtime's
    rule), or None; None too for a footprint made by hand, neither an export nor a recipe."""
    made = model.form or model.manifest
    if made is None:
        return None
    return device_refusal(device, made.variant, kv_dtype, model.logits)


def make_plan(
    model: ModelFootprint,
    budget: Budget,
    device: str = "cpu",
    kv_dtype: str | None = None,
    slots: Sequence[int] = DEFAULT_SLOTS,
    contexts: Sequence[int] | None = None,
) -> Plan:
    """`model`'s totals by context and slots. A recipe's `kv_dtype` is its export's (an ort
    int8/int4 graph's decode form depends on it); an export's must be one its graph is exported
    with (a re-export)."""
    kv_dtype = kv_dtype or model.geometry.dtype
    if model.form is not None and kv_dtype != model.form.kv_dtype:
        model = with_form(model, dataclasses.replace(model.form, kv_dtype=kv_dtype))
    elif model.manifest is not None:
        check_kv_dtype(kv_dtype, model.manifest.variant, model.manifest.precision)
    if contexts is None:
        contexts = sorted({c for c in DEFAULT_CONTEXTS if c <= model.max_context} | {model.geometry.max_len})
    too_long = [c for c in contexts if c > model.max_context]
    if too_long:
        raise KvedgeError(
            f"context {too_long[0]} exceeds what {model.name} supports; allowed: 1..{model.max_context}"
        )
    cells = tuple(tuple(estimate(model, s, c, kv_dtype, device) for s in slots) for c in contexts)
    return Plan(model, budget, device, kv_dtype, tuple(contexts), tuple(slots), cells)


def render(plan: Plan) -> str:
    m, b, first = plan.model, plan.budget, plan.cells[0][0]
    per_token = m.geometry.with_dtype(plan.kv_dtype).bytes_per_token()
    overheads = OVERHEADS[plan.device]
    lines = [
        f"model        {m.name} ({m.origin})",
        f"weights      {human(m.weights_bytes)}: {m.weights_note}"
        + (f"\n{'':13}{m.forms_note}" if m.forms_note else ""),
        f"device       {plan.device} ({overheads.note}): runtime {human(first.runtime)}, "
        f"load {human(first.load)} ({overheads.load_note(m)})",
        f"kv cache     {plan.kv_dtype}: {per_token:,} bytes per token per slot" + _kv_layers_note(m.geometry),
        f"budget       {human(b.usable)} = {b.source} {human(b.total_bytes)}"
        f" - reserve {human(b.reserve_bytes)}",
        "",
        "total GiB by max_len (rows) and slots (columns); '-' does not fit",
    ]
    g = m.geometry.with_dtype(plan.kv_dtype)
    if g.states:
        lines[4:4] = [states_line(g)]
    if g.ring_layers:  # the per-token figure above counts every layer; ring layers stop at ring_len
        full = dataclasses.replace(g, ring_layers=(), window=0, ring_margin=0)
        lines[4:4] = [
            f"ring layers  {len(g.ring_layers)} of {g.num_layers} hold the last {g.ring_len} tokens "
            f"(window {g.window} + {g.ring_margin}): a {g.max_len}-token slot is "
            f"{human(g.bytes_per_slot())}, {g.bytes_per_slot() / full.bytes_per_slot():.3f} x "
            f"{human(full.bytes_per_slot())} at full length"
        ]
    lines.append(f"{'max_len':>8} " + "".join(f"{s:>8}" for s in plan.slots))
    for context, row in zip(plan.contexts, plan.cells, strict=True):
        cells = "".join(f"{c.total / GiB:>8.2f}" if plan.fits(c) else f"{'-':>8}" for c in row)
        mark = ""
        if context == m.geometry.max_len:
            mark = "   <- this export" if m.fixed_context else "   <- recipe max_len"
        elif m.fixed_context:
            mark = "   (needs re-export with --max-len)"
        lines.append(f"{context:>8} {cells}{mark}")
    return "\n".join(lines)


def _kv_layers_note(geometry: CacheGeometry) -> str:
    """Which layers the per-token figure covers, where not all of them hold KV (hybrids)."""
    if not geometry.states:
        return ""
    return f" ({geometry.num_layers} of {geometry.model_layers} layers hold KV)"


def states_line(geometry: CacheGeometry) -> str:
    """A hybrid's per-slot states beside its KV per token: what one slot holds whatever its length,
    and with the snapshots the runtime keeps."""
    per_slot = geometry.state_bytes_per_slot()
    kinds = " + ".join(f"{s.kind} {list(s.shape)}" for s in geometry.states)
    layers = len({i for s in geometry.states for i in s.layers})
    return (
        f"states       {per_slot:,} bytes per slot whatever its length ({kinds} {geometry.states[0].dtype} "
        f"on {layers} layers); {human(per_slot * (1 + MAX_SNAPSHOTS))} with the runtime's "
        f"{MAX_SNAPSHOTS} snapshots"
    )


def to_json(plan: Plan, recommended: Recommendation | None = None) -> str:
    """The plan's cells; `refused`: why its device cannot run it (then no cells); `fits_with`: the
    options of `what_fits` (null when none); `recommended`: `recommend`'s answer (recipes)."""
    change = what_fits(plan)
    refused = plan.refusal
    return json.dumps(
        {
            "fits_with": dict(change.options) if change else None,
            "refused": refused,
            "recommended": _recommendation_json(recommended),
            "model": plan.model.name,
            "budget_bytes": plan.budget.usable,
            "device": plan.device,
            "kv_dtype": plan.kv_dtype,
            "rows": []
            if refused
            else [
                {**dataclasses.asdict(c), "total": c.total, "fits": plan.fits(c)}
                for row in plan.cells
                for c in row
            ],
        },
        indent=2,
    )


def _recommendation_json(found: Recommendation | None) -> dict[str, Any] | None:
    if found is None:
        return None
    c = found.cell
    return {
        "export": found.export_flags,
        "engine": found.engine_command,
        "slots": c.slots,
        "max_len": c.context,
        "total": c.total,
        "kl": found.kl,
    }


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}


def parse_bytes(text: str) -> int:
    """'6GiB', '512MiB', '1.5G' or a plain byte count (units are binary)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in _UNITS:
        raise KvedgeError(f"size {text!r} is not allowed; allowed: bytes or a number with KiB, MiB or GiB")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise KvedgeError(f"{what} {text!r} is not allowed; allowed: positive integers separated by commas")
    return values


# --- what fits instead: `what_fits` ---------------------------------------------------------------

# the flags a form change names, with the ExportRecipe attribute each shows
FORM_FLAGS = (
    ("--variant", "variant"),
    ("--precision", "precision"),
    ("--weights", "weights"),
    ("--head-bits", "lm_head_bits"),
    ("--kv-dtype", "kv_dtype"),
)


@dataclass(frozen=True)
class Change:
    """Options that make a plan fit (or, for a form its device refuses, run), and that plan."""

    options: tuple[tuple[str, str], ...]  # ("--weights", "int4"), ...
    plan: Plan

    def describe(self) -> str:
        flags = " ".join(f"{flag} {value}" for flag, value in self.options)
        text = f"re-export with {flags}" if self.plan.model.fixed_context else flags
        form = self.plan.model.form
        if form is not None and {flag for flag, _ in self.options} & {flag for flag, _ in FORM_FLAGS}:
            text += f" ({quality_note(form, bool(self.plan.model.geometry.states), self.plan.device)})"
        return text


@dataclass(frozen=True)
class _Try:
    """A change `what_fits` weighs: its options, what it plans, and the cell it is judged by (the
    plan's smallest, the change applied: fewer slots, another form, or the new --max-len)."""

    options: tuple[tuple[str, str], ...]
    model: ModelFootprint
    kv_dtype: str
    slots: tuple[int, ...]
    contexts: tuple[int, ...]
    corner: Estimate

    def change(self, plan: Plan) -> Change:
        changed = make_plan(self.model, plan.budget, plan.device, self.kv_dtype, self.slots, self.contexts)
        return Change(self.options, changed)


def what_fits(plan: Plan) -> Change | None:
    """The smallest change of slots, export form or context that makes something of `plan` fit
    (module docstring, "What fits instead"), or None when something fits already, when nothing
    tried does, or when the plan's device refuses its form (`nearest_runnable` says what it runs)."""
    if plan.refusal or plan.anything_fits:
        return None
    fitting = (t for t in _shrinking(plan) if plan.fits(t.corner))
    found = next(fitting, None)
    return found.change(plan) if found else None


def closest(plan: Plan) -> tuple[Change, Estimate] | None:
    """Of the changes `what_fits` tries, the one whose cell needs the fewest bytes, and that cell
    (None when there is nothing to change)."""
    found = min(_shrinking(plan), key=lambda t: t.corner.total, default=None)
    return (found.change(plan), found.corner) if found else None


def nearest_runnable(plan: Plan) -> Change | None:
    """For a plan whose device refuses its form: the form the device runs of the best
    `quality_tier` that changes the fewest options (--variant portable; on cuda also --kv-dtype
    float16), ties to the fewer bytes; None when no form of it runs there (an export's graph is
    its files)."""
    least, shortest = min(plan.slots), min(plan.contexts)
    tries = [
        _Try(options, model, kv, plan.slots, plan.contexts, estimate(model, least, shortest, kv, plan.device))
        for options, model, kv in _other_forms(plan)
    ]

    def rank(t: _Try) -> tuple[int, int, int]:
        return quality_tier(t.model, plan.device), len(t.options), t.corner.total

    found = min(tries, key=rank, default=None)
    return found.change(plan) if found else None


def quality_tier(model: ModelFootprint, device: str) -> int:
    """0: a form measured within `QUALITY_BAR` on `device`, or an export (its form is its files);
    1: measured above it; 2: unmeasured."""
    if model.form is None:
        return 0
    kl = measured_kl(model.form, bool(model.geometry.states), device)
    return 2 if kl is None else int(kl > QUALITY_BAR)


def _shrinking(plan: Plan) -> list[_Try]:
    """The changes `what_fits` tries, in its order: each saves bytes at the plan's smallest cell,
    and none makes the weights (with what loading them holds) or the cache's bytes per token
    bigger. The longest context first: those that keep the plan's come first, then each shorter
    --max-len (a shorter context changes what the model can do most); then those whose quality
    stays within the bar (`quality_tier`); then the fewest bytes saved, ties to fewer options."""
    corner, per_token = plan.corner, _per_token(plan.model, plan.kv_dtype)
    held = corner.weights + corner.load
    kept = [
        t
        for t in _tries(plan)
        if t.corner.total < corner.total
        and t.corner.weights + t.corner.load <= held
        and _per_token(t.model, t.kv_dtype) <= per_token
    ]
    return sorted(
        kept,
        key=lambda t: (
            -t.corner.context,
            quality_tier(t.model, plan.device),
            corner.total - t.corner.total,
            len(t.options),
        ),
    )


def _tries(plan: Plan) -> list[_Try]:
    """Every change weighed: fewer slots; each other form the device runs; a shorter --max-len,
    alone and with each of those forms."""
    m, least, shortest = plan.model, min(plan.slots), min(plan.contexts)
    forms = _other_forms(plan)
    tries = []

    def add(
        options: tuple, model: ModelFootprint, kv: str, slots: tuple, contexts: tuple, context: int
    ) -> None:
        corner = estimate(model, min(slots), context, kv, plan.device)
        tries.append(_Try(options, model, kv, slots, contexts, corner))

    for s in range(least - 1, 0, -1):
        add((("--slots", str(s)),), m, plan.kv_dtype, (s,), plan.contexts, shortest)
    for options, model, kv in forms:
        add(options, model, kv, plan.slots, plan.contexts, shortest)
    halved = {shortest >> i for i in range(1, 16)}
    for c in sorted({c for c in (*DEFAULT_CONTEXTS, *halved) if MIN_CONTEXT <= c < shortest}, reverse=True):
        contexts = tuple(sorted({d for d in DEFAULT_CONTEXTS if d <= c} | {c}))
        add((("--max-len", str(c)),), m, plan.kv_dtype, plan.slots, contexts, c)
        for options, model, kv in forms:
            add((*options, ("--max-len", str(c))), model, kv, plan.slots, contexts, c)
    return tries


def _other_forms(plan: Plan) -> list[tuple[tuple[tuple[str, str], ...], ModelFootprint, str]]:
    """(options, model, cache dtype) of each other form of `plan`'s model its device runs: a
    recipe's every form (`device_forms`); an export's other cache dtypes its graph is exported with
    (a re-export: its weights are its files)."""
    m = plan.model
    if m.form is not None:
        found = []
        for form in device_forms(m.form, plan.device, bool(m.geometry.states)):
            options = _form_options(m.form, form)
            if options and _per_token(m, form.kv_dtype) < float("inf"):
                found.append((options, with_form(m, form), form.kv_dtype))
        return found
    kvs = [k for k in EXPORTED_KV_DTYPES if k != plan.kv_dtype and _per_token(m, k) < float("inf")]
    if m.manifest is not None:
        kvs = [k for k in kvs if k in export_kv_dtypes(m.manifest.variant, m.manifest.precision)]
    return [((("--kv-dtype", k),), m, k) for k in kvs if refusal(m, plan.device, k) is None]


def _form_options(old: ExportRecipe, new: ExportRecipe) -> tuple[tuple[str, str], ...]:
    """The flags that change `old` into `new`: each choice that changed, but not weights or a cache
    dtype that only follow the new --precision's defaults; --head-bits where `new` is quantized
    and its head's bits are not what the change of weights brings anyway."""
    options = []
    for flag, attr in FORM_FLAGS:
        value = getattr(new, attr)
        if value == getattr(old, attr) or _implied(old, new, attr):
            continue
        if flag == "--head-bits" and (not new.quantized or (not old.quantized and new.head_bits is None)):
            continue
        options.append((flag, str(value)))
    return tuple(options)


def _implied(old: ExportRecipe, new: ExportRecipe, attr: str) -> bool:
    """`new`'s weights or cache dtype is its graph's default, as `old`'s was its own."""
    if attr not in ("weights", "kv_dtype"):
        return False
    return all(
        getattr(r, attr) == getattr(ExportRecipe(variant=r.variant, precision=r.precision), attr)
        for r in (old, new)
    )


def device_forms(base: ExportRecipe, device: str, states: bool = False) -> list[ExportRecipe]:
    """Every form `kvedge export` makes of `base` choosing its variant, precision, weights, head
    bits (the default, or 4) and cache dtype, that `device` runs (`device_refusal`; a model with
    per-slot `states` has float32-compute forms only, as its export does); `base`'s max_len,
    logits, block size, kept channels and decode matmuls stay where they apply."""
    found: dict[tuple, ExportRecipe] = {}
    for variant, precision, weights, head_bits, kv in itertools.product(
        VARIANTS, PRECISIONS, WEIGHT_FORMATS, (None, 4), EXPORTED_KV_DTYPES
    ):
        quantized = WEIGHT_FORMATS[weights] < 16
        try:
            form = dataclasses.replace(
                base,
                variant=variant,
                precision=precision,
                weights=weights,
                head_bits=head_bits if quantized else None,
                outlier_channels=base.outlier_channels if quantized else None,
                decode_matmuls=base.decode_matmuls if quantized and variant == "ort" else None,
                kv_dtype=kv,
                kv_group_size=base.kv_group_size if kv in QUANTIZED_KV_DTYPES else 0,
            )
        except KvedgeError:  # a combination export refuses
            continue
        if states and form.half:  # `check_states`: per-slot states are built for float32 graphs
            continue
        if device_refusal(device, variant, kv, form.logits) is None:
            found.setdefault((variant, precision, weights, form.lm_head_bits, kv), form)
    return list(found.values())


def _per_token(model: ModelFootprint, kv_dtype: str) -> float:
    """Cache bytes per token, or infinity for a dtype this model's cache cannot take (an INT8
    cache's channel groups wider than its heads)."""
    try:
        return model.geometry.with_dtype(kv_dtype).bytes_per_token()
    except KvedgeError:
        return float("inf")


def render_with_advice(plan: Plan) -> str:
    """The plan's table; when nothing in it fits, what would, with its own table. A form the
    plan's device refuses gets one line saying why, and the nearest form it runs."""
    if plan.refusal:
        return _refused(plan)
    text = render(plan)
    if plan.anything_fits:
        return text
    change = what_fits(plan)
    if change is not None:
        return (
            f"{text}\n\nnothing above fits; the smallest change that does: {change.describe()}\n\n"
            + render(change.plan)
        )
    near = closest(plan)
    text += "\n\nnothing above fits, and no fewer slots, smaller form or shorter context fits either"
    if near is not None:
        change, cell = near
        text += (
            f"; the closest, {change.describe()}, needs {human(cell.total)} for {cell.slots} x "
            f"{cell.context} tokens, {human(cell.total - plan.budget.usable)} over ({cell.breakdown()})"
        )
    return text


def _refused(plan: Plan) -> str:
    m = plan.model
    line = f"{m.name} ({m.weights_note}, {plan.kv_dtype} cache): {plan.refusal}"
    near = nearest_runnable(plan)
    if near is None and plan.device != "cpu" and refusal(m, "cpu", plan.kv_dtype) is None:
        on_cpu = make_plan(m, plan.budget, "cpu", plan.kv_dtype, plan.slots, plan.contexts)
        return f"{line}\n\non --device cpu, which runs it:\n\n" + render_with_advice(on_cpu)
    if near is None:
        return line
    return (
        f"{line}\n\nthe nearest form --device {plan.device} runs: {near.describe()}\n\n"
        + render_with_advice(near.plan)
    )


# --- one recommendation per board: `recommend` ----------------------------------------------------

# KL of the next-token distribution against the float32 model, per export choice, as measured on
# SmolLM2-135M (docs/PERFORMANCE.md, "Quality of each export choice", whose table a test holds to
# these). A form's KL is the sum of its weights', its graph precision's and its cache's; a form with
# a choice not listed here is unmeasured, and never recommended. They were measured on a dense
# model: a hybrid's (per-slot states: LFM2's convolutions, Qwen3.5's Gated DeltaNet projections and
# recurrent state) quantized or float16 forms were not, and count as unmeasured (`measured_kl`).
WEIGHTS_KL = {
    "--variant portable --weights float32": 0.0,
    "--variant ort --weights float32": 0.0,
    "--variant portable --weights float16": 0.0000028,
    "--variant ort --weights int8": 0.0009,
    "--variant ort --weights int4": 0.0013,
    "--variant portable --weights int8": 0.000000045,
    "--variant portable --weights int4": 0.000000048,
    "--variant portable --weights int4 --head-bits 4": 0.0267,
}
PRECISION_KL = {"--precision float32": 0.0, "--precision float16": 0.0000028}
CACHE_KL = {"--kv-dtype float32": 0.0, "--kv-dtype float16": 0.0, "--kv-dtype int8": 0.0003}
# the most KL a recommended form may cost: the bar export's defaults were chosen by (KL <= 0.002
# and top-1 >= 98% on the held-out set, docs/PERFORMANCE.md "Quantized weights")
QUALITY_BAR = 0.002
MAX_SLOTS = max(DEFAULT_SLOTS)
# where `recommend` answers: a board's GPU, whose decode reads every weight byte and the cache each
# step, so fewer bytes decode faster. On the CPU speed follows kernels, not bytes (kvedge's own run
# the ort graphs; x86 onnxruntime widens float16 graphs), and the README's export there is chosen by
# measured speed and greedy answers.
RECOMMENDED_DEVICES = ("cuda", "tensorrt")


def weights_choice(form: ExportRecipe) -> str:
    """`form`'s weights as `WEIGHTS_KL` names them: variant, weights, and --head-bits where the
    head's bits are not that variant's default."""
    text = f"--variant {form.variant} --weights {form.weights}"
    if form.lm_head_bits != ExportRecipe(variant=form.variant, weights=form.weights).lm_head_bits:
        text += f" --head-bits {form.lm_head_bits}"
    return text


def measured_kl(form: ExportRecipe, states: bool = False, device: str | None = None) -> float | None:
    """`form`'s KL against the float32 model from its choices' measured KLs, or None where one of
    them was not measured: a choice missing from the tables, a block size or kept channels other
    than export's defaults, or an ort int8/int4 graph without kvedge's decode form (the float16
    cache's, whose decode steps run MatMulNBits). For a model with per-slot `states` (a hybrid),
    every form but the float32 one (the float32 model itself, 0) is unmeasured. On `device` "cpu"
    a float16 graph's quantized products are too: onnxruntime rounds their activations to int8
    there, which only a float32 graph's split input undoes (`quant_matmul._product`); the
    measured weight-only figures are TensorRT's and CUDA's."""
    if device == "cpu" and form.half and form.quantized:
        return None
    if states and (form.weights, form.precision, form.kv_dtype) != ("float32", "float32", "float32"):
        return None
    default = ExportRecipe(variant=form.variant, precision=form.precision, weights=form.weights)
    if form.quantized and (form.block_size, form.kept_channels) != (32, default.kept_channels):
        return None
    if form.decode and not form.two_forms:
        return None
    parts = (
        WEIGHTS_KL.get(weights_choice(form)),
        PRECISION_KL.get(f"--precision {form.precision}"),
        CACHE_KL.get(f"--kv-dtype {form.kv_dtype}"),
    )
    return None if None in parts else sum(parts)


def quality_note(form: ExportRecipe, states: bool = False, device: str | None = None) -> str:
    kl = measured_kl(form, states, device)
    return "quality unmeasured" if kl is None else f"KL {kl:.2g} vs float32, docs/PERFORMANCE.md"


@dataclass(frozen=True)
class Recommendation:
    """What to export a model as for one budget and device, and what it holds there."""

    model: str
    device: str
    budget: Budget
    form: ExportRecipe
    cell: Estimate  # the most slots at the recipe's max_len
    kl: float  # `measured_kl`

    @property
    def export_flags(self) -> str:
        """The `kvedge export` flags that make it: a portable folder, exported where torch is."""
        return self.form.flags()

    @property
    def engine_command(self) -> str | None:
        """For tensorrt, the command that builds the engine on the device from the copied folder
        (`kvedge engine` needs no torch; `export --target tensorrt` does, which a Jetson lacks)."""
        return f"kvedge engine DIR --max-batch {self.cell.slots}" if self.device == "tensorrt" else None

    def describe(self) -> str:
        c = self.cell
        slots = f"{c.slots} {'slot' if c.slots == 1 else 'slots'} x {c.context} tokens"
        engine = f", then on the device {self.engine_command}" if self.engine_command else ""
        return (
            f"recommended for {self.budget.source} on --device {self.device}: kvedge export "
            f"{self.export_flags or '(the defaults)'}{engine}: {slots}, {human(c.total)} of "
            f"{human(self.budget.usable)} (KL {self.kl:.2g} vs float32)"
        )


def recommend(
    budget: Budget | BoardProfile | str,
    model: ModelFootprint | ModelRecipe | str | Path,
    device: str = "tensorrt",
) -> Recommendation | None:
    """The one form to export recipe `model` as for `budget` (a Budget, a board profile or its
    name) on `device`: of the forms the device runs (`device_forms`, export's defaults otherwise)
    whose quality was measured within `QUALITY_BAR` (`measured_kl`), the one that holds the most
    slots (up to `MAX_SLOTS`) at the recipe's max_len; ties to the fewer bytes (a decode step
    reads every weight byte and the cache, so on these bandwidth-bound boards fewer bytes also
    decode faster), then to the lower KL. None when not one slot of any fits."""
    if device not in RECOMMENDED_DEVICES:
        raise KvedgeError(
            f"--device {device!r} has no recommendation; allowed: {list(RECOMMENDED_DEVICES)} (the CPU's "
            "export is README's, 'Choosing an export', chosen by measured speed)"
        )
    fp = footprint(model)
    if fp.form is None:
        raise KvedgeError(
            f"{fp.name} is an export, whose form is its files; a recommendation is for a recipe"
        )
    if not isinstance(budget, Budget):
        budget = board_budget(budget if isinstance(budget, BoardProfile) else load_board(budget))
    states = bool(fp.geometry.states)
    found = []
    for form in device_forms(ExportRecipe(max_len=fp.form.max_len), device, states):
        kl = measured_kl(form, states)
        if kl is None or kl > QUALITY_BAR or _per_token(fp, form.kv_dtype) == float("inf"):
            continue
        cell = _most_slots(with_form(fp, form), budget, device)
        if cell is not None:
            found.append(Recommendation(fp.name, device, budget, form, cell, kl))
    return min(found, key=lambda r: (-r.cell.slots, r.cell.total, r.kl), default=None)


def _most_slots(model: ModelFootprint, budget: Budget, device: str) -> Estimate | None:
    for slots in range(MAX_SLOTS, 0, -1):
        cell = estimate(model, slots, model.geometry.max_len, device=device)
        if cell.total <= budget.usable:
            return cell
    return None


def describe_recommendation(
    found: Recommendation | None, model: ModelFootprint, budget: Budget, device: str
) -> str:
    if found is not None:
        return found.describe()
    if refused := model_refusal(model, device):
        return f"recommended for {budget.source} on --device {device}: nothing; {refused}"
    return (
        f"recommended for {budget.source} on --device {device}: nothing; no form of {model.name} whose "
        f"quality was measured within KL {QUALITY_BAR} fits 1 slot of {model.geometry.max_len} tokens"
    )


def model_refusal(model: ModelFootprint | ModelRecipe | str | Path, device: str) -> str | None:
    """Why `device` runs no form of `model` at all (its logits, say, where TensorRT refuses them),
    or None: then `recommend` has nothing for it whatever the budget."""
    fp = footprint(model)
    if device_forms(ExportRecipe(max_len=fp.geometry.max_len), device, bool(fp.geometry.states)):
        return None
    return device_refusal(device, "portable", fp.geometry.dtype, fp.logits)


def _budget(profile: str | None, budget: str | None, reserve: str | None) -> Budget:
    reserve_bytes = parse_bytes(reserve) if reserve else None
    if budget:
        return Budget(parse_bytes(budget), reserve_bytes or 0, "--memory-budget")
    if profile:
        return board_budget(load_board(profile), BOARD_RESERVE if reserve_bytes is None else reserve_bytes)
    return live_budget(reserve_bytes or 0)


def weight_form(options: dict[str, Any]) -> ExportRecipe | None:
    """The weight form `kvedge plan`'s export options name (None: the model's own): --weights
    (default: the --precision's, float32 for a float32 graph) and the options of `kvedge export`
    that go with it."""
    given = {k: v for k, v in options.items() if v is not None}
    if not given:
        return None
    return ExportRecipe(**given)


def plan_report(
    model: str | Path,
    profile: str | None = None,
    budget: str | None = None,
    reserve: str | None = None,
    device: str | None = None,
    kv_dtypes: Sequence[str] = (),
    form: ExportRecipe | None = None,
    slots: str | None = None,
    max_lens: str | None = None,
    as_json: bool = False,
) -> str:
    """`kvedge plan`: the table(s) for `model` on a board profile, a fixed budget or this machine,
    what would fit when nothing does, and for a recipe on a GPU the form `recommend` gives.
    `device` defaults to cuda with a profile (a Jetson's GPU), else cpu."""
    fp = footprint(model, form)
    for dtype in kv_dtypes:
        if dtype not in KV_DTYPES:
            raise KvedgeError(f"--kv-dtype {dtype!r} is not allowed; allowed: {', '.join(KV_DTYPES)}")
    chosen = _budget(profile, budget, reserve)
    device = device or ("cuda" if profile else "cpu")
    plans = [
        make_plan(
            fp,
            chosen,
            device,
            dtype,
            parse_ints(slots, "--slots") if slots else DEFAULT_SLOTS,
            parse_ints(max_lens, "--max-len") if max_lens else None,
        )
        for dtype in (kv_dtypes or (fp.geometry.dtype,))
    ]
    advises = fp.form is not None and device in RECOMMENDED_DEVICES
    recommended = recommend(chosen, fp, device) if advises else None
    if as_json:
        return "[" + ",\n".join(to_json(p, recommended) for p in plans) + "]"
    text = "\n\n".join(render_with_advice(p) for p in plans)
    if not advises:
        return text
    return f"{text}\n\n{describe_recommendation(recommended, fp, chosen, device)}"
