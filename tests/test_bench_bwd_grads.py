"""CPU checks of ``benchmarks/bench_bwd_grads.py``: its byte arithmetic, its options, and that it refuses
to time without CUDA."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

import bench_script
from bench_script import BENCHMARKS



@pytest.fixture(scope="module")
def bench():
    return bench_script.load("bench_bwd_grads")


def test_traffic_b1_t8192_h96(bench):
    read, written = bench.grads_traffic((8192,), 96)
    tiles = 512 * 96
    assert read == tiles * (6 * 4096 + 2 * 32768 + 512 + 64)  # 90.7 KB a (tile, head)
    assert written == 8192 * 96 * (3 * 256 + 2) + tiles * 129 * 4
    assert round((read + written) / 1e9, 2) == 5.09


def test_traffic_counts_real_tiles_only(bench):
    read, _ = bench.grads_traffic((17, 0, 1), 1)
    assert read == 3 * (6 * 4096 + 2 * 32768 + 512 + 64)


def test_warps_option(bench):
    assert bench.parse_warps("4,8") == [4, 8] and bench.parse_warps("8") == [8]
    for bad in ("2", "4,16", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_warps(bad)


def test_switch_options(bench):
    assert bench.parse_switch("off") == [False] and bench.parse_switch("off,on") == [False, True]
    for bad in ("", "yes", "on,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_switch(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_bwd_grads.py"), "--shapes", "B1_T8192_H96"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr
