"""Torch launcher of the fp16 → bf16 rounding pass (:class:`cute_kda.kernels.round_bf16.RoundBf16Kernel`).

The kernel takes what it was built for: a CUDA fp16 tensor and a bf16 one of as many elements, both contiguous,
16-byte aligned, a multiple of 8 elements and fewer than 2³¹ (its offsets are 32-bit); anything else is rounded by
torch's own cast (``out.copy_(x)``), which gives the same bits (a NaN's aside: a NaN stays a NaN, but the kernel's
``cvt.rn.bf16x2.f32`` makes it the canonical one, whose bits may not be torch's). The kernel launches on
torch's current stream of ``x``'s device and returns without synchronising.
"""

from __future__ import annotations

import torch

from ..numerics import ROUND_RUN as RUN
from ..variants import RoundVariant
from ._cache import (
    CompileCache, compile_for_launch, current_stream, device_index, fake_stream, on_device, to_cute_tensor,
)

_ROUND = CompileCache("round_bf16")
_META = torch.device("meta")
MAX_ELEMENTS = 2**31 - 1  # the kernel's element offsets are Int32


def on_the_kernel(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel rounds ``x`` into ``out`` (see the module doc), else torch's cast."""
    n = x.numel()
    return (x.is_cuda and x.dtype == torch.float16 and 0 < n <= MAX_ELEMENTS and n % RUN == 0
            and x.is_contiguous() and out.is_contiguous() and x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0)


def compiled_variant(variant: RoundVariant, index: int):
    """The compiled rounding ``variant`` on device ``index``, compiled (from fake tensors) on first use."""

    def build():
        from ..kernels.round_bf16 import RoundBf16Kernel

        return compile_for_launch(RoundBf16Kernel(variant.num_threads, variant.vectors), *compile_arguments())

    return _ROUND.get((variant, index), build)


def compile_arguments() -> tuple:
    """The kernel's arguments for a compile: flat fp16 and bf16 fake tensors (16-byte aligned, every extent
    dynamic) and a fake stream."""
    x = torch.empty(RUN, dtype=torch.float16, device=_META)
    out = torch.empty(RUN, dtype=torch.bfloat16, device=_META)
    return to_cute_tensor(x, 16), to_cute_tensor(out, 16), fake_stream()


def compile_variant(variant: RoundVariant, device: torch.device | str) -> None:
    """Compile (or load from the disk cache) ``variant`` for ``device`` ahead of time; nothing is launched."""
    compiled_variant(variant, device_index(torch.device(device)))


def round_to_bf16(x: torch.Tensor, out: torch.Tensor | None = None, *,
                  variant: RoundVariant = RoundVariant()) -> torch.Tensor:
    """``x`` (fp16) rounded to bf16 to nearest even, as ``x.to(torch.bfloat16)`` does: into ``out`` (bf16, ``x``'s
    shape and device) or a new contiguous tensor, which is returned."""
    if x.dtype != torch.float16:
        raise TypeError(f"round_to_bf16 takes an fp16 tensor, got {x.dtype}")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    elif out.dtype != torch.bfloat16 or out.shape != x.shape or out.device != x.device:
        raise ValueError(f"out must be bf16 of x's shape {tuple(x.shape)} on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not on_the_kernel(x, out):
        return out.copy_(x)
    device = x.device
    compiled = compiled_variant(variant, device_index(device))
    with on_device(device):
        compiled(x.view(-1), out.view(-1), current_stream(device))
    return out
