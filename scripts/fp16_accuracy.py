"""What fp16 inputs lose on their way into the bf16 kernels, measured on the CPU with the references (issue 33).

FLA's chunk tests feed fp16 q, k, v (and a raw gate g), fp32 β (GatedDeltaNet) and fp32 or fp16 initial states.
For each case the inputs are drawn the way those tests draw them, in fp16, and three results are compared with the
fp64 gold recurrence on the fp16 values themselves (relative RMS, FLA's measure, for o and the final state):

- ``mirror``: the bf16 mirror (docs/numerics.md) on the inputs rounded to bf16 (β too), the state widened to fp32
  exactly: what a K1 / K2 that converts fp16 to bf16 where it loads (or an entry cast) computes;
- ``rounding``: the fp64 gold on the same bf16-rounded inputs: the part of that error the rounding of the inputs
  alone costs, whatever the arithmetic after it;
- ``pipeline``: the mirror against the gold on the rounded inputs: today's bf16 error on these distributions;
- ``beta``: (β fp32 cases) the mirror with β kept in fp32 (what K1 would read without the entry cast), to show
  what rounding β to bf16 costs;
- ``fp16``: the mirror of the fp16 kernels (option 2, as built): q, k, v and g as they are (widened exactly where
  bf16 is widened), o rounded to fp16, β rounded to bf16 where the call enters.

    python3 scripts/fp16_accuracy.py              # the table of docs/numerics.md, "fp16 inputs"
    python3 scripts/fp16_accuracy.py --backward   # the gradient table of docs/numerics.md, "fp16 training"
    python3 scripts/fp16_accuracy.py --backward --native   # beside it the fp16 forward's own backward (stage 4)

``--backward`` measures the gradients the same way (FLA's ``do = randn`` in fp16 and ``dht = randn`` fp32), against
the fp64 gold gradients on the fp16 values: fp16 training as built (:func:`trained`: the training executor on the
reference stages, docs/numerics.md "fp16 training") and, in brackets, the rounding of the inputs and dO to bf16
alone. :func:`measure_backward` also gives the bf16 mirror of the whole backward
(:func:`cute_kda.reference.backward.mirror_backward`) on the rounded inputs, which the build equals, and the pipeline
(that mirror against the gold on the rounded values). ``--native`` adds the training executor's backward under
:data:`cute_kda.executors.training.FP16_NATIVE_BACKWARD` (docs/numerics.md, "fp16 training", stage 4: the inputs as
given, not rounded to bf16).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda.reference import gold_backward, gold_forward, mirror_forward, rel_rms  # noqa: E402
from cute_kda.reference.backward import mirror_backward  # noqa: E402


class Case(NamedTuple):
    name: str
    seq_len: int
    heads: int
    value_heads: int
    gate: str  # "none" (log decay), "softplus" (raw gate, FLA's use_gate_in_kernel) or "head" (GatedDeltaNet)
    scale: float
    state: torch.dtype  # the initial state's dtype (randn in FLA's KDA tests)


CASES = (
    Case("KDA log decay, T63", 63, 1, 1, "none", 1.0, torch.float32),
    Case("KDA log decay, T1024", 1024, 2, 2, "none", 0.1, torch.float32),
    Case("KDA log decay, T2048, fp16 state", 2048, 2, 2, "none", 0.1, torch.float16),
    Case("KDA softplus gate, T1500", 1500, 2, 2, "softplus", 0.1, torch.float32),
    Case("GatedDeltaNet, T1024, GVA 2→4", 1024, 2, 4, "head", 0.1, torch.float32),
    Case("GatedDeltaNet, T2048, fp16 state", 2048, 2, 2, "head", 0.1, torch.float16),
)
DIM = 128


def inputs(case: Case, seed: int = 0) -> dict:
    """One case's inputs as FLA's ``test_chunk`` draws them: q, k, v uniform in [0, 1) fp16; the KDA log decay
    ``logsigmoid(randn)`` fp32, the raw gate ``randn`` fp16 with fp32 ``A_log``, ``dt_bias``, GatedDeltaNet's
    ``logsigmoid(rand)`` fp32 per head; β ``sigmoid(randn)`` (fp16 for KDA, fp32 for GatedDeltaNet); the state
    ``randn`` (KDA) or ``0.1·randn`` (GatedDeltaNet's varlen test draws fp16 ``randn``; scaled so its o is not
    all state)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, hv = 1, case.seq_len, case.heads, case.value_heads

    def draw(*shape, normal=False):
        x = torch.empty(*shape)
        return x.normal_(generator=gen) if normal else x.uniform_(generator=gen)

    x = dict(q=draw(b, t, h, DIM).half(), k=draw(b, t, h, DIM).half(), v=draw(b, t, hv, DIM).half())
    options = dict(gate="none", A_log=None, dt_bias=None)
    if case.gate == "none":
        x["g"] = F.logsigmoid(draw(b, t, hv, DIM, normal=True))
    elif case.gate == "softplus":
        x["g"] = draw(b, t, hv, DIM, normal=True).half()
        options = dict(gate="softplus", A_log=draw(hv, normal=True), dt_bias=draw(hv, DIM, normal=True))
    else:
        x["g"] = F.logsigmoid(draw(b, t, hv))
    beta = torch.sigmoid(draw(b, t, hv, normal=True))
    x["beta"] = beta if case.gate == "head" else beta.half()
    state = draw(b, hv, DIM, DIM, normal=True) * (0.1 if case.gate == "head" else 1.0)
    x["initial_state"] = state.to(case.state)
    return dict(x, **options, scale=case.scale)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16() if x.dtype == torch.float16 else x


