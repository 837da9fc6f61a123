"""Host µs per call of ``kda_forward`` and ``chunk_kda`` at B1 T64 H16, and of the serving entry points on a state
pool, in a short process for A/B runs.

``kda_forward`` with an fp32 initial state and output buffers given; ``chunk_kda`` with FLA's flags
(in-kernel gate, l2norm and β-sigmoid, fp32 state v-first, final state allocated). Serving (issue 32's target:
≤ 15 µs a decode call), N = 32 sequences × 16 heads on an fp32 V-first pool, FLA's KDA layer flags (softplus gate,
dt_bias ``[HV·K]``), the engine's steady loop (pool, slot ids and ``out`` given): ``decode`` (T = 1, one slot id
per sequence, a padding row), ``verify`` (S = 3: slot ids ``[N, 4]`` and accepted counts), and
``decode_launcher``, the bare :func:`cute_kda.ops.decode.decode` under ``decode`` (what the serving checks add);
``gdn_decode`` / ``gdn_verify`` / ``gdn_decode_beta_none``: ``fused_recurrent_gated_delta_rule`` as Qwen3-Next's
layer calls it (8 key heads for the 16 value heads, a per-head gate in the kernel, beta given or None), same pool.
Per entry point: the minimum and the median over 15 rounds of 200 back-to-back calls (the GPU drained between
rounds).

For an A/B of two checkouts on one machine, interleave the processes so that the host's drift (up to
1.5× between consecutive runs on the H200 hosts) hits both alike; the label names the tree:

    for i in 1 2 3 4 5; do for t in old new; do (cd $t && python3 benchmarks/host_calls.py $t); done; done

A second argument picks a group of rows (``forward`` or ``serving``; default ``all``).

``bench_host.py`` is the full table (more shapes, FLA, idle-GPU latency, graph time); ``bench_host_stub.py`` times
these rows' Python path on a machine without a GPU (CUDA stubbed).
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


def entry_points(rows: str = "all") -> dict[str, Callable[[], object]]:
    """The rows on the GPU: ``all``, ``serving`` or ``forward`` (only that group's inputs are built)."""
    device = torch.device("cuda")
    serving = serving_entry_points(device) if rows in ("all", "serving") else {}
    return {**serving, **(forward_entry_points(device) if rows in ("all", "forward") else {})}


def forward_entry_points(device: torch.device) -> dict[str, Callable[[], object]]:
    """The ``kda_forward`` and ``chunk_kda`` rows (module doc) on ``device`` (``bench_host_stub.py``: the CPU)."""
    inputs = make_inputs(Shape((64,), 16), device)
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


def serving_entry_points(device: torch.device, num_seqs: int = 32, heads: int = 16,
                         draft: int = 3) -> dict[str, Callable[[], object]]:
    """The serving rows (module doc) on ``device``: decode and verify steps on one pool, their outputs given."""
    from cute_kda.ops.decode import decode

    width = 1 + draft
    decode_in = make_inputs(Shape((1,) * num_seqs, heads), device)
    verify_in = make_inputs(Shape((width,) * num_seqs, heads), device, seed=1)
    tokens = ("q", "k", "v", "g", "beta")
    pool = torch.zeros(num_seqs * (width + 1), heads, 128, 128, dtype=torch.float32, device=device)
    A_log, dt_bias = decode_in["A_log"], decode_in["dt_bias"].reshape(-1)  # the layer's [HV·K]
    slots = torch.arange(num_seqs, dtype=torch.int32, device=device)
    slots[1] = -1
    verify_slots = (num_seqs + torch.arange(num_seqs * width, dtype=torch.int32, device=device)).reshape(-1, width)
    accepted = torch.ones(num_seqs, dtype=torch.int32, device=device)
    decode_out, verify_out = torch.empty_like(decode_in["v"]), torch.empty_like(verify_in["v"])
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True)
    gdn_decode_in, gdn_verify_in = gdn_tokens(decode_in, heads // 2), gdn_tokens(verify_in, heads // 2)
    gdn_flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                     dt_bias=decode_in["dt_bias"][:, 0].contiguous(), state_v_first=True)
    return {
        "decode": lambda: cute_kda.fused_recurrent_kda(
            *(decode_in[name] for name in tokens), A_log, dt_bias, initial_state=pool, ssm_state_indices=slots,
            out=decode_out, **flags),
        "verify": lambda: cute_kda.fused_recurrent_kda(
            *(verify_in[name] for name in tokens), A_log, dt_bias, initial_state=pool,
            ssm_state_indices=verify_slots, num_accepted_tokens=accepted, out=verify_out, **flags),
        "decode_launcher": lambda: decode(
            *(decode_in[name] for name in tokens), A_log, decode_in["dt_bias"], pool, slots, gate="softplus",
            scale=128 ** -0.5, out=decode_out),
        "gdn_decode": lambda: cute_kda.fused_recurrent_gated_delta_rule(
            **gdn_decode_in, initial_state=pool, ssm_state_indices=slots, out=decode_out, **gdn_flags),
        "gdn_verify": lambda: cute_kda.fused_recurrent_gated_delta_rule(
            **gdn_verify_in, initial_state=pool, ssm_state_indices=verify_slots, num_accepted_tokens=accepted,
            out=verify_out, **gdn_flags),
        "gdn_decode_beta_none": lambda: cute_kda.fused_recurrent_gated_delta_rule(
            **{**gdn_decode_in, "beta": None}, initial_state=pool, ssm_state_indices=slots, out=decode_out,
            **gdn_flags),
    }


def gdn_tokens(inputs: dict, key_heads: int) -> dict:
    """GatedDeltaNet's tokens from KDA's: q, k of the first ``key_heads`` heads (grouped value heads), the gate
    per head (``[B, T, HV]``), each contiguous."""
    return dict(q=inputs["q"][:, :, :key_heads].contiguous(), k=inputs["k"][:, :, :key_heads].contiguous(),
                v=inputs["v"], g=inputs["g"][..., 0].contiguous(), beta=inputs["beta"])


def host_us(fn: Callable[[], object], calls: int = 200, rounds: int = 15) -> tuple[float, float]:
    """(minimum, median) µs per call over ``rounds`` rounds of ``calls`` calls."""
    per_call = host_round_us(fn, calls, rounds)
    return min(per_call), statistics.median(per_call)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_calls needs a CUDA GPU (Hopper)")
    label = sys.argv[1] if len(sys.argv) > 1 else "cute_kda"
    with torch.inference_mode():
        runs = entry_points(sys.argv[2] if len(sys.argv) > 2 else "all")
        for fn in runs.values():
            fn()  # compile or load from the disk cache
        figures = {name: host_us(fn) for name, fn in runs.items()}
    print(label, " ".join(f"{name} min {low:.1f} med {mid:.1f}" for name, (low, mid) in figures.items()), flush=True)


if __name__ == "__main__":
    main()
