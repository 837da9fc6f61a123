"""The unbounded gates' forward: cute_kda against FLA's chunk_kda on the same inputs, one run.

Two gate forms (docs/numerics.md, "Unbounded gates"):

- ``softplus``: Kimi-Linear's ``g = −exp(A_log) · softplus(g_raw + dt_bias)`` from a raw bf16 gate, on the
  Kimi-Linear-48B prefill shapes (H = 32; ``exp(A_log) ~ U(1, 16)`` as the model's initialisation);
  FLA: ``use_gate_in_kernel=True`` without ``lower_bound``. FlashKDA cannot run this gate (it forms
  ``2^−G``, which overflows), so it is not a peer here.
- ``log_decay``: g given as the fp32 log decay (FLA's ``use_gate_in_kernel=False``), that same softplus gate
  evaluated outside, on design.md's main forward shape.
- ``gdn_softplus`` / ``gdn_log_decay``: GatedDeltaNet (Qwen3-Next / Qwen3.5: H = 16 q/k heads, HV = 32 value
  heads), one decay per value head, through ``cute_kda.chunk_gated_delta_rule`` against FLA's
  ``chunk_gated_delta_rule`` with the same arguments (FLA's default ``[N, HV, K, V]`` fp32 state).

fp32 state in and out (v-first), l2norm and β logits in the kernels. Times are medians of
``triton.testing.do_bench`` (L2 cleared before every repetition); the rel-RMS columns compare with FLA's
outputs on the same inputs. The table is written to ``--out`` after every row.

    python benchmarks/bench_gates.py                                  # every row
    python benchmarks/bench_gates.py --shapes kimi_T4096_H32,gdn_T8192_H16_HV32
    python benchmarks/bench_gates.py --train --shapes kimi_T4096_H32,gdn_T8192_H16_HV32   # fwd+bwd steps

``--train`` times a training step instead: q, k, v, g, beta, A_log, dt_bias and the initial state require grad
(cute_kda's ``kda_forward`` keeps its checkpoints for the backward, its default; its ``chunk_gated_delta_rule``, as
FLA's, keeps no states and recomputes them, unless ``--gdn-disable-recompute``); one step is the forward and
``torch.autograd.backward((o, ht), (dO, dht))`` with fixed dO, dht, the gradients reset before each step; a peer
that raises (FLA's GDN backward refuses Hopper with Triton < 3.7.1) is reported with its error, not timed; the
rel-RMS columns then compare dq and dv with FLA's. ``--train --fla-unguarded`` turns that guard of FLA's off to
time its backward all the same: speed only, since FLA says its gradients are wrong there (no rel-RMS column; the
note says so).

The FLA column is FLA's ``chunk_kda`` for the KDA rows and its ``chunk_gated_delta_rule`` for the GDN rows.
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

from cute_kda._bench import (  # noqa: E402
    add_run_arguments, add_switches, apply_switches, environment, markdown_table, median_ms, publish)
from cute_kda.reference import rel_rms  # noqa: E402

from shapes import D, KIMI_SHAPES, SHAPES, make_inputs  # noqa: E402

GDN_SHAPES = {  # (lengths, q/k heads, value heads)
    "gdn_T8192_H16_HV32": ((8192,), 16, 32),
    "gdn_T32768_H16_HV32": ((32768,), 16, 32),
    "gdn_varlen6_H16_HV32": ((1300, 547, 2048, 963, 271, 3063), 16, 32),
}
ROWS = {**{name: "softplus" for name in KIMI_SHAPES}, "B1_T8192_H96": "log_decay",
        "gdn_T8192_H16_HV32": "gdn_softplus", "gdn_T32768_H16_HV32": "gdn_softplus",
        "gdn_varlen6_H16_HV32": "gdn_log_decay"}
ALL_SHAPES = {**KIMI_SHAPES, "B1_T8192_H96": SHAPES["B1_T8192_H96"], **GDN_SHAPES}


def gate_inputs(name: str, gate: str, device: torch.device) -> dict:
    """The shape's inputs with the gate of ``gate``: a raw bf16 gate at Kimi-Linear's initialisation, or the
    fp32 log decay that gate gives."""
    if gate.startswith("gdn"):
        return gdn_inputs(name, gate, device)
    shape = ALL_SHAPES[name]
    inputs = make_inputs(shape, device)
    gen = torch.Generator(device=device).manual_seed(1)
    inputs["A_log"] = torch.log(torch.rand(shape.heads, generator=gen, device=device) * 15 + 1)
    if gate == "log_decay":
        x = inputs["g"].float() + inputs["dt_bias"]
        inputs["g"] = -inputs["A_log"].exp()[:, None] * F.softplus(x)
        inputs["A_log"] = inputs["dt_bias"] = None
    return inputs


def gdn_inputs(name: str, gate: str, device: torch.device) -> dict:
    """GatedDeltaNet's ``chunk_gated_delta_rule`` arguments: q, k ``[B, T, H, D]``; v ``[B, T, HV, D]``; g ``[B, T, HV]``
    raw bf16 (with A_log, dt_bias ``[HV]``) or the fp32 log decay; β logits; an fp32 ``[N, HV, K, V]`` state."""
    lengths, heads, value_heads = GDN_SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    varlen = len(lengths) > 1
    batch, steps = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    A_log = torch.log(torch.rand(value_heads, generator=gen, device=device) * 15 + 1)
    dt_bias = torch.rand(value_heads, generator=gen, device=device)
    g = randn(batch, steps, value_heads)
    kwargs = dict(q=randn(batch, steps, heads, D), k=randn(batch, steps, heads, D), v=randn(batch, steps, value_heads, D),
                  beta=randn(batch, steps, value_heads), scale=D ** -0.5, output_final_state=True,
                  initial_state=0.1 * randn(len(lengths), value_heads, D, D, dtype=torch.float32),
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  cu_seqlens=torch.tensor((0, *lengths), device=device).cumsum(0) if varlen else None)
    if gate == "gdn_softplus":
        kwargs.update(g=g, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    else:
        kwargs.update(g=-A_log.exp() * F.softplus(g.float() + dt_bias))
    return kwargs


def gdn_peers(kwargs: dict, disable_recompute: bool = False) -> dict:
    import cute_kda

    extension = dict(disable_recompute=True) if disable_recompute else {}  # cute_kda's: keep the states
    runs = {"cute_kda": lambda: cute_kda.chunk_gated_delta_rule(**kwargs, **extension)}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

        runs["FLA chunk_kda"] = lambda: fla_gdn(**kwargs)
    except ImportError as error:
        print(f"FLA not importable, skipped: {error}", file=sys.stderr)
    return runs


def peers(inputs: dict, gate: str, train: bool = False, gdn_disable_recompute: bool = False) -> dict:
    """The calls to time, by peer; ``train``: cute_kda allocates its outputs (autograd records the call);
    ``gdn_disable_recompute``: cute_kda's GatedDeltaNet call keeps its states for the backward."""
    import cute_kda

    if gate.startswith("gdn"):
        return gdn_peers(inputs, gdn_disable_recompute)

    tensors = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    out, final = torch.empty_like(inputs["v"]), torch.empty_like(inputs["initial_state"])
    softplus = gate == "softplus"
    fla_kwargs = dict(
        scale=D ** -0.5, initial_state=inputs["initial_state"], output_final_state=True, use_gate_in_kernel=softplus,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=False, lower_bound=None,
        state_v_first=True, cu_seqlens=inputs["cu_seqlens"],
    )
    if softplus:  # FLA's dt_bias is flat, [H·D]; its backward returns that shape
        fla_kwargs.update(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"].flatten())
    buffers = dict(output_final_state=True) if train else dict(out=out, final_state=final)
    runs = {"cute_kda": lambda: cute_kda.kda_forward(
        *tensors, scale=D ** -0.5, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], gate="softplus" if softplus
        else "none", initial_state=inputs["initial_state"], cu_seqlens=inputs["cu_seqlens"], **buffers)}
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        runs["FLA chunk_kda"] = lambda: fla_chunk_kda(*tensors, **fla_kwargs)
    except ImportError as error:
        print(f"FLA not importable, skipped: {error}", file=sys.stderr)
    return runs


