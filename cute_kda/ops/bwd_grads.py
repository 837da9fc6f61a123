"""Torch launcher of Kernel B (:class:`cute_kda.kernels.bwd_grads.BwdGrads`), the tile gradients.

Inputs are the forward's validated tensors, the training forward's per-tile checkpoints, Kernel A's
``du`` and per-tile snapshots; all on one CUDA device, C-contiguous, 16-byte aligned. This module
checks the buffers against each other, picks the compiled variant and launches on torch's current
stream. Nothing here reads device memory on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import validation
from ..layouts.bwd_grads import compute_warps as warps_at, default_warps, reads_gate_rows
from ..numerics import NATIVE_HEAD_DIMS, f32, gate_constant
from ..variants import GradsVariant
from ..workspace import PartnerFields, Workspace, block_states_shape, pair_blocks_shape, pair_u_shape
from ._cache import (
    CompileCache, compile_for_launch, current_stream, device_index, dsl_type, fake_stream, launch_tensor,
    to_cute_tensor,
)
from .prepare import compile_problem, tile_bases

_CACHE = CompileCache("bwd_grads")
# Whether the per-channel gates' Kernel B loads a channel's 16 raw gate values in one burst before the gate backward's
# row loop (``GradsVariant.gate_ahead``; docs/perf-log.md, B5: Kernel B −13-14 % on the H200, bit-identical there);
# ``bench_train.py --no-gate-ahead`` and ``bench_bwd_grads.py --gate-ahead off,on`` are its A/B.
GATE_AHEAD = True
# Whether Kernel B's state images complete a transaction barrier of their own, so K1's recompute runs while they
# arrive (``GradsVariant.split_load``; docs/perf-log.md, B6: predicted −6-9 % on top of B5, measured 0-1 % on the
# H200, bit-identical): off (``--split-load`` of the same two benchmarks).
SPLIT_LOAD = False
# Whether the safe gate's Kernel B at 8 warps runs its gate backward's rows on all warps (``GradsVariant.split_rows``;
# docs/perf-log.md, B7: predicted −5-7 % on top of B5 + B6, measured +2-3 % on the H200, bit-identical): off
# (``--split-rows``).
SPLIT_ROWS = False
# Whether the safe gate's Kernel B forms its gate backward's rows' x and σ'(x) in straight-line code before the row
# loop (``GradsVariant.slopes_ahead``; docs/perf-log.md, B8: Kernel B −8-9 % on the H200, bit-identical, predicted
# −12-19 %); ``--no-slopes-ahead`` is its A/B; not together with ``split_rows``, which wins.
SLOPES_AHEAD = True
# Whether the training step hands Kernel B dq, dk per q/k head for grouped value heads in groups of two, so that the
# kernel adds each pair (``GradsVariant.group_sum``; docs/perf-log.md, GDN6) instead of the step summing per-value-head
# tensors afterwards (``executors.stages.group_sum``); the same bits. ``bench_gates.py --train --no-group-sum`` is the
# A/B.
GROUP_SUM = True
# dq, dk and a per-channel gate's dg: bf16, or fp16 as f16(bf16(x)) for fp16 training (``GradsVariant.grad_dtype``,
# picked by dq's dtype; the training executor's :data:`~cute_kda.executors.training.FP16_GRAD_STORES`)
GRAD_DTYPES = (torch.bfloat16, torch.float16)
# q, k, v and a raw gate: bf16, or fp16 widened exactly where bf16 is (``GradsVariant.dtype``, picked by q's dtype; the
# training executor's :data:`~cute_kda.executors.training.FP16_NATIVE_BACKWARD`)
INPUT_DTYPES = (torch.bfloat16, torch.float16)


class PairTensors(NamedTuple):
    """Kernel B's inputs in the two-tile training form (``GradsVariant.pair_rebuild``; docs/perf-log.md, W2): tile a's
    ``U`` as the training pair K2 keeps it (bf16 :func:`~cute_kda.workspace.pair_u_shape`), Kernel A's ``dv``
    (bf16 ``[B, T, HV, D]``) and the pair partners' tile-relative fields: a K1 workspace of the call or the
    :class:`~cute_kda.workspace.PartnerFields` of K1's pair variant (its qd, kd, kr, gt; today's K1's values, bit for
    bit what Kernel B recomputes of its own tile)."""

    u_a: torch.Tensor
    dv: torch.Tensor
    ws: Workspace | PartnerFields


def sums_pairs(qk_heads: int, value_heads: int, grad_dtype: torch.dtype) -> bool:
    """Whether a training step hands Kernel B dq, dk per q/k head to add each pair of value heads into
    (``GradsVariant.group_sum``): :data:`GROUP_SUM` on, value heads in groups of two, bf16 gradients."""
    return GROUP_SUM and value_heads == 2 * qk_heads and grad_dtype == torch.bfloat16


def switches(gate: str, per_head_gate: bool, compute_warps: int) -> dict[str, bool]:
    """The switches above as a call's Kernel B variant takes them (``gate_ahead`` where a gate row is read back,
    ``split_rows`` for the safe gate at 8 warps, ``slopes_ahead`` for the safe gate without ``split_rows``): the
    launcher keys them, :func:`cute_kda.api.warmup_variants` lists them, so a warmed variant is the one a call runs."""
    split_rows = SPLIT_ROWS and gate == "safe" and compute_warps == max(warps_at())
    return dict(gate_ahead=GATE_AHEAD and reads_gate_rows(gate, per_head_gate), split_load=SPLIT_LOAD,
                split_rows=split_rows, slopes_ahead=SLOPES_AHEAD and gate == "safe" and not split_rows)


def gate_partials_shapes(ws: Workspace, heads: int, per_head_gate: bool = False) -> tuple[tuple[int, ...], tuple[int, int]]:
    """Shapes of the per-tile partial sums ``(ddt_partial [H, tiles, K], dalog_partial [H, tiles])``; a per-head
    gate's ddt_partial is ``[HV, tiles]``."""
    rows, _, dim = ws.qd.shape
    tiles = rows // heads
    return ((heads, tiles) if per_head_gate else (heads, tiles, dim)), (heads, tiles)


