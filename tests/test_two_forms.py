"""Two forms of one graph (`kvedge.export.graph.forms.two_forms`, docs/design/graph-variants.md): "ort"
exports with int8/int4 weights hold the decoder twice, as the branches of one If on the step's
length; a step of up to VERIFY_TOKENS tokens per row (a decode step, a speculative verify: its
rows to the bit those of decode steps, tests/test_speculate.py) runs the form whose quantized
matmuls are kvedge.QuantMatMul, a longer step the MatMulNBits form.

What is compared, and how closely:
- the graph's shape: each form's matmuls, each weight stored once per form, shared tensors once;
- the decode form against the same graph with its decode branch replaced by the prefill form (so
  every step runs MatMulNBits): the two quantize activations alike, but the decode form's grids
  have float16 scales and minimums, it adds in another order and keeps the kept channels' rows
  in float16, and an int8-rounded activation that lands on the other side of a tie moves an
  output by a whole int8 level (tests/test_side_inputs.py). These random weights sit on no float16
  grid, so their blocks' grids differ more than a GGUF's would. The bound is on distributions:
  mean KL over 40 decode steps under 4e-3 and no logit moved by 10% of the logits' range
  (measured: int4 KL 8.4e-4, 3.3% of the range; int8 3.3e-5, 0.6%). Zeroing the decode form's
  kept-channel rows gave KL 0.26. Top-1 agreement is not asserted: these models' next-token
  distributions are near uniform (entropy 5.5 nats over 300 tokens), so near-ties flip (90%);
- a batched decode step (several rows through the op's multi-row path) against the same rows
  decoded one at a time: each row's arithmetic is the same, so to 1e-5 of the logits' range.
"""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import onnx
import pytest
from conftest import decode_logits, export_once, random_ids, save_graph
from tiny import make_tiny_model

