"""Context parallelism across processes: the exchange between ranks (torch.distributed collectives only) and FLA's
layout of a sequence over the ranks of a group.

The layout (fla-core 0.6.0's ``build_cp_context``, which :func:`build_cp_context` reproduces for callers without
FLA): the packed token row of all the group's sequences (global ``cu_seqlens``, B = 1) is cut into equal intervals,
``T / W`` tokens each for a group of W ranks (``"contiguous"``: rank r holds interval r) or ``T / 2W``
(``"zigzag"``: rank r holds intervals r and 2W − 1 − r, its local row the two side by side). An interval is a *slot*
of the chain; slots in token order are the order in which states pass from rank to rank. A rank sees its own
tokens as a packed row of local sequences (the pieces of the global sequences its intervals cut out, empty ones
dropped) and, per interval, how many slots before it hold its first sequence (``pre_num_ranks``; 0: the sequence
starts there) and how many after it hold its last (``post_num_ranks``; 0: it ends there).

The exchange is one ``all_gather`` a direction (:func:`all_gather`): every rank sends a fixed-size fp32 summary of
its slots (the forward: a slot's local final state and transition; the backward: its local state gradient and the
transition) and every rank combines the pieces it needs itself (:class:`cute_kda.context_parallel.RankChain`).
Why a gather and not a pass along the ranks: a pass waits W − 1 times for a neighbour that itself waited, while one
collective moves every piece at once (W · 2 · H · 64 KiB, tens of microseconds on NVLink) and the combine that
follows is at most W small matmuls per head, the same on every rank; FLA's own context parallelism gathers too.

Multi-GPU launches of this workplace keep NVLink multicast off (:data:`MULTICAST_OFF`, :func:`keep_multicast_off`):
the benchmark and the GPU test set it before the process group starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# torch 2.13 renamed all_gather_into_tensor (now deprecated, with a warning); torch 2.11 has only the old name
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def keep_multicast_off() -> None:
    """Set :data:`MULTICAST_OFF` in this process's environment (before NCCL starts: it reads them once)."""
    os.environ.update(MULTICAST_OFF)


def all_gather(piece: torch.Tensor, group: Any) -> torch.Tensor:
    """``[W, *piece.shape]``: every rank's ``piece`` (same shape and dtype on every rank) in rank order, by one
    collective of ``group`` (NCCL on GPUs, gloo on CPUs). Every rank of the group must call it."""
    piece = piece.contiguous()
    gathered = piece.new_empty((dist.get_world_size(group), *piece.shape))
    _GATHER_INTO(gathered.view(-1, *piece.shape[1:]), piece, group=group)  # gloo takes the ranks along dim 0
    return gathered


@dataclass
class CPContext:
    """One rank's share of a context-parallel call, with the field names of FLA's ``FLACPContext`` (the fields
    cute_kda reads): ``cu_seqlens`` int32 ``[N+1]`` (the local sequences, on the device of the global ones) and
    ``cu_seqlens_cpu``; ``layout``; for ``"contiguous"`` ``is_first_rank`` / ``pre_num_ranks`` and ``is_last_rank`` /
    ``post_num_ranks`` of its interval; for ``"zigzag"`` ``part_len`` (tokens per interval), ``front_num_seqs`` (local
    sequences of the first interval) and the same four per interval (``*_by_part``)."""

    group: Any
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    layout: str = "contiguous"
    is_first_rank: bool | None = None
    pre_num_ranks: int | None = None
    is_last_rank: bool | None = None
    post_num_ranks: int | None = None
    part_len: int | None = None
    front_num_seqs: int | None = None
    pre_num_ranks_by_part: tuple[int, int] | None = None
    post_num_ranks_by_part: tuple[int, int] | None = None
    is_first_by_part: tuple[bool, bool] | None = None
    is_last_by_part: tuple[bool, bool] | None = None


def build_cp_context(cu_seqlens: torch.Tensor, group: Any, layout: str = "contiguous", *,
                     world_size: int | None = None, rank: int | None = None) -> CPContext:
    """The :class:`CPContext` of this process's rank in ``group`` (or of ``rank`` of ``world_size``, as FLA's
    ``get_cp_cu_seqlens`` takes them) for the packed sequences ``cu_seqlens`` (int ``[N+1]``, the whole group's),
    laid out as FLA lays them out (the module docstring): the total must be a multiple of the slot count (W, or 2W
    for ``"zigzag"``). Reads ``cu_seqlens`` on the host."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    world = dist.get_world_size(group) if world_size is None else world_size
    rank = dist.get_rank(group) if rank is None else rank
    slots = world if layout == "contiguous" else 2 * world
    total = bounds[-1]
    if total < slots or total % slots:
        raise ValueError(f"the total of cu_seqlens ({total} tokens) must be a positive multiple of the {slots} "
                         f"intervals of a {layout} layout over {world} ranks")
    length = total // slots
    own = (rank,) if layout == "contiguous" else (rank, slots - 1 - rank)
    parts = [_interval(bounds, slot, length) for slot in own]
    local = parts[0][0] + [b + length for b in parts[1][0][1:]] if len(parts) == 2 else parts[0][0]
    cpu = torch.tensor(local, dtype=torch.int32)
    context = CPContext(group, cpu.to(cu_seqlens.device, non_blocking=True), cpu, layout)
    if layout == "contiguous":
        (_, pre, post), = parts
        context.is_first_rank, context.pre_num_ranks, context.is_last_rank, context.post_num_ranks = (
            pre == 0, pre, post == 0, post)
    else:
        context.part_len, context.front_num_seqs = length, len(parts[0][0]) - 1
        context.pre_num_ranks_by_part = (parts[0][1], parts[1][1])
        context.post_num_ranks_by_part = (parts[0][2], parts[1][2])
        context.is_first_by_part = (parts[0][1] == 0, parts[1][1] == 0)
        context.is_last_by_part = (parts[0][2] == 0, parts[1][2] == 0)
    return context


def _interval(bounds: list[int], slot: int, length: int) -> tuple[list[int], int, int]:
    """(local bounds, slots before it holding its first sequence, slots after it holding its last) of interval
    ``slot`` (tokens ``[slot · length, (slot + 1) · length)``) of the packed sequences ``bounds``."""
    start, end = slot * length, (slot + 1) * length
    inner = sorted({b - start for b in bounds if start < b < end})  # a set: empty sequences leave no piece
    first_start = max(b for b in bounds if b <= start)
    last_end = min(b for b in bounds if b >= end)
    return [0, *inner, length], slot - first_start // length, (last_end - 1) // length - slot
