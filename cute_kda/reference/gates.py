"""Mirrors of the unbounded gates' kernels (issue 12): K1's two overflow-free schemes and Kernel B's variants
for them, with the kernels' rounding.

The safe gate's K1 (docs/numerics.md, K1) forms ``L`` and ``Mqk`` as tensor-core products of ``kd``/``qd`` with
``kinv = k̂ ⊙ 2^−G``, which overflows as soon as one channel decays by more than 2^128 inside a tile: the
softplus gate of Kimi-Linear (unbounded below), a precomputed log decay with −1000 masks. The unbounded gates'
K1 takes every pair's decay from the tokens between the two rows only (docs/numerics.md, "The pair-decay
formulation"; its float64 chain is :mod:`.exact`), by one of two schemes (:data:`K1_SCHEMES`):

- ``"dyadic"`` (a per-channel gate): four straddle levels on the tensor cores, every factor ≤ 1;
- ``"per_head"`` (a per-head gate, GatedDeltaNet): ``A = E ⊙ (k̂ k̂ᵀ)`` with one decay matrix per tile.

:func:`mirror_prepare_gates` is K1 (``PrepareKernel(gate="softplus" | "none")``), :func:`bwd_grads_gates`
Kernel B (``BwdGrads(gate=…)``); K2 and Kernel A are the safe gate's (they only read the workspace), and
:func:`~.backward.mirror_backward` runs the whole chain for every gate.

Shapes: q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; beta ``[B, T, HV]``; g ``[B, T, HV, K]`` (per-channel
gate) or ``[B, T, HV]`` (per-head gate, GatedDeltaNet); HV a multiple of H (value head ``j`` reads q/k head
``j // (HV / H)``). Workspaces are per value head: ``[HV · tiles, ...]``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..executors.stages import GradsResult
from ..numerics import DYADIC_BLOCKS, LN2
from ..workspace import CHUNK, Workspace
from .common import (
    KERNEL, Constants, TileMap, check_activations, crossing_rows, dot_f32, ex2_approx, l2norm_rinv, lg2_approx, mma,
    neumann_inverse, qk_backward, row_dot, sigmoid_approx, straddle_geometry, straddle_sums, tile_blocks, to_tiles,
    token_tile_map, untile, workspace_of_tiles,
)
from .gold import expand_to_value_heads, value_head_group

# K1's schemes for the unbounded gates (docs/numerics.md, "Ways to compute A and Mqk"), as the kernels run them
K1_SCHEMES = ("dyadic", "per_head")


def scheme_of(g: torch.Tensor) -> str:
    """The K1 scheme the kernels run for an unbounded gate ``g``: ``"per_head"`` for ``[B, T, HV]``, else
    ``"dyadic"``."""
    return "per_head" if g.dim() == 3 else "dyadic"


# ---------------------------------------------------------------------------------------------
# K1


def _base2_log_decay(
    g: torch.Tensor, key_dim: int, gate: str, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    consts: Constants,
) -> torch.Tensor:
    """K1's fp32 base-2 log decay g' per token ``[tokens, HV, K]`` from g ``[tokens, HV, K]`` or ``[tokens, HV]``.

    safe: ``c_gate · sigmoid_approx(eA·(g + b))`` as the safe K1; softplus: with ``y = f32(f32(g + b)·LOG2E)``,
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


def _running_straddle_factor(a: torch.Tensor, block: int) -> torch.Tensor:
    """K1's factors of one straddle level ``[..., 16, K]`` fp32 from ``a = ex2(g')`` (their exact values:
    :func:`~.exact.dyadic_tile_products`), as running products outward from each block's middle row m: upper rows
    ``f_{m+1} = a_{m+1}``, ``f_r = f32(f_{r−1}·a_r)``; lower rows ``f_m = 1``, ``f_r = f32(f_{r+1}·a_{r+1})``. The
    upper rows equal the spans ``E[r, m]`` bit for bit; the lower ones are ``E[m, r]`` multiplied from the other
    end."""
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


