"""The forward and the backward as ``torch.library`` custom ops, so ``torch.compile`` can trace calls of
:func:`cute_kda.kda_forward` and :func:`cute_kda.chunk_kda`, and training steps around them, without a
graph break.

Registered when ``cute_kda`` is imported, each with a fake (meta) implementation that gives the exact
output shapes and dtypes:

- ``torch.ops.cute_kda.forward``: the inference forward; its real implementation is the eager
  forward (``cute_kda.api._forward``: validation, variant choice, K1, K2 on the current stream).
- ``torch.ops.cute_kda.forward_train``: the training forward of :mod:`cute_kda.autograd` (a fresh
  workspace, K1, K2 with checkpoints), which also returns what the backward reads (the flat workspace,
  the checkpoints, ``tile_base``); its backward is registered with ``torch.library.register_autograd``
  and is one op too,
- ``torch.ops.cute_kda.backward``: Kernel A, then Kernel B when a token or gate gradient is needed.

The public functions route through the ops only while Dynamo traces (``torch.compiler.is_compiling()``):
an eager call never meets the dispatcher and keeps its host cost (an eager training call runs the
``torch.autograd.Function`` of :mod:`cute_kda.autograd` on the same stages), and DLPack/CuPy/JAX
inputs keep going through the eager path. ``forward_train`` is traced when grad mode is on and an
input requires grad, as in eager.

What the traced path changes: caller buffers (``out=``, ``final_state=``) are filled by a copy of the
op's result (inference only: a recorded call refuses them at trace time, as eager does), and the
checks that need real memory (alignment, device) run when the compiled graph runs, inside the op.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import autograd, context_parallel, validation

OP_NAME = "cute_kda::forward"
TRAIN_OP_NAME = "cute_kda::forward_train"
BACKWARD_OP_NAME = "cute_kda::backward"


@torch.library.custom_op(OP_NAME, mutates_args=())
def forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], scale: float, lower_bound: float, final_state_dtype: Optional[torch.dtype],
    vsplit: int, qk_l2norm: bool, beta_logits: bool, gate: str, segments: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_forward`` on torch tensors; ``final_state_dtype`` None means no final state (then the
    second output is an empty tensor), ``vsplit`` and ``segments`` 0 mean the heuristics; A_log, dt_bias None with
    ``gate="none"``."""
    from . import api

    final_state = None
    if final_state_dtype is not None:
        shape = _state_shape(q, v, cu_seqlens)
        final_state = torch.empty(shape, dtype=final_state_dtype, device=q.device)
    o, state = api._forward(
        q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        initial_state=initial_state, output_final_state=False, cu_seqlens=cu_seqlens, out=None,
        final_state=final_state, vsplit=vsplit or None, qk_l2norm=qk_l2norm, beta_logits=beta_logits, gate=gate,
        segments=segments or None,
    )
    return o, (state if state is not None else q.new_empty((0,)))


@forward_op.register_fake
def _forward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                  final_state_dtype, vsplit, qk_l2norm, beta_logits, gate, segments):
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    if final_state_dtype is None:
        return o, q.new_empty((0,))
    return o, q.new_empty(_state_shape(q, v, cu_seqlens), dtype=final_state_dtype)


