"""Public entry points: :func:`kda_forward`, :func:`chunk_kda` (FLA's KDA drop-in), :func:`chunk_gated_delta_rule`
(FLA's GatedDeltaNet drop-in) and :func:`warmup`.

Path of a call: DLPack → torch views (:mod:`.interop`) → one resolved call (:func:`cute_kda.call.resolve`: checks,
defaults, variant-independent derivations) → the inference executor (:mod:`.executors.inference`) or, for a call
autograd records, the training executor (:mod:`.executors.training`) → results back in the caller's framework.
Nothing on this path synchronises the host with the device (see :mod:`.validation` for the one opt-in exception).
FLA's two entry points translate their arguments first (:mod:`.fla_calls`). Under ``torch.compile`` a call is one
custom op (the inference op, or the training op and its backward), with the same resolution inside.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import TYPE_CHECKING, Any

import torch

from . import interop, validation
from .interop import DLPackTensor
from .call import Call, final_state_dtype_of, finish, kernel_call, resolve, scale_of
from .context_parallel import check_segments
from .executors import inference, stages, training
from .executors.stages import KERNELS
from .fla_calls import translate_fla_call, translate_fla_gdn_call
from .variants import (
    CombineVariant, GradsVariant, PrepareVariant, RecurrenceVariant, RoundVariant, ScanVariant, pair_prefill,
)

if TYPE_CHECKING:
    from .fla_calls import CanonicalCall

STATE_MODES = (None, torch.bfloat16, torch.float32)  # no state, bf16 state, fp32 state


def kda_forward(
    q: DLPackTensor,
    k: DLPackTensor,
    v: DLPackTensor,
    g: DLPackTensor,
    beta: DLPackTensor,
    *,
    scale: float | None = None,
    A_log: DLPackTensor | None = None,
    dt_bias: DLPackTensor | None = None,
    lower_bound: float = -5.0,
    initial_state: DLPackTensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: DLPackTensor | None = None,
    out: DLPackTensor | None = None,
    final_state: DLPackTensor | None = None,
    vsplit: int | None = None,
    qk_l2norm: bool = True,
    beta_logits: bool = True,
    recompute: bool = False,
    gate: str = "safe",
    segments: int | None = None,
    state_indices: DLPackTensor | None = None,
    checkpoint_every: int | None = None,
    checkpoint_indices: DLPackTensor | None = None,
) -> tuple[DLPackTensor, DLPackTensor | None]:
    """KDA forward (docs/design.md §1) with the in-kernel gate, on a Hopper GPU.

    Inputs (any DLPack tensors on one CUDA device, contiguous, 16-byte aligned):
      q, k   bf16 ``[B, T, H, K]``; l2-normalised per token inside when ``qk_l2norm``. fp16 q, k, v, a raw g
             and ``out`` (all of them: a mix is refused) run the forward kernels on fp16 (widened on load, o
             in fp16; they train, gradients in fp16: docs/numerics.md, "fp16 inputs", "fp16 training").
      v      bf16 ``[B, T, H, V]`` (q's dtype).
      g      ``[B, T, H, K]``, the gate; the per-channel log decay it gives depends on ``gate``:
               ``"safe"`` (default)  raw gate (q's dtype), ``lower_bound · sigmoid(exp(A_log[h]) · (g + dt_bias[h]))``;
               ``"softplus"``  raw gate in q's dtype, ``−exp(A_log[h]) · softplus(g + dt_bias[h])`` (Kimi-Linear's
                          gate, unbounded below);
               ``"none"``  q's dtype or fp32, the log decay itself (any value ≤ 0; −1000 masks a channel).
      beta   bf16 ``[B, T, H]``: logits (``beta_logits=True``, sigmoid inside) or β itself; fp16 or fp32 is
             rounded to bf16 on entry (one small cast on the stream; docs/numerics.md, "fp16 inputs").
      A_log  fp32 ``[H]``;  dt_bias fp32 ``[H, K]`` (gates "safe" and "softplus"; None with "none"); bf16 or
             fp16 ones are widened to fp32 on entry (exact).
      lower_bound in [-5, 0) (gate "safe" only).
      scale  Python float, default ``K ** -0.5``.
      cu_seqlens  int32 or int64 ``[N+1]``, optional: N packed sequences (then B == 1); int32 is widened
             to int64 on the device (one small kernel, no sync). On the GPU it is
             trusted (its length gives N; set ``CUTE_KDA_DEBUG_CHECKS=1`` to check its values, a
             sync); on the CPU its values are checked and it is copied over asynchronously.
      initial_state  bf16 or fp32 ``[N, H, V, K]`` (v-first: ``state[n, h, v, k]``; fp16 too with fp16 inputs,
             not beside an fp32 final state), N = B without cu_seqlens; None means zero.
    Outputs:
      out    ``[B, T, H, V]`` in q's dtype; written into ``out`` when given.
      final_state  ``[N, H, V, K]``, written into ``final_state`` when given (then returned even
             without ``output_final_state``), else allocated when ``output_final_state`` with the
             dtype of ``initial_state`` (fp32 without one); None otherwise.
    Prefill on a state pool (serving; inference only): with ``state_indices`` int32 ``[N]``, ``initial_state`` is a
    pool ``[slots, H, V, K]`` (bf16 or fp32; a strided view of a larger cache is fine as long as each ``[V, K]``
    block is contiguous and the slot / head strides are multiples of 16 bytes): sequence n starts from
    ``pool[state_indices[n]]`` and its final state is written back into that slot in place (K2 loads and stores it
    there; the returned final state is the pool itself, whatever ``output_final_state`` says; ``final_state=`` may
    only be the pool). ``state_indices[n] = -1`` marks a padding row: nothing of the pool is read or written for it,
    it starts from a zero state, and its ``out`` rows are that zero-state prefill's outputs (finite; engines ignore
    them). Prefix checkpoints (prefix caching): ``checkpoint_every`` = C tokens (a positive multiple of 64) and
    ``checkpoint_indices`` int32 ``[N, M]``: the state after ``(j + 1)·C`` tokens of sequence n (counted from its
    start in this call) goes into pool slot ``checkpoint_indices[n, j]``, in the pool's dtype (−1, or a j past the
    sequence's last full C-block, writes nothing); it equals the final state of the same prefill stopped there.
    Slot ids are not read on the host; ``CUTE_KDA_DEBUG_CHECKS=1`` checks that they lie in [−1, slots) and that no
    slot appears twice across ``state_indices`` and ``checkpoint_indices`` (a sync). Pool calls are never split into
    segments and are not traced by ``torch.compile`` (``NotImplementedError``).
    Head dims: the kernels' K = V = 128, and K = V = 64 without autograd (the forward kernels compiled for 64);
    other K ≤ 128 and V ≤ 128 (and 64 under autograd) run zero-padded to 128, V a multiple of 128 as V / 128
    value heads of 128 (:mod:`cute_kda.call`: exact, forward and backward; the default scale is the caller's
    ``K ** -0.5``; not for a pool call). K > 128, V > 128 not a multiple of 128, and q, k, v or a raw gate in fp32,
    bf16 and fp16 mixed, or an fp16 state with bf16 inputs, raise ``NotImplementedError``
    naming the argument and size
    (:class:`cute_kda.validation.UnsupportedDtypeError` for a dtype, also a ``TypeError``). ``vsplit`` (1, 2, 4 or
    None = heuristic): K2 CTAs per (sequence, head). ``segments``
    (context parallelism, :mod:`cute_kda.context_parallel`): None lets a fixed-length call with few (sequence,
    head) pairs and long sequences cut each sequence into segments of whole tiles that the serial scans run side
    by side (the forward's K2 then runs three passes, the backward's Kernel A two; results differ from the unsplit
    chain by rounding); 1 never splits; an int ≥ 2 asks for that many segments per sequence. Varlen calls are
    never split, calls that fix ``vsplit`` only when ``segments`` asks. The unbounded gates
    ("softplus", "none") run K1's overflow-free form (docs/numerics.md, "Unbounded gates"); K2 is the same.

    Runs on the caller's current stream (torch's, or CuPy's for CuPy arrays) without host
    synchronisation; returns arrays of ``q``'s framework (torch, CuPy, JAX; torch otherwise). With a torch ``q``
    every array argument is a torch tensor (one framework a call).

    Autograd: under grad mode, when any of q, k, v, g, beta, A_log, dt_bias, initial_state requires
    grad, the call is recorded (:mod:`cute_kda.executors.training`) and ``backward`` gives each of those that
    requires grad its gradient (in its dtype; dh0 ``[N, H, V, K]``), the final state's gradient flowing
    in when the final state is used. Not on that path: ``out=`` / ``final_state=`` buffers, double
    backward and grouped value heads (HV > H) with the safe gate (``NotImplementedError``); every gate trains.
    Under ``torch.no_grad()`` / ``torch.inference_mode()`` nothing
    is recorded or saved. ``recompute`` (training only): the forward keeps nothing beyond its inputs and
    the backward runs K1 and K2 again first (bit-identical gradients; at B1 T8192 H96 2.3 GB less held
    per call for 1 ms more per step, 7.22 against 6.19 ms); False keeps K1's workspace and the per-tile
    states. Ignored by calls that autograd does not record.
    Under ``torch.compile`` the call is one custom op, ``torch.ops.cute_kda.forward``, or for a
    recorded call ``torch.ops.cute_kda.forward_train`` with its backward op (:mod:`cute_kda.executors`);
    eager calls do not go through the dispatcher.
    """
    compiling = torch.compiler.is_compiling()
    if not compiling and (isinstance(q, torch.Tensor) or not hasattr(q, "__dlpack__")):
        # torch in, torch out, on torch's current stream (q that is no array at all: resolve names it)
        return run(resolve(  # the arguments by name, not through a dict: 0.2 µs of a small call's host path
            q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, out=out,
            final_state=final_state, vsplit=vsplit, qk_l2norm=qk_l2norm, beta_logits=beta_logits, recompute=recompute,
            gate=gate, segments=segments, state_indices=state_indices, checkpoint_every=checkpoint_every,
            checkpoint_indices=checkpoint_indices))
    arguments = dict(scale=scale, lower_bound=lower_bound, output_final_state=output_final_state, vsplit=vsplit,
                     qk_l2norm=qk_l2norm, beta_logits=beta_logits, recompute=recompute, gate=gate, segments=segments)
    if state_indices is not None or checkpoint_indices is not None or checkpoint_every is not None:
        arguments.update(state_indices=state_indices, checkpoint_every=checkpoint_every,
                         checkpoint_indices=checkpoint_indices)
    if not compiling:
        # another framework's arrays: the same call on torch views of them, answered in q's framework
        as_torch = interop.as_torch
        for name in ("state_indices", "checkpoint_indices"):
            if name in arguments:
                arguments[name] = as_torch(arguments[name])
        return interop.answer_in_framework(q, lambda: kda_forward(
            *(as_torch(x) for x in (q, k, v, g, beta)), A_log=as_torch(A_log), dt_bias=as_torch(dt_bias),
            initial_state=as_torch(initial_state), cu_seqlens=as_torch(cu_seqlens), out=as_torch(out),
            final_state=as_torch(final_state), **arguments))
    return _traced(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,  # one custom op
                   cu_seqlens=cu_seqlens, out=out, final_state=final_state, **arguments)


def run(call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A resolved call on its executor: training (autograd records it) or inference; at the caller's head dims."""
    result = training.train(KERNELS, call) if call.training else inference.run(call)
    return finish(call, result)


