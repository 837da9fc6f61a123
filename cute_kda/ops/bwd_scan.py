"""Torch launcher of Kernel A (:class:`cute_kda.kernels.bwd_scan.BwdScan`), the backward state-gradient scan.

Like :mod:`.recurrence`: inputs are the forward's validated tensors plus the upstream gradients, on
one CUDA device, C-contiguous (``dv`` and ``du`` past their batch mode, whose stride is free), 16-byte
aligned; this module checks the buffers it is handed against each other (shapes, dtypes, devices,
strides), picks the compiled variant and launches on torch's current stream. Nothing here reads
device memory on the host.
"""

from __future__ import annotations

import torch

from .. import validation
from ..device import sm_count
from ..numerics import NATIVE_HEAD_DIMS, SCAN_VSPLITS
from ..variants import ScanTuning, ScanVariant
from ..workspace import SNAPSHOT_TILES, CrossBlocks, Workspace, block_states_shape, pair_blocks_shape
from ._cache import (
    CompileCache, compile_for_launch, current_stream, device_index, dsl_type, fake_stream, launch_tensor,
    to_cute_tensor,
)
from .prepare import compile_problem, tile_bases
from .recurrence import dtype_or_none

_CACHE = CompileCache("bwd_scan")
_STATE_DTYPES = (torch.bfloat16, torch.float32)
# dv: bf16, or fp16 as f16(bf16(β·du)) for fp16 training (``ScanVariant.dv_dtype``, picked by dv's dtype; the training
# executor's :data:`~cute_kda.executors.training.FP16_GRAD_STORES`)
DV_DTYPES = (torch.bfloat16, torch.float16)


def launch_arguments(
    do: torch.Tensor, ws: Workspace, dv: torch.Tensor, du: torch.Tensor, snapshots: torch.Tensor, *,
    dht: torch.Tensor | None, dh0: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    tile_base: torch.Tensor | None, cross: CrossBlocks | None = None, tensor=launch_tensor,
) -> tuple:
    """The tensor arguments of ``BwdScan.__call__`` (dynamic shapes: one compile serves all sizes); ``cross``: the
    pair workspace's cross blocks (the pair scan).

    ``tensor(t, assumed_align)``: :func:`~._cache.launch_tensor` for a call of the compiled function,
    :func:`~._cache.to_cute_tensor` for the compile.
    """
    from ..kernels.bwd_scan import ScanWorkspace

    workspace = ScanWorkspace(
        qd=tensor(ws.qd, 16), kd=tensor(ws.kd, 16), kr=tensor(ws.kr, 16), gt=tensor(ws.gt, 16),
        inv=tensor(ws.inv, 16), mqk=tensor(ws.mqk, 16), beta=tensor(ws.beta, 16),
    )
    cross_kd, cross_qd = (None, None) if cross is None else cross
    return (
        tensor(do, 16), tensor(dv, 16), tensor(du, 16), workspace, tensor(snapshots, 16),
        tensor(dht, 16), tensor(dh0, 16), tensor(cu_seqlens, 8), tensor(tile_base, 4), tensor(cross_kd, 16),
        tensor(cross_qd, 16),
    )


def compiled_variant(variant: ScanVariant, index: int, tensors: dict):
    """The compiled Kernel A ``variant`` on device ``index``, compiled on first use from ``tensors``
    (:func:`launch_arguments`' keywords, real or ``meta``)."""

    def build():
        from ..kernels.bwd_scan import BwdScan
        from ..kernels.bwd_scan_pairs import PairBwdScan

        tuning = variant.tuning
        kernel = (PairBwdScan if variant.pairs else BwdScan)(
            vsplit=variant.vsplit, dht=dsl_type(variant.dht), dh0=dsl_type(variant.dh0), varlen=variant.varlen,
            snapshot_every=variant.snapshot_every, compute_warps=tuning.compute_warps,
            output_stages=tuning.output_stages, split_accumulator=tuning.split_accumulator,
            token_outputs=variant.token_outputs, dim=variant.dim, dv_dtype=dsl_type(variant.dv_dtype))
        return compile_for_launch(kernel, *launch_arguments(**tensors, tensor=to_cute_tensor), fake_stream())

    return _CACHE.get((variant, index), build)


