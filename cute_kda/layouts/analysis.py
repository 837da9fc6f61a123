"""Host-side analysis of the shared-memory layouts (no GPU needed).

Three questions, each answered from the DSL's own objects:

(i)   Does a transpose-dual pair address the same byte for ``(i, j)`` and ``(j, i)``?
      :func:`check_transpose_dual`.
(ii)  How many shared-memory wavefronts does one ``ldmatrix`` / ``stmatrix`` take on a layout?
      :func:`instruction_wavefronts`, and :func:`bank_conflict_table` for the kernels' uses.
(iii) Bytes per stage and per CTA: :mod:`cute_kda.layouts.budget`.

Byte tables. A layout is evaluated once, inside a ``@cute.jit`` trace on the host, into a numpy
array of *byte addresses* relative to a buffer base (:func:`byte_table`, cached). A plain CuTe layout
is the sum of its modes' contributions, so only ``sum(mode sizes)`` coordinates are evaluated by the
DSL and the table is their outer sum. A swizzle ``S<B,M,S>`` of a ``ComposedLayout`` is applied to
the **byte** address: that is what TMA, wgmma descriptors and a tensor made with
``get_tensor(layout.outer, swizzle=layout.inner)`` do (checked in the sm_90a PTX: K_SW128 bf16 row 1
lands at byte 128 ^ 16). A ``ComposedLayout`` passed whole as a tensor layout swizzles *element*
offsets instead, which differs for 16/32-bit types whenever the swizzle is not the identity; kernels
must attach the swizzle to the pointer. For ``K_INTER`` / ``MN_INTER`` (identity swizzle) the two agree.

Bank model. 32 banks of 4 bytes. An ``ldmatrix`` / ``stmatrix`` ``.xN`` runs as N phases; in phase
``p`` lanes ``8p .. 8p+7`` each give the address of one 16-byte row of an 8×8 b16 matrix. The phase
takes ``max over banks of (distinct 4-byte words in that bank)`` wavefronts (equal words broadcast);
the ideal instruction takes N wavefronts. Which rows a lane addresses comes from the DSL's tiled
copies for one ``mma.sync m16n8k16`` warp tile of 16×16 (``make_tiled_copy_A/B/C`` of
``LdMatrix8x8x16bOp`` / ``StMatrix8x8x16bOp`` on ``MmaF16BF16Op`` with permutation (16,16,16)): the
smem-side thread-value layout (``layout_src_tv_tiled`` for ldmatrix, ``layout_dst_tv_tiled`` for
stmatrix) gives, for lane ``l`` and value ``8c + e``, the block coordinate of element ``e`` of the
row lane ``l`` addresses in atom call ``c``. The 16×16 block is indexed ``(m, k)`` for A, ``(n, k)``
for B and ``(m, n)`` for C. With ``.trans`` the eight elements of a lane run down mode 0 of the block,
so the layout being read is the *transposed view* (mode 0 contiguous). Concretely, for x4:

* A ``ldmatrix.x4``: lane l → row ``m = l % 16``, columns ``k = 8·(l // 16) .. +7``; the phases are the
  four 8×8 quarters (m0-7,k0-7), (m8-15,k0-7), (m0-7,k8-15), (m8-15,k8-15).
* B ``ldmatrix.x4`` (two n8 tiles): lane l → ``n = l % 8 + 8·(l // 16)``, ``k = 8·((l // 8) % 2) .. +7``.
* C ``stmatrix.x4`` / ``ldmatrix.x4``: lane l → ``m = l % 16``, ``n = 8·(l // 16) .. +7``.
* ``.trans`` variants: the same with the roles of the two block modes exchanged (lane l addresses
  eight consecutive ``m`` (A, C) or ``n`` (B) of one ``k`` (A, B) or ``n`` (C)).
* x2 / x1: the first 16 / 8 lanes, and two / four atom calls per 16×16 block.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ..dsl import cute, cutlass
from cutlass.cute.nvgpu import warp

from . import smem, tma

BANKS = 32
BANK_BYTES = 4
LDSM_ROW_BYTES = 16  # one ldmatrix/stmatrix lane address covers 8 b16 elements
MMA_BLOCK = 16  # the warp tile the access patterns are derived on (m16n8k16 with N permuted to 16)


# --------------------------------------------------------------------------------------------
# Layout specs and byte tables
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutSpec:
    """A layout constructor with its arguments, for elements of ``dtype``.

    ``build(*args, **kwargs)`` runs under a trace; ``dtype`` is forwarded as ``dtype=`` when
    ``build`` takes one. Specs are hashable, so evaluated tables are cached per spec.
    """

    name: str
    build: Callable[..., Any]
    args: tuple = ()
    dtype: type = cutlass.BFloat16
    kwargs: tuple = ()

    @property
    def width(self) -> int:
        """Element size in bytes."""
        return self.dtype.width // 8

    def make(self) -> Any:
        """Build the layout (inside a trace)."""
        kwargs = dict(self.kwargs)
        if "dtype" in inspect.signature(self.build).parameters:
            kwargs["dtype"] = self.dtype
        return self.build(*self.args, **kwargs)


def layout_spec(name: str, build: Callable[..., Any], *args: Any,
                dtype: type = cutlass.BFloat16, **kwargs: Any) -> LayoutSpec:
    """Shorthand for :class:`LayoutSpec` with keyword arguments."""
    return LayoutSpec(name, build, tuple(args), dtype, tuple(sorted(kwargs.items())))


@dataclass(frozen=True)
class EvaluatedLayout:
    """What one trace learns about a layout: printed form, sizes and the byte table."""

    text: str
    shape: tuple[int, ...]  # size of each top-level mode
    cosize: int  # elements (DSL cosize)
    swizzle: tuple[int, int, int]  # (bits, base, shift); (0, 4, 3) is the identity
    bytes: np.ndarray = field(repr=False)  # byte address of every coordinate, shape == shape


def apply_swizzle(addr: np.ndarray | int, bits: int, base: int, shift: int) -> np.ndarray | int:
    """CuTe ``Swizzle<bits, base, shift>`` on integer addresses: xor bits [base+shift, +bits) into [base, +bits)."""
    if bits == 0:
        return addr
    mask = ((1 << bits) - 1) << (base + max(0, shift))
    moved = addr & mask
    return addr ^ (moved >> shift if shift >= 0 else moved << -shift)


def swizzle_period_bytes(swizzle: tuple[int, int, int]) -> int:
    """Byte alignment a buffer needs so its swizzle pattern starts at the base (1 for none)."""
    bits, base, shift = swizzle
    return 1 << (bits + base + shift) if bits else 1


def run_traced(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` inside a host ``@cute.jit`` trace and return what it returned."""
    box: list[Any] = []

    @cute.jit
    def trace():
        box.append(fn())

    trace()
    return box[0]


