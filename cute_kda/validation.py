"""Input checks at the API boundary: one small function per concern, errors name the argument.

Error types: ``TypeError`` for a wrong dtype or a non-tensor, ``ValueError`` for a wrong shape,
device, layout or value, ``NotImplementedError`` for a size or feature the kernels do not cover
(K above 128, V above 128 and not a multiple of 128 — smaller ones are checked here at the caller's size and run
padded, :mod:`cute_kda.call`; on the training path, caller buffers). A float dtype FLA computes and the kernels
do not (fp32 q, k, v or raw gate; bf16 and fp16 mixed in a call; an fp16 state with bf16 inputs) raises
:class:`UnsupportedDtypeError`, both a ``NotImplementedError`` and a ``TypeError``. q, k, v, a raw gate and ``out``
are bf16, or all fp16 (the forward kernels widen fp16 where they widen bf16, o is fp16; training runs the fp16
forward's own backward). β, ``A_log`` and ``dt_bias`` in another float dtype are converted where a call enters
instead (:func:`cast_beta`, :func:`cast_gate_parameters`).

No check here synchronises the host with the device. ``cu_seqlens`` *values* (starts at 0, ends at
T, never decreases) are read only when the tensor lives on the CPU, or when the debug switch
``CUTE_KDA_DEBUG_CHECKS=1`` is set — then a device ``cu_seqlens`` is copied to the host (a sync)
so that bad values raise instead of producing garbage. Without it a device ``cu_seqlens`` is
trusted: its length gives N, its values are read only by the kernels. The serving entry points' slot ids and
accepted counts likewise (the last sections: state pools; :func:`check_slot_values` under the switch).
"""

from __future__ import annotations

import itertools
import math
import os
from numbers import Integral, Real
from typing import Iterable, NamedTuple

import torch

from .numerics import GATES, HEAD_DIM, SUPPORTED_HEAD_DIMS, SUPPORTED_VSPLITS

LOWER_BOUND_MIN, LOWER_BOUND_MAX = -5.0, 0.0  # lower_bound must lie in [min, max)
STATE_DTYPES = (torch.bfloat16, torch.float32)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)  # q, k, v, a raw gate, out: one of these for all of them
CU_SEQLENS_DTYPES = (torch.int32, torch.int64)  # int32 as FLA's unpadding builds it; widened to int64 for the kernels
ALIGNMENT_BYTES = 16  # TMA and the DSL tensors assume 16-byte aligned base addresses
DEBUG_ENV = "CUTE_KDA_DEBUG_CHECKS"
# Kernel B indexes its per-token outputs, and the unbounded gates' K1 its g loads, with 32-bit element offsets
TOKEN_ELEMENTS_LIMIT = 2 ** 31


class ProblemShape(NamedTuple):
    """Sizes of one forward call: ``[batch, seq_len, heads, head_dim]`` inputs, ``num_seqs`` states
    (a NamedTuple: built on every call, and a frozen dataclass costs 1 µs more to build). ``heads``
    counts the value heads (v, β, g, the states): q and k may have fewer (grouped value heads)."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    num_seqs: int
    varlen: bool

    @property
    def total_tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """``[N, HV, V, K]``: a v-first state per sequence and value head."""
        return (self.num_seqs, self.heads, self.head_dim, self.head_dim)

    @property
    def concrete(self) -> bool:
        """Whether the sizes are plain ints (not the symbolic sizes of a trace, which caches must not key on)."""
        return type(self.batch) is int and type(self.seq_len) is int and type(self.num_seqs) is int \
            and type(self.heads) is int


def num_seqs(batch: int, cu_seqlens: torch.Tensor | None) -> int:
    """N: the sequences of a call, ``batch`` rows or ``cu_seqlens``' ``N + 1`` bounds (its length only)."""
    return batch if cu_seqlens is None else cu_seqlens.shape[0] - 1


