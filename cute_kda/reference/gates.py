"""Chunk-16 references for every gate (issue 12): the overflow-free K1 formulation, exact and rounded,
with its backward.

Today's K1 (docs/numerics.md, K1) forms ``L`` and ``Mqk`` as tensor-core products of ``kd``/``qd`` with
``kinv = k̂ ⊙ 2^−G``. ``kinv`` overflows as soon as one channel decays by more than 2^128 inside a tile:
the softplus gate of Kimi-Linear (unbounded below), a precomputed log decay with −1000 masks. The
*pairwise* formulation takes every pair's decay from the tokens between the two rows only::

    E_ijc  = exp(Σ_{s=j+1..i} γ_sc)  ≤ 1   (i ≥ j; E_iic = 1; γ the per-token log decay)
    A_ij   = Σ_c k̂_ic k̂_jc E_ijc   (i > j)        L = β_i · A_ij
    Mqk_ij = Σ_c q̂s_ic k̂_jc E_ijc  (i ≥ j)        q̂s = q̂ · scale

and every other K1 field from sums that never subtract (``γ ≤ 0``, so no cancellation either):
``qd = q̂s ⊙ e^P``, ``kd = k̂ ⊙ e^P`` with the prefix ``P_r = Σ_{s≤r} γ_s``, ``kr = k̂ ⊙ e^R`` with the
suffix ``R_r = Σ_{s>r} γ_s``, ``gT = e^{P_15}``. K2 and Kernel A are unchanged: they only read these.

- :func:`pairwise_tile_products` / :func:`pairwise_tile_products_backward`: A and Mqk of a batch of
  tiles, and their vector-Jacobian product (the ``dG`` of the pairwise terms), in any float dtype;
  :func:`dyadic_tile_products` / :func:`dyadic_tile_products_backward`: the same through four levels of
  matrix products whose operands never exceed k̂, q̂ (the tensor-core plan of K1 and of Kernel B).
- :func:`prepare_pairwise_exact`: the K1 workspace in float64 for every gate form (safe, softplus, a
  precomputed log decay; per channel or per head) and grouped value heads.
- :func:`chunk_forward_pairwise_exact`, :func:`chunk_backward_pairwise_exact`: the whole forward and
  backward chain in float64 over that workspace; they equal the gold token recurrence and its autograd.
- :func:`mirror_prepare_gates`: the proposed K1 kernels with their rounding (``K1_SCHEMES``), one per
  way of computing the pairwise sums — for measuring their accuracy before any kernel is written.

Shapes: q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; beta ``[B, T, HV]``; g ``[B, T, HV, K]`` (per-channel
gate) or ``[B, T, HV]`` (per-head gate, GatedDeltaNet); HV a multiple of H (value head ``j`` reads q/k head
``j // (HV / H)``). Workspaces are per value head: ``[HV · tiles, ...]``.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..numerics import DYADIC_BLOCKS, LN2
from ..workspace import CHUNK, Workspace, WorkspaceSpec, allocate_workspace, block_states_shape
from .backward import (
    _EXACT, _KERNEL, _PER_TILE, _dot_f32, _tile_blocks, chunk_bwd_scan_exact, chunk_fwd_states_exact, mirror_bwd_scan,
)
from .gold import L2NORM_EPS, channel_log_decay, expand_to_value_heads, value_head_group
from .mirror import (
    Constants, _l2norm_rinv, _mma, _row_butterfly_sum, _TileMap, _to_tiles, _token_tile_map, ex2_approx, lg2_approx,
    mirror_recurrence, sigmoid_approx,
)

# the proposed ways of computing K1's pairwise sums, measured in docs/numerics.md ("Unbounded gates")
K1_SCHEMES = ("kinv", "middle", "halves", "dyadic", "pairwise", "per_head")
_HALF = CHUNK // 2
_MIDDLE_ROW = _HALF - 1  # reference row of the one-level factorisations: the last row of the first half
_GROWTH_EXPONENT_MAX = 126.0  # the middle scheme's per-row guard: its growing factor stays ≤ 2^126 (finite)


# ---------------------------------------------------------------------------------------------
# The pairwise tile products and their backward (any float dtype; float64 in the references)


def segment_log_decay(gamma: torch.Tensor) -> torch.Tensor:
    """``D[..., i, j, c] = Σ_{s=j+1..i} γ[..., s, c]`` for i ≥ j (0 for i ≤ j), from γ ``[..., 16, K]``.

    A running sum per column ``j`` over the rows below it, never a difference of prefix sums: with γ ≤ 0
    no term cancels, so ``D`` is accurate to its own size (a −1000 mask before both rows cannot smear it).
    Returns ``[..., 16, 16, K]``.
    """
    rows = gamma.shape[-2]
    below = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=gamma.device), diagonal=-1)  # s > j
    return torch.cumsum(gamma[..., :, None, :] * below[..., None], dim=-3)


def pairwise_tile_products(
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


def pairwise_tile_products_backward(
    qs: torch.Tensor, kh: torch.Tensor, gamma: torch.Tensor, dA: torch.Tensor, dMqk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vector-Jacobian product of :func:`pairwise_tile_products` by formulas: (dqs, dkh, dγ).

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




def _straddle_geometry(block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(middle ``[16]``, upper ``[16]``, mask ``[16, 16]``) of one straddle level with blocks of ``block`` rows.

    Row r's block has the middle row ``m`` = the last row of its first half; r is *upper* when r > m.
    ``mask[i, j]``: i upper and j lower in the same block — the pairs that straddle m. Over the four
    levels of :data:`DYADIC_BLOCKS` every pair i > j straddles exactly one level's m (the highest bit in
    which i and j differ picks it)."""
    rows = torch.arange(CHUNK, device=device)
    middle = rows // block * block + block // 2 - 1
    upper = rows > middle
    mask = (rows[:, None] // block == rows[None, :] // block) & upper[:, None] & ~upper[None, :]
    return middle, upper, mask


def _straddle_factor(decay: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(factor ``[..., 16, K]``, upper, mask): ``E[r, m]`` for an upper row r, ``E[m, r]`` for a lower one, from the
    pair decays ``E`` ``[..., 16, 16, K]`` (i ≥ j) — both ≤ 1, and ``factor_i·factor_j = E_ij`` on the mask."""
    middle, upper, mask = _straddle_geometry(block, decay.device)
    rows = torch.arange(CHUNK, device=decay.device)
    factor = torch.where(upper[:, None], decay[..., rows, middle, :], decay[..., middle, rows, :])
    return factor, upper, mask


def dyadic_tile_products(
    qs: torch.Tensor, kh: torch.Tensor, gamma: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pairwise_tile_products` through the four straddle levels (the ``"dyadic"`` K1 scheme, unrounded).

    Per level: ``X = kh ⊙ factor`` (every row), ``Q = qs ⊙ factor`` (upper rows), ``A += mask ⊙ (X Xᵀ)``,
    ``Mqk += mask ⊙ (Q Xᵀ)`` — plain matrix products of operands ≤ |kh|, |qs|, i.e. tensor-core products —
    and Mqk's diagonal ``Σ_c qs_ic kh_ic``. Shapes as :func:`pairwise_tile_products`.
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


def _straddle_sums(row_sums: torch.Tensor, column_sums: torch.Tensor, block: int, upper: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A straddle level's two parts of ``dγ_s`` ``[..., 16, K]`` in the inputs' dtype: for s upper the sum of
    ``row_sums`` over the upper rows i ≥ s of s's block, for s lower the sum of ``column_sums`` over the lower
    rows j < s of s's block (every term crosses s)."""
    rows = torch.arange(CHUNK, device=row_sums.device)
    same_block = rows[:, None] // block == rows[None, :] // block
    from_s = same_block & (rows[None, :] >= rows[:, None]) & upper[None, :] & upper[:, None]
    before_s = same_block & (rows[None, :] < rows[:, None]) & ~upper[None, :] & ~upper[:, None]
    return (torch.einsum("sr,...rc->...sc", from_s.to(row_sums.dtype), row_sums),
            torch.einsum("sr,...rc->...sc", before_s.to(column_sums.dtype), column_sums))


def dyadic_tile_products_backward(
    qs: torch.Tensor, kh: torch.Tensor, gamma: torch.Tensor, dA: torch.Tensor, dMqk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pairwise_tile_products_backward` through the four straddle levels: the tile-gradient kernel's plan.

    Per level, with ``dA_ℓ = mask ⊙ dA``, ``dM_ℓ = mask ⊙ dMqk`` and the forward's X, Q: three products,
    ``P = dA_ℓ X``, ``Pq = dM_ℓ X`` (upper rows) and ``C = dA_ℓᵀ X + dM_ℓᵀ Q`` (lower rows), give
    ``dqs += factor ⊙ Pq``, ``dkh += factor ⊙ (P + C)``; the pair terms' row sums ``R_i = Σ_j W_ij = X_i⊙P_i +
    Q_i⊙Pq_i`` and column sums ``C'_j = Σ_i W_ij = X_j⊙C_j`` give the straddle sum ``dγ_s`` as a running sum of
    R over the upper rows i ≥ s of s's block (s upper) or of C' over the lower rows j < s (s lower) — every
    term crosses s. Mqk's diagonal adds ``dMqk_ii·kh_i`` to dqs and ``dMqk_ii·qs_i`` to dkh. Same results as
    :func:`pairwise_tile_products_backward`; no ``[16, 16, K]`` pair tensor beyond the decays.
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
        from_s, before_s = _straddle_sums(X * P + Q * Pq, X * C, block, upper)
        dgamma = dgamma + from_s + before_s
    return dqs, dkh, dgamma


# ---------------------------------------------------------------------------------------------
# The exact (float64) chain


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
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float, gate: str,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float, qk_l2norm: bool,
    beta_logits: bool,
) -> _ExactTokens:
    batch, seq_len, heads, key_dim = q.shape
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


def _exact_tiles(tokens: _ExactTokens, tile_map: _TileMap) -> _ExactTiles:
    qs, kh, gamma = (_to_tiles(x, tile_map) for x in (tokens.qs, tokens.kh, tokens.gamma))
    beta = _to_tiles(tokens.beta, tile_map)
    prefix = torch.cumsum(gamma, dim=2)
    # R_r = Σ_{s>r} γ_s as its own running sum from the tile's end (not P_15 − P_r)
    suffix = torch.cat([torch.flip(torch.cumsum(torch.flip(gamma[:, :, 1:], [2]), dim=2), [2]),
                        torch.zeros_like(gamma[:, :, :1])], dim=2)
    A, mqk = pairwise_tile_products(qs, kh, gamma)
    eye = torch.eye(CHUNK, dtype=torch.float64, device=qs.device)
    L = beta[..., None] * A
    inv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    return _ExactTiles(qs=qs, kh=kh, gamma=gamma, beta=beta, prefix=prefix, suffix=suffix, qd=qs * prefix.exp(),
                       kd=kh * prefix.exp(), kr=kh * suffix.exp(), gt=prefix[:, :, -1].exp(), A=A, inv=inv, mqk=mqk)


def _workspace(fields: dict[str, torch.Tensor], tile_map: _TileMap) -> Workspace:
    """``[HV, tiles, ...]`` fields → a Workspace ``[HV · tiles, ...]``; slots that are no tile NaN, as in K1."""
    missing = ~tile_map.slot_exists
    out = {}
    for name, value in fields.items():
        heads, tiles = value.shape[:2]
        value = value.masked_fill(missing.reshape(1, tiles, *([1] * (value.dim() - 2))), math.nan)
        out[name] = value.reshape(heads * tiles, *value.shape[2:]).contiguous()
    return Workspace(**out)


def prepare_pairwise_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    gate: str = "softplus",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> Workspace:
    """K1's workspace in float64 by the pairwise formulation (module docstring), for any gate.

    Inputs as :func:`~.gold.gold_forward` (any float dtype; the gate, l2norm and β-sigmoid are its own
    functions): q, k ``[B, T, H, K]``, g ``[B, T, HV, K]`` or ``[B, T, HV]``, beta ``[B, T, HV]``. Returns a
    :class:`~cute_kda.workspace.Workspace` of float64 tensors ``[HV · tiles, ...]``; rows past a sequence's
    end are 0 (γ = 0, β = 0), slots that are no tile NaN. It holds for gates of any size: every
    exponential has a non-positive argument.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tokens = _exact_tokens(q, k, g, beta, scale=scale, gate=gate, A_log=A_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    tile_map = _token_tile_map(q, cu_seqlens)
    t = _exact_tiles(tokens, tile_map)
    return _workspace(dict(qd=t.qd, kd=t.kd, kr=t.kr, gt=t.gt, inv=t.inv, mqk=t.mqk, beta=t.beta), tile_map)


def chunk_forward_pairwise_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    state_layout: str = "vk",
    cu_seqlens: torch.Tensor | None = None,
    **gate_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prepare_pairwise_exact` then the chunk recurrence (``chunk_fwd_states_exact``), in float64.

    v ``[B, T, HV, V]``; ``initial_state`` ``[N, HV, V, K]`` ("vk") or ``[N, HV, K, V]`` ("kv"); the other
    keywords as :func:`prepare_pairwise_exact`. Returns (o ``[B, T, HV, V]``, final state in ``state_layout``).
    """
    ws = prepare_pairwise_exact(q, k, g, beta, cu_seqlens=cu_seqlens, **gate_options)
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


def _qk_backward(dx_hat: torch.Tensor, x_hat: torch.Tensor | None, rinv: torch.Tensor | None,
                 row_dot: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Through the l2norm ``x̂ = x·rinv``: ``dx = rinv·(dx̂ − x̂·(x̂·dx̂))``; without it, dx = dx̂. ``row_dot(a, b)``
    ``[..., 1]``: the dot product over the channels (default the plain sum)."""
    if x_hat is None:
        return dx_hat
    dot = (x_hat * dx_hat).sum(-1, keepdim=True) if row_dot is None else row_dot(x_hat, dx_hat)
    return rinv * (dx_hat - x_hat * dot)


def _crossing_rows(through_prefix: torch.Tensor, through_suffix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row terms of ``dγ_s`` that carry token s's decay ``[.., 16, K]``: ``Σ_{r≥s}`` of the prefix terms
    (dqd⊙qd + dkd⊙kd) and ``Σ_{r<s}`` of the suffix terms (dkr⊙kr), in the inputs' dtype."""
    from_s = torch.flip(torch.cumsum(torch.flip(through_prefix, [2]), dim=2), [2])
    before_s = torch.cat([torch.zeros_like(through_suffix[:, :, :1]), torch.cumsum(through_suffix, dim=2)[:, :, :-1]],
                         dim=2)
    return from_s, before_s


def _untile(x: torch.Tensor, tile_map: _TileMap) -> torch.Tensor:
    """``[HV, tiles, 16, ...]`` → ``[tokens, HV, ...]``."""
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, tile_map.row_of_token].movedim(0, 1)


def _group_sum(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[tokens, HV, K]`` → ``[tokens, H, K]``: the sum over each group of value heads, in x's dtype."""
    return x.reshape(x.shape[0], heads, x.shape[1] // heads, x.shape[2]).sum(2)


def chunk_backward_pairwise_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    gate: str = "softplus",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    initial_state: torch.Tensor | None = None,
    state_layout: str = "vk",
    cu_seqlens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """The backward of the pairwise chunk chain in float64, by formulas; :func:`~.backward.gold_backward`'s keys.

    Chain: :func:`prepare_pairwise_exact` → ``chunk_fwd_states_exact`` (the state entering every tile) →
    ``chunk_bwd_scan_exact`` (Kernel A: du, dv, dh0 and the gradient w.r.t. the state after every tile) →
    per tile, with ``w = v − kd S``, ``U = INV·β w``: ``dMqk = tril(dO Uᵀ)``, ``dL = stril(−du Uᵀ)``,
    ``dA = β ⊙ dL``, ``dβ = Σ_v du ⊙ w + Σ_j dL ⊙ A``; ``dqd = dO Sᵀ``, ``dkd = −(β du) Sᵀ``,
    ``dkr = U dS'ᵀ``, ``dgT = Σ_v S ⊙ dS'``; the pair terms of :func:`pairwise_tile_products_backward`;
    then, for token s,
    ``dγ_s = Σ_{i≥s>j} W_ij + Σ_{r≥s} (dqd⊙qd + dkd⊙kd)_r + Σ_{r<s} (dkr⊙kr)_r + dgT⊙gT`` —
    the contract's ``Σ_{r≥s} dG_r + dG_last`` with the terms that cancel left out, so that a token whose decay
    underflows gets dγ = 0; the gate, GVA group sums, l2norm and β-sigmoid last.

    Inputs and keywords as :func:`~.backward.gold_backward` (any float dtype, widened to float64). Returns
    dq, dk ``[B, T, H, K]`` (summed over each group of value heads), dv ``[B, T, HV, V]``, dg, dbeta,
    dA_log, ddt_bias in their inputs' shapes (None for a None input), dh0 in ``state_layout`` (None without
    an initial state); all float64.
    """
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim ** -0.5 if scale is None else scale
    tokens = _exact_tokens(q, k, g, beta, scale=scale, gate=gate, A_log=A_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    tile_map = _token_tile_map(q, cu_seqlens)
    t = _exact_tiles(tokens, tile_map)
    ws = _workspace(dict(qd=t.qd, kd=t.kd, kr=t.kr, gt=t.gt, inv=t.inv, mqk=t.mqk, beta=t.beta), tile_map)
    forward = chunk_fwd_states_exact(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                     state_layout=state_layout)
    scan = chunk_bwd_scan_exact(ws, do, cu_seqlens=cu_seqlens, dht=dht, state_layout=state_layout, snapshot_every=1)
    S = _tile_blocks(forward.states, value_heads, tile_map, _EXACT)  # [HV, tiles, K, V]
    dS = _tile_blocks(scan.snapshots, value_heads, tile_map, _EXACT)

    def tiles_of(x: torch.Tensor) -> torch.Tensor:
        return _to_tiles(x.reshape(batch * seq_len, value_heads, value_dim).double(), tile_map)

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
    dqs, dkh, dgamma_t = pairwise_tile_products_backward(t.qs, t.kh, t.gamma, beta_col * dL, dMqk)
    dqs = dqs + dqd * t.prefix.exp()
    dkh = dkh + dkd * t.prefix.exp() + dkr * t.suffix.exp()
    # every term below carries the decay of token s: qd, kd of rows r ≥ s, kr of rows r < s, gT
    rows_from_s, rows_before_s = _crossing_rows(dqd * t.qd + dkd * t.kd, dkr * t.kr)
    dgamma_t = dgamma_t + rows_from_s + rows_before_s + (dgT * t.gt)[:, :, None]

    def untile(x: torch.Tensor) -> torch.Tensor:
        return _untile(x, tile_map)

    dq = _qk_backward(_group_sum(untile(dqs), heads) * scale, tokens.qhat, tokens.rinv_q)
    dk = _qk_backward(_group_sum(untile(dkh), heads), tokens.khat, tokens.rinv_k)
    g_tokens = g.reshape(batch * seq_len, *g.shape[2:])
    dg, dA_log, ddt_bias = _gate_backward(g_tokens, untile(dgamma_t), gate=gate, A_log=A_log, dt_bias=dt_bias,
                                          lower_bound=lower_bound)
    dbeta = untile(dbeta_t)
    if beta_logits:
        dbeta = dbeta * tokens.beta * (1 - tokens.beta)
    return {
        "dq": dq.reshape(q.shape), "dk": dk.reshape(k.shape), "dv": scan.dv, "dg": dg.reshape(g.shape),
        "dbeta": dbeta.reshape(beta.shape), "dA_log": dA_log, "ddt_bias": ddt_bias,
        "dh0": None if initial_state is None else scan.dh0,
    }


# ---------------------------------------------------------------------------------------------
# The rounded mirror of the proposed K1 kernels


def _base2_log_decay(
    g: torch.Tensor, key_dim: int, gate: str, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    consts: Constants,
) -> torch.Tensor:
    """K1's fp32 base-2 log decay g' per token ``[tokens, HV, K]`` from g ``[tokens, HV, K]`` or ``[tokens, HV]``.

    safe: ``c_gate · sigmoid_approx(eA·(g + b))`` as today; softplus: with ``y = f32(f32(g + b)·LOG2E)``,
    ``g' = −f32(eA · f32(max(y, 0) + lg2(f32(1 + ex2(−|y|)))))`` (softplus(x)·log2 e in base 2: no overflow for
    any y); none: ``g' = f32(g · LOG2E)``. ``eA = ex2_approx(f32(A_log · LOG2E))``, 1 without A_log.
    """
    per_head = g.dim() == 2
    heads = g.shape[1]
    channels = (1,) if per_head else (key_dim,)  # a per-head gate is computed once and broadcast
    g32 = g.float()[..., None] if per_head else g.float()
    if gate == "none":
        gp = g32 * consts.log2e
    else:
        e_a = (torch.ones(heads, device=g.device) if A_log is None
               else ex2_approx(A_log.float().reshape(heads) * consts.log2e))[:, None]
        bias = (torch.zeros(heads, *channels, device=g.device) if dt_bias is None
                else dt_bias.float().reshape(heads, *channels))
        if gate == "safe":
            gp = consts.c_gate * sigmoid_approx(e_a * (g32 + bias))
        elif gate == "softplus":
            y = (g32 + bias) * consts.log2e
            softplus2 = torch.clamp(y, min=0.0) + lg2_approx(1.0 + ex2_approx(-y.abs()))
            gp = -(e_a * softplus2)
        else:
            raise ValueError(f"gate must be 'safe', 'softplus' or 'none', got {gate!r}")
    return gp.expand(*gp.shape[:2], key_dim)


def _decay_spans(a: torch.Tensor) -> torch.Tensor:
    """``E[..., i, j, c]`` = the fp32 product ``(…((a_{j+1}·a_{j+2})·a_{j+3})…)·a_i`` for i > j, 1 for i = j,
    0 above; ``a = ex2(g')`` ``[..., 16, K]`` (each factor ≤ 1: the products only shrink). ``[..., 16, 16, K]``."""
    rows = a.shape[-2]
    spans = torch.zeros(*a.shape[:-2], rows, rows, a.shape[-1], dtype=torch.float32, device=a.device)
    for i in range(rows):
        if i:
            spans[..., i, :i, :] = spans[..., i - 1, :i, :] * a[..., i, None, :]
        spans[..., i, i, :] = 1.0
    return spans


def _cuda_core_pairs(qh: torch.Tensor, kh: torch.Tensor, spans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_kk, A_qk) ``[..., 16, 16]`` fp32 over every i ≥ j by fp32 CUDA-core arithmetic:
    ``t_ijc = f32(kh_jc · E_ijc)``, ``A = f32(Σ_c kh_ic·t_ijc)``, ``A_qk = f32(Σ_c qh_ic·t_ijc)`` (each sum: the
    exact sum of the exact fp32 products, rounded once — the order a kernel's FMA chain and reduction pick
    is left open, as for the other reductions of the contract)."""
    t = (kh[..., None, :, :] * spans).double()
    A = (kh[..., :, None, :].double() * t).sum(-1).float()
    A_qk = (qh[..., :, None, :].double() * t).sum(-1).float()
    return A, A_qk


def _running_straddle_factor(a: torch.Tensor, block: int) -> torch.Tensor:
    """K1's factors of one straddle level (:func:`_straddle_factor`) ``[..., 16, K]`` fp32 from ``a = ex2(g')``,
    as running products outward from each block's middle row m: upper rows ``f_{m+1} = a_{m+1}``,
    ``f_r = f32(f_{r−1}·a_r)``; lower rows ``f_m = 1``, ``f_r = f32(f_{r+1}·a_{r+1})``. The upper rows equal the
    spans ``E[r, m]`` bit for bit; the lower ones are ``E[m, r]`` multiplied from the other end."""
    rows: list[torch.Tensor] = [a[..., 0, :]] * CHUNK
    for start in range(0, CHUNK, block):
        middle = start + block // 2 - 1
        rows[middle] = torch.ones_like(a[..., 0, :])
        for r in range(middle - 1, start - 1, -1):
            rows[r] = rows[r + 1] * a[..., r + 1, :]
        rows[middle + 1] = a[..., middle + 1, :]
        for r in range(middle + 2, start + block):
            rows[r] = rows[r - 1] * a[..., r, :]
    return torch.stack(rows, dim=-2)


def _row_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``Σ_c x_c·y_c`` per row of fp32 ``[..., D]`` in K1's order: fp32 products, sequential partials over 8
    consecutive channels, then the butterfly over the D/8 partials → ``[...]``."""
    products = (x * y).unflatten(-1, (-1, 8))
    partial = products[..., 0]
    for c in range(1, 8):
        partial = partial + products[..., c]
    return _row_butterfly_sum(partial)


def _straddle_operands(qh: torch.Tensor, kh: torch.Tensor, a: torch.Tensor, block: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One straddle level with K1's factors (:func:`_running_straddle_factor`): (X, Q, mask),
    X = bf16(kh ⊙ factor) on every row, Q = bf16(qh ⊙ factor) on upper rows (0 on lower rows) ``[..., 16, K]``."""
    factor = _running_straddle_factor(a, block)
    _, upper, mask = _straddle_geometry(block, kh.device)
    X = (kh * factor).bfloat16()
    Q = torch.where(upper[:, None], qh * factor, torch.zeros((), device=kh.device)).bfloat16()
    return X, Q, mask


def _middle_row_operands(qh: torch.Tensor, kh: torch.Tensor, gp: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-level factorisation around row m = 7 for every pair, with a per-row guard: (left_q, left_k, right).

    ``Z_r`` = the fp32 running sum of g' from row m outwards (``Σ_{s=m+1..r}`` for r > m, ``Σ_{s=r+1..m}`` for
    r ≤ m); decay ``f_r = ex2(Z_r)`` ≤ 1, growth ``h_r = ex2(min(−Z_r, 126))`` (the guard: finite, but wrong once
    a row lies more than 2^126 of decay from row m). Rows i > m take ``f_i`` as left operands, ``h_i`` as right;
    rows ≤ m the opposite, so ``left_i·right_j = 2^{Z_i − Z_j}`` on either side of m."""
    rows: list[torch.Tensor] = [torch.zeros_like(gp[..., 0, :])] * CHUNK
    for r in range(_MIDDLE_ROW - 1, -1, -1):
        rows[r] = rows[r + 1] + gp[..., r + 1, :]
    rows[_MIDDLE_ROW + 1] = gp[..., _MIDDLE_ROW + 1, :]
    for r in range(_MIDDLE_ROW + 2, CHUNK):
        rows[r] = rows[r - 1] + gp[..., r, :]
    Z = torch.stack(rows, dim=-2)
    decay = ex2_approx(Z)
    growth = ex2_approx(torch.clamp(-Z, max=_GROWTH_EXPONENT_MAX))
    upper = (torch.arange(CHUNK, device=gp.device) > _MIDDLE_ROW)[:, None]
    left = torch.where(upper, decay, growth)
    right = torch.where(upper, growth, decay)
    return (qh * left).bfloat16(), (kh * left).bfloat16(), (kh * right).bfloat16()


def _scheme_products(scheme: str, qh: torch.Tensor, kh: torch.Tensor, gp: torch.Tensor, G: torch.Tensor,
                     qd: torch.Tensor, kd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_kk, A_qk) fp32 ``[..., 16, 16]`` of one K1 scheme (only the lower triangle is used)."""
    if scheme == "kinv":  # today's K1: tensor cores over kd, qd and kinv = bf16(kh · 2^−G)
        kinv = (kh * ex2_approx(-G)).bfloat16()
        return _mma(kd, kinv.transpose(-1, -2)), _mma(qd, kinv.transpose(-1, -2))
    if scheme == "middle":
        left_q, left_k, right = _middle_row_operands(qh, kh, gp)
        return _mma(left_k, right.transpose(-1, -2)), _mma(left_q, right.transpose(-1, -2))
    if scheme == "per_head":  # one decay per head: A = E ⊙ (k̂ k̂ᵀ), the product of the undecayed bf16 rows
        if bool((gp != gp[..., :1]).any()):
            raise ValueError("scheme 'per_head' needs a per-head gate (the same decay on every channel)")
        spans = _decay_spans(ex2_approx(gp[..., :1]))[..., 0]
        k16 = kh.bfloat16()
        return (spans * _mma(k16, k16.transpose(-1, -2)),
                spans * _mma(qh.bfloat16(), k16.transpose(-1, -2)))
    a = ex2_approx(gp)
    if scheme == "dyadic":  # every pair i > j on one level; the diagonal in K1's order
        A = torch.zeros(*gp.shape[:-1], CHUNK, dtype=torch.float32, device=gp.device)
        A_qk = torch.diag_embed(_row_dot(qh, kh))
        levels = DYADIC_BLOCKS
    else:
        A, A_qk = _cuda_core_pairs(qh, kh, _decay_spans(a))
        if scheme == "pairwise":
            return A, A_qk
        levels = DYADIC_BLOCKS[:1]
    for block in levels:  # each straddle level on the tensor cores replaces the CUDA-core values of its pairs
        X, Q, mask = _straddle_operands(qh, kh, a, block)
        A = torch.where(mask, _mma(X, X.transpose(-1, -2)), A)
        A_qk = torch.where(mask, _mma(Q, X.transpose(-1, -2)), A_qk)
    return A, A_qk


def _neumann_inverse(L: torch.Tensor) -> torch.Tensor:
    """INV = (I + L)⁻¹ of fp16 strictly lower L ``[..., 16, 16]`` by K1's fp16 Neumann product → bf16."""
    L2 = _mma(L, L).half()
    L4 = _mma(L2, L2).half()
    L8 = _mma(L4, L4).half()
    P1 = (torch.eye(CHUNK, device=L.device) - L.float()).half()
    P2 = _mma(P1, L2, c=P1).half()
    P3 = _mma(P2, L4, c=P2).half()
    return _mma(P3, L8, c=P3).bfloat16()


class _K1GateValues(NamedTuple):
    """What the unbounded gates' K1 computes, kept for the backward's recompute (Kernel B's operands).

    Per value head and tile ``[HV, tiles, 16, ...]``: qh (= q̂·scale), kh fp32 ``[.., K]``; gp (g', base 2),
    G (prefix), Gs (suffix) fp32 ``[.., K]``; beta (activated) ``[..]``; A, A_qk fp32 ``[.., 16]`` (the
    scheme's pair sums). Per token and q/k head ``[tokens, H, K]``: qhat, khat (l2-normalised, unscaled) and
    rinv_q, rinv_k ``[tokens, H, 1]`` (None without the l2norm). The workspace as K1 writes it.
    """

    tile_map: _TileMap
    consts: Constants
    qh: torch.Tensor
    kh: torch.Tensor
    gp: torch.Tensor
    G: torch.Tensor
    Gs: torch.Tensor
    beta: torch.Tensor
    A: torch.Tensor
    A_qk: torch.Tensor
    qhat: torch.Tensor | None
    khat: torch.Tensor | None
    rinv_q: torch.Tensor | None
    rinv_k: torch.Tensor | None
    workspace: Workspace


def _k1_gate_values(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scheme: str, gate: str,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float, scale: float | None,
    cu_seqlens: torch.Tensor | None, qk_l2norm: bool, beta_logits: bool,
) -> _K1GateValues:
    """:func:`mirror_prepare_gates`' arithmetic, with the values it passes through."""
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise TypeError("q and k must be bf16 (the kernels' input type)")
    if scheme not in K1_SCHEMES:
        raise ValueError(f"scheme must be one of {K1_SCHEMES}, got {scheme!r}")
    batch, seq_len, heads, dim = q.shape
    value_heads = beta.shape[2]
    group = value_head_group(heads, value_heads)
    total = batch * seq_len
    consts = Constants.make(lower_bound, dim ** -0.5 if scale is None else scale)
    tile_map = _token_tile_map(q, cu_seqlens)

    q32, k32 = (x.reshape(total, heads, dim).float() for x in (q, k))
    qhat = khat = rinv_q = rinv_k = None
    if qk_l2norm:
        rinv_q, rinv_k = _l2norm_rinv(q32, consts.eps), _l2norm_rinv(k32, consts.eps)
        qhat, khat = q32 * rinv_q, k32 * rinv_k  # for the l2norm backward (unscaled)
        q_hat, k_hat = q32 * (rinv_q * consts.scale), khat
    else:
        q_hat, k_hat = q32 * consts.scale, k32
    qh = _to_tiles(expand_to_value_heads(q_hat, group, dim=1), tile_map)  # [HV, tiles, 16, D]
    kh = _to_tiles(expand_to_value_heads(k_hat, group, dim=1), tile_map)
    gp = _to_tiles(_base2_log_decay(g.reshape(total, *g.shape[2:]), dim, gate, A_log, dt_bias, consts), tile_map)
    beta32 = beta.reshape(total, value_heads).float()
    beta_t = _to_tiles(sigmoid_approx(beta32) if beta_logits else beta32, tile_map)

    prefix, suffix = [gp[:, :, 0]], [torch.zeros_like(gp[:, :, 0])]
    for r in range(1, CHUNK):
        prefix.append(prefix[-1] + gp[:, :, r])
        suffix.append(suffix[-1] + gp[:, :, CHUNK - r])
    G, Gs = torch.stack(prefix, dim=2), torch.stack(suffix[::-1], dim=2)
    G_last = G[:, :, CHUNK - 1]
    decay = ex2_approx(G)
    qd, kd = (qh * decay).bfloat16(), (kh * decay).bfloat16()
    rest = ex2_approx(G_last[:, :, None, :] - G) if scheme == "kinv" else ex2_approx(Gs)
    kr = (kh * rest).bfloat16()

    A, A_qk = _scheme_products(scheme, qh, kh, gp, G, qd, kd)
    L = torch.tril(beta_t[..., None] * A, diagonal=-1).half()
    mqk = torch.tril(A_qk).bfloat16()
    inv = _neumann_inverse(L)

    ws = _workspace(dict(qd=qd, kd=kd, kr=kr, gt=ex2_approx(G_last), inv=inv, mqk=mqk, beta=beta_t), tile_map)
    return _K1GateValues(tile_map, consts, qh, kh, gp, G, Gs, beta_t, A, A_qk, qhat, khat, rinv_q, rinv_k, ws)


def mirror_prepare_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scheme: str = "dyadic",
    gate: str = "softplus",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> Workspace:
    """A proposed K1 for every gate (docs/numerics.md, "Unbounded gates") with its rounding → a K1 workspace.

    q, k bf16 ``[B, T, H, D]``; g ``[B, T, HV, D]`` or ``[B, T, HV]`` (bf16 or fp32: the raw gate, or the log
    decay itself for ``gate="none"``); beta ``[B, T, HV]``; A_log fp32 ``[HV]`` (None: e^A = 1); dt_bias fp32
    ``[HV, D]`` / ``[HV*D]`` (per channel) or ``[HV]`` (per head), None for none. Everything ahead of L and
    Mqk as today's K1 (l2norm, β, the prefix G, qd, kd, gT = ex2(G_last)) except the gate forms and, for every
    scheme but ``"kinv"``, ``kr = bf16(kh · ex2(Gs))`` with the suffix ``Gs`` its own running sum. ``scheme``:

    - ``"kinv"``: today's tensor-core products with ``kinv = bf16(kh · ex2(−G))`` (overflows past 2^128);
    - ``"middle"``: one tensor-core product factorised around row 7 with a per-row exponent guard;
    - ``"halves"``: the pairs straddling row 7 on the tensor cores (both factors ≤ 1), the pairs inside each
      8-row half and Mqk's diagonal on CUDA cores in fp32;
    - ``"dyadic"``: four straddle levels (blocks of 16, 8, 4, 2 rows) on the tensor cores, every factor ≤ 1;
      Mqk's diagonal on CUDA cores;
    - ``"pairwise"``: every pair on CUDA cores in fp32 (``t = f32(kh_j·E_ij)``, two fp32 sums);
    - ``"per_head"``: per-head gates only (GatedDeltaNet): ``A = E ⊙ (bf16 kh · bf16 khᵀ)``.

    Then ``L = f16(f32(β·A))``, ``Mqk = bf16(A_qk)`` and INV by the fp16 Neumann product, as today. With
    ``scheme="kinv"`` and the safe gate this is :func:`~.mirror.mirror_prepare` bit for bit. Returns a
    Workspace ``[HV · tiles, ...]`` in the kernels' dtypes (slots that are no tile NaN).
    """
    values = _k1_gate_values(q, k, g, beta, scheme=scheme, gate=gate, A_log=A_log, dt_bias=dt_bias,
                             lower_bound=lower_bound, scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm,
                             beta_logits=beta_logits)
    return values.workspace


# ---------------------------------------------------------------------------------------------
# The rounded backward of the unbounded gates: the tile-gradient kernel's proposed arithmetic


def _rounded_pair_backward(values: _K1GateValues, scheme: str, dA: torch.Tensor, dMqk: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dqh, dkh, dγ per channel, dγ per head or None) of the pair terms, with a kernel's rounding.

    ``dA = bf16(β ⊙ dL)`` (strictly lower), ``dMqk`` bf16 (lower with the diagonal) ``[HV, tiles, 16, 16]``.
    dyadic (:func:`dyadic_tile_products_backward`'s plan): per level the bf16 operands X, Q of the forward,
    three tensor-core products ``P = dA_ℓ X``, ``Pq = dM_ℓ X``, ``C = dA_ℓᵀ X + dM_ℓᵀ Q`` (one fp32
    accumulator), ``dqh += factor ⊙ Pq``, ``dkh += factor ⊙ (P + C)`` and the straddle sums of
    ``X⊙P + Q⊙Pq`` and ``X⊙C`` for dγ. per_head: ``dP = bf16(E ⊙ dA)``, ``dPq = bf16(E ⊙ dMqk)`` on the
    tensor cores against the bf16 rows k̂, q̂; ``dγ_s = Σ_{i≥s>j} E_ij (dA_ij P_ij + dM_ij Pq_ij)`` per head.
    Mqk's diagonal: ``dqh += dM_ii kh_i``, ``dkh += dM_ii qh_i`` (fp32) in the dyadic scheme, inside the
    product in the per-head one.
    """
    qh, kh = values.qh, values.kh
    rows = torch.arange(CHUNK, device=qh.device)
    zero = torch.zeros((), dtype=torch.bfloat16, device=qh.device)
    if scheme == "per_head":
        spans = _decay_spans(ex2_approx(values.gp[..., :1]))[..., 0]
        k16, q16 = kh.bfloat16(), qh.bfloat16()
        dP = (spans * dA.float()).bfloat16()
        dPq = (spans * dMqk.float()).bfloat16()
        dkh = _mma(torch.cat([dP, dP.transpose(-1, -2), dPq.transpose(-1, -2)], -1),
                   torch.cat([k16, k16, q16], -2))
        dqh = _mma(dPq, k16)
        W = spans * (dA.float() * _mma(k16, k16.transpose(-1, -2)) + dMqk.float() * _mma(q16, k16.transpose(-1, -2)))
        crossing = (rows[None, :, None] >= rows[:, None, None]) & (rows[:, None, None] > rows[None, None, :])  # [s, i, j]
        dgamma_head = torch.einsum("sij,...ij->...s", crossing.double(), torch.tril(W, diagonal=-1).double()).float()
        return dqh, dkh, torch.zeros_like(qh), dgamma_head
    a = ex2_approx(values.gp)
    diagonal = torch.diagonal(dMqk, dim1=-2, dim2=-1).float()[..., None]
    dqh, dkh = diagonal * kh, diagonal * qh
    dgamma = torch.zeros_like(qh)
    for block in DYADIC_BLOCKS:
        X, Q, mask = _straddle_operands(qh, kh, a, block)
        factor = _running_straddle_factor(a, block)
        _, upper, _ = _straddle_geometry(block, qh.device)
        dA_level, dM_level = torch.where(mask, dA, zero), torch.where(mask, dMqk, zero)
        P, Pq = _mma(dA_level, X), _mma(dM_level, X)
        C = _mma(torch.cat([dA_level.transpose(-1, -2), dM_level.transpose(-1, -2)], -1), torch.cat([X, Q], -2))
        dqh = dqh + factor * Pq
        dkh = dkh + factor * (P + C)
        from_s, before_s = _straddle_sums((X.float() * P + Q.float() * Pq).double(), (X.float() * C).double(),
                                          block, upper)
        dgamma = dgamma + (from_s + before_s).float()
    return dqh, dkh, dgamma, None


def mirror_backward_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    gate: str = "softplus",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """The backward of the unbounded gates with a kernel's rounding (a proposal: no kernel implements it yet).

    The forward through :func:`mirror_prepare_gates` (scheme ``"dyadic"``; ``"per_head"`` for a per-head g
    ``[B, T, HV]``, the scheme proposed for GatedDeltaNet's K1) and K2's mirror with the state entering every
    tile, Kernel A's mirror (unchanged: it
    reads the workspace only), then per tile Kernel B's terms with kinv replaced by the pair terms of
    :func:`_rounded_pair_backward` and dγ in the straddle form of :func:`chunk_backward_pairwise_exact`
    (natural log units: ``γ = g'·ln 2``): bf16 mma operands, fp32 accumulators and element-wise values,
    reductions rounded once. The gate in fp32: softplus ``dx = −e^A σ(x) dγ`` with
    ``σ(x) = 1 / (1 + 2^(−x·log2 e))``, ``dA_log = Σ dγ·γ``; a log decay ``dg = dγ``; per-head gates sum dγ over
    the channels; dq, dk through the l2norm backward per value head, rounded to bf16, then summed over each group
    of value heads in fp32.

    Inputs bf16 as the kernels take them (g fp32 allowed for gate "none"), shapes as :func:`~.gold.gold_forward`,
    ``initial_state`` / ``dht`` v-first ``[N, HV, V, K]``. Returns :func:`~.backward.gold_backward`'s keys: dq,
    dk, dv, dbeta bf16; dg bf16 per channel, fp32 for a per-head gate (as Kernel B writes it); dA_log, ddt_bias
    fp32 (None for a None input); dh0 fp32 (None without an initial state).
    """
    if gate not in ("softplus", "none"):
        raise ValueError(f"gate must be 'softplus' or 'none' (the safe gate's is mirror_backward), got {gate!r}")
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    per_head = g.dim() == 3
    scheme = "per_head" if per_head else "dyadic"
    values = _k1_gate_values(q, k, g, beta, scheme=scheme, gate=gate, A_log=A_log, dt_bias=dt_bias,
                             lower_bound=-5.0,  # the safe gate's constant: unused by these gates
                             scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    ws, tile_map = values.workspace, values.tile_map
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    states = torch.full(block_states_shape(ws, value_heads, num_seqs, _PER_TILE), math.nan, dtype=torch.bfloat16,
                        device=q.device)
    mirror_recurrence(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state, checkpoints=states,
                      checkpoint_every=_PER_TILE)
    scan = mirror_bwd_scan(ws, do, cu_seqlens=cu_seqlens, dht=dht, snapshot_every=_PER_TILE)
    grads = _gate_tile_gradients(values, ws, q, k, v, g, beta, do, scan.du, states, scan.snapshots, gate=gate,
                                 A_log=A_log, dt_bias=dt_bias, beta_logits=beta_logits)
    return {**grads, "dv": scan.dv, "dh0": None if initial_state is None else scan.dh0}


def mirror_bwd_grads_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    du: torch.Tensor,
    ws: Workspace,
    states: torch.Tensor,
    state_grads: torch.Tensor,
    *,
    gate: str,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> dict[str, torch.Tensor | None]:
    """Kernel B's stage of :func:`mirror_backward_gates` on a chain's own intermediates (the per-head gate's
    Kernel B, docs/numerics.md, "Kernel B for a per-head gate"): K1's quantities recomputed from the raw inputs
    (the per-head scheme for g ``[B, T, HV]``, else dyadic), INV, gT and β read from ``ws`` (the forward's
    workspace), ``states`` / ``state_grads`` the per-tile checkpoints and Kernel A's snapshots, ``du`` Kernel A's.
    Returns dq, dk, dbeta (bf16, dq and dk summed over each group of value heads), dg (fp32 for a per-head gate,
    as Kernel B writes it; bf16 per channel) and dA_log, ddt_bias (fp32; None for a None input)."""
    scheme = "per_head" if g.dim() == 3 else "dyadic"
    values = _k1_gate_values(q, k, g, beta, scheme=scheme, gate=gate, A_log=A_log, dt_bias=dt_bias,
                             lower_bound=-5.0, scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm,
                             beta_logits=beta_logits)
    return _gate_tile_gradients(values, ws, q, k, v, g, beta, do, du, states, state_grads, gate=gate, A_log=A_log,
                                dt_bias=dt_bias, beta_logits=beta_logits)


def _gate_tile_gradients(values: _K1GateValues, ws: Workspace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor, du: torch.Tensor,
                         states: torch.Tensor, state_grads: torch.Tensor, *, gate: str, A_log: torch.Tensor | None,
                         dt_bias: torch.Tensor | None, beta_logits: bool) -> dict[str, torch.Tensor | None]:
    """The tile gradients of the unbounded gates with a kernel's rounding (the body of
    :func:`mirror_bwd_grads_gates`); ``values`` K1's recompute, ``ws`` the workspace INV, gT are read from."""
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    per_head = g.dim() == 3
    scheme = "per_head" if per_head else "dyadic"
    tile_map = values.tile_map
    S = _tile_blocks(states, value_heads, tile_map, _KERNEL)  # bf16 [HV, tiles, K, V]
    dS = _tile_blocks(state_grads, value_heads, tile_map, _KERNEL)

    def tiles_of(x: torch.Tensor) -> torch.Tensor:
        return _to_tiles(x.reshape(batch * seq_len, value_heads, value_dim), tile_map)

    ws_tiles = type(ws)(*(x.view(value_heads, -1, *x.shape[1:]) for x in ws))
    exists = tile_map.slot_exists.reshape(1, -1, 1, 1)
    qd, kd, kr, inv = (torch.where(exists, x, torch.zeros_like(x)) for x in (ws_tiles.qd, ws_tiles.kd, ws_tiles.kr,
                                                                              ws_tiles.inv))
    gt = torch.where(tile_map.slot_exists.reshape(1, -1, 1), ws_tiles.gt, torch.zeros_like(ws_tiles.gt))
    v_t, do_t, du_t = tiles_of(v), tiles_of(do), tiles_of(du)
    beta_col = values.beta[..., None]
    # K2's recompute, Kernel B's products (docs/numerics.md, "Backward: Kernel B")
    w = v_t.float() - _mma(kd, S)
    U = _mma(inv, (w * beta_col).bfloat16()).bfloat16()
    dMqk = torch.tril(_mma(do_t, U.transpose(-1, -2))).bfloat16()
    dL = torch.tril(-_mma(du_t, U.transpose(-1, -2)), diagonal=-1)
    dA = (beta_col * dL).bfloat16()
    bdu = (beta_col * du_t.float()).bfloat16()
    dqd = _mma(do_t, S.transpose(-1, -2))
    dkd = _mma(-bdu, S.transpose(-1, -2))
    dkr = _mma(U, dS.transpose(-1, -2))
    dgT = _dot_f32(S, dS, -1)
    dbeta_t = _dot_f32(torch.cat([du_t.float(), dL], -1), torch.cat([w, values.A], -1), -1)
    dqh, dkh, dgamma, dgamma_head = _rounded_pair_backward(values, scheme, dA, dMqk)
    dqh = dqh + dqd * ex2_approx(values.G)
    dkh = dkh + dkd * ex2_approx(values.G) + dkr * ex2_approx(values.Gs)
    # rows r ≥ s (qd, kd) and r < s (kr) carry token s's decay
    rows_from_s, rows_before_s = _crossing_rows((dqd * qd.float() + dkd * kd.float()).double(),
                                                (dkr * kr.float()).double())
    dgamma = (dgamma.double() + rows_from_s + rows_before_s + (dgT * gt)[:, :, None].double()).float()

    def untile(x: torch.Tensor) -> torch.Tensor:
        return _untile(x, tile_map)

    def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _dot_f32(a, b, -1)[..., None]

    tokens = batch * seq_len
    group = value_heads // heads

    def per_value_head(dx_hat: torch.Tensor, x_hat: torch.Tensor | None, rinv: torch.Tensor | None) -> torch.Tensor:
        """The l2norm backward per value head, rounded to bf16 there, then summed over each group in fp32 (Kernel
        B writes dq, dk per value head; docs/numerics.md, "Kernel B for a per-head gate")."""
        if group > 1 and x_hat is not None:
            x_hat, rinv = x_hat.repeat_interleave(group, dim=1), rinv.repeat_interleave(group, dim=1)
        dx = _qk_backward(dx_hat, x_hat, rinv, row_dot).bfloat16()
        return dx.float().view(tokens, heads, group, -1).sum(2) if group > 1 else dx

    dq = per_value_head(untile(dqh) * values.consts.scale, values.qhat, values.rinv_q)
    dk = per_value_head(untile(dkh), values.khat, values.rinv_k)
    dgamma_tokens = untile(dgamma)  # [tokens, HV, K] w.r.t. the natural log decay
    gamma = untile(values.gp) * LN2
    if per_head:  # one decay per head: its channels' terms summed, then the head's pair terms
        dgamma_tokens = _dot_f32(dgamma_tokens, torch.ones((), device=q.device), -1) + untile(dgamma_head[..., None])[..., 0]
        gamma = gamma[..., 0]
    dA_log = ddt_bias = None
    if gate == "none":
        dg = dgamma_tokens
    else:
        shape = (value_heads,) if per_head else (value_heads, key_dim)
        x = g.reshape(tokens, *g.shape[2:]).float()
        if dt_bias is not None:
            x = x + dt_bias.float().reshape(shape)
        e_a = torch.ones(value_heads, device=q.device) if A_log is None else ex2_approx(
            A_log.float().reshape(value_heads) * values.consts.log2e)
        e_a = e_a if per_head else e_a[:, None]
        sigmoid = 1.0 / (1.0 + ex2_approx(-(x * values.consts.log2e)))
        dg = -(e_a * sigmoid) * dgamma_tokens
        if A_log is not None:
            dA_log = _dot_f32(dgamma_tokens, gamma, (0,) if per_head else (0, 2))
        if dt_bias is not None:
            ddt_bias = _dot_f32(dg, torch.ones((), device=q.device), 0).reshape(dt_bias.shape)
    dbeta = untile(dbeta_t)
    if beta_logits:
        activated = untile(values.beta)
        dbeta = dbeta * activated * (1 - activated)
    return {
        "dq": dq.reshape(q.shape).bfloat16(), "dk": dk.reshape(k.shape).bfloat16(),
        # a per-head gate's dg is Kernel B's fp32 [B, T, HV] output (its token's channel sum, not rounded); a
        # per-channel dg is bf16
        "dg": dg.reshape(g.shape) if per_head else dg.reshape(g.shape).bfloat16(),
        "dbeta": dbeta.reshape(beta.shape).bfloat16(),
        "dA_log": dA_log, "ddt_bias": ddt_bias,
    }
