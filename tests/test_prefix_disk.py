"""The disk tier of run-time prefixes (`kvedge.runtime.prefix_disk`), against cold prefills.

A conversation's KV leaves memory (the model closes, its slot is taken, the LRU evicts it), a new
`Model` over the same folder reads the index, and the next turn reuses the file and gives the
logits of a full prefill from an empty slot. Damaged or foreign files are refused, named in one
log line and removed, and the turn prefills cold.
"""

from __future__ import annotations

import logging
import stat

import numpy as np
import pytest
from tiny import make_tiny_model

from kvedge.contract import ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.generate import SamplingConfig, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import SUFFIX

ATOL = 1e-4  # fp32 both sides, same graph (tests/test_sessions.py)
GREEDY = SamplingConfig(max_new_tokens=8)
SYSTEM = "You are assistant A on a kiosk. Answer in one short sentence. " * 3
MIN_TOKENS = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    source = make_tiny_model(root / "hf", "llama", seed=3)
    export_model(source, root / "out", ExportRecipe(max_len=512))
    export_model(source, root / "int8", ExportRecipe(max_len=512, kv_dtype="int8"))
    return root


def boot(llama, folder, export: str = "out", **fields) -> Model:
    fields.setdefault("prefix_disk_min_tokens", MIN_TOKENS)
    return Model(llama / export, prefix_dir=folder, **fields)


def talk(model: Model, slot: int = 0) -> list[dict[str, str]]:
    """One turn of conversation A in `slot`; the messages of its next turn."""
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]
    a.append({"role": "assistant", "content": "".join(e.text for e in model.chat(a, GREEDY, slot=slot))})
    a.append({"role": "user", "content": "And why keep it on disk?"})
    return a


def cold_logits(llama, ids: list[int], export: str = "out") -> np.ndarray:
    reference = Model(llama / export)
    return prefill(reference.backend, reference.cache, 0, [ids])[0]


def files(folder) -> list:
    return sorted(folder.glob(f"*{SUFFIX}"))


@pytest.mark.parametrize("export,atol", [("out", ATOL), ("int8", 2e-3)])  # int8: tests/test_kv_int8.py's
def test_conversation_survives_a_restart_exactly(llama, tmp_path, export, atol):
    model = boot(llama, tmp_path / "prefixes", export)
    a = talk(model)
    held = model.cache.length(0)
    model.close()
    (path,) = files(tmp_path / "prefixes")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = boot(llama, tmp_path / "prefixes", export)
    assert len(again.prefix_disk) == 1
    ids = again.tokenizer.encode_chat(a)
    logits = again.prepare(0, ids)
    assert again.prefix_disk.hits == 1 and again.sessions[0].reused_tokens == held
    np.testing.assert_allclose(logits, cold_logits(llama, ids, export), atol=atol, rtol=0)


def test_a_taken_slot_is_written_once_and_short_prefixes_never(llama, tmp_path):
    model = boot(llama, tmp_path)
    a = talk(model)
    model.prepare(0, model.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))  # B takes the slot
    (path,) = files(tmp_path)
    first = model.prefix_disk.bytes_written
    assert first == path.stat().st_size
    assert model.keep_prefixes() == 0  # B is under the threshold, A is on disk already
    ids = model.tokenizer.encode_chat(a)
    np.testing.assert_allclose(model.prepare(0, ids), cold_logits(llama, ids), atol=ATOL, rtol=0)
    assert model.prefix_disk.hits == 1
    assert model.keep_prefixes() == 1 and model.keep_prefixes() == 0  # A's longer run replaces its head
    (longer,) = files(tmp_path)
    assert longer != path and model.prefix_disk.bytes_written == first + longer.stat().st_size
    model.close()
    assert files(tmp_path) == [longer]


def test_lru_evictions_go_to_disk_and_come_back_exactly(llama, tmp_path):
    model = boot(llama, tmp_path, prefix_cache_bytes=2**16)
    a = talk(model)
    for i in range(3):  # other users push A out of the slot, then out of the LRU
        other = [{"role": "system", "content": f"User {i}. " * 40}, {"role": "user", "content": "Hello"}]
        model.prepare(0, model.tokenizer.encode_chat(other))
    assert model.prefix_lru.evictions and model.prefix_disk.bytes_written
    ids = model.tokenizer.encode_chat(a)
    np.testing.assert_allclose(model.prepare(0, ids), cold_logits(llama, ids), atol=ATOL, rtol=0)
    assert model.prefix_disk.hits == 1


def test_the_byte_budget_removes_the_least_recently_used_files(llama, tmp_path):
    model = boot(llama, tmp_path)
    talk(model)
    model.close()
    size = files(tmp_path)[0].stat().st_size
    model = boot(llama, tmp_path, prefix_disk_bytes=2 * size + size // 2)  # room for two
    first = files(tmp_path)[0]
    for i in range(3):
        other = [{"role": "system", "content": f"User {i}. " * 20}, {"role": "user", "content": "Hello"}]
        model.prepare(0, model.tokenizer.encode_chat(other))
        model.prepare(0, model.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
        assert model.prefix_disk.nbytes <= 2 * size + size // 2
        assert sum(p.stat().st_size for p in files(tmp_path)) == model.prefix_disk.nbytes
    assert not first.exists() and len(files(tmp_path)) == 2


def test_the_disk_tier_is_off_without_a_folder_and_its_options_are_checked(llama, tmp_path):
    assert Model(llama / "out").prefix_disk is None
    with pytest.raises(KvedgeError, match=r"prefix_disk_bytes=0 is not allowed; allowed: an integer >= 1"):
        boot(llama, tmp_path, prefix_disk_bytes=0)
    with pytest.raises(KvedgeError, match=r"prefix_disk_min_tokens='8' is not allowed"):
        boot(llama, tmp_path, prefix_disk_min_tokens="8")


def test_clear_removes_every_file(llama, tmp_path):
    model = boot(llama, tmp_path)
    talk(model)
    model.close()
    again = boot(llama, tmp_path)
    assert again.prefix_disk.clear() == 1 and not files(tmp_path)


# -- crash safety: each damage refused, named in one line, removed, and the turn prefilled cold --


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def zero_fill(path):  # a power cut: the size was written, the data never were
    path.write_bytes(bytes(path.stat().st_size))


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,reason",
    [
        (truncate, "bytes, header promises"),
        (zero_fill, "is not 'KVEDGEWM'"),
        (flip_byte, "checksum mismatch"),
    ],
)
def test_a_damaged_file_is_refused_and_the_turn_prefilled_cold(llama, tmp_path, caplog, damage, reason):
    model = boot(llama, tmp_path)
    a = talk(model)
    model.close()
    (path,) = files(tmp_path)
    damage(path)
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
        again = boot(llama, tmp_path)
        ids = again.tokenizer.encode_chat(a)
        logits = again.prepare(0, ids)
    lines = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0] and "refused" in lines[0], lines
    assert again.prefix_disk.hits == 0 and again.sessions[0].reused_tokens == 0
    np.testing.assert_allclose(logits, cold_logits(llama, ids), atol=ATOL, rtol=0)


def test_a_file_of_another_export_is_refused_at_boot(llama, tmp_path, caplog):
    model = boot(llama, tmp_path)
    a = talk(model)
    model.close()
    (path,) = files(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
        other = boot(llama, tmp_path, "int8")
    (line,) = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert "graph" in line and "this model's is" in line
    assert len(other.prefix_disk) == 0 and not path.exists()
    ids = other.tokenizer.encode_chat(a)
    other.prepare(0, ids)
    assert other.sessions[0].reused_tokens == 0