def measure(case: Case, seed: int = 0) -> dict[str, tuple[float, float]]:
    """(o, final state) rel-RMS against the fp64 gold on the fp16 inputs, per comparison of the module doc."""
    x = inputs(case, seed)
    common = dict(qk_l2norm=True, beta_logits=False, output_final_state=True, state_layout="kv")
    tensors = ("q", "k", "v", "g", "beta")
    params = dict(gate=x["gate"], A_log=x["A_log"], dt_bias=x["dt_bias"], scale=x["scale"])
    gold = gold_forward(*(x[n] for n in tensors), initial_state=x["initial_state"], **params, **common)
    rounded = {n: _bf16(x[n]) for n in tensors}
    rounded["beta"] = x["beta"].bfloat16()
    state32 = x["initial_state"].float()  # fp16 → fp32 is exact
    gold_rounded = gold_forward(*(rounded[n] for n in tensors), initial_state=state32, **params, **common)
    mirror = mirror_forward(*(rounded[n] for n in tensors), initial_state=state32, state_dtype=torch.float32,
                            **params, **common)

    def pair(result, reference):
        return rel_rms(result[0], reference[0]), rel_rms(result[1], reference[1])

    out = dict(mirror=pair(mirror, gold), rounding=pair(gold_rounded, gold), pipeline=pair(mirror, gold_rounded))
    fp16 = dict(x, beta=x["beta"].bfloat16())
    out["fp16"] = pair(mirror_forward(*(fp16[n] for n in tensors), initial_state=state32, state_dtype=torch.float32,
                                      **params, **common), gold)
    if x["beta"].dtype == torch.float32:
        exact_beta = dict(rounded, beta=x["beta"])
        out["beta"] = pair(mirror_forward(*(exact_beta[n] for n in tensors), initial_state=state32,
                                          state_dtype=torch.float32, **params, **common), gold)
    return out


GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def trained(x: dict, do: torch.Tensor, dht: torch.Tensor, *, recompute: bool = False,
            native: bool = False) -> dict[str, torch.Tensor]:
    """The gradients of fp16 training as built: ``x`` (fp16, :func:`inputs`) through the training executor on the
    reference stages (the fp16 forward's mirror, then the backward of docs/numerics.md, "fp16 training"; ``native``:
    under :data:`~cute_kda.executors.training.FP16_NATIVE_BACKWARD`), every input a leaf; ``dht`` and the returned
    dh0 in the gold's ``[K, V]`` layout (the executor's is ``[V, K]``)."""
    from cute_kda.executors import training
    from cute_kda.reference.backend import REFERENCE

    switch = training.FP16_NATIVE_BACKWARD
    training.FP16_NATIVE_BACKWARD = native
    try:
        return _trained(training.kda_forward, REFERENCE, x, do, dht, recompute)
    finally:
        training.FP16_NATIVE_BACKWARD = switch


