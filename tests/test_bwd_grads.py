"""Kernel B, the tile gradients: its plan and sm_90a compile checks of every variant (CPU); the whole
kernel chain K1 → K2 (training) → Kernel A → Kernel B against the fp64 gold's gradients, Kernel B
against its mirror on the same inputs, and determinism (GPU tier).

The references are tested in tests/test_reference_grads.py; Kernel A in tests/test_bwd_scan.py.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from gradient_targets import SAFE_GATE_TOLERANCES as TOL
from gradient_targets import TARGETS
from test_fwd_recurrence import STATE, _assert_guards_untouched, _guarded, _problem
from test_reference_gates import BACKWARD_CASES

from cute_kda.executors import stages
from cute_kda.variants import GradsVariant
from cute_kda.dsl import cute
from cute_kda.kernels.bwd_grads import bwd_grads_kernel
from cute_kda.layouts import bwd_grads as plan
from cute_kda.ops import bwd_grads as kb
from cute_kda.ops._cache import to_cute_tensor
from cute_kda.workspace import WorkspaceSpec, block_states_shape, images_to_states, tiles_per_head, workspace_views

D = 128
CHUNK = 16
MIRROR_TOL = 2e-3  # rel-RMS vs the mirror on the same inputs (accumulation order, fp32 rounding)
CHAIN_MIRROR_TOL = 5e-3  # rel-RMS of the kernels' whole chain vs a mirror that runs its own forward
# (varlen, qk_l2norm, beta_logits, compute_warps): every flag combination at the default warps, one at 4
VARIANTS = [(*flags, plan.DEFAULT_WARPS) for flags in itertools.product((False, True), (True, False), (True, False))]
VARIANTS.append((False, True, True, 4))


# ============================================================================ plan and compile (CPU)


@pytest.mark.parametrize("warps,dim", [(warps, D) for warps in plan.COMPUTE_WARPS] + [(4, 64)])
def test_plan(warps, dim):
    assert warps in plan.compute_warps(dim) and plan.default_warps(dim) == (plan.DEFAULT_WARPS if dim == D else 4)
    budget = plan.smem_budget(warps, dim)
    assert budget.ctas_per_sm >= plan.CTAS_PER_SM == 2
    assert plan.load_bytes(dim) == 6 * CHUNK * dim * 2 + 2 * dim * dim * 2
    placed = budget.buffers
    for name in ("q", "k", "g", "do", "v", "du", "state", "state_grad"):
        assert placed[name].offset % 1024 == 0, name  # the TMA destinations, 128-byte swizzled
    # dG overlays v and du exactly; the l2norm partials overlay dβ's
    assert placed["dg_cum"].offset == placed["v"].offset
    assert placed["dg_cum"].buffer.nbytes == 2 * placed["v"].buffer.nbytes
    assert placed["dot_q"].offset == placed["dbeta_w"].offset


def _compile_args(varlen: bool, dim: int = D):
    heads, num_seqs = 2, 3
    batch, steps = (1, 80) if varlen else (num_seqs, 24)
    tok = torch.zeros(batch, steps, heads, dim, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=8, dim=dim)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    states = torch.zeros(block_states_shape(ws, heads, num_seqs), dtype=torch.bfloat16)
    ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, heads)
    return kb.launch_arguments(
        tok, tok, tok, tok, tok, tok, torch.zeros(heads), torch.zeros(heads, dim), ws, states, states, tok, tok, tok,
        torch.zeros(batch, steps, heads, dtype=torch.bfloat16), torch.zeros(ddt_shape), torch.zeros(dalog_shape),
        scale=dim ** -0.5, lower_bound=-5.0, cu_seqlens=torch.tensor([0, 20, 20, 80]) if varlen else None,
        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None, tensor=to_cute_tensor,
    )


_COMPILED: dict = {}


def _compiled(variant, dim: int = D):
    if (variant, dim) not in _COMPILED:
        from cute_kda.compile_report import compile_with_report

        # then gate_ahead, split_load, split_rows, slopes_ahead
        varlen, qk_l2norm, beta_logits, warps, *switches = variant
        gate_ahead, split_load, split_rows, slopes_ahead = (*switches, False, False, False, False)[:4]
        kernel = bwd_grads_kernel(varlen=varlen, qk_l2norm=qk_l2norm, beta_logits=beta_logits, compute_warps=warps,
                                  gate_ahead=gate_ahead, split_load=split_load, split_rows=split_rows,
                                  slopes_ahead=slopes_ahead, dim=dim)
        _, report = compile_with_report(kernel, *_compile_args(varlen, dim), cute.runtime.make_fake_stream())
        _COMPILED[(variant, dim)] = (kernel, report)
    return _COMPILED[(variant, dim)]


# D = 64 (4 warps, the one count built there), a sample for the CPU tier's time: both sequence layouts, every flag
D64_VARIANTS = [(True, True, True, 4), (False, False, False, 4)]


@pytest.mark.parametrize("variant,dim", [(v, D) for v in VARIANTS] + [(v, 64) for v in D64_VARIANTS],
                         ids=lambda v: f"D{v}" if isinstance(v, int) else "{}-{}-{}-{}warps".format(
                             "varlen" if v[0] else "fixed", "l2norm" if v[1] else "raw_qk",
                             "beta_logits" if v[2] else "beta", v[3]))
def test_variant_compiles(variant, dim):
    kernel, report = _compiled(variant, dim)
    k_steps = dim // CHUNK
    band = dim // variant[3]
    band_atoms, band_x4 = band // 8, band // 16  # n=8 mma atoms, ldmatrix.x4 (16 n) of a warp's band
    # kd·S (8) + INV·u (1) per band; dO·Uᵀ (8), du·Uᵀ (8), kd·kinvᵀ (8) at 16 columns; dqd, dkd (8 + 1 each),
    # dkinv (2), dkr (8) per band
    mmas = (k_steps + 1) * band_atoms + 3 * k_steps * 2 + (2 * (k_steps + 1) + 2 + k_steps) * band_atoms
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == mmas
    assert report.count("movmatrix.sync.aligned.m8n8.trans.b16") == 2 * band_atoms  # u: C → B
    # transposed reads: S and dS' as [K, V] through the state image's MN_INTER face (per k-step; dqd and dkd
    # share S's), kinvᵀ (one load serves dqd and dkd), qdᵀ and kdᵀ as B (band_x4 each); dMqkᵀ and β·dLᵀ
    # (1 each) as A
    assert report.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == band_x4 * (2 * k_steps + 3) + 2
    assert report.has("ldmatrix.sync.aligned.m8n8.x4.shared.b16")
    # six token tiles by TMA (4-D boxes) and the two state images by 1-D bulk copies, one transaction barrier
    assert report.count("cp.async.bulk.tensor") == 6
    assert report.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 2
    assert report.has("mbarrier.try_wait") and report.has("mbarrier.arrive.expect_tx")
    assert report.count("ex2.approx.ftz.f32") >= 4 and report.has("tanh.approx.f32")
    assert not report.has("atom.") and not report.has("red.")  # no atomics: partial sums per tile
    assert report.local_memory_ops == 0
    assert len(report.kernels) == 1 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == [plan.smem_budget(variant[3], dim).total_bytes]
    print(f"{variant} D={dim}: {report.kernels[0].registers} registers, {report.launch_smem[0]} B smem")


def _gate_loads_and_stores(ptx: str) -> tuple[list[int], list[int]]:
    """Line numbers of the scalar 16-bit global loads (the gate backward's raw g, one a row) and stores (its dg,
    dβ) of a Kernel B PTX."""
    lines = ptx.splitlines()
    loads = [i for i, line in enumerate(lines) if line.split()[:1] == ["ld.global.b16"]]
    stores = [i for i, line in enumerate(lines) if line.split()[:1] == ["st.global.b16"]]
    return loads, stores


def _assert_gate_ahead(plain, ahead) -> None:
    """``gate_ahead`` (docs/perf-log.md, B5) against the plain variant's report: the same loads, products and plan;
    the plain loop reloads g between its dg stores (ptxas may not pass a store with a load), the ahead one issues
    every g load before its first dg store; no spills under the two-CTA cap."""
    loads, stores = _gate_loads_and_stores(plain.ptx)
    assert len(loads) >= CHUNK and len(stores) >= CHUNK and any(stores[0] < i for i in loads)
    loads, stores = _gate_loads_and_stores(ahead.ptx)
    assert len(loads) >= CHUNK and len(stores) >= CHUNK and max(loads) < stores[0]
    for mnemonic in ("ld.global.b16", "st.global.b16", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                     "ex2.approx.ftz.f32", "bar.sync", "cp.async.bulk.tensor"):
        assert ahead.count(mnemonic) == plain.count(mnemonic), mnemonic
    assert ahead.local_memory_ops == 0 and ahead.spills == 0 and ahead.kernels[0].stack_frame == 0
    assert ahead.launch_smem == plain.launch_smem
    print(f"gate_ahead: {ahead.kernels[0].registers} registers (plain {plain.kernels[0].registers})")


# the safe gate's gate_ahead variants: fixed and varlen, both warp counts, the other flags once
GATE_AHEAD_VARIANTS = [(False, True, True, 8), (True, True, True, 8), (True, False, False, 8), (False, True, True, 4)]


@pytest.mark.parametrize("variant", GATE_AHEAD_VARIANTS, ids=lambda v: "{}-{}-{}warps".format(
    "varlen" if v[0] else "fixed", "l2norm_logits" if v[1] else "plain", v[3]))
def test_gate_ahead_variant_compiles(variant):
    _, plain = _compiled(variant)
    _, ahead = _compiled((*variant, True))
    _assert_gate_ahead(plain, ahead)
    assert ahead.kernels[0].registers <= 65536 // (plan.CTAS_PER_SM * variant[3] * 32)


def _assert_split_load(plain, split, budget, ctas: int = plan.CTAS_PER_SM) -> None:
    """``split_load`` (docs/perf-log.md, B6) against the plain variant's report: two transaction barriers, the
    second waited for after phase 2's barriers; the same products and loads; its plan still two CTAs an SM."""
    assert plain.count("mbarrier.init") == 1 and split.count("mbarrier.init") == 2
    assert split.count("mbarrier.arrive.expect_tx") == 2
    assert split.count("mbarrier.try_wait") == plain.count("mbarrier.try_wait") + 1
    lines = split.ptx.splitlines()
    waits = [i for i, line in enumerate(lines) if "mbarrier.try_wait" in line]
    syncs = [i for i, line in enumerate(lines) if line.split()[:1] == ["bar.sync"]]
    assert sum(waits[0] < i < waits[-1] for i in syncs) >= 2  # K1's recompute lies between the two waits
    for mnemonic in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.bulk.tensor",
                     "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "ld.global", "st.global"):
        assert split.count(mnemonic) == plain.count(mnemonic), mnemonic
    assert split.local_memory_ops == 0 and split.spills == 0 and split.kernels[0].stack_frame == 0
    assert split.launch_smem == [budget.total_bytes] and budget.ctas_per_sm >= ctas
    print(f"split_load: {split.kernels[0].registers} registers (plain {plain.kernels[0].registers}), "
          f"{budget.total_bytes} B smem")


