"""Builds kvedge's onnxruntime kernel library; all other metadata is in setup.cfg.

`kvedge/runtime/csrc/kvedge_ops.cc` holds the INT8-cache attention kernel that "ort" graphs
exported with `--kv-dtype int8` run (`kvedge.runtime.kernels`). It is built here with the
machine's C++ compiler, for the machine's own CPU (-march=native, as llama.cpp does; set
KVEDGE_NATIVE=0 for a build that runs on other CPUs of the architecture). The extension is
optional: without a compiler the install still succeeds and only that graph kind is unavailable.
"""

import os

from setuptools import Extension, setup

flags = ["-O3", "-std=c++17", "-fvisibility=hidden"]
if os.environ.get("KVEDGE_NATIVE", "1") != "0":
    flags.append("-march=native")

setup(
    ext_modules=[
        Extension(
            "kvedge.runtime._kvedge_ops",
            sources=["kvedge/runtime/csrc/kvedge_ops.cc"],
            include_dirs=[os.environ.get("ORT_INCLUDE_DIR", "kvedge/runtime/csrc/third_party/onnxruntime")],
            extra_compile_args=flags,
            language="c++",
            optional=True,
        )
    ]
)
