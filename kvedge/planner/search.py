"""What fits instead: when no cell of a plan fits, the smallest change of slots, export form or
context that makes its smallest cell fit (`what_fits`), the closest when none does
(`closest`), and for a form its device refuses the nearest form it runs (`nearest_runnable`).

A "module docstring" cited here is the package's (kvedge/planner/__init__.py), which documents
each term of the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedge.contract import EXPORTED_KV_DTYPES, ExportRecipe, export_kv_dtypes
from kvedge.planner.estimate import (
    DEFAULT_CONTEXTS,
    MIN_CONTEXT,
    Estimate,
    ModelFootprint,
    estimate,
    with_form,
)
from kvedge.planner.recommend import QUALITY_BAR, _per_token, device_forms, measured_kl, quality_note
from kvedge.planner.render import Plan, make_plan, refusal

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
            text += f" ({quality_note(form, self.plan.model.float32_only, self.plan.device)})"
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
    kl = measured_kl(model.form, model.float32_only, device)
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
        for form in device_forms(m.form, plan.device, m.family):
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
