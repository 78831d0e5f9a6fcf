"""Make every artifact the benchmark compares, from one source, once (reused when present).

    <work>/hf/                      the source as a Hugging Face folder (GGUF dequantized to fp32,
                                    saved after clearing transformers' GGUF quantizer marker)
    <work>/kvedge-<variant>-<weights>[-L<max_len>]/   `kvedge export` artifacts
    <work>/ort-genai-<precision>/   onnxruntime-genai model builder output (fp32, int4)

An artifact is reused when its manifest names the same source fingerprint and options.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvedge.contract import MANIFEST_FILE, Manifest
from kvedge.errors import ArtifactMismatch
from kvedge.export.export import ExportOptions, export_model
from kvedge.export.source import Source, load_hf, resolve_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvedgeBuild:
    variant: str
    weights: str
    max_len: int = 2048
    block_size: int = 32
    kv_dtype: str = "float32"

    @property
    def folder_name(self) -> str:
        suffix = "" if self.max_len == 2048 else f"-L{self.max_len}"
        kv = "" if self.kv_dtype == "float32" else f"-kv{self.kv_dtype}"
        return f"kvedge-{self.variant}-{self.weights}{kv}{suffix}"

    @property
    def system_name(self) -> str:
        kv = "" if self.kv_dtype == "float32" else f" kv {self.kv_dtype}"
        return f"kvedge {self.variant} {self.weights}{kv}"


class Workdir:
    """Loads the source at most once and builds what is missing under `root`."""

    def __init__(self, root: Path, source_path: str | Path | None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.source: Source = resolve_source(source_path)
        self._loaded: tuple[Any, Any] | None = None

    def loaded(self) -> tuple[Any, Any]:
        if self._loaded is None:
            self._loaded = load_hf(self.source)
        return self._loaded

    def kvedge(self, build: KvedgeBuild) -> Path:
        out = self.root / build.folder_name
        options = ExportOptions(
            max_len=build.max_len,
            variant=build.variant,
            weights=build.weights,
            block_size=build.block_size,
            kv_dtype=build.kv_dtype,
            force=True,
        )
        if (out / MANIFEST_FILE).is_file() and (manifest := _loadable(out)) is not None:
            if (
                manifest.source_fingerprint == self.source.fingerprint()
                and manifest.variant == build.variant
                and manifest.weights_dtype == build.weights
                and manifest.geometry.max_len == build.max_len
                and manifest.geometry.dtype == build.kv_dtype
            ):
                return out
        log.info("exporting %s", out)
        export_model(self.source.description, out, options, loaded=self.loaded())
        return out

    def hf_folder(self) -> Path:
        """The source as an HF folder (what transformers and the onnxruntime-genai builder read)."""
        out = self.root / "hf"
        if (out / "config.json").is_file():
            return out
        if not self.source.gguf_file:
            return self.source.folder
        model, tokenizer = self.loaded()
        # transformers refuses to save a model that carries its GGUF quantizer marker; the
        # weights are already dequantized to fp32, so the marker is all there is to clear.
        for attr in ("hf_quantizer", "is_quantized"):
            if hasattr(model, attr):
                delattr(model, attr)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return out

    def ort_genai(self, precision: str) -> Path:
        """onnxruntime-genai's own model builder, CPU, `precision` fp32 or int4 (its defaults)."""
        out = self.root / f"ort-genai-{precision}"
        if (out / "genai_config.json").is_file():
            return out
        hf = self.hf_folder()
        cmd = [
            sys.executable,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(hf),
            "-o",
            str(out),
            "-p",
            precision,
            "-e",
            "cpu",
            "-c",
            str(self.root / "ort-genai-cache"),
        ]
        log.info("building %s: %s", out, " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return out


def _loadable(folder: Path) -> Manifest | None:
    """The folder's manifest, or None where this kvedge refuses it (an older format): re-export."""
    try:
        return Manifest.load(folder)
    except ArtifactMismatch as exc:
        log.info("re-exporting %s: %s", folder, exc)
        return None
