"""The band-scan kernels' ldmatrix / stmatrix addresses on swizzled shared memory, checked lane by lane on the CPU.

A one-warp probe kernel builds a staged swizzled tile the way K2 and Kernel A do, slices it by a runtime stage
(and, for the band tiles, a runtime warp index), and moves one fragment with the kernels' tiled copy. Its PTX
is compiled for sm_90a and its integer address arithmetic evaluated per lane (:mod:`ptx_addresses`); each
address must be the byte the layout puts the row at (:func:`cute_kda.layouts.analysis.evaluate_layout`,
pointer semantics, as the TMA fills it), for every lane, warp and instruction.

Why: on 2026-12-02 K_SW128 band tiles read through an element-offset swizzle
(:func:`cute_kda.kernels.common.copy.aligned_smem_tensor`) gave wrong results in both kernels at V-splits 1
and 2 on the H200 (``docs/perf-log.md``, v7). This probe reproduces that on the CPU: the DSL's address for a
runtime warp offset inside an element-offset K_SW128 swizzle is wrong for a quarter to three quarters of the
lanes, while a pointer swizzle, and the element-offset K_SW64 / K_SW32 views, are right.
"""


import tempfile

import pytest
import torch
from ptx_addresses import matrix_addresses

from cute_kda.dsl import cute, cutlass
from cutlass.memory import SmemAllocator

from cute_kda.kernels.bwd_scan import BwdScan
from cute_kda.kernels.common.copy import Operand, aligned_smem_tensor, make_fragment, smem_tensor
from cute_kda.kernels.fwd_recurrence import FwdRecurrence
from cute_kda.layouts import fwd_recurrence as layouts
from cute_kda.layouts.analysis import evaluate_layout, run_traced
from cute_kda.layouts.smem import AtomKind, atom_tile, atom_tile_transposed
from cute_kda.numerics import CHUNK
from cute_kda.ops._cache import to_cute_tensor

BF16 = cutlass.BFloat16
STAGES = 3


def _scan_kernel(vsplit: int, dim: int = 128):
    """The band-scan kernel whose warp MMA and copies a V-split uses (Kernel A for V-split 8), at head dim ``dim``."""
    return BwdScan(vsplit=vsplit) if vsplit == 8 else FwdRecurrence(vsplit=vsplit, dim=dim)


class _Case:
    """One probe: ``build()`` the staged layout, the warp's ``tile`` of it (``warp_mode``: the mode a runtime
    warp index slices, None for the whole tile), the copy ``name`` and its fragment ``operand``."""

    def __init__(self, vsplit: int, build, tile: tuple[int, int], warp_mode, name: str, operand: Operand,
                 swizzle_on: str, dim: int = 128):
        self.kernel = _scan_kernel(vsplit, dim)
        self.build, self.tile, self.warp_mode = build, tile, warp_mode
        self.name, self.operand, self.swizzle_on = name, operand, swizzle_on

    def warp_tile(self, tensor, warp):
        if self.warp_mode is None:
            return tensor
        coord = (warp, 0, None) if self.warp_mode == 0 else (0, warp, None)
        return cute.local_tile(tensor, self.tile, coord)

    def ptx(self) -> str:
        case = self
        size = run_traced(lambda: int(cute.cosize(case.build().outer)))

        @cute.struct
        class Storage:
            buf: cute.struct.Align[cute.struct.MemRange[BF16, size], 1024]

        class Probe:
            storage = Storage

            @cute.jit
            def __call__(self, out: cute.Tensor, warp: cutlass.Int32, stage: cutlass.Int32, stream):
                self.kernel(out, warp, stage).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

            @cute.kernel
            def kernel(self, out: cute.Tensor, warp: cutlass.Int32, stage: cutlass.Int32):
                lane = cute.arch.lane_idx()
                storage = SmemAllocator().allocate(self.storage)
                make = aligned_smem_tensor if cutlass.const_expr(case.swizzle_on == "offset") else smem_tensor
                view = case.warp_tile(make(storage.buf.data_ptr(), case.build(), BF16), warp)
                mma = case.kernel.warp_mma()
                tiled = getattr(case.kernel.warp_copies(mma), case.name)
                thr = tiled.get_slice(lane)
                frag = make_fragment(mma, case.operand, BF16, case.tile)
                if cutlass.const_expr(case.name.startswith("stsm")):
                    frag.fill(1.0)
                    cute.copy(tiled, thr.retile(frag), thr.partition_D(view)[(*([None] * 3), stage)])
                else:
                    cute.copy(tiled, thr.partition_S(view)[(*([None] * 3), stage)], thr.retile(frag))
                    words = cute.recast_tensor(frag, cutlass.Uint32)
                    for i in cutlass.range_constexpr(cute.size(words)):
                        out[lane * cute.size(words) + i] = words[i]

        out = to_cute_tensor(torch.zeros(32 * 512, dtype=torch.int32), 16)
        with tempfile.TemporaryDirectory() as dump_dir:  # the kept PTX file goes there, not into the working directory
            compiled = cute.compile(Probe(), out, cutlass.Int32(0), cutlass.Int32(0), cute.runtime.make_fake_stream(),
                                    options=f"--keep-ptx --dump-dir={dump_dir}")
            return compiled.__ptx__

    def expected(self) -> dict:
        """(warp, lane) → the byte address of each row the lane hands its instructions, in issue order."""
        case = self

        def run():
            layout = case.build()
            table = evaluate_layout(layout, 2).bytes
            mma = case.kernel.warp_mma()
            tiled = getattr(case.kernel.warp_copies(mma), case.name)
            ident = cute.make_identity_tensor(tuple(cute.size(layout, mode=[m]) for m in range(3)))
            warps = case.kernel.mma_warps if case.warp_mode is not None else 1
            rows = {}
            for warp in range(warps):
                view = case.warp_tile(ident, warp)
                for lane in range(32):
                    thr = tiled.get_slice(lane)
                    part = thr.partition_D(view) if case.name.startswith("stsm") else thr.partition_S(view)
                    stage1 = part[(*([None] * 3), 1)]
                    # each instruction takes one 8-element row a lane
                    rows[(warp, lane)] = [int(table[tuple(stage1[i])]) for i in range(0, cute.size(stage1), 8)]
            return rows

        return run_traced(run)


