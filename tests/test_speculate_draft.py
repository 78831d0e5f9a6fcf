"""Speculative decoding with a draft model (kvedge.runtime.draft).

The target is a tiny random model's portable float32 export; drafts are exports of the same
tokenizer: the same model with int4 weights (close: takes most proposals), the same model with
its weights perturbed (takes some, refuses some), and the target's own export (every proposal
right, unless the draft's slot falls out of step with the target's: what the sync and rewind
tests lean on). Greedy replies must equal plain decoding token for token whatever the draft; the
draft's slot must only ever hold tokens of the target's conversation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import MAX_LEN, random_ids
from test_speculate import assert_sampled_distribution, run_turn

from kvedge.contract import ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.model import Model

# exactness and bookkeeping need takes and refusals: a tiny target's draft steps cost what
# they save, so steps that lose time do not pause here (the policy: test_speculate.py)
pytestmark = pytest.mark.usefixtures("no_loss_pauses")
PROMPTS = [random_ids(12, seed=3) * 2, random_ids(30, seed=8), random_ids(20, seed=4)]


def perturbed(source, out, scale: float, seed: int = 1):
    """A copy of the Hugging Face model in `source` (tokenizer and all) with every weight matrix
    moved by `scale` times its own standard deviation of noise."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, out)
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(scale * p.std() * torch.randn_like(p))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("draft")
    source = make_tiny_model(root / "hf")
    out = {
        "target": ("portable", source, {"variant": "portable"}),
        "int4": ("int4", source, {"variant": "ort", "weights": "int4", "kv_dtype": "int8"}),
        "perturbed": ("perturbed", perturbed(source, root / "hf-perturbed", 0.6), {"variant": "ort"}),
    }
    for name, (folder, hf, options) in out.items():
        export_model(hf, root / folder, ExportRecipe(max_len=MAX_LEN, **options))
        out[name] = root / folder
    gemma = make_tiny_model(root / "hf-gemma3", "gemma3")
    export_model(gemma, root / "gemma3", ExportRecipe(max_len=MAX_LEN, variant="portable"))
    export_model(
        gemma, root / "gemma3-int8", ExportRecipe(max_len=MAX_LEN, variant="portable", kv_dtype="int8")
    )
    out["gemma3"], out["gemma3-int8"] = root / "gemma3", root / "gemma3-int8"
    return out


def greedy(n: int, speculate: str = "off") -> SamplingConfig:
    return SamplingConfig(max_new_tokens=n, speculate=speculate)


def assert_draft_in_step(model: Model, slot: int) -> None:
    """The draft's slot holds a prefix of what the target's slot holds: no rejected proposal,
    nothing of another conversation."""
    held = list(model.draft.model.cache.token_ids(slot))
    assert held == list(model.cache.token_ids(slot))[: len(held)]


def run_in_step(model: Model, slot: int, ids: list[int], config: SamplingConfig):
    """`run_turn`, checking after every verify that the draft's slot is in step with the target's:
    it holds what the target kept, never a rejected proposal (before its first proposal of a
    turn the draft may still hold another conversation: it syncs when it proposes)."""
    turn = model.begin(slot, ids, config)
    tokens, verifies = [], []
    while not turn.done:
        result = model.step([turn])
        tokens += [e.token for e in result.emitted(turn)]
        verifies += result.verify_calls
        if result.verify_calls:
            assert_draft_in_step(model, slot)
    return tokens, None, verifies


@pytest.mark.parametrize("draft", ["int4", "perturbed"])
def test_greedy_identical_with_a_draft(folders, draft):
    proposed = kept = 0
    with Model(folders["target"], slots=2, draft=folders[draft]) as model:
        for ids in PROMPTS:
            plain, _, none = run_turn(model, 0, ids, greedy(40))
            fast, _, verifies = run_in_step(model, 1, ids, greedy(40, "draft"))
            assert not none and fast == plain
            assert list(model.cache.token_ids(1)) == list(model.cache.token_ids(0))
            assert_draft_in_step(model, 1)
            proposed += sum(p for p, _ in verifies)
            kept += sum(k - 1 for _, k in verifies)
    assert 0 < kept <= proposed, (draft, kept, proposed)
    if draft == "perturbed":  # the int4 draft's greedy tokens were the target's (102 of 102)
        assert kept < proposed, (kept, proposed)  # took some, refused some


def test_draft_equal_to_target_is_always_right_across_chat_turns(folders):
    """With the target's own export as draft, every proposal is what the target decodes, if the
    draft's slot holds exactly the target's context: the sync (prefill what it lacks), the rewind
    after each verify, and a second turn that drops the reply's tail and adds a user turn."""
    with Model(folders["target"], slots=2) as model:
        model.load_draft(folders["target"])
        first = PROMPTS[0]
        for turn_ids in (first, None):
            if turn_ids is None:  # turn 2: turn 1's prompt, half its reply, a new message
                held = list(model.cache.token_ids(0))
                turn_ids = held[: len(first) + 6] + random_ids(9, seed=11)
            plain, _, _ = run_turn(model, 0, turn_ids, greedy(30))
            fast, _, verifies = run_turn(model, 1, turn_ids, greedy(30, "draft"))
            assert fast == plain
            assert verifies and all(k == p + 1 for p, k in verifies[:-1]), verifies
            assert_draft_in_step(model, 1)


