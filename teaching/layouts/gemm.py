"""Layouts and shared-memory plan of the multistage GEMM (:mod:`teaching.kernels.gemm_multistage`), and
the bank-conflict analysis of every shared-memory access it makes.

The GEMM is ``C[M, N] = A[M, K] · B[N, K]ᵀ`` (bf16 in, fp32 accumulation, bf16 or fp32 out). One CTA
owns a ``[BM, BN]`` tile of C and walks K in ``BK``-wide k-tiles. Its shared memory (:func:`smem_budget`)
is a union of two phases:

- *mainloop*: ``stages`` slots of an A tile ``[BM, BK]`` and of a B tile ``[BN, BK]``
  (:func:`operand_stage`), filled by ``cp.async`` and read by ``ldmatrix``;
- *epilogue*: the C tile ``[BM, BN]`` in the output dtype (:func:`epilogue_tile`), written from the
  accumulator fragments and read back row by row for coalesced 16-byte global stores.

Swizzles, like everywhere in :mod:`cute_kda.layouts`, act on byte addresses (tensors are made with
``get_tensor(layout.outer, swizzle=layout.inner)``). An A/B row holds ``BK`` bf16 = 64 or 128 bytes, so
the operand tiles are the GMMA atoms ``K_SW64`` (``BK = 32``: ``Swizzle<2,4,3>``, 16-byte chunk ``j``
of row ``r`` at chunk ``j ^ ((r // 2) % 4)``) or ``K_SW128`` (``BK = 64``: ``Swizzle<3,4,3>``, chunk
``j ^ (r % 8)``) tiled down the rows: the eight rows one ``ldmatrix`` phase reads at one chunk column
land on eight different 16-byte bank groups. Without the swizzle (``swizzle=False``, plain row-major
tiles) those eight rows share 2 (``BK = 32``) or 1 (``BK = 64``) bank groups: 4- or 8-way conflicts.

The epilogue tile is ``K_SW128`` atoms for bf16 (the ``stmatrix`` rows of one phase spread like
``ldmatrix``'s) and, for fp32, 128-byte rows with ``Swizzle<2,5,2>``: the 32-byte group ``G`` of row
``r`` is stored at group ``G ^ (r % 4)``, so the four rows that one half-warp's 8-byte fragment stores
touch (``g = lane // 4``) fill the 32 banks once.

The thread arrangements of the copies (:func:`load_thread_layout`, :func:`store_thread_layout`) and the
CTA's tiled MMA (:func:`tiled_mma`) live here too: they decide which addresses a warp presents at once,
so the bank analysis (:func:`bank_conflict_table`) evaluates the DSL's thread-value layouts of exactly
the copies the kernel builds from them.

Everything that builds a layout runs inside a ``@cute.jit`` / ``@cute.kernel`` trace; :class:`GemmPlan`,
the budget and the analysis are host-side.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from cutlass.cute.nvgpu import warp

from cute_kda.dsl import cute, cutlass
from cute_kda.layouts import smem
from cute_kda.layouts.analysis import BANK_BYTES, BANKS, LayoutSpec, byte_table, layout_spec, phase_wavefronts, run_traced
from cute_kda.layouts.budget import SmemBudget, SmemBuffer, SmemGroup

BF16, F32 = cutlass.BFloat16, cutlass.Float32
MMA_SHAPE = (16, 8, 16)  # mma.sync.m16n8k16
VECTOR_BYTES = 16  # one cp.async, one ld/st.shared.v4, one st.global.v4 per thread
WAVEFRONT_BYTES = BANKS * BANK_BYTES  # 128: what one shared-memory wavefront serves
OPERAND_ATOMS = {32: smem.AtomKind.K_SW64, 64: smem.AtomKind.K_SW128}  # BK → atom of a [rows, BK] bf16 tile
OUT_DTYPES = (BF16, F32)
FP32_EPILOGUE_SWIZZLE = (2, 5, 2)  # (bits, base, shift) on byte addresses, see the module docstring
SMEM_PER_CTA_MAX = 227 * 1024


@dataclass(frozen=True)
class GemmPlan:
    """Static configuration of one GEMM variant: CTA tile, stages, warps, output dtype, swizzle on/off.

    ``warps_m × warps_n`` warps tile the CTA's ``[BM, BN]`` C tile; warp ``(wm, wn)`` owns rows
    ``16·wm + 16·warps_m·i`` and columns ``8·wn + 8·warps_n·j`` (:func:`tiled_mma`). Checked here:
    ``BK ∈ {32, 64}`` (two or four k16 steps per k-tile: the register pipeline below needs at least
    two), ``stages ≥ 2``, the tile a whole number of MMA repetitions and of copy passes, and the
    shared memory under the 227 KiB a CTA may have.
    """

    bm: int = 128
    bn: int = 128
    bk: int = 32
    stages: int = 3
    warps_m: int = 2
    warps_n: int = 2
    out_dtype: type = BF16
    swizzle: bool = True

    def __post_init__(self) -> None:
        if self.bk not in OPERAND_ATOMS:
            raise ValueError(f"BK must be one of {sorted(OPERAND_ATOMS)}, got {self.bk}")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2 (double buffering), got {self.stages}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be BFloat16 or Float32, got {self.out_dtype}")
        if self.bm % (MMA_SHAPE[0] * self.warps_m):
            raise ValueError(f"BM={self.bm} is not a multiple of 16 x warps_m={self.warps_m}")
        if self.bn % (2 * MMA_SHAPE[1] * self.warps_n):
            raise ValueError(f"BN={self.bn} is not a multiple of 16 x warps_n={self.warps_n}")
        if self.bn % 64:
            raise ValueError(f"BN={self.bn} is not a multiple of 64 (the epilogue's 128-byte bf16 rows)")
        for what, (rows, cols, elem_bytes) in (("A", (self.bm, self.bk, 2)), ("B", (self.bn, self.bk, 2)),
                                              ("C", (self.bm, self.bn, self.out_bytes))):
            per_row = cols * elem_bytes // VECTOR_BYTES
            if self.num_threads % per_row or rows % (self.num_threads // per_row):
                raise ValueError(f"{what} tile [{rows}, {cols}] is not a whole number of passes of "
                                 f"{self.num_threads} threads x {VECTOR_BYTES} bytes")
        if self.smem_bytes > SMEM_PER_CTA_MAX:
            raise ValueError(f"{self.name} needs {self.smem_bytes} B of shared memory (at most {SMEM_PER_CTA_MAX})")

    @property
    def num_threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def k_blocks(self) -> int:
        """k16 steps (mma.sync / ldmatrix per k-tile and operand fragment) in one k-tile."""
        return self.bk // MMA_SHAPE[2]

    @property
    def out_bytes(self) -> int:
        return self.out_dtype.width // 8

    @property
    def out_vector(self) -> int:
        """C elements per 16-byte store: N must be a multiple of it."""
        return VECTOR_BYTES // self.out_bytes

    @property
    def stage_bytes(self) -> int:
        """Bytes of one k-tile of A and B in shared memory."""
        return (self.bm + self.bn) * self.bk * 2

    @property
    def smem_bytes(self) -> int:
        """Shared memory of a CTA: the larger of the mainloop stages and the epilogue tile (a union)."""
        return max(self.stages * self.stage_bytes, self.bm * self.bn * self.out_bytes)

    @property
    def name(self) -> str:
        out = "bf16" if self.out_dtype is BF16 else "fp32"
        sw = "" if self.swizzle else " unswizzled"
        return f"{self.bm}x{self.bn}x{self.bk} s{self.stages} w{self.warps_m}x{self.warps_n} {out}{sw}"


# --------------------------------------------------------------------------------------------
# Shared-memory layouts (inside a trace)
# --------------------------------------------------------------------------------------------


def _identity_swizzled(layout):
    """``layout`` composed with the identity swizzle, so swizzled and plain tiles are used alike."""
    return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, layout)


def operand_stage(rows: int, bk: int, dtype: type = BF16, stages: int | None = None, swizzle: bool = True):
    """``[rows, BK]`` (``[rows, BK, stages]`` if ``stages``) A or B tile: ``K_SW64`` / ``K_SW128`` atoms.

    Stage ``s`` starts ``s · rows · BK`` elements in (a multiple of the swizzle period, so every stage
    has the same pattern). ``swizzle=False``: the row-major tile of the comparison, same strides.
    """
    if swizzle:
        return smem.atom_tile(OPERAND_ATOMS[bk], rows, bk, dtype, stages)
    if stages is None:
        return _identity_swizzled(cute.make_layout((rows, bk), stride=(bk, 1)))
    return _identity_swizzled(cute.make_layout((rows, bk, stages), stride=(bk, 1, rows * bk)))


def epilogue_tile(bm: int, bn: int, dtype: type = BF16, swizzle: bool = True):
    """``[BM, BN]`` C tile in the output dtype (module docstring); ``swizzle=False``: row-major."""
    if not swizzle:
        return _identity_swizzled(cute.make_layout((bm, bn), stride=(bn, 1)))
    if dtype.width == 16:
        return smem.atom_tile(smem.AtomKind.K_SW128, bm, bn, dtype)
    row = WAVEFRONT_BYTES // (dtype.width // 8)
    atom = cute.make_composed_layout(cute.make_swizzle(*FP32_EPILOGUE_SWIZZLE), 0,
                                     cute.make_layout((8, row), stride=(row, 1)))
    return cute.tile_to_shape(atom, (bm, bn), (0, 1))


def gmem_matrix(iterator, rows, cols) -> cute.Tensor:
    """Row-major ``[rows, cols]`` global tensor at ``iterator`` (row stride ``cols``, static unit stride).

    The launcher hands over dynamic layouts; ``cols`` should carry its divisibility (``cute.assume``)
    so the DSL can prove each row starts 16-byte aligned and vectorise the copies. A generic pointer
    (what DLPack gives for a CPU tensor, as in the compile-only tests) is taken as a global one:
    ``cp.async`` needs a global source.
    """
    if iterator.memspace != cute.AddressSpace.gmem:
        iterator = cute.make_ptr(iterator.dtype, iterator.toint(), cute.AddressSpace.gmem,
                                 assumed_align=iterator.alignment)
    return cute.make_tensor(iterator, cute.make_layout((rows, cols), stride=(cols, 1)))


# --------------------------------------------------------------------------------------------
# Thread arrangements and the tiled MMA (inside a trace)
# --------------------------------------------------------------------------------------------


def _vector_arrangement(threads: int, cols: int, elem_bytes: int) -> tuple[int, int]:
    per_row = cols * elem_bytes // VECTOR_BYTES
    return threads // per_row, per_row


def load_arrangement(plan: GemmPlan) -> tuple[int, int]:
    """(rows per pass, threads per row) of the A/B ``cp.async`` loads: ``BK / 8`` threads per row."""
    return _vector_arrangement(plan.num_threads, plan.bk, 2)


def store_arrangement(plan: GemmPlan) -> tuple[int, int]:
    """(rows per pass, threads per row) of the epilogue's 16-byte smem reads and global stores."""
    return _vector_arrangement(plan.num_threads, plan.bn, plan.out_bytes)


