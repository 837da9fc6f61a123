"""Torch launchers of :class:`cute_kda.kernels.intrinsics.ApproxIntrinsicKernel`.

``tanh_approx(x)`` / ``ex2_approx(x)`` / ``lg2_approx(x)`` return a new fp32 tensor of ``x``'s shape
holding ``tanh.approx.f32`` / ``ex2.approx.ftz.f32`` / ``lg2.approx.f32`` of every element, computed on ``x``'s GPU on the
current stream. The mirror reference uses them to see the kernels' exact instruction results.
"""

from __future__ import annotations

import torch

from ._cache import CompileCache, compile_for_launch, current_stream, to_cute_tensor

_CACHE = CompileCache("approx_intrinsic")
_MAX_ELEMENTS = 2**31 - 1  # the kernel indexes with int32


def _compile(op: str, src, dst, stream):
    """The launch entry of ``ApproxIntrinsicKernel(op)`` for fp32 vectors ``src`` → ``dst`` (4-byte aligned:
    a contiguous view may start anywhere in its storage)."""
    from ..kernels.intrinsics import ApproxIntrinsicKernel

    return compile_for_launch(ApproxIntrinsicKernel(op), to_cute_tensor(src, 4), to_cute_tensor(dst, 4), stream)


def _launch(op: str, x: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda or x.dtype != torch.float32:
        raise TypeError(f"expected a CUDA float32 tensor, got {x.dtype} on {x.device}")
    src = x.contiguous().view(-1)
    dst = torch.empty_like(src)
    if src.numel() == 0:
        return dst.view(x.shape)
    if src.numel() > _MAX_ELEMENTS:
        raise ValueError(f"at most {_MAX_ELEMENTS} elements per launch, got {src.numel()}")
    with torch.cuda.device(x.device):
        stream = current_stream(x.device)
        compiled = _CACHE.get((op, x.device.index), lambda: _compile(op, src, dst, stream))
        compiled(src, dst, stream)
    return dst.view(x.shape)


def tanh_approx(x: torch.Tensor) -> torch.Tensor:
    """``tanh.approx.f32`` of every element of the CUDA fp32 tensor ``x`` (any shape)."""
    return _launch("tanh", x)


def ex2_approx(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz.f32`` (2^x, subnormal inputs and results flushed to 0) of every element of ``x``."""
    return _launch("ex2", x)


def lg2_approx(x: torch.Tensor) -> torch.Tensor:
    """``lg2.approx.f32`` (log2 x) of every element of the CUDA fp32 tensor ``x``."""
    return _launch("lg2", x)
