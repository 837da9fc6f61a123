"""The multistage GEMM (teaching example): PTX, resources, smem plan and bank conflicts on the CPU; results
against ``torch.matmul`` (fp32) on a GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from cute_kda.compile_report import compile_with_report
from cute_kda.dsl import cute, cutlass
from cute_kda.layouts.analysis import MatrixAccess, byte_table, max_wavefronts
from cute_kda.ops._cache import to_cute_tensor
from teaching.layouts import gemm as layouts
from teaching.layouts.gemm import GemmPlan
from teaching.ops import gemm as ops

BF16, F32 = cutlass.BFloat16, cutlass.Float32
STAGES = (2, 3, 4)


def _plan(config: str, stages: int = 3, out_dtype=BF16, swizzle: bool = True) -> GemmPlan:
    return ops.kernel_for(config, stages, {BF16: torch.bfloat16, F32: torch.float32}[out_dtype], swizzle).plan


# ---------------------------------------------------------------- configuration checks (CPU)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bk=16), "BK must be one of"),
    (dict(stages=1), "stages must be at least 2"),
    (dict(bm=80), "BM=80 is not a multiple of 16 x warps_m"),
    (dict(bn=96), "BN=96 is not a multiple of 64"),
    (dict(bn=48, warps_n=4), "BN=48 is not a multiple of 16 x warps_n"),
    (dict(out_dtype=cutlass.Float16), "out_dtype must be"),
    (dict(bm=256, bn=256, bk=64, stages=4), "needs 262144 B of shared memory"),
    (dict(bm=16, warps_m=1, warps_n=4, bn=64), "A tile \\[16, 32\\] is not a whole number of passes"),
])
def test_plan_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GemmPlan(**kwargs)


def test_offered_configs_are_valid():
    for config in ops.CONFIGS:
        for stages in STAGES:
            plan = _plan(config, stages)
            assert plan.smem_bytes == layouts.smem_budget(plan).total_bytes


# ---------------------------------------------------------------- compiled PTX (CPU)


def _fake(dtype):
    """A row-major fake gmem tensor with both extents dynamic (as the launcher's DLPack tensors)."""
    return cute.runtime.make_fake_compact_tensor(dtype, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0),
                                                 assumed_align=16)


def _compile(plan_args: tuple):
    config, stages, out_dtype, swizzle = plan_args
    kernel = ops.kernel_for(config, stages, out_dtype, swizzle)
    out = {torch.bfloat16: BF16, torch.float32: F32}[out_dtype]
    _, report = compile_with_report(kernel, _fake(BF16), _fake(BF16), _fake(out), cute.runtime.make_fake_stream())
    return kernel.plan, report


VARIANTS = {f"{config}-s{stages}": (config, stages, torch.bfloat16, True)
            for config in ops.CONFIGS for stages in STAGES}
VARIANTS["128x128x32-s3-fp32"] = ("128x128x32", 3, torch.float32, True)
VARIANTS["64x128x64-s4-fp32"] = ("64x128x64", 4, torch.float32, True)
VARIANTS["128x128x32-s3-unswizzled"] = ("128x128x32", 3, torch.bfloat16, False)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def compiled(request):
    return _compile(VARIANTS[request.param])


def _per_thread(plan: GemmPlan) -> dict[str, int]:
    """Instruction counts the plan implies for one thread (the kernel is fully unrolled per k-tile)."""
    rows_per_pass, _ = layouts.load_arrangement(plan)
    m_reps, n_reps = plan.bm // (16 * plan.warps_m), plan.bn // (16 * plan.warps_n)
    return dict(
        loads=(plan.bm + plan.bn) // rows_per_pass,  # cp.async of one k-tile
        ldmatrix=m_reps + n_reps,  # one k16 step: an x4 per A repetition, one per two B n8 atoms
        mma=m_reps * 2 * n_reps,  # one k16 step
        c_vectors=plan.bm * plan.bn * plan.out_bytes // layouts.VECTOR_BYTES // plan.num_threads,
    )


