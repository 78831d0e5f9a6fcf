"""Speculative decoding (kvedge.runtime.speculate): prompt lookup, verification in one call,
acceptance, roll back.

Exactness: greedy replies with `speculate="lookup"` are compared token for token with the same
model decoding one token per step, on every cache kind (float32, float16, INT8 codes + scales,
Gemma 3's ring) and both graph variants, alone and as rows of a batch; the slot then holds the
same tokens, and the same K/V to the tolerance the two paths' float sums allow. Tiny random
models repeat themselves within a few tokens, so lookup proposes often and the model both takes
and refuses proposals in every run (asserted: a test that never verified proves nothing).

Sampled replies: the rejection rule keeps the distribution (`test_sampled_distribution_*`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import MAX_LEN, random_ids

from kvedge.contract import MANIFEST_FILE, ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.generate import (
    SamplingConfig,
    _distribution,
    _keep,
    decode_one_token,
    prefill,
    verify,
    verify_rows,
)
from kvedge.runtime.model import Model
from kvedge.runtime.speculate import (
    LOSS_BUDGET,
    MAX_DRAFT,
    MAX_PAUSE,
    MIN_NGRAM,
    MISSES,
    Adaptive,
    Costs,
    Lookup,
    accept,
    legacy_draft,
    lookup,
)

# (name, ExportRecipe fields, family): every cache kind on both variants where it exists
CASES = [
    ("portable-f32", {"variant": "portable"}, "llama"),
    ("ort-f32", {"variant": "ort"}, "llama"),
    ("portable-int8", {"variant": "portable", "kv_dtype": "int8"}, "llama"),
    ("ort-int8", {"variant": "ort", "kv_dtype": "int8"}, "llama"),
    # quantized ort weights: a verify runs the decode form (kvedge.QuantMatMul) and attends its
    # tokens one at a time, each row to the bit a decode step's (`test_verify_rows_are_decode_steps`)
    ("ort-int4-int8", {"variant": "ort", "kv_dtype": "int8", "weights": "int4"}, "llama"),
    ("ort-int8w-int8", {"variant": "ort", "kv_dtype": "int8", "weights": "int8"}, "llama"),
    # quantized weights dequantized to float: verify and decode run the same arithmetic
    # (and a graph onnxruntime refused to load before `OrtBackend` disabled its S8->U8 rewrite)
    ("portable-int4-int8", {"variant": "portable", "kv_dtype": "int8", "weights": "int4"}, "llama"),
    ("ort-f16", {"variant": "ort", "kv_dtype": "float16"}, "llama"),
    ("portable-half", {"variant": "portable", "precision": "float16"}, "llama"),
    ("gemma3-ring", {"variant": "portable"}, "gemma3"),
    # per-slot states: a partial take runs its kept tokens again (`generate._roll_back`)
    ("lfm2-portable", {"variant": "portable"}, "lfm2"),
]
# the other hybrid exports: tiny random Qwen3.5 models seldom repeat themselves, so prompt lookup
# proposes next to nothing; `test_a_partial_take_carries_the_states_to_the_accepted_token`
# proposes for them
STATE_CASES = [
    ("qwen3_5-ort", {"variant": "ort"}, "qwen3_5"),
    ("qwen3_5-portable", {"variant": "portable"}, "qwen3_5"),
    ("lfm2-ort", {"variant": "ort"}, "lfm2"),
]
# a prompt that repeats, so lookup has something to propose from the first step
PROMPT = random_ids(12, seed=3) * 3
PROMPTS = [PROMPT, random_ids(30, seed=8), random_ids(8, seed=9) * 3]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("speculate")
    sources: dict[str, Path] = {}
    built: dict[str, object] = {}

    def source(family: str) -> Path:
        """The tiny HF folder of a family, made at its first use."""
        if family not in sources:
            sources[family] = make_tiny_model(root / f"hf-{family}", family)
        return sources[family]

    def get(name: str):
        if name not in built:
            fields, family = next((f, fam) for n, f, fam in CASES + STATE_CASES if n == name)
            out = root / name
            export_model(source(family), out, ExportRecipe(max_len=MAX_LEN, **fields))
            built[name] = out
        return built[name]

    get.source = source
    return get


def run_turn(model: Model, slot: int, ids: list[int], config: SamplingConfig):
    """(tokens, events, verify calls) of one turn run to its end in `slot`."""
    turn = model.begin(slot, ids, config)
    events, verifies = [], []
    while not turn.done:
        result = model.step([turn])
        events += result.emitted(turn)
        verifies += result.verify_calls
    return [e.token for e in events], events, verifies


def bit_exact(model: Model) -> bool:
    """Whether a verify row is a decode step's to the bit: ort graphs over the INT8 cache, whose
    attention takes a verify's tokens one at a time as decode steps, with float weights or the
    decode form's quantized matmuls (kvedge.QuantMatMul, each row in the arithmetic of one)."""
    m = model.manifest
    return m.variant == "ort" and m.geometry.quantized and m.weight_decode_matmuls in ("", "kvedge")


