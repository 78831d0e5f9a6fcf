"""The float16 KV cache of the `ort` variant (`--kv-dtype float16`): the in-place export
onnxruntime's CUDA provider runs, tested here on onnxruntime's CPU GroupQueryAttention, which
takes float16 too.

Tolerance against transformers: the graph casts Q, K and V to float16 before attention and
keeps the RoPE tables and the cache in float16, so every attention input carries fp16 rounding
(relative FP16_UNIT = 2**-11). Carried through the layers it moves a logit by a small multiple
of FP16_UNIT x the logits' range: measured 0.53-0.93 x over the eight tiny families (0.66 x on
llama; the float32 graph agrees to ~1.5e-6), bounded at 4 x as for float16 weights. A wrong
position, mask or cast moves logits by 1e-1 or more. Against itself (cache on / off, reuse /
re-prefill) the graph reads back exactly the float16 values it wrote, so the remaining
differences are summation order: ATOL_SELF.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import FAMILIES, GQA_WINDOW, random_ids, require_onnxruntime
from onnx import TensorProto
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM

from kvedge.contract import ExportRecipe, Manifest
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.planner import ModelFootprint, kv_bytes
from kvedge.runtime.backends.ort import (
    CALL,
    POOL,
    STEP,
    OrtBackend,
    binding_plan,
    cuda_graph_refusal,
    cuda_refusal,
)
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.sessions import HistoryPolicy

FP16_UNIT = 2.0**-11
ATOL_SELF = 1e-3  # measured 1.4e-4 (llama), 5e-4 (qwen3): float16 sums in another order; logits ~4
MAX_LEN = 128


def export_pair(root, family: str) -> tuple:
    """(source, float32-cache portable export, float16-cache ort export) of one tiny model."""
    overrides = dict(FAMILIES[family])
    source = make_tiny_model(root / "hf", overrides.pop("family", family), **overrides)
    export_model(source, root / "fp32", ExportRecipe(max_len=MAX_LEN))
    export_model(source, root / "fp16", ExportRecipe(max_len=MAX_LEN, variant="ort", kv_dtype="float16"))
    return source, root / "fp32", root / "fp16"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    if request.param == "gemma3":
        require_onnxruntime(*GQA_WINDOW)
    return export_pair(tmp_path_factory.mktemp(f"kv16-{request.param}"), request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return export_pair(tmp_path_factory.mktemp("kv16-llama"), "llama")


def teacher_forced(folder, ids: list[int], prompt: int = 20) -> np.ndarray:
    """Logits [len(ids) - prompt + 1, vocab]: a prefill of `prompt` tokens, then decode steps."""
    model = Model(folder)
    got = [prefill(model.backend, model.cache, 0, [ids[:prompt]])[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[prompt:]]
    return np.stack(got)


def greedy(folder, prompt: list[int], eos: int, steps: int = 64) -> list[int]:
    model = Model(folder)
    logits, tokens = prefill(model.backend, model.cache, 0, [prompt])[0], []
    for _ in range(steps):
        logits[eos] = -np.inf
        tokens.append(int(np.argmax(logits)))
        logits = decode_one_token(model.backend, model.cache, 0, [tokens[-1]])[0]
    return tokens


def test_matches_transformers_and_greedy_equals_the_float32_graph(pair):
    source, fp32, fp16 = pair
    hf = AutoModelForCausalLM.from_pretrained(source, dtype="float32").eval()
    ids = random_ids(52, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].numpy()[19:]
    got = teacher_forced(fp16, ids)
    bound = 4 * FP16_UNIT * float(ref.max() - ref.min())
    np.testing.assert_allclose(got, ref, atol=bound, rtol=0)
    prompt, eos = random_ids(16, seed=2), hf.config.eos_token_id
    assert greedy(fp16, prompt, eos) == greedy(fp32, prompt, eos)


def test_graph_is_float16_attention_in_a_float32_graph(llama):
    """The pool and the op are float16, everything around them float32; GroupQueryAttention's
    lengths come from device inputs (no Shape upstream) and its host-side total is the constant
    max_len, which is what lets CUDA capture the decode step (the docstring of kvedge.export.graph)."""
    _, fp32, fp16 = llama
    manifest = Manifest.load(fp16)
    layers = manifest.geometry.num_layers
    assert manifest.geometry.dtype == "float16" and manifest.in_place and not manifest.uses_kvedge_ops
    model = onnx.load(str(fp16 / "model.onnx"))
    graph = model.graph
    onnx.checker.check_model(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output)}
    cache = [s.name for s in manifest.graph_inputs() + manifest.graph_outputs() if s.layer is not None]
    assert len(cache) == 4 * layers and {types[n] for n in cache} == {TensorProto.FLOAT16}
    assert types[manifest.names.logits] == TensorProto.FLOAT
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == layers
    producer = {out: node for node in graph.node for out in node.output}
    consumers = {name: [n for n in graph.node if name in n.input] for name in (gqa[0].output[0],)}
    assert producer[gqa[0].input[0]].op_type == "Cast"  # packed QKV float32 -> float16
    assert [n.op_type for n in consumers[gqa[0].output[0]]] == ["Cast"]  # and back
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    assert initializers[gqa[0].input[6]] == MAX_LEN  # total_sequence_length: a constant
    assert initializers[gqa[0].input[7]].dtype == np.float16  # RoPE tables in the op's type

    def ancestors(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            node = producer.get(todo.pop())
            if node is not None and node.name not in seen:
                seen.add(node.name)
                todo += list(node.input)
        return {n.op_type for n in graph.node if n.name in seen}

    assert "Shape" not in ancestors(gqa[0].input[5])  # seqlens_k: made on the device
    f32 = onnx.load(str(fp32 / "model.onnx"), load_external_data=False).graph
    assert {t.name for t in f32.input} - {"position_ids"} == {t.name for t in graph.input}


def test_cache_on_equals_cache_off_and_reuse_equals_reprefill(llama):
    _, _, fp16 = llama
    model, fresh = Model(fp16, slots=2), Model(fp16)
    ids = random_ids(60, seed=3)
    prefill(model.backend, model.cache, 1, [ids[:17]])
    for n in range(17, 60):
        logits = decode_one_token(model.backend, model.cache, 1, [ids[n]])[0]
        if n % 7 == 0:
            fresh.cache.reset(0)
            full = prefill(fresh.backend, fresh.cache, 0, [ids[: n + 1]])[0]
            np.testing.assert_allclose(logits, full, atol=ATOL_SELF, rtol=0)

    chat, reference = Model(fp16), Model(fp16)
    messages = [{"role": "system", "content": "Be brief."}]
    for turn, question in enumerate(["Hello!", "What is a KV cache?", "And float16?"]):
        messages.append({"role": "user", "content": question})
        ids = chat.tokenizer.encode_chat(messages)
        logits = chat.prepare(0, ids)
        assert turn == 0 or chat.sessions[0].reused_tokens > 0
        reference.cache.reset(0)
        np.testing.assert_allclose(
            logits, prefill(reference.backend, reference.cache, 0, [ids])[0], atol=ATOL_SELF, rtol=0
        )
        messages.append({"role": "assistant", "content": f"Answer {turn}."})


def test_window_eviction_rerotates_float16_keys(llama):
    """Eviction re-rotates the kept float16 keys in float16 (`rotate_keys`: a product and a sum,
    each rounded): layer 0 must equal a fresh run over the kept tokens within 4 float16 units of
    the largest key (measured 1 unit: 0.00195 on keys up to 2.75)."""
    _, _, fp16 = llama
    policy = HistoryPolicy(mode="window", n_sink=4, evict_chunk=32)
    model, reference = Model(fp16, policy=policy), Model(fp16)
    ids = random_ids(MAX_LEN, seed=11)
    model.prepare(0, ids)
    logits = model.prepare(0, ids + random_ids(10, seed=12))
    kept = [int(t) for t in model.cache.token_ids(0)]
    assert model.sessions[0].evicted == 32 and np.isfinite(logits).all()
    prefill(reference.backend, reference.cache, 0, [kept])
    n = len(kept)
    got, want = (m.cache.pool[0, :, 0, :, :n].astype(np.float32) for m in (model, reference))
    np.testing.assert_allclose(got, want, atol=4 * FP16_UNIT * float(np.abs(want).max()), rtol=0)


def test_pool_and_planner_count_half_the_float32_bytes(llama):
    _, fp32, fp16 = llama
    half, full = Model(fp16, slots=3), Model(fp32, slots=3)
    assert half.cache.pool.dtype == np.float16
    assert half.cache.nbytes == half.manifest.geometry.pool_bytes(3) == full.cache.nbytes // 2
    a, b = ModelFootprint.from_export(fp16), ModelFootprint.from_export(fp32)
    g = a.geometry
    per_token = 2 * g.num_layers * g.num_kv_heads * g.head_dim * 2  # K and V, float16
    assert kv_bytes(a, 4, 1024) == per_token * 4 * 1024 == kv_bytes(b, 4, 1024) // 2


def test_options_are_refused_by_name():
    with pytest.raises(
        KvedgeError,
        match=r"--kv-dtype float16 with float32 compute is built for --variant ort only .* "
        r"allowed: \['float32', 'int8'\]",
    ):
        ExportRecipe(kv_dtype="float16")
    with pytest.raises(KvedgeError, match=r"allowed: \['float32', 'float16', 'int8', 'int4'\]"):
        ExportRecipe(kv_dtype="int2", variant="ort")
    assert ExportRecipe(kv_dtype="float16", variant="ort", weights="float16").kv_dtype == "float16"


def test_cuda_runs_it_in_place_and_may_capture_its_decode(llama, tmp_path):
    """The binding plan for provider "cuda" (pure, no GPU needed): every past and present tensor
    is the pool view [b, kv_heads, max_len, head_dim], bound on the device, present the same
    buffer as past (written in place); the step buffers are a few tokens' worth; prefill adds
    only prompt-sized host arrays. `cuda_graph` is allowed for this export only; the float32- and
    int8-cache ort exports are refused, naming --kv-dtype float16."""
    source, _, fp16 = llama
    manifest = Manifest.load(fp16)
    g, names = manifest.geometry, manifest.names
    assert cuda_refusal(manifest) is None and cuda_graph_refusal(manifest) is None
    slot_bytes = g.num_kv_heads * g.max_len * g.head_dim * 2  # one layer's K of one row, float16
    for batch in (1, 3):
        decode = binding_plan(manifest, "cuda", "decode", batch)
        assert {b.memory for b in decode} == {"cuda"} and CALL not in {b.buffer for b in decode}
        pool = {(b.name, b.output): b for b in decode if b.buffer == POOL}
        assert len(pool) == 4 * g.num_layers
        for i in range(g.num_layers):
            for past, present in zip(names.past(False), names.present(False), strict=True):
                read, written = pool[names.layer(past, i), False], pool[names.layer(present, i), True]
                assert read.shape == written.shape == g.layer_shape(batch) and read.dtype == np.float16
        assert all(b.nbytes < slot_bytes for b in decode if b.buffer == STEP)
        assert sum(b.nbytes for b in decode if b.buffer == POOL) == 2 * g.pool_bytes(batch)
    prefill_plan = binding_plan(manifest, "cuda", "prefill", 1, seq=8)
    calls = [b for b in prefill_plan if b.buffer == CALL]
    assert {b.memory for b in calls} == {"cpu"} and all(b.nbytes < slot_bytes for b in calls)

    # the CPU binding holds the plan: present outputs are bound at the pool's own addresses
    model = Model(fp16)
    prefill(model.backend, model.cache, 0, [random_ids(10, seed=4)])
    decode_one_token(model.backend, model.cache, 0, [5])
    (step,) = [s for s in model.backend._decode_bindings.values() if s.input_ids.shape[0] == 1]
    views = model.cache.layer_views(0, 1)
    assert [v.data_ptr() for v in step.binding.get_outputs()[1:]] == [
        view.ctypes.data for layer in views for view in layer
    ]

    for options in (dict(variant="ort"), dict(variant="ort", kv_dtype="int8")):
        out = tmp_path / options.get("kv_dtype", "float32")
        export_model(source, out, ExportRecipe(max_len=MAX_LEN, **options))
        other = Manifest.load(out)
        with pytest.raises(KvedgeError, match=r"cannot run this 'ort'-variant .*--kv-dtype float16"):
            binding_plan(other, "cuda", "decode", 1)
        with pytest.raises(KvedgeError, match=r"--variant ort --kv-dtype float16"):
            OrtBackend(out, other, provider="cuda", cuda_graph=True)
    with pytest.raises(KvedgeError, match="CUDAExecutionProvider is not available here"):
        OrtBackend(fp16, manifest, provider="cuda", cuda_graph=True)  # allowed, then no GPU here


@pytest.mark.real_model
def test_real_model_float16_cache_matches_transformers(default_hf, default_export):
    """SmolLM2-135M exported --variant ort --kv-dtype float16: logits within 4 x 2**-11 x the
    logits' range of transformers' float32 (measured 0.82 x: 0.026 on a range of 65), and the
    same 32 greedy tokens."""
    from test_parity import _real_model_against_transformers

    folder = default_export(ExportRecipe(variant="ort", kv_dtype="float16"))
    got, ref, greedy, want = _real_model_against_transformers(default_hf, folder)
    np.testing.assert_allclose(got, ref, atol=4 * FP16_UNIT * float(ref.max() - ref.min()), rtol=0)
    assert greedy == want