def _split(layout: Any) -> tuple[tuple[int, int, int], Any, int]:
    """(swizzle (bits, base, shift), plain layout, offset) of a Layout or ComposedLayout."""
    if isinstance(layout, cute.ComposedLayout):
        sw = layout.inner
        return (sw.num_bits, sw.num_base, sw.num_shift), layout.outer, layout.offset
    return (0, 4, 3), layout, 0


def _mode_sizes(layout: Any) -> tuple[int, ...]:
    return tuple(cute.size(layout, mode=[m]) for m in range(cute.rank(layout)))


def _at(layout: Any, coord: tuple[int, ...]) -> int:
    return layout(coord) if len(coord) > 1 else layout(coord[0])


def evaluate_layout(layout: Any, width: int) -> EvaluatedLayout:
    """Evaluate ``layout`` with elements of ``width`` bytes (call inside a trace; see :func:`evaluate`).

    A plain layout is the sum of its top-level modes' contributions, so each mode is evaluated
    alone (the other coordinates 0) and the table is the outer sum.
    """
    swizzle, outer, offset = _split(layout)
    shape = _mode_sizes(outer)
    elems = np.full(shape, offset, dtype=np.int64)
    for m, n in enumerate(shape):
        along = [_at(outer, tuple(i if k == m else 0 for k in range(len(shape)))) for i in range(n)]
        elems = elems + np.asarray(along, dtype=np.int64).reshape([n if k == m else 1 for k in range(len(shape))])
    table = apply_swizzle(elems * width, *swizzle)
    return EvaluatedLayout(str(layout), shape, int(cute.cosize(layout)), swizzle, table)


