"""The disk tier of run-time prefixes (`kvedge.runtime.prefix_disk`), against cold prefills.

A conversation's KV leaves memory (the model closes, its slot is taken, the LRU evicts it), a new
`Model` over the same folder reads the index, and the next turn reuses the file and gives the
logits of a full prefill from an empty slot. Each export keeps its files in its own subfolder of
the folder, and leaves another export's alone. Damaged files, and another export's moved into this
one's subfolder, are refused, named in one log line and removed, and the turn prefills cold.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import flip_byte, random_ids, truncate, zero_fill
from tiny import make_tiny_model

from kvedge.contract import CacheGeometry, ExportRecipe
from kvedge.errors import KvedgeError
from kvedge.export.export import export_model
from kvedge.runtime.cache import KVBlock
from kvedge.runtime.generate import SamplingConfig, prefill
from kvedge.runtime.model import Model
from kvedge.runtime.prefix import SUFFIX, file_identity, read_warm_header
from kvedge.runtime.prefix_disk import PrefixDisk, export_folder, reader
from kvedge.runtime.sessions import HistoryPolicy

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


def files(folder, live=None) -> list:
    """The prefix files in the folder and its export subfolders, first segment first; with `live`
    (a Model or a PrefixDisk), once the files it queued are written."""
    disk = live.prefixes.disk if isinstance(live, Model) else live
    if disk is not None:
        disk.flush()
    return sorted(folder.rglob(f"*{SUFFIX}"), key=lambda p: (read_warm_header(p).start, p.name))


@pytest.mark.parametrize("export,atol", [("out", ATOL), ("int8", 2e-3)])  # int8: tests/test_kv_int8.py's
def test_conversation_survives_a_restart_exactly(llama, tmp_path, export, atol):
    model = boot(llama, tmp_path / "prefixes", export)
    a = talk(model)
    held = model.cache.length(0)
    model.close()
    written = files(tmp_path / "prefixes")  # the prompt and the reply, as the turn ended
    assert len(written) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)
    subfolder = export_folder(tmp_path / "prefixes", model.manifest.onnx_fingerprint)
    assert {p.parent for p in written} == {subfolder} and stat.S_IMODE(subfolder.stat().st_mode) == 0o700
    again = boot(llama, tmp_path / "prefixes", export)
    assert len(again.prefixes.disk) == 2
    ids = again.tokenizer.encode_chat(a)
    logits = again.prepare(0, ids)
    assert again.prefixes.disk.hits == 1 and again.sessions[0].reused_tokens == held
    np.testing.assert_allclose(logits, cold_logits(llama, ids, export), atol=atol, rtol=0)


def test_each_token_is_written_once_as_the_conversation_grows(llama, tmp_path):
    """Each turn's end writes its prompt past the chain's last file it extends, then its reply
    after it; the next turn's prompt follows the reply where the template renders the reply as
    it was generated, else the prompt; nothing is left to write when another conversation takes
    the slot; a restart restores the chain exactly."""
    model = boot(llama, tmp_path)
    a = talk(model)
    held = model.cache.length(0)
    first = {read_warm_header(p).start: p for p in files(tmp_path, model)}  # turn 1's prompt, its reply
    assert len(first) == 2 and read_warm_header(first[max(first)]).parent == first[0].name
    rendered = model.tokenizer.encode_chat(a)
    follows_reply = list(rendered[:held]) == [int(t) for t in model.cache.token_ids(0)[:held]]
    a.append({"role": "assistant", "content": "".join(e.text for e in model.chat(a, GREEDY))})
    written = [p for p in files(tmp_path, model) if p not in first.values()]  # turn 2's prompt, its reply
    assert len(written) == 2
    prompt, reply = sorted(written, key=lambda p: read_warm_header(p).start)
    assert read_warm_header(prompt).parent == first[max(first) if follows_reply else 0].name
    assert read_warm_header(reply).parent == prompt.name
    held = model.cache.length(0)
    model.prepare(0, model.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))  # B takes the slot
    assert model.keep_prefixes() == 0  # B is under the threshold; A was written as its turns ended
    chain, link = [], reply
    while link is not None:  # the last reply's chain holds the slot, each token once
        chain.insert(0, read_warm_header(link))
        link = next((p for p in files(tmp_path, model) if p.name == chain[0].parent), None)
    assert [h.start for h in chain] == list(np.cumsum([0] + [h.count for h in chain[:-1]]))
    assert sum(h.count for h in chain) == held
    assert sum(h.data_bytes for h in chain) == held * model.manifest.geometry.bytes_per_token()
    assert sum(p.stat().st_size for p in files(tmp_path, model)) == model.prefixes.disk.bytes_written
    model.close()
    a.append({"role": "user", "content": "And why keep it on disk?"})
    again = boot(llama, tmp_path)
    ids = again.tokenizer.encode_chat(a)
    np.testing.assert_allclose(again.prepare(0, ids), cold_logits(llama, ids), atol=ATOL, rtol=0)
    assert again.prefixes.disk.hits == 1 and again.sessions[0].reused_tokens >= read_warm_header(reply).start


def test_a_turns_end_queues_its_files_and_never_waits_on_the_disk(llama, tmp_path, monkeypatch):
    """The scheduler's thread copies a turn's KV and goes on; the writer thread writes and fsyncs."""
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(threading.current_thread().name), fsync(fd)))
    model = boot(llama, tmp_path)
    talk(model)
    assert len(files(tmp_path, model)) == 2 and synced == ["kvedge-prefix-writer"] * 2
    model.close()


def test_the_writers_queue_is_bounded_and_a_deferred_turn_is_written_by_the_next(
    llama, tmp_path, monkeypatch
):
    """While the disk stalls, the copies queued for the writer stay within `queue_bytes` (one
    slot's KV): a turn ending past it queues nothing (`deferred`); its conversation's next turn
    writes those tokens too (from where its last file ends: here, none), and a restart restores
    them exactly."""
    go, fsync = threading.Event(), os.fsync

    def stalled(fd: int) -> None:  # a disk that stops answering until `go`
        if threading.current_thread().name == "kvedge-prefix-writer":
            assert go.wait(120)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", stalled)
    model = boot(llama, tmp_path, slots=2)
    disk = model.prefixes.disk
    slot_bytes = disk.queue_bytes
    assert slot_bytes == model.manifest.geometry.bytes_per_slot()
    talk(model, slot=0)  # A's prompt and reply queued, the first being written
    disk.queue_bytes = disk.queued_bytes  # as far behind as the writer may be
    b = [{"role": "system", "content": "Queues, B says. " * 12}, {"role": "user", "content": "Why?"}]
    b.append({"role": "assistant", "content": "".join(e.text for e in model.chat(b, GREEDY, slot=1))})
    assert disk.deferred == 2 and disk.queued_bytes == disk.queue_bytes  # B's prompt and reply
    go.set()
    disk.flush()
    disk.queue_bytes = slot_bytes
    a_files = files(tmp_path)
    assert len(a_files) == 2
    b.append({"role": "user", "content": "And then?"})
    b.append({"role": "assistant", "content": "".join(e.text for e in model.chat(b, GREEDY, slot=1))})
    held = model.cache.length(1)
    b_files = [read_warm_header(p) for p in files(tmp_path, model) if p not in a_files]
    assert b_files[0].start == 0 and sum(h.count for h in b_files) == held  # B's whole turn 1 too
    model.close()
    b.append({"role": "user", "content": "Thanks."})
    again = boot(llama, tmp_path)
    ids = again.tokenizer.encode_chat(b)
    np.testing.assert_allclose(again.prepare(0, ids), cold_logits(llama, ids), atol=ATOL, rtol=0)
    assert again.sessions[0].reused_tokens >= held - b_files[-1].count  # B's files, from its turn 1
    assert again.prefixes.disk.hits == 1
    c = [
        {"role": "system", "content": "C. " * 40},
        {"role": "user", "content": "Hi"},
    ]  # shares the template's start
    again.prepare(0, again.tokenizer.encode_chat(c))
    assert again.prefixes.disk.hits == 1  # a match shorter than prefix_disk_min_tokens is not read


def test_lru_evictions_go_to_disk_and_come_back_exactly(llama, tmp_path):
    model = boot(llama, tmp_path, prefix_cache_bytes=2**16)
    a = talk(model)
    for i in range(3):  # other users push A out of the slot, then out of the LRU
        other = [{"role": "system", "content": f"User {i}. " * 40}, {"role": "user", "content": "Hello"}]
        model.prepare(0, model.tokenizer.encode_chat(other))
    model.prefixes.disk.flush()
    assert model.prefixes.run_time.evictions and model.prefixes.disk.bytes_written
    ids = model.tokenizer.encode_chat(a)
    np.testing.assert_allclose(model.prepare(0, ids), cold_logits(llama, ids), atol=ATOL, rtol=0)
    assert model.prefixes.disk.hits == 1


def test_files_are_checked_ahead_and_a_file_changed_since_is_checked_again(llama, tmp_path, caplog):
    """At load a background thread checks every file in full (`PrefixDisk.check_ahead`), so the
    turn that needs one copies it without hashing it; the check is keyed to the file's identity
    (inode, size, modification time), so a file written to since is checked again and refused."""
    model = boot(llama, tmp_path)
    talk(model)
    model.close()
    again = boot(llama, tmp_path)
    again.prefixes.disk._ahead.join(timeout=60)
    paths = files(tmp_path)
    assert {file_identity(p.stat()) for p in paths} == again.prefixes.disk.checked
    root, reply = (again.prefixes.disk.entries[p.name] for p in paths)
    status = paths[0].stat()
    flip_byte(paths[0])
    os.utime(paths[0], ns=(status.st_atime_ns, status.st_mtime_ns))  # the same identity
    assert again.prefixes.disk.load(root, len(root.token_ids)) is not None  # taken as checked: no hash
    time.sleep(0.02)  # past the file system's clock tick
    flip_byte(paths[1])
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
        assert again.prefixes.disk.load(reply, len(reply.token_ids)) is None
    assert "checksum mismatch" in caplog.text and not paths[1].exists()
    disk = again.prefixes.disk
    again.close()
    assert not disk._ahead.is_alive()


def test_the_byte_budget_removes_the_least_recently_used_files(llama, tmp_path):
    model = boot(llama, tmp_path)
    talk(model)
    model.close()
    size = files(tmp_path, model)[0].stat().st_size
    model = boot(llama, tmp_path, prefix_disk_bytes=2 * size + size // 2)  # room for two
    first = files(tmp_path, model)[0]
    for i in range(3):
        other = [{"role": "system", "content": f"User {i}. " * 20}, {"role": "user", "content": "Hello"}]
        model.prepare(0, model.tokenizer.encode_chat(other))
        model.prepare(0, model.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
        assert model.prefixes.disk.nbytes <= 2 * size + size // 2
        assert sum(p.stat().st_size for p in files(tmp_path, model)) == model.prefixes.disk.nbytes
    assert not first.exists() and len(files(tmp_path, model)) == 2


def test_the_disk_tier_is_off_without_a_folder_and_its_options_are_checked(llama, tmp_path):
    assert Model(llama / "out").prefixes.disk is None
    with pytest.raises(KvedgeError, match=r"prefix_disk_bytes=0 is not allowed; allowed: an integer >= 1"):
        boot(llama, tmp_path, prefix_disk_bytes=0)
    with pytest.raises(KvedgeError, match=r"prefix_disk_min_tokens='8' is not allowed"):
        boot(llama, tmp_path, prefix_disk_min_tokens="8")


def test_clear_removes_every_file(llama, tmp_path):
    model = boot(llama, tmp_path)
    talk(model)
    model.close()
    again = boot(llama, tmp_path)
    assert again.prefixes.disk.clear() == 2 and not files(tmp_path)


# -- crash safety: each damage refused, named in one line, removed, and the turn prefilled cold --


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
    path = files(tmp_path)[0]  # the first segment: the second goes with it
    damage(path)
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
        again = boot(llama, tmp_path)
        ids = again.tokenizer.encode_chat(a)
        logits = again.prepare(0, ids)
    lines = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0] and "refused" in lines[0], lines
    assert again.prefixes.disk.hits == 0 and again.sessions[0].reused_tokens == 0
    np.testing.assert_allclose(logits, cold_logits(llama, ids), atol=ATOL, rtol=0)


def test_another_exports_files_are_left_alone_and_unused(llama, tmp_path, caplog):
    """Two exports of one model share a prefix_dir: each keeps its files in its own subfolder,
    boots with only those, and never refuses or removes the other's."""
    model = boot(llama, tmp_path)
    a = talk(model)
    model.close()
    mine = files(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
        other = boot(llama, tmp_path, "int8")
        b = talk(other)  # conversation A again: the first export's files are not used
        assert len(other.prefixes.disk) == 2 and other.prefixes.disk.hits == 0  # its prompt and reply
        folder = other.prefixes.disk.folder
        other.close()
    theirs = [p for p in files(tmp_path) if p not in mine]
    assert len(theirs) == 2 and {p.parent for p in theirs} == {folder} and mine[0].parent != folder
    for export, kept, messages in (("out", mine, a), ("int8", theirs, b)):
        with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
            again = boot(llama, tmp_path, export)
            assert {e.path for e in again.prefixes.disk.entries.values()} == set(kept)
            ids = again.tokenizer.encode_chat(messages)
            logits = again.prepare(0, ids)
        assert again.prefixes.disk.hits == 1 and not again.prefixes.disk.refused
        atol = ATOL if export == "out" else 2e-3
        np.testing.assert_allclose(logits, cold_logits(llama, ids, export), atol=atol, rtol=0)
    assert not [r for r in caplog.records if r.name == "kvedge.runtime.prefix_disk"]
    assert all(p.exists() for p in mine + theirs)


def test_a_file_moved_in_from_another_exports_subfolder_is_refused_and_removed(llama, tmp_path, caplog):
    model = boot(llama, tmp_path)
    a = talk(model)
    model.close()
    root = files(tmp_path)[0]  # the first segment, in this export's subfolder
    int8 = boot(llama, tmp_path, "int8")
    theirs = export_folder(tmp_path, int8.manifest.onnx_fingerprint)
    int8.close()
    moved = theirs / root.name
    shutil.move(root, moved)
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
        other = boot(llama, tmp_path, "int8")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvedge.runtime.prefix_disk"]
    assert root.name in line and "refused" in line and "graph" in line and "this model's is" in line
    assert not moved.exists() and not list(theirs.iterdir()) and len(other.prefixes.disk) == 0
    assert len(files(tmp_path)) == 1  # the first export's second segment, left in its subfolder
    other.prepare(0, other.tokenizer.encode_chat(a))
    assert other.sessions[0].reused_tokens == 0


# -- writers that die or run out of space, on a small geometry (no model needed) --

WRITER = """
import resource, signal, sys
import numpy as np
from pathlib import Path
from kvedge.contract import CacheGeometry
from kvedge.runtime.cache import KVBlock
from kvedge.runtime.prefix_disk import PrefixDisk, export_folder, reader
from kvedge.runtime.sessions import HistoryPolicy
geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
if len(sys.argv) > 2:  # a full disk: files may not grow past this many bytes
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
disk = PrefixDisk(Path(sys.argv[1]), 6 * 2**15, geometry, "model", "graph", min_tokens=8)
for i in range(10**6):
    ids = list(range(1000 * i, 1000 * i + 40))  # each run is its own: nothing extends another
    disk.save(ids, reader(KVBlock(np.full((2, 2, 2, 40, 16), i, np.float32))))
    disk.flush()  # the writer thread's write, or its failure
    if any(e.token_ids[0] == 1000 * i for e in disk.entries.values()):
        print("written", i, flush=True)
    elif len(sys.argv) > 2:
        print("refused", i, flush=True)
        break
"""


def small_disk(folder) -> PrefixDisk:
    geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
    return PrefixDisk(folder, 6 * 2**15, geometry, "model", "graph", min_tokens=8)


def test_kill_9_in_a_loop_while_writing_never_leaves_a_wrong_file(tmp_path):
    rng = np.random.default_rng(0)
    for _ in range(12):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE)
        time.sleep(float(rng.uniform(0.6, 1.2)))  # python and numpy start, then writes
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        disk = small_disk(tmp_path)
        assert not disk.refused and len(disk) and disk.nbytes <= 6 * 2**15
        for entry in list(disk.entries.values()):
            (prefix,) = disk.load(entry, len(entry.token_ids))
            assert (prefix.block.kv == entry.token_ids[0] // 1000).all()


def test_a_full_disk_drops_the_prefix_and_leaves_no_file(tmp_path, caplog):
    done = subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp_path), "10000"], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-1] == "refused 0", done.stdout + done.stderr
    assert "not written (File too large); prefix dropped" in done.stderr
    assert not list(tmp_path.iterdir())  # neither a file nor a temp left


