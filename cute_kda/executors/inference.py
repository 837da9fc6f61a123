"""The inference executor: a resolved call (:mod:`cute_kda.call`) that autograd does not record.

K1 then K2 on the caller's current stream, sharing a workspace buffer cached per (device, stream)
(:class:`WorkspaceCache`), with the compiled variants and the launch arguments of each static configuration kept in
a :class:`LaunchPlan`: a small call's host time is mostly looking things up. Nothing here waits for the device. A call
split into segments (context parallelism) runs the training forward's stage keeping nothing
(:mod:`cute_kda.executors.stages`). Under ``torch.compile`` the same executor is the custom op
``torch.ops.cute_kda.forward``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import validation, variants
from ..call import Call, Inputs, Options, resolve
from ..validation import problem_of
from ..device import check_supported, sm_count
from ..variants import PrepareVariant, RecurrenceVariant, pair_prefill
from ..numerics import CHUNK
from ..workspace import (
    CrossBlocks, Workspace, WorkspaceSpec, cross_block_views, images_to_states, tile_bases_of, workspace_views,
)
from .stages import KERNELS, ForwardResult, Saved, packed, pair_chain, workspace_spec

OP_NAME = "cute_kda::forward"

_WORKSPACE_GRANULE = 2 << 20  # grow the cached buffer in 2 MiB steps


class WorkspaceCache:
    """One flat uint8 K1→K2 workspace buffer per (device, stream), grown on demand, never shrunk, and the
    launch plans of the calls that use it.

    Keyed by stream because the buffer is reused without any event: two calls on one stream are
    ordered by the stream, so the second call's K1 cannot overwrite what the first call's K2 still
    reads; calls on different streams get different buffers. A buffer that grows is freed to
    torch's caching allocator, which hands it only to later work on the same stream. Not safe
    under CUDA-graph capture (a captured call would keep using a buffer that a later eager call on
    the capture stream may replace); :meth:`clear` drops every buffer. The views of the last spec
    seen per buffer are kept too: carving them costs more host time than a small call's kernels.

    A :class:`LaunchPlan` (what one static configuration launches, with views of the buffer) is kept per
    (device, stream) and configuration; a buffer that grows drops the plans on the old one.
    """

    _MAX_PLANS = 64  # per (device, stream); past it the plans start over (a workload of ever new shapes)

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._views: dict[tuple[int, int], tuple[WorkspaceSpec, Workspace]] = {}
        self._plans: dict[tuple[int, int], dict[tuple, LaunchPlan]] = {}
        self._lock = threading.Lock()

    def get(self, spec: WorkspaceSpec, device: torch.device, stream: int | None = None) -> Workspace:
        """Views of a workspace for ``spec`` on ``device``, for work on the stream with raw handle
        ``stream`` (default: the current stream)."""
        if stream is None:
            stream = torch.cuda.current_stream(device).cuda_stream
        key = (device.index, stream)
        with self._lock:
            cached = self._views.get(key)
            if cached is not None and cached[0] == spec:  # the steady state: same spec, same stream
                return cached[1]
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < spec.nbytes:
                nbytes = -(-spec.nbytes // _WORKSPACE_GRANULE) * _WORKSPACE_GRANULE
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self._buffers[key] = buffer
                self._plans.pop(key, None)  # their views are of the old buffer
            views = workspace_views(spec, buffer)
            self._views[key] = (spec, views)
        return views

    def cross_blocks(self, spec: WorkspaceSpec, device: torch.device, stream: int) -> CrossBlocks:
        """The cross blocks of a ``pairs`` ``spec`` in the buffer :meth:`get` handed out for it (call that first)."""
        with self._lock:
            return cross_block_views(spec, self._buffers[(device.index, stream)])

    def plan(self, index: int, stream: int, config: tuple) -> LaunchPlan | None:
        """The kept plan of ``config`` on (device ``index``, raw ``stream``), None before :meth:`keep`."""
        plans = self._plans.get((index, stream))
        return None if plans is None else plans.get(config)

    def keep(self, index: int, stream: int, config: tuple, plan: LaunchPlan) -> LaunchPlan:
        """Keep ``plan`` (built on this cache's current buffer) for ``config``; returns it."""
        with self._lock:
            plans = self._plans.setdefault((index, stream), {})
            if len(plans) >= self._MAX_PLANS:
                plans.clear()
            plans[config] = plan
        return plan

    def snapshot(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(device index, stream handle) → (buffer address, bytes) of every cached buffer."""
        with self._lock:
            return {key: (b.data_ptr(), b.numel()) for key, b in self._buffers.items()}

    def clear(self) -> None:
        """Drop every cached buffer and plan (their memory returns to torch's caching allocator)."""
        with self._lock:
            self._buffers.clear()
            self._views.clear()
            self._plans.clear()


class LaunchPlan(NamedTuple):
    """What a forward call of one static configuration launches on one (device, stream): the compiled K1
    and K2 variants, the workspace as each takes it (converted for TVM-FFI once), K1's fp32 scalars, the
    ``CUstream``. Built on the configuration's first call, then looked up: building it costs a small call more
    host time than its kernels take."""

    prepare: Callable[..., None]
    recurrence: Callable[..., None]
    prepare_workspace: Any
    recurrence_workspace: tuple  # (fields, cross blocks): ``ops.recurrence.workspace_arguments``
    scalars: tuple[float, float]
    stream: Any


WORKSPACES = WorkspaceCache()




_LAUNCHERS: tuple = ()


def _launchers() -> tuple:
    """(``ops.prepare``, ``ops.recurrence``, ``ops._cache``), imported on the first call (they bring in the DSL), then
    kept."""
    global _LAUNCHERS
    if not _LAUNCHERS:
        from ..ops import _cache
        from ..ops import prepare as k1
        from ..ops import recurrence as k2

        _LAUNCHERS = (k1, k2, _cache)
    return _LAUNCHERS


def run(call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, final state or None) of a resolved inference ``call``: K1 then K2 on the current stream of q's device,
    into the caller's buffers when given (``call.out``, ``call.final_state``)."""
    x, options, out, final_state, _, _ = call
    if options.segmentation is not None:  # the training forward's stage checks the device itself
        return _segmented(call)
    # the fields as locals: one unpack instead of seventeen reads by name (0.2 µs of a small call's host path)
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, _, state_indices, checkpoint_indices = x
    validation.check_on_cuda("q", q)
    problem, device = options.problem, q.device
    if final_state is None and options.final_state_dtype is not None:
        final_state = torch.empty(problem.state_shape, dtype=options.final_state_dtype, device=device)
    if out is None:
        out = torch.empty_like(v)
    if problem.heads == 0:
        return out, final_state
    k1, k2, streams = _launchers()
    handle = streams.current_stream_handle(device.index)  # one stream look-up for the plan and both launches
    # with the switch the plan's build reads (variants.PAIR_PREFILL): a plan never outlives the choice it was built on
    config = (options, q.shape[2], q.dtype, g.dtype, g.dim(), None if initial_state is None else initial_state.dtype,
              state_indices is not None, variants.PAIR_PREFILL)
    plan = WORKSPACES.plan(device.index, handle, config)
    with streams.on_device(device):
        if plan is None:
            plan = WORKSPACES.keep(device.index, handle, config, _build_plan(x, options, out, final_state, handle))
        prepare, recurrence, prepare_workspace, recurrence_workspace, scalars, stream = plan
        tile_base = k1.tile_bases(cu_seqlens, stream=stream) if problem.varlen else None
        k1.launch(prepare, q, k, g, beta, A_log, dt_bias, prepare_workspace, scalars, problem.seq_len, cu_seqlens,
                  tile_base, stream)
        k2.launch(recurrence, v, out, recurrence_workspace, initial_state, final_state, cu_seqlens, tile_base, stream,
                  state_indices, checkpoint_indices)
    return out, final_state


def _segmented(call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inference forward of a call split into segments (:mod:`cute_kda.context_parallel`): the training
    forward's stage keeping nothing (a fresh workspace), then the caller's buffers filled when given."""
    options = call.options._replace(recompute=True)
    result = KERNELS.forward(*packed(call.inputs, options))
    o = result.out.view(call.inputs.v.shape)
    if call.out is not None:
        o = call.out.copy_(o)
    if call.final_state is None:
        return o, result.final_state
    return o, call.final_state.copy_(result.final_state)


def run_keeping_chunk_states(call: Call, chunk: int, cu_seqlens_cpu: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(out, final state or None, the bf16 state entering every ``chunk``-token chunk of every sequence) of an unsplit
    inference ``call``: FLA's ``return_intermediate_states``. The call's forward runs with K2's training checkpoints
    (the bf16 state ``S`` entering every tile, as state images; where the plain call runs the two-tile prefill,
    :func:`~cute_kda.variants.pair_prefill`, on its chain keeping the state entering every pair, :func:`pair_forward`:
    ``chunk`` is a multiple of 32 tokens, so every chunk starts a pair), and the images entering tiles
    ``0, chunk / 16, …`` of each sequence are gathered: ``[B, NT, H, K, V]`` (NT = ceil(T / chunk)) for equal
    lengths, ``[1, Σ NT_n, H, K, V]`` packed. o and the final state are the plain call's bits. A packed call needs
    ``cu_seqlens_cpu`` (the chunk count depends on its values: without them the host would wait for the device)."""
    x, options = call.inputs, call.options
    if call.training:
        raise NotImplementedError("return_intermediate_states=True is inference only: run the call under "
                                  "torch.inference_mode() / torch.no_grad() (as FLA requires)")
    if options.segmentation is not None or x.state_indices is not None:
        raise NotImplementedError("return_intermediate_states=True with segments or a state pool is not supported")
    problem = options.problem
    if problem.varlen:
        if cu_seqlens_cpu is None:
            raise NotImplementedError("return_intermediate_states=True with cu_seqlens needs cu_seqlens_cpu (the "
                                      "chunk count depends on the sequence lengths; reading them would sync)")
        bounds = cu_seqlens_cpu.tolist()
        tile_base = tile_bases_of(cu_seqlens_cpu).tolist()
        lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    else:
        lengths, per_row = [problem.seq_len] * problem.batch, -(-problem.seq_len // CHUNK)
        tile_base = [n * per_row for n in range(problem.batch + 1)]
    vsplit = k2_vsplit(options, x.q.device)
    pairs = pair_prefill(options.gate, x.g.dim() == 3, False, vsplit)
    result = pair_forward(x, options, vsplit) if pairs else KERNELS.forward(x, options._replace(recompute=False))
    images = result.saved.checkpoints
    slots, step = images.shape[0] // problem.heads, chunk // CHUNK
    # the state entering global tile g of sequence n is kept at g + n; the pair entered there at (g + n) // 2
    entering = [tile_base[n] + n + c * step for n, length in enumerate(lengths) for c in range(-(-length // chunk))]
    rows = [row // 2 for row in entering] if pairs else entering
    index = torch.tensor([head * slots + row for head in range(problem.heads) for row in rows], dtype=torch.int64)
    if images.is_cuda:  # a pinned copy does not wait for the stream
        index = index.pin_memory().to(images.device, non_blocking=True)
    states = images_to_states(images.index_select(0, index)).view(problem.heads, len(rows), *images.shape[1:])
    batch = 1 if problem.varlen else problem.batch
    h = states.transpose(0, 1).reshape(batch, len(rows) // batch, problem.heads, *images.shape[1:])
    return result.out, result.final_state, h


def k2_vsplit(options: Options, device: torch.device) -> int:
    """The call's K2 V-split: ``options.vsplit``, else :meth:`~cute_kda.variants.RecurrenceVariant.choose_vsplit` on
    the device's SMs."""
    if options.vsplit is not None:
        return options.vsplit
    return RecurrenceVariant.choose_vsplit(options.problem.num_seqs, options.problem.heads, sm_count(device.index))


def pair_forward(x: Inputs, options: Options, vsplit: int) -> ForwardResult:
    """The two-tile prefill of an unsplit call keeping the state entering every pair
    (:func:`~cute_kda.executors.stages.pair_chain`; tile a's U, which its K2 keeps too, is dropped), at ``vsplit``:
    the same o and final state as the plain call's pair variants, on q's device's current stream; the checkpoints in
    the slots of :func:`cute_kda.workspace.pair_block_slots`."""
    chain = pair_chain(x, options, keep=True, vsplit=vsplit)
    return ForwardResult(chain.out, chain.final_state, Saved(None, chain.checkpoints, chain.tile_base))


def _build_plan(x: Inputs, options: Options, out: torch.Tensor, final_state: torch.Tensor | None,
                handle: int) -> LaunchPlan:
    """The :class:`LaunchPlan` of a call's configuration on q's device and stream ``handle``, compiling the variants
    on first use (K2's from this call's tensors and a fake ``tile_base``)."""
    problem, device = options.problem, x.q.device
    check_supported(device)
    k1, k2, streams = _launchers()
    vsplit = k2_vsplit(options, device)
    pairs = pair_prefill(options.gate, x.g.dim() == 3, False, vsplit)  # unsplit: a segmented call runs the stages
    spec = workspace_spec(problem, pairs)
    workspace = WORKSPACES.get(spec, device, handle)
    cross = WORKSPACES.cross_blocks(spec, device, handle) if pairs else None
    stream = streams.cu_stream(handle)
    prepare = k1.compiled_variant(
        PrepareVariant(problem.varlen, options.qk_l2norm, options.beta_logits, options.gate, x.g.dtype, x.g.dim() == 3,
                       problem.heads != x.q.shape[2], x.q.dtype, problem.head_dim, pairs), device.index)
    tile_base = None if x.cu_seqlens is None else torch.empty(x.cu_seqlens.shape, dtype=torch.int32, device="meta")
    arguments = k2.launch_arguments(x.v, workspace, out, cu_seqlens=x.cu_seqlens, tile_base=tile_base,
                                    initial_state=x.initial_state, final_state=final_state,
                                    state_indices=x.state_indices, checkpoint_indices=x.checkpoint_indices,
                                    cross=cross)
    recurrence = k2.compiled_variant(
        RecurrenceVariant(vsplit, None if x.initial_state is None else x.initial_state.dtype,
                          None if final_state is None else final_state.dtype, problem.varlen, False,
                          x.state_indices is not None, options.checkpoint_every, x.v.dtype, problem.head_dim, pairs),
        device.index, arguments)
    return LaunchPlan(prepare, recurrence, k1.workspace_arguments(workspace, cross),
                      k2.workspace_arguments(workspace, cross), k1.fp32_scalars(options.scale, options.lower_bound),
                      stream)


# ---------------------------------------------------------------------------------------------
# the inference op (torch.compile)


@torch.library.custom_op(OP_NAME, mutates_args=())
def forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], scale: Optional[float], lower_bound: float,
    final_state_dtype: Optional[torch.dtype], vsplit: Optional[int], qk_l2norm: bool, beta_logits: bool, gate: str,
    segments: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cute_kda.kda_forward`'s inference on torch tensors; ``final_state_dtype`` None means no final state
    (then the second output is an empty tensor); A_log, dt_bias None with ``gate="none"``."""
    o, state = run(resolve(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                           initial_state=initial_state, cu_seqlens=cu_seqlens, vsplit=vsplit, qk_l2norm=qk_l2norm,
                           beta_logits=beta_logits, gate=gate, segments=segments, training=False,
                           final_state_dtype=final_state_dtype))
    return o, (state if state is not None else q.new_empty((0,)))


@forward_op.register_fake
def _forward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                  final_state_dtype, vsplit, qk_l2norm, beta_logits, gate, segments):
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    if final_state_dtype is None:
        return o, q.new_empty((0,))
    return o, q.new_empty(problem_of(q, v, cu_seqlens).state_shape, dtype=final_state_dtype)
