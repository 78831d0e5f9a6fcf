"""Where a `kvedge bench` run writes: bench/results/<date>-<commit>-<what>/.

A results folder that docs/PERFORMANCE.md cites is committed beside it (bench.json and the run's
log; plots are copied into docs/ when cited), so its name says when and from which code it was
measured: the UTC date, the short git commit of the checkout kvedge ran from (with "-dirty" when
that checkout's tracked files differ from the commit, "v<version>" when kvedge is not run from a
git checkout), and what was measured (the backend and the thread counts, e.g. "cpu-t1-t2").
A name already taken gets "-2", "-3", ...: a run never overwrites an earlier one. Runs not meant
to be kept go under bench/results/scratch/ (`--out`), which git ignores.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import subprocess
from collections.abc import Sequence
from pathlib import Path

RESULTS_ROOT = Path("bench/results")
_PACKAGE = Path(__file__).resolve().parents[1]  # the kvedge package folder that is running


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(_PACKAGE), *args], capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def code_revision() -> str:
    """The short commit of the git checkout kvedge runs from, "-dirty" if its tracked files
    changed since; "v<version>" when kvedge runs from an installed copy (a wheel, or a
    non-editable install inside a checkout, whose files git does not track)."""
    try:
        _git("ls-files", "--error-unmatch", "__init__.py")  # fails outside a checkout, or untracked
        commit = _git("rev-parse", "--short=7", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return f"v{importlib.metadata.version('kvedge')}"
    return f"{commit}-dirty" if dirty else commit


def results_folder(
    device: str,
    threads: Sequence[int],
    root: Path = RESULTS_ROOT,
    today: datetime.date | None = None,
    revision: str | None = None,
) -> Path:
    """A new folder name under `root` for a run on `device` at each of `threads`:
    root/<YYYY-MM-DD>-<revision>-<device>-t<n>[-t<m>...], "-2", "-3", ... added if taken."""
    day = today or datetime.datetime.now(datetime.timezone.utc).date()
    what = "-".join([device, *(f"t{n}" for n in threads)])
    name = f"{day.isoformat()}-{revision or code_revision()}-{what}"
    folder, count = root / name, 1
    while folder.exists():
        count += 1
        folder = root / f"{name}-{count}"
    return folder
