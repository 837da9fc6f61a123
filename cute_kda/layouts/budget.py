"""Shared-memory plans of the forward kernels: named buffers, their layouts, stage bytes, totals.

A plan is a tree of buffers (:class:`SmemBuffer`) in structs and unions (:class:`SmemGroup`), laid
out by the same rules as ``cute.struct`` / ``cute.union`` (members in order, each at its alignment;
a union is as large as its largest member). Every buffer's size is its layout's ``cosize`` times the
element width, rounded up to its alignment: 128 bytes (TMA's shared-memory alignment), or the
swizzle period if that is larger (256 bytes for K_SW32); mbarriers take 8. A staged buffer holds
``stages`` such slots back to back, so stage ``s`` starts ``s · slot_bytes`` into it.

Kernel tests assert that a kernel's ``SharedStorage`` equals the plan; :meth:`SmemBudget.storage_struct`
builds that ``cute.struct`` from the plan directly. Occupancy follows the sm_90 rules: 228 KiB of
shared memory per SM, at most 227 KiB per CTA, and 1 KiB reserved by the system per CTA.

Each kernel's plan lives with its layouts: :func:`cute_kda.layouts.fwd_prepare.smem_budget` (K1, the
struct the kernel allocates is built from it) and
:class:`cute_kda.layouts.fwd_recurrence.RecurrenceSmemPlan` (K2, recurrence, one CTA per (sequence,
head, V-band); :func:`k2_budget` here is that plan as buffers with layouts);
``python scripts/explore_layouts.py --section budget`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

from ..dsl import cute, cutlass
from . import fwd_recurrence, smem
from .analysis import LayoutSpec, evaluate, layout_spec, swizzle_period_bytes

SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA_MAX = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024
SMEM_CARVEOUT_PERCENT = 100  # all of the unified L1/smem as smem: the kernels that ask for several CTAs an SM
BUFFER_ALIGN = 128
MBARRIER_ALIGN = 8


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class SmemBuffer:
    """One named buffer: ``stages`` slots of ``layout`` (one slot per pipeline stage)."""

    name: str
    layout: LayoutSpec
    stages: int = 1
    pipeline: str | None = None  # the pipeline whose stage this buffer is part of
    align_bytes: int | None = None  # None: max(128, swizzle period)
    note: str = ""

    @property
    def dtype(self) -> type:
        return self.layout.dtype

    @property
    def width(self) -> int:
        return self.layout.width

    @property
    def cosize(self) -> int:
        """Elements one slot's layout spans (DSL ``cosize``)."""
        return evaluate(self.layout).cosize

    @property
    def align(self) -> int:
        if self.align_bytes is not None:
            return self.align_bytes
        return max(BUFFER_ALIGN, swizzle_period_bytes(evaluate(self.layout).swizzle))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one stage, rounded up to the alignment."""
        return _align_up(self.cosize * self.width, self.align)

    @property
    def stage_stride(self) -> int:
        """Elements from one stage's slot to the next."""
        return self.slot_bytes // self.width

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.stages

    def staged_layout(self):
        """The slot layout with a trailing stage mode of stride :attr:`stage_stride` (inside a trace)."""
        return cute.append(self.layout.make(), cute.make_layout(self.stages, stride=self.stage_stride))


@dataclass(frozen=True)
class SmemGroup:
    """A struct (members one after another) or a union (members overlaid) of buffers and groups."""

    name: str
    members: tuple["SmemNode", ...]
    union: bool = False

    @property
    def align(self) -> int:
        return max(m.align for m in self.members)

    def offsets(self) -> list[int]:
        """Byte offset of each member inside this group."""
        if self.union:
            return [0] * len(self.members)
        out, offset = [], 0
        for m in self.members:
            offset = _align_up(offset, m.align)
            out.append(offset)
            offset += m.nbytes
        return out

    @property
    def nbytes(self) -> int:
        if self.union:
            end = max(m.nbytes for m in self.members)
        else:
            end = max(o + m.nbytes for o, m in zip(self.offsets(), self.members))
        return _align_up(end, self.align)


