"""The systemd unit that starts `kvedge serve` at boot (`configs/kvedge.service` is its default render).

`ExecStartPre` runs `kvedge serve --check`: it validates the service config and loads the model
once, verifying the graph fingerprint, so a broken install fails before the service starts and is
retried by `Restart=on-failure`. stdout and stderr go to the journal (`journalctl -u kvedge`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

UNIT = """\
# kvedge serve at boot. Install and start:
#   sudo cp kvedge.service /etc/systemd/system/ && sudo systemctl daemon-reload
#   sudo systemctl enable --now kvedge      # logs: journalctl -u kvedge -f
# `kvedge serve --config CONFIG --print-systemd-unit` writes this file for the current install.
# A bearer key (required when the config binds a non-loopback host) goes in /etc/kvedge/kvedge.env
# as NAME=value, NAME being the config's api_key_env. The service runs as User, never root; create
# it with `sudo useradd --system --home-dir /nonexistent kvedge`. It reads what export and
# warm-prefixes wrote under umask 022 (folders 0755, files 0644); to let it write warm prefix files
# at boot, give it the config's warm_dir: `sudo install -d -o kvedge -m 0755 WARM_DIR`.
[Unit]
Description=kvedge chatbot service (OpenAI-compatible HTTP API)
After=network.target

[Service]
Type=exec
User={user}
WorkingDirectory={workdir}
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


def render_unit(
    python: str, config: Path | None, workdir: Path, user: str, grace_s: float, flags: Sequence[str] = ()
) -> str:
    """The unit text for `kvedge serve --config CONFIG FLAGS...` (no --config when `config` is
    None); systemd waits `grace_s` (the config's shutdown grace) plus 10 s before SIGKILL."""
    args = ([f"--config {config}"] if config is not None else []) + list(flags)
    return UNIT.format(
        python=python, args=" ".join(args), workdir=workdir, user=user, stop_timeout_s=int(grace_s) + 10
    )
