"""Shared-memory plan of the tile-gradient kernel, Kernel B (``cute_kda.kernels.bwd_grads``).

One CTA handles one (16-token tile, head); :func:`smem_budget` is its shared memory. Every ``[16, D]``
bf16 tile and both ``[D, D]`` state matrices (D = 128 or 64) use K1's 128-byte-swizzled ``K_SW128`` atoms
(:func:`cute_kda.layouts.fwd_prepare.chunk_tile`): the TMA's ``SWIZZLE_128B`` mode, conflict-free
16-byte runs for the elementwise phases, and ``ldmatrix`` / ``ldmatrix.trans`` through the tile or
its ``MN_SW128`` transposed view (:func:`cute_kda.layouts.smem.sw128_tile_transposed`), as each
product needs. A state matrix arrives as the scan kernels keep it in global memory, a state image
(:func:`cute_kda.layouts.fwd_recurrence.state_image`: K_INTER ``[V, K]``, 8 k contiguous), by one 1-D
bulk copy: its ``[V, K]`` face is the B operand of ``kd·S`` (n = V, k = K), its ``[K, V]`` MN_INTER face
that of ``dO·Sᵀ`` (n = K, k = V, ``ldmatrix.trans``); both read 128-byte core matrices, conflict-free. The 16×16 matrices (INV, dMqk, β·dL) are
K_INTER operand tiles with their transposed views. The fp32 ``[16, D]`` tiles (G, dG, dkr⊙kr) use
K1's gate-cumsum layout.
"""

from __future__ import annotations

from typing import NamedTuple

from ..dsl import cute, cutlass
from ..numerics import DYADIC_BLOCKS
from .analysis import layout_spec
from .budget import SmemBudget, SmemBuffer, SmemGroup, mbarriers
from .fwd_prepare import chunk_tile, gate_cumsum_tile, pair_matrix, row_vector
from .smem import CHUNK, HEAD_DIM, square_tile, state_acc_view, state_b_view, vector

TOKEN_TILES = ("q", "k", "g", "v", "do", "du")  # TMA-loaded [16, D] bf16 tiles, in load order
PER_HEAD_TOKEN_TILES = ("q", "k", "v", "do", "du")  # a per-head gate is one value a row, not a tile
PER_HEAD_ROWS = ("gate", "decay", "prefix", "suffix", "x_rows", "y_rows")  # [16] fp32 of a per-head gate
STATE_TILES = ("state", "state_grad")  # bulk-loaded [D, D] bf16 state images: S entering the tile, dS' after it
ROW_VECTORS = ("beta", "rinv_q", "rinv_k", "dbeta_square")  # [16] fp32
COMPUTE_WARPS = (4, 8)  # warps per CTA the kernel is built for; warp w owns columns w·(D/warps) …
DEFAULT_WARPS = 8  # measured faster than 4 (docs/perf-log.md, B1)
CTAS_PER_SM = 2  # what the smem plan is sized for; the launch asks ptxas for it (≤ 128 registers at 8 warps)
CHANNEL_WARPS = 4  # the most warps that run the per-channel phases (one thread per channel: D / 32 warps)
DYADIC_LEVELS = len(DYADIC_BLOCKS)  # the straddle levels of the per-channel unbounded gates
DYADIC_CTAS_PER_SM = 1  # the dyadic plan's first form


# The two-tile training form (``GradsVariant.pair_rebuild``; W2 of docs/perf-log.md): a CTA loads its pair partner's
# tiles into the bytes of the four tiles its phases 2 and 3 write first (nothing touches them before the rebuild that
# reads the partner's), in this order, and the partner's gT into dgT's vector (written in phase 4). Tile a rebuilds
# dS'_a = qd_bᵀ·dO_b − kd_bᵀ·dv_b + gT_b ⊙ dS'_b from :data:`PAIR_A_TILES`, tile b S_b = kr_aᵀ·U_a + gT_a ⊙ S_a from
# :data:`PAIR_B_TILES` (U_a value-major ``[D, 16]``, a tile's bytes)
PARTNER_BUFFERS = {"safe": ("kinv", "u_out", "neg_bdu", "cumsum"), "per_head": ("k_hat", "q_hat", "u_out", "neg_bdu")}
PAIR_A_TILES = ("qd", "kd", "do", "dv")
PAIR_B_TILES = ("kr", "u")


