"""TMA views: where our shared-memory layouts meet a TMA descriptor, and the gmem side of it.

Like :mod:`cute_kda.layouts.smem`, everything here runs inside a ``@cute.jit`` / ``@cute.kernel``
trace and builds layouts or tensor views only.

Shared memory. ``cpasync.make_tiled_tma_atom`` takes our K_INTER operand layouts as they are (they
are ``Swizzle<0,4,3> ∘ layout``, the identity swizzle). A ``[rows, cols]`` K_INTER tile stores each
8-element run of a row contiguously (16 bytes), the rows of one 8-column band after each other, then
the next band: in smem order the tile is ``(8 cols, rows, cols/8 bands)``. The MN_INTER transposed
views are never TMA layouts for row-major gmem (their contiguous direction is the strided one in
gmem): a tile is moved through its K_INTER face and read or written through either face.

Global memory. Kernels see per-token tensors as ``[rows, H, cols]`` (``[B·T, H, D]`` inputs;
workspace fields are ``[H·tiles·16, 1, D]``, one "head"). Handed to the DSL as ``(rows, cols, H)``,
the descriptor's box follows the gmem modes, so a K_INTER tile becomes ``cols/8`` TMA instructions
of ``8 × rows`` each (one per band). :func:`head_tile_view` splits the column mode into
``(run, cols/run)`` — ``run`` being the smem layout's contiguous column run
(:func:`contiguous_col_run`, 8 for K_INTER 16-bit) — so the band mode becomes a descriptor
dimension of its own (gmem stride ``run`` elements = 16 bytes) and one 4-D TMA instruction moves the
whole tile. This plays the part of FlashKDA's ``prepend``/``composition`` smem views in C++: the
descriptor sees the tile in the order the smem layout stores it.

Staged buffers add a last mode (the pipeline stage) of stride ``rows · cols``; the staged K_INTER
layout and the staged MN_INTER view stay a transpose-dual pair stage by stage.
"""

from __future__ import annotations

from ..dsl import cute, cutlass
from .smem import AtomKind, atom_tile, atom_tile_transposed


def operand_tile_staged(rows: int, cols: int, stages: int, dtype: type = cutlass.BFloat16):
    """``[rows, cols, stages]``: ``stages`` K_INTER operand tiles back to back (TMA destination/source)."""
    return atom_tile(AtomKind.K_INTER, rows, cols, dtype, stages)


def operand_tile_transposed_staged(rows: int, cols: int, stages: int, dtype: type = cutlass.BFloat16):
    """``[cols, rows, stages]`` MN_INTER view of :func:`operand_tile_staged` (same bytes per stage)."""
    return atom_tile_transposed(AtomKind.K_INTER, rows, cols, dtype, stages)


def contiguous_col_run(smem_layout) -> int:
    """Columns stored contiguously in ``smem_layout`` (``[rows, cols(, stages)]``): its innermost column extent.

    8 for a 16-bit K_INTER tile (one 16-byte core-matrix row). Raises if that extent is not the
    stride-1 direction (an MN_INTER view, which no row-major TMA can fill).
    """
    outer = smem_layout.outer if isinstance(smem_layout, cute.ComposedLayout) else smem_layout
    shape, stride = outer.shape[1], outer.stride[1]
    while isinstance(shape, tuple):
        shape, stride = shape[0], stride[0]
    if stride != 1:
        raise ValueError(f"columns of {smem_layout} are not contiguous in smem; not a TMA layout")
    return shape


def head_tile_view(tensor: cute.Tensor, cols: int, run: int) -> cute.Tensor:
    """View gmem ``[rows, H, cols]`` (``cols`` contiguous) as ``(rows, (run, cols/run), H)``, same memory.

    A TMA tiler ``(tile_rows, cols)`` then moves ``tile_rows`` rows of one head, all columns (row
    stride ``H · cols``: all heads of a token interleaved, as in ``[B, T, H, D]``). ``cols`` is the
    static column count (the kernel's D); the caller checks the tensor has it.
    """
    if cols % run:
        raise ValueError(f"cols={cols} is not a multiple of the contiguous run {run}")
    row_stride, head_stride = tensor.layout.stride[0], tensor.layout.stride[1]
    view = cute.make_layout(
        (tensor.shape[0], (run, cols // run), tensor.shape[1]),
        stride=(row_stride, (1, run), head_stride),
    )
    return cute.make_tensor(tensor.iterator, view)
