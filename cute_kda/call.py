"""One resolved call: every entry point's arguments turned, once, into what the executors run.

:func:`resolve` takes the arguments of :func:`cute_kda.kda_forward` (which :func:`cute_kda.chunk_kda` and
:func:`cute_kda.chunk_gated_delta_rule` translate into), checks them (:mod:`cute_kda.validation`) and derives
everything the kernels need exactly here: the problem's shape (at head dims other than 128, the padded / split call's:
"Head dims" below), the default scale, the final state's dtype,
``cu_seqlens`` as the kernels read it (int64 on the device), the context-parallel segmentation, and whether autograd
records the call. The result is a :class:`Call`; the inference executor (:mod:`cute_kda.executors.inference`) and
the training executor (:mod:`cute_kda.executors.training`) consume it. The custom ops that ``torch.compile`` traces
rebuild their :class:`Options` with :func:`options_of`, the same function :func:`resolve` uses, so a default or a
derived value has one definition.

Head dims other than the kernels' K = V = 128 are computed exactly on the 128 kernels (docs/numerics.md, "Other head
dims"), except a call at K = V = 64, which every kernel compiles for (:func:`runs_native`; training there behind
:data:`NATIVE_TRAINING`). A call
with K < 128 and / or V < 128 runs zero-padded: q, k (and a per-channel gate g, ``dt_bias``) get zero channels up to
K = 128, v zero columns up to V = 128, the initial state both. The padded rows and columns of the state stay zero
under every gate and the delta update, so the caller's part of every output and gradient is the unpadded call's. A
call with V a multiple of 128 (GatedDeltaNet's ``expand_v = 2``: K = 128, V = 256) runs each value head as V / 128
value heads of 128 columns: the columns of the state never mix, so the heads are independent; g, β, ``A_log`` and
``dt_bias`` are repeated per split head (autograd sums the repeats' gradients). Split head ``j · s + r`` (s = V / 128)
holds columns ``[128 r, 128 r + 128)`` of value head ``j``, so with grouped value heads it still reads q/k head
``j // (HV / H)``. A training call with the safe gate (whose backward takes no grouped value heads) gets q and k
repeated the same way instead. All of it is torch ops on the caller's stream (no host sync), recorded by autograd:
:func:`kernel_call` before :func:`resolve` resolves the 128 call, :meth:`CallerDims.restore` on its results. K > 128
and V > 128 not a multiple of 128 are refused (:func:`cute_kda.validation.check_padded_head_dim`), so FLA's backend
computes them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import validation
from .context_parallel import Segmentation, segmentation_of
from .numerics import HEAD_DIM, NATIVE_HEAD_DIMS
from .validation import ProblemShape

INPUT_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


class Inputs(NamedTuple):
    """The validated tensors of one call.

    q, k bf16 ``[B, T, H, K]``; v bf16 ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads); g
    ``[B, T, HV, K]`` (or ``[B, T, HV]``, a per-head gate); beta bf16 ``[B, T, HV]``; A_log fp32 ``[HV]``; dt_bias
    fp32 ``[HV, K]`` (``[HV]`` per head; both None for the log decay, gate "none"); initial_state None or bf16 / fp32
    ``[N, HV, V, K]``; cu_seqlens None or int64 ``[N+1]`` on q's device
    (:func:`~cute_kda.validation.staged_cu_seqlens`); tile_base None or
    int32 ``[N+1]`` when known (a segmented call's, or the training forward's saved one). A prefill on a state pool
    (inference only): ``initial_state`` is the pool ``[slots, HV, V, K]``, ``state_indices`` int32 ``[N]`` its slot per
    sequence (−1: a padding row), ``checkpoint_indices`` None or int32 ``[N, M]`` the slots of the prefix
    checkpoints (:func:`cute_kda.kda_forward`).
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
    tile_base: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    checkpoint_indices: torch.Tensor | None = None


class Options(NamedTuple):
    """The non-tensor arguments of one call, resolved: ``scale`` a float, ``final_state_dtype`` None for no final
    state, ``vsplit`` None for K2's heuristic, ``segmentation`` None for an unsplit call, ``checkpoint_every`` the
    tokens between a pool call's prefix checkpoints (0: none)."""

    problem: ProblemShape
    scale: float
    lower_bound: float
    qk_l2norm: bool
    beta_logits: bool
    final_state_dtype: torch.dtype | None
    vsplit: int | None
    recompute: bool = False
    gate: str = "safe"
    segmentation: Segmentation | None = None
    checkpoint_every: int = 0


