"""K2 over pairs of tiles: the two-tile serial step (docs/numerics.md, "Two tiles a serial step"; the mirror is
``cute_kda.reference.pairs.mirror_recurrence_pairs``), inference.

K2's step is mostly fixed latency (a dependent chain of small products), so a step over two tiles costs far less
than two steps (docs/perf-log.md, v8). It reads the pair workspace of K1's pair variant
(:class:`~cute_kda.kernels.fwd_prepare.SafePairPrepare`): tiles a, b of a pair run against the state ``S`` entering
the pair, tile b through its pair-relative ``kd_b'``, ``qd_b'`` and the cross blocks ``P``, ``Q``::

    u_a = bf16(f32(v_a − kd_a·S)·β_a),  U_a = bf16(INV_a·u_a),  o_a = bf16(qd_a·S + Mqk_a·U_a)
    u_b = bf16(f32(v_b − (kd_b'·S + P·U_a))·β_b),  U_b = bf16(INV_b·u_b)
    o_b = bf16(qd_b'·S + Q·U_a + Mqk_b·U_b)
    S32 ← kr_a'ᵀ·U_a + kr_bᵀ·U_b + f32(gT_pair·S32),  S = bf16(S32)

(``kr_a'`` is measured to the pair's end, ``gT_pair`` in tile a's slot). A sequence's odd last tile runs K2's
step. Everything else is :class:`~cute_kda.kernels.fwd_recurrence.FwdRecurrence`'s: roles, the state in registers,
state I/O and pools; the load warp still moves one tile a stage (and the cross blocks in every stage), the compute
warps take two stages a step; 6 input and 4 output stages keep three pairs in flight.

The training variant (``checkpoints``; planned W2 of docs/perf-log.md v8, whose Kernel B rebuilds the state between
a pair's tiles) keeps ``S = bf16(S32)`` entering each pair (and the lone tile) in row ``head · slots + (g + s) // 2``
of the checkpoint images, ``g`` the global tile of the pair's tile a and ``s`` the sequence
(:func:`cute_kda.workspace.pair_block_slots`), as K2 keeps a tile's; and tile a's ``U`` (bf16, value-major
``[D, 16]``, as Phase 6 reads it) in the same row of ``u_a``, stored from the registers as 32-bit words of two token
rows. It runs under a launch bound of one CTA an SM. Mirror: ``mirror_recurrence_pairs`` with ``checkpoints`` and
``u_a``. Without token outputs (the backward's recomputation under ``STATES_ONLY_PASSES``, as K2's) the step loads no
qd, Mqk or Q, forms no ``qd·S`` and no o: the same kept states and U.
"""

from __future__ import annotations

from typing import Optional

from ..dsl import cute, cutlass  # first: sets the target architecture before the DSL loads

import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr

from ..layouts.fwd_recurrence import RecurrenceSmemPlan
from ..numerics import CHUNK
from .common.copy import c_row_half, transpose_c_to_b
from .common.fastmath import mul_rn
from .fwd_recurrence import FwdRecurrence, PrefixCheckpoints, RecurrenceSmem

PAIR_INPUT_STAGES = 6  # three pairs in flight (perf-log v8 measured the probe at 6 / 4)
PAIR_OUTPUT_STAGES = 4


