"""``cute_kda.chunk_kda`` as a drop-in for flash-linear-attention's ``chunk_kda``.

CPU tier: the translation of FLA's keyword arguments (gate forms, ``A_log``/``dt_bias`` shapes,
state layouts, β logits or activated, l2norm on/off, varlen) is run through the internal seam
with the gold reference in place of the kernels, and compared with an independent fp64 token
recurrence written here from FLA's own definitions (``fla/ops/kda/naive.py``, ``gate.py``).
Unsupported flags must raise ``NotImplementedError`` naming the flag.

GPU tier: the real ``chunk_kda`` against FLA's Triton ``chunk_kda`` on the same inputs
(``FLA_FLASH_KDA=0`` and ``FLA_CUTE_KDA=0`` so FLA dispatches neither to FlashKDA nor back to
cute_kda), rel-RMS printed and bounded.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F

import cute_kda
from cute_kda import api
from cute_kda.reference import gold_forward, mirror_forward, rel_rms

os.environ["FLA_FLASH_KDA"] = "0"
os.environ["FLA_CUTE_KDA"] = "0"  # FLA's own kernels are the reference, not its dispatch to cute_kda

D = 128


def fla_semantics(q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None, lower_bound, l2norm, beta_sigmoid,
                  initial_state=None, state_v_first=False, output_final_state=False, cu_seqlens=None,
                  use_gate_in_kernel=True):
    """FLA's chunk_kda function, restated in fp64 from its naive definitions (``naive_kda_gate`` for the
    softplus gate, ``lower_bound · sigmoid`` for the bounded one; g the log decay without the gate)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    heads, key_dim = q.shape[2], q.shape[3]
    scale = key_dim ** -0.5 if scale is None else scale
    x = g if dt_bias is None else g + dt_bias.double().view(heads, key_dim)
    if not use_gate_in_kernel:
        decay = torch.exp(g)
    elif lower_bound is None:
        a = torch.ones(heads, 1, dtype=torch.float64) if A_log is None else A_log.double().exp().view(heads, 1)
        decay = torch.exp(-a * F.softplus(x))
    else:
        if A_log is not None:
            x = A_log.double().exp().view(heads, 1) * x
        decay = torch.exp(lower_bound * torch.sigmoid(x))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    q = q * scale
    batch, seq_len = q.shape[:2]
    spans = [(b, 0, seq_len) for b in range(batch)] if cu_seqlens is None else [
        (0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    o = torch.zeros_like(v)
    finals = []
    for n, (b, start, end) in enumerate(spans):
        state = q.new_zeros(heads, key_dim, v.shape[-1])  # [H, K, V]
        if initial_state is not None:
            h0 = initial_state[n].double()
            state = state + (h0.transpose(-1, -2) if state_v_first else h0)
        for t in range(start, end):
            state = state * decay[b, t][..., None]
            k_t = k[b, t]
            delta = beta[b, t][:, None] * (v[b, t] - torch.einsum("hk,hkv->hv", k_t, state))
            state = state + k_t[..., None] * delta[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t], state)
        finals.append(state.transpose(-1, -2) if state_v_first else state)
    return o, torch.stack(finals) if output_final_state else None


def gold_as_kernels(q, k, v, g, beta, *, scale, A_log, dt_bias, lower_bound, initial_state, output_final_state,
                    cu_seqlens, qk_l2norm, beta_logits, gate):
    """The canonical forward (kda_forward's contract: contiguous v-first states) by the gold recurrence."""
    o, state = gold_forward(
        q, k, v, g, beta, scale=scale, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        qk_l2norm=qk_l2norm, beta_logits=beta_logits, initial_state=initial_state, state_layout="vk",
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, dtype=torch.float64,
    )
    return o, None if state is None else state.contiguous()


def mirror_as_kernels(q, k, v, g, beta, **options):
    """The canonical forward by the chunk-16 mirror (the kernels' rounding)."""
    return mirror_forward(q, k, v, g, beta, **options)


def make_problem(lengths, heads=2, *, normalized_qk=False, beta_logits=True, state=None, seed=0, device="cpu"):
    """FLA-style inputs: B = len(lengths) equal sequences, or one packed row when lengths vary."""
    gen = torch.Generator().manual_seed(seed)
    varlen = len(set(lengths)) > 1
    batch, seq_len = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(batch, seq_len, heads, D), randn(batch, seq_len, heads, D)
    if normalized_qk:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = randn(batch, seq_len, heads) if beta_logits else torch.rand(batch, seq_len, heads, generator=gen)
    inputs = dict(
        q=q, k=k, v=randn(batch, seq_len, heads, D), g=randn(batch, seq_len, heads, D), beta=beta,
        A_log=torch.rand(heads, generator=gen), dt_bias=randn(heads * D),
    )
    inputs = {name: x.to(torch.bfloat16) if name in "q k v g beta".split() else x for name, x in inputs.items()}
    if varlen:
        inputs["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    if state is not None:
        inputs["initial_state"] = 0.1 * randn(len(lengths), heads, D, D)
    return {name: x.to(device) for name, x in inputs.items()}


FLAGS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
             safe_gate=True, lower_bound=-5.0)

# (problem, extra chunk_kda kwargs, FLA semantic flags): one row per translation concern
TRANSLATION_CASES = {
    "defaults_kv_state": (dict(lengths=[37], state="kv"), dict(output_final_state=True), {}),
    "v_first_state": (dict(lengths=[37, 37], state="vk"), dict(output_final_state=True, state_v_first=True), {}),
    "transpose_state_layout": (dict(lengths=[21], state="vk"),
                               dict(output_final_state=True, transpose_state_layout=True), {}),
    "dt_bias_2d": (dict(lengths=[19]), dict(dt_bias_shape="2d"), {}),
    "no_dt_bias_no_A_log": (dict(lengths=[19]), dict(dt_bias_shape=None, A_log=None, lower_bound=-1.0), {}),
    "unsafe_gate_flag": (dict(lengths=[19]), dict(safe_gate=False, lower_bound=-2.5), {}),
    "beta_activated": (dict(lengths=[23], beta_logits=False), dict(use_beta_sigmoid_in_kernel=False), {}),
    "no_l2norm": (dict(lengths=[23], normalized_qk=True), dict(use_qk_l2norm_in_kernel=False, scale=0.3), {}),
    "varlen_states": (dict(lengths=[5, 16, 1, 17], state="kv"), dict(output_final_state=True), {}),
    "varlen_no_state_out": (dict(lengths=[9, 33]), dict(output_final_state=True, state_v_first=True), {}),
    "accepted_noops": (dict(lengths=[18]), dict(disable_recompute=True, chunk_size=32), {}),
    "softplus_gate": (dict(lengths=[5, 16, 1, 17], state="kv"), dict(lower_bound=None, safe_gate=False,
                                                                     output_final_state=True), {}),
    "softplus_no_dt_bias_no_A_log": (dict(lengths=[19]), dict(lower_bound=None, safe_gate=False, dt_bias_shape=None,
                                                              A_log=None), {}),
    "log_decay_fp32": (dict(lengths=[37], state="vk"), dict(use_gate_in_kernel=False, log_decay=torch.float32,
                                                             output_final_state=True, state_v_first=True), {}),
    "log_decay_bf16_masks": (dict(lengths=[9, 33]), dict(use_gate_in_kernel=False, log_decay=torch.bfloat16), {}),
}


def run_translation(case: str, forward):
    problem, extra, _ = TRANSLATION_CASES[case]
    inputs = make_problem(**problem)
    extra = dict(extra)
    dt_bias_shape = extra.pop("dt_bias_shape", "flat")
    if dt_bias_shape is None:
        inputs["dt_bias"] = None
    elif dt_bias_shape == "2d":
        inputs["dt_bias"] = inputs["dt_bias"].view(inputs["q"].shape[2], D)
    if "A_log" in extra:
        inputs["A_log"] = extra.pop("A_log")
    log_decay = extra.pop("log_decay", None)
    if log_decay is not None:  # the log decay itself, ≤ 0, with −1000 masks on some entries
        decay = -F.softplus(inputs["g"].float())
        inputs["g"] = torch.where(torch.rand(decay.shape, generator=torch.Generator().manual_seed(5)) < 0.05,
                                  -1000.0, decay).to(log_decay)
    kwargs = {**FLAGS, **inputs, **extra}
    call = api.translate_fla_call(**kwargs)
    o, state = call.run(forward)

    state_v_first = kwargs.get("state_v_first", False) or kwargs.get("transpose_state_layout", False)
    o_ref, state_ref = fla_semantics(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale=kwargs.get("scale"),
        A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=kwargs["lower_bound"],
        l2norm=kwargs["use_qk_l2norm_in_kernel"], beta_sigmoid=kwargs["use_beta_sigmoid_in_kernel"],
        use_gate_in_kernel=kwargs["use_gate_in_kernel"],
        initial_state=inputs.get("initial_state"), state_v_first=state_v_first,
        output_final_state=kwargs.get("output_final_state", False), cu_seqlens=inputs.get("cu_seqlens"),
    )
    return (o, state), (o_ref, state_ref)


@pytest.mark.parametrize("case", sorted(TRANSLATION_CASES))
def test_translation_against_fla_semantics(case):
    (o, state), (o_ref, state_ref) = run_translation(case, gold_as_kernels)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    if state_ref is None:
        assert state is None
    else:
        assert state.shape == state_ref.shape and state.is_contiguous()
        torch.testing.assert_close(state, state_ref, rtol=1e-9, atol=1e-9)


def test_translation_through_the_mirror():
    (o, state), (o_ref, state_ref) = run_translation("varlen_states", mirror_as_kernels)
    assert state.dtype == torch.float32 and o.dtype == torch.bfloat16
    assert rel_rms(o, o_ref) < 1e-2
    assert rel_rms(state, state_ref) < 1e-2


def test_canonical_call_binds_to_kda_forward():
    call = api.translate_fla_call(**FLAGS, **make_problem([5, 16], state="kv"), output_final_state=True)
    inspect.signature(cute_kda.kda_forward).bind(*call.tensors, **call.options)
    assert call.options["initial_state"].is_contiguous()
    assert call.state_k_first


def test_non_contiguous_inputs_are_made_contiguous():
    inputs = make_problem([20])
    inputs["q"] = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)
    call = api.translate_fla_call(**FLAGS, **inputs)
    assert all(x.is_contiguous() for x in call.tensors)
    assert torch.equal(call.tensors[0], inputs["q"])


