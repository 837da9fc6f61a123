"""Torch launcher of the segment combine (:class:`cute_kda.kernels.segment_combine.SegmentCombineKernel`).

:func:`cute_kda.context_parallel.segment_states` and :func:`~cute_kda.context_parallel.exiting_gradients` call it
for CUDA tensors (one launch a combine); on the CPU they run the torch combine it replaces. The kernel launches on
torch's current stream of ``into``'s device and returns without synchronising.
"""

from __future__ import annotations

import torch

from ..numerics import NATIVE_HEAD_DIMS
from ..variants import CombineVariant
from ._cache import (
    CompileCache, compile_for_launch, current_stream, device_index, fake_stream, on_device, to_cute_tensor,
)

_COMBINE = CompileCache("segment_combine")
_META = torch.device("meta")
BOUNDARY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compile_arguments(variant: CombineVariant) -> tuple:
    """The kernel's arguments for a compile: fake fp32 ``[C, H, D, D]`` tensors (and the boundary), a per-sequence
    count and a fake stream."""
    shape = (1, 1, variant.dim, variant.dim)
    states = torch.empty(shape, dtype=torch.float32, device=_META)
    boundary = None if variant.boundary is None else torch.empty(shape, dtype=variant.boundary, device=_META)
    return to_cute_tensor(states), to_cute_tensor(states), to_cute_tensor(boundary), 1, fake_stream()


def compiled_variant(variant: CombineVariant, index: int):
    """The compiled combine ``variant`` on device ``index``, compiled (from fake tensors) on first use."""

    def build():
        from ..kernels.segment_combine import SegmentCombineKernel

        kernel = SegmentCombineKernel(variant.dim, variant.transpose)
        return compile_for_launch(kernel, *compile_arguments(variant))

    return _COMBINE.get((variant, index), build)


def compile_variant(variant: CombineVariant, device: torch.device | str) -> None:
    """Compile (or load from the disk cache) ``variant`` for ``device`` ahead of time; nothing is launched."""
    compiled_variant(variant, device_index(torch.device(device)))


def combine_segments(into: torch.Tensor, transitions: torch.Tensor, boundary: torch.Tensor | None, per_seq: int, *,
                     transpose: bool) -> None:
    """The serial combine over each sequence's ``per_seq`` segments, in place in ``into`` (the kernel's doc).

    into, transitions: fp32 ``[N · per_seq, H, D, D]`` on one CUDA device, contiguous, a sequence's segments
    consecutive, D in :data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`; ``into``'s rows hold the addends. boundary: None
    (zero) or ``[N, H, D, D]`` in :data:`BOUNDARY_DTYPES` (any strides: made contiguous), the initial states
    (``transpose`` False, written to each sequence's first row) or the final states' gradients (True, its last row).
    """
    count, heads, rows, cols = into.shape
    if (into.dtype != torch.float32 or not into.is_cuda or not into.is_contiguous() or rows != cols
            or rows not in NATIVE_HEAD_DIMS):
        raise ValueError(f"into must be contiguous fp32 [count, H, D, D] on a GPU with D in {NATIVE_HEAD_DIMS}, got "
                         f"{into.dtype} {tuple(into.shape)} on {into.device}")
    if per_seq < 1 or count % per_seq:
        raise ValueError(f"per_seq must be a positive divisor of the {count} segments, got {per_seq}")
    if (transitions.dtype != torch.float32 or transitions.shape != into.shape or transitions.device != into.device
            or not transitions.is_contiguous()):
        raise ValueError(f"transitions must be contiguous fp32 {tuple(into.shape)} on {into.device}, got "
                         f"{transitions.dtype} {tuple(transitions.shape)} on {transitions.device}")
    if boundary is not None:
        expected = (count // per_seq, heads, rows, cols)
        if boundary.dtype not in BOUNDARY_DTYPES or tuple(boundary.shape) != expected or boundary.device != into.device:
            raise ValueError(f"boundary must be fp32, bf16 or fp16 {expected} on {into.device}, got {boundary.dtype} "
                             f"{tuple(boundary.shape)} on {boundary.device}")
        boundary = boundary.contiguous()
    if count == 0 or heads == 0:
        return
    device = into.device
    variant = CombineVariant(rows, transpose, None if boundary is None else boundary.dtype)
    compiled = compiled_variant(variant, device_index(device))
    with on_device(device):
        compiled(into, transitions, boundary, per_seq, current_stream(device))
