"""LFM2 (short-convolution layers around attention ones): the exported graph and the runtime's
per-slot states against Hugging Face transformers on tiny random models.

Tolerance: 1e-4 absolute on logits, as tests/test_parity.py (both sides float32; measured
differences about 2e-6). A state carried wrongly between calls (a chunk, a decode step, a turn, a
batch row) moves logits by 1e-1 or more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import Exported, random_ids
from test_serve import Server, run_alone
from tiny import LFM2_LAYERS, make_tiny_model

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
# layer patterns: conv first and last (tied head, GQA); attention first, conv last, one KV head,
# an untied head, a kernel of 4 and biases in the convolution's projections
CONFIGS = {
    "conv-first": {},
    "attention-first": {
        "layer_types": ["full_attention", "conv", "conv", "full_attention", "conv", "conv"],
        "num_hidden_layers": 6,
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "conv_L_cache": 4,
        "conv_bias": True,
    },
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def lfm2(request, tmp_path_factory) -> Exported:
    overrides = {"num_hidden_layers": len(LFM2_LAYERS), **CONFIGS[request.param]}
    root = tmp_path_factory.mktemp(f"lfm2-{request.param}")
    source = make_tiny_model(root / "hf", "lfm2", seed=4, **overrides)
    export_model(source, root / "out", ExportRecipe(max_len=MAX_LEN))
    return Exported(source, root / "out")


def test_the_manifest_names_each_layers_state(lfm2):
    manifest = Manifest.load(lfm2.out)
    g, config = manifest.geometry, lfm2.hf.config
    convs = [i for i, kind in enumerate(config.layer_types) if kind == "conv"]
    assert list(g.kv_layers) == [i for i, kind in enumerate(config.layer_types) if kind != "conv"]
    assert g.num_layers == len(g.kv_layers) and g.model_layers == config.num_hidden_layers
    (state,) = g.states
    assert (state.kind, list(state.layers)) == ("conv", convs)
    assert state.shape == (config.conv_L_cache - 1, config.hidden_size)
    assert g.state_bytes_per_slot() == len(convs) * (config.conv_L_cache - 1) * config.hidden_size * 4
    assert g.bytes_per_slot() == g.bytes_held(MAX_LEN) + g.state_bytes_per_slot()
    model = lfm2.model(slots=2)
    assert model.cache.states["conv"].shape == (len(convs), 2, *state.shape)
    assert model.cache.nbytes == g.pool_bytes(2)


@pytest.mark.parametrize("chunk", [256, 7])
def test_prefill_in_chunks_and_decode_match_hf(lfm2, chunk):
    """Every position's logits: a prompt prefilled whole or in chunks of 7 (the convolution state
    crosses each chunk's edge), then teacher-forced decode steps."""
    model = lfm2.model()
    ids = random_ids(60, seed=1)
    ref = lfm2.hf_logits(ids)  # [60, vocab]
    got = [prefill(model.backend, model.cache, 0, [ids[:30]], chunk=chunk)[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[30:]]
    np.testing.assert_allclose(np.stack(got), ref[29:], atol=ATOL, rtol=0)
    assert np.abs(ref).max() > 1.0  # logits far from zero: the tolerance means something


def test_greedy_64_tokens_identical_to_hf_generate(lfm2):
    model = lfm2.model()
    prompt = random_ids(16, seed=2)
    eos = lfm2.hf.config.eos_token_id
    with torch.no_grad():
        ref = lfm2.hf.generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0
        )[0, 16:].tolist()
    logits = prefill(model.backend, model.cache, 0, [prompt])[0]
    got = []
    for _ in range(64):
        logits[eos] = -np.inf  # as min_new_tokens does on the HF side
        got.append(int(np.argmax(logits)))
        logits = decode_one_token(model.backend, model.cache, 0, [got[-1]])[0]
    assert got == ref


def test_a_batch_equals_each_row_alone(lfm2):
    """Three prompts of different lengths prefilled in one call (rows right-padded: padding never
    enters a row's state), then decode steps in which one row idles: every row's logits equal its
    own run alone."""
    prompts = [random_ids(n, seed=10 + n) for n in (5, 17, 11)]
    steps = [random_ids(6, seed=20 + r) for r in range(3)]
    batch = lfm2.model(slots=3)
    alone = [lfm2.model() for _ in prompts]
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


QUESTIONS = [
    "Hello! How are you today?",
    "What is the capital of France?",
    "Tell me about the KV cache.",
    "Jetson Orin boards share memory.",
    "The quick brown fox jumps over the lazy dog.",
    "Thank you, I am fine.",
    "How are you?",
    "Paris?",
    "What does a cache store?",
    "Goodbye!",
]


