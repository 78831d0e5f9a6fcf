"""The 2026 hybrid models: LFM2 (short-convolution layers around attention ones) and Qwen3.5
(Gated DeltaNet layers, a convolution and a recurrent matrix state each, around gated attention
ones): the exported graph and the runtime's per-slot states against Hugging Face transformers on
tiny random models.

Tolerance: 1e-4 absolute on logits, as tests/test_parity.py (both sides float32; measured
differences 2e-6 to 5e-6). A state carried wrongly between calls (a chunk, a decode step, a turn,
a batch row) moves logits by 1e-1 or more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VARIANTS, Exported, decode_logits, random_ids
from test_serve import Server, run_alone
from test_sessions import QUESTIONS
from tiny import make_tiny_model

from kvedge.configs import load_warm_prefix_config
from kvedge.contract import ExportRecipe, Manifest
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.generate import SamplingConfig, decode_one_token, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import SUFFIX, read_warm_header
from kvedge.runtime.sessions import HistoryPolicy

ATOL = 1e-4
MAX_LEN = 512
# (family, overrides): layer patterns with state layers first and last, GQA and one KV head, tied
# and untied heads; LFM2 with a kernel of 4 and biases in the convolution's projections; Qwen3.5
# with key heads serving two value heads each, or one each
CONFIGS = {
    "lfm2": ("lfm2", {}),
    "lfm2-attention-first": (
        "lfm2",
        {
            "layer_types": ["full_attention", "conv", "conv", "full_attention", "conv", "conv"],
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
            "conv_L_cache": 4,
            "conv_bias": True,
        },
    ),
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5-attention-first": (
        "qwen3_5",
        {
            "layer_types": ["full_attention", "linear_attention", "linear_attention"],
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
            "linear_num_value_heads": 2,
            "linear_conv_kernel_dim": 3,
        },
    ),
}


@pytest.fixture(
    scope="module",
    params=[(name, variant) for name in sorted(CONFIGS) for variant in VARIANTS],
    ids=lambda param: "-".join(param),
)
def hybrid(request, tmp_path_factory) -> Exported:
    """A tiny model of each config, exported in each graph variant (`recipe` keeps the variant
    for the tests' own exports)."""
    name, variant = request.param
    family, overrides = CONFIGS[name]
    root = tmp_path_factory.mktemp(f"{name}-{variant}")
    source = make_tiny_model(root / "hf", family, seed=4, **overrides)
    export_model(source, root / "out", ExportRecipe(max_len=MAX_LEN, variant=variant))
    exported = Exported(source, root / "out")
    exported.variant = variant
    return exported


def state_layers(config) -> tuple[list[int], list[int]]:
    """(attention layers, state layers) of a config, as transformers reads `layer_types`."""
    kinds = list(config.layer_types)
    attention = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    return attention, [i for i in range(len(kinds)) if i not in attention]


def test_the_manifest_names_each_layers_states(hybrid):
    manifest = Manifest.load(hybrid.out)
    g, config = manifest.geometry, hybrid.hf.config
    attention, stateful = state_layers(config)
    assert list(g.kv_layers) == attention and g.num_layers == len(attention)
    assert g.model_layers == config.num_hidden_layers
    if config.model_type == "lfm2":
        shapes = {"conv": (config.conv_L_cache - 1, config.hidden_size)}
    else:
        channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim
        channels += config.linear_num_value_heads * config.linear_value_head_dim
        shapes = {
            "conv": (config.linear_conv_kernel_dim - 1, channels),
            "recurrent": (
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
            ),
        }
    assert {s.kind: s.shape for s in g.states} == shapes
    assert all(list(s.layers) == stateful for s in g.states)
    per_slot = sum(len(stateful) * int(np.prod(shape)) * 4 for shape in shapes.values())
    assert g.state_bytes_per_slot() == per_slot
    assert g.bytes_per_slot() == g.bytes_held(MAX_LEN) + per_slot
    model = hybrid.model(slots=2)
    for s in g.states:
        assert model.cache.states[s.kind].shape == (len(stateful), 2, *s.shape)
    assert model.cache.nbytes == g.pool_bytes(2)


@pytest.mark.parametrize("chunk", [256, 7])
def test_prefill_in_chunks_and_decode_match_hf(hybrid, chunk):
    """Every position's logits: a prompt prefilled whole or in chunks of 7 (the convolution state
    crosses each chunk's edge), then teacher-forced decode steps."""
    model = hybrid.model()
    ids = random_ids(60, seed=1)
    ref = hybrid.hf_logits(ids)  # [60, vocab]
    got = [prefill(model.backend, model.cache, 0, [ids[:30]], chunk=chunk)[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[30:]]
    np.testing.assert_allclose(np.stack(got), ref[29:], atol=ATOL, rtol=0)
    assert np.abs(ref).max() > 1.0  # logits far from zero: the tolerance means something


def test_greedy_64_tokens_identical_to_hf_generate(hybrid):
    ref, got = hybrid.greedy_pair(random_ids(16, seed=2))
    assert got == ref


def test_a_batch_equals_each_row_alone(hybrid):
    """Three prompts of different lengths prefilled in one call (rows right-padded: padding never
    enters a row's state), then decode steps in which one row idles: every row's logits equal its
    own run alone."""
    prompts = [random_ids(n, seed=10 + n) for n in (5, 17, 11)]
    steps = [random_ids(6, seed=20 + r) for r in range(3)]
    batch = hybrid.model(slots=3)
    alone = [hybrid.model() for _ in prompts]
    got = prefill(batch.backend, batch.cache, 0, prompts, chunk=8)
    for r, prompt in enumerate(prompts):
        want = prefill(alone[r].backend, alone[r].cache, 0, [prompt], chunk=8)[0]
        np.testing.assert_allclose(got[r], want, atol=ATOL, rtol=0)
    for step in range(6):
        tokens = [steps[r][step] if (r, step % 2) != (1, 1) else None for r in range(3)]  # row 1 idles
        got = decode_one_token(batch.backend, batch.cache, 0, tokens)
        for r, token in enumerate(tokens):
            if token is not None:
                want = decode_one_token(alone[r].backend, alone[r].cache, 0, [token])[0]
                np.testing.assert_allclose(got[r], want, atol=ATOL, rtol=0)
    assert batch.cache.lengths.tolist() == [m.cache.length(0) for m in alone]


def cold_logits(reference: Model, ids: list[int]) -> np.ndarray:
    """Next-token logits of `ids` prefilled from an empty slot."""
    reference.cache.reset(0)
    return prefill(reference.backend, reference.cache, 0, [ids])[0]


def test_ten_turns_equal_a_cold_prefill_each_turn(hybrid):
    """A 10-turn chat: each turn resumes the slot's state where the last reply ended (or, where
    the reply's text tokenizes otherwise than the tokens generated, as a random model's often
    does, where the last prompt ended) and prefills only the rest; its logits equal a cold
    prefill of the whole conversation."""
    model, reference = hybrid.model(), hybrid.model()
    messages = [{"role": "system", "content": "Be brief."}]
    last = 0  # the previous turn's prompt tokens
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        ids = model.tokenizer.encode_chat(messages)
        logits = model.prepare(0, ids)
        assert model.sessions[0].reused_tokens >= last
        last = len(ids)
        np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)
        text = "".join(e.text for e in model.chat(messages, SamplingConfig(max_new_tokens=8)))
        messages.append({"role": "assistant", "content": text})


def test_an_edited_reply_resumes_from_the_prompts_snapshot(hybrid):
    """A client that sends back another reply than the one generated shares the prompt only: the
    slot resumes from the snapshot at the prompt's end (a state cannot be cut back), prefills the
    rest, and equals a cold prefill; a conversation sharing less starts over."""
    model, reference = hybrid.model(), hybrid.model()
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    prompt = model.tokenizer.encode_chat(messages)
    list(model.chat(messages, SamplingConfig(max_new_tokens=10)))
    assert sorted(model.cache.snapshots[0]) == [len(prompt), model.cache.length(0)]
    edited = [*messages, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    ids = model.tokenizer.encode_chat(edited)
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == len(prompt)
    np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)
    other = model.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[2]}])
    logits = model.prepare(0, other)
    assert model.sessions[0].reused_tokens == 0
    np.testing.assert_allclose(logits, cold_logits(reference, other), atol=ATOL, rtol=0)


