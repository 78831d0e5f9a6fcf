"""The top-level nodes of an ONNX file, read from its protobuf wire format without the onnx
package (a device has the runtime only): test_ort_cuda.py reads the graph onnxruntime optimized
for CUDA (`optimized_model_path`) for Memcpy nodes.

Fields read (onnx.proto): ModelProto.graph = 7; GraphProto.node = 1; NodeProto.input = 1,
op_type = 4, domain = 7. Wire types: 0 varint, 1 fixed 64-bit, 2 length-delimited, 5 fixed 32-bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Node:
    op_type: str
    domain: str
    inputs: tuple[str, ...]


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: memoryview) -> Iterator[tuple[int, memoryview | int]]:
    """(field number, bytes of a length-delimited field or a scalar's value) of one message."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at : at + size], at + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = int.from_bytes(data[at : at + size], "little"), at + size
        else:
            raise ValueError(f"protobuf wire type {wire} (field {number}): ONNX files use 0, 1, 2 and 5")
        yield number, value


def graph_nodes(path: Path) -> list[Node]:
    """The main graph's nodes in file order (subgraphs not descended into)."""
    nodes = []
    for number, graph in _fields(memoryview(Path(path).read_bytes())):
        if number != 7:
            continue
        for field, node in _fields(graph):
            if field != 1:
                continue
            parts: dict[int, list[str]] = {1: [], 4: [], 7: []}
            for key, value in _fields(node):
                if key in parts:
                    parts[key].append(bytes(value).decode())
            nodes.append(Node("".join(parts[4]), "".join(parts[7]), tuple(parts[1])))
    return nodes
