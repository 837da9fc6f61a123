"""``cute_kda.gdn_api.translate_fla_gdn_call``: FLA's ``chunk_gated_delta_rule`` arguments onto the canonical
GatedDeltaNet call (issue 12).

CPU only. For every combination of FLA's flags (gate in kernel or a precomputed log decay, l2norm, β
logits, state layout, varlen, grouped value heads) the canonical call, run through the gold token
recurrence, equals an fp64 restatement of FLA's function written here from its own definitions
(``fla/ops/gated_delta_rule/naive.py`` and ``gate.py``; value head ``j`` reading q/k head ``j // (HV/H)`` as
its kernels index them). Unsupported flags raise ``NotImplementedError`` naming the flag; FLA's own
errors are raised as FLA raises them.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F

from cute_kda.fla_calls import GDN_GATES, GdnCall, translate_fla_gdn_call
from cute_kda.reference import gold_forward, rel_rms

K = V = 16  # the translation does not depend on the head dim; small keeps the token loops fast
# chunk_gated_delta_rule's parameters in fla-core 0.6.0 (fla/ops/gated_delta_rule/chunk.py)
FLA_PARAMETERS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
                  "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context", "kwargs")


def fla_gdn_semantics(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, state_v_first=False,
                      cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None):
    """FLA's chunk_gated_delta_rule function restated in fp64, one sequence and value head at a time."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    heads, value_heads = q.shape[2], v.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_gate_in_kernel:  # naive_gdn_gate: -exp(A_log) * softplus(g + dt_bias), in fp32 inputs widened
        x = g if dt_bias is None else g + dt_bias.double()
        g = -A_log.double().exp() * F.softplus(x)
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
    batch, seq_len = q.shape[:2]
    spans = [(b, 0, seq_len) for b in range(batch)] if cu_seqlens is None else [
        (0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    o = torch.zeros_like(v)
    finals = []
    for n, (b, start, end) in enumerate(spans):
        per_head = []
        for j in range(value_heads):
            i_h = j // (value_heads // heads)
            state = torch.zeros(q.shape[-1], v.shape[-1], dtype=torch.float64)  # [K, V]
            if initial_state is not None:
                h0 = initial_state[n, j].double()
                state = h0.transpose(0, 1) if state_v_first else h0
            for t in range(start, end):
                state = state * g[b, t, j].exp()
                k_t = k[b, t, i_h]
                residual = (v[b, t, j] - k_t @ state) * beta[b, t, j]
                state = state + torch.outer(k_t, residual)
                o[b, t, j] = (q[b, t, i_h] * scale) @ state
            per_head.append(state.transpose(0, 1) if state_v_first else state)
        finals.append(torch.stack(per_head))
    return o, torch.stack(finals) if output_final_state else None


def gold_as_gdn_kernels(q, k, v, g, beta, **options):
    """The canonical GatedDeltaNet forward (GdnCall.options; v-first states) by the gold token recurrence."""
    return gold_forward(q, k, v, g, beta, state_layout="vk", dtype=torch.float64, **options)


def make_gdn_problem(lengths, *, heads=2, value_heads=4, raw_gate=True, beta_logits=True, state="fp32",
                     state_v_first=False, seed=0, dim=K):
    """FLA-style GatedDeltaNet inputs: B = len(lengths) equal sequences, or one packed row when lengths vary.

    q, k, v, beta bf16; g bf16 raw (``raw_gate``) or an fp32 log decay with −1000 masks; A_log, dt_bias fp32
    ``[HV]``; an initial state in the caller's layout (fp32, bf16 or none). Head dims ``dim`` (K = V).
    """
    gen = torch.Generator().manual_seed(seed)
    varlen = len(set(lengths)) > 1
    batch, seq_len = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    if raw_gate:
        g = randn(batch, seq_len, value_heads).bfloat16()
    else:
        g = F.logsigmoid(randn(batch, seq_len, value_heads) + 2.0)
        g = torch.where(torch.rand(g.shape, generator=gen) < 0.1, torch.full_like(g, -1000.0), g)
    beta = randn(batch, seq_len, value_heads) if beta_logits else torch.rand(batch, seq_len, value_heads, generator=gen)
    inputs = dict(
        q=randn(batch, seq_len, heads, dim).bfloat16(), k=randn(batch, seq_len, heads, dim).bfloat16(),
        v=randn(batch, seq_len, value_heads, dim).bfloat16(), g=g, beta=beta.bfloat16(),
        A_log=torch.log(torch.rand(value_heads, generator=gen) * 15 + 1), dt_bias=randn(value_heads),
    )
    if varlen:
        inputs["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    if state is not None:
        h0 = 0.3 * randn(len(lengths), value_heads, dim, dim)
        h0 = h0.transpose(-1, -2).contiguous() if state_v_first else h0
        inputs["initial_state"] = h0 if state == "fp32" else h0.bfloat16()
    return inputs


def _check_against_fla(inputs: dict, flags: dict) -> GdnCall:
    call = translate_fla_gdn_call(**inputs, **flags)
    o, state = call.run(gold_as_gdn_kernels)
    how_not_what = ("cu_seqlens_cpu", "chunk_indices", "chunk_size")
    semantics = {n: x for n, x in {**inputs, **flags}.items() if n not in how_not_what}
    if "transpose_state_layout" in semantics:
        semantics["state_v_first"] = semantics.pop("transpose_state_layout")
    o_ref, state_ref = fla_gdn_semantics(**semantics)
    assert rel_rms(o, o_ref) < 1e-12
    if state_ref is None:
        assert state is None
    else:
        assert state.dtype == torch.float32 and state.is_contiguous() and state.shape == state_ref.shape
        assert rel_rms(state, state_ref) < 1e-6  # the fp32 hand-back
    return call


FLAG_PRODUCT = list(itertools.product([True, False], repeat=6))


@pytest.mark.parametrize("gate_in_kernel,l2norm,beta_sigmoid,v_first,varlen,gva", FLAG_PRODUCT)
def test_every_flag_combination_matches_fla_semantics(gate_in_kernel, l2norm, beta_sigmoid, v_first, varlen, gva):
    lengths = [7, 20, 0, 16] if varlen else [19, 19]
    inputs = make_gdn_problem(lengths, value_heads=4 if gva else 2, raw_gate=gate_in_kernel, beta_logits=beta_sigmoid,
                              state_v_first=v_first)
    flags = dict(use_gate_in_kernel=gate_in_kernel, use_qk_l2norm_in_kernel=l2norm,
                 use_beta_sigmoid_in_kernel=beta_sigmoid, state_v_first=v_first, output_final_state=True)
    call = _check_against_fla(inputs, flags)
    options = call.options
    assert options["gate"] == ("softplus" if gate_in_kernel else "none") and options["gate"] in GDN_GATES
    assert (options["A_log"] is None) == (not gate_in_kernel)
    assert options["qk_l2norm"] is l2norm and options["beta_logits"] is beta_sigmoid
    assert options["initial_state"].shape == (len(lengths), 4 if gva else 2, V, K)
    assert options["initial_state"].is_contiguous() and call.state_k_first is not v_first


TRANSLATION_CASES = {
    "no_dt_bias": (dict(lengths=[21]), dict(use_gate_in_kernel=True, dt_bias=None)),
    "gate_params_ignored_for_a_log_decay": (dict(lengths=[21], raw_gate=False), dict(use_gate_in_kernel=False)),
    "transpose_state_layout": (dict(lengths=[18], state_v_first=True),
                               dict(use_gate_in_kernel=True, transpose_state_layout=True, output_final_state=True)),
    "bf16_initial_state": (dict(lengths=[18], state="bf16"), dict(use_gate_in_kernel=True, output_final_state=True)),
    "no_initial_state_final_out": (dict(lengths=[9, 33], state=None), dict(use_gate_in_kernel=True,
                                                                           output_final_state=True)),
    "no_final_state": (dict(lengths=[9, 33]), dict(use_gate_in_kernel=True)),
    "custom_scale_no_gva": (dict(lengths=[17], value_heads=2), dict(use_gate_in_kernel=True, scale=0.3,
                                                                     output_final_state=True)),
    "one_qk_head_many_value_heads": (dict(lengths=[17], heads=1, value_heads=4), dict(use_gate_in_kernel=True)),
    "accepted_noops": (dict(lengths=[5, 27]), dict(use_gate_in_kernel=True, chunk_size=16, output_final_state=True,
                                                   chunk_indices=torch.tensor([[0, 0], [1, 0], [1, 1]]))),
    "cu_seqlens_cpu": (dict(lengths=[5, 27]), dict(use_gate_in_kernel=False, output_final_state=True)),
}


@pytest.mark.parametrize("case", list(TRANSLATION_CASES))
def test_translation_cases_match_fla_semantics(case):
    problem, flags = TRANSLATION_CASES[case]
    inputs = make_gdn_problem(**problem)
    flags = dict(flags)
    for name in ("dt_bias", "A_log"):
        if name in flags:
            inputs[name] = flags.pop(name)
    if case == "cu_seqlens_cpu":
        inputs["cu_seqlens_cpu"] = inputs["cu_seqlens"].clone()
    if case == "transpose_state_layout":
        with pytest.warns(DeprecationWarning, match="state_v_first"):
            _check_against_fla(inputs, flags)
        return
    call = _check_against_fla(inputs, flags)
    if case == "gate_params_ignored_for_a_log_decay":
        assert call.options["A_log"] is None and call.options["dt_bias"] is None
    if case == "custom_scale_no_gva":
        assert call.options["scale"] == 0.3


def test_translation_is_pure_makes_inputs_contiguous_and_binds_the_gold():
    inputs = make_gdn_problem([24])
    before = {n: x.clone() for n, x in inputs.items()}
    inputs["q"] = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    call = translate_fla_gdn_call(**inputs, use_gate_in_kernel=True)
    assert all(x.is_contiguous() for x in call.tensors)
    for name, x in before.items():
        assert torch.equal(inputs[name], x), name
    assert call.options["A_log"].dtype == torch.float32 and call.options["dt_bias"].shape == (4,)
    inspect.signature(gold_forward).bind(*call.tensors, **call.options)  # the options are the gold's keywords


def test_signature_is_flas():
    """FLA's parameters, plus cute_kda's keyword-only extension: a prefill on a state pool, and chunk_kda's
    ``disable_recompute``."""
    ours = ("state_indices", "checkpoint_every", "checkpoint_indices", "disable_recompute")
    parameters = inspect.signature(translate_fla_gdn_call).parameters
    assert tuple(name for name in parameters if name not in ours) == FLA_PARAMETERS
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ours)


@pytest.mark.parametrize("flags,error,match", [
    (dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=True), NotImplementedError, "allow_neg_eigval"),
    (dict(allow_neg_eigval=True), ValueError, "use_beta_sigmoid_in_kernel"),
    (dict(cp_context=object()), TypeError, "cp_context"),  # not a context (tests/test_cp_ranks.py runs real ones)
    (dict(head_first=False), DeprecationWarning, "head_first"),
    (dict(chunk_size=128), ValueError, "`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got 128."),
    (dict(use_gate_in_kernel=True, A_log=None), ValueError, "A_log"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, "A_log"),
    (dict(use_gate_in_kernel=True, dt_bias=torch.zeros(4, K)), ValueError, "dt_bias"),
    (dict(state_v_first=True, transpose_state_layout=True), ValueError, "transpose_state_layout"),
    (dict(use_graph=True), TypeError, "use_graph"),
])
def test_unsupported_flags_and_flas_own_errors(flags, error, match):
    inputs = make_gdn_problem([20])
    for name in ("A_log", "dt_bias"):
        if name in flags:
            inputs[name] = flags.pop(name)
    with pytest.raises(error, match=match):
        translate_fla_gdn_call(**inputs, **flags)


def test_shape_errors_are_flas():
    inputs = make_gdn_problem([20], heads=2, value_heads=4)
    with pytest.raises(ValueError, match="multiple"):
        translate_fla_gdn_call(**dict(inputs, v=inputs["v"][:, :, :3], g=inputs["g"][:, :, :3],
                                      beta=inputs["beta"][:, :, :3], initial_state=None))
    with pytest.raises(ValueError, match="same number of heads"):
        translate_fla_gdn_call(**dict(inputs, k=inputs["k"][:, :, :1]))
    with pytest.raises(ValueError, match="g must be 3-D"):
        translate_fla_gdn_call(**dict(inputs, g=inputs["g"][..., None].expand(-1, -1, -1, K)))
    with pytest.raises(ValueError, match="one state per sequence"):
        translate_fla_gdn_call(**dict(inputs, initial_state=inputs["initial_state"].repeat(2, 1, 1, 1)))
    with pytest.raises(TypeError, match="initial_state"):  # fp16 is widened (test_fp16_state_is_widened_exactly)
        translate_fla_gdn_call(**dict(inputs, initial_state=inputs["initial_state"].double()))
    varlen = make_gdn_problem([5, 15])
    with pytest.raises(ValueError, match="batch size must be 1"):
        translate_fla_gdn_call(**dict(make_gdn_problem([20, 20], state=None), cu_seqlens=varlen["cu_seqlens"]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        translate_fla_gdn_call(**varlen, cu_seqlens_cpu=torch.tensor([0, 25, 20]))