def test_a_state_cannot_be_cut_back(hybrid):
    model = hybrid.model()
    prefill(model.backend, model.cache, 0, [random_ids(20, seed=3)])
    assert model.cache.rewind_limit(0, 12) == 0  # no snapshot at or before 12
    with pytest.raises(KvedgeError, match="its states are known at"):
        model.cache.truncate(0, 12)
    model.cache.snapshot(0)
    prefill(model.backend, model.cache, 0, [random_ids(5, seed=4)])
    assert model.cache.rewind_limit(0, 22) == 20


def test_what_is_not_built_for_states_is_refused_by_name(hybrid, tmp_path):
    model = hybrid.model()
    assert model.speculation_refusal() is None  # a partial take runs its kept tokens again
    with pytest.raises(KvedgeError, match="keeps per-slot states, which a draft would have to rewind"):
        model.load_draft(hybrid.out)
    assert model.draft is None
    with pytest.raises(KvedgeError, match="history_policy 'window'.*per-slot states"):
        Model(hybrid.out, policy=HistoryPolicy(mode="window", n_sink=2, evict_chunk=16))
    from cuda_standin import CudaRuntime

    from kvedge.runtime.backends.cuda import DeviceMemory
    from kvedge.runtime.cache import KVCache

    cuda = CudaRuntime()
    with pytest.raises(KvedgeError, match="--kv-memory device does not hold per-slot states"):
        KVCache(Manifest.load(hybrid.out).geometry, 1, DeviceMemory(cuda))
    assert cuda.device == {}  # what it allocated before refusing went back