class PairRecurrence(FwdRecurrence):
    """K2's two-tile step (module docstring); :class:`FwdRecurrence`'s configuration, ``checkpoints`` a pair's."""

    kept_a_pair = True

    def __init__(self, **config) -> None:
        if config.get("checkpoint_every", 2) != 2:
            raise ValueError("the two-tile step keeps a checkpoint a pair (checkpoint_every 2)")
        super().__init__(**{**config, "checkpoint_every": 2})

    @property
    def launch_min_blocks(self) -> int:
        """The training variant (and any pass without token outputs) runs under a launch bound of one CTA an SM:
        without it ptxas caps its registers for occupancy and spills (72 at D = 64, V-split 4)."""
        return 1 if self.checkpoints or not self.token_outputs else 0

    def make_plan(self, vsplit: int, state_io_fp32: bool, dim: int) -> RecurrenceSmemPlan:
        return RecurrenceSmemPlan(vsplit=vsplit, state_io_fp32=state_io_fp32, dim=dim, pairs=True,
                                  input_stages=PAIR_INPUT_STAGES, output_stages=PAIR_OUTPUT_STAGES,
                                  token_outputs=self.token_outputs)

    @cute.jit
    def compute(
        self, warp_idx: Int32, num_tiles: Int32,
        load_pipe: pipeline.PipelineTmaAsync, store_pipe: pipeline.PipelineAsync, smem: RecurrenceSmem,
        state32: tuple, band: Int32, first_tile: Int32, checkpoint_row0: Int32,
        checkpoints: Optional[cute.Tensor], prefix: Optional[PrefixCheckpoints] = None,
        u_a: Optional[cute.Tensor] = None,
    ):
        """The pair steps, then the lone last tile of an odd count, on the warp's ``warp_cols`` value columns;
        ``state32`` as :meth:`FwdRecurrence.compute`'s. Phase numbers are K2's (module docstring of
        :mod:`~cute_kda.kernels.fwd_recurrence`): Phase 1 of both tiles against ``S``, then tile a's Phases 2-5,
        tile b's with the cross terms, and one Phase 6 for the pair. The training variant keeps the state entering
        each step in checkpoint row ``checkpoint_row0 + (first_tile + tile a) // 2`` as K2 keeps a tile's, and tile
        a's ``U`` in that row of ``u_a`` (:meth:`store_u_rows`)."""
        lane = cute.arch.lane_idx()
        group = lane // 4
        cols = self.warp_cols
        dim = self.dim
        k_steps = dim // CHUNK

        (tiled_mma, ldsm_a, ldsm_a_t, ldsm_b, ldsm_c, stsm_c, stsm_c_t, p_kd, p_qd, p_inv, p_mqk, p_kr_t, p_state, p_v,
         p_out, p_state_acc_st) = self.warp_views(warp_idx, smem, lane)
        outputs = self.token_outputs  # o and what only it reads (qd, Mqk, Q): with the token outputs only
        p_cross_kd = ldsm_a.partition_S(smem.cross_kd)  # (CPY, 1, 1, stage), as INV
        p_cross_qd, r_qd, acc_qs, r_o, v_qd, v_out = None, None, None, None, None, None
        if const_expr(outputs):
            p_cross_qd = ldsm_a.partition_S(smem.cross_qd)

        def fragment_a(shape):
            return tiled_mma.make_fragment_A(tiled_mma.partition_shape_A(shape))

        def fragment_b(shape):
            return tiled_mma.make_fragment_B(tiled_mma.partition_shape_B(shape))

        c_shape = tiled_mma.partition_shape_C((CHUNK, cols))  # ((2,2), 1, n)
        r_kd = (fragment_a((CHUNK, dim)), fragment_a((CHUNK, dim)))  # tile a's, tile b's
        if const_expr(outputs):
            r_qd = (fragment_a((CHUNK, dim)), fragment_a((CHUNK, dim)))
        r_state = fragment_b((cols, dim))
        r_square = fragment_a((CHUNK, CHUNK))  # INV, Mqk, P, Q in turn
        r_kr_t = (fragment_a((dim, CHUNK)), fragment_a((dim, CHUNK)))
        acc_ks = (tiled_mma.make_fragment_C(c_shape), tiled_mma.make_fragment_C(c_shape))
        if const_expr(outputs):
            acc_qs = (tiled_mma.make_fragment_C(c_shape), tiled_mma.make_fragment_C(c_shape))  # qS, then o
        acc = tiled_mma.make_fragment_C(c_shape)  # INV·u
        r_v = cute.make_rmem_tensor(c_shape, self.token_dtype)
        r_c16 = cute.make_rmem_tensor(c_shape, BFloat16)  # u, then U (bf16 C fragments)
        if const_expr(outputs):
            r_o = cute.make_rmem_tensor(c_shape, self.token_dtype)
        r_u_b = fragment_b((cols, CHUNK))  # u as B
        r_big_u_b = (fragment_b((cols, CHUNK)), fragment_b((cols, CHUNK)))  # U_a, U_b as B (Phases 2b-6)
        r_state_acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((dim, cols)), BFloat16)

        v_kd = tuple(ldsm_a.retile(r) for r in r_kd)
        if const_expr(outputs):
            v_qd = tuple(ldsm_a.retile(r) for r in r_qd)
        v_state = ldsm_b.retile(r_state)
        v_square = ldsm_a.retile(r_square)
        v_kr_t = tuple(ldsm_a_t.retile(r) for r in r_kr_t)
        v_v = ldsm_c.retile(r_v)
        if const_expr(outputs):
            v_out = stsm_c.retile(r_o)
        v_state_acc_st = stsm_c_t.retile(r_state_acc)
        state_words = cute.recast_tensor(r_state_acc, Uint32)

        load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.plan.input_stages)
        out_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.plan.output_stages)
        # the pairs, then (an odd count) the lone last tile: the step's code once with tile b, once without
        for lone in cutlass.range_constexpr(2):
            tiles = 1 if const_expr(lone) else 2
            steps = num_tiles % 2 if const_expr(lone) else num_tiles // 2
            for step in cutlass.range(steps, unroll=1):
                if const_expr(self.checkpoints):
                    tile_a = num_tiles - 1 if const_expr(lone) else 2 * step
                    kept_row = checkpoint_row0 + (first_tile + tile_a) // 2
                    checkpoint = self.band_image(checkpoints, kept_row)
                    if const_expr(self.image_by_bulk):  # the state buffer as the last step left it (fenced)
                        self.store_band_image(checkpoint, smem.state, band, warp_idx)
                # the pipeline states advance in this body (the tracer carries them only through rebinds it sees)
                stages, held = [], []
                for j in cutlass.range_constexpr(tiles):
                    load_pipe.consumer_wait(load_state)
                    stages.append(load_state.index)
                    held.append(load_state.clone())
                    load_state.advance()
                # the pair's decay (tile a's slot), read now so that Phase 6 waits on no load
                decays = [self.fragment_rows(smem.gt, stages[0], group, m) for m in range(k_steps)]

                # Phase 1: kS = kd·S, qS = qd·S of every tile; the operands of step k+1 load before the mma of k
                for j in cutlass.range_constexpr(tiles):
                    acc_ks[j].fill(0.0)
                    if const_expr(outputs):
                        acc_qs[j].fill(0.0)
                    cute.copy(ldsm_a, p_kd[None, None, 0, stages[j]], v_kd[j][None, None, 0])
                    if const_expr(outputs):
                        cute.copy(ldsm_a, p_qd[None, None, 0, stages[j]], v_qd[j][None, None, 0])
                cute.copy(ldsm_b, p_state[None, None, 0], v_state[None, None, 0])
                for k in cutlass.range_constexpr(k_steps):
                    if const_expr(k + 1 < k_steps):
                        for j in cutlass.range_constexpr(tiles):
                            cute.copy(ldsm_a, p_kd[None, None, k + 1, stages[j]], v_kd[j][None, None, k + 1])
                            if const_expr(outputs):
                                cute.copy(ldsm_a, p_qd[None, None, k + 1, stages[j]], v_qd[j][None, None, k + 1])
                        cute.copy(ldsm_b, p_state[None, None, k + 1], v_state[None, None, k + 1])
                    for j in cutlass.range_constexpr(tiles):
                        cute.gemm(tiled_mma, acc_ks[j], r_kd[j][None, None, k], r_state[None, None, k], acc_ks[j])
                        if const_expr(outputs):
                            cute.gemm(tiled_mma, acc_qs[j], r_qd[j][None, None, k], r_state[None, None, k],
                                      acc_qs[j])
                if const_expr(self.checkpoints and not self.image_by_bulk):  # narrow bands: S as Phase 1 loaded it
                    self.store_band_fragment(checkpoint, r_state, band, warp_idx, lane)

                for j in cutlass.range_constexpr(tiles):
                    stage = stages[j]
                    if const_expr(j == 1):  # tile b reads the state entering the pair plus tile a's writes: P·U_a
                        cute.copy(ldsm_a, p_cross_kd[None, None, None, stage], v_square)
                        cute.gemm(tiled_mma, acc_ks[1], r_square[None, None, 0], r_big_u_b[0][None, None, 0],
                                  acc_ks[1])
                    # Phase 2: u = bf16(f32(v − kS)·β) in C format
                    cute.copy(ldsm_c, p_v[None, None, None, stage], v_v)
                    cute.copy(ldsm_a, p_inv[None, None, None, stage], v_square)
                    beta = self.fragment_rows(smem.beta, stage, group)
                    for i in cutlass.range_constexpr(cute.size(acc_ks[j])):
                        r_c16[i] = BFloat16((Float32(r_v[i]) - acc_ks[j][i]) * beta[c_row_half(i)])
                    # Phase 3: U = bf16(INV·u), u moved C → B in registers
                    transpose_c_to_b(r_c16, r_u_b)
                    acc.fill(0.0)
                    cute.gemm(tiled_mma, acc, r_square[None, None, 0], r_u_b[None, None, 0], acc)
                    r_c16.store(acc.load().to(BFloat16))
                    transpose_c_to_b(r_c16, r_big_u_b[j])
                    if const_expr(self.checkpoints and j == 0 and tiles == 2):  # tile a's U as Phase 6 reads it
                        self.store_u_rows(u_a, kept_row, r_big_u_b[0], band, warp_idx, lane)
                    if const_expr(outputs):
                        # Phase 4: o = qS (+ Q·U_a) + Mqk·U
                        if const_expr(j == 1):
                            cute.copy(ldsm_a, p_cross_qd[None, None, None, stage], v_square)
                            cute.gemm(tiled_mma, acc_qs[1], r_square[None, None, 0], r_big_u_b[0][None, None, 0],
                                      acc_qs[1])
                        cute.copy(ldsm_a, p_mqk[None, None, None, stage], v_square)
                        cute.gemm(tiled_mma, acc_qs[j], r_square[None, None, 0], r_big_u_b[j][None, None, 0],
                                  acc_qs[j])
                        r_o.store(acc_qs[j].load().to(self.token_dtype))
                        # Phase 5: o → output stage
                        self.store_outputs(store_pipe, out_state, ((stsm_c, v_out, p_out),))
                        out_state.advance()

                # Phase 6: S32 ← Σ_j kr_jᵀ·U_j + f32(gT_pair·S32), a row block of 16 k at a time (after the
                # checkpoint's copy has read the state buffer)
                if const_expr(self.checkpoints and self.image_by_bulk):
                    self.wait_band_image_read()
                for j in cutlass.range_constexpr(tiles):
                    cute.copy(ldsm_a_t, p_kr_t[None, 0, None, stages[j]], v_kr_t[j][None, 0, None])
                for m in cutlass.range_constexpr(k_steps):
                    block = state32[m]
                    for i in cutlass.range_constexpr(cute.size(block)):
                        block[i] = mul_rn(decays[m][c_row_half(i)], block[i])
                    for j in cutlass.range_constexpr(tiles):
                        cute.gemm(tiled_mma, block, r_kr_t[j][None, m, None], r_big_u_b[j][None, None, 0], block)
                    if const_expr(m + 1 < k_steps):
                        for j in cutlass.range_constexpr(tiles):
                            cute.copy(ldsm_a_t, p_kr_t[None, m + 1, None, stages[j]], v_kr_t[j][None, m + 1, None])
                    self.round_block(block, state_words, m)
                    cute.copy(stsm_c_t, v_state_acc_st[None, m, None], p_state_acc_st[None, m, None])

                # the warp's state columns and its reads of these stages are complete before lane 0 releases them
                # (and its state writes fenced for the next step's checkpoint copy)
                if const_expr(self.checkpoints and self.image_by_bulk):
                    cute.arch.fence_view_async_shared()
                cute.arch.sync_warp()
                for j in cutlass.range_constexpr(tiles):
                    load_pipe.consumer_release(held[j])
                if const_expr(self.prefix_checkpoint_every > 0):
                    last = num_tiles - 1 if const_expr(lone) else 2 * step + 1
                    self.store_prefix_checkpoint(last, state32, prefix, band, warp_idx)

    @cute.jit
    def store_u_rows(self, u_a: cute.Tensor, row: Int32, fragment: cute.Tensor, band: Int32, warp_idx: Int32,
                     lane: Int32):
        """Tile a's ``U`` as Phase 6 reads it, the warp's bf16 B fragment ``((2, 2), n, 1)`` of its ``[warp_cols, 16]``
        columns (``Uᵀ``) → row ``row`` of ``u_a`` (``[rows, D, 16]`` bf16, value-major): each lane stores its pairs
        of consecutive token rows as 32-bit words.

        Word ``((0, h), j, 0)`` holds ``[v, r], [v, r + 1]`` with ``v = 8j + g`` of the warp's columns,
        ``r = 2q + 8h`` (``g = lane / 4``, ``q = lane % 4``): ``8v + q + 4h`` words into the row."""
        first_v = band * self.v_band + warp_idx * self.warp_cols + lane // 4
        first = (Int64(row) * self.dim + first_v) * CHUNK + 2 * (lane % 4)
        # rows of 16 bf16 and even token rows: the words are 4-byte aligned
        words_ptr = cute.make_ptr(Uint32, (u_a.iterator + first).toint(), cute.AddressSpace.gmem, assumed_align=4)
        target = cute.make_tensor(words_ptr, cute.make_layout(((1, 2), self.warp_cols // 8, 1),
                                                              stride=((0, 4), 8 * CHUNK // 2, 0)))
        words = cute.recast_tensor(fragment, Uint32)
        for i in cutlass.range_constexpr(cute.size(words)):
            target[i] = words[i]
