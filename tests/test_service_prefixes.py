"""The service keeps conversations' KV across a restart (`prefix_dir`), says where prefix bytes
sit in /metrics, and the shipped config has the disk tier on. A real server subprocess on
127.0.0.1 (tests/test_serve.py's `Server`) over the tiny exported model."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_serve import Server, run_alone

from kvedge.runtime.model import Model
from kvedge.runtime.prefix import SUFFIX
from kvedge.runtime.prefix_disk import export_folder
from kvedge.serve.config import load_service_config
from kvedge.serve.service import serve_command

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0, "max_tokens": 12}
SYSTEM = "You are the kiosk assistant. Read the log below and answer questions about it. " * 4


@pytest.fixture(scope="module")
def artifact(served_artifact) -> Path:
    return served_artifact  # conftest: max_len 512


def turn(srv: Server, messages: list[dict[str, str]]) -> str:
    body = {"model": "tiny", "messages": messages, **GREEDY}
    response = srv.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def stop(srv: Server) -> None:
    srv.process.send_signal(signal.SIGTERM)
    srv.process.wait(30)
    srv.stop()


def test_a_conversation_is_answered_from_disk_after_a_restart(artifact, tmp_path):
    config = {"slots": 1, "warmup_tokens": 2, "threads": 1, "prefix_dir": str(tmp_path / "prefixes")}
    config["prefix_disk_min_tokens"] = 32
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What failed first?"}]
    with Server(artifact, tmp_path, **config) as srv:
        a.append({"role": "assistant", "content": turn(srv, a)})
        stop(srv)
    written = list((tmp_path / "prefixes").rglob(f"*{SUFFIX}"))  # the prompt, the reply; never the warm-up
    assert len(written) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)
    a.append({"role": "user", "content": "And then?"})
    with Server(artifact, tmp_path, **config) as srv:
        before = srv.metrics()
        assert before["kvedge_prefix_disk_files"] == 2
        assert before["kvedge_prefix_disk_bytes"] == sum(p.stat().st_size for p in written)
        assert before["kvedge_prefix_disk_written_bytes"] == 0 and before["kvedge_ready_seconds"] > 0
        assert before["kvedge_prefix_disk_queued_bytes"] == before["kvedge_prefix_disk_deferred"] == 0
        assert turn(srv, a) == run_alone(Model(artifact, slots=1), a, max_new_tokens=12)[0]
        after = srv.metrics()
        reused = (
            after["kvedge_prefix_cache_hit_tokens_total"] - before["kvedge_prefix_cache_hit_tokens_total"]
        )
        assert reused >= 100, (before, after)


def test_the_switch_turns_the_disk_tier_off(artifact, tmp_path):
    on = load_service_config(None, {"model": artifact, "prefix_dir": tmp_path / "p"}).run_options()
    assert on.prefix_dir == tmp_path / "p" and on.prefix_disk_min_tokens == 64
    off = load_service_config(None, {"model": artifact}).run_options()
    assert off.prefix_dir is None and Model(artifact, off).prefixes.disk is None
    assert not (tmp_path / "p").exists()


def test_the_shipped_config_keeps_prefixes_on_disk_beside_warm_dir():
    shipped = yaml.safe_load((ROOT / "configs/services/default.yaml").read_text())
    assert Path(shipped["prefix_dir"]).parent == Path(shipped["warm_dir"]).parent
    assert shipped["prefix_dir"] != shipped["warm_dir"]


def test_serve_check_reports_the_prefix_files_and_the_refused(artifact, tmp_path):
    folder = tmp_path / "prefixes"
    model = Model(artifact, prefix_dir=folder, prefix_disk_min_tokens=32)
    mine = export_folder(folder, model.manifest.onnx_fingerprint)
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What failed first?"}]
    run_alone(model, a, max_new_tokens=4)
    model.close()
    (mine / "bad.kvw").write_bytes(b"garbage")
    other = folder / "0123456789abcdef"  # another export's subfolder: reported, left alone
    other.mkdir()
    (other / "theirs.kvw").write_bytes(b"x" * 3000)
    report = serve_command(None, {"model": artifact, "prefix_dir": folder}, check=True)
    size = sum(p.stat().st_size for p in mine.glob(f"*{SUFFIX}")) / 2**20
    budget = "of prefix_disk_bytes 1024.0 MiB, on disk, not in memory"
    assert f"2 prefix files ({size:.1f} MiB {budget}) in {mine}, 1 refused and removed: bad.kvw (" in report
    assert "truncated (7 bytes)" in report and not (mine / "bad.kvw").exists()
    line = f"other exports' subfolders of {folder} hold 3000 bytes (0.0 MiB): 1 prefix files in 1 subfolders"
    assert line in report.splitlines() and (other / "theirs.kvw").exists()


def test_kvedge_prefixes_lists_and_clears_the_files(artifact, tmp_path):
    folder = tmp_path / "prefixes"
    model = Model(artifact, prefix_dir=folder, prefix_disk_min_tokens=32)
    mine = model.prefixes.disk.folder
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What failed first?"}]
    run_alone(model, a, max_new_tokens=4)
    held = model.cache.length(0)
    model.close()
    (mine / "bad.kvw").write_bytes(b"garbage")
    other = folder / "0123456789abcdef"  # another export's subfolder
    other.mkdir()
    (other / "theirs.kvw").write_bytes(b"x" * 3000)

    def kvedge(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "kvedge", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = kvedge("prefixes", "list", "--prefix-dir", str(folder)).splitlines()
    good = [line for line in listed if line.startswith(f"{mine.name}/") and "tokens" in line]
    assert len(good) == 2 and sum(int(line.split(": ")[1].split()[0]) for line in good) == held
    assert f"{mine.name}/bad.kvw: unreadable: bad.kvw: truncated (7 bytes), 0.00 MiB" in listed
    assert f"{mine.name}: 3 files, " in "\n".join(listed)
    assert "0123456789abcdef/theirs.kvw: unreadable: " in "\n".join(listed)
    assert "0123456789abcdef: 1 files, 0.00 MiB" in listed
    assert listed[-1].startswith("4 files, ") and listed[-1].endswith(f"MiB in {folder}")
    cleared = kvedge("prefixes", "clear", "--prefix-dir", str(folder))
    assert cleared == f"removed 4 prefix files from {folder}\n"
    assert sorted(folder.iterdir()) == sorted([mine, other])  # the subfolders stay: a service writes there
    assert not list(mine.iterdir()) and not list(other.iterdir())


def test_a_conversation_is_answered_from_disk_after_kill_9(artifact, tmp_path):
    """Each turn's end writes what it added before the reply goes out, so a service killed with
    SIGKILL right after a reply answers the next turn from its files, as a cold run would."""
    config = {"slots": 2, "warmup_tokens": 2, "threads": 1, "prefix_dir": str(tmp_path / "prefixes")}
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What failed first?"}]
    with Server(artifact, tmp_path, **config) as srv:
        a.append({"role": "assistant", "content": turn(srv, a)})
        a.append({"role": "user", "content": "And then?"})
        a.append({"role": "assistant", "content": turn(srv, a)})
        srv.process.kill()
        srv.process.wait(10)
        srv.stop()
    a.append({"role": "user", "content": "What should I check next?"})
    reference = Model(artifact, slots=1)
    second = len(reference.tokenizer.encode_chat(a[:3]))  # the second turn's prompt
    with Server(artifact, tmp_path, **config) as srv:
        before = srv.metrics()
        assert turn(srv, a) == run_alone(reference, a, max_new_tokens=12)[0]
        after = srv.metrics()
    reused = after["kvedge_prefix_cache_hit_tokens_total"] - before["kvedge_prefix_cache_hit_tokens_total"]
    assert reused >= second, (second, reused)  # and its reply, as far as it reads back the same