def _state_shape(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple:
    """``[N, HV, V, K]``: N sequences (B, or the packed count of ``cu_seqlens``), v's heads."""
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (num_seqs, v.shape[2], v.shape[3], q.shape[3])


# ---------------------------------------------------------------------------------------------
# training: the forward that keeps what the backward reads, and the backward


def _stages() -> autograd.Backend:
    """The stages the training ops run: always the kernels (a test replaces this function to run the
    ops on the references)."""
    return autograd.KERNELS


@torch.library.custom_op(TRAIN_OP_NAME, mutates_args=())
def forward_train_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], scale: float, lower_bound: float, final_state_dtype: Optional[torch.dtype],
    vsplit: int, qk_l2norm: bool, beta_logits: bool, recompute: bool, gate: str, segments: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training forward (arguments as :func:`forward_op`, and ``recompute``: keep nothing for the
    backward, which recomputes it; ``gate`` as :func:`cute_kda.autograd.check_trainable` admits). Returns out bf16
    ``[B, T, HV, V]``, the final state ``[N, HV, V, K]`` (empty when ``final_state_dtype`` is None), the flat uint8
    workspace ``[WorkspaceSpec.nbytes]``, the checkpoints bf16 ``[HV · slots, D, D]`` (state images; both empty under
    ``recompute``), ``tile_base`` int32 ``[N+1]`` (empty for fixed length) and the segment states fp32
    ``[2, segments, HV, V, K]`` (empty unsplit). A segmented call's workspace, checkpoints and ``tile_base`` are those
    of its packed problem (:func:`cute_kda.autograd.packed`)."""
    problem = validation.validate_forward(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=initial_state, cu_seqlens=cu_seqlens, vsplit=vsplit or None, gate=gate,
    )
    autograd.check_trainable(gate, q, v, g)
    x = autograd.Inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, autograd.staged_cu_seqlens(cu_seqlens, q))
    options = autograd.Options(problem, scale, lower_bound, qk_l2norm, beta_logits, final_state_dtype, vsplit or None,
                               recompute, gate, autograd.segmentation_of(problem, q.device, segments or None,
                                                                         vsplit or None))
    result = _stages().forward(*autograd.packed(x, options))
    saved = result.saved
    workspace = q.new_empty((0,), dtype=torch.uint8) if saved.workspace is None else saved.workspace
    checkpoints = q.new_empty((0, 0, 0), dtype=torch.bfloat16) if saved.checkpoints is None else saved.checkpoints
    segment_states = q.new_empty((0,), dtype=torch.float32) if saved.segment_states is None else saved.segment_states
    return (
        result.out.view(v.shape), q.new_empty((0,)) if result.final_state is None else result.final_state, workspace,
        checkpoints, q.new_empty((0,), dtype=torch.int32) if saved.tile_base is None else saved.tile_base,
        segment_states,
    )


@forward_train_op.register_fake
def _forward_train_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                        final_state_dtype, vsplit, qk_l2norm, beta_logits, recompute, gate, segments):
    problem = autograd.problem_of(q, v, cu_seqlens)
    seg = autograd.segmentation_of(problem, q.device, segments or None, vsplit or None)
    segment_states = q.new_empty((0,), dtype=torch.float32)
    if seg is not None:
        problem = seg.problem(problem.heads, problem.head_dim)
        segment_states = q.new_empty((2, seg.count, problem.heads, problem.head_dim, problem.head_dim),
                                     dtype=torch.float32)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    state = q.new_empty((0,)) if final_state_dtype is None else q.new_empty(_state_shape(q, v, cu_seqlens),
                                                                             dtype=final_state_dtype)
    workspace = q.new_empty((0 if recompute else autograd.workspace_spec(problem).nbytes,), dtype=torch.uint8)
    checkpoints = q.new_empty((0, 0, 0) if recompute else autograd.checkpoints_shape(problem), dtype=torch.bfloat16)
    tile_base = q.new_empty((problem.num_seqs + 1 if problem.varlen else 0,), dtype=torch.int32)
    return o, state, workspace, checkpoints, tile_base, segment_states


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())
def backward_op(
    do: torch.Tensor, dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], workspace: torch.Tensor,
    checkpoints: torch.Tensor, tile_base: Optional[torch.Tensor], segment_states: Optional[torch.Tensor], scale: float,
    lower_bound: float, qk_l2norm: bool, beta_logits: bool, dh0_dtype: Optional[torch.dtype], token_grads: bool,
    recompute: bool, gate: str, segments: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """The backward of :func:`forward_train_op`: do bf16 ``[B, T, H, V]``; dht None or ``[N, H, V, K]``;
    the forward's inputs (``initial_state`` read only under ``recompute``) and saved outputs (``tile_base``
    None for fixed length, ``segment_states`` None unsplit; workspace and checkpoints empty under ``recompute``);
    ``segments`` as the forward had it. Returns dq, dk, dv, dg,
    dbeta, dA_log, ddt_bias, dh0 in their inputs' shapes and dtypes; dq, dk, dg, dbeta, dA_log, ddt_bias
    are empty unless ``token_grads``, dh0 unless ``dh0_dtype`` (then ``[N, HV, V, K]`` in it); dA_log, ddt_bias
    empty for the log decay (gate "none", no A_log / dt_bias)."""
    problem = autograd.problem_of(q, v, cu_seqlens)
    user = autograd.Inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, autograd.staged_cu_seqlens(cu_seqlens, q))
    options = autograd.Options(problem, scale, lower_bound, qk_l2norm, beta_logits, None, None, recompute, gate,
                               autograd.segmentation_of(problem, q.device, segments or None, None))
    x, options = autograd.packed(user, options)
    constants = token_grads and A_log is not None
    needs = (token_grads, token_grads, True, token_grads, token_grads, constants, constants, dh0_dtype is not None)
    kept = (None, None) if recompute else (workspace, checkpoints)
    saved = autograd.Saved(*kept, tile_base, segment_states)
    grads = autograd.backward(_stages(), x, options, saved, do, dht, needs, dh0_dtype)
    grads = autograd.unpacked(grads, autograd.shapes_of(user))
    return tuple(q.new_empty((0,)) if grad is None else grad for grad in grads)


@backward_op.register_fake
def _backward_fake(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, workspace, checkpoints,
                   tile_base, segment_states, scale, lower_bound, qk_l2norm, beta_logits, dh0_dtype, token_grads,
                   recompute, gate, segments):
    def like(t: torch.Tensor | None, wanted: bool) -> torch.Tensor:
        if t is None or not wanted:
            return q.new_empty((0,))
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    dh0 = q.new_empty((0,)) if dh0_dtype is None else q.new_empty(_state_shape(q, v, cu_seqlens), dtype=dh0_dtype)
    return (like(q, token_grads), like(k, token_grads), like(v, True), like(g, token_grads), like(beta, token_grads),
            like(A_log, token_grads), like(dt_bias, token_grads), dh0)


_TRAIN_INPUTS = 18  # arguments of forward_train_op


def _setup_train_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound = inputs[:11]
    vsplit, qk_l2norm, beta_logits, recompute, gate, segments = inputs[12:]
    _, _, workspace, checkpoints, tile_base, segment_states = output
    ctx.mark_non_differentiable(workspace, checkpoints, tile_base, segment_states)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state if recompute else None, cu_seqlens,
                          workspace, checkpoints, tile_base, segment_states)
    # the backward's split is the forward's: the heuristic's, unless the forward fixed V-split or segments
    ctx.options = (scale, lower_bound, qk_l2norm, beta_logits, recompute, gate,
                   segments if segments or not vsplit else 1)
    ctx.initial_state_dtype = None if initial_state is None else initial_state.dtype


def _train_backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor, *_: Any) -> tuple:
    autograd.check_first_order()
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, workspace, checkpoints, tile_base,
     segment_states) = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dh0_dtype = ctx.initial_state_dtype if needs[7] else None
    scale, lower_bound, qk_l2norm, beta_logits, recompute, gate, segments = ctx.options
    grads = backward_op(
        d_out, d_final if d_final.numel() else None, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
        workspace, checkpoints, tile_base if tile_base.numel() else None,
        segment_states if segment_states.numel() else None, scale, lower_bound, qk_l2norm, beta_logits,
        dh0_dtype, any(needs[i] for i in autograd.KERNEL_B_INPUTS), recompute, gate, segments,
    )
    return (*(grad if need else None for grad, need in zip(grads, needs[:8])), *(None,) * (_TRAIN_INPUTS - 8))


forward_train_op.register_autograd(_train_backward, setup_context=_setup_train_context)


def kda_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float,
    initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None,
    out: torch.Tensor | None, final_state: torch.Tensor | None, vsplit: int | None, qk_l2norm: bool,
    beta_logits: bool, recompute: bool = False, gate: str = "safe", segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`cute_kda.kda_forward` as Dynamo traces it: the same arguments and results, one op (the
    training op when autograd records the call)."""
    training = validation.needs_autograd(q, k, v, g, beta, A_log, dt_bias, initial_state)
    validation.check_gate(gate)
    for name, x in (("q", q), ("v", v), ("g", g)):
        validation.check_is_tensor(name, x)
    if training:
        validation.check_no_buffers_under_autograd(out=out, final_state=final_state)
        autograd.check_trainable(gate, q, v, g)
    if gate == "safe":
        validation.check_lower_bound(lower_bound)
    validation.check_vsplit(vsplit)
    context_parallel.check_segments(segments)
    scale = q.shape[-1] ** -0.5 if scale is None else validation.check_scale(scale)
    wants_state = final_state is not None or output_final_state
    state_dtype = None
    if wants_state:
        state_dtype = (final_state.dtype if final_state is not None
                       else torch.float32 if initial_state is None else initial_state.dtype)
    arguments = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, float(scale), float(lower_bound),
                 state_dtype, vsplit or 0, bool(qk_l2norm), bool(beta_logits))
    if training:
        o, state, *_ = forward_train_op(*arguments, bool(recompute), gate, segments or 0)
    else:
        o, state = forward_op(*arguments, gate, segments or 0)
    if out is not None:
        out.copy_(o)
        o = out
    if final_state is not None:
        final_state.copy_(state)
        return o, final_state
    return o, (state if wants_state else None)


def chunk_kda(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`cute_kda.chunk_kda` as Dynamo traces it: the FLA translation, then :func:`kda_forward`."""
    from . import api

    call = api.translate_fla_call(*args, **kwargs)
    return call.run(lambda *tensors, **options: kda_forward(
        *tensors, out=None, final_state=None, vsplit=None, recompute=call.recompute, **options))
