"""Torch launchers of K1 (:class:`cute_kda.kernels.fwd_prepare.PrepareKernel`) and of the varlen tile
bases (:class:`cute_kda.kernels.tile_prefix.TilePrefixKernel`).

Inputs are assumed validated by the API layer (``cute_kda.validation``): dtypes, shapes,
C-contiguity, 16-byte aligned base addresses, one CUDA device, ``B == 1`` with ``cu_seqlens``.
Everything launches on torch's current stream of that device; nothing here reads device memory on
the host. Variants compile from fake tensors (``meta`` tensors described by
:func:`~._cache.to_cute_tensor`), so a compile needs neither a call's tensors nor device memory.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from .. import validation
from ..numerics import HEAD_DIM, f32, gate_constant
from ..variants import PrepareVariant
from ..workspace import (
    CHUNK, SNAPSHOT_TILES, CrossBlocks, PartnerFields, Workspace, WorkspaceSpec, allocate_cross_blocks,
    allocate_partner_fields, allocate_workspace, block_states_shape,
)
from ._cache import (
    CompileCache, compile_for_launch, current_stream, device_index, dsl_type, fake_stream, launch_tensor,
    on_device, to_cute_tensor,
)

_PREPARE = CompileCache("fwd_prepare")
_TILE_PREFIX = CompileCache("tile_prefix")
_META = torch.device("meta")


def _compile_tile_prefix():
    from ..kernels.tile_prefix import TilePrefixKernel

    cu_seqlens = torch.empty(2, dtype=torch.int64, device=_META)
    tile_base = torch.empty(2, dtype=torch.int32, device=_META)
    return compile_for_launch(TilePrefixKernel(), to_cute_tensor(cu_seqlens, 8), to_cute_tensor(tile_base, 4),
                              fake_stream())


class CompileProblem(NamedTuple):
    """The small problem the ahead-of-time compiles of K2, Kernel A and Kernel B describe their arguments with: two
    sequences (of two tiles each, or packed in one row of one tile each), two heads, head dim D; ``meta`` tensors (a
    compile reads dtypes, ranks and alignment only)."""

    rows: tuple[int, int]  # (B, T) of the token tensors
    heads: int
    dim: int
    num_seqs: int
    ws: Workspace
    cu_seqlens: torch.Tensor | None
    tile_base: torch.Tensor | None
    device: torch.device

    def zeros(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def tokens(self, heads: int | None = None, inner: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``[B, T, heads, *inner]`` (``heads`` default the problem's, ``inner`` default ``(D,)``)."""
        inner = (self.dim,) if inner is None else inner
        return self.zeros(*self.rows, self.heads if heads is None else heads, *inner, dtype=dtype)

    def state(self, dtype: torch.dtype | None) -> torch.Tensor | None:
        """``[N, H, D, D]`` of ``dtype``, or None."""
        return None if dtype is None else self.zeros(self.num_seqs, self.heads, self.dim, self.dim, dtype=dtype)

    def block_states(self, every: int = SNAPSHOT_TILES) -> torch.Tensor:
        """The checkpoints' / snapshots' bf16 ``block_states_shape`` (one kept state per ``every`` tiles)."""
        return self.zeros(*block_states_shape(self.ws, self.heads, self.num_seqs, every))


def compile_problem(varlen: bool, dim: int = HEAD_DIM) -> CompileProblem:
    num_seqs, heads = 2, 2
    cu_seqlens = torch.empty(num_seqs + 1, dtype=torch.int64, device=_META) if varlen else None
    tile_base = torch.empty(num_seqs + 1, dtype=torch.int32, device=_META) if varlen else None
    return CompileProblem(rows=(1 if varlen else num_seqs, 2 * CHUNK), heads=heads, dim=dim, num_seqs=num_seqs,
                          ws=allocate_workspace(WorkspaceSpec(heads=heads, tiles=4, dim=dim), _META),
                          cu_seqlens=cu_seqlens, tile_base=tile_base, device=_META)