def _trained(kda_forward, backend, x: dict, do: torch.Tensor, dht: torch.Tensor,
             recompute: bool) -> dict[str, torch.Tensor]:
    names = ("q", "k", "v", "g", "beta", "initial_state")
    given = dict(x, initial_state=x["initial_state"].transpose(-1, -2))
    leaves = {n: given[n].contiguous().clone().requires_grad_() for n in names}
    o, ht = kda_forward(*(leaves[n] for n in names[:5]), initial_state=leaves["initial_state"],
                        output_final_state=True, gate=x["gate"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                        scale=x["scale"], qk_l2norm=True, beta_logits=False, recompute=recompute, backend=backend)
    torch.autograd.backward([o, ht], [do, dht.transpose(-1, -2).to(ht.dtype)])
    grads = {GRADIENTS[i]: leaves[n].grad for i, n in enumerate(names)}
    grads["dh0"] = grads["dh0"].transpose(-1, -2)
    return grads


def measure_backward(case: Case, seed: int = 0, native: bool = False) -> dict[str, tuple[float, ...]]:
    """Per gradient: (through bf16, the rounding alone, the pipeline, fp16 training as built[, under
    ``FP16_NATIVE_BACKWARD`` with ``native``]) rel-RMS, as the module doc's ``--backward``."""
    x = inputs(case, seed)
    gen = torch.Generator().manual_seed(seed + 5)
    do = torch.randn(x["v"].shape, generator=gen).half()
    dht = torch.randn(x["initial_state"].shape, generator=gen).to(x["initial_state"].dtype).float()  # as the state
    tensors = ("q", "k", "v", "g", "beta")
    options = dict(gate=x["gate"], A_log=x["A_log"], dt_bias=x["dt_bias"], scale=x["scale"], qk_l2norm=True,
                   beta_logits=False, state_layout="kv", dht=dht)
    gold = gold_backward(*(x[n] for n in tensors), do, initial_state=x["initial_state"], **options)
    rounded = [_bf16(x[n]) for n in ("q", "k", "v", "g")] + [x["beta"].bfloat16(), do.bfloat16()]
    state32 = x["initial_state"].float()
    mirror = mirror_backward(*rounded, initial_state=state32, **options)
    gold_rounded = gold_backward(*rounded, initial_state=state32, **options)
    built = trained(x, do, dht)
    own = trained(x, do, dht, native=True) if native else {}
    return {name: (rel_rms(mirror[name], gold[name]), rel_rms(gold_rounded[name], gold[name]),
                   rel_rms(mirror[name], gold_rounded[name]), rel_rms(built[name], gold[name]),
                   *((rel_rms(own[name], gold[name]),) if native else ())) for name in GRADIENTS}


def backward_table(native: bool = False) -> str:
    """Per case and gradient: fp16 training as built, in brackets the rounding of the inputs and dO alone; with
    ``native`` the copy route → the native backward instead."""
    rows = ["| case | " + " | ".join(GRADIENTS) + " |", "|---|" + "---|" * len(GRADIENTS)]
    for case in CASES:
        m = measure_backward(case, native=native)
        cells = (f"{m[n][3]:.1e} → {m[n][4]:.1e}" if native else f"{m[n][3]:.1e} ({m[n][1]:.1e})" for n in GRADIENTS)
        rows.append(f"| {case.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table() -> str:
    rows = ["| case | mirror (o / state) | rounding alone | pipeline | β kept fp32 | fp16 kernels |",
            "|---|---|---|---|---|---|"]
    for case in CASES:
        m = measure(case)
        cell = lambda key: f"{m[key][0]:.2e} / {m[key][1]:.2e}" if key in m else "—"  # noqa: E731
        rows.append(f"| {case.name} | {cell('mirror')} | {cell('rounding')} | {cell('pipeline')} | {cell('beta')} "
                    f"| {cell('fp16')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    torch.set_num_threads(1)
    arguments = sys.argv[1:]
    print(backward_table("--native" in arguments) if "--backward" in arguments else table(), flush=True)