def _straddle_operands(qh: torch.Tensor, kh: torch.Tensor, a: torch.Tensor, block: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One straddle level with K1's factors (:func:`_running_straddle_factor`): (X, Q, mask),
    X = bf16(kh ⊙ factor) on every row, Q = bf16(qh ⊙ factor) on upper rows (0 on lower rows) ``[..., 16, K]``."""
    factor = _running_straddle_factor(a, block)
    _, upper, mask = straddle_geometry(block, kh.device)
    X = (kh * factor).bfloat16()
    Q = torch.where(upper[:, None], qh * factor, torch.zeros((), device=kh.device)).bfloat16()
    return X, Q, mask


def _scheme_products(scheme: str, qh: torch.Tensor, kh: torch.Tensor, gp: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_kk, A_qk) fp32 ``[..., 16, 16]`` of one K1 scheme (only the lower triangle is used)."""
    if scheme == "per_head":  # one decay per head: A = E ⊙ (k̂ k̂ᵀ), the product of the undecayed bf16 rows
        if bool((gp != gp[..., :1]).any()):
            raise ValueError("scheme 'per_head' needs a per-head gate (the same decay on every channel)")
        spans = _decay_spans(ex2_approx(gp[..., :1]))[..., 0]
        k16 = kh.bfloat16()
        return (spans * mma(k16, k16.transpose(-1, -2)),
                spans * mma(qh.bfloat16(), k16.transpose(-1, -2)))
    # dyadic: every pair i > j on one level's tensor-core product; the diagonal in K1's order
    a = ex2_approx(gp)
    A = torch.zeros(*gp.shape[:-1], CHUNK, dtype=torch.float32, device=gp.device)
    A_qk = torch.diag_embed(row_dot(qh, kh))
    for block in DYADIC_BLOCKS:
        X, Q, mask = _straddle_operands(qh, kh, a, block)
        A = torch.where(mask, mma(X, X.transpose(-1, -2)), A)
        A_qk = torch.where(mask, mma(Q, X.transpose(-1, -2)), A_qk)
    return A, A_qk


class _K1GateValues(NamedTuple):
    """What the unbounded gates' K1 computes, kept for the backward's recompute (Kernel B's operands).

    Per value head and tile ``[HV, tiles, 16, ...]``: qh (= q̂·scale), kh fp32 ``[.., K]``; gp (g', base 2),
    G (prefix), Gs (suffix) fp32 ``[.., K]``; beta (activated) ``[..]``; A, A_qk fp32 ``[.., 16]`` (the
    scheme's pair sums). Per token and q/k head ``[tokens, H, K]``: qhat, khat (l2-normalised, unscaled) and
    rinv_q, rinv_k ``[tokens, H, 1]`` (None without the l2norm). The workspace as K1 writes it.
    """

    tile_map: TileMap
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
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scheme: str | None = None,
    gate: str = "softplus", A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0, scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True, beta_logits: bool = True,
) -> _K1GateValues:
    """:func:`mirror_prepare_gates`' arithmetic (its arguments), with the values it passes through."""
    if scheme is None:
        scheme = scheme_of(g)
    check_activations(q=q, k=k)
    if scheme not in K1_SCHEMES:
        raise ValueError(f"scheme must be one of {K1_SCHEMES}, got {scheme!r}")
    batch, seq_len, heads, dim = q.shape
    value_heads = beta.shape[2]
    group = value_head_group(heads, value_heads)
    total = batch * seq_len
    consts = Constants.make(lower_bound, dim ** -0.5 if scale is None else scale)
    tile_map = token_tile_map(q, cu_seqlens)

    q32, k32 = (x.reshape(total, heads, dim).float() for x in (q, k))
    qhat = khat = rinv_q = rinv_k = None
    if qk_l2norm:
        rinv_q, rinv_k = l2norm_rinv(q32, consts.eps), l2norm_rinv(k32, consts.eps)
        qhat, khat = q32 * rinv_q, k32 * rinv_k  # for the l2norm backward (unscaled)
        q_hat, k_hat = q32 * (rinv_q * consts.scale), khat
    else:
        q_hat, k_hat = q32 * consts.scale, k32
    qh = to_tiles(expand_to_value_heads(q_hat, group, dim=1), tile_map)  # [HV, tiles, 16, D]
    kh = to_tiles(expand_to_value_heads(k_hat, group, dim=1), tile_map)
    gp = to_tiles(_base2_log_decay(g.reshape(total, *g.shape[2:]), dim, gate, A_log, dt_bias, consts), tile_map)
    beta32 = beta.reshape(total, value_heads).float()
    beta_t = to_tiles(sigmoid_approx(beta32) if beta_logits else beta32, tile_map)

    prefix, suffix = [gp[:, :, 0]], [torch.zeros_like(gp[:, :, 0])]
    for r in range(1, CHUNK):
        prefix.append(prefix[-1] + gp[:, :, r])
        suffix.append(suffix[-1] + gp[:, :, CHUNK - r])
    G, Gs = torch.stack(prefix, dim=2), torch.stack(suffix[::-1], dim=2)
    G_last = G[:, :, CHUNK - 1]
    decay = ex2_approx(G)
    qd, kd = (qh * decay).bfloat16(), (kh * decay).bfloat16()
    kr = (kh * ex2_approx(Gs)).bfloat16()

    A, A_qk = _scheme_products(scheme, qh, kh, gp)
    L = torch.tril(beta_t[..., None] * A, diagonal=-1).half()
    mqk = torch.tril(A_qk).bfloat16()
    inv = neumann_inverse(L)

    ws = workspace_of_tiles(dict(qd=qd, kd=kd, kr=kr, gt=ex2_approx(G_last), inv=inv, mqk=mqk, beta=beta_t), tile_map)
    return _K1GateValues(tile_map, consts, qh, kh, gp, G, Gs, beta_t, A, A_qk, qhat, khat, rinv_q, rinv_k, ws)


