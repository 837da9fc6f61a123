"""K1, the prepare kernel: raw inputs → the per-(head, 16-token tile) workspace that K2 reads.

Arithmetic: docs/numerics.md, section "K1", operation by operation (the mirror reference
``cute_kda.reference.mirror.mirror_prepare`` follows the same page). Workspace format:
``cute_kda.workspace``. Shared-memory plans: ``cute_kda.layouts.fwd_prepare``.

One CTA per (tile slot, head). Warp 0 TMA-loads the token tiles behind one transaction barrier while threads
0-15 compute β of their row (written to smem and to the workspace); the gate's scheme then forms the decayed
operands qd, kd, kr and gT, and the pair sums behind L and Mqk; to finish, warp 0 turns ``A_kk`` into INV (the
fp16 Neumann product, :meth:`PrepareKernel.lower_inverse`), warp 1 stores Mqk, warp 2 TMA-stores qd, kd, kr.

Rows past the end of the sequence (tail tile) are *invalid*: the TMA may have brought the next
sequence's rows (or zeros past the tensor), and every use masks them — q, k as 0, ``g' = 0``,
β = 0 — so nothing of another sequence reaches the results.

Varlen: the grid runs over the tile-slot bound (``tiles_per_head``); a CTA finds its sequence by
binary search in ``tile_base`` and does nothing (writes nothing) when its slot has no tile.
Fixed length: sequence ``b`` owns rows ``b·T … b·T + T − 1`` of the flattened ``[B·T]`` tokens and
tiles ``b·⌈T/16⌉ …``; tiles never straddle sequences.

This module holds what every gate shares: the argument bundles, the launch, the loads, β, INV and Mqk from the
pair sums, the stores. One subclass a gate scheme holds its tile's phases and shared memory:
:class:`~.safe.SafePrepare` (the bounded gate), :class:`~.dyadic.DyadicPrepare` (the per-channel unbounded gates),
:class:`~.per_head.PerHeadPrepare` (a per-head gate); :func:`~cute_kda.kernels.fwd_prepare.prepare_kernel` picks
one from the variant's flags.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ...dsl import cute, cutlass
from ...layouts import fwd_prepare as plan
from ...layouts.budget import SMEM_CARVEOUT_PERCENT, SmemBudget  # K1 wants CTAs, not L1
from ...layouts.smem import CHUNK, HEAD_DIM
from ...numerics import NATIVE_HEAD_DIMS
from ..common.copy import (
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
from ..common.fastmath import sigmoid_approx
from ..common.token_prep import TokenPrep

INPUT_DTYPES = (BFloat16, Float16)  # q, k (and a raw gate): widened to fp32 on load, the same instructions after


class PrepareInputs(NamedTuple):
    """K1's inputs, validated by the API layer; token tensors ``[B, T, ...]`` or with the tokens
    flattened (``rows = B·T``), C-contiguous either way (:func:`~cute_kda.layouts.fwd_prepare.compact`)."""

    q: cute.Tensor  # bf16 or fp16 (the kernel's ``dtype``) [B, T, H, D] or [rows, H, D], D contiguous
    k: cute.Tensor  # like q
    g: cute.Tensor  # like q, raw gate (or the log decay: fp32 too)
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
    # a pair K1's cross blocks (docs/numerics.md, "Two tiles a serial step"), tile b's slot; None otherwise
    cross_kd: Optional[cute.Tensor] = None  # bf16 [R, 16, 16]: P = kd_b'·kinv_aᵀ
    cross_qd: Optional[cute.Tensor] = None  # bf16 [R, 16, 16]: Q = qd_b'·kinv_aᵀ
    # the per-head pair K1's partner fields (cute_kda.workspace.PartnerFields: tile b's tile-relative qd, kd, tile a's
    # kr, each tile's gT; what the backward's rebuild reads), shaped as qd, kd, kr, gt; None otherwise
    partner_qd: Optional[cute.Tensor] = None
    partner_kd: Optional[cute.Tensor] = None
    partner_kr: Optional[cute.Tensor] = None
    partner_gt: Optional[cute.Tensor] = None


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
    """K1's shared parts. Static configuration: ``varlen``, ``qk_l2norm``, ``beta_logits``, ``gate``
    (:data:`cute_kda.numerics.GATES`), ``dtype`` (q's and k's: bf16, or fp16 widened to fp32 exactly where bf16
    is, docs/numerics.md "fp16 inputs"; the workspace stays bf16), ``gate_dtype`` (``dtype``, or fp32 with gate
    "none"), ``num_threads`` and
    ``ctas_per_sm`` (the launch's minimum, i.e. the register budget ``65536 / (num_threads · ctas_per_sm)``;
    default the scheme's). ``dim``: the head dim K (:data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`); below
    ``num_threads`` the threads past ``dim`` own no channel (the finish still needs warps 0-2). ``grouped``: q and k
    have H heads, everything else HV = group · H (value heads); the grid and the workspace run over value heads, and
    value head ``h`` reads q/k head ``h // group``.

    A scheme's subclass sets :attr:`gates`, :attr:`per_head_gate` (g ``[.., HV]`` and dt_bias ``[HV]``),
    :attr:`gate_tile` (g comes by TMA), :attr:`thread_counts`, :attr:`default_ctas_per_sm` and :attr:`smem_plan`,
    and provides :meth:`prepare_tile` (its phases)."""

    gates = ("softplus", "none")  # the gate forms the scheme takes
    per_head_gate = False
    gate_tile = False
    thread_counts = (HEAD_DIM,)  # one thread per channel (of up to 128)
    default_ctas_per_sm: int
    smem_plan: Callable[..., SmemBudget]  # of D

    def __init__(self, *, varlen: bool, gate: str = "safe", qk_l2norm: bool = True, beta_logits: bool = True,
                 dtype: type = BFloat16, gate_dtype: Optional[type] = None, grouped: bool = False,
                 num_threads: int = 128, ctas_per_sm: Optional[int] = None, dim: int = HEAD_DIM) -> None:
        if dim not in NATIVE_HEAD_DIMS:
            raise ValueError(f"K1 is compiled for head dims {NATIVE_HEAD_DIMS}, got {dim}")
        if num_threads not in self.thread_counts:
            raise ValueError(f"{type(self).__name__} runs {' or '.join(map(str, self.thread_counts))} threads, "
                             f"got {num_threads}")
        if gate not in self.gates:
            raise ValueError(f"{type(self).__name__} takes gate {' or '.join(map(repr, self.gates))}, got {gate!r}")
        if dtype not in INPUT_DTYPES:
            raise ValueError(f"q and k are bf16 or fp16, got {dtype}")
        gate_dtype = dtype if gate_dtype is None else gate_dtype
        if gate_dtype not in (dtype, Float32) or (gate_dtype is Float32 and gate != "none"):
            raise ValueError(f"g is q's dtype {dtype.__name__} (or fp32 with gate 'none'), got {gate_dtype} with "
                             f"gate {gate!r}")
        self.dtype = dtype
        self.varlen = varlen
        self.qk_l2norm = qk_l2norm
        self.beta_logits = beta_logits
        self.gate, self.gate_dtype, self.grouped = gate, gate_dtype, grouped
        self.num_threads = num_threads
        self.ctas_per_sm = self.default_ctas_per_sm if ctas_per_sm is None else ctas_per_sm
        self.dim = dim
        self.tile = (CHUNK, dim)
        # decay phase: 16 rows × row_lanes lanes per row, spread over the threads
        if CHUNK * self.row_lanes % num_threads:
            raise ValueError(f"{num_threads} threads do not share the {CHUNK * self.row_lanes} row chunks of D = {dim}")
        self.decay_items = CHUNK * self.row_lanes // num_threads
        self.kkt_warp, self.qk_warp, self.store_warp = 0, 1, 2

    @property
    def idle_threads(self) -> bool:
        """Whether some threads own no channel (``dim < num_threads``): the per-channel phases then run under
        ``tidx < dim`` (a D = 128 kernel compiles without that test)."""
        return self.dim < self.num_threads

    def channel_of(self, tidx: Int32) -> Int32:
        """The channel whose inputs thread ``tidx`` reads in a per-channel phase (its own; a thread past ``dim``
        reads ``tidx % dim``'s, so that every load stays inside the tensors, and writes nothing)."""
        return tidx % self.dim if self.idle_threads else tidx

    def smem_budget(self) -> SmemBudget:
        """The shared-memory plan the launch asks for: the scheme's :attr:`smem_plan` (of ``layouts.fwd_prepare``)."""
        return self.smem_plan(self.dim)

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
        inner = dict(qd=(1, d), kd=(1, d), kr=(1, d), gt=(d,), inv=(CHUNK, CHUNK), mqk=(CHUNK, CHUNK), beta=(CHUNK,),
                     cross_kd=(CHUNK, CHUNK), cross_qd=(CHUNK, CHUNK), partner_qd=(1, d), partner_kd=(1, d),
                     partner_kr=(1, d), partner_gt=(d,))
        ws = WorkspaceTiles(*(None if field is None else plan.compact(field, inner[name])
                              for name, field in zip(WorkspaceTiles._fields, ws)))
        tile = plan.chunk_tile(d)
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma = PrepareTma(
            q=make_head_tile_tma_atom(load, inputs.q, tile, self.tile),
            k=make_head_tile_tma_atom(load, inputs.k, tile, self.tile),
            g=make_head_tile_tma_atom(load, inputs.g, tile, self.tile) if self.gate_tile else None,
            qd=make_head_tile_tma_atom(store, ws.qd, tile, self.tile),
            kd=make_head_tile_tma_atom(store, ws.kd, tile, self.tile),
            kr=make_head_tile_tma_atom(store, ws.kr, tile, self.tile),
        )
        self.shared_storage = self.smem_budget().storage_struct()
        tiles = ws.gt.shape[0] // heads
        self.kernel(tma, inputs, ws, scalars, cu_seqlens, tile_base).launch(
            grid=(self.grid_slots(tiles), heads, 1), block=(self.num_threads, 1, 1), stream=stream,
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=SMEM_CARVEOUT_PERCENT,
        )

    def grid_slots(self, tiles):
        """The grid's extent over a head's ``tiles`` workspace slots: a CTA a slot."""
        return tiles

    @cute.kernel
    def kernel(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles, scalars: PrepareScalars,
               cu_seqlens: Optional[cute.Tensor], tile_base: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        tile_slot, head, _ = cute.arch.block_idx()
        tiles, heads, _ = cute.arch.grid_dim()
        row0, valid_rows, exists, _ = self.locate_tile(tile_slot, scalars.seq_len, cu_seqlens, tile_base)
        qk_head = head
        if cutlass.const_expr(self.grouped):
            qk_head = head // (heads // inputs.q.shape[1])
        if exists:
            self.prepare_tile(tma, inputs, ws, scalars, head, qk_head, head * tiles + tile_slot, row0, valid_rows)

    @cute.jit
    def start_tile(self, storage=None) -> tuple:
        """(thread, warp, lane, the CTA's shared storage, the layout of its token tiles); ``storage`` the storage
        allocated already (else it is allocated here: once a kernel)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        tile_layout = plan.chunk_tile(self.dim)
        if cutlass.const_expr(storage is None):
            storage = SmemAllocator().allocate(self.shared_storage)
        return tidx, warp_idx, lane, storage, tile_layout

    @staticmethod
    def swizzled_views(layout, *buffers, dtype: Optional[type] = None) -> tuple:
        """Shared-memory tensors of ``buffers`` with the swizzled ``layout`` (a composed layout), of the buffers'
        element type or ``dtype``."""
        return tuple(buffer.get_tensor(layout.outer, swizzle=layout.inner, dtype=dtype) for buffer in buffers)

    def input_views(self, layout, *buffers) -> tuple:
        """:meth:`swizzled_views` of the TMA-loaded input tiles in :attr:`dtype`: the same bytes as their bf16
        views, which the decayed operands then overwrite (fp16 and bf16 tiles share the layout)."""
        return self.swizzled_views(layout, *buffers, dtype=self.dtype)

    @staticmethod
    def row_views(*buffers) -> tuple:
        """Shared-memory tensors of per-row ``buffers`` (``[16]`` fp32)."""
        return tuple(buffer.get_tensor(plan.row_vector()) for buffer in buffers)

    @cute.jit
    def load_inputs(self, tiles: tuple, tma_barrier, init: bool = True):
        """Warp 0: one transaction barrier, TMA tile loads; ``tiles`` is ``((atom, tma_tensor), smem, head, row0)``
        per tile, ``row0`` its first token row. ``init``: the barrier is initialised here (else it was, and this
        load is its next phase)."""
        with cute.arch.elect_one():
            if cutlass.const_expr(init):
                cute.arch.mbarrier_init(tma_barrier, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(tma_barrier, len(tiles) * plan.input_tile_bytes(self.dim))
        for (atom, tma_tensor), smem, head, row0 in tiles:
            s_part, g_part = head_tile_tma_partition(
                atom, cute.domain_offset((row0, 0, 0), tma_tensor), smem, head, self.tile
            )
            cute.copy(atom, g_part[None, 0], s_part, tma_bar_ptr=tma_barrier)

    @cute.jit
    def activate_beta(self, beta_in: cute.Tensor, ws_beta: cute.Tensor, s_beta: cute.Tensor,
                      head: Int32, slot: Int32, row0: Int32, valid_rows: Int32, row: Int32, raw=None):
        """β of one row: sigmoid of the logit (or as given), 0 on invalid rows; smem + workspace. ``raw``: the row's
        β input already loaded (else it is loaded here)."""
        value = Float32(0.0)
        if row < valid_rows:
            value = (beta_in[row0 + row, head] if cutlass.const_expr(raw is None) else raw).to(Float32)
            if cutlass.const_expr(self.beta_logits):
                value = sigmoid_approx(value)
        s_beta[row] = value
        ws_beta[slot, row] = value

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
        return self.converted(make_fragment(tiled_mma, Operand.A, dtype), acc)

    @cute.jit
    def widened(self, tiled_mma, frag: cute.Tensor) -> cute.Tensor:
        """fp32 C fragment holding the (exact) values of a 16-bit A fragment."""
        return self.converted(make_fragment(tiled_mma, Operand.C, Float32), frag)

    @cute.jit
    def converted(self, out: cute.Tensor, frag: cute.Tensor) -> cute.Tensor:
        """``out`` filled with ``frag``'s values converted to ``out``'s element type."""
        for i in cutlass.range_constexpr(cute.size(frag)):
            out[i] = frag[i].to(out.element_type)
        return out

    @cute.jit
    def right_factor(self, tiled_mma, x_a: cute.Tensor) -> cute.Tensor:
        """B fragment of X (X as the right factor of a product), from X's A/C registers."""
        x_b = make_fragment(tiled_mma, Operand.B, Float16)
        transpose_c_to_b(x_a, x_b)
        return x_b

    @cute.jit
    def store_mqk(self, a_qk: cute.Tensor, ws_mqk: cute.Tensor, slot: Int32, lane: Int32, causal: bool = True):
        """``Mqk = bf16(A_qk[i, j])`` for i ≥ j, else 0, from ``A_qk``'s fp32 C fragment, to slot ``slot``; without
        ``causal`` every entry (a pair's cross blocks)."""
        mma_bf16 = warp_tiled_mma(BFloat16, Float32)
        thr = mma_bf16.get_slice(lane)
        coords = thr.partition_C(cute.make_identity_tensor((WARP_TILE, WARP_TILE)))
        mqk = make_fragment(mma_bf16, Operand.C, BFloat16)
        for i in cutlass.range_constexpr(cute.size(a_qk)):
            row, col = coords[i]
            if cutlass.const_expr(causal):
                mqk[i] = Float32(cutlass.select_(row >= col, a_qk[i], Float32(0.0))).to(BFloat16)
            else:
                mqk[i] = a_qk[i].to(BFloat16)
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
