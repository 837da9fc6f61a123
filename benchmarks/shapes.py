"""The forward shapes of design.md §6 and their inputs, shared by the benchmark and profiling scripts.

Each shape carries FlashKDA's measured forward time (design.md §6, H200, D = 128, fp32 state),
the bar every cute_kda number is held against.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

D = 128
LOWER_BOUND = -5.0


@dataclass(frozen=True)
class Shape:
    """``batch`` rows of ``lengths[0]`` tokens, or one packed row of ``lengths`` (``varlen``)."""

    lengths: tuple[int, ...]
    heads: int
    flashkda_ms: float | None = None  # design.md §6's measurement, where it has one
    varlen: bool = False

    @property
    def batch(self) -> int:
        return 1 if self.varlen else len(self.lengths)

    @property
    def seq_len(self) -> int:
        return sum(self.lengths) if self.varlen else self.lengths[0]


SHAPES = {
    "B1_T8192_H96": Shape((8192,), 96, 1.40),
    "varlen6_H96": Shape((1300, 547, 2048, 963, 271, 3063), 96, 1.39, varlen=True),
    "varlen1024x8_H96": Shape((1024,) * 8, 96, 1.20, varlen=True),
    "B1_T8192_H64": Shape((8192,), 64, 1.20),
    "B1_T32768_H16": Shape((32768,), 16, 3.38),
    "B8_T4096_H32": Shape((4096,) * 8, 32, 1.53),
}


# Kimi-Linear-48B-A3B prefill (H = 32, D = 128): the model of the softplus gate (issue 12)
KIMI_SHAPES = {
    "kimi_T4096_H32": Shape((4096,), 32),
    "kimi_T32768_H32": Shape((32768,), 32),
    "kimi_T131072_H32": Shape((131072,), 32),
    "kimi_varlen6_H32": Shape((1300, 547, 2048, 963, 271, 3063), 32, varlen=True),
}


def head_dim(text: str) -> int:
    """An argparse type: a head dim 1..128 (cute_kda runs 64 on kernels compiled for it, the others below 128
    zero-padded to 128)."""
    value = int(text)
    if not 1 <= value <= D:
        raise argparse.ArgumentTypeError(f"a head dim from 1 to {D}, got {value}")
    return value


def head_dim_note(dim: int, training: bool = False) -> str:
    """How cute_kda runs head dim ``dim`` (K = V), for a table header: nothing at the kernels' 128, else native or
    zero-padded (:func:`cute_kda.call.runs_native`; ``training``: a training call's routing)."""
    from cute_kda.call import HeadDims, runs_native

    if dim == D:
        return ""
    return f" (cute_kda: native D = {dim} kernels)" if runs_native(HeadDims(dim, dim, 1), training) else \
        f" (cute_kda: zero-padded to {D})"


def make_inputs(shape: Shape, device: torch.device, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                dim: int = D) -> dict:
    """FlashKDA-style inputs: raw q, k, gate and beta logits (all activations in-kernel), fp32 v-first state.

    Keys: q, k, v, g ``[B, T, H, D]`` and beta ``[B, T, H]`` in ``dtype`` (bf16, or fp16 as FLA's tests pass it: the
    same draws rounded to fp16; cute_kda rounds an fp16 β to bf16 where the call enters), A_log ``[H]`` and
    dt_bias ``[H, D]`` fp32, initial_state ``[N, H, D, D]`` fp32, cu_seqlens int64 ``[N + 1]`` or None; D = ``dim``
    (the kernels' 128 by default; cute_kda runs 64 natively, other smaller head dims zero-padded to 128).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t, h = shape.batch, shape.seq_len, shape.heads

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    inputs = dict(
        q=randn(b, t, h, dim, dtype=dtype), k=randn(b, t, h, dim, dtype=dtype), v=randn(b, t, h, dim, dtype=dtype),
        g=randn(b, t, h, dim, dtype=dtype), beta=randn(b, t, h, dtype=dtype),
        A_log=torch.rand(h, generator=gen, device=device), dt_bias=torch.rand(h, dim, generator=gen, device=device),
        initial_state=0.1 * randn(len(shape.lengths), h, dim, dim, dtype=torch.float32),
        cu_seqlens=None,
    )
    if shape.varlen:
        bounds = torch.tensor((0, *shape.lengths), dtype=torch.int64).cumsum(0)
        inputs["cu_seqlens"] = bounds.to(device)
    return inputs
