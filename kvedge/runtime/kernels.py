"""kvedge's compiled onnxruntime kernels: where the library is and whether it is the right one.

The library (`kvedge/runtime/csrc/kvedge_ops.cc`) holds `kvedge.Int8CacheAttention`, the
attention of "ort" graphs over an INT8 cache (`kvedge export --variant ort --kv-dtype int8`),
`kvedge.Int4CacheAttention`, the same over a 4-bit cache with a float window (`kvedge.kv4`, its
numpy twin; no export builds it yet), `kvedge.SideInputs`, the block sums and kept channels of
"ort" graphs' quantized matmuls (`--weights int8|int4`), and `kvedge.QuantMatMul`, a decode
step's quantized matmul with both fused in (which graphs hold which: `kvedge.contract.kvedge_ops`).
`pip install` builds it next to this module with the machine's C++ compiler (setup.py); nothing else in kvedge
needs it, so an install without a compiler still works for every other graph.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

from kvedge.errors import KvedgeError

# Bumped with every change to the kernel's inputs, outputs or arithmetic; the library reports its
# own (kvedge_ops_version) and a stale build is refused rather than run.
OPS_VERSION = 9
LIBRARY_STEM = "_kvedge_ops"


@functools.cache
def library_path(here: Path = Path(__file__).parent) -> Path:
    """The built kernel library in `here` (where setup.py builds it), checked against OPS_VERSION.
    The one this Python built: one source tree installed into venvs of several Pythons (3.10, 3.11,
    3.12) holds a library per Python, named by its extension suffix, and another's may be stale."""
    found = [here / f"{LIBRARY_STEM}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    found = [path for path in found if path.is_file()]
    if not found:
        raise KvedgeError(
            f"this graph uses kvedge's own onnxruntime kernels (the INT8-cache attention of --kv-dtype "
            f"int8, the quantized matmuls' side inputs of --weights int8|int4), but their library "
            f"({LIBRARY_STEM}{importlib.machinery.EXTENSION_SUFFIXES[0]}) is not built in {here}: "
            "reinstall kvedge where a C++17 compiler is present (`pip install -e .` builds it), or "
            "export with --variant portable"
        )
    path = found[0]
    try:
        version = ctypes.CDLL(str(path)).kvedge_ops_version()
    except (OSError, AttributeError) as exc:
        raise KvedgeError(f"{path} is not a usable kvedge kernel library: {exc}") from exc
    if version != OPS_VERSION:
        raise KvedgeError(
            f"{path} is kernel library version {version}, this kvedge needs {OPS_VERSION}: "
            "rebuild it (`pip install -e .`)"
        )
    return path
