"""Make every artifact the benchmark compares, from one source, once (reused when present).

    <work>/hf/                      the source as a Hugging Face folder (GGUF dequantized to fp32,
                                    saved after clearing transformers' GGUF quantizer marker)
    <work>/kvedge-<variant>-<weights>[-kv<dtype>][-decode-onnxruntime][-L<max_len>]/
                                    `kvedge export` artifacts
    <work>/ort-genai-<precision>/   onnxruntime-genai model builder output (fp32, int4)

A kvedge export is reused only when it is what exporting now would make: its manifest names the
same source fingerprint and every field the export recipe decides (`kvedge.export.export.differences`:
variant, logits, weights, block size, outlier channels, head bits, max_len, cache dtype and group
size), and the export code that built it is this one. The bench writes, next to each export it
makes, `<folder>.export-code`: `export_code_fingerprint()`, a sha256 over kvedge's graph-building
sources (kvedge/export/*.py and kvedge/export/graph/*.py, the contract that declares the graph's
inputs and outputs, kvedge/contract/*.py, and the calibration prompts that choose the outlier
channels) and the kernel library's OPS_VERSION (an "ort" INT8-cache graph names its op). Neither
the kvedge version (not bumped on every change) nor the git commit (blind to uncommitted edits,
and changed by edits that leave graphs alone) tells a stale graph; rebuilding the graph to compare
onnx_fingerprint would be the export itself. Hashing the files errs on the safe side: an edit that
leaves graphs as they were (a comment) costs one re-export, while a missed change would benchmark
an old graph silently. An export without the file (made by hand, or before stamps) is re-exported.
Each re-export logs why.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvedge
from kvedge.contract import MANIFEST_FILE, ExportRecipe, Manifest
from kvedge.errors import ArtifactMismatch
from kvedge.export.export import differences, export_model
from kvedge.export.source import Source, load_hf, resolve_source
from kvedge.runtime.kernels import OPS_VERSION

log = logging.getLogger(__name__)

EXPORT_CODE_SUFFIX = ".export-code"  # <work>/<export folder>.export-code: `export_code_fingerprint()`
# what the exported graph is built by, relative to the kvedge package (module docstring)
EXPORT_CODE = ("export/*.py", "export/graph/*.py", "contract/*.py", "calibrate/data/calibration.jsonl")


def export_code_fingerprint(package: Path = Path(kvedge.__file__).parent) -> str:
    """sha256 over the kernel library's OPS_VERSION and the `EXPORT_CODE` files of `package`
    (each file's path within it, then its bytes' sha256, in path order)."""
    digest = hashlib.sha256(f"OPS_VERSION {OPS_VERSION}\n".encode())
    files = sorted({path for pattern in EXPORT_CODE for path in package.glob(pattern)})
    for path in files:
        digest.update(f"{path.relative_to(package).as_posix()}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@dataclass(frozen=True)
class KvedgeBuild:
    """One kvedge system of the benchmark: the export it runs, and the names it goes by."""

    recipe: ExportRecipe

    @property
    def folder_name(self) -> str:
        r = self.recipe
        suffix = "" if r.max_len == 2048 else f"-L{r.max_len}"
        kv = "" if r.kv_dtype == "float32" else f"-kv{r.kv_dtype}"
        decode = "-decode-onnxruntime" if self.one_form else ""
        return f"kvedge-{r.variant}-{r.weights}{kv}{decode}{suffix}"

    @property
    def system_name(self) -> str:
        r = self.recipe
        kv = "" if r.kv_dtype == "float32" else f" kv {r.kv_dtype}"
        return f"kvedge {r.variant} {r.weights}{kv}" + (" decode onnxruntime" if self.one_form else "")

    @property
    def one_form(self) -> bool:
        """An ort int8/int4 export asked for without its decode form (`--decode-matmuls
        onnxruntime`); the names say so, the default two-form export's do not."""
        return self.recipe.decode_matmuls == "onnxruntime"


class Workdir:
    """Loads the source at most once and builds what is missing under `root`."""

    def __init__(self, root: Path, source_path: str | Path | None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.source: Source = resolve_source(source_path)
        self.export_code = export_code_fingerprint()
        self._loaded: tuple[Any, Any] | None = None

    def loaded(self) -> tuple[Any, Any]:
        if self._loaded is None:
            self._loaded = load_hf(self.source)
        return self._loaded

    def kvedge(self, build: KvedgeBuild) -> Path:
        out, recipe = self.root / build.folder_name, build.recipe
        why = self.stale(out, recipe)
        if why is None:
            return out
        log.info("exporting %s: %s", out, why)
        export_model(self.source.description, out, recipe, loaded=self.loaded(), force=True)
        export_code_file(out).write_text(self.export_code + "\n")
        return out

    def stale(self, out: Path, recipe: ExportRecipe) -> str | None:
        """Why the export in `out` is not what exporting `recipe` now would make (module
        docstring), or None when it is."""
        if not (out / MANIFEST_FILE).is_file():
            return "no export there yet"
        try:
            manifest = Manifest.load(out)
        except ArtifactMismatch as exc:  # e.g. an older manifest format
            return str(exc)
        if manifest.source_fingerprint != self.source.fingerprint():
            return (
                f"made from source {manifest.source_fingerprint[:16]}, the source is "
                f"{self.source.fingerprint()[:16]}"
            )
        if found := differences(recipe, manifest):
            return "; ".join(found)
        stamp = export_code_file(out)
        if not stamp.is_file():
            return f"no {stamp.name}: made by unknown export code"
        made_by = stamp.read_text().strip()
        if made_by != self.export_code:
            return f"made by export code {made_by[:16]}, this kvedge's is {self.export_code[:16]}"
        return None

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


def export_code_file(export: Path) -> Path:
    """Where the bench records which export code made `export` (module docstring)."""
    return export.with_name(export.name + EXPORT_CODE_SUFFIX)
