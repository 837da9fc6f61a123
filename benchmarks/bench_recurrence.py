"""K2 (chunk recurrence) alone: median time per shape and V-split, µs per tile step, registers and smem.

The workspace comes from the mirror's K1 (``cute_kda.reference.mirror_prepare``), so K2 is timed on
its own; states are fp32 in and out (FlashKDA's setting in design.md §6). K2 is serial over the
tiles of a sequence, so the figure of merit for few (sequence, head) pairs is the time per tile
step: ``time / max_s ceil(len_s / 16)``. Each shape runs at the automatic V-split and at 1, 2, 4.
Times are medians over CUDA-graph replays of one launch (``cute_kda._bench.median_ms``: Triton's
``do_bench`` with the L2 cleared, or CUDA events).

The last column is the *whole forward* (K1 + K2) time to beat from design.md §6 (FlashKDA, fp32
state), for scale; K2 alone should take a good part less.

    python benchmarks/bench_recurrence.py                        # the six shapes of issue 4
    python benchmarks/bench_recurrence.py --shapes B1_T32768_H16 --out benchmarks/results/recurrence.md
    python benchmarks/bench_recurrence.py --resources            # registers / smem per variant, on a CPU
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import add_run_arguments, environment, graph_median_ms, markdown_table, median_ms, publish  # noqa: E402
from cute_kda.numerics import SUPPORTED_VSPLITS  # noqa: E402
from cute_kda.workspace import CHUNK  # noqa: E402

from shapes import D, LOWER_BOUND, SHAPES, Shape, make_inputs  # noqa: E402


def _inputs(shape: Shape, device: torch.device):
    """(v, workspace from the mirror's K1, cu_seqlens, fp32 initial state ``[N, H, V, K]``) for ``shape``."""
    from cute_kda.reference import mirror_prepare

    inputs = make_inputs(shape, device)
    ws = mirror_prepare(inputs["q"], inputs["k"], inputs["g"], inputs["beta"], A_log=inputs["A_log"],
                        dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND, cu_seqlens=inputs["cu_seqlens"])
    return inputs["v"], ws, inputs["cu_seqlens"], inputs["initial_state"]


@functools.lru_cache(maxsize=None)  # one compile per variant, not per shape
def _resources(vsplit: int, varlen: bool) -> tuple[str, int]:
    """(registers per thread, shared memory bytes per CTA) of the fp32-state variant.

    Compiled here from small CPU tensors; the register count needs a ptxas that reads the DSL's PTX
    version (the pip toolkit of ``make test``'s venv does; the H200 image's CUDA 13.0 ptxas does not,
    so a GPU run reports 'n/a' and ``--resources`` on the CPU fills the column).
    """
    from cute_kda.compile_report import compile_with_report
    from cute_kda.dsl import cute, cutlass
    from cute_kda.kernels.fwd_recurrence import FwdRecurrence
    from cute_kda.layouts.fwd_recurrence import RecurrenceSmemPlan
    from cute_kda.ops import recurrence as k2
    from cute_kda.ops._cache import to_cute_tensor
    from cute_kda.workspace import WorkspaceSpec, allocate_workspace

    smem = RecurrenceSmemPlan(vsplit=vsplit, state_io_fp32=True).total_bytes
    heads, tokens = 2, 40
    v = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
    state = torch.zeros(2 if varlen else 1, heads, D, D)
    args = k2.launch_arguments(
        v, allocate_workspace(WorkspaceSpec(heads=heads, tiles=4), "cpu"), torch.zeros_like(v),
        cu_seqlens=torch.tensor([0, 17, tokens]) if varlen else None,
        tile_base=torch.tensor([0, 2, 4], dtype=torch.int32) if varlen else None,
        initial_state=state, final_state=state, tensor=to_cute_tensor,
    )
    kernel = FwdRecurrence(vsplit=vsplit, initial_state=cutlass.Float32, final_state=cutlass.Float32, varlen=varlen)
    try:
        _, report = compile_with_report(kernel, *args, cute.runtime.make_fake_stream())
    except (FileNotFoundError, RuntimeError) as error:
        print(f"no register count ({str(error).splitlines()[-1]})", file=sys.stderr)
        return "n/a", smem
    return str(report.kernels[0].registers), smem


def resources_table() -> str:
    """Registers and smem of every V-split, fixed length and varlen (CPU compile, no GPU needed)."""
    rows = [[str(vsplit), "varlen" if varlen else "fixed", *map(str, _resources(vsplit, varlen))]
            for vsplit in SUPPORTED_VSPLITS for varlen in (False, True)]
    return markdown_table(["VSplit", "batching", "registers", "smem / CTA (B)"], rows)


def run(name: str, warmup: int, rep: int) -> list[dict]:
    from cute_kda.device import sm_count
    from cute_kda.ops import recurrence as k2
    from cute_kda.variants import RecurrenceVariant

    shape = SHAPES[name]
    lengths, heads, varlen = shape.lengths, shape.heads, shape.varlen
    device = torch.device("cuda")
    v, ws, cu_seqlens, initial = _inputs(shape, device)
    out = torch.empty_like(v)
    final = torch.empty_like(initial)
    tile_base = k2.tile_bases(cu_seqlens) if varlen else None
    steps = max((n + CHUNK - 1) // CHUNK for n in lengths)
    auto = RecurrenceVariant.choose_vsplit(len(lengths), heads, sm_count(device.index or 0))
    rows = []
    for vsplit in SUPPORTED_VSPLITS:

        def launch(vsplit=vsplit):
            k2.recurrence(v, ws, out, cu_seqlens=cu_seqlens, tile_base=tile_base, initial_state=initial,
                          final_state=final, vsplit=vsplit)

        launch()  # compile outside the timing
        torch.cuda.synchronize()
        ms = graph_median_ms(launch, warmup, rep)
        if ms is None:  # capture failed: eager timing
            ms = median_ms(launch, warmup, rep)
        registers, smem = _resources(vsplit, varlen)
        rows.append(dict(shape=name, vsplit=vsplit, auto=vsplit == auto, ctas=len(lengths) * heads * vsplit,
                         steps=steps, ms=ms, us_per_step=1e3 * ms / steps, registers=registers, smem=smem,
                         forward_bar=shape.flashkda_ms))
        print(f"{name} vsplit={vsplit}: {ms:.3f} ms, {1e3 * ms / steps:.2f} µs/tile step", file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["shape", "VSplit", "CTAs", "tile steps", "K2 median ms", "µs / tile step", "registers", "smem / CTA (B)",
            "forward bar ms (FlashKDA)"]
    return markdown_table(head, [
        [r["shape"], f"**{r['vsplit']}** (auto)" if r["auto"] else str(r["vsplit"]), str(r["ctas"]), str(r["steps"]),
         f"{r['ms']:.3f}", f"{r['us_per_step']:.2f}", str(r["registers"]), str(r["smem"]), f"{r['forward_bar']:.2f}"]
        for r in rows
    ])


def header() -> str:
    return (f"{environment('cutlass', labels={'cutlass': 'cutlass-dsl'})} · K2 alone, D={D}, fp32 state in and out, "
            "workspace from the mirror")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    parser.add_argument("--resources", action="store_true",
                        help="only the registers/smem table of each variant (compiled for sm_90a, no GPU needed)")
    args = parser.parse_args()
    if args.resources:
        publish(f"K2 resources, fp32 state in and out (sm_90a compile)\n\n{resources_table()}\n", args.out)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_recurrence needs a CUDA GPU (Hopper)")

    with torch.inference_mode():
        rows = [row for name in args.shapes for row in run(name, args.warmup, args.rep)]
    publish(f"{header()}\n\n{markdown(rows)}\n", args.out)


if __name__ == "__main__":
    main()
