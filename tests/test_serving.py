"""The serving entry points (``cute_kda/serving.py``): FLA 0.6.0's ``fused_recurrent_kda`` and
``fused_recurrent_gated_delta_rule`` on the decode kernel, with the state pool of ``fused_recurrent_kda_fwd``.

CPU tier: the signatures against FLA 0.6.0's (written out here; the ``fla``-marked test reads the installed FLA);
every bad input raises naming the argument, value checks only under ``CUTE_KDA_DEBUG_CHECKS=1``; the argument
mapping end to end with the fp64 decode reference (``gold_decode``) standing in for the kernel, against an fp64
token recurrence written from FLA's kernels' formulas (gates, missing A_log / dt_bias, layouts, the pool and verify
contract, packed sequences); FLA's backend verifier and the hand-over of its translation.

GPU tier (``gpu``; ``fla`` where FLA runs): against FLA's ``fused_recurrent_kda_fwd`` on a pool with padding rows
and a guard, verify with every accepted count, K-first pools, GatedDeltaNet's per-head gate, FLA's KDA layer in
decode mode dispatching to cute_kda, and a steady decode loop captured in a CUDA graph (no allocation, no sync).

Packed calls (``cu_seqlens``) and fixed-length calls with T > 8 need the decode launcher's token loop (another
branch): on the CPU they run on the reference only; the GPU tests that make them say so in their names (``packed``).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import cute_kda
from cute_kda import fla_backend, serving, validation
from cute_kda.reference import rel_rms
from cute_kda.reference.decode import gold_decode

D = 128
BF16 = torch.bfloat16


# ============================================================================ FLA 0.6.0's signatures

_KDA_PARAMS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("g", inspect.Parameter.empty), ("beta", inspect.Parameter.empty), ("A_log", None), ("dt_bias", None),
    ("scale", None), ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
    ("lower_bound", None), ("state_v_first", False), ("cu_seqlens", None),
]
_GDN_PARAMS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty), ("g", None),
    ("gk", None), ("gv", None), ("beta", None), ("scale", None), ("initial_state", None),
    ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False),
    ("A_log", None), ("dt_bias", None), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
    ("state_v_first", False), ("cu_seqlens", None),
]
_FWD_PARAMS = [  # fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("g", inspect.Parameter.empty), ("beta", inspect.Parameter.empty), ("A_log", None), ("dt_bias", None),
    ("initial_state", None), ("scale", None), ("output_final_state", False), ("inplace_final_state", True),
    ("state_v_first", False), ("cu_seqlens", None), ("ssm_state_indices", None), ("num_accepted_tokens", None),
    ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False), ("lower_bound", None), ("out", None),
]
_POOL_KEYWORDS = ["ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "out"]


def _positional(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def _keyword_only(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


@pytest.mark.parametrize("fn,expected", [(serving.fused_recurrent_kda, _KDA_PARAMS),
                                         (serving.fused_recurrent_gated_delta_rule, _GDN_PARAMS)],
                         ids=["kda", "gdn"])
def test_signatures_are_flas_plus_the_pool_keywords(fn, expected):
    assert _positional(fn) == expected
    assert _keyword_only(fn) == _POOL_KEYWORDS
    assert inspect.signature(fn).parameters["inplace_final_state"].default is None
    assert list(inspect.signature(fn).parameters)[-1] == "kwargs"


def test_fwd_translation_takes_flas_fwd_signature():
    assert _positional(serving.fla_fwd_call) == _FWD_PARAMS
    assert cute_kda.fused_recurrent_kda is serving.fused_recurrent_kda
    assert cute_kda.fused_recurrent_gated_delta_rule is serving.fused_recurrent_gated_delta_rule


@pytest.mark.fla
def test_signatures_match_the_installed_fla():
    kda = pytest.importorskip("fla.ops.kda.fused_recurrent")
    gdn = pytest.importorskip("fla.ops.gated_delta_rule.fused_recurrent")
    assert _positional(serving.fused_recurrent_kda) == _positional(kda.fused_recurrent_kda)
    assert _positional(serving.fused_recurrent_gated_delta_rule) == _positional(gdn.fused_recurrent_gated_delta_rule)
    assert _positional(serving.fla_fwd_call) == _positional(inspect.unwrap(kda.fused_recurrent_kda_fwd))


# ============================================================================ inputs and references


def make_tokens(B, T, H, HV, *, per_head=False, log_decay=False, device="cpu", seed=0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    g = randn(B, T, HV) if per_head else randn(B, T, HV, D)
    if log_decay:
        g = F.logsigmoid(g + 2.0)
    return dict(q=randn(B, T, H, D).to(BF16), k=randn(B, T, H, D).to(BF16), v=randn(B, T, HV, D).to(BF16),
                g=g.to(BF16), beta=randn(B, T, HV).to(BF16))


def make_pool(slots, HV, dtype=torch.float32, device="cpu", seed=1) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return (0.1 * torch.randn(slots, HV, D, D, generator=gen, device=device)).to(dtype)


def fla_log_decay(g, *, use_gate_in_kernel, lower_bound, A_log, dt_bias, per_head):
    """FLA's fused recurrent kernels' log decay, in fp64 (its formulas, its missing-parameter rules)."""
    g = g.double()
    if not use_gate_in_kernel:
        return g
    heads = g.shape[-1] if per_head else g.shape[-2]
    if dt_bias is not None:
        g = g + (dt_bias.double().reshape(heads) if per_head else dt_bias.double().reshape(heads, D))
    if A_log is None:
        a = torch.ones(heads, dtype=torch.float64) if lower_bound is not None else torch.full((heads,), math.e)
    else:
        a = A_log.double().exp()
    a = a if per_head else a[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * F.softplus(g)


def fla_recurrence(q, k, v, log_decay, beta, *, scale, l2norm, beta_sigmoid, sequences):
    """FLA's token recurrence in fp64 over ``sequences``: (bos, eos, read state ``[HV, V, K]`` or None, sink) with
    ``sink(t, state)`` called after every token; returns o ``[total, HV, V]`` of the packed tokens."""
    H, HV = q.shape[-2], v.shape[-2]
    group = HV // H
    o = torch.zeros(v.shape, dtype=torch.float64)
    for bos, eos, state, sink in sequences:
        S = torch.zeros(HV, D, D, dtype=torch.float64) if state is None else state.double().clone()  # [HV, V, K]
        for t in range(bos, eos):
            qt, kt = q[t].double().repeat_interleave(group, 0), k[t].double().repeat_interleave(group, 0)
            if l2norm:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            b = beta[t].double()
            b = torch.sigmoid(b) if beta_sigmoid else b
            decay = log_decay[t].exp()
            S = S * (decay[:, None, :] if decay.dim() == 2 else decay[:, None, None])
            u = b[:, None] * (v[t].double() - torch.einsum("hvk,hk->hv", S, kt))
            S = S + u[:, :, None] * kt[:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", S, qt * scale)
            sink(t - bos, S)
    return o


def as_vk(state, state_v_first):
    return state if state_v_first else state.transpose(-1, -2)


def gold_launch(call: serving.PoolCall, pool: torch.Tensor) -> torch.Tensor:
    """The decode kernel's contract on the CPU: ``gold_decode`` per call (per packed sequence with ``cu_seqlens``),
    o rounded to bf16 into ``out``."""
    q, k, v, g, beta = call.tensors
    out = call.out if call.out is not None else torch.empty(v.shape, dtype=BF16)
    ids, counts, cu = call.state_indices, call.num_accepted_tokens, call.cu_seqlens
    if cu is None:
        parts = [(slice(None), slice(None), ids, counts)]
    else:
        bounds = cu.tolist()
        parts = [(slice(0, 1), slice(bounds[n], bounds[n + 1]),
                  ids[n:n + 1, :bounds[n + 1] - bounds[n]] if ids.dim() == 2 else ids[n:n + 1],
                  None if counts is None else counts[n:n + 1]) for n in range(len(bounds) - 1)]
    for rows, tokens, part_ids, part_counts in parts:
        if tokens.start is not None and tokens.stop == tokens.start:
            continue
        cut = [x[rows, tokens] for x in (q, k, v, g, beta)]
        o = gold_decode(*cut, call.A_log, call.dt_bias, pool, part_ids, part_counts, **call.options)
        out[rows, tokens] = o.to(BF16)
    return out


@pytest.fixture
def on_reference(monkeypatch):
    """Serving calls run the fp64 decode reference on the CPU instead of the kernel."""
    monkeypatch.setattr(serving, "launch_decode", gold_launch)


def assert_close(actual, expected, what, tolerance=5e-3):
    error = rel_rms(actual.double(), expected.double())
    assert error <= tolerance, (what, error)


# ============================================================================ the gate mapping and the contract (CPU)

KDA_GATES = {  # name: (use_gate_in_kernel, lower_bound, A_log given, dt_bias shape or None)
    "log_decay": (False, None, True, "flat"),
    "safe": (True, -5.0, True, "flat"),
    "safe_no_A_log": (True, -3.0, False, "2d"),
    "softplus": (True, None, True, "2d"),
    "softplus_no_A_log_no_bias": (True, None, False, None),
}


@pytest.mark.parametrize("state_v_first", [True, False], ids=["v_first", "k_first"])
@pytest.mark.parametrize("gate", sorted(KDA_GATES))
def test_kda_gate_mapping_matches_flas_formulas(on_reference, gate, state_v_first):
    """No pool (FLA's fused_recurrent_kda): each gate form, GVA, l2norm and β-sigmoid; o and the new fp32 final
    state against FLA's formulas in fp64; initial_state untouched."""
    use_gate, lower_bound, with_a_log, bias = KDA_GATES[gate]
    N, T, H, HV = 3, 4, 2, 4
    x = make_tokens(N, T, H, HV, log_decay=not use_gate)
    A_log = torch.log(torch.rand(HV) * 15 + 1) if with_a_log else None
    dt_bias = None if bias is None else 0.1 * torch.randn(HV * D)
    dt_bias = dt_bias.reshape(HV, D) if bias == "2d" else dt_bias
    h0 = make_pool(N, HV)
    h0_before = h0.clone()
    o, ht = serving.fused_recurrent_kda(
        **x, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=use_gate, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
        state_v_first=state_v_first)
    assert torch.equal(h0, h0_before) and ht.dtype == torch.float32 and ht.shape == h0.shape and o.dtype == BF16

    decay = fla_log_decay(x["g"], use_gate_in_kernel=use_gate, lower_bound=lower_bound, A_log=A_log,
                          dt_bias=dt_bias, per_head=False)
    finals = torch.zeros(N, HV, D, D, dtype=torch.float64)
    sequences = [(n * T, n * T + T, as_vk(h0[n], state_v_first),
                  (lambda t, S, n=n: finals.__setitem__(n, S) if t == T - 1 else None)) for n in range(N)]
    flat = {name: t.flatten(0, 1) for name, t in x.items()}
    o_ref = fla_recurrence(flat["q"], flat["k"], flat["v"], decay.flatten(0, 1), flat["beta"], scale=D ** -0.5,
                           l2norm=True, beta_sigmoid=True, sequences=sequences)
    assert_close(o.flatten(0, 1), o_ref, "o")
    assert_close(as_vk(ht, state_v_first), finals, "final state", 1e-5)


@pytest.mark.parametrize("case", ["softplus_per_head", "log_decay_per_head", "gk_per_channel", "no_beta"])
def test_gdn_gate_mapping_matches_flas_formulas(on_reference, case):
    N, T, H, HV = 2, 3, 2, 4
    per_head = case != "gk_per_channel"
    x = make_tokens(N, T, H, HV, per_head=per_head, log_decay=case != "softplus_per_head")
    use_gate = case == "softplus_per_head"
    A_log = torch.log(torch.rand(HV) * 15 + 1)
    dt_bias = 0.1 * torch.randn(HV)
    gates = {"gk": x.pop("g")} if case == "gk_per_channel" else {"g": x.pop("g")}
    if case == "no_beta":
        x["beta"] = None
    o, ht = serving.fused_recurrent_gated_delta_rule(
        **x, **gates, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=use_gate,
        A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    g = next(iter(gates.values()))
    decay = fla_log_decay(g, use_gate_in_kernel=use_gate, lower_bound=None, A_log=A_log, dt_bias=dt_bias,
                          per_head=per_head)
    beta = torch.ones(N, T, HV, dtype=BF16) if x["beta"] is None else x["beta"]
    finals = torch.zeros(N, HV, D, D, dtype=torch.float64)
    flat = {name: t.flatten(0, 1) for name, t in x.items() if t is not None}
    o_ref = fla_recurrence(flat["q"], flat["k"], flat["v"], decay.flatten(0, 1), beta.flatten(0, 1),
                           scale=D ** -0.5, l2norm=True, beta_sigmoid=True,
                           sequences=[(n * T, n * T + T, None,
                                       lambda t, S, n=n: finals.__setitem__(n, S) if t == T - 1 else None)
                                      for n in range(N)])
    assert_close(o.flatten(0, 1), o_ref, "o")
    assert_close(ht, finals, "final state", 1e-5)


def _pool_reference(x, pool, ids, counts, cu, *, state_v_first=True, **gate):
    """FLA's pool semantics in fp64 (−1: padding, nothing read or written, o zero): the expected o and pool."""
    expected_pool = pool.double().clone()
    flat = {name: t.flatten(0, 1) for name, t in x.items()}
    decay = fla_log_decay(flat["g"], per_head=False, **gate)
    if cu is None:
        T = x["q"].shape[1]
        bounds = [n * T for n in range(x["q"].shape[0] + 1)]
    else:
        bounds = cu.tolist()
    sequences = []
    for n in range(len(bounds) - 1):
        read = int(ids[n, int(counts[n]) - 1]) if ids.dim() == 2 else int(ids[n])
        if read < 0:
            continue
        length = bounds[n + 1] - bounds[n]

        def sink(t, S, n=n, length=length):
            slot = int(ids[n, t]) if ids.dim() == 2 else (int(ids[n]) if t == length - 1 else -1)
            if slot >= 0:
                expected_pool[slot] = as_vk(S, state_v_first)
        sequences.append((bounds[n], bounds[n + 1], as_vk(pool[read], state_v_first), sink))
    o = fla_recurrence(flat["q"], flat["k"], flat["v"], decay, flat["beta"], scale=D ** -0.5, l2norm=True,
                       beta_sigmoid=True, sequences=sequences)
    return o, expected_pool


_SAFE = dict(use_gate_in_kernel=True, lower_bound=-5.0)


def _pool_kwargs(x, A_log, dt_bias, **changes):
    kwargs = dict(**x, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)
    kwargs.update(changes)
    return kwargs


def _bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("state_v_first", [True, False], ids=["v_first", "k_first"])
def test_pool_decode_padding_rows_and_unlisted_slots(on_reference, state_v_first):
    N, HV, slots = 5, 4, 9
    x = make_tokens(N, 1, 4, HV)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, D)
    pool = make_pool(slots, HV)
    ids = torch.tensor([7, -1, 0, 3, -1], dtype=torch.int32)
    before = pool.clone()
    o_ref, pool_ref = _pool_reference(x, pool, ids, None, None, state_v_first=state_v_first, A_log=A_log,
                                      dt_bias=dt_bias, **_SAFE)
    out = torch.full_like(x["v"], float("nan"))
    o, ht = serving.fused_recurrent_kda(**_pool_kwargs(x, A_log, dt_bias, state_v_first=state_v_first),
                                        initial_state=pool, ssm_state_indices=ids, out=out)
    assert o is out and ht is pool
    assert torch.equal(o[[1, 4]], torch.zeros_like(o[[1, 4]]))
    assert_close(o.flatten(0, 1), o_ref, "o")
    unlisted = [s for s in range(slots) if s not in (7, 0, 3)]
    assert torch.equal(_bits(pool[unlisted]), _bits(before[unlisted]))
    assert_close(pool, pool_ref, "pool", 1e-5)


def test_verify_every_accepted_count(on_reference):
    """T = 1 + S = 4: one row per accepted count 1 .. 4, a padding row, a −1 after a row's last token."""
    N, W, HV = 5, 4, 2
    x = make_tokens(N, W, 2, HV, seed=3)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, D)
    pool = make_pool(N * W + 2, HV, torch.bfloat16)
    ids = torch.randperm(N * W).int().reshape(N, W)
    ids[4] = -1
    ids[2, 3] = -1
    counts = torch.tensor([1, 2, 3, 4, 1], dtype=torch.int32)
    o_ref, pool_ref = _pool_reference(x, pool, ids, counts, None, A_log=A_log, dt_bias=dt_bias, **_SAFE)
    o, _ = serving.fused_recurrent_kda(**_pool_kwargs(x, A_log, dt_bias), initial_state=pool, ssm_state_indices=ids,
                                       num_accepted_tokens=counts)
    assert torch.equal(o[4], torch.zeros_like(o[4]))
    assert_close(o.flatten(0, 1), o_ref, "o")
    assert_close(pool, pool_ref, "pool")