def partner_load_bytes(tiles: tuple[str, ...], dim: int = HEAD_DIM, chunk: int = CHUNK) -> int:
    """Bytes a CTA loads of its pair partner: ``tiles`` (:data:`PAIR_A_TILES` or :data:`PAIR_B_TILES`) of ``[16, D]``
    bf16 each."""
    return len(tiles) * chunk * dim * 2


def compute_warps(dim: int = HEAD_DIM) -> tuple[int, ...]:
    """The warp counts Kernel B is built for at head dim ``dim``: :data:`COMPUTE_WARPS` at 128; 4 at 64, where K1's
    recompute has 16 rows × 8 lanes of row chunks, one a thread of 4 warps, and a warp's band stays 16 columns (the
    band of 8 warps at 128)."""
    return COMPUTE_WARPS if dim == HEAD_DIM else (4,)


def default_warps(dim: int = HEAD_DIM) -> int:
    """The launcher's warps at head dim ``dim``: :data:`DEFAULT_WARPS`, or the one count :func:`compute_warps` has."""
    return DEFAULT_WARPS if DEFAULT_WARPS in compute_warps(dim) else max(compute_warps(dim))


def reads_gate_rows(gate: str, per_head_gate: bool) -> bool:
    """Whether Kernel B's gate backward walks a channel's 16 rows reading the raw gate back from global memory (its
    smem tile is reused, or never loaded): the per-channel gates with A_log and dt_bias, the ones ``gate_ahead``
    (``cute_kda.variants.GradsVariant``) loads in one burst."""
    return not per_head_gate and gate != "none"


def state_tile(dim: int = HEAD_DIM):
    """``[K, V]`` face of a state (or state gradient) matrix as the kernels keep it: the state image
    (:func:`cute_kda.layouts.fwd_recurrence.state_image`) seen through its MN_INTER atoms, so the matrix
    arrives by one 1-D bulk copy."""
    return state_acc_view(dim)


def state_tile_transposed(dim: int = HEAD_DIM):
    """``[V, K]`` face of :func:`state_tile` (the image's own K_INTER layout), same bytes."""
    return state_b_view(dim)


def pair_u_tile(dim: int = HEAD_DIM, chunk: int = CHUNK):
    """``[D, 16]`` bf16 rows of 32 bytes: tile a's ``U`` value-major as the training pair K2 keeps it, one 1-D bulk
    copy into a pair partner's tile (:data:`PAIR_B_TILES`); the A operand ``U_aᵀ`` of tile b's rebuild."""
    return cute.make_layout((dim, chunk), stride=(chunk, 1))


def warp_rows(warps: int, chunk: int = CHUNK):
    """``[warps, CHUNK]`` fp32 row partials, one row of 16 per warp (reduced in warp order)."""
    return cute.make_layout((warps, chunk), stride=(chunk, 1))


def load_bytes(dim: int = HEAD_DIM, chunk: int = CHUNK, per_head_gate: bool = False) -> int:
    """Bytes of the one TMA transaction: the token tiles and the two state matrices. ``per_head_gate``: no gate
    tile is loaded (a per-head gate; the per-channel unbounded gates read g column by column too)."""
    tiles = PER_HEAD_TOKEN_TILES if per_head_gate else TOKEN_TILES
    return len(tiles) * chunk * dim * 2 + state_load_bytes(dim)


def state_load_bytes(dim: int = HEAD_DIM) -> int:
    """Bytes of the two state images, the second transaction of a split load (``GradsVariant.split_load``)."""
    return len(STATE_TILES) * dim * dim * 2


def load_barriers(split_load: bool) -> SmemBuffer:
    """The loads' transaction barriers: one for everything, or (``split_load``) the token tiles' and the state
    images' (docs/perf-log.md, B6)."""
    if split_load:
        return mbarriers("tma_barrier", 2, "transaction barriers: the token tiles', the state images'")
    return mbarriers("tma_barrier", 1, "transaction barrier of the loads")


