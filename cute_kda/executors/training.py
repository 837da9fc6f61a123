"""The training executor: a call that autograd records runs here, its forward and backward behind one
``torch.autograd.Function`` (eager) or as the custom ops ``torch.ops.cute_kda.forward_train`` and
``torch.ops.cute_kda.backward`` (under ``torch.compile``).

Forward (training): a fresh K1 workspace per call (never the inference executor's shared buffer, which the next
call reuses), K1, then K2 writing also the bf16 state entering every tile (``checkpoints``,
:func:`cute_kda.workspace.block_states_shape`). Saved for the backward: the raw inputs, the workspace, the
checkpoints, ``cu_seqlens`` on the device and ``tile_base``. With ``recompute`` the forward keeps neither: K2 runs
without checkpoints and the workspace is freed when the forward returns; the backward runs K1 and K2 (with
checkpoints) again from the saved inputs, ``initial_state`` included, before Kernel A. The recomputation is the
same kernels on the same inputs, so the gradients are bit-identical to the default path's; it costs one K1 and one
K2 per backward and saves the workspace and checkpoints (about 2.8× the bf16 q, k, v, g of the call) for as long as
the graph holds the call.

Backward: dO (zeros when only the final state is used) and dht (None when the final state is unused or absent) →
Kernel A (dv, du, the per-tile state gradients, dh0) → Kernel B (dq, dk, dg, dβ and per-tile partial sums of
ddt_bias / dA_log, reduced by ``.sum(1)``: deterministic). Kernel B runs only when one of q, k, g, beta, A_log,
dt_bias needs a gradient. Everything is ordered on the current stream (a recomputation side by side,
``stages.SPLIT_RECOMPUTE``, forks side streams and joins them back); nothing synchronises the host. Gradients come
back only for the inputs that need them, each in its input's dtype and shape (dh0 in ``initial_state``'s
``[N, HV, V, K]`` layout and dtype). fp16 inputs: the forward runs the fp16 K1 / K2 and keeps what a bf16 one keeps
under ``recompute`` (whatever ``recompute`` says); the backward is (:data:`FP16_NATIVE_BACKWARD`, the default) the
fp16 forward's own on the inputs as given, the gradients stored in fp16 by the kernels, or with that switch off the
bf16 call's on bf16 copies made in the backward, K1 and K2 again included, its gradients converted to fp16 after it
or (:data:`FP16_GRAD_STORES`) stored in fp16 by the kernels (:func:`backward`; docs/numerics.md, "fp16 training").

The stages sit behind a :class:`~cute_kda.executors.stages.Backend`: :data:`~cute_kda.executors.stages.KERNELS` for
every public call and op; :data:`cute_kda.reference.backend.REFERENCE` only for a caller that names it
(:func:`kda_forward` here with ``backend=``; the tests). Not supported, with an error naming it: double backward
(``create_graph=True``), caller buffers ``out=`` / ``final_state=``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import validation
from ..call import Call, Inputs, Options, final_state_dtype_of, finish, options_of, resolve
from ..ops import round_bf16
from ..validation import problem_of, staged_cu_seqlens
from .stages import (
    KERNEL_B_INPUTS, KERNELS, Backend, Saved, checkpoints_shape, packed, recompute_split, trains_pairs,
    workspace_spec,
)

TRAIN_OP_NAME = "cute_kda::forward_train"
# fp16 training: Kernel A stores dv, Kernel B dq, dk and a per-channel gate's dg in fp16 themselves (f16 of the bf16
# value each stores for bf16: the bits the copy route's conversions give) instead of bf16 tensors converted after them,
# 1.61 GB of traffic less at B1 T8192 H96; off until the H200 has measured it (docs/perf-log.md, F2;
# bench_train.py --fp16-grad-stores)
FP16_GRAD_STORES = False
# fp16 training's own backward: no bf16 copies of q, k, v, g; the backward's K1 + K2 recompute runs the fp16 variants
# on the inputs as given and Kernel B reads them in fp16 (dO still rounded to bf16 once), the gradients stored in fp16
# by the kernels as under FP16_GRAD_STORES: the gradient of the fp16 forward, not of the bf16 call on rounded inputs
# (docs/numerics.md, "fp16 training", stage 4); 1.61 GB less traffic than FP16_GRAD_STORES at B1 T8192 H96, the
# step 6.80 → 5.81 ms on the H200 (7.82 with neither; docs/perf-log.md, F3); bench_train.py --fp16-copy-backward
# turns it off for the A/B
FP16_NATIVE_BACKWARD = True
# fp16 training's dO rounded to bf16 by cute_kda's own streaming kernel (cute_kda.ops.round_bf16; the same bits)
# instead of torch's cast, which moves its 403 MB at B1 T8192 H96 at 1.46 TB/s (0.275 ms of the step's 0.33 ms over
# bf16): the fp16 step 1.063 → 1.021× bf16's on the H200 (docs/perf-log.md, F4); bench_train.py --no-fp16-do-kernel
# turns it off for the A/B
FP16_DO_KERNEL = True
BACKWARD_OP_NAME = "cute_kda::backward"


def stores_fp16_grads(grouped: bool, *dtypes: torch.dtype) -> bool:
    """Whether the backward kernels store gradients in fp16 themselves (:data:`FP16_GRAD_STORES`, or implied by
    :data:`FP16_NATIVE_BACKWARD`): Kernel B's dq, dk and dg where the caller's q, k and g (``dtypes``) are all fp16
    (an fp32 log decay keeps the bf16 stores) and no value heads are ``grouped`` (their group sums add bf16 values);
    Kernel A's dv where v (``dtypes``, ``grouped`` False: one value head a CTA) is fp16."""
    return ((FP16_GRAD_STORES or FP16_NATIVE_BACKWARD) and not grouped
            and all(dtype == torch.float16 for dtype in dtypes))


