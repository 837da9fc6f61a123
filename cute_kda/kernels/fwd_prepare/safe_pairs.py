"""K1 for the safe gate, a pair of tiles a CTA: the workspace of the two-tile serial step (docs/numerics.md, "Two
tiles a serial step"; the mirror is ``cute_kda.reference.pairs.mirror_prepare_pairs``).

Pairs and threads as :mod:`.pairs` (a lone last tile gets today's fields: tile b's exponents are then 0 and add
nothing); one channel of one tile a thread in the gate scan:

1. *Load.* Warp 0 TMA-loads q, k, g of both tiles behind one transaction barrier (its phase ``phase``: a CTA may
   do two pairs, :mod:`.pairs`); threads 0-15 compute tile a's β, 16-31 tile b's.
2. *Gate scans.* Threads 0 … D−1 scan tile a's channels, D … 2D−1 tile b's; then ``gT_b = 2^G_b,last`` and tile a
   takes the pair's decay ``2^f32(G_a,last + G_b,last)``.
3. *Decay.* Tile a's qd, kd, kinv as today and kr measured to the pair's end; then, behind a barrier, tile b's
   tile-relative qd, kd, kinv, kr and its qd', kd' measured from the pair's start, written over tile a's gate
   cumsum (:meth:`~cute_kda.kernels.common.token_prep.TokenPrep.decay`; the plan is
   ``layouts.fwd_prepare.pair_smem_budget``).
4. *Finish*, eight warp tasks: INV and Mqk of each tile from its tile-relative operands, the cross blocks
   ``P = kd_b'·kinv_aᵀ`` and ``Q = qd_b'·kinv_aᵀ`` (to tile b's slot), the TMA stores of each tile's qd, kd, kr
   (tile b's qd', kd'). Nothing of tile b is written when the pair has none.
"""

from __future__ import annotations

from cutlass import Int32

from ...dsl import cute
from ...layouts import fwd_prepare as plan
from ...layouts.smem import CHUNK
from ..common.fastmath import ex2_approx
from .base import PrepareInputs, PrepareScalars, PrepareTma, WorkspaceTiles
from .pairs import PairOperands, PairPrepare
from .safe import SafePrepare


class SafePairPrepare(PairPrepare, SafePrepare):
    """The safe gate's K1 over pairs of tiles (module docstring): ``2 · dim`` threads, the workspace plus the cross
    blocks (``WorkspaceTiles.cross_kd``, ``cross_qd``)."""

    smem_plan = staticmethod(plan.pair_smem_budget)

    @cute.jit
    def prepare_pair(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles, scalars: PrepareScalars,
                     head: Int32, qk_head: Int32, slot: Int32, row0: Int32, valid_a: Int32, valid_b: Int32,
                     storage, phase: Int32):
        """The safe gate's phases (module docstring) of one pair (:class:`~.pairs.PairPrepare`'s ``prepare_pair``)."""
        tidx, warp_idx, lane, storage, tile_layout = self.start_tile(storage)
        shared = storage.cumsum_a_then_pair  # G_a, then tile b's pair-relative qd', kd'
        s_q_a, s_k_a, s_g_a, s_kinv_a, s_q_b, s_k_b, s_g_b, s_kinv_b, s_qd_pair, s_kd_pair = self.swizzled_views(
            tile_layout, storage.q_a, storage.k_a, storage.g_a, storage.kinv_a, storage.q_b, storage.k_b,
            storage.g_b, storage.kinv_b, shared.pair_tiles.qd_pair, shared.pair_tiles.kd_pair)
        q_a_in, k_a_in, g_a_in, q_b_in, k_b_in, g_b_in = self.input_views(
            tile_layout, storage.q_a, storage.k_a, storage.g_a, storage.q_b, storage.k_b, storage.g_b)
        s_cumsum_a, s_cumsum_b = self.swizzled_views(plan.gate_cumsum_tile(self.dim), shared.gate_cumsum_a,
                                                     storage.gate_cumsum_b)
        s_beta_a, s_beta_b = self.row_views(storage.beta_a, storage.beta_b)
        tma_barrier = storage.tma_barrier.data_ptr()
        slot_b, row_b = slot + 1, row0 + CHUNK
        has_b = valid_b > 0

        if warp_idx == 0:
            self.load_inputs(((tma.q, q_a_in, qk_head, row0), (tma.k, k_a_in, qk_head, row0),
                              (tma.g, g_a_in, head, row0), (tma.q, q_b_in, qk_head, row_b),
                              (tma.k, k_b_in, qk_head, row_b), (tma.g, g_b_in, head, row_b)), tma_barrier,
                             init=False)
        col = tidx % self.dim
        dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, head, col)
        if tidx < CHUNK:
            self.activate_beta(inputs.beta, ws.beta, s_beta_a, head, slot, row0, valid_a, tidx)
        elif tidx < 2 * CHUNK:
            if has_b:
                self.activate_beta(inputs.beta, ws.beta, s_beta_b, head, slot_b, row_b, valid_b, tidx - CHUNK)
        cute.arch.mbarrier_wait(tma_barrier, phase)

        if tidx < self.dim:
            self.gate_scan(g_a_in, s_cumsum_a, col, dt, e_a, scalars.c_gate, valid_a)
        else:
            last_b = self.gate_scan(g_b_in, s_cumsum_b, col, dt, e_a, scalars.c_gate, valid_b)
            if has_b:
                ws.gt[slot_b, col] = ex2_approx(last_b)
        cute.arch.sync_threads()
        if tidx < self.dim:  # the pair's decay (tile b's G_last is 0 without a tile b: today's gT)
            ws.gt[slot, col] = ex2_approx(s_cumsum_a[CHUNK - 1, col] + s_cumsum_b[CHUNK - 1, col])
        self.decay(q_a_in, k_a_in, s_cumsum_a, s_q_a, s_k_a, s_g_a, s_kinv_a, scalars.scale, valid_a, tidx,
                   s_cumsum_next=s_cumsum_b)
        a_last = self.pair_start_sums(s_cumsum_a, tidx)
        cute.arch.sync_threads()  # every read of G_a done: tile b's qd', kd' go over it
        self.decay(q_b_in, k_b_in, s_cumsum_b, s_q_b, s_k_b, s_g_b, s_kinv_b, scalars.scale, valid_b, tidx,
                   pair_start=(a_last, s_qd_pair, s_kd_pair))
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()

        tiles = (PairOperands(s_k_a, s_q_a, s_kinv_a, None, s_beta_a, (s_q_a, s_k_a, s_g_a)),
                 PairOperands(s_k_b, s_q_b, s_kinv_b, None, s_beta_b, (s_qd_pair, s_kd_pair, s_g_b)))
        cross = PairOperands(s_kd_pair, s_qd_pair, s_kinv_a, None)
        self.finish_pair(tma, ws, tiles, cross, slot, has_b, warp_idx, lane)
