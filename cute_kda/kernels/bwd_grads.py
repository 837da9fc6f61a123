"""Kernel B, the tile gradients: per (16-token tile, head), every per-token gradient of the backward.

Arithmetic: docs/numerics.md, "Backward: Kernel B", operation by operation (the mirror reference
``cute_kda.reference.backward.mirror_bwd_grads`` follows the same page). Shared-memory plan:
``cute_kda.layouts.bwd_grads``.

Tile-parallel: one CTA per (tile slot, head), 4 or 8 warps, no dependence between CTAs. Inputs are what the
forward and the reverse scan left: the state ``S`` entering the tile (the training forward's
checkpoint) and the gradient ``dS'`` leaving it (Kernel A's snapshot), both state images
(:func:`cute_kda.layouts.fwd_recurrence.state_image`); Kernel A's
``du``; dO; the raw q, k, g, v; the workspace's INV, β and gT. Phases (``sync_threads`` between):

1. *Load.* Warp 0 TMA-loads q, k, g, v, dO, du and bulk-copies the two state images behind one transaction
   barrier; the other threads fetch INV, β, gT and their channel's gate constants.
2. *Recompute K1* (:class:`~.common.token_prep.TokenPrep`, the instructions K1 runs): ``G``, the
   l2norm scales, qd, kd, kr and kinv. Invalid rows of v, dO, du are zeroed.
3. *Forward recompute* (warp ``w`` of ``n`` owns value columns ``w·128/n …``, its band): ``kd·S``, ``w = v − kd·S``,
   ``u = bf16(β·w)``, ``U = bf16(INV·u)`` (K2's rounding), ``−bf16(β·du)``, and the per-row partial of
   ``Σ_v du·w``.
4. *16×16 products:* warp 0 ``dMqk = bf16(tril(dO·Uᵀ))``; warp 1 ``dL = −stril(du·Uᵀ)``,
   ``β·dL`` and ``Σ_j dL ⊙ (kd·kinvᵀ)``; the last 2 (of 4) or 4 (of 8) warps ``dgT = Σ_v S ⊙ dS'`` per channel.
5. *Channel products* (warp ``w`` owns the key channels of its band): dqd, dkd, dkinv, dkr, then the
   token gradients of q̂ and k̂, ``dG`` and ``dkr ⊙ kr``, and the per-row l2norm dot products.
6. *Finish:* dq, dk (l2norm backward); per channel (threads 0-127), the reverse cumsum of dG, the gate backward
   (dg, and the tile's partial sums of ddt_bias and dA_log); per row, dβ.

Rows past the end of the sequence are invalid: masked to zero on entry, never written.

A per-head gate (GatedDeltaNet: ``per_head_gate=True``, gate ``"softplus"`` or ``"none"``, optionally grouped value
heads) runs the plan of docs/numerics.md, "Kernel B for a per-head gate": phase 2 recomputes K1's per-head
scheme (one decay per row, the pair decays E, the bf16 rows q̂, k̂), the kinv products give way to the pair
terms ``bf16(E ⊙ dMqk)``, ``bf16(E ⊙ β·dL)`` against q̂, k̂, and phase 6 runs one thread per row: dγ from the row
sums over the channels and the head's crossing pair sums, then the gate backward per (token, head). dq and dk are
written per value head; grouped heads sum them afterwards. Shared-memory plan:
``cute_kda.layouts.bwd_grads.per_head_smem_budget``.

The per-channel unbounded gates (``gate`` "softplus" or "none" with a per-channel g) run the first form of
docs/numerics.md, "Kernel B for the per-channel unbounded gates": phase 2 recomputes K1's dyadic scan per channel
(qd, kd, kr, ``2^G``, ``2^Gs``, and per straddle level the factors and the operands X, Q, unpacked) and K1's A
level by level; the kinv products give way to three 16 × 16 × D products per level against X and Q; phase 6 sums
dγ per channel from the levels' straddle sums and the rows' terms. One CTA per SM
(``cute_kda.layouts.bwd_grads.dyadic_smem_budget``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental.primitives import cp_async_bulk_shared_cluster_global
from cutlass.memory import SmemAllocator

from ..dsl import cute, cutlass
from ..layouts import bwd_grads as plan
from ..layouts.budget import SMEM_CARVEOUT_PERCENT
from ..layouts.fwd_prepare import chunk_tile, compact, gate_cumsum_tile, pair_matrix
from ..layouts.smem import CHUNK, HEAD_DIM, square_tile, square_tile_transposed, sw128_tile_transposed
from ..numerics import DYADIC_BLOCKS, GATES, IMAGE_RUN, LN2, LOG2E
from .common.copy import (
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
from .common.fastmath import ex2_approx
from .common.token_prep import ROW_LANES, ROW_SUMS_THREAD, TokenPrep

K_STEPS = HEAD_DIM // WARP_TILE  # 16-wide contraction steps over a full head dimension


class GradsInputs(NamedTuple):
    """Per-token inputs, tokens flattened (``rows = B·T``); validated by the launcher. ``HV`` value heads (= H
    unless grouped); a per-head gate's g, A_log, dt_bias are per value head (A_log, dt_bias None for gate "none")."""

    q: cute.Tensor  # bf16 [rows, H, D], raw
    k: cute.Tensor  # bf16 [rows, H, D], raw
    g: cute.Tensor  # bf16 [rows, H, D], raw gate; per-head gate: [rows, HV] (bf16, or fp32 log decay)
    v: cute.Tensor  # bf16 [rows, HV, D]
    do: cute.Tensor  # bf16 [rows, HV, D]
    du: cute.Tensor  # bf16 [rows, HV, D], Kernel A's
    a_log: Optional[cute.Tensor]  # fp32 [HV]
    dt_bias: Optional[cute.Tensor]  # fp32 [H, D]; per-head gate: [HV]


class GradsStates(NamedTuple):
    """Per-tile state matrices, ``[H · slots, D, D]`` state images (:func:`cute_kda.layouts.fwd_recurrence.state_image`):
    matrix ``h·slots + g + s``, each loaded by one 1-D bulk copy."""

    state: cute.Tensor  # bf16: S entering the tile (training forward's checkpoints)
    state_grad: cute.Tensor  # bf16: dS' after the tile (Kernel A's snapshots)


class GradsWorkspace(NamedTuple):
    """The K1 workspace fields Kernel B reads (``R = H · tiles`` rows, slot = h·tiles + tile); gT it
    recomputes as K1 does (``2^G_last``, the same instruction on the same value)."""

    inv: cute.Tensor  # bf16 [R, 16, 16]
    beta: cute.Tensor  # fp32 [R, 16]


class GradsOutputs(NamedTuple):
    """Gradients: per token (valid rows only) and per tile slot (every slot written). A per-head gate: dq, dk per
    value head (their group sums are the caller's), dg per (token, value head), the partials per slot; none for
    gate "none"."""

    dq: cute.Tensor  # bf16 [rows, H, D]; per-head gate: [rows, HV, D]
    dk: cute.Tensor  # bf16 [rows, H, D]; per-head gate: [rows, HV, D]
    dg: cute.Tensor  # bf16 [rows, H, D], w.r.t. the raw gate; per-head gate: fp32 [rows, HV]
    dbeta: cute.Tensor  # bf16 [rows, HV], w.r.t. beta as given (logits when beta_logits)
    ddt_partial: Optional[cute.Tensor]  # fp32 [R, D]: Σ over the tile's tokens of dg_raw; per-head gate: [R]
    dalog_partial: Optional[cute.Tensor]  # fp32 [R]: Σ of dx · x (safe) or of dγ · γ (per-head softplus)


class GradsScalars(NamedTuple):
    scale: Float32  # f32(scale)
    c_gate: Float32  # f32(lower_bound · log2(e))
    seq_len: Int32  # T of a fixed-length batch (unused with cu_seqlens)
    state_slots: Int32  # state slots per head (cute_kda.workspace.snapshot_slots)


class GradsSmem(NamedTuple):
    """Shared-memory tensors of one CTA (views named ``*_t`` are transposed views of the same bytes)."""

    q: cute.Tensor
    k: cute.Tensor
    g: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    du: cute.Tensor
    state: cute.Tensor  # [K, V]
    state_t: cute.Tensor  # [V, K]
    state_grad: cute.Tensor  # [K, V]
    qd_t: cute.Tensor
    kd: cute.Tensor
    kd_t: cute.Tensor
    kr: cute.Tensor
    kinv: cute.Tensor
    kinv_t: cute.Tensor
    qd: cute.Tensor
    u_out: cute.Tensor
    neg_bdu: cute.Tensor
    cumsum: cute.Tensor
    dg_cum: cute.Tensor
    dkr_col: cute.Tensor
    inv: cute.Tensor
    dmqk: cute.Tensor
    dmqk_t: cute.Tensor
    dlb: cute.Tensor
    dlb_t: cute.Tensor
    beta: cute.Tensor
    rinv_q: cute.Tensor
    rinv_k: cute.Tensor
    dbeta_square: cute.Tensor
    dbeta_w: cute.Tensor
    dot_q: cute.Tensor
    dot_k: cute.Tensor
    dgt: cute.Tensor
    dalog_w: cute.Tensor


