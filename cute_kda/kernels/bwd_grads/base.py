"""Kernel B, the tile gradients: per (16-token tile, head), every per-token gradient of the backward.

Arithmetic: docs/numerics.md, "Backward: Kernel B", operation by operation (the mirror reference
``cute_kda.reference.backward.mirror_bwd_grads`` follows the same page). Shared-memory plans:
``cute_kda.layouts.bwd_grads``.

Tile-parallel: one CTA per (tile slot, head), 4 or 8 warps, no dependence between CTAs. Inputs are what the
forward and the reverse scan left: the state ``S`` entering the tile (the training forward's
checkpoint) and the gradient ``dS'`` leaving it (Kernel A's snapshot), both state images
(:func:`cute_kda.layouts.fwd_recurrence.state_image`); Kernel A's
``du``; dO; the raw q, k, g, v; the workspace's INV and β. Phases (``sync_threads`` between):

1. *Load.* Warp 0 TMA-loads the token tiles and bulk-copies the two state images behind one transaction
   barrier; the other threads fetch INV, β and the gate's inputs.
2. *Recompute K1* (:class:`~..common.token_prep.TokenPrep`, the instructions K1 runs) for the gate's scheme.
   Invalid rows of v, dO, du are zeroed.
3. *Forward recompute* (warp ``w`` of ``n`` owns value columns ``w·D/n …``, its band): ``kd·S``, ``w = v − kd·S``,
   ``u = bf16(β·w)``, ``U = bf16(INV·u)`` (K2's rounding), ``−bf16(β·du)``, and the per-row partial of
   ``Σ_v du·w``.
4. *16×16 products:* warp 0 ``dMqk = bf16(tril(dO·Uᵀ))``; warp 1 ``dL = −stril(du·Uᵀ)``,
   ``β·dL`` and ``Σ_j dL ⊙ A``; the last 2 (of 4) or 4 (of 8) warps ``dgT = Σ_v S ⊙ dS'`` per channel.
5. *Channel products* (warp ``w`` owns the key channels of its band): the token gradients of q̂ and k̂ and the
   per-row l2norm dot products.
6. *Finish:* dq, dk (l2norm backward); the gate backward (dg, and the tile's partial sums of ddt_bias and
   dA_log); per row, dβ.

Rows past the end of the sequence are invalid: masked to zero on entry, never written.

With ``pair_rebuild`` the states come a pair of tiles and each CTA first rebuilds the matrix of its tile's other end
from its pair partner's fields (:mod:`.pairs`, the two-tile training form).

This module holds what every gate shares: the argument bundles, the launch, phases 1, 3 and 4, the warp products
and the l2norm and β backward. One subclass a gate scheme holds its recompute, its shared memory and phases 5
and 6: :class:`~.safe.SafeBwdGrads` (the bounded gate), :class:`~.dyadic.DyadicBwdGrads` (the per-channel
unbounded gates), :class:`~.per_head.PerHeadBwdGrads` (a per-head gate); :func:`~cute_kda.kernels.bwd_grads.
bwd_grads_kernel` picks one from the variant's flags.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental.primitives import cp_async_bulk_shared_cluster_global
from cutlass.memory import SmemAllocator

from ...dsl import cute, cutlass
from ...layouts import bwd_grads as plan
from ...layouts.budget import SMEM_CARVEOUT_PERCENT, SmemBudget
from ...layouts.fwd_prepare import chunk_tile, compact
from ...layouts.smem import CHUNK, HEAD_DIM, square_tile, sw128_tile_transposed
from ...numerics import IMAGE_RUN, LOG2E, NATIVE_HEAD_DIMS
from ..common.copy import (
    WARP_TILE,
    Operand,
    c_row_half,
    head_tile_tma_partition,
    ldmatrix_copy,
    make_fragment,
    make_head_tile_tma_atom,
    smem_tensor,
    stmatrix_copy,
    transpose_c_to_b,
    warp_tiled_mma,
)
from ..common.fastmath import ex2_approx, reduce_add_bf16x2
from ..common.token_prep import TokenPrep
from .pairs import PairLoads, PairRebuild, PairTile


class GradsInputs(NamedTuple):
    """Per-token inputs, tokens flattened (``rows = B·T``); validated by the launcher. ``HV`` value heads (= H
    unless grouped); a per-head gate's g, A_log, dt_bias are per value head (A_log, dt_bias None for gate "none")."""

    q: cute.Tensor  # dtype (bf16 or fp16) [rows, H, D], raw
    k: cute.Tensor  # dtype [rows, H, D], raw
    g: cute.Tensor  # gate_dtype [rows, H, D], raw gate; per-head gate: [rows, HV] (dtype, or fp32 log decay)
    v: cute.Tensor  # dtype [rows, HV, D]
    do: cute.Tensor  # bf16 [rows, HV, D]
    du: cute.Tensor  # bf16 [rows, HV, D], Kernel A's
    a_log: Optional[cute.Tensor]  # fp32 [HV]
    dt_bias: Optional[cute.Tensor]  # fp32 [H, D]; per-head gate: [HV]


class GradsStates(NamedTuple):
    """Per-tile state matrices, ``[H · slots, D, D]`` state images (:func:`cute_kda.layouts.fwd_recurrence.state_image`):
    matrix ``h·slots + g + s``, each loaded by one 1-D bulk copy; with ``pair_rebuild`` one a pair of tiles (the state
    entering it, the gradient leaving it), matrix ``h·slots + (g_a + s) // 2`` (``workspace.pair_block_slots``)."""

    state: cute.Tensor  # bf16: S entering the tile (training forward's checkpoints)
    state_grad: cute.Tensor  # bf16: dS' after the tile (Kernel A's snapshots)


class GradsWorkspace(NamedTuple):
    """The K1 workspace fields Kernel B reads (``R = H · tiles`` rows, slot = h·tiles + tile); gT it
    recomputes as K1 does (``2^G_last``, the same instruction on the same value)."""

    inv: cute.Tensor  # bf16 [R, 16, 16]
    beta: cute.Tensor  # fp32 [R, 16]


class PairInputs(NamedTuple):
    """What ``pair_rebuild`` reads of a tile's pair partner (launch side): ``R = HV · tiles`` workspace rows."""

    u_a: cute.Tensor  # bf16 [HV · pair slots, D, 16]: tile a's U, value-major, as the training pair K2 keeps it
    dv: cute.Tensor  # bf16 [rows, HV, D]: Kernel A's
    qd: cute.Tensor  # bf16 [R · 16, 1, D]: a tile-relative K1 workspace's qd (its [R, 16, D] rows as one head)
    kd: cute.Tensor  # bf16 [R · 16, 1, D]
    kr: cute.Tensor  # bf16 [R · 16, 1, D]
    gt: cute.Tensor  # fp32 [R, D]