PEERS = ("cute_kda", "FLA")  # --peers' choices, by the first word of a peer's name
# the library switches of GatedDeltaNet's training step a run can flip (cute_kda._bench.SWITCHES)
GDN_SWITCHES = ("--no-group-sum", "--no-pair-training", "--no-states-only-passes", "--no-partner-fields",
                "--no-split-recompute")


def bench_row(name: str, gate: str, device: torch.device, warmup: int, rep: int,
              only: tuple[str, ...] = PEERS) -> dict:
    inputs = gate_inputs(name, gate, device)
    runs = {peer: fn for peer, fn in peers(inputs, gate).items() if peer.split()[0] in only}
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


def unguard_fla_backward() -> str:
    """Turn off FLA's refusal of its gated ``chunk_bwd_dqkwg`` on Hopper with Triton 3.4-3.7.0 (FLA #640: wrong
    results there, not a crash), so that its backward can be timed; returns the note for the table."""
    from fla.ops.common import chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return "Triton guard (#640) off: speed only, its gradients are wrong on this Triton"


def training_problem(name: str, gate: str, device: torch.device) -> tuple[dict, list[str], torch.Tensor, torch.Tensor]:
    """A training step's inputs: :func:`gate_inputs` with every floating tensor among q, k, v, g, beta, A_log,
    dt_bias and the initial state a leaf that requires grad; returns (inputs, the leaves' names, dO, dht)."""
    inputs = gate_inputs(name, gate, device)
    leaves = [n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
              if isinstance(inputs.get(n), torch.Tensor) and inputs[n].is_floating_point()]
    for n in leaves:
        inputs[n] = inputs[n].detach().requires_grad_()
    gen = torch.Generator(device=device).manual_seed(2)
    do = torch.randn(inputs["v"].shape, generator=gen, device=device).bfloat16()
    dht = torch.randn(inputs["initial_state"].shape, generator=gen, device=device)
    return inputs, leaves, do, dht


