"""Memory at load and at the first decode, beside the planner's terms (the first GPU run checks
them: the runtime's 1 GiB and the load term are assumed, not measured, in kvedge/planner/).

Device memory is cudaMemGetInfo's total - free (a Jetson has no nvidia-smi; there CPU and GPU
share one DRAM, so it counts the process's host memory too); host memory is the process's
resident set (/proc/self/status VmRSS) and its peak (VmHWM), which a Jetson's unified memory
makes the same budget.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvedge.planner import Estimate


def device_used_bytes() -> int:
    from kvedge.accel import cuda_call, import_cudart

    cudart = import_cudart()
    free, total = cuda_call(cudart, cudart.cudaMemGetInfo(), "cudaMemGetInfo")
    return int(total) - int(free)


def host_bytes() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


class MemoryLog:
    """Device and host memory from a baseline (made at construction) to each `mark`, recorded as
    "<name>.memory_<stage>_{device,host_rss,host_peak}_bytes", and the planner's terms beside."""

    def __init__(self, record: Callable[[str, object], None], name: str) -> None:
        self.record, self.name = record, name
        self.device, self.host = device_used_bytes(), host_bytes()
        self.marks: dict[str, dict[str, int]] = {}

    def mark(self, stage: str) -> dict[str, int]:
        host = host_bytes()
        found = {
            "device": device_used_bytes() - self.device,
            "host_rss": host["VmRSS"] - self.host["VmRSS"],
            "host_peak": host["VmHWM"],
        }
        for key, value in found.items():
            self.record(f"{self.name}.memory_{stage}_{key}_bytes", value)
        self.marks[stage] = found
        return found

    def planned(self, estimate: Estimate) -> dict[str, int]:
        terms = planned_terms(estimate)
        self.record(f"{self.name}.memory_planned", terms)
        return terms


def planned_terms(estimate: Estimate) -> dict[str, int]:
    """The planner's terms by name, and their total."""
    terms = {p: getattr(estimate, p) for p in ("weights", "load", "kv", "activations", "runtime")}
    return {**terms, "total": estimate.total}