def test_the_cuda_binding_plan_binds_the_states_where_they_are(hybrid):
    """onnxruntime's CUDA provider binds each state layer's past state as it binds the pool: by
    pointer, on the device, at its mapped address (the states are page-locked and mapped as the
    pool is, 256-byte aligned at every slot); the new states go to step buffers on the device
    (decode, verify) or per-call host arrays (prefill). No GPU here: the plan is pure, the
    mapping is cuda_standin's, and opening the model gets as far as the missing provider."""
    from cuda_standin import CudaRuntime

    from kvedge.runtime.backends.cuda import MappedHost
    from kvedge.runtime.backends.memory import check_alignment
    from kvedge.runtime.backends.ort import CALL, POOL, STEP, binding_plan
    from kvedge.runtime.cache import KVCache

    manifest = Manifest.load(hybrid.out)
    names = manifest.names
    past = {spec.name for spec in manifest.interface.states(names.past_state)}
    present = {spec.name for spec in manifest.interface.states(names.present_state)}
    assert past and present
    if manifest.in_place:  # float32 GroupQueryAttention has no CUDA kernel: the variant's refusal
        with pytest.raises(KvedgeError, match="--device cuda cannot run this 'ort'-variant export"):
            binding_plan(manifest, "cuda", "decode", 1)
        return
    for phase, seq, out in (
        ("decode", 1, (STEP, "cuda")),
        ("verify", 4, (STEP, "cuda")),
        ("prefill", 9, (CALL, "cpu")),
    ):
        plan = {b.name: b for b in binding_plan(manifest, "cuda", phase, 2, seq=seq, rows=seq)}
        assert {(plan[name].buffer, plan[name].memory, plan[name].output) for name in past} == {
            (POOL, "cuda", False)
        }
        assert {(plan[name].buffer, plan[name].memory) for name in present} == {out}
    slots = 3
    cuda = CudaRuntime()
    host = MappedHost(cuda)
    cache = KVCache(manifest.geometry, slots)
    for first, count in ((0, slots), (1, 2), (2, 1)):
        views = cache.state_views(first, count)
        assert views.keys() == past
        for name, view in views.items():
            check_alignment(name, host.device_address(view), view, state=True)
            plan = {b.name: b for b in binding_plan(manifest, "cuda", "decode", count)}
            assert view.shape == plan[name].shape and view.flags.c_contiguous
    assert len(cuda.registered) == len(cache.states)  # each state array page-locked once, whole
    odd = np.zeros((2, 3, 7), np.float32)  # a state of 84 bytes a slot: the second slot misaligned
    with pytest.raises(KvedgeError, match="a slot's state is 84 bytes, not a multiple of 256"):
        check_alignment("past_conv.0", 0, odd, state=True)
    host.close()
    with pytest.raises(KvedgeError, match="CUDAExecutionProvider is not available here"):
        Model(hybrid.out, device="cuda")


FP16_UNIT = 2.0**-11


