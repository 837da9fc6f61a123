"""Shared-memory plan of the prepare kernel K1 (``cute_kda.kernels.fwd_prepare``).

One CTA handles one (16-token tile, head). :func:`smem_budget` is its shared memory, the one
description of it: buffers in order with their layouts, alignments, offsets and what they hold (the
bf16 ``q``, ``k``, ``g`` tiles, TMA-loaded, then overwritten in place by qd, kd and kr; ``kinv``;
the fp32 gate cumsum ``G``; β; one transaction mbarrier). The kernel allocates
:func:`shared_storage`, the ``cute.struct`` built from that plan, and the CPU tests check that the
launch asks for exactly its total. ``python scripts/explore_layouts.py --section budget`` prints it:
25 600 bytes per CTA (the swizzled tiles' 1024-byte alignment rounds the struct up); with the 1 KB
the system reserves per CTA, 8 CTAs fit in an SM's 228 KB; the register budget sets the rest.

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

from ..dsl import cute, cutlass
from .analysis import layout_spec
from .budget import SmemBudget, SmemBuffer, SmemGroup, mbarriers
from ..numerics import DYADIC_BLOCKS
from .smem import CHUNK, HEAD_DIM, row_major_tile, sw128_tile

DYADIC_LEVELS = len(DYADIC_BLOCKS)

BETA_ALIGN = 16  # β is read and written element by element, never by the TMA
# the pair K1s' CTAs an SM, at most (their smem may allow fewer): four at D = 128 (64 registers, no spills); at D = 64
# the 25 600 bytes allow eight, but at 64 or 72 registers (eight or seven CTAs) the fp16 variants spill
PAIR_CTAS_PER_SM = {128: 4, 64: 6}
DYADIC_CTAS_PER_SM = 5  # the dyadic K1 (per-channel unbounded gates): ≈ 39 KB of shared memory a CTA
PER_HEAD_CTAS_PER_SM = 8  # GatedDeltaNet's per-head gate: ≈ 22 KB a CTA, as many CTAs as the safe K1


def chunk_tile(dim: int = HEAD_DIM, chunk: int = CHUNK, dtype: type = cutlass.BFloat16):
    """``[CHUNK, D]`` bf16 tile with 128-byte swizzle (``K_SW128`` atoms, rows first)."""
    return sw128_tile(chunk, dim, dtype)


def gate_cumsum_tile(dim: int = HEAD_DIM, chunk: int = CHUNK):
    """``[CHUNK, D]`` fp32 row-major, byte-address swizzle ``Swizzle<1,4,3>`` (see module docstring)."""
    return cute.make_composed_layout(cute.make_swizzle(1, 4, 3), 0, row_major_tile(chunk, dim))


def row_vector(chunk: int = CHUNK):
    """``[CHUNK]`` contiguous (β per row)."""
    return cute.make_layout(chunk)


def pair_matrix(chunk: int = CHUNK):
    """``[CHUNK, CHUNK]`` fp32 row-major: the pair sums ``A_kk``, ``A_qk`` of the unbounded gates' K1."""
    return row_major_tile(chunk, chunk)


def input_tile_bytes(dim: int = HEAD_DIM, chunk: int = CHUNK) -> int:
    """Bytes of one bf16 input tile; K1's TMA barrier expects this once per tile it loads."""
    return chunk * dim * 2


def smem_budget(dim: int = HEAD_DIM, chunk: int = CHUNK) -> SmemBudget:
    """K1's shared-memory plan (host side; evaluates the layouts in a host trace once per spec)."""
    tile = layout_spec(f"chunk_tile({dim},{chunk})", chunk_tile, dim, chunk, dtype=cutlass.BFloat16)
    cumsum = layout_spec(f"gate_cumsum_tile({dim},{chunk})", gate_cumsum_tile, dim, chunk, dtype=cutlass.Float32)
    beta = layout_spec(f"row_vector({chunk})", row_vector, chunk, dtype=cutlass.Float32)
    return SmemBudget(f"K1 D={dim} CHUNK={chunk}", SmemGroup("PrepareStorage", (
        SmemBuffer("q", tile, note="TMA-loaded q; qd written over it"),
        SmemBuffer("k", tile, note="TMA-loaded k; kd written over it"),
        SmemBuffer("g", tile, note="TMA-loaded raw gate; kr written over it"),
        SmemBuffer("kinv", tile, note="k̂ ⊙ 2^-G: B operand of L and Mqk (K1-internal)"),
        SmemBuffer("gate_cumsum", cumsum, note="G[r, c] (row CHUNK-1 is G_last)"),
        SmemBuffer("beta", beta, align_bytes=BETA_ALIGN, note="activated β per row, 0 on invalid rows"),
        mbarriers("tma_barrier", 1, "transaction barrier of the q, k, g loads"),
    )))


