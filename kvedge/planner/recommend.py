"""One recommendation per board: the measured KL of each export choice (`WEIGHTS_KL`,
`PRECISION_KL`, `CACHE_KL`) and a form's sum of them (`measured_kl`), every form a device runs
(`device_forms`), and the one form to export a recipe as for a budget and GPU device
(`recommend`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

from kvedge.configs import BoardProfile, ModelRecipe, load_board
from kvedge.contract import (
    EXPORTED_KV_DTYPES,
    PRECISIONS,
    QUANTIZED_KV_DTYPES,
    VARIANTS,
    WEIGHT_FORMATS,
    ExportRecipe,
    family_refusal,
)
from kvedge.contract.engine import device_refusal
from kvedge.errors import KvedgeError
from kvedge.files import human
from kvedge.planner.budget import Budget, board_budget
from kvedge.planner.estimate import DEFAULT_SLOTS, Estimate, ModelFootprint, estimate, footprint, with_form

# KL of the next-token distribution against the float32 model, per export choice, as measured on
# SmolLM2-135M (docs/PERFORMANCE.md, "Quality of each export choice", whose table a test holds to
# these). A form's KL is the sum of its weights', its graph precision's and its cache's; a form with
# a choice not listed here is unmeasured, and never recommended. They were measured on a dense
# model: a hybrid's (per-slot states: LFM2's convolutions, Qwen3.5's Gated DeltaNet projections and
# recurrent state) and Gemma 4's (per-layer inputs, shared KV) quantized or float16 forms were not,
# and count as unmeasured (`measured_kl`, `ModelFootprint.float32_only`).
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


def measured_kl(form: ExportRecipe, float32_only: bool = False, device: str | None = None) -> float | None:
    """`form`'s KL against the float32 model from its choices' measured KLs, or None where one of
    them was not measured: a choice missing from the tables, a block size or kept channels other
    than export's defaults, or an ort int8/int4 graph without kvedge's decode form (the float16
    cache's, whose decode steps run MatMulNBits). For a model measured in `float32_only` (a
    hybrid, Gemma 4), every form but the float32 one (the float32 model itself, 0) is
    unmeasured. On `device` "cpu" a float16 graph's quantized products are too: onnxruntime
    rounds their activations to int8 there, which only a float32 graph's split input undoes
    (`quant_matmul._product`); the measured weight-only figures are TensorRT's and CUDA's."""
    if device == "cpu" and form.half and form.quantized:
        return None
    if float32_only and (form.weights, form.precision, form.kv_dtype) != ("float32", "float32", "float32"):
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


def quality_note(form: ExportRecipe, float32_only: bool = False, device: str | None = None) -> str:
    kl = measured_kl(form, float32_only, device)
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
    found = []
    for form in device_forms(ExportRecipe(max_len=fp.form.max_len), device, fp.family):
        kl = measured_kl(form, fp.float32_only)
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
    if device_forms(ExportRecipe(max_len=fp.geometry.max_len), device, fp.family):
        return None
    return device_refusal(device, "portable", fp.geometry.dtype, fp.logits)


def device_forms(base: ExportRecipe, device: str, family: str | None = None) -> list[ExportRecipe]:
    """Every form `kvedge export` makes of `base` (of a model of `family`, where given: its
    `family_refusal`) choosing its variant, precision, weights, head bits (the default, or 4) and
    cache dtype, that `device` runs (`device_refusal`); `base`'s max_len, logits, block size, kept
    channels and decode matmuls stay where they apply."""
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
        if family and family_refusal(family, variant=variant, precision=precision, kv_dtype=kv):
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
