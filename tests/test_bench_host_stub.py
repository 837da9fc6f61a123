"""CPU check of ``benchmarks/bench_host_stub.py``: one short round of host_calls.py's rows (the eager ``kda_forward``
and ``chunk_kda``, the serving calls) with CUDA stubbed (in a subprocess: the script replaces the launchers for the
whole process)."""

from __future__ import annotations

import re
import subprocess
import sys

from bench_script import BENCHMARKS


def test_reports_both_entry_points():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_host_stub.py"), "--calls", "20", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = dict(re.findall(r"(kda_forward|chunk_kda) min (\d+\.\d+)", proc.stdout))
    assert set(figures) == {"kda_forward", "chunk_kda"}
    assert all(float(us) > 0 for us in figures.values())


def test_reports_the_serving_rows():
    """``--rows serving``: host_calls.py's serving rows, the fast paths of KDA and GatedDeltaNet included."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_host_stub.py"), "--rows", "serving", "--calls", "20",
                           "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = dict(re.findall(r"(\w+) min (\d+\.\d+)", proc.stdout))
    assert set(figures) == {"decode", "verify", "decode_launcher", "gdn_decode", "gdn_verify", "gdn_decode_beta_none"}
    assert all(float(us) > 0 for us in figures.values())
