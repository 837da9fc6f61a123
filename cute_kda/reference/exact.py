"""The exact chains: the kernels' formulas in float64 with no rounding at all, over exact chunk quantities.

Each equals the gold (:mod:`.gold`) to fp64 precision, which proves the chain's formulas; the mirrors
(:mod:`.mirror`, :mod:`.gates`, :mod:`.backward`) then differ from it by rounding only.

- The safe gate's chain (the kinv form of docs/numerics.md, K1): :func:`prepare_exact` (K1),
  :func:`chunk_fwd_states_exact` (K2, keeping the state entering every tile), :func:`chunk_bwd_scan_exact`
  (Kernel A), :func:`chunk_bwd_grads_exact` (Kernel B) and the whole backward :func:`chunk_backward_exact`. The
  kinv form overflows once a channel decays by more than e^709 within a tile (a −1000 mask): the safe gate's
  lower bound keeps it far from that.
- Every gate, by the pair-decay formulation of docs/numerics.md ("Unbounded gates"): every pair's decay from the
  tokens between its two rows only, ``E_ijc = exp(Σ_{s=j+1..i} γ_sc) ≤ 1`` (γ the per-token log decay)::

      A_ij   = Σ_c k̂_ic k̂_jc E_ijc   (i > j)        L = β_i · A_ij
      Mqk_ij = Σ_c q̂s_ic k̂_jc E_ijc  (i ≥ j)        q̂s = q̂ · scale

  and every other K1 field from sums that never subtract (``γ ≤ 0``, so no cancellation either):
  ``qd = q̂s ⊙ e^P``, ``kd = k̂ ⊙ e^P`` with the prefix ``P_r = Σ_{s≤r} γ_s``, ``kr = k̂ ⊙ e^R`` with the suffix
  ``R_r = Σ_{s>r} γ_s``, ``gT = e^{P_15}``. :func:`tile_products` / :func:`tile_products_backward`: A and Mqk of
  a batch of tiles by that definition and their vector-Jacobian product; :func:`dyadic_tile_products` /
  :func:`dyadic_tile_products_backward`: the same through the dyadic scheme's four levels of matrix products
  (the tensor-core plan of K1 and Kernel B). :func:`prepare_gates_exact`: the K1 workspace for every gate form
  (safe, softplus, a precomputed log decay; per channel or per head) and grouped value heads;
  :func:`chunk_forward_gates_exact`, :func:`chunk_backward_gates_exact`: the whole forward and backward chain
  over it.

Shapes of the every-gate chain: q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; beta ``[B, T, HV]``; g
``[B, T, HV, K]`` (per-channel gate) or ``[B, T, HV]`` (per-head gate, GatedDeltaNet); HV a multiple of H (value
head ``j`` reads q/k head ``j // (HV / H)``). Workspaces are per value head: ``[HV · tiles, ...]``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..executors.stages import GradsResult
from ..numerics import DYADIC_BLOCKS
from ..workspace import CHUNK, SNAPSHOT_TILES, Workspace, snapshot_slots
from .chains import BwdScanResult, GradConstants, bwd_grads, gradient_dict, reverse_scan
from .common import (
    EXACT, PER_TILE, TileMap, crossing_rows, qk_backward, scan_shape, state_in, state_out, straddle_geometry,
    straddle_sums, tile_blocks, to_tiles, token_tile_map, untile, workspace_of_tiles,
)
from .gold import (
    L2NORM_EPS, channel_log_decay, expand_to_value_heads, value_head_group,
)


# ---------------------------------------------------------------------------------------------
# The safe gate's chain (kinv form)


def prepare_exact(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float | None = None,
    gate: str = "safe", A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0, qk_l2norm: bool = True, beta_logits: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> Workspace:
    """The workspace fields of K1 (docs/numerics.md) in float64, unrounded, from the inputs.

    Inputs and keywords as :func:`~.gold.gold_forward` (the gate, l2norm and β-sigmoid are its
    own functions, so every gate it knows works); q, k, g ``[B, T, H, K]``, beta ``[B, T, H]``.
    With the per-token log decay ``γ`` and ``G_r = Σ_{s≤r} γ_s`` within a tile (``e^G`` is the
    contract's ``2^G``): qd = q̂·scale·e^G, kd = k̂·e^G, kr = k̂·e^(G_last − G), gt = e^G_last,
    INV = (I + L)⁻¹ with L = stril(β · kd·kinvᵀ), kinv = k̂·e^(−G), Mqk = tril(qd·kinvᵀ).
    Rows past a sequence's end are 0 (γ = 0, β = 0), slots that are no tile NaN, as in K1.
    Returns a :class:`~cute_kda.workspace.Workspace` of float64 tensors with K1's shapes.
    """
    tokens = _exact_tokens(q, k, g, beta, scale=scale, gate=gate, A_log=A_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    tile_map = token_tile_map(q, cu_seqlens)
    q_t, k_t, beta_t = (to_tiles(x, tile_map) for x in (tokens.qs, tokens.kh, tokens.beta))
    G = torch.cumsum(to_tiles(tokens.gamma, tile_map), dim=2)  # [H, tiles, 16, K]
    G_last = G[:, :, -1:]
    qd, kd, kinv = q_t * G.exp(), k_t * G.exp(), k_t * (-G).exp()
    kr = k_t * (G_last - G).exp()
    L = torch.tril(beta_t[..., None] * (kd @ kinv.transpose(-1, -2)), diagonal=-1)
    eye = torch.eye(CHUNK, dtype=torch.float64, device=q.device)
    inv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    mqk = torch.tril(qd @ kinv.transpose(-1, -2))
    fields = {"qd": qd, "kd": kd, "kr": kr, "gt": G_last[:, :, 0].exp(), "inv": inv, "mqk": mqk, "beta": beta_t}
    return workspace_of_tiles(fields, tile_map)


class FwdStatesResult(NamedTuple):
    """Outputs of :func:`chunk_fwd_states_exact`.

    o ``[B, T, H, V]``; final_state ``[N, H, V, K]`` ("vk") or ``[N, H, K, V]`` ("kv"); states
    ``[H·slots, K, V]`` (``block_states_shape(ws, H, N, every=1)``): row ``h·slots + g + s`` is the
    state entering global tile ``g`` of sequence ``s``, as ``states[row, k, v]``; other rows NaN.
    """

    o: torch.Tensor
    final_state: torch.Tensor
    states: torch.Tensor


def chunk_fwd_states_exact(
    ws: Workspace, v: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, state_layout: str = "vk",
) -> FwdStatesResult:
    """The K2 chunk recurrence in float64 with no rounding, keeping the state entering every tile.

    ``ws``: workspace-shaped fields (:func:`prepare_exact`), widened to float64; v ``[B, T, H, V]`` and
    ``initial_state`` (``[N, H, V, K]`` for "vk", ``[N, H, K, V]`` for "kv") any float dtype. Per tile:
    u = (v − kd·S)·β, U = INV·u, o = qd·S + Mqk·U, S ← gT ⊙ S + krᵀ·U. Every output is float64
    (see :class:`FwdStatesResult`); an empty sequence keeps its initial state.
    """
    batch, seq_len, heads, value_dim, tiles, key_dim, tile_map = scan_shape(ws, v, "v", cu_seqlens, state_layout)
    device = v.device
    num_seqs = tile_map.tiles_per_seq.numel()
    qd, kd, kr, gt, inv, mqk, beta = (t.double().view(heads, tiles, *t.shape[1:]) for t in ws)
    v_t = to_tiles(v.reshape(batch * seq_len, heads, value_dim).double(), tile_map)

    state = state_in(initial_state, "initial_state", state_layout, (num_seqs, heads, key_dim, value_dim),
                     torch.float64, device)

    slots = snapshot_slots(tiles, num_seqs, 1)
    kept = torch.full((heads, slots + 1, key_dim, value_dim), math.nan, device=device, dtype=torch.float64)
    out_t = torch.zeros(heads, tiles + 1, CHUNK, value_dim, device=device, dtype=torch.float64)  # slot `tiles`: sink
    counts, firsts = tile_map.tiles_per_seq, tile_map.bases[:-1]
    seq_index = torch.arange(num_seqs, device=device)
    steps = int(counts.max().item()) if num_seqs else 0
    for step in range(steps):
        active = step < counts
        slot = (firsts + torch.clamp(counts - 1, min=0).clamp(max=step)).clamp(max=max(tiles - 1, 0))
        kept.index_copy_(1, torch.where(active, slot + seq_index, torch.full_like(slot, slots)), state)
        U = inv[:, slot] @ ((v_t[:, slot] - kd[:, slot] @ state) * beta[:, slot][..., None])
        out_t.index_copy_(1, torch.where(active, slot, torch.full_like(slot, tiles)),
                          qd[:, slot] @ state + mqk[:, slot] @ U)
        updated = gt[:, slot][..., None] * state + kr[:, slot].transpose(-1, -2) @ U
        state = torch.where(active[None, :, None, None], updated, state)

    o_rows = out_t[:, :tiles].reshape(heads, tiles * CHUNK, value_dim)[:, tile_map.row_of_token]
    o = o_rows.movedim(0, 1).reshape(batch, seq_len, heads, value_dim)
    states = kept[:, :slots].reshape(heads * slots, key_dim, value_dim)
    return FwdStatesResult(o, state_out(state.movedim(1, 0), state_layout, torch.float64), states)


def chunk_bwd_scan_exact(
    ws: Workspace, do: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, dht: torch.Tensor | None = None,
    state_layout: str = "vk", snapshot_every: int = SNAPSHOT_TILES,
) -> BwdScanResult:
    """The Kernel A chain of :func:`~.backward.mirror_bwd_scan` in float64 with no rounding at all.

    ``ws``: any workspace-shaped fields, widened to float64 — :func:`prepare_exact` for the exact
    chunk quantities (or a K1 workspace, to separate the scan's rounding from K1's). ``do``, ``dht``
    any float dtype, shapes as for :func:`~.backward.mirror_bwd_scan`. Every output is float64.
    """
    return reverse_scan(ws, do, cu_seqlens, dht, state_layout, EXACT, snapshot_every, torch.float64)


def _exact_recompute(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, lower_bound: float, scale: float, tile_map: TileMap, qk_l2norm: bool, beta_logits: bool,
) -> tuple[dict[str, torch.Tensor | None], GradConstants]:
    """The same values in float64, unrounded: the safe gate, gold's l2norm, exact exponentials."""
    batch, seq_len, heads, key_dim = q.shape
    q64, k64, g64 = (x.reshape(batch * seq_len, heads, key_dim).double() for x in (q, k, g))
    qhat = khat = rinv_q = rinv_k = None
    if qk_l2norm:
        rinv_q, rinv_k = (torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q64, k64))
        q64, k64 = q64 * rinv_q, k64 * rinv_k
        qhat, khat = to_tiles(q64, tile_map), to_tiles(k64, tile_map)
        rinv_q, rinv_k = to_tiles(rinv_q, tile_map), to_tiles(rinv_k, tile_map)
    c_gate = lower_bound * math.log2(math.e)
    e_a = torch.exp(A_log.double().reshape(heads))
    x = e_a[:, None] * (g64 + dt_bias.double().reshape(heads, key_dim))
    sig = torch.sigmoid(x)
    G = torch.cumsum(to_tiles(c_gate * sig, tile_map), dim=2)  # base 2; rows without a token add 0
    decay, decay_inv = torch.exp2(G), torch.exp2(-G)
    decay_rest = torch.exp2(G[:, :, -1:] - G)
    q_t, k_t = to_tiles(q64, tile_map), to_tiles(k64, tile_map)
    recomputed = dict(
        qhat=qhat, khat=khat, rinv_q=rinv_q, rinv_k=rinv_k, x=to_tiles(x, tile_map),
        dsig=to_tiles(sig * torch.sigmoid(-x), tile_map),
        e_a=e_a, decay=decay, decay_inv=decay_inv, decay_rest=decay_rest, qd=q_t * scale * decay,
        kd=k_t * decay, kinv=k_t * decay_inv, kr=k_t * decay_rest,
    )
    return recomputed, GradConstants(scale, c_gate, math.log(2.0))