@pytest.mark.parametrize("variant", GATE_AHEAD_VARIANTS[:2] + GATE_AHEAD_VARIANTS[3:],
                         ids=lambda v: "{}-{}warps".format("varlen" if v[0] else "fixed", v[3]))
def test_split_load_variant_compiles(variant):
    _, plain = _compiled(variant)
    _, split = _compiled((*variant, False, True))
    _assert_split_load(plain, split, plan.smem_budget(variant[3], split_load=True))
    _, both = _compiled((*variant, True, True))  # the two switches together
    _assert_split_load(plain, both, plan.smem_budget(variant[3], split_load=True))
    _assert_gate_ahead(split, both)


# slopes_ahead over the launcher's safe variants: fixed and varlen at 8 warps with gate_ahead, 4 warps, no gate_ahead
SLOPES_AHEAD_BASES = [(False, True, True, 8, True), (True, True, True, 8, True), (False, True, True, 4, True),
                      (False, True, True, 8, False)]


@pytest.mark.parametrize("base", SLOPES_AHEAD_BASES, ids=lambda v: "{}-{}warps-{}".format(
    "varlen" if v[0] else "fixed", v[3], "gate_ahead" if v[4] else "plain"))
def test_slopes_ahead_variant_compiles(base):
    """``slopes_ahead`` (docs/perf-log.md, B8) against the variant without it: the same global loads and stores,
    products, barriers, ex2 and plan; one ``rcp.approx.ftz`` a reciprocal (two a row), the divisions (``rcp.rn``) kept
    for the fallback (which takes the rows' ex2 as they are); no spills under the two-CTA cap."""
    _, plain = _compiled(base)
    _, slopes = _compiled((*base, False, False, True))
    for mnemonic in ("ld.global", "st.global", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "bar.sync",
                     "mbarrier.try_wait", "cp.async.bulk.tensor", "rcp.rn.f32", "ex2.approx.ftz.f32"):
        assert slopes.count(mnemonic) == plain.count(mnemonic), mnemonic
    assert slopes.count("rcp.approx.ftz.f32") == plain.count("rcp.approx.ftz.f32") + 2 * CHUNK
    assert slopes.local_memory_ops == 0 and slopes.spills == 0 and slopes.kernels[0].stack_frame == 0
    assert slopes.launch_smem == plain.launch_smem
    assert slopes.kernels[0].registers <= 65536 // (plan.CTAS_PER_SM * base[3] * 32)
    print(f"slopes_ahead: {slopes.kernels[0].registers} registers (without {plain.kernels[0].registers})")
    with pytest.raises(ValueError, match="slopes_ahead"):
        bwd_grads_kernel(varlen=base[0], split_rows=True, slopes_ahead=True)
    with pytest.raises(ValueError, match="slopes_ahead"):
        bwd_grads_kernel(varlen=base[0], gate="softplus", slopes_ahead=True)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_split_rows_variant_compiles(varlen):
    """``split_rows`` (docs/perf-log.md, B7), alone and with the other two switches: the same global loads and stores,
    products and ex2 as without it, one more barrier (after warps 4-7's x and σ'(x)), no spills under the two-CTA
    cap."""
    variant = (varlen, True, True, 8)
    _, plain = _compiled(variant)
    for switches in ((False, False, True), (True, True, True)):
        _, split = _compiled((*variant, *switches))
        base = _compiled((*variant, *switches[:2]))[1] if any(switches[:2]) else plain
        for mnemonic in ("ld.global", "st.global", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                         "mbarrier.try_wait", "ex2.approx.ftz.f32"):
            assert split.count(mnemonic) == base.count(mnemonic), (switches, mnemonic)
        assert split.count("bar.sync") == base.count("bar.sync") + 1
        assert split.local_memory_ops == 0 and split.spills == 0 and split.kernels[0].stack_frame == 0
        assert split.launch_smem == base.launch_smem
        assert split.kernels[0].registers <= 65536 // (plan.CTAS_PER_SM * 8 * 32)
        print(f"split_rows {switches}: {split.kernels[0].registers} registers (without {base.kernels[0].registers})")
    with pytest.raises(ValueError, match="split_rows"):
        bwd_grads_kernel(varlen=varlen, compute_warps=4, split_rows=True)
    with pytest.raises(ValueError, match="split_rows"):
        bwd_grads_kernel(varlen=varlen, gate="softplus", split_rows=True)


def test_gate_ahead_is_refused_where_no_gate_row_is_read():
    assert plan.reads_gate_rows("safe", False) and plan.reads_gate_rows("softplus", False)
    assert not plan.reads_gate_rows("none", False) and not plan.reads_gate_rows("softplus", True)
    with pytest.raises(ValueError, match="gate_ahead"):
        bwd_grads_kernel(varlen=False, gate="softplus", per_head_gate=True, gate_ahead=True)
    with pytest.raises(ValueError, match="gate_ahead"):
        bwd_grads_kernel(varlen=False, gate="none", gate_ahead=True)


