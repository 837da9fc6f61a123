"""Kernel A's tuning knobs, timed: compute warps, output stages and a split G2 accumulator per V-split.

For each shape (``benchmarks/shapes.py``) and each (V-split, :class:`cute_kda.variants.ScanTuning`)
of the grid, Kernel A alone on the K1 workspace of the shape's inputs (fp32 dht in, fp32 dh0 out),
median ms of CUDA-graph replays and µs per serial 16-token step; a row per variant. This is how the
defaults of ``ScanTuning`` are chosen (docs/perf-log.md); ``benchmarks/bench_bwd.py`` is the benchmark.

    python benchmarks/explore_bwd_scan.py --shapes B1_T8192_H96,B1_T32768_H16
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kda._bench import add_run_arguments, environment, graph_median_ms, markdown_table, publish  # noqa: E402
from shapes import D, LOWER_BOUND, SHAPES, make_inputs  # noqa: E402

GRID = {  # V-split → compute-warp counts that split its band into multiples of 8 columns
    1: (4, 8),
    2: (4, 8),
    4: (4,),
    8: (2,),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    parser.add_argument("--vsplits", default="1,2,4,8", help="comma-separated V-splits")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("explore_bwd_scan needs a CUDA GPU")
    from cute_kda.ops.bwd_scan import bwd_scan
    from cute_kda.ops.prepare import prepare, tile_bases
    from cute_kda.variants import ScanTuning
    from cute_kda.workspace import WorkspaceSpec, allocate_workspace, block_states_shape, tiles_per_head

    device = torch.device("cuda")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        inputs = make_inputs(shape, device)
        cu = inputs["cu_seqlens"]
        tile_base = tile_bases(cu) if cu is not None else None
        n, heads = len(shape.lengths), shape.heads
        ws = allocate_workspace(WorkspaceSpec(heads=heads, tiles=tiles_per_head(shape.batch * shape.seq_len, n,
                                                                                 shape.varlen)), device)
        prepare(inputs["q"], inputs["k"], inputs["g"], inputs["beta"], inputs["A_log"], inputs["dt_bias"], ws,
                scale=D ** -0.5, lower_bound=LOWER_BOUND, cu_seqlens=cu, tile_base=tile_base)
        do = torch.randn_like(inputs["v"])
        dv, du = torch.empty_like(do), torch.empty_like(do)
        snaps = torch.empty(block_states_shape(ws, heads, n), dtype=torch.bfloat16, device=device)
        dht = 0.1 * torch.randn(n, heads, D, D, device=device)
        dh0 = torch.empty_like(dht)
        steps = max(-(-length // 16) for length in shape.lengths)
        for vsplit in (int(v) for v in args.vsplits.split(",")):
            for warps, stages, split in itertools.product(GRID[vsplit], (2, 4), (False, True)):
                tuning = ScanTuning(compute_warps=warps, output_stages=stages, split_accumulator=split)

                def launch(vsplit=vsplit, tuning=tuning):
                    bwd_scan(do, ws, dv, du, snaps, cu_seqlens=cu, tile_base=tile_base, dht=dht, dh0=dh0,
                             vsplit=vsplit, tuning=tuning)

                launch()
                torch.cuda.synchronize()
                ms = graph_median_ms(launch, args.warmup, args.rep)
                rows.append([name, str(vsplit), str(warps), str(stages), "yes" if split else "no",
                             f"{ms:.3f}", f"{1e3 * ms / steps:.2f}"])
                print(" | ".join(rows[-1]), file=sys.stderr)
        del inputs, ws, do, dv, du, snaps
        torch.cuda.empty_cache()
    head = ["shape", "V-split", "compute warps", "output stages", "split G2", "median ms", "µs / step"]
    publish(f"# Kernel A tuning\n\n{environment('cutlass')}\n\n{markdown_table(head, rows)}\n", args.out)


if __name__ == "__main__":
    main()