def chunk_bwd_grads_exact(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    du: torch.Tensor, ws: Workspace, states: torch.Tensor, state_grads: torch.Tensor, *, A_log: torch.Tensor,
    dt_bias: torch.Tensor, scale: float | None = None, lower_bound: float = -5.0,
    cu_seqlens: torch.Tensor | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
) -> GradsResult:
    """The formulas of :func:`~.backward.mirror_bwd_grads` in float64 with no rounding at all (safe gate).

    Arguments as :func:`~.backward.mirror_bwd_grads`, any float dtype, widened to float64: ``ws`` from
    :func:`prepare_exact`, ``states`` from :func:`chunk_fwd_states_exact`, ``du`` and ``state_grads``
    from :func:`chunk_bwd_scan_exact` with ``snapshot_every=1``. Every output is float64.
    """
    return bwd_grads(q, k, g, beta, v, do, du, ws, states, state_grads, A_log, dt_bias, scale, lower_bound,
                     cu_seqlens, qk_l2norm, beta_logits, EXACT, _exact_recompute)


def chunk_backward_exact(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor, *,
    dht: torch.Tensor | None = None, A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float | None = None,
    lower_bound: float = -5.0, initial_state: torch.Tensor | None = None, state_layout: str = "vk",
    cu_seqlens: torch.Tensor | None = None, qk_l2norm: bool = True, beta_logits: bool = True,
) -> dict[str, torch.Tensor | None]:
    """:func:`~.backward.mirror_backward`'s chain in float64 with no rounding (safe gate), from any float inputs:
    :func:`prepare_exact` → :func:`chunk_fwd_states_exact` → :func:`chunk_bwd_scan_exact` →
    :func:`chunk_bwd_grads_exact`. Returns :func:`~.gold.gold_backward`'s keys, every gradient float64."""
    key_dim = q.shape[-1]
    scale = key_dim ** -0.5 if scale is None else scale
    ws = prepare_exact(q, k, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       qk_l2norm=qk_l2norm, beta_logits=beta_logits, cu_seqlens=cu_seqlens)
    forward = chunk_fwd_states_exact(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                     state_layout=state_layout)
    scan = chunk_bwd_scan_exact(ws, do, cu_seqlens=cu_seqlens, dht=dht, state_layout=state_layout,
                                snapshot_every=PER_TILE)
    grads = chunk_bwd_grads_exact(q, k, g, beta, v, do, scan.du, ws, forward.states, scan.snapshots, A_log=A_log,
                                  dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                                  qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    return gradient_dict(grads, scan, dt_bias, initial_state)


# ---------------------------------------------------------------------------------------------
# Every gate: the pair-decay formulation


def segment_log_decay(gamma: torch.Tensor) -> torch.Tensor:
    """``D[..., i, j, c] = Σ_{s=j+1..i} γ[..., s, c]`` for i ≥ j (0 for i ≤ j), from γ ``[..., 16, K]``.

    A running sum per column ``j`` over the rows below it, never a difference of prefix sums: with γ ≤ 0
    no term cancels, so ``D`` is accurate to its own size (a −1000 mask before both rows cannot smear it).
    Returns ``[..., 16, 16, K]``.
    """
    rows = gamma.shape[-2]
    below = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=gamma.device), diagonal=-1)  # s > j
    return torch.cumsum(gamma[..., :, None, :] * below[..., None], dim=-3)