def test_ptx_pipeline(compiled):
    """cp.async into the stages (prologue stages-1 k-tiles + one in the loop), commit per k-tile,
    wait_group(stages-2) before the first and before each next k-tile, wait_group(0) before the epilogue."""
    plan, report = compiled
    n = _per_thread(plan)
    assert report.count("cp.async.cg.shared.global") == plan.stages * n["loads"]
    assert len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, 16;", report.ptx)) == \
        plan.stages * n["loads"]  # 16-byte copies, whole (no zero-fill)
    assert report.count("cp.async.commit_group") == plan.stages
    waits = re.findall(r"cp\.async\.wait_group\s+(\d+);", report.ptx)
    assert sorted(waits) == sorted([str(plan.stages - 2)] * 2 + ["0"])
    assert report.count("bar.sync") == 4  # first k-tile, next k-tile (loop), before and after the C tile


def test_ptx_ldmatrix_mma(compiled):
    plan, report = compiled
    n = _per_thread(plan)
    assert report.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == (1 + plan.k_blocks) * n["ldmatrix"]
    assert not report.has("ldmatrix.sync.aligned.m8n8.x4.trans")
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == plan.k_blocks * n["mma"]
    assert report.count("mma.sync") == plan.k_blocks * n["mma"]


def test_ptx_epilogue(compiled):
    plan, report = compiled
    n = _per_thread(plan)
    if plan.out_dtype is BF16:
        assert report.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == n["mma"] // 2
        assert report.count("cvt.rn.bf16x2.f32") == n["mma"] * 2
    else:
        assert report.count("st.shared.v2.b32") == n["mma"] * 2 and not report.has("stmatrix")
    assert report.count("ld.shared.v4") == n["c_vectors"]
    assert report.count("st.global.v4") == n["c_vectors"]
    assert not report.has("st.global.b") and not report.has("st.global.v2")  # only whole 16-byte pieces


def test_no_local_memory_no_spills(compiled):
    plan, report = compiled
    assert report.local_memory_ops == 0, report.summary()
    (entry,) = report.kernels
    assert entry.spill_stores == entry.spill_loads == entry.stack_frame == 0, report.summary()
    assert entry.registers <= 255
    print(f"\n{plan.name}: {report.summary()}; smem {report.launch_smem} B")


def test_launch_smem_is_the_plan(compiled):
    plan, report = compiled
    assert report.launch_smem == [layouts.smem_budget(plan).total_bytes] == [plan.smem_bytes]


def test_swizzle_is_in_the_addresses(compiled):
    """The swizzled variants xor their smem addresses; the row-major one has no xor at all."""
    plan, report = compiled
    assert (report.count("xor.b32") > 0) == plan.swizzle


def test_launcher_arguments_compile_to_the_same_kernel():
    """The launcher's torch → DSL conversion (CPU tensors here) gives the PTX of the fake-tensor compile."""
    a, b = torch.zeros(300, 96, dtype=torch.bfloat16), torch.zeros(200, 96, dtype=torch.bfloat16)
    c = torch.zeros(300, 200, dtype=torch.bfloat16)
    kernel = ops.kernel_for()
    _, report = compile_with_report(kernel, *ops._kernel_args(a, b, c, cute.runtime.make_fake_stream(),
                                                               tensor=to_cute_tensor))
    _, reference = _compile(("128x128x32", 3, torch.bfloat16, True))

    def body(ptx):
        return ptx[ptx.index(".entry"):]

    assert body(report.ptx) == body(reference.ptx)


# ---------------------------------------------------------------- shared-memory plan (CPU)


@pytest.mark.parametrize("config", list(ops.CONFIGS))
def test_stage_slots_are_the_plan(config):
    """Stage ``s`` of the staged operand layout the kernel uses is the 2-D stage ``s`` slots further on."""
    plan = _plan(config, 3)
    budget = layouts.smem_budget(plan).buffers
    for name, rows in (("a", plan.bm), ("b", plan.bn)):
        staged = byte_table(layouts.layout_spec("staged", layouts.operand_stage, rows, plan.bk, dtype=BF16,
                                                stages=plan.stages))
        one = byte_table(layouts.operand_spec(plan, rows))
        slot = budget[name].buffer.slot_bytes
        for s in range(plan.stages):
            assert np.array_equal(staged[:, :, s], one + s * slot)
    assert budget["a"].offset == 0 and budget["c"].offset == 0  # the C tile reuses the stage bytes
    assert budget["b"].offset == plan.stages * plan.bm * plan.bk * 2


