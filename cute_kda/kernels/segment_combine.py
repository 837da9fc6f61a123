"""The serial combine of a segmented (context-parallel) call, on the device.

A segmented call cuts each sequence into ``C`` segments that the scans run side by side; the combine then links
them (:mod:`cute_kda.context_parallel`). Over the segments of one (sequence, head), fp32 ``[D, D]`` matrices:

- forward (``transpose`` False): ``X[c] = X[c−1]·F[c−1] + H[c−1]`` from ``X[0]`` = the sequence's initial state
  (zero without one): the state entering every segment from each segment's local final state ``H`` and
  transition ``F``;
- backward (``transpose`` True): ``G[c−1] = G[c]·F[c]ᵀ + L[c]`` from ``G[C−1]`` = the gradient w.r.t. the final
  state (zero without one): the gradient w.r.t. the state leaving every segment, from each segment's local
  gradient ``L``.

In place in ``into`` (``[N · C, H, D, D]``, a sequence's segments consecutive), whose rows hold the addends already
(``H[c−1]`` where ``X[c]`` goes, ``L[c]`` where ``G[c−1]`` goes); the boundary row is written from ``boundary``.
One launch replaces a batched GEMM per segment, whose host time bound the training step at B1 T32768 H16
(docs/perf-log.md, CP6).

Rows of ``X`` (and ``G``) are independent (``X[c][r] = X[c−1][r]·F + H[r]``), so a CTA owns
:data:`~cute_kda.layouts.segment_combine.ROWS` rows of one (sequence, head) and walks its segments alone: per step
it stages ``F`` in shared memory (padded rows, :func:`~cute_kda.layouts.segment_combine.transition_tile`), each
thread forms its column of its rows as an fp32 dot product over ``k`` in order (FMA), adds the addend and writes
the row back to the staging and to ``into``. fp32 throughout (the CPU's torch combine follows torch's matmul
precision); the sums' order is not a GEMM library's, so the two agree to rounding, not bit for bit.
"""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from ..dsl import cute, cutlass
from ..layouts.segment_combine import ROWS, THREADS, rows_per_pass, state_rows, transition_tile


class SegmentCombineKernel:
    """Static configuration: ``dim`` (K = V) and ``transpose`` (the backward combine). The boundary's presence and
    element type come from the compile's arguments (None: no boundary, zero)."""

    def __init__(self, dim: int, transpose: bool) -> None:
        if dim % ROWS or THREADS % dim:
            raise ValueError(f"dim must divide {THREADS} and be a multiple of {ROWS}, got {dim}")
        self.dim = dim
        self.transpose = transpose
        self.row_step = rows_per_pass(dim)  # rows apart of one thread's elements
        self.per_thread = ROWS // self.row_step

    @cute.jit
    def __call__(self, into: cute.Tensor, transitions: cute.Tensor, boundary: cute.Tensor | None, per_seq: Int32,
                 stream) -> None:
        """``into``, ``transitions`` fp32 ``[N · C, H, D, D]``, ``boundary`` None or ``[N, H, D, D]`` (fp32, bf16 or
        fp16), ``per_seq`` = C ≥ 1; all contiguous."""
        heads = into.shape[1]
        num_seqs = into.shape[0] // per_seq
        self.kernel(into, transitions, boundary, per_seq).launch(
            grid=(self.dim // ROWS, heads, num_seqs), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, into: cute.Tensor, transitions: cute.Tensor, boundary: cute.Tensor | None, per_seq: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        band, head, seq = cute.arch.block_idx()
        allocator = SmemAllocator()
        staged = allocator.allocate_tensor(Float32, transition_tile(self.dim), byte_alignment=16)
        rows = allocator.allocate_tensor(Float32, state_rows(self.dim), byte_alignment=16)
        column = Int32(tidx) % self.dim
        first_row = Int32(tidx) // self.dim  # of the CTA's ROWS; the thread's others are row_step apart
        row0 = Int32(band) * ROWS
        base = Int32(seq) * per_seq

        start = per_seq - 1 if cutlass.const_expr(self.transpose) else Int32(0)
        for p in cutlass.range_constexpr(self.per_thread):
            r = first_row + p * self.row_step
            value = Float32(0.0)
            if cutlass.const_expr(boundary is not None):
                value = boundary[seq, head, row0 + r, column].to(Float32)
            rows[r, column] = value
            into[base + start, head, row0 + r, column] = value

        for step in cutlass.range(1, per_seq, unroll=1):
            target = per_seq - 1 - step if cutlass.const_expr(self.transpose) else step
            source = target + 1 if cutlass.const_expr(self.transpose) else target - 1
            cute.arch.sync_threads()  # the rows of the step before are in place; the staging is free
            for i in cutlass.range_constexpr(self.dim * self.dim // THREADS):
                k = first_row + i * self.row_step
                staged[k, column] = transitions[base + source, head, k, column]
            cute.arch.sync_threads()
            sums = cute.make_rmem_tensor((self.per_thread,), Float32)
            for p in cutlass.range_constexpr(self.per_thread):
                sums[p] = into[base + target, head, row0 + first_row + p * self.row_step, column]
            for k in cutlass.range_constexpr(self.dim):
                f = staged[column, k] if cutlass.const_expr(self.transpose) else staged[k, column]
                for p in cutlass.range_constexpr(self.per_thread):
                    sums[p] = sums[p] + rows[first_row + p * self.row_step, k] * f
            cute.arch.sync_threads()  # every thread has read the rows it is about to replace
            for p in cutlass.range_constexpr(self.per_thread):
                r = first_row + p * self.row_step
                rows[r, column] = sums[p]
                into[base + target, head, row0 + r, column] = sums[p]
