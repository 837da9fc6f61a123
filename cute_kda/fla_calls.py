"""flash-linear-attention's calls translated into cute_kda's: ``chunk_kda`` (KDA) and ``chunk_gated_delta_rule``
(GatedDeltaNet), fla-core 0.6.0's signatures.

Each translation is a pure function of FLA's arguments: it checks them the way FLA does (FLA's error types and, where
FLA's code or tests match them, its texts), raises ``NotImplementedError`` naming the flag for what the kernels do
not cover, and returns the canonical :func:`cute_kda.kda_forward` call (:class:`CanonicalCall`, :class:`GdnCall`)
with the way back to FLA's layouts. Nothing is launched and no device is needed: the CPU tests run the translations
against the gold token recurrence.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import validation
from .context_parallel import ChainPart, RankChain
from .k_first_pool import run_on_k_first_pool


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
    chunk_states: int = 0  # return_intermediate_states: FLA's chunk size (tokens), else 0
    cu_seqlens_cpu: torch.Tensor | None = None
    k_first_pool: bool = False  # a prefill on a K-first state pool (:mod:`cute_kda.k_first_pool`)

    def run(self, forward: Callable[..., tuple]) -> tuple[Any, ...]:
        """Call ``forward`` (:func:`kda_forward`, or a reference with its signature) and shape the result; with
        ``chunk_states``, ``forward`` also returns the chunk states ``[B, NT, H, K, V]`` (handed back v-first when the
        caller's states are)."""
        if self.k_first_pool:
            return run_on_k_first_pool(forward, self.tensors, self.options)
        o, state, *chunk_states = forward(*self.tensors, **self.options)
        if state is not None and self.state_k_first:
            state = state.transpose(-1, -2).contiguous()
        if not chunk_states:
            return o, state
        h = chunk_states[0]
        return o, state, (h if self.state_k_first else h.transpose(-1, -2).contiguous())


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
    *,
    state_indices: torch.Tensor | None = None,
    checkpoint_every: int | None = None,
    checkpoint_indices: torch.Tensor | None = None,
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
        log decay itself (q's dtype or fp32) → ``gate="none"``, A_log and dt_bias unused.
      - q, k, v, a raw g: bf16, or fp16 (o and the gradients in fp16; docs/numerics.md, "fp16 inputs", "fp16
        training").
      - beta bf16, or fp16 / fp32 rounded to bf16 here (:func:`cute_kda.validation.cast_beta`; FLA's kernels read
        it in its own dtype, so this rounding is an error FLA does not make: docs/numerics.md, "fp16 inputs").
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
    What raises ``NotImplementedError`` (the argument is named): K > 128 or V > 128 not a multiple of 128 (smaller ones
    are padded where the canonical call is resolved, :mod:`cute_kda.call`), fp32 q, k, v or raw g, bf16 and fp16
    mixed (:class:`cute_kda.validation.UnsupportedDtypeError`, raised by the checks of the canonical call), a
    bounded gate with ``lower_bound``
    outside [-5, 0) when ``safe_gate=False``, ``allow_neg_eigval``, training grouped value heads (HV != H) with
    the safe gate, ``use_graph``, ``return_intermediate_states`` with ``cu_seqlens`` but no
    ``cu_seqlens_cpu`` (``return_intermediate_states`` otherwise returns FLA's third output ``h``, bf16
    ``[B, NT, H, K, V]``: :func:`cute_kda.executors.inference.run_keeping_chunk_states`; inference only). Errors FLA raises itself
    (``ValueError``) are raised the same way.

    ``cp_context`` (context parallelism, :func:`rank_chain_of`): FLA's context of this rank's share; its local
    ``cu_seqlens`` replace the call's and the call runs with the other ranks of its group (eager; every rank must
    call the forward and the backward). Beyond FLA, an initial state and the final states are taken (the
    ``RankChain`` docstring in :mod:`cute_kda.context_parallel` says what they mean there).

    cute_kda's extension (keyword-only, not in FLA): ``state_indices``, ``checkpoint_every``, ``checkpoint_indices``
    make the call a prefill on a state pool (:func:`translate_pool_arguments`).
    """
    state_v_first = fla_state_v_first("chunk_kda", state_v_first, kwargs, _FLA_EXTRA_KWARGS, stacklevel=3)
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in _FLA_CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")  # FLA's text
    _refuse_unsupported_fla_flags(
        allow_neg_eigval=allow_neg_eigval, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, use_graph=use_graph,
    )
    chain, cu_seqlens, cu_seqlens_cpu = _context_parallel(
        cp_context, q, cu_seqlens, cu_seqlens_cpu, return_intermediate_states=return_intermediate_states,
        pool=(state_indices, checkpoint_every, checkpoint_indices))
    if return_intermediate_states and cu_seqlens is not None and cu_seqlens_cpu is None:
        raise NotImplementedError("return_intermediate_states=True with cu_seqlens needs cu_seqlens_cpu (the chunk "
                                  "count depends on the sequence lengths; reading them would sync with the device)")
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

    pool = translate_pool_arguments(state_indices, checkpoint_every, checkpoint_indices)
    if initial_state is not None and not pool:
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
        qk_l2norm=bool(use_qk_l2norm_in_kernel), beta_logits=bool(use_beta_sigmoid_in_kernel), gate=gate, **pool,
    )
    if chain is not None:
        options["segments"] = chain
    beta = validation.cast_beta(beta)
    tensors = (q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous())
    return CanonicalCall(tensors=tensors, options=options, state_k_first=not (state_v_first or pool),
                         recompute=not disable_recompute, k_first_pool=bool(pool) and not state_v_first,
                         chunk_states=chunk_size if return_intermediate_states else 0,
                         cu_seqlens_cpu=cu_seqlens_cpu if return_intermediate_states else None)


def translate_pool_arguments(state_indices: Any, checkpoint_every: Any, checkpoint_indices: Any) -> dict[str, Any]:
    """cute_kda's extension of FLA's prefill calls: :func:`cute_kda.kda_forward`'s pool keywords (a prefill on a state
    pool, ``initial_state`` the pool, bf16 or fp32, final states written into its slots in place and the pool
    returned; prefix checkpoints into pool slots), or ``{}`` when none is given. A v-first pool
    (``state_v_first=True``, ``[slots, HV, V, K]``) is K2's TMA tensor; a K-first one (``[slots, HV, K, V]``) is staged
    through a v-first pool by torch copies on the stream (:mod:`cute_kda.k_first_pool`). The checks are
    :func:`cute_kda.kda_forward`'s."""
    return {name: value for name, value in (("state_indices", state_indices), ("checkpoint_every", checkpoint_every),
                                            ("checkpoint_indices", checkpoint_indices)) if value is not None}


def _check_fla_state_shape(state: torch.Tensor, q: torch.Tensor, v: torch.Tensor, cu_seqlens: Any,
                           state_v_first: bool) -> None:
    """The caller's state shape in the caller's layout (checked before the v-first transpose, so an
    error shows the shape that was passed)."""
    meaning = "[N, H, V, K] (state_v_first)" if state_v_first else "[N, H, K, V]"
    validation.check_ndim("initial_state", state, 4, meaning)
    packed = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
    num_seqs = validation.num_seqs(q.shape[0], cu_seqlens if packed else None)
    heads, key_dim, value_dim = v.shape[2], q.shape[3], v.shape[3]
    inner = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    validation.check_shape("initial_state", state, (num_seqs, heads, *inner), meaning)


def fla_state_v_first(entry_point: str, state_v_first: bool, kwargs: dict, allowed: frozenset[str], *,
                      stacklevel: int) -> bool:
    """FLA's ``state_v_first``, or its deprecated name ``transpose_state_layout`` (FLA's DeprecationWarning, raised
    ``stacklevel`` frames up); keywords outside ``allowed`` raise ``TypeError`` naming ``entry_point`` (FLA would
    ignore them)."""
    unknown = sorted(name for name in kwargs if name not in allowed)  # dynamo cannot trace dict_keys - frozenset
    if unknown:
        raise TypeError(f"{entry_point} got unexpected keyword arguments: {', '.join(unknown)}")
    if "transpose_state_layout" not in kwargs:
        return bool(state_v_first)
    if state_v_first:
        raise ValueError("pass either state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first", DeprecationWarning,
                  stacklevel=stacklevel + 1)
    return bool(kwargs["transpose_state_layout"])


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


def _refuse_unsupported_fla_flags(*, allow_neg_eigval: bool, use_beta_sigmoid_in_kernel: bool, use_graph: bool) -> None:
    refuse_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if use_graph:
        raise NotImplementedError(
            "use_graph=True (padded cu_seqlens for graph capture) is not supported; "
            "the kernels need no host sync, call with the real cu_seqlens"
        )


def _context_parallel(cp_context: Any, q: Any, cu_seqlens: Any, cu_seqlens_cpu: Any, *, pool: tuple,
                      return_intermediate_states: bool = False) -> tuple[RankChain | None, Any, Any]:
    """(the :class:`~cute_kda.context_parallel.RankChain` of FLA's ``cp_context`` or None, the ``cu_seqlens`` and
    ``cu_seqlens_cpu`` the call runs on). As in FLA, the context's local ``cu_seqlens`` replace the call's; a context
    without a group is a plain call on them. ``q`` must be the rank's share (``[1, T_rank, ...]``; a ``q`` that is not
    a 4-D tensor is left to the checks that name it). Refused with it: torch.compile,
    ``return_intermediate_states`` and a state pool."""
    if cp_context is None:
        return None, cu_seqlens, cu_seqlens_cpu
    if return_intermediate_states:
        raise NotImplementedError("return_intermediate_states=True with cp_context is not supported")
    if any(x is not None for x in pool):
        raise NotImplementedError("cp_context with a state pool (state_indices, checkpoint_every, "
                                  "checkpoint_indices) is not supported")
    if torch.compiler.is_compiling():
        raise NotImplementedError("cp_context under torch.compile is not supported: call chunk_kda / "
                                  "chunk_gated_delta_rule eagerly (torch.compiler.disable)")
    chain = rank_chain_of(cp_context)  # the chain keeps the host bounds: the caller's cu_seqlens_cpu goes too
    if chain is not None and isinstance(q, torch.Tensor) and q.dim() == 4:
        chain.check_tokens(q.shape[0], q.shape[1])
    return chain, cp_context.cu_seqlens, getattr(cp_context, "cu_seqlens_cpu", None) if chain is None else None


def rank_chain_of(cp_context: Any) -> RankChain | None:
    """The :class:`~cute_kda.context_parallel.RankChain` of this process's rank described by ``cp_context``: FLA's
    ``FLACPContext`` (``fla.ops.cp.build_cp_context``) or :func:`cute_kda.distributed.build_cp_context`'s, in FLA's
    ``"contiguous"`` or ``"zigzag"`` layout; None for a context without a group. Reads ``cu_seqlens_cpu`` (or, when
    the context has none, copies ``cu_seqlens`` to the host: a sync, as FLA's own context building does). Every
    inconsistency raises naming the field."""
    if not all(hasattr(cp_context, name) for name in ("group", "cu_seqlens")):
        raise TypeError("cp_context must be a context-parallel context (FLA's FLACPContext from "
                        "fla.ops.cp.build_cp_context, or cute_kda.distributed.build_cp_context's), got "
                        f"{type(cp_context).__name__}")
    local = cp_context.cu_seqlens
    if not isinstance(local, torch.Tensor) or local.dim() != 1 or local.shape[0] < 2 or local.is_floating_point():
        raise ValueError("cp_context.cu_seqlens must be an int tensor [N+1] of the rank's local sequences, got "
                         f"{local if not isinstance(local, torch.Tensor) else list(local.shape)}")
    group = cp_context.group
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"cp_context.group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    host = getattr(cp_context, "cu_seqlens_cpu", None)
    bounds = tuple(int(b) for b in (local if host is None else host).tolist())
    if len(bounds) != local.shape[0]:
        raise ValueError(f"cp_context.cu_seqlens_cpu ({len(bounds)} bounds) must match cp_context.cu_seqlens "
                         f"({local.shape[0]})")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of cp_context.group")
    count, layout = len(bounds) - 1, getattr(cp_context, "layout", "contiguous")
    if layout == "contiguous":
        slots = world
        parts = (_chain_part(slots, rank, 0, count - 1, cp_context.pre_num_ranks, cp_context.post_num_ranks, ""),)
    elif layout == "zigzag":
        slots, front = 2 * world, cp_context.front_num_seqs
        if isinstance(front, bool) or not isinstance(front, int) or not 1 <= front < count:
            raise ValueError(f"cp_context.front_num_seqs must be an int in [1, {count}) (the local sequences of the "
                             f"first interval), got {front!r}")
        before, after = (_pair(cp_context, name) for name in ("pre_num_ranks_by_part", "post_num_ranks_by_part"))
        parts = (_chain_part(slots, rank, 0, front - 1, before[0], after[0], "_by_part[0]"),
                 _chain_part(slots, slots - 1 - rank, front, count - 1, before[1], after[1], "_by_part[1]"))
    else:
        raise ValueError(f"cp_context.layout must be 'contiguous' or 'zigzag', got {layout!r}")
    return RankChain(group, world, slots, parts, bounds)


def _pair(cp_context: Any, name: str) -> tuple:
    value = getattr(cp_context, name, None)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"cp_context.{name} must hold two values (one per interval of the zigzag layout), "
                         f"got {value!r}")
    return tuple(value)