def train_row(name: str, gate: str, device: torch.device, warmup: int, rep: int, fla_note: str | None = None,
              only: tuple[str, ...] = PEERS, gdn_disable_recompute: bool = False) -> dict:
    """One row of ``--train``: the median fwd+bwd step per peer, or the error that stopped it;
    ``fla_note``: FLA's guard is off (:func:`unguard_fla_backward`), so its gradients are not compared;
    ``gdn_disable_recompute``: cute_kda's GatedDeltaNet call keeps its states for the backward."""
    inputs, leaves, do, dht = training_problem(name, gate, device)
    calls = peers(inputs, gate, train=True, gdn_disable_recompute=gdn_disable_recompute)
    runs = {peer: fn for peer, fn in calls.items() if peer.split()[0] in only}
    row = {"shape": name, "gate": gate, "ms": {}, "err": None, "notes": {}}
    grads = {}
    for peer, fn in runs.items():
        def step():
            for n in leaves:
                inputs[n].grad = None
            o, state = fn()
            torch.autograd.backward((o, state), (do, dht))
        try:
            step()  # compile / autotune outside the timing
        except Exception as error:  # noqa: BLE001 - a peer that cannot train is reported, not timed
            row["notes"][peer] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            print(f"{name:18s} {gate:10s} {peer:14s} refused: {row['notes'][peer]}", file=sys.stderr)
            continue
        grads[peer] = (inputs["q"].grad.clone(), inputs["v"].grad.clone())
        row["ms"][peer] = median_ms(step, warmup, rep)
        print(f"{name:18s} {gate:10s} {peer:14s} {row['ms'][peer]:8.3f} ms / step", file=sys.stderr)
    if fla_note is not None and "FLA chunk_kda" in row["ms"]:
        row["notes"]["FLA chunk_kda"] = fla_note
    elif len(grads) == 2:
        (dq, dv), (dq_ref, dv_ref) = grads["cute_kda"], grads["FLA chunk_kda"]
        row["err"] = (rel_rms(dq, dq_ref), rel_rms(dv, dv_ref))
    del inputs, runs, grads
    torch.cuda.empty_cache()
    return row