def tile_products(
    qs: torch.Tensor, kh: torch.Tensor, gamma: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` (strictly lower) and ``Mqk`` (lower, diagonal kept) of tiles ``[..., 16, K]``, ``[..., 16, 16]``.

    qs = q̂·scale, kh = k̂, gamma = the per-token natural log decay of each row (0 on rows past a
    sequence's end). ``A_ij = Σ_c kh_ic kh_jc E_ijc``, ``Mqk_ij = Σ_c qs_ic kh_jc E_ijc`` with
    ``E = exp(segment_log_decay(gamma))`` — every factor ≤ 1. Differentiable.
    """
    rows = gamma.shape[-2]
    lower = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=gamma.device))
    decay = torch.where(lower[..., None], segment_log_decay(gamma).exp(), torch.zeros((), dtype=gamma.dtype))
    right = kh[..., None, :, :] * decay  # [..., i, j, c] = kh_jc E_ijc
    A = torch.tril(torch.einsum("...ic,...ijc->...ij", kh, right), diagonal=-1)
    Mqk = torch.einsum("...ic,...ijc->...ij", qs, right)
    return A, Mqk


def tile_products_backward(
    qs: torch.Tensor, kh: torch.Tensor, gamma: torch.Tensor, dA: torch.Tensor, dMqk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vector-Jacobian product of :func:`tile_products` by formulas: (dqs, dkh, dγ).

    ``dA`` (only i > j used) and ``dMqk`` (i ≥ j) ``[..., 16, 16]``. With the pair terms
    ``W_ijc = (dA_ij kh_ic + dMqk_ij qs_ic) kh_jc E_ijc`` (i > j):
    ``dqs_i = Σ_{j≤i} dMqk_ij kh_j E_ij``,
    ``dkh_i = Σ_{j<i} dA_ij kh_j E_ij + Σ_{j≥i} (dA_ji kh_j + dMqk_ji qs_j) E_ji`` (``dA_ii = 0``).
    W is the gradient w.r.t. the pair's log decay ``D_ij = G_i − G_j`` (``G_r = Σ_{s≤r} γ_s``), so
    ``dG_i = Σ_{j<i} W_ij − Σ_{j>i} W_ji`` and ``dγ_s = Σ_{r≥s} dG_r``. That suffix sum is evaluated as the
    *straddle sum* ``dγ_s = Σ_{i≥s>j} W_ij`` (the terms of pairs on one side of s cancel exactly), whose every
    term carries the decay of token s: a masked token (E = 0 across it) gets dγ = 0, not the rounding residue
    of a cancellation. Returns three ``[..., 16, K]`` tensors; none of them forms ``e^{−G}``.
    """
    rows = gamma.shape[-2]
    lower = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=gamma.device))
    strict = torch.tril(lower, diagonal=-1)
    decay = torch.where(lower[..., None], segment_log_decay(gamma).exp(), torch.zeros((), dtype=gamma.dtype))
    dA = torch.where(strict, dA, torch.zeros((), dtype=dA.dtype))
    dMqk = torch.where(lower, dMqk, torch.zeros((), dtype=dMqk.dtype))
    right = kh[..., None, :, :] * decay  # kh_jc E_ijc
    dqs = torch.einsum("...ij,...ijc->...ic", dMqk, right)
    left = dA[..., None] * kh[..., :, None, :] + dMqk[..., None] * qs[..., :, None, :]  # [..., i, j, c]
    dkh = torch.einsum("...ij,...ijc->...ic", dA, right) + torch.einsum("...ijc,...ijc->...jc", left, decay)
    pair = torch.where(strict[..., None], left * right, torch.zeros((), dtype=left.dtype))  # W_ijc
    # column sums from the bottom up, Σ_{i≥s} W_ij, then over the columns j < s of row s
    below = torch.flip(torch.cumsum(torch.flip(pair, [-3]), dim=-3), [-3])
    dgamma = (below * strict[..., None]).sum(-2)
    return dqs, dkh, dgamma




def _straddle_factor(decay: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(factor ``[..., 16, K]``, upper, mask): ``E[r, m]`` for an upper row r, ``E[m, r]`` for a lower one, from the
    pair decays ``E`` ``[..., 16, 16, K]`` (i ≥ j) — both ≤ 1, and ``factor_i·factor_j = E_ij`` on the mask."""
    middle, upper, mask = straddle_geometry(block, decay.device)
    rows = torch.arange(CHUNK, device=decay.device)
    factor = torch.where(upper[:, None], decay[..., rows, middle, :], decay[..., middle, rows, :])
    return factor, upper, mask


def dyadic_tile_products(
    qs: torch.Tensor, kh: torch.Tensor, gamma: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile_products` through the four straddle levels (the ``"dyadic"`` K1 scheme, unrounded).

    Per level: ``X = kh ⊙ factor`` (every row), ``Q = qs ⊙ factor`` (upper rows), ``A += mask ⊙ (X Xᵀ)``,
    ``Mqk += mask ⊙ (Q Xᵀ)`` — plain matrix products of operands ≤ |kh|, |qs|, i.e. tensor-core products —
    and Mqk's diagonal ``Σ_c qs_ic kh_ic``. Shapes as :func:`tile_products`.
    """
    decay = segment_log_decay(gamma).exp()  # only i ≥ j is read
    A = torch.zeros(*gamma.shape[:-1], CHUNK, dtype=qs.dtype, device=qs.device)
    Mqk = torch.diag_embed((qs * kh).sum(-1))
    for block in DYADIC_BLOCKS:
        factor, upper, mask = _straddle_factor(decay, block)
        X = kh * factor
        Q = torch.where(upper[:, None], qs * factor, torch.zeros((), dtype=qs.dtype))
        A = A + torch.where(mask, X @ X.transpose(-1, -2), torch.zeros((), dtype=qs.dtype))
        Mqk = Mqk + torch.where(mask, Q @ X.transpose(-1, -2), torch.zeros((), dtype=qs.dtype))
    return A, Mqk


def dyadic_tile_products_backward(
    qs: torch.Tensor, kh: torch.Tensor, gamma: torch.Tensor, dA: torch.Tensor, dMqk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tile_products_backward` through the four straddle levels: the tile-gradient kernel's plan.

    Per level, with ``dA_ℓ = mask ⊙ dA``, ``dM_ℓ = mask ⊙ dMqk`` and the forward's X, Q: three products,
    ``P = dA_ℓ X``, ``Pq = dM_ℓ X`` (upper rows) and ``C = dA_ℓᵀ X + dM_ℓᵀ Q`` (lower rows), give
    ``dqs += factor ⊙ Pq``, ``dkh += factor ⊙ (P + C)``; the pair terms' row sums ``R_i = Σ_j W_ij = X_i⊙P_i +
    Q_i⊙Pq_i`` and column sums ``C'_j = Σ_i W_ij = X_j⊙C_j`` give the straddle sum ``dγ_s`` as a running sum of
    R over the upper rows i ≥ s of s's block (s upper) or of C' over the lower rows j < s (s lower) — every
    term crosses s. Mqk's diagonal adds ``dMqk_ii·kh_i`` to dqs and ``dMqk_ii·qs_i`` to dkh. Same results as
    :func:`tile_products_backward`; no ``[16, 16, K]`` pair tensor beyond the decays.
    """
    decay = segment_log_decay(gamma).exp()
    diagonal = torch.diagonal(dMqk, dim1=-2, dim2=-1)[..., None]
    dqs, dkh = diagonal * kh, diagonal * qs
    dgamma = torch.zeros_like(gamma)
    zero = torch.zeros((), dtype=qs.dtype)
    for block in DYADIC_BLOCKS:
        factor, upper, mask = _straddle_factor(decay, block)
        X = kh * factor
        Q = torch.where(upper[:, None], qs * factor, zero)
        dA_level, dM_level = torch.where(mask, dA, zero), torch.where(mask, dMqk, zero)
        P, Pq = dA_level @ X, dM_level @ X
        C = dA_level.transpose(-1, -2) @ X + dM_level.transpose(-1, -2) @ Q
        dqs = dqs + factor * Pq
        dkh = dkh + factor * (P + C)
        from_s, before_s = straddle_sums(X * P + Q * Pq, X * C, block, upper)
        dgamma = dgamma + from_s + before_s
    return dqs, dkh, dgamma


class _ExactTokens(NamedTuple):
    """Per-token values in float64, per value head ``[tokens, HV, ...]``: qs = q̂·scale, kh = k̂ (``K``),
    gamma the natural log decay (``K``), beta activated; qhat, khat, rinv_q, rinv_k per q/k head
    ``[tokens, H, ...]`` for the l2norm backward (None without it)."""

    qs: torch.Tensor
    kh: torch.Tensor
    gamma: torch.Tensor
    beta: torch.Tensor
    qhat: torch.Tensor | None
    khat: torch.Tensor | None
    rinv_q: torch.Tensor | None
    rinv_k: torch.Tensor | None


def _exact_tokens(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float | None = None,
    gate: str = "softplus", A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0, qk_l2norm: bool = True, beta_logits: bool = True,
) -> _ExactTokens:
    """The per-token values of K1's inputs (``scale`` None: ``K ** -0.5``)."""
    batch, seq_len, heads, key_dim = q.shape
    scale = key_dim ** -0.5 if scale is None else scale
    value_heads = beta.shape[2]
    group = value_head_group(heads, value_heads)
    total = batch * seq_len
    q64, k64 = (x.reshape(total, heads, key_dim).double() for x in (q, k))
    qhat = khat = rinv_q = rinv_k = None
    if qk_l2norm:
        rinv_q, rinv_k = (torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q64, k64))
        qhat, khat = q64 * rinv_q, k64 * rinv_k
        q64, k64 = qhat, khat
    per_head = g.dim() == 3
    gamma = channel_log_decay(g.double(), key_dim, per_head=per_head, gate=gate, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=lower_bound).reshape(total, value_heads, key_dim)
    beta64 = beta.reshape(total, value_heads).double()
    return _ExactTokens(
        qs=expand_to_value_heads(q64 * scale, group, dim=1), kh=expand_to_value_heads(k64, group, dim=1),
        gamma=gamma, beta=torch.sigmoid(beta64) if beta_logits else beta64,
        qhat=qhat, khat=khat, rinv_q=rinv_q, rinv_k=rinv_k,
    )


