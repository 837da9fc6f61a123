"""Backward references: autograd through the gold, the reverse state-gradient scan (Kernel A) and the
per-tile gradients (Kernel B), each with the kernels' rounding and in exact float64.

- :func:`gold_backward`: every input gradient of the gold token recurrence by torch autograd in
  fp64, through the gate, l2norm and β-sigmoid as :func:`~.gold.gold_forward` computes them — the
  accuracy yardstick of the backward.
- :func:`mirror_bwd_scan`: Kernel A of docs/numerics.md ("Backward: Kernel A") with the kernel's
  rounding, over a K1 workspace; loops over the tile step only, batched over every
  (head, sequence), each sequence running from its own last tile down to its first.
- :func:`mirror_bwd_grads`: Kernel B (docs/numerics.md, "Backward: Kernel B") with
  the kernel's rounding: dq, dk, dg, dβ per token and dA_log, ddt_bias from per-tile partials, every
  (head, tile) at once (the tiles are independent given the per-tile states and state gradients).
- :func:`mirror_backward`: the whole chain with the kernels' rounding — K1, the training forward's
  per-tile checkpoints, Kernel A, Kernel B — returning :func:`gold_backward`'s gradients.
- :func:`prepare_exact`, :func:`chunk_fwd_states_exact`, :func:`chunk_bwd_scan_exact`,
  :func:`chunk_bwd_grads_exact`, :func:`chunk_backward_exact`: the same chain in float64 without any
  rounding, over exact chunk quantities. It equals every gradient of the gold to fp64 precision,
  which proves the chain's formulas; the mirrors then differ from it by rounding only.

Kernel A needs no forward state: dv and the state gradients are linear in dO and dht and do not
depend on S (the recurrence is affine in S). Kernel B does: it reads the state entering each tile.
Both share one chain per kernel, parametrised by an :class:`_Arithmetic` of rounding functions.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..numerics import LN2, LOG2E
from ..workspace import (
    CHUNK, SNAPSHOT_TILES, Workspace, WorkspaceSpec, block_states_shape, snapshot_slots, tiles_per_head,
)
from .gold import L2NORM_EPS, STATE_LAYOUTS, gate_log_decay, gold_forward, l2norm
from .mirror import (
    Constants, _k1_rows, _mma, _tile_map, _TileMap, _to_tiles, _token_tile_map, ex2_approx, mirror_prepare,
    mirror_recurrence,
)


def gold_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    gate: str = "safe",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    initial_state: torch.Tensor | None = None,
    state_layout: str = "vk",
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor | None]:
    """Gradients of ``Σ o·do + Σ final_state·dht`` through :func:`~.gold.gold_forward`, by autograd.

    Inputs and keywords as :func:`~.gold.gold_forward` (which this calls with
    ``output_final_state`` set as needed); every input is widened to ``dtype`` first. ``do``
    ``[B, T, H, V]``; ``dht`` (optional) is the gradient w.r.t. the final state, ``[N, H, V, K]``
    for ``state_layout="vk"`` or ``[N, H, K, V]`` for ``"kv"``.

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
            leaves["dq"], leaves["dk"], leaves["dv"], leaves["dg"], leaves["dbeta"], scale=scale, gate=gate,
            A_log=leaves.get("dA_log"), dt_bias=leaves.get("ddt_bias"), lower_bound=lower_bound,
            qk_l2norm=qk_l2norm, beta_logits=beta_logits, initial_state=leaves.get("dh0"),
            state_layout=state_layout, output_final_state=dht is not None, cu_seqlens=cu_seqlens, dtype=dtype,
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


class _Arithmetic(NamedTuple):
    """Where the backward kernels round: their contract, or nowhere (float64 throughout)."""

    dtype: torch.dtype  # type of the bf16 values: Kernel A's dS, dU, dv, du_out, snapshots; Kernel B's v, dO, du, S
    load: Callable[[torch.Tensor], torch.Tensor]  # a workspace field (or state block) as the chain reads it
    store: Callable[[torch.Tensor], torch.Tensor]  # a value the kernel holds as bf16 (smem, operand, output)
    mma: Callable[..., torch.Tensor]  # one tensor-core accumulation ``c + a @ b`` (``c`` optional)
    work: torch.dtype  # type of the values the kernels hold in fp32 registers
    # Σ a·b over dims, a reduction whose order the contract leaves open: the exact sum rounded once
    dot: Callable[[torch.Tensor, torch.Tensor, int | tuple[int, ...]], torch.Tensor]