def _mismatches(case: _Case) -> int:
    ptx = case.ptx()
    return sum(matrix_addresses(ptx, lane, [0, warp, 1]) != want for (warp, lane), want in case.expected().items())


def _band_case(vsplit: int, kind: AtomKind, name: str, swizzle_on: str, dim: int = 128) -> _Case:
    kernel = _scan_kernel(vsplit, dim)
    band, cols = kernel.v_band, kernel.warp_cols
    if name == "ldsm_b_t":  # Kernel A's dOᵀ: the MN-major face of the band tile, B operand
        return _Case(vsplit, lambda: atom_tile_transposed(kind, CHUNK, band, BF16, STAGES), (cols, CHUNK), 0,
                     name, Operand.B, swizzle_on)
    return _Case(vsplit, lambda: atom_tile(kind, CHUNK, band, BF16, STAGES), (CHUNK, cols), 1, name, Operand.C,
                 swizzle_on, dim)


@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("transposed", [False, True], ids=["kd", "kr_t"])
def test_workspace_operand_views_address_their_bytes(transposed, dim):
    """kd / qd (A operand) and krᵀ (its MN_SW128 face) as K2 and Kernel A read them: element-offset views,
    no warp slice, a runtime stage (``layouts.fwd_recurrence.chunk_operand``); at D = 64 a tile is one atom wide."""
    plan = layouts.RecurrenceSmemPlan(vsplit=1, dim=dim)
    if transposed:
        case = _Case(1, lambda: layouts.chunk_operand_transposed(plan), (dim, CHUNK), None, "ldsm_a_t", Operand.A,
                     "offset", dim)
    else:
        case = _Case(1, lambda: layouts.chunk_operand(plan), (CHUNK, dim), None, "ldsm_a", Operand.A, "offset", dim)
    assert _mismatches(case) == 0


@pytest.mark.parametrize("vsplit,kind,name", [
    (1, AtomKind.K_SW128, "ldsm_c"), (1, AtomKind.K_SW128, "stsm_c"), (1, AtomKind.K_SW128, "ldsm_b_t"),
    (2, AtomKind.K_SW128, "ldsm_c"), (2, AtomKind.K_SW128, "ldsm_b_t"),
    (4, AtomKind.K_SW64, "ldsm_c"), (8, AtomKind.K_SW32, "ldsm_b_t"),
], ids=lambda v: getattr(v, "name", v))
def test_swizzled_band_tiles_through_a_pointer_swizzle(vsplit, kind, name):
    """The band tiles (v, out; dO, dv, du) swizzled, sliced by a runtime warp index, read and written through
    a pointer swizzle: every lane of every warp addresses its row."""
    assert _mismatches(_band_case(vsplit, kind, name, "pointer")) == 0


@pytest.mark.parametrize("vsplit,kind", [(1, AtomKind.K_SW128), (2, AtomKind.K_SW64), (4, AtomKind.K_SW32)],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("name", ["ldsm_c", "stsm_c"])
def test_head_dim_64_band_tiles_through_a_pointer_swizzle(vsplit, kind, name):
    """K2 at D = 64: v and out bands of 64, 32 and 16 columns (4 warps × 16, 4 × 8, 2 × 8) in the swizzle their
    rows fit, every lane of every warp addressing its row through the pointer swizzle."""
    assert layouts.token_atom(layouts.RecurrenceSmemPlan(vsplit=vsplit, dim=64)) == kind
    assert _mismatches(_band_case(vsplit, kind, name, "pointer", dim=64)) == 0


def test_element_offset_swizzle_with_a_runtime_warp_slice():
    """K_SW64 through an element-offset swizzle and a runtime warp slice is addressed right; K_SW128 is not
    (the DSL, nvidia-cutlass-dsl 4.8.1): the reason the band tiles are K_INTER today. If K_SW128 comes out
    right here, the DSL has changed, and band tiles can take element-offset views again."""
    assert _mismatches(_band_case(4, AtomKind.K_SW64, "ldsm_c", "offset")) == 0
    assert _mismatches(_band_case(1, AtomKind.K_SW128, "ldsm_c", "offset")) == 64  # of 4 warps × 32 lanes