# a per-head gate (GatedDeltaNet): (varlen, gate, g dtype, grouped, qk_l2norm, beta_logits)
PER_HEAD_VARIANTS = [
    (False, "softplus", torch.bfloat16, True, True, True),
    (True, "softplus", torch.bfloat16, False, True, True),
    (True, "none", torch.float32, True, True, True),
    (False, "none", torch.bfloat16, False, False, False),
]


def test_per_head_plan():
    """The per-head gate's plan keeps two CTAs per SM; its TMA loads five token tiles (no gate tile) and the states."""
    for warps in plan.COMPUTE_WARPS:
        assert plan.per_head_smem_budget(warps).ctas_per_sm >= plan.CTAS_PER_SM
    assert plan.load_bytes(per_head_gate=True) == 5 * CHUNK * D * 2 + 2 * D * D * 2
    placed = plan.per_head_smem_budget(plan.DEFAULT_WARPS).buffers
    for name in ("q", "k", "v", "do", "du", "state", "state_grad"):
        assert placed[name].offset % 1024 == 0, name
    assert placed["dot_q"].offset == placed["dbeta_w"].offset


_LAUNCH_ORDER = ("q", "k", "g", "v", "do", "du", "A_log", "dt_bias", "ws", "states", "state_grads", "dq", "dk", "dg",
                 "dbeta", "ddt_partial", "dalog_partial")  # kb.launch_arguments' positional tensors


def _per_head_buffers(gate: str = "softplus", grouped: bool = True, varlen: bool = False,
                      g_dtype: torch.dtype = torch.bfloat16, dim: int = D) -> dict:
    """``bwd_grads``' keyword arguments for a per-head gate as CPU zeros: T = 40 tokens, HV = 2 value heads on 1
    q/k head (2 without grouping); one sequence, or with ``varlen`` three packed ([20, 0, 20])."""
    qk_heads, heads, T = (1 if grouped else 2), 2, 40
    cu_seqlens = torch.tensor([0, 20, 20, 40]) if varlen else None
    num_seqs = 3 if varlen else 1
    qk = torch.zeros(1, T, qk_heads, dim, dtype=torch.bfloat16)
    tok = torch.zeros(1, T, heads, dim, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=tiles_per_head(T, num_seqs, varlen), dim=dim)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    states = torch.zeros(block_states_shape(ws, heads, num_seqs), dtype=torch.bfloat16)
    ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, heads, per_head_gate=True)
    constants = gate != "none"
    return dict(q=qk, k=qk, g=torch.zeros(1, T, heads, dtype=g_dtype), v=tok, do=tok, du=tok, ws=ws,
                states=states, state_grads=states, A_log=torch.zeros(heads) if constants else None,
                dt_bias=torch.zeros(heads) if constants else None, dq=tok.clone(), dk=tok.clone(),
                dg=torch.zeros(1, T, heads), dbeta=torch.zeros(1, T, heads, dtype=torch.bfloat16),
                ddt_partial=torch.zeros(ddt_shape) if constants else None,
                dalog_partial=torch.zeros(dalog_shape) if constants else None, cu_seqlens=cu_seqlens,
                tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None, gate=gate, scale=0.1,
                lower_bound=-5.0)


def _variant_id(variant) -> str:
    varlen, gate, g_dtype, grouped, qk_l2norm, _ = variant
    return "{}-{}-{}-{}-{}".format("varlen" if varlen else "fixed", gate, str(g_dtype).replace("torch.", ""),
                                   "grouped" if grouped else "HV=H", "l2norm_logits" if qk_l2norm else "plain")