class _Specs(NamedTuple):
    """The layouts Kernel B's plans place, as budget specs."""

    tile: object
    state: object
    square: object
    fp32: object
    pairs: object
    rows: object
    per_warp: object
    channels: object
    channel_warps: object


def _specs(warps: int, dim: int, chunk: int) -> _Specs:
    return _Specs(
        tile=layout_spec(f"chunk_tile({dim},{chunk})", chunk_tile, dim, chunk, dtype=cutlass.BFloat16),
        state=layout_spec(f"state_tile({dim})", state_tile, dim, dtype=cutlass.BFloat16),
        square=layout_spec(f"square_tile({chunk})", square_tile, chunk, dtype=cutlass.BFloat16),
        fp32=layout_spec(f"gate_cumsum_tile({dim},{chunk})", gate_cumsum_tile, dim, chunk, dtype=cutlass.Float32),
        pairs=layout_spec(f"pair_matrix({chunk})", pair_matrix, chunk, dtype=cutlass.Float32),
        rows=layout_spec(f"row_vector({chunk})", row_vector, chunk, dtype=cutlass.Float32),
        per_warp=layout_spec(f"warp_rows({warps},{chunk})", warp_rows, warps, chunk, dtype=cutlass.Float32),
        channels=layout_spec(f"vector({dim})", vector, dim, dtype=cutlass.Float32),
        channel_warps=layout_spec(f"vector({CHANNEL_WARPS})", vector, CHANNEL_WARPS, dtype=cutlass.Float32),
    )


def _tiles(specs: _Specs, *named) -> tuple:
    """``[16, D]`` bf16 tiles, each ``(name, note)``."""
    return tuple(SmemBuffer(name, specs.tile, note=note) for name, note in named)


def _rows_then_l2norm(specs: _Specs) -> SmemGroup:
    """dβ's per-warp row partials, then (a union) the l2norm's."""
    l2norm = SmemGroup("l2norm_rows", (
        SmemBuffer("dot_q", specs.per_warp, align_bytes=16, note="Σ_c q̂·dq̂ per warp and row"),
        SmemBuffer("dot_k", specs.per_warp, align_bytes=16, note="Σ_c k̂·dk̂ per warp and row"),
    ))
    return SmemGroup("rows_then_l2norm", (
        SmemBuffer("dbeta_w", specs.per_warp, align_bytes=16, note="Σ_v du·w per warp and row"), l2norm), union=True)


def smem_budget(warps: int, dim: int = HEAD_DIM, chunk: int = CHUNK, split_load: bool = False) -> SmemBudget:
    """Kernel B's shared-memory plan for ``warps`` compute warps (host side).

    Sized for two CTAs per SM (≤ 113 KB each): qd, kd, kr are written over the raw q, k, g tiles (as
    K1 does; the raw values the last phases need are read back from global memory, where the TMA
    just left them in L2); dG takes the bytes of v and du, dead after the 16×16 products; the l2norm's
    row partials take those of dβ's; Σ_r dkr ⊙ kr is kept per channel, not per element.
    """
    specs = _specs(warps, dim, chunk)
    dead_after_products = SmemGroup("inputs_vdu", _tiles(specs, ("v", "v (TMA)"), ("du", "du from Kernel A (TMA)")))
    buffers = (
        *_tiles(specs, ("q", "raw q (TMA), then qd"), ("k", "raw k (TMA), then kd"), ("g", "raw gate (TMA), then kr"),
               ("do", "dO (TMA)")),
        SmemGroup("vdu_then_dg", (dead_after_products, SmemBuffer("dg_cum", specs.fp32, note="dG per token")), union=True),
        *(SmemBuffer(name, specs.state, note=note) for name, note in (
            ("state", "S entering the tile, [K, V] (TMA)"), ("state_grad", "dS' after the tile, [K, V] (TMA)"))),
        *_tiles(specs, ("kinv", "recomputed as K1"), ("u_out", "U = INV·u"), ("neg_bdu", "−bf16(β ⊙ du)")),
        SmemBuffer("cumsum", specs.fp32, note="G"),
        *(SmemBuffer(name, specs.square, note=note) for name, note in (
            ("inv", "INV (workspace)"), ("dmqk", "bf16(tril(dO·Uᵀ))"), ("dlb", "bf16(β_i · dL_ij)"))),
        *(SmemBuffer(name, specs.rows, align_bytes=16, note="per row") for name in ROW_VECTORS),
        _rows_then_l2norm(specs),
        SmemBuffer("dkr_col", specs.channels, align_bytes=16, note="Σ_r dkr ⊙ kr per channel"),
        SmemBuffer("dgt", specs.channels, align_bytes=16, note="Σ_v S ⊙ dS' per channel"),
        SmemBuffer("dalog_w", specs.channel_warps, align_bytes=16, note="dA_log partial per channel warp"),
        load_barriers(split_load),
    )
    return SmemBudget(f"Kernel B warps={warps} D={dim} CHUNK={chunk}", SmemGroup("GradsStorage", buffers))


