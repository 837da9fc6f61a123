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

**Packed sequences** (``cu_seqlens`` ``[N + 1]``): q, k, v, g, beta and o are ``[1, total T, ...]``, sequence ``n``
the rows ``cu_seqlens[n] .. cu_seqlens[n + 1] − 1``, ``state_indices`` ``[N]`` or ``[N, S + 1]`` as above (a
verify's sequence at most S + 1 long). A sequence of length 0 reads and writes nothing (its slot keeps its bits:
the kernel does not rewrite it). Each sequence computes exactly as a fixed-length call of its own.

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

from typing import NamedTuple

import torch

from ..numerics import EPS
from .gates import _base2_log_decay
from .common import row_butterfly_sum
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


def _lane_dot(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Σ_k state[..., v, k]·x[..., k]`` as the kernel sums it: ``state [..., V, 8, 16]`` and
    ``x [..., 8, 16]`` in lane order → ``[..., V]``."""
    x = x[..., None, :, :]
    acc = state[..., 0] * x[..., 0]
    for e in range(1, CHANNELS_PER_LANE):
        acc = _fma(state[..., e], x[..., e], acc)
    return row_butterfly_sum(acc)


def _lane_rinv(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(Σx² + EPS)`` of fp32 rows ``x [..., 8, 16]`` in lane order → ``[..., 1, 1]``."""
    partial = x[..., 0] * x[..., 0]
    for e in range(1, CHANNELS_PER_LANE):
        partial = partial + x[..., e] * x[..., e]
    return torch.reciprocal(torch.sqrt(row_butterfly_sum(partial) + EPS))[..., None, None]


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


class _Operands(NamedTuple):
    """One call's live rows ``[n, ...]`` as an arithmetic holds them: q (l2-normalised and scaled), k, the decay
    factor, β (activated) and v per token ``[n, T, HV, ...]``; the states read from the pool ``[n, HV, ...]``."""

    q: torch.Tensor
    k: torch.Tensor
    decay: torch.Tensor
    beta: torch.Tensor
    v: torch.Tensor
    state: torch.Tensor


class _Arithmetic:
    """How one decode call on a pool of ``state_layout`` and ``state_dtype`` computes: the operands of its live rows,
    the three steps of a token's update and the store of a state into the pool. ``out_dtype``: o's dtype."""

    out_dtype: torch.dtype

    def __init__(self, state_layout: str, state_dtype: torch.dtype, device: torch.device) -> None:
        self.state_layout = state_layout

    def operands(self, live: torch.Tensor, slots: torch.Tensor, group: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor | None,
                 dt_bias: torch.Tensor | None, state_pool: torch.Tensor, gate: str, scale: float, lower_bound: float,
                 qk_l2norm: bool, beta_logits: bool) -> _Operands:
        raise NotImplementedError

    def decayed(self, state: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
        """``Diag(exp g_t) S`` (``decay`` one token's ``[n, HV, ...]``)."""
        raise NotImplementedError

    def dot(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``Sᵀ x`` per row ``[n, HV, V]``."""
        raise NotImplementedError

    def updated(self, state: torch.Tensor, k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``S + k uᵀ``."""
        raise NotImplementedError

    def store(self, state_pool: torch.Tensor, slots: torch.Tensor, state: torch.Tensor) -> None:
        """The states into the pool's slots, in the pool's dtype; −1 slots skipped."""
        raise NotImplementedError


class _KernelArithmetic(_Arithmetic):
    """The decode kernel's: fp32 in lane order (module doc), the gate, l2norm and β as K1 computes them, o bf16."""

    out_dtype = torch.bfloat16

    def __init__(self, state_layout: str, state_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(state_layout, state_dtype, device)
        self.order = channel_order(state_layout, state_dtype).to(device)

    def operands(self, live, slots, group, q, k, v, g, beta, A_log, dt_bias, state_pool, gate, scale, lower_bound,
                 qk_l2norm, beta_logits) -> _Operands:
        consts = Constants.make(lower_bound, scale)
        order = self.order
        q_lanes, k_lanes = _to_lanes(q[live].float(), order), _to_lanes(k[live].float(), order)
        if qk_l2norm:
            q_lanes = q_lanes * (_lane_rinv(q_lanes) * consts.scale)
            k_lanes = k_lanes * _lane_rinv(k_lanes)
        else:
            q_lanes = q_lanes * consts.scale
        g_live = g[live]
        tokens = g_live.reshape(-1, *g_live.shape[2:])
        gp = _base2_log_decay(tokens, DIM, gate, A_log, dt_bias, consts)
        decay = _to_lanes(ex2_approx(gp.contiguous()).reshape(*g_live.shape[:3], DIM), order)
        beta32 = beta[live].float()
        state = _to_lanes(_as_vk(state_pool[slots[live]], self.state_layout).float(), order)  # [n, HV, V, 8, 16]
        return _Operands(q_lanes.repeat_interleave(group, dim=2), k_lanes.repeat_interleave(group, dim=2), decay,
                         sigmoid_approx(beta32) if beta_logits else beta32, v[live].float(), state)

    def decayed(self, state, decay):
        return state * decay[:, :, None]

    def dot(self, state, x):
        return _lane_dot(state, x)

    def updated(self, state, k, u):
        return _fma(k[:, :, None], u[..., None, None], state)

    def store(self, state_pool, slots, state):
        keep = slots >= 0
        states = _as_vk(_from_lanes(state[keep], self.order), self.state_layout)
        state_pool[slots[keep]] = states.to(state_pool.dtype)


class _ExactArithmetic(_Arithmetic):
    """The fp64 token recurrence of :mod:`.gold` (its gates and l2norm), states ``S[k, v]``, o float64."""

    out_dtype = torch.float64

    def operands(self, live, slots, group, q, k, v, g, beta, A_log, dt_bias, state_pool, gate, scale, lower_bound,
                 qk_l2norm, beta_logits) -> _Operands:
        f64 = torch.float64
        q64, k64 = q[live].to(f64), k[live].to(f64)
        if qk_l2norm:
            q64, k64 = l2norm(q64), l2norm(k64)
        params = {name: None if t is None else t.to(f64) for name, t in (("A_log", A_log), ("dt_bias", dt_bias))}
        decay = torch.exp(channel_log_decay(g[live].to(f64), DIM, per_head=g.dim() == 3, gate=gate,
                                            lower_bound=lower_bound, **params))
        beta64 = torch.sigmoid(beta[live].to(f64)) if beta_logits else beta[live].to(f64)
        state = _as_vk(state_pool[slots[live]], self.state_layout).to(f64).transpose(-1, -2)  # S[k, v]
        return _Operands((q64 * scale).repeat_interleave(group, dim=2), k64.repeat_interleave(group, dim=2), decay,
                         beta64, v[live].to(f64), state)

    def decayed(self, state, decay):
        return state * decay[..., None]

    def dot(self, state, x):
        return torch.einsum("nhk,nhkv->nhv", x, state)

    def updated(self, state, k, u):
        return state + k[..., :, None] * u[:, :, None, :]

    def store(self, state_pool, slots, state):
        keep = slots >= 0
        states = state[keep] if self.state_layout == "kv" else state[keep].transpose(-1, -2)
        state_pool[slots[keep]] = states.to(state_pool.dtype)


class ReferenceDecode:
    """One decode (or verify) call on a state pool (the module doc's contract) in one arithmetic: updates
    ``state_pool`` in place, returns o ``[N, T, HV, 128]``.

    q, k ``[N, T, H, 128]``, v ``[N, T, HV, 128]``, g ``[N, T, HV, 128]`` (per channel) or ``[N, T, HV]``
    (per head), beta ``[N, T, HV]`` (bf16, or any float taken as is), A_log fp32 ``[HV]`` and dt_bias fp32
    ``[HV, 128]`` (``[HV]`` with a per-head gate; both None for ``gate="none"``); ``state_pool``
    ``[slots, HV, V, K]`` (``state_layout="vk"``) or ``[slots, HV, K, V]``; ``state_indices`` int ``[N]``
    (decode) or ``[N, T]`` with ``num_accepted_tokens`` ``[N]`` (verify). ``cu_seqlens`` (read on the host):
    the tensors packed ``[1, total T, ...]``, ``state_indices`` ``[N]`` or ``[N, S + 1]``.
    """

    def __init__(self, arithmetic: type[_Arithmetic], doc: str) -> None:
        self.arithmetic = arithmetic
        self.__doc__ = f"{doc}\n\n{ReferenceDecode.__doc__}"

    def __call__(
        self,
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
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_head_dims(q, v, state_pool)
        options = dict(gate=gate, scale=scale, lower_bound=lower_bound, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
                       state_layout=state_layout)
        if cu_seqlens is not None:
            return self._packed(q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, num_accepted_tokens,
                                cu_seqlens, options)
        arith = self.arithmetic(state_layout, state_pool.dtype, q.device)
        batch, steps, heads = q.shape[:3]
        value_heads = v.shape[2]
        group = value_head_group(heads, value_heads)
        slots = read_slots(state_indices, num_accepted_tokens)
        live = (slots >= 0).nonzero().flatten()
        out = torch.zeros(batch, steps, value_heads, DIM, dtype=arith.out_dtype, device=q.device)
        if live.numel() == 0:
            return out
        x = arith.operands(live, slots, group, q, k, v, g, beta, A_log, dt_bias, state_pool, gate, scale,
                           lower_bound, qk_l2norm, beta_logits)
        state = x.state
        for t in range(steps):
            state = arith.decayed(state, x.decay[:, t])
            u = x.beta[:, t, :, None] * (x.v[:, t] - arith.dot(state, x.k[:, t]))
            state = arith.updated(state, x.k[:, t], u)
            out[live, t] = arith.dot(state, x.q[:, t]).to(arith.out_dtype)
            if num_accepted_tokens is not None:
                arith.store(state_pool, state_indices[live, t].long(), state)
        if num_accepted_tokens is None:
            arith.store(state_pool, slots[live], state)
        return out

    def _packed(self, q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, num_accepted_tokens, cu_seqlens,
                options: dict) -> torch.Tensor:
        """Each sequence of a packed call as a fixed-length call of one batch row (length 0: skipped)."""
        out = torch.zeros(1, q.shape[1], v.shape[2], DIM, dtype=self.arithmetic.out_dtype, device=q.device)
        bounds = cu_seqlens.tolist()
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end == start:
                continue
            rows = slice(start, end)
            accepted = None if num_accepted_tokens is None else num_accepted_tokens[n:n + 1]
            out[:, rows] = self(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows], A_log, dt_bias,
                                state_pool, state_indices[n:n + 1], accepted, **options)
        return out


mirror_decode = ReferenceDecode(_KernelArithmetic, "The decode kernel's arithmetic (module doc); o bf16.")
gold_decode = ReferenceDecode(
    _ExactArithmetic, ":func:`mirror_decode`'s contract on the exact token recurrence in float64 (:mod:`.gold`'s gates "
    "and l2norm); the pool (any dtype; fp64 keeps it exact) is updated in place; o float64.")
