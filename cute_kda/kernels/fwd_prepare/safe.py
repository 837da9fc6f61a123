"""K1 for the bounded (safe) gate, FlashKDA's form; ``num_threads`` threads (128 or 256):

1. *Load.* Warp 0 TMA-loads the q, k and g tiles (``[16, 128]`` bf16 or fp16, 128-byte swizzle) behind one
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

Occupancy (K1 is memory-bound: tiles in flight per SM matter). Default 128 threads with
``minctasm = 8``: ptxas fits the kernel in 62 registers (8 × 128 × 64 = 65 536) and the 25.6 KB of
shared memory fits 8 times per SM, so 8 tiles (8 × 12 KB of TMA loads) are in flight per SM. The
256-thread variant needs 48 registers, i.e. 5 CTAs per SM (6 would spill).
"""

from __future__ import annotations

from cutlass import BFloat16, Float32, Int32

from ...dsl import cute
from ...layouts import fwd_prepare as plan
from ...layouts.smem import CHUNK
from ..common.copy import warp_tiled_mma
from ..common.fastmath import ex2_approx
from .base import PrepareInputs, PrepareKernel, PrepareScalars, PrepareTma, WorkspaceTiles


class SafePrepare(PrepareKernel):
    """K1 for the safe gate (g per channel in q's dtype; 128 or 256 threads)."""

    gates = ("safe",)
    gate_tile = True
    thread_counts = (128, 256)
    default_ctas_per_sm = 8
    smem_plan = staticmethod(plan.smem_budget)

    @cute.jit
    def prepare_tile(self, tma: PrepareTma, inputs: PrepareInputs, ws: WorkspaceTiles,
                     scalars: PrepareScalars, head: Int32, qk_head: Int32, slot: Int32, row0: Int32,
                     valid_rows: Int32):
        """The phases of the safe gate (module docstring)."""
        tidx, warp_idx, lane, storage, tile_layout = self.start_tile()
        s_q, s_k, s_g, s_kinv = self.swizzled_views(tile_layout, storage.q, storage.k, storage.g, storage.kinv)
        q_in, k_in, g_in = self.input_views(tile_layout, storage.q, storage.k, storage.g)
        (s_cumsum,) = self.swizzled_views(plan.gate_cumsum_tile(self.dim), storage.gate_cumsum)
        s_beta = storage.beta.get_tensor(plan.row_vector())
        tma_barrier = storage.tma_barrier.data_ptr()

        if warp_idx == 0:
            self.load_inputs(((tma.q, q_in, qk_head, row0), (tma.k, k_in, qk_head, row0), (tma.g, g_in, head, row0)),
                             tma_barrier)
        # gate inputs of this thread's scan column, fetched while the TMA runs
        col = tidx % self.dim
        dt, e_a = self.gate_constants(inputs.a_log, inputs.dt_bias, head, col)
        if tidx < CHUNK:
            self.activate_beta(inputs.beta, ws.beta, s_beta, head, slot, row0, valid_rows, tidx)
        cute.arch.sync_threads()  # the barrier is initialised before anyone waits on it
        cute.arch.mbarrier_wait(tma_barrier, 0)

        if tidx < self.dim:
            ws.gt[slot, col] = ex2_approx(self.gate_scan(g_in, s_cumsum, col, dt, e_a, scalars.c_gate, valid_rows))
        cute.arch.sync_threads()
        # qd, kd, kr written over q, k, g
        self.decay(q_in, k_in, s_cumsum, s_q, s_k, s_g, s_kinv, scalars.scale, valid_rows, tidx)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes → TMA store reads
        cute.arch.sync_threads()

        if warp_idx == self.kkt_warp:
            self.kkt_inverse(s_k, s_kinv, s_beta, ws.inv, slot, lane)
        elif warp_idx == self.qk_warp:
            self.masked_qk(s_q, s_kinv, ws.mqk, slot, lane)
        elif warp_idx == self.store_warp:
            self.store_tiles(tma, s_q, s_k, s_g, slot)

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
    def masked_qk(self, s_qd, s_kinv, ws_mqk: cute.Tensor, slot: Int32, lane: Int32):
        """Warp 1: ``Mqk = bf16(qd_i·kinv_j)`` for i ≥ j, else 0."""
        self.store_mqk(self.tile_product(warp_tiled_mma(BFloat16, Float32), s_qd, s_kinv, lane), ws_mqk, slot, lane)
