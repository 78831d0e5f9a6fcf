"""The export's memory preflight: before minutes of work, what the export must hold at once
against what this process may still use, refused in one line where it cannot fit.

The floor (`export_floor`) is a lower bound, never an estimate that may overshoot: the exporter
holds the float32 model whole while it builds the graph (4 bytes a parameter), and the graph's
weights (at least the recipe's bits a parameter) exist beside it until the files are written.
Measured peaks sit about twice as high (docs/PERFORMANCE.md, "Memory"), so a refused export would
certainly have failed, and a passed one may still run short.

What this process may use is `kvedge.machine.available_memory`'s: the least of MemAvailable, the
cgroups' limits and `ulimit -v`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct

from kvedge.contract.manifest import WEIGHT_FORMATS
from kvedge.errors import KvedgeError
from kvedge.export.source import CUT_FILE, Source, incomplete
from kvedge.files import human
from kvedge.machine import Available, available_memory

log = logging.getLogger(__name__)

# tensors the export does not load: composite checkpoints' vision / audio towers, multi-token heads
NOT_LOADED = re.compile(r"(^|\.)(visual|vision_tower|vision_model|audio_tower|mtp|multi_modal_projector)\.")


def source_parameters(source: Source) -> int:
    """The decoder's parameter count from the files' headers alone (no weight is read): each
    safetensors file's JSON header, or the GGUF's tensor table; a file cut short is refused."""
    try:
        return _parameters(source)
    except CUT_FILE as exc:  # json's errors are ValueErrors
        raise incomplete(source, exc) from None


def _parameters(source: Source) -> int:
    if source.gguf_file:
        import gguf  # the export extra's

        reader = gguf.GGUFReader(source.folder / source.gguf_file)
        return sum(int(t.n_elements) for t in reader.tensors)
    count = 0
    for path in source.files()[1:]:
        with path.open("rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, tensor in header.items():
            if name != "__metadata__" and not NOT_LOADED.search(name):
                count += math.prod(tensor["shape"])
    return count


def export_floor(parameters: int, weights: str) -> int:
    """Bytes the export certainly holds at once: the float32 model plus the graph's weights."""
    return parameters * 4 + parameters * WEIGHT_FORMATS[weights] // 8


def check_export_memory(source: Source, weights: str, available: Available | None = None) -> None:
    """Refuse, in one line, an export whose floor exceeds what this process may use."""
    parameters = source_parameters(source)
    floor = export_floor(parameters, weights)
    room = available or available_memory()
    log.info(
        "memory preflight: %s parameters, at least %s held at once; %s",
        f"{parameters:,}",
        human(floor),
        f"{human(room.bytes)} available ({room.what})" if room else "no limit found",
    )
    if room is not None and floor > room.bytes:
        raise KvedgeError(
            f"the export needs at least {human(floor)} of memory (the float32 model of {parameters:,} "
            f"parameters and its {weights} weights, held together), and {human(max(room.bytes, 0))} is "
            f"available ({room.what}); pass --no-memory-check to try anyway"
        )