def test_a_prefix_larger_than_the_whole_budget_is_not_written(tmp_path):
    geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
    disk = PrefixDisk(tmp_path, 20000, geometry, "model", "graph", min_tokens=8)
    assert not disk.save(range(40), reader(KVBlock(np.zeros((2, 2, 2, 40, 16), np.float32))))  # 20480 bytes
    assert disk.save(range(30), reader(KVBlock(np.zeros((2, 2, 2, 30, 16), np.float32))))
    assert not disk.save(
        range(7), reader(KVBlock(np.zeros((2, 2, 2, 7, 16), np.float32)))
    )  # under min_tokens
    assert [len(e.token_ids) for e in disk.entries.values()] == [30] and disk.nbytes <= 20000


@pytest.mark.parametrize(
    "damage,reason",
    [(flip_byte, "checksum mismatch"), (lambda p: p.unlink(), "the file before it, {root}, is missing")],
)
def test_a_segment_after_a_damaged_or_missing_file_is_refused_with_it(
    llama, tmp_path, caplog, damage, reason
):
    model = boot(llama, tmp_path)
    a = talk(model)
    a.append({"role": "assistant", "content": "".join(e.text for e in model.chat(a, GREEDY))})
    model.close()
    root, *after = files(tmp_path)
    damage(root)
    a.append({"role": "user", "content": "And why keep it on disk?"})
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.prefix_disk"):
        again = boot(llama, tmp_path)
        ids = again.tokenizer.encode_chat(a)
        logits = again.prepare(0, ids)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and reason.format(root=root.name) in refused[0], refused
    assert again.sessions[0].reused_tokens == 0 and not any(p.exists() for p in after)
    np.testing.assert_allclose(logits, cold_logits(llama, ids), atol=ATOL, rtol=0)


