"""The embeddings the runtime looks up for a quantized graph with a tied LM head
(kvedge/runtime/embeddings.py): the table is stored once, as the head's blocks, and no float copy
of it is in the graph. Checked against the head's own initializers dequantized by onnx's reference
path (exact: the same stored numbers), against the float32 embedding of the source (within the
export's recorded max |w - w_hat|), and against a data file rewritten after the export (refused).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import export_once
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
from tiny import make_tiny_model

from kvedge.contract import HEAD_PARTS, HEAD_TABLE, ONNX_FILE, ExportRecipe, Manifest
from kvedge.errors import ArtifactMismatch
from kvedge.export.export import export_model
from kvedge.export.graph import all_graphs
from kvedge.runtime.embeddings import TableEmbeddings
from kvedge.runtime.model import Model

RECIPES = {
    "portable-int4": ExportRecipe(max_len=64, weights="int4"),
    "portable-int8": ExportRecipe(max_len=64, weights="int8"),
    "portable-int4-float16": ExportRecipe(max_len=64, weights="int4", precision="float16"),
    "ort-int4-head8": ExportRecipe(max_len=64, weights="int4", variant="ort", kv_dtype="int8"),
    "portable-int4-no-kept": ExportRecipe(max_len=64, weights="int4", outlier_channels=0),
    "portable-int4-head4": ExportRecipe(max_len=64, weights="int4", head_bits=4),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("embed") / "hf", "llama")


# the ExportRecipe fields the cases above set, in the order `exported` takes them
FIELDS = ("weights", "variant", "precision", "kv_dtype", "outlier_channels", "head_bits")


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """name -> the artifact folder of RECIPES[name], built once per module (`export_once`)."""
    get = export_once(source, tmp_path_factory.mktemp("embed_exports"), *FIELDS, max_len=64)
    return lambda name: get(*(getattr(RECIPES[name], field) for field in FIELDS))


def head_weight(folder) -> np.ndarray:
    """w [hidden, vocab] as the graph's LM head computes with it, from its initializers: onnx's
    reference DequantizeLinear of the codes, plus each block's offset, the kept channels exact."""
    model = onnx.load(str(folder / ONNX_FILE))
    found = {t.name: numpy_helper.to_array(t) for g in all_graphs(model.graph) for t in g.initializer}
    codes, scale = (found[HEAD_TABLE + HEAD_PARTS[p]] for p in ("codes", "scale"))
    block = Manifest.load(folder).embedding.block_size
    node = onnx.helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=0, block_size=block)
    graph = onnx.helper.make_graph(
        [node],
        "dq",
        [
            onnx.helper.make_tensor_value_info(
                "q", onnx.helper.np_dtype_to_tensor_dtype(codes.dtype), list(codes.shape)
            ),
            onnx.helper.make_tensor_value_info(
                "s", onnx.helper.np_dtype_to_tensor_dtype(scale.dtype), list(scale.shape)
            ),
        ],
        [onnx.helper.make_tensor_value_info("w", onnx.helper.np_dtype_to_tensor_dtype(scale.dtype), None)],
    )
    dq = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    w = ReferenceEvaluator(dq).run(None, {"q": codes, "s": scale})[0].astype(np.float32)
    side = found.get(HEAD_TABLE + HEAD_PARTS["side"])  # [rows, vocab], a portable graph's [vocab, rows]
    if side is not None and side.shape[0] == w.shape[1] != side.shape[1]:
        side = side.T
    kept = found.get(HEAD_TABLE + HEAD_PARTS["kept"], np.zeros(0, np.int64))
    blocks = w.shape[0] // block
    offsets = np.zeros((blocks, w.shape[1]), np.float32)
    if side is not None and side.shape[0] > kept.size:
        offsets = side[:blocks].astype(np.float32)
    w += np.repeat(offsets, block, axis=0)
    if kept.size:
        w[kept] = side[-kept.size :].astype(np.float32) + offsets[kept // block]
    return w


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_lookup_is_the_heads_own_table_and_no_float_copy_is_stored(exported, source, name):
    import torch
    from transformers import AutoModelForCausalLM

    folder = exported(name)
    manifest = Manifest.load(folder)
    assert manifest.embedding is not None and manifest.embedding.bits == RECIPES[name].lm_head_bits
    if manifest.embedding.side is not None:  # TensorRT keeps a portable head's side rows once [vocab, *]
        assert manifest.embedding.side_token_major() == (RECIPES[name].variant == "portable")
    graph = onnx.load(str(folder / ONNX_FILE), load_external_data=False)
    stored = [t for g in all_graphs(graph.graph) for t in g.initializer]
    assert not [t.name for t in stored if "embed_tokens" in t.name]
    assert manifest.names.inputs_embeds in [i.name for i in graph.graph.input]
    lookup = TableEmbeddings.of(folder, manifest)
    ids = np.array([[0, 5, 17, 319], [3, 3, 200, 1]], np.int64)
    rows = lookup(ids)
    assert rows.shape == (2, 4, manifest.hidden_size)
    assert rows.dtype == (np.float16 if RECIPES[name].half else np.float32)
    expected = head_weight(folder)[:, ids.reshape(-1)].T.reshape(rows.shape)
    if RECIPES[name].half:  # the reference rounds codes x scale to float16 before the offset: two
        # roundings of terms as large as the row's values, which may cancel to a small result
        atol = 2.0**-10 * float(np.abs(expected).max())
        np.testing.assert_allclose(rows.astype(np.float32), expected, rtol=2.0**-9, atol=atol)
    else:  # the same stored numbers, the same float32 arithmetic
        np.testing.assert_array_equal(rows, expected)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    with torch.no_grad():
        table = hf.model.embed_tokens.weight.numpy()
    error = float(np.abs(rows.astype(np.float32) - table[ids]).max())
    bound = float({p.key: p.value for p in graph.metadata_props}["kvedge.max_quant_error"])
    # the head's quantization error, plus float16's rounding of a float16 graph's embeddings
    slack = float(np.abs(table).max()) * 2.0**-10 if RECIPES[name].half else 1e-6
    assert error <= bound + slack, (error, bound)


def test_float_weights_keep_the_graphs_own_gather(source, tmp_path):
    manifest = export_model(source, tmp_path / "f32", ExportRecipe(max_len=64))
    assert manifest.embedding is None
    graph = onnx.load(str(tmp_path / "f32" / ONNX_FILE), load_external_data=False).graph
    assert manifest.names.inputs_embeds not in [i.name for i in graph.input]
    assert any(n.op_type == "Gather" and n.input[1] == manifest.names.input_ids for n in graph.node)


def test_a_data_file_rewritten_after_the_export_is_refused(exported, tmp_path):
    import shutil

    folder = tmp_path / "moved"
    shutil.copytree(exported("portable-int4"), folder)
    table = Manifest.load(folder).embedding
    data = folder / table.file
    raw = bytearray(data.read_bytes())
    raw[table.scale.offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactMismatch, match="graph fingerprint .* re-export"):
        Model(folder)  # the whole files' fingerprint
    with pytest.raises(ArtifactMismatch, match="not those the export wrote.*re-export"):
        TableEmbeddings.of(folder, Manifest.load(folder))  # where the table's first bytes were


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_an_untied_table_is_8_bit_blocks_in_a_file_of_its_own(tmp_path, precision):
    """An untied model's quantized export keeps no float table in the graph: its input table is
    8-bit blocks in embeddings.bin, which the lookup reads within one rounding step of each
    block; the answer is a full prefill's step by step; a byte flipped there is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvedge.contract import EMBEDDINGS_FILE
    from kvedge.runtime.generate import decode_one_token, prefill

    source = make_tiny_model(tmp_path / "hf", "llama", tie_word_embeddings=False)
    folder = tmp_path / "out"
    recipe = ExportRecipe(max_len=64, weights="int4", precision=precision)
    manifest = export_model(source, folder, recipe)
    table = manifest.embedding
    assert table.file == EMBEDDINGS_FILE and table.bits == 8 and (folder / EMBEDDINGS_FILE).is_file()
    graph = onnx.load(str(folder / ONNX_FILE), load_external_data=False)
    assert not [t.name for g in all_graphs(graph.graph) for t in g.initializer if "embed_tokens" in t.name]
    hf = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    with torch.no_grad():
        float_table = hf.model.embed_tokens.weight.numpy()
        head = hf.lm_head.weight.numpy()
    assert not np.array_equal(float_table, head)  # untied: the head is another matrix
    ids = np.array([[0, 5, 17, 319], [3, 3, 200, 1]], np.int64)
    rows = TableEmbeddings.of(folder, manifest)(ids).astype(np.float32)
    blocks = float_table.reshape(float_table.shape[0], -1, table.block_size)
    step = np.abs(blocks).max(axis=2) / 128  # a block's grid step: its extreme at code -128
    bound = np.repeat(step, table.block_size, axis=1)[ids]  # half a step, or one at the clipped end
    slack = float(np.abs(float_table).max()) * (2.0**-10 if recipe.half else 1e-6)
    error = np.abs(rows - float_table[ids])
    assert (error <= bound + slack).all() and error.max() > 0
    with Model(folder) as model:  # decode steps read the same table as a prefill
        prompt = [5, 17, 200, 3, 9, 41]
        whole = prefill(model.backend, model.cache, 0, [prompt])[0]
        model.cache.reset(0)
        prefill(model.backend, model.cache, 0, [prompt[:3]])
        for token in prompt[3:]:
            stepped = decode_one_token(model.backend, model.cache, 0, [token])[0]
        np.testing.assert_allclose(stepped, whole, atol=1e-2 if recipe.half else 1e-4, rtol=0)
    raw = bytearray((folder / EMBEDDINGS_FILE).read_bytes())
    raw[table.codes.offset] ^= 0x01
    (folder / EMBEDDINGS_FILE).write_bytes(bytes(raw))
    with pytest.raises(ArtifactMismatch, match="graph fingerprint .* re-export"):
        Model(folder)
