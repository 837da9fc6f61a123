"""Kernel B in the two-tile training form (``GradsVariant.pair_rebuild``; W2 of docs/perf-log.md, the mirror
``cute_kda.reference.pair_backward.tile_states_of_pairs``).

The training forward's pair K2 keeps the state entering each pair of tiles and tile a's ``U``, Kernel A's pair scan
the state gradient leaving the pair: half the kept matrices of the per-tile form. Kernel B, still a CTA a tile, first
rebuilds the matrix of its tile's other end from them::

    tile a:  dS'_a = bf16(qd_bᵀ·dO_b − kd_bᵀ·dv_b + f32(gT_b ⊙ dS'_b))    Kernel A's step of tile b
    tile b:  S_b   = bf16(kr_aᵀ·U_a + f32(gT_a ⊙ S_a))                    K2's step of tile a

one fp32 accumulator each (an ``mma`` a 16-token contraction step, the kept matrix decayed with ``mul.rn`` as its
C), from the partner tile's tile-relative fields (a K1 workspace), dO_b and Kernel A's dv_b; then its phases run as
in the per-tile form. A sequence's lone last tile reads both matrices as kept. The partner's tiles arrive behind the
CTA's transaction barrier in the bytes of the four tiles phases 2 and 3 write first
(``layouts.bwd_grads.PARTNER_BUFFERS``), its gT in dgT's vector (phase 4's); each warp rebuilds its band of value rows
of the image's ``[V, K]`` face in place of the kept matrix it started from. The pair's two CTAs are neighbours in
the grid and load the same two kept images.
"""

from __future__ import annotations

from typing import NamedTuple

from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.experimental.primitives import cp_async_bulk_shared_cluster_global

from ...dsl import cute, cutlass
from ...layouts import bwd_grads as plan
from ...layouts.smem import CHUNK
from ..common.copy import WARP_TILE, Operand, head_tile_tma_partition, ldmatrix_copy, make_fragment, warp_tiled_mma
from ..common.fastmath import mul_rn

LONE, TILE_A, TILE_B = 0, 1, 2  # a CTA's role in its pair (a sequence's odd last tile is lone)
REBUILD_COLUMNS = 64  # key columns of the rebuilt matrix a warp forms per accumulator (32 fp32 registers)
SIGN_BITS = 0x80008000  # of two packed bf16: −dv_b as the second product's A operand, exactly


class PairLoads(NamedTuple):
    """What a CTA reads of its pair partner (launch side of ``pair_rebuild``): TMA ``(atom, tensor)`` pairs of
    Kernel A's dv ``[rows, HV, D]`` and the tile-relative workspace's qd, kd, kr (``[R·16, 1, D]``: a tile's rows
    as one head), tile a's ``U`` bf16 ``[H · pair slots, D, 16]`` (value-major) and gT fp32 ``[R, D]``."""

    dv: tuple
    qd: tuple
    kd: tuple
    kr: tuple
    u_a: cute.Tensor
    gt: cute.Tensor


class PairTile(NamedTuple):
    """A CTA's place in its pair (device values)."""

    role: Int32  # LONE, TILE_A or TILE_B
    partner_slot: Int32  # the partner's workspace row (head · tiles + its slot)
    partner_rows: Int32  # tile a: tile b's rows inside the sequence
    pair_row: Int32  # the kept matrices' row: head · pair slots + (g_a + s) // 2 (``workspace.pair_block_slots``)


