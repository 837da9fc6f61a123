"""Backward references: autograd through the gold, and the reverse state-gradient scan (Kernel A).

- :func:`gold_backward`: every input gradient of the gold token recurrence by torch autograd in
  fp64, through the gate, l2norm and β-sigmoid as :func:`~.gold.gold_forward` computes them — the
  accuracy yardstick of the backward.
- :func:`mirror_bwd_scan`: Kernel A of docs/numerics.md ("Backward: Kernel A") with the kernel's
  rounding, over a K1 workspace; loops over the tile step only, batched over every
  (head, sequence), each sequence running from its own last tile down to its first.
- :func:`chunk_bwd_scan_exact` with :func:`prepare_exact`: the same chain in float64 without any
  rounding, over exact chunk quantities. It equals the gold's dv and dh0 to fp64 precision, which
  proves the chain; the mirror then differs from it by rounding only.

The chain needs no forward state: dv and the state gradients are linear in dO and dht and do not
depend on S (the recurrence is affine in S).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..workspace import CHUNK, SNAPSHOT_TILES, Workspace, WorkspaceSpec, snapshot_slots, tiles_per_head
from .gold import STATE_LAYOUTS, gate_log_decay, gold_forward, l2norm
from .mirror import _fma_f32, _mma, _tile_map, _to_tiles


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
    """Where the scan rounds: the kernel's contract, or nowhere (float64 throughout)."""

    dtype: torch.dtype  # type of dS, dU, dv, du_out and the snapshots
    load: Callable[[torch.Tensor], torch.Tensor]  # a workspace field as the chain reads it
    store: Callable[[torch.Tensor], torch.Tensor]  # a value the kernel holds as bf16 (smem, operand, output)
    mma: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # one tensor-core accumulation
    fma: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_KERNEL = _Arithmetic(torch.bfloat16, lambda x: x, torch.Tensor.bfloat16, _mma, _fma_f32)
_EXACT = _Arithmetic(torch.float64, torch.Tensor.double, lambda x: x, torch.matmul, lambda a, b, c: a * b + c)


def _reverse_scan(
    ws: Workspace,
    do: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    dht: torch.Tensor | None,
    state_layout: str,
    arith: _Arithmetic,
    snapshot_every: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Kernel A chain (docs/numerics.md) in ``arith``; returns du, dv, dS ``[N, H, K, V]``, snapshots."""
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

    if dht is None:
        state = torch.zeros(heads, num_seqs, key_dim, value_dim, device=device, dtype=arith.dtype)
    else:
        init = dht.transpose(-1, -2) if state_layout == "vk" else dht
        if tuple(init.shape) != (num_seqs, heads, key_dim, value_dim):
            raise ValueError(f"dht has shape {tuple(dht.shape)} for {num_seqs} sequences")
        state = init.to(device=device, dtype=arith.dtype).movedim(0, 1).contiguous()  # [H, N, K, V]

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
        W = arith.mma(torch.cat([qd[:, slot], kd[:, slot]], -2).transpose(-1, -2), torch.cat([dO, -dv], -2))
        updated = arith.store(arith.fma(gt[:, slot][..., None], state, W))
        state = torch.where(active[None, :, None, None], updated, state)
        du_t.index_copy_(1, target, arith.store(du))
        dv_t.index_copy_(1, target, dv)

    def untile(t: torch.Tensor) -> torch.Tensor:
        rows = t[:, :tiles].reshape(heads, tiles * CHUNK, value_dim)[:, tile_map.row_of_token]
        return rows.movedim(0, 1).reshape(batch, seq_len, heads, value_dim)

    snapshot_rows = snapshots[:, :slots].reshape(heads * slots, key_dim, value_dim)
    return untile(du_t), untile(dv_t), state.movedim(1, 0), snapshot_rows


def _state_out(dS: torch.Tensor, state_layout: str, dtype: torch.dtype) -> torch.Tensor:
    """``[N, H, K, V]`` → ``state_layout`` in ``dtype``."""
    return (dS.transpose(-1, -2) if state_layout == "vk" else dS).to(dtype).contiguous()


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
    fp32, ``[N, H, V, K]`` (``state_layout="vk"``) or ``[N, H, K, V]`` (``"kv"``), rounded to bf16
    on entry. Returns du, dv bf16 ``[B, T, H, V]``; dh0 in ``dh0_dtype`` (bf16, or the bf16 value
    widened exactly to fp32) in ``state_layout``; snapshots bf16 ``[H*tiles, K, V]`` (see
    :class:`BwdScanResult`). An empty sequence passes ``bf16(dht)`` through to its dh0.
    """
    if do.dtype != torch.bfloat16:
        raise TypeError("do must be bf16 (the kernel's input type)")
    if dht is not None and dht.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"dht must be bf16 or fp32, got {dht.dtype}")
    if dh0_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dh0_dtype must be bf16 or fp32, got {dh0_dtype}")
    heads = do.shape[2]
    spec = WorkspaceSpec(heads=heads, tiles=ws.qd.shape[0] // heads, dim=ws.qd.shape[-1])
    for name, (_, dtype) in spec.fields().items():
        if getattr(ws, name).dtype != getattr(torch, dtype):
            raise TypeError(f"workspace field {name} is {getattr(ws, name).dtype}, the kernels write {dtype}")
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
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    tiles = tiles_per_head(total, num_seqs, cu_seqlens is not None)
    tile_map = _tile_map(cu_seqlens, batch, seq_len, tiles, q.device)

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