def _compile_unbounded(variant, per_head: bool, gate_ahead: bool = False, split_load: bool = False, dim: int = D,
                       group_sum: bool = False):
    """Compile Kernel B for an unbounded-gate ``variant`` (per head, or the per-channel dyadic form; ``group_sum``:
    dq, dk per q/k head, the grouped pair added by the kernel) on the CPU buffers, check what every such variant must
    show (one kernel, the 7 TMA loads under one transaction barrier, no atomics but ``group_sum``'s bf16x2
    reductions, no local memory or spills, the plan's shared memory) and return the report."""
    from cute_kda.compile_report import compile_with_report
    from cute_kda.ops._cache import dsl_type

    varlen, gate, g_dtype, grouped, qk_l2norm, beta_logits = variant
    kernel = bwd_grads_kernel(varlen=varlen, qk_l2norm=qk_l2norm, beta_logits=beta_logits, gate=gate,
                              gate_dtype=dsl_type(g_dtype), per_head_gate=per_head, grouped=grouped,
                              gate_ahead=gate_ahead, split_load=split_load, dim=dim,
                              compute_warps=plan.default_warps(dim), group_sum=group_sum)
    buffers = (_per_head_buffers if per_head else _dyadic_buffers)(gate, grouped, varlen, g_dtype, dim)
    if group_sum:
        buffers["dq"], buffers["dk"] = torch.zeros_like(buffers["q"]), torch.zeros_like(buffers["k"])
    arguments = kb.launch_arguments(*(buffers[name] for name in _LAUNCH_ORDER), scale=dim ** -0.5, lower_bound=-5.0,
                                    cu_seqlens=buffers["cu_seqlens"], tile_base=buffers["tile_base"],
                                    tensor=to_cute_tensor)
    _, report = compile_with_report(kernel, *arguments, cute.runtime.make_fake_stream())
    budget = kernel.smem_budget()
    assert report.count("cp.async.bulk.tensor") == 5  # q, k, v, dO, du; the two state images by 1-D bulk copies
    assert report.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 2
    assert report.has("mbarrier.try_wait") and report.has("mbarrier.arrive.expect_tx")
    # no atomics (partial sums per tile) but group_sum's adds of dq, dk: a 32-bit pair a lane and row of a fragment
    reductions = 2 * 2 * (dim // plan.default_warps(dim) // 8) if group_sum else 0
    assert report.count("red.global.add.noftz.bf16x2") == reductions
    assert not report.has("atom.") and report.count("red.") == reductions
    assert report.local_memory_ops == 0
    assert len(report.kernels) == 1 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == [budget.total_bytes]
    print(f"{variant}: {report.kernels[0].registers} registers, {report.launch_smem[0]} B smem")
    return report


def _with_d64(variants: list) -> list:
    """``(variant, D)`` of every variant, and the first at D = 64 (a sample: the CPU tier's time)."""
    return [pytest.param(v, D, id=_variant_id(v)) for v in variants] + [
        pytest.param(variants[0], 64, id=_variant_id(variants[0]) + "-D64")]


@pytest.mark.parametrize("variant,dim", _with_d64(PER_HEAD_VARIANTS))
def test_per_head_variant_compiles(variant, dim):
    report = _compile_unbounded(variant, per_head=True, dim=dim)
    gate = variant[1]
    k_steps, band_atoms = dim // CHUNK, dim // plan.default_warps(dim) // 8
    # kd·S and INV·u per band; dO·Uᵀ, q̂k̂ᵀ (warp 0), du·Uᵀ, k̂k̂ᵀ (warp 1) at 16 columns; dqd, dkd, dkr per band
    # and the pair terms: bf16(E ⊙ dMqk)·k̂ (1 k-step), [dP | dPᵀ | dPqᵀ]·[k̂; k̂; q̂] (3 k-steps)
    mmas = (k_steps + 1) * band_atoms + 4 * k_steps * 2 + (3 * k_steps + 4) * band_atoms
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == mmas
    assert report.count("lg2.approx.f32") == (1 if gate == "softplus" else 0)  # the gate's softplus, one row a thread


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head", "dyadic"])
def test_group_sum_variant_compiles(per_head):
    """``group_sum`` (grouped value heads in pairs): the same kernel but for dq, dk added into the q/k head's rows by
    bf16x2 reductions instead of stored, no more registers than the plain grouped variant's."""
    variant = next(v for v in (PER_HEAD_VARIANTS if per_head else DYADIC_VARIANTS) if v[3])
    plain = _compile_unbounded(variant, per_head)
    summed = _compile_unbounded(variant, per_head, group_sum=True)
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    assert summed.count(mma) == plain.count(mma)
    assert summed.kernels[0].registers <= plain.kernels[0].registers
    with pytest.raises(ValueError, match="group_sum"):
        bwd_grads_kernel(varlen=False, gate="softplus", per_head_gate=per_head, group_sum=True)


def test_refused_configurations():
    with pytest.raises(ValueError, match="per-head gate"):
        bwd_grads_kernel(varlen=False, per_head_gate=True)
    with pytest.raises(NotImplementedError, match="grouped"):
        bwd_grads_kernel(varlen=False, grouped=True)
    with pytest.raises(ValueError, match="D = 64"):  # 4 warps only at 64
        bwd_grads_kernel(varlen=False, compute_warps=8, dim=64)
    with pytest.raises(ValueError, match="dim"):
        bwd_grads_kernel(varlen=False, compute_warps=4, dim=32)


# the per-channel unbounded gates (Kernel B's dyadic variant): (varlen, gate, g dtype, grouped, qk_l2norm, beta_logits)
DYADIC_VARIANTS = [
    (False, "softplus", torch.bfloat16, False, True, True),
    (True, "softplus", torch.bfloat16, True, True, True),
    (True, "none", torch.float32, False, True, True),
    (False, "none", torch.bfloat16, True, False, False),
]


def test_dyadic_plan():
    """The dyadic plan's first form fits one CTA per SM; S's and dS''s bytes hold the sums after the state products."""
    budget = plan.dyadic_smem_budget(plan.DEFAULT_WARPS)
    assert budget.ctas_per_sm >= plan.DYADIC_CTAS_PER_SM
    placed = budget.buffers
    assert placed["level_sum0"].offset == placed["state"].offset
    assert placed["row_x"].offset == placed["state_grad"].offset
    for name in ("q", "k", "v", "do", "du", "state", "state_grad"):
        assert placed[name].offset % 1024 == 0, name


def _dyadic_buffers(gate: str = "softplus", grouped: bool = False, varlen: bool = False,
                    g_dtype: torch.dtype = torch.bfloat16, dim: int = D) -> dict:
    """:func:`_per_head_buffers` with a per-channel gate: g, dg ``[1, T, HV, D]``, the partials per channel."""
    buffers = _per_head_buffers(gate, grouped, varlen, g_dtype, dim)
    heads, T = buffers["v"].shape[2], buffers["v"].shape[1]
    ddt_shape, dalog_shape = kb.gate_partials_shapes(buffers["ws"], heads)
    constants = gate != "none"
    return {**buffers, "g": torch.zeros(1, T, heads, dim, dtype=g_dtype),
            "dg": torch.zeros(1, T, heads, dim, dtype=torch.bfloat16),
            "dt_bias": torch.zeros(heads, dim) if constants else None,
            "ddt_partial": torch.zeros(ddt_shape) if constants else None,
            "dalog_partial": torch.zeros(dalog_shape) if constants else None}


@pytest.mark.parametrize("variant,dim", _with_d64(DYADIC_VARIANTS))
def test_dyadic_variant_compiles(variant, dim):
    report = _compile_unbounded(variant, per_head=False, dim=dim)
    gate = variant[1]
    k_steps, band_atoms, levels = dim // CHUNK, dim // plan.default_warps(dim) // 8, plan.DYADIC_LEVELS
    # kd·S and INV·u per band; dO·Uᵀ (warp 0), du·Uᵀ (warp 1); per level X·Xᵀ (a warp each: level 0 keeps one of
    # its two 8-column halves, the other straddles nothing); dqd, dkd, dkr per band; per level P, Pq (1 k-step
    # each) and C (2) per band
    mmas = ((k_steps + 1) * band_atoms + 2 * k_steps * 2 + (levels * 2 - 1) * k_steps
            + (3 * k_steps + 4 * levels) * band_atoms)
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == mmas
    # the gate's softplus per (row, channel): K1's scan and dA_log's γ, one channel a thread
    assert report.count("lg2.approx.f32") == (2 * CHUNK if gate == "softplus" else 0)
    assert report.has("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") and report.has("stmatrix")


@pytest.mark.parametrize("variant", [v for v in DYADIC_VARIANTS if v[1] == "softplus"], ids=_variant_id)
def test_dyadic_gate_ahead_variant_compiles(variant):
    _assert_gate_ahead(_compile_unbounded(variant, per_head=False),
                       _compile_unbounded(variant, per_head=False, gate_ahead=True))


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head-softplus", "dyadic-softplus"])
def test_unbounded_split_load_variant_compiles(per_head):
    variant = (PER_HEAD_VARIANTS if per_head else DYADIC_VARIANTS)[0]
    plain = _compile_unbounded(variant, per_head)
    split = _compile_unbounded(variant, per_head, split_load=True)
    budget = (plan.per_head_smem_budget if per_head else plan.dyadic_smem_budget)(plan.DEFAULT_WARPS, split_load=True)
    _assert_split_load(plain, split, budget, plan.CTAS_PER_SM if per_head else plan.DYADIC_CTAS_PER_SM)


_CPU_HEADS, _CPU_SEQS, _CPU_T = 2, 2, 40


def _cpu_launch_args() -> list:
    """``bwd_grads``' positional arguments as CPU zeros: B = N = 2, T = 40, H = 2, a 6-tile workspace."""
    heads, n, T = _CPU_HEADS, _CPU_SEQS, _CPU_T
    tok = torch.zeros(n, T, heads, D, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=6)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    states = torch.zeros(block_states_shape(ws, heads, n), dtype=torch.bfloat16)
    ddt, dalog = (torch.zeros(s) for s in kb.gate_partials_shapes(ws, heads))
    dbeta = torch.zeros(n, T, heads, dtype=torch.bfloat16)
    return [tok, tok, tok, tok, tok, tok, ws, states, states, torch.zeros(heads), torch.zeros(heads, D), tok, tok,
            tok, dbeta, ddt, dalog]


def test_launcher_rejects_mismatched_buffers():
    args = _cpu_launch_args()
    tok, states, dbeta, ddt, dalog = args[0], args[7], args[14], args[15], args[16]
    cases = {1: tok.float(), 7: states[1:], 8: states.float(), 14: dbeta[:, 1:], 15: ddt[:, 1:], 16: dalog.double(),
             11: tok.transpose(0, 1).contiguous().transpose(0, 1), 12: tok.half()}  # dk fp16 beside a bf16 dq
    for index, bad in cases.items():
        broken = list(args)
        broken[index] = bad
        with pytest.raises(ValueError):
            kb.bwd_grads(*broken, scale=0.1, lower_bound=-5.0)


def test_training_size_limit():
    """Kernel B's per-token offsets are 32-bit: more than 2^31 elements per tensor is refused by name
    (checked on a meta tensor: no memory)."""
    from cute_kda import validation

    validation.check_training_size(torch.empty(1, 2 ** 24, 1, 128, device="meta"))  # 2^31: allowed
    with pytest.raises(NotImplementedError, match="2\\^31"):
        validation.check_training_size(torch.empty(1, 2 ** 24 + 1, 1, 128, device="meta"))


def test_launcher_keys_the_variant_and_builds_its_arguments(monkeypatch):
    """The launch path up to the compiled call, on the CPU: the key, the argument bundles, the stream."""
    seen = []

    def compiled(variant, index, tensors, options):
        seen.append((variant, index))
        return lambda *args: seen.append(args)

    monkeypatch.setattr(kb, "compiled_variant", compiled)
    monkeypatch.setattr(kb, "current_stream", lambda device: "stream")
    monkeypatch.setattr(kb, "device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0, compute_warps=4)
    key, args = seen
    assert key == (GradsVariant(False, True, True, "safe", torch.bfloat16, False, False, 4, gate_ahead=kb.GATE_AHEAD,
                                slopes_ahead=kb.SLOPES_AHEAD), 0)
    assert len(args) == 11 and args[-1] == "stream" and args[6] == _CPU_T and args[-2] is None  # no pair form
    with pytest.raises(ValueError, match="compute_warps"):
        kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0, compute_warps=2)


def test_launcher_keys_the_switches(monkeypatch):
    """``GATE_AHEAD`` on: the per-channel gates with A_log / dt_bias key ``gate_ahead``; a per-head gate and a log
    decay keep the plain variant (nothing to batch, no second compile). ``SPLIT_LOAD`` on: every scheme keys
    ``split_load``. ``SPLIT_ROWS`` and ``SLOPES_AHEAD``: the safe gate only, ``split_rows`` at 8 warps and
    ``slopes_ahead`` where ``split_rows`` is not keyed."""
    seen = []
    monkeypatch.setattr(kb, "compiled_variant", lambda variant, index, tensors, options: seen.append(
        variant) or (lambda *args: None))
    monkeypatch.setattr(kb, "current_stream", lambda device: "stream")
    monkeypatch.setattr(kb, "device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kb, "GATE_AHEAD", False)
    monkeypatch.setattr(kb, "SLOPES_AHEAD", False)
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0)
    monkeypatch.setattr(kb, "GATE_AHEAD", True)
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0)
    kb.bwd_grads(**_dyadic_buffers("softplus"))
    kb.bwd_grads(**_dyadic_buffers("none"))
    kb.bwd_grads(**_per_head_buffers("softplus"))
    assert [variant.gate_ahead for variant in seen] == [False, True, True, False, False]
    assert not any(variant.split_load for variant in seen)
    seen.clear()
    monkeypatch.setattr(kb, "SPLIT_LOAD", True)
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0)
    kb.bwd_grads(**_per_head_buffers("softplus"))
    assert [(variant.gate_ahead, variant.split_load) for variant in seen] == [(True, True), (False, True)]
    assert not any(variant.split_rows for variant in seen)
    seen.clear()
    monkeypatch.setattr(kb, "SPLIT_ROWS", True)  # the safe gate at 8 warps only
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0)
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0, compute_warps=4)
    kb.bwd_grads(**_dyadic_buffers("softplus"))
    assert [variant.split_rows for variant in seen] == [True, False, False]
    assert not any(variant.slopes_ahead for variant in seen)
    seen.clear()
    monkeypatch.setattr(kb, "SLOPES_AHEAD", True)  # the safe gate, both warp counts; split_rows keeps its own loop
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0)
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0, compute_warps=4)
    kb.bwd_grads(**_dyadic_buffers("softplus"))
    monkeypatch.setattr(kb, "SPLIT_ROWS", False)
    kb.bwd_grads(*_cpu_launch_args(), scale=0.1, lower_bound=-5.0)
    assert [(variant.split_rows, variant.slopes_ahead) for variant in seen] == [(True, False), (False, True),
                                                                                (False, False), (False, True)]


