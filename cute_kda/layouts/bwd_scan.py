"""Shared-memory plan and layouts of Kernel A, the backward state-gradient scan (``cute_kda.kernels.bwd_scan``).

Kernel A is K2's skeleton run backwards (:mod:`cute_kda.kernels.common.band_scan`): a CTA owns one
(sequence, head, V-band) and holds the band of the state gradient ``dS[v, k]`` (bf16 ``[v_band, D]``)
where K2 holds the state, in the same transpose-dual pair (:func:`.fwd_recurrence.state_b` /
:func:`.fwd_recurrence.state_acc`). Its input stage carries the upstream gradient ``dO`` of the band
where K2's carries ``v``, and the same seven workspace fields; its output stage carries two tiles,
``dv`` and ``du``. So the plan is K2's with other field names and V-split 8 allowed (a 16-column
band runs on two compute warps of 8 columns).

The operands it reads through their MN-major faces (``ldmatrix.trans``): ``Mqkᵀ`` and ``INVᵀ`` (A
operands, from the K_INTER squares), ``qdᵀ`` and ``kdᵀ`` (A operands of the ``[D, 16]`` row blocks of
the K_SW128 tiles, like K2's ``krᵀ``), and ``dOᵀ`` (the B operand ``[cols, 16]`` of the warp's columns,
from the swizzled band tile).
"""

from __future__ import annotations

from ..numerics import SCAN_VSPLITS
from .fwd_recurrence import RecurrenceSmemPlan, staged, token_atom
from .smem import atom_tile_transposed, operand_tile_transposed



class ScanSmemPlan(RecurrenceSmemPlan):
    """Kernel A's shared memory: :class:`~.fwd_recurrence.RecurrenceSmemPlan` with the per-token input
    ``do`` (the band of ``dO``) and the output tiles ``dv``, ``du`` of the band."""

    kernel_name = "Kernel A"
    supported_vsplits = SCAN_VSPLITS
    token_field = "do"
    output_fields = ("dv", "du")


def token_tile_transposed(plan: RecurrenceSmemPlan, stages: int):
    """``[v_band, 16, stages]``: MN-major view of the per-token tiles (``dOᵀ``, B operand), same bytes
    (the transposed atom of :func:`~.fwd_recurrence.token_atom`)."""
    if plan.swizzled_tokens:
        return atom_tile_transposed(token_atom(plan), plan.chunk, plan.v_band, stages=stages)
    return staged(operand_tile_transposed(plan.chunk, plan.v_band), stages)


def square_tile_transposed(plan: RecurrenceSmemPlan):
    """``[16, 16, input_stages]``: MN_INTER view of the INV / Mqk tiles (``INVᵀ``, ``Mqkᵀ`` as A operands)."""
    return staged(operand_tile_transposed(plan.chunk, plan.chunk), plan.input_stages)
