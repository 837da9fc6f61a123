"""Head dims other than the kernels' K = V = 128, computed exactly on the 128 kernels (docs/numerics.md, "Other head
dims"), except an inference call at K = V = 64, which the forward kernels compile for (:func:`runs_native`).

A call with K < 128 and / or V < 128 runs zero-padded: q, k (and a per-channel gate g, ``dt_bias``) get zero channels
up to K = 128, v zero columns up to V = 128, the initial state both. The padded rows and columns of the state stay zero
under every gate and the delta update, so the caller's part of every output and gradient is the unpadded call's. A
call with V a multiple of 128 (GatedDeltaNet's ``expand_v = 2``: K = 128, V = 256) runs each value head as V / 128
value heads of 128 columns: the columns of the state never mix, so the heads are independent; g, β, ``A_log`` and
``dt_bias`` are repeated per split head (autograd sums the repeats' gradients). Split head ``j · s + r`` (s = V / 128)
holds columns ``[128 r, 128 r + 128)`` of value head ``j``, so with grouped value heads it still reads q/k head
``j // (HV / H)``. A training call with the safe gate (whose backward takes no grouped value heads) gets q and k
repeated the same way instead.

Everything here is torch ops on the caller's stream (no host sync), recorded by autograd: :func:`to_kernel_dims`
before :func:`cute_kda.call.resolve` resolves the 128 call, :meth:`CallerDims.restore` on its results. K > 128 and V
> 128 not a multiple of 128 are refused (:func:`cute_kda.validation.check_padded_head_dim`), so FLA's backend computes
them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .numerics import HEAD_DIM, NATIVE_HEAD_DIMS

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


def runs_native(dims: HeadDims, training: bool) -> bool:
    """Whether a call at the caller's ``dims`` runs on kernels compiled for them, unpadded: K = V, one of
    :data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`, and no autograd (the backward kernels take 128 only, so a training
    call at 64 runs padded)."""
    return not training and dims.key_dim == dims.value_dim and dims.key_dim in NATIVE_HEAD_DIMS


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
