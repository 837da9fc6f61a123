"""A prefill on a state pool, by definition: gather → prefill → scatter (and prefix checkpoints as prefills cut short).

:func:`cute_kda.kda_forward` with ``state_indices`` does this in K2 (the slot id is the state's TMA coordinate); this
reference states what it must equal, around any forward with :func:`cute_kda.kda_forward`'s signature (the kernels
themselves, for bit-for-bit checks, or :func:`~.mirror.mirror_forward` on the CPU). It reads the slot ids on the
host and leaves the caller's pool untouched (it returns a new one).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def gather_states(pool: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """``[N, H, V, K]`` contiguous: ``pool[state_indices[n]]``, zeros where the slot is −1 (a padding row)."""
    slots = state_indices.to(device=pool.device, dtype=torch.int64)
    valid = (slots >= 0).view(-1, 1, 1, 1)
    return torch.where(valid, pool[slots.clamp(min=0)], torch.zeros((), dtype=pool.dtype, device=pool.device))


def sequence_bounds(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, first token, length) of every sequence of a call."""
    if cu_seqlens is None:
        return [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    bounds = cu_seqlens.tolist()
    return [(0, start, end - start) for start, end in zip(bounds, bounds[1:])]


def prefill_on_pool(
    forward: Forward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    pool: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
    checkpoint_every: int | None = None, checkpoint_indices: torch.Tensor | None = None, **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, the pool after the call) of ``kda_forward(..., initial_state=pool, state_indices=..., ...)``.

    The states of the listed slots are gathered (zeros for −1), ``forward`` runs the prefill from them with a final
    state, and each final state goes back to its slot (none for −1). Checkpoint ``[n, j]`` is the final state of
    ``forward`` over the first ``(j + 1)·checkpoint_every`` tokens of sequence n alone, from its gathered state, when
    the sequence has that many tokens and both its slot and the checkpoint's slot are not −1. ``options``: further
    keywords of ``forward`` (gate, A_log, dt_bias, vsplit, ...).
    """
    entering = gather_states(pool, state_indices)
    out, final = forward(q, k, v, g, beta, initial_state=entering, output_final_state=True, cu_seqlens=cu_seqlens,
                         **options)
    result = pool.clone()
    slots = state_indices.tolist()
    for n, slot in enumerate(slots):
        if slot >= 0:
            result[slot] = final[n]
    if checkpoint_indices is None:
        return out, result
    for n, (row, start, length) in enumerate(sequence_bounds(q, cu_seqlens)):
        for j, target in enumerate(checkpoint_indices[n].tolist()):
            stop = (j + 1) * checkpoint_every
            if slots[n] < 0 or target < 0 or stop > length:
                continue
            cut = [x[row:row + 1, start:start + stop].clone() for x in (q, k, v, g, beta)]  # aligned copies
            _, state = forward(*cut, initial_state=entering[n:n + 1], output_final_state=True, **options)
            result[target] = state[0]
    return out, result
