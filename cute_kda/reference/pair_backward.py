"""The training form of the two-tile step (W2 of docs/perf-log.md v8; planned, no kernel yet): the training forward's
pair K2 keeps one state a pair, Kernel A's pair step one state gradient a pair, and Kernel B, still a CTA a tile,
rebuilds the matrix of the pair's other end from them (docs/numerics.md, "Two tiles a serial step").

For a pair (a, b) K2 keeps ``S_a`` (entering the pair) and tile a's ``U_a``, Kernel A keeps ``dS'_b`` (leaving
it). Tile a's CTA reads ``S_a`` as today and forms ``dS'_a`` by Kernel A's step of tile b; tile b's CTA reads
``dS'_b`` as today and forms ``S_b`` by K2's step of tile a. Both steps take the other tile's tile-relative fields,
which Kernel B recomputes from the raw inputs as it does its own tile's; the pair-relative workspace serves the two
scans only. Half the kept matrices of today's per-tile form, and Kernel B's per-tile arithmetic unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..workspace import CHUNK, Workspace, pair_block_slots, snapshot_slots
from .backward import mirror_bwd_grads
from .chains import BwdScanResult, gradient_dict
from .common import PER_TILE, mma, scan_shape, state_out, to_tiles
from .gates import mirror_prepare_gates
from .mirror import mirror_prepare
from .pairs import (
    mirror_bwd_scan_pairs, mirror_prepare_pairs, mirror_prepare_pairs_dyadic, mirror_prepare_pairs_per_head,
    mirror_recurrence_pairs, pair_block_of, pair_roles,
)


def tile_states_of_pairs(
    ws: Workspace, checkpoints: torch.Tensor, snapshots: torch.Tensor, u_a: torch.Tensor, do: torch.Tensor,
    dv: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel B's per-tile matrices from the pair form's kept ones: ``(states, state_grads)`` bf16 ``[H · slots, K, V]``
    (``slots = snapshot_slots(tiles, N, 1)``, slot ``g + s``: what :func:`~.backward.mirror_bwd_grads` takes; rows of
    no tile NaN).

    ``ws``: today's tile-relative workspace (K1's fields, bit-identical to what Kernel B recomputes); ``checkpoints``,
    ``snapshots`` bf16 ``[H · pair_slots, K, V]`` and ``u_a`` bf16 ``[H · pair_slots, V, 16]`` (``Uᵀ``) as
    :func:`~.pairs.mirror_recurrence_pairs` and :func:`~.pairs.mirror_bwd_scan_pairs` keep them; ``do``, ``dv`` bf16
    ``[B, T, H, V]`` (dO and Kernel A's dv). In a pair (a, b), with the bf16 kept matrices widened::

        S_b   = bf16(kr_aᵀ·U_a + f32(gT_a·S_a))                   K2's step of tile a, its C from the checkpoint
        dS'_a = bf16(qd_bᵀ·dO_b − kd_bᵀ·dv_b + f32(gT_b·dS'_b))   Kernel A's step of tile b, from the snapshot

    each one fp32 accumulator rounded once; ``S_a`` and ``dS'_b`` (and a lone tile's two) are the kept matrices."""
    batch, seq_len, heads, value_dim, tiles, key_dim, tile_map = scan_shape(ws, do, "do", cu_seqlens, "kv")
    num_seqs = tile_map.tiles_per_seq.numel()
    pair_slots = pair_block_slots(tiles, num_seqs)

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(heads, tiles, *t.shape[1:])

    def kept(t: torch.Tensor) -> torch.Tensor:
        return t.view(heads, pair_slots, *t.shape[1:])[:, pair_block_of(tile_map)]  # [H, tiles, ...]

    qd, kd, kr, gt = (per_head(t) for t in (ws.qd, ws.kd, ws.kr, ws.gt))
    S, dS, U = kept(checkpoints), kept(snapshots), kept(u_a).transpose(-1, -2)
    do_t, dv_t = (to_tiles(t.reshape(batch * seq_len, heads, value_dim), tile_map) for t in (do, dv))
    is_a, is_b = pair_roles(tile_map, tiles)
    a, b = torch.nonzero(is_a).flatten(), torch.nonzero(is_b).flatten()  # a[i] + 1 == b[i]
    states, grads = S.clone(), dS.clone()
    states[:, b] = mma(kr[:, a].transpose(-1, -2), U[:, a], c=gt[:, a][..., None] * S[:, a].float()).bfloat16()
    grads[:, a] = mma(torch.cat([qd[:, b], kd[:, b]], -2).transpose(-1, -2), torch.cat([do_t[:, b], -dv_t[:, b]], -2),
                      c=gt[:, b][..., None] * dS[:, b].float()).bfloat16()
    slots = snapshot_slots(tiles, num_seqs, PER_TILE)
    tile = torch.arange(tiles, device=do.device)
    seq = torch.searchsorted(tile_map.bases[1:], tile, right=True).clamp(max=max(num_seqs - 1, 0))
    out = []
    for per_tile in (states, grads):
        blocks = torch.full((heads, slots, key_dim, value_dim), math.nan, dtype=torch.bfloat16, device=do.device)
        real = torch.nonzero(tile_map.slot_exists).flatten()
        blocks[:, tile[real] + seq[real]] = per_tile[:, real]
        out.append(blocks.reshape(heads * slots, key_dim, value_dim))
    return out[0], out[1]