class GradsOutputs(NamedTuple):
    """Gradients: per token (valid rows only) and per tile slot (every slot written). A per-head gate: dq, dk per
    value head (their group sums are the caller's), dg per (token, value head), the partials per slot; none for
    gate "none"."""

    dq: cute.Tensor  # grad_dtype [rows, H, D]; per-head gate: [rows, HV, D]
    dk: cute.Tensor  # grad_dtype [rows, H, D]; per-head gate: [rows, HV, D]
    dg: cute.Tensor  # grad_dtype [rows, H, D], w.r.t. the raw gate; per-head gate: fp32 [rows, HV]
    dbeta: cute.Tensor  # bf16 [rows, HV], w.r.t. beta as given (logits when beta_logits)
    ddt_partial: Optional[cute.Tensor]  # fp32 [R, D]: Σ over the tile's tokens of dg_raw; per-head gate: [R]
    dalog_partial: Optional[cute.Tensor]  # fp32 [R]: Σ of dx · x (safe) or of dγ · γ (per-head softplus)


class TileLocation(NamedTuple):
    """Where a CTA's tile lies (device values)."""

    head: Int32  # value head
    qk_head: Int32  # its q/k head
    slot: Int32  # workspace row: head · tiles + tile slot
    state_row: Int32  # the state images' row (cute_kda.workspace.snapshot_slots with blocks of one tile)
    row0: Int32  # first token row
    valid_rows: Int32  # rows inside the sequence
    pair: Optional[PairTile] = None  # with ``pair_rebuild``: the tile's place in its pair


class GradsScalars(NamedTuple):
    scale: Float32  # f32(scale)
    c_gate: Float32  # f32(lower_bound · log2(e))
    seq_len: Int32  # T of a fixed-length batch (unused with cu_seqlens)
    state_slots: Int32  # state slots per head (cute_kda.workspace.snapshot_slots)


# views of one CTA's shared memory every scheme has (``*_t``: transposed views of the same bytes); qd, kd are
# written over q, k in every plan
# (``partner_*``: the pair partner's tiles of ``pair_rebuild``, over ``layouts.bwd_grads.PARTNER_BUFFERS``; None in a
# scheme without them)
SHARED_SMEM_FIELDS = ("q", "k", "v", "do", "du", "state", "state_t", "state_grad", "state_grad_t", "qd", "kd", "kr",
                      "u_out", "neg_bdu", "inv", "dmqk", "dlb", "beta", "rinv_q", "rinv_k", "dbeta_square", "dbeta_w",
                      "dot_q", "dot_k", "dgt", "partner_tiles", "partner_tiles_t", "partner_u")


def smem_bundle(name: str, own_fields: tuple[str, ...], doc: str) -> type:
    """A NamedTuple of shared-memory views: :data:`SHARED_SMEM_FIELDS`, then a scheme's ``own_fields``."""
    bundle = NamedTuple(name, [(field, Any) for field in SHARED_SMEM_FIELDS + own_fields])
    bundle.__doc__ = doc
    return bundle