def tile_bases(cu_seqlens: torch.Tensor, *, stream=None) -> torch.Tensor:
    """int32 ``[N+1]`` on ``cu_seqlens``' device: ``Σ_{j<s} ⌈len_j / 16⌉`` (one device kernel, no sync).

    ``cu_seqlens``: int64 ``[N+1]``, non-decreasing from 0, on a CUDA device. ``stream``: the
    ``CUstream`` to launch on, default torch's current stream there.
    """
    device = cu_seqlens.device
    out = torch.empty(cu_seqlens.numel(), dtype=torch.int32, device=device)
    compiled = _TILE_PREFIX.get((device_index(device),), _compile_tile_prefix)
    with on_device(device):
        compiled(cu_seqlens, out, current_stream(device) if stream is None else stream)
    return out


def launch_arguments(q, k, g, beta, A_log, dt_bias, ws: Workspace, scale: float, lower_bound: float,
                     seq_len: int, cu_seqlens, tile_base, stream, tensor=launch_tensor,
                     cross: CrossBlocks | None = None, partners: PartnerFields | None = None) -> tuple:
    """Positional arguments of ``PrepareKernel.__call__`` for these torch tensors.

    ``tensor(t, assumed_align)`` converts each tensor: :func:`~._cache.launch_tensor` (the default)
    for a call of the compiled function, :func:`~._cache.to_cute_tensor` for the compile. ``cross``: the pair K1's
    cross blocks; ``partners``: its partner fields.
    """
    if A_log is not None and (A_log.dim() != 1 or dt_bias.dim() != g.dim() - 2):  # None: gate "none"
        heads, dim = beta.shape[2], q.shape[3]  # value heads; a per-head gate's dt_bias is [HV]
        A_log, dt_bias = A_log.view(heads), dt_bias.view(heads, dim) if g.dim() == 4 else dt_bias.view(heads)
    scalars = fp32_scalars(scale, lower_bound)
    if tensor is launch_tensor:  # every call: the tensors as they are, the workspace's as kept
        inputs = _prepare_inputs()(q, k, g, beta, A_log, dt_bias)
        return (inputs, _workspace_tiles(ws, launch_tensor, cross, partners), *scalars, seq_len, cu_seqlens, tile_base,
                stream)
    inputs = _prepare_inputs()(  # [B, T, ...] as given: the kernel folds B·T (layouts.fwd_prepare.compact)
        q=tensor(q, 16), k=tensor(k, 16), g=tensor(g, 16), beta=tensor(beta, 2),
        a_log=None if A_log is None else tensor(A_log, 4), dt_bias=None if dt_bias is None else tensor(dt_bias, 4),
    )
    return (inputs, _workspace_tiles(ws, tensor, cross, partners), *scalars, seq_len, tensor(cu_seqlens, 8),
            tensor(tile_base, 4), stream)


@functools.cache
def _prepare_inputs() -> type:
    """``PrepareInputs``, imported on first use (its module brings in the DSL)."""
    from ..kernels.fwd_prepare import PrepareInputs

    return PrepareInputs


@functools.lru_cache(maxsize=256)  # a call's host path: one look-up instead of two struct round trips
def fp32_scalars(scale: float, lower_bound: float) -> tuple[float, float]:
    """K1's ``(scale, c_gate)`` rounded to fp32 (docs/numerics.md)."""
    return f32(scale), gate_constant(lower_bound)


def workspace_arguments(ws: Workspace, cross: CrossBlocks | None = None) -> Any:
    """K1's workspace argument for repeated launches on ``ws`` (and the pair variant's ``cross`` blocks), built once
    by the caller that keeps it: its ``WorkspaceTiles`` as one TVM-FFI array of FFI tensors (a tuple of torch tensors
    is converted anew on every call, about 1 µs of host time for these seven)."""
    import tvm_ffi

    return tvm_ffi.convert(_workspace_tiles(ws, launch_tensor, cross))


