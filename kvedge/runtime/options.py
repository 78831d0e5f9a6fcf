"""`RunOptions`: everything a `Model` is loaded with, in one frozen type, parsed once at the edge.

The CLI's flags (`kvedge generate`, `chat`, `warm-prefixes`), the service config
(`ServiceConfig.run_options`) and the benchmark build one and hand it to `Model(folder, options)`;
nothing maps the same options field by field twice. Invalid values and combinations fail when it
is made, naming the option and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvedge.configs import WarmPrefixConfig
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.memory import check_kv_memory
from kvedge.runtime.sessions import HistoryPolicy


@dataclass(frozen=True)
class RunOptions:
    """How a model runs: its backend and cache, its history policy, the prefixes it keeps and the
    draft model its turns may speculate with."""

    slots: int = 1  # sequences the cache holds at once (a service's concurrent conversations)
    threads: int | None = None  # onnxruntime intra-op threads; None: all cores
    device: str = "cpu"  # contract.engine.DEVICES: onnxruntime CPU or CUDA, or the folder's TensorRT engine
    # GPU devices: the cache pool in mapped pinned host memory ("mapped") or GPU memory ("device")
    kv_memory: str = "mapped"
    policy: HistoryPolicy = field(default_factory=HistoryPolicy)  # conversations longer than the cache
    prefix_cache_bytes: int = (
        0  # run-time prefixes kept when their slot is taken (`RunTimePrefixStore`); 0: off
    )
    # run-time prefixes written to disk when they leave memory (`PrefixDisk`), in this export's
    # subfolder (`export_folder`); None: off
    prefix_dir: Path | None = None
    prefix_disk_bytes: int = 1 << 30  # budget of this export's files, least recently used removed first
    prefix_disk_min_tokens: int = 64  # shorter prefixes are never written (flash wear)
    warm_prefixes: WarmPrefixConfig | None = None  # fixed prompts whose KV is loaded from `warm_dir`
    warm_dir: Path | None = None
    # an export with the same tokenizer whose proposals turns may verify (speculate="draft"),
    # loaded with the model: never in the middle of a request
    draft: Path | None = None
    cuda_graph: bool = False  # capture the decode step as a CUDA graph (cuda only)
    verify: bool = True  # check the graph's fingerprint against the manifest at load

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or self.slots < 1:
            raise KvedgeError(f"slots={self.slots!r} is not allowed; allowed: an integer >= 1")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise KvedgeError(f"threads={self.threads!r} is not allowed; allowed: an integer >= 1, or None")
        check_kv_memory(self.kv_memory, self.device)
        if not isinstance(self.prefix_cache_bytes, int) or self.prefix_cache_bytes < 0:
            raise KvedgeError(
                f"prefix_cache_bytes={self.prefix_cache_bytes!r} is not allowed; allowed: an integer >= 0"
            )
        for name in ("prefix_disk_bytes", "prefix_disk_min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KvedgeError(f"{name}={value!r} is not allowed; allowed: an integer >= 1")
        if self.warm_prefixes is not None and self.warm_dir is None:
            raise KvedgeError("warm prefixes need a warm folder (--warm-dir)")
