"""Public entry points: :func:`kda_forward`, :func:`chunk_kda` (FLA drop-in) and :func:`warmup`.

Path of a call: DLPack → torch views (:mod:`.interop`) → checks (:mod:`.validation`) → variant
(:mod:`.config`) → K1 ``prepare`` and K2 ``recurrence`` on the caller's current stream, sharing a
cached workspace → results back in the caller's framework. Nothing on this path synchronises the
host with the device (see :mod:`.validation` for the one opt-in exception). A call that autograd
records (grad mode on, an input requiring grad) leaves this path after the checks for
:mod:`.autograd`'s training forward, which has a workspace of its own and a backward.

:func:`chunk_kda` is a thin layer over :func:`kda_forward`: :func:`translate_fla_call` maps
flash-linear-attention's keyword arguments onto our canonical call (a pure function of its
arguments, tested on the CPU against the gold reference), or raises ``NotImplementedError``
naming the flag the kernels do not cover.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from . import autograd, interop, torch_ops, validation
from .config import STATE_MODES, enumerate_configs, select_forward_config, sm_count
from .workspace import Workspace, WorkspaceSpec, workspace_views

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
        prepare = sys.modules.get("cute_kda.ops.prepare")
        if prepare is not None:
            prepare.forget_launch_tiles()  # K1 keeps its arguments for the last workspace it saw


class LaunchPlan(NamedTuple):
    """What a forward call of one static configuration launches on one (device, stream): the compiled K1
    and K2 variants, the workspace as each takes it (converted for TVM-FFI once), K1's fp32 scalars, the
    ``CUstream``. Built on the configuration's first call, then looked up: building it costs a small call more
    host time than its kernels take."""

    prepare: Callable[..., None]
    recurrence: Callable[..., None]
    prepare_workspace: Any
    recurrence_workspace: tuple
    scalars: tuple[float, float]
    stream: Any


WORKSPACES = WorkspaceCache()


def kda_forward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None = None,
    A_log: Any = None,
    dt_bias: Any = None,
    lower_bound: float = -5.0,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    out: Any = None,
    final_state: Any = None,
    vsplit: int | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    recompute: bool = False,
    gate: str = "safe",
    segments: int | None = None,
) -> tuple[Any, Any]:
    """KDA forward (docs/design.md §1) with the in-kernel gate, on a Hopper GPU.

    Inputs (any DLPack tensors on one CUDA device, contiguous, 16-byte aligned):
      q, k   bf16 ``[B, T, H, K]``; l2-normalised per token inside when ``qk_l2norm``.
      v      bf16 ``[B, T, H, V]``.
      g      ``[B, T, H, K]``, the gate; the per-channel log decay it gives depends on ``gate``:
               ``"safe"`` (default)  bf16 raw gate, ``lower_bound · sigmoid(exp(A_log[h]) · (g + dt_bias[h]))``;
               ``"softplus"``  bf16 raw gate, ``−exp(A_log[h]) · softplus(g + dt_bias[h])`` (Kimi-Linear's
                          gate, unbounded below);
               ``"none"``  bf16 or fp32, the log decay itself (any value ≤ 0; −1000 masks a channel).
      beta   bf16 ``[B, T, H]``: logits (``beta_logits=True``, sigmoid inside) or β itself.
      A_log  fp32 ``[H]``;  dt_bias fp32 ``[H, K]`` (gates "safe" and "softplus"; None with "none");
      lower_bound in [-5, 0) (gate "safe" only).
      scale  Python float, default ``K ** -0.5``.
      cu_seqlens  int32 or int64 ``[N+1]``, optional: N packed sequences (then B == 1); int32 is widened
             to int64 on the device (one small kernel, no sync). On the GPU it is
             trusted (its length gives N; set ``CUTE_KDA_DEBUG_CHECKS=1`` to check its values, a
             sync); on the CPU its values are checked and it is copied over asynchronously.
      initial_state  bf16 or fp32 ``[N, H, V, K]`` (v-first: ``state[n, h, v, k]``), N = B without
             cu_seqlens; None means zero.
    Outputs:
      out    bf16 ``[B, T, H, V]``; written into ``out`` when given.
      final_state  ``[N, H, V, K]``, written into ``final_state`` when given (then returned even
             without ``output_final_state``), else allocated when ``output_final_state`` with the
             dtype of ``initial_state`` (fp32 without one); None otherwise.
    K = V = 128. ``vsplit`` (1, 2, 4 or None = heuristic): K2 CTAs per (sequence, head). ``segments``
    (context parallelism, :mod:`cute_kda.context_parallel`): None lets a fixed-length call with few (sequence,
    head) pairs and long sequences cut each sequence into segments of whole tiles that the serial scans run side
    by side (the forward's K2 then runs three passes, the backward's Kernel A two; results differ from the unsplit
    chain by rounding); 1 never splits; an int ≥ 2 asks for that many segments per sequence. Varlen calls are
    never split, calls that fix ``vsplit`` only when ``segments`` asks. The unbounded gates
    ("softplus", "none") run K1's overflow-free form (docs/numerics.md, "Unbounded gates"); K2 is the same.

    Runs on the caller's current stream (torch's, or CuPy's for CuPy arrays) without host
    synchronisation; returns arrays of ``q``'s framework (torch, CuPy, JAX; torch otherwise).

    Autograd: under grad mode, when any of q, k, v, g, beta, A_log, dt_bias, initial_state requires
    grad, the call is recorded (:mod:`cute_kda.autograd`) and ``backward`` gives each of those that
    requires grad its gradient (in its dtype; dh0 ``[N, H, V, K]``), the final state's gradient flowing
    in when the final state is used. Not on that path: ``out=`` / ``final_state=`` buffers, double
    backward and, for now, the gates "softplus" and "none" (``NotImplementedError``). Under ``torch.no_grad()`` / ``torch.inference_mode()`` nothing
    is recorded or saved. ``recompute`` (training only): the forward keeps nothing beyond its inputs and
    the backward runs K1 and K2 again first (bit-identical gradients; at B1 T8192 H96 2.3 GB less held
    per call for 1 ms more per step, 7.22 against 6.19 ms); False keeps K1's workspace and the per-tile
    states. Ignored by calls that autograd does not record.
    Under ``torch.compile`` the call is one custom op, ``torch.ops.cute_kda.forward``, or for a
    recorded call ``torch.ops.cute_kda.forward_train`` with its backward op (:mod:`cute_kda.torch_ops`);
    eager calls do not go through the dispatcher.
    """
    if torch.compiler.is_compiling():
        return torch_ops.kda_forward(
            q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, out=out,
            final_state=final_state, vsplit=vsplit, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
            recompute=recompute, gate=gate, segments=segments,
        )
    if isinstance(q, torch.Tensor):  # torch in, torch out, torch's current stream: nothing to hand over
        return _forward(
            q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, out=out,
            final_state=final_state, vsplit=vsplit, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
            recompute=recompute, gate=gate, segments=segments,
        )
    as_torch = interop.as_torch
    return interop.answer_in_framework(q, lambda: _forward(
        *(as_torch(x) for x in (q, k, v, g, beta)),
        scale=scale, A_log=as_torch(A_log), dt_bias=as_torch(dt_bias),
        lower_bound=lower_bound, initial_state=as_torch(initial_state),
        output_final_state=output_final_state, cu_seqlens=as_torch(cu_seqlens),
        out=as_torch(out), final_state=as_torch(final_state), vsplit=vsplit,
        qk_l2norm=qk_l2norm, beta_logits=beta_logits, recompute=recompute, gate=gate, segments=segments,
    ))


_LAUNCHERS: tuple = ()


def _launchers() -> tuple:
    """(``ops.prepare``, ``ops.recurrence``, ``ops._cache``), imported on the first call (they bring
    in the DSL), then kept."""
    global _LAUNCHERS
    if not _LAUNCHERS:
        from .ops import _cache
        from .ops import prepare as k1
        from .ops import recurrence as k2

        _LAUNCHERS = (k1, k2, _cache)
    return _LAUNCHERS


def _forward(
    q: torch.Tensor, k: Any, v: Any, g: Any, beta: Any, *,
    scale: float | None, A_log: Any, dt_bias: Any, lower_bound: float,
    initial_state: Any, output_final_state: bool, cu_seqlens: Any,
    out: Any, final_state: Any, vsplit: int | None,
    qk_l2norm: bool, beta_logits: bool, recompute: bool = False, gate: str = "safe", segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kda_forward` for a torch ``q`` (the other arguments may be any DLPack tensors): validate, look up
    the :class:`LaunchPlan`, launch K1 then K2 (a call that autograd records: :func:`cute_kda.autograd.train`
    on the kernels).

    A plain call (every argument a torch tensor that passes, no ``cu_seqlens``, the safe gate) is checked in
    one pass (:func:`cute_kda.validation.plain_forward`); any other goes through the checks that name what is
    wrong, its arguments seen as torch tensors first.
    """
    problem = validation.plain_forward(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                                       final_state, out, cu_seqlens, vsplit, gate)
    if problem is None:
        as_torch = interop.as_torch
        k, v, g, beta, A_log, dt_bias = (as_torch(x) for x in (k, v, g, beta, A_log, dt_bias))
        initial_state, cu_seqlens, out, final_state = (as_torch(x) for x in (initial_state, cu_seqlens, out,
                                                                             final_state))
        problem = validation.validate_forward(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
            initial_state=initial_state, final_state=final_state, out=out, cu_seqlens=cu_seqlens, vsplit=vsplit,
            gate=gate,
        )
    if validation.needs_autograd(q, k, v, g, beta, A_log, dt_bias, initial_state):
        autograd.check_trainable(gate, q, v, g)
        return autograd.train(
            autograd.KERNELS, problem, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, out=out, final_state=final_state, vsplit=vsplit, qk_l2norm=qk_l2norm,
            beta_logits=beta_logits, recompute=recompute, gate=gate, segments=segments,
        )
    validation.check_on_cuda("q", q)
    device = q.device
    scale = float(problem.head_dim ** -0.5 if scale is None else scale)
    if cu_seqlens is not None:
        cu_seqlens = validation.device_cu_seqlens(cu_seqlens, device, problem.seq_len)

    segmentation = autograd.segmentation_of(problem, device, segments, vsplit)
    if segmentation is not None:
        return _segmented_forward(problem, segmentation, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                                  lower_bound=lower_bound, initial_state=initial_state, out=out,
                                  final_state=final_state, output_final_state=output_final_state,
                                  qk_l2norm=qk_l2norm, beta_logits=beta_logits, gate=gate)
    if final_state is None and output_final_state:
        dtype = torch.float32 if initial_state is None else initial_state.dtype
        d = problem.head_dim
        final_state = torch.empty((problem.num_seqs, problem.heads, d, d), dtype=dtype, device=device)
    if out is None:
        out = torch.empty_like(v)
    if problem.heads == 0 or problem.total_tokens == 0:
        return out, final_state
    k1, k2, streams = _launchers()
    handle = streams.current_stream_handle(device.index)  # one stream look-up for the plan and both launches
    states = (None if initial_state is None else initial_state.dtype, None if final_state is None else final_state.dtype)
    config = (problem, q.shape[2], g.dtype, g.dim(), gate, qk_l2norm, beta_logits, states, vsplit, scale,
              lower_bound)
    plan = WORKSPACES.plan(device.index, handle, config)
    with streams.on_device(device):
        if plan is None:
            plan = WORKSPACES.keep(device.index, handle, config, _build_plan(
                problem, config, v, out, initial_state, final_state, cu_seqlens, device, handle))
        tile_base = k1.tile_bases(cu_seqlens, stream=plan.stream) if problem.varlen else None
        k1.launch(plan.prepare, q, k, g, beta, A_log, dt_bias, plan.prepare_workspace, plan.scalars, problem.seq_len,
                  cu_seqlens, tile_base, plan.stream)
        k2.launch(plan.recurrence, v, out, plan.recurrence_workspace, initial_state, final_state, cu_seqlens,
                  tile_base, plan.stream)
    return out, final_state


