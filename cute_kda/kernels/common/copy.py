"""Copy helpers shared by the kernels: TMA tiles of one head, and the register moves of mma.sync.

TMA (host + device). A per-token tensor ``[rows, H, D]`` (``[B·T, H, D]`` inputs, workspace fields
with ``H = 1``) is moved in ``(tile_rows, tile_cols)`` tiles of one head:

- host, inside the ``@cute.jit`` launcher: :func:`make_head_tile_tma_atom` builds the descriptor
  from an smem layout of :mod:`cute_kda.layouts` (unstaged or staged);
- device: :func:`head_tile_tma_partition` slices the head and returns the TMA-partitioned smem
  buffer (``(TMA,)`` unstaged, ``(TMA, stage)`` staged) and gmem tiles ``(TMA, tile)``. A load is
  ``cute.copy(atom, g[None, t], s, tma_bar_ptr=...)`` (``s[None, stage]`` when staged) from a whole
  warp: the DSL elects the issuing lane of a G2S copy itself (inside ``elect_one`` it would hang).
  A store is :func:`tma_store_tiles`, also from a whole warp: the DSL (4.8.1) does *not* elect for
  an S2G copy (every lane would issue the same store), so that helper elects one lane itself.

Registers (device). All fragments are per-warp 16×16 tiles of the warp MMA
(:func:`warp_tiled_mma`, two ``mma.sync.m16n8k16`` side by side). In that tile, lane ``l``
(``g = l // 4``, ``q = l % 4``) holds, as four 32-bit registers of two 16-bit values each (in the
order of ``cute.recast_tensor(fragment, Uint32)``):

======  ==========================  ==========================
 reg     C fragment of M (m, n)       B fragment of B (n, k)
======  ==========================  ==========================
 0       M[g,   2q:2q+2]              B[g,   2q:2q+2]
 1       M[g+8, 2q:2q+2]              B[g,   2q+8:2q+10]
 2       M[g,   2q+8:2q+10]           B[g+8, 2q:2q+2]
 3       M[g+8, 2q+8:2q+10]           B[g+8, 2q+8:2q+10]
======  ==========================  ==========================

(The A fragment holds the same registers as the C fragment.) Register ``i`` over the 32 lanes is
one 8×8 block in ``movmatrix`` row order, so ``movmatrix.trans`` applied register by register
turns the C fragment of ``M`` into the B fragment of ``B = Mᵀ`` (``B[n, k] = M[k, n]``): the
C→B move that lets a result ``M`` (``m`` = contraction index) feed the next MMA as its right
operand (:func:`transpose_c_to_b`). No register reordering is needed: C's order walks the 8×8
blocks down the rows first, B's order walks them along ``k`` first, and ``k`` is ``M``'s row index.

Vectors (device). :func:`gmem_run` views a run of consecutive elements of a global tensor as aligned to the run's
size (up to 16 bytes), so that ``cute.autovec_copy`` moves it in one vector access the compiler could not prove
aligned from the tensor alone.

ldmatrix / stmatrix tiled copies (:func:`ldmatrix_copy`, :func:`stmatrix_copy`) move one such
16×16 fragment between registers and a 16×16 block of an smem tensor, for operand A, B or C. Use
``transpose=False`` on a block whose second index is contiguous in 16-byte runs (a K_INTER operand
tile), ``transpose=True`` on a block whose first index is (its MN_INTER transposed view).
"""

from __future__ import annotations

from enum import Enum

from cutlass import Uint32
from cutlass.cute.nvgpu import cpasync, warp

from ...dsl import cute, cutlass
from ...layouts.smem import offset_swizzled
from ...layouts.tma import contiguous_col_run, head_tile_view
from .fastmath import movmatrix_trans

WARP_TILE = 16  # side of the per-warp mma tile every register helper here is shaped for


class Operand(Enum):
    """Which operand of the warp MMA a fragment or a tiled copy is shaped for."""

    A = "A"  # (m, k), row operand
    B = "B"  # (n, k), column operand
    C = "C"  # (m, n), accumulator / result