def check_first_order() -> None:
    """Refuse a backward that autograd would record (``create_graph=True``): the kernels' gradients are
    not differentiable."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "cute_kda's backward is not differentiable: double backward (create_graph=True, or a backward "
            "of the backward) is not supported"
        )


def kernel_operand(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous, 16-byte aligned ``dtype`` tensor (copied only when it is not one)."""
    t = t.to(dtype).contiguous()
    if t.data_ptr() % validation.ALIGNMENT_BYTES:
        t = t.clone()
    return t


def rounded_do(d_out: torch.Tensor) -> torch.Tensor:
    """dO as the backward kernels take it: bf16, contiguous, 16-byte aligned; an fp16 one rounded by
    :func:`cute_kda.ops.round_bf16.round_to_bf16` under :data:`FP16_DO_KERNEL` (a fresh contiguous tensor; torch's
    cast where the kernel does not take it, a CPU tensor included), else by :func:`kernel_operand`."""
    if FP16_DO_KERNEL and d_out.dtype == torch.float16:
        return round_bf16.round_to_bf16(d_out)
    return kernel_operand(d_out, torch.bfloat16)


def recomputed(backend: Backend, x: Inputs, options: Options, saved: Saved, pairs: bool = False) -> Saved:
    """The workspace and checkpoints a ``recompute`` forward did not keep: ``backend``'s forward again on
    the same inputs (``x.initial_state`` included), keeping them this time and skipping o and the final state; a
    segmented call's kept segment states spare it the two extra passes, an unsplit call's (``stages.SPLIT_RECOMPUTE``)
    let it run its segments side by side. ``pairs`` (the two-tile form,
    :func:`~cute_kda.executors.stages.trains_pairs`): ``backend.pair_states`` instead, a state a pair of tiles."""
    x = x._replace(tile_base=saved.tile_base)
    if pairs:
        return backend.pair_states(x, options, saved.segment_states)
    return backend.forward(x, options._replace(recompute=False, final_state_dtype=None), saved.segment_states,
                           token_outputs=False).saved


def recomputes(recompute: bool, q: torch.Tensor) -> bool:
    """Whether the training forward leaves the workspace and checkpoints to the backward's recomputation: under
    ``recompute``, and always with fp16 inputs (with :data:`FP16_NATIVE_BACKWARD` off their backward recomputes the
    forward on bf16 copies, :func:`backward`, which the fp16 forward's would not match; the switch is read when the
    backward runs, so the forward keeps what either route needs)."""
    return recompute or q.dtype == torch.float16


