"""Elementwise kernel applying one approximate PTX math instruction to an fp32 tensor.

The mirror references (``cute_kda.reference.common``) evaluate ``tanh.approx.f32``,
``ex2.approx.ftz.f32`` and ``lg2.approx.f32`` through this kernel so that its results carry exactly the rounding of the
instructions the forward kernels issue (docs/numerics.md). Every variant uses the device helpers
of ``cute_kda.kernels.common.fastmath``, the same ones the forward kernels call.
"""

from __future__ import annotations

from typing import Callable

from cuda.bindings import driver

from ..dsl import cute, cutlass
from .common import fastmath

INTRINSICS: dict[str, Callable] = {
    "tanh": fastmath.tanh_approx,  # tanh.approx.f32
    "ex2": fastmath.ex2_approx,  # ex2.approx.ftz.f32
    "lg2": fastmath.lg2_approx,  # lg2.approx.f32
}


class ApproxIntrinsicKernel:
    """``dst[i] = op(src[i])`` for 1-D fp32 tensors ``src``, ``dst`` of equal length (< 2**31).

    One thread per element, ``threads_per_cta`` threads per CTA, a bounds test for the last CTA.
    ``op`` is a key of :data:`INTRINSICS`.
    """

    def __init__(self, op: str, threads_per_cta: int = 256) -> None:
        if op not in INTRINSICS:
            raise ValueError(f"op must be one of {sorted(INTRINSICS)}, got {op!r}")
        self.op = op
        self.threads_per_cta = threads_per_cta

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, stream: driver.CUstream):
        ctas = cute.ceil_div(cute.size(src), self.threads_per_cta)
        self.kernel(src, dst).launch(grid=[ctas, 1, 1], block=[self.threads_per_cta, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor):
        thread, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        index = cta * self.threads_per_cta + thread
        if index < cute.size(src):
            dst[index] = INTRINSICS[self.op](cutlass.Float32(src[index]))