def problem_of(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> ProblemShape:
    """The :class:`ProblemShape` of ``q`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]`` (its heads are the problem's: the
    states and the workspace are per value head) and ``cu_seqlens`` (shapes only: what the custom ops' fake
    implementations can see)."""
    batch, seq_len, _, dim = q.shape
    return ProblemShape(batch, seq_len, v.shape[2], dim, num_seqs(batch, cu_seqlens), cu_seqlens is not None)


def debug_checks_enabled() -> bool:
    """Whether ``CUTE_KDA_DEBUG_CHECKS`` asks for the checks that synchronise with the device."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def check_is_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor (torch or any DLPack array), got {type(value).__name__}")
    return value


def check_dtype(name: str, tensor: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if tensor.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must be {names}, got {str(tensor.dtype).replace('torch.', '')}")


FLA_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the float dtypes FLA's kernels take


class UnsupportedDtypeError(NotImplementedError, TypeError):
    """A float dtype FLA computes but the kernels do not (fp32 activations, bf16 and fp16 mixed in one call, an fp16
    state with bf16 inputs): not implemented, so the FLA backends decline the call and FLA computes it; a
    ``TypeError`` too, as every other dtype error here."""


def check_kernel_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """:func:`check_dtype` for a tensor the kernels read: a float dtype of :data:`FLA_FLOAT_DTYPES` they do not take
    raises :class:`UnsupportedDtypeError` naming the argument and the dtype."""
    if tensor.dtype in allowed:
        return
    if tensor.dtype in FLA_FLOAT_DTYPES:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        got = str(tensor.dtype).replace("torch.", "")
        raise UnsupportedDtypeError(f"{name} must be {names}, got {got}: the kernels do not take {got} here (not "
                                    f"implemented); cast it to {names}, or let FLA compute the call")
    check_dtype(name, tensor, allowed)


# β and the gate parameters are small (per token and head, per head): converted where a call enters (the FLA
# translations, cute_kda.call.resolve when its one-pass check fails, the traced kda_forward) instead of refused. Torch casts on the current stream: no sync, and autograd
# takes each gradient back to its input's dtype. Anything else (other dtypes, non-tensors) passes as it is, for the
# checks to name.
_BETA_CASTS = (torch.float16, torch.float32)
_PARAMETER_CASTS = (torch.float16, torch.bfloat16)


def cast_beta(beta: object) -> object:
    """An fp16 or fp32 β rounded to bf16, the dtype K1 reads: one elementwise cast of ``[B, T, HV]`` (6 bytes a
    token and value head moved for fp32); the rounding's cost in accuracy is in docs/numerics.md, "fp16 inputs"."""
    if isinstance(beta, torch.Tensor) and beta.dtype in _BETA_CASTS:
        return beta.to(torch.bfloat16)
    return beta


def cast_gate_parameters(A_log: object, dt_bias: object) -> tuple[object, object]:
    """A bf16 or fp16 ``A_log`` / ``dt_bias`` widened to fp32, the dtype K1 reads (exact; ``[HV]``, ``[HV, K]``)."""
    if isinstance(A_log, torch.Tensor) and A_log.dtype in _PARAMETER_CASTS:
        A_log = A_log.to(torch.float32)
    if isinstance(dt_bias, torch.Tensor) and dt_bias.dtype in _PARAMETER_CASTS:
        dt_bias = dt_bias.to(torch.float32)
    return A_log, dt_bias


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {meaning} = {list(expected)}, got {list(tensor.shape)}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, meaning: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {meaning}, got shape {list(tensor.shape)}")


def check_buffer(name: str, t: torch.Tensor, dtypes: tuple, shape: tuple, device: torch.device, *,
                 batch_stride_free: bool = False) -> None:
    """A launcher's buffer ``name``: one of ``dtypes``, ``shape``, on ``device`` and C-contiguous, else a ValueError
    naming it. ``batch_stride_free``: the first mode's stride may be any multiple of 16 bytes (a view of a buffer
    padded along the second mode), the other modes C-contiguous within it, the base 16-byte aligned."""
    if t.dtype not in dtypes or tuple(t.shape) != tuple(shape) or t.device != device:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be {names} {tuple(shape)} on {device}, got {t.dtype} {tuple(t.shape)} "
                         f"on {t.device}")
    if not batch_stride_free and not t.is_contiguous():
        raise ValueError(f"{name} must be C-contiguous, got strides {list(t.stride())}")
    if batch_stride_free:
        if not ((t.shape[0] == 0 or t[0].is_contiguous()) and _row_strides_fit(t, 1)):
            raise ValueError(f"{name} must be C-contiguous past its first mode, whose stride is a multiple of 16 "
                             f"bytes; got strides {list(t.stride())}")
        check_aligned(name, t)


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")


