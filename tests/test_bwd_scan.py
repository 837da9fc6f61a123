"""Kernel A, the backward state-gradient scan: its plan, sm_90a compile checks of every variant (CPU),
results against the mirror and the fp64 gold (GPU tier).

The fragment and copy models of the band-scan skeleton are tested with K2 (tests/test_fwd_recurrence.py,
which covers ``ldsm_b_t``, the one copy only Kernel A uses); the references in
tests/test_reference_backward.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from ptx_checks import assert_band_image_copies
from test_fwd_recurrence import STATE, _assert_guards_untouched, _guarded, _problem
from ulp_check import assert_within_one_ulp, bf16_ulps

from cute_kda.dsl import cute
from cute_kda.kernels.bwd_scan import BwdScan
from cute_kda.layouts import budget
from cute_kda.layouts.bwd_scan import SCAN_VSPLITS, ScanSmemPlan
from cute_kda.ops import bwd_scan as ka
from cute_kda.ops._cache import dsl_type, to_cute_tensor
from cute_kda.workspace import (WorkspaceSpec, block_states_shape, images_to_states, kept_tiles, snapshot_slots,
                                workspace_views)

D = 128
CHUNK = 16
TOL = 8e-3  # rel-RMS of dv and dh0 vs the fp64 gold (issue 9)
MIRROR_TOL = 2e-3  # rel-RMS vs the mirror over many tiles (1-ULP differences drifting through the bf16 dS)


# ============================================================================ plan (CPU)


@pytest.mark.parametrize("dim", [D, 64])
@pytest.mark.parametrize("vsplit", SCAN_VSPLITS)
def test_plan(vsplit, dim):
    plan = ScanSmemPlan(vsplit=vsplit, state_io_fp32=True, dim=dim)
    band = dim // vsplit
    assert plan.v_band == band and plan.mma_warps == min(4, band // 8) and plan.warp_cols == band // plan.mma_warps
    assert plan.warp_cols >= 8
    offsets = plan.union_offsets()
    assert list(offsets) == ["do", "kd", "qd", "kr", "gt", "inv", "mqk", "beta", "dv", "du"]
    assert offsets["du"] - offsets["dv"] == CHUNK * band * 2 * plan.output_stages
    assert plan.stage_tx_bytes == CHUNK * band * 2 + 3 * CHUNK * dim * 2 + dim * 4 + 2 * CHUNK * CHUNK * 2 + CHUNK * 4
    assert budget.k2_budget(plan).total_bytes == plan.total_bytes
    assert plan.total_bytes + 1024 <= 227 * 1024


@pytest.mark.parametrize("vsplit", SCAN_VSPLITS)
def test_token_tiles_and_their_transposed_view_are_dual(vsplit):
    """dO's band tile (the TMA's and stmatrix's face) and its MN-major view (dOᵀ, the B operand) address the
    same bytes stage by stage, in the widest swizzle whose rows fit the band (128 / 64 / 32 bytes), with the
    slots on that swizzle's period."""
    from cute_kda.layouts import bwd_scan as scan_layouts
    from cute_kda.layouts import fwd_recurrence as layouts
    from cute_kda.layouts.analysis import evaluate_layout, run_traced

    plan = ScanSmemPlan(vsplit=vsplit)
    assert plan.swizzled_tokens
    stages = plan.input_stages
    tile, view = run_traced(lambda: (evaluate_layout(layouts.value_tile(plan, stages), 2),
                                     evaluate_layout(scan_layouts.token_tile_transposed(plan, stages), 2)))
    assert tile.bytes.shape == (CHUNK, plan.v_band, stages)
    assert (tile.bytes == view.bytes.transpose(1, 0, 2)).all()
    swizzle = {1: (3, 4, 3), 2: (3, 4, 3), 4: (2, 4, 3), 8: (1, 4, 3)}[vsplit]
    assert tile.swizzle == view.swizzle == swizzle
    period = {1: 1024, 2: 1024, 4: 512, 8: 256}[vsplit]
    assert plan.field_align("do") == plan.field_align("dv") == plan.field_align("du") == period


