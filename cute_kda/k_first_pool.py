"""A prefill on a K-first state pool (FLA's default layout, ``[slots, HV, K, V]``), staged through a v-first pool.

K2 moves ``[V, K]`` blocks (its TMA boxes run along K), so a K-first pool cannot be its TMA tensor. The drop-ins
(``chunk_kda``, ``chunk_gated_delta_rule`` with ``state_indices`` and ``state_v_first=False``) instead run the
v-first pool call on a pool of their own, ``[N · (1 + M), HV, V, K]``: row n holds sequence n's state (transposed
from its slot, zeros for a padding row) and row ``N + n·M + j`` checkpoint ``[n, j]`` (first the old contents of its
slot, so a checkpoint the prefill does not reach writes back what was there). Afterwards every row goes back,
transposed, to its slot with one ``index_copy_``. All of it is torch work on the current stream, with no host
synchronisation, so the rows whose slot is −1 cannot be dropped from the copy; each is sent to the slot of the first
row that has one, with that row's value (equal duplicates: the result does not depend on their order). Only when no
row at all has a slot does the copy write slot 0's own contents back. Padding rows also read slot 0 (and discard it).
Cost: two transposing copies of the listed states beyond the v-first call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import validation

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def run_on_k_first_pool(forward: Forward, tensors: tuple[torch.Tensor, ...],
                        options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, the pool) of ``forward(*tensors, **options)`` (:func:`cute_kda.kda_forward`'s signature) where
    ``options["initial_state"]`` is a K-first pool ``[slots, HV, K, V]`` and ``state_indices`` /
    ``checkpoint_indices`` name its slots (module docstring)."""
    pool, slots = options["initial_state"], options["state_indices"]
    checkpoints = options.get("checkpoint_indices")
    _check_k_first_pool(pool, slots, checkpoints)
    staged, local_slots, local_checkpoints, targets = _stage(pool, slots, checkpoints)
    o, _ = forward(*tensors, **{**options, "initial_state": staged, "state_indices": local_slots,
                                "checkpoint_indices": local_checkpoints})
    _unstage(pool, staged, targets)
    return o, pool


def _check_k_first_pool(pool: Any, slots: Any, checkpoints: Any) -> None:
    """The caller's pool and slot tensors, before any torch work touches them (the staged call checks the rest)."""
    pool = validation.check_is_tensor("initial_state", pool)
    validation.check_dtype("initial_state", pool, validation.STATE_DTYPES)
    validation.check_ndim("initial_state", pool, 4, "[slots, HV, K, V] (a K-first state pool)")
    if pool.shape[0] == 0 or pool.stride(-1) != 1:
        raise ValueError(f"initial_state (a K-first state pool) must hold at least one slot and have a contiguous last "
                         f"dimension, got shape {list(pool.shape)} and strides {list(pool.stride())}")
    for name, tensor, ndim in (("state_indices", slots, 1), ("checkpoint_indices", checkpoints, 2)):
        if tensor is not None or name == "state_indices":
            tensor = validation.check_is_tensor(name, tensor)
            validation.check_dtype(name, tensor, (torch.int32,))
            validation.check_ndim(name, tensor, ndim, "[N]" if ndim == 1 else "[N, M]")
            validation.check_same_device(name, tensor, pool.device, "initial_state")


def _stage(pool: torch.Tensor, slots: torch.Tensor, checkpoints: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(the v-first staging pool, its slot ids, its checkpoint slot ids, the caller's slot of every staged row)."""
    num_seqs = slots.shape[0]
    targets = slots.to(torch.int64)
    local_checkpoints = None
    if checkpoints is not None:
        count = checkpoints.numel()
        targets = torch.cat([targets, checkpoints.reshape(-1).to(torch.int64)])
        rows = torch.arange(num_seqs, num_seqs + count, dtype=torch.int32, device=pool.device).view(checkpoints.shape)
        local_checkpoints = torch.where(checkpoints >= 0, rows, -1).to(torch.int32)
    listed = (targets >= 0).view(-1, 1, 1, 1)
    old = pool[targets.clamp(min=0)].transpose(-1, -2)  # [rows, HV, V, K]
    staged = torch.where(listed, old, torch.zeros((), dtype=pool.dtype, device=pool.device)).contiguous()
    local_slots = torch.where(slots >= 0, torch.arange(num_seqs, dtype=torch.int32, device=pool.device), -1)
    return staged, local_slots.to(torch.int32), local_checkpoints, targets


def _unstage(pool: torch.Tensor, staged: torch.Tensor, targets: torch.Tensor) -> None:
    """Every staged row → its slot of ``pool``, transposed; rows without a slot duplicate the first row with one."""
    listed = targets >= 0
    first = torch.argmax(listed.to(torch.int8))  # 0 when no row is listed
    any_listed = listed[first]
    values = staged.transpose(-1, -2)  # [rows, HV, K, V]
    stand_in = torch.where(any_listed, values[first], pool[0])
    slot = torch.where(listed, targets, torch.where(any_listed, targets[first], 0))
    rows = torch.where(listed.view(-1, 1, 1, 1), values, stand_in)
    pool.index_copy_(0, slot, rows)
