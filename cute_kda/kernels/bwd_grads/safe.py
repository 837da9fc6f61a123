"""Kernel B for the bounded (safe) gate, FlashKDA's form: the phases of :mod:`.base` with

2. *Recompute K1*: the gate scan ``G`` per channel (threads 0 … D − 1), the l2norm scales, qd, kd, kr and kinv
   (over q, k, g and into kinv).
5. *Channel products*: dqd, dkd, dkinv, dkr, then the token gradients of q̂ and k̂, ``dG`` and ``dkr ⊙ kr``.
6. *Finish*: per channel (threads 0 … D − 1), the reverse cumsum of dG, the gate backward (dg, and the tile's
   partial sums of ddt_bias and dA_log); with ``slopes_ahead`` every row's ``x`` and ``σ'(x)`` first, in
   straight-line code (:func:`reciprocal_rn`).

g comes by TMA with the other token tiles; two CTAs per SM (``cute_kda.layouts.bwd_grads.smem_budget``).
"""

from __future__ import annotations

from typing import Optional

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute, cutlass
from ...layouts import bwd_grads as plan
from ...layouts.fwd_prepare import chunk_tile, gate_cumsum_tile
from ...layouts.smem import CHUNK, square_tile_transposed, sw128_tile_transposed
from ...numerics import LN2, LOG2E
from ..common.copy import Operand, make_fragment
from ..common.fastmath import ex2_approx, fma_rn, rcp_approx
from .base import (
    BwdGrads, GradsInputs, GradsOutputs, GradsScalars, GradsStates, GradsWorkspace, TileLocation, smem_bundle,
)
from .pairs import PairLoads

# ptxas takes its fast path of rcp.rn.f32(y) (what ``1 / y`` becomes) for y's biased exponent in 1 … 252 (its range
# test: (bits + 3·2^23) & 0x7f800000 > 0x1ffffff); [1, 2^125) lies inside
RECIPROCAL_FAST_BELOW = 2.0 ** 125


@cute.jit
def reciprocal_rn(y: Float32) -> Float32:
    """``1 / y`` for ``1 ≤ y < 2^125``, spelled as ptxas' own fast path of ``rcp.rn.f32`` (``MUFU.RCP``, then one
    Newton step ``r − r·(y·r − 1)``, both ``fma.rn``): the division's bits, in straight-line code that ptxas may
    interleave (the division itself ends a basic block at its range test). Elsewhere the caller divides."""
    r = rcp_approx(y)
    return fma_rn(r, -fma_rn(y, r, Float32(-1.0)), r)


SafeGradsSmem = smem_bundle(
    "SafeGradsSmem",
    ("g", "qd_t", "kd_t", "kinv", "kinv_t", "cumsum", "dg_cum", "dkr_col", "dmqk_t", "dlb_t", "dalog_w", "x_rows",
     "dsig_rows"),
    "Shared-memory tensors of one CTA with the safe gate (``layouts.bwd_grads.smem_budget``): kr is written over g; "
    "``split_rows``' x and σ'(x) of the first rows over S and dS' (dead after phase 5).",
)


