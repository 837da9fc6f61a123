"""Backward Kernel A (the reverse state-gradient scan) alone, per V-split, beside FLA's own reverse scan.

Kernel A (``cute_kda.ops.bwd_scan.bwd_scan``) reads the workspace the forward's K1 writes
(``cute_kda.ops.prepare.prepare`` on the raw inputs of ``benchmarks/shapes.py``), a random bf16 dO
and an fp32 dht ``[N, H, V, K]``; it writes dv, du (bf16), one bf16 snapshot of dS' per block of
``cute_kda.workspace.SNAPSHOT_TILES`` 16-token tiles (one tile: Kernel B reads one per tile) and per sequence end
(``cute_kda.workspace.snapshot_slots``), and an fp32 dh0. Every shape runs at V-split 1, 2, 4, 8 and at the
heuristic's choice (``cute_kda.variants.ScanVariant.choose_vsplit``, marked "auto"). Kernel A is serial over the
tiles of a sequence, so the figure of merit for few (sequence, head) pairs is the time per serial step,
``ms · 1000 / max_s ceil(len_s / 16)``.

The peer is FLA's reverse scan, ``fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_dhu``
(kernel ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64``, 64-token chunks), with exactly the
arguments FLA 0.6.0's KDA backward passes it (``fla/ops/kda/chunk_bwd.py::chunk_kda_bwd``): one
``chunk_kda`` forward + backward on the same raw inputs, dO and dht (``state_v_first=True``, fp32
initial state, in-kernel gate / l2norm / β-sigmoid, ``safe_gate``), stopped at that call, whose
arguments are kept and timed on their own. Issue 9's torch.profiler figures for that kernel on an
H200 are printed beside the measured ones.

Times are medians over CUDA-graph replays of one launch (``cute_kda._bench.graph_median_ms``:
``triton.testing.do_bench`` with the L2 cleared before each repetition), or of eager calls
(``median_ms``) where a capture fails; the "timing" column says which. Bytes are the unique bytes
a call must move, each read or written once:

- Kernel A reads dO, the seven workspace fields of every real (head, tile) (13 888 B,
  ``cute_kda.workspace``) and dht; it writes dv, du, a 128×128 bf16 snapshot per block and dh0.
  V-split CTAs of one (sequence, head) each read the whole workspace tile; those re-reads, mostly
  served from L2, are not counted.
- FLA's kernel reads qg, kg, w, dO, dv (bf16, per token), the last row of gk per chunk (fp32) and
  dht; it writes dh (bf16, per 64-token chunk), dv2 and dh0.

Where the public API cuts the shape into context-parallel segments (``cute_kda.context_parallel``: fixed-length
shapes with few (sequence, head) pairs, B1 T32768 H16 among the six), the row "Kernel A, C segments" times what
the backward runs there instead: the training stage's scan (``cute_kda.executors.stages.KERNELS.scan`` on the
packed segments), i.e. Kernel A over every segment with zero gradients leaving them, the reverse combine of their
transitions (fp32 matmuls), and Kernel A again with each segment's gradient; its allocations included. That row is
the "auto" one of its shape; its steps are one segment's tiles (each of the two passes), its bytes those of one pass.

One more row per shape, "FLA's density", times Kernel A at its fastest V-split keeping one snapshot per 4 tiles
(``bwd_scan(..., snapshot_every=4)``: one per 64 tokens, as FLA's kernel keeps its dh) with everything else the
same: the kernel against FLA's on equal outputs. The training step does not run it (its Kernel B reads a snapshot
per tile), so the summary's "best" and "auto" columns leave it out.

The training forward's extra cost is measured beside it: K2 alone on the same workspace (fp32
state in and out) as the inference variant and as the training variant, which also writes the bf16
state entering every block of ``cute_kda.workspace.SNAPSHOT_TILES`` tiles (one tile today;
``cute_kda.ops.recurrence.recurrence(..., checkpoints=...)``).

The table is printed last and written to ``--out`` (default ``$OUT/bwd-<date>.md`` when ``$OUT``
is set, else ``benchmarks/results/bwd-<date>.md``) after every shape, so a run cut short keeps
what it measured.

    python benchmarks/bench_bwd.py                                     # the six shapes, with FLA
    python benchmarks/bench_bwd.py --shapes B1_T8192_H96,B1_T32768_H16 --out /tmp/bwd.md
    python benchmarks/bench_bwd.py --vsplits 1,4 --peers none          # Kernel A only
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton path (FlashKDA rejects grad mode anyway)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import (  # noqa: E402
    add_run_arguments, environment, graph_median_ms, markdown_table, median_ms, publish, save,
)
from cute_kda.numerics import SCAN_VSPLITS  # noqa: E402
from cute_kda.workspace import CHUNK, SNAPSHOT_TILES, WorkspaceSpec, block_states_shape, kept_tiles  # noqa: E402

from bench_prepare import COPY_CEILING_TBPS  # noqa: E402
from shapes import D, LOWER_BOUND, SHAPES, make_inputs  # noqa: E402

VSPLITS = SCAN_VSPLITS  # every V-split Kernel A offers
FLA_CHUNK = 64  # FLA's chunk_size for KDA
FLA_DENSITY_TILES = FLA_CHUNK // CHUNK  # Kernel A's snapshot blocks at FLA's dh density: one per 64 tokens
# FLA's chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 on an H200, measured by torch.profiler (issue 9)
FLA_REFERENCE_MS = {"B1_T8192_H96": 0.55, "B1_T32768_H16": 0.69}
_ITEMSIZE = {"bfloat16": 2, "float32": 4}


# ---------------------------------------------------------------------------------------------
# arithmetic (no GPU)


class Traffic(NamedTuple):
    """Unique bytes one call reads and writes."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written


