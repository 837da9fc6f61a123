"""Kernel B alone: the tile-gradient kernel timed on the benchmark shapes, per compute-warp count.

Its inputs are made by the kernels themselves once per shape (K1's workspace, the training forward's
per-tile checkpoints, Kernel A's snapshots and du), then ``cute_kda.ops.bwd_grads.bwd_grads`` is timed
alone: median of CUDA-graph replays (events when capture fails). Also printed: the bytes Kernel B
reads and writes per call and the bandwidth that makes, and µs per wave of (tile, head) CTAs (as many
CTAs an SM as the smem plan is sized for, ``layouts.bwd_grads.CTAS_PER_SM``).

    python benchmarks/bench_bwd_grads.py                                 # six shapes, 4 and 8 warps
    python benchmarks/bench_bwd_grads.py --shapes B1_T8192_H96 --warps 8
    python benchmarks/bench_bwd_grads.py --warps 8 --gate-ahead off,on --split-load off,on   # A/B of B5, B6
    python benchmarks/bench_bwd_grads.py --warps 8 --gate-ahead on --split-load on --split-rows off,on   # B7
    python benchmarks/bench_bwd_grads.py --shapes B8_T4096_H32,B1_T8192_H96 --warps 8 --slopes-ahead off,on   # B8
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cute_kda._bench import add_run_arguments, environment, graph_median_ms, markdown_table, median_ms, publish  # noqa: E402
from cute_kda.workspace import CHUNK, WorkspaceSpec, tiles_per_head  # noqa: E402

from shapes import D, LOWER_BOUND, SHAPES, Shape  # noqa: E402

TOKEN_TILES_READ = 6  # q, k, g, v, dO, du


def grads_traffic(lengths: tuple[int, ...] | list[int], heads: int) -> tuple[int, int]:
    """(bytes read, bytes written) by one Kernel B call: per real tile and head the six bf16 token tiles,
    the two bf16 state matrices, INV and β; per token dq, dk, dg (bf16) and dβ; per tile slot the partials."""
    tiles = sum(-(-n // CHUNK) for n in lengths)
    tokens = sum(lengths)
    read = heads * tiles * (TOKEN_TILES_READ * CHUNK * D * 2 + 2 * D * D * 2 + CHUNK * CHUNK * 2 + CHUNK * 4)
    written = heads * tokens * (3 * D * 2 + 2) + heads * tiles * (D + 1) * 4
    return read, written


def parse_warps(text: str) -> list[int]:
    from cute_kda.layouts.bwd_grads import COMPUTE_WARPS

    warps = [int(w) for w in text.split(",") if w]
    bad = [w for w in warps if w not in COMPUTE_WARPS]
    if bad or not warps:
        raise argparse.ArgumentTypeError(f"--warps takes a comma list of {COMPUTE_WARPS}, got {text!r}")
    return warps


def parse_switch(text: str) -> list[bool]:
    """``off``, ``on`` or both (``off,on``): the settings of one of the launcher's switches (``GATE_AHEAD``,
    ``SPLIT_LOAD``, ``SPLIT_ROWS``, ``SLOPES_AHEAD``; docs/perf-log.md, B5-B8) to time, each a row."""
    names = [name for name in text.split(",") if name]
    if not names or any(name not in ("off", "on") for name in names):
        raise argparse.ArgumentTypeError(f"a switch takes off, on or off,on, got {text!r}")
    return [name == "on" for name in names]


def _chain_inputs(shape: Shape, device: torch.device) -> dict:
    """Kernel B's arguments for ``shape``, made by K1, K2 (training) and Kernel A."""
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.ops import bwd_scan as ka
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.workspace import allocate_workspace, block_states_shape

    from shapes import make_inputs

    x = make_inputs(shape, device)
    b, t, h = x["q"].shape[:3]
    cu = x["cu_seqlens"]
    n = len(shape.lengths)
    ws = allocate_workspace(WorkspaceSpec(heads=h, tiles=tiles_per_head(b * t, n, cu is not None)), device)
    tile_base = k1.tile_bases(cu) if cu is not None else None
    k1.prepare(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], ws, scale=D ** -0.5,
               lower_bound=LOWER_BOUND, cu_seqlens=cu, tile_base=tile_base)
    states = torch.empty(block_states_shape(ws, h, n), dtype=torch.bfloat16, device=device)
    k2.recurrence(x["v"], ws, torch.empty_like(x["v"]), cu_seqlens=cu, tile_base=tile_base,
                  initial_state=x["initial_state"], final_state=None, checkpoints=states)
    do = torch.randn_like(x["v"])
    dv, du, grads = torch.empty_like(do), torch.empty_like(do), torch.empty_like(states)
    ka.bwd_scan(do, ws, dv, du, grads, cu_seqlens=cu, tile_base=tile_base)
    ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, h)
    return dict(
        q=x["q"], k=x["k"], g=x["g"], v=x["v"], do=do, du=du, ws=ws, states=states, state_grads=grads,
        A_log=x["A_log"], dt_bias=x["dt_bias"], dq=torch.empty_like(x["q"]), dk=torch.empty_like(x["k"]),
        dg=torch.empty_like(x["g"]), dbeta=torch.empty_like(x["beta"]),
        ddt_partial=torch.empty(ddt_shape, device=device), dalog_partial=torch.empty(dalog_shape, device=device),
        scale=D ** -0.5, lower_bound=LOWER_BOUND, cu_seqlens=cu, tile_base=tile_base,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    parser.add_argument("--warps", type=parse_warps, default=parse_warps("4,8"), help="compute warps per CTA")
    parser.add_argument("--gate-ahead", type=parse_switch, default=[True],
                        help="the gate backward's raw gate loaded in one burst: off, on or off,on (default on, as "
                             "calls run)")
    parser.add_argument("--split-load", type=parse_switch, default=[False],
                        help="the state images behind their own barrier: off, on or off,on (default off)")
    parser.add_argument("--split-rows", type=parse_switch, default=[False],
                        help="the safe gate backward's rows on all 8 warps: off, on or off,on (default off)")
    parser.add_argument("--slopes-ahead", type=parse_switch, default=[True],
                        help="the safe gate backward's rows' x and σ'(x) formed before its row loop: off, on or "
                             "off,on (default on, as calls run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_bwd_grads needs a CUDA GPU (Hopper)")
    from cute_kda.layouts.bwd_grads import CTAS_PER_SM
    from cute_kda.ops import bwd_grads as kb

    device = torch.device("cuda")
    wave = torch.cuda.get_device_properties(device).multi_processor_count * CTAS_PER_SM
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        inputs = _chain_inputs(shape, device)
        read, written = grads_traffic(shape.lengths, shape.heads)
        for warps, ahead, split, rows_split, slopes in itertools.product(args.warps, args.gate_ahead, args.split_load,
                                                                         args.split_rows, args.slopes_ahead):
            def call():
                kb.bwd_grads(**inputs, compute_warps=warps)

            # read by the launcher at each call (and at a graph's capture)
            kb.GATE_AHEAD, kb.SPLIT_LOAD, kb.SPLIT_ROWS, kb.SLOPES_AHEAD = ahead, split, rows_split, slopes
            call()
            ms = graph_median_ms(call, args.warmup, args.rep)
            if ms is None:
                ms = median_ms(call, args.warmup, args.rep)
            tiles = sum(-(-n // CHUNK) for n in shape.lengths) * shape.heads
            switches = ("on" if on else "off" for on in (ahead, split, rows_split, slopes))
            rows.append([name, str(warps), *switches, f"{ms:.3f}", f"{(read + written) / ms / 1e9:.2f}",
                         f"{ms * 1e3 / math.ceil(tiles / wave):.2f}"])
            print(" ".join(rows[-1]), file=sys.stderr)
    head = ["shape", "warps", "gate_ahead", "split_load", "split_rows", "slopes_ahead", "Kernel B ms",
            "TB/s (bytes read + written)", f"µs per CTA wave ({CTAS_PER_SM} CTAs an SM)"]
    publish(f"{environment('cutlass')}\n\n`{' '.join(sys.argv)}`\n\n{markdown_table(head, rows)}\n", args.out)


if __name__ == "__main__":
    main()