def launch_arguments(
    q, k, g, v, do, du, A_log, dt_bias, ws: Workspace, states, state_grads, dq, dk, dg, dbeta, ddt_partial,
    dalog_partial, *, scale: float, lower_bound: float, cu_seqlens, tile_base, pair: PairTensors | None = None,
    tensor=launch_tensor,
) -> tuple:
    """The arguments of ``BwdGrads.__call__`` (dynamic shapes: one compile serves all sizes).

    ``tensor(t, assumed_align)``: :func:`~._cache.launch_tensor` for a call, :func:`~._cache.to_cute_tensor`
    for the compile.
    """
    from ..kernels.bwd_grads import GradsInputs, GradsOutputs, GradsStates, GradsWorkspace, PairInputs

    batch, steps, qk_heads, dim = q.shape
    heads = v.shape[2]  # value heads
    rows = batch * steps
    per_head = g.dim() == 3  # a per-head gate [B, T, HV]

    def tokens(t, n=heads):
        return tensor(t.view(rows, n, dim), 16)

    def optional(t, shape):
        return None if t is None else tensor(t.view(*shape), 4)

    gate_of = (lambda t: tensor(t.view(rows, heads), 16)) if per_head else tokens
    inputs = GradsInputs(q=tokens(q, qk_heads), k=tokens(k, qk_heads), g=gate_of(g), v=tokens(v), do=tokens(do),
                         du=tokens(du), a_log=optional(A_log, (heads,)),
                         dt_bias=optional(dt_bias, (heads,) if per_head else (heads, dim)))
    states_args = GradsStates(state=tensor(states, 16), state_grad=tensor(state_grads, 16))
    workspace = GradsWorkspace(inv=tensor(ws.inv, 16), beta=tensor(ws.beta, 16))
    outputs = GradsOutputs(  # dq, dk per q/k head with group_sum
        dq=tokens(dq, dq.shape[2]), dk=tokens(dk, dk.shape[2]), dg=gate_of(dg),
        dbeta=tensor(dbeta.view(rows, heads), 2), ddt_partial=optional(ddt_partial, (-1,) if per_head else (-1, dim)),
        dalog_partial=optional(dalog_partial, (-1,)),
    )
    pair_args = None
    if pair is not None:
        fields = (pair.ws.qd, pair.ws.kd, pair.ws.kr)
        pair_args = PairInputs(tensor(pair.u_a, 16), tokens(pair.dv), *(tensor(t.view(-1, 1, dim), 16) for t in fields),
                               tensor(pair.ws.gt, 16))
    return (inputs, states_args, workspace, outputs, f32(scale), f32(gate_constant(lower_bound)), steps,
            tensor(cu_seqlens, 8), tensor(tile_base, 4), pair_args)