def bf16_operands(x: Inputs) -> Inputs:
    """fp16 ``x`` as the bf16 call the backward kernels run: q, k, v and g as bf16 copies, an fp16 initial state as
    an fp32 one (exact); bf16 and fp32 tensors as they are."""
    def bf16(t: torch.Tensor) -> torch.Tensor:
        return kernel_operand(t, torch.bfloat16) if t.dtype == torch.float16 else t

    state = x.initial_state
    if state is not None and state.dtype == torch.float16:
        state = kernel_operand(state, torch.float32)
    return x._replace(q=bf16(x.q), k=bf16(x.k), v=bf16(x.v), g=bf16(x.g), initial_state=state)


def backward(backend: Backend, x: Inputs, options: Options, saved: Saved, d_out: torch.Tensor | None,
             d_final: torch.Tensor | None, needs: tuple[bool, ...],
             initial_state_dtype: torch.dtype | None) -> tuple[torch.Tensor | None, ...]:
    """Gradients of q, k, v, g, beta, A_log, dt_bias, initial_state (None where ``needs`` is False).

    ``x``, ``options``: the forward's, packed (:func:`packed`; ``x.initial_state`` is read only under
    ``options.recompute``, where ``saved`` lacks the workspace and checkpoints and :func:`recomputed` rebuilds them);
    d_out: None or the gradient w.r.t. out (``[B, T, H, V]``, or its packed ``[1, B · T, H, V]``); d_final: None or
    the gradient w.r.t. the final state ``[N, H, V, K]`` (its dtype); ``needs``: one flag per input, in
    :data:`INPUT_NAMES` order; ``initial_state_dtype``: the forward's initial state dtype, None without one (then no
    dh0). The token gradients come back in the packed shapes (:func:`unpacked` takes them to the caller's), each in
    its input's dtype.

    fp16 inputs (docs/numerics.md, "fp16 training"): unless :data:`FP16_NATIVE_BACKWARD` (below), the backward of the
    bf16 call on the inputs rounded to bf16
    (:func:`bf16_operands`, copies made here and freed when it returns), the forward's kernels included: its forward
    kept no workspace (:func:`recomputes`), K1 and K2 run again on the copies (a segmented call's segment states
    too), then Kernel A and Kernel B; dO enters rounded to bf16 (as any dO does), an fp16 dht widened to fp32; dq, dk,
    dv, dg and dh0 come back as the kernels' values converted to fp16 (exact within fp16's range); under
    :data:`FP16_GRAD_STORES` Kernel A stores an fp16 v's dv so converted itself, and Kernel B dq, dk and dg (q, k and g
    fp16, no grouped value heads: their group sums add bf16 values; a per-head gate's dg as before). Under
    :data:`FP16_NATIVE_BACKWARD` the backward of the fp16 forward itself: K1 and K2 again on the inputs as given (their
    fp16 variants, an fp16 initial state and a segmented call's kept segment states included), Kernel B reading fp16
    q, k, v, g, the gradients stored in fp16 by the kernels as under :data:`FP16_GRAD_STORES`; dO rounded to bf16 as
    above (stage 4). An fp16 dO is rounded by :func:`rounded_do` (by cute_kda's kernel under :data:`FP16_DO_KERNEL`).
    """
    fp16 = torch.float16
    dtypes = (x.q.dtype, x.k.dtype, x.v.dtype, x.g.dtype, None, None, None, initial_state_dtype if needs[7] else None)
    pairs = trains_pairs(backend, x, options)  # bf16 calls only (not fp16 ones on bf16 copies)
    stores_fp16 = stores_fp16_grads(x.q.shape[2] != x.v.shape[2], x.q.dtype, x.k.dtype, x.g.dtype)
    if x.q.dtype == fp16 and not FP16_NATIVE_BACKWARD:
        x, saved = bf16_operands(x), saved._replace(segment_states=None)
    do = torch.zeros_like(x.v, dtype=torch.bfloat16) if d_out is None else rounded_do(d_out).view(x.v.shape)
    dht = None
    if d_final is not None:
        dht = kernel_operand(d_final, torch.float32 if d_final.dtype == fp16 else d_final.dtype)
    dh0_dtype = initial_state_dtype if needs[7] else None
    if options.recompute:
        saved = recomputed(backend, x, options, saved, pairs)
    scan = backend.scan(x, options, saved, do, dht, torch.float32 if dh0_dtype == fp16 else dh0_dtype,
                        fp16 if stores_fp16_grads(False, dtypes[2]) else torch.bfloat16)
    dq = dk = dg = dbeta = dA_log = ddt_bias = None
    if any(needs[i] for i in KERNEL_B_INPUTS):
        dq, dk, dg, dbeta, dA_log, ddt_bias = backend.grads(x, options, saved, do, scan,
                                                            fp16 if stores_fp16 else torch.bfloat16)
    grads = (dq, dk, scan.dv, dg, dbeta, dA_log, ddt_bias, scan.dh0)
    return tuple(None if not need or grad is None else grad if dtype is None else grad.to(dtype)
                 for grad, need, dtype in zip(grads, needs, dtypes))


def unpacked(grads: tuple, shapes: tuple) -> tuple:
    """The gradients of :func:`backward` in the caller's shapes: the token gradients (dq, dk, dv, dg, dβ) viewed as
    ``shapes`` (:func:`shapes_of`), the others as they are."""
    tokens = tuple(None if grad is None else grad.view(shape) for grad, shape in zip(grads, shapes))
    return (*tokens, *grads[len(shapes):])


def shapes_of(x: Inputs) -> tuple:
    """The shapes of the per-token inputs q, k, v, g, beta."""
    return tuple(t.shape for t in x[:5])


class TrainingForward(torch.autograd.Function):
    """``(backend, options, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens) → (out, final_state)``
    (tensors as :class:`Inputs`; final_state None without one)."""

    @staticmethod
    def forward(ctx: Any, backend: Backend, options: Options, *tensors: torch.Tensor | None) -> tuple:
        user = Inputs(*tensors)
        x, options = packed(user, options)
        options = options._replace(recompute=recomputes(options.recompute, x.q))
        result = backend.forward(x, options)
        ctx.set_materialize_grads(False)
        ctx.backend, ctx.options, ctx.shapes = backend, options, shapes_of(user)
        ctx.initial_state_dtype = None if x.initial_state is None else x.initial_state.dtype
        initial_state = x.initial_state if options.recompute else None  # only the recomputation reads it
        ctx.save_for_backward(x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, initial_state, x.cu_seqlens,
                              *result.saved)
        return result.out.view(user.v.shape), result.final_state

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor | None, d_final: torch.Tensor | None) -> tuple:
        check_first_order()
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *saved = ctx.saved_tensors
        x = Inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        grads = backward(ctx.backend, x, ctx.options, Saved(*saved), d_out, d_final, ctx.needs_input_grad[2:10],
                         ctx.initial_state_dtype)
        return (None, None, *unpacked(grads, ctx.shapes), None)