def cold_logits(reference: Model, ids: list[int]) -> np.ndarray:
    """Next-token logits of `ids` prefilled from an empty slot."""
    reference.cache.reset(0)
    return prefill(reference.backend, reference.cache, 0, [ids])[0]


def test_ten_turns_equal_a_cold_prefill_each_turn(lfm2):
    """A 10-turn chat: each turn resumes the slot's state where the last reply ended (or, where
    the reply's text tokenizes otherwise than the tokens generated, as a random model's often
    does, where the last prompt ended) and prefills only the rest; its logits equal a cold
    prefill of the whole conversation."""
    model, reference = lfm2.model(), lfm2.model()
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


def test_an_edited_reply_resumes_from_the_prompts_snapshot(lfm2):
    """A client that sends back another reply than the one generated shares the prompt only: the
    slot resumes from the snapshot at the prompt's end (a state cannot be cut back), prefills the
    rest, and equals a cold prefill; a conversation sharing less starts over."""
    model, reference = lfm2.model(), lfm2.model()
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


def test_a_state_cannot_be_cut_back(lfm2):
    model = lfm2.model()
    prefill(model.backend, model.cache, 0, [random_ids(20, seed=3)])
    assert model.cache.rewind_limit(0, 12) == 0  # no snapshot at or before 12
    with pytest.raises(KvedgeError, match="its states are known at"):
        model.cache.truncate(0, 12)
    model.cache.snapshot(0)
    prefill(model.backend, model.cache, 0, [random_ids(5, seed=4)])
    assert model.cache.rewind_limit(0, 22) == 20


def test_what_is_not_built_for_states_is_refused_by_name(lfm2, tmp_path):
    with pytest.raises(KvedgeError, match="--variant 'ort' is not built for models with convolution"):
        export_model(lfm2.source, tmp_path / "ort", ExportRecipe(max_len=64, variant="ort"))
    with pytest.raises(KvedgeError, match="--precision float16 is not built"):
        export_model(lfm2.source, tmp_path / "half", ExportRecipe(max_len=64, precision="float16"))
    model = lfm2.model()
    assert "per-slot states" in model.speculation_refusal()
    with pytest.raises(KvedgeError, match="history_policy 'window'.*per-slot states"):
        Model(lfm2.out, policy=HistoryPolicy(mode="window", n_sink=2, evict_chunk=16))
    with pytest.raises(KvedgeError, match="--device tensorrt does not bind"):
        from kvedge.runtime.backends.trt import TrtBackend

        TrtBackend(lfm2.out, Manifest.load(lfm2.out))


def test_quantized_weights_stay_close(lfm2, tmp_path):
    """int8 weights on the portable graph: the convolution's projections are quantized as the
    attention's; logits stay within int8's error of the float32 export."""
    export_model(lfm2.source, tmp_path / "int8", ExportRecipe(max_len=64, weights="int8"))
    ids = random_ids(24, seed=6)
    ref = lfm2.hf_logits(ids)[-1]
    model = Model(tmp_path / "int8")
    got = prefill(model.backend, model.cache, 0, [ids])[0]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert int(np.argmax(got)) == int(np.argmax(ref))


# -- prefix stores: a stored prefix carries the states where a turn can resume ------------------

SYSTEM = "You are the kiosk assistant. Read the log below and answer questions about it. " * 3
GREEDY = SamplingConfig(max_new_tokens=8)


def first_turn(model: Model, slot: int = 0) -> tuple[list[dict[str, str]], int]:
    """Conversation A's first turn in `slot`; the messages of its next turn and the first turn's
    prompt tokens."""
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    prompt = len(model.tokenizer.encode_chat(a))
    a.append({"role": "assistant", "content": "".join(e.text for e in model.chat(a, GREEDY, slot=slot))})
    a.append({"role": "user", "content": QUESTIONS[1]})
    return a, prompt


def test_a_conversation_that_left_its_slot_resumes_from_the_run_time_store(lfm2):
    """Another conversation takes the only slot; A's tokens, KV and the states at its prompt's
    and reply's ends go to the run-time store, and A's next turn resumes from the latest of them
    it shares, equal to a cold prefill."""
    model, reference = Model(lfm2.out, slots=1, prefix_cache_bytes=2**21), lfm2.model()
    a, prompt = first_turn(model)
    held = model.cache.length(0)
    model.prepare(0, model.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[2]}]))
    (entry,) = model.run_time_store.entries.values()
    assert entry.state_at == (prompt, held)
    ids = model.tokenizer.encode_chat(a)
    logits = model.prepare(0, ids)
    assert model.run_time_store.hits == 1 and model.sessions[0].reused_tokens in (prompt, held)
    np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)


