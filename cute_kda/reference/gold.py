"""Gold reference: the KDA token recurrence (docs/design.md §1) in high precision, and its gradients.

Plain torch, one token at a time, batched over sequences and heads; differentiable with autograd
(no in-place updates). :func:`gold_forward` is the yardstick for every accuracy figure of the kernels and
of the chunk-16 mirrors, :func:`gold_backward` (autograd through it in fp64) for every gradient; speed is
not a goal.

Every gate users run (issue 12): a per-channel gate ``[B, T, HV, K]`` (KDA) or a per-head scalar gate
``[B, T, HV]`` (GatedDeltaNet, broadcast over the K channels), each as the safe (bounded) form, the
softplus (unbounded) form or a precomputed log decay; and grouped value heads (GVA): q, k per q/k head
``[B, T, H, K]``, v, g, β and the state per value head, HV a multiple of H, value head ``j`` reading q/k
head ``j // (HV / H)`` as FLA does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..numerics import GATES

L2NORM_EPS = 1e-6
STATE_LAYOUTS = ("vk", "kv")


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x · rsqrt(Σ x² + eps)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gate_log_decay(
    g: torch.Tensor,
    *,
    gate: str = "safe",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Per-channel log decay from the gate input ``g`` ``[..., H, K]`` (computed in ``g.dtype``).

    ``"safe"``: ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` (FlashKDA form; ``A_log`` may
    be None: no scaling). ``"softplus"``: ``−exp(A_log) · softplus(g + dt_bias)`` (FLA's default
    form; needs ``A_log``). ``"none"``: ``g`` is already the log decay. ``dt_bias`` ``[H, K]`` or
    ``[H*K]`` may be None (no bias); ``A_log`` is ``[H]``.
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if gate == "none":
        return g
    heads, dim = g.shape[-2:]
    x = g if dt_bias is None else g + dt_bias.to(g.dtype).reshape(heads, dim)
    if gate == "softplus":
        if A_log is None:
            raise ValueError("the softplus gate needs A_log")
        return -torch.exp(A_log.to(g.dtype)).reshape(heads, 1) * F.softplus(x)
    if A_log is not None:
        x = torch.exp(A_log.to(g.dtype)).reshape(heads, 1) * x
    return lower_bound * torch.sigmoid(x)


def head_gate_log_decay(
    g: torch.Tensor, *, gate: str = "softplus", dt_bias: torch.Tensor | None = None, **gate_options: Any
) -> torch.Tensor:
    """Per-head (scalar) log decay from the gate input ``g`` ``[..., HV]`` (GatedDeltaNet; in ``g.dtype``).

    The forms of :func:`gate_log_decay` with one channel per head (``gate_options``: its ``A_log`` ``[HV]`` and
    ``lower_bound``): ``"softplus"`` is FLA's GDN gate ``−exp(A_log) · softplus(g + dt_bias)``. ``dt_bias`` is
    ``[HV]`` (or None). Returns ``[..., HV]``.
    """
    bias = None if dt_bias is None else dt_bias.reshape(g.shape[-1], 1)
    return gate_log_decay(g[..., None], gate=gate, dt_bias=bias, **gate_options)[..., 0]


def channel_log_decay(
    g: torch.Tensor, key_dim: int, *, per_head: bool, gate: str = "safe", **gate_options: Any
) -> torch.Tensor:
    """Log decay per value head and key channel, ``[..., HV, key_dim]``, from either gate layout.

    ``per_head`` False: ``g`` ``[..., HV, key_dim]`` through :func:`gate_log_decay`; True: ``g`` ``[..., HV]``
    through :func:`head_gate_log_decay`, broadcast (a view) over the channels. ``gate_options``: ``A_log``,
    ``dt_bias``, ``lower_bound`` as those take them.
    """
    if not per_head:
        return gate_log_decay(g, gate=gate, **gate_options)
    decay = head_gate_log_decay(g, gate=gate, **gate_options)
    return decay[..., None].expand(*decay.shape, key_dim)


def value_head_group(heads: int, value_heads: int) -> int:
    """``HV / H``: value heads per q/k head (1 without GVA)."""
    if value_heads % heads:
        raise ValueError(f"value heads HV = {value_heads} must be a multiple of the q/k heads H = {heads}")
    return value_heads // heads


def expand_to_value_heads(x: torch.Tensor, group: int, dim: int = 2) -> torch.Tensor:
    """A q/k-head tensor (H heads along ``dim``) → H·group heads: value head ``j`` gets q/k head ``j // group``."""
    return x if group == 1 else x.repeat_interleave(group, dim=dim)


