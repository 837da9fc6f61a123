"""Kernel A over pairs of tiles: the adjoint of K2's two-tile step (docs/numerics.md, "Two tiles a serial step"; the
mirror is ``cute_kda.reference.pairs.mirror_bwd_scan_pairs``), for the training form planned as W2 of
docs/perf-log.md v8.

Kernel A's tile step is mostly fixed latency as K2's is (perf-log A8: a probe of this step ran −14 to −28 % a tile).
It reads the pair workspace of K1's pair variant and walks each pair b then a from the state gradient ``dS'``
leaving it (``dS32`` fp32 in the compute warps' registers, its bf16 rounding the products' operand)::

    dU_b = bf16(Mqk_bᵀ·dO_b + kr_b·dS'),  du_b = INV_bᵀ·dU_b,  dv_b = bf16(β_b·du_b)
    dU_a = bf16(Mqk_aᵀ·dO_a + kr_a'·dS' + Qᵀ·dO_b − Pᵀ·dv_b),  du_a, dv_a likewise
    dS32 ← qd_aᵀ·dO_a − kd_aᵀ·dv_a + qd_b'ᵀ·dO_b − kd_b'ᵀ·dv_b + f32(gT_pair·dS32)   (one block update)

each line one fp32 accumulator. A sequence's odd last tile (the first the scan meets) runs Kernel A's step. The
snapshot of a step is ``dS'`` as the band buffer holds it when the step starts, kept in row
``head · slots + (g + s) // 2`` (``g`` the global tile of the pair's tile a, ``s`` the sequence;
:func:`cute_kda.workspace.pair_block_slots`) as Kernel A keeps a tile's; Kernel B rebuilds the gradient between a
pair's tiles from it (``cute_kda.reference.pair_backward``). Everything else is
:class:`~cute_kda.kernels.bwd_scan.BwdScan`'s; the load warp moves one tile a stage (the cross blocks in every
stage), the compute warps take two stages a step.
"""

from __future__ import annotations

from ..dsl import cute, cutlass  # first: sets the target architecture before the DSL loads

import cutlass.pipeline as pipeline
from cutlass import BFloat16, Int32, Uint32, const_expr

from ..layouts.bwd_scan import ScanSmemPlan
from ..numerics import CHUNK
from .bwd_scan import BwdScan, ScanSmem
from .common.copy import c_row_half, transpose_c_to_b
from .common.fastmath import mul_rn
from .fwd_recurrence_pairs import PAIR_INPUT_STAGES


