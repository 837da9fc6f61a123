"""Kernel B, the tile gradients (:mod:`.base`), one class a gate scheme: :class:`~.safe.SafeBwdGrads`,
:class:`~.dyadic.DyadicBwdGrads`, :class:`~.per_head.PerHeadBwdGrads`; :func:`bwd_grads_kernel` picks one."""

from __future__ import annotations

from cutlass import BFloat16

from ...layouts.bwd_grads import DEFAULT_WARPS
from .base import BwdGrads, GradsInputs, GradsOutputs, GradsScalars, GradsStates, GradsWorkspace
from .dyadic import DyadicBwdGrads
from .per_head import PerHeadBwdGrads
from .safe import SafeBwdGrads

__all__ = ["BwdGrads", "DyadicBwdGrads", "GradsInputs", "GradsOutputs", "GradsScalars", "GradsStates",
           "GradsWorkspace", "PerHeadBwdGrads", "SafeBwdGrads", "bwd_grads_kernel"]


def bwd_grads_kernel(*, varlen: bool, qk_l2norm: bool = True, beta_logits: bool = True,
                     compute_warps: int = DEFAULT_WARPS, gate: str = "safe", gate_dtype: type = BFloat16,
                     per_head_gate: bool = False, grouped: bool = False) -> BwdGrads:
    """The Kernel B of a variant: the safe gate's, a per-head gate's (``per_head_gate``: GatedDeltaNet's g
    ``[.., HV]``) or the per-channel unbounded gates' (``gate`` "softplus" or "none")."""
    flags = dict(varlen=varlen, qk_l2norm=qk_l2norm, beta_logits=beta_logits, compute_warps=compute_warps)
    if gate == "safe":
        if per_head_gate:
            raise ValueError("a per-head gate is 'softplus' or 'none' (the safe gate is per channel)")
        if grouped:
            raise NotImplementedError("grouped value heads are built for the unbounded gates only")
        if gate_dtype is not BFloat16:
            raise ValueError(f"g is bf16 (or fp32 with gate 'none'), got {gate_dtype} with gate 'safe'")
        return SafeBwdGrads(**flags)
    scheme = PerHeadBwdGrads if per_head_gate else DyadicBwdGrads
    return scheme(**flags, gate=gate, gate_dtype=gate_dtype, grouped=grouped)
