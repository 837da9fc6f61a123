"""Varlen tile bases on the device: ``tile_base[s] = Σ_{j<s} ⌈len_j / 16⌉`` for ``s = 0 … N``.

``cute_kda.workspace`` numbers the tiles of all sequences consecutively; K1 and K2 find a tile's
sequence (or a sequence's first tile) from this prefix. Computing it on the device keeps the
forward free of host synchronisation (``cu_seqlens`` is never read on the host).

One CTA walks the sequences ``num_threads`` at a time: each thread turns one length into a tile
count, a warp scan (``shfl.up``) and a scan of the warp totals through shared memory give the
inclusive prefix, and a running carry links the blocks. Integer sums: the order does not matter.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass.memory import SmemAllocator

from ..dsl import cute, cutlass
from ..layouts.smem import CHUNK, vector

WARP = 32


class TilePrefixKernel:
    """Static configuration: ``num_threads`` (a multiple of 32, at most 1024)."""

    def __init__(self, num_threads: int = 256) -> None:
        if num_threads % WARP or not 0 < num_threads <= 1024:
            raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {num_threads}")
        self.num_threads = num_threads
        self.num_warps = num_threads // WARP

    @cute.jit
    def __call__(self, cu_seqlens: cute.Tensor, tile_base: cute.Tensor, stream) -> None:
        """``cu_seqlens`` int64 ``[N+1]`` (non-decreasing, from 0) → ``tile_base`` int32 ``[N+1]``."""
        self.kernel(cu_seqlens, tile_base).launch(grid=(1, 1, 1), block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, cu_seqlens: cute.Tensor, tile_base: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_totals = SmemAllocator().allocate_tensor(Int32, vector(self.num_warps), byte_alignment=16)
        num_seqs = Int32(cu_seqlens.shape[0] - 1)
        if tidx == 0:
            tile_base[0] = Int32(0)
        carry = Int32(0)
        for block_start in cutlass.range(0, num_seqs, self.num_threads, unroll=1):
            seq = block_start + tidx
            count = Int32(0)
            if seq < num_seqs:
                count = Int32((cu_seqlens[seq + 1] - cu_seqlens[seq] + (CHUNK - 1)) // CHUNK)
            inclusive = count
            for offset in (1, 2, 4, 8, 16):
                neighbour = cute.arch.shuffle_sync_up(inclusive, offset=offset)
                if lane >= offset:
                    inclusive = inclusive + neighbour
            if lane == WARP - 1:
                warp_totals[warp_idx] = inclusive
            cute.arch.sync_threads()
            before = Int32(0)
            block_total = Int32(0)
            for w in cutlass.range_constexpr(self.num_warps):
                total = warp_totals[w]
                if w < warp_idx:
                    before = before + total
                block_total = block_total + total
            if seq < num_seqs:
                tile_base[seq + 1] = carry + before + inclusive
            carry = carry + block_total
            cute.arch.sync_threads()  # warp_totals is rewritten by the next block
