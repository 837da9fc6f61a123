"""Static configuration of one forward call, and the choice of variant.

A :class:`ForwardConfig` names everything that selects compiled code (the flags of K1, the state
modes and V-split of K2); sizes that vary per call are not part of it. The launchers in
``cute_kda.ops`` key their compile caches by the parts they consume. The V-split heuristic itself
lives next to K2 (:func:`cute_kda.ops.recurrence.choose_vsplit`).
"""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple

import torch

from .validation import SUPPORTED_VSPLITS, ProblemShape

STATE_MODES = (None, torch.bfloat16, torch.float32)  # no state, bf16 state, fp32 state


class ForwardConfig(NamedTuple):
    """Everything that selects compiled code for one forward call.

    qk_l2norm: K1 l2-normalises q and k.  beta_logits: K1 applies sigmoid to beta.
    varlen: packed sequences with ``cu_seqlens``.  initial_state / final_state: None, bf16 or fp32
    (``[N, H, V, K]``).  vsplit: K2 CTAs per (sequence, head), each owning 128/vsplit V columns.
    """

    qk_l2norm: bool
    beta_logits: bool
    varlen: bool
    initial_state: torch.dtype | None
    final_state: torch.dtype | None
    vsplit: int


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side property query, no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=4096)  # on every call's host path: a look-up instead of an import and a scan
def resolve_vsplit(vsplit: int | None, num_seqs: int, heads: int, sms: int) -> int:
    """The caller's ``vsplit``, or K2's heuristic for ``num_seqs × heads`` CTAs on ``sms`` SMs."""
    if vsplit is not None:
        return vsplit
    from .ops.recurrence import choose_vsplit

    return choose_vsplit(num_seqs, heads, sms)


def select_forward_config(
    problem: ProblemShape,
    *,
    qk_l2norm: bool,
    beta_logits: bool,
    initial_state: torch.dtype | None,
    final_state: torch.dtype | None,
    vsplit: int | None,
    sms: int,
) -> ForwardConfig:
    """The variant that serves ``problem`` with these flags and state modes."""
    return ForwardConfig(
        qk_l2norm=bool(qk_l2norm),
        beta_logits=bool(beta_logits),
        varlen=problem.varlen,
        initial_state=initial_state,
        final_state=final_state,
        vsplit=resolve_vsplit(vsplit, problem.num_seqs, problem.heads, sms),
    )


def enumerate_configs(
    *,
    qk_l2norm: tuple[bool, ...] = (True,),
    beta_logits: tuple[bool, ...] = (True,),
    varlen: tuple[bool, ...] = (False, True),
    state_modes: tuple[torch.dtype | None, ...] = STATE_MODES,
    vsplits: tuple[int, ...] = SUPPORTED_VSPLITS,
) -> Iterator[ForwardConfig]:
    """Every combination of the given flag values (for ahead-of-time warm-up).

    A state mode applies to both ends (initial state in, final state out), the common case; a
    call that mixes modes compiles its own variant on first use.
    """
    for l2 in qk_l2norm:
        for logits in beta_logits:
            for packed in varlen:
                for mode in state_modes:
                    for split in vsplits:
                        yield ForwardConfig(l2, logits, packed, mode, mode, split)
