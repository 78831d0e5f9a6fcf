"""What device_tests/ needs before a test can even be collected: pytest, onnxruntime and kvedge's
runtime, importable by the Python that runs them. `run.sh` prints each one missing with the line
that installs it (and stops only without pytest); conftest.py skips every test with the same
lines. Imports nothing at module level but the standard library, so any Python can run it:

    python device_tests/preflight.py      # exit 2 without pytest, else 0
"""

from __future__ import annotations

import importlib
import sys

# module -> (what to import, the one-line fix). onnxruntime-gpu is installed after kvedge: a later
# `pip install .` puts the CPU onnxruntime back (docs/JETSON.md, step 1).
INSTALL = "pip install '.[serve,jp6]' (jp7 on JetPack 7.2, then onnxruntime-gpu: docs/JETSON.md step 1)"
NEEDS = {
    "pytest": ("pytest", "pip install pytest (kvedge's device-tests extra)"),
    "onnxruntime": ("onnxruntime", INSTALL),
    "kvedge": ("kvedge.runtime.model", INSTALL),
}


def missing() -> list[str]:
    """One line per module this Python cannot import: what failed, and the fix."""
    lines = []
    for name, (module, fix) in NEEDS.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # an ImportError, or a wheel built against another numpy
            lines.append(
                f"{name} is not importable by {sys.executable} ({type(exc).__name__}: {exc}): "
                f"{sys.executable} -m {fix}, or run with the Python kvedge is installed in "
                "(activate its venv, or PYTHON=/opt/kvedge/.venv/bin/python)"
            )
    return lines


if __name__ == "__main__":
    found = missing()
    for line in found:
        print(f"device_tests: {line}")
    sys.exit(2 if any(line.startswith("pytest ") for line in found) else 0)