def _thread_value_layouts(arrangement: tuple[int, int], elem_bytes: int):
    rows, per_row = arrangement
    return (cute.make_layout((rows, per_row), stride=(per_row, 1)),
            cute.make_layout((1, VECTOR_BYTES // elem_bytes)))


def load_thread_layout(plan: GemmPlan):
    """(thread layout, value layout) of the loads: thread ``t`` copies 8 bf16 of row ``t // (BK/8)``."""
    return _thread_value_layouts(load_arrangement(plan), 2)


def store_thread_layout(plan: GemmPlan):
    """(thread layout, value layout) of the epilogue: thread ``t`` moves 16 bytes of one C row."""
    return _thread_value_layouts(store_arrangement(plan), plan.out_bytes)


def tiled_mma(plan: GemmPlan):
    """``warps_m × warps_n`` warps of ``mma.sync.m16n8k16`` (bf16 × bf16 → fp32).

    The permutation makes the tiled MMA ``16·warps_m × 16·warps_n × 16``: each warp gets two n8
    atoms per repetition (columns ``8·wn`` and ``8·wn + 8·warps_n``), so one ``ldmatrix.x4`` loads
    its B fragment for both. The CTA tile repeats this ``BM/(16·warps_m) × BN/(16·warps_n)`` times.
    """
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(BF16, F32, MMA_SHAPE), (plan.warps_m, plan.warps_n, 1),
        permutation_mnk=(MMA_SHAPE[0] * plan.warps_m, 2 * MMA_SHAPE[1] * plan.warps_n, MMA_SHAPE[2]),
    )


# --------------------------------------------------------------------------------------------
# Shared-memory plan (host)
# --------------------------------------------------------------------------------------------


def operand_spec(plan: GemmPlan, rows: int, swizzle: bool | None = None) -> LayoutSpec:
    """One stage of an A (``rows = BM``) or B (``rows = BN``) tile, as a spec for the analysis."""
    swizzle = plan.swizzle if swizzle is None else swizzle
    name = f"operand_stage[{rows},{plan.bk}]{'' if swizzle else ' row-major'}"
    return layout_spec(name, operand_stage, rows, plan.bk, dtype=BF16, swizzle=swizzle)


def epilogue_spec(plan: GemmPlan, swizzle: bool | None = None) -> LayoutSpec:
    swizzle = plan.swizzle if swizzle is None else swizzle
    name = f"epilogue_tile[{plan.bm},{plan.bn}]{'' if swizzle else ' row-major'}"
    return layout_spec(name, epilogue_tile, plan.bm, plan.bn, dtype=plan.out_dtype, swizzle=swizzle)


def smem_budget(plan: GemmPlan) -> SmemBudget:
    """The CTA's shared memory: ``tiles`` = union of the mainloop stages (A, B) and the epilogue C tile."""
    mainloop = SmemGroup("mainloop", (
        SmemBuffer("a", operand_spec(plan, plan.bm), plan.stages, "k_tile", note="A k-tiles (cp.async → ldmatrix)"),
        SmemBuffer("b", operand_spec(plan, plan.bn), plan.stages, "k_tile", note="B k-tiles (cp.async → ldmatrix)"),
    ))
    epilogue = SmemBuffer("c", epilogue_spec(plan), note="C tile after the mainloop (stmatrix/st → 16 B rows)")
    return SmemBudget(f"GEMM {plan.name}", SmemGroup("GemmStorage", (
        SmemGroup("tiles", (mainloop, epilogue), union=True),
    )))


def shared_storage(plan: GemmPlan):
    """The ``cute.struct`` the kernel allocates: :func:`smem_budget`'s fields, offsets and size."""
    return smem_budget(plan).storage_struct()


# --------------------------------------------------------------------------------------------
# Bank conflicts of the kernel's accesses (host)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class WarpAccess:
    """One kind of shared-memory instruction of the kernel, as the DSL's thread-value layout gives it.

    ``coords[t, v]`` is the ``(row, col)`` in the buffer's ``tile`` that value ``v`` of thread ``t``
    touches in one sweep of that tile; consecutive ``group`` values of a thread are one lane's access
    of ``group · elem_bytes`` contiguous bytes (a row of an ldmatrix/stmatrix matrix, a 16-byte vector,
    an 8-byte fp32 pair).
    """

    name: str
    coords: np.ndarray = field(repr=False)  # [threads, values, 2]
    tile: tuple[int, int]
    group: int
    elem_bytes: int

    @property
    def lane_bytes(self) -> int:
        return self.group * self.elem_bytes

    @property
    def ideal(self) -> int:
        """Wavefronts of one warp instruction without conflicts: 32 lanes' bytes / 128."""
        return max(1, 32 * self.lane_bytes // WAVEFRONT_BYTES)


def _access(name: str, tv, tile_mn, threads: int, group: int, elem_bytes: int) -> WarpAccess:
    """Evaluate a thread-value layout (thread, value) → flat index in a column-major ``tile_mn`` tile."""
    tile = tuple(int(cute.size(t)) for t in tile_mn)
    values = int(cute.size(tv, mode=[1]))
    flat = np.array([[tv((t, v)) for v in range(values)] for t in range(threads)], dtype=np.int64)
    return WarpAccess(name, np.stack([flat % tile[0], flat // tile[0]], axis=-1), tile, group, elem_bytes)


@functools.lru_cache(maxsize=None)
def warp_accesses(plan: GemmPlan) -> dict[str, WarpAccess]:
    """The kernel's shared-memory accesses by name, their lane coordinates from the DSL's tiled copies
    (built like the kernel builds them: on :func:`tiled_mma` and the thread arrangements here)."""
    threads = plan.num_threads

    def run():
        mma = tiled_mma(plan)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), BF16)
        vector = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=8 * VECTOR_BYTES)
        c_vector = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), plan.out_dtype,
                                       num_bits_per_copy=8 * VECTOR_BYTES)
        out = []
        for operand, make in (("A", cute.make_tiled_copy_A), ("B", cute.make_tiled_copy_B)):
            tiled = make(ldsm, mma)  # ldmatrix: a lane's 8 source values are the row it addresses
            out.append(_access(f"{operand} ldmatrix.x4", tiled.layout_src_tv_tiled, tiled.tiler_mn, threads, 8, 2))
        for operand in ("A", "B"):
            tiled = cute.make_tiled_copy_tv(vector, *load_thread_layout(plan))
            out.append(_access(f"{operand} cp.async 16B", tiled.layout_dst_tv_tiled, tiled.tiler_mn, threads, 8, 2))
        if plan.out_dtype is BF16:
            tiled = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), BF16), mma)
            out.append(_access("C stmatrix.x4", tiled.layout_dst_tv_tiled, tiled.tiler_mn, threads, 8, 2))
        else:  # the accumulator fragment itself, stored pair by pair
            tile_mn = (mma.get_tile_size(0), mma.get_tile_size(1))
            out.append(_access("C st.shared.v2 fp32", mma.tv_layout_C_tiled, tile_mn, threads, 2, 4))
        tiled = cute.make_tiled_copy_tv(c_vector, *store_thread_layout(plan))
        out.append(_access("C ld.shared 16B", tiled.layout_src_tv_tiled, tiled.tiler_mn, threads, plan.out_vector,
                           plan.out_bytes))
        return {access.name: access for access in out}

    return run_traced(run)


class NotContiguous(ValueError):
    """A lane's values are not one contiguous, aligned run of bytes under this layout."""


def instruction_wavefronts(table: np.ndarray, access: WarpAccess) -> np.ndarray:
    """Wavefronts of every warp instruction of ``access`` sweeping the 2-D byte ``table`` (flat array).

    The access's tile is repeated over the table; per repetition, warp and value group, the 32 lanes
    present their byte runs at once. Bank model of :mod:`cute_kda.layouts.analysis`: lanes go in phases
    of ``128 / lane_bytes`` (8 for 16-byte accesses and for ldmatrix/stmatrix rows, 16 for 8 bytes), a
    phase costs the largest number of distinct 4-byte words it asks of one bank.
    """
    rows, cols = access.tile
    if table.shape[0] % rows or table.shape[1] % cols:
        raise ValueError(f"table {table.shape} is not a whole number of {access.name} tiles {access.tile}")
    threads, values, _ = access.coords.shape
    lanes_per_phase = min(32, WAVEFRONT_BYTES // access.lane_bytes)
    out = []
    for i in range(0, table.shape[0], rows):
        for j in range(0, table.shape[1], cols):
            addr = table[access.coords[..., 0] + i, access.coords[..., 1] + j]  # [threads, values]
            runs = addr.reshape(threads, values // access.group, access.group)
            start = runs[..., :1]
            if np.any(start % access.lane_bytes) or np.any(runs != start + access.elem_bytes * np.arange(access.group)):
                raise NotContiguous(f"{access.name}: a lane's values are not one aligned {access.lane_bytes}-byte run")
            words = start + BANK_BYTES * np.arange(max(1, access.lane_bytes // BANK_BYTES))  # [threads, calls, words]
            for w in range(threads // 32):
                for call in range(words.shape[1]):
                    lanes = words[32 * w: 32 * w + 32, call]
                    out.append(sum(phase_wavefronts(lanes[p: p + lanes_per_phase].tolist())
                                   for p in range(0, 32, lanes_per_phase)))
    return np.asarray(out)


@dataclass(frozen=True)
class ConflictRow:
    """Worst wavefronts per warp instruction of one access, on the swizzled and the row-major layout."""

    buffer: str
    access: str
    ideal: int
    swizzled: int
    row_major: int


def bank_conflict_table(plan: GemmPlan) -> list[ConflictRow]:
    """Every shared-memory instruction of the kernel, swizzled layout vs row-major (``plan.swizzle`` ignored)."""
    accesses = warp_accesses(plan)
    buffers = {"A": lambda sw: operand_spec(plan, plan.bm, sw), "B": lambda sw: operand_spec(plan, plan.bn, sw),
               "C": lambda sw: epilogue_spec(plan, sw)}
    rows = []
    for name, access in accesses.items():
        spec = buffers[name[0]]
        worst = [int(instruction_wavefronts(byte_table(spec(sw)), access).max()) for sw in (True, False)]
        rows.append(ConflictRow(spec(True).name, name, access.ideal, *worst))
    return rows


def draw_chunks(spec: LayoutSpec, rows: int = 8) -> str:
    """The first ``rows`` rows of a 2-D tile as 16-byte chunks: entry ``j`` of row ``r`` is the bank group
    (``byte // 16 % 8``, four banks each) chunk ``j`` of row ``r`` lands in. An ldmatrix phase reads one
    chunk column of eight rows: conflict-free when that column shows eight different groups."""
    groups = byte_table(spec)[:rows, :: VECTOR_BYTES // spec.width] // VECTOR_BYTES % (WAVEFRONT_BYTES // VECTOR_BYTES)
    lines = [f"{spec.name}: bank group of 16-byte chunk j of row r",
             "     " + " ".join(f"{'j' + str(j):>3s}" for j in range(groups.shape[1]))]
    lines += [f"  r{r:<2d} " + " ".join(f"{int(g):>3d}" for g in groups[r]) for r in range(groups.shape[0])]
    return "\n".join(lines)


def format_conflict_table(rows: list[ConflictRow]) -> str:
    """Text table: worst wavefronts per warp instruction (and × ideal), swizzled vs row-major."""
    head = f"{'buffer':28s} {'instruction':22s} {'ideal':>5s} {'swizzled':>12s} {'row-major':>12s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{w:>5d} ({w / r.ideal:.0f}x)".rjust(12) for w in (r.swizzled, r.row_major)]
        lines.append(f"{r.buffer:28s} {r.access:22s} {r.ideal:5d} " + " ".join(cells))
    return "\n".join(lines)
