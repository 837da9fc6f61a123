"""The backward kernels' chains in either arithmetic (:data:`~.common.KERNEL`: their rounding;
:data:`~.common.EXACT`: float64 throughout): the reverse state-gradient scan (Kernel A, docs/numerics.md,
"Backward: Kernel A") and the per-tile gradients of the safe gate (Kernel B, "Backward: Kernel B").

One chain per kernel serves its mirror (:mod:`.backward`) and its exact counterpart (:mod:`.exact`), so the two
differ by rounding only. Kernel A needs no forward state: dv and the state gradients are linear in dO and dht and do
not depend on S (the recurrence is affine in S). Kernel B does: it reads the state entering each tile.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..executors.stages import GradsResult
from ..workspace import CHUNK, Workspace, snapshot_slots, tiles_per_head
from .common import (
    PER_TILE, Arithmetic, TileMap, scan_shape, state_in, state_out, tile_blocks, tile_map_of, to_tiles,
)

# ---------------------------------------------------------------------------------------------
# Kernel A


class BwdScanResult(NamedTuple):
    """Outputs of the reverse state-gradient scan.

    du, dv ``[B, T, H, V]``; dh0 ``[N, H, V, K]`` ("vk") or ``[N, H, K, V]`` ("kv"); snapshots
    ``[H·slots, K, V]`` (``slots = snapshot_slots(tiles, N, snapshot_every)``): row
    ``h·slots + g // snapshot_every + s`` holds the gradient w.r.t. the state after global tile ``g``
    (workspace numbering) of sequence ``s``, for every ``g`` that ends a block of ``snapshot_every``
    global tiles or ends its sequence, as ``snapshots[row, k, v]``; the other rows are NaN.
    """

    du: torch.Tensor
    dv: torch.Tensor
    dh0: torch.Tensor
    snapshots: torch.Tensor


def reverse_scan(
    ws: Workspace,
    do: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    dht: torch.Tensor | None,
    state_layout: str,
    arith: Arithmetic,
    snapshot_every: int,
    dh0_dtype: torch.dtype,
) -> BwdScanResult:
    """The Kernel A chain (docs/numerics.md) in ``arith``; dh0 is its band after the first tile in ``dh0_dtype``."""
    batch, seq_len, heads, value_dim, tiles, key_dim, tile_map = scan_shape(ws, do, "do", cu_seqlens, state_layout)
    device = do.device
    num_seqs = tile_map.tiles_per_seq.numel()

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return arith.load(t).view(heads, tiles, *t.shape[1:])

    qd, kd, kr, gt, inv, mqk, beta = (per_head(t) for t in ws)
    # tail rows of dO are 0 here; in the kernel they meet the exact zeros of their Mqk and qd rows
    do_t = to_tiles(do.reshape(batch * seq_len, heads, value_dim).to(arith.dtype), tile_map)  # [H, tiles, 16, V]

    # dS32: the band in the kernel's fp32 registers; dS = store(dS32): its bf16 copy, the products' operand
    state32 = state_in(dht, "dht", state_layout, (num_seqs, heads, key_dim, value_dim), arith.work, device)
    state = arith.store(state32)

    # slot `tiles` (`slots` for snapshots) is a sink for the writes of sequences that have no tile at this step
    slots = snapshot_slots(tiles, num_seqs, snapshot_every)
    seq_index = torch.arange(num_seqs, device=device)
    snapshots = torch.full((heads, slots + 1, key_dim, value_dim), math.nan, device=device, dtype=arith.dtype)
    du_t = torch.empty(heads, tiles + 1, CHUNK, value_dim, device=device, dtype=arith.dtype)
    dv_t = torch.empty_like(du_t)
    counts, firsts = tile_map.tiles_per_seq, tile_map.bases[:-1]
    steps = int(counts.max().item()) if num_seqs else 0
    for step in range(steps):
        active = step < counts  # [N]
        slot = (firsts + torch.clamp(counts - 1 - step, min=0)).clamp(max=max(tiles - 1, 0))
        target = torch.where(active, slot, torch.full_like(slot, tiles))
        # a snapshot where the global tile ends a block of `snapshot_every`, or ends its sequence (step 0)
        keep = active & ((slot % snapshot_every == snapshot_every - 1) | (step == 0))
        snapshots.index_copy_(1, torch.where(keep, slot // snapshot_every + seq_index, torch.full_like(slot, slots)),
                              state)
        dO = do_t[:, slot]  # [H, N, 16, V]
        # both sums of dU (and of W) run in one accumulator: one matmul over the joined contraction
        dU = arith.store(arith.mma(torch.cat([mqk[:, slot].transpose(-1, -2), kr[:, slot]], -1),
                                   torch.cat([dO, state], -2)))
        du = arith.mma(inv[:, slot].transpose(-1, -2), dU)
        dv = arith.store(beta[:, slot][..., None] * du)
        updated = arith.mma(torch.cat([qd[:, slot], kd[:, slot]], -2).transpose(-1, -2), torch.cat([dO, -dv], -2),
                            c=gt[:, slot][..., None] * state32)
        state32 = torch.where(active[None, :, None, None], updated, state32)
        state = arith.store(state32)
        du_t.index_copy_(1, target, arith.store(du))
        dv_t.index_copy_(1, target, dv)

    def untile(t: torch.Tensor) -> torch.Tensor:
        rows = t[:, :tiles].reshape(heads, tiles * CHUNK, value_dim)[:, tile_map.row_of_token]
        return rows.movedim(0, 1).reshape(batch, seq_len, heads, value_dim)

    snapshot_rows = snapshots[:, :slots].reshape(heads * slots, key_dim, value_dim)
    return BwdScanResult(untile(du_t), untile(dv_t), state_out(state32.movedim(1, 0), state_layout, dh0_dtype),
                         snapshot_rows)


# ---------------------------------------------------------------------------------------------
# Kernel B


class GradConstants(NamedTuple):
    """Kernel B's scalars: ``scale``, ``c_gate`` (= lower_bound·log2 e, the base-2 gate's factor), ln 2."""

    scale: float
    c_gate: float
    ln2: float


# K1's values by a chain's own arithmetic (the mirror's or float64), from (q, k, g, beta, A_log, dt_bias,
# lower_bound, scale, tile_map, qk_l2norm, beta_logits): the fields of TileOperands it recomputes, and the constants
Recompute = Callable[..., tuple[dict[str, torch.Tensor | None], GradConstants]]


class TileOperands(NamedTuple):
    """What Kernel B holds for every (head, tile) slot, ``[H, tiles, 16, ...]`` in the chain's types.

    Recomputed (K1's values): qhat, khat ``[.., 16, K]`` l2-normalised q, k without the scale and
    rinv_q, rinv_k ``[.., 16, 1]`` (all None without the l2norm); x, dsig ``[.., 16, K]`` the gate's
    argument and the sigmoid's derivative σ(x)·σ(−x); e_a ``[H]``; decay = 2^G, decay_inv = 2^-G, decay_rest = 2^(G_last − G);
    qd, kd, kinv, kr ``[.., 16, K]``. Read: gt ``[.., K]``, inv, mqk ``[.., 16, 16]``, beta ``[.., 16]``
    (workspace); v, do, du ``[.., 16, V]``; S (entering the tile), dS (w.r.t. the state after it)
    ``[.., K, V]``. valid bool ``[tiles, 16]``: the row holds a token. Slots that are no tile are 0.
    """

    qhat: torch.Tensor | None
    khat: torch.Tensor | None
    rinv_q: torch.Tensor | None
    rinv_k: torch.Tensor | None
    x: torch.Tensor
    dsig: torch.Tensor
    e_a: torch.Tensor
    decay: torch.Tensor
    decay_inv: torch.Tensor
    decay_rest: torch.Tensor
    qd: torch.Tensor
    kd: torch.Tensor
    kinv: torch.Tensor
    kr: torch.Tensor
    gt: torch.Tensor
    inv: torch.Tensor
    mqk: torch.Tensor
    beta: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    du: torch.Tensor
    S: torch.Tensor
    dS: torch.Tensor
    valid: torch.Tensor


class _TileGrads(NamedTuple):
    """Kernel B's outputs per slot: dq, dk, dg ``[H, tiles, 16, K]``, dbeta ``[H, tiles, 16]``
    (rows without a token unspecified), ddt_partial ``[H, tiles, K]``, dalog_partial ``[H, tiles]``."""

    dq: torch.Tensor
    dk: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    ddt_partial: torch.Tensor
    dalog_partial: torch.Tensor


def forward_recompute(ops: TileOperands, arith: Arithmetic) -> tuple[torch.Tensor, torch.Tensor]:
    """K2's w = v − kd·S (fp32) and U = bf16(INV·bf16(w·β)) of every slot, ``[H, tiles, 16, V]``."""
    w = ops.v.to(arith.work) - arith.mma(ops.kd, ops.S)
    return w, arith.store(arith.mma(ops.inv, arith.store(w * ops.beta[..., None])))


def _tile_grads(ops: TileOperands, consts: GradConstants, arith: Arithmetic, qk_l2norm: bool,
                beta_logits: bool) -> _TileGrads:
    """The per-tile gradients of the contract, every slot at once, rounded as ``arith`` says."""
    def widen(t: torch.Tensor) -> torch.Tensor:
        return t.to(arith.work)

    def mma_pair(a1: torch.Tensor, b1: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        # a1·b1 + a2·b2 in one accumulator: one matmul over the joined contraction
        return arith.mma(torch.cat([a1, a2], -1), torch.cat([b1, b2], -2))

    beta = ops.beta[..., None]
    S_t, dS_t = ops.S.transpose(-1, -2), ops.dS.transpose(-1, -2)
    w, U = forward_recompute(ops, arith)
    U_t = U.transpose(-1, -2)

    dMqk = arith.store(torch.tril(arith.mma(ops.do, U_t)))
    dL = torch.tril(-arith.mma(ops.du, U_t), diagonal=-1)
    dLb = arith.store(beta * dL)
    du = widen(ops.du)
    bdu = arith.store(beta * du)
    dqd = mma_pair(ops.do, S_t, dMqk, ops.kinv)
    dkd = mma_pair(-bdu, S_t, dLb, ops.kinv)
    dkinv = mma_pair(dMqk.transpose(-1, -2), ops.qd, dLb.transpose(-1, -2), ops.kd)
    dkr = arith.mma(U, dS_t)
    dgT = arith.dot(ops.S, ops.dS, -1)  # [H, tiles, K]
    A = arith.mma(ops.kd, ops.kinv.transpose(-1, -2))
    dbeta_act = arith.dot(torch.cat([du, dL], -1), torch.cat([w, A], -1), -1)

    dqh = dqd * ops.decay * consts.scale
    dkh = dkd * ops.decay + dkinv * ops.decay_inv + dkr * ops.decay_rest
    dG = consts.ln2 * (dqd * widen(ops.qd) + dkd * widen(ops.kd) - dkinv * widen(ops.kinv) - dkr * widen(ops.kr))
    dG_last = consts.ln2 * arith.dot(torch.cat([dkr, dgT[:, :, None]], 2),
                                     torch.cat([widen(ops.kr), ops.gt[:, :, None]], 2), 2)
    suffix = [dG[:, :, CHUNK - 1]]  # Σ_{s ≥ r} dG[s], added from the last row up
    for r in range(CHUNK - 2, -1, -1):
        suffix.append(suffix[-1] + dG[:, :, r])
    dgp = torch.stack(suffix[::-1], dim=2) + dG_last[:, :, None]

    dx = dgp * consts.c_gate * ops.dsig
    dg = dx * ops.e_a[:, None, None, None]
    if qk_l2norm:
        dq = ops.rinv_q * (dqh - ops.qhat * arith.dot(ops.qhat, dqh, -1)[..., None])
        dk = ops.rinv_k * (dkh - ops.khat * arith.dot(ops.khat, dkh, -1)[..., None])
    else:
        dq, dk = dqh, dkh
    dbeta = dbeta_act * ops.beta * (1 - ops.beta) if beta_logits else dbeta_act

    valid = widen(ops.valid)[None, :, :, None]  # rows without a token add nothing to the partials
    ddt_partial = arith.dot(dg, valid, 2)
    dalog_partial = arith.dot(dx * valid, ops.x, (2, 3))
    return _TileGrads(arith.store(dq), arith.store(dk), arith.store(dg), arith.store(dbeta), ddt_partial,
                      dalog_partial)


def tile_operands(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    du: torch.Tensor, ws: Workspace, states: torch.Tensor, state_grads: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, scale: float | None, lower_bound: float, cu_seqlens: torch.Tensor | None,
    qk_l2norm: bool, beta_logits: bool, arith: Arithmetic, recompute: Recompute,
) -> tuple[TileOperands, GradConstants, TileMap]:
    """Checks the shapes, then gathers Kernel B's operands of every slot (K1's values from ``recompute``)."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    for name, x in (("k", k), ("g", g)):
        if x.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, q {tuple(q.shape)}")
    for name, x in (("do", do), ("du", du)):
        if x.shape != v.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, v {tuple(v.shape)}")
    if v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} and beta {tuple(beta.shape)} do not fit q {tuple(q.shape)}")
    if A_log.numel() != heads or dt_bias.numel() != heads * key_dim:
        raise ValueError(f"A_log {tuple(A_log.shape)} / dt_bias {tuple(dt_bias.shape)} do not fit "
                         f"H={heads}, K={key_dim}")
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    tiles = tiles_per_head(batch * seq_len, num_seqs, cu_seqlens is not None)
    if tuple(ws.qd.shape) != (heads * tiles, CHUNK, key_dim):
        raise ValueError(f"workspace {tuple(ws.qd.shape)} does not fit q {tuple(q.shape)}")
    blocks = (heads * snapshot_slots(tiles, num_seqs, PER_TILE), key_dim, value_dim)
    for name, x in (("states", states), ("state_grads", state_grads)):
        if tuple(x.shape) != blocks:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, per-tile blocks are {blocks}")
    tile_map = tile_map_of(cu_seqlens, batch, seq_len, tiles, q.device)
    recomputed, consts = recompute(q, k, g, beta, A_log, dt_bias, lower_bound,
                                   key_dim ** -0.5 if scale is None else scale, tile_map, qk_l2norm, beta_logits)
    exists = tile_map.slot_exists

    def per_head(t: torch.Tensor) -> torch.Tensor:
        t = arith.load(t).view(heads, tiles, *t.shape[1:])  # no-tile slots are NaN in the workspace: zero them
        return torch.where(exists.reshape(1, tiles, *([1] * (t.dim() - 2))), t, torch.zeros_like(t))

    def tokens(t: torch.Tensor) -> torch.Tensor:
        # an fp16 v stays fp16: Kernel B widens it exactly where it widens bf16 (w = v − kd·S in fp32)
        dtype = t.dtype if t.dtype == torch.float16 else arith.dtype
        return to_tiles(t.reshape(batch * seq_len, heads, value_dim).to(dtype), tile_map)

    ops = TileOperands(
        **recomputed, gt=per_head(ws.gt), inv=per_head(ws.inv), mqk=per_head(ws.mqk), beta=per_head(ws.beta),
        v=tokens(v), do=tokens(do), du=tokens(du), S=tile_blocks(states, heads, tile_map, arith),
        dS=tile_blocks(state_grads, heads, tile_map, arith), valid=tile_map.token_of_row < batch * seq_len,
    )
    return ops, consts, tile_map


def bwd_grads(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    du: torch.Tensor, ws: Workspace, states: torch.Tensor, state_grads: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, scale: float | None, lower_bound: float, cu_seqlens: torch.Tensor | None,
    qk_l2norm: bool, beta_logits: bool, arith: Arithmetic, recompute: Recompute,
) -> GradsResult:
    """Kernel B over every (head, tile) slot in ``arith``; the partials reduced over the tiles."""
    ops, consts, tile_map = tile_operands(q, k, g, beta, v, do, du, ws, states, state_grads, A_log, dt_bias, scale,
                                          lower_bound, cu_seqlens, qk_l2norm, beta_logits, arith, recompute)
    grads = _tile_grads(ops, consts, arith, qk_l2norm, beta_logits)
    heads, tiles = ops.qd.shape[:2]

    def untile(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        rows = t.reshape(heads, tiles * CHUNK, *t.shape[3:])[:, tile_map.row_of_token]
        return rows.movedim(0, 1).reshape(shape)

    # the reduction over tiles: one fixed-order sum (no atomics), rounded once
    one = torch.ones((), dtype=arith.work, device=q.device)
    return GradsResult(untile(grads.dq, q.shape), untile(grads.dk, q.shape), untile(grads.dg, q.shape),
                       untile(grads.dbeta, beta.shape), arith.dot(grads.dalog_partial, one, 1),
                       arith.dot(grads.ddt_partial, one, 1))


def gradient_dict(grads: GradsResult, scan: BwdScanResult, dt_bias: torch.Tensor | None,
                  initial_state: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The chain's gradients by :func:`~.gold.gold_backward`'s keys (ddt_bias in dt_bias's shape; dh0 None without
    an initial state)."""
    ddt_bias = None if grads.ddt_bias is None else grads.ddt_bias.reshape(dt_bias.shape)
    return {"dq": grads.dq, "dk": grads.dk, "dv": scan.dv, "dg": grads.dg, "dbeta": grads.dbeta,
            "dA_log": grads.dA_log, "ddt_bias": ddt_bias, "dh0": None if initial_state is None else scan.dh0}