def test_snapshot_slots_are_distinct():
    """Slot g // every + s of every block-ending tile of every sequence: distinct and inside the bound."""
    for every in (1, 2, 4, 8):
        for lengths in ([1], [0, 1, 17, 33], [64] * 5, [15, 16, 17, 100, 0, 3]):
            counts = [(n + CHUNK - 1) // CHUNK for n in lengths]
            bases = list(itertools.accumulate([0, *counts]))
            tiles = sum(lengths) // CHUNK + len(lengths)
            slots = [g // every + s for s, g in kept_tiles(bases, every)]
            assert len(set(slots)) == len(slots) and max(slots, default=0) < snapshot_slots(tiles, len(lengths), every)


def test_choose_scan_vsplit():
    from cute_kda.variants import ScanVariant

    sms = 132
    assert ScanVariant.choose_vsplit(1, 96, sms) == 1
    assert ScanVariant.choose_vsplit(1, 64, sms) == 2
    assert ScanVariant.choose_vsplit(1, 16, sms) == 8  # B1 T32768 H16: 128 CTAs
    assert ScanVariant.choose_vsplit(1, 17, sms) == 4
    assert ScanVariant.choose_vsplit(8, 32, sms) == 1


def test_launcher_rejects_mismatched_buffers():
    heads, n = 2, 2
    do = torch.zeros(n, 40, heads, D, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=6)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    snaps = torch.zeros(block_states_shape(ws, heads, n), dtype=torch.bfloat16)
    dv, du = torch.zeros_like(do), torch.zeros_like(do)
    with pytest.raises(ValueError, match="snapshots"):
        ka.bwd_scan(do, ws, dv, du, snaps[1:])
    with pytest.raises(ValueError, match="dv"):
        ka.bwd_scan(do, ws, dv.float(), du, snaps)
    with pytest.raises(ValueError, match="du"):  # dv may be fp16, du (Kernel B's operand) not
        ka.bwd_scan(do, ws, dv.half(), du.half(), snaps)
    with pytest.raises(ValueError, match="dht"):
        ka.bwd_scan(do, ws, dv, du, snaps, dht=torch.zeros(n + 1, heads, D, D))
    with pytest.raises(ValueError, match="vsplit"):
        ka.bwd_scan(do, ws, dv, du, snaps, vsplit=3)
    with pytest.raises(ValueError, match="dh0"):
        ka.bwd_scan(do, ws, dv, du, snaps, token_outputs=False)
    with pytest.raises(ValueError, match="snapshot_every"):
        ka.bwd_scan(do, ws, dv, du, snaps, snapshot_every=0)
    with pytest.raises(ValueError, match="snapshots"):  # per-tile rows handed to a 4-tile-block scan
        ka.bwd_scan(do, ws, dv, du, snaps, snapshot_every=4)


# ============================================================================ compile (CPU)


# D = 64, a sample (the CPU tier's time): every V-split, every dht and dh0 kind, both layouts of the sequences
D64_VARIANTS = [(1, "fp32", "fp32", True, 64), (2, "none", "bf16", False, 64), (4, "bf16", "none", True, 64),
                (8, "fp32", "fp32", False, 64), (8, "none", "fp32", True, 64)]


def _variants():
    """(vsplit, dht, dh0, varlen, D): every variant the launcher compiles at D = 128 (4 × 3 × 3 × 2 = 72), and
    :data:`D64_VARIANTS`."""
    return [(*variant, D) for variant in itertools.product(SCAN_VSPLITS, STATE, STATE, (False, True))] + D64_VARIANTS


def _variant_id(v) -> str:
    return "vs{}-{}-{}-{}".format(v[0], v[1], v[2], "varlen" if v[3] else "fixed") + ("" if v[4] == D else f"-D{v[4]}")


def _compile_args(vsplit, dht, dh0, varlen, dim=D, snapshot_every=1):
    heads, num_seqs = 2, 3
    batch, steps = (1, 80) if varlen else (num_seqs, 24)
    do = torch.zeros(batch, steps, heads, dim, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=8, dim=dim)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))

    def state(name):
        return None if STATE[name] is None else torch.zeros(num_seqs, heads, dim, dim, dtype=STATE[name])

    return ka.launch_arguments(
        do, ws, torch.zeros_like(do), torch.zeros_like(do),
        torch.zeros(block_states_shape(ws, heads, num_seqs, snapshot_every), dtype=torch.bfloat16),
        dht=state(dht), dh0=state(dh0), cu_seqlens=torch.tensor([0, 20, 20, 80]) if varlen else None,
        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None, tensor=to_cute_tensor,
    )