def logprob_tolerance(model: Model) -> float:
    """How far a verify row's log probabilities may be from a decode step's: 0 where it is
    `bit_exact`; elsewhere float sums in another order (measured <= 1e-4 on float caches);
    quantized weights dequantized to float (portable) round their products apart from the
    float path's (bound kept from the two-form exports, measured up to 0.052 on the tiny int4
    model, whose logits span ~40)."""
    if bit_exact(model):
        return 0.0
    return 0.1 if model.manifest.weights_dtype in ("int8", "int4") else 2e-3


def greedy(n: int, speculate: str, logprobs: int | None = None) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=n, speculate=speculate, logprobs=logprobs)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
@pytest.mark.usefixtures("no_loss_pauses")
def test_greedy_identical_every_cache_kind(exports, name):
    proposed = kept = 0
    with Model(exports(name), slots=2) as model:
        for ids in PROMPTS:
            plain, plain_events, none = run_turn(model, 0, ids, greedy(40, "off", logprobs=2))
            fast, fast_events, verifies = run_turn(model, 1, ids, greedy(40, "lookup", logprobs=2))
            assert not none
            assert fast == plain
            proposed += sum(p for p, _ in verifies)
            kept += sum(k - 1 for _, k in verifies)
            tolerance = logprob_tolerance(model)
            for a, b in zip(plain_events, fast_events, strict=True):  # logprobs from the verify rows
                assert a.logprob == pytest.approx(b.logprob, abs=tolerance)
                if a.token is None or a.token in model.manifest.eos_token_ids:  # the end: no logprobs
                    assert not a.top_logprobs and not b.top_logprobs
                    continue
                assert a.top_logprobs[0][0] == b.top_logprobs[0][0]  # the runner-up may be a near tie
                fast_top = dict(b.top_logprobs)
                for token, logprob in a.top_logprobs:
                    assert token not in fast_top or fast_top[token] == pytest.approx(logprob, abs=tolerance)
            # the slots hold the same tokens, and K/V to what two paths' float sums allow
            n = model.cache.length(0)
            assert model.cache.length(1) == n
            assert list(model.cache.token_ids(1)) == list(model.cache.token_ids(0))
            a, b = model.cache.view(0, 0, n), model.cache.view(1, 0, n)
            if bit_exact(model):
                np.testing.assert_array_equal(b.kv, a.kv)
                np.testing.assert_array_equal(b.scales, a.scales)
                continue
            for kind, states in model.cache.states.items():  # a hybrid's: carried to the same position
                np.testing.assert_allclose(states[:, 1], states[:, 0], atol=1e-4, err_msg=kind)
            if model.manifest.weights_dtype in ("int8", "int4"):
                continue  # K/V differ by the matmuls' rounding (`logprob_tolerance`)
            # float32: sums in another order; float16: its rounding; int8: the same codes
            atol = {"float32": 2e-3, "float16": 3e-2, "int8": 3e-2}[model.manifest.geometry.dtype]
            np.testing.assert_allclose(b.kv.astype(np.float32), a.kv.astype(np.float32), atol=atol)
    assert 0 < kept < proposed, (name, kept, proposed)  # took some, refused some
    assert model.speculation_costs.share_s() > 0  # measured on the lookup turns' decode calls


@pytest.mark.parametrize("name", [c[0] for c in STATE_CASES])
@pytest.mark.usefixtures("no_loss_pauses")
def test_a_partial_take_carries_the_states_to_the_accepted_token(exports, name, monkeypatch):
    """A model with per-slot states under a proposer that knows the plain greedy reply and gets
    every third proposal run's last token wrong: the partial takes run their kept tokens again
    (`generate._roll_back`), and the reply, the slot's tokens, K/V and states equal plain
    decoding's (float sums in another order: 1e-4)."""
    with Model(exports(name), slots=2) as model:
        ids = random_ids(20, seed=8)
        plain, _, _ = run_turn(model, 0, ids, greedy(40, "off"))
        calls = []

        def proposals(self, history, k):
            done = len(history) - len(ids)  # the reply's tokens so far, the pending one last
            draft = list(plain[done : done + k])
            if draft and len(calls) % 3 == 1:
                draft[-1] = (draft[-1] + 1) % model.manifest.vocab_size
            calls.append(len(draft))
            return draft

        monkeypatch.setattr(Lookup, "proposals", proposals)
        fast, _, verifies = run_turn(model, 1, ids, greedy(40, "lookup"))
    assert fast == plain
    assert any(keep - 1 < proposed for proposed, keep in verifies)  # partial takes: rolled back
    assert any(keep - 1 == proposed for proposed, keep in verifies)  # whole takes: the verify's states
    n = model.cache.length(0)
    assert model.cache.length(1) == n and list(model.cache.token_ids(1)) == list(model.cache.token_ids(0))
    a, b = model.cache.view(0, 0, n), model.cache.view(1, 0, n)
    np.testing.assert_allclose(b.kv, a.kv, atol=1e-4)
    for kind, states in model.cache.states.items():
        np.testing.assert_allclose(states[:, 1], states[:, 0], atol=1e-4, err_msg=kind)