def test_verify_without_counts_reads_column_zero(on_reference):
    """FLA's 2-D slot ids without num_accepted_tokens: the state comes from column 0 (every count 1)."""
    N, W, HV = 3, 2, 2
    x = make_tokens(N, W, 2, HV, seed=4)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, D)
    pool = make_pool(N * W, HV)
    ids = torch.arange(N * W, dtype=torch.int32).reshape(N, W)
    o_ref, pool_ref = _pool_reference(x, pool, ids, torch.ones(N, dtype=torch.int32), None, A_log=A_log,
                                      dt_bias=dt_bias, **_SAFE)
    o, _ = serving.fused_recurrent_kda(**_pool_kwargs(x, A_log, dt_bias), initial_state=pool, ssm_state_indices=ids)
    assert_close(o.flatten(0, 1), o_ref, "o")
    assert_close(pool, pool_ref, "pool", 1e-5)


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_packed_calls(on_reference, verify):
    """cu_seqlens (int32): packed decode (one token each; a padding row) and packed verify (lengths ≤ 1 + S)."""
    HV, W = 2, 3
    lengths = [2, 3, 1, 2] if verify else [1, 1, 1, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = make_tokens(1, sum(lengths), 2, HV, seed=6)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, D)
    pool = make_pool(16, HV)
    if verify:
        ids = torch.arange(12, dtype=torch.int32).reshape(4, W)
        ids[1, 0] = -1  # read from column 1
        counts = torch.tensor([1, 2, 1, 2], dtype=torch.int32)
    else:
        ids, counts = torch.tensor([5, 2, -1, 9], dtype=torch.int32), None
    o_ref, pool_ref = _pool_reference(x, pool, ids, counts, cu, A_log=A_log, dt_bias=dt_bias, **_SAFE)
    o, _ = serving.fused_recurrent_kda(**_pool_kwargs(x, A_log, dt_bias), cu_seqlens=cu, initial_state=pool,
                                       ssm_state_indices=ids, num_accepted_tokens=counts)
    assert_close(o.flatten(0, 1), o_ref, "o")
    assert_close(pool, pool_ref, "pool", 1e-5)