def test_a_float16_graph_matches_transformers_with_its_states_where_they_belong(hybrid, tmp_path):
    """--precision float16 (the portable graph in float16): LFM2's convolution states are float16,
    the inputs its float16 convolutions read anyway; Qwen3.5's Gated DeltaNet layers are float32
    islands between their projections, their states float32 (the recurrent one sums a whole
    conversation's updates). Every position's logits stay within the float16 bound of
    tests/test_precision_float16.py (6 x 2**-11 x the logits' range) of transformers' float32,
    with the same top token, and a snapshot resumes the slot to the bit."""
    if hybrid.variant != "portable":
        pytest.skip("--precision float16 is the portable graph only")
    export_model(hybrid.source, tmp_path / "half", ExportRecipe(max_len=MAX_LEN, precision="float16"))
    manifest = Manifest.load(tmp_path / "half")
    state_dtype = "float16" if manifest.model_type == "lfm2" else "float32"
    assert {s.dtype for s in manifest.geometry.states} == {state_dtype}
    ids = random_ids(40, seed=6)
    ref = hybrid.hf_logits(ids)[19:]
    got = decode_logits(tmp_path / "half", ids, 20)  # [21, vocab]
    np.testing.assert_allclose(got, ref, atol=6 * FP16_UNIT * float(ref.max() - ref.min()), rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    with Model(tmp_path / "half") as model:
        assert {a.dtype for a in model.cache.states.values()} == {np.dtype(state_dtype)}
        prefill(model.backend, model.cache, 0, [ids[:20]])
        model.cache.snapshot(0)
        once = [decode_one_token(model.backend, model.cache, 0, [t]) for t in ids[20:24]]
        model.cache.truncate(0, 20)
        again = [decode_one_token(model.backend, model.cache, 0, [t]) for t in ids[20:24]]
    np.testing.assert_array_equal(np.stack(again), np.stack(once))


def test_quantized_weights_stay_close(hybrid, tmp_path):
    """int8 weights: the state layers' projections are quantized as the attention's (the ort
    variant: in both forms of its graph); logits stay within int8's error of transformers'."""
    export_model(
        hybrid.source, tmp_path / "int8", ExportRecipe(max_len=64, weights="int8", variant=hybrid.variant)
    )
    ids = random_ids(24, seed=6)
    ref = hybrid.hf_logits(ids)[-1]
    model = Model(tmp_path / "int8")
    got = prefill(model.backend, model.cache, 0, [ids])[0]
    # measured 1.9-4.3% of the largest logit; the prompt's second half without its past: 32-103%
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_the_int8_cache_quantizes_the_attention_layers_and_keeps_states_float(hybrid, tmp_path):
    """--kv-dtype int8: the attention layers' KV per token in groups, the states float32; a prompt
    and decode steps stay within the INT8 cache's error of the float32 cache."""
    export_model(
        hybrid.source, tmp_path / "kv8", ExportRecipe(max_len=64, kv_dtype="int8", variant=hybrid.variant)
    )
    g = Manifest.load(tmp_path / "kv8").geometry
    assert g.dtype == "int8" and {s.dtype for s in g.states} == {"float32"}
    ids = random_ids(40, seed=7)
    ref = hybrid.hf_logits(ids)[19:]
    model = Model(tmp_path / "kv8")
    got = [prefill(model.backend, model.cache, 0, [ids[:20]])[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[20:]]
    assert np.abs(np.stack(got) - ref).max() < 0.1 * np.abs(ref).max()


def test_the_text_part_of_a_qwen3_5_vision_language_checkpoint_exports(tmp_path):
    """A `qwen3_5` checkpoint (vision-language, its decoder under model.language_model) exports its
    text decoder, which equals transformers' Qwen3_5ForConditionalGeneration on text."""
    from tiny import tiny_config, tiny_tokenizer
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64}
    config = Qwen3_5Config(text_config=tiny_config("qwen3_5").to_dict(), vision_config=vision)
    torch.manual_seed(5)
    full = Qwen3_5ForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path / "hf")
    tiny_tokenizer().save_pretrained(tmp_path / "hf")
    export_model(tmp_path / "hf", tmp_path / "out", ExportRecipe(max_len=64))
    assert Manifest.load(tmp_path / "out").model_type == "qwen3_5_text"
    ids = random_ids(20, seed=8)
    with torch.no_grad():
        ref = full(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    model = Model(tmp_path / "out")
    np.testing.assert_allclose(prefill(model.backend, model.cache, 0, [ids])[0], ref, atol=ATOL, rtol=0)


def test_eval_kv_reports_the_int8_cache_of_a_hybrid(hybrid, tmp_path):
    """`kvedge eval-kv` over a hybrid model: the INT8 cache quantizes its attention layers only,
    each prompt group starts from zero states (`KVCache.reset`), and the report is the INT8 row."""
    from click.testing import CliRunner

    from kvedge.cli import main

    export_model(
        hybrid.source, tmp_path / "i8", ExportRecipe(max_len=MAX_LEN, kv_dtype="int8", variant=hybrid.variant)
    )
    args = [
        "eval-kv",
        "--model",
        str(hybrid.out),
        "--int8-model",
        str(tmp_path / "i8"),
        "--limit",
        "6",
        "--tokens",
        "8",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("INT8 cache"))
    kl, top1 = float(row.split()[-5]), float(row.split()[-3].rstrip("%"))
    assert kl < 0.01 and top1 >= 90.0, row


# -- prefix stores: a stored prefix carries the states where a turn can resume ------------------

SYSTEM = "You are the kiosk assistant. Read the log below and answer questions about it. " * 3
GREEDY = SamplingConfig(max_new_tokens=8)
# sampled, so that a random model whose first greedy token is the end of turn still replies
FIRST_REPLY = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=0)