def launch(compiled, q, k, g, beta, A_log, dt_bias, tiles: Any, scalars: tuple[float, float], seq_len: int,
           cu_seqlens, tile_base, stream) -> None:
    """Call the compiled K1 ``compiled`` on validated tensors (A_log, dt_bias in the kernel's shapes), the
    :func:`workspace_arguments` ``tiles`` and the :func:`fp32_scalars` ``scalars``: the API's launch."""
    inputs = tuple.__new__(_prepare_inputs(), (q, k, g, beta, A_log, dt_bias))  # without NamedTuple's __new__
    compiled(inputs, tiles, *scalars, seq_len, cu_seqlens, tile_base, stream)


def _workspace_tiles(ws: Workspace, tensor, cross: CrossBlocks | None = None,
                     partners: PartnerFields | None = None) -> tuple:
    """``WorkspaceTiles`` of ``ws`` (the ``[rows, 16, D]`` fields seen as ``[rows·16, 1, D]``), of the pair K1's
    ``cross`` blocks and of its ``partners`` fields."""
    from ..kernels.fwd_prepare import WorkspaceTiles

    dim = ws.qd.shape[-1]
    tile_rows = ws.qd.shape[0] * CHUNK

    def rows(t):  # a [rows, 16, D] field as [rows·16, 1, D]
        return tensor(t.view(tile_rows, 1, dim), 16)

    return WorkspaceTiles(
        qd=rows(ws.qd), kd=rows(ws.kd), kr=rows(ws.kr), gt=tensor(ws.gt, 16), inv=tensor(ws.inv, 16),
        mqk=tensor(ws.mqk, 16), beta=tensor(ws.beta, 16),
        cross_kd=None if cross is None else tensor(cross.cross_kd, 16),
        cross_qd=None if cross is None else tensor(cross.cross_qd, 16),
        **({} if partners is None else dict(partner_qd=rows(partners.qd), partner_kd=rows(partners.kd),
                                           partner_kr=rows(partners.kr), partner_gt=tensor(partners.gt, 16))),
    )


def _compile_arguments(variant: PrepareVariant) -> tuple:
    """:func:`launch_arguments` of a K1 variant for the compile: ``meta`` tensors, a fake stream (two value
    heads to one q/k head when ``grouped``)."""
    heads = 2 if variant.grouped else 1
    q = torch.empty((1, CHUNK, 1, variant.dim), dtype=variant.dtype, device=_META)
    per_channel = () if variant.per_head_gate else (variant.dim,)
    g = torch.empty((1, CHUNK, heads, *per_channel), dtype=variant.g_dtype, device=_META)
    beta = torch.empty((1, CHUNK, heads), dtype=torch.bfloat16, device=_META)
    spec = WorkspaceSpec(heads=heads, tiles=2, dim=variant.dim)
    ws = allocate_workspace(spec, _META)
    cross = allocate_cross_blocks(spec, _META) if variant.pairs else None
    partners = allocate_partner_fields(spec, _META) if variant.partner_fields else None
    cu_seqlens = torch.empty(2, dtype=torch.int64, device=_META) if variant.varlen else None
    tile_base = torch.empty(2, dtype=torch.int32, device=_META) if variant.varlen else None
    constants = variant.gate != "none"
    A_log = torch.empty(heads, dtype=torch.float32, device=_META) if constants else None
    dt_bias = torch.empty((heads, *per_channel), dtype=torch.float32, device=_META) if constants else None
    return launch_arguments(q, q, g, beta, A_log, dt_bias, ws, 1.0, -1.0, CHUNK, cu_seqlens, tile_base,
                            fake_stream(), tensor=to_cute_tensor, cross=cross, partners=partners)


def compiled_variant(variant: PrepareVariant, index: int):
    """The compiled K1 ``variant`` on device ``index``, compiled (from fake tensors) on first use."""

    def build():
        from ..kernels.fwd_prepare import prepare_kernel

        kernel = prepare_kernel(varlen=variant.varlen, qk_l2norm=variant.qk_l2norm, beta_logits=variant.beta_logits,
                                gate=variant.gate, dtype=dsl_type(variant.dtype), gate_dtype=dsl_type(variant.g_dtype),
                                per_head_gate=variant.per_head_gate, grouped=variant.grouped, dim=variant.dim,
                                pairs=variant.pairs)
        return compile_for_launch(kernel, *_compile_arguments(variant))

    return _PREPARE.get((variant, index), build)


