# Two entry points do all the set-up themselves on a fresh machine:
#   make demo   - build a local venv, then run the demo (CPU: references + sm_90a compile; GPU: run + check + time)
#   make test   - build a local venv, then run the test suite on two workers (GPU tier skipped without CUDA)
# On a GPU host:
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

.PHONY: demo test gpu-test clean

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

clean:
	rm -rf $(VENV) build *.egg-info
