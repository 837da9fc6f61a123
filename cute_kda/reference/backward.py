"""Mirrors of the backward kernels, with their rounding: the reverse state-gradient scan (Kernel A,
docs/numerics.md, "Backward: Kernel A"), the safe gate's per-tile gradients (Kernel B, "Backward: Kernel B";
the unbounded gates' variants are :func:`~.gates.bwd_grads_gates`) and the whole chain.

- :func:`mirror_bwd_scan`: Kernel A over a K1 workspace; loops over the tile step only, batched over every
  (head, sequence), each sequence running from its own last tile down to its first.
- :func:`mirror_bwd_grads`: Kernel B for every gate: dq, dk, dg, dβ per token and dA_log, ddt_bias from per-tile
  partials, every (head, tile) at once (the tiles are independent given the per-tile states and state gradients);
  :func:`mirror_bwd_grads_gates` the same by name.
- :func:`mirror_backward`: the whole chain for every gate — K1, the training forward's per-tile checkpoints,
  Kernel A, Kernel B — returning :func:`~.gold.gold_backward`'s gradients.

The mirrors of Kernels A and B run the chains of :mod:`.chains` in :data:`~.common.KERNEL` arithmetic;
:mod:`.exact` runs the same chains in float64.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..numerics import LN2, LOG2E
from ..executors.stages import GradsResult
from ..workspace import SNAPSHOT_TILES, Workspace, WorkspaceSpec, block_states_shape
from .chains import BwdScanResult, GradConstants, bwd_grads, gradient_dict, reverse_scan
from .common import KERNEL, PER_TILE, Constants, TileMap, ex2_approx, to_tiles
from .gates import bwd_grads_gates, mirror_prepare_gates
from .mirror import k1_rows, mirror_prepare, mirror_recurrence


def _check_workspace_dtypes(ws: Workspace, heads: int) -> None:
    """The mirrors take a workspace in the dtypes K1 writes (:class:`~cute_kda.workspace.WorkspaceSpec`)."""
    spec = WorkspaceSpec(heads=heads, tiles=ws.qd.shape[0] // heads, dim=ws.qd.shape[-1])
    for name, (_, dtype) in spec.fields().items():
        if getattr(ws, name).dtype != getattr(torch, dtype):
            raise TypeError(f"workspace field {name} is {getattr(ws, name).dtype}, the kernels write {dtype}")


def mirror_bwd_scan(
    ws: Workspace,
    do: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    dh0_dtype: torch.dtype = torch.float32,
    state_layout: str = "vk",
    snapshot_every: int = SNAPSHOT_TILES,
) -> BwdScanResult:
    """Kernel A of docs/numerics.md with the kernel's rounding, over the workspace ``ws``.

    ``ws`` from the K1 kernel or :func:`~.mirror.mirror_prepare` (its dtypes); do bf16
    ``[B, T, H, V]``; ``cu_seqlens`` int ``[N+1]`` (B == 1) as for the forward; ``dht`` None, bf16 or
    fp32, ``[N, H, V, K]`` (``state_layout="vk"``) or ``[N, H, K, V]`` (``"kv"``), carried in fp32
    (the products read its bf16 rounding). Returns du, dv bf16 ``[B, T, H, V]``; dh0 in ``dh0_dtype``
    (the fp32 band, or its bf16 rounding) in ``state_layout``; snapshots bf16 ``[H*tiles, K, V]``
    (see :class:`BwdScanResult`). An empty sequence passes ``dht`` through to its dh0.
    """
    if do.dtype != torch.bfloat16:
        raise TypeError("do must be bf16 (the kernel's input type)")
    if dht is not None and dht.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"dht must be bf16 or fp32, got {dht.dtype}")
    if dh0_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dh0_dtype must be bf16 or fp32, got {dh0_dtype}")
    heads = do.shape[2]
    _check_workspace_dtypes(ws, heads)
    return reverse_scan(ws, do, cu_seqlens, dht, state_layout, KERNEL, snapshot_every, dh0_dtype)


# ---------------------------------------------------------------------------------------------
# Kernel B


def _sigmoid_derivative(x: torch.Tensor) -> torch.Tensor:
    """Kernel B's ``σ(x)·σ(−x)``, each factor ``1 / (1 + 2^(∓x·log2 e))`` in fp32: accurate where σ saturates
    (``σ·(1 − σ)`` from the forward's tanh form would cancel there)."""
    scaled = x * LOG2E
    return (1.0 / (1.0 + ex2_approx(-scaled))) * (1.0 / (1.0 + ex2_approx(scaled)))


def _kernel_recompute(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, lower_bound: float, scale: float, tile_map: TileMap, qk_l2norm: bool, beta_logits: bool,
) -> tuple[dict[str, torch.Tensor | None], GradConstants]:
    """K1's values by mirror_prepare's own helper (bit-identical to it), and Kernel B's fp32 constants."""
    batch, seq_len, heads, key_dim = q.shape
    consts = Constants.make(lower_bound, scale)
    rows = k1_rows(q, k, g, beta, A_log, dt_bias, consts, tile_map, qk_l2norm, beta_logits)
    qhat = khat = rinv_q = rinv_k = None
    if qk_l2norm:
        q32, k32 = (x.reshape(batch * seq_len, heads, key_dim).float() for x in (q, k))
        qhat, khat = to_tiles(q32 * rows.rinv_q, tile_map), to_tiles(k32 * rows.rinv_k, tile_map)
        rinv_q, rinv_k = to_tiles(rows.rinv_q, tile_map), to_tiles(rows.rinv_k, tile_map)
    recomputed = dict(
        qhat=qhat, khat=khat, rinv_q=rinv_q, rinv_k=rinv_k, x=to_tiles(rows.x, tile_map),
        dsig=to_tiles(_sigmoid_derivative(rows.x), tile_map), e_a=rows.e_a, decay=rows.decay, decay_inv=rows.decay_inv,
        decay_rest=rows.decay_rest, qd=rows.qd, kd=rows.kd, kinv=rows.kinv, kr=rows.kr,
    )
    return recomputed, GradConstants(consts.scale, consts.c_gate, LN2)


def mirror_bwd_grads(
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
    gate: str = "safe",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    lower_bound: float = -5.0,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> GradsResult:
    """Kernel B (docs/numerics.md, "Backward: Kernel B") with the kernel's rounding; an unbounded ``gate``
    ("softplus", "none") by :func:`~.gates.bwd_grads_gates` (its inputs and outputs there).

    Inputs bf16 (q, k, g, v may be fp16 together: widened exactly, as Kernel B's ``dtype`` fp16 does): q, k, g (raw
    gate input) ``[B, T, H, K]``, beta ``[B, T, H]`` (logits when
    ``beta_logits``; as in the kernel, β itself is read from ``ws``), v, do, du ``[B, T, H, V]`` (V == K;
    du: Kernel A's gradient w.r.t. u). ``ws``: the K1 workspace of the forward (it reads gt, inv, mqk,
    beta; qd, kd, kinv, kr, G, the l2norm and the gate are recomputed with K1's own arithmetic). ``states``: bf16 ``[H·slots, K, V]`` (slots =
    ``snapshot_slots(tiles, N, 1)``), row ``h·slots + g + s`` the state entering global tile g of
    sequence s (the training forward's checkpoints with ``checkpoint_every=1``); ``state_grads``: the
    same shape, the gradient w.r.t. the state after tile g (Kernel A's snapshots, ``snapshot_every=1``).
    A_log fp32 ``[H]``, dt_bias fp32 ``[H, K]`` or ``[H*K]``; ``cu_seqlens`` int ``[N+1]`` (B == 1).

    Returns dq, dk, dg, dbeta bf16 in their inputs' shapes; dA_log fp32 ``[H]``, ddt_bias fp32 ``[H, K]``:
    the per-tile partials summed over the tiles.
    """
    if gate != "safe":
        return bwd_grads_gates(q, k, g, beta, v, do, du, ws, states, state_grads, gate=gate, A_log=A_log,
                               dt_bias=dt_bias, scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm,
                               beta_logits=beta_logits)
    for name, x in (("beta", beta), ("do", do), ("du", du), ("states", states), ("state_grads", state_grads)):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bf16 (the kernel's input type), got {x.dtype}")
    for name, x in (("q", q), ("k", k), ("g", g), ("v", v)):  # the kernel's input dtype: bf16, or fp16 together
        if x.dtype not in (torch.bfloat16, torch.float16) or x.dtype != q.dtype:
            raise TypeError(f"{name} must be bf16 or fp16 (q's dtype, the kernel's input type), got {x.dtype}")
    if A_log is None or dt_bias is None or A_log.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        raise TypeError("the safe gate's A_log and dt_bias must be fp32 tensors")
    heads = q.shape[2]
    _check_workspace_dtypes(ws, heads)
    return bwd_grads(q, k, g, beta, v, do, du, ws, states, state_grads, A_log, dt_bias, scale, lower_bound,
                     cu_seqlens, qk_l2norm, beta_logits, KERNEL, _kernel_recompute)


def mirror_bwd_grads_gates(*operands: torch.Tensor | Workspace, gate: str, **options: Any
                           ) -> dict[str, torch.Tensor | None]:
    """:func:`mirror_bwd_grads` (its operands and keywords but ``lower_bound``) for an unbounded ``gate``, its
    gradients by name."""
    return mirror_bwd_grads(*operands, gate=gate, **options)._asdict()


# ---------------------------------------------------------------------------------------------
# The whole backward chain


def mirror_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor, *,
    dht: torch.Tensor | None = None, gate: str = "safe", initial_state: torch.Tensor | None = None,
    state_layout: str = "vk", cu_seqlens: torch.Tensor | None = None, **k1_options: Any,
) -> dict[str, torch.Tensor | None]:
    """The whole backward with the kernels' rounding, for every gate: the reference backend of the autograd layer.

    K1 (:func:`~.mirror.mirror_prepare` for the safe gate; :func:`~.gates.mirror_prepare_gates` for "softplus" and
    "none", the per-head scheme for g ``[B, T, HV]``, else dyadic) → :func:`~.mirror.mirror_recurrence` (the
    training forward: per-tile checkpoints) → :func:`mirror_bwd_scan` (Kernel A, per-tile snapshots, from ``dht``)
    → Kernel B (:func:`mirror_bwd_grads`). Inputs bf16 as the kernels take
    them: q, k ``[B, T, H, K]``, v, do ``[B, T, HV, V]``, g ``[B, T, HV, K]`` (or ``[B, T, HV]``, a per-head
    unbounded gate; a log decay for "none" may be fp32), beta ``[B, T, HV]``; HV = H for the safe gate, a multiple
    of H for the others; A_log fp32 ``[HV]``, dt_bias fp32 ``[HV, K]`` or ``[HV*K]`` (``[HV]`` per head; both
    needed by the safe gate, optional for softplus, unused by "none"); ``initial_state`` and ``dht`` None, bf16 or
    fp32, ``[N, HV, V, K]`` ("vk") or ``[N, HV, K, V]`` ("kv"); ``cu_seqlens`` int ``[N+1]`` (B == 1).
    ``k1_options``: ``A_log``, ``dt_bias``, ``scale``, ``lower_bound``, ``qk_l2norm``, ``beta_logits``, passed on
    to K1 and Kernel B.

    Returns :func:`~.gold.gold_backward`'s keys: dq, dk (summed over each group of value heads), dv, dbeta bf16 in
    their inputs' shapes; dg bf16 (fp32 for a per-head gate, as Kernel B writes it); dA_log, ddt_bias fp32 in their
    inputs' shapes (None for a None input); dh0 in ``initial_state``'s dtype and layout (bf16, or the bf16 value
    widened), None without an initial state.
    """
    value_heads = v.shape[2]
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    options = dict(cu_seqlens=cu_seqlens, **k1_options)
    if gate == "safe":
        ws = mirror_prepare(q, k, g, beta, **options)
    else:
        ws = mirror_prepare_gates(q, k, g, beta, gate=gate, **options)
    states = torch.full(block_states_shape(ws, value_heads, num_seqs, PER_TILE), math.nan, dtype=torch.bfloat16,
                        device=q.device)
    mirror_recurrence(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state, state_layout=state_layout,
                      checkpoints=states, checkpoint_every=PER_TILE)
    dh0_dtype = torch.float32 if initial_state is None else initial_state.dtype
    scan = mirror_bwd_scan(ws, do, cu_seqlens=cu_seqlens, dht=dht, dh0_dtype=dh0_dtype, state_layout=state_layout,
                           snapshot_every=PER_TILE)
    grads = mirror_bwd_grads(q, k, g, beta, v, do, scan.du, ws, states, scan.snapshots, gate=gate, **options)
    return gradient_dict(grads, scan, k1_options.get("dt_bias"), initial_state)
