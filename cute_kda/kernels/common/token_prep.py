"""The per-token preparation of docs/numerics.md ("K1") that K1 and the tile-gradient kernel both run.

K1 (:mod:`cute_kda.kernels.fwd_prepare`) computes it to fill the workspace; Kernel B
(:mod:`cute_kda.kernels.bwd_grads`) recomputes it from the raw inputs (bit for bit, the same
instructions) because it needs what K1 never stores: ``kinv``, the cumsum ``G`` and the l2norm
scales. :class:`TokenPrep` is a mixin: the kernel class sets ``dim``, ``num_threads``,
``qk_l2norm`` and ``decay_items`` (rows × :attr:`~TokenPrep.row_lanes` items per thread); the unbounded gates' methods
(:meth:`~TokenPrep.base2_log_decay`, the per-head ones) read ``gate`` too.
"""

from __future__ import annotations

from typing import Optional

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute, cutlass
from ...numerics import CHUNK, DYADIC_BLOCKS, EPS, LOG2E
from .fastmath import ex2_approx, lg2_approx, mul_rn, sigmoid_approx

CHANNELS_PER_LANE = 8  # l2norm partial: 8 consecutive channels per lane, D / 8 lanes per row


class TokenPrep:
    """Tile lookup, gate scan, l2norm and decayed operands of one 16-token tile (device methods)."""

    @property
    def row_lanes(self) -> int:
        """Lanes that share a row of the tile, :data:`CHANNELS_PER_LANE` channels each (16 at D = 128, 8 at 64)."""
        return self.dim // CHANNELS_PER_LANE

    def row_butterfly(self, partial: Float32) -> Float32:
        """The sum of a row's :attr:`row_lanes` lane partials, in every lane of the row: ``shfl.xor`` with offsets
        ``row_lanes / 2, …, 1`` (docs/numerics.md, l2norm: 8, 4, 2, 1 at D = 128)."""
        offset = self.row_lanes // 2
        while offset:
            partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=offset)
            offset //= 2
        return partial

    @cute.jit
    def tile_position(self, tile_slot: Int32, seq_len: Int32, cu_seqlens: Optional[cute.Tensor],
                      tile_base: Optional[cute.Tensor]):
        """(sequence, the tile's index in it, the tile's first token row, the sequence's end row, whether the slot
        is a tile).

        Needs ``self.varlen``. Varlen: the largest sequence whose ``tile_base`` is ≤ the slot (binary search).
        """
        if cutlass.const_expr(self.varlen):
            num_seqs = cu_seqlens.shape[0] - 1
            # largest seq with tile_base[seq] <= tile_slot (empty sequences own no slot)
            lo = Int32(0)
            hi = Int32(num_seqs)
            while lo + 1 < hi:
                mid = (lo + hi) >> 1
                if tile_base[mid] <= tile_slot:
                    lo = mid
                else:
                    hi = mid
            return self.packed_position(lo, tile_slot, cu_seqlens, tile_base)
        tiles_per_seq = (seq_len + CHUNK - 1) // CHUNK
        seq = tile_slot // tiles_per_seq
        seq_end = (seq + 1) * seq_len
        tile_in_seq = tile_slot - seq * tiles_per_seq
        row0 = seq * seq_len + tile_in_seq * CHUNK
        return seq, tile_in_seq, row0, seq_end, True  # the grid is exact

    @cute.jit
    def two_tile_positions(self, tile_slot: Int32, seq_len: Int32, cu_seqlens: Optional[cute.Tensor],
                           tile_base: Optional[cute.Tensor]) -> tuple:
        """:meth:`tile_position` of slots ``tile_slot`` and ``tile_slot + 1``; varlen: the two binary searches in one
        loop, their loads side by side (one chain of dependent round trips, not two)."""
        if cutlass.const_expr(not self.varlen):
            return (self.tile_position(tile_slot, seq_len, cu_seqlens, tile_base),
                    self.tile_position(tile_slot + 1, seq_len, cu_seqlens, tile_base))
        num_seqs = cu_seqlens.shape[0] - 1
        lo_a, hi_a, lo_b, hi_b = Int32(0), Int32(num_seqs), Int32(0), Int32(num_seqs)
        while lo_a + 1 < hi_a or lo_b + 1 < hi_b:  # the two intervals' sizes differ by one at most
            mid_a, mid_b = (lo_a + hi_a) >> 1, (lo_b + hi_b) >> 1
            base_a, base_b = tile_base[mid_a], tile_base[mid_b]
            if lo_a + 1 < hi_a:
                if base_a <= tile_slot:
                    lo_a = mid_a
                else:
                    hi_a = mid_a
            if lo_b + 1 < hi_b:
                if base_b <= tile_slot + 1:
                    lo_b = mid_b
                else:
                    hi_b = mid_b
        return (self.packed_position(lo_a, tile_slot, cu_seqlens, tile_base),
                self.packed_position(lo_b, tile_slot + 1, cu_seqlens, tile_base))

    @cute.jit
    def packed_position(self, seq: Int32, tile_slot: Int32, cu_seqlens: cute.Tensor, tile_base: cute.Tensor):
        """:meth:`tile_position` of a varlen slot in sequence ``seq`` (its binary search done)."""
        num_seqs = cu_seqlens.shape[0] - 1
        seq_start = Int32(cu_seqlens[seq])
        seq_end = Int32(cu_seqlens[seq + 1])
        tile_in_seq = tile_slot - tile_base[seq]
        row0 = seq_start + tile_in_seq * CHUNK
        exists = tile_slot < tile_base[num_seqs]
        return seq, tile_in_seq, row0, seq_end, exists

    @cute.jit
    def locate_tile(self, tile_slot: Int32, seq_len: Int32, cu_seqlens: Optional[cute.Tensor],
                    tile_base: Optional[cute.Tensor]):
        """(first token row of the tile, rows of it inside the sequence, whether the slot is a tile, sequence), from
        :meth:`tile_position`."""
        seq, _, row0, seq_end, exists = self.tile_position(tile_slot, seq_len, cu_seqlens, tile_base)
        return row0, cutlass.min(seq_end - row0, CHUNK), exists, seq

    @cute.jit
    def gate_constants(self, a_log: cute.Tensor, dt_bias: cute.Tensor, head: Int32, col: Int32):
        """(``dt_bias[head, col]``, ``e_a = 2^(A_log[head]·log2 e)``): :meth:`gate_scan`'s constants of channel
        ``col``, read from global memory (issued while the tile's TMA runs)."""
        return dt_bias[head, col], ex2_approx(a_log[head] * Float32(LOG2E))

    @cute.jit
    def load_gate_column(self, g: cute.Tensor, head: Int32, row0: Int32, valid_rows: Int32, col: Int32) -> cute.Tensor:
        """Channel ``col`` of the tile's g rows as fp32 (0 on invalid rows: nothing past the sequence is read)."""
        column = cute.make_rmem_tensor((CHUNK,), Float32)
        for row in cutlass.range_constexpr(CHUNK):
            value = Float32(0.0)
            if row < valid_rows:
                value = g[row0 + row, head, col].to(Float32)
            column[row] = value
        return column

    @cute.jit
    def gate_scan(self, s_g, s_cumsum, col: Int32, dt: Float32, e_a: Float32, c_gate: Float32,
                  valid_rows: Int32) -> Float32:
        """Column ``col``: ``G[r] = G[r-1] + g'[r]`` in row order into ``s_cumsum``; returns ``G[15]``."""
        cumsum = Float32(0.0)
        for row in cutlass.range_constexpr(CHUNK):
            x = e_a * (s_g[row, col].to(Float32) + dt)
            # mul.rn keeps c_gate·sig and the scan's add two roundings (no fma)
            gate = mul_rn(c_gate, sigmoid_approx(x))
            cumsum = cumsum + Float32(cutlass.select_(row < valid_rows, gate, Float32(0.0)))
            s_cumsum[row, col] = cumsum
        return cumsum

    @cute.jit
    def decay(self, s_q, s_k, s_cumsum, s_qd, s_kd, s_kr, s_kinv, scale: Float32, valid_rows: Int32,
              tidx: Int32, s_rinv_q=None, s_rinv_k=None, s_cumsum_next=None, pair_start=None):
        """l2norm and decayed operands (qd, kd, kr, kinv) of this thread's row chunks.

        The outputs may alias the inputs (K1 writes qd over q); ``s_rinv_q`` / ``s_rinv_k`` (``[16]``
        fp32, optional) receive each row's ``1/sqrt(Σx² + EPS)`` (with l2norm only).

        A pair of tiles (docs/numerics.md, "Two tiles a serial step"): for tile a, ``s_cumsum_next`` is tile b's
        ``G`` and kr is measured to the pair's end, ``2^f32(f32(G_last − G) + G_b,last)``; for tile b,
        ``pair_start = (a_last, s_qd_pair, s_kd_pair)`` also writes qd and kd measured from the pair's start,
        ``2^f32(G_a,last + G)``, beside the tile-relative ones; ``a_last`` holds ``G_a,last`` of each of the thread's
        row chunks (:meth:`pair_start_sums`: read before tile b's outputs may overwrite ``G_a``).
        """
        for item in cutlass.range_constexpr(self.decay_items):
            row, chunk = self.row_chunk(tidx, item)
            valid = row < valid_rows
            at = (row, chunk)
            run = (1, CHANNELS_PER_LANE)
            q_in, k_in = self.load_row_chunk(s_q, s_k, row, chunk)
            # a pair's tile reads more sums: they are loaded after the norms' sqrt / rcp (subroutine calls on their
            # slow path), which is what keeps the pair K1 at 64 registers without spills
            pair_tile = s_cumsum_next is not None or pair_start is not None
            if cutlass.const_expr(pair_tile):
                q32, k32, q_rinv, q_rscale, k_rscale = self.chunk_scales(q_in, k_in, valid, scale)
            cum = cute.make_rmem_tensor(run, Float32)
            cum_last = cute.make_rmem_tensor(run, Float32)
            cute.autovec_copy(cute.local_tile(s_cumsum, run, at), cum)
            cute.autovec_copy(cute.local_tile(s_cumsum, run, (CHUNK - 1, chunk)), cum_last)
            next_last = None
            if cutlass.const_expr(s_cumsum_next is not None):
                next_last = cute.make_rmem_tensor(run, Float32)
                cute.autovec_copy(cute.local_tile(s_cumsum_next, run, (CHUNK - 1, chunk)), next_last)
            if cutlass.const_expr(not pair_tile):
                q32, k32, q_rinv, q_rscale, k_rscale = self.chunk_scales(q_in, k_in, valid, scale)
            self.store_row_rinv(s_rinv_q, s_rinv_k, row, chunk, q_rinv, k_rscale)
            before_last, qd_pair, kd_pair = None, None, None
            if cutlass.const_expr(pair_start is not None):
                before_last = pair_start[0][item]
                qd_pair = cute.make_rmem_tensor(run, BFloat16)
                kd_pair = cute.make_rmem_tensor(run, BFloat16)

            qd = cute.make_rmem_tensor(run, BFloat16)
            kd = cute.make_rmem_tensor(run, BFloat16)
            kinv = cute.make_rmem_tensor(run, BFloat16)
            kr = cute.make_rmem_tensor(run, BFloat16)
            for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                q_hat = q32[i] * q_rscale
                k_hat = k32[i] * k_rscale if cutlass.const_expr(self.qk_l2norm) else k32[i]
                decay = ex2_approx(cum[i])
                qd[i] = (q_hat * decay).to(BFloat16)
                kd[i] = (k_hat * decay).to(BFloat16)
                kinv[i] = (k_hat * ex2_approx(-cum[i])).to(BFloat16)
                rest = cum_last[i] - cum[i]
                if cutlass.const_expr(next_last is not None):
                    rest = rest + next_last[i]
                kr[i] = (k_hat * ex2_approx(rest)).to(BFloat16)
                if cutlass.const_expr(pair_start is not None):
                    pair_decay = ex2_approx(before_last[i] + cum[i])
                    qd_pair[i] = (q_hat * pair_decay).to(BFloat16)
                    kd_pair[i] = (k_hat * pair_decay).to(BFloat16)
            cute.autovec_copy(qd, cute.local_tile(s_qd, run, at))
            cute.autovec_copy(kd, cute.local_tile(s_kd, run, at))
            cute.autovec_copy(kr, cute.local_tile(s_kr, run, at))
            cute.autovec_copy(kinv, cute.local_tile(s_kinv, run, at))
            if cutlass.const_expr(pair_start is not None):
                cute.autovec_copy(qd_pair, cute.local_tile(pair_start[1], run, at))
                cute.autovec_copy(kd_pair, cute.local_tile(pair_start[2], run, at))

    @cute.jit
    def pair_start_sums(self, s_cumsum_a, tidx: Int32) -> tuple:
        """``G_a,last`` (row 15 of tile a's ``s_cumsum_a``) of each of this thread's row chunks, in registers: tile
        b's ``pair_start`` of :meth:`decay`."""
        run = (1, CHANNELS_PER_LANE)
        sums = []
        for item in cutlass.range_constexpr(self.decay_items):
            _, chunk = self.row_chunk(tidx, item)
            last = cute.make_rmem_tensor(run, Float32)
            cute.autovec_copy(cute.local_tile(s_cumsum_a, run, (CHUNK - 1, chunk)), last)
            sums.append(last)
        return tuple(sums)

    def row_chunk(self, tidx: Int32, item: int) -> tuple:
        """(row, 8-channel chunk) of this thread's ``item``-th of its ``decay_items`` row chunks (:attr:`row_lanes`
        lanes a row)."""
        flat = tidx + item * self.num_threads
        return flat // self.row_lanes, flat % self.row_lanes

    @cute.jit
    def load_row_chunk(self, s_q, s_k, row: Int32, chunk: Int32) -> tuple:
        """Channels ``8·chunk …`` of row ``row`` of q and k (registers of the tiles' bf16 or fp16;
        :meth:`chunk_scales` widens them)."""
        run = (1, CHANNELS_PER_LANE)
        q_in = cute.make_rmem_tensor(run, s_q.element_type)
        k_in = cute.make_rmem_tensor(run, s_k.element_type)
        cute.autovec_copy(cute.local_tile(s_q, run, (row, chunk)), q_in)
        cute.autovec_copy(cute.local_tile(s_k, run, (row, chunk)), k_in)
        return q_in, k_in

    @cute.jit
    def chunk_scales(self, q_in: cute.Tensor, k_in: cute.Tensor, valid, scale: Float32) -> tuple:
        """A :meth:`load_row_chunk` pair in fp32, zero where not ``valid``, and the row's scales:
        ``(q32, k32, q_rinv, q_rscale, k_rscale)`` with ``q_rinv = 1/sqrt(Σq² + EPS)``, ``q_rscale = q_rinv ·
        scale`` and ``k_rscale`` k's ``1/sqrt(Σk² + EPS)`` (:meth:`row_rsqrt`); without l2norm ``q_rscale =
        scale``, ``k_rscale = 1`` and ``q_rinv`` is not used."""
        run = (1, CHANNELS_PER_LANE)
        q32 = cute.make_rmem_tensor(run, Float32)
        k32 = cute.make_rmem_tensor(run, Float32)
        for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
            q32[i] = Float32(cutlass.select_(valid, q_in[i].to(Float32), Float32(0.0)))
            k32[i] = Float32(cutlass.select_(valid, k_in[i].to(Float32), Float32(0.0)))
        q_rinv = Float32(1.0)
        q_rscale = scale
        k_rscale = Float32(1.0)
        if cutlass.const_expr(self.qk_l2norm):
            q_rinv = self.row_rsqrt(q32)
            q_rscale = q_rinv * scale
            k_rscale = self.row_rsqrt(k32)
        return q32, k32, q_rinv, q_rscale, k_rscale

    @cute.jit
    def store_row_rinv(self, s_rinv_q, s_rinv_k, row: Int32, chunk: Int32, q_rinv: Float32, k_rinv: Float32):
        """With l2norm and row vectors given (Kernel B keeps them for the l2norm backward): the row's
        ``1/‖q‖`` and ``1/‖k‖`` (:meth:`chunk_scales`), written once a row, by its first chunk's lane."""
        if cutlass.const_expr(self.qk_l2norm and s_rinv_q is not None):
            if chunk == 0:
                s_rinv_q[row] = q_rinv
                s_rinv_k[row] = k_rinv

    @cute.jit
    def base2_log_decay(self, g: Float32, dt: Float32, e_a: Float32) -> Float32:
        """``g'`` (base 2, ≤ 0) of one entry: softplus ``−e^A · softplus2(g + dt_bias)`` or ``g · log2 e``.

        ``softplus2(x) = max(y, 0) + lg2(1 + 2^−|y|)`` with ``y = x · log2 e``: no overflow for any g. The
        final products are ``mul.rn`` so that the scan's add stays a separate rounding.
        """
        if cutlass.const_expr(self.gate == "softplus"):
            y = (g + dt) * Float32(LOG2E)
            softplus2 = cutlass.max(y, Float32(0.0)) + lg2_approx(Float32(1.0) + ex2_approx(cutlass.min(y, -y)))
            return -mul_rn(e_a, softplus2)
        return mul_rn(g, Float32(LOG2E))

    @cute.jit
    def dyadic_channel_scan(self, sink, gate_in: cute.Tensor, dt: Float32, e_a: Float32, valid_rows: Int32) -> Float32:
        """One channel of every row of the tile, the per-channel unbounded gates' ``dyadic`` scan (docs/numerics.md);
        returns ``G_15``. K1 runs it to fill the workspace and Kernel B to recompute it, with the same instructions
        in the same order; ``sink`` says where each value goes (the two kernels keep different buffers).

        ``sink`` reads ``k(row)``, ``q(row)`` (raw bf16 or fp16), ``k_scale(row)`` (1/‖k‖, under l2norm),
        ``q_scale(row)`` (1/‖q‖ · scale) and takes, in this order:

        1. rows last to first: ``suffix(row, kh, growth)``, ``growth = 2^(G_15 − G_row)`` (for ``kr``);
        2. rows first to last: ``prefix(row, qh, kh, decay)``, ``decay = 2^G_row`` (for ``qd``, ``kd``);
        3. per level ``ℓ`` (blocks of ``b = DYADIC_BLOCKS[ℓ]`` rows from ``start``, middle row ``m`` the last of
           the first half): ``lower(ℓ, start, r, factor, kh)`` for ``r = m … start`` (``factor`` the running
           product ``a_m·…·a_{r+1}``, 1 at ``m``) and ``upper(ℓ, start, r, factor, kh, qh)`` for
           ``r = m+1 … start+b−1`` (``a_{m+1}·…·a_r``), with ``a = 2^g'``.
        """
        gp = cute.make_rmem_tensor((CHUNK,), Float32)
        a = cute.make_rmem_tensor((CHUNK,), Float32)
        qh = cute.make_rmem_tensor((CHUNK,), Float32)
        kh = cute.make_rmem_tensor((CHUNK,), Float32)
        # rows last to first first (g' and kh, the suffix sum, kr), so that g' is live during one pass only
        suffix = Float32(0.0)
        for step in cutlass.range_constexpr(CHUNK):
            row = CHUNK - 1 - step
            valid = row < valid_rows
            gp[row] = Float32(cutlass.select_(valid, self.base2_log_decay(gate_in[row], dt, e_a), Float32(0.0)))
            k_raw = Float32(cutlass.select_(valid, sink.k(row).to(Float32), Float32(0.0)))
            kh[row] = k_raw * sink.k_scale(row) if cutlass.const_expr(self.qk_l2norm) else k_raw
            sink.suffix(row, kh[row], ex2_approx(suffix))
            suffix = suffix + gp[row]
        prefix = Float32(0.0)
        for row in cutlass.range_constexpr(CHUNK):
            a[row] = ex2_approx(gp[row])
            prefix = prefix + gp[row]
            q_raw = Float32(cutlass.select_(row < valid_rows, sink.q(row).to(Float32), Float32(0.0)))
            qh[row] = q_raw * sink.q_scale(row)
            sink.prefix(row, qh[row], kh[row], ex2_approx(prefix))
        for level in cutlass.range_constexpr(len(DYADIC_BLOCKS)):
            block = DYADIC_BLOCKS[level]
            half = block // 2
            for start in cutlass.range_constexpr(0, CHUNK, block):
                middle = start + half - 1
                factor = Float32(1.0)
                for r in cutlass.range_constexpr(middle, start - 1, -1):
                    if cutlass.const_expr(r < middle):
                        factor = factor * a[r + 1]
                    sink.lower(level, start, r, factor, kh[r])
                factor = a[middle + 1]
                for r in cutlass.range_constexpr(middle + 1, start + block):
                    if cutlass.const_expr(r > middle + 1):
                        factor = factor * a[r]
                    sink.upper(level, start, r, factor, kh[r], qh[r])
        return prefix

    @cute.jit
    def head_gate_inputs(self, g: cute.Tensor, a_log: Optional[cute.Tensor], dt_bias: Optional[cute.Tensor],
                         head: Int32, row0: Int32, valid_rows: Int32, row: Int32) -> tuple:
        """The loads of :meth:`head_gate_rows` for row ``row`` (< 16), issued before anything waits on them: (the raw
        g of the row, dt_bias[head], A_log[head]; the last two None for the log decay). Rows at and past
        ``valid_rows`` (≥ 1) read the last valid row, which :meth:`head_gate_rows` drops: every load is in bounds and
        none sits behind a branch, so they go out beside the caller's other loads (perf-log GDN7)."""
        g_raw = g[row0 + cutlass.min(row, valid_rows - 1), head]
        dt_raw, a_log_raw = None, None
        if cutlass.const_expr(self.gate != "none"):
            dt_raw, a_log_raw = dt_bias[head], a_log[head]
        return g_raw, dt_raw, a_log_raw

    @cute.jit
    def head_gate_rows(self, inputs: tuple, valid_rows: Int32, s_gate, s_decay, s_spans, s_prefix, s_suffix,
                       lane: Int32) -> tuple:
        """One warp, row ``lane % 16`` a lane (lanes 16-31 repeat rows 0-15 and store nothing), from the loads of
        :meth:`head_gate_inputs`: ``g'`` of the row (0 at and past ``valid_rows``) into ``s_gate`` and ``a = 2^g'``
        into ``s_decay``; then, after ``bar.warp.sync``, the row's ``2^G`` (prefix sum of g' over rows ≤ r, in row
        order) into ``s_prefix``, its ``2^Gs`` (suffix sum over rows > r, from row 15 down) into ``s_suffix``, and
        column r of the pair decays, ``E[r, r] = 1``, ``E[i, r] = f32(E[i−1, r]·a_i)`` below the diagonal, 0 above it,
        into ``s_spans``. Each lane adds and multiplies in the order one thread walking the rows would, so the values
        are those of a serial walk. Returns the head's ``(dt_bias, e^A)`` (0 and 1 for the log decay)."""
        g_raw, dt_raw, a_log_raw = inputs
        dt, e_a = Float32(0.0), Float32(1.0)
        if cutlass.const_expr(self.gate != "none"):
            dt, e_a = dt_raw, ex2_approx(a_log_raw * Float32(LOG2E))
        row = lane % CHUNK
        gate = Float32(0.0)
        if row < valid_rows:
            gate = self.base2_log_decay(g_raw.to(Float32), dt, e_a)
        decay = ex2_approx(gate)
        if lane < CHUNK:
            s_gate[row] = gate
            s_decay[row] = decay
        cute.arch.sync_warp()
        prefix = Float32(0.0)
        suffix = Float32(0.0)
        span = Float32(1.0)
        for r in cutlass.range_constexpr(CHUNK):
            prefix = cutlass.select_(r <= row, prefix + s_gate[r], prefix)
            suffix = cutlass.select_(CHUNK - 1 - r > row, suffix + s_gate[CHUNK - 1 - r], suffix)
            span = cutlass.select_(r > row, span * s_decay[r], span)
            if lane < CHUNK:
                s_spans[r, row] = cutlass.select_(r >= row, span, Float32(0.0))
        if lane < CHUNK:
            s_prefix[row] = ex2_approx(prefix)
            s_suffix[row] = ex2_approx(suffix)
        return dt, e_a

    @cute.jit
    def decay_per_row(self, s_q, s_k, s_qd, s_kd, s_kr, s_q_hat, s_k_hat, s_prefix, s_suffix, scale: Float32,
                      valid_rows: Int32, tidx: Int32, s_rinv_q=None, s_rinv_k=None, tile_relative=None):
        """A per-head gate's :meth:`decay`: this thread's row chunks, the l2norm, qd and kd (which may alias q and
        k), kr, and the bf16 rows ``q̂``, ``k̂``, from the per-row ``2^G`` and ``2^Gs`` of :meth:`head_gate_rows`;
        ``s_rinv_q`` / ``s_rinv_k`` as :meth:`decay`'s. ``tile_relative``: ``(qd, kd, kr, s_prefix, s_suffix, store)``,
        global ``[16, D]`` tiles (each may be None) that also take the rows' qd, kd, kr from these per-row factors
        where ``store`` holds (a pair K1's partner fields: the tile's own factors where ``s_prefix`` / ``s_suffix`` are
        the pair's)."""
        for item in cutlass.range_constexpr(self.decay_items):
            row, chunk = self.row_chunk(tidx, item)
            valid = row < valid_rows
            at = (row, chunk)
            run = (1, CHANNELS_PER_LANE)
            q_in, k_in = self.load_row_chunk(s_q, s_k, row, chunk)
            q32, k32, q_rinv, q_rscale, k_rscale = self.chunk_scales(q_in, k_in, valid, scale)
            self.store_row_rinv(s_rinv_q, s_rinv_k, row, chunk, q_rinv, k_rscale)
            decay, rest = s_prefix[row], s_suffix[row]
            qd = cute.make_rmem_tensor(run, BFloat16)
            kd = cute.make_rmem_tensor(run, BFloat16)
            kr = cute.make_rmem_tensor(run, BFloat16)
            q_hat = cute.make_rmem_tensor(run, BFloat16)
            k_hat = cute.make_rmem_tensor(run, BFloat16)
            for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                qh = q32[i] * q_rscale
                kh = k32[i] * k_rscale if cutlass.const_expr(self.qk_l2norm) else k32[i]
                qd[i] = (qh * decay).to(BFloat16)
                kd[i] = (kh * decay).to(BFloat16)
                kr[i] = (kh * rest).to(BFloat16)
                q_hat[i] = qh.to(BFloat16)
                k_hat[i] = kh.to(BFloat16)
            for values, tile in ((qd, s_qd), (kd, s_kd), (kr, s_kr), (q_hat, s_q_hat), (k_hat, s_k_hat)):
                cute.autovec_copy(values, cute.local_tile(tile, run, at))
            if cutlass.const_expr(tile_relative is not None):
                self.store_tile_relative(tile_relative, q32, k32, q_rscale, k_rscale, row, at)

    @cute.jit
    def store_tile_relative(self, tile_relative: tuple, q32, k32, q_rscale: Float32, k_rscale: Float32, row: Int32,
                            at: tuple):
        """:meth:`decay_per_row`'s ``tile_relative`` stores of one row chunk: ``bf16(q̂ · 2^G)``, ``bf16(k̂ · 2^G)``,
        ``bf16(k̂ · 2^Gs)`` with the tile's own per-row factors, today's K1's instructions."""
        g_qd, g_kd, g_kr, s_prefix, s_suffix, store = tile_relative
        run = (1, CHANNELS_PER_LANE)
        decay, rest = s_prefix[row], s_suffix[row]
        for tile, from_q, factor in ((g_qd, True, decay), (g_kd, False, decay), (g_kr, False, rest)):
            if cutlass.const_expr(tile is not None):
                values = cute.make_rmem_tensor(run, BFloat16)
                for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                    if cutlass.const_expr(from_q):
                        x = q32[i] * q_rscale
                    else:
                        x = k32[i] * k_rscale if cutlass.const_expr(self.qk_l2norm) else k32[i]
                    values[i] = (x * factor).to(BFloat16)
                if store:
                    cute.autovec_copy(values, cute.local_tile(tile, run, at))

    @cute.jit
    def row_rsqrt(self, x: cute.Tensor) -> Float32:
        """``1 / sqrt(Σ x² + EPS)`` of one row, :attr:`row_lanes` lanes × 8 channels, in the order of numerics.md."""
        partial = Float32(0.0)
        for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
            partial = partial + x[i] * x[i]  # x² is exact: fma or not, one rounding
        partial = self.row_butterfly(partial)
        return Float32(1.0) / cute.math.sqrt(partial + Float32(EPS))