# ort graphs write K/V in place and verify a padded group row by row; portable ones in one call
@pytest.mark.parametrize("name", ["ort-int8", "portable-f32", "gemma3-ring", "lfm2-portable"])
@pytest.mark.usefixtures("no_loss_pauses")
def test_batched_rows_equal_solo(exports, name, monkeypatch):
    # draft lengths by takes alone, not by measured seconds (`Adaptive.least_k`): which slots
    # propose in the same step then does not hang on the machine's load (under a CI run's load
    # lfm2-portable once never verified two rows together)
    monkeypatch.setattr(Adaptive, "least_k", lambda self, batch=1: 1)
    prompts = [PROMPT, random_ids(10, seed=5) * 2, random_ids(30, seed=7)]
    with Model(exports(name), slots=3) as model:
        solo = [run_turn(model, 0, ids, greedy(30, "off"))[0] for ids in prompts]
        turns = [model.begin(slot, ids, greedy(30, "lookup")) for slot, ids in enumerate(prompts)]
        got: dict[int, list[int]] = {t.slot: [] for t in turns}
        decoded_together = False
        while not all(t.done for t in turns):
            result = model.step(turns)
            decoded_together |= bool(result.verify_calls and result.decode_calls)
            for turn in turns:
                got[turn.slot] += [e.token for e in result.emitted(turn)]
    assert [got[s] for s in range(3)] == solo
    assert decoded_together  # a verify and a batched decode in the same step
    assert max(model.speculation_costs.calls) > 1  # calls of several rows, measured by their rows
    # neighbours verified together, but on in-place graphs, which would run them row by row
    together = max(rows for rows, _ in model.speculation_costs.verifies)
    assert together == 1 if model.manifest.in_place else together > 1


@pytest.mark.parametrize("name", ["portable-f32", "ort-int8", "portable-int8", "gemma3-ring"])
def test_neighbours_verified_in_one_call_equal_each_verified_alone(exports, name):
    """`verify_rows` of three slots with 2, 5 and 1 tokens (right-padded to 5) against `verify`
    of each slot alone: the same logits at each row's real positions, and the same K/V kept.
    Tolerance: the padded call's float sums may run in another order (measured < 1e-5 on float32;
    ort graphs run the padded rows one at a time, to the bit)."""
    prompts = [random_ids(9, seed=1), random_ids(14, seed=2), random_ids(6, seed=4)]
    tokens = [random_ids(2, seed=11), random_ids(5, seed=12), random_ids(1, seed=13)]
    keeps = [2, 3, 1]
    with Model(exports(name), slots=6) as model:
        cache = model.cache
        prefill(model.backend, cache, 0, prompts)
        prefill(model.backend, cache, 3, prompts)
        together, input_ids = verify_rows(model.backend, cache, 0, tokens)
        assert input_ids.shape == (3, 5)
        _keep(cache, together, [0, 1, 2], input_ids, keeps)
        for r, row in enumerate(tokens):
            alone, ids = verify(model.backend, cache, 3 + r, row)
            np.testing.assert_allclose(together.logits[r, : len(row)], alone.logits[0], atol=1e-4)
            _keep(cache, alone, [3 + r], ids, [keeps[r]])
            n = cache.length(r)
            assert n == len(prompts[r]) + keeps[r] == cache.length(3 + r)
            assert list(cache.token_ids(r)) == list(cache.token_ids(3 + r))
            a, b = cache.view(r, 0, n), cache.view(3 + r, 0, n)
            np.testing.assert_allclose(a.kv.astype(np.float32), b.kv.astype(np.float32), atol=1e-4)
            if model.manifest.geometry.quantized:
                np.testing.assert_array_equal(a.scales, b.scales)


def test_the_bench_steps_batches_side_by_side_and_checks_every_reply(tmp_path, exports):
    """bench/speculate.py at batch 2: each round a plain and a lookup batch of 2 replies step in
    turn in 4 slots; every reply of both equals the first plain one, and each round gives a
    ratio."""
    from kvedge.bench.speculate import WORKLOADS, measure_speculation

    out = tmp_path / "bench"  # room for the workloads' prompts (~600 tokens here)
    export_model(exports.source("llama"), out, ExportRecipe(max_len=1024, variant="ort", kv_dtype="int8"))
    lines: list[str] = []
    figures = measure_speculation(out, rounds=2, max_new_tokens=12, echo=lines.append, batch=2)
    assert set(figures) == set(WORKLOADS) and len(lines) == len(WORKLOADS)
    for workload in figures.values():
        assert workload["greedy_equal"] and 1 < workload["reply_tokens"] <= 12
        assert len(workload["round_ratios"]) == 2 and workload["lookup_tokens_per_s"] > 0


