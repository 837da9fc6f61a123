"""Torch launcher of the multistage GEMM (:class:`teaching.kernels.gemm_multistage.GemmMultistageKernel`).

``gemm(a, b)`` = ``a @ b.T`` for bf16 ``a [M, K]``, ``b [N, K]`` (row-major), fp32 accumulation, bf16 or
fp32 ``C [M, N]``. A teaching kernel (``docs/gemm-walkthrough.md``), not a cuBLAS replacement:
``benchmarks/bench_gemm.py`` says how far it is from ``torch.matmul``.

One compile per static configuration (:class:`~teaching.layouts.gemm.GemmPlan` and device), with
dynamic M, N, K. Inputs are checked here (:func:`validate_gemm`); the launch runs on torch's current
stream and does not synchronise.
"""

from __future__ import annotations

import torch

from cute_kda.ops._cache import compile_for_launch, current_stream, device_index, launch_tensor, to_cute_tensor
from cute_kda.validation import (
    ALIGNMENT_BYTES, check_aligned, check_contiguous, check_dtype, check_is_tensor, check_ndim, check_on_cuda,
    check_same_device,
)

from ._cache import teaching_cache

_GEMM = teaching_cache("gemm_multistage")

# The tile configurations offered: name → kernel keyword arguments (every stage count ≥ 2 is accepted).
CONFIGS: dict[str, dict] = {
    "128x128x32": dict(tile=(128, 128, 32), warps=(2, 2)),  # 4 warps of 64x64: the seed tutorial's tile
    "128x256x32": dict(tile=(128, 256, 32), warps=(2, 4)),  # 8 warps of 64x64: more reuse per k-tile
    "64x128x64": dict(tile=(64, 128, 64), warps=(2, 2)),  # 4 warps of 32x64, 128-byte rows (K_SW128)
}
DEFAULT_CONFIG = "128x128x32"
DEFAULT_STAGES = 3
OUT_DTYPES = (torch.bfloat16, torch.float32)
MAX_ELEMENTS = 2 ** 31 - 1  # the kernel's index arithmetic is 32-bit


def _dsl_dtype(dtype: torch.dtype):
    from cute_kda.dsl import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}[dtype]


def kernel_for(config: str = DEFAULT_CONFIG, stages: int = DEFAULT_STAGES, out_dtype: torch.dtype = torch.bfloat16,
               swizzle: bool = True):
    """The :class:`GemmMultistageKernel` of a named configuration (no compile; imports the DSL)."""
    from ..kernels.gemm_multistage import GemmMultistageKernel

    if config not in CONFIGS:
        raise ValueError(f"config must be one of {list(CONFIGS)}, got {config!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return GemmMultistageKernel(**CONFIGS[config], stages=stages, out_dtype=_dsl_dtype(out_dtype), swizzle=swizzle)


def validate_gemm(a: object, b: object, out: object | None, out_dtype: torch.dtype,
                  tile_k: int) -> tuple[int, int, int]:
    """Check the operands of ``gemm`` (``out_dtype`` one of :data:`OUT_DTYPES`); return ``(M, N, K)``.

    Raises TypeError (not a tensor, dtype) or
    ValueError (shape, K not a multiple of BK, N not a multiple of the 16-byte C vector, layout,
    alignment, device, size)."""
    a, b = check_is_tensor("a", a), check_is_tensor("b", b)
    check_dtype("a", a, (torch.bfloat16,))
    check_dtype("b", b, (torch.bfloat16,))
    check_ndim("a", a, 2, "[M, K]")
    check_ndim("b", b, 2, "[N, K] (the kernel computes a @ b.T)")
    (m, k), (n, k_b) = a.shape, b.shape
    if k_b != k:
        raise ValueError(f"a is [M, K] = {list(a.shape)} and b is [N, K] = {list(b.shape)}: K differs ({k} vs {k_b})")
    if k % tile_k:
        padded = (k + tile_k - 1) // tile_k * tile_k
        raise ValueError(f"K = {k} is not a multiple of the tile's BK = {tile_k} (the kernel has no K tail); "
                         f"pad K with zeros to {padded} or pick a tile with a BK that divides K")
    vector = ALIGNMENT_BYTES // torch.empty((), dtype=out_dtype).element_size()
    if n % vector:
        raise ValueError(f"N = {n} must be a multiple of {vector} for {str(out_dtype).replace('torch.', '')} output "
                         f"(the epilogue stores whole {ALIGNMENT_BYTES}-byte pieces of a C row)")
    tensors = {"a": a, "b": b}
    if out is not None:
        out = check_is_tensor("out", out)
        check_dtype("out", out, (out_dtype,))
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must have shape [M, N] = {[m, n]}, got {list(out.shape)}")
        tensors["out"] = out
    for name, tensor in tensors.items():
        check_contiguous(name, tensor)
        check_aligned(name, tensor)
        if tensor.numel() > MAX_ELEMENTS:
            raise ValueError(f"{name} has {tensor.numel()} elements; the kernel indexes with 32 bits "
                             f"(at most {MAX_ELEMENTS})")
    for name, tensor in tensors.items():
        check_on_cuda(name, tensor)
        check_same_device(name, tensor, a.device, reference="a")
    return m, n, k


def _kernel_args(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, stream, tensor=launch_tensor) -> tuple:
    """Positional arguments of ``GemmMultistageKernel.__call__``; ``tensor`` converts each tensor
    (:func:`~cute_kda.ops._cache.launch_tensor` for a call, :func:`~cute_kda.ops._cache.to_cute_tensor`
    for the compile)."""
    return tensor(a, ALIGNMENT_BYTES), tensor(b, ALIGNMENT_BYTES), tensor(c, ALIGNMENT_BYTES), stream


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: str = DEFAULT_CONFIG,
    stages: int = DEFAULT_STAGES,
    swizzle: bool = True,
) -> torch.Tensor:
    """``a @ b.T`` on the multistage GEMM: bf16 ``a [M, K]``, ``b [N, K]`` → ``out_dtype [M, N]``.

    ``config``: a key of :data:`CONFIGS` (CTA tile and warps); ``stages``: k-tiles in flight (≥ 2);
    ``swizzle=False``: row-major shared memory (slower; for the comparison). K must be a multiple of
    the tile's BK and N of 8 (bf16 out) or 4 (fp32 out); M is free. ``out``: write there instead of
    a new tensor. Launches on the current stream; returns without synchronising.
    """
    kernel = kernel_for(config, stages, out_dtype, swizzle)  # checks the configuration first
    m, n, k = validate_gemm(a, b, out, out_dtype, kernel.plan.bk)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    device = a.device
    with torch.cuda.device(device):
        arguments = (a, b, out, current_stream(device))
        key = (kernel.plan, device_index(device))
        compiled = _GEMM.get(key, lambda: compile_for_launch(kernel, *_kernel_args(*arguments, tensor=to_cute_tensor)))
        compiled(*_kernel_args(*arguments))
    return out
