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
    Backend, ForwardResult, GradsResult, PairSaved, Saved, ScanResult, checkpoints_shape, entering_states,
    final_state_of, pair_kept_shapes, pair_workspace_of, segment_scan, trains_pairs, workspace_of, workspace_spec,
)
from ..workspace import cross_block_views, workspace_views
from .backward import mirror_bwd_grads, mirror_bwd_scan
from .common import tile_bases
from .gates import mirror_prepare_gates
from .mirror import mirror_prepare, mirror_recurrence
from .pair_backward import tile_states_of_pairs
from .pairs import (
    PairWorkspace, mirror_bwd_scan_pairs, mirror_prepare_pairs, mirror_prepare_pairs_per_head, mirror_recurrence_pairs,
)


def _mirrored_workspace(x: Inputs, options: Options, pairs: bool = False) -> torch.Tensor:
    """K1's workspace of the gate's scheme by its mirror, in a flat uint8 buffer as the kernels lay it out; with
    ``pairs`` the pair workspace and its cross blocks (the safe and per-head gates)."""
    common = dict(A_log=x.A_log, dt_bias=x.dt_bias, scale=options.scale, cu_seqlens=x.cu_seqlens,
                  qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits)
    if pairs and options.gate == "safe":
        mirrored = mirror_prepare_pairs(x.q, x.k, x.g, x.beta, lower_bound=options.lower_bound, **common)
    elif pairs:
        mirrored = mirror_prepare_pairs_per_head(x.q, x.k, x.g, x.beta, gate=options.gate, **common)
    elif options.gate == "safe":
        mirrored = mirror_prepare(x.q, x.k, x.g, x.beta, lower_bound=options.lower_bound, **common)
    else:  # K1's per-head scheme for a per-head gate, its dyadic one per channel (the kernels' schemes)
        mirrored = mirror_prepare_gates(x.q, x.k, x.g, x.beta, gate=options.gate,
                                        scheme="per_head" if x.g.dim() == 3 else "dyadic", **common)
    spec = workspace_spec(options.problem, pairs=pairs)
    buffer = torch.empty(spec.nbytes, dtype=torch.uint8, device=x.q.device)
    fields = mirrored.ws if pairs else mirrored
    for field, value in zip(workspace_views(spec, buffer), fields):
        field.copy_(value)
    if pairs:
        for block, value in zip(cross_block_views(spec, buffer), mirrored[1:]):
            block.copy_(value)
    return buffer


def _reference_forward(x: Inputs, options: Options, segment_states: torch.Tensor | None = None,
                       token_outputs: bool = True) -> ForwardResult:
    """:func:`~cute_kda.reference.mirror_prepare` and :func:`~cute_kda.reference.mirror_recurrence`
    with checkpoints (without them under ``options.recompute``); slots the kernels leave unwritten are NaN. The mirror
    forms o either way; ``token_outputs`` False returns None for it, as the kernels' forward does. A recomputing call
    whose backward runs the two-tile form (:func:`~cute_kda.executors.stages.trains_pairs`) runs the pair chain
    (:func:`~cute_kda.reference.pairs.mirror_recurrence_pairs`), as the kernels' does."""
    problem = options.problem
    tile_base = tile_bases(x.cu_seqlens, problem.total_tokens, problem.batch) if problem.varlen else None
    if options.recompute and trains_pairs(REFERENCE, x, options):
        saved = Saved(None, None, tile_base, None, PairSaved(_mirrored_workspace(x, options, pairs=True), None))
        out, final_state = _pair_recurrence(x, options, saved)
        return ForwardResult(out.contiguous(), final_state, Saved(None, None, tile_base))
    buffer = _mirrored_workspace(x, options)
    ws = workspace_views(workspace_spec(problem), buffer)
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
    final_state = None if final_state is None else final_state_of(options, final_state.contiguous())
    return ForwardResult(out.contiguous() if token_outputs else None, final_state,
                         Saved(None if options.recompute else buffer, checkpoints, tile_base, segment_states))


