"""Speculative decoding on a GPU backend, shared by test_tensorrt.py and test_ort_cuda.py: the
greedy reply with prompt lookup (`speculate="lookup"`) against plain decoding, token for token,
on one `Model`, and decode tokens/s of both.

The prompt repeats a random run of tokens three times, so lookup proposes from the first step;
tiny random models repeat themselves within a few tokens, so the model both takes and refuses
proposals. A run that never verified proves nothing and fails. Tokens/s are timed from the first
reply token on (prefill excluded), after a warm-up reply of each kind (bindings, arenas, both
TensorRT profiles), each kind in its own slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.model import Model

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 300, 12)] * 3  # 36 tokens


def reply(model: Model, slot: int, speculate: str, n: int) -> tuple[list[int], list, float]:
    """(the greedy reply's tokens, its verify calls (proposed, kept), decode tokens/s)."""
    turn = model.begin(slot, PROMPT, SamplingConfig(max_new_tokens=n, speculate=speculate))
    tokens, verifies = [], []
    start = first = None
    while not turn.done:
        result = model.step([turn])
        tokens += [event.token for event in result.emitted(turn)]
        verifies += result.verify_calls
        if start is None and tokens:
            start, first = time.perf_counter(), len(tokens)
    seconds = time.perf_counter() - start
    return tokens, verifies, (len(tokens) - first) / seconds


def check_speculation(
    model: Model, record: Callable[[str, object], None], name: str, n: int = 80, near_tie: float = 0.0
) -> None:
    """Greedy lookup reply == plain reply on `model` (2 slots or more); figures "<name>.*". With
    `near_tie` > 0 (float16 engines, where a verify and a decode step may round apart) the replies
    may part where the two tokens' logits, as plain decoding saw them there, are within
    `near_tie` of each other; anywhere else is a failure."""
    assert model.speculation_refusal() is None, model.speculation_refusal()
    reply(model, 0, "off", 8)
    reply(model, 1, "lookup", 8)
    plain, none, plain_rate = reply(model, 0, "off", n)
    fast, verifies, fast_rate = reply(model, 1, "lookup", n)
    proposed, kept = sum(p for p, _ in verifies), sum(k - 1 for _, k in verifies)
    record(f"{name}.plain_tokens_per_s", plain_rate)
    record(f"{name}.speculate_tokens_per_s", fast_rate)
    record(f"{name}.speculate_ratio", fast_rate / plain_rate)
    record(f"{name}.speculate_verifies_proposed_kept", [len(verifies), proposed, kept])
    first_difference = next((i for i, (a, b) in enumerate(zip(plain, fast, strict=False)) if a != b), None)
    record(f"{name}.speculate_first_difference", first_difference)
    assert not none and verifies, "lookup never verified: the comparison proves nothing"
    if fast == plain:
        assert list(model.cache.token_ids(1)) == list(model.cache.token_ids(0))
        return
    at = min(len(plain), len(fast)) if first_difference is None else first_difference
    gap = tie_gap(model, plain, fast, at)
    record(f"{name}.speculate_first_difference_logit_gap", gap)
    assert gap <= near_tie, (
        f"the replies part at token {at}, not at a near tie (logit gap {gap:.4g} > {near_tie:.4g})"
    )


def tie_gap(model: Model, plain: list, fast: list, at: int) -> float:
    """How far apart plain decoding's logits put the two replies' tokens at index `at` (an eos,
    None in the events, or a reply that ended there, counts as the first eos id)."""
    eos = model.manifest.eos_token_ids[0]

    def token(reply: list, i: int) -> int:
        return eos if i >= len(reply) or reply[i] is None else int(reply[i])

    logits = model.prepare(0, PROMPT + [int(t) for t in plain[:at]])  # [vocab], what plain chose from
    return abs(float(logits[token(plain, at)] - logits[token(fast, at)]))