_COMPILED: dict = {}


def _compiled(variant, token_outputs=True, snapshot_every=1):
    key = (*variant, token_outputs, snapshot_every)
    if key not in _COMPILED:
        from cute_kda.compile_report import compile_with_report

        vsplit, dht, dh0, varlen, dim = variant
        kernel = BwdScan(vsplit=vsplit, dht=dsl_type(STATE[dht]), dh0=dsl_type(STATE[dh0]),
                         varlen=varlen, token_outputs=token_outputs, snapshot_every=snapshot_every, dim=dim)
        _, report = compile_with_report(kernel, *_compile_args(*variant, snapshot_every=snapshot_every),
                                        cute.runtime.make_fake_stream())
        _COMPILED[key] = (kernel, report)
    return _COMPILED[key]


@pytest.mark.parametrize("vsplit,dim", [(vsplit, D) for vsplit in SCAN_VSPLITS] + [(1, 64)],
                         ids=[str(vsplit) for vsplit in SCAN_VSPLITS] + ["1-D64"])
def test_local_gradient_variant_compiles(vsplit, dim):
    """The context-parallel backward's first pass (token_outputs=False; no dht, fp32 dh0, varlen): the products
    of every tile, no dv / du tiles, no snapshots, dh0 alone leaving by TMA."""
    kernel, report = _compiled((vsplit, "none", "fp32", True, dim), token_outputs=False)
    full_kernel, full = _compiled((vsplit, "none", "fp32", True, dim))
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    assert report.count(mma) == full.count(mma) > 0
    assert report.count("cp.async.bulk.tensor.5d.global.shared::cta") == 1  # dh0
    assert report.count("cp.async.bulk.global.shared::cta") == 0 and report.count("st.global.b32") == 0
    assert report.count("st.global.b16") == 0  # no tail rows either
    x = kernel.band_matrices
    assert report.count(f"stmatrix.sync.aligned.m8n8.x{x}.shared.b16") == 0
    assert report.count(f"stmatrix.sync.aligned.m8n8.x{x}.trans.shared.b16") == \
        full.count(f"stmatrix.sync.aligned.m8n8.x{x}.trans.shared.b16")
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    print(f"vsplit {vsplit} local gradients: {report.kernels[0].registers} registers "
          f"({full.kernels[0].registers} with the token outputs)")


@pytest.mark.parametrize("vsplit", [1, 8])
def test_block_snapshot_variant_compiles(vsplit):
    """snapshot_every=4 (one snapshot per 64 tokens, FLA's density; benchmarks/bench_bwd.py times it): the same
    products and the same snapshot copies as the per-tile scan, issued under a tile-dependent branch."""
    variant = (vsplit, "fp32", "fp32", True, D)
    _, report = _compiled(variant, snapshot_every=4)
    _, per_tile = _compiled(variant)
    for op in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.bulk.global.shared::cta",
               "st.global.b32", "cp.async.bulk.tensor.5d.global.shared::cta"):
        assert report.count(op) == per_tile.count(op), op
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.ptx != per_tile.ptx


def test_local_gradient_variant_needs_dh0():
    with pytest.raises(ValueError, match="dh0"):
        BwdScan(vsplit=1, dh0=None, token_outputs=False)


