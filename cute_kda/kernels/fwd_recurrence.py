"""K2: the forward chunk recurrence, one CTA per (sequence, head, V-band), serial over 16-token tiles.

Per tile (docs/numerics.md, section K2), with the fp32 state band ``S32[k, v]`` in registers and its
bf16 rounding ``S`` in shared memory:

```
kS = kd·S,  qS = qd·S                       Phase 1 (fp32 accumulators, 8 k-steps)
u  = bf16(f32(v − kS)·β)                    Phase 2 (C fragment)
U  = bf16(INV·u)                            Phase 3 (u moved C→B by movmatrix, no smem round trip)
o  = bf16(qS + Mqk·U)                       Phase 4 (qS is the C operand of the mma; U moved C→B again)
out tile ← o                                Phase 5 (stmatrix into an output stage)
S32 ← krᵀ·U + f32(gT·S32),  S = bf16(S32)   Phase 6 (row block by row block of 16 k: the decayed state
                                            is the C operand of the mma; stmatrix.trans of S on the
                                            [K, V] view of the state buffer)
```

The state lives in fp32 in the compute warps' registers (``S32``, C fragments of the warp's columns:
128, 64 or 32 registers a thread at V-split 1, 2, 4 for D = 128; at D = 64 a quarter of those at V-split 1, 2,
where the bands of 16 and 8 columns keep four warps, and 16 at V-split 4 on two warps); shared memory holds its
bf16 rounding ``S``, the B operand of the next tile's products. So the state is not rounded once per tile, which
drifted over long sequences with little decay (docs/numerics.md, K2), and Phase 6 reads no state from shared memory.

Grid: ``(vsplit · N, H)``; CTA ``x`` owns band ``x % vsplit`` of sequence ``x // vsplit`` (the bands
of one (sequence, head) run side by side and share the tile's kd/qd/kr reads in L2).

Roles (192 threads; 128 at D = 64, V-split 4): warps 0-3 compute, warp ``w`` owning value columns
``[w·c, (w+1)·c)`` of the CTA's band (``c = v_band / 4``: 32, 16 or 8; at least 8, so fewer compute warps for a
band under 32 columns). Every line above is separable in the value columns,
so a warp reads and writes only its own columns of v, out and S: the compute warps never wait for
each other. Warp 4 issues the TMA loads of an input stage (v band, kd, qd, kr, gT, INV, Mqk, β under
one transaction barrier; the per-token tiles and kd, qd, kr are swizzled, so each moves as one box of
rows of up to 128 bytes); warp 5 stores output stages (TMA for a full tile; for a tail tile only the
valid rows, by plain stores, so the next sequence's rows are never written).

Pipelines: input ``PipelineTmaAsync`` (3 stages; producer = the load warp, one expect-tx arrival;
consumer = the 4 compute warps, one arrival per warp from lane 0 after ``bar.warp.sync``); output
``PipelineAsync`` (2 stages; producer = the 128 compute threads, each arriving after
``fence.proxy.async`` so the TMA store sees its stmatrix writes; consumer = the 32 threads of the
store warp, the lane that issued a TMA store arriving only after ``cp.async.bulk.wait_group.read 0``,
so a stage is released once the store has read it).

State I/O: none (zeros), bf16 (TMA straight into the state buffer) or fp32 / fp16 (TMA into a staging buffer
that shares its bytes with the pipeline buffers, rounded to bf16 in shared memory before the loop).
The compute warps then read their ``S32`` from the buffer they came in through (fp16 widened exactly). After the
loop a bf16 final state is ``S`` as it stands; an fp32 one is ``S32``, an fp16 one ``f16(S32)``, written into the
staging by the compute warps for the TMA store. Global state tensors are ``[N, H, V, K]``.

State pool (``state_pool``, inference): the initial and the final state are one tensor ``[slots, H, V, K]`` (its
``[V, K]`` blocks contiguous, the other strides free: a view of an engine's cache) and ``state_indices`` int32
``[N]`` gives each sequence its slot, the TMA coordinate of its state in place of the sequence index. Slot −1 is a
padding row: it starts from zeros and stores no state. Prefix checkpoints (``prefix_checkpoint_every`` = C tokens,
a multiple of 64): after the tile that ends ``(j + 1) · C`` tokens into a sequence, the compute warps store their
fp32 ``S32`` columns (the pool's dtype; a bf16 pool gets ``bf16(S32)``, which is ``S``) straight from registers
into slot ``checkpoint_indices[n, j]`` of the pool (−1, a row past the sequence's last full C-block, or a padding
sequence: nothing); these stores wait on nothing and no other variant has them.

Inputs are assumed valid (the API layer checks them): v / out bf16 or fp16 ``[B, T, H, D]`` with the last
mode contiguous, workspace fields as :mod:`cute_kda.workspace`, ``cu_seqlens`` int64 ``[N+1]`` with
B == 1 and ``tile_base`` int32 ``[N+1]`` for varlen, every base address 16-byte aligned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..dsl import cute, cutlass  # first: sets the target architecture before the DSL loads

import cutlass.pipeline as pipeline
from cuda.bindings import driver
from cutlass import BFloat16, Boolean, Float16, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..layouts import fwd_recurrence as layouts
from ..layouts.fwd_recurrence import RecurrenceSmemPlan
from ..numerics import CHUNK, HEAD_DIM
from ..workspace import SNAPSHOT_TILES
from .common.band_scan import STAGED_STATES, BandScan, OutputTile
from .common.copy import aligned_smem_tensor, c_row_half, smem_tensor
from .common.copy import transpose_c_to_b  # movmatrix.trans word by word: C fragment of M → B fragment of Mᵀ
from .common.fastmath import mul_rn


@dataclass(frozen=True)
class RecurrenceSmem:
    """K2's shared-memory tensors, operand views (see :mod:`cute_kda.layouts.fwd_recurrence`)."""

    state: cute.Tensor  # [v_band, D] bf16, K_INTER
    state_acc: cute.Tensor  # [D, v_band] bf16, MN_INTER view of state
    state_fp32: cute.Tensor  # [v_band, D] staging (in the union): fp32, or fp16 for fp16 states
    state_fp32_acc: cute.Tensor  # [D, v_band] view of the staging
    v: cute.Tensor  # [16, v_band, stage]
    kd: cute.Tensor  # [16, D, stage], K_SW128
    kr_t: cute.Tensor  # [D, 16, stage], MN_SW128 view of kr
    gt: cute.Tensor  # [D, stage] fp32
    inv: cute.Tensor  # [16, 16, stage]
    beta: cute.Tensor  # [16, stage] fp32
    qd: Optional[cute.Tensor] = None  # [16, D, stage], K_SW128; with the token outputs only, as Mqk and out
    mqk: Optional[cute.Tensor] = None  # [16, 16, stage]
    out: Optional[cute.Tensor] = None  # [16, v_band, out stage]
    cross_kd: Optional[cute.Tensor] = None  # [16, 16, stage]: a pair plan's P (tile b's stages)
    cross_qd: Optional[cute.Tensor] = None  # [16, 16, stage]: a pair plan's Q