class Call(NamedTuple):
    """A resolved :func:`cute_kda.kda_forward` call: its tensors, its options, the caller's output buffers (None:
    allocate) and whether autograd records it (``training``). ``caller_dims``: None when the caller's head dims are the
    kernels' (K = V = 128); else the call is the padded / split K = V = 128 call (module docstring), and
    whoever runs it hands its results through :meth:`CallerDims.restore` (:func:`finish`)."""

    inputs: Inputs
    options: Options
    out: torch.Tensor | None
    final_state: torch.Tensor | None
    training: bool
    caller_dims: CallerDims | None = None


def finish(call: Call, results: tuple) -> tuple:
    """The results of running ``call`` (o, final state, and FLA's chunk states when kept) at the caller's head
    dims."""
    return results if call.caller_dims is None else call.caller_dims.restore(*results)


def final_state_dtype_of(initial_state: torch.Tensor | None, final_state: torch.Tensor | None,
                         output_final_state: bool) -> torch.dtype | None:
    """The final state's dtype: the caller's buffer's, else (when asked for) the initial state's, fp32 without one;
    None: no final state."""
    if final_state is not None:
        return final_state.dtype
    if not output_final_state:
        return None
    return torch.float32 if initial_state is None else initial_state.dtype


def options_of(problem: ProblemShape, device: torch.device, scale: float | None, lower_bound: float,
               qk_l2norm: bool, beta_logits: bool, final_state_dtype: torch.dtype | None, vsplit: int | None,
               recompute: bool, gate: str, segments: int | None) -> Options:
    """The :class:`Options` of a call of shape ``problem`` on ``device`` with checked arguments: the default scale
    ``K ** -0.5``, the segmentation of :func:`cute_kda.context_parallel.segmentation_of`. Kept per distinct
    arguments (a steady caller repeats them: one dictionary look-up instead of the build and the heuristic). Positional
    or keyword: :func:`resolve` passes them by position (eleven keywords cost a call's host path 0.3 µs)."""
    key = (problem, device, scale, lower_bound, qk_l2norm, beta_logits, final_state_dtype, vsplit, recompute, gate,
           segments)
    try:  # before the sizes are checked: a kept key holds plain ints, and a trace's symbolic size does not hash
        return _OPTIONS[key]
    except (KeyError, TypeError):  # TypeError: an unhashable argument, built every time
        pass
    options = _build_options(problem, device, scale, lower_bound, qk_l2norm, beta_logits, final_state_dtype, vsplit,
                             recompute, gate, segments)
    if not problem.concrete:  # a trace's symbolic sizes (the custom ops' fakes): built, never kept
        return options
    if len(_OPTIONS) >= _OPTIONS_LIMIT:
        _OPTIONS.clear()
    try:
        _OPTIONS[key] = options
    except TypeError:
        pass
    return options


_OPTIONS: dict[tuple, Options] = {}
_OPTIONS_LIMIT = 1024


def scale_of(key_dim: int, scale: float | None) -> float:
    """A call's scale: ``scale``, or by default ``K ** -0.5`` of the caller's K (``key_dim``; a padded call's too)."""
    return float(key_dim ** -0.5 if scale is None else scale)


def _build_options(problem: ProblemShape, device: torch.device, scale: float | None, lower_bound: float,
                   qk_l2norm: bool, beta_logits: bool, final_state_dtype: torch.dtype | None, vsplit: int | None,
                   recompute: bool, gate: str, segments: int | None) -> Options:
    return Options(  # positionally: a call's host path builds one (keywords cost a µs more)
        problem, scale_of(problem.head_dim, scale), float(lower_bound), bool(qk_l2norm),
        bool(beta_logits), final_state_dtype, vsplit, bool(recompute), gate,
        segmentation_of(problem, device, segments, vsplit),
    )


