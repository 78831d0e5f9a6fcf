"""The estimate: its constants, what a backend holds beyond the weights (`Overheads`), a model's
footprint from an export folder or a recipe (`ModelFootprint`, `footprint`, `with_form`), and
the bytes one configuration of slots, context and cache dtype needs, by part (`estimate`,
`check_fits`).

A "module docstring" cited here is the package's (kvedge/planner/__init__.py), which documents
each term of the estimate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvedge.configs import Architecture, ModelRecipe, load_recipe
from kvedge.contract import (
    MANIFEST_FILE,
    ONNX_FILE,
    PER_LAYER_FILE,
    PREFILL_CHUNK,
    CacheGeometry,
    ExportRecipe,
    Manifest,
    family_refusal,
    graph_files,
)
from kvedge.contract.engine import DEVICES
from kvedge.contract.recipe import MAX_LEN_RANGE
from kvedge.errors import KvedgeError
from kvedge.files import GiB, MiB, human
from kvedge.planner.weights import FLOAT32, per_layer_bytes, recipe_note, recipe_weight_bytes, widened_bytes
from kvedge.runtime.cache import MAX_SNAPSHOTS

SCORE_BUFFERS, MLP_BUFFERS, HIDDEN_BUFFERS, PRESENT_COPIES = 8, 3, 4, 2  # see the module docstring
BOARD_RESERVE = 1536 * MiB
DEFAULT_SLOTS = (1, 2, 4, 8, 16)
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MIN_CONTEXT = MAX_LEN_RANGE[0]  # the shortest cache an export takes


# onnxruntime CPU: bytes a session holds once loaded and stepped, as a multiple of the weight
# files, by (graph precision, weights) (module docstring, "load"), as measured on SmolLM2-135M:
# docs/PERFORMANCE.md, "The memory planner's terms"
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
# "avx2" path; other CPUs' paths unmeasured): docs/PERFORMANCE.md, "Two forms of the weights". At
# Qwen3-1.7B's shape (int8, float32 cache, 2 threads) it bought nothing: "Exporting at a real size"
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
        "(measured: SmolLM2-135M, an AVX2 CPU; at Qwen3-1.7B's shape, int8, 0.85-1.06x); "
        "--decode-matmuls onnxruntime keeps one form"
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
    form: ExportRecipe | None = None  # a recipe's export, its cache dtype the geometry's (None: an export)
    architecture: Architecture | None = None  # a recipe's, to plan other weight forms
    manifest: Manifest | None = None  # an export's
    forms_note: str = ""  # a two-form export's: its decode form's bytes and speed (`second_form_note`)
    # Gemma 4's per-layer table: a file the runtime maps and reads a row of per token, page cache
    # the kernel may drop, never the backend's (module docstring, "mapped"); not in weights_bytes
    per_layer_bytes: int = 0

    @property
    def precision(self) -> str:
        """Its graph's precision (PRECISIONS): its form's or its export's; float32 for a footprint
        made by hand."""
        made = self.form or self.manifest
        return made.precision if made is not None else "float32"

    @property
    def weights_dtype(self) -> str:
        """How its weights are stored (WEIGHT_FORMATS): its form's or its export's; float32 for a
        footprint made by hand."""
        if self.form is not None:
            return self.form.weights
        return self.manifest.weights_dtype if self.manifest is not None else "float32"

    @property
    def family(self) -> str | None:
        """The model's family (HF model_type): its recipe's, or its export's."""
        if self.architecture is not None:
            return self.architecture.family
        return self.manifest.model_type if self.manifest is not None else None

    @property
    def float32_only(self) -> bool:
        """Whether only its float32 form's quality is measured: the export choices' KLs were
        measured on a dense model, not on a hybrid's states or Gemma 4's per-layer inputs and
        shared KV (`recommend.measured_kl`)."""
        return bool(self.geometry.states or self.geometry.shared_layers or self.per_layer_bytes)

    @classmethod
    def from_export(cls, folder: str | Path) -> ModelFootprint:
        folder = Path(folder)
        manifest = Manifest.load(folder)
        files = [p for p in graph_files(folder) if p.name != PER_LAYER_FILE]
        per_layer = folder / PER_LAYER_FILE
        if not (folder / ONNX_FILE).is_file():
            raise KvedgeError(f"{folder}: no {ONNX_FILE}; is this a `kvedge export` folder?")
        two_forms = manifest.weight_decode_matmuls == "kvedge"  # the graph holds kvedge.QuantMatMul
        return cls(
            name=folder.name,
            origin=str(folder / MANIFEST_FILE),
            weights_bytes=(weights := sum(p.stat().st_size for p in files)),
            weights_note=" + ".join(p.name for p in files) + f" ({manifest.weights_dtype})",
            # a float32 graph widens float16-stored weights; a float16 graph computes with them
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
            per_layer_bytes=per_layer.stat().st_size if per_layer.is_file() else 0,
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
    if refused := family_refusal(
        a.family, variant=form.variant, precision=form.precision, kv_dtype=form.kv_dtype
    ):
        raise KvedgeError(f"{model.name}: {refused}")
    weights = recipe_weight_bytes(a, form)
    forms_note = ""
    if form.two_forms:  # the decode form's bytes: beyond the same export's with one form
        one_form = dataclasses.replace(form, decode_matmuls="onnxruntime")
        forms_note = second_form_note(form.weights, weights - recipe_weight_bytes(a, one_form))
    return dataclasses.replace(
        model,
        weights_bytes=weights,
        weights_note=recipe_note(a, form),
        widened_bytes=widened_bytes(weights, form.precision, form.weights),
        geometry=a.geometry(model.geometry.max_len, model.geometry.dtype, form.variant).with_dtype(
            form.kv_dtype, form.kv_group_size or None
        ),
        form=form,
        forms_note=forms_note,
        per_layer_bytes=per_layer_bytes(a, form),
    )


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
    mapped: int = 0  # Gemma 4's per-layer table, mapped: not in `total` (module docstring, "mapped")

    @property
    def total(self) -> int:
        return self.weights + self.load + self.kv + self.states + self.activations + self.runtime

    def breakdown(self) -> str:
        parts = ("weights", "load", "kv", *(("states",) if self.states else ()), "activations", "runtime")
        mapped = f"; mapped {human(self.mapped)}, not counted" if self.mapped else ""
        return ", ".join(f"{p} {human(getattr(self, p))}" for p in parts) + mapped


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
        mapped=model.per_layer_bytes,
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