class _ExactTiles(NamedTuple):
    """The exact K1 quantities of every (value head, tile slot), ``[HV, tiles, 16, ...]`` float64: qs, kh,
    gamma ``[.., K]``; beta ``[..]``; prefix P and suffix R ``[.., K]``; the workspace fields qd, kd, kr
    ``[.., K]``, gt ``[HV, tiles, K]``, A (strictly lower), inv, mqk ``[.., 16]``."""

    qs: torch.Tensor
    kh: torch.Tensor
    gamma: torch.Tensor
    beta: torch.Tensor
    prefix: torch.Tensor
    suffix: torch.Tensor
    qd: torch.Tensor
    kd: torch.Tensor
    kr: torch.Tensor
    gt: torch.Tensor
    A: torch.Tensor
    inv: torch.Tensor
    mqk: torch.Tensor


def _exact_tiles(tokens: _ExactTokens, tile_map: TileMap) -> _ExactTiles:
    qs, kh, gamma = (to_tiles(x, tile_map) for x in (tokens.qs, tokens.kh, tokens.gamma))
    beta = to_tiles(tokens.beta, tile_map)
    prefix = torch.cumsum(gamma, dim=2)
    # R_r = Σ_{s>r} γ_s as its own running sum from the tile's end (not P_15 − P_r)
    suffix = torch.cat([torch.flip(torch.cumsum(torch.flip(gamma[:, :, 1:], [2]), dim=2), [2]),
                        torch.zeros_like(gamma[:, :, :1])], dim=2)
    A, mqk = tile_products(qs, kh, gamma)
    eye = torch.eye(CHUNK, dtype=torch.float64, device=qs.device)
    L = beta[..., None] * A
    inv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    return _ExactTiles(qs=qs, kh=kh, gamma=gamma, beta=beta, prefix=prefix, suffix=suffix, qd=qs * prefix.exp(),
                       kd=kh * prefix.exp(), kr=kh * suffix.exp(), gt=prefix[:, :, -1].exp(), A=A, inv=inv, mqk=mqk)


