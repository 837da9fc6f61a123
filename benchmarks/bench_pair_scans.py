"""The training form of the two-tile step (W2 of docs/perf-log.md v8; planned, Kernel B's rebuild not built) beside
today's training scans, kernel by kernel: K2 keeping a checkpoint a tile against the pair K2 keeping a checkpoint and
tile a's U a pair, and Kernel A keeping a snapshot a tile against the pair scan keeping one a pair (both at the
automatic V-split), medians in one run on the same inputs (the mirror-free kernels' own K1 workspaces), with the
bytes each keeps. ``--gate safe`` (the default) or ``per_head`` (GatedDeltaNet's).

    python benchmarks/bench_pair_scans.py                                  # the six shapes of the forward
    python benchmarks/bench_pair_scans.py --shapes B1_T32768_H16 --gate per_head --out benchmarks/results/scans.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import markdown_table  # noqa: E402
from cute_kda.workspace import CHUNK  # noqa: E402

from bench_pair_prefill import _median, gate_inputs, pair_bench  # noqa: E402
from shapes import D, LOWER_BOUND, SHAPES, make_inputs  # noqa: E402


def run(name: str, warmup: int, rep: int, gate: str = "safe") -> dict:
    from cute_kda.ops import bwd_scan as ka
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.workspace import (
        WorkspaceSpec, allocate_cross_blocks, allocate_workspace, block_states_shape, pair_blocks_shape,
        pair_u_shape, tiles_per_head,
    )

    shape = SHAPES[name]
    x, gate_name = gate_inputs(make_inputs(shape, torch.device("cuda")), gate)
    cu = x["cu_seqlens"]
    tile_base = k1.tile_bases(cu) if cu is not None else None
    num_seqs, heads = len(shape.lengths), shape.heads
    spec = WorkspaceSpec(heads=heads, tiles=tiles_per_head(shape.batch * shape.seq_len, num_seqs, shape.varlen))
    do = torch.randn_like(x["v"])
    row = dict(shape=name, steps=max((n + CHUNK - 1) // CHUNK for n in shape.lengths))
    for pairs in (False, True):
        ws = allocate_workspace(spec, "cuda")
        cross = allocate_cross_blocks(spec, "cuda") if pairs else None
        k1.prepare(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], ws, scale=D ** -0.5,
                   lower_bound=LOWER_BOUND, cu_seqlens=cu, tile_base=tile_base, gate=gate_name, cross=cross)
        kept_shape = pair_blocks_shape(ws, heads, num_seqs) if pairs else block_states_shape(ws, heads, num_seqs)
        checkpoints, snapshots = (torch.empty(kept_shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        u_a = torch.empty(pair_u_shape(ws, heads, num_seqs), dtype=torch.bfloat16, device="cuda") if pairs else None
        out, dv, du = (torch.empty_like(x["v"]) for _ in range(3))

        def recurrence():
            k2.recurrence(x["v"], ws, out, cu_seqlens=cu, tile_base=tile_base, initial_state=x["initial_state"],
                          checkpoints=checkpoints, cross=cross, u_a=u_a)

        def scan():
            ka.bwd_scan(do, ws, dv, du, snapshots, cu_seqlens=cu, tile_base=tile_base,
                        snapshot_every=2 if pairs else 1, cross=cross)

        label = "pairs" if pairs else "today"
        row[f"k2_{label}"] = _median(recurrence, warmup, rep)
        row[f"ka_{label}"] = _median(scan, warmup, rep)
        kept = 2 * checkpoints.numel() + (0 if u_a is None else u_a.numel())
        row[f"kept_{label}"] = 2 * kept / 2 ** 20  # bf16 bytes, MiB
        print(f"{name} {label}: K2 {row[f'k2_{label}']:.3f} ms, Kernel A {row[f'ka_{label}']:.3f} ms",
              file=sys.stderr)
    return row


def markdown(rows: list[dict]) -> str:
    head = ["shape", "tile steps", "training K2 ms", "pair K2 ms", "ratio", "Kernel A ms", "pair scan ms", "ratio",
            "kept MiB", "pairs kept MiB"]
    cells = [[r["shape"], str(r["steps"]), f"{r['k2_today']:.3f}", f"{r['k2_pairs']:.3f}",
              f"{r['k2_pairs'] / r['k2_today']:.3f}", f"{r['ka_today']:.3f}", f"{r['ka_pairs']:.3f}",
              f"{r['ka_pairs'] / r['ka_today']:.3f}", f"{r['kept_today']:.0f}", f"{r['kept_pairs']:.0f}"]
             for r in rows]
    return markdown_table(head, cells)


def main() -> None:
    pair_bench(__doc__, "bench_pair_scans", run, markdown,
               "the two-tile training scans beside today's, fp32 initial state, no dht")


if __name__ == "__main__":
    main()