def test_a_prefix_dir_that_cannot_be_made_leaves_the_model_serving_from_memory(llama, tmp_path, caplog):
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="kvedge.runtime.model"):
        model = boot(llama, tmp_path / "file" / "prefixes")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"prefix_dir {tmp_path / 'file' / 'prefixes'}: ") and "memory only" in line
    assert model.prefixes.disk is None and talk(model)


def test_a_windowed_or_tampered_slot_is_never_written(llama, tmp_path):
    """A slot whose window dropped tokens holds KV that is not its tokens' from position 0, and
    one whose record no longer matches its session is suspect: neither goes to disk."""
    model = boot(llama, tmp_path, policy=HistoryPolicy(mode="window"), slots=2)
    model.prepare(0, random_ids(600, seed=1))  # max_len 512: the window evicts as it prefills
    assert model.sessions[0].evicted and not files(tmp_path, model)
    a = talk(model, slot=1)
    model.prefixes.disk.clear()
    model.cache.tokens[1, 3] += 1  # the record no longer matches what the session left
    assert model.keep_prefixes() == 0 and not files(tmp_path, model) and a


def test_a_segment_whose_first_files_the_budget_cannot_keep_beside_it_is_not_written(tmp_path):
    geometry = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, max_len=128)
    disk = PrefixDisk(tmp_path, 20000, geometry, "model", "graph", min_tokens=8)
    block = KVBlock(np.zeros((2, 2, 2, 40, 16), np.float32))  # 512 bytes a token
    assert disk.save(range(30), reader(block.head(30)))  # 15,360 bytes of data
    assert not disk.save(range(40), reader(block))  # its segment (5,120) does not fit beside it
    assert not files(tmp_path, disk) and len(disk) == 0 and disk.nbytes == 0
