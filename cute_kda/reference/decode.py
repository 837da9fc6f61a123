"""Decode and speculative verify on a state pool (issue 32): the decode kernel's mirror and an fp64 reference.

Per sequence ``n`` and value head ``j`` (q/k head ``j // (HV / H)``), tokens ``t = 0 .. T-1``::

    S ← Diag(exp g_t) S;   S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;   o_t = Sᵀ (scale · q_t)

with ``S[k, v]`` the state of one head. The state lives in a pool ``[slots, HV, V, K]`` (``"vk"``: V-first,
``pool[slot, j, v, k] = S[k, v]``) or ``[slots, HV, K, V]`` (``"kv"``), fp32 or bf16, addressed by int32 slot
ids (the FLA ``fused_recurrent_kda_fwd`` contract with ``ssm_state_indices``, ``inplace_final_state=True``):

- **decode**: ``state_indices [N]``; the state is read from slot ``state_indices[n]`` and the state after the
  last token is written back to it;
- **verify** (speculative decoding): ``state_indices [N, T]`` and ``num_accepted_tokens [N]``; the state is
  read from slot ``state_indices[n, num_accepted_tokens[n] − 1]`` and the state after token ``t`` is written
  to slot ``state_indices[n, t]`` — skipped where that entry is −1 (vLLM's rule);
- a row whose read slot is −1 is padding: nothing is read or written, its output rows are zero.

:func:`mirror_decode` is the kernel's arithmetic in torch fp32, operation by operation (the rounding of
docs/numerics.md's K1 for the gate, l2norm and β; the per-thread order of the dot products below; the bf16
rounding of a bf16 pool on every store); on a CPU the approximate intrinsics are torch's accurate functions
(:mod:`.mirror`). :func:`gold_decode` is the same contract on the fp64 token recurrence of :mod:`.gold`.

The kernel's dot products over the 128 key channels (``Sᵀk`` and ``Sᵀq`` of each value row) are split over 8
lanes of 16 channels each: each lane sums its channels with one fused multiply-add per channel in the order
of :func:`channel_order`, then a butterfly over the 8 lanes (xor 4, 2, 1) adds the partials. The same
split computes ``Σx²`` of the l2norm (plain adds; a bf16 square is exact). The update ``S + k·u`` is one
fused multiply-add per element and the decay one multiply.
"""

from __future__ import annotations

import torch

from ..numerics import EPS
from .gates import _base2_log_decay
from .gold import STATE_LAYOUTS, channel_log_decay, l2norm, value_head_group
from .mirror import Constants, ex2_approx, sigmoid_approx

DIM = 128  # K = V: the head size the kernel is written for
LANES = 8  # lanes sharing one value row's dot products
CHANNELS_PER_LANE = DIM // LANES
VECTOR_BYTES = 16  # one wide load


