"""The training stages on the mirror references: :data:`REFERENCE`, the twin of
:data:`cute_kda.executors.stages.KERNELS` (the same three stages, the same results' layouts), on any device.

Only callers that name it get it (``cute_kda.executors.training.kda_forward(..., backend=REFERENCE)``; the tests):
the whole training chain then runs on the CPU. Its results are made C-contiguous like the kernels' (the fake
implementations of the ops promise that layout); slots the kernels leave unwritten are NaN.
"""

from __future__ import annotations

import torch

from ..call import Inputs, Options
from ..executors.stages import (
    Backend, ForwardResult, GradsResult, Saved, ScanResult, entering_states, final_state_of, segment_scan,
    checkpoints_shape, workspace_of, workspace_spec,
)
from ..workspace import workspace_views
from .backward import mirror_bwd_grads, mirror_bwd_scan
from .gates import mirror_prepare_gates
from .common import tile_bases
from .mirror import mirror_prepare, mirror_recurrence


def _reference_forward(x: Inputs, options: Options, segment_states: torch.Tensor | None = None,
                       token_outputs: bool = True) -> ForwardResult:
    """:func:`~cute_kda.reference.mirror_prepare` and :func:`~cute_kda.reference.mirror_recurrence`
    with checkpoints (without them under ``options.recompute``); slots the kernels leave unwritten are NaN. The mirror
    forms o either way; ``token_outputs`` False returns None for it, as the kernels' forward does."""
    problem = options.problem
    if options.gate == "safe":
        mirrored = mirror_prepare(
            x.q, x.k, x.g, x.beta, A_log=x.A_log, dt_bias=x.dt_bias, lower_bound=options.lower_bound,
            scale=options.scale, cu_seqlens=x.cu_seqlens, qk_l2norm=options.qk_l2norm,
            beta_logits=options.beta_logits,
        )
    else:  # K1's per-head scheme for a per-head gate, its dyadic one per channel (the kernels' schemes)
        mirrored = mirror_prepare_gates(
            x.q, x.k, x.g, x.beta, gate=options.gate, A_log=x.A_log, dt_bias=x.dt_bias, scale=options.scale,
            cu_seqlens=x.cu_seqlens, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
            scheme="per_head" if x.g.dim() == 3 else "dyadic",
        )
    buffer = torch.empty(workspace_spec(problem).nbytes, dtype=torch.uint8, device=x.q.device)
    ws = workspace_views(workspace_spec(problem), buffer)
    for field, value in zip(ws, mirrored):
        field.copy_(value)
    checkpoints = None
    if not options.recompute:
        checkpoints = torch.full(checkpoints_shape(problem), float("nan"), dtype=torch.bfloat16, device=x.q.device)

    def final_states(v: torch.Tensor, initial: torch.Tensor | None, into: torch.Tensor) -> None:
        into.copy_(mirror_recurrence(ws, v, cu_seqlens=x.cu_seqlens, initial_state=initial, output_final_state=True,
                                     state_layout="vk")[1])

    initial_state, segment_states = entering_states(options, x, segment_states, final_states)
    wants_state = options.final_state_dtype is not None
    state_dtype = torch.float32 if options.segmentation is not None or not wants_state else options.final_state_dtype
    out, final_state = mirror_recurrence(
        ws, x.v, cu_seqlens=x.cu_seqlens, initial_state=initial_state, output_final_state=wants_state,
        state_dtype=state_dtype, state_layout="vk", checkpoints=checkpoints,
    )
    tile_base = tile_bases(x.cu_seqlens, problem.total_tokens, problem.batch) if problem.varlen else None
    final_state = None if final_state is None else final_state_of(options, final_state.contiguous())
    return ForwardResult(out.contiguous() if token_outputs else None, final_state,
                         Saved(None if options.recompute else buffer, checkpoints, tile_base, segment_states))


def _reference_scan(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None,
                    dh0_dtype: torch.dtype | None, dv_dtype: torch.dtype = torch.bfloat16) -> ScanResult:
    """:func:`~cute_kda.reference.mirror_bwd_scan` (twice for a segmented call, :func:`segment_scan`; the mirror
    computes every output in either pass, so ``token_outputs`` changes nothing here); dv converted to ``dv_dtype``
    as Kernel A stores it."""
    def scan(leaving: torch.Tensor | None, dh0: torch.Tensor | None, token_outputs: bool = True) -> ScanResult:
        result = mirror_bwd_scan(workspace_of(options, saved), do, cu_seqlens=x.cu_seqlens, dht=leaving,
                                 dh0_dtype=torch.float32 if dh0 is None else dh0.dtype, state_layout="vk")
        if dh0 is not None:
            dh0.copy_(result.dh0)
        return ScanResult(result.dv.to(dv_dtype).contiguous(), result.du.contiguous(), result.snapshots.contiguous(),
                          dh0)

    return segment_scan(options, saved, dht, dh0_dtype, scan, do.device)


def _reference_grads(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, scan: ScanResult,
                     grad_dtype: torch.dtype = torch.bfloat16) -> GradsResult:
    """:func:`~cute_kda.reference.backward.mirror_bwd_grads`; dq, dk and a per-channel gate's dg converted to
    ``grad_dtype`` as Kernel B stores them."""
    result = mirror_bwd_grads(
        x.q, x.k, x.g, x.beta, x.v, do, scan.du, workspace_of(options, saved), saved.checkpoints, scan.state_grads,
        gate=options.gate, A_log=x.A_log, dt_bias=x.dt_bias, scale=options.scale, lower_bound=options.lower_bound,
        cu_seqlens=x.cu_seqlens, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
    )
    result = GradsResult(*(None if t is None else t.contiguous() for t in result))
    dg = result.dg if x.g.dim() == 3 else result.dg.to(grad_dtype)
    return result._replace(dq=result.dq.to(grad_dtype), dk=result.dk.to(grad_dtype), dg=dg)


REFERENCE = Backend("reference", _reference_forward, _reference_scan, _reference_grads)
