"""Gradient accuracy side by side: cute_kda's and FLA's ``chunk_kda`` against the fp64 gold, same inputs.

Issue 10 asks ours to be no worse than FLA's. Each case runs both through FLA's signature (FLA kept on
its own kernels), computes every gradient's rel-RMS against :func:`cute_kda.reference.gold_backward`
and asserts ours ≤ 1.25 × FLA's or within the issue's target. GPU tier, marker ``fla`` (FLA's Triton
autotuning makes these slow: run them in their own call).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from cute_kda.reference import gold_backward, rel_rms

pytestmark = [pytest.mark.gpu, pytest.mark.fla]

D = 128
TARGET = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dA_log": 8e-3,
          "ddt_bias": 8e-3}
LEAVES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log", "dt_bias": "ddt_bias",
          "initial_state": "dh0"}
CASES = {
    "B2_T100": dict(lengths=None, B=2, T=100, seed=100),
    "varlen_300-0-5-64-1": dict(lengths=[300, 0, 5, 64, 1], B=1, T=370, seed=5),
    "A_log_2.5-3": dict(lengths=None, B=1, T=200, seed=4, a_log=(2.5, 3.0)),
    # dA_log 1.2e-2 against FLA's 7.2e-3 on the H200 (2026-12-01, benchmarks/results/2026-12-01-grads-vs-fla.md);
    # the other seven gradients pass. The sum cancels and either side can lose: at g_normal_bias_8 FLA's is 1.7e-2
    # against our 3.3e-3.
    "B1_T2048": dict(lengths=None, B=1, T=2048, seed=7, xfail="dA_log 1.2e-2 > 1.25 x FLA's 7.2e-3"),
    # low decay: g ~ N(0, 1) with dt_bias = 8 (test_bwd_grads' strict dA_log xfail draws g = 8·N(0, 1))
    "g_normal_bias_8": dict(lengths=None, B=2, T=97, seed=1, g_normal=True, dt_bias=8.0),
}


@pytest.fixture(scope="module")
def fla_chunk_kda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    os.environ["FLA_CUTE_KDA"] = "0"  # FLA on its own kernels
    fla_kda = pytest.importorskip("fla.ops.kda")
    return fla_kda.chunk_kda


def _inputs(case: dict, heads: int = 2):
    gen = torch.Generator().manual_seed(case["seed"])
    B, T = case["B"], case["T"]
    N = B if case["lengths"] is None else len(case["lengths"])
    q, k, v = (torch.randn(B, T, heads, D, generator=gen).bfloat16() for _ in range(3))
    shape = (B, T, heads, D)
    g = (torch.randn(shape, generator=gen) if case.get("g_normal") else torch.rand(shape, generator=gen) * 8 - 4).bfloat16()
    beta = (torch.randn(B, T, heads, generator=gen) * 2).bfloat16()
    A_log = torch.tensor(case["a_log"]) if "a_log" in case else torch.rand(heads, generator=gen) - 0.5
    dt_bias = torch.full((heads * D,), case["dt_bias"]) if "dt_bias" in case else torch.randn(heads * D, generator=gen)
    h0 = torch.randn(N, heads, D, D, generator=gen) * 0.3
    do = torch.randn(B, T, heads, D, generator=gen).bfloat16()
    dht = torch.randn(N, heads, D, D, generator=gen) * 0.3
    cu = None if case["lengths"] is None else torch.tensor([0, *itertools.accumulate(case["lengths"])])
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0), do, dht, cu


def _grads(chunk_kda, inputs: dict, do, dht, cu) -> dict:
    leaves = {n: x.cuda().requires_grad_() for n, x in inputs.items()}
    o, ht = chunk_kda(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=D ** -0.5,
        initial_state=leaves["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
        A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], state_v_first=True,
        cu_seqlens=None if cu is None else cu.cuda(), cu_seqlens_cpu=cu,
    )
    torch.autograd.backward([o, ht], [do.cuda(), dht.cuda()])
    torch.cuda.synchronize()
    return {LEAVES[n]: x.grad.float().cpu() for n, x in leaves.items()}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=CASES[name]["xfail"])) if "xfail" in CASES[name]
    else name for name in sorted(CASES)
])
def test_no_worse_than_fla(name, fla_chunk_kda):
    import cute_kda

    inputs, do, dht, cu = _inputs(CASES[name])
    p = dict(inputs)
    gold = gold_backward(p.pop("q"), p.pop("k"), p.pop("v"), p.pop("g"), p.pop("beta"), do, dht=dht,
                         A_log=p.pop("A_log"), dt_bias=p.pop("dt_bias").view(-1, D), initial_state=p.pop("initial_state"),
                         cu_seqlens=cu, lower_bound=-5.0)
    ours = _grads(cute_kda.chunk_kda, inputs, do, dht, cu)
    theirs = _grads(fla_chunk_kda, inputs, do, dht, cu)
    rows = []
    for grad in TARGET:
        want = gold[grad].reshape(ours[grad].shape)
        err_ours, err_fla = rel_rms(ours[grad], want), rel_rms(theirs[grad], want)
        rows.append((grad, err_ours, err_fla))
    print(f"{name}: " + ", ".join(f"{g} {a:.1e} (FLA {b:.1e})" for g, a, b in rows))
    for grad, err_ours, err_fla in rows:
        assert err_ours <= max(1.25 * err_fla, TARGET[grad]), (name, grad, err_ours, err_fla)
