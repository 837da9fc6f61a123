"""A prefill on a state pool (issue 32): what the pool costs against the plain forward and against what engines do now.

Per shape and pool dtype, median ms (``cute_kda._bench.median_ms``, host time included) of:

- ``plain``: ``kda_forward`` with an initial state per sequence and a final state out (no pool);
- ``gather+scatter``: the engines' way today, the listed slots gathered into a state batch, ``plain``, the final
  states scattered back (torch indexing);
- ``pool``: ``kda_forward(..., initial_state=pool, state_indices=slots)`` (K2 reads and writes the slots);
- ``pool + ckpt C``: the same with a prefix checkpoint every C tokens of every sequence (into distinct slots).

    python benchmarks/bench_prefill_pool.py
    python benchmarks/bench_prefill_pool.py --shapes serve_N16_H32 --out benchmarks/results/prefill-pool.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import cute_kda  # noqa: E402
from cute_kda._bench import add_run_arguments, environment, markdown_table, median_ms, publish  # noqa: E402

D = 128
SHAPES = {  # name: (sequence lengths, heads)
    "serve_N16_H32": ([512, 4096, 1024, 2048, 777, 3000, 128, 1500] * 2, 32),
    "N4_T8192_H16": ([8192] * 4, 16),
    "N64_T1024_H32": ([1024] * 64, 32),
}
CHECKPOINTS = (64, 256)


def _inputs(lengths: list[int], heads: int, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)
    return dict(q=randn(1, total, heads, D), k=randn(1, total, heads, D), v=randn(1, total, heads, D),
                g=randn(1, total, heads, D), beta=randn(1, total, heads), A_log=torch.rand(heads, device=device),
                dt_bias=randn(heads, D, dtype=torch.float32), cu_seqlens=bounds)


def run(name: str, dtype: torch.dtype, warmup: int, rep: int) -> list[str]:
    lengths, heads = SHAPES[name]
    device = torch.device("cuda")
    x = _inputs(lengths, heads, device)
    num_seqs = len(lengths)
    blocks = max(lengths) // min(CHECKPOINTS)
    pool = (0.1 * torch.randn(num_seqs * (2 + blocks), heads, D, D, device=device)).to(dtype)
    slots = torch.arange(num_seqs, dtype=torch.int32, device=device) * 2 + 1  # every other slot
    slot_ids = slots.long()
    states = pool[slot_ids].clone()

    def plain():
        return cute_kda.kda_forward(**x, initial_state=states, output_final_state=True)

    def gather_scatter():
        _, final = cute_kda.kda_forward(**x, initial_state=pool[slot_ids], output_final_state=True)
        pool[slot_ids] = final

    def on_pool(every: int | None = None):
        if every is None:
            return lambda: cute_kda.kda_forward(**x, initial_state=pool, state_indices=slots)
        columns = max(lengths) // every
        first = 2 * num_seqs
        checkpoints = (first + torch.arange(num_seqs * columns, device=device)).view(num_seqs, columns).to(torch.int32)
        return lambda: cute_kda.kda_forward(**x, initial_state=pool, state_indices=slots, checkpoint_every=every,
                                            checkpoint_indices=checkpoints)

    times = [median_ms(fn, warmup, rep) for fn in (plain, gather_scatter, on_pool(),
                                                   *(on_pool(every) for every in CHECKPOINTS))]
    return [name, str(dtype).replace("torch.", ""), *(f"{t:.3f}" for t in times)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, SHAPES)
    args = parser.parse_args()
    head = ["shape", "pool", "plain", "gather+scatter", "pool", *(f"pool + ckpt {c}" for c in CHECKPOINTS)]
    rows = [run(name, dtype, args.warmup, args.rep) for name in args.shapes for dtype in (torch.float32, torch.bfloat16)]
    publish(f"{environment('cute_kda')}\n\nms (median)\n\n{markdown_table(head, rows)}", args.out)


if __name__ == "__main__":
    main()