@pytest.mark.parametrize("variant", _variants(), ids=_variant_id)
def test_variant_compiles(variant):
    vsplit, dht, dh0, varlen, dim = variant
    kernel, report = _compiled(variant)
    atoms = kernel.warp_cols // 8  # n=8 mma atoms per warp row of 16
    k_steps = dim // CHUNK
    # TMA: 8 loads per stage (dO, kd, qd, kr, gT, INV, Mqk, β), two tile stores, one per state transfer
    tma = {dims: report.count(f"cp.async.bulk.tensor.{dims}d.shared::cta.global") for dims in (2, 3, 4, 5)}
    assert tma == {2: 2, 3: 3, 4: 2, 5: 1 + (dht != "none")}  # gT, β | kd, qd, kr (K_SW128) | INV, Mqk | dO, dht
    assert report.count("cp.async.bulk.tensor.5d.global.shared::cta") == 2 + (dh0 != "none")  # dv, du, dh0
    assert report.has("mbarrier.try_wait") and report.has("mbarrier.arrive.expect_tx")
    # per tile: G1 (1 k-step), G2 (D/16), G3 (1), G4 + G5 (2 per row block)
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == (1 + k_steps + 1 + 2 * k_steps) * atoms
    assert report.count("movmatrix.sync.aligned.m8n8.trans.b16") == 2 * 2 * atoms  # dU, −dv: 2 words per atom
    # dS fp32 in registers: every element decayed by one mul.rn (then the C of G4) and rounded to bf16 pairs
    # for the band buffer; dU, du, dv and −dv take 4 cvt per atom, an fp32 dht's staging 4 a thread step
    assert report.count("mul.rn.f32") == k_steps * 4 * atoms and report.count("fma.rn.f32") == 0
    words = k_steps * 2 * atoms  # 32-bit words of the warp's [K, cols] band fragment per lane
    assert report.count("cvt.rn.bf16x2.f32") == 4 * atoms + words + (dht == "fp32") * 4
    x = kernel.band_matrices
    per_slice = atoms // 2 if x == 4 else 1  # band ldmatrix/stmatrix instructions per 16-row (or 16-k) slice
    band_x4 = x == 4
    # A operands: kr (D/16, x4), Mqkᵀ/INVᵀ (2, x4.trans), qdᵀ/kdᵀ (D/8, x4.trans); band: dS' as B (D/16 k-steps),
    # dOᵀ as B (.trans)
    assert report.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == k_steps + band_x4 * k_steps * per_slice
    assert report.count("ldmatrix.sync.aligned.m8n8.x2.shared.b16") == (not band_x4) * k_steps * per_slice
    assert report.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 2 + 2 * k_steps + band_x4 * per_slice
    assert report.count("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16") == (not band_x4) * per_slice
    assert report.count(f"stmatrix.sync.aligned.m8n8.x{x}.shared.b16") == 2 * per_slice  # dv, du
    assert report.count(f"stmatrix.sync.aligned.m8n8.x{x}.trans.shared.b16") == k_steps * per_slice
    # snapshot: the warp's rows of the band buffer as D / 8 bulk copies of warp_cols · 16 bytes (one per 8-k
    # run) from one lane, the combine waiting for their read; under 32 columns the B fragment G2 loaded, as
    # 32-bit words (D · cols / 64 a lane); the store warp's tail rows are st.global.b16
    if kernel.image_by_bulk:
        assert_band_image_copies(report, kernel.warp_cols, dim)
        assert report.count("st.global.b32") == 0
    else:
        assert report.count("cp.async.bulk.global.shared::cta") == 0
        assert report.count("st.global.b32") == dim * kernel.warp_cols // 64
    assert report.has("fence.proxy.async.shared::cta") and report.has("bar.warp.sync")
    lines = report.ptx.splitlines()
    for i, line in enumerate(lines):
        if "cp.async.bulk.tensor" in line and ".global.shared::cta" in line:
            assert any("elect.sync" in prev for prev in lines[max(0, i - 24): i])
    assert report.local_memory_ops == 0
    assert len(report.kernels) == 1 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert kernel.shared_storage.__sizeof__() == kernel.plan.total_bytes
    assert report.launch_smem == [kernel.plan.total_bytes] == [budget.k2_budget(kernel.plan).total_bytes]
    print(f"{variant}: {report.kernels[0].registers} registers, {kernel.plan.total_bytes} B smem")


# ============================================================================ GPU: vs the mirror and the gold


# the GPU tests that run at both head dims Kernel A compiles for
ALL_DIMS = pytest.mark.parametrize("dim", [D, 64], ids=["D128", "D64"])


def _dht(kind, N, H, seed, device, dim=D):
    if STATE[kind] is None:
        return None
    gen = torch.Generator().manual_seed(seed + 2)
    return (torch.randn(N, H, dim, dim, generator=gen) * 0.5).to(device=device, dtype=STATE[kind])