def _reference_pair_states(x: Inputs, options: Options, segment_states: torch.Tensor | None = None) -> Saved:
    """The two-tile form's recomputation on the mirrors: K1's workspace and its pair workspace
    (:func:`_mirrored_workspace`), :func:`~cute_kda.reference.pairs.mirror_recurrence_pairs` keeping the state entering
    each pair (``[K, V]`` matrices) and tile a's U; rows no pair keeps are NaN. ``segment_states``: unused (the
    reference forward keeps none: it runs nothing side by side)."""
    problem, device = options.problem, x.q.device
    pair_buffer = _mirrored_workspace(x, options, pairs=True)
    kept, u_shape = pair_kept_shapes(problem)
    checkpoints = torch.full(kept, float("nan"), dtype=torch.bfloat16, device=device)
    u_a = torch.full(u_shape, float("nan"), dtype=torch.bfloat16, device=device)
    saved = Saved(_mirrored_workspace(x, options), checkpoints,
                  tile_bases(x.cu_seqlens, problem.total_tokens, problem.batch) if problem.varlen else None, None,
                  PairSaved(pair_buffer, u_a))
    _pair_recurrence(x, options._replace(final_state_dtype=None), saved)
    return saved


def _pair_recurrence(x: Inputs, options: Options, saved: Saved) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, the final state in ``options.final_state_dtype`` or None) of the pair chain over ``saved.pairs``' workspace,
    keeping the state entering each pair and tile a's U where ``saved`` has buffers for them."""
    ws, cross = pair_workspace_of(options, saved)
    wants_state = options.final_state_dtype is not None
    return mirror_recurrence_pairs(PairWorkspace(ws, *cross), x.v, cu_seqlens=x.cu_seqlens,
                                   initial_state=x.initial_state, output_final_state=wants_state,
                                   state_dtype=options.final_state_dtype if wants_state else torch.float32,
                                   state_layout="vk", checkpoints=saved.checkpoints, u_a=saved.pairs.u_a)


def _reference_scan(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None,
                    dh0_dtype: torch.dtype | None, dv_dtype: torch.dtype = torch.bfloat16) -> ScanResult:
    """:func:`~cute_kda.reference.mirror_bwd_scan` (twice for a segmented call, :func:`segment_scan`; the mirror
    computes every output in either pass, so ``token_outputs`` changes nothing here); dv converted to ``dv_dtype``
    as Kernel A stores it. With ``saved.pairs``: :func:`~cute_kda.reference.pairs.mirror_bwd_scan_pairs`, a state
    gradient a pair (the rows no pair keeps NaN)."""
    if saved.pairs is not None:
        snapshots = torch.full_like(saved.checkpoints, float("nan"))
        pair_ws, cross = pair_workspace_of(options, saved)

        def pair_scan(leaving: torch.Tensor | None, dh0: torch.Tensor | None) -> ScanResult:
            result = mirror_bwd_scan_pairs(PairWorkspace(pair_ws, *cross), do, cu_seqlens=x.cu_seqlens, dht=leaving,
                                           snapshots=snapshots)
            if dh0 is not None:
                dh0.copy_(result.dh0)
            return ScanResult(result.dv.to(dv_dtype).contiguous(), result.du.contiguous(), snapshots, dh0)

        return segment_scan(options, saved, dht, dh0_dtype, pair_scan, do.device)

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
    ``grad_dtype`` as Kernel B stores them. With ``saved.pairs`` on the per-tile matrices
    :func:`~cute_kda.reference.pair_backward.tile_states_of_pairs` rebuilds from the pair form's, as Kernel B does."""
    ws, states, state_grads = workspace_of(options, saved), saved.checkpoints, scan.state_grads
    if saved.pairs is not None:
        states, state_grads = tile_states_of_pairs(ws, states, state_grads, saved.pairs.u_a, do, scan.dv,
                                                   cu_seqlens=x.cu_seqlens)
    result = mirror_bwd_grads(
        x.q, x.k, x.g, x.beta, x.v, do, scan.du, ws, states, state_grads,
        gate=options.gate, A_log=x.A_log, dt_bias=x.dt_bias, scale=options.scale, lower_bound=options.lower_bound,
        cu_seqlens=x.cu_seqlens, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
    )
    result = GradsResult(*(None if t is None else t.contiguous() for t in result))
    dg = result.dg if x.g.dim() == 3 else result.dg.to(grad_dtype)
    return result._replace(dq=result.dq.to(grad_dtype), dk=result.dk.to(grad_dtype), dg=dg)


REFERENCE = Backend("reference", _reference_forward, _reference_scan, _reference_grads, _reference_pair_states)
