"""Decode and speculative verify on a state pool (issue 32): µs per call, state bandwidth against a device copy,
and FLA's fused recurrent kernels on the same inputs.

Rows: N ∈ {1, 8, 32, 128, 512} sequences × HV ∈ {4, 32, 96} value heads (H = HV), fp32 and bf16 pools
(V-first, FLA's layers' ``state_v_first=True``), decode (T = 1) and verify with S = 3 draft tokens (T = 4,
every token's state written, accepted counts cycling 1..4); KDA's per-channel safe gate with l2norm and β
sigmoid in the kernel. The per-head rows (GatedDeltaNet) run decode with a precomputed log decay.

- **µs**: median of CUDA-graph replays of one call (:func:`cute_kda._bench.graph_median_ms`: do_bench with
  the L2 cleared before each replay);
- **state GB/s**: (bytes of state read + written) / time; **% copy**: that against a same-run device-to-device
  copy moving the same bytes (half read, half written), timed the same way (graph replay, L2 cleared before each
  repetition), the faster of two copies: ``cudaMemcpyAsync`` (``torch.Tensor.copy_``) and a vectorized SM kernel
  (``torch.add(x, 0, out=y)`` on fp32, 16-byte accesses); **copy GB/s** is that copy's rate, so the baseline can be
  read beside the kernel; stderr gives both copies' µs per row. Why two: cudaMemcpy alone is no HBM ceiling on
  Hopper (NVIDIA/cccl#1672: 66 % of the H200's bandwidth for an 8.6 GB device copy; pytorch/pytorch#161518: slower
  than a vectorized x + 0 on H100). The 2026-12-03 run used it alone: on 12 of its 90 rows, all among the largest
  (N = 512 with HV ≥ 32; the fp32 verify at N = 128, HV = 32; 0.5-8 GB a copy, far past the 50 MB L2, so not a
  cache effect), the copy ran at ~2.75 TB/s against ~4.1-4.3 TB/s on its neighbours while the kernel held
  3.8-3.9 TB/s, hence the 114-143 %;
- **ceiling vs FLA**: FLA's µs over the larger of the copy's µs and a launch floor (a one-element kernel timed
  the same way): the most any kernel that moves the state once could gain on FLA on that row (issue 32 asks
  1.5×; a row whose ceiling is below that cannot meet it);
- **FLA**: ``fla.ops.kda.fused_recurrent_kda_fwd`` with its in-place pool indexing (``ssm_state_indices``,
  ``num_accepted_tokens``, ``inplace_final_state=True``), the same gate, l2norm and β sigmoid in its kernel;
  for the per-head rows ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` (FLA 0.6.0 has no pool
  indexing there: it reads a contiguous ``[N, HV, V, K]`` initial state and allocates the final state). Slot
  ids are a random permutation (no padding rows: FLA 0.6.0 reads slot −1); ``--ordered-slots`` puts them in order
  (slot placement alone moved a bf16 decode row by up to 4 points of the copy: docs/perf-log.md, D-slots);
- ``--slot-copy``: on decode rows, also :mod:`slot_copy`'s copy of the same state bytes onto themselves at the same
  slots (the ceiling of the access pattern a random slot placement makes) and the decode's share of it;
- ``--sweep``: every V-split of each row too (the column gives the fastest and its µs; ``auto`` is
  :meth:`cute_kda.kernels.decode.DecodeVariant.choose_vsplit`);
- ``--no-prefetch``: the plain unrolled multi-token variants instead of those that load every token ahead
  (:meth:`cute_kda.kernels.decode.DecodeVariant.choose_prefetch`, ``cute_kda.ops.decode.PREFETCH``), for the A/B of
  docs/perf-log.md's D3; ``--no-paired``: one-token bf16 decodes without the paired variant
  that :meth:`cute_kda.kernels.decode.DecodeVariant.choose_paired` picks where it pays (``cute_kda.ops.decode.PAIRED``,
  on by default; the vsplit column names the paired split), for the A/B of D4; ``--no-split-prep``: the
  T = 2-4 calls prepare each token in every thread group, not once a warp shared by shuffles
  (``cute_kda.ops.decode.SPLIT_PREP``, on by default;
  :meth:`cute_kda.kernels.decode.DecodeVariant.choose_split_prep`), the A/B of D6;
  ``--no-paired-loop``: packed bf16 decodes on the plain runtime loop, not the paired variant
  (``cute_kda.ops.decode.PAIRED_LOOP``, on by default), the A/B of D8; ``--no-split-prep-packed``: packed verifies on
  the runtime loop, not the ``split_prep`` schedule of S + 1 tokens (``cute_kda.ops.decode.SPLIT_PREP_PACKED``, on by
  default), the A/B of D9; ``--no-fla``: our columns only;
- ``--modes packed,packed-verify``: the same calls with the tokens packed (``[1, N·T, ...]``, int32 ``cu_seqlens``,
  every sequence T long): a packed decode runs our runtime token loop (on bf16 pools its paired form), a packed verify
  the unrolled split_prep schedule of S + 1 tokens where it fits, else the loop (FLA takes the same ``cu_seqlens``).

Goals (issue 32): ≥ 85 % of the copy's bandwidth where N·HV ≥ 2048; ≥ 1.5× FLA; N = 1, HV = 32 ≤ 8 µs.

    python benchmarks/bench_decode.py --out benchmarks/results/decode.md
    python benchmarks/bench_decode.py --sweep --pools fp32 --modes decode
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("FLA_CUTE_KDA", "0")  # FLA's own kernels, not cute_kda's backend, in its columns

from cute_kda._bench import environment, graph_median_ms, markdown_table, publish, save  # noqa: E402

D = 128
SEQS = (1, 8, 32, 128, 512)
HEADS = (4, 32, 96)
POOLS = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = {"decode": 1, "verify": 4, "packed": 1, "packed-verify": 4}  # tokens per sequence
ISSUE_MODES = ("decode", "verify")  # the issue's grid; the packed modes (cu_seqlens: our runtime loop) on request
LOWER_BOUND = -5.0


def _inputs(N: int, T: int, HV: int, pool_dtype: torch.dtype, per_head: bool, verify: bool,
            packed: bool = False, ordered: bool = False) -> dict:
    """A call's tensors (H = HV), its pool (``N·T`` slots for a verify, ``N`` for a decode) and slot ids, a random
    permutation of the slots (``ordered``: in order); ``packed``: the same tokens as ``[1, N·T, ...]`` with int32
    ``cu_seqlens`` (every sequence T long)."""
    dev = "cuda"
    bf16 = torch.bfloat16
    gate_shape = (N, T, HV) if per_head else (N, T, HV, D)
    g = torch.randn(*gate_shape, device=dev)
    if per_head:
        g = torch.nn.functional.logsigmoid(g + 2.0)  # GatedDeltaNet's precomputed log decay
    slots = N * T if verify else N
    indices = (torch.arange if ordered else torch.randperm)(slots, device=dev, dtype=torch.int32)
    case = dict(
        q=torch.randn(N, T, HV, D, device=dev, dtype=bf16), k=torch.randn(N, T, HV, D, device=dev, dtype=bf16),
        v=torch.randn(N, T, HV, D, device=dev, dtype=bf16), g=g.to(bf16),
        beta=torch.randn(N, T, HV, device=dev, dtype=bf16),
        A_log=None if per_head else torch.log(torch.rand(HV, device=dev) * 15 + 1),
        dt_bias=None if per_head else 0.1 * torch.randn(HV, D, device=dev),
        state_pool=(0.1 * torch.randn(slots, HV, D, D, device=dev)).to(pool_dtype),
        state_indices=indices.reshape(N, T) if verify else indices,
        num_accepted_tokens=(torch.arange(N, device=dev, dtype=torch.int32) % T + 1) if verify else None,
    )
    if packed:
        for name in ("q", "k", "v", "g", "beta"):
            case[name] = case[name].reshape(1, N * T, *case[name].shape[2:])
        case["cu_seqlens"] = torch.arange(0, N * T + 1, T, device=dev, dtype=torch.int32)
    return case


def _ours(case: dict, per_head: bool, vsplit: int | None):
    from cute_kda.ops.decode import decode

    out = torch.empty_like(case["v"])
    gate = "none" if per_head else "safe"
    return lambda: decode(**case, gate=gate, scale=D ** -0.5, lower_bound=LOWER_BOUND, out=out, vsplit=vsplit)


def _fla(case: dict, per_head: bool):
    """FLA's call on the same tensors, or None when FLA does not import."""
    try:
        if per_head:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        else:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    q, k, v, g, beta = (case[name] for name in ("q", "k", "v", "g", "beta"))
    if per_head:
        states = case["state_pool"][: case["state_indices"].shape[0]]  # the batch's states, contiguous: FLA's best case
        return lambda: fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, scale=D ** -0.5, initial_state=states, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
            cu_seqlens=case.get("cu_seqlens"))
    out = torch.empty_like(v)
    return lambda: fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, A_log=case["A_log"], dt_bias=case["dt_bias"], scale=D ** -0.5,
        initial_state=case["state_pool"], inplace_final_state=True, state_v_first=True,
        ssm_state_indices=case["state_indices"], num_accepted_tokens=case["num_accepted_tokens"],
        cu_seqlens=case.get("cu_seqlens"),
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=LOWER_BOUND, out=out)


