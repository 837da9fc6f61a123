"""The decode / speculative-verify kernel: tokens of a sequence on a state pool, updated in place.

Per (sequence ``n``, value head ``j``, V-band) one CTA (the contract: :mod:`cute_kda.reference.decode`, whose
:func:`~cute_kda.reference.decode.mirror_decode` is this kernel's arithmetic)::

    slot ← state_indices[n]  (verify: state_indices[n, num_accepted_tokens[n] − 1]);  −1: zero outputs, stop
    S ← pool[slot]  (the band's rows, fp32 in registers)
    per token t:  a = 2^g'_t (the gate of docs/numerics.md, base 2);  q̂, k̂ (l2norm), β (sigmoid)
                  S ← a ⊙ S;  u = β (v_t − Sᵀk̂);  S ← S + k̂ uᵀ;  o_t = Sᵀ q̂
                  verify: pool[state_indices[n, t]] ← S  (skipped for a −1 entry)
    decode: pool[slot] ← S

It moves the state once (read and written in 16-byte vectors straight between the pool and registers,
no shared memory) and little else, so its speed is the HBM bandwidth; small batches get enough CTAs (and
bytes in flight) from the V-split: the value rows of a V-first state are independent (row ``v`` needs only
``s_v·k`` and ``s_v·q``), and so are the value columns of a K-first one. Thread map:
:class:`cute_kda.layouts.decode.DecodeThreadMap`. Slot offsets are 64-bit (pools over 2^31 elements).

Two token loops, one arithmetic (the same bits for the same tokens):

- **unrolled** (``tokens`` = T ≤ 8, fixed length): every token's code inline; token 0's loads are issued before
  the branch on the slot id and its preparation after the state's loads (D10), and ptxas schedules the later
  tokens' loads across the unrolled math. Its schedules (variant flags): ``prefetch`` loads every token's inputs
  into registers up front (D3; D5 prefetched them into L2 instead: slower, removed); ``paired`` (one token, a bf16
  V-first decode) gives a thread group 8 value rows, two blocks of 4 that share the slot id and the token's
  operands, the second block's lines prefetched into L2 beside the first block's loads and loaded once the first
  block is stored (D4: docs/perf-log.md; the runtime loop's decode takes it too, D8; on fp32 pools it was slower,
  D11);
  ``split_prep`` (T = 2-4) prepares each token's q̂, k̂, decay and β once a warp instead of once a thread group:
  group ``g`` of a warp loads and prepares token ``g mod T``, the lanes take the others' by shuffles (D6);
- **runtime** (``tokens`` None): a loop over a count known at run time — a fixed T over 8 (the tensors' extent),
  or packed sequences (``cu_seqlens`` int32 / int64 ``[N + 1]``, read on the device: sequence ``n`` is input rows
  ``cu_seqlens[n] .. cu_seqlens[n + 1] − 1`` of batch row 0). Token ``t + 1``'s inputs are loaded into registers
  (bf16, unconverted) before token ``t``'s math, so their latency hides behind it; the last token reloads itself
  rather than branch. A sequence of length 0 reads and writes nothing: its slot is not rewritten (decode or
  verify), and it has no output rows. A verify's sequence is at most S + 1 tokens (``state_indices [N, S + 1]``).

Inputs are assumed valid (the API layer checks): K = V = 128, slot ids in ``[−1, slots)``, accepted counts in
``[1, S + 1]``, no slot twice in one call; every tensor's last mode contiguous and its rows (and the pool's state
blocks, ``[128, 128]`` contiguous) starting 16-byte aligned — the other strides are free (engines hand strided
pool views and q, k, v split from one projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..dsl import cute, cutlass  # first: sets the target architecture before the DSL loads

from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.experimental.primitives import prefetch_l2

from ..layouts.decode import CHANNELS, LANES, WARP_GROUPS, DecodeThreadMap
from ..numerics import EPS, GATES, LOG2E
from .common.copy import gmem_run
from .common.fastmath import ex2_approx, fma_rn, mul_rn, sigmoid_approx
from .common.token_prep import TokenPrep

MAX_TOKENS = 8
BOUND_CTAS_PER_SM = 6  # paired, split_prep, bf16 V-first loops: 64-thread CTAs an SM, 168 registers
BUTTERFLY = (4, 2, 1)  # shfl.xor offsets over the 8 lanes of a row (the mirror's order)
_STATE_TYPES = {"fp32": Float32, "bf16": BFloat16}
OFFSET_DTYPES = ("int32", "int64")  # of cu_seqlens


@dataclass(frozen=True)
class DecodeVariant:
    """The static configuration of one compiled decode kernel (its compile key).

    ``gate``: "safe", "softplus" or "none" (g is the log decay); ``per_head_gate``: g ``[N, T, HV]`` (GatedDeltaNet)
    instead of ``[N, T, HV, K]``; ``state_dtype``: "fp32" / "bf16" pool; ``state_layout``: "vk" (V-first) / "kv";
    ``tokens``: T = 1..8, the token loop unrolled, or None: a runtime loop over a count read at run time (the
    tensors' T for a fixed length over 8, each sequence's length for packed ones); ``verify``: 2-D slot ids with
    accepted counts (every token's state written); ``qk_l2norm``, ``beta_logits``: in-kernel l2norm of q, k and
    sigmoid of beta; ``grouped``: HV > H (value head ``j`` reads q/k head ``j // (HV / H)``); ``vsplit``: CTAs per
    (sequence, head); ``cu_seqlens``: None (fixed length) or the dtype ("int32", "int64") of the ``[N + 1]``
    offsets of packed sequences (tokens None; or a ``split_prep`` verify's slot-row width S + 1, each sequence at
    most that long: D9); ``prefetch`` (unrolled, T ≥ 2): every token's inputs (and a
    verify's slot ids, the accepted count) loaded before the branch on the slot, so their latencies overlap the
    slot id's and the state's — without it token t + 1's loads wait behind token t's stores (each token's
    conditional stores end a basic block, and ptxas does not hoist loads above them): one memory latency a token;
    ``paired`` (T = 1 decode or the runtime loop's decode, V-first bf16 pool: D4, D8): 8 value rows a thread group
    in two blocks of 4, the second's state prefetched into L2 during the first's math (:meth:`choose_paired`);
    ``split_prep`` (unrolled, T = 2-4, instead of ``prefetch``): the 4 groups of a warp hold the same key channels,
    so group ``g`` loads token ``g mod T``'s q, k, g, β alone (every token's v rows: the group's own), prepares them
    (l2norm, gate, β sigmoid) once, and each token's operands reach the other groups by shuffles — the per-token
    preparation, 3/5 of a thread's instructions and 1/2 of its MUFU / conversion work at T = 4, once a warp instead
    of T times, and one token's raw inputs in registers instead of T (:meth:`choose_split_prep`, docs/perf-log.md
    D6).
    """

    gate: str = "safe"
    per_head_gate: bool = False
    state_dtype: str = "fp32"
    state_layout: str = "vk"
    tokens: Optional[int] = 1
    verify: bool = False
    qk_l2norm: bool = True
    beta_logits: bool = True
    grouped: bool = False
    vsplit: int = 1
    cu_seqlens: Optional[str] = None
    prefetch: bool = False
    paired: bool = False
    split_prep: bool = False

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if self.tokens is not None and not 1 <= self.tokens <= MAX_TOKENS:
            raise ValueError(f"tokens must be None or in [1, {MAX_TOKENS}], got {self.tokens}")
        if self.cu_seqlens not in (None, *OFFSET_DTYPES):
            raise ValueError(f"cu_seqlens must be None or one of {OFFSET_DTYPES}, got {self.cu_seqlens!r}")
        if self.cu_seqlens is not None and self.tokens is not None and not (self.verify and self.split_prep):
            raise ValueError("packed sequences (cu_seqlens) take their lengths at run time: tokens must be None, or "
                             "a split_prep verify's slot-row width")
        if self.prefetch and (self.tokens is None or self.tokens < 2):
            raise ValueError("prefetch loads the tokens of the unrolled loop ahead: it needs tokens >= 2")
        if self.split_prep and (not self.choose_split_prep(self.tokens, self.state_layout, self.state_dtype)
                                or self.prefetch):
            raise ValueError(f"split_prep gives each of the {WARP_GROUPS} groups of a warp one token of the unrolled "
                             "loop: tokens 2 to 4, not a K-first bf16 state, not prefetch")
        if self.paired and not self.pairs(self.tokens, self.verify, self.state_layout, self.state_dtype,
                                          self.cu_seqlens):
            raise ValueError("paired runs a one-token decode, or the runtime loop's decode (int32 offsets), on a "
                             "V-first bf16 pool")
        self.thread_map  # validates layout, dtype and vsplit

    @property
    def thread_map(self) -> DecodeThreadMap:
        return DecodeThreadMap(self.state_layout, self.state_dtype, self.vsplit, 2 if self.paired else 1)

    @property
    def bounded_loop(self) -> bool:
        """Whether the runtime token loop runs under the :data:`BOUND_CTAS_PER_SM` register cap: on a V-first bf16
        pool. Uncapped, ptxas gives the loop 232 registers (token t + 1's inputs held across token t's math): 4 CTAs
        of 64 threads an SM, 32 KB of bf16 state in flight an SM at V-split 4, latency-bound (62-68 % of the copy,
        packed T = 1). Capped at 168 it takes 158-166 registers without spills; the fp32 and K-first loops spill at
        the cap (24-548 bytes) and fp32 moves twice the bytes a CTA (89-94 % of the copy uncapped)."""
        return self.tokens is None and self.state_layout == "vk" and self.state_dtype == "bf16"

    @staticmethod
    def choose_split_prep(tokens: Optional[int], state_layout: str, state_dtype: str) -> bool:
        """Whether an unrolled loop of ``tokens`` can prepare its tokens split over the groups of a warp: 2 to
        :data:`~cute_kda.layouts.decode.WARP_GROUPS` tokens (one a group; one token has nothing to share), not on a
        K-first bf16 state (8 value columns a thread, 128 fp32 state registers: at the 168-register cap of
        :data:`BOUND_CTAS_PER_SM` ptxas spills 640 bytes; ``prefetch`` excludes it too)."""
        return (tokens is not None and 2 <= tokens <= WARP_GROUPS
                and not (state_layout == "kv" and state_dtype == "bf16"))

    @staticmethod
    def pairs(tokens: Optional[int], verify: bool, state_layout: str, state_dtype: str,
              cu_seqlens: Optional[str] = None) -> bool:
        """Whether ``paired`` can run: a decode (a verify keeps a state a token; the runtime loop's verify spills at
        the 168-register cap: 196 bytes with grouped heads and int64 offsets), V-first rows, a bf16 pool (fp32 decode
        is at 87-92 % of the copy already, docs/perf-log.md D3), one unrolled token (every later token would need the
        first block's operands again) or the runtime loop at a fixed length or on int32 offsets (D8: a sequence of
        one token runs the unrolled one's paired update, a longer one its tokens once a block; with int64 offsets,
        grouped heads and the softplus gate it spills 16 bytes at the cap)."""
        loop = tokens is None and cu_seqlens != "int64"
        return (tokens == 1 or loop) and not verify and state_layout == "vk" and state_dtype == "bf16"

    @classmethod
    def choose_paired(cls, num_seqs: int, value_heads: int, sm_count: int, tokens: Optional[int], verify: bool,
                      state_layout: str, state_dtype: str, vsplit: Optional[int] = None,
                      cu_seqlens: Optional[str] = None) -> bool:
        """Whether a call runs ``paired``: where it can (:meth:`pairs`; a given ``vsplit`` leaving a paired CTA a
        warp) and its grid (two CTAs a head at V-split 2) fills the SMs at least twice at
        :data:`BOUND_CTAS_PER_SM`; below that one wave of plain CTAs (8 an SM, each one block's math shorter)
        ends sooner."""
        if not cls.pairs(tokens, verify, state_layout, state_dtype, cu_seqlens):
            return False
        if vsplit is not None and vsplit not in DecodeThreadMap.vsplits(state_layout, state_dtype, halves=2):
            return False
        return num_seqs * value_heads * 2 >= 2 * BOUND_CTAS_PER_SM * sm_count

    @staticmethod
    def choose_prefetch(tokens: Optional[int], state_layout: str, state_dtype: str) -> bool:
        """Whether an unrolled loop of ``tokens`` loads every token ahead (``prefetch``): for 2 to 4 tokens, where
        the loaded inputs (about 27 registers a token) fit beside the state without spills (ptxas, sm_90a: 206-254
        registers; at T = 8 it spills, and a K-first bf16 state holds 255 registers without it). A T = 4 verify then
        waits on memory twice (slot ids, then the state with every token's inputs) instead of six times, at 4 CTAs
        an SM instead of 5-6 (docs/perf-log.md, D3)."""
        return tokens is not None and 2 <= tokens <= 4 and not (state_layout == "kv" and state_dtype == "bf16")

    @classmethod
    def choose_vsplit(cls, num_seqs: int, value_heads: int, sm_count: int, state_layout: str = "vk",
                      state_dtype: str = "fp32", paired: bool = False) -> int:
        """V-split for ``num_seqs × value_heads`` heads on ``sm_count`` SMs: CTAs of 64 threads (a thread holds
        ~150 registers, so six such CTAs share an SM where a 256-thread CTA sits alone, and a CTA's load, compute
        and store phases overlap with its neighbours'), split further, down to one warp, while the grid has fewer
        than two CTAs per SM (small batches: more CTAs, more bytes in flight). Not measured yet:
        ``benchmarks/bench_decode.py --vsplits`` compares every split. ``paired``: the same rule on the paired map (8
        rows a group: V-split 2 at 64 threads).
        """
        halves = 2 if paired else 1
        splits = DecodeThreadMap.vsplits(state_layout, state_dtype, halves)
        chosen = next(v for v in splits if DecodeThreadMap(state_layout, state_dtype, v, halves).threads <= 64)
        while num_seqs * value_heads * chosen < 2 * sm_count and chosen < splits[-1]:
            chosen *= 2
        return chosen


class DecodeInputs(NamedTuple):
    """The per-token tensors and the gate parameters (``a_log``, ``dt_bias`` None for the "none" gate)."""

    q: cute.Tensor  # bf16 [N, T, H, K]
    k: cute.Tensor  # bf16 [N, T, H, K]
    v: cute.Tensor  # bf16 [N, T, HV, V]
    g: cute.Tensor  # bf16 [N, T, HV, K] or [N, T, HV]
    beta: cute.Tensor  # bf16 [N, T, HV]
    a_log: Optional[cute.Tensor]  # fp32 [HV]
    dt_bias: Optional[cute.Tensor]  # fp32 [HV, K] or [HV]


class Position(NamedTuple):
    """Where a thread works: its sequence, q/k head, value head, lane and first value row (or column)
    (a trace-time tuple of device integers)."""

    seq: Int32
    head: Int32
    value_head: Int32
    lane: Int32
    first_value: Int32


class GateConstants(NamedTuple):
    """Per-head scalars of the token preparation: dt_bias of the lane's channels (``[0]``: of the head), ``e^A``,
    ``c_gate = lower_bound · log2 e`` and the q scale."""

    dt: cute.Tensor
    e_a: Float32
    c_gate: Float32
    scale: Float32


class TokenSpan(NamedTuple):
    """A sequence's tokens in the input rows (runtime loop): batch row, first token and count (device integers);
    ``(n, 0, T)`` at a fixed length, ``(0, cu_seqlens[n], cu_seqlens[n + 1] − cu_seqlens[n])`` packed."""

    batch: Int32
    start: Int32
    length: Int32


class RawToken(NamedTuple):
    """One token's inputs for one thread as loaded (bf16 registers, the runtime loop's prefetch buffers): q, k and
    a per-channel gate of its 16 channels in channel-slot order (a per-head gate: ``[0]``), β ``[0]``, v of its
    value rows."""

    q: cute.Tensor
    k: cute.Tensor
    g: cute.Tensor
    beta: cute.Tensor
    values: cute.Tensor


class TokenOperands(NamedTuple):
    """One token's operands for one thread: ``q̂·scale``, ``k̂`` and the decay ``2^g'`` of its 16 channels (``[0]``
    for a per-head gate), β, and v of its value rows (bf16)."""

    q_hat: cute.Tensor
    k_hat: cute.Tensor
    decay: cute.Tensor
    beta: Float32
    values: cute.Tensor


class DecodeKernel(TokenPrep):
    """One compiled decode / verify variant (:class:`DecodeVariant`); head size 128."""

    def __init__(self, variant: DecodeVariant) -> None:
        self.variant = variant
        self.map = variant.thread_map
        self.gate = variant.gate  # TokenPrep.base2_log_decay reads it
        self.tokens = variant.tokens
        self.state_type = _STATE_TYPES[variant.state_dtype]

    # -----------------------------------------------------------------------------------------
    # host

    @cute.jit
    def __call__(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor,
                 num_accepted_tokens: Optional[cute.Tensor], cu_seqlens: Optional[cute.Tensor], out: cute.Tensor,
                 scale: Float32, c_gate: Float32, stream):
        """Launch one CTA per (sequence, value head, band): pool ``[slots, HV, 128, 128]``, out ``[N, T, HV, V]``
        bf16 (packed: ``[1, total T, HV, V]``, with ``cu_seqlens [N + 1]``); ``scale`` and
        ``c_gate = lower_bound · log2 e`` rounded to fp32 by the caller."""
        num_seqs, value_heads = state_indices.shape[0], inputs.v.shape[2]  # a row of slot ids per sequence
        qk_heads = inputs.q.shape[2]
        self.kernel(inputs, pool, state_indices, num_accepted_tokens, cu_seqlens, out, scale, c_gate, qk_heads,
                    value_heads).launch(
            grid=[num_seqs * value_heads * self.variant.vsplit, 1, 1],  # the bands of a head are adjacent CTAs
            block=[self.map.threads, 1, 1],
            stream=stream,
            **self.launch_bound(),
        )

    def launch_bound(self) -> dict:
        """The launch's occupancy keywords. One CTA an SM lifts ptxas's own register cap (a T = 8 verify spilled at
        168). ``paired``, ``split_prep`` and :attr:`DecodeVariant.bounded_loop`: :data:`BOUND_CTAS_PER_SM` CTAs of
        64 threads (the same threads an SM at other sizes), a cap of 168 registers (6 CTAs; paired at 8 would need
        128: it spills; split_prep uncapped 174-189: 5 CTAs; the bf16 loop 232: 4 CTAs); the carveout given (the
        driver's default, -1) so that the DSL does not ask a device for its shared memory."""
        if self.variant.paired or self.variant.split_prep or self.variant.bounded_loop:
            ctas = max(1, BOUND_CTAS_PER_SM * 64 // self.map.threads)
            return dict(min_blocks_per_mp=ctas, preferred_smem_carveout=-1)
        return dict(min_blocks_per_mp=1)

    # -----------------------------------------------------------------------------------------
    # device

    @cute.kernel
    def kernel(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor,
               num_accepted_tokens: Optional[cute.Tensor], cu_seqlens: Optional[cute.Tensor], out: cute.Tensor,
               scale: Float32, c_gate: Float32, qk_heads: Int32, value_heads: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane, group = tidx % LANES, tidx // LANES
        band = block % self.variant.vsplit
        seq_head = block // self.variant.vsplit
        seq, value_head = seq_head // value_heads, seq_head % value_heads
        head = value_head
        if const_expr(self.variant.grouped):
            head = value_head // (value_heads // qk_heads)
        written = None
        if const_expr(self.variant.verify and (self.variant.prefetch or self.variant.split_prep)):
            written = self.slot_row(state_indices, seq)
            slot = self.entering_slot(state_indices, seq, written, num_accepted_tokens[seq])
        elif const_expr(self.variant.verify):
            slot = state_indices[seq, num_accepted_tokens[seq] - 1]
        else:
            slot = state_indices[seq]
        at = Position(seq, head, value_head, lane, self.map.first_value(band, group))
        gate = self.gate_constants_of(inputs, value_head, lane, scale, c_gate)
        if const_expr(self.tokens is None):
            self.run_tokens(inputs, pool, state_indices, out, slot, at, gate, self.token_span(inputs, cu_seqlens, seq))
        elif const_expr(self.variant.split_prep):
            self.run_split(inputs, pool, state_indices, out, slot, at, gate, written, cu_seqlens, tidx)
        elif const_expr(self.variant.prefetch):
            raws = self.raw_tokens(inputs, at)
            if slot >= 0:
                self.update(inputs, pool, state_indices, out, slot, at, gate, None, raws, written)
            else:
                self.zero_outputs(out, at, None)
        else:
            # the first token's inputs do not depend on the slot: their loads overlap the slot id's, and their math
            # waits for the state's loads to go out, so it runs under that latency (perf-log D10)
            first = self.raw_token_buffers()
            self.load_raw(inputs, at, at.seq, 0, first)
            if slot >= 0:
                if const_expr(self.variant.paired):
                    self.update_paired(pool, out, slot, at, gate, first)
                else:
                    self.update(inputs, pool, state_indices, out, slot, at, gate, first, None, written)
            else:
                self.zero_outputs(out, at, None)

    @cute.jit
    def update(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor, out: cute.Tensor,
               slot: Int32, at: "Position", gate: "GateConstants", first: Optional["RawToken"],
               raws: Optional[tuple] = None, written: Optional[cute.Tensor] = None, split: Optional[tuple] = None,
               span: Optional["TokenSpan"] = None):
        """Load the band from ``slot``, run the tokens, write the state(s) back and the outputs; token 0's loaded
        inputs ``first`` (prepared once the state's loads are out), or (``prefetch``) every token's loaded inputs
        ``raws``, or (``split_prep``) ``split`` = (the group's own token's loaded inputs, every token's v rows); a
        verify's slot ids ``written``. ``span``: a packed sequence's input rows; its tokens from ``span.length`` on
        run on the last token's inputs and store nothing."""
        rows = self.map.rows
        base = self.map.state_base(at.lane, at.first_value)
        state = cute.make_rmem_tensor((rows, CHANNELS), Float32)
        self.load_state(pool[slot, at.value_head, None, None], base, state)
        prepared = None
        if const_expr(split is not None):
            prepared = self.prepared(split[0], gate)  # the group's own token, under the state's load latency
        for t in cutlass.range_constexpr(self.tokens):
            if const_expr(split is not None):
                operands = self.shared_operands(prepared, at.lane, t, split[1][t])
            elif const_expr(raws is not None):
                operands = self.prepared(raws[t], gate)
            else:
                operands = (self.prepared(first, gate) if const_expr(t == 0)
                            else self.token_operands(inputs, at, t, gate))
            outputs = self.advance(state, operands)
            if const_expr(span is None):
                self.finish_token(out, pool, state_indices, at, (at.seq, t), t, base, state, outputs, written)
            else:
                # a token past the sequence runs on the last token's operands and stores nothing (it follows every
                # stored state of a verify, so what it makes of the state is never read): straight-line code, as
                # the fixed length's (a branch around the update spilled 386 bytes)
                if t < span.length:
                    self.finish_token(out, pool, state_indices, at, (span.batch, span.start + t), t, base, state,
                                      outputs, written)
        if const_expr(not self.variant.verify):
            self.store_state(pool[slot, at.value_head, None, None], base, state)

    @cute.jit
    def run_split(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor, out: cute.Tensor,
                  slot: Int32, at: "Position", gate: "GateConstants", written: Optional[cute.Tensor],
                  cu_seqlens: Optional[cute.Tensor], tidx):
        """The ``split_prep`` schedule: each group loads its own token's inputs and every token's v rows, then
        :meth:`update`. Packed (a verify with ``cu_seqlens``; perf-log D9) on the sequence's span, whose length is at
        most ``tokens`` (the slot rows' width): the loads of tokens past it read the last token again (in bounds;
        their results unused), a sequence of length 0 reads and writes nothing. A padding row (slot −1) zeroes its
        output rows."""
        packed = self.variant.cu_seqlens is not None
        span = TokenSpan(at.seq, Int32(0), Int32(self.tokens))
        if const_expr(packed):
            span = self.token_span(inputs, cu_seqlens, at.seq)
        if span.length > 0:
            last = span.length - 1
            own = self.raw_token_buffers()
            self.load_raw(inputs, at, span.batch, span.start + cutlass.min(self.map.own_token(tidx, self.tokens), last),
                          own)
            values = tuple(self.load_run(inputs.v[span.batch, span.start + cutlass.min(t, last), at.value_head, None],
                                         at.first_value, self.map.rows) for t in range(self.tokens))
            if slot >= 0:
                self.update(inputs, pool, state_indices, out, slot, at, gate, None, None, written, (own, values),
                            span if const_expr(packed) else None)
            else:
                self.zero_outputs(out, at, span if const_expr(packed) else None)

    @cute.jit
    def update_paired(self, pool: cute.Tensor, out: cute.Tensor, slot: Int32, at: "Position", gate: "GateConstants",
                      raw: "RawToken"):
        """:meth:`update` of one token on the two blocks of a paired group (:meth:`paired_token`), its loaded inputs
        ``raw`` prepared once the first block's loads are out."""
        head = pool[slot, at.value_head, None, None]
        base = self.map.state_base(at.lane, at.first_value)
        state = self.first_block(head, base)
        self.paired_token(head, base, state, out, at, (at.seq, 0), self.prepared(raw, gate))

    @cute.jit
    def first_block(self, head: cute.Tensor, base) -> cute.Tensor:
        """A paired group's first block of the head's state loaded, the second block's lines prefetched into L2 beside
        those loads (no registers held for them), then a warp barrier."""
        state = cute.make_rmem_tensor((self.map.block_rows, CHANNELS), Float32)
        for vector in self.map.block_vectors(1):
            prefetch_l2(gmem_run(head, base + vector.offset, self.map.vector).iterator)
        self.load_state(head, base, state, self.map.block_vectors(0))
        # the warp barriers order memory among the warp's threads, so ptxas moves no memory operation across them:
        # the prefetches stay beside the first block's loads (else they sink to its stores), the second block's
        # loads below the first block's stores (else they rise over its math, both blocks live: spills)
        cute.arch.sync_warp()
        return state

    @cute.jit
    def paired_token(self, head: cute.Tensor, base, state: cute.Tensor, out: cute.Tensor, at: "Position", row: tuple,
                     operands: "TokenOperands"):
        """One token on the two blocks of a paired group, the first in ``state`` (:meth:`first_block`): the first
        block run and stored (its outputs to input row ``row = (batch, token)`` too: nothing of it stays live),
        then the second loaded (from L2), run and stored."""
        for half in cutlass.range_constexpr(self.map.halves):
            vectors = self.map.block_vectors(half)
            if const_expr(half > 0):
                cute.arch.sync_warp()
                self.load_state(head, base, state, vectors)
            first_row = self.map.block_first_row(half)
            outputs = self.advance(state, operands, first_row)
            self.store_outputs(out, at, row, outputs, first_row)
            self.store_state(head, base, state, vectors)

    @cute.jit
    def run_tokens(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor, out: cute.Tensor,
                   slot: Int32, at: "Position", gate: "GateConstants", span: "TokenSpan"):
        """The runtime token loop (``tokens`` None) over ``span``. A sequence of length 0 reads and writes nothing
        (its slot keeps its bits, verify or not); a padding row (slot −1) zeroes its output rows."""
        if span.length > 0:
            raw = self.raw_token_buffers()
            self.load_raw(inputs, at, span.batch, span.start, raw)  # overlaps the slot id's load
            if slot >= 0:
                if const_expr(self.variant.paired):
                    self.update_loop_paired(inputs, pool, state_indices, out, slot, at, gate, span, raw)
                else:
                    self.update_loop(inputs, pool, state_indices, out, slot, at, gate, span, raw)
            else:
                self.zero_outputs(out, at, span)

    @cute.jit
    def update_loop(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor, out: cute.Tensor,
                    slot: Int32, at: "Position", gate: "GateConstants", span: "TokenSpan", raw: "RawToken"):
        """:meth:`update` with a runtime count: token ``t``'s operands come from ``raw`` (loaded during token
        ``t − 1``), and the loads of token ``t + 1`` go out before token ``t``'s math, so their latency hides behind
        it (the last token loads itself again: no branch, no read past the sequence)."""
        base = self.map.state_base(at.lane, at.first_value)
        state = cute.make_rmem_tensor((self.map.rows, CHANNELS), Float32)
        self.load_state(pool[slot, at.value_head, None, None], base, state)
        self.token_loop(inputs, pool, state_indices, out, at, gate, span, raw, base, state)
        if const_expr(not self.variant.verify):
            self.store_state(pool[slot, at.value_head, None, None], base, state)

    @cute.jit
    def token_loop(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor, out: cute.Tensor,
                   at: "Position", gate: "GateConstants", span: "TokenSpan", raw: "RawToken", base, state: cute.Tensor,
                   first_row: int = 0):
        """``span``'s tokens on ``state`` (the group's rows ``first_row ..``), ``raw`` holding the first token's
        inputs: each token's operands prepared from ``raw``, then the next token's loads issued into it before the
        token's math (the last token loads itself again), then its outputs (a verify: its state) stored."""
        last = span.length - 1
        for t in cutlass.range(span.length, unroll=1):
            operands = self.prepared(raw, gate)
            self.load_raw(inputs, at, span.batch, span.start + cutlass.min(t + 1, last), raw)
            outputs = self.advance(state, operands, first_row)
            self.finish_token(out, pool, state_indices, at, (span.batch, span.start + t), t, base, state, outputs,
                              first_row=first_row)

    @cute.jit
    def update_loop_paired(self, inputs: DecodeInputs, pool: cute.Tensor, state_indices: cute.Tensor,
                           out: cute.Tensor, slot: Int32, at: "Position", gate: "GateConstants", span: "TokenSpan",
                           raw: "RawToken"):
        """:meth:`update_loop` of a decode on the two blocks of a paired group (``paired``, the runtime loop). A
        sequence of one token (an engine's packed decode batch) runs :meth:`paired_token`: the token prepared once,
        each block run and stored in turn. A longer one runs all its tokens on the first block, then on the second
        (their inputs loaded and prepared again: the same bits), each block storing its own rows of the outputs and
        its state."""
        head = pool[slot, at.value_head, None, None]
        base = self.map.state_base(at.lane, at.first_value)
        state = self.first_block(head, base)
        if span.length == 1:
            self.paired_token(head, base, state, out, at, (span.batch, span.start), self.prepared(raw, gate))
        else:
            for half in cutlass.range_constexpr(self.map.halves):
                vectors = self.map.block_vectors(half)
                if const_expr(half > 0):
                    cute.arch.sync_warp()
                    self.load_state(head, base, state, vectors)
                    self.load_raw(inputs, at, span.batch, span.start, raw)
                self.token_loop(inputs, pool, state_indices, out, at, gate, span, raw, base, state,
                                self.map.block_first_row(half))
                self.store_state(head, base, state, vectors)

    @cute.jit
    def advance(self, state: cute.Tensor, operands: "TokenOperands", first_row: int = 0) -> cute.Tensor:
        """One token on the thread's state (decay, delta-rule write, read); its value rows' outputs, bf16.
        ``first_row``: the group's value row that ``state`` row 0 holds (a paired block's own rows of v, since the
        operands carry the v of all the group's rows)."""
        rows = cute.size(state, mode=[0])
        outputs = cute.make_rmem_tensor((rows,), BFloat16)
        for r in cutlass.range_constexpr(rows):
            for e in cutlass.range_constexpr(CHANNELS):
                channel = 0 if const_expr(self.variant.per_head_gate) else e
                state[r, e] = mul_rn(state[r, e], operands.decay[channel])
            predicted = self.row_dot(state, r, operands.k_hat)
            u = operands.beta * (operands.values[first_row + r].to(Float32) - predicted)
            for e in cutlass.range_constexpr(CHANNELS):
                state[r, e] = fma_rn(operands.k_hat[e], u, state[r, e])
            outputs[r] = self.row_dot(state, r, operands.q_hat).to(BFloat16)
        return outputs

    @cute.jit
    def finish_token(self, out: cute.Tensor, pool: cute.Tensor, state_indices: cute.Tensor, at: "Position",
                     row: tuple, t, base, state: cute.Tensor, outputs: cute.Tensor,
                     written_ids: Optional[cute.Tensor] = None, first_row: int = 0):
        """Token ``t``'s outputs (of the group's rows ``first_row ..``) to input row ``row = (batch, token)`` of
        ``out``; a verify keeps its state too (in slot ``state_indices[seq, t]``, or ``written_ids[t]`` when loaded
        ahead)."""
        self.store_outputs(out, at, row, outputs, first_row)
        if const_expr(self.variant.verify):
            if const_expr(written_ids is None):
                written = state_indices[at.seq, t]
            else:
                written = written_ids[t]
            if written >= 0:
                self.store_state(pool[written, at.value_head, None, None], base, state)

    @cute.jit
    def store_outputs(self, out: cute.Tensor, at: "Position", row: tuple, outputs: cute.Tensor, first_row: int = 0):
        """A token's outputs of the group's value rows ``first_row ..`` to input row ``row = (batch, token)`` of
        ``out``, by the group's lane 0 (its row dots' butterfly leaves them in every lane)."""
        if at.lane == 0:
            self.store_run(out[(*row, at.value_head, None)], at.first_value + first_row, outputs)

    @cute.jit
    def zero_outputs(self, out: cute.Tensor, at: "Position", span: Optional["TokenSpan"]):
        """A padding row: zero output rows, nothing read or written in the pool (``span`` None: the fixed T)."""
        if at.lane == 0:
            zeros = cute.make_rmem_tensor((self.map.rows,), BFloat16)
            zeros.fill(0.0)
            if const_expr(span is None):
                for t in cutlass.range_constexpr(self.tokens):
                    self.store_run(out[at.seq, t, at.value_head, None], at.first_value, zeros)
            else:
                for t in cutlass.range(span.length, unroll=1):
                    self.store_run(out[span.batch, span.start + t, at.value_head, None], at.first_value, zeros)

    @cute.jit
    def slot_row(self, state_indices: cute.Tensor, seq: Int32) -> cute.Tensor:
        """A verify's slot ids ``state_indices[seq, 0 .. T − 1]`` in registers (independent loads, together)."""
        row = cute.make_rmem_tensor((self.tokens,), Int32)
        for t in cutlass.range_constexpr(self.tokens):
            row[t] = state_indices[seq, t]
        return row

    @cute.jit
    def entering_slot(self, state_indices: cute.Tensor, seq: Int32, written: cute.Tensor, count: Int32) -> Int32:
        """``state_indices[seq, count − 1]``: from the loaded ``written`` by selects (a register array indexed at
        run time would go to local memory), so the count is loaded beside the ids, not before them (one memory
        latency instead of two); loaded after the count only for a count past T (slot ids wider than the call's
        tokens, ``[N, S + 1]`` with T < S + 1)."""
        slot = written[0]
        for t in cutlass.range_constexpr(1, self.tokens):
            slot = Int32(cutlass.select_(count == t + 1, written[t], slot))
        if count > self.tokens:
            slot = state_indices[seq, count - 1]
        return slot

    @cute.jit
    def raw_tokens(self, inputs: DecodeInputs, at: "Position") -> tuple:
        """Every token's inputs of the unrolled loop, loaded into registers as they are (``prefetch``)."""
        raws = []
        for t in cutlass.range_constexpr(self.tokens):
            raw = self.raw_token_buffers()
            self.load_raw(inputs, at, at.seq, t, raw)
            raws.append(raw)
        return tuple(raws)

    @cute.jit
    def token_span(self, inputs: DecodeInputs, cu_seqlens: Optional[cute.Tensor], seq: Int32) -> "TokenSpan":
        if const_expr(self.variant.cu_seqlens is None):
            return TokenSpan(seq, Int32(0), Int32(inputs.q.shape[1]))
        start = Int32(cu_seqlens[seq])
        return TokenSpan(Int32(0), start, Int32(cu_seqlens[seq + 1]) - start)

    # -- state I/O ----------------------------------------------------------------------------

    @cute.jit
    def load_state(self, head: cute.Tensor, offset, state: cute.Tensor, vectors: Optional[tuple] = None):
        """The thread's state elements (of ``vectors``, all by default; from element ``offset`` of the head's
        ``[128, 128]`` block) as fp32."""
        for vector in (self.map.state_vectors() if vectors is None else vectors):
            staged = cute.make_rmem_tensor((self.map.vector,), self.state_type)
            cute.autovec_copy(gmem_run(head, offset + vector.offset, self.map.vector), staged)
            for c, (row, e) in enumerate(vector.registers):
                state[row, e] = staged[c].to(Float32)

    @cute.jit
    def store_state(self, head: cute.Tensor, offset, state: cute.Tensor, vectors: Optional[tuple] = None):
        """The thread's state elements (of ``vectors``, all by default) into the head's block at ``offset``, rounded
        to the pool's dtype."""
        for vector in (self.map.state_vectors() if vectors is None else vectors):
            staged = cute.make_rmem_tensor((self.map.vector,), self.state_type)
            for c, (row, e) in enumerate(vector.registers):
                staged[c] = state[row, e].to(self.state_type)
            cute.autovec_copy(staged, gmem_run(head, offset + vector.offset, self.map.vector))

    @cute.jit
    def load_run(self, tensor: cute.Tensor, offset, length: int) -> cute.Tensor:
        values = cute.make_rmem_tensor((length,), tensor.element_type)
        cute.autovec_copy(gmem_run(tensor, offset, length), values)
        return values

    @cute.jit
    def store_run(self, tensor: cute.Tensor, offset, values: cute.Tensor):
        cute.autovec_copy(values, gmem_run(tensor, offset, cute.size(values)))

    @cute.jit
    def raw_channels(self, row: cute.Tensor, lane: Int32, into: cute.Tensor):
        """The lane's 16 key channels of a ``[128]`` row view into ``into``, as they are, in channel-slot order."""
        base = self.map.lane_channel_base(lane)
        for run in self.map.channel_runs():
            part = self.load_run(row, base + run.offset, run.length)
            for c in cutlass.range_constexpr(run.length):
                into[run.first + c] = part[c]

    @cute.jit
    def load_channels(self, row: cute.Tensor, lane: Int32) -> cute.Tensor:
        """The lane's 16 key channels of a ``[128]`` row view, as fp32 in channel-slot order."""
        values = cute.make_rmem_tensor((CHANNELS,), Float32)
        base = self.map.lane_channel_base(lane)
        for run in self.map.channel_runs():
            part = self.load_run(row, base + run.offset, run.length)
            for c in cutlass.range_constexpr(run.length):
                values[run.first + c] = part[c].to(Float32)
        return values

    # -- per-token operands ---------------------------------------------------------------------

    @cute.jit
    def token_operands(self, inputs: DecodeInputs, at: "Position", t: int, gate: "GateConstants") -> "TokenOperands":
        """Everything token ``t`` brings to the update, for this thread (the unrolled loop: loads and math
        together, ptxas schedules them across the unrolled tokens)."""
        q_hat, k_hat = self.normalized_qk(inputs, (at.seq, t, at.head, None), at.lane, gate.scale)
        decay = self.decay(inputs, (at.seq, t, at.value_head), at.lane, gate)
        beta = self.activated_beta(inputs.beta[at.seq, t, at.value_head].to(Float32))
        values = self.load_run(inputs.v[at.seq, t, at.value_head, None], at.first_value, self.map.rows)
        return TokenOperands(q_hat, k_hat, decay, beta, values)

    @cute.jit
    def raw_token_buffers(self) -> "RawToken":
        gate_channels = 1 if const_expr(self.variant.per_head_gate) else CHANNELS
        return RawToken(cute.make_rmem_tensor((CHANNELS,), BFloat16), cute.make_rmem_tensor((CHANNELS,), BFloat16),
                        cute.make_rmem_tensor((gate_channels,), BFloat16), cute.make_rmem_tensor((1,), BFloat16),
                        cute.make_rmem_tensor((self.map.rows,), BFloat16))

    @cute.jit
    def load_raw(self, inputs: DecodeInputs, at: "Position", batch: Int32, token: Int32, raw: "RawToken"):
        """The loads of input row ``(batch, token)`` into ``raw`` (no conversion: nothing waits for them here)."""
        self.raw_channels(inputs.q[batch, token, at.head, None], at.lane, raw.q)
        self.raw_channels(inputs.k[batch, token, at.head, None], at.lane, raw.k)
        if const_expr(self.variant.per_head_gate):
            raw.g[0] = inputs.g[batch, token, at.value_head]
        else:
            self.raw_channels(inputs.g[batch, token, at.value_head, None], at.lane, raw.g)
        raw.beta[0] = inputs.beta[batch, token, at.value_head]
        cute.autovec_copy(gmem_run(inputs.v[batch, token, at.value_head, None], at.first_value, self.map.rows),
                          raw.values)

    @cute.jit
    def prepared(self, raw: "RawToken", gate: "GateConstants") -> "TokenOperands":
        """:meth:`token_operands` from loaded inputs (the same arithmetic); copies what ``raw`` holds, so the next
        token's loads may land in it."""
        q_hat, k_hat = self.normalize(self.widened(raw.q), self.widened(raw.k), gate.scale)
        decay = self.decay_of(self.widened(raw.g), gate)
        beta = self.activated_beta(raw.beta[0].to(Float32))
        values = cute.make_rmem_tensor((self.map.rows,), BFloat16)
        for r in cutlass.range_constexpr(self.map.rows):
            values[r] = raw.values[r]
        return TokenOperands(q_hat, k_hat, decay, beta, values)

    @cute.jit
    def shared_operands(self, prepared: "TokenOperands", lane: Int32, t: int, values: cute.Tensor) -> "TokenOperands":
        """Token ``t``'s operands from the group that prepared it (``split_prep``): its q̂, k̂, decay (``[0]`` for a
        per-head gate) and β by shuffles from lane :meth:`~cute_kda.layouts.decode.DecodeThreadMap.token_source`,
        the same bits as this lane's own preparation would give; ``values`` this group's v rows of token ``t``."""
        source = self.map.token_source(lane, t)
        q_hat = cute.make_rmem_tensor((CHANNELS,), Float32)
        k_hat = cute.make_rmem_tensor((CHANNELS,), Float32)
        decay = cute.make_rmem_tensor((CHANNELS,), Float32)
        for e in cutlass.range_constexpr(CHANNELS):
            q_hat[e] = cute.arch.shuffle_sync(prepared.q_hat[e], source)
            k_hat[e] = cute.arch.shuffle_sync(prepared.k_hat[e], source)
        for e in cutlass.range_constexpr(1 if const_expr(self.variant.per_head_gate) else CHANNELS):
            decay[e] = cute.arch.shuffle_sync(prepared.decay[e], source)
        beta = Float32(cute.arch.shuffle_sync(prepared.beta, source))
        return TokenOperands(q_hat, k_hat, decay, beta, values)

    @cute.jit
    def widened(self, x: cute.Tensor) -> cute.Tensor:
        wide = cute.make_rmem_tensor((cute.size(x),), Float32)
        for c in cutlass.range_constexpr(cute.size(x)):
            wide[c] = x[c].to(Float32)
        return wide

    @cute.jit
    def activated_beta(self, beta: Float32) -> Float32:
        if const_expr(self.variant.beta_logits):
            beta = sigmoid_approx(beta)
        return beta

    @cute.jit
    def normalized_qk(self, inputs: DecodeInputs, row: tuple, lane: Int32, scale: Float32):
        """``(q̂·scale, k̂)`` of the lane's channels of q/k row ``row``."""
        q = self.load_channels(inputs.q[row], lane)
        k = self.load_channels(inputs.k[row], lane)
        return self.normalize(q, k, scale)

    @cute.jit
    def normalize(self, q: cute.Tensor, k: cute.Tensor, scale: Float32):
        """``(q̂·scale, k̂)`` from fp32 channels, in place (K1's l2norm: ``x / sqrt(Σx² + EPS)``)."""
        q_scale = scale
        k_scale = Float32(1.0)
        if const_expr(self.variant.qk_l2norm):
            q_scale = self.lane_rinv(q) * scale
            k_scale = self.lane_rinv(k)
        for e in cutlass.range_constexpr(CHANNELS):
            q[e] = q[e] * q_scale
            if const_expr(self.variant.qk_l2norm):
                k[e] = k[e] * k_scale
        return q, k

    @cute.jit
    def lane_rinv(self, x: cute.Tensor) -> Float32:
        """``1 / sqrt(Σx² + EPS)`` over the 8 lanes' channels (sequential partials, then the butterfly)."""
        partial = x[0] * x[0]
        for e in cutlass.range_constexpr(1, CHANNELS):
            partial = partial + x[e] * x[e]  # a bf16 square is exact: fma or not, one rounding
        return Float32(1.0) / cute.math.sqrt(self.lane_sum(partial) + Float32(EPS))

    @cute.jit
    def lane_sum(self, partial: Float32) -> Float32:
        for offset in BUTTERFLY:
            partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=offset)
        return partial

    @cute.jit
    def row_dot(self, state: cute.Tensor, row: int, x: cute.Tensor) -> Float32:
        """``Σ_k state[row, k]·x[k]``: one fma per channel slot in order, then the butterfly."""
        acc = state[row, 0] * x[0]
        for e in cutlass.range_constexpr(1, CHANNELS):
            acc = fma_rn(state[row, e], x[e], acc)
        return self.lane_sum(acc)

    @cute.jit
    def gate_constants_of(self, inputs: DecodeInputs, value_head: Int32, lane: Int32, scale: Float32,
                          c_gate: Float32) -> "GateConstants":
        """The head's :class:`GateConstants` (dt_bias of the lane's channels, or of the head; e^A)."""
        dt = cute.make_rmem_tensor((CHANNELS,), Float32)
        dt.fill(0.0)
        e_a = Float32(1.0)
        if const_expr(self.gate != "none"):
            e_a = ex2_approx(inputs.a_log[value_head] * Float32(LOG2E))
            if const_expr(self.variant.per_head_gate):
                dt[0] = inputs.dt_bias[value_head]
            else:
                dt = self.load_channels(inputs.dt_bias[value_head, None], lane)
        return GateConstants(dt, e_a, c_gate, scale)

    @cute.jit
    def decay(self, inputs: DecodeInputs, token: tuple, lane: Int32, gate: "GateConstants") -> cute.Tensor:
        """``a = 2^g'`` of the lane's channels (``[0]`` only for a per-head gate) of token ``at = (seq, t, value
        head)``."""
        if const_expr(self.variant.per_head_gate):
            g = cute.make_rmem_tensor((1,), Float32)
            g[0] = inputs.g[token].to(Float32)
        else:
            g = self.load_channels(inputs.g[(*token, None)], lane)
        return self.decay_of(g, gate)

    @cute.jit
    def decay_of(self, g: cute.Tensor, gate: "GateConstants") -> cute.Tensor:
        """``a = 2^g'`` from the fp32 gate inputs ``g`` of the lane's channels (``[0]`` for a per-head gate)."""
        decay = cute.make_rmem_tensor((CHANNELS,), Float32)
        if const_expr(self.variant.per_head_gate):
            decay[0] = ex2_approx(self.log_decay2(g[0], gate.dt[0], gate))
        else:
            for e in cutlass.range_constexpr(CHANNELS):
                decay[e] = ex2_approx(self.log_decay2(g[e], gate.dt[e], gate))
        return decay

    @cute.jit
    def log_decay2(self, g: Float32, dt: Float32, gate: "GateConstants") -> Float32:
        """``g'`` (base 2): safe ``c_gate · sigmoid(e^A (g + dt_bias))``, else TokenPrep's softplus / log decay."""
        if const_expr(self.gate == "safe"):
            return mul_rn(gate.c_gate, sigmoid_approx(gate.e_a * (g + dt)))
        return self.base2_log_decay(g, dt, gate.e_a)
