"""Two kda_forward calls on one design.md §6 shape, for a profiler: the first compiles, the second is the one to read.

Nsight Compute on K1 and K2 of the second call (achieved occupancy, bandwidth, warp stalls):

    ncu --clock-control none -k 'regex:fwd_prepare|FwdRecurrence' --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/profile_forward.py --shape B1_T8192_H96

(varlen shapes also launch the tile-prefix kernel, which the filter leaves out.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from shapes import D, LOWER_BOUND, SHAPES, make_inputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="B1_T8192_H96")
    parser.add_argument("--vsplit", type=int, choices=(1, 2, 4), help="K2's V-split (automatic by default)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_forward needs a CUDA GPU (Hopper)")

    import cute_kda

    inputs = make_inputs(SHAPES[args.shape], torch.device("cuda"))
    out = torch.empty_like(inputs["v"])
    final = torch.empty_like(inputs["initial_state"])
    for _ in range(2):
        cute_kda.kda_forward(
            *(inputs[name] for name in ("q", "k", "v", "g", "beta")), scale=D ** -0.5, A_log=inputs["A_log"],
            dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND, initial_state=inputs["initial_state"],
            cu_seqlens=inputs["cu_seqlens"], out=out, final_state=final, vsplit=args.vsplit,
        )
    torch.cuda.synchronize()
    print(f"{args.shape}: two kda_forward calls done", file=sys.stderr)


if __name__ == "__main__":
    main()
