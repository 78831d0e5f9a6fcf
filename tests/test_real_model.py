"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers.

Tolerance 1e-3 absolute on logits of magnitude ~20: 30 fp32 layers with a different op order
than transformers (fused QKV, folded scale, split softmax inputs); measured ~1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvedge.export.export import ExportOptions, export_model
from kvedge.export.source import default_gguf, load_hf, resolve_source
from kvedge.runtime.generate import SamplingConfig, decode_one_token, prefill
from kvedge.runtime.model import Model

pytestmark = pytest.mark.real_model
ATOL = 1e-3
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "artifact"
    export_model(None, out, ExportOptions(max_len=2048))
    hf, tokenizer = load_hf(resolve_source(default_gguf()))
    return out, hf, tokenizer


def test_chat_ids_equal_transformers(smol):
    out, _, tokenizer = smol
    expected = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert Model(out).tokenizer.encode_chat(QUESTION) == list(expected)


def test_prefill_and_32_decode_steps_match_transformers(smol):
    out, hf, _ = smol
    model = Model(out)
    prompt = model.tokenizer.encode_chat(QUESTION)
    with torch.no_grad():
        continuation = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )[0]
        ref = hf(continuation[None], use_cache=False).logits[0].numpy()
    ids = continuation.tolist()
    got = [prefill(model.backend, model.cache, 0, [prompt])[0]]
    for t in ids[len(prompt) : len(prompt) + 31]:
        got.append(decode_one_token(model.backend, model.cache, 0, [t])[0])
    np.testing.assert_allclose(np.stack(got), ref[len(prompt) - 1 : len(prompt) + 31], atol=ATOL, rtol=0)


def test_64_greedy_tokens_identical_to_transformers(smol):
    out, hf, _ = smol
    model = Model(out)
    prompt = model.tokenizer.encode("The history of the Roman empire", add_special_tokens=True)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    logits = prefill(model.backend, model.cache, 0, [prompt])[0]
    got = []
    for _ in range(64):
        logits[list(model.manifest.eos_token_ids)] = -np.inf
        got.append(int(np.argmax(logits)))
        logits = decode_one_token(model.backend, model.cache, 0, [got[-1]])[0]
    assert got == ref


def test_known_good_answer_and_eos_stop(smol):
    out, _, _ = smol
    events = list(Model(out).stream("What is the capital of France?", SamplingConfig(max_new_tokens=64)))
    text = "".join(e.text for e in events)
    assert "Paris" in text
    assert events[-1].finish_reason == "stop" and "<|im" not in text
