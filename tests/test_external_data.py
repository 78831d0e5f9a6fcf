"""The graph's data file written while the graph is built (`kvedge.export.graph.external`,
`kvedge.export.export.graph_data`): a graph built so holds no large tensor's bytes in memory, and
saved it is the graph built without the file, to the bit.

What is compared, and how closely:
- one tensor against onnx's own save (`convert_model_to_external_data`, `save_external_data`):
  the same proto and the same bytes in the file; an identical tensor written once;
- a tiny model's graph built with the data file against the same graph built without it, each
  saved into a copy of its export: every initializer's name, type, dims and bytes, graph by graph
  (so the two forms share the same tensors), the data file's size (each tensor once, back to
  back), and the runtime's logits over a prefill and decode steps (both forms), equal to the bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import decode_logits, export_once, random_ids, save_graph
from onnx import helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data, save_external_data
from tiny import make_tiny_model

from kvedge.contract import ONNX_FILE, ExportRecipe, IONames
from kvedge.export.export import _rope, geometry_from_config, graph_bytes, graph_data
from kvedge.export.graph import DecoderSpec, all_graphs, build_decoder_graph, check_states
from kvedge.export.graph.builder import Builder
from kvedge.export.graph.external import ExternalData, is_large
from kvedge.export.quantize import calibration_ids, input_outliers
from kvedge.export.source import load_hf, resolve_source

# recipe name -> (variant, weights, kv_dtype, precision)
RECIPES = {
    "ort-int4": ("ort", "int4", "int8", "float32"),  # two forms: the decode form's kvedge.QuantMatMul
    "ort-int8": ("ort", "int8", "int8", "float32"),
    "portable-float16": ("portable", None, None, "float16"),
}
FIELDS = ("variant", "weights", "kv_dtype", "precision")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("external_data") / "hf", "llama")


@pytest.fixture(scope="module")
def pair(source, tmp_path_factory):
    """recipe name -> (its export with the graph rebuilt without the data file, the same export
    with the graph built into it), each made once per module."""
    root = tmp_path_factory.mktemp("external_pairs")
    export = export_once(source, root, *FIELDS, max_len=96)
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            exported, options = export(*RECIPES[name]), recipe(name)
            plain, written = root / f"{name}-plain", root / f"{name}-written"
            shutil.copytree(exported, plain)
            save_graph(build(source, options), plain)
            shutil.copytree(exported, written)
            (written / (ONNX_FILE + ".data")).unlink()
            with graph_data(written) as sink:
                model = build(source, options, sink)
            save_graph(model, written, written=True)
            made[name] = plain, written
        return made[name]

    return get


def recipe(name: str) -> ExportRecipe:
    return ExportRecipe(max_len=96, **{k: v for k, v in zip(FIELDS, RECIPES[name], strict=True) if v})


def build(source: Path, options: ExportRecipe, sink: ExternalData | None = None) -> onnx.ModelProto:
    """The graph of `source` as the export builds it (its kept channels measured as it measures
    them), its large tensors written to `sink` when given."""
    model, tokenizer = load_hf(resolve_source(source))
    spec = DecoderSpec.from_config(model.config)
    geometry = geometry_from_config(model.config, options.max_len, options.variant)
    geometry = check_states(geometry.with_dtype(options.kv_dtype, options.kv_group_size or None), options)
    cos, sin, local_tables, _ = _rope(model, spec, geometry, options.max_len)
    channels = options.kept_channels_of(False)
    outliers = input_outliers(model, calibration_ids(tokenizer), channels) if channels else None
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return build_decoder_graph(
        spec,
        geometry,
        weights,
        cos,
        sin,
        IONames(),
        options,
        outliers=outliers,
        local_tables=local_tables,
        sink=sink,
    )


def stored(folder: Path) -> list[dict[str, tuple]]:
    """Each graph's initializers (the outer graph, then its branches): name -> (type, dims, bytes)."""
    model = onnx.load(str(folder / ONNX_FILE))  # its external data read back
    return [
        {t.name: (t.data_type, tuple(t.dims), t.raw_data) for t in g.initializer}
        for g in all_graphs(model.graph)
    ]


