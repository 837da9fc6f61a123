"""Chunk-16 mirrors of the forward kernels: docs/numerics.md, operation by operation, in torch.

Every fp32 operation of the contract is one torch float32 operation here, in the written order;
every tensor-core sum is a float64 sum of the already-rounded operands, rounded to fp32 (and then
to the stored type) where the kernel's accumulator is (:mod:`.common`: the intrinsics, :func:`~.common.mma`).

K1 of the safe gate (:func:`mirror_prepare`) is vectorised over heads and tiles and writes a real
:class:`cute_kda.workspace.Workspace`; the unbounded gates' K1 is :func:`~.gates.mirror_prepare_gates`.
K2 (:func:`mirror_recurrence`) loops over the tile index only, batched over every (head, sequence) pair,
finished sequences masked. :func:`mirror_forward` runs the K1 a gate takes, then K2.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..workspace import CHUNK, SNAPSHOT_TILES, Workspace, snapshot_slots
from .common import (
    Constants, TileMap, check_activations, ex2_approx, l2norm_rinv, mma, neumann_inverse, sigmoid_approx, scan_shape,
    state_in, to_tiles, token_tile_map, workspace_of_tiles,
)
from .gates import mirror_prepare_gates
from .gold import expand_to_value_heads, value_head_group

class K1Rows(NamedTuple):
    """The safe K1's values ahead of its tensor cores (docs/numerics.md, K1), shared with Kernel B's recompute.

    Per token and q/k head ``[B·T, H, 1]``: ``rinv_q``, ``rinv_k`` fp32 (None without the l2norm). Per token and
    value head ``[B·T, HV, D]``: ``x`` (gate argument) and ``sig`` fp32. Per value head: ``e_a`` fp32 ``[HV]``.
    Tiled ``[HV, tiles, 16, ...]``: ``beta`` fp32 ``[.., 16]`` activated; ``G``, ``decay`` = 2^G,
    ``decay_inv`` = 2^-G, ``decay_rest`` = 2^(G_last - G) fp32 ``[.., 16, D]``; ``gt`` fp32
    ``[HV, tiles, D]``; ``qd``, ``kd``, ``kinv``, ``kr`` bf16 ``[.., 16, D]``. Rows without a token have
    β = 0 and zero operands; their G repeats the last valid row's (g' = 0 there).
    """

    rinv_q: torch.Tensor | None
    rinv_k: torch.Tensor | None
    x: torch.Tensor
    sig: torch.Tensor
    e_a: torch.Tensor
    beta: torch.Tensor
    G: torch.Tensor
    decay: torch.Tensor
    decay_inv: torch.Tensor
    decay_rest: torch.Tensor
    gt: torch.Tensor
    qd: torch.Tensor
    kd: torch.Tensor
    kinv: torch.Tensor
    kr: torch.Tensor


def k1_rows(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor,
            dt_bias: torch.Tensor, consts: Constants, tile_map: TileMap, qk_l2norm: bool, beta_logits: bool) -> K1Rows:
    """The safe K1's l2norm, gate, β and decayed operands (docs/numerics.md, K1) for q, k ``[B, T, H, D]``,
    g ``[B, T, HV, D]``, beta ``[B, T, HV]`` (bf16, or fp32 taken as is), A_log ``[HV]``, dt_bias ``[HV, D]`` or
    ``[HV*D]``; HV a multiple of H (value head ``j`` reads q/k head ``j // (HV / H)``)."""
    batch, seq_len, heads, dim = q.shape
    value_heads = beta.shape[2]
    group = value_head_group(heads, value_heads)
    total = batch * seq_len
    q32 = q.reshape(total, heads, dim).float()
    k32 = k.reshape(total, heads, dim).float()
    rinv_q = rinv_k = None
    if qk_l2norm:
        rinv_q = l2norm_rinv(q32, consts.eps)
        rinv_k = l2norm_rinv(k32, consts.eps)
        q_hat, k_hat = q32 * (rinv_q * consts.scale), k32 * rinv_k
    else:
        q_hat, k_hat = q32 * consts.scale, k32

    # gate, per token: invalid rows get gp = 0 from the zero padding of to_tiles
    e_a = ex2_approx(A_log.float().reshape(value_heads) * consts.log2e)
    x = e_a[:, None] * (g.reshape(total, value_heads, dim).float() + dt_bias.float().reshape(value_heads, dim))
    sig = sigmoid_approx(x)
    gp = consts.c_gate * sig
    beta32 = beta.reshape(total, value_heads).float()
    beta_act = sigmoid_approx(beta32) if beta_logits else beta32

    gp_t = to_tiles(gp, tile_map)  # [HV, tiles, 16, D]
    rows = [gp_t[:, :, 0]]
    for r in range(1, CHUNK):
        rows.append(rows[-1] + gp_t[:, :, r])
    G = torch.stack(rows, dim=2)
    G_last = G[:, :, CHUNK - 1]

    qh, kh = (to_tiles(expand_to_value_heads(t, group, dim=1), tile_map) for t in (q_hat, k_hat))
    decay, decay_inv = ex2_approx(G), ex2_approx(-G)
    decay_rest = ex2_approx(G_last[:, :, None, :] - G)
    return K1Rows(
        rinv_q=rinv_q, rinv_k=rinv_k, x=x, sig=sig, e_a=e_a, beta=to_tiles(beta_act, tile_map), G=G,
        decay=decay, decay_inv=decay_inv, decay_rest=decay_rest, gt=ex2_approx(G_last),
        qd=(qh * decay).bfloat16(), kd=(kh * decay).bfloat16(), kinv=(kh * decay_inv).bfloat16(),
        kr=(kh * decay_rest).bfloat16(),
    )


def mirror_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = -5.0,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> Workspace:
    """K1 of docs/numerics.md for the safe gate: the workspace the prepare kernel writes.

    q, k bf16 or fp16 ``[B, T, H, D]`` (fp16 widened exactly, as bf16); g (raw gate input) ``[B, T, HV, D]`` and
    beta ``[B, T, HV]`` in q's dtype or bf16 (fp32 is taken as is); A_log fp32 ``[HV]``; dt_bias fp32 ``[HV, D]``
    or ``[HV*D]``; safe gate ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))``. HV (value heads) a multiple
    of H: value head ``j`` reads q/k head ``j // (HV / H)``. ``cu_seqlens`` int ``[N+1]`` (B == 1) packs N sequences. D must be
    8·2^m (128 or 64 for the kernels: their l2norm sums D / 8 lane partials by the same butterfly).

    Returns a :class:`~cute_kda.workspace.Workspace` with ``tiles = tiles_per_head(B·T, N, varlen)``
    slots per value head, on q's device; slots past the last real tile are NaN in every field.
    """
    return safe_k1(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                   cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits).workspace


class SafeK1(NamedTuple):
    """:func:`mirror_prepare`'s constants, tile map, per-token values and workspace (the two-tile prefill's K1,
    :func:`~.pairs.mirror_prepare_pairs`, starts from them)."""

    consts: Constants
    tile_map: TileMap
    rows: K1Rows
    workspace: Workspace


def safe_k1(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, A_log: torch.Tensor,
            dt_bias: torch.Tensor, lower_bound: float, scale: float | None, cu_seqlens: torch.Tensor | None,
            qk_l2norm: bool, beta_logits: bool) -> SafeK1:
    """:func:`mirror_prepare` (its arguments), with the values it passes through."""
    dim = q.shape[-1]
    check_activations(q=q, k=k)
    if dim % 8 or (dim // 8) & (dim // 8 - 1):
        raise ValueError(f"head dim must be 8·2^m, got {dim}")
    consts = Constants.make(lower_bound, dim ** -0.5 if scale is None else scale)
    tile_map = token_tile_map(q, cu_seqlens)
    rows = k1_rows(q, k, g, beta, A_log, dt_bias, consts, tile_map, qk_l2norm, beta_logits)
    A_kk = mma(rows.kd, rows.kinv.transpose(-1, -2))
    A_qk = mma(rows.qd, rows.kinv.transpose(-1, -2))
    L = torch.tril(rows.beta[..., None] * A_kk, diagonal=-1).half()
    fields = dict(qd=rows.qd, kd=rows.kd, kr=rows.kr, gt=rows.gt, inv=neumann_inverse(L),
                  mqk=torch.tril(A_qk).bfloat16(), beta=rows.beta)
    return SafeK1(consts, tile_map, rows, workspace_of_tiles(fields, tile_map))


# ---------------------------------------------------------------------------------------------
# K2


def mirror_recurrence(
    ws: Workspace,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_dtype: torch.dtype = torch.float32,
    state_layout: str = "vk",
    checkpoints: torch.Tensor | None = None,
    checkpoint_every: int = SNAPSHOT_TILES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K2 of docs/numerics.md over the workspace ``ws`` (from K1 or :func:`mirror_prepare`).

    v bf16 or fp16 ``[B, T, H, V]`` (V == D; o in v's dtype); ``initial_state`` None, bf16, fp16 or fp32,
    ``[N, H, V, K]`` (``state_layout="vk"``, the kernels' layout) or ``[N, H, K, V]`` (``"kv"``). The state is fp32
    between tiles (``S32``); the products read its bf16 rounding ``S``. Returns o ``[B, T, H, V]`` in v's dtype
    and, when ``output_final_state``, the final state in ``state_dtype`` (bf16: ``S``; fp32: ``S32``; fp16:
    ``f16(S32)``)
    in ``state_layout``; else None.

    ``checkpoints`` (the training forward): a bf16 ``[H · slots, K, V]`` buffer
    (:func:`cute_kda.workspace.block_states_shape` with ``every=checkpoint_every``) that receives, in slot
    ``g // checkpoint_every + s``, ``S = bf16(S32)`` entering every global tile ``g`` of sequence ``s`` that
    starts a block of ``checkpoint_every`` or the sequence; other rows are left as they are.
    """
    check_activations(v=v)
    if state_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"state_dtype must be bf16, fp16 or fp32, got {state_dtype}")
    batch, seq_len, heads, value_dim, tiles, key_dim, tile_map = scan_shape(ws, v, "v", cu_seqlens, state_layout)
    if value_dim != key_dim:
        raise ValueError(f"workspace {tuple(ws.qd.shape)} does not fit v {tuple(v.shape)}")
    device = v.device
    num_seqs = tile_map.tiles_per_seq.numel()

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(heads, tiles, *t.shape[1:])

    qd, kd, kr, gt, inv, mqk, beta = (per_head(t) for t in ws)
    v_t = to_tiles(v.reshape(batch * seq_len, heads, value_dim).float(), tile_map)  # [H, tiles, 16, V]

    if initial_state is not None and initial_state.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"initial_state must be bf16, fp16 or fp32, got {initial_state.dtype}")
    state32 = state_in(initial_state, "initial_state", state_layout, (num_seqs, heads, key_dim, value_dim),
                       torch.float32, device)
    state = state32.bfloat16()  # the products' operand

    out_t = torch.empty(heads, tiles + 1, CHUNK, value_dim, device=device, dtype=v.dtype)  # slot `tiles`: sink
    starts = tile_map.bases[:-1]
    if checkpoints is not None:
        slots = snapshot_slots(tiles, num_seqs, checkpoint_every)
        if checkpoints.dtype != torch.bfloat16 or tuple(checkpoints.shape) != (heads * slots, key_dim, value_dim):
            raise ValueError(f"checkpoints must be bf16 {(heads * slots, key_dim, value_dim)}, "
                             f"got {checkpoints.dtype} {tuple(checkpoints.shape)}")
        kept = torch.empty(heads, slots + 1, key_dim, value_dim, device=device, dtype=torch.bfloat16)  # slot `slots`: sink
        kept[:, :slots] = checkpoints.view(heads, slots, key_dim, value_dim)
        seq_index = torch.arange(num_seqs, device=device)
    steps = int(tile_map.tiles_per_seq.max().item()) if num_seqs else 0
    for step in range(steps):
        active = step < tile_map.tiles_per_seq  # [N]
        slot = (starts + torch.clamp(tile_map.tiles_per_seq - 1, min=0).clamp(max=step)).clamp(max=max(tiles - 1, 0))
        if checkpoints is not None:
            keep = active & ((slot % checkpoint_every == 0) | (step == 0))
            kept.index_copy_(1, torch.where(keep, slot // checkpoint_every + seq_index, torch.full_like(slot, slots)),
                             state)
        kS = mma(kd[:, slot], state)  # [H, N, 16, V]
        qS = mma(qd[:, slot], state)
        u = ((v_t[:, slot] - kS) * beta[:, slot][..., None]).bfloat16()
        U = mma(inv[:, slot], u).bfloat16()
        o = mma(mqk[:, slot], U, c=qS).to(v.dtype)
        updated = mma(kr[:, slot].transpose(-1, -2), U, c=gt[:, slot][..., None] * state32)  # [H, N, K, V]
        state32 = torch.where(active[None, :, None, None], updated, state32)
        state = state32.bfloat16()
        out_t.index_copy_(1, torch.where(active, slot, torch.full_like(slot, tiles)), o)

    if checkpoints is not None:
        checkpoints.copy_(kept[:, :slots].reshape(checkpoints.shape))
    o_rows = out_t[:, :tiles].reshape(heads, tiles * CHUNK, value_dim)[:, tile_map.row_of_token]
    out = o_rows.movedim(0, 1).reshape(batch, seq_len, heads, value_dim)
    if not output_final_state:
        return out, None
    final = (state if state_dtype == torch.bfloat16 else state32).movedim(1, 0)
    if state_layout == "vk":
        final = final.transpose(-1, -2)
    return out, final.to(state_dtype).contiguous()


def mirror_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    gate: str = "safe",
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_dtype: torch.dtype | None = None,
    state_layout: str = "vk",
    **k1_options: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`mirror_prepare` (or for the unbounded gates ``"softplus"`` and ``"none"`` K1's overflow-free
    form, :func:`~.gates.mirror_prepare_gates` with scheme ``"dyadic"``, ``"per_head"`` for a per-head g
    ``[B, T, HV]``) then :func:`mirror_recurrence`. ``k1_options``: K1's keywords (``A_log``, ``dt_bias``,
    ``lower_bound``, ``scale``, ``qk_l2norm``, ``beta_logits``), passed on as those take them. The two-tile
    prefill's twin: :func:`~.pairs.mirror_forward_pairs`.

    ``state_dtype`` None: the initial state's dtype, fp32 when there is none.
    """
    if state_dtype is None:
        state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    if gate == "safe":
        ws = mirror_prepare(q, k, g, beta, cu_seqlens=cu_seqlens, **k1_options)
    else:
        ws = mirror_prepare_gates(q, k, g, beta, gate=gate, cu_seqlens=cu_seqlens, **k1_options)
    return mirror_recurrence(
        ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state, output_final_state=output_final_state,
        state_dtype=state_dtype, state_layout=state_layout,
    )
