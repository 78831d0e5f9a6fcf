"""`ExternalData`: the graph's data file (model.onnx.data), written while the graph is built.

A builder given one (`Builder.initializer`) writes each large initializer's bytes to the file the
moment the tensor is made and keeps only its external-data fields, as onnx's own save writes them
(`convert_model_to_external_data`, then `save_external_data`): the tensor's data_location is
EXTERNAL and its external_data entries are location (the file's name, which lies beside the graph
file), offset and length. So the export holds no weight twice, nor all of them at once.

"Large" is onnx's test, kept exactly so that a graph built with the file and one saved without it
externalize the same tensors: sys.getsizeof(raw bytes) >= EXTERNAL_THRESHOLD, the bytes' length
plus Python's bytes header. Tensors lie back to back, unpadded, as onnx's save writes them (it
aligns nothing; onnxruntime maps a tensor at any offset, rounding the mapping down to a page).

An identical tensor (same name, element type, dims and bytes, by sha256) is written once: each of
its protos points at the same offset, so the two forms of one graph, which share what they hold
alike by comparing their serialized tensors (`forms.two_forms`), still find it shared.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import TracebackType

import numpy as np
from onnx import TensorProto, helper, numpy_helper

# onnx's default size_threshold (convert_model_to_external_data), compared as onnx compares it
EXTERNAL_THRESHOLD = 1024


def is_large(raw: bytes) -> bool:
    """True when onnx's default save would move raw bytes `raw` to the data file."""
    return sys.getsizeof(raw) >= EXTERNAL_THRESHOLD


def stored_length(tensor: TensorProto) -> int:
    """The bytes of `tensor`'s data: its raw bytes, or the length its external data records."""
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return int({entry.key: entry.value for entry in tensor.external_data}.get("length", 0))


class ExternalData:
    """The data file at `path`, open for appending tensors while a graph is built (a context
    manager: leaving it closes the file, which must happen before the graph is saved)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.location = self.path.name  # relative to the graph file, which lies beside it
        self._file = open(self.path, "xb")
        self.size = 0  # bytes written so far
        self._written: dict[bytes, tuple[int, int]] = {}  # sha256 of a tensor -> (offset, length)

    def keep(self, tensor: TensorProto) -> TensorProto:
        """`tensor` as the graph keeps it: itself when small, else (its bytes written, once per
        identical tensor) with external-data fields in place of its raw bytes."""
        if not tensor.HasField("raw_data"):
            return tensor
        raw = tensor.raw_data
        if not is_large(raw):
            return tensor
        return self._written_tensor(tensor.name, tensor.data_type, list(tensor.dims), raw)

    def keep_array(self, name: str, array: np.ndarray) -> TensorProto:
        """`keep(numpy_helper.from_array(array, name))`, the same proto, without its bytes copied
        three times on the way (to bytes, into the message, out of it): a large array's own
        buffer is written."""
        array = np.ascontiguousarray(array)
        if array.dtype.kind not in "biuf" or sys.getsizeof(b"") + array.nbytes < EXTERNAL_THRESHOLD:
            return self.keep(numpy_helper.from_array(array, name))
        data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        return self._written_tensor(name, data_type, list(array.shape), array.reshape(-1).view(np.uint8))

    def _written_tensor(
        self, name: str, data_type: int, dims: list[int], raw: bytes | np.ndarray
    ) -> TensorProto:
        """The external-data proto of a tensor whose bytes are `raw`, written unless an identical
        tensor was."""
        key = hashlib.sha256(repr((name, data_type, dims)).encode())
        key.update(raw)
        digest = key.digest()
        if digest not in self._written:
            self._written[digest] = (self.size, len(raw))
            self._file.write(raw)
            self._file.flush()  # the file's end is where `save_onnx` appends, even while open
            self.size += len(raw)
        offset, length = self._written[digest]
        # a new message: clearing raw_data would leave its bytes in the message's memory (upb
        # frees a message's memory with the message only)
        kept = TensorProto(name=name, data_type=data_type, dims=dims)
        kept.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.location), ("offset", offset), ("length", length)):
            entry = kept.external_data.add()
            entry.key, entry.value = k, str(v)
        return kept

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ExternalData:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