def _check_buffers(do, ws, dv, du, snapshots, dht, dh0, num_seqs: int, snapshot_every: int, pairs: bool) -> None:
    """Shapes, dtypes and devices of Kernel A's buffers against ``do`` and the workspace."""
    batch, steps, heads, dim = do.shape
    if do.dtype != torch.bfloat16 or dim != ws.qd.shape[-1] or dim not in NATIVE_HEAD_DIMS:
        raise ValueError(f"do must be bf16 [B, T, H, {ws.qd.shape[-1]}], got {do.dtype} {tuple(do.shape)}")
    if ws.qd.shape[0] % heads:
        raise ValueError(f"workspace rows {ws.qd.shape[0]} are not a multiple of H = {heads}")
    validation.check_buffer("dv", dv, DV_DTYPES, do.shape, do.device, batch_stride_free=True)
    validation.check_buffer("du", du, (torch.bfloat16,), do.shape, do.device, batch_stride_free=True)
    expected = pair_blocks_shape(ws, heads, num_seqs) if pairs else block_states_shape(ws, heads, num_seqs,
                                                                                         snapshot_every)
    validation.check_buffer("snapshots", snapshots, (torch.bfloat16,), expected, do.device)
    for name, t in (("dht", dht), ("dh0", dh0)):
        if t is not None:
            validation.check_buffer(name, t, _STATE_DTYPES, (num_seqs, heads, dim, dim), do.device)
    if ws.qd.device != do.device:
        raise ValueError(f"ws is on {ws.qd.device}, do on {do.device}")


