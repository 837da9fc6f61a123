"""Kernel B, the tile gradients (:mod:`.base`), one class a gate scheme (:data:`cute_kda.numerics.GATE_SCHEMES`):
:class:`~.safe.SafeBwdGrads`, :class:`~.dyadic.DyadicBwdGrads`, :class:`~.per_head.PerHeadBwdGrads`;
:func:`bwd_grads_kernel` picks one."""

from __future__ import annotations

from typing import Any

from ...numerics import gate_scheme
from .base import BwdGrads, GradsInputs, GradsOutputs, GradsScalars, GradsStates, GradsWorkspace, PairInputs
from .dyadic import DyadicBwdGrads
from .per_head import PerHeadBwdGrads
from .safe import SafeBwdGrads

__all__ = ["BwdGrads", "DyadicBwdGrads", "GradsInputs", "GradsOutputs", "GradsScalars", "GradsStates",
           "GradsWorkspace", "PairInputs", "PerHeadBwdGrads", "SafeBwdGrads", "bwd_grads_kernel"]

SCHEMES = {"safe": SafeBwdGrads, "dyadic": DyadicBwdGrads, "per_head": PerHeadBwdGrads}


def bwd_grads_kernel(*, gate: str = "safe", per_head_gate: bool = False, **config: Any) -> BwdGrads:
    """The Kernel B of a variant: the class of ``gate``'s scheme (per head with ``per_head_gate``, GatedDeltaNet's g
    ``[.., HV]``), built with ``gate`` and ``config`` (:class:`~.base.BwdGrads`' other arguments)."""
    return SCHEMES[gate_scheme(gate, per_head_gate)](gate=gate, **config)