@functools.lru_cache(maxsize=None)
def evaluate(spec: LayoutSpec) -> EvaluatedLayout:
    """Evaluate ``spec`` once (one host trace) and cache it; the table is read-only."""
    result = run_traced(lambda: evaluate_layout(spec.make(), spec.width))
    result.bytes.setflags(write=False)
    return result


def byte_table(spec: LayoutSpec) -> np.ndarray:
    """Byte address (from the buffer base) of every coordinate of ``spec``'s layout."""
    return evaluate(spec).bytes


def full_byte_table(spec: LayoutSpec) -> np.ndarray:
    """Like :func:`byte_table` but evaluating every coordinate through the DSL (slow; for tests)."""

    def run():
        swizzle, outer, offset = _split(spec.make())
        shape = _mode_sizes(outer)
        elems = np.empty(shape, dtype=np.int64)
        for coord in np.ndindex(*shape):
            elems[coord] = offset + _at(outer, tuple(int(c) for c in coord))
        return apply_swizzle(elems * spec.width, *swizzle)

    return run_traced(run)


# --------------------------------------------------------------------------------------------
# Layout families: ways to store a tile, compared in the bank-conflict table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutFamily:
    """A way to store a ``[rows, cols]`` tile: the tile layout and its ``[cols, rows]`` transposed view."""

    name: str
    tile: Callable[..., Any]
    transposed: Callable[..., Any]
    min_cols_bytes: int = 16  # the atom's contiguous run; narrower tiles cannot be built

    def fits(self, rows: int, cols: int, dtype: type) -> bool:
        return rows % 8 == 0 and (cols * dtype.width // 8) % self.min_cols_bytes == 0

    def spec(self, rows: int, cols: int, dtype: type, transposed: bool = False) -> LayoutSpec:
        build = self.transposed if transposed else self.tile
        view = "ᵀ" if transposed else ""
        return layout_spec(f"{self.name}[{rows},{cols}]{view}", build, rows, cols, dtype=dtype)


K_INTER_FAMILY = LayoutFamily("K_INTER", smem.operand_tile, smem.operand_tile_transposed)
ROW_MAJOR_FAMILY = LayoutFamily("row-major", smem.row_major_tile, smem.row_major_tile_transposed)
SW128_FAMILY = LayoutFamily("K_SW128", smem.sw128_tile, smem.sw128_tile_transposed, min_cols_bytes=128)
FAMILIES = (K_INTER_FAMILY, ROW_MAJOR_FAMILY, SW128_FAMILY)


# --------------------------------------------------------------------------------------------
# (i) transpose-dual check
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DualCheck:
    """Result of comparing ``a(c)`` with ``b(perm(c))`` byte for byte."""

    a: str
    b: str
    shape: tuple[int, ...]
    mismatches: int  # coordinates whose bytes differ (-1: shapes do not transpose)
    bijective: bool  # a maps its coordinates one-to-one onto [0, size) elements

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.bijective


def check_transpose_dual(a: LayoutSpec, b: LayoutSpec, perm: tuple[int, ...] = (1, 0)) -> DualCheck:
    """Check that ``a(i, j, ...)`` and ``b`` at the permuted coordinate are the same byte.

    ``perm`` says which mode of ``a`` each mode of ``b`` is: the default swaps the first two
    (``(1, 0, 2)`` for staged pairs).
    """
    ta, tb = byte_table(a), byte_table(b)
    if a.width != b.width or tb.shape != tuple(ta.shape[p] for p in perm):
        mismatches = -1
    else:
        mismatches = int(np.count_nonzero(ta != np.transpose(tb, np.argsort(perm))))
    elems = np.sort(ta.ravel() // a.width)
    bijective = bool(np.array_equal(elems, np.arange(ta.size)))
    return DualCheck(a.name, b.name, ta.shape, mismatches, bijective)


def design_pairs(dim: int = smem.HEAD_DIM, chunk: int = smem.CHUNK,
                 dtype: type = cutlass.BFloat16) -> list[tuple[LayoutSpec, LayoutSpec, tuple[int, ...]]]:
    """The transpose-dual pairs the kernels use: ``cute_kda.layouts.smem`` and the staged TMA views."""
    pairs = [
        (layout_spec(f"chunk_operand[{chunk},{dim}]", smem.chunk_operand, dim, chunk, dtype=dtype),
         layout_spec(f"chunk_operand_transposed[{dim},{chunk}]", smem.chunk_operand_transposed, dim, chunk,
                     dtype=dtype), (1, 0)),
        (layout_spec(f"state_b_view[{dim},{dim}]", smem.state_b_view, dim, dtype=dtype),
         layout_spec(f"state_acc_view[{dim},{dim}]", smem.state_acc_view, dim, dtype=dtype), (1, 0)),
        (layout_spec(f"square_tile[{chunk},{chunk}]", smem.square_tile, chunk, dtype=dtype),
         layout_spec(f"square_tile_transposed[{chunk},{chunk}]", smem.square_tile_transposed, chunk,
                     dtype=dtype), (1, 0)),
    ]
    stages = 3
    pairs.append((
        layout_spec(f"tma.operand_tile_staged[{chunk},{dim},{stages}]", tma.operand_tile_staged, chunk, dim, stages,
                    dtype=dtype),
        layout_spec(f"tma.operand_tile_transposed_staged[{dim},{chunk},{stages}]", tma.operand_tile_transposed_staged,
                    chunk, dim, stages, dtype=dtype),
        (1, 0, 2)))
    return pairs


# --------------------------------------------------------------------------------------------
# (ii) ldmatrix / stmatrix address patterns and wavefronts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatrixAccess:
    """One warp-level matrix copy: ``op`` ∈ {ldmatrix, stmatrix}, MMA ``operand`` ∈ {A, B, C}."""

    op: str
    operand: str
    num_matrices: int
    trans: bool = False

    @property
    def name(self) -> str:
        return f"{self.op}.x{self.num_matrices}{'.trans' if self.trans else ''} {self.operand}"


# rows[call][phase][lane] = the eight block coordinates (mode0, mode1) of the row that lane addresses
AccessRows = tuple[tuple[tuple[tuple[tuple[int, int], ...], ...], ...], ...]


@functools.lru_cache(maxsize=None)
def access_rows(access: MatrixAccess) -> AccessRows:
    """Block coordinates each lane addresses, per atom call and phase, from the DSL's tiled copy."""

    def run():
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)),
                                  (1, 1, 1), (MMA_BLOCK, MMA_BLOCK, MMA_BLOCK))
        op_cls = {"ldmatrix": warp.LdMatrix8x8x16bOp, "stmatrix": warp.StMatrix8x8x16bOp}[access.op]
        make = {"A": cute.make_tiled_copy_A, "B": cute.make_tiled_copy_B, "C": cute.make_tiled_copy_C}
        tiled = make[access.operand](
            cute.make_copy_atom(op_cls(access.trans, access.num_matrices), cutlass.BFloat16), mma)
        tv = tiled.layout_src_tv_tiled if access.op == "ldmatrix" else tiled.layout_dst_tv_tiled
        block_rows = cute.size(tiled.tiler_mn[0])
        calls = cute.size(tv, mode=[1]) // 8
        rows = []
        for call in range(calls):
            phases = []
            for phase in range(access.num_matrices):
                lanes = []
                for lane in range(8 * phase, 8 * phase + 8):
                    idx = [tv((lane, 8 * call + e)) for e in range(8)]
                    lanes.append(tuple((i % block_rows, i // block_rows) for i in idx))
                phases.append(tuple(lanes))
            rows.append(tuple(phases))
        return tuple(rows)

    return run_traced(run)


class NotAddressable(ValueError):
    """The layout does not keep a lane's eight elements as one aligned 16-byte row."""


def _wavefronts(addresses: np.ndarray) -> np.ndarray:
    """Wavefronts of phases ``addresses[..., lane, element]`` (byte addresses), one per leading index."""
    words = np.sort((addresses // BANK_BYTES).reshape(*addresses.shape[:-2], -1), axis=-1)
    first = np.ones(words.shape, dtype=bool)
    first[..., 1:] = words[..., 1:] != words[..., :-1]  # count each distinct word once (broadcast)
    hits = (words[..., None] % BANKS == np.arange(BANKS)) & first[..., None]
    return hits.sum(axis=-2).max(axis=-1)


def phase_wavefronts(row_addresses: Iterable[Iterable[int]]) -> int:
    """Wavefronts of one phase: max over banks of the distinct 4-byte words it requests there."""
    return int(_wavefronts(np.asarray([list(row) for row in row_addresses], dtype=np.int64)))


def instruction_wavefronts(table: np.ndarray, access: MatrixAccess, width: int = 2) -> np.ndarray:
    """Wavefronts of every ``access`` instruction that sweeps ``table`` in 16×16 blocks (flat array).

    ``table`` is a 2-D byte table indexed like the access's block (``(m, k)`` for A, ``(n, k)`` for B,
    ``(m, n)`` for C); both modes must be multiples of 16. Raises :class:`NotAddressable` when a
    lane's row is not 16 contiguous, 16-byte-aligned bytes of b16 elements.
    """
    if width != 2:
        raise NotAddressable("ldmatrix/stmatrix move b16 elements")
    rows0, rows1 = table.shape
    if rows0 % MMA_BLOCK or rows1 % MMA_BLOCK:
        raise ValueError(f"table {table.shape} is not a whole number of 16x16 blocks")
    coords = np.array(access_rows(access))  # [call, phase, lane, element, 2]
    blocks = table.reshape(rows0 // MMA_BLOCK, MMA_BLOCK, rows1 // MMA_BLOCK, MMA_BLOCK).transpose(0, 2, 1, 3)
    blocks = blocks.reshape(-1, MMA_BLOCK, MMA_BLOCK)
    addresses = blocks[:, coords[..., 0], coords[..., 1]]  # [block, call, phase, lane, element]
    start = addresses[..., :1]
    if np.any(start % LDSM_ROW_BYTES) or np.any(addresses != start + width * np.arange(8)):
        raise NotAddressable(f"{access.name}: a lane's eight elements are not one aligned 16-byte row")
    return _wavefronts(addresses).sum(axis=-1).ravel()


def max_wavefronts(spec: LayoutSpec, access: MatrixAccess) -> int | None:
    """Worst instruction of ``access`` over ``spec``'s layout (None if ldmatrix cannot address it)."""
    try:
        return int(instruction_wavefronts(byte_table(spec), access, spec.width).max())
    except NotAddressable:
        return None


# --------------------------------------------------------------------------------------------
# Bank-conflict table for the kernels' accesses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperandUse:
    """A tensor the kernels move with ldmatrix/stmatrix.

    ``tile`` ∈ {chunk [CHUNK, D], state [V, K], square [CHUNK, CHUNK]}; ``transposed`` selects the
    ``[cols, rows]`` view (e.g. ``krᵀ`` ``[D, CHUNK]``, state ``[K, V]``).
    """

    what: str
    tile: str
    transposed: bool
    op: str
    operand: str
    trans: bool

    def access(self, num_matrices: int) -> MatrixAccess:
        return MatrixAccess(self.op, self.operand, num_matrices, self.trans)

    def shape(self, dim: int, chunk: int) -> tuple[int, int]:
        """``[rows, cols]`` of the stored tile (before the transposed view)."""
        return {"chunk": (chunk, dim), "state": (dim, dim), "square": (chunk, chunk)}[self.tile]


KERNEL_USES: tuple[OperandUse, ...] = (
    OperandUse("qd, kd: A of qd·S, kd·S (K2 ph.1)", "chunk", False, "ldmatrix", "A", False),
    OperandUse("v: C of u = v - kd·S (K2 ph.2)", "chunk", False, "ldmatrix", "C", False),
    OperandUse("out: C store (K2 ph.5)", "chunk", False, "stmatrix", "C", False),
    OperandUse("krᵀ: A of krᵀ·U (K2 ph.6)", "chunk", True, "ldmatrix", "A", True),
    OperandUse("kinv: B of kd·kinvᵀ (K1)", "chunk", False, "ldmatrix", "B", False),
    OperandUse("S [V,K]: B of kd·S (K2 ph.1)", "state", False, "ldmatrix", "B", False),
    OperandUse("S [K,V]: C load (K2 ph.6)", "state", True, "ldmatrix", "C", True),
    OperandUse("S [K,V]: C store (K2 ph.6)", "state", True, "stmatrix", "C", True),
    OperandUse("INV, Mqk: A (K2 ph.3-4)", "square", False, "ldmatrix", "A", False),
    OperandUse("L, INV, Mqk: C store (K1)", "square", False, "stmatrix", "C", False),
    OperandUse("Lᵀ: B of L·L (K1 Neumann)", "square", True, "ldmatrix", "B", True),
)


@dataclass(frozen=True)
class ConflictRow:
    """Worst wavefronts per instruction of one use and width under each layout family (None: n/a)."""

    use: OperandUse
    access: MatrixAccess
    wavefronts: dict[str, int | None]

    @property
    def ideal(self) -> int:
        return self.access.num_matrices


def bank_conflict_table(dim: int = smem.HEAD_DIM, chunk: int = smem.CHUNK, dtype: type = cutlass.BFloat16,
                        uses: Iterable[OperandUse] = KERNEL_USES, num_matrices: Iterable[int] = (1, 2, 4),
                        families: Iterable[LayoutFamily] = FAMILIES) -> list[ConflictRow]:
    """Wavefronts per instruction for each kernel use, ``.x1/.x2/.x4``, under each layout family."""
    families = tuple(families)
    rows = []
    for use in uses:
        r, c = use.shape(dim, chunk)
        for n in num_matrices:
            access = use.access(n)
            cells = {}
            for fam in families:
                spec = fam.spec(r, c, dtype, use.transposed) if fam.fits(r, c, dtype) else None
                cells[fam.name] = None if spec is None else max_wavefronts(spec, access)
            rows.append(ConflictRow(use, access, cells))
    return rows


def format_conflict_table(rows: list[ConflictRow]) -> str:
    """Text table: one line per (use, access), a ``wavefronts (×ideal)`` column per family."""
    names = list(rows[0].wavefronts) if rows else []
    head = f"{'tensor / use':38s} {'access':28s} {'ideal':>5s} " + " ".join(f"{n:>12s}" for n in names)
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = []
        for n in names:
            w = row.wavefronts[n]
            cells.append(f"{'n/a':>12s}" if w is None else f"{w:>5d} ({w / row.ideal:.0f}x)".rjust(12))
        view = "ᵀ" if row.use.transposed else ""
        lines.append(f"{row.use.what:38s} {row.access.name + ' ' + row.use.tile + view:28s} {row.ideal:5d} "
                     + " ".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------


def draw_grid(spec: LayoutSpec, value: str = "element", rows: int | None = None, cols: int | None = None) -> str:
    """Index grid of a 2-D layout: per coordinate its ``element`` offset, ``byte`` address or ``bank``."""
    table = byte_table(spec)
    if table.ndim != 2:
        raise ValueError(f"{spec.name} is not 2-D")
    table = table[: rows or table.shape[0], : cols or table.shape[1]]
    shown = {"element": table // spec.width, "byte": table, "bank": table // BANK_BYTES % BANKS}[value]
    cell = max(len(str(int(shown.max()))), len(str(shown.shape[1] - 1))) + 1
    lines = [f"{spec.name} ({value}; rows {shown.shape[0]}, cols {shown.shape[1]})",
             " " * 5 + "".join(f"{j:>{cell}d}" for j in range(shown.shape[1]))]
    lines += [f"{i:>4d} " + "".join(f"{int(v):>{cell}d}" for v in shown[i]) for i in range(shown.shape[0])]
    return "\n".join(lines)
