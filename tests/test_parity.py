"""Exported graph + runtime against Hugging Face transformers on tiny random models.

Tolerance: 1e-4 absolute on logits of magnitude ~3. Both sides compute in fp32 with different
op orders (fused QKV, scale folded into Wq, softmax over split past/new scores); measured
differences are ~1e-6, so 1e-4 leaves margin while still catching any mask or position bug,
which moves logits by 1e-1 or more.
"""

from __future__ import annotations

import numpy as np
import torch
from conftest import random_ids

from kvedge.runtime.generate import decode_one_token, prefill

ATOL = 1e-4


def test_prefill_and_teacher_forced_decode_match_hf(tiny):
    model = tiny.model()
    ids = random_ids(52, seed=1)
    ref = tiny.hf_logits(ids)  # [52, vocab]
    got = [prefill(model.backend, model.cache, 0, [ids[:20]])[0]]
    for i in range(20, 52):  # 32 teacher-forced decode steps
        got.append(decode_one_token(model.backend, model.cache, 0, [ids[i]])[0])
    np.testing.assert_allclose(np.stack(got), ref[19:], atol=ATOL, rtol=0)
    assert model.cache.length(0) == 52


def test_greedy_64_tokens_identical_to_hf_generate(tiny):
    model = tiny.model()
    prompt = random_ids(16, seed=2)
    eos = tiny.hf.config.eos_token_id
    with torch.no_grad():
        ref = tiny.hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )[0, 16:].tolist()
    logits = prefill(model.backend, model.cache, 0, [prompt])[0]
    got = []
    for _ in range(64):
        logits[eos] = -np.inf  # as min_new_tokens does on the HF side
        got.append(int(np.argmax(logits)))
        logits = decode_one_token(model.backend, model.cache, 0, [got[-1]])[0]
    assert got == ref
