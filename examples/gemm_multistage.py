"""The multistage GEMM, end to end: its layouts, what the compiler made of it, and (with a GPU) a run.

Everywhere (no GPU needed): prints the configuration, the shared-memory layouts as CuTe prints them,
one stage of A drawn as 16-byte chunks (where each chunk of each row lands, with and without the
swizzle), the bank conflicts of every shared-memory access, the shared-memory plan, and the compile
report for sm_90a (registers, spills, instruction counts). With a GPU: runs ``C = A·Bᵀ`` on a few
shapes, checks it against ``torch.matmul`` in fp32 and times it against ``torch.matmul`` (cuBLAS).
The walk-through that goes with it is ``docs/gemm-walkthrough.md``.

    python examples/gemm_multistage.py                               # 128x128x32, 3 stages
    python examples/gemm_multistage.py --config 64x128x64 --stages 4
    python examples/gemm_multistage.py --shape 8192,8192,8192 --no-compile
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda.dsl import cute, cutlass  # noqa: E402
from cute_kda.layouts.analysis import evaluate  # noqa: E402
from teaching.layouts import gemm as layouts  # noqa: E402
from teaching.ops import gemm as ops  # noqa: E402

NOTABLE = (
    ("cp.async 16 B", "cp.async.cg.shared.global"),
    ("cp.async.commit_group", "cp.async.commit_group"),
    ("cp.async.wait_group", "cp.async.wait_group"),
    ("ldmatrix.x4", "ldmatrix.sync.aligned.m8n8.x4"),
    ("mma.sync m16n8k16", "mma.sync.aligned.m16n8k16"),
    ("stmatrix.x4", "stmatrix.sync.aligned.m8n8.x4"),
    ("st.shared.v2 (fp32 C)", "st.shared.v2"),
    ("ld.shared.v4 (C rows)", "ld.shared.v4"),
    ("st.global.v4 (C rows)", "st.global.v4"),
    ("bar.sync", "bar.sync"),
    ("ld.local / st.local", "ld.local"),
)


def heading(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def print_partitions(plan: layouts.GemmPlan) -> None:
    """Shapes of thread 0's partitions, as the kernel makes them. Identity (coordinate) tensors stand in
    for the global and shared tensors: a partition's shape depends only on the tile and the tiled copy
    or MMA, not on what the tensor points to, so this runs on the host."""
    from cute_kda.kernels.common.copy import Operand, ldmatrix_copy, stmatrix_copy
    from cute_kda.layouts.analysis import run_traced

    def run():
        k_tiles = 8  # a K of 8 k-tiles, for the printout
        g_a = cute.make_identity_tensor((plan.bm, plan.bk, k_tiles))
        s_a = cute.make_identity_tensor((plan.bm, plan.bk, plan.stages))
        s_b = cute.make_identity_tensor((plan.bn, plan.bk, plan.stages))
        c = cute.make_identity_tensor((plan.bm, plan.bn))
        vector = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
        load = cute.make_tiled_copy_tv(vector, *layouts.load_thread_layout(plan)).get_slice(0)
        store = cute.make_tiled_copy_tv(vector, *layouts.store_thread_layout(plan)).get_slice(0)
        mma = layouts.tiled_mma(plan)
        thr_mma = mma.get_slice(0)
        rows = [
            ("local_tile(A, (BM, BK), (m, None))", "gA", g_a.shape),
            ("cp.async  partition_S(gA)", "(CPY, CPY_M, CPY_K, k_tile)", load.partition_S(g_a).shape),
            ("cp.async  partition_D(sA)", "(CPY, CPY_M, CPY_K, stage)", load.partition_D(s_a).shape),
            ("mma       partition_A(sA[:, :, 0])", "(MMA, MMA_M, MMA_K) = frag_a",
             thr_mma.partition_A(s_a[None, None, 0]).shape),
            ("mma       partition_B(sB[:, :, 0])", "(MMA, MMA_N, MMA_K) = frag_b",
             thr_mma.partition_B(s_b[None, None, 0]).shape),
            ("mma       partition_C(gC)", "(MMA, MMA_M, MMA_N) = acc", thr_mma.partition_C(c).shape),
            ("ldmatrix  partition_S(sA)", "(CPY, MMA_M, MMA_K, stage)",
             ldmatrix_copy(mma, Operand.A, False).get_slice(0).partition_S(s_a).shape),
            ("ldmatrix  partition_S(sB)", "(CPY, MMA_N/2, MMA_K, stage)",
             ldmatrix_copy(mma, Operand.B, False).get_slice(0).partition_S(s_b).shape),
            ("stmatrix  partition_D(sC)", "(CPY, MMA_M, MMA_N/2)",
             stmatrix_copy(mma, Operand.C, False).get_slice(0).partition_D(c).shape),
            ("store     partition_D(gC)", "(CPY, CPY_M, CPY_N)", store.partition_D(c).shape),
        ]
        return rows

    heading("partitions of thread 0 (shapes)")
    for what, modes, shape in run_traced(run):
        print(f"  {what:38s} {str(shape):22s} {modes}")


def print_layouts(plan: layouts.GemmPlan) -> None:
    heading(f"configuration {plan.name}")
    rows_a, per_row_a = layouts.load_arrangement(plan)
    rows_c, per_row_c = layouts.store_arrangement(plan)
    print(f"  {plan.num_threads} threads = {plan.warps_m}x{plan.warps_n} warps; warp tile "
          f"{plan.bm // plan.warps_m}x{plan.bn // plan.warps_n}; {plan.k_blocks} k16 steps per k-tile")
    print(f"  cp.async: {per_row_a} threads per row of A/B, {rows_a} rows per pass; "
          f"epilogue: {per_row_c} threads per row of C, {rows_c} rows per pass")

    print_partitions(plan)

    heading("shared-memory layouts (element offsets; the swizzle acts on byte addresses)")
    specs = [layouts.operand_spec(plan, plan.bm, True), layouts.operand_spec(plan, plan.bm, False),
             layouts.operand_spec(plan, plan.bn, True), layouts.epilogue_spec(plan, True),
             layouts.epilogue_spec(plan, False)]
    staged = layouts.layout_spec(f"operand_stage[{plan.bm},{plan.bk},{plan.stages}]", layouts.operand_stage,
                                 plan.bm, plan.bk, dtype=cutlass.BFloat16, stages=plan.stages)
    for spec in dict.fromkeys([staged, *specs]):  # A and B share a spec when BM == BN
        print(f"  {spec.name:38s} {evaluate(spec).text}")
    print()
    print(layouts.draw_chunks(layouts.operand_spec(plan, plan.bm, True)))
    print()
    print(layouts.draw_chunks(layouts.operand_spec(plan, plan.bm, False)))

    heading("bank conflicts: worst wavefronts per warp instruction (ideal = 32 lanes' bytes / 128)")
    print(layouts.format_conflict_table(layouts.bank_conflict_table(plan)))

    heading("shared-memory plan")
    print(layouts.smem_budget(plan).describe())


def print_compile_report(kernel) -> None:
    from cute_kda.compile_report import compile_with_report

    heading("compile report (sm_90a, ptxas -v)")

    def fake(dtype):
        return cute.runtime.make_fake_compact_tensor(dtype, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0),
                                                     assumed_align=16)

    plan = kernel.plan
    try:
        _, report = compile_with_report(kernel, fake(cutlass.BFloat16), fake(cutlass.BFloat16), fake(plan.out_dtype),
                                        cute.runtime.make_fake_stream())
    except (RuntimeError, FileNotFoundError) as error:  # e.g. a ptxas older than the DSL's PTX (the H200 image)
        print(f"  skipped: {str(error).splitlines()[0]} (the CPU compile tier reports registers and spills)")
        return
    (entry,) = report.kernels
    print(f"  registers {entry.registers}, stack {entry.stack_frame} B, spills {entry.spill_stores}/"
          f"{entry.spill_loads} B, dynamic smem {report.launch_smem[0]} B")
    print(f"  CTAs per SM: ~{65536 // (entry.registers * plan.num_threads)} by registers, "
          f"{layouts.smem_budget(plan).ctas_per_sm} by shared memory")
    for label, mnemonic in NOTABLE:
        count = report.count(mnemonic) + (report.count("st.local") if mnemonic == "ld.local" else 0)
        print(f"  {label:24s} {count:5d}")


def run_on_gpu(config: str, stages: int, out_dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> None:
    from cute_kda._bench import median_ms

    heading(f"GPU: {torch.cuda.get_device_name()} — results vs torch.matmul (fp32), times vs cuBLAS")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    bk = ops.CONFIGS[config]["tile"][2]
    print(f"  {'M x N x K':20s} {'max |err|':>10s} {'rel err':>9s} {'ours µs':>9s} {'cuBLAS µs':>10s} "
          f"{'TFLOP/s':>8s} {'of cuBLAS':>9s}")
    for m, n, k in shapes:
        k = (k + bk - 1) // bk * bk
        a = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        b = torch.randn(n, k, generator=gen, device="cuda").bfloat16()
        c = ops.gemm(a, b, out_dtype=out_dtype, config=config, stages=stages)
        ref = torch.matmul(a.float(), b.float().T)
        err = (c.float() - ref).abs().max().item()
        rel = (torch.linalg.vector_norm((c.float() - ref).double()) / torch.linalg.vector_norm(ref.double())).item()
        ours = median_ms(lambda: ops.gemm(a, b, out=c, out_dtype=out_dtype, config=config, stages=stages))
        cublas = median_ms(lambda: torch.matmul(a, b.T))
        print(f"  {f'{m} x {n} x {k}':20s} {err:10.3g} {rel:9.1e} {ours * 1e3:9.1f} {cublas * 1e3:10.1f} "
              f"{2 * m * n * k / ours / 1e9:8.0f} {cublas / ours:9.0%}")
    print("  (cuBLAS runs wgmma + TMA on Hopper; this kernel is mma.sync + cp.async: see docs/gemm-walkthrough.md)")


def parse_shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in text.split(","))
    return m, n, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=list(ops.CONFIGS), default=ops.DEFAULT_CONFIG)
    parser.add_argument("--stages", type=int, default=ops.DEFAULT_STAGES)
    parser.add_argument("--out-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--shape", type=parse_shape, action="append",
                        help="M,N,K to run on a GPU (repeatable; K is rounded up to a multiple of BK)")
    parser.add_argument("--no-compile", action="store_true", help="skip the sm_90a compile report")
    args = parser.parse_args()
    out_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.out_dtype]
    kernel = ops.kernel_for(args.config, args.stages, out_dtype)
    print_layouts(kernel.plan)
    if not args.no_compile:
        print_compile_report(kernel)
    if torch.cuda.is_available():
        run_on_gpu(args.config, args.stages, out_dtype,
                   args.shape or [(4096, 4096, 4096), (8192, 8192, 8192), (1000, 776, 320), (81920, 256, 256)])
    else:
        print("\n(no CUDA device: the run against torch.matmul needs a GPU)")


if __name__ == "__main__":
    main()
