"""Teaching kernels: the pieces of cute_kda's kernels, each shown on a kernel small enough to read whole.

Not part of the product: this folder sits beside ``cute_kda/``, is not in the wheel, and nothing in
``cute_kda`` imports it. It takes from ``cute_kda`` only the shared pieces (the DSL set-up, the
shared-memory atoms and their analysis, the copy helpers, the compile cache), so what it teaches is
what the product's kernels are built from. Import it from a checkout with the repository root on
``sys.path`` (pytest from the root does this; the scripts in ``examples/``, ``benchmarks/`` and
``scripts/`` insert it themselves).

- the multistage GEMM (``cp.async`` + ``mma.sync``, ``docs/gemm-walkthrough.md``):
  :mod:`.kernels.gemm_multistage`, its layouts and bank analysis :mod:`.layouts.gemm`, its torch
  launcher :mod:`.ops.gemm`; run by ``examples/gemm_multistage.py``, timed by ``benchmarks/bench_gemm.py``;
- the transpose round trip (TMA → ``ldmatrix`` → ``movmatrix`` → ``stmatrix`` → TMA, the moves K2
  makes): :mod:`.kernels.transpose_roundtrip`, its launcher :mod:`.ops.roundtrip`.
"""
