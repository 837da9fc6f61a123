"""Shared-memory layouts, transpose-dual pairs, TMA views and host-side layout analysis.

Layout constructors run inside a CuTe trace (``@cute.jit``); the analysis helpers evaluate them on
the host, so everything here works on a machine without a GPU.
"""

from .smem import (  # noqa: F401
    CHUNK,
    HEAD_DIM,
    AtomKind,
    chunk_operand,
    chunk_operand_transposed,
    layout_atom,
    operand_tile,
    operand_tile_transposed,
    square_tile,
    square_tile_transposed,
    state_acc_view,
    state_b_view,
    state_fp32,
    vector,
)
