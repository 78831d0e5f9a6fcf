"""A plan: a model's totals by context and slots on one budget and device (`make_plan`), whether
its device runs its form at all (`refusal`), and its table as `kvedge plan` prints it
(`render`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvedge.contract import PER_LAYER_FILE, CacheGeometry, per_layer_dtype
from kvedge.contract.engine import device_refusal
from kvedge.contract.recipe import check_kv_dtype
from kvedge.errors import KvedgeError
from kvedge.files import GiB, human
from kvedge.planner.budget import Budget
from kvedge.planner.estimate import (
    DEFAULT_CONTEXTS,
    DEFAULT_SLOTS,
    OVERHEADS,
    Estimate,
    ModelFootprint,
    estimate,
    with_form,
)
from kvedge.runtime.cache import MAX_SNAPSHOTS


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
    if m.per_layer_bytes:
        lines[4:4] = [per_layer_line(m)]
    if g.states:
        lines[4:4] = [states_line(g)]
    if g.ring_layers:  # the per-token figure above counts every layer; ring layers stop at ring_len
        full = g.bytes_per_token() * g.max_len + g.state_bytes_per_slot()  # every layer max_len long
        lines[4:4] = [
            f"ring layers  {len(g.ring_layers)} of {g.num_layers} hold the last {g.ring_len} tokens "
            f"(window {g.window} + {g.ring_margin}): a {g.max_len}-token slot is "
            f"{human(g.bytes_per_slot())}, {g.bytes_per_slot() / full:.3f} x {human(full)} at full length"
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
    """Which layers the per-token figure covers, where not all of them hold KV (hybrids, Gemma 4's
    shared layers)."""
    shared = geometry.shared_layers
    if not geometry.states and not shared:
        return ""
    reading = f"; {len(shared)} read an earlier layer's" if shared else ""
    return f" ({geometry.num_layers} of {geometry.model_layers} layers hold KV{reading})"


def per_layer_line(model: ModelFootprint) -> str:
    """Gemma 4's per-layer table, on its own line: mapped from its file, not in the totals."""
    table = f"{human(model.per_layer_bytes)} {PER_LAYER_FILE} ({per_layer_dtype(model.weights_dtype)})"
    return (
        f"per-layer    {table}, mapped: page cache the kernel may drop, never the backend's; a row "
        "read per token; not in the totals below"
    )


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
