"""Kernel variants: one frozen dataclass per kernel, naming everything that selects compiled code.

A variant is the compile key of its kernel (the launchers in :mod:`cute_kda.ops` cache compiled code by
``(variant, device index)``), what its launcher builds the kernel class from, and what :func:`cute_kda.warmup`
lists. Sizes that vary per call are not part of it: one compile serves every size. The choices that depend on
the problem and the device (the V-split of the scans) are class methods here, next to the field they choose.
This module imports nothing of the DSL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .numerics import HEAD_DIM, SCAN_VSPLITS, SUPPORTED_VSPLITS, gate_scheme
from .workspace import SNAPSHOT_TILES

# The two-tile prefill (docs/numerics.md, "Two tiles a serial step"; perf-log v10): K1's and K2's pair variants run
# the inference forward where they pay (:func:`pair_prefill`). Training keeps today's K1 and K2 in both passes, so
# ``recompute`` changes no bit of a step.
PAIR_PREFILL = True
PAIR_SCHEMES = ("safe", "per_head")  # the K1 gate schemes with a pair variant (not yet: "dyadic")
# the smallest K2 V-split at which each scheme's two-tile prefill pays, measured on the H200 (perf-log v10, v12,
# 2026-12-05): the pair K1s cost +6-27 % of K1 (per head; the safe gate's +19-38 %, the packed cases the most), which
# the pair K2 wins back where K2 splits the value columns (few chains: K1 + K2 −5 % at V-split 2, −10-12 % at 4) and
# not at V-split 1 (+2-10 %; a per-head packed prefill +4 %)
PAIR_PREFILL_MIN_VSPLIT = {"per_head": 2, "safe": 2}


def pair_prefill(gate: str, per_head_gate: bool, segmented: bool, vsplit: int) -> bool:
    """Whether an inference forward whose K2 runs at ``vsplit`` runs the pair variants: a gate scheme and split where
    they pay (:data:`PAIR_PREFILL_MIN_VSPLIT`), an unsplit call (a segmented one runs K2 three times over segment
    bounds), and :data:`PAIR_PREFILL`."""
    least = PAIR_PREFILL_MIN_VSPLIT.get(gate_scheme(gate, per_head_gate))
    return PAIR_PREFILL and least is not None and vsplit >= least and not segmented


def fill_sms(num_seqs: int, heads: int, sms: int, splits: tuple[int, ...]) -> int:
    """The largest split in ``splits`` whose CTA count ``num_seqs · heads · split`` still fits one CTA per SM; the
    smallest when even ``num_seqs · heads`` does not.

    The rule of the serial scans (K2 and Kernel A): splitting the value columns shortens a CTA's tile step (K2 alone
    on the H200: 0.99 µs at V-split 1, 0.75 at 2, 0.67 at 4, one CTA per SM, at B1 T32768 H16), but two CTAs sharing
    an SM step slower than one unsplit CTA (B1 T8192 H96 at V-split 2: 192 CTAs, 1.78 µs against 1.07 at V-split
    1), so a split pays only while it lands on idle SMs (``benchmarks/bench_recurrence.py``,
    ``benchmarks/bench_bwd.py``).
    """
    fitting = [split for split in splits if num_seqs * heads * split <= sms]
    return max(fitting, default=splits[0])


class SerialScan:
    """A serial scan over the tiles (K2, Kernel A): its V-split heuristic, over the class's ``splits``."""

    splits: ClassVar[tuple[int, ...]]

    @classmethod
    def choose_vsplit(cls, num_seqs: int, heads: int, sms: int) -> int:
        """The V-split for ``num_seqs × heads`` chains on ``sms`` SMs (:func:`fill_sms` over ``splits``)."""
        return fill_sms(num_seqs, heads, sms, cls.splits)


