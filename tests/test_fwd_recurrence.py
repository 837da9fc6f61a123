"""K2, the forward chunk recurrence: host model of its layouts and fragments, sm_90a compile checks
(CPU), results against the mirror and the fp64 gold (GPU tier).

CPU compile coverage (2 cores): every (initial state, final state) pair in {none, bf16, fp32}² is
compiled twice, at two different (vsplit, varlen) points, so every value of every axis is compiled
several times (18 of the 54 variants; ~2 s each).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from ptx_checks import assert_band_image_copies
from ulp_check import assert_within_one_ulp, bf16_ulps

from cute_kda.dsl import cute, cutlass
from cute_kda.kernels.common.copy import c_row_half
from cute_kda.kernels.fwd_recurrence import FwdRecurrence
from cute_kda.layouts.fwd_recurrence import MMA_WARPS
from cute_kda.layouts import fwd_recurrence as layouts
from cute_kda.layouts import budget, smem
from cute_kda.layouts.analysis import run_traced
from cute_kda.layouts.fwd_recurrence import RecurrenceSmemPlan
from cute_kda.ops import recurrence as k2
from cute_kda.ops._cache import dsl_type, to_cute_tensor

D = 128
CHUNK = 16
VSPLITS = (1, 2, 4)
DIMS = (D, 64)  # the head dims K2 compiles for (cute_kda.numerics.NATIVE_HEAD_DIMS)
STATE = {"none": None, "bf16": torch.bfloat16, "fp32": torch.float32}
TOL = 6e-3  # rel-RMS vs the fp64 gold (the bound)
MIRROR_TOL = 2e-3  # rel-RMS vs the mirror over many tiles (1-ULP differences drifting through the bf16 state)


# ============================================================================ shared-memory plan


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("vsplit", VSPLITS)
def test_plan_bytes(vsplit, dim):
    plan = RecurrenceSmemPlan(vsplit=vsplit, dim=dim)
    band = dim // vsplit
    warps = min(MMA_WARPS, band // 8)  # at least 8 columns a warp (D = 64, V-split 4: two warps of 8)
    assert plan.v_band == band and plan.mma_warps == warps and plan.warp_cols == band // warps
    assert plan.stage_tx_bytes == CHUNK * band * 2 + 3 * CHUNK * dim * 2 + dim * 4 + 2 * CHUNK * CHUNK * 2 + CHUNK * 4
    offsets = plan.union_offsets()
    assert all(offset % 128 == 0 for offset in offsets.values())
    assert list(offsets) == ["v", "kd", "qd", "kr", "gt", "inv", "mqk", "beta", "out"]
    assert offsets["kd"] == -(-CHUNK * band * 2 * plan.input_stages // layouts.SWIZZLED_ALIGN) * layouts.SWIZZLED_ALIGN
    # the band tiles' swizzle period: 1024 B (K_SW128, rows of 128 bytes or more), 512 B (K_SW64), 256 B (K_SW32)
    out_align = plan.field_align("out")
    assert out_align == {128: 1024, 64: 512, 32: 256}[min(2 * band, 128)] == plan.field_align("v")
    # β's 64 bytes take a 128-byte slot; the output stages start on their swizzle period
    assert offsets["out"] == -(-(offsets["beta"] + 128 * plan.input_stages) // out_align) * out_align
    assert all(offsets[name] % layouts.SWIZZLED_ALIGN == 0 for name in layouts.SWIZZLED_FIELDS)
    align = layouts.SWIZZLED_ALIGN  # the union holds K_SW128 tiles: its size is a multiple of their period
    assert plan.union_bytes == -(-plan.pipeline_bytes // align) * align
    fp32 = RecurrenceSmemPlan(vsplit=vsplit, state_io_fp32=True, dim=dim)
    assert fp32.union_bytes == -(-max(plan.pipeline_bytes, band * dim * 4) // align) * align
    # two CTAs per SM (228 KiB, 1 KiB reserved per CTA) in every variant
    assert 2 * (fp32.total_bytes + 1024) <= 228 * 1024


def test_plan_rejects_unsupported_vsplit():
    with pytest.raises(ValueError):
        RecurrenceSmemPlan(vsplit=8)
    with pytest.raises(ValueError):
        FwdRecurrence(vsplit=3)


# ============================================================================ layout algebra (host)


def _offsets(build, shape):
    """``{coordinate: offset}`` of the layout ``build()`` over ``shape``.

    A CuTe layout (without swizzle, or with the identity swizzle of K_INTER / MN_INTER) is a sum of
    one function per mode, so one trace evaluates each mode alone and numpy adds them up.
    """

    def run():
        layout = build()
        origin = [0] * len(shape)
        per_mode = []
        for mode, extent in enumerate(shape):
            values = []
            for i in range(extent):
                coord = list(origin)
                coord[mode] = i
                values.append(layout(tuple(coord)))
            per_mode.append(values)
        return layout(tuple(origin)), per_mode

    base, per_mode = run_traced(run)
    total = np.zeros(shape, dtype=np.int64) - (len(shape) - 1) * base
    for mode, values in enumerate(per_mode):
        view = [1] * len(shape)
        view[mode] = len(values)
        total = total + np.asarray(values, dtype=np.int64).reshape(view)
    return {c: int(total[c]) for c in np.ndindex(*shape)}


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("vsplit", VSPLITS)
def test_state_views_are_transpose_dual(vsplit, dim):
    plan = RecurrenceSmemPlan(vsplit=vsplit, dim=dim)
    b = _offsets(lambda: layouts.state_b(plan), (plan.v_band, dim))
    acc = _offsets(lambda: layouts.state_acc(plan), (dim, plan.v_band))
    assert all(b[(v, k)] == acc[(k, v)] for v, k in b)
    assert sorted(b.values()) == list(range(plan.v_band * dim))
    fp32 = _offsets(lambda: layouts.state_fp32(plan), (plan.v_band, dim))
    assert fp32 == b  # same element offsets: [v, k] of staging and state correspond


@pytest.mark.parametrize("dim", DIMS)
def test_staged_operands(dim):
    plan = RecurrenceSmemPlan(dim=dim)
    stages = plan.input_stages
    # kd / qd / kr: staged K_SW128 tiles and their MN_SW128 view; the swizzle (on byte addresses) is the
    # 128-byte one of K1's tiles (a 64-column bf16 row is one 128-byte swizzle row), and the element offsets
    # before it agree view by view, stage by stage
    kr = _offsets(lambda: layouts.chunk_operand(plan).outer, (CHUNK, dim, stages))
    kr_t = _offsets(lambda: layouts.chunk_operand_transposed(plan).outer, (dim, CHUNK, stages))
    tile = _offsets(lambda: smem.sw128_tile(CHUNK, dim).outer, (CHUNK, dim))
    box = _offsets(lambda: layouts.chunk_operand(plan, stages=0).outer, (CHUNK, dim))
    assert box == tile
    assert all(kr[(r, c, s)] == kr_t[(c, r, s)] == tile[(r, c)] + s * CHUNK * dim for r, c, s in kr)
    swizzles = run_traced(lambda: [str(build().inner) for build in (
        lambda: layouts.chunk_operand(plan), lambda: layouts.chunk_operand_transposed(plan),
        lambda: smem.sw128_tile(CHUNK, dim))])
    assert len(set(swizzles)) == 1 and swizzles[0] == "S<3,4,3>"
    assert all(plan.union_offsets()[name] % layouts.SWIZZLED_ALIGN == 0 for name in layouts.SWIZZLED_FIELDS)
    square = _offsets(lambda: layouts.square_tile(plan), (CHUNK, CHUNK, stages))
    square_tile = _offsets(lambda: smem.square_tile(), (CHUNK, CHUNK))
    assert all(square[(i, j, s)] == square_tile[(i, j)] + s * CHUNK * CHUNK for i, j, s in square)
    beta = _offsets(lambda: layouts.vector(CHUNK, stages), (CHUNK, stages))
    assert all(beta[(i, s)] == i + 32 * s for i, s in beta)  # 128-byte stage slots


@pytest.mark.parametrize("rows,cols", [(CHUNK, D), (CHUNK, 32), (CHUNK, CHUNK), (D, D), (32, D)])
def test_tma_box_is_operand_tile_address_order(rows, cols):
    box = _offsets(lambda: layouts.tma_box(rows, cols), (layouts.IMAGE_RUN, rows, cols // layouts.IMAGE_RUN))
    tile = _offsets(lambda: smem.operand_tile(rows, cols), (rows, cols))
    assert all(box[(i, r, c)] == tile[(r, layouts.IMAGE_RUN * c + i)] for i, r, c in box)
    staged = _offsets(lambda: layouts.tma_box(rows, cols, 2), (layouts.IMAGE_RUN, rows, cols // layouts.IMAGE_RUN, 2))
    assert all(staged[(i, r, c, s)] == box[(i, r, c)] + s * rows * cols for i, r, c, s in staged)


def _gmem(shape, dtype=cutlass.BFloat16):
    """A row-major gmem tensor of ``shape`` at address 0 (for evaluating views on the host)."""
    strides = [1]
    for n in reversed(shape[1:]):
        strides.insert(0, strides[0] * n)
    return cute.make_tensor(cute.make_ptr(dtype, 0, cute.AddressSpace.gmem), cute.make_layout(shape, stride=tuple(strides)))


def test_gmem_views_reach_the_right_elements():
    B, T, H, N, rows = 2, 40, 3, 2, 5

    def run():
        tokens = layouts.token_band_view(_gmem((B, T, H, D)), 64).layout
        tiles = layouts.tile_rows_view(_gmem((rows, CHUNK, D)), 64).layout
        squares = layouts.tile_runs_view(_gmem((rows, CHUNK, CHUNK))).layout
        vectors = layouts.vector_rows_view(_gmem((rows, D), cutlass.Float32)).layout
        states = layouts.state_runs_view(_gmem((N, H, D, D))).layout
        return (
            {(b, t, h, c): tokens((t, (c % 64, c // 64), h, b)) for b in range(B) for t in (0, 17, 39)
             for h in range(H) for c in (0, 7, 8, 127)},
            {(r, i, c): tiles((r * CHUNK + i, (c % 64, c // 64))) for r in range(rows) for i in (0, 15) for c in (0, 9, 127)},
            {(r, i, c): squares((c % 8, i, c // 8, r)) for r in range(rows) for i in (0, 15) for c in (0, 9, 15)},
            {(r, c): vectors((c, r)) for r in range(rows) for c in (0, 127)},
            {(n, h, v, k): states((k % 8, v, k // 8, n, h)) for n in range(N) for h in range(H)
             for v in (0, 63, 127) for k in (0, 8, 127)},
        )

    tokens, tiles, squares, vectors, states = run_traced(run)
    assert all(off == ((b * T + t) * H + h) * D + c for (b, t, h, c), off in tokens.items())
    assert all(off == (r * CHUNK + i) * D + c for (r, i, c), off in tiles.items())
    assert all(off == (r * CHUNK + i) * CHUNK + c for (r, i, c), off in squares.items())
    assert all(off == r * D + c for (r, c), off in vectors.items())
    assert all(off == ((n * H + h) * D + v) * D + k for (n, h, v, k), off in states.items())


# ============================================================================ fragments (host model)
#
# Lane l, g = l // 4, q = l % 4. mma.sync.m16n8k16 (PTX ISA): A (m, k) value i holds
# (g + 8·((i//2)%2), 2q + i%2 + 8·(i//4)); B (n, k) of n-atom j: (8j + g, 2q + i%2 + 8·((i//2)%2));
# C (m, n) of n-atom j: (g + 8·((i//2)%2), 8j + 2q + i%2).


def _kernel(vsplit: int) -> FwdRecurrence:
    return FwdRecurrence(vsplit=vsplit)


def _fragment_coords(vsplit: int, operand: str, shape):
    """lane → [coordinate of fragment value i] for the K2 warp MMA (from the DSL's partitions)."""
    kernel = _kernel(vsplit)

    def run():
        mma = kernel.warp_mma()
        out = {}
        for lane in range(32):
            thr = mma.get_slice(lane)
            part = {"A": thr.partition_A, "B": thr.partition_B, "C": thr.partition_C}[operand]
            coords = part(cute.make_identity_tensor(shape))
            out[lane] = [tuple(coords[i]) for i in range(cute.size(coords))]
        return out

    return run_traced(run)


@pytest.mark.parametrize("vsplit", VSPLITS)
def test_fragment_orders_match_the_ptx_layouts(vsplit):
    cols = D // vsplit // MMA_WARPS
    c_frag = _fragment_coords(vsplit, "C", (CHUNK, cols))
    b_frag = _fragment_coords(vsplit, "B", (cols, CHUNK))
    a_frag = _fragment_coords(vsplit, "A", (CHUNK, CHUNK))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        assert c_frag[lane] == [(g + 8 * c_row_half(i), 8 * (i // 4) + 2 * q + i % 2) for i in range(cols // 2)]
        assert b_frag[lane] == [(8 * (i // 4) + g, 2 * q + i % 2 + 8 * ((i // 2) % 2)) for i in range(cols // 2)]
        assert a_frag[lane] == [(g + 8 * ((i // 2) % 2), 2 * q + i % 2 + 8 * (i // 4)) for i in range(8)]


def _movmatrix(words):
    """``movmatrix.m8n8.trans.b16`` on every 32-bit word of ``words[lane][word] = (lo, hi)`` (PTX ISA)."""
    out = {}
    for lane in range(32):
        out[lane] = []
        for p in range(len(words[0])):
            # lane l receives row l // 4 of the transpose: elements (2q, 2q+1) of column l // 4
            pair = []
            for e in range(2):
                row, col = 2 * (lane % 4) + e, lane // 4
                pair.append(words[4 * row + col // 2][p][col % 2])
            out[lane].append(tuple(pair))
    return out


@pytest.mark.parametrize("vsplit", VSPLITS)
def test_movmatrix_turns_the_c_fragment_into_the_b_fragment_of_the_transpose(vsplit):
    """Phases 3-4: u / U (C fragment, rows = tokens) word by word → B fragment of the next mma."""
    cols = D // vsplit // MMA_WARPS
    c_frag = _fragment_coords(vsplit, "C", (CHUNK, cols))
    b_frag = _fragment_coords(vsplit, "B", (cols, CHUNK))
    words = {lane: [(c_frag[lane][2 * p], c_frag[lane][2 * p + 1]) for p in range(cols // 4)] for lane in range(32)}
    moved = _movmatrix(words)
    for lane in range(32):
        got = [coord for pair in moved[lane] for coord in pair]  # M coordinates now held, in B order
        want = [(k, n) for n, k in b_frag[lane]]  # B[n, k] = M[k, n]
        assert got == want


def _copy_model(vsplit: int, name: str, view_shape, operand: str, transpose: bool, store: bool):
    """For every lane and fragment slot: the view coordinate an ldmatrix/stmatrix of ``name`` moves.

    The smem side comes from the tiled copy's partition of an identity tensor (lane ``8j + r`` gives
    the address of row ``r`` of matrix ``j``), the register side from its ``retile`` of the
    fragment; what moves between them is the PTX ISA rule (lane ``l`` holds elements ``2q, 2q+1`` of
    row ``g`` of each matrix, or of its transpose with ``.trans``). Also checks that each row is 8
    consecutive elements of ``view_shape``'s first (``transpose``) or second mode.
    """
    kernel = _kernel(vsplit)
    matrices = 4 if name in ("ldsm_a", "ldsm_a_t") else kernel.band_matrices

    def run():
        mma = kernel.warp_mma()
        tiled = getattr(kernel.warp_copies(mma), name)
        shape = {"A": mma.partition_shape_A, "B": mma.partition_shape_B, "C": mma.partition_shape_C}[operand](view_shape)
        ident = cute.make_identity_tensor(view_shape)
        rows, slots = {}, {}
        for lane in range(32):
            thr = tiled.get_slice(lane)
            part = thr.partition_D(ident) if store else thr.partition_S(ident)
            retiled = thr.retile(cute.make_rmem_tensor(shape, cutlass.BFloat16))
            # every copy value; of the repeated (rest) modes only the first and the last index
            rest = [sorted({0, cute.size(part, mode=[m]) - 1}) for m in range(1, cute.rank(part))]
            rows[lane] = {(c, *r): tuple(part[(c, *r)]) for c in range(cute.size(part, mode=[0]))
                          for r in itertools.product(*rest)}
            slots[lane] = {(c, *r): retiled.layout((c, *r)) for c in range(cute.size(retiled, mode=[0]))
                           for r in itertools.product(*rest)}
        return rows, slots

    rows, slots = run_traced(run)
    values = 2 * matrices
    moved = {lane: {} for lane in range(32)}  # lane → fragment slot → view coordinate
    for (cpy, *rest) in slots[0]:
        a, v = divmod(cpy, values)
        j, e = divmod(v, 2)
        for lane in range(32):
            g, q = lane // 4, lane % 4
            row, elem = (2 * q + e, g) if transpose else (g, 2 * q + e)
            coord = rows[8 * j + row][(8 * a + elem, *rest)]
            moved[lane][slots[lane][(cpy, *rest)]] = coord
    # each address row: 8 consecutive coordinates along the contiguous mode of the view
    for lane in range(8 * matrices):
        for (cpy, *rest), coord in rows[lane].items():
            i = cpy % 8
            base = rows[lane][(cpy - i, *rest)]
            step = (i, 0) if transpose else (0, i)
            assert coord == (base[0] + step[0], base[1] + step[1])
    return moved


# (copy, view shape given warp columns c, operand, .trans, stmatrix): the band-scan kernels' seven copies
# (ldsm_b_t is the backward scan's dOᵀ; the others are K2's)
_COPIES = {
    "ldsm_a": (lambda c: (CHUNK, D), "A", False, False),  # kd / qd [16, D] (INV, Mqk: first block)
    "ldsm_a_t": (lambda c: (D, CHUNK), "A", True, False),  # krᵀ: MN_INTER view [D, 16]
    "ldsm_b": (lambda c: (c, D), "B", False, False),  # S band [cols, K]
    "ldsm_b_t": (lambda c: (c, CHUNK), "B", True, False),  # dOᵀ [cols, 16] (MN_INTER view of a token tile)
    "ldsm_c": (lambda c: (CHUNK, c), "C", False, False),  # v [16, cols]
    "stsm_c": (lambda c: (CHUNK, c), "C", False, True),  # out [16, cols]
    "stsm_c_t": (lambda c: (D, c), "C", True, True),  # S band [K, cols] (MN_INTER)
}


@pytest.mark.parametrize("vsplit", VSPLITS)
@pytest.mark.parametrize("name", list(_COPIES))
def test_copies_move_the_fragment_elements(vsplit, name):
    cols = D // vsplit // MMA_WARPS
    shape_of, operand, transpose, store = _COPIES[name]
    shape = shape_of(cols)
    moved = _copy_model(vsplit, name, shape, operand, transpose, store)
    expected = _fragment_coords(vsplit, operand, shape)
    for lane in range(32):
        assert moved[lane], name
        assert all(moved[lane][slot] == expected[lane][slot] for slot in moved[lane]), (name, lane)


# ============================================================================ compile (CPU)


def _variants():
    """(vsplit, state in, state out, varlen, D): every variant K2 can be compiled as at D = 128 (3 × 3 × 3 × 2 = 54);
    at D = 64 every state pair at two (vsplit, varlen) points, each point three times (18)."""
    full = [(*variant, D) for variant in itertools.product(VSPLITS, STATE, STATE, (False, True))]
    points = list(itertools.product(VSPLITS, (False, True)))
    pairs = list(itertools.product(STATE, STATE))
    halves = [(*points[(2 * i + j) % len(points)], pair) for i, pair in enumerate(pairs) for j in range(2)]
    return full + [(vsplit, *pair, varlen, 64) for vsplit, varlen, pair in halves]


def _variant_id(variant) -> str:
    vsplit, state_in, state_out, varlen, dim = variant
    return f"vs{vsplit}-{state_in}-{state_out}-{'varlen' if varlen else 'fixed'}" + ("" if dim == D else f"-D{dim}")


def _compile_args(vsplit, state_in, state_out, varlen, dim=D, checkpoints=False, token_outputs=True):
    """The launcher's own argument conversion on small CPU tensors (shapes are dynamic)."""
    from cute_kda.workspace import WorkspaceSpec, block_states_shape, workspace_views

    heads, num_seqs = 2, 3
    batch, steps = (1, 80) if varlen else (num_seqs, 24)
    v = torch.zeros(batch, steps, heads, dim, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=8, dim=dim)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    cu = torch.tensor([0, 20, 20, 80]) if varlen else None

    def state(name):
        return None if STATE[name] is None else torch.zeros(num_seqs, heads, dim, dim, dtype=STATE[name])

    return k2.launch_arguments(
        v, ws, torch.zeros_like(v) if token_outputs else None, cu_seqlens=cu,
        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None,
        initial_state=state(state_in), final_state=state(state_out),
        checkpoints=torch.zeros(block_states_shape(ws, heads, num_seqs), dtype=torch.bfloat16) if checkpoints else None,
        tensor=to_cute_tensor,
    )


_COMPILED: dict = {}


def _compiled(variant, checkpoints=False, token_outputs=True):
    key = (variant, checkpoints, token_outputs)
    if key not in _COMPILED:
        from cute_kda.compile_report import compile_with_report

        vsplit, state_in, state_out, varlen, dim = variant
        kernel = FwdRecurrence(
            vsplit=vsplit, initial_state=dsl_type(STATE[state_in]), final_state=dsl_type(STATE[state_out]),
            varlen=varlen, checkpoints=checkpoints, dim=dim, token_outputs=token_outputs,
        )
        args = _compile_args(*variant, checkpoints, token_outputs)
        _, report = compile_with_report(kernel, *args, cute.runtime.make_fake_stream())
        _COMPILED[key] = (kernel, report)
    return _COMPILED[key]


@pytest.mark.parametrize("variant", _variants(), ids=_variant_id)
def test_variant_compiles(variant):
    vsplit, state_in, state_out, varlen, dim = variant
    kernel, report = _compiled(variant)
    atoms = kernel.warp_cols // 8  # n=8 mma atoms per warp row of 16
    k_steps = dim // CHUNK
    # TMA: 8 loads per stage (v, kd, qd, kr, gT, INV, Mqk, β), one tile store, one per state transfer
    tma = {dims: report.count(f"cp.async.bulk.tensor.{dims}d.shared::cta.global") for dims in (2, 3, 4, 5)}
    assert tma == {2: 2, 3: 3, 4: 2, 5: 1 + (state_in != "none")}  # gT, β | kd, qd, kr (K_SW128) | INV, Mqk | v, state
    assert report.count("cp.async.bulk.tensor.5d.global.shared::cta") == 1 + (state_out != "none")  # out, state
    assert report.has("mbarrier.try_wait") and report.has("mbarrier.arrive.expect_tx")
    # per tile: Phase 1 (kd·S, qd·S), INV·u, Mqk·U, krᵀ·U over 8 row blocks
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == (2 * k_steps + 2 + k_steps) * atoms
    assert report.count("movmatrix.sync.aligned.m8n8.trans.b16") == 2 * 2 * atoms  # u, U: 2 words per atom
    # the state is fp32 in registers: per tile every element is decayed by one mul.rn (then the C of the
    # update mma) and rounded to bf16 for the state buffer, two columns per cvt (as are u, U and o; an
    # fp32 initial state's staging goes to the buffer 8 elements per step of every thread)
    assert report.count("mul.rn.f32") == k_steps * 4 * atoms and report.count("fma.rn.f32") == 0
    words = k_steps * 2 * atoms  # 32-bit words of the warp's [K, cols] state fragment per lane
    assert report.count("cvt.rn.bf16x2.f32") == 3 * 2 * atoms + words + (state_in == "fp32") * 4
    x = kernel.band_matrices
    per_tile = atoms // 2 if x == 4 else 1  # band ldmatrix/stmatrix instructions per 16-row (or 16-k) slice
    band_x4 = x == 4
    assert report.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 2 * k_steps + 2 + band_x4 * (k_steps + 1) * per_tile
    assert report.count("ldmatrix.sync.aligned.m8n8.x2.shared.b16") == (not band_x4) * (k_steps + 1) * per_tile
    assert report.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == k_steps  # krᵀ; no state read back
    assert report.count("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16") == 0
    assert report.count(f"stmatrix.sync.aligned.m8n8.x{x}.shared.b16") == per_tile
    assert report.count(f"stmatrix.sync.aligned.m8n8.x{x}.trans.shared.b16") == k_steps * per_tile
    assert report.has("fence.proxy.async.shared::cta") and report.has("bar.warp.sync")
    # the TMA stores are issued by one elected lane
    lines = report.ptx.splitlines()
    for i, line in enumerate(lines):
        if "cp.async.bulk.tensor" in line and ".global.shared::cta" in line:
            assert any("elect.sync" in prev for prev in lines[max(0, i - 24): i])
    assert report.local_memory_ops == 0
    assert len(report.kernels) == 1 and report.spills == 0 and report.kernels[0].stack_frame == 0
    # shared memory: the struct the kernel allocates and the launch's request are the plan, and so is
    # the plan's buffer table (layouts.budget.k2_budget) that the tools print
    assert kernel.shared_storage.__sizeof__() == kernel.plan.total_bytes
    assert report.launch_smem == [kernel.plan.total_bytes] == [budget.k2_budget(kernel.plan).total_bytes]
    assert kernel.plan.state_io_fp32 == ("fp32" in (state_in, state_out))
    print(f"{variant}: {report.kernels[0].registers} registers, {kernel.plan.total_bytes} B smem")


@pytest.mark.parametrize("vsplit,varlen,dim", [(vsplit, varlen, D) for vsplit in VSPLITS for varlen in (False, True)]
                         + [(vsplit, vsplit == 2, 64) for vsplit in VSPLITS])
def test_training_variant_compiles(vsplit, varlen, dim):
    """The training forward (state checkpoints) runs the inference variant's instructions plus, on a
    checkpoint tile, each warp's rows of the state buffer as D / 8 one-dimensional bulk copies from one lane
    (the state image, ``layouts.fwd_recurrence.state_image``), one wait for their read and one proxy fence
    a tile — or, for bands under 32 columns, 32-bit stores of the state fragment Phase 1 loaded — with no
    spills."""
    variant = (vsplit, "fp32", "fp32", varlen, dim)
    kernel, report = _compiled(variant, checkpoints=True)
    _, inference = _compiled(variant)
    bulk = kernel.image_by_bulk
    assert bulk == (kernel.warp_cols >= 32)
    if bulk:
        assert_band_image_copies(report, kernel.warp_cols, dim)
    else:  # the B fragment Phase 1 loaded, as 32-bit words (D · cols / 64 a lane)
        assert report.count("cp.async.bulk.global.shared::cta") == 0
        assert report.count("st.global.b32") == inference.count("st.global.b32") + dim * kernel.warp_cols // 64
    assert report.count("cp.async.bulk.commit_group") == inference.count("cp.async.bulk.commit_group") + bulk
    assert report.count("fence.proxy.async") == inference.count("fence.proxy.async") + bulk
    for mnemonic in ("mma.sync", "movmatrix", "ldmatrix", "stmatrix", "mul.rn.f32", "cvt.rn.bf16x2.f32",
                     "cp.async.bulk.tensor", "st.global.b16"):
        assert report.count(mnemonic) == inference.count(mnemonic), mnemonic
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == inference.launch_smem
    print(f"{variant} checkpoints: {report.kernels[0].registers} registers (inference {inference.kernels[0].registers})")


# a pass for its states alone: the backward's recomputation (checkpoints, no final state) and a segmented call's passes
# for the segment states (a final state from none or an fp32 one), each against the variant with token outputs
_STATE_PASSES = ([(vsplit, "fp32", "none", varlen, D, True) for vsplit in VSPLITS for varlen in (False, True)]
                 + [(1, state_in, "fp32", True, D, False) for state_in in ("none", "fp32")]
                 + [(vsplit, "bf16", "none", vsplit == 2, 64, True) for vsplit in VSPLITS]
                 + [(1, "fp32", "fp32", True, 64, False)])


@pytest.mark.parametrize("vsplit,state_in,state_out,varlen,dim,checkpoints", _STATE_PASSES,
                         ids=lambda value: str(value))
def test_state_pass_compiles(vsplit, state_in, state_out, varlen, dim, checkpoints):
    """``token_outputs=False``: the variant's instructions less o's — no qd or Mqk load (the 3-D and 4-D TMA loads
    one fewer each), no o store, Phase 1 without ``qd·S`` and no ``Mqk·U`` (``k_steps + 1`` fewer mma a warp row),
    no o rounding or ``stmatrix`` — and the state chain's own (movmatrix, decays, the state's rounding and
    ``stmatrix.trans``, the checkpoint copies) unchanged; no spills, at most the shared memory of the variant with
    o."""
    variant = (vsplit, state_in, state_out, varlen, dim)
    kernel, report = _compiled(variant, checkpoints, token_outputs=False)
    full_kernel, full = _compiled(variant, checkpoints)
    atoms, k_steps = kernel.warp_cols // 8, dim // CHUNK
    assert kernel.plan.stage_tx_bytes == full_kernel.plan.stage_tx_bytes - CHUNK * dim * 2 - CHUNK * CHUNK * 2
    tma = {dims: report.count(f"cp.async.bulk.tensor.{dims}d.shared::cta.global") for dims in (2, 3, 4, 5)}
    assert tma == {2: 2, 3: 2, 4: 1, 5: 1 + (state_in != "none")}  # gT, β | kd, kr | INV | v, state
    assert report.count("cp.async.bulk.tensor.5d.global.shared::cta") == (state_out != "none")
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    assert report.count(mma) == full.count(mma) - (k_steps + 1) * atoms == (2 * k_steps + 1) * atoms
    assert report.count("cvt.rn.bf16x2.f32") == full.count("cvt.rn.bf16x2.f32") - 2 * atoms
    assert report.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == \
        full.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") - k_steps - 1
    x = kernel.band_matrices
    assert report.count(f"stmatrix.sync.aligned.m8n8.x{x}.shared.b16") == 0
    for mnemonic in ("movmatrix", "mul.rn.f32", f"stmatrix.sync.aligned.m8n8.x{x}.trans",
                     "ldmatrix.sync.aligned.m8n8.x4.trans", "cp.async.bulk.global.shared::cta", "st.global.b32"):
        assert report.count(mnemonic) == full.count(mnemonic), mnemonic
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.kernels[0].registers * kernel.threads <= 64 * 1024  # ptxas may take more than with o: one CTA an SM
    assert report.launch_smem == [kernel.plan.total_bytes] == [budget.k2_budget(kernel.plan).total_bytes]
    assert kernel.plan.total_bytes <= full_kernel.plan.total_bytes
    print(f"{variant} states only: {report.kernels[0].registers} registers (with o {full.kernels[0].registers}), "
          f"{kernel.plan.total_bytes} B smem ({full_kernel.plan.total_bytes})")


def test_every_axis_value_is_compiled():
    variants = _variants()
    for axis, values in enumerate((VSPLITS, tuple(STATE), tuple(STATE), (False, True))):
        assert {v[axis] for v in variants} == set(values)


# ============================================================================ launcher (CPU)


def test_choose_vsplit():
    """One CTA per SM at most: the largest split that still fits (bench_recurrence's measurement)."""
    from cute_kda.variants import RecurrenceVariant

    sms = 132
    assert RecurrenceVariant.choose_vsplit(1, 96, sms) == 1  # B1 T8192 H96: 192 CTAs at VSplit 2 would share SMs
    assert RecurrenceVariant.choose_vsplit(1, 64, sms) == 2  # 128 CTAs
    assert RecurrenceVariant.choose_vsplit(1, 66, sms) == 2  # exactly one per SM
    assert RecurrenceVariant.choose_vsplit(1, 67, sms) == 1
    assert RecurrenceVariant.choose_vsplit(1, 16, sms) == 4  # B1 T32768 H16
    assert RecurrenceVariant.choose_vsplit(1, 33, sms) == 4  # 132 CTAs
    assert RecurrenceVariant.choose_vsplit(1, 34, sms) == 2
    assert RecurrenceVariant.choose_vsplit(8, 32, sms) == 1
    assert RecurrenceVariant.choose_vsplit(6, 96, sms) == 1
    assert RecurrenceVariant.choose_vsplit(1, 1, sms) == 4


def test_tile_bases():
    """The workspace tile numbering K2 reads (the device kernel's is checked in test_fwd_prepare)."""
    from cute_kda.reference import tile_bases

    cu = torch.tensor([0, 0, 5, 21, 21, 53])
    assert tile_bases(cu, 53, 1).tolist() == [0, 0, 1, 2, 2, 4]  # lengths 0, 5, 16, 0, 32
    assert tile_bases(cu, 53, 1).dtype == torch.int32


# ============================================================================ GPU: vs the mirror and the gold

_G_RAW = (-8, -4, 0, 8, "uniform", "normal")
_DT_BIAS = (0, 4, -4, 8, -8, "uniform", "normal")


def _values(kind, shape, gen):
    if kind == "uniform":
        return torch.rand(shape, generator=gen) * 16 - 8
    if kind == "normal":
        return torch.randn(shape, generator=gen) * 8
    return torch.full(shape, float(kind))


# the GPU tests run at both head dims K2 compiles for
ALL_DIMS = pytest.mark.parametrize("dim", [D, 64], ids=["D128", "D64"])


def _problem(B, T, H, *, g_raw="uniform", dt_bias="normal", seed=0, device="cuda", dim=D):
    """bf16 q, k, v, g, beta [B, T, H(, D)]; fp32 A_log [H], dt_bias [H, D] (D = ``dim``)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, dim, generator=gen).bfloat16() for _ in range(3))
    g = _values(g_raw, (B, T, H, dim), gen).bfloat16()
    beta = (torch.randn(B, T, H, generator=gen) * 2).bfloat16()
    A_log = torch.rand(H, generator=gen) - 0.5
    bias = _values(dt_bias, (H, dim), gen)
    return tuple(t.to(device) for t in (q, k, v, g, beta, A_log, bias))


def _initial_state(kind, N, H, seed, device, dim=D):
    if STATE[kind] is None:
        return None
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(N, H, dim, dim, generator=gen) * 0.5).to(device=device, dtype=STATE[kind])


def _guarded(shape, dtype, device, axis: int, pad: int):
    """A buffer of all-ones bits (NaN) with ``pad`` extra slices on each side of ``axis``; returns
    (the inner view of ``shape``, the buffer)."""
    big_shape = list(shape)
    big_shape[axis] += 2 * pad
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    buffer = torch.full(big_shape, -1, dtype=bits, device=device).view(dtype)
    return buffer.narrow(axis, pad, shape[axis]), buffer


def _assert_guards_untouched(buffer, axis: int, pad: int):
    bits = buffer.view(torch.int16 if buffer.dtype == torch.bfloat16 else torch.int32)
    for guard in (bits.narrow(axis, 0, pad), bits.narrow(axis, bits.shape[axis] - pad, pad)):
        assert bool((guard == -1).all()), "a guard region was written"


def _run(problem, *, lengths=None, state_in="none", state_out="fp32", vsplit=None, lower_bound=-5.0, seed=0):
    """Workspace from the mirror's K1, then K2 into guarded buffers; returns (o, final, ws, cu, init)."""
    from cute_kda.reference import mirror_prepare

    q, k, v, g, beta, A_log, bias = problem
    device = q.device
    B, T, H, dim = q.shape
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    N = B if lengths is None else len(lengths)
    ws = mirror_prepare(q, k, g, beta, A_log=A_log, dt_bias=bias, lower_bound=lower_bound, cu_seqlens=cu)
    init = _initial_state(state_in, N, H, seed, device, dim)
    out, out_buf = _guarded((B, T, H, dim), torch.bfloat16, device, axis=1, pad=CHUNK)
    final = final_buf = None
    if STATE[state_out] is not None:
        final, final_buf = _guarded((N, H, dim, dim), STATE[state_out], device, axis=0, pad=1)
    k2.recurrence(v, ws, out, cu_seqlens=cu, initial_state=init, final_state=final, vsplit=vsplit)
    torch.cuda.synchronize()
    _assert_guards_untouched(out_buf, axis=1, pad=CHUNK)
    if final is not None:
        _assert_guards_untouched(final_buf, axis=0, pad=1)
    assert not out.isnan().any(), "an output row was not written"
    return out, final, ws, cu, init


def _mirror(problem, ws, cu, init, state_out):
    from cute_kda.reference import mirror_recurrence

    dtype = STATE[state_out] or torch.float32
    return mirror_recurrence(ws, problem[2], cu_seqlens=cu, initial_state=init, output_final_state=True,
                             state_dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 16])
@pytest.mark.parametrize("state_in,state_out", [("bf16", "bf16"), ("fp32", "fp32"), ("none", "fp32")])
@ALL_DIMS
def test_single_tile_within_one_ulp_of_the_mirror(T, state_in, state_out, dim):
    problem = _problem(2, T, 3, seed=T, dim=dim)
    o, final, ws, cu, init = _run(problem, state_in=state_in, state_out=state_out, seed=T)
    o_ref, final_ref = _mirror(problem, ws, cu, init, state_out)
    assert_within_one_ulp(f"T={T} o", o, o_ref)
    assert_within_one_ulp(f"T={T} state", final, final_ref)  # an fp32 state compared in bf16 ULPs


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300]], ids=["B2xT300", "varlen"])
@ALL_DIMS
def test_many_tiles_track_the_mirror(lengths, dim):
    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=11, dim=dim)
    from cute_kda.reference import rel_rms

    o, final, ws, cu, init = _run(problem, lengths=lengths, state_in="bf16", state_out="bf16", seed=11)
    o_ref, final_ref = _mirror(problem, ws, cu, init, "bf16")
    err_o, err_s = rel_rms(o, o_ref), rel_rms(final, final_ref)
    print(f"o ulps vs mirror: {torch.bincount(bf16_ulps(o, o_ref).flatten().clamp(max=3)).tolist()}")
    print(f"state ulps vs mirror: {torch.bincount(bf16_ulps(final, final_ref).flatten().clamp(max=3)).tolist()}")
    print(f"vs mirror: o {err_o:.2e} state {err_s:.2e}")
    assert err_o <= MIRROR_TOL and err_s <= MIRROR_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("state_out", ["bf16", "fp32"])
@ALL_DIMS
def test_vsplits_are_bit_identical(state_out, dim):
    lengths = [300, 0, 17, 1, 64]
    problem = _problem(1, sum(lengths), 3, seed=5, dim=dim)
    results = [_run(problem, lengths=lengths, state_in="fp32", state_out=state_out, vsplit=s, seed=5)[:2]
               for s in VSPLITS]
    for o, final in results[1:]:
        assert torch.equal(o.view(torch.int16), results[0][0].view(torch.int16))
        assert torch.equal(final, results[0][1])


def _gold(problem, *, lengths, init, lower_bound=-5.0):
    from cute_kda.reference import gold_forward

    q, k, v, g, beta, A_log, bias = problem
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device=q.device)
    return gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=bias, lower_bound=lower_bound, cu_seqlens=cu,
                        initial_state=init, output_final_state=True)


def _check_gold(problem, *, lengths=None, state_in="none", state_out="fp32", vsplit=None, seed=0, label=""):
    """K2 vs the fp64 gold ≤ TOL; where the contract's own bf16 state already exceeds TOL (the mirror
    does: long sequences without decay, tests/test_reference_mirror.py), ≤ 1.1 × the mirror's error."""
    from cute_kda.reference import rel_rms

    o, final, ws, cu, init = _run(problem, lengths=lengths, state_in=state_in, state_out=state_out,
                                  vsplit=vsplit, seed=seed)
    o_gold, final_gold = _gold(problem, lengths=lengths, init=init)
    err_o = rel_rms(o, o_gold)
    err_s = rel_rms(final, final_gold) if final is not None else 0.0
    limit_o = limit_s = TOL
    if max(err_o, err_s) > TOL:
        o_m, final_m = _mirror(problem, ws, cu, init, state_out)
        limit_o = max(TOL, 1.1 * rel_rms(o_m, o_gold))
        limit_s = max(TOL, 1.1 * rel_rms(final_m, final_gold))
    print(f"{label}: o {err_o:.2e} (limit {limit_o:.1e}) state {err_s:.2e} (limit {limit_s:.1e})")
    assert math.isfinite(err_o) and err_o <= limit_o
    assert math.isfinite(err_s) and err_s <= limit_s


@pytest.mark.gpu
@pytest.mark.parametrize("dt_bias", _DT_BIAS)
@pytest.mark.parametrize("g_raw", _G_RAW)
@ALL_DIMS
def test_gold_gate_cases(g_raw, dt_bias, dim):
    problem = _problem(2, 97, 2, g_raw=g_raw, dt_bias=dt_bias, seed=1, dim=dim)
    _check_gold(problem, state_in="bf16", state_out="fp32", seed=1, label=f"g={g_raw} bias={dt_bias}")


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,state_in,state_out", [
    (1, 1, "none", "bf16"), (2, 15, "bf16", "fp32"), (8, 16, "fp32", "none"), (1, 17, "fp32", "bf16"),
    (2, 97, "none", "fp32"), (1, 1024, "fp32", "fp32"), (8, 100, "bf16", "bf16"),
])
@ALL_DIMS
def test_gold_shapes(B, T, state_in, state_out, dim):
    problem = _problem(B, T, 2, seed=T, dim=dim)
    _check_gold(problem, state_in=state_in, state_out=state_out, seed=T, label=f"B={B} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[1300, 547, 2048, 963, 271, 3063], [1024] * 8, [0, 5, 16]],
                         ids=["mixed", "8x1024", "0-5-16"])
@pytest.mark.parametrize("state_in,state_out", [("none", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")])
@ALL_DIMS
def test_gold_varlen(lengths, state_in, state_out, dim):
    problem = _problem(1, sum(lengths), 2, seed=len(lengths), dim=dim)
    _check_gold(problem, lengths=lengths, state_in=state_in, state_out=state_out, seed=3, label=f"{lengths}")


@pytest.mark.gpu
@pytest.mark.parametrize("state_in,state_out,vsplit", [
    (state_in, state_out, VSPLITS[i % 3]) for i, (state_in, state_out) in enumerate(itertools.product(STATE, STATE))
])
@ALL_DIMS
def test_gold_every_state_mode(state_in, state_out, vsplit, dim):
    lengths = [0, 5, 16, 33]
    problem = _problem(1, sum(lengths), 2, seed=9, dim=dim)
    _check_gold(problem, lengths=lengths, state_in=state_in, state_out=state_out, vsplit=vsplit, seed=9,
                label=f"vs{vsplit} {state_in}->{state_out}")


@pytest.mark.gpu
@ALL_DIMS
def test_empty_sequence_passes_the_state_through(dim):
    lengths = [0, 16, 0]
    problem = _problem(1, 16, 2, seed=4, dim=dim)
    for state in ("bf16", "fp32"):
        _, final, _, _, init = _run(problem, lengths=lengths, state_in=state, state_out=state, seed=4)
        for n in (0, 2):  # empty: final = initial (bf16 as it is, fp32 kept in fp32)
            assert torch.equal(final[n], init[n])


@pytest.mark.gpu
@ALL_DIMS
def test_gold_t8192(dim):
    problem = _problem(1, 8192, 2, seed=8, dim=dim)
    _check_gold(problem, state_in="fp32", state_out="fp32", seed=8, label="T=8192")


# ---------------------------------------------------------------- 1M tokens: chunked fp64 reference


def chunked_fp64_forward(problem, *, chunk: int = 64, lower_bound: float = -5.0):
    """The KDA recurrence in fp64 by exact chunked algebra (no rounding but fp64's): o and the final
    state ``[1, H, V, K]`` of one sequence (B = 1), zero initial state. Same math as the gold token
    loop (checked against it on the CPU), ``T / chunk`` sequential steps instead of ``T``."""
    from cute_kda.reference.gold import gate_log_decay, l2norm

    q, k, v, g, beta, A_log, bias = (x.double() for x in problem)
    _, T, H, _ = q.shape
    q = l2norm(q[0]) * D ** -0.5
    k = l2norm(k[0])
    v, beta = v[0], torch.sigmoid(beta[0])
    log_decay = gate_log_decay(g[0], A_log=A_log, dt_bias=bias, lower_bound=lower_bound)  # [T, H, K]
    state = q.new_zeros(H, D, D)  # [H, K, V]
    out = torch.empty_like(v)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        n = end - start
        G = torch.cumsum(log_decay[start:end], 0).transpose(0, 1)  # [H, n, K]
        qc, kc, vc, bc = (x[start:end].transpose(0, 1) for x in (q, k, v, beta))
        kd, qd, kinv = kc * G.exp(), qc * G.exp(), kc * (-G).exp()
        kr = kc * (G[:, -1:] - G).exp()
        L = torch.tril(bc[..., None] * kd @ kinv.transpose(1, 2), -1)
        u = bc[..., None] * (vc - kd @ state)
        U = torch.linalg.solve_triangular(eye[:n, :n] + L, u, upper=False, unitriangular=True)
        out[start:end] = (qd @ state + torch.tril(qd @ kinv.transpose(1, 2)) @ U).transpose(0, 1)
        state = G[:, -1, :, None].exp() * state + kr.transpose(1, 2) @ U
    return out[None], state.transpose(1, 2)[None]


def test_chunked_fp64_reference_is_the_gold():
    from cute_kda.reference import gold_forward, rel_rms

    problem = _problem(1, 75, 2, seed=2, device="cpu")
    q, k, v, g, beta, A_log, bias = problem
    o_gold, s_gold = gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=bias, output_final_state=True)
    o, s = chunked_fp64_forward(problem, chunk=16)
    assert rel_rms(o, o_gold) < 1e-10 and rel_rms(s, s_gold) < 1e-10


@pytest.mark.gpu
def test_one_million_tokens():
    from cute_kda.reference import rel_rms

    problem = _problem(1, 1 << 20, 1, seed=6)
    o, final, *_ = _run(problem, state_out="fp32", seed=6)
    o_ref, final_ref = chunked_fp64_forward(problem)
    err_o, err_s = rel_rms(o, o_ref), rel_rms(final, final_ref)
    print(f"T=2^20 H=1: o {err_o:.2e} state {err_s:.2e}")
    assert err_o <= TOL and err_s <= TOL


# ---------------------------------------------------------------- training forward: state checkpoints


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300, 1]], ids=["B2xT300", "varlen"])
@ALL_DIMS
def test_training_variant_checkpoints(lengths, dim):
    """The training variant writes the inference variant's o and final state bit for bit, and checkpoints
    (state images) that track the mirror's (the first of each sequence is bf16(initial state) exactly); rows it does not
    own stay poisoned and the guards around the buffer untouched."""
    from cute_kda.reference import mirror_recurrence, rel_rms
    from cute_kda.workspace import SNAPSHOT_TILES, block_states_shape, images_to_states

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=12, dim=dim)
    o, final, ws, cu, init = _run(problem, lengths=lengths, state_in="fp32", state_out="fp32", seed=12)
    N, H = init.shape[:2]
    shape = block_states_shape(ws, H, N)
    ckpt, ckpt_buf = _guarded(shape, torch.bfloat16, problem[0].device, axis=0, pad=1)
    out2, final2 = torch.empty_like(o), torch.empty_like(final)
    k2.recurrence(problem[2], ws, out2, cu_seqlens=cu, initial_state=init, final_state=final2, checkpoints=ckpt)
    torch.cuda.synchronize()
    _assert_guards_untouched(ckpt_buf, axis=0, pad=1)
    assert torch.equal(out2.view(torch.int16), o.view(torch.int16)) and torch.equal(final2, final)
    ckpt = images_to_states(ckpt)  # the kernel keeps state images; the mirror [K, V] matrices
    want = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=o.device)
    mirror_recurrence(ws, problem[2], cu_seqlens=cu, initial_state=init, checkpoints=want)
    written = ~want.isnan()
    assert bool((ckpt.isnan() == ~written).all()), "checkpoint rows written ≠ the mirror's"
    slots = shape[0] // H
    lengths = lengths or [T] * B
    tiles = [(n + CHUNK - 1) // CHUNK for n in lengths]
    first = list(itertools.accumulate([0, *tiles]))
    for n in range(N):
        if tiles[n]:
            slot = first[n] // SNAPSHOT_TILES + n  # the block of the sequence's first tile
            rows = ckpt.view(H, slots, dim, dim)[:, slot]
            assert torch.equal(rows, init[n].transpose(-1, -2).bfloat16()), n
    err = rel_rms(ckpt[written], want[written])
    print(f"checkpoints vs mirror: {err:.2e} over {int(written.sum()) // (dim * dim)} matrices")
    assert err <= MIRROR_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300, 1]], ids=["B2xT300", "varlen"])
@pytest.mark.parametrize("vsplit", VSPLITS)
@ALL_DIMS
def test_state_pass_keeps_the_same_states(lengths, vsplit, dim):
    """A pass without token outputs (``out=None``: the backward's recomputation, a segmented call's passes for the
    segment states) writes the checkpoints and the final state of the pass with o bit for bit, and nothing else:
    the checkpoint rows it does not own stay poisoned, the guards around both buffers untouched."""
    from cute_kda.workspace import block_states_shape

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=13, dim=dim)
    _, final, ws, cu, init = _run(problem, lengths=lengths, state_in="fp32", state_out="fp32", seed=13, vsplit=vsplit)
    N, H = init.shape[:2]
    shape = block_states_shape(ws, H, N)
    device = problem[0].device
    want, _ = _guarded(shape, torch.bfloat16, device, axis=0, pad=1)
    k2.recurrence(problem[2], ws, torch.empty_like(problem[2]), cu_seqlens=cu, initial_state=init, vsplit=vsplit,
                  checkpoints=want)
    ckpt, ckpt_buf = _guarded(shape, torch.bfloat16, device, axis=0, pad=1)
    k2.recurrence(problem[2], ws, None, cu_seqlens=cu, initial_state=init, vsplit=vsplit, checkpoints=ckpt)
    states, states_buf = _guarded(final.shape, torch.float32, device, axis=0, pad=1)
    k2.recurrence(problem[2], ws, None, cu_seqlens=cu, initial_state=init, final_state=states, vsplit=vsplit)
    torch.cuda.synchronize()
    _assert_guards_untouched(ckpt_buf, axis=0, pad=1)
    _assert_guards_untouched(states_buf, axis=0, pad=1)
    assert torch.equal(ckpt.view(torch.int16), want.view(torch.int16))  # the unwritten rows' poison too
    assert torch.equal(states.view(torch.int32), final.view(torch.int32))


def test_state_pass_needs_a_state_to_keep():
    """``out=None`` keeps checkpoints or a final state; without either K2 would write nothing."""
    from cute_kda.workspace import WorkspaceSpec, workspace_views

    v = torch.zeros(1, 16, 2, D, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=2, tiles=1, dim=D)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out=None"):
        k2.recurrence(v, ws, None)


@pytest.mark.parametrize("dim", [D, 64])
def test_state_images_are_the_state_image_layout(dim):
    """The torch conversion of the kept matrices (``workspace.states_to_images``) puts ``S[k, v]`` where the
    kernels' CuTe layout (``layouts.fwd_recurrence.state_image``) puts element ``[v, k]``, and a band-scan warp's
    rows of its band buffer are D / 8 contiguous runs of ``cols · 16`` bytes in it at every V-split (K2's and
    Kernel A's)."""
    from cute_kda.layouts import fwd_recurrence as layouts
    from cute_kda.layouts.analysis import evaluate_layout, run_traced
    from cute_kda.layouts.bwd_scan import SCAN_VSPLITS, ScanSmemPlan
    from cute_kda.workspace import images_to_states, states_to_images

    image = run_traced(lambda: evaluate_layout(layouts.state_image(dim), 2))
    assert image.bytes.shape == (dim, dim) and image.cosize == dim * dim
    elements = torch.from_numpy(image.bytes // 2)  # [v, k]
    states = torch.randn(3, dim, dim)
    flat = states_to_images(states).flatten(1)
    assert torch.equal(flat[:, elements], states.transpose(1, 2))
    assert torch.equal(images_to_states(states_to_images(states)), states)
    plans = [RecurrenceSmemPlan(vsplit=vsplit, dim=dim) for vsplit in VSPLITS]
    plans += [ScanSmemPlan(vsplit=v) for v in SCAN_VSPLITS] if dim == D else []  # Kernel A: D = 128 only
    for plan in plans:
        vsplit = plan.vsplit
        band = run_traced(lambda: evaluate_layout(layouts.state_b(plan), 2)).bytes
        cols = plan.warp_cols
        for band_index in range(vsplit):
            for w in range(plan.v_band // cols):
                for j in range(dim // layouts.IMAGE_RUN):
                    run = slice(8 * j, 8 * j + 8)
                    rows = slice(w * cols, (w + 1) * cols)
                    local = band[rows, run]
                    kept = image.bytes[band_index * plan.v_band + w * cols:band_index * plan.v_band + (w + 1) * cols, run]
                    assert sorted(local.flatten()) == list(range(local.min(), local.min() + cols * 16, 2))
                    assert (kept - kept.min() == local - local.min()).all()
