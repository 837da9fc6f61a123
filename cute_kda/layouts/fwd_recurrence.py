"""Shared-memory plan and layouts of K2, the forward chunk recurrence (``cute_kda.kernels.fwd_recurrence``).

A K2 CTA owns one (sequence, head, V-band): ``v_band = D / vsplit`` value columns of the state
``S[v, k]`` (``v`` in the band, all ``k``). Its shared memory, in this order:

- ``state``: bf16 ``[v_band, D]``, the transpose-dual pair of :mod:`.smem` (``[V, K]`` with K_INTER
  atoms for the B operand of ``kd·S`` / ``qd·S``; ``[K, V]`` with MN_INTER atoms, the same bytes, for
  the accumulator-side update). Lives for the whole kernel.
- ``union``: either the pipeline buffers (``input_stages`` input stages of v, kd, qd, kr, gT, INV, Mqk,
  β and ``output_stages`` output tiles) or the fp32 state staging buffer ``[v_band, D]`` used only
  before and after the tile loop (fp32 state I/O is converted in shared memory).
- ``barriers``: mbarriers of the input pipeline (full + empty per stage), the output pipeline
  (full + empty per stage) and one transaction barrier for the initial-state load.

Inside ``union`` every field is an array of stage slots, each slot 128-byte aligned (TMA's
shared-memory alignment). :class:`RecurrenceSmemPlan` computes all byte sizes and offsets on
the host (plain Python, no trace needed); the layout functions below build the CuTe layouts inside a
trace from the constructors of :mod:`.smem`, so the kernel, the tests and exploration scripts see
the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..dsl import cute
from ..numerics import IMAGE_RUN, SUPPORTED_VSPLITS
from .smem import (CHUNK, HEAD_DIM, SW128_PERIOD_BYTES, SWIZZLE_PERIOD_BYTES, AtomKind, atom_tile, atom_tile_transposed,
                   operand_tile, row_atom, state_acc_view, state_b_view)

MMA_WARPS = 4  # compute warps; warp w owns value columns [w·v_band/4, (w+1)·v_band/4) of the CTA's band
MIN_WARP_COLS = 8  # one n=8 mma atom: a narrower band runs on fewer compute warps
INPUT_STAGES = 3
OUTPUT_STAGES = 2
ALIGN = 128  # byte alignment of every buffer (TMA needs 16; 128 keeps ldmatrix rows in one bank sweep)
# kd, qd, kr: K_SW128 tiles, and the per-token band tiles in the widest swizzle their rows fit
# (:func:`token_atom`), so the TMA moves them in rows of up to 128 bytes (a K_INTER box moves 16-byte
# rows, and with several CTAs an SM the TMA's time goes by rows: perf-log v6). Each slot sits on its
# swizzle's period, and the state and the union that hold them on the largest one.
SWIZZLED_FIELDS = ("kd", "qd", "kr")
SWIZZLED_ALIGN = SW128_PERIOD_BYTES
CROSS_FIELDS = ("cross_kd", "cross_qd")  # a pair plan's cross blocks P, Q (16 × 16, K_INTER like INV and Mqk)
MBARRIER_BYTES = 8

_BF16 = 2
_FP32 = 4


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class RecurrenceSmemPlan:
    """Byte sizes and offsets of K2's shared memory for one variant (host side, no trace).

    Storage, in order (the kernel's ``cute.struct``): ``state`` (bf16 ``[v_band, D]``), ``union``
    (pipeline buffers, or the fp32 staging when ``state_io_fp32``), mbarriers (input full/empty,
    output full/empty, initial-state transaction). Pipeline fields, per stage, at ``v_band = D / vsplit``:

    ========  ======================  =====================================
    field     tile                    meaning
    ========  ======================  =====================================
    v         bf16 [16, v_band]       values of the CTA's band (TMA load; :func:`token_atom`)
    kd        bf16 [16, D]            workspace kd (K_SW128 operand tile)
    qd        bf16 [16, D]            workspace qd (K_SW128)
    kr        bf16 [16, D]            workspace kr (K_SW128; K2 reads its [D, 16] MN_SW128 view)
    gt        fp32 [D]                workspace gT
    inv       bf16 [16, 16]           workspace INV
    mqk       bf16 [16, 16]           workspace Mqk
    beta      fp32 [16]               workspace β
    out       bf16 [16, v_band]       output tile (output stages; TMA store or tail store; :func:`token_atom`)
    ========  ======================  =====================================

    ``pairs`` (the two-tile serial step, :class:`cute_kda.kernels.fwd_recurrence_pairs.PairRecurrence`): each input
    stage also holds the cross blocks ``cross_kd``, ``cross_qd`` (bf16 [16, 16] each, K_INTER; read in tile b's
    stages, loaded in every stage).

    ``token_outputs`` False (a K2 pass run for its states alone: under ``STATES_ONLY_PASSES`` the backward's
    recomputation and a segmented call's passes for the segment states): no output tiles, and the input stages drop
    :attr:`output_operands`, the fields only the outputs read (qd and Mqk: ``o = qd·S + Mqk·U``; a pair plan's Q
    too: ``o_b = qd_b'·S + Q·U_a + Mqk_b·U_b``). The output
    pipeline's barriers stay.

    Each field is an array of stage slots (stage ``s`` at ``offset + s · slot``), each aligned to 128 bytes
    or, for a swizzled tile, to its swizzle period (:meth:`field_align`).
    The class attributes name the per-token input field and the output fields, so a kernel with the
    same skeleton and other tensors (the backward scan, :mod:`.bwd_scan`) reuses the plan.
    """

    kernel_name: ClassVar[str] = "K2"
    supported_vsplits: ClassVar[tuple[int, ...]] = SUPPORTED_VSPLITS
    token_field: ClassVar[str] = "v"  # the per-token input tile of the CTA's band
    output_fields: ClassVar[tuple[str, ...]] = ("out",)  # per-token output tiles of an output stage
    output_operands: ClassVar[tuple[str, ...]] = ("qd", "mqk", "cross_qd")  # input fields only the outputs read
    # the per-token and output tiles in the swizzle of :func:`token_atom` (else K_INTER, moved as
    # :func:`tma_box` boxes of 16-byte rows)
    swizzled_tokens: ClassVar[bool] = True

    vsplit: int = 1
    state_io_fp32: bool = False  # a state is fp32 (or fp16): the union holds the (fp32-sized) staging
    dim: int = HEAD_DIM
    chunk: int = CHUNK
    input_stages: int = INPUT_STAGES
    output_stages: int = OUTPUT_STAGES
    compute_warps: int | None = None  # None: MMA_WARPS, fewer for a band under 4 · 8 columns
    pairs: bool = False  # the input stages also hold the pair workspace's cross blocks
    token_outputs: bool = True  # False: no output tiles, no output operands (the class docstring)

    def __post_init__(self) -> None:
        if self.vsplit not in self.supported_vsplits:
            raise ValueError(f"vsplit must be one of {self.supported_vsplits}, got {self.vsplit}")
        if self.compute_warps is not None and (self.v_band % self.compute_warps
                                               or (self.v_band // self.compute_warps) % MIN_WARP_COLS):
            raise ValueError(f"{self.compute_warps} compute warps cannot split {self.v_band} value columns "
                             f"into multiples of {MIN_WARP_COLS}")

    @property
    def v_band(self) -> int:
        """Value columns per CTA."""
        return self.dim // self.vsplit

    @property
    def mma_warps(self) -> int:
        """Compute warps: ``compute_warps``, else 4, or fewer when the band has fewer than 4 · 8 columns."""
        if self.compute_warps is not None:
            return self.compute_warps
        return min(MMA_WARPS, self.v_band // MIN_WARP_COLS)

    @property
    def warp_cols(self) -> int:
        """Value columns per compute warp (32, 16 or 8)."""
        return self.v_band // self.mma_warps

    def input_field_bytes(self) -> dict[str, int]:
        """Input field → bytes of one stage (also the bytes its TMA copy delivers)."""
        c, d, vb = self.chunk, self.dim, self.v_band
        fields = {
            self.token_field: c * vb * _BF16,
            "kd": c * d * _BF16,
            "qd": c * d * _BF16,
            "kr": c * d * _BF16,
            "gt": d * _FP32,
            "inv": c * c * _BF16,
            "mqk": c * c * _BF16,
            "beta": c * _FP32,
        }
        if self.pairs:
            fields.update({name: c * c * _BF16 for name in CROSS_FIELDS})
        if not self.token_outputs:
            fields = {name: nbytes for name, nbytes in fields.items() if name not in self.output_operands}
        return fields

    @property
    def outputs(self) -> tuple[str, ...]:
        """The output tiles of an output stage: :attr:`output_fields`, none without ``token_outputs``."""
        return self.output_fields if self.token_outputs else ()

    @property
    def stage_tx_bytes(self) -> int:
        """Transaction bytes of one input stage (the input pipeline's ``tx_count``)."""
        return sum(self.input_field_bytes().values())

    @property
    def out_tile_bytes(self) -> int:
        return self.chunk * self.v_band * _BF16

    @property
    def state_bytes(self) -> int:
        """bf16 state band ``[v_band, D]`` (also the TMA transaction of a bf16 state load)."""
        return self.v_band * self.dim * _BF16

    @property
    def state_fp32_bytes(self) -> int:
        """fp32 staging of the state band (also the TMA transaction of an fp32 state load)."""
        return self.v_band * self.dim * _FP32

    def union_offsets(self) -> dict[str, int]:
        """Pipeline field → byte offset of its stage 0 inside the union (the fp32 staging sits at 0).

        A stage slot is the field's bytes rounded up to its alignment (:meth:`field_align`), so β's
        64 bytes take a 128-byte slot.
        """
        return self._union_layout()[0]

    def _union_layout(self) -> tuple[dict[str, int], int]:
        """(:meth:`union_offsets`, the end of the last field's slots)."""
        offsets, at = {}, 0
        fields = [(name, nbytes, self.input_stages) for name, nbytes in self.input_field_bytes().items()]
        fields += [(name, self.out_tile_bytes, self.output_stages) for name in self.outputs]
        for name, nbytes, stages in fields:
            align = self.field_align(name)
            at = _round_up(at, align)
            offsets[name] = at
            at += _round_up(nbytes, align) * stages
        return offsets, at

    def field_align(self, name: str) -> int:
        """Byte alignment of a pipeline field's stage slots: the swizzle period of a swizzled tile
        (kd, qd, kr; the per-token and output tiles), else 128."""
        if name in SWIZZLED_FIELDS:
            return SWIZZLED_ALIGN
        if self.swizzled_tokens and (name == self.token_field or name in self.output_fields):
            return SWIZZLE_PERIOD_BYTES[row_atom(self.v_band * _BF16)]
        return ALIGN

    @property
    def pipeline_bytes(self) -> int:
        return self._union_layout()[1]

    @property
    def union_bytes(self) -> int:
        """The larger of the pipeline buffers and the staging, rounded up to the union's alignment."""
        staging = self.state_fp32_bytes if self.state_io_fp32 else 0
        return _round_up(max(self.pipeline_bytes, staging), SWIZZLED_ALIGN)

    @property
    def barrier_count(self) -> int:
        """mbarriers: full + empty per input stage and per output stage, one for the state load."""
        return 2 * self.input_stages + 2 * self.output_stages + 1

    @property
    def total_bytes(self) -> int:
        """Shared memory per CTA: state, union, mbarriers (the struct padded to its alignment, the swizzle period)."""
        state = _round_up(self.state_bytes, SWIZZLED_ALIGN)
        return _round_up(state + self.union_bytes + self.barrier_count * MBARRIER_BYTES, SWIZZLED_ALIGN)


# ---------------------------------------------------------------------------------------------
# Shared-memory layouts (inside a trace). Operand layouts are K_INTER / MN_INTER from :mod:`.smem`;
# ``stages`` appends a stage mode of stride one tile.



def staged(tile, stages: int):
    """``tile`` with a trailing stage mode (stage stride = cosize of the tile)."""
    outer = tile.outer if isinstance(tile, cute.ComposedLayout) else tile
    staged = cute.make_layout((*outer.shape, stages), stride=(*outer.stride, cute.cosize(outer)))
    if isinstance(tile, cute.ComposedLayout):
        return cute.make_composed_layout(tile.inner, 0, staged)
    return staged


def state_b(plan: RecurrenceSmemPlan):
    """State band ``[v_band, D]`` (rows v, cols k): B operand of ``kd·S`` / ``qd·S``, K_INTER."""
    return state_b_view(plan.dim, vband=plan.v_band)


def state_acc(plan: RecurrenceSmemPlan):
    """State band ``[D, v_band]`` (rows k, cols v): accumulator view, MN_INTER, same bytes as :func:`state_b`."""
    return state_acc_view(plan.dim, vband=plan.v_band)


def state_image(dim: int = HEAD_DIM):
    """``[V, K]`` layout of a kept state matrix in global memory (the training forward's checkpoints, Kernel A's
    snapshots, both bf16): the bytes of a whole V-split-1 state buffer (:func:`state_b` with ``v_band = D``).
    Element ``[v, k]`` is at ``1024 · (k // 8) + 8 · v + k % 8`` (D = 128): a compute warp's rows of its band
    buffer are D / 8 contiguous runs there and in the image at every V-split, so 1-D bulk copies move them,
    and Kernel B loads a matrix into shared memory as one bulk copy. :func:`cute_kda.workspace.images_to_states`
    turns images into ``[K, V]`` matrices."""
    return state_b_view(dim)


def state_fp32(plan: RecurrenceSmemPlan):
    """fp32 staging ``[v_band, D]``: the element layout of :func:`state_b` with fp32 elements.

    32-byte rows, no swizzle (the buffer is touched once before and once after the tile loop), so
    ``[v, k]`` of the staging and of the bf16 state sit at the same element offset and the TMA box
    of both is :func:`tma_box` ``(v_band, D)``.
    """
    return state_b(plan).outer


def state_fp32_acc(plan: RecurrenceSmemPlan):
    """fp32 staging ``[D, v_band]`` (rows k, cols v): :func:`state_fp32` in the accumulator orientation,
    same bytes (K2's compute warps read and write their C-fragment elements of the staging through it)."""
    return cute.select(state_fp32(plan), mode=[1, 0])


def token_atom(plan: RecurrenceSmemPlan) -> AtomKind:
    """The atom of the per-token band tiles: K_SW128 for bands of 64 columns or more, K_SW64 for 32,
    K_SW32 for 16 (rows of ``2 · v_band`` bytes)."""
    return row_atom(plan.v_band * _BF16)


def value_tile(plan: RecurrenceSmemPlan, stages: int):
    """``[16, v_band(, stages)]``: per-token band tiles (v, out; Kernel A's dO, dv, du), :func:`token_atom`
    atoms when ``plan.swizzled_tokens`` (the swizzle acts on byte addresses), else K_INTER; ``stages`` 0:
    one unstaged tile (the TMA atom's box)."""
    if plan.swizzled_tokens:
        return atom_tile(token_atom(plan), plan.chunk, plan.v_band, stages=stages or None)
    tile = operand_tile(plan.chunk, plan.v_band)
    return staged(tile, stages) if stages else tile


def chunk_operand(plan: RecurrenceSmemPlan, stages: int | None = None):
    """``[16, D(, stages)]``: kd / qd / kr tiles (A operand of ``kd·S``, ``qd·S``), K_SW128 atoms.

    ``stages`` None: the input stages; 0: one unstaged tile (the TMA atom's box). The swizzle acts on
    byte addresses: the TMA's tensors take it on the pointer (:func:`cute_kda.kernels.common.copy.smem_tensor`),
    the compute warps' on element offsets (:func:`~cute_kda.kernels.common.copy.aligned_smem_tensor`).
    """
    stages = plan.input_stages if stages is None else stages
    return atom_tile(AtomKind.K_SW128, plan.chunk, plan.dim, stages=stages or None)


def chunk_operand_transposed(plan: RecurrenceSmemPlan):
    """``[D, 16, input_stages]``: MN_SW128 view of :func:`chunk_operand` (``krᵀ``, A operand of the update)."""
    return atom_tile_transposed(AtomKind.K_SW128, plan.chunk, plan.dim, stages=plan.input_stages)


def square_tile(plan: RecurrenceSmemPlan):
    """``[16, 16, input_stages]``: INV / Mqk tiles (A operand), K_INTER."""
    return staged(operand_tile(plan.chunk, plan.chunk), plan.input_stages)


def vector(n: int, stages: int):
    """``[n, stages]`` fp32 vectors (gT: n = D, β: n = 16), one 128-byte aligned slot per stage."""
    return cute.make_layout((n, stages), stride=(1, _round_up(n * _FP32) // _FP32))


def tma_box(rows: int, cols: int, stages: int | None = None):
    """``(IMAGE_RUN, rows, cols / IMAGE_RUN, stages)``: the bytes of ``operand_tile(rows, cols)`` in address order.

    A K_INTER tile stores 8-element runs of a row contiguously, the rows of one run-column one after
    the other, then the next run-column: as a TMA box that is ``(run, row, run-column)`` with the
    first mode innermost, so one ``cp.async.bulk.tensor`` moves a whole tile (the gmem side is the
    matching view of :func:`token_runs_view` / :func:`tile_runs_view` / :func:`state_runs_view`).
    ``tma_box(r, c)(i, j, l) == operand_tile(r, c)(j, IMAGE_RUN·l + i)``. ``stages``: a trailing stage mode.
    """
    shape, stride = (IMAGE_RUN, rows, cols // IMAGE_RUN), (1, IMAGE_RUN, IMAGE_RUN * rows)
    if stages is not None:
        shape, stride = (*shape, stages), (*stride, rows * cols)
    return cute.make_layout(shape, stride=stride)


# ---------------------------------------------------------------------------------------------
# Global-memory views for TMA (inside a trace; the last mode of every tensor has stride 1).


def token_runs_view(tensor: cute.Tensor) -> cute.Tensor:
    """``[B, T, H, D]`` → ``(IMAGE_RUN, T, D / IMAGE_RUN, H, B)``: token rows of one (head, batch) in :func:`tma_box` order
    (the K_INTER band tiles of a plan without ``swizzled_tokens``)."""
    batch, seq, heads, dim = tensor.shape
    s_batch, s_seq, s_heads, s_dim = tensor.layout.stride
    layout = cute.make_layout(
        (IMAGE_RUN, seq, dim // IMAGE_RUN, heads, batch), stride=(s_dim, s_seq, IMAGE_RUN * s_dim, s_heads, s_batch)
    )
    return cute.make_tensor(tensor.iterator, layout)


def token_band_view(tensor: cute.Tensor, run: int) -> cute.Tensor:
    """``[B, T, H, D]`` → ``(T, (run, D / run), H, B)``: token rows of one (head, batch), the columns split at
    the band tile's contiguous run (:func:`value_tile`), so a ``(16, v_band)`` TMA tile is one box of rows
    of ``min(run, v_band)`` elements."""
    batch, seq, heads, dim = tensor.shape
    s_batch, s_seq, s_heads, s_dim = tensor.layout.stride
    layout = cute.make_layout(
        (seq, (run, dim // run), heads, batch), stride=(s_seq, (s_dim, run * s_dim), s_heads, s_batch)
    )
    return cute.make_tensor(tensor.iterator, layout)


def tile_runs_view(tensor: cute.Tensor) -> cute.Tensor:
    """Workspace field ``[rows, 16, C]`` → ``(IMAGE_RUN, 16, C / IMAGE_RUN, rows)`` (qd/kd/kr: C = D; INV/Mqk: C = 16)."""
    rows, chunk, cols = tensor.shape
    s_rows, s_chunk, s_cols = tensor.layout.stride
    layout = cute.make_layout((IMAGE_RUN, chunk, cols // IMAGE_RUN, rows), stride=(s_cols, s_chunk, IMAGE_RUN * s_cols, s_rows))
    return cute.make_tensor(tensor.iterator, layout)


def tile_rows_view(tensor: cute.Tensor, run: int) -> cute.Tensor:
    """Workspace field ``[rows, 16, C]`` (C-contiguous) → ``(rows · 16, (run, C / run))``: token rows, the
    columns split at the smem tile's contiguous run (64 for K_SW128 bf16), so a ``(16, C)`` TMA tile is
    one box of ``C / run`` swizzled 128-byte rows per token row (:func:`chunk_operand`)."""
    rows, chunk, cols = tensor.shape
    _, s_chunk, s_cols = tensor.layout.stride
    layout = cute.make_layout((rows * chunk, (run, cols // run)), stride=(s_chunk, (s_cols, run * s_cols)))
    return cute.make_tensor(tensor.iterator, layout)


def vector_rows_view(tensor: cute.Tensor) -> cute.Tensor:
    """Workspace field ``[rows, n]`` → ``(n, rows)`` (gT, β)."""
    return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=[1, 0]))


def state_runs_view(tensor: cute.Tensor) -> cute.Tensor:
    """State ``[N, H, V, K]`` → ``(IMAGE_RUN, V, K / IMAGE_RUN, N, H)``: one (sequence, head) in :func:`tma_box` order."""
    seqs, heads, rows, cols = tensor.shape
    s_seqs, s_heads, s_rows, s_cols = tensor.layout.stride
    layout = cute.make_layout((IMAGE_RUN, rows, cols // IMAGE_RUN, seqs, heads), stride=(s_cols, s_rows, IMAGE_RUN * s_cols, s_seqs, s_heads))
    return cute.make_tensor(tensor.iterator, layout)
