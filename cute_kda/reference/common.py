"""What the references share: the kernels' approximate intrinsics and fp32 constants, tensor-core sums in
either arithmetic (the kernels' rounding or float64), the workspace's tile numbering and the token ↔ tile maps,
the row sums in the kernels' order, and the straddle levels of the dyadic scheme.

``tanh.approx.f32``, ``ex2.approx.ftz.f32`` and ``lg2.approx.f32`` run through the DSL kernels of
``cute_kda.ops.intrinsics`` when the data is on a GPU, so a mirror sees the very instructions the kernels
issue; on a CPU they fall back to ``torch.tanh`` / ``torch.exp2`` (with flush-to-zero) / ``torch.log2`` and a
one-time warning says the results are close to, not equal to, the kernels' (:func:`intrinsics_exact`).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, NamedTuple

import torch

from ..numerics import EPS, LOG2E, f32, gate_constant
from ..validation import ACTIVATION_DTYPES
from ..workspace import CHUNK, Workspace, snapshot_slots, tile_bases_of, tiles_per_head
from .gold import STATE_LAYOUTS

PER_TILE = 1  # Kernel B reads the state entering each tile and the gradient leaving it: a block every tile
_SMALLEST_NORMAL_F32 = 2.0 ** -126
_warned_inexact = False


# ---------------------------------------------------------------------------------------------
# The kernels' approximate intrinsics


def intrinsics_exact(device: torch.device | str) -> bool:
    """Whether a mirror run on ``device`` evaluates tanh/ex2 with the kernels' PTX instructions."""
    return torch.device(device).type == "cuda"


def __getattr__(name: str):
    # INTRINSICS_EXACT (docs/numerics.md): True where a CUDA device exists, so a mirror run on it
    # is bit-faithful; evaluated on access so that importing this module touches no driver.
    if name == "INTRINSICS_EXACT":
        return torch.cuda.is_available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < _SMALLEST_NORMAL_F32, torch.zeros_like(x), x)


