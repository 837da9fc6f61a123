"""Torch launcher of K2 (:class:`cute_kda.kernels.fwd_recurrence.FwdRecurrence`).

Inputs are assumed validated by the API layer (``cute_kda.validation``): dtypes, shapes, one CUDA
device, C-contiguous tensors with 16-byte aligned base addresses, ``B == 1`` with ``cu_seqlens``
and non-decreasing ``cu_seqlens`` values. This module only converts, picks the compiled variant and
launches on torch's current stream; nothing here reads device memory on the host.
"""

from __future__ import annotations

import torch

from .. import validation
from ..device import sm_count
from ..variants import RecurrenceVariant
from ..workspace import CrossBlocks, Workspace, block_states_shape, pair_blocks_shape, pair_u_shape
from ._cache import (
    CompileCache, compile_for_launch, current_stream, device_index, dsl_type, fake_stream, launch_tensor, on_device,
    to_cute_tensor,
)
from .prepare import compile_problem, tile_bases

_CACHE = CompileCache("fwd_recurrence")
# bytes, per tensor of launch_arguments (cu_seqlens 8; tile_base, state_indices, checkpoint_indices 4)
_ARGUMENT_ALIGNMENT = (16,) * 11 + (8, 4, 16, 4, 4, 16, 16, 16)


def dtype_or_none(tensor: torch.Tensor | None) -> torch.dtype | None:
    return None if tensor is None else tensor.dtype


def launch_arguments(
    v: torch.Tensor, ws: Workspace, out: torch.Tensor | None, *, cu_seqlens: torch.Tensor | None,
    tile_base: torch.Tensor | None, initial_state: torch.Tensor | None, final_state: torch.Tensor | None,
    checkpoints: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
    checkpoint_indices: torch.Tensor | None = None, cross: CrossBlocks | None = None, u_a: torch.Tensor | None = None,
    tensor=launch_tensor,
) -> tuple:
    """The tensor arguments of ``FwdRecurrence.__call__`` (dynamic shapes: one compile serves all sizes). A pool
    call passes the pool as both ``initial_state`` and ``final_state``; ``cross``: the pair workspace's cross blocks
    (the pair K2); ``u_a``: tile a's U rows of the pair K2's training variant; ``out`` None: a pass without token
    outputs.

    ``tensor(t, assumed_align)`` converts each: :func:`~._cache.launch_tensor` (the default) for a
    call of the compiled function, :func:`~._cache.to_cute_tensor` for the compile.
    """
    cross_kd, cross_qd = (None, None) if cross is None else cross
    tensors = (v, out, ws.qd, ws.kd, ws.kr, ws.gt, ws.inv, ws.mqk, ws.beta, initial_state, final_state,
               cu_seqlens, tile_base, checkpoints, state_indices, checkpoint_indices, cross_kd, cross_qd, u_a)
    if tensor is launch_tensor:  # every call: the tensors as they are
        return tensors
    return tuple(tensor(t, align) for t, align in zip(tensors, _ARGUMENT_ALIGNMENT))


def workspace_arguments(ws: Workspace, cross: CrossBlocks | None = None) -> tuple:
    """K2's workspace tensors for repeated launches on ``ws`` (:func:`launch`), as FFI tensors converted once
    by the caller that keeps them (a torch tensor is converted anew on every call): ``(fields, cross blocks)``, the
    second ``(None, None)`` without ``cross``."""
    import tvm_ffi

    blocks = (None, None) if cross is None else tuple(tvm_ffi.from_dlpack(block) for block in cross)
    return tuple(tvm_ffi.from_dlpack(field) for field in ws), blocks


def launch(compiled, v: torch.Tensor, out: torch.Tensor, workspace: tuple, initial_state, final_state, cu_seqlens,
           tile_base, stream, state_indices=None, checkpoint_indices=None) -> None:
    """Call the compiled K2 ``compiled`` (inference: no training checkpoints) in :func:`launch_arguments`' order, with
    the :func:`workspace_arguments` ``workspace``."""
    fields, cross = workspace
    compiled(v, out, *fields, initial_state, final_state, cu_seqlens, tile_base, None, state_indices,
             checkpoint_indices, *cross, None, stream)


def compiled_variant(variant: RecurrenceVariant, index: int, arguments: tuple):
    """The compiled K2 ``variant`` on device ``index``, compiled on first use from ``arguments`` (a
    :func:`launch_arguments` tuple of torch tensors, real or ``meta``: only their dtypes, ranks and alignment
    count)."""

    def build():
        from ..kernels.fwd_recurrence import FwdRecurrence
        from ..kernels.fwd_recurrence_pairs import PairRecurrence

        initial_state, final_state, dtype = (dsl_type(t) for t in (variant.initial_state, variant.final_state,
                                                                   variant.dtype))
        converted = [to_cute_tensor(t, align) for t, align in zip(arguments, _ARGUMENT_ALIGNMENT)]
        kernel_class = PairRecurrence if variant.pairs else FwdRecurrence
        kernel = kernel_class(vsplit=variant.vsplit, initial_state=initial_state, final_state=final_state,
                              varlen=variant.varlen, checkpoints=variant.checkpoints, state_pool=variant.state_pool,
                              prefix_checkpoint_every=variant.prefix_checkpoint_every, dtype=dtype, dim=variant.dim,
                              token_outputs=variant.token_outputs)
        return compile_for_launch(kernel, *converted, fake_stream())

    return _CACHE.get((variant, index), build)


