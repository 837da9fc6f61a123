"""A multistage ``cp.async`` GEMM on ``mma.sync``: the teaching example of the layout machinery.

``C[M, N] = A[M, K] · B[N, K]ᵀ``: A and B bf16 row-major (K contiguous), fp32 accumulation, C bf16 or
fp32 row-major. Not part of KDA (nor of the ``cute_kda`` package); it shows, on the smallest kernel that
needs them, the pieces K1 and K2 are built from: swizzled shared-memory layouts made of
:mod:`cute_kda.layouts`' atoms (:mod:`teaching.layouts.gemm`), ``ldmatrix`` fragments for
``mma.sync.m16n8k16``, an epilogue through shared memory. The walk-through is
``docs/gemm-walkthrough.md``; ``examples/gemm_multistage.py`` prints the layouts and runs it.

One CTA of ``32 · warps_m · warps_n`` threads per ``[BM, BN]`` tile of C (grid ``⌈M/BM⌉ × ⌈N/BN⌉``):

1. *Prologue.* Every thread issues its 16-byte ``cp.async`` copies of k-tiles ``0 … stages-2`` of A
   and B into stage slots ``0 … stages-2``, one ``cp.async.commit_group`` per k-tile.
2. *Mainloop*, k-tile ``t`` read from slot ``t % stages``, in ``BK / 16`` k16 steps. Two pipelines run
   at once: shared memory (``cp.async`` of k-tile ``t + stages - 1`` is issued at the first step, into
   the slot k-tile ``t - 1`` has left) and registers (the ``ldmatrix`` of step ``s + 1`` is issued
   before the ``mma.sync`` of step ``s``). Before the last step, ``cp.async.wait_group(stages - 2)``
   and a CTA barrier make k-tile ``t + 1`` visible to every warp (and mean every warp is done reading
   k-tile ``t - 1``'s slot, the next one refilled).
3. *Epilogue.* The fp32 accumulators are rounded to the output dtype and written into the C tile in
   shared memory (``stmatrix`` for bf16, 8-byte stores for fp32; the tile shares its bytes with the
   stage slots), then every thread moves 16-byte row pieces to global memory: coalesced stores.

Bounds. ``K`` must be a multiple of ``BK`` (the launcher checks; there is no K tail). ``M`` and ``N``
are free: rows of A past ``M`` and of B past ``N`` are not loaded (their smem keeps whatever it held,
which only reaches C elements past ``M`` or ``N``), and the epilogue stores only the 16-byte pieces
inside C; ``N`` must therefore be a multiple of 8 (bf16 out) or 4 (fp32 out), so that a piece is in
or out as a whole, and every row of A, B and C starts 16-byte aligned (``K`` a multiple of 8).
"""

from __future__ import annotations

from typing import NamedTuple

from cutlass import BFloat16, Boolean, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from cute_kda.dsl import cute, cutlass
from cute_kda.kernels.common.copy import Operand, ldmatrix_copy, stmatrix_copy

from ..layouts import gemm as layouts
from ..layouts.gemm import GemmPlan


class GemmOperands(NamedTuple):
    """Global tensors, row-major: ``a`` bf16 [M, K], ``b`` bf16 [N, K], ``c`` [M, N] (bf16 or fp32)."""

    a: cute.Tensor
    b: cute.Tensor
    c: cute.Tensor


class GemmCopies(NamedTuple):
    """Tiled copies of the CTA: ``cp.async`` loads of A and B (same arrangement), 16-byte C stores."""

    load: cute.TiledCopy
    store: cute.TiledCopy


class CtaTiles(NamedTuple):
    """This CTA's global tiles and their coordinates (identity tensors, for the bounds checks)."""

    a: cute.Tensor  # [BM, BK, k_tiles]
    b: cute.Tensor  # [BN, BK, k_tiles]
    c: cute.Tensor  # [BM, BN]
    a_coord: cute.Tensor
    b_coord: cute.Tensor
    c_coord: cute.Tensor
    m: Int32  # rows of A and C
    n: Int32  # rows of B, columns of C


