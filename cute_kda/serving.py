"""Serving entry points: FLA 0.6.0's ``fused_recurrent_kda`` and ``fused_recurrent_gated_delta_rule`` on the decode /
verify kernel (:mod:`cute_kda.ops.decode`), with the state pool of FLA's ``fused_recurrent_kda_fwd``.

Both take FLA's signature (names, order, defaults) plus four keyword-only arguments, as ``fused_recurrent_kda_fwd``
has them: ``ssm_state_indices``, ``num_accepted_tokens``, ``inplace_final_state``, ``out``.

**Without** ``ssm_state_indices``: FLA's semantics. ``initial_state`` ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
``state_v_first``) or None (zeros); the final state is a new fp32 tensor in the same layout, returned when
``output_final_state`` (None otherwise); ``initial_state`` is never written — unless ``inplace_final_state=True``,
where it must be an fp32 / bf16 state block per sequence and the final states overwrite it (then it is what is
returned). Inside, the initial states are copied into the new fp32 tensor on the current stream and the kernel
updates that in place (slots ``0 .. N−1``): no host sync.

**With** ``ssm_state_indices`` (the engines' pool; ``inplace_final_state`` None or True): ``initial_state`` is the
pool, fp32 or bf16 ``[slots, HV, V, K]`` (``state_v_first=True``, what FLA's layers and vLLM use) or
``[slots, HV, K, V]``, each ``[128, 128]`` state block contiguous, slot and head strides free (16-byte multiples).
It is updated in place and returned as the final state.

- decode: ``ssm_state_indices`` int32 ``[N]``: sequence ``n`` starts from slot ``ssm_state_indices[n]`` and its
  state after its last token is written back there;
- verify (speculative decoding): ``ssm_state_indices`` int32 ``[N, 1 + S]`` and ``num_accepted_tokens`` int32
  ``[N]`` (``[1, 1 + S]``; None: all 1): the state entering the step is the one in slot
  ``[n, num_accepted_tokens[n] − 1]``, the state after token ``t`` is written to slot ``[n, t]`` (skipped where
  that entry is −1). Fixed-length calls have T = 1 + S tokens; packed ones (``cu_seqlens``) up to 1 + S each;
- slot −1 marks a padding row (CUDA graphs keep the batch fixed): nothing is read or written for it and its
  outputs are zero. No slot may be listed twice in one call; nothing outside the listed slots is ever written.

Shapes and dtypes: q, k bf16 ``[B, T, H, 128]``; v bf16 ``[B, T, HV, 128]`` (HV a multiple of H); g bf16
(KDA: ``[B, T, HV, 128]``; GatedDeltaNet: ``[B, T, HV]``); beta bf16 ``[B, T, HV]``; packed sequences: B = 1 and
``cu_seqlens`` int32 / int64 ``[N + 1]`` on the device. o is bf16 ``[B, T, HV, 128]`` (into ``out`` when given).
Tensors may be strided views: the last mode contiguous, rows (of q, k, v, g, out) 16-byte aligned.

**Engines**: with the pool, the slot ids and ``out`` given, a call allocates nothing and never synchronises: the
checks read shapes, dtypes and strides only; the values (ids in ``[−1, slots)``, no slot twice, accepted counts
in range, packed lengths within the verify width) are checked only under ``CUTE_KDA_DEBUG_CHECKS=1`` (a sync).
A steady decode loop can be captured in a CUDA graph (warm it up once first: the first call compiles, and the
cached device constants — slot ranges, default gate parameters, GatedDeltaNet's ones beta — are made on first use).
Both entry points check an engine's steady call in full once per configuration and then launch it from the kept plan
(:func:`steady_launch`): calls with the same shapes, layouts, dtypes, devices, flags and scalars, 16-byte aligned.

What FLA takes and the kernel does not raises, naming the argument: head dims other than 128
(``NotImplementedError``), q/k/v/g/beta in fp16 or fp32 (:class:`cute_kda.validation.UnsupportedDtypeError`, a
``NotImplementedError`` and a ``TypeError``: cast first) or another dtype (``TypeError``), per-channel
("headwise") beta ``[B, T, HV, V]``, ``allow_neg_eigval=True``, a bounded gate's ``lower_bound`` outside
[-5, 0), ``ssm_state_indices`` with ``inplace_final_state=False``; GatedDeltaNet's ``gv``, or ``gk`` with ``g``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch

from . import validation
from .fla_calls import fla_state_v_first, refuse_neg_eigval
from .numerics import HEAD_DIM

_BF16 = (torch.bfloat16,)
_EXTRA_KWARGS = frozenset(("transpose_state_layout",))


class PoolCall(NamedTuple):
    """One checked serving call, ready to run (:meth:`run`): the decode launcher's arguments and how to hand back.

    ``pool`` None: a new fp32 state block per sequence is made at run time, from ``initial_state`` (copied on the
    stream) or zeros; ``returns_state``: whether that (or ``pool``) is returned as the final state.
    """

    tensors: tuple  # q, k, v, g, beta
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    pool: torch.Tensor | None
    initial_state: torch.Tensor | None
    state_indices: torch.Tensor
    num_accepted_tokens: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    out: torch.Tensor | None
    options: dict  # gate, scale, lower_bound, qk_l2norm, beta_logits, state_layout
    returns_state: bool

    def run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(o, final state) as FLA returns them (the kernel launched by :func:`launch_decode`)."""
        pool = self.pool
        if pool is None:
            v = self.tensors[2]
            pool = torch.empty(self.state_indices.shape[0], v.shape[2], HEAD_DIM, HEAD_DIM, dtype=torch.float32,
                               device=v.device)
            if self.initial_state is None:
                pool.zero_()
            else:
                pool.copy_(self.initial_state)
        o = launch_decode(self, pool)
        return o, (pool if self.returns_state else None)


