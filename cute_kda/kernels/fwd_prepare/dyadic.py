"""K1 for the per-channel unbounded gates (``gate`` "softplus" or "none", the latter a precomputed log decay;
g in q's dtype, or fp32 with "none"): the overflow-free form of docs/numerics.md ("Unbounded gates", scheme
``dyadic``), one thread per channel (128 threads; at D = 64 threads 64-127 own none); no ``2^−G`` is ever formed.
Five CTAs per SM (``cute_kda.layouts.fwd_prepare.dyadic_smem_budget``).
"""

from __future__ import annotations

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute, cutlass
from ...layouts import fwd_prepare as plan
from ...layouts.smem import CHUNK, sw128_column_offsets, sw128_row_offset
from ...numerics import DYADIC_BLOCKS
from ..common.copy import WARP_TILE, Operand, make_fragment, warp_tiled_mma
from ..common.fastmath import ex2_approx, mul_rn
from ..common.token_prep import CHANNELS_PER_LANE
from .base import PrepareInputs, PrepareKernel, PrepareScalars, PrepareTma, WorkspaceTiles

LEVEL_ROWS = CHUNK // 2  # upper (and lower) rows of one straddle level, over all its blocks


class SwizzledColumn:
    """One column of a sw128 ``[16, D]`` smem tile, indexed by a compile-time row: the flat (unswizzled)
    element view of the tile at the column's eight precomputed offsets (``layouts.smem.sw128_column_offsets``)
    plus the row's constant, so no access recomputes the swizzle."""

    def __init__(self, flat: cute.Tensor, offsets: list) -> None:
        self.flat, self.offsets = flat, offsets

    def __getitem__(self, row: int):
        return self.flat[self.offsets[row % len(self.offsets)] + sw128_row_offset(row)]

    def __setitem__(self, row: int, value) -> None:
        self.flat[self.offsets[row % len(self.offsets)] + sw128_row_offset(row)] = value



