"""Shared-memory layouts of the KDA kernels, as functions of (D, CHUNK, dtype).

Every function here builds CuTe layouts and therefore runs inside a ``@cute.jit`` or
``@cute.kernel`` trace (on the host for exploration, or while compiling a kernel). Kernels take
their layouts from here and never build one of their own.

Naming: an *operand tile* is a ``[rows, cols]`` matrix that an ``mma.sync`` reads with ldmatrix,
the contraction dimension being ``cols``. It is stored with the ``K_INTER`` atom: 8×8 core matrices
of 128 contiguous bytes (one 16-byte row per ldmatrix lane), core matrices stacked down the rows
first. Its *transposed view* ``[cols, rows]`` uses the ``MN_INTER`` atom tiled the other way round
and addresses exactly the same bytes (``operand(i, j) == transposed(j, i)``): a *transpose-dual
pair*. One physical copy then serves both ``ldmatrix`` (row access) and ``ldmatrix.trans`` /
``stmatrix.trans`` (column access) without bank conflicts.

Every tiled layout here is :func:`atom_tile` (or its transposed view :func:`atom_tile_transposed`)
of one GMMA atom kind: ``K_INTER`` operand tiles, ``K_SW128`` tiles (K1), ``K_SW32`` fp32 state
staging. :func:`row_major_tile` is the unswizzled baseline (K1's gate cumsum adds a swizzle to it;
:mod:`.analysis` compares it with the atoms).
"""

from __future__ import annotations

from ..dsl import cute, cutlass
from cutlass.cute.nvgpu import warpgroup

from ..numerics import CHUNK, HEAD_DIM

AtomKind = warpgroup.SmemLayoutAtomKind


# The MN-major atom whose ``[cols, rows]`` tiling addresses the bytes of a K-major ``[rows, cols]`` tiling.
TRANSPOSED_ATOM = {
    AtomKind.K_INTER: AtomKind.MN_INTER,
    AtomKind.K_SW32: AtomKind.MN_SW32,
    AtomKind.K_SW64: AtomKind.MN_SW64,
    AtomKind.K_SW128: AtomKind.MN_SW128,
}


def layout_atom(kind: AtomKind, dtype: type = cutlass.BFloat16):
    """The GMMA shared-memory atom ``kind`` for ``dtype`` (e.g. K_INTER bf16 is ``(8,8):(8,1)``)."""
    return warpgroup.make_smem_layout_atom(kind, dtype)


def atom_tile(kind: AtomKind, rows: int, cols: int, dtype: type = cutlass.BFloat16, stages: int | None = None):
    """``[rows, cols]`` (``[rows, cols, stages]`` if ``stages``) of K-major ``kind`` atoms, down the rows first.

    Stage ``s`` of a staged tile is the unstaged tile ``s · rows · cols`` elements further on.
    """
    shape, order = ((rows, cols), (0, 1)) if stages is None else ((rows, cols, stages), (0, 1, 2))
    return cute.tile_to_shape(layout_atom(kind, dtype), shape, order)


def atom_tile_transposed(kind: AtomKind, rows: int, cols: int, dtype: type = cutlass.BFloat16,
                         stages: int | None = None):
    """``[cols, rows(, stages)]`` view of ``atom_tile(kind, rows, cols)``: the MN-major atom, same bytes."""
    shape, order = ((cols, rows), (1, 0)) if stages is None else ((cols, rows, stages), (1, 0, 2))
    return cute.tile_to_shape(layout_atom(TRANSPOSED_ATOM[kind], dtype), shape, order)


def operand_tile(rows: int, cols: int, dtype: type = cutlass.BFloat16):
    """``[rows, cols]`` operand tile, K_INTER atoms, core matrices tiled down the rows first."""
    return atom_tile(AtomKind.K_INTER, rows, cols, dtype)


def operand_tile_transposed(rows: int, cols: int, dtype: type = cutlass.BFloat16):
    """``[cols, rows]`` view of ``operand_tile(rows, cols)``: MN_INTER atoms, same bytes."""
    return atom_tile_transposed(AtomKind.K_INTER, rows, cols, dtype)