def test_inplace_final_state_without_a_pool(on_reference):
    """FLA's fwd default: the final states overwrite initial_state's rows, which is returned."""
    N, HV = 2, 2
    x = make_tokens(N, 2, 2, HV, seed=7)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, D)
    h0 = make_pool(N, HV)
    expected_o, expected_state = serving.fused_recurrent_kda(**_pool_kwargs(x, A_log, dt_bias), initial_state=h0,
                                                             output_final_state=True)
    o, ht = serving.fused_recurrent_kda(**_pool_kwargs(x, A_log, dt_bias), initial_state=h0, inplace_final_state=True)
    assert ht is h0 and torch.equal(o, expected_o) and torch.equal(h0, expected_state)


def test_without_output_final_state_nothing_is_returned(on_reference):
    x = make_tokens(2, 1, 2, 2)
    o, ht = serving.fused_recurrent_kda(**x)
    assert ht is None and o.shape == x["v"].shape


# ============================================================================ bad inputs (CPU)


def _decode_call(**changes):
    """A valid pool decode call (N = 3, HV = 4, 6 slots), with ``changes``."""
    x = make_tokens(3, 1, 2, 4)
    kwargs = dict(**x, A_log=torch.zeros(4), dt_bias=torch.zeros(4, D), use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True,
                  initial_state=make_pool(6, 4), ssm_state_indices=torch.tensor([0, 5, -1], dtype=torch.int32))
    kwargs.update(changes)
    return kwargs


def _verify_call(**changes):
    verify = dict(**make_tokens(3, 2, 2, 4),
                  ssm_state_indices=torch.tensor([[0, 1], [2, 3], [-1, -1]], dtype=torch.int32),
                  num_accepted_tokens=torch.tensor([1, 2, 1], dtype=torch.int32))
    verify.update(changes)
    return _decode_call(**verify)


def _strided_pool():
    return torch.zeros(6, 4, D, D + 4)[..., :D]