class BwdGrads(TokenPrep, PairRebuild):
    """Kernel B's shared phases. Static configuration: ``varlen``, ``qk_l2norm``, ``beta_logits``; ``dim``: K = V
    (:data:`cute_kda.numerics.NATIVE_HEAD_DIMS`); ``compute_warps`` (:func:`cute_kda.layouts.bwd_grads.compute_warps`:
    4 or 8 at 128, 4 at 64): warps per CTA, each owning ``D / compute_warps`` columns in the band phases, the first
    ``D / 32`` also one channel a thread in the per-channel phases; ``gate``
    (:data:`cute_kda.numerics.GATES`) and ``gate_dtype`` (``dtype``, or fp32 with gate "none"); ``grouped`` value heads
    (value head ``h`` reads q/k head ``h // (HV / H)``). ``gate_ahead``: the gate backward reads its channel's 16 raw
    gate values in one burst before its row loop (K1's :meth:`load_gate_column`), not one a row after the previous
    row's ``dg`` store, which ptxas may not pass (the two may alias): one L2 round trip instead of 16
    (docs/perf-log.md, B5); ``split_load``: the state images complete a transaction barrier of their own, waited for
    before phase 3 (their first reader), so K1's recompute runs while they arrive (docs/perf-log.md, B6). Neither
    changes an instruction's operands: the same bits. ``split_rows`` (a scheme with :attr:`splits_gate_rows`, 8 warps):
    the gate backward's rows shared by all warps, its sums kept in order (docs/perf-log.md, B7). ``slopes_ahead`` (a
    scheme with :attr:`forms_slopes_ahead`, not with ``split_rows``): the gate backward forms every row's ``x`` and
    ``σ'(x)`` in straight-line code before its row loop, so ptxas overlaps the rows' latency chains (docs/perf-log.md,
    B8; the same bits). ``grad_dtype``: dq,
    dk and a per-channel gate's dg stored in bf16, or in fp16 for fp16 training as ``f16(bf16(x))``: the bf16 value
    the bf16 variant stores, converted exactly as the copy route's ``.to(float16)`` of it (docs/numerics.md, "fp16
    training"; not with ``grouped``: the group sums add the bf16 values). ``dtype``: q's, k's and v's (and a raw
    gate's), bf16 or fp16: fp16 tiles come by TMA into the same 16-bit buffers and are widened to fp32 exactly where
    bf16 ones are, so the recompute is the fp16 K1's and K2's (docs/numerics.md, "fp16 training", stage 4); qd, kd
    are bf16 over them as before. ``group_sum`` (``grouped``, bf16 gradients): dq and dk of the value heads of a
    group of two added by the kernel into the q/k head's rows of a zeroed ``[rows, H, D]`` (bf16x2 reductions: either
    order gives ``bf16(a + b)``, the bits of the caller's fp32 sum rounded once), not stored per value head.
    ``pair_rebuild`` (a scheme with :attr:`partner_buffers`; bf16 inputs, not with ``split_load``): the states a pair
    of tiles, the matrix of the tile's other end rebuilt first (:mod:`.pairs`).

    A scheme's subclass sets :attr:`gates`, :attr:`per_head_gate` (g ``[.., HV]`` instead of ``[.., HV, D]``),
    :attr:`gate_tile` (g comes by TMA with the other token tiles), :attr:`grouped_heads`, :attr:`ctas_per_sm` and
    :attr:`smem_plan`, and provides :meth:`make_smem`, :meth:`tile_gradients` (its phases) and :meth:`dl_pairs`
    (the ``A`` of dβ)."""

    gates = ("softplus", "none")  # the gate forms the scheme takes
    per_head_gate = False
    gate_tile = False
    grouped_heads = True  # built for grouped value heads
    splits_gate_rows = False  # the scheme's gate backward can run on every warp (``split_rows``)
    forms_slopes_ahead = False  # its gate backward can form the rows' slopes before its loop (``slopes_ahead``)
    partner_buffers: tuple[str, ...] = ()  # its plan's buffers a pair partner's tiles take (``pair_rebuild``)
    ctas_per_sm = plan.CTAS_PER_SM
    smem_plan: Callable[..., SmemBudget]  # of (warps, D)

    def __init__(self, *, varlen: bool, gate: str = "safe", qk_l2norm: bool = True, beta_logits: bool = True,
                 compute_warps: int = plan.DEFAULT_WARPS, gate_dtype: type = BFloat16, grouped: bool = False,
                 gate_ahead: bool = False, split_load: bool = False, split_rows: bool = False,
                 slopes_ahead: bool = False, dim: int = HEAD_DIM, grad_dtype: type = BFloat16,
                 dtype: type = BFloat16, group_sum: bool = False, pair_rebuild: bool = False) -> None:
        if dim not in NATIVE_HEAD_DIMS:
            raise ValueError(f"dim must be one of {NATIVE_HEAD_DIMS}, got {dim}")
        if compute_warps not in plan.compute_warps(dim):
            raise ValueError(f"compute_warps must be one of {plan.compute_warps(dim)} at D = {dim}, got {compute_warps}")
        if gate not in self.gates:
            raise ValueError(f"{type(self).__name__} takes gate {' or '.join(map(repr, self.gates))}, got {gate!r}")
        if grouped and not self.grouped_heads:
            raise NotImplementedError(f"grouped value heads are built for the unbounded gates only, not {gate!r}")
        if dtype not in (BFloat16, Float16):
            raise ValueError(f"q, k and v are bf16 or fp16, got {dtype}")
        if gate_dtype not in (dtype, Float32) or (gate_dtype is Float32 and gate != "none"):
            raise ValueError(f"g is q's dtype {dtype.__name__} (or fp32 with gate 'none'), got {gate_dtype} with "
                             f"gate {gate!r}")
        if gate_ahead and not plan.reads_gate_rows(gate, self.per_head_gate):
            raise ValueError(f"gate_ahead: {type(self).__name__} with gate {gate!r} reads no raw gate row by row")
        if grad_dtype not in (BFloat16, Float16) or (grad_dtype is Float16 and grouped):
            raise ValueError(f"dq, dk, dg are bf16, or fp16 without grouped value heads, got {grad_dtype}")
        if group_sum and not (grouped and grad_dtype is BFloat16):
            raise ValueError("group_sum: grouped value heads with bf16 dq, dk")
        self.gate, self.gate_dtype, self.grouped, self.grad_dtype = gate, gate_dtype, grouped, grad_dtype
        self.group_sum = group_sum
        self.dtype = dtype
        if split_rows and not (self.splits_gate_rows and compute_warps == max(plan.COMPUTE_WARPS)):
            raise ValueError(f"split_rows: built for the safe gate at {max(plan.COMPUTE_WARPS)} warps")
        if slopes_ahead and (split_rows or not self.forms_slopes_ahead):
            raise ValueError("slopes_ahead: built for the safe gate, without split_rows")
        self.gate_ahead, self.split_load, self.split_rows = gate_ahead, split_load, split_rows
        self.slopes_ahead = slopes_ahead
        if pair_rebuild and (not self.partner_buffers or split_load or dtype is not BFloat16):
            raise ValueError(f"pair_rebuild: built for bf16 inputs with the {' and '.join(plan.PARTNER_BUFFERS)} gate "
                             "schemes, not with split_load")
        self.pair_rebuild = pair_rebuild
        self.varlen = varlen
        self.qk_l2norm = qk_l2norm
        self.beta_logits = beta_logits
        self.warps = compute_warps
        self.band = dim // compute_warps  # columns (value or key channels) one warp owns
        self.dgt_warp = compute_warps // 2  # warps from here on compute dgT in phase 4
        self.num_threads = compute_warps * 32
        self.dim = dim
        self.tile = (CHUNK, dim)
        self.k_steps = dim // WARP_TILE  # 16-wide contraction steps over a full head dimension
        self.channel_warps = dim // 32  # warps that run the per-channel phases, one thread a channel
        self.decay_items = CHUNK * self.row_lanes // self.num_threads

    def smem_budget(self) -> SmemBudget:
        """The shared-memory plan the launch asks for: the scheme's :attr:`smem_plan` (of ``layouts.bwd_grads``)."""
        return self.smem_plan(self.warps, self.dim, split_load=self.split_load)

    @cute.jit
    def __call__(
        self,
        inputs: GradsInputs,
        states: GradsStates,
        ws: GradsWorkspace,
        out: GradsOutputs,
        scale: Float32,
        c_gate: Float32,
        seq_len: Int32,
        cu_seqlens: Optional[cute.Tensor],
        tile_base: Optional[cute.Tensor],
        pair: Optional[PairInputs],
        stream,
    ) -> None:
        """Launch over ``(tiles, H)`` (``(2 · tiles, H / 2)`` with :attr:`group_sum`), ``tiles = ws.beta.shape[0] //
        H``. Tensors C-contiguous with the shapes of the argument bundles (dynamic extents); ``cu_seqlens`` int64 /
        ``tile_base`` int32 ``[N+1]`` for varlen, else None; ``pair`` with :attr:`pair_rebuild` only."""
        heads, qk_heads, d = inputs.v.shape[1], inputs.q.shape[1], self.dim
        scalars = GradsScalars(scale=scale, c_gate=c_gate, seq_len=seq_len,
                               state_slots=states.state.shape[0] // heads)
        per_head = self.per_head_gate
        gate_inner = (heads,) if per_head else (heads, d)
        with_constants = self.gate != "none"  # a log decay has neither A_log nor dt_bias (None)
        inputs = GradsInputs(
            q=compact(inputs.q, (qk_heads, d)), k=compact(inputs.k, (qk_heads, d)), g=compact(inputs.g, gate_inner),
            v=compact(inputs.v, (heads, d)), do=compact(inputs.do, (heads, d)), du=compact(inputs.du, (heads, d)),
            a_log=compact(inputs.a_log, ()) if with_constants else None,
            dt_bias=(compact(inputs.dt_bias, () if per_head else (d,)) if with_constants else None),
        )
        ws = GradsWorkspace(inv=compact(ws.inv, (CHUNK, CHUNK)), beta=compact(ws.beta, (CHUNK,)))
        grad_heads = qk_heads if cutlass.const_expr(self.group_sum) else heads  # dq, dk per q/k head with group_sum
        out = GradsOutputs(
            dq=compact(out.dq, (grad_heads, d)), dk=compact(out.dk, (grad_heads, d)), dg=compact(out.dg, gate_inner),
            dbeta=compact(out.dbeta, (heads,)),
            ddt_partial=compact(out.ddt_partial, () if per_head else (d,)) if with_constants else None,
            dalog_partial=compact(out.dalog_partial, ()) if with_constants else None,
        )
        load = cpasync.CopyBulkTensorTileG2SOp()
        tile = chunk_tile(d)
        token_tiles = ((inputs.q, inputs.k, inputs.g, inputs.v, inputs.do, inputs.du) if self.gate_tile
                       else (inputs.q, inputs.k, inputs.v, inputs.do, inputs.du))
        tma_tokens = tuple(make_head_tile_tma_atom(load, t, tile, self.tile) for t in token_tiles)
        pair_loads = None
        if cutlass.const_expr(self.pair_rebuild):
            pair_loads = PairLoads(
                *(make_head_tile_tma_atom(load, t, tile, self.tile)
                  for t in (compact(pair.dv, (heads, d)), *(compact(f, (1, d)) for f in (pair.qd, pair.kd, pair.kr)))),
                u_a=compact(pair.u_a, (d, CHUNK)), gt=compact(pair.gt, (d,)))
        self.shared_storage = self.smem_budget().storage_struct()
        tiles = ws.beta.shape[0] // heads
        # group_sum: the two value heads of a pair one after the other (x = 2 · tile + j), so that the second one's
        # dq, dk reductions find the first one's lines in L2, as its q, k tiles
        grid = (2 * tiles, heads // 2, 1) if cutlass.const_expr(self.group_sum) else (tiles, heads, 1)
        self.kernel(tma_tokens, states, inputs, ws, out, scalars, cu_seqlens, tile_base, pair_loads).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=SMEM_CARVEOUT_PERCENT,
        )

    @cute.kernel
    def kernel(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
               out: GradsOutputs, scalars: GradsScalars, cu_seqlens: Optional[cute.Tensor],
               tile_base: Optional[cute.Tensor], pair_loads: Optional[PairLoads]):
        tile_slot, head, _ = cute.arch.block_idx()
        tiles, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.group_sum):  # x = 2 · tile + value head in the pair, y = the pair
            tile_slot, head, tiles = tile_slot // 2, 2 * head + tile_slot % 2, tiles // 2
        slot = head * tiles + tile_slot
        if cutlass.const_expr(self.pair_rebuild):
            seq, tile_in_seq, row0, seq_end, exists = self.tile_position(tile_slot, scalars.seq_len, cu_seqlens,
                                                                         tile_base)
            valid_rows = cutlass.min(seq_end - row0, CHUNK)
        else:
            row0, valid_rows, exists, seq = self.locate_tile(tile_slot, scalars.seq_len, cu_seqlens, tile_base)
        if exists:
            pair = None
            if cutlass.const_expr(self.pair_rebuild):
                pair = self.pair_position(head, tile_slot, tiles, tile_in_seq, seq, row0, seq_end,
                                          scalars.state_slots)
                state_row = pair.pair_row
            else:
                state_row = head * scalars.state_slots + tile_slot + seq
            qk_head = head // (inputs.v.shape[1] // inputs.q.shape[1]) if cutlass.const_expr(self.grouped) else head
            self.tile_gradients(tma_tokens, states, inputs, ws, out, scalars,
                                TileLocation(head, qk_head, slot, state_row, row0, valid_rows, pair), pair_loads)
        else:
            self.zero_partials(out, slot)

    @cute.jit
    def zero_partials(self, out: GradsOutputs, slot: Int32):
        """A slot that is no tile (varlen bound) still sums to nothing (per-channel partials)."""
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.gate != "none"):
            if tidx < self.dim:
                out.ddt_partial[slot, tidx] = Float32(0.0)
            if tidx == 0:
                out.dalog_partial[slot] = Float32(0.0)

    def shared_views(self, storage, *, v, du, kr, state, state_grad) -> dict:
        """The :data:`SHARED_SMEM_FIELDS` views of ``storage``, given the buffers each plan places differently."""
        tile = chunk_tile(self.dim)
        partner = tuple(getattr(storage, name) for name in self.partner_buffers)
        tile_t = sw128_tile_transposed(CHUNK, self.dim)
        state_layout = plan.state_tile(self.dim)
        sq = square_tile()
        warp_rows = plan.warp_rows(self.warps)
        l2norm = storage.rows_then_l2norm.l2norm_rows
        return dict(
            q=self.view(storage.q, tile, self.dtype), k=self.view(storage.k, tile, self.dtype),
            v=self.view(v, tile, self.dtype),
            do=self.view(storage.do, tile), du=self.view(du, tile), state=self.view(state, state_layout),
            state_t=self.view(state, plan.state_tile_transposed(self.dim)),
            state_grad=self.view(state_grad, state_layout),
            state_grad_t=self.view(state_grad, plan.state_tile_transposed(self.dim)), qd=self.view(storage.q, tile),
            kd=self.view(storage.k, tile), kr=self.view(kr, tile), u_out=self.view(storage.u_out, tile),
            neg_bdu=self.view(storage.neg_bdu, tile), inv=self.view(storage.inv, sq), dmqk=self.view(storage.dmqk, sq),
            dlb=self.view(storage.dlb, sq),
            **{name: self.view(getattr(storage, name), plan.row_vector(), Float32) for name in plan.ROW_VECTORS},
            dbeta_w=self.view(storage.rows_then_l2norm.dbeta_w, warp_rows, Float32),
            dot_q=self.view(l2norm.dot_q, warp_rows, Float32), dot_k=self.view(l2norm.dot_k, warp_rows, Float32),
            dgt=self.view(storage.dgt, plan.vector(self.dim), Float32),
            partner_tiles=tuple(self.view(buffer, tile) for buffer in partner) if partner else None,
            partner_tiles_t=tuple(self.view(buffer, tile_t) for buffer in partner) if partner else None,
            partner_u=self.view(partner[1], plan.pair_u_tile(self.dim)) if partner else None,
        )

    @staticmethod
    def zero_fragments(tiled_mma, shape: tuple, count: int) -> tuple:
        """``count`` fp32 C fragments of ``shape`` (all made, then each zero-filled)."""
        fragments = tuple(make_fragment(tiled_mma, Operand.C, Float32, tile=shape) for _ in range(count))
        for fragment in fragments:
            fragment.fill(0.0)
        return fragments

    @staticmethod
    def view(buffer, layout, dtype: type = BFloat16) -> cute.Tensor:
        """A shared-memory tensor over a storage ``buffer``."""
        return smem_tensor(buffer.data_ptr(), layout, dtype)

    @cute.jit
    def start_tile(self, tma_tokens: tuple, states: GradsStates, tile: TileLocation,
                   pair_loads: Optional[PairLoads] = None) -> tuple:
        """A CTA with a tile: (thread, warp, lane, the scheme's smem views, the transaction barrier), warp 0 having
        issued the loads (:meth:`load_tiles` of :meth:`token_buffers`; with ``pair_rebuild`` the pair partner's,
        :meth:`~.pairs.PairRebuild.load_partner`)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        smem = self.make_smem(storage)
        tma_barrier = storage.tma_barrier.data_ptr()
        if warp_idx == 0:
            partner_bytes = self.partner_bytes(tile.pair) if cutlass.const_expr(self.pair_rebuild) else 0
            self.load_tiles(tma_tokens, states, self.token_buffers(smem, tile.head, tile.qk_head),
                            (smem.state, smem.state_grad), tma_barrier, tile.row0, tile.state_row, partner_bytes)
            if cutlass.const_expr(self.pair_rebuild):
                self.load_partner(pair_loads, tma_tokens[-2], smem, tile.pair, tile.head, tile.row0, tma_barrier)
        return tidx, warp_idx, lane, smem, tma_barrier

    def token_buffers(self, smem, head: Int32, qk_head: Int32) -> tuple:
        """(smem tile, head) of each TMA-loaded token tile, in the launch's ``tma_tokens`` order."""
        buffers = ((smem.q, qk_head), (smem.k, qk_head))
        if self.gate_tile:
            buffers += ((smem.g, head),)
        return buffers + ((smem.v, head), (smem.do, head), (smem.du, head))

    @cute.jit
    def load_tiles(self, tma_tokens: tuple, states: GradsStates, token_buffers: tuple, state_buffers: tuple,
                   tma_barrier, row0: Int32, state_row: Int32, extra_bytes=0):
        """Warp 0: one transaction barrier (two with ``split_load``: the token tiles', then the state images', the
        next mbarrier), counting ``extra_bytes`` more that the caller loads after these; the token tiles at token row
        ``row0`` (``token_buffers``: (smem tile, head) in ``tma_tokens``' order), the two state images of row
        ``state_row`` (one 1-D bulk copy each)."""
        image_elements = self.dim * self.dim
        total = plan.load_bytes(self.dim, per_head_gate=not self.gate_tile)
        state_barrier = tma_barrier + 1 if cutlass.const_expr(self.split_load) else tma_barrier
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(tma_barrier, 1)
            if cutlass.const_expr(self.split_load):
                cute.arch.mbarrier_init(state_barrier, 1)
            cute.arch.mbarrier_init_fence()
            if cutlass.const_expr(self.split_load):
                cute.arch.mbarrier_arrive_and_expect_tx(tma_barrier, total - plan.state_load_bytes(self.dim))
                cute.arch.mbarrier_arrive_and_expect_tx(state_barrier, plan.state_load_bytes(self.dim))
            else:
                cute.arch.mbarrier_arrive_and_expect_tx(tma_barrier, total + extra_bytes)
        for (atom, tma_tensor), (buffer, head) in zip(tma_tokens, token_buffers):
            s_part, g_part = head_tile_tma_partition(
                atom, cute.domain_offset((row0, 0, 0), tma_tensor), buffer, head, self.tile
            )
            cute.copy(atom, g_part[None, 0], s_part, tma_bar_ptr=tma_barrier)
        with cute.arch.elect_one():
            for source, buffer in zip(states, state_buffers):
                image = source.iterator + Int64(state_row) * image_elements
                cp_async_bulk_shared_cluster_global(buffer.iterator, image, state_barrier, image_elements * 2)

    @cute.jit
    def load_workspace_rows(self, smem, ws: GradsWorkspace, slot: Int32, tidx: Int32):
        """The tile's activated β and INV from the workspace into shared memory (plain loads, during the TMA)."""
        if tidx < CHUNK:
            smem.beta[tidx] = ws.beta[slot, tidx]
        for i in cutlass.range_constexpr(CHUNK * CHUNK // self.num_threads):
            flat = tidx + i * self.num_threads
            smem.inv[flat // CHUNK, flat % CHUNK] = ws.inv[slot, flat // CHUNK, flat % CHUNK]

    @cute.jit
    def forward_and_square_products(self, smem, tidx: Int32, warp_idx: Int32, lane: Int32, tma_barrier):
        """Phases 3 and 4, the same for every gate: (``split_load``: the state images' barrier first) the forward
        recompute per value band; then warp 0 ``dMqk``, warp 1 ``dL`` (:meth:`masked_do_u`, :meth:`masked_du_u`) and
        the last warps dgT; a barrier after each."""
        if cutlass.const_expr(self.split_load):
            cute.arch.mbarrier_wait(tma_barrier + 1, 0)
        self.forward_band(smem, warp_idx, lane)
        cute.arch.sync_threads()
        if warp_idx == 0:
            self.masked_do_u(smem, lane)
        elif warp_idx == 1:
            self.masked_du_u(smem, lane)
        elif warp_idx >= self.dgt_warp:
            self.state_gate_grad(smem, tidx - self.dgt_warp * 32)
        cute.arch.sync_threads()

    @cute.jit
    def zero_invalid_rows(self, smem, valid_rows: Int32, tidx: Int32):
        """v, dO and du rows past the sequence end (the TMA brought another sequence's rows) := 0."""
        if valid_rows < CHUNK:
            for i in cutlass.range_constexpr(CHUNK * self.dim // self.num_threads):
                flat = tidx + i * self.num_threads
                row, c = flat // self.dim, flat % self.dim
                if row >= valid_rows:
                    smem.v[row, c] = self.dtype(0.0)
                    smem.do[row, c] = BFloat16(0.0)
                    smem.du[row, c] = BFloat16(0.0)

    # -------------------------------------------------------------------------------------------
    # warp products

    @cute.jit
    def accumulate(self, tiled_mma, acc: cute.Tensor, a_view: cute.Tensor, b_view: cute.Tensor,
                   a_transposed: cutlass.Constexpr, b_transposed: cutlass.Constexpr, k_steps: cutlass.Constexpr,
                   lane: Int32):
        """``acc += a · bᵀ`` over ``k_steps`` 16-wide steps: ``a_view`` ``(16, 16·k_steps)`` (m, k),
        ``b_view`` ``(n, 16·k_steps)`` (n, k); ``*_transposed``: the view's first index is the contiguous
        one (``ldmatrix.trans``)."""
        n = cute.size(b_view, mode=[0])
        a_frag = make_fragment(tiled_mma, Operand.A, BFloat16)
        b_frag = make_fragment(tiled_mma, Operand.B, BFloat16, tile=(n, WARP_TILE))
        copy_a = ldmatrix_copy(tiled_mma, Operand.A, a_transposed)
        copy_b = ldmatrix_copy(tiled_mma, Operand.B, b_transposed)
        thr_a, thr_b = copy_a.get_slice(lane), copy_b.get_slice(lane)
        for kb in cutlass.range_constexpr(k_steps):
            cute.copy(copy_a, thr_a.partition_S(cute.local_tile(a_view, (WARP_TILE, WARP_TILE), (0, kb))),
                      thr_a.retile(a_frag))
            cute.copy(copy_b, thr_b.partition_S(cute.local_tile(b_view, (n, WARP_TILE), (0, kb))),
                      thr_b.retile(b_frag))
            cute.gemm(tiled_mma, acc, a_frag, b_frag, acc)

    @cute.jit
    def load_c(self, tiled_mma, s_block: cute.Tensor, lane: Int32) -> cute.Tensor:
        """C fragment of the ``(16, n)`` smem block ``s_block`` in its element type (bf16, or an fp16 input tile;
        ``ldmatrix``: one instruction a 16×16)."""
        dtype = s_block.element_type
        frag = make_fragment(tiled_mma, Operand.C, dtype, tile=(CHUNK, cute.size(s_block, mode=[1])))
        copy = ldmatrix_copy(tiled_mma, Operand.C, False, dtype)
        thr = copy.get_slice(lane)
        cute.copy(copy, thr.partition_S(s_block), thr.retile(frag))
        return frag

    @cute.jit
    def store_c(self, tiled_mma, frag: cute.Tensor, s_block: cute.Tensor, lane: Int32):
        """bf16 C fragment ``frag`` into the ``(16, n)`` smem block ``s_block`` (``stmatrix``)."""
        copy = stmatrix_copy(tiled_mma, Operand.C, False)
        thr = copy.get_slice(lane)
        cute.copy(copy, thr.retile(frag), thr.partition_D(s_block))

    @cute.jit
    def row_values(self, s_rows: cute.Tensor, lane: Int32) -> cute.Tensor:
        """``s_rows[g]`` and ``s_rows[g + 8]`` (``g = lane // 4``): the two rows a C fragment's lane holds."""
        values = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            values[h] = s_rows[lane // 4 + 8 * h]
        return values

    @cute.jit
    def forward_band(self, smem, warp_idx: Int32, lane: Int32):
        """Value band of warp ``w``: ``w = v − kd·S``, ``u``, ``U = bf16(INV·u)`` into ``u_out``,
        ``−bf16(β·du)`` into ``neg_bdu``, and the warp's row partial of ``Σ_v du·w``."""
        band = self.band
        mma = warp_tiled_mma(BFloat16, Float32, band)
        block = (CHUNK, band)
        ks = make_fragment(mma, Operand.C, Float32, tile=block)
        ks.fill(0.0)
        self.accumulate(mma, ks, smem.kd, cute.local_tile(smem.state_t, (band, self.dim), (warp_idx, 0)),
                        False, False, self.k_steps, lane)
        v = self.load_c(mma, cute.local_tile(smem.v, block, (0, warp_idx)), lane)
        du = self.load_c(mma, cute.local_tile(smem.du, block, (0, warp_idx)), lane)
        beta = self.row_values(smem.beta, lane)
        u = make_fragment(mma, Operand.C, BFloat16, tile=block)
        neg_bdu = make_fragment(mma, Operand.C, BFloat16, tile=block)
        row_sum = cute.make_rmem_tensor((2,), Float32)  # rows g and g + 8 of this lane
        row_sum.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(ks)):
            h = c_row_half(i)
            w = v[i].to(Float32) - ks[i]
            u[i] = (w * beta[h]).to(BFloat16)
            du_i = du[i].to(Float32)
            row_sum[h] = row_sum[h] + du_i * w
            neg_bdu[i] = (-(beta[h] * du_i)).to(BFloat16)
        self.store_c(mma, neg_bdu, cute.local_tile(smem.neg_bdu, block, (0, warp_idx)), lane)
        self.store_row_partials(smem.dbeta_w, row_sum, warp_idx, lane)

        u_b = make_fragment(mma, Operand.B, BFloat16, tile=(band, WARP_TILE))
        transpose_c_to_b(u, u_b)
        inv = make_fragment(mma, Operand.A, BFloat16)
        copy_a = ldmatrix_copy(mma, Operand.A, False)
        thr_a = copy_a.get_slice(lane)
        cute.copy(copy_a, thr_a.partition_S(smem.inv), thr_a.retile(inv))
        big_u = make_fragment(mma, Operand.C, Float32, tile=block)
        big_u.fill(0.0)
        cute.gemm(mma, big_u, inv, u_b, big_u)
        u_out = make_fragment(mma, Operand.C, BFloat16, tile=block)
        for i in cutlass.range_constexpr(cute.size(big_u)):
            u_out[i] = big_u[i].to(BFloat16)
        self.store_c(mma, u_out, cute.local_tile(smem.u_out, block, (0, warp_idx)), lane)

    @cute.jit
    def key_band(self, smem, warp_idx: Int32, lane: Int32) -> tuple:
        """Phase 5's start for the key band of warp ``warp_idx``: (its mma, first column, C fragment shape, the
        fragment's coordinates, S's rows of the band)."""
        band = self.band
        mma = warp_tiled_mma(BFloat16, Float32, band)
        c0 = warp_idx * band
        shape = (CHUNK, band)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor(shape))
        return mma, c0, shape, coords, cute.local_tile(smem.state, (band, self.dim), (warp_idx, 0))

    @cute.jit
    def store_row_partials(self, s_rows: cute.Tensor, row_sum: cute.Tensor, warp_idx: Int32, lane: Int32):
        """Sum each lane's two row partials over the 4 lanes that share the rows; lane ``4g`` writes
        rows ``g`` and ``g + 8`` of ``s_rows[warp_idx]``."""
        for h in cutlass.range_constexpr(2):
            total = row_sum[h]
            for offset in (1, 2):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
            if lane % 4 == 0:
                s_rows[warp_idx, lane // 4 + 8 * h] = total

    @cute.jit
    def square_product(self, s_left: cute.Tensor, s_right: cute.Tensor, lane: Int32) -> cute.Tensor:
        """``left · rightᵀ`` of two ``[16, D]`` tiles: a fresh fp32 C fragment (16-wide steps in order)."""
        mma = warp_tiled_mma(BFloat16, Float32)
        acc = make_fragment(mma, Operand.C, Float32)
        acc.fill(0.0)
        self.accumulate(mma, acc, s_left, s_right, False, False, self.k_steps, lane)
        return acc

    @cute.jit
    def masked_do_u(self, smem, lane: Int32):
        """Warp 0: ``dMqk = bf16(tril(dO·Uᵀ))`` (diagonal kept), as :meth:`weigh_dmqk` leaves it, into ``dmqk``."""
        mma = warp_tiled_mma(BFloat16, Float32)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        acc = self.square_product(smem.do, smem.u_out, lane)
        dmqk = make_fragment(mma, Operand.C, BFloat16)
        for i in cutlass.range_constexpr(cute.size(acc)):
            row, c = coords[i]
            dmqk[i] = Float32(cutlass.select_(row >= c, acc[i], Float32(0.0))).to(BFloat16)
        self.weigh_dmqk(smem, dmqk, coords, lane)
        self.store_c(mma, dmqk, smem.dmqk, lane)

    @cute.jit
    def weigh_dmqk(self, smem, dmqk: cute.Tensor, coords: cute.Tensor, lane: Int32):
        """What a scheme does to the bf16 dMqk fragment before it is stored: nothing with a per-channel gate (its
        decays are in qd and kd)."""

    @cute.jit
    def masked_du_u(self, smem, lane: Int32):
        """Warp 1: ``dL = −stril(du·Uᵀ)``, ``bf16(β_i·dL_ij)`` into ``dlb``, ``Σ_j dL ⊙ A`` per row with the
        forward's ``A`` (:meth:`dl_pairs`; :meth:`add_dl_pair` adds each pair's term)."""
        mma = warp_tiled_mma(BFloat16, Float32)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        du_u = self.square_product(smem.du, smem.u_out, lane)
        a_kk = self.dl_pairs(smem, coords, lane)
        beta = self.row_values(smem.beta, lane)
        dlb = make_fragment(mma, Operand.C, BFloat16)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_sum.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(du_u)):
            row, c = coords[i]
            h = c_row_half(i)
            d_l = Float32(cutlass.select_(row > c, -du_u[i], Float32(0.0)))
            dlb[i] = (beta[h] * d_l).to(BFloat16)
            self.add_dl_pair(smem, dlb, row_sum, a_kk, d_l, i, h, row, c)
        self.store_c(mma, dlb, smem.dlb, lane)
        for h in cutlass.range_constexpr(2):
            total = row_sum[h]
            for offset in (1, 2):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
            if lane % 4 == 0:  # dβ's two parts: Σ_v du·w (the warps' partials, in warp order), then Σ_j dL ⊙ A
                row = lane // 4 + 8 * h
                value_part = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    value_part = value_part + smem.dbeta_w[w, row]
                smem.dbeta_square[row] = value_part + total

    def dl_pairs(self, smem, coords: cute.Tensor, lane: Int32) -> cute.Tensor:
        """The forward's ``A`` (fp32 C fragment, ``coords`` its positions) that dβ's ``Σ_j dL ⊙ A`` reads."""
        raise NotImplementedError

    @cute.jit
    def add_dl_pair(self, smem, dlb: cute.Tensor, row_sum: cute.Tensor, a_kk: cute.Tensor, d_l: Float32, i: int,
                    h: int, row, c):
        """Pair ``(row, c)`` (element ``i`` of the fragments, row half ``h``): ``dL ⊙ A`` into the row's sum."""
        row_sum[h] = row_sum[h] + d_l * a_kk[i]

    @cute.jit
    def state_gate_grad(self, smem, thread: Int32):
        """The dgT warps (``thread`` counts from their first lane): ``dgT[c] = Σ_v S[c, v]·dS'[c, v]``.

        A state matrix is a state image (8 channels contiguous per value column), so each thread takes one
        8-channel run and a slice of the value columns, reading 16 bytes of S and of dS' a column; the
        slices of a run are summed by butterflies inside the warp. Lane ``l`` starts its slice at column
        offset ``l % 8``, so the 32 lanes' reads fall in distinct 16-byte bank groups, 4 wavefronts an access."""
        run = (IMAGE_RUN, 1)
        warps = self.warps - self.dgt_warp
        runs_per_warp = self.dim // IMAGE_RUN // warps  # 8-channel runs a warp owns
        slices = 32 // runs_per_warp  # value-column slices a run is split into
        width = self.dim // slices
        lane = thread % 32
        channel_run = (thread // 32) * runs_per_warp + lane % runs_per_warp
        first = (lane // runs_per_warp) * width
        totals = cute.make_rmem_tensor((IMAGE_RUN,), Float32)
        totals.fill(0.0)
        s_run = cute.make_rmem_tensor(run, BFloat16)
        ds_run = cute.make_rmem_tensor(run, BFloat16)
        for i in cutlass.range_constexpr(width):
            column = first + (i + lane % 8) % width
            cute.autovec_copy(cute.local_tile(smem.state, run, (channel_run, column)), s_run)
            cute.autovec_copy(cute.local_tile(smem.state_grad, run, (channel_run, column)), ds_run)
            for e in cutlass.range_constexpr(IMAGE_RUN):
                totals[e] = totals[e] + s_run[e].to(Float32) * ds_run[e].to(Float32)
        for e in cutlass.range_constexpr(IMAGE_RUN):
            total = totals[e]
            for level in cutlass.range_constexpr(slices.bit_length() - 1):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=runs_per_warp << level)
            if lane < runs_per_warp:
                smem.dgt[channel_run * IMAGE_RUN + e] = total

    @cute.jit
    def softplus_gate_grad(self, g_raw: Float32, dt: Float32, e_a: Float32, dgamma: Float32) -> Float32:
        """``dg = −e^A·σ(g + dt_bias)·dγ``, the softplus gate's backward; ``σ`` as ``1 / (1 + 2^(−x·log2 e))``,
        accurate in relative terms where it saturates."""
        x = g_raw + dt
        sigmoid = Float32(1.0) / (Float32(1.0) + ex2_approx(-(x * Float32(LOG2E))))
        return -(e_a * sigmoid) * dgamma

    @cute.jit
    def store_token_gradients(self, smem, inputs: GradsInputs, out: GradsOutputs, dq_hat: cute.Tensor,
                              dk_hat: cute.Tensor, coords: cute.Tensor, c0: Int32, tile: TileLocation, warp_idx: Int32,
                              lane: Int32):
        """dq, dk of the warp's key band from the gradients of q̂, k̂ (fp32 C fragments): the l2norm backward
        (the row dot products of all warps, a barrier, the raw q, k of q/k head ``tile.qk_head`` read back from L2),
        stored at (value) head ``tile.head``, or with :attr:`group_sum` added into q/k head ``tile.qk_head``."""
        band = self.band
        mma = warp_tiled_mma(BFloat16, Float32, band)
        shape = (CHUNK, band)
        dq = make_fragment(mma, Operand.C, BFloat16, tile=shape)
        dk = make_fragment(mma, Operand.C, BFloat16, tile=shape)
        if cutlass.const_expr(self.qk_l2norm):
            # raw q, k back from global memory (L2): their smem tiles hold qd, kd now
            q = self.load_token_pairs(inputs.q, coords, c0, tile.qk_head, tile.row0, tile.valid_rows)
            k = self.load_token_pairs(inputs.k, coords, c0, tile.qk_head, tile.row0, tile.valid_rows)
            rinv_q, rinv_k = self.row_values(smem.rinv_q, lane), self.row_values(smem.rinv_k, lane)
            dot_q = cute.make_rmem_tensor((2,), Float32)
            dot_k = cute.make_rmem_tensor((2,), Float32)
            dot_q.fill(0.0)
            dot_k.fill(0.0)
            for i in cutlass.range_constexpr(cute.size(dq_hat)):
                h = c_row_half(i)
                dot_q[h] = dot_q[h] + q[i].to(Float32) * rinv_q[h] * dq_hat[i]
                dot_k[h] = dot_k[h] + k[i].to(Float32) * rinv_k[h] * dk_hat[i]
            self.store_row_partials(smem.dot_q, dot_q, warp_idx, lane)
            self.store_row_partials(smem.dot_k, dot_k, warp_idx, lane)
            cute.arch.sync_threads()
            sum_q = cute.make_rmem_tensor((2,), Float32)
            sum_k = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):  # the row sums over the warps, in warp order
                row = lane // 4 + 8 * h
                total_q = Float32(0.0)
                total_k = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    total_q = total_q + smem.dot_q[w, row]
                    total_k = total_k + smem.dot_k[w, row]
                sum_q[h] = total_q
                sum_k[h] = total_k
            for i in cutlass.range_constexpr(cute.size(dq_hat)):
                h = c_row_half(i)
                dq[i] = (rinv_q[h] * (dq_hat[i] - q[i].to(Float32) * rinv_q[h] * sum_q[h])).to(BFloat16)
                dk[i] = (rinv_k[h] * (dk_hat[i] - k[i].to(Float32) * rinv_k[h] * sum_k[h])).to(BFloat16)
        else:
            for i in cutlass.range_constexpr(cute.size(dq_hat)):
                dq[i] = dq_hat[i].to(BFloat16)
                dk[i] = dk_hat[i].to(BFloat16)
        head = tile.qk_head if cutlass.const_expr(self.group_sum) else tile.head
        self.store_token_pairs(out.dq, dq, coords, c0, head, tile.row0, tile.valid_rows)
        self.store_token_pairs(out.dk, dk, coords, c0, head, tile.row0, tile.valid_rows)

    @cute.jit
    def store_warp_dalog(self, smem, dalog: Float32, warp_idx: Int32, lane: Int32):
        """A channel warp's part of dA_log's partial: the butterfly sum of its lanes' ``dalog``, into ``dalog_w``."""
        for offset in (16, 8, 4, 2, 1):
            dalog = dalog + cute.arch.shuffle_sync_bfly(dalog, offset=offset)
        if lane == 0:
            smem.dalog_w[warp_idx] = dalog

    @cute.jit
    def store_dalog_partial(self, smem, out: GradsOutputs, slot: Int32, warp_idx: Int32, lane: Int32):
        """After a barrier, thread 0: the tile's dA_log partial, the channel warps' parts summed in warp order."""
        cute.arch.sync_threads()
        if warp_idx == 0 and lane == 0:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.channel_warps):
                total = total + smem.dalog_w[w]
            out.dalog_partial[slot] = total

    @cute.jit
    def load_pairs(self, s_tile: cute.Tensor, coords: cute.Tensor, c0: Int32, lane: Int32, row=None) -> cute.Tensor:
        """fp32 values of a ``[16, D]`` smem tile at a C fragment's positions (columns ``c0 +`` its own), two
        adjacent columns per access; ``row`` fixes the row (e.g. G's last) instead of the fragment's."""
        values = cute.make_rmem_tensor(cute.size(coords), Float32)
        pair = cute.make_rmem_tensor((1, 2), Float32)
        for p in cutlass.range_constexpr(cute.size(coords) // 2):
            r, c = coords[2 * p]
            at_row = r if cutlass.const_expr(row is None) else row
            cute.autovec_copy(cute.local_tile(s_tile, (1, 2), (at_row, (c0 + c) // 2)), pair)
            values[2 * p] = pair[0]
            values[2 * p + 1] = pair[1]
        return values

    @cute.jit
    def store_pairs(self, s_tile: cute.Tensor, frag: cute.Tensor, coords: cute.Tensor, c0: Int32):
        """``frag`` (fp32, C fragment order) into a ``[16, D]`` smem tile, two adjacent columns per access."""
        pair = cute.make_rmem_tensor((1, 2), Float32)
        for p in cutlass.range_constexpr(cute.size(frag) // 2):
            r, c = coords[2 * p]
            pair[0] = frag[2 * p]
            pair[1] = frag[2 * p + 1]
            cute.autovec_copy(pair, cute.local_tile(s_tile, (1, 2), (r, (c0 + c) // 2)))

    @cute.jit
    def load_token_pairs(self, gmem: cute.Tensor, coords: cute.Tensor, c0: Int32, head: Int32, row0: Int32,
                         valid_rows: Int32) -> cute.Tensor:
        """The values (``gmem``'s 16-bit type) of the token rows ``row0 + r`` of ``[rows, H, D]`` at a C fragment's
        positions, 32 bits a load; rows past the sequence end read as 0 (they may lie past the tensor)."""
        values = cute.make_rmem_tensor(cute.size(coords), gmem.element_type)
        pair = cute.make_rmem_tensor((2,), gmem.element_type)
        for p in cutlass.range_constexpr(cute.size(coords) // 2):
            r, c = coords[2 * p]
            pair.fill(0.0)
            if r < valid_rows:
                cute.autovec_copy(cute.local_tile(gmem[row0 + r, head, None], (2,), ((c0 + c) // 2,)), pair)
            values[2 * p] = pair[0]
            values[2 * p + 1] = pair[1]
        return values

    @cute.jit
    def stored(self, value: BFloat16):
        """A bf16 gradient as :attr:`grad_dtype` stores it: itself, or ``f16(f32(value))`` (exact but for fp16's
        subnormals and overflow: torch's ``.to(float16)`` of the bf16 tensor)."""
        if cutlass.const_expr(self.grad_dtype is BFloat16):
            return value
        return value.to(Float32).to(Float16)

    @cute.jit
    def store_token_pairs(self, gmem: cute.Tensor, frag: cute.Tensor, coords: cute.Tensor, c0: Int32, head: Int32,
                          row0: Int32, valid_rows: Int32):
        """bf16 C fragment into the token rows ``row0 + r`` (valid rows only) of ``[rows, H, D]`` in
        :attr:`grad_dtype` (:meth:`stored`), 32 bits a store; with :attr:`group_sum` added into them (a bf16x2
        reduction a pair: the two value heads of a group sum in either order to the same bits)."""
        pair = cute.make_rmem_tensor((2,), self.grad_dtype)
        for p in cutlass.range_constexpr(cute.size(frag) // 2):
            r, c = coords[2 * p]
            if r < valid_rows:
                pair[0] = self.stored(frag[2 * p])
                pair[1] = self.stored(frag[2 * p + 1])
                target = cute.local_tile(gmem[row0 + r, head, None], (2,), ((c0 + c) // 2,))
                if cutlass.const_expr(self.group_sum):
                    reduce_add_bf16x2(target.iterator.toint(), cute.recast_tensor(pair, Uint32)[0])
                else:
                    cute.autovec_copy(pair, target)

    @cute.jit
    def beta_backward(self, smem, out: GradsOutputs, head: Int32, row0: Int32, valid_rows: Int32,
                      row: Int32):
        """Row ``row``: ``dβ = Σ_v du·w + Σ_j dL ⊙ A`` (warp partials in order), through the sigmoid."""
        total = smem.dbeta_square[row]
        if cutlass.const_expr(self.beta_logits):
            beta = smem.beta[row]
            total = total * beta * (Float32(1.0) - beta)
        if row < valid_rows:
            out.dbeta[row0 + row, head] = total.to(BFloat16)
