#!/usr/bin/env bash
# The team's offline bundle for the H200 device calls (docs/contributing/gpu.md): the shared DSL bundle plus the
# cp312 TVM-FFI wheel, flash-linear-attention's layers (pure Python, beside the fla-core there; examples/kda_layer.py
# uses them) and pytest-xdist, so the GPU tier's compiles spread over the host's cores. Run from the repository root.
set -euo pipefail
PYTHON=${PYTHON:-python3}
../shared/gpu/make-dsl-bundle
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .gpu-bundle "apache-tvm-ffi>=0.1.15,<0.2"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d .gpu-bundle "flash-linear-attention==0.6.0"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d .gpu-bundle "pytest-xdist==3.8.0" "execnet==2.1.2"
