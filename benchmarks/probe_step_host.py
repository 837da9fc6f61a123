"""Host against GPU in one training step: where the GPU waits for Python.

For one shape of ``benchmarks/shapes.py`` and each context-parallel setting asked (``--segments``: ``auto`` is
``chunk_kda`` with its heuristic, an int the canonical call with ``kda_forward(..., segments=N)``), the inputs and
upstream gradients of ``benchmarks/bench_train.py`` (every input requiring grad, ``disable_recompute=False``):

- the host time of the forward call and of ``torch.autograd.backward`` (``time.perf_counter`` around each, the
  device synchronised before the step), beside the GPU time of each (CUDA events recorded around the same calls),
  medians over ``--steps`` steps after two warm-up steps. A host time near or above its GPU time means the GPU
  waits for the host;
- one profiled step of the first setting (torch.profiler): the GPU events' span and busy time, the largest idle gaps
  between consecutive GPU events with their neighbours' names, and the CPU operators by self time;
- with ``--cprofile N``: N steps of the first setting under cProfile, the Python functions by own time (the
  host path attributed to our code, torch's calls and the CUDA runtime calls they make);
- with ``--timers``: for every setting, the host time of each cute_kda function, of each compiled kernel's call and
  of the torch operators the combine uses, inclusive (a caller's time holds its callees'), by ``time.perf_counter``
  wrappers and no profiler: µs and calls a step, medians of the per-step totals;
- with ``--launch-times``: for the first setting, when the host enters and leaves the few functions on the way to the
  kernels (:data:`STAMPED`) and calls each compiled kernel, µs from the step's start (before its start event's
  record), medians over ``--steps`` steps: the host time a step exposes is what passes before its first launch while
  the GPU is idle (docs/perf-log.md, h11).

Printed as markdown, and written to ``--out`` when given:

    python benchmarks/probe_step_host.py --shape B1_T32768_H16 --segments auto,1
    python benchmarks/probe_step_host.py --shape B1_T32768_H16 --head-dim 64 --segments auto --cprofile 5
    python benchmarks/probe_step_host.py --shape B1_T32768_H16 --head-dim 64 --segments auto,1 --timers
    python benchmarks/probe_step_host.py --shape B1_T8192_H96 --segments auto --launch-times
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("FLA_CUTE_KDA", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import markdown_table, publish  # noqa: E402

import bench_train  # noqa: E402
from bench_train import positive_int  # noqa: E402
from shapes import D, SHAPES, head_dim  # noqa: E402

GAP_US = 15.0  # idle time between GPU events that counts as a gap
TOP_GAPS = 8


def parse_segments(listed: str) -> list[int | None]:
    """``auto`` → None (the heuristic), an int ≥ 1 → itself; comma-separated, order kept."""
    values = [None if item == "auto" else positive_int(item)
              for item in (part.strip() for part in listed.split(",")) if item]
    if not values:
        raise argparse.ArgumentTypeError("no segments setting given")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="B1_T32768_H16")
    parser.add_argument("--segments", type=parse_segments, default=[None, 1],
                        help="comma-separated settings: 'auto' (the heuristic) or segments per sequence")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per median (default 10)")
    parser.add_argument("--head-dim", type=head_dim, default=D, help=f"K = V of every input (default {D})")
    parser.add_argument("--cprofile", type=positive_int, default=None, metavar="N",
                        help="also profile N steps of the first setting with cProfile")
    parser.add_argument("--timers", action="store_true",
                        help="also time every cute_kda function and compiled kernel call on the host, per setting")
    parser.add_argument("--launch-times", action="store_true",
                        help="also stamp when the host reaches each kernel launch of a step (the first setting)")
    parser.add_argument("--out", help="markdown file to write besides printing")
    return parser


TIMED_MODULES = ("cute_kda.api", "cute_kda.fla_calls", "cute_kda.call", "cute_kda.validation", "cute_kda.workspace",
                 "cute_kda.context_parallel", "cute_kda.executors.stages", "cute_kda.executors.training",
                 "cute_kda.ops.prepare", "cute_kda.ops.recurrence", "cute_kda.ops.bwd_scan", "cute_kda.ops.bwd_grads",
                 "cute_kda.ops.round_bf16", "cute_kda.ops.segment_combine", "cute_kda.ops._cache")
TIMED_TENSOR_METHODS = ("baddbmm_", "copy_", "zero_", "to", "contiguous")
TIMED_TORCH_FUNCTIONS = ("empty", "empty_like", "zeros", "zeros_like")


def install_wrappers(wrapped: dict) -> None:
    """Put each wrapper of ``wrapped`` (function → its wrapper) in every loaded cute_kda module namespace that holds
    the function, so that ``from x import f`` callers call it too."""
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("cute_kda") and m is not None]:
        for attr, value in list(vars(module).items()):
            if inspect.isfunction(value) and value in wrapped:
                setattr(module, attr, wrapped[value])


def wrap_compiled(wrapper: Callable[[str, Callable], Callable]) -> None:
    """Make :class:`~cute_kda.ops._cache.CompileCache` hand out ``wrapper(its name, compiled kernel)`` for each
    compiled kernel, one wrapper a kernel for the process's life."""
    from cute_kda.ops._cache import CompileCache

    get, kept = CompileCache.get, {}  # id of a compiled callable → (it, its wrapper)

    def wrapped_get(cache, key, build):
        compiled = get(cache, key, build)
        pair = kept.get(id(compiled))
        if pair is None:
            pair = kept[id(compiled)] = (compiled, wrapper(cache.name, compiled))
        return pair[1]

    CompileCache.get = wrapped_get


