"""Host µs per call of ``kda_forward`` and ``chunk_kda`` at B1 T64 H16, in a short process for A/B runs.

``kda_forward`` with an fp32 initial state and output buffers given; ``chunk_kda`` with FLA's flags
(in-kernel gate, l2norm and β-sigmoid, fp32 state v-first, final state allocated). Per entry point:
the minimum and the median over 15 rounds of 200 back-to-back calls (the GPU drained between rounds).

For an A/B of two checkouts on one machine, interleave the processes so that the host's drift (up to
1.5× between consecutive runs on the H200 hosts) hits both alike; the label names the tree:

    for i in 1 2 3 4 5; do for t in old new; do (cd $t && python3 benchmarks/host_calls.py $t); done; done

``bench_host.py`` is the full table (more shapes, FLA, idle-GPU latency, graph time).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import cute_kda  # noqa: E402
from cute_kda._bench import host_round_us  # noqa: E402
from shapes import LOWER_BOUND, Shape, make_inputs  # noqa: E402


def entry_points() -> dict[str, Callable[[], object]]:
    inputs = make_inputs(Shape((64,), 16), torch.device("cuda"))
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    A_log, dt_bias, h0 = inputs["A_log"], inputs["dt_bias"], inputs["initial_state"]
    out, final = torch.empty_like(v), torch.empty_like(h0)
    scale = q.shape[-1] ** -0.5
    return {
        "kda_forward": lambda: cute_kda.kda_forward(
            q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND, initial_state=h0,
            out=out, final_state=final),
        "chunk_kda": lambda: cute_kda.chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
            A_log=A_log, dt_bias=dt_bias, state_v_first=True),
    }


def host_us(fn: Callable[[], object], calls: int = 200, rounds: int = 15) -> tuple[float, float]:
    """(minimum, median) µs per call over ``rounds`` rounds of ``calls`` calls."""
    per_call = host_round_us(fn, calls, rounds)
    return min(per_call), statistics.median(per_call)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_calls needs a CUDA GPU (Hopper)")
    label = sys.argv[1] if len(sys.argv) > 1 else "cute_kda"
    with torch.inference_mode():
        runs = entry_points()
        for fn in runs.values():
            fn()  # compile or load from the disk cache
        figures = {name: host_us(fn) for name, fn in runs.items()}
    print(label, " ".join(f"{name} min {low:.1f} med {mid:.1f}" for name, (low, mid) in figures.items()), flush=True)


if __name__ == "__main__":
    main()
