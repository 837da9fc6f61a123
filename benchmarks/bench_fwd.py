"""Forward benchmark: cute_kda against FLA's chunk_kda (and FlashKDA when importable), same inputs, one run.

Shapes are design.md §6's (D = 128, fp32 state in and out in the v-first layout, as FlashKDA's
measured row). Every peer gets identical tensors; times are medians of ``triton.testing.do_bench``
(which clears L2 before every repetition) or, without Triton, of CUDA-event timings with an L2
flush in between. The markdown table is printed last and written to ``--out`` (default
``$OUT/fwd-<date>.md`` when ``$OUT`` is set, else ``benchmarks/results/fwd-<date>.md``) after every
shape, so a run cut short keeps what it measured; a bar chart PNG of the times is drawn next to it
(needs matplotlib; without it the script says so and writes the table only). Peers that are not
installed are skipped with a message.

    python benchmarks/bench_fwd.py                       # all shapes
    python benchmarks/bench_fwd.py --shapes B1_T8192_H96,B1_T32768_H16 --out /tmp/fwd.md
    python benchmarks/bench_fwd.py --dtype fp16 --shapes B1_T8192_H96   # q, k, v, g, β in fp16 (o fp16)
    python benchmarks/bench_fwd.py --shapes B1_T8192_H96,B1_T32768_H16 --head-dim 64   # K = V = 64 beside FLA

``--head-dim`` below 128: cute_kda runs K = V = 64 on the kernels compiled for 64 (an inference call), other head dims
zero-padded to 128 (``cute_kda.call``: the D = 128 call plus the padding copies); the table's header says which.
FLA runs at that head dim; FlashKDA (D = 128 only) is skipped and design.md §6's FlashKDA column left empty.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Callable

os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton path, not its FlashKDA dispatch
os.environ.setdefault("FLA_CUTE_KDA", "0")  # nor its dispatch to cute_kda (cute_kda.fla_backend)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import add_run_arguments, environment, markdown_table, median_ms, publish  # noqa: E402
from cute_kda.reference import rel_rms  # noqa: E402

from shapes import D, LOWER_BOUND, SHAPES, Shape, head_dim, head_dim_note, make_inputs  # noqa: E402


def peers(inputs: dict) -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """name → zero-argument forward producing (o, final state ``[N, H, V, K]`` fp32); absent peers are said so
    (FlashKDA also at a head dim other than 128, which it does not take)."""
    import cute_kda

    dim = inputs["q"].shape[-1]
    scale = dim ** -0.5
    tensors = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    out = torch.empty_like(inputs["v"])
    final = torch.empty_like(inputs["initial_state"])
    fla_kwargs = dict(
        scale=scale, initial_state=inputs["initial_state"], output_final_state=True, use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
        A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], state_v_first=True, cu_seqlens=inputs["cu_seqlens"],
    )
    runs = {
        "cute_kda": lambda: cute_kda.kda_forward(
            *tensors, scale=scale, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND,
            initial_state=inputs["initial_state"], cu_seqlens=inputs["cu_seqlens"], out=out, final_state=final),
        "cute_kda chunk_kda": lambda: cute_kda.chunk_kda(*tensors, **fla_kwargs),
    }
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        runs["FLA chunk_kda"] = lambda: fla_chunk_kda(*tensors, **fla_kwargs)
    except ImportError as error:
        print(f"FLA not importable, skipped: {error}", file=sys.stderr)
    if dim != D:
        print(f"FlashKDA takes D = {D} only: skipped at D = {dim}", file=sys.stderr)
        return runs
    try:
        import flash_kda

        flash_out, flash_final = torch.empty_like(out), torch.empty_like(final)

        def run_flash_kda():
            flash_kda.fwd(*tensors, scale, flash_out, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
                          lower_bound=LOWER_BOUND, initial_state=inputs["initial_state"], final_state=flash_final,
                          cu_seqlens=inputs["cu_seqlens"])
            return flash_out, flash_final

        runs["FlashKDA"] = run_flash_kda
    except ImportError as error:
        print(f"FlashKDA not importable, skipped: {error}", file=sys.stderr)
    return runs


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench_shape(name: str, shape: Shape, device: torch.device, warmup: int, rep: int,
                dtype: torch.dtype = torch.bfloat16, dim: int = D) -> dict:
    inputs = make_inputs(shape, device, dtype=dtype, dim=dim)
    runs = peers(inputs)
    row = {"shape": name, "ms": {}, "err": {}, "flashkda_design_ms": shape.flashkda_ms if dim == D else None}
    with torch.inference_mode():
        reference = None
        for peer, fn in runs.items():
            o, state = fn()  # first call: compile / autotune outside the timing
            o, state = o.clone(), state.clone()
            if "FLA chunk_kda" in runs and peer != "FLA chunk_kda":
                reference = reference or tuple(x.clone() for x in runs["FLA chunk_kda"]())
                row["err"][peer] = (rel_rms(o, reference[0]), rel_rms(state, reference[1]))
            row["ms"][peer] = median_ms(fn, warmup, rep)
            print(f"{name:18s} {peer:20s} {row['ms'][peer]:8.3f} ms", file=sys.stderr)
    del inputs, runs
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], peers_seen: list[str]) -> str:
    ours = "cute_kda"
    others = [p for p in peers_seen if p != ours]
    head = ["shape"] + [f"{p} (ms)" for p in peers_seen] + [f"{p} / {ours}" for p in others]
    head += ["FlashKDA, design.md §6 (ms)", f"§6 FlashKDA / {ours}"]
    head += [f"{p} vs FLA rel-RMS o / state" for p in peers_seen if p != "FLA chunk_kda"]
    table = []
    for row in rows:
        ms = row["ms"]
        cells = [row["shape"]] + [f"{ms[p]:.3f}" if p in ms else "—" for p in peers_seen]
        cells += [f"{ms[p] / ms[ours]:.2f}×" if p in ms and ours in ms else "—" for p in others]
        design = row["flashkda_design_ms"]
        cells += [f"{design:.2f}", f"{design / ms[ours]:.2f}×" if ours in ms else "—"] if design else ["—", "—"]
        cells += [f"{row['err'][p][0]:.1e} / {row['err'][p][1]:.1e}" if p in row["err"] else "—"
                  for p in peers_seen if p != "FLA chunk_kda"]
        table.append(cells)
    return markdown_table(head, table)


def header(dtype: str = "bf16", dim: int = D) -> str:
    padded = head_dim_note(dim)
    return (f"{environment('cutlass', 'fla', 'triton')} · D={dim}{padded}, {dtype} q, k, v, g and o, fp32 state in/out "
            f"(v-first), lower_bound={LOWER_BOUND}; ratios > 1 mean cute_kda is faster")


def draw_chart(rows: list[dict], path: str) -> bool:
    """Grouped bars of the median times per shape and peer; False (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart drawn", file=sys.stderr)
        return False
    peers_seen = list(dict.fromkeys(p for row in rows for p in row["ms"]))
    width = 0.8 / max(len(peers_seen), 1)
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    for i, peer in enumerate(peers_seen):
        xs = [j + i * width for j, row in enumerate(rows) if peer in row["ms"]]
        ys = [row["ms"][peer] for row in rows if peer in row["ms"]]
        bars = ax.bar(xs, ys, width, label=peer)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(peers_seen) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([row["shape"] for row in rows], rotation=15, fontsize=8)
    ax.set_ylabel("forward, median ms (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def default_out(dim: int = D) -> str:
    folder = os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results")
    kind = "fwd" if dim == D else f"fwd-d{dim}"
    return os.path.join(folder, f"{kind}-{datetime.date.today()}.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="q, k, v, g (and o) dtype; fp16 runs the kernels' fp16 variants (default bf16)")
    parser.add_argument("--head-dim", type=head_dim, default=D,
                        help=f"K = V of every input (default {D}; 64 runs on cute_kda's D = 64 kernels, other smaller "
                        f"ones zero-padded to {D})")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fwd needs a CUDA GPU (Hopper)")

    out = args.out or default_out(args.head_dim)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    device = torch.device("cuda")
    rows: list[dict] = []
    for name in args.shapes:
        rows.append(bench_shape(name, SHAPES[name], device, args.warmup, args.rep, DTYPES[args.dtype], args.head_dim))
        seen = list(dict.fromkeys(p for row in rows for p in row["ms"]))
        table = f"{header(args.dtype, args.head_dim)}\n\n{markdown(rows, seen)}\n"
        with open(out, "w") as f:  # after every shape: a run cut short keeps what it measured
            f.write(table)
    publish(table, out)
    draw_chart(rows, os.path.splitext(out)[0] + ".png")


if __name__ == "__main__":
    main()
