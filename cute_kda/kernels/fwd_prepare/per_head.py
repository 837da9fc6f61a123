"""K1 for a per-head gate (GatedDeltaNet: g ``[.., HV]``, dt_bias ``[HV]``, ``gate`` "softplus" or "none"): one
decay per head broadcast over the channels, computed by the scheme ``per_head`` of docs/numerics.md ("Unbounded
gates"), one thread per channel (128 threads; at D = 64 threads 64-127 own none), eight CTAs per SM
(``cute_kda.layouts.fwd_prepare.per_head_smem_budget``).
"""

from __future__ import annotations

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute, cutlass
from ...layouts import fwd_prepare as plan
from ...layouts.smem import CHUNK
from ..common.copy import WARP_TILE, Operand, make_fragment, warp_tiled_mma
from .base import PrepareInputs, PrepareKernel, PrepareScalars, PrepareTma, WorkspaceTiles


class PerHeadPrepare(PrepareKernel):
    """K1 for a per-head gate."""

    per_head_gate = True
    default_ctas_per_sm = plan.PER_HEAD_CTAS_PER_SM
    smem_plan = staticmethod(plan.per_head_smem_budget)

    @cute.jit
    def prepare_tile(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles, scalars: PrepareScalars,
                     head: Int32, qk_head: Int32, slot: Int32, row0: Int32, valid_rows: Int32):
        """One tile with one decay per row (the head's), scheme ``per_head``: no per-channel decay exists, so
        ``A = E ⊙ (bf16(kh)·bf16(kh)ᵀ)`` and ``A_qk = E ⊙ (bf16(qh)·bf16(kh)ᵀ)`` with the tile's 16 × 16 pair
        decays ``E[i, j] = a_{j+1}·…·a_i`` (each ≤ 1: nothing overflows for any gate value).

        1. Warp 0 TMA-loads q and k; every thread loads its row's β and gate inputs (row ``lane % 16``).
        2. Warp 0, lane r < 16 row r: β, ``g'``, ``a = 2^g'``; then column r of E, ``E[i, r] = f32(E[i−1, r]·a_i)``
           down the rows, and the row's ``2^G``, ``2^Gs`` from its prefix and suffix sums in row order
           (:meth:`~cute_kda.kernels.common.token_prep.TokenPrep.head_gate_rows`).
        3. Rows, 16 lanes a row (as :meth:`decay`): l2norm, then qd, kd, kr and the bf16 rows ``q̂``, ``k̂``.
        4. Warp 0: ``A_kk`` and INV; warp 1: Mqk; warp 2: TMA stores of qd, kd, kr.
        """
        tidx, warp_idx, lane, storage, tile_layout = self.start_tile()
        s_q, s_k, s_kr, s_q_hat, s_k_hat = self.swizzled_views(tile_layout, storage.q, storage.k, storage.kr,
                                                               storage.q_hat, storage.k_hat)
        q_in, k_in = self.input_views(tile_layout, storage.q, storage.k)
        s_spans = storage.spans.get_tensor(plan.pair_matrix())
        s_beta, s_gate, s_decay, s_prefix, s_suffix = self.row_views(storage.beta, storage.gate, storage.decay,
                                                                     storage.prefix_decay, storage.suffix_decay)
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_inputs(((tma.q, q_in, qk_head, row0), (tma.k, k_in, qk_head, row0)), tma_barrier)
        # the rows' β and gate inputs, loaded by every thread (in bounds, no branch) so that they go out together
        row = lane % CHUNK
        gate_inputs = self.head_gate_inputs(inputs.g, inputs.a_log, inputs.dt_bias, head, row0, valid_rows, row)
        beta_raw = inputs.beta[row0 + cutlass.min(row, valid_rows - 1), head]
        if warp_idx == 0:
            if lane < CHUNK:
                self.activate_beta(inputs.beta, ws.beta, s_beta, head, slot, row0, valid_rows, row, raw=beta_raw)
            self.head_gate_rows(gate_inputs, valid_rows, s_gate, s_decay, s_spans, s_prefix, s_suffix, lane)
        cute.arch.sync_threads()  # the rows' values; the barrier is initialised before anyone waits on it
        ws.gt[slot, self.channel_of(tidx)] = s_prefix[CHUNK - 1]  # past D: the same value again, no branch
        cute.arch.mbarrier_wait(tma_barrier, 0)
        self.decay_per_row(q_in, k_in, s_q, s_k, s_kr, s_q_hat, s_k_hat, s_prefix, s_suffix, scalars.scale, valid_rows,
                           tidx)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()

        if warp_idx == self.kkt_warp:
            mma_bf16 = warp_tiled_mma(BFloat16, Float32)
            a_kk = self.spanned(self.tile_product(mma_bf16, s_k_hat, s_k_hat, lane), s_spans, lane)
            self.lower_inverse(a_kk, s_beta, ws.inv, slot, lane)
        elif warp_idx == self.qk_warp:
            mma_bf16 = warp_tiled_mma(BFloat16, Float32)
            a_qk = self.spanned(self.tile_product(mma_bf16, s_q_hat, s_k_hat, lane), s_spans, lane)
            self.store_mqk(a_qk, ws.mqk, slot, lane)
        elif warp_idx == self.store_warp:
            self.store_tiles(tma, s_q, s_k, s_kr, slot)

    @cute.jit
    def spanned(self, product: cute.Tensor, s_spans, lane: Int32, causal: bool = True) -> cute.Tensor:
        """``E ⊙ product`` on and below the diagonal (fp32 C fragment; above it 0); without ``causal`` everywhere (a
        pair's cross blocks)."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        coords = mma_bf16.get_slice(lane).partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        out = make_fragment(mma_bf16, Operand.C, Float32)
        for i in cutlass.range_constexpr(cute.size(product)):
            row, col = coords[i]
            if cutlass.const_expr(causal):
                value = Float32(0.0)
                if row >= col:
                    value = product[i] * s_spans[row, col]
                out[i] = value
            else:
                out[i] = product[i] * s_spans[row, col]
        return out
