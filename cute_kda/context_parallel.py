"""Context parallelism: each long sequence split into segments that the serial scans run side by side.

Why. K2 and Kernel A are serial over a sequence's 16-token tiles, one CTA chain per (sequence, head, V band). With
few (sequence, head) pairs most SMs idle: at B1 T32768 H16 the best V-split gives 64 K2 CTAs of 2048 steps, and a
narrower band shortens a step far less than it divides the work (K2 on the H200: 0.94 µs a step for 128 columns,
0.66 µs for 32). Cutting every sequence into C segments of whole tiles gives C times the chains at full width, for
the price of extra passes over the segments.

The algebra (v-first states ``X = Sᵀ``, ``[V, K]``, as the kernels keep them). Over one segment the state recurrence
is affine in the state entering it:

    X_end = X_start · F + H

``F`` (``[K, K]``) is the segment's transition: its final state when run from ``X_start = I`` with ``v = 0`` (a
K × K identity is a state of V = K columns). ``H`` is its final state when run from zero with the real ``v``. So the
forward is (:func:`segment_states`): one pass for every ``H``, one for every ``F`` (the same kernel on ``v = 0``), a
serial combine over the segments of each sequence (``C − 1`` batched matmuls of 128 × 128, fp32), then the real run
of every segment from the state entering it. The backward scan is the adjoint (:func:`exiting_gradients`):
``dX_start = dX_end · Fᵀ + L`` with ``L`` a segment's own gradient (its scan with a zero ``dht``), so one scan pass
for every ``L``, a reverse combine with the forward's ``F``, and the real scan with the gradient leaving each segment
as its ``dht``. The transitions come from the forward; nothing is transposed on the device.

Every pass is the varlen form of the kernels on a packed problem whose sequences are the segments
(:meth:`Segmentation.cu_seqlens`): the tiles, the workspace, K1, Kernel B and the per-tile checkpoints are those of
the unsplit problem, because a segment boundary falls on a tile boundary. Results differ from the unsplit chain by
rounding only (the entering states pass through the fp32 combine instead of the chain's registers); the first
segment of each sequence is computed exactly as without segments.

On one GPU (:class:`Segmentation`): fixed-length batches only (``cu_seqlens`` None): the segment bounds are then known
on the host, and so is the serial combine's shape, with no device value read.

Across the ranks of a process group (:class:`RankChain`, FLA's ``cp_context``): each rank holds a share of the
tokens laid out as FLA lays them out (:mod:`cute_kda.distributed`), a packed row of local sequences, and runs the
same three passes on it; the combine runs over the ranks instead of the segments, from every rank's (``H``, ``F``)
summary gathered by one collective, and the backward's likewise from every rank's (``L``, ``F``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch

from .device import available_sms, sm_count
from .distributed import all_gather
from .numerics import CHUNK
from .validation import ProblemShape
from .workspace import tile_bases_of

# The heuristic's bounds. A segment of fewer tiles leaves the combine's launches and the extra passes without work
# to hide behind; fewer segments than MIN_SEGMENTS do not pay for the extra passes (K2 runs three, at
# 0.94 µs a step, against one at the best V-split's 0.66 µs: C ≥ 3 · 0.94 / 0.66 ≈ 4.3 breaks even; Kernel A
# runs two at 1.5 µs against 0.7: C ≥ 4.3 too).
MIN_SEGMENT_TILES = 64
MIN_SEGMENTS = 6


class Segmentation(NamedTuple):
    """``num_seqs`` sequences of ``seq_len`` tokens, each cut into segments of ``length`` tokens (a multiple of the
    tile; a sequence's last segment may be shorter)."""

    num_seqs: int
    seq_len: int
    length: int

    @property
    def per_seq(self) -> int:
        """Segments per sequence."""
        return -(-self.seq_len // self.length)

    @property
    def count(self) -> int:
        """Segments in all: the sequences of the packed problem."""
        return self.num_seqs * self.per_seq

    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``[count + 1]`` on the CPU: the segment bounds in the flattened ``[1, N · T]`` token order."""
        return _segment_bounds(self.num_seqs, self.seq_len, self.length)

    def tile_bases(self) -> torch.Tensor:
        """int32 ``[count + 1]`` on the CPU: the global tile index of each segment's first tile
        (:func:`cute_kda.workspace.tile_bases_of`), what ``ops.prepare.tile_bases`` computes on the device."""
        return tile_bases_of(self.cu_seqlens())

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`cu_seqlens`, :meth:`tile_bases`) on ``device``, made once per (segmentation, device, stream) and
        kept: on a GPU copied asynchronously from pinned memory, so a call launches neither a copy nor the tile prefix
        (like the inference workspace cache, not for a first call under CUDA-graph capture: the copy would be captured
        and the kept tensors come from the graph's pool); on the CPU (the reference stages) the host tensors."""
        return _kept_on_device(self, device)

    def problem(self, heads: int, head_dim: int) -> ProblemShape:
        """The packed problem of the segments: ``[1, N · T]`` tokens, ``count`` sequences."""
        return ProblemShape(1, self.num_seqs * self.seq_len, heads, head_dim, self.count, True)

    def by_sequence(self, states: torch.Tensor) -> torch.Tensor:
        """``[count, ...]`` per-segment tensors as ``[N, C, ...]``."""
        return states.view(self.num_seqs, self.per_seq, *states.shape[1:])

    def first(self, states: torch.Tensor) -> torch.Tensor:
        """Each sequence's first segment of ``[count, ...]``: ``[N, ...]`` (a view)."""
        return self.by_sequence(states)[:, 0]

    def last(self, states: torch.Tensor) -> torch.Tensor:
        """Each sequence's last segment of ``[count, ...]``: ``[N, ...]`` (a view)."""
        return self.by_sequence(states)[:, -1]


# what a segmented call reads and never writes, kept per (what, device, stream): the bounds of
# Segmentation.on_device and RankChain.on_device, the identities of transition_identities
_KEPT: dict[tuple, Any] = {}
_KEPT_LIMIT = 64


def _kept(key: tuple, device: torch.device, make: Callable[[], Any]) -> Any:
    """``make()`` once per (``key``, device, current stream on a GPU) and kept (made on the stream that first reads
    it, so no other stream's work is ordered before it). Made outside inference mode: a training call saves them
    for its backward, which an inference tensor refuses, whatever mode the call that made them ran in."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (*key, device.type, device.index, stream)
    kept = _KEPT.get(key)
    if kept is None:
        if len(_KEPT) >= _KEPT_LIMIT:
            _KEPT.clear()
        with torch.inference_mode(False):
            kept = _KEPT[key] = make()
    return kept


def _kept_on_device(split: "Segmentation | RankChain", device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``split``'s (``cu_seqlens()``, ``tile_bases()``) on ``device`` as :meth:`Segmentation.on_device` describes."""
    def copies() -> tuple[torch.Tensor, ...]:
        if device.type != "cuda":
            return split.cu_seqlens(), split.tile_bases()
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in (split.cu_seqlens(), split.tile_bases()))

    return _kept(("bounds", split), device, copies)


def transition_identities(count: int, heads: int, dim: int, device: torch.device) -> torch.Tensor:
    """fp32 ``[count, heads, dim, dim]`` identities, the initial states of the transition pass (read only by K2 and
    its mirror), made once per (shape, device, stream) and kept as :meth:`Segmentation.on_device` keeps the bounds
    (on a GPU an ``eye`` and a copy launched less a call)."""
    def make() -> torch.Tensor:
        return torch.eye(dim, dtype=torch.float32, device=device).expand(count, heads, dim, dim).contiguous()

    return _kept(("identities", count, heads, dim), device, make)


@functools.lru_cache(maxsize=64)
@torch.inference_mode(False)  # kept: a later training call saves them (see _kept)
def _segment_bounds(num_seqs: int, seq_len: int, length: int) -> torch.Tensor:
    starts = torch.arange(0, seq_len, length, dtype=torch.int64)
    bounds = (torch.arange(num_seqs, dtype=torch.int64)[:, None] * seq_len + starts).flatten()
    return torch.cat((bounds, torch.tensor([num_seqs * seq_len], dtype=torch.int64)))


def segmentation_of(problem: ProblemShape, device: torch.device, segments: "int | RankChain | None",
                    vsplit: int | None) -> "Segmentation | RankChain | None":
    """:func:`plan` for the SMs of ``device``; on a CPU (the reference stages) only an explicit ``segments``
    splits. A :class:`RankChain` (a ``cp_context`` call's) is the split itself, checked against ``problem``."""
    if isinstance(segments, RankChain):
        segments.check(problem)
        return segments.split(available_sms(device), problem.heads, vsplit)
    if device.type != "cuda":
        return None if segments is None else plan(problem, 0, segments, vsplit)
    return plan(problem, sm_count(device.index), segments, vsplit)


def check_segments(segments: object) -> None:
    """``segments``: None (the heuristic) or an int ≥ 1 (1: no segments)."""
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
        raise ValueError(f"segments must be None or an int >= 1 (1: no context parallelism), got {segments!r}")


def plan(problem: ProblemShape, sms: int, segments: int | None = None,
         vsplit: int | None = None) -> Segmentation | None:
    """The segmentation of ``problem``, or None to run it unsplit.

    ``segments`` None: the heuristic: a fixed-length problem whose ``num_seqs · heads`` chains leave at least
    :data:`MIN_SEGMENTS` SMs to each is cut into ``sms // (num_seqs · heads)`` segments per sequence of at least
    :data:`MIN_SEGMENT_TILES` tiles, unless the caller fixed ``vsplit``. An int: that many segments per sequence
    (fewer where the sequence has fewer tiles), 1 meaning none. Varlen problems are not split: asking for segments
    there raises ``NotImplementedError``.
    """
    check_segments(segments)
    if problem.varlen and segments is not None and segments > 1:
        raise NotImplementedError("segments (context parallelism) with cu_seqlens: only fixed-length batches are "
                                  "split; pass segments=None or 1 for packed sequences")
    if not problem.concrete:  # a trace's symbolic sizes: computed, not cached
        return _plan.__wrapped__(problem, sms, segments, vsplit)
    return _plan(problem, sms, segments, vsplit)


@functools.lru_cache(maxsize=256)  # on the host path of every unsplit call
def _plan(problem: ProblemShape, sms: int, segments: int | None, vsplit: int | None) -> Segmentation | None:
    if problem.varlen or problem.heads == 0 or problem.seq_len == 0 or problem.num_seqs == 0:
        return None
    tiles = -(-problem.seq_len // CHUNK)
    if segments is None:
        if vsplit is not None:
            return None
        segments = min(sms // (problem.num_seqs * problem.heads), tiles // MIN_SEGMENT_TILES)
        if segments < MIN_SEGMENTS:
            return None
    segments = min(segments, tiles)
    if segments <= 1:
        return None
    length = -(-tiles // segments) * CHUNK
    return Segmentation(problem.num_seqs, problem.seq_len, length)


FinalStates = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], None]
LocalGradients = Callable[[torch.Tensor], object]


def segment_states(seg: Segmentation, final_states: FinalStates, v: torch.Tensor,
                   initial_state: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[2, count, H, V, K]``: the state entering every segment (``[0]``) and every segment's transition
    ``F`` (``[1]``), from two passes of the forward scan and the serial combine.

    ``final_states(v, initial, into)`` runs the forward scan (K2, or its mirror) over every segment with the packed
    problem's ``v`` ``[1, N · T, H, V]`` and ``initial`` (None: zero; else fp32 ``[count, H, V, K]``) and writes the
    fp32 final states into ``into`` ``[count, H, V, K]``. ``initial_state``: None or ``[N, H, V, K]``, the caller's.
    A :class:`RankChain` makes them with the other ranks (:meth:`RankChain.segment_states`).
    """
    if isinstance(seg, RankChain):
        return seg.segment_states(final_states, v, initial_state)
    heads, dim = v.shape[2], v.shape[3]
    kept = torch.empty((2, seg.count, heads, dim, dim), dtype=torch.float32, device=v.device)
    # segment c's H lands where X[c + 1] goes, for the combine to add to in place (the last segment's, which no
    # state needs, in the rows of the next sequence's X[0] or of F[0], both written after it)
    final_states(v, None, kept.view(2 * seg.count, heads, dim, dim)[1:seg.count + 1])
    final_states(torch.zeros_like(v), transition_identities(seg.count, heads, dim, v.device), kept[1])
    _combine(seg, kept[0], kept[1], initial_state, transpose=False)
    return kept


def exiting_gradients(seg: Segmentation, local_gradients: LocalGradients, transitions: torch.Tensor,
                      dht: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[count, H, V, K]``: the gradient w.r.t. the state leaving every segment, the reverse combine.

    ``local_gradients(into)`` runs the backward scan with zero gradients leaving the segments and writes each
    segment's fp32 gradient at its start into ``into`` (``[count, H, V, K]``); ``transitions``: the forward's ``F``
    (:func:`segment_states`'s ``[1]``); ``dht``: None or ``[N, H, V, K]``, the gradient w.r.t. each sequence's final
    state. A :class:`RankChain` combines with the other ranks (:meth:`RankChain.exiting_gradients`).
    """
    if isinstance(seg, RankChain):
        local = torch.empty_like(transitions)
        local_gradients(local)
        return seg.exiting_gradients(local, transitions, dht)
    rows = torch.empty((seg.count + 1, *transitions.shape[1:]), dtype=torch.float32, device=transitions.device)
    # segment c's L lands where G[c − 1] goes, for the combine to add to in place (the first segment's, which no
    # gradient needs, in the spare row 0 or in the sequence before's G[C − 1], written after it)
    local_gradients(rows[:seg.count])
    leaving = rows[1:]
    _combine(seg, leaving, transitions, dht, transpose=True)
    return leaving


def _combine(seg: Segmentation, into: torch.Tensor, transitions: torch.Tensor, boundary: torch.Tensor | None, *,
             transpose: bool) -> None:
    """The serial combine of :func:`segment_states` (``transpose`` False: ``X[c] = X[c−1]·F[c−1] + H[c−1]`` from
    ``X[0] = boundary``) or of :func:`exiting_gradients` (True: ``G[c−1] = G[c]·F[c]ᵀ + L[c]`` from
    ``G[C−1] = boundary``) in place in ``into`` (``[count, H, V, K]``; ``boundary`` None: zero), whose rows hold
    the addends already (``H[c−1]`` where ``X[c]`` goes, ``L[c]`` where ``G[c−1]`` goes): one batched matmul a
    segment over segment-major ``[C, N · H, V, K]`` operands, adding in place (into another tensor, ``baddbmm``
    would copy the addend there first: a device copy a segment). On a GPU one launch of cute_kda's combine kernel
    does it all instead (:func:`cute_kda.ops.segment_combine.combine_segments`; the same sums to fp32 rounding)."""
    if into.is_cuda:
        from .ops.segment_combine import combine_segments

        combine_segments(into, transitions, boundary, seg.per_seq, transpose=transpose)
        return
    count, heads, rows, cols = into.shape

    def segment_major(t: torch.Tensor) -> torch.Tensor:  # one sequence's segments are already, else a copy
        if seg.num_seqs == 1:
            return t
        return seg.by_sequence(t).transpose(0, 1).reshape(seg.per_seq, seg.num_seqs * heads, rows, cols)

    whole, steps = segment_major(into), segment_major(transitions)
    if transpose:
        steps = steps.transpose(-1, -2)
    # per-segment views by one unbind each (indexing in the loop costs a select a view on the host path)
    states, steps = whole.unbind(0), steps.unbind(0)
    first = seg.per_seq - 1 if transpose else 0
    if boundary is None:
        states[first].zero_()
    else:
        states[first].copy_(boundary.reshape(seg.num_seqs * heads, rows, cols))
    for target in (range(seg.per_seq - 2, -1, -1) if transpose else range(1, seg.per_seq)):
        source = target + 1 if transpose else target - 1
        states[target].baddbmm_(states[source], steps[source])
    if seg.num_seqs > 1:
        seg.by_sequence(into).copy_(whole.view(seg.per_seq, seg.num_seqs, heads, rows, cols).transpose(0, 1))


class ChainPart(NamedTuple):
    """One interval of a rank's tokens in a :class:`RankChain`: ``slot`` its place in the chain (the intervals in token
    order), ``first`` / ``last`` its first and last local sequence, ``before`` / ``after`` how many slots before /
    after it hold those same sequences (0: the sequence starts / ends in this interval)."""

    slot: int
    first: int
    last: int
    before: int
    after: int

    @property
    def passes_through(self) -> bool:
        """Whether the interval is one piece of a sequence that enters from the slot before and goes on to the slot
        after: only then is its transition a link of the chain."""
        return self.before > 0 and self.after > 0 and self.first == self.last


class RankChain(NamedTuple):
    """This rank's share of sequences split over the ``world`` ranks of ``group`` (FLA's ``cp_context``, read by
    :func:`cute_kda.fla_calls.rank_chain_of`): its tokens are a packed row of local sequences with the host bounds
    ``bounds``; ``parts`` its intervals in local order (one; two in FLA's zigzag layout), of ``slots`` in the chain;
    ``length`` > 0 cuts every local sequence further into segments of that many tokens (a multiple of the tile), run
    side by side as :class:`Segmentation` runs them (:meth:`split` chooses it on a GPU), 0 leaves them whole.

    A stand-in for :class:`Segmentation` in the stages (the same methods): the packed problem is the rank's segments.
    Its final state is each local sequence's state after its last token on this rank (a sequence's final state where
    it ends; where it goes on, the state the next rank starts from). Its initial state is read for the local
    sequences that start on this rank; a sequence entering from the rank before starts from the chain's state, and
    its row of dh0 is zero.
    """

    group: Any
    world: int
    slots: int
    parts: tuple[ChainPart, ...]
    bounds: tuple[int, ...]
    length: int = 0

    @property
    def count(self) -> int:
        """The segments: the packed problem's sequences."""
        return len(_segment_rows(self.bounds, self.length)[0]) - 1

    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``[count + 1]`` on the CPU: the segment bounds."""
        return torch.tensor(_segment_rows(self.bounds, self.length)[0], dtype=torch.int64)

    def tile_bases(self) -> torch.Tensor:
        """int32 ``[count + 1]`` on the CPU (:func:`cute_kda.workspace.tile_bases_of`)."""
        return tile_bases_of(self.cu_seqlens())

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`cu_seqlens`, :meth:`tile_bases`) on ``device``, kept as :meth:`Segmentation.on_device` keeps them."""
        return _kept_on_device(self, device)

    def problem(self, heads: int, head_dim: int) -> ProblemShape:
        """The rank's packed problem of segments."""
        return ProblemShape(1, self.bounds[-1], heads, head_dim, self.count, True)

    def check(self, problem: ProblemShape) -> None:
        """Refuse a call whose tokens are not the rank's share the chain describes."""
        self.check_tokens(problem.batch, problem.seq_len)
        if problem.num_seqs != len(self.bounds) - 1 or not problem.varlen:
            raise ValueError(f"cp_context describes {len(self.bounds) - 1} local sequences, the call has "
                             f"{problem.num_seqs}")

    def check_tokens(self, batch: int, seq_len: int) -> None:
        """Refuse ``[batch, seq_len]`` tokens that are not the rank's packed row."""
        if (batch, seq_len) != (1, self.bounds[-1]):
            raise ValueError(f"cp_context gives this rank {self.bounds[-1]} tokens, but the call has {batch} x "
                             f"{seq_len}: pass the rank's share as one packed row [1, {self.bounds[-1]}, ...]")

    def split(self, sms: int, heads: int, vsplit: int | None) -> RankChain:
        """The chain with :func:`plan`'s segments for ``sms`` SMs (its heuristic on the longest local sequence, the
        ``local sequences · heads`` chains sharing the SMs); unchanged when ``length`` is set or ``sms`` is 0."""
        rows = len(self.bounds) - 1
        if self.length or not sms:
            return self
        longest = max(b - a for a, b in zip(self.bounds, self.bounds[1:]))
        seg = plan(ProblemShape(rows, longest, heads, 0, rows, False), sms, None, vsplit)
        return self if seg is None else self._replace(length=seg.length)

    def first(self, states: torch.Tensor) -> torch.Tensor:
        """The caller's dh0 from the scan's fp32 ``[count, ...]``: each local sequence's first segment's, the rows
        of sequences that enter from another rank zeroed (their initial state is the chain's, not the caller's)."""
        states = states[list(_segment_rows(self.bounds, self.length)[1])]
        for part in self.parts:
            if part.before:
                states[part.first] = 0
        return states

    def last(self, states: torch.Tensor) -> torch.Tensor:
        """The caller's final states from ``[count, ...]``: each local sequence's last segment's."""
        return states[list(_segment_rows(self.bounds, self.length)[2])]

    def segment_states(self, final_states: FinalStates, v: torch.Tensor,
                       initial_state: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``[2, count, H, V, K]``: the state entering every segment (``[0]``) and every segment's transition
        ``F`` (``[1]``).

        Two passes over the segments (from zero with the real ``v``: ``H``; from the identity with ``v = 0``: ``F``);
        each interval's summary, its last local sequence's state leaving it (folded over its segments from the
        sequence's initial state, zero for one entering from another rank) and, where the interval passes one
        sequence through, that sequence's transition (the product of its segments'), gathered from every rank; the
        state entering an interval's first sequence combined in fp32 over the slots that hold it before,
        ``X = H[s0]``, then ``X = X · F[j] + H[j]``; last the fold over each sequence's segments from its entering
        state, ``X[c] = X[c−1] · F[c−1] + H[c−1]``."""
        heads, dim = v.shape[2], v.shape[3]
        _, firsts, lasts = _segment_rows(self.bounds, self.length)
        kept = torch.zeros((2, self.count, heads, dim, dim), dtype=torch.float32, device=v.device)
        entering, transitions = kept.unbind(0)
        local = torch.empty_like(entering)
        final_states(v, None, local)
        identity = torch.eye(dim, dtype=torch.float32, device=v.device).expand(self.count, heads, dim, dim)
        if self.length or initial_state is not None or any(part.before for part in self.parts):
            final_states(torch.zeros_like(v), identity.contiguous(), transitions)  # else no state to carry: F unused
        starts = torch.zeros((len(firsts), heads, dim, dim), dtype=torch.float32, device=v.device)
        if initial_state is not None:
            starts.copy_(initial_state)
        for part in self.parts:  # the caller's row is not read: the state comes from the chain
            if part.before:
                starts[part.first] = 0
        pieces = kept.new_zeros((len(self.parts), 2, heads, dim, dim))
        for index, part in enumerate(self.parts):
            rows = range(firsts[part.last], lasts[part.last] + 1)
            pieces[index, 0] = _fold(starts[part.last], local, transitions, rows, transpose=False)
            if part.passes_through:
                pieces[index, 1] = _fold(identity[0], None, transitions, rows, transpose=False)
        chain = self._in_chain_order(all_gather(pieces, self.group))
        for part in self.parts:
            if part.before:
                starts[part.first] = _fold(chain[part.slot - part.before, 0], chain[:, 0], chain[:, 1],
                                           range(part.slot - part.before + 1, part.slot), transpose=False)
        if not self.length:  # a segment a sequence
            entering.copy_(starts)
        for n, (first, last) in enumerate(zip(firsts, lasts) if self.length else ()):
            entering[last] = _fold(starts[n], local, transitions, range(first, last), transpose=False, record=entering)
        return kept

    def exiting_gradients(self, local_gradients: torch.Tensor, transitions: torch.Tensor,
                          dht: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``[count, H, V, K]``: the gradient w.r.t. the state leaving every segment: for a local sequence's
        last, the caller's ``dht`` plus, for a sequence that goes on to later ranks, what comes back from them; for
        the others, folded back over the segments after it, ``G[c−1] = G[c] · F[c]ᵀ + L[c]``.

        ``local_gradients``: the scan's dh0 of every segment with zero gradients leaving it (``L``). An interval
        whose first sequence enters from another rank sends that sequence's gradient at its start with ``dht``
        leaving it (folded over its segments) and, where it passes the sequence through, its transition; gathered
        from every rank, the gradient leaving an interval's last sequence is combined over the slots after it:
        ``G = L[s1]``, then ``G = G · F[j]ᵀ + L[j]`` back to the slot after this one."""
        _, firsts, lasts = _segment_rows(self.bounds, self.length)
        heads, dim = local_gradients.shape[1], local_gradients.shape[2]
        ends = local_gradients.new_zeros((len(firsts), heads, dim, dim)) if dht is None else dht.to(torch.float32,
                                                                                                    copy=True)
        pieces = local_gradients.new_zeros((len(self.parts), 2, heads, dim, dim))
        identity = torch.eye(dim, dtype=torch.float32, device=local_gradients.device).expand(heads, dim, dim)
        for index, part in enumerate(self.parts):
            if part.before:
                rows = range(lasts[part.first], firsts[part.first] - 1, -1)
                pieces[index, 0] = _fold(ends[part.first], local_gradients, transitions, rows, transpose=True)
                if part.passes_through:
                    pieces[index, 1] = _fold(identity, None, transitions, rows[::-1], transpose=False)
        chain = self._in_chain_order(all_gather(pieces, self.group))
        for part in self.parts:
            if part.after:
                end = part.slot + part.after
                ends[part.last] += _fold(chain[end, 0], chain[:, 0], chain[:, 1], range(end - 1, part.slot, -1),
                                         transpose=True)
        if not self.length:  # a segment a sequence
            return ends
        leaving = torch.empty_like(local_gradients)
        for n, (first, last) in enumerate(zip(firsts, lasts)):
            leaving[first] = _fold(ends[n], local_gradients, transitions, range(last, first, -1), transpose=True,
                                   record=leaving)
        return leaving

    def _in_chain_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[W, parts, ...]`` pieces in rank order as ``[slots, ...]`` in chain order: rank r's first interval is
        slot r; in the zigzag layout its second is slot 2W − 1 − r."""
        if len(self.parts) == 1:
            return gathered[:, 0]
        return torch.cat((gathered[:, 0], gathered[:, 1].flip(0)))


@functools.lru_cache(maxsize=64)
def _segment_rows(bounds: tuple[int, ...], length: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(the segment bounds of local sequences ``bounds`` cut every ``length`` tokens (0: not cut), each local
    sequence's first segment, its last)."""
    cuts, firsts, lasts = [0], [], []
    for start, end in zip(bounds, bounds[1:]):
        firsts.append(len(cuts) - 1)
        cuts.extend(range(start + length, end, length) if length else ())
        cuts.append(end)
        lasts.append(len(cuts) - 2)
    return tuple(cuts), tuple(firsts), tuple(lasts)


def _fold(state: torch.Tensor, adds: torch.Tensor | None, steps: torch.Tensor, rows: range, *, transpose: bool,
          record: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 combine along ``rows`` of ``[rows, H, V, K]`` operands: ``state · steps[c] + adds[c]`` for each row
    in turn (``steps[c]ᵀ`` with ``transpose``, the backward's; no ``adds``: a product of transitions); ``record``
    takes the state each row starts from."""
    for row in rows:
        if record is not None:
            record[row] = state
        step = steps[row].transpose(-1, -2) if transpose else steps[row]
        state = torch.bmm(state, step) if adds is None else torch.baddbmm(adds[row], state, step)
    return state