class PerHeadGradsSmem(NamedTuple):
    """Shared-memory tensors of one CTA with a per-head gate (``layouts.bwd_grads.per_head_smem_budget``)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    du: cute.Tensor
    state: cute.Tensor  # [K, V]
    state_t: cute.Tensor  # [V, K]
    state_grad: cute.Tensor  # [K, V]
    qd: cute.Tensor
    kd: cute.Tensor
    kr: cute.Tensor
    k_hat: cute.Tensor
    k_hat_t: cute.Tensor
    q_hat: cute.Tensor
    q_hat_t: cute.Tensor
    u_out: cute.Tensor
    neg_bdu: cute.Tensor
    spans: cute.Tensor
    a_pairs: cute.Tensor
    m_pairs: cute.Tensor
    inv: cute.Tensor
    dmqk: cute.Tensor
    dmqk_t: cute.Tensor
    dlb: cute.Tensor
    dlb_t: cute.Tensor
    beta: cute.Tensor
    rinv_q: cute.Tensor
    rinv_k: cute.Tensor
    dbeta_square: cute.Tensor
    gate: cute.Tensor
    decay: cute.Tensor
    prefix: cute.Tensor
    suffix: cute.Tensor
    dbeta_w: cute.Tensor
    dot_q: cute.Tensor
    dot_k: cute.Tensor
    x_w: cute.Tensor
    y_w: cute.Tensor
    dgt: cute.Tensor


class DyadicGradsSmem(NamedTuple):
    """Shared-memory tensors of one CTA with a per-channel unbounded gate (``layouts.bwd_grads.dyadic_smem_budget``);
    the per-level fields are tuples over the straddle levels."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    du: cute.Tensor
    state: cute.Tensor  # [K, V]
    state_t: cute.Tensor  # [V, K]
    state_grad: cute.Tensor  # [K, V]
    qd: cute.Tensor
    kd: cute.Tensor
    kr: cute.Tensor
    level_x: tuple
    level_x_t: tuple
    level_q: tuple
    level_q_t: tuple
    factors: tuple
    pow_g: cute.Tensor
    pow_gs: cute.Tensor
    level_sums: tuple  # over S's bytes, after the state products
    row_x: cute.Tensor  # over dS''s bytes, after the state products
    row_y: cute.Tensor
    u_out: cute.Tensor
    neg_bdu: cute.Tensor
    a_kk: cute.Tensor
    inv: cute.Tensor
    dmqk: cute.Tensor
    dlb: cute.Tensor
    masked_dlb: tuple
    masked_dlb_t: tuple
    masked_dmqk: tuple
    masked_dmqk_t: tuple
    beta: cute.Tensor
    rinv_q: cute.Tensor
    rinv_k: cute.Tensor
    dbeta_square: cute.Tensor
    dbeta_w: cute.Tensor
    dot_q: cute.Tensor
    dot_k: cute.Tensor
    dgt: cute.Tensor
    dalog_w: cute.Tensor


class UnpackedLevels:
    """Where Kernel B puts channel ``col`` of :meth:`~.common.token_prep.TokenPrep.dyadic_channel_scan` (K1's scan,
    the same instructions): qd, kd over q, k; kr; ``2^G`` and ``2^Gs``; per level the fp32 factors and the bf16
    operands ``X = kh ⊙ factor`` (every row) and ``Q = qh ⊙ factor`` (upper rows, 0 on lower ones), unpacked: row
    r of a level's tile is row r."""

    def __init__(self, smem: "DyadicGradsSmem", col: Int32, scale: Float32, qk_l2norm: bool) -> None:
        self.smem, self.col, self.scale, self.qk_l2norm = smem, col, scale, qk_l2norm

    def q(self, row: int):
        return self.smem.q[row, self.col]

    def k(self, row: int):
        return self.smem.k[row, self.col]

    def q_scale(self, row: int):
        return self.smem.rinv_q[row] * self.scale if self.qk_l2norm else self.scale

    def k_scale(self, row: int):
        return self.smem.rinv_k[row]

    def suffix(self, row: int, kh: Float32, growth: Float32) -> None:
        self.smem.pow_gs[row, self.col] = growth
        self.smem.kr[row, self.col] = (kh * growth).to(BFloat16)

    def prefix(self, row: int, qh: Float32, kh: Float32, decay: Float32) -> None:
        self.smem.pow_g[row, self.col] = decay
        self.smem.q[row, self.col] = (qh * decay).to(BFloat16)
        self.smem.k[row, self.col] = (kh * decay).to(BFloat16)

    def lower(self, level: int, start: int, row: int, factor: Float32, kh: Float32) -> None:
        self.smem.factors[level][row, self.col] = factor
        self.smem.level_x[level][row, self.col] = (kh * factor).to(BFloat16)
        self.smem.level_q[level][row, self.col] = BFloat16(0.0)

    def upper(self, level: int, start: int, row: int, factor: Float32, kh: Float32, qh: Float32) -> None:
        self.smem.factors[level][row, self.col] = factor
        self.smem.level_x[level][row, self.col] = (kh * factor).to(BFloat16)
        self.smem.level_q[level][row, self.col] = (qh * factor).to(BFloat16)


