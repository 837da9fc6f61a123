"""Torch launcher of the decode / verify kernel (:class:`cute_kda.kernels.decode.DecodeKernel`).

Inputs are assumed validated by the API layer: torch CUDA tensors on one device, C-contiguous, 16-byte
aligned bases; q, k bf16 ``[N, T, H, 128]``, v bf16 ``[N, T, HV, 128]``, g bf16 ``[N, T, HV, 128]`` or
``[N, T, HV]``, beta bf16 ``[N, T, HV]``, A_log fp32 ``[HV]``, dt_bias fp32 ``[HV, 128]`` (``[HV]`` with a
per-head gate; both may be None for ``gate="none"``), state_pool fp32 / bf16 ``[slots, HV, 128, 128]``,
state_indices int32 ``[N]`` (decode) or ``[N, S + 1]`` (T ≤ S + 1) with num_accepted_tokens int32 ``[N]``
(verify), slot ids in ``[−1, slots)``, no slot twice. Any T: up to 8 the unrolled kernel, over 8 its runtime loop.
Packed sequences: ``cu_seqlens`` int32 or int64 ``[N + 1]`` on the device, q, k, v, g, beta and out
``[1, total T, ...]``, N the rows of state_indices. q, k, v, g, beta, out and the pool may be strided views: their
last mode contiguous, rows of 128 (and the pool's ``[128, 128]`` state blocks, contiguous) starting 16-byte aligned.
This module picks the compiled variant (compiled from fake tensors on first use: nothing is allocated for
it) and launches on torch's current stream: no host sync, no allocation but ``out`` when it is not given.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from ..device import check_supported, sm_count
from ..kernels.decode import MAX_TOKENS, DecodeInputs, DecodeVariant
from ._cache import (
    _CUSTREAMS, CompileCache, compile_for_launch, cu_stream, device_index, fake_stream, on_device,
    to_cute_tensor,
)
from .prepare import fp32_scalars

_CACHE = CompileCache("decode")
_STATE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_OFFSET_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
# Whether calls take the prefetching unrolled variants (docs/perf-log.md, D3: verify 73-76 % → 85-89 % of the copy
# on the H200 for fp32 pools, bf16 58-62 % → 72-74 %); False gives the plain unrolled variants for A/B runs.
PREFETCH = True
# Whether one-token bf16 V-first decodes take the paired variant where :meth:`DecodeVariant.choose_paired` says it
# pays (docs/perf-log.md, D4: bf16 decode 83-84 % → 85-88 % of the copy from N = 128 on the H200, the same bits as
# the unpaired variant there); ``bench_decode.py --no-paired`` is its A/B.
PAIRED = True
# Whether the runtime loop's decodes (packed calls on int32 offsets; a fixed T over 8) on V-first bf16 pools take the
# paired variant too where :meth:`DecodeVariant.choose_paired` says it pays (docs/perf-log.md, D8: a one-token
# sequence runs the paired update, a longer one its tokens once a block; packed bf16 decode 73-82 % → 84-94 % of the
# copy where N·HV ≥ 2048 on the H200, the same bits as the plain loop); ``bench_decode.py --no-paired-loop`` is its
# A/B.
PAIRED_LOOP = True
# Whether unrolled T = 2-4 calls prepare each token once a warp (``split_prep``: group g of a warp prepares token
# g mod T, the others take its operands by shuffles) instead of once a thread group, in place of ``prefetch``
# (docs/perf-log.md, D6: bf16 verify 71-75 % → 85-88 % of the copy where N·HV ≥ 2048 on the H200,
# fp32 unchanged, the same bits as ``prefetch``); ``bench_decode.py --no-split-prep`` is its A/B.
SPLIT_PREP = True
# Whether packed verifies (``cu_seqlens`` with ``[N, S + 1]`` slot ids, S + 1 of 2-4) take ``split_prep`` on the
# unrolled (S + 1)-token schedule, each sequence's tokens past its length run and never stored, instead of the
# runtime loop (docs/perf-log.md, D9: packed bf16 verify 68-73 % → 85-89 % of the copy where N·HV ≥ 2048 on the
# H200, the same bits as the loop); ``bench_decode.py --no-split-prep-packed`` is its A/B.
SPLIT_PREP_PACKED = True
_COMPILE_SIZES = (3, 2, 4, 5)  # N, H, HV, slots of the meta tensors a compile describes (every extent is dynamic)


def variant_of(gate: str, per_head_gate: bool, state_dtype: torch.dtype, state_layout: str, tokens: int | None,
               verify: bool, qk_l2norm: bool, beta_logits: bool, grouped: bool, vsplit: int,
               cu_seqlens: torch.dtype | None = None, paired: bool = False, width: int = 1) -> DecodeVariant:
    """The variant of a call; ``tokens`` the fixed T (over :data:`MAX_TOKENS`: the runtime loop), ``cu_seqlens``
    the offsets' dtype of a packed call (None: fixed length), ``width`` a verify's slot-row width S + 1; ``prefetch``
    where :data:`PREFETCH` is on and :meth:`DecodeVariant.choose_prefetch` says it fits, unless ``split_prep`` (where
    :data:`SPLIT_PREP` is on and :meth:`DecodeVariant.choose_split_prep` says so; a packed verify's on ``width``
    tokens where :data:`SPLIT_PREP_PACKED` is on too) takes its place; ``paired`` as :func:`launch_plan` chose it."""
    unrolled = unrolled_tokens(tokens, cu_seqlens)
    dtype = _STATE_DTYPES[state_dtype]
    if (unrolled is None and cu_seqlens is not None and verify and SPLIT_PREP and SPLIT_PREP_PACKED
            and DecodeVariant.choose_split_prep(width, state_layout, dtype)):
        unrolled = width  # the packed verify's split schedule (perf-log D9)
    split_prep = SPLIT_PREP and DecodeVariant.choose_split_prep(unrolled, state_layout, dtype)
    return DecodeVariant(gate=gate, per_head_gate=per_head_gate, state_dtype=dtype, state_layout=state_layout,
                         tokens=unrolled, verify=verify, qk_l2norm=qk_l2norm, beta_logits=beta_logits, grouped=grouped,
                         vsplit=vsplit, cu_seqlens=None if cu_seqlens is None else _OFFSET_DTYPES[cu_seqlens],
                         prefetch=PREFETCH and not split_prep
                         and DecodeVariant.choose_prefetch(unrolled, state_layout, dtype),
                         paired=paired, split_prep=split_prep)


def unrolled_tokens(tokens: int, cu_seqlens: torch.dtype | None) -> int | None:
    """The variant's ``tokens``: the fixed T up to :data:`MAX_TOKENS`, else None (the runtime loop)."""
    return tokens if cu_seqlens is None and tokens <= MAX_TOKENS else None