def prepare_gates_exact(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                        cu_seqlens: torch.Tensor | None = None, **options: Any) -> Workspace:
    """K1's workspace in float64 by the pair-decay formulation (module docstring), for any gate.

    Inputs and ``options`` (``scale``, ``gate`` ("softplus" unless given), ``A_log``, ``dt_bias``,
    ``lower_bound``, ``qk_l2norm``, ``beta_logits``) as :func:`~.gold.gold_forward` (any float dtype; the gate,
    l2norm and β-sigmoid are its own functions): q, k ``[B, T, H, K]``, g ``[B, T, HV, K]`` or ``[B, T, HV]``,
    beta ``[B, T, HV]``. Returns a
    :class:`~cute_kda.workspace.Workspace` of float64 tensors ``[HV · tiles, ...]``; rows past a sequence's
    end are 0 (γ = 0, β = 0), slots that are no tile NaN. It holds for gates of any size: every
    exponential has a non-positive argument.
    """
    tile_map = token_tile_map(q, cu_seqlens)
    t = _exact_tiles(_exact_tokens(q, k, g, beta, **options), tile_map)
    return workspace_of_tiles(dict(qd=t.qd, kd=t.kd, kr=t.kr, gt=t.gt, inv=t.inv, mqk=t.mqk, beta=t.beta), tile_map)


