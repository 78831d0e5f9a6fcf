"""`RunOptions`: everything a `Model` is loaded with, in one frozen type, parsed once at the edge.

The CLI's flags (`kvedge generate`, `chat`, `warm-prefixes`), the service config
(`ServiceConfig.run_options`) and the benchmark build one and hand it to `Model(folder, options)`;
nothing maps the same options field by field twice. Invalid values and combinations fail when it
is made, naming the option and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta

from kvedge.configs import WarmPrefixConfig, load_warm_prefix_config
from kvedge.contract.engine import DEVICES
from kvedge.declare import Flag
from kvedge.errors import KvedgeError
from kvedge.runtime.backends.memory import KV_MEMORY, check_kv_memory
from kvedge.runtime.sessions import HistoryPolicy

# the options of the backend and its cache, which a draft model loaded beside it shares
BACKEND_FIELDS = ("slots", "threads", "device", "kv_memory", "cuda_graph", "verify")


@dataclass(frozen=True)
class RunOptions:
    """How a model runs: its backend and cache, its history policy, the prefixes it keeps and the
    draft model its turns may speculate with."""

    # sequences the cache holds at once (a service's concurrent conversations)
    slots: Annotated[
        int, Meta(ge=1, le=256), Flag("KV slots preallocated at start-up = conversations served at once.")
    ] = 1
    threads: Annotated[
        Annotated[int, Meta(ge=1, le=1024)] | None,
        Meta(description="an integer >= 1, or null for all cores"),
        Flag("onnxruntime intra-op threads (default: all cores)."),
    ] = None
    device: Annotated[
        Literal[DEVICES],
        Meta(description=f"one of {list(DEVICES)}"),
        Flag("cpu or cuda (onnxruntime), or tensorrt (the folder's model.engine)."),
    ] = "cpu"
    kv_memory: Annotated[
        Literal[KV_MEMORY],
        Meta(description=f"one of {list(KV_MEMORY)}"),
        Flag(
            "GPU devices: where the KV cache pool lives: mapped (pinned host memory the GPU reads "
            "in place; default) or device (GPU memory, copied where the CPU needs it). docs/JETSON.md."
        ),
    ] = "mapped"
    policy: HistoryPolicy = field(default_factory=HistoryPolicy)  # conversations longer than the cache
    prefix_cache_bytes: Annotated[
        int,
        Meta(ge=0, le=2**50, description="a number of bytes >= 0 (0 = off)"),
        Flag(
            "In-memory store of conversation prefixes seen at run time, kept when their slot goes "
            "to another conversation (`RunTimePrefixStore`); 0: off.",
        ),
    ] = 0
    # run-time prefixes written to disk when they leave memory (`PrefixDisk`), in this export's
    # subfolder (`export_folder`); None: off
    prefix_dir: Annotated[
        Path | None,
        Meta(description="a folder for run-time prefix files, or null (off)"),
        Flag(
            "Folder where conversations' KV is written as turns end and read back after a "
            "restart (kvedge.runtime.prefix_disk), one subfolder per export; none: off."
        ),
    ] = None
    prefix_disk_bytes: Annotated[
        int,
        Meta(ge=1, le=2**50, description="a number of bytes >= 1"),
        Flag("The budget of each export's prefix folder; least recently used removed first."),
    ] = 1 << 30
    prefix_disk_min_tokens: Annotated[
        int,
        Meta(ge=1, le=1_000_000, description="an integer >= 1"),
        Flag("Prefixes shorter than this are never written (flash wear)."),
    ] = 64
    warm_prefixes: Annotated[
        WarmPrefixConfig | None,
        Flag(
            "Warm-prefix YAML (configs/warmup/): fixed prompts whose KV is kept in the warm "
            "folder (rebuilt there if missing).",
            given_as=Annotated[Path | None, Meta(description="a warm-prefix YAML file, or null")],
            read=load_warm_prefix_config,
        ),
    ] = None
    warm_dir: Annotated[
        Path | None,
        Meta(description="a folder for warm prefix files, or null"),
        Flag("Folder of the warm prefix files (needed with warm prefixes)."),
    ] = None
    # loaded with the model, never in the middle of a request
    draft: Annotated[
        Path | None,
        Meta(description="an export folder, or null"),
        Flag(
            "An export with the same tokenizer (e.g. --weights int4 of the same model), loaded "
            "with the model, whose proposals the model verifies (speculate draft)."
        ),
    ] = None
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

    def backend_options(self) -> RunOptions:
        """These options' backend and cache only (`BACKEND_FIELDS`): what a draft loads with."""
        return RunOptions(**{name: getattr(self, name) for name in BACKEND_FIELDS})
