"""The K1 → K2 workspace: what K1 writes per (head, 16-token tile) and K2 reads back.

One definition shared by the kernels, the mirror reference and the API layer.

Tile numbering. Sequence ``s`` of length ``l_s`` has ``ceil(l_s / 16)`` tiles; tile ``t`` of it has
the *global tile index* ``tile_base[s] + t`` where ``tile_base[s] = sum_{j<s} ceil(l_j / 16)``.
Workspace row of (head ``h``, global tile ``g``) is ``h * tiles + g``: all tiles of one head are
contiguous, in sequence order, so K2 streams them front to back.

``tiles`` is the number of tile slots per head. For fixed-length batches it is exact,
``B * ceil(T / 16)``. For varlen input it is the bound ``T_total // 16 + N`` (each sequence adds at
most one partial tile), known on the host without reading ``cu_seqlens``; slots past the real tile
count are never written.

Fields (all C-contiguous, rows as above):

========  =====================  =======  ============================================
field     shape                  dtype    meaning (docs/numerics.md)
========  =====================  =======  ============================================
qd        [H*tiles, 16, D]       bf16     q̂ ⊙ 2^G · scale
kd        [H*tiles, 16, D]       bf16     k̂ ⊙ 2^G
kr        [H*tiles, 16, D]       bf16     k̂ ⊙ 2^(G_last − G)
gt        [H*tiles, D]           fp32     2^G_last
inv       [H*tiles, 16, 16]      bf16     (I + L)^-1
mqk       [H*tiles, 16, 16]      bf16     tril(qd · kinvᵀ), diagonal kept
beta      [H*tiles, 16]          fp32     β (activated), 0 on rows past the sequence end
========  =====================  =======  ============================================

Per tile-head this is 3·4096 + 512 + 2·512 + 64 = 13 888 bytes.

The pair workspace of the two-tile serial step (docs/numerics.md, "Two tiles a serial step"; built by K1's pair
variants, ``cute_kda.kernels.fwd_prepare.PAIR_SCHEMES``): tiles pair up from each sequence's first tile; the
fields above hold tile b's qd, kd measured from the pair's start, tile a's kr to the pair's end and tile a's gt the
pair's decay, and :class:`CrossBlocks` adds two bf16 ``[H*tiles, 16, 16]`` blocks in tile b's slot (1 KB a pair).
The training form's backward also needs those four fields tile-relative where the pair changed them
(:class:`PartnerFields`, which the per-head gate's pair K1 can write beside the pair workspace).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    import torch

from .numerics import CHUNK, IMAGE_RUN

_ALIGN = 128  # every field starts on a 128-byte boundary (TMA needs 16, we keep 128)
_ITEMSIZE = {"bfloat16": 2, "float32": 4}


def tiles_per_head(total_tokens: int, num_seqs: int, varlen: bool) -> int:
    """Number of workspace tile slots per head (exact for fixed length, a bound for varlen)."""
    if varlen:
        return total_tokens // CHUNK + num_seqs
    seq_len = total_tokens // num_seqs if num_seqs else 0
    return num_seqs * ((seq_len + CHUNK - 1) // CHUNK)


# Tiles per block of the training forward's state checkpoints and the backward scan's state-gradient
# snapshots. 1: the tile-gradient kernel (Kernel B) reads the state entering each tile and the
# gradient leaving it. The scan kernels also build blocks of 4 (64 tokens, a quarter of the bytes).
SNAPSHOT_TILES = 1


def tile_bases_of(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 ``[N+1]``: ``tile_base[s] = Σ_{j<s} ceil(len_j / 16)`` (the tile numbering above) from int ``[N+1]``
    ``cu_seqlens``, on its device; the launchers' tile-prefix kernel computes the same on the GPU."""
    import torch

    counts = ((cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64) + CHUNK - 1) // CHUNK
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


def snapshot_slots(tiles: int, num_seqs: int, every: int = SNAPSHOT_TILES) -> int:
    """Snapshot slots per head for ``tiles`` workspace tile slots per head and ``num_seqs`` sequences.

    The backward scan keeps the gradient w.r.t. the state after global tile ``g`` of sequence ``s``
    when ``g`` ends a block of ``every`` global tiles (``g % every == every − 1``) or ends its
    sequence, in slot ``g // every + s`` (``s`` keeps two sequences that share a block apart).
    Those slots are distinct and below ``tiles // every + num_seqs``.
    """
    return tiles // every + num_seqs


def pair_block_slots(tiles: int, num_seqs: int) -> int:
    """Slots per head of the two-tile step's training form (a checkpoint, a snapshot and tile a's ``U`` a pair): the
    pair whose tile a is global tile ``g`` of sequence ``s`` (a lone last tile counts as a pair) keeps slot
    ``(g + s) // 2``. Those slots are distinct and below ``(tiles + num_seqs) // 2``, as the pairs of a sequence start
    on its first tile."""
    return (tiles + num_seqs) // 2