# ============================================================================ GPU: the kernel chain


def chain_draws(B, T, H, N, *, seed, initial="fp32", dht="fp32", device="cuda", dim=D):
    """The chain's initial state, dht (``STATE`` kinds: None for "none") and bf16 dO, from one generator."""
    gen = torch.Generator().manual_seed(seed + 7)
    init = None if STATE[initial] is None else (torch.randn(N, H, dim, dim, generator=gen) * 0.3).to(device, STATE[initial])
    dht_in = None if STATE[dht] is None else (torch.randn(N, H, dim, dim, generator=gen) * 0.3).to(device, STATE[dht])
    do = torch.randn(B, T, H, dim, generator=gen).bfloat16().to(device)
    return init, dht_in, do


def _chain(problem, *, lengths=None, dht="fp32", initial="fp32", seed=0, lower_bound=-5.0, qk_l2norm=True,
           beta_logits=True):
    """K1 → K2 (per-tile checkpoints) → Kernel A → Kernel B on the GPU; every output guarded."""
    from cute_kda.ops import bwd_scan as ka
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.workspace import allocate_workspace, tiles_per_head

    q, k, v, g, beta, A_log, bias = problem
    device = q.device
    B, T, H, dim = q.shape
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    N = B if lengths is None else len(lengths)
    init, dht_in, do = chain_draws(B, T, H, N, seed=seed, initial=initial, dht=dht, device=device, dim=dim)
    scale = dim ** -0.5
    ws = allocate_workspace(WorkspaceSpec(heads=H, tiles=tiles_per_head(B * T, N, cu is not None), dim=dim), device)
    tile_base = k1.tile_bases(cu) if cu is not None else None
    k1.prepare(q, k, g, beta, A_log, bias, ws, scale=scale, lower_bound=lower_bound, cu_seqlens=cu,
               tile_base=tile_base, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    states = torch.full(block_states_shape(ws, H, N), math.nan, dtype=torch.bfloat16, device=device)
    o = torch.empty_like(v)
    k2.recurrence(v, ws, o, cu_seqlens=cu, tile_base=tile_base, initial_state=init, final_state=None,
                  checkpoints=states)
    dv, du = torch.empty_like(do), torch.empty_like(do)
    grads = torch.full_like(states, math.nan)
    dh0 = torch.empty(N, H, dim, dim, device=device) if init is not None else None
    ka.bwd_scan(do, ws, dv, du, grads, cu_seqlens=cu, tile_base=tile_base, dht=dht_in, dh0=dh0)
    outs = {}  # guard slabs of one batch entry before and after (the outputs must stay contiguous)
    for name in ("dq", "dk", "dg"):
        outs[name], outs[name + "_buf"] = _guarded((B, T, H, dim), torch.bfloat16, device, axis=0, pad=1)
    outs["dbeta"], outs["dbeta_buf"] = _guarded((B, T, H), torch.bfloat16, device, axis=0, pad=1)
    ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, H)
    ddt = torch.full(ddt_shape, math.nan, device=device)
    dalog = torch.full(dalog_shape, math.nan, device=device)
    kb.bwd_grads(q, k, g, v, do, du, ws, states, grads, A_log, bias, outs["dq"], outs["dk"], outs["dg"],
                 outs["dbeta"], ddt, dalog, scale=scale, lower_bound=lower_bound, cu_seqlens=cu, tile_base=tile_base,
                 qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    torch.cuda.synchronize()
    for name in ("dq", "dk", "dg", "dbeta"):
        _assert_guards_untouched(outs.pop(name + "_buf"), axis=0, pad=1)
    for name in ("dq", "dk", "dg", "dbeta"):
        assert not outs[name].isnan().any(), f"a {name} row was not written"
    assert not ddt.isnan().any() and not dalog.isnan().any(), "a partial-sum slot was not written"
    outs.update(dv=dv, dh0=dh0, dA_log=dalog.sum(1), ddt_bias=ddt.sum(1), ddt_partial=ddt, dalog_partial=dalog,
                du=du, ws=ws, states=images_to_states(states), state_grads=images_to_states(grads), do=do, dht=dht_in,
                init=init, cu=cu, scale=scale)  # the kernels' state images as the mirror's [K, V] matrices
    return outs


def _gold(problem, run, *, lower_bound=-5.0, qk_l2norm=True, beta_logits=True):
    from cute_kda.reference import gold_backward

    q, k, v, g, beta, A_log, bias = problem
    return gold_backward(q, k, v, g, beta, run["do"], dht=run["dht"], A_log=A_log, dt_bias=bias,
                         lower_bound=lower_bound, cu_seqlens=run["cu"], initial_state=run["init"],
                         qk_l2norm=qk_l2norm, beta_logits=beta_logits)


def _check_gold(problem, label, **options):
    from cute_kda.reference import rel_rms

    gold_keys = ("lower_bound", "qk_l2norm", "beta_logits")
    run = _chain(problem, **options)
    gold = _gold(problem, run, **{k: v for k, v in options.items() if k in gold_keys})
    errors = {name: rel_rms(run[name], gold[name]) for name in TOL if run.get(name) is not None}
    print(f"{label}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    for name, err in errors.items():
        assert math.isfinite(err) and err <= TOL[name], (label, name, err)
    return run


# dA_log on the H200 (2026-12-01, dS fp32 in Kernel A): 2.93e-2 at g = 8·N(0, 1) with dt_bias = 8; the CPU mirror
# gives 2.98e-2 on the same inputs. Its sum cancels: dA_log = Σ dγ·γ over T·K terms is 1-2 % of Σ|dγ·γ|. On the case
# that crossed 2e-2 before (B2 T100, 3.8e-2 with dS bf16; it passes now, the mirror at 2.2e-2) the float64 chain over
# K1's rounded workspace kept the error: the forward's bf16 operands set it, and which case crosses moves with them.
_DALOG_CANCELS = pytest.mark.xfail(strict=True, reason="dA_log 2.9e-2 > 2e-2: cancellation in the sum (see above)")


# the GPU tests that run at both head dims Kernel B compiles for
ALL_DIMS = pytest.mark.parametrize("dim", [D, 64], ids=["D128", "D64"])


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("B,T,initial,dht", [
    (1, 1, "fp32", "none"), (2, 15, "bf16", "fp32"), (1, 16, "none", "none"), (2, 17, "fp32", "bf16"),
    (2, 100, "fp32", "fp32"), (1, 1024, "none", "fp32"), (8, 64, "bf16", "bf16"),
])
def test_gold_shapes(B, T, initial, dht, dim):
    _check_gold(_problem(B, T, 2, seed=T, dim=dim), f"B={B} T={T} {initial}/{dht} D={dim}", initial=initial, dht=dht,
                seed=T)


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("lengths", [[0, 1, 17, 33], [300, 0, 5, 64, 1], [1300, 547, 80]],
                         ids=["0-1-17-33", "300-0-5-64-1", "1300-547-80"])
def test_gold_varlen(lengths, dim):
    _check_gold(_problem(1, sum(lengths), 2, seed=len(lengths), dim=dim), f"{lengths} D={dim}", lengths=lengths,
                seed=3)


_GATE_CASES = [(-8, -8.0), (8, 8.0), (0, "normal"), ("normal", 8.0), ("normal", -8.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("g_raw,dt_bias,dim", [
    pytest.param(*case, D, marks=[_DALOG_CANCELS] if case == ("normal", 8.0) else [], id=f"{case[0]}-{case[1]}-D128")
    for case in _GATE_CASES] + [
    # at 64 the cancelling dA_log sum has half the terms: it may or may not cross 2e-2
    pytest.param(*case, 64, marks=[pytest.mark.xfail(strict=False, reason=_DALOG_CANCELS.kwargs["reason"])]
                 if case == ("normal", 8.0) else [], id=f"{case[0]}-{case[1]}-D64") for case in _GATE_CASES])
def test_gold_gates(g_raw, dt_bias, dim):
    """Gates saturating both ways (no decay, or the lower bound on every token)."""
    _check_gold(_problem(2, 97, 2, g_raw=g_raw, dt_bias=dt_bias, seed=1, dim=dim), f"g={g_raw} bias={dt_bias} D={dim}",
                seed=1)


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="ddt_bias 1.4e-2 > 8e-3 (H200 and CPU mirror alike; the float64 chain over "
                   "K1's rounded workspace keeps 1.1e-2): the forward's bf16 operands set it")
def test_gold_large_a_log():
    problem = list(_problem(1, 200, 2, seed=4))
    problem[5] = torch.tensor([2.5, 3.0], device="cuda")
    _check_gold(tuple(problem), "A_log 2.5, 3", seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_l2norm,beta_logits", [(False, True), (True, False), (False, False)])
def test_gold_flags(qk_l2norm, beta_logits):
    q, k, v, g, beta, A_log, bias = _problem(2, 50, 2, seed=6)
    if not qk_l2norm:  # unnormalised q, k must keep the state bounded: scale them down
        q, k = ((x * 0.1).bfloat16() for x in (q, k))
    if not beta_logits:
        beta = torch.sigmoid(beta.float()).bfloat16()
    _check_gold((q, k, v, g, beta, A_log, bias), f"l2norm={qk_l2norm} logits={beta_logits}", seed=6,
                qk_l2norm=qk_l2norm, beta_logits=beta_logits)


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 1]], ids=["B2xT100", "varlen"])
def test_tracks_the_mirror(lengths, dim):
    """Kernel B vs :func:`mirror_bwd_grads` on the kernels' own workspace, states and du."""
    from cute_kda.reference import mirror_bwd_grads, rel_rms

    B, T = (2, 100) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=12, dim=dim)
    run = _chain(problem, lengths=lengths, seed=12)
    q, k, v, g, beta, A_log, bias = problem
    ref = mirror_bwd_grads(q, k, g, beta, v, run["do"], run["du"], run["ws"], run["states"], run["state_grads"],
                           A_log=A_log, dt_bias=bias, scale=run["scale"], lower_bound=-5.0, cu_seqlens=run["cu"])
    errors = {name: rel_rms(run[name], getattr(ref, name)) for name in ("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias")}
    print("vs mirror: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert all(err <= MIRROR_TOL for err in errors.values()), errors


@pytest.mark.gpu
@ALL_DIMS
def test_deterministic_and_empty_slots_zero(dim):
    lengths = [33, 0, 16, 1, 70]
    problem = _problem(1, sum(lengths), 2, seed=2, dim=dim)
    first, second = (_chain(problem, lengths=lengths, seed=2) for _ in range(2))
    for name in ("dq", "dk", "dg", "dbeta", "ddt_partial", "dalog_partial"):
        assert torch.equal(first[name], second[name]), name
    tiles = sum(-(-n // CHUNK) for n in lengths)
    assert bool((first["ddt_partial"][:, tiles:] == 0).all()) and bool((first["dalog_partial"][:, tiles:] == 0).all())


# the launcher's schedule switches (docs/perf-log.md, B5-B8), alone and together
SWITCHES = {"gate_ahead": ("GATE_AHEAD",), "split_load": ("SPLIT_LOAD",), "both": ("GATE_AHEAD", "SPLIT_LOAD"),
            "split_rows": ("SPLIT_ROWS",), "all": ("GATE_AHEAD", "SPLIT_LOAD", "SPLIT_ROWS"),
            "slopes_ahead": ("SLOPES_AHEAD",), "slopes_split_load": ("SPLIT_LOAD", "SLOPES_AHEAD")}
_OUTPUTS = ("dq", "dk", "dg", "dbeta", "ddt_partial", "dalog_partial")


@pytest.mark.gpu
@pytest.mark.parametrize("switches,dim", [pytest.param(name, D, id=name) for name in SWITCHES]
                         + [pytest.param("both", 64, id="both-D64"),  # no split_rows at 64 (8 warps only)
                            pytest.param("slopes_ahead", 64, id="slopes_ahead-D64")])
@pytest.mark.parametrize("lengths", [None, [33, 0, 16, 1, 70]], ids=["B2xT100", "varlen"])
def test_switches_are_bit_identical(lengths, switches, dim, monkeypatch):
    """``gate_ahead``, ``split_load`` and ``split_rows`` move loads, waits and rows between warps only, and
    ``slopes_ahead`` spells the division ptxas emits: every output of Kernel B equals the plain variant's bit for bit,
    on the same chain (K1 → K2 → Kernel A are deterministic)."""
    B, T = (2, 100) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=5, dim=dim)
    plain = _chain(problem, lengths=lengths, seed=5)
    for switch in SWITCHES[switches]:
        monkeypatch.setattr(kb, switch, True)
    switched = _chain(problem, lengths=lengths, seed=5)
    for name in _OUTPUTS:
        assert torch.equal(plain[name], switched[name]), name


# ============================================================================ GPU: the unbounded gates

# _backward_problem's cases of tests/test_reference_gates.py with a per-head gate, and two more shapes
PER_HEAD_CASES = {
    "softplus_gva_varlen": dict(kind="kimi_init", heads=2, value_heads=4, lengths=[40, 1, 60], seed=0),
    "log_decay_masks_small_dht": dict(kind="masks", heads=1, value_heads=2, lengths=[96], seed=0, dht_scale=0.1),
    "softplus_pm1000_T_under_16": dict(kind="pm1000", heads=2, value_heads=2, lengths=[13], seed=3),
    "softplus_low_decay_varlen_empty": dict(kind="low_decay", heads=1, value_heads=2, lengths=[17, 0, 33, 1, 45],
                                            seed=1),
}
# the per-channel unbounded gates (Kernel B's dyadic variant): _backward_problem's per-channel cases
DYADIC_CASES = {**{name: spec for name, spec in BACKWARD_CASES.items() if not spec.get("per_head")},
                "softplus_pm1000_T_under_16": dict(kind="pm1000", heads=2, value_heads=2, lengths=[13], seed=0)}
# measured over issue 10's targets on the H200, the kernels equal to their mirror there (chain vs mirror 6.5e-5):
# dA_log sums dγ·γ over every token and channel and cancels (the mirror on the CPU, with accurate exp2 / lg2: 7.6e-3;
# docs/numerics.md, "The rounded backward"); held to 1.25× the figure
DYADIC_OVER = {"softplus_low_decay": {"dA_log": 8.52e-3}}
# the per-head gate's dA_log and ddt_bias are one number a value head, each a sum over the head's tokens of dg·x that
# cancels as the safe gate's dA_log does (gradient_targets.SAFE_GATE_TOLERANCES); at D = 64 the H200 measured 1.05e-2
# (softplus_gva_varlen) and 1.84e-2 (softplus_pm1000_T_under_16) with the kernels equal to their mirror (≤ 1.2e-6),
# so the rounding of the algorithm, not the kernel, sets them: held to dg's bound
PER_HEAD_OVER = {"dA_log": 2e-2, "ddt_bias": 2e-2}


# batch slices of guard on each side of the per-head outputs: eight keep the [B, T, HV] views 16-byte aligned (the
# launchers' contract) whatever T·HV is
GUARD = 8


def _unbounded_chain(case: str, per_head: bool = True, dim: int = D) -> tuple[dict, dict, tuple, dict]:
    """The kernels' chain for an unbounded gate — K1 (the per-head or the dyadic scheme), K2 with per-tile
    checkpoints, Kernel A, Kernel B — on one of :data:`PER_HEAD_CASES` (``per_head``) or :data:`DYADIC_CASES`; dq,
    dk summed over each group of value heads (with groups of two, Kernel B's ``group_sum`` checked against that sum
    bit for bit). Returns (the gradients by the mirror's names, Kernel B's raw outputs,
    the inputs, the options)."""
    from test_reference_gates import _backward_problem

    from cute_kda.ops import bwd_scan as ka
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.workspace import allocate_workspace, tiles_per_head

    spec = (PER_HEAD_CASES if per_head else DYADIC_CASES)[case]
    tensors, options = _backward_problem(spec["kind"], **{n: x for n, x in spec.items() if n != "kind"},
                                         per_head=per_head, dim=dim)
    device = torch.device("cuda")
    q, k, v, g, beta, do = (t.to(device) for t in tensors)
    options = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in options.items()}
    gate, A_log, dt_bias = options["gate"], options["A_log"], options["dt_bias"]
    cu, h0, dht = options["cu_seqlens"], options["initial_state"], options["dht"]
    B, T, H, _ = q.shape
    HV = v.shape[2]
    N = B if cu is None else cu.numel() - 1
    scale = dim ** -0.5
    ws = allocate_workspace(WorkspaceSpec(heads=HV, tiles=tiles_per_head(B * T, N, cu is not None), dim=dim), device)
    tile_base = k1.tile_bases(cu) if cu is not None else None
    k1.prepare(q, k, g, beta, A_log, dt_bias, ws, scale=scale, lower_bound=-5.0, cu_seqlens=cu, tile_base=tile_base,
               gate=gate)
    states = torch.full(block_states_shape(ws, HV, N), math.nan, dtype=torch.bfloat16, device=device)
    k2.recurrence(v, ws, torch.empty_like(v), cu_seqlens=cu, tile_base=tile_base, initial_state=h0, final_state=None,
                  checkpoints=states)
    dv, du = torch.empty_like(do), torch.empty_like(do)
    state_grads = torch.full_like(states, math.nan)
    dh0 = torch.empty(N, HV, dim, dim, device=device)
    ka.bwd_scan(do, ws, dv, du, state_grads, cu_seqlens=cu, tile_base=tile_base, dht=dht, dh0=dh0)
    raw = {}
    for name in ("dq", "dk"):
        raw[name], raw[name + "_buf"] = _guarded((B, T, HV, dim), torch.bfloat16, device, axis=0, pad=GUARD)
    if per_head:  # fp32 per (token, head); per channel bf16 like g
        raw["dg"], raw["dg_buf"] = _guarded((B, T, HV), torch.float32, device, axis=0, pad=GUARD)
    else:
        raw["dg"], raw["dg_buf"] = _guarded((B, T, HV, dim), torch.bfloat16, device, axis=0, pad=GUARD)
    raw["dbeta"], raw["dbeta_buf"] = _guarded((B, T, HV), torch.bfloat16, device, axis=0, pad=GUARD)
    ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, HV, per_head_gate=per_head)
    constants = gate != "none"
    ddt = torch.full(ddt_shape, math.nan, device=device) if constants else None
    dalog = torch.full(dalog_shape, math.nan, device=device) if constants else None
    kb.bwd_grads(q, k, g, v, do, du, ws, states, state_grads, A_log, dt_bias, raw["dq"], raw["dk"], raw["dg"],
                 raw["dbeta"], ddt, dalog, scale=scale, lower_bound=-5.0, cu_seqlens=cu, tile_base=tile_base, gate=gate)
    torch.cuda.synchronize()
    for name in ("dq", "dk", "dg", "dbeta"):
        _assert_guards_untouched(raw.pop(name + "_buf"), axis=0, pad=GUARD)
        assert not raw[name].isnan().any(), f"a {name} row was not written"
    if constants:
        assert not ddt.isnan().any() and not dalog.isnan().any(), "a partial-sum slot was not written"
    grads = {"dq": stages.group_sum(raw["dq"], H), "dk": stages.group_sum(raw["dk"], H), "dv": dv, "dg": raw["dg"], "dbeta": raw["dbeta"],
             "dh0": dh0, "dA_log": None if dalog is None else dalog.sum(1),
             "ddt_bias": None if ddt is None else ddt.sum(1)}
    if HV == 2 * H:  # value heads in pairs: Kernel B adding each pair itself (group_sum) gives the group sums' bits
        summed = {}
        for name in ("dq", "dk"):
            summed[name], summed[name + "_buf"] = _guarded((B, T, H, dim), torch.bfloat16, device, axis=0, pad=GUARD)
            summed[name].zero_()
        kb.bwd_grads(q, k, g, v, do, du, ws, states, state_grads, A_log, dt_bias, summed["dq"], summed["dk"],
                     torch.empty_like(raw["dg"]), torch.empty_like(raw["dbeta"]),
                     None if ddt is None else torch.empty_like(ddt), None if dalog is None else torch.empty_like(dalog),
                     scale=scale, lower_bound=-5.0, cu_seqlens=cu, tile_base=tile_base, gate=gate)
        torch.cuda.synchronize()
        for name in ("dq", "dk"):
            _assert_guards_untouched(summed.pop(name + "_buf"), axis=0, pad=GUARD)
            assert torch.equal(summed[name], grads[name]), f"group_sum's {name} is not the group sum's"
    raw.update(ddt_partial=ddt, dalog_partial=dalog, ws=ws, states=images_to_states(states),
               state_grads=images_to_states(state_grads), du=du)  # [K, V] matrices for the mirror
    return grads, raw, (q, k, v, g, beta, do), options