def _run(problem, *, lengths=None, dht="fp32", dh0="fp32", vsplit=None, seed=0, lower_bound=-5.0, snapshot_every=1):
    """Workspace from the mirror's K1, then Kernel A into guarded buffers (poisoned snapshot rows too)."""
    from cute_kda.reference import mirror_prepare

    q, k, v, g, beta, A_log, bias = problem
    device = q.device
    B, T, H, dim = q.shape
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    N = B if lengths is None else len(lengths)
    ws = mirror_prepare(q, k, g, beta, A_log=A_log, dt_bias=bias, lower_bound=lower_bound, cu_seqlens=cu)
    do = (torch.randn(B, T, H, dim, generator=torch.Generator().manual_seed(seed + 3))).bfloat16().to(device)
    dht_in = _dht(dht, N, H, seed, device, dim)
    dv, dv_buf = _guarded((B, T, H, dim), torch.bfloat16, device, axis=1, pad=CHUNK)
    du, du_buf = _guarded((B, T, H, dim), torch.bfloat16, device, axis=1, pad=CHUNK)
    snaps, snaps_buf = _guarded(block_states_shape(ws, H, N, snapshot_every), torch.bfloat16, device, axis=0, pad=1)
    dh0_out = dh0_buf = None
    if STATE[dh0] is not None:
        dh0_out, dh0_buf = _guarded((N, H, dim, dim), STATE[dh0], device, axis=0, pad=1)
    ka.bwd_scan(do, ws, dv, du, snaps, cu_seqlens=cu, dht=dht_in, dh0=dh0_out, vsplit=vsplit,
                snapshot_every=snapshot_every)
    torch.cuda.synchronize()
    for buf, axis, pad in ((dv_buf, 1, CHUNK), (du_buf, 1, CHUNK), (snaps_buf, 0, 1)):
        _assert_guards_untouched(buf, axis, pad)
    if dh0_buf is not None:
        _assert_guards_untouched(dh0_buf, axis=0, pad=1)
    assert not dv.isnan().any() and not du.isnan().any(), "a dv/du row was not written"
    # the kernel keeps state images; the mirror (and these tests) [K, V] matrices
    return dict(dv=dv, du=du, snapshots=images_to_states(snaps), dh0=dh0_out, ws=ws, do=do, dht=dht_in, cu=cu)


def _mirror(run, dh0="fp32"):
    from cute_kda.reference import mirror_bwd_scan

    return mirror_bwd_scan(run["ws"], run["do"], cu_seqlens=run["cu"], dht=run["dht"],
                           dh0_dtype=STATE[dh0] or torch.float32)