from kvedge.contract import ONNX_FILE, QUANT_MATMUL_OP, ExportRecipe, Manifest
from kvedge.errors import KvedgeError
from kvedge.export.export import recorded
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(weights, kv_dtype, decode_matmuls) -> ort artifact folder, built once per module."""
    root = tmp_path_factory.mktemp("two_forms")
    fields = ("weights", "kv_dtype", "decode_matmuls")
    return export_once(make_tiny_model(root / "hf", "llama"), root, *fields, max_len=96, variant="ort")


def forms(folder) -> tuple[onnx.GraphProto, onnx.GraphProto, onnx.GraphProto]:
    """(outer graph, decode form, prefill form) of a two-form artifact."""
    graph = onnx.load(str(folder / ONNX_FILE), load_external_data=False).graph
    (choice,) = [node for node in graph.node if node.op_type == "If"]
    branches = {a.name: a.g for a in choice.attribute}
    return graph, branches["then_branch"], branches["else_branch"]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_each_form_holds_its_own_matmuls_and_shares_the_rest(exports, weights):
    folder = exports(weights, "int8")
    layers = Manifest.load(folder).geometry.num_layers
    outer, decode, prefill_form = forms(folder)
    decode_ops = Counter(node.op_type for node in decode.node)
    prefill_ops = Counter(node.op_type for node in prefill_form.node)
    assert decode_ops[QUANT_MATMUL_OP] == 4 * layers + 1  # qkv, o, gate_up, down; LM head
    assert decode_ops["DequantizeLinear"] == 0 and decode_ops["SideInputs"] == 0
    assert prefill_ops[QUANT_MATMUL_OP] == 0 and prefill_ops["DequantizeLinear"] == 4 * layers + 1
    names = [[t.name for t in g.initializer] for g in (outer, decode, prefill_form)]
    assert sum(map(len, names)) == len(set().union(*map(set, names)))  # nothing stored twice
    assert "model.embed_tokens.weight" not in set().union(*map(set, names))  # the head's blocks instead
    assert "logits.rows_vocab.weight_q" in names[2]  # `EmbeddingTable`: the prefill form's head
    assert all(n.endswith(".qmm_weights") for n in names[1])  # the kept rows inside each tile
    assert not any(n.endswith(".qmm_weights") for n in names[2])


def prefill_form_only(folder, out):
    """A copy of the artifact whose If runs the prefill form for every step."""
    shutil.copytree(folder, out)
    model = onnx.load(str(out / ONNX_FILE))
    (choice,) = [node for node in model.graph.node if node.op_type == "If"]
    branches = {a.name: a for a in choice.attribute}
    then = onnx.GraphProto()
    then.CopyFrom(branches["else_branch"].g)
    then.name = "kvedge_prefill_again"
    branches["then_branch"].g.CopyFrom(then)
    return save_graph(model, out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize(("weights", "kv_dtype"), [("int4", "int8"), ("int8", "float32")])
def test_decode_form_tracks_the_prefill_form(exports, tmp_path, weights, kv_dtype):
    folder = exports(weights, kv_dtype)
    ids = random_ids(60, seed=4)
    got = decode_logits(folder, ids, 20)
    want = decode_logits(prefill_form_only(folder, tmp_path / "prefill_only"), ids, 20)
    assert np.array_equal(got[0], want[0])  # the first row is a prefill in both
    p, q = log_softmax(want[1:]), log_softmax(got[1:])
    kl = (np.exp(p) * (p - q)).sum(axis=-1)
    assert kl.mean() < 4e-3, kl
    assert np.abs(got - want).max() < 0.1 * float(np.ptp(want))


def test_a_batched_decode_step_equals_its_rows_one_at_a_time(exports):
    folder = exports("int4", "int8")
    prompts = [random_ids(n, seed=s) for n, s in ((9, 1), (30, 2), (17, 3))]
    batched = Model(folder, slots=3)
    alone = Model(folder, slots=1)
    rows = []
    for slot, prompt in enumerate(prompts):
        prefill(batched.backend, batched.cache, slot, [prompt])
    tokens = [5, 77, 123]
    both = decode_one_token(batched.backend, batched.cache, 0, tokens)  # slots 0..2, 3 rows
    for prompt, token in zip(prompts, tokens, strict=True):
        alone.cache.reset(0)
        prefill(alone.backend, alone.cache, 0, [prompt])
        rows.append(decode_one_token(alone.backend, alone.cache, 0, [token])[0])
    want = np.stack(rows)
    np.testing.assert_allclose(both, want, rtol=0, atol=1e-5 * float(np.ptp(want)))


def test_decode_matmuls_onnxruntime_is_the_prefill_form_alone(exports, tmp_path):
    """--decode-matmuls onnxruntime (one copy of the weights) exports exactly the two-form graph's
    prefill form: no If, no QuantMatMul, and the same logits to the bit as the two-form graph with
    its decode branch replaced by its prefill form."""
    one = exports("int4", "int8", "onnxruntime")
    graph = onnx.load(str(one / ONNX_FILE), load_external_data=False).graph
    assert not {"If", QUANT_MATMUL_OP} & {node.op_type for node in graph.node}
    assert Manifest.load(one).weight_decode_matmuls == "onnxruntime"
    assert Manifest.load(exports("int4", "int8")).weight_decode_matmuls == "kvedge"
    ids = random_ids(40, seed=6)
    want = decode_logits(prefill_form_only(exports("int4", "int8"), tmp_path / "prefill_only"), ids, 12)
    np.testing.assert_array_equal(decode_logits(one, ids, 12), want)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (dict(variant="portable", weights="int4", decode_matmuls="kvedge"), "applies to --variant ort"),
        (dict(variant="ort", weights="float32", decode_matmuls="onnxruntime"), "applies to --variant ort"),
        (dict(variant="ort", weights="int4", decode_matmuls="mlas"), r"allowed: \['kvedge', 'onnxruntime'\]"),
        (dict(variant="ort", weights="int4", kv_dtype="float16", decode_matmuls="kvedge"), "CUDA form"),
    ],
)
def test_decode_matmuls_refuses_what_it_does_not_apply_to(options, said):
    with pytest.raises(KvedgeError, match=said):
        ExportRecipe(max_len=64, **options)


def test_decode_matmuls_recorded_where_it_applies():
    decode = {
        (variant, weights, kv): recorded(ExportRecipe(variant=variant, weights=weights, kv_dtype=kv))[
            "weight_decode_matmuls"
        ]
        for variant, weights, kv in [
            ("ort", "int4", "int8"),
            ("ort", "int8", "float32"),
            ("ort", "int4", "float16"),
            ("ort", "float32", "int8"),
            ("portable", "int4", "float32"),
        ]
    }
    assert list(decode.values()) == ["kvedge", "kvedge", "onnxruntime", "", ""]
