"""Where a decode / verify variant's time goes, from its machine code (CPU only; docs/perf-log.md D6).

Compiles a :class:`cute_kda.kernels.decode.DecodeVariant` for sm_90a, disassembles it (``cuobjdump``: ``$CUOBJDUMP``,
``PATH``, or the copy Triton's package carries) and reads the main path (every token run, the slow-path calls of
the fp32 division / square root not taken). Reports, per warp: dynamic instructions and their mix, XU work (MUFU and
conversions, 16 lanes a cycle an SM: 8 cycles a warp instruction on its scheduler), and three times from a model of
one scheduler issuing in order from the control codes ptxas wrote (each instruction's stall count, the scoreboards it
sets and waits on):

- **math**: the instructions after the last global load, for 1, 2, 3 warps sharing a scheduler (loads answered);
- **dataflow**: the longest register dependence chain of that part (any order the registers allow);
- **% of the copy**: ``--latency`` cycles a global load, each of ``--warps`` warps a scheduler running the whole
  path again and again (a new CTA as one ends): the state bytes they move a cycle against a copy's rate
  (``--copy-gbs``, at ``--clock-ghz`` and 528 schedulers). Over 100 %: the kernel would outrun the copy, i.e. the
  DRAM, not the SM, is the bound.

Latencies (cycles): SHFL 24, MUFU 18, S2R / LDC 20, fixed-latency ALU 4; the shuffle unit takes a warp
instruction every 4 cycles a scheduler (32 lanes a cycle an SM). These are estimates, not measurements: the model
ranks schedules; the calibration against a measured row is the ``--latency`` that reproduces it.

    python benchmarks/sass_issue_model.py --dtype bf16 --latency 2000,2200,3000
    python benchmarks/sass_issue_model.py --dtype bf16 --split-prep --warps 3
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

LATENCY = {"SHFL": 24, "MUFU": 18, "S2R": 20, "LDC": 20, "I2F": 18, "F2I": 18}
FIXED = 4
XU_CYCLES, SHFL_CYCLES, READ_CYCLES = 8, 4, 4
SCHEDULERS = 132 * 4
NO_DESTINATION = ("STG", "BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "NOP", "WARPSYNC")


def cuobjdump() -> str:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not found:
        try:
            import triton
        except ImportError:
            triton = None
        if triton is not None:
            bundled = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
            found = next(iter(glob.glob(bundled)), None)
    if not found:
        raise FileNotFoundError("cuobjdump not found: set CUOBJDUMP, or install triton")
    return found


def sass_of(variant) -> tuple[str, int]:
    """The variant's SASS and its registers a thread (ptxas)."""
    from cute_kda.compile_report import compile_with_report, find_ptxas
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.ops import decode as ops
    from cute_kda.ops._cache import TVM_FFI_OPTION

    _, report = compile_with_report(DecodeKernel(variant), *ops.compile_arguments(variant), options=TVM_FFI_OPTION)
    print(report.summary())
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(report.ptx)
        subprocess.run([find_ptxas(), "-arch=sm_90a", "-o", cubin, ptx], check=True)
        sass = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return sass, report.kernels[0].registers


def instructions(sass: str) -> list[tuple]:
    """(address, predicate, opcode, text, stall, write scoreboard, read scoreboard, wait mask) of each instruction
    (the control bits of the upper word: stall [41:44], write [46:48], read [49:51], wait [52:57]; 7: none)."""
    lines = sass.splitlines()
    out = []
    for k, line in enumerate(lines):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);\s+/\* 0x[0-9a-f]{16} \*/", line)
        if not m:
            continue
        high = int(re.search(r"/\* 0x([0-9a-f]{16}) \*/", lines[k + 1]).group(1), 16)
        text, predicate = m.group(2).strip(), ""
        guarded = re.match(r"(@!?U?P[T0-9]+)\s+(.*)", text)
        if guarded:
            predicate, text = guarded.groups()
        out.append((int(m.group(1), 16), predicate, text.split()[0], text, high >> 41 & 0xF, high >> 46 & 7,
                    high >> 49 & 7, high >> 52 & 0x3F))
    return out


def main_path(code: list[tuple]) -> list[tuple]:
    """The instructions a warp of a listed slot runs: predicated blocks run, a short forward branch over a slow-path
    CALL taken, the padding row's branch (a long one) not."""
    at = {x[0]: k for k, x in enumerate(code)}
    k, path = 0, []
    while k < len(code):
        address, predicate, op, text = code[k][:4]
        path.append(code[k])
        if op == "EXIT" and not predicate:
            break
        if op == "BRA":
            target = int(re.search(r"0x([0-9a-f]+)", text).group(1), 16)
            skipped = [x for x in code if address < x[0] < target]
            if not predicate or (len(skipped) < 12 and any(x[2].startswith("CALL") for x in skipped)):
                k = at[target]
                continue
        k += 1
    return path


def pipe(op: str):
    if op.startswith(("MUFU", "F2FP", "F2F", "I2F", "F2I")):
        return "xu"
    return "shfl" if op.startswith("SHFL") else None


def latency(op: str, memory: int) -> int:
    if op.startswith("LDG"):
        return memory
    return next((cycles for prefix, cycles in LATENCY.items() if op.startswith(prefix)), 20)