def recurrence(
    v: torch.Tensor,
    ws: Workspace,
    out: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    tile_base: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    vsplit: int | None = None,
    checkpoints: torch.Tensor | None = None,
    cross: CrossBlocks | None = None,
    u_a: torch.Tensor | None = None,
    stream=None,
) -> None:
    """Run K2: ``out`` (valid rows only) and, when given, ``final_state``, from v and the K1 workspace; ``out`` None
    runs the pass for its states alone (``checkpoints`` or ``final_state``; no o formed, qd and Mqk not read; the
    two-tile step: ``checkpoints`` and ``u_a``, Q not read either).

    v, out: bf16 or fp16 (both the same) ``[B, T, H, D]`` (D in :data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`, the
    workspace's); ws: the :class:`~cute_kda.workspace.Workspace` of
    these sequences; initial_state / final_state: None or bf16 / fp32 / fp16 ``[N, H, V, K]`` (fp16 not beside
    fp32; the dtype of each selects the variant; the state is fp32 between tiles). ``cu_seqlens`` int64 ``[N+1]`` with B == 1
    packs N sequences; ``tile_base`` int32 ``[N+1]`` (prefix sums of ``ceil(len / 16)``) is derived
    from it when not given. ``vsplit`` None: :meth:`~cute_kda.variants.RecurrenceVariant.choose_vsplit`. ``checkpoints``: None, or bf16
    ``[H · slots, D, D]`` state images (:func:`cute_kda.workspace.block_states_shape`) for the training forward, which
    also keeps the bf16 state entering every block of :data:`~cute_kda.workspace.SNAPSHOT_TILES` tiles there (the slots of
    :func:`cute_kda.workspace.snapshot_slots`; other rows are not written). ``cross``: the pair workspace's cross
    blocks (``ws`` then the pair workspace of K1's pair variant): the two-tile serial step, whose training variant
    (planned W2 of docs/perf-log.md v8) keeps a state a pair instead: ``checkpoints`` bf16
    :func:`~cute_kda.workspace.pair_blocks_shape` state images and ``u_a`` bf16
    :func:`~cute_kda.workspace.pair_u_shape`, tile a's U value-major, both in the slots of
    :func:`~cute_kda.workspace.pair_block_slots` (other rows are not written). Launches on ``stream`` (a
    ``CUstream``; default torch's current stream on v's device).
    """
    varlen = cu_seqlens is not None
    num_seqs = validation.num_seqs(v.shape[0], cu_seqlens)
    heads = v.shape[2]
    if num_seqs == 0 or heads == 0:
        return
    if (u_a is not None) != (cross is not None and checkpoints is not None):
        raise ValueError("u_a comes with the two-tile step's checkpoints (cross and checkpoints), and they with it")
    if out is None and (checkpoints is None and (cross is not None or final_state is None)):
        raise ValueError("out=None (a pass for its states alone) needs checkpoints or final_state (with cross: "
                         "checkpoints)")
    if vsplit is None:
        vsplit = RecurrenceVariant.choose_vsplit(num_seqs, heads, sm_count(device_index(v.device)))
    kept = (("checkpoints", checkpoints, block_states_shape(ws, heads, num_seqs)),)
    if cross is not None:
        kept = (("checkpoints", checkpoints, pair_blocks_shape(ws, heads, num_seqs)),
                ("u_a", u_a, pair_u_shape(ws, heads, num_seqs)))
    for name, buffer, expected in kept:
        if buffer is not None:
            validation.check_buffer(name, buffer, (torch.bfloat16,), expected, v.device)
    if varlen and tile_base is None:
        tile_base = tile_bases(cu_seqlens)
    with on_device(v.device):
        if stream is None:
            stream = current_stream(v.device)
        arguments = launch_arguments(v, ws, out, cu_seqlens=cu_seqlens, tile_base=tile_base,
                                     initial_state=initial_state, final_state=final_state, checkpoints=checkpoints,
                                     cross=cross, u_a=u_a)
        variant = RecurrenceVariant(vsplit, dtype_or_none(initial_state), dtype_or_none(final_state), varlen,
                                    checkpoints is not None, dtype=v.dtype, dim=v.shape[-1], pairs=cross is not None,
                                    token_outputs=out is not None)
        compiled_variant(variant, device_index(v.device), arguments)(*arguments, stream)


def compile_variant(variant: RecurrenceVariant, device: torch.device | str) -> None:
    """Compile (or load from the disk cache) the K2 ``variant`` for ``device`` from ``meta`` tensors: nothing is
    allocated or launched."""
    problem = compile_problem(variant.varlen, variant.dim)
    v = problem.tokens(dtype=variant.dtype)
    num_seqs = problem.state(torch.float32).shape[0]
    state_indices = torch.empty(num_seqs, dtype=torch.int32, device="meta") if variant.state_pool else None
    checkpoint_indices = None
    if variant.prefix_checkpoint_every:
        checkpoint_indices = torch.empty(num_seqs, 1, dtype=torch.int32, device="meta")
    checkpoints = cross = u_a = None
    if variant.checkpoints:
        checkpoints = problem.block_states()
    if variant.pairs:
        cross = CrossBlocks(*(torch.empty_like(problem.ws.inv) for _ in range(2)))
        if variant.checkpoints:
            checkpoints, u_a = (problem.zeros(*shape(problem.ws, problem.heads, problem.num_seqs))
                                for shape in (pair_blocks_shape, pair_u_shape))
    out = v if variant.token_outputs else None
    arguments = launch_arguments(v, problem.ws, out, cu_seqlens=problem.cu_seqlens, tile_base=problem.tile_base,
                                 initial_state=problem.state(variant.initial_state),
                                 final_state=problem.state(variant.final_state), checkpoints=checkpoints,
                                 state_indices=state_indices, checkpoint_indices=checkpoint_indices, cross=cross,
                                 u_a=u_a)
    compiled_variant(variant, device_index(torch.device(device)), arguments)
