"""Autograd for :func:`cute_kda.kda_forward` and :func:`cute_kda.chunk_kda`: the training forward and
the backward behind one ``torch.autograd.Function``.

A call under grad mode with an input that requires grad (q, k, v, g, beta, A_log, dt_bias,
initial_state) takes this path instead of the inference one; ``chunk_kda``'s translation (state
transposes, ``A_log``/``dt_bias`` reshapes and casts) stays ordinary torch ops in front of it, so
autograd carries FLA's layouts and dtypes back to the caller's tensors.

Forward (training): a fresh K1 workspace per call (never :data:`cute_kda.api.WORKSPACES`' shared
buffer, which the next call reuses), K1, then K2 writing also the bf16 state entering every tile
(``checkpoints``, :func:`cute_kda.workspace.block_states_shape`). Saved for the backward: the raw
inputs, the workspace, the checkpoints, ``cu_seqlens`` on the device and ``tile_base``.

With ``recompute`` the forward keeps neither: K2 runs without checkpoints and the workspace is freed
when the forward returns; the backward runs K1 and K2 (with checkpoints) again from the saved inputs,
``initial_state`` included, before Kernel A. The recomputation is the same kernels on the same inputs,
so the gradients are bit-identical to the default path's; it costs one K1 and one K2 per backward and
saves the workspace and checkpoints (about 2.8× the bf16 q, k, v, g of the call) for as long as the
graph holds the call.

Backward: dO (zeros when only the final state is used) and dht (None when the final state is unused
or absent) → Kernel A (dv, du, the per-tile state gradients, dh0) → Kernel B (dq, dk, dg, dβ and
per-tile partial sums of ddt_bias / dA_log, reduced by ``.sum(1)``: deterministic). Kernel B runs
only when one of q, k, g, beta, A_log, dt_bias needs a gradient. Everything is queued on the current
stream; nothing synchronises the host. Gradients come back only for the inputs that need them, each in
its input's dtype and shape (dh0 in ``initial_state``'s ``[N, H, V, K]`` layout and dtype).

The launch sequence sits behind a :class:`Backend`, three stage functions. :data:`KERNELS` (the CUDA
kernels) is what the public API and ``torch.ops.cute_kda.forward_train`` / ``backward`` use, always.
:data:`REFERENCE` runs the same stages with the mirror references (:mod:`cute_kda.reference`, on any
device: bit-faithful intrinsics on a GPU, close on a CPU); only a caller that names it gets it, by
calling :func:`kda_forward` here with ``backend=REFERENCE`` (the tests do).

Not supported, with an error naming it: double backward (``create_graph=True``, backward of the
backward), caller buffers ``out=`` / ``final_state=`` when autograd records the call.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from . import context_parallel, validation
from .config import select_forward_config, sm_count
from .context_parallel import Segmentation
from .validation import ProblemShape
from .workspace import Workspace, WorkspaceSpec, snapshot_slots, tiles_per_head, workspace_views

INPUT_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
KERNEL_B_INPUTS = (0, 1, 3, 4, 5, 6)  # q, k, g, beta, A_log, dt_bias: the inputs whose gradients Kernel B gives


class Inputs(NamedTuple):
    """The validated tensors of one training call.

    q, k, g bf16 ``[B, T, H, K]``; v bf16 ``[B, T, H, V]``; beta bf16 ``[B, T, H]``; A_log fp32 ``[H]``;
    dt_bias fp32 ``[H, K]``; initial_state None or bf16 / fp32 ``[N, H, V, K]``; cu_seqlens None or
    int64 ``[N+1]`` (on q's device for the kernels; :func:`staged_cu_seqlens` widens an int32 one). A per-head gate (GatedDeltaNet): v, beta, the states with
    HV value heads (a multiple of q's H), g ``[B, T, HV]`` (bf16, or an fp32 log decay), A_log, dt_bias
    ``[HV]`` (None for the log decay).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    tile_base: torch.Tensor | None = None  # int32 [N+1] when known (a segmented call's, or the forward's saved one)


class Options(NamedTuple):
    """The non-tensor arguments of one training call (``scale`` resolved; ``vsplit`` None: K2's heuristic;
    ``final_state_dtype`` None: no final state)."""

    problem: ProblemShape
    scale: float
    lower_bound: float
    qk_l2norm: bool
    beta_logits: bool
    final_state_dtype: torch.dtype | None
    vsplit: int | None
    recompute: bool = False
    gate: str = "safe"  # or, with a per-head g [B, T, HV], "softplus" / "none" (GatedDeltaNet)
    segmentation: Segmentation | None = None  # context parallelism (cute_kda.context_parallel); None: unsplit


class Saved(NamedTuple):
    """What the training forward leaves for the backward besides the inputs.

    workspace: flat uint8 ``[WorkspaceSpec.nbytes]`` (:func:`workspace_of` carves the K1 fields);
    checkpoints: bf16 ``[H · slots, D, D]``, the state entering every tile (state images from the kernels,
    :func:`cute_kda.workspace.states_to_images`; ``[K, V]`` matrices from the reference backend); tile_base: None (fixed
    length) or int32 ``[N+1]``. Under ``Options.recompute`` workspace and checkpoints are None
    (:func:`recomputed` makes them in the backward). segment_states: None unsplit, else fp32 ``[2, segments, H, V, K]``,
    the state entering every segment and every segment's transition
    (:func:`cute_kda.context_parallel.segment_states`), kept under ``recompute`` too (two states a segment).
    """

    workspace: torch.Tensor | None
    checkpoints: torch.Tensor | None
    tile_base: torch.Tensor | None
    segment_states: torch.Tensor | None = None


class ForwardResult(NamedTuple):
    """out bf16 ``[B, T, H, V]``; final_state None or ``[N, H, V, K]`` in ``Options.final_state_dtype``."""

    out: torch.Tensor
    final_state: torch.Tensor | None
    saved: Saved


class ScanResult(NamedTuple):
    """Kernel A: dv, du bf16 ``[B, T, H, V]``; state_grads bf16 like the checkpoints (the gradient w.r.t.
    the state after each tile); dh0 None or ``[N, H, V, K]`` in the requested dtype."""

    dv: torch.Tensor
    du: torch.Tensor
    state_grads: torch.Tensor
    dh0: torch.Tensor | None


class GradsResult(NamedTuple):
    """Kernel B: dq, dk, dg bf16 ``[B, T, H, K]``; dbeta bf16 ``[B, T, H]``; dA_log fp32 ``[H]``;
    ddt_bias fp32 ``[H, K]``. A per-head gate: dq, dk summed over each group of value heads; dg ``[B, T, HV]`` in
    g's dtype; dbeta ``[B, T, HV]``; dA_log, ddt_bias ``[HV]`` (None for the log decay)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor
    ddt_bias: torch.Tensor


class Backend(NamedTuple):
    """The three stages of a training step.

    forward(inputs, options, segment_states=None) → :class:`ForwardResult` (without workspace and checkpoints under
    ``options.recompute``; ``segment_states``: a segmented call's, when an earlier forward made them);
    scan(inputs, options, saved, do, dht, dh0_dtype) → :class:`ScanResult` (do bf16 ``[B, T, H, V]``
    contiguous; dht None or bf16 / fp32 ``[N, H, V, K]`` contiguous; dh0_dtype None: no dh0);
    grads(inputs, options, saved, do, scan) → :class:`GradsResult`.
    """

    name: str
    forward: Callable[..., ForwardResult]
    scan: Callable[..., ScanResult]
    grads: Callable[..., GradsResult]


def problem_of(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> ProblemShape:
    """The :class:`~cute_kda.validation.ProblemShape` of validated ``q`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``
    (its heads are the problem's: the states and the workspace are per value head) and ``cu_seqlens``."""
    batch, seq_len, _, dim = q.shape
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return ProblemShape(batch, seq_len, v.shape[2], dim, num_seqs, cu_seqlens is not None)


def workspace_spec(problem: ProblemShape) -> WorkspaceSpec:
    """The K1 workspace of ``problem``: ``tiles_per_head`` slots per head."""
    return WorkspaceSpec(
        heads=problem.heads, tiles=tiles_per_head(problem.total_tokens, problem.num_seqs, problem.varlen),
        dim=problem.head_dim,
    )


def workspace_of(options: Options, saved: Saved) -> Workspace:
    """The K1 field views of ``saved.workspace``."""
    return workspace_views(workspace_spec(options.problem), saved.workspace)


def state_shape(problem: ProblemShape) -> tuple[int, int, int, int]:
    """``[N, H, V, K]``."""
    return (problem.num_seqs, problem.heads, problem.head_dim, problem.head_dim)


def checkpoints_shape(problem: ProblemShape) -> tuple[int, int, int]:
    """``[H · slots, D, D]`` of the checkpoints and of the state gradients, one slot per tile
    (:func:`cute_kda.workspace.block_states_shape` of the problem's workspace)."""
    slots = snapshot_slots(workspace_spec(problem).tiles, problem.num_seqs)
    return (problem.heads * slots, problem.head_dim, problem.head_dim)


def staged_cu_seqlens(cu_seqlens: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``cu_seqlens`` as the stages read it, int64: on q's device when that is a GPU
    (:func:`~cute_kda.validation.device_cu_seqlens`: an asynchronous copy of a CPU tensor), else on the CPU."""
    if cu_seqlens is None or not q.is_cuda:
        return None if cu_seqlens is None else cu_seqlens.to(torch.int64)
    return validation.device_cu_seqlens(cu_seqlens, q.device, q.shape[1])


def segmentation_of(problem: ProblemShape, device: torch.device, segments: int | None,
                    vsplit: int | None) -> Segmentation | None:
    """The context-parallel split of ``problem`` (:func:`cute_kda.context_parallel.plan`) for the SMs of ``device``;
    on a CPU (the reference backend) only an explicit ``segments`` splits."""
    if device.type != "cuda":
        return None if segments is None else context_parallel.plan(problem, 0, segments, vsplit)
    return context_parallel.plan(problem, sm_count(device.index), segments, vsplit)


def packed(x: Inputs, options: Options) -> tuple[Inputs, Options]:
    """What the stages run: a segmented call's inputs as one packed row of segments (``[1, N · T, ...]`` views,
    ``cu_seqlens`` the segment bounds on q's device) and the packed problem; an unsplit call as it is."""
    seg = options.segmentation
    if seg is None:
        return x, options
    flat = [t.reshape(1, -1, *t.shape[2:]) for t in (x.q, x.k, x.v, x.g, x.beta)]
    cu_seqlens, tile_base = seg.on_device(x.q.device) if x.q.is_cuda else (seg.cu_seqlens(), seg.tile_bases())
    return (Inputs(*flat, x.A_log, x.dt_bias, x.initial_state, cu_seqlens, tile_base),
            options._replace(problem=seg.problem(options.problem.heads, options.problem.head_dim)))


def _entering(options: Options, x: Inputs, segment_states: torch.Tensor | None,
              final_states: context_parallel.FinalStates) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the initial states of the packed run, the segment states): ``x.initial_state`` and None unsplit; else the
    entering states ``[segments, H, V, K]`` fp32 of ``segment_states``, made first when not given."""
    seg = options.segmentation
    if seg is None:
        return x.initial_state, None
    if segment_states is None:
        segment_states = context_parallel.segment_states(seg, final_states, x.v, x.initial_state)
    return segment_states[0], segment_states


def _final_state_buffer(options: Options, device: torch.device) -> torch.Tensor | None:
    """The final-state buffer of the packed run: ``[N, H, V, K]`` in the requested dtype; fp32 for every segment
    of a segmented call (:func:`_final_state_of` takes the last ones)."""
    if options.final_state_dtype is None:
        return None
    dtype = torch.float32 if options.segmentation is not None else options.final_state_dtype
    return torch.empty(state_shape(options.problem), dtype=dtype, device=device)


def _final_state_of(options: Options, final_state: torch.Tensor | None) -> torch.Tensor | None:
    """Each sequence's final state, contiguous, in the requested dtype."""
    if options.segmentation is None or final_state is None:
        return final_state
    # a copy of its own: a view would keep every segment's final state alive
    return options.segmentation.last(final_state).to(options.final_state_dtype, copy=True).contiguous()


def _segment_scan(options: Options, saved: Saved, dht: torch.Tensor | None, dh0_dtype: torch.dtype | None,
                  scan: Callable[..., ScanResult]) -> ScanResult:
    """The backward scan of a segmented call: ``scan(dht, dh0_dtype, token_outputs)`` runs the packed scan
    (``[segments, H, V, K]`` states); once with zero gradients leaving the segments for their own gradients (dh0
    only: ``token_outputs`` False), the reverse combine, then the real scan. Unsplit: ``scan(dht, dh0_dtype)``."""
    seg = options.segmentation
    if seg is None:
        return scan(dht, dh0_dtype)
    local = scan(None, torch.float32, token_outputs=False).dh0
    leaving = context_parallel.exiting_gradients(seg, local, saved.segment_states[1], dht)
    result = scan(leaving, None if dh0_dtype is None else torch.float32)
    dh0 = None if dh0_dtype is None else seg.first(result.dh0).to(dh0_dtype, copy=True).contiguous()
    return result._replace(dh0=dh0)


# ---------------------------------------------------------------------------------------------
# the kernel backend


def _kernel_forward(x: Inputs, options: Options, segment_states: torch.Tensor | None = None) -> ForwardResult:
    """K1 into a fresh workspace, K2 with checkpoints (without them under ``options.recompute``, the
    workspace then dropped), on the current stream of q's device. A segmented call (packed, :func:`packed`) runs K2
    twice more first, for the segment states (:func:`cute_kda.context_parallel.segment_states`), unless given."""
    validation.check_on_cuda("q", x.q)
    from .ops import prepare as k1
    from .ops import recurrence as k2

    problem, device = options.problem, x.q.device
    buffer = torch.empty(workspace_spec(problem).nbytes, dtype=torch.uint8, device=device)
    saved_ws = workspace_views(workspace_spec(problem), buffer)
    checkpoints = None
    if not options.recompute:
        checkpoints = torch.empty(checkpoints_shape(problem), dtype=torch.bfloat16, device=device)
    out = torch.empty_like(x.v)
    final_state = _final_state_buffer(options, device)
    config = select_forward_config(
        problem, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
        initial_state=None, final_state=None, vsplit=options.vsplit, sms=sm_count(device.index),
    )
    tile_base = x.tile_base
    if tile_base is None and problem.varlen:
        tile_base = k1.tile_bases(x.cu_seqlens)
    k1.prepare(
        x.q, x.k, x.g, x.beta, x.A_log, x.dt_bias, saved_ws, scale=options.scale, lower_bound=options.lower_bound,
        cu_seqlens=x.cu_seqlens, tile_base=tile_base, qk_l2norm=config.qk_l2norm, beta_logits=config.beta_logits,
        gate=options.gate,
    )
    k1.forget_launch_tiles()  # K1 keeps the arguments of the last workspace it saw: not this one's memory

    def final_states(v: torch.Tensor, initial: torch.Tensor | None, into: torch.Tensor) -> None:
        k2.recurrence(v, saved_ws, out, cu_seqlens=x.cu_seqlens, tile_base=tile_base, initial_state=initial,
                      final_state=into, vsplit=config.vsplit)

    initial_state, segment_states = _entering(options, x, segment_states, final_states)
    k2.recurrence(
        x.v, saved_ws, out, cu_seqlens=x.cu_seqlens, tile_base=tile_base, initial_state=initial_state,
        final_state=final_state, vsplit=config.vsplit, checkpoints=checkpoints,
    )
    return ForwardResult(out, _final_state_of(options, final_state),
                         Saved(None if options.recompute else buffer, checkpoints, tile_base, segment_states))


def _kernel_scan(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None,
                 dh0_dtype: torch.dtype | None) -> ScanResult:
    """Kernel A (:func:`cute_kda.ops.bwd_scan.bwd_scan`); twice for a segmented call (:func:`_segment_scan`)."""
    from .ops import bwd_scan as ka

    dv, du = torch.empty_like(x.v), torch.empty_like(x.v)
    state_grads = torch.empty_like(saved.checkpoints)
    ws = workspace_of(options, saved)

    def scan(leaving: torch.Tensor | None, dtype: torch.dtype | None, token_outputs: bool = True) -> ScanResult:
        dh0 = None if dtype is None else torch.empty(state_shape(options.problem), dtype=dtype, device=do.device)
        ka.bwd_scan(do, ws, dv, du, state_grads, cu_seqlens=x.cu_seqlens, tile_base=saved.tile_base, dht=leaving,
                    dh0=dh0, token_outputs=token_outputs)
        return ScanResult(dv, du, state_grads, dh0)

    return _segment_scan(options, saved, dht, dh0_dtype, scan)


def _kernel_grads(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, scan: ScanResult) -> GradsResult:
    """Kernel B (:func:`cute_kda.ops.bwd_grads.bwd_grads`), its gate partials summed over the tiles."""
    from .ops import bwd_grads as kb

    ws = workspace_of(options, saved)
    per_head = x.g.dim() == 3  # GatedDeltaNet's per-head gate
    ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, options.problem.heads, per_head)
    constants = options.gate != "none"  # a log decay has no A_log / dt_bias
    ddt_partial = torch.empty(ddt_shape, dtype=torch.float32, device=do.device) if constants else None
    dalog_partial = torch.empty(dalog_shape, dtype=torch.float32, device=do.device) if constants else None
    unbounded = options.gate != "safe"  # dq, dk per value head (summed over each group below), else like q, k
    dq, dk = (torch.empty_like(x.v if unbounded else t) for t in (x.q, x.k))
    # dg: fp32 per (token, head) for a per-head gate, else bf16 like g (a fp32 log decay's is widened below)
    dg = torch.empty(x.g.shape, dtype=torch.float32 if per_head else torch.bfloat16, device=do.device)
    dbeta = torch.empty_like(x.beta)
    kb.bwd_grads(  # β enters through the workspace's activated ws.beta
        q=x.q, k=x.k, g=x.g, v=x.v, do=do, du=scan.du, ws=ws, states=saved.checkpoints,
        state_grads=scan.state_grads, A_log=x.A_log, dt_bias=x.dt_bias, dq=dq, dk=dk, dg=dg, dbeta=dbeta,
        ddt_partial=ddt_partial, dalog_partial=dalog_partial, scale=options.scale, lower_bound=options.lower_bound,
        cu_seqlens=x.cu_seqlens, tile_base=saved.tile_base, qk_l2norm=options.qk_l2norm,
        beta_logits=options.beta_logits, gate=options.gate,
    )
    if unbounded:
        dq, dk = (group_sum(t, x.q.shape[2]) for t in (dq, dk))
    dg = dg.to(x.g.dtype)
    return GradsResult(dq, dk, dg, dbeta, None if dalog_partial is None else dalog_partial.sum(1),
                       None if ddt_partial is None else ddt_partial.sum(1))


def group_sum(t: torch.Tensor, heads: int) -> torch.Tensor:
    """bf16 ``[B, T, HV, D]`` summed over each group of ``HV / heads`` value heads in fp32: ``[B, T, heads, D]``
    bf16 (the per-value-head dq, dk of grouped value heads; deterministic, no atomics). One reduction that reads
    the bf16 values and accumulates in fp32 (torch's accumulator type for bf16), rounding once: no fp32 copy of
    ``t`` (that copy and a reduction over it took 0.67 ms for each of dq, dk at T32768 HV32)."""
    batch, steps, value_heads, dim = t.shape
    if value_heads == heads:
        return t
    return t.view(batch, steps, heads, value_heads // heads, dim).sum(3)


KERNELS = Backend("kernels", _kernel_forward, _kernel_scan, _kernel_grads)


# ---------------------------------------------------------------------------------------------
# the reference backend (the mirrors; selected only by callers that name it). Its results are made
# C-contiguous like the kernels' (the fake implementations of the ops promise that layout).


def _reference_forward(x: Inputs, options: Options, segment_states: torch.Tensor | None = None) -> ForwardResult:
    """:func:`~cute_kda.reference.mirror_prepare` and :func:`~cute_kda.reference.mirror_recurrence`
    with checkpoints (without them under ``options.recompute``); slots the kernels leave unwritten are NaN."""
    from .reference import mirror_prepare, mirror_prepare_gates, mirror_recurrence, tile_bases

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

    initial_state, segment_states = _entering(options, x, segment_states, final_states)
    wants_state = options.final_state_dtype is not None
    state_dtype = torch.float32 if options.segmentation is not None or not wants_state else options.final_state_dtype
    out, final_state = mirror_recurrence(
        ws, x.v, cu_seqlens=x.cu_seqlens, initial_state=initial_state, output_final_state=wants_state,
        state_dtype=state_dtype, state_layout="vk", checkpoints=checkpoints,
    )
    tile_base = tile_bases(x.cu_seqlens, problem.total_tokens, problem.batch) if problem.varlen else None
    final_state = None if final_state is None else _final_state_of(options, final_state.contiguous())
    return ForwardResult(out.contiguous(), final_state,
                         Saved(None if options.recompute else buffer, checkpoints, tile_base, segment_states))


def _reference_scan(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None,
                    dh0_dtype: torch.dtype | None) -> ScanResult:
    """:func:`~cute_kda.reference.mirror_bwd_scan` (twice for a segmented call, :func:`_segment_scan`; the mirror
    computes every output in either pass, so ``token_outputs`` changes nothing here)."""
    from .reference import mirror_bwd_scan

    def scan(leaving: torch.Tensor | None, dtype: torch.dtype | None, token_outputs: bool = True) -> ScanResult:
        result = mirror_bwd_scan(workspace_of(options, saved), do, cu_seqlens=x.cu_seqlens, dht=leaving,
                                 dh0_dtype=torch.float32 if dtype is None else dtype, state_layout="vk")
        return ScanResult(result.dv.contiguous(), result.du.contiguous(), result.snapshots.contiguous(),
                          None if dtype is None else result.dh0.contiguous())

    return _segment_scan(options, saved, dht, dh0_dtype, scan)


def _reference_grads(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, scan: ScanResult) -> GradsResult:
    """:func:`~cute_kda.reference.backward.mirror_bwd_grads` (:func:`~cute_kda.reference.mirror_bwd_grads_gates`
    for a per-head gate)."""
    from .reference import mirror_bwd_grads_gates
    from .reference.backward import mirror_bwd_grads

    if options.gate != "safe":
        grads = mirror_bwd_grads_gates(
            x.q, x.k, x.g, x.beta, x.v, do, scan.du, workspace_of(options, saved), saved.checkpoints,
            scan.state_grads, gate=options.gate, A_log=x.A_log, dt_bias=x.dt_bias, scale=options.scale,
            cu_seqlens=x.cu_seqlens, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
        )
        return GradsResult(*(None if grads[n] is None else grads[n].contiguous()
                             for n in ("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias")))
    result = mirror_bwd_grads(
        x.q, x.k, x.g, x.beta, x.v, do, scan.du, workspace_of(options, saved), saved.checkpoints, scan.state_grads,
        A_log=x.A_log, dt_bias=x.dt_bias, scale=options.scale, lower_bound=options.lower_bound,
        cu_seqlens=x.cu_seqlens, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
    )
    return GradsResult(*(t.contiguous() for t in result))


REFERENCE = Backend("reference", _reference_forward, _reference_scan, _reference_grads)


# ---------------------------------------------------------------------------------------------
# the backward, shared by the autograd.Function and torch.ops.cute_kda.backward


def check_trainable(gate: str, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    """Refuse a training call the backward kernels do not cover: grouped value heads with the safe gate (its Kernel
    B writes dq, dk per q/k head). What trains: the safe gate with HV = H, and the unbounded gates ("softplus",
    "none") per channel (Kernel B's dyadic variant) or per head (GatedDeltaNet), grouped value heads included."""
    if gate == "safe" and v.dim() == 4 and v.shape[2] != q.shape[2]:
        raise NotImplementedError(
            "grouped value heads (HV != H) with the safe gate have no backward yet (the unbounded gates train with "
            "them); run it under torch.no_grad() / torch.inference_mode(), or detach its inputs"
        )


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


def recomputed(backend: Backend, x: Inputs, options: Options, saved: Saved) -> Saved:
    """The workspace and checkpoints a ``recompute`` forward did not keep: ``backend``'s forward again on
    the same inputs (``x.initial_state`` included), keeping them this time and skipping the final state; a segmented
    call's kept segment states spare it the two extra passes."""
    return backend.forward(x._replace(tile_base=saved.tile_base), options._replace(recompute=False, final_state_dtype=None),
                           saved.segment_states).saved


def backward(backend: Backend, x: Inputs, options: Options, saved: Saved, d_out: torch.Tensor | None,
             d_final: torch.Tensor | None, needs: tuple[bool, ...],
             initial_state_dtype: torch.dtype | None) -> tuple[torch.Tensor | None, ...]:
    """Gradients of q, k, v, g, beta, A_log, dt_bias, initial_state (None where ``needs`` is False).

    ``x``, ``options``: the forward's, packed (:func:`packed`; ``x.initial_state`` is read only under
    ``options.recompute``, where ``saved`` lacks the workspace and checkpoints and :func:`recomputed` rebuilds them);
    d_out: None or the gradient w.r.t. out (``[B, T, H, V]``, or its packed ``[1, B · T, H, V]``); d_final: None or
    the gradient w.r.t. the final state ``[N, H, V, K]`` (its dtype); ``needs``: one flag per input, in
    :data:`INPUT_NAMES` order; ``initial_state_dtype``: the forward's initial state dtype, None without one (then no
    dh0). The token gradients come back in the packed shapes (:func:`unpacked` takes them to the caller's).
    """
    do = torch.zeros_like(x.v) if d_out is None else kernel_operand(d_out, torch.bfloat16).view(x.v.shape)
    dht = None if d_final is None else kernel_operand(d_final, d_final.dtype)
    dh0_dtype = initial_state_dtype if needs[7] else None
    if options.recompute:
        saved = recomputed(backend, x, options, saved)
    scan = backend.scan(x, options, saved, do, dht, dh0_dtype)
    dq = dk = dg = dbeta = dA_log = ddt_bias = None
    if any(needs[i] for i in KERNEL_B_INPUTS):
        dq, dk, dg, dbeta, dA_log, ddt_bias = backend.grads(x, options, saved, do, scan)
    grads = (dq, dk, scan.dv, dg, dbeta, dA_log, ddt_bias, scan.dh0)
    return tuple(grad if need else None for grad, need in zip(grads, needs))


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


def train(
    backend: Backend, problem: ProblemShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, *, scale: float | None, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
    initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None,
    out: torch.Tensor | None, final_state: torch.Tensor | None, vsplit: int | None, qk_l2norm: bool,
    beta_logits: bool, recompute: bool = False, gate: str = "safe", segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recorded training call on arguments that :func:`~cute_kda.validation.validate_forward` accepted
    (``problem`` is its result) and :func:`check_trainable` admits; :func:`cute_kda.kda_forward`'s contract
    otherwise (``segments``: its context-parallel split, :func:`segmentation_of`)."""
    validation.check_no_buffers_under_autograd(out=out, final_state=final_state)
    validation.check_training_size(v, "v")  # v, dq and dk per value head: the largest per-token tensors
    cu_seqlens = staged_cu_seqlens(cu_seqlens, q)
    final_state_dtype = None
    if output_final_state:
        final_state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    options = Options(
        problem=problem, scale=float(problem.head_dim ** -0.5 if scale is None else scale),
        lower_bound=float(lower_bound), qk_l2norm=bool(qk_l2norm), beta_logits=bool(beta_logits),
        final_state_dtype=final_state_dtype, vsplit=vsplit, recompute=bool(recompute), gate=gate,
        segmentation=segmentation_of(problem, q.device, segments, vsplit),
    )
    return TrainingForward.apply(backend, options, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)


def kda_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, backend: Backend,
    scale: float | None = None, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None, final_state: torch.Tensor | None = None, vsplit: int | None = None,
    qk_l2norm: bool = True, beta_logits: bool = True, recompute: bool = False, gate: str = "safe",
    segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`cute_kda.kda_forward`'s training path on torch tensors, with the stages of ``backend``.

    Same arguments, checks and results as :func:`cute_kda.kda_forward` (which calls :func:`train` with
    :data:`KERNELS`); always recorded by autograd, whatever requires grad. For the references:
    ``backend=REFERENCE`` runs on any device. ``gate``: the safe gate, or "softplus" / "none" with a per-head g
    (the others raise, :func:`check_trainable`).
    """
    problem = validation.validate_forward(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=initial_state, final_state=final_state, out=out, cu_seqlens=cu_seqlens, vsplit=vsplit,
        gate=gate,
    )
    check_trainable(gate, q, v, g)
    return train(
        backend, problem, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, out=out,
        final_state=final_state, vsplit=vsplit, qk_l2norm=qk_l2norm, beta_logits=beta_logits, recompute=recompute,
        gate=gate, segments=segments,
    )