def _check_buffers(q, k, g, v, do, du, ws, states, state_grads, dq, dk, dg, dbeta, ddt_partial, dalog_partial,
                   num_seqs: int, gate: str, pair: PairTensors | None = None) -> None:
    batch, steps, qk_heads, dim = q.shape
    if dim not in NATIVE_HEAD_DIMS or dim != ws.qd.shape[-1]:
        raise ValueError(f"q's head dim {dim} must be the workspace's ({ws.qd.shape[-1]}) and one of "
                         f"{NATIVE_HEAD_DIMS}")
    heads = v.shape[2] if v.dim() == 4 else qk_heads
    per_head = gate != "safe" and g.dim() == 3
    if heads % qk_heads or (heads != qk_heads and gate == "safe"):
        raise ValueError(f"v has {heads} heads for q's {qk_heads}: grouped value heads need an unbounded gate here")
    bf16, device = (torch.bfloat16,), q.device
    qk_shape, token_shape = (batch, steps, qk_heads, dim), (batch, steps, heads, dim)
    validation.check_buffer("q", q, INPUT_DTYPES, qk_shape, device)
    inputs = (q.dtype,)  # k, v and a raw gate in q's dtype
    validation.check_buffer("k", k, inputs, qk_shape, device)
    validation.check_buffer("v", v, inputs, token_shape, device)
    for name, t in (("do", do), ("du", du)):
        validation.check_buffer(name, t, bf16, token_shape, device)
    grads = (torch.bfloat16,) if heads != qk_heads else GRAD_DTYPES  # group sums add bf16 values
    # grouped heads in pairs may take dq, dk per q/k head: the kernel adds the pair (group_sum)
    grad_shape = qk_shape if heads == 2 * qk_heads and dq.dim() == 4 and dq.shape[2] == qk_heads else token_shape
    validation.check_buffer("dq", dq, grads, grad_shape, device)
    validation.check_buffer("dk", dk, (dq.dtype,), grad_shape, device)
    if per_head:
        validation.check_buffer("g", g, (q.dtype, torch.float32) if gate == "none" else inputs, token_shape[:3], device)
        validation.check_buffer("dg", dg, (torch.float32,), token_shape[:3], device)
    else:
        validation.check_buffer("g", g, (q.dtype, torch.float32) if gate == "none" else inputs, token_shape, device)
        validation.check_buffer("dg", dg, (dq.dtype,), token_shape, device)
    validation.check_training_size(v, "v")
    validation.check_buffer("dbeta", dbeta, bf16, token_shape[:3], device)
    expected = (block_states_shape if pair is None else pair_blocks_shape)(ws, heads, num_seqs)
    for name, t in (("states", states), ("state_grads", state_grads)):
        validation.check_buffer(name, t, bf16, expected, device)
    if pair is not None:
        if q.dtype != torch.bfloat16:
            raise ValueError(f"pair: Kernel B's two-tile form takes bf16 q, k, v, got {q.dtype}")
        validation.check_buffer("pair.u_a", pair.u_a, bf16, pair_u_shape(ws, heads, num_seqs), device)
        validation.check_buffer("pair.dv", pair.dv, bf16, token_shape, device)
        for name in ("qd", "kd", "kr", "gt"):
            field, own = getattr(pair.ws, name), getattr(ws, name)
            validation.check_buffer(f"pair.ws.{name}", field, (own.dtype,), own.shape, device)
    ddt_shape, dalog_shape = gate_partials_shapes(ws, heads, per_head)
    if gate == "none":
        if ddt_partial is not None or dalog_partial is not None:
            raise ValueError("a log decay (gate 'none') has no A_log / dt_bias: pass ddt_partial=dalog_partial=None")
        return
    validation.check_buffer("ddt_partial", ddt_partial, (torch.float32,), ddt_shape, device)
    validation.check_buffer("dalog_partial", dalog_partial, (torch.float32,), dalog_shape, device)


def variant_kernel(variant: GradsVariant):
    """The Kernel B object of ``variant`` (:func:`cute_kda.kernels.bwd_grads.bwd_grads_kernel`), not compiled."""
    from ..kernels.bwd_grads import bwd_grads_kernel

    return bwd_grads_kernel(varlen=variant.varlen, qk_l2norm=variant.qk_l2norm, beta_logits=variant.beta_logits,
                            compute_warps=variant.compute_warps, gate=variant.gate,
                            gate_dtype=dsl_type(variant.g_dtype), per_head_gate=variant.per_head_gate,
                            grouped=variant.grouped, gate_ahead=variant.gate_ahead, split_load=variant.split_load,
                            split_rows=variant.split_rows, slopes_ahead=variant.slopes_ahead, dim=variant.dim,
                            grad_dtype=dsl_type(variant.grad_dtype), dtype=dsl_type(variant.dtype),
                            group_sum=variant.group_sum, pair_rebuild=variant.pair_rebuild)


