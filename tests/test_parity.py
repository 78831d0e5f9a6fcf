"""Exported graph + runtime against Hugging Face transformers on tiny random models.

Tolerance: 1e-4 absolute on logits of magnitude ~3. Both sides compute in fp32 with different
op orders (fused QKV, scale folded into Wq, softmax over split past/new scores); measured
differences are ~1e-6, so 1e-4 leaves margin while still catching any mask or position bug,
which moves logits by 1e-1 or more. The `tiny` fixture runs every test here for each graph
variant (tests/conftest.py); the real model's in-place variant is checked at the end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_ids
from tiny import make_tiny_model

from kvedge.contract import ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.export.graph.rope import rope_tables, rotary_frequencies, rotary_order
from kvedge.runtime.generate import decode_one_token, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.rope import rotate_keys

ATOL = 1e-4
REAL_ATOL = 1e-3  # real model, logits up to ~40: the tolerance of tests/test_real_model.py


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
    ref, got = tiny.greedy_pair(random_ids(16, seed=2))
    assert got == ref


def test_partial_rotary_as_full_rotary_over_a_permuted_head():
    """Phi-4-mini's RoPE (12 of 16 channels rotated, HF's own function) against kvedge's: full
    rotate_half over permuted channels with zero-frequency pass-through pairs gives the same scores,
    and re-rotating the cached keys (window eviction) equals writing them at the new positions."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    d, r, n = 16, 12, 10
    inv_freq = 1.0 / 10000 ** (np.arange(0, r, 2) / r)  # [r/2]
    q, k = (np.random.default_rng(seed).standard_normal((1, 1, n, d)) for seed in (0, 1))
    angles = np.outer(np.arange(n), inv_freq)
    emb = np.concatenate([angles, angles], -1)  # HF's [n, r] layout
    hq, hk = apply_rotary_pos_emb(*(torch.tensor(x) for x in (q, k, np.cos(emb)[None], np.sin(emb)[None])))
    cos, sin = rope_tables(inv_freq, 1.0, n + 3, d)  # [n+3, d/2]

    def rotate(x, first):  # rotate_half with the tables from position `first`, as the graphs do
        x1, x2 = np.split(x[..., rotary_order(d, r)], 2, -1)
        c, s = cos[first : first + n], sin[first : first + n]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    ours_q, ours_k = rotate(q, 0), rotate(k, 0)
    np.testing.assert_allclose(
        ours_q @ np.swapaxes(ours_k, -1, -2), (hq @ hk.transpose(-1, -2)).numpy(), atol=1e-5
    )
    moved = rotate(k, 3).astype(np.float32)
    rotate_keys(moved, -3, rotary_frequencies(inv_freq, d))
    np.testing.assert_allclose(moved, ours_k, atol=1e-5)


def test_longrope_past_its_short_factors_is_refused_by_name(tmp_path):
    """Past original_max_position_embeddings HF switches to the long factors; static tables cannot."""
    source = make_tiny_model(tmp_path / "hf", "phi3")  # original_max_position_embeddings 256
    with pytest.raises(KvedgeError, match=r"--max-len 512 passes .*original_max_position_embeddings \(256\)"):
        export_model(source, tmp_path / "out", ExportRecipe(max_len=512))
    assert not (tmp_path / "out").exists()


def test_unsupported_family_is_refused_by_name(tmp_path):
    source = make_tiny_model(tmp_path / "hf", "llama", hidden_act="gelu")
    with pytest.raises(KvedgeError, match="hidden_act 'gelu' is not supported"):
        export_model(source, tmp_path / "out", ExportRecipe(max_len=64))


@pytest.mark.real_model
def test_real_model_ort_variant_matches_transformers(default_hf, default_export):
    """The in-place GroupQueryAttention graph on SmolLM2-135M: same 1e-3 as the portable graph."""
    folder = default_export(ExportRecipe(variant="ort"))
    got, ref, greedy, want = _real_model_against_transformers(default_hf, folder)
    np.testing.assert_allclose(got, ref, atol=REAL_ATOL, rtol=0)
    assert greedy == want  # greedy tokens identical


@pytest.mark.real_model
def test_real_model_float16_weights_match_transformers(default_hf, default_export):
    """--weights float16 on SmolLM2-135M (257 MiB of graph instead of 514): logits within 4 x the
    float16 unit roundoff (2**-11) x the logits' range of transformers' float32 (measured 0.91 x:
    0.029 on a range of 65), and the same 32 greedy tokens."""
    got, ref, greedy, want = _real_model_against_transformers(
        default_hf, default_export(ExportRecipe(weights="float16"))
    )
    np.testing.assert_allclose(got, ref, atol=4 * 2.0**-11 * float(ref.max() - ref.min()), rtol=0)
    assert greedy == want


def _real_model_against_transformers(loaded, folder: Path):
    """SmolLM2's export in `folder` (from the session's `default_export`) teacher-forced through
    32 greedy tokens of transformers' (`loaded`: the session's `default_hf`): (kvedge logits [32,
    vocab], transformers' logits [32, vocab], kvedge's greedy tokens with eos masked as
    min_new_tokens masks it, transformers' tokens)."""
    hf, _ = loaded
    model = Model(folder)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        continuation = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )[0]
        ref = hf(continuation[None], use_cache=False).logits[0].numpy()[len(prompt) - 1 : -1]
    ids = continuation.tolist()
    got = [prefill(model.backend, model.cache, 0, [prompt])[0]]
    got += [decode_one_token(model.backend, model.cache, 0, [t])[0] for t in ids[len(prompt) : -1]]
    got = np.stack(got)
    masked = got.copy()
    masked[:, list(model.manifest.eos_token_ids)] = -np.inf
    return got, ref, list(masked.argmax(-1)), ids[len(prompt) :]
