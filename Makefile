# Two entry points do all the set-up themselves on a fresh machine:
#   make demo   - build a local venv, then run the demo (CPU: references + sm_90a compile; GPU: run + check + time)
#   make test   - build a local venv, then run the test suite on two workers (GPU tier skipped without CUDA)
# GPU host (offline DSL bundle on PYTHONPATH, see docs/contributing/gpu.md; make gpu-bundle builds it here):
#   make gpu-test PYTHON=python3   - GPU tier, writes a dated summary to benchmarks/results/
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
# Without a GPU (no nvidia-smi) the venv gets torch's CPU build, not the CUDA one PyPI serves: first
# as pip finds it already (a local wheel or index that has it), else from PyTorch's CPU index.
# HAS_GPU= / HAS_GPU=1 on the command line overrides the detection.
HAS_GPU ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(HAS_GPU),)
TORCH_INSTALL = $(VPY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" \
	|| $(VPY) -m pip install -q --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)+cpu"
else
TORCH_INSTALL = $(VPY) -m pip install -q "torch==$(TORCH_VERSION)"
endif

.PHONY: demo test gpu-test gpu-bundle clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(TORCH_INSTALL)
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.ready
	$(VPY) examples/demo.py

# Two pytest-xdist workers: the sm_90a compile tests are most of the CPU tier and each compile is one thread
# (the CPU tier on a 2-core machine: 718 s on one worker, 486 s on two).
test: $(VENV)/.ready
	$(VPY) -m pytest -q -n 2 tests

gpu-test:
	$(PYTHON) scripts/gpu_tier.py

# Offline bundle for the H200 (docs/contributing/gpu.md): the shared DSL bundle plus the cp312 TVM-FFI wheel and
# flash-linear-attention's layers (pure Python, beside the fla-core there; examples/kda_layer.py uses them) and
# pytest-xdist, so the GPU tier's compiles spread over the host's cores (docs/contributing/gpu.md).
gpu-bundle:
	../shared/gpu/make-dsl-bundle
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d .gpu-bundle "apache-tvm-ffi>=0.1.15,<0.2"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d .gpu-bundle "flash-linear-attention==0.6.0"
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d .gpu-bundle "pytest-xdist==3.8.0" "execnet==2.1.2"

clean:
	rm -rf $(VENV) build *.egg-info
