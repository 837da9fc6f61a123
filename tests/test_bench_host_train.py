"""CPU check of ``benchmarks/bench_host_train.py``: the training step's launches in order, with the kernels
replaced by no-ops (in a subprocess: the script replaces the launchers for the whole process)."""

from __future__ import annotations

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
