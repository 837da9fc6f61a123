"""The multistage GEMM (teaching kernel, ``teaching.ops.gemm``) against ``torch.matmul`` (cuBLAS), same run.

``C = A·Bᵀ``, bf16 A ``[M, K]`` and B ``[N, K]``, fp32 accumulation, bf16 C, for every offered tile
configuration × stage count, the default configuration without the swizzle, and cuBLAS on the same
tensors (``torch.matmul(a, b.T)``, bf16 out). Times are medians of ``triton.testing.do_bench`` (L2
cleared before each repetition) or, without Triton, of CUDA-event timings with an L2 flush; each
kernel is called through its launcher (host cost included, as for ``torch.matmul``). Every result is
also checked against ``torch.matmul`` in fp32 (``rel err`` column: ``‖C − C_ref‖ / ‖C_ref‖``; bf16
output rounding alone is ~2e-3).

What to expect, honestly: this kernel is Ampere-style — ``mma.sync`` (one warp, 16×8×16, operands in
registers through ``ldmatrix``) fed by ``cp.async``. cuBLAS on Hopper uses ``wgmma`` (a warpgroup
multiplying operands straight from shared memory, asynchronously), TMA loads, warp-specialised
producer/consumer pipelines and thread-block clusters, and picks its tile per shape. On an H100/H200
``mma.sync`` alone cannot reach the dense-bf16 peak that ``wgmma`` reaches, and this kernel has no
tile rasterisation, no split-K, a register-bound 64×64 warp tile and one CTA shape per run: the
``of cuBLAS`` column measures how far that leaves it.

    python benchmarks/bench_gemm.py                            # all shapes, all configurations
    python benchmarks/bench_gemm.py --shapes square4096 --out /tmp/gemm.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import add_run_arguments, environment, markdown_table, median_ms, publish  # noqa: E402
from cute_kda.reference import rel_rms  # noqa: E402

SHAPES = {  # name → (M, N, K)
    "square4096": (4096, 4096, 4096),
    "square8192": (8192, 8192, 8192),
    "ragged": (7999, 5000, 4096),  # tails in M and N
    "tall_skinny": (81920, 256, 256),  # the seed tutorial's measurement shape
}
STAGES = (2, 3, 4)


def variants() -> list[tuple[str, dict]]:
    """(label, ``gemm`` keyword arguments) of every configuration benchmarked."""
    from teaching.ops.gemm import CONFIGS, DEFAULT_CONFIG, DEFAULT_STAGES

    out = [(f"{config} s{stages}", dict(config=config, stages=stages)) for config in CONFIGS for stages in STAGES]
    out.append((f"{DEFAULT_CONFIG} s{DEFAULT_STAGES} unswizzled",
                dict(config=DEFAULT_CONFIG, stages=DEFAULT_STAGES, swizzle=False)))
    return out


def bench_shape(name: str, shape: tuple[int, int, int], warmup: int, rep: int) -> list[dict]:
    from teaching.ops.gemm import gemm

    m, n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    b = torch.randn(n, k, generator=gen, device="cuda").bfloat16()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32 (this run times bf16 matmuls only)
    ref = torch.matmul(a.float(), b.float().T)
    flops = 2 * m * n * k
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    cublas_ms = median_ms(lambda: torch.matmul(a, b.T), warmup, rep)
    rows = [dict(shape=name, mnk=shape, what="cuBLAS (torch.matmul)", ms=cublas_ms, tflops=flops / cublas_ms / 1e9,
                 of_cublas=1.0, err=rel_rms(torch.matmul(a, b.T), ref))]
    for label, kwargs in variants():
        def run(kwargs=kwargs):
            return gemm(a, b, out=out, **kwargs)

        err = rel_rms(run(), ref)  # compiles on first use, outside the timing
        ms = median_ms(run, warmup, rep)
        rows.append(dict(shape=name, mnk=shape, what=label, ms=ms, tflops=flops / ms / 1e9, of_cublas=cublas_ms / ms,
                         err=err))
        print(f"{name} {label}: {ms * 1e3:.1f} µs ({cublas_ms / ms:.0%} of cuBLAS)", file=sys.stderr)
    return rows


def header() -> str:
    return (f"{environment('cutlass', 'triton')}\n\nMultistage GEMM (cp.async + ldmatrix + mma.sync, Ampere-style) vs "
            "cuBLAS (wgmma on Hopper); bf16 in, fp32 accumulate, bf16 out. `of cuBLAS` = cuBLAS time / ours.")


def markdown(rows: list[dict]) -> str:
    head = ["shape", "M×N×K", "kernel", "median µs", "TFLOP/s", "of cuBLAS", "rel err"]
    return markdown_table(head, [
        [r["shape"], "×".join(map(str, r["mnk"])), r["what"], f"{r['ms'] * 1e3:.1f}", f"{r['tflops']:.0f}",
         f"{100 * r['of_cublas']:.0f} %", f"{r['err']:.1e}"]
        for r in rows
    ])


def summary(rows: list[dict]) -> str:
    """Best configuration per shape, as a ratio to cuBLAS."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ours = [r for r in rows if r["shape"] == shape and not r["what"].startswith("cuBLAS")]
        best = max(ours, key=lambda r: r["of_cublas"])
        lines.append(f"- {shape}: best {best['what']} at {best['tflops']:.0f} TFLOP/s, "
                     f"{100 * best['of_cublas']:.0f} % of cuBLAS")
    return "\n".join(lines)


def default_out() -> str:
    folder = os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results")
    return os.path.join(folder, f"gemm-{datetime.date.today()}.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemm needs a CUDA GPU (Hopper)")
    out = args.out or default_out()
    rows: list[dict] = []
    for name in args.shapes:
        rows += bench_shape(name, SHAPES[name], args.warmup, args.rep)
    publish(f"{header()}\n\n{markdown(rows)}\n\n{summary(rows)}\n", out)


if __name__ == "__main__":
    main()
