"""Inputs the runtime looks up per token on the host: the token embeddings of a quantized graph
with a tied LM head (`TableEmbeddings`) and Gemma 4's per-layer embeddings (`PerLayerRows`);
`HostInputs` gives a step both, by graph input name.

Such a graph takes `inputs_embeds` instead of gathering rows of a float table: the table is the
LM head's own blocked weight w [hidden, vocab] (`kvedge.contract.EmbeddingTable`), stored once at
the head's bits, and row t of the embedding is column t of w. A float table beside the head cost
SmolLM2-135M's int4 export 113 MB (float32) and Llama-3.2-3B's 1.6 GB; TensorRT would fold a
DequantizeLinear feeding a Gather back into float weights, and onnxruntime runs it over the whole
table each step (docs/design/graph-variants.md, "Quantized weights").

The stored blocks are read in place: the export's data file is memory-mapped read-only, so only
the pages of the tokens looked up become resident (page cache, shared and reclaimable), and a
lookup of n tokens reads n columns: hidden codes, hidden / block scales and offsets, and the kept
channels' exact rows, each column a strided read of one element per row.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from kvedge.contract import STORED_CHECK_BYTES, EmbeddingTable, Manifest, PerLayerTable, StoredTensor
from kvedge.errors import ArtifactMismatch


class TableEmbeddings:
    """`lookup(ids)`: the embeddings [..., hidden] of token ids [...], in `dtype` (the graph's
    inputs_embeds dtype), computed as the LM head's dequantization does: codes x scale + the
    block's offset, the kept channels' rows exact."""

    def __init__(self, folder: Path, table: EmbeddingTable, hidden: int, vocab: int, dtype: np.dtype) -> None:
        path = Path(folder) / table.file
        if not path.is_file():
            raise ArtifactMismatch(f"{folder}: the embedding table's file {table.file} is missing; re-export")
        self.table, self.hidden, self.vocab, self.dtype = table, hidden, vocab, np.dtype(dtype)
        self._file = np.memmap(path, np.uint8, mode="r")
        self.blocks = hidden // table.block_size
        packed = table.bits == 4
        self.codes = self._view(table.codes, flat=packed)  # [hidden, vocab] int8, or packed int4 bytes
        self.scale = self._view(table.scale)  # [hidden / block, vocab]
        self.side = None if table.side is None else self._view(table.side)  # [offsets + kept, vocab]
        if self.side is not None and table.side_token_major():  # stored [vocab, offsets + kept]
            self.side = self.side.T  # a view: a token's rows are one contiguous read
        self.kept = np.zeros(0, np.int64) if table.kept is None else np.array(self._view(table.kept))
        expected = self.blocks * table.offsets + self.kept.size
        if self.side is not None and self.side.shape != (expected, vocab):
            raise ArtifactMismatch(
                f"{folder}: the embedding table's side rows are {list(self.side.shape)}, expected "
                f"[{expected}, {vocab}]; re-export"
            )

    @classmethod
    def of(cls, folder: Path, manifest: Manifest) -> TableEmbeddings | None:
        """The lookup `manifest`'s graph needs, or None where the graph gathers its own."""
        if manifest.embedding is None:
            return None
        spec = next(s for s in manifest.graph_inputs() if s.name == manifest.names.inputs_embeds)
        return cls(folder, manifest.embedding, manifest.hidden_size, manifest.vocab_size, spec.dtype)

    def _view(self, stored: StoredTensor, flat: bool = False) -> np.ndarray:
        end = stored.offset + stored.length
        if end > self._file.size:
            raise ArtifactMismatch(
                f"the embedding table's bytes {stored.offset}..{end} lie past the end of "
                f"{self.table.file} ({self._file.size} bytes); re-export"
            )
        data = self._file[stored.offset : end]
        first = hashlib.sha256(data[:STORED_CHECK_BYTES]).hexdigest()
        if first != stored.sha256:
            raise ArtifactMismatch(
                f"{self.table.file}: the embedding table's bytes at {stored.offset} are not those the "
                "export wrote (the data file was rewritten after the manifest); re-export"
            )
        data = data.view(np.dtype(stored.dtype))
        return data if flat else data.reshape(stored.shape)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        flat = np.asarray(ids, np.int64).reshape(-1)  # [n]
        n, bs, t = flat.size, self.table.block_size, self.table
        if self.table.bits == 4:  # element (k, v) of [hidden, vocab] is nibble k * vocab + v
            rows = np.arange(self.hidden, dtype=np.int64)[:, None]
            index = rows * self.vocab + flat[None, :]  # [hidden, n]
            nibble = (self.codes[index >> 1] >> ((index & 1) << 2).astype(np.uint8)) & 0xF
            codes = nibble.astype(np.int8) ^ np.int8(8)  # two's complement of the low 4 bits: (u ^ 8) - 8
            codes = codes - np.int8(8)
        else:
            codes = self.codes[:, flat]  # [hidden, n]
        scale = self.scale[:, flat].astype(np.float32)  # [blocks, n]
        w = codes.reshape(self.blocks, bs, n).astype(np.float32) * scale[:, None, :]
        offsets = None
        if t.offsets:
            offsets = self.side[: self.blocks, flat].astype(np.float32)  # [blocks, n]
            w += offsets[:, None, :]
        w = w.reshape(self.hidden, n)
        if self.kept.size:
            rows = self.side[self.blocks * t.offsets :, flat].astype(np.float32)  # [kept, n]
            w[self.kept] = rows + (offsets[self.kept // bs] if offsets is not None else 0.0)
        return np.ascontiguousarray(w.T).reshape(*np.shape(ids), self.hidden).astype(self.dtype, copy=False)


class PerLayerRows:
    """`lookup(ids)`: Gemma 4's per-layer inputs [..., layers x P] float32 of token ids [...],
    rows of the table in its .npy file (`PerLayerTable`), mapped read-only: only the pages of the
    tokens looked up become resident, page cache shared with the file and never GPU memory (E2B's
    table is about as large as the rest of its weights)."""

    def __init__(self, folder: Path, table: PerLayerTable) -> None:
        path = Path(folder) / table.file
        if not path.is_file():
            raise ArtifactMismatch(
                f"{folder}: the per-layer embedding file {table.file} is missing; re-export"
            )
        with open(path, "rb") as handle:
            first = hashlib.sha256(handle.read(STORED_CHECK_BYTES)).hexdigest()
        if first != table.sha256:
            raise ArtifactMismatch(
                f"{table.file}: its first bytes are not those the export wrote (the file was rewritten "
                "after the manifest); re-export"
            )
        self.rows = np.load(path, mmap_mode="r", allow_pickle=False)  # [rows, layers x P], mapped
        if self.rows.shape != tuple(table.shape) or self.rows.dtype != np.dtype(table.dtype):
            raise ArtifactMismatch(
                f"{table.file} holds {list(self.rows.shape)} {self.rows.dtype}, the manifest says "
                f"{list(table.shape)} {table.dtype}; re-export"
            )

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        flat = np.asarray(ids, np.int64).reshape(-1)  # [n]
        return self.rows[flat].astype(np.float32, copy=False).reshape(*np.shape(ids), self.rows.shape[1])


class HostInputs:
    """The graph inputs a step's runtime looks up from its token ids: {name: value} by graph
    input name, `inputs_embeds` (`TableEmbeddings`) and `per_layer_inputs` (`PerLayerRows`)."""

    def __init__(self, lookups: dict[str, TableEmbeddings | PerLayerRows]) -> None:
        self.lookups = lookups

    @classmethod
    def of(cls, folder: Path, manifest: Manifest) -> HostInputs | None:
        """What `manifest`'s graph takes from the runtime, or None where it gathers all itself."""
        lookups: dict[str, TableEmbeddings | PerLayerRows] = {}
        table = TableEmbeddings.of(folder, manifest)
        if table is not None:
            lookups[manifest.names.inputs_embeds] = table
        if manifest.per_layer is not None:
            lookups[manifest.names.per_layer_inputs] = PerLayerRows(folder, manifest.per_layer)
        return cls(lookups) if lookups else None

    @property
    def names(self) -> list[str]:
        return list(self.lookups)

    def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {name: lookup(ids) for name, lookup in self.lookups.items()}
