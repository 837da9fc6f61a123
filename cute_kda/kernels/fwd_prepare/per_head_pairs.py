"""K1 for a per-head gate (GatedDeltaNet), a pair of tiles a CTA: the workspace of the two-tile serial step
(docs/numerics.md, "Two tiles a serial step"; the mirror is ``cute_kda.reference.pairs.mirror_prepare_pairs_per_head``).

Pairs and threads as :mod:`.pairs`. The scheme is :class:`~.per_head.PerHeadPrepare`'s, one decay a row, so the pair
needs no exponent: tile b's rows are measured from the pair's start by ``f32(gT_a · 2^G_b)``, tile a's kr to the
pair's end by ``f32(2^Gs_a · gT_b)``, and the cross blocks are
``bf16(f32(f32(2^G_b[i] · 2^Gs_a[j]) · (k̂_b·k̂_aᵀ)[i, j]))`` (``q̂_b`` for Q):

1. Warp 0 TMA-loads q, k of both tiles; warp 0 forms tile a's rows (β, ``g'``, E, ``2^G``, ``2^Gs``), warp 1 tile
   b's (:meth:`~cute_kda.kernels.common.token_prep.TokenPrep.head_gate_rows`).
2. Threads 0-15 and 16-31 the rows' factors across the pair, the others the cross decays; both tiles' gT.
3. Rows (one row chunk of each tile a thread): l2norm, qd, kd, kr and the bf16 rows q̂, k̂; with the pair partners'
   fields (``WorkspaceTiles.partner_*``, :class:`cute_kda.workspace.PartnerFields`) also tile b's qd, kd and tile a's kr
   on the tiles' own row factors, stored from registers, and both tiles' gT.
4. Eight warp tasks: INV and Mqk of each tile, P, Q, and each tile's TMA stores.
"""

from __future__ import annotations

from cutlass import Int32

from ...dsl import cute, cutlass
from ...layouts import fwd_prepare as plan
from ...layouts.smem import CHUNK
from .base import PrepareInputs, PrepareScalars, PrepareTma, WorkspaceTiles
from .pairs import PairOperands, PairPrepare
from .per_head import PerHeadPrepare