@dataclass(frozen=True)
class PrepareVariant:
    """K1 (:class:`cute_kda.kernels.fwd_prepare.PrepareKernel`).

    ``gate``: one of :data:`cute_kda.numerics.GATES`; ``g_dtype``: ``dtype`` (fp32 too with gate "none");
    ``per_head_gate``: g ``[B, T, HV]`` (GatedDeltaNet), else per channel; ``grouped``: HV > H value heads;
    ``dtype``: q's and k's, bf16 or fp16 (:data:`cute_kda.validation.ACTIVATION_DTYPES`); ``dim``: the head dim K
    (:data:`cute_kda.numerics.NATIVE_HEAD_DIMS`); ``pairs``: the pair workspace of the two-tile serial step, a CTA a
    pair of tiles (the schemes of :data:`PAIR_SCHEMES`: :data:`cute_kda.kernels.fwd_prepare.PAIR_SCHEMES`);
    ``partner_fields``: with ``pairs`` and a per-head gate, also the
    :class:`~cute_kda.workspace.PartnerFields` (the backward's recomputation in the two-tile training form).
    """

    varlen: bool
    qk_l2norm: bool = True
    beta_logits: bool = True
    gate: str = "safe"
    g_dtype: torch.dtype = torch.bfloat16
    per_head_gate: bool = False
    grouped: bool = False
    dtype: torch.dtype = torch.bfloat16
    dim: int = HEAD_DIM
    pairs: bool = False
    partner_fields: bool = False


@dataclass(frozen=True)
class RecurrenceVariant(SerialScan):
    """K2 (:class:`cute_kda.kernels.fwd_recurrence.FwdRecurrence`): the state dtypes in and out (None: no such
    state; fp16 ones not beside fp32), ``dtype``: v's and o's (bf16 or fp16), ``checkpoints``: the training
    forward's variant that keeps the state entering every tile;
    ``state_pool``: the states are one pool read and written by slot id (both dtypes the pool's), with
    ``prefix_checkpoint_every`` (tokens, a multiple of 64; 0: none) its prefix checkpoints into pool slots; ``dim``:
    K = V (:data:`cute_kda.numerics.NATIVE_HEAD_DIMS`); ``pairs``: the two-tile serial step over the pair workspace
    (:class:`cute_kda.kernels.fwd_recurrence_pairs.PairRecurrence`; with ``checkpoints`` its training variant, a
    state and tile a's U kept a pair); ``token_outputs`` False: a pass run for its states alone (``checkpoints`` or a
    final state), no o (under :data:`cute_kda.executors.stages.STATES_ONLY_PASSES`: the backward's recomputation, a
    segmented call's passes for the segment states)."""

    vsplit: int
    initial_state: torch.dtype | None
    final_state: torch.dtype | None
    varlen: bool
    checkpoints: bool = False
    state_pool: bool = False
    prefix_checkpoint_every: int = 0
    dtype: torch.dtype = torch.bfloat16
    dim: int = HEAD_DIM
    pairs: bool = False
    token_outputs: bool = True
    splits: ClassVar[tuple[int, ...]] = SUPPORTED_VSPLITS


@dataclass(frozen=True)
class ScanTuning:
    """Kernel A's compile-time tuning knobs; the defaults are what ``benchmarks/explore_bwd_scan.py`` measured
    fastest (docs/perf-log.md)."""

    compute_warps: int | None = None  # None: 4 (2 at V-split 8)
    output_stages: int = 2
    split_accumulator: bool = False