def test_draft_prefill_of_the_prompt_is_not_weighed_as_a_step(folders):
    """The draft's first proposal of a turn prefills the turn's prompt in its slot: that is the
    prompt's cost, left out of the step's time the cost gate weighs (`unweighed_s`); the turn's
    later proposals are all the step's."""
    with Model(folders["target"], slots=1) as model:
        model.load_draft(folders["target"])
        turn = model.begin(0, PROMPTS[1], greedy(16, "draft"))
        unweighed = []
        while not turn.done:
            result = model.step([turn])
            if result.verify_calls:
                unweighed.append(turn.speculator.unweighed_s)
                assert turn.propose_s >= 0
        assert len(unweighed) > 1 and unweighed[0] > 0 and not any(unweighed[1:]), unweighed


def test_batched_rows_equal_solo(folders):
    prompts = [PROMPTS[0], random_ids(10, seed=5) * 2, random_ids(30, seed=7)]
    with Model(folders["target"], slots=3, draft=folders["perturbed"]) as model:
        solo = [run_turn(model, 0, ids, greedy(30))[0] for ids in prompts]
        config = greedy(30, "draft")
        turns = [model.begin(slot, ids, config) for slot, ids in enumerate(prompts)]
        got: dict[int, list[int]] = {t.slot: [] for t in turns}
        verified = 0
        while not all(t.done for t in turns):
            result = model.step(turns)
            verified += len(result.verify_calls)
            for turn in turns:
                got[turn.slot] += [e.token for e in result.emitted(turn)]
        for slot in range(3):
            assert_draft_in_step(model, slot)
    assert [got[s] for s in range(3)] == solo
    assert verified


def test_sampled_distribution_preserved(folders):
    """The perturbed draft's proposals keep sampled replies in the target's distribution
    (`assert_sampled_distribution`)."""
    config = SamplingConfig(max_new_tokens=3, temperature=1.5, top_k=3, speculate="draft")
    with Model(folders["target"], slots=1) as model:
        model.load_draft(folders["perturbed"])
        assert_sampled_distribution(model, random_ids(20, seed=4), config)


def test_a_draft_that_fails_to_close_still_lets_the_model_close(folders):
    """`Model.close` closed the draft, then the backend, in one try: a draft whose close raised
    left the target's backend (a GPU session, mapped memory) open."""
    model = Model(folders["target"], slots=1, draft=folders["int4"])

    def broken() -> None:
        raise RuntimeError("injected: the draft's device went away")

    model.draft.close = broken
    with pytest.raises(RuntimeError, match="injected"):
        model.close()
    _, events, _ = run_turn(model, 0, PROMPTS[0], greedy(2))  # a step's failure ends its turn
    assert events[-1].finish_reason == "error" and "backend was closed" in str(events[-1].error)


