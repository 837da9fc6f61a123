"""Shared-memory plan of the prepare kernel K1 (``cute_kda.kernels.fwd_prepare``).

One CTA handles one (16-token tile, head). Its shared memory, in bytes:

==============  =========================  ======  ===============================================
buffer          layout                      bytes   holds
==============  =========================  ======  ===============================================
q / k / g       :func:`chunk_tile`, bf16    3×4096  TMA-loaded inputs; then qd, kd and kr in place
kinv            :func:`chunk_tile`, bf16    4096    ``k̂ ⊙ 2^-G`` (K1-internal, B operand of L, Mqk)
gate_cumsum     :func:`gate_cumsum_tile`    8192    ``G[r, c]`` fp32 (row 15 is ``G_last``)
beta            :func:`row_vector`          64      activated β per row (0 on invalid rows)
tma_barrier     one mbarrier                8
==============  =========================  ======  ===============================================

25 600 bytes per CTA (the struct rounds up to its 1024-byte alignment): with the 1 KB the system
reserves per CTA, 8 CTAs fit in an SM's 228 KB; the register budget sets the rest (the kernel).

Bank conflicts. Every 16×128 bf16 tile uses the 128-byte-swizzled ``K_SW128`` atom (8 rows of
128 bytes, 16-byte chunk ``j`` of row ``r`` stored at chunk ``j ^ (r % 8)``):

- the elementwise phase gives lane ``j`` of a 16-lane row group the 16-byte chunk ``j`` of one row;
  8 consecutive lanes hit 8 different chunks of one 128-byte line: conflict-free;
- ``ldmatrix`` reads chunk ``j`` of 8 consecutive rows: 8 different chunks, conflict-free;
- the gate scan reads one bf16 column per lane: 32 lanes cover 64 bytes of one line;
- it is the TMA's native ``SWIZZLE_128B`` mode (two 64-column boxes per tile).

``gate_cumsum_tile`` is row-major fp32 (512-byte rows) with a one-bit swizzle (16-byte chunk bit 0
XOR chunk bit 3): the scan writes 32 consecutive floats of a row per warp (one 128-byte line,
permuted), and the elementwise phase reads 16-byte halves ``h`` of 32-byte runs ``j`` — chunk
``2j + h`` — where 8 lanes ``j`` then land on 8 different chunks of the bank window.

Swizzles here act on the byte address of the shared-memory pointer (as the DSL's ``K_SW128`` atom
does): tensors are made as ``make_tensor(recast_ptr(base, layout.inner), layout.outer)``, which the
struct's ``get_tensor(layout.outer, swizzle=layout.inner)`` does.
"""

# No ``from __future__ import annotations``: cute.struct reads its field annotations as objects.
from ..dsl import cute, cutlass
from .smem import CHUNK, HEAD_DIM, AtomKind, layout_atom

# Byte alignment of the swizzled tiles: the 128-byte swizzle pattern repeats every 1024 bytes.
SWIZZLE_ALIGN = 1024
INPUT_TILES = 3  # q, k, g: the TMA transaction of one CTA


def chunk_tile(dim: int = HEAD_DIM, chunk: int = CHUNK, dtype: type = cutlass.BFloat16):
    """``[CHUNK, D]`` bf16 tile with 128-byte swizzle (``K_SW128`` atoms, rows first)."""
    return cute.tile_to_shape(layout_atom(AtomKind.K_SW128, dtype), (chunk, dim), (0, 1))


def gate_cumsum_tile(dim: int = HEAD_DIM, chunk: int = CHUNK):
    """``[CHUNK, D]`` fp32 row-major, byte-address swizzle ``Swizzle<1,4,3>`` (see module docstring)."""
    return cute.make_composed_layout(
        cute.make_swizzle(1, 4, 3), 0, cute.make_layout((chunk, dim), stride=(dim, 1))
    )


def row_vector(chunk: int = CHUNK):
    """``[CHUNK]`` contiguous (β per row)."""
    return cute.make_layout(chunk)


def input_tile_bytes(dim: int = HEAD_DIM, chunk: int = CHUNK) -> int:
    """Bytes of one bf16 input tile; the TMA barrier expects ``INPUT_TILES`` of them."""
    return chunk * dim * 2


def shared_storage(dim: int = HEAD_DIM, chunk: int = CHUNK):
    """The ``cute.struct`` of K1's shared memory (call inside a trace)."""
    tile = chunk_tile(dim, chunk)
    cumsum = gate_cumsum_tile(dim, chunk)
    tile_elems = cute.cosize(tile.outer)

    @cute.struct
    class PrepareStorage:
        q: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, tile_elems], SWIZZLE_ALIGN]
        k: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, tile_elems], SWIZZLE_ALIGN]
        g: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, tile_elems], SWIZZLE_ALIGN]
        kinv: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, tile_elems], SWIZZLE_ALIGN]
        gate_cumsum: cute.struct.Align[
            cute.struct.MemRange[cutlass.Float32, cute.cosize(cumsum.outer)], SWIZZLE_ALIGN
        ]
        beta: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, chunk], 16]
        tma_barrier: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 1], 8]

    return PrepareStorage


def compact(tensor: cute.Tensor, inner: tuple) -> cute.Tensor:
    """The C-contiguous gmem tensor ``[n, *inner]`` with its inner extents and all strides static.

    K1's launcher hands over tensors with dynamic layouts (one compile serves every size); only the
    leading extent ``n`` stays dynamic here, so tiles and fragments of the inner modes are static.
    """
    shape = (tensor.shape[0], *inner)
    return cute.make_tensor(tensor.iterator, cute.make_layout(shape, stride=cute.make_layout(shape[::-1]).stride[::-1]))
