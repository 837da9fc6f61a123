"""Host cost of one forward call: how long the CPU takes to issue it, against how long the GPU runs it.

Per peer (cute_kda ``kda_forward``, cute_kda ``chunk_kda``, FLA ``chunk_kda``) and shape:

- host µs / call: CPU wall time to issue ``--calls`` back-to-back calls (no synchronisation in
  between; small shapes keep the GPU ahead of the host), divided by the number of calls; the median
  of ``HOST_ROUNDS`` such rounds, the GPU drained between them (one round of 200 calls lasts ~20 ms,
  short enough for a busy host to skew it);
- idle-GPU latency: median CUDA-event time of one call with the GPU idle before it, which is what a
  call costs when the host is on the critical path (decode, small batches);
- GPU time: median replay time of a CUDA graph of one call (device time alone; "—" where capture fails).

``--profile`` also prints the cProfile of cute_kda's host path (top functions by cumulative time).

    python benchmarks/bench_host.py
    python benchmarks/bench_host.py --shapes B1_T64_H16 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_CUTE_KDA", "0")  # FLA's own path, not its dispatch to cute_kda

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda._bench import (  # noqa: E402
    add_run_arguments, environment, event_median_ms, graph_median_ms, host_round_us, markdown_table, publish,
)

from bench_fwd import peers  # noqa: E402
from shapes import SHAPES, Shape, make_inputs  # noqa: E402

HOST_SHAPES = {
    "B1_T64_H16": Shape((64,), 16),
    "B1_T1024_H32": Shape((1024,), 32),
    "B1_T8192_H96": SHAPES["B1_T8192_H96"],
}


HOST_ROUNDS = 7


def host_us(fn, calls: int, rounds: int = HOST_ROUNDS) -> float:
    return sorted(host_round_us(fn, calls, rounds))[rounds // 2]


def profile(fn, calls: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, HOST_SHAPES)
    parser.add_argument("--calls", type=int, default=200, help="back-to-back calls timed for the host figure")
    parser.add_argument("--profile", action="store_true", help="print the cProfile of cute_kda's kda_forward")
    parser.add_argument("--peers", help="comma-separated subset of the peers to time (default: all found)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host needs a CUDA GPU (Hopper)")

    rows = []
    with torch.inference_mode():
        for name in args.shapes:
            runs = peers(make_inputs(HOST_SHAPES[name], torch.device("cuda")))
            chosen = [p for p in runs if args.peers is None or p in args.peers.split(",")]
            for peer, fn in ((p, runs[p]) for p in chosen):
                fn()  # compile / autotune
                gpu = graph_median_ms(fn, args.warmup, args.rep)
                rows.append([name, peer, f"{host_us(fn, args.calls):.0f}",
                             f"{event_median_ms(fn, reps=50):.3f}", "—" if gpu is None else f"{gpu:.3f}"])
                print(" ".join(rows[-1]), file=sys.stderr)
            if args.profile:
                print(profile(runs["cute_kda"], args.calls), file=sys.stderr)
    head = ["shape", "peer", "host µs / call", "idle-GPU latency ms", "GPU time ms (graph)"]
    publish(f"{environment('cutlass', 'fla', 'triton')}\n\n{markdown_table(head, rows)}\n", args.out)


if __name__ == "__main__":
    main()