SmemNode = Union[SmemBuffer, SmemGroup]


@dataclass(frozen=True)
class PlacedBuffer:
    """A buffer at its byte offset from the start of the shared storage; ``path`` names its groups."""

    buffer: SmemBuffer
    offset: int
    path: tuple[str, ...]


@dataclass(frozen=True)
class SmemBudget:
    """A kernel's shared-memory plan."""

    name: str
    storage: SmemGroup

    def _walk(self, group: SmemGroup, base: int, path: tuple[str, ...]) -> Iterator[PlacedBuffer]:
        for member, offset in zip(group.members, group.offsets()):
            if isinstance(member, SmemGroup):
                yield from self._walk(member, base + offset, path + (member.name,))
            else:
                yield PlacedBuffer(member, base + offset, path)

    @property
    def buffers(self) -> dict[str, PlacedBuffer]:
        """Every buffer by name, with its offset, in storage order."""
        return {p.buffer.name: p for p in self._walk(self.storage, 0, ())}

    @property
    def stage_bytes(self) -> dict[str, int]:
        """Bytes of one stage of each pipeline (sum of its buffers' slots)."""
        out: dict[str, int] = {}
        for p in self.buffers.values():
            if p.buffer.pipeline is not None:
                out[p.buffer.pipeline] = out.get(p.buffer.pipeline, 0) + p.buffer.slot_bytes
        return out

    @property
    def total_bytes(self) -> int:
        return self.storage.nbytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= SMEM_PER_CTA_MAX

    @property
    def ctas_per_sm(self) -> int:
        """CTAs of this kernel one SM holds as far as shared memory goes."""
        if not self.fits:
            return 0
        return SMEM_PER_SM // (_align_up(self.total_bytes, BUFFER_ALIGN) + SMEM_RESERVED_PER_CTA)

    def storage_struct(self):
        """The ``cute.struct`` with exactly this plan's fields, offsets and size (buffers as ``MemRange``)."""
        return _make_struct(self.storage)

    def describe(self) -> str:
        """Text table of the buffers, stage bytes, total and occupancy."""
        head = f"{'buffer':34s} {'layout':44s} {'dtype':>9s} {'cosize':>7s} {'slot B':>7s} {'stages':>6s} {'offset':>7s}"
        lines = [f"{self.name}", head, "-" * len(head)]
        for p in self.buffers.values():
            b = p.buffer
            name = ".".join(p.path + (b.name,))
            note = f"  {b.note}" if b.note else ""
            lines.append(f"{name:34s} {b.layout.name:44s} {b.dtype.__name__:>9s} {b.cosize:7d} "
                         f"{b.slot_bytes:7d} {b.stages:6d} {p.offset:7d}{note}")
        for pipe, nbytes in self.stage_bytes.items():
            lines.append(f"bytes per {pipe} stage: {nbytes}")
        lines.append(f"total: {self.total_bytes} B ({self.total_bytes / 1024:.1f} KiB); "
                     f"CTAs/SM by smem: {self.ctas_per_sm}")
        return "\n".join(lines)


def _make_struct(group: SmemGroup):
    annotations = {}
    for m in group.members:
        if isinstance(m, SmemGroup):
            annotations[m.name] = cute.struct.Align[_make_struct(m), m.align]
        else:
            annotations[m.name] = cute.struct.Align[
                cute.struct.MemRange[m.dtype, m.stages * m.stage_stride], m.align]
    cls = type(group.name, (), {"__annotations__": annotations})
    return (cute.union if group.union else cute.struct)(cls)


def mbarriers(name: str, count: int, note: str) -> SmemBuffer:
    """``count`` mbarriers (8 bytes each, 8-byte aligned)."""
    return SmemBuffer(name, layout_spec(f"vector({count})", smem.vector, count, dtype=cutlass.Int64),
                      align_bytes=MBARRIER_ALIGN, note=note)


