"""Where `kvedge bench` writes and what it records about the code that ran (kvedge.bench.results)."""

from __future__ import annotations

import datetime
import re

from tiny import make_tiny_model

from kvedge.bench import BenchConfig, _specs
from kvedge.bench.prepare import Workdir
from kvedge.bench.results import RESULTS_ROOT, code_revision, results_folder
from kvedge.contract import Manifest

DAY = datetime.date(2026, 12, 1)


def test_a_results_folder_is_named_by_date_commit_and_what_ran(tmp_path):
    folder = results_folder("cpu", (1, 2), root=tmp_path, today=DAY, revision="c1d86bf")
    assert folder == tmp_path / "2026-12-01-c1d86bf-cpu-t1-t2"
    folder.mkdir()
    again = results_folder("cpu", (1, 2), root=tmp_path, today=DAY, revision="c1d86bf")
    assert again == tmp_path / "2026-12-01-c1d86bf-cpu-t1-t2-2"  # an earlier run is never overwritten
    again.mkdir()
    assert results_folder("cpu", (1, 2), root=tmp_path, today=DAY, revision="c1d86bf").name.endswith("-3")


def test_the_revision_is_this_checkouts_commit():
    """kvedge runs from this repository's checkout here (editable install), so the revision is its
    HEAD, "-dirty" while tracked files differ from it."""
    revision = code_revision()
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", revision), revision


def test_the_default_output_is_a_new_dated_folder_under_bench_results():
    config = BenchConfig(threads=(1, 2))
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert config.out.parent == RESULTS_ROOT
    assert re.fullmatch(rf"{today}-[0-9a-f]{{7,}}(-dirty)?-cpu-t1-t2(-\d+)?", config.out.name), config.out
    assert BenchConfig(out=RESULTS_ROOT / "scratch" / "x").out == RESULTS_ROOT / "scratch" / "x"


def test_peers_are_given_the_float32_cache_when_the_first_kvedge_system_has_an_int8_one(tmp_path):
    """The bytes a peer's decode step reads (its roofline) count its own cache, a float32 one for
    transformers and onnxruntime-genai, not the first kvedge export's INT8 cache."""
    source = make_tiny_model(tmp_path / "hf", "llama")
    config = BenchConfig(
        out=tmp_path / "results",
        work=tmp_path / "work",
        source=str(source),
        threads=1,
        kvedge=("portable:float32:int8",),
        peers=("transformers",),
    )
    specs, _ = _specs(config, Workdir(config.work, config.source))
    by_name = {spec.name: spec for spec in specs}
    geometry = Manifest.load(by_name["kvedge portable float32 kv int8"].path).geometry
    assert geometry.dtype == "int8"
    float32 = geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * 2 * 4  # K and V, 4 bytes
    assert by_name["transformers eager"].kv_bytes_per_token == float32
    assert by_name["kvedge portable float32 kv int8"].kv_bytes_per_token < float32 / 3