# ---------------------------------------------------------------- bank conflicts (CPU)

# worst wavefronts per warp instruction: access → (ideal, swizzled, row-major)
EXPECTED_CONFLICTS = {
    ("128x128x32", BF16): {"A ldmatrix.x4": (4, 4, 16), "B ldmatrix.x4": (4, 4, 16), "A cp.async 16B": (4, 4, 4),
                           "B cp.async 16B": (4, 4, 4), "C stmatrix.x4": (4, 4, 32), "C ld.shared 16B": (4, 4, 4)},
    ("128x256x32", BF16): {"A ldmatrix.x4": (4, 4, 16), "B ldmatrix.x4": (4, 4, 16), "A cp.async 16B": (4, 4, 4),
                           "B cp.async 16B": (4, 4, 4), "C stmatrix.x4": (4, 4, 32), "C ld.shared 16B": (4, 4, 4)},
    ("64x128x64", BF16): {"A ldmatrix.x4": (4, 4, 32), "B ldmatrix.x4": (4, 4, 32), "A cp.async 16B": (4, 4, 4),
                          "B cp.async 16B": (4, 4, 4), "C stmatrix.x4": (4, 4, 32), "C ld.shared 16B": (4, 4, 4)},
    ("128x128x32", F32): {"A ldmatrix.x4": (4, 4, 16), "B ldmatrix.x4": (4, 4, 16), "A cp.async 16B": (4, 4, 4),
                          "B cp.async 16B": (4, 4, 4), "C st.shared.v2 fp32": (2, 2, 8), "C ld.shared 16B": (4, 4, 4)},
}


@pytest.mark.parametrize("config, out_dtype", list(EXPECTED_CONFLICTS),
                         ids=[f"{c}-{d.__name__}" for c, d in EXPECTED_CONFLICTS])
def test_bank_conflict_table(config, out_dtype):
    """Swizzled: every access at its ideal. Row-major: ldmatrix 4-way (64-byte rows: 8 rows on 2 bank
    groups) or 8-way (128-byte rows: 1 group), stmatrix 8-way, fp32 fragment stores 4-way; the
    row-contiguous 16-byte copies are conflict-free either way."""
    rows = layouts.bank_conflict_table(_plan(config, out_dtype=out_dtype))
    assert {r.access: (r.ideal, r.swizzled, r.row_major) for r in rows} == EXPECTED_CONFLICTS[(config, out_dtype)]
    text = layouts.format_conflict_table(rows)
    assert "A ldmatrix.x4" in text and "(1x)" in text


@pytest.mark.parametrize("config", list(ops.CONFIGS))
def test_ldmatrix_phases_agree_with_the_warp_tile_analysis(config):
    """The CTA-wide sweep (this kernel's tiled copies) and ``analysis.max_wavefronts`` (the 16×16 warp
    tile of the KDA kernels) see the same phases: 8 consecutive rows at one 16-byte column chunk."""
    plan = _plan(config)
    accesses = layouts.warp_accesses(plan)
    for operand, rows in (("A", plan.bm), ("B", plan.bn)):
        for swizzle in (True, False):
            spec = layouts.operand_spec(plan, rows, swizzle)
            ours = int(layouts.instruction_wavefronts(byte_table(spec), accesses[f"{operand} ldmatrix.x4"]).max())
            assert ours == max_wavefronts(spec, MatrixAccess("ldmatrix", operand, 4))


def test_phases_are_eight_row_runs():
    """Each ldmatrix phase of the kernel (8 lanes) addresses 8 consecutive rows, 8-aligned, one chunk."""
    for access in ("A ldmatrix.x4", "B ldmatrix.x4"):
        coords = layouts.warp_accesses(_plan("128x256x32"))[access].coords  # [threads, values, 2]
        starts = coords[:, ::8]  # the first element of each lane's row, per call
        for t0 in range(0, coords.shape[0], 8):
            phase = starts[t0:t0 + 8]
            assert np.all(phase[:, :, 0] - phase[0, :, 0] == np.arange(8)[:, None])
            assert np.all(phase[0, :, 0] % 8 == 0) and np.all(phase[:, :, 1] == phase[0, :, 1])