def _same_bits_or_both_nan(a, b):
    bits_a, bits_b = a.view(torch.int16), b.view(torch.int16)
    return bool(((bits_a == bits_b) | (a.isnan() & b.isnan())).all())


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("T", [1, 7, 16])
@pytest.mark.parametrize("dht,dh0", [("bf16", "bf16"), ("fp32", "fp32"), ("none", "fp32")])
def test_single_tile_within_one_ulp_of_the_mirror(T, dht, dh0, dim):
    problem = _problem(2, T, 3, seed=T, dim=dim)
    run = _run(problem, dht=dht, dh0=dh0, seed=T)
    ref = _mirror(run, dh0)
    assert_within_one_ulp(f"T={T} dv", run["dv"], ref.dv)
    assert_within_one_ulp(f"T={T} du", run["du"], ref.du)
    assert_within_one_ulp(f"T={T} dh0", run["dh0"], ref.dh0)
    # a single tile's snapshot is bf16(dht) itself: bit-exact; unwritten rows stay poisoned (NaN)
    assert _same_bits_or_both_nan(run["snapshots"], ref.snapshots)


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300]], ids=["B2xT300", "varlen"])
def test_many_tiles_track_the_mirror(lengths, dim):
    from cute_kda.reference import rel_rms

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=11, dim=dim)
    run = _run(problem, lengths=lengths, dht="bf16", dh0="fp32", seed=11)
    ref = _mirror(run)
    written = ~ref.snapshots.isnan()
    assert bool((run["snapshots"].isnan() == ~written).all()), "snapshot rows written ≠ the mirror's"
    errors = {name: rel_rms(run[name], getattr(ref, name)) for name in ("dv", "du", "dh0")}
    errors["snapshots"] = rel_rms(run["snapshots"][written], ref.snapshots[written])
    print(f"dv ulps vs mirror: {torch.bincount(bf16_ulps(run['dv'], ref.dv).flatten().clamp(max=3)).tolist()}")
    print("vs mirror: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert all(err <= MIRROR_TOL for err in errors.values())


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("dh0", ["bf16", "fp32"])
def test_vsplits_are_bit_identical(dh0, dim):
    lengths = [300, 0, 17, 1, 64]
    problem = _problem(1, sum(lengths), 3, seed=5, dim=dim)
    runs = [_run(problem, lengths=lengths, dht="fp32", dh0=dh0, vsplit=s, seed=5) for s in SCAN_VSPLITS]
    for run in runs[1:]:
        for name in ("dv", "du", "snapshots"):
            assert _same_bits_or_both_nan(run[name], runs[0][name]), name
        assert torch.equal(run["dh0"], runs[0]["dh0"])


@pytest.mark.gpu
@pytest.mark.parametrize("vsplit", [1, 8])
def test_block_snapshots_are_the_per_tile_ones_at_block_ends(vsplit):
    """snapshot_every=4 (FLA's density, timed by bench_bwd.py): dv, du, dh0 bit for bit the per-tile scan's; slot
    g // 4 + s holds the per-tile snapshot of each global tile g ending a block or its sequence; nothing else is
    written (the guarded buffer's poison stays)."""
    from cute_kda.ops.prepare import tile_bases

    lengths = [300, 0, 17, 1, 64, 33]
    problem = _problem(1, sum(lengths), 3, seed=9)
    fine = _run(problem, lengths=lengths, dht="fp32", dh0="fp32", vsplit=vsplit, seed=9)
    coarse = _run(problem, lengths=lengths, dht="fp32", dh0="fp32", vsplit=vsplit, seed=9, snapshot_every=4)
    for name in ("dv", "du", "dh0"):
        assert torch.equal(coarse[name], fine[name]), name
    heads = 3
    per_tile = fine["snapshots"].view(heads, -1, D, D)  # slots of the workspace's tiles (block_states_shape)
    blocks = coarse["snapshots"].view(heads, -1, D, D)
    written = {g // 4 + s: g + s for s, g in kept_tiles(tile_bases(fine["cu"]).tolist(), 4)}
    for slot in range(blocks.shape[1]):
        if slot in written:
            assert _same_bits_or_both_nan(blocks[:, slot], per_tile[:, written[slot]]), slot
        else:
            assert bool(blocks[:, slot].isnan().all()), slot


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("vsplit", SCAN_VSPLITS)
def test_local_gradient_variant_gives_the_full_scans_dh0(vsplit, dim):
    """token_outputs=False (the context-parallel backward's first pass): the same dh0, bit for bit, and not one
    byte of dv, du or the snapshots written."""
    lengths = [300, 0, 17, 1, 64]
    problem = _problem(1, sum(lengths), 3, seed=6, dim=dim)
    run = _run(problem, lengths=lengths, dht="none", dh0="fp32", vsplit=vsplit, seed=6)
    dv, du = torch.full_like(run["dv"], float("nan")), torch.full_like(run["du"], float("nan"))
    snaps = torch.full(block_states_shape(run["ws"], 3, len(lengths)), float("nan"), dtype=torch.bfloat16,
                       device=dv.device)
    dh0 = torch.full_like(run["dh0"], float("nan"))
    ka.bwd_scan(run["do"], run["ws"], dv, du, snaps, cu_seqlens=run["cu"], dh0=dh0, vsplit=vsplit,
                token_outputs=False)
    torch.cuda.synchronize()
    assert torch.equal(dh0, run["dh0"])
    assert dv.isnan().all() and du.isnan().all() and snaps.isnan().all()


def _gold(problem, run, *, lengths, lower_bound=-5.0):
    from cute_kda.reference import gold_backward

    q, k, v, g, beta, A_log, bias = problem
    dim = q.shape[-1]
    return gold_backward(q, k, v, g, beta, run["do"], dht=run["dht"], A_log=A_log, dt_bias=bias,
                         lower_bound=lower_bound, cu_seqlens=run["cu"],
                         initial_state=torch.zeros(len(lengths) if lengths else q.shape[0], q.shape[2], dim, dim,
                                                   device=q.device))


def _check_gold(problem, *, lengths=None, dht="fp32", dh0="fp32", vsplit=None, seed=0, label="", tol=TOL):
    """Kernel A's dv and dh0 vs the fp64 gold's (autograd through the token recurrence) ≤ ``tol``."""
    from cute_kda.reference import rel_rms

    run = _run(problem, lengths=lengths, dht=dht, dh0=dh0, vsplit=vsplit, seed=seed)
    gold = _gold(problem, run, lengths=lengths)
    err_dv = rel_rms(run["dv"], gold["dv"])
    err_dh0 = rel_rms(run["dh0"], gold["dh0"]) if run["dh0"] is not None else 0.0
    print(f"{label}: dv {err_dv:.2e} dh0 {err_dh0:.2e} (limit {tol:.0e})")
    assert math.isfinite(err_dv) and err_dv <= tol
    assert math.isfinite(err_dh0) and err_dh0 <= tol


_G_RAW = (-8, 0, 8, "uniform", "normal")
_DT_BIAS = (8.0, -8.0, "normal")


@pytest.mark.gpu
@pytest.mark.parametrize("dt_bias", _DT_BIAS)
@pytest.mark.parametrize("g_raw", _G_RAW)
def test_gold_gate_cases(g_raw, dt_bias):
    """Gates saturating both ways (g_raw ± 8 with dt_bias ± 8: no decay, or the lower bound every token)."""
    problem = _problem(2, 97, 2, g_raw=g_raw, dt_bias=dt_bias, seed=1)
    _check_gold(problem, dht="bf16", dh0="fp32", seed=1, label=f"g={g_raw} bias={dt_bias}")


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,dht,dh0", [
    (1, 1, "none", "bf16"), (2, 15, "bf16", "fp32"), (8, 16, "fp32", "fp32"), (1, 17, "fp32", "bf16"),
    (2, 97, "none", "fp32"), (1, 1024, "fp32", "fp32"), (8, 100, "bf16", "bf16"),
])
def test_gold_shapes(B, T, dht, dh0):
    problem = _problem(B, T, 2, seed=T)
    _check_gold(problem, dht=dht, dh0=dh0, seed=T, label=f"B={B} T={T}")


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("lengths", [[1300, 547, 2048, 963, 271, 3063], [0, 1, 17, 33], [0, 5, 16]],
                         ids=["mixed", "0-1-17-33", "0-5-16"])