def train(backend: Backend, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recorded training forward of a resolved ``call`` (:func:`cute_kda.call.resolve` admitted it) on
    ``backend``'s stages: (out, final state or None), with their backward recorded."""
    x, options = call.inputs, call.options
    return TrainingForward.apply(backend, options, *x[:9])


def kda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                backend: Backend, **arguments: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`cute_kda.kda_forward`'s training path on torch tensors, with the stages of ``backend``: the same
    arguments, checks and results, always recorded by autograd, whatever requires grad. For the references:
    ``backend=REFERENCE`` runs on any device."""
    call = resolve(q, k, v, g, beta, training=True, **arguments)
    return finish(call, train(backend, call))


# ---------------------------------------------------------------------------------------------
# the training ops (torch.compile)


def _stages() -> Backend:
    """The stages the training ops run: always the kernels (a test replaces this function to run the
    ops on the references)."""
    return KERNELS


@torch.library.custom_op(TRAIN_OP_NAME, mutates_args=())
def forward_train_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], scale: Optional[float], lower_bound: float, output_final_state: bool,
    vsplit: Optional[int], qk_l2norm: bool, beta_logits: bool, recompute: bool, gate: str, segments: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training forward of :func:`cute_kda.kda_forward`'s arguments (caller buffers excepted). Returns out in v's
    dtype ``[B, T, HV, V]``, the final state ``[N, HV, V, K]`` (empty without ``output_final_state``), the flat uint8
    workspace ``[WorkspaceSpec.nbytes]``, the checkpoints bf16 ``[HV · slots, D, D]`` (state images; both empty under
    ``recompute`` and for fp16 inputs, :func:`recomputes`), ``tile_base`` int32 ``[N+1]`` (empty for fixed length)
    and the segment states fp32 ``[2, segments, HV, V, K]`` (empty unsplit; ``[1, C − 1, HV, V, K]`` for an unsplit
    call whose backward recomputes side by side, ``stages.recompute_split``). A segmented call's workspace,
    checkpoints and ``tile_base`` are those of its packed problem (:func:`cute_kda.executors.stages.packed`)."""
    call = resolve(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                   initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                   vsplit=vsplit, qk_l2norm=qk_l2norm, beta_logits=beta_logits, recompute=recompute, gate=gate,
                   segments=segments, training=True)
    x, options = packed(call.inputs, call.options)
    result = _stages().forward(x, options._replace(recompute=recomputes(recompute, q)))
    saved, device = result.saved, v.device

    def present(t: torch.Tensor | None, dtype: torch.dtype, rank: int = 1) -> torch.Tensor:
        """``t``, or an empty tensor standing for None (a custom op returns tensors only)."""
        return torch.empty((0,) * rank, dtype=dtype, device=device) if t is None else t

    return (result.out.view(v.shape), present(result.final_state, v.dtype), present(saved.workspace, torch.uint8),
            present(saved.checkpoints, torch.bfloat16, 3), present(saved.tile_base, torch.int32),
            present(saved.segment_states, torch.float32))


def _op_options(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float | None,
                lower_bound: float, final_state_dtype: torch.dtype | None, vsplit: int | None, qk_l2norm: bool,
                beta_logits: bool, recompute: bool, gate: str, segments: int | None) -> Options:
    """The :class:`~cute_kda.call.Options` the training ops' fakes and backward derive from the op's arguments
    (:func:`~cute_kda.call.options_of`, as the forward's :func:`~cute_kda.call.resolve` did)."""
    return options_of(problem_of(q, v, cu_seqlens), q.device, scale=scale, lower_bound=lower_bound,
                      qk_l2norm=qk_l2norm, beta_logits=beta_logits, final_state_dtype=final_state_dtype, vsplit=vsplit,
                      recompute=recompute, gate=gate, segments=segments)


@forward_train_op.register_fake
def _forward_train_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                        output_final_state, vsplit, qk_l2norm, beta_logits, recompute, gate, segments):
    state_dtype = final_state_dtype_of(initial_state, None, output_final_state)
    recompute = recomputes(recompute, q)
    options = _op_options(q, v, cu_seqlens, scale, lower_bound, state_dtype, vsplit, qk_l2norm, beta_logits,
                          recompute, gate, segments)
    problem, seg = options.problem, options.segmentation
    segment_states = q.new_empty((0,), dtype=torch.float32)
    split = recompute_split(options, q.device)
    if seg is not None:
        segment_states = q.new_empty((2, seg.count, *problem.state_shape[1:]), dtype=torch.float32)
        problem = seg.problem(problem.heads, problem.head_dim)
    elif split is not None:
        segment_states = q.new_empty((1, split.count - 1, *problem.state_shape[1:]), dtype=torch.float32)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    state = q.new_empty((0,)) if state_dtype is None else q.new_empty(options.problem.state_shape, dtype=state_dtype)
    workspace = q.new_empty((0 if recompute else workspace_spec(problem).nbytes,), dtype=torch.uint8)
    checkpoints = q.new_empty((0, 0, 0) if recompute else checkpoints_shape(problem), dtype=torch.bfloat16)
    tile_base = q.new_empty((problem.num_seqs + 1 if problem.varlen else 0,), dtype=torch.int32)
    return o, state, workspace, checkpoints, tile_base, segment_states


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())
def backward_op(
    do: torch.Tensor, dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], workspace: torch.Tensor,
    checkpoints: torch.Tensor, tile_base: Optional[torch.Tensor], segment_states: Optional[torch.Tensor],
    scale: Optional[float], lower_bound: float, qk_l2norm: bool, beta_logits: bool, dh0_dtype: Optional[torch.dtype],
    token_grads: bool, recompute: bool, gate: str, vsplit: Optional[int], segments: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """The backward of :func:`forward_train_op`: do bf16 or fp16 ``[B, T, HV, V]``; dht None or ``[N, HV, V, K]``;
    the forward's inputs (``initial_state`` read only under ``recompute``) and saved outputs (``tile_base``
    None for fixed length, ``segment_states`` None unsplit; workspace and checkpoints empty under ``recompute``);
    ``vsplit`` and ``segments`` as the forward had them. Returns dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 in
    their inputs' shapes and dtypes; dq, dk, dg, dbeta, dA_log, ddt_bias are empty unless ``token_grads``, dh0
    unless ``dh0_dtype`` (then ``[N, HV, V, K]`` in it); dA_log, ddt_bias empty for the log decay (gate "none")."""
    recompute = recomputes(recompute, q)  # as the forward op had it
    options = _op_options(q, v, cu_seqlens, scale, lower_bound, None, vsplit, qk_l2norm, beta_logits, recompute,
                          gate, segments)
    user = Inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, staged_cu_seqlens(cu_seqlens, q))
    x, options = packed(user, options)
    constants = token_grads and A_log is not None
    needs = (token_grads, token_grads, True, token_grads, token_grads, constants, constants, dh0_dtype is not None)
    kept = (None, None) if recompute else (workspace, checkpoints)
    saved = Saved(*kept, tile_base, segment_states)
    grads = backward(_stages(), x, options, saved, do, dht, needs, dh0_dtype)
    grads = unpacked(grads, shapes_of(user))
    return tuple(q.new_empty((0,)) if grad is None else grad for grad in grads)