def k2_budget(plan: fwd_recurrence.RecurrenceSmemPlan = fwd_recurrence.RecurrenceSmemPlan()) -> SmemBudget:
    """K2's shared memory as buffers with layouts, read off the kernel's own plan (also the backward
    scan's, whose plan :class:`~cute_kda.layouts.bwd_scan.ScanSmemPlan` is K2's with other fields).

    :class:`~cute_kda.layouts.fwd_recurrence.RecurrenceSmemPlan` is what K2 allocates (``state``, a
    byte ``union``, mbarriers) and where it puts each pipeline field inside the union. This gives the
    same storage buffer by buffer: fields, order and stage counts from ``plan``; slot layouts the
    ones :mod:`.fwd_recurrence` stages (swizzled band tiles and kd / qd / kr, K_INTER squares, fp32 vectors); the state and its fp32
    staging (present only when ``plan.state_io_fp32``) are that module's views. The tests check its
    offsets and total against ``plan`` and the compiled launch.
    """
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    chunk, dim, v_band = plan.chunk, plan.dim, plan.v_band

    def tile(rows: int, cols: int) -> LayoutSpec:
        return layout_spec(f"operand_tile({rows},{cols})", smem.operand_tile, rows, cols, dtype=bf16)

    def vector(n: int) -> LayoutSpec:
        return layout_spec(f"vector({n})", smem.vector, n, dtype=f32)

    def swizzled(rows: int, cols: int) -> LayoutSpec:
        return layout_spec(f"sw128_tile({rows},{cols})", smem.sw128_tile, rows, cols, dtype=bf16)

    band = tile(chunk, v_band)
    if plan.swizzled_tokens:
        token_kind = fwd_recurrence.token_atom(plan)
        band = layout_spec(f"atom_tile({token_kind.name},{chunk},{v_band})", smem.atom_tile, token_kind, chunk, v_band,
                           dtype=bf16)
    slots = {plan.token_field: band, **{name: swizzled(chunk, dim) for name in fwd_recurrence.SWIZZLED_FIELDS},
             "gt": vector(dim), "inv": tile(chunk, chunk), "mqk": tile(chunk, chunk), "beta": vector(chunk),
             **{name: tile(chunk, chunk) for name in fwd_recurrence.CROSS_FIELDS}}
    pipeline = SmemGroup("pipeline", (
        *(SmemBuffer(name, slots[name], plan.input_stages, "input") for name in plan.input_field_bytes()),
        *(SmemBuffer(name, band, plan.output_stages, "output") for name in plan.outputs),
    ))
    union: tuple[SmemNode, ...] = (pipeline,)
    if plan.state_io_fp32:
        union += (SmemBuffer("state_fp32", layout_spec(f"state_fp32(v_band={v_band})", fwd_recurrence.state_fp32,
                                                       plan, dtype=f32),
                             note="fp32 state I/O staging, used only before and after the tile loop"),)
    storage = SmemGroup("RecurrenceStorage", (
        SmemBuffer("state", layout_spec(f"state_b(v_band={v_band})", fwd_recurrence.state_b, plan, dtype=bf16),
                   note="[V, K] K_INTER; its [K, V] MN_INTER view is the same bytes"),
        SmemGroup("union", union, union=True),
        mbarriers("load_mbar", 2 * plan.input_stages, "PipelineTmaAsync full/empty"),
        mbarriers("store_mbar", 2 * plan.output_stages, "PipelineAsync full/empty"),
        mbarriers("state_mbar", 1, "initial-state TMA load"),
    ))
    staging = ", fp32 state staging" if plan.state_io_fp32 else ""
    return SmemBudget(f"{plan.kernel_name} vsplit={plan.vsplit} (v_band={v_band}){staging}", storage)