UNSUPPORTED = [
    (dict(lower_bound=None), ValueError, "`lower_bound` must be specified"),
    (dict(lower_bound=-6.0, safe_gate=False), NotImplementedError, "lower_bound = -6.0"),
    (dict(lower_bound=-6.0), ValueError, "safe range"),
    (dict(lower_bound=0.0), ValueError, "safe range"),
    (dict(allow_neg_eigval=True), NotImplementedError, "allow_neg_eigval"),
    (dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False), ValueError, "pass allow_neg_eigval=False"),
    (dict(return_intermediate_states=True, cu_seqlens=torch.tensor([0, 20])), NotImplementedError, "cu_seqlens_cpu"),
    (dict(cp_context=object()), TypeError, "cp_context"),  # not a context (tests/test_cp_ranks.py runs real ones)
    (dict(use_graph=True), NotImplementedError, "use_graph"),
    (dict(chunk_size=16), ValueError, "`chunk_size` must be either 32 or 64 for KDA, got 16."),  # FLA's own text
    (dict(state_v_first=True, transpose_state_layout=True), ValueError, "transpose_state_layout"),
    (dict(some_new_flag=True), TypeError, "some_new_flag"),
    (dict(dt_bias=torch.zeros(3)), ValueError, "dt_bias"),
    (dict(A_log=torch.zeros(5)), ValueError, "A_log"),
    (dict(initial_state=torch.zeros(1, 2, D, D, dtype=torch.bfloat16)), TypeError, "initial_state"),
]


@pytest.mark.parametrize("changes, error, words", UNSUPPORTED, ids=[w for _, _, w in UNSUPPORTED])
def test_unsupported_or_invalid_flags(changes, error, words):
    kwargs = {**FLAGS, **make_problem([20]), **changes}
    with pytest.raises(error, match=words.replace("(", r"\(").replace("=", "=")):
        api.translate_fla_call(**kwargs)


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_wrong_state_shape_reports_the_callers_shape(state_v_first):
    inputs = make_problem([20])
    inputs["initial_state"] = torch.zeros(1, 2, D, 64)  # the caller's layout, wrong last dim
    layout = "[N, H, V, K]" if state_v_first else "[N, H, K, V]"
    with pytest.raises(ValueError, match=r"initial_state must have shape .* = \[1, 2, 128, 128\], got \[1, 2, 128, 64\]") as info:
        api.translate_fla_call(**FLAGS, **inputs, state_v_first=state_v_first)
    assert layout in str(info.value)


def test_wrong_state_count_for_packed_sequences():
    inputs = make_problem([5, 16, 1], state="kv")
    inputs["initial_state"] = inputs["initial_state"][:2]
    with pytest.raises(ValueError, match=r"\[3, 2, 128, 128\], got \[2, 2, 128, 128\]"):
        api.translate_fla_call(**FLAGS, **inputs)