class PerHeadPairPrepare(PairPrepare, PerHeadPrepare):
    """The per-head gate's K1 over pairs of tiles (module docstring): ``2 · dim`` threads, the workspace plus the
    cross blocks."""

    smem_plan = staticmethod(plan.per_head_pair_smem_budget)

    @cute.jit
    def prepare_pair(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles, scalars: PrepareScalars,
                     head: Int32, qk_head: Int32, slot: Int32, row0: Int32, valid_a: Int32, valid_b: Int32,
                     storage, phase: Int32):
        """The per-head gate's phases (module docstring) of one pair (``PairPrepare``'s ``prepare_pair``)."""
        tidx, warp_idx, lane, storage, tile_layout = self.start_tile(storage)
        s = storage
        q_a_in, k_a_in, q_b_in, k_b_in = self.input_views(tile_layout, s.q_a, s.k_a, s.q_b, s.k_b)
        s_q_a, s_k_a, s_kr_a, s_q_hat_a, s_k_hat_a, s_q_b, s_k_b, s_kr_b, s_q_hat_b, s_k_hat_b = self.swizzled_views(
            tile_layout, s.q_a, s.k_a, s.kr_a, s.q_hat_a, s.k_hat_a, s.q_b, s.k_b, s.kr_b, s.q_hat_b, s.k_hat_b)
        s_spans_a, s_spans_b, s_cross = (buffer.get_tensor(plan.pair_matrix())
                                         for buffer in (s.spans_a, s.spans_b, s.cross_spans))
        rows_a = self.row_views(s.beta_a, s.gate_a, s.decay_a, s.prefix_decay_a, s.suffix_decay_a)
        rows_b = self.row_views(s.beta_b, s.gate_b, s.decay_b, s.prefix_decay_b, s.suffix_decay_b)
        s_to_end, s_from_start = self.row_views(s.suffix_to_pair_end, s.prefix_from_pair_start)
        tma_barrier = s.tma_barrier.data_ptr()
        slot_b, row_b = slot + 1, row0 + CHUNK
        has_b = valid_b > 0

        if warp_idx == 0:
            self.load_inputs(((tma.q, q_a_in, qk_head, row0), (tma.k, k_a_in, qk_head, row0),
                              (tma.q, q_b_in, qk_head, row_b), (tma.k, k_b_in, qk_head, row_b)), tma_barrier,
                             init=False)
        # warp 0 the rows of tile a, warp 1 those of tile b; without a tile b its loads read tile a's rows (in
        # bounds) and every row of it is masked
        if warp_idx < 2:
            tile_b = warp_idx == 1
            first = cutlass.select_(tile_b, cutlass.select_(has_b, row_b, row0), row0)
            valid = cutlass.select_(tile_b, valid_b, valid_a)
            loaded = cutlass.max(valid, 1)
            row = lane % CHUNK
            gate_inputs = self.head_gate_inputs(inputs.g, inputs.a_log, inputs.dt_bias, head, first, loaded, row)
            beta_raw = inputs.beta[first + cutlass.min(row, loaded - 1), head]
            if warp_idx == 0:
                if lane < CHUNK:
                    self.activate_beta(inputs.beta, ws.beta, rows_a[0], head, slot, row0, valid_a, row, raw=beta_raw)
                self.head_gate_rows(gate_inputs, valid_a, *rows_a[1:3], s_spans_a, *rows_a[3:], lane)
            else:
                if lane < CHUNK:
                    if has_b:
                        self.activate_beta(inputs.beta, ws.beta, rows_b[0], head, slot_b, row_b, valid_b, row,
                                           raw=beta_raw)
                self.head_gate_rows(gate_inputs, valid_b, *rows_b[1:3], s_spans_b, *rows_b[3:], lane)
        cute.arch.sync_threads()  # the rows' values

        prefix_a, suffix_a, prefix_b, suffix_b = rows_a[3], rows_a[4], rows_b[3], rows_b[4]
        gt_a, gt_b = prefix_a[CHUNK - 1], prefix_b[CHUNK - 1]  # 1 without a tile b: today's fields
        if tidx < CHUNK:
            s_to_end[tidx] = suffix_a[tidx] * gt_b
        elif tidx < 2 * CHUNK:
            s_from_start[tidx - CHUNK] = gt_a * prefix_b[tidx - CHUNK]
        for entry in cutlass.range_constexpr(CHUNK * CHUNK // self.num_threads):
            flat = tidx + entry * self.num_threads
            i, j = flat // CHUNK, flat % CHUNK
            s_cross[i, j] = prefix_b[i] * suffix_a[j]
        channel = tidx % self.dim
        partners = cutlass.const_expr(ws.partner_gt is not None)
        if tidx < self.dim:
            ws.gt[slot, channel] = gt_a * gt_b
            if cutlass.const_expr(partners):
                ws.partner_gt[slot, channel] = gt_a
        elif has_b:
            ws.gt[slot_b, channel] = gt_b
            if cutlass.const_expr(partners):
                ws.partner_gt[slot_b, channel] = gt_b
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(tma_barrier, phase)
        partner_a = partner_b = None
        if cutlass.const_expr(partners):  # the tiles' own factors: tile a's kr, tile b's qd and kd (PartnerFields)
            partner_a = (None, None, self.slot_tile(ws.partner_kr, slot), prefix_a, suffix_a, True)
            partner_b = (self.slot_tile(ws.partner_qd, slot_b), self.slot_tile(ws.partner_kd, slot_b), None, prefix_b,
                         suffix_b, has_b)
        self.decay_per_row(q_a_in, k_a_in, s_q_a, s_k_a, s_kr_a, s_q_hat_a, s_k_hat_a, prefix_a, s_to_end,
                           scalars.scale, valid_a, tidx, tile_relative=partner_a)
        self.decay_per_row(q_b_in, k_b_in, s_q_b, s_k_b, s_kr_b, s_q_hat_b, s_k_hat_b, s_from_start, suffix_b,
                           scalars.scale, valid_b, tidx, tile_relative=partner_b)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()

        tiles = (PairOperands(s_k_hat_a, s_q_hat_a, s_k_hat_a, s_spans_a, rows_a[0], (s_q_a, s_k_a, s_kr_a)),
                 PairOperands(s_k_hat_b, s_q_hat_b, s_k_hat_b, s_spans_b, rows_b[0], (s_q_b, s_k_b, s_kr_b)))
        cross = PairOperands(s_k_hat_b, s_q_hat_b, s_k_hat_a, s_cross)
        self.finish_pair(tma, ws, tiles, cross, slot, has_b, warp_idx, lane)

    def slot_tile(self, field: cute.Tensor, slot: Int32) -> cute.Tensor:
        """The ``[16, D]`` tile of workspace slot ``slot`` in a ``[R·16, 1, D]`` field."""
        return cute.local_tile(field[None, 0, None], (CHUNK, self.dim), (slot, 0))