def check_aligned(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() and tensor.data_ptr() % ALIGNMENT_BYTES:
        raise ValueError(f"{name} must start on a {ALIGNMENT_BYTES}-byte boundary (a sliced view is not)")


def check_same_device(name: str, tensor: torch.Tensor, device: torch.device, reference: str = "q") -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but {reference} is on {device}; all tensors must share a device")


def check_on_cuda(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_cuda:
        raise ValueError(
            f"{name} must be on a CUDA device (the kernels run on Hopper GPUs), got {tensor.device}; "
            "the torch references in cute_kda.reference run on the CPU"
        )


def check_head_dim(name: str, dim: int) -> None:
    """A head dim the kernels take as it is (the decode kernels' only ones)."""
    if dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(
            f"{name} = {dim} is not supported; supported head dims: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )


def check_padded_head_dim(name: str, dim: int, *, split: bool) -> None:
    """A head dim of the chunked forward: the kernels' own, or one :mod:`cute_kda.call` maps exactly onto it,
    1 to 128 (zero-padded to 128) and, with ``split`` (V), a multiple of 128 (value heads of 128 each)."""
    if 1 <= dim <= HEAD_DIM or (split and dim % HEAD_DIM == 0):
        return
    also = f" or a multiple of {HEAD_DIM} (split into value heads of {HEAD_DIM})" if split else ""
    raise NotImplementedError(f"{name} = {dim} is not supported; the kernels take head dims up to {HEAD_DIM} (smaller "
                              f"ones run zero-padded to {HEAD_DIM}){also}")


def check_real(name: str, value: object) -> float:
    """A Python number (not a tensor: reading a device scalar would synchronise)."""
    if type(value) is float:  # the common case, without the abstract-class checks below
        return value
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    return float(value)


def check_scale(scale: object) -> float:
    """A finite, non-zero Python float (an integer is refused: ``scale=1`` is more likely a slip
    for a flag than a wish for unscaled scores; pass ``1.0``)."""
    if type(scale) is not float and isinstance(scale, Integral) and not isinstance(scale, bool):
        raise TypeError(f"scale must be a Python float, got int {scale!r}; pass {float(scale)!r} if that is meant")
    value = check_real("scale", scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    if value == 0.0:
        raise ValueError("scale must be non-zero (scale = 0 makes every output zero); None means K ** -0.5")
    return value


def check_lower_bound(lower_bound: object) -> float:
    value = check_real("lower_bound", lower_bound)
    if not LOWER_BOUND_MIN <= value < LOWER_BOUND_MAX:
        raise ValueError(f"lower_bound must be in [{LOWER_BOUND_MIN}, {LOWER_BOUND_MAX}), got {value}")
    return value


def check_gate(gate: object) -> str:
    if not isinstance(gate, str) or gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    return gate


def check_gate_inputs(gate: str, g: object, A_log: object, dt_bias: object, shape: tuple[int, ...],
                      device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """g, A_log and dt_bias for ``gate``; returns whether the gate is per head. ``shape`` = ``[B, T, HV, K]``;
    ``dtype``: the call's activations' (q's).

    g is ``[B, T, HV, K]`` (per channel) or, with the unbounded gates, ``[B, T, HV]`` (one decay per value
    head, GatedDeltaNet's): a raw gate in ``dtype`` with fp32 ``A_log [HV]`` and ``dt_bias [HV, K]`` (``[HV]`` per
    head) for "safe" and "softplus", or the log decay itself, in ``dtype`` or fp32, with neither for "none".
    """
    batch, seq_len, heads, key_dim = shape
    per_head = isinstance(g, torch.Tensor) and g.dim() == 3 and gate != "safe"
    if gate != "safe" and not per_head and isinstance(g, torch.Tensor) and g.numel() > TOKEN_ELEMENTS_LIMIT:
        raise NotImplementedError(
            f"the unbounded gates' K1 reads g with 32-bit element offsets: g must hold at most 2^31 elements "
            f"(B·T·HV·K), got {g.numel()}; split the batch or the sequence"
        )
    g_shape, g_meaning = ((batch, seq_len, heads), "[B, T, HV]") if per_head else (shape, "[B, T, HV, K]")
    if gate == "none":
        _check_tensor("g", g, (dtype, torch.float32), g_shape, f"{g_meaning} (the log decay)", device, aligned=True,
                      like_q=True)
        given = [name for name, value in (("A_log", A_log), ("dt_bias", dt_bias)) if value is not None]
        if given:
            raise ValueError(f"gate='none' takes g as the log decay itself: pass {' and '.join(given)}=None")
        return per_head
    _check_activation("g", g, g_shape, g_meaning, device, dtype)
    for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
        if value is None:
            raise TypeError(f"gate={gate!r} needs {name} (an fp32 tensor); pass zeros for no {name}")
    _check_parameter("A_log", A_log, (heads,), "[HV]", device)
    if per_head:
        _check_parameter("dt_bias", dt_bias, (heads,), "[HV] (per-head gate)", device)
    else:
        _check_parameter("dt_bias", dt_bias, (heads, key_dim), "[HV, K]", device)
    return per_head


def check_value_heads(heads: int, value_heads: int) -> None:
    """Grouped value heads: HV a multiple of H (value head ``j`` reads q/k head ``j // (HV / H)``)."""
    if value_heads == 0 or value_heads % heads:
        raise ValueError(f"v must have a multiple of q's H = {heads} heads (grouped value heads), got HV = {value_heads}")


def check_vsplit(vsplit: object) -> None:
    if vsplit is not None and (isinstance(vsplit, bool) or vsplit not in SUPPORTED_VSPLITS):
        raise ValueError(f"vsplit must be None or one of {SUPPORTED_VSPLITS}, got {vsplit!r}")


def check_cu_seqlens_layout(cu_seqlens: torch.Tensor, batch: int) -> int:
    """dtype (int32 or int64), rank and length of ``cu_seqlens`` and B == 1; returns N (no device values read)."""
    check_dtype("cu_seqlens", cu_seqlens, CU_SEQLENS_DTYPES)
    check_ndim("cu_seqlens", cu_seqlens, 1, "[N+1] (cumulative sequence lengths)")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 entries (N+1 with N >= 1), got {cu_seqlens.numel()}")
    check_contiguous("cu_seqlens", cu_seqlens)
    if batch != 1:
        raise ValueError(f"q must have batch size 1 when cu_seqlens is given (packed sequences), got B = {batch}")
    return cu_seqlens.numel() - 1


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, total_tokens: int, name: str = "cu_seqlens") -> None:
    """Starts at 0, ends at T, never decreases. Reads the values: call it on a CPU tensor only
    (or deliberately, under the debug switch)."""
    bounds = cu_seqlens.tolist()
    if not bounds:
        raise ValueError(f"{name} must not be empty")
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    if bounds[-1] != total_tokens:
        raise ValueError(f"{name} must end at T = {total_tokens} (q.shape[1]), got {bounds[-1]}")
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b < a:
            raise ValueError(f"{name} must not decrease, but {name}[{i + 1}] = {b} < {name}[{i}] = {a}")


def check_state(name: str, state: torch.Tensor, problem: ProblemShape, device: torch.device,
                value_dim: int | None = None, *, dtype: torch.dtype = torch.bfloat16) -> None:
    """A recurrent state: bf16 or fp32 ``[N, H, V, K]`` (v-first), contiguous, on q's device; V = K unless
    ``value_dim`` says; fp16 too when the activations (``dtype``, q's) are fp16 (an inference call: K2 widens it on
    load and rounds to it on store)."""
    d = problem.head_dim
    shape = (problem.num_seqs, problem.heads, d if value_dim is None else value_dim, d)
    allowed = STATE_DTYPES + (torch.float16,) if dtype == torch.float16 else STATE_DTYPES
    _check_tensor(name, state, allowed, shape, "[N, H, V, K]", device, aligned=True)


def check_state_pair(initial_state: torch.Tensor | None, final_state: torch.Tensor | None) -> None:
    """An fp16 state and an fp32 one do not meet in a call (K2 stages either through one buffer): refused by name."""
    if initial_state is None or final_state is None:
        return
    if {initial_state.dtype, final_state.dtype} == {torch.float16, torch.float32}:
        got, other = (str(t.dtype).replace("torch.", "") for t in (final_state, initial_state))
        raise UnsupportedDtypeError(f"final_state is {got} but initial_state is {other}: fp16 and fp32 states in one "
                                    f"call are not implemented; pass final_state in {other} (or bf16)")


def needs_autograd(*tensors: object) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode is on (not ``torch.no_grad()`` /
    ``torch.inference_mode()``) and one of them is a tensor that requires grad."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)




def check_training_size(tensor: torch.Tensor, name: str = "q") -> None:
    """A training call's per-token tensors must have at most 2^31 elements (B·T·H·K): Kernel B's stores
    of dq, dk, dg and dβ compute 32-bit element offsets, which would wrap past that."""
    if tensor.numel() > TOKEN_ELEMENTS_LIMIT:
        raise NotImplementedError(
            f"training calls need B·T·H·K ≤ 2^31 elements per tensor (Kernel B's 32-bit offsets); {name} has "
            f"{tensor.numel()}: split the batch"
        )


def check_trainable(gate: str, q: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse a training call the backward kernels do not cover: grouped value heads with the safe gate (its Kernel B
    writes dq, dk per q/k head). What trains: bf16 or fp16 activations (fp16: the fp16 forward's own backward,
    :mod:`cute_kda.executors.training`), the safe gate with HV = H, and the unbounded gates ("softplus", "none") per
    channel or per head (GatedDeltaNet), grouped value heads included."""
    if gate == "safe" and v.dim() == 4 and v.shape[2] != q.shape[2]:
        raise NotImplementedError(
            "grouped value heads (HV != H) with the safe gate have no backward yet (the unbounded gates train with "
            "them); run it under torch.no_grad() / torch.inference_mode(), or detach its inputs"
        )


def check_no_buffers_under_autograd(*, out: object, final_state: object) -> None:
    """Caller buffers are written in place, which autograd cannot record: refuse them on the training path."""
    given = [name for name, buffer in (("out", out), ("final_state", final_state)) if buffer is not None]
    if given:
        raise NotImplementedError(
            f"{' and '.join(given)}= {'buffers are' if len(given) > 1 else 'buffer is'} not supported when inputs "
            "require grad (autograd needs outputs of its own); drop the argument and use the returned tensors"
        )


_BF16, _FP32 = (torch.bfloat16,), (torch.float32,)


def _fits(tensor: object, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], device: torch.device,
          aligned: bool) -> bool:
    """Whether ``tensor`` passes :func:`_check_tensor`, in one test."""
    return (isinstance(tensor, torch.Tensor) and tensor.dtype in dtypes and tensor.shape == shape
            and tensor.is_contiguous() and tensor.device == device
            and not (aligned and tensor.data_ptr() % ALIGNMENT_BYTES))


def _all_fit(tensors: tuple, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether every one of ``tensors`` passes :func:`_fits` (aligned): one frame for the activations of a call."""
    for tensor in tensors:
        if not (isinstance(tensor, torch.Tensor) and tensor.dtype in dtypes and tensor.shape == shape
                and tensor.is_contiguous() and tensor.device == device and not tensor.data_ptr() % ALIGNMENT_BYTES):
            return False
    return True


def _check_tensor(name: str, tensor: object, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], meaning: str,
                  device: torch.device, *, aligned: bool, like_q: bool = False) -> None:
    """A tensor of one of ``dtypes`` with ``shape``, C-contiguous, on ``device`` and, when ``aligned``, on a
    16-byte boundary. ``like_q``: ``dtypes[0]`` is q's activation dtype, and the other one of
    :data:`ACTIVATION_DTYPES` is refused as a mix (:func:`check_activation_dtype`)."""
    if _fits(tensor, dtypes, shape, device, aligned):
        return  # the common case in one test; otherwise the checks below name what is wrong
    t = check_is_tensor(name, tensor)
    if like_q:
        check_activation_dtype(name, t, dtypes[0])
    check_kernel_dtype(name, t, dtypes)
    check_shape(name, t, shape, meaning)
    check_contiguous(name, t)
    check_same_device(name, t, device)
    if aligned:
        check_aligned(name, t)


def _check_activation(name: str, tensor: object, shape: tuple[int, ...], meaning: str, device: torch.device,
                      dtype: torch.dtype = torch.bfloat16) -> None:
    """A token tensor in ``dtype`` (q's, one of :data:`ACTIVATION_DTYPES`): the other one is refused as a mix."""
    _check_tensor(name, tensor, (dtype,), shape, meaning, device, aligned=True, like_q=name != "q")


def check_activation_dtype(name: str, tensor: torch.Tensor, q_dtype: torch.dtype) -> None:
    """``tensor`` (an activation of a call whose q is ``q_dtype``) is not the other of :data:`ACTIVATION_DTYPES`:
    bf16 and fp16 in one call are refused by name (:class:`UnsupportedDtypeError`; the kernels read one dtype)."""
    if tensor.dtype != q_dtype and tensor.dtype in ACTIVATION_DTYPES and q_dtype in ACTIVATION_DTYPES:
        got, want = (str(d).replace("torch.", "") for d in (tensor.dtype, q_dtype))
        raise UnsupportedDtypeError(f"{name} is {got} but q is {want}: q, k, v, a raw g and out must share one dtype "
                                    f"(bf16 and fp16 mixed in one call are not implemented); cast {name} to {want}")


def _check_parameter(name: str, tensor: object, shape: tuple[int, ...], meaning: str, device: torch.device) -> None:
    _check_tensor(name, tensor, _FP32, shape, meaning, device, aligned=False)


def plain_forward(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out, cu_seqlens,
                  vsplit, gate) -> ProblemShape | None:
    """The :class:`ProblemShape` of a plain call, tested in one pass, else None: torch tensors only, no
    ``cu_seqlens``, the safe gate, no grouped value heads (a small call's host time is mostly checks). It only
    ever answers for a call that :func:`validate_forward`'s checks accept; None sends the call through them,
    and they name what is wrong."""
    if not (gate == "safe" and cu_seqlens is None and isinstance(q, torch.Tensor) and type(lower_bound) is float
            and LOWER_BOUND_MIN <= lower_bound < LOWER_BOUND_MAX
            and (scale is None or (type(scale) is float and scale != 0.0 and math.isfinite(scale)))
            and (vsplit is None or (type(vsplit) is int and vsplit in SUPPORTED_VSPLITS))):
        return None
    shape, device = q.shape, q.device
    if len(shape) != 4 or shape[1] == 0 or shape[3] not in SUPPORTED_HEAD_DIMS:
        return None
    batch, seq_len, heads, dim = shape
    state_shape = (batch, heads, dim, dim)
    activations = (q.dtype,)
    if (q.dtype in ACTIVATION_DTYPES and q.is_contiguous() and not q.data_ptr() % ALIGNMENT_BYTES  # q: shape, device
            and _all_fit((k, v, g) if out is None else (k, v, g, out), activations, shape, device)
            and _fits(beta, _BF16, (batch, seq_len, heads), device, True)
            and _fits(A_log, _FP32, (heads,), device, False) and _fits(dt_bias, _FP32, (heads, dim), device, False)
            and (initial_state is None or _fits(initial_state, STATE_DTYPES, state_shape, device, True))
            and (final_state is None or _fits(final_state, STATE_DTYPES, state_shape, device, True))):
        return tuple.__new__(ProblemShape, (batch, seq_len, heads, dim, batch, False))  # without NamedTuple's __new__
    return None


def validate_forward(
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    *,
    A_log: object,
    dt_bias: object,
    lower_bound: object,
    scale: object,
    initial_state: object = None,
    final_state: object = None,
    out: object = None,
    cu_seqlens: object = None,
    vsplit: object = None,
    gate: object = "safe",
) -> ProblemShape:
    """Check every argument of :func:`cute_kda.kda_forward` (see its docstring for the contract).

    Structure first (types, dtypes, shapes, layouts, devices agreeing with q), so these checks run
    on CPU tensors too; whether the device is a GPU is :func:`check_on_cuda`'s separate concern.
    """
    plain = plain_forward(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
                          cu_seqlens, vsplit, gate)
    if plain is not None:
        return plain
    q = check_is_tensor("q", q)
    check_ndim("q", q, 4, "[B, T, H, K]")
    batch, seq_len, heads, key_dim = q.shape
    check_padded_head_dim("K (q.shape[-1])", key_dim, split=False)
    if seq_len == 0:
        raise ValueError("q must hold at least one token (T = q.shape[1] is 0)")
    device = q.device
    check_kernel_dtype("q", q, ACTIVATION_DTYPES)
    dtype = q.dtype
    _check_activation("q", q, (batch, seq_len, heads, key_dim), "[B, T, H, K]", device, dtype)
    _check_activation("k", k, (batch, seq_len, heads, key_dim), "[B, T, H, K]", device, dtype)
    v = check_is_tensor("v", v)
    check_ndim("v", v, 4, "[B, T, HV, V]")
    value_dim = v.shape[-1]
    check_padded_head_dim("V (v.shape[-1])", value_dim, split=True)
    if v.dim() == 4 and v.shape[2] != heads:
        check_value_heads(heads, v.shape[2])
        heads = v.shape[2]  # from here on: the value heads (the state, the workspace, K2)
    _check_activation("v", v, (batch, seq_len, heads, value_dim), "[B, T, HV, V]", device, dtype)
    check_gate(gate)
    check_gate_inputs(gate, g, A_log, dt_bias, (batch, seq_len, heads, key_dim), device, dtype)
    _check_tensor("beta", beta, _BF16, (batch, seq_len, heads), "[B, T, HV]", device, aligned=True)
    if gate == "safe":
        check_lower_bound(lower_bound)
    if scale is not None:
        check_scale(scale)
    check_vsplit(vsplit)

    num_seqs, varlen = batch, cu_seqlens is not None
    if varlen:
        cu_seqlens = check_is_tensor("cu_seqlens", cu_seqlens)
        num_seqs = check_cu_seqlens_layout(cu_seqlens, batch)
        if cu_seqlens.device.type == "cpu":
            check_cu_seqlens_values(cu_seqlens, seq_len)
        else:
            check_same_device("cu_seqlens", cu_seqlens, device)
    problem = ProblemShape(batch, seq_len, heads, key_dim, num_seqs, varlen)

    if initial_state is not None:
        check_state("initial_state", initial_state, problem, device, value_dim, dtype=dtype)
    if final_state is not None:
        check_state("final_state", final_state, problem, device, value_dim, dtype=dtype)
        check_state_pair(initial_state, final_state)
    if out is not None:
        _check_activation("out", out, (batch, seq_len, heads, value_dim), "[B, T, HV, V]", device, dtype)
    return problem


def device_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device, total_tokens: int) -> torch.Tensor:
    """``cu_seqlens`` on ``device`` as the kernels read it: int64.

    A CPU tensor (values already checked) is widened on the host and copied over from pinned memory,
    asynchronously on the current stream (a pageable copy would wait for the stream); an int64 device tensor is
    used as is, an int32 one widened by one small kernel on the current stream (no sync; FLA's layers build int32
    ``cu_seqlens`` for padded batches). Values are checked on the device only under ``CUTE_KDA_DEBUG_CHECKS=1``
    (that check synchronises).
    """
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens.to(torch.int64).pin_memory().to(device, non_blocking=True)
    if debug_checks_enabled():
        check_cu_seqlens_values(cu_seqlens.cpu(), total_tokens)
    return cu_seqlens.to(torch.int64)


def staged_cu_seqlens(cu_seqlens: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``cu_seqlens`` as the stages read it, int64: on q's device when that is a GPU (:func:`device_cu_seqlens`, no
    sync), else on the CPU (the reference stages)."""
    if cu_seqlens is None or not q.is_cuda:
        return None if cu_seqlens is None else cu_seqlens.to(torch.int64)
    return device_cu_seqlens(cu_seqlens, q.device, q.shape[1])


# =============================================================================================
# state pools (serving): the pool, its slot ids and their values — one set of checks for the decode / verify entry
# points (:mod:`cute_kda.serving`) and the prefill on a pool (:func:`check_prefill_pool_call`)
#
# Structure only (dtype, rank, shape, strides, device): nothing here reads a device value. The values (slot ids in
# [−1, slots), no slot twice, accepted counts in [1, 1 + S], packed lengths within the verify width) are read by
# :func:`check_slot_values` and :func:`check_pool_values`, which the entry points call only under
# ``CUTE_KDA_DEBUG_CHECKS=1`` (they synchronise).

SLOT_ID_DTYPES = (torch.int32,)
CHECKPOINT_GRANULE = 64  # prefix checkpoints fall on multiples of 64 tokens (whole K2 tiles of the engines' blocks)


def _row_strides_fit(tensor: torch.Tensor, modes: int) -> bool:
    """The first ``modes`` strides are multiples of 16 bytes (so every row of the rest starts 16-byte aligned when
    the base does)."""
    per_vector = ALIGNMENT_BYTES // tensor.element_size()
    strides = tensor.stride()
    return all(strides[d] % per_vector == 0 for d in range(modes))


def check_state_pool(name: str, pool: object, value_heads: int, device: torch.device, slots: int | None = None
                     ) -> torch.Tensor:
    """A state pool: fp32 or bf16 ``[slots, HV, 128, 128]`` on ``device`` (``slots`` exactly when given, else at
    least one), each ``[128, 128]`` state block contiguous, the base and the slot and head strides 16-byte multiples
    (a strided view of a larger cache is fine). Which of the two inner modes is V is the caller's layout."""
    pool = check_is_tensor(name, pool)
    check_dtype(name, pool, STATE_DTYPES)
    meaning = "[slots, HV, 128, 128] (a state pool)"
    check_ndim(name, pool, 4, meaning)
    block = tuple(pool.shape[2:])
    if block != (HEAD_DIM, HEAD_DIM) and block[0] == block[1]:
        raise NotImplementedError(f"{name}: states of {list(block)} are not supported; the kernels are written for "
                                  f"K = V = {HEAD_DIM}")
    check_shape(name, pool, (pool.shape[0] if slots is None else slots, value_heads, HEAD_DIM, HEAD_DIM), meaning)
    if slots is None and pool.shape[0] == 0:
        raise ValueError(f"{name} (a state pool) must hold at least one slot, got shape {list(pool.shape)}")
    if pool.stride(3) != 1 or pool.stride(2) != HEAD_DIM:
        raise ValueError(f"{name}: each [128, 128] state block must be contiguous (strides [..., 128, 1]), got "
                         f"strides {list(pool.stride())}")
    if not _row_strides_fit(pool, 2):
        raise ValueError(f"{name}: the slot and head strides must be multiples of 16 bytes, got strides "
                         f"{list(pool.stride())}")
    check_aligned(name, pool)
    check_same_device(name, pool, device)
    return pool


def check_slot_ids(name: str, ids: object, shape: tuple[int, ...], meaning: str, device: torch.device
                   ) -> torch.Tensor:
    """Pool slot ids (−1: none): contiguous int32 of ``shape`` on ``device`` (values not read)."""
    ids = check_is_tensor(name, ids)
    check_dtype(name, ids, SLOT_ID_DTYPES)
    check_ndim(name, ids, len(shape), meaning)
    check_shape(name, ids, shape, meaning)
    check_contiguous(name, ids)
    check_same_device(name, ids, device)
    return ids


def check_accepted_counts(name: str, counts: object, num_seqs: int, device: torch.device) -> torch.Tensor:
    """Accepted token counts of a verify: contiguous int32 ``[N]`` on ``device``."""
    counts = check_is_tensor(name, counts)
    check_dtype(name, counts, SLOT_ID_DTYPES)
    check_shape(name, counts, (num_seqs,), "[N] (accepted tokens per sequence)")
    check_contiguous(name, counts)
    check_same_device(name, counts, device)
    return counts


def check_slot_values(slots: int, named: list[tuple[str, torch.Tensor]]) -> None:
    """Every slot id of the ``(name, ids)`` tensors in ``[−1, slots)`` and no slot listed twice across them (two
    rows, or a row and a checkpoint, would race on it). Reads the values: a sync for device tensors, so only under
    ``CUTE_KDA_DEBUG_CHECKS=1``."""
    seen: dict[int, str] = {}
    for name, tensor in named:
        values = tensor.cpu()
        for position, slot in zip(itertools.product(*map(range, values.shape)), values.flatten().tolist()):
            where = f"{name}[{', '.join(map(str, position))}]"
            if not -1 <= slot < slots:
                raise ValueError(f"{where} = {slot} is not a slot of the pool (0 <= slot < {slots}, or -1 for none)")
            if slot >= 0:
                if slot in seen:
                    raise ValueError(f"{where} = {slot} repeats {seen[slot]}: one call lists a pool slot once (two "
                                     "rows would race on it)")
                seen[slot] = where


def check_token_rows(name: str, tensor: torch.Tensor, aligned_rows: bool = True) -> None:
    """A per-token tensor the decode kernel reads (or writes) by rows: the last mode contiguous and, with
    ``aligned_rows``, every row starting 16-byte aligned (base and outer strides); other strides are free (q, k, v
    may be views of one fused projection)."""
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        raise ValueError(f"{name}: the last mode must be contiguous (stride 1), got strides {list(tensor.stride())}")
    if aligned_rows and not _row_strides_fit(tensor, tensor.dim() - 1):
        raise ValueError(f"{name}: every row must start on a 16-byte boundary (outer strides multiples of 16 bytes), "
                         f"got strides {list(tensor.stride())}")
    if aligned_rows:
        check_aligned(name, tensor)


def check_pool_values(slots: int, ids: torch.Tensor, counts: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                      *, ids_name: str = "state_indices", counts_name: str = "num_accepted_tokens") -> None:
    """The device values behind a decode / verify call on a pool (copies them to the host: a sync, debug only).
    ``ids`` ``[N]``, or ``[N, 1 + S]`` with ``counts`` (or without: every count 1): :func:`check_slot_values`;
    counts in ``[1, 1 + S]``; with ``cu_seqlens`` and 2-D ids, no sequence longer than ``1 + S`` tokens."""
    check_slot_values(slots, [(ids_name, ids)])
    if ids.dim() != 2:
        return
    width = ids.shape[1]
    if counts is not None:
        host_counts = counts.cpu()
        if host_counts.numel() and (int(host_counts.min()) < 1 or int(host_counts.max()) > width):
            raise ValueError(f"{counts_name} must lie in [1, {width}] (1 + S, the width of {ids_name}), got "
                             f"{host_counts.tolist()}")
    if cu_seqlens is not None:
        lengths = cu_seqlens.cpu().diff()
        if lengths.numel() and int(lengths.max()) > width:
            raise ValueError(f"cu_seqlens: a verified sequence holds at most {width} tokens (the width of "
                             f"{ids_name}), got lengths {lengths.tolist()}")


# ---------------------------------------------------------------------------------------------
# Prefill on a state pool: the pool and slot ids as above, and the prefix checkpoints


def check_checkpoint_every(checkpoint_every: object) -> int:
    """A positive Python int, a multiple of :data:`CHECKPOINT_GRANULE` tokens."""
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, Integral):
        raise TypeError(f"checkpoint_every must be a Python int (tokens), got {type(checkpoint_every).__name__}")
    if checkpoint_every <= 0 or checkpoint_every % CHECKPOINT_GRANULE:
        raise ValueError(f"checkpoint_every must be a positive multiple of {CHECKPOINT_GRANULE} tokens, "
                         f"got {checkpoint_every}")
    return int(checkpoint_every)


def check_prefill_pool_call(problem: ProblemShape, device: torch.device, *, initial_state: object,
                            state_indices: object, checkpoint_every: object, checkpoint_indices: object,
                            final_state: object) -> int:
    """The pool arguments of a :func:`cute_kda.kda_forward` call (structure only; the slot values under
    ``CUTE_KDA_DEBUG_CHECKS=1``, :func:`check_slot_values`). Returns ``checkpoint_every`` (0: none)."""
    if state_indices is None:
        for name, value in (("checkpoint_indices", checkpoint_indices), ("checkpoint_every", checkpoint_every)):
            if value is not None:
                raise ValueError(f"{name} writes into a state pool: pass initial_state=pool with state_indices")
        return 0
    if initial_state is None:
        raise ValueError("state_indices selects slots of a state pool: pass the pool as initial_state")
    pool = check_state_pool("initial_state", initial_state, problem.heads, device)
    check_slot_ids("state_indices", state_indices, (problem.num_seqs,), "[N] (a pool slot per sequence)", device)
    if final_state is not None and not (final_state is pool or (
            isinstance(final_state, torch.Tensor) and final_state.data_ptr() == pool.data_ptr()
            and final_state.shape == pool.shape and final_state.stride() == pool.stride()
            and final_state.dtype == pool.dtype)):
        raise ValueError("final_state contradicts the state pool: with state_indices the final states are written "
                         "into initial_state's slots in place; pass final_state=None (or the pool itself)")
    if (checkpoint_every is None) != (checkpoint_indices is None):
        given, missing = (("checkpoint_every", "checkpoint_indices") if checkpoint_indices is None
                          else ("checkpoint_indices", "checkpoint_every"))
        raise ValueError(f"{given} needs {missing}: prefix checkpoints take both")
    if checkpoint_indices is None:
        every = 0
    else:
        every = check_checkpoint_every(checkpoint_every)
        meaning = "[N, M] (a pool slot per sequence and checkpoint)"
        indices = check_is_tensor("checkpoint_indices", checkpoint_indices)
        check_ndim("checkpoint_indices", indices, 2, meaning)
        check_slot_ids("checkpoint_indices", indices, (problem.num_seqs, indices.shape[1]), meaning, device)
    if debug_checks_enabled():
        named = [("state_indices", state_indices)]
        if checkpoint_indices is not None:
            named.append(("checkpoint_indices", checkpoint_indices))
        check_slot_values(pool.shape[0], named)
    return every
