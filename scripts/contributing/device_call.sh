#!/bin/bash
# One device call (docs/contributing/gpu.md): the set-up line, FLA's autotune results restored, then each argument as a
# shell step (its log in $OUT/step<i>.log, the last TAILN lines echoed), then the autotune results harvested into
# $OUT/fla-autotune.tgz. Run from the repository root on the device: COMMIT=<sha> bash scripts/contributing/device_call.sh '<step>' ...
mkdir -p /tmp/dsl && tar -xJf .gpu-bundle/cute-dsl-py312.tar.xz -C /tmp/dsl && python3 -m pip install -q --no-index --no-deps --target /tmp/dsl/site .gpu-bundle/*.whl
export PYTHONPATH=/tmp/dsl/site:/tmp/dsl/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1 CUTE_KDA_COMMIT=${COMMIT:-unknown}
export CUTE_KDA_CACHE_DIR=/tmp/ckc FLA_CUTE_KDA=0 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache && tar -xzf benchmarks/fla-autotune-h200.tgz -C /tmp/tcache && echo "restored $(find /tmp/tcache -name "*.autotune.json" | wc -l) autotune results"
i=0
for step in "$@"; do
  i=$((i+1))
  echo "=== step $i: $step"
  start=$(date +%s)
  bash -c "$step" > $OUT/step$i.log 2>&1
  echo "rc=$? $(( $(date +%s) - start ))s"
  tail -n ${TAILN:-15} $OUT/step$i.log
done
# FLA's Triton autotune results (FLA_CACHE_RESULTS=1, its default), for the next call to restore
if [ -d /tmp/tcache ]; then (cd /tmp/tcache && find . -name '*.autotune.json' | tar -czf $OUT/fla-autotune.tgz -T -); echo "harvested $(tar -tzf $OUT/fla-autotune.tgz | wc -l) autotune results"; fi
