"""bf16 ULP comparison shared by the kernel-vs-mirror tests (docs/numerics.md, "≤ 1 ULP").

Values produced by fp32 tensor-core sums (Mqk, INV, and K2's o and state) carry a rounding error
proportional to the magnitude of the summed terms, not of the result. Where a sum cancels to a
value far below its terms, it can differ from the mirror by many of its own ULPs while differing by
a small fraction of one ULP at the scale of its row. So a comparison asserts both:

- elementwise: all but ``max(2, 1e-3·n)`` entries within 1 bf16 ULP (exact fraction printed), counted among the
  entries the row resolves: those whose |mirror| is at least 2⁻⁸ of the row's largest (smaller ones vanish when
  added to it in bf16, so only the row-scale bound can judge them);
- at row scale: every entry within 1 bf16 ULP of the largest |mirror| value of its row (``dim``).

Identical bit patterns (±0, ±inf included) count as equal.
"""

from __future__ import annotations

import torch


def ordered_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 values as order-preserving integers: neighbouring bf16 values differ by 1, ±0 → 0."""
    bits = x.bfloat16().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got − want| in bf16 ULPs (both rounded to bf16 first)."""
    return (ordered_bf16(got) - ordered_bf16(want)).abs()


def row_scale_ulps(got: torch.Tensor, want: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """|got − want| in bf16 ULPs of the largest |want| along ``dim``."""
    got, want = got.bfloat16().float(), want.bfloat16().float()
    same = got.view(torch.int32) == want.view(torch.int32)
    scale = want.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)  # bf16 keeps 8 significant bits
    return torch.where(same, torch.zeros_like(got), (got - want).abs() / ulp)


def assert_within_one_ulp(label: str, got: torch.Tensor, want: torch.Tensor, dim: int = -1,
                          row_ulps: float = 1.0) -> None:
    """Assert the two-part bound of the module docstring, printing the ULP histogram; ``row_ulps``: the row-scale
    bound (1 ULP unless a caller's chain rounds more often than the mirror's)."""
    ulps = bf16_ulps(got, want)
    n = ulps.numel()
    equal, one = int((ulps == 0).sum()), int((ulps == 1).sum())
    magnitude = want.float().abs()
    resolved = magnitude >= magnitude.amax(dim=dim, keepdim=True) * 2.0**-8
    beyond = int(((ulps > 1) & resolved).sum())
    unresolved = n - equal - one - beyond
    row = row_scale_ulps(got, want, dim)
    worst_row = float(row.max()) if n else 0.0
    print(f"{label}: {equal}/{n} equal, {one} at 1 ulp, {beyond} beyond (+{unresolved} below the row's resolution; "
          f"max {int(ulps.max()) if n else 0} ulp, max {worst_row:.3f} ulp at row scale)")
    assert beyond <= max(2, int(1e-3 * n)), f"{label}: {beyond} of {n} entries beyond 1 ulp"
    assert worst_row <= row_ulps, f"{label}: {worst_row:.3f} ulp at row scale"