def launch_decode(call: PoolCall, pool: torch.Tensor) -> torch.Tensor:
    """Run ``call`` on ``pool`` with the decode kernel (a CUDA device of compute capability 9.x)."""
    from .ops.decode import decode

    q = call.tensors[0]
    if not q.is_cuda:
        validation.check_on_cuda("q", q)
    packed = {} if call.cu_seqlens is None else {"cu_seqlens": call.cu_seqlens}
    return decode(*call.tensors, call.A_log, call.dt_bias, pool, call.state_indices, call.num_accepted_tokens,
                  out=call.out, **call.options, **packed)


# ---------------------------------------------------------------------------------------------
# device constants, made once per (size, device)


@functools.lru_cache(maxsize=256)
def slot_range(num_seqs: int, device: torch.device) -> torch.Tensor:
    """int32 ``[0, 1, .., N−1]`` on ``device``: the slots of a call that owns one state per sequence."""
    return torch.arange(num_seqs, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=256)
def ones_counts(num_seqs: int, device: torch.device) -> torch.Tensor:
    """int32 ones ``[N]``: FLA's 2-D slot ids without accepted counts read column 0."""
    return torch.ones(num_seqs, dtype=torch.int32, device=device)


_ONES: dict[torch.device, torch.Tensor] = {}  # device → a flat bf16 ones buffer (ones_betas)