def pair_smem_budget(dim: int = HEAD_DIM, chunk: int = CHUNK) -> SmemBudget:
    """Shared-memory plan of the safe gate's pair K1 (docs/numerics.md, "Two tiles a serial step"): one CTA a pair
    of tiles (a, b) of a sequence, both loaded behind one barrier. Tile a's buffers are :func:`smem_budget`'s with
    kr measured to the pair's end; tile b keeps its tile-relative qd, kd (the operands of ``L_b`` and ``Mqk_b``)
    beside the pair-relative ones the workspace takes, whose products with ``kinv_a`` are the cross blocks. Those
    two share the bytes of tile a's gate cumsum, dead once tile a's decay is done: 50 176 bytes at D = 128, four
    CTAs an SM."""
    tile = layout_spec(f"chunk_tile({dim},{chunk})", chunk_tile, dim, chunk, dtype=cutlass.BFloat16)
    cumsum = layout_spec(f"gate_cumsum_tile({dim},{chunk})", gate_cumsum_tile, dim, chunk, dtype=cutlass.Float32)
    beta = layout_spec(f"row_vector({chunk})", row_vector, chunk, dtype=cutlass.Float32)
    return SmemBudget(f"K1 pairs D={dim} CHUNK={chunk}", SmemGroup("PairPrepareStorage", (
        SmemBuffer("q_a", tile, note="tile a's TMA-loaded q; qd_a written over it"),
        SmemBuffer("k_a", tile, note="tile a's TMA-loaded k; kd_a written over it"),
        SmemBuffer("g_a", tile, note="tile a's TMA-loaded raw gate; kr_a' (to the pair's end) written over it"),
        SmemBuffer("kinv_a", tile, note="k̂_a ⊙ 2^-G_a: B operand of L_a, Mqk_a and the cross blocks"),
        SmemBuffer("q_b", tile, note="tile b's TMA-loaded q; its tile-relative qd_b written over it"),
        SmemBuffer("k_b", tile, note="tile b's TMA-loaded k; its tile-relative kd_b written over it"),
        SmemBuffer("g_b", tile, note="tile b's TMA-loaded raw gate; kr_b written over it"),
        SmemBuffer("kinv_b", tile, note="k̂_b ⊙ 2^-G_b: B operand of L_b and Mqk_b"),
        # tile b's decay writes its pair-relative tiles over G_a, read to its end by tile a's decay
        SmemGroup("cumsum_a_then_pair", (
            SmemBuffer("gate_cumsum_a", cumsum, note="G_a[r, c]"),
            SmemGroup("pair_tiles", (
                SmemBuffer("qd_pair", tile,
                           note="qd_b' = q̂_b ⊙ 2^(G_a,last + G_b) · scale: workspace, left factor of Q"),
                SmemBuffer("kd_pair", tile, note="kd_b' = k̂_b ⊙ 2^(G_a,last + G_b): workspace, left factor of P"),
            )),
        ), union=True),
        SmemBuffer("gate_cumsum_b", cumsum, note="G_b[r, c]"),
        SmemBuffer("beta_a", beta, align_bytes=BETA_ALIGN, note="activated β of tile a's rows"),
        SmemBuffer("beta_b", beta, align_bytes=BETA_ALIGN, note="activated β of tile b's rows"),
        mbarriers("tma_barrier", 1, "transaction barrier of both tiles' q, k, g loads"),
    )))


