"""The service as a Jetson runs it: what root exports, a system user serves.

1. Modes (any user): export folders and files, warm prefix files and the temporary entries they
   are renamed from have the modes a plain mkdir / open give, 0777 / 0666 less the umask
   (kvedge/files.py says why): 0755 / 0644 under the usual umask 022, private under 077.
2. The systemd unit (root only, as CI runs): root exports a tiny model and computes one warm
   prefix under umask 022; a new system user then runs the unit's ExecStartPre and ExecStart
   command lines, parsed from `kvedge serve --print-systemd-unit`, through `runuser`, in the
   unit's WorkingDirectory, with systemd's environment (the user's HOME, nothing inherited). The
   service loads root's warm file, writes the second one itself, and a chat request to 127.0.0.1
   answers 200 with the text the model gives in-process; a model folder the user may not read is
   then refused in one line. The user and its files are removed afterwards. The unit's
   SupplementaryGroups (the GPU groups this machine has: on a Jetson the GPU's device nodes are
   video's, 0660) are given to those command lines as systemd gives them.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import MAX_LEN
from tiny import make_tiny_model

from kvedge.configs import load_warm_prefix_config
from kvedge.contract import ExportRecipe
from kvedge.export.export import export_model
from kvedge.files import new_file, new_folder
from kvedge.runtime.generate import SamplingConfig
from kvedge.runtime.model import Model
from kvedge.serve.service import systemd_unit
from kvedge.serve.systemd import GPU_GROUPS, gpu_groups, group_exists, render_unit

SYSTEM = "You are the assistant of a Jetson."  # the prefix root computes
SECOND = "Answer in one word."  # the prefix the service user computes at boot
WARMUP = {
    "prefixes": [
        {"name": "root-made", "messages": [{"role": "system", "content": SYSTEM}]},
        {"name": "service-made", "messages": [{"role": "system", "content": SECOND}]},
    ]
}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    """Set the process umask for one test; restored after it."""
    before = os.umask(0o022)

    def set_to(value: int) -> None:
        os.umask(value)

    yield set_to
    os.umask(before)


@pytest.mark.parametrize(
    ("mask", "folder", "file"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640), (0o077, 0o700, 0o600)]
)
def test_new_entries_take_the_umask_like_mkdir_and_open(tmp_path, umask, mask, folder, file):
    umask(mask)
    made = new_folder(tmp_path, ".out.")
    fd, path = new_file(tmp_path, ".w.", ".tmp")
    os.close(fd)
    assert made.name.startswith(".out.") and path.name.startswith(".w.") and path.name.endswith(".tmp")
    assert (mode(made), mode(path)) == (folder, file)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert mode(plain) == folder  # the same as mkdir


def test_export_and_warm_files_are_readable_by_others_under_umask_022(tmp_path, umask):
    umask(0o022)
    source = make_tiny_model(tmp_path / "hf", "qwen2", seed=3)
    out = tmp_path / "out"
    export_model(source, out, ExportRecipe(max_len=MAX_LEN))
    assert mode(out) == 0o755, oct(mode(out))
    assert {f.name: mode(f) for f in out.iterdir()} == {f.name: 0o644 for f in out.iterdir()}
    (tmp_path / "warm.yaml").write_text(yaml.safe_dump(WARMUP))
    warm = tmp_path / "warm"
    Model(
        out, warm_prefixes=load_warm_prefix_config(tmp_path / "warm.yaml"), warm_dir=warm
    )  # writes both files
    assert {f.name: mode(f) for f in warm.iterdir()} == {"root-made.kvw": 0o644, "service-made.kvw": 0o644}


# --- 2. the unit's command lines as another user (root only) ---------------------------------


def test_the_unit_gives_its_user_the_gpu_groups_this_machine_has():
    assert gpu_groups(lambda name: name == "video") == ("video",)  # a machine without render
    assert gpu_groups(lambda name: True) == GPU_GROUPS == ("video", "render")
    none = render_unit("/usr/bin/python3", None, Path("/opt/kvedge"), "kvedge", 10, groups=())
    assert "SupplementaryGroups" not in unit_lines(none)  # systemd fails a unit naming a group it lacks
    here = tuple(name for name in GPU_GROUPS if group_exists(name))
    unit = unit_lines(systemd_unit(None, {"model": "model"}))
    assert unit.get("SupplementaryGroups", "") == " ".join(here)
    assert (
        unit_lines((Path(__file__).parents[1] / "configs/kvedge.service").read_text())["SupplementaryGroups"]
        == "video"
    )


def why_not_root() -> str | None:
    if os.geteuid() != 0:
        return "needs root, to create a system user and run as it (CI runs as root)"
    missing = [tool for tool in ("runuser", "useradd", "userdel") if shutil.which(tool) is None]
    return f"needs {', '.join(missing)} (util-linux / passwd)" if missing else None


def as_user(user: str, argv: list[str], cwd: Path, groups: str = "", **kwargs) -> subprocess.Popen:
    """`argv` as `user` the way systemd starts a unit's command: in its WorkingDirectory, with
    the user's HOME (runuser sets it from passwd), the unit's SupplementaryGroups (`groups`,
    space-separated) and nothing of this process's environment but a PATH."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}
    runuser = shutil.which("runuser")
    supplementary = [flag for group in groups.split() for flag in ("-G", group)]
    return subprocess.Popen(
        [runuser, "-u", user, *supplementary, "--", *argv], cwd=cwd, env=env, text=True, **kwargs
    )


