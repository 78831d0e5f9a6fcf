"""Memory planner: does a model with S cache slots of C tokens fit in a byte budget?

The estimate, per (slots, context, kv dtype)::

    total = weights + load + kv + activations + runtime

weights      export folder: bytes of model.onnx (+ model.onnx.data). Recipe: param_count x bytes
             per parameter of `export.weights_dtype`.
load         what the backend holds beyond the weight bytes. onnxruntime 1.32 CPU: SmolLM2-135M's
             514 MiB float32 graph left the process 757-789 MiB larger after session creation
             (prepacked MatMul weights; two runs), so 0.6 x weights. GPU backends (onnxruntime CUDA,
             TensorRT): 1.0 x weights, ASSUMED (not measured): on unified memory the host copy
             read from disk and the device copy coexist while the model loads. A float16-weight
             export (`--weights float16`) is half the file bytes, but its graph widens each
             weight with a Cast that onnxruntime folds at load, so it holds float32 weights
             anyway: + 2 x the file bytes. Measured, onnxruntime 1.32 CPU, SmolLM2-135M: float16
             files 257 MiB, RSS +903 MiB at load; float32 files 514 MiB, +889 MiB.
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
tokens then decoding: measured peak RSS 1078/1178/1424/1718 MiB, planned 1202/1292/1472/1832.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvedge.configs import WEIGHT_BYTES, DeviceProfile, ModelRecipe, load_device, load_recipe
from kvedge.contract import KV_DTYPES, MANIFEST_FILE, ONNX_FILE, PREFILL_CHUNK, CacheGeometry, Manifest
from kvedge.errors import KvedgeError

MiB, GiB = 1 << 20, 1 << 30
FLOAT32 = 4  # the graph computes activations in float32
SCORE_BUFFERS, MLP_BUFFERS, HIDDEN_BUFFERS, PRESENT_COPIES = 8, 3, 4, 2  # see the module docstring
DEVICE_RESERVE = 1536 * MiB
DEFAULT_SLOTS = (1, 2, 4, 8, 16)
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class Overheads:
    """What a backend costs besides weights, cache and activations."""

    runtime_bytes: int
    load_fraction: float  # extra weight-sized memory, as a fraction of the weight bytes
    note: str


_GPU = Overheads(96 * MiB + GiB, 1.0, "CUDA/TensorRT on unified memory, assumed, not measured")
# by backend: "cpu", "gpu", or a `--device` name (cpu, cuda, tensorrt)
OVERHEADS = {
    "cpu": Overheads(96 * MiB, 0.6, "onnxruntime CPU, measured"),
    "gpu": _GPU,
    "cuda": _GPU,
    "tensorrt": _GPU,
}


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
    widened_bytes: int = 0  # float32 copy of float16-stored weights made at load (module docstring)

    @classmethod
    def from_export(cls, folder: str | Path) -> ModelFootprint:
        folder = Path(folder)
        manifest = Manifest.load(folder)
        files = [p for p in (folder / ONNX_FILE, folder / (ONNX_FILE + ".data")) if p.is_file()]
        if not files:
            raise KvedgeError(f"{folder}: no {ONNX_FILE}; is this a `kvedge export` folder?")
        return cls(
            name=folder.name,
            origin=str(folder / MANIFEST_FILE),
            weights_bytes=(weights := sum(p.stat().st_size for p in files)),
            weights_note=" + ".join(p.name for p in files) + f" ({manifest.weights_dtype})",
            # a float32 graph widens float16-stored weights; a float16 graph computes with them
            widened_bytes=2 * weights
            if (manifest.weights_dtype, manifest.precision) == ("float16", "float32")
            else 0,
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
        )

    @classmethod
    def from_recipe(cls, recipe: ModelRecipe, weights_dtype: str | None = None) -> ModelFootprint:
        """`weights_dtype` overrides the recipe's, e.g. float16 for a `--precision float16` export."""
        a = recipe.architecture
        dtype = weights_dtype or recipe.export.weights_dtype
        if dtype not in WEIGHT_BYTES:
            raise KvedgeError(f"weights dtype {dtype!r} is not allowed; allowed: {', '.join(WEIGHT_BYTES)}")
        return cls(
            name=recipe.name,
            origin=str(recipe.path),
            weights_bytes=a.param_count * WEIGHT_BYTES[dtype],
            weights_note=f"{a.param_count:,} params x {dtype}",
            geometry=recipe.geometry(),
            num_heads=a.num_heads,
            hidden_size=a.hidden_size,
            intermediate_size=a.intermediate_size,
            vocab_size=a.vocab_size,
            logits=recipe.export.logits,
            max_context=a.max_position_embeddings,
            fixed_context=False,
        )