def ones_betas(shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """bf16 ones ``[B, T, HV]``: GatedDeltaNet's beta when none is given (FLA makes it per call; a steady loop must
    not allocate, as a CUDA graph needs). A view of one buffer per device, doubled when a call needs more (one
    tensor per shape would pile up over the lengths of packed prompts); callers never write it."""
    count = shape[0] * shape[1] * shape[2]
    ones = _ONES.get(device)
    if ones is None or ones.numel() < count:
        ones = _ONES[device] = torch.ones(max(count, 0 if ones is None else 2 * ones.numel()), dtype=torch.bfloat16,
                                          device=device)
    return ones[:count].view(shape)


@functools.lru_cache(maxsize=1024)
def parameter_view(parameter: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``parameter`` detached and viewed as ``shape``, made once per parameter (a view costs more host time than the
    rest of a call's checks; the layers' ``dt_bias`` is ``[HV·K]``, the kernel reads ``[HV, K]``; a tensor that
    requires grad is not handed to the kernel: the decode kernel has no backward, as FLA's has none). The view
    shares the parameter's memory, so in-place updates show through; the cache holds up to 1024 parameters alive
    (a model's A_log and dt_bias of every layer: 64 thrashed on a 48-layer model, a new view a call)."""
    return parameter.detach().view(shape)


@functools.lru_cache(maxsize=256)
def constant(value: float, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An fp32 tensor of ``value`` (a default gate parameter); callers never write it."""
    return torch.full(shape, value, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------
# FLA's arguments


def _parameter(name: str, value: Any, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A gate parameter as the kernel reads it: fp32 of ``shape`` (any shape of that many elements, viewed; another
    float dtype is widened exactly, at the cost of one small copy per call)."""
    value = validation.check_is_tensor(name, value)
    if (value.shape == shape and value.dtype is torch.float32 and value.is_contiguous() and value.device == device
            and not value.requires_grad):
        return value
    count = 1
    for extent in shape:
        count *= extent
    if value.numel() != count:
        raise ValueError(f"{name} must hold {count} values ({list(shape)}), got shape {list(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {value.dtype}")
    validation.check_contiguous(name, value)
    validation.check_same_device(name, value, device)
    return value.detach().view(shape).float()


def _check_token_tensor(name: str, x: Any, shape: tuple[int, ...], meaning: str, device: torch.device,
                        aligned_rows: bool = True) -> None:
    x = validation.check_is_tensor(name, x)
    if x.dtype is not torch.bfloat16:  # a float dtype FLA takes: not implemented (its backend declines), else wrong
        error = validation.UnsupportedDtypeError if x.dtype in validation.FLA_FLOAT_DTYPES else TypeError
        raise error(f"{name} must be bf16 (the decode kernel reads bf16 tokens), got {x.dtype}; cast it first")
    validation.check_shape(name, x, shape, meaning)
    validation.check_same_device(name, x, device)
    validation.check_token_rows(name, x, aligned_rows)


def check_tokens(q: Any, k: Any, v: Any, g: Any, beta: Any, per_head_gate: bool) -> tuple[int, int, int, int]:
    """q, k, v, g, beta of one call → (B, T, H, HV)."""
    q = validation.check_is_tensor("q", q)
    validation.check_ndim("q", q, 4, "[B, T, H, K]")
    batch, tokens, heads, key_dim = q.shape
    validation.check_head_dim("K (q.shape[-1])", key_dim)
    if tokens == 0:
        raise ValueError("q must hold at least one token (T = q.shape[1] is 0)")
    device = q.device
    _check_token_tensor("q", q, tuple(q.shape), "[B, T, H, K]", device)
    _check_token_tensor("k", k, tuple(q.shape), "[B, T, H, K]", device)
    v = validation.check_is_tensor("v", v)
    validation.check_ndim("v", v, 4, "[B, T, HV, V]")
    validation.check_head_dim("V (v.shape[-1])", v.shape[-1])
    value_heads = v.shape[2]
    validation.check_value_heads(heads, value_heads)
    _check_token_tensor("v", v, (batch, tokens, value_heads, HEAD_DIM), "[B, T, HV, V]", device)
    if per_head_gate:
        _check_token_tensor("g", g, (batch, tokens, value_heads), "[B, T, HV] (a per-head gate)", device, False)
    else:
        _check_token_tensor("g", g, (batch, tokens, value_heads, HEAD_DIM), "[B, T, HV, K]", device)
    beta = validation.check_is_tensor("beta", beta)
    if beta.dim() == 4:
        raise NotImplementedError("beta: a per-channel (headwise) beta [B, T, HV, V] is not supported; the decode "
                                  "kernel takes one beta per token and value head, [B, T, HV]")
    _check_token_tensor("beta", beta, (batch, tokens, value_heads), "[B, T, HV]", device, False)
    return batch, tokens, heads, value_heads


def pool_call(q, k, v, g, beta, *, gate: str, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
              lower_bound: float, scale: float | None, initial_state: Any, output_final_state: bool, qk_l2norm: bool,
              beta_logits: bool, state_v_first: bool, cu_seqlens: Any, ssm_state_indices: Any,
              num_accepted_tokens: Any, inplace_final_state: bool | None, out: Any,
              shape: tuple[int, int, int, int]) -> PoolCall:
    """The :class:`PoolCall` of checked tokens (``shape`` = (B, T, H, HV) from :func:`check_tokens`) and gate
    parameters; checks the rest (module doc)."""
    batch, tokens, _, value_heads = shape
    device = q.device
    num_seqs = batch
    if cu_seqlens is not None:
        cu_seqlens = validation.check_is_tensor("cu_seqlens", cu_seqlens)
        num_seqs = validation.check_cu_seqlens_layout(cu_seqlens, batch)
        validation.check_same_device("cu_seqlens", cu_seqlens, device)
    scale = HEAD_DIM ** -0.5 if scale is None else validation.check_scale(scale)
    if out is not None:
        _check_token_tensor("out", out, tuple(v.shape), "v's shape [B, T, HV, V]", device)
    debug = validation.debug_checks_enabled()

    pool = state = None
    counts = num_accepted_tokens
    if ssm_state_indices is not None:
        if inplace_final_state is False:
            raise NotImplementedError(
                "inplace_final_state=False with ssm_state_indices is not supported (FLA writes one state per token "
                "into an [N] tensor there); the pool is updated in place: pass inplace_final_state=True or None")
        if initial_state is None:
            raise ValueError("initial_state (the state pool) is required with ssm_state_indices")
        pool = validation.check_state_pool("initial_state", initial_state, value_heads, device)
        verify = ssm_state_indices.dim() == 2 if isinstance(ssm_state_indices, torch.Tensor) else False
        if counts is not None and not verify:
            raise ValueError("num_accepted_tokens needs 2-D ssm_state_indices [N, 1 + S] (a verify's slots)")
        width = None
        if verify:
            width = ssm_state_indices.shape[1]
            if cu_seqlens is None and width != tokens:
                raise ValueError(f"ssm_state_indices of a fixed-length verify must be [N, T] = [{num_seqs}, {tokens}] "
                                 f"(one slot per token), got {list(ssm_state_indices.shape)}; pack the tokens "
                                 "with cu_seqlens for shorter rows")
        ids = validation.check_slot_ids(
            "ssm_state_indices", ssm_state_indices, (num_seqs,) if width is None else (num_seqs, width),
            "[N] (one slot per sequence)" if width is None else "[N, 1 + S] (a verify's slots per sequence and token)",
            device)
        if verify:
            counts = (ones_counts(num_seqs, device) if counts is None
                      else validation.check_accepted_counts("num_accepted_tokens", counts, num_seqs, device))
        if debug:
            validation.check_pool_values(pool.shape[0], ids, counts, cu_seqlens, ids_name="ssm_state_indices")
        returns_state = True
    else:
        if counts is not None:
            raise ValueError("num_accepted_tokens needs ssm_state_indices (a verify on a state pool)")
        ids = slot_range(num_seqs, device)
        if inplace_final_state:
            if initial_state is None:
                raise ValueError("inplace_final_state=True needs initial_state (its states are overwritten)")
            pool = validation.check_state_pool("initial_state", initial_state, value_heads, device, slots=num_seqs)
            returns_state = True
        else:
            if initial_state is not None:
                state = _check_initial_state(initial_state, num_seqs, value_heads, state_v_first, device)
            returns_state = bool(output_final_state)
    if cu_seqlens is not None and debug:
        validation.check_cu_seqlens_values(cu_seqlens.cpu(), tokens)

    options = dict(gate=gate, scale=scale, lower_bound=lower_bound, qk_l2norm=bool(qk_l2norm),
                   beta_logits=bool(beta_logits), state_layout="vk" if state_v_first else "kv")
    return PoolCall((q, k, v, g, beta), A_log, dt_bias, pool, state, ids, counts, cu_seqlens, out, options,
                    returns_state)


def _check_initial_state(state: Any, num_seqs: int, value_heads: int, state_v_first: bool, device: torch.device
                         ) -> torch.Tensor:
    """FLA's ``initial_state`` without a pool: any float dtype (read as fp32, as FLA does), one state per sequence."""
    state = validation.check_is_tensor("initial_state", state)
    if not state.is_floating_point():
        raise TypeError(f"initial_state must be a float tensor, got {state.dtype}")
    meaning = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
    validation.check_ndim("initial_state", state, 4, meaning)
    validation.check_shape("initial_state", state, (num_seqs, value_heads, HEAD_DIM, HEAD_DIM), meaning)
    validation.check_same_device("initial_state", state, device)
    return state


def _kda_gate(use_gate_in_kernel: bool, lower_bound: Any, A_log: Any, dt_bias: Any, value_heads: int,
              device: torch.device) -> tuple[str, float, torch.Tensor | None, torch.Tensor | None]:
    """(gate, lower_bound, A_log fp32 ``[HV]``, dt_bias fp32 ``[HV, 128]``) of FLA's KDA gate flags.

    FLA's fused recurrent kernel: ``use_gate_in_kernel=False`` → g is the log decay ("none"; A_log, dt_bias and
    lower_bound unused); with ``lower_bound`` → ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` ("safe"),
    where a missing A_log means no scaling (A_log = 0); without → ``−exp(A_log) · softplus(g + dt_bias)``
    ("softplus"), where a missing A_log makes FLA's kernel scale by e (it takes A = 1.0, then exp(A)): A_log = 1.
    dt_bias ``[HV·K]`` or ``[HV, K]`` (FLA's kernel reads HV·K values), None: zeros."""
    if not use_gate_in_kernel:
        return "none", -5.0, None, None
    if lower_bound is None:
        gate, bound, missing_a_log = "softplus", -5.0, 1.0
    else:
        bound = validation.check_real("lower_bound", lower_bound)
        if not validation.LOWER_BOUND_MIN <= bound < validation.LOWER_BOUND_MAX:
            raise NotImplementedError(f"lower_bound = {bound} is not supported; the kernels need lower_bound in "
                                      f"[{validation.LOWER_BOUND_MIN}, {validation.LOWER_BOUND_MAX})")
        gate, missing_a_log = "safe", 0.0
    A_log = (constant(missing_a_log, (value_heads,), device) if A_log is None
             else _parameter("A_log", A_log, (value_heads,), device))
    dt_bias = (constant(0.0, (value_heads, HEAD_DIM), device) if dt_bias is None
               else _parameter("dt_bias", dt_bias, (value_heads, HEAD_DIM), device))
    return gate, bound, A_log, dt_bias


# ---------------------------------------------------------------------------------------------
# an engine's steady call: the full checks once per configuration, then only what changes between such calls


def steady_key(entry, q, k, v, g, beta, A_log, dt_bias, scale, pool, qk_l2norm, use_gate_in_kernel, beta_logits,
               lower_bound, state_v_first, cu_seqlens, ids, counts, out) -> tuple | None:
    """The facts of a pool call (``ids`` and ``out`` given) that the full checks of ``entry`` read (``"kda"``:
    :func:`kda_call`; ``"gdn g"`` / ``"gdn gk"``: :func:`gated_delta_rule_call` with ``g`` / ``gk`` as the decay,
    passed here as ``g``; its ``lower_bound`` None), but the
    tensors' addresses: each tensor's type, shape, layout (True when contiguous, else its strides), dtype and device
    (q's, and the others' index: the device type of each is checked again by the compiled function), the gate
    parameters' requires_grad, the scalars with their types, the flags (beta None: FLA's GatedDeltaNet's ones);
    None: an argument is not a tensor. Calls of
    one key are accepted or refused alike by the full checks, but for a misaligned base address and one layout: a
    contiguous tensor whose extent-1 modes have strides off a 16-byte multiple (torch calls it contiguous, the full
    checks refuse it, the compiled function refuses it with its own ValueError). One read of each attribute."""
    try:
        return (type(q), q.shape, q.is_contiguous() or q.stride(), q.dtype, q.device,
                type(k), k.shape, k.is_contiguous() or k.stride(), k.dtype, k.get_device(),
                type(v), v.shape, v.is_contiguous() or v.stride(), v.dtype, v.get_device(),
                type(g), g.shape, g.is_contiguous() or g.stride(), g.dtype, g.get_device(),
                None if beta is None else (type(beta), beta.shape, beta.is_contiguous() or beta.stride(), beta.dtype,
                                           beta.get_device()),
                type(out), out.shape, out.is_contiguous() or out.stride(), out.dtype, out.get_device(),
                type(pool), pool.shape, pool.is_contiguous() or pool.stride(), pool.dtype, pool.get_device(),
                type(ids), ids.shape, ids.is_contiguous() or ids.stride(), ids.dtype, ids.get_device(),
                None if counts is None else (type(counts), counts.shape, counts.is_contiguous() or counts.stride(),
                                             counts.dtype, counts.get_device()),
                None if cu_seqlens is None else (type(cu_seqlens), cu_seqlens.shape,
                                                 cu_seqlens.is_contiguous() or cu_seqlens.stride(), cu_seqlens.dtype,
                                                 cu_seqlens.get_device()),
                None if A_log is None else (type(A_log), A_log.shape, A_log.is_contiguous() or A_log.stride(),
                                            A_log.dtype, A_log.get_device(), A_log.requires_grad),
                None if dt_bias is None else (type(dt_bias), dt_bias.shape, dt_bias.is_contiguous() or dt_bias.stride(),
                                              dt_bias.dtype, dt_bias.get_device(), dt_bias.requires_grad),
                type(scale), scale, type(lower_bound), lower_bound, qk_l2norm, use_gate_in_kernel, beta_logits,
                state_v_first, entry)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or tensors without strides (sparse)
        return None


_ARGUMENT, _VIEW, _FIXED = range(3)  # where a steady call's A_log, dt_bias, counts come from (SteadyPlan)


class SteadyPlan(NamedTuple):
    """How the calls of one :func:`steady_key` run, taken from the :class:`PoolCall` the full checks made for the
    first of them: the decode launch (None: an empty call, nothing to launch), the launcher's options, the betas
    of a call without them (GatedDeltaNet's ones; None: beta is given, and passed as it is), and for A_log, dt_bias
    and the accepted counts a pair (source, what): the call's argument as it is (``_ARGUMENT``), a fixed tensor
    (``_FIXED``: a default constant, ones counts, or None: a parameter the gate does not read), or the argument
    viewed (``_VIEW``: a gate
    parameter detached and reshaped by :func:`parameter_view`; ``what`` = (the parameter seen first, its view),
    reused while the call passes that parameter: a look-up in :func:`parameter_view`'s cache costs more)."""

    key: tuple
    launch: Any  # cute_kda.ops.decode.LaunchPlan | None
    options: dict
    ones: torch.Tensor | None
    A_log: tuple
    dt_bias: tuple
    counts: tuple

    def call(self, q, k, v, g, beta, A_log, dt_bias, pool, ids, counts, cu_seqlens, out) -> PoolCall:
        """The :class:`PoolCall` the full checks make of a call of this plan's key (aligned bases)."""
        return PoolCall((q, k, v, g, self.ones if beta is None else beta), _resolved(A_log, self.A_log),
                        _resolved(dt_bias, self.dt_bias), pool, None, ids, _resolved(counts, self.counts), cu_seqlens,
                        out, self.options, True)


def _resolved(given: Any, source: tuple) -> Any:
    how, what = source
    if how == _ARGUMENT:
        return given
    if how == _FIXED:
        return what
    parameter, view = what
    if given is parameter and view.data_ptr() == given.data_ptr():
        return view
    return current_view(given, tuple(view.shape))


def current_view(parameter: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`parameter_view`, made again when the parameter's storage was replaced since (``param.data = ...``, a
    weight reload): a cached view would still read the old memory."""
    view = parameter_view(parameter, shape)
    if view.data_ptr() != parameter.data_ptr():
        parameter_view.cache_clear()
        view = parameter_view(parameter, shape)
    return view


def _source(given: Any, used: Any) -> tuple | None:
    """(source, what) of ``used`` (the full checks' tensor) from ``given`` (the argument); None: a per-call copy."""
    if used is given:
        return _ARGUMENT, None
    if given is None or used is None:
        return _FIXED, used
    if used.dtype == given.dtype and used.data_ptr() == given.data_ptr():
        return _VIEW, (given, used)
    return None


# q.shape → the plans of that shape (a list of one, mostly: a hash of the whole key costs more than comparing it)
_STEADY_PLANS: dict[tuple, list[SteadyPlan]] = {}
_STEADY_PLANS_MAX = 1024  # configurations kept (an engine has a handful: batch sizes × modes); more start over
_DEBUG_KEY = os.fsencode(validation.DEBUG_ENV)  # os.environ's own key: a look-up in it costs 1 µs, in _data 20 ns


def remember_steady(key: tuple | None, call: PoolCall, A_log: Any, dt_bias: Any, counts: Any, beta: Any) -> None:
    """Keep the :class:`SteadyPlan` of ``call`` (a pool call the full checks accepted, CUDA tensors) under ``key``;
    one whose gate parameters are copied per call (not fp32) is not kept, nor one without a key or on the CPU."""
    if key is None or not call.tensors[0].is_cuda:
        return
    sources = (_source(A_log, call.A_log), _source(dt_bias, call.dt_bias), _source(counts, call.num_accepted_tokens))
    q, _, v, g, used_beta = call.tensors
    if None in sources or beta is not None and used_beta is not beta:
        return
    from .ops.decode import plan_of

    options = call.options
    launch = None
    if call.state_indices.shape[0] and v.shape[2] and q.shape[1]:
        launch = plan_of(q, v, g, call.pool, call.state_indices, options["gate"], options["scale"],
                         options["lower_bound"], options["qk_l2norm"], options["beta_logits"], options["state_layout"],
                         None, call.cu_seqlens)
    if sum(map(len, _STEADY_PLANS.values())) >= _STEADY_PLANS_MAX:
        _STEADY_PLANS.clear()
    plans = _STEADY_PLANS.setdefault(key[1], [])
    plans[:] = [plan for plan in plans if plan.key != key]
    plans.append(SteadyPlan(key, launch, options, used_beta if beta is None else None, *sources))


def steady_plan(key: tuple | None, q, k, v, g, pool, out) -> SteadyPlan | None:
    """The plan of a call with ``key``, when one is kept, the bases are 16-byte aligned (the rest of what the full
    checks read is the key) and the debug switch is off (it asks for the value checks)."""
    if key is None:
        return None
    for plan in _STEADY_PLANS.get(key[1], ()):
        if plan.key == key:
            if (q.data_ptr() | k.data_ptr() | v.data_ptr() | g.data_ptr() | out.data_ptr() | pool.data_ptr()) \
                    % validation.ALIGNMENT_BYTES or _DEBUG_KEY in os.environ._data:
                return None
            return plan
    return None


def steady_launch(entry, q, k, v, g, beta, A_log, dt_bias, scale, pool, qk_l2norm, use_gate_in_kernel, beta_logits,
                  lower_bound, state_v_first, cu_seqlens, ids, counts, out) -> bool:
    """Launch an engine's steady pool call (the host time of a decode step is mostly checks) when a call of its
    :func:`steady_key` has passed the full checks of ``entry`` before; False (nothing done): the caller runs them."""
    plan = steady_plan(steady_key(entry, q, k, v, g, beta, A_log, dt_bias, scale, pool, qk_l2norm, use_gate_in_kernel,
                                  beta_logits, lower_bound, state_v_first, cu_seqlens, ids, counts, out),
                       q, k, v, g, pool, out)
    if plan is None:
        return False
    launch = plan.launch
    if launch is not None:
        if torch.cuda.current_device() != launch.index:
            return False  # the launcher makes the device current
        launch.launch(q, k, v, g, plan.ones if beta is None else beta, _resolved(A_log, plan.A_log),
                      _resolved(dt_bias, plan.dt_bias), pool, ids, _resolved(counts, plan.counts), cu_seqlens, out)
    return True


def planned_call(entry, q, k, v, g, beta, A_log, dt_bias, scale, pool, qk_l2norm, use_gate_in_kernel, beta_logits,
                 lower_bound, state_v_first, cu_seqlens, ids, counts, out) -> tuple[tuple | None, PoolCall | None]:
    """(the :func:`steady_key` of a pool call, its :class:`PoolCall` when a call of that key passed the full checks
    of ``entry`` before; None: they run, and keep the plan with :func:`remember_steady`)."""
    key = steady_key(entry, q, k, v, g, beta, A_log, dt_bias, scale, pool, qk_l2norm, use_gate_in_kernel, beta_logits,
                     lower_bound, state_v_first, cu_seqlens, ids, counts, out)
    plan = steady_plan(key, q, k, v, g, pool, out)
    if plan is None:
        return key, None
    return key, plan.call(q, k, v, g, beta, A_log, dt_bias, pool, ids, counts, cu_seqlens, out)


def kda_call(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
             allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, *,
             ssm_state_indices=None, num_accepted_tokens=None, inplace_final_state=None, out=None,
             **kwargs) -> PoolCall:
    """The :class:`PoolCall` of a :func:`fused_recurrent_kda` call (nothing runs). A steady pool call (the slot ids
    and ``out`` given, CUDA tensors) is checked in full once per :func:`steady_key`."""
    key = None
    if ssm_state_indices is not None and out is not None and inplace_final_state is not False and not kwargs \
            and not allow_neg_eigval:
        key, call = planned_call("kda", q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                                 use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound,
                                 state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, out)
        if call is not None:
            return call
    state_v_first = fla_state_v_first("fused_recurrent_kda", state_v_first, kwargs, _EXTRA_KWARGS, stacklevel=3)
    refuse_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    shape = check_tokens(q, k, v, g, beta, per_head_gate=False)
    gate, bound, A_log_used, dt_bias_used = _kda_gate(use_gate_in_kernel, lower_bound, A_log, dt_bias, shape[3],
                                                      q.device)
    call = pool_call(q, k, v, g, beta, gate=gate, A_log=A_log_used, dt_bias=dt_bias_used, lower_bound=bound,
                     scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     qk_l2norm=use_qk_l2norm_in_kernel, beta_logits=use_beta_sigmoid_in_kernel,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                     num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state, out=out,
                     shape=shape)
    remember_steady(key, call, A_log, dt_bias, num_accepted_tokens, beta)
    return call


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool | None = None,
    out: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA 0.6.0's ``fused_recurrent_kda`` (KDA, per-channel gate) on cute_kda's decode kernel; the pool keywords of
    FLA's ``fused_recurrent_kda_fwd``. Returns ``(o, final_state)`` as FLA does (the module doc has the contract).

    The gate (FLA's kernel, checked in the tests against the fp64 recurrence): ``use_gate_in_kernel=False`` → g is
    the per-channel log decay; True with ``lower_bound`` (in [-5, 0)) → ``lower_bound · sigmoid(exp(A_log) ·
    (g + dt_bias))``; True without → ``−exp(A_log) · softplus(g + dt_bias)``. ``A_log`` ``[HV]``, ``dt_bias``
    ``[HV·K]`` or ``[HV, K]``, fp32 (another float dtype costs a copy per call); None as FLA's kernel takes it (a
    bounded gate without A_log is unscaled; the softplus gate without A_log is scaled by e, FLA's A = 1.0;
    dt_bias zeros). ``use_qk_l2norm_in_kernel``: q, k l2-normalised per token; ``use_beta_sigmoid_in_kernel``:
    beta holds logits. ``scale`` None: 128 ** -0.5.

    Shapes: q, k bf16 ``[B, T, H, 128]``; v bf16 ``[B, T, HV, 128]``; g bf16 ``[B, T, HV, 128]``; beta bf16
    ``[B, T, HV]``; with ``cu_seqlens`` (int32 / int64 ``[N + 1]``, on the device) B = 1 and the N sequences are
    packed. Returns o bf16 ``[B, T, HV, 128]`` (``out`` when given) and the final state.

    States: without ``ssm_state_indices``, ``initial_state`` ``[N, HV, 128, 128]`` (K-first, or V-first with
    ``state_v_first``; any float dtype) is read, the final state is a new fp32 tensor in that layout (None unless
    ``output_final_state``); with ``inplace_final_state=True`` the final states overwrite ``initial_state``
    (fp32 / bf16) instead. With ``ssm_state_indices`` (int32 ``[N]``, or ``[N, 1 + S]`` with
    ``num_accepted_tokens`` int32 ``[N]`` for a verify), ``initial_state`` is the pool ``[slots, HV, 128, 128]``
    (fp32 / bf16, each state block contiguous), updated in place and returned: a row starts from slot
    ``ids[n]`` (verify: ``ids[n, num_accepted_tokens[n] − 1]``), writes its final state there (verify: the state
    after token t to ``ids[n, t]``, skipped for −1); a row whose start slot is −1 is padding (outputs zero, nothing
    read or written). ``inplace_final_state`` None: in place exactly when ``ssm_state_indices`` is given (FLA's
    ``fused_recurrent_kda`` never writes in place, its ``fused_recurrent_kda_fwd`` by default does).

    Nothing synchronises with the device; with the pool, the slot ids and ``out`` given nothing is allocated (slot
    values are checked only under ``CUTE_KDA_DEBUG_CHECKS=1``, which syncs).
    """
    if ssm_state_indices is not None and out is not None and inplace_final_state is not False and not kwargs \
            and not allow_neg_eigval and steady_launch(
                "kda", q, k, v, g, beta, A_log, dt_bias, scale, initial_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, state_v_first, cu_seqlens,
                ssm_state_indices, num_accepted_tokens, out):
        return out, initial_state
    call = kda_call(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                    lower_bound, state_v_first, cu_seqlens, ssm_state_indices=ssm_state_indices,
                    num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state, out=out,
                    **kwargs)
    return call.run()


def _gdn_gate(g: Any, gk: Any, gv: Any, use_gate_in_kernel: bool, A_log: Any, dt_bias: Any, value_heads: int,
              device: torch.device) -> tuple[str, Any, bool, torch.Tensor | None, torch.Tensor | None]:
    """(gate, the gate tensor, per head, A_log fp32 ``[HV]``, dt_bias fp32 ``[HV]``) of FLA's GatedDeltaNet gate
    arguments: ``g`` per head (the softplus gate with ``use_gate_in_kernel``, else the log decay), or ``gk`` alone
    (a per-channel log decay, KDA's "none" gate). ``gv``, and ``gk`` beside ``g``, have no exact map."""
    if gv is not None:
        raise NotImplementedError("gv (a per-value-channel decay) is not supported by the decode kernel")
    if gk is not None:
        if g is not None or use_gate_in_kernel:
            raise NotImplementedError("gk together with g (or use_gate_in_kernel=True) is not supported; pass one "
                                      "decay: g [B, T, HV] or gk [B, T, HV, K] (a log decay)")
        return "none", gk, False, None, None
    if g is None:
        if use_gate_in_kernel:
            raise ValueError("g (the raw pre-activation gate) must be provided when use_gate_in_kernel=True")
        raise NotImplementedError("g = gk = gv = None (no decay) is not supported; pass g = zeros [B, T, HV] "
                                  "(a log decay of 0) for the same result")
    if not use_gate_in_kernel:
        return "none", g, True, None, None
    if A_log is None:
        raise ValueError("A_log must be provided when use_gate_in_kernel=True")
    A_log = _parameter("A_log", A_log, (value_heads,), device)
    dt_bias = (constant(0.0, (value_heads,), device) if dt_bias is None
               else _parameter("dt_bias", dt_bias, (value_heads,), device))
    return "softplus", g, True, A_log, dt_bias


def gated_delta_rule_call(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                          output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                          A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                          state_v_first=False, cu_seqlens=None, *, ssm_state_indices=None, num_accepted_tokens=None,
                          inplace_final_state=None, out=None, **kwargs) -> PoolCall:
    """The :class:`PoolCall` of a :func:`fused_recurrent_gated_delta_rule` call (nothing runs; a missing beta is
    ones, as FLA makes it: :func:`ones_betas`). A steady pool call is checked in full once per :func:`steady_key`,
    as :func:`kda_call`'s."""
    key = None
    if ssm_state_indices is not None and out is not None and inplace_final_state is not False and not kwargs \
            and not allow_neg_eigval and gv is None and (g is None or gk is None):
        key, call = planned_call("gdn g" if gk is None else "gdn gk", q, k, v, g if gk is None else gk, beta, A_log,
                                 dt_bias, scale, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                 use_beta_sigmoid_in_kernel, None, state_v_first, cu_seqlens, ssm_state_indices,
                                 num_accepted_tokens, out)
        if call is not None:
            return call
    state_v_first = fla_state_v_first("fused_recurrent_gated_delta_rule", state_v_first, kwargs, _EXTRA_KWARGS,
                                      stacklevel=3)
    refuse_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    q = validation.check_is_tensor("q", q)
    v = validation.check_is_tensor("v", v)
    validation.check_ndim("v", v, 4, "[B, T, HV, V]")
    gate, decay, per_head, A_log_used, dt_bias_used = _gdn_gate(g, gk, gv, use_gate_in_kernel, A_log, dt_bias,
                                                                v.shape[2], q.device)
    beta_used = ones_betas(tuple(v.shape[:3]), v.device) if beta is None else beta
    shape = check_tokens(q, k, v, decay, beta_used, per_head_gate=per_head)
    call = pool_call(q, k, v, decay, beta_used, gate=gate, A_log=A_log_used, dt_bias=dt_bias_used, lower_bound=-5.0,
                     scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     qk_l2norm=use_qk_l2norm_in_kernel, beta_logits=use_beta_sigmoid_in_kernel,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                     num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state, out=out,
                     shape=shape)
    remember_steady(key, call, A_log, dt_bias, num_accepted_tokens, beta)
    return call


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool | None = None,
    out: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA 0.6.0's ``fused_recurrent_gated_delta_rule`` (GatedDeltaNet, one decay per token and value head) on
    cute_kda's decode kernel, with the pool keywords of :func:`fused_recurrent_kda` (the module doc has the
    contract; FLA's own GatedDeltaNet kernel has no pool).

    The gate: ``g`` bf16 ``[B, T, HV]``, the log decay, or with ``use_gate_in_kernel`` the raw input of
    ``−exp(A_log) · softplus(g + dt_bias)`` (``A_log`` ``[HV]`` required, ``dt_bias`` ``[HV]`` or None: zeros);
    or ``gk`` bf16 ``[B, T, HV, K]`` alone, a per-channel log decay. beta None: ones (as FLA; made once per shape
    and device, not per call). States, the pool, packing, outputs, the no-sync rule and the steady calls' fast
    path: as :func:`fused_recurrent_kda`.
    """
    if ssm_state_indices is not None and out is not None and inplace_final_state is not False and not kwargs \
            and not allow_neg_eigval and gv is None and (g is None or gk is None) and steady_launch(
                "gdn g" if gk is None else "gdn gk", q, k, v, g if gk is None else gk, beta, A_log, dt_bias, scale,
                initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, None,
                state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, out):
        return out, initial_state
    call = gated_delta_rule_call(q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                 use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
                                 ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                                 inplace_final_state=inplace_final_state, out=out, **kwargs)
    return call.run()


# ---------------------------------------------------------------------------------------------
# FLA's dispatched fused_recurrent_kda_fwd (the backend's translation, cute_kda.fla_backend)


def fla_fwd_call(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                 output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                 ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                 use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                 lower_bound=None, out=None, **kwargs) -> PoolCall:
    """The :class:`PoolCall` of an FLA ``fused_recurrent_kda_fwd`` call (its signature, fla-core 0.6.0), refusing
    what FLA computes differently from the pool contract: 1-D ``ssm_state_indices`` with sequences of more than one
    token (FLA's kernel writes token t's state to ``ssm_state_indices[n + t]``, another sequence's slot)."""
    if isinstance(ssm_state_indices, torch.Tensor) and ssm_state_indices.dim() == 1 and isinstance(q, torch.Tensor):
        single = q.shape[1] == 1 if cu_seqlens is None else q.shape[1] == cu_seqlens.shape[0] - 1
        if not single:
            raise NotImplementedError("1-D ssm_state_indices with sequences of more than one token (FLA writes "
                                      "token t's state to ssm_state_indices[n + t])")
    return kda_call(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                    lower_bound, state_v_first, cu_seqlens, ssm_state_indices=ssm_state_indices,
                    num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state, out=out,
                    **kwargs)