def _copy_us(nbytes: int, warmup: int, rep: int) -> dict[str, float]:
    """µs of two device-to-device copies moving ``nbytes`` (half read, half written) of random fp32 values:
    ``memcpy`` (cudaMemcpyAsync, what ``copy_`` of contiguous tensors calls) and ``sm`` (torch's vectorized
    elementwise kernel, x + 0)."""
    src = torch.rand(max(nbytes // 8, 1), device="cuda")
    dst = torch.empty_like(src)
    return {"memcpy": 1e3 * graph_median_ms(lambda: dst.copy_(src), warmup, rep),
            "sm": 1e3 * graph_median_ms(lambda: torch.add(src, 0.0, out=dst), warmup, rep)}


def _floor_us(warmup: int, rep: int) -> float:
    """µs of the smallest kernel timed as the rows are (a one-element add under graph replay, L2 cleared): no call,
    ours or FLA's, can take less."""
    x = torch.zeros(1, device="cuda")
    return 1e3 * graph_median_ms(lambda: torch.add(x, 0.0, out=x), warmup, rep)


def _time_us(fn, warmup: int, rep: int) -> float | None:
    if fn is None:
        return None
    fn()  # compile / JIT outside the capture
    torch.cuda.synchronize()
    ms = graph_median_ms(fn, warmup, rep)
    return None if ms is None else 1e3 * ms


def _row(N: int, HV: int, pool: str, mode: str, per_head: bool, args) -> list[str]:
    from cute_kda.device import sm_count
    from cute_kda.kernels.decode import DecodeVariant
    from cute_kda.layouts.decode import DecodeThreadMap

    T = MODES[mode]
    verify = mode.endswith("verify")
    packed = mode.startswith("packed")
    case = _inputs(N, T, HV, POOLS[pool], per_head, verify, packed=packed, ordered=args.ordered_slots)
    state_bytes = HV * D * D * case["state_pool"].element_size()
    traffic = N * state_bytes * (1 + (T if verify else 1))
    from cute_kda.ops import decode as decode_ops

    paired = decode_ops.takes_paired(N, HV, sm_count(0), T, verify, "vk", POOLS[pool], None,
                                     torch.int32 if packed else None)
    auto = DecodeVariant.choose_vsplit(N, HV, sm_count(0), "vk", pool, paired)
    ours = _time_us(_ours(case, per_head, None), args.warmup, args.rep)
    fla = (_time_us(_fla(case, per_head), args.warmup, args.rep) if not (per_head and verify or args.no_fla)
           else None)
    copies = _copy_us(traffic, args.warmup, args.rep)
    copy = min(copies.values())
    print(f"copy µs: {copies}", file=sys.stderr)
    cells = [str(N), str(HV), pool, mode + (" (per head)" if per_head else ""),
             f"{auto}{' paired' if paired else ''}", f"{ours:.2f}",
             f"{traffic / ours / 1e3:.0f}", f"{traffic / copy / 1e3:.0f}", f"{100 * copy / ours:.0f} %",
             "–" if fla is None else f"{fla:.2f}", "–" if fla is None else f"{fla / ours:.2f}×",
             "–" if fla is None else f"{fla / max(copy, args.floor_us):.2f}×"]
    if args.slot_copy:  # decode rows: the same bytes at the same slots (slot_copy.py); a verify's pattern differs
        from slot_copy import slot_copy

        slotted = None if verify else _time_us(slot_copy(case["state_pool"], case["state_indices"]), args.warmup,
                                               args.rep)
        cells += ["–", "–"] if slotted is None else [f"{slotted:.2f}", f"{100 * slotted / ours:.0f} %"]
    if args.sweep:
        timed = {v: _time_us(_ours(case, per_head, v), args.warmup, args.rep)
                 for v in DecodeThreadMap.vsplits("vk", pool)}
        best = min(timed, key=timed.get)
        cells.append(f"{best}: {timed[best]:.2f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=list(SEQS))
    parser.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=list(HEADS))
    parser.add_argument("--pools", type=lambda s: s.split(","), default=list(POOLS))
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(ISSUE_MODES),
                        help=f"of {', '.join(MODES)}")
    parser.add_argument("--no-per-head", action="store_true", help="skip the GatedDeltaNet rows")
    parser.add_argument("--sweep", action="store_true", help="also time every V-split of each row")
    parser.add_argument("--slot-copy", action="store_true",
                        help="decode rows: also a copy of the same state bytes at the same slots (slot_copy.py)")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="the plain unrolled variants, not those loading every token ahead (A/B)")
    parser.add_argument("--no-paired", action="store_true",
                        help="one-token bf16 decodes without the paired variant (A/B, docs/perf-log.md D4)")
    parser.add_argument("--no-split-prep", action="store_true",
                        help="T = 2-4 calls preparing each token in every thread group, not once a warp (A/B, "
                             "perf-log D6)")
    parser.add_argument("--no-paired-loop", action="store_true",
                        help="packed bf16 decodes on the plain runtime loop, not the paired one (A/B, perf-log D8)")
    parser.add_argument("--no-split-prep-packed", action="store_true",
                        help="packed verifies on the runtime loop, not the split_prep schedule (A/B, perf-log D9)")
    parser.add_argument("--no-fla", action="store_true", help="skip FLA's columns")
    parser.add_argument("--ordered-slots", action="store_true",
                        help="slot ids in order, not a random permutation (how slot placement moves a row)")
    args = parser.parse_args()
    from cute_kda.ops import decode as decode_ops

    decode_ops.PREFETCH = not args.no_prefetch
    decode_ops.PAIRED = not args.no_paired
    decode_ops.PAIRED_LOOP = not args.no_paired_loop
    decode_ops.SPLIT_PREP_PACKED = not args.no_split_prep_packed
    decode_ops.SPLIT_PREP = not args.no_split_prep

    head = ["N", "HV", "pool", "mode", "vsplit", "µs", "state GB/s", "copy GB/s", "% copy", "FLA µs", "vs FLA",
            "ceiling vs FLA"]
    args.floor_us = _floor_us(args.warmup, args.rep)
    if args.slot_copy:
        head += ["slot copy µs", "% slot copy"]
    if args.sweep:
        head.append("best vsplit: µs")
    rows = []
    kinds = [False] + ([] if args.no_per_head else [True])
    for per_head in kinds:
        for pool in args.pools:
            for mode in args.modes:
                if per_head and mode.endswith("verify"):
                    continue
                for N in args.seqs:
                    for HV in args.heads:
                        rows.append(_row(N, HV, pool, mode, per_head, args))
                        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
                        torch.cuda.empty_cache()
                        if args.out:  # a run cut short keeps what it measured
                            save(_report(head, rows, args.floor_us, args.ordered_slots), args.out)
    publish(_report(head, rows, args.floor_us, args.ordered_slots), args.out)


def _report(head: list[str], rows: list[list[str]], floor_us: float, ordered: bool) -> str:
    return "\n".join([
        "# Decode / verify on a state pool (bench_decode.py)", "",
        environment("cutlass", "fla", labels={"cutlass": "nvidia-cutlass-dsl", "fla": "FLA"}), "",
        "KDA rows: safe gate per channel, l2norm and β sigmoid in the kernel, V-first pool, H = HV; per-head rows: "
        "a precomputed log decay per head (FLA GDN without pool indexing). µs: CUDA-graph replay, median, L2 cleared "
        "before each repetition; % copy: state bytes / time against the faster of two device copies of the same "
        "bytes (cudaMemcpyAsync, a vectorized SM kernel) timed the same way; copy GB/s: that copy's. ceiling vs FLA: "
        f"FLA's µs over the larger of the copy's µs and the launch floor ({floor_us:.2f} µs, a one-element kernel "
        "timed the same way): the most any kernel moving these bytes could gain on FLA. Slot ids "
        f"{'in order' if ordered else 'a random permutation'}.", "",
        markdown_table(head, rows), "",
    ])


if __name__ == "__main__":
    main()
