"""Torch references for the kernels, in three kinds that import one another only downwards.

The gold:

- :mod:`.gold`: the token recurrence in fp64 (or any dtype) and its gradients by autograd — the accuracy
  yardstick.

Mirrors of what ships, with the kernels' rounding, step by step as docs/numerics.md fixes it — the
exact-comparison references of the kernels:

- :mod:`.mirror`: K1 of the safe gate and K2 (the forward);
- :mod:`.gates`: K1 and Kernel B of the unbounded gates, by the kernels' schemes ``dyadic`` (per channel) and
  ``per_head`` (GatedDeltaNet);
- :mod:`.backward`: Kernel A, Kernel B of the safe gate and the whole backward chain for every gate.

The exact chains, the same formulas in float64 without rounding, equal to the gold to fp64 precision:

- :mod:`.exact`: the safe gate's chain (kinv form) and the every-gate chain (pair-decay form).

Serving: :mod:`.pool`, a prefill on a state pool by definition (gather → prefill → scatter, prefix checkpoints as
prefills cut short) around any of the forwards above or the kernels.

Shared by all: :mod:`.common` (the intrinsics, constants, tensor-core sums, tile maps, row sums) and
:mod:`.chains` (Kernel A's and Kernel B's chains in either arithmetic, for the mirrors and the exact chains).
Importing this package needs no GPU and does not import the CuTe DSL.
"""

from __future__ import annotations

import torch

from .backward import mirror_backward, mirror_bwd_grads, mirror_bwd_grads_gates, mirror_bwd_scan
from .chains import BwdScanResult
from .common import intrinsics_exact, tile_bases
from .exact import (
    FwdStatesResult,
    chunk_backward_exact,
    chunk_backward_gates_exact,
    chunk_bwd_grads_exact,
    chunk_bwd_scan_exact,
    chunk_forward_gates_exact,
    chunk_fwd_states_exact,
    prepare_exact,
    prepare_gates_exact,
)
from .gates import K1_SCHEMES, mirror_prepare_gates
from .gold import gold_backward, gold_forward
from .mirror import mirror_forward, mirror_prepare, mirror_recurrence
from .pool import prefill_on_pool


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
    "BwdScanResult",
    "FwdStatesResult",
    "chunk_backward_exact",
    "chunk_backward_gates_exact",
    "chunk_bwd_grads_exact",
    "chunk_bwd_scan_exact",
    "chunk_forward_gates_exact",
    "chunk_fwd_states_exact",
    "gold_backward",
    "gold_forward",
    "intrinsics_exact",
    "mirror_backward",
    "mirror_bwd_grads_gates",
    "mirror_bwd_grads",
    "mirror_bwd_scan",
    "mirror_forward",
    "mirror_prepare",
    "mirror_prepare_gates",
    "mirror_recurrence",
    "prefill_on_pool",
    "prepare_exact",
    "prepare_gates_exact",
    "rel_rms",
    "tile_bases",
]
