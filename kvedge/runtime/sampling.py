"""The values each sampling option allows, declared once.

`SamplingConfig` checks them; the CLI flags (`kvedge.cli`), `ServiceConfig`'s fields
(`Bounds.meta`) and the request checks of the wire (`kvedge.serve.protocol`) are made from them, so
no surface accepts a value another refuses. Temperature takes OpenAI's range, [0, 2]: the service,
the wire and the chat page already had it, and a client written for OpenAI's API sends no more.

Kept apart from `kvedge.runtime.generate` so that the CLI reads them without importing the runtime.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from kvedge.declare import Flag


@dataclass(frozen=True)
class Bounds:
    """[low, high] (or (low, high] where `low_open`), of integers or real numbers."""

    low: float
    high: float | None = None  # None: no upper bound
    low_open: bool = False  # low itself is refused
    integer: bool = False
    note: str = ""  # what a special value means, e.g. "0: greedy"

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(
            value, numbers.Integral if self.integer else numbers.Real
        ):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    @property
    def allowed(self) -> str:
        """What an error message says is allowed: "a number in [0, 2] (0: greedy)"."""
        kind = "an integer" if self.integer else "a number"
        if self.high is None:
            span = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            span = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        return f"{kind} {span}" + (f" ({self.note})" if self.note else "")

    def meta(self) -> dict[str, float]:
        """The bounds as `msgspec.Meta` keywords."""
        limits = {"gt" if self.low_open else "ge": self.low}
        return limits if self.high is None else {**limits, "le": self.high}


# SamplingConfig's field name: its bounds. The repetition penalty's: dividing a logit by 1e-307
# overflows as a tiny temperature does.
SAMPLING_BOUNDS = {
    "temperature": Bounds(0.0, 2.0, note="0: greedy"),
    "top_k": Bounds(0, integer=True, note="0: off"),
    "top_p": Bounds(0.0, 1.0, low_open=True),
    "repetition_penalty": Bounds(0.01, 10.0),
}


def _meta(name: str) -> Meta:
    bounds = SAMPLING_BOUNDS[name]
    return Meta(**bounds.meta(), description=bounds.allowed)


def _help(name: str) -> str:
    allowed = SAMPLING_BOUNDS[name].allowed
    return f"{allowed[0].upper()}{allowed[1:]}."


# The sampling options' types, as `SamplingConfig`, the CLI and the service declare them
Temperature = Annotated[float, _meta("temperature"), Flag(_help("temperature"))]
TopK = Annotated[int, _meta("top_k"), Flag(_help("top_k"))]
TopP = Annotated[float, _meta("top_p"), Flag(_help("top_p"))]
RepetitionPenalty = Annotated[float, _meta("repetition_penalty"), Flag(_help("repetition_penalty"))]