@pytest.mark.usefixtures("no_loss_pauses")
def test_stop_inside_accepted_run_keeps_slot_as_plain(exports):
    """A reply that ends (max_new_tokens) in the middle of what the model took leaves the slot
    holding what it would hold without speculation: no token past the reply."""
    with Model(exports("portable-f32"), slots=2) as model:
        for n in (3, 7, 11):
            plain = run_turn(model, 0, PROMPT, greedy(n, "off"))[0]
            fast = run_turn(model, 1, PROMPT, greedy(n, "lookup"))[0]
            assert fast == plain and len(fast) == n
            assert list(model.cache.token_ids(1)) == list(model.cache.token_ids(0))


def test_old_artifact_decodes_without_speculation(tmp_path, exports, caplog):
    from tiny import make_tiny_model

    out = tmp_path / "last"
    export_model(make_tiny_model(tmp_path / "hf"), out, ExportRecipe(max_len=MAX_LEN, logits="last"))
    with Model(out) as model:
        assert "--logits 'last'" in model.speculation_refusal()
        tokens, _, verifies = run_turn(model, 0, PROMPT, greedy(20, "lookup"))
    assert len(tokens) == 20 and not verifies
    assert "speculative decoding needs logits at every proposed position" in caplog.text


def decode_rows(model: Model, slot: int, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """(tokens, logits [n, vocab]): `prompt` prefilled in `slot`, then n greedy decode steps."""
    tokens = [int(np.argmax(prefill(model.backend, model.cache, slot, [prompt])[0]))]
    rows = []
    for _ in range(n):
        rows.append(decode_one_token(model.backend, model.cache, slot, [tokens[-1]])[0])
        tokens.append(int(np.argmax(rows[-1])))
    return tokens[:n], np.stack(rows)


@pytest.mark.parametrize(
    ("weights", "max_len", "past", "n"),
    [
        ("int4", MAX_LEN, 20, 9),  # 18 query rows per KV head: the prefill tiles' path in a longer call
        ("int4", MAX_LEN, 40, 4),
        ("int8", MAX_LEN, 30, 6),
        ("float32", MAX_LEN, 30, 9),
        # a long past: decode steps split the cache into blocks by their own length
        ("int4", 1024, 600, 9),
    ],
)
def test_verify_rows_are_decode_steps(tmp_path, weights, max_len, past, n):
    """A verify's rows (one call of n tokens, logits at each) against n decode steps, on ort
    graphs over the INT8 cache: equal to the bit, logits and the cache alike. Measured before
    verifies ran the decode form: int4 weights 0.08-0.13 apart in logits spanning ~4 (the
    prefill form's MatMulNBits over its own float32-scaled grids), and float weights ~1e-6
    at a past of 600 (the prefill tiles' online softmax, and cache blocks cut by the call's
    length)."""
    from tiny import make_tiny_model

    out = tmp_path / "ort"
    options = ExportRecipe(max_len=max_len, variant="ort", kv_dtype="int8", weights=weights)
    export_model(make_tiny_model(tmp_path / "hf"), out, options)
    with Model(out, slots=2) as model:
        assert model.speculation_refusal() is None
        prompt = random_ids(past, seed=past)
        tokens, want = decode_rows(model, 0, prompt, n)
        prefill(model.backend, model.cache, 1, [prompt])
        checked, _ = verify(model.backend, model.cache, 1, tokens)
        np.testing.assert_array_equal(checked.logits[0], want)
        model.cache.commit([1], np.asarray([tokens], np.int64), [n])
        length = model.cache.length(0)
        a, b = model.cache.view(0, 0, length), model.cache.view(1, 0, length)
        np.testing.assert_array_equal(b.kv, a.kv)
        np.testing.assert_array_equal(b.scales, a.scales)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            {"kv_dtype": "int8", "decode_matmuls": "onnxruntime"},
            "MatMulNBits, which rounds one row and several",
        ),
        ({"kv_dtype": "float32"}, "GroupQueryAttention over its float32 cache"),
        ({"kv_dtype": "int8", "recorded": None}, "exported before its decode form took verify steps"),
    ],
)
def test_quantized_ort_weights_without_exact_verify_decode_without_speculation(tmp_path, options, said):
    """Quantized `ort` graphs whose verify is not a decode step to the bit decode without
    speculation: onnxruntime's MatMulNBits and GroupQueryAttention add up one row and several
    apart (measured ~1e-6 in logits, and int8 activations rounded apart amplify it: the greedy
    replies of SmolLM2-135M parted at token 12 of 96), and an export from before its decode
    form took verify steps (its manifest without `decode_form_tokens`) ran them on the
    prefill form."""
    from tiny import make_tiny_model

    out = tmp_path / "quantized"
    fields = {k: v for k, v in options.items() if k != "recorded"}
    export_model(
        make_tiny_model(tmp_path / "hf"),
        out,
        ExportRecipe(max_len=MAX_LEN, variant="ort", weights="int4", **fields),
    )
    if "recorded" in options:
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        del manifest["decode_form_tokens"]
        (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    with Model(out) as model:
        assert "--weights int4 export" in model.speculation_refusal()
        assert said in model.speculation_refusal()
        assert not run_turn(model, 0, PROMPT, greedy(20, "lookup"))[2]


def test_bad_mode_names_allowed():
    """A turn's speculate is one of three words; the draft's folder is the model's (RunOptions.draft),
    and the retired "draft:DIR" is read only at the edges (`legacy_draft`)."""
    allowed = r"allowed: \['off', 'lookup', 'draft'\]"
    for bad in ("draft:", "draft: ", "draft:some/dir", "Lookup", "on"):
        with pytest.raises(KvedgeError, match=rf"speculate={bad!r} is not allowed; {allowed}"):
            SamplingConfig(speculate=bad)
    assert SamplingConfig(speculate="draft").speculate == "draft"
    assert legacy_draft("draft: some/dir ") == Path("some/dir")
    assert legacy_draft("draft") is None and legacy_draft("lookup") is None
    with pytest.raises(KvedgeError, match=rf"speculate='draft: ' names no draft folder; {allowed}"):
        legacy_draft("draft: ")


def test_lookup_takes_longest_latest_match():
    h = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup(h, 3, min_ngram=2) == [7, 8, 5]  # "2 3" last occurred before 7; "1 2 3" does not end h
    assert lookup(h, 3) == []  # 3 tokens at least by default: "5 2 3" never occurred
    assert lookup(np.array([4, 1, 2, 5, 6, 1, 2, 7, 1, 2]), 2, min_ngram=2) == [7, 1]  # the latest "1 2"
    assert lookup(np.array([1, 2, 3, 4]), 4) == []
    assert lookup(np.array([5, 6, 5, 6]), 5, min_ngram=2) == [5, 6, 5, 6, 5]  # past the end: the loop goes on
    assert lookup(np.array([7, 1, 2, 3, 1, 2, 3]), 4) == [1, 2, 3, 1]
    h = np.array([1, 2, 3, 4, 0, 2, 3, 4])
    assert lookup(h, 1, min_ngram=2, max_ngram=4) == [0]  # "2 3 4" (3 tokens) beats "3 4"


def test_lookup_adapts_and_pauses():
    spec = Lookup()
    assert spec.propose([1, 2, 3, 1, 2, 3, 1, 2], 8) == [3]  # a reply's first probe: one token
    spec.update(1, 1)
    assert spec.k == 3
    spec.update(3, 3)
    assert spec.k == 5
    spec.update(5, 2)
    assert spec.k == 3
    for _ in range(MISSES):
        spec.update(3, 0)
    assert spec.pause == 1 and spec.propose([1, 2, 1, 2], 8) == [] and spec.pause == 0
    assert spec.k == 1 and spec.propose([3, 1, 2, 3, 1, 2, 3], 8) == [1]  # k fell to 1 with the misses
    for _ in range(20 * MISSES):
        spec.update(1, 0)
    assert spec.backoff == MAX_PAUSE  # doubling, capped
    spec.update(1, 1)
    assert spec.backoff == 1 and spec.misses == 0


def pause_for(loss: float, share: float) -> int:
    """The pause `Adaptive.update` sets for `loss` seconds lost at `share` seconds a step."""
    return math.ceil(loss / (LOSS_BUDGET * share) - 1e-9)


def test_steps_that_lose_time_pause_until_decoding_wins_it_back():
    """A speculative step is weighed against decoding its tokens (a decode call each, alone): what
    it saves is kept, a loss beyond the savings pauses proposing for as many steps as make the loss
    LOSS_BUDGET of their time (at most MAX_PAUSE); a miss that costs no more than a decode call
    (float32's verify of 2 on this CPU) loses nothing and does not pause. Unmeasured, only misses
    pause."""
    costs = Costs()
    costs.decoded(0.010, rows=1)
    spec = Lookup(costs=costs)
    spec.update(4, 3, seconds=0.020)  # 4 tokens in 2 decode calls' time
    assert spec.pause == 0 and spec.saved_s == pytest.approx(0.020)
    spec.update(4, 0, seconds=0.025)  # 1 token in 2.5 calls' time: the savings cover it
    assert spec.pause == 0 and spec.saved_s == pytest.approx(0.005)
    spec.update(4, 0, seconds=0.017)  # 0.002 s lost beyond the savings
    assert spec.pause == pause_for(0.002, 0.010) and spec.saved_s == 0
    free_miss = Lookup(costs=costs)
    free_miss.update(1, 0, seconds=0.010)
    assert free_miss.pause == 0
    free_miss.update(8, 0, seconds=1.0)
    assert free_miss.pause == MAX_PAUSE
    unmeasured = Lookup()
    unmeasured.update(4, 1, seconds=0.040)
    assert unmeasured.pause == 0 and unmeasured.saved_s == 0
    unmeasured.update(4, 0, seconds=0.040)
    assert unmeasured.pause == 1


def test_full_takes_while_k_ramps_up_carry_their_loss():
    """A verify that took all it proposed, below MAX_DRAFT, lost time because k was small (1, 3,
    ..), not because proposals fail: the loss is carried, not paused for; a refusal then pauses
    for all that is owed, and so does a full take of MAX_DRAFT that loses."""
    costs = Costs()
    costs.decoded(0.010, rows=1)
    spec = Lookup(costs=costs)
    spec.update(1, 1, seconds=0.025)  # 2 tokens in 2.5 calls' time: 0.005 s lost
    assert spec.pause == 0 and spec.saved_s == pytest.approx(-0.005) and spec.k == 3
    spec.update(3, 1, seconds=0.021)  # a refusal: 0.001 s more lost, 0.006 owed
    assert spec.pause == pause_for(0.006, 0.010) and spec.saved_s == 0
    full = Lookup(costs=costs, k=MAX_DRAFT)
    full.update(MAX_DRAFT, MAX_DRAFT, seconds=(MAX_DRAFT + 2) * 0.010)
    assert full.pause == pause_for(0.010, 0.010)


def test_ramping_stops_where_the_turns_own_steps_say_no_take_could_pay():
    """k ramps up through losing full takes only while the line through the turn's steps (tokens
    verified -> seconds) says a full take of MAX_DRAFT would pay: rows at 0.015 s each against
    decoded tokens at 0.010 s never can, and the carried loss pauses; at 0.008 s they could."""
    costs = Costs()
    costs.decoded(0.010, rows=1)
    dear, cheap = Lookup(costs=costs), Lookup(costs=costs)
    for spec, seconds in ((dear, 0.055), (cheap, 0.041)):
        spec.update(1, 1, seconds=0.025)  # 2 tokens, 0.005 s lost: carried
        assert spec.pause == 0 and spec.saved_s == pytest.approx(-0.005)
        spec.update(3, 3, seconds=seconds)
    assert not dear.may_pay() and dear.pause == pause_for(0.020, 0.010) and dear.saved_s == 0
    assert cheap.may_pay() and cheap.pause == 0 and cheap.saved_s == pytest.approx(-0.006)


def test_decode_calls_are_kept_by_rows_and_a_broken_batch_is_charged_to_its_verifies():
    """`Costs`: D(rows) measured per row count (a running average); a count not measured lies on
    the line through the two nearest measured (one measured: flat); a token decoded in a step of
    B costs D(B) / B; when v of the B verify, the call of the B - v left costs (D(B - v) - (B - v)
    D(B) / B) more than their share, charged to the v."""
    costs = Costs()
    assert not costs.measured and costs.call_s(1) == 0
    costs.decoded(0.016, rows=4)
    assert costs.call_s(1) == pytest.approx(0.016) and costs.call_s(0) == 0
    costs.decoded(0.010, rows=1)
    costs.decoded(0.020, rows=1)  # a running average: 0.010 + 0.2 * 0.010
    assert costs.call_s(1) == pytest.approx(0.012)
    assert costs.call_s(3) == pytest.approx(0.012 + 0.004 * 2 / 3)  # between 1 and 4 rows
    assert costs.call_s(8) == pytest.approx(0.012 + 0.004 * 7 / 3)  # beyond: the same line
    costs.decoded(0.014, rows=3)
    assert costs.share_s() == pytest.approx(0.012) and costs.share_s(4) == pytest.approx(0.004)
    assert costs.broken_s() == 0 and costs.broken_s(4, 4) == 0  # nobody left decoding
    assert costs.broken_s(4, 1) == pytest.approx(0.014 - 3 * 0.004)
    assert costs.broken_s(4, 3) == pytest.approx((0.012 - 0.004) / 3)


def test_a_verify_beside_decoding_turns_pays_for_the_batch_it_breaks():
    """In a step of 4 turns whose decode call costs 1.6 one-row calls, a verify making 4 tokens
    in 2 one-row calls' time saves time alone; in the step of 4 its tokens are worth 0.4 of a
    call each, and beside 3 decoding turns it also pays what their smaller call loses: it pauses
    for the loss over LOSS_BUDGET of a turn's share of a step."""
    costs = Costs()
    for rows, seconds in ((1, 0.010), (3, 0.014), (4, 0.016)):
        costs.decoded(seconds, rows)
    alone, beside, together = Lookup(costs=costs), Lookup(costs=costs), Lookup(costs=costs)
    alone.update(4, 3, seconds=0.020, batch=1)
    beside.update(4, 3, seconds=0.020, batch=4, verifying=1)
    together.update(4, 3, seconds=0.020, batch=4, verifying=4)
    assert alone.pause == 0 and alone.saved_s == pytest.approx(0.020)
    assert beside.pause == pause_for((0.020 - 4 * 0.004 + 0.002), 0.004)
    assert together.pause == pause_for((0.020 - 4 * 0.004), 0.004)


def test_neighbours_verify_together_where_measured_no_dearer():
    """Neighbouring turns' verifies run as one padded call first to measure it, then apart to
    measure those, then as measured: together where that call is no dearer than theirs apart
    (float weights: read once for all rows), apart where padding costs (int4's multiplies)."""
    costs = Costs()
    assert not costs.groups([5])  # one turn: nothing to group
    assert costs.groups([2, 5])  # (2 rows, 5) never measured: measure it
    costs.verified(0.060, 2, 5)
    assert not costs.groups([2, 5])  # the rows apart not measured yet
    costs.verified(0.040, 1, 5)
    assert not costs.groups([2, 5])  # still not (1, 2)
    costs.verified(0.025, 1, 2)
    assert costs.groups([2, 5])  # 0.060 against 0.065 apart
    costs.verified(0.080, 2, 5)  # a running average: 0.060 + 0.2 * 0.020 = 0.064
    assert costs.verifies[2, 5] == pytest.approx(0.064)
    assert costs.groups([2, 5])
    costs.verified(0.090, 2, 5)  # 0.064 + 0.2 * 0.026 = 0.0692 > 0.065
    assert not costs.groups([2, 5])
    assert costs.groups([5, 5])  # another shape: measured first


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the standard normal's z (3.09: 0.999) by
    Wilson-Hilferty, within 1% for df >= 3."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def test_beside_other_turns_proposals_start_at_the_fewest_that_could_pay():
    """Alone, lookup proposes k (1 at first); in a step of 4 whose decode call costs 1.6 one-row
    calls, 2 tokens taken would be worth less than the verify's least cost (a one-row call plus
    the batch it breaks), so it proposes 2 (3 tokens: 0.012 s, what a one-row call and the
    broken batch cost)."""
    costs = Costs()
    for rows, seconds in ((1, 0.010), (3, 0.014), (4, 0.016)):
        costs.decoded(seconds, rows)
    history = [5, 6, 7, 8, 9, 5, 6, 7]
    assert Lookup(costs=costs).propose(history, 8) == [8]
    assert Lookup(costs=costs).least_k(4) == 2
    assert Lookup(costs=costs).propose(history, 8, batch=4) == [8, 9]
    assert Lookup().propose(history, 8, batch=4) == [8]  # unmeasured


def test_accept_rule_keeps_the_distribution():
    """Whatever the proposal, `accept`'s token has the target distribution: chi-square at
    p = 0.001 over 20000 draws per proposal."""
    probs = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    rng = np.random.default_rng(0)
    for proposal in range(probs.size):
        counts = np.bincount([accept(probs, proposal, rng) for _ in range(20000)], minlength=probs.size)
        expected = probs * counts.sum()
        assert ((counts - expected) ** 2 / expected).sum() < chi_square_critical(probs.size - 1)
    # a rule that always took the proposal would fail the same test
    counts = np.bincount([3] * 20000, minlength=probs.size)
    expected = probs * counts.sum()
    assert ((counts - expected) ** 2 / expected).sum() > chi_square_critical(probs.size - 1)


def lookup_bait(model: Model, base: list[int]) -> list[int]:
    """`base` after blocks [.., last, t, x_t] for each of the 3 likeliest next tokens t (the
    context lookup matches: `MIN_NGRAM` tokens ending in t), with x_t the
    likeliest after t: then whichever first token is drawn, lookup proposes x_t, which the model
    takes often but not always. The blocks change what is likeliest at the end, so they are
    rebuilt until they cover it (a few rounds)."""
    ids = base
    for _ in range(6):
        top = np.argsort(-model.prepare(0, ids))[:3]
        context = base[len(base) - MIN_NGRAM + 1 :]
        block = [[*context, int(t), int(np.argmax(model.prepare(0, [*ids, int(t)])))] for t in top]
        grown = [tok for b in block for tok in b] + base
        if grown == ids:
            break
        ids = grown
    return ids


def assert_sampled_distribution(model: Model, ids: list[int], config: SamplingConfig, replies: int = 1500):
    """The first three sampled tokens of `replies` replies to `ids` (`config`: 3 tokens, top-k 3:
    27 outcomes), with speculation, follow the model's exact distribution, computed from its
    teacher-forced logits: chi-square at p = 0.001; proposals were both taken and refused."""
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, p in exact.items():
            dist = _distribution(model.prepare(0, ids + list(prefix)).astype(np.float64), config)
            for t in np.flatnonzero(dist):
                grown[(*prefix, int(t))] = p * dist[t]
        exact = grown
    counts = dict.fromkeys(exact, 0)
    taken = refused = 0
    for seed in range(replies):
        tokens, _, verifies = run_turn(model, 0, ids, SamplingConfig(**{**config.__dict__, "seed": seed}))
        counts[tuple(tokens)] += 1
        taken += sum(k - 1 for _, k in verifies)
        refused += sum(p - (k - 1) for p, k in verifies)
    assert taken > 50 and refused > 50, (taken, refused)
    expected = np.array([exact[k] for k in counts]) * replies
    observed = np.array(list(counts.values()))
    assert ((observed - expected) ** 2 / expected).sum() < chi_square_critical(len(counts) - 1)


@pytest.mark.usefixtures("no_loss_pauses")
def test_sampled_distribution_preserved(exports):
    """Lookup's proposals keep sampled replies in distribution (`assert_sampled_distribution`)."""
    config = SamplingConfig(max_new_tokens=3, temperature=1.5, top_k=3, speculate="lookup")
    with Model(exports("portable-f32"), slots=1) as model:
        assert_sampled_distribution(model, lookup_bait(model, random_ids(20, seed=4)), config)


def test_service_request_field_overrides_config():
    from kvedge.serve.app import sampling_config
    from kvedge.serve.protocol import ApiError, parse_chat_request, parse_completion_request

    messages = [{"role": "user", "content": "hi"}]
    asked = parse_chat_request({"messages": messages, "speculate": "lookup"})
    plain = parse_chat_request({"messages": messages})
    assert (asked.speculate, plain.speculate) == ("lookup", None)
    assert sampling_config(asked, 8, None, None, "off").speculate == "lookup"
    assert sampling_config(plain, 8, None, None, "lookup").speculate == "lookup"  # the service's default
    assert sampling_config(plain, 8, None, None).speculate == "off"
    assert parse_completion_request({"prompt": "x", "speculate": "off"}).speculate == "off"
    for retired in ("draft:", "draft:some/dir"):  # the wire never needed the folder
        with pytest.raises(ApiError, match=r"speculate=.*draft:.* is not allowed; allowed: one of"):
            parse_chat_request({"messages": messages, "speculate": retired})
    assert parse_chat_request({"messages": messages, "speculate": "draft"}).speculate == "draft"


def test_s8_to_u8_rewrite_disabled_only_where_it_breaks_loading(exports):
    """The INT8 cache beside quantized weights' DequantizeLinear fails to load with onnxruntime's
    S8->U8 rewrite (the portable-int4-int8 case above loads at all only without it); elsewhere
    it stays, as it speeds up portable int8-weight graphs."""
    from kvedge.contract import Manifest
    from kvedge.runtime.backends.ort import disabled_optimizers

    assert disabled_optimizers(Manifest.load(exports("portable-int4-int8"))) == ["QDQS8ToU8Transformer"]
    for name in ("portable-f32", "portable-int8", "ort-int8"):
        assert disabled_optimizers(Manifest.load(exports(name))) == []


def test_device_check_runs_on_the_cpu(exports):
    """device_tests/speculation.py's check (run there on TensorRT and onnxruntime CUDA), run here
    on the CPU backend: what it calls exists and works as it expects, so a first run on a GPU
    can fail only on what the GPU computes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "device_tests" / "speculation.py"
    spec = importlib.util.spec_from_file_location("device_speculation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures: dict[str, object] = {}
    with Model(exports("portable-f32"), slots=2) as model:
        module.check_speculation(model, figures.__setitem__, "cpu", n=24)
    assert figures["cpu.speculate_first_difference"] is None
    verifies, proposed, kept = figures["cpu.speculate_verifies_proposed_kept"]
    assert verifies > 0 and 0 < kept <= proposed
    assert figures["cpu.plain_tokens_per_s"] > 0 and figures["cpu.speculate_ratio"] > 0


def test_the_device_tests_speculation_check_runs_on_the_cpu(exports):
    """device_tests/speculation.py's check, on the CPU backend (where verify and decode agree to
    the bit): it passes, records its figures, and a reply that parts from plain decoding is
    measured at the tokens' logit gap there, which the near-tie rule compares."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "device_tests"))
    try:
        from speculation import PROMPT as DEVICE_PROMPT
        from speculation import check_speculation, tie_gap
    finally:
        sys.path.pop(0)
    figures: dict[str, object] = {}
    with Model(exports("portable-f32"), slots=2) as model:
        check_speculation(model, figures.__setitem__, "cpu", n=24)
        assert figures["cpu.speculate_first_difference"] is None and figures["cpu.speculate_ratio"] > 0
        plain = run_turn(model, 0, DEVICE_PROMPT, SamplingConfig(max_new_tokens=6))[0]
        logits = model.prepare(0, DEVICE_PROMPT + plain[:3])
        other = int(np.argsort(logits)[-2])  # the runner-up at token 3
        gap = tie_gap(model, plain, plain[:3] + [other], 3)
        assert gap == pytest.approx(float(logits[plain[3]] - logits[other]))
        assert gap > 0