def footprint(
    model: ModelFootprint | ModelRecipe | str | Path, weights_dtype: str | None = None
) -> ModelFootprint:
    """`model` as an export folder (has manifest.json), a recipe, or a recipe name or path.

    `weights_dtype` applies to recipes only: an export's weights are what its files hold.
    """
    if isinstance(model, ModelFootprint):
        found = model
    elif isinstance(model, ModelRecipe):
        return ModelFootprint.from_recipe(model, weights_dtype)
    elif Path(model).is_dir():
        found = ModelFootprint.from_export(model)
    else:
        return ModelFootprint.from_recipe(load_recipe(model), weights_dtype)
    if weights_dtype:
        raise KvedgeError(
            f"--weights-dtype applies to recipes only; {found.name} is an export whose weights are "
            f"its files ({found.weights_note})"
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
    model: ModelFootprint, slots: int, context: int, kv_dtype: str | None = None, backend: str = "cpu"
) -> Estimate:
    if backend not in OVERHEADS:
        raise KvedgeError(f"backend {backend!r} is not allowed; allowed: {', '.join(OVERHEADS)}")
    if not isinstance(slots, int) or slots < 1:
        raise KvedgeError(f"slots={slots!r} must be a positive integer")
    overheads = OVERHEADS[backend]
    return Estimate(
        slots=slots,
        context=context,
        kv_dtype=kv_dtype or model.geometry.dtype,
        weights=model.weights_bytes,
        load=int(overheads.load_fraction * model.weights_bytes) + model.widened_bytes,
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
    backend: str = "cpu",
) -> Estimate:
    """Return the estimate for `slots` sequences of `context` tokens, or raise saying by how much
    it does not fit. `model` is an export folder (weights come from its file sizes; a Manifest
    alone does not carry them), a recipe, or a recipe name or path. `context` defaults to the
    model's own max_len."""
    fp = footprint(model)
    context = context or fp.geometry.max_len
    need = estimate(fp, slots, context, kv_dtype, backend)
    if need.total <= budget_bytes:
        return need
    fitting = next(
        (
            s
            for s in range(slots - 1, 0, -1)
            if estimate(fp, s, context, kv_dtype, backend).total <= budget_bytes
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
        raise KvedgeError(f"cannot read MemAvailable from {meminfo}; give --device or --budget instead")
    return Budget(int(found.group(1)) * 1024, reserve_bytes, f"MemAvailable of this machine ({meminfo})")


def device_budget(profile: DeviceProfile, reserve_bytes: int = DEVICE_RESERVE) -> Budget:
    return Budget(profile.memory_bytes, reserve_bytes, profile.name)


@dataclass(frozen=True)
class Plan:
    model: ModelFootprint
    budget: Budget
    backend: str
    kv_dtype: str
    contexts: tuple[int, ...]
    slots: tuple[int, ...]
    cells: tuple[tuple[Estimate, ...], ...]  # [context][slots]

    def fits(self, cell: Estimate) -> bool:
        return cell.total <= self.budget.usable


def make_plan(
    model: ModelFootprint,
    budget: Budget,
    backend: str = "cpu",
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
    cells = tuple(tuple(estimate(model, s, c, kv_dtype, backend) for s in slots) for c in contexts)
    return Plan(model, budget, backend, kv_dtype, tuple(contexts), tuple(slots), cells)


def render(plan: Plan) -> str:
    m, b, first = plan.model, plan.budget, plan.cells[0][0]
    per_token = m.geometry.with_dtype(plan.kv_dtype).bytes_per_token()
    overheads = OVERHEADS[plan.backend]
    lines = [
        f"model        {m.name} ({m.origin})",
        f"weights      {human(m.weights_bytes)}: {m.weights_note}",
        f"backend      {plan.backend} ({overheads.note}): runtime {human(first.runtime)}, "
        f"load {human(first.load)} ({overheads.load_fraction:g} x weights)",
        f"kv cache     {plan.kv_dtype}: {per_token:,} bytes per token per slot",
        f"budget       {human(b.usable)} = {b.source} {human(b.total_bytes)}"
        f" - reserve {human(b.reserve_bytes)}",
        "",
        "total GiB by context (rows) and slots (columns); '-' does not fit",
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
    lines.append(f"{'context':>8} " + "".join(f"{s:>8}" for s in plan.slots))
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
    return json.dumps(
        {
            "model": plan.model.name,
            "budget_bytes": plan.budget.usable,
            "backend": plan.backend,
            "kv_dtype": plan.kv_dtype,
            "rows": [
                {**dataclasses.asdict(c), "total": c.total, "fits": plan.fits(c)}
                for row in plan.cells
                for c in row
            ],
        },
        indent=2,
    )


def human(n: int) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if abs(n) >= MiB else f"{n:,} B"


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


def plan_report(
    model: str | Path,
    device: str | None = None,
    budget: str | None = None,
    reserve: str | None = None,
    backend: str | None = None,
    kv_dtypes: Sequence[str] = (),
    weights_dtype: str | None = None,
    slots: str | None = None,
    contexts: str | None = None,
    as_json: bool = False,
) -> str:
    """`kvedge plan`: the table(s) for `model` on a device profile, a fixed budget or this machine."""
    fp = footprint(model, weights_dtype)
    for dtype in kv_dtypes:
        if dtype not in KV_DTYPES:
            raise KvedgeError(f"--kv-dtype {dtype!r} is not allowed; allowed: {', '.join(KV_DTYPES)}")
    reserve_bytes = parse_bytes(reserve) if reserve else None
    if budget:
        chosen = Budget(parse_bytes(budget), reserve_bytes or 0, "--budget")
    elif device:
        chosen = device_budget(
            load_device(device), DEVICE_RESERVE if reserve_bytes is None else reserve_bytes
        )
    else:
        chosen = live_budget(reserve_bytes or 0)
    backend = backend or ("gpu" if device else "cpu")
    plans = [
        make_plan(
            fp,
            chosen,
            backend,
            dtype,
            parse_ints(slots, "--slots") if slots else DEFAULT_SLOTS,
            parse_ints(contexts, "--context") if contexts else None,
        )
        for dtype in (kv_dtypes or (fp.geometry.dtype,))
    ]
    if as_json:
        return "[" + ",\n".join(to_json(p) for p in plans) + "]"
    return "\n\n".join(render(p) for p in plans)