@dataclass(frozen=True)
class ScanVariant(SerialScan):
    """Kernel A (:class:`cute_kda.kernels.bwd_scan.BwdScan`): dht / dh0 dtypes (None: no such tensor);
    ``token_outputs`` False writes dh0 alone (a segmented call's first pass); ``snapshot_every`` tiles per kept
    state gradient; ``dim``: K = V (:data:`cute_kda.numerics.NATIVE_HEAD_DIMS`); ``dv_dtype``: dv in bf16, or fp16
    (:data:`cute_kda.ops.bwd_scan.DV_DTYPES`); ``pairs``: the two-tile scan over the pair workspace, a snapshot a
    pair (:class:`cute_kda.kernels.bwd_scan_pairs.PairBwdScan`)."""

    vsplit: int
    dht: torch.dtype | None
    dh0: torch.dtype | None
    varlen: bool
    tuning: ScanTuning = ScanTuning()
    token_outputs: bool = True
    snapshot_every: int = SNAPSHOT_TILES
    dim: int = HEAD_DIM
    dv_dtype: torch.dtype = torch.bfloat16
    pairs: bool = False
    splits: ClassVar[tuple[int, ...]] = SCAN_VSPLITS  # K2's rule over Kernel A's own splits, 8 included


@dataclass(frozen=True)
class GradsVariant:
    """Kernel B (:class:`cute_kda.kernels.bwd_grads.BwdGrads`): K1's flags and ``compute_warps`` (4 or 8 at D = 128,
    4 at 64; the launcher's default is :func:`cute_kda.layouts.bwd_grads.default_warps`); ``gate_ahead``: the gate
    backward's raw gate values loaded in one burst; ``split_load``: the state images behind their own transaction
    barrier; ``split_rows``: the safe gate backward's rows on all 8 warps; ``slopes_ahead``: the safe gate backward's
    rows' slopes formed before its row loop (the launcher's :data:`cute_kda.ops.bwd_grads.GATE_AHEAD`,
    :data:`~cute_kda.ops.bwd_grads.SPLIT_LOAD`, :data:`~cute_kda.ops.bwd_grads.SPLIT_ROWS`,
    :data:`~cute_kda.ops.bwd_grads.SLOPES_AHEAD`); ``dim``: K = V (:data:`cute_kda.numerics.NATIVE_HEAD_DIMS`);
    ``grad_dtype``: dq, dk and a per-channel gate's dg in bf16, or fp16 (:data:`cute_kda.ops.bwd_grads.GRAD_DTYPES`);
    ``dtype``: q's, k's, v's and a raw gate's, bf16 or fp16 (fp16 training's own backward, docs/numerics.md "fp16
    training", stage 4); ``group_sum``: grouped value heads in groups of two, dq and dk added by the kernel into
    ``[B, T, H, D]`` (perf-log GDN6); ``pair_rebuild``: the states come a pair of tiles (the two-tile training form,
    W2 of docs/perf-log.md), each CTA rebuilding the matrix of its tile's other end from its pair partner's fields
    (:mod:`cute_kda.kernels.bwd_grads.pairs`)."""

    varlen: bool
    qk_l2norm: bool
    beta_logits: bool
    gate: str
    g_dtype: torch.dtype
    per_head_gate: bool
    grouped: bool
    compute_warps: int
    gate_ahead: bool = False
    split_load: bool = False
    split_rows: bool = False
    slopes_ahead: bool = False
    dim: int = HEAD_DIM
    grad_dtype: torch.dtype = torch.bfloat16
    dtype: torch.dtype = torch.bfloat16
    group_sum: bool = False
    pair_rebuild: bool = False


@dataclass(frozen=True)
class CombineVariant:
    """The segment combine (:class:`cute_kda.kernels.segment_combine.SegmentCombineKernel`) of a segmented call:
    ``dim`` (K = V), ``transpose`` (the backward's combine) and ``boundary``, the dtype of the initial state (forward)
    or of the final state's gradient (backward) it starts from (None: none, zero)."""

    dim: int
    transpose: bool
    boundary: torch.dtype | None


@dataclass(frozen=True)
class RoundVariant:
    """The fp16 → bf16 rounding pass (:class:`cute_kda.kernels.round_bf16.RoundBf16Kernel`; fp16 training's dO,
    :data:`cute_kda.executors.training.FP16_DO_KERNEL`): ``num_threads`` a CTA, ``vectors`` 16-byte runs in flight
    a thread."""

    num_threads: int = 256
    vectors: int = 4
