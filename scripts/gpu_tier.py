"""Run the GPU test tier (or a part of it) and write a dated summary (markdown) for benchmarks/results/.

    python3 scripts/gpu_tier.py [--part NAME] [--deadline SECONDS] [-- pytest args]

Runs ``pytest -m gpu -v tests`` (the pytest args after ``--`` are appended: ``-m "gpu and not fla"``, ``-n 8``,
file names) and writes, to ``$OUT`` when that is set (the device machine's return folder), else to
``benchmarks/results/``:

- ``<date>-gpu-tier[-NAME].log``: pytest's output, line by line as it runs, so a call the device's time limit
  ends still says which tests passed, failed or never ran;
- ``<date>-gpu-tier[-NAME].md``: commit, device, command, the counts by outcome, and one row per test.

``--deadline``: after that many seconds pytest is interrupted (SIGINT: pytest stops, reports what ran, and the
summary is still written, with the items it did not reach counted) and killed 60 s later if it has not exited.
Give it somewhat less than the device call's limit. The commit comes from ``$CUTE_KDA_COMMIT`` or
``git rev-parse``. Exit status: pytest's (2 without CUDA).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 60  # after the SIGINT, before the kill
# one result line of `pytest -v`: "tests/x.py::t[a] PASSED [ 5%]", or with xdist "[gw3] [ 5%] PASSED tests/x.py::t[a]"
_OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_SERIAL = re.compile(r"^(?P<test>tests/\S+::\S+) (?P<outcome>" + "|".join(_OUTCOMES) + r")\b")
_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (?P<outcome>" + "|".join(_OUTCOMES) + r") (?P<test>tests/\S+::\S+)")
_COLLECTED = re.compile(r"(?:collected (\d+) items?(?: / (\d+) deselected)?)|(?:\d+ workers \[(\d+) items?\])")


def parse_outcomes(log: str) -> dict[str, str]:
    """{test id: outcome} from ``pytest -v`` output, serial or xdist (a test's last result line wins)."""
    outcomes = {}
    for line in log.splitlines():
        match = _SERIAL.match(line) or _XDIST.match(line)
        if match:
            outcomes[match["test"]] = match["outcome"]
    return outcomes


def selected_count(log: str) -> int | None:
    """The number of tests pytest selected to run (collected minus deselected), None if it never said."""
    match = _COLLECTED.search(log)
    if match is None:
        return None
    if match.group(3) is not None:
        return int(match.group(3))
    return int(match.group(1)) - int(match.group(2) or 0)


def _default_sigint() -> None:
    """In the child: SIGINT back to its default, so that Python turns it into KeyboardInterrupt (a shell's background
    job inherits SIGINT ignored, and Python then installs no handler for it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_with_deadline(cmd: list[str], log_path: Path, deadline_s: float | None, *, cwd: Path = ROOT,
                      grace_s: float = GRACE_S) -> tuple[int, bool]:
    """Run ``cmd`` with its output written line by line to ``log_path`` and echoed; after ``deadline_s`` send it
    SIGINT, after ``grace_s`` more kill it. Returns (exit status, whether the deadline was reached)."""
    with open(log_path, "w", buffering=1) as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                preexec_fn=_default_sigint)

        def copy_output():
            for line in proc.stdout:
                log.write(line)
                print(line, end="", flush=True)

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        cut = False
        try:
            proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            cut = True
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=grace_s)
    return proc.returncode, cut


def summary(log: str, *, stamp: str, commit: str, device: str, command: str, rc: int, cut: bool) -> str:
    """The markdown record of one run from its ``-v`` log."""
    outcomes = parse_outcomes(log)
    counts = Counter(outcomes.values())
    selected = selected_count(log)
    missing = None if selected is None else selected - len(outcomes)
    told = ", ".join(f"{counts[o]} {o.lower()}" for o in _OUTCOMES if counts[o])
    lines = [
        f"# GPU tier {stamp}",
        "",
        f"- commit: `{commit}`",
        f"- device: {device}",
        f"- command: `{command}`",
        f"- result: {told or 'no test reported'}"
        + (f"; {missing} of {selected} selected not reported" if missing else "")
        + (" (stopped at its deadline)" if cut else "") + f" (pytest exit {rc})",
        "",
        "| test | outcome |",
        "|---|---|",
    ]
    lines += [f"| {test} | {outcome.lower()} |" for test, outcome in sorted(outcomes.items())]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    if os.environ.get("CUTE_KDA_COMMIT"):
        return os.environ["CUTE_KDA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def _device() -> str:
    try:
        import torch

        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    except Exception as exc:  # report, do not hide
        return f"unavailable: {exc}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="", help="suffix of the output files, for a tier run in several calls")
    parser.add_argument("--deadline", type=float, default=None, help="seconds before pytest is interrupted")
    parser.add_argument("pytest_args", nargs="*", help="appended to the pytest command (after --)")
    return parser


def test_paths(pytest_args: list[str]) -> list[str]:
    """``["tests"]`` unless the pytest args name test files or folders themselves (a part of the tier)."""
    return [] if any(arg.startswith("tests") for arg in pytest_args) else ["tests"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_tier: no CUDA device here; the GPU tier needs one (CPU tests: make test)", file=sys.stderr)
        return 2
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    name = f"{stamp}-gpu-tier" + (f"-{args.part}" if args.part else "")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rfE", "-p", "no:cacheprovider",
           *test_paths(args.pytest_args), *args.pytest_args]
    log_path = out_dir / f"{name}.log"
    rc, cut = run_with_deadline(cmd, log_path, args.deadline)
    text = summary(log_path.read_text(), stamp=stamp, commit=_commit(), device=_device(),
                   command=" ".join(cmd[1:]), rc=rc, cut=cut)
    (out_dir / f"{name}.md").write_text(text)
    print("\n".join(text.splitlines()[:6]))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