def pair_blocks_shape(ws: "Workspace", heads: int, num_seqs: int) -> tuple[int, int, int]:
    """``[H · slots, D, D]``: the state images kept a pair (:func:`pair_block_slots`) for the workspace ``ws``."""
    tiles, _, dim = ws.qd.shape
    return (heads * pair_block_slots(tiles // heads, num_seqs), dim, dim)


def pair_u_shape(ws: "Workspace", heads: int, num_seqs: int) -> tuple[int, int, int]:
    """``[H · slots, D, 16]``: tile a's ``U`` kept a pair, value-major (``Uᵀ``, as K2's state update reads it)."""
    rows, chunk, dim = ws.qd.shape
    return (heads * pair_block_slots(rows // heads, num_seqs), dim, chunk)


def kept_tiles(tile_bases: Sequence[int], every: int = SNAPSHOT_TILES) -> list[tuple[int, int]]:
    """``(s, g)`` for each global tile ``g`` of sequence ``s`` whose state (gradient) is kept: ``g`` ends a block of
    ``every`` global tiles or ends its sequence (:func:`snapshot_slots`: slot ``g // every + s``). ``tile_bases``:
    ``[N+1]`` global tile numbers where each sequence starts (:func:`tile_bases_of`), as plain ints."""
    return [(s, g) for s in range(len(tile_bases) - 1) for g in range(tile_bases[s], tile_bases[s + 1])
            if g % every == every - 1 or g == tile_bases[s + 1] - 1]


def states_to_images(states: torch.Tensor) -> torch.Tensor:
    """``[..., K, V]`` matrices → their state images (the kept checkpoints' and snapshots' element order,
    :func:`cute_kda.layouts.fwd_recurrence.state_image`), the same shape: flat element
    ``(D / 8 · V) · (k // 8) + 8 · v + k % 8`` of each image is ``[k, v]``."""
    dim = states.shape[-1]
    images = states.unflatten(-2, (dim // IMAGE_RUN, IMAGE_RUN)).transpose(-1, -2)
    return images.reshape(states.shape)


def images_to_states(images: torch.Tensor) -> torch.Tensor:
    """State images (:func:`states_to_images`) → ``[..., K, V]`` matrices."""
    dim = images.shape[-1]
    return images.reshape(*images.shape[:-2], dim // IMAGE_RUN, dim, IMAGE_RUN).transpose(-1, -2).reshape(images.shape)


def block_states_shape(ws: "Workspace", heads: int, num_seqs: int, every: int = SNAPSHOT_TILES) -> tuple[int, int, int]:
    """``[H · slots, D, D]``: one matrix per slot of :func:`snapshot_slots` — the shape of the training
    forward's state checkpoints and of the backward scan's state-gradient snapshots, each a state image
    (:func:`states_to_images`; :func:`images_to_states` gives the ``[K, V]`` matrices)."""
    rows, _, dim = ws.qd.shape
    return (heads * snapshot_slots(rows // heads, num_seqs, every), dim, dim)


class WorkspaceSpec(NamedTuple):
    """Shapes and dtypes of the workspace for ``heads`` heads and ``tiles`` slots per head (built on
    every call: a NamedTuple)."""

    heads: int
    tiles: int
    dim: int = 128
    pairs: bool = False  # the buffer also holds the pair workspace's cross blocks (:func:`cross_block_views`)

    @property
    def rows(self) -> int:
        return self.heads * self.tiles

    def fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Field name → (shape, dtype name), in storage order."""
        r, d = self.rows, self.dim
        return {
            "qd": ((r, CHUNK, d), "bfloat16"),
            "kd": ((r, CHUNK, d), "bfloat16"),
            "kr": ((r, CHUNK, d), "bfloat16"),
            "gt": ((r, d), "float32"),
            "inv": ((r, CHUNK, CHUNK), "bfloat16"),
            "mqk": ((r, CHUNK, CHUNK), "bfloat16"),
            "beta": ((r, CHUNK), "float32"),
        }

    def layout(self) -> dict[str, tuple[int, tuple[int, ...], str]]:
        """Field name → (byte offset, shape, dtype name) inside one flat byte buffer."""
        out, offset = {}, 0
        for name, (shape, dtype) in self.fields().items():
            out[name] = (offset, shape, dtype)
            offset += _padded_nbytes(shape, dtype)
        return out

    @property
    def fields_nbytes(self) -> int:
        """Bytes of the fields (:meth:`layout`), where the cross blocks of a ``pairs`` spec start."""
        return sum(_padded_nbytes(shape, dtype) for shape, dtype in self.fields().values())

    @property
    def nbytes(self) -> int:
        cross = 2 * _padded_nbytes((self.rows, CHUNK, CHUNK), "bfloat16") if self.pairs else 0
        return self.fields_nbytes + cross


def _padded_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    nbytes = _ITEMSIZE[dtype]
    for n in shape:
        nbytes *= n
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class Workspace(NamedTuple):
    """Torch views of the workspace fields (see the module docstring for shapes)."""

    qd: "torch.Tensor"
    kd: "torch.Tensor"
    kr: "torch.Tensor"
    gt: "torch.Tensor"
    inv: "torch.Tensor"
    mqk: "torch.Tensor"
    beta: "torch.Tensor"


class CrossBlocks(NamedTuple):
    """The pair workspace's cross blocks, bf16 ``[H*tiles, 16, 16]`` each, written in tile b's slot of each pair
    (the module docstring): entry ``[i, j]`` couples row j of tile a to row i of tile b."""

    cross_kd: "torch.Tensor"  # P = kd_b'·kinv_aᵀ
    cross_qd: "torch.Tensor"  # Q = qd_b'·kinv_aᵀ


class PartnerFields(NamedTuple):
    """The tile-relative fields of each pair's other tile, which Kernel B's rebuild reads in the two-tile training form
    (``GradsVariant.pair_rebuild``), written by the per-head gate's pair K1 beside the pair workspace: tile b's qd and
    kd in tile b's slot, tile a's kr in tile a's slot, each tile's gT in its own slot, shaped as :class:`Workspace`'s
    fields, the values today's K1 writes there (the pair workspace changes exactly these). Other slots: unwritten."""

    qd: "torch.Tensor"  # bf16 [H*tiles, 16, D]
    kd: "torch.Tensor"  # bf16 [H*tiles, 16, D]
    kr: "torch.Tensor"  # bf16 [H*tiles, 16, D]
    gt: "torch.Tensor"  # fp32 [H*tiles, D]


def allocate_partner_fields(spec: WorkspaceSpec, device: "torch.device | str") -> PartnerFields:
    """Fresh (uninitialised) :class:`PartnerFields` for the workspace of ``spec`` on ``device``."""
    import torch

    fields = spec.fields()
    return PartnerFields(*(torch.empty(fields[name][0], dtype=getattr(torch, fields[name][1]), device=device)
                           for name in PartnerFields._fields))


def allocate_cross_blocks(spec: WorkspaceSpec, device: "torch.device | str") -> CrossBlocks:
    """Fresh (uninitialised) cross blocks for the workspace of ``spec`` on ``device``."""
    import torch

    return CrossBlocks(*(torch.empty(spec.rows, CHUNK, CHUNK, dtype=torch.bfloat16, device=device) for _ in range(2)))


def cross_block_views(spec: WorkspaceSpec, buffer: "torch.Tensor") -> CrossBlocks:
    """The cross blocks of a ``pairs`` spec, carved out of ``buffer`` (:func:`workspace_views`'s) after the fields."""
    import torch

    if not spec.pairs or buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < spec.nbytes:
        raise ValueError(f"cross blocks need a pairs spec and a 1-D uint8 buffer of >= {spec.nbytes} bytes")
    block = _padded_nbytes((spec.rows, CHUNK, CHUNK), "bfloat16")
    start = spec.fields_nbytes
    elements = spec.rows * CHUNK * CHUNK
    return CrossBlocks(*(buffer[start + i * block:start + (i + 1) * block].view(torch.bfloat16)[:elements]
                         .view(spec.rows, CHUNK, CHUNK) for i in range(2)))


def workspace_views(spec: WorkspaceSpec, buffer: "torch.Tensor") -> Workspace:
    """Carve the field views out of a flat uint8 ``buffer`` of at least ``spec.nbytes`` bytes."""
    import torch

    nbytes = _nbytes(spec)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < nbytes:
        raise ValueError(f"workspace buffer must be 1-D uint8 with >= {nbytes} bytes")
    # one typed view per dtype, then one as_strided a field: on the host path of every training call
    typed = {dtype: buffer[:nbytes].view(dtype) for dtype in (torch.bfloat16, torch.float32)}
    return Workspace(*(typed[dtype].as_strided(shape, strides, offset)
                       for dtype, shape, strides, offset in _view_plan(spec)))


@functools.lru_cache(maxsize=64)
def _nbytes(spec: WorkspaceSpec) -> int:
    return spec.nbytes


@functools.lru_cache(maxsize=64)
def _view_plan(spec: WorkspaceSpec) -> tuple:
    """Per field in :class:`Workspace` order: (torch dtype, shape, C-contiguous strides, offset in elements)."""
    import torch

    plan = []
    for offset, shape, dtype in spec.layout().values():
        strides, stride = [], 1
        for n in reversed(shape):
            strides.insert(0, stride)
            stride *= n
        plan.append((getattr(torch, dtype), shape, tuple(strides), offset // _ITEMSIZE[dtype]))
    return tuple(plan)


def allocate_workspace(spec: WorkspaceSpec, device: "torch.device | str") -> Workspace:
    """Allocate a fresh workspace (uninitialised) on ``device``."""
    import torch

    return workspace_views(spec, torch.empty(spec.nbytes, dtype=torch.uint8, device=device))