def test_grouped_value_heads_translate_to_value_head_parameters():
    """GVA: v, g, beta and A_log, dt_bias per value head (HV = 4 over H = 2); the call is the gold's GVA call."""
    inputs = make_problem([20], heads=4)
    inputs["q"], inputs["k"] = inputs["q"][:, :, :2].contiguous(), inputs["k"][:, :, :2].contiguous()
    call = api.translate_fla_call(**FLAGS, **inputs)
    assert call.options["A_log"].shape == (4,) and call.options["dt_bias"].shape == (4, D)
    o, _ = call.run(gold_as_kernels)
    o_ref, _ = gold_forward(*call.tensors, gate="safe", scale=D ** -0.5, A_log=inputs["A_log"],
                            dt_bias=inputs["dt_bias"], lower_bound=-5.0, state_layout="vk", dtype=torch.float64)
    assert o.shape == inputs["v"].shape and torch.equal(o, o_ref)
    with pytest.raises(ValueError, match="multiple of q's H = 2"):
        api.translate_fla_call(**FLAGS, **{**inputs, "q": inputs["q"][:, :, :1].repeat(1, 1, 2, 1).contiguous()[:, :, :2],
                                           "v": inputs["v"][:, :, :3].contiguous()})


def test_public_chunk_kda_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA device"):
        cute_kda.chunk_kda(**FLAGS, **make_problem([20], state="kv"), output_final_state=True)


def test_public_chunk_kda_takes_training_calls():
    """A call whose inputs require grad is a training call; on the CPU it stops at the device check."""
    inputs = make_problem([20])
    inputs["k"].requires_grad_()
    with pytest.raises(ValueError, match="CUDA device"):
        cute_kda.chunk_kda(**FLAGS, **inputs)


# ---------------------------------------------------------------------------------------------
# GPU tier: against FLA's Triton chunk_kda

FLA_CASES = {
    "B1_T1000_H4_kv_state": (dict(lengths=[1000], heads=4, state="kv"), dict(output_final_state=True)),
    "varlen_H4_v_first": (dict(lengths=[1300, 547, 2048, 963, 271, 3063], heads=4),
                          dict(output_final_state=True, state_v_first=True)),
    "B2_T300_H8_beta_activated_no_A_log": (dict(lengths=[300, 300], heads=8, beta_logits=False),
                                           dict(use_beta_sigmoid_in_kernel=False, A_log=None, lower_bound=-1.0)),
    "B1_T513_H2_no_l2norm": (dict(lengths=[513], heads=2, normalized_qk=True, state="vk"),
                             dict(use_qk_l2norm_in_kernel=False, transpose_state_layout=True,
                                  output_final_state=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(FLA_CASES))
def test_chunk_kda_matches_fla(case, device):
    fla_kda = pytest.importorskip("fla.ops.kda")
    problem, extra = FLA_CASES[case]
    inputs = make_problem(**problem, device=device)
    kwargs = {**FLAGS, **inputs, **extra}
    with torch.no_grad():
        o, state = cute_kda.chunk_kda(**kwargs)
        o_fla, state_fla = fla_kda.chunk_kda(**kwargs)
    torch.cuda.synchronize()
    assert o.dtype == o_fla.dtype and o.shape == o_fla.shape
    err_o = rel_rms(o, o_fla)
    line = f"[fla-compat] {case}: rel-RMS o {err_o:.3e}"
    if state_fla is not None:
        assert state.dtype == state_fla.dtype == torch.float32 and state.shape == state_fla.shape
        err_state = rel_rms(state, state_fla)
        line += f", final state {err_state:.3e}"
        assert err_state <= 1e-2, line
    print(line)
    assert err_o <= 1e-2, line
