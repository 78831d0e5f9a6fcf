"""A Hugging Face folder's weights, or a GGUF file's, read one tensor at a time, so the export's
float32 model never exists whole.

`open_streamed` gives the model's skeleton (parameters on the meta device; buffers real, so the
RoPE tables are the ones transformers computes) and `FolderWeights`: each state-dict name mapped
to where its tensor lies in the folder's safetensors files, read with plain file reads (no
memory map, whose touched pages would count as the process's) and widened to float32 when asked
for, never kept. bfloat16 widens exactly (its 16 bits are float32's high half), float16 too.

A GGUF file's tensors are read the same way (`open_streamed_gguf`): named, dequantized and laid
out as transformers loads them (`kvedge.export.gguf_blocks.GgufFile.floats`).

Checkpoint names become the model's as transformers maps them (`rename_source_key` with the
model's own renamings). A checkpoint transformers converts on load (fused experts, permuted
heads), a dtype without an exact float32 widening, a tensor of another shape or a parameter the
files lack is not streamed: `open_streamed` says why and the export loads the model whole.

`streaming` runs the skeleton (the export's channel calibration): each block's weights (a
decoder layer, or a module outside them) are read as the block starts and dropped as it ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvedge.machine import release_freed_memory

log = logging.getLogger(__name__)

# safetensors dtype -> the numpy dtype of its stored bytes; BF16 is read as uint16 and widened
STORED = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes lie: `path`, from byte `start` (the file's own offset), `dtype`
    (safetensors' name) and `shape`."""

    path: Path
    start: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        """The bytes of one row (one index of the first axis)."""
        return self.count // self.shape[0] * np.dtype(STORED[self.dtype]).itemsize

    def row_range(self, start: int, count: int) -> Stored:
        """Rows `start` .. `start + count` of this tensor, as a tensor of their own."""
        return Stored(self.path, self.start + start * self.row_bytes, self.dtype, (count, *self.shape[1:]))