def _approx(name: str, x: torch.Tensor, on_cpu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The intrinsic ``name`` of ``cute_kda.ops.intrinsics`` on a GPU tensor; ``on_cpu(x)`` and the warning else."""
    global _warned_inexact
    if x.is_cuda:
        from ..ops import intrinsics  # launches DSL kernels: imported only where a GPU runs them

        return getattr(intrinsics, name)(x)
    if not _warned_inexact:
        _warned_inexact = True
        warnings.warn(
            "cute_kda mirror on CPU: tanh.approx.f32 / ex2.approx.ftz.f32 are replaced by accurate "
            "torch.tanh / torch.exp2, so results are close to, not equal to, the kernels'",
            RuntimeWarning,
            stacklevel=3,
        )
    return on_cpu(x)


def tanh_approx(x: torch.Tensor) -> torch.Tensor:
    """``tanh.approx.f32`` of an fp32 tensor (on CPU: ``torch.tanh``)."""
    return _approx("tanh_approx", x, torch.tanh)


def ex2_approx(x: torch.Tensor) -> torch.Tensor:
    """``ex2.approx.ftz.f32`` of an fp32 tensor (on CPU: ``torch.exp2`` with flush-to-zero)."""
    return _approx("ex2_approx", x, lambda y: _flush_subnormals(torch.exp2(_flush_subnormals(y))))


def lg2_approx(x: torch.Tensor) -> torch.Tensor:
    """``lg2.approx.f32`` of an fp32 tensor (on CPU: ``torch.log2``)."""
    return _approx("lg2_approx", x, torch.log2)


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


# ---------------------------------------------------------------------------------------------
# Sums in the kernels' rounding, or in float64


def mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """Tensor-core ``c + a @ b`` (batched): float64 sum of the rounded operands, rounded to fp32."""
    acc = torch.matmul(a.double(), b.double())
    if c is not None:
        acc = acc + c.double()
    return acc.float()


def dot_f32(a: torch.Tensor, b: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """``f32(Σ a·b)`` over ``dim``: float64 sum of the exact products of fp32/bf16 operands, as :func:`mma`."""
    return (a.double() * b.double()).sum(dim).float()


class Arithmetic(NamedTuple):
    """Where the backward kernels round: their contract (:data:`KERNEL`), or nowhere (:data:`EXACT`)."""

    dtype: torch.dtype  # type of the bf16 values: Kernel A's dS, dU, dv, du_out, snapshots; Kernel B's v, dO, du, S
    load: Callable[[torch.Tensor], torch.Tensor]  # a workspace field (or state block) as the chain reads it
    store: Callable[[torch.Tensor], torch.Tensor]  # a value the kernel holds as bf16 (smem, operand, output)
    mma: Callable[..., torch.Tensor]  # one tensor-core accumulation ``c + a @ b`` (``c`` optional)
    work: torch.dtype  # type of the values the kernels hold in fp32 registers
    # Σ a·b over dims, a reduction whose order the contract leaves open: the exact sum rounded once
    dot: Callable[[torch.Tensor, torch.Tensor, int | tuple[int, ...]], torch.Tensor]


KERNEL = Arithmetic(torch.bfloat16, lambda x: x, torch.Tensor.bfloat16, mma, torch.float32, dot_f32)
EXACT = Arithmetic(torch.float64, torch.Tensor.double, lambda x: x,
                   lambda a, b, c=None: a @ b if c is None else a @ b + c, torch.float64,
                   lambda a, b, dim: (a * b).sum(dim))


def row_butterfly_sum(partial: torch.Tensor) -> torch.Tensor:
    """The ``shfl.xor`` butterfly (offsets n/2, …, 1) over the last axis of fp32 partials → ``[...]``: lane
    ``j`` adds lane ``j ^ offset``, so the halves are added elementwise, then their halves, …"""
    while partial.shape[-1] > 1:
        half = partial.shape[-1] // 2
        partial = partial[..., :half] + partial[..., half:]
    return partial[..., 0]


def row_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``Σ_c x_c·y_c`` per row of fp32 ``[..., D]`` in K1's order: fp32 products, sequential partials over 8
    consecutive channels, then the butterfly over the D/8 partials → ``[...]``."""
    products = (x * y).unflatten(-1, (-1, 8))
    partial = products[..., 0]
    for c in range(1, 8):
        partial = partial + products[..., c]
    return row_butterfly_sum(partial)


def l2norm_rinv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``f32(1 / f32(sqrt(f32(ss + EPS))))`` per row of fp32 ``x`` ``[..., D]`` → ``[..., 1]``; ``ss`` = ``Σ x²``
    summed as K1 does (:func:`row_dot`)."""
    return torch.reciprocal(torch.sqrt(row_dot(x, x) + eps)[..., None])


def neumann_inverse(L: torch.Tensor) -> torch.Tensor:
    """INV = (I + L)⁻¹ of fp16 strictly lower L ``[..., 16, 16]`` by K1's fp16 Neumann product → bf16."""
    L2 = mma(L, L).half()
    L4 = mma(L2, L2).half()
    L8 = mma(L4, L4).half()
    P1 = (torch.eye(CHUNK, device=L.device) - L.float()).half()
    P2 = mma(P1, L2, c=P1).half()
    P3 = mma(P2, L4, c=P2).half()
    return mma(P3, L8, c=P3).bfloat16()


def qk_backward(dx_hat: torch.Tensor, x_hat: torch.Tensor | None, rinv: torch.Tensor | None,
                row_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Through the l2norm ``x̂ = x·rinv``: ``dx = rinv·(dx̂ − x̂·(x̂·dx̂))``; without it, dx = dx̂. ``row_sum(a, b)``
    ``[..., 1]``: the dot product over the channels (default the plain sum)."""
    if x_hat is None:
        return dx_hat
    dot = (x_hat * dx_hat).sum(-1, keepdim=True) if row_sum is None else row_sum(x_hat, dx_hat)
    return rinv * (dx_hat - x_hat * dot)


def crossing_rows(through_prefix: torch.Tensor, through_suffix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row terms of ``dγ_s`` that carry token s's decay ``[.., 16, K]``: ``Σ_{r≥s}`` of the prefix terms
    (dqd⊙qd + dkd⊙kd) and ``Σ_{r<s}`` of the suffix terms (dkr⊙kr), in the inputs' dtype."""
    from_s = torch.flip(torch.cumsum(torch.flip(through_prefix, [2]), dim=2), [2])
    before_s = torch.cat([torch.zeros_like(through_suffix[:, :, :1]),
                          torch.cumsum(through_suffix, dim=2)[:, :, :-1]], dim=2)
    return from_s, before_s


# ---------------------------------------------------------------------------------------------
# The dyadic scheme's straddle levels (docs/numerics.md, "Ways to compute A and Mqk")


def straddle_geometry(block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(middle ``[16]``, upper ``[16]``, mask ``[16, 16]``) of one straddle level with blocks of ``block`` rows.

    Row r's block has the middle row ``m`` = the last row of its first half; r is *upper* when r > m.
    ``mask[i, j]``: i upper and j lower in the same block — the pairs that straddle m. Over the four
    levels of :data:`~cute_kda.numerics.DYADIC_BLOCKS` every pair i > j straddles exactly one level's m (the
    highest bit in which i and j differ picks it)."""
    rows = torch.arange(CHUNK, device=device)
    middle = rows // block * block + block // 2 - 1
    upper = rows > middle
    mask = (rows[:, None] // block == rows[None, :] // block) & upper[:, None] & ~upper[None, :]
    return middle, upper, mask


def straddle_sums(row_sums: torch.Tensor, column_sums: torch.Tensor, block: int, upper: torch.Tensor
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


# ---------------------------------------------------------------------------------------------
# Tile numbering (cute_kda/workspace.py) and the token ↔ tile maps


def tile_bases(cu_seqlens: torch.Tensor | None, total_tokens: int, batch: int) -> torch.Tensor:
    """int32 ``[N+1]``: ``tile_base[s] = Σ_{j<s} ceil(len_j / 16)``, the workspace tile numbering.

    Fixed length (``cu_seqlens`` None): N = ``batch`` sequences of ``total_tokens // batch`` tokens.
    The result lives on ``cu_seqlens``' device (CPU when None).
    """
    if cu_seqlens is None:
        seq_len = total_tokens // batch if batch else 0
        return torch.arange(batch + 1, dtype=torch.int32) * ((seq_len + CHUNK - 1) // CHUNK)
    return tile_bases_of(cu_seqlens)


class TileMap(NamedTuple):
    """Token ↔ (tile slot, row) maps of one problem (int64, on the data's device)."""

    bases: torch.Tensor  # [N+1] tile_bases
    tiles_per_seq: torch.Tensor  # [N]
    token_of_row: torch.Tensor  # [tiles, 16]: token index, or total_tokens for rows without a token
    slot_exists: torch.Tensor  # bool [tiles]: the slot is a real tile of some sequence
    row_of_token: torch.Tensor  # [total_tokens]: slot * 16 + row


def tile_map_of(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int, tiles: int, device: torch.device) -> TileMap:
    """The maps of ``batch`` rows of ``seq_len`` tokens (or one row of packed sequences) over ``tiles`` slots."""
    total = batch * seq_len
    if cu_seqlens is None:
        starts = torch.arange(batch, device=device, dtype=torch.int64) * seq_len
        lengths = torch.full((batch,), seq_len, device=device, dtype=torch.int64)
    else:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs batch size 1, got {batch}")
        bounds = cu_seqlens.to(device=device, dtype=torch.int64)
        if (bounds.numel() < 2 or bounds[0].item() != 0 or bounds[-1].item() != total
                or bool((bounds[1:] < bounds[:-1]).any())):
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
    return TileMap(bases, counts, token_of_row, slot_exists, row_of_token)


def token_tile_map(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> TileMap:
    """The tile map of a call's tokens (``q`` ``[B, T, ...]``, ``cu_seqlens`` as the forward takes it)."""
    batch, seq_len = q.shape[:2]
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    tiles = tiles_per_head(batch * seq_len, num_seqs, cu_seqlens is not None)
    return tile_map_of(cu_seqlens, batch, seq_len, tiles, q.device)


class ScanShape(NamedTuple):
    """The sizes of a scan over a workspace's tiles: a per-token tensor's ``[B, T, H, V]`` and the workspace's tiles
    per head and key dim K, with the problem's tile map."""

    batch: int
    seq_len: int
    heads: int
    value_dim: int
    tiles: int
    key_dim: int
    tile_map: TileMap


def scan_shape(ws: Workspace, x: torch.Tensor, name: str, cu_seqlens: torch.Tensor | None,
               state_layout: str) -> ScanShape:
    """Checks that the workspace ``ws`` ``[H·tiles, 16, K]`` fits the per-token ``x`` ``[B, T, H, V]`` (named
    ``name``) and that ``state_layout`` is one of :data:`~.gold.STATE_LAYOUTS`; returns their sizes and the tile map."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    batch, seq_len, heads, value_dim = x.shape
    tiles = ws.qd.shape[0] // heads
    if ws.qd.shape[0] != heads * tiles:
        raise ValueError(f"workspace {tuple(ws.qd.shape)} does not fit {name} {tuple(x.shape)}")
    return ScanShape(batch, seq_len, heads, value_dim, tiles, ws.qd.shape[-1],
                     tile_map_of(cu_seqlens, batch, seq_len, tiles, x.device))


def to_tiles(x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """Per-token ``x`` ``[tokens, H, ...]`` → ``[H, tiles, 16, ...]``; rows without a token are 0."""
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    tiled = padded[tiles.token_of_row]  # [tiles, 16, H, ...]
    return tiled.movedim(2, 0)


def untile(x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """``[H, tiles, 16, ...]`` → ``[tokens, H, ...]``: the inverse of :func:`to_tiles`."""
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, tiles.row_of_token].movedim(0, 1)


def tile_blocks(blocks: torch.Tensor, heads: int, tiles: TileMap, arith: Arithmetic) -> torch.Tensor:
    """Per-tile state blocks ``[H·slots, K, V]`` (slot g + s) → ``[H, tiles, K, V]``; no-tile slots 0."""
    count = tiles.slot_exists.numel()
    num_seqs = tiles.tiles_per_seq.numel()
    slots = snapshot_slots(count, num_seqs, PER_TILE)
    tile = torch.arange(count, device=blocks.device)
    seq = torch.searchsorted(tiles.bases[1:], tile, right=True).clamp(max=num_seqs - 1)
    rows = arith.load(blocks).view(heads, slots, *blocks.shape[1:])[:, (tile + seq).clamp(max=slots - 1)]
    return torch.where(tiles.slot_exists[None, :, None, None], rows, torch.zeros_like(rows))


def workspace_of_tiles(fields: dict[str, torch.Tensor], tiles: TileMap) -> Workspace:
    """``[H, tiles, ...]`` fields → a Workspace ``[H · tiles, ...]``; slots that are no tile NaN, as in K1."""
    missing = ~tiles.slot_exists
    out = {}
    for name, value in fields.items():
        heads, count = value.shape[:2]
        value = value.masked_fill(missing.reshape(1, count, *([1] * (value.dim() - 2))), math.nan)
        out[name] = value.reshape(heads * count, *value.shape[2:]).contiguous()
    return Workspace(**out)


def check_activations(**tensors: torch.Tensor) -> torch.dtype:
    """The one dtype of the kernels' token tensors ``tensors`` (bf16, or fp16: docs/numerics.md, "fp16 inputs");
    a TypeError naming them otherwise."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or not dtypes <= set(ACTIVATION_DTYPES):
        names = " and ".join(tensors)
        raise TypeError(f"{names} must be all bf16 or all fp16 (the kernels' input types), got "
                        f"{', '.join(str(t.dtype) for t in tensors.values())}")
    return dtypes.pop()


def state_in(state: torch.Tensor | None, name: str, state_layout: str, shape: tuple[int, int, int, int],
             dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A chain's entering state (or state gradient) ``state`` ``[N, H, V, K]`` ("vk") or ``[N, H, K, V]`` ("kv")
    → ``[H, N, K, V]`` in ``dtype`` (exact from bf16 and fp32; zeros for None); ``shape`` is (N, H, K, V)."""
    if state is None:
        return torch.zeros(shape[1], shape[0], *shape[2:], device=device, dtype=dtype)
    init = state.transpose(-1, -2) if state_layout == "vk" else state
    if tuple(init.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(state.shape)} for {shape[0]} sequences")
    return init.to(device=device, dtype=dtype).movedim(0, 1).contiguous()


def state_out(dS: torch.Tensor, state_layout: str, dtype: torch.dtype) -> torch.Tensor:
    """``[N, H, K, V]`` → ``state_layout`` in ``dtype``."""
    return (dS.transpose(-1, -2) if state_layout == "vk" else dS).to(dtype).contiguous()
