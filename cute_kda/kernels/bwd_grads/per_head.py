"""Kernel B for a per-head gate (GatedDeltaNet: g ``[.., HV]``, ``gate`` "softplus" or "none", grouped value heads
allowed): the plan of docs/numerics.md, "Kernel B for a per-head gate" (K1's ``per_head`` scheme), the phases of
:mod:`.base` with

2. *Recompute K1*: one decay per row, the pair decays E, the bf16 rows q̂, k̂, qd, kd, kr.
4. the pair terms ``bf16(E ⊙ dMqk)``, ``bf16(E ⊙ β·dL)`` in the 16×16 products' place, and the head's pair sums.
5. *Channel products*: dqd, dkd, dkr and the pair terms against q̂, k̂; the per-row channel sums for dγ.
6. *Finish*: one thread per row: dγ from the row sums over the channels and the head's crossing pair sums, then
   the gate backward per (token, head).

dq and dk are written per value head, or, with ``group_sum``, added into a group of two's q/k head by bf16
reductions (:class:`.base.BwdGrads`); larger groups are summed afterwards. Two CTAs per SM
(``cute_kda.layouts.bwd_grads.per_head_smem_budget``).
"""

from __future__ import annotations

from typing import Optional

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute, cutlass
from ...layouts import bwd_grads as plan
from ...layouts.fwd_prepare import chunk_tile, pair_matrix
from ...layouts.smem import CHUNK, square_tile_transposed, sw128_tile_transposed
from ...numerics import LN2
from ..common.copy import Operand, c_row_half, make_fragment
from .base import (
    BwdGrads, GradsInputs, GradsOutputs, GradsScalars, GradsStates, GradsWorkspace, TileLocation, smem_bundle,
)
from .pairs import PairLoads

PerHeadGradsSmem = smem_bundle(
    "PerHeadGradsSmem",
    ("k_hat", "k_hat_t", "q_hat", "q_hat_t", "spans", "a_pairs", "m_pairs", "dmqk_t", "dlb_t", "gate", "decay",
     "prefix", "suffix", "x_w", "y_w"),
    "Shared-memory tensors of one CTA with a per-head gate (``layouts.bwd_grads.per_head_smem_budget``).",
)