def _traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
            scale: float | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float,
            initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None,
            out: torch.Tensor | None, final_state: torch.Tensor | None, vsplit: int | None, qk_l2norm: bool,
            beta_logits: bool, recompute: bool = False, gate: str = "safe", segments: int | None = None,
            **pool: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kda_forward` as Dynamo traces it: the checks that need no memory, then one op (the training op when
    autograd records the call; it resolves the call itself when the graph runs). Caller buffers are filled by a copy
    of the op's result (inference only: a recorded call refuses them here, as eager does). Head dims other than the
    kernels' run as the padded / split 128 call's op (:mod:`cute_kda.call`; the padding and the restore are
    traced torch ops), but for a call at K = V = 64 (:func:`cute_kda.call.runs_native`). ``pool``: a
    prefill on a state pool, which no op covers yet (refused)."""
    if pool:
        raise NotImplementedError(f"{', '.join(sorted(pool))} (a prefill on a state pool) is not supported under "
                                  "torch.compile yet: call kda_forward eagerly (torch.compiler.disable)")
    beta, (A_log, dt_bias) = validation.cast_beta(beta), validation.cast_gate_parameters(A_log, dt_bias)  # as resolve
    training_call = validation.needs_autograd(q, k, v, g, beta, A_log, dt_bias, initial_state)
    validation.check_gate(gate)
    for name, x in (("q", q), ("v", v), ("g", g)):
        validation.check_is_tensor(name, x)
    if training_call:
        validation.check_no_buffers_under_autograd(out=out, final_state=final_state)
        validation.check_trainable(gate, q, v)
    if gate == "safe":
        validation.check_lower_bound(lower_bound)
    if scale is not None:
        validation.check_scale(scale)
    validation.check_vsplit(vsplit)
    check_segments(segments)
    state_dtype = final_state_dtype_of(initial_state, final_state, output_final_state)
    options = (float(lower_bound), vsplit, bool(qk_l2norm), bool(beta_logits), bool(recompute), gate, segments)
    validation.check_padded_head_dim("K (q.shape[-1])", q.shape[-1], split=False)
    validation.check_padded_head_dim("V (v.shape[-1])", v.shape[-1], split=True)
    padded = kernel_call(q, k, v, g, beta, A_log, dt_bias, initial_state, training=training_call, gate=gate,
                         out=out, final_state=final_state)
    if padded is None:
        return _traced_op(training_call, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
                          state_dtype, out, final_state, *options)
    # the padded / split 128 call (cute_kda.call): its op on new tensors, the results back at the caller's dims
    tensors, caller_dims = padded
    o, state = _traced_op(training_call, *tensors, cu_seqlens, scale_of(q.shape[-1], scale), state_dtype, None, None,
                          *options)
    return caller_dims.restore(o, state)


def _traced_op(training_call: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
               initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float | None,
               state_dtype: torch.dtype | None, out: torch.Tensor | None, final_state: torch.Tensor | None,
               lower_bound: float, vsplit: int | None, qk_l2norm: bool, beta_logits: bool, recompute: bool, gate: str,
               segments: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op of a checked :func:`_traced` call (a final state of ``state_dtype``, None for none), its results
    copied into the caller's buffers when given."""
    arguments = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound)
    if training_call:
        o, state, *_ = training.forward_train_op(*arguments, state_dtype is not None, vsplit, qk_l2norm, beta_logits,
                                                 recompute, gate, segments)
    else:
        o, state = inference.forward_op(*arguments, state_dtype, vsplit, qk_l2norm, beta_logits, gate, segments)
    if out is not None:
        o = out.copy_(o)
    if final_state is not None:
        return o, final_state.copy_(state)
    return o, (state if state_dtype is not None else None)


def chunk_kda(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Drop-in for ``fla.ops.kda.chunk_kda`` (fla-core 0.6.0 signature), forward and backward.

    Shapes as in FLA: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; keyword
    ``A_log`` ``[H]`` and ``dt_bias`` ``[H*K]`` or ``[H, K]``; ``initial_state`` fp32
    ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first=True`` or the deprecated
    ``transpose_state_layout=True``); ``cu_seqlens`` int32 or int64 ``[N+1]`` with B == 1. Returns
    (o ``[B, T, H, V]`` in q's dtype, final state fp32 in the caller's layout or None).

    Supported: K = V = 128 (K, V ≤ 128 zero-padded to 128 and V a multiple of 128 split, as :func:`kda_forward`
    does), bf16 q/k/v (or fp16: o and the gradients in fp16), beta bf16 (fp16 or fp32 rounded to bf16 on entry, a
    small cast; FLA's tests pass such betas); the gate as FLA has it: ``use_gate_in_kernel=True`` with
    ``lower_bound`` in [-5, 0) (the bounded gate) or without (the softplus gate of Kimi-Linear), both with
    a raw g in q's dtype, or ``use_gate_in_kernel=False`` (g the log decay, q's dtype or fp32);
    ``use_qk_l2norm_in_kernel`` and ``use_beta_sigmoid_in_kernel`` on or off. Every gate trains (grouped
    value heads with the bounded gate do not: ``NotImplementedError`` when inputs require grad).
    Other sizes, fp32 q, k, v or raw g, and other combinations raise ``NotImplementedError`` naming the argument or
    flag (see :func:`cute_kda.fla_calls.translate_fla_call`). FLA's default ``[N, H, K, V]`` state costs a transpose
    copy each way; ``state_v_first=True`` avoids it. Takes DLPack tensors like :func:`kda_forward` and answers in
    ``q``'s framework; ``torch.compile`` traces it into the translation and one ``cute_kda::forward``
    op (``cute_kda::forward_train`` and its backward when autograd records the call).

    Autograd as :func:`kda_forward`: q, k, v, g, beta, ``A_log``, ``dt_bias`` and ``initial_state``
    get gradients in their own shapes, dtypes and layouts (the translation's transposes, reshapes
    and casts are torch ops that autograd runs backwards); ``ht``'s gradient flows into the backward.
    ``disable_recompute`` keeps FLA's meaning: False (the default) keeps nothing beyond the inputs for
    the backward (``kda_forward``'s ``recompute=True``), True keeps the intermediates for a faster one.

    ``return_intermediate_states=True`` (inference) returns FLA's third output, ``h`` bf16 ``[B, NT, H, K, V]``
    (``[.., V, K]`` with ``state_v_first``): the state entering every ``chunk_size``-token chunk of each sequence;
    with ``cu_seqlens`` it needs ``cu_seqlens_cpu`` (the chunk count depends on the lengths).

    cute_kda's extension (keyword-only, not in FLA): ``state_indices``, ``checkpoint_every`` and
    ``checkpoint_indices`` make the call a prefill on a state pool as :func:`kda_forward` describes
    (``initial_state`` the pool, bf16 or fp32; its final states written into the pool, which is returned). A
    v-first pool (``state_v_first=True``) is read and written by the kernel; a K-first pool is staged through a
    v-first one by torch copies on the stream (:mod:`cute_kda.k_first_pool`).
    """
    q = args[0] if args else kwargs.get("q")
    if not isinstance(q, torch.Tensor) and hasattr(q, "__dlpack__"):  # another framework's arrays, answered in it
        return interop.answer_in_framework(q, lambda: chunk_kda(*_as_torch(args), **_as_torch(kwargs)))
    call = translate_fla_call(*args, **kwargs)
    if call.chunk_states:  # FLA's return_intermediate_states
        return run_with_chunk_states(call)
    if torch.compiler.is_compiling():
        return call.run(functools.partial(kda_forward, recompute=call.recompute))
    return call.run(lambda *tensors, **options: run(resolve(*tensors, recompute=call.recompute, **options)))


chunk_kda.__signature__ = inspect.signature(translate_fla_call).replace(return_annotation=tuple[Any, Any])


def run_with_chunk_states(call: CanonicalCall) -> tuple[Any, Any, Any]:
    """(o, final state, h) of a translated ``chunk_kda`` call with ``return_intermediate_states=True``, unsplit
    (:func:`cute_kda.executors.inference.run_keeping_chunk_states`); eager only."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("return_intermediate_states=True is not supported under torch.compile yet")

    def forward(*tensors: torch.Tensor, **options: Any) -> tuple:
        resolved = resolve(*tensors, segments=1, **options)
        return finish(resolved, inference.run_keeping_chunk_states(resolved, call.chunk_states, call.cu_seqlens_cpu))

    return call.run(forward)


def chunk_gated_delta_rule(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Drop-in for ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (fla-core 0.6.0 signature), forward and
    backward.

    Shapes as in FLA: q, k bf16 or fp16 ``[B, T, H, K]``; v ``[B, T, HV, V]`` in q's dtype, HV a
    multiple of H (value head ``j`` reads q/k head ``j // (HV / H)``); g ``[B, T, HV]``: the log decay (q's dtype or
    fp32, FLA's default ``use_gate_in_kernel=False``) or with ``use_gate_in_kernel=True`` the raw input (q's dtype) of
    ``−exp(A_log) · softplus(g + dt_bias)`` (keywords ``A_log`` ``[HV]``, ``dt_bias`` ``[HV]`` or None);
    beta bf16 ``[B, T, HV]`` (logits with ``use_beta_sigmoid_in_kernel``; fp16 or fp32, as FLA's tests pass it, is
    rounded to bf16 on entry); ``initial_state`` fp32 or bf16 (fp16 widened to fp32 on entry)
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); ``cu_seqlens`` int32 or int64 ``[N+1]`` with B = 1.
    K = V = 128, and as :func:`kda_forward` other head dims padded or split (``expand_v = 2``'s V = 256 runs as two
    value heads of 128 each); K > 128, fp32 q, k, v and a g of the other 16-bit dtype than q's raise
    ``NotImplementedError`` naming the argument. Returns (o ``[B, T, HV, V]`` in q's dtype, the final state fp32 in
    the caller's layout or None), in
    ``q``'s framework, computed by K1 (one decay per head on every channel, overflow-free for any gate value)
    and K2 on the current stream, with no host synchronisation.

    Training: inputs that require grad get the backward of :mod:`cute_kda.executors.training` (Kernel B's per-head
    form; dq, dk summed over each group of value heads), eagerly or under torch.compile (its training ops). As FLA's
    function the forward keeps no states for the backward (``kda_forward``'s ``recompute=True``);
    ``disable_recompute=True`` (cute_kda's keyword-only extension, ``chunk_kda``'s flag) keeps K1's workspace and the
    per-tile states for a faster backward. Flags as :func:`cute_kda.fla_calls.translate_fla_gdn_call`. A prefill on a
    state pool (``state_indices``, ``checkpoint_every``, ``checkpoint_indices``: cute_kda's keyword-only extension)
    as :func:`chunk_kda`.
    """
    q = args[0] if args else kwargs.get("q")
    if not isinstance(q, torch.Tensor) and hasattr(q, "__dlpack__"):  # another framework's arrays, answered in it
        return interop.answer_in_framework(q, lambda: chunk_gated_delta_rule(*_as_torch(args), **_as_torch(kwargs)))
    call = translate_fla_gdn_call(*args, **kwargs)
    return call.run(functools.partial(kda_forward, recompute=call.recompute))


chunk_gated_delta_rule.__signature__ = inspect.signature(translate_fla_gdn_call).replace(
    return_annotation=tuple[Any, Any])


def _as_torch(arguments: tuple | dict) -> tuple | dict:
    """The array arguments of an FLA call as torch tensors (DLPack), the others as they are."""
    if isinstance(arguments, dict):
        return {name: interop.as_torch(value) for name, value in arguments.items()}
    return tuple(interop.as_torch(value) for value in arguments)


def warmup(*, device: Any = None, **selection: Any) -> int:
    """Compile, ahead of time and without running anything, every variant ``selection`` selects: the keyword
    arguments of :func:`warmup_variants` (which lists them, and says what each covers), for ``device`` (default: the
    current CUDA device), where the compiled code will run.

    Variants already in the disk cache (``$CUTE_KDA_CACHE_DIR``, default ``~/.cache/cute_kda``) are loaded instead of
    compiled, and the ones compiled here are saved there, so a later process starts warm. Returns the number of
    variants visited; already-compiled ones cost nothing.
    """
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
    variants = warmup_variants(**selection)
    launchers = _launchers_by_variant()
    for variant in variants:
        launchers[type(variant)].compile_variant(variant, device)
    return len(variants)


def _launchers_by_variant() -> dict[type, Any]:
    """The launcher module of each variant class (imported here: they bring in the DSL)."""
    from .ops import bwd_grads, bwd_scan, prepare, recurrence, round_bf16, segment_combine

    return {PrepareVariant: prepare, RecurrenceVariant: recurrence, ScanVariant: bwd_scan, GradsVariant: bwd_grads,
            RoundVariant: round_bf16, CombineVariant: segment_combine}


def warmup_variants(
    *,
    qk_l2norm: tuple[bool, ...] = (True,),
    beta_logits: tuple[bool, ...] = (True,),
    varlen: tuple[bool, ...] = (False, True),
    state_modes: tuple[torch.dtype | None, ...] = STATE_MODES,
    vsplits: tuple[int, ...] | None = None,
    gates: tuple[str, ...] = ("safe",),
    gated_delta_rule: bool = False,
    training: bool = False,
    segments: bool = True,
    state_pools: tuple[torch.dtype, ...] = (),
    checkpoint_every: tuple[int, ...] = (),
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    head_dims: tuple[int, ...] = (128,),
) -> list:
    """The variants :func:`warmup` compiles, in order, without duplicates. Pure: nothing is compiled, no device is
    needed.

    Each argument lists the values to cover: ``state_modes`` holds None (no state), bf16 and/or fp32 (used for both
    the initial and the final state); ``vsplits`` None covers every supported V-split; ``gates`` the K1 gate forms
    (``"none"`` for both g dtypes, bf16 and fp32); ``gated_delta_rule`` also the K1 variants of
    :func:`cute_kda.chunk_gated_delta_rule` (a per-head gate with grouped value heads, for each unbounded gate in
    ``gates``). ``training`` also lists what a training step adds: K2 with checkpoints (and the backward's
    recomputation, without a final state and, under :data:`~cute_kda.executors.stages.STATES_ONLY_PASSES`, without
    o, as a segmented call's passes for its segment states), Kernel A (every V-split in
    ``vsplits``; dht of the final state's dtype or none, dh0 of the initial state's dtype or none) and Kernel B for
    each gate (per head too with ``gated_delta_rule``). ``segments`` also lists what a call split into segments runs
    (context parallelism, :mod:`cute_kda.context_parallel`; V-split 1): K2 on packed segments with fp32 states in and
    out, the segment combine from each of ``state_modes``, and with ``training`` K2's checkpoint variant, Kernel A's
    two passes and the backward's combine (from dht: an fp16 state's in fp32). ``state_pools`` (bf16 and/or fp32):
    K2 of a prefill on a state pool of that dtype, for every V-split and ``varlen`` value, without prefix checkpoints
    and with each of ``checkpoint_every`` (tokens: one variant per value). ``dtypes``: the activations' dtypes (bf16
    and / or fp16) the forward variants are listed for (an fp16 one's log decay in fp16 or fp32, its ``state_modes``
    may hold fp16; with ``training`` K2's checkpoint variants too); the backward's are the bf16 ones, and with fp16 in
    ``dtypes`` under :data:`~cute_kda.executors.training.FP16_NATIVE_BACKWARD` (the default) also Kernel A's fp16 dv
    and the Kernel B variants reading fp16 q, k, v and g (each gate form of fp16 calls; fp16 gradients where
    :func:`~cute_kda.executors.training.stores_fp16_grads`; an fp16 state's dht / dh0 in fp32); with that switch off
    (the copy route: fp16 trains on bf16 copies, :func:`cute_kda.executors.training.backward`) and
    :data:`~cute_kda.executors.training.FP16_GRAD_STORES` on, the copy route's fp16-gradient twins (Kernel A's fp16
    dv; Kernel B's fp16 dq, dk, dg for the per-channel gates in q's dtype); under
    :data:`~cute_kda.executors.training.FP16_DO_KERNEL` the rounding pass of an fp16 dO.
    Under :data:`~cute_kda.executors.stages.PAIR_TRAINING` ``training`` also lists the two-tile form's backward (bf16,
    the gates with pair variants, the V-splits its rule takes): K1's pair variant, the training pair K2, Kernel A's
    pair scan and Kernel B's ``pair_rebuild``. Under :data:`~cute_kda.executors.stages.SPLIT_RECOMPUTE` ``training``
    also lists the passes of a call recomputed side by side (varlen K2 over one segment: the forward's with fp32 states
    beside the caller's, the recomputation's at V-split 1; on pairs where ``PAIR_TRAINING`` takes the V-split).
    ``head_dims``: K = V of every listed variant (:data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`: what runs natively,
    :func:`cute_kda.call.runs_native`; Kernel B at 64 at its one warp count, 4). Where a gate's inference forward
    runs the two-tile prefill (:func:`cute_kda.variants.pair_prefill`), its K1 and K2 (and pool K2) are the pair
    variants, and today's are listed as far as training, a segmented call or another gate runs them.
    """
    # their values now (``training``: the switches)
    from .executors.training import FP16_DO_KERNEL, FP16_NATIVE_BACKWARD, stores_fp16_grads
    from .layouts.bwd_grads import default_warps
    from .ops.bwd_grads import switches as grads_switches
    from .numerics import NATIVE_HEAD_DIMS, SCAN_VSPLITS, SUPPORTED_VSPLITS, gate_scheme

    for dim in head_dims:
        if dim not in NATIVE_HEAD_DIMS:
            raise ValueError(f"head_dims: the kernels compile for {NATIVE_HEAD_DIMS}, got {dim}")

    for gate in gates:
        validation.check_gate(gate)
    k2_splits = SUPPORTED_VSPLITS if vsplits is None else vsplits
    scan_splits = SCAN_VSPLITS if vsplits is None else tuple(v for v in vsplits if v in SCAN_VSPLITS)

    def gate_forms_of(dtype: torch.dtype) -> list:  # (gate, g dtype, per head)
        forms = [(gate, g_dtype, False) for gate in gates
                 for g_dtype in ((dtype, torch.float32) if gate == "none" else (dtype,))]
        return forms + [(gate, g_dtype, True) for gate, g_dtype, _ in forms if gate != "safe" and gated_delta_rule]

    gate_forms = gate_forms_of(torch.bfloat16)
    flags = [(l2, logits, packed) for l2 in qk_l2norm for logits in beta_logits for packed in varlen]
    variants: dict = {}  # ordered, without duplicates
    def paired(dtype: torch.dtype, split: int) -> list:  # whether each gate form's inference forward at K2 V-split
        return [pair_prefill(gate, per_head, False, split) for gate, _, per_head in gate_forms_of(dtype)]  # pairs

    for dtype, (l2, logits, packed) in itertools.product(dtypes, flags):
        forms = gate_forms_of(dtype)
        for mode, dim in itertools.product(state_modes, head_dims):
            for split in k2_splits:
                pairs_of = paired(dtype, split)
                for (gate, g_dtype, per_head), pairs in zip(forms, pairs_of):
                    key = (packed, l2, logits, gate, g_dtype, per_head, per_head, dtype, dim)
                    if not pairs or training or segments:  # today's K1: training, a segmented call
                        variants[PrepareVariant(*key)] = None
                    if pairs:
                        variants[PrepareVariant(*key, pairs=True)] = None
                if not all(pairs_of) or training:  # today's K2: the other gates' inference, training
                    variants[RecurrenceVariant(split, mode, mode, packed, False, dtype=dtype, dim=dim)] = None
                if any(pairs_of):
                    variants[RecurrenceVariant(split, mode, mode, packed, False, dtype=dtype, dim=dim,
                                               pairs=True)] = None
                if training:
                    variants[RecurrenceVariant(split, mode, mode, packed, True, dtype=dtype, dim=dim)] = None
                    # the backward's recomputation: checkpoints, no final state, no o
                    variants[RecurrenceVariant(split, mode, None, packed, True, dtype=dtype, dim=dim,
                                               token_outputs=not stages.STATES_ONLY_PASSES)] = None
    # the backward kernels' gradient dtypes: bf16, and fp16 where fp16 training stores its own
    native = FP16_NATIVE_BACKWARD and torch.float16 in dtypes
    fp16_stores = torch.float16 in dtypes and stores_fp16_grads(False, torch.float16)
    grad_dtypes = (torch.bfloat16,) + ((torch.float16,) if fp16_stores else ())
    if training:  # Kernel A picks its own V-split (8 as well); Kernel B has no state flags
        scan_modes = dict.fromkeys(torch.float32 if mode == torch.float16 else mode for mode in state_modes)
        for (l2, logits, packed), dim, grads in itertools.product(flags, head_dims, grad_dtypes):
            for mode in scan_modes:
                for split in scan_splits:
                    for dht in (mode, None):
                        variants[ScanVariant(split, dht, mode, packed, dim=dim, dv_dtype=grads)] = None
                for gate, g_dtype, per_head in gate_forms:
                    # the caller's g: fp16 where Kernel B reads its bf16 copy, an fp32 log decay as it is
                    caller_g = torch.float16 if g_dtype == torch.bfloat16 else g_dtype
                    if grads == torch.float16 and not stores_fp16_grads(per_head, torch.float16, caller_g):
                        continue
                    warps = default_warps(dim)
                    # GatedDeltaNet's value heads: per value head, and in pairs added by Kernel B (group_sum)
                    for pairs in (False, True) if per_head and grads == torch.bfloat16 else (False,):
                        variants[GradsVariant(packed, l2, logits, gate, g_dtype, per_head, per_head, warps, dim=dim,
                                              grad_dtype=grads, group_sum=pairs,
                                              **grads_switches(gate, per_head, warps))] = None
            for gate, g_dtype, per_head in (gate_forms_of(torch.float16) if native and grads == torch.bfloat16
                                            else ()):  # fp16 training's own backward: Kernel B on the fp16 inputs
                warps = default_warps(dim)
                stored = torch.float16 if stores_fp16_grads(per_head, torch.float16, g_dtype) else torch.bfloat16
                for pairs in (False, True) if per_head and stored == torch.bfloat16 else (False,):
                    variants[GradsVariant(packed, l2, logits, gate, g_dtype, per_head, per_head, warps, dim=dim,
                                          grad_dtype=stored, dtype=torch.float16, group_sum=pairs,
                                          **grads_switches(gate, per_head, warps))] = None
        if stages.PAIR_TRAINING:  # a recomputing backward in the two-tile form (bf16, stages.trains_pairs)
            for (l2, logits, packed), dim, (gate, g_dtype, per_head) in itertools.product(flags, head_dims, gate_forms):
                least = stages.pair_training_vsplit(gate_scheme(gate, per_head))
                if least is None or not any(split >= least for split in k2_splits):
                    continue
                key = (packed, l2, logits, gate, g_dtype, per_head, per_head, torch.bfloat16, dim)
                variants[PrepareVariant(*key, pairs=True)] = None  # the forward's pair chain
                if per_head:  # the recomputation's, with the pair partners' fields
                    variants[PrepareVariant(*key, pairs=True, partner_fields=True)] = None
                for mode, split in itertools.product(state_modes, k2_splits):
                    if split >= least:  # the training pair K2: checkpoints, no final state, o unread
                        variants[RecurrenceVariant(split, mode, None, packed, True, dim=dim, pairs=True,
                                                   token_outputs=not stages.STATES_ONLY_PASSES)] = None
                for mode, split in itertools.product(scan_modes, scan_splits):
                    for dht in (mode, None):
                        variants[ScanVariant(split, dht, mode, packed, snapshot_every=2, dim=dim, pairs=True)] = None
                warps = default_warps(dim)
                for pairs in (False, True) if per_head else (False,):
                    variants[GradsVariant(packed, l2, logits, gate, g_dtype, per_head, per_head, warps, dim=dim,
                                          group_sum=pairs, pair_rebuild=True,
                                          **grads_switches(gate, per_head, warps))] = None
        if stages.SPLIT_RECOMPUTE:  # one sequence recomputed side by side (stages.recompute_split): segment passes
            fp32 = torch.float32
            leasts = [stages.pair_training_vsplit(gate_scheme(gate, per_head)) for gate, _, per_head in gate_forms]
            least = min((n for n in leasts if n is not None), default=None) if stages.PAIR_TRAINING else None
            for dtype, dim, mode in itertools.product(dtypes, head_dims, state_modes):
                wide = fp32 if mode == torch.float16 else mode  # an fp16 state beside an fp32 one, widened
                for split, pairs in itertools.product(k2_splits, (False, True)):
                    if pairs and (dtype != torch.bfloat16 or least is None or split < least):
                        continue
                    for initial, final in ((wide, fp32), (fp32, fp32), (fp32, wide)):  # the forward's passes
                        variants[RecurrenceVariant(split, initial, final, True, False, dtype=dtype, dim=dim,
                                                   pairs=pairs)] = None
                    for initial in (mode, fp32):  # the recomputation's, at V-split 1
                        variants[RecurrenceVariant(1, initial, None, True, True, dtype=dtype, dim=dim, pairs=pairs,
                                                   token_outputs=not stages.STATES_ONLY_PASSES)] = None
        if FP16_DO_KERNEL and torch.float16 in dtypes:  # an fp16 dO rounded to bf16 by the kernel
            variants[RoundVariant()] = None
    if segments:  # a segmented call (context parallelism): varlen, V-split 1 (the heuristic's), fp32 states
        fp32 = torch.float32
        states_only = stages.STATES_ONLY_PASSES
        for dtype, dim in itertools.product(dtypes, head_dims):
            for initial, final, outputs in ((None, fp32, not states_only), (fp32, fp32, not states_only),
                                            (fp32, fp32, True), (fp32, None, True)):  # local, transition; real
                variants[RecurrenceVariant(1, initial, final, True, dtype=dtype, dim=dim, token_outputs=outputs)] = None
        for dim, boundary in itertools.product(head_dims, state_modes):  # the combine, from the caller's state
            variants[CombineVariant(dim, False, boundary)] = None
        if training:
            for dim, dht in itertools.product(head_dims, scan_modes):  # from dht, as Kernel A takes it
                variants[CombineVariant(dim, True, dht)] = None
            for dtype, final, dim in itertools.product(dtypes, (fp32, None), head_dims):
                variants[RecurrenceVariant(1, fp32, final, True, True, dtype=dtype, dim=dim)] = None
            for dtype, dim in itertools.product(dtypes, head_dims):  # the backward's recomputation
                variants[RecurrenceVariant(1, fp32, None, True, True, dtype=dtype, dim=dim,
                                           token_outputs=not states_only)] = None
            for dim, grads in itertools.product(head_dims, grad_dtypes):
                variants[ScanVariant(1, None, fp32, True, token_outputs=False, dim=dim, dv_dtype=grads)] = None
                for dh0 in (fp32, None):
                    variants[ScanVariant(1, fp32, dh0, True, dim=dim, dv_dtype=grads)] = None
    for dtype, pool, packed, split, every in itertools.product(dtypes, state_pools, varlen, k2_splits,
                                                               (0, *checkpoint_every)):
        for pairs in (False, True):  # a pool prefill of a gate without a pair variant, of one with (two tiles a step)
            if pairs in paired(dtype, split):
                variants[RecurrenceVariant(split, pool, pool, packed, False, True, every, dtype, pairs=pairs)] = None
    return list(variants)