def chunks(lengths: tuple[int, ...] | list[int], size: int = CHUNK) -> int:
    """Σ_s ceil(len_s / size): the tiles (or chunks) of all sequences."""
    return sum(-(-n // size) for n in lengths)


def tile_steps(lengths: tuple[int, ...] | list[int], size: int = CHUNK) -> int:
    """max_s ceil(len_s / size): the serial steps of the longest sequence (0 when there is none)."""
    return max((-(-n // size) for n in lengths), default=0)


def snapshot_blocks(lengths: tuple[int, ...] | list[int], every: int = SNAPSHOT_TILES) -> int:
    """Snapshots (or checkpoints) of one head: the global tiles that end a block of ``every`` or end their
    sequence (``cute_kda.workspace.kept_tiles``), the tiles numbered across sequences as the workspace does."""
    bases = list(itertools.accumulate((-(-n // CHUNK) for n in lengths), initial=0))
    return len(kept_tiles(bases, every))


def workspace_bytes_per_tile(dim: int = D) -> int:
    """Bytes of one (head, tile) of the K1 workspace, from ``WorkspaceSpec``'s fields (13 888 at D = 128)."""
    fields = WorkspaceSpec(heads=1, tiles=1, dim=dim).fields().values()
    return sum(math.prod(shape) * _ITEMSIZE[dtype] for shape, dtype in fields)


def scan_traffic(lengths, heads: int, *, dht_itemsize: int | None = 4, dh0: bool = True, dim: int = D,
                 every: int = SNAPSHOT_TILES) -> Traffic:
    """Kernel A's unique bytes: reads dO, the workspace of every real tile, dht (``dht_itemsize`` bytes an
    element, None for no dht); writes dv, du, one bf16 dim×dim snapshot per block of ``every`` tiles
    (:func:`snapshot_blocks`), dh0 (fp32)."""
    tokens, tiles, seqs = sum(lengths), chunks(lengths), len(lengths)
    state = seqs * heads * dim * dim
    read = tokens * heads * dim * 2 + tiles * heads * workspace_bytes_per_tile(dim)
    read += state * dht_itemsize if dht_itemsize else 0
    written = 2 * tokens * heads * dim * 2 + snapshot_blocks(lengths, every) * heads * dim * dim * 2
    written += state * 4 if dh0 else 0
    return Traffic(read, written)


def fla_dhu_traffic(lengths, heads: int, *, dht: bool = True, dh0: bool = True, dim: int = D,
                    chunk: int = FLA_CHUNK) -> Traffic:
    """FLA's dhu kernel's unique bytes: reads qg, kg, w, dO, dv (bf16), gk's last row per chunk (fp32), dht
    (fp32); writes dh (bf16 per chunk), dv2 (bf16), dh0 (fp32)."""
    tokens, nchunks, seqs = sum(lengths), chunks(lengths, chunk), len(lengths)
    state = seqs * heads * dim * dim
    read = 5 * tokens * heads * dim * 2 + nchunks * heads * dim * 4 + (state * 4 if dht else 0)
    written = nchunks * heads * dim * dim * 2 + tokens * heads * dim * 2 + (state * 4 if dh0 else 0)
    return Traffic(read, written)


def floor_ms(nbytes: int, tbps: float = COPY_CEILING_TBPS) -> float:
    """Milliseconds to move ``nbytes`` at the copy ceiling (H200: 4.3 TB/s, design.md §6): a lower bound."""
    return nbytes / (tbps * 1e12) * 1e3


def gb_per_s(nbytes: int, ms: float) -> float:
    """Achieved bandwidth: ``nbytes`` in ``ms`` milliseconds, in GB/s (10⁹ bytes)."""
    return nbytes / (ms * 1e-3) / 1e9


def us_per_step(ms: float, steps: int) -> float:
    return 1e3 * ms / steps if steps else float("nan")


def parse_vsplits(listed: str) -> tuple[int, ...]:
    """``"1,2,4"`` → (1, 2, 4): sorted, unique, each one of :data:`VSPLITS`."""
    try:
        values = sorted({int(item) for item in listed.split(",") if item.strip()})
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"V-splits are integers: {error}") from None
    bad = [v for v in values if v not in VSPLITS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"V-splits must be a non-empty subset of {VSPLITS}, got {listed!r}")
    return tuple(values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    parser.add_argument("--vsplits", type=parse_vsplits, default=VSPLITS,
                        help="comma-separated V-splits of Kernel A to time (the heuristic's is always added)")
    parser.add_argument("--peers", choices=("fla", "none"), default="fla",
                        help="'none' skips FLA's reverse scan (default: fla)")
    return parser


def _checkpoint_block() -> str:
    from cute_kda.workspace import SNAPSHOT_TILES

    return "tile" if SNAPSHOT_TILES == 1 else f"{SNAPSHOT_TILES}-tile block"


def default_out() -> str:
    folder = os.environ.get("OUT") or str(Path(__file__).resolve().parent / "results")
    return os.path.join(folder, f"bwd-{datetime.date.today()}.md")


# ---------------------------------------------------------------------------------------------
# timing (GPU)


def _time(fn: Callable[[], object], warmup: int, rep: int) -> tuple[float, str]:
    """(median ms, 'graph' or 'eager') of ``fn``, already called once (compiled / autotuned)."""
    ms = graph_median_ms(fn, warmup, rep)
    if ms is not None:
        return ms, "graph"
    return median_ms(fn, warmup, rep), "eager"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:120]


def _time_scan_row(row: dict, launch: Callable[[], object], label: str, warmup: int, rep: int) -> dict:
    """Fill a Kernel A row's ``ms`` and ``timing`` (compiled by a first call outside the timing), or its ``note``
    with the error, so the other rows keep their numbers."""
    try:
        launch()
        torch.cuda.synchronize()
        row["ms"], row["timing"] = _time(launch, warmup, rep)
        print(f"{label}: {row['ms']:.3f} ms, {us_per_step(row['ms'], row['steps']):.2f} µs/step", file=sys.stderr)
    except Exception as error:
        traceback.print_exc()
        row["note"] = f"error: {_first_line(error)}"
    return row


def time_scan(name: str, inputs: dict, do: torch.Tensor, dht: torch.Tensor, vsplits: tuple[int, ...],
              warmup: int, rep: int) -> list[dict]:
    """Rows of Kernel A alone, one per V-split (the heuristic's added), on the workspace of the real K1."""
    from cute_kda.device import sm_count
    from cute_kda.ops.bwd_scan import bwd_scan
    from cute_kda.ops.prepare import prepare, tile_bases
    from cute_kda.variants import ScanVariant
    from cute_kda.workspace import allocate_workspace, tiles_per_head

    shape = SHAPES[name]
    device = do.device
    lengths, heads = shape.lengths, shape.heads
    cu_seqlens = inputs["cu_seqlens"]
    tile_base = tile_bases(cu_seqlens) if cu_seqlens is not None else None
    spec = WorkspaceSpec(heads=heads, tiles=tiles_per_head(shape.batch * shape.seq_len, len(lengths), shape.varlen))
    ws = allocate_workspace(spec, device)
    prepare(inputs["q"], inputs["k"], inputs["g"], inputs["beta"], inputs["A_log"], inputs["dt_bias"], ws,
            scale=D ** -0.5, lower_bound=LOWER_BOUND, cu_seqlens=cu_seqlens, tile_base=tile_base)
    snapshots = torch.empty(block_states_shape(ws, heads, len(lengths)), dtype=torch.bfloat16, device=device)
    dv, du = torch.empty_like(do), torch.empty_like(do)
    dh0 = torch.empty((len(lengths), heads, D, D), dtype=torch.float32, device=device)

    auto = ScanVariant.choose_vsplit(len(lengths), heads, sm_count(device.index or 0))
    steps = tile_steps(lengths)
    traffic = scan_traffic(lengths, heads, dht_itemsize=dht.element_size())
    rows = []
    for vsplit in sorted(set(vsplits) | {auto}):

        def launch(vsplit=vsplit):
            bwd_scan(do, ws, dv, du, snapshots, cu_seqlens=cu_seqlens, tile_base=tile_base, dht=dht, dh0=dh0,
                     vsplit=vsplit)

        row = dict(kind="scan", vsplit=vsplit, auto=vsplit == auto, ctas=len(lengths) * heads * vsplit,
                   steps=steps, traffic=traffic, ms=None, timing=None, note="")
        rows.append(_time_scan_row(row, launch, f"{name} Kernel A vsplit={vsplit}", warmup, rep))
    rows.append(time_fla_density_scan(name, rows, launch_kwargs=dict(
        ws=ws, cu_seqlens=cu_seqlens, tile_base=tile_base, dht=dht, dh0=dh0), do=do, warmup=warmup, rep=rep))
    segmented = time_segmented_scan(name, inputs, do, dht, warmup, rep)
    if segmented is not None:
        for row in rows:
            row["auto"] = False
        rows.append(segmented)
    rows.append(time_training_forward(name, inputs, ws, tile_base, warmup, rep))
    return rows


def time_fla_density_scan(name: str, rows: list[dict], *, launch_kwargs: dict, do: torch.Tensor, warmup: int,
                          rep: int) -> dict:
    """The "FLA's density" row (the module docstring): Kernel A at the fastest timed V-split of ``rows`` with
    one snapshot per :data:`FLA_DENSITY_TILES` tiles, into its own snapshot buffer."""
    from cute_kda.ops.bwd_scan import bwd_scan

    shape = SHAPES[name]
    lengths, heads = shape.lengths, shape.heads
    timed = [r for r in rows if r["ms"] is not None]
    vsplit = min(timed, key=lambda r: r["ms"])["vsplit"] if timed else 1
    row = dict(kind="scan_fla_density", vsplit=vsplit, auto=False, ctas=len(lengths) * heads * vsplit,
               steps=tile_steps(lengths), ms=None, timing=None, note="",
               traffic=scan_traffic(lengths, heads, dht_itemsize=launch_kwargs["dht"].element_size(),
                                    every=FLA_DENSITY_TILES))
    snapshots = torch.empty(block_states_shape(launch_kwargs["ws"], heads, len(lengths), FLA_DENSITY_TILES),
                            dtype=torch.bfloat16, device=do.device)
    dv, du = torch.empty_like(do), torch.empty_like(do)

    def launch():
        bwd_scan(do, dv=dv, du=du, snapshots=snapshots, vsplit=vsplit, snapshot_every=FLA_DENSITY_TILES,
                 **launch_kwargs)

    return _time_scan_row(row, launch, f"{name} Kernel A vsplit={vsplit}, FLA's density", warmup, rep)


def time_segmented_scan(name: str, inputs: dict, do: torch.Tensor, dht: torch.Tensor, warmup: int,
                        rep: int) -> dict | None:
    """The row of the backward's segmented scan (the module docstring), None where the API does not split."""
    from cute_kda.call import resolve
    from cute_kda.executors.stages import KERNELS, packed

    shape = SHAPES[name]
    call = resolve(*(inputs[n] for n in ("q", "k", "v", "g", "beta")), A_log=inputs["A_log"],
                   dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND, initial_state=inputs["initial_state"],
                   cu_seqlens=inputs["cu_seqlens"], training=True)
    seg = call.options.segmentation
    if seg is None:
        return None
    x, options = packed(call.inputs, call.options)
    saved = KERNELS.forward(x, options).saved
    packed_do = do.view(x.v.shape)

    def launch():
        KERNELS.scan(x, options, saved, packed_do, dht, torch.float32)

    steps = seg.length // CHUNK
    row = dict(kind="scan", vsplit=1, segments=seg.per_seq, auto=True, ctas=seg.count * shape.heads, steps=steps,
               traffic=scan_traffic(shape.lengths, shape.heads, dht_itemsize=dht.element_size()), ms=None,
               timing=None, note="")
    return _time_scan_row(row, launch, f"{name} Kernel A, {seg.per_seq} segments", warmup, rep)


def scan_label(row: dict) -> str:
    """The kernel column of a Kernel A row."""
    if row.get("segments"):
        return f"Kernel A, {row['segments']} segments × V-split {row['vsplit']} (2 passes + combine)"
    if row["kind"] == "scan_fla_density":
        return (f"Kernel A, V-split {row['vsplit']}, FLA's density "
                f"(a snapshot per {FLA_DENSITY_TILES} tiles; not in the step)")
    return f"Kernel A, V-split {row['vsplit']}"


def time_training_forward(name: str, inputs: dict, ws, tile_base, warmup: int, rep: int) -> dict:
    """K2 alone (fp32 state in and out, the heuristic's V-split) as the inference and the training variant."""
    from cute_kda.ops.recurrence import recurrence

    shape = SHAPES[name]
    v, cu_seqlens, init = inputs["v"], inputs["cu_seqlens"], inputs["initial_state"]
    out, final = torch.empty_like(v), torch.empty_like(init)
    checkpoints = torch.empty(block_states_shape(ws, shape.heads, len(shape.lengths)), dtype=torch.bfloat16,
                              device=v.device)
    row = dict(kind="train", checkpoint_bytes=snapshot_blocks(shape.lengths) * shape.heads * D * D * 2, note="")
    try:
        for key, saved in (("inference_ms", None), ("training_ms", checkpoints)):

            def launch(saved=saved):
                recurrence(v, ws, out, cu_seqlens=cu_seqlens, tile_base=tile_base, initial_state=init,
                           final_state=final, checkpoints=saved)

            launch()
            torch.cuda.synchronize()
            row[key], row["timing"] = _time(launch, warmup, rep)
        print(f"{name} K2 inference {row['inference_ms']:.3f} ms, training {row['training_ms']:.3f} ms",
              file=sys.stderr)
    except Exception as error:
        traceback.print_exc()
        row["note"] = f"error: {_first_line(error)}"
    return row


def capture_fla_dhu_call(inputs: dict, do: torch.Tensor, dht: torch.Tensor):
    """(dhu, args, kwargs): FLA's ``chunk_gated_delta_rule_bwd_dhu`` and the arguments FLA's KDA backward
    passes it, from one ``chunk_kda`` forward + backward on ``inputs`` / dO / dht stopped at that call.

    Raises ImportError when FLA (or that function in ``fla.ops.kda.chunk_bwd``) is missing.
    """
    import fla.ops.kda.chunk_bwd as fla_kda_bwd
    from fla.ops.kda import chunk_kda

    dhu = fla_kda_bwd.chunk_gated_delta_rule_bwd_dhu  # the name chunk_kda_bwd calls (fla-core 0.6.0)
    seen: dict = {}

    class _Stop(Exception):
        """Raised by the spy: the rest of FLA's backward is not needed."""

    def spy(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Stop

    tensors = [inputs[name].detach().clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")]
    kwargs = dict(
        scale=D ** -0.5, initial_state=inputs["initial_state"], output_final_state=True, use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
        A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], state_v_first=True, cu_seqlens=inputs["cu_seqlens"],
    )
    fla_kda_bwd.chunk_gated_delta_rule_bwd_dhu = spy
    try:
        with torch.enable_grad():
            o, ht = chunk_kda(*tensors, **kwargs)
            try:
                torch.autograd.backward((o, ht), (do, dht.to(ht.dtype)))
            except Exception:  # _Stop, possibly wrapped by the autograd engine
                if "kwargs" not in seen:
                    raise
    finally:
        fla_kda_bwd.chunk_gated_delta_rule_bwd_dhu = dhu
    if "kwargs" not in seen:
        raise RuntimeError("FLA's chunk_kda backward did not call chunk_gated_delta_rule_bwd_dhu")
    return dhu, seen["args"], seen["kwargs"]


def describe_call(args: tuple, kwargs: dict) -> str:
    """``name=dtype[shape]`` / ``name=value`` for every argument of a call, for the record."""
    def show(value) -> str:
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        return f"{value:.6g}" if isinstance(value, float) else repr(value)

    return ", ".join([show(a) for a in args] + [f"{name}={show(value)}" for name, value in kwargs.items()])


def _fla_config() -> tuple[int | None, str]:
    """(BV, "BV …, … warps, … stages") of the dhu kernel's last autotune pick; (None, "") when unreadable."""
    try:
        from fla.ops.common import chunk_delta_h

        config = chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64.best_config
        block_v = int(config.kwargs["BV"])
        return block_v, f"BV {block_v}, {config.num_warps} warps, {config.num_stages} stages"
    except Exception:
        return None, ""


def time_fla(name: str, inputs: dict, do: torch.Tensor, dht: torch.Tensor, warmup: int, rep: int) -> dict:
    """The row of FLA's reverse-scan kernel on the same problem ('not installed' / error in ``note``)."""
    shape = SHAPES[name]
    lengths, heads = shape.lengths, shape.heads
    row = dict(kind="fla", ctas=None, steps=tile_steps(lengths), ms=None, timing=None, note="", call="",
               traffic=fla_dhu_traffic(lengths, heads), reference=FLA_REFERENCE_MS.get(name))
    try:
        dhu, args, kwargs = capture_fla_dhu_call(inputs, do, dht)
    except ImportError as error:
        print(f"FLA not importable, skipped: {error}", file=sys.stderr)
        row["note"] = "not installed"
        return row
    except Exception as error:
        traceback.print_exc()
        row["note"] = f"error: {_first_line(error)}"
        return row
    row["call"] = describe_call(args, kwargs)
    print(f"{name} FLA call: chunk_gated_delta_rule_bwd_dhu({row['call']})", file=sys.stderr)

    def launch():
        return dhu(*args, **kwargs)

    try:
        launch()  # autotune outside the timing
        torch.cuda.synchronize()
        block_v, config = _fla_config()
        if block_v:
            row["ctas"] = -(-D // block_v) * len(lengths) * heads  # grid: cdiv(V, BV) · N · H
            row["note"] = config
        row["ms"], row["timing"] = _time(launch, warmup, rep)
        print(f"{name} FLA dhu: {row['ms']:.3f} ms ({config})", file=sys.stderr)
    except Exception as error:
        traceback.print_exc()
        row["note"] = f"error: {_first_line(error)}"
    del args, kwargs
    return row


def bench_shape(name: str, vsplits: tuple[int, ...], peers: str, warmup: int, rep: int) -> dict:
    shape = SHAPES[name]
    device = torch.device("cuda")
    inputs = make_inputs(shape, device)
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(inputs["v"].shape, generator=gen, device=device).to(torch.bfloat16)
    dht = 0.1 * torch.randn((len(shape.lengths), shape.heads, D, D), generator=gen, device=device)
    with torch.no_grad():
        scan_rows = time_scan(name, inputs, do, dht, vsplits, warmup, rep)
    torch.cuda.empty_cache()
    if peers == "fla":
        fla_row = time_fla(name, inputs, do, dht, warmup, rep)
    else:
        fla_row = dict(kind="fla", note="skipped (--peers none)", ms=None, call="",
                       reference=FLA_REFERENCE_MS.get(name))
    del inputs, do, dht
    torch.cuda.empty_cache()
    return dict(shape=name, scan=scan_rows, fla=fla_row)


# ---------------------------------------------------------------------------------------------
# report


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}" if ours is not None and theirs else "—"


def _fla_cell(fla: dict) -> str:
    """FLA's measured ms, or why there is none."""
    if fla["ms"] is not None:
        return f"{fla['ms']:.3f}"
    return fla["note"] or "—"


def detail_table(results: list[dict]) -> str:
    head = ["shape", "kernel", "CTAs", "16-token steps", "median ms", "µs / step", "MB read", "MB written",
            "GB/s", "timing", "ms / FLA ms"]
    rows = []
    for result in results:
        fla = result["fla"]
        for r in result["scan"]:
            if r["kind"] not in ("scan", "scan_fla_density"):
                continue
            label = f"**{scan_label(r)}** (auto)" if r["auto"] else scan_label(r)
            ms = r["ms"]
            rows.append([
                result["shape"], label, str(r["ctas"]), str(r["steps"]), _ms(ms) if ms is not None else r["note"],
                "—" if ms is None else f"{us_per_step(ms, r['steps']):.2f}", f"{r['traffic'].read / 1e6:.1f}",
                f"{r['traffic'].written / 1e6:.1f}", "—" if ms is None else f"{gb_per_s(r['traffic'].total, ms):.0f}",
                r["timing"] or "—", _ratio(ms, fla["ms"]),
            ])
        traffic, ms = fla.get("traffic"), fla["ms"]
        label = "FLA bwd_dhu" + (f" ({fla['note']})" if ms is not None and fla["note"] else "")
        rows.append([
            result["shape"], label, str(fla.get("ctas") or "—"), str(fla.get("steps", "—")), _fla_cell(fla),
            "—" if ms is None else f"{us_per_step(ms, fla['steps']):.2f}",
            "—" if traffic is None else f"{traffic.read / 1e6:.1f}",
            "—" if traffic is None else f"{traffic.written / 1e6:.1f}",
            "—" if ms is None else f"{gb_per_s(traffic.total, ms):.0f}", fla.get("timing") or "—",
            "1.00" if ms else "—",
        ])
    return markdown_table(head, rows)


def _split(row: dict | None) -> str:
    """A row's split: its V-split, with its segments when it has them."""
    if row is None:
        return "—"
    return f"{row['segments']} seg × {row['vsplit']}" if row.get("segments") else str(row["vsplit"])


def summary_table(results: list[dict]) -> str:
    head = ["shape", "auto split", "Kernel A auto ms", "best split", "Kernel A best ms", "FLA bwd_dhu ms",
            "FLA ms, issue 9 (profiler)", "best / FLA", "auto / FLA", "FLA's density ms", "FLA's density / FLA",
            f"bytes floor ms at {COPY_CEILING_TBPS} TB/s, Kernel A / FLA's density / FLA"]
    rows = []
    for result in results:
        scan = [r for r in result["scan"] if r["kind"] == "scan"]
        timed = [r for r in scan if r["ms"] is not None]
        auto = next((r for r in scan if r["auto"]), None)
        best = min(timed, key=lambda r: r["ms"], default=None)
        density = next((r for r in result["scan"] if r["kind"] == "scan_fla_density"), None)
        density_ms = density["ms"] if density else None
        fla = result["fla"]
        shape = SHAPES[result["shape"]]
        floors = (floor_ms(scan_traffic(shape.lengths, shape.heads).total),
                  floor_ms(scan_traffic(shape.lengths, shape.heads, every=FLA_DENSITY_TILES).total),
                  floor_ms(fla_dhu_traffic(shape.lengths, shape.heads).total))
        rows.append([
            result["shape"], _split(auto), _ms(auto["ms"]) if auto else "—",
            _split(best), _ms(best["ms"]) if best else "—", _fla_cell(fla),
            f"{fla['reference']:.2f}" if fla.get("reference") else "—",
            _ratio(best["ms"] if best else None, fla["ms"]), _ratio(auto["ms"] if auto else None, fla["ms"]),
            _ms(density_ms), _ratio(density_ms, fla["ms"]), " / ".join(f"{f:.3f}" for f in floors),
        ])
    return markdown_table(head, rows)


def training_table(results: list[dict]) -> str:
    head = ["shape", "K2 inference ms", "K2 training ms", "extra ms", "extra %", "checkpoints MB", "timing"]
    rows = []
    for result in results:
        for r in result["scan"]:
            if r["kind"] != "train":
                continue
            if r["note"]:
                rows.append([result["shape"], r["note"], "—", "—", "—", f"{r['checkpoint_bytes'] / 1e6:.1f}", "—"])
                continue
            extra = r["training_ms"] - r["inference_ms"]
            rows.append([result["shape"], _ms(r["inference_ms"]), _ms(r["training_ms"]), f"{extra:+.3f}",
                         f"{100 * extra / r['inference_ms']:+.1f}", f"{r['checkpoint_bytes'] / 1e6:.1f}", r["timing"]])
    return markdown_table(head, rows)


def report(results: list[dict], command: str, env: str) -> str:
    calls = [f"- {r['shape']}: `chunk_gated_delta_rule_bwd_dhu({r['fla']['call']})`" for r in results
             if r["fla"].get("call")]
    parts = [
        "# Backward Kernel A (reverse state-gradient scan) vs FLA's chunk_gated_delta_rule_bwd_dhu",
        f"Command: `{command}`",
        f"{env} · D={D}, dO bf16, dht fp32 in, dh0 fp32 out, workspace from K1, lower_bound={LOWER_BOUND}; "
        "ratios are cute_kda ms / FLA ms (< 1: cute_kda faster)",
        summary_table(results),
        detail_table(results),
        "Training forward: K2 alone on the same workspace (fp32 state in/out, the heuristic's V-split), "
        "the inference variant and the training variant that also keeps the bf16 state entering every "
        f"{_checkpoint_block()} for the backward:",
        training_table(results),
        "Steps are 16-token steps of the longest sequence for both kernels (FLA steps over 64-token chunks); "
        "bytes are unique bytes per call (see the script's docstring); GB/s = (read + written) / time; the bytes "
        f"floor is (read + written) at the {COPY_CEILING_TBPS} TB/s copy ceiling.",
    ]
    if calls:
        parts.append("FLA's calls, as its KDA backward made them:\n\n" + "\n".join(calls))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_bwd needs a CUDA GPU (Hopper): nothing timed")
    try:
        import cute_kda.ops.bwd_scan  # noqa: F401
    except ImportError as error:
        sys.exit(f"bench_bwd: Kernel A's launcher cute_kda.ops.bwd_scan does not import ({error})")

    out = args.out or default_out()
    command = shlex.join(["python", *(sys.argv if argv is None else ["benchmarks/bench_bwd.py", *argv])])
    env = environment("cutlass", "fla", "triton", labels={"cutlass": "cutlass-dsl"})
    results: list[dict] = []
    text = report(results, command, env)
    for name in args.shapes:
        results.append(bench_shape(name, args.vsplits, args.peers, args.warmup, args.rep))
        text = report(results, command, env)
        save(text, out)  # after every shape
    publish(text, out)


if __name__ == "__main__":
    main()
