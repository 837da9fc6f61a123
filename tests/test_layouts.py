"""Layout analysis on the CPU: byte tables, transpose-dual pairs, ldmatrix/stmatrix bank conflicts, smem budgets."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cute_kda.dsl import cute, cutlass
from cute_kda.layouts import analysis, budget, fwd_prepare, smem
from cute_kda.layouts import fwd_recurrence as recurrence_layouts
from cute_kda.layouts.analysis import (
    K_INTER_FAMILY, ROW_MAJOR_FAMILY, SW128_FAMILY, MatrixAccess, layout_spec,
)
from cute_kda.layouts.fwd_recurrence import RecurrenceSmemPlan

BF16 = cutlass.BFloat16


def _broadcast_rows(rows: int, cols: int):
    """Every row on the same bytes: a layout that is not one-to-one."""
    return cute.make_layout((rows, cols), stride=(0, 1))


# ---------------------------------------------------------------------------- byte tables


@pytest.mark.parametrize("spec", [
    layout_spec("chunk", smem.chunk_operand, 128, 16),
    layout_spec("chunk_t", smem.chunk_operand_transposed, 64, 16),
    SW128_FAMILY.spec(16, 64, BF16, transposed=True),
    layout_spec("state_fp32", smem.state_fp32, 32, dtype=cutlass.Float32),
], ids=lambda s: s.name)
def test_mode_sum_table_equals_coordinate_by_coordinate_evaluation(spec):
    assert np.array_equal(analysis.byte_table(spec), analysis.full_byte_table(spec))


def test_swizzle_function_matches_the_dsl_on_element_offsets():
    # The DSL's ComposedLayout(coord) swizzles the element offset; with width 1 our function must agree.
    def run():
        atom = smem.layout_atom(smem.AtomKind.K_SW128, BF16)
        sw = atom.inner
        params = (sw.num_bits, sw.num_base, sw.num_shift)
        return [(atom((r, c)), analysis.apply_swizzle(atom.outer((r, c)), *params))
                for r in range(8) for c in range(64)]

    pairs = analysis.run_traced(run)
    assert all(dsl == ours for dsl, ours in pairs)
    assert any(dsl != plain for (dsl, _), plain in zip(pairs, range(512)))  # the swizzle is not the identity


def test_k_sw128_byte_swizzle_row1():
    # Hardware (byte) semantics: row 1 of a bf16 K_SW128 atom starts at byte 128 ^ 16.
    table = analysis.byte_table(SW128_FAMILY.spec(8, 64, BF16))
    assert table[1, 0] == 144 and table[0, 0] == 0 and table[2, 0] == 256 ^ 32


class _SwizzleProbe:
    """Stores to row 1, col 0 of a K_SW128 bf16 atom through a pointer swizzle and a composed layout."""

    @cute.jit
    def __call__(self, stream):
        @cute.struct
        class Storage:
            pointer_swizzled: cute.struct.Align[cute.struct.MemRange[BF16, 512], 1024]
            layout_swizzled: cute.struct.Align[cute.struct.MemRange[BF16, 512], 1024]

        self.storage = Storage
        self.kernel().launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self):
        import cutlass.memory

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        atom = smem.layout_atom(smem.AtomKind.K_SW128, BF16)
        storage.pointer_swizzled.get_tensor(atom.outer, swizzle=atom.inner)[(1, 0)] = BF16(1.0)  # 0x3F80
        storage.layout_swizzled.get_tensor(atom)[(1, 0)] = BF16(2.0)  # 0x4000


def test_pointer_swizzle_acts_on_bytes_in_ptx(tmp_path):
    """The bank model's premise: ``get_tensor(outer, swizzle=inner)`` swizzles byte addresses.

    Row 1 is byte 128: the byte swizzle moves it to 144 (xor 16); the element swizzle of a composed
    layout leaves element 64 (byte 128) alone, 1024 bytes into the storage.
    """
    from cutlass.cute.runtime import make_fake_stream

    compiled = cute.compile(_SwizzleProbe(), make_fake_stream(), options=f"--keep-ptx --dump-dir {tmp_path}")
    stores = {m.group(2): m.group(1) for m in re.finditer(r"st\.shared\.b16\s+\[([^\]]+)\],\s*(0x[0-9A-F]+);",
                                                         compiled.__ptx__)}
    pointer_addr, layout_addr = stores["0x3F80"], stores["0x4000"]
    assert layout_addr.endswith("+1152")
    xor_reg = re.search(r"xor\.b32\s+" + re.escape(pointer_addr) + r",\s*%r\d+,\s*16;", compiled.__ptx__)
    assert xor_reg is not None or pointer_addr.endswith("+144"), pointer_addr


# ---------------------------------------------------------------------------- (i) transpose-dual


@pytest.mark.parametrize("dim", [64, 128])
def test_design_pairs_are_transpose_dual(dim):
    pairs = analysis.design_pairs(dim, 16, BF16)
    assert len(pairs) == 4  # chunk operand, state, square, staged TMA tile
    for a, b, perm in pairs:
        result = analysis.check_transpose_dual(a, b, perm)
        assert result.ok, result


@pytest.mark.parametrize("family", [K_INTER_FAMILY, ROW_MAJOR_FAMILY, SW128_FAMILY], ids=lambda f: f.name)
def test_candidate_families_are_transpose_dual(family):
    for rows, cols in ((16, 128), (128, 128)):
        result = analysis.check_transpose_dual(family.spec(rows, cols, BF16),
                                               family.spec(rows, cols, BF16, transposed=True))
        assert result.ok, result


def test_transpose_dual_check_detects_a_wrong_pair():
    wrong = analysis.check_transpose_dual(K_INTER_FAMILY.spec(16, 128, BF16),
                                          ROW_MAJOR_FAMILY.spec(16, 128, BF16, transposed=True))
    assert wrong.mismatches > 0 and not wrong.ok
    not_transposed = analysis.check_transpose_dual(K_INTER_FAMILY.spec(16, 128, BF16),
                                                   K_INTER_FAMILY.spec(16, 128, BF16))
    assert not_transposed.mismatches == -1
    aliasing = layout_spec("broadcast", _broadcast_rows, 16, 16)
    assert not analysis.check_transpose_dual(aliasing, aliasing).bijective


def test_design_md_32x32_pair_prints():
    def run():
        return str(smem.operand_tile(32, 32).outer), str(smem.operand_tile_transposed(32, 32).outer)

    assert analysis.run_traced(run) == ("((8,4),(8,4)):((8,64),(1,256))", "((8,4),(8,4)):((1,256),(8,64))")


# ---------------------------------------------------------------------------- (ii) access patterns


def _starts(access):
    """(lane, start coordinate, direction of the eight elements) from the DSL-derived rows."""
    out = []
    for call in analysis.access_rows(access):
        for p, phase in enumerate(call):
            for i, row in enumerate(phase):
                step = (row[1][0] - row[0][0], row[1][1] - row[0][1])
                assert all(row[e] == (row[0][0] + e * step[0], row[0][1] + e * step[1]) for e in range(8))
                out.append((8 * p + i, row[0], step))
    return out


@pytest.mark.parametrize("op", ["ldmatrix", "stmatrix"])
@pytest.mark.parametrize("operand,trans,start", [
    ("A", False, lambda l: (l % 16, 8 * (l // 16))),
    ("C", False, lambda l: (l % 16, 8 * (l // 16))),
    ("B", False, lambda l: (l % 8 + 8 * (l // 16), 8 * (l // 8 % 2))),
    ("A", True, lambda l: (8 * (l // 8 % 2), l % 8 + 8 * (l // 16))),
    ("C", True, lambda l: (8 * (l // 8 % 2), l % 8 + 8 * (l // 16))),
    ("B", True, lambda l: (8 * (l // 16), l % 16)),
])
def test_x4_lane_addresses_follow_the_mma_fragments(op, operand, trans, start):
    rows = _starts(MatrixAccess(op, operand, 4, trans))
    assert len(rows) == 32
    for lane, first, step in rows:
        assert first == start(lane), (lane, first)
        assert step == ((1, 0) if trans else (0, 1))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_xn_covers_the_block_once(n):
    for operand in "ABC":
        for trans in (False, True):
            rows = analysis.access_rows(MatrixAccess("ldmatrix", operand, n, trans))
            assert len(rows) == 4 // n and all(len(call) == n for call in rows)
            coords = [c for call in rows for phase in call for row in phase for c in row]
            assert sorted(coords) == [(i, j) for i in range(16) for j in range(16)]


def test_phase_wavefronts_bank_model():
    rows = lambda starts: [list(range(s, s + 16, 2)) for s in starts]  # noqa: E731
    assert analysis.phase_wavefronts(rows(range(0, 128, 16))) == 1  # one 128-byte line
    assert analysis.phase_wavefronts(rows([0] * 8)) == 1  # same row: broadcast
    assert analysis.phase_wavefronts(rows(range(0, 8 * 128, 128))) == 8  # 128-byte stride: one bank group
    assert analysis.phase_wavefronts(rows(range(0, 8 * 32, 32))) == 2  # 32-byte stride: rows r, r+4 collide


# ---------------------------------------------------------------------------- (ii) bank conflicts


A_X4 = MatrixAccess("ldmatrix", "A", 4)
A_X4_T = MatrixAccess("ldmatrix", "A", 4, trans=True)
B_X4 = MatrixAccess("ldmatrix", "B", 4)
C_ST_X4_T = MatrixAccess("stmatrix", "C", 4, trans=True)


@pytest.mark.parametrize("family,expected", [(ROW_MAJOR_FAMILY, 32), (K_INTER_FAMILY, 4), (SW128_FAMILY, 4)],
                         ids=lambda x: getattr(x, "name", x))
def test_chunk_tile_a_operand_known_answers(family, expected):
    # Row-major [16,128] bf16: 8 rows of 256 B hit the same 4 banks, 8 wavefronts per phase.
    assert analysis.max_wavefronts(family.spec(16, 128, BF16), A_X4) == expected
    assert analysis.max_wavefronts(family.spec(16, 128, BF16, transposed=True), A_X4_T) == expected


@pytest.mark.parametrize("family,expected", [(ROW_MAJOR_FAMILY, 32), (K_INTER_FAMILY, 4), (SW128_FAMILY, 4)],
                         ids=lambda x: getattr(x, "name", x))
def test_state_known_answers(family, expected):
    assert analysis.max_wavefronts(family.spec(128, 128, BF16), B_X4) == expected
    assert analysis.max_wavefronts(family.spec(128, 128, BF16, transposed=True), C_ST_X4_T) == expected


def test_square_row_major_is_two_way_conflicted():
    assert analysis.max_wavefronts(ROW_MAJOR_FAMILY.spec(16, 16, BF16), A_X4) == 8
    assert analysis.max_wavefronts(K_INTER_FAMILY.spec(16, 16, BF16), A_X4) == 4


def test_wrong_orientation_is_not_addressable():
    # The K_INTER tile keeps k contiguous; .trans on it would need m contiguous.
    assert analysis.max_wavefronts(K_INTER_FAMILY.spec(16, 128, BF16), A_X4_T) is None
    with pytest.raises(analysis.NotAddressable):
        analysis.instruction_wavefronts(analysis.byte_table(K_INTER_FAMILY.spec(16, 128, BF16)), A_X4_T)


def test_kernel_uses_are_conflict_free_with_k_inter():
    rows = analysis.bank_conflict_table(128, 16, BF16)
    assert len(rows) == 3 * len(analysis.KERNEL_USES)
    for row in rows:
        assert row.wavefronts["K_INTER"] == row.ideal, row
        assert row.wavefronts["row-major"] > row.ideal, row
        assert row.wavefronts["K_SW128"] in (row.ideal, None), row
    assert "K_INTER" in analysis.format_conflict_table(rows)


# ---------------------------------------------------------------------------- (iii) budgets


K2_PLANS = [RecurrenceSmemPlan(vsplit, fp32, dim) for dim in (128, 64) for fp32 in (False, True) for vsplit in (1, 2, 4)]


def _plan_id(plan: RecurrenceSmemPlan) -> str:
    return f"vs{plan.vsplit}-{'fp32' if plan.state_io_fp32 else 'bf16'}" + ("" if plan.dim == 128 else f"-D{plan.dim}")


@pytest.mark.parametrize("plan", K2_PLANS, ids=_plan_id)
def test_k2_budget_is_the_kernels_plan(plan):
    """Every buffer of the table sits where ``RecurrenceSmemPlan`` (what K2 allocates) puts it."""
    table = budget.k2_budget(plan)
    bufs = table.buffers
    assert table.total_bytes == plan.total_bytes
    assert bufs["state"].offset == 0 and bufs["state"].buffer.nbytes == plan.state_bytes
    union = bufs["v"].offset
    assert union % 128 == 0 and union >= plan.state_bytes
    assert {name: p.offset - union for name, p in bufs.items() if p.path[:2] == ("union", "pipeline")} \
        == plan.union_offsets()
    fields = plan.input_field_bytes()
    assert {name: bufs[name].buffer.cosize * bufs[name].buffer.width for name in fields} == fields
    assert sum(p.buffer.cosize for name, p in bufs.items() if name.endswith("_mbar")) == plan.barrier_count
    if plan.state_io_fp32:
        assert bufs["state_fp32"].offset == union  # overlaid on the pipeline
        assert bufs["state_fp32"].buffer.nbytes == plan.state_fp32_bytes
    else:
        assert "state_fp32" not in bufs
    assert table.ctas_per_sm == budget.SMEM_PER_SM // (plan.total_bytes + budget.SMEM_RESERVED_PER_CTA)


def test_k2_budget_known_totals():
    assert budget.k2_budget(RecurrenceSmemPlan(1)).stage_bytes == {"input": 18048, "output": 4096}
    assert [budget.k2_budget(RecurrenceSmemPlan(v)).ctas_per_sm for v in (1, 2, 4)] == [2, 3, 4]
    assert budget.k2_budget(RecurrenceSmemPlan(4, True)).total_bytes == 56320
    # D = 64: a quarter of the state, half of each workspace tile
    assert budget.k2_budget(RecurrenceSmemPlan(1, dim=64)).stage_bytes == {"input": 9600, "output": 2048}
    assert [budget.k2_budget(RecurrenceSmemPlan(v, dim=64)).ctas_per_sm for v in (1, 2, 4)] == [5, 6, 7]


@pytest.mark.parametrize("plan", [
    budget.k2_budget(RecurrenceSmemPlan(1, True)), budget.k2_budget(RecurrenceSmemPlan(4)), fwd_prepare.smem_budget(),
    budget.k2_budget(RecurrenceSmemPlan(1, True, 64)), budget.k2_budget(RecurrenceSmemPlan(4, dim=64)),
    fwd_prepare.smem_budget(64), fwd_prepare.dyadic_smem_budget(64), fwd_prepare.per_head_smem_budget(64),
], ids=lambda p: p.name)
def test_storage_struct_matches_plan(plan):
    struct = plan.storage_struct()
    assert struct.size_in_bytes() == plan.total_bytes

    def offsets(s, base=0, out=None):
        out = {} if out is None else out
        for name, off in s._offsets.items():
            member = s._annotations[name].dtype
            if isinstance(member, cute.struct):
                offsets(member, base + off, out)
            else:
                out[name] = base + off
        return out

    assert offsets(struct) == {name: p.offset for name, p in plan.buffers.items()}


@pytest.mark.parametrize("plan", [fwd_prepare.smem_budget(), budget.k2_budget(RecurrenceSmemPlan(2, True))],
                         ids=lambda p: p.name)
def test_buffers_overlap_only_inside_unions(plan):
    placed = list(plan.buffers.values())
    for i, a in enumerate(placed):
        for b in placed[i + 1:]:
            overlap = a.offset < b.offset + b.buffer.nbytes and b.offset < a.offset + a.buffer.nbytes
            shared = 0
            while shared < min(len(a.path), len(b.path)) and a.path[shared] == b.path[shared]:
                shared += 1
            assert not overlap or _group(plan, a.path[:shared]).union, (a.buffer.name, b.buffer.name)


def _group(plan, path):
    group = plan.storage
    for name in path:
        group = next(m for m in group.members if m.name == name)
    return group


@pytest.mark.parametrize("dim,total,ctas", [(128, 25600, 8), (64, 13312, 16)])
def test_k1_plan(dim, total, ctas):
    """K1: four swizzled bf16 tiles, the swizzled fp32 G tile, β, one mbarrier; 25 600 B at D = 128, 8 CTAs/SM by
    shared memory (13 312 B and 16 at D = 64, where the registers keep it at 8)."""
    plan = fwd_prepare.smem_budget(dim)
    tile = 16 * dim * 2
    assert {name: p.offset for name, p in plan.buffers.items()} == {
        "q": 0, "k": tile, "g": 2 * tile, "kinv": 3 * tile, "gate_cumsum": 4 * tile,
        "beta": 4 * tile + 16 * dim * 4, "tma_barrier": 4 * tile + 16 * dim * 4 + 16 * 4,
    }
    assert plan.buffers["q"].buffer.align == 1024  # K_SW128: the 128-byte swizzle repeats every 1024 bytes
    assert plan.buffers["gate_cumsum"].buffer.align == 256  # Swizzle<1,4,3>
    assert plan.total_bytes == total and plan.ctas_per_sm == ctas
    assert np.array_equal(analysis.byte_table(plan.buffers["q"].buffer.layout),
                          analysis.byte_table(SW128_FAMILY.spec(16, dim, BF16)))


def test_staged_layout_puts_each_stage_on_its_slot():
    plan = budget.k2_budget(RecurrenceSmemPlan(1))
    for name in ("beta", "kd", "v", "out"):
        buf = plan.buffers[name].buffer
        staged = analysis.run_traced(lambda: analysis.evaluate_layout(buf.staged_layout(), buf.width))
        one = analysis.byte_table(buf.layout)
        assert staged.shape[-1] == buf.stages
        for s in range(buf.stages):
            assert np.array_equal(staged.bytes[..., s], one + s * buf.slot_bytes)
            assert (s * buf.slot_bytes) % 128 == 0  # TMA needs 128-byte aligned shared-memory addresses


@pytest.mark.parametrize("plan", [RecurrenceSmemPlan(1), RecurrenceSmemPlan(4, True), RecurrenceSmemPlan(1, dim=64),
                                  RecurrenceSmemPlan(4, True, 64)], ids=_plan_id)
def test_k2_budget_layouts_are_the_kernels(plan):
    """The table's staged buffers and state views address the bytes of the layouts K2 builds."""
    bufs = budget.k2_budget(plan).buffers
    kernel_layouts = {
        "v": lambda: recurrence_layouts.value_tile(plan, plan.input_stages),
        "out": lambda: recurrence_layouts.value_tile(plan, plan.output_stages),
        "kd": lambda: recurrence_layouts.chunk_operand(plan),
        "inv": lambda: recurrence_layouts.square_tile(plan),
        "gt": lambda: recurrence_layouts.vector(plan.dim, plan.input_stages),
        "beta": lambda: recurrence_layouts.vector(plan.chunk, plan.input_stages),
        "state": lambda: recurrence_layouts.state_b(plan),
    }
    if plan.state_io_fp32:
        kernel_layouts["state_fp32"] = lambda: recurrence_layouts.state_fp32(plan)
    for name, build in kernel_layouts.items():
        buf = bufs[name].buffer
        ours = buf.staged_layout if buf.stages > 1 else buf.layout.make
        table, kernel = analysis.run_traced(lambda: (analysis.evaluate_layout(ours(), buf.width),
                                                     analysis.evaluate_layout(build(), buf.width)))
        assert np.array_equal(table.bytes, kernel.bytes), name