class WarpViews(NamedTuple):
    """A compute warp's copies (its lane's slices) and the partitions of the shared memory it reads and writes, stage
    mode last (:meth:`FwdRecurrence.warp_views`)."""

    tiled_mma: cute.TiledMma
    ldsm_a: cute.ThrCopy
    ldsm_a_t: cute.ThrCopy
    ldsm_b: cute.ThrCopy
    ldsm_c: cute.ThrCopy
    stsm_c: cute.ThrCopy
    stsm_c_t: cute.ThrCopy
    p_kd: cute.Tensor  # (CPY, 1, k_steps, stage)
    p_qd: Optional[cute.Tensor]  # None without token outputs, as p_mqk and p_out
    p_inv: cute.Tensor  # (CPY, 1, 1, stage)
    p_mqk: Optional[cute.Tensor]
    p_kr_t: cute.Tensor  # (CPY, k_steps, 1, stage)
    p_state: cute.Tensor  # (CPY, n, k_steps): the warp's rows of S, the B operand
    p_v: cute.Tensor  # (CPY, 1, n, stage)
    p_out: Optional[cute.Tensor]
    p_state_acc_st: cute.Tensor  # the warp's columns of S in the [K, V] view, for stmatrix.trans


@dataclass(frozen=True)
class PrefixCheckpoints:
    """What a CTA of the prefix-checkpoint variant needs to store its sequence's checkpoints (module docstring)."""

    pool: cute.Tensor  # [slots, H, V, K], the state pool
    slots: cute.Tensor  # [M] int32: the sequence's row of checkpoint_indices
    head: Int32
    full_tiles: Int32  # whole 16-token tiles of the sequence
    active: Boolean  # the sequence's own slot is not −1 (a padding row writes nothing)


@dataclass(frozen=True)
class RecurrenceTmaSmem:
    """The same bytes as :class:`RecurrenceSmem`, as the TMA sees them: the swizzled tiles (the per-token
    and output band tiles, kd / qd / kr) with the swizzle on the pointer, the others as boxes
    ``(IMAGE_RUN, rows, cols / IMAGE_RUN[, stage])``."""

    v: cute.Tensor
    kd: cute.Tensor
    kr: cute.Tensor
    inv: cute.Tensor
    state: cute.Tensor
    state_fp32: cute.Tensor
    qd: Optional[cute.Tensor] = None
    mqk: Optional[cute.Tensor] = None
    out: Optional[cute.Tensor] = None
    cross_kd: Optional[cute.Tensor] = None
    cross_qd: Optional[cute.Tensor] = None