def read_header(path: Path) -> tuple[dict[str, Stored], dict[str, str]]:
    """A safetensors file's tensors ({name: Stored}) and metadata, from its JSON header only."""
    with path.open("rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(size))
    metadata = header.pop("__metadata__", {}) or {}
    return {
        name: Stored(path, 8 + size + entry["data_offsets"][0], entry["dtype"], tuple(entry["shape"]))
        for name, entry in header.items()
    }, metadata


# values read and widened at a time: a large table is never held twice in float32
CHUNK_VALUES = 1 << 22
# tables an export reads some rows of at a time, never whole: Gemma 4's per-layer embeddings
# (E2B's: 8.8 GiB in float32), written a chunk at a time (`export.save_per_layer`) and gathered
# for the tokens a calibration batch holds (`streaming`)
READ_IN_ROWS = re.compile(r"(^|\.)embed_tokens_per_layer\.")


def read_tensor(stored: Stored) -> np.ndarray:
    """The tensor's values: floats widened to float32 (exactly), other types as stored; read
    CHUNK_VALUES at a time into the result."""
    dtype = np.dtype(STORED[stored.dtype])
    wide = stored.dtype in ("BF16", "F16", "F64")
    values = np.empty(stored.count, np.float32 if wide else dtype)
    chunk = np.empty(min(stored.count, CHUNK_VALUES), dtype)
    with stored.path.open("rb") as handle:
        handle.seek(stored.start)
        for start in range(0, stored.count, CHUNK_VALUES):
            part = chunk[: min(CHUNK_VALUES, stored.count - start)]
            if handle.readinto(memoryview(part).cast("B")) != part.nbytes:
                raise EOFError(f"{stored.path}: a tensor runs past the end of the file")
            if stored.dtype == "BF16":  # its bits are float32's high half
                values[start : start + part.size].view(np.uint32)[:] = part.astype(np.uint32) << 16
            else:
                values[start : start + part.size] = part
    return values.reshape(stored.shape)


class FolderWeights(Mapping[str, np.ndarray]):
    """The model's state dict, read on each access: name -> float32 array (a buffer of another
    type as the model holds it). `where` says where each name's tensor lies, `read` reads it
    (`read_tensor` of a safetensors `Stored`; a GGUF file's `floats` of its own name); `fixed`
    holds the buffers the files lack, as the model made them."""

    def __init__(
        self,
        where: dict[str, Any],
        fixed: dict[str, np.ndarray],
        read: Callable[[Any], np.ndarray] = read_tensor,
    ) -> None:
        self._where = where
        self._fixed = fixed
        self._read = read

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._fixed:
            return self._fixed[name]
        return self._read(self._where[name])

    def __iter__(self) -> Iterator[str]:
        yield from self._where
        yield from self._fixed

    def __len__(self) -> int:
        return len(self._where) + len(self._fixed)

    def __contains__(self, name: object) -> bool:
        return name in self._where or name in self._fixed

    def same(self, name: str, other: str) -> bool:
        """Whether `name` reads the tensor `other` does (a tied LM head)."""
        return name in self._where and self._where[name] == self._where.get(other)

    def rows(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows `index` of table `name` [rows, ...] (float32, as `self[name]` gives them): from a
        safetensors file only those rows are read."""
        stored = self.stored(name)
        if stored is None:
            return self[name][index]
        wanted = np.unique(index)  # sorted; neighbouring rows are read in one run
        runs = np.split(wanted, np.flatnonzero(np.diff(wanted) != 1) + 1) if len(wanted) else []
        read = [read_tensor(stored.row_range(int(run[0]), len(run))) for run in runs]
        table = np.concatenate(read) if read else np.empty((0, *stored.shape[1:]), np.float32)
        return table[np.searchsorted(wanted, index)]

    def stored(self, name: str) -> Stored | None:
        """Where a safetensors tensor `name` lies; None for another kind (a GGUF's, a buffer)."""
        where = self._where.get(name)
        return where if isinstance(where, Stored) else None


def row_chunks(weights: Mapping[str, np.ndarray], name: str, rows: int) -> Iterator[np.ndarray]:
    """Tensor `name`'s values `rows` rows at a time, as `weights[name]` gives them (float32): from a
    safetensors file a range of rows at a time, so a table larger than memory is never whole (Gemma
    4's per-layer embeddings); else read whole, then cut."""
    stored = weights.stored(name) if isinstance(weights, FolderWeights) else None
    if stored is None:
        whole = weights[name]
        for start in range(0, len(whole), rows):
            yield whole[start : start + rows]
        return
    for start in range(0, stored.shape[0], rows):
        yield read_tensor(stored.row_range(start, min(rows, stored.shape[0] - start)))


def skeleton(config: Any) -> Any:
    """The causal LM of `config` with its parameters on the meta device and its buffers real."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def open_streamed(
    folder: Path, files: list[Path], config: Any, key_mapping: dict[str, str] | None = None
) -> tuple[Any, FolderWeights] | None:
    """(the model's skeleton, its weights as `FolderWeights`) of the safetensors `files` in
    `folder` (their names renamed by `key_mapping` too, transformers' argument of that name), or
    None (logged, with why) where the export must load the model whole."""
    model = skeleton(config)
    stored: dict[str, Stored] = {}
    for path in files:
        tensors, metadata = read_header(path)
        if metadata.get("format", "pt") != "pt":
            return _whole(f"{path.name} holds {metadata['format']!r} tensors")
        stored.update(tensors)
    mapped = _mapped(model, stored, key_mapping)
    if isinstance(mapped, str):
        return _whole(mapped)
    return _with_buffers(model, mapped, read_tensor)


def open_streamed_gguf(file: Any, config: Any) -> tuple[Any, FolderWeights] | None:
    """(the model's skeleton, its weights as `FolderWeights`) of a GGUF file (`file`, a
    `kvedge.export.gguf_blocks.GgufFile`), each tensor read and dequantized as transformers
    dequantizes it (`GgufFile.floats`) when asked for, or None (logged, with why) where the
    export must load the model whole."""
    model = skeleton(config)
    meta = model.state_dict()
    mapped: dict[str, str] = {}
    for name, tensor in file.entries.items():
        if name not in meta:
            continue  # a part the export does not build
        if int(tensor.n_elements) != meta[name].numel():
            values, want = int(tensor.n_elements), meta[name].numel()
            return _whole(f"{tensor.name} holds {values:,} values, the model's {name} {want:,}")
        mapped[name] = name
    for name, tied in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if tied in mapped and name not in mapped:  # a GGUF holds no output.weight where it is tied
            mapped[name] = tied
    return _with_buffers(model, mapped, file.floats)


def _with_buffers(
    model: Any, mapped: dict[str, Any], read: Callable[[Any], np.ndarray]
) -> tuple[Any, FolderWeights] | None:
    """`model` and its `FolderWeights` over `mapped` (name -> where its tensor lies, read by
    `read`): a buffer the files hold is copied into the skeleton, which runs with it; one they
    lack is kept as the model made it; None (logged) where they lack a parameter."""
    import torch

    buffers = dict(model.named_buffers())
    fixed = {}
    for name, value in model.state_dict().items():
        if name in mapped:
            if name in buffers:  # a checkpoint's buffer (a layer's scale): the skeleton runs with it
                buffers[name].copy_(torch.from_numpy(read(mapped[name])))
            continue
        if name in buffers and value.device.type != "meta":
            fixed[name] = value.numpy()
        else:
            return _whole(f"the files lack {name}")
    return model, FolderWeights(mapped, fixed, read)


def _whole(why: str) -> None:
    log.info("reading the weights whole, not layer by layer: %s", why)
    return None


def _mapped(
    model: Any, stored: dict[str, Stored], key_mapping: dict[str, str] | None = None
) -> dict[str, Stored] | str:
    """{state-dict name: its tensor in the files} as transformers names them, with `key_mapping`
    (a tied name reads the tensor it is tied to), or why they cannot be read one by one."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model, key_mapping)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = model.state_dict()
    mapped: dict[str, Stored] = {}
    for key, tensor in stored.items():
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if name not in meta:
            continue  # a part the export does not build (vision tower, multi-token heads)
        if converted is not None:
            return f"transformers converts {key} as it loads it"
        if tensor.dtype not in STORED:
            return f"{key} is {tensor.dtype}, which has no exact float32 form here"
        if tensor.shape != tuple(meta[name].shape):
            return f"{key} is {list(tensor.shape)}, the model's {name} is {list(meta[name].shape)}"
        mapped[name] = tensor
    for name, tied in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if tied in mapped and name not in mapped:  # transformers ties a head the files lack
            mapped[name] = mapped[tied]
    return mapped


@contextlib.contextmanager
def streaming(model: Any, weights: Mapping[str, np.ndarray]) -> Iterator[None]:
    """Within: running `model` (a `skeleton`) reads each block's weights from `weights` as the
    block starts and drops them as it ends. A block is each item of a ModuleList (a decoder
    layer) and each module outside them that holds parameters of its own."""
    import torch

    blocks = _blocks(model)
    handles = []
    for prefix, module, recurse in blocks:
        names = [name for name, _ in module.named_parameters(recurse=recurse)]
        if (
            isinstance(weights, FolderWeights)
            and names == ["weight"]
            and READ_IN_ROWS.search(f"{prefix}weight")
        ):
            handles += _gathered(module, f"{prefix}weight", weights)
            continue

        def load(mod: Any, args: Any, prefix: str = prefix, names: list[str] = names) -> None:
            for name in names:
                owner, attr = _owner(mod, name)
                value = torch.from_numpy(np.ascontiguousarray(weights[f"{prefix}{name}"]))
                owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)

        def drop(mod: Any, args: Any, output: Any, names: list[str] = names) -> None:
            for name in names:
                owner, attr = _owner(mod, name)
                meta = owner._parameters[attr].to("meta")
                owner._parameters[attr] = torch.nn.Parameter(meta, requires_grad=False)
            # glibc keeps a block's freed weights and activations in its heap: without this a 3B
            # model's calibration grew with every layer (docs/PERFORMANCE.md, "Exporting at a real
            # size")
            release_freed_memory()

        handles.append(module.register_forward_pre_hook(load))
        handles.append(module.register_forward_hook(drop))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _gathered(module: Any, name: str, weights: FolderWeights) -> list[Any]:
    """Hooks that run embedding `module` (weight `name`, `READ_IN_ROWS`) over the rows its input
    ids need only: the ids become indices into those rows, read as the module starts and dropped
    as it ends."""
    import torch

    table = module.weight  # the skeleton's: on the meta device, the table's shape

    def load(mod: Any, args: Any) -> tuple[Any, ...]:
        ids, *rest = args
        needed, where = torch.unique(ids, return_inverse=True)
        rows = weights.rows(name, needed.numpy())
        mod._parameters["weight"] = torch.nn.Parameter(torch.from_numpy(rows), requires_grad=False)
        return (where.reshape(ids.shape), *rest)

    def drop(mod: Any, args: Any, output: Any) -> None:
        mod._parameters["weight"] = table

    return [module.register_forward_pre_hook(load), module.register_forward_hook(drop)]


def _blocks(model: Any) -> list[tuple[str, Any, bool]]:
    """(name prefix, module, whether its children's parameters are its own) of each block."""
    import torch

    items = [
        f"{name}.{i}" if name else str(i)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        for i in range(len(module))
    ]

    def inside(name: str, others: list[str]) -> bool:
        return any(name.startswith(f"{other}.") for other in others)

    outer = {item for item in items if not inside(item, items)}  # a layer's own lists are its
    blocks = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if name in outer:
            blocks.append((prefix, module, True))
        elif not inside(name, list(outer)) and module._parameters:
            blocks.append((prefix, module, False))
    return blocks


def _owner(module: Any, name: str) -> tuple[Any, str]:
    """The submodule of `module` holding parameter `name` (dotted) and the parameter's own name."""
    *path, attr = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr
