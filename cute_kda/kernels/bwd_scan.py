"""Kernel A: the backward state-gradient scan, one CTA per (sequence, head, V-band), tiles last to first.

Per tile (docs/numerics.md, section "Kernel A"), with the band of the state gradient ``dS32[k, v]``
(the gradient w.r.t. the state after the tile, ``dS'``) fp32 in the compute warps' registers and its
bf16 rounding ``dS`` in shared memory:

```
snapshot ← dS'                                   (bf16; kept for the tile-gradient kernel)
dU = bf16(Mqkᵀ·dO + kr·dS')                      G1, G2 (one fp32 accumulator; 1 + D/16 k-steps)
du = INVᵀ·dU                                     G3 (dU moved C→B by movmatrix)
du → du out (bf16);  dv = bf16(β·du) → dv out    (stmatrix into an output stage)
dS32 ← qdᵀ·dO − kdᵀ·dv + f32(gT·dS32)            G4, G5 and the combine, row block by row block of
dS = bf16(dS32)                                  16 k (the decayed block is the C of G4; stmatrix.trans
                                                 on the [K, V] view; −dv moved C→B by movmatrix)
```

As in K2, the band is not rounded to bf16 once per tile (that drifted over long sequences with
little decay), and the combine reads no band from shared memory.

Every line is separable in the value columns (V is never contracted), so warp ``w`` owns value
columns ``[w·c, (w+1)·c)`` of the CTA's band and the compute warps never wait for each other inside
a tile. The skeleton — roles, pipelines, state I/O, the load and store warps — is K2's
(:class:`~cute_kda.kernels.common.band_scan.BandScan`): warps ``0 .. m-1`` compute (``m = 4``, 2 at
V-split 8), warp ``m`` TMA-loads the input stages (dO band, kd, qd, kr, gT, INV, Mqk, β of the tile),
warp ``m + 1`` stores the output stages (dv and du tiles; TMA for a full tile, the valid rows of a
tail tile by plain stores).

The snapshot of a tile is ``dS'`` as the band buffer holds it (bf16) when the tile starts: each compute
warp bulk-copies its rows of the buffer into the snapshot's state image
(:func:`cute_kda.layouts.fwd_recurrence.state_image`, D / 8 runs of 1-D bulk copies from one lane), and
the combine waits for that read before it writes the rows again; warps of bands under 32 columns store
instead the B fragment of ``dS'`` that G2 loaded (32-bit words from every lane).
Snapshots are kept once per block of ``snapshot_every`` global tiles and at the last tile of each
sequence, bf16 ``[H · slots, D, D]`` state images (:func:`cute_kda.workspace.snapshot_slots`,
:func:`cute_kda.workspace.images_to_states`).
Global tensors: dO / dv / du ``[B, T, H, V]``; dht / dh0 ``[N, H, V, K]`` (none, bf16, fp32).

Inputs are assumed valid (the launcher's callers check them): the K1 workspace of the forward
(:mod:`cute_kda.workspace`), every base address 16-byte aligned, last modes contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..dsl import cute, cutlass  # first: sets the target architecture before the DSL loads

import cutlass.pipeline as pipeline
from cuda.bindings import driver
from cutlass import BFloat16, Float16, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator

from ..layouts import bwd_scan as scan_layouts
from ..layouts import fwd_recurrence as layouts
from ..layouts.bwd_scan import ScanSmemPlan
from ..layouts.fwd_recurrence import OUTPUT_STAGES
from ..numerics import CHUNK, HEAD_DIM
from ..workspace import SNAPSHOT_TILES
from .common.band_scan import BandScan, OutputTile
from .common.copy import aligned_smem_tensor, c_row_half, smem_tensor, transpose_c_to_b
from .common.fastmath import mul_rn


class ScanWorkspace(NamedTuple):
    """The K1 workspace fields Kernel A reads (``R = H · tiles`` rows, :mod:`cute_kda.workspace`)."""

    qd: cute.Tensor  # bf16 [R, 16, D]
    kd: cute.Tensor  # bf16 [R, 16, D]
    kr: cute.Tensor  # bf16 [R, 16, D]
    gt: cute.Tensor  # fp32 [R, D]
    inv: cute.Tensor  # bf16 [R, 16, 16]
    mqk: cute.Tensor  # bf16 [R, 16, 16]
    beta: cute.Tensor  # fp32 [R, 16]


class ScanTma(NamedTuple):
    """(TMA atom, TMA tensor) per moved tensor: loads of dO and the workspace, stores of dv, du."""

    do: tuple
    dv: tuple
    du: tuple
    qd: tuple
    kd: tuple
    kr: tuple
    gt: tuple
    inv: tuple
    mqk: tuple
    beta: tuple


@dataclass(frozen=True)
class ScanSmem:
    """Kernel A's shared-memory tensors, element views (see :mod:`cute_kda.layouts.bwd_scan`)."""

    ds: cute.Tensor  # [v_band, D] bf16 K_INTER: dS as the B operand of kr·dS'
    ds_acc: cute.Tensor  # [D, v_band] MN_INTER view of ds (the combine's C fragments)
    ds_fp32: cute.Tensor  # [v_band, D] fp32 staging (in the union)
    ds_fp32_acc: cute.Tensor  # [D, v_band] view of the staging
    do_t: cute.Tensor  # [v_band, 16, stage] MN_INTER view of the dO tiles (B operand dOᵀ)
    kr: cute.Tensor  # [16, D, stage] K_SW128
    qd_t: cute.Tensor  # [D, 16, stage] MN_SW128 view of qd
    kd_t: cute.Tensor  # [D, 16, stage] MN_SW128 view of kd
    gt: cute.Tensor  # [D, stage] fp32
    inv_t: cute.Tensor  # [16, 16, stage] MN_INTER view of INV
    mqk_t: cute.Tensor  # [16, 16, stage] MN_INTER view of Mqk
    beta: cute.Tensor  # [16, stage] fp32
    dv: cute.Tensor  # [16, v_band, out stage]
    du: cute.Tensor  # [16, v_band, out stage]
    cross_kd_t: Optional[cute.Tensor] = None  # [16, 16, stage] MN_INTER view of P (a pair plan; Pᵀ as A operand)
    cross_qd_t: Optional[cute.Tensor] = None  # Qᵀ likewise