def sw128_tile(rows: int, cols: int, dtype: type = cutlass.BFloat16):
    """``[rows, cols]`` of 128-byte-swizzled ``K_SW128`` atoms (rows of a multiple of 128 bytes).

    The swizzle acts on byte addresses: build tensors with the swizzle on the pointer (see
    :func:`state_fp32`). K1's tiles; the TMA's ``SWIZZLE_128B`` mode.
    """
    return atom_tile(AtomKind.K_SW128, rows, cols, dtype)


SW128_ATOM_ROWS = 8  # a K_SW128 atom: 8 rows of 128 bytes, 16-byte chunk j of row r at chunk j ^ (r % 8)
SW128_CHUNK_ELEMS = 8  # bf16 elements per 16-byte chunk
# Bytes after which an atom's swizzle pattern repeats (8 rows of its width): a buffer of that atom sits on
# this alignment, and a stage stride that is a multiple of it leaves the swizzle unchanged.
SWIZZLE_PERIOD_BYTES = {AtomKind.K_INTER: 128, AtomKind.K_SW32: 256, AtomKind.K_SW64: 512, AtomKind.K_SW128: 1024}
SW128_PERIOD_BYTES = SWIZZLE_PERIOD_BYTES[AtomKind.K_SW128]
# The widest K-major swizzle atom whose 16-bit rows fit a band of this many bytes (8 rows of it per period)
_ATOM_FOR_ROW_BYTES = ((128, AtomKind.K_SW128), (64, AtomKind.K_SW64), (32, AtomKind.K_SW32), (16, AtomKind.K_INTER))


def row_atom(row_bytes: int) -> AtomKind:
    """The K-major atom for tiles whose rows are ``row_bytes`` long (a multiple of 16): the widest
    swizzle that fits, so that a TMA box moves rows of that width (K_SW128 for 128 bytes and more)."""
    for width, kind in _ATOM_FOR_ROW_BYTES:
        if row_bytes % width == 0:
            return kind
    raise ValueError(f"rows of {row_bytes} bytes are not a multiple of 16")


def sw128_column_offsets(col, rows: int = CHUNK, cols: int = HEAD_DIM) -> list:
    """Element offsets (bf16) of column ``col`` in rows ``0 … 7`` of :func:`sw128_tile` ``(rows, cols)``: the
    part of ``offset(r, col)`` that depends on the column, one per ``r % 8``. With :func:`sw128_row_offset`,
    ``offset(r, col) = sw128_column_offsets(col)[r % 8] + sw128_row_offset(r)``.

    For a kernel that walks one column down the rows (K1's unbounded-gate scan): eight offsets per column
    once, then every access is a register plus a constant, with no swizzle arithmetic per access. ``col`` is
    a Python int or a DSL integer (bit operations only); the layout tests check the formula against the
    DSL layout on every coordinate.
    """
    atom_cols = 128 // 2  # bf16 columns of an atom
    atom_block = rows * atom_cols  # elements of one atom column: the atoms go down the rows first
    chunk, within = (col >> 3) & (atom_cols // SW128_CHUNK_ELEMS - 1), col & (SW128_CHUNK_ELEMS - 1)
    block = (col >> 6) * atom_block
    return [block + ((chunk ^ r8) * SW128_CHUNK_ELEMS) + within for r8 in range(SW128_ATOM_ROWS)]


def sw128_row_offset(row: int, cols: int = HEAD_DIM) -> int:
    """The column-independent part of row ``row``'s element offsets in :func:`sw128_tile` (see
    :func:`sw128_column_offsets`): whole atoms above it, then 64 elements a row inside the atom."""
    atom_cols = 128 // 2
    return (row // SW128_ATOM_ROWS) * SW128_ATOM_ROWS * atom_cols + (row % SW128_ATOM_ROWS) * atom_cols


def offset_swizzled(layout, dtype: type = cutlass.BFloat16):
    """``layout`` (a composed layout whose swizzle acts on byte addresses, as the DSL's atoms do) with its
    swizzle moved to element offsets: ``S<B, M, S>`` on bytes is ``S<B, M − log2(width), S>`` on elements.

    A tensor over a pointer aligned to the swizzle period then addresses the same bytes as the pointer
    swizzle (:func:`cute_kda.kernels.common.copy.smem_tensor`), but the swizzle sees only the offset
    inside the buffer: a stage offset that is a multiple of the period drops out of it at compile time,
    where a pointer swizzle is recomputed from the whole address at every access
    (:func:`cute_kda.kernels.common.copy.aligned_smem_tensor` builds such tensors). Runtime offsets inside
    the period (a warp's slice of a K_SW128 tile) are mis-addressed by the DSL: keep those on the pointer
    swizzle.
    """
    width = dtype.width // 8
    shift = width.bit_length() - 1
    swizzle = layout.inner
    if swizzle.num_base < shift:
        raise ValueError(f"the swizzle {swizzle} moves units smaller than a {dtype.__name__} element")
    element = cute.make_swizzle(swizzle.num_bits, swizzle.num_base - shift, swizzle.num_shift)
    return cute.make_composed_layout(element, layout.offset, layout.outer)


def sw128_tile_transposed(rows: int, cols: int, dtype: type = cutlass.BFloat16):
    """``[cols, rows]`` ``MN_SW128`` view of :func:`sw128_tile` (same bytes)."""
    return atom_tile_transposed(AtomKind.K_SW128, rows, cols, dtype)


def row_major_tile(rows: int, cols: int):
    """Plain row-major ``[rows, cols]`` (``cols`` contiguous, no swizzle)."""
    return cute.make_layout((rows, cols), stride=(cols, 1))


def row_major_tile_transposed(rows: int, cols: int):
    """``[cols, rows]`` view of :func:`row_major_tile` (column-major, same bytes)."""
    return cute.make_layout((cols, rows), stride=(1, cols))


def chunk_operand(dim: int = HEAD_DIM, chunk: int = CHUNK, dtype: type = cutlass.BFloat16):
    """``[CHUNK, D]`` tile of qd / kd / kr / v / out (rows = tokens, cols = channels)."""
    return operand_tile(chunk, dim, dtype)


def chunk_operand_transposed(dim: int = HEAD_DIM, chunk: int = CHUNK, dtype: type = cutlass.BFloat16):
    """``[D, CHUNK]`` view of :func:`chunk_operand` (e.g. ``krᵀ`` as the A operand of the state update)."""
    return operand_tile_transposed(chunk, dim, dtype)


def state_b_view(dim: int = HEAD_DIM, dtype: type = cutlass.BFloat16, vband: int | None = None):
    """State ``[V, K]`` as the B operand of ``kd·S`` / ``qd·S`` (K contiguous inside core matrices).

    ``vband`` (default ``dim``) is the number of V rows a CTA owns under split-V.
    """
    return operand_tile(vband or dim, dim, dtype)


def state_acc_view(dim: int = HEAD_DIM, dtype: type = cutlass.BFloat16, vband: int | None = None):
    """State ``[K, V]`` in accumulator orientation for the update; same bytes as :func:`state_b_view`."""
    return operand_tile_transposed(vband or dim, dim, dtype)


def square_tile(chunk: int = CHUNK, dtype: type = cutlass.BFloat16):
    """``[CHUNK, CHUNK]`` tile of L / INV / Mqk (row i = query/key token, col j = key token)."""
    return operand_tile(chunk, chunk, dtype)


def square_tile_transposed(chunk: int = CHUNK, dtype: type = cutlass.BFloat16):
    """Transposed view of :func:`square_tile` (same bytes)."""
    return operand_tile_transposed(chunk, chunk, dtype)


def vector(n: int):
    """1-D contiguous layout of ``n`` elements (β per row, gT per channel)."""
    return cute.make_layout(n)


def state_fp32(dim: int = HEAD_DIM, vband: int | None = None):
    """fp32 state ``[V, K]`` staging buffer for fp32 state I/O (K_SW32 atoms; ``vband`` V rows).

    The atom carries a byte swizzle: build tensors as ``make_tensor(ptr with swizzle=layout.inner,
    layout.outer)`` (swizzle on the pointer), not with the composed layout, or the swizzle is applied
    to element offsets instead of byte addresses.
    """
    return atom_tile(AtomKind.K_SW32, vband or dim, dim, cutlass.Float32)