def channel_order(state_layout: str, state_dtype: torch.dtype) -> torch.Tensor:
    """int64 ``[8, 16]``: the key channels of lane ``j`` in the order its partial sums take them.

    V-first: a state row is contiguous in k, so lane ``j`` takes the ``e``-th 16-byte vector of each
    ``8·e``-vector stretch (8 lanes read 128 contiguous bytes per load): channel ``i·8E + j·E + c`` for
    ``E = 16 / element bytes``, ``i = 0 .. 16/E − 1``, ``c = 0 .. E − 1``. K-first: lane ``j`` owns the 16
    consecutive k rows ``16 j .. 16 j + 15`` (each a 16-byte vector of E value columns).
    """
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    lanes = torch.arange(LANES)[:, None]
    e = torch.arange(CHANNELS_PER_LANE)[None, :]
    if state_layout == "kv":
        return lanes * CHANNELS_PER_LANE + e
    vector = VECTOR_BYTES // torch.empty((), dtype=state_dtype).element_size()
    return (e // vector) * (LANES * vector) + lanes * vector + e % vector


def read_slots(state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[N]``: the slot each row's state is read from (−1: a padding row)."""
    if num_accepted_tokens is None:
        return state_indices.long()
    rows = torch.arange(state_indices.shape[0], device=state_indices.device)
    return state_indices.long()[rows, num_accepted_tokens.long() - 1]


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``fma.rn(a, b, c)``: the fp32 product is exact in fp64, the sum rounded there and then to fp32
    (that double rounding differs from one rounding in about 1 case of 2^29)."""
    return (a.double() * b.double() + c.double()).float()


def _butterfly(partial: torch.Tensor) -> torch.Tensor:
    """Sum over the lane axis (-1, 8 lanes) in the order of the ``shfl.xor`` butterfly 4, 2, 1."""
    while partial.shape[-1] > 1:
        half = partial.shape[-1] // 2
        partial = partial[..., :half] + partial[..., half:]
    return partial[..., 0]


def _lane_dot(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Σ_k state[..., v, k]·x[..., k]`` as the kernel sums it: ``state [..., V, 8, 16]`` and
    ``x [..., 8, 16]`` in lane order → ``[..., V]``."""
    x = x[..., None, :, :]
    acc = state[..., 0] * x[..., 0]
    for e in range(1, CHANNELS_PER_LANE):
        acc = _fma(state[..., e], x[..., e], acc)
    return _butterfly(acc)


def _lane_rinv(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(Σx² + EPS)`` of fp32 rows ``x [..., 8, 16]`` in lane order → ``[..., 1, 1]``."""
    partial = x[..., 0] * x[..., 0]
    for e in range(1, CHANNELS_PER_LANE):
        partial = partial + x[..., e] * x[..., e]
    return torch.reciprocal(torch.sqrt(_butterfly(partial) + EPS))[..., None, None]


def _to_lanes(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``[..., 128]`` → ``[..., 8, 16]`` in :func:`channel_order`."""
    return x[..., order]


def _from_lanes(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*x.shape[:-2], DIM, dtype=x.dtype, device=x.device)
    out[..., order] = x
    return out


def _as_vk(states: torch.Tensor, state_layout: str) -> torch.Tensor:
    return states if state_layout == "vk" else states.transpose(-1, -2)


def _check_head_dims(q: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor) -> None:
    if q.shape[-1] != DIM or v.shape[-1] != DIM or tuple(state_pool.shape[-2:]) != (DIM, DIM):
        raise ValueError(f"the decode kernel is written for K = V = {DIM}: q {tuple(q.shape)}, v {tuple(v.shape)}, "
                         f"state_pool {tuple(state_pool.shape)}")


def mirror_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    *,
    gate: str,
    scale: float,
    lower_bound: float = -5.0,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    state_layout: str = "vk",
) -> torch.Tensor:
    """One decode (or verify) call with the kernel's rounding; updates ``state_pool`` in place, returns o.

    q, k ``[N, T, H, 128]``, v ``[N, T, HV, 128]``, g ``[N, T, HV, 128]`` (per channel) or ``[N, T, HV]``
    (per head), beta ``[N, T, HV]`` (bf16, or any float taken as is), A_log fp32 ``[HV]`` and dt_bias fp32
    ``[HV, 128]`` (``[HV]`` with a per-head gate; both None for ``gate="none"``); ``state_pool``
    ``[slots, HV, V, K]`` (``state_layout="vk"``) or ``[slots, HV, K, V]``, fp32 or bf16; ``state_indices``
    int ``[N]`` (decode) or ``[N, T]`` with ``num_accepted_tokens`` ``[N]`` (verify); see the module doc.
    Returns o bf16 ``[N, T, HV, 128]``.
    """
    _check_head_dims(q, v, state_pool)
    batch, steps, heads = q.shape[:3]
    value_heads = v.shape[2]
    group = value_head_group(heads, value_heads)
    consts = Constants.make(lower_bound, scale)
    order = channel_order(state_layout, state_pool.dtype).to(q.device)
    slots = read_slots(state_indices, num_accepted_tokens)
    live = (slots >= 0).nonzero().flatten()
    out = torch.zeros(batch, steps, value_heads, DIM, dtype=torch.bfloat16, device=q.device)
    if live.numel() == 0:
        return out

    # per token, live rows only: the operands of the update in lane order
    q32, k32 = q[live].float(), k[live].float()
    q_lanes, k_lanes = _to_lanes(q32, order), _to_lanes(k32, order)
    if qk_l2norm:
        q_lanes = q_lanes * (_lane_rinv(q_lanes) * consts.scale)
        k_lanes = k_lanes * _lane_rinv(k_lanes)
    else:
        q_lanes = q_lanes * consts.scale
    q_lanes = q_lanes.repeat_interleave(group, dim=2)  # [n, T, HV, 8, 16]
    k_lanes = k_lanes.repeat_interleave(group, dim=2)
    g_live = g[live]
    tokens = g_live.reshape(-1, *g_live.shape[2:])
    gp = _base2_log_decay(tokens, DIM, gate, A_log, dt_bias, consts)
    decay = _to_lanes(ex2_approx(gp.contiguous()).reshape(*g_live.shape[:3], DIM), order)
    beta32 = beta[live].float()
    beta_act = sigmoid_approx(beta32) if beta_logits else beta32
    v32 = v[live].float()

    state = _to_lanes(_as_vk(state_pool[slots[live]], state_layout).float(), order)  # [n, HV, V, 8, 16]
    for t in range(steps):
        state = state * decay[:, t, :, None]
        predicted = _lane_dot(state, k_lanes[:, t])
        u = beta_act[:, t, :, None] * (v32[:, t] - predicted)
        state = _fma(k_lanes[:, t, :, None], u[..., None, None], state)
        out[live, t] = _lane_dot(state, q_lanes[:, t]).bfloat16()
        if num_accepted_tokens is not None:
            _store(state_pool, state_indices[live, t].long(), state, order, state_layout)
    if num_accepted_tokens is None:
        _store(state_pool, slots[live], state, order, state_layout)
    return out


def _store(state_pool: torch.Tensor, slots: torch.Tensor, state_lanes: torch.Tensor, order: torch.Tensor,
           state_layout: str) -> None:
    """The states (lane order, fp32) into the pool's slots, rounded to the pool's dtype; −1 slots skipped."""
    keep = slots >= 0
    states = _as_vk(_from_lanes(state_lanes[keep], order), state_layout)
    state_pool[slots[keep]] = states.to(state_pool.dtype)


def gold_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    *,
    gate: str,
    scale: float,
    lower_bound: float = -5.0,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    state_layout: str = "vk",
) -> torch.Tensor:
    """:func:`mirror_decode`'s contract on the exact token recurrence in float64 (:mod:`.gold`'s gates and
    l2norm); the pool (any dtype; fp64 keeps it exact) is updated in place. Returns o float64."""
    _check_head_dims(q, v, state_pool)
    batch, steps, heads = q.shape[:3]
    value_heads = v.shape[2]
    group = value_head_group(heads, value_heads)
    slots = read_slots(state_indices, num_accepted_tokens)
    live = (slots >= 0).nonzero().flatten()
    out = torch.zeros(batch, steps, value_heads, DIM, dtype=torch.float64, device=q.device)
    if live.numel() == 0:
        return out
    f64 = torch.float64
    q64, k64 = q[live].to(f64), k[live].to(f64)
    if qk_l2norm:
        q64, k64 = l2norm(q64), l2norm(k64)
    q64 = (q64 * scale).repeat_interleave(group, dim=2)
    k64 = k64.repeat_interleave(group, dim=2)
    params = {name: None if t is None else t.to(f64) for name, t in (("A_log", A_log), ("dt_bias", dt_bias))}
    decay = torch.exp(channel_log_decay(g[live].to(f64), DIM, per_head=g.dim() == 3, gate=gate,
                                        lower_bound=lower_bound, **params))
    beta64 = torch.sigmoid(beta[live].to(f64)) if beta_logits else beta[live].to(f64)
    v64 = v[live].to(f64)

    state = _as_vk(state_pool[slots[live]], state_layout).to(f64).transpose(-1, -2)  # S[k, v]
    for t in range(steps):
        state = state * decay[:, t, :, :, None]
        predicted = torch.einsum("nhk,nhkv->nhv", k64[:, t], state)
        u = beta64[:, t, :, None] * (v64[:, t] - predicted)
        state = state + k64[:, t, :, :, None] * u[:, :, None, :]
        out[live, t] = torch.einsum("nhk,nhkv->nhv", q64[:, t], state)
        if num_accepted_tokens is not None:
            _store_exact(state_pool, state_indices[live, t].long(), state, state_layout)
    if num_accepted_tokens is None:
        _store_exact(state_pool, slots[live], state, state_layout)
    return out


def _store_exact(state_pool: torch.Tensor, slots: torch.Tensor, state_kv: torch.Tensor, state_layout: str) -> None:
    keep = slots >= 0
    states = state_kv[keep] if state_layout == "kv" else state_kv[keep].transpose(-1, -2)
    state_pool[slots[keep]] = states.to(state_pool.dtype)