@backward_op.register_fake
def _backward_fake(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, workspace, checkpoints,
                   tile_base, segment_states, scale, lower_bound, qk_l2norm, beta_logits, dh0_dtype, token_grads,
                   recompute, gate, vsplit, segments):
    def like(t: torch.Tensor | None, wanted: bool) -> torch.Tensor:
        if t is None or not wanted:
            return q.new_empty((0,))
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    dh0 = q.new_empty((0,))
    if dh0_dtype is not None:
        dh0 = q.new_empty(problem_of(q, v, cu_seqlens).state_shape, dtype=dh0_dtype)
    return (like(q, token_grads), like(k, token_grads), like(v, True), like(g, token_grads), like(beta, token_grads),
            like(A_log, token_grads), like(dt_bias, token_grads), dh0)


_TRAIN_INPUTS = 18  # arguments of forward_train_op


def _setup_train_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound = inputs[:11]
    vsplit, qk_l2norm, beta_logits, recompute, gate, segments = inputs[12:]
    recompute = recomputes(recompute, q)
    _, _, workspace, checkpoints, tile_base, segment_states = output
    ctx.mark_non_differentiable(workspace, checkpoints, tile_base, segment_states)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state if recompute else None, cu_seqlens,
                          workspace, checkpoints, tile_base, segment_states)
    ctx.options = (scale, lower_bound, qk_l2norm, beta_logits, recompute, gate, vsplit, segments)
    ctx.initial_state_dtype = None if initial_state is None else initial_state.dtype


def _train_backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor, *_: Any) -> tuple:
    check_first_order()
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, workspace, checkpoints, tile_base,
     segment_states) = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dh0_dtype = ctx.initial_state_dtype if needs[7] else None
    scale, lower_bound, qk_l2norm, beta_logits, recompute, gate, vsplit, segments = ctx.options
    grads = backward_op(
        d_out, d_final if d_final.numel() else None, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
        workspace, checkpoints, tile_base if tile_base.numel() else None,
        segment_states if segment_states.numel() else None, scale, lower_bound, qk_l2norm, beta_logits,
        dh0_dtype, any(needs[i] for i in KERNEL_B_INPUTS), recompute, gate, vsplit, segments,
    )
    return (*(grad if need else None for grad, need in zip(grads, needs[:8])), *(None,) * (_TRAIN_INPUTS - 8))


forward_train_op.register_autograd(_train_backward, setup_context=_setup_train_context)
