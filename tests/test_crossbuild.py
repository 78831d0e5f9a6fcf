"""kvedge.bench.crossbuild, the aarch64 job's logits check (.ci/aarch64): a build compared with
itself measures nothing and passes the tightest tolerance, other logits are measured and fail
it, and a reference recorded on another export is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvedge.bench.crossbuild import main
from kvedge.contract import ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model

PROMPTS, TOKENS = 2, 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny llama (head_dim 64) exported as the job exports: ort, int4 weights, INT8 cache."""
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("crossbuild")
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    source = make_tiny_model(root / "hf", "llama", hidden_size=128, **heads)
    options = ExportRecipe(max_len=128, variant="ort", weights="int4", kv_dtype="int8")
    export_model(source, root / "out", options)
    return root / "out"


def record(model, path) -> dict[str, np.ndarray]:
    args = ["record", "--model", str(model), "--out", str(path), "--prompts", str(PROMPTS)]
    assert main([*args, "--tokens", str(TOKENS)]) == 0
    with np.load(path) as loaded:
        return dict(loaded)


def compare(model, reference, tmp_path, max_kl: str, min_top1: str) -> tuple[int, dict]:
    out = tmp_path / "measures.json"
    args = ["compare", "--model", str(model), "--reference", str(reference), "--json", str(out)]
    status = main([*args, "--max-kl-mean", max_kl, "--min-top1", min_top1])
    return status, json.loads(out.read_text())


def test_a_build_against_itself_measures_nothing(exported, tmp_path):
    reference = record(exported, tmp_path / "ref.npz")
    assert reference["logits"].shape == (PROMPTS, TOKENS, 320)
    assert all(reference[f"forced_{i}"].shape == (TOKENS - 1,) for i in range(PROMPTS))
    status, measures = compare(exported, tmp_path / "ref.npz", tmp_path, "0", "1")
    assert status == 0
    assert measures["kl_mean"] <= 1e-12 and measures["top1_agreement"] == 1.0
    assert measures["greedy_match_min"] == TOKENS


def test_other_logits_are_measured_and_fail_the_tolerance(exported, tmp_path):
    """The reference's top two logits swapped at prompt 0, position 3: one position of 16 disagrees
    there (top-1 15/16, the first disagreement of prompt 0 at 3), and its KL is that swap's."""
    reference = record(exported, tmp_path / "ref.npz")
    row = reference["logits"][0, 3]
    first, second = np.argsort(row)[-1], np.argsort(row)[-2]
    row[[first, second]] = row[[second, first]]
    np.savez(tmp_path / "changed.npz", **reference)
    status, measures = compare(exported, tmp_path / "changed.npz", tmp_path, "1", "1")
    assert status == 1
    assert measures["top1_agreement"] == 1 - 1 / (PROMPTS * TOKENS)
    assert measures["greedy_match_min"] == 3 and measures["kl_mean"] > 0
    assert compare(exported, tmp_path / "changed.npz", tmp_path, "1", "0.9")[0] == 0


def test_a_reference_of_another_export_is_refused(exported, tmp_path):
    reference = record(exported, tmp_path / "ref.npz")
    reference["fingerprint"] = np.array("0" * 64)
    np.savez(tmp_path / "other.npz", **reference)
    with pytest.raises(KvedgeError, match="recorded on export 0000000000000000, --model is export"):
        compare(exported, tmp_path / "other.npz", tmp_path, "1", "0")
