"""The stages of a call on the kernels: K1 + K2 (the forward), Kernel A (the backward scan), Kernel B (the tile
gradients), behind one :class:`Backend`, and what passes between them.

The inference executor runs the forward stage for a call split into segments; the training executor runs all three
(:mod:`cute_kda.executors.training`). :data:`KERNELS` launches the CUDA kernels on the current stream of q's
device; :data:`cute_kda.reference.backend.REFERENCE` runs the same stages on the mirror references, on any device
(the tests name it). A segmented call (context parallelism, :mod:`cute_kda.context_parallel`) is run as one packed
row of segments (:func:`packed`); the helpers here turn its states back into the caller's.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from .. import context_parallel, validation
from ..call import Inputs, Options
from ..device import available_sms, check_supported, sm_count
from ..numerics import CHUNK, gate_scheme
from ..validation import ProblemShape
from ..variants import RecurrenceVariant
from ..workspace import (
    CrossBlocks, PartnerFields, Workspace, WorkspaceSpec, allocate_partner_fields, cross_block_views,
    pair_block_slots, snapshot_slots, tiles_per_head, workspace_views,
)

KERNEL_B_INPUTS = (0, 1, 3, 4, 5, 6)  # q, k, g, beta, A_log, dt_bias: the inputs whose gradients Kernel B gives
# K2 passes whose o nobody reads (the backward's recomputation, a segmented call's two passes for the segment states)
# run K2's variant without token outputs (``RecurrenceVariant.token_outputs``: no qd or Mqk read, no o formed or
# written; the same states); False: the variant with o, into a scratch buffer (docs/perf-log.md v13; its GPU tests
# passed on an H100, 2026-12-05; ``bench_train.py --no-states-only-passes`` for the A/B)
STATES_ONLY_PASSES = True
# The two-tile training form (docs/perf-log.md, W2, W2a, W2b): where :func:`trains_pairs` says, a recomputing step
# (``Options.recompute``, FLA's default) runs its forward on the inference prefill's pair chain (:func:`pair_chain`)
# and its backward on K1's pair variant, the training pair K2 (a state and tile a's U kept a pair), Kernel A's pair
# scan (a state gradient a pair) and Kernel B rebuilding each tile's other end (``GradsVariant.pair_rebuild``); a call
# keeping its states stays per tile. GatedDeltaNet B1 T32768 H16 HV32 on an H100: 8.52 → 7.49 ms with
# STATES_ONLY_PASSES (``bench_gates.py --train --no-pair-training`` for the A/B)
PAIR_TRAINING = True
# In that form a per-head gate's recomputation has K1's pair variant write the pair partners' fields, which Kernel B's
# rebuild reads, instead of running K1 once more for them (docs/perf-log.md, W2b); False: the second K1, for the A/B
# (``bench_gates.py --train --no-partner-fields``)
PARTNER_FIELDS = True
# the smallest K2 V-split at which each scheme's recomputing backward runs on pairs (where the chains are few: K2 and
# Kernel A's pair steps −34 % and −24 % a tile at V-split 4, v11 and A9), for the schemes of PAIR_TRAINING_SCHEMES:
# those whose pair step was measured faster, the per-head gate (W2b). The safe gate's recomputation on pairs runs K1
# twice (no partner fields) and is not measured as a step (``bench_train.py --safe-pair-training`` adds it)
PAIR_TRAINING_MIN_VSPLIT = {"safe": 4, "per_head": 4}
PAIR_TRAINING_SCHEMES = ("per_head",)
# The backward's recomputation side by side (docs/perf-log.md, R1): a recomputing call of one sequence whose chains
# leave SMs idle (:func:`recompute_split`) runs its forward's K2 over the sequence's segments one after the other,
# keeping the fp32 state entering each later segment (``Saved.segment_states`` ``[1, C − 1, H, V, K]``, 64 KB a head
# and segment), and the backward's recomputation runs those segments side by side, a stream each, at V-split 1. Each
# pass runs the unsplit chain's instructions on the unsplit chain's fp32 state, so o, the checkpoints and every
# gradient are the unsplit call's, bit for bit. GatedDeltaNet B1 T32768 H16 HV32 on an H100: 7.49 → 7.34 ms
# (``bench_train.py``, ``bench_gates.py --train --no-split-recompute`` for the A/B); at two segments nothing measurable
# (KDA B1 T8192 H64), hence at least RECOMPUTE_MIN_SEGMENTS
SPLIT_RECOMPUTE = True
RECOMPUTE_MIN_SEGMENTS = 4


class PairSaved(NamedTuple):
    """The two-tile form's part of :class:`Saved` (the backward's recomputation makes it, :func:`trains_pairs`):
    ``workspace`` flat uint8 ``[WorkspaceSpec(pairs=True).nbytes]``, the pair workspace and its cross blocks
    (:func:`pair_workspace_of`); ``u_a`` bf16 :func:`~cute_kda.workspace.pair_u_shape`, tile a's U a pair;
    ``partners``: the pair partners' fields from K1's pair variant (a per-head gate), else None (then
    ``Saved.workspace`` is K1's per tile, which holds them)."""

    workspace: torch.Tensor
    u_a: torch.Tensor
    partners: PartnerFields | None = None


class Saved(NamedTuple):
    """What the training forward leaves for the backward besides the inputs.

    workspace: flat uint8 ``[WorkspaceSpec.nbytes]`` (:func:`workspace_of` carves the K1 fields);
    checkpoints: bf16 ``[H · slots, D, D]``, the state entering every tile (state images from the kernels,
    :func:`cute_kda.workspace.states_to_images`; ``[K, V]`` matrices from the reference backend); tile_base: None (fixed
    length) or int32 ``[N+1]``. Under ``Options.recompute`` workspace and checkpoints are None
    (:func:`recomputed` makes them in the backward). segment_states: None unsplit, else fp32 ``[2, segments, H, V, K]``,
    the state entering every segment and every segment's transition
    (:func:`cute_kda.context_parallel.segment_states`), kept under ``recompute`` too (two states a segment).
    pairs: the two-tile form's (:class:`PairSaved`; only within a backward, from ``Backend.pair_states``): then
    ``checkpoints`` hold the state entering each pair (:func:`~cute_kda.workspace.pair_blocks_shape`) and ``workspace``
    is K1's per tile (Kernel B's INV and β, and each pair partner's fields), or None where ``pairs.partners`` holds
    those fields (Kernel B then reads INV and β of the pair workspace, the same per tile).
    """

    workspace: torch.Tensor | None
    checkpoints: torch.Tensor | None
    tile_base: torch.Tensor | None
    segment_states: torch.Tensor | None = None
    pairs: PairSaved | None = None


class ForwardResult(NamedTuple):
    """out bf16 ``[B, T, H, V]`` (None from a forward run for its saved states alone); final_state None or
    ``[N, H, V, K]`` in ``Options.final_state_dtype``."""

    out: torch.Tensor | None
    final_state: torch.Tensor | None
    saved: Saved


class ScanResult(NamedTuple):
    """Kernel A: dv (bf16, or fp16 as asked), du bf16 ``[B, T, H, V]``; state_grads bf16 like the checkpoints (the
    gradient w.r.t. the state after each tile); dh0 None or ``[N, H, V, K]`` in the requested dtype."""

    dv: torch.Tensor
    du: torch.Tensor
    state_grads: torch.Tensor
    dh0: torch.Tensor | None


class GradsResult(NamedTuple):
    """Kernel B: dq, dk, dg bf16 ``[B, T, H, K]``; dbeta bf16 ``[B, T, H]``; dA_log fp32 ``[H]``;
    ddt_bias fp32 ``[H, K]``. A per-head gate: dq, dk summed over each group of value heads; dg ``[B, T, HV]`` in
    g's dtype; dbeta ``[B, T, HV]``; dA_log, ddt_bias ``[HV]`` (None for the log decay)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor
    ddt_bias: torch.Tensor


class Backend(NamedTuple):
    """The three stages of a training step.

    forward(inputs, options, segment_states=None, token_outputs=True) → :class:`ForwardResult` (without workspace and
    checkpoints under ``options.recompute``; ``segment_states``: a segmented call's, when an earlier forward made them;
    ``token_outputs`` False: for the saved states alone, out None — the backward's recomputation);
    scan(inputs, options, saved, do, dht, dh0_dtype, dv_dtype) → :class:`ScanResult` (do bf16 ``[B, T, H, V]``
    contiguous; dht None or bf16 / fp32 ``[N, H, V, K]`` contiguous; dh0_dtype None: no dh0; dv in ``dv_dtype``: bf16,
    or fp16 as ``f16(bf16(x))`` for fp16 training);
    grads(inputs, options, saved, do, scan, grad_dtype) → :class:`GradsResult` (``grad_dtype``: dq, dk and a
    per-channel gate's dg in bf16, or fp16 as ``f16(bf16(x))``: fp16 training, without grouped value heads);
    pair_states(inputs, options, segment_states=None) → :class:`Saved` with :class:`PairSaved`: the recomputation of
    the two-tile form (:func:`trains_pairs`; None: a backend without it recomputes per tile), which ``scan`` and
    ``grads`` then follow (``segment_states``: the forward's, as ``forward`` takes them).
    """

    name: str
    forward: Callable[..., ForwardResult]
    scan: Callable[..., ScanResult]
    grads: Callable[..., GradsResult]
    pair_states: Callable[..., Saved] | None = None


def pair_training_vsplit(scheme: str) -> int | None:
    """The smallest K2 V-split at which a recomputing backward of gate scheme ``scheme`` runs the two-tile form, None
    where it never does (:data:`PAIR_TRAINING_SCHEMES`, :data:`PAIR_TRAINING_MIN_VSPLIT`)."""
    return PAIR_TRAINING_MIN_VSPLIT.get(scheme) if scheme in PAIR_TRAINING_SCHEMES else None


def trains_pairs(backend: Backend, x: Inputs, options: Options) -> bool:
    """Whether a recomputing backward runs the two-tile form (:data:`PAIR_TRAINING`): ``backend`` has the stage, bf16
    inputs, an unsplit call, and K2's V-split (``options.vsplit``, else its heuristic on q's device; 1 off CUDA) at
    least :func:`pair_training_vsplit`'s for the gate's scheme."""
    least = pair_training_vsplit(gate_scheme(options.gate, x.g.dim() == 3))
    if not (PAIR_TRAINING and backend.pair_states is not None and least is not None and options.recompute
            and options.segmentation is None and x.q.dtype == torch.bfloat16):
        return False
    vsplit = options.vsplit
    if vsplit is None:
        problem, device = options.problem, x.q.device
        vsplit = (RecurrenceVariant.choose_vsplit(problem.num_seqs, problem.heads, sm_count(device.index))
                  if device.type == "cuda" else 1)
    return vsplit >= least


def workspace_spec(problem: ProblemShape, pairs: bool = False) -> WorkspaceSpec:
    """The K1 workspace of ``problem``: ``tiles_per_head`` slots per head (with the pair variants' cross blocks when
    ``pairs``)."""
    return WorkspaceSpec(
        heads=problem.heads, tiles=tiles_per_head(problem.total_tokens, problem.num_seqs, problem.varlen),
        dim=problem.head_dim, pairs=pairs,
    )


def recompute_split(options: Options, device: torch.device,
                    kept: torch.Tensor | None = None) -> context_parallel.Segmentation | None:
    """The segments whose recomputation a recomputing call's backward runs side by side (:data:`SPLIT_RECOMPUTE`), or
    None: a fixed-length, unsplit ``options.recompute`` call of one sequence whose ``H`` chains leave SMs of ``device``
    idle, cut into ``SMs // H`` segments (fewer where one would have under
    :data:`~cute_kda.context_parallel.MIN_SEGMENT_TILES` tiles) of an even number of tiles, so that the two-tile
    form's pairs start on each segment's first tile as on the sequence's; at least :data:`RECOMPUTE_MIN_SEGMENTS` of
    them (``SMs // H`` at least that: chains at V-split 4 or more). ``kept``: the backward's, the forward's
    ``Saved.segment_states`` of such a call: its segments, whatever the switch says now."""
    problem = options.problem
    if kept is None and not (SPLIT_RECOMPUTE and options.recompute):
        return None
    if options.segmentation is not None or problem.varlen or problem.num_seqs != 1 or problem.heads == 0:
        return None
    tiles = -(-problem.seq_len // CHUNK)
    count = min(available_sms(device) // problem.heads, tiles // context_parallel.MIN_SEGMENT_TILES)
    split = None
    if count >= RECOMPUTE_MIN_SEGMENTS:
        length = -(-tiles // count)
        split = context_parallel.Segmentation(1, problem.seq_len, (length + length % 2) * CHUNK)
        if split.count < RECOMPUTE_MIN_SEGMENTS:  # fewer once rounded to even lengths
            split = None
    if kept is not None and (split is None or kept.shape[:2] != (1, split.count - 1)):
        raise ValueError(f"kept segment states {tuple(kept.shape)} do not fit this device's recompute split {split}")
    return split


def chain_in_segments(split: context_parallel.Segmentation, x: Inputs, run: Callable[..., None],
                      final_state: torch.Tensor | None, kept: torch.Tensor | None = None) -> torch.Tensor | None:
    """K2 over the segments of ``split`` (:func:`recompute_split`), ``run(cu_seqlens, tile_base, initial_state,
    final_state, vsplit)`` a segment: a call of the packed problem's one segment (its bounds ``[2]``), which reads
    and writes the unsplit workspace, o and kept rows at the segment's tiles. ``kept`` None (the forward): one segment
    after the other on the current stream at the call's V-split (None), each handing the fp32 state leaving it to the
    next, the last writing ``final_state``; returns the states entering segments 1 … C − 1, fp32
    ``[1, C − 1, H, V, K]``. ``kept`` given (the backward's recomputation): the segments side by side from ``x``'s
    initial state and ``kept``, the first on the current stream and each other on a side stream of its own (on a
    GPU), at V-split 1, no final state."""
    cu_seqlens, tile_base = split.on_device(x.q.device)
    count, cuda = split.count, x.q.device.type == "cuda"
    first = x.initial_state

    def segment(c: int, leaving: torch.Tensor | None, vsplit: int | None) -> None:
        run(cu_seqlens[c:c + 2], tile_base[c:c + 2], first if c == 0 else kept[0, c - 1:c], leaving, vsplit)

    if kept is None:
        _, _, heads, dim = x.v.shape
        kept = torch.empty((1, count - 1, heads, dim, dim), dtype=torch.float32, device=x.q.device)
        # an fp16 state cannot share a K2 pass with an fp32 one (one staging buffer): the caller's widened exactly,
        # the final one stored in fp32 and rounded as K2 rounds it (f16(S32))
        if first is not None and first.dtype == torch.float16:
            first = first.float()
        last = final_state
        if final_state is not None and final_state.dtype == torch.float16:
            last = torch.empty_like(final_state, dtype=torch.float32)
        for c in range(count):
            segment(c, kept[0, c:c + 1] if c < count - 1 else last, None)
        if last is not final_state:
            final_state.copy_(last)
        return kept
    streams = side_streams(x.q.device, count - 1) if cuda else ()
    current = torch.cuda.current_stream(x.q.device) if cuda else None
    for stream in streams:
        stream.wait_stream(current)
    for c in range(count):
        with torch.cuda.stream(streams[c - 1]) if cuda and c else contextlib.nullcontext():
            segment(c, None, 1)
    for stream in streams:
        current.wait_stream(stream)
    return None


_SIDE_STREAMS: dict[int, list] = {}


def side_streams(device: torch.device, count: int) -> list:
    """``count`` CUDA streams of ``device`` beside the caller's, made once and kept."""
    streams = _SIDE_STREAMS.setdefault(device.index if device.index is not None else torch.cuda.current_device(), [])
    while len(streams) < count:
        streams.append(torch.cuda.Stream(device=device))
    return streams[:count]


def workspace_of(options: Options, saved: Saved) -> Workspace:
    """The K1 field views of ``saved.workspace``."""
    return workspace_views(workspace_spec(options.problem), saved.workspace)


def pair_workspace_of(options: Options, saved: Saved) -> tuple[Workspace, CrossBlocks]:
    """The pair workspace's fields and cross blocks in ``saved.pairs.workspace``."""
    spec = workspace_spec(options.problem, pairs=True)
    return workspace_views(spec, saved.pairs.workspace), cross_block_views(spec, saved.pairs.workspace)


def pair_kept_shapes(problem: ProblemShape) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(the pair checkpoints' and snapshots' ``[H · pair slots, D, D]``, tile a's U ``[H · pair slots, D, 16]``:
    :func:`~cute_kda.workspace.pair_blocks_shape`, :func:`~cute_kda.workspace.pair_u_shape`)."""
    rows = problem.heads * pair_block_slots(workspace_spec(problem).tiles, problem.num_seqs)
    return (rows, problem.head_dim, problem.head_dim), (rows, problem.head_dim, CHUNK)


def checkpoints_shape(problem: ProblemShape) -> tuple[int, int, int]:
    """``[H · slots, D, D]`` of the checkpoints and of the state gradients, one slot per tile
    (:func:`cute_kda.workspace.block_states_shape` of the problem's workspace)."""
    slots = snapshot_slots(workspace_spec(problem).tiles, problem.num_seqs)
    return (problem.heads * slots, problem.head_dim, problem.head_dim)


def packed(x: Inputs, options: Options) -> tuple[Inputs, Options]:
    """What the stages run: a segmented call's inputs as one packed row of segments (``[1, N · T, ...]`` views,
    ``cu_seqlens`` the segment bounds on q's device) and the packed problem; an unsplit call as it is."""
    seg = options.segmentation
    if seg is None:
        return x, options
    flat = [t if t.shape[0] == 1 else t.reshape(1, -1, *t.shape[2:]) for t in (x.q, x.k, x.v, x.g, x.beta)]
    cu_seqlens, tile_base = seg.on_device(x.q.device)
    return (Inputs(*flat, x.A_log, x.dt_bias, x.initial_state, cu_seqlens, tile_base),
            options._replace(problem=seg.problem(options.problem.heads, options.problem.head_dim)))


def entering_states(options: Options, x: Inputs, segment_states: torch.Tensor | None,
              final_states: context_parallel.FinalStates) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the initial states of the packed run, the segment states): ``x.initial_state`` and None unsplit; else the
    entering states ``[segments, H, V, K]`` fp32 of ``segment_states``, made first when not given."""
    seg = options.segmentation
    if seg is None:
        return x.initial_state, None
    if segment_states is None:
        segment_states = context_parallel.segment_states(seg, final_states, x.v, x.initial_state)
    return segment_states[0], segment_states


def final_state_buffer(options: Options, device: torch.device) -> torch.Tensor | None:
    """The final-state buffer of the packed run: ``[N, H, V, K]`` in the requested dtype; fp32 for every segment
    of a segmented call (:func:`final_state_of` takes the last ones)."""
    if options.final_state_dtype is None:
        return None
    dtype = torch.float32 if options.segmentation is not None else options.final_state_dtype
    return torch.empty(options.problem.state_shape, dtype=dtype, device=device)


def final_state_of(options: Options, final_state: torch.Tensor | None) -> torch.Tensor | None:
    """Each sequence's final state, contiguous, in the requested dtype."""
    if options.segmentation is None or final_state is None:
        return final_state
    # a copy of its own: a view would keep every segment's final state alive
    return options.segmentation.last(final_state).to(options.final_state_dtype, copy=True).contiguous()


def segment_scan(options: Options, saved: Saved, dht: torch.Tensor | None, dh0_dtype: torch.dtype | None,
                 scan: Callable[..., ScanResult], device: torch.device) -> ScanResult:
    """The backward scan: ``scan(dht, dh0, token_outputs)`` runs the packed scan, writing the gradient w.r.t. every
    packed sequence's initial state into ``dh0`` (None: none asked). A segmented call (``[segments, H, V, K]``
    states) scans once with zero gradients leaving the segments for their own gradients (dh0 only:
    ``token_outputs`` False; :func:`cute_kda.context_parallel.exiting_gradients` gives the buffer), combines, then
    runs the real scan. Unsplit: ``scan(dht, dh0)`` with dh0 in ``dh0_dtype`` on ``device``."""
    seg = options.segmentation
    if seg is None:
        dh0 = None if dh0_dtype is None else torch.empty(options.problem.state_shape, dtype=dh0_dtype, device=device)
        return scan(dht, dh0)
    leaving = context_parallel.exiting_gradients(seg, lambda local: scan(None, local, token_outputs=False),
                                                 saved.segment_states[1], dht)
    per_segment = None
    if dh0_dtype is not None:
        per_segment = torch.empty(options.problem.state_shape, dtype=torch.float32, device=device)
    result = scan(leaving, per_segment)
    dh0 = None if dh0_dtype is None else seg.first(result.dh0).to(dh0_dtype, copy=True).contiguous()
    return result._replace(dh0=dh0)


# ---------------------------------------------------------------------------------------------
# the kernel backend


def _kernel_forward(x: Inputs, options: Options, segment_states: torch.Tensor | None = None,
                    token_outputs: bool = True) -> ForwardResult:
    """K1 into a fresh workspace, K2 with checkpoints (without them under ``options.recompute``, the
    workspace then dropped), on the current stream of q's device. A segmented call (packed, :func:`packed`) runs K2
    twice more first, for the segment states (:func:`cute_kda.context_parallel.segment_states`), unless given.
    ``token_outputs`` False (with checkpoints): no o (:data:`STATES_ONLY_PASSES`). A recomputing call whose backward
    runs the two-tile form (:func:`trains_pairs`) runs :func:`pair_chain`, as its inference forward does. A recomputing
    call with a :func:`recompute_split` runs K2 a segment after the other and keeps the states entering them; the
    backward's recomputation of such a call (its ``segment_states`` given, unsplit) runs the segments side by side
    (:func:`chain_in_segments`)."""
    validation.check_on_cuda("q", x.q)
    check_supported(x.q.device)
    from ..ops import prepare as k1
    from ..ops import recurrence as k2

    if not token_outputs and options.recompute:
        raise ValueError("a forward without token outputs keeps its checkpoints (options.recompute False)")
    problem, device = options.problem, x.q.device
    resumed = segment_states is not None and options.segmentation is None  # a recomputation from kept states
    split = recompute_split(options, device, segment_states if resumed else None)
    if options.recompute and trains_pairs(KERNELS, x, options):  # the inference prefill's chain: its o
        chain = pair_chain(x, options, keep=False, split=split)
        return ForwardResult(chain.out, chain.final_state, Saved(None, None, chain.tile_base, chain.kept))
    buffer = torch.empty(workspace_spec(problem).nbytes, dtype=torch.uint8, device=device)
    saved_ws = workspace_views(workspace_spec(problem), buffer)
    checkpoints = None
    if not options.recompute:
        checkpoints = torch.empty(checkpoints_shape(problem), dtype=torch.bfloat16, device=device)
    out = torch.empty_like(x.v) if token_outputs else None

    def unread_out() -> torch.Tensor | None:  # the o argument of a pass whose o nobody reads
        if STATES_ONLY_PASSES:
            return None
        return out if out is not None else torch.empty_like(x.v)

    final_state = final_state_buffer(options, device)
    tile_base = x.tile_base
    if tile_base is None and problem.varlen:
        tile_base = k1.tile_bases(x.cu_seqlens)
    k1.prepare(
        x.q, x.k, x.g, x.beta, x.A_log, x.dt_bias, saved_ws, scale=options.scale, lower_bound=options.lower_bound,
        cu_seqlens=x.cu_seqlens, tile_base=tile_base, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
        gate=options.gate,
    )
    token_out = out if token_outputs else unread_out()
    if split is not None:
        def segment(cu_seqlens, segment_base, initial, leaving, vsplit) -> None:
            k2.recurrence(x.v, saved_ws, token_out, cu_seqlens=cu_seqlens, tile_base=segment_base,
                          initial_state=initial, final_state=leaving,
                          vsplit=options.vsplit if vsplit is None else vsplit, checkpoints=checkpoints)

        kept = chain_in_segments(split, x, segment, final_state, segment_states if resumed else None)
        return ForwardResult(out, final_state, Saved(None if options.recompute else buffer, checkpoints, tile_base,
                                                     kept))

    def final_states(v: torch.Tensor, initial: torch.Tensor | None, into: torch.Tensor) -> None:
        k2.recurrence(v, saved_ws, unread_out(), cu_seqlens=x.cu_seqlens, tile_base=tile_base, initial_state=initial,
                      final_state=into, vsplit=options.vsplit)

    initial_state, segment_states = entering_states(options, x, segment_states, final_states)
    k2.recurrence(
        x.v, saved_ws, token_out, cu_seqlens=x.cu_seqlens, tile_base=tile_base,
        initial_state=initial_state, final_state=final_state, vsplit=options.vsplit, checkpoints=checkpoints,
    )
    return ForwardResult(out, final_state_of(options, final_state),
                         Saved(None if options.recompute else buffer, checkpoints, tile_base, segment_states))


class PairChain(NamedTuple):
    """:func:`pair_chain`'s results: the flat pair workspace (``PairSaved.workspace``), o (None without token outputs),
    the final state (None unless asked), and with ``keep`` the state entering each pair (state images) and tile a's U;
    ``tile_base``; ``kept``: a forward's states entering the segments of its ``split`` (:func:`chain_in_segments`),
    else None."""

    workspace: torch.Tensor
    out: torch.Tensor | None
    final_state: torch.Tensor | None
    checkpoints: torch.Tensor | None
    u_a: torch.Tensor | None
    tile_base: torch.Tensor | None
    kept: torch.Tensor | None = None


def pair_chain(x: Inputs, options: Options, *, keep: bool, vsplit: int | None = None,
               token_outputs: bool = True, partners: PartnerFields | None = None,
               split: context_parallel.Segmentation | None = None,
               segment_states: torch.Tensor | None = None) -> PairChain:
    """An unsplit call's chain on the two-tile variants, on the current stream of q's device: K1's pair variant into a
    fresh pair workspace, then K2's pair variant from ``x.initial_state`` at ``vsplit`` (None: ``options.vsplit``):
    o, the final state in ``options.final_state_dtype`` (None: none), and with ``keep`` a state a pair
    (:func:`~cute_kda.workspace.pair_blocks_shape` state images) and tile a's U (:func:`pair_kept_shapes`). The
    inference prefill's variants, the same o and final state whether it keeps them or not; ``token_outputs`` False
    (with ``keep``): no o (out None), the same kept states; ``partners``: K1's pair variant also fills these pair
    partners' fields (a per-head gate). ``split`` (:func:`recompute_split`): K2 over its segments
    (:func:`chain_in_segments`), one after the other keeping the states entering them, or side by side from the
    kept ``segment_states``."""
    from ..ops import prepare as k1
    from ..ops import recurrence as k2

    problem, device = options.problem, x.q.device
    spec = workspace_spec(problem, pairs=True)
    buffer = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    ws, cross = workspace_views(spec, buffer), cross_block_views(spec, buffer)
    tile_base = x.tile_base
    if tile_base is None and problem.varlen:
        tile_base = k1.tile_bases(x.cu_seqlens)
    k1.prepare(x.q, x.k, x.g, x.beta, x.A_log, x.dt_bias, ws, scale=options.scale, lower_bound=options.lower_bound,
               cu_seqlens=x.cu_seqlens, tile_base=tile_base, qk_l2norm=options.qk_l2norm,
               beta_logits=options.beta_logits, gate=options.gate, cross=cross, partners=partners)
    checkpoints = u_a = None
    if keep:
        kept, u_shape = pair_kept_shapes(problem)
        checkpoints = torch.empty(kept, dtype=torch.bfloat16, device=device)
        u_a = torch.empty(u_shape, dtype=torch.bfloat16, device=device)
    out, final_state = torch.empty_like(x.v) if token_outputs else None, final_state_buffer(options, device)
    vsplit = options.vsplit if vsplit is None else vsplit

    def run(cu_seqlens, segment_base, initial, leaving, segment_vsplit) -> None:
        k2.recurrence(x.v, ws, out, cu_seqlens=cu_seqlens, tile_base=segment_base, initial_state=initial,
                      final_state=leaving, vsplit=vsplit if segment_vsplit is None else segment_vsplit,
                      checkpoints=checkpoints, cross=cross, u_a=u_a)

    if split is None:
        run(x.cu_seqlens, tile_base, x.initial_state, final_state, None)
        return PairChain(buffer, out, final_state, checkpoints, u_a, tile_base)
    kept_states = chain_in_segments(split, x, run, final_state, segment_states)
    return PairChain(buffer, out, final_state, checkpoints, u_a, tile_base, kept_states)


def _kernel_pair_states(x: Inputs, options: Options, segment_states: torch.Tensor | None = None) -> Saved:
    """The two-tile form's recomputation (:func:`trains_pairs`): :func:`pair_chain` keeping a state and tile a's U a
    pair (its o unread: none formed under :data:`STATES_ONLY_PASSES`), its segments side by side where the forward
    kept ``segment_states`` (:func:`recompute_split`); a per-head gate's K1 pair variant also writes the pair
    partners' fields (:class:`~cute_kda.workspace.PartnerFields`), else K1 runs again into a fresh workspace for them
    (the safe gate's pair K1 has no such variant)."""
    from ..ops import prepare as k1

    problem = options.problem
    states_options = options._replace(final_state_dtype=None)
    split = None if segment_states is None else recompute_split(options, x.q.device, segment_states)
    resume = dict(split=split, segment_states=segment_states)
    if x.g.dim() == 3 and PARTNER_FIELDS:  # the per-head gate
        partners = allocate_partner_fields(workspace_spec(problem), x.q.device)
        chain = pair_chain(x, states_options, keep=True, token_outputs=not STATES_ONLY_PASSES, partners=partners,
                           **resume)
        return Saved(None, chain.checkpoints, chain.tile_base, None, PairSaved(chain.workspace, chain.u_a, partners))
    buffer = torch.empty(workspace_spec(problem).nbytes, dtype=torch.uint8, device=x.q.device)
    chain = pair_chain(x, states_options, keep=True, token_outputs=not STATES_ONLY_PASSES, **resume)
    k1.prepare(x.q, x.k, x.g, x.beta, x.A_log, x.dt_bias, workspace_views(workspace_spec(problem), buffer),
               scale=options.scale, lower_bound=options.lower_bound, cu_seqlens=x.cu_seqlens,
               tile_base=chain.tile_base, qk_l2norm=options.qk_l2norm, beta_logits=options.beta_logits,
               gate=options.gate)
    return Saved(buffer, chain.checkpoints, chain.tile_base, None, PairSaved(chain.workspace, chain.u_a))


def _kernel_scan(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None,
                 dh0_dtype: torch.dtype | None, dv_dtype: torch.dtype = torch.bfloat16) -> ScanResult:
    """Kernel A (:func:`cute_kda.ops.bwd_scan.bwd_scan`); twice for a segmented call (:func:`segment_scan`); its pair
    scan over the pair workspace with ``saved.pairs`` (a state gradient a pair)."""
    from ..ops import bwd_scan as ka

    dv, du = torch.empty_like(do, dtype=dv_dtype), torch.empty_like(do)  # du bf16 like dO, Kernel B's
    state_grads = torch.empty_like(saved.checkpoints)
    ws, cross = (workspace_of(options, saved), None) if saved.pairs is None else pair_workspace_of(options, saved)
    pair_options = {} if cross is None else dict(cross=cross, snapshot_every=2)

    def scan(leaving: torch.Tensor | None, dh0: torch.Tensor | None, token_outputs: bool = True) -> ScanResult:
        ka.bwd_scan(do, ws, dv, du, state_grads, cu_seqlens=x.cu_seqlens, tile_base=saved.tile_base, dht=leaving,
                    dh0=dh0, token_outputs=token_outputs, **pair_options)
        return ScanResult(dv, du, state_grads, dh0)

    return segment_scan(options, saved, dht, dh0_dtype, scan, do.device)


def _kernel_grads(x: Inputs, options: Options, saved: Saved, do: torch.Tensor, scan: ScanResult,
                  grad_dtype: torch.dtype = torch.bfloat16) -> GradsResult:
    """Kernel B (:func:`cute_kda.ops.bwd_grads.bwd_grads`), its gate partials summed over the tiles; dq, dk and a
    per-channel gate's dg stored by it in ``grad_dtype``; with ``saved.pairs`` on the pair form's kept matrices."""
    from ..ops import bwd_grads as kb

    partners = None if saved.pairs is None else saved.pairs.partners
    # INV and β per tile: K1's workspace (also the pair partners' fields), or the pair workspace's (the same values)
    # beside K1's pair variant's partner fields
    ws = workspace_of(options, saved) if partners is None else pair_workspace_of(options, saved)[0]
    pair = None
    if saved.pairs is not None:
        pair = kb.PairTensors(saved.pairs.u_a, scan.dv, ws if partners is None else partners)
    per_head = x.g.dim() == 3  # GatedDeltaNet's per-head gate
    ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, options.problem.heads, per_head)
    constants = options.gate != "none"  # a log decay has no A_log / dt_bias
    ddt_partial = torch.empty(ddt_shape, dtype=torch.float32, device=do.device) if constants else None
    dalog_partial = torch.empty(dalog_shape, dtype=torch.float32, device=do.device) if constants else None
    unbounded = options.gate != "safe"  # dq, dk per value head (summed over each group below), else like q, k
    # groups of two value heads: Kernel B adds each pair into zeroed dq, dk per q/k head
    pairs = unbounded and kb.sums_pairs(x.q.shape[2], x.v.shape[2], grad_dtype)
    if pairs:
        dq, dk = (torch.zeros_like(t, dtype=grad_dtype) for t in (x.q, x.k))
    else:
        dq, dk = (torch.empty_like(x.v if unbounded else t, dtype=grad_dtype) for t in (x.q, x.k))
    # dg: fp32 per (token, head) for a per-head gate, else like dq (a fp32 log decay's bf16 one is widened below)
    dg = torch.empty(x.g.shape, dtype=torch.float32 if per_head else grad_dtype, device=do.device)
    dbeta = torch.empty_like(x.beta)
    kb.bwd_grads(  # β enters through the workspace's activated ws.beta
        q=x.q, k=x.k, g=x.g, v=x.v, do=do, du=scan.du, ws=ws, states=saved.checkpoints,
        state_grads=scan.state_grads, A_log=x.A_log, dt_bias=x.dt_bias, dq=dq, dk=dk, dg=dg, dbeta=dbeta,
        ddt_partial=ddt_partial, dalog_partial=dalog_partial, scale=options.scale, lower_bound=options.lower_bound,
        cu_seqlens=x.cu_seqlens, tile_base=saved.tile_base, qk_l2norm=options.qk_l2norm,
        beta_logits=options.beta_logits, gate=options.gate,
        pair=pair,
    )
    if unbounded and not pairs:
        dq, dk = (group_sum(t, x.q.shape[2]) for t in (dq, dk))
    if per_head or grad_dtype == torch.bfloat16:
        dg = dg.to(x.g.dtype)
    return GradsResult(dq, dk, dg, dbeta, None if dalog_partial is None else dalog_partial.sum(1),
                       None if ddt_partial is None else ddt_partial.sum(1))


def group_sum(t: torch.Tensor, heads: int) -> torch.Tensor:
    """bf16 ``[B, T, HV, D]`` summed over each group of ``HV / heads`` value heads in fp32: ``[B, T, heads, D]``
    bf16 (the per-value-head dq, dk of grouped value heads; deterministic, no atomics). One reduction that reads
    the bf16 values and accumulates in fp32 (torch's accumulator type for bf16), rounding once: no fp32 copy of
    ``t`` (that copy and a reduction over it took 0.67 ms for each of dq, dk at T32768 HV32). Groups of two (Qwen3-Next's)
    are one elementwise add instead, the same bits (torch adds bf16 in fp32 and rounds once): the reduction over the
    middle mode took 0.27 ms a tensor at T32768 HV32 (docs/perf-log.md, GDN2 / GDN3)."""
    batch, steps, value_heads, dim = t.shape
    if value_heads == heads:
        return t
    groups = t.view(batch, steps, heads, value_heads // heads, dim)
    if groups.shape[3] == 2:
        return torch.add(groups[:, :, :, 0], groups[:, :, :, 1])
    return groups.sum(3)


KERNELS = Backend("kernels", _kernel_forward, _kernel_scan, _kernel_grads, _kernel_pair_states)