def warm_config(tmp_path):
    """A warm-prefix config of SYSTEM as a messages prefix, and its warm folder."""
    path = tmp_path / "warmup.yaml"
    path.write_text(
        f'prefixes:\n  - name: kiosk\n    messages:\n      - {{role: system, content: "{SYSTEM}"}}'
    )
    return load_warm_prefix_config(path), tmp_path / "warm"


def test_warm_prefixes_carry_their_end_state_and_are_reused_exactly(lfm2, tmp_path):
    config, folder = warm_config(tmp_path)
    assert Model(lfm2.out, warm_prefixes=config, warm_dir=folder).warm_prefix_report.rebuilt == {
        "kiosk": "missing"
    }
    model, reference = Model(lfm2.out, warm_prefixes=config, warm_dir=folder), lfm2.model()
    assert model.warm_prefix_report.loaded == ["kiosk"]
    (warm,) = model.warm_store.prefixes
    assert warm.state_at == (len(warm.token_ids),)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    ids = model.tokenizer.encode_chat(messages)
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == len(warm.token_ids)
    np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)


def test_a_warm_prefix_serves_a_slot_that_cannot_cut_its_state_back_to_it(lfm2, tmp_path):
    """The slot holds three turns of a conversation sharing the warm prefix, its snapshots all past
    it: the slot cannot resume from what a new conversation shares with it, the warm prefix can."""
    config, folder = warm_config(tmp_path)
    model, reference = Model(lfm2.out, warm_prefixes=config, warm_dir=folder), lfm2.model()
    (warm,) = model.warm_store.prefixes
    a = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:3]:
        a.append({"role": "user", "content": question})
        a.append({"role": "assistant", "content": "".join(e.text for e in model.chat(a, GREEDY))})
    assert min(model.cache.snapshots[0]) > len(warm.token_ids)
    ids = model.tokenizer.encode_chat([a[0], {"role": "user", "content": QUESTIONS[-1]}])
    logits = model.prepare(0, ids)
    assert model.sessions[0].reused_tokens == len(warm.token_ids)
    np.testing.assert_allclose(logits, cold_logits(reference, ids), atol=ATOL, rtol=0)


def test_the_disk_tier_resumes_a_conversation_after_a_restart(lfm2, tmp_path):
    """The files a turn's end writes carry the states at their ends; a new Model over the folder
    answers the next turn from them, with the logits and greedy reply of a cold start."""
    options = {"prefix_dir": tmp_path / "prefixes", "prefix_disk_min_tokens": 32}
    model = Model(lfm2.out, **options)
    a, prompt = first_turn(model)
    held = model.cache.length(0)
    model.close()
    headers = [read_warm_header(p) for p in (tmp_path / "prefixes").rglob(f"*{SUFFIX}")]
    assert sorted(h.state_at for h in headers) == [(prompt,), (held,)]
    again = Model(lfm2.out, **options)
    ids = again.tokenizer.encode_chat(a)
    logits = again.prepare(0, ids)
    assert again.prefix_disk.hits == 1 and again.sessions[0].reused_tokens in (prompt, held)
    np.testing.assert_allclose(logits, cold_logits(lfm2.model(), ids), atol=ATOL, rtol=0)
    reply = "".join(e.text for e in again.chat(a, GREEDY))
    assert reply == "".join(e.text for e in lfm2.model().chat(a, GREEDY))


def test_a_service_killed_with_sigkill_answers_the_next_turn_from_its_files(lfm2, tmp_path):
    """A real server, kill -9 right after a reply: the restarted one resumes the conversation
    from the files (reused tokens past the first turn's prompt) with a cold start's greedy reply."""
    config = {"slots": 2, "warmup_tokens": 2, "threads": 1, "prefix_dir": str(tmp_path / "prefixes")}
    config["prefix_disk_min_tokens"] = 32
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    with Server(lfm2.out, tmp_path, **config) as srv:
        for question in QUESTIONS[1:3]:
            a.append({"role": "assistant", "content": served_turn(srv, a)})
            a.append({"role": "user", "content": question})
        srv.process.kill()
        srv.process.wait(10)
        srv.stop()
    reference = lfm2.model()
    first = len(reference.tokenizer.encode_chat(a[:2]))  # the first turn's prompt
    with Server(lfm2.out, tmp_path, **config) as srv:
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
