"""Shared-memory layouts, transpose-dual pairs, TMA views, smem plans and host-side layout analysis.

Layout constructors run inside a CuTe trace (``@cute.jit``); the analysis helpers and the smem plans
evaluate them on the host, so everything here works on a machine without a GPU.

Modules: :mod:`.smem` (layout constructors), :mod:`.tma` (TMA views), :mod:`.analysis` (byte tables,
transpose-dual check, bank conflicts), :mod:`.budget` (smem plans: buffers, offsets, occupancy),
one module per kernel with its layouts and smem plan (:mod:`.fwd_prepare`: K1, :mod:`.fwd_recurrence`:
K2, :mod:`.bwd_scan`: Kernel A, the backward scan, :mod:`.bwd_grads`: Kernel B, the tile gradients).
``k1_budget()`` and ``k2_budget(plan)`` (a ``RecurrenceSmemPlan`` or Kernel A's ``ScanSmemPlan``) give
the plans as buffer tables. The teaching kernels' layouts (the multistage GEMM's) live outside the
package, in ``teaching/layouts``.
"""

from . import analysis, budget, bwd_scan, fwd_prepare, fwd_recurrence, smem, tma  # noqa: F401
from .analysis import bank_conflict_table, check_transpose_dual, design_pairs, format_conflict_table  # noqa: F401
from .budget import SmemBudget, k2_budget  # noqa: F401
from .fwd_prepare import dyadic_smem_budget as k1_dyadic_budget  # noqa: F401
from .fwd_prepare import smem_budget as k1_budget  # noqa: F401
from .fwd_recurrence import RecurrenceSmemPlan  # noqa: F401
from .smem import (  # noqa: F401
    CHUNK,
    HEAD_DIM,
    AtomKind,
    atom_tile,
    atom_tile_transposed,
    chunk_operand,
    chunk_operand_transposed,
    layout_atom,
    operand_tile,
    operand_tile_transposed,
    row_major_tile,
    row_major_tile_transposed,
    square_tile,
    square_tile_transposed,
    state_acc_view,
    state_b_view,
    state_fp32,
    sw128_tile,
    sw128_tile_transposed,
    vector,
)
