"""Sampling steps as pure functions."""

from __future__ import annotations

import numpy as np
import pytest

from kvedge.errors import KvedgeError
from kvedge.runtime.generate import SamplingConfig, sample

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9], np.float32)


def draws(config: SamplingConfig, n: int = 400, seen=()) -> set[int]:
    rng = np.random.default_rng(config.seed)
    return {sample(LOGITS, config, rng, seen) for _ in range(n)}


def test_greedy_is_argmax():
    assert draws(SamplingConfig(temperature=0.0), n=3) == {1}


def test_top_k_and_top_p_restrict_the_support():
    assert draws(SamplingConfig(temperature=1.0, top_k=2, seed=0)) == {1, 4}
    # softmax mass: 1 -> .37, 4 -> .33, 2 -> .14: top_p 0.6 keeps exactly {1, 4}
    assert draws(SamplingConfig(temperature=1.0, top_p=0.6, seed=0)) == {1, 4}
    assert len(draws(SamplingConfig(temperature=1.0, seed=0))) == 5


def test_seed_reproduces_and_differs():
    def run(seed):
        rng = np.random.default_rng(seed)
        return [sample(LOGITS, SamplingConfig(temperature=1.0, seed=seed), rng, ()) for _ in range(30)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_repetition_penalty_demotes_seen_tokens():
    assert draws(SamplingConfig(repetition_penalty=1.5), n=1, seen=[1]) == {4}
    assert draws(SamplingConfig(repetition_penalty=1.0), n=1, seen=[1]) == {1}


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("max_new_tokens", 0),
        ("repetition_penalty", 0.0),
    ],
)
def test_bad_values_are_named(field, value):
    with pytest.raises(KvedgeError, match=f"{field}={value!r} is not allowed; allowed: "):
        SamplingConfig(**{field: value})
