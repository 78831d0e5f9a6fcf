"""`kvedge.serve.config`: what the service config refuses at load (more cases in tests/test_serve.py)."""

from __future__ import annotations

import pytest

from kvedge.contract import MANIFEST_FILE
from kvedge.errors import KvedgeError
from kvedge.serve.config import load_service_config


@pytest.fixture()
def model(tmp_path):
    """A folder `load_service_config` takes for an export (it checks only that the manifest is there)."""
    (tmp_path / MANIFEST_FILE).write_text("{}")
    return tmp_path


@pytest.mark.parametrize(
    "key,held",
    [
        ("sécret-key", "a non-ASCII character"),
        ("ключ", "a non-ASCII character"),
        ("two words", "a space or a control character"),
        ("tab\there", "a space or a control character"),
        ("bell\x07", "a space or a control character"),
    ],
)
def test_api_key_an_http_header_cannot_carry_is_refused_without_showing_it(model, key, held):
    lan = {"model": model, "host": "0.0.0.0", "api_key_env": "KVEDGE_API_KEY"}
    with pytest.raises(KvedgeError) as info:
        load_service_config(None, lan, environ={"KVEDGE_API_KEY": key})
    message = str(info.value)
    assert message.startswith("--api-key-env='KVEDGE_API_KEY': the key that environment variable holds")
    assert f"has {held} (the key is not shown)" in message
    assert "allowed: printable ASCII characters, no spaces" in message
    assert key not in message


@pytest.mark.parametrize(
    "key", ["secret", " secret \n", "A-z0.9_~+/==", "sk-Proj_0123456789abcdef", "p@ss;w0rd!"]
)
def test_api_key_of_printable_ascii_is_taken(model, key):
    lan = {"model": model, "host": "0.0.0.0", "api_key_env": "KVEDGE_API_KEY"}
    assert load_service_config(None, lan, environ={"KVEDGE_API_KEY": key}).api_key == key.strip()


def test_an_unquoted_speculate_off_is_off(model, tmp_path):
    """YAML 1.1 reads `speculate: off` as false; the service once refused it (speculate=False)."""
    path = tmp_path / "svc.yaml"
    path.write_text(f"model: {model}\nspeculate: off\n")
    assert load_service_config(path, {}).speculate == "off"


def test_sampling_defaults_and_run_options_come_from_the_config(model, tmp_path):
    path = tmp_path / "svc.yaml"
    path.write_text(
        f"model: {model}\ntemperature: 0.7\ntop_k: 40\nhistory_policy: window\nn_sink: 8\nslots: 3\n"
    )
    config = load_service_config(path, {})
    assert config.sampling_defaults == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 40,
        "repetition_penalty": 1.0,
    }
    options = config.run_options()
    assert (options.slots, options.policy.mode, options.policy.n_sink) == (3, "window", 8)
    assert config.run_options(slots=1).slots == 1
    path.write_text(f"model: {model}\nrepetition_penalty: 0.001\n")
    with pytest.raises(
        KvedgeError, match=r"repetition_penalty=0.001 is not allowed; allowed: a number in \[0.01, 10\]"
    ):
        load_service_config(path, {})