class FwdRecurrence(BandScan):
    """K2, one compiled variant per static configuration.

    ``dim``: K = V (:data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`; the plan's tiles, k-steps and warp bands follow it).
    ``vsplit`` ∈ {1, 2, 4}: CTAs per (sequence, head), each owning ``dim / vsplit`` value columns.
    ``initial_state`` / ``final_state``: None, ``cutlass.BFloat16``, ``cutlass.Float32`` or ``cutlass.Float16``
    (the dtype of the ``[N, H, V, K]`` state tensors; an fp16 state is staged as an fp32 one, widened on load and
    rounded to fp16 on store, and does not meet an fp32 one in a variant). ``varlen``: sequences packed along T
    with ``cu_seqlens``.
    ``checkpoints``: the training variant, which also keeps ``S = bf16(S32)`` entering every block of
    ``checkpoint_every`` global tiles (default :data:`~cute_kda.workspace.SNAPSHOT_TILES`; and each
    sequence's first tile) for the backward, ``[H · slots, D, D]`` bf16 state images
    (:func:`cute_kda.workspace.snapshot_slots`: the slot of a block is the one the backward scan keeps
    its gradient in). ``state_pool``: the states are a pool read and written by slot id, ``prefix_checkpoint_every``
    (tokens, a multiple of 64; 0: none) its prefix checkpoints (module docstring). ``dtype``: v's and o's,
    ``cutlass.BFloat16`` or ``cutlass.Float16`` (v widened to fp32 exactly, o rounded to fp16 where it would be to
    bf16: docs/numerics.md, "fp16 inputs"). ``token_outputs`` False: a pass run for its states alone (with
    ``checkpoints`` or a ``final_state``): no o, so qd and Mqk are not loaded, Phase 1 forms ``kd·S`` alone, Phases
    4 and 5 go and the store warp idles; the state chain runs the same instructions (the same bits).
    """

    def __init__(
        self,
        *,
        vsplit: int = 1,
        initial_state: Optional[type] = None,
        final_state: Optional[type] = None,
        varlen: bool = False,
        checkpoints: bool = False,
        checkpoint_every: int = SNAPSHOT_TILES,
        state_pool: bool = False,
        prefix_checkpoint_every: int = 0,
        dtype: type = BFloat16,
        dim: int = HEAD_DIM,
        token_outputs: bool = True,
    ) -> None:
        if not token_outputs and not checkpoints and final_state is None:
            raise ValueError("a K2 pass without token outputs keeps checkpoints or a final state (else it writes "
                             "nothing)")
        if not token_outputs and state_pool:
            raise ValueError("a state-pool prefill writes its token outputs (token_outputs=True)")
        self.token_outputs = token_outputs
        staged = bool({initial_state, final_state} & set(STAGED_STATES))
        super().__init__(
            self.make_plan(vsplit, staged, dim),
            initial_state=initial_state, final_state=final_state, varlen=varlen, reverse=False, token_dtype=dtype,
            state_dtypes=(BFloat16, Float32, Float16),
        )
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.checkpoints = checkpoints
        self.checkpoint_every = checkpoint_every
        if state_pool and (initial_state is None or initial_state is not final_state or checkpoints):
            raise ValueError("state_pool reads and writes one pool: initial_state and final_state must be its dtype, "
                             "without checkpoints")
        if prefix_checkpoint_every and (not state_pool or prefix_checkpoint_every % (4 * CHUNK)):
            raise ValueError(f"prefix_checkpoint_every must be a multiple of {4 * CHUNK} tokens on a state_pool variant, "
                             f"got {prefix_checkpoint_every}")
        self.state_pool = state_pool
        self.prefix_checkpoint_every = prefix_checkpoint_every

    @property
    def launch_min_blocks(self) -> int:
        """The launch bound's CTAs an SM (0: none, ptxas sizes the registers itself). A pass without token outputs
        runs under one CTA an SM (K2's V-split gives each CTA its own SM): left to itself ptxas capped one at D = 64
        at 80 registers and spilled 4 bytes."""
        return 0 if self.token_outputs else 1

    def make_plan(self, vsplit: int, state_io_fp32: bool, dim: int) -> RecurrenceSmemPlan:
        """The shared-memory plan of the variant (:class:`~cute_kda.layouts.fwd_recurrence.RecurrenceSmemPlan`)."""
        return RecurrenceSmemPlan(vsplit=vsplit, state_io_fp32=state_io_fp32, dim=dim,
                                  token_outputs=self.token_outputs)

    # -----------------------------------------------------------------------------------------
    # host

    @cute.jit
    def __call__(
        self,
        v: cute.Tensor,
        out: Optional[cute.Tensor],
        ws_qd: cute.Tensor,
        ws_kd: cute.Tensor,
        ws_kr: cute.Tensor,
        ws_gt: cute.Tensor,
        ws_inv: cute.Tensor,
        ws_mqk: cute.Tensor,
        ws_beta: cute.Tensor,
        initial_state: Optional[cute.Tensor],
        final_state: Optional[cute.Tensor],
        cu_seqlens: Optional[cute.Tensor],
        tile_base: Optional[cute.Tensor],
        checkpoints: Optional[cute.Tensor],
        state_indices: Optional[cute.Tensor],
        checkpoint_indices: Optional[cute.Tensor],
        ws_cross_kd: Optional[cute.Tensor],
        ws_cross_qd: Optional[cute.Tensor],
        u_a: Optional[cute.Tensor],
        stream: driver.CUstream,
    ):
        """Launch K2. v, out ``[B, T, H, D]`` (out None without token outputs); workspace fields as in
        :mod:`cute_kda.workspace`;
        checkpoints ``[H · slots, D, D]`` (the training variant) or None; ``state_indices`` int32 ``[N]`` (the
        pool variant: initial_state and final_state are both the pool) and ``checkpoint_indices`` int32 ``[N, M]``
        (its prefix checkpoints), else None; ``ws_cross_kd``, ``ws_cross_qd`` the pair workspace's cross blocks
        ``[H · tiles, 16, 16]`` (a pair plan), else None; ``u_a`` the pair training variant's tile a ``U`` rows
        ``[H · pair slots, 16, D]`` bf16, else None."""
        heads = v.shape[2]
        num_seqs = v.shape[0]
        if const_expr(self.varlen):
            num_seqs = cu_seqlens.shape[0] - 1
        tiles_per_head = ws_qd.shape[0] // heads

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        runs_atom = self.runs_atom

        tma_v, gmem_v = self.token_tile_atom(load, v)
        tma_out, gmem_out, tma_qd, gmem_qd, tma_mqk, gmem_mqk = None, None, None, None, None, None
        if const_expr(self.token_outputs):
            tma_out, gmem_out = self.token_tile_atom(store, out)
            tma_qd, gmem_qd = self.workspace_tile_atom(load, ws_qd)
            tma_mqk, gmem_mqk = runs_atom(load, layouts.tile_runs_view(ws_mqk), CHUNK, CHUNK)
        tma_kd, gmem_kd = self.workspace_tile_atom(load, ws_kd)
        tma_kr, gmem_kr = self.workspace_tile_atom(load, ws_kr)
        tma_inv, gmem_inv = runs_atom(load, layouts.tile_runs_view(ws_inv), CHUNK, CHUNK)
        tma_gt, gmem_gt = self.vector_atom(ws_gt, self.dim)
        tma_beta, gmem_beta = self.vector_atom(ws_beta, CHUNK)
        tma_cross_kd, gmem_cross_kd, tma_cross_qd, gmem_cross_qd = None, None, None, None
        if const_expr(ws_cross_kd is not None):
            tma_cross_kd, gmem_cross_kd = runs_atom(load, layouts.tile_runs_view(ws_cross_kd), CHUNK, CHUNK)
            if const_expr(self.token_outputs):  # Q: what only o reads
                tma_cross_qd, gmem_cross_qd = runs_atom(load, layouts.tile_runs_view(ws_cross_qd), CHUNK, CHUNK)
        tma_state_in, gmem_state_in = None, None
        if const_expr(initial_state is not None):
            tma_state_in, gmem_state_in = runs_atom(load, layouts.state_runs_view(initial_state), self.v_band, self.dim)
        tma_state_out, gmem_state_out = None, None
        if const_expr(final_state is not None):
            tma_state_out, gmem_state_out = runs_atom(store, layouts.state_runs_view(final_state), self.v_band, self.dim)

        prefix_pool = final_state if const_expr(self.prefix_checkpoint_every > 0) else None  # plain stores
        shape_of_rows = v  # without token outputs the kernel's ``out`` is v: only its shape (the batch's length)
        if const_expr(self.token_outputs):
            shape_of_rows = out
        self.shared_storage = self.make_shared_storage()

        self.kernel(
            tma_v, gmem_v, tma_out, gmem_out,
            tma_qd, gmem_qd, tma_kd, gmem_kd, tma_kr, gmem_kr,
            tma_gt, gmem_gt, tma_inv, gmem_inv, tma_mqk, gmem_mqk, tma_beta, gmem_beta,
            tma_state_in, gmem_state_in, tma_state_out, gmem_state_out,
            shape_of_rows,
            cu_seqlens, tile_base, Int32(tiles_per_head), checkpoints, state_indices, checkpoint_indices,
            prefix_pool, tma_cross_kd, gmem_cross_kd, tma_cross_qd, gmem_cross_qd, u_a,
        ).launch(
            grid=[self.vsplit * num_seqs, heads, 1],  # the bands of one (sequence, head) are adjacent CTAs
            block=[self.threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.launch_min_blocks,
        )

    # -----------------------------------------------------------------------------------------
    # device

    @cute.kernel
    def kernel(
        self,
        tma_v: cute.CopyAtom, gmem_v: cute.Tensor,
        tma_out: Optional[cute.CopyAtom], gmem_out: Optional[cute.Tensor],
        tma_qd: Optional[cute.CopyAtom], gmem_qd: Optional[cute.Tensor],
        tma_kd: cute.CopyAtom, gmem_kd: cute.Tensor,
        tma_kr: cute.CopyAtom, gmem_kr: cute.Tensor,
        tma_gt: cute.CopyAtom, gmem_gt: cute.Tensor,
        tma_inv: cute.CopyAtom, gmem_inv: cute.Tensor,
        tma_mqk: Optional[cute.CopyAtom], gmem_mqk: Optional[cute.Tensor],
        tma_beta: cute.CopyAtom, gmem_beta: cute.Tensor,
        tma_state_in: Optional[cute.CopyAtom], gmem_state_in: Optional[cute.Tensor],
        tma_state_out: Optional[cute.CopyAtom], gmem_state_out: Optional[cute.Tensor],
        out: cute.Tensor,  # o; without token outputs v, for its shape alone
        cu_seqlens: Optional[cute.Tensor],
        tile_base: Optional[cute.Tensor],
        tiles_per_head: Int32,
        checkpoints: Optional[cute.Tensor],
        state_indices: Optional[cute.Tensor],
        checkpoint_indices: Optional[cute.Tensor],
        prefix_pool: Optional[cute.Tensor],
        tma_cross_kd: Optional[cute.CopyAtom], gmem_cross_kd: Optional[cute.Tensor],
        tma_cross_qd: Optional[cute.CopyAtom], gmem_cross_qd: Optional[cute.Tensor],
        u_a: Optional[cute.Tensor],
    ):
        plan = self.plan
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        band_seq, head, _ = cute.arch.block_idx()
        seq, band = band_seq // self.vsplit, band_seq % self.vsplit
        batch, first_row, seq_len, num_tiles, ws_row0 = self.locate_sequence(
            seq, head, Int32(out.shape[1]), tiles_per_head, cu_seqlens, tile_base
        )

        # --- shared memory: operand views (ldmatrix/stmatrix) and TMA views of the same bytes
        storage = SmemAllocator().allocate(self.shared_storage)
        state_ptr, union_ptr, at = self.smem_pointers(storage)
        stages, out_stages = plan.input_stages, plan.output_stages
        cross = {}
        if const_expr(plan.pairs):
            cross = {name: smem_tensor(at[name], layouts.square_tile(plan), BFloat16) for name in layouts.CROSS_FIELDS
                     if name in at}  # Q with the token outputs only
        # the views in the plan's order; qd, Mqk and out (o's buffers) with the token outputs only
        views = dict(
            state=smem_tensor(state_ptr, layouts.state_b(plan), BFloat16),
            state_acc=smem_tensor(state_ptr, layouts.state_acc(plan), BFloat16),
            state_fp32=smem_tensor(union_ptr, layouts.state_fp32(plan), self.staging),
            state_fp32_acc=smem_tensor(union_ptr, layouts.state_fp32_acc(plan), self.staging),
            v=smem_tensor(at["v"], layouts.value_tile(plan, stages), self.token_dtype),
        )
        if const_expr(self.token_outputs):
            views["qd"] = aligned_smem_tensor(at["qd"], layouts.chunk_operand(plan), BFloat16)
        views["kd"] = aligned_smem_tensor(at["kd"], layouts.chunk_operand(plan), BFloat16)
        views["kr_t"] = aligned_smem_tensor(at["kr"], layouts.chunk_operand_transposed(plan), BFloat16)
        views["gt"] = smem_tensor(at["gt"], layouts.vector(self.dim, stages), Float32)
        views["inv"] = smem_tensor(at["inv"], layouts.square_tile(plan), BFloat16)
        if const_expr(self.token_outputs):
            views["mqk"] = smem_tensor(at["mqk"], layouts.square_tile(plan), BFloat16)
        views["beta"] = smem_tensor(at["beta"], layouts.vector(CHUNK, stages), Float32)
        if const_expr(self.token_outputs):
            views["out"] = smem_tensor(at["out"], layouts.value_tile(plan, out_stages), self.token_dtype)
        smem = RecurrenceSmem(**views, **cross)
        tma_smem = RecurrenceTmaSmem(**self.tma_boxes(state_ptr, union_ptr, at))
        load_pipe, store_pipe, state_mbar = self.make_pipelines(warp_idx, storage)

        # --- initial state → bf16 state buffer (a pool's: the sequence's slot, none for a padding row)
        slot, present = seq, None
        if const_expr(self.state_pool):
            slot = state_indices[seq]
            present = slot >= 0
        state_in_tiles = None
        if const_expr(self.initial_state is not None):
            state_in_tiles = self.state_tile(gmem_state_in, slot, head, band)
        self.load_initial_state(warp_idx, tidx, tma_state_in, state_in_tiles, state_mbar,
                                smem.state, smem.state_fp32, tma_smem.state, tma_smem.state_fp32, present)
        # the fp32 state lives in the compute warps' registers for the whole kernel
        state32 = self.band_blocks()
        if warp_idx < self.mma_warps:
            self.load_band32(warp_idx, state32, smem.state_acc, smem.state_fp32_acc)
        if const_expr(self.initial_state in STAGED_STATES):
            cute.arch.barrier()  # the staging is read before the load warp's first stage reuses its bytes

        # --- roles
        if warp_idx < self.mma_warps:
            first_tile, checkpoint_row0 = Int32(0), Int32(0)
            if const_expr(self.checkpoints):
                _, heads, _ = cute.arch.grid_dim()
                first_tile, checkpoint_row0 = self.kept_origin(ws_row0 - head * tiles_per_head, seq, head,
                                                                checkpoints.shape[0] // heads)
            prefix = None
            if const_expr(self.prefix_checkpoint_every > 0):
                prefix = PrefixCheckpoints(prefix_pool, checkpoint_indices[seq, None], head, seq_len // CHUNK, present)
            self.compute(warp_idx, num_tiles, load_pipe, store_pipe, smem, state32,
                         band, first_tile, checkpoint_row0, checkpoints, prefix, u_a)
        elif warp_idx == self.load_warp:
            # in the plan's order; qd and Mqk (what only o reads) with the token outputs only
            loads = ((tma_v, self.band_tiles(gmem_v, head, batch, first_row, band), tma_smem.v),)
            if const_expr(self.token_outputs):
                loads += ((tma_qd, self.workspace_rows(gmem_qd), tma_smem.qd),)
            loads += ((tma_kd, self.workspace_rows(gmem_kd), tma_smem.kd),
                      (tma_kr, self.workspace_rows(gmem_kr), tma_smem.kr),
                      (tma_inv, self.workspace_tiles(gmem_inv, CHUNK), tma_smem.inv))
            if const_expr(self.token_outputs):
                loads += ((tma_mqk, self.workspace_tiles(gmem_mqk, CHUNK), tma_smem.mqk),)
            loads += ((tma_gt, cute.local_tile(gmem_gt, (self.dim,), (0, None)), smem.gt),
                      (tma_beta, cute.local_tile(gmem_beta, (CHUNK,), (0, None)), smem.beta))
            if const_expr(plan.pairs):
                loads += ((tma_cross_kd, self.workspace_tiles(gmem_cross_kd, CHUNK), tma_smem.cross_kd),)
                if const_expr(self.token_outputs):
                    loads += ((tma_cross_qd, self.workspace_tiles(gmem_cross_qd, CHUNK), tma_smem.cross_qd),)
            self.load(num_tiles, ws_row0, load_pipe, loads)
        elif const_expr(self.token_outputs):
            # plain view of this (batch, head, band) from the sequence start, for tail rows
            out_rows = cute.domain_offset((first_row, band * self.v_band), out[batch, None, head, None])
            outputs = (OutputTile(tma_out, tma_smem.out, smem.out,
                                  self.band_tiles(gmem_out, head, batch, first_row, band), out_rows),)
            self.store(seq_len, num_tiles, store_pipe, outputs)

        # --- final state: bf16 is the state buffer as it stands; fp32 is S32, staged by the compute warps
        cute.arch.fence_view_async_shared()  # stmatrix writes of the state → visible to the TMA store
        cute.arch.barrier()
        if const_expr(self.final_state in STAGED_STATES):
            if warp_idx < self.mma_warps:
                self.stage_band32(warp_idx, state32, smem.state_fp32_acc)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()
        if const_expr(self.final_state is not None):
            state_out_tiles = self.state_tile(gmem_state_out, slot, head, band)
            if const_expr(self.state_pool):
                if present:
                    self.store_final_state(warp_idx, tidx, tma_state_out, state_out_tiles, smem.state,
                                           smem.state_fp32, tma_smem.state, tma_smem.state_fp32, staged=True)
            else:
                self.store_final_state(warp_idx, tidx, tma_state_out, state_out_tiles,
                                       smem.state, smem.state_fp32, tma_smem.state, tma_smem.state_fp32, staged=True)

    # -----------------------------------------------------------------------------------------
    # compute warps

    @cute.jit
    def compute(
        self, warp_idx: Int32, num_tiles: Int32,
        load_pipe: pipeline.PipelineTmaAsync, store_pipe: pipeline.PipelineAsync, smem: RecurrenceSmem,
        state32: tuple, band: Int32, first_tile: Int32, checkpoint_row0: Int32,
        checkpoints: Optional[cute.Tensor], prefix: Optional[PrefixCheckpoints] = None,
        u_a: Optional[cute.Tensor] = None,
    ):
        """Phases 1-6 per tile on the warp's ``warp_cols`` value columns (module docstring; without token outputs
        Phase 1 forms ``kS`` alone and Phases 4 and 5 go); ``state32``: the fp32 state of those columns
        (:meth:`band_blocks`, updated in place).

        Training variant: global tile ``g = first_tile + tile`` that starts a block of
        ``checkpoint_every`` (or its sequence) keeps the state entering it in checkpoint row
        ``checkpoint_row0 + g // checkpoint_every``: at the top of the tile each warp bulk-copies its rows
        of the state buffer there (:meth:`store_band_image`) and Phase 6 waits for that read before it
        writes them; warps of narrower bands store the state as Phase 1 loaded it (:meth:`store_band_fragment`).

        Prefix-checkpoint variant (``prefix``): after a tile that ends a C-block, :meth:`store_prefix_checkpoint`.
        ``u_a``: the pair training variant's (:class:`~cute_kda.kernels.fwd_recurrence_pairs.PairRecurrence`), None
        here.
        """
        lane = cute.arch.lane_idx()
        group = lane // 4  # fragment row g (rows g and g + 8)
        cols = self.warp_cols
        dim = self.dim
        k_steps = dim // CHUNK
        (tiled_mma, ldsm_a, ldsm_a_t, ldsm_b, ldsm_c, stsm_c, stsm_c_t, p_kd, p_qd, p_inv, p_mqk, p_kr_t, p_state, p_v,
         p_out, p_state_acc_st) = self.warp_views(warp_idx, smem, lane)

        outputs = self.token_outputs
        r_qd, acc_qs, r_o, v_qd, v_out = None, None, None, None, None  # o's, with the token outputs only
        # register fragments
        r_kd = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((CHUNK, dim)))  # ((2,2,2), 1, k_steps)
        if const_expr(outputs):
            r_qd = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((CHUNK, dim)))
        r_state = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((cols, dim)))  # ((2,2), n, k_steps)
        r_square = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((CHUNK, CHUNK)))  # INV, then Mqk
        r_kr_t = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((dim, CHUNK)))  # ((2,2,2), k_steps, 1)
        c_shape = tiled_mma.partition_shape_C((CHUNK, cols))  # ((2,2), 1, n)
        acc_ks = tiled_mma.make_fragment_C(c_shape)
        if const_expr(outputs):
            acc_qs = tiled_mma.make_fragment_C(c_shape)  # qS, then o
        acc = tiled_mma.make_fragment_C(c_shape)  # INV·u
        r_v = cute.make_rmem_tensor(c_shape, self.token_dtype)
        r_c16 = cute.make_rmem_tensor(c_shape, BFloat16)  # u, then U (bf16 C fragments)
        if const_expr(outputs):
            r_o = cute.make_rmem_tensor(c_shape, self.token_dtype)
        r_u_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((cols, CHUNK)))  # u as B
        r_big_u_b = tiled_mma.make_fragment_B(tiled_mma.partition_shape_B((cols, CHUNK)))  # U as B (Phases 4, 6)
        r_state_acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((dim, cols)), BFloat16)  # S, a row block at a time

        v_kd = ldsm_a.retile(r_kd)
        if const_expr(outputs):
            v_qd = ldsm_a.retile(r_qd)
        v_state = ldsm_b.retile(r_state)
        v_square = ldsm_a.retile(r_square)
        v_kr_t = ldsm_a_t.retile(r_kr_t)
        v_v = ldsm_c.retile(r_v)
        if const_expr(outputs):
            v_out = stsm_c.retile(r_o)
        v_state_acc_st = stsm_c_t.retile(r_state_acc)
        state_words = cute.recast_tensor(r_state_acc, Uint32)  # ((1,2), k_steps, n): pairs of value columns

        load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.plan.input_stages)
        out_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.plan.output_stages)
        for tile in cutlass.range(num_tiles, unroll=1):
            if const_expr(self.checkpoints):
                # the state entering the tile, as the buffer holds it (the last tile's writes are fenced)
                global_tile = first_tile + tile
                take_checkpoint = (global_tile % self.checkpoint_every == 0) or (tile == 0)
                checkpoint = self.band_image(checkpoints, checkpoint_row0 + global_tile // self.checkpoint_every)
                if const_expr(self.image_by_bulk):
                    if take_checkpoint:
                        self.store_band_image(checkpoint, smem.state, band, warp_idx)
            load_pipe.consumer_wait(load_state)
            stage = load_state.index
            # gT of every row block, read now so that Phase 6's decays wait on no load
            decays = [self.fragment_rows(smem.gt, stage, group, m) for m in range(k_steps)]

            # Phase 1: kS = kd·S, qS = qd·S; operands of step k+1 are loaded before the mma of step k
            acc_ks.fill(0.0)
            if const_expr(outputs):
                acc_qs.fill(0.0)
            cute.copy(ldsm_a, p_kd[None, None, 0, stage], v_kd[None, None, 0])
            if const_expr(outputs):
                cute.copy(ldsm_a, p_qd[None, None, 0, stage], v_qd[None, None, 0])
            cute.copy(ldsm_b, p_state[None, None, 0], v_state[None, None, 0])
            for k in cutlass.range_constexpr(k_steps):
                if const_expr(k + 1 < k_steps):
                    cute.copy(ldsm_a, p_kd[None, None, k + 1, stage], v_kd[None, None, k + 1])
                    if const_expr(outputs):
                        cute.copy(ldsm_a, p_qd[None, None, k + 1, stage], v_qd[None, None, k + 1])
                    cute.copy(ldsm_b, p_state[None, None, k + 1], v_state[None, None, k + 1])
                cute.gemm(tiled_mma, acc_ks, r_kd[None, None, k], r_state[None, None, k], acc_ks)
                if const_expr(outputs):
                    cute.gemm(tiled_mma, acc_qs, r_qd[None, None, k], r_state[None, None, k], acc_qs)
            if const_expr(self.checkpoints and not self.image_by_bulk):
                if take_checkpoint:  # narrow bands: S as Phase 1 loaded it
                    self.store_band_fragment(checkpoint, r_state, band, warp_idx, lane)

            # Phase 2: u = bf16(f32(v − kS)·β) in C format
            cute.copy(ldsm_c, p_v[None, None, None, stage], v_v)
            cute.copy(ldsm_a, p_inv[None, None, None, stage], v_square)
            beta = self.fragment_rows(smem.beta, stage, group)
            for i in cutlass.range_constexpr(cute.size(acc_ks)):
                r_c16[i] = BFloat16((Float32(r_v[i]) - acc_ks[i]) * beta[c_row_half(i)])

            # Phase 3: U = bf16(INV·u), u moved C → B in registers
            transpose_c_to_b(r_c16, r_u_b)
            acc.fill(0.0)
            cute.gemm(tiled_mma, acc, r_square[None, None, 0], r_u_b[None, None, 0], acc)
            r_c16.store(acc.load().to(BFloat16))

            # Phase 4: o = bf16(qS + Mqk·U) (qS is the accumulator's C; f16 for fp16 tokens); U as B is kept for
            # Phase 6
            transpose_c_to_b(r_c16, r_big_u_b)
            if const_expr(outputs):
                cute.copy(ldsm_a, p_mqk[None, None, None, stage], v_square)
                cute.gemm(tiled_mma, acc_qs, r_square[None, None, 0], r_big_u_b[None, None, 0], acc_qs)
                r_o.store(acc_qs.load().to(self.token_dtype))

                # Phase 5: o → output stage
                self.store_outputs(store_pipe, out_state, ((stsm_c, v_out, p_out),))
                out_state.advance()

            # Phase 6: S32 ← krᵀ·U + f32(gT·S32), row block m of 16 k at a time (the decayed block is the
            # mma's C), then S = bf16(S32) → the state buffer (after the checkpoint's copy has read it)
            if const_expr(self.checkpoints and self.image_by_bulk):
                if take_checkpoint:
                    self.wait_band_image_read()
            # block m+1's krᵀ is read before block m is stored, so no load waits behind a store
            cute.copy(ldsm_a_t, p_kr_t[None, 0, None, stage], v_kr_t[None, 0, None])
            for m in cutlass.range_constexpr(k_steps):
                block = state32[m]
                for i in cutlass.range_constexpr(cute.size(block)):
                    block[i] = mul_rn(decays[m][c_row_half(i)], block[i])
                cute.gemm(tiled_mma, block, r_kr_t[None, m, None], r_big_u_b[None, None, 0], block)
                if const_expr(m + 1 < k_steps):
                    cute.copy(ldsm_a_t, p_kr_t[None, m + 1, None, stage], v_kr_t[None, m + 1, None])
                self.round_block(block, state_words, m)
                cute.copy(stsm_c_t, v_state_acc_st[None, m, None], p_state_acc_st[None, m, None])

            # the warp's state columns and its reads of this stage are complete before lane 0 releases it (and
            # its state writes fenced for the next tile's checkpoint copy)
            if const_expr(self.checkpoints and self.image_by_bulk):
                cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()
            load_pipe.consumer_release(load_state)
            load_state.advance()
            if const_expr(self.prefix_checkpoint_every > 0):
                self.store_prefix_checkpoint(tile, state32, prefix, band, warp_idx)

    def warp_views(self, warp_idx: Int32, smem: RecurrenceSmem, lane: Int32) -> WarpViews:
        """The :class:`WarpViews` of compute warp ``warp_idx``: its ``warp_cols`` columns of the state (both views),
        of v and of out, and the whole tiles of kd, qd, kr, INV, Mqk (qd, Mqk and out None where ``smem`` has none:
        no token outputs)."""
        cols, dim = self.warp_cols, self.dim
        tiled_mma = self.warp_mma()
        ldsm_a, ldsm_a_t, ldsm_b, _, ldsm_c, stsm_c, stsm_c_t = self.thread_copies(tiled_mma, lane)
        w_state = cute.local_tile(smem.state, (cols, dim), (warp_idx, 0))  # [cols, K]
        w_state_acc = cute.local_tile(smem.state_acc, (dim, cols), (0, warp_idx))  # [K, cols]
        w_v = cute.local_tile(smem.v, (CHUNK, cols), (0, warp_idx, None))  # [16, cols, stage]
        outputs = smem.out is not None
        w_out = cute.local_tile(smem.out, (CHUNK, cols), (0, warp_idx, None)) if outputs else None  # [16, cols, stage]
        return WarpViews(
            tiled_mma, ldsm_a, ldsm_a_t, ldsm_b, ldsm_c, stsm_c, stsm_c_t,
            p_kd=ldsm_a.partition_S(smem.kd), p_qd=ldsm_a.partition_S(smem.qd) if outputs else None,
            p_inv=ldsm_a.partition_S(smem.inv), p_mqk=ldsm_a.partition_S(smem.mqk) if outputs else None,
            p_kr_t=ldsm_a_t.partition_S(smem.kr_t), p_state=ldsm_b.partition_S(w_state), p_v=ldsm_c.partition_S(w_v),
            p_out=stsm_c.partition_D(w_out) if outputs else None, p_state_acc_st=stsm_c_t.partition_D(w_state_acc),
        )

    @cute.jit
    def store_prefix_checkpoint(self, tile: Int32, state32: tuple, prefix: PrefixCheckpoints, band: Int32,
                                warp_idx: Int32):
        """After tile ``tile``: when it ends C-block ``j`` of the sequence (``(tile + 1) · 16 = (j + 1) · C`` tokens,
        all valid) and ``prefix.slots[j]`` is a slot of the pool, the warp's fp32 state columns → that slot, each
        lane storing its C-fragment elements (in the pool's dtype) from registers."""
        tiles_per_block = self.prefix_checkpoint_every // CHUNK
        done = tile + 1
        if prefix.active and done % tiles_per_block == 0 and done <= prefix.full_tiles:
            block = done // tiles_per_block - 1
            if block < prefix.slots.shape[0]:
                target = prefix.slots[block]
                if target >= 0 and target < prefix.pool.shape[0]:  # never a write outside the pool
                    matrix = prefix.pool[target, prefix.head, None, None]  # [V, K]
                    matrix_acc = cute.make_tensor(matrix.iterator, cute.select(matrix.layout, mode=[1, 0]))
                    band_acc = cute.local_tile(matrix_acc, (self.dim, self.v_band), (0, band))
                    elements = self.warp_band_elements(warp_idx, band_acc)
                    for m in cutlass.range_constexpr(len(state32)):
                        values, rows = state32[m], elements[None, m, None]
                        for i in cutlass.range_constexpr(cute.size(values)):
                            rows[i] = rows.element_type(values[i])
