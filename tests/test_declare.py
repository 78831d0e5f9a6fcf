"""Each option declared once (kvedge.declare): the command-line options, the service's keys and
the types built from them all come from the declaring fields."""

from __future__ import annotations

import dataclasses
import re

import click
import pytest
import yaml

import kvedge.serve.config as service_config
from kvedge.cli import main
from kvedge.configs import WarmPrefixConfig
from kvedge.contract import ExportRecipe
from kvedge.declare import DeclaredOption, declared, from_values
from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.options import RunOptions
from kvedge.runtime.sessions import HistoryPolicy
from kvedge.serve.config import KEYS, ServiceConfig

OWNERS = (ExportRecipe, RunOptions, SamplingConfig, ServiceConfig)
# (command, flag): why its option is not a declared one of that name
OWN_MEANING = {
    ("generate", "--model"): "the folder to load (the service's model flag overrides a file)",
    ("chat", "--model"): "likewise",
    ("warm-prefixes", "--model"): "likewise",
    ("warmup", "--model"): "likewise (the former name of warm-prefixes)",
    ("calibrate", "--model"): "likewise",
    ("eval-kv", "--model"): "likewise",
    ("plan", "--device"): "also reads a board profile (its former meaning)",
    ("plan", "--kv-dtype"): "several cache dtypes to plan",
    ("plan", "--slots"): "a list of slot counts to plan",
    ("plan", "--max-len"): "a list of cache lengths to plan",
    ("calibrate", "--kv-group-size"): "the calibrator's (CalibrationOptions), static scales",
    ("calibrate", "--kv-dtype"): "what to calibrate: INT8 static scales or the int4 cache's key layers",
    ("eval-kv", "--threads"): "llama.cpp's threads",
    ("bench", "--threads"): "the benchmark's thread counts",
}


def commands(group: click.Group, prefix: str = ""):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, f"{prefix}{name} ")
        else:
            yield prefix + name, command


def test_every_option_named_as_a_declared_one_is_made_from_it():
    """A hand-written click option restating a field (its own help, type or default) fails here,
    unless it means something else, said in OWN_MEANING."""
    flags = {option.flag_name for owner in OWNERS for option in declared(owner).values()}
    found, generated = set(), 0
    for name, command in commands(main):
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            for flag in set(param.opts) & flags:
                if isinstance(param, DeclaredOption):
                    generated += 1
                    assert param.declared.flag_name == flag
                else:
                    found.add((name, flag))
    assert found == set(OWN_MEANING), found ^ set(OWN_MEANING)
    assert generated >= 40  # export's 11, plan's 7, generate's and chat's 16 each, serve's 9, ...


def test_the_service_holds_every_run_option_and_gives_it_to_the_model(tmp_path):
    """`ServiceConfig.run_options` carries each of RunOptions' declared keys, set to a value other
    than its default, into the RunOptions it builds."""
    warm = tmp_path / "warm.yaml"
    warm.write_text("prefixes:\n  - name: a\n    text: hello\n")
    values = {
        "slots": 3,
        "threads": 2,
        "device": "cuda",
        "kv_memory": "device",
        "history_policy": "window",
        "n_sink": 2,
        "prefix_cache_bytes": 5,
        "prefix_dir": tmp_path / "p",
        "prefix_disk_bytes": 7,
        "prefix_disk_min_tokens": 9,
        "warm_prefixes": warm,
        "warm_dir": tmp_path / "w",
        "draft": tmp_path / "d",
    }
    assert set(values) == set(declared(RunOptions))
    config = ServiceConfig(model=tmp_path, **values)
    options = config.run_options()
    for key, option in declared(RunOptions).items():
        value = options
        for name in option.path:
            value = getattr(value, name)
        if key == "warm_prefixes":
            assert isinstance(value, WarmPrefixConfig) and value.prefixes[0].name == "a"
        else:
            assert value == values[key] != option.default, key
    assert config.run_options(slots=1).slots == 1


def test_from_values_builds_nested_fields_and_reads_files(tmp_path):
    options = from_values(RunOptions, {"history_policy": "truncate", "n_sink": None, "threads": 2})
    assert options.policy == HistoryPolicy(mode="truncate") and options.threads == 2
    assert from_values(RunOptions, {}, draft=tmp_path).draft == tmp_path
    assert from_values(SamplingConfig, {"stop": ["a", "b"]}).stop == ("a", "b")


def test_service_defaults_are_the_declarations_but_where_said():
    for owner in (RunOptions, SamplingConfig):
        for key, option in declared(owner).items():
            if key in KEYS:
                expected = service_config.SERVICE_DEFAULTS.get(key, option.default)
                assert getattr(ServiceConfig, key) == expected, key


def test_the_file_format_lists_every_key_with_its_default():
    """kvedge/serve/config.py's docstring shows the file: every key, each with its default."""
    listing = service_config.__doc__.split("::", 1)[1]
    listed = {}
    for line in listing.splitlines():
        found = re.match(r"^    (\w+): (.*?)(?:\s+#.*)?$", line)
        if found:
            listed[found[1]] = yaml.safe_load(found[2])
    assert list(listed) and set(listed) == set(KEYS), set(listed) ^ set(KEYS)
    for field in dataclasses.fields(ServiceConfig):
        if field.name in listed and field.name != "model":
            default = list(field.default) if isinstance(field.default, tuple) else field.default
            assert listed[field.name] == default, field.name


@pytest.mark.parametrize("flag,value", [("--block-size", "48"), ("--kv-group-size", "7")])
def test_a_generated_flag_refuses_what_its_field_refuses(flag, value):
    param = next(p for p in main.commands["export"].params if flag in p.opts)
    with pytest.raises(click.BadParameter, match=f"{flag} {value} is not allowed; allowed: "):
        param.type.convert(value, param, None)
    with pytest.raises(Exception, match=f"{flag} {value} is not allowed; allowed: "):
        ExportRecipe(**{param.name: int(value)}, kv_dtype="int8")
