"""`kvedge plan`'s report: a plan's table with what fits instead when nothing does, or why its
device refuses it (`render_with_advice`), the same as JSON (`to_json`), and for a recipe on a
GPU the form `recommend` gives (`plan_report`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvedge.contract import KV_DTYPES, ExportRecipe
from kvedge.declare import from_values
from kvedge.errors import KvedgeError
from kvedge.files import human
from kvedge.planner.budget import _budget, parse_ints
from kvedge.planner.estimate import DEFAULT_SLOTS, footprint
from kvedge.planner.recommend import (
    RECOMMENDED_DEVICES,
    Recommendation,
    describe_recommendation,
    recommend,
)
from kvedge.planner.render import Plan, make_plan, refusal, render
from kvedge.planner.search import closest, nearest_runnable, what_fits


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


def weight_form(options: dict[str, Any]) -> ExportRecipe | None:
    """The weight form `kvedge plan`'s export options name (None: the model's own): --weights
    (default: the --precision's, float32 for a float32 graph) and the options of `kvedge export`
    that go with it."""
    if all(v is None for v in options.values()):
        return None
    return from_values(ExportRecipe, options)


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
