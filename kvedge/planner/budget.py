"""Budgets: the bytes a plan may use, from a board profile less a reserve (`board_budget`), this
machine (`live_budget`) or a figure given (`parse_bytes`), and the parsing of `kvedge plan`'s
size and list options.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvedge.configs import BoardProfile, load_board
from kvedge.errors import KvedgeError
from kvedge.files import GiB, MiB
from kvedge.machine import Available, available_memory
from kvedge.planner.estimate import BOARD_RESERVE


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


def _budget(profile: str | None, budget: str | None, reserve: str | None) -> Budget:
    reserve_bytes = parse_bytes(reserve) if reserve else None
    if budget:
        return Budget(parse_bytes(budget), reserve_bytes or 0, "--memory-budget")
    if profile:
        return board_budget(load_board(profile), BOARD_RESERVE if reserve_bytes is None else reserve_bytes)
    return live_budget(reserve_bytes or 0)
