"""The skeleton shared by the band-scan kernels: one CTA per (sequence, head, V-band), serial over tiles.

K2 (the forward recurrence, tiles first to last) and Kernel A (the backward state-gradient scan,
tiles last to first) are the same machine with other arithmetic:

- a bf16 ``[v_band, D]`` band of a state-like matrix (the state ``S``, or its gradient ``dS``) in
  shared memory for the whole kernel, loaded from and stored to ``[N, H, V, K]`` tensors (none,
  bf16, or fp32 through a staging buffer that shares its bytes with the pipeline buffers); K2 also
  keeps the band in fp32 in the compute warps' registers (:meth:`BandScan.band_blocks`), the smem
  band being its bf16 rounding;
- a load warp that TMA-loads one input stage per tile (a per-token ``[16, v_band]`` tile and the
  seven K1 workspace fields of the tile) under one transaction barrier of a ``PipelineTmaAsync``;
- compute warps, warp ``w`` owning value columns ``[w·c, (w+1)·c)`` of the band (every line of both
  scans is separable in the value columns, so the compute warps never wait for each other);
- a store warp that drains the output stages of a ``PipelineAsync`` (a TMA store for a full tile,
  plain stores of the valid rows for a tail tile, so the next sequence's rows are never written).

:class:`BandScan` holds what does not depend on the arithmetic: the static configuration, sequence
lookup, pipelines, the load and store roles, state I/O and the compute warps' tiled MMA and copies.
A kernel subclasses it and brings its own ``__call__``, ``kernel`` and ``compute``.
"""

from typing import NamedTuple, Optional

from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.experimental.primitives import cp_async_bulk_global_shared_cta

import cutlass.pipeline as pipeline

from ...dsl import cute, cutlass
from ...layouts import fwd_recurrence as layouts
from ...layouts.smem import vector
from ...layouts.tma import contiguous_col_run
from ...numerics import CHUNK
from .copy import c_row_half, smem_tensor, tma_store_tiles
from .fastmath import pack_bf16x2

BULK_IMAGE_COLS = 32  # narrowest warp band whose kept rows leave by bulk copies
STAGED_STATES = (Float32, Float16)  # state dtypes that pass through the staging buffer, converted in shared memory


class WarpCopies(NamedTuple):
    """Tiled copies of a compute warp, by operand and direction (which smem view each one reads)."""

    ldsm_a: cute.TiledCopy  # A from K_INTER: [16, D] row tiles; [16, 16] squares
    ldsm_a_t: cute.TiledCopy  # A from MN_INTER: transposed views ([D, 16], [16, 16])
    ldsm_b: cute.TiledCopy  # B from K_INTER: the warp's band rows [cols, K]
    ldsm_b_t: cute.TiledCopy  # B from MN_INTER: the warp's columns of a token tile, as [cols, 16]
    ldsm_c: cute.TiledCopy  # C from K_INTER: the warp's columns of a token tile [16, cols]
    stsm_c: cute.TiledCopy  # C to K_INTER: the warp's columns of an output tile [16, cols]
    stsm_c_t: cute.TiledCopy  # C to MN_INTER: the warp's band columns [K, cols]


class OutputTile(NamedTuple):
    """One per-token output of the store warp: its TMA atom, staged smem (TMA box and element views),
    the gmem TMA tiles of the CTA's band and the plain ``[rows, v_band]`` view for tail rows."""

    atom: cute.CopyAtom
    tma_smem: cute.Tensor  # [16, v_band, stage] with the swizzle on the pointer, or (IMAGE_RUN, 16, v_band / IMAGE_RUN, stage)
    smem: cute.Tensor  # [16, v_band, stage]
    gmem_tiles: cute.Tensor  # (16, v_band, tile), or (IMAGE_RUN, 16, v_band / IMAGE_RUN, tile)
    rows: cute.Tensor  # [tokens of the sequence, v_band]


def _stage_stores(outputs: tuple, parts: list, stage, tile) -> list:
    """(atom, smem stage, gmem tile) of every output: the TMA stores of one full output stage."""
    return [(out.atom, s_part[None, stage], g_part[None, tile]) for out, (s_part, g_part) in zip(outputs, parts)]