class PairRebuild:
    """Kernel B's pair phases, mixed into :class:`~.base.BwdGrads` (run only with ``pair_rebuild``)."""

    @cute.jit
    def pair_position(self, head: Int32, tile_slot: Int32, tiles: Int32, tile_in_seq: Int32, seq: Int32, row0: Int32,
                      seq_end: Int32, pair_slots: Int32) -> PairTile:
        """The role of global tile ``tile_slot`` (tile ``tile_in_seq`` of sequence ``seq``, rows ``row0 …`` of a
        sequence ending at ``seq_end``): pairs start at a sequence's first tile."""
        odd = tile_in_seq % 2
        role = cutlass.select_(odd == 1, Int32(TILE_B),
                               cutlass.select_(row0 + CHUNK < seq_end, Int32(TILE_A), Int32(LONE)))
        partner = cutlass.select_(odd == 1, tile_slot - 1, tile_slot + 1)
        return PairTile(role, head * tiles + partner, cutlass.min(seq_end - row0 - CHUNK, CHUNK),
                        head * pair_slots + (tile_slot - odd + seq) // 2)

    def partner_bytes(self, pair: PairTile) -> Int32:
        """The transaction bytes of the partner's tiles for ``pair``'s role (0 for a lone tile)."""
        return cutlass.select_(
            pair.role == TILE_A, Int32(plan.partner_load_bytes(plan.PAIR_A_TILES, self.dim)),
            cutlass.select_(pair.role == TILE_B, Int32(plan.partner_load_bytes(plan.PAIR_B_TILES, self.dim)),
                            Int32(0)))

    @cute.jit
    def load_partner(self, loads: PairLoads, tma_do: tuple, smem, pair: PairTile, head: Int32, row0: Int32,
                     tma_barrier):
        """Warp 0, after :meth:`~.base.BwdGrads.load_tiles` (whose transaction count includes these): tile a the
        partner's qd, kd, dO, dv tiles, tile b its kr tile and tile a's U (one bulk copy)."""
        tiles = smem.partner_tiles
        if pair.role == TILE_A:
            sources = ((loads.qd, pair.partner_slot * CHUNK, 0), (loads.kd, pair.partner_slot * CHUNK, 0),
                       (tma_do, row0 + CHUNK, head), (loads.dv, row0 + CHUNK, head))  # plan.PAIR_A_TILES' order
            for buffer, ((atom, tensor), row, source_head) in zip(tiles, sources):
                self.load_tile(atom, tensor, buffer, row, source_head, tma_barrier)
        if pair.role == TILE_B:
            atom, tensor = loads.kr
            self.load_tile(atom, tensor, tiles[0], pair.partner_slot * CHUNK, 0, tma_barrier)
            elements = self.dim * CHUNK
            with cute.arch.elect_one():
                cp_async_bulk_shared_cluster_global(smem.partner_u.iterator,
                                                    loads.u_a.iterator + Int64(pair.pair_row) * elements,
                                                    tma_barrier, elements * 2)

    @cute.jit
    def load_tile(self, atom, tensor: cute.Tensor, buffer: cute.Tensor, row: Int32, head, tma_barrier):
        """One ``[16, D]`` TMA tile of ``tensor`` (``[rows, heads, D]``) from token row ``row`` of ``head``."""
        s_part, g_part = head_tile_tma_partition(atom, cute.domain_offset((row, 0, 0), tensor), buffer, head,
                                                 self.tile)
        cute.copy(atom, g_part[None, 0], s_part, tma_bar_ptr=tma_barrier)

    @cute.jit
    def load_partner_decay(self, smem, loads: PairLoads, pair: PairTile, tidx: Int32):
        """The partner's gT into dgT's vector (plain loads while the TMA runs; phase 4 writes dgT later)."""
        if pair.role != LONE:
            if tidx < self.dim:
                smem.dgt[tidx] = loads.gt[pair.partner_slot, tidx]

    @cute.jit
    def rebuild_pair_matrix(self, smem, pair: PairTile, tidx: Int32, warp_idx: Int32, lane: Int32):
        """All warps, once the loads have landed: tile a's dS'_a over the kept dS'_b, tile b's S_b over the kept
        S_a (module docstring); then a CTA barrier (phases 2 and 3 write over the partner's tiles)."""
        tiles, tiles_t = smem.partner_tiles, smem.partner_tiles_t
        if pair.role == TILE_A:
            if pair.partner_rows < CHUNK:  # dO and dv rows past the sequence end are another sequence's
                self.zero_tile_rows((tiles[2], tiles[3]), pair.partner_rows, tidx)
                cute.arch.sync_threads()
            self.rebuild_band(smem.state_grad_t, ((tiles_t[2], True, tiles_t[0], False),
                                                  (tiles_t[3], True, tiles_t[1], True)), smem.dgt, warp_idx, lane)
        if pair.role == TILE_B:
            self.rebuild_band(smem.state_t, ((smem.partner_u, False, tiles_t[0], False),), smem.dgt, warp_idx, lane)
        cute.arch.sync_threads()

    @cute.jit
    def zero_tile_rows(self, tiles: tuple, valid_rows: Int32, tidx: Int32):
        """Rows ``valid_rows …`` of the ``[16, D]`` bf16 ``tiles`` := 0."""
        for tile in tiles:
            for i in cutlass.range_constexpr(CHUNK * self.dim // self.num_threads):
                flat = tidx + i * self.num_threads
                row, c = flat // self.dim, flat % self.dim
                if row >= valid_rows:
                    tile[row, c] = BFloat16(0.0)

    @cute.jit
    def rebuild_band(self, face: cute.Tensor, products: tuple, s_gt: cute.Tensor, warp_idx: Int32, lane: Int32):
        """Warp ``w``'s value rows of a kept matrix's ``[V, K]`` face ``face``, in place:
        ``bf16(Σ aᵀ·b + f32(gT ⊙ kept))`` over ``products`` ``(a, a transposed, b, negate a)``: ``a`` a ``(V, 16)``
        view of token-major operands (value rows, tokens), ``b`` a ``(K, 16)`` one (``ldmatrix.trans`` of a
        ``[16, D]`` tile's transposed face), one mma a product and 16-wide block; ``s_gt`` gT per key column."""
        cols = min(self.dim, REBUILD_COLUMNS)
        mma = warp_tiled_mma(BFloat16, Float32, cols)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, cols)))
        copy_b = ldmatrix_copy(mma, Operand.B, True)
        thr_b = copy_b.get_slice(lane)
        for m in cutlass.range_constexpr(self.band // CHUNK):
            rows = warp_idx * (self.band // CHUNK) + m
            for j in cutlass.range_constexpr(self.dim // cols):
                block = cute.local_tile(face, (CHUNK, cols), (rows, j))
                kept = self.load_c(mma, block, lane)
                acc = make_fragment(mma, Operand.C, Float32, tile=(CHUNK, cols))
                for i in cutlass.range_constexpr(cute.size(acc)):
                    _, c = coords[i]
                    acc[i] = mul_rn(s_gt[j * cols + c], kept[i].to(Float32))
                for a_view, a_transposed, b_view, negate in products:
                    a_frag = make_fragment(mma, Operand.A, BFloat16)
                    copy_a = ldmatrix_copy(mma, Operand.A, a_transposed)
                    thr_a = copy_a.get_slice(lane)
                    cute.copy(copy_a, thr_a.partition_S(cute.local_tile(a_view, (CHUNK, WARP_TILE), (rows, 0))),
                              thr_a.retile(a_frag))
                    b_frag = make_fragment(mma, Operand.B, BFloat16, tile=(cols, WARP_TILE))
                    cute.copy(copy_b, thr_b.partition_S(cute.local_tile(b_view, (cols, WARP_TILE), (j, 0))),
                              thr_b.retile(b_frag))
                    if cutlass.const_expr(negate):
                        words = cute.recast_tensor(a_frag, Uint32)
                        for w in cutlass.range_constexpr(cute.size(words)):
                            words[w] = words[w] ^ Uint32(SIGN_BITS)
                    cute.gemm(mma, acc, a_frag, b_frag, acc)
                rebuilt = make_fragment(mma, Operand.C, BFloat16, tile=(CHUNK, cols))
                for i in cutlass.range_constexpr(cute.size(acc)):
                    rebuilt[i] = acc[i].to(BFloat16)
                self.store_c(mma, rebuilt, block, lane)
