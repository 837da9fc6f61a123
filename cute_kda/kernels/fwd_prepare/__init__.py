"""K1, the prepare kernel (:mod:`.base`), one class a gate scheme (:data:`cute_kda.numerics.GATE_SCHEMES`):
:class:`~.safe.SafePrepare`, :class:`~.dyadic.DyadicPrepare`, :class:`~.per_head.PerHeadPrepare`; and the pair variants
of the two-tile serial step (:mod:`.pairs`), :class:`~.safe_pairs.SafePairPrepare` and
:class:`~.per_head_pairs.PerHeadPairPrepare`; :func:`prepare_kernel` picks one."""

from __future__ import annotations

from typing import Any

from ...numerics import gate_scheme
from .base import PrepareInputs, PrepareKernel, PrepareScalars, PrepareTma, WorkspaceTiles
from .dyadic import DyadicPrepare
from .pairs import PairPrepare
from .per_head import PerHeadPrepare
from .per_head_pairs import PerHeadPairPrepare
from .safe import SafePrepare
from .safe_pairs import SafePairPrepare

__all__ = ["DyadicPrepare", "PairPrepare", "PerHeadPairPrepare", "PerHeadPrepare", "PrepareInputs", "PrepareKernel",
           "PrepareScalars", "PrepareTma", "SafePairPrepare", "SafePrepare", "WorkspaceTiles", "prepare_kernel"]

SCHEMES = {"safe": SafePrepare, "dyadic": DyadicPrepare, "per_head": PerHeadPrepare}
PAIR_SCHEMES = {"safe": SafePairPrepare, "per_head": PerHeadPairPrepare}  # variants.PAIR_SCHEMES' classes


def prepare_kernel(*, gate: str = "safe", per_head_gate: bool = False, pairs: bool = False,
                   **config: Any) -> PrepareKernel:
    """The K1 of a variant: the class of ``gate``'s scheme (per head with ``per_head_gate``, GatedDeltaNet's g
    ``[.., HV]``), built with ``gate`` and ``config`` (:class:`~.base.PrepareKernel`'s other arguments); ``pairs``:
    the workspace of the two-tile serial step (:data:`PAIR_SCHEMES`: the safe gate, a per-head gate)."""
    scheme = gate_scheme(gate, per_head_gate)
    if pairs:
        if scheme not in PAIR_SCHEMES:
            raise ValueError(f"the pair K1 is built for schemes {tuple(PAIR_SCHEMES)}, not {scheme!r}")
        return PAIR_SCHEMES[scheme](gate=gate, **config)
    return SCHEMES[scheme](gate=gate, **config)
