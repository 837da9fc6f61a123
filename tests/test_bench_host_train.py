"""CPU check of ``benchmarks/bench_host_train.py``: the training step's launches in order, and the torch operators a
segmented step adds, with the kernels replaced by no-ops (in a subprocess: the script replaces the launchers for the
whole process)."""

from __future__ import annotations

import collections
import re
import subprocess
import sys

from bench_script import BENCHMARKS


def test_reports_every_launch_of_both_modes_in_order():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_host_train.py"), "--steps", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(":")[0]: line for line in proc.stdout.splitlines() if line.startswith(("recompute:", "keep:"))}
    order = {mode: re.findall(r"(K1|K2|Kernel A|Kernel B) at \d+", line) for mode, line in lines.items()}
    # recompute: the forward's K1 + K2, the backward's K1 + K2 again, then A and B; keep: no rerun
    assert order == {"recompute": ["K1", "K2", "K1", "K2", "Kernel A", "Kernel B"],
                     "keep": ["K1", "K2", "Kernel A", "Kernel B"]}
    assert all(float(us) > 0 for us in re.findall(r"(\d+) µs of host", proc.stdout))


def device_ops(*flags: str) -> dict[str, collections.Counter]:
    """``--count-ops`` of a T256 H1 D64 step: phase → the device operators (name → count)."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_host_train.py"), "--seq-len", "256", "--heads", "1",
                           "--head-dim", "64", "--count-ops", *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    phases = {}
    for line in proc.stdout.splitlines():
        if line.startswith(("forward:", "backward:")):
            listed = line.split("device: ", 1)[1]
            phases[line.split(":")[0]] = collections.Counter(
                {name: int(n) for name, n in re.findall(r"(aten\.[\w.]+) ×(\d+)", listed)})
    return phases


def test_segmented_step_glue_is_pinned():
    """The torch device operators (on a GPU each one a launch or a copy) that a step cut into 8 segments dispatches
    beyond the unsplit step's, pinned so that one more fails here: the forward's combine (7 in-place GEMMs: into
    another tensor ``baddbmm`` copies its addend first), the transition pass's zero v, the initial state into the
    first segment's, the final state's own copy; the backward's combine, dht into the last segment's, dh0's own
    copy. The segment bounds and the identities are kept, not made again."""
    split, whole = device_ops("--segments", "8"), device_ops()
    assert {phase: split[phase] - whole[phase] for phase in split} == {
        "forward": collections.Counter({"aten.baddbmm_.default": 7, "aten.zeros_like.default": 1,
                                        "aten.copy_.default": 1, "aten._to_copy.default": 1}),
        "backward": collections.Counter({"aten.baddbmm_.default": 7, "aten.copy_.default": 1,
                                         "aten._to_copy.default": 1}),
    }
