"""K1, the prepare kernel: raw inputs → the per-(head, 16-token tile) workspace that K2 reads.

Arithmetic: docs/numerics.md, section "K1", operation by operation (the mirror reference
``cute_kda.reference.mirror.mirror_prepare`` follows the same page). Workspace format:
``cute_kda.workspace``. Shared-memory plan: ``cute_kda.layouts.fwd_prepare``.

One CTA per (tile slot, head), ``num_threads`` threads (128 or 256):

1. *Load.* Warp 0 TMA-loads the q, k and g tiles (``[16, 128]`` bf16, 128-byte swizzle) behind one
   transaction barrier; meanwhile every thread fetches its gate column's ``dt_bias`` and
   ``exp(A_log)``, and threads 0-15 compute β of their row (written to smem and to the workspace).
2. *Gate scan.* Threads 0-127 own one channel each and run the 16-row inclusive scan of
   ``g' = c_gate · sigmoid(e^A · (g + dt_bias))`` in order, writing ``G`` (fp32) to smem and
   ``gT = 2^G_last`` to the workspace.
3. *Decay.* Every 16-lane half warp owns one row, lane ``j`` the 8 channels ``8j … 8j+7``: the l2
   norm (sequential partial over 8 channels, then a ``shfl.xor`` butterfly 8, 4, 2, 1), then qd,
   kd, kr and kinv, written over q, k, g and into kinv.
4. *Finish.* Warp 0: ``A_kk = kd·kinvᵀ`` (``mma.sync`` m16n8k16, bf16 → fp32), ``L``, and the fp16
   Neumann product for INV, all in registers; warp 1: ``Mqk``; warp 2: TMA stores of qd, kd, kr.

Rows past the end of the sequence (tail tile) are *invalid*: the TMA may have brought the next
sequence's rows (or zeros past the tensor), and every use masks them — q, k as 0, ``g' = 0``,
β = 0 — so nothing of another sequence reaches the results.

Occupancy (K1 is memory-bound: tiles in flight per SM matter). Default 128 threads with
``minctasm = 8``: ptxas fits the kernel in 62 registers (8 × 128 × 64 = 65 536) and the 25.6 KB of
shared memory fits 8 times per SM, so 8 tiles (8 × 12 KB of TMA loads) are in flight per SM. The
256-thread variant needs 48 registers, i.e. 5 CTAs per SM (6 would spill).

Varlen: the grid runs over the tile-slot bound (``tiles_per_head``); a CTA finds its sequence by
binary search in ``tile_base`` and does nothing (writes nothing) when its slot has no tile.
Fixed length: sequence ``b`` owns rows ``b·T … b·T + T − 1`` of the flattened ``[B·T]`` tokens and
tiles ``b·⌈T/16⌉ …``; tiles never straddle sequences.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..dsl import cute, cutlass
from ..layouts import fwd_prepare as plan
from ..layouts.budget import SMEM_CARVEOUT_PERCENT  # K1 wants CTAs, not L1
from ..layouts.smem import CHUNK, HEAD_DIM, sw128_column_offsets, sw128_row_offset
from .common.copy import (
    WARP_TILE,
    Operand,
    head_tile_tma_partition,
    ldmatrix_copy,
    make_fragment,
    make_head_tile_tma_atom,
    tma_store_tiles,
    transpose_c_to_b,
    warp_tiled_mma,
)
from ..numerics import DYADIC_BLOCKS, GATES, LOG2E
from .common.fastmath import ex2_approx, mul_rn, sigmoid_approx
from .common.token_prep import CHANNELS_PER_LANE, ROW_LANES, ROW_SUMS_THREAD, TokenPrep

LEVEL_ROWS = CHUNK // 2  # upper (and lower) rows of one straddle level, over all its blocks


class SwizzledColumn:
    """One column of a sw128 ``[16, D]`` smem tile, indexed by a compile-time row: the flat (unswizzled)
    element view of the tile at the column's eight precomputed offsets (``layouts.smem.sw128_column_offsets``)
    plus the row's constant, so no access recomputes the swizzle."""

    def __init__(self, flat: cute.Tensor, offsets: list) -> None:
        self.flat, self.offsets = flat, offsets

    def __getitem__(self, row: int):
        return self.flat[self.offsets[row % len(self.offsets)] + sw128_row_offset(row)]

    def __setitem__(self, row: int, value) -> None:
        self.flat[self.offsets[row % len(self.offsets)] + sw128_row_offset(row)] = value


