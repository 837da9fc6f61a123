"""Mirrors of the two-tile prefill (docs/numerics.md, "Two tiles a serial step"; docs/perf-log.md, v8 and v10): K1's
pair workspace and K2's pair step, safe gate (the kernels: ``cute_kda.kernels.fwd_prepare.SafePairPrepare``,
``cute_kda.kernels.fwd_recurrence_pairs.PairRecurrence``), and Kernel A's pair step (planned: W2 of v8).

Tiles pair up from each sequence's first tile: (0, 1), (2, 3), …; a sequence with an odd count ends on a lone tile,
which keeps today's fields and today's step. In a pair (a, b) the workspace holds today's fields except

- tile b's ``kd``, ``qd`` relative to the pair's start: ``bf16(k̂ ⊙ 2^f32(G_a,last + G_b))`` (and ``scale · q̂``);
- tile a's ``kr`` relative to the pair's end: ``bf16(k̂ ⊙ 2^f32(f32(G_a,last − G_a) + G_b,last))``;
- tile a's ``gt``: the pair's decay ``2^f32(G_a,last + G_b,last)``;
- tile b's cross blocks against tile a: ``P = bf16(kd_b'·kinv_aᵀ)``, ``Q = bf16(qd_b'·kinv_aᵀ)`` from tile b's
  pair-relative bf16 rows and tile a's bf16 ``kinv`` (K1's operand of ``L_a``): entry ``[i, j]`` carries the decay
  from row j of a to row i of b, ≤ 1 (16 × 16; zero in every other slot). The safe gate bounds ``kinv`` as it does
  for ``L``; the same accuracy as from today's ``kd_b·kr_aᵀ`` on the CPU
  (``benchmarks/results/2026-12-04-session14.md``).

INV, Mqk and β stay per tile, as today. The pair step (state ``S32`` fp32 entering the pair, ``S = bf16(S32)``)::

    u_a = bf16(f32(v_a − kd_a·S)·β_a),  U_a = bf16(INV_a·u_a),  o_a = qd_a·S + Mqk_a·U_a
    u_b = bf16(f32(v_b − (kd_b'·S + P·U_a))·β_b),  U_b = bf16(INV_b·u_b),  o_b = qd_b'·S + Q·U_a + Mqk_b·U_b
    S32 ← kr_a'ᵀ·U_a + kr_bᵀ·U_b + f32(gT_pair·S32)           (one block update: the state between the tiles is
                                                              not formed, so this is the inference form)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..workspace import CHUNK, Workspace, pair_block_slots
from .common import (
    Constants, TileMap, check_activations, ex2_approx, mma, scan_shape, state_in, state_out, to_tiles,
)
from .gold import expand_to_value_heads
from .mirror import K1Rows, safe_k1


class PairWorkspace(NamedTuple):
    """K1's pair workspace: ``ws`` (today's fields, a pair's as the module docstring says) and the cross blocks
    ``cross_kd`` (P), ``cross_qd`` (Q) bf16 ``[H · tiles, 16, 16]`` (tile b's slot; zero elsewhere), as
    :class:`cute_kda.workspace.CrossBlocks`."""

    ws: Workspace
    cross_kd: torch.Tensor
    cross_qd: torch.Tensor


def pair_roles(tile_map: TileMap, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool ``[tiles]``: the slot is tile a of a pair, bool ``[tiles]``: the slot is tile b of a pair). Pairs start
    at each sequence's first tile; a sequence's odd last tile is neither (a lone tile)."""
    device = tile_map.bases.device
    slot = torch.arange(tiles, device=device)
    starts, counts = tile_map.bases[:-1], tile_map.tiles_per_seq
    seq = torch.searchsorted(tile_map.bases[1:], slot, right=True).clamp(max=counts.numel() - 1)
    local = slot - starts[seq]
    real = tile_map.slot_exists & (local < counts[seq])
    is_a = real & (local % 2 == 0) & (local + 1 < counts[seq])
    is_b = real & (local % 2 == 1)
    return is_a, is_b


def unscaled_rows(q: torch.Tensor, k: torch.Tensor, consts: Constants, tile_map: TileMap, value_heads: int,
                  qk_l2norm: bool, rows: K1Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale · q̂`` and ``k̂`` tiled ``[HV, tiles, 16, D]`` fp32, as :func:`~.mirror.k1_rows` forms them before the
    decays."""
    total, heads, dim = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
    q32, k32 = q.reshape(total, heads, dim).float(), k.reshape(total, heads, dim).float()
    if qk_l2norm:
        q_hat, k_hat = q32 * (rows.rinv_q * consts.scale), k32 * rows.rinv_k
    else:
        q_hat, k_hat = q32 * consts.scale, k32
    group = value_heads // heads
    return tuple(to_tiles(expand_to_value_heads(t, group, dim=1), tile_map) for t in (q_hat, k_hat))


def pair_slots(tile_map: TileMap) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile a, tile b) slot numbers of every pair, int64 ``[pairs]`` each (:func:`pair_roles`)."""
    _, is_b = pair_roles(tile_map, tile_map.slot_exists.numel())
    b = torch.nonzero(is_b).flatten()
    return b - 1, b


def pair_block_of(tile_map: TileMap) -> torch.Tensor:
    """int64 ``[tiles]``: the kept slot (:func:`~cute_kda.workspace.pair_block_slots`) of the pair each tile slot
    belongs to."""
    tiles = tile_map.slot_exists.numel()
    slot = torch.arange(tiles, device=tile_map.bases.device)
    num_seqs = tile_map.tiles_per_seq.numel()
    seq = torch.searchsorted(tile_map.bases[1:], slot, right=True).clamp(max=max(num_seqs - 1, 0))
    first = tile_map.bases[:-1][seq]
    return (first + 2 * ((slot - first) // 2) + seq) // 2


def _kept(buffer: torch.Tensor | None, name: str, heads: int, slots: int,
          shape: tuple[int, int]) -> torch.Tensor | None:
    """``buffer`` bf16 ``[H · slots, *shape]`` as ``[H, slots + 1, *shape]`` (slot ``slots``: a sink), or None."""
    if buffer is None:
        return None
    if buffer.dtype != torch.bfloat16 or tuple(buffer.shape) != (heads * slots, *shape):
        raise ValueError(f"{name} must be bf16 {(heads * slots, *shape)}, got {buffer.dtype} {tuple(buffer.shape)}")
    kept = torch.empty(heads, slots + 1, *shape, device=buffer.device, dtype=torch.bfloat16)
    kept[:, :slots] = buffer.view(heads, slots, *shape)
    return kept


def _changed_fields(ws: Workspace, heads: int) -> tuple[torch.Tensor, ...]:
    """Copies of ``ws``'s qd, kd, kr, gt as ``[HV, tiles, ...]``: the fields a pair changes."""
    return tuple(t.view(heads, -1, *t.shape[1:]).clone() for t in (ws.qd, ws.kd, ws.kr, ws.gt))


def _pair_workspace(ws: Workspace, changed: tuple, b: torch.Tensor, cross_kd: torch.Tensor,
                    cross_qd: torch.Tensor) -> PairWorkspace:
    """``ws`` with the pair's qd, kd, kr, gt (``changed``, ``[HV, tiles, ...]``) and the cross blocks of the tile b
    slots ``b`` (``[HV, pairs, 16, 16]``, rounded to bf16 here; zero in every other slot)."""
    heads, tiles = changed[0].shape[:2]
    blocks = []
    for values in (cross_kd, cross_qd):
        block = torch.zeros(heads, tiles, CHUNK, CHUNK, device=values.device, dtype=torch.bfloat16)
        block[:, b] = values.bfloat16()
        blocks.append(block.reshape(-1, CHUNK, CHUNK))
    fields = {name: value.reshape(getattr(ws, name).shape) for name, value in zip(("qd", "kd", "kr", "gt"), changed)}
    return PairWorkspace(ws._replace(**fields), *blocks)


def mirror_prepare_pairs(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, A_log: torch.Tensor,
    dt_bias: torch.Tensor, lower_bound: float = -5.0, scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
) -> PairWorkspace:
    """K1 of the pair step for the safe gate (arguments as :func:`~.mirror.mirror_prepare`)."""
    consts, tile_map, rows, ws = safe_k1(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                         scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm,
                                         beta_logits=beta_logits)
    heads = beta.shape[2]
    qd, kd, kr, gt = _changed_fields(ws, heads)
    a, b = pair_slots(tile_map)
    G_last = rows.G[:, :, CHUNK - 1]  # [HV, tiles, D]
    q_rows, k_rows = unscaled_rows(q, k, consts, tile_map, heads, qk_l2norm, rows)
    # tile b, relative to the pair's start; tile a's kr, relative to the pair's end; the pair's decay
    from_start = ex2_approx(G_last[:, a, None, :] + rows.G[:, b])
    kd[:, b] = (k_rows[:, b] * from_start).bfloat16()
    qd[:, b] = (q_rows[:, b] * from_start).bfloat16()
    kr[:, a] = (k_rows[:, a] * ex2_approx((G_last[:, a, None, :] - rows.G[:, a]) + G_last[:, b, None, :])).bfloat16()
    gt[:, a] = ex2_approx(G_last[:, a] + G_last[:, b])
    kinv_a = rows.kinv[:, a].transpose(-1, -2)
    return _pair_workspace(ws, (qd, kd, kr, gt), b, mma(kd[:, b], kinv_a), mma(qd[:, b], kinv_a))


def mirror_prepare_pairs_per_head(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **options,
) -> PairWorkspace:
    """K1 of the pair step for a per-head gate (GatedDeltaNet's g ``[B, T, HV]``; arguments as
    :func:`~.gates.mirror_prepare_gates`, scheme ``per_head``). Today's per-head fields (``prefix = 2^G``,
    ``suffix = 2^Gs`` a row, ``gT = prefix[15]``, ``E ⊙ (k̂ k̂ᵀ)`` products of the bf16 rows) except, in a pair (a, b):

    - tile b's ``kd``, ``qd`` from the pair's start: ``bf16(kh_b · f32(gT_a · prefix_b))`` (and ``qh_b``);
    - tile a's ``kr`` to the pair's end: ``bf16(kh_a · f32(suffix_a · gT_b))``; tile a's ``gt``: ``f32(gT_a · gT_b)``;
    - the cross blocks ``P = bf16(f32(f32(prefix_b[i] · suffix_a[j]) · (k̂_b·k̂_aᵀ)[i, j]))`` and ``Q`` with ``q̂_b``
      (the bf16 rows' fp32 tensor-core sums): the decay from row j of a to row i of b times the rows' product.

    One decay a row, every factor ≤ 1: no exponent is formed, so nothing overflows for any gate value."""
    from .gates import _k1_gate_values

    if g.dim() != 3:
        raise ValueError("mirror_prepare_pairs_per_head takes a per-head gate g [B, T, HV]")
    values = _k1_gate_values(q, k, g, beta, scheme="per_head", **options)
    qd, kd, kr, gt = _changed_fields(values.workspace, beta.shape[2])
    prefix, suffix = ex2_approx(values.G)[..., 0], ex2_approx(values.Gs)[..., 0]  # [HV, tiles, 16]
    a, b = pair_slots(values.tile_map)
    gt_a, gt_b = prefix[:, a, CHUNK - 1], prefix[:, b, CHUNK - 1]  # [HV, pairs]
    from_start = (gt_a[..., None] * prefix[:, b])[..., None]  # [HV, pairs, 16, 1]
    kd[:, b] = (values.kh[:, b] * from_start).bfloat16()
    qd[:, b] = (values.qh[:, b] * from_start).bfloat16()
    kr[:, a] = (values.kh[:, a] * (suffix[:, a] * gt_b[..., None])[..., None]).bfloat16()
    gt[:, a] = (gt_a * gt_b)[..., None].expand(-1, -1, gt.shape[-1])
    spans = prefix[:, b, :, None] * suffix[:, a, None, :]  # [HV, pairs, 16 (b), 16 (a)]
    k16_a = values.kh[:, a].bfloat16().transpose(-1, -2)
    cross_kd, cross_qd = (spans * mma(rows[:, b].bfloat16(), k16_a) for rows in (values.kh, values.qh))
    return _pair_workspace(values.workspace, (qd, kd, kr, gt), b, cross_kd, cross_qd)


def mirror_prepare_pairs_dyadic(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **options,
) -> PairWorkspace:
    """K1 of the pair step for the per-channel unbounded gates (softplus, a log decay; scheme ``dyadic``, arguments as
    :func:`~.gates.mirror_prepare_gates`): planned, no kernel yet. Today's dyadic fields (G, Gs its own running
    sums) except, in a pair (a, b):

    - tile b's ``kd``, ``qd`` from the pair's start: ``bf16(kh_b ⊙ 2^f32(G_a,last + G_b))`` (and ``qh_b``);
    - tile a's ``kr`` to the pair's end: ``bf16(kh_a ⊙ 2^f32(Gs_a + G_b,last))``; tile a's ``gt``:
      ``2^f32(G_a,last + G_b,last)``;
    - the cross blocks from the tile-relative fields, ``P = bf16(kd_b·kr_aᵀ)``, ``Q = bf16(qd_b·kr_aᵀ)``: every
      factor ``2^(G_b + Gs_a)`` ≤ 1 for any gate (the safe gate's ``kinv_a`` would overflow here).

    Every exponent is ≤ 0, so nothing overflows."""
    from .gates import _k1_gate_values

    if g.dim() != 4:
        raise ValueError("mirror_prepare_pairs_dyadic takes a per-channel gate g [B, T, HV, K]")
    values = _k1_gate_values(q, k, g, beta, scheme="dyadic", **options)
    ws = values.workspace
    qd, kd, kr, gt = _changed_fields(ws, beta.shape[2])
    a, b = pair_slots(values.tile_map)
    G_last = values.G[:, :, CHUNK - 1]  # [HV, tiles, K]
    from_start = ex2_approx(G_last[:, a, None, :] + values.G[:, b])
    kd[:, b] = (values.kh[:, b] * from_start).bfloat16()
    qd[:, b] = (values.qh[:, b] * from_start).bfloat16()
    kr[:, a] = (values.kh[:, a] * ex2_approx(values.Gs[:, a] + G_last[:, b, None, :])).bfloat16()
    gt[:, a] = ex2_approx(G_last[:, a] + G_last[:, b])
    tile_kd, tile_qd, tile_kr = (t.view(*kd.shape) for t in (ws.kd, ws.qd, ws.kr))  # today's, tile-relative
    kr_a = tile_kr[:, a].transpose(-1, -2)
    return _pair_workspace(ws, (qd, kd, kr, gt), b, mma(tile_kd[:, b], kr_a), mma(tile_qd[:, b], kr_a))


def mirror_recurrence_pairs(
    pws: PairWorkspace, v: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    state_dtype: torch.dtype = torch.float32, state_layout: str = "vk", checkpoints: torch.Tensor | None = None,
    u_a: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K2's pair step over ``pws`` (:func:`mirror_prepare_pairs`): v bf16 ``[B, T, H, V]``, the states ``[N, H, V, K]``
    (``state_layout="vk"``, the kernels' layout) or ``[N, H, K, V]`` (``"kv"``); returns o in v's dtype and, when
    asked, the final state in ``state_dtype`` (fp32 ``S32`` or bf16 ``S``). A lone last tile runs today's step
    (:func:`~.mirror.mirror_recurrence`'s).

    The training form (planned, W2 of perf-log v8) keeps, in slot ``h · slots + (g + s) // 2`` of the pair whose tile
    a is global tile ``g`` of sequence ``s`` (:func:`~cute_kda.workspace.pair_block_slots`; other rows are left as
    they are): ``checkpoints`` bf16 ``[H · slots, K, V]``, ``S = bf16(S32)`` entering the pair (or the lone tile);
    ``u_a`` bf16 ``[H · slots, V, 16]``, tile a's ``U`` value-major (``Uᵀ``; pairs with a tile b only). Kernel B
    rebuilds the state between the tiles from them (:func:`~.pair_backward.tile_states_of_pairs`)."""
    check_activations(v=v)
    ws = pws.ws
    batch, seq_len, heads, value_dim, tiles, key_dim, tile_map = scan_shape(ws, v, "v", cu_seqlens, state_layout)
    num_seqs = tile_map.tiles_per_seq.numel()

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(heads, tiles, *t.shape[1:])

    qd, kd, kr, gt, inv, mqk, beta = (per_head(t) for t in ws)
    p, cross_q = per_head(pws.cross_kd), per_head(pws.cross_qd)
    v_t = to_tiles(v.reshape(batch * seq_len, heads, value_dim).float(), tile_map)
    state32 = state_in(initial_state, "initial_state", state_layout, (num_seqs, heads, key_dim, value_dim),
                       torch.float32, v.device)
    out_t = torch.empty(heads, tiles + 1, CHUNK, value_dim, device=v.device, dtype=v.dtype)  # slot `tiles`: sink
    counts, starts = tile_map.tiles_per_seq, tile_map.bases[:-1]
    slots = pair_block_slots(tiles, num_seqs)
    kept_states = _kept(checkpoints, "checkpoints", heads, slots, (key_dim, value_dim))
    kept_u = _kept(u_a, "u_a", heads, slots, (value_dim, CHUNK))
    block, block_sink = pair_block_of(tile_map), torch.full_like(starts, slots)
    steps = int(((counts + 1) // 2).max().item()) if num_seqs else 0
    sink = torch.full_like(starts, tiles)
    for step in range(steps):
        a = starts + 2 * step
        active_a = 2 * step < counts
        active_b = 2 * step + 1 < counts
        sa = torch.where(active_a, a, torch.zeros_like(a)).clamp(max=max(tiles - 1, 0))
        sb = torch.where(active_b, a + 1, sa)
        S = state32.bfloat16()
        if kept_states is not None:
            kept_states.index_copy_(1, torch.where(active_a, block[sa], block_sink), S)
        U_a = mma(inv[:, sa], ((v_t[:, sa] - mma(kd[:, sa], S)) * beta[:, sa][..., None]).bfloat16()).bfloat16()
        if kept_u is not None:
            kept_u.index_copy_(1, torch.where(active_b, block[sa], block_sink), U_a.transpose(-1, -2))
        o_a = mma(mqk[:, sa], U_a, c=mma(qd[:, sa], S)).to(v.dtype)
        kS_b = mma(torch.cat([kd[:, sb], p[:, sb]], -1), torch.cat([S, U_a], -2))
        U_b = mma(inv[:, sb], ((v_t[:, sb] - kS_b) * beta[:, sb][..., None]).bfloat16()).bfloat16()
        o_b = mma(torch.cat([mqk[:, sb], cross_q[:, sb], qd[:, sb]], -1), torch.cat([U_b, U_a, S], -2)).to(v.dtype)
        lone = mma(kr[:, sa].transpose(-1, -2), U_a, c=gt[:, sa][..., None] * state32)
        paired = mma(torch.cat([kr[:, sa], kr[:, sb]], -2).transpose(-1, -2), torch.cat([U_a, U_b], -2),
                     c=gt[:, sa][..., None] * state32)
        updated = torch.where(active_b[None, :, None, None], paired, lone)
        state32 = torch.where(active_a[None, :, None, None], updated, state32)
        out_t.index_copy_(1, torch.where(active_a, sa, sink), o_a)
        out_t.index_copy_(1, torch.where(active_b, sb, sink), o_b)
    for buffer, kept in ((checkpoints, kept_states), (u_a, kept_u)):
        if buffer is not None:
            buffer.copy_(kept[:, :slots].reshape(buffer.shape))
    o_rows = out_t[:, :tiles].reshape(heads, tiles * CHUNK, value_dim)[:, tile_map.row_of_token]
    out = o_rows.movedim(0, 1).reshape(batch, seq_len, heads, value_dim)
    if not output_final_state:
        return out, None
    final = state32.bfloat16() if state_dtype == torch.bfloat16 else state32
    return out, state_out(final.movedim(1, 0), state_layout, state_dtype)


class PairScanResult(NamedTuple):
    """The pair scan's outputs: du, dv bf16 ``[B, T, H, V]``; dh0 fp32 ``[N, H, V, K]`` (v-first)."""

    du: torch.Tensor
    dv: torch.Tensor
    dh0: torch.Tensor


def mirror_bwd_scan_pairs(pws: PairWorkspace, do: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                          dht: torch.Tensor | None = None, snapshots: torch.Tensor | None = None) -> PairScanResult:
    """Kernel A's pair step over ``pws``, the adjoint of :func:`mirror_recurrence_pairs` (docs/numerics.md, "Two
    tiles a serial step"), with the rounding of today's scan (:func:`~.chains.reverse_scan`): a pair walked b then a
    from the ``dS'`` leaving it (``dS32`` fp32, its bf16 rounding the operand)::

        dU_b = Mqk_bᵀ·dO_b + kr_b·dS',  du_b = INV_bᵀ·dU_b,  dv_b = bf16(β_b ⊙ du_b)
        dU_a = Mqk_aᵀ·dO_a + kr_a'·dS' + Qᵀ·dO_b − Pᵀ·dv_b,  du_a, dv_a likewise
        dS32 ← qd_aᵀ·dO_a − kd_aᵀ·dv_a + qd_b'ᵀ·dO_b − kd_b'ᵀ·dv_b + f32(gT_pair·dS32)   (one block update)

    A lone last tile runs today's step. The gradient between a pair's tiles is not formed: the training form (W2)
    keeps ``snapshots`` bf16 ``[H · slots, K, V]``, ``dS' = bf16(dS32)`` leaving each pair (or lone tile), in the
    pair's slot of :func:`~cute_kda.workspace.pair_block_slots` (other rows are left as they are)."""
    ws = pws.ws
    batch, seq_len, heads, value_dim, tiles, key_dim, tile_map = scan_shape(ws, do, "do", cu_seqlens, "vk")
    num_seqs = tile_map.tiles_per_seq.numel()

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(heads, tiles, *t.shape[1:])

    qd, kd, kr, gt, inv, mqk, beta = (per_head(t) for t in ws)
    p, cross_q = per_head(pws.cross_kd), per_head(pws.cross_qd)
    do_t = to_tiles(do.reshape(batch * seq_len, heads, value_dim).bfloat16(), tile_map)
    state32 = state_in(dht, "dht", "vk", (num_seqs, heads, key_dim, value_dim), torch.float32, do.device)
    du_t = torch.empty(heads, tiles + 1, CHUNK, value_dim, device=do.device, dtype=torch.bfloat16)
    dv_t = torch.empty_like(du_t)
    counts, starts = tile_map.tiles_per_seq, tile_map.bases[:-1]
    slots = pair_block_slots(tiles, num_seqs)
    kept = _kept(snapshots, "snapshots", heads, slots, (key_dim, value_dim))
    block, block_sink = pair_block_of(tile_map), torch.full_like(starts, slots)
    steps = int(((counts + 1) // 2).max().item()) if num_seqs else 0
    sink = torch.full_like(starts, tiles)
    for step in range(steps):
        pairs = (counts + 1) // 2
        j = pairs - 1 - step  # this step's pair of each sequence, from the last
        active_a = j >= 0
        active_b = active_a & (2 * j + 1 < counts)
        sa = torch.where(active_a, starts + 2 * j, torch.zeros_like(j)).clamp(max=max(tiles - 1, 0))
        sb = torch.where(active_b, sa + 1, sa)
        S = state32.bfloat16()
        if kept is not None:
            kept.index_copy_(1, torch.where(active_a, block[sa], block_sink), S)
        dO_a, dO_b = do_t[:, sa], do_t[:, sb]
        dU_b = mma(torch.cat([mqk[:, sb].transpose(-1, -2), kr[:, sb]], -1), torch.cat([dO_b, S], -2)).bfloat16()
        du_b = mma(inv[:, sb].transpose(-1, -2), dU_b)
        dv_b = (beta[:, sb][..., None] * du_b).bfloat16()
        # a lone tile: today's step on tile a (no pair terms)
        b_on = active_b[None, :, None, None]
        cross = torch.where(b_on, torch.cat([cross_q[:, sb].transpose(-1, -2), p[:, sb].transpose(-1, -2)], -1),
                            torch.zeros(heads, num_seqs, CHUNK, 2 * CHUNK, dtype=torch.bfloat16, device=do.device))
        dU_a = mma(torch.cat([mqk[:, sa].transpose(-1, -2), kr[:, sa], cross], -1),
                   torch.cat([dO_a, S, dO_b, -dv_b], -2)).bfloat16()
        du_a = mma(inv[:, sa].transpose(-1, -2), dU_a)
        dv_a = (beta[:, sa][..., None] * du_a).bfloat16()
        lone = mma(torch.cat([qd[:, sa], kd[:, sa]], -2).transpose(-1, -2), torch.cat([dO_a, -dv_a], -2),
                   c=gt[:, sa][..., None] * state32)
        paired = mma(torch.cat([qd[:, sa], kd[:, sa], qd[:, sb], kd[:, sb]], -2).transpose(-1, -2),
                     torch.cat([dO_a, -dv_a, dO_b, -dv_b], -2), c=gt[:, sa][..., None] * state32)
        updated = torch.where(b_on, paired, lone)
        state32 = torch.where(active_a[None, :, None, None], updated, state32)
        du_t.index_copy_(1, torch.where(active_a, sa, sink), du_a.bfloat16())
        dv_t.index_copy_(1, torch.where(active_a, sa, sink), dv_a)
        du_t.index_copy_(1, torch.where(active_b, sb, sink), du_b.bfloat16())
        dv_t.index_copy_(1, torch.where(active_b, sb, sink), dv_b)
    if snapshots is not None:
        snapshots.copy_(kept[:, :slots].reshape(snapshots.shape))

    def untile(t: torch.Tensor) -> torch.Tensor:
        rows = t[:, :tiles].reshape(heads, tiles * CHUNK, value_dim)[:, tile_map.row_of_token]
        return rows.movedim(0, 1).reshape(batch, seq_len, heads, value_dim)

    return PairScanResult(untile(du_t), untile(dv_t), state32.movedim(1, 0).transpose(-1, -2).contiguous())


def mirror_forward_pairs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, gate: str = "safe",
    cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    state_dtype: torch.dtype | None = None, state_layout: str = "vk", **k1_options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~.mirror.mirror_forward` of the two-tile prefill (the same arguments): :func:`mirror_prepare_pairs` for
    the safe gate or :func:`mirror_prepare_pairs_per_head` for a per-head g ``[B, T, HV]``, then
    :func:`mirror_recurrence_pairs` — what the kernels run where :func:`cute_kda.variants.pair_prefill` says."""
    if gate == "safe":
        pws = mirror_prepare_pairs(q, k, g, beta, cu_seqlens=cu_seqlens, **k1_options)
    elif g.dim() == 3:
        pws = mirror_prepare_pairs_per_head(q, k, g, beta, gate=gate, cu_seqlens=cu_seqlens, **k1_options)
    else:
        raise ValueError(f"the two-tile prefill is built for the safe gate and per-head gates, not {gate!r} per "
                         "channel")
    if state_dtype is None:
        state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    return mirror_recurrence_pairs(pws, v, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                   output_final_state=output_final_state, state_dtype=state_dtype,
                                   state_layout=state_layout)