def _chain_part(slots: int, slot: int, first: int, last: int, before: Any, after: Any, suffix: str) -> ChainPart:
    """An interval of the rank's tokens, its neighbour counts checked against the chain's ``slots``."""
    for name, value, room in (("pre_num_ranks", before, slot), ("post_num_ranks", after, slots - 1 - slot)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= room:
            raise ValueError(f"cp_context.{name}{suffix} must be an int in [0, {room}] for slot {slot} of {slots}, "
                             f"got {value!r}")
    return ChainPart(slot, first, last, before, after)


def _fla_gate(use_gate_in_kernel: bool, safe_gate: bool, lower_bound: float | None) -> tuple[str, float]:
    """(``gate``, ``lower_bound``) of :func:`kda_forward` for FLA's gate flags."""
    if not use_gate_in_kernel:
        return "none", -5.0  # g is the log decay; lower_bound plays no part
    if lower_bound is None:
        if safe_gate:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
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


_GDN_CHUNK_SIZES = (16, 32, 64)
_GDN_EXTRA_KWARGS = frozenset(("transpose_state_layout", "head_first", "chunk_size", "use_gate_in_kernel", "A_log",
                               "dt_bias"))
GDN_GATES = ("softplus", "none")  # raw input through −exp(A_log)·softplus(g + dt_bias), or the log decay itself


@dataclass(frozen=True)
class GdnCall:
    """A canonical GatedDeltaNet forward equivalent to an FLA ``chunk_gated_delta_rule`` call.

    ``tensors`` = (q, k, v, g, beta), contiguous, dtypes as given: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    g ``[B, T, HV]`` (the raw gate input for ``gate="softplus"``, the per-token log decay for ``"none"``);
    beta ``[B, T, HV]`` (logits when ``beta_logits``).

    ``options``, the keywords of the canonical forward: ``scale`` (None: the default), ``gate`` (one of
    ``GDN_GATES``), ``A_log`` fp32 ``[HV]`` (softplus gate; None for ``"none"``), ``dt_bias`` fp32 ``[HV]``
    (softplus gate: zeros when the call has none; None for ``"none"``), ``qk_l2norm``, ``beta_logits``,
    ``initial_state`` (None, or contiguous v-first
    ``[N, HV, V, K]`` in the caller's fp32 / bf16), ``output_final_state``, ``cu_seqlens`` (int ``[N+1]``, B = 1).

    ``state_k_first``: the caller's states are FLA's default ``[N, HV, K, V]``, so the v-first final state
    is transposed back (into a contiguous tensor) on the way out. ``recompute``: :func:`kda_forward`'s training-memory
    choice (not in ``options``, which the references take too): True unless the call says ``disable_recompute``.
    """

    tensors: tuple[torch.Tensor, ...]
    options: dict[str, Any]
    state_k_first: bool
    recompute: bool = True
    pool: bool = False  # a prefill on a state pool: the final state is the pool itself, handed back as it is
    k_first_pool: bool = False  # a K-first pool (:mod:`cute_kda.k_first_pool`)

    def run(self, forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, Any]:
        """Call ``forward`` (a canonical GatedDeltaNet forward: ``forward(q, k, v, g, beta, **options)`` →
        (o ``[B, T, HV, V]``, v-first final state or None)) and hand back as FLA does: the final state fp32
        (whatever the initial state's dtype) in the caller's layout; a pool call's pool as it is."""
        if self.k_first_pool:
            return run_on_k_first_pool(forward, self.tensors, self.options)
        o, state = forward(*self.tensors, **self.options)
        if state is not None and not self.pool:
            state = state.transpose(-1, -2) if self.state_k_first else state
            state = state.to(torch.float32).contiguous()
        return o, state


def translate_fla_gdn_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None, cp_context: Any = None, *,
    state_indices: torch.Tensor | None = None,
    checkpoint_every: int | None = None,
    checkpoint_indices: torch.Tensor | None = None,
    disable_recompute: bool = False,
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
        ``transpose_state_layout``, fp32 or bf16, or fp16 widened to fp32 here (exact; one copy of the states);
        the final state is fp32 in the caller's layout.
      - beta bf16, or fp16 / fp32 (FLA's tests pass fp32) rounded to bf16 here (:func:`cute_kda.validation.cast_beta`;
        docs/numerics.md, "fp16 inputs", measures what the rounding costs).
      - ``chunk_size`` (16, 32 or 64) and ``chunk_indices`` change how FLA computes, not what: accepted.
        ``cu_seqlens_cpu``, when given, is checked on the host. Inputs that are not contiguous are made so.
    ``cp_context`` as in :func:`translate_fla_call`.
    What raises ``NotImplementedError`` (the argument is named): ``allow_neg_eigval=True`` (β = 2·sigmoid),
    K > 128 or V > 128 not a multiple of 128 (smaller ones and GatedDeltaNet's ``expand_v = 2`` are padded or split
    where the canonical call is resolved, :mod:`cute_kda.call`), fp32 q, k, v or raw g, bf16 and fp16 mixed
    (:class:`cute_kda.validation.UnsupportedDtypeError`, from the checks of the canonical call; fp16 is taken, o and
    the gradients in fp16). Errors
    FLA raises itself are raised the same way (``ValueError``; its ``DeprecationWarning`` for ``head_first``); a
    missing ``A_log`` with ``use_gate_in_kernel=True`` is a ``ValueError`` here (FLA asserts). Unknown keywords raise
    ``TypeError``. cute_kda's extension (keyword-only):
    ``state_indices``, ``checkpoint_every``, ``checkpoint_indices``, as :func:`translate_pool_arguments`;
    ``disable_recompute`` (training), as ``chunk_kda``'s: False (the default) keeps nothing beyond the inputs for the
    backward, which recomputes the forward's intermediates (``kda_forward``'s ``recompute=True``; FLA's
    ``chunk_gated_delta_rule`` keeps no states either: it recomputes them in its backward), True keeps K1's workspace
    and the per-tile states from the forward for a faster backward (≈ 2.8× the bf16 q, k, v, g of the call).
    """
    state_v_first = fla_state_v_first("chunk_gated_delta_rule", state_v_first, kwargs, _GDN_EXTRA_KWARGS,
                                      stacklevel=3)
    if "head_first" in kwargs:  # FLA raises the warning class itself
        raise DeprecationWarning("head_first has been removed; inputs must be in [B, T, H, ...] format")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in _GDN_CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")  # FLA's text
    refuse_neg_eigval(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    chain, cu_seqlens, cu_seqlens_cpu = _context_parallel(
        cp_context, q, cu_seqlens, cu_seqlens_cpu, pool=(state_indices, checkpoint_every, checkpoint_indices))

    batch, seq_len, heads, value_heads = _check_gdn_shapes(q, k, v, g, beta)
    gate, A_log, dt_bias = _gdn_gate(bool(kwargs.get("use_gate_in_kernel", False)), kwargs.get("A_log"),
                                     kwargs.get("dt_bias"), value_heads, q.device)
    if cu_seqlens is not None:
        validation.check_is_tensor("cu_seqlens", cu_seqlens)
        if batch != 1:
            raise ValueError(f"the batch size must be 1 with cu_seqlens (flatten variable-length inputs), got {batch}")
        if cu_seqlens_cpu is not None:
            validation.check_is_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
            validation.check_cu_seqlens_values(cu_seqlens_cpu, seq_len, name="cu_seqlens_cpu")
    num_seqs = validation.num_seqs(batch, cu_seqlens)
    pool = translate_pool_arguments(state_indices, checkpoint_every, checkpoint_indices)
    if initial_state is not None and not pool:
        validation.check_is_tensor("initial_state", initial_state)
        if initial_state.dtype == torch.float16:  # widened exactly: FLA returns an fp32 final state anyway
            initial_state = initial_state.to(torch.float32)
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
        scale=None if scale is None else validation.check_real("scale", scale),
        gate=gate, A_log=A_log, dt_bias=dt_bias, qk_l2norm=bool(use_qk_l2norm_in_kernel),
        beta_logits=bool(use_beta_sigmoid_in_kernel), initial_state=initial_state,
        output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens, **pool,
    )
    if chain is not None:
        options["segments"] = chain
    tensors = tuple(x.contiguous() for x in (q, k, v, g, validation.cast_beta(beta)))
    return GdnCall(tensors=tensors, options=options, state_k_first=not state_v_first,
                   recompute=not disable_recompute, pool=bool(pool),
                   k_first_pool=bool(pool) and not state_v_first)


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


def _gdn_gate(use_gate_in_kernel: bool, A_log: Any, dt_bias: Any, value_heads: int, device: torch.device
              ) -> tuple[str, torch.Tensor | None, torch.Tensor | None]:
    """(gate, A_log fp32 [HV] or None, dt_bias fp32 [HV] or None) of FLA's gate flags; the softplus gate without a
    bias gets zeros (the kernels read one)."""
    if not use_gate_in_kernel:
        return "none", None, None
    if A_log is None:
        raise ValueError("A_log must be provided when use_gate_in_kernel=True")
    if dt_bias is None:
        dt_bias = torch.zeros(value_heads, dtype=torch.float32, device=device)
    out = []
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        validation.check_is_tensor(name, x)
        if x.numel() != value_heads:
            raise ValueError(f"{name} must hold HV = {value_heads} values, got shape {list(x.shape)}")
        out.append(x.reshape(value_heads).to(torch.float32).contiguous())
    return "softplus", out[0], out[1]
