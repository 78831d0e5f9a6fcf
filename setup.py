"""Builds kvedge's onnxruntime kernel library and lists the packages; all other metadata is in
setup.cfg.

Packages: every folder under kvedge/ (namespace folders too, so data folders such as
kvedge/calibrate/data are declared packages and setuptools has nothing to warn about), and the
repository's configs/ (device profiles, model recipes, service and warm-prefix configs), shipped
as the package `kvedge._configs` so an installed kvedge finds them from any working directory
(`kvedge.configs.CONFIG_ROOT`).

`kvedge/runtime/csrc/kvedge_ops.cc` holds the kernels that "ort" graphs exported with
`--kv-dtype int8` (INT8-cache attention) or `--weights int8|int4` (the quantized matmuls' side
inputs) run (`kvedge.runtime.kernels`). It is built here with the machine's C++ compiler, for the
machine's own CPU (-march=native, as llama.cpp does; set KVEDGE_NATIVE=0 for a build that runs on
other CPUs of the architecture). The extension is optional: without a compiler the install still
succeeds and only those graph kinds are unavailable.

Every build compiles the library anew (`AlwaysBuildExt`): setuptools skips an extension whose
object file in build/ is newer than its source, but what the object holds also depends on what
the source never says: the CPU behind -march=native, KVEDGE_NATIVE, the onnxruntime headers of
ORT_INCLUDE_DIR. A reinstall from a folder that kept build/ would otherwise reuse a library made
for another CPU or with other flags (one C++ file: the rebuild costs under a minute).
"""

import os

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext


class AlwaysBuildExt(build_ext):
    """build_ext with --force always on (see the module docstring)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.force = True


flags = ["-O3", "-std=c++17", "-fvisibility=hidden"]
if os.environ.get("KVEDGE_NATIVE", "1") != "0":
    flags.append("-march=native")

configs = ["kvedge._configs"] + [f"kvedge._configs.{name}" for name in find_namespace_packages("configs")]

setup(
    cmdclass={"build_ext": AlwaysBuildExt},
    packages=find_namespace_packages(include=["kvedge*"]) + configs,
    package_dir={"kvedge._configs": "configs"},
    package_data={
        "kvedge.calibrate.data": ["*.jsonl"],
        "kvedge.serve.ui": ["*.html", "*.js", "*.css", "*.svg"],  # the chat page (GET /)
        "kvedge._configs": ["*.md", "*.service"],
        **{name: ["*.yaml"] for name in configs[1:]},
    },
    ext_modules=[
        Extension(
            "kvedge.runtime._kvedge_ops",
            sources=["kvedge/runtime/csrc/kvedge_ops.cc"],
            include_dirs=[os.environ.get("ORT_INCLUDE_DIR", "kvedge/runtime/csrc/third_party/onnxruntime")],
            extra_compile_args=flags,
            language="c++",
            optional=True,
        )
    ],
)