def chunk_forward_gates_exact(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    initial_state: torch.Tensor | None = None, state_layout: str = "vk", cu_seqlens: torch.Tensor | None = None,
    **gate_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prepare_gates_exact` then the chunk recurrence (``chunk_fwd_states_exact``), in float64.

    v ``[B, T, HV, V]``; ``initial_state`` ``[N, HV, V, K]`` ("vk") or ``[N, HV, K, V]`` ("kv"); the other
    keywords as :func:`prepare_gates_exact`. Returns (o ``[B, T, HV, V]``, final state in ``state_layout``).
    """
    ws = prepare_gates_exact(q, k, g, beta, cu_seqlens=cu_seqlens, **gate_options)
    result = chunk_fwd_states_exact(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                    state_layout=state_layout)
    return result.o, result.final_state


def _gate_backward(
    g: torch.Tensor, dgamma: torch.Tensor, *, gate: str, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    lower_bound: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dg, dA_log, ddt_bias) from dγ ``[tokens, HV, K]`` (w.r.t. the per-channel log decay), float64.

    ``g`` ``[tokens, HV, K]`` or ``[tokens, HV]`` (per head: dγ is first summed over the channels). With
    ``x`` the gate's argument: softplus ``γ = −e^A softplus(x)``, ``x = g + b``: ``dx = −e^A σ(x) dγ``,
    ``dA = Σ dγ·γ``; safe ``γ = lb·σ(x)``, ``x = e^A (g + b)``: ``dx = lb σ(x) σ(−x) dγ``, ``dg = e^A dx``,
    ``dA = Σ dx·x``; none: ``dg = dγ``. ``ddt_bias = Σ_tokens dg``. A_log / dt_bias gradients are None for
    a None input, zeros where the gate does not use it.
    """
    per_head = g.dim() == 2
    if per_head:
        dgamma = dgamma.sum(-1)
    heads = g.shape[1]
    shape = (heads,) if per_head else (heads, g.shape[2])  # one gate argument per head [and channel]
    reduce = (0,) if per_head else (0, 2)  # dA_log: over tokens [and channels]
    zero_A = None if A_log is None else torch.zeros(heads, dtype=torch.float64, device=g.device)
    zero_b = None if dt_bias is None else torch.zeros(dt_bias.shape, dtype=torch.float64, device=g.device)
    if gate == "none":
        return dgamma, zero_A, zero_b
    g64 = g.double()
    bias = 0.0 if dt_bias is None else dt_bias.double().reshape(shape)
    e_a = (torch.ones(heads, dtype=torch.float64, device=g.device) if A_log is None
           else A_log.double().reshape(heads).exp())
    e_a = e_a.reshape(heads, *([1] * (len(shape) - 1)))
    if gate == "softplus":
        x = g64 + bias
        dg = -e_a * torch.sigmoid(x) * dgamma
        dA = (dgamma * (-e_a * torch.nn.functional.softplus(x))).sum(reduce)
    elif gate == "safe":
        x = e_a * (g64 + bias)
        dx = lower_bound * torch.sigmoid(x) * torch.sigmoid(-x) * dgamma
        dg = e_a * dx
        dA = (dx * x).sum(reduce)
    else:
        raise ValueError(f"gate must be 'safe', 'softplus' or 'none', got {gate!r}")
    ddt = None if dt_bias is None else dg.sum(0).reshape(dt_bias.shape)
    return dg, None if A_log is None else dA, ddt


def _group_sum(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[tokens, HV, K]`` → ``[tokens, H, K]``: the sum over each group of value heads, in x's dtype."""
    return x.reshape(x.shape[0], heads, x.shape[1] // heads, x.shape[2]).sum(2)


def chunk_backward_gates_exact(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor, *,
    dht: torch.Tensor | None = None, scale: float | None = None, gate: str = "softplus",
    A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, lower_bound: float = -5.0,
    qk_l2norm: bool = True, beta_logits: bool = True, initial_state: torch.Tensor | None = None,
    state_layout: str = "vk", cu_seqlens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """The backward of the pair-decay chunk chain in float64, by formulas; :func:`~.gold.gold_backward`'s keys.

    Chain: :func:`prepare_gates_exact` → ``chunk_fwd_states_exact`` (the state entering every tile) →
    ``chunk_bwd_scan_exact`` (Kernel A: du, dv, dh0 and the gradient w.r.t. the state after every tile) →
    per tile, with ``w = v − kd S``, ``U = INV·β w``: ``dMqk = tril(dO Uᵀ)``, ``dL = stril(−du Uᵀ)``,
    ``dA = β ⊙ dL``, ``dβ = Σ_v du ⊙ w + Σ_j dL ⊙ A``; ``dqd = dO Sᵀ``, ``dkd = −(β du) Sᵀ``,
    ``dkr = U dS'ᵀ``, ``dgT = Σ_v S ⊙ dS'``; the pair terms of :func:`tile_products_backward`;
    then, for token s,
    ``dγ_s = Σ_{i≥s>j} W_ij + Σ_{r≥s} (dqd⊙qd + dkd⊙kd)_r + Σ_{r<s} (dkr⊙kr)_r + dgT⊙gT`` —
    the contract's ``Σ_{r≥s} dG_r + dG_last`` with the terms that cancel left out, so that a token whose decay
    underflows gets dγ = 0; the gate, GVA group sums, l2norm and β-sigmoid last.

    Inputs and keywords as :func:`~.gold.gold_backward` (any float dtype, widened to float64). Returns
    dq, dk ``[B, T, H, K]`` (summed over each group of value heads), dv ``[B, T, HV, V]``, dg, dbeta,
    dA_log, ddt_bias in their inputs' shapes (None for a None input), dh0 in ``state_layout`` (None without
    an initial state); all float64.
    """
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim ** -0.5 if scale is None else scale
    tokens = _exact_tokens(q, k, g, beta, scale=scale, gate=gate, A_log=A_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    tile_map = token_tile_map(q, cu_seqlens)
    t = _exact_tiles(tokens, tile_map)
    ws = workspace_of_tiles(dict(qd=t.qd, kd=t.kd, kr=t.kr, gt=t.gt, inv=t.inv, mqk=t.mqk, beta=t.beta), tile_map)
    forward = chunk_fwd_states_exact(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                     state_layout=state_layout)
    scan = chunk_bwd_scan_exact(ws, do, cu_seqlens=cu_seqlens, dht=dht, state_layout=state_layout, snapshot_every=1)
    S = tile_blocks(forward.states, value_heads, tile_map, EXACT)  # [HV, tiles, K, V]
    dS = tile_blocks(scan.snapshots, value_heads, tile_map, EXACT)

    def tiles_of(x: torch.Tensor) -> torch.Tensor:
        return to_tiles(x.reshape(batch * seq_len, value_heads, value_dim).double(), tile_map)

    v_t, do_t, du_t = tiles_of(v), tiles_of(do), tiles_of(scan.du)
    beta_col = t.beta[..., None]
    w = v_t - t.kd @ S
    U = t.inv @ (beta_col * w)
    dMqk = torch.tril(do_t @ U.transpose(-1, -2))
    dL = torch.tril(-du_t @ U.transpose(-1, -2), diagonal=-1)
    dbeta_t = (du_t * w).sum(-1) + (dL * t.A).sum(-1)
    dqd = do_t @ S.transpose(-1, -2)
    dkd = -(beta_col * du_t) @ S.transpose(-1, -2)
    dkr = U @ dS.transpose(-1, -2)
    dgT = (S * dS).sum(-1)
    dqs, dkh, dgamma_t = tile_products_backward(t.qs, t.kh, t.gamma, beta_col * dL, dMqk)
    dqs = dqs + dqd * t.prefix.exp()
    dkh = dkh + dkd * t.prefix.exp() + dkr * t.suffix.exp()
    # every term below carries the decay of token s: qd, kd of rows r ≥ s, kr of rows r < s, gT
    rows_from_s, rows_before_s = crossing_rows(dqd * t.qd + dkd * t.kd, dkr * t.kr)
    dgamma_t = dgamma_t + rows_from_s + rows_before_s + (dgT * t.gt)[:, :, None]

    dq = qk_backward(_group_sum(untile(dqs, tile_map), heads) * scale, tokens.qhat, tokens.rinv_q)
    dk = qk_backward(_group_sum(untile(dkh, tile_map), heads), tokens.khat, tokens.rinv_k)
    g_tokens = g.reshape(batch * seq_len, *g.shape[2:])
    dg, dA_log, ddt_bias = _gate_backward(g_tokens, untile(dgamma_t, tile_map), gate=gate, A_log=A_log,
                                          dt_bias=dt_bias, lower_bound=lower_bound)
    dbeta = untile(dbeta_t, tile_map)
    if beta_logits:
        dbeta = dbeta * tokens.beta * (1 - tokens.beta)
    return {
        "dq": dq.reshape(q.shape), "dk": dk.reshape(k.shape), "dv": scan.dv, "dg": dg.reshape(g.shape),
        "dbeta": dbeta.reshape(beta.shape), "dA_log": dA_log, "ddt_bias": ddt_bias,
        "dh0": None if initial_state is None else scan.dh0,
    }


