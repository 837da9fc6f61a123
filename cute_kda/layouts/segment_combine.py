"""Layouts of the segment combine (:class:`cute_kda.kernels.segment_combine.SegmentCombineKernel`).

A CTA owns :data:`ROWS` rows of one (sequence, head)'s state and walks the segments in order. Each step it stages
the segment's transition ``F`` (fp32 ``[D, D]``) in shared memory and its own rows of the running state ``X``
(fp32 ``[ROWS, D]``). The transition tile's rows are padded by one element: thread ``j`` of the forward combine
reads ``F[k, j]`` (a row, consecutive banks), of the transposed combine ``F[j, k]`` (a column, D + 1 words
apart: consecutive banks again), so both directions read it without bank conflicts.
"""

from __future__ import annotations

from ..dsl import cute

THREADS = 128  # a CTA: every thread owns one column of ROWS · D / THREADS of the CTA's state elements
ROWS = 8  # state rows a CTA owns: D / ROWS CTAs a (sequence, head)
PAD = 1  # elements after each row of the staged transition
WORD = 4  # bytes of an fp32


def transition_tile(dim: int):
    """fp32 ``[D, D]`` staging of one segment's transition, rows ``D + PAD`` elements apart."""
    return cute.make_layout((dim, dim), stride=(dim + PAD, 1))


def state_rows(dim: int):
    """fp32 ``[ROWS, D]`` of the running state's rows a CTA owns, row-major."""
    return cute.make_layout((ROWS, dim), stride=(dim, 1))


def smem_bytes(dim: int) -> int:
    """Shared memory of a CTA: the padded transition and the state rows."""
    return (dim * (dim + PAD) + ROWS * dim) * WORD


def rows_per_pass(dim: int) -> int:
    """Rows a CTA's threads cover at once (``THREADS // D``): thread ``t`` takes column ``t % D`` of rows
    ``t // D``, ``t // D + THREADS // D``, …"""
    return THREADS // dim