class BwdGrads(TokenPrep):
    """Kernel B. Static configuration: ``varlen``, ``qk_l2norm``, ``beta_logits``; ``compute_warps`` (4 or
    8): warps per CTA, each owning ``128 / compute_warps`` columns in the band phases. ``per_head_gate``:
    GatedDeltaNet's per-head gate, with ``gate`` "softplus" (raw bf16 g, A_log, dt_bias per head) or "none"
    (the log decay, ``gate_dtype`` bf16 or fp32), and ``grouped`` value heads (value head ``h`` reads q/k head
    ``h // (HV / H)``). ``gate`` "softplus" or "none" without ``per_head_gate``: the per-channel unbounded gates
    (Kimi-Linear-48B's softplus, a per-channel log decay), K1's dyadic scheme recomputed (docs/numerics.md,
    "Kernel B for the per-channel unbounded gates"), grouped value heads allowed as well."""

    def __init__(self, *, varlen: bool, qk_l2norm: bool = True, beta_logits: bool = True,
                 compute_warps: int = plan.DEFAULT_WARPS, gate: str = "safe", gate_dtype: type = BFloat16,
                 per_head_gate: bool = False, grouped: bool = False) -> None:
        if compute_warps not in plan.COMPUTE_WARPS:
            raise ValueError(f"compute_warps must be one of {plan.COMPUTE_WARPS}, got {compute_warps}")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if per_head_gate and gate == "safe":
            raise ValueError("a per-head gate is 'softplus' or 'none' (the safe gate is per channel)")
        if grouped and gate == "safe":
            raise NotImplementedError("grouped value heads are built for the unbounded gates only")
        if gate_dtype not in (BFloat16, Float32) or (gate_dtype is Float32 and gate != "none"):
            raise ValueError(f"g is bf16 (or fp32 with gate 'none'), got {gate_dtype} with gate {gate!r}")
        self.gate = gate
        self.gate_dtype = gate_dtype
        self.per_head_gate = per_head_gate
        self.dyadic = gate != "safe" and not per_head_gate  # K1's dyadic scheme per channel
        self.grouped = grouped
        self.varlen = varlen
        self.qk_l2norm = qk_l2norm
        self.beta_logits = beta_logits
        self.warps = compute_warps
        self.band = HEAD_DIM // compute_warps  # columns (value or key channels) one warp owns
        self.dgt_warp = compute_warps // 2  # warps from here on compute dgT in phase 4
        self.num_threads = compute_warps * 32
        self.dim = HEAD_DIM
        self.tile = (CHUNK, HEAD_DIM)
        self.decay_items = CHUNK * ROW_LANES // self.num_threads

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
        stream,
    ) -> None:
        """Launch over ``(tiles, H)``, ``tiles = ws.beta.shape[0] // H``. Tensors C-contiguous with the
        shapes of the argument bundles (dynamic extents); ``cu_seqlens`` int64 / ``tile_base`` int32
        ``[N+1]`` for varlen, else None."""
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
        out = GradsOutputs(
            dq=compact(out.dq, (heads, d)), dk=compact(out.dk, (heads, d)), dg=compact(out.dg, gate_inner),
            dbeta=compact(out.dbeta, (heads,)),
            ddt_partial=compact(out.ddt_partial, () if per_head else (d,)) if with_constants else None,
            dalog_partial=compact(out.dalog_partial, ()) if with_constants else None,
        )
        load = cpasync.CopyBulkTensorTileG2SOp()
        tile = chunk_tile(d)
        token_tiles = ((inputs.q, inputs.k, inputs.v, inputs.do, inputs.du) if per_head or self.dyadic
                       else (inputs.q, inputs.k, inputs.g, inputs.v, inputs.do, inputs.du))
        tma_tokens = tuple(make_head_tile_tma_atom(load, t, tile, self.tile) for t in token_tiles)
        self.shared_storage = plan.shared_storage(self.warps, d, per_head_gate=per_head, dyadic=self.dyadic)
        tiles = ws.beta.shape[0] // heads
        ctas_per_sm = plan.DYADIC_CTAS_PER_SM if self.dyadic else plan.CTAS_PER_SM
        self.kernel(tma_tokens, states, inputs, ws, out, scalars, cu_seqlens, tile_base).launch(
            grid=(tiles, heads, 1), block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=ctas_per_sm,
            preferred_smem_carveout=SMEM_CARVEOUT_PERCENT,
        )

    @cute.kernel
    def kernel(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
               out: GradsOutputs, scalars: GradsScalars, cu_seqlens: Optional[cute.Tensor],
               tile_base: Optional[cute.Tensor]):
        tile_slot, head, _ = cute.arch.block_idx()
        tiles, heads, _ = cute.arch.grid_dim()
        slot = head * tiles + tile_slot
        row0, valid_rows, exists, seq = self.locate_tile(tile_slot, scalars.seq_len, cu_seqlens, tile_base)
        if exists:
            # per-tile state slot (cute_kda.workspace.snapshot_slots with blocks of one tile)
            state_row = head * scalars.state_slots + tile_slot + seq
            qk_head = head // (inputs.v.shape[1] // inputs.q.shape[1]) if cutlass.const_expr(self.grouped) else head
            if cutlass.const_expr(self.per_head_gate):
                self.tile_gradients_per_head(tma_tokens, states, inputs, ws, out, scalars, head, qk_head, slot,
                                             state_row, row0, valid_rows)
            elif cutlass.const_expr(self.dyadic):
                self.tile_gradients_dyadic(tma_tokens, states, inputs, ws, out, scalars, head, qk_head, slot,
                                           state_row, row0, valid_rows)
            else:
                self.tile_gradients(tma_tokens, states, inputs, ws, out, scalars, head, slot, state_row,
                                    row0, valid_rows)
        else:
            self.zero_partials(out, slot)

    @cute.jit
    def zero_partials(self, out: GradsOutputs, slot: Int32):
        """A slot that is no tile (varlen bound) still sums to nothing."""
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.per_head_gate):
            if cutlass.const_expr(self.gate != "none"):
                if tidx == 0:
                    out.ddt_partial[slot] = Float32(0.0)
                    out.dalog_partial[slot] = Float32(0.0)
        elif cutlass.const_expr(self.gate != "none"):
            if tidx < self.dim:
                out.ddt_partial[slot, tidx] = Float32(0.0)
            if tidx == 0:
                out.dalog_partial[slot] = Float32(0.0)

    def make_smem(self, storage) -> GradsSmem:
        tile, tile_t = chunk_tile(self.dim), sw128_tile_transposed(CHUNK, self.dim)
        state, state_t = plan.state_tile(self.dim), plan.state_tile_transposed(self.dim)
        fp32 = gate_cumsum_tile(self.dim)
        sq, sq_t = square_tile(), square_tile_transposed()
        bf16 = BFloat16

        def view(buffer, layout, dtype=bf16):
            return smem_tensor(buffer.data_ptr(), layout, dtype)

        early = storage.vdu_then_dg.inputs_vdu
        # qd, kd, kr are written over q, k, g (smem plan): both names view the same bytes
        return GradsSmem(
            q=view(storage.q, tile), k=view(storage.k, tile), g=view(storage.g, tile), v=view(early.v, tile),
            do=view(storage.do, tile), du=view(early.du, tile),
            state=view(storage.state, state), state_t=view(storage.state, state_t),
            state_grad=view(storage.state_grad, state),
            qd=view(storage.q, tile), qd_t=view(storage.q, tile_t), kd=view(storage.k, tile),
            kd_t=view(storage.k, tile_t), kr=view(storage.g, tile), kinv=view(storage.kinv, tile),
            kinv_t=view(storage.kinv, tile_t), u_out=view(storage.u_out, tile), neg_bdu=view(storage.neg_bdu, tile),
            cumsum=view(storage.cumsum, fp32, Float32), dg_cum=view(storage.vdu_then_dg.dg_cum, fp32, Float32),
            dkr_col=view(storage.dkr_col, plan.vector(self.dim), Float32),
            inv=view(storage.inv, sq), dmqk=view(storage.dmqk, sq), dmqk_t=view(storage.dmqk, sq_t),
            dlb=view(storage.dlb, sq), dlb_t=view(storage.dlb, sq_t),
            beta=view(storage.beta, plan.row_vector(), Float32), rinv_q=view(storage.rinv_q, plan.row_vector(), Float32),
            rinv_k=view(storage.rinv_k, plan.row_vector(), Float32),
            dbeta_square=view(storage.dbeta_square, plan.row_vector(), Float32),
            dbeta_w=view(storage.rows_then_l2norm.dbeta_w, plan.warp_rows(self.warps), Float32),
            dot_q=view(storage.rows_then_l2norm.l2norm_rows.dot_q, plan.warp_rows(self.warps), Float32),
            dot_k=view(storage.rows_then_l2norm.l2norm_rows.dot_k, plan.warp_rows(self.warps), Float32),
            dgt=view(storage.dgt, plan.vector(self.dim), Float32),
            dalog_w=view(storage.dalog_w, plan.vector(plan.CHANNEL_WARPS), Float32),
        )

    def make_per_head_smem(self, storage) -> PerHeadGradsSmem:
        tile, tile_t = chunk_tile(self.dim), sw128_tile_transposed(CHUNK, self.dim)
        state, state_t = plan.state_tile(self.dim), plan.state_tile_transposed(self.dim)
        sq, sq_t = square_tile(), square_tile_transposed()
        pairs, rows, warp_rows = pair_matrix(), plan.row_vector(), plan.warp_rows(self.warps)

        def view(buffer, layout, dtype=BFloat16):
            return smem_tensor(buffer.data_ptr(), layout, dtype)

        l2norm = storage.rows_then_l2norm.l2norm_rows
        # qd, kd are written over q, k (smem plan): both names view the same bytes
        return PerHeadGradsSmem(
            q=view(storage.q, tile), k=view(storage.k, tile), v=view(storage.v, tile), do=view(storage.do, tile),
            du=view(storage.du, tile), state=view(storage.state, state), state_t=view(storage.state, state_t),
            state_grad=view(storage.state_grad, state), qd=view(storage.q, tile), kd=view(storage.k, tile),
            kr=view(storage.kr, tile), k_hat=view(storage.k_hat, tile), k_hat_t=view(storage.k_hat, tile_t),
            q_hat=view(storage.q_hat, tile), q_hat_t=view(storage.q_hat, tile_t), u_out=view(storage.u_out, tile),
            neg_bdu=view(storage.neg_bdu, tile), spans=view(storage.spans, pairs, Float32),
            a_pairs=view(storage.a_pairs, pairs, Float32), m_pairs=view(storage.m_pairs, pairs, Float32),
            inv=view(storage.inv, sq), dmqk=view(storage.dmqk, sq), dmqk_t=view(storage.dmqk, sq_t),
            dlb=view(storage.dlb, sq), dlb_t=view(storage.dlb, sq_t),
            **{name: view(getattr(storage, name), rows, Float32) for name in (
                "beta", "rinv_q", "rinv_k", "dbeta_square", "gate", "decay", "prefix", "suffix")},
            dbeta_w=view(storage.rows_then_l2norm.dbeta_w, warp_rows, Float32),
            dot_q=view(l2norm.dot_q, warp_rows, Float32), dot_k=view(l2norm.dot_k, warp_rows, Float32),
            x_w=view(storage.x_w, warp_rows, Float32), y_w=view(storage.y_w, warp_rows, Float32),
            dgt=view(storage.dgt, plan.vector(self.dim), Float32),
        )

    @cute.jit
    def tile_gradients_per_head(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
                                out: GradsOutputs, scalars: GradsScalars, head: Int32, qk_head: Int32, slot: Int32,
                                state_row: Int32, row0: Int32, valid_rows: Int32):
        """The phases of a per-head gate (module docstring; docs/numerics.md, "Kernel B for a per-head gate")."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        smem = self.make_per_head_smem(storage)
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_tiles(tma_tokens, states, ((smem.q, qk_head), (smem.k, qk_head), (smem.v, head),
                                                     (smem.do, head), (smem.du, head)),
                            (smem.state, smem.state_grad), tma_barrier, row0, state_row)
        # 1. workspace values, the rows' gate while the TMA runs
        self.load_workspace_rows(smem, ws, slot, tidx)
        dt, e_a = Float32(0.0), Float32(1.0)
        if tidx < CHUNK:
            dt, e_a = self.head_gate_row(inputs.g, inputs.a_log, inputs.dt_bias, head, row0, valid_rows, smem.gate,
                                         smem.decay, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it

        # 2. K1's per-head recompute; rows past the sequence end of v, dO, du are zeroed
        if tidx < CHUNK:
            self.span_column(smem.decay, smem.spans, tidx)
        elif tidx == ROW_SUMS_THREAD:
            self.row_sums(smem.gate, smem.prefix, smem.suffix)
        cute.arch.mbarrier_wait(tma_barrier, 0)
        self.zero_invalid_rows(smem, valid_rows, tidx)
        cute.arch.sync_threads()
        self.decay_per_row(smem.q, smem.k, smem.kr, smem.q_hat, smem.k_hat, smem.prefix, smem.suffix, scalars.scale,
                           valid_rows, tidx, smem.rinv_q, smem.rinv_k)
        cute.arch.sync_threads()

        # 3. forward recompute per value band, 4. the 16×16 products with the pair decays, dgT
        self.forward_and_square_products(smem, tidx, warp_idx, lane)

        # 5. channel products per key band, 6. finish per row
        self.channel_band_per_head(smem, inputs, out, scalars, head, qk_head, row0, valid_rows, warp_idx, lane)
        cute.arch.sync_threads()
        if warp_idx == 0:
            self.gate_backward_per_head(smem, inputs, out, head, slot, row0, valid_rows, dt, e_a, lane)
        if tidx < CHUNK:
            self.beta_backward(smem, out, head, row0, valid_rows, tidx)

    @cute.jit
    def tile_gradients(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
                       out: GradsOutputs, scalars: GradsScalars, head: Int32, slot: Int32, state_row: Int32,
                       row0: Int32, valid_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        smem = self.make_smem(storage)
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_tiles(tma_tokens, states, tuple((b, head) for b in (smem.q, smem.k, smem.g, smem.v, smem.do,
                                                                              smem.du)),
                            (smem.state, smem.state_grad), tma_barrier, row0, state_row)
        # 1. workspace values and this thread's channel constants while the TMA runs
        col = tidx % self.dim
        dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, head, col)
        self.load_workspace_rows(smem, ws, slot, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)

        # 2. K1's recompute; rows past the sequence end of v, dO, du are zeroed
        self.zero_invalid_rows(smem, valid_rows, tidx)
        if tidx < self.dim:
            self.gate_scan(smem.g, smem.cumsum, col, dt, e_a, scalars.c_gate, valid_rows)
        cute.arch.sync_threads()
        self.decay(smem.q, smem.k, smem.cumsum, smem.qd, smem.kd, smem.kr, smem.kinv, scalars.scale, valid_rows,
                   tidx, smem.rinv_q, smem.rinv_k)
        cute.arch.sync_threads()

        # 3. forward recompute per value band, 4. the 16×16 products, dgT
        self.forward_and_square_products(smem, tidx, warp_idx, lane)

        # 5. channel products per key band, 6. finish
        self.channel_band(smem, inputs, out, scalars, head, row0, valid_rows, warp_idx, lane)
        cute.arch.sync_threads()
        self.gate_backward(smem, inputs, out, scalars, head, slot, row0, valid_rows, col, dt, e_a, warp_idx, lane)
        if tidx < CHUNK:
            self.beta_backward(smem, out, head, row0, valid_rows, tidx)

    @cute.jit
    def load_tiles(self, tma_tokens: tuple, states: GradsStates, token_buffers: tuple, state_buffers: tuple,
                   tma_barrier, row0: Int32, state_row: Int32):
        """Warp 0: one transaction barrier; the token tiles at token row ``row0`` (``token_buffers``: (smem tile,
        head) in ``tma_tokens``' order), the two state images of row ``state_row`` (one 1-D bulk copy each)."""
        image_elements = self.dim * self.dim
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(tma_barrier, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(
                tma_barrier, plan.load_bytes(self.dim, per_head_gate=self.per_head_gate or self.dyadic))
        for (atom, tma_tensor), (buffer, head) in zip(tma_tokens, token_buffers):
            s_part, g_part = head_tile_tma_partition(
                atom, cute.domain_offset((row0, 0, 0), tma_tensor), buffer, head, self.tile
            )
            cute.copy(atom, g_part[None, 0], s_part, tma_bar_ptr=tma_barrier)
        with cute.arch.elect_one():
            for source, buffer in zip(states, state_buffers):
                image = source.iterator + Int64(state_row) * image_elements
                cp_async_bulk_shared_cluster_global(buffer.iterator, image, tma_barrier, image_elements * 2)

    @cute.jit
    def load_workspace_rows(self, smem, ws: GradsWorkspace, slot: Int32, tidx: Int32):
        """The tile's activated β and INV from the workspace into shared memory (plain loads, during the TMA)."""
        if tidx < CHUNK:
            smem.beta[tidx] = ws.beta[slot, tidx]
        for i in cutlass.range_constexpr(CHUNK * CHUNK // self.num_threads):
            flat = tidx + i * self.num_threads
            smem.inv[flat // CHUNK, flat % CHUNK] = ws.inv[slot, flat // CHUNK, flat % CHUNK]

    @cute.jit
    def forward_and_square_products(self, smem, tidx: Int32, warp_idx: Int32, lane: Int32):
        """Phases 3 and 4, the same for every gate: the forward recompute per value band; then warp 0 ``dMqk``,
        warp 1 ``dL`` (:meth:`masked_do_u`, :meth:`masked_du_u`) and the last warps dgT; a barrier after each."""
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
                    smem.v[row, c] = BFloat16(0.0)
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
        """bf16 C fragment of the ``(16, n)`` smem block ``s_block`` (``ldmatrix``: one instruction a 16×16)."""
        frag = make_fragment(tiled_mma, Operand.C, BFloat16, tile=(CHUNK, cute.size(s_block, mode=[1])))
        copy = ldmatrix_copy(tiled_mma, Operand.C, False)
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
                        False, False, K_STEPS, lane)
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
        self.accumulate(mma, acc, s_left, s_right, False, False, K_STEPS, lane)
        return acc

    @cute.jit
    def masked_do_u(self, smem, lane: Int32):
        """Warp 0: ``dMqk = bf16(tril(dO·Uᵀ))`` (diagonal kept). A per-head gate stores ``bf16(E ⊙ dMqk)`` in its
        place and ``f32(dMqk ⊙ q̂k̂ᵀ)`` for the head's pair sums."""
        mma = warp_tiled_mma(BFloat16, Float32)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        acc = self.square_product(smem.do, smem.u_out, lane)
        dmqk = make_fragment(mma, Operand.C, BFloat16)
        for i in cutlass.range_constexpr(cute.size(acc)):
            row, c = coords[i]
            dmqk[i] = Float32(cutlass.select_(row >= c, acc[i], Float32(0.0))).to(BFloat16)
        if cutlass.const_expr(self.per_head_gate):
            qk = self.square_product(smem.q_hat, smem.k_hat, lane)
            for i in cutlass.range_constexpr(cute.size(acc)):
                row, c = coords[i]
                d_m = dmqk[i].to(Float32)
                smem.m_pairs[row, c] = d_m * qk[i]
                dmqk[i] = (smem.spans[row, c] * d_m).to(BFloat16)  # E is 0 above the diagonal
        self.store_c(mma, dmqk, smem.dmqk, lane)

    @cute.jit
    def masked_du_u(self, smem, lane: Int32):
        """Warp 1: ``dL = −stril(du·Uᵀ)``, ``bf16(β_i·dL_ij)`` into ``dlb``, ``Σ_j dL ⊙ A`` per row with the
        forward's ``A = kd·kinvᵀ`` (the dyadic K1's fp32 level sums with a per-channel unbounded gate). A
        per-head gate: ``A = E ⊙ k̂k̂ᵀ``, ``bf16(E ⊙ bf16(β·dL))`` into ``dlb`` and ``f32(bf16(β·dL) ⊙ k̂k̂ᵀ)`` for
        the head's pair sums."""
        mma = warp_tiled_mma(BFloat16, Float32)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        du_u = self.square_product(smem.du, smem.u_out, lane)
        if cutlass.const_expr(self.per_head_gate):
            a_kk = self.square_product(smem.k_hat, smem.k_hat, lane)
        elif cutlass.const_expr(self.dyadic):
            a_kk = self.lower_pairs(smem.a_kk, coords)
        else:
            a_kk = self.square_product(smem.kd, smem.kinv, lane)
        beta = self.row_values(smem.beta, lane)
        dlb = make_fragment(mma, Operand.C, BFloat16)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_sum.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(du_u)):
            row, c = coords[i]
            h = c_row_half(i)
            d_l = Float32(cutlass.select_(row > c, -du_u[i], Float32(0.0)))
            dlb[i] = (beta[h] * d_l).to(BFloat16)
            if cutlass.const_expr(self.per_head_gate):
                span = smem.spans[row, c]
                d_a = dlb[i].to(Float32)
                row_sum[h] = row_sum[h] + d_l * (span * a_kk[i])
                smem.a_pairs[row, c] = d_a * a_kk[i]
                dlb[i] = (span * d_a).to(BFloat16)
            else:
                row_sum[h] = row_sum[h] + d_l * a_kk[i]
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
    def channel_band(self, smem: GradsSmem, inputs: GradsInputs, out: GradsOutputs, scalars: GradsScalars,
                     head: Int32, row0: Int32, valid_rows: Int32, warp_idx: Int32, lane: Int32):
        """Key band of warp ``w``: dqd, dkd, dkinv, dkr; the q̂ / k̂ gradients; ``dG`` and ``dkr ⊙ kr``;
        the l2norm backward (after the row dot products of all warps)."""
        band = self.band
        mma = warp_tiled_mma(BFloat16, Float32, band)
        c0 = warp_idx * band
        shape = (CHUNK, band)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor(shape))
        s_band = cute.local_tile(smem.state, (band, self.dim), (warp_idx, 0))
        kinv_band = cute.local_tile(smem.kinv_t, (band, CHUNK), (warp_idx, 0))
        ln2 = Float32(LN2)
        # two passes of two accumulators each (register pressure): dqd and dkd, then dkinv and dkr
        d_qd = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_kd = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_qd.fill(0.0)
        d_kd.fill(0.0)
        self.accumulate(mma, d_qd, smem.do, s_band, False, True, K_STEPS, lane)
        self.accumulate(mma, d_qd, smem.dmqk, kinv_band, False, True, 1, lane)
        self.accumulate(mma, d_kd, smem.neg_bdu, s_band, False, True, K_STEPS, lane)
        self.accumulate(mma, d_kd, smem.dlb, kinv_band, False, True, 1, lane)
        qd = self.load_c(mma, cute.local_tile(smem.qd, shape, (0, warp_idx)), lane)
        kd = self.load_c(mma, cute.local_tile(smem.kd, shape, (0, warp_idx)), lane)
        cum = self.load_pairs(smem.cumsum, coords, c0, lane)
        dq_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_g = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(d_qd)):
            decay = ex2_approx(cum[i])
            dq_hat[i] = d_qd[i] * decay * scalars.scale
            dk_hat[i] = d_kd[i] * decay
            d_g[i] = d_qd[i] * qd[i].to(Float32) + d_kd[i] * kd[i].to(Float32)

        d_kinv = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_kr = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_kinv.fill(0.0)
        d_kr.fill(0.0)
        self.accumulate(mma, d_kinv, smem.dmqk_t, cute.local_tile(smem.qd_t, (band, CHUNK), (warp_idx, 0)),
                        True, True, 1, lane)
        self.accumulate(mma, d_kinv, smem.dlb_t, cute.local_tile(smem.kd_t, (band, CHUNK), (warp_idx, 0)),
                        True, True, 1, lane)
        self.accumulate(mma, d_kr, smem.u_out, cute.local_tile(smem.state_grad, (band, self.dim), (warp_idx, 0)),
                        False, True, K_STEPS, lane)
        kinv = self.load_c(mma, cute.local_tile(smem.kinv, shape, (0, warp_idx)), lane)
        kr = self.load_c(mma, cute.local_tile(smem.kr, shape, (0, warp_idx)), lane)
        cum_last = self.load_pairs(smem.cumsum, coords, c0, lane, row=CHUNK - 1)
        dkr_kr = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(d_kr)):
            # dk̂ = dkd·2^G + dkinv·2^-G + dkr·2^(G_last − G), summed in this order
            dk_hat[i] = (dk_hat[i] + d_kinv[i] * ex2_approx(-cum[i])
                         + d_kr[i] * ex2_approx(cum_last[i] - cum[i]))
            dkr_kr[i] = d_kr[i] * kr[i].to(Float32)
            d_g[i] = ln2 * (d_g[i] - d_kinv[i] * kinv[i].to(Float32) - dkr_kr[i])
        self.store_pairs(smem.dg_cum, d_g, coords, c0)
        self.store_column_sums(smem.dkr_col, dkr_kr, coords, c0, lane)

        self.store_token_gradients(smem, inputs, out, dq_hat, dk_hat, coords, c0, head, head, row0, valid_rows,
                                   warp_idx, lane)

    @cute.jit
    def channel_band_per_head(self, smem: PerHeadGradsSmem, inputs: GradsInputs, out: GradsOutputs,
                              scalars: GradsScalars, head: Int32, qk_head: Int32, row0: Int32, valid_rows: Int32,
                              warp_idx: Int32, lane: Int32):
        """Key band of warp ``w`` with a per-head gate: dqd, dkd, dkr; the pair terms ``bf16(E ⊙ dMqk)·k̂`` and
        ``[dP | dPᵀ | dPqᵀ]·[k̂; k̂; q̂]``; the q̂ / k̂ gradients; the per-row channel sums of ``dqd⊙qd + dkd⊙kd``
        and ``dkr⊙kr`` for dγ; then dq, dk (:meth:`store_token_gradients`)."""
        band = self.band
        mma = warp_tiled_mma(BFloat16, Float32, band)
        c0 = warp_idx * band
        shape = (CHUNK, band)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor(shape))
        s_band = cute.local_tile(smem.state, (band, self.dim), (warp_idx, 0))
        k_hat_band = cute.local_tile(smem.k_hat_t, (band, CHUNK), (warp_idx, 0))
        q_hat_band = cute.local_tile(smem.q_hat_t, (band, CHUNK), (warp_idx, 0))
        d_qd = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_kd = make_fragment(mma, Operand.C, Float32, tile=shape)
        pair_q = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_qd.fill(0.0)
        d_kd.fill(0.0)
        pair_q.fill(0.0)
        self.accumulate(mma, d_qd, smem.do, s_band, False, True, K_STEPS, lane)
        self.accumulate(mma, d_kd, smem.neg_bdu, s_band, False, True, K_STEPS, lane)
        self.accumulate(mma, pair_q, smem.dmqk, k_hat_band, False, True, 1, lane)
        qd = self.load_c(mma, cute.local_tile(smem.qd, shape, (0, warp_idx)), lane)
        kd = self.load_c(mma, cute.local_tile(smem.kd, shape, (0, warp_idx)), lane)
        prefix = self.row_values(smem.prefix, lane)
        suffix = self.row_values(smem.suffix, lane)
        dq_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        x_sum = cute.make_rmem_tensor((2,), Float32)  # rows g and g + 8 of this lane
        y_sum = cute.make_rmem_tensor((2,), Float32)
        x_sum.fill(0.0)
        y_sum.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(d_qd)):
            h = c_row_half(i)
            dq_hat[i] = (pair_q[i] + d_qd[i] * prefix[h]) * scalars.scale
            dk_hat[i] = d_kd[i] * prefix[h]
            x_sum[h] = x_sum[h] + (d_qd[i] * qd[i].to(Float32) + d_kd[i] * kd[i].to(Float32))

        pair_k = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_kr = make_fragment(mma, Operand.C, Float32, tile=shape)
        pair_k.fill(0.0)
        d_kr.fill(0.0)
        self.accumulate(mma, pair_k, smem.dlb, k_hat_band, False, True, 1, lane)
        self.accumulate(mma, pair_k, smem.dlb_t, k_hat_band, True, True, 1, lane)
        self.accumulate(mma, pair_k, smem.dmqk_t, q_hat_band, True, True, 1, lane)
        self.accumulate(mma, d_kr, smem.u_out, cute.local_tile(smem.state_grad, (band, self.dim), (warp_idx, 0)),
                        False, True, K_STEPS, lane)
        kr = self.load_c(mma, cute.local_tile(smem.kr, shape, (0, warp_idx)), lane)
        for i in cutlass.range_constexpr(cute.size(d_kr)):
            h = c_row_half(i)
            # dk̂ = (pair + dkd·2^G) + dkr·2^Gs, the mirror's order
            dk_hat[i] = (pair_k[i] + dk_hat[i]) + d_kr[i] * suffix[h]
            y_sum[h] = y_sum[h] + d_kr[i] * kr[i].to(Float32)
        self.store_row_partials(smem.x_w, x_sum, warp_idx, lane)
        self.store_row_partials(smem.y_w, y_sum, warp_idx, lane)
        self.store_token_gradients(smem, inputs, out, dq_hat, dk_hat, coords, c0, qk_head, head, row0, valid_rows,
                                   warp_idx, lane)

    @cute.jit
    def gate_backward_per_head(self, smem: PerHeadGradsSmem, inputs: GradsInputs, out: GradsOutputs, head: Int32,
                               slot: Int32, row0: Int32, valid_rows: Int32, dt: Float32, e_a: Float32, lane: Int32):
        """Warp 0, lane ``s`` < 16 a row: ``dγ_s = Σ_{r≥s} X_r + Σ_{r<s} Y_r + gT·Σ_c dgT_c + Σ_{i≥s>j} W_ij``
        (``X``, ``Y`` the channel sums of phase 5 over the warps in warp order; ``W = E ⊙ (dA ⊙ k̂k̂ᵀ + dMqk ⊙ q̂k̂ᵀ)``
        the head's pairs), then ``dg = dγ`` (log decay) or ``dx = −e^A·σ(g + dt_bias)·dγ``; the tile's partial
        sums of ddt_bias (``Σ dx``) and dA_log (``Σ dγ·γ``, ``γ = g'·ln 2``) over its rows, lanes in order."""
        ddt = Float32(0.0)
        dalog = Float32(0.0)
        dgt_sum = Float32(0.0)  # Σ_c dgT_c: 4 channels a lane, then the butterfly (every lane holds the total)
        for part in cutlass.range_constexpr(self.dim // 32):
            dgt_sum = dgt_sum + smem.dgt[lane + 32 * part]
        for offset in (16, 8, 4, 2, 1):
            dgt_sum = dgt_sum + cute.arch.shuffle_sync_bfly(dgt_sum, offset=offset)
        if lane < CHUNK:
            s = lane
            from_s = Float32(0.0)
            before_s = Float32(0.0)
            for r in cutlass.range_constexpr(CHUNK):
                x_r = Float32(0.0)
                y_r = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    x_r = x_r + smem.x_w[w, r]
                    y_r = y_r + smem.y_w[w, r]
                from_s = from_s + Float32(cutlass.select_(r >= s, x_r, Float32(0.0)))
                before_s = before_s + Float32(cutlass.select_(r < s, y_r, Float32(0.0)))
            pairs = Float32(0.0)
            for i in cutlass.range_constexpr(1, CHUNK):
                for j in cutlass.range_constexpr(i):  # i > j: the strictly lower pairs; those with i ≥ s > j count
                    w_ij = smem.spans[i, j] * (smem.a_pairs[i, j] + smem.m_pairs[i, j])
                    crossing = Float32(cutlass.select_(s > j, w_ij, Float32(0.0)))
                    pairs = pairs + Float32(cutlass.select_(s <= i, crossing, Float32(0.0)))
            dgamma = ((from_s + before_s) + smem.prefix[CHUNK - 1] * dgt_sum) + pairs
            if s < valid_rows:
                dg = dgamma
                if cutlass.const_expr(self.gate == "softplus"):
                    dg = self.softplus_gate_grad(inputs.g[row0 + s, head].to(Float32), dt, e_a, dgamma)
                    ddt = dg
                    dalog = dgamma * (smem.gate[s] * Float32(LN2))
                out.dg[row0 + s, head] = dg
        if cutlass.const_expr(self.gate == "softplus"):
            for offset in (16, 8, 4, 2, 1):
                ddt = ddt + cute.arch.shuffle_sync_bfly(ddt, offset=offset)
                dalog = dalog + cute.arch.shuffle_sync_bfly(dalog, offset=offset)
            if lane == 0:
                out.ddt_partial[slot] = ddt
                out.dalog_partial[slot] = dalog

    @cute.jit
    def softplus_gate_grad(self, g_raw: Float32, dt: Float32, e_a: Float32, dgamma: Float32) -> Float32:
        """``dg = −e^A·σ(g + dt_bias)·dγ``, the softplus gate's backward; ``σ`` as ``1 / (1 + 2^(−x·log2 e))``,
        accurate in relative terms where it saturates."""
        x = g_raw + dt
        sigmoid = Float32(1.0) / (Float32(1.0) + ex2_approx(-(x * Float32(LOG2E))))
        return -(e_a * sigmoid) * dgamma

    @cute.jit
    def store_token_gradients(self, smem, inputs: GradsInputs, out: GradsOutputs, dq_hat: cute.Tensor,
                              dk_hat: cute.Tensor, coords: cute.Tensor, c0: Int32, qk_head: Int32, head: Int32,
                              row0: Int32, valid_rows: Int32, warp_idx: Int32, lane: Int32):
        """dq, dk of the warp's key band from the gradients of q̂, k̂ (fp32 C fragments): the l2norm backward
        (the row dot products of all warps, a barrier, the raw q, k of q/k head ``qk_head`` read back from L2),
        stored at (value) head ``head``."""
        band = self.band
        mma = warp_tiled_mma(BFloat16, Float32, band)
        shape = (CHUNK, band)
        dq = make_fragment(mma, Operand.C, BFloat16, tile=shape)
        dk = make_fragment(mma, Operand.C, BFloat16, tile=shape)
        if cutlass.const_expr(self.qk_l2norm):
            # raw q, k back from global memory (L2): their smem tiles hold qd, kd now
            q = self.load_token_pairs(inputs.q, coords, c0, qk_head, row0, valid_rows)
            k = self.load_token_pairs(inputs.k, coords, c0, qk_head, row0, valid_rows)
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
        self.store_token_pairs(out.dq, dq, coords, c0, head, row0, valid_rows)
        self.store_token_pairs(out.dk, dk, coords, c0, head, row0, valid_rows)

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
    def store_column_sums(self, s_cols: cute.Tensor, frag: cute.Tensor, coords: cute.Tensor, c0: Int32, lane: Int32):
        """``s_cols[c0 + c] = Σ_r frag[r, c]`` over the 16 rows of a fp32 C fragment: the lane's two rows,
        then the 8 lanes that share its columns (``shfl.xor`` 4, 8, 16); lanes 0-3 write."""
        for a in cutlass.range_constexpr(cute.size(frag) // 4):
            for e in cutlass.range_constexpr(2):
                total = frag[e + 4 * a] + frag[e + 2 + 4 * a]  # rows g and g + 8
                for offset in (4, 8, 16):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
                _, c = coords[e + 4 * a]
                if lane < 4:
                    s_cols[c0 + c] = total

    @cute.jit
    def load_token_pairs(self, gmem: cute.Tensor, coords: cute.Tensor, c0: Int32, head: Int32, row0: Int32,
                         valid_rows: Int32) -> cute.Tensor:
        """bf16 values of the token rows ``row0 + r`` of ``[rows, H, D]`` at a C fragment's positions, 32 bits a
        load; rows past the sequence end read as 0 (they may lie past the tensor)."""
        values = cute.make_rmem_tensor(cute.size(coords), BFloat16)
        pair = cute.make_rmem_tensor((2,), BFloat16)
        for p in cutlass.range_constexpr(cute.size(coords) // 2):
            r, c = coords[2 * p]
            pair.fill(0.0)
            if r < valid_rows:
                cute.autovec_copy(cute.local_tile(gmem[row0 + r, head, None], (2,), ((c0 + c) // 2,)), pair)
            values[2 * p] = pair[0]
            values[2 * p + 1] = pair[1]
        return values

    @cute.jit
    def store_token_pairs(self, gmem: cute.Tensor, frag: cute.Tensor, coords: cute.Tensor, c0: Int32, head: Int32,
                          row0: Int32, valid_rows: Int32):
        """bf16 C fragment into the token rows ``row0 + r`` (valid rows only) of ``[rows, H, D]``, 32 bits a store."""
        pair = cute.make_rmem_tensor((2,), BFloat16)
        for p in cutlass.range_constexpr(cute.size(frag) // 2):
            r, c = coords[2 * p]
            if r < valid_rows:
                pair[0] = frag[2 * p]
                pair[1] = frag[2 * p + 1]
                cute.autovec_copy(pair, cute.local_tile(gmem[row0 + r, head, None], (2,), ((c0 + c) // 2,)))

    @cute.jit
    def gate_backward(self, smem: GradsSmem, inputs: GradsInputs, out: GradsOutputs, scalars: GradsScalars,
                      head: Int32, slot: Int32, row0: Int32, valid_rows: Int32, col: Int32, dt: Float32,
                      e_a: Float32, warp_idx: Int32, lane: Int32):
        """Channel ``col``: ``dg' = Σ_{s≥r} dG_s + dG_last`` (reverse cumsum), the gate backward to the raw
        gate, and the tile's partial sums of ddt_bias (per channel) and dA_log (over channels, warp order)."""
        if warp_idx < plan.CHANNEL_WARPS:  # one thread per channel
            gate_total = ex2_approx(smem.cumsum[CHUNK - 1, col])  # gT, as K1 computes it
            d_last = Float32(LN2) * (smem.dkr_col[col] + smem.dgt[col] * gate_total)
            suffix = Float32(0.0)
            ddt = Float32(0.0)
            dalog = Float32(0.0)
            for step in cutlass.range_constexpr(CHUNK):
                row = CHUNK - 1 - step
                if row < valid_rows:
                    suffix = suffix + smem.dg_cum[row, col]
                    # raw g from global memory (L2): its smem tile holds kr now
                    x = e_a * (inputs.g[row0 + row, head, col].to(Float32) + dt)
                    # σ'(x) = σ(x)·σ(−x), each factor from ex2: σ·(1 − σ) of the tanh form cancels where it saturates
                    scaled = x * Float32(LOG2E)
                    dsig = (Float32(1.0) / (Float32(1.0) + ex2_approx(-scaled))) * (
                        Float32(1.0) / (Float32(1.0) + ex2_approx(scaled)))
                    dx = (suffix + d_last) * scalars.c_gate * dsig
                    dg_raw = dx * e_a
                    out.dg[row0 + row, head, col] = dg_raw.to(BFloat16)
                    ddt = ddt + dg_raw
                    dalog = dalog + dx * x
            out.ddt_partial[slot, col] = ddt
            for offset in (16, 8, 4, 2, 1):
                dalog = dalog + cute.arch.shuffle_sync_bfly(dalog, offset=offset)
            if lane == 0:
                smem.dalog_w[warp_idx] = dalog
        cute.arch.sync_threads()
        if warp_idx == 0 and lane == 0:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(plan.CHANNEL_WARPS):
                total = total + smem.dalog_w[w]
            out.dalog_partial[slot] = total

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

    # -------------------------------------------------------------------------------------------
    # the per-channel unbounded gates: docs/numerics.md, "Kernel B for the per-channel unbounded gates"

    def make_dyadic_smem(self, storage) -> DyadicGradsSmem:
        tile, tile_t = chunk_tile(self.dim), sw128_tile_transposed(CHUNK, self.dim)
        state, state_t = plan.state_tile(self.dim), plan.state_tile_transposed(self.dim)
        fp32 = gate_cumsum_tile(self.dim)
        sq, sq_t = square_tile(), square_tile_transposed()
        rows, warp_rows = plan.row_vector(), plan.warp_rows(self.warps)
        levels = range(plan.DYADIC_LEVELS)

        def view(buffer, layout, dtype=BFloat16):
            return smem_tensor(buffer.data_ptr(), layout, dtype)

        def per_level(prefix: str, layout, dtype=BFloat16, group=storage) -> tuple:
            return tuple(view(getattr(group, f"{prefix}{ell}"), layout, dtype) for ell in levels)

        state_space = storage.state_then_level_sums
        grad_space = storage.state_grad_then_row_terms
        l2norm = storage.rows_then_l2norm.l2norm_rows
        # qd, kd are written over q, k (smem plan): both names view the same bytes
        return DyadicGradsSmem(
            q=view(storage.q, tile), k=view(storage.k, tile), v=view(storage.v, tile), do=view(storage.do, tile),
            du=view(storage.du, tile), state=view(state_space.state, state), state_t=view(state_space.state, state_t),
            state_grad=view(grad_space.state_grad, state), qd=view(storage.q, tile), kd=view(storage.k, tile),
            kr=view(storage.kr, tile), level_x=per_level("level_x", tile), level_x_t=per_level("level_x", tile_t),
            level_q=per_level("level_q", tile), level_q_t=per_level("level_q", tile_t),
            factors=per_level("factor", fp32, Float32), pow_g=view(storage.pow_g, fp32, Float32),
            pow_gs=view(storage.pow_gs, fp32, Float32),
            level_sums=per_level("level_sum", fp32, Float32, state_space.level_sums),
            row_x=view(grad_space.row_terms.row_x, fp32, Float32), row_y=view(grad_space.row_terms.row_y, fp32, Float32),
            u_out=view(storage.u_out, tile), neg_bdu=view(storage.neg_bdu, tile),
            a_kk=view(storage.a_kk, pair_matrix(), Float32), inv=view(storage.inv, sq), dmqk=view(storage.dmqk, sq),
            dlb=view(storage.dlb, sq), masked_dlb=per_level("masked_dlb", sq), masked_dlb_t=per_level("masked_dlb", sq_t),
            masked_dmqk=per_level("masked_dmqk", sq), masked_dmqk_t=per_level("masked_dmqk", sq_t),
            **{name: view(getattr(storage, name), rows, Float32) for name in plan.ROW_VECTORS},
            dbeta_w=view(storage.rows_then_l2norm.dbeta_w, warp_rows, Float32),
            dot_q=view(l2norm.dot_q, warp_rows, Float32), dot_k=view(l2norm.dot_k, warp_rows, Float32),
            dgt=view(storage.dgt, plan.vector(self.dim), Float32),
            dalog_w=view(storage.dalog_w, plan.vector(plan.CHANNEL_WARPS), Float32),
        )

    @cute.jit
    def tile_gradients_dyadic(self, tma_tokens: tuple, states: GradsStates, inputs: GradsInputs, ws: GradsWorkspace,
                              out: GradsOutputs, scalars: GradsScalars, head: Int32, qk_head: Int32, slot: Int32,
                              state_row: Int32, row0: Int32, valid_rows: Int32):
        """The phases of a per-channel unbounded gate (module docstring; docs/numerics.md, "Kernel B for the
        per-channel unbounded gates")."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        smem = self.make_dyadic_smem(storage)
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_tiles(tma_tokens, states, ((smem.q, qk_head), (smem.k, qk_head), (smem.v, head),
                                                     (smem.do, head), (smem.du, head)),
                            (smem.state, smem.state_grad), tma_barrier, row0, state_row)
        # 1. workspace values, this thread's channel of g and its gate constants while the TMA runs
        col = tidx % self.dim
        gate_in = self.load_gate_column(inputs.g, head, row0, valid_rows, col)
        dt, e_a = Float32(0.0), Float32(1.0)
        if cutlass.const_expr(self.gate != "none"):
            dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, head, col)
        self.load_workspace_rows(smem, ws, slot, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)

        # 2. K1's dyadic recompute: the rows' l2norm scales, the channel scan, the levels' A; rows past the sequence
        # end of v, dO, du are zeroed
        self.zero_invalid_rows(smem, valid_rows, tidx)
        self.row_norms(smem, scalars.scale, valid_rows, tidx)
        cute.arch.sync_threads()
        if tidx < self.dim:
            self.dyadic_channel_scan(UnpackedLevels(smem, col, scalars.scale, self.qk_l2norm), gate_in, dt, e_a,
                                     valid_rows)
        cute.arch.sync_threads()
        for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
            if warp_idx == level:
                self.level_pairs(level, smem, lane)

        # 3. forward recompute per value band, 4. the 16×16 products, dgT; then the levels' masked dA, dMqk
        self.forward_and_square_products(smem, tidx, warp_idx, lane)
        for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
            if warp_idx == level:
                self.mask_level(level, smem, lane)
        cute.arch.sync_threads()

        # 5. channel products per key band, 6. finish per channel and per row
        self.channel_band_dyadic(smem, inputs, out, scalars, head, qk_head, row0, valid_rows, warp_idx, lane)
        cute.arch.sync_threads()
        self.gate_backward_dyadic(smem, inputs, out, head, slot, row0, valid_rows, col, dt, e_a, warp_idx, lane)
        if tidx < CHUNK:
            self.beta_backward(smem, out, head, row0, valid_rows, tidx)

    @cute.jit
    def row_norms(self, smem: DyadicGradsSmem, scale: Float32, valid_rows: Int32, tidx: Int32):
        """Per row the l2norm's ``rinv_q`` and ``rinv_k``, as K1's row phase computes them (without l2norm none: no
        phase reads them then)."""
        for item in cutlass.range_constexpr(self.decay_items):
            row, chunk = self.row_chunk(tidx, item)
            q_in, k_in = self.load_row_chunk(smem.q, smem.k, row, chunk)
            _, _, q_rinv, _, k_rscale = self.chunk_scales(q_in, k_in, row < valid_rows, scale)
            self.store_row_rinv(smem.rinv_q, smem.rinv_k, row, chunk, q_rinv, k_rscale)

    @cute.jit
    def straddles(self, level: int, row: Int32, c: Int32):
        """Whether the pair (row, c) straddles level ``level``'s middle row: one block, row upper, c lower."""
        block = DYADIC_BLOCKS[level]
        half = block // 2
        return (row // block == c // block) & (row % block >= half) & (c % block < half)

    @cute.jit
    def level_pairs(self, level: int, smem: DyadicGradsSmem, lane: Int32):
        """One warp: level ``level``'s part of K1's ``A``: ``X·Xᵀ`` (fp32) on the pairs that straddle it, into
        ``a_kk`` (over the four levels every pair i > j is written once)."""
        mma = warp_tiled_mma(BFloat16, Float32)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        product = self.square_product(smem.level_x[level], smem.level_x[level], lane)
        for i in cutlass.range_constexpr(cute.size(product)):
            row, c = coords[i]
            if self.straddles(level, row, c):
                smem.a_kk[row, c] = product[i]

    @cute.jit
    def lower_pairs(self, s_pairs: cute.Tensor, coords: cute.Tensor) -> cute.Tensor:
        """fp32 C fragment of ``s_pairs`` strictly below the diagonal, 0 on and above it (never read there)."""
        values = cute.make_rmem_tensor(cute.size(coords), Float32)
        for i in cutlass.range_constexpr(cute.size(coords)):
            row, c = coords[i]
            value = Float32(0.0)
            if row > c:
                value = s_pairs[row, c]
            values[i] = value
        return values

    @cute.jit
    def mask_level(self, level: int, smem: DyadicGradsSmem, lane: Int32):
        """One warp: ``dA_ℓ = mask_ℓ ⊙ bf16(β·dL)`` and ``dM_ℓ = mask_ℓ ⊙ dMqk`` (the pairs that straddle level ℓ)."""
        for e in cutlass.range_constexpr(CHUNK * CHUNK // 32):
            flat = lane + 32 * e
            row, c = flat // CHUNK, flat % CHUNK
            inside = self.straddles(level, row, c)
            smem.masked_dlb[level][row, c] = Float32(
                cutlass.select_(inside, smem.dlb[row, c].to(Float32), Float32(0.0))).to(BFloat16)
            smem.masked_dmqk[level][row, c] = Float32(
                cutlass.select_(inside, smem.dmqk[row, c].to(Float32), Float32(0.0))).to(BFloat16)

    @cute.jit
    def channel_band_dyadic(self, smem: DyadicGradsSmem, inputs: GradsInputs, out: GradsOutputs,
                            scalars: GradsScalars, head: Int32, qk_head: Int32, row0: Int32, valid_rows: Int32,
                            warp_idx: Int32, lane: Int32):
        """Key band of warp ``w`` with a per-channel unbounded gate: the state products dqd, dkd, dkr (then a
        barrier: S and dS' are dead); Mqk's diagonal terms; per level ``P = dA_ℓ X``, ``Pq = dM_ℓ X``,
        ``C = dA_ℓᵀ X + dM_ℓᵀ Q``, ``dq̂ += factor ⊙ Pq``, ``dk̂ += factor ⊙ (P + C)`` and the level's pair sums
        ``X⊙P + Q⊙Pq + X⊙C`` into S's bytes; ``dq̂ = (… + dqd ⊙ 2^G)·scale``, ``dk̂ = (… + dkd ⊙ 2^G) + dkr ⊙ 2^Gs``;
        the rows' terms into dS''s bytes; then dq, dk (:meth:`store_token_gradients`)."""
        band = self.band
        mma = warp_tiled_mma(BFloat16, Float32, band)
        c0 = warp_idx * band
        shape = (CHUNK, band)
        coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor(shape))
        s_band = cute.local_tile(smem.state, (band, self.dim), (warp_idx, 0))
        d_qd = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_kd = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_kr = make_fragment(mma, Operand.C, Float32, tile=shape)
        d_qd.fill(0.0)
        d_kd.fill(0.0)
        d_kr.fill(0.0)
        self.accumulate(mma, d_qd, smem.do, s_band, False, True, K_STEPS, lane)
        self.accumulate(mma, d_kd, smem.neg_bdu, s_band, False, True, K_STEPS, lane)
        self.accumulate(mma, d_kr, smem.u_out, cute.local_tile(smem.state_grad, (band, self.dim), (warp_idx, 0)),
                        False, True, K_STEPS, lane)
        cute.arch.sync_threads()  # every warp's reads of S and dS' are done: their bytes take the sums below

        # Mqk's diagonal: dqh += dMqk_ii·kh_i, dkh += dMqk_ii·qh_i (kh, qh from the raw q, k in L2)
        q = self.load_token_pairs(inputs.q, coords, c0, qk_head, row0, valid_rows)
        k = self.load_token_pairs(inputs.k, coords, c0, qk_head, row0, valid_rows)
        rinv_q, rinv_k = self.row_values(smem.rinv_q, lane), self.row_values(smem.rinv_k, lane)
        diagonal = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            row = lane // 4 + 8 * h
            diagonal[h] = smem.dmqk[row, row].to(Float32)
        dq_pairs = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_pairs = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(dq_pairs)):
            h = c_row_half(i)
            q_rscale = rinv_q[h] * scalars.scale if cutlass.const_expr(self.qk_l2norm) else scalars.scale
            k_hat = k[i].to(Float32) * rinv_k[h] if cutlass.const_expr(self.qk_l2norm) else k[i].to(Float32)
            dq_pairs[i] = diagonal[h] * k_hat
            dk_pairs[i] = diagonal[h] * (q[i].to(Float32) * q_rscale)

        for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
            x_band = cute.local_tile(smem.level_x_t[level], (band, CHUNK), (warp_idx, 0))
            q_band = cute.local_tile(smem.level_q_t[level], (band, CHUNK), (warp_idx, 0))
            p = make_fragment(mma, Operand.C, Float32, tile=shape)
            pq = make_fragment(mma, Operand.C, Float32, tile=shape)
            cross = make_fragment(mma, Operand.C, Float32, tile=shape)
            p.fill(0.0)
            pq.fill(0.0)
            cross.fill(0.0)
            self.accumulate(mma, p, smem.masked_dlb[level], x_band, False, True, 1, lane)
            self.accumulate(mma, pq, smem.masked_dmqk[level], x_band, False, True, 1, lane)
            self.accumulate(mma, cross, smem.masked_dlb_t[level], x_band, True, True, 1, lane)
            self.accumulate(mma, cross, smem.masked_dmqk_t[level], q_band, True, True, 1, lane)
            x = self.load_c(mma, cute.local_tile(smem.level_x[level], shape, (0, warp_idx)), lane)
            q_op = self.load_c(mma, cute.local_tile(smem.level_q[level], shape, (0, warp_idx)), lane)
            factor = self.load_pairs(smem.factors[level], coords, c0, lane)
            sums = make_fragment(mma, Operand.C, Float32, tile=shape)
            for i in cutlass.range_constexpr(cute.size(p)):
                x_i = x[i].to(Float32)
                dq_pairs[i] = dq_pairs[i] + factor[i] * pq[i]
                dk_pairs[i] = dk_pairs[i] + factor[i] * (p[i] + cross[i])
                # P, Pq vanish on lower rows and C on upper ones: one tile holds both halves' sums
                sums[i] = (x_i * p[i] + q_op[i].to(Float32) * pq[i]) + x_i * cross[i]
            self.store_pairs(smem.level_sums[level], sums, coords, c0)

        qd = self.load_c(mma, cute.local_tile(smem.qd, shape, (0, warp_idx)), lane)
        kd = self.load_c(mma, cute.local_tile(smem.kd, shape, (0, warp_idx)), lane)
        kr = self.load_c(mma, cute.local_tile(smem.kr, shape, (0, warp_idx)), lane)
        pow_g = self.load_pairs(smem.pow_g, coords, c0, lane)
        pow_gs = self.load_pairs(smem.pow_gs, coords, c0, lane)
        dq_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        dk_hat = make_fragment(mma, Operand.C, Float32, tile=shape)
        row_x = make_fragment(mma, Operand.C, Float32, tile=shape)
        row_y = make_fragment(mma, Operand.C, Float32, tile=shape)
        for i in cutlass.range_constexpr(cute.size(d_qd)):
            dq_hat[i] = (dq_pairs[i] + d_qd[i] * pow_g[i]) * scalars.scale
            dk_hat[i] = (dk_pairs[i] + d_kd[i] * pow_g[i]) + d_kr[i] * pow_gs[i]
            row_x[i] = d_qd[i] * qd[i].to(Float32) + d_kd[i] * kd[i].to(Float32)
            row_y[i] = d_kr[i] * kr[i].to(Float32)
        self.store_pairs(smem.row_x, row_x, coords, c0)
        self.store_pairs(smem.row_y, row_y, coords, c0)
        self.store_token_gradients(smem, inputs, out, dq_hat, dk_hat, coords, c0, qk_head, head, row0, valid_rows,
                                   warp_idx, lane)

    @cute.jit
    def gate_backward_dyadic(self, smem: DyadicGradsSmem, inputs: GradsInputs, out: GradsOutputs, head: Int32,
                             slot: Int32, row0: Int32, valid_rows: Int32, col: Int32, dt: Float32, e_a: Float32,
                             warp_idx: Int32, lane: Int32):
        """Channel ``col``: ``dγ_s`` = the levels' straddle sums (upper rows: Σ of the level's sums over the upper
        rows r ≥ s of s's block, running down from its last row; lower rows: Σ over the lower rows j < s, running
        up from its first) + ``Σ_{r≥s} (dqd⊙qd + dkd⊙kd)_r`` + ``Σ_{r<s} (dkr⊙kr)_r`` + ``dgT·gT``; then
        ``dg = dγ`` (log decay) or ``dg = −e^A·σ(g + dt_bias)·dγ`` (softplus) and the tile's partial sums of
        ddt_bias (per channel) and dA_log (``Σ dγ·γ``, ``γ = g'·ln 2``; over channels in warp order)."""
        if warp_idx < plan.CHANNEL_WARPS:  # one thread per channel
            levels = cute.make_rmem_tensor((CHUNK,), Float32)
            levels.fill(0.0)
            for level in cutlass.range_constexpr(plan.DYADIC_LEVELS):
                block = DYADIC_BLOCKS[level]
                half = block // 2
                for start in cutlass.range_constexpr(0, CHUNK, block):
                    running = Float32(0.0)
                    for r in cutlass.range_constexpr(start + block - 1, start + half - 1, -1):
                        running = running + smem.level_sums[level][r, col]
                        levels[r] = levels[r] + running
                    running = Float32(0.0)
                    for r in cutlass.range_constexpr(start, start + half):
                        levels[r] = levels[r] + running
                        running = running + smem.level_sums[level][r, col]
            from_s = cute.make_rmem_tensor((CHUNK,), Float32)
            running = Float32(0.0)
            for step in cutlass.range_constexpr(CHUNK):
                r = CHUNK - 1 - step
                running = running + smem.row_x[r, col]
                from_s[r] = running
            state_term = smem.dgt[col] * smem.pow_g[CHUNK - 1, col]  # dgT ⊙ gT
            before_s = Float32(0.0)
            ddt = Float32(0.0)
            dalog = Float32(0.0)
            for s in cutlass.range_constexpr(CHUNK):
                dgamma = ((levels[s] + from_s[s]) + before_s) + state_term
                before_s = before_s + smem.row_y[s, col]
                if s < valid_rows:
                    dg = dgamma
                    if cutlass.const_expr(self.gate == "softplus"):
                        g_raw = inputs.g[row0 + s, head, col].to(Float32)
                        dg = self.softplus_gate_grad(g_raw, dt, e_a, dgamma)
                        ddt = ddt + dg
                        dalog = dalog + dgamma * (self.base2_log_decay(g_raw, dt, e_a) * Float32(LN2))
                    out.dg[row0 + s, head, col] = dg.to(BFloat16)
            if cutlass.const_expr(self.gate == "softplus"):
                out.ddt_partial[slot, col] = ddt
                for offset in (16, 8, 4, 2, 1):
                    dalog = dalog + cute.arch.shuffle_sync_bfly(dalog, offset=offset)
                if lane == 0:
                    smem.dalog_w[warp_idx] = dalog
        if cutlass.const_expr(self.gate == "softplus"):
            cute.arch.sync_threads()
            if warp_idx == 0 and lane == 0:
                total = Float32(0.0)
                for w in cutlass.range_constexpr(plan.CHANNEL_WARPS):
                    total = total + smem.dalog_w[w]
                out.dalog_partial[slot] = total
