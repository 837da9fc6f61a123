"""K1 (prepare) alone: time, bytes moved and bandwidth against the copy ceiling, with a same-size copy.

Bytes moved = inputs read once + workspace written once:

- read: q, k, g (bf16 ``[B·T, H, 128]`` each), beta (bf16 ``[B·T, H]``), A_log and dt_bias (fp32);
- written: per (head, tile) qd, kd, kr (3 × 4096 B), gT (512 B), INV, Mqk (2 × 512 B) and β (64 B)
  = 13 888 B (``cute_kda.workspace``).

The reference copy is a device-to-device ``copy_`` of half that many bytes (so it also reads and
writes the same total). K1 is timed twice: replaying a CUDA graph of one launch (the kernel alone)
and through ``cute_kda.ops.prepare.prepare`` (adds the host's DLPack conversion and launch). Times are medians of ``triton.testing.do_bench`` (L2 cleared before each
repetition) or, without Triton, of CUDA-event timings with an L2 flush in between.

    python benchmarks/bench_prepare.py                                   # B1 T8192 H96
    python benchmarks/bench_prepare.py --lengths 1300,547,2048,963,271,3063 --varlen
    python benchmarks/bench_prepare.py --out benchmarks/results/prepare.md
    python benchmarks/bench_prepare.py --gates safe,softplus,none --variants ''   # the unbounded gates' K1 beside

``--gates``: K1 of each gate form in the same run (CUDA graph of one launch): the safe gate, the softplus
gate (raw bf16 g) and a precomputed fp32 log decay (``none``: 2 more bytes per g element read, no A_log,
dt_bias), the last two through the overflow-free K1 of docs/numerics.md ("Unbounded gates").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import add_run_arguments, environment, graph_median_ms, markdown_table, median_ms, publish  # noqa: E402
from cute_kda.workspace import CHUNK, WorkspaceSpec, allocate_workspace, tiles_per_head  # noqa: E402

D = 128
LOWER_BOUND = -5.0
COPY_CEILING_TBPS = 4.3  # H200 device-to-device copy, design.md §6
TILE_BYTES = 3 * CHUNK * D * 2 + D * 4 + 2 * CHUNK * CHUNK * 2 + CHUNK * 4  # one (head, tile) of workspace


def _direct_launch(threads: int, ctas: int, q, k, g, beta, a_log, dt_bias, ws, cu_seqlens, tile_base, steps):
    """A compiled ``SafePrepare(num_threads=threads, ctas_per_sm=ctas)`` bound to these tensors."""
    from cute_kda.kernels.fwd_prepare import SafePrepare
    from cute_kda.ops._cache import compile_for_launch, current_stream, to_cute_tensor
    from cute_kda.ops.prepare import launch_arguments

    arguments = (q, k, g, beta, a_log, dt_bias, ws, D ** -0.5, LOWER_BOUND, steps, cu_seqlens, tile_base,
                 current_stream(q.device))
    kernel = SafePrepare(varlen=cu_seqlens is not None, num_threads=threads, ctas_per_sm=ctas)
    compiled = compile_for_launch(kernel, *launch_arguments(*arguments, tensor=to_cute_tensor))
    launch_args = launch_arguments(*arguments)
    return lambda: compiled(*launch_args)


def run(lengths: list[int], heads: int, varlen: bool, variants: list[tuple[int, int]], warmup: int,
        rep: int, gates: tuple[str, ...] = ("safe",)) -> list[dict]:
    from cute_kda.ops.prepare import prepare, tile_bases

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    batch, steps = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    rows = batch * steps

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device).bfloat16()

    q, k, g = randn(batch, steps, heads, D), randn(batch, steps, heads, D), randn(batch, steps, heads, D)
    beta = randn(batch, steps, heads)
    a_log = torch.rand(heads, generator=gen, device=device)
    dt_bias = torch.rand(heads, D, generator=gen, device=device)
    cu_seqlens = None
    tile_base = None
    if varlen:
        cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device)
        tile_base = tile_bases(cu_seqlens)
    num_seqs = len(lengths)
    tiles = tiles_per_head(rows, num_seqs, varlen)
    ws = allocate_workspace(WorkspaceSpec(heads=heads, tiles=tiles), device)
    real_tiles = sum((n + CHUNK - 1) // CHUNK for n in lengths)  # slots K1 writes per head

    def k1():
        prepare(q, k, g, beta, a_log, dt_bias, ws, scale=D ** -0.5, lower_bound=LOWER_BOUND,
                cu_seqlens=cu_seqlens, tile_base=tile_base)

    k1()  # compile outside the timing
    torch.cuda.synchronize()
    read = 3 * rows * heads * D * 2 + rows * heads * 2 + heads * 4 + heads * D * 4
    written = heads * real_tiles * TILE_BYTES
    moved = read + written
    timed = [("K1 prepare, eager (with host launch cost)", median_ms(k1, warmup, rep), moved)]
    kernel_alone = graph_median_ms(k1, warmup, rep)  # one graph replay has no Python launch cost
    if kernel_alone is not None:
        timed.insert(0, ("K1 prepare, CUDA graph", kernel_alone, moved))
    for gate in gates:
        if gate == "safe":
            continue
        log_decay = -torch.nn.functional.softplus(g.float()) if gate == "none" else g  # fp32 with gate "none"
        constants = (None, None) if gate == "none" else (a_log, dt_bias)

        def k1_gate(gate=gate, log_decay=log_decay, constants=constants):
            prepare(q, k, log_decay, beta, *constants, ws, scale=D ** -0.5, lower_bound=LOWER_BOUND,
                    cu_seqlens=cu_seqlens, tile_base=tile_base, gate=gate)

        k1_gate()
        torch.cuda.synchronize()
        extra = rows * heads * D * 2 if gate == "none" else 0  # fp32 g: twice the bytes of bf16
        timed.append((f"K1 prepare, gate {gate}, CUDA graph", graph_median_ms(k1_gate, warmup, rep), moved + extra))
    for threads, ctas in variants:  # other static configurations of the same kernel, launched directly
        timed.append((f"K1 {threads} threads × {ctas} CTAs/SM, direct launch",
                      median_ms(_direct_launch(threads, ctas, q, k, g, beta, a_log, dt_bias, ws, cu_seqlens,
                                               tile_base, steps), warmup, rep), moved))

    src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), warmup, rep)
    copy_tbps = 2 * src.numel() / copy_ms / 1e9

    shape = f"varlen {lengths} H{heads}" if varlen else f"B{batch} T{steps} H{heads}"
    out = []
    for what, ms, nbytes in [*timed, ("D2D copy, same bytes", copy_ms, 2 * src.numel())]:
        tbps = nbytes / ms / 1e9
        out.append(dict(shape=shape, what=what, ms=ms, bytes=nbytes, tbps=tbps,
                        of_ceiling=tbps / COPY_CEILING_TBPS, of_copy=tbps / copy_tbps))
    print(f"{shape}: read {read / 1e6:.1f} MB + written {written / 1e6:.1f} MB; {heads * real_tiles} CTAs",
          file=sys.stderr)
    return out


def markdown(rows: list[dict]) -> str:
    head = ["shape", "what", "median µs", "bytes moved (MB)", "TB/s", f"% of {COPY_CEILING_TBPS} TB/s", "% of measured copy"]
    return markdown_table(head, [
        [r["shape"], r["what"], f"{r['ms'] * 1e3:.1f}", f"{r['bytes'] / 1e6:.1f}", f"{r['tbps']:.2f}",
         f"{100 * r['of_ceiling']:.0f} %", f"{100 * r['of_copy']:.0f} %"]
        for r in rows
    ])


def header() -> str:
    return (f"{environment('cutlass', 'triton')} · D={D}, all activations in K1; "
            f"bytes = inputs read once + workspace written once ({TILE_BYTES} B per head-tile)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192", help="comma-separated sequence lengths (batch rows, or packed with --varlen)")
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--varlen", action="store_true", help="pack the sequences with cu_seqlens")
    parser.add_argument("--gates", default="safe", help="comma-separated gate forms to time: safe, softplus, none")
    parser.add_argument("--variants", default="128x8,256x5",
                        help="THREADSxCTAS_PER_SM configurations to time by direct launch (comma-separated, '' for none)")
    add_run_arguments(parser)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not args.varlen and len(set(lengths)) != 1:
        parser.error("a fixed-length batch needs equal lengths (or pass --varlen)")
    if not torch.cuda.is_available():
        sys.exit("bench_prepare needs a CUDA GPU (Hopper)")

    with torch.inference_mode():
        variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",") if v.strip()]
        gates = tuple(x.strip() for x in args.gates.split(",") if x.strip())
        rows = run(lengths, args.heads, args.varlen, variants, args.warmup, args.rep, gates)
    publish(f"{header()}\n\n{markdown(rows)}\n", args.out)


if __name__ == "__main__":
    main()