def mirror_prepare_gates(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **options: Any
                         ) -> Workspace:
    """The unbounded gates' K1 (docs/numerics.md, "The dyadic K1 as built", "The per-head K1 as built") with
    its rounding → a K1 workspace. ``options``: ``scheme``, ``gate`` ("softplus" unless given), ``A_log``,
    ``dt_bias``, ``lower_bound``, ``scale``, ``cu_seqlens``, ``qk_l2norm``, ``beta_logits`` (by default None, except
    lower_bound −5 and qk_l2norm, beta_logits True).

    q, k bf16 ``[B, T, H, D]``; g ``[B, T, HV, D]`` or ``[B, T, HV]`` (bf16 or fp32: the raw gate, or the log
    decay itself for ``gate="none"``); beta ``[B, T, HV]``; A_log fp32 ``[HV]`` (None: e^A = 1); dt_bias fp32
    ``[HV, D]`` / ``[HV*D]`` (per channel) or ``[HV]`` (per head), None for none. ``gate`` "softplus", "none"
    or "safe" (the safe gate's form through these schemes; its kernel is :func:`~.mirror.mirror_prepare`'s).
    Everything ahead of L and Mqk as the safe K1 (l2norm, β, the prefix G, qd, kd, gT = ex2(G_last)) except
    the gate forms and ``kr = bf16(kh · ex2(Gs))`` with the suffix ``Gs`` its own running sum. ``scheme``
    (None: :func:`scheme_of` ``g``, as the kernels pick):

    - ``"dyadic"``: four straddle levels (blocks of 16, 8, 4, 2 rows) on the tensor cores, every factor ≤ 1;
      Mqk's diagonal on CUDA cores;
    - ``"per_head"``: per-head gates only (GatedDeltaNet): ``A = E ⊙ (bf16 kh · bf16 khᵀ)``.

    Then ``L = f16(f32(β·A))``, ``Mqk = bf16(A_qk)`` and INV by the fp16 Neumann product, as the safe K1.
    Returns a Workspace ``[HV · tiles, ...]`` in the kernels' dtypes (slots that are no tile NaN).
    """
    return _k1_gate_values(q, k, g, beta, **options).workspace