class HostTimers:
    """Inclusive host seconds and calls by name, from wrappers put around every function defined in
    :data:`TIMED_MODULES` (in every module namespace that holds it, so ``from x import f`` callers are timed too),
    around each compiled kernel :class:`~cute_kda.ops._cache.CompileCache` hands out (by its cache's name) and around
    a few torch tensor methods. Installed for the process's life (the probe's last part)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, name: str, function):
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += clock() - start
                calls[name] += 1

        timed.__wrapped_by_timers__ = True
        return timed

    def install(self) -> None:
        modules = [importlib.import_module(name) for name in TIMED_MODULES]
        wrapped = {}
        for module in modules:
            for attr, value in list(vars(module).items()):
                if (inspect.isfunction(value) and value.__module__ == module.__name__
                        and not getattr(value, "__wrapped_by_timers__", False)):
                    wrapped[value] = self.wrap(f"{module.__name__.removeprefix('cute_kda.')}.{attr}", value)
        install_wrappers(wrapped)
        wrap_compiled(lambda name, compiled: self.wrap(f"compiled {name}", compiled))
        for method in TIMED_TENSOR_METHODS:
            setattr(torch.Tensor, method, self.wrap(f"Tensor.{method}", getattr(torch.Tensor, method)))
        for function in TIMED_TORCH_FUNCTIONS:
            setattr(torch, function, self.wrap(f"torch.{function}", getattr(torch, function)))

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {name: (self.seconds[name], self.calls[name]) for name in self.seconds}


# the host functions a training step passes through on the way to its launches (--launch-times): (module, name);
# TrainingForward's forward and backward are stamped too
STAMPED = (("cute_kda.fla_calls", "translate_fla_call"), ("cute_kda.call", "resolve"),
           ("cute_kda.executors.training", "packed"), ("cute_kda.executors.training", "rounded_do"),
           ("cute_kda.executors.training", "recomputed"), ("cute_kda.workspace", "workspace_views"),
           ("cute_kda.ops.prepare", "prepare"), ("cute_kda.ops.recurrence", "recurrence"))


class LaunchStamps:
    """``(event, µs from the step's start)`` in host order: entering and leaving the functions of :data:`STAMPED` and
    ``TrainingForward``'s forward and backward, and each call of a compiled kernel (``launch <its cache>``), by
    ``time.perf_counter`` stamps (no profiler; a stamp costs well under a µs). :meth:`begin` starts a step.
    Installed for the process's life."""

    def __init__(self) -> None:
        self.start = 0.0
        self.stamps: list[tuple[str, float]] = []

    def begin(self) -> None:
        self.stamps = []
        self.start = time.perf_counter()

    def mark(self, event: str) -> None:
        self.stamps.append((event, (time.perf_counter() - self.start) * 1e6))

    def wrap(self, name: str, function):
        @functools.wraps(function)
        def stamped(*args, **kwargs):
            self.mark(f"{name} in")
            try:
                return function(*args, **kwargs)
            finally:
                self.mark(f"{name} out")

        return stamped

    def install(self) -> None:
        wrapped = {}
        for module_name, name in STAMPED:
            function = getattr(importlib.import_module(module_name), name)
            wrapped[function] = self.wrap(name, function)
        install_wrappers(wrapped)
        from cute_kda.executors.training import TrainingForward

        for method in ("forward", "backward"):
            setattr(TrainingForward, method, staticmethod(self.wrap(f"TrainingForward.{method}",
                                                                    getattr(TrainingForward, method))))
        wrap_compiled(self.launch_marker)

    def launch_marker(self, name: str, compiled):
        """``compiled`` marking ``launch <name>`` before each call."""

        def launch(*args, **kwargs):
            self.mark(f"launch {name}")
            return compiled(*args, **kwargs)

        return launch


def launch_rows(steps: list[list[tuple[str, float]]]) -> list[list[str]]:
    """[event, median µs] rows over the steps whose events came in the first step's order (the others dropped)."""
    events = [event for event, _ in steps[0]]
    kept = [step for step in steps if [event for event, _ in step] == events]
    return [[f"`{event}`", f"{statistics.median(step[i][1] for step in kept):.1f}"] for i, event in enumerate(events)]


def timer_rows(timers: HostTimers, problem: dict, forward, steps: int, setting: str, top: int = 40) -> list[list[str]]:
    """The ``top`` names by median host µs a step over ``steps`` steps: [setting, name, µs, calls] rows."""
    per_step = collections.defaultdict(list)
    for _ in range(steps):
        before = timers.snapshot()
        timed_step(problem, forward)
        after = timers.snapshot()
        for name, (seconds, calls) in after.items():
            was = before.get(name, (0.0, 0))
            per_step[name].append(((seconds - was[0]) * 1e6, calls - was[1]))
    medians = {name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
               for name, values in per_step.items()}
    ranked = sorted(medians.items(), key=lambda item: -item[1][0])[:top]
    return [[setting, f"`{name}`", f"{us:.1f}", f"{calls:g}"] for name, (us, calls) in ranked if calls]


def label(segments: int | None) -> str:
    return "heuristic" if segments is None else f"segments={segments}"


def forward_of(problem: dict, segments: int | None):
    """Zero-argument forward (o, ht) of ``problem`` (bench_train's) with this context-parallel setting."""
    import cute_kda
    from cute_kda.fla_calls import translate_fla_call

    leaves, kwargs = problem["leaves"], problem["kwargs"]
    tensors = [leaves[key] for key in ("q", "k", "v", "g", "beta")]
    if segments is None:
        return lambda: cute_kda.chunk_kda(*tensors, **kwargs)

    def forward():
        call = translate_fla_call(*tensors, **kwargs)
        return call.run(lambda *t, **options: cute_kda.kda_forward(*t, **options, recompute=call.recompute,
                                                                   segments=segments))

    return forward


def timed_step(problem: dict, forward, stamps: LaunchStamps | None = None) -> tuple[float, float, float, float]:
    """(host fwd, host bwd, GPU fwd, GPU bwd) ms of one step; ``stamps`` begins its step where the timing does."""
    for leaf in problem["leaves"].values():
        leaf.grad = None
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    if stamps is not None:
        stamps.begin()
    start = time.perf_counter()
    events[0].record()
    with torch.enable_grad():
        o, ht = forward()
        middle = time.perf_counter()
        events[1].record()
        if stamps is not None:
            stamps.mark("forward returned")
        torch.autograd.backward((o, ht), (problem["do"], problem["dht"]))
    end = time.perf_counter()
    if stamps is not None:
        stamps.mark("backward returned")
    events[2].record()
    torch.cuda.synchronize()
    return ((middle - start) * 1e3, (end - middle) * 1e3, events[0].elapsed_time(events[1]),
            events[1].elapsed_time(events[2]))


def profiled_gaps(problem: dict, forward) -> tuple[str, list[list[str]], str]:
    """One profiled step: (summary line, the largest GPU gaps as table rows, CPU operators by self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_step(problem, forward)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(kernels, kernels[1:])
                   if b.time_range.start - a.time_range.end > GAP_US), reverse=True)
    summary = (f"{len(kernels)} GPU events, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms; "
               f"{len(gaps)} gaps over {GAP_US:g} µs, {sum(g for g, _, _ in gaps) / 1e3:.3f} ms in all")
    rows = [[f"{gap:.1f}", f"`{before[:70]}`", f"`{after[:70]}`"] for gap, before, after in gaps[:TOP_GAPS]]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return summary, rows, table


def python_profile(problem: dict, forward, steps: int, rows: int = 30) -> str:
    """``steps`` steps under cProfile: the functions by own time, then by cumulative time (pstats' text)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        timed_step(problem, forward)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumtime").print_stats(rows)
    return text.getvalue()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_step_host needs a CUDA GPU (Hopper): nothing timed")
    problem = bench_train.make_problem(args.shape, torch.device("cuda"), dim=args.head_dim)
    rows = []
    for segments in args.segments:
        forward = forward_of(problem, segments)
        for _ in range(2):
            timed_step(problem, forward)  # compiles, fills the caches
        times = [timed_step(problem, forward) for _ in range(args.steps)]
        medians = [statistics.median(column) for column in zip(*times)]
        rows.append([args.shape, label(segments), *(f"{ms:.3f}" for ms in medians)])
        print(f"{label(segments)}: host fwd {medians[0]:.3f}, host bwd {medians[1]:.3f}, GPU fwd {medians[2]:.3f}, "
              f"GPU bwd {medians[3]:.3f} ms", file=sys.stderr)
    summary, gaps, operators = profiled_gaps(problem, forward_of(problem, args.segments[0]))
    text = "\n\n".join([
        f"# Host against GPU in one training step ({args.shape}, D = {args.head_dim})",
        markdown_table(["shape", "setting", "host fwd ms", "host bwd ms", "GPU fwd ms", "GPU bwd ms"], rows),
        f"One profiled step ({label(args.segments[0])}): {summary}.",
        markdown_table(["gap µs", "after", "before"], gaps),
        "CPU operators by self time:\n\n```\n" + operators + "\n```",
    ]) + "\n"
    if args.cprofile:
        text += (f"\nPython profile of {args.cprofile} steps ({label(args.segments[0])}, cProfile):\n\n```\n"
                 + python_profile(problem, forward_of(problem, args.segments[0]), args.cprofile) + "```\n")
    if args.launch_times:
        stamps = LaunchStamps()
        stamps.install()
        forward = forward_of(problem, args.segments[0])
        timed_step(problem, forward)  # the wrappers' own first calls
        steps, gpu = [], []
        for _ in range(args.steps):
            times = timed_step(problem, forward, stamps)
            steps.append(stamps.stamps)
            gpu.append(times[2] + times[3])
        text += (f"\nWhen the host reaches each launch ({label(args.segments[0])}; µs from the step's start, medians of "
                 f"{args.steps} steps; the step {statistics.median(gpu):.3f} ms by events):\n\n"
                 + markdown_table(["host event", "µs"], launch_rows(steps)) + "\n")
    if args.timers:
        timers = HostTimers()
        timers.install()
        timed = []
        for segments in args.segments:
            forward = forward_of(problem, segments)
            timed_step(problem, forward)  # the wrappers' own first calls
            timed += timer_rows(timers, problem, forward, args.steps, label(segments))
        text += ("\nHost time by function (inclusive: a caller's time holds its callees'; perf_counter wrappers, "
                 f"medians of {args.steps} steps):\n\n"
                 + markdown_table(["setting", "function", "host µs a step", "calls a step"], timed) + "\n")
    publish(text, args.out)


if __name__ == "__main__":
    main()
