"""Host µs of a steady serving call on a machine without a GPU: the Python path of ``fused_recurrent_kda`` and
``fused_recurrent_gated_delta_rule`` with what needs CUDA stubbed, for A/B runs of two checkouts.

host_calls.py times the same calls on the H200 (its ``decode`` / ``verify`` / ``decode_launcher`` rows, N = 32,
HV = 16, fp32 V-first pool, FLA's KDA layer flags, ``out`` given; its ``gdn_decode`` / ``gdn_verify`` /
``gdn_decode_beta_none`` rows, GatedDeltaNet as Qwen3-Next's layer calls it: H = 8 key heads for the 16 value
heads, a per-head gate in the kernel, beta given — or None, which FLA fills with ones); this script builds those
calls on CPU tensors and stubs, with C-level callables where torch's own are C (so the stub adds little of its own):

- ``Tensor.get_device`` → 0 and ``torch.cuda.current_device`` → 0 (the tensors pass as CUDA device 0's);
- torch's raw current-stream look-up → 0, ``cute_kda.ops.decode.sm_count`` → 132 (the H200),
  ``cute_kda.ops.decode.check_supported`` → nothing (an sm_90 device; run once per configuration);
- ``cute_kda.ops.decode.compiled_variant`` → a function that takes any arguments and does nothing (what the
  compiled TVM-FFI function costs — it reads each tensor's DLPack descriptor in C — is not timed here);
- ``Tensor.is_cuda`` → True (a Python property: read at most once a call on the timed paths).

What is timed is the rest: the checks, the plan look-ups, the argument building. Per row: the minimum and the
median over ``--rounds`` rounds of ``--calls`` calls. An interleaved A/B of two trees (``--tree`` puts a checkout
first on ``sys.path``; the stubs are this file's in both runs)::

    git archive HEAD | tar -x -C /tmp/base
    for i in 1 2 3 4 5; do for t in /tmp/base $PWD; do python benchmarks/bench_host_decode.py --tree $t; done; done

The H200's host ran Python about 2× slower than the 2-core CPU this was written on (2026-12-03: 24-25 µs for the
decode row there).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from typing import Callable

N, HV, H, D, DRAFT = 32, 16, 16, 128, 3


def install_stubs() -> None:
    """The CUDA queries a steady call makes, answered on the CPU (module doc)."""
    import torch

    torch.Tensor.get_device = (0).__int__  # a C callable that is not a descriptor: t.get_device() → 0
    torch._C._cuda_getCurrentRawStream = (0).__mul__  # (index) → 0, in C
    torch.cuda.current_device = (0).__int__
    decode_ops = importlib.import_module("cute_kda.ops.decode")
    decode_ops.sm_count = lambda index: 132
    decode_ops.check_supported = lambda device: None

    def launch(*args):
        return None

    decode_ops.compiled_variant = lambda variant, index: launch
    torch.Tensor.is_cuda = property(lambda self: True)


def calls() -> dict[str, Callable[[], object]]:
    """host_calls.py's serving rows (decode, verify, decode_launcher, the gdn ones) on CPU tensors."""
    import torch

    import cute_kda
    from cute_kda.ops.decode import decode

    bf16 = torch.bfloat16
    width = 1 + DRAFT

    def tokens(t: int, heads: int = H, gate: tuple = (D,)) -> tuple:
        return (torch.randn(N, t, heads, D).to(bf16), torch.randn(N, t, heads, D).to(bf16),
                torch.randn(N, t, HV, D).to(bf16), torch.randn(N, t, HV, *gate).to(bf16), torch.randn(N, t, HV).to(bf16))

    one, four = tokens(1), tokens(width)
    gdn_one, gdn_four = tokens(1, H // 2, ()), tokens(width, H // 2, ())  # q, k, v, g [N, T, HV], beta
    pool = torch.zeros(N * (width + 1), HV, D, D)
    A_log, dt_bias = torch.rand(HV), torch.rand(HV * D)  # the layer's dt_bias [HV·K]
    dt_bias_hk = dt_bias.view(HV, D)  # as the launcher reads it
    slots = torch.arange(N, dtype=torch.int32)
    slots[1] = -1
    verify_slots = (N + torch.arange(N * width, dtype=torch.int32)).reshape(N, width)
    accepted = torch.ones(N, dtype=torch.int32)
    one_out, four_out = torch.empty_like(one[2]), torch.empty_like(four[2])
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True)
    gdn_flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=torch.rand(HV),
                     state_v_first=True)
    return {
        "decode": lambda: cute_kda.fused_recurrent_kda(*one, A_log, dt_bias, initial_state=pool,
                                                       ssm_state_indices=slots, out=one_out, **flags),
        "verify": lambda: cute_kda.fused_recurrent_kda(*four, A_log, dt_bias, initial_state=pool,
                                                       ssm_state_indices=verify_slots, num_accepted_tokens=accepted,
                                                       out=four_out, **flags),
        "decode_launcher": lambda: decode(*one, A_log, dt_bias_hk, pool, slots, gate="softplus", scale=D ** -0.5,
                                          out=one_out),
        "gdn_decode": lambda: cute_kda.fused_recurrent_gated_delta_rule(
            *gdn_one[:3], gdn_one[3], beta=gdn_one[4], initial_state=pool, ssm_state_indices=slots, out=one_out,
            **gdn_flags),
        "gdn_verify": lambda: cute_kda.fused_recurrent_gated_delta_rule(
            *gdn_four[:3], gdn_four[3], beta=gdn_four[4], initial_state=pool, ssm_state_indices=verify_slots,
            num_accepted_tokens=accepted, out=four_out, **gdn_flags),
        "gdn_decode_beta_none": lambda: cute_kda.fused_recurrent_gated_delta_rule(
            *gdn_one[:3], gdn_one[3], initial_state=pool, ssm_state_indices=slots, out=one_out, **gdn_flags),
    }


def round_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", help="a checkout to import cute_kda from (default: this one)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    sys.path.insert(0, args.tree or str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    import torch

    install_stubs()
    runs = calls()
    figures = {}
    with torch.inference_mode():
        for name, fn in runs.items():
            fn()
            per_round = [round_us(fn, args.calls) for _ in range(args.rounds)]
            figures[name] = (min(per_round), statistics.median(per_round))
    label = args.tree or "."
    print(label, " ".join(f"{name} min {low:.2f} med {mid:.2f}" for name, (low, mid) in figures.items()), flush=True)


if __name__ == "__main__":
    main()
