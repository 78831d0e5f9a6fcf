"""The systemd unit that starts `kvedge serve` at boot (`configs/kvedge.service` is its default
render), and the notify protocol the service speaks to it (`Notifier`).

`ExecStartPre` runs `kvedge serve --check`: it validates the service config and loads the model
once, verifying the graph fingerprint, so a broken install fails before the service starts and is
retried by `Restart=on-failure`. stdout and stderr go to the journal (`journalctl -u kvedge`).

`Type=notify`: kvedge says READY=1 only once it is warm (weights loaded, warm prefixes in, warm-up
steps run: when /health turns 200), and the scheduler thread pings WATCHDOG=1 as it loops, so a
scheduler that stops stepping for `WatchdogSec` is killed and restarted whatever the cause. A failed
scheduler ends the process non-zero, which `Restart=on-failure` restarts too.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

UNIT = """\
# kvedge serve at boot. Install and start:
#   sudo cp kvedge.service /etc/systemd/system/ && sudo systemctl daemon-reload
#   sudo systemctl enable --now kvedge      # logs: journalctl -u kvedge -f
# `kvedge serve --config CONFIG --print-systemd-unit` writes this file for the current install.
# A bearer key (required when the config binds a non-loopback host) goes in /etc/kvedge/kvedge.env
# as NAME=value, NAME being the config's api_key_env. The service runs as User, never root; create
# it with `sudo useradd --system --home-dir /nonexistent --groups video kvedge` (and
# `sudo usermod -aG render kvedge` where a render group exists). The GPU's device nodes are group
# video on a Jetson (mode 0660), so SupplementaryGroups names those of video and render the
# rendering machine has; `kvedge doctor` names a GPU group the user lacks. It reads what export and
# warm-prefixes wrote under umask 022 (folders 0755, files 0644); to let it write warm prefix files
# at boot, give it the config's warm_dir: `sudo install -d -o kvedge -m 0755 WARM_DIR`, and to keep
# conversations across restarts, its prefix_dir: `sudo install -d -o kvedge -m 0700 PREFIX_DIR`.
[Unit]
Description=kvedge chatbot service (OpenAI-compatible HTTP API)
After=network.target

[Service]
# notify: started means warm (READY=1 once /health is 200). Loading twice (the check, then the
# service) may take minutes on a small board, hence the start timeout. The scheduler pings the
# watchdog every round and every second while idle: no ping for WatchdogSec means it hangs.
Type=notify
NotifyAccess=main
TimeoutStartSec=900
WatchdogSec=60
User={user}
{groups}WorkingDirectory={workdir}
Environment=PYTHONUNBUFFERED=1
EnvironmentFile=-/etc/kvedge/kvedge.env
ExecStartPre={python} -m kvedge serve {args} --check
ExecStart={python} -m kvedge -v serve {args}
Restart=on-failure
RestartSec=5
KillSignal=SIGTERM
TimeoutStopSec={stop_timeout_s}
StandardOutput=journal
StandardError=journal
SyslogIdentifier=kvedge

[Install]
WantedBy=multi-user.target
"""


# The groups that own GPU device nodes: L4T's nvhost, nvmap and nvgpu nodes are video's (0660),
# a DRM render node render's. Ollama's installer adds its user to both for the same reason.
GPU_GROUPS = ("video", "render")


def group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def gpu_groups(exists: Callable[[str], bool] = group_exists) -> tuple[str, ...]:
    """The `GPU_GROUPS` this machine has. systemd fails a unit whose SupplementaryGroups names a
    group that does not exist (216/GROUP), so the unit names only these."""
    return tuple(name for name in GPU_GROUPS if exists(name))


def render_unit(
    python: str,
    config: Path | None,
    workdir: Path,
    user: str,
    grace_s: float,
    flags: Sequence[str] = (),
    groups: Sequence[str] = ("video",),  # every Debian and Ubuntu has video (base-passwd's gid 44)
) -> str:
    """The unit text for `kvedge serve --config CONFIG FLAGS...` (no --config when `config` is
    None), run as `user` with the supplementary `groups`; systemd waits `grace_s` (the config's
    shutdown grace) plus 10 s before SIGKILL."""
    args = ([f"--config {config}"] if config is not None else []) + list(flags)
    return UNIT.format(
        python=python,
        args=" ".join(args),
        workdir=workdir,
        user=user,
        groups=f"SupplementaryGroups={' '.join(groups)}\n" if groups else "",
        stop_timeout_s=int(grace_s) + 10,
    )


class Notifier:
    """systemd's notify protocol (sd_notify(3)), without libsystemd: datagrams to $NOTIFY_SOCKET
    (a path, or an abstract socket written with a leading @). Silent when not started by systemd
    with Type=notify; a message that cannot be sent is logged once, never raised: the service
    runs without its supervisor rather than not at all."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        # the watchdog's timeout, when it is this process's (WATCHDOG_PID, if set, says whose)
        usec, pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID")
        ours = usec.isdigit() and int(usec) > 0 and pid in (None, str(os.getpid()))
        # pinged at half the timeout, as sd_watchdog_enabled(3) advises; None: no watchdog
        self.watchdog_interval_s = int(usec) / 2e6 if ours else None
        self._last_ping = float("-inf")
        self._failed = False
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self.address else None

    @property
    def heartbeat_s(self) -> float | None:
        """How often the caller of `watchdog` should call it at least: half a ping interval, so
        pings are never more than 0.75 x the watchdog's timeout apart."""
        return None if self.watchdog_interval_s is None else self.watchdog_interval_s / 2

    def send(self, message: str) -> None:
        if self._socket is None:
            return
        try:
            self._socket.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)

    def ready(self) -> None:
        self.send("READY=1\nSTATUS=ready")

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=draining")

    def watchdog(self) -> None:
        """A ping, at most every `watchdog_interval_s` (called as often as the scheduler loops)."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_s:
            self._last_ping = now
            self.send("WATCHDOG=1")