@pytest.mark.parametrize("dim", [128, 64])
def test_sw128_column_offsets_are_the_swizzled_layout(dim):
    """K1's unbounded-gate scan addresses a sw128 tile as eight per-column offsets plus a per-row constant."""
    from cute_kda.layouts.smem import sw128_column_offsets, sw128_row_offset

    table = analysis.byte_table(SW128_FAMILY.spec(16, dim, BF16))
    for col in range(dim):
        columns = sw128_column_offsets(col, cols=dim)
        for row in range(16):
            assert 2 * (columns[row % 8] + sw128_row_offset(row)) == table[row, col], (row, col)


@pytest.mark.parametrize("kind", [smem.AtomKind.K_SW128, smem.AtomKind.K_SW64, smem.AtomKind.K_SW32, smem.AtomKind.K_INTER],
                         ids=lambda k: k.name)
def test_offset_swizzle_addresses_the_pointer_swizzles_bytes(kind):
    """A tensor over a period-aligned pointer with :func:`smem.offset_swizzled` (the compute warps' views)
    reaches the byte the pointer swizzle (the TMA's view) reaches, for every coordinate of a staged tile."""
    rows, cols, stages = 16, 64, 3
    pointer_bytes = analysis.run_traced(
        lambda: analysis.evaluate_layout(smem.atom_tile(kind, rows, cols, BF16, stages), 2)).bytes

    def element_offsets():
        layout = smem.offset_swizzled(smem.atom_tile(kind, rows, cols, BF16, stages), BF16)
        return np.array([[[layout((r, c, s)) for s in range(stages)] for c in range(cols)] for r in range(rows)])

    assert np.array_equal(2 * analysis.run_traced(element_offsets), pointer_bytes)
    assert smem.SWIZZLE_PERIOD_BYTES[kind] * 1 <= rows * cols * 2  # the stage stride is a multiple of the period
    assert (rows * cols * 2) % smem.SWIZZLE_PERIOD_BYTES[kind] == 0


def test_row_atom_is_the_widest_swizzle_that_fits():
    assert [smem.row_atom(n) for n in (256, 128, 64, 32, 16, 48)] == [
        smem.AtomKind.K_SW128, smem.AtomKind.K_SW128, smem.AtomKind.K_SW64, smem.AtomKind.K_SW32,
        smem.AtomKind.K_INTER, smem.AtomKind.K_INTER]
    with pytest.raises(ValueError):
        smem.row_atom(24)
