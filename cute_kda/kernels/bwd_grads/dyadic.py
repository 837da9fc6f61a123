"""Kernel B for the per-channel unbounded gates (``gate`` "softplus" or "none" with a per-channel g): the first
form of docs/numerics.md, "Kernel B for the per-channel unbounded gates" (K1's ``dyadic`` scheme), the phases of
:mod:`.base` with

2. *Recompute K1*: the rows' l2norm scales, K1's dyadic scan per channel (qd, kd, kr, ``2^G``, ``2^Gs``, and per
   straddle level the factors and the operands X, Q, unpacked) and K1's A level by level.
4. after the 16×16 products, each level's masked ``dA`` and ``dMqk``.
5. *Channel products*: the state products dqd, dkd, dkr, then three 16 × 16 × D products per level against X and
   Q in place of the kinv products.
6. *Finish*: dγ per channel from the levels' straddle sums and the rows' terms, then the gate backward.

One CTA per SM (``cute_kda.layouts.bwd_grads.dyadic_smem_budget``).
"""

from __future__ import annotations

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute, cutlass
from ...layouts import bwd_grads as plan
from ...layouts.fwd_prepare import chunk_tile, gate_cumsum_tile, pair_matrix
from ...layouts.smem import CHUNK, square_tile, square_tile_transposed, sw128_tile_transposed
from ...numerics import DYADIC_BLOCKS, LN2
from ..common.copy import Operand, c_row_half, make_fragment, warp_tiled_mma
from .base import (
    BwdGrads, GradsInputs, GradsOutputs, GradsScalars, GradsStates, GradsWorkspace, TileLocation, smem_bundle,
)

DyadicGradsSmem = smem_bundle(
    "DyadicGradsSmem",
    ("level_x", "level_x_t", "level_q", "level_q_t", "factors", "pow_g", "pow_gs", "level_sums", "row_x", "row_y",
     "a_kk", "masked_dlb", "masked_dlb_t", "masked_dmqk", "masked_dmqk_t", "dalog_w"),
    "Shared-memory tensors of one CTA with a per-channel unbounded gate (``layouts.bwd_grads.dyadic_smem_budget``); "
    "the per-level fields are tuples over the straddle levels, ``level_sums`` over S's bytes and ``row_x``, "
    "``row_y`` over dS''s (after the state products).",
)


class UnpackedLevels:
    """Where Kernel B puts channel ``col`` of :meth:`~.common.token_prep.TokenPrep.dyadic_channel_scan` (K1's scan,
    the same instructions): qd, kd over q, k; kr; ``2^G`` and ``2^Gs``; per level the fp32 factors and the bf16
    operands ``X = kh ⊙ factor`` (every row) and ``Q = qh ⊙ factor`` (upper rows, 0 on lower ones), unpacked: row
    r of a level's tile is row r."""

    def __init__(self, smem: DyadicGradsSmem, col: Int32, scale: Float32, qk_l2norm: bool) -> None:
        self.smem, self.col, self.scale, self.qk_l2norm = smem, col, scale, qk_l2norm

    def q(self, row: int):
        return self.smem.q[row, self.col]

    def k(self, row: int):
        return self.smem.k[row, self.col]

    def q_scale(self, row: int):
        return self.smem.rinv_q[row] * self.scale if self.qk_l2norm else self.scale

    def k_scale(self, row: int):
        return self.smem.rinv_k[row]

    def suffix(self, row: int, kh: Float32, growth: Float32) -> None:
        self.smem.pow_gs[row, self.col] = growth
        self.smem.kr[row, self.col] = (kh * growth).to(BFloat16)

    def prefix(self, row: int, qh: Float32, kh: Float32, decay: Float32) -> None:
        self.smem.pow_g[row, self.col] = decay
        self.smem.qd[row, self.col] = (qh * decay).to(BFloat16)
        self.smem.kd[row, self.col] = (kh * decay).to(BFloat16)

    def lower(self, level: int, start: int, row: int, factor: Float32, kh: Float32) -> None:
        self.smem.factors[level][row, self.col] = factor
        self.smem.level_x[level][row, self.col] = (kh * factor).to(BFloat16)
        self.smem.level_q[level][row, self.col] = BFloat16(0.0)

    def upper(self, level: int, start: int, row: int, factor: Float32, kh: Float32, qh: Float32) -> None:
        self.smem.factors[level][row, self.col] = factor
        self.smem.level_x[level][row, self.col] = (kh * factor).to(BFloat16)
        self.smem.level_q[level][row, self.col] = (qh * factor).to(BFloat16)