# ---------------------------------------------------------------------------------------------
# Kernel B


def _rounded_pair_backward(values: _K1GateValues, scheme: str, dA: torch.Tensor, dMqk: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dqh, dkh, dγ per channel, dγ per head or None) of the pair terms, with a kernel's rounding.

    ``dA = bf16(β ⊙ dL)`` (strictly lower), ``dMqk`` bf16 (lower with the diagonal) ``[HV, tiles, 16, 16]``.
    dyadic (:func:`~.exact.dyadic_tile_products_backward`'s plan): per level the bf16 operands X, Q of the forward,
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
        dkh = mma(torch.cat([dP, dP.transpose(-1, -2), dPq.transpose(-1, -2)], -1),
                  torch.cat([k16, k16, q16], -2))
        dqh = mma(dPq, k16)
        W = spans * (dA.float() * mma(k16, k16.transpose(-1, -2)) + dMqk.float() * mma(q16, k16.transpose(-1, -2)))
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
        _, upper, _ = straddle_geometry(block, qh.device)
        dA_level, dM_level = torch.where(mask, dA, zero), torch.where(mask, dMqk, zero)
        P, Pq = mma(dA_level, X), mma(dM_level, X)
        C = mma(torch.cat([dA_level.transpose(-1, -2), dM_level.transpose(-1, -2)], -1), torch.cat([X, Q], -2))
        dqh = dqh + factor * Pq
        dkh = dkh + factor * (P + C)
        from_s, before_s = straddle_sums((X.float() * P + Q.float() * Pq).double(), (X.float() * C).double(),
                                         block, upper)
        dgamma = dgamma + (from_s + before_s).float()
    return dqh, dkh, dgamma, None


def bwd_grads_gates(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    du: torch.Tensor, ws: Workspace, states: torch.Tensor, state_grads: torch.Tensor, *, gate: str,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, scale: float | None, cu_seqlens: torch.Tensor | None,
    qk_l2norm: bool, beta_logits: bool,
) -> GradsResult:
    """Kernel B with an unbounded gate (``BwdGrads(gate=…)``, docs/numerics.md, "Kernel B for a per-head gate" and
    "Kernel B for the per-channel unbounded gates") on a chain's own intermediates: K1's quantities recomputed from
    the raw inputs (:func:`scheme_of` g), INV, gT and β read from ``ws`` (the forward's workspace), ``states`` /
    ``state_grads`` the per-tile checkpoints and Kernel A's snapshots, ``du`` Kernel A's.
    :func:`~.backward.mirror_bwd_grads`' arguments. Returns dq, dk, dbeta (bf16, dq and dk summed over each group of
    value heads), dg (fp32 for a per-head gate, as Kernel B writes it; bf16 per channel) and dA_log, ddt_bias (fp32;
    None for a None input)."""
    scheme = scheme_of(g)
    values = _k1_gate_values(q, k, g, beta, scheme=scheme, gate=gate, A_log=A_log, dt_bias=dt_bias, scale=scale,
                             cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    per_head = scheme == "per_head"
    tile_map = values.tile_map
    S = tile_blocks(states, value_heads, tile_map, KERNEL)  # bf16 [HV, tiles, K, V]
    dS = tile_blocks(state_grads, value_heads, tile_map, KERNEL)

    def tiles_of(x: torch.Tensor) -> torch.Tensor:
        return to_tiles(x.reshape(batch * seq_len, value_heads, value_dim), tile_map)

    ws_tiles = type(ws)(*(x.view(value_heads, -1, *x.shape[1:]) for x in ws))
    exists = tile_map.slot_exists.reshape(1, -1, 1, 1)
    qd, kd, kr, inv = (torch.where(exists, x, torch.zeros_like(x))
                       for x in (ws_tiles.qd, ws_tiles.kd, ws_tiles.kr, ws_tiles.inv))
    gt = torch.where(tile_map.slot_exists.reshape(1, -1, 1), ws_tiles.gt, torch.zeros_like(ws_tiles.gt))
    v_t, do_t, du_t = tiles_of(v), tiles_of(do), tiles_of(du)
    beta_col = values.beta[..., None]
    # K2's recompute, Kernel B's products (docs/numerics.md, "Backward: Kernel B")
    w = v_t.float() - mma(kd, S)
    U = mma(inv, (w * beta_col).bfloat16()).bfloat16()
    dMqk = torch.tril(mma(do_t, U.transpose(-1, -2))).bfloat16()
    dL = torch.tril(-mma(du_t, U.transpose(-1, -2)), diagonal=-1)
    dA = (beta_col * dL).bfloat16()
    bdu = (beta_col * du_t.float()).bfloat16()
    dqd = mma(do_t, S.transpose(-1, -2))
    dkd = mma(-bdu, S.transpose(-1, -2))
    dkr = mma(U, dS.transpose(-1, -2))
    dgT = dot_f32(S, dS, -1)
    dbeta_t = dot_f32(torch.cat([du_t.float(), dL], -1), torch.cat([w, values.A], -1), -1)
    dqh, dkh, dgamma, dgamma_head = _rounded_pair_backward(values, scheme, dA, dMqk)
    dqh = dqh + dqd * ex2_approx(values.G)
    dkh = dkh + dkd * ex2_approx(values.G) + dkr * ex2_approx(values.Gs)
    # rows r ≥ s (qd, kd) and r < s (kr) carry token s's decay
    rows_from_s, rows_before_s = crossing_rows((dqd * qd.float() + dkd * kd.float()).double(),
                                                (dkr * kr.float()).double())
    dgamma = (dgamma.double() + rows_from_s + rows_before_s + (dgT * gt)[:, :, None].double()).float()

    def channel_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return dot_f32(a, b, -1)[..., None]

    tokens = batch * seq_len
    group = value_heads // heads

    def per_value_head(dx_hat: torch.Tensor, x_hat: torch.Tensor | None, rinv: torch.Tensor | None) -> torch.Tensor:
        """The l2norm backward per value head, rounded to bf16 there, then summed over each group in fp32 (Kernel
        B writes dq, dk per value head; docs/numerics.md, "Kernel B for a per-head gate")."""
        if group > 1 and x_hat is not None:
            x_hat, rinv = x_hat.repeat_interleave(group, dim=1), rinv.repeat_interleave(group, dim=1)
        dx = qk_backward(dx_hat, x_hat, rinv, channel_sum).bfloat16()
        return dx.float().view(tokens, heads, group, -1).sum(2) if group > 1 else dx

    dq = per_value_head(untile(dqh, tile_map) * values.consts.scale, values.qhat, values.rinv_q)
    dk = per_value_head(untile(dkh, tile_map), values.khat, values.rinv_k)
    dgamma_tokens = untile(dgamma, tile_map)  # [tokens, HV, K] w.r.t. the natural log decay
    gamma = untile(values.gp, tile_map) * LN2
    if per_head:  # one decay per head: its channels' terms summed, then the head's pair terms
        head_terms = untile(dgamma_head[..., None], tile_map)[..., 0]
        dgamma_tokens = dot_f32(dgamma_tokens, torch.ones((), device=q.device), -1) + head_terms
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
            dA_log = dot_f32(dgamma_tokens, gamma, (0,) if per_head else (0, 2))
        if dt_bias is not None:
            ddt_bias = dot_f32(dg, torch.ones((), device=q.device), 0).reshape(dt_bias.shape)
    dbeta = untile(dbeta_t, tile_map)
    if beta_logits:
        activated = untile(values.beta, tile_map)
        dbeta = dbeta * activated * (1 - activated)
    return GradsResult(
        dq.reshape(q.shape).bfloat16(), dk.reshape(k.shape).bfloat16(),
        # a per-head gate's dg is Kernel B's fp32 [B, T, HV] output (its token's channel sum, not rounded); a
        # per-channel dg is bf16
        dg.reshape(g.shape) if per_head else dg.reshape(g.shape).bfloat16(),
        dbeta.reshape(beta.shape).bfloat16(), dA_log, ddt_bias,
    )