def per_head_smem_budget(warps: int, dim: int = HEAD_DIM, chunk: int = CHUNK,
                         split_load: bool = False) -> SmemBudget:
    """Kernel B's shared-memory plan for a per-head gate (GatedDeltaNet; docs/numerics.md, "Kernel B for a
    per-head gate"), two CTAs per SM as :func:`smem_budget`.

    qd, kd over q, k and kr in a tile of its own (no gate tile is loaded); k̂ and q̂, the bf16 rows of the pair
    products, take kinv's place and one tile more; the fp32 G and dG tiles go (one decay per row: the per-row
    values of :data:`PER_HEAD_ROWS` instead); the pair decays E, ``f32(dA ⊙ k̂k̂ᵀ)`` and ``f32(dMqk ⊙ q̂k̂ᵀ)`` are
    16 × 16 fp32. dMqk and β·dL hold ``bf16(E ⊙ dMqk)`` and ``bf16(E ⊙ β·dL)``.
    """
    specs = _specs(warps, dim, chunk)
    buffers = (
        *_tiles(specs, ("q", "raw q (TMA), then qd"), ("k", "raw k (TMA), then kd"), ("kr", "kr"), ("do", "dO (TMA)"),
               ("v", "v (TMA)"), ("du", "du from Kernel A (TMA)")),
        *(SmemBuffer(name, specs.state, note=note) for name, note in (
            ("state", "S entering the tile, [K, V] (TMA)"), ("state_grad", "dS' after the tile, [K, V] (TMA)"))),
        *_tiles(specs, ("k_hat", "bf16 k̂"), ("q_hat", "bf16 q̂"), ("u_out", "U = INV·u"), ("neg_bdu", "−bf16(β ⊙ du)")),
        *(SmemBuffer(name, specs.pairs, align_bytes=16, note=note) for name, note in (
            ("spans", "E, the pair decays"), ("a_pairs", "f32(dA ⊙ k̂k̂ᵀ)"), ("m_pairs", "f32(dMqk ⊙ q̂k̂ᵀ)"))),
        *(SmemBuffer(name, specs.square, note=note) for name, note in (
            ("inv", "INV (workspace)"), ("dmqk", "bf16(E ⊙ dMqk)"), ("dlb", "bf16(E ⊙ bf16(β_i · dL_ij))"))),
        *(SmemBuffer(name, specs.rows, align_bytes=16, note="per row") for name in ROW_VECTORS + PER_HEAD_ROWS),
        _rows_then_l2norm(specs),
        SmemBuffer("x_w", specs.per_warp, align_bytes=16, note="Σ_c dqd⊙qd + dkd⊙kd per warp and row"),
        SmemBuffer("y_w", specs.per_warp, align_bytes=16, note="Σ_c dkr⊙kr per warp and row"),
        SmemBuffer("dgt", specs.channels, align_bytes=16, note="Σ_v S ⊙ dS' per channel"),
        load_barriers(split_load),
    )
    return SmemBudget(f"Kernel B per-head gate warps={warps} D={dim} CHUNK={chunk}",
                      SmemGroup("PerHeadGradsStorage", buffers))