BAD = {  # name: (the call's changes, error type, words the message holds)
    "pool dtype": (lambda: _decode_call(initial_state=make_pool(6, 4, torch.float16)), TypeError, "initial_state"),
    "pool rank": (lambda: _decode_call(initial_state=torch.zeros(6, 4, D * D)), ValueError, "initial_state"),
    "pool heads": (lambda: _decode_call(initial_state=make_pool(6, 2)), ValueError, "initial_state"),
    "pool block size": (lambda: _decode_call(initial_state=torch.zeros(6, 4, 64, 64)), NotImplementedError,
                        "initial_state"),
    "pool block not contiguous": (lambda: _decode_call(initial_state=make_pool(6, 4).transpose(-1, -2)), ValueError,
                                  "initial_state"),
    "pool slot stride": (lambda: _decode_call(initial_state=torch.zeros(6, 4 * D * D + 1)[:, :4 * D * D].view(
        6, 4, D, D)), ValueError, "slot and head strides"),
    "pool base misaligned": (lambda: _decode_call(initial_state=torch.zeros(6 * 4 * D * D + 1)[1:].view(6, 4, D, D)),
                             ValueError, "initial_state"),
    "pool missing": (lambda: _decode_call(initial_state=None), ValueError, "initial_state"),
    "slot ids int64": (lambda: _decode_call(ssm_state_indices=torch.tensor([0, 5, -1])), TypeError,
                       "ssm_state_indices"),
    "slot ids shape": (lambda: _decode_call(ssm_state_indices=torch.tensor([0, 5], dtype=torch.int32)), ValueError,
                       "ssm_state_indices"),
    "slot ids not contiguous": (lambda: _decode_call(
        ssm_state_indices=torch.tensor([0, 9, 5, 9, -1, 9], dtype=torch.int32)[::2]), ValueError, "ssm_state_indices"),
    "verify ids width": (lambda: _verify_call(ssm_state_indices=torch.zeros(3, 3, dtype=torch.int32)), ValueError,
                         "ssm_state_indices"),
    "counts int64": (lambda: _verify_call(num_accepted_tokens=torch.ones(3, dtype=torch.int64)), TypeError,
                     "num_accepted_tokens"),
    "counts shape": (lambda: _verify_call(num_accepted_tokens=torch.ones(2, dtype=torch.int32)), ValueError,
                     "num_accepted_tokens"),
    "counts with 1-D ids": (lambda: _decode_call(num_accepted_tokens=torch.ones(3, dtype=torch.int32)), ValueError,
                            "num_accepted_tokens"),
    "counts without ids": (lambda: _decode_call(ssm_state_indices=None, initial_state=None,
                                                num_accepted_tokens=torch.ones(3, dtype=torch.int32)), ValueError,
                           "num_accepted_tokens"),
    "not in place with a pool": (lambda: _decode_call(inplace_final_state=False), NotImplementedError,
                                 "inplace_final_state"),
    "in place without a state": (lambda: _decode_call(ssm_state_indices=None, initial_state=None,
                                                      inplace_final_state=True), ValueError, "initial_state"),
    "head dim 64": (lambda: _decode_call(q=torch.zeros(3, 1, 2, 64, dtype=BF16)), NotImplementedError, "K"),
    "headwise beta": (lambda: _decode_call(beta=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "beta"),
    "neg eigval": (lambda: _decode_call(allow_neg_eigval=True), NotImplementedError, "allow_neg_eigval"),
    "fp16 q": (lambda: _decode_call(q=torch.zeros(3, 1, 2, D, dtype=torch.float16)), TypeError, "q"),
    "fp32 v": (lambda: _decode_call(v=torch.zeros(3, 1, 4, D)), TypeError, "v"),
    "fp32 log decay": (lambda: _decode_call(g=torch.zeros(3, 1, 4, D), use_gate_in_kernel=False), TypeError, "g"),
    "bf16 out of another shape": (lambda: _decode_call(out=torch.zeros(3, 1, 2, D, dtype=BF16)), ValueError, "out"),
    "fp32 out": (lambda: _decode_call(out=torch.zeros(3, 1, 4, D)), TypeError, "out"),
    "lower bound": (lambda: _decode_call(lower_bound=-7.0), NotImplementedError, "lower_bound"),
    "dt_bias size": (lambda: _decode_call(dt_bias=torch.zeros(4)), ValueError, "dt_bias"),
    "A_log size": (lambda: _decode_call(A_log=torch.zeros(2)), ValueError, "A_log"),
    "q rows misaligned": (lambda: _decode_call(q=torch.zeros(3, 1, 2, D + 1, dtype=BF16)[..., 1:]), ValueError, "q"),
    "unknown keyword": (lambda: _decode_call(chunk_size=64), TypeError, "chunk_size"),
    "initial state shape": (lambda: _decode_call(ssm_state_indices=None, initial_state=make_pool(2, 4),
                                                 output_final_state=True), ValueError, "initial_state"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_raise_naming_the_argument(case, monkeypatch):
    monkeypatch.setattr(validation, "check_pool_values", _no_device_reads)
    make, error, words = BAD[case]
    with pytest.raises(error, match=words):
        serving.kda_call(**make())


GDN_BAD = {
    "gv": (dict(gv=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "gv"),
    "gk with g": (dict(gk=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "gk"),
    "no decay": (dict(g=None), NotImplementedError, "g"),
    "gate without A_log": (dict(use_gate_in_kernel=True), ValueError, "A_log"),
    "per-head dt_bias size": (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4, D)),
                              ValueError, "dt_bias"),
    "headwise beta": (dict(beta=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "beta"),
}


@pytest.mark.parametrize("case", sorted(GDN_BAD))
def test_gdn_bad_inputs_raise_naming_the_argument(case):
    x = make_tokens(3, 1, 2, 4, per_head=True, log_decay=True)
    changes, error, words = GDN_BAD[case]
    with pytest.raises(error, match=words):
        serving.gated_delta_rule_call(**{**x, **changes})


def _no_device_reads(*args, **kwargs):
    raise AssertionError("the value checks ran without CUTE_KDA_DEBUG_CHECKS")


def test_values_are_not_read_without_the_debug_switch(monkeypatch):
    """Out-of-range slot ids pass the structural checks untouched (the values are the kernel's to read)."""
    monkeypatch.delenv(validation.DEBUG_ENV, raising=False)
    monkeypatch.setattr(validation, "check_pool_values", _no_device_reads)
    serving.kda_call(**_decode_call(ssm_state_indices=torch.tensor([0, 99, -5], dtype=torch.int32)))
    serving.kda_call(**_verify_call(num_accepted_tokens=torch.tensor([0, 7, 1], dtype=torch.int32)))


DEBUG_BAD = {
    "slot past the pool": (lambda: _decode_call(ssm_state_indices=torch.tensor([0, 6, -1], dtype=torch.int32)),
                           r"ssm_state_indices\[1\] = 6 is not a slot of the pool"),
    "slot below -1": (lambda: _decode_call(ssm_state_indices=torch.tensor([0, -2, 1], dtype=torch.int32)),
                      r"ssm_state_indices\[1\] = -2 is not a slot"),
    "slot twice": (lambda: _decode_call(ssm_state_indices=torch.tensor([4, 1, 4], dtype=torch.int32)),
                   r"ssm_state_indices\[2\] = 4 repeats ssm_state_indices\[0\]"),
    "slot twice in a verify": (lambda: _verify_call(
        ssm_state_indices=torch.tensor([[0, 1], [2, 1], [-1, -1]], dtype=torch.int32)),
        r"ssm_state_indices\[1, 1\] = 1 repeats ssm_state_indices\[0, 1\]"),
    "count 0": (lambda: _verify_call(num_accepted_tokens=torch.tensor([0, 1, 1], dtype=torch.int32)),
                "num_accepted_tokens must lie in"),
    "count past 1 + S": (lambda: _verify_call(num_accepted_tokens=torch.tensor([1, 3, 1], dtype=torch.int32)),
                         "num_accepted_tokens must lie in"),
    "packed length past 1 + S": (lambda: _decode_call(
        **make_tokens(1, 5, 2, 4), cu_seqlens=torch.tensor([0, 1, 4, 5], dtype=torch.int32),
        ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)), "cu_seqlens"),
    "packed cu_seqlens end": (lambda: _decode_call(
        **make_tokens(1, 5, 2, 4), cu_seqlens=torch.tensor([0, 1, 2, 3], dtype=torch.int32)), "cu_seqlens"),
}


@pytest.mark.parametrize("case", sorted(DEBUG_BAD))
def test_debug_switch_checks_the_values(case, monkeypatch):
    monkeypatch.setenv(validation.DEBUG_ENV, "1")
    make, words = DEBUG_BAD[case]
    with pytest.raises(ValueError, match=words):
        serving.kda_call(**make())
    monkeypatch.setenv(validation.DEBUG_ENV, "0")
    serving.kda_call(**make())  # the structure alone is fine


def test_strided_pool_views_are_taken():
    """A pool view of a larger cache (padded state rows are not: the block must be contiguous), q/k/v split from
    one fused projection."""
    padded_slots = torch.zeros(6, 5, D, D)[:, 1:]
    serving.kda_call(**_decode_call(initial_state=padded_slots))
    fused = torch.zeros(3, 1, 8, D, dtype=BF16)
    serving.kda_call(**_decode_call(q=fused[:, :, :2], k=fused[:, :, 2:4], v=fused[:, :, 4:]))
    with pytest.raises(ValueError, match="initial_state"):
        serving.kda_call(**_decode_call(initial_state=_strided_pool()))


# ============================================================================ the FLA backend (CPU)


def _fwd_layer_call(**changes):
    """What FLA's fused_recurrent_kda passes to fused_recurrent_kda_fwd for the KDA layer in decode mode."""
    x = make_tokens(3, 1, 2, 4)
    kwargs = dict(**x, A_log=torch.zeros(4), dt_bias=torch.zeros(4 * D), scale=D ** -0.5, initial_state=None,
                  inplace_final_state=False, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, lower_bound=None,
                  cu_seqlens=None, state_v_first=True)
    kwargs.update(changes)
    return kwargs


@pytest.fixture
def any_device(monkeypatch):
    monkeypatch.setattr(fla_backend, "_device_reason", lambda q: None)


def test_fwd_verifier_takes_the_layer_and_engine_calls(any_device):
    assert fla_backend.verify_fused_recurrent(**_fwd_layer_call()) == (True, None)
    pool = make_pool(6, 4)
    engine = _fwd_layer_call(initial_state=pool, inplace_final_state=True,
                             ssm_state_indices=torch.tensor([2, -1, 0], dtype=torch.int32))
    assert fla_backend.verify_fused_recurrent(**engine) == (True, None)
    x = make_tokens(1, 3, 2, 4)
    packed = _fwd_layer_call(**x, initial_state=pool, inplace_final_state=True,
                             cu_seqlens=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                             ssm_state_indices=torch.tensor([2, -1, 0], dtype=torch.int32))
    assert fla_backend.verify_fused_recurrent(**packed) == (True, None)


@pytest.mark.parametrize("changes,words", [
    (dict(q=torch.zeros(3, 1, 2, D)), "q"),
    (dict(allow_neg_eigval=True), "allow_neg_eigval"),
    (dict(initial_state=make_pool(6, 4), inplace_final_state=False,
          ssm_state_indices=torch.tensor([2, -1, 0], dtype=torch.int32)), "inplace_final_state"),
    (dict(**make_tokens(3, 2, 2, 4), initial_state=make_pool(6, 4), inplace_final_state=True,
          ssm_state_indices=torch.tensor([2, -1, 0], dtype=torch.int32)), "ssm_state_indices"),
], ids=["fp32 q", "neg eigval", "pool not in place", "1-D ids with 2 tokens"])
def test_fwd_verifier_refuses_what_flas_kernel_computes_otherwise(any_device, changes, words):
    accepted, reason = fla_backend.verify_fused_recurrent(**_fwd_layer_call(**changes))
    assert not accepted and words in reason


def test_flas_kda_operation_registry_holds_cute_kda(monkeypatch):
    """With FLA importable (it needs triton): cute_kda sits in FLA's ``kda`` registry, which dispatches
    fused_recurrent_kda_fwd, at priority 2; ``FLA_CUTE_KDA=0`` disables it."""
    pytest.importorskip("fla.ops.kda")
    backends = pytest.importorskip("fla.backends")
    ours = [b for b in backends._get_operation_registry("kda")._get_sorted_backends() if b.backend_type == "cute_kda"]
    assert len(ours) == 1 and ours[0].priority == fla_backend.PRIORITY
    assert hasattr(ours[0], "fused_recurrent_kda_fwd_verifier")
    monkeypatch.setenv("FLA_CUTE_KDA", "0")
    assert not ours[0].is_enabled()


def test_fwd_verifier_refuses_cpu_tensors():
    accepted, reason = fla_backend.verify_fused_recurrent(**_fwd_layer_call())
    assert not accepted and "cuda" in reason.lower()


def test_fwd_implementation_reuses_the_verifiers_translation(any_device, on_reference, monkeypatch):
    kwargs = _fwd_layer_call()
    translations = []
    original = serving.fla_fwd_call
    monkeypatch.setattr(serving, "fla_fwd_call", lambda *a, **k: translations.append(1) or original(*a, **k))
    assert fla_backend.verify_fused_recurrent(**kwargs) == (True, None)
    o, ht = fla_backend.fused_recurrent_kda_fwd(**kwargs)
    assert len(translations) == 1 and o.shape == kwargs["v"].shape and ht.shape == (3, 4, D, D)
    fla_backend.fused_recurrent_kda_fwd(**kwargs)  # no verdict pending: translated again
    assert len(translations) == 2


# ============================================================================ GPU tier


def _fla_fwd():
    return inspect.unwrap(pytest.importorskip("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd)


def _gpu_gate(HV, device, seed=11):
    gen = torch.Generator(device=device).manual_seed(seed)
    return dict(A_log=torch.log(torch.rand(HV, generator=gen, device=device) * 15 + 1),
                dt_bias=0.1 * torch.randn(HV * D, generator=gen, device=device))


def _flags(**changes):
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 lower_bound=None, state_v_first=True)
    flags.update(changes)
    return flags


def _assert_states_close(actual, expected, what):
    tolerance = 1e-4 if actual.dtype == torch.float32 else 8e-3
    assert_close(actual, expected, what, tolerance)


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state_v_first", [True, False], ids=["v_first", "k_first"])
def test_pool_decode_matches_fla_with_padding_rows_and_a_guard(device, dtype, state_v_first):
    """N = 8 decode on a guarded pool (random bits, one guard slot on each side): o and the listed slots as FLA's
    fused_recurrent_kda_fwd computes them (FLA's padding rows sent to a scratch slot: its kernel has no −1), padding
    rows zero, every other slot and both guards bit-identical."""
    fla_fwd = _fla_fwd()
    N, H, HV, slots = 8, 4, 8, 20
    x = make_tokens(N, 1, H, HV, device=device, seed=12)
    gate = _gpu_gate(HV, device)
    ids = torch.tensor([3, -1, 17, 0, 9, -1, 12, 5], dtype=torch.int32, device=device)
    guarded = torch.empty(slots + 2, HV, D, D, dtype=dtype, device=device)
    _bits(guarded).copy_(torch.randint(-2**15, 2**15, guarded.shape, device=device, dtype=torch.int32))
    live = ids[ids >= 0].long()
    guarded[1:-1][live] = make_pool(len(live), HV, dtype, device=device)
    before = guarded.clone()
    reference = guarded[1:-1].clone()
    scratch = torch.where(ids < 0, torch.full_like(ids, slots - 1), ids)  # slot 19 is not listed
    fla_o, _ = fla_fwd(**x, **gate, initial_state=reference, ssm_state_indices=scratch, inplace_final_state=True,
                       **_flags(state_v_first=state_v_first))
    out = torch.empty_like(x["v"])
    o, ht = cute_kda.fused_recurrent_kda(**x, **gate, initial_state=guarded[1:-1], ssm_state_indices=ids, out=out,
                                         **_flags(state_v_first=state_v_first))
    torch.cuda.synchronize()
    rows = (ids >= 0).nonzero().flatten()
    assert o is out and torch.equal(o[ids < 0], torch.zeros_like(o[ids < 0]))
    assert_close(o[rows], fla_o[rows], "o")
    _assert_states_close(guarded[1:-1][live], reference[live], "pool")
    untouched = torch.ones(slots + 2, dtype=torch.bool, device=device)
    untouched[live + 1] = False
    assert torch.equal(_bits(guarded[untouched]), _bits(before[untouched]))


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("state_v_first", [True, False], ids=["v_first", "k_first"])
def test_verify_every_accepted_count_matches_fla(device, state_v_first):
    """Fixed-length verify, S = 3: rows with accepted counts 1 .. 4; o and every token's state as FLA's."""
    fla_fwd = _fla_fwd()
    N, W, H, HV = 4, 4, 2, 4
    x = make_tokens(N, W, H, HV, device=device, seed=13)
    gate = _gpu_gate(HV, device)
    pool = make_pool(N * W, HV, device=device)
    ids = torch.arange(N * W, dtype=torch.int32, device=device).flip(0).reshape(N, W).contiguous()
    counts = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=device)
    reference = pool.clone()
    fla_o, _ = fla_fwd(**x, **gate, initial_state=reference, ssm_state_indices=ids, num_accepted_tokens=counts,
                       inplace_final_state=True, **_flags(state_v_first=state_v_first))
    o, _ = cute_kda.fused_recurrent_kda(**x, **gate, initial_state=pool, ssm_state_indices=ids,
                                        num_accepted_tokens=counts, **_flags(state_v_first=state_v_first))
    torch.cuda.synchronize()
    assert_close(o, fla_o, "o")
    _assert_states_close(pool, reference, "pool")


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("gate", ["safe", "softplus", "log_decay"])
def test_no_pool_call_matches_flas_fused_recurrent_kda(device, monkeypatch, gate):
    """FLA's public fused_recurrent_kda (initial_state, output_final_state) on each gate, FLA's kernel
    (``FLA_CUTE_KDA=0``: it would dispatch to cute_kda) against cute_kda's: o and the final state."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    monkeypatch.setenv("FLA_CUTE_KDA", "0")
    N, T, H, HV = 3, 4, 2, 4
    x = make_tokens(N, T, H, HV, log_decay=gate == "log_decay", device=device, seed=14)
    flags = _flags(use_gate_in_kernel=gate != "log_decay", lower_bound=-5.0 if gate == "safe" else None)
    h0 = make_pool(N, HV, device=device)
    kwargs = dict(**x, **_gpu_gate(HV, device), initial_state=h0, output_final_state=True, **flags)
    fla_o, fla_ht = fla_kda.fused_recurrent_kda(**kwargs)
    h0_before = h0.clone()
    o, ht = cute_kda.fused_recurrent_kda(**kwargs)
    torch.cuda.synchronize()
    assert torch.equal(h0, h0_before)
    assert_close(o, fla_o, "o")
    _assert_states_close(ht, fla_ht, "final state")


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("use_gate_in_kernel", [True, False], ids=["softplus", "log_decay"])
def test_gdn_per_head_gate_matches_fla(device, use_gate_in_kernel):
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")
    N, T, H, HV = 3, 2, 2, 8
    x = make_tokens(N, T, H, HV, per_head=True, log_decay=not use_gate_in_kernel, device=device, seed=15)
    gen = torch.Generator(device=device).manual_seed(16)
    kwargs = dict(**x, initial_state=make_pool(N, HV, device=device), output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=use_gate_in_kernel,
                  A_log=torch.log(torch.rand(HV, generator=gen, device=device) * 15 + 1),
                  dt_bias=0.1 * torch.randn(HV, generator=gen, device=device), use_beta_sigmoid_in_kernel=True,
                  state_v_first=True)
    fla_o, fla_ht = fla_gdn.fused_recurrent_gated_delta_rule(**kwargs)
    o, ht = cute_kda.fused_recurrent_gated_delta_rule(**kwargs)
    torch.cuda.synchronize()
    assert_close(o, fla_o, "o")
    _assert_states_close(ht, fla_ht, "final state")


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [True, False], ids=["v_first", "k_first"])
def test_gdn_pool_decode_equals_gather_run_scatter(device, state_v_first):
    """GatedDeltaNet's per-head gate on an fp32 pool (FLA's GatedDeltaNet has no pool to compare with): the same bits
    as gathering the live rows' states, a call without the pool, and scattering the final states back."""
    N, H, HV, slots = 6, 2, 8, 10
    x = make_tokens(N, 1, H, HV, per_head=True, device=device, seed=22)
    gen = torch.Generator(device=device).manual_seed(23)
    gate = dict(A_log=torch.log(torch.rand(HV, generator=gen, device=device) * 15 + 1),
                dt_bias=0.1 * torch.randn(HV, generator=gen, device=device))
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=state_v_first)
    pool = make_pool(slots, HV, device=device)
    ids = torch.tensor([4, -1, 0, 9, -1, 7], dtype=torch.int32, device=device)
    rows, live = (ids >= 0).nonzero().flatten(), ids[ids >= 0].long()
    expected_pool = pool.clone()
    o_rows, final = cute_kda.fused_recurrent_gated_delta_rule(
        **{name: t[rows] for name, t in x.items()}, **gate, initial_state=expected_pool[live], output_final_state=True,
        **flags)
    expected_pool[live] = final
    o, _ = cute_kda.fused_recurrent_gated_delta_rule(**x, **gate, initial_state=pool, ssm_state_indices=ids, **flags)
    torch.cuda.synchronize()
    assert torch.equal(o[rows], o_rows) and torch.equal(o[ids < 0], torch.zeros_like(o[ids < 0]))
    assert torch.equal(_bits(pool), _bits(expected_pool))


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("tokens,fp32_gate_parameters", [(1, False), (5, False), (1, True)],
                         ids=["decode", "prompt_of_5", "decode_fp32_A_log"])
def test_fla_kda_layer_in_decode_mode_runs_on_cute_kda(device, monkeypatch, tokens, fp32_gate_parameters):
    """FLA's KimiDeltaAttention in inference with q_len ≤ 64 takes its fused_recurrent mode: the dispatched
    fused_recurrent_kda_fwd reaches cute_kda (counted), and the layer's output agrees with FLA's kernels. The layer in
    bf16 has bf16 A_log / dt_bias (widened per call); Kimi keeps them fp32 (parameters that require grad)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "kda_layer_example", Path(__file__).resolve().parents[1] / "examples" / "kda_layer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    layer = example.build_layer(hidden=512, heads=4, gate="softplus")
    if fp32_gate_parameters:
        layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float()
        assert layer.A_log.requires_grad
    x = torch.randn(3, tokens, 512, device=device, dtype=BF16)
    ran = []
    implementation = fla_backend.fused_recurrent_kda_fwd
    monkeypatch.setattr(fla_backend, "fused_recurrent_kda_fwd",
                        lambda *a, **k: ran.append(1) or implementation(*a, **k))
    with torch.no_grad():
        monkeypatch.setenv("FLA_CUTE_KDA", "0")
        expected = layer(x)[0]
        assert ran == []
        monkeypatch.delenv("FLA_CUTE_KDA")
        got = layer(x)[0]
    assert ran == [1]
    assert_close(got, expected, "layer output", 1e-2)


@pytest.mark.gpu
@pytest.mark.fla
def test_flas_dispatched_fwd_runs_engine_calls_on_cute_kda(device, monkeypatch):
    """An engine's verify call to FLA's fused_recurrent_kda_fwd (the dispatched entry) reaches cute_kda (counted) and
    gives cute_kda's bits; a call cute_kda refuses (fp32 q) stays with FLA's kernel."""
    fused = pytest.importorskip("fla.ops.kda.fused_recurrent")
    monkeypatch.delenv("FLA_CUTE_KDA", raising=False)
    ran = []
    implementation = fla_backend.fused_recurrent_kda_fwd
    monkeypatch.setattr(fla_backend, "fused_recurrent_kda_fwd",
                        lambda *a, **k: ran.append(1) or implementation(*a, **k))
    N, W, H, HV = 4, 3, 2, 4
    x = make_tokens(N, W, H, HV, device=device, seed=21)
    gate = _gpu_gate(HV, device)
    pool = make_pool(N * W, HV, device=device)
    ids = torch.arange(N * W, dtype=torch.int32, device=device).reshape(N, W)
    counts = torch.tensor([1, 3, 2, 1], dtype=torch.int32, device=device)
    ours = pool.clone()
    o, ht = fused.fused_recurrent_kda_fwd(**x, **gate, initial_state=pool, ssm_state_indices=ids,
                                          num_accepted_tokens=counts, inplace_final_state=True, **_flags())
    expected, _ = cute_kda.fused_recurrent_kda(**x, **gate, initial_state=ours, ssm_state_indices=ids,
                                               num_accepted_tokens=counts, **_flags())
    torch.cuda.synchronize()
    assert ran == [1] and ht is pool
    assert torch.equal(o, expected) and torch.equal(_bits(pool), _bits(ours))
    fused.fused_recurrent_kda_fwd(**{**x, "q": x["q"].float()}, **gate, initial_state=pool, ssm_state_indices=ids,
                                  num_accepted_tokens=counts, inplace_final_state=True, **_flags())
    assert ran == [1]


@pytest.mark.gpu
def test_steady_decode_loop_allocates_nothing_syncs_nothing_and_replays_in_a_cuda_graph(device):
    """Decode and verify steps with the caller's pool, slot ids and out: eager calls allocate nothing and never
    synchronise (torch's sync debug mode raises); a captured loop of both replays to the eager result and
    allocates nothing across replays."""
    N, H, HV, W = 8, 4, 8, 4
    dec = make_tokens(N, 1, H, HV, device=device, seed=18)
    ver = make_tokens(N, W, H, HV, device=device, seed=19)
    gate = _gpu_gate(HV, device)
    pool = make_pool(N * W + N, HV, device=device)
    dec_ids = torch.arange(N, dtype=torch.int32, device=device)
    dec_ids[3] = -1
    ver_ids = (N + torch.arange(N * W, dtype=torch.int32, device=device)).reshape(N, W)
    counts = (torch.arange(N, dtype=torch.int32, device=device) % W + 1).contiguous()
    dec_out, ver_out = torch.empty_like(dec["v"]), torch.empty_like(ver["v"])

    def step(state_pool):
        cute_kda.fused_recurrent_kda(**dec, **gate, initial_state=state_pool, ssm_state_indices=dec_ids, out=dec_out,
                                     **_flags())
        cute_kda.fused_recurrent_kda(**ver, **gate, initial_state=state_pool, ssm_state_indices=ver_ids,
                                     num_accepted_tokens=counts, out=ver_out, **_flags())

    eager_pool = pool.clone()
    step(eager_pool)  # compiles and makes the cached constants
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step(eager_pool)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    eager = (dec_out.clone(), ver_out.clone(), eager_pool.clone())
    _assert_graph_replays_to(step, pool, 4, (dec_out, ver_out), eager)


def _assert_graph_replays_to(step, pool, replays, outputs, expected) -> None:
    """``step(pool)`` captured in a CUDA graph and replayed ``replays`` times from :func:`make_pool`'s pool
    allocates nothing and leaves ``outputs`` and the pool as ``expected`` (the outputs', then the pool)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pool)
    pool.copy_(make_pool(*pool.shape[:2], device=pool.device))
    allocated = torch.cuda.memory_allocated()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert all(torch.equal(out, want) for out, want in zip(outputs, expected))
    assert torch.equal(_bits(pool), _bits(expected[-1]))


@pytest.mark.gpu
def test_gdn_steady_loop_matches_the_full_checks_allocates_nothing_and_replays_in_a_cuda_graph(device, monkeypatch):
    """GatedDeltaNet (Qwen3-Next's decode: grouped heads, per-head softplus gate, beta None) decode and verify steps
    from their kept plans: the bits of the same steps run through the full checks, no allocation and no sync
    eagerly, and a captured loop replays to the eager result."""
    N, H, HV, W = 8, 4, 8, 4
    dec = make_tokens(N, 1, H, HV, per_head=True, device=device, seed=24)
    ver = make_tokens(N, W, H, HV, per_head=True, device=device, seed=25)
    dec["beta"] = ver["beta"] = None
    gen = torch.Generator(device=device).manual_seed(26)
    gate = dict(A_log=torch.log(torch.rand(HV, generator=gen, device=device) * 15 + 1),
                dt_bias=0.1 * torch.randn(HV, generator=gen, device=device), use_gate_in_kernel=True)
    pool = make_pool(N * W + N, HV, device=device)
    dec_ids = torch.arange(N, dtype=torch.int32, device=device)
    dec_ids[3] = -1
    ver_ids = (N + torch.arange(N * W, dtype=torch.int32, device=device)).reshape(N, W)
    counts = (torch.arange(N, dtype=torch.int32, device=device) % W + 1).contiguous()
    dec_out, ver_out = torch.empty_like(dec["v"]), torch.empty_like(ver["v"])
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)

    def step(state_pool):
        cute_kda.fused_recurrent_gated_delta_rule(**dec, **gate, initial_state=state_pool, ssm_state_indices=dec_ids,
                                                  out=dec_out, **flags)
        cute_kda.fused_recurrent_gated_delta_rule(**ver, **gate, initial_state=state_pool, ssm_state_indices=ver_ids,
                                                  num_accepted_tokens=counts, out=ver_out, **flags)

    full_pool = pool.clone()
    with monkeypatch.context() as patch:
        patch.setattr(serving, "steady_plan", lambda *a: None)
        for _ in range(2):
            step(full_pool)
    torch.cuda.synchronize()
    full = (dec_out.clone(), ver_out.clone(), full_pool)

    eager_pool = pool.clone()
    step(eager_pool)  # from the plans the full-check steps kept
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(eager_pool)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    assert torch.equal(dec_out, full[0]) and torch.equal(ver_out, full[1])
    assert torch.equal(_bits(eager_pool), _bits(full[2]))
    _assert_graph_replays_to(step, pool, 2, (dec_out, ver_out), full)


@pytest.mark.gpu
@pytest.mark.fla
def test_packed_verify_matches_fla(device):
    """Needs the decode launcher's cu_seqlens (the token-loop branch): packed verify of lengths ≤ 1 + S = 4 (a
    length-0 row included) against FLA's kernel, int32 cu_seqlens."""
    fla_fwd = _fla_fwd()
    lengths = [4, 2, 0, 3, 1]
    N, W, H, HV = len(lengths), 4, 2, 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    x = make_tokens(1, sum(lengths), H, HV, device=device, seed=20)
    gate = _gpu_gate(HV, device)
    pool = make_pool(N * W, HV, device=device)
    ids = torch.arange(N * W, dtype=torch.int32, device=device).reshape(N, W)
    counts = torch.tensor([2, 1, 1, 3, 1], dtype=torch.int32, device=device)
    reference = pool.clone()
    fla_o, _ = fla_fwd(**x, **gate, initial_state=reference, cu_seqlens=cu, ssm_state_indices=ids,
                       num_accepted_tokens=counts, inplace_final_state=True, **_flags())
    o, _ = cute_kda.fused_recurrent_kda(**x, **gate, initial_state=pool, cu_seqlens=cu, ssm_state_indices=ids,
                                        num_accepted_tokens=counts, **_flags())
    torch.cuda.synchronize()
    assert_close(o, fla_o, "o")
    _assert_states_close(pool, reference, "pool")


# ============================================================================ the steady-state fast path (CPU)


@pytest.fixture
def cpu_as_device_0(monkeypatch, request):
    """CPU tensors pass for CUDA device 0's (the fast path keeps plans for CUDA calls only) and the compiled decode
    kernel records its arguments instead of running: ``launches`` (a list of argument tuples) is returned."""
    from cute_kda.ops import decode as ops

    launches = []
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(ops, "sm_count", lambda index: 132)
    monkeypatch.setattr(ops, "check_supported", lambda device: None)  # an sm_90 device, as far as the plan knows
    monkeypatch.setattr(ops, "compiled_variant", lambda variant, index: lambda *args: launches.append(args))
    for forget in (serving._STEADY_PLANS.clear, ops.launch_plan.cache_clear):  # none made with the stand-ins
        forget()
        request.addfinalizer(forget)
    return launches


def _full_checks(monkeypatch, kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(serving, "steady_plan", lambda *a: None)
        return serving.kda_call(**kwargs)


def _same(x, y) -> bool:
    if x is y:
        return True
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                and x.stride() == y.stride() and x.dtype == y.dtype and x.data_ptr() == y.data_ptr())
    if isinstance(x, tuple):
        return type(x) is type(y) and len(x) == len(y) and all(_same(i, j) for i, j in zip(x, y))
    return x == y


STEADY = {
    "decode softplus": lambda: _decode_call(lower_bound=None, out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "decode safe, dt_bias [HV*K]": lambda: _decode_call(dt_bias=torch.zeros(4 * D),
                                                        out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "decode, parameters that require grad": lambda: _decode_call(
        A_log=torch.nn.Parameter(torch.zeros(4)), dt_bias=torch.nn.Parameter(torch.zeros(4 * D)),
        out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "decode, default A_log and dt_bias": lambda: _decode_call(A_log=None, dt_bias=None,
                                                              out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "decode log decay": lambda: _decode_call(use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                             out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "decode log decay, gate parameters given and unread": lambda: _decode_call(
        use_gate_in_kernel=False, out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "decode, q k v views of one projection": lambda: _decode_call(
        **dict(zip("qkv", torch.zeros(3, 1, 8, D, dtype=BF16).split([2, 2, 4], dim=2))),
        out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "verify": lambda: _verify_call(out=torch.empty(3, 2, 4, D, dtype=BF16), scale=0.25),
    "verify without counts": lambda: _verify_call(num_accepted_tokens=None, out=torch.empty(3, 2, 4, D, dtype=BF16)),
    "packed verify": lambda: _decode_call(
        **make_tokens(1, 5, 2, 4), cu_seqlens=torch.tensor([0, 1, 4, 5], dtype=torch.int32),
        ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5], [-1, -1, -1]], dtype=torch.int32),
        out=torch.empty(1, 5, 4, D, dtype=BF16)),
    "bf16 pool, k-first": lambda: _decode_call(initial_state=make_pool(6, 4, torch.bfloat16), state_v_first=False,
                                               out=torch.empty(3, 1, 4, D, dtype=BF16)),
    "strided pool view": lambda: _decode_call(initial_state=torch.zeros(6, 5, D, D)[:, 1:],
                                              out=torch.empty(3, 1, 4, D, dtype=BF16)),
}


def _steady_launch(kwargs) -> bool:
    return serving.steady_launch(
        "kda", *(kwargs[name] for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), kwargs.get("scale"),
        kwargs["initial_state"], True, kwargs["use_gate_in_kernel"], True, kwargs["lower_bound"],
        kwargs["state_v_first"], kwargs.get("cu_seqlens"), kwargs["ssm_state_indices"],
        kwargs.get("num_accepted_tokens"), kwargs["out"])


def _assert_launched_alike(launches, kwargs, full_o, case) -> tuple:
    """Of four launches (the first call's, the second call's from the plan, a direct steady launch's, the full
    checks' run's), the second's arguments are the fourth's, with ``kwargs``'s q and out; returns those two."""
    assert len(launches) == 4
    fast_args, full_args = launches[1], launches[3]
    assert all(_same(x, y) for x, y in zip(fast_args, full_args)), case
    assert fast_args[0].q is kwargs["q"] and fast_args[5] is kwargs["out"] and full_o is kwargs["out"]
    return fast_args, full_args


@pytest.mark.parametrize("case", sorted(STEADY))
def test_fast_path_launches_what_the_full_checks_launch(cpu_as_device_0, monkeypatch, case):
    """The first call of a configuration runs the full checks and keeps its plan; a second call with other tensors
    of the same configuration launches from the plan, with the arguments the full path gives the kernel."""
    launches = cpu_as_device_0
    first, second = STEADY[case](), STEADY[case]()
    assert not _steady_launch(first)  # no plan yet
    cute_kda.fused_recurrent_kda(**first)
    cute_kda.fused_recurrent_kda(**second)  # from the plan
    assert _steady_launch(second)
    _assert_launched_alike(launches, second, _full_checks(monkeypatch, second).run()[0], case)
    assert _same(serving.kda_call(**second), _full_checks(monkeypatch, second))  # FLA's backend: the PoolCall


def test_a_new_tensor_layout_or_address_leaves_the_fast_path(cpu_as_device_0, monkeypatch):
    """Calls of a kept configuration with a misaligned base, a strided view, the debug switch or another current
    device go through the full checks (which refuse the misaligned base, name the value errors under the switch)."""
    kwargs = _decode_call(out=torch.empty(3, 1, 4, D, dtype=BF16))
    cute_kda.fused_recurrent_kda(**kwargs)
    assert _steady_launch(kwargs)
    misaligned = torch.zeros(3 * 2 * D + 1, dtype=BF16)[1:].view(3, 1, 2, D)
    assert misaligned.stride() == kwargs["q"].stride()
    with pytest.raises(ValueError, match="q"):
        cute_kda.fused_recurrent_kda(**{**kwargs, "q": misaligned})
    assert not _steady_launch({**kwargs, "v": torch.zeros(3, 1, 8, D, dtype=BF16)[:, :, ::2]})
    monkeypatch.setenv(validation.DEBUG_ENV, "1")
    assert not _steady_launch(kwargs)
    with pytest.raises(ValueError, match="repeats"):
        cute_kda.fused_recurrent_kda(**{**kwargs, "ssm_state_indices": torch.tensor([4, 1, 4], dtype=torch.int32)})
    monkeypatch.delenv(validation.DEBUG_ENV)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not _steady_launch(kwargs)


def test_each_layers_gate_parameters_reach_the_kernel(cpu_as_device_0):
    """Layers share a configuration (one plan) but not their parameters: each call's own A_log and dt_bias (viewed
    and detached, as the layers' parameters require grad) reach the kernel, not the first layer's."""
    launches = cpu_as_device_0
    layers = [(torch.nn.Parameter(torch.rand(4)), torch.nn.Parameter(torch.rand(4 * D))) for _ in range(3)]
    for A_log, dt_bias in layers + layers:
        kwargs = _decode_call(A_log=A_log, dt_bias=dt_bias, out=torch.empty(3, 1, 4, D, dtype=BF16))
        cute_kda.fused_recurrent_kda(**kwargs)
        inputs = launches[-1][0]
        assert inputs.a_log.data_ptr() == A_log.data_ptr() and not inputs.a_log.requires_grad
        assert inputs.dt_bias.data_ptr() == dt_bias.data_ptr() and inputs.dt_bias.shape == (4, D)
    assert len(launches) == 6 and _steady_launch(kwargs)
    for A_log, dt_bias in layers[:2]:  # a weight reload that replaces the storage: the new memory is read
        A_log.data, dt_bias.data = torch.rand(4), torch.rand(4 * D)
        cute_kda.fused_recurrent_kda(**_decode_call(A_log=A_log, dt_bias=dt_bias,
                                                    out=torch.empty(3, 1, 4, D, dtype=BF16)))
        inputs = launches[-1][0]
        assert inputs.a_log.data_ptr() == A_log.data_ptr() and inputs.dt_bias.data_ptr() == dt_bias.data_ptr()


@pytest.mark.parametrize("case", sorted(BAD))
def test_fast_path_never_takes_a_bad_call(cpu_as_device_0, monkeypatch, case):
    """With plans kept for the good decode and verify calls, every bad input (``out`` given, so the fast path is
    tried) still raises, naming the argument, from the launching entry point and from FLA's backend's."""
    monkeypatch.setattr(validation, "check_pool_values", _no_device_reads)
    for good in (_decode_call(out=torch.empty(3, 1, 4, D, dtype=BF16)),
                 _verify_call(out=torch.empty(3, 2, 4, D, dtype=BF16))):
        cute_kda.fused_recurrent_kda(**good)
    make, error, words = BAD[case]
    kwargs = make()
    kwargs.setdefault("out", torch.empty(kwargs["v"].shape, dtype=BF16) if kwargs["v"].dtype == BF16 else None)
    with pytest.raises(error, match=words):
        cute_kda.fused_recurrent_kda(**kwargs)
    with pytest.raises(error, match=words):
        serving.kda_call(**kwargs)


def _gdn_decode_call(**changes):
    """A valid GatedDeltaNet pool decode call (N = 3, H = 2, HV = 4: grouped heads; per-head softplus gate; 6 slots;
    ``out`` given), with ``changes``."""
    x = make_tokens(3, 1, 2, 4, per_head=True)
    kwargs = dict(**x, A_log=torch.zeros(4), dt_bias=torch.zeros(4), use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                  initial_state=make_pool(6, 4), ssm_state_indices=torch.tensor([0, 5, -1], dtype=torch.int32),
                  out=torch.empty(3, 1, 4, D, dtype=BF16))
    kwargs.update(changes)
    return kwargs


def _gdn_verify_call(**changes):
    verify = dict(**make_tokens(3, 2, 2, 4, per_head=True), out=torch.empty(3, 2, 4, D, dtype=BF16),
                  ssm_state_indices=torch.tensor([[0, 1], [2, 3], [-1, -1]], dtype=torch.int32),
                  num_accepted_tokens=torch.tensor([1, 2, 1], dtype=torch.int32))
    verify.update(changes)
    return _gdn_decode_call(**verify)


GDN_STEADY = {
    "decode softplus": _gdn_decode_call,
    "decode, beta None": lambda: _gdn_decode_call(beta=None),
    "decode, default dt_bias": lambda: _gdn_decode_call(dt_bias=None),
    "decode, parameters that require grad, A_log [HV, 1]": lambda: _gdn_decode_call(
        A_log=torch.nn.Parameter(torch.zeros(4, 1)), dt_bias=torch.nn.Parameter(torch.zeros(4))),
    "decode log decay, gate parameters given and unread": lambda: _gdn_decode_call(
        g=F.logsigmoid(torch.randn(3, 1, 4)).to(BF16), use_gate_in_kernel=False),
    "decode gk (per-channel log decay)": lambda: _gdn_decode_call(
        g=None, gk=F.logsigmoid(torch.randn(3, 1, 4, D)).to(BF16), use_gate_in_kernel=False, A_log=None,
        dt_bias=None),
    "verify, beta None": lambda: _gdn_verify_call(beta=None, scale=0.25),
    "verify without counts": lambda: _gdn_verify_call(num_accepted_tokens=None),
    "packed verify, beta None": lambda: _gdn_decode_call(
        **{**make_tokens(1, 5, 2, 4, per_head=True), "beta": None},
        cu_seqlens=torch.tensor([0, 1, 4, 5], dtype=torch.int32),
        ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5], [-1, -1, -1]], dtype=torch.int32),
        out=torch.empty(1, 5, 4, D, dtype=BF16)),
    "bf16 pool, k-first": lambda: _gdn_decode_call(initial_state=make_pool(6, 4, torch.bfloat16),
                                                   state_v_first=False),
}


def _gdn_steady_launch(kwargs) -> bool:
    g, gk = kwargs.get("g"), kwargs.get("gk")
    return serving.steady_launch(
        "gdn g" if gk is None else "gdn gk", *(kwargs[name] for name in ("q", "k", "v")), g if gk is None else gk,
        *(kwargs.get(name) for name in ("beta", "A_log", "dt_bias", "scale")), kwargs["initial_state"], True,
        kwargs["use_gate_in_kernel"], True, None, kwargs["state_v_first"], kwargs.get("cu_seqlens"),
        kwargs["ssm_state_indices"], kwargs.get("num_accepted_tokens"), kwargs["out"])


def _gdn_full_checks(monkeypatch, kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(serving, "steady_plan", lambda *a: None)
        return serving.gated_delta_rule_call(**kwargs)


@pytest.mark.parametrize("case", sorted(GDN_STEADY))
def test_gdn_fast_path_launches_what_the_full_checks_launch(cpu_as_device_0, monkeypatch, case):
    """As for KDA: the first GatedDeltaNet call of a configuration keeps its plan, a second one with other tensors
    launches from it (the full checks do not run) with the arguments the full path gives the kernel; a missing
    beta is the same cached ones in both."""
    launches = cpu_as_device_0
    first, second = GDN_STEADY[case](), GDN_STEADY[case]()
    assert not _gdn_steady_launch(first)  # no plan yet
    cute_kda.fused_recurrent_gated_delta_rule(**first)
    with monkeypatch.context() as patch:
        patch.setattr(serving, "check_tokens", _no_device_reads)
        cute_kda.fused_recurrent_gated_delta_rule(**second)  # from the plan
        assert _gdn_steady_launch(second)
    fast_args, full_args = _assert_launched_alike(launches, second,
                                                  _gdn_full_checks(monkeypatch, second).run()[0], case)
    if second["beta"] is None:
        assert _same(fast_args[0].beta, full_args[0].beta) and fast_args[0].beta is launches[0][0].beta
        assert torch.equal(fast_args[0].beta, torch.ones(second["v"].shape[:3], dtype=BF16))
    assert _same(serving.gated_delta_rule_call(**second), _gdn_full_checks(monkeypatch, second))


GDN_STEADY_BAD = {  # name: (the call's changes, error type, words the message holds)
    "gv": (dict(gv=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "gv"),
    "gk with g": (dict(gk=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "gk"),
    "gk with the gate": (dict(g=None, gk=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "gk"),
    "per-channel g": (dict(g=torch.zeros(3, 1, 4, D, dtype=BF16), use_gate_in_kernel=False), ValueError, "g"),
    "per-head gk": (dict(g=None, gk=torch.zeros(3, 1, 4, dtype=BF16), use_gate_in_kernel=False), ValueError, "g"),
    "no decay": (dict(g=None), ValueError, "g"),
    "gate without A_log": (dict(A_log=None), ValueError, "A_log"),
    "A_log size": (dict(A_log=torch.zeros(2)), ValueError, "A_log"),
    "per-channel dt_bias": (dict(dt_bias=torch.zeros(4, D)), ValueError, "dt_bias"),
    "headwise beta": (dict(beta=torch.zeros(3, 1, 4, D, dtype=BF16)), NotImplementedError, "beta"),
    "fp32 beta": (dict(beta=torch.zeros(3, 1, 4)), TypeError, "beta"),
    "fp32 g": (dict(g=torch.zeros(3, 1, 4)), TypeError, "g"),
    "fp32 v, beta None": (dict(v=torch.zeros(3, 1, 4, D), beta=None), TypeError, "v"),
    "neg eigval": (dict(allow_neg_eigval=True), NotImplementedError, "allow_neg_eigval"),
    "unknown keyword": (dict(chunk_size=64), TypeError, "chunk_size"),
    "pool dtype": (dict(initial_state=make_pool(6, 4, torch.float16)), TypeError, "initial_state"),
    "pool heads": (dict(initial_state=make_pool(6, 2)), ValueError, "initial_state"),
    "slot ids int64": (dict(ssm_state_indices=torch.tensor([0, 5, -1])), TypeError, "ssm_state_indices"),
    "counts with 1-D ids": (dict(num_accepted_tokens=torch.ones(3, dtype=torch.int32)), ValueError,
                            "num_accepted_tokens"),
    "not in place with a pool": (dict(inplace_final_state=False), NotImplementedError, "inplace_final_state"),
    "fp32 out": (dict(out=torch.zeros(3, 1, 4, D)), TypeError, "out"),
    "q rows misaligned": (dict(q=torch.zeros(3, 1, 2, D + 1, dtype=BF16)[..., 1:]), ValueError, "q"),
    "misaligned out base": (dict(out=torch.zeros(3 * 4 * D + 1, dtype=BF16)[1:].view(3, 1, 4, D)), ValueError,
                            "out"),
}


@pytest.mark.parametrize("case", sorted(GDN_STEADY_BAD))
def test_gdn_fast_path_never_takes_a_bad_call(cpu_as_device_0, monkeypatch, case):
    """With plans kept for good GatedDeltaNet calls (per-head gate, log decay, gk, beta None, verify), every bad
    input still raises, naming the argument (g and gk, which the key tells apart, included)."""
    monkeypatch.setattr(validation, "check_pool_values", _no_device_reads)
    for good in (_gdn_decode_call(), _gdn_decode_call(beta=None), _gdn_verify_call(),
                 _gdn_decode_call(use_gate_in_kernel=False),
                 _gdn_decode_call(g=None, gk=torch.zeros(3, 1, 4, D, dtype=BF16), use_gate_in_kernel=False),
                 _gdn_decode_call(g=torch.zeros(3, 1, 4, dtype=BF16), use_gate_in_kernel=False, A_log=None,
                                  dt_bias=None)):
        cute_kda.fused_recurrent_gated_delta_rule(**good)
    changes, error, words = GDN_STEADY_BAD[case]
    kwargs = _gdn_decode_call(**changes)
    with pytest.raises(error, match=words):
        cute_kda.fused_recurrent_gated_delta_rule(**kwargs)
    with pytest.raises(error, match=words):
        serving.gated_delta_rule_call(**kwargs)
    assert _gdn_steady_launch(_gdn_decode_call())  # the plans are kept


def test_gdn_debug_switch_and_a_new_layout_take_the_full_checks(cpu_as_device_0, monkeypatch):
    kwargs = _gdn_decode_call(beta=None)
    cute_kda.fused_recurrent_gated_delta_rule(**kwargs)
    assert _gdn_steady_launch(kwargs)
    assert not _gdn_steady_launch({**kwargs, "v": torch.zeros(3, 1, 8, D, dtype=BF16)[:, :, ::2]})
    monkeypatch.setenv(validation.DEBUG_ENV, "1")
    assert not _gdn_steady_launch(kwargs)
    with pytest.raises(ValueError, match="repeats"):
        cute_kda.fused_recurrent_gated_delta_rule(
            **{**kwargs, "ssm_state_indices": torch.tensor([4, 1, 4], dtype=torch.int32)})
    monkeypatch.delenv(validation.DEBUG_ENV)
    assert _gdn_steady_launch(kwargs)


def test_ones_betas_are_views_of_one_growing_buffer(monkeypatch):
    """The betas of calls without them: ones of each call's shape, one buffer per device (not one per shape: packed
    prompts of many lengths would pile them up); a view handed out before the buffer grows stays ones."""
    monkeypatch.setattr(serving, "_ONES", {})
    small = serving.ones_betas((2, 3, 4), torch.device("cpu"))
    assert small.shape == (2, 3, 4) and small.dtype == BF16 and bool((small == 1).all())
    same_size = serving.ones_betas((1, 6, 4), torch.device("cpu"))
    assert same_size.data_ptr() == small.data_ptr() and same_size.shape == (1, 6, 4)
    large = serving.ones_betas((1, 50, 4), torch.device("cpu"))
    assert large.shape == (1, 50, 4) and bool((large == 1).all()) and bool((small == 1).all())
    assert serving.ones_betas((1, 7, 4), torch.device("cpu")).data_ptr() == large.data_ptr()
    assert len(serving._ONES) == 1


@pytest.mark.parametrize("entry", ["kda", "gdn"])
def test_steady_calls_allocate_nothing(cpu_as_device_0, entry):
    """The CPU allocator's record (torch's profiler) over steady decode and verify calls, beta None for
    GatedDeltaNet: nothing allocated (FLA's GatedDeltaNet makes a ones beta per call)."""
    from torch.profiler import ProfilerActivity, profile

    if entry == "kda":
        fn, calls = cute_kda.fused_recurrent_kda, (_decode_call(out=torch.empty(3, 1, 4, D, dtype=BF16)),
                                                   _verify_call(out=torch.empty(3, 2, 4, D, dtype=BF16)))
    else:
        fn, calls = cute_kda.fused_recurrent_gated_delta_rule, (_gdn_decode_call(beta=None),
                                                                _gdn_verify_call(beta=None))
    for kwargs in calls:
        fn(**kwargs)  # the full checks, the plans kept
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        for _ in range(3):
            for kwargs in calls:
                fn(**kwargs)
    allocations = [(event.name, event.cpu_memory_usage) for event in profiler.events() if event.cpu_memory_usage > 0]
    assert allocations == []
    assert len(cpu_as_device_0) == 8


# ============================================================================ the launch (CPU)


def test_cpu_tensors_raise_before_any_launch():
    with pytest.raises(ValueError, match="CUDA"):
        serving.fused_recurrent_kda(**_decode_call())


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_launch_passes_the_decode_launchers_arguments(monkeypatch, packed):
    """What reaches ``cute_kda.ops.decode.decode``: the tensors as given (dt_bias viewed ``[HV, K]``), the pool, the
    slot ids, the counts, the options; ``cu_seqlens`` only for a packed call (the fixed-length launcher has none)."""
    from cute_kda.ops import decode as ops

    calls = []
    monkeypatch.setattr(ops, "decode", lambda *a, **k: calls.append((a, k)) or "o")
    monkeypatch.setattr(validation, "check_on_cuda", lambda name, t: None)
    changes = dict(**make_tokens(1, 3, 2, 4), cu_seqlens=torch.tensor([0, 1, 2, 3], dtype=torch.int32)) if packed \
        else {}
    kwargs = _verify_call(lower_bound=None, dt_bias=torch.zeros(4 * D), scale=0.5, **changes)
    o, ht = serving.fused_recurrent_kda(**kwargs)
    (args, options), = calls
    assert o == "o" and ht is kwargs["initial_state"]
    q, k, v, g, beta, A_log, dt_bias, pool, ids, counts = args
    assert q is kwargs["q"] and beta is kwargs["beta"] and A_log is kwargs["A_log"] and pool is kwargs["initial_state"]
    assert dt_bias.shape == (4, D) and dt_bias.data_ptr() == kwargs["dt_bias"].data_ptr()
    assert ids is kwargs["ssm_state_indices"] and counts is kwargs["num_accepted_tokens"]
    expected = dict(out=None, gate="softplus", scale=0.5, lower_bound=-5.0, qk_l2norm=True, beta_logits=True,
                    state_layout="vk")
    if packed:
        expected["cu_seqlens"] = kwargs["cu_seqlens"]
    assert options == expected


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "full_checks"])
def test_parameters_that_require_grad_reach_the_kernel_detached(cpu_as_device_0, monkeypatch, fast):
    A_log, dt_bias = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4 * D))
    kwargs = _decode_call(A_log=A_log, dt_bias=dt_bias, out=torch.empty(3, 1, 4, D, dtype=BF16))
    if fast:
        serving.kda_call(**kwargs)  # the full checks; the plan kept
    call = serving.kda_call(**kwargs) if fast else _full_checks(monkeypatch, kwargs)
    assert not call.A_log.requires_grad and not call.dt_bias.requires_grad
    assert call.A_log.data_ptr() == A_log.data_ptr() and call.dt_bias.data_ptr() == dt_bias.data_ptr()


def test_deprecated_transpose_state_layout_is_state_v_first(on_reference):
    x = make_tokens(2, 1, 2, 2)
    h0 = make_pool(2, 2)
    expected = serving.fused_recurrent_kda(**x, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        got = serving.fused_recurrent_kda(**x, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(ValueError, match="transpose_state_layout"):
        serving.fused_recurrent_kda(**x, state_v_first=True, transpose_state_layout=True)
