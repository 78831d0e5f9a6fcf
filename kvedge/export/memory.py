"""The export's memory preflight: before minutes of work, the export's peak estimated from the
source's file headers and the recipe, refused in one line where it exceeds what this process may
still use; and the one line an allocation that fails anyway becomes.

The graph's weights go to its data file as they are made (`kvedge.export.graph.external`) and a
folder of plain safetensors or a GGUF file is read a tensor at a time (`kvedge.export.streamed`),
so a streamed export's peak is its LM head's quantization: the table in float32 (the largest
tensor read whole; Gemma 4's larger per-layer table is read a range of rows at a time,
`READ_IN_ROWS`) beside its codes, scales and offsets, and a second layout where the graph holds
a decode form (`ExportRecipe.two_forms`). `export_estimate` is that, measured
(`HEAD_PEAK`); a source loaded whole (an AWQ or GPTQ checkpoint, what transformers converts)
adds its float32 model.

What this process may use is `kvedge.machine.available_memory`'s: the least of MemAvailable, the
cgroups' limits and `ulimit -v`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvedge.contract import ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.source import CUT_FILE, Source, incomplete
from kvedge.export.streamed import READ_IN_ROWS
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
    return [count for _, count in _named_tensors(source)]


def tensors_read_in_rows(source: Source) -> list[int]:
    """The values of each tensor a streamed export reads a range of rows at a time (`READ_IN_ROWS`
    in a safetensors folder; a GGUF file's are read whole)."""
    if source.gguf_file:
        return []
    return [count for name, count in _named_tensors(source) if READ_IN_ROWS.search(name)]


def _named_tensors(source: Source) -> list[tuple[str, int]]:
    try:
        return _tensors(source)
    except CUT_FILE as exc:  # json's errors are ValueErrors
        raise incomplete(source, exc) from None


def _tensors(source: Source) -> list[tuple[str, int]]:
    if source.gguf_file:
        import gguf  # the export extra's

        reader = gguf.GGUFReader(source.folder / source.gguf_file)
        return [(t.name, int(t.n_elements)) for t in reader.tensors]
    counts = []
    for path in source.files()[1:]:
        with path.open("rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, tensor in header.items():
            if name != "__metadata__" and not NOT_LOADED.search(name):
                counts.append((name, math.prod(tensor["shape"])))
    return counts


# A streamed export's peak RSS: STREAMED_BASE (the libraries, a layer's weights) plus HEAD_PEAK
# times the largest tensor's float32 bytes, by the graph's weights: the LM head's quantization
# sets the peak, whatever the depth. Both sit above what Llama-3.2-3B's and Qwen3-1.7B's shapes
# and a GGUF file peaked at (docs/PERFORMANCE.md, "Exporting at a real size").
STREAMED_BASE = 2**30
HEAD_PEAK = {"one form": 2.2, "two forms": 2.6}
# Address space an export maps beyond its resident peak (its libraries, threads' stacks and
# arenas), where the limit is `ulimit -v`; above the same runs' VmPeak - VmHWM (the same page).
# torch itself is mapped before the preflight (`kvedge.export.export`), which counts it in what
# is mapped already.
MAPPED_BEYOND_RESIDENT = 2**30


@dataclass(frozen=True)
class Estimate:
    """An export's estimated peak (`bytes`) and what sets it (`what`, a phrase)."""

    bytes: int
    what: str


def export_estimate(
    tensors: list[int], recipe: ExportRecipe, streamed: bool, in_rows: Sequence[int] = ()
) -> Estimate:
    """The peak of an export of a source with these tensors (their values, `source_tensors`) as
    `recipe`: read a tensor at a time (`streamed`; those of `in_rows`, among `tensors`, a range of
    rows at a time: not the largest read whole), or loaded whole in float32."""
    whole_read = list(tensors)
    if streamed:
        for count in in_rows:
            whole_read.remove(count)
    parameters, largest = sum(tensors), max(whole_read, default=0)
    head = STREAMED_BASE + int(HEAD_PEAK["two forms" if recipe.two_forms else "one form"] * 4 * largest)
    what = f"its largest tensor, {largest:,} values, in float32 and as the graph's weights"
    if streamed:
        return Estimate(head, what)
    whole = f"the float32 model of {parameters:,} parameters, loaded whole, and {what}"
    return Estimate(head + 4 * (parameters - largest), whole)


def check_export_memory(
    source: Source, recipe: ExportRecipe, available: Available | None = None, streamed: bool = False
) -> None:
    """Refuse, in one line, an export as `recipe` whose estimated peak exceeds what this process
    may use (`streamed`: the source is read one tensor at a time)."""
    tensors = source_tensors(source)
    room = available or available_memory()
    need = _need(tensors, tensors_read_in_rows(source), recipe, streamed, room)
    log.info(
        "memory preflight: %s parameters, a peak of about %s; %s",
        f"{sum(tensors):,}",
        human(need.bytes),
        f"{human(room.bytes)} available ({room.what})" if room else "no limit found",
    )
    if room is not None and need.bytes > room.bytes:
        raise KvedgeError(
            f"the export needs about {human(need.bytes)} of memory ({need.what}), and "
            f"{human(max(room.bytes, 0))} is available ({room.what}); pass --no-memory-check to try anyway"
        )


def export_needs(source: Source, recipe: ExportRecipe, streamed: bool) -> str:
    """What an export of `source` as `recipe` needs and what is available, for the error an
    allocation that failed becomes."""
    room = available_memory()
    need = _need(source_tensors(source), tensors_read_in_rows(source), recipe, streamed, room)
    have = f", and {human(max(room.bytes, 0))} is available now ({room.what})" if room else ""
    return f"it needs about {human(need.bytes)} ({need.what}){have}"


def _need(
    tensors: list[int], in_rows: list[int], recipe: ExportRecipe, streamed: bool, room: Available | None
) -> Estimate:
    """`export_estimate`, and the libraries' mapping where `room` limits the address space."""
    need = export_estimate(tensors, recipe, streamed, in_rows)
    if room is None or not room.address_space:
        return need
    return Estimate(need.bytes + MAPPED_BEYOND_RESIDENT, f"{need.what}, and its libraries mapped")


def out_of_memory(exc: BaseException) -> bool:
    """True when `exc` is an allocation that failed: a MemoryError (Python's, numpy's), torch's
    allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory"), or a library that
    could not be mapped (an ImportError: "libtorch_cpu.so: failed to map segment from shared
    object": a CUDA wheel of torch maps gigabytes under `ulimit -v`)."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, ImportError):
        return "failed to map segment" in str(exc) or "cannot allocate memory" in str(exc).lower()
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def failed_allocation(exc: BaseException) -> str:
    """An `out_of_memory` error as a phrase: "an allocation of 1.47 GiB failed" where it says its
    size (torch's allocator's, numpy's), else its first line."""
    text = str(exc)
    if found := re.search(r"tried to allocate (\d+) bytes", text):
        return f"an allocation of {human(int(found[1]))} failed"
    if found := re.search(r"Unable to allocate ([\d.]+ [KMGT]?i?B)", text):
        return f"an allocation of {found[1]} failed"
    return text.splitlines()[0] if text else type(exc).__name__
