"""Host time of one training step with every kernel replaced by a no-op (CPU only, no GPU needed).

The autograd path of ``cute_kda.kda_forward`` runs as it does on a GPU (validation, workspace and
buffer allocation, the autograd Function, the backward's stages), but K1, the tile bases, K2,
Kernel A and Kernel B return at once, on CPU tensors. It prints the host time of the forward and of
the backward, and when each launch would have been issued, measured from the start of the step.
Compare those with the kernels' GPU times (``bench_train.py``): a launch issued after the GPU has run
out of work is a gap in the step. The figures are this machine's; a GPU host may be slower.

    python3 benchmarks/bench_host_train.py
    python3 benchmarks/bench_host_train.py --seq-len 64 --heads 16 --steps 50
    python3 benchmarks/bench_host_train.py --seq-len 2048 --heads 1 --segments 8   # a call split into 8 segments
    python3 benchmarks/bench_host_train.py --seq-len 256 --heads 1 --segments 8 --ops   # and the torch ops a step

With ``--ops`` it also counts the aten operators one step dispatches outside the kernels (a ``TorchDispatchMode``):
those that do device work (each a launch or a copy on a GPU), the allocations and the views, which only cost host time.
    python3 benchmarks/bench_host_train.py --seq-len 256 --heads 1 --head-dim 64 --segments 8 --count-ops

``--count-ops`` lists the torch operators one recomputing step dispatches outside the kernels (a
``TorchDispatchMode``), forward and backward apart, by kind: device work (what launches a kernel or a copy
on a GPU), allocations, and views or metadata (no device work).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kda import kda_forward, validation  # noqa: E402
from cute_kda.ops import bwd_grads, bwd_scan, prepare, recurrence  # noqa: E402
from cute_kda.reference import tile_bases  # noqa: E402
from shapes import D, LOWER_BOUND, Shape, make_inputs  # noqa: E402

LAUNCHERS = ((prepare, "prepare", "K1"), (recurrence, "recurrence", "K2"), (bwd_scan, "bwd_scan", "Kernel A"),
             (bwd_grads, "bwd_grads", "Kernel B"))


def install_noop_kernels(launches: list) -> None:
    """Every launcher returns at once, noting (kernel, time) in ``launches``; CUDA checks pass on the CPU."""

    def noop(label):
        def launcher(*args, **kwargs):
            launches.append((label, time.perf_counter()))

        return launcher

    for module, name, label in LAUNCHERS:
        setattr(module, name, noop(label))
    prepare.tile_bases = lambda cu_seqlens, stream=None: tile_bases(cu_seqlens, 0, 1)
    validation.check_on_cuda = lambda name, tensor: None


def make_problem(seq_len: int, heads: int, dim: int = D) -> dict:
    """The benchmarks' inputs (``shapes.make_inputs``, B1, head dim ``dim``) as leaves that require grad, dO and
    dht."""
    inputs = make_inputs(Shape((seq_len,), heads), torch.device("cpu"), dim=dim)
    leaves = {name: tensor.requires_grad_() for name, tensor in inputs.items() if tensor is not None}
    gen = torch.Generator().manual_seed(1)
    return dict(leaves=leaves, do=torch.randn(1, seq_len, heads, dim, generator=gen).bfloat16(),
                dht=torch.randn(1, heads, dim, dim, generator=gen))


ALLOCATIONS = frozenset({"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
                         "aten.empty_strided.default"})


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched under it by kind: ``device`` (work a GPU would run: kernels, copies,
    fills), ``allocations``, ``views`` (views and metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, collections.Counter] = {kind: collections.Counter()
                                                      for kind in ("device", "allocations", "views")}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        kind = "views" if func.is_view else "allocations" if name in ALLOCATIONS else "device"
        self.kinds[kind][name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(problem: dict, segments: int | None, warmup: int = 2) -> dict[str, OpCounter]:
    """The operators of one recomputing step's forward and backward (``"forward"``, ``"backward"``), after
    ``warmup`` steps that fill the caches."""
    leaves, counters = problem["leaves"], {}
    for i in range(warmup + 1):
        for x in leaves.values():
            x.grad = None
        counters = {"forward": OpCounter(), "backward": OpCounter()}
        with counters["forward"]:
            o, ht = kda_forward(**leaves, lower_bound=LOWER_BOUND, output_final_state=True, recompute=True,
                                segments=segments)
        with counters["backward"]:
            torch.autograd.backward((o, ht), (problem["do"], problem["dht"]))
    return counters


def ops_report(counters: dict[str, OpCounter]) -> str:
    lines = []
    for phase, counter in counters.items():
        totals = ", ".join(f"{sum(ops.values())} {kind}" for kind, ops in counter.kinds.items())
        device = ", ".join(f"{name} ×{n}" for name, n in sorted(counter.kinds["device"].items()))
        lines.append(f"{phase}: {totals}; device: {device}")
    return "\n".join(lines)


def time_steps(problem: dict, launches: list, steps: int, recompute: bool, segments: int | None = None,
               warmup: int = 5) -> dict:
    """Medians over ``steps`` steps (after ``warmup`` untimed): forward and backward host µs, and per launch µs
    from the step's start (in launch order); ``segments``: ``kda_forward``'s context-parallel split. No steps: {}."""
    leaves = problem["leaves"]
    forward_us, backward_us, offsets = [], [], []
    for i in range(steps + warmup):
        for x in leaves.values():
            x.grad = None
        launches.clear()
        start = time.perf_counter()
        o, ht = kda_forward(**leaves, lower_bound=LOWER_BOUND, output_final_state=True, recompute=recompute,
                            segments=segments)
        forwarded = time.perf_counter()
        torch.autograd.backward((o, ht), (problem["do"], problem["dht"]))
        done = time.perf_counter()
        if i >= warmup:
            forward_us.append(1e6 * (forwarded - start))
            backward_us.append(1e6 * (done - forwarded))
            offsets.append([(label, 1e6 * (t - start)) for label, t in launches])
    if not steps:
        return {}
    labels = [label for label, _ in offsets[0]]
    launch_us = [statistics.median(step[j][1] for step in offsets) for j in range(len(labels))]
    return dict(forward_us=statistics.median(forward_us), backward_us=statistics.median(backward_us),
                launches=list(zip(labels, launch_us)))


def report(recompute: bool, result: dict) -> str:
    mode = "recompute" if recompute else "keep"
    issued = ", ".join(f"{label} at {us:.0f}" for label, us in result["launches"])
    return (f"{mode}: forward {result['forward_us']:.0f} µs, backward {result['backward_us']:.0f} µs of host time; "
            f"launches issued (µs from the step's start): {issued}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=D, help=f"K = V (default {D}; 64 runs natively)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps (medians)")
    parser.add_argument("--segments", type=int, default=None,
                        help="context-parallel segments per sequence (default: none; the heuristic needs a GPU)")
    parser.add_argument("--count-ops", action="store_true",
                        help="list the torch operators of one recomputing step instead of timing")
    args = parser.parse_args(argv)
    launches: list = []
    install_noop_kernels(launches)
    problem = make_problem(args.seq_len, args.heads, args.head_dim)
    split = "" if args.segments is None else f", {args.segments} segments"
    if args.count_ops:
        print(f"B1 T{args.seq_len} H{args.heads} D{args.head_dim}{split}, kernels replaced by no-ops, one step")
        print(ops_report(count_ops(problem, args.segments)))
        return
    print(f"B1 T{args.seq_len} H{args.heads} D{args.head_dim}{split}, kernels replaced by no-ops, "
          f"medians of {args.steps} steps")
    for recompute in (True, False):
        print(report(recompute, time_steps(problem, launches, args.steps, recompute, args.segments)))


if __name__ == "__main__":
    main()
