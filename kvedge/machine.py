"""What this process may still allocate on this machine: the least of MemAvailable, every
enclosing cgroup's limit less its usage (v2 `memory.max`, v1 `memory.limit_in_bytes`), and the
address-space limit (`ulimit -v`) less the address space already mapped. A container's limit or a
ulimit is often far below MemAvailable, and whatever plans memory (an export's preflight, `kvedge
plan` and the service's budget without a board profile, `kvedge doctor`) reads it here.
"""

from __future__ import annotations

import functools
import re
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Available:
    bytes: int
    what: str  # which limit it is
    address_space: bool = False  # a limit on mapped memory (ulimit -v), not on resident memory


def meminfo_bytes(text: str, field: str) -> int | None:
    """`field` of /proc/meminfo's (or /proc/self/status's) `text`, "NAME:   N kB", in bytes."""
    found = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def read_text(path: Path) -> str | None:
    """`path`'s text, stripped; None where it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_room(root: Path, membership: str) -> list[Available]:
    """Limit less usage of every cgroup enclosing this process that has a memory limit."""
    found = []
    for line in membership.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2: walk up from our group to the root
            files, folder = ("memory.max", "memory.current"), root / path.lstrip("/")
        elif "memory" in controllers.split(","):  # v1
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            folder = root / "memory" / path.lstrip("/")
        else:
            continue
        while True:
            limit, usage = (read_text(folder / name) for name in files)
            if limit and limit.isdigit() and usage and usage.isdigit() and int(limit) < 2**60:
                found.append(Available(int(limit) - int(usage), f"cgroup {folder}'s limit less its usage"))
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
    return found


def available_memory(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    membership: Path = Path("/proc/self/cgroup"),
    status: Path = Path("/proc/self/status"),
) -> Available | None:
    """What this process may still allocate (the module docstring), or None where nothing says.
    The paths are the live machine's unless given (tests)."""
    found = []
    available = meminfo_bytes(read_text(meminfo) or "", "MemAvailable")
    if available is not None:
        found.append(Available(available, "MemAvailable"))
    found += _cgroup_room(cgroup_root, read_text(membership) or "")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = meminfo_bytes(read_text(status) or "", "VmSize")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        found.append(Available(soft - mapped, "ulimit -v less what is mapped", address_space=True))
    return min(found, key=lambda a: a.bytes) if found else None


def release_freed_memory() -> bool:
    """Hand the C heap's freed pages back to the system (glibc's malloc_trim); False where the C
    library has no such call. After a phase that allocated and freed gigabytes from several
    threads (the export's calibration), glibc keeps them in its arenas, where they still count
    as the process's resident memory."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0) is not None)


def map_large_allocations(threshold: int = 2**20) -> bool:
    """Have glibc's malloc take every block of `threshold` bytes or more straight from the system
    (mmap) and give it back when freed (M_MMAP_THRESHOLD); False where the C library has no
    mallopt. Its default threshold rises to 32 MiB as large blocks are freed, and blocks under
    it then come from the heap, whose address range a long run of mixed sizes only extends: the
    streamed export's calibration of Llama-3.2-3B's shape mapped more address space with every
    layer, its resident size flat, until it passed a `ulimit -v` (docs/PERFORMANCE.md, "Exporting
    at a real size")."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1)


M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None."""
    return getattr(_libc(), "malloc_trim", None)


@functools.cache
def _libc() -> Any:
    """The C library, or None (found once: find_library runs ldconfig)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None