def auto_vsplit(num_seqs: int, value_heads: int, index: int, state_layout: str, state_dtype: torch.dtype,
                paired: bool = False) -> int:
    """:meth:`DecodeVariant.choose_vsplit` on device ``index``'s SMs."""
    return DecodeVariant.choose_vsplit(num_seqs, value_heads, sm_count(index), state_layout, _STATE_DTYPES[state_dtype],
                                       paired)


def launch_arguments(q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, num_accepted_tokens, cu_seqlens,
                     out, scale: float, c_gate: float, stream, tensor=None) -> tuple:
    """The positional arguments of ``DecodeKernel.__call__``: the tensors as they are for a launch (``tensor``
    None), or converted by ``tensor(t, assumed_align)`` (:func:`~._cache.to_cute_tensor`) for a compile."""
    if tensor is None:
        return (DecodeInputs(q, k, v, g, beta, A_log, dt_bias), state_pool, state_indices, num_accepted_tokens,
                cu_seqlens, out, scale, c_gate, stream)

    def rows(t, rows_aligned: bool = True):
        """Free strides but the last (1); rows of 16-byte aligned starts where the kernel reads them in vectors."""
        return None if t is None else strided_fake(t, 16 if rows_aligned else t.element_size(),
                                                   16 // t.element_size() if rows_aligned else 1)

    inputs = DecodeInputs(
        q=rows(q), k=rows(k), v=rows(v), g=rows(g, rows_aligned=g.dim() == 4), beta=rows(beta, rows_aligned=False),
        a_log=None if A_log is None else tensor(A_log, 4),
        dt_bias=None if dt_bias is None else tensor(dt_bias, 16 if dt_bias.dim() == 2 else 4),
    )
    return (inputs, strided_fake(state_pool, 16, 16 // state_pool.element_size(), static_inner=True),
            tensor(state_indices, 4), None if num_accepted_tokens is None else tensor(num_accepted_tokens, 4),
            None if cu_seqlens is None else tensor(cu_seqlens, cu_seqlens.element_size()), rows(out), scale, c_gate,
            stream)


def strided_fake(t: torch.Tensor, assumed_align: int, divisibility: int, static_inner: bool = False):
    """A fake DSL tensor of ``t``'s dtype and rank for a compile: dynamic extents, the last mode contiguous, every
    other stride dynamic (64-bit, a multiple of ``divisibility`` elements). ``static_inner``: the two last modes
    are a contiguous ``[128, 128]`` block (a state)."""
    from ..dsl import cute
    from ._cache import dsl_type

    rank = t.dim()
    free = rank - 2 if static_inner else rank - 1
    shape = tuple(cute.sym_int() for _ in range(free)) + ((128, 128) if static_inner else (cute.sym_int(),))
    stride = tuple(cute.sym_int(64, divisibility=divisibility) for _ in range(free)) + ((128, 1) if static_inner
                                                                                       else (1,))
    return cute.runtime.make_fake_tensor(dsl_type(t.dtype), shape, stride, assumed_align=assumed_align)


def compile_arguments(variant: DecodeVariant) -> tuple:
    """:func:`launch_arguments` for ``variant`` from meta tensors (no memory anywhere) and a fake stream."""
    n, heads, value_heads, slots = _COMPILE_SIZES
    qk_heads = heads if variant.grouped else value_heads
    t, d = variant.tokens or MAX_TOKENS + 1, 128
    bf16 = torch.bfloat16

    def meta(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    cu_seqlens = None
    batch = n
    if variant.cu_seqlens is not None:  # packed: one batch row of all tokens, n + 1 offsets
        cu_seqlens = meta(n + 1, dtype=torch.int32 if variant.cu_seqlens == "int32" else torch.int64)
        batch = 1
    v = meta(batch, t, value_heads, d)
    gate_channels = () if variant.per_head_gate else (d,)
    with_constants = variant.gate != "none"
    state_dtype = torch.float32 if variant.state_dtype == "fp32" else bf16
    return launch_arguments(
        meta(batch, t, qk_heads, d), meta(batch, t, qk_heads, d), v, meta(batch, t, value_heads, *gate_channels),
        meta(batch, t, value_heads), meta(value_heads, dtype=torch.float32) if with_constants else None,
        meta(value_heads, *gate_channels, dtype=torch.float32) if with_constants else None,
        meta(slots, value_heads, d, d, dtype=state_dtype),
        meta(n, t, dtype=torch.int32) if variant.verify else meta(n, dtype=torch.int32),
        meta(n, dtype=torch.int32) if variant.verify else None, cu_seqlens, v, 1.0, 1.0, fake_stream(),
        tensor=to_cute_tensor,
    )


def compiled_variant(variant: DecodeVariant, index: int):
    """The compiled kernel of ``variant`` for device ``index`` (compiled from :func:`compile_arguments` on first
    use, or loaded from the disk cache)."""

    def build():
        from ..kernels.decode import DecodeKernel

        return compile_for_launch(DecodeKernel(variant), *compile_arguments(variant))

    return _CACHE.get((variant, index), build)


def decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor, state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None, *, gate: str, scale: float, lower_bound: float = -5.0,
    qk_l2norm: bool = True, beta_logits: bool = True, state_layout: str = "vk", out: torch.Tensor | None = None,
    vsplit: int | None = None, cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode (``state_indices [N]``) or verify (``[N, S + 1]`` with ``num_accepted_tokens``) call:
    ``state_pool`` updated in place, o bf16 ``[N, T, HV, 128]`` returned (into ``out`` when given). The contract:
    :mod:`cute_kda.reference.decode`; shapes and assumptions: the module doc. ``state_layout``: "vk"
    (``[slots, HV, V, K]``) or "kv"; ``vsplit`` None: :meth:`DecodeVariant.choose_vsplit`. ``cu_seqlens``: int32 or
    int64 ``[N + 1]`` on the device (never read on the host): q, k, v, g, beta and o are packed ``[1, total T, ...]``,
    sequence ``n`` the rows ``cu_seqlens[n] .. cu_seqlens[n + 1] − 1``, any length (a verify's at most S + 1)."""
    if gate == "none":  # a log decay needs no gate parameters; the variant is compiled without them
        A_log = dt_bias = None
    batch, tokens, qk_heads = q.shape[:3]
    num_seqs = state_indices.shape[0]
    value_heads = v.shape[2]
    if out is None:
        out = torch.empty(batch, tokens, value_heads, v.shape[3], dtype=torch.bfloat16, device=v.device)
    if num_seqs == 0 or value_heads == 0 or tokens == 0:
        return out
    plan = plan_of(q, v, g, state_pool, state_indices, gate, scale, lower_bound, qk_l2norm, beta_logits, state_layout,
                   vsplit, cu_seqlens)
    with on_device(v.device):
        plan.launch(q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, num_accepted_tokens, cu_seqlens, out)
    return out


class LaunchPlan(NamedTuple):
    """What a call configuration launches (:func:`plan_of`): the compiled variant, the fp32-rounded scale and gate
    constant, and the device; :meth:`launch` is the one launch path of :func:`decode` and of the serving fast path
    (:func:`cute_kda.serving.steady_launch`)."""

    compiled: Any
    scale: float
    c_gate: float
    index: int

    def launch(self, q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, num_accepted_tokens, cu_seqlens,
               out) -> None:
        """Launch on the current stream of the plan's device (which must be the current device); the tensors as
        :func:`decode` takes them (A_log, dt_bias None for the "none" gate), ``out`` given."""
        handle = torch._C._cuda_getCurrentRawStream(self.index)  # current_stream's look-ups, inline (host time)
        stream = _CUSTREAMS.get(handle)
        inputs = tuple.__new__(DecodeInputs, (q, k, v, g, beta, A_log, dt_bias))  # without the NamedTuple's frame
        self.compiled(inputs, state_pool, state_indices, num_accepted_tokens, cu_seqlens, out, self.scale, self.c_gate,
                      cu_stream(handle) if stream is None else stream)


def plan_of(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state_pool: torch.Tensor, state_indices: torch.Tensor,
            gate: str, scale: float, lower_bound: float, qk_l2norm: bool, beta_logits: bool, state_layout: str,
            vsplit: int | None, cu_seqlens: torch.Tensor | None) -> LaunchPlan:
    """The :class:`LaunchPlan` of a non-empty :func:`decode` call (its arguments' shapes, dtypes and device)."""
    index = device_index(v.device)
    return launch_plan(
        gate, g.dim() == 3, state_pool.dtype, state_layout, q.shape[1], state_indices.dim() == 2, qk_l2norm,
        beta_logits, q.shape[2] != v.shape[2], vsplit, None if cu_seqlens is None else cu_seqlens.dtype,
        state_indices.shape[0], v.shape[2], index, scale, lower_bound,
        state_indices.shape[1] if state_indices.dim() == 2 else 1)


def takes_paired(num_seqs: int, value_heads: int, sms: int, tokens: int, verify: bool, state_layout: str,
                 state_dtype: torch.dtype, vsplit: int | None, cu_seqlens_dtype: torch.dtype | None) -> bool:
    """Whether a call of ``tokens`` a sequence (fixed T, or packed with offsets of ``cu_seqlens_dtype``) on ``sms``
    SMs runs the paired variant: :data:`PAIRED` on (for the runtime loop :data:`PAIRED_LOOP` too) and
    :meth:`DecodeVariant.choose_paired`."""
    unrolled = unrolled_tokens(tokens, cu_seqlens_dtype)
    return (PAIRED and (unrolled is not None or PAIRED_LOOP)
            and DecodeVariant.choose_paired(num_seqs, value_heads, sms, unrolled, verify, state_layout,
                                            _STATE_DTYPES[state_dtype], vsplit,
                                            None if cu_seqlens_dtype is None else _OFFSET_DTYPES[cu_seqlens_dtype]))


@functools.lru_cache(maxsize=4096)  # a call's host path: one look-up for the variant, its compile and the scalars
def launch_plan(gate: str, per_head_gate: bool, state_dtype: torch.dtype, state_layout: str, tokens: int,
                verify: bool, qk_l2norm: bool, beta_logits: bool, grouped: bool, vsplit: int | None,
                cu_seqlens_dtype: torch.dtype | None, num_seqs: int, value_heads: int, index: int, scale: float,
                lower_bound: float, width: int = 1) -> LaunchPlan:
    """The :class:`LaunchPlan` of a call: the variant (:func:`variant_of`; ``paired`` where :data:`PAIRED` is on, for
    the runtime loop :data:`PAIRED_LOOP` too, and :meth:`DecodeVariant.choose_paired` says it pays; ``vsplit`` None:
    :meth:`DecodeVariant.choose_vsplit`; ``width`` a verify's slot-row width) compiled for device ``index`` on first
    use, after the device check (:func:`cute_kda.device.check_supported`: a clear error on a device that is not
    sm_90)."""
    check_supported(torch.device("cuda", index))
    paired = takes_paired(num_seqs, value_heads, sm_count(index), tokens, verify, state_layout, state_dtype, vsplit,
                          cu_seqlens_dtype)
    if vsplit is None:
        vsplit = auto_vsplit(num_seqs, value_heads, index, state_layout, state_dtype, paired)
    variant = variant_of(gate, per_head_gate, state_dtype, state_layout, tokens, verify, qk_l2norm, beta_logits,
                         grouped, vsplit, cu_seqlens_dtype, paired, width)
    return LaunchPlan(compiled_variant(variant, index), *fp32_scalars(scale, lower_bound), index)
