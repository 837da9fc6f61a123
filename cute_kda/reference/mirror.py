"""Chunk-16 mirror of the forward kernels: docs/numerics.md, operation by operation, in torch.

Every fp32 operation of the contract is one torch float32 operation here, in the written order;
every tensor-core sum is a float64 sum of the already-rounded operands, rounded to fp32 (and then
to the stored type) where the kernel's accumulator is. ``tanh.approx.f32`` and
``ex2.approx.ftz.f32`` run through the DSL kernels of ``cute_kda.ops.intrinsics`` when the data
is on a GPU, so the mirror sees the very instructions the kernels issue; on a CPU they fall back to
``torch.tanh`` / ``torch.exp2`` (with flush-to-zero) and a one-time warning says the results are
close to, not equal to, the kernels' (:func:`intrinsics_exact`).

K1 (:func:`mirror_prepare`) is vectorised over heads and tiles and writes a real
:class:`cute_kda.workspace.Workspace`; K2 (:func:`mirror_recurrence`) loops over the tile index
only, batched over every (head, sequence) pair, finished sequences masked.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from ..numerics import EPS, LOG2E, f32, gate_constant
from ..workspace import (
    CHUNK, SNAPSHOT_TILES, Workspace, WorkspaceSpec, allocate_workspace, snapshot_slots, tile_bases_of, tiles_per_head,
)

_SMALLEST_NORMAL_F32 = 2.0 ** -126
_warned_inexact = False


def intrinsics_exact(device: torch.device | str) -> bool:
    """Whether a mirror run on ``device`` evaluates tanh/ex2 with the kernels' PTX instructions."""
    return torch.device(device).type == "cuda"


def __getattr__(name: str):
    # INTRINSICS_EXACT (docs/numerics.md): True where a CUDA device exists, so a mirror run on it
    # is bit-faithful; evaluated on access so that importing this module touches no driver.
    if name == "INTRINSICS_EXACT":
        return torch.cuda.is_available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _warn_inexact_once() -> None:
    global _warned_inexact
    if not _warned_inexact:
        _warned_inexact = True
        warnings.warn(
            "cute_kda mirror on CPU: tanh.approx.f32 / ex2.approx.ftz.f32 are replaced by accurate "
            "torch.tanh / torch.exp2, so results are close to, not equal to, the kernels'",
            RuntimeWarning,
            stacklevel=3,
        )


def _flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < _SMALLEST_NORMAL_F32, torch.zeros_like(x), x)


def tanh_approx(x: torch.Tensor) -> torch.Tensor:
    """``tanh.approx.f32`` of an fp32 tensor (on CPU: ``torch.tanh``)."""
    if x.is_cuda:
        from ..ops.intrinsics import tanh_approx as launch

        return launch(x)
    _warn_inexact_once()
    return torch.tanh(x)


