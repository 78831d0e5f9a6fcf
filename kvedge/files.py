"""Artifacts another user reads: new files and folders with the modes a plain open / mkdir give.

kvedge writes each artifact (an export folder, a warm prefix file, a TensorRT engine) under a
temporary name beside its final one and renames it into place, so a reader never sees half of
it. `tempfile.mkdtemp` / `mkstemp` would make those entries owner-only (0700 / 0600): right for a
shared /tmp, wrong here, since the service reads them as its own user (configs/kvedge.service,
`User=kvedge`) and would get "Permission denied" on manifest.json. So the temporary entries are
created with modes 0777 (folders) and 0666 (files), which the kernel reduces by the process's
umask, exactly as for `mkdir` or `open(..., "w")`:

    umask 022 (the usual default)  -> folders 0755, files 0644: the service user reads them
    umask 077 (chosen privacy)     -> folders 0700, files 0600: kept private, as asked

The umask is respected rather than overridden because it is the user's stated policy (weights can
be private); docs/JETSON.md says what the service user needs. Nothing here reads or changes the
umask (os.umask is process-wide, so reading it means setting it, racing other threads).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

FOLDER_MODE = 0o777  # before the umask
FILE_MODE = 0o666
MiB, GiB = 1 << 20, 1 << 30
_ATTEMPTS = 100  # 32 random bits per name: a clash is a stale leftover, not chance


def new_folder(parent: Path, prefix: str) -> Path:
    """A new folder `parent`/`prefix`<random>, mode 0777 less the umask."""
    for _ in range(_ATTEMPTS):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=FOLDER_MODE)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name {prefix}* in {parent} after {_ATTEMPTS} tries")


def new_file(parent: Path, prefix: str, suffix: str = "", mode: int = FILE_MODE) -> tuple[int, Path]:
    """A new, empty file `parent`/`prefix`<random>`suffix` open for writing (its descriptor and
    path), `mode` (0666: what a plain open gives) less the umask."""
    for _ in range(_ATTEMPTS):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        except FileExistsError:
            continue
        return fd, path
    raise FileExistsError(f"no free name {prefix}*{suffix} in {parent} after {_ATTEMPTS} tries")


def human(n: int) -> str:
    """A byte count as people read it: GiB, MiB or bytes."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if abs(n) >= MiB else f"{n:,} B"