@pytest.mark.parametrize("dht,dh0", [("none", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_gold_varlen(lengths, dht, dh0, dim):
    problem = _problem(1, sum(lengths), 2, seed=len(lengths), dim=dim)
    _check_gold(problem, lengths=lengths, dht=dht, dh0=dh0, seed=3, label=f"{lengths}")


@pytest.mark.gpu
@pytest.mark.parametrize("dht,dh0,vsplit", [
    (dht, dh0, SCAN_VSPLITS[i % 4]) for i, (dht, dh0) in enumerate(itertools.product(STATE, STATE))
])
@ALL_DIMS
def test_gold_every_state_mode(dht, dh0, vsplit, dim):
    lengths = [0, 5, 16, 33]
    problem = _problem(1, sum(lengths), 2, seed=9, dim=dim)
    _check_gold(problem, lengths=lengths, dht=dht, dh0=dh0, vsplit=vsplit, seed=9, label=f"vs{vsplit} {dht}->{dh0}")


@pytest.mark.gpu
def test_empty_sequence_passes_dht_through():
    lengths = [0, 16, 0]
    problem = _problem(1, 16, 2, seed=4)
    for state in ("bf16", "fp32"):
        run = _run(problem, lengths=lengths, dht=state, dh0=state, seed=4)
        for n in (0, 2):  # dht as it came in (the band is fp32 between tiles)
            assert torch.equal(run["dh0"][n], run["dht"][n])


@pytest.mark.gpu
def test_one_million_tokens():
    """H = 1, 2^20 tokens (65 536 serial tiles): dv and dh0 vs the float64 chain of exact chunk quantities."""
    from cute_kda.reference import chunk_bwd_scan_exact, prepare_exact, rel_rms

    problem = _problem(1, 1 << 20, 1, seed=6)
    q, k, v, g, beta, A_log, bias = problem
    run = _run(problem, dht="fp32", dh0="fp32", seed=6)
    exact = chunk_bwd_scan_exact(prepare_exact(q, k, g, beta, A_log=A_log, dt_bias=bias), run["do"], dht=run["dht"])
    err_dv, err_dh0 = rel_rms(run["dv"], exact.dv), rel_rms(run["dh0"], exact.dh0)
    print(f"T=2^20 H=1: dv {err_dv:.2e} dh0 {err_dh0:.2e}")
    assert err_dv <= TOL and err_dh0 <= TOL