def ex2_approx(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz.f32`` of an fp32 tensor (on CPU: ``torch.exp2`` with flush-to-zero)."""
    if x.is_cuda:
        from ..ops.intrinsics import ex2_approx as launch

        return launch(x)
    _warn_inexact_once()
    return _flush_subnormals(torch.exp2(_flush_subnormals(x)))


def lg2_approx(x: torch.Tensor) -> torch.Tensor:
    """``lg2.approx.f32`` of an fp32 tensor (on CPU: ``torch.log2``)."""
    if x.is_cuda:
        from ..ops.intrinsics import lg2_approx as launch

        return launch(x)
    _warn_inexact_once()
    return torch.log2(x)


def sigmoid_approx(x: torch.Tensor) -> torch.Tensor:
    """``f32(0.5 · tanh_approx(0.5 · x) + 0.5)``: both products are exact, one rounding in the sum."""
    return tanh_approx(x * 0.5) * 0.5 + 0.5


class Constants(NamedTuple):
    """The kernels' fp32 scalars, computed in double on the host and rounded once."""

    log2e: float
    c_gate: float
    scale: float
    eps: float

    @classmethod
    def make(cls, lower_bound: float, scale: float) -> "Constants":
        return cls(LOG2E, gate_constant(lower_bound), f32(scale), EPS)


def _mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """Tensor-core ``c + a @ b`` (batched): float64 sum of the rounded operands, rounded to fp32."""
    acc = torch.matmul(a.double(), b.double())
    if c is not None:
        acc = acc + c.double()
    return acc.float()


# ---------------------------------------------------------------------------------------------
# Tile numbering (cute_kda/workspace.py)


def tile_bases(cu_seqlens: torch.Tensor | None, total_tokens: int, batch: int) -> torch.Tensor:
    """int32 ``[N+1]``: ``tile_base[s] = Σ_{j<s} ceil(len_j / 16)``, the workspace tile numbering.

    Fixed length (``cu_seqlens`` None): N = ``batch`` sequences of ``total_tokens // batch`` tokens.
    The result lives on ``cu_seqlens``' device (CPU when None).
    """
    if cu_seqlens is None:
        seq_len = total_tokens // batch if batch else 0
        return torch.arange(batch + 1, dtype=torch.int32) * ((seq_len + CHUNK - 1) // CHUNK)
    return tile_bases_of(cu_seqlens)


class _TileMap(NamedTuple):
    """Token ↔ (tile slot, row) maps of one problem (int64, on the data's device)."""

    bases: torch.Tensor  # [N+1] tile_bases
    tiles_per_seq: torch.Tensor  # [N]
    token_of_row: torch.Tensor  # [tiles, 16]: token index, or total_tokens for rows without a token
    slot_exists: torch.Tensor  # bool [tiles]: the slot is a real tile of some sequence
    row_of_token: torch.Tensor  # [total_tokens]: slot * 16 + row


def _tile_map(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int, tiles: int, device: torch.device) -> _TileMap:
    total = batch * seq_len
    if cu_seqlens is None:
        starts = torch.arange(batch, device=device, dtype=torch.int64) * seq_len
        lengths = torch.full((batch,), seq_len, device=device, dtype=torch.int64)
    else:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs batch size 1, got {batch}")
        bounds = cu_seqlens.to(device=device, dtype=torch.int64)
        if bounds.numel() < 2 or bounds[0].item() != 0 or bounds[-1].item() != total or bool((bounds[1:] < bounds[:-1]).any()):
            raise ValueError(f"cu_seqlens must rise from 0 to {total} over at least one sequence")
        starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    if lengths.numel() == 0:
        raise ValueError("need at least one sequence")
    last_seq = lengths.numel() - 1
    bases = tile_bases(None if cu_seqlens is None else bounds, total, batch).to(device=device, dtype=torch.int64)
    counts = bases[1:] - bases[:-1]

    slot = torch.arange(tiles, device=device)
    slot_seq = torch.searchsorted(bases[1:], slot, right=True).clamp(max=last_seq)  # empty sequences own no slot
    slot_exists = slot < bases[-1]
    pos = (slot - bases[slot_seq])[:, None] * CHUNK + torch.arange(CHUNK, device=device)
    has_token = slot_exists[:, None] & (pos < lengths[slot_seq][:, None])
    token_of_row = torch.where(has_token, starts[slot_seq][:, None] + pos, torch.full_like(pos, total))

    token = torch.arange(total, device=device)
    token_seq = torch.searchsorted(starts + lengths, token, right=True).clamp(max=last_seq)
    row_of_token = bases[token_seq] * CHUNK + token - starts[token_seq]
    return _TileMap(bases, counts, token_of_row, slot_exists, row_of_token)


def _token_tile_map(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> _TileMap:
    """The tile map of a call's tokens (``q`` ``[B, T, ...]``, ``cu_seqlens`` as the forward takes it)."""
    batch, seq_len = q.shape[:2]
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    tiles = tiles_per_head(batch * seq_len, num_seqs, cu_seqlens is not None)
    return _tile_map(cu_seqlens, batch, seq_len, tiles, q.device)


def _to_tiles(x: torch.Tensor, tile_map: _TileMap) -> torch.Tensor:
    """Per-token ``x`` ``[tokens, H, ...]`` → ``[H, tiles, 16, ...]``; rows without a token are 0."""
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    tiled = padded[tile_map.token_of_row]  # [tiles, 16, H, ...]
    return tiled.movedim(2, 0)


# ---------------------------------------------------------------------------------------------
# K1


def _l2norm_rinv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``f32(1 / f32(sqrt(f32(ss + EPS))))`` per row of fp32 ``x`` ``[..., D]`` → ``[..., 1]``; ``ss`` is
    summed as K1 does: sequential partials over 8 consecutive channels, then a butterfly over the
    D/8 partials."""
    squares = (x * x).unflatten(-1, (-1, 8))
    partial = squares[..., 0]
    for c in range(1, 8):
        partial = partial + squares[..., c]
    return torch.reciprocal(torch.sqrt(_row_butterfly_sum(partial) + eps)[..., None])


def _row_butterfly_sum(partial: torch.Tensor) -> torch.Tensor:
    """The ``shfl.xor`` butterfly (offsets n/2, …, 1) over the last axis of fp32 partials → ``[...]``: lane
    ``j`` adds lane ``j ^ offset``, so the halves are added elementwise, then their halves, …"""
    while partial.shape[-1] > 1:
        half = partial.shape[-1] // 2
        partial = partial[..., :half] + partial[..., half:]
    return partial[..., 0]


class _K1Rows(NamedTuple):
    """K1's values ahead of its tensor cores (docs/numerics.md, K1), shared with Kernel B's recompute.

    Per token ``[B·T, H, ...]``: ``rinv_q``, ``rinv_k`` fp32 ``[.., 1]`` (None without the l2norm),
    ``x`` (gate argument) and ``sig`` fp32 ``[.., D]``. Per head: ``e_a`` fp32 ``[H]``. Tiled
    ``[H, tiles, 16, ...]``: ``beta`` fp32 ``[.., 16]`` activated; ``G``, ``decay`` = 2^G,
    ``decay_inv`` = 2^-G, ``decay_rest`` = 2^(G_last - G) fp32 ``[.., 16, D]``; ``gt`` fp32
    ``[H, tiles, D]``; ``qd``, ``kd``, ``kinv``, ``kr`` bf16 ``[.., 16, D]``. Rows without a token have
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


def _k1_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    consts: Constants,
    tile_map: _TileMap,
    qk_l2norm: bool,
    beta_logits: bool,
) -> _K1Rows:
    """K1's l2norm, gate, β and decayed operands (docs/numerics.md, K1) for q, k, g ``[B, T, H, D]``,
    beta ``[B, T, H]`` (bf16, or fp32 taken as is), A_log ``[H]``, dt_bias ``[H, D]`` or ``[H*D]``."""
    batch, seq_len, heads, dim = q.shape
    total = batch * seq_len
    q32 = q.reshape(total, heads, dim).float()
    k32 = k.reshape(total, heads, dim).float()
    rinv_q = rinv_k = None
    if qk_l2norm:
        rinv_q = _l2norm_rinv(q32, consts.eps)
        rinv_k = _l2norm_rinv(k32, consts.eps)
        q_hat, k_hat = q32 * (rinv_q * consts.scale), k32 * rinv_k
    else:
        q_hat, k_hat = q32 * consts.scale, k32

    # gate, per token: invalid rows get gp = 0 from the zero padding of _to_tiles
    e_a = ex2_approx(A_log.float().reshape(heads) * consts.log2e)
    x = e_a[:, None] * (g.reshape(total, heads, dim).float() + dt_bias.float().reshape(heads, dim))
    sig = sigmoid_approx(x)
    gp = consts.c_gate * sig
    beta32 = beta.reshape(total, heads).float()
    beta_act = sigmoid_approx(beta32) if beta_logits else beta32

    gp_t = _to_tiles(gp, tile_map)  # [H, tiles, 16, D]
    rows = [gp_t[:, :, 0]]
    for r in range(1, CHUNK):
        rows.append(rows[-1] + gp_t[:, :, r])
    G = torch.stack(rows, dim=2)
    G_last = G[:, :, CHUNK - 1]

    qh, kh = _to_tiles(q_hat, tile_map), _to_tiles(k_hat, tile_map)
    decay, decay_inv = ex2_approx(G), ex2_approx(-G)
    decay_rest = ex2_approx(G_last[:, :, None, :] - G)
    return _K1Rows(
        rinv_q=rinv_q, rinv_k=rinv_k, x=x, sig=sig, e_a=e_a, beta=_to_tiles(beta_act, tile_map), G=G,
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
    lower_bound: float,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
) -> Workspace:
    """K1 of docs/numerics.md: the workspace the prepare kernel writes.

    q, k bf16 ``[B, T, H, D]``; g (raw gate input) ``[B, T, H, D]`` and beta ``[B, T, H]`` in bf16
    (fp32 is taken as is); A_log fp32 ``[H]``; dt_bias fp32 ``[H, D]`` or ``[H*D]``; safe gate
    ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))``. ``cu_seqlens`` int ``[N+1]`` (B == 1)
    packs N sequences. D must be 8·2^m (128 for the kernels).

    Returns a :class:`~cute_kda.workspace.Workspace` with ``tiles = tiles_per_head(B·T, N, varlen)``
    slots per head, on q's device; slots past the last real tile are NaN in every field.
    """
    batch, seq_len, heads, dim = q.shape
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise TypeError("q and k must be bf16 (the kernels' input type)")
    if dim % 8 or (dim // 8) & (dim // 8 - 1):
        raise ValueError(f"head dim must be 8·2^m, got {dim}")
    device = q.device
    consts = Constants.make(lower_bound, dim ** -0.5 if scale is None else scale)
    tile_map = _token_tile_map(q, cu_seqlens)
    tiles = tile_map.slot_exists.numel()

    rows = _k1_rows(q, k, g, beta, A_log, dt_bias, consts, tile_map, qk_l2norm, beta_logits)
    qd, kd, kinv, kr, gt, beta_t = rows.qd, rows.kd, rows.kinv, rows.kr, rows.gt, rows.beta

    A_kk = _mma(kd, kinv.transpose(-1, -2))
    A_qk = _mma(qd, kinv.transpose(-1, -2))
    L = torch.tril(beta_t[..., None] * A_kk, diagonal=-1).half()
    mqk = torch.tril(A_qk).bfloat16()

    L2 = _mma(L, L).half()
    L4 = _mma(L2, L2).half()
    L8 = _mma(L4, L4).half()
    P1 = (torch.eye(CHUNK, device=device) - L.float()).half()
    P2 = _mma(P1, L2, c=P1).half()
    P3 = _mma(P2, L4, c=P2).half()
    inv = _mma(P3, L8, c=P3).bfloat16()

    ws = allocate_workspace(WorkspaceSpec(heads=heads, tiles=tiles, dim=dim), device)
    missing = ~tile_map.slot_exists
    for name, value in (("qd", qd), ("kd", kd), ("kr", kr), ("gt", gt), ("inv", inv), ("mqk", mqk), ("beta", beta_t)):
        value = value.masked_fill(missing.reshape(1, tiles, *([1] * (value.dim() - 2))), math.nan)
        getattr(ws, name).copy_(value.reshape(getattr(ws, name).shape))
    return ws


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

    v bf16 ``[B, T, H, V]`` (V == D); ``initial_state`` None, bf16 or fp32, ``[N, H, V, K]``
    (``state_layout="vk"``, the kernels' layout) or ``[N, H, K, V]`` (``"kv"``). The state is fp32
    between tiles (``S32``); the products read its bf16 rounding ``S``. Returns o bf16 ``[B, T, H, V]``
    and, when ``output_final_state``, the final state in ``state_dtype`` (bf16: ``S``; fp32: ``S32``)
    in ``state_layout``; else None.

    ``checkpoints`` (the training forward): a bf16 ``[H · slots, K, V]`` buffer
    (:func:`cute_kda.workspace.block_states_shape` with ``every=checkpoint_every``) that receives, in slot
    ``g // checkpoint_every + s``, ``S = bf16(S32)`` entering every global tile ``g`` of sequence ``s`` that
    starts a block of ``checkpoint_every`` or the sequence; other rows are left as they are.
    """
    if v.dtype != torch.bfloat16:
        raise TypeError("v must be bf16 (the kernels' input type)")
    if state_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"state_dtype must be bf16 or fp32, got {state_dtype}")
    if state_layout not in ("vk", "kv"):
        raise ValueError(f"state_layout must be 'vk' or 'kv', got {state_layout!r}")
    batch, seq_len, heads, value_dim = v.shape
    device = v.device
    tiles = ws.qd.shape[0] // heads
    key_dim = ws.qd.shape[-1]
    if value_dim != key_dim or ws.qd.shape[0] != heads * tiles:
        raise ValueError(f"workspace {tuple(ws.qd.shape)} does not fit v {tuple(v.shape)}")
    tile_map = _tile_map(cu_seqlens, batch, seq_len, tiles, device)
    num_seqs = tile_map.tiles_per_seq.numel()

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(heads, tiles, *t.shape[1:])

    qd, kd, kr, gt, inv, mqk, beta = (per_head(t) for t in ws)
    v_t = _to_tiles(v.reshape(batch * seq_len, heads, value_dim).float(), tile_map)  # [H, tiles, 16, V]

    if initial_state is None:
        state32 = torch.zeros(heads, num_seqs, key_dim, value_dim, device=device, dtype=torch.float32)
    else:
        if initial_state.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"initial_state must be bf16 or fp32, got {initial_state.dtype}")
        init = initial_state.transpose(-1, -2) if state_layout == "vk" else initial_state
        if tuple(init.shape) != (num_seqs, heads, key_dim, value_dim):
            raise ValueError(f"initial_state has shape {tuple(initial_state.shape)} for {num_seqs} sequences")
        state32 = init.to(device=device, dtype=torch.float32).movedim(0, 1).contiguous()  # exact
    state = state32.bfloat16()  # the products' operand

    out_t = torch.empty(heads, tiles + 1, CHUNK, value_dim, device=device, dtype=torch.bfloat16)  # slot `tiles`: sink
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
        kS = _mma(kd[:, slot], state)  # [H, N, 16, V]
        qS = _mma(qd[:, slot], state)
        u = ((v_t[:, slot] - kS) * beta[:, slot][..., None]).bfloat16()
        U = _mma(inv[:, slot], u).bfloat16()
        o = _mma(mqk[:, slot], U, c=qS).bfloat16()
        updated = _mma(kr[:, slot].transpose(-1, -2), U, c=gt[:, slot][..., None] * state32)  # [H, N, K, V]
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
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_dtype: torch.dtype | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    state_layout: str = "vk",
    gate: str = "safe",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`mirror_prepare` (or for the unbounded gates ``"softplus"`` and ``"none"`` K1's overflow-free
    form, :func:`~.gates.mirror_prepare_gates` with scheme ``"dyadic"``, ``"per_head"`` for a per-head g
    ``[B, T, HV]``) then :func:`mirror_recurrence`.

    ``state_dtype`` None: the initial state's dtype, fp32 when there is none.
    """
    if gate == "safe":
        ws = mirror_prepare(
            q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
            cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
        )
    else:
        from .gates import mirror_prepare_gates  # gates builds on this module

        scheme = "per_head" if g.dim() == 3 else "dyadic"  # the kernels' K1 for a per-head / per-channel gate
        ws = mirror_prepare_gates(q, k, g, beta, scheme=scheme, gate=gate, A_log=A_log, dt_bias=dt_bias,
                                  scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    if state_dtype is None:
        state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    return mirror_recurrence(
        ws, v, cu_seqlens=cu_seqlens, initial_state=initial_state, output_final_state=output_final_state,
        state_dtype=state_dtype, state_layout=state_layout,
    )
