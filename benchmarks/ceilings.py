"""Measure the two ceilings the kernels are judged against: device-to-device copy bandwidth and
bf16 matrix-product rate (device/METHOD.md: measure them on the machine, use those, not datasheets).

    python3 benchmarks/ceilings.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import event_median_ms  # noqa: E402


def main() -> None:
    n = 1 << 30  # 1 GiB, far beyond L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda: dst.copy_(src), reps=20)
    copy_tbs = 2 * n / ms / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = event_median_ms(lambda: a @ b, reps=10)
    tflops = 2 * 8192**3 / ms_mm / 1e9
    print(f"| ceiling | value |\n|---|---|\n| D2D copy (read+write) | {copy_tbs:.2f} TB/s |\n"
          f"| bf16 GEMM 8192^3 (random) | {tflops:.0f} TFLOP/s |")


if __name__ == "__main__":
    main()