class PairBwdScan(BwdScan):
    """Kernel A's two-tile step (module docstring): :class:`BwdScan`'s configuration with a snapshot a pair, token
    outputs and one G2 accumulator."""

    kept_a_pair = True

    def __init__(self, **config) -> None:
        if config.get("snapshot_every", 2) != 2 or config.get("split_accumulator") or \
                config.get("token_outputs") is False:
            raise ValueError("the two-tile scan keeps a snapshot a pair (snapshot_every 2), writes its token outputs "
                             "and runs G2 on one accumulator")
        super().__init__(**{**config, "snapshot_every": 2})

    def make_plan(self, **plan) -> ScanSmemPlan:
        return ScanSmemPlan(**plan, pairs=True, input_stages=PAIR_INPUT_STAGES)

    @cute.jit
    def compute(
        self, warp_idx: Int32, band: Int32, num_tiles: Int32, first_tile: Int32, snapshot_row0: Int32,
        load_pipe: pipeline.PipelineTmaAsync, store_pipe: pipeline.PipelineAsync, smem: ScanSmem,
        ds32: tuple, snapshots: cute.Tensor,
    ):
        """The lone last tile of an odd count, then the pairs from the last, on the warp's ``warp_cols`` value
        columns; arguments as :meth:`BwdScan.compute`'s (``snapshot_row0 + (first_tile + a) // 2`` the snapshot row
        of the step whose tile a is local tile ``a``). Stage ``0`` of a pair step is tile b's, ``1`` tile a's (the
        load warp's reverse order)."""
        lane = cute.arch.lane_idx()
        group = lane // 4
        cols = self.warp_cols
        dim = self.dim
        k_steps = dim // CHUNK

        (tiled_mma, ldsm_a, ldsm_a_t, ldsm_b, ldsm_b_t, stsm_c, stsm_c_t, stsm_dv, p_kr, p_qd_t, p_kd_t, p_inv_t,
         p_mqk_t, p_ds, p_do_t, p_dv, p_du, p_ds_acc_st) = self.warp_views(warp_idx, smem, lane)
        p_cross_kd_t = ldsm_a_t.partition_S(smem.cross_kd_t)  # Pᵀ, tile b's stages
        p_cross_qd_t = ldsm_a_t.partition_S(smem.cross_qd_t)  # Qᵀ

        def fragment_a(shape):
            return tiled_mma.make_fragment_A(tiled_mma.partition_shape_A(shape))

        def fragment_b(shape):
            return tiled_mma.make_fragment_B(tiled_mma.partition_shape_B(shape))

        c_shape = tiled_mma.partition_shape_C((CHUNK, cols))  # ((2,2), 1, n)
        r_kr = (fragment_a((CHUNK, dim)), fragment_a((CHUNK, dim)))  # tile b's, tile a's (stage order)
        r_qd_t = (fragment_a((dim, CHUNK)), fragment_a((dim, CHUNK)))
        r_kd_t = (fragment_a((dim, CHUNK)), fragment_a((dim, CHUNK)))
        r_ds = fragment_b((cols, dim))
        r_square = fragment_a((CHUNK, CHUNK))  # Mqkᵀ, INVᵀ, Qᵀ, Pᵀ in turn
        r_do_b = (fragment_b((cols, CHUNK)), fragment_b((cols, CHUNK)))  # dOᵀ (G1, the cross terms and G4)
        r_c16_b = fragment_b((cols, CHUNK))  # dU as B (G3)
        r_ndv_b = (fragment_b((cols, CHUNK)), fragment_b((cols, CHUNK)))  # −dv as B (tile a's cross term and G5)
        acc = (tiled_mma.make_fragment_C(c_shape), tiled_mma.make_fragment_C(c_shape))  # dU, then du
        r_c16 = cute.make_rmem_tensor(c_shape, BFloat16)  # dU, then du
        r_dv = cute.make_rmem_tensor(c_shape, self.dv_dtype)
        r_ndv = cute.make_rmem_tensor(c_shape, BFloat16)
        r_ds_acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((dim, cols)), BFloat16)
        ds_words = cute.recast_tensor(r_ds_acc, Uint32)

        v_kr = tuple(ldsm_a.retile(r) for r in r_kr)
        v_qd_t = tuple(ldsm_a_t.retile(r) for r in r_qd_t)
        v_kd_t = tuple(ldsm_a_t.retile(r) for r in r_kd_t)
        v_ds = ldsm_b.retile(r_ds)
        v_square = ldsm_a_t.retile(r_square)
        v_do_b = tuple(ldsm_b_t.retile(r) for r in r_do_b)
        v_dv = stsm_dv.retile(r_dv)
        v_du = stsm_c.retile(r_c16)
        v_ds_acc_st = stsm_c_t.retile(r_ds_acc)

        load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.plan.input_stages)
        out_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.plan.output_stages)
        # the lone last tile of an odd count (the first the reverse scan meets), then the pairs: the step's code
        # once without tile b, once with it
        for paired in cutlass.range_constexpr(2):
            tiles = 2 if const_expr(paired) else 1
            steps = num_tiles // 2 if const_expr(paired) else num_tiles % 2
            for step in cutlass.range(steps, unroll=1):
                tile_a = 2 * (num_tiles // 2 - 1 - step) if const_expr(paired) else num_tiles - 1
                # dS' leaving the step, as the band buffer holds it (the last step's writes are fenced)
                snapshot = self.band_image(snapshots, snapshot_row0 + (first_tile + tile_a) // 2)
                if const_expr(self.image_by_bulk):
                    self.store_band_image(snapshot, smem.ds, band, warp_idx)
                # the pipeline states advance in this body (the tracer carries them only through rebinds it sees)
                stages, held = [], []
                for j in cutlass.range_constexpr(tiles):
                    load_pipe.consumer_wait(load_state)
                    stages.append(load_state.index)
                    held.append(load_state.clone())
                    load_state.advance()

                # G1 + G2 of every tile against dS': dU_j = Mqk_jᵀ·dO_j + kr_j·dS'; operands of k+1 before mma k
                for j in cutlass.range_constexpr(tiles):
                    acc[j].fill(0.0)
                    cute.copy(ldsm_a_t, p_mqk_t[None, None, None, stages[j]], v_square)
                    cute.copy(ldsm_b_t, p_do_t[None, None, None, stages[j]], v_do_b[j])
                    cute.gemm(tiled_mma, acc[j], r_square[None, None, 0], r_do_b[j][None, None, 0], acc[j])
                    cute.copy(ldsm_a, p_kr[None, None, 0, stages[j]], v_kr[j][None, None, 0])
                if const_expr(paired):  # tile a's term of tile b's dO, Qᵀ·dO_b (tile b's stage), before G2
                    cute.copy(ldsm_a_t, p_cross_qd_t[None, None, None, stages[0]], v_square)
                    cute.gemm(tiled_mma, acc[1], r_square[None, None, 0], r_do_b[0][None, None, 0], acc[1])
                cute.copy(ldsm_b, p_ds[None, None, 0], v_ds[None, None, 0])
                for k in cutlass.range_constexpr(k_steps):
                    if const_expr(k + 1 < k_steps):
                        for j in cutlass.range_constexpr(tiles):
                            cute.copy(ldsm_a, p_kr[None, None, k + 1, stages[j]], v_kr[j][None, None, k + 1])
                        cute.copy(ldsm_b, p_ds[None, None, k + 1], v_ds[None, None, k + 1])
                    for j in cutlass.range_constexpr(tiles):
                        cute.gemm(tiled_mma, acc[j], r_kr[j][None, None, k], r_ds[None, None, k], acc[j])
                if const_expr(not self.image_by_bulk):  # narrow bands: dS' as G2 loaded it
                    self.store_band_fragment(snapshot, r_ds, band, warp_idx, lane)

                for j in cutlass.range_constexpr(tiles):
                    stage = stages[j]
                    if const_expr(j == 1):  # tile a's term of tile b's dv: −Pᵀ·dv_b
                        cute.copy(ldsm_a_t, p_cross_kd_t[None, None, None, stages[0]], v_square)
                        cute.gemm(tiled_mma, acc[1], r_square[None, None, 0], r_ndv_b[0][None, None, 0], acc[1])
                    r_c16.store(acc[j].load().to(BFloat16))
                    # G3: du = INVᵀ·dU, dU moved C → B in registers
                    transpose_c_to_b(r_c16, r_c16_b)
                    cute.copy(ldsm_a_t, p_inv_t[None, None, None, stage], v_square)
                    acc[j].fill(0.0)
                    cute.gemm(tiled_mma, acc[j], r_square[None, None, 0], r_c16_b[None, None, 0], acc[j])
                    # du and dv = bf16(β·du) → output stage; −dv (exact negation) as a B operand
                    beta = self.fragment_rows(smem.beta, stage, group)
                    self.round_du_dv(acc[j], beta, r_c16, r_dv, r_ndv)
                    self.store_outputs(store_pipe, out_state, ((stsm_dv, v_dv, p_dv), (stsm_c, v_du, p_du)))
                    out_state.advance()
                    transpose_c_to_b(r_ndv, r_ndv_b[j])

                # G4 + G5 + combine, row block m of 16 k: dS32 ← Σ_j (qd_jᵀ·dO_j − kd_jᵀ·dv_j) + f32(gT·dS32), gT the
                # pair's (tile a's slot), after the snapshot's copy has read the band buffer
                if const_expr(self.image_by_bulk):
                    self.wait_band_image_read()
                last = stages[tiles - 1]  # tile a's stage (the lone tile's)
                for j in cutlass.range_constexpr(tiles):
                    if const_expr(paired):  # dOᵀ again, not held through G3 (held, V-split 1 spilled)
                        cute.copy(ldsm_b_t, p_do_t[None, None, None, stages[j]], v_do_b[j])
                    cute.copy(ldsm_a_t, p_qd_t[None, 0, None, stages[j]], v_qd_t[j][None, 0, None])
                    cute.copy(ldsm_a_t, p_kd_t[None, 0, None, stages[j]], v_kd_t[j][None, 0, None])
                decay = self.fragment_rows(smem.gt, last, group, 0)
                for m in cutlass.range_constexpr(k_steps):
                    block = ds32[m]
                    for i in cutlass.range_constexpr(cute.size(block)):
                        block[i] = mul_rn(decay[c_row_half(i)], block[i])
                    # each tile's next row block loads after its own products
                    for j in cutlass.range_constexpr(tiles):
                        cute.gemm(tiled_mma, block, r_qd_t[j][None, m, None], r_do_b[j][None, None, 0], block)
                        cute.gemm(tiled_mma, block, r_kd_t[j][None, m, None], r_ndv_b[j][None, None, 0], block)
                        if const_expr(m + 1 < k_steps):
                            cute.copy(ldsm_a_t, p_qd_t[None, m + 1, None, stages[j]], v_qd_t[j][None, m + 1, None])
                            cute.copy(ldsm_a_t, p_kd_t[None, m + 1, None, stages[j]], v_kd_t[j][None, m + 1, None])
                    if const_expr(m + 1 < k_steps):
                        decay = self.fragment_rows(smem.gt, last, group, m + 1)
                    self.round_block(block, ds_words, m)
                    cute.copy(stsm_c_t, v_ds_acc_st[None, m, None], p_ds_acc_st[None, m, None])

                # the warp's dS columns and its reads of these stages are complete before lane 0 releases them (and
                # its band writes fenced for the next step's snapshot copy)
                if const_expr(self.image_by_bulk):
                    cute.arch.fence_view_async_shared()
                cute.arch.sync_warp()
                for j in cutlass.range_constexpr(tiles):
                    load_pipe.consumer_release(held[j])
