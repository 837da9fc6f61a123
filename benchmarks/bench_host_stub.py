"""Host µs of host_calls.py's rows on a machine without a GPU: the Python path of each call with what needs CUDA
stubbed, for A/B runs of two checkouts (issue 31's "eager host cost of a call not worse", issue 32's ≤ 15 µs a
decode call).

The rows are host_calls.py's own (:func:`host_calls.forward_entry_points`, :func:`host_calls.serving_entry_points`)
built on CPU tensors; only what needs a device is replaced. ``--rows forward`` (the default): ``kda_forward`` and
``chunk_kda``, stubbed at the launchers, which both the package's older layout (``api._forward``) and its newer one
(``executors/inference.py``) call the same way:

- ``ops.prepare.compiled_variant`` and ``ops.recurrence.compiled_variant`` → a function that takes any arguments and
  does nothing (``ops.prepare.launch`` / ``ops.recurrence.launch`` still build their arguments and call it; what the
  compiled TVM-FFI function costs in C is not timed here);
- torch's raw current-stream look-up → 0 (``ops._cache.current_stream_handle`` runs as it is) and
  ``ops._cache.cu_stream`` → the handle itself (a plan's build only);
- ``validation.check_on_cuda`` → no check (the tensors are the CPU's), and every module's ``sm_count`` → 132 (the
  H200; a plan's build only).

On the CPU ``device.index`` is None and ``on_device`` answers without CUDA; a CPU tensor makes the context-parallel
heuristic answer "no segments" without asking for the SMs (on a GPU the older tree ran it on every call, the newer
keeps its answer: that difference is not timed here).

``--rows serving``: the steady serving calls (``decode``, ``verify``, ``decode_launcher`` and the GatedDeltaNet rows),
with C-level callables where torch's own are C (so the stub adds little of its own):

- ``Tensor.get_device`` → 0 and ``torch.cuda.current_device`` → 0 (the tensors pass as CUDA device 0's);
- torch's raw current-stream look-up → 0, ``cute_kda.ops.decode.sm_count`` → 132 (the H200),
  ``cute_kda.ops.decode.check_supported`` → nothing (an sm_90 device; run once per configuration);
- ``cute_kda.ops.decode.compiled_variant`` → a function that takes any arguments and does nothing;
- ``Tensor.is_cuda`` → True (a Python property: read at most once a call on the timed paths).

What is timed is the rest: the checks, the resolution, the plan look-ups, the launch arguments. Per row: the minimum
and the median over ``--rounds`` rounds of ``--calls`` calls. An interleaved A/B of two trees (``--tree`` puts a
checkout first on ``sys.path``; the stubs and the rows are this file's and its host_calls.py's in both runs)::

    git archive e8ffb54 | tar -x -C /tmp/base
    for i in 1 2 3 4 5; do for t in /tmp/base $PWD; do python benchmarks/bench_host_stub.py --tree $t; done; done

``--profile ROW`` prints cProfile's table of one round of that row instead, to see where a tree spends it. The H200's
host ran Python about 2× slower than the 2-core CPU this was written on (2026-12-03: 24-25 µs for the decode row
there).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable


def install_forward_stubs() -> None:
    """The CUDA queries and the compiled kernels of an eager forward call, answered on the CPU (module doc)."""
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


def install_serving_stubs() -> None:
    """The CUDA queries a steady serving call makes, answered on the CPU (module doc)."""
    import torch

    torch.Tensor.get_device = (0).__int__  # a C callable that is not a descriptor: t.get_device() → 0
    torch._C._cuda_getCurrentRawStream = (0).__mul__  # (index) → 0, in C
    torch.cuda.current_device = (0).__int__
    decode_ops = importlib.import_module("cute_kda.ops.decode")
    decode_ops.sm_count = lambda index: 132
    decode_ops.check_supported = lambda device: None

    def launch(*args):
        return None

    decode_ops.compiled_variant = lambda variant, index: launch
    torch.Tensor.is_cuda = property(lambda self: True)


def round_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", help="a checkout to import cute_kda from (default: this one)")
    parser.add_argument("--rows", choices=("forward", "serving"), default="forward",
                        help="host_calls.py's kda_forward / chunk_kda rows, or its serving rows")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", metavar="ROW", help="print cProfile's table of one row's calls instead")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tree or str(Path(__file__).resolve().parents[1]))
    import torch

    # the tree's package, before its attributes change and before host_calls.py imports it (then it finds it loaded)
    for name in ("api", "ops.prepare", "ops.recurrence") if args.rows == "forward" else ("serving", "ops.decode"):
        importlib.import_module(f"cute_kda.{name}")
    import host_calls

    cpu = torch.device("cpu")
    if args.rows == "forward":
        install_forward_stubs()
        runs = host_calls.forward_entry_points(cpu)
    else:
        install_serving_stubs()
        runs = host_calls.serving_entry_points(cpu)
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