def compiled_variant(variant: GradsVariant, index: int, tensors: tuple, options: dict):
    """The compiled Kernel B ``variant`` on device ``index``, built on first use from ``tensors`` and ``options``
    (:func:`launch_arguments`' arguments, real or ``meta``)."""

    def build():
        arguments = launch_arguments(*tensors, **options, tensor=to_cute_tensor)
        return compile_for_launch(variant_kernel(variant), *arguments, fake_stream())

    return _CACHE.get((variant, index), build)


def bwd_grads(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    du: torch.Tensor, ws: Workspace, states: torch.Tensor, state_grads: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dg: torch.Tensor, dbeta: torch.Tensor,
    ddt_partial: torch.Tensor, dalog_partial: torch.Tensor, *, scale: float, lower_bound: float,
    cu_seqlens: torch.Tensor | None = None, tile_base: torch.Tensor | None = None, qk_l2norm: bool = True,
    beta_logits: bool = True, compute_warps: int | None = None, gate: str = "safe", pair: PairTensors | None = None,
) -> None:
    """Run Kernel B: dq, dk, dg, dbeta (valid rows) and the per-tile partials of ddt_bias and dA_log.

    q, k, g (raw gate), v, do, du (Kernel A's), dq, dk, dg: bf16 ``[B, T, H, D]`` (q, k, v and g may be fp16
    together, :data:`INPUT_DTYPES`, an fp32 log decay beside them; dq, dk and a per-channel gate's dg
    may be fp16 together, without grouped value heads: the bf16 values rounded once more, :data:`GRAD_DTYPES`; D in
    :data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`, the workspace's); dbeta bf16
    ``[B, T, H]``, w.r.t. beta as the forward took it (the logits when ``beta_logits``; β itself enters
    through the workspace's activated ``ws.beta``); A_log fp32 ``[H]``, dt_bias fp32 ``[H, D]``; ws: the forward's K1
    workspace. states: the training forward's per-tile checkpoints, state_grads: Kernel A's per-tile
    snapshots, both bf16 ``block_states_shape(ws, H, N)`` state images. ddt_partial fp32 ``[H, tiles, D]``,
    dalog_partial fp32 ``[H, tiles]`` (:func:`gate_partials_shapes`): every slot is written (0 for slots
    that are no tile), so ``ddt_bias = ddt_partial.sum(1)`` and ``dA_log = dalog_partial.sum(1)``.
    ``scale`` and ``lower_bound`` as the forward's; ``cu_seqlens`` int64 ``[N+1]`` with B == 1 packs N
    sequences (``tile_base`` derived when not given). ``compute_warps``: warps per CTA, 4 or 8 at D = 128, 4 at 64, None
    the default (:func:`~cute_kda.layouts.bwd_grads.default_warps`); a tuning knob: the row sums over warps then group
    differently, so results agree to rounding, not bit for bit.

    ``gate`` "softplus" or "none" with g ``[B, T, HV, D]``: the per-channel unbounded gates (docs/numerics.md,
    "Kernel B for the per-channel unbounded gates"): g raw bf16 for "softplus", the log decay bf16 / fp32 for
    "none"; dg bf16 like g's shape, the partials as the safe gate's (None for "none"); v, do, du, dq, dk per value
    head as below. With g ``[B, T, HV]``: GatedDeltaNet's per-head gate (docs/numerics.md, "Kernel B for a
    per-head gate"). Then v, do, du, dq, dk are ``[B, T, HV, D]`` with HV a multiple of q and k's H (grouped value
    heads: dq, dk come per value head, the caller sums each group; with groups of two, dq and dk may be zeroed
    ``[B, T, H, D]`` instead, into which the kernel adds each pair of value heads, ``bf16(a + b)`` whatever the
    order, the group sum's bits; either gate layout); g ``[B, T, HV]`` (raw bf16 for "softplus",
    the log decay bf16 / fp32 for "none"); A_log, dt_bias fp32 ``[HV]`` (None for "none"); dg fp32
    ``[B, T, HV]``; ddt_partial, dalog_partial fp32 ``[HV, tiles]`` (None for "none"). Launches on torch's
    current stream.

    ``pair`` (:class:`PairTensors`): the two-tile training form (docs/perf-log.md, W2; the safe and per-head gates,
    bf16 inputs): ``states`` the training pair K2's checkpoints (the state entering each pair), ``state_grads`` Kernel
    A's pair snapshots (the gradient leaving it), both bf16 :func:`~cute_kda.workspace.pair_blocks_shape` state
    images; each CTA rebuilds the matrix of its tile's other end from its pair partner's fields
    (:mod:`cute_kda.kernels.bwd_grads.pairs`). ``ws`` may be the pair workspace (Kernel B reads its INV and β, per
    tile in both) or ``pair.ws``.
    """
    varlen = cu_seqlens is not None
    num_seqs = validation.num_seqs(q.shape[0], cu_seqlens)
    _check_buffers(q, k, g, v, do, du, ws, states, state_grads, dq, dk, dg, dbeta, ddt_partial, dalog_partial,
                   num_seqs, gate, pair)
    dim = q.shape[-1]
    if compute_warps is None:
        compute_warps = default_warps(dim)
    if compute_warps not in warps_at(dim):
        raise ValueError(f"compute_warps must be one of {warps_at(dim)} at D = {dim}, got {compute_warps}")
    if ws.qd.shape[0] == 0:
        return
    if varlen and tile_base is None:
        tile_base = tile_bases(cu_seqlens)
    tensors = (q, k, g, v, do, du, A_log, dt_bias, ws, states, state_grads, dq, dk, dg, dbeta, ddt_partial,
               dalog_partial)
    options = dict(scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens, tile_base=tile_base, pair=pair)
    with torch.cuda.device(q.device):
        stream = current_stream(q.device)
        per_head = g.dim() == 3
        variant = GradsVariant(varlen, bool(qk_l2norm), bool(beta_logits), gate, g.dtype, per_head,
                               v.shape[2] != q.shape[2], compute_warps, dim=dim, grad_dtype=dq.dtype, dtype=q.dtype,
                               group_sum=dq.shape[2] != v.shape[2], pair_rebuild=pair is not None,
                               **switches(gate, per_head, compute_warps))
        compiled_variant(variant, device_index(q.device), tensors, options)(*launch_arguments(*tensors, **options),
                                                                            stream)