@dataclass(frozen=True)
class ScanTmaSmem:
    """The same bytes as :class:`ScanSmem`, as the TMA sees them: the swizzled tiles (the per-token
    and output band tiles, kd / qd / kr) with the swizzle on the pointer, the others as boxes
    ``(IMAGE_RUN, rows, cols / IMAGE_RUN[, stage])``."""

    do: cute.Tensor
    qd: cute.Tensor
    kd: cute.Tensor
    kr: cute.Tensor
    inv: cute.Tensor
    mqk: cute.Tensor
    dv: cute.Tensor
    du: cute.Tensor
    state: cute.Tensor  # the dS band
    state_fp32: cute.Tensor
    cross_kd: Optional[cute.Tensor] = None
    cross_qd: Optional[cute.Tensor] = None


class ScanViews(NamedTuple):
    """A compute warp's copies (its lane's slices) and the partitions of the shared memory it reads and writes, stage
    mode last (:meth:`BwdScan.warp_views`)."""

    tiled_mma: cute.TiledMma
    ldsm_a: cute.ThrCopy
    ldsm_a_t: cute.ThrCopy
    ldsm_b: cute.ThrCopy
    ldsm_b_t: cute.ThrCopy
    stsm_c: cute.ThrCopy
    stsm_c_t: cute.ThrCopy
    stsm_dv: cute.ThrCopy
    p_kr: cute.Tensor  # (CPY, 1, k_steps, stage)
    p_qd_t: cute.Tensor  # (CPY, k_steps, 1, stage)
    p_kd_t: cute.Tensor
    p_inv_t: cute.Tensor  # (CPY, 1, 1, stage)
    p_mqk_t: cute.Tensor
    p_ds: cute.Tensor  # (CPY, n, k_steps): the warp's rows of dS', the B operand
    p_do_t: cute.Tensor  # (CPY, n, 1, stage)
    p_dv: cute.Tensor
    p_du: cute.Tensor
    p_ds_acc_st: cute.Tensor  # the warp's columns of dS in the [K, V] view, for stmatrix.trans


