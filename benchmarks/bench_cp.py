"""Context parallelism over the GPUs of one host: cute_kda's ``cp_context`` beside FLA's own, fwd and fwd+bwd.

One sequence (B1) of T tokens split over the W ranks of the group as FLA lays it out (``"contiguous"``: rank r holds
tokens ``[r·T/W, (r+1)·T/W)``), through ``cute_kda.chunk_kda`` / ``cute_kda.chunk_gated_delta_rule`` with a
``cute_kda.distributed.build_cp_context`` context and FLA's ``chunk_kda`` / ``chunk_gated_delta_rule`` with
``fla.ops.cp.build_cp_context``'s (``FLA_CUTE_KDA=0``: FLA's own kernels, not its dispatch to cute_kda). KDA: H = 16,
the safe gate (``lower_bound = −5``); ``--gdn``: GatedDeltaNet, H = 16 q/k heads, HV = 32 value heads, FLA's default
fp32 log decay. l2norm and β logits in the kernels, no initial or final state (FLA's context parallelism takes
neither). A time is the median of ``--reps`` CUDA-event timings on each rank, the slowest rank's reported; the
single-GPU time is the same call on one GPU over all T tokens (rank 0, the others waiting), and the scaling
efficiency ``single / (W · split)``. fwd+bwd: q, k, v, g, β, A_log, dt_bias require grad, one step is the call
and ``backward(o, dO)``.

Launch (NVLink multicast stays off: the script also sets it before NCCL starts):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc_per_node=8 \\
        benchmarks/bench_cp.py --backward --out benchmarks/results/cp-kda-8.md
    ... --gdn                       # GatedDeltaNet H16 HV32
    ... --tokens 131072,262144     # fewer lengths; --no-fla: cute_kda only; --no-single: no one-GPU baseline
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_CUTE_KDA", "0")  # FLA's own kernels in its columns, not its dispatch to cute_kda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cute_kda._bench import event_median_ms  # noqa: E402
from cute_kda.distributed import MULTICAST_OFF, build_cp_context, keep_multicast_off  # noqa: E402

TOKENS = (131072, 262144, 524288, 1048576)
D = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda text: [int(t) for t in text.split(",")], default=list(TOKENS),
                        help="comma-separated sequence lengths (each a multiple of the world size)")
    parser.add_argument("--heads", type=int, default=16, help="q/k heads")
    parser.add_argument("--gdn", action="store_true", help="GatedDeltaNet (value heads: 2x the q/k heads)")
    parser.add_argument("--backward", action="store_true", help="also time fwd+bwd steps")
    parser.add_argument("--no-fla", dest="fla", action="store_false", help="cute_kda only")
    parser.add_argument("--no-single", dest="single", action="store_false", help="no one-GPU baseline")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per call")
    parser.add_argument("--out", help="also write the markdown table to this file (rank 0)")
    return parser.parse_args(argv)


def inputs(args: argparse.Namespace, tokens: int, seed: int, device: torch.device) -> dict:
    """FLA-level arguments of one packed row of ``tokens`` tokens (KDA's safe gate, or GatedDeltaNet's log decay)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    value_heads = 2 * args.heads if args.gdn else args.heads

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    p = dict(q=randn(1, tokens, args.heads, D), k=randn(1, tokens, args.heads, D),
             v=randn(1, tokens, value_heads, D), beta=randn(1, tokens, value_heads),
             use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if args.gdn:
        p["g"] = torch.nn.functional.logsigmoid(randn(1, tokens, value_heads, dtype=torch.float32) + 4)
    else:
        p.update(g=randn(1, tokens, args.heads, D), A_log=torch.rand(args.heads, generator=gen, device=device),
                 dt_bias=randn(args.heads * D, dtype=torch.float32), use_gate_in_kernel=True, safe_gate=True,
                 lower_bound=-5.0)
    return p


def entry_points(args: argparse.Namespace) -> dict:
    """{peer: (the FLA-signature call, its context builder)}."""
    import cute_kda

    peers = {"cute_kda": (cute_kda.chunk_gated_delta_rule if args.gdn else cute_kda.chunk_kda, build_cp_context)}
    if args.fla:
        from fla.ops.cp import build_cp_context as fla_context
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda

        peers["FLA"] = (chunk_gated_delta_rule if args.gdn else chunk_kda, fla_context)
    return peers


def timed(call, arguments: dict, backward: bool, reps: int) -> float:
    """Median ms of ``call(**arguments)`` (and ``backward(o, dO)`` when ``backward``) on the current stream."""
    leaves = {n: x.detach().requires_grad_(backward) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for n, x in arguments.items()}
    do = torch.randn_like(arguments["v"]) if backward else None

    def step() -> None:
        with torch.set_grad_enabled(backward):
            o, _ = call(**leaves)
            if backward:
                torch.autograd.backward(o, do)

    return event_median_ms(step, reps)


def slowest(ms: float, device: torch.device) -> float:
    """The largest of every rank's ``ms``."""
    value = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def single_gpu(call, args: argparse.Namespace, tokens: int, backward: bool, device: torch.device) -> str:
    """The one-GPU time of the whole sequence on rank 0 ("OOM" when it does not fit, the error's name when it
    raises), shared with every rank."""
    result = [""]
    if dist.get_rank() == 0:
        try:
            result[0] = f"{timed(call, inputs(args, tokens, 0, device), backward, args.reps):.2f}"
        except torch.cuda.OutOfMemoryError:
            result[0] = "OOM"
        except (RuntimeError, NotImplementedError, AssertionError) as error:  # answered, so the others stop waiting
            result[0] = type(error).__name__
        torch.cuda.empty_cache()
    dist.broadcast_object_list(result, src=0)
    return result[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep_multicast_off()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    model = f"GatedDeltaNet H{args.heads} HV{2 * args.heads}" if args.gdn else f"KDA H{args.heads}"
    rows = []
    for tokens in args.tokens:
        cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        share = inputs(args, tokens // world, rank + 1, device)
        for peer, (call, context_of) in entry_points(args).items():
            context = context_of(cu_seqlens, dist.group.WORLD)
            for backward in (False, True) if args.backward else (False,):
                cells = [model, f"{tokens // 1024}K", str(world), peer, "fwd+bwd" if backward else "fwd"]
                try:
                    split = slowest(timed(call, dict(share, cp_context=context), backward, args.reps), device)
                except (RuntimeError, NotImplementedError, AssertionError) as error:  # e.g. FLA's guards, on every rank
                    rows.append([*cells, f"{type(error).__name__}: {str(error).splitlines()[0][:80]}", "–", "–"])
                    continue
                alone = single_gpu(call, args, tokens, backward, device) if args.single else ""
                efficiency = f"{float(alone) / (world * split):.2f}" if alone.replace(".", "").isdigit() else "–"
                rows.append([*cells, f"{split:.2f}", alone or "–", efficiency])
                if rank == 0:
                    print(" | ".join(rows[-1]), flush=True)
    if rank == 0:
        from cute_kda._bench import environment, markdown_table, publish

        head = ["model", "T", "GPUs", "peer", "pass", "split ms", "one GPU ms", "efficiency"]
        publish(f"{environment('cute_kda', 'fla')} · {MULTICAST_OFF}\n\n{markdown_table(head, rows)}\n", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
