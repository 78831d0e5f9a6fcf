"""The export's memory preflight: before minutes of work, what the export must hold at once
against what this process may still use, refused in one line where it cannot fit.

The floor (`export_floor`) is a lower bound, never an estimate that may overshoot. The graph's
weights go to its data file as they are made (`kvedge.export.graph.external`), so what the
export certainly holds is what it reads in float32: the whole model, where the source is loaded
whole (a GGUF file, an AWQ or GPTQ checkpoint), else the largest tensor (the embedding, read whole
to quantize it as the LM head), where it is streamed (`kvedge.export.streamed`). Measured peaks
sit higher (docs/PERFORMANCE.md, "Memory"), so a refused export would certainly have failed, and
a passed one may still run short.

What this process may use is `kvedge.machine.available_memory`'s: the least of MemAvailable, the
cgroups' limits and `ulimit -v`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct

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
    return sum(source_tensors(source))


def source_tensors(source: Source) -> list[int]:
    """The values of each of the decoder's tensors, from the files' headers alone."""
    try:
        return _tensors(source)
    except CUT_FILE as exc:  # json's errors are ValueErrors
        raise incomplete(source, exc) from None


def _tensors(source: Source) -> list[int]:
    if source.gguf_file:
        import gguf  # the export extra's

        reader = gguf.GGUFReader(source.folder / source.gguf_file)
        return [int(t.n_elements) for t in reader.tensors]
    counts = []
    for path in source.files()[1:]:
        with path.open("rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, tensor in header.items():
            if name != "__metadata__" and not NOT_LOADED.search(name):
                counts.append(math.prod(tensor["shape"]))
    return counts


def export_floor(parameters: int, largest: int | None = None) -> int:
    """Bytes the export certainly holds at once: the float32 model of `parameters` loaded whole,
    or its `largest` tensor in float32 when streamed."""
    return 4 * (parameters if largest is None else largest)


def check_export_memory(source: Source, available: Available | None = None, streamed: bool = False) -> None:
    """Refuse, in one line, an export whose floor exceeds what this process may use (`streamed`:
    the source is read one layer at a time)."""
    tensors = source_tensors(source)
    parameters, largest = sum(tensors), max(tensors, default=0)
    floor = export_floor(parameters, largest if streamed else None)
    room = available or available_memory()
    log.info(
        "memory preflight: %s parameters, at least %s held at once; %s",
        f"{parameters:,}",
        human(floor),
        f"{human(room.bytes)} available ({room.what})" if room else "no limit found",
    )
    if room is not None and floor > room.bytes:
        held = (
            f"its largest tensor, {largest:,} values, in float32"
            if streamed
            else f"the float32 model of {parameters:,} parameters, loaded whole"
        )
        raise KvedgeError(
            f"the export needs at least {human(floor)} of memory ({held}), and "
            f"{human(max(room.bytes, 0))} is available ({room.what}); pass --no-memory-check to try anyway"
        )