def bwd_scan(
    do: torch.Tensor, ws: Workspace, dv: torch.Tensor, du: torch.Tensor, snapshots: torch.Tensor, *,
    cu_seqlens: torch.Tensor | None = None, tile_base: torch.Tensor | None = None, dht: torch.Tensor | None = None,
    dh0: torch.Tensor | None = None, vsplit: int | None = None, tuning: ScanTuning = ScanTuning(),
    token_outputs: bool = True, snapshot_every: int = SNAPSHOT_TILES, cross: CrossBlocks | None = None,
) -> None:
    """Run Kernel A: ``dv``, ``du`` (valid rows only), ``snapshots`` and, when given, ``dh0``.

    do, dv, du: bf16 ``[B, T, H, D]`` (dv may be fp16: the bf16 value converted, :data:`DV_DTYPES`), D in
    :data:`~cute_kda.numerics.NATIVE_HEAD_DIMS` and the workspace's (dO the gradient w.r.t. the forward's output; du
    the gradient w.r.t. ``u = β ⊙ (v − kd S)`` of each tile, for the tile-gradient kernel; dv the gradient w.r.t. v).
    ws: the K1 :class:`~cute_kda.workspace.Workspace` of the forward these gradients belong to.
    snapshots: bf16 ``[H · slots, D, D]`` state images (:func:`cute_kda.workspace.block_states_shape` with
    ``snapshot_every``): row ``h · slots + g // snapshot_every + s`` receives the gradient w.r.t. the state after
    global tile ``g`` of sequence ``s``, head ``h``, where ``g`` ends a block of ``snapshot_every`` global tiles
    or the sequence (:func:`~cute_kda.workspace.kept_tiles`); other rows are not written. The training step's
    Kernel B reads one per tile (the default, :data:`~cute_kda.workspace.SNAPSHOT_TILES`); ``snapshot_every=4``
    keeps one per 64 tokens, the density of FLA's reverse scan, for ``benchmarks/bench_bwd.py``.
    dht: None (zero) or bf16 / fp32 ``[N, H, V, K]``, the gradient w.r.t. the final state; dh0: None or bf16 / fp32 ``[N, H, V, K]``, receives the gradient w.r.t. the initial state
    (the bf16 scan value, widened exactly for fp32). ``cu_seqlens`` int64 ``[N+1]`` with B == 1
    packs N sequences (``tile_base`` int32 ``[N+1]`` derived when not given); ``vsplit`` ∈ {1, 2, 4, 8}
    or None (:meth:`~cute_kda.variants.ScanVariant.choose_vsplit`); ``tuning``: :class:`ScanTuning`. ``token_outputs`` False: only ``dh0`` is
    written (dv, du and snapshots are left as they are; ``dh0`` required). ``cross``: the pair workspace's cross
    blocks (``ws`` then the pair workspace of K1's pair variant): the two-tile scan (planned W2 of docs/perf-log.md
    v8, :class:`~cute_kda.kernels.bwd_scan_pairs.PairBwdScan`), a snapshot a pair, ``snapshots``
    :func:`~cute_kda.workspace.pair_blocks_shape` in the slots of :func:`~cute_kda.workspace.pair_block_slots`
    (``snapshot_every`` 2, token outputs, one G2 accumulator). Launches on torch's current stream of ``do``'s
    device.
    """
    varlen = cu_seqlens is not None
    num_seqs = validation.num_seqs(do.shape[0], cu_seqlens)
    heads = do.shape[2]
    if snapshot_every < 1:
        raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
    if cross is not None and (snapshot_every != 2 or not token_outputs or tuning.split_accumulator):
        raise ValueError("the two-tile scan (cross) keeps a snapshot a pair (snapshot_every=2), writes its token "
                         "outputs and runs G2 on one accumulator")
    _check_buffers(do, ws, dv, du, snapshots, dht, dh0, num_seqs, snapshot_every, cross is not None)
    if vsplit is not None and vsplit not in SCAN_VSPLITS:
        raise ValueError(f"vsplit must be one of {SCAN_VSPLITS} or None, got {vsplit}")
    if not token_outputs and dh0 is None:
        raise ValueError("a scan without token outputs (token_outputs=False) needs dh0, its only output")
    if num_seqs == 0 or heads == 0:
        return
    if vsplit is None:
        vsplit = ScanVariant.choose_vsplit(num_seqs, heads, sm_count(device_index(do.device)))
    if varlen and tile_base is None:
        tile_base = tile_bases(cu_seqlens)
    with torch.cuda.device(do.device):
        stream = current_stream(do.device)
        tensors = dict(do=do, ws=ws, dv=dv, du=du, snapshots=snapshots, dht=dht, dh0=dh0,
                       cu_seqlens=cu_seqlens, tile_base=tile_base, cross=cross)
        variant = ScanVariant(vsplit, dtype_or_none(dht), dtype_or_none(dh0), varlen, tuning, bool(token_outputs),
                              snapshot_every, dim=do.shape[-1], dv_dtype=dv.dtype, pairs=cross is not None)
        compiled_variant(variant, device_index(do.device), tensors)(*launch_arguments(**tensors), stream)



def compile_variant(variant: ScanVariant, device: torch.device | str) -> None:
    """Compile (or load from the disk cache) the Kernel A ``variant`` for ``device`` ahead of time from ``meta``
    tensors: nothing is allocated or launched."""
    if variant.vsplit not in SCAN_VSPLITS:
        raise ValueError(f"vsplit must be one of {SCAN_VSPLITS}, got {variant.vsplit}")
    problem = compile_problem(variant.varlen, variant.dim)
    do = problem.tokens()
    snapshots, cross = problem.block_states(variant.snapshot_every), None
    if variant.pairs:
        snapshots = problem.zeros(*pair_blocks_shape(problem.ws, problem.heads, problem.num_seqs))
        cross = CrossBlocks(*(torch.empty_like(problem.ws.inv) for _ in range(2)))
    tensors = dict(do=do, ws=problem.ws, dv=problem.tokens(dtype=variant.dv_dtype), du=do, snapshots=snapshots,
                   dht=problem.state(variant.dht), dh0=problem.state(variant.dh0), cu_seqlens=problem.cu_seqlens,
                   tile_base=problem.tile_base, cross=cross)
    compiled_variant(variant, device_index(torch.device(device)), tensors)
