"""CPU checks of ``benchmarks/bench_bwd.py``: its step and byte arithmetic, its options, its report, and
that it imports and refuses to time without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench_script
from bench_script import BENCHMARKS
from cute_kda.workspace import SNAPSHOT_TILES

STATE = 128 * 128  # elements of one (sequence, head) state at D = 128


@pytest.fixture(scope="module")
def bench():
    return bench_script.load("bench_bwd")


def test_workspace_tile_bytes_match_the_workspace_doc(bench):
    assert bench.workspace_bytes_per_tile() == 3 * 4096 + 512 + 2 * 512 + 64 == 13_888


def test_tile_steps_are_those_of_the_longest_sequence(bench):
    shapes = bench.SHAPES
    assert bench.tile_steps(shapes["B1_T32768_H16"].lengths) == 2048
    assert bench.tile_steps(shapes["B8_T4096_H32"].lengths) == 256
    assert bench.tile_steps(shapes["varlen6_H96"].lengths) == 192  # 3063 tokens: 191 full tiles + 1
    assert bench.tile_steps((17, 16, 1, 0)) == 2
    assert bench.tile_steps(()) == 0
    assert bench.chunks((17, 16, 1, 0)) == 4
    assert bench.chunks((8192,), 64) == 128 and bench.chunks((65, 64), 64) == 3


def test_scan_traffic_b1_t8192_h96(bench):
    t, h, tiles = 8192, 96, 512
    traffic = bench.scan_traffic((t,), h)
    assert traffic.read == t * h * 128 * 2 + tiles * h * 13_888 + h * STATE * 4  # dO, workspace, fp32 dht
    assert traffic.written == 2 * t * h * 128 * 2 + tiles // SNAPSHOT_TILES * h * STATE * 2 + h * STATE * 4  # dv+du, snapshots, dh0
    assert traffic.total == traffic.read + traffic.written
    assert bench.scan_traffic((t,), h, dht_itemsize=2).read == traffic.read - h * STATE * 2
    assert bench.scan_traffic((t,), h, dht_itemsize=None).read == traffic.read - h * STATE * 4
    assert bench.scan_traffic((t,), h, dh0=False).written == traffic.written - h * STATE * 4
    density = bench.scan_traffic((t,), h, every=bench.FLA_DENSITY_TILES)  # FLA's: one per 64 tokens
    assert bench.FLA_DENSITY_TILES == 4 and density.read == traffic.read
    assert density.written == 2 * t * h * 128 * 2 + tiles // 4 * h * STATE * 2 + h * STATE * 4


def test_scan_traffic_counts_real_tiles_of_each_sequence(bench):
    traffic = bench.scan_traffic((17, 1), 1)  # 3 real tiles, 18 tokens, 2 states, 3 per-tile snapshots
    assert traffic.read == 18 * 256 + 3 * 13_888 + 2 * STATE * 4
    assert traffic.written == 2 * 18 * 256 + bench.snapshot_blocks((17, 1)) * STATE * 2 + 2 * STATE * 4
    assert bench.snapshot_blocks((17, 1)) == 3


def test_snapshot_blocks(bench):
    """One per block end of ``every`` global tiles or sequence end (cute_kda.workspace.snapshot_slots)."""
    assert bench.snapshot_blocks((8192,), 4) == 128
    assert bench.snapshot_blocks((17, 1), 4) == 2  # tiles 0-1 (end), tile 2 (end)
    assert bench.snapshot_blocks((64, 64), 4) == 2
    assert bench.snapshot_blocks((16, 64), 4) == 3  # tile 0 (end) | tiles 1-3 (block end at 3), tile 4 (end)
    assert bench.snapshot_blocks((0, 5), 4) == 1
    assert bench.snapshot_blocks((8192,), 1) == 512 and bench.snapshot_blocks((16, 64), 1) == 5


def test_fla_dhu_traffic_b1_t8192_h96(bench):
    t, h, nchunks = 8192, 96, 128
    traffic = bench.fla_dhu_traffic((t,), h)
    # qg, kg, w, dO, dv (bf16) + gk's last row per chunk (fp32) + dht (fp32)
    assert traffic.read == 5 * t * h * 256 + nchunks * h * 128 * 4 + h * STATE * 4
    # dh per chunk (bf16) + dv2 (bf16) + dh0 (fp32)
    assert traffic.written == nchunks * h * STATE * 2 + t * h * 256 + h * STATE * 4


def test_rates(bench):
    assert bench.gb_per_s(10**9, 1.0) == pytest.approx(1000.0)
    assert bench.floor_ms(43 * 10**8) == pytest.approx(1.0)  # 4.3 GB at the 4.3 TB/s copy ceiling
    assert bench.us_per_step(0.55, 512) == pytest.approx(1.07421875)
    assert bench.us_per_step(1.0, 0) != bench.us_per_step(1.0, 0)  # NaN, not a ZeroDivisionError


def test_options(bench):
    args = bench.build_parser().parse_args([])
    assert args.shapes == list(bench.SHAPES) and args.vsplits == (1, 2, 4, 8) and args.peers == "fla"
    assert (args.warmup, args.rep, args.out) == (25, 100, None)
    args = bench.build_parser().parse_args(
        ["--shapes", "B1_T32768_H16,B1_T8192_H96", "--vsplits", "8,1,1", "--peers", "none", "--rep", "50"])
    assert args.shapes == ["B1_T32768_H16", "B1_T8192_H96"] and args.vsplits == (1, 8)
    assert args.peers == "none" and args.rep == 50


@pytest.mark.parametrize("argv", [["--vsplits", "3"], ["--vsplits", ","], ["--vsplits", "two"],
                                  ["--shapes", "B1_T1_H1"], ["--peers", "flashkda"]])
def test_bad_options_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.build_parser().parse_args(argv)
    assert exit_info.value.code == 2


def test_default_out(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert Path(bench.default_out()).parent == tmp_path and Path(bench.default_out()).name.startswith("bwd-")
    monkeypatch.delenv("OUT")
    assert Path(bench.default_out()).parent == BENCHMARKS / "results"


def test_refuses_to_time_without_cuda(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--shapes", "B1_T8192_H96", "--peers", "none"])


def test_help_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_bwd.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--vsplits" in done.stdout and "--peers" in done.stdout


def _scan_row(bench, vsplit, ms, auto=False):
    return dict(kind="scan", vsplit=vsplit, auto=auto, ctas=96 * vsplit, steps=512,
                traffic=bench.scan_traffic((8192,), 96), ms=ms, timing="graph", note="" if ms else "error: X")


def test_report(bench):
    density = dict(_scan_row(bench, 2, 0.25), kind="scan_fla_density",
                   traffic=bench.scan_traffic((8192,), 96, every=4))
    measured = dict(shape="B1_T8192_H96", scan=[_scan_row(bench, 1, 0.40, auto=True), _scan_row(bench, 2, 0.30),
                                                _scan_row(bench, 8, None), density],
                    fla=dict(kind="fla", ctas=384, steps=512, ms=0.50, timing="graph", note="BV 32, 4 warps, 2 stages",
                             call="q=bfloat16[1, 8192, 96, 128]", traffic=bench.fla_dhu_traffic((8192,), 96),
                             reference=0.55))
    absent = dict(shape="B1_T32768_H16", scan=[_scan_row(bench, 4, 1.0, auto=True)],
                  fla=dict(kind="fla", ctas=None, steps=2048, ms=None, timing=None, note="not installed", call="",
                           traffic=bench.fla_dhu_traffic((32768,), 16), reference=0.69))
    text = bench.report([measured, absent], "python benchmarks/bench_bwd.py", "ENV")
    lines = text.splitlines()
    assert lines[2] == "Command: `python benchmarks/bench_bwd.py`" and lines[4].startswith("ENV · ")
    # summary: auto V-split 1 at 0.40, best V-split 2 at 0.30 (the density row not among them), against FLA's 0.50
    # (issue: 0.55); FLA's density 0.25
    floors = [f"{bench.floor_ms(traffic.total):.3f}" for traffic in (
        bench.scan_traffic((8192,), 96), bench.scan_traffic((8192,), 96, every=4), bench.fla_dhu_traffic((8192,), 96))]
    assert (f"| B1_T8192_H96 | 1 | 0.400 | 2 | 0.300 | 0.500 | 0.55 | 0.60 | 0.80 | 0.250 | 0.50 | "
            f"{' / '.join(floors)} |") in lines
    assert any(line.startswith("| B1_T32768_H16 | 4 | 1.000 | 4 | 1.000 | not installed | 0.69 | — | — | — | — |")
               for line in lines)
    assert any(line.startswith("| B1_T8192_H96 | Kernel A, V-split 2, FLA's density (a snapshot per 4 tiles; not in "
                               "the step) | 192 | 512 | 0.250 |") for line in lines)
    assert any(line.startswith("| B1_T8192_H96 | **Kernel A, V-split 1** (auto) | 96 | 512 | 0.400 | 0.78 |")
               for line in lines)
    assert any("| Kernel A, V-split 8 | 768 | 512 | error: X |" in line for line in lines)
    assert any("FLA bwd_dhu (BV 32, 4 warps, 2 stages) | 384 | 512 | 0.500 |" in line for line in lines)
    assert "- B1_T8192_H96: `chunk_gated_delta_rule_bwd_dhu(q=bfloat16[1, 8192, 96, 128])`" in lines


def test_report_of_a_segmented_shape(bench):
    """A shape the API splits: the segmented scan is its auto row, named with its segments."""
    segmented = dict(_scan_row(bench, 1, 0.80, auto=True), segments=8, ctas=128, steps=256)
    result = dict(shape="B1_T32768_H16", scan=[_scan_row(bench, 8, 1.40), segmented],
                  fla=dict(kind="fla", ctas=None, steps=512, ms=0.70, timing="graph", note="", call="",
                           traffic=bench.fla_dhu_traffic((32768,), 16), reference=0.69))
    lines = bench.report([result], "python benchmarks/bench_bwd.py", "ENV").splitlines()
    assert any(line.startswith("| B1_T32768_H16 | 8 seg × 1 | 0.800 | 8 seg × 1 | 0.800 | 0.700 | 0.69 | 1.14 | 1.14 | — |")
               for line in lines)
    assert any(line.startswith("| B1_T32768_H16 | **Kernel A, 8 segments × V-split 1 (2 passes + combine)** (auto) "
                               "| 128 | 256 | 0.800 | 3.12 |") for line in lines)
    assert any(line.startswith("| B1_T32768_H16 | Kernel A, V-split 8 | 768 | 512 | 1.400 |") for line in lines)