class DyadicBwdGrads(BwdGrads):
    """Kernel B for the per-channel unbounded gates: ``gate`` "softplus" (Kimi-Linear-48B's; raw bf16 g, A_log,
    dt_bias) or "none" (a per-channel log decay, ``gate_dtype`` bf16 or fp32); ``grouped`` value heads allowed."""

    ctas_per_sm = plan.DYADIC_CTAS_PER_SM
    smem_plan = staticmethod(plan.dyadic_smem_budget)

    def make_smem(self, storage) -> DyadicGradsSmem:
        tile, tile_t = chunk_tile(self.dim), sw128_tile_transposed(CHUNK, self.dim)
        fp32 = gate_cumsum_tile(self.dim)
        sq, sq_t = square_tile(), square_tile_transposed()
        view = self.view

        def per_level(prefix: str, layout, dtype=BFloat16, group=storage) -> tuple:
            return tuple(view(getattr(group, f"{prefix}{ell}"), layout, dtype) for ell in range(plan.DYADIC_LEVELS))

        state_space = storage.state_then_level_sums
        grad_space = storage.state_grad_then_row_terms
        return DyadicGradsSmem(
            **self.shared_views(storage, v=storage.v, du=storage.du, kr=storage.kr, state=state_space.state,
                                state_grad=grad_space.state_grad),
            level_x=per_level("level_x", tile), level_x_t=per_level("level_x", tile_t),
            level_q=per_level("level_q", tile), level_q_t=per_level("level_q", tile_t),
            factors=per_level("factor", fp32, Float32), pow_g=view(storage.pow_g, fp32, Float32),
            pow_gs=view(storage.pow_gs, fp32, Float32),
            level_sums=per_level("level_sum", fp32, Float32, state_space.level_sums),
            row_x=view(grad_space.row_terms.row_x, fp32, Float32),
            row_y=view(grad_space.row_terms.row_y, fp32, Float32),
            a_kk=view(storage.a_kk, pair_matrix(), Float32), masked_dlb=per_level("masked_dlb", sq),
            masked_dlb_t=per_level("masked_dlb", sq_t), masked_dmqk=per_level("masked_dmqk", sq),
            masked_dmqk_t=per_level("masked_dmqk", sq_t),
            dalog_w=view(storage.dalog_w, plan.vector(plan.CHANNEL_WARPS), Float32),
        )

    @cute.jit
    def tile_gradients(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
                       out: GradsOutputs, scalars: GradsScalars, tile: TileLocation, pair_loads=None):
        tidx, warp_idx, lane, smem, tma_barrier = self.start_tile(tma_tokens, states, tile)
        # 1. workspace values, this thread's channel of g and its gate constants while the TMA runs
        col = tidx % self.dim
        gate_in = self.load_gate_column(inputs.g, tile.head, tile.row0, tile.valid_rows, col)
        dt, e_a = Float32(0.0), Float32(1.0)
        if cutlass.const_expr(self.gate != "none"):
            dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, tile.head, col)
        self.load_workspace_rows(smem, ws, tile.slot, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)

        # 2. K1's dyadic recompute: the rows' l2norm scales, the channel scan, the levels' A; rows past the sequence
        # end of v, dO, du are zeroed
        self.zero_invalid_rows(smem, tile.valid_rows, tidx)
        self.row_norms(smem, scalars.scale, tile.valid_rows, tidx)
        cute.arch.sync_threads()
        if tidx < self.dim:
            self.dyadic_channel_scan(UnpackedLevels(smem, col, scalars.scale, self.qk_l2norm), gate_in, dt, e_a,
                                     tile.valid_rows)
        cute.arch.sync_threads()
        for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
            if warp_idx == level:
                self.level_pairs(level, smem, lane)

        # 3. forward recompute per value band, 4. the 16×16 products, dgT; then the levels' masked dA, dMqk
        self.forward_and_square_products(smem, tidx, warp_idx, lane, tma_barrier)
        for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
            if warp_idx == level:
                self.mask_level(level, smem, lane)
        cute.arch.sync_threads()

        # 5. channel products per key band, 6. finish per channel and per row
        self.channel_band(smem, inputs, out, scalars, tile, warp_idx, lane)
        cute.arch.sync_threads()
        self.gate_backward(smem, inputs, out, tile, col, dt, e_a, warp_idx, lane)
        if tidx < CHUNK:
            self.beta_backward(smem, out, tile.head, tile.row0, tile.valid_rows, tidx)

    @cute.jit
    def row_norms(self, smem: DyadicGradsSmem, scale: Float32, valid_rows: Int32, tidx: Int32):
        """Per row the l2norm's ``rinv_q`` and ``rinv_k``, as K1's row phase computes them (without l2norm none: no
        phase reads them then)."""
        for item in cutlass.range_constexpr(self.decay_items):
            row, chunk = self.row_chunk(tidx, item)
            q_in, k_in = self.load_row_chunk(smem.q, smem.k, row, chunk)
            _, _, q_rinv, _, k_rscale = self.chunk_scales(q_in, k_in, row < valid_rows, scale)
            self.store_row_rinv(smem.rinv_q, smem.rinv_k, row, chunk, q_rinv, k_rscale)

    @cute.jit
    def straddles(self, level: int, row: Int32, c: Int32):
        """Whether the pair (row, c) straddles level ``level``'s middle row: one block, row upper, c lower."""
        block = DYADIC_BLOCKS[level]
        half = block // 2
        return (row // block == c // block) & (row % block >= half) & (c % block < half)

    @cute.jit
    def level_pairs(self, level: int, smem: DyadicGradsSmem, lane: Int32):
        """One warp: level ``level``'s part of K1's ``A``: ``X·Xᵀ`` (fp32) on the pairs that straddle it, into
        ``a_kk`` (over the four levels every pair i > j is written once)."""
        mma = warp_tiled_mma(BFloat16, Float32)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        product = self.square_product(smem.level_x[level], smem.level_x[level], lane)
        for i in cutlass.range_constexpr(cute.size(product)):
            row, c = coords[i]
            if self.straddles(level, row, c):
                smem.a_kk[row, c] = product[i]

    @cute.jit
    def lower_pairs(self, s_pairs: cute.Tensor, coords: cute.Tensor) -> cute.Tensor:
        """fp32 C fragment of ``s_pairs`` strictly below the diagonal, 0 on and above it (never read there)."""
        values = cute.make_rmem_tensor(cute.size(coords), Float32)
        for i in cutlass.range_constexpr(cute.size(coords)):
            row, c = coords[i]
            value = Float32(0.0)
            if row > c:
                value = s_pairs[row, c]
            values[i] = value
        return values

    @cute.jit
    def dl_pairs(self, smem: DyadicGradsSmem, coords: cute.Tensor, lane: Int32) -> cute.Tensor:
        """K1's fp32 level sums ``A`` (:meth:`level_pairs`)."""
        return self.lower_pairs(smem.a_kk, coords)

    @cute.jit
    def mask_level(self, level: int, smem: DyadicGradsSmem, lane: Int32):
        """One warp: ``dA_ℓ = mask_ℓ ⊙ bf16(β·dL)`` and ``dM_ℓ = mask_ℓ ⊙ dMqk`` (the pairs that straddle level ℓ)."""
        for e in cutlass.range_constexpr(CHUNK * CHUNK // 32):
            flat = lane + 32 * e
            row, c = flat // CHUNK, flat % CHUNK
            inside = self.straddles(level, row, c)
            smem.masked_dlb[level][row, c] = Float32(
                cutlass.select_(inside, smem.dlb[row, c].to(Float32), Float32(0.0))).to(BFloat16)
            smem.masked_dmqk[level][row, c] = Float32(
                cutlass.select_(inside, smem.dmqk[row, c].to(Float32), Float32(0.0))).to(BFloat16)

    @cute.jit
    def channel_band(self, smem: DyadicGradsSmem, inputs: GradsInputs, out: GradsOutputs, scalars: GradsScalars,
                     tile: TileLocation, warp_idx: Int32, lane: Int32):
        """Key band of warp ``w`` with a per-channel unbounded gate: the state products dqd, dkd, dkr (then a
        barrier: S and dS' are dead); Mqk's diagonal terms; per level ``P = dA_ℓ X``, ``Pq = dM_ℓ X``,
        ``C = dA_ℓᵀ X + dM_ℓᵀ Q``, ``dq̂ += factor ⊙ Pq``, ``dk̂ += factor ⊙ (P + C)`` and the level's pair sums
        ``X⊙P + Q⊙Pq + X⊙C`` into S's bytes; ``dq̂ = (… + dqd ⊙ 2^G)·scale``, ``dk̂ = (… + dkd ⊙ 2^G) + dkr ⊙ 2^Gs``;
        the rows' terms into dS''s bytes; then dq, dk (:meth:`store_token_gradients`)."""
        band = self.band
        mma, c0, shape, coords, s_band = self.key_band(smem, warp_idx, lane)
        d_qd, d_kd, d_kr = self.zero_fragments(mma, shape, 3)
        self.accumulate(mma, d_qd, smem.do, s_band, False, True, self.k_steps, lane)
        self.accumulate(mma, d_kd, smem.neg_bdu, s_band, False, True, self.k_steps, lane)
        self.accumulate(mma, d_kr, smem.u_out, cute.local_tile(smem.state_grad, (band, self.dim), (warp_idx, 0)),
                        False, True, self.k_steps, lane)
        cute.arch.sync_threads()  # every warp's reads of S and dS' are done: their bytes take the sums below

        # Mqk's diagonal: dqh += dMqk_ii·kh_i, dkh += dMqk_ii·qh_i (kh, qh from the raw q, k in L2)
        q = self.load_token_pairs(inputs.q, coords, c0, tile.qk_head, tile.row0, tile.valid_rows)
        k = self.load_token_pairs(inputs.k, coords, c0, tile.qk_head, tile.row0, tile.valid_rows)
        rinv_q, rinv_k = self.row_values(smem.rinv_q, lane), self.row_values(smem.rinv_k, lane)
        diagonal = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            row = lane // 4 + 8 * h
            diagonal[h] = smem.dmqk[row, row].to(Float32)
        dq_pairs = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_pairs = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(dq_pairs)):
            h = c_row_half(i)
            q_rscale = rinv_q[h] * scalars.scale if cutlass.const_expr(self.qk_l2norm) else scalars.scale
            k_hat = k[i].to(Float32) * rinv_k[h] if cutlass.const_expr(self.qk_l2norm) else k[i].to(Float32)
            dq_pairs[i] = diagonal[h] * k_hat
            dk_pairs[i] = diagonal[h] * (q[i].to(Float32) * q_rscale)

        for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
            x_band = cute.local_tile(smem.level_x_t[level], (band, CHUNK), (warp_idx, 0))
            q_band = cute.local_tile(smem.level_q_t[level], (band, CHUNK), (warp_idx, 0))
            p, pq, cross = self.zero_fragments(mma, shape, 3)
            self.accumulate(mma, p, smem.masked_dlb[level], x_band, False, True, 1, lane)
            self.accumulate(mma, pq, smem.masked_dmqk[level], x_band, False, True, 1, lane)
            self.accumulate(mma, cross, smem.masked_dlb_t[level], x_band, True, True, 1, lane)
            self.accumulate(mma, cross, smem.masked_dmqk_t[level], q_band, True, True, 1, lane)
            x = self.load_c(mma, cute.local_tile(smem.level_x[level], shape, (0, warp_idx)), lane)
            q_op = self.load_c(mma, cute.local_tile(smem.level_q[level], shape, (0, warp_idx)), lane)
            factor = self.load_pairs(smem.factors[level], coords, c0, lane)
            sums = make_fragment(mma, Operand.C, Float32, tile=shape)
            for i in cutlass.range_constexpr(cute.size(p)):
                x_i = x[i].to(Float32)
                dq_pairs[i] = dq_pairs[i] + factor[i] * pq[i]
                dk_pairs[i] = dk_pairs[i] + factor[i] * (p[i] + cross[i])
                # P, Pq vanish on lower rows and C on upper ones: one tile holds both halves' sums
                sums[i] = (x_i * p[i] + q_op[i].to(Float32) * pq[i]) + x_i * cross[i]
            self.store_pairs(smem.level_sums[level], sums, coords, c0)

        qd = self.load_c(mma, cute.local_tile(smem.qd, shape, (0, warp_idx)), lane)
        kd = self.load_c(mma, cute.local_tile(smem.kd, shape, (0, warp_idx)), lane)
        kr = self.load_c(mma, cute.local_tile(smem.kr, shape, (0, warp_idx)), lane)
        pow_g = self.load_pairs(smem.pow_g, coords, c0, lane)
        pow_gs = self.load_pairs(smem.pow_gs, coords, c0, lane)
        dq_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        row_x = make_fragment(mma, Operand.C, Float32, tile=shape)
        row_y = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(d_qd)):
            dq_hat[i] = (dq_pairs[i] + d_qd[i] * pow_g[i]) * scalars.scale
            dk_hat[i] = (dk_pairs[i] + d_kd[i] * pow_g[i]) + d_kr[i] * pow_gs[i]
            row_x[i] = d_qd[i] * qd[i].to(Float32) + d_kd[i] * kd[i].to(Float32)
            row_y[i] = d_kr[i] * kr[i].to(Float32)
        self.store_pairs(smem.row_x, row_x, coords, c0)
        self.store_pairs(smem.row_y, row_y, coords, c0)
        self.store_token_gradients(smem, inputs, out, dq_hat, dk_hat, coords, c0, tile, warp_idx, lane)

    @cute.jit
    def gate_backward(self, smem: DyadicGradsSmem, inputs: GradsInputs, out: GradsOutputs, tile: TileLocation,
                      col: Int32, dt: Float32, e_a: Float32, warp_idx: Int32, lane: Int32):
        """Channel ``col``: ``dγ_s`` = the levels' straddle sums (upper rows: Σ of the level's sums over the upper
        rows r ≥ s of s's block, running down from its last row; lower rows: Σ over the lower rows j < s, running
        up from its first) + ``Σ_{r≥s} (dqd⊙qd + dkd⊙kd)_r`` + ``Σ_{r<s} (dkr⊙kr)_r`` + ``dgT·gT``; then
        ``dg = dγ`` (log decay) or ``dg = −e^A·σ(g + dt_bias)·dγ`` (softplus) and the tile's partial sums of
        ddt_bias (per channel) and dA_log (``Σ dγ·γ``, ``γ = g'·ln 2``; over channels in warp order)."""
        if warp_idx < self.channel_warps:  # one thread per channel
            levels = cute.make_rmem_tensor((CHUNK,), Float32)
            levels.fill(0.0)
            for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
                block = DYADIC_BLOCKS[level]
                half = block // 2
                for start in cutlass.range_constexpr(0, CHUNK, block):
                    running = Float32(0.0)
                    for r in cutlass.range_constexpr(start + block - 1, start + half - 1, -1):
                        running = running + smem.level_sums[level][r, col]
                        levels[r] = levels[r] + running
                    running = Float32(0.0)
                    for r in cutlass.range_constexpr(start, start + half):
                        levels[r] = levels[r] + running
                        running = running + smem.level_sums[level][r, col]
            from_s = cute.make_rmem_tensor((CHUNK,), Float32)
            running = Float32(0.0)
            for step in cutlass.range_constexpr(CHUNK):
                r = CHUNK - 1 - step
                running = running + smem.row_x[r, col]
                from_s[r] = running
            state_term = smem.dgt[col] * smem.pow_g[CHUNK - 1, col]  # dgT ⊙ gT
            before_s = Float32(0.0)
            ddt = Float32(0.0)
            dalog = Float32(0.0)
            if cutlass.const_expr(self.gate_ahead):
                g_rows = self.load_gate_column(inputs.g, tile.head, tile.row0, tile.valid_rows, col)
            for s in cutlass.range_constexpr(CHUNK):
                dgamma = ((levels[s] + from_s[s]) + before_s) + state_term
                before_s = before_s + smem.row_y[s, col]
                if s < tile.valid_rows:
                    dg = dgamma
                    if cutlass.const_expr(self.gate == "softplus"):
                        if cutlass.const_expr(self.gate_ahead):
                            g_raw = g_rows[s]
                        else:
                            g_raw = inputs.g[tile.row0 + s, tile.head, col].to(Float32)
                        dg = self.softplus_gate_grad(g_raw, dt, e_a, dgamma)
                        ddt = ddt + dg
                        dalog = dalog + dgamma * (self.base2_log_decay(g_raw, dt, e_a) * Float32(LN2))
                    out.dg[tile.row0 + s, tile.head, col] = self.stored(dg.to(BFloat16))
            if cutlass.const_expr(self.gate == "softplus"):
                out.ddt_partial[tile.slot, col] = ddt
                self.store_warp_dalog(smem, dalog, warp_idx, lane)
        if cutlass.const_expr(self.gate == "softplus"):
            self.store_dalog_partial(smem, out, tile.slot, warp_idx, lane)