class PackedLevels:
    """Where K1 puts one channel of :meth:`~.common.token_prep.TokenPrep.dyadic_channel_scan`: it reads q, k through
    ``q_in``, ``k_in`` (the input dtype's columns) and writes qd, kd over them (bf16 columns of the same bytes) and
    kr in their sw128 tiles (:class:`SwizzledColumn` s), and each level's operands packed into 8 slots a level:
    an upper row ``r > m`` of block ``β`` (``b`` rows) in slot ``β·b/2 + (r − m − 1)`` of the level's rows (``X``
    then, 8 rows on, ``Q``), a lower row ``r ≤ m`` in slot ``β·b/2 + (r − β·b)`` of its pair's lower rows."""

    def __init__(self, q_in: SwizzledColumn, k_in: SwizzledColumn, q_col: SwizzledColumn, k_col: SwizzledColumn,
                 kr_col: SwizzledColumn, level_cols: tuple, lower_cols: tuple, s_q_scale: cute.Tensor,
                 s_k_scale: cute.Tensor) -> None:
        self.q_in, self.k_in = q_in, k_in
        self.q_col, self.k_col, self.kr_col = q_col, k_col, kr_col
        self.level_cols, self.lower_cols = level_cols, lower_cols
        self.s_q_scale, self.s_k_scale = s_q_scale, s_k_scale

    def q(self, row: int):
        return self.q_in[row]

    def k(self, row: int):
        return self.k_in[row]

    def q_scale(self, row: int):
        return self.s_q_scale[row]

    def k_scale(self, row: int):
        return self.s_k_scale[row]

    def suffix(self, row: int, kh: Float32, growth: Float32) -> None:
        self.kr_col[row] = (kh * growth).to(BFloat16)

    def prefix(self, row: int, qh: Float32, kh: Float32, decay: Float32) -> None:
        self.q_col[row] = (qh * decay).to(BFloat16)
        self.k_col[row] = (kh * decay).to(BFloat16)

    def lower(self, level: int, start: int, row: int, factor: Float32, kh: Float32) -> None:
        block = DYADIC_BLOCKS[level]
        slot = LEVEL_ROWS * (level % 2) + start // block * (block // 2) + row - start
        self.lower_cols[level // 2][slot] = (kh * factor).to(BFloat16)

    def upper(self, level: int, start: int, row: int, factor: Float32, kh: Float32, qh: Float32) -> None:
        block = DYADIC_BLOCKS[level]
        slot = start // block * (block // 2) + row - (start + block // 2)
        self.level_cols[level][slot] = (kh * factor).to(BFloat16)
        self.level_cols[level][LEVEL_ROWS + slot] = (qh * factor).to(BFloat16)



class DyadicPrepare(PrepareKernel):
    """K1 for the per-channel unbounded gates."""

    default_ctas_per_sm = plan.DYADIC_CTAS_PER_SM
    smem_plan = staticmethod(plan.dyadic_smem_budget)

    @cute.jit
    def prepare_tile(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles, scalars: PrepareScalars,
                     head: Int32, qk_head: Int32, slot: Int32, row0: Int32, valid_rows: Int32):
        """One tile with an unbounded gate: no ``2^−G`` is ever formed.

        1. Warp 0 TMA-loads q and k; every thread (one per channel) loads its column of g.
        2. Rows (16 lanes per row, as :meth:`decay`): the l2norm scales and Mqk's diagonal ``Σ_c qh·kh``.
        3. Columns (one thread per channel, rows in order): the gate, ``a = 2^g'``, the prefix ``G`` and the
           suffix ``Gs``, ``qd``, ``kd`` (over q, k), ``kr``, and per straddle level the factors (running
           products of ``a`` outward from the block's middle row, all ≤ 1) and the operands X, Q.
        4. Warp ``ℓ``: level ``ℓ``'s pair sums by one tensor-core product, scattered into ``A_kk`` / ``A_qk``.
        5. Warp 0: L and INV; warp 1: Mqk; warp 2: TMA stores of qd, kd, kr.
        """
        tidx, warp_idx, lane, storage, tile_layout = self.start_tile()
        s_q, s_k, s_kr = self.swizzled_views(tile_layout, storage.q, storage.k, storage.kr)
        q_in, k_in = self.input_views(tile_layout, storage.q, storage.k)
        s_levels = self.swizzled_views(tile_layout, *(getattr(storage, f"level_rows{level}")
                                                      for level in range(len(DYADIC_BLOCKS))))
        s_lowers = self.swizzled_views(tile_layout, *(getattr(storage, f"lower_rows{pair}")
                                                      for pair in range(len(DYADIC_BLOCKS) // 2)))
        s_akk = storage.a_kk.get_tensor(plan.pair_matrix())
        s_aqk = storage.a_qk.get_tensor(plan.pair_matrix())
        s_beta, s_q_scale, s_k_scale, s_diagonal = self.row_views(storage.beta, storage.q_scale, storage.k_scale,
                                                                  storage.mqk_diagonal)
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_inputs(((tma.q, q_in, qk_head, row0), (tma.k, k_in, qk_head, row0)), tma_barrier)
        col = self.channel_of(tidx)
        gate_in = self.load_gate_column(inputs.g, head, row0, valid_rows, col)  # in flight with the TMA
        dt, e_a = Float32(0.0), Float32(1.0)
        if cutlass.const_expr(self.gate != "none"):
            dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, head, col)
        if tidx < CHUNK:
            self.activate_beta(inputs.beta, ws.beta, s_beta, head, slot, row0, valid_rows, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)

        self.row_scales(q_in, k_in, s_q_scale, s_k_scale, s_diagonal, scalars.scale, valid_rows, tidx)
        cute.arch.sync_threads()
        column = (storage, col, gate_in, dt, e_a, valid_rows, s_q_scale, s_k_scale, ws.gt, slot)
        if cutlass.const_expr(self.idle_threads):
            if tidx < self.dim:
                self.channel_column(*column)
        else:
            self.channel_column(*column)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()
        for level in cutlass.range_constexpr(len(DYADIC_BLOCKS)):
            if warp_idx == level:
                self.level_pair_sums(level, s_levels[level], s_lowers[level // 2], s_akk, s_aqk, lane)
        cute.arch.sync_threads()

        if warp_idx == self.kkt_warp:
            self.lower_inverse(self.pair_fragment(s_akk, None, lane), s_beta, ws.inv, slot, lane)
        elif warp_idx == self.qk_warp:
            self.store_mqk(self.pair_fragment(s_aqk, s_diagonal, lane), ws.mqk, slot, lane)
        elif warp_idx == self.store_warp:
            self.store_tiles(tma, s_q, s_k, s_kr, slot)

    @cute.jit
    def channel_column(self, storage, col: Int32, gate_in: cute.Tensor, dt: Float32, e_a: Float32, valid_rows: Int32,
                       s_q_scale: cute.Tensor, s_k_scale: cute.Tensor, ws_gt: cute.Tensor, slot: Int32):
        """Phase 3 for channel ``col``: the scan into :class:`PackedLevels` over the tiles in ``storage``, and
        ``gT`` of the channel to the workspace."""
        offsets = sw128_column_offsets(col)
        flat = cute.make_layout(CHUNK * self.dim)

        def column(buffer, dtype=None) -> SwizzledColumn:
            return SwizzledColumn(buffer.get_tensor(flat, dtype=dtype), offsets)

        sink = PackedLevels(
            column(storage.q, self.dtype), column(storage.k, self.dtype), column(storage.q), column(storage.k),
            column(storage.kr),
            tuple(column(getattr(storage, f"level_rows{level}")) for level in range(len(DYADIC_BLOCKS))),
            tuple(column(getattr(storage, f"lower_rows{pair}")) for pair in range(len(DYADIC_BLOCKS) // 2)),
            s_q_scale, s_k_scale)
        ws_gt[slot, col] = ex2_approx(self.dyadic_channel_scan(sink, gate_in, dt, e_a, valid_rows))

    @cute.jit
    def row_scales(self, s_q, s_k, s_q_scale, s_k_scale, s_diagonal, scale: Float32, valid_rows: Int32, tidx: Int32):
        """Per row: ``rq = rinv_q · scale``, ``rk = rinv_k`` (scale and 1 without l2norm) and Mqk's diagonal
        ``Σ_c f32(qh·kh)`` (qh = q·rq, kh = k·rk; sequential over the lane's 8 channels, then the butterfly)."""
        for item in cutlass.range_constexpr(self.decay_items):
            row, chunk = self.row_chunk(tidx, item)
            valid = row < valid_rows
            q_in, k_in = self.load_row_chunk(s_q, s_k, row, chunk)
            q32, k32, _, q_rscale, k_rscale = self.chunk_scales(q_in, k_in, valid, scale)
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                k_hat = k32[i] * k_rscale if cutlass.const_expr(self.qk_l2norm) else k32[i]
                dot = dot + mul_rn(q32[i] * q_rscale, k_hat)
            dot = self.row_butterfly(dot)
            if chunk == 0:
                s_q_scale[row] = q_rscale
                s_k_scale[row] = k_rscale
                s_diagonal[row] = dot

    @cute.jit
    def level_pair_sums(self, level: int, s_level, s_lower, s_akk, s_aqk, lane: Int32):
        """One warp: ``P = level_rows · lower_rowsᵀ`` (fp32), scattered: ``P[p, l]`` → ``A_kk[i, j]``,
        ``P[8 + p, l]`` → ``A_qk[i, j]`` for the level's upper slot p (row i) and lower slot l (row j) of one
        block; the other entries of P (pairs across blocks, the other level's columns) are dropped."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        product = self.tile_product(mma_bf16, s_level, s_lower, lane)
        coords = mma_bf16.get_slice(lane).partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        block = DYADIC_BLOCKS[level]
        half = block // 2
        lower_base = LEVEL_ROWS * (level % 2)
        for i in cutlass.range_constexpr(cute.size(product)):
            prow, pcol = coords[i]
            upper_slot = prow % LEVEL_ROWS
            lower_slot = pcol - lower_base
            in_level = (lower_slot >= 0) & (lower_slot < LEVEL_ROWS)
            if in_level & (upper_slot // half == lower_slot // half):
                row_i = upper_slot // half * block + half + upper_slot % half
                row_j = lower_slot // half * block + lower_slot % half
                if prow < LEVEL_ROWS:
                    s_akk[row_i, row_j] = product[i]
                else:
                    s_aqk[row_i, row_j] = product[i]

    @cute.jit
    def pair_fragment(self, s_pairs, s_diagonal, lane: Int32) -> cute.Tensor:
        """The fp32 C fragment of ``s_pairs`` below the diagonal, ``s_diagonal`` on it (0 when None), 0 above."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        coords = mma_bf16.get_slice(lane).partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        frag = make_fragment(mma_bf16, Operand.C, Float32)
        for i in cutlass.range_constexpr(cute.size(frag)):
            row, col = coords[i]
            value = Float32(0.0)
            if row > col:
                value = s_pairs[row, col]
            if cutlass.const_expr(s_diagonal is not None):
                if row == col:
                    value = s_diagonal[row]
            frag[i] = value
        return frag