def _sequence_spans(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence, in state order."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {batch}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != seq_len or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {seq_len}, got {bounds}")
    return [(0, a, b) for a, b in zip(bounds, bounds[1:])]


def _recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop for ``n`` equal-length sequences: q, k ``[n,T,H,K]``, decay ``[n,T,H,K]`` (or
    ``[n,T,H,1]``, broadcast), v ``[n,T,H,V]``, beta ``[n,T,H]``, state ``[n,H,K,V]`` → (o ``[n,T,H,V]``,
    final state ``[n,H,K,V]``); H counts value heads."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * decay[:, t, :, :, None]
        k_t = k[:, t]
        predicted = torch.einsum("nhk,nhkv->nhv", k_t, state)
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], state))
    if not outputs:
        return v.new_zeros(v.shape), state
    return torch.stack(outputs, dim=1), state


def gold_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None = None, gate: str = "safe", A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None, lower_bound: float = -5.0, qk_l2norm: bool = True, beta_logits: bool = True,
    initial_state: torch.Tensor | None = None, state_layout: str = "vk", output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA / GatedDeltaNet forward by the token recurrence, every input widened to ``dtype``.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with HV a multiple of H (GVA: value head ``j``
    reads q/k head ``j // (HV / H)``; HV = H without it); beta ``[B, T, HV]``; g ``[B, T, HV, K]``
    (per-channel gate, KDA; dt_bias ``[HV, K]`` or ``[HV*K]``) or ``[B, T, HV]`` (per-head scalar gate,
    GatedDeltaNet, broadcast over the K channels; dt_bias ``[HV]``); A_log ``[HV]``. With ``cu_seqlens``
    (int ``[N+1]``, B must be 1) the tokens form N packed sequences; otherwise N = B.
    ``initial_state`` (any float dtype) and the final state are ``[N, HV, V, K]`` for
    ``state_layout="vk"`` or ``[N, HV, K, V]`` for ``"kv"``. ``gate``: see :func:`gate_log_decay`
    (``"none"``: g is the log decay itself). ``beta_logits``: β = sigmoid(beta), else β = beta.
    ``scale`` defaults to ``K ** -0.5``; q is l2-normalised first when ``qk_l2norm``.

    Returns (o ``[B, T, HV, V]`` in ``dtype``, final state in ``dtype`` or None). Under autograd, the
    gradients of q and k come out summed over each group of value heads.
    """
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    batch, seq_len, qk_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]  # the state, v, g and β are per value head
    group = value_head_group(qk_heads, value_heads)
    per_head = g.dim() == 3
    expected_g = (batch, seq_len, value_heads) if per_head else (batch, seq_len, value_heads, key_dim)
    if k.shape != q.shape or tuple(g.shape) != expected_g or tuple(beta.shape) != (batch, seq_len, value_heads):
        raise ValueError(f"k {tuple(k.shape)}, g {tuple(g.shape)} or beta {tuple(beta.shape)} do not fit "
                         f"q {tuple(q.shape)} and v {tuple(v.shape)}")
    if scale is None:
        scale = key_dim ** -0.5
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = expand_to_value_heads(q * scale, group), expand_to_value_heads(k, group)
    # a per-head gate stays [B, T, HV, 1]: the recurrence broadcasts it over the channels
    log_decay = (head_gate_log_decay(g, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)[..., None]
                 if per_head else gate_log_decay(g, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound))
    decay = torch.exp(log_decay)
    if beta_logits:
        beta = torch.sigmoid(beta)

    spans = _sequence_spans(batch, seq_len, cu_seqlens)
    if initial_state is None:
        states = q.new_zeros(len(spans), value_heads, key_dim, value_dim)
    else:
        states = initial_state.to(dtype)
        if state_layout == "vk":
            states = states.transpose(-1, -2)
        if tuple(states.shape) != (len(spans), value_heads, key_dim, value_dim):
            raise ValueError(f"initial_state has shape {tuple(initial_state.shape)} for {len(spans)} sequences")

    if cu_seqlens is None:
        o, final = _recurrence(q, k, v, decay, beta, states)
    else:
        pieces, finals = [], []
        for n, (_, start, end) in enumerate(spans):
            o_n, s_n = _recurrence(
                q[:, start:end], k[:, start:end], v[:, start:end], decay[:, start:end], beta[:, start:end],
                states[n: n + 1],
            )
            pieces.append(o_n)
            finals.append(s_n)
        o = torch.cat(pieces, dim=1)
        final = torch.cat(finals, dim=0)
    if not output_final_state:
        return o, None
    return o, final.transpose(-1, -2) if state_layout == "vk" else final


def gold_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor, *,
    dht: torch.Tensor | None = None, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, dtype: torch.dtype = torch.float64, **forward_options: Any,
) -> dict[str, torch.Tensor | None]:
    """Gradients of ``Σ o·do + Σ final_state·dht`` through :func:`gold_forward`, by autograd.

    Inputs and keywords as :func:`gold_forward`, which this calls with ``forward_options`` (``scale``, ``gate``,
    ``lower_bound``, ``qk_l2norm``, ``beta_logits``, ``state_layout``, ``cu_seqlens``) and ``output_final_state``
    set as needed; every input is widened to ``dtype`` first. ``do`` ``[B, T, H, V]``; ``dht`` (optional) is the
    gradient w.r.t. the final state, ``[N, H, V, K]`` for ``state_layout="vk"`` or ``[N, H, K, V]`` for ``"kv"``.

    Returns, in ``dtype``, each with the shape of its input as given: ``dq``, ``dk``, ``dv``,
    ``dg`` (w.r.t. the raw gate input g), ``dbeta`` (w.r.t. beta as given: the logits when
    ``beta_logits``), ``dA_log``, ``ddt_bias`` (None when that input is None; zeros when the gate
    does not use it), ``dh0`` (w.r.t. ``initial_state`` in ``state_layout``; None without one).
    """
    if do.shape != v.shape:
        raise ValueError(f"do has shape {tuple(do.shape)}, v {tuple(v.shape)}")
    inputs = {"dq": q, "dk": k, "dv": v, "dg": g, "dbeta": beta, "dA_log": A_log, "ddt_bias": dt_bias,
              "dh0": initial_state}
    leaves = {name: x.detach().to(dtype).requires_grad_() for name, x in inputs.items() if x is not None}
    with torch.enable_grad():
        o, final = gold_forward(
            leaves["dq"], leaves["dk"], leaves["dv"], leaves["dg"], leaves["dbeta"], A_log=leaves.get("dA_log"),
            dt_bias=leaves.get("ddt_bias"), initial_state=leaves.get("dh0"), output_final_state=dht is not None,
            dtype=dtype, **forward_options,
        )
        loss = (o * do.to(device=o.device, dtype=dtype)).sum()
        if dht is not None:
            if dht.shape != final.shape:
                raise ValueError(f"dht has shape {tuple(dht.shape)}, the final state {tuple(final.shape)}")
            loss = loss + (final * dht.to(device=final.device, dtype=dtype)).sum()
        # no token and no dht: the loss is a constant (0) and every gradient is 0
        grads = (torch.autograd.grad(loss, list(leaves.values()), allow_unused=True) if loss.requires_grad
                 else [None] * len(leaves))
    out: dict[str, torch.Tensor | None] = dict.fromkeys(inputs)
    for (name, leaf), grad in zip(leaves.items(), grads):
        out[name] = torch.zeros_like(leaf) if grad is None else grad
    return out
