"""The tiny artifacts device_tests/ runs on: made on an x86 machine with the export extra, copied
to the device, which needs only the runtime (`pip install '.[serve]'`: a Jetson has no torch,
transformers or onnx; PyPI's aarch64 torch does not run on L4T).

    make device-artifacts                       # x86: python device_tests/artifacts.py --out device_artifacts
    rsync -a device_artifacts/ orin:/opt/kvedge/device_artifacts/      # the line it prints
    device_tests/run.sh device_artifacts        # on the device, in /opt/kvedge

The folder: one kvedge export per entry of EXPORTS, each from a tiny random model of
`tests/tiny.py` (SOURCES: family and seed; a tiny llama, or for the hybrid models' tests one of
each hybrid family, `source_of`), `pool_reader.onnx` (test_pool_placement's one-node ReduceSum
graph) and `index.json`:

    {"format": FORMAT, "kvedge": <version>, "sources": SOURCES, "exports": {<name>: <recipe>},
     "files": {"pool_reader": "pool_reader.onnx"}}

A test takes its copy of an artifact (`take`): from $KVEDGE_DEVICE_ARTIFACTS where set (an index
of another format, or a recipe other than this checkout's, is refused naming both), else exported
here where torch is importable; `missing` says why neither is possible, and the tests skip with
it. TensorRT engines are never in the folder: they are per device, built there from the exports.
The tests compare against onnxruntime on the CPU, so no Hugging Face reference data is carried.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

ENV = "KVEDGE_DEVICE_ARTIFACTS"
TARGET = "make device-artifacts"
FORMAT = 2
INDEX_FILE = "index.json"
# the tiny models the exports are made from: a llama, and one model of each hybrid family (seed 4,
# as tests/test_hybrid.py's)
SOURCES = {
    "llama": {"family": "llama", "seed": 0},
    "lfm2": {"family": "lfm2", "seed": 4},
    "qwen3_5": {"family": "qwen3_5", "seed": 4},
}
EXPORTS = {  # name -> ExportRecipe options; an export named "<SOURCES key>-..." is of that model
    "portable-2048": {"max_len": 2048},
    "ort16-2048": {"max_len": 2048, "variant": "ort", "kv_dtype": "float16"},
    "portable-128": {"max_len": 128},
    "float16-128": {"max_len": 128, "precision": "float16"},
    "float16-2048": {"max_len": 2048, "precision": "float16"},
    "lfm2-256": {"max_len": 256},
    "qwen3_5-256": {"max_len": 256},
}
POOL_READER = "pool_reader.onnx"
FILES = {"pool_reader": POOL_READER}


def missing() -> str | None:
    """Why the tests can have no artifacts here, or None: the folder $KVEDGE_DEVICE_ARTIFACTS
    names has no index, or it is unset and torch (to export them here) is not importable."""
    folder = os.environ.get(ENV)
    if folder:
        if not (Path(folder) / INDEX_FILE).is_file():
            return f"{ENV}={folder} has no {INDEX_FILE}: make the folder with `{TARGET}` on an x86 machine"
        return None
    if importlib.util.find_spec("torch") is None:
        return (
            f"no device artifacts: {ENV} is unset and torch is not installed to export them here; "
            f"run `{TARGET}` on an x86 machine with the export extra, copy the folder over and set {ENV}"
        )
    return None


def take(name: str, into: Path) -> Path:
    """Artifact `name` (an EXPORTS name or POOL_READER) as a path under `into`, a copy the test
    may write in (engines, timing caches): from $KVEDGE_DEVICE_ARTIFACTS, else exported here."""
    folder = os.environ.get(ENV)
    if not folder:
        return make_one(name, into)
    index = _index(Path(folder))
    if name in EXPORTS and index["exports"].get(name) != EXPORTS[name]:
        raise ValueError(
            f"{folder}/{INDEX_FILE} has {name} as {index['exports'].get(name)}, this checkout's recipe is "
            f"{EXPORTS[name]}: remake the folder with `{TARGET}` from this checkout"
        )
    if name in EXPORTS and (made := index["sources"].get(source_of(name))) != SOURCES[source_of(name)]:
        raise ValueError(
            f"{folder}/{INDEX_FILE} made {name} from {made}, this checkout from "
            f"{SOURCES[source_of(name)]}: remake the folder with `{TARGET}` from this checkout"
        )
    copy = into / name
    if (Path(folder) / name).is_dir():
        shutil.copytree(Path(folder) / name, copy)
    else:
        shutil.copyfile(Path(folder) / name, copy)
    return copy


def source_of(name: str) -> str:
    """The SOURCES key export `name` is made from."""
    return next((key for key in SOURCES if name.startswith(f"{key}-")), "llama")


def _index(folder: Path) -> dict:
    index = json.loads((folder / INDEX_FILE).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(
            f"{folder}/{INDEX_FILE} is format {index.get('format')}, this checkout reads format {FORMAT}: "
            f"remake the folder with `{TARGET}`"
        )
    return index


def make_one(name: str, into: Path) -> Path:
    """Export artifact `name` into `into`/`name` (needs the export extra: torch, transformers, onnx)."""
    out = into / name
    if name == POOL_READER:
        _write_pool_reader(out)
        return out
    from kvedge.contract import ExportRecipe
    from kvedge.export.export import export_model

    export_model(_source(into, source_of(name)), out, ExportRecipe(**EXPORTS[name]))
    return out


def _source(into: Path, key: str) -> Path:
    """The tiny Hugging Face model SOURCES[key], made once per folder."""
    hf = into / f"hf-{key}"
    if not hf.exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny import make_tiny_model

        make_tiny_model(hf, SOURCES[key]["family"], seed=SOURCES[key]["seed"])
    return hf


def _write_pool_reader(path: Path) -> None:
    """One ReduceSum node: cache [n] float32 -> total [1]. IR version 8, as kvedge's own opset-17
    graphs (onnx's default, its newest IR, is refused by onnxruntime 1.23, JetPack 6.2's)."""
    import onnx
    from onnx import TensorProto, helper

    data = helper.make_tensor_value_info("cache", TensorProto.FLOAT, ["n"])
    total = helper.make_tensor_value_info("total", TensorProto.FLOAT, [1])
    node = helper.make_node("ReduceSum", ["cache"], ["total"], keepdims=1)
    model = helper.make_model(
        helper.make_graph([node], "read", [data], [total]),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    onnx.save(model, str(path))


def make(out: Path) -> Path:
    """Every artifact device_tests/ uses, in `out` (made anew), with its index."""
    from kvedge import __version__

    if out.exists():
        if not (out / INDEX_FILE).is_file():
            raise FileExistsError(
                f"{out} exists without an {INDEX_FILE}: not replacing it; choose another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in [*EXPORTS, POOL_READER]:
        make_one(name, out)
    for key in SOURCES:
        shutil.rmtree(out / f"hf-{key}")
    index = {"format": FORMAT, "kvedge": __version__, "sources": SOURCES, "exports": EXPORTS, "files": FILES}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export the tiny artifacts device_tests/ runs on.")
    parser.add_argument("--out", type=Path, default=Path("device_artifacts"), help="folder to write")
    out = make(parser.parse_args(argv).out).resolve()
    print(copy_lines(out))


def copy_lines(out: Path, device: str = "orin", repo: str = "/opt/kvedge") -> str:
    """What to run next: copy the folder `out` into the checkout on `device` (docs/JETSON.md's
    /opt/kvedge), then run the tests there."""
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return (
        f"device artifacts in {out} ({size / 2**20:.1f} MiB). Copy them to the device, into the "
        f"kvedge checkout there:\n"
        f"  rsync -a {out}/ {device}:{repo}/{out.name}/\n"
        f"then on the device, in {repo}, with kvedge's venv active:\n"
        f"  device_tests/run.sh {out.name}"
    )


if __name__ == "__main__":
    main()