def prepare(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None, ws: Workspace, *, scale: float, lower_bound: float,
    cu_seqlens: torch.Tensor | None = None, tile_base: torch.Tensor | None = None, qk_l2norm: bool = True,
    beta_logits: bool = True, gate: str = "safe", stream=None, cross: CrossBlocks | None = None,
    partners: PartnerFields | None = None,
) -> None:
    """Run K1: fill ``ws`` (``tiles_per_head(B·T, N, varlen)`` slots per head) from the raw inputs; with ``cross``
    (:class:`~cute_kda.workspace.CrossBlocks` of ``ws``'s spec; the safe gate or a per-head gate) the pair workspace
    of the two-tile serial step (``cute_kda.workspace``), a CTA a pair of tiles; with ``partners``
    (:class:`~cute_kda.workspace.PartnerFields` of ``ws``'s fields' shapes; with ``cross``, a per-head gate) that pair
    variant also writes the fields of each pair's other tile that the backward's rebuild reads.

    q, k: bf16 or fp16 ``[B, T, H, D]`` (D in :data:`~cute_kda.numerics.NATIVE_HEAD_DIMS`, the workspace's); g
    ``[B, T, HV, D]`` (or ``[B, T, HV]``, a per-head gate, with the
    unbounded gates): the raw gate in q's dtype (``gate`` "safe" or "softplus"), or the log decay, q's dtype or fp32
    (``gate="none"``);
    beta: bf16 ``[B, T, HV]`` (logits if ``beta_logits``); A_log fp32 ``[HV]``; dt_bias fp32 ``[HV, D]``
    (``[HV]`` per head; both None with gate "none"); HV a multiple of H (grouped value heads; the workspace
    has HV heads); ``cu_seqlens`` int64 ``[N+1]`` (then ``B == 1``) with
    ``tile_base = tile_bases(cu_seqlens)`` (computed here when omitted). Slots without a tile are
    left untouched. Launches on ``stream`` (a ``CUstream``; default torch's current stream on q's
    device); returns without synchronising.
    """
    batch, steps, heads, _ = q.shape
    if partners is not None:
        _check_partners(partners, ws, cross, g)
    if ws.gt.shape[0] == 0 or batch * steps == 0:
        return
    device = q.device
    if stream is None:
        stream = current_stream(device)
    if cu_seqlens is not None and tile_base is None:
        tile_base = tile_bases(cu_seqlens, stream=stream)
    variant = PrepareVariant(cu_seqlens is not None, bool(qk_l2norm), bool(beta_logits), gate, g.dtype, g.dim() == 3,
                             beta.shape[2] != q.shape[2], q.dtype, q.shape[3], cross is not None,
                             partners is not None)
    compiled = compiled_variant(variant, device_index(device))
    with on_device(device):
        compiled(*launch_arguments(q, k, g, beta, A_log, dt_bias, ws, scale, lower_bound, steps, cu_seqlens, tile_base,
                               stream, cross=cross, partners=partners))


def _check_partners(partners: PartnerFields, ws: Workspace, cross: CrossBlocks | None, g: torch.Tensor) -> None:
    """``partners`` go with the per-head gate's pair variant and have ``ws``'s fields' dtypes, shapes and device."""
    if cross is None or g.dim() != 3:
        raise ValueError("partners: only the per-head gate's pair K1 (g [B, T, HV] and cross blocks) writes them")
    for name in PartnerFields._fields:
        own = getattr(ws, name)
        validation.check_buffer(f"partners.{name}", getattr(partners, name), (own.dtype,), own.shape, own.device)


def compile_variant(variant: PrepareVariant, device: torch.device | str) -> None:
    """Compile (or load from the disk cache) the K1 ``variant`` for ``device`` ahead of time, and for a varlen one
    the tile prefix kernel too; nothing is allocated or launched."""
    index = device_index(torch.device(device))
    compiled_variant(variant, index)
    if variant.varlen:
        _TILE_PREFIX.get((index,), _compile_tile_prefix)
