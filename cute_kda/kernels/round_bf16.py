"""fp16 → bf16 rounding of a flat tensor on the device: ``out[i] = bf16(f32(x[i]))``, round to nearest even.

fp16 training rounds dO to bf16 once per backward (:func:`cute_kda.executors.training.backward`); torch's cast of
an fp16 tensor to bf16 runs at well under the H200's copy bandwidth (docs/perf-log.md, "fp16 training", F4), and
this is a plain streaming copy, so it is written as one: 16-byte loads and stores, several in flight per thread.

The widening fp16 → fp32 is exact, and ``cvt.rn.bf16x2.f32`` rounds each fp32 value to nearest even, so every
finite value, ±inf, ±0 and every subnormal come out as torch's ``x.to(torch.bfloat16)`` gives them; a NaN stays a
NaN (its payload may differ from torch's).

Each thread owns ``vectors`` runs of 8 elements (16 bytes) ``num_threads`` runs apart, issues all their loads,
then converts and stores them; each CTA covers ``num_threads · vectors`` runs, and the grid covers the tensor (no
grid-stride loop: a CTA's work is fixed, the runs past the end are skipped). The launcher
(:func:`cute_kda.ops.round_bf16.round_to_bf16`) hands the kernel tensors of a multiple of 8 elements, 16-byte
aligned, fewer than 2³¹.
"""

from __future__ import annotations

from cutlass import BFloat16, Float16, Float32, Int32, Uint32

from ..dsl import cute, cutlass
from ..numerics import ROUND_RUN as RUN
from .common.copy import gmem_run
from .common.fastmath import pack_bf16x2

WARP = 32


class RoundBf16Kernel:
    """Static configuration: ``num_threads`` per CTA (a multiple of 32, at most 1024) and ``vectors``, the 16-byte
    runs each thread has in flight."""

    def __init__(self, num_threads: int = 256, vectors: int = 4) -> None:
        if num_threads % WARP or not 0 < num_threads <= 1024:
            raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {num_threads}")
        if vectors < 1:
            raise ValueError(f"vectors must be positive, got {vectors}")
        self.num_threads = num_threads
        self.vectors = vectors
        self.tile_runs = num_threads * vectors

    @cute.jit
    def __call__(self, x: cute.Tensor, out: cute.Tensor, stream) -> None:
        """``x`` fp16 ``[n]`` → ``out`` bf16 ``[n]``, both contiguous and 16-byte aligned, ``n % 8 == 0``."""
        runs = x.shape[0] // RUN
        grid = (runs + self.tile_runs - 1) // self.tile_runs
        self.kernel(x, out).launch(grid=(grid, 1, 1), block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        runs = Int32(x.shape[0] // RUN)
        first = Int32(bidx) * self.tile_runs + Int32(tidx)
        halves = [cute.make_rmem_tensor((RUN,), Float16) for _ in range(self.vectors)]
        for j in cutlass.range_constexpr(self.vectors):  # every load first: `vectors` of them in flight
            run = first + j * self.num_threads
            if run < runs:
                cute.autovec_copy(gmem_run(x, run * RUN, RUN), halves[j])
        for j in cutlass.range_constexpr(self.vectors):
            run = first + j * self.num_threads
            if run < runs:
                rounded = cute.make_rmem_tensor((RUN,), BFloat16)
                words = cute.recast_tensor(rounded, Uint32)
                for w in cutlass.range_constexpr(RUN // 2):
                    words[w] = pack_bf16x2(halves[j][2 * w].to(Float32), halves[j][2 * w + 1].to(Float32))
                cute.autovec_copy(rounded, gmem_run(out, run * RUN, RUN))
