"""Tile transpose round trip: the first kernel, proving the data-movement primitives K1/K2 rely on.

For each head ``h`` and 16-token tile ``t`` of ``x`` (``[T, H, D]``, 16-bit) it writes the tile's
transpose: ``y[t·D + i, h, j] = x[16·t + j, h, i]`` (``y``: ``[⌈T/16⌉·D, H, 16]``), moving every
byte the way K2 moves its operands:

1. a TMA warp loads the ``[16, D]`` tile into a K_INTER operand buffer
   (:func:`cute_kda.layouts.tma.operand_tile_staged`) through a ``PipelineTmaAsync`` stage;
2. each compute warp ``ldmatrix``-es 16×16 blocks as **C fragments**, turns each into the **B
   fragment of its transpose** with four ``movmatrix.trans`` (K2's C→B move,
   :func:`cute_kda.kernels.common.copy.transpose_c_to_b`) and ``stmatrix``-es that B fragment into
   the output buffer;
3. after ``fence.proxy.async`` and a ``PipelineAsync`` hand-off, a store warp TMA-stores the output
   buffer, a ``[D, 16]`` K_INTER operand tile, as the transposed tile.

Fragment bookkeeping for block ``b`` (columns ``16b…16b+15`` of the x tile), ``X_b = x[:, 16b:16b+16]``
and ``Y_b = X_bᵀ`` (rows ``16b…`` of the y tile). ``transposed_views`` picks which face of each
transpose-dual buffer the registers use; both give the same bytes:

- ``True`` (K2's Phase-6 moves, the default): ``ldmatrix.trans`` reads the C fragment of ``Y_b``
  from the MN_INTER ``[D, 16]`` view of the input buffer (block ``(b, 0)``); ``movmatrix`` gives the
  B fragment of ``Y_bᵀ = X_b``; ``stmatrix.trans`` writes it to block ``(0, b)`` of the MN_INTER
  ``[16, D]`` view of the output buffer, i.e. ``X_b`` lands transposed in the K_INTER ``[D, 16]``
  face that the TMA store reads.
- ``False`` (K2's Phase-1/5 moves): ``ldmatrix`` reads the C fragment of ``X_b`` from the K_INTER
  ``[16, D]`` face (block ``(0, b)``); ``movmatrix`` gives the B fragment of ``Y_b``; ``stmatrix``
  writes it to block ``(b, 0)`` of the K_INTER ``[D, 16]`` output face.

Each route transposes the bytes an odd number of times (three or one), so dropping or doubling a
primitive breaks the result: the GPU test compares with ``x``'s tile transposes bit for bit.

Warp roles: warps ``0 … compute_warps-1`` move ``D / 16 / compute_warps`` blocks each, warp
``compute_warps`` issues TMA loads, warp ``compute_warps + 1`` issues TMA stores. Grid: (tile group,
head); a CTA walks ``tiles_per_cta`` consecutive tiles through the pipelines, as K2 walks a sequence.
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.pipeline import (
    Agent,
    CooperativeGroup,
    PipelineAsync,
    PipelineTmaAsync,
    PipelineUserType,
    make_pipeline_state,
)

from cute_kda.dsl import cute, cutlass
from cute_kda.kernels.common.copy import (
    WARP_TILE,
    Operand,
    head_tile_tma_partition,
    ldmatrix_copy,
    make_fragment,
    make_head_tile_tma_atom,
    stmatrix_copy,
    tma_store_tiles,
    transpose_c_to_b,
    warp_tiled_mma,
)
from cute_kda.layouts.smem import CHUNK
from cute_kda.layouts.tma import operand_tile_staged, operand_tile_transposed_staged

_SMEM_ALIGN = 128


class TransposeRoundTrip:
    """Static configuration: ``dim`` (D), element ``dtype`` (16-bit), pipeline depths, view choice."""

    def __init__(
        self,
        dim: int = 128,
        dtype: type = cutlass.BFloat16,
        load_stages: int = 2,
        store_stages: int = 2,
        transposed_views: bool = True,
        compute_warps: int = 4,
    ) -> None:
        blocks = dim // WARP_TILE
        if dim % WARP_TILE or blocks % compute_warps:
            raise ValueError(f"dim={dim} must split into 16-column blocks evenly over {compute_warps} warps")
        if dtype.width != 16:
            raise ValueError("ldmatrix/stmatrix/movmatrix move 16-bit elements")
        self.dim = dim
        self.dtype = dtype
        self.load_stages = load_stages
        self.store_stages = store_stages
        self.transposed_views = transposed_views
        self.compute_warps = compute_warps
        self.blocks_per_warp = blocks // compute_warps
        self.load_warp = compute_warps
        self.store_warp = compute_warps + 1
        self.threads = 32 * (compute_warps + 2)
        self.in_tile = (CHUNK, dim)  # [tokens, channels] tile of x
        self.out_tile = (dim, CHUNK)  # its transpose, a tile of y
        self.tile_bytes = CHUNK * dim * dtype.width // 8

    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, tiles_per_cta: Int32, stream) -> None:
        """``x``: ``[T, H, D]``, ``y``: ``[⌈T/16⌉·D, H, 16]``, both ``dtype``, last mode contiguous."""
        in_layout = operand_tile_staged(CHUNK, self.dim, self.load_stages, self.dtype)
        out_layout = operand_tile_staged(self.dim, CHUNK, self.store_stages, self.dtype)
        load_atom, x_tma = make_head_tile_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), x, in_layout, self.in_tile
        )
        store_atom, y_tma = make_head_tile_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), y, out_layout, self.out_tile
        )

        @cute.struct
        class SharedStorage:
            load_barriers: cute.struct.MemRange[Int64, 2 * self.load_stages]
            store_barriers: cute.struct.MemRange[Int64, 2 * self.store_stages]
            x_tiles: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(in_layout)], _SMEM_ALIGN
            ]
            y_tiles: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(out_layout)], _SMEM_ALIGN
            ]

        self.shared_storage = SharedStorage
        tiles = (x.shape[0] + CHUNK - 1) // CHUNK
        tile_groups = (tiles + tiles_per_cta - 1) // tiles_per_cta
        self.kernel(load_atom, x_tma, store_atom, y_tma, in_layout, out_layout, tiles, tiles_per_cta).launch(
            grid=(tile_groups, x.shape[1], 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(
        self, load_atom, x_tma: cute.Tensor, store_atom, y_tma: cute.Tensor, in_layout, out_layout,
        tiles: Int32, tiles_per_cta: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile_group, head, _ = cute.arch.block_idx()
        first_tile = tile_group * tiles_per_cta
        tile_count = cutlass.min(tiles_per_cta, tiles - first_tile)

        if warp_idx == self.load_warp:
            cpasync.prefetch_descriptor(load_atom)
            cpasync.prefetch_descriptor(store_atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        # Consumer releases come from one lane per compute warp, so the empty barrier counts warps.
        load_pipeline = PipelineTmaAsync.create(
            barrier_storage=storage.load_barriers.data_ptr(),
            num_stages=self.load_stages,
            producer_group=CooperativeGroup(Agent.Thread),
            consumer_group=CooperativeGroup(Agent.Thread, self.compute_warps),
            tx_count=self.tile_bytes,
            defer_sync=True,
        )
        store_pipeline = PipelineAsync.create(
            barrier_storage=storage.store_barriers.data_ptr(),
            num_stages=self.store_stages,
            producer_group=CooperativeGroup(Agent.Thread, 32 * self.compute_warps),
            consumer_group=CooperativeGroup(Agent.Thread, 32),
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        x_tiles = storage.x_tiles.get_tensor(in_layout)
        y_tiles = storage.y_tiles.get_tensor(out_layout)

        if warp_idx == self.load_warp:
            self.load(load_pipeline, load_atom, x_tma, x_tiles, head, first_tile, tile_count)
        if warp_idx == self.store_warp:
            self.store(store_pipeline, store_atom, y_tma, y_tiles, head, first_tile, tile_count)
        if warp_idx < self.compute_warps:
            self.transpose_tiles(load_pipeline, store_pipeline, x_tiles, y_tiles, warp_idx, tile_count)

    @cute.jit
    def load(
        self, pipeline, atom, x_tma: cute.Tensor, x_tiles: cute.Tensor, head: Int32, first_tile: Int32,
        tile_count: Int32,
    ):
        """TMA warp: tile ``first_tile + i`` into stage ``i mod load_stages`` (whole warp calls)."""
        smem_part, gmem_part = head_tile_tma_partition(atom, x_tma, x_tiles, head, self.in_tile)
        state = make_pipeline_state(PipelineUserType.Producer, self.load_stages)
        for i in cutlass.range(tile_count, unroll=1):
            pipeline.producer_acquire(state)
            cute.copy(
                atom, gmem_part[None, first_tile + i], smem_part[None, state.index],
                tma_bar_ptr=pipeline.producer_get_barrier(state),
            )
            pipeline.producer_commit(state)
            state.advance()
        pipeline.producer_tail(state)

    @cute.jit
    def transpose_tiles(
        self, load_pipeline, store_pipeline, x_tiles: cute.Tensor, y_tiles: cute.Tensor, warp_idx: Int32,
        tile_count: Int32,
    ):
        """Compute warps: ldmatrix → movmatrix (C→B) → stmatrix, block by block (module docstring)."""
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.transposed_views):
            # Read Y_b through the MN_INTER face of the input, write X_b into the MN_INTER face of the output.
            sources = cute.make_tensor(
                x_tiles.iterator, operand_tile_transposed_staged(CHUNK, self.dim, self.load_stages, self.dtype)
            )
            targets = cute.make_tensor(
                y_tiles.iterator, operand_tile_transposed_staged(self.dim, CHUNK, self.store_stages, self.dtype)
            )
        else:
            sources = x_tiles
            targets = y_tiles
        tiled_mma = warp_tiled_mma(self.dtype)
        load_copy = ldmatrix_copy(tiled_mma, Operand.C, self.transposed_views, self.dtype)
        store_copy = stmatrix_copy(tiled_mma, Operand.B, self.transposed_views, self.dtype)
        thr_load = load_copy.get_slice(lane)
        thr_store = store_copy.get_slice(lane)
        c_fragment = make_fragment(tiled_mma, Operand.C, self.dtype)
        b_fragment = make_fragment(tiled_mma, Operand.B, self.dtype)

        load_state = make_pipeline_state(PipelineUserType.Consumer, self.load_stages)
        store_state = make_pipeline_state(PipelineUserType.Producer, self.store_stages)
        for _ in cutlass.range(tile_count, unroll=1):
            load_pipeline.consumer_wait(load_state)
            store_pipeline.producer_acquire(store_state)
            source = sources[None, None, load_state.index]
            target = targets[None, None, store_state.index]
            for j in cutlass.range_constexpr(self.blocks_per_warp):
                block = warp_idx * self.blocks_per_warp + j
                if cutlass.const_expr(self.transposed_views):
                    source_block = (block, 0)
                    target_block = (0, block)
                else:
                    source_block = (0, block)
                    target_block = (block, 0)
                cute.copy(
                    load_copy,
                    thr_load.partition_S(cute.local_tile(source, (WARP_TILE, WARP_TILE), source_block)),
                    thr_load.retile(c_fragment),
                )
                transpose_c_to_b(c_fragment, b_fragment)
                cute.copy(
                    store_copy,
                    thr_store.retile(b_fragment),
                    thr_store.partition_D(cute.local_tile(target, (WARP_TILE, WARP_TILE), target_block)),
                )
            load_pipeline.consumer_release(load_state)
            # Generic-proxy smem writes must be visible to the TMA (async proxy) store.
            cute.arch.fence_view_async_shared()
            store_pipeline.producer_commit(store_state)
            load_state.advance()
            store_state.advance()

    @cute.jit
    def store(
        self, pipeline, atom, y_tma: cute.Tensor, y_tiles: cute.Tensor, head: Int32, first_tile: Int32,
        tile_count: Int32,
    ):
        """Store warp: TMA-store each finished output stage, free it once the TMA has read it."""
        smem_part, gmem_part = head_tile_tma_partition(atom, y_tma, y_tiles, head, self.out_tile)
        state = make_pipeline_state(PipelineUserType.Consumer, self.store_stages)
        for i in cutlass.range(tile_count, unroll=1):
            pipeline.consumer_wait(state)
            tma_store_tiles((atom, smem_part[None, state.index], gmem_part[None, first_tile + i]))
            pipeline.consumer_release(state)
            state.advance()
