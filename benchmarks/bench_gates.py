"""The unbounded gates' forward: cute_kda against FLA's chunk_kda on the same inputs, one run.

Two gate forms (docs/numerics.md, "Unbounded gates"):

- ``softplus``: Kimi-Linear's ``g = −exp(A_log) · softplus(g_raw + dt_bias)`` from a raw bf16 gate, on the
  Kimi-Linear-48B prefill shapes (H = 32; ``exp(A_log) ~ U(1, 16)`` as the model's initialisation);
  FLA: ``use_gate_in_kernel=True`` without ``lower_bound``. FlashKDA cannot run this gate (it forms
  ``2^−G``, which overflows), so it is not a peer here.
- ``log_decay``: g given as the fp32 log decay (FLA's ``use_gate_in_kernel=False``), that same softplus gate
  evaluated outside, on design.md's main forward shape.

fp32 state in and out (v-first), l2norm and β logits in the kernels. Times are medians of
``triton.testing.do_bench`` (L2 cleared before every repetition); the rel-RMS columns compare with FLA's
outputs on the same inputs. The table is written to ``--out`` after every row.

    python benchmarks/bench_gates.py                                  # every row
    python benchmarks/bench_gates.py --shapes kimi_T4096_H32 --gates softplus
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_CUTE_KDA", "0")  # FLA's own kernels, not its dispatch to cute_kda

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cute_kda._bench import add_run_arguments, environment, markdown_table, median_ms, publish  # noqa: E402
from cute_kda.reference import rel_rms  # noqa: E402

from shapes import D, KIMI_SHAPES, SHAPES, make_inputs  # noqa: E402

ROWS = {**{name: "softplus" for name in KIMI_SHAPES}, "B1_T8192_H96": "log_decay"}
ALL_SHAPES = {**KIMI_SHAPES, "B1_T8192_H96": SHAPES["B1_T8192_H96"]}


def gate_inputs(name: str, gate: str, device: torch.device) -> dict:
    """The shape's inputs with the gate of ``gate``: a raw bf16 gate at Kimi-Linear's initialisation, or the
    fp32 log decay that gate gives."""
    shape = ALL_SHAPES[name]
    inputs = make_inputs(shape, device)
    gen = torch.Generator(device=device).manual_seed(1)
    inputs["A_log"] = torch.log(torch.rand(shape.heads, generator=gen, device=device) * 15 + 1)
    if gate == "log_decay":
        x = inputs["g"].float() + inputs["dt_bias"]
        inputs["g"] = -inputs["A_log"].exp()[:, None] * F.softplus(x)
        inputs["A_log"] = inputs["dt_bias"] = None
    return inputs


def peers(inputs: dict, gate: str) -> dict:
    import cute_kda

    tensors = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    out, final = torch.empty_like(inputs["v"]), torch.empty_like(inputs["initial_state"])
    softplus = gate == "softplus"
    fla_kwargs = dict(
        scale=D ** -0.5, initial_state=inputs["initial_state"], output_final_state=True, use_gate_in_kernel=softplus,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=False, lower_bound=None,
        state_v_first=True, cu_seqlens=inputs["cu_seqlens"],
    )
    if softplus:
        fla_kwargs.update(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"])
    runs = {"cute_kda": lambda: cute_kda.kda_forward(
        *tensors, scale=D ** -0.5, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], gate="softplus" if softplus
        else "none", initial_state=inputs["initial_state"], cu_seqlens=inputs["cu_seqlens"], out=out, final_state=final)}
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        runs["FLA chunk_kda"] = lambda: fla_chunk_kda(*tensors, **fla_kwargs)
    except ImportError as error:
        print(f"FLA not importable, skipped: {error}", file=sys.stderr)
    return runs


def bench_row(name: str, gate: str, device: torch.device, warmup: int, rep: int) -> dict:
    inputs = gate_inputs(name, gate, device)
    runs = peers(inputs, gate)
    row = {"shape": name, "gate": gate, "ms": {}, "err": None}
    with torch.inference_mode():
        results = {}
        for peer, fn in runs.items():
            o, state = fn()  # compile / autotune outside the timing
            results[peer] = (o.clone(), state.clone())
            row["ms"][peer] = median_ms(fn, warmup, rep)
            print(f"{name:18s} {gate:10s} {peer:14s} {row['ms'][peer]:8.3f} ms", file=sys.stderr)
        if "FLA chunk_kda" in results:
            (o, s), (o_ref, s_ref) = results["cute_kda"], results["FLA chunk_kda"]
            row["err"] = (rel_rms(o, o_ref), rel_rms(s, s_ref))
    del inputs, runs, results
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict]) -> str:
    head = ["shape", "gate", "cute_kda (ms)", "FLA chunk_kda (ms)", "FLA / cute_kda", "rel-RMS vs FLA: o / state"]
    table = []
    for row in rows:
        ms = row["ms"]
        fla = ms.get("FLA chunk_kda")
        table.append([row["shape"], row["gate"], f"{ms['cute_kda']:.3f}", f"{fla:.3f}" if fla else "—",
                      f"{fla / ms['cute_kda']:.2f}×" if fla else "—",
                      f"{row['err'][0]:.1e} / {row['err'][1]:.1e}" if row["err"] else "—"])
    return markdown_table(head, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, ALL_SHAPES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gates needs a CUDA GPU (Hopper)")
    device = torch.device("cuda")
    header = (f"{environment('cutlass', 'fla', 'triton')} · D={D}, fp32 state in/out (v-first), l2norm and β "
              "logits in the kernels; ratios > 1 mean cute_kda is faster")
    rows = []
    for name in args.shapes:
        rows.append(bench_row(name, ROWS[name], device, args.warmup, args.rep))
        table = f"{header}\n\n{markdown(rows)}\n"
        if args.out:
            Path(args.out).write_text(table)
    publish(table, args.out)


if __name__ == "__main__":
    main()