def external_ranges(folder: Path) -> list[tuple[int, int]]:
    """The (offset, length) of the tensors the saved graph keeps in its data file, each range once,
    sorted."""
    model = onnx.load(str(folder / ONNX_FILE), load_external_data=False)
    found = []
    for g in all_graphs(model.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                where = {entry.key: entry.value for entry in t.external_data}
                found.append((int(where["offset"]), int(where["length"])))
    return sorted(set(found))


def test_a_tensor_lies_as_onnx_would_store_it(tmp_path):
    """Each tensor, the two at onnx's threshold included (991 bytes: 1024 as onnx measures them
    with sys.getsizeof), kept as onnx's own save keeps it, the file's bytes the same."""
    arrays = {
        "w": np.arange(600, dtype=np.float32).reshape(20, 30),
        "at": np.full(991, 7, np.uint8),
        "below": np.full(990, 9, np.uint8),
        "s": np.arange(8, dtype=np.int64),
    }
    with ExternalData(tmp_path / "ours.data") as sink:
        ours = [sink.keep(numpy_helper.from_array(a, n)) for n, a in arrays.items()]
    tensors = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    model = helper.make_model(helper.make_graph([], "g", [], [], tensors))
    convert_model_to_external_data(model, location="ours.data")
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            save_external_data(tensor, str(onnx_dir))
            tensor.ClearField("raw_data")
    assert [t.SerializeToString() for t in ours] == [t.SerializeToString() for t in model.graph.initializer]
    data = (tmp_path / "ours.data").read_bytes()
    assert data == (onnx_dir / "ours.data").read_bytes() == arrays["w"].tobytes() + arrays["at"].tobytes()
    assert [t.HasField("raw_data") for t in ours] == [False, False, True, True]


def test_an_identical_tensor_is_written_once(tmp_path):
    weight = np.ones((16, 32), np.float16)
    with ExternalData(tmp_path / "model.onnx.data") as sink:
        first = sink.keep(numpy_helper.from_array(weight, "w"))
        again = sink.keep(numpy_helper.from_array(weight, "w"))
        other_name = sink.keep(numpy_helper.from_array(weight, "v"))
        other_bytes = sink.keep(numpy_helper.from_array(weight * 2, "w"))
    assert again.SerializeToString() == first.SerializeToString()
    offsets = [int(t.external_data[1].value) for t in (first, other_name, other_bytes)]
    assert offsets == [0, weight.nbytes, 2 * weight.nbytes]
    assert sink.size == (tmp_path / "model.onnx.data").stat().st_size == 3 * weight.nbytes


def test_the_builder_keeps_no_large_bytes(source, tmp_path):
    """Built with the data file, the in-memory graph holds no initializer's bytes past onnx's
    threshold, and counts as many bytes as the graph built without it."""
    options = recipe("ort-int4")
    with ExternalData(tmp_path / "model.onnx.data") as sink:
        model = build(source, options, sink)
    tensors = [t for g in all_graphs(model.graph) for t in g.initializer]
    assert not [t.name for t in tensors if t.HasField("raw_data") and is_large(t.raw_data)]
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in tensors) > 20
    assert graph_bytes(model) == graph_bytes(build(source, options))
    with ExternalData(tmp_path / "builder.data") as sink:
        builder = Builder(17, sink=sink)
        builder.const("big", np.zeros(1024, np.float32))
        builder.const("small", np.zeros(4, np.float32))
    assert [t.HasField("raw_data") for t in builder.initializers] == [False, True]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_graph_built_into_its_data_file_stores_what_the_other_does(pair, name):
    plain, written = pair(name)
    ours, theirs = stored(written), stored(plain)
    assert [sorted(g) for g in ours] == [sorted(g) for g in theirs]  # each form shares the same
    assert ours == theirs
    if name.startswith("ort"):
        assert len(ours) == 3 and len(ours[0]) > 10  # two forms sharing their norms and tables
    ranges = external_ranges(written)
    ends = [offset + length for offset, length in ranges]
    assert [offset for offset, _ in ranges] == [0, *ends[:-1]]  # back to back, none twice
    size = (written / (ONNX_FILE + ".data")).stat().st_size
    assert size == sum(n for _, n in ranges) == (plain / (ONNX_FILE + ".data")).stat().st_size


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_its_logits_are_the_same_to_the_bit(pair, name):
    plain, written = pair(name)
    ids = random_ids(40, seed=3)
    ours, theirs = decode_logits(written, ids, 24), decode_logits(plain, ids, 24)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, theirs)