class SafeBwdGrads(BwdGrads):
    """Kernel B for the safe gate (bf16 g, per channel; no grouped value heads)."""

    gates = ("safe",)
    gate_tile = True
    splits_gate_rows = True
    forms_slopes_ahead = True
    grouped_heads = False
    smem_plan = staticmethod(plan.smem_budget)
    partner_buffers = plan.PARTNER_BUFFERS["safe"]

    def make_smem(self, storage) -> SafeGradsSmem:
        tile, tile_t = chunk_tile(self.dim), sw128_tile_transposed(CHUNK, self.dim)
        fp32 = gate_cumsum_tile(self.dim)
        sq_t = square_tile_transposed()
        view = self.view
        early = storage.vdu_then_dg.inputs_vdu
        # kr is written over g (smem plan): both names view the same bytes
        return SafeGradsSmem(
            **self.shared_views(storage, v=early.v, du=early.du, kr=storage.g, state=storage.state,
                                state_grad=storage.state_grad),
            g=view(storage.g, tile, self.gate_dtype), qd_t=view(storage.q, tile_t), kd_t=view(storage.k, tile_t),
            kinv=view(storage.kinv, tile), kinv_t=view(storage.kinv, tile_t),
            cumsum=view(storage.cumsum, fp32, Float32), dg_cum=view(storage.vdu_then_dg.dg_cum, fp32, Float32),
            dkr_col=view(storage.dkr_col, plan.vector(self.dim), Float32), dmqk_t=view(storage.dmqk, sq_t),
            dlb_t=view(storage.dlb, sq_t), dalog_w=view(storage.dalog_w, plan.vector(plan.CHANNEL_WARPS), Float32),
            x_rows=view(storage.state, fp32, Float32), dsig_rows=view(storage.state_grad, fp32, Float32),
        )

    @cute.jit
    def tile_gradients(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
                       out: GradsOutputs, scalars: GradsScalars, tile: TileLocation,
                       pair_loads: Optional[PairLoads] = None):
        tidx, warp_idx, lane, smem, tma_barrier = self.start_tile(tma_tokens, states, tile, pair_loads)
        # 1. workspace values and this thread's channel constants while the TMA runs
        col = tidx % self.dim
        dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, tile.head, col)
        self.load_workspace_rows(smem, ws, tile.slot, tidx)
        if cutlass.const_expr(self.pair_rebuild):
            self.load_partner_decay(smem, pair_loads, tile.pair, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)
        if cutlass.const_expr(self.pair_rebuild):  # the matrix of the tile's other end, before phase 2's writes
            self.rebuild_pair_matrix(smem, tile.pair, tidx, warp_idx, lane)

        # 2. K1's recompute; rows past the sequence end of v, dO, du are zeroed
        self.zero_invalid_rows(smem, tile.valid_rows, tidx)
        if tidx < self.dim:
            self.gate_scan(smem.g, smem.cumsum, col, dt, e_a, scalars.c_gate, tile.valid_rows)
        cute.arch.sync_threads()
        self.decay(smem.q, smem.k, smem.cumsum, smem.qd, smem.kd, smem.kr, smem.kinv, scalars.scale, tile.valid_rows,
                   tidx, smem.rinv_q, smem.rinv_k)
        cute.arch.sync_threads()

        # 3. forward recompute per value band, 4. the 16×16 products, dgT
        self.forward_and_square_products(smem, tidx, warp_idx, lane, tma_barrier)

        # 5. channel products per key band, 6. finish
        self.channel_band(smem, inputs, out, scalars, tile, warp_idx, lane)
        cute.arch.sync_threads()
        self.gate_backward(smem, inputs, out, scalars, tile, col, dt, e_a, warp_idx, lane)
        if tidx < CHUNK:
            self.beta_backward(smem, out, tile.head, tile.row0, tile.valid_rows, tidx)

    @cute.jit
    def dl_pairs(self, smem: SafeGradsSmem, coords: cute.Tensor, lane: Int32) -> cute.Tensor:
        """``A = kd·kinvᵀ``, as K1 forms it."""
        return self.square_product(smem.kd, smem.kinv, lane)

    @cute.jit
    def channel_band(self, smem: SafeGradsSmem, inputs: GradsInputs, out: GradsOutputs, scalars: GradsScalars,
                     tile: TileLocation, warp_idx: Int32, lane: Int32):
        """Key band of warp ``w``: dqd, dkd, dkinv, dkr; the q̂ / k̂ gradients; ``dG`` and ``dkr ⊙ kr``;
        the l2norm backward (after the row dot products of all warps)."""
        band = self.band
        mma, c0, shape, coords, s_band = self.key_band(smem, warp_idx, lane)
        kinv_band = cute.local_tile(smem.kinv_t, (band, CHUNK), (warp_idx, 0))
        ln2 = Float32(LN2)
        # two passes of two accumulators each (register pressure): dqd and dkd, then dkinv and dkr
        d_qd, d_kd = self.zero_fragments(mma, shape, 2)
        self.accumulate(mma, d_qd, smem.do, s_band, False, True, self.k_steps, lane)
        self.accumulate(mma, d_qd, smem.dmqk, kinv_band, False, True, 1, lane)
        self.accumulate(mma, d_kd, smem.neg_bdu, s_band, False, True, self.k_steps, lane)
        self.accumulate(mma, d_kd, smem.dlb, kinv_band, False, True, 1, lane)
        qd = self.load_c(mma, cute.local_tile(smem.qd, shape, (0, warp_idx)), lane)
        kd = self.load_c(mma, cute.local_tile(smem.kd, shape, (0, warp_idx)), lane)
        cum = self.load_pairs(smem.cumsum, coords, c0, lane)
        dq_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_g = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(d_qd)):
            decay = ex2_approx(cum[i])
            dq_hat[i] = d_qd[i] * decay * scalars.scale
            dk_hat[i] = d_kd[i] * decay
            d_g[i] = d_qd[i] * qd[i].to(Float32) + d_kd[i] * kd[i].to(Float32)

        d_kinv, d_kr = self.zero_fragments(mma, shape, 2)
        self.accumulate(mma, d_kinv, smem.dmqk_t, cute.local_tile(smem.qd_t, (band, CHUNK), (warp_idx, 0)),
                        True, True, 1, lane)
        self.accumulate(mma, d_kinv, smem.dlb_t, cute.local_tile(smem.kd_t, (band, CHUNK), (warp_idx, 0)),
                        True, True, 1, lane)
        self.accumulate(mma, d_kr, smem.u_out, cute.local_tile(smem.state_grad, (band, self.dim), (warp_idx, 0)),
                        False, True, self.k_steps, lane)
        kinv = self.load_c(mma, cute.local_tile(smem.kinv, shape, (0, warp_idx)), lane)
        kr = self.load_c(mma, cute.local_tile(smem.kr, shape, (0, warp_idx)), lane)
        cum_last = self.load_pairs(smem.cumsum, coords, c0, lane, row=CHUNK - 1)
        dkr_kr = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(d_kr)):
            # dk̂ = dkd·2^G + dkinv·2^-G + dkr·2^(G_last − G), summed in this order
            dk_hat[i] = (dk_hat[i] + d_kinv[i] * ex2_approx(-cum[i])
                         + d_kr[i] * ex2_approx(cum_last[i] - cum[i]))
            dkr_kr[i] = d_kr[i] * kr[i].to(Float32)
            d_g[i] = ln2 * (d_g[i] - d_kinv[i] * kinv[i].to(Float32) - dkr_kr[i])
        self.store_pairs(smem.dg_cum, d_g, coords, c0)
        self.store_column_sums(smem.dkr_col, dkr_kr, coords, c0, lane)

        self.store_token_gradients(smem, inputs, out, dq_hat, dk_hat, coords, c0, tile, warp_idx, lane)

    @cute.jit
    def store_column_sums(self, s_cols: cute.Tensor, frag: cute.Tensor, coords: cute.Tensor, c0: Int32, lane: Int32):
        """``s_cols[c0 + c] = Σ_r frag[r, c]`` over the 16 rows of a fp32 C fragment: the lane's two rows,
        then the 8 lanes that share its columns (``shfl.xor`` 4, 8, 16); lanes 0-3 write."""
        for a in cutlass.range_constexpr(cute.size(frag) // 4):
            for e in cutlass.range_constexpr(2):
                total = frag[e + 4 * a] + frag[e + 2 + 4 * a]  # rows g and g + 8
                for offset in (4, 8, 16):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
                _, c = coords[e + 4 * a]
                if lane < 4:
                    s_cols[c0 + c] = total

    @cute.jit
    def gate_backward(self, smem: SafeGradsSmem, inputs: GradsInputs, out: GradsOutputs, scalars: GradsScalars,
                      tile: TileLocation, col: Int32, dt: Float32, e_a: Float32, warp_idx: Int32, lane: Int32):
        """Channel ``col``: ``dg' = Σ_{s≥r} dG_s + dG_last`` (reverse cumsum), the gate backward to the raw
        gate, and the tile's partial sums of ddt_bias (per channel) and dA_log (over channels, warp order).
        Warps 0-3 walk the rows from the last. With ``split_rows`` warps 4-7 meanwhile form each of rows 7 … 0's
        ``x`` and ``σ'(x)`` (the chain's two ex2 and two divisions, which need no suffix) into S's and dS''s bytes,
        and warps 0-3, after row 8 and a barrier, finish rows 7 … 0 from them: the same operations on the same
        values in the same order, so the same bits."""
        if cutlass.const_expr(not self.split_rows):
            if warp_idx < self.channel_warps:  # one thread per channel
                d_last = self.gate_d_last(smem, col)
                zero = Float32(0.0)
                # raw g from global memory (L2): its smem tile holds kr now
                g_rows = None
                if cutlass.const_expr(self.gate_ahead or self.slopes_ahead):
                    g_rows = self.load_gate_column(inputs.g, tile.head, tile.row0, tile.valid_rows, col)
                slopes = None
                if cutlass.const_expr(self.slopes_ahead):
                    slopes = self.row_slopes(smem, col, dt, e_a, g_rows)
                _, ddt, dalog = self.gate_rows(smem, inputs, out, scalars, tile, col, dt, e_a, d_last, g_rows,
                                               CHUNK, 0, (zero, zero, zero), slopes=slopes)
                out.ddt_partial[tile.slot, col] = ddt
                self.store_warp_dalog(smem, dalog, warp_idx, lane)
        else:
            half = CHUNK // 2
            d_last = self.gate_d_last(smem, col)
            g_rows = None
            if cutlass.const_expr(self.gate_ahead):
                g_rows = self.load_gate_column(inputs.g, tile.head, tile.row0, tile.valid_rows, col)
            suffix = Float32(0.0)
            ddt = Float32(0.0)
            dalog = Float32(0.0)
            if warp_idx < self.channel_warps:
                suffix, ddt, dalog = self.gate_rows(smem, inputs, out, scalars, tile, col, dt, e_a, d_last, g_rows,
                                                    CHUNK, half, (suffix, ddt, dalog))
            else:
                for row in cutlass.range_constexpr(half):
                    if row < tile.valid_rows:
                        x, dsig = self.gate_slope(self.raw_gate(inputs, tile, col, g_rows, row), dt, e_a)
                        smem.x_rows[row, col] = x
                        smem.dsig_rows[row, col] = dsig
            cute.arch.sync_threads()  # rows 7 … 0's x and σ'(x) are in shared memory
            if warp_idx < self.channel_warps:
                _, ddt, dalog = self.gate_rows(smem, inputs, out, scalars, tile, col, dt, e_a, d_last, g_rows,
                                               half, 0, (suffix, ddt, dalog), formed=False)
                out.ddt_partial[tile.slot, col] = ddt
                self.store_warp_dalog(smem, dalog, warp_idx, lane)
        self.store_dalog_partial(smem, out, tile.slot, warp_idx, lane)

    def gate_d_last(self, smem: SafeGradsSmem, col: Int32) -> Float32:
        """``dG_last = ln 2 · (Σ_r dkr⊙kr + dgT ⊙ gT)`` of channel ``col``."""
        gate_total = ex2_approx(smem.cumsum[CHUNK - 1, col])  # gT, as K1 computes it
        return Float32(LN2) * (smem.dkr_col[col] + smem.dgt[col] * gate_total)

    def raw_gate(self, inputs: GradsInputs, tile: TileLocation, col: Int32, g_rows, row: int) -> Float32:
        """The raw gate of ``row``, channel ``col``: from the burst ``g_rows`` (``gate_ahead``, ``slopes_ahead``) or
        global memory."""
        if cutlass.const_expr(self.gate_ahead or self.slopes_ahead):
            return g_rows[row]
        return inputs.g[tile.row0 + row, tile.head, col].to(Float32)

    @staticmethod
    def gate_slope(g_raw: Float32, dt: Float32, e_a: Float32) -> tuple:
        """``x = e^A·(g + dt_bias)`` and ``σ'(x)``."""
        x = e_a * (g_raw + dt)
        # σ'(x) = σ(x)·σ(−x), each factor from ex2: σ·(1 − σ) of the tanh form cancels where it saturates
        scaled = x * Float32(LOG2E)
        dsig = (Float32(1.0) / (Float32(1.0) + ex2_approx(-scaled))) * (
            Float32(1.0) / (Float32(1.0) + ex2_approx(scaled)))
        return x, dsig

    @cute.jit
    def row_slopes(self, smem: SafeGradsSmem, col: Int32, dt: Float32, e_a: Float32, g_rows: cute.Tensor) -> tuple:
        """``slopes_ahead``: (x, σ'(x), dG) of every row of channel ``col`` (fp32 ``[16]`` each; ``g_rows`` the
        column's raw gate, 0 past the sequence end, where the values go unused), as :meth:`gate_slope` forms them: the
        two reciprocals by :func:`reciprocal_rn`, straight-line code; a thread with a denominator outside its range
        (≥ 2^125, or NaN) forms every σ'(x) again by :meth:`gate_slope`'s division."""
        xs = cute.make_rmem_tensor((CHUNK,), Float32)
        dsigs = cute.make_rmem_tensor((CHUNK,), Float32)
        d_gs = cute.make_rmem_tensor((CHUNK,), Float32)
        limit = Float32(RECIPROCAL_FAST_BELOW)
        outside = Int32(0)
        for row in cutlass.range_constexpr(CHUNK):
            x = e_a * (g_rows[row] + dt)
            scaled = x * Float32(LOG2E)
            low = Float32(1.0) + ex2_approx(-scaled)
            high = Float32(1.0) + ex2_approx(scaled)
            xs[row] = x
            dsigs[row] = reciprocal_rn(low) * reciprocal_rn(high)
            outside = outside + cutlass.select_(low < limit, Int32(0), Int32(1))
            outside = outside + cutlass.select_(high < limit, Int32(0), Int32(1))
            d_gs[row] = smem.dg_cum[row, col]
        if outside > 0:
            for row in cutlass.range_constexpr(CHUNK):
                _, dsig = self.gate_slope(g_rows[row], dt, e_a)
                dsigs[row] = dsig
        return xs, dsigs, d_gs

    @cute.jit
    def gate_rows(self, smem: SafeGradsSmem, inputs: GradsInputs, out: GradsOutputs, scalars: GradsScalars,
                  tile: TileLocation, col: Int32, dt: Float32, e_a: Float32, d_last: Float32, g_rows, top: int,
                  bottom: int, carry: tuple, formed: bool = True, slopes=None) -> tuple:
        """Rows ``top − 1`` … ``bottom`` of channel ``col`` from ``carry`` = (suffix, ddt, dalog) entering them: dg
        stored, the carry returned; ``x`` and ``σ'(x)`` formed here, or (not ``formed``) read from ``x_rows`` /
        ``dsig_rows``, or (``slopes``: :meth:`row_slopes`) taken with dG from registers."""
        suffix, ddt, dalog = carry
        for row in cutlass.range_constexpr(top - 1, bottom - 1, -1):
            if row < tile.valid_rows:
                if cutlass.const_expr(slopes is not None):
                    suffix = suffix + slopes[2][row]
                    x, dsig = slopes[0][row], slopes[1][row]
                else:
                    suffix = suffix + smem.dg_cum[row, col]
                    if cutlass.const_expr(formed):
                        x, dsig = self.gate_slope(self.raw_gate(inputs, tile, col, g_rows, row), dt, e_a)
                    else:
                        x = smem.x_rows[row, col]
                        dsig = smem.dsig_rows[row, col]
                dx = (suffix + d_last) * scalars.c_gate * dsig
                dg_raw = dx * e_a
                out.dg[tile.row0 + row, tile.head, col] = self.stored(dg_raw.to(BFloat16))
                ddt = ddt + dg_raw
                dalog = dalog + dx * x
        return suffix, ddt, dalog
