"""Torch launcher of :class:`teaching.kernels.transpose_roundtrip.TransposeRoundTrip`.

``transpose_tiles(x)`` returns, for ``x`` of shape ``[T, H, D]`` (bf16 or fp16, on a GPU), the
transpose of every 16-token tile of every head: ``y[t·D + i, h, j] = x[16·t + j, h, i]``, ``y`` of
shape ``[⌈T/16⌉·D, H, 16]`` (rows of a short last tile read as zeros). It exists to test the data
movement K1/K2 are built from; :func:`transpose_tiles_reference` is the same map in plain torch.
"""

from __future__ import annotations

import torch

from cute_kda.numerics import CHUNK
from cute_kda.ops._cache import compile_for_launch, current_stream, to_cute_tensor

from ._cache import teaching_cache

_CACHE = teaching_cache("transpose_roundtrip")
_DTYPES = (torch.bfloat16, torch.float16)
_TMA_ALIGN = 16  # bytes: TMA base addresses and strides


def transpose_tiles_reference(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D] → [⌈T/16⌉·D, H, 16]`` tile transposes in plain torch (any device, any dtype)."""
    tokens, heads, dim = x.shape
    tiles = -(-tokens // CHUNK)
    padded = x.new_zeros(tiles * CHUNK, heads, dim)
    padded[:tokens] = x
    # [tile, j, h, i] → [tile, i, h, j]
    return padded.view(tiles, CHUNK, heads, dim).permute(0, 3, 2, 1).reshape(tiles * dim, heads, CHUNK)


def _check_tma_operand(name: str, t: torch.Tensor) -> None:
    itemsize = t.element_size()
    if t.stride(2) != 1 or any(t.stride(i) * itemsize % _TMA_ALIGN for i in (0, 1)):
        raise ValueError(f"{name}: last mode must be contiguous and other strides multiples of 16 bytes")
    if t.data_ptr() % _TMA_ALIGN:
        raise ValueError(f"{name}: data pointer must be 16-byte aligned for TMA")


def _compile(kernel_args: tuple, x, y, tiles_per_cta, stream):
    from ..kernels.transpose_roundtrip import TransposeRoundTrip

    dtype, dim, load_stages, store_stages, transposed_views = kernel_args
    kernel = TransposeRoundTrip(dim, dtype, load_stages, store_stages, transposed_views)
    return compile_for_launch(
        kernel, to_cute_tensor(x, _TMA_ALIGN), to_cute_tensor(y, _TMA_ALIGN), tiles_per_cta, stream
    )


def transpose_tiles(
    x: torch.Tensor,
    *,
    tiles_per_cta: int = 1,
    load_stages: int = 2,
    store_stages: int = 2,
    transposed_views: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tile transposes of ``x`` (``[T, H, D]``, D a multiple of 64) computed by the round-trip kernel.

    One CTA per (group of ``tiles_per_cta`` consecutive tiles, head). ``out`` (``[⌈T/16⌉·D, H, 16]``,
    ``x``'s dtype) receives the result if given. ``transposed_views`` selects the register route
    (see the kernel module). Runs on ``x``'s device, on the current stream.
    """
    from cute_kda.dsl import cutlass

    if not x.is_cuda or x.dtype not in _DTYPES or x.dim() != 3:
        raise TypeError(
            f"expected a CUDA bf16/fp16 tensor [T, H, D], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    tokens, heads, dim = x.shape
    if dim % 64:
        raise ValueError(f"D={dim} must be a multiple of 64 (16-column blocks over 4 warps)")
    if tiles_per_cta < 1:
        raise ValueError(f"tiles_per_cta must be >= 1, got {tiles_per_cta}")
    tiles = -(-tokens // CHUNK)
    shape = (tiles * dim, heads, CHUNK)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {x.dtype} {shape} on {x.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if tiles == 0 or heads == 0:
        return out
    _check_tma_operand("x", x)
    _check_tma_operand("out", out)
    dtype = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[x.dtype]
    kernel_args = (dtype, dim, load_stages, store_stages, transposed_views)
    with torch.cuda.device(x.device):
        stream = current_stream(x.device)
        compiled = _CACHE.get(
            (kernel_args, x.device.index), lambda: _compile(kernel_args, x, out, tiles_per_cta, stream)
        )
        compiled(x, out, tiles_per_cta, stream)
    return out
