"""CPU checks of ``scripts/gpu_tier.py``: it reads pytest's ``-v`` output (serial and xdist), stops a run at its
deadline and still writes the record."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_tier.py"

SERIAL_LOG = """\
============================= test session starts ==============================
collected 1674 items / 1600 deselected / 74 selected
tests/test_api.py::test_a[x-1] PASSED                                    [  1%]
tests/test_api.py::test_b FAILED                                         [  2%]
tests/test_bwd_grads.py::test_gold_large_a_log XFAIL (dA_log cancels)    [  3%]
"""
XDIST_LOG = """\
8 workers [342 items]
scheduling tests via LoadScheduling
tests/test_api.py::test_a[x-1] \n[gw3] [  1%] PASSED tests/test_api.py::test_a[x-1] \n\
[gw0] [  2%] SKIPPED tests/test_gdn.py::test_c \n[gw1] [  3%] ERROR tests/test_gdn.py::test_d \n\
tests/test_gdn.py::test_e \n"""


@pytest.fixture(scope="module")
def tier():
    spec = importlib.util.spec_from_file_location("gpu_tier", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_outcomes_of_a_serial_log(tier):
    assert tier.parse_outcomes(SERIAL_LOG) == {
        "tests/test_api.py::test_a[x-1]": "PASSED", "tests/test_api.py::test_b": "FAILED",
        "tests/test_bwd_grads.py::test_gold_large_a_log": "XFAIL"}
    assert tier.selected_count(SERIAL_LOG) == 74


def test_outcomes_of_an_xdist_log(tier):
    """xdist names a test when it starts (no outcome: not counted) and again with its outcome."""
    assert tier.parse_outcomes(XDIST_LOG) == {
        "tests/test_api.py::test_a[x-1]": "PASSED", "tests/test_gdn.py::test_c": "SKIPPED",
        "tests/test_gdn.py::test_d": "ERROR"}
    assert tier.selected_count(XDIST_LOG) == 342
    assert tier.selected_count("collected 12 items\n") == 12 and tier.selected_count("nothing\n") is None


def test_summary_counts_what_was_not_reported(tier):
    text = tier.summary(XDIST_LOG, stamp="2026-12-03", commit="abc", device="H200", command="pytest", rc=2,
                        cut=True)
    assert "- result: 1 passed, 1 error, 1 skipped; 339 of 342 selected not reported (stopped at its deadline) " \
           "(pytest exit 2)" in text
    assert "| tests/test_gdn.py::test_d | error |" in text


def test_a_run_past_its_deadline_is_interrupted_and_logged(tier, tmp_path):
    log = tmp_path / "run.log"
    code = "import time; print('started', flush=True); time.sleep(60)"
    start = time.monotonic()
    rc, cut = tier.run_with_deadline([sys.executable, "-c", code], log, 1.0, cwd=tmp_path, grace_s=10)
    assert cut and rc != 0 and time.monotonic() - start < 20
    text = log.read_text()
    assert text.startswith("started\n") and "KeyboardInterrupt" in text  # SIGINT, not the kill


def test_a_run_within_its_deadline_keeps_every_line(tier, tmp_path):
    log = tmp_path / "run.log"
    code = "import sys; print('\\n'.join(str(i) for i in range(2000))); sys.exit(3)"
    rc, cut = tier.run_with_deadline([sys.executable, "-c", code], log, 60.0, cwd=tmp_path)
    assert (rc, cut) == (3, False)
    assert log.read_text().split() == [str(i) for i in range(2000)]


def test_without_cuda_it_says_so(tier, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tier.main(["--deadline", "5"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_part_runs_only_the_files_it_names(tier):
    """A part of the tier (file arguments) collects those files alone, not the whole tests folder as well."""
    assert tier.test_paths(["-m", "gpu and not fla", "-n", "8", "tests/test_api.py"]) == []
    assert tier.test_paths(["-m", "gpu and not fla", "-n", "8"]) == ["tests"]
