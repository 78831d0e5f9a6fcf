"""setup.py's kernel build: every install compiles the library anew, with the flags it is given.

setuptools skips an extension whose built library is newer than its source; kvedge's library also
depends on what its source does not say (the CPU behind -march=native, KVEDGE_NATIVE), so a
reinstall from a folder that kept build/ would reuse a library made for another CPU or with other
flags. The check runs setuptools itself (`setup.py build_ext`) into a build folder whose library
is already up to date by date, with a stand-in for the C++ compiler (CC, CXX, LDSHARED and
LDCXXSHARED, which setuptools takes from the environment) that records each command line and
writes the file named by -o: what is checked is whether and how setuptools calls the compiler,
not g++ itself (the real build is `make install`'s and the kernel tests').
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDER = """#!/bin/sh
echo "$@" >> "{log}"
while [ $# -gt 0 ]; do
    if [ "$1" = -o ]; then : > "$2"; fi
    shift
done
"""


def build(tmp_path: Path, native: str) -> tuple[list[str], Path]:
    """(the compiler's command lines, the library) of `setup.py build_ext` with KVEDGE_NATIVE=`native`,
    into a build folder that already holds the library, newer than its source."""
    name = "_kvedge_ops" + sysconfig.get_config_var("EXT_SUFFIX")
    library = tmp_path / "lib" / "kvedge" / "runtime" / name
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")  # written now: newer than kvedge_ops.cc
    log, compiler = tmp_path / "commands.log", tmp_path / "cc"
    compiler.write_text(RECORDER.format(log=log))
    compiler.chmod(0o755)
    tools = {name: str(compiler) for name in ("CC", "CXX", "LDSHARED", "LDCXXSHARED")}
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext"]
        + ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "temp")],
        cwd=ROOT,
        env={**os.environ, **tools, "KVEDGE_NATIVE": native},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return (log.read_text().splitlines() if log.exists() else []), library


@pytest.mark.parametrize("native", ["1", "0"])
def test_reinstall_recompiles_the_kernels_with_the_flags_given(tmp_path, native):
    commands, library = build(tmp_path, native)
    compiled = [c.split() for c in commands if "kvedge/runtime/csrc/kvedge_ops.cc" in c.split()]
    assert len(compiled) == 1, commands  # compiled, though the library looked up to date
    assert ("-march=native" in compiled[0]) == (native == "1")
    assert [c for c in commands if str(library) in c.split()]  # and linked again