def _check_unbounded_chain(case: str, per_head: bool, dim: int = D) -> None:
    """Kernel B with an unbounded gate: alone against its mirror ``mirror_bwd_grads_gates`` on the chain's own
    workspace, states and du; the kernels' whole chain against ``mirror_backward`` and against autograd
    through the fp64 gold; masked entries (−1000) get dg = 0."""
    from cute_kda.reference import gold_backward, mirror_backward, mirror_bwd_grads_gates, rel_rms

    grads, raw, tensors, options = _unbounded_chain(case, per_head, dim)
    q, k, v, g, beta, do = tensors
    scale = dim ** -0.5
    stage = mirror_bwd_grads_gates(q, k, g, beta, v, do, raw["du"], raw["ws"], raw["states"], raw["state_grads"],
                                   gate=options["gate"], A_log=options["A_log"], dt_bias=options["dt_bias"],
                                   scale=scale, cu_seqlens=options["cu_seqlens"])
    alone = {n: rel_rms(grads[n].float(), stage[n].float()) for n in ("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias")
             if stage[n] is not None}
    print(f"{case}: Kernel B vs its mirror " + ", ".join(f"{n} {e:.2e}" for n, e in alone.items()))
    assert all(e <= MIRROR_TOL for e in alone.values()), alone
    mirror = mirror_backward(*tensors, scale=scale, **options)
    gold = gold_backward(*tensors, scale=scale, **options)
    names = [n for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias") if grads[n] is not None]
    vs_mirror = {n: rel_rms(grads[n].float(), mirror[n].float()) for n in names}
    vs_gold = {n: rel_rms(grads[n].float(), gold[n].float()) for n in names}
    print(f"{case}: vs mirror " + ", ".join(f"{n} {e:.2e}" for n, e in vs_mirror.items())
          + "; vs gold " + ", ".join(f"{n} {e:.2e}" for n, e in vs_gold.items()))
    over = PER_HEAD_OVER if per_head else {n: 1.25 * figure for n, figure in DYADIC_OVER.get(case, {}).items()}
    targets = {**TARGETS, **over}
    # the mirror runs its own forward (INV, Mqk within one bf16 ULP of K1's), so the bound is the chain's, not
    # Kernel B's alone; a structural error shows as O(1)
    assert all(e <= CHAIN_MIRROR_TOL for n, e in vs_mirror.items() if n not in ("dA_log", "ddt_bias")), vs_mirror
    assert all(e <= targets[n] for n, e in vs_gold.items()), vs_gold
    masked = g == -1000.0
    if masked.any():
        assert torch.equal(grads["dg"][masked].float(), torch.zeros(int(masked.sum()), device=g.device))


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("case", sorted(PER_HEAD_CASES))
def test_per_head_gate_tracks_the_mirror_and_the_gold(case, dim):
    _check_unbounded_chain(case, per_head=True, dim=dim)


@pytest.mark.gpu
@ALL_DIMS
@pytest.mark.parametrize("case", sorted(DYADIC_CASES))
def test_per_channel_unbounded_gate_tracks_the_mirror_and_the_gold(case, dim):
    _check_unbounded_chain(case, per_head=False, dim=dim)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head, case", [(True, "softplus_gva_varlen"),
                                            (False, "softplus_gva_varlen_empty_1_token")], ids=["per_head", "dyadic"])