def dyadic_smem_budget(dim: int = HEAD_DIM, chunk: int = CHUNK) -> SmemBudget:
    """Shared-memory plan of K1 for the unbounded gates (softplus, a precomputed log decay).

    The straddle levels of docs/numerics.md ("Unbounded gates", scheme ``dyadic``): level ``ℓ`` has blocks
    of ``16 >> ℓ`` rows, and each block's upper half pairs with its lower half. ``level_rows{ℓ}`` holds the
    level's 8 upper rows of ``X = kh ⊙ factor`` (rows 0-7) and of ``Q = qh ⊙ factor`` (rows 8-15);
    ``lower_rows{p}`` the 8 lower rows of ``X`` of levels ``2p`` (rows 0-7) and ``2p + 1`` (rows 8-15). One
    tensor-core product ``level_rows · lower_rowsᵀ`` then gives a level's pair sums of ``A_kk`` and ``A_qk``.
    """
    tile = layout_spec(f"chunk_tile({dim},{chunk})", chunk_tile, dim, chunk, dtype=cutlass.BFloat16)
    pairs = layout_spec(f"pair_matrix({chunk})", pair_matrix, chunk, dtype=cutlass.Float32)
    rows = layout_spec(f"row_vector({chunk})", row_vector, chunk, dtype=cutlass.Float32)
    levels = tuple(
        SmemBuffer(f"level_rows{level}", tile, note=f"level {level}: X upper rows 0-7, Q upper rows 8-15")
        for level in range(DYADIC_LEVELS)
    )
    lowers = tuple(
        SmemBuffer(f"lower_rows{pair}", tile, note=f"X lower rows of levels {2 * pair} (0-7) and {2 * pair + 1} (8-15)")
        for pair in range(DYADIC_LEVELS // 2)
    )
    return SmemBudget(f"K1 unbounded gates D={dim} CHUNK={chunk}", SmemGroup("DyadicPrepareStorage", (
        SmemBuffer("q", tile, note="TMA-loaded q; qd written over it"),
        SmemBuffer("k", tile, note="TMA-loaded k; kd written over it"),
        SmemBuffer("kr", tile, note="kr = kh ⊙ 2^Gs (suffix sum)"),
        *levels,
        *lowers,
        SmemBuffer("a_kk", pairs, note="A_kk[i, j], i > j, from the level products"),
        SmemBuffer("a_qk", pairs, note="A_qk[i, j], i > j, from the level products"),
        SmemBuffer("beta", rows, align_bytes=BETA_ALIGN, note="activated β per row, 0 on invalid rows"),
        SmemBuffer("q_scale", rows, align_bytes=BETA_ALIGN, note="rinv_q · scale per row (scale without l2norm)"),
        SmemBuffer("k_scale", rows, align_bytes=BETA_ALIGN, note="rinv_k per row (1 without l2norm)"),
        SmemBuffer("mqk_diagonal", rows, align_bytes=BETA_ALIGN, note="Σ_c qh·kh per row (Mqk's diagonal)"),
        mbarriers("tma_barrier", 1, "transaction barrier of the q, k loads"),
    )))


def per_head_smem_budget(dim: int = HEAD_DIM, chunk: int = CHUNK) -> SmemBudget:
    """Shared-memory plan of K1 for a per-head gate (GatedDeltaNet), scheme ``per_head`` of docs/numerics.md:
    one decay per row, so ``A = E ⊙ (k̂ k̂ᵀ)`` and ``A_qk = E ⊙ (q̂ k̂ᵀ)`` with the bf16 rows ``k̂``, ``q̂`` and the
    16 × 16 span matrix ``E`` of the tile."""
    tile = layout_spec(f"chunk_tile({dim},{chunk})", chunk_tile, dim, chunk, dtype=cutlass.BFloat16)
    pairs = layout_spec(f"pair_matrix({chunk})", pair_matrix, chunk, dtype=cutlass.Float32)
    rows = layout_spec(f"row_vector({chunk})", row_vector, chunk, dtype=cutlass.Float32)
    return SmemBudget(f"K1 per-head gate D={dim} CHUNK={chunk}", SmemGroup("PerHeadPrepareStorage", (
        SmemBuffer("q", tile, note="TMA-loaded q; qd written over it"),
        SmemBuffer("k", tile, note="TMA-loaded k; kd written over it"),
        SmemBuffer("kr", tile, note="kr = kh · 2^Gs"),
        SmemBuffer("q_hat", tile, note="bf16(qh): left operand of A_qk"),
        SmemBuffer("k_hat", tile, note="bf16(kh): both operands of A_kk, right operand of A_qk"),
        SmemBuffer("spans", pairs, note="E[i, j] = a_{j+1}·…·a_i (i ≥ j): the tile's pair decays"),
        SmemBuffer("beta", rows, align_bytes=BETA_ALIGN, note="activated β per row, 0 on invalid rows"),
        SmemBuffer("gate", rows, align_bytes=BETA_ALIGN, note="g' per row (base 2), 0 on invalid rows"),
        SmemBuffer("decay", rows, align_bytes=BETA_ALIGN, note="a = 2^g' per row"),
        SmemBuffer("prefix_decay", rows, align_bytes=BETA_ALIGN, note="2^G per row (G the prefix sum)"),
        SmemBuffer("suffix_decay", rows, align_bytes=BETA_ALIGN, note="2^Gs per row (Gs the suffix sum)"),
        mbarriers("tma_barrier", 1, "transaction barrier of the q, k loads"),
    )))


def per_head_pair_smem_budget(dim: int = HEAD_DIM, chunk: int = CHUNK) -> SmemBudget:
    """Shared-memory plan of the per-head gate's pair K1 (docs/numerics.md, "Two tiles a serial step"): both tiles'
    buffers of :func:`per_head_smem_budget` (tile b's qd, kd are the pair-relative ones, written over its q, k: the
    scheme's products read the bf16 rows q̂, k̂, not qd, kd), the rows' factors measured across the pair, and the
    cross block's decays."""
    tile = layout_spec(f"chunk_tile({dim},{chunk})", chunk_tile, dim, chunk, dtype=cutlass.BFloat16)
    pairs = layout_spec(f"pair_matrix({chunk})", pair_matrix, chunk, dtype=cutlass.Float32)
    rows = layout_spec(f"row_vector({chunk})", row_vector, chunk, dtype=cutlass.Float32)

    def tile_buffers(t: str) -> tuple:
        return (
            SmemBuffer(f"q_{t}", tile, note=f"tile {t}'s TMA-loaded q; its qd written over it"),
            SmemBuffer(f"k_{t}", tile, note=f"tile {t}'s TMA-loaded k; its kd written over it"),
            SmemBuffer(f"kr_{t}", tile, note=f"tile {t}'s kr"),
            SmemBuffer(f"q_hat_{t}", tile, note=f"tile {t}'s bf16(qh)"),
            SmemBuffer(f"k_hat_{t}", tile, note=f"tile {t}'s bf16(kh)"),
            SmemBuffer(f"spans_{t}", pairs, note=f"tile {t}'s pair decays E"),
            *(SmemBuffer(f"{name}_{t}", rows, align_bytes=BETA_ALIGN, note=f"tile {t}: {note}") for name, note in (
                ("beta", "activated β per row"), ("gate", "g' per row"), ("decay", "a = 2^g' per row"),
                ("prefix_decay", "2^G per row"), ("suffix_decay", "2^Gs per row"))),
        )

    return SmemBudget(f"K1 per-head gate, pairs D={dim} CHUNK={chunk}", SmemGroup("PerHeadPairPrepareStorage", (
        *tile_buffers("a"),
        *tile_buffers("b"),
        SmemBuffer("cross_spans", pairs, note="f32(2^G_b[i] · 2^Gs_a[j]): row j of a to row i of b"),
        SmemBuffer("suffix_to_pair_end", rows, align_bytes=BETA_ALIGN, note="f32(2^Gs_a · gT_b): kr_a'"),
        SmemBuffer("prefix_from_pair_start", rows, align_bytes=BETA_ALIGN, note="f32(gT_a · 2^G_b): qd_b', kd_b'"),
        mbarriers("tma_barrier", 1, "transaction barrier of both tiles' q, k loads"),
    )))


def compact(tensor: cute.Tensor, inner: tuple) -> cute.Tensor:
    """The C-contiguous gmem tensor ``[n, *inner]`` with its inner extents and all strides static.

    K1's launcher hands over tensors with dynamic layouts (one compile serves every size); only the
    leading extent ``n`` stays dynamic here, so tiles and fragments of the inner modes are static.
    ``n`` is the product of every mode before the inner ones: a C-contiguous ``[B, T, H, D]`` tensor
    with ``inner = (H, D)`` is the ``[B·T, H, D]`` tensor (the launcher passes no views, which cost
    host time per call).
    """
    n = tensor.shape[0]
    for extent in tensor.shape[1:cute.rank(tensor) - len(inner)]:
        n = n * extent
    shape = (n, *inner)
    return cute.make_tensor(tensor.iterator, cute.make_layout(shape, stride=cute.make_layout(shape[::-1]).stride[::-1]))