def mirror_backward_pairs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor, *,
    dht: torch.Tensor | None = None, gate: str = "safe", initial_state: torch.Tensor | None = None,
    state_layout: str = "vk", cu_seqlens: torch.Tensor | None = None, **k1_options: Any,
) -> dict[str, torch.Tensor | None]:
    """:func:`~.backward.mirror_backward` (the same arguments and result) in the pair form: the pair K1 of the gate's
    scheme → :func:`~.pairs.mirror_recurrence_pairs` keeping a checkpoint and ``U_a`` a pair →
    :func:`~.pairs.mirror_bwd_scan_pairs` keeping a snapshot a pair → :func:`tile_states_of_pairs` → Kernel B
    (:func:`~.backward.mirror_bwd_grads`) over today's tile-relative workspace."""
    value_heads, value_dim = v.shape[2], v.shape[3]
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    options = dict(cu_seqlens=cu_seqlens, **k1_options)
    if gate == "safe":
        ws, pws = mirror_prepare(q, k, g, beta, **options), mirror_prepare_pairs(q, k, g, beta, **options)
    else:
        ws = mirror_prepare_gates(q, k, g, beta, gate=gate, **options)
        prepare_pairs = mirror_prepare_pairs_per_head if g.dim() == 3 else mirror_prepare_pairs_dyadic
        pws = prepare_pairs(q, k, g, beta, gate=gate, **options)
    tiles = ws.qd.shape[0] // value_heads
    rows = value_heads * pair_block_slots(tiles, num_seqs)
    checkpoints, snapshots = (torch.full((rows, value_dim, value_dim), math.nan, dtype=torch.bfloat16,
                                         device=q.device) for _ in range(2))
    u_a = torch.full((rows, value_dim, CHUNK), math.nan, dtype=torch.bfloat16, device=q.device)
    mirror_recurrence_pairs(pws, v, cu_seqlens=cu_seqlens, initial_state=initial_state, state_layout=state_layout,
                            checkpoints=checkpoints, u_a=u_a)
    dht_vk = dht.transpose(-1, -2) if dht is not None and state_layout == "kv" else dht
    scan = mirror_bwd_scan_pairs(pws, do, cu_seqlens=cu_seqlens, dht=dht_vk, snapshots=snapshots)
    states, state_grads = tile_states_of_pairs(ws, checkpoints, snapshots, u_a, do, scan.dv, cu_seqlens=cu_seqlens)
    grads = mirror_bwd_grads(q, k, g, beta, v, do, scan.du, ws, states, state_grads, gate=gate, **options)
    dh0_dtype = torch.float32 if initial_state is None else initial_state.dtype
    dh0 = state_out(scan.dh0.transpose(-1, -2), state_layout, dh0_dtype)  # v-first [N, H, V, K] → [N, H, K, V] first
    return gradient_dict(grads, BwdScanResult(scan.du, scan.dv, dh0, snapshots), k1_options.get("dt_bias"),
                         initial_state)