class PerHeadBwdGrads(BwdGrads):
    """Kernel B for a per-head gate: ``gate`` "softplus" (raw bf16 g, A_log, dt_bias per head) or "none" (the log
    decay, ``gate_dtype`` bf16 or fp32)."""

    per_head_gate = True
    smem_plan = staticmethod(plan.per_head_smem_budget)
    partner_buffers = plan.PARTNER_BUFFERS["per_head"]

    @cute.jit
    def zero_partials(self, out: GradsOutputs, slot: Int32):
        """A slot that is no tile (varlen bound) still sums to nothing (per-head partials)."""
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.gate != "none"):
            if tidx == 0:
                out.ddt_partial[slot] = Float32(0.0)
                out.dalog_partial[slot] = Float32(0.0)

    def make_smem(self, storage) -> PerHeadGradsSmem:
        tile, tile_t = chunk_tile(self.dim), sw128_tile_transposed(CHUNK, self.dim)
        sq_t = square_tile_transposed()
        pairs, rows, warp_rows = pair_matrix(), plan.row_vector(), plan.warp_rows(self.warps)
        view = self.view
        return PerHeadGradsSmem(
            **self.shared_views(storage, v=storage.v, du=storage.du, kr=storage.kr, state=storage.state,
                                state_grad=storage.state_grad),
            k_hat=view(storage.k_hat, tile), k_hat_t=view(storage.k_hat, tile_t), q_hat=view(storage.q_hat, tile),
            q_hat_t=view(storage.q_hat, tile_t), spans=view(storage.spans, pairs, Float32),
            a_pairs=view(storage.a_pairs, pairs, Float32), m_pairs=view(storage.m_pairs, pairs, Float32),
            dmqk_t=view(storage.dmqk, sq_t), dlb_t=view(storage.dlb, sq_t),
            **{name: view(getattr(storage, name), rows, Float32) for name in ("gate", "decay", "prefix", "suffix")},
            x_w=view(storage.x_w, warp_rows, Float32), y_w=view(storage.y_w, warp_rows, Float32),
        )

    @cute.jit
    def tile_gradients(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
                       out: GradsOutputs, scalars: GradsScalars, tile: TileLocation,
                       pair_loads: Optional[PairLoads] = None):
        tidx, warp_idx, lane, smem, tma_barrier = self.start_tile(tma_tokens, states, tile, pair_loads)
        # 1. the rows' gate inputs and the workspace values, loaded while the TMA runs (all loads out first)
        gate_inputs = self.head_gate_inputs(inputs.g, inputs.a_log, inputs.dt_bias, tile.head, tile.row0,
                                            tile.valid_rows, lane % CHUNK)
        self.load_workspace_rows(smem, ws, tile.slot, tidx)
        if cutlass.const_expr(self.pair_rebuild):
            self.load_partner_decay(smem, pair_loads, tile.pair, tidx)
        # 2. K1's per-head recompute: warp 0 the rows' gate, sums and pair decays; rows past the sequence end of v,
        # dO, du are zeroed
        dt, e_a = Float32(0.0), Float32(1.0)
        if warp_idx == 0:
            dt, e_a = self.head_gate_rows(gate_inputs, tile.valid_rows, smem.gate, smem.decay, smem.spans,
                                          smem.prefix, smem.suffix, lane)
        cute.arch.sync_threads()  # the rows' values; the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)
        if cutlass.const_expr(self.pair_rebuild):  # the matrix of the tile's other end, before phase 2's writes
            self.rebuild_pair_matrix(smem, tile.pair, tidx, warp_idx, lane)
        self.zero_invalid_rows(smem, tile.valid_rows, tidx)
        cute.arch.sync_threads()
        self.decay_per_row(smem.q, smem.k, smem.qd, smem.kd, smem.kr, smem.q_hat, smem.k_hat, smem.prefix, smem.suffix,
                           scalars.scale, tile.valid_rows, tidx, smem.rinv_q, smem.rinv_k)
        cute.arch.sync_threads()

        # 3. forward recompute per value band, 4. the 16×16 products with the pair decays, dgT
        self.forward_and_square_products(smem, tidx, warp_idx, lane, tma_barrier)

        # 5. channel products per key band, 6. finish per row
        self.channel_band(smem, inputs, out, scalars, tile, warp_idx, lane)
        cute.arch.sync_threads()
        if warp_idx == 0:
            self.gate_backward(smem, inputs, out, tile, dt, e_a, lane)
        if tidx < CHUNK:
            self.beta_backward(smem, out, tile.head, tile.row0, tile.valid_rows, tidx)

    @cute.jit
    def weigh_dmqk(self, smem: PerHeadGradsSmem, dmqk: cute.Tensor, coords: cute.Tensor, lane: Int32):
        """``f32(dMqk ⊙ q̂k̂ᵀ)`` into ``m_pairs`` for the head's pair sums, then ``bf16(E ⊙ dMqk)`` in dMqk's place."""
        qk = self.square_product(smem.q_hat, smem.k_hat, lane)
        for i in cutlass.range_constexpr(cute.size(dmqk)):
            row, c = coords[i]
            d_m = dmqk[i].to(Float32)
            smem.m_pairs[row, c] = d_m * qk[i]
            dmqk[i] = (smem.spans[row, c] * d_m).to(BFloat16)  # E is 0 above the diagonal

    @cute.jit
    def dl_pairs(self, smem: PerHeadGradsSmem, coords: cute.Tensor, lane: Int32) -> cute.Tensor:
        """``k̂k̂ᵀ``; :meth:`add_dl_pair` applies the pair decays E."""
        return self.square_product(smem.k_hat, smem.k_hat, lane)

    @cute.jit
    def add_dl_pair(self, smem: PerHeadGradsSmem, dlb: cute.Tensor, row_sum: cute.Tensor, a_kk: cute.Tensor,
                    d_l: Float32, i: int, h: int, row, c):
        """``dL ⊙ (E ⊙ k̂k̂ᵀ)`` into the row's sum, ``f32(bf16(β·dL) ⊙ k̂k̂ᵀ)`` into ``a_pairs`` for the head's pair
        sums, and ``bf16(E ⊙ bf16(β·dL))`` in ``dlb``'s place."""
        span = smem.spans[row, c]
        d_a = dlb[i].to(Float32)
        row_sum[h] = row_sum[h] + d_l * (span * a_kk[i])
        smem.a_pairs[row, c] = d_a * a_kk[i]
        dlb[i] = (span * d_a).to(BFloat16)

    @cute.jit
    def channel_band(self, smem: PerHeadGradsSmem, inputs: GradsInputs, out: GradsOutputs, scalars: GradsScalars,
                     tile: TileLocation, warp_idx: Int32, lane: Int32):
        """Key band of warp ``w`` with a per-head gate: dqd, dkd, dkr; the pair terms ``bf16(E ⊙ dMqk)·k̂`` and
        ``[dP | dPᵀ | dPqᵀ]·[k̂; k̂; q̂]``; the q̂ / k̂ gradients; the per-row channel sums of ``dqd⊙qd + dkd⊙kd``
        and ``dkr⊙kr`` for dγ; then dq, dk (:meth:`store_token_gradients`)."""
        band = self.band
        mma, c0, shape, coords, s_band = self.key_band(smem, warp_idx, lane)
        k_hat_band = cute.local_tile(smem.k_hat_t, (band, CHUNK), (warp_idx, 0))
        q_hat_band = cute.local_tile(smem.q_hat_t, (band, CHUNK), (warp_idx, 0))
        d_qd, d_kd, pair_q = self.zero_fragments(mma, shape, 3)
        self.accumulate(mma, d_qd, smem.do, s_band, False, True, self.k_steps, lane)
        self.accumulate(mma, d_kd, smem.neg_bdu, s_band, False, True, self.k_steps, lane)
        self.accumulate(mma, pair_q, smem.dmqk, k_hat_band, False, True, 1, lane)
        qd = self.load_c(mma, cute.local_tile(smem.qd, shape, (0, warp_idx)), lane)
        kd = self.load_c(mma, cute.local_tile(smem.kd, shape, (0, warp_idx)), lane)
        prefix = self.row_values(smem.prefix, lane)
        suffix = self.row_values(smem.suffix, lane)
        dq_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        x_sum = cute.make_rmem_tensor((2,), Float32)  # rows g and g + 8 of this lane
        y_sum = cute.make_rmem_tensor((2,), Float32)
        x_sum.fill(0.0)
        y_sum.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(d_qd)):
            h = c_row_half(i)
            dq_hat[i] = (pair_q[i] + d_qd[i] * prefix[h]) * scalars.scale
            dk_hat[i] = d_kd[i] * prefix[h]
            x_sum[h] = x_sum[h] + (d_qd[i] * qd[i].to(Float32) + d_kd[i] * kd[i].to(Float32))

        pair_k, d_kr = self.zero_fragments(mma, shape, 2)
        self.accumulate(mma, pair_k, smem.dlb, k_hat_band, False, True, 1, lane)
        self.accumulate(mma, pair_k, smem.dlb_t, k_hat_band, True, True, 1, lane)
        self.accumulate(mma, pair_k, smem.dmqk_t, q_hat_band, True, True, 1, lane)
        self.accumulate(mma, d_kr, smem.u_out, cute.local_tile(smem.state_grad, (band, self.dim), (warp_idx, 0)),
                        False, True, self.k_steps, lane)
        kr = self.load_c(mma, cute.local_tile(smem.kr, shape, (0, warp_idx)), lane)
        for i in cutlass.range_constexpr(cute.size(d_kr)):
            h = c_row_half(i)
            # dk̂ = (pair + dkd·2^G) + dkr·2^Gs, the mirror's order
            dk_hat[i] = (pair_k[i] + dk_hat[i]) + d_kr[i] * suffix[h]
            y_sum[h] = y_sum[h] + d_kr[i] * kr[i].to(Float32)
        self.store_row_partials(smem.x_w, x_sum, warp_idx, lane)
        self.store_row_partials(smem.y_w, y_sum, warp_idx, lane)
        self.store_token_gradients(smem, inputs, out, dq_hat, dk_hat, coords, c0, tile, warp_idx, lane)

    @cute.jit
    def gate_backward(self, smem: PerHeadGradsSmem, inputs: GradsInputs, out: GradsOutputs, tile: TileLocation,
                      dt: Float32, e_a: Float32, lane: Int32):
        """Warp 0, lane ``s`` < 16 a row: ``dγ_s = Σ_{r≥s} X_r + Σ_{r<s} Y_r + gT·Σ_c dgT_c + Σ_{i≥s>j} W_ij``
        (``X``, ``Y`` the channel sums of phase 5 over the warps in warp order; ``W = E ⊙ (dA ⊙ k̂k̂ᵀ + dMqk ⊙ q̂k̂ᵀ)``
        the head's pairs), then ``dg = dγ`` (log decay) or ``dx = −e^A·σ(g + dt_bias)·dγ``; the tile's partial
        sums of ddt_bias (``Σ dx``) and dA_log (``Σ dγ·γ``, ``γ = g'·ln 2``) over its rows, lanes in order.

        Each sum is formed once, not once a lane (perf-log GDN5): lane ``r`` sums row ``r``'s warp partials
        ``X_r``, ``Y_r``, lane ``j`` the suffix sums ``C_j(s) = Σ_{i≥s} W_ij`` of column ``j`` (rows descending), both
        into shared memory (``C_j(s)`` at ``a_pairs[s, j ⊕ s]``: both passes conflict-free); then lane ``s`` adds
        ``X_r`` over ``r ≥ s``, ``Y_r`` over ``r < s`` (rows ascending) and ``C_j(s)`` over ``j < s``."""
        ddt = Float32(0.0)
        dalog = Float32(0.0)
        dgt_sum = Float32(0.0)  # Σ_c dgT_c: 4 channels a lane, then the butterfly (every lane holds the total)
        for part in cutlass.range_constexpr(self.dim // 32):
            dgt_sum = dgt_sum + smem.dgt[lane + 32 * part]
        for offset in (16, 8, 4, 2, 1):
            dgt_sum = dgt_sum + cute.arch.shuffle_sync_bfly(dgt_sum, offset=offset)
        row = lane % CHUNK  # lanes 16-31 mirror 0-15 in the loads and store nothing
        x_r = Float32(0.0)
        y_r = Float32(0.0)
        for w in cutlass.range_constexpr(self.warps):
            x_r = x_r + smem.x_w[w, row]
            y_r = y_r + smem.y_w[w, row]
        column = cute.make_rmem_tensor((CHUNK,), Float32)  # W[i, j = row], 0 where i ≤ j
        for i in cutlass.range_constexpr(1, CHUNK):
            w_ij = smem.spans[i, row] * (smem.a_pairs[i, row] + smem.m_pairs[i, row])
            column[i] = Float32(cutlass.select_(i > row, w_ij, Float32(0.0)))
        cute.arch.sync_warp()  # every lane has read a_pairs, x_w and y_w before any lane writes them
        if lane < CHUNK:
            smem.x_w[0, row] = x_r
            smem.y_w[0, row] = y_r
            suffix = Float32(0.0)
            for i in cutlass.range_constexpr(CHUNK - 1, 0, -1):
                suffix = suffix + column[i]
                smem.a_pairs[i, row ^ i] = suffix  # C_row(i) where i > row; the rest is never read
        cute.arch.sync_warp()
        if lane < CHUNK:
            s = lane
            from_s = Float32(0.0)
            before_s = Float32(0.0)
            for r in cutlass.range_constexpr(CHUNK):
                from_s = from_s + Float32(cutlass.select_(r >= s, smem.x_w[0, r], Float32(0.0)))
                before_s = before_s + Float32(cutlass.select_(r < s, smem.y_w[0, r], Float32(0.0)))
            pairs = Float32(0.0)
            for j in cutlass.range_constexpr(CHUNK - 1):
                pairs = pairs + Float32(cutlass.select_(j < s, smem.a_pairs[s, s ^ j], Float32(0.0)))
            dgamma = ((from_s + before_s) + smem.prefix[CHUNK - 1] * dgt_sum) + pairs
            if s < tile.valid_rows:
                dg = dgamma
                if cutlass.const_expr(self.gate == "softplus"):
                    dg = self.softplus_gate_grad(inputs.g[tile.row0 + s, tile.head].to(Float32), dt, e_a, dgamma)
                    ddt = dg
                    dalog = dgamma * (smem.gate[s] * Float32(LN2))
                out.dg[tile.row0 + s, tile.head] = dg
        if cutlass.const_expr(self.gate == "softplus"):
            for offset in (16, 8, 4, 2, 1):
                ddt = ddt + cute.arch.shuffle_sync_bfly(ddt, offset=offset)
                dalog = dalog + cute.arch.shuffle_sync_bfly(dalog, offset=offset)
            if lane == 0:
                out.ddt_partial[tile.slot] = ddt
                out.dalog_partial[tile.slot] = dalog