def ran_as(
    user: str, argv: list[str], cwd: Path, timeout: float = 300, groups: str = ""
) -> subprocess.CompletedProcess:
    process = as_user(user, argv, cwd, groups, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def blocked_at(path: Path) -> Path | None:
    """The first folder on the way to `path` that others may not enter, if any."""
    for folder in [*reversed(path.parents), path]:
        if folder.is_dir() and not mode(folder) & stat.S_IXOTH:
            return folder
    return None


def let_through(user: str, path: Path) -> list[Path]:
    """Give `user` (and no one else) the right to pass through the folders on the way to `path`
    that others may not enter, by a POSIX ACL (setfacl, package `acl`): how CI lets the unit's
    user run a pyenv interpreter kept under root's private home. Returns the folders, to undo."""
    if shutil.which("setfacl") is None:
        return []
    granted = [f for f in [*reversed(path.parents)] if f.is_dir() and not mode(f) & stat.S_IXOTH]
    for folder in granted:
        subprocess.run(["setfacl", "-m", f"u:{user}:x", str(folder)], check=True)
    return granted


def service_python(user: str, deploy: Path, granted: list[Path]) -> str:
    """A python `user` can run that imports this checkout's kvedge: this venv's when its
    interpreter is reachable (through an ACL where `setfacl` exists, recorded in `granted`),
    else a venv in `deploy` on the system python of the same version, seeing this venv's
    packages (a pyenv interpreter under root's private home is not)."""
    probe = ["-c", "import kvedge.serve.service"]
    if ran_as(user, [sys.executable, *probe], deploy).returncode == 0:
        return sys.executable
    for private in {Path(sys.executable).resolve(), Path(sys.prefix)}:
        granted += let_through(user, private)
    if granted and ran_as(user, [sys.executable, *probe], deploy).returncode == 0:
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = shutil.which(version, path="/usr/local/bin:/usr/bin")
    blocked = blocked_at(Path(sys.executable).resolve())
    if base is None:
        pytest.skip(
            f"{user} cannot run {sys.executable} ({blocked} is private) and there is no system {version}"
        )
    venv = deploy / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    ours = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    (site / "checkout.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
    tried = ran_as(user, [str(venv / "bin/python"), *probe], deploy)
    if tried.returncode != 0:
        pytest.skip(
            f"{user} cannot import this checkout's kvedge (private folder: {blocked_at(ours)}): "
            + tried.stderr[-300:]
        )
    return str(venv / "bin/python")


@pytest.fixture
def system_user() -> Iterator[str]:
    """A new system user standing in for the unit's `kvedge` (useradd --system, in video where
    that exists, as the unit's header says), deleted afterwards; a fresh name, so no real kvedge
    user is touched."""
    why = why_not_root()
    if why:
        pytest.skip(why)
    name = f"kvedge-ci-{secrets.token_hex(3)}"
    video = ["--groups", "video"] if group_exists("video") else []
    user_tool(
        "useradd", "--system", *video, "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name
    )
    try:
        yield name
    finally:
        user_tool("userdel", name)


def user_tool(*args: str) -> None:
    """useradd / userdel, again while another holds /etc/passwd's lock (their exit 10): CI runs
    this test under two Pythons at once (.ci/run)."""
    for _ in range(20):
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 10:
            break
        time.sleep(0.5)
    assert done.returncode == 0, (args, done.returncode, done.stderr)


@pytest.fixture
def granted(system_user: str) -> Iterator[list[Path]]:
    """Folders `let_through` opened to the unit's user: their ACL entries go before the user."""
    folders: list[Path] = []
    yield folders
    for folder in folders:
        subprocess.run(["setfacl", "-x", f"u:{system_user}", str(folder)], check=True)


@pytest.fixture
def deploy() -> Iterator[Path]:
    """An install folder like /opt/kvedge: made by root with mkdir's modes (0755 under umask 022).
    Not pytest's tmp_path, whose /tmp/pytest-of-root is private to root."""
    before = os.umask(0o022)
    folder = Path(tempfile.mkdtemp(prefix="kvedge-service-"))
    folder.chmod(0o777 & ~0o022)
    try:
        yield folder
    finally:
        os.umask(before)
        shutil.rmtree(folder, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit_lines(text: str) -> dict[str, str]:
    """The unit's `Key=value` lines (each key once in kvedge's unit)."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def test_the_unit_serves_as_its_user_what_root_exported(system_user, granted, deploy, tmp_path):
    source = make_tiny_model(tmp_path / "hf", "qwen2", seed=3)
    python = service_python(system_user, deploy, granted)
    root_runs = {"capture_output": True, "text": True, "timeout": 300, "cwd": deploy}
    done = subprocess.run(
        [python, "-m", "kvedge", "export", str(source), "--out", "model", "--max-len", str(MAX_LEN)],
        **root_runs,
    )
    assert done.returncode == 0, done.stderr
    (deploy / "warmup.yaml").write_text(yaml.safe_dump({"prefixes": WARMUP["prefixes"][:1]}))
    args = ["--model", "model", "--warm-prefixes", "warmup.yaml", "--warm-dir", "warm"]
    done = subprocess.run([python, "-m", "kvedge", "warm-prefixes", *args], **root_runs)
    assert done.returncode == 0, done.stderr
    (deploy / "warmup.yaml").write_text(yaml.safe_dump(WARMUP))  # the second prefix: the service's to make
    (deploy / "warm").chmod(0o755)
    shutil.chown(deploy / "warm", user=system_user)  # the service user's folder, root's file inside
    port = free_port()
    config = {
        "model": "model",
        "model_name": "tiny",
        "port": port,
        "slots": 1,
        "threads": 1,
        "warm_prefixes": "warmup.yaml",
        "warm_dir": "warm",
        "warmup_tokens": 0,
    }
    (deploy / "service.yaml").write_text(yaml.safe_dump(config))

    printed = subprocess.run(
        [python, "-m", "kvedge", "serve", "--config", "service.yaml", "--print-systemd-unit"], **root_runs
    )
    assert printed.returncode == 0, printed.stderr
    unit = unit_lines(printed.stdout)
    assert unit["User"] == "kvedge" and Path(unit["WorkingDirectory"]) == deploy  # root printed it
    groups = unit.get("SupplementaryGroups", "")
    member_of = ran_as(system_user, ["id", "-Gn"], deploy, groups=groups).stdout.split()
    assert set(groups.split()) <= set(member_of), member_of
    check = ran_as(system_user, shlex.split(unit["ExecStartPre"]), deploy, groups=groups)
    assert check.returncode == 0 and check.stdout.startswith("ok: "), check.stderr
    assert "2 warm prefixes" in check.stdout
    made = deploy / "warm/service-made.kvw"
    assert made.owner() == system_user and mode(made) == 0o644

    log = tmp_path / "service.log"
    with open(log, "w") as sink:
        service = as_user(
            system_user, shlex.split(unit["ExecStart"]), deploy, groups, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert service.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "warm prefixes: 2 loaded, 0 recomputed" in log.read_text()  # root's file and its own
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        events = list(Model(deploy / "model").chat(messages, SamplingConfig(max_new_tokens=6)))
        assert text and text == "".join(e.text for e in events)
    finally:
        service.terminate()
        service.wait(timeout=30)
    (deploy / "model").chmod(0o700)  # as a umask of 077 would have left it: one line, no traceback
    refused = ran_as(system_user, shlex.split(unit["ExecStartPre"]), deploy)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
    assert f"manifest.json: Permission denied for user {system_user} (docs/JETSON.md" in refused.stderr