def test_unbounded_gate_is_deterministic(per_head, case):
    first = _unbounded_chain(case, per_head)
    second = _unbounded_chain(case, per_head)
    for name in ("dq", "dk", "dg", "dbeta", "ddt_partial", "dalog_partial"):
        assert torch.equal(first[1][name], second[1][name]), name


@pytest.mark.parametrize("change, words", [
    (dict(g=torch.zeros(1, 40, 2, D, dtype=torch.bfloat16)), "g must be"),  # a per-channel g with a per-head gate
    (dict(dg=torch.zeros(1, 40, 2, dtype=torch.bfloat16)), "dg must be float32"),  # dg is fp32 per (token, head)
    (dict(dq=torch.zeros(1, 40, 3, D, dtype=torch.bfloat16)), "dq must be"),  # per value head, or q/k head (pairs)
    (dict(ddt_partial=torch.zeros(2, 3, D)), "ddt_partial must be"),  # per head, not per channel
    (dict(gate="none"), "pass ddt_partial=dalog_partial=None"),  # a log decay has no partial sums
    (dict(gate="safe"), "grouped value heads need an unbounded gate"),
])
def test_per_head_launcher_rejects_mismatched_buffers(change, words):
    kwargs = {**_per_head_buffers(), **change}
    with pytest.raises(ValueError, match=words):
        kb.bwd_grads(**kwargs)