class PackedLevels:
    """Where K1 puts one channel of :meth:`~.common.token_prep.TokenPrep.dyadic_channel_scan`: qd, kd over q, k and
    kr in their sw128 tiles (:class:`SwizzledColumn` s), and each level's operands packed into 8 slots a level:
    an upper row ``r > m`` of block ``β`` (``b`` rows) in slot ``β·b/2 + (r − m − 1)`` of the level's rows (``X``
    then, 8 rows on, ``Q``), a lower row ``r ≤ m`` in slot ``β·b/2 + (r − β·b)`` of its pair's lower rows."""

    def __init__(self, q_col: SwizzledColumn, k_col: SwizzledColumn, kr_col: SwizzledColumn, level_cols: tuple,
                 lower_cols: tuple, s_q_scale: cute.Tensor, s_k_scale: cute.Tensor) -> None:
        self.q_col, self.k_col, self.kr_col = q_col, k_col, kr_col
        self.level_cols, self.lower_cols = level_cols, lower_cols
        self.s_q_scale, self.s_k_scale = s_q_scale, s_k_scale

    def q(self, row: int):
        return self.q_col[row]

    def k(self, row: int):
        return self.k_col[row]

    def q_scale(self, row: int):
        return self.s_q_scale[row]

    def k_scale(self, row: int):
        return self.s_k_scale[row]

    def suffix(self, row: int, kh: Float32, growth: Float32) -> None:
        self.kr_col[row] = (kh * growth).to(BFloat16)

    def prefix(self, row: int, qh: Float32, kh: Float32, decay: Float32) -> None:
        self.q_col[row] = (qh * decay).to(BFloat16)
        self.k_col[row] = (kh * decay).to(BFloat16)

    def lower(self, level: int, start: int, row: int, factor: Float32, kh: Float32) -> None:
        block = DYADIC_BLOCKS[level]
        slot = LEVEL_ROWS * (level % 2) + start // block * (block // 2) + row - start
        self.lower_cols[level // 2][slot] = (kh * factor).to(BFloat16)

    def upper(self, level: int, start: int, row: int, factor: Float32, kh: Float32, qh: Float32) -> None:
        block = DYADIC_BLOCKS[level]
        slot = start // block * (block // 2) + row - (start + block // 2)
        self.level_cols[level][slot] = (kh * factor).to(BFloat16)
        self.level_cols[level][LEVEL_ROWS + slot] = (qh * factor).to(BFloat16)


class PrepareInputs(NamedTuple):
    """K1's inputs, validated by the API layer; token tensors ``[B, T, ...]`` or with the tokens
    flattened (``rows = B·T``), C-contiguous either way (:func:`~cute_kda.layouts.fwd_prepare.compact`)."""

    q: cute.Tensor  # bf16 [B, T, H, D] or [rows, H, D], D contiguous
    k: cute.Tensor  # bf16 like q
    g: cute.Tensor  # bf16 like q, raw gate
    beta: cute.Tensor  # bf16 [B, T, H] or [rows, H], logits or activated
    a_log: cute.Tensor  # fp32 [H]
    dt_bias: cute.Tensor  # fp32 [H, D]


class WorkspaceTiles(NamedTuple):
    """The workspace fields as K1 writes them (``R = H · tiles`` tile rows, slot = h·tiles + tile)."""

    qd: cute.Tensor  # bf16 [R·16, 1, D]: the [R, 16, D] field as rows of one "head"
    kd: cute.Tensor  # bf16 [R·16, 1, D]
    kr: cute.Tensor  # bf16 [R·16, 1, D]
    gt: cute.Tensor  # fp32 [R, D]
    inv: cute.Tensor  # bf16 [R, 16, 16]
    mqk: cute.Tensor  # bf16 [R, 16, 16]
    beta: cute.Tensor  # fp32 [R, 16]


class PrepareScalars(NamedTuple):
    """fp32 constants of docs/numerics.md (rounded once on the host) and the fixed length."""

    scale: Float32  # f32(scale)
    c_gate: Float32  # f32(lower_bound · log2(e))
    seq_len: Int32  # T of a fixed-length batch (unused with cu_seqlens)


class PrepareTma(NamedTuple):
    """TMA atoms and TMA tensors: loads of q, k, g; stores of qd, kd, kr."""

    q: tuple
    k: tuple
    g: tuple
    qd: tuple
    kd: tuple
    kr: tuple


class PrepareKernel(TokenPrep):
    """K1. Static configuration: ``varlen``, ``qk_l2norm``, ``beta_logits``, ``gate``, ``gate_dtype``,
    ``num_threads``.

    ``gate`` (:data:`cute_kda.numerics.GATES`): ``"safe"`` is the kernel above; ``"softplus"`` and ``"none"``
    (a precomputed log decay, bf16 or fp32 ``g``) are unbounded below and run the overflow-free form of
    docs/numerics.md ("Unbounded gates", scheme ``dyadic``), :meth:`prepare_tile_pairwise`; with
    ``per_head_gate`` (GatedDeltaNet) g is ``[.., HV]`` and dt_bias ``[HV]``, one decay per head broadcast
    over the channels, computed by the cheaper scheme ``per_head`` (:meth:`prepare_tile_per_head`). ``grouped``: q and k have H heads, everything else HV = group · H (value heads);
    the grid and the workspace run over value heads, and value head ``h`` reads q/k head ``h // group``.
    """

    def __init__(self, *, varlen: bool, qk_l2norm: bool = True, beta_logits: bool = True, gate: str = "safe",
                 gate_dtype: type = BFloat16, per_head_gate: bool = False, grouped: bool = False,
                 num_threads: int = 128, ctas_per_sm: Optional[int] = None) -> None:
        if num_threads not in (128, 256):
            raise ValueError(f"num_threads must be 128 or 256, got {num_threads}")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if gate_dtype not in (BFloat16, Float32) or (gate_dtype is Float32 and gate != "none"):
            raise ValueError(f"g is bf16 (or fp32 with gate 'none'), got {gate_dtype} with gate {gate!r}")
        self.pairwise = gate != "safe"
        if per_head_gate and not self.pairwise:
            raise ValueError("a per-head gate (GatedDeltaNet's) takes gate 'softplus' or 'none'")
        if self.pairwise and num_threads != HEAD_DIM:
            raise ValueError(f"the unbounded gates' K1 runs one thread per channel ({HEAD_DIM}), got {num_threads}")
        self.varlen = varlen
        self.qk_l2norm = qk_l2norm
        self.beta_logits = beta_logits
        self.gate = gate
        self.gate_dtype = gate_dtype
        self.per_head_gate = per_head_gate  # g [.., HV] and dt_bias [HV]: one decay per head, on every channel
        self.grouped = grouped  # grouped value heads: HV = group · H, value head h reads q/k head h // group
        self.num_threads = num_threads
        if ctas_per_sm is None:
            ctas_per_sm = (plan.PER_HEAD_CTAS_PER_SM if per_head_gate else plan.PAIRWISE_CTAS_PER_SM if self.pairwise
                           else 8)
        self.ctas_per_sm = ctas_per_sm  # register budget: 65536 / (num_threads · ctas_per_sm)
        self.dim = HEAD_DIM
        self.tile = (CHUNK, HEAD_DIM)
        # decay phase: 16 rows × 16 lanes per row, spread over the threads
        self.decay_items = CHUNK * ROW_LANES // num_threads
        self.kkt_warp, self.qk_warp, self.store_warp = 0, 1, 2

    @cute.jit
    def __call__(
        self,
        inputs: PrepareInputs,
        ws: WorkspaceTiles,
        scale: Float32,
        c_gate: Float32,
        seq_len: Int32,
        cu_seqlens: Optional[cute.Tensor],
        tile_base: Optional[cute.Tensor],
        stream,
    ) -> None:
        """Launch over ``(tiles, H)``; ``tiles = ws.gt.shape[0] // H`` slots per head.

        Tensors may come with fully dynamic layouts; they must be C-contiguous with the shapes of
        :class:`PrepareInputs` / :class:`WorkspaceTiles` (the API layer checks). ``scale`` and
        ``c_gate = lower_bound · log2(e)`` are rounded to fp32 once by the caller; ``seq_len`` is T
        of a fixed-length batch. ``cu_seqlens`` int64 ``[N+1]`` and ``tile_base`` int32 ``[N+1]``
        (:class:`cute_kda.kernels.tile_prefix.TilePrefixKernel`) for varlen, else None.
        """
        scalars = PrepareScalars(scale=scale, c_gate=c_gate, seq_len=seq_len)
        heads, d = inputs.beta.shape[cute.rank(inputs.beta) - 1], self.dim  # value heads
        qk_heads = inputs.q.shape[cute.rank(inputs.q) - 2] if self.grouped else heads
        with_constants = self.gate != "none"  # a log decay needs neither A_log nor dt_bias (None)
        channels = () if self.per_head_gate else (d,)
        inputs = PrepareInputs(
            q=plan.compact(inputs.q, (qk_heads, d)),
            k=plan.compact(inputs.k, (qk_heads, d)),
            g=plan.compact(inputs.g, (heads, *channels)),
            beta=plan.compact(inputs.beta, (heads,)),
            a_log=plan.compact(inputs.a_log, ()) if with_constants else None,
            dt_bias=plan.compact(inputs.dt_bias, channels) if with_constants else None,
        )
        ws = WorkspaceTiles(
            qd=plan.compact(ws.qd, (1, d)),
            kd=plan.compact(ws.kd, (1, d)),
            kr=plan.compact(ws.kr, (1, d)),
            gt=plan.compact(ws.gt, (d,)),
            inv=plan.compact(ws.inv, (CHUNK, CHUNK)),
            mqk=plan.compact(ws.mqk, (CHUNK, CHUNK)),
            beta=plan.compact(ws.beta, (CHUNK,)),
        )
        tile = plan.chunk_tile(d)
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma = PrepareTma(
            q=make_head_tile_tma_atom(load, inputs.q, tile, self.tile),
            k=make_head_tile_tma_atom(load, inputs.k, tile, self.tile),
            g=None if self.pairwise else make_head_tile_tma_atom(load, inputs.g, tile, self.tile),
            qd=make_head_tile_tma_atom(store, ws.qd, tile, self.tile),
            kd=make_head_tile_tma_atom(store, ws.kd, tile, self.tile),
            kr=make_head_tile_tma_atom(store, ws.kr, tile, self.tile),
        )
        self.shared_storage = plan.shared_storage(d, pairwise=self.pairwise, per_head=self.per_head_gate)
        tiles = ws.gt.shape[0] // heads
        self.kernel(tma, inputs, ws, scalars, cu_seqlens, tile_base).launch(
            grid=(tiles, heads, 1), block=(self.num_threads, 1, 1), stream=stream,
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=SMEM_CARVEOUT_PERCENT,
        )

    @cute.kernel
    def kernel(
        self,
        tma: PrepareTma,
        inputs: PrepareInputs,
        ws: WorkspaceTiles,
        scalars: PrepareScalars,
        cu_seqlens: Optional[cute.Tensor],
        tile_base: Optional[cute.Tensor],
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_slot, head, _ = cute.arch.block_idx()
        tiles, heads, _ = cute.arch.grid_dim()
        row0, valid_rows, exists, _ = self.locate_tile(tile_slot, scalars.seq_len, cu_seqlens, tile_base)
        qk_head = head
        if cutlass.const_expr(self.grouped):
            qk_head = head // (heads // inputs.q.shape[1])
        if exists:
            if cutlass.const_expr(self.per_head_gate):
                self.prepare_tile_per_head(tma, inputs, ws, scalars, head, qk_head, head * tiles + tile_slot, row0,
                                           valid_rows)
            elif cutlass.const_expr(self.pairwise):
                self.prepare_tile_pairwise(tma, inputs, ws, scalars, head, qk_head, head * tiles + tile_slot, row0,
                                           valid_rows)
            else:
                self.prepare_tile(tma, inputs, ws, scalars, head, qk_head, head * tiles + tile_slot, row0, valid_rows)

    @cute.jit
    def prepare_tile(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles,
                     scalars: PrepareScalars, head: Int32, qk_head: Int32, slot: Int32, row0: Int32, valid_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        tile_layout = plan.chunk_tile(self.dim)
        cumsum_layout = plan.gate_cumsum_tile(self.dim)
        storage = SmemAllocator().allocate(self.shared_storage)
        s_q = storage.q.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_k = storage.k.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_g = storage.g.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_kinv = storage.kinv.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_cumsum = storage.gate_cumsum.get_tensor(cumsum_layout.outer, swizzle=cumsum_layout.inner)
        s_beta = storage.beta.get_tensor(plan.row_vector())
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_inputs(((tma.q, s_q, qk_head), (tma.k, s_k, qk_head), (tma.g, s_g, head)), tma_barrier, row0)
        # gate inputs of this thread's scan column, fetched while the TMA runs
        col = tidx % self.dim
        dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, head, col)
        if tidx < CHUNK:
            self.activate_beta(inputs.beta, ws.beta, s_beta, head, slot, row0, valid_rows, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)

        if tidx < self.dim:
            ws.gt[slot, col] = ex2_approx(self.gate_scan(s_g, s_cumsum, col, dt, e_a, scalars.c_gate, valid_rows))
        cute.arch.sync_threads()
        # qd, kd, kr written over q, k, g
        self.decay(s_q, s_k, s_cumsum, s_q, s_k, s_g, s_kinv, scalars.scale, valid_rows, tidx)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()

        if warp_idx == self.kkt_warp:
            self.kkt_inverse(s_k, s_kinv, s_beta, ws.inv, slot, lane)
        elif warp_idx == self.qk_warp:
            self.masked_qk(s_q, s_kinv, ws.mqk, slot, lane)
        elif warp_idx == self.store_warp:
            self.store_tiles(tma, s_q, s_k, s_g, slot)

    @cute.jit
    def load_inputs(self, tiles: tuple, tma_barrier, row0: Int32):
        """Warp 0: one transaction barrier, TMA tile loads starting at token row ``row0``; ``tiles`` is
        ``((atom, tma_tensor), smem, head)`` per tile."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(tma_barrier, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(tma_barrier, len(tiles) * plan.input_tile_bytes(self.dim))
        for (atom, tma_tensor), smem, head in tiles:
            s_part, g_part = head_tile_tma_partition(
                atom, cute.domain_offset((row0, 0, 0), tma_tensor), smem, head, self.tile
            )
            cute.copy(atom, g_part[None, 0], s_part, tma_bar_ptr=tma_barrier)

    @cute.jit
    def activate_beta(self, beta_in: cute.Tensor, ws_beta: cute.Tensor, s_beta: cute.Tensor,
                      head: Int32, slot: Int32, row0: Int32, valid_rows: Int32, row: Int32):
        """β of one row: sigmoid of the logit (or as given), 0 on invalid rows; smem + workspace."""
        value = Float32(0.0)
        if row < valid_rows:
            value = beta_in[row0 + row, head].to(Float32)
            if cutlass.const_expr(self.beta_logits):
                value = sigmoid_approx(value)
        s_beta[row] = value
        ws_beta[slot, row] = value

    @cute.jit
    def kkt_inverse(self, s_kd, s_kinv, s_beta, ws_inv: cute.Tensor, slot: Int32, lane: Int32):
        """Warp 0: ``L = f16(β_i · kd_i·kinv_j)`` (i > j), then INV = (I + L)⁻¹ by the Neumann product.

        Fragment algebra (``cute_kda.kernels.common.copy``): a C fragment's registers are the A
        fragment of the same matrix, and ``transpose_c_to_b`` turns them into the B fragment that
        makes it the right factor: ``X·Y`` = ``mma(A = X, B = transpose_c_to_b(Y))``.
        """
        self.lower_inverse(self.tile_product(warp_tiled_mma(BFloat16, Float32), s_kd, s_kinv, lane),
                           s_beta, ws_inv, slot, lane)

    @cute.jit
    def lower_inverse(self, a_kk: cute.Tensor, s_beta, ws_inv: cute.Tensor, slot: Int32, lane: Int32):
        """``L = f16(β_i · A_kk[i, j])`` (i > j) from ``A_kk``'s fp32 C fragment, INV = (I + L)⁻¹ by the
        Neumann product, stored to workspace slot ``slot``."""
        coords = warp_tiled_mma(BFloat16, Float32).get_slice(lane).partition_C(
            cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        mma_f16 = warp_tiled_mma(Float16, Float32)
        l_a = make_fragment(mma_f16, Operand.A, Float16)
        p1 = make_fragment(mma_f16, Operand.C, Float32)
        for i in cutlass.range_constexpr(cute.size(a_kk)):
            row, col = coords[i]
            l_val = Float16(0.0)
            if row > col:
                l_val = (s_beta[row] * a_kk[i]).to(Float16)
            l_a[i] = l_val
            # P1 = I − L is exact in f16 (held widened to fp32, the C operand of the next mma)
            p1[i] = Float32(cutlass.select_(row == col, Float32(1.0), Float32(0.0))) - l_val.to(Float32)

        l_b = self.right_factor(mma_f16, l_a)
        l2_a = self.rounded(mma_f16, self.mma_16x16(mma_f16, l_a, l_b, None), Float16)
        l2_b = self.right_factor(mma_f16, l2_a)
        l4_a = self.rounded(mma_f16, self.mma_16x16(mma_f16, l2_a, l2_b, None), Float16)
        l4_b = self.right_factor(mma_f16, l4_a)
        l8_a = self.rounded(mma_f16, self.mma_16x16(mma_f16, l4_a, l4_b, None), Float16)
        l8_b = self.right_factor(mma_f16, l8_a)
        p2_a = self.rounded(mma_f16, self.mma_16x16(mma_f16, self.rounded(mma_f16, p1, Float16), l2_b, p1), Float16)
        p3_a = self.rounded(mma_f16, self.mma_16x16(mma_f16, p2_a, l4_b, self.widened(mma_f16, p2_a)), Float16)
        inv = self.rounded(mma_f16, self.mma_16x16(mma_f16, p3_a, l8_b, self.widened(mma_f16, p3_a)), BFloat16)
        cute.autovec_copy(inv, mma_f16.get_slice(lane).partition_C(ws_inv[slot, None, None]))

    @cute.jit
    def mma_16x16(self, tiled_mma, a_frag: cute.Tensor, b_frag: cute.Tensor, c_frag) -> cute.Tensor:
        """fp32 ``C + A·B`` of one 16×16×16 warp tile (``C`` = 0 when ``c_frag`` is None)."""
        acc = make_fragment(tiled_mma, Operand.C, Float32)
        if cutlass.const_expr(c_frag is None):
            acc.fill(0.0)
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = c_frag[i]
        cute.gemm(tiled_mma, acc, a_frag, b_frag, acc)
        return acc

    @cute.jit
    def rounded(self, tiled_mma, acc: cute.Tensor, dtype: type) -> cute.Tensor:
        """A fragment (= C registers) of ``acc`` rounded to ``dtype`` (round to nearest even)."""
        out = make_fragment(tiled_mma, Operand.A, dtype)
        for i in cutlass.range_constexpr(cute.size(acc)):
            out[i] = acc[i].to(dtype)
        return out

    @cute.jit
    def widened(self, tiled_mma, frag: cute.Tensor) -> cute.Tensor:
        """fp32 C fragment holding the (exact) values of a 16-bit A fragment."""
        out = make_fragment(tiled_mma, Operand.C, Float32)
        for i in cutlass.range_constexpr(cute.size(frag)):
            out[i] = frag[i].to(Float32)
        return out

    @cute.jit
    def right_factor(self, tiled_mma, x_a: cute.Tensor) -> cute.Tensor:
        """B fragment of X (X as the right factor of a product), from X's A/C registers."""
        x_b = make_fragment(tiled_mma, Operand.B, Float16)
        transpose_c_to_b(x_a, x_b)
        return x_b

    @cute.jit
    def masked_qk(self, s_qd, s_kinv, ws_mqk: cute.Tensor, slot: Int32, lane: Int32):
        """Warp 1: ``Mqk = bf16(qd_i·kinv_j)`` for i ≥ j, else 0."""
        self.store_mqk(self.tile_product(warp_tiled_mma(BFloat16, Float32), s_qd, s_kinv, lane), ws_mqk, slot, lane)

    @cute.jit
    def store_mqk(self, a_qk: cute.Tensor, ws_mqk: cute.Tensor, slot: Int32, lane: Int32):
        """``Mqk = bf16(A_qk[i, j])`` for i ≥ j, else 0, from ``A_qk``'s fp32 C fragment, to slot ``slot``."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        thr = mma_bf16.get_slice(lane)
        coords = thr.partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        mqk = make_fragment(mma_bf16, Operand.C, BFloat16)
        for i in cutlass.range_constexpr(cute.size(a_qk)):
            row, col = coords[i]
            mqk[i] = Float32(cutlass.select_(row >= col, a_qk[i], Float32(0.0))).to(BFloat16)
        cute.autovec_copy(mqk, thr.partition_C(ws_mqk[slot, None, None]))

    @cute.jit
    def tile_product(self, tiled_mma, s_left, s_right, lane: Int32) -> cute.Tensor:
        """``left · rightᵀ`` of two ``[16, D]`` smem tiles: fp32, 16-channel k-steps in order."""
        acc = make_fragment(tiled_mma, Operand.C, Float32)
        acc.fill(0.0)
        a_frag = make_fragment(tiled_mma, Operand.A, BFloat16)
        b_frag = make_fragment(tiled_mma, Operand.B, BFloat16)
        copy_a = ldmatrix_copy(tiled_mma, Operand.A, False)
        copy_b = ldmatrix_copy(tiled_mma, Operand.B, False)
        thr_a = copy_a.get_slice(lane)
        thr_b = copy_b.get_slice(lane)
        block = (WARP_TILE, WARP_TILE)
        for kb in cutlass.range_constexpr(self.dim // WARP_TILE):
            cute.copy(copy_a, thr_a.partition_S(cute.local_tile(s_left, block, (0, kb))), thr_a.retile(a_frag))
            cute.copy(copy_b, thr_b.partition_S(cute.local_tile(s_right, block, (0, kb))), thr_b.retile(b_frag))
            cute.gemm(tiled_mma, acc, a_frag, b_frag, acc)
        return acc

    def store_tiles(self, tma: PrepareTma, s_qd, s_kd, s_kr, slot: Int32):
        """Warp 2: TMA stores of qd, kd, kr to workspace slot ``slot``; waits until smem is read.

        ``tma_store_tiles`` elects the issuing lane (the DSL does not for an S2G copy).
        """
        copies = []
        for (atom, tma_tensor), smem in ((tma.qd, s_qd), (tma.kd, s_kd), (tma.kr, s_kr)):
            s_part, g_part = head_tile_tma_partition(atom, tma_tensor, smem, 0, self.tile)
            copies.append((atom, s_part, g_part[None, slot]))
        tma_store_tiles(*copies)

    # ------------------------------------------------------------------------------------------
    # the unbounded gates (docs/numerics.md, "Unbounded gates": the dyadic scheme)

    @cute.jit
    def prepare_tile_pairwise(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles, scalars: PrepareScalars,
                              head: Int32, qk_head: Int32, slot: Int32, row0: Int32, valid_rows: Int32):
        """One tile with an unbounded gate: no ``2^−G`` is ever formed.

        1. Warp 0 TMA-loads q and k; every thread (one per channel) loads its column of g.
        2. Rows (16 lanes per row, as :meth:`decay`): the l2norm scales and Mqk's diagonal ``Σ_c qh·kh``.
        3. Columns (one thread per channel, rows in order): the gate, ``a = 2^g'``, the prefix ``G`` and the
           suffix ``Gs``, ``qd``, ``kd`` (over q, k), ``kr``, and per straddle level the factors (running
           products of ``a`` outward from the block's middle row, all ≤ 1) and the operands X, Q.
        4. Warp ``ℓ``: level ``ℓ``'s pair sums by one tensor-core product, scattered into ``A_kk`` / ``A_qk``.
        5. Warp 0: L and INV; warp 1: Mqk; warp 2: TMA stores of qd, kd, kr.
        """
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        tile_layout = plan.chunk_tile(self.dim)
        storage = SmemAllocator().allocate(self.shared_storage)
        s_q = storage.q.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_k = storage.k.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_kr = storage.kr.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_levels = tuple(getattr(storage, f"level_rows{level}").get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
                         for level in range(len(DYADIC_BLOCKS)))
        s_lowers = tuple(getattr(storage, f"lower_rows{pair}").get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
                         for pair in range(len(DYADIC_BLOCKS) // 2))
        s_akk = storage.a_kk.get_tensor(plan.pair_matrix())
        s_aqk = storage.a_qk.get_tensor(plan.pair_matrix())
        s_beta = storage.beta.get_tensor(plan.row_vector())
        s_q_scale = storage.q_scale.get_tensor(plan.row_vector())
        s_k_scale = storage.k_scale.get_tensor(plan.row_vector())
        s_diagonal = storage.mqk_diagonal.get_tensor(plan.row_vector())
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_inputs(((tma.q, s_q, qk_head), (tma.k, s_k, qk_head)), tma_barrier, row0)
        col = tidx
        gate_in = self.load_gate_column(inputs.g, head, row0, valid_rows, col)  # in flight with the TMA
        dt, e_a = Float32(0.0), Float32(1.0)
        if cutlass.const_expr(self.gate != "none"):
            dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, head, col)
        if tidx < CHUNK:
            self.activate_beta(inputs.beta, ws.beta, s_beta, head, slot, row0, valid_rows, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)

        self.row_scales(s_q, s_k, s_q_scale, s_k_scale, s_diagonal, scalars.scale, valid_rows, tidx)
        cute.arch.sync_threads()
        offsets = sw128_column_offsets(col)
        flat = cute.make_layout(CHUNK * self.dim)

        def column(buffer) -> SwizzledColumn:
            return SwizzledColumn(buffer.get_tensor(flat), offsets)

        sink = PackedLevels(
            column(storage.q), column(storage.k), column(storage.kr),
            tuple(column(getattr(storage, f"level_rows{level}")) for level in range(len(DYADIC_BLOCKS))),
            tuple(column(getattr(storage, f"lower_rows{pair}")) for pair in range(len(DYADIC_BLOCKS) // 2)),
            s_q_scale, s_k_scale)
        ws.gt[slot, col] = ex2_approx(self.dyadic_channel_scan(sink, gate_in, dt, e_a, valid_rows))
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()
        for level in cutlass.range_constexpr(len(DYADIC_BLOCKS)):
            if warp_idx == level:
                self.level_pair_sums(level, s_levels[level], s_lowers[level // 2], s_akk, s_aqk, lane)
        cute.arch.sync_threads()

        if warp_idx == self.kkt_warp:
            self.lower_inverse(self.pair_fragment(s_akk, None, lane), s_beta, ws.inv, slot, lane)
        elif warp_idx == self.qk_warp:
            self.store_mqk(self.pair_fragment(s_aqk, s_diagonal, lane), ws.mqk, slot, lane)
        elif warp_idx == self.store_warp:
            self.store_tiles(tma, s_q, s_k, s_kr, slot)

    @cute.jit
    def row_scales(self, s_q, s_k, s_q_scale, s_k_scale, s_diagonal, scale: Float32, valid_rows: Int32, tidx: Int32):
        """Per row: ``rq = rinv_q · scale``, ``rk = rinv_k`` (scale and 1 without l2norm) and Mqk's diagonal
        ``Σ_c f32(qh·kh)`` (qh = q·rq, kh = k·rk; sequential over the lane's 8 channels, then the butterfly)."""
        for item in cutlass.range_constexpr(self.decay_items):
            row, chunk = self.row_chunk(tidx, item)
            valid = row < valid_rows
            q_in, k_in = self.load_row_chunk(s_q, s_k, row, chunk)
            q32, k32, _, q_rscale, k_rscale = self.chunk_scales(q_in, k_in, valid, scale)
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                k_hat = k32[i] * k_rscale if cutlass.const_expr(self.qk_l2norm) else k32[i]
                dot = dot + mul_rn(q32[i] * q_rscale, k_hat)
            for offset in (8, 4, 2, 1):
                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=offset)
            if chunk == 0:
                s_q_scale[row] = q_rscale
                s_k_scale[row] = k_rscale
                s_diagonal[row] = dot

    @cute.jit
    def level_pair_sums(self, level: int, s_level, s_lower, s_akk, s_aqk, lane: Int32):
        """One warp: ``P = level_rows · lower_rowsᵀ`` (fp32), scattered: ``P[p, l]`` → ``A_kk[i, j]``,
        ``P[8 + p, l]`` → ``A_qk[i, j]`` for the level's upper slot p (row i) and lower slot l (row j) of one
        block; the other entries of P (pairs across blocks, the other level's columns) are dropped."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        product = self.tile_product(mma_bf16, s_level, s_lower, lane)
        coords = mma_bf16.get_slice(lane).partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        block = DYADIC_BLOCKS[level]
        half = block // 2
        lower_base = LEVEL_ROWS * (level % 2)
        for i in cutlass.range_constexpr(cute.size(product)):
            prow, pcol = coords[i]
            upper_slot = prow % LEVEL_ROWS
            lower_slot = pcol - lower_base
            in_level = (lower_slot >= 0) & (lower_slot < LEVEL_ROWS)
            if in_level & (upper_slot // half == lower_slot // half):
                row_i = upper_slot // half * block + half + upper_slot % half
                row_j = lower_slot // half * block + lower_slot % half
                if prow < LEVEL_ROWS:
                    s_akk[row_i, row_j] = product[i]
                else:
                    s_aqk[row_i, row_j] = product[i]

    @cute.jit
    def pair_fragment(self, s_pairs, s_diagonal, lane: Int32) -> cute.Tensor:
        """The fp32 C fragment of ``s_pairs`` below the diagonal, ``s_diagonal`` on it (0 when None), 0 above."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        coords = mma_bf16.get_slice(lane).partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        frag = make_fragment(mma_bf16, Operand.C, Float32)
        for i in cutlass.range_constexpr(cute.size(frag)):
            row, col = coords[i]
            value = Float32(0.0)
            if row > col:
                value = s_pairs[row, col]
            if cutlass.const_expr(s_diagonal is not None):
                if row == col:
                    value = s_diagonal[row]
            frag[i] = value
        return frag

    # ------------------------------------------------------------------------------------------
    # a per-head gate (GatedDeltaNet): docs/numerics.md, "Unbounded gates", scheme per_head

    @cute.jit
    def prepare_tile_per_head(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles,
                              scalars: PrepareScalars, head: Int32, qk_head: Int32, slot: Int32, row0: Int32,
                              valid_rows: Int32):
        """One tile with one decay per row (the head's), scheme ``per_head``: no per-channel decay exists, so
        ``A = E ⊙ (bf16(kh)·bf16(kh)ᵀ)`` and ``A_qk = E ⊙ (bf16(qh)·bf16(kh)ᵀ)`` with the tile's 16 × 16 pair
        decays ``E[i, j] = a_{j+1}·…·a_i`` (each ≤ 1: nothing overflows for any gate value).

        1. Warp 0 TMA-loads q and k; threads 0-15 compute β and ``g'``, ``a = 2^g'`` of their row.
        2. Threads 0-15: column j of E, ``E[i, j] = f32(E[i−1, j]·a_i)`` down the rows; thread 32: the prefix and
           suffix sums, ``2^G``, ``2^Gs``.
        3. Rows, 16 lanes a row (as :meth:`decay`): l2norm, then qd, kd, kr and the bf16 rows ``q̂``, ``k̂``.
        4. Warp 0: ``A_kk`` and INV; warp 1: Mqk; warp 2: TMA stores of qd, kd, kr.
        """
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        tile_layout = plan.chunk_tile(self.dim)
        storage = SmemAllocator().allocate(self.shared_storage)
        s_q = storage.q.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_k = storage.k.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_kr = storage.kr.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_q_hat = storage.q_hat.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_k_hat = storage.k_hat.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
        s_spans = storage.spans.get_tensor(plan.pair_matrix())
        s_beta = storage.beta.get_tensor(plan.row_vector())
        s_gate = storage.gate.get_tensor(plan.row_vector())
        s_decay = storage.decay.get_tensor(plan.row_vector())
        s_prefix = storage.prefix_decay.get_tensor(plan.row_vector())
        s_suffix = storage.suffix_decay.get_tensor(plan.row_vector())
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_inputs(((tma.q, s_q, qk_head), (tma.k, s_k, qk_head)), tma_barrier, row0)
        if tidx < CHUNK:
            self.activate_beta(inputs.beta, ws.beta, s_beta, head, slot, row0, valid_rows, tidx)
            self.head_gate_row(inputs.g, inputs.a_log, inputs.dt_bias, head, row0, valid_rows, s_gate, s_decay, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        if tidx < CHUNK:
            self.span_column(s_decay, s_spans, tidx)
        elif tidx == ROW_SUMS_THREAD:
            self.row_sums(s_gate, s_prefix, s_suffix)
        cute.arch.sync_threads()
        ws.gt[slot, tidx] = s_prefix[CHUNK - 1]
        cute.arch.mbarrier_wait(tma_barrier, 0)
        self.decay_per_row(s_q, s_k, s_kr, s_q_hat, s_k_hat, s_prefix, s_suffix, scalars.scale, valid_rows, tidx)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()

        if warp_idx == self.kkt_warp:
            mma_bf16 = warp_tiled_mma(BFloat16, Float32)
            a_kk = self.spanned(self.tile_product(mma_bf16, s_k_hat, s_k_hat, lane), s_spans, lane)
            self.lower_inverse(a_kk, s_beta, ws.inv, slot, lane)
        elif warp_idx == self.qk_warp:
            mma_bf16 = warp_tiled_mma(BFloat16, Float32)
            a_qk = self.spanned(self.tile_product(mma_bf16, s_q_hat, s_k_hat, lane), s_spans, lane)
            self.store_mqk(a_qk, ws.mqk, slot, lane)
        elif warp_idx == self.store_warp:
            self.store_tiles(tma, s_q, s_k, s_kr, slot)

    @cute.jit
    def spanned(self, product: cute.Tensor, s_spans, lane: Int32) -> cute.Tensor:
        """``E ⊙ product`` on and below the diagonal (fp32 C fragment; above it 0)."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        coords = mma_bf16.get_slice(lane).partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        out = make_fragment(mma_bf16, Operand.C, Float32)
        for i in cutlass.range_constexpr(cute.size(product)):
            row, col = coords[i]
            value = Float32(0.0)
            if row >= col:
                value = product[i] * s_spans[row, col]
            out[i] = value
        return out
