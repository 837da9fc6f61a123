"""The two-tile prefill (docs/numerics.md, "Two tiles a serial step") beside today's, kernel by kernel: K1 and its
pair variant, K2 and its pair variant (at the automatic V-split), medians in one run on the same inputs, fp32 states
in and out; with the accuracy of both forwards against each other. ``--gate safe`` (the default) or ``per_head``
(GatedDeltaNet's: the shape's heads as value heads, one softplus decay a head and token).

    python benchmarks/bench_pair_prefill.py                               # the six shapes of the forward
    python benchmarks/bench_pair_prefill.py --shapes B1_T32768_H16 --gate per_head --out benchmarks/results/pairs.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import (  # noqa: E402
    add_run_arguments, environment, graph_median_ms, markdown_table, median_ms, publish,
)
from cute_kda.workspace import CHUNK  # noqa: E402

from shapes import D, LOWER_BOUND, SHAPES, make_inputs  # noqa: E402


def _median(launch, warmup: int, rep: int) -> float:
    launch()  # compile outside the timing
    torch.cuda.synchronize()
    ms = graph_median_ms(launch, warmup, rep)
    return median_ms(launch, warmup, rep) if ms is None else ms


def gate_inputs(x: dict, gate: str) -> tuple[dict, str]:
    """``make_inputs``' tensors for ``gate`` ("safe", or "per_head": one softplus decay a head and token with a
    Kimi-like A_log) and K1's gate name."""
    if gate != "per_head":
        return x, "safe"
    x["g"], x["dt_bias"] = x["g"][..., 0].contiguous(), x["dt_bias"][:, 0].contiguous()
    x["A_log"] = torch.log(1 + 15 * torch.rand_like(x["A_log"]))
    return x, "softplus"


def run(name: str, warmup: int, rep: int, gate: str = "safe") -> dict:
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.reference import rel_rms
    from cute_kda.workspace import WorkspaceSpec, allocate_cross_blocks, allocate_workspace, tiles_per_head

    shape = SHAPES[name]
    x, gate_name = gate_inputs(make_inputs(shape, torch.device("cuda")), gate)
    cu = x["cu_seqlens"]
    tile_base = k1.tile_bases(cu) if cu is not None else None
    num_seqs = len(shape.lengths)
    spec = WorkspaceSpec(heads=shape.heads, tiles=tiles_per_head(shape.batch * shape.seq_len, num_seqs,
                                                                 shape.varlen))
    row = dict(shape=name, steps=max((n + CHUNK - 1) // CHUNK for n in shape.lengths))
    outputs = {}
    for pairs in (False, True):
        ws = allocate_workspace(spec, "cuda")
        cross = allocate_cross_blocks(spec, "cuda") if pairs else None
        out, final = torch.empty_like(x["v"]), torch.empty_like(x["initial_state"])

        def prepare():
            k1.prepare(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], ws, scale=D ** -0.5,
                       lower_bound=LOWER_BOUND, cu_seqlens=cu, tile_base=tile_base, gate=gate_name, cross=cross)

        def recurrence():
            k2.recurrence(x["v"], ws, out, cu_seqlens=cu, tile_base=tile_base, initial_state=x["initial_state"],
                          final_state=final, cross=cross)

        label = "pairs" if pairs else "today"
        row[f"k1_{label}"] = _median(prepare, warmup, rep)
        row[f"k2_{label}"] = _median(recurrence, warmup, rep)
        prepare()
        recurrence()
        torch.cuda.synchronize()
        outputs[pairs] = out.clone(), final.clone()
        print(f"{name} {label}: K1 {row[f'k1_{label}']:.3f} ms, K2 {row[f'k2_{label}']:.3f} ms", file=sys.stderr)
    row["o_diff"] = rel_rms(outputs[True][0], outputs[False][0])
    row["state_diff"] = rel_rms(outputs[True][1], outputs[False][1])
    return row


def markdown(rows: list[dict]) -> str:
    head = ["shape", "tile steps", "K1 ms", "K1 pairs ms", "K2 ms", "K2 pairs ms", "K2 pairs / K2", "K1 + K2 ms",
            "pairs K1 + K2 ms", "ratio", "o rel-RMS pairs vs today", "state"]
    cells = []
    for r in rows:
        today, pairs = r["k1_today"] + r["k2_today"], r["k1_pairs"] + r["k2_pairs"]
        cells.append([r["shape"], str(r["steps"]), f"{r['k1_today']:.3f}", f"{r['k1_pairs']:.3f}",
                      f"{r['k2_today']:.3f}", f"{r['k2_pairs']:.3f}", f"{r['k2_pairs'] / r['k2_today']:.3f}",
                      f"{today:.3f}", f"{pairs:.3f}", f"{pairs / today:.3f}", f"{r['o_diff']:.2e}",
                      f"{r['state_diff']:.2e}"])
    return markdown_table(head, cells)


def pair_bench(doc: str, script: str, run_shape, table, what: str) -> None:
    """The command line of a two-tile benchmark: ``--gate`` and the run arguments, ``run_shape(name, warmup, rep,
    gate)`` a row per shape, ``table(rows)`` published under a header naming ``what`` it compares."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    parser.add_argument("--gate", choices=("safe", "per_head"), default="safe",
                        help="the safe gate per channel, or a per-head softplus gate (GatedDeltaNet's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (Hopper)")
    with torch.inference_mode():
        rows = [run_shape(name, args.warmup, args.rep, args.gate) for name in args.shapes]
    header = f"{environment('cutlass', labels={'cutlass': 'cutlass-dsl'})} · {what}, D={D}, {args.gate} gate"
    publish(f"{header}\n\n{table(rows)}\n", args.out)


def main() -> None:
    pair_bench(__doc__, "bench_pair_prefill", run, markdown,
               "the two-tile prefill beside today's, fp32 state in and out")


if __name__ == "__main__":
    main()
