"""Helpers shared by ``benchmarks/*.py`` and ``examples/demo.py``: the median GPU time of a callable,
the command-line options of a timed run, the environment line at the head of a result, and the
markdown table it prints and writes.

Importing this needs no GPU; :func:`event_median_ms`, :func:`median_ms`, :func:`graph_median_ms` and
:func:`environment` need one when called.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 << 20  # written between repetitions: several times the H200's 50 MiB L2


def event_median_ms(fn: Callable[[], object], reps: int, warmup_calls: int = 3, flush_l2: bool = False) -> float:
    """Median of ``reps`` CUDA-event timings (ms) of ``fn`` on the current stream.

    ``warmup_calls`` untimed calls come first. ``flush_l2``: overwrite :data:`L2_FLUSH_BYTES` before
    each repetition, outside the timed region, so every repetition starts from a cold L2.
    """
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if flush_l2 else None
    for _ in range(warmup_calls):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` on the current stream, L2 cleared before each repetition.

    Triton's ``do_bench`` (``warmup`` and ``rep`` are its milliseconds of warm-up and of timed
    repetitions) where Triton imports; otherwise :func:`event_median_ms` with ``max(rep // 5, 10)``
    repetitions and the L2 flush.
    """
    try:
        from triton.testing import do_bench
    except ImportError:
        return event_median_ms(fn, reps=max(rep // 5, 10), flush_l2=True)
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float | None:
    """:func:`median_ms` of replaying a CUDA graph of one ``fn()`` call: device time without the host's
    launch cost. None (and a line on stderr) when ``fn`` cannot be captured."""
    import sys

    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        print(f"CUDA graph capture failed: {str(error).splitlines()[0]}", file=sys.stderr)
        return None
    return median_ms(graph.replay, warmup, rep)


def host_round_us(fn: Callable[[], object], calls: int, rounds: int) -> list[float]:
    """Host µs per call of ``fn`` in each of ``rounds`` rounds of ``calls`` back-to-back calls (no
    synchronisation inside a round; the GPU drained before each round and after the last)."""
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append(1e6 * (time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return per_call


# The library's module switches a run can flip (the command line in the report records them): flag → (module,
# attribute, the value the flag sets, what it does).
SWITCHES = {
    "--padded-training": ("cute_kda.call", "NATIVE_TRAINING", False,
                          "--head-dim 64 padded to 128, not on the backward kernels built for 64 (perf-log P3)"),
    "--no-gate-ahead": ("cute_kda.ops.bwd_grads", "GATE_AHEAD", False,
                        "Kernel B's gate backward without the raw gate's one-burst load (perf-log B5)"),
    "--split-load": ("cute_kda.ops.bwd_grads", "SPLIT_LOAD", True,
                     "Kernel B's state images behind their own barrier (perf-log B6)"),
    "--split-rows": ("cute_kda.ops.bwd_grads", "SPLIT_ROWS", True,
                     "the safe gate backward's rows on all 8 warps (perf-log B7)"),
    "--no-slopes-ahead": ("cute_kda.ops.bwd_grads", "SLOPES_AHEAD", False,
                          "the safe gate backward's rows' x and σ'(x) formed inside its row loop (perf-log B8)"),
    "--fp16-grad-stores": ("cute_kda.executors.training", "FP16_GRAD_STORES", True,
                           "--dtype fp16: Kernel A stores dv, Kernel B dq, dk, dg in fp16 themselves (perf-log F2)"),
    "--fp16-copy-backward": ("cute_kda.executors.training", "FP16_NATIVE_BACKWARD", False,
                             "--dtype fp16: the backward on bf16 copies of q, k, v, g, not on the fp16 inputs "
                             "(perf-log F3; with --fp16-grad-stores F2)"),
    "--no-states-only-passes": ("cute_kda.executors.stages", "STATES_ONLY_PASSES", False,
                                "K2's passes whose o nobody reads (the backward's recomputation, per tile or on "
                                "pairs, a segmented call's segment-state passes) with o, into a scratch "
                                "(perf-log v13)"),
    "--no-pair-training": ("cute_kda.executors.stages", "PAIR_TRAINING", False,
                           "a recomputing backward per tile where its rule would take the two-tile form (perf-log W2)"),
    "--safe-pair-training": ("cute_kda.executors.stages", "PAIR_TRAINING_SCHEMES", ("safe", "per_head"),
                             "the safe gate's recomputing backward in the two-tile form too, where its rule takes the "
                             "V-split (perf-log W2a)"),
    "--no-partner-fields": ("cute_kda.executors.stages", "PARTNER_FIELDS", False,
                            "a per-head gate's recomputation in the two-tile form runs K1 again for the pair "
                            "partners' fields instead of its pair K1 writing them (perf-log W2b)"),
    "--no-split-recompute": ("cute_kda.executors.stages", "SPLIT_RECOMPUTE", False,
                             "a recomputing call of one sequence whose chains leave SMs idle recomputes unsplit, not "
                             "its segments side by side (perf-log R1)"),
    "--no-group-sum": ("cute_kda.ops.bwd_grads", "GROUP_SUM", False,
                       "grouped value heads in pairs summed after Kernel B, not by it (perf-log GDN6)"),
    "--no-fp16-do-kernel": ("cute_kda.executors.training", "FP16_DO_KERNEL", False,
                            "--dtype fp16: dO rounded to bf16 by torch's cast, not by cute_kda's streaming kernel "
                            "(perf-log F4)"),
}


def add_switches(parser: argparse.ArgumentParser, flags: tuple[str, ...]) -> None:
    """One store-true option for each of ``flags`` (keys of :data:`SWITCHES`), its help what the switch does."""
    for flag in flags:
        module, name, _, text = SWITCHES[flag]
        parser.add_argument(flag, action="store_true", help=f"{text} ({module}.{name})")


def apply_switches(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """Set the library switch of each of ``flags`` the command line gave (:func:`add_switches`)."""
    for flag in flags:
        if getattr(args, flag[2:].replace("-", "_")):
            module, name, value, _ = SWITCHES[flag]
            setattr(importlib.import_module(module), name, value)


def add_run_arguments(parser: argparse.ArgumentParser, shapes: dict | None = None) -> None:
    """``--out`` (also write the table to a file), ``--warmup`` / ``--rep`` (:func:`median_ms`'s times)
    and, given ``shapes``, ``--shapes`` (a comma-separated subset of its keys, all by default)."""
    if shapes is not None:
        parser.add_argument("--shapes", type=functools.partial(_shape_names, shapes), default=list(shapes),
                            help=f"comma-separated subset of {', '.join(shapes)}")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")


def _shape_names(shapes: dict, listed: str) -> list[str]:
    names = [name.strip() for name in listed.split(",") if name.strip()]
    unknown = [name for name in names if name not in shapes]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown}; choose from {list(shapes)}")
    return names


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table of ``head`` and ``rows`` (cells already formatted)."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head), *(line(cells) for cells in rows)])


def environment(*modules: str, labels: dict[str, str] | None = None) -> str:
    """``date · GPU (SMs) · torch …, <module> <version>… · Python …`` for the head of a result.

    ``modules``: whose ``__version__`` to show, each under its name or ``labels[name]``; those that
    do not import are left out.
    """
    props = torch.cuda.get_device_properties(0)
    shown = [f"torch {torch.__version__}"]
    for module in modules:
        try:
            version = getattr(importlib.import_module(module), "__version__", "?")
        except ImportError:
            continue
        shown.append(f"{(labels or {}).get(module, module)} {version}")
    return (f"{datetime.date.today()} · {props.name} ({props.multi_processor_count} SMs) · "
            f"{', '.join(shown)} · Python {platform.python_version()}")


def save(text: str, out: str) -> None:
    """Write ``text`` to the file ``out``, creating its folder (a script may save after every shape, so a
    run cut short keeps what it measured)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)


def publish(text: str, out: str | None) -> None:
    """Print ``text``; also :func:`save` it to ``out`` when given."""
    print(text)
    if out:
        save(text, out)


def checkout_commit(root: Path) -> str:
    """``$CUTE_KDA_COMMIT`` (a device call's tree has no git), else ``root``'s short HEAD, else "unknown"."""
    if os.environ.get("CUTE_KDA_COMMIT"):
        return os.environ["CUTE_KDA_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def dated_out(stem: str, results: Path) -> str:
    """``$OUT/<stem>-<date>.md``, else in ``results`` (a device call writes under ``$OUT``)."""
    return os.path.join(os.environ.get("OUT") or str(results), f"{stem}-{datetime.date.today()}.md")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