class BwdScan(BandScan):
    """Kernel A, one compiled variant per static configuration.

    ``dim``: K = V (:data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`; the plan's tiles, k-steps and warp bands follow it,
    as K2's). ``vsplit`` ∈ {1, 2, 4, 8}: CTAs per (sequence, head), each owning ``dim / vsplit`` value columns.
    ``compute_warps`` / ``output_stages``: the plan's (:class:`~cute_kda.layouts.bwd_scan.ScanSmemPlan`);
    ``split_accumulator``: G2's 8 k-steps run on two accumulators (even, odd), added at the end, so the
    chain of dependent mma is half as long. ``snapshot_every``: tiles per snapshot block (:func:`cute_kda.workspace.snapshot_slots`). ``dht`` / ``dh0``: None, ``cutlass.BFloat16`` or ``cutlass.Float32``: the dtype of the ``[N, H, V, K]``
    gradient w.r.t. the final state (in) and w.r.t. the initial state (out); None means zero in and
    no output. ``varlen``: sequences packed along T with ``cu_seqlens``. ``token_outputs`` False: the scan writes
    dh0 only (no dv, du or snapshots; the store warp idles): the first pass of the context-parallel backward
    (:mod:`cute_kda.context_parallel`), which needs each segment's own gradient at its start and nothing else.
    ``dv_dtype``: dv stored in bf16, or in fp16 for fp16 training as ``f16(f32(bf16(β·du)))``, the bits of the copy
    route's ``.to(float16)`` of the bf16 dv (docs/numerics.md, "fp16 training"; −dv in G5 stays the bf16 value).
    """

    def __init__(self, *, vsplit: int = 1, dht: Optional[type] = None, dh0: Optional[type] = None,
                 varlen: bool = False, snapshot_every: int = SNAPSHOT_TILES, compute_warps: Optional[int] = None,
                 output_stages: int = OUTPUT_STAGES, split_accumulator: bool = False,
                 token_outputs: bool = True, dim: int = HEAD_DIM, dv_dtype: type = BFloat16) -> None:
        super().__init__(
            self.make_plan(vsplit=vsplit, state_io_fp32=Float32 in (dht, dh0), compute_warps=compute_warps,
                           output_stages=output_stages, dim=dim),
            initial_state=dht, final_state=dh0, varlen=varlen, reverse=True,
        )
        self.split_accumulator = split_accumulator
        self.token_outputs = token_outputs
        if dv_dtype not in (BFloat16, Float16):
            raise ValueError(f"dv is bf16 or fp16, got {dv_dtype}")
        self.dv_dtype = dv_dtype
        if token_outputs is False and dh0 is None:
            raise ValueError("a scan without token outputs needs dh0 (it would write nothing)")
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.snapshot_every = snapshot_every

    def make_plan(self, **plan) -> ScanSmemPlan:
        """The shared-memory plan of the variant (:class:`~cute_kda.layouts.bwd_scan.ScanSmemPlan`)."""
        return ScanSmemPlan(**plan)

    def output_dtype(self, name: str) -> type:
        """dv's tile in :attr:`dv_dtype`, du's in bf16 (Kernel B reads it)."""
        return self.dv_dtype if name == "dv" else self.token_dtype

    # -----------------------------------------------------------------------------------------
    # host

    @cute.jit
    def __call__(
        self,
        do: cute.Tensor,
        dv: cute.Tensor,
        du: cute.Tensor,
        ws: ScanWorkspace,
        snapshots: cute.Tensor,
        dht: Optional[cute.Tensor],
        dh0: Optional[cute.Tensor],
        cu_seqlens: Optional[cute.Tensor],
        tile_base: Optional[cute.Tensor],
        cross_kd: Optional[cute.Tensor],
        cross_qd: Optional[cute.Tensor],
        stream: driver.CUstream,
    ):
        """Launch Kernel A. do, dv, du ``[B, T, H, D]``; snapshots ``[H·slots, D, D]``; dht, dh0 ``[N, H, D, D]``;
        ``cross_kd``, ``cross_qd`` the pair workspace's cross blocks ``[H · tiles, 16, 16]`` (a pair plan), else
        None."""
        heads = do.shape[2]
        num_seqs = do.shape[0]
        if const_expr(self.varlen):
            num_seqs = cu_seqlens.shape[0] - 1
        tiles_per_head = ws.qd.shape[0] // heads

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        band, dim = self.v_band, self.dim
        tma = ScanTma(
            do=self.token_tile_atom(load, do),
            dv=self.token_tile_atom(store, dv),
            du=self.token_tile_atom(store, du),
            qd=self.workspace_tile_atom(load, ws.qd),
            kd=self.workspace_tile_atom(load, ws.kd),
            kr=self.workspace_tile_atom(load, ws.kr),
            gt=self.vector_atom(ws.gt, dim),
            inv=self.runs_atom(load, layouts.tile_runs_view(ws.inv), CHUNK, CHUNK),
            mqk=self.runs_atom(load, layouts.tile_runs_view(ws.mqk), CHUNK, CHUNK),
            beta=self.vector_atom(ws.beta, CHUNK),
        )
        tma_dht, gmem_dht = None, None
        if const_expr(dht is not None):
            tma_dht, gmem_dht = self.runs_atom(load, layouts.state_runs_view(dht), band, dim)
        tma_dh0, gmem_dh0 = None, None
        if const_expr(dh0 is not None):
            tma_dh0, gmem_dh0 = self.runs_atom(store, layouts.state_runs_view(dh0), band, dim)
        tma_cross_kd, gmem_cross_kd, tma_cross_qd, gmem_cross_qd = None, None, None, None
        if const_expr(cross_kd is not None):
            tma_cross_kd, gmem_cross_kd = self.runs_atom(load, layouts.tile_runs_view(cross_kd), CHUNK, CHUNK)
            tma_cross_qd, gmem_cross_qd = self.runs_atom(load, layouts.tile_runs_view(cross_qd), CHUNK, CHUNK)

        self.shared_storage = self.make_shared_storage()
        self.kernel(
            tma, tma_dht, gmem_dht, tma_dh0, gmem_dh0, dv, du, snapshots, cu_seqlens, tile_base,
            Int32(tiles_per_head), Int32(snapshots.shape[0] // heads),
            tma_cross_kd, gmem_cross_kd, tma_cross_qd, gmem_cross_qd,
        ).launch(
            grid=[self.vsplit * num_seqs, heads, 1],  # the bands of one (sequence, head) are adjacent CTAs
            block=[self.threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,  # without a launch bound ptxas caps the registers at 64 and spills at V-split 1
        )

    # -----------------------------------------------------------------------------------------
    # device

    @cute.kernel
    def kernel(
        self,
        tma: ScanTma,
        tma_dht: Optional[cute.CopyAtom], gmem_dht: Optional[cute.Tensor],
        tma_dh0: Optional[cute.CopyAtom], gmem_dh0: Optional[cute.Tensor],
        dv: cute.Tensor,
        du: cute.Tensor,
        snapshots: cute.Tensor,
        cu_seqlens: Optional[cute.Tensor],
        tile_base: Optional[cute.Tensor],
        tiles_per_head: Int32,
        slots_per_head: Int32,
        tma_cross_kd: Optional[cute.CopyAtom], gmem_cross_kd: Optional[cute.Tensor],
        tma_cross_qd: Optional[cute.CopyAtom], gmem_cross_qd: Optional[cute.Tensor],
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        band_seq, head, _ = cute.arch.block_idx()
        seq, band = band_seq // self.vsplit, band_seq % self.vsplit
        batch, first_row, seq_len, num_tiles, ws_row0 = self.locate_sequence(
            seq, head, Int32(dv.shape[1]), tiles_per_head, cu_seqlens, tile_base
        )
        smem, tma_smem, storage = self.carve_smem()
        load_pipe, store_pipe, state_mbar = self.make_pipelines(warp_idx, storage)

        dht_tiles = None
        if const_expr(self.initial_state is not None):
            dht_tiles = self.state_tile(gmem_dht, seq, head, band)
        self.load_initial_state(warp_idx, tidx, tma_dht, dht_tiles, state_mbar,
                                smem.ds, smem.ds_fp32, tma_smem.state, tma_smem.state_fp32)
        # the fp32 band lives in the compute warps' registers for the whole kernel
        ds32 = self.band_blocks()
        if warp_idx < self.mma_warps:
            self.load_band32(warp_idx, ds32, smem.ds_acc, smem.ds_fp32_acc)
        if const_expr(self.initial_state is Float32):
            cute.arch.barrier()  # the staging is read before the load warp's first stage reuses its bytes

        if warp_idx < self.mma_warps:
            # the sequence's tile 0 is global tile ws_row0 - head · tiles_per_head
            first_tile, snapshot_row0 = self.kept_origin(ws_row0 - head * tiles_per_head, seq, head, slots_per_head)
            self.compute(warp_idx, band, num_tiles, first_tile, snapshot_row0,
                         load_pipe, store_pipe, smem, ds32, snapshots)
        elif warp_idx == self.load_warp:
            loads = (
                (tma.do[0], self.band_tiles(tma.do[1], head, batch, first_row, band), tma_smem.do),
                (tma.qd[0], self.workspace_rows(tma.qd[1]), tma_smem.qd),
                (tma.kd[0], self.workspace_rows(tma.kd[1]), tma_smem.kd),
                (tma.kr[0], self.workspace_rows(tma.kr[1]), tma_smem.kr),
                (tma.inv[0], self.workspace_tiles(tma.inv[1], CHUNK), tma_smem.inv),
                (tma.mqk[0], self.workspace_tiles(tma.mqk[1], CHUNK), tma_smem.mqk),
                (tma.gt[0], cute.local_tile(tma.gt[1], (self.dim,), (0, None)), smem.gt),
                (tma.beta[0], cute.local_tile(tma.beta[1], (CHUNK,), (0, None)), smem.beta),
            )
            if const_expr(self.plan.pairs):
                loads += ((tma_cross_kd, self.workspace_tiles(gmem_cross_kd, CHUNK), tma_smem.cross_kd),
                          (tma_cross_qd, self.workspace_tiles(gmem_cross_qd, CHUNK), tma_smem.cross_qd))
            self.load(num_tiles, ws_row0, load_pipe, loads)
        elif const_expr(self.token_outputs):
            # plain views of this (batch, head, band) from the sequence start, for tail rows
            band_col = band * self.v_band
            outputs = (
                OutputTile(tma.dv[0], tma_smem.dv, smem.dv, self.band_tiles(tma.dv[1], head, batch, first_row, band),
                           cute.domain_offset((first_row, band_col), dv[batch, None, head, None])),
                OutputTile(tma.du[0], tma_smem.du, smem.du, self.band_tiles(tma.du[1], head, batch, first_row, band),
                           cute.domain_offset((first_row, band_col), du[batch, None, head, None])),
            )
            self.store(seq_len, num_tiles, store_pipe, outputs)

        # dh0: bf16 is the band buffer as it stands; fp32 is dS32, staged by the compute warps
        cute.arch.fence_view_async_shared()  # stmatrix writes of dS → visible to the TMA store
        cute.arch.barrier()
        if const_expr(self.final_state is Float32):
            if warp_idx < self.mma_warps:
                self.stage_band32(warp_idx, ds32, smem.ds_fp32_acc)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()
        if const_expr(self.final_state is not None):
            self.store_final_state(warp_idx, tidx, tma_dh0, self.state_tile(gmem_dh0, seq, head, band),
                                   smem.ds, smem.ds_fp32, tma_smem.state, tma_smem.state_fp32, staged=True)

    @cute.jit
    def carve_smem(self):
        """Element views and TMA views of the CTA's shared memory (:class:`ScanSmemPlan`, in its order)."""
        plan = self.plan
        storage = SmemAllocator().allocate(self.shared_storage)
        ds_ptr, union_ptr, at = self.smem_pointers(storage)
        stages, out_stages = plan.input_stages, plan.output_stages
        bf16 = BFloat16
        cross = {}
        if const_expr(plan.pairs):
            cross = {f"{name}_t": smem_tensor(at[name], scan_layouts.square_tile_transposed(plan), bf16)
                     for name in layouts.CROSS_FIELDS}
        smem = ScanSmem(
            ds=smem_tensor(ds_ptr, layouts.state_b(plan), bf16),
            ds_acc=smem_tensor(ds_ptr, layouts.state_acc(plan), bf16),
            ds_fp32=smem_tensor(union_ptr, layouts.state_fp32(plan), Float32),
            ds_fp32_acc=smem_tensor(union_ptr, layouts.state_fp32_acc(plan), Float32),
            do_t=smem_tensor(at["do"], scan_layouts.token_tile_transposed(plan, stages), bf16),
            kr=aligned_smem_tensor(at["kr"], layouts.chunk_operand(plan), bf16),
            qd_t=aligned_smem_tensor(at["qd"], layouts.chunk_operand_transposed(plan), bf16),
            kd_t=aligned_smem_tensor(at["kd"], layouts.chunk_operand_transposed(plan), bf16),
            gt=smem_tensor(at["gt"], layouts.vector(self.dim, stages), Float32),
            inv_t=smem_tensor(at["inv"], scan_layouts.square_tile_transposed(plan), bf16),
            mqk_t=smem_tensor(at["mqk"], scan_layouts.square_tile_transposed(plan), bf16),
            beta=smem_tensor(at["beta"], layouts.vector(CHUNK, stages), Float32),
            dv=smem_tensor(at["dv"], layouts.value_tile(plan, out_stages), self.dv_dtype),
            du=smem_tensor(at["du"], layouts.value_tile(plan, out_stages), bf16),
            **cross,
        )
        tma_smem = ScanTmaSmem(**self.tma_boxes(ds_ptr, union_ptr, at))
        return smem, tma_smem, storage

    # -----------------------------------------------------------------------------------------
    # compute warps

    def dv_copy(self, tiled_mma: cute.TiledMma) -> cute.TiledCopy:
        """The stmatrix tiled copy of dv's C fragments into its output stage, in :attr:`dv_dtype` (the warp
        copies' ``stsm_c`` is bf16, du's)."""
        atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, self.band_matrices), self.dv_dtype)
        return cute.make_tiled_copy_C(atom, tiled_mma)

    @cute.jit
    def stored_dv(self, value: BFloat16):
        """dv as :attr:`dv_dtype` stores it: the bf16 value, or ``f16(f32(value))`` (exact but for fp16's
        subnormals and overflow: torch's ``.to(float16)`` of the bf16 tensor)."""
        if const_expr(self.dv_dtype is BFloat16):
            return value
        return value.to(Float32).to(Float16)

    @cute.jit
    def round_du_dv(self, du: cute.Tensor, beta: tuple, r_du: cute.Tensor, r_dv: cute.Tensor, r_ndv: cute.Tensor):
        """From G3's fp32 ``du`` (a C fragment) and the rows' ``beta``: ``r_du = bf16(du)``, ``r_dv`` dv as stored
        (:meth:`stored_dv` of ``bf16(β·du)``) and ``r_ndv = bf16(−β·du)`` (the exact negation of bf16 dv)."""
        for i in cutlass.range_constexpr(cute.size(du)):
            scaled = du[i] * beta[c_row_half(i)]
            r_du[i] = BFloat16(du[i])
            r_dv[i] = self.stored_dv(BFloat16(scaled))
            r_ndv[i] = BFloat16(-scaled)

    def warp_views(self, warp_idx: Int32, smem: ScanSmem, lane: Int32) -> ScanViews:
        """The :class:`ScanViews` of compute warp ``warp_idx``: its ``warp_cols`` columns of dS (both views), of dOᵀ
        and of the dv / du output tiles, and the whole tiles of kr, qdᵀ, kdᵀ, INVᵀ, Mqkᵀ."""
        cols, dim = self.warp_cols, self.dim
        tiled_mma = self.warp_mma()
        ldsm_a, ldsm_a_t, ldsm_b, ldsm_b_t, _, stsm_c, stsm_c_t = self.thread_copies(tiled_mma, lane)
        stsm_dv = self.dv_copy(tiled_mma).get_slice(lane)
        w_ds = cute.local_tile(smem.ds, (cols, dim), (warp_idx, 0))  # [cols, K]
        w_ds_acc = cute.local_tile(smem.ds_acc, (dim, cols), (0, warp_idx))  # [K, cols]
        w_do_t = cute.local_tile(smem.do_t, (cols, CHUNK), (warp_idx, 0, None))  # [cols, 16, stage]
        w_dv = cute.local_tile(smem.dv, (CHUNK, cols), (0, warp_idx, None))  # [16, cols, stage]
        w_du = cute.local_tile(smem.du, (CHUNK, cols), (0, warp_idx, None))
        return ScanViews(
            tiled_mma, ldsm_a, ldsm_a_t, ldsm_b, ldsm_b_t, stsm_c, stsm_c_t, stsm_dv,
            p_kr=ldsm_a.partition_S(smem.kr), p_qd_t=ldsm_a_t.partition_S(smem.qd_t),
            p_kd_t=ldsm_a_t.partition_S(smem.kd_t), p_inv_t=ldsm_a_t.partition_S(smem.inv_t),
            p_mqk_t=ldsm_a_t.partition_S(smem.mqk_t), p_ds=ldsm_b.partition_S(w_ds),
            p_do_t=ldsm_b_t.partition_S(w_do_t), p_dv=stsm_dv.partition_D(w_dv), p_du=stsm_c.partition_D(w_du),
            p_ds_acc_st=stsm_c_t.partition_D(w_ds_acc),
        )

    @cute.jit
    def compute(
        self, warp_idx: Int32, band: Int32, num_tiles: Int32, first_tile: Int32, snapshot_row0: Int32,
        load_pipe: pipeline.PipelineTmaAsync, store_pipe: pipeline.PipelineAsync, smem: ScanSmem,
        ds32: tuple, snapshots: cute.Tensor,
    ):
        """G1-G5 and the combine per tile on the warp's ``warp_cols`` value columns (module docstring).

        ``snapshot_row0 + g // snapshot_every`` is the snapshot row of global tile ``g`` (the
        sequence's tiles are ``first_tile ..``), written when ``g`` ends a block or the sequence.
        ``ds32``: the fp32 band of the warp's columns (:meth:`band_blocks`, updated in place).
        """
        lane = cute.arch.lane_idx()
        group = lane // 4  # fragment row g (rows g and g + 8)
        cols = self.warp_cols
        dim = self.dim
        k_steps = dim // CHUNK

        (tiled_mma, ldsm_a, ldsm_a_t, ldsm_b, ldsm_b_t, stsm_c, stsm_c_t, stsm_dv, p_kr, p_qd_t, p_kd_t, p_inv_t,
         p_mqk_t, p_ds, p_do_t, p_dv, p_du, p_ds_acc_st) = self.warp_views(warp_idx, smem, lane)

        # register fragments
        r_kr = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((CHUNK, dim)))  # ((2,2,2), 1, k_steps)
        r_qd_t = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((dim, CHUNK)))  # ((2,2,2), k_steps, 1)
        r_kd_t = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((dim, CHUNK)))
        r_ds = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((cols, dim)))  # ((2,2), n, k_steps)
        r_square = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((CHUNK, CHUNK)))  # Mqkᵀ, then INVᵀ
        r_do_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((cols, CHUNK)))  # dOᵀ (G1 and G4)
        r_c16_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((cols, CHUNK)))  # dU as B (G3)
        r_ndv_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((cols, CHUNK)))  # −dv as B (G5)
        c_shape = tiled_mma.partition_shape_C((CHUNK, cols))  # ((2,2), 1, n)
        acc = tiled_mma.make_fragment_C(c_shape)  # dU, then du
        acc_ds = tiled_mma.make_fragment_C(c_shape)  # G2's second accumulator (split_accumulator)
        r_c16 = cute.make_rmem_tensor(c_shape, BFloat16)  # dU, then du (bf16 C fragments)
        r_dv = cute.make_rmem_tensor(c_shape, self.dv_dtype)
        r_ndv = cute.make_rmem_tensor(c_shape, BFloat16)
        r_ds_acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((dim, cols)), BFloat16)  # dS, a row block at a time
        ds_words = cute.recast_tensor(r_ds_acc, Uint32)  # ((1,2), k_steps, n): pairs of value columns

        v_kr = ldsm_a.retile(r_kr)
        v_qd_t = ldsm_a_t.retile(r_qd_t)
        v_kd_t = ldsm_a_t.retile(r_kd_t)
        v_ds = ldsm_b.retile(r_ds)
        v_square = ldsm_a_t.retile(r_square)
        v_do_b = ldsm_b_t.retile(r_do_b)
        v_dv = stsm_dv.retile(r_dv)
        v_du = stsm_c.retile(r_c16)
        v_ds_acc_st = stsm_c_t.retile(r_ds_acc)

        load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.plan.input_stages)
        out_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.plan.output_stages)
        for step in cutlass.range(num_tiles, unroll=1):
            tile = self.tile_at(step, num_tiles)
            # dS' entering the tile, as the band buffer holds it (the last tile's writes are fenced)
            global_tile = first_tile + tile
            take_snapshot = (global_tile % self.snapshot_every == self.snapshot_every - 1) or (tile == num_tiles - 1)
            snapshot = self.band_image(snapshots, snapshot_row0 + global_tile // self.snapshot_every)
            if const_expr(self.image_by_bulk and self.token_outputs):
                if take_snapshot:
                    self.store_band_image(snapshot, smem.ds, band, warp_idx)
            load_pipe.consumer_wait(load_state)
            stage = load_state.index

            # G1 + G2: dU = Mqkᵀ·dO + kr·dS' (one accumulator); operands of step k+1 load before mma k
            acc.fill(0.0)
            cute.copy(ldsm_a_t, p_mqk_t[None, None, None, stage], v_square)
            cute.copy(ldsm_b_t, p_do_t[None, None, None, stage], v_do_b)
            cute.copy(ldsm_a, p_kr[None, None, 0, stage], v_kr[None, None, 0])
            cute.copy(ldsm_b, p_ds[None, None, 0], v_ds[None, None, 0])
            cute.gemm(tiled_mma, acc, r_square[None, None, 0], r_do_b[None, None, 0], acc)
            if const_expr(self.split_accumulator):
                acc_ds.fill(0.0)
            for k in cutlass.range_constexpr(k_steps):
                if const_expr(k + 1 < k_steps):
                    cute.copy(ldsm_a, p_kr[None, None, k + 1, stage], v_kr[None, None, k + 1])
                    cute.copy(ldsm_b, p_ds[None, None, k + 1], v_ds[None, None, k + 1])
                target = acc_ds if const_expr(self.split_accumulator and k % 2 == 1) else acc
                cute.gemm(tiled_mma, target, r_kr[None, None, k], r_ds[None, None, k], target)
            if const_expr(not self.image_by_bulk and self.token_outputs):
                if take_snapshot:  # narrow bands: dS' as G2 loaded it
                    self.store_band_fragment(snapshot, r_ds, band, warp_idx, lane)
            if const_expr(self.split_accumulator):
                acc.store(acc.load() + acc_ds.load())
            r_c16.store(acc.load().to(BFloat16))

            # G3: du = INVᵀ·dU, dU moved C → B in registers
            transpose_c_to_b(r_c16, r_c16_b)
            cute.copy(ldsm_a_t, p_inv_t[None, None, None, stage], v_square)
            acc.fill(0.0)
            cute.gemm(tiled_mma, acc, r_square[None, None, 0], r_c16_b[None, None, 0], acc)

            # du and dv = bf16(β·du) → output stage; −dv (exact negation) as the B operand of G5
            beta = self.fragment_rows(smem.beta, stage, group)
            self.round_du_dv(acc, beta, r_c16, r_dv, r_ndv)
            if const_expr(self.token_outputs):
                self.store_outputs(store_pipe, out_state, ((stsm_dv, v_dv, p_dv), (stsm_c, v_du, p_du)))
                out_state.advance()
            transpose_c_to_b(r_ndv, r_ndv_b)

            # G4 + G5 + combine, row block m of 16 k: dS32 ← qdᵀ·dO − kdᵀ·dv + f32(gT·dS32) (the decayed
            # block is the C of G4), then dS = bf16(dS32) → the band buffer (after the snapshot's copy has read
            # it); block m+1's qdᵀ, kdᵀ and gT are read before block m is stored
            if const_expr(self.image_by_bulk and self.token_outputs):
                if take_snapshot:
                    self.wait_band_image_read()
            cute.copy(ldsm_a_t, p_qd_t[None, 0, None, stage], v_qd_t[None, 0, None])
            cute.copy(ldsm_a_t, p_kd_t[None, 0, None, stage], v_kd_t[None, 0, None])
            decay = self.fragment_rows(smem.gt, stage, group, 0)
            for m in cutlass.range_constexpr(k_steps):
                block = ds32[m]
                for i in cutlass.range_constexpr(cute.size(block)):
                    block[i] = mul_rn(decay[c_row_half(i)], block[i])
                cute.gemm(tiled_mma, block, r_qd_t[None, m, None], r_do_b[None, None, 0], block)
                cute.gemm(tiled_mma, block, r_kd_t[None, m, None], r_ndv_b[None, None, 0], block)
                if const_expr(m + 1 < k_steps):
                    cute.copy(ldsm_a_t, p_qd_t[None, m + 1, None, stage], v_qd_t[None, m + 1, None])
                    cute.copy(ldsm_a_t, p_kd_t[None, m + 1, None, stage], v_kd_t[None, m + 1, None])
                    decay = self.fragment_rows(smem.gt, stage, group, m + 1)
                self.round_block(block, ds_words, m)
                cute.copy(stsm_c_t, v_ds_acc_st[None, m, None], p_ds_acc_st[None, m, None])

            # the warp's dS columns and its reads of this stage are complete before lane 0 releases it (and its
            # band writes fenced for the next tile's snapshot copy)
            if const_expr(self.image_by_bulk and self.token_outputs):
                cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()
            load_pipe.consumer_release(load_state)
            load_state.advance()
