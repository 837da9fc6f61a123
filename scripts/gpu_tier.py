"""Run the GPU test tier and write a dated summary (markdown) for benchmarks/results/.

    python3 scripts/gpu_tier.py [extra pytest args]

Writes ``<date>-gpu-tier.md`` (and the junit XML beside it) to ``$OUT`` when that is set (the
device machine's return folder), else to ``benchmarks/results/``. The commit comes from
``$CUTE_KDA_COMMIT`` or ``git rev-parse``. Exit status is pytest's.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_tier: no CUDA device here; the GPU tier needs one (CPU tests: make test)", file=sys.stderr)
        return 2
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    junit = out_dir / f"{stamp}-gpu-tier.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", f"--junitxml={junit}", "tests", *sys.argv[1:]]
    rc = subprocess.call(cmd, cwd=ROOT)
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [
        f"# GPU tier {stamp}",
        "",
        f"- commit: `{_commit()}`",
        f"- device: {_device()}",
        f"- command: `{' '.join(cmd[1:])}`",
        f"- result: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped (pytest exit {rc})",
        "",
        "| test | outcome | time (s) |",
        "|---|---|---|",
    ]
    for case in suite.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        lines.append(f"| {case.get('classname', '')}::{case.get('name')} | {outcome} | {float(case.get('time', 0)):.2f} |")
    (out_dir / f"{stamp}-gpu-tier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