def dyadic_smem_budget(warps: int, dim: int = HEAD_DIM, chunk: int = CHUNK, split_load: bool = False) -> SmemBudget:
    """Kernel B's shared-memory plan for the per-channel unbounded gates (the dyadic scheme of docs/numerics.md,
    "Kernel B for the per-channel unbounded gates"): the first, simplest form, one CTA per SM.

    As :func:`per_head_smem_budget` for the token tiles and the states; K1's dyadic recompute adds, per straddle
    level, the bf16 operands X (every row) and Q (upper rows) and the fp32 factors, and the fp32 tiles ``2^G`` and
    ``2^Gs``; the 16 × 16 ``A`` of dβ is fp32; the masked ``dA_ℓ``, ``dM_ℓ`` are bf16 operand tiles. After the
    state products (a barrier), S's bytes take the four levels' fp32 pair sums (``X⊙P + Q⊙Pq`` on upper rows,
    ``X⊙C`` on lower ones) and dS''s the rows' terms ``dqd⊙qd + dkd⊙kd`` and ``dkr⊙kr``.
    """
    specs = _specs(warps, dim, chunk)
    levels = range(DYADIC_LEVELS)
    buffers = (
        *_tiles(specs, ("q", "raw q (TMA), then qd"), ("k", "raw k (TMA), then kd"), ("kr", "kr"), ("do", "dO (TMA)"),
               ("v", "v (TMA)"), ("du", "du from Kernel A (TMA)")),
        SmemGroup("state_then_level_sums", (
            SmemBuffer("state", specs.state, note="S entering the tile, [K, V] (TMA)"),
            SmemGroup("level_sums", tuple(SmemBuffer(f"level_sum{ell}", specs.fp32, note=f"level {ell}'s pair sums")
                                          for ell in levels))), union=True),
        SmemGroup("state_grad_then_row_terms", (
            SmemBuffer("state_grad", specs.state, note="dS' after the tile, [K, V] (TMA)"),
            SmemGroup("row_terms", (SmemBuffer("row_x", specs.fp32, note="dqd⊙qd + dkd⊙kd"),
                                    SmemBuffer("row_y", specs.fp32, note="dkr⊙kr")))), union=True),
        *(SmemBuffer(f"level_x{ell}", specs.tile, note=f"X of level {ell}") for ell in levels),
        *(SmemBuffer(f"level_q{ell}", specs.tile, note=f"Q of level {ell}") for ell in levels),
        *(SmemBuffer(f"factor{ell}", specs.fp32, note=f"level {ell}'s factors") for ell in levels),
        SmemBuffer("pow_g", specs.fp32, note="2^G"), SmemBuffer("pow_gs", specs.fp32, note="2^Gs"),
        *_tiles(specs, ("u_out", "U = INV·u"), ("neg_bdu", "−bf16(β ⊙ du)")),
        SmemBuffer("a_kk", specs.pairs, align_bytes=16, note="A, K1's pair sums"),
        *(SmemBuffer(name, specs.square, note=note) for name, note in (
            ("inv", "INV (workspace)"), ("dmqk", "bf16(tril(dO·Uᵀ))"), ("dlb", "bf16(β_i · dL_ij)"))),
        *(SmemBuffer(f"masked_dlb{ell}", specs.square, note=f"dA of level {ell}") for ell in levels),
        *(SmemBuffer(f"masked_dmqk{ell}", specs.square, note=f"dMqk of level {ell}") for ell in levels),
        *(SmemBuffer(name, specs.rows, align_bytes=16, note="per row") for name in ROW_VECTORS),
        _rows_then_l2norm(specs),
        SmemBuffer("dgt", specs.channels, align_bytes=16, note="Σ_v S ⊙ dS' per channel"),
        SmemBuffer("dalog_w", specs.channel_warps, align_bytes=16, note="dA_log partial per channel warp"),
        load_barriers(split_load),
    )
    return SmemBudget(f"Kernel B dyadic warps={warps} D={dim} CHUNK={chunk}", SmemGroup("DyadicGradsStorage", buffers))