def train_markdown(rows: list[dict]) -> str:
    head = ["shape", "gate", "cute_kda fwd+bwd (ms)", "FLA fwd+bwd (ms)", "cute_kda / FLA", "rel-RMS vs FLA: dq / dv",
            "notes"]
    table = []
    for row in rows:
        ms, fla = row["ms"], row["ms"].get("FLA chunk_kda")
        ours = ms.get("cute_kda")
        table.append([row["shape"], row["gate"], f"{ours:.3f}" if ours else "—", f"{fla:.3f}" if fla else "—",
                      f"{ours / fla:.2f}×" if ours and fla else "—",
                      f"{row['err'][0]:.1e} / {row['err'][1]:.1e}" if row["err"] else "—",
                      "; ".join(f"{peer}: {note}" for peer, note in row["notes"].items()) or "—"])
    return markdown_table(head, table)


def markdown(rows: list[dict]) -> str:
    head = ["shape", "gate", "cute_kda (ms)", "FLA (ms)", "FLA / cute_kda", "rel-RMS vs FLA: o / state"]
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
    parser.add_argument("--train", action="store_true", help="time fwd+bwd steps instead of the forward")
    parser.add_argument("--fla-unguarded", action="store_true",
                        help="with --train: time FLA's backward with its Triton guard (#640) off (speed only)")
    parser.add_argument("--peers", type=lambda text: tuple(text.split(",")), default=PEERS,
                        help="comma-separated peers to time: cute_kda, FLA (default both)")
    parser.add_argument("--gdn-disable-recompute", action="store_true",
                        help="with --train: cute_kda's GatedDeltaNet call keeps K1's workspace and the per-tile states "
                             "for the backward (disable_recompute=True) instead of recomputing them, FLA's semantics")
    add_switches(parser, GDN_SWITCHES)  # with --train
    args = parser.parse_args()
    apply_switches(args, GDN_SWITCHES)
    if args.fla_unguarded and not args.train:
        parser.error("--fla-unguarded goes with --train")
    if not torch.cuda.is_available():
        sys.exit("bench_gates needs a CUDA GPU (Hopper)")
    device = torch.device("cuda")
    header = (f"{environment('cutlass', 'fla', 'triton')} · D={D}, fp32 state in/out (v-first), l2norm and β "
              "logits in the kernels; " + ("fwd+bwd steps, every input requiring grad; ratios < 1 mean cute_kda is "
                                           "faster" if args.train else "ratios > 1 mean cute_kda is faster"))
    fla_note = unguard_fla_backward() if args.fla_unguarded else None
    rows = []
    for name in args.shapes:
        if args.train:
            rows.append(train_row(name, ROWS[name], device, args.warmup, args.rep, fla_note, only=args.peers,
                                  gdn_disable_recompute=args.gdn_disable_recompute))
        else:
            rows.append(bench_row(name, ROWS[name], device, args.warmup, args.rep, only=args.peers))
        table = f"{header}\n\n{(train_markdown if args.train else markdown)(rows)}\n"
        if args.out:
            Path(args.out).write_text(table)
    publish(table, args.out)


if __name__ == "__main__":
    main()
