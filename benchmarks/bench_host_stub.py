"""Host µs of an eager ``kda_forward`` / ``chunk_kda`` call on a machine without a GPU: the Python path with what
needs CUDA stubbed, for A/B runs of two checkouts (issue 31's "eager host cost of a call not worse").

host_calls.py times the same calls on the H200 (its ``kda_forward`` and ``chunk_kda`` rows: B1 T64 H16, fp32
initial state; ``kda_forward`` with ``out`` and ``final_state`` given, ``chunk_kda`` with FLA's flags); this script
builds them on CPU tensors and replaces only what needs a device, at the launchers, which both the package's older
layout (``api._forward``) and its newer one (``executors/inference.py``) call the same way:

- ``ops.prepare.compiled_variant`` and ``ops.recurrence.compiled_variant`` → a function that takes any arguments and
  does nothing (``ops.prepare.launch`` / ``ops.recurrence.launch`` still build their arguments and call it; what the
  compiled TVM-FFI function costs in C is not timed here);
- torch's raw current-stream look-up → 0 (``ops._cache.current_stream_handle`` runs as it is) and
  ``ops._cache.cu_stream`` → the handle itself (a plan's build only);
- ``validation.check_on_cuda`` → no check (the tensors are the CPU's), and every module's ``sm_count`` → 132 (the
  H200; a plan's build only).

On the CPU ``device.index`` is None and ``on_device`` answers without CUDA; a CPU tensor makes the context-parallel
heuristic answer "no segments" without asking for the SMs (on a GPU the older tree ran it on every call, the newer
keeps its answer: that difference is not timed here). What is timed is the rest: the checks, the resolution, the
plan look-up, the launch arguments. Per row: the minimum and the median over ``--rounds`` rounds of ``--calls``
calls. An interleaved A/B of two trees (``--tree`` puts a checkout first on ``sys.path``; the stubs and the inputs
are this file's in both runs)::

    git archive e8ffb54 | tar -x -C /tmp/base
    for i in 1 2 3 4 5; do for t in /tmp/base $PWD; do python benchmarks/bench_host_stub.py --tree $t; done; done

``--profile kda_forward`` (or ``chunk_kda``) prints cProfile's table of one round of that row instead, to see where
a tree spends it.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable


def install_stubs() -> None:
    """The CUDA queries and the compiled kernels of an eager call, answered on the CPU (module doc)."""
    import torch

    torch._C._cuda_getCurrentRawStream = {None: 0, 0: 0}.get  # (index) → 0, in C
    cache = importlib.import_module("cute_kda.ops._cache")
    cache.cu_stream = lambda handle: handle

    def compiled(*args):
        return None

    for name in ("prepare", "recurrence"):
        importlib.import_module(f"cute_kda.ops.{name}").compiled_variant = lambda *args, **kwargs: compiled
    importlib.import_module("cute_kda.validation").check_on_cuda = lambda name, tensor: None
    for module in [m for name, m in sys.modules.items() if name.startswith("cute_kda")]:
        if callable(getattr(module, "sm_count", None)):
            module.sm_count = {None: 132, 0: 132}.get


def calls() -> dict[str, Callable[[], object]]:
    """host_calls.py's ``kda_forward`` and ``chunk_kda`` rows on CPU tensors."""
    import torch

    import cute_kda
    from shapes import LOWER_BOUND, Shape, make_inputs

    inputs = make_inputs(Shape((64,), 16), torch.device("cpu"))
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    A_log, dt_bias, h0 = inputs["A_log"], inputs["dt_bias"], inputs["initial_state"]
    out, final = torch.empty_like(v), torch.empty_like(h0)
    scale = q.shape[-1] ** -0.5
    return {
        "kda_forward": lambda: cute_kda.kda_forward(
            q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND, initial_state=h0,
            out=out, final_state=final),
        "chunk_kda": lambda: cute_kda.chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
            A_log=A_log, dt_bias=dt_bias, state_v_first=True),
    }


def round_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", help="a checkout to import cute_kda from (default: this one)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", metavar="ROW", help="print cProfile's table of one row's calls instead")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree or str(Path(__file__).resolve().parents[1]))
    import torch

    for name in ("api", "ops.prepare", "ops.recurrence"):  # the package's modules, before their attributes change
        importlib.import_module(f"cute_kda.{name}")
    install_stubs()
    runs = calls()
    figures = {}
    with torch.inference_mode():
        for fn in runs.values():
            fn()  # the plan's build, the cached options
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(round_us, runs[args.profile], args.calls)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            return
        for name, fn in runs.items():
            per_round = [round_us(fn, args.calls) for _ in range(args.rounds)]
            figures[name] = (min(per_round), statistics.median(per_round))
    label = args.tree or "."
    print(label, " ".join(f"{name} min {low:.2f} med {mid:.2f}" for name, (low, mid) in figures.items()), flush=True)


if __name__ == "__main__":
    main()
