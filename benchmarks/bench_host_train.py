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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

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


def make_problem(seq_len: int, heads: int) -> dict:
    """The benchmarks' inputs (``shapes.make_inputs``, B1) as leaves that require grad, dO and dht."""
    inputs = make_inputs(Shape((seq_len,), heads), torch.device("cpu"))
    leaves = {name: tensor.requires_grad_() for name, tensor in inputs.items() if tensor is not None}
    gen = torch.Generator().manual_seed(1)
    return dict(leaves=leaves, do=torch.randn(1, seq_len, heads, D, generator=gen).bfloat16(),
                dht=torch.randn(1, heads, D, D, generator=gen))


def time_steps(problem: dict, launches: list, steps: int, recompute: bool, segments: int | None = None) -> dict:
    """Medians over ``steps`` steps (after 5 untimed): forward and backward host µs, and per launch µs
    from the step's start (in launch order); ``segments``: ``kda_forward``'s context-parallel split."""
    leaves = problem["leaves"]
    forward_us, backward_us, offsets = [], [], []
    for i in range(steps + 5):
        for x in leaves.values():
            x.grad = None
        launches.clear()
        start = time.perf_counter()
        o, ht = kda_forward(**leaves, lower_bound=LOWER_BOUND, output_final_state=True, recompute=recompute,
                            segments=segments)
        forwarded = time.perf_counter()
        torch.autograd.backward((o, ht), (problem["do"], problem["dht"]))
        done = time.perf_counter()
        if i >= 5:
            forward_us.append(1e6 * (forwarded - start))
            backward_us.append(1e6 * (done - forwarded))
            offsets.append([(label, 1e6 * (t - start)) for label, t in launches])
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
    parser.add_argument("--steps", type=int, default=50, help="timed steps (medians)")
    parser.add_argument("--segments", type=int, default=None,
                        help="context-parallel segments per sequence (default: none; the heuristic needs a GPU)")
    args = parser.parse_args(argv)
    launches: list = []
    install_noop_kernels(launches)
    problem = make_problem(args.seq_len, args.heads)
    split = "" if args.segments is None else f", {args.segments} segments"
    print(f"B1 T{args.seq_len} H{args.heads}{split}, kernels replaced by no-ops, medians of {args.steps} steps")
    for recompute in (True, False):
        print(report(recompute, time_steps(problem, launches, args.steps, recompute, args.segments)))


if __name__ == "__main__":
    main()