def resolve(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None = None, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, out: torch.Tensor | None = None, final_state: torch.Tensor | None = None,
    vsplit: int | None = None, qk_l2norm: bool = True, beta_logits: bool = True, recompute: bool = False,
    gate: str = "safe", segments: int | None = None, training: bool | None = None,
    final_state_dtype: torch.dtype | None = None, state_indices: torch.Tensor | None = None,
    checkpoint_every: int | None = None, checkpoint_indices: torch.Tensor | None = None,
) -> Call:
    """Check the arguments of :func:`cute_kda.kda_forward` (torch tensors; its docstring is the contract) and
    resolve them into a :class:`Call`. β in fp16 / fp32 and ``A_log``, ``dt_bias`` in bf16 / fp16 enter converted
    (:func:`~cute_kda.validation.cast_beta`, :func:`~cute_kda.validation.cast_gate_parameters`; autograd records the
    casts, so their gradients come back in the caller's dtypes). ``training`` None: autograd records the call when grad mode is on and an
    input requires grad (:func:`~cute_kda.validation.needs_autograd`); True / False forces the path (the training
    executor's own entry, the custom ops). ``final_state_dtype`` (the inference op's, which takes no buffer): a final
    state of that dtype; None: :func:`final_state_dtype_of`'s. A training call is refused here when the backward does
    not cover it, when caller buffers are given, or when a tensor is too large for Kernel B's offsets. Reads no device
    memory.

    Head dims other than the kernels' K = V = 128 are checked at the caller's size; a call at K = V = 64 (inference, and
    training under :data:`NATIVE_TRAINING`) then runs on the kernels compiled for 64 (:func:`runs_native`), any other
    as the padded / split 128 call (:func:`kernel_call`, torch ops autograd records; the default scale
    is the caller's ``K ** -0.5``) with the caller's buffers and dims in ``caller_dims``: its runner hands the results
    through :func:`finish`. Refused there: a pool call.

    A pool call (``state_indices`` given) checks the pool and slot arguments
    (:func:`~cute_kda.validation.check_prefill_pool_call`), is never split into segments and never trains."""
    pool = state_indices is not None
    pool_arguments = pool or checkpoint_indices is not None or checkpoint_every is not None  # checked below
    shown_initial, shown_final = (None, None) if pool_arguments else (initial_state, final_state)
    problem = validation.plain_forward(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, shown_initial,
                                       shown_final, out, cu_seqlens, vsplit, gate)  # the common call, in one pass
    if problem is None:  # β, A_log, dt_bias in other float dtypes are converted here, off the common call's path
        beta, (A_log, dt_bias) = validation.cast_beta(beta), validation.cast_gate_parameters(A_log, dt_bias)
        problem = validation.validate_forward(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
            initial_state=shown_initial, final_state=shown_final, out=out, cu_seqlens=cu_seqlens, vsplit=vsplit,
            gate=gate,
        )
        key_dim, value_dim = q.shape[-1], v.shape[-1]
        if pool_arguments and (key_dim, value_dim) != (HEAD_DIM, HEAD_DIM):
            raise NotImplementedError(
                f"state_indices (a prefill on a state pool) needs K = V = {HEAD_DIM}, got K = {key_dim}, V = "
                f"{value_dim}: other head dims run on other kernels, and the pool is the engine's to lay out")
        if training is None:
            training = validation.needs_autograd(q, k, v, g, beta, A_log, dt_bias, initial_state)
        padded = kernel_call(q, k, v, g, beta, A_log, dt_bias, initial_state, training=bool(training), gate=gate,
                             out=out, final_state=final_state)
        if padded is not None:  # checked at the caller's head dims: resolved as the padded / split 128 call
            tensors, caller_dims = padded
            if training:
                validation.check_no_buffers_under_autograd(out=out, final_state=final_state)
            if final_state_dtype is None:
                final_state_dtype = final_state_dtype_of(initial_state, final_state, output_final_state)
            call = resolve(*tensors[:5], scale=scale_of(key_dim, scale), A_log=tensors[5],
                           dt_bias=tensors[6], lower_bound=lower_bound, initial_state=tensors[7],
                           cu_seqlens=cu_seqlens, vsplit=vsplit, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
                           recompute=recompute, gate=gate, segments=segments, training=training,
                           final_state_dtype=final_state_dtype)
            return call._replace(caller_dims=caller_dims)
    every = None
    if pool_arguments:
        every = validation.check_prefill_pool_call(
            problem, q.device, initial_state=initial_state, state_indices=state_indices,
            checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices, final_state=final_state)
    if training is None:
        training = validation.needs_autograd(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if pool:
        _check_pool_inference(bool(training), segments)
        segments, final_state = 1, initial_state  # the final states go into the pool's slots
    if training:
        validation.check_trainable(gate, q, v)
        validation.check_no_buffers_under_autograd(out=out, final_state=final_state)
        validation.check_training_size(v, "v")  # v, dq and dk per value head: the largest per-token tensors
    if final_state_dtype is None:
        final_state_dtype = final_state_dtype_of(initial_state, final_state, output_final_state)
    inputs = tuple.__new__(Inputs, (  # every field, in order: NamedTuple's own __new__ costs 0.13 µs more
        q, k, v, g, beta, A_log, dt_bias, initial_state,
        None if cu_seqlens is None else validation.staged_cu_seqlens(cu_seqlens, q), None, state_indices,
        checkpoint_indices if pool else None))
    options = options_of(problem, q.device, scale, lower_bound, qk_l2norm, beta_logits, final_state_dtype, vsplit,
                         recompute, gate, segments)
    if every:
        options = options._replace(checkpoint_every=every)
    return tuple.__new__(Call, (inputs, options, out, final_state, bool(training), None))  # as Inputs


def _check_pool_inference(training: bool, segments: int | None) -> None:
    """A prefill on a state pool runs in the inference executor, unsplit: refuse autograd and segments >= 2."""
    if training:
        raise NotImplementedError(
            "state_indices (a prefill on a state pool) is inference only: run the call under torch.no_grad() / "
            "torch.inference_mode(), or detach its inputs")
    if segments is not None and segments != 1:
        raise NotImplementedError(
            f"segments={segments!r} (context parallelism) does not apply to a prefill on a state pool "
            "(state_indices): pass segments=None or 1")


# ---------------------------------------------------------------------------------------------
# head dims other than the kernels' (module docstring, "Head dims")

# the padded channels' gate input: a raw gate of 0 with a dt_bias of 1 (or a log decay of 0) gives every gate form a
# finite decay there, lower_bound · sigmoid(e^A_log) or −e^A_log · softplus(1), and no 0 · inf for any finite A_log
PAD_GATE, PAD_DT_BIAS = 0.0, 1.0


class HeadDims(NamedTuple):
    """The caller's ``key_dim`` K and ``value_dim`` V; ``splits`` the kernels' value heads per caller value head
    (V / 128 rounded up)."""

    key_dim: int
    value_dim: int
    splits: int

    @property
    def padded_value_dim(self) -> int:
        return self.splits * HEAD_DIM


def head_dims_of(q: torch.Tensor, v: torch.Tensor) -> HeadDims | None:
    """The :class:`HeadDims` of q ``[B, T, H, K]`` and v ``[B, T, HV, V]`` (sizes checked by
    :func:`cute_kda.validation.check_padded_head_dim`), or None when they are the kernels' own (K = V = 128)."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    if key_dim == HEAD_DIM and value_dim == HEAD_DIM:
        return None
    return HeadDims(key_dim, value_dim, max(1, -(-value_dim // HEAD_DIM)))


# Whether a training call at K = V = 64 runs on the backward kernels compiled for 64 (Kernel A, Kernel B; the GPU tier
# passes them against their mirrors and the fp64 gold; docs/perf-log.md, P3: the step at B1 T8192 H96 3.27 ms on the
# H200 against 5.57 at D = 128, which the padded call runs plus its copies). Off, it runs padded to 128 (exact);
# ``bench_train.py --head-dim 64 --padded-training`` is the A/B.
NATIVE_TRAINING = True


def runs_native(dims: HeadDims, training: bool) -> bool:
    """Whether a call at the caller's ``dims`` runs on kernels compiled for them, unpadded: K = V, one of
    :data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`, and for a training call :data:`NATIVE_TRAINING` (every kernel, K1,
    K2, Kernel A, Kernel B, each gate scheme, takes the head dim in its variant)."""
    return (NATIVE_TRAINING or not training) and dims.key_dim == dims.value_dim and dims.key_dim in NATIVE_HEAD_DIMS


def _pad_last(x: torch.Tensor, size: int, value: float = 0.0) -> torch.Tensor:
    """``x`` with its last mode padded with ``value`` from ``x.shape[-1]`` to ``size`` (``x`` itself when equal)."""
    missing = size - x.shape[-1]
    return x if missing == 0 else F.pad(x, (0, missing), value=value)


def _repeat_heads(x: torch.Tensor | None, splits: int, dim: int) -> torch.Tensor | None:
    """Each head of mode ``dim`` repeated ``splits`` times in place (head ``j`` → ``j · s .. j · s + s − 1``)."""
    return x if x is None or splits == 1 else x.repeat_interleave(splits, dim=dim)


def to_kernel_dims(dims: HeadDims, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   initial_state: torch.Tensor | None, *, repeat_qk: bool) -> tuple:
    """(q, k, v, g, beta, A_log, dt_bias, initial_state) of the K = V = 128 call equal to the caller's (module
    docstring): q, k ``[B, T, H, 128]`` (``[B, T, H·s, 128]`` with ``repeat_qk``), v ``[B, T, HV·s, 128]``, a
    per-channel g ``[B, T, HV·s, 128]`` (a per-head one ``[B, T, HV·s]``), beta ``[B, T, HV·s]``, ``A_log``
    ``[HV·s]``, ``dt_bias`` ``[HV·s, 128]`` (or ``[HV·s]``), the v-first state ``[N, HV·s, 128, 128]``; new tensors
    or the caller's own where nothing changes. Shapes as :func:`cute_kda.validation.validate_forward` checks them."""
    s, kernel_v = dims.splits, dims.padded_value_dim
    q, k = _pad_last(q, HEAD_DIM), _pad_last(k, HEAD_DIM)
    if repeat_qk:
        q, k = _repeat_heads(q, s, 2), _repeat_heads(k, s, 2)
    v = _pad_last(v, kernel_v).unflatten(3, (s, HEAD_DIM)).flatten(2, 3)
    per_channel = g.dim() == 4
    g = _repeat_heads(_pad_last(g, HEAD_DIM, PAD_GATE) if per_channel else g, s, 2)
    if dt_bias is not None and per_channel:
        dt_bias = _pad_last(dt_bias, HEAD_DIM, PAD_DT_BIAS)
    if initial_state is not None:
        missing = (0, HEAD_DIM - dims.key_dim, 0, kernel_v - dims.value_dim)
        state = F.pad(initial_state, missing) if any(missing) else initial_state  # [N, HV, 128·s, 128]
        initial_state = state.unflatten(2, (s, HEAD_DIM)).flatten(1, 2).contiguous()  # a view when V only splits
    return (q, k, v.contiguous(), g.contiguous(), _repeat_heads(beta, s, 2), _repeat_heads(A_log, s, 0),
            _repeat_heads(dt_bias, s, 0), initial_state)


def kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None, *,
                training: bool, gate: str, out: torch.Tensor | None,
                final_state: torch.Tensor | None) -> tuple[tuple, CallerDims] | None:
    """None when a call (checked at the caller's head dims) runs at them: K = V = 128, or natively
    (:func:`runs_native`); else the tensors of the padded / split K = V = 128 call (:func:`to_kernel_dims`; q and k
    repeated per split head for a training call with the safe gate, whose backward takes no grouped value heads)
    and how its results go back to the caller and its buffers (:class:`CallerDims`)."""
    dims = head_dims_of(q, v)
    if dims is None or runs_native(dims, training):
        return None
    tensors = to_kernel_dims(dims, q, k, v, g, beta, A_log, dt_bias, initial_state,
                             repeat_qk=training and gate == "safe")
    return tensors, CallerDims(dims, out, final_state)


class CallerDims(NamedTuple):
    """How the results of a call run at K = V = 128 go back to the caller (:attr:`cute_kda.call.Call.caller_dims`):
    its :class:`HeadDims` and its output buffers (the 128 call writes its own and :meth:`restore` copies)."""

    dims: HeadDims
    out: torch.Tensor | None
    final_state: torch.Tensor | None

    def restore(self, o: torch.Tensor, state: torch.Tensor | None, *chunk_states: torch.Tensor) -> tuple:
        """(o ``[B, T, HV, V]``, final state ``[N, HV, V, K]`` or None, and FLA's chunk states ``[B, NT, HV, K, V]``
        when given) of the 128 call's results, contiguous, or the caller's buffers filled with them."""
        o, state = output_to_caller_dims(self.dims, o), state_to_caller_dims(self.dims, state)
        if self.out is not None:
            o = self.out.copy_(o)
        if self.final_state is not None:
            state = self.final_state.copy_(state)
        return (o, state, *(chunk_states_to_caller_dims(self.dims, h) for h in chunk_states))


def output_to_caller_dims(dims: HeadDims, o: torch.Tensor) -> torch.Tensor:
    """o ``[B, T, HV·s, 128]`` → ``[B, T, HV, V]``."""
    o = o.unflatten(2, (-1, dims.splits)).flatten(3, 4)
    return o if o.shape[-1] == dims.value_dim else o[..., :dims.value_dim].contiguous()


def state_to_caller_dims(dims: HeadDims, state: torch.Tensor | None) -> torch.Tensor | None:
    """A v-first state ``[N, HV·s, 128, 128]`` → ``[N, HV, V, K]``."""
    if state is None:
        return None
    state = state.unflatten(1, (-1, dims.splits)).flatten(2, 3)
    return state[..., :dims.value_dim, :dims.key_dim].contiguous()


def chunk_states_to_caller_dims(dims: HeadDims, h: torch.Tensor) -> torch.Tensor:
    """FLA's chunk states ``[B, NT, HV·s, 128, 128]`` (K-first) → ``[B, NT, HV, K, V]``."""
    h = h.unflatten(2, (-1, dims.splits)).movedim(3, 4).flatten(4, 5)
    return h[..., :dims.key_dim, :dims.value_dim].contiguous()
