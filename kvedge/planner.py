"""Memory planner: does a model with S cache slots of C tokens fit in a byte budget?

The estimate, per (slots, context, kv dtype)::

    total = weights + load + kv + activations + runtime

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
             looks rows up there); everything else (an untied model's embedding table, norms,
             biases) is param_count less the projections and the head, 4 bytes each (2 in a
             float16 graph). Checked against real exports: a random 2-layer llama
             (tests/test_planner.py, five forms) 0.8-2.2% (35-52 KiB) under the files, the
             graph's own bytes and RoPE tables not counted; SmolLM2-135M `--weights int8
             --outlier-channels 0`: planned 294,107,904, files 291,490,818 (+0.9%: its Q8_0 LM
             head needs no block offsets, 3.5 MB the planner assumes).
load         what the backend holds beyond the weight bytes. onnxruntime CPU, measured per form
             (`CPU_HELD`: bytes held once loaded and stepped, as a multiple of the weight files):
             float32 weights 1.3 (MLAS's prepacked copy replaces the file's pages, plus padding);
             float16 weights 2.6 in a float32 graph (its Casts are folded to a float32 copy at
             load, then prepacked) and 2.45 in a float16 graph (no float16 kernels on x86: the
             same widening); int8 / int4 weights 1.8 / 1.95, 2.0 / 2.4 in a float16 graph (the
             MatMulNBits kernels' packed blocks beside the graph's). Measured with onnxruntime
             1.2x on SmolLM2-135M (peak RSS of a fresh process after load and two decode steps,
             less the tokenizer, which `runtime` counts, and the KV pool; every form within 10%:
             tests/test_real_model.py); a larger model's fixed parts weigh less, so these
             over-count it. GPU backends (onnxruntime CUDA, TensorRT): 1.0 x weights,
             ASSUMED (not measured): on unified memory the host copy read from disk and the
             device copy coexist while the model loads; plus a float32 graph's float32 copy of
             float16-stored weights (`widened_bytes`, 2 x the file: onnxruntime folds the Casts).
kv           `CacheGeometry(max_len=C, dtype=kv).pool_bytes(S)`: exactly what `KVCache` allocates
             (tests/test_planner.py checks it). A quantized cache's scales belong to
             CacheGeometry and appear here with no change to this module. The runtime's token
             record (8 bytes per cached token) is not cache geometry and sits in the margin of
             `runtime`.
activations  the largest single call: one sequence prefilling a chunk of s = PREFILL_CHUNK tokens,
             or one decode step for all S slots. It is dominated by the attention scores of one
             layer, [kv_heads, g*s, C+s] float32 (the graph never copies the cache). Measured
             with onnxruntime 1.32 CPU, SmolLM2-135M, chunk 256, C = 2048: peak 76-152 MiB
             (arena growth depends on call order), i.e. up to 7.5 score-sized buffers; the
             estimate counts 8, plus 3 MLP-sized and 4 hidden-sized buffers, the logits, and
             the new tokens' K/V twice (the graph's output and the runtime's copy of it).
runtime      Python + numpy + onnxruntime + tokenizer: 96 MiB (measured 70-75 MiB). A GPU
             backend adds the CUDA context and libraries (cuBLAS, cuDNN or TensorRT): 1 GiB,
             ASSUMED, not measured (no GPU was available when this was written); device_tests
             is where it gets measured.

Checked (cpu preset): SmolLM2-135M float32, max_len 2048, 1/2/4/8 slots each prefilled with 600
tokens then decoding: measured peak RSS 1078/1178/1424/1718 MiB, planned 1045/1135/1315/1675
(3-8% under: the load term, 1.3 x weights, is measured after two decode steps, not 600-token
prefills, whose arena growth the activations term counts at 8 score buffers).

What fits instead: when no cell of a plan fits, `what_fits` tries the smallest change, in this
order: fewer options changed first; one change in the order cache dtype (float16, then int8),
weights (float16, int8, int4: least quantization first; recipes only, an export's weights are its
files) and a shorter context; then weights with cache dtype; then both with a shorter context.
The first that fits at 1 slot is shown with its own table.

Budgets: a device profile's `memory_bytes` minus a reserve for the kernel, carveouts and the OS
(1.5 GiB by default, an estimate for a headless L4T; a desktop session needs about 1 GiB
more), or the live machine's MemAvailable from /proc/meminfo. On Jetson's unified memory that
is the right figure, not cudaMemGetInfo (NVIDIA's "CUDA for Tegra" app note, "Estimating Total
Allocatable Device Memory on an Integrated GPU Device").
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvedge.configs import Architecture, DeviceProfile, ModelRecipe, load_device, load_recipe
from kvedge.contract import (
    KV_DTYPES,
    MANIFEST_FILE,
    ONNX_FILE,
    PREFILL_CHUNK,
    CacheGeometry,
    ExportRecipe,
    Manifest,
)
from kvedge.contract.engine import DEVICES
from kvedge.errors import KvedgeError
from kvedge.files import GiB, MiB, human

FLOAT32 = 4  # the graph computes activations in float32
SCORE_BUFFERS, MLP_BUFFERS, HIDDEN_BUFFERS, PRESENT_COPIES = 8, 3, 4, 2  # see the module docstring
DEVICE_RESERVE = 1536 * MiB
DEFAULT_SLOTS = (1, 2, 4, 8, 16)
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MIN_CONTEXT = 16  # the shortest cache an export takes (configs.ExportSettings.max_len)


# onnxruntime CPU: bytes a session holds once loaded and stepped, as a multiple of the weight
# files, by (graph precision, weights) (module docstring, "load")
CPU_HELD = {
    ("float32", "float32"): 1.3,
    ("float32", "float16"): 2.6,
    ("float32", "int8"): 1.8,
    ("float32", "int4"): 1.95,
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


def quantized_matmul_bytes(k: int, n: int, bits: int, form: ExportRecipe) -> int:
    """Bytes `kvedge export` stores for one quantized w [K, N] (module docstring, `graph.py`'s
    `matmul_weight` and `_quant_matmul`)."""
    blocks, kept = k // form.block_size, form.kept_channels
    codes, real = k * n * bits // 8, 2 if form.half else FLOAT32  # a float16 graph's floats are float16
    total = codes + real * blocks * n + real * (blocks + kept) * n  # scales, second product
    total += 8 * kept  # the kept channels' indices (kvedge.SideInputs', or a Gather's)
    if form.variant == "portable" and kept:  # side inputs from standard ops: the 0/1 mask [K]
        total += real * k
    if form.two_forms and n % 64 == 0:  # decode form: codes, float16 scale + minimum, float16 rows
        total += codes + 2 * 2 * blocks * n + 2 * kept * n
    return total


def recipe_weight_bytes(a: Architecture, form: ExportRecipe) -> int:
    """The bytes of an export of architecture `a` in weight form `form` (module docstring)."""
    if not form.quantized:
        return a.param_count * form.bits // 8
    q, kv, h, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, a.intermediate_size
    layer = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]  # [K, N]: fused QKV, O, fused gate/up, down
    # a tied table is the head's blocks (the runtime looks embeddings up there); an untied model
    # keeps a float embedding table beside its quantized head
    table = h * a.vocab_size
    rest = a.param_count - a.num_layers * sum(k * n for k, n in layer) - table  # float
    quantized = a.num_layers * sum(quantized_matmul_bytes(k, n, form.bits, form) for k, n in layer)
    real = 2 if form.half else FLOAT32
    return real * rest + quantized + quantized_matmul_bytes(h, a.vocab_size, form.lm_head_bits, form)


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
    form: ExportRecipe | None = None  # a recipe's weight form (None: an export's files)
    architecture: Architecture | None = None  # a recipe's, to plan other weight forms
    forms_note: str = ""  # a two-form export's: its decode form's bytes and speed (`second_form_note`)

    @classmethod
    def from_export(cls, folder: str | Path) -> ModelFootprint:
        folder = Path(folder)
        manifest = Manifest.load(folder)
        files = [p for p in (folder / ONNX_FILE, folder / (ONNX_FILE + ".data")) if p.is_file()]
        if not files:
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
            forms_note=second_form_note(manifest.weights_dtype) if two_forms else "",
        )

    @classmethod
    def from_recipe(cls, recipe: ModelRecipe, form: ExportRecipe | None = None) -> ModelFootprint:
        """`form` overrides the recipe's weights, e.g. int4 (`--weights int4`)."""
        a = recipe.architecture
        found = cls(
            name=recipe.name,
            origin=str(recipe.path),
            weights_bytes=0,
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
        return found.with_form(form or recipe.export_recipe)

    def with_form(self, form: ExportRecipe) -> ModelFootprint:
        """This recipe's model exported in weight form `form`."""
        assert self.architecture is not None, "an export's weights are its files"
        weights = recipe_weight_bytes(self.architecture, form)
        forms_note = ""
        if form.two_forms:  # the decode form's bytes: beyond the same export's with one form
            one_form = dataclasses.replace(form, decode_matmuls="onnxruntime")
            forms_note = second_form_note(
                form.weights, weights - recipe_weight_bytes(self.architecture, one_form)
            )
        return dataclasses.replace(
            self,
            weights_bytes=weights,
            weights_note=recipe_note(self.architecture, form),
            precision=form.precision,
            weights_dtype=form.weights,
            widened_bytes=widened_bytes(weights, form.precision, form.weights),
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

    @property
    def total(self) -> int:
        return self.weights + self.load + self.kv + self.activations + self.runtime

    def breakdown(self) -> str:
        parts = ("weights", "load", "kv", "activations", "runtime")
        return ", ".join(f"{p} {human(getattr(self, p))}" for p in parts)


def kv_bytes(model: ModelFootprint, slots: int, context: int, kv_dtype: str | None = None) -> int:
    """Exact KV pool bytes, asked of CacheGeometry (the only place they are computed)."""
    geometry = dataclasses.replace(model.geometry, max_len=context).with_dtype(
        kv_dtype or model.geometry.dtype
    )
    return geometry.pool_bytes(slots)


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


def live_budget(reserve_bytes: int = 0, meminfo: Path = Path("/proc/meminfo")) -> Budget:
    """This machine's MemAvailable (right for unified memory, where the GPU allocates from it)."""
    try:
        text = meminfo.read_text()
    except OSError:
        text = ""
    found = re.search(r"^MemAvailable:\s+(\d+)\s+kB", text, re.MULTILINE)
    if not found:
        raise KvedgeError(
            f"cannot read MemAvailable from {meminfo}; give --profile or --memory-budget instead"
        )
    return Budget(int(found.group(1)) * 1024, reserve_bytes, f"MemAvailable of this machine ({meminfo})")


def device_budget(profile: DeviceProfile, reserve_bytes: int = DEVICE_RESERVE) -> Budget:
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


def make_plan(
    model: ModelFootprint,
    budget: Budget,
    device: str = "cpu",
    kv_dtype: str | None = None,
    slots: Sequence[int] = DEFAULT_SLOTS,
    contexts: Sequence[int] | None = None,
) -> Plan:
    kv_dtype = kv_dtype or model.geometry.dtype
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
        f"kv cache     {plan.kv_dtype}: {per_token:,} bytes per token per slot",
        f"budget       {human(b.usable)} = {b.source} {human(b.total_bytes)}"
        f" - reserve {human(b.reserve_bytes)}",
        "",
        "total GiB by max_len (rows) and slots (columns); '-' does not fit",
    ]
    g = m.geometry.with_dtype(plan.kv_dtype)
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


def to_json(plan: Plan) -> str:
    """The plan's cells, and `fits_with`: the options of `what_fits` (null when none)."""
    change = what_fits(plan)
    return json.dumps(
        {
            "fits_with": dict(change.options) if change else None,
            "model": plan.model.name,
            "budget_bytes": plan.budget.usable,
            "device": plan.device,
            "kv_dtype": plan.kv_dtype,
            "rows": [
                {**dataclasses.asdict(c), "total": c.total, "fits": plan.fits(c)}
                for row in plan.cells
                for c in row
            ],
        },
        indent=2,
    )


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


# what `what_fits` tries, least change first (module docstring)
KV_STEPS = ("float16", "int8")
WEIGHT_STEPS = ("float16", "int8", "int4")


@dataclass(frozen=True)
class Change:
    """Options that make a plan fit, and that plan."""

    options: tuple[tuple[str, str], ...]  # ("--weights", "int4"), ...
    plan: Plan

    def describe(self) -> str:
        flags = " ".join(f"{flag} {value}" for flag, value in self.options)
        return f"re-export with {flags}" if self.plan.model.fixed_context else flags


def what_fits(plan: Plan) -> Change | None:
    """The smallest change of slots, cache dtype, weights or context that makes something of
    `plan` fit (module docstring for the order), or None when something fits already or nothing
    tried does."""
    if plan.anything_fits:
        return None
    return next((change for change in _changes(plan) if change.plan.anything_fits), None)


def closest(plan: Plan) -> tuple[Change, Estimate] | None:
    """Of the changes `what_fits` tries, the one whose smallest cell needs the fewest bytes, and
    that cell (None when there is nothing to change)."""
    smallest = [(min((c for row in ch.plan.cells for c in row), key=_total), ch) for ch in _changes(plan)]
    if not smallest:
        return None
    cell, change = min(smallest, key=lambda pair: pair[0].total)
    return change, cell


def _total(cell: Estimate) -> int:
    return cell.total


def _changes(plan: Plan) -> Iterator[Change]:
    """The changes `what_fits` tries, in its order, each with its plan."""
    m = plan.model
    fewer = tuple(s for s in range(min(plan.slots) - 1, 0, -1))
    kvs = [k for k in KV_STEPS if _per_token(m, k) < _per_token(m, plan.kv_dtype)]
    forms = _smaller_forms(m)
    halved = {min(plan.contexts) >> i for i in range(1, 16)}
    shorter = sorted(
        {c for c in (*DEFAULT_CONTEXTS, *halved) if MIN_CONTEXT <= c < min(plan.contexts)}, reverse=True
    )
    tries: list[tuple[tuple[str, str], ...]] = []
    tries += [(("--slots", str(s)),) for s in fewer]
    tries += [(("--kv-dtype", k),) for k in kvs]
    tries += [(("--weights", f.weights),) for f in forms]
    tries += [(("--max-len", str(c)),) for c in shorter]
    tries += [(("--weights", f.weights), ("--kv-dtype", k)) for f in forms for k in kvs]
    tries += [  # the longest context first: a shorter one changes what the model can do most
        (("--weights", f.weights), ("--kv-dtype", k), ("--max-len", str(c)))
        for c in shorter
        for f in forms
        for k in kvs
    ]
    by_name = {f.weights: f for f in forms}
    for options in tries:
        yield Change(options, _changed_plan(plan, dict(options), by_name))


def _per_token(model: ModelFootprint, kv_dtype: str) -> float:
    """Cache bytes per token, or infinity for a dtype this model's cache cannot take (an INT8
    cache's channel groups wider than its heads)."""
    try:
        return model.geometry.with_dtype(kv_dtype).bytes_per_token()
    except KvedgeError:
        return float("inf")


def _smaller_forms(model: ModelFootprint) -> list[ExportRecipe]:
    """A recipe's weight forms smaller than its own, least quantized first (an export's weights
    are its files: re-exporting them is out of the planner's sight, so none)."""
    if model.architecture is None or model.form is None:
        return []
    forms = []
    for weights in WEIGHT_STEPS:
        try:  # e.g. --head-bits 8 with portable int4: not a form of int8 weights
            forms.append(dataclasses.replace(model.form, weights=weights))
        except KvedgeError:
            continue
    return [f for f in forms if recipe_weight_bytes(model.architecture, f) < model.weights_bytes]


def _changed_plan(plan: Plan, options: dict[str, str], forms: dict[str, ExportRecipe]) -> Plan:
    model = plan.model
    if "--weights" in options:
        model = model.with_form(forms[options["--weights"]])
    slots = (int(options["--slots"]),) if "--slots" in options else plan.slots
    contexts = plan.contexts
    if "--max-len" in options:
        longest = int(options["--max-len"])
        contexts = tuple(sorted({c for c in DEFAULT_CONTEXTS if c <= longest} | {longest}))
    return make_plan(
        model, plan.budget, plan.device, options.get("--kv-dtype", plan.kv_dtype), slots, contexts
    )


def render_with_advice(plan: Plan) -> str:
    """The plan's table; when nothing in it fits, what would, with its own table."""
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
    text += "\n\nnothing above fits, and no smaller slots, cache dtype, weights or context fits either"
    if near is not None:
        change, cell = near
        text += (
            f"; the closest, {change.describe()}, needs {human(cell.total)} for {cell.slots} x "
            f"{cell.context} tokens, {human(cell.total - plan.budget.usable)} over ({cell.breakdown()})"
        )
    return text


def _budget(profile: str | None, budget: str | None, reserve: str | None) -> Budget:
    reserve_bytes = parse_bytes(reserve) if reserve else None
    if budget:
        return Budget(parse_bytes(budget), reserve_bytes or 0, "--memory-budget")
    if profile:
        return device_budget(load_device(profile), DEVICE_RESERVE if reserve_bytes is None else reserve_bytes)
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
    """`kvedge plan`: the table(s) for `model` on a device profile, a fixed budget or this machine,
    and what would fit when nothing does. `device` defaults to cuda with a profile (a Jetson's
    GPU), else cpu."""
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
    if as_json:
        return "[" + ",\n".join(to_json(p) for p in plans) + "]"
    return "\n\n".join(render_with_advice(p) for p in plans)