def _dot_f32(a: torch.Tensor, b: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """``f32(Σ a·b)`` over ``dim``: float64 sum of the exact products of fp32/bf16 operands, as :func:`_mma`."""
    return (a.double() * b.double()).sum(dim).float()


_KERNEL = _Arithmetic(torch.bfloat16, lambda x: x, torch.Tensor.bfloat16, _mma, torch.float32, _dot_f32)
_EXACT = _Arithmetic(torch.float64, torch.Tensor.double, lambda x: x,
                     lambda a, b, c=None: a @ b if c is None else a @ b + c, torch.float64,
                     lambda a, b, dim: (a * b).sum(dim))


def _reverse_scan(
    ws: Workspace,
    do: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    dht: torch.Tensor | None,
    state_layout: str,
    arith: _Arithmetic,
    snapshot_every: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Kernel A chain (docs/numerics.md) in ``arith``; returns du, dv, dS32 ``[N, H, K, V]``, snapshots."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    batch, seq_len, heads, value_dim = do.shape
    device = do.device
    tiles = ws.qd.shape[0] // heads
    key_dim = ws.qd.shape[-1]
    if ws.qd.shape[0] != heads * tiles:
        raise ValueError(f"workspace {tuple(ws.qd.shape)} does not fit do {tuple(do.shape)}")
    tile_map = _tile_map(cu_seqlens, batch, seq_len, tiles, device)
    num_seqs = tile_map.tiles_per_seq.numel()

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return arith.load(t).view(heads, tiles, *t.shape[1:])

    qd, kd, kr, gt, inv, mqk, beta = (per_head(t) for t in ws)
    # tail rows of dO are 0 here; in the kernel they meet the exact zeros of their Mqk and qd rows
    do_t = _to_tiles(do.reshape(batch * seq_len, heads, value_dim).to(arith.dtype), tile_map)  # [H, tiles, 16, V]

    # dS32: the band in the kernel's fp32 registers; dS = store(dS32): its bf16 copy, the products' operand
    if dht is None:
        state32 = torch.zeros(heads, num_seqs, key_dim, value_dim, device=device, dtype=arith.work)
    else:
        init = dht.transpose(-1, -2) if state_layout == "vk" else dht
        if tuple(init.shape) != (num_seqs, heads, key_dim, value_dim):
            raise ValueError(f"dht has shape {tuple(dht.shape)} for {num_seqs} sequences")
        state32 = init.to(device=device, dtype=arith.work).movedim(0, 1).contiguous()  # [H, N, K, V], exact
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
    return untile(du_t), untile(dv_t), state32.movedim(1, 0), snapshot_rows


def _state_out(dS: torch.Tensor, state_layout: str, dtype: torch.dtype) -> torch.Tensor:
    """``[N, H, K, V]`` → ``state_layout`` in ``dtype``."""
    return (dS.transpose(-1, -2) if state_layout == "vk" else dS).to(dtype).contiguous()


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
    du, dv, dS, snapshots = _reverse_scan(ws, do, cu_seqlens, dht, state_layout, _KERNEL, snapshot_every)
    return BwdScanResult(du, dv, _state_out(dS, state_layout, dh0_dtype), snapshots)


def chunk_bwd_scan_exact(
    ws: Workspace,
    do: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    state_layout: str = "vk",
    snapshot_every: int = SNAPSHOT_TILES,
) -> BwdScanResult:
    """The Kernel A chain of :func:`mirror_bwd_scan` in float64 with no rounding at all.

    ``ws``: any workspace-shaped fields, widened to float64 — :func:`prepare_exact` for the exact
    chunk quantities (or a K1 workspace, to separate the scan's rounding from K1's). ``do``, ``dht``
    any float dtype, shapes as for :func:`mirror_bwd_scan`. Every output is float64.
    """
    du, dv, dS, snapshots = _reverse_scan(ws, do, cu_seqlens, dht, state_layout, _EXACT, snapshot_every)
    return BwdScanResult(du, dv, _state_out(dS, state_layout, torch.float64), snapshots)


def prepare_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    gate: str = "safe",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
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
    batch, seq_len, heads, key_dim = q.shape
    if scale is None:
        scale = key_dim ** -0.5
    total = batch * seq_len
    tile_map = _token_tile_map(q, cu_seqlens)
    tiles = tile_map.slot_exists.numel()

    q64, k64, g64 = (x.reshape(total, heads, key_dim).double() for x in (q, k, g))
    if qk_l2norm:
        q64, k64 = l2norm(q64), l2norm(k64)
    log_decay = gate_log_decay(g64, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    beta64 = beta.reshape(total, heads).double()
    beta64 = torch.sigmoid(beta64) if beta_logits else beta64

    q_t, k_t, beta_t = _to_tiles(q64 * scale, tile_map), _to_tiles(k64, tile_map), _to_tiles(beta64, tile_map)
    G = torch.cumsum(_to_tiles(log_decay, tile_map), dim=2)  # [H, tiles, 16, K]
    G_last = G[:, :, -1:]
    qd, kd, kinv = q_t * G.exp(), k_t * G.exp(), k_t * (-G).exp()
    kr = k_t * (G_last - G).exp()
    L = torch.tril(beta_t[..., None] * (kd @ kinv.transpose(-1, -2)), diagonal=-1)
    eye = torch.eye(CHUNK, dtype=torch.float64, device=q.device)
    inv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    mqk = torch.tril(qd @ kinv.transpose(-1, -2))

    missing = ~tile_map.slot_exists
    fields = {"qd": qd, "kd": kd, "kr": kr, "gt": G_last[:, :, 0].exp(), "inv": inv, "mqk": mqk, "beta": beta_t}
    for name, value in fields.items():
        value = value.masked_fill(missing.reshape(1, tiles, *([1] * (value.dim() - 2))), math.nan)
        fields[name] = value.reshape(heads * tiles, *value.shape[2:]).contiguous()
    return Workspace(**fields)


# ---------------------------------------------------------------------------------------------
# Forward states of the exact chain (the float64 counterpart of the training forward's checkpoints)


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
    ws: Workspace,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    state_layout: str = "vk",
) -> FwdStatesResult:
    """The K2 chunk recurrence in float64 with no rounding, keeping the state entering every tile.

    ``ws``: workspace-shaped fields (:func:`prepare_exact`), widened to float64; v ``[B, T, H, V]`` and
    ``initial_state`` (``[N, H, V, K]`` for "vk", ``[N, H, K, V]`` for "kv") any float dtype. Per tile:
    u = (v − kd·S)·β, U = INV·u, o = qd·S + Mqk·U, S ← gT ⊙ S + krᵀ·U. Every output is float64
    (see :class:`FwdStatesResult`); an empty sequence keeps its initial state.
    """
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    batch, seq_len, heads, value_dim = v.shape
    device = v.device
    tiles = ws.qd.shape[0] // heads
    key_dim = ws.qd.shape[-1]
    tile_map = _tile_map(cu_seqlens, batch, seq_len, tiles, device)
    num_seqs = tile_map.tiles_per_seq.numel()
    qd, kd, kr, gt, inv, mqk, beta = (t.double().view(heads, tiles, *t.shape[1:]) for t in ws)
    v_t = _to_tiles(v.reshape(batch * seq_len, heads, value_dim).double(), tile_map)

    if initial_state is None:
        state = torch.zeros(heads, num_seqs, key_dim, value_dim, device=device, dtype=torch.float64)
    else:
        init = initial_state.transpose(-1, -2) if state_layout == "vk" else initial_state
        if tuple(init.shape) != (num_seqs, heads, key_dim, value_dim):
            raise ValueError(f"initial_state has shape {tuple(initial_state.shape)} for {num_seqs} sequences")
        state = init.to(device=device, dtype=torch.float64).movedim(0, 1).contiguous()

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
    return FwdStatesResult(o, _state_out(state.movedim(1, 0), state_layout, torch.float64), states)


# ---------------------------------------------------------------------------------------------
# Kernel B: the per-tile gradients (docs/numerics.md, "Backward: Kernel B")

_PER_TILE = 1  # Kernel B reads the state entering each tile and the gradient leaving it


class BwdGradsResult(NamedTuple):
    """Outputs of the tile-gradient kernel.

    dq, dk, dg ``[B, T, H, K]`` (dg w.r.t. the raw gate input), dbeta ``[B, T, H]`` (w.r.t. beta as
    given: the logits when ``beta_logits``), dA_log ``[H]``, ddt_bias ``[H, K]``.
    """

    dq: torch.Tensor
    dk: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor
    ddt_bias: torch.Tensor


class _GradConstants(NamedTuple):
    """Kernel B's scalars: ``scale``, ``c_gate`` (= lower_bound·log2 e, the base-2 gate's factor), ln 2."""

    scale: float
    c_gate: float
    ln2: float


class _TileOperands(NamedTuple):
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


def _forward_recompute(ops: _TileOperands, arith: _Arithmetic) -> tuple[torch.Tensor, torch.Tensor]:
    """K2's w = v − kd·S (fp32) and U = bf16(INV·bf16(w·β)) of every slot, ``[H, tiles, 16, V]``."""
    w = ops.v.to(arith.work) - arith.mma(ops.kd, ops.S)
    return w, arith.store(arith.mma(ops.inv, arith.store(w * ops.beta[..., None])))


def _tile_grads(ops: _TileOperands, consts: _GradConstants, arith: _Arithmetic, qk_l2norm: bool,
                beta_logits: bool) -> _TileGrads:
    """The per-tile gradients of the contract, every slot at once, rounded as ``arith`` says."""
    def widen(t: torch.Tensor) -> torch.Tensor:
        return t.to(arith.work)

    def mma_pair(a1: torch.Tensor, b1: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        # a1·b1 + a2·b2 in one accumulator: one matmul over the joined contraction
        return arith.mma(torch.cat([a1, a2], -1), torch.cat([b1, b2], -2))

    beta = ops.beta[..., None]
    S_t, dS_t = ops.S.transpose(-1, -2), ops.dS.transpose(-1, -2)
    w, U = _forward_recompute(ops, arith)
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


def _tile_blocks(blocks: torch.Tensor, heads: int, tile_map: _TileMap, arith: _Arithmetic) -> torch.Tensor:
    """Per-tile state blocks ``[H·slots, K, V]`` (slot g + s) → ``[H, tiles, K, V]``; no-tile slots 0."""
    tiles = tile_map.slot_exists.numel()
    num_seqs = tile_map.tiles_per_seq.numel()
    slots = snapshot_slots(tiles, num_seqs, _PER_TILE)
    tile = torch.arange(tiles, device=blocks.device)
    seq = torch.searchsorted(tile_map.bases[1:], tile, right=True).clamp(max=num_seqs - 1)
    rows = arith.load(blocks).view(heads, slots, *blocks.shape[1:])[:, (tile + seq).clamp(max=slots - 1)]
    return torch.where(tile_map.slot_exists[None, :, None, None], rows, torch.zeros_like(rows))


def _sigmoid_derivative(x: torch.Tensor) -> torch.Tensor:
    """Kernel B's ``σ(x)·σ(−x)``, each factor ``1 / (1 + 2^(∓x·log2 e))`` in fp32: accurate where σ saturates
    (``σ·(1 − σ)`` from the forward's tanh form would cancel there)."""
    scaled = x * LOG2E
    return (1.0 / (1.0 + ex2_approx(-scaled))) * (1.0 / (1.0 + ex2_approx(scaled)))


def _kernel_recompute(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, lower_bound: float, scale: float, tile_map: _TileMap, qk_l2norm: bool, beta_logits: bool,
) -> tuple[dict[str, torch.Tensor | None], _GradConstants]:
    """K1's values by mirror_prepare's own helper (bit-identical to it), and Kernel B's fp32 constants."""
    batch, seq_len, heads, key_dim = q.shape
    consts = Constants.make(lower_bound, scale)
    rows = _k1_rows(q, k, g, beta, A_log, dt_bias, consts, tile_map, qk_l2norm, beta_logits)
    qhat = khat = rinv_q = rinv_k = None
    if qk_l2norm:
        q32, k32 = (x.reshape(batch * seq_len, heads, key_dim).float() for x in (q, k))
        qhat, khat = _to_tiles(q32 * rows.rinv_q, tile_map), _to_tiles(k32 * rows.rinv_k, tile_map)
        rinv_q, rinv_k = _to_tiles(rows.rinv_q, tile_map), _to_tiles(rows.rinv_k, tile_map)
    recomputed = dict(
        qhat=qhat, khat=khat, rinv_q=rinv_q, rinv_k=rinv_k, x=_to_tiles(rows.x, tile_map),
        dsig=_to_tiles(_sigmoid_derivative(rows.x), tile_map), e_a=rows.e_a, decay=rows.decay, decay_inv=rows.decay_inv,
        decay_rest=rows.decay_rest, qd=rows.qd, kd=rows.kd, kinv=rows.kinv, kr=rows.kr,
    )
    return recomputed, _GradConstants(consts.scale, consts.c_gate, LN2)


def _exact_recompute(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, lower_bound: float, scale: float, tile_map: _TileMap, qk_l2norm: bool, beta_logits: bool,
) -> tuple[dict[str, torch.Tensor | None], _GradConstants]:
    """The same values in float64, unrounded: the safe gate, gold's l2norm, exact exponentials."""
    batch, seq_len, heads, key_dim = q.shape
    q64, k64, g64 = (x.reshape(batch * seq_len, heads, key_dim).double() for x in (q, k, g))
    qhat = khat = rinv_q = rinv_k = None
    if qk_l2norm:
        rinv_q, rinv_k = (torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q64, k64))
        q64, k64 = q64 * rinv_q, k64 * rinv_k
        qhat, khat = _to_tiles(q64, tile_map), _to_tiles(k64, tile_map)
        rinv_q, rinv_k = _to_tiles(rinv_q, tile_map), _to_tiles(rinv_k, tile_map)
    c_gate = lower_bound * math.log2(math.e)
    e_a = torch.exp(A_log.double().reshape(heads))
    x = e_a[:, None] * (g64 + dt_bias.double().reshape(heads, key_dim))
    sig = torch.sigmoid(x)
    G = torch.cumsum(_to_tiles(c_gate * sig, tile_map), dim=2)  # base 2; rows without a token add 0
    decay, decay_inv = torch.exp2(G), torch.exp2(-G)
    decay_rest = torch.exp2(G[:, :, -1:] - G)
    q_t, k_t = _to_tiles(q64, tile_map), _to_tiles(k64, tile_map)
    recomputed = dict(
        qhat=qhat, khat=khat, rinv_q=rinv_q, rinv_k=rinv_k, x=_to_tiles(x, tile_map),
        dsig=_to_tiles(sig * torch.sigmoid(-x), tile_map),
        e_a=e_a, decay=decay, decay_inv=decay_inv, decay_rest=decay_rest, qd=q_t * scale * decay,
        kd=k_t * decay, kinv=k_t * decay_inv, kr=k_t * decay_rest,
    )
    return recomputed, _GradConstants(scale, c_gate, math.log(2.0))


def _tile_operands(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    du: torch.Tensor, ws: Workspace, states: torch.Tensor, state_grads: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, scale: float | None, lower_bound: float, cu_seqlens: torch.Tensor | None,
    qk_l2norm: bool, beta_logits: bool, arith: _Arithmetic, recompute: Callable[..., tuple[dict, _GradConstants]],
) -> tuple[_TileOperands, _GradConstants, _TileMap]:
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
    blocks = (heads * snapshot_slots(tiles, num_seqs, _PER_TILE), key_dim, value_dim)
    for name, x in (("states", states), ("state_grads", state_grads)):
        if tuple(x.shape) != blocks:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, per-tile blocks are {blocks}")
    tile_map = _tile_map(cu_seqlens, batch, seq_len, tiles, q.device)
    recomputed, consts = recompute(q, k, g, beta, A_log, dt_bias, lower_bound,
                                   key_dim ** -0.5 if scale is None else scale, tile_map, qk_l2norm, beta_logits)
    exists = tile_map.slot_exists

    def per_head(t: torch.Tensor) -> torch.Tensor:
        t = arith.load(t).view(heads, tiles, *t.shape[1:])  # no-tile slots are NaN in the workspace: zero them
        return torch.where(exists.reshape(1, tiles, *([1] * (t.dim() - 2))), t, torch.zeros_like(t))

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return _to_tiles(t.reshape(batch * seq_len, heads, value_dim).to(arith.dtype), tile_map)

    ops = _TileOperands(
        **recomputed, gt=per_head(ws.gt), inv=per_head(ws.inv), mqk=per_head(ws.mqk), beta=per_head(ws.beta),
        v=tokens(v), do=tokens(do), du=tokens(du), S=_tile_blocks(states, heads, tile_map, arith),
        dS=_tile_blocks(state_grads, heads, tile_map, arith), valid=tile_map.token_of_row < batch * seq_len,
    )
    return ops, consts, tile_map


def _bwd_grads(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    du: torch.Tensor, ws: Workspace, states: torch.Tensor, state_grads: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, scale: float | None, lower_bound: float, cu_seqlens: torch.Tensor | None,
    qk_l2norm: bool, beta_logits: bool, arith: _Arithmetic, recompute: Callable[..., tuple[dict, _GradConstants]],
) -> BwdGradsResult:
    """Kernel B over every (head, tile) slot in ``arith``; the partials reduced over the tiles."""
    ops, consts, tile_map = _tile_operands(q, k, g, beta, v, do, du, ws, states, state_grads, A_log, dt_bias, scale,
                                           lower_bound, cu_seqlens, qk_l2norm, beta_logits, arith, recompute)
    grads = _tile_grads(ops, consts, arith, qk_l2norm, beta_logits)
    heads, tiles = ops.qd.shape[:2]

    def untile(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        rows = t.reshape(heads, tiles * CHUNK, *t.shape[3:])[:, tile_map.row_of_token]
        return rows.movedim(0, 1).reshape(shape)

    # the reduction over tiles: one fixed-order sum (no atomics), rounded once
    one = torch.ones((), dtype=arith.work, device=q.device)
    return BwdGradsResult(untile(grads.dq, q.shape), untile(grads.dk, q.shape), untile(grads.dg, q.shape),
                          untile(grads.dbeta, beta.shape), arith.dot(grads.dalog_partial, one, 1),
                          arith.dot(grads.ddt_partial, one, 1))


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
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None = None,
    lower_bound: float = -5.0,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> BwdGradsResult:
    """Kernel B (docs/numerics.md, "Backward: Kernel B") with the kernel's rounding.

    Inputs bf16: q, k, g (raw gate input) ``[B, T, H, K]``, beta ``[B, T, H]`` (logits when
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
    for name, x in (("q", q), ("k", k), ("g", g), ("beta", beta), ("v", v), ("do", do), ("du", du),
                    ("states", states), ("state_grads", state_grads)):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bf16 (the kernel's input type), got {x.dtype}")
    if A_log.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        raise TypeError("A_log and dt_bias must be fp32")
    heads = q.shape[2]
    _check_workspace_dtypes(ws, heads)
    return _bwd_grads(q, k, g, beta, v, do, du, ws, states, state_grads, A_log, dt_bias, scale, lower_bound,
                      cu_seqlens, qk_l2norm, beta_logits, _KERNEL, _kernel_recompute)


def chunk_bwd_grads_exact(
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
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None = None,
    lower_bound: float = -5.0,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> BwdGradsResult:
    """The formulas of :func:`mirror_bwd_grads` in float64 with no rounding at all (safe gate).

    Arguments as :func:`mirror_bwd_grads`, any float dtype, widened to float64: ``ws`` from
    :func:`prepare_exact`, ``states`` from :func:`chunk_fwd_states_exact`, ``du`` and ``state_grads``
    from :func:`chunk_bwd_scan_exact` with ``snapshot_every=1``. Every output is float64.
    """
    return _bwd_grads(q, k, g, beta, v, do, du, ws, states, state_grads, A_log, dt_bias, scale, lower_bound,
                      cu_seqlens, qk_l2norm, beta_logits, _EXACT, _exact_recompute)


# ---------------------------------------------------------------------------------------------
# The whole backward chain


def _gradient_dict(grads: BwdGradsResult, scan: BwdScanResult, dt_bias: torch.Tensor,
                   initial_state: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    return {"dq": grads.dq, "dk": grads.dk, "dv": scan.dv, "dg": grads.dg, "dbeta": grads.dbeta,
            "dA_log": grads.dA_log, "ddt_bias": grads.ddt_bias.reshape(dt_bias.shape),
            "dh0": None if initial_state is None else scan.dh0}


def mirror_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    dht: torch.Tensor | None = None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None = None,
    lower_bound: float = -5.0,
    initial_state: torch.Tensor | None = None,
    state_layout: str = "vk",
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> dict[str, torch.Tensor | None]:
    """The whole backward with the kernels' rounding: the reference backend of the autograd layer.

    :func:`~.mirror.mirror_prepare` → :func:`~.mirror.mirror_recurrence` (the training forward:
    per-tile checkpoints) → :func:`mirror_bwd_scan` (Kernel A, per-tile snapshots, from ``dht``) →
    :func:`mirror_bwd_grads` (Kernel B). Inputs bf16 as the kernels take them: q, k, g ``[B, T, H, K]``,
    v, do ``[B, T, H, V]``, beta ``[B, T, H]``; A_log fp32 ``[H]``, dt_bias fp32 ``[H, K]`` or ``[H*K]``;
    ``initial_state`` and ``dht`` None, bf16 or fp32, ``[N, H, V, K]`` ("vk") or ``[N, H, K, V]``
    ("kv"); ``cu_seqlens`` int ``[N+1]`` (B == 1).

    Returns :func:`gold_backward`'s keys: dq, dk, dv, dg, dbeta bf16 in their inputs' shapes; dA_log
    fp32 ``[H]``; ddt_bias fp32 in dt_bias's shape; dh0 in ``initial_state``'s dtype and layout (bf16,
    or the bf16 value widened), None without an initial state.
    """
    heads = q.shape[2]
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    ws = mirror_prepare(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                        cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    states = torch.full(block_states_shape(ws, heads, num_seqs, _PER_TILE), math.nan, dtype=torch.bfloat16,
                        device=q.device)
    mirror_recurrence(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state, state_layout=state_layout,
                      checkpoints=states, checkpoint_every=_PER_TILE)
    dh0_dtype = torch.float32 if initial_state is None else initial_state.dtype
    scan = mirror_bwd_scan(ws, do, cu_seqlens=cu_seqlens, dht=dht, dh0_dtype=dh0_dtype, state_layout=state_layout,
                           snapshot_every=_PER_TILE)
    grads = mirror_bwd_grads(q, k, g, beta, v, do, scan.du, ws, states, scan.snapshots, A_log=A_log,
                             dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                             qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    return _gradient_dict(grads, scan, dt_bias, initial_state)


def chunk_backward_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    dht: torch.Tensor | None = None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None = None,
    lower_bound: float = -5.0,
    initial_state: torch.Tensor | None = None,
    state_layout: str = "vk",
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> dict[str, torch.Tensor | None]:
    """:func:`mirror_backward`'s chain in float64 with no rounding (safe gate), from any float inputs:
    :func:`prepare_exact` → :func:`chunk_fwd_states_exact` → :func:`chunk_bwd_scan_exact` →
    :func:`chunk_bwd_grads_exact`. Returns :func:`gold_backward`'s keys, every gradient float64."""
    key_dim = q.shape[-1]
    scale = key_dim ** -0.5 if scale is None else scale
    ws = prepare_exact(q, k, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       qk_l2norm=qk_l2norm, beta_logits=beta_logits, cu_seqlens=cu_seqlens)
    forward = chunk_fwd_states_exact(ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                     state_layout=state_layout)
    scan = chunk_bwd_scan_exact(ws, do, cu_seqlens=cu_seqlens, dht=dht, state_layout=state_layout,
                                snapshot_every=_PER_TILE)
    grads = chunk_bwd_grads_exact(q, k, g, beta, v, do, scan.du, ws, forward.states, scan.snapshots, A_log=A_log,
                                  dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                                  qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    return _gradient_dict(grads, scan, dt_bias, initial_state)