def test_tokenizer_mismatch_refused(folders, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(folders["int4"], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # two ids swapped: the same strings, other meanings
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with Model(folders["target"]) as model:
        with pytest.raises(KvedgeError, match="has another tokenizer than the target") as info:
            model.load_draft(other)
        assert str(other) in str(info.value) and str(folders["target"]) in str(info.value)
        assert model.draft is None
        with pytest.raises(KvedgeError, match="needs the draft loaded with the model"):
            model.begin(0, PROMPTS[0], greedy(5, "draft"))  # never loaded mid-request
    with pytest.raises(KvedgeError, match="has another tokenizer than the target"):
        Model(folders["target"], draft=other)  # at load, as RunOptions.draft
    with Model(folders["target"], draft=folders["int4"]) as model:
        with pytest.raises(
            KvedgeError, match="speculate='draft:.*' is not allowed"
        ):  # the folder is the model's
            model.begin(0, PROMPTS[0], greedy(5, f"draft:{folders['perturbed']}"))
        tokens, _, _ = run_turn(model, 0, PROMPTS[0], greedy(5))  # the model still answers
        assert len(tokens) == 5


@pytest.mark.parametrize("target", ["gemma3", "gemma3-int8"])
def test_ring_draft_identical_or_off(folders, target, caplog):
    """Gemma 3 (sliding-window ring layers) drafting for itself at float32 and INT8-cache: replies
    as plain; a rewind past the rings' margin turns the draft off for the turn, never wrong."""
    caplog.set_level("INFO", logger="kvedge.runtime.draft")
    with Model(folders[target], slots=2) as model:
        model.load_draft(folders["gemma3"])
        taken = 0
        for ids in PROMPTS:
            plain, _, _ = run_turn(model, 0, ids, greedy(40))
            fast, _, verifies = run_turn(model, 1, ids, greedy(40, "draft"))
            assert fast == plain
            assert_draft_in_step(model, 1)
            taken += sum(k - 1 for _, k in verifies)
    assert taken or "draft proposals off" in caplog.text


def test_ring_draft_starts_over_when_a_new_turn_rewinds_past_its_rings(folders):
    """A second turn keeping fewer tokens than the draft's rings can rewind to (they hold the last
    window + margin positions of ~110) starts the draft slot over: every proposal still right."""
    with Model(folders["gemma3"], slots=2) as model:
        model.load_draft(folders["gemma3"])
        first = random_ids(60, seed=12)
        second = first[:20] + random_ids(6, seed=13)
        for ids in (first, second):
            if ids is second:  # the rewind the second turn needs is refused: it starts over
                assert model.draft.model.cache.rewind_limit(1, 20) == 0
            plain, _, _ = run_turn(model, 0, ids, greedy(50))
            fast, _, verifies = run_turn(model, 1, ids, greedy(50, "draft"))
            assert fast == plain
            assert verifies and all(k == p + 1 for p, k in verifies[:-1]), verifies
            assert_draft_in_step(model, 1)


def test_cli_generate_with_a_draft(folders, caplog):
    from kvedge.cli import main

    runner = CliRunner()
    args = ["generate", "--model", str(folders["target"]), "--max-new-tokens", "12", "hello there"]
    plain = runner.invoke(main, args)
    fast = runner.invoke(main, [*args, "--draft", str(folders["int4"])])  # --speculate draft by default
    assert plain.exit_code == 0 and fast.exit_code == 0, (plain.output, fast.output)
    assert fast.output == plain.output
    with caplog.at_level("WARNING", logger="kvedge"):
        retired = runner.invoke(main, [*args, "--speculate", f"draft:{folders['int4']}"])
    assert retired.exit_code == 0 and retired.output == plain.output
    assert caplog.text.count(f"--speculate draft:DIR is deprecated; use --draft {folders['int4']}") == 1
    bad = runner.invoke(main, [*args, "--speculate", "draft:"])
    assert bad.exit_code != 0 and "'draft:' is not allowed; allowed: off, lookup, draft" in bad.output
    alone = runner.invoke(main, [*args, "--speculate", "draft"])
    assert alone.exit_code != 0 and "--speculate draft needs the draft's export: --draft DIR" in alone.output
    missing = runner.invoke(main, [*args, "--draft", "/nonexistent/draft"])
    assert missing.exit_code != 0 and "/nonexistent/draft" in missing.output
    assert "Traceback" not in missing.output + alone.output
    remote = runner.invoke(main, ["chat", "--url", "http://127.0.0.1:9", "--draft", str(folders["int4"])])
    assert remote.exit_code == 2 and "with --url the service's draft proposes" in remote.output


def test_remote_chat_sends_speculate_only_where_given():
    from kvedge.runtime.generate import SamplingConfig
    from kvedge.serve.client import RemoteChat

    messages = [{"role": "user", "content": "hi"}]
    assert "speculate" not in RemoteChat("http://x", SamplingConfig()).request(messages)  # the service's
    asked = RemoteChat("http://x", SamplingConfig(speculate="draft"), speculate="draft").request(messages)
    assert asked["speculate"] == "draft"


def test_service_draft_requests(folders, tmp_path, caplog):
    from kvedge.serve.app import speculate_mode
    from kvedge.serve.config import load_service_config
    from kvedge.serve.protocol import ApiError
    from kvedge.serve.service import load_model

    assert speculate_mode("draft", "lookup", drafted=True) == "draft"
    assert speculate_mode(None, "draft", drafted=True) == "draft"
    assert speculate_mode("lookup", "draft", drafted=True) == "lookup"
    with pytest.raises(ApiError, match=r"loaded no draft model; allowed: \['off', 'lookup'\]"):
        speculate_mode("draft", "lookup")
    with pytest.raises(KvedgeError, match="speculate=draft needs the draft's export: set draft"):
        load_service_config(None, {"model": folders["target"], "speculate": "draft"})
    config = load_service_config(None, {"model": folders["target"], "draft": folders["int4"]})
    assert (config.speculate, config.draft) == ("draft", folders["int4"])  # draft: speculates by default
    with pytest.raises(KvedgeError, match="--draft='/nonexistent': no manifest.json there"):
        load_service_config(None, {"model": folders["target"], "draft": Path("/nonexistent")})
    retired = tmp_path / "retired.yaml"
    retired.write_text(f"model: {folders['target']}\nspeculate: draft:{folders['int4']}\n")
    with caplog.at_level("WARNING", logger="kvedge.serve.config"):
        assert load_service_config(retired, {}) == config
    assert f"speculate: draft:DIR is deprecated; write draft: {folders['int4']}" in caplog.text
    with load_model(config, slots=2) as model:  # the draft is loaded at start, a slot per slot
        assert model.draft is not None and model.draft.model.slots == 2
        tokens, _, verifies = run_turn(
            model, 1, PROMPTS[0], greedy(20, speculate_mode(None, config.speculate, True))
        )
        assert verifies and tokens == run_turn(model, 0, PROMPTS[0], greedy(20))[0]