def make_head_tile_tma_atom(op, tensor: cute.Tensor, smem_layout, tile: tuple[int, int]):
    """TMA atom and TMA tensor for ``tile = (tile_rows, cols)`` tiles of a ``[rows, H, cols]`` tensor.

    ``op`` is ``cpasync.CopyBulkTensorTileG2SOp()`` (load) or ``CopyBulkTensorTileS2GOp()`` (store);
    ``smem_layout`` is ``[tile_rows, cols]`` or ``[tile_rows, cols, stages]`` from
    :mod:`cute_kda.layouts` (K_INTER: one TMA instruction per tile, see
    :func:`cute_kda.layouts.tma.head_tile_view`). A tile spans all ``cols`` columns. Host side
    (inside the ``@cute.jit`` launcher). Rows past ``rows`` are zero-filled by a load and dropped
    by a store.
    """
    view = head_tile_view(tensor, tile[1], contiguous_col_run(smem_layout))
    return cpasync.make_tiled_tma_atom(op, view, smem_layout, tile)


def head_tile_tma_partition(atom, tma_tensor: cute.Tensor, smem: cute.Tensor, head, tile: tuple[int, int]):
    """Partition ``smem`` and head ``head`` of ``tma_tensor`` for ``atom``; device side.

    Returns ``(smem_part, gmem_part)``; the two sides of one TMA copy are ``gmem_part[None, tile_index]``
    and, for an unstaged ``[rows, cols]`` buffer, ``smem_part`` itself (rank 1: the TMA mode), or for
    a staged ``[rows, cols, stages]`` buffer ``smem_part[None, stage]``.
    """
    gmem_tiles = cute.local_tile(tma_tensor[None, None, head], tile, (None, 0))
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2), cute.group_modes(gmem_tiles, 0, 2)
    )


def tma_store_tiles(*copies: tuple) -> None:
    """TMA-store tiles, each ``(atom, smem_tile, gmem_tile)``; call from a whole warp.

    One elected lane issues every store, commits them as one bulk group and waits until the TMA
    has read the smem tiles, so the buffers may be refilled when this returns (the gmem writes
    may still be in flight; they complete before the kernel ends). The caller fences its smem
    writes (``cute.arch.fence_view_async_shared``) and synchronises with the writers first.
    """
    with cute.arch.elect_one():
        for atom, smem_tile, gmem_tile in copies:
            cute.copy(atom, smem_tile, gmem_tile)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)


def warp_tiled_mma(ab_dtype: type = cutlass.BFloat16, acc_dtype: type = cutlass.Float32, n: int = WARP_TILE):
    """One warp's ``16 × n × 16`` tile of ``mma.sync.m16n8k16`` (``n / 8`` atoms side by side; 16 by default)."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(ab_dtype, acc_dtype, (16, 8, 16)), (1, 1, 1),
        permutation_mnk=(WARP_TILE, n, WARP_TILE),
    )


def c_row_half(i: int) -> int:
    """Row half (0: row ``g``, 1: row ``g + 8``) of flat value ``i`` of a ``((2, 2), 1, n)`` C fragment.

    Per n-atom the C fragment of ``mma.sync.m16n8k16`` holds ``(g, 2q), (g, 2q+1), (g+8, 2q),
    (g+8, 2q+1)`` in this order (the kernels' fragment tests check it on the DSL's layouts).
    """
    return (i // 2) % 2


def smem_tensor(ptr: cute.Pointer, layout, dtype: type) -> cute.Tensor:
    """Tensor over ``ptr`` with ``layout``; a composed layout's swizzle goes on the pointer (as TMA sees it)."""
    if isinstance(layout, cute.ComposedLayout):
        return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=dtype), layout.outer)
    return cute.make_tensor(cute.recast_ptr(ptr, dtype=dtype), layout)


def aligned_smem_tensor(ptr: cute.Pointer, layout, dtype: type) -> cute.Tensor:
    """Tensor over ``ptr`` with ``layout``, its swizzle applied to element offsets from ``ptr``
    (:func:`cute_kda.layouts.smem.offset_swizzled`): the same bytes as :func:`smem_tensor` when ``ptr`` is
    aligned to the swizzle period, with the stage offsets of a staged layout outside the swizzle.

    Only for views whose runtime offsets are multiples of the swizzle period (a pipeline stage): a view
    sliced by a runtime offset inside a K_SW128 swizzle (a warp's columns of a band tile) gets wrong
    addresses from the DSL (4.8.1; ``tests/test_smem_addresses.py``). Use :func:`smem_tensor` there."""
    return cute.make_tensor(cute.recast_ptr(ptr, dtype=dtype), offset_swizzled(layout, dtype))