def schedule(stream: list[tuple], warps: int, memory: int = 0, horizon: int | None = None) -> float:
    """In-order issue of ``warps`` warps on one scheduler, the oldest ready warp first. ``horizon`` None: one pass
    each, returns the cycles; else each warp restarts its stream as it ends, returns the passes a cycle."""
    pc, ready = [0] * warps, [w * 997 % 3000 if horizon else 0 for w in range(warps)]
    boards = [[0] * 6 for _ in range(warps)]
    busy = {"xu": 0, "shfl": 0}
    t = last = passes = 0
    while (t < horizon) if horizon else any(p < len(stream) for p in pc):
        chosen = None
        for w in range(warps):
            if pc[w] >= len(stream):
                continue
            x = stream[pc[w]]
            when = max([ready[w]] + [boards[w][b] for b in range(6) if x[7] >> b & 1])
            if pipe(x[2]):
                when = max(when, busy[pipe(x[2])])
            if when <= t:
                chosen = w
                break
        if chosen is None:
            t += 1
            continue
        x = stream[pc[chosen]]
        if x[5] != 7:
            boards[chosen][x[5]] = t + latency(x[2], memory)
        if x[6] != 7:
            boards[chosen][x[6]] = t + READ_CYCLES
        if pipe(x[2]):
            busy[pipe(x[2])] = t + (XU_CYCLES if pipe(x[2]) == "xu" else SHFL_CYCLES)
        ready[chosen], last = t + max(1, x[4]), t
        pc[chosen] += 1
        if horizon and pc[chosen] == len(stream):
            pc[chosen], boards[chosen], passes = 0, [0] * 6, passes + 1
        t += 1
    return passes / horizon if horizon else last + 1


def registers(token: str) -> list[str]:
    found = []
    for m in re.finditer(r"\b(R|P|UR|UP)(\d+)(\.64|\.128)?", token):
        width = {None: 1, ".64": 2, ".128": 4}[m.group(3)] if m.group(1) == "R" else 1
        found += [f"{m.group(1)}{int(m.group(2)) + i}" for i in range(width)]
    return found


def dataflow(stream: list[tuple]) -> int:
    """The longest read-after-write chain (fixed latencies, loads answered)."""
    ready, longest = {}, 0
    for _, predicate, op, text, *_ in stream:
        args = [a.strip() for a in text[len(op):].split(",")]
        guard = [predicate.lstrip("@!")] if predicate else []
        if op.startswith(NO_DESTINATION):
            written, read = [], sum(map(registers, args), []) + guard
        elif op.startswith("SHFL"):
            written, read = registers(args[1]), sum(map(registers, args[2:]), []) + guard
        else:
            written, read = registers(args[0]), sum(map(registers, args[1:]), []) + guard
        done = max([ready.get(r, 0) for r in read] or [0])
        done += latency(op, 0) if pipe(op) or op.startswith(tuple(LATENCY)) else FIXED
        ready.update(dict.fromkeys(written, done))
        longest = max(longest, done)
    return longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--decode", action="store_true", help="a fixed-length decode, not a verify")
    parser.add_argument("--vsplit", type=int, default=4)
    parser.add_argument("--split-prep", action="store_true", help="the split_prep variant instead of prefetch")
    parser.add_argument("--warps", type=float, default=None,
                        help="warps a scheduler for the %% of the copy (default: what the registers allow; a fraction "
                             "averages the two whole counts around it)")
    parser.add_argument("--latency", type=lambda s: [int(x) for x in s.split(",")], default=[1500, 2200, 3000, 4000],
                        help="cycles a global load, comma separated")
    parser.add_argument("--copy-gbs", type=float, default=None, help="the copy's GB/s (default 4143 bf16, 4196 fp32)")
    parser.add_argument("--clock-ghz", type=float, default=1.98)
    args = parser.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(state_dtype=args.dtype, tokens=args.tokens, verify=not args.decode, vsplit=args.vsplit,
                            prefetch=not args.split_prep, split_prep=args.split_prep)
    sass, regs = sass_of(variant)
    path = main_path(instructions(sass))
    last_load = max(k for k, x in enumerate(path) if x[2].startswith("LDG"))
    math = path[last_load + 1:]
    mix = collections.Counter(x[2] for x in path)
    xu = sum(n for op, n in mix.items() if pipe(op) == "xu")
    print(f"{variant}\nper warp: {len(path)} instructions on the main path, {len(math)} after the last load; "
          f"XU {xu} ({xu * XU_CYCLES} cycles); top: {mix.most_common(12)}")
    print("math, loads answered: " + ", ".join(f"{w} warp(s) {schedule(math, w):.0f} cycles" for w in (1, 2, 3))
          + f"; dataflow {dataflow(math)} cycles")
    cta_warps = variant.thread_map.threads // 32
    ctas = 65536 // (-(-regs // 8) * 8 * 32 * cta_warps)  # the register file; allocation in 8-register steps
    warps = args.warps or ctas * cta_warps / 4
    print(f"{regs} registers: {ctas} CTAs of {cta_warps} warp(s) an SM, {warps:g} warps a scheduler")
    state = 2 if args.dtype == "bf16" else 4
    moved = 32 * variant.thread_map.rows * 16 * state * (1 + (1 if args.decode else args.tokens))  # bytes a warp
    copy = (args.copy_gbs or (4143 if args.dtype == "bf16" else 4196)) / SCHEDULERS / args.clock_ghz  # B a cycle
    whole = sorted({int(warps), -(-int(warps * 2) // 2)})
    for memory in args.latency:
        rate = sum(schedule(path, w, memory, horizon=400_000) for w in whole) / len(whole) * moved / copy
        print(f"loads answered after {memory} cycles: {100 * rate:.0f} % of the copy")


if __name__ == "__main__":
    main()