def compile_variant(variant: GradsVariant, device: torch.device | str) -> None:
    """Compile (or load from the disk cache) the Kernel B ``variant`` for ``device`` ahead of time from ``meta``
    tensors (:func:`compile_tensors`): nothing is allocated or launched."""
    compiled_variant(variant, device_index(torch.device(device)), *compile_tensors(variant))


def compile_arguments(variant: GradsVariant) -> tuple:
    """``BwdGrads.__call__``'s arguments for ``variant`` from ``meta`` tensors and a fake stream (a compile only)."""
    tensors, options = compile_tensors(variant)
    return (*launch_arguments(*tensors, **options, tensor=to_cute_tensor), fake_stream())


def compile_tensors(variant: GradsVariant) -> tuple[tuple, dict]:
    """:func:`launch_arguments`' tensors and options for ``variant`` as ``meta`` tensors (a per-head gate: g
    ``[B, T, HV]``; grouped: two value heads per q/k head)."""
    problem = compile_problem(variant.varlen, variant.dim)
    heads, fp32 = problem.heads, torch.float32
    qk = problem.tokens(1 if variant.grouped else heads, dtype=variant.dtype)
    tokens, values = problem.tokens(), problem.tokens(dtype=variant.dtype)
    grads = problem.tokens(heads // 2 if variant.group_sum else heads, dtype=variant.grad_dtype)
    gate_inner = () if variant.per_head_gate else (problem.dim,)
    states = problem.block_states()
    pair = None
    if variant.pair_rebuild:
        states = problem.zeros(*pair_blocks_shape(problem.ws, heads, problem.num_seqs))
        pair = PairTensors(problem.zeros(*pair_u_shape(problem.ws, heads, problem.num_seqs)), tokens, problem.ws)
    ddt_shape, dalog_shape = gate_partials_shapes(problem.ws, heads, variant.per_head_gate)
    constants = variant.gate != "none"
    tensors = (qk, qk, problem.tokens(heads, gate_inner, dtype=variant.g_dtype), values, tokens, tokens,
               problem.zeros(heads, dtype=fp32) if constants else None,
               problem.zeros(heads, *gate_inner, dtype=fp32) if constants else None,
               problem.ws, states, states, grads, grads,
               problem.tokens(heads, gate_inner, dtype=fp32 if variant.per_head_gate else variant.grad_dtype),
               problem.tokens(heads, ()),
               problem.zeros(*ddt_shape, dtype=fp32) if constants else None,
               problem.zeros(*dalog_shape, dtype=fp32) if constants else None)
    options = dict(scale=problem.dim ** -0.5, lower_bound=-5.0, cu_seqlens=problem.cu_seqlens,
                   tile_base=problem.tile_base, pair=pair)
    return tensors, options
