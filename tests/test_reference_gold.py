"""The gold token recurrence: semantics, state handling, varlen, autograd, and parity with FLA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cute_kda.reference import gold_forward, rel_rms
from cute_kda.reference.gold import gate_log_decay, l2norm


def _inputs(B=1, T=40, H=2, K=16, V=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = torch.rand(B, T, H, K, generator=gen, dtype=dtype) * 16 - 8
    beta = torch.randn(B, T, H, generator=gen, dtype=dtype)
    A_log = torch.rand(H, generator=gen, dtype=dtype)
    dt_bias = torch.randn(H, K, generator=gen, dtype=dtype)
    return q, k, v, g, beta, A_log, dt_bias


def _chunked(q, k, v, decay_log, beta, S, chunk=16):
    """The chunk algorithm of docs/design.md §2 in fp64 (natural log, exact inverse), one sequence.

    q (already l2-normalised and scaled), k, decay_log ``[T, H, K]``; v ``[T, H, V]``; beta
    ``[T, H]`` activated; S ``[H, K, V]``. An independent formulation to check the gold against.
    """
    outs = []
    for start in range(0, q.shape[0], chunk):
        sl = slice(start, start + chunk)
        qc, kc, vc, bc = (x[sl].transpose(0, 1) for x in (q, k, v, beta))  # [H, C, ...]
        G = decay_log[sl].transpose(0, 1).cumsum(1)  # [H, C, K]
        qd, kd, kinv = qc * G.exp(), kc * G.exp(), kc * (-G).exp()
        kr = kc * (G[:, -1:] - G).exp()
        n = qc.shape[1]
        L = torch.tril(bc[..., None] * kd @ kinv.transpose(1, 2), -1)
        inv = torch.linalg.inv(torch.eye(n, dtype=q.dtype) + L)
        mqk = torch.tril(qd @ kinv.transpose(1, 2))
        U = inv @ ((vc - kd @ S) * bc[..., None])
        outs.append((qd @ S + mqk @ U).transpose(0, 1))
        S = G[:, -1].exp()[..., None] * S + kr.transpose(1, 2) @ U
    return torch.cat(outs), S


@pytest.mark.parametrize("T", [1, 15, 16, 17, 50])
def test_matches_chunked_formulation(T):
    q, k, v, g, beta, A_log, dt_bias = _inputs(T=T)
    S0 = torch.randn(1, 2, 8, 16, dtype=torch.float64)  # [N, H, V, K]
    o, S = gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=S0, output_final_state=True)
    decay_log = gate_log_decay(g, gate="safe", A_log=A_log, dt_bias=dt_bias)[0]
    o_ref, S_ref = _chunked(l2norm(q[0]) * 16 ** -0.5, l2norm(k[0]), v[0], decay_log, torch.sigmoid(beta[0]),
                            S0[0].transpose(-1, -2))
    assert rel_rms(o[0], o_ref) < 1e-12
    assert rel_rms(S[0], S_ref.transpose(-1, -2)) < 1e-12


def test_single_token_by_hand():
    """T = 1 from zero state: S = β k vᵀ, o = Sᵀ (scale q) = β (scale q·k) v."""
    q, k, v, g, beta, A_log, dt_bias = _inputs(T=1, H=1)
    o, S = gold_forward(q, k, v, g, beta, gate="none", qk_l2norm=False, beta_logits=False, scale=0.5,
                        state_layout="kv", output_final_state=True)
    b = beta[0, 0, 0]
    assert torch.allclose(S[0, 0], b * torch.outer(k[0, 0, 0], v[0, 0, 0]))
    assert torch.allclose(o[0, 0, 0], b * 0.5 * (q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0])


def test_gate_forms():
    _, _, _, g, _, A_log, dt_bias = _inputs()
    x = g + dt_bias
    safe = gate_log_decay(g, gate="safe", A_log=A_log, dt_bias=dt_bias.flatten(), lower_bound=-3.0)
    assert torch.allclose(safe, -3.0 * torch.sigmoid(A_log.exp()[:, None] * x))
    assert torch.allclose(gate_log_decay(g, gate="safe", lower_bound=-1.0), -torch.sigmoid(g))
    softplus = gate_log_decay(g, gate="softplus", A_log=A_log, dt_bias=dt_bias)
    assert torch.allclose(softplus, -A_log.exp()[:, None] * F.softplus(x))
    assert gate_log_decay(g, gate="none") is g
    with pytest.raises(ValueError):
        gate_log_decay(g, gate="softplus")
    with pytest.raises(ValueError):
        gate_log_decay(g, gate="sigmoid")


def test_options_match_manual_preprocessing():
    q, k, v, g, beta, A_log, dt_bias = _inputs()
    o, S = gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True)
    decay_log = gate_log_decay(g, A_log=A_log, dt_bias=dt_bias)
    o2, S2 = gold_forward(l2norm(q) * 0.25, l2norm(k), v, decay_log, torch.sigmoid(beta), gate="none",
                          qk_l2norm=False, beta_logits=False, scale=1.0, output_final_state=True)
    assert rel_rms(o, o2) < 1e-13 and rel_rms(S, S2) < 1e-13


def test_state_layouts_and_continuation():
    """Running [0, t) then [t, T) from the returned state equals one run, in both layouts."""
    q, k, v, g, beta, A_log, dt_bias = _inputs(T=37)
    kw = dict(A_log=A_log, dt_bias=dt_bias, output_final_state=True)
    S0 = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    o, S = gold_forward(q, k, v, g, beta, initial_state=S0, **kw)
    o_kv, S_kv = gold_forward(q, k, v, g, beta, initial_state=S0.transpose(-1, -2), state_layout="kv", **kw)
    assert torch.equal(o, o_kv) and torch.equal(S, S_kv.transpose(-1, -2))
    parts = [(x[:, :20], x[:, 20:]) for x in (q, k, v, g, beta)]
    o1, S1 = gold_forward(*(p[0] for p in parts), initial_state=S0, **kw)
    o2, S2 = gold_forward(*(p[1] for p in parts), initial_state=S1, **kw)
    assert rel_rms(torch.cat([o1, o2], 1), o) < 1e-14 and rel_rms(S2, S) < 1e-14
    assert gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias)[1] is None
    _, S_half = gold_forward(q, k, v, g, beta, initial_state=S0.bfloat16(), dtype=torch.float32, **kw)
    assert S_half.dtype == torch.float32
    assert rel_rms(S_half, gold_forward(q, k, v, g, beta, initial_state=S0.bfloat16(), **kw)[1]) < 1e-5


def test_varlen_equals_separate_runs_and_batch():
    lengths = [5, 0, 16, 23]
    q, k, v, g, beta, A_log, dt_bias = _inputs(T=sum(lengths), seed=1)
    cu = torch.tensor([0, 5, 5, 21, 44])
    S0 = torch.randn(4, 2, 8, 16, dtype=torch.float64)
    kw = dict(A_log=A_log, dt_bias=dt_bias, output_final_state=True)
    o, S = gold_forward(q, k, v, g, beta, cu_seqlens=cu, initial_state=S0, **kw)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, S_n = gold_forward(*(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=S0[n: n + 1], **kw)
        assert torch.equal(o[:, a:b], o_n)
        assert torch.equal(S[n], S_n[0])
    # equal lengths: varlen over the packed batch == B > 1
    qb, kb, vb, gb, bb = (x[:, 21:43].reshape(2, 11, *x.shape[2:]) for x in (q, k, v, g, beta))
    o_b, S_b = gold_forward(qb, kb, vb, gb, bb, initial_state=S0[:2], **kw)
    o_v, S_v = gold_forward(*(x[:, 21:43] for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 11, 22]),
                            initial_state=S0[:2], **kw)
    assert rel_rms(o_b.reshape(1, 22, 2, 8), o_v) < 1e-14 and rel_rms(S_b, S_v) < 1e-14
    with pytest.raises(ValueError):
        gold_forward(qb, kb, vb, gb, bb, cu_seqlens=torch.tensor([0, 11]), **kw)


def test_causality():
    q, k, v, g, beta, A_log, dt_bias = _inputs(T=33)
    o, _ = gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias)
    for x in (q, k, v, g, beta):
        x[:, 20] += 3.0
    o2, _ = gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias)
    assert torch.equal(o[:, :20], o2[:, :20])
    assert not torch.equal(o[:, 20], o2[:, 20])


def test_saturated_gate_and_beta_are_finite():
    q, k, v, g, beta, A_log, dt_bias = _inputs(T=40)
    for gate in ("safe", "softplus"):
        for sign in (1.0, -1.0):
            o, S = gold_forward(q, k, v, torch.full_like(g, sign * 3e38), torch.full_like(beta, sign * 1e30),
                                gate=gate, A_log=A_log, dt_bias=dt_bias, output_final_state=True)
            assert o.isfinite().all() and S.isfinite().all()


def test_gradcheck():
    q, k, v, g, beta, A_log, dt_bias = _inputs(T=5, H=1, K=4, V=3)
    S0 = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, A_log, dt_bias, S0)]

    def f(q, k, v, g, beta, A_log, dt_bias, S0):
        o, S = gold_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=S0, output_final_state=True)
        return o, S

    assert torch.autograd.gradcheck(f, args)


def _fla_case(device, varlen):
    torch.manual_seed(0)
    T, H, D = 2048, 4, 128
    q, k, v = (torch.randn(1, T, H, D, device=device).bfloat16() for _ in range(3))
    g = torch.randn(1, T, H, D, device=device).bfloat16()
    beta = torch.randn(1, T, H, device=device).bfloat16()
    A_log = torch.log(torch.empty(H, device=device).uniform_(1, 16))
    dt_bias = torch.randn(H * D, device=device) * 0.5
    S0 = torch.randn(3 if varlen else 1, H, D, D, device=device)
    cu = torch.tensor([0, 700, 1300, T], device=device) if varlen else None
    return q, k, v, g, beta, A_log, dt_bias, S0, cu


@pytest.mark.gpu
@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("state_v_first", [True, False])
@pytest.mark.parametrize("varlen", [False, True])
def test_gold_agrees_with_fla(device, safe, state_v_first, varlen, monkeypatch):
    """FLA's chunk_kda (a peer implementation) is within its known accuracy of the gold."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    monkeypatch.setenv("FLA_CUTE_KDA", "0")  # FLA's own kernels, not its dispatch to cute_kda
    q, k, v, g, beta, A_log, dt_bias, S0, cu = _fla_case(device, varlen)
    lower_bound = -5.0 if safe else None
    o_fla, S_fla = fla_kda.chunk_kda(
        q, k, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=safe, lower_bound=lower_bound,
        state_v_first=state_v_first, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias,
    )
    o, S = gold_forward(
        q, k, v, g, beta, gate="safe" if safe else "softplus", A_log=A_log, dt_bias=dt_bias,
        lower_bound=-5.0, initial_state=S0, state_layout="vk" if state_v_first else "kv",
        output_final_state=True, cu_seqlens=cu,
    )
    err_o, err_s = rel_rms(o_fla, o), rel_rms(S_fla, S)
    print(f"FLA vs gold (safe={safe}, v_first={state_v_first}, varlen={varlen}): o {err_o:.2e}, state {err_s:.2e}")
    assert err_o < 1e-2 and err_s < 1e-2
