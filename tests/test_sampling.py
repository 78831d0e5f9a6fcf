"""Sampling steps as pure functions, and the sampling options' bounds on every surface."""

from __future__ import annotations

import re
from pathlib import Path

import click
import numpy as np
import pytest

import kvedge.serve
from kvedge.cli import main
from kvedge.contract import MANIFEST_FILE
from kvedge.errors import KvedgeError
from kvedge.runtime.generate import SamplingConfig, sample
from kvedge.runtime.sampling import SAMPLING_BOUNDS, Bounds
from kvedge.serve.config import ServiceConfig, load_service_config
from kvedge.serve.protocol import ApiError, parse_completion_request

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


def probes(bounds: Bounds) -> list[float]:
    """Values on, just inside and just outside each end of `bounds`, and the range SamplingConfig
    once had for temperature (up to 100)."""
    step = 1 if bounds.integer else 1e-6
    ends = [bounds.low] if bounds.high is None else [bounds.low, bounds.high]
    return sorted({v for end in ends for v in (end - step, end, end + step)} | {100})


def accepts(check, value) -> bool:
    try:
        check(value)
    except (KvedgeError, ApiError, click.BadParameter):
        return False
    return True


@pytest.mark.parametrize("field", sorted(SAMPLING_BOUNDS))
def test_every_surface_allows_what_the_declaration_allows(field, tmp_path):
    """SamplingConfig, the CLI flags, the service config and the wire accept exactly the values of
    `SAMPLING_BOUNDS`: a surface with a range of its own (temperature was 0..100 in SamplingConfig,
    0..2 in the service) fails here."""
    bounds = SAMPLING_BOUNDS[field]
    (tmp_path / MANIFEST_FILE).write_text("{}")
    flags = [p for name in ("generate", "chat") for p in main.commands[name].params if p.name == field]
    surfaces = {
        "SamplingConfig": lambda v: SamplingConfig(**{field: v}),
        "ServiceConfig": lambda v: load_service_config(None, {"model": tmp_path, field: v}),
        "/v1/completions": lambda v: parse_completion_request({"prompt": "hi", field: v}),
        **{f"kvedge {i} --{field}": (lambda v, p=p: p.type.convert(v, p, None)) for i, p in enumerate(flags)},
    }
    assert len(flags) == 2
    for value in probes(bounds):
        said = {name: accepts(check, value) for name, check in surfaces.items()}
        assert said == dict.fromkeys(surfaces, value in bounds), (field, value)


def test_every_surface_defaults_as_sampling_config():
    """The CLI flags (which do not import the runtime to read them) and the service config sample
    as SamplingConfig does where nothing is given."""
    for field in SAMPLING_BOUNDS:
        default = getattr(SamplingConfig, field)
        flags = [p for name in ("generate", "chat") for p in main.commands[name].params if p.name == field]
        assert [p.default for p in flags] == [default, default], field
        assert getattr(ServiceConfig, field) == default, field


def test_the_chat_page_offers_the_declared_temperatures():
    page = (Path(kvedge.serve.__file__).parent / "ui" / "index.html").read_text()
    field = re.search(r'<input id="temperature"[^>]*>', page).group()
    bounds = SAMPLING_BOUNDS["temperature"]
    assert re.search(r'min="([^"]+)"', field).group(1) == f"{bounds.low:g}"
    assert re.search(r'max="([^"]+)"', field).group(1) == f"{bounds.high:g}"


def test_bounds_say_what_they_allow():
    assert SAMPLING_BOUNDS["temperature"].allowed == "a number in [0, 2] (0: greedy)"
    assert SAMPLING_BOUNDS["top_p"].allowed == "a number in (0, 1]"
    assert SAMPLING_BOUNDS["top_k"].allowed == "an integer >= 0 (0: off)"
    assert SAMPLING_BOUNDS["top_p"].meta() == {"gt": 0.0, "le": 1.0}
    assert True not in SAMPLING_BOUNDS["top_k"] and 0.5 not in SAMPLING_BOUNDS["top_k"]
