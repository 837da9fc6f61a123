"""A copy with a decode's memory pattern: the ceiling of moving a decode's state bytes at its slots.

``bench_decode.py``'s "% copy" compares a decode with a device copy of one contiguous buffer. A decode reads each
listed sequence's state from a slot of the pool and writes it back there; with the slot ids a random permutation the
blocks lie scattered (128 KB a slot for 4 heads of bf16 state), and where they lie moved a bf16 decode row by up to
4 points of the copy (docs/perf-log.md, D-slots). :class:`SlotCopyKernel` moves exactly a decode's state bytes and
nothing else: one CTA per (sequence, value head, band of value rows), the slot id read first, the band's rows loaded
in 16-byte vectors (all of a thread's at once) and stored back where they were, unchanged (each 32-bit word XORed
with a run-time zero, so that the compiler cannot drop the store of a value just loaded from the same address, and
the loads with it); −1 skips the row.
``--slot-copy`` in ``bench_decode.py`` times it on each decode row's own pool and slot ids.

Benchmark tooling, not part of the package: compiled in each process (no disk cache).
"""

from __future__ import annotations

import functools

import torch

from cute_kda.dsl import cute, cutlass  # first: sets the target architecture before the DSL loads

from cutlass import Int32

from cute_kda.kernels.common.copy import gmem_run

DIM = 128  # K = V of a state block
VECTOR_BYTES = 16


class SlotCopyKernel:
    """Per CTA one (sequence, value head, band) of ``DIM // vsplit`` value rows of a pool seen as 32-bit words
    ``[slots, HV · DIM · DIM · element_bytes / 4]`` (each slot's blocks flattened), ``threads`` threads, each moving
    ``vectors`` 16-byte vectors."""

    WORD = 4  # bytes

    def __init__(self, element_bytes: int, vsplit: int, threads: int) -> None:
        self.vsplit = vsplit
        self.threads = threads
        self.vector = VECTOR_BYTES // self.WORD  # words a vector
        self.head = DIM * DIM * element_bytes // self.WORD  # words a head's block
        band = self.head // vsplit  # words a CTA moves
        if band % (threads * self.vector):
            raise ValueError(f"a band of {band} words does not split into {threads} threads' vectors")
        self.band = band
        self.vectors = band // (threads * self.vector)

    @cute.jit
    def __call__(self, pool: cute.Tensor, state_indices: cute.Tensor, value_heads: Int32, zero: Int32, stream):
        self.kernel(pool, state_indices, value_heads, zero).launch(
            grid=[state_indices.shape[0] * value_heads * self.vsplit, 1, 1], block=[self.threads, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, pool: cute.Tensor, state_indices: cute.Tensor, value_heads: Int32, zero: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        band = block % self.vsplit
        seq_head = block // self.vsplit
        seq, head = seq_head // value_heads, seq_head % value_heads
        slot = state_indices[seq]
        if slot >= 0:
            row = pool[slot, None]
            first = head * self.head + band * self.band + tidx * self.vector
            staged = cute.make_rmem_tensor((self.vector, self.vectors), Int32)  # a vector a column
            for i in cutlass.range_constexpr(self.vectors):  # every load out before the first store
                cute.autovec_copy(gmem_run(row, first + i * self.threads * self.vector, self.vector), staged[None, i])
            cute.arch.sync_warp()  # ptxas moves no memory operation across it: every load issued before any store
            for i in cutlass.range_constexpr(self.vectors):
                for w in cutlass.range_constexpr(self.vector):
                    staged[w, i] = staged[w, i] ^ zero
                cute.autovec_copy(staged[None, i], gmem_run(row, first + i * self.threads * self.vector, self.vector))


def compile_arguments() -> tuple:
    """The compile's fake arguments: the word view of a pool, int32 slot ids, HV, the run-time zero, a stream."""
    from cute_kda.ops._cache import to_cute_tensor

    pool = torch.empty(3, DIM * DIM, dtype=torch.int32, device="meta")
    ids = torch.empty(3, dtype=torch.int32, device="meta")
    return to_cute_tensor(pool, VECTOR_BYTES), to_cute_tensor(ids, 4), Int32(2), Int32(0), \
        cute.runtime.make_fake_stream()


@functools.lru_cache(maxsize=None)
def compiled_slot_copy(element_bytes: int, vsplit: int, threads: int):
    from cute_kda.ops._cache import compile_for_launch

    return compile_for_launch(SlotCopyKernel(element_bytes, vsplit, threads), *compile_arguments())


def slot_copy(state_pool: torch.Tensor, state_indices: torch.Tensor, threads: int = 64):
    """``state_pool`` contiguous ``[slots, HV, DIM, DIM]`` fp32 / bf16 on a GPU, ``state_indices`` int32 ``[N]``:
    a zero-argument call that moves the listed slots' state onto itself, 16 KB a CTA of ``threads`` threads (V-split
    2 for bf16, 4 for fp32: a decode CTA's bytes at its V-split of 64 threads)."""
    from cute_kda.ops._cache import current_stream

    element_bytes = state_pool.element_size()
    vsplit = DIM * DIM * element_bytes // (16 * 1024)  # 16 KB a CTA
    compiled = compiled_slot_copy(element_bytes, vsplit, threads)
    words = state_pool.view(state_pool.shape[0], -1).view(torch.int32)
    value_heads = state_pool.shape[1]
    return lambda: compiled(words, state_indices, value_heads, 0, current_stream(state_pool.device))
