"""Print the shared-memory layouts and their analysis (no GPU needed).

    python scripts/explore_layouts.py                       # everything, D=128, CHUNK=16
    python scripts/explore_layouts.py --section banks budget
    python scripts/explore_layouts.py --section grids --value bank --cols 64

Sections: ``atoms`` (GMMA smem atoms and the kernels' layouts as CuTe prints them), ``grids``
(tiled layouts drawn as index grids), ``dual`` (transpose-dual check), ``banks`` (ldmatrix/stmatrix
wavefronts per instruction: K_INTER vs row-major vs K_SW128), ``budget`` (smem per kernel plan: K1's
``smem_budget``, K2's ``RecurrenceSmemPlan`` and Kernel A's ``ScanSmemPlan`` per V-split and state I/O), ``gemm`` (the multistage GEMM
of ``teaching.layouts.gemm``: its smem layouts, the swizzle, its bank conflicts with and without it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cute_kda.dsl import cutlass  # noqa: E402
from cute_kda.layouts import RecurrenceSmemPlan, analysis, k1_budget, k2_budget, smem  # noqa: E402
from cute_kda.layouts.analysis import layout_spec  # noqa: E402
from cute_kda.layouts.bwd_scan import ScanSmemPlan  # noqa: E402
from cute_kda.numerics import SCAN_VSPLITS, SUPPORTED_VSPLITS  # noqa: E402

SECTIONS = ("atoms", "grids", "dual", "banks", "budget", "gemm")
DTYPES = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}


def design_layouts(dim: int, chunk: int, dtype: type) -> list[analysis.LayoutSpec]:
    """The layouts of ``cute_kda.layouts.smem`` for this configuration."""
    return [
        layout_spec(f"chunk_operand[{chunk},{dim}]", smem.chunk_operand, dim, chunk, dtype=dtype),
        layout_spec(f"chunk_operand_transposed[{dim},{chunk}]", smem.chunk_operand_transposed, dim, chunk,
                    dtype=dtype),
        layout_spec(f"state_b_view[{dim},{dim}]", smem.state_b_view, dim, dtype=dtype),
        layout_spec(f"state_acc_view[{dim},{dim}]", smem.state_acc_view, dim, dtype=dtype),
        layout_spec(f"square_tile[{chunk},{chunk}]", smem.square_tile, chunk, dtype=dtype),
        layout_spec(f"square_tile_transposed[{chunk},{chunk}]", smem.square_tile_transposed, chunk, dtype=dtype),
        layout_spec(f"vector({chunk}) (beta)", smem.vector, chunk, dtype=cutlass.Float32),
        layout_spec(f"vector({dim}) (gT)", smem.vector, dim, dtype=cutlass.Float32),
        layout_spec(f"state_fp32[{dim},{dim}]", smem.state_fp32, dim, dtype=cutlass.Float32),
    ]


def print_atoms(dim: int, chunk: int, dtype: type) -> None:
    print("== GMMA shared-memory atoms (element units; swizzles act on byte addresses) ==")
    for kind in smem.AtomKind:
        for dt in (dtype, cutlass.Float32):
            spec = layout_spec(f"{kind.name} {dt.__name__}", smem.layout_atom, kind, dtype=dt)
            print(f"  {spec.name:26s} {analysis.evaluate(spec).text}")
    print("\n== kernel layouts ==")
    for spec in design_layouts(dim, chunk, dtype):
        ev = analysis.evaluate(spec)
        print(f"  {spec.name:36s} cosize {ev.cosize:6d}  {ev.text}")


def print_grids(dim: int, chunk: int, dtype: type, value: str, cols: int) -> None:
    atom = layout_spec(f"K_INTER atom {dtype.__name__}", smem.layout_atom, smem.AtomKind.K_INTER, dtype=dtype)
    sw128 = layout_spec(f"K_SW128 atom {dtype.__name__}", smem.layout_atom, smem.AtomKind.K_SW128, dtype=dtype)
    grids = [(atom, None, None), (sw128, None, None)]
    grids += [(spec, 16, cols) for spec in design_layouts(dim, chunk, dtype)
              if analysis.evaluate(spec).bytes.ndim == 2]
    for spec, rows, c in grids:
        print(analysis.draw_grid(spec, value, rows, c))
        print()


def print_dual(dim: int, chunk: int, dtype: type) -> None:
    print("== transpose-dual check: a(i, j) and b(j, i) are the same byte ==")
    pairs = analysis.design_pairs(dim, chunk, dtype)
    for fam in analysis.FAMILIES[1:]:
        for rows, cols in ((chunk, dim), (dim, dim)):
            if fam.fits(rows, cols, dtype):
                pairs.append((fam.spec(rows, cols, dtype), fam.spec(rows, cols, dtype, transposed=True), (1, 0)))
    for a, b, perm in pairs:
        res = analysis.check_transpose_dual(a, b, perm)
        verdict = "ok" if res.ok else f"FAIL (mismatches {res.mismatches}, bijective {res.bijective})"
        print(f"  {a.name:44s} ~ {b.name:48s} {verdict}")


def print_banks(dim: int, chunk: int, dtype: type) -> None:
    print("== ldmatrix/stmatrix wavefronts per instruction (worst over the tile; ideal = .xN) ==")
    print(analysis.format_conflict_table(analysis.bank_conflict_table(dim, chunk, dtype)))


def print_budget(dim: int, chunk: int) -> None:
    print("== shared-memory budget ==")
    print(k1_budget(dim, chunk).describe())
    print()
    k2_plans = [RecurrenceSmemPlan(vsplit=vsplit, state_io_fp32=fp32, dim=dim, chunk=chunk)
                for fp32 in (False, True) for vsplit in SUPPORTED_VSPLITS]
    scan_plans = [ScanSmemPlan(vsplit=vsplit, state_io_fp32=fp32, dim=dim, chunk=chunk)
                  for fp32 in (False, True) for vsplit in SCAN_VSPLITS]  # Kernel A: K2's plan, other fields
    for plan in k2_plans + scan_plans:
        print(k2_budget(plan).describe())
        print()
    print(f"{'band-scan config':44s} {'input stage B':>13s} {'output stage B':>14s} {'total B':>8s} {'CTAs/SM':>7s}")
    for plan in k2_plans + scan_plans:
        b = k2_budget(plan)
        name = f"{plan.kernel_name} vsplit={plan.vsplit} state_io={'fp32' if plan.state_io_fp32 else 'bf16/none'}"
        print(f"{name:44s} {b.stage_bytes['input']:13d} {b.stage_bytes['output']:14d} "
              f"{b.total_bytes:8d} {b.ctas_per_sm:7d}")


def print_gemm() -> None:
    """The multistage GEMM (``teaching.layouts.gemm``): its smem layouts per offered tile, the swizzle
    as 16-byte chunks per row, and the bank conflicts of its accesses with and without the swizzle."""
    from teaching.layouts import gemm
    from teaching.ops.gemm import CONFIGS

    print("== multistage GEMM: smem layouts, swizzle, bank conflicts (swizzled vs row-major) ==")
    for name, kwargs in CONFIGS.items():
        (bm, bn, bk), (wm, wn) = kwargs["tile"], kwargs["warps"]
        for out_dtype in (cutlass.BFloat16, cutlass.Float32):
            plan = gemm.GemmPlan(bm=bm, bn=bn, bk=bk, warps_m=wm, warps_n=wn, out_dtype=out_dtype)
            print(f"\n-- {name} ({plan.name})")
            specs = [gemm.operand_spec(plan, bm, sw) for sw in (True, False)]
            specs += [gemm.operand_spec(plan, bn), gemm.epilogue_spec(plan, True), gemm.epilogue_spec(plan, False)]
            for spec in dict.fromkeys(specs):
                print(f"  {spec.name:34s} {analysis.evaluate(spec).text}")
            if out_dtype is cutlass.BFloat16:
                for spec in specs[:2]:
                    print(gemm.draw_chunks(spec))
            print(gemm.format_conflict_table(gemm.bank_conflict_table(plan)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=smem.HEAD_DIM)
    parser.add_argument("--chunk", type=int, default=smem.CHUNK)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--section", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--value", choices=("element", "byte", "bank"), default="element",
                        help="what the grids show per coordinate")
    parser.add_argument("--cols", type=int, default=32, help="columns drawn of wide layouts")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    for section in args.section:
        if section == "atoms":
            print_atoms(args.dim, args.chunk, dtype)
        elif section == "grids":
            print_grids(args.dim, args.chunk, dtype, args.value, args.cols)
        elif section == "dual":
            print_dual(args.dim, args.chunk, dtype)
        elif section == "banks":
            print_banks(args.dim, args.chunk, dtype)
        elif section == "gemm":
            print_gemm()
        else:
            print_budget(args.dim, args.chunk)
        print()


if __name__ == "__main__":
    main()
