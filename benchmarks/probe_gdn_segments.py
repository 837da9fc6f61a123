"""GatedDeltaNet's training step at chosen context-parallel segment counts, with its per-kernel breakdown.

For one GatedDeltaNet shape of ``benchmarks/bench_gates.py`` (its inputs: softplus gate, every input requiring
grad, fixed dO and dht), and each ``--segments`` value (0: the heuristic of ``cute_kda/context_parallel.py``; an
int: ``kda_forward(..., segments=N)`` under ``chunk_gated_delta_rule``'s translation, which recomputes the states in
the backward as FLA's does unless ``--disable-recompute``):

- the median fwd+bwd step and the median forward (``median_ms``: ``triton.testing.do_bench``, L2 cleared);
- the gradients' rel-RMS against those of the first value listed (segments change the rounding of the states
  entering each segment only);
- torch.profiler's device time per kernel group of ``benchmarks/bench_train.py`` over five steps, and the
  heaviest kernels.

    python benchmarks/probe_gdn_segments.py --shape gdn_T32768_H16_HV32 --segments 0,4,8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_CUTE_KDA", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import add_switches, apply_switches, median_ms  # noqa: E402
from cute_kda.api import kda_forward  # noqa: E402
from cute_kda.fla_calls import translate_fla_gdn_call  # noqa: E402
from cute_kda.reference import rel_rms  # noqa: E402

from bench_gates import GDN_SHAPES, GDN_SWITCHES, training_problem  # noqa: E402
from bench_train import kernel_breakdown, profile_kernels, top_kernels  # noqa: E402

POSITIONAL = ("q", "k", "v", "g", "beta")
PROFILE_STEPS = 5


def segment_counts(text: str) -> list[int]:
    """``"0,4,8"`` → ``[0, 4, 8]``; 0 is the heuristic."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"segment counts are >= 0 (0: the heuristic), got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(GDN_SHAPES), default="gdn_T32768_H16_HV32")
    parser.add_argument("--segments", type=segment_counts, default=[0, 4, 8],
                        help="comma-separated segment counts per sequence (0: the heuristic)")
    parser.add_argument("--disable-recompute", action="store_true",
                        help="the forward keeps K1's workspace and the per-tile states for the backward "
                             "(disable_recompute=True), as every GatedDeltaNet step before perf-log GDN8 did")
    add_switches(parser, GDN_SWITCHES)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_gdn_segments needs a CUDA GPU (Hopper)")
    apply_switches(args, GDN_SWITCHES)
    device = torch.device("cuda")
    inputs, leaves, do, dht = training_problem(args.shape, "gdn_softplus", device)
    positional = [inputs[name] for name in POSITIONAL]
    keywords = {name: value for name, value in inputs.items() if name not in POSITIONAL}
    first = None
    for segments in args.segments:
        def forward():
            call = translate_fla_gdn_call(*positional, disable_recompute=args.disable_recompute, **keywords)
            return call.run(lambda *a, **options: kda_forward(*a, segments=segments or None,
                                                               recompute=call.recompute, **options))

        def step():
            for name in leaves:
                inputs[name].grad = None
            o, state = forward()
            torch.autograd.backward((o, state), (do, dht))

        step()  # compile outside the timing
        grads = [inputs[name].grad.clone() for name in leaves]
        first = grads if first is None else first
        agreement = " ".join(f"{name} {rel_rms(a, b):.1e}" for name, a, b in zip(leaves, grads, first))
        with torch.no_grad():
            forward_ms = median_ms(forward, 25, 200)
        step_ms = median_ms(step, 25, 300)
        label = "heuristic" if segments == 0 else f"{segments} segments"
        print(f"\n{args.shape}, {label}: step {step_ms:.3f} ms, forward {forward_ms:.3f} ms; gradients against "
              f"the first setting's: {agreement}")
        kernels = profile_kernels(step, PROFILE_STEPS)
        for group, (ms, launches) in kernel_breakdown(kernels, PROFILE_STEPS).items():
            print(f"    {group:16s} {ms:7.3f} ms  {launches:5.1f} launches")
        for name, group, ms, launches in top_kernels(kernels, PROFILE_STEPS, 6):
            print(f"      {ms:7.3f} ms {launches:4.1f}x  {group:12s} {name[:80]}")


if __name__ == "__main__":
    main()
