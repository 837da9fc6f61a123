"""Where a decode / verify variant's or Kernel B's time goes, from its machine code (CPU only; docs/perf-log.md D6,
B8).

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

``--grads``: the safe fixed-length Kernel B (``--cta-warps``, its switches). Its warps run different code (warp 0
issues the loads, warps 4-7 skip the channel phases, ...): the first run lists the predicated branches, and
``--roles`` says which each warp takes; each role's path is then cut at its ``BAR.SYNC`` into phases (instructions,
one warp alone, the dataflow path), and :func:`sm_model` runs the CTAs an SM holds with barriers, pipes, the
shared-memory port and the loads' queue at the SM's share of ``--copy-gbs``: µs a CTA wave and each phase's mean
length. Calibrated on the H200 at 350 cycles (docs/perf-log.md, B8).

    python benchmarks/sass_issue_model.py --dtype bf16 --latency 2000,2200,3000
    python benchmarks/sass_issue_model.py --dtype bf16 --split-prep --warps 3
    python benchmarks/sass_issue_model.py --grads --latency 350 \
        --roles 0:1/1:0,1,11,33/2-3:0,1,11,12,15,33/4-7:0,1,10,11,12,16,33
    python benchmarks/sass_issue_model.py --grads --slopes-ahead --latency 350 \
        --roles 0:1,17/1:0,1,11,17,34/2-3:0,1,11,12,15,17,34/4-7:0,1,10,11,12,16,34
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
from typing import NamedTuple

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


def sass_of(kernel, arguments: tuple) -> tuple[str, int]:
    """The SASS of ``kernel`` compiled for ``arguments`` and its registers a thread (ptxas)."""
    from cute_kda.compile_report import compile_with_report, find_ptxas
    from cute_kda.ops._cache import TVM_FFI_OPTION

    _, report = compile_with_report(kernel, *arguments, options=TVM_FFI_OPTION)
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


def main_path(code: list[tuple], taken: frozenset = frozenset()) -> list[tuple]:
    """The instructions a warp of a listed slot runs: predicated blocks run, a short forward branch over a slow-path
    CALL taken, the padding row's branch (a long one) not. ``taken``: addresses of predicated ``BRA`` / ``EXIT`` that
    this warp takes (a role's branches: :func:`role_branches`)."""
    at = {x[0]: k for k, x in enumerate(code)}
    k, path = 0, []
    while k < len(code):
        address, predicate, op, text = code[k][:4]
        path.append(code[k])
        if op == "EXIT" and (not predicate or address in taken):
            break
        if op == "BRA":
            target = int(re.search(r"0x([0-9a-f]+)", text).group(1), 16)
            skipped = [x for x in code if address < x[0] < target]
            if (not predicate or address in taken
                    or (len(skipped) < 12 and any(x[2].startswith("CALL") for x in skipped))):
                k = at[target]
                continue
        k += 1
    return path


def role_branches(code: list[tuple]) -> list[int]:
    """Addresses of the predicated branches a role may take, in program order: long forward ``BRA`` (over more than
    12 instructions) and predicated ``EXIT``; ``--roles`` names them by their index here."""
    found = []
    for address, predicate, op, text, *_ in code:
        if predicate and op == "BRA":
            target = int(re.search(r"0x([0-9a-f]+)", text).group(1), 16)
            if (target - address) // 16 > 12:
                found.append(address)
        elif predicate and op == "EXIT":
            found.append(address)
    return found


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


def smem_cycles(op: str) -> int:
    """Cycles of the SM's shared-memory port (128 B a cycle) a warp's access takes, bank conflicts aside."""
    if op.startswith(("LDSM", "STSM")):
        return {"4": 4, "2": 2}.get(op.split(".")[-1], 1)
    if op.startswith(("LDS", "STS")):
        return {"128": 4, "64": 2}.get(op.split(".")[-1], 1)
    return 0


class Cta(NamedTuple):
    """What :func:`sm_model` runs: a path a warp (``paths[w]``, warp ``w`` on scheduler ``w % 4``), the bytes its
    transaction barrier waits for (one load, issued as the CTA starts) and the bytes it stores."""

    paths: list
    load_bytes: int
    store_bytes: int = 0


def sm_model(cta: Cta, ctas: int, memory: int, bytes_per_cycle: float, horizon: int, hmma_cycles: int = 8,
             smem_latency: int = 28, barrier_latency: int = 20) -> dict:
    """One SM running ``ctas`` CTAs at a time (a new one in a slot as its last warp exits) for ``horizon`` cycles:
    four schedulers issuing in order (the oldest ready warp first) from ptxas' control codes, per scheduler the XU,
    shuffle and tensor pipes (``hmma_cycles`` an HMMA), the SM's shared-memory port (:func:`smem_cycles`; an access
    waits for its turn, its result ``smem_latency`` after), ``BAR.SYNC`` across the CTA's warps, the transaction
    barrier's wait (``SYNCS.PHASECHK``) released when the CTA's bytes have come: one queue a SM at
    ``bytes_per_cycle`` (its stores queue there too), answered ``memory`` cycles after their turn; a global load
    (``LDG``: L2 hits here) answered after ``memory``.

    Returns the CTAs finished, the cycles a CTA (``horizon`` / finished), per phase (between barriers) its mean
    duration and the issue of each warp, and each scheduler's issue share."""
    warps = len(cta.paths)
    n = warps * ctas
    pc, ready = [0] * n, [0] * n
    boards = [[0] * 6 for _ in range(n)]
    state = ["run"] * n  # run, bar, wait, done
    pipes = [{"xu": 0, "shfl": 0, "hmma": 0} for _ in range(4)]
    width = {"xu": XU_CYCLES, "shfl": SHFL_CYCLES, "hmma": hmma_cycles}
    port, queue = 0, 0.0  # shared-memory port free at, memory queue free at
    start, loaded, releases = [0] * ctas, [0] * ctas, [[] for _ in range(ctas)]
    phase_issue = [[collections.Counter() for _ in range(warps)] for _ in range(ctas)]
    phases, issue_total = collections.defaultdict(list), collections.defaultdict(lambda: [0] * warps)
    finished, issued = 0, [0] * 4

    def begin(slot: int, t: int) -> None:
        nonlocal queue
        start[slot] = t
        queue = max(queue, t) + (cta.load_bytes + cta.store_bytes) / bytes_per_cycle
        loaded[slot] = int(queue) + memory
        releases[slot] = []
        phase_issue[slot] = [collections.Counter() for _ in range(warps)]
        for w in range(warps):
            i = slot * warps + w
            pc[i], ready[i], boards[i], state[i] = 0, t, [0] * 6, "run"

    for slot in range(ctas):
        begin(slot, slot * 997 % 3000)
    for t in range(horizon):
        for s in range(4):
            for i in range(s, n, 4):
                if state[i] != "run" or ready[i] > t:
                    continue
                slot, w = divmod(i, warps)
                x = cta.paths[w][pc[i]]
                op = x[2]
                if max([boards[i][b] for b in range(6) if x[7] >> b & 1] or [0]) > t:
                    continue
                kind = pipe(op) or ("hmma" if op.startswith("HMMA") else None)
                if kind and pipes[s][kind] > t:
                    continue
                cycles = smem_cycles(op)
                if cycles and port > t + 16:
                    continue
                result = latency(op, memory)
                if kind:
                    pipes[s][kind] = t + width[kind]
                    result = 32 if kind == "hmma" else result
                if cycles:
                    port = max(port, t) + cycles
                    result = port - t + smem_latency
                if x[5] != 7:
                    boards[i][x[5]] = t + result
                if x[6] != 7:
                    boards[i][x[6]] = t + READ_CYCLES
                ready[i] = t + max(1, x[4])
                pc[i] += 1
                issued[s] += 1
                phase_issue[slot][w][len(releases[slot])] += 1
                if op.startswith("BAR.SYNC"):
                    state[i] = "bar"
                elif op.startswith("SYNCS.PHASECHK"):
                    ready[i] = max(ready[i], loaded[slot])
                elif op == "EXIT" or pc[i] == len(cta.paths[w]):
                    state[i] = "done"
                group = range(slot * warps, (slot + 1) * warps)
                if state[i] == "bar" and all(state[j] in ("bar", "done") for j in group):
                    releases[slot].append(t)
                    for j in group:
                        if state[j] == "bar":
                            state[j], ready[j] = "run", t + barrier_latency
                if all(state[j] == "done" for j in group):
                    finished += 1
                    marks = [start[slot]] + releases[slot] + [t]
                    for k, (a, b) in enumerate(zip(marks, marks[1:])):
                        phases[k].append(b - a)
                        for v in range(warps):
                            issue_total[k][v] += phase_issue[slot][v][k]
                    begin(slot, t + 1)
                break
    done = max(finished, 1)
    return dict(finished=finished, cycles_a_cta=horizon / done,
                phases={k: (sum(d) / len(d), [c / len(d) for c in issue_total[k]]) for k, d in phases.items()},
                issue_share=[c / horizon for c in issued])


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


def parse_roles(text: str) -> dict[int, frozenset]:
    """``"0:1/1:0,1,11/2-3:…"``: warps (one or a range) and the indices (:func:`role_branches`) of the branches they
    take → {warp: indices}."""
    roles = {}
    for part in text.split("/"):
        warps, taken = part.split(":")
        first, _, last = warps.partition("-")
        for warp in range(int(first), int(last or first) + 1):
            roles[warp] = frozenset(int(i) for i in taken.split(",") if i)
    return roles


def phases(path: list[tuple]) -> list[list[tuple]]:
    """A warp's path cut after each ``BAR.SYNC`` (the phases :func:`sm_model` times)."""
    cuts = [k + 1 for k, x in enumerate(path) if x[2].startswith("BAR.SYNC")]
    return [path[a:b] for a, b in zip([0] + cuts, cuts + [len(path)])]


def grads_main(args) -> None:
    """``--grads``: Kernel B (fixed length, the safe gate) per phase and per role, and :func:`sm_model`'s CTA wave."""
    import torch

    from cute_kda.layouts.bwd_grads import CTAS_PER_SM, load_bytes
    from cute_kda.layouts.smem import CHUNK, HEAD_DIM
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.variants import GradsVariant

    variant = GradsVariant(False, True, True, "safe", torch.bfloat16, False, False, args.cta_warps,
                           gate_ahead=not args.no_gate_ahead, split_load=args.split_load, split_rows=args.split_rows,
                           slopes_ahead=args.slopes_ahead)
    sass, regs = sass_of(kb.variant_kernel(variant), kb.compile_arguments(variant))
    code = instructions(sass)
    branches = role_branches(code)
    at = {x[0]: x for x in code}
    print(f"{variant}\n{regs} registers; predicated branches (index: address, instructions jumped over):\n  "
          + " ".join(f"{i}:{a:x}" + (f">{(int(re.search(r'0x([0-9a-f]+)', at[a][3]).group(1), 16) - a) // 16}"
                                     if at[a][2] == "BRA" else "EXIT") for i, a in enumerate(branches)))
    if not args.roles:
        return
    roles = parse_roles(args.roles)
    paths = [main_path(code, frozenset(branches[i] for i in roles[w])) for w in range(args.cta_warps)]
    print("per phase (after each BAR.SYNC): instructions / one warp alone, loads answered after the first latency / "
          "dataflow path")
    for w, path in enumerate(paths):
        if w and roles[w] == roles[w - 1]:
            continue
        cells = [f"{len(p)}/{schedule(p, 1, args.latency[0]):.0f}/{dataflow(p)}" for p in phases(path)]
        print(f"  warp {w}: {len(path)} instructions: " + " | ".join(cells))
    every = [x for path in paths for x in path]
    mix = collections.Counter(x[2].split(".")[0] for x in every)
    print(f"a CTA: {len(every)} warp instructions, HMMA {mix['HMMA']}, MUFU {mix['MUFU']}, shared-memory port "
          f"{sum(smem_cycles(x[2]) for x in every)} cycles")
    grads = 3 * CHUNK * HEAD_DIM * 2  # dq, dk, dg of a tile (bf16); dβ and the partials are small
    rate = (args.copy_gbs or 4300) / 132 / args.clock_ghz  # bytes a cycle an SM
    for memory in args.latency:
        got = sm_model(Cta(paths, load_bytes(HEAD_DIM), grads), CTAS_PER_SM, memory, rate, args.horizon)
        wave = got["cycles_a_cta"] * CTAS_PER_SM / args.clock_ghz / 1e3
        print(f"latency {memory}: {wave:.2f} µs a CTA wave ({got['finished']} CTAs), issue "
              + " ".join(f"{x:.2f}" for x in got["issue_share"]) + "; phases (cycles): "
              + " ".join(f"{k}:{d:.0f}" for k, (d, _) in sorted(got["phases"].items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grads", action="store_true",
                        help="Kernel B (the safe gate, fixed length) instead of decode: per phase and per role "
                             "(--roles), and the CTA wave of sm_model")
    parser.add_argument("--cta-warps", type=int, default=8, help="--grads: compute warps")
    parser.add_argument("--no-gate-ahead", action="store_true", help="--grads: without gate_ahead")
    parser.add_argument("--split-load", action="store_true", help="--grads: with split_load")
    parser.add_argument("--split-rows", action="store_true", help="--grads: with split_rows")
    parser.add_argument("--slopes-ahead", action="store_true", help="--grads: with slopes_ahead")
    parser.add_argument("--roles", default="",
                        help="--grads: warps and the branches they take, e.g. 0:1/1:0,1,11,33/2-3:0,1,11,12,15,33/"
                             "4-7:0,1,10,11,12,16,33 (indices of the listing printed first)")
    parser.add_argument("--horizon", type=int, default=1_000_000, help="--grads: cycles sm_model runs")
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
    if args.grads:
        grads_main(args)
        return
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(state_dtype=args.dtype, tokens=args.tokens, verify=not args.decode, vsplit=args.vsplit,
                            prefetch=not args.split_prep, split_prep=args.split_prep)
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.ops import decode as ops

    sass, regs = sass_of(DecodeKernel(variant), ops.compile_arguments(variant))
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
