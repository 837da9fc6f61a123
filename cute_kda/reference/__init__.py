"""Torch references for the kernels.

- :mod:`.gold`: the token recurrence in fp64 (or any dtype), differentiable — the accuracy yardstick.
- :mod:`.mirror`: the chunk-16 algorithm with the kernels' rounding, step by step as
  docs/numerics.md fixes it — the exact-comparison reference for K1 and K2.
- :mod:`.backward`: gold gradients by autograd; the backward's reverse state-gradient scan (Kernel A),
  its per-tile gradients (Kernel B) and the whole backward chain, with the kernels' rounding and in
  exact float64.
- :mod:`.gates`: every gate (issue 12): the overflow-free pairwise K1 formulation, exact (forward and backward
  chain) and with the rounding of each proposed K1 scheme, and the backward with a tile-gradient kernel's
  proposed rounding (:func:`~.gates.mirror_backward_gates`).

Importing this package needs no GPU and does not import the CuTe DSL.
"""

from __future__ import annotations

import torch

from .backward import (
    BwdGradsResult,
    BwdScanResult,
    FwdStatesResult,
    chunk_backward_exact,
    chunk_bwd_grads_exact,
    chunk_bwd_scan_exact,
    chunk_fwd_states_exact,
    gold_backward,
    mirror_backward,
    mirror_bwd_grads,
    mirror_bwd_scan,
    prepare_exact,
)
from .gates import (
    K1_SCHEMES,
    chunk_backward_pairwise_exact,
    chunk_forward_pairwise_exact,
    mirror_backward_gates,
    mirror_bwd_grads_gates,
    mirror_prepare_gates,
    prepare_pairwise_exact,
)
from .gold import gold_forward
from .mirror import intrinsics_exact, mirror_forward, mirror_prepare, mirror_recurrence, tile_bases


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` (Frobenius norms, computed in fp64): the accuracy figure used everywhere.

    ``b`` is the reference. Returns ``inf`` when ``b`` is zero and ``a`` is not, 0 when both are.
    """
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a64, b64 = a.detach().to(torch.float64), b.detach().to(device=a.device, dtype=torch.float64)
    error = torch.linalg.vector_norm(a64 - b64).item()
    norm = torch.linalg.vector_norm(b64).item()
    if norm == 0.0:
        return 0.0 if error == 0.0 else float("inf")
    return error / norm


__all__ = [
    "K1_SCHEMES",
    "BwdGradsResult",
    "BwdScanResult",
    "FwdStatesResult",
    "chunk_backward_exact",
    "chunk_backward_pairwise_exact",
    "chunk_bwd_grads_exact",
    "chunk_bwd_scan_exact",
    "chunk_forward_pairwise_exact",
    "chunk_fwd_states_exact",
    "gold_backward",
    "gold_forward",
    "intrinsics_exact",
    "mirror_backward",
    "mirror_backward_gates",
    "mirror_bwd_grads_gates",
    "mirror_bwd_grads",
    "mirror_bwd_scan",
    "mirror_forward",
    "mirror_prepare",
    "mirror_prepare_gates",
    "mirror_recurrence",
    "prepare_exact",
    "prepare_pairwise_exact",
    "rel_rms",
    "tile_bases",
]