def make_fragment(
    tiled_mma, operand: Operand, dtype: type = cutlass.BFloat16, tile: tuple[int, int] = (WARP_TILE, WARP_TILE)
) -> cute.Tensor:
    """Registers of one lane for a ``tile`` of ``operand`` (``(m, k)`` / ``(n, k)`` / ``(m, n)``).

    The default 16×16 tile holds 8 values in the order of the module docstring; a larger tile
    repeats that fragment over its 16×16 blocks (extra modes of the returned tensor).
    """
    shape = {
        Operand.A: tiled_mma.partition_shape_A,
        Operand.B: tiled_mma.partition_shape_B,
        Operand.C: tiled_mma.partition_shape_C,
    }[operand](tile)
    return cute.make_rmem_tensor(shape, dtype)


def _tiled_copy(copy_atom, tiled_mma, operand: Operand):
    make = {
        Operand.A: cute.make_tiled_copy_A,
        Operand.B: cute.make_tiled_copy_B,
        Operand.C: cute.make_tiled_copy_C,
    }[operand]
    return make(copy_atom, tiled_mma)


def ldmatrix_copy(tiled_mma, operand: Operand, transpose: bool, dtype: type = cutlass.BFloat16,
                  num_matrices: int = 4):
    """Tiled copy smem → registers (``ldmatrix.x4[.trans]``, or ``.x2`` / ``.x1``) of an ``operand`` fragment.

    x4 moves one 16×16 fragment; x2 an 8-wide one (an 8-column band of a B or C operand).
    Use: ``thr = copy.get_slice(lane)``; ``cute.copy(copy, thr.partition_S(block), thr.retile(frag))``.
    """
    atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=num_matrices), dtype)
    return _tiled_copy(atom, tiled_mma, operand)


def stmatrix_copy(tiled_mma, operand: Operand, transpose: bool, dtype: type = cutlass.BFloat16,
                  num_matrices: int = 4):
    """Tiled copy registers → smem (``stmatrix.x4[.trans]``, or ``.x2`` / ``.x1``) of an ``operand`` fragment.

    Use: ``thr = copy.get_slice(lane)``; ``cute.copy(copy, thr.retile(frag), thr.partition_D(block))``.
    """
    atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=transpose, num_matrices=num_matrices), dtype)
    return _tiled_copy(atom, tiled_mma, operand)


@cute.jit
def transpose_c_to_b(c_fragment: cute.Tensor, b_fragment: cute.Tensor):
    """``b_fragment ← `` B fragment of ``Mᵀ`` from the C fragment of ``M`` (16-bit, warp-collective).

    One ``movmatrix.trans`` per 32-bit register, no reordering (see the module docstring): register
    ``p`` of a C fragment of a ``16 × 8n`` tile ``M`` (shape ``((2,2),1,n)``: row half ``p % 2``,
    n-atom ``p // 2``) becomes register ``p`` of the B fragment of the ``8n × 16`` tile ``Mᵀ``
    (shape ``((2,2),n,1)``: k half ``p % 2``, n-atom ``p // 2``). Both are 16-bit register tensors,
    e.g. from :func:`make_fragment`.
    """
    c_words = cute.recast_tensor(c_fragment, Uint32)
    b_words = cute.recast_tensor(b_fragment, Uint32)
    for i in cutlass.range_constexpr(cute.size(c_words)):
        b_words[i] = movmatrix_trans(c_words[i])


@cute.jit
def gmem_run(tensor: cute.Tensor, offset, length: int) -> cute.Tensor:
    """``length`` consecutive elements of ``tensor`` (a global view whose last mode is contiguous) from element
    ``offset``, as a view aligned to the run's size (up to 16 bytes). The caller promises that alignment: its runs
    start at multiples of their size from a base that is 16-byte aligned."""
    align = min(16, length * tensor.element_type.width // 8)
    address = (tensor.iterator + offset).toint()
    pointer = cute.make_ptr(tensor.element_type, address, cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(pointer, cute.make_layout((length,)))