def test_the_step_sums_pairs_of_value_heads_in_the_kernel(monkeypatch):
    """``sums_pairs``: dq, dk per q/k head for Kernel B to add into exactly where value heads come in pairs with bf16
    gradients and :data:`~cute_kda.ops.bwd_grads.GROUP_SUM` is on."""
    bf16 = torch.bfloat16
    assert kb.sums_pairs(8, 16, bf16)
    assert not kb.sums_pairs(8, 8, bf16) and not kb.sums_pairs(8, 32, bf16) and not kb.sums_pairs(8, 16, torch.float16)
    monkeypatch.setattr(kb, "GROUP_SUM", False)
    assert not kb.sums_pairs(8, 16, bf16)


def test_per_head_launcher_keys_the_variant(monkeypatch):
    seen = []
    monkeypatch.setattr(kb, "compiled_variant", lambda variant, index, tensors, options: seen.append(
        (variant, index)) or (lambda *args: seen.append(args)))
    monkeypatch.setattr(kb, "current_stream", lambda device: "stream")
    monkeypatch.setattr(kb, "device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    kb.bwd_grads(**_per_head_buffers("none"))
    key, args = seen
    assert key == (GradsVariant(False, True, True, "none", torch.bfloat16, True, True, plan.DEFAULT_WARPS), 0)
    inputs, outputs = args[0], args[3]
    assert inputs.a_log is None and inputs.dt_bias is None and outputs.ddt_partial is None
    assert tuple(inputs.g.shape) == (40, 2) and tuple(outputs.dq.shape) == (40, 2, D)
    seen.clear()
    kb.bwd_grads(**_dyadic_buffers("softplus", grouped=True, g_dtype=torch.bfloat16))
    key, args = seen
    assert key == (GradsVariant(False, True, True, "softplus", torch.bfloat16, False, True, plan.DEFAULT_WARPS,
                                **kb.switches("softplus", False, plan.DEFAULT_WARPS)), 0)
    inputs, outputs = args[0], args[3]
    assert tuple(inputs.g.shape) == (40, 2, D) and tuple(outputs.dg.shape) == (40, 2, D)
    assert tuple(inputs.dt_bias.shape) == (2, D) and tuple(outputs.ddt_partial.shape[1:]) == (D,)
    seen.clear()
    pairs = _per_head_buffers("softplus")  # two value heads on one q/k head, dq and dk per q/k head
    kb.bwd_grads(**{**pairs, "dq": torch.zeros_like(pairs["q"]), "dk": torch.zeros_like(pairs["k"])})
    key, args = seen
    assert key[0].group_sum and key[0].grouped and tuple(args[3].dq.shape) == tuple(args[3].dk.shape) == (40, 1, D)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head, case, switches", [
    (False, "softplus_pm1000_T_under_16", "both"), (False, "softplus_gva_varlen_empty_1_token", "both"),
    (False, "log_decay_masks", "split_load"), (True, "softplus_gva_varlen", "split_load"),
    (True, "log_decay_masks_small_dht", "split_load")], ids=lambda x: str(x))
def test_unbounded_switches_are_bit_identical(per_head, case, switches, monkeypatch):
    """The unbounded gates' Kernel B under the switches that apply to it (a per-head gate or a log decay reads no
    gate row by row: ``split_load`` only): the plain variant's bits, as the safe gate's."""
    _, plain, _, _ = _unbounded_chain(case, per_head)
    for switch in SWITCHES[switches]:
        monkeypatch.setattr(kb, switch, True)
    _, switched, _, _ = _unbounded_chain(case, per_head)
    for name in _OUTPUTS:
        if plain[name] is not None:
            assert torch.equal(plain[name], switched[name]), name
