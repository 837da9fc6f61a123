"""K1, the prepare kernel (:mod:`.base`), one class a gate scheme (:data:`cute_kda.numerics.GATE_SCHEMES`):
:class:`~.safe.SafePrepare`, :class:`~.dyadic.DyadicPrepare`, :class:`~.per_head.PerHeadPrepare`;
:func:`prepare_kernel` picks one."""

from __future__ import annotations

from typing import Any

from ...numerics import gate_scheme
from .base import PrepareInputs, PrepareKernel, PrepareScalars, PrepareTma, WorkspaceTiles
from .dyadic import DyadicPrepare
from .per_head import PerHeadPrepare
from .safe import SafePrepare
from .safe_pairs import SafePairPrepare

__all__ = ["DyadicPrepare", "PerHeadPrepare", "PrepareInputs", "PrepareKernel", "PrepareScalars", "PrepareTma",
           "SafePairPrepare", "SafePrepare", "WorkspaceTiles", "prepare_kernel"]

SCHEMES = {"safe": SafePrepare, "dyadic": DyadicPrepare, "per_head": PerHeadPrepare}


def prepare_kernel(*, gate: str = "safe", per_head_gate: bool = False, pairs: bool = False,
                   **config: Any) -> PrepareKernel:
    """The K1 of a variant: the class of ``gate``'s scheme (per head with ``per_head_gate``, GatedDeltaNet's g
    ``[.., HV]``), built with ``gate`` and ``config`` (:class:`~.base.PrepareKernel`'s other arguments); ``pairs``:
    the workspace of the two-tile serial step (:class:`~.safe_pairs.SafePairPrepare`, the safe gate)."""
    scheme = gate_scheme(gate, per_head_gate)
    if pairs:
        if scheme != "safe":
            raise ValueError(f"the pair K1 is built for the safe gate, not scheme {scheme!r}")
        return SafePairPrepare(gate=gate, **config)
    return SCHEMES[scheme](gate=gate, **config)