def first_turn(model: Model, slot: int = 0) -> tuple[list[dict[str, str]], int]:
    """Conversation A's first turn in `slot`; the messages of its next turn and the first turn's
    prompt tokens."""
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    prompt = len(model.tokenizer.encode_chat(a))
    reply = "".join(e.text for e in model.chat(a, FIRST_REPLY, slot=slot))
    assert model.cache.length(slot) > prompt, "the tests of the states at a reply's end need a reply"
    a.append({"role": "assistant", "content": reply})
    a.append({"role": "user", "content": QUESTIONS[1]})
    return a, prompt


def test_a_conversation_that_left_its_slot_resumes_from_the_run_time_store(hybrid):
    """Another conversation takes the only slot; A's tokens, KV and the states at its prompt's
    and reply's ends go to the run-time store, and A's next turn resumes from the latest of them
    it shares, equal to a cold prefill."""
    model, reference = Model(hybrid.out, slots=1, prefix_cache_bytes=2**21), hybrid.model()
    a, prompt = first_turn(model)
    held = model.cache.length(0)
    model.prepare(0, model.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[2]}]))
    (entry,) = model.prefixes.run_time.entries.values()
    assert entry.state_at == (prompt, held)
    ids = model.tokenizer.encode_chat(a)
    logits = model.prepare(0, ids)
    assert model.prefixes.run_time.hits == 1 and model.sessions[0].reused_tokens in (prompt, held)
    np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)


def warm_config(tmp_path):
    """A warm-prefix config of SYSTEM as a messages prefix, and its warm folder."""
    path = tmp_path / "warmup.yaml"
    path.write_text(
        f'prefixes:\n  - name: kiosk\n    messages:\n      - {{role: system, content: "{SYSTEM}"}}'
    )
    return load_warm_prefix_config(path), tmp_path / "warm"


def test_warm_prefixes_carry_their_end_state_and_are_reused_exactly(hybrid, tmp_path):
    config, folder = warm_config(tmp_path)
    assert Model(hybrid.out, warm_prefixes=config, warm_dir=folder).prefixes.warm_report.rebuilt == {
        "kiosk": "missing"
    }
    model, reference = Model(hybrid.out, warm_prefixes=config, warm_dir=folder), hybrid.model()
    assert model.prefixes.warm_report.loaded == ["kiosk"]
    (warm,) = model.prefixes.warm.prefixes
    assert warm.state_at == (len(warm.token_ids),)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    ids = model.tokenizer.encode_chat(messages)
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == len(warm.token_ids)
    np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)