class BandScan:
    """Static configuration and shared roles of a band-scan kernel (module docstring).

    ``plan``: the kernel's :class:`~cute_kda.layouts.fwd_recurrence.RecurrenceSmemPlan` (or a
    subclass). ``initial_state`` / ``final_state``: None, ``cutlass.BFloat16`` or ``cutlass.Float32``
    (the dtype of the ``[N, H, V, K]`` tensors the band is loaded from before the tile loop and stored
    to after it). ``varlen``: sequences packed along T with ``cu_seqlens``. ``reverse``: tiles run
    from the last to the first. ``token_dtype``: the per-token input and output tiles' (bf16, or fp16: the same
    16-bit layouts and ldmatrix / stmatrix, other conversions). ``state_dtypes``: the state dtypes the kernel
    takes; a :data:`STAGED_STATES` one passes through the staging buffer (:attr:`staging`, its element type), so
    an fp16 and an fp32 state do not meet in one variant.
    """

    def __init__(self, plan, *, initial_state: Optional[type], final_state: Optional[type], varlen: bool,
                 reverse: bool, token_dtype: type = BFloat16, state_dtypes: tuple = (BFloat16, Float32)) -> None:
        if token_dtype not in (BFloat16, Float16):
            raise ValueError(f"token_dtype must be BFloat16 or Float16, got {token_dtype}")
        for name, dtype in (("initial_state", initial_state), ("final_state", final_state)):
            if dtype is not None and dtype not in state_dtypes:
                names = ", ".join(d.__name__ for d in state_dtypes)
                raise ValueError(f"{name} must be None or one of {names}, got {dtype}")
        staged = {dtype for dtype in (initial_state, final_state) if dtype in STAGED_STATES}
        if len(staged) > 1:
            raise ValueError("an fp16 and an fp32 state would share the staging buffer: give both states one of them")
        self.staging = staged.pop() if staged else Float32
        self.plan = plan
        self.token_dtype = token_dtype
        self.vsplit = plan.vsplit
        self.initial_state = initial_state
        self.final_state = final_state
        self.varlen = varlen
        self.reverse = reverse
        self.v_band = plan.v_band
        self.warp_cols = plan.warp_cols
        self.dim = plan.dim
        self.mma_warps = plan.mma_warps
        self.load_warp = plan.mma_warps
        self.store_warp = plan.mma_warps + 1
        self.threads = (plan.mma_warps + 2) * 32
        self.mma_threads = plan.mma_warps * 32
        # 8x8 matrices per ldmatrix/stmatrix of the warp's band: x4 covers 16 columns, x2 covers 8
        self.band_matrices = 4 if self.warp_cols >= 16 else 2

    # -----------------------------------------------------------------------------------------
    # host (inside the @cute.jit launcher)

    @staticmethod
    def runs_atom(op, view: cute.Tensor, rows: int, cols: int):
        """TMA atom and tensor moving ``[rows, cols]`` K_INTER tiles of a runs view as one box."""
        box = layouts.tma_box(rows, cols)
        return cpasync.make_tiled_tma_atom(op, view, box, (layouts.IMAGE_RUN, rows, cols // layouts.IMAGE_RUN))

    def token_tile_atom(self, op, tensor: cute.Tensor):
        """TMA atom and tensor moving the CTA's ``[16, v_band]`` band tiles of a ``[B, T, H, D]`` tensor as one
        box: of swizzled rows (:func:`~cute_kda.layouts.fwd_recurrence.value_tile`), or of the K_INTER
        tile's 16-byte runs for a plan without ``swizzled_tokens``."""
        if const_expr(not self.plan.swizzled_tokens):
            return self.runs_atom(op, layouts.token_runs_view(tensor), CHUNK, self.v_band)
        box = layouts.value_tile(self.plan, 0)
        view = layouts.token_band_view(tensor, contiguous_col_run(box))
        return cpasync.make_tiled_tma_atom(op, view, box, (CHUNK, self.v_band))

    def workspace_tile_atom(self, op, field: cute.Tensor):
        """TMA atom and tensor moving a workspace field's ``[16, D]`` K_SW128 tiles (kd, qd, kr) as one box
        of 128-byte rows (:func:`~cute_kda.layouts.fwd_recurrence.tile_rows_view`)."""
        box = layouts.chunk_operand(self.plan, stages=0)
        view = layouts.tile_rows_view(field, contiguous_col_run(box))
        return cpasync.make_tiled_tma_atom(op, view, box, (CHUNK, self.dim))

    @staticmethod
    def vector_atom(field: cute.Tensor, n: int):
        """TMA atom and tensor of the ``[rows, n]`` workspace vectors (gT, β), one row per copy."""
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), layouts.vector_rows_view(field), vector(n), (n,)
        )

    def make_shared_storage(self):
        """The kernel's ``cute.struct``: the band, the union (pipelines or fp32 staging), the mbarriers."""
        plan = self.plan

        @cute.struct
        class SharedStorage:  # RecurrenceSmemPlan, in its order
            state: cute.struct.Align[cute.struct.MemRange[BFloat16, plan.v_band * plan.dim], layouts.SWIZZLED_ALIGN]
            union: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, plan.union_bytes], layouts.SWIZZLED_ALIGN]
            load_mbar: cute.struct.MemRange[cutlass.Int64, 2 * plan.input_stages]
            store_mbar: cute.struct.MemRange[cutlass.Int64, 2 * plan.output_stages]
            state_mbar: cute.struct.MemRange[cutlass.Int64, 1]

        return SharedStorage

    # -----------------------------------------------------------------------------------------
    # device: set-up

    def smem_pointers(self, storage):
        """(band pointer, union pointer, union field → pointer of its stage 0) of the allocated storage."""
        state_ptr = storage.state.data_ptr()
        union_ptr = storage.union.data_ptr()
        return state_ptr, union_ptr, {name: union_ptr + offset for name, offset in self.plan.union_offsets().items()}

    def tma_boxes(self, state_ptr, union_ptr, at: dict) -> dict:
        """Every TMA-moved buffer of the plan as its TMA smem tensor, by plan field name: the swizzled tiles (kd,
        qd, kr; the per-token and output tiles when ``plan.swizzled_tokens``) as ``[16, cols, stage]`` with the
        swizzle on the pointer; the others as boxes ``(IMAGE_RUN, rows, cols / IMAGE_RUN[, stage])``."""
        plan, bf16, tokens = self.plan, BFloat16, self.token_dtype
        stages, out_stages = plan.input_stages, plan.output_stages

        def token_box(name: str, count: int, dtype: type = tokens) -> cute.Tensor:
            if plan.swizzled_tokens:
                return smem_tensor(at[name], layouts.value_tile(plan, count), dtype)
            return smem_tensor(at[name], layouts.tma_box(CHUNK, self.v_band, count), dtype)

        boxes = {plan.token_field: token_box(plan.token_field, stages)}
        for name in layouts.SWIZZLED_FIELDS:
            if name in at:  # qd: not in a plan without token outputs
                boxes[name] = smem_tensor(at[name], layouts.chunk_operand(plan), bf16)
        for name in ("inv", "mqk", *(layouts.CROSS_FIELDS if plan.pairs else ())):
            if name in at:
                boxes[name] = smem_tensor(at[name], layouts.tma_box(CHUNK, CHUNK, stages), bf16)
        for name in plan.outputs:
            boxes[name] = token_box(name, out_stages, self.output_dtype(name))
        boxes["state"] = smem_tensor(state_ptr, layouts.tma_box(self.v_band, self.dim), bf16)
        boxes["state_fp32"] = smem_tensor(union_ptr, layouts.tma_box(self.v_band, self.dim), self.staging)
        return boxes

    def output_dtype(self, name: str) -> type:
        """The element type of the output tile ``name`` (a field of ``plan.output_fields``): :attr:`token_dtype`."""
        return self.token_dtype

    @cute.jit
    def locate_sequence(self, seq: Int32, head: Int32, seq_len_of_batch: Int32, tiles_per_head: Int32,
                        cu_seqlens: Optional[cute.Tensor], tile_base: Optional[cute.Tensor]):
        """(batch index, first row inside the batch, length, tiles, workspace row of its tile 0)."""
        batch = seq
        first_row = Int32(0)
        seq_len = seq_len_of_batch
        first_tile = seq * ((seq_len + CHUNK - 1) // CHUNK)
        if const_expr(self.varlen):
            batch = Int32(0)
            first_row = Int32(cu_seqlens[seq])
            seq_len = Int32(cu_seqlens[seq + 1]) - first_row
            first_tile = Int32(tile_base[seq])
        num_tiles = (seq_len + CHUNK - 1) // CHUNK
        return batch, first_row, seq_len, num_tiles, head * tiles_per_head + first_tile

    @cute.jit
    def make_pipelines(self, warp_idx: Int32, storage):
        """The input ``PipelineTmaAsync``, the output ``PipelineAsync`` and the state-load mbarrier,
        initialised by warp 0 and made visible to the CTA before this returns."""
        plan = self.plan
        load_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.load_mbar.data_ptr(),
            num_stages=plan.input_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_warps),
            tx_count=plan.stage_tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        store_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.store_mbar.data_ptr(),
            num_stages=plan.output_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            defer_sync=True,
        )
        state_mbar = storage.state_mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(state_mbar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        return load_pipe, store_pipe, state_mbar

    def tile_at(self, step, num_tiles):
        """The tile processed at loop step ``step`` (last first when ``reverse``)."""
        if const_expr(self.reverse):
            return num_tiles - 1 - step
        return step

    def state_tile(self, gmem_state: cute.Tensor, seq: Int32, head: Int32, band: Int32) -> cute.Tensor:
        """The ``(IMAGE_RUN, v_band, D / IMAGE_RUN)`` TMA tile of the state of (seq, head, band)."""
        box = (layouts.IMAGE_RUN, self.v_band, self.dim // layouts.IMAGE_RUN)
        return cute.local_tile(gmem_state[None, None, None, seq, head], box, (0, band, 0))

    @staticmethod
    def workspace_tiles(gmem: cute.Tensor, cols: int) -> cute.Tensor:
        """``(IMAGE_RUN, 16, cols / IMAGE_RUN, rows)``: workspace row ``r`` is TMA tile ``[..., r]`` (INV, Mqk)."""
        return cute.local_tile(gmem, (layouts.IMAGE_RUN, CHUNK, cols // layouts.IMAGE_RUN), (0, 0, 0, None))

    def workspace_rows(self, gmem: cute.Tensor) -> cute.Tensor:
        """``(16, D, rows)`` of a :meth:`workspace_tile_atom` tensor: workspace row ``r`` is TMA tile ``[..., r]``."""
        return cute.local_tile(gmem, (CHUNK, self.dim), (None, 0))

    def band_tiles(self, gmem_tokens: cute.Tensor, head: Int32, batch: Int32, first_row: Int32,
                   band: Int32) -> cute.Tensor:
        """``(16, v_band, tile)`` TMA tiles of a :meth:`token_tile_atom` tensor (``(IMAGE_RUN, 16, v_band / IMAGE_RUN, tile)``
        without ``swizzled_tokens``): the CTA's band of the sequence's token rows, tile ``t`` holding rows
        ``16t .. 16t + 15`` from ``first_row`` on."""
        if const_expr(not self.plan.swizzled_tokens):
            value_rows = cute.domain_offset((0, first_row, 0), gmem_tokens[None, None, None, head, batch])
            return cute.local_tile(value_rows, (layouts.IMAGE_RUN, CHUNK, self.v_band // layouts.IMAGE_RUN), (0, None, band))
        value_rows = cute.domain_offset((first_row, 0), gmem_tokens[None, None, head, batch])
        return cute.local_tile(value_rows, (CHUNK, self.v_band), (None, band))

    # -----------------------------------------------------------------------------------------
    # state I/O (all threads take part; TMA from one warp)

    @cute.jit
    def load_initial_state(
        self, warp_idx: Int32, tidx: Int32, tma_state_in: Optional[cute.CopyAtom], g_state: Optional[cute.Tensor],
        state_mbar: cute.Pointer, state: cute.Tensor, state_fp32: cute.Tensor, tma_state: cute.Tensor,
        tma_state_fp32: cute.Tensor, present=None,
    ):
        """Band → ``state`` (bf16): zeros, a TMA load, or a TMA load of fp32 (or fp16) and a conversion.

        ``state`` / ``state_fp32``: the bf16 band and the staging (:attr:`staging`) as ``[v_band, D]`` element views;
        ``tma_state`` / ``tma_state_fp32``: the same bytes as TMA boxes. ``present``: None, or a CTA-uniform
        runtime boolean (a state pool's slot id is not −1); false loads nothing and starts from zeros.
        """
        if const_expr(self.initial_state is None):
            self.zero_box(tidx, tma_state)
        else:
            staged = self.initial_state in STAGED_STATES
            target = tma_state_fp32 if const_expr(staged) else tma_state
            # an fp16 band moves the bytes of a bf16 one
            nbytes = self.plan.state_fp32_bytes if const_expr(self.initial_state is Float32) else self.plan.state_bytes
            if const_expr(present is None):
                self.tma_load_state(warp_idx, tma_state_in, g_state, state_mbar, target, nbytes)
            else:
                if present:
                    self.tma_load_state(warp_idx, tma_state_in, g_state, state_mbar, target, nbytes)
                else:
                    self.zero_box(tidx, target)
            if const_expr(staged):
                self.convert_state(tidx, state_fp32, state)
        cute.arch.fence_view_async_shared()  # generic smem accesses before any TMA touches these bytes
        cute.arch.barrier()

    @cute.jit
    def zero_box(self, tidx: Int32, box: cute.Tensor):
        """Every byte of a TMA box of the band (bf16 state or fp32 staging) ← 0, by all threads."""
        words = cute.recast_tensor(cute.group_modes(box, 0, 3), Uint32)
        for i in cutlass.range(tidx, cute.size(words), self.threads, unroll=4):
            words[i] = Uint32(0)

    @cute.jit
    def tma_load_state(self, warp_idx: Int32, tma_state_in: cute.CopyAtom, g_state: cute.Tensor,
                       state_mbar: cute.Pointer, target: cute.Tensor, nbytes: int):
        """The band's TMA tile ``g_state`` → the box ``target`` (one lane of the load warp issues it), and every
        thread waits for it."""
        if warp_idx == self.load_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(state_mbar, nbytes)
            s_part, g_part = cpasync.tma_partition(
                tma_state_in, 0, cute.make_layout(1), cute.group_modes(target, 0, 3), cute.group_modes(g_state, 0, 3)
            )
            cute.copy(tma_state_in, g_part, s_part, tma_bar_ptr=state_mbar)
        cute.arch.mbarrier_wait(state_mbar, 0)

    @cute.jit
    def store_final_state(
        self, warp_idx: Int32, tidx: Int32, tma_state_out: cute.CopyAtom, g_state: cute.Tensor,
        state: cute.Tensor, state_fp32: cute.Tensor, tma_state: cute.Tensor, tma_state_fp32: cute.Tensor,
        staged: bool = False,
    ):
        """``state`` → the final-state band (bf16 directly, fp32 or fp16 through the staging buffer).

        ``staged``: the staging already holds the band (the caller wrote it and met the CTA
        barrier after), so only the TMA store is left.
        """
        source = tma_state
        if const_expr(self.final_state in STAGED_STATES):
            if const_expr(not staged):
                self.convert_state(tidx, state, state_fp32)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier()
            source = tma_state_fp32
        if warp_idx == self.store_warp:
            s_part, g_part = cpasync.tma_partition(
                tma_state_out, 0, cute.make_layout(1), cute.group_modes(source, 0, 3), cute.group_modes(g_state, 0, 3)
            )
            tma_store_tiles((tma_state_out, s_part, g_part))

    @cute.jit
    def convert_state(self, tidx: Int32, src: cute.Tensor, dst: cute.Tensor):
        """``dst[v, k] = src[v, k]`` converted (fp32 or fp16 → bf16 round-to-nearest-even, or bf16 → fp32 exactly).

        Thread ``i`` takes the 8 consecutive k of one row v per step, consecutive threads consecutive
        rows: 16-byte runs on the bf16 side, 32-byte runs on the fp32 side, both contiguous across a warp.
        """
        rows = self.v_band
        for unit in cutlass.range(tidx, rows * (self.dim // layouts.IMAGE_RUN), self.threads, unroll=1):
            row = unit % rows
            col0 = (unit // rows) * layouts.IMAGE_RUN
            for j in cutlass.range_constexpr(layouts.IMAGE_RUN):
                dst[row, col0 + j] = dst.element_type(src[row, col0 + j])

    # -----------------------------------------------------------------------------------------
    # load warp

    @cute.jit
    def load(self, num_tiles: Int32, ws_row0: Int32, load_pipe: pipeline.PipelineTmaAsync, loads: tuple):
        """One input stage per tile: the per-token band tile and the 7 workspace fields of the tile.

        ``loads``: (atom, gmem tiles ``(box, tile)``, smem ``(box, stage)``), the per-token tile first
        (gmem tile index: the tile), then the workspace fields (gmem tile index: the workspace row).
        Rows past the sequence end read the next sequence's rows (finite) or zeros past the tensor;
        the workspace gives them β = kd = kr = qd = 0 and zero Mqk rows and columns, so they change
        nothing.
        """
        copies = []
        for atom, gmem, smem in loads:
            cpasync.prefetch_descriptor(atom)
            box_rank = cute.rank(smem) - 1
            s_part, g_part = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, box_rank), cute.group_modes(gmem, 0, box_rank)
            )
            copies.append((atom, s_part, g_part))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.plan.input_stages)
        for step in cutlass.range(num_tiles, unroll=1):
            tile = self.tile_at(step, num_tiles)
            load_pipe.producer_acquire(state)
            barrier = load_pipe.producer_get_barrier(state)
            for i in cutlass.range_constexpr(len(copies)):
                atom, s_part, g_part = copies[i]
                index = tile if const_expr(i == 0) else ws_row0 + tile
                cute.copy(atom, g_part[None, index], s_part[None, state.index], tma_bar_ptr=barrier)
            state.advance()
        # no producer_tail: every warp meets the CTA barrier after its role, after the last release

    # -----------------------------------------------------------------------------------------
    # store warp

    @cute.jit
    def store(self, seq_len: Int32, num_tiles: Int32, store_pipe: pipeline.PipelineAsync, outputs: tuple):
        """Output stages → the :class:`OutputTile` s: a full tile by one TMA store per output, a tail
        tile by plain stores of its valid rows."""
        lane = cute.arch.lane_idx()
        parts = []
        for out in outputs:
            box_rank = cute.rank(out.tma_smem) - 1
            s_part, g_part = cpasync.tma_partition(
                out.atom, 0, cute.make_layout(1), cute.group_modes(out.tma_smem, 0, box_rank),
                cute.group_modes(out.gmem_tiles, 0, box_rank),
            )
            parts.append((s_part, g_part))
        runs_per_row = self.v_band // layouts.IMAGE_RUN
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.plan.output_stages)
        for step in cutlass.range(num_tiles, unroll=1):
            tile = self.tile_at(step, num_tiles)
            store_pipe.consumer_wait(state)
            valid_rows = seq_len - tile * CHUNK
            if valid_rows >= CHUNK:
                tma_store_tiles(*_stage_stores(outputs, parts, state.index, tile))
            else:
                for out in outputs:
                    for run in cutlass.range(lane, CHUNK * runs_per_row, 32, unroll=1):
                        row = run // runs_per_row
                        col0 = (run % runs_per_row) * layouts.IMAGE_RUN
                        if row < valid_rows:
                            for j in cutlass.range_constexpr(layouts.IMAGE_RUN):
                                out.rows[tile * CHUNK + row, col0 + j] = out.smem[row, col0 + j, state.index]
            store_pipe.consumer_release(state)
            state.advance()

    # -----------------------------------------------------------------------------------------
    # compute warps

    # band matrices kept in global memory (the backward's snapshots, the training forward's checkpoints), as
    # state images (layouts.fwd_recurrence.state_image): each warp's rows of the bf16 band buffer are D / 8
    # contiguous runs of warp_cols · 16 bytes there and in the image, so 1-D bulk copies move them. Runs of
    # 32 columns (V-split 1) measured faster that way; narrower runs (128 bytes at 8 columns) measured slower
    # than stores from registers (docs/perf-log.md, T5), so those warps store the B fragment of their rows
    # that the products load anyway.

    @staticmethod
    def store_outputs(store_pipe: pipeline.PipelineAsync, out_state, outputs: tuple):
        """The compute warp's output tiles → output stage ``out_state``: each of ``outputs`` a (stmatrix copy, its
        retiled registers, the stage partition); each thread fences its writes for the store warp's TMA, then commits.
        The caller advances ``out_state`` in its own loop body (the tracer carries a pipeline state only through
        rebinds it sees)."""
        store_pipe.producer_acquire(out_state)
        for copy, registers, stages in outputs:
            cute.copy(copy, registers, stages[None, None, None, out_state.index])
        cute.arch.fence_view_async_shared()
        store_pipe.producer_commit(out_state)

    # the kept matrices' rows: one a block of `every` global tiles, in slot g // every + s of the sequence s
    # (workspace.snapshot_slots); the two-tile step's training form keeps one a pair, in slot (g + s) // 2 of the pair
    # whose tile a is global tile g (workspace.pair_block_slots)
    kept_a_pair = False

    def kept_origin(self, first_tile: Int32, seq: Int32, head: Int32, slots: Int32) -> tuple:
        """``(first, row0)`` for the sequence ``seq`` of head ``head``, whose tile 0 is global tile ``first_tile``, in a
        tensor of ``slots`` kept matrices a head: local tile ``t`` (a pair's tile a) keeps row
        ``row0 + (first + t) // every`` (``every`` 2 for a pair)."""
        if self.kept_a_pair:
            return first_tile + seq, head * slots
        return first_tile, head * slots + seq

    @property
    def image_by_bulk(self) -> bool:
        """Whether the warps' kept rows leave by bulk copies (:meth:`store_band_image`), not by
        :meth:`store_band_fragment`."""
        return self.warp_cols >= BULK_IMAGE_COLS

    def band_image(self, images: cute.Tensor, index) -> cute.Tensor:
        """Matrix ``index`` of a ``[rows, D, D]`` bf16 tensor of state images as its ``[V, K]`` view (64-bit offset)."""
        base = images.iterator + Int64(index) * (self.dim * self.dim)
        return cute.make_tensor(base, layouts.state_image(self.dim))

    @cute.jit
    def store_band_image(self, image: cute.Tensor, band_state: cute.Tensor, band: Int32, warp_idx: Int32):
        """The warp's ``warp_cols`` rows of the bf16 band buffer ``band_state`` (``[v_band, D]``) → their rows of
        ``image`` (:meth:`band_image`): one lane issues D / 8 bulk copies (one per 8-k run) as one bulk group.

        Call from the whole warp after each lane fenced its writes to those rows
        (``fence_view_async_shared``) and the warp synchronised; :meth:`wait_band_image_read` before the rows
        are written again."""
        cols = self.warp_cols
        image_row_block = band * (self.v_band // cols) + warp_idx
        with cute.arch.elect_one():
            for j in cutlass.range_constexpr(self.dim // layouts.IMAGE_RUN):
                source = cute.local_tile(band_state, (cols, layouts.IMAGE_RUN), (warp_idx, j))
                target = cute.local_tile(image, (cols, layouts.IMAGE_RUN), (image_row_block, j))
                cp_async_bulk_global_shared_cta(target.iterator, source.iterator, cols * layouts.IMAGE_RUN * 2)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_band_fragment(self, image: cute.Tensor, fragment: cute.Tensor, band: Int32, warp_idx: Int32,
                            lane: Int32):
        """The warp's B fragment of its band rows (``[cols, K]`` bf16, ``((2, 2), n, k_steps)``, as ``ldmatrix``
        loaded it for the products) → its rows of ``image`` (:meth:`band_image`): each lane stores its pairs of
        consecutive k (contiguous in the image) as 32-bit words.

        Word ``((0, h), j, s)`` of the fragment holds ``[v, k], [v, k + 1]`` with ``v = 8j + g``,
        ``k = 16s + 2q + 8h`` (``g = lane / 4``, ``q = lane % 4``); in the image's words that pair sits at
        ``4v + q + 512 · (2s + h)`` (D = 128: a k-run of 8 is ``4 · D`` words)."""
        run_words = layouts.IMAGE_RUN // 2 * self.dim  # words of one 8-k run of the whole image
        first_v = band * self.v_band + warp_idx * self.warp_cols + lane // 4
        # the image starts on 32 KB, so its words are 4-byte aligned (a recast keeps the bf16 pointer's 2)
        words_ptr = cute.make_ptr(Uint32, image.iterator.toint(), cute.AddressSpace.gmem, assumed_align=4)
        base = words_ptr + (layouts.IMAGE_RUN // 2 * first_v + lane % 4)
        words = cute.recast_tensor(fragment, Uint32)
        target = cute.make_tensor(base, cute.make_layout(
            ((1, 2), self.warp_cols // 8, self.dim // CHUNK), stride=((0, run_words), 8 * layouts.IMAGE_RUN // 2, 2 * run_words)))
        for i in cutlass.range_constexpr(cute.size(words)):
            target[i] = words[i]

    @staticmethod
    def wait_band_image_read():
        """The warp's bulk copies have read the band buffer (so the warp may overwrite it)."""
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()

    # a band kept in fp32 in the compute warps' registers (K2's state): row block m of 16 k of the warp's
    # [K, cols] columns is one C fragment, the accumulator of that block's update mma

    def band_blocks(self) -> tuple:
        """The warp's fp32 band columns as registers: one C fragment ``((2, 2), 1, n)`` per row block."""
        tiled_mma = self.warp_mma()
        shape = tiled_mma.partition_shape_C((CHUNK, self.warp_cols))
        return tuple(tiled_mma.make_fragment_C(shape) for _ in range(self.dim // CHUNK))

    def warp_band_elements(self, warp_idx: Int32, view: cute.Tensor) -> cute.Tensor:
        """The lane's elements of the warp's columns of a ``[K, v_band]`` smem view, ``((2, 2), k_steps, n)``:
        ``[None, m, None]`` is in the order of :meth:`band_blocks` ``[m]``."""
        warp_columns = cute.local_tile(view, (self.dim, self.warp_cols), (0, warp_idx))
        return self.warp_mma().get_slice(cute.arch.lane_idx()).partition_C(warp_columns)

    @cute.jit
    def load_band32(self, warp_idx: Int32, band32: tuple, band_acc: cute.Tensor, staging_acc: cute.Tensor):
        """The fp32 band from the initial state: 0, the bf16 band buffer widened (``band_acc``, its
        ``[K, v_band]`` view), or the staging (``staging_acc``, the same view of it; fp16 widened exactly)."""
        if const_expr(self.initial_state is None):
            for block in band32:
                block.fill(0.0)
        else:
            source = staging_acc if const_expr(self.initial_state in STAGED_STATES) else band_acc
            elements = self.warp_band_elements(warp_idx, source)
            for m in cutlass.range_constexpr(len(band32)):
                block, rows = band32[m], elements[None, m, None]
                for i in cutlass.range_constexpr(cute.size(block)):
                    block[i] = Float32(rows[i])

    @cute.jit
    def stage_band32(self, warp_idx: Int32, band32: tuple, staging_acc: cute.Tensor):
        """The fp32 band of the warp's columns → the staging (the final state's TMA store reads it), rounded to
        its element type (fp16: round to nearest even)."""
        elements = self.warp_band_elements(warp_idx, staging_acc)
        for m in cutlass.range_constexpr(len(band32)):
            block, rows = band32[m], elements[None, m, None]
            for i in cutlass.range_constexpr(cute.size(block)):
                rows[i] = rows.element_type(block[i])

    @staticmethod
    def fragment_rows(vector: cute.Tensor, stage, group: Int32, m: int = 0) -> tuple:
        """A staged ``[n, stage]`` vector (gT, β) at the lane's two C-fragment rows ``g``, ``g + 8`` of row
        block ``m`` (the values ``c_row_half`` picks between)."""
        return vector[m * CHUNK + group, stage], vector[m * CHUNK + group + 8, stage]

    @staticmethod
    @cute.jit
    def round_block(block: cute.Tensor, words: cute.Tensor, m: int):
        """Row block ``m`` of an fp32 band → bf16 pairs (word ``j``: elements ``2j``, ``2j + 1``) in row
        block ``m`` of ``words``, the 32-bit view of the bf16 C fragment that stmatrix stores."""
        block_words = words[None, m, None]
        for j in cutlass.range_constexpr(cute.size(block_words)):
            block_words[j] = pack_bf16x2(block[2 * j], block[2 * j + 1])

    def warp_mma(self) -> cute.TiledMma:
        """One warp's ``16 × warp_cols × 16`` tile of ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate)."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1),
            permutation_mnk=(CHUNK, self.warp_cols, CHUNK),
        )

    def thread_copies(self, tiled_mma: cute.TiledMma, lane) -> WarpCopies:
        """:meth:`warp_copies`, each field the ``lane``'s slice of it (the compute loops' copies)."""
        return WarpCopies(*(copy.get_slice(lane) for copy in self.warp_copies(tiled_mma)))

    def warp_copies(self, tiled_mma: cute.TiledMma) -> WarpCopies:
        """The ldmatrix / stmatrix tiled copies of the compute warps (x4, or x2 for 8-column bands); those of the
        per-token tiles (``ldsm_c``, ``stsm_c``) in :attr:`token_dtype`."""
        band = self.band_matrices

        def tiled(make, op, dtype=BFloat16):
            return make(cute.make_copy_atom(op, dtype), tiled_mma)

        return WarpCopies(
            ldsm_a=tiled(cute.make_tiled_copy_A, warp.LdMatrix8x8x16bOp(False, 4)),
            ldsm_a_t=tiled(cute.make_tiled_copy_A, warp.LdMatrix8x8x16bOp(True, 4)),
            ldsm_b=tiled(cute.make_tiled_copy_B, warp.LdMatrix8x8x16bOp(False, band)),
            ldsm_b_t=tiled(cute.make_tiled_copy_B, warp.LdMatrix8x8x16bOp(True, band)),
            ldsm_c=tiled(cute.make_tiled_copy_C, warp.LdMatrix8x8x16bOp(False, band), self.token_dtype),
            stsm_c=tiled(cute.make_tiled_copy_C, warp.StMatrix8x8x16bOp(False, band), self.token_dtype),
            stsm_c_t=tiled(cute.make_tiled_copy_C, warp.StMatrix8x8x16bOp(True, band)),
        )