def test_instruction_wavefronts_refuses_scattered_lanes():
    access = layouts.warp_accesses(_plan("128x128x32"))["A ldmatrix.x4"]
    column_major = np.arange(128 * 32).reshape(32, 128).T * 2  # k is the strided direction
    with pytest.raises(layouts.NotContiguous):
        layouts.instruction_wavefronts(column_major, access)


# ---------------------------------------------------------------- launcher checks (CPU)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((np.zeros((4, 4)), _bf16(8, 32)), {}, TypeError, "a must be a tensor"),
    ((_bf16(64, 32).float(), _bf16(8, 32)), {}, TypeError, "a must be"),
    ((_bf16(64, 32), _bf16(8, 32).half()), {}, TypeError, "b must be"),
    ((_bf16(64, 32), _bf16(8, 32)), dict(out_dtype=torch.float16), TypeError, "out_dtype must be"),
    ((_bf16(2, 64, 32), _bf16(8, 32)), {}, ValueError, "a must be 2-D"),
    ((_bf16(64, 32), _bf16(8, 64)), {}, ValueError, "K differs"),
    ((_bf16(64, 48), _bf16(8, 48)), {}, ValueError, "K = 48 is not a multiple of the tile's BK = 32"),
    ((_bf16(64, 96), _bf16(8, 96)), dict(config="64x128x64"), ValueError,
     "K = 96 is not a multiple of the tile's BK = 64"),
    ((_bf16(64, 32), _bf16(12, 32)), {}, ValueError, "N = 12 must be a multiple of 8 for bfloat16"),
    ((_bf16(64, 32), _bf16(6, 32)), dict(out_dtype=torch.float32), ValueError, "N = 6 must be a multiple of 4"),
    ((_bf16(32, 64)[:, :32], _bf16(8, 32)), {}, ValueError, "a must be contiguous"),
    ((_bf16(64 * 32 + 1)[1:].view(64, 32), _bf16(8, 32)), {}, ValueError, "a must start on a 16-byte boundary"),
    ((_bf16(64, 32), _bf16(8, 32)), dict(out=_bf16(64, 16)), ValueError, "out must have shape"),
    ((_bf16(64, 32), _bf16(8, 32)), dict(out=torch.zeros(64, 8)), TypeError, "out must be"),
    ((_bf16(64, 32), _bf16(8, 32)), dict(config="256x256x32"), ValueError, "config must be one of"),
    ((_bf16(64, 32), _bf16(8, 32)), dict(stages=1), ValueError, "stages must be at least 2"),
])
def test_launcher_validation(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        ops.gemm(*args, **kwargs)


def test_launcher_refuses_cpu_tensors():
    """Well-formed operands on the CPU get as far as the device check."""
    with pytest.raises(ValueError, match="a must be on a CUDA device"):
        ops.gemm(_bf16(64, 64), _bf16(8, 64), config="64x128x64", stages=2, out_dtype=torch.float32)


# ---------------------------------------------------------------- results vs torch.matmul (GPU)

# (M, N, K): multiples of every tile, tails in M and N, fewer k-tiles than stages, single rows/columns
SHAPES = [
    (256, 256, 256), (512, 768, 1024),  # square-ish, M, N, K multiples of every tile
    (1000, 776, 320), (4097, 264, 128),  # tails in M and N (N a multiple of 8, not of BN)
    (37, 24, 32), (1, 8, 64), (130, 136, 64),  # smaller than one tile; one or two k-tiles (K rounded up to BK)
]
# (config, stages, swizzle, out dtype): every offered tile × stage count with bf16 out, fp32 out at 3 stages
GPU_VARIANTS = {
    **{f"{c}-s{s}-bf16": (c, s, True, torch.bfloat16) for c in ops.CONFIGS for s in STAGES},
    **{f"{c}-s3-fp32": (c, 3, True, torch.float32) for c in ops.CONFIGS},
    "128x128x32-s3-bf16-unswizzled": ("128x128x32", 3, False, torch.bfloat16),
}


def _integers(shape, gen, device):
    return torch.randint(-2, 3, shape, generator=gen, device=device).to(torch.bfloat16)


@pytest.fixture
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
def test_exact_on_integers(variant, device, no_tf32):
    """Integer inputs in [-2, 2]: every product and partial sum is an integer below 2^24, exact in fp32
    in any order, so C must equal ``torch.matmul`` in fp32 (rounded to bf16 the same way) bit for bit.
    Nothing may be written past the end of C (the tail stores are predicated)."""
    config, stages, swizzle, out_dtype = GPU_VARIANTS[variant]
    gen = torch.Generator(device=device).manual_seed(0)
    bk = ops.CONFIGS[config]["tile"][2]
    for m, n, k in SHAPES:
        k = (k + bk - 1) // bk * bk
        a, b = _integers((m, k), gen, device), _integers((n, k), gen, device)
        buffer = torch.full((m * n + 64,), 7.0, dtype=out_dtype, device=device)
        out = buffer[: m * n].view(m, n)
        ops.gemm(a, b, out=out, out_dtype=out_dtype, config=config, stages=stages, swizzle=swizzle)
        ref = torch.matmul(a.float(), b.float().T).to(out_dtype)
        assert torch.equal(out, ref), f"{m}x{n}x{k}: {(out.float() - ref.float()).abs().max().item()}"
        assert torch.all(buffer[m * n:] == 7.0), f"{m}x{n}x{k}: written past the end of C"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config", list(ops.CONFIGS))
def test_random_within_rounding_bound(config, out_dtype, device, no_tf32):
    """Normal inputs, against ``torch.matmul(a.float(), b.float().T)`` (fp32, TF32 off).

    Tolerance per element: the products of bf16 numbers are exact in fp32, so the two results differ
    only by how their fp32 sums round. For any summation order ``|ŝ − s| ≤ γ_K · Σ|a_i b_i|`` with
    ``γ_K ≈ K·u``; allowing the tensor cores' accumulation 2u per addition (it need not round to
    nearest) and the reference u gives ``K · 2^-22 · (|A|·|B|ᵀ)``. bf16 output adds its own rounding,
    half an ulp: ``2^-9 · |ref|`` (``2^-8`` to cover a sum that lands on the other side of a
    rounding boundary). A lost k-tile or a wrong row is off by O(1) or more, far outside.
    """
    gen = torch.Generator(device=device).manual_seed(1)
    bk = ops.CONFIGS[config]["tile"][2]
    for m, n, k in [(512, 512, 1024), (1000, 776, 320), (4097, 264, 128)]:
        k = (k + bk - 1) // bk * bk
        a = torch.randn(m, k, generator=gen, device=device).bfloat16()
        b = torch.randn(n, k, generator=gen, device=device).bfloat16()
        out = ops.gemm(a, b, out_dtype=out_dtype, config=config)
        ref = torch.matmul(a.float(), b.float().T)
        magnitude = torch.matmul(a.float().abs(), b.float().abs().T)
        rel = 2.0 ** -8 if out_dtype == torch.bfloat16 else 0.0
        bound = rel * ref.abs() + k * 2.0 ** -22 * magnitude
        err = (out.float() - ref).abs()
        assert torch.all(err <= bound), f"{m}x{n}x{k}: worst err/bound {(err / bound).max().item():.2f}"


@pytest.mark.gpu
def test_empty_and_zero_k(device):
    a, b = torch.ones(5, 0, dtype=torch.bfloat16, device=device), torch.ones(8, 0, dtype=torch.bfloat16, device=device)
    assert torch.equal(ops.gemm(a, b), torch.zeros(5, 8, dtype=torch.bfloat16, device=device))
    empty = ops.gemm(torch.ones(0, 32, dtype=torch.bfloat16, device=device),
                     torch.ones(8, 32, dtype=torch.bfloat16, device=device))
    assert empty.shape == (0, 8)