def test_a_warm_prefix_serves_a_slot_that_cannot_cut_its_state_back_to_it(hybrid, tmp_path):
    """The slot holds three turns of a conversation sharing the warm prefix, its snapshots all past
    it: the slot cannot resume from what a new conversation shares with it, the warm prefix can."""
    config, folder = warm_config(tmp_path)
    model, reference = Model(hybrid.out, warm_prefixes=config, warm_dir=folder), hybrid.model()
    (warm,) = model.prefixes.warm.prefixes
    a = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:3]:
        a.append({"role": "user", "content": question})
        a.append({"role": "assistant", "content": "".join(e.text for e in model.chat(a, GREEDY))})
    assert min(model.cache.snapshots[0]) > len(warm.token_ids)
    ids = model.tokenizer.encode_chat([a[0], {"role": "user", "content": QUESTIONS[-1]}])
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == len(warm.token_ids)
    np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)


def test_the_disk_tier_resumes_a_conversation_after_a_restart(hybrid, tmp_path):
    """The files a turn's end writes carry the states at their ends; a new Model over the folder
    answers the next turn from them, with the logits and greedy reply of a cold start."""
    options = {"prefix_dir": tmp_path / "prefixes", "prefix_disk_min_tokens": 32}
    model = Model(hybrid.out, **options)
    a, prompt = first_turn(model)
    held = model.cache.length(0)
    model.close()
    headers = [read_warm_header(p) for p in (tmp_path / "prefixes").rglob(f"*{SUFFIX}")]
    assert sorted(h.state_at for h in headers) == [(prompt,), (held,)]
    again = Model(hybrid.out, **options)
    ids = again.tokenizer.encode_chat(a)
    logits = again.prepare(0, ids)
    assert again.prefixes.disk.hits == 1 and again.sessions[0].reused_tokens in (prompt, held)
    np.testing.assert_allclose(logits, cold_logits(hybrid.model(), ids), atol=ATOL, rtol=0)
    reply = "".join(e.text for e in again.chat(a, GREEDY))
    assert reply == "".join(e.text for e in hybrid.model().chat(a, GREEDY))


def test_after_a_restart_an_edited_reply_resumes_from_the_prompts_file(hybrid, tmp_path):
    """A restarted Model resumes a conversation from the last file of its chain, taking the
    states at that file's end only; a later turn that edits the reply goes back to the disk for
    the prompt's file, with a cold start's logits."""
    options = {"prefix_dir": tmp_path / "prefixes", "prefix_disk_min_tokens": 32}
    model = Model(hybrid.out, **options)
    _, prompt = first_turn(model)
    held = [int(t) for t in model.cache.token_ids(0)]
    model.close()
    again = Model(hybrid.out, **options)
    again.prepare(0, [*held, 5, 6, 7])
    assert again.sessions[0].reused_tokens == len(held) and prompt not in again.cache.snapshots[0]
    edited = [*held[:prompt], 8, 9, 10, 11]
    logits = again.prepare(0, edited)
    assert again.prefixes.disk.hits == 2 and again.sessions[0].reused_tokens == prompt
    np.testing.assert_allclose(logits, cold_logits(hybrid.model(), edited), atol=ATOL, rtol=0)


def test_a_service_killed_with_sigkill_answers_the_next_turn_from_its_files(hybrid, tmp_path):
    """A real server, kill -9 right after a reply: the restarted one resumes the conversation
    from the files (reused tokens past the first turn's prompt) with a cold start's greedy reply
    (the portable variant's exports: two servers each)."""
    if hybrid.variant != "portable":
        pytest.skip("the service over each config once: its portable export")
    config = {"slots": 2, "warmup_tokens": 2, "threads": 1, "prefix_dir": str(tmp_path / "prefixes")}
    config["prefix_disk_min_tokens"] = 32
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    with Server(hybrid.out, tmp_path, **config) as srv:
        for question in QUESTIONS[1:3]:
            a.append({"role": "assistant", "content": served_turn(srv, a)})
            a.append({"role": "user", "content": question})
        srv.process.kill()
        srv.process.wait(10)
        srv.stop()
    reference = hybrid.model()
    first = len(reference.tokenizer.encode_chat(a[:2]))  # the first turn's prompt
    with Server(hybrid.out, tmp_path, **config) as srv:
        before = srv.metrics()
        assert served_turn(srv, a) == run_alone(reference, a, max_new_tokens=12)[0]
        after = srv.metrics()
    reused = after["kvedge_prefix_cache_hit_tokens_total"] - before["kvedge_prefix_cache_hit_tokens_total"]
    assert reused > first, (first, reused)


def served_turn(srv: Server, messages: list[dict[str, str]]) -> str:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 12}
    response = srv.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]