class SmemTiles(NamedTuple):
    a: cute.Tensor  # [BM, BK, stages]
    b: cute.Tensor  # [BN, BK, stages]
    c: cute.Tensor  # [BM, BN], same bytes as a and b


class GemmMultistageKernel:
    """Static configuration: CTA ``tile = (BM, BN, BK)``, ``stages``, ``warps = (warps_m, warps_n)``,
    ``out_dtype`` (``BFloat16`` or ``Float32``), ``swizzle`` (False: row-major smem, for comparison).

    See :class:`teaching.layouts.gemm.GemmPlan` for what is accepted.
    """

    def __init__(self, *, tile: tuple[int, int, int] = (128, 128, 32), stages: int = 3,
                 warps: tuple[int, int] = (2, 2), out_dtype: type = BFloat16, swizzle: bool = True) -> None:
        bm, bn, bk = tile
        self.plan = GemmPlan(bm=bm, bn=bn, bk=bk, stages=stages, warps_m=warps[0], warps_n=warps[1],
                             out_dtype=out_dtype, swizzle=swizzle)
        self.num_threads = self.plan.num_threads

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream) -> None:
        """Launch over ``⌈M/BM⌉ × ⌈N/BN⌉`` CTAs. ``a`` [M, K], ``b`` [N, K], ``c`` [M, N], C-contiguous,
        16-byte aligned, ``K % BK == 0`` and ``N`` a multiple of the 16-byte C vector (the launcher checks)."""
        plan = self.plan
        m, n = a.shape[0], b.shape[0]
        k = cute.assume(a.shape[1], divby=plan.bk)
        n_vec = cute.assume(c.shape[1], divby=plan.out_vector)
        operands = GemmOperands(
            a=layouts.gmem_matrix(a.iterator, m, k),
            b=layouts.gmem_matrix(b.iterator, n, k),
            c=layouts.gmem_matrix(c.iterator, m, n_vec),
        )
        load_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                        num_bits_per_copy=8 * layouts.VECTOR_BYTES)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), plan.out_dtype,
                                         num_bits_per_copy=8 * layouts.VECTOR_BYTES)
        copies = GemmCopies(
            load=cute.make_tiled_copy_tv(load_atom, *layouts.load_thread_layout(plan)),
            store=cute.make_tiled_copy_tv(store_atom, *layouts.store_thread_layout(plan)),
        )
        self.shared_storage = layouts.shared_storage(plan)
        grid = ((m + plan.bm - 1) // plan.bm, (n + plan.bn - 1) // plan.bn, 1)
        self.kernel(operands, copies, layouts.tiled_mma(plan)).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream,
        )

    @cute.kernel
    def kernel(self, operands: GemmOperands, copies: GemmCopies, tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, n_tile, _ = cute.arch.block_idx()
        tiles = self.locate_tiles(operands, m_tile, n_tile)
        smem = self.smem_tiles()
        acc = self.mainloop(tiled_mma, copies.load, tiles, smem, tidx)
        self.epilogue(tiled_mma, copies.store, acc, tiles, smem.c, tidx)

    @cute.jit
    def locate_tiles(self, operands: GemmOperands, m_tile: Int32, n_tile: Int32) -> CtaTiles:
        """Global tiles of CTA ``(m_tile, n_tile)``: A rows, B rows (all k-tiles) and the C tile."""
        plan = self.plan
        a_tiler, b_tiler, c_tiler = (plan.bm, plan.bk), (plan.bn, plan.bk), (plan.bm, plan.bn)
        a_at, b_at, c_at = (m_tile, None), (n_tile, None), (m_tile, n_tile)
        return CtaTiles(
            a=cute.local_tile(operands.a, a_tiler, a_at),
            b=cute.local_tile(operands.b, b_tiler, b_at),
            c=cute.local_tile(operands.c, c_tiler, c_at),
            a_coord=cute.local_tile(cute.make_identity_tensor(operands.a.shape), a_tiler, a_at),
            b_coord=cute.local_tile(cute.make_identity_tensor(operands.b.shape), b_tiler, b_at),
            c_coord=cute.local_tile(cute.make_identity_tensor(operands.c.shape), c_tiler, c_at),
            m=operands.c.shape[0],
            n=operands.c.shape[1],
        )

    @cute.jit
    def smem_tiles(self) -> SmemTiles:
        """The stage slots and the epilogue tile, each with its swizzle on the pointer (byte addresses)."""
        plan = self.plan
        storage = SmemAllocator().allocate(self.shared_storage)
        a_layout = layouts.operand_stage(plan.bm, plan.bk, BFloat16, plan.stages, plan.swizzle)
        b_layout = layouts.operand_stage(plan.bn, plan.bk, BFloat16, plan.stages, plan.swizzle)
        c_layout = layouts.epilogue_tile(plan.bm, plan.bn, plan.out_dtype, plan.swizzle)
        return SmemTiles(
            a=storage.tiles.mainloop.a.get_tensor(a_layout.outer, swizzle=a_layout.inner),
            b=storage.tiles.mainloop.b.get_tensor(b_layout.outer, swizzle=b_layout.inner),
            c=storage.tiles.c.get_tensor(c_layout.outer, swizzle=c_layout.inner),
        )

    @cute.jit
    def row_predicate(self, coords: cute.Tensor, rows: Int32) -> cute.Tensor:
        """Per copy pass of this thread (mode 1 of a load partition): whether its row is inside ``rows``."""
        pred = cute.make_rmem_tensor(cute.size(coords, mode=[1]), Boolean)
        for i in cutlass.range_constexpr(cute.size(pred)):
            pred[i] = cute.elem_less(coords[0, i, 0, 0][0], rows)
        return pred

    @cute.jit
    def load_k_tile(self, load: cute.TiledCopy, g_tiles: cute.Tensor, s_slots: cute.Tensor, pred: cute.Tensor,
                    k_tile: Int32, slot: Int32):
        """This thread's ``cp.async`` copies of k-tile ``k_tile`` into stage ``slot`` (rows inside only)."""
        for i in cutlass.range_constexpr(cute.size(g_tiles, mode=[1])):
            if pred[i]:
                cute.copy(load, g_tiles[None, i, None, k_tile], s_slots[None, i, None, slot])

    @cute.jit
    def mainloop(self, tiled_mma: cute.TiledMma, load: cute.TiledCopy, tiles: CtaTiles, smem: SmemTiles,
                 tidx: Int32) -> cute.Tensor:
        """Prologue and mainloop (module docstring, steps 1-2); returns this thread's fp32 accumulators."""
        plan = self.plan
        stages, k_blocks = plan.stages, plan.k_blocks

        # gmem → smem: partition the global k-tiles and the stage slots by the load arrangement
        thr_load = load.get_slice(tidx)
        g_a, s_a = thr_load.partition_S(tiles.a), thr_load.partition_D(smem.a)  # (CPY, CPY_M, CPY_K, k | stage)
        g_b, s_b = thr_load.partition_S(tiles.b), thr_load.partition_D(smem.b)
        pred_a = self.row_predicate(thr_load.partition_S(tiles.a_coord), tiles.m)
        pred_b = self.row_predicate(thr_load.partition_S(tiles.b_coord), tiles.n)
        k_tiles = cute.size(tiles.a, mode=[2])

        for k_tile in cutlass.range_constexpr(stages - 1):  # prologue
            if k_tile < k_tiles:
                self.load_k_tile(load, g_a, s_a, pred_a, k_tile, k_tile)
                self.load_k_tile(load, g_b, s_b, pred_b, k_tile, k_tile)
            cute.arch.cp_async_commit_group()

        # smem → registers: ldmatrix views of the slots, retiled onto the mma fragments
        thr_mma = tiled_mma.get_slice(tidx)
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(smem.a[None, None, 0]))  # (MMA, MMA_M, k_blocks)
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(smem.b[None, None, 0]))  # (MMA, MMA_N, k_blocks)
        acc = tiled_mma.make_fragment_C(thr_mma.partition_C(tiles.c))
        acc.fill(0.0)
        ldsm_a = ldmatrix_copy(tiled_mma, Operand.A, transpose=False)
        ldsm_b = ldmatrix_copy(tiled_mma, Operand.B, transpose=False)
        thr_ldsm_a, thr_ldsm_b = ldsm_a.get_slice(tidx), ldsm_b.get_slice(tidx)
        s_a_view, r_a_view = thr_ldsm_a.partition_S(smem.a), thr_ldsm_a.retile(frag_a)  # (CPY, M, k_blocks, stage)
        s_b_view, r_b_view = thr_ldsm_b.partition_S(smem.b), thr_ldsm_b.retile(frag_b)

        read_slot = Int32(0)
        write_slot = Int32(stages - 1)
        cute.arch.cp_async_wait_group(stages - 2)  # k-tile 0 has landed (this thread's copies) …
        cute.arch.sync_threads()  # … and everyone's
        cute.copy(ldsm_a, s_a_view[None, None, 0, read_slot], r_a_view[None, None, 0])
        cute.copy(ldsm_b, s_b_view[None, None, 0, read_slot], r_b_view[None, None, 0])

        for k_tile in range(k_tiles):
            for kb in cutlass.range_constexpr(k_blocks):
                if kb == k_blocks - 1:  # the next ldmatrix reads k-tile k_tile + 1: wait for it
                    read_slot = read_slot + 1
                    if read_slot == stages:
                        read_slot = Int32(0)
                    cute.arch.cp_async_wait_group(stages - 2)
                    cute.arch.sync_threads()
                kb_next = (kb + 1) % k_blocks
                cute.copy(ldsm_a, s_a_view[None, None, kb_next, read_slot], r_a_view[None, None, kb_next])
                cute.copy(ldsm_b, s_b_view[None, None, kb_next, read_slot], r_b_view[None, None, kb_next])
                if kb == 0:  # refill the slot k-tile k_tile - 1 left (every warp passed the last barrier)
                    if k_tile + stages - 1 < k_tiles:
                        self.load_k_tile(load, g_a, s_a, pred_a, k_tile + stages - 1, write_slot)
                        self.load_k_tile(load, g_b, s_b, pred_b, k_tile + stages - 1, write_slot)
                    cute.arch.cp_async_commit_group()  # possibly empty: keeps the group count uniform
                    write_slot = write_slot + 1
                    if write_slot == stages:
                        write_slot = Int32(0)
                cute.gemm(tiled_mma, acc, frag_a[None, None, kb], frag_b[None, None, kb], acc)
        return acc

    @cute.jit
    def epilogue(self, tiled_mma: cute.TiledMma, store: cute.TiledCopy, acc: cute.Tensor, tiles: CtaTiles,
                 s_c: cute.Tensor, tidx: Int32):
        """Accumulators → output dtype → C tile in smem → 16-byte row pieces inside C → global."""
        plan = self.plan
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # every warp is done with the stage slots the C tile overwrites
        out = cute.make_fragment_like(acc, plan.out_dtype)
        out.store(acc.load().to(plan.out_dtype))
        if cutlass.const_expr(plan.out_dtype is BFloat16):
            stsm = stmatrix_copy(tiled_mma, Operand.C, transpose=False)
            thr_stsm = stsm.get_slice(tidx)
            cute.copy(stsm, thr_stsm.retile(out), thr_stsm.partition_D(s_c))
        else:
            cute.autovec_copy(out, tiled_mma.get_slice(tidx).partition_C(s_c))
        cute.arch.sync_threads()

        thr_store = store.get_slice(tidx)
        s_part, g_part = thr_store.partition_S(s_c), thr_store.partition_D(tiles.c)  # (CPY, CPY_M, CPY_N)
        coords = thr_store.partition_D(tiles.c_coord)
        pieces = cute.make_fragment_like(s_part)
        cute.autovec_copy(s_part, pieces)
        for i in cutlass.range_constexpr(cute.size(g_part, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(g_part, mode=[2])):
                if cute.elem_less(coords[0, i, j], (tiles.m, tiles.n)):
                    cute.copy(store, pieces[None, i, j], g_part[None, i, j])
