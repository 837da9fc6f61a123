"""What K1's pair variants share (docs/numerics.md, "Two tiles a serial step"): tiles pair up from each sequence's
first tile, and a sequence's odd last tile is a pair without tile b. A CTA owns a window of two workspace slots of a
head and does the pairs whose tile a lies in it: one, or two where a sequence's lone last tile is followed by the next
sequence's first pair (the second reuses the shared memory and the TMA barrier's next phase). ``2 · D`` threads: one
row chunk of each tile a thread in the decay phase. A scheme's pair class puts :class:`PairPrepare` before its
scheme's class and provides ``prepare_pair(tma, inputs, ws, scalars, head, qk_head, slot, row0, valid_a, valid_b,
storage, phase)``: the pair whose tile a is in workspace slot ``slot`` (tile b in ``slot + 1``) and starts at token
row ``row0``, ``valid_b`` 0 without a tile b, in the CTA's shared ``storage``, its loads the barrier's phase
``phase`` (the barrier initialised).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute, cutlass
from ...layouts import fwd_prepare as plan
from ...layouts.smem import CHUNK, HEAD_DIM
from ..common.copy import warp_tiled_mma
from .base import PrepareInputs, PrepareScalars, PrepareTma, WorkspaceTiles

WINDOW = 2  # workspace slots a CTA: the pairs starting in them, one or two (module docstring), two traced bodies

# the finish, one warp task each: (what, tile 0 = a / 1 = b); warp w takes tasks w, w + warps, …
FINISH_TASKS = (("inv", 0), ("inv", 1), ("mqk", 0), ("mqk", 1), ("cross_kd", 1), ("cross_qd", 1), ("stores", 0),
                ("stores", 1))


class PairOperands(NamedTuple):
    """What the finish reads of one tile (or of the cross blocks): the left factors of ``A_kk`` (P) and ``A_qk`` (Q),
    their right factor, the pair decays the scheme multiplies the products by (None: none), β (the tiles'), and the
    qd, kd, kr tiles the workspace takes (the tiles')."""

    left_k: cute.Tensor
    left_q: cute.Tensor
    right: cute.Tensor
    spans: Optional[cute.Tensor]
    beta: Optional[cute.Tensor] = None
    stores: tuple = ()


class PairPrepare:
    """Mixin of a pair variant of K1 (module docstring), before the scheme's :class:`~.base.PrepareKernel` class."""

    thread_counts = (2 * HEAD_DIM, HEAD_DIM)

    def __init__(self, *, dim: int = HEAD_DIM, num_threads: Optional[int] = None, ctas_per_sm: Optional[int] = None,
                 **config) -> None:
        threads = 2 * dim
        if num_threads not in (None, threads):
            raise ValueError(f"the pair K1 runs 2 · dim = {threads} threads, got {num_threads}")
        self.default_ctas_per_sm = min(self.smem_plan(dim).ctas_per_sm, plan.PAIR_CTAS_PER_SM[dim])
        super().__init__(dim=dim, num_threads=threads, ctas_per_sm=ctas_per_sm, **config)

    def grid_slots(self, tiles):
        """A CTA a window of two slots (module docstring)."""
        return (tiles + WINDOW - 1) // WINDOW

    @cute.kernel
    def kernel(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles, scalars: PrepareScalars,
               cu_seqlens: Optional[cute.Tensor], tile_base: Optional[cute.Tensor]):
        window, head, _ = cute.arch.block_idx()
        _, heads, _ = cute.arch.grid_dim()
        tiles = ws.gt.shape[0] // heads
        qk_head = head
        if cutlass.const_expr(self.grouped):
            qk_head = head // (heads // inputs.q.shape[1])
        _, warp_idx, _, storage, _ = self.start_tile()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(storage.tma_barrier.data_ptr(), 1)
                cute.arch.mbarrier_init_fence()
        phase = Int32(0)
        positions = self.two_tile_positions(WINDOW * window, scalars.seq_len, cu_seqlens, tile_base)
        # unrolled: as a runtime loop ptxas spills ≈ 220 bytes at the 64 registers of four CTAs an SM
        for step in cutlass.range_constexpr(WINDOW):
            tile_slot = WINDOW * window + step
            _, tile_in_seq, row0, seq_end, exists = positions[step]
            if exists and tile_slot < tiles and tile_in_seq % 2 == 0:
                cute.arch.sync_threads()  # the barrier initialised; the window's previous pair done with its smem
                rows_left = seq_end - row0
                valid_b = cutlass.max(cutlass.min(rows_left - CHUNK, CHUNK), 0)
                self.prepare_pair(tma, inputs, ws, scalars, head, qk_head, head * tiles + tile_slot, row0,
                                  cutlass.min(rows_left, CHUNK), valid_b, storage, phase)
                phase = phase ^ 1

    @cute.jit
    def finish_pair(self, tma: PrepareTma, ws: WorkspaceTiles, tiles: tuple, cross: PairOperands, slot: Int32,
                    has_b, warp_idx: Int32, lane: Int32):
        """The :data:`FINISH_TASKS` on the warps (``tiles``: tile a's and tile b's :class:`PairOperands`): INV and
        Mqk of each tile, the cross blocks P and Q into tile b's slot, each tile's TMA stores. Nothing of tile b
        without ``has_b``."""
        warps = self.num_threads // 32
        for task in cutlass.range_constexpr(len(FINISH_TASKS)):
            what, tile = FINISH_TASKS[task]
            if warp_idx == task % warps:
                if cutlass.const_expr(tile == 0):
                    self.finish_task(what, tma, ws, tiles[0], cross, slot, lane)
                else:
                    if has_b:
                        self.finish_task(what, tma, ws, tiles[1], cross, slot + 1, lane)

    def finish_task(self, what: str, tma: PrepareTma, ws: WorkspaceTiles, tile: PairOperands, cross: PairOperands,
                    slot: Int32, lane: Int32):
        """One of :data:`FINISH_TASKS` for the tile in workspace slot ``slot`` (traced inline: ``what`` picks the
        code)."""
        if cutlass.const_expr(what == "inv"):
            self.lower_inverse(self.pair_product(tile.left_k, tile.right, tile.spans, lane), tile.beta, ws.inv, slot,
                               lane)
        if cutlass.const_expr(what == "mqk"):
            self.store_mqk(self.pair_product(tile.left_q, tile.right, tile.spans, lane), ws.mqk, slot, lane)
        if cutlass.const_expr(what in ("cross_kd", "cross_qd")):
            left = cross.left_k if cutlass.const_expr(what == "cross_kd") else cross.left_q
            block = self.pair_product(left, cross.right, cross.spans, lane, causal=False)
            self.store_mqk(block, getattr(ws, what), slot, lane, causal=False)
        if cutlass.const_expr(what == "stores"):
            self.store_tiles(tma, *tile.stores, slot)

    @cute.jit
    def pair_product(self, s_left, s_right, s_spans, lane: Int32, causal: bool = True) -> cute.Tensor:
        """``left · rightᵀ`` (fp32 C fragment), times the pair decays ``s_spans`` element by element where the scheme
        has them (the per-head gate's; on and below the diagonal when ``causal``)."""
        product = self.tile_product(warp_tiled_mma(BFloat16, Float32), s_left, s_right, lane)
        if cutlass.const_expr(s_spans is not None):
            product = self.spanned(product, s_spans, lane, causal)
        return product