def _segmented_forward(problem: validation.ProblemShape, segmentation: Any, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float, A_log: Any, dt_bias: Any,
                       lower_bound: float, initial_state: Any, out: Any, final_state: Any, output_final_state: bool,
                       qk_l2norm: bool, beta_logits: bool, gate: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inference forward of a call split into segments (:mod:`cute_kda.context_parallel`): the training
    forward's stage keeping nothing (a fresh workspace), then the caller's buffers filled when given."""
    final_dtype = None
    if final_state is not None:
        final_dtype = final_state.dtype
    elif output_final_state:
        final_dtype = torch.float32 if initial_state is None else initial_state.dtype
    options = autograd.Options(problem, scale, float(lower_bound), bool(qk_l2norm), bool(beta_logits), final_dtype,
                               None, True, gate, segmentation)
    x = autograd.Inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, None)
    result = autograd.KERNELS.forward(*autograd.packed(x, options))
    o = result.out.view(v.shape)
    if out is not None:
        o = out.copy_(o)
    if final_state is None:
        return o, result.final_state
    return o, final_state.copy_(result.final_state)


def _build_plan(problem: validation.ProblemShape, config: tuple, v: torch.Tensor, out: torch.Tensor,
                initial_state: torch.Tensor | None, final_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                device: torch.device, handle: int) -> LaunchPlan:
    """The :class:`LaunchPlan` of ``config`` (:func:`_forward`'s key) on ``device`` and stream ``handle``,
    compiling the variants on first use (K2's from this call's tensors and a fake ``tile_base``)."""
    _, qk_heads, g_dtype, g_dim, gate, qk_l2norm, beta_logits, states, vsplit, scale, lower_bound = config
    k1, k2, streams = _launchers()
    forward = select_forward_config(problem, qk_l2norm=qk_l2norm, beta_logits=beta_logits, initial_state=states[0],
                                    final_state=states[1], vsplit=vsplit, sms=sm_count(device.index))
    workspace = WORKSPACES.get(autograd.workspace_spec(problem), device, handle)
    stream = streams.cu_stream(handle)
    prepare = k1.compiled_variant(problem.varlen, forward.qk_l2norm, forward.beta_logits, device.index, gate, g_dtype,
                                  g_dim == 3, problem.heads != qk_heads)
    tile_base = None if cu_seqlens is None else torch.empty(cu_seqlens.shape, dtype=torch.int32, device="meta")
    arguments = k2.launch_arguments(v, workspace, out, cu_seqlens=cu_seqlens, tile_base=tile_base,
                                    initial_state=initial_state, final_state=final_state)
    recurrence = k2.compiled_variant(forward.vsplit, forward.initial_state, forward.final_state, problem.varlen, False,
                                     device.index, arguments, stream)
    return LaunchPlan(prepare, recurrence, k1.workspace_arguments(workspace), k2.workspace_arguments(workspace),
                      k1.fp32_scalars(scale, float(lower_bound)), stream)


# ---------------------------------------------------------------------------------------------
# flash-linear-attention drop-in


@dataclass(frozen=True)
class CanonicalCall:
    """A :func:`kda_forward` call equivalent to an FLA ``chunk_kda`` call, and how to hand back.

    ``tensors`` = (q, k, v, g, beta); ``options`` = keyword arguments of :func:`kda_forward`;
    ``state_k_first``: the caller's states are FLA's default ``[N, H, K, V]``, so the v-first
    final state is transposed back (into a contiguous tensor) on the way out; ``recompute``: FLA's
    ``not disable_recompute``, :func:`kda_forward`'s training-memory choice (not in ``options``, which
    the references take too).
    """

    tensors: tuple[torch.Tensor, ...]
    options: dict[str, Any]
    state_k_first: bool
    recompute: bool = True

    def run(self, forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[Any, Any]:
        """Call ``forward`` (:func:`kda_forward`, or a reference with its signature) and shape the result."""
        o, state = forward(*self.tensors, **self.options)
        if state is not None and self.state_k_first:
            state = state.transpose(-1, -2).contiguous()
        return o, state


_FLA_CHUNK_SIZES = (32, 64)
_FLA_EXTRA_KWARGS = frozenset(("A_log", "dt_bias", "chunk_size", "transpose_state_layout"))


def translate_fla_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> CanonicalCall:
    """Map FLA ``chunk_kda`` arguments (fla-core 0.6.0) onto a :func:`kda_forward` call.

    Pure: no kernel runs, no device is needed. What maps (same function as FLA computes):
      - gate: ``use_gate_in_kernel=True`` with ``lower_bound`` set is FLA's bounded gate
        ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` whatever ``safe_gate`` says (FLA's
        gate kernel keys on ``lower_bound``) → ``gate="safe"``; without ``lower_bound`` it is the
        softplus gate ``−exp(A_log) · softplus(g + dt_bias)`` → ``gate="softplus"``; ``A_log=None``
        means no scaling (we pass zeros: exp(0) = 1); ``dt_bias`` ``[H*K]``, ``[H, K]`` or None
        (zeros). Both are taken to fp32 as FLA's kernels do. ``use_gate_in_kernel=False``: g is the
        log decay itself (bf16 or fp32) → ``gate="none"``, A_log and dt_bias unused.
      - ``use_qk_l2norm_in_kernel`` → ``qk_l2norm``; ``use_beta_sigmoid_in_kernel`` → ``beta_logits``.
      - states: fp32 ``[N, H, K, V]`` (default) or ``[N, H, V, K]`` with ``state_v_first`` /
        ``transpose_state_layout``; the final state is fp32 in the caller's layout.
      - ``disable_recompute`` keeps FLA's meaning for training: False (FLA's default) →
        ``recompute=True``, the backward recomputes the forward's intermediates instead of the
        forward keeping them (FLA's memory-lean default); True → they are kept (faster backward).
      - ``safe_gate`` changes how FLA computes, not what: accepted. ``chunk_size`` (32 or 64)
        likewise. ``cu_seqlens_cpu``, when given, is checked on the host.
      - grouped value heads: v, g, beta, ``A_log``, ``dt_bias`` and the states have HV heads, a multiple of
        q's and k's H (value head ``j`` reads q/k head ``j // (HV / H)``); they train with the unbounded gates.
      - inputs that are not contiguous are made contiguous (FLA does the same).
    What raises ``NotImplementedError`` (the flag is named): a bounded gate with ``lower_bound``
    outside [-5, 0) when ``safe_gate=False``, ``allow_neg_eigval``, training grouped value heads (HV != H) with
    the safe gate, ``return_intermediate_states``, ``cp_context``, ``use_graph``. Errors FLA raises itself
    (``ValueError``) are raised the same way.
    """
    if not kwargs.keys() <= _FLA_EXTRA_KWARGS:
        unknown = sorted(kwargs.keys() - _FLA_EXTRA_KWARGS)
        raise TypeError(f"chunk_kda got unexpected keyword arguments: {', '.join(unknown)}")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass either state_v_first or the deprecated transpose_state_layout, not both")
        state_v_first = bool(kwargs["transpose_state_layout"])
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in _FLA_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be 32 or 64 for KDA, got {chunk_size}")
    _refuse_unsupported_fla_flags(
        allow_neg_eigval=allow_neg_eigval, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        return_intermediate_states=return_intermediate_states, cp_context=cp_context, use_graph=use_graph,
    )
    gate, lower_bound = _fla_gate(use_gate_in_kernel, safe_gate, lower_bound)

    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor) and isinstance(g, tensor)
            and isinstance(beta, tensor) and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and g.dim() == 4
            and beta.dim() == 3):  # the common case in one test; otherwise the checks name the argument
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            validation.check_is_tensor(name, x)
            ndim, meaning = (3, "[B, T, H]") if name == "beta" else (4, "[B, T, H, D]")
            validation.check_ndim(name, x, ndim, meaning)
    key_dim, heads = q.shape[3], v.shape[2]  # value heads: g, beta, A_log, dt_bias and the states have HV
    if heads != q.shape[2]:
        validation.check_value_heads(q.shape[2], heads)
    if gate == "none":  # FLA reads neither with a precomputed log decay
        A_log = dt_bias = None
    else:
        A_log = _fla_A_log(kwargs.get("A_log"), heads, q.device)
        dt_bias = _fla_dt_bias(kwargs.get("dt_bias"), heads, key_dim, q.device)

    if initial_state is not None:
        validation.check_is_tensor("initial_state", initial_state)
        validation.check_dtype("initial_state", initial_state, (torch.float32,))
        _check_fla_state_shape(initial_state, q, v, cu_seqlens, state_v_first)
        initial_state = initial_state if state_v_first else initial_state.transpose(-1, -2)
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None and cu_seqlens_cpu is not None:
        validation.check_is_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
        validation.check_cu_seqlens_values(cu_seqlens_cpu, q.shape[1], name="cu_seqlens_cpu")

    options = dict(
        scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, initial_state=initial_state,
        output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens,
        qk_l2norm=bool(use_qk_l2norm_in_kernel), beta_logits=bool(use_beta_sigmoid_in_kernel), gate=gate,
    )
    tensors = (q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous())
    return CanonicalCall(tensors=tensors, options=options, state_k_first=not state_v_first,
                         recompute=not disable_recompute)


def _check_fla_state_shape(state: torch.Tensor, q: torch.Tensor, v: torch.Tensor, cu_seqlens: Any,
                           state_v_first: bool) -> None:
    """The caller's state shape in the caller's layout (checked before the v-first transpose, so an
    error shows the shape that was passed)."""
    meaning = "[N, H, V, K] (state_v_first)" if state_v_first else "[N, H, K, V]"
    validation.check_ndim("initial_state", state, 4, meaning)
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        num_seqs = cu_seqlens.numel() - 1
    else:
        num_seqs = q.shape[0]
    heads, key_dim, value_dim = v.shape[2], q.shape[3], v.shape[3]
    inner = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    validation.check_shape("initial_state", state, (num_seqs, heads, *inner), meaning)


def refuse_neg_eigval(allow_neg_eigval: bool, use_beta_sigmoid_in_kernel: bool) -> None:
    """FLA's ``allow_neg_eigval`` (β = 2·sigmoid) is not implemented: FLA's own ValueError first, then ours."""
    if allow_neg_eigval:
        if not use_beta_sigmoid_in_kernel:  # FLA raises this ValueError itself
            raise ValueError(
                "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (FLA's rule); cute_kda does not "
                "implement allow_neg_eigval=True with either beta flag: pass allow_neg_eigval=False"
            )
        raise NotImplementedError(
            "allow_neg_eigval=True (beta = 2·sigmoid(logits)) is not supported; pass allow_neg_eigval=False"
        )


def _refuse_unsupported_fla_flags(
    *, allow_neg_eigval: bool, use_beta_sigmoid_in_kernel: bool, return_intermediate_states: bool,
    cp_context: Any, use_graph: bool,
) -> None:
    refuse_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if return_intermediate_states:
        raise NotImplementedError("return_intermediate_states=True is not supported (no chunk states are kept)")
    if cp_context is not None:
        raise NotImplementedError("cp_context (context parallelism) is not supported")
    if use_graph:
        raise NotImplementedError(
            "use_graph=True (padded cu_seqlens for graph capture) is not supported; "
            "the kernels need no host sync, call with the real cu_seqlens"
        )


def _fla_gate(use_gate_in_kernel: bool, safe_gate: bool, lower_bound: float | None) -> tuple[str, float]:
    """(``gate``, ``lower_bound``) of :func:`kda_forward` for FLA's gate flags."""
    if not use_gate_in_kernel:
        return "none", -5.0  # g is the log decay; lower_bound plays no part
    if lower_bound is None:
        if safe_gate:
            raise ValueError("lower_bound must be specified when safe_gate=True and use_gate_in_kernel=True")
        return "softplus", -5.0
    value = validation.check_real("lower_bound", lower_bound)
    if not validation.LOWER_BOUND_MIN <= value < validation.LOWER_BOUND_MAX:
        if safe_gate:
            raise ValueError(f"lower_bound must be in the safe range [-5, 0), got {value}")
        raise NotImplementedError(f"lower_bound = {value} is not supported; the kernels need lower_bound in [-5, 0)")
    return "safe", value


def _fla_A_log(A_log: Any, heads: int, device: torch.device) -> torch.Tensor:
    """FLA's ``A_log`` (``[H]``-sized, any float dtype, or None) as fp32 ``[H]``."""
    if A_log is None:
        return torch.zeros(heads, dtype=torch.float32, device=device)
    validation.check_is_tensor("A_log", A_log)
    if A_log.dtype is torch.float32 and A_log.shape == (heads,) and A_log.is_contiguous():
        return A_log  # already what the kernels take (what the conversions below would return, for less host time)
    if A_log.numel() != heads:
        raise ValueError(f"A_log must hold H = {heads} values, got shape {list(A_log.shape)}")
    return A_log.reshape(heads).to(torch.float32).contiguous()


def _fla_dt_bias(dt_bias: Any, heads: int, key_dim: int, device: torch.device) -> torch.Tensor:
    """FLA's ``dt_bias`` (``[H*K]``, ``[H, K]`` or None) as fp32 ``[H, K]``."""
    if dt_bias is None:
        return torch.zeros(heads, key_dim, dtype=torch.float32, device=device)
    validation.check_is_tensor("dt_bias", dt_bias)
    if dt_bias.dtype is torch.float32 and dt_bias.shape == (heads, key_dim) and dt_bias.is_contiguous():
        return dt_bias
    if tuple(dt_bias.shape) not in ((heads * key_dim,), (heads, key_dim)):
        raise ValueError(f"dt_bias must have shape [H*K] = [{heads * key_dim}] or [H, K] = [{heads}, {key_dim}], "
                         f"got {list(dt_bias.shape)}")
    return dt_bias.reshape(heads, key_dim).to(torch.float32).contiguous()


def chunk_kda(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Any = None,
    cu_seqlens_cpu: Any = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Drop-in for ``fla.ops.kda.chunk_kda`` (fla-core 0.6.0 signature), forward and backward.

    Shapes as in FLA: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; keyword
    ``A_log`` ``[H]`` and ``dt_bias`` ``[H*K]`` or ``[H, K]``; ``initial_state`` fp32
    ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first=True`` or the deprecated
    ``transpose_state_layout=True``); ``cu_seqlens`` int32 or int64 ``[N+1]`` with B == 1. Returns
    (o bf16 ``[B, T, H, V]``, final state fp32 in the caller's layout or None).

    Supported: K = V = 128, bf16 q/k/v/beta; the gate as FLA has it: ``use_gate_in_kernel=True`` with
    ``lower_bound`` in [-5, 0) (the bounded gate) or without (the softplus gate of Kimi-Linear), both with
    a bf16 raw g, or ``use_gate_in_kernel=False`` (g the log decay, bf16 or fp32);
    ``use_qk_l2norm_in_kernel`` and ``use_beta_sigmoid_in_kernel`` on or off. Training runs with the
    bounded gate only for now (the others raise ``NotImplementedError`` when inputs require grad).
    Other combinations raise ``NotImplementedError`` naming the flag (see
    :func:`translate_fla_call`). FLA's default ``[N, H, K, V]`` state costs a transpose copy each way;
    ``state_v_first=True`` avoids it. Takes DLPack tensors like :func:`kda_forward` and answers in
    ``q``'s framework; ``torch.compile`` traces it into the translation and one ``cute_kda::forward``
    op (``cute_kda::forward_train`` and its backward when autograd records the call).

    Autograd as :func:`kda_forward`: q, k, v, g, beta, ``A_log``, ``dt_bias`` and ``initial_state``
    get gradients in their own shapes, dtypes and layouts (the translation's transposes, reshapes
    and casts are torch ops that autograd runs backwards); ``ht``'s gradient flows into the backward.
    ``disable_recompute`` keeps FLA's meaning: False (the default) keeps nothing beyond the inputs for
    the backward (``kda_forward``'s ``recompute=True``), True keeps the intermediates for a faster one.
    """
    if torch.compiler.is_compiling():
        return torch_ops.chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
            return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, use_graph=use_graph,
            max_num_seqs=max_num_seqs, **kwargs,
        )
    fla_flags = dict(
        scale=scale, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        disable_recompute=disable_recompute, return_intermediate_states=return_intermediate_states,
        state_v_first=state_v_first, cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs,
    )
    as_torch = interop.as_torch

    def run() -> tuple[torch.Tensor, torch.Tensor | None]:
        call = translate_fla_call(
            as_torch(q), as_torch(k), as_torch(v), as_torch(g), as_torch(beta), initial_state=as_torch(initial_state),
            cu_seqlens=as_torch(cu_seqlens), cu_seqlens_cpu=as_torch(cu_seqlens_cpu), **fla_flags,
            **{name: as_torch(value) for name, value in kwargs.items()},
        )
        # the translation's tensors are torch's and the compile check is done: straight to _forward
        return call.run(functools.partial(_forward, out=None, final_state=None, vsplit=None,
                                          recompute=call.recompute))

    return interop.answer_in_framework(q, run)


def warmup(
    *,
    device: Any = None,
    qk_l2norm: tuple[bool, ...] = (True,),
    beta_logits: tuple[bool, ...] = (True,),
    varlen: tuple[bool, ...] = (False, True),
    state_modes: tuple[torch.dtype | None, ...] = STATE_MODES,
    vsplits: tuple[int, ...] | None = None,
    gates: tuple[str, ...] = ("safe",),
    gated_delta_rule: bool = False,
    training: bool = False,
    segments: bool = True,
) -> int:
    """Compile, ahead of time and without running anything, every variant the flags select.

    Variants already in the disk cache (``$CUTE_KDA_CACHE_DIR``, default ``~/.cache/cute_kda``) are
    loaded instead of compiled, and the ones compiled here are saved there, so a later process
    starts warm.

    Each argument lists the values to cover: ``state_modes`` holds None (no state), bf16 and/or
    fp32 (used for both the initial and the final state); ``vsplits`` None covers every supported
    V-split; ``gates`` the K1 gate forms (``"none"`` for both g dtypes, bf16 and fp32);
    ``gated_delta_rule`` also the K1 variants of :func:`cute_kda.chunk_gated_delta_rule` (a per-head gate
    with grouped value heads, for each unbounded gate in ``gates``). ``training`` also compiles what a training
    step adds: K2 with checkpoints, Kernel A (every V-split in ``vsplits``; dht of the final state's dtype or none,
    dh0 of the initial state's dtype or none) and Kernel B for each gate (per head too with
    ``gated_delta_rule``). ``segments`` also compiles what a call split into segments runs (context parallelism,
    :mod:`cute_kda.context_parallel`; V-split 1): K2 on packed segments with fp32 states in and out, and with
    ``training`` its checkpoint variant and Kernel A's two passes. ``device`` (default: the current CUDA device) is
    where the compiled
    code will run. Returns the number of (K1, K2) configurations visited (each with every gate);
    already-compiled ones cost nothing.
    """
    from .ops import bwd_grads as kb
    from .ops import bwd_scan as ka
    from .ops import prepare as k1
    from .ops import recurrence as k2

    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"warmup compiles for a CUDA device, got device={device}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "warmup() needs a CUDA device (it compiles for the device that will run the kernels) and torch "
            "sees none here; on a CPU, examples/demo.py and the compile tier of `make test` compile the "
            "kernels for sm_90a without running them"
        )
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    configs = list(enumerate_configs(
        qk_l2norm=qk_l2norm, beta_logits=beta_logits, varlen=varlen, state_modes=state_modes,
        vsplits=validation.SUPPORTED_VSPLITS if vsplits is None else vsplits,
    ))
    for gate in gates:
        validation.check_gate(gate)
    k1_gates = [(gate, dtype, False) for gate in gates
                for dtype in ((torch.bfloat16, torch.float32) if gate == "none" else (torch.bfloat16,))]
    if gated_delta_rule:
        k1_gates += [(gate, dtype, True) for gate, dtype, _ in k1_gates if gate != "safe"]
    for config in configs:
        for gate, g_dtype, gdn in k1_gates:
            k1.compile_prepare(qk_l2norm=config.qk_l2norm, beta_logits=config.beta_logits, varlen=config.varlen,
                               device=device, gate=gate, g_dtype=g_dtype, per_head_gate=gdn, grouped=gdn)
        k2.compile_recurrence(
            varlen=config.varlen, initial_state=config.initial_state, final_state=config.final_state,
            vsplit=config.vsplit, device=device,
        )
        if training:
            k2.compile_recurrence(
                varlen=config.varlen, initial_state=config.initial_state, final_state=config.final_state,
                vsplit=config.vsplit, device=device, checkpoints=True,
            )
    if training:  # Kernel A picks its own V-split (8 as well); Kernel B has no state flags
        scan_vsplits = ka.SCAN_VSPLITS if vsplits is None else tuple(v for v in vsplits if v in ka.SCAN_VSPLITS)
        scans = {(vsplit, dht, config.initial_state, config.varlen) for config in configs for vsplit in scan_vsplits
                 for dht in (config.final_state, None)}
        for vsplit, dht, dh0, varlen_scan in sorted(scans, key=repr):
            ka.compile_bwd_scan(vsplit=vsplit, dht=dht, dh0=dh0, varlen=varlen_scan, device=device)
        grads = {(config.varlen, config.qk_l2norm, config.beta_logits, gate, g_dtype, gdn) for config in configs
                 for gate, g_dtype, gdn in k1_gates}
        for varlen_grads, qk_l2norm_grads, beta_logits_grads, gate, g_dtype, gdn in sorted(grads, key=repr):
            kb.compile_bwd_grads(varlen=varlen_grads, qk_l2norm=qk_l2norm_grads, beta_logits=beta_logits_grads,
                                 device=device, gate=gate, g_dtype=g_dtype, per_head_gate=gdn, grouped=gdn)
    if segments:
        _warm_segments(device, training)
    return len(configs)


def _warm_segments(device: torch.device, training: bool) -> None:
    """The K2 and Kernel A variants of a segmented call (:func:`cute_kda.autograd.packed`): varlen, V-split 1 (the
    heuristic's; ``N · H · segments`` chains fill the SMs once), fp32 states."""
    from .ops import bwd_scan as ka
    from .ops import recurrence as k2

    fp32 = torch.float32
    passes = [(None, fp32), (fp32, fp32), (fp32, None)]  # the local pass, the transition / real pass, no final state
    for initial, final in passes:
        k2.compile_recurrence(varlen=True, initial_state=initial, final_state=final, vsplit=1, device=device)
    if training:
        for final in (fp32, None):
            k2.compile_recurrence(varlen=True, initial_state=fp32, final_state=final, vsplit=1, device=device,
                                  checkpoints=True)
        ka.compile_bwd_scan(vsplit=1, dht=None, dh0=fp32, varlen=True, device=device, token_outputs=False)
        for dh0 in (fp32, None):
            ka.compile_bwd_scan(vsplit=1, dht=fp32, dh0=dh0, varlen=True, device=device)
