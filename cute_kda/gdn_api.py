"""FLA's ``chunk_gated_delta_rule`` (GatedDeltaNet) on cute_kda's kernels: :func:`chunk_gated_delta_rule`.

GatedDeltaNet (Qwen3-Next, Qwen3.5) is the KDA recurrence with one decay per value head, broadcast over
the K channels, and grouped value heads (GVA: HV a multiple of H). :func:`translate_fla_gdn_call` is a
pure function of flash-linear-attention's arguments (fla-core 0.6.0): it checks them the way FLA does,
raises ``NotImplementedError`` naming the flag for what cute_kda's kernels do not cover, and returns a
:class:`GdnCall`, the canonical description :func:`cute_kda.kda_forward` computes (a per-head g
``[B, T, HV]``, the gate "softplus" or "none"). The translation launches nothing and needs no device;
the CPU tests run it against the gold token recurrence (:func:`cute_kda.reference.gold_forward` with
``g`` ``[B, T, HV]``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import interop, validation
from .api import kda_forward, refuse_neg_eigval

_GDN_CHUNK_SIZES = (16, 32, 64)
_GDN_EXTRA_KWARGS = ("transpose_state_layout", "head_first", "chunk_size", "use_gate_in_kernel", "A_log", "dt_bias")
GDN_GATES = ("softplus", "none")  # raw input through −exp(A_log)·softplus(g + dt_bias), or the log decay itself


@dataclass(frozen=True)
class GdnCall:
    """A canonical GatedDeltaNet forward equivalent to an FLA ``chunk_gated_delta_rule`` call.

    ``tensors`` = (q, k, v, g, beta), contiguous, dtypes as given: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    g ``[B, T, HV]`` (the raw gate input for ``gate="softplus"``, the per-token log decay for ``"none"``);
    beta ``[B, T, HV]`` (logits when ``beta_logits``).

    ``options``, the keywords of the canonical forward: ``scale`` (float, resolved), ``gate`` (one of
    ``GDN_GATES``), ``A_log`` fp32 ``[HV]`` (softplus gate; None for ``"none"``), ``dt_bias`` fp32 ``[HV]`` or
    None (no bias), ``qk_l2norm``, ``beta_logits``, ``initial_state`` (None, or contiguous v-first
    ``[N, HV, V, K]`` in the caller's fp32 / bf16), ``output_final_state``, ``cu_seqlens`` (int ``[N+1]``, B = 1).

    ``state_k_first``: the caller's states are FLA's default ``[N, HV, K, V]``, so the v-first final state
    is transposed back (into a contiguous tensor) on the way out.
    """

    tensors: tuple[torch.Tensor, ...]
    options: dict[str, Any]
    state_k_first: bool

    def run(self, forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, Any]:
        """Call ``forward`` (a canonical GatedDeltaNet forward: ``forward(q, k, v, g, beta, **options)`` →
        (o ``[B, T, HV, V]``, v-first final state or None)) and hand back as FLA does: the final state fp32
        (whatever the initial state's dtype) in the caller's layout."""
        o, state = forward(*self.tensors, **self.options)
        if state is not None:
            state = state.transpose(-1, -2) if self.state_k_first else state
            state = state.to(torch.float32).contiguous()
        return o, state


def translate_fla_gdn_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> GdnCall:
    """Map FLA ``chunk_gated_delta_rule`` arguments (fla-core 0.6.0) onto a :class:`GdnCall`.

    Pure: no kernel runs, no device is needed. What maps (the same function as FLA computes):
      - gate: ``use_gate_in_kernel=True`` is the softplus gate ``−exp(A_log) · softplus(g + dt_bias)`` per value
        head (``A_log`` ``[HV]`` required, ``dt_bias`` ``[HV]`` or None; both taken to fp32 as FLA's gate kernel
        does); ``use_gate_in_kernel=False`` (FLA's default) takes g as the log decay (any value ≤ 0, −1000
        masks included; A_log and dt_bias are then ignored, as FLA ignores them).
      - GVA: v, g, beta and the states have HV heads, HV a multiple of H; value head ``j`` reads q/k head
        ``j // (HV / H)``.
      - ``use_qk_l2norm_in_kernel`` → ``qk_l2norm``; ``use_beta_sigmoid_in_kernel`` → ``beta_logits``.
      - states: ``[N, HV, K, V]`` (default) or ``[N, HV, V, K]`` with ``state_v_first`` / the deprecated
        ``transpose_state_layout``, fp32 or bf16; the final state is fp32 in the caller's layout.
      - ``chunk_size`` (16, 32 or 64) and ``chunk_indices`` change how FLA computes, not what: accepted.
        ``cu_seqlens_cpu``, when given, is checked on the host. Inputs that are not contiguous are made so.
    What raises ``NotImplementedError`` (the flag is named): ``allow_neg_eigval=True`` (β = 2·sigmoid) and
    ``cp_context``. Errors FLA raises itself are raised the same way (``ValueError``; its
    ``DeprecationWarning`` for ``head_first``); a missing ``A_log`` with ``use_gate_in_kernel=True`` is a
    ``ValueError`` here (FLA asserts). Unknown keywords raise ``TypeError``.
    """
    unknown = sorted(set(kwargs) - set(_GDN_EXTRA_KWARGS))
    if unknown:
        raise TypeError(f"chunk_gated_delta_rule got unexpected keyword arguments: {', '.join(unknown)}")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass either state_v_first or the deprecated transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first", DeprecationWarning,
                      stacklevel=2)
        state_v_first = bool(kwargs["transpose_state_layout"])
    if "head_first" in kwargs:  # FLA raises the warning class itself
        raise DeprecationWarning("head_first has been removed; inputs must be in [B, T, H, ...] format")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in _GDN_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be 16, 32 or 64 for the gated delta rule, got {chunk_size}")
    refuse_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if cp_context is not None:
        raise NotImplementedError("cp_context (context parallelism) is not supported")

    batch, seq_len, heads, value_heads = _check_gdn_shapes(q, k, v, g, beta)
    gate, A_log, dt_bias = _gdn_gate(bool(kwargs.get("use_gate_in_kernel", False)), kwargs.get("A_log"),
                                     kwargs.get("dt_bias"), value_heads)
    if cu_seqlens is not None:
        validation.check_is_tensor("cu_seqlens", cu_seqlens)
        if batch != 1:
            raise ValueError(f"the batch size must be 1 with cu_seqlens (flatten variable-length inputs), got {batch}")
        if cu_seqlens_cpu is not None:
            validation.check_is_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
            validation.check_cu_seqlens_values(cu_seqlens_cpu, seq_len, name="cu_seqlens_cpu")
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        validation.check_is_tensor("initial_state", initial_state)
        validation.check_dtype("initial_state", initial_state, validation.STATE_DTYPES)
        meaning = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
        validation.check_ndim("initial_state", initial_state, 4, meaning)
        if initial_state.shape[0] != num_seqs:
            raise ValueError(f"initial_state must hold one state per sequence ({num_seqs}), got "
                             f"{initial_state.shape[0]}")
        inner = (v.shape[3], q.shape[3]) if state_v_first else (q.shape[3], v.shape[3])
        validation.check_shape("initial_state", initial_state, (num_seqs, value_heads, *inner), meaning)
        initial_state = (initial_state if state_v_first else initial_state.transpose(-1, -2)).contiguous()

    options = dict(
        scale=float(q.shape[3] ** -0.5 if scale is None else validation.check_real("scale", scale)),
        gate=gate, A_log=A_log, dt_bias=dt_bias, qk_l2norm=bool(use_qk_l2norm_in_kernel),
        beta_logits=bool(use_beta_sigmoid_in_kernel), initial_state=initial_state,
        output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens,
    )
    tensors = tuple(x.contiguous() for x in (q, k, v, g, beta))
    return GdnCall(tensors=tensors, options=options, state_k_first=not state_v_first)


def _check_gdn_shapes(q: Any, k: Any, v: Any, g: Any, beta: Any) -> tuple[int, int, int, int]:
    """FLA's shape rules for GatedDeltaNet → (B, T, H, HV)."""
    for name, x, ndim, meaning in (("q", q, 4, "[B, T, H, K]"), ("k", k, 4, "[B, T, H, K]"), ("v", v, 4, "[B, T, HV, V]"),
                                   ("g", g, 3, "[B, T, HV]"), ("beta", beta, 3, "[B, T, HV]")):
        validation.check_is_tensor(name, x)
        validation.check_ndim(name, x, ndim, meaning)
    batch, seq_len, heads, key_dim = q.shape
    if k.shape[2] != heads:
        raise ValueError(f"q and k must have the same number of heads, got {heads} and {k.shape[2]}")
    validation.check_shape("k", k, tuple(q.shape), "[B, T, H, K]")
    value_heads = v.shape[2]
    if value_heads % heads:
        raise ValueError(f"for GVA the value heads (HV = {value_heads}) must be a multiple of the q/k heads "
                         f"(H = {heads})")
    validation.check_shape("v", v, (batch, seq_len, value_heads, v.shape[3]), "[B, T, HV, V]")
    validation.check_shape("g", g, (batch, seq_len, value_heads), "[B, T, HV]")
    validation.check_shape("beta", beta, (batch, seq_len, value_heads), "[B, T, HV]")
    return batch, seq_len, heads, value_heads


def _gdn_gate(use_gate_in_kernel: bool, A_log: Any, dt_bias: Any, value_heads: int
              ) -> tuple[str, torch.Tensor | None, torch.Tensor | None]:
    """(gate, A_log fp32 [HV] or None, dt_bias fp32 [HV] or None) of FLA's gate flags."""
    if not use_gate_in_kernel:
        return "none", None, None
    if A_log is None:
        raise ValueError("A_log must be provided when use_gate_in_kernel=True")
    out = []
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is None:
            out.append(None)
            continue
        validation.check_is_tensor(name, x)
        if x.numel() != value_heads:
            raise ValueError(f"{name} must hold HV = {value_heads} values, got shape {list(x.shape)}")
        out.append(x.reshape(value_heads).to(torch.float32).contiguous())
    return "softplus", out[0], out[1]


def chunk_gated_delta_rule(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Any = None,
    cu_seqlens_cpu: Any = None,
    chunk_indices: Any = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Drop-in for ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (fla-core 0.6.0 signature), forward.

    Shapes as in FLA: q, k bf16 ``[B, T, H, K]``; v bf16 ``[B, T, HV, V]``, HV a multiple of H (value head
    ``j`` reads q/k head ``j // (HV / H)``); g ``[B, T, HV]``: the log decay (bf16 or fp32, FLA's default
    ``use_gate_in_kernel=False``) or with ``use_gate_in_kernel=True`` the raw bf16 input of
    ``−exp(A_log) · softplus(g + dt_bias)`` (keywords ``A_log`` ``[HV]``, ``dt_bias`` ``[HV]`` or None);
    beta bf16 ``[B, T, HV]`` (logits with ``use_beta_sigmoid_in_kernel``); ``initial_state`` fp32 or bf16
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); ``cu_seqlens`` int32 or int64 ``[N+1]`` with B = 1.
    K = V = 128. Returns (o bf16 ``[B, T, HV, V]``, the final state fp32 in the caller's layout or None), in
    ``q``'s framework, computed by K1 (one decay per head on every channel, overflow-free for any gate value)
    and K2 on the current stream, with no host synchronisation.

    Training: inputs that require grad get the backward of :mod:`cute_kda.autograd` (Kernel B's per-head form; dq,
    dk summed over each group of value heads), eagerly or under torch.compile (the training ops of
    :mod:`cute_kda.torch_ops`). Flags as :func:`translate_fla_gdn_call`.
    """
    as_torch = interop.as_torch
    call = translate_fla_gdn_call(
        as_torch(q), as_torch(k), as_torch(v), as_torch(g), as_torch(beta), scale=scale,
        initial_state=as_torch(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=as_torch(cu_seqlens),
        cu_seqlens_cpu=as_torch(cu_seqlens_cpu), chunk_indices=chunk_indices, cp_context=cp_context,
        **{name: as_torch(value) for name, value in kwargs.items()},
    )
    return interop.answer_in_framework(q, lambda: call.run(gdn_forward))


def gdn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                gate: str, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A :class:`GdnCall`'s canonical forward by :func:`cute_kda.kda_forward` (the softplus gate without dt_bias:
    zeros, :func:`kernel_dt_bias`)."""
    return kda_forward(q, k, v, g, beta, gate=gate, A_log=A_log, dt_bias=kernel_dt_bias(gate, dt_bias, v), **options)


def kernel_dt_bias(gate: str, dt_bias: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor | None:
    """The dt_bias the kernels take: the call's own, or zeros ``[HV]`` for a softplus call without one."""
    if gate == "softplus" and dt_bias is None:
        return torch.zeros(v.shape[2], dtype=torch.float32, device=v.device)
    return dt_bias


def gate_bias(call: GdnCall) -> torch.Tensor | None:
    """The dt_bias :func:`gdn_forward` hands the kernels for ``call``."""
    return kernel_dt_bias(call.options["gate"], call.options["dt_bias"], call.tensors[2])
