"""Head dims other than K = V = 128 (:mod:`cute_kda.call`): zero-padded to 128, or V split into value heads of
128, on the 128 kernels — exactly, never a wrong answer.

CPU tier: calls at FLA's head dims (K = V = 32, 60, 64, 100; K = 128, V = 256 with and without grouped value heads;
K ≠ V) through :func:`cute_kda.call.resolve` on the reference stages (the kernels' mirrors:
``training.kda_forward(..., backend=REFERENCE)``), for every gate form, packed sequences, initial states and segments,
against the fp64 gold recurrence at the caller's dims: o, the final state and every gradient (dq dk dv dg dβ dA_log
ddt_bias dh0), in the caller's shapes and dtypes. The exactness argument itself on the mirror (the padded rows and
columns of the state and of o stay exactly zero, the padded channels get exactly zero gate gradients); the default
scale is the caller's K ** -0.5; FLA's drop-ins and their verifier; the traced path (one op each way); the chunk states'
mapping; refusals naming the size (K = 192, 256; V = 192; state pools). The public inference path with its executor
replaced by the fp64 gold (``gold_kernels``): caller buffers, one traced op under torch.compile, FLA's backend at 64.

GPU tier: the public API on the kernels against the gold (FLA's tolerances: o, final state 5e-3; dq dk dv dh0 8e-3; dg
dβ 2e-2), inference with caller buffers, FLA's drop-ins, ``return_intermediate_states``, a compiled training step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

import cute_kda
from cute_kda import api, call as call_module, fla_backend
from cute_kda.call import (CallerDims, HeadDims, chunk_states_to_caller_dims, head_dims_of, resolve,
                           state_to_caller_dims, to_kernel_dims)
from cute_kda.executors import training
from cute_kda.fla_calls import translate_fla_call, translate_fla_gdn_call
from cute_kda.reference import gold_backward, gold_forward, rel_rms
from cute_kda.reference.backend import REFERENCE

from gradient_targets import SAFE_GATE_TOLERANCES, TARGETS
from test_torch_compile import gold_kernels  # noqa: F401 (a fixture: the inference executor by the fp64 gold)

pytestmark = pytest.mark.filterwarnings("ignore:cute_kda mirror on CPU:RuntimeWarning")

REFERENCE_FORWARD = functools.partial(training.kda_forward, backend=REFERENCE)
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
GRAD = dict(zip(NAMES, ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")))
FORWARD_TOLERANCE = 5e-3  # FLA's for o and the final state


@dataclass(frozen=True)
class Case:
    """One call: head dims, gate form (``per_head``: GatedDeltaNet's one decay per value head), heads, sequence
    lengths (packed when they differ), the initial state's dtype (None: none), and kda_forward's options."""

    key_dim: int
    value_dim: int
    gate: str = "safe"
    per_head: bool = False
    heads: int = 2
    value_heads: int = 2
    lengths: tuple[int, ...] = (37, 37)
    state: torch.dtype | None = torch.float32
    options: tuple[tuple[str, object], ...] = ()


CASES = {
    "K32_safe_fp32_state": Case(32, 32),
    "K60_softplus_varlen_bf16_state": Case(60, 60, "softplus", lengths=(20, 0, 17, 5), state=torch.bfloat16),
    "K64_log_decay_no_state": Case(64, 64, "none", state=None),
    "K64_safe_varlen_bf16_state": Case(64, 64, lengths=(20, 0, 1, 47), state=torch.bfloat16),
    "K100_safe_no_l2norm_beta_activated": Case(100, 100, options=(("qk_l2norm", False), ("beta_logits", False),
                                                                  ("scale", 0.3), ("lower_bound", -2.0))),
    "K64_gdn_softplus_gva": Case(64, 64, "softplus", per_head=True, heads=1, value_heads=2),
    "K64_softplus_segments": Case(64, 64, "softplus", lengths=(64,), options=(("segments", 3),)),
    "K128_V256_safe": Case(128, 256),
    "K128_V256_softplus_gva_varlen": Case(128, 256, "softplus", heads=1, value_heads=2, lengths=(21, 30)),
    "K128_V256_gdn_log_decay_gva": Case(128, 256, "none", per_head=True, heads=2, value_heads=4, lengths=(33,)),
    "K64_V256_gdn_softplus": Case(64, 256, "softplus", per_head=True, lengths=(29,)),
    "K128_V64_log_decay": Case(128, 64, "none", lengths=(30,)),
    "K64_V128_softplus_bf16_state": Case(64, 128, "softplus", lengths=(30,), state=torch.bfloat16),
}


def make_problem(case: Case, *, seed: int = 0, device: str | torch.device = "cpu", scale_lengths: int = 1):
    """(inputs keyed by kda_forward's names, ``do``, ``dht``): bf16 activations, raw gates drawn to saturate both
    ways, a log decay in [-2, 0] (fp32), the v-first initial state. ``scale_lengths`` multiplies the lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [n * scale_lengths for n in case.lengths]
    packed = len(set(lengths)) > 1
    batch, seq_len = (1, sum(lengths)) if packed else (len(lengths), lengths[0])
    h, hv, kd, vd = case.heads, case.value_heads, case.key_dim, case.value_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    g_shape = (batch, seq_len, hv) if case.per_head else (batch, seq_len, hv, kd)
    options = dict(case.options)
    q, k = randn(batch, seq_len, h, kd), randn(batch, seq_len, h, kd)
    if options.get("qk_l2norm") is False:  # the delta rule is stable for |k| <= 1 only
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    p = dict(q=q.bfloat16(), k=k.bfloat16(), v=randn(batch, seq_len, hv, vd).bfloat16(),
             beta=(2 * randn(batch, seq_len, hv)).bfloat16())
    if options.get("beta_logits") is False:
        p["beta"] = torch.rand(batch, seq_len, hv, generator=gen).bfloat16()
    if case.gate == "safe":  # saturating both ways, as tests/test_autograd.py draws it
        p.update(g=(torch.rand(g_shape, generator=gen) * 16 - 8).bfloat16(), A_log=torch.rand(hv, generator=gen) - 0.5,
                 dt_bias=randn(hv, kd))
    elif case.gate == "softplus":  # Kimi-Linear's initialisation, as tests/test_reference_gates.py draws it
        p.update(g=randn(*g_shape).bfloat16(), A_log=torch.log(torch.rand(hv, generator=gen) * 15 + 1),
                 dt_bias=randn(hv) if case.per_head else randn(hv, kd))
    else:  # a log decay (fp32), one entry in ten masked
        decay = torch.nn.functional.logsigmoid(randn(*g_shape) + 2.0)
        p["g"] = torch.where(torch.rand(g_shape, generator=gen) < 0.1, -1000.0, decay)
    if case.state is not None:
        p["initial_state"] = (0.5 * randn(len(lengths), hv, vd, kd)).to(case.state)
    if packed:
        p["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    do = randn(batch, seq_len, hv, vd).bfloat16()
    dht = randn(len(lengths), hv, vd, kd)
    return {n: x.to(device) for n, x in p.items()}, do.to(device), dht.to(device)


def train(forward, problem, do, dht, **options):
    """(o, final state, {input name: gradient}) of one step of ``Σ o·do + Σ ht·dht``, every float input a leaf."""
    leaves = {n: x.detach().clone().requires_grad_() if x.is_floating_point() else x for n, x in problem.items()}
    q, k, v, g, beta = (leaves[n] for n in NAMES[:5])
    rest = {n: x for n, x in leaves.items() if n not in NAMES[:5]}
    o, ht = forward(q, k, v, g, beta, output_final_state=True, **rest, **options)
    torch.autograd.backward([o, ht], [do, dht])
    return o, ht, {n: leaves[n].grad for n in NAMES if n in leaves}


def gold_options(options: dict) -> dict:
    """The call's options the gold takes: ``segments`` splits the work, not the math."""
    return {n: x for n, x in options.items() if n != "segments"}


def gold(problem, do, dht, **options):
    """(o, final state, gradients) of the fp64 token recurrence at the caller's dims."""
    p = {n: x.cpu() for n, x in problem.items()}
    tensors = [p.pop(n) for n in NAMES[:5]]
    options = gold_options(options)
    o, ht = gold_forward(*tensors, output_final_state=True, **p, **options)
    grads = gold_backward(*tensors, do.cpu(), dht=dht.cpu(), **p, **options)
    return o, ht, {n: grads[GRAD[n]] for n in NAMES if n in problem}


# dA_log and ddt_bias are sums over the tokens (and, per head, the channels) that cancel: held to dg's bound, as the
# safe gate's dA_log is (tests/gradient_targets.py; docs/numerics.md, "The rounded backward")
SUM_TOLERANCES = {**TARGETS, "dA_log": TARGETS["dg"], "ddt_bias": TARGETS["dg"]}


def assert_matches_gold(case: Case, result, expected, label: str) -> None:
    (o, ht, grads), (o_gold, ht_gold, grads_gold) = result, expected
    tolerances = SAFE_GATE_TOLERANCES if case.gate == "safe" else SUM_TOLERANCES
    errors = {"o": rel_rms(o.cpu(), o_gold), "ht": rel_rms(ht.cpu(), ht_gold)}
    errors.update({GRAD[n]: rel_rms(grads[n].cpu(), grads_gold[n]) for n in grads})
    line = f"[head dims] {label}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
    print(line)
    assert o.shape == o_gold.shape and ht.shape == ht_gold.shape, line
    for name, error in errors.items():
        assert error <= (FORWARD_TOLERANCE if name in ("o", "ht") else tolerances[name]), line


# ============================================================================ CPU tier


@pytest.fixture
def native_training(monkeypatch):
    """Training at K = V = 64 on the backward kernels built for 64 (:data:`cute_kda.call.NATIVE_TRAINING`, the
    default), pinned so the 64 cases check that routing whatever the switch; the others are unaffected."""
    monkeypatch.setattr(call_module, "NATIVE_TRAINING", True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_stages_match_gold(native_training, name):
    """The call at the caller's head dims through resolve (padded / split, or at 64 natively) on the mirrors, against
    the gold at the caller's dims; every gradient in its input's shape and dtype."""
    case = CASES[name]
    problem, do, dht = make_problem(case)
    options = dict(case.options, gate=case.gate)
    result = train(REFERENCE_FORWARD, problem, do, dht, **options)
    for n, grad in result[2].items():
        assert grad.shape == problem[n].shape and grad.dtype == problem[n].dtype, n
    assert result[0].dtype == torch.bfloat16 and result[1].dtype == (case.state or torch.float32)
    assert_matches_gold(case, result, gold(problem, do, dht, **options), name)


@pytest.mark.parametrize("gate, per_head", [("safe", False), ("softplus", False), ("none", False), ("softplus", True),
                                            ("none", True)])
def test_padded_rows_and_columns_stay_exactly_zero(gate, per_head):
    """The exactness argument (docs/numerics.md, "Other head dims") on the kernels' mirrors: the 128 call on the
    padded inputs keeps the padded state rows (K) and columns (V) and the padded columns of o exactly zero, and
    gives the padded gate channels exactly zero gradients (so they add nothing to dA_log either), q's padded
    channels exactly zero, and the padded state entries of dh0 exactly zero."""
    case = Case(60, 60, gate, per_head=per_head)
    problem, do, dht = make_problem(case, seed=5)
    dims = head_dims_of(problem["q"], problem["v"])
    padded = to_kernel_dims(dims, *(problem.get(n) for n in NAMES), repeat_qk=False)
    padded = dict(zip(NAMES, padded))
    padded = {n: x for n, x in padded.items() if x is not None}
    pad = torch.nn.functional.pad
    o, ht, grads = train(REFERENCE_FORWARD, padded, pad(do, (0, 68)), pad(dht, (0, 68, 0, 68)),
                         scale=60 ** -0.5, gate=gate)
    assert not o[..., 60:].any() and not ht[..., 60:, :].any() and not ht[..., :, 60:].any()
    assert not grads["q"][..., 60:].any() and not grads["v"][..., 60:].any()
    assert not grads["initial_state"][..., 60:, :].any() and not grads["initial_state"][..., :, 60:].any()
    if not per_head:
        assert not grads["g"][..., 60:].any()
        if gate != "none":
            assert not grads["dt_bias"][..., 60:].any()
    assert all(torch.isfinite(grad).all() for grad in grads.values())


def test_default_scale_is_the_callers_key_dim():
    """scale=None is K ** -0.5 of the caller's K (bit for bit the call that passes it), not 128 ** -0.5."""
    case = Case(64, 64, lengths=(20,))
    problem, do, dht = make_problem(case, seed=2)

    def o_of(**options):
        return train(REFERENCE_FORWARD, problem, do, dht, **options)[0]

    default = o_of()
    assert torch.equal(default, o_of(scale=64 ** -0.5))
    assert not torch.equal(default, o_of(scale=128 ** -0.5))


def test_split_value_heads_keep_the_grouped_value_head_mapping():
    """V = 256 with HV = 2H: split head ``j · 2 + r`` holds columns ``[128 r, 128 r + 128)`` of value head j and reads
    q/k head ``j // 2``; ``A_log``, ``dt_bias``, g and β repeat per split head."""
    case = Case(128, 256, "softplus", heads=2, value_heads=4, lengths=(5,))
    problem, _, _ = make_problem(case)
    dims = head_dims_of(problem["q"], problem["v"])
    assert dims == HeadDims(128, 256, 2) and dims.padded_value_dim == 256
    q, k, v, g, beta, A_log, dt_bias, h0 = to_kernel_dims(dims, *(problem[n] for n in NAMES),
                                                                   repeat_qk=False)
    assert q is problem["q"] and v.shape == (1, 5, 8, 128) and h0.shape == (1, 8, 128, 128)
    # a split alone copies nothing of v and the state (views of the caller's tensors)
    assert v.data_ptr() == problem["v"].data_ptr() and h0.data_ptr() == problem["initial_state"].data_ptr()
    for split in range(8):
        head, r = divmod(split, 2)
        assert torch.equal(v[:, :, split], problem["v"][:, :, head, 128 * r:128 * (r + 1)])
        assert torch.equal(h0[:, split], problem["initial_state"][:, head, 128 * r:128 * (r + 1)])
        assert torch.equal(g[:, :, split], problem["g"][:, :, head]) and torch.equal(beta[..., split],
                                                                                   problem["beta"][..., head])
        assert A_log[split] == problem["A_log"][head] and torch.equal(dt_bias[split], problem["dt_bias"][head])
        assert split // (8 // 2) == head // (4 // 2)  # the kernels' q/k head of the split head is the caller's
    assert torch.equal(state_to_caller_dims(dims, h0), problem["initial_state"])


def test_chunk_states_map_as_the_final_state_does():
    """FLA's chunk states (K-first) go back to the caller's dims as the v-first final state does."""
    dims = HeadDims(60, 200, 2)
    states = torch.randn(3, 6, 128, 128)  # v-first [N, HV·s, 128, 128]
    expected = state_to_caller_dims(dims, states).transpose(-1, -2)  # [N, HV, K, V]
    h = chunk_states_to_caller_dims(dims, states.transpose(-1, -2)[None])
    assert h.shape == (1, 3, 3, 60, 200) and torch.equal(h[0], expected)


def test_caller_buffers_are_filled_and_returned():
    """out= and final_state= at the caller's dims get the restored results (the 128 call wrote its own)."""
    dims = HeadDims(64, 64, 1)
    o, state = torch.randn(1, 4, 2, 128), torch.randn(1, 2, 128, 128)
    out, final = torch.full((1, 4, 2, 64), float("nan")), torch.full((1, 2, 64, 64), float("nan"), dtype=torch.bfloat16)
    restored_o, restored_state = CallerDims(dims, out, final).restore(o, state)
    assert restored_o is out and restored_state is final
    assert torch.equal(out, o[..., :64]) and torch.equal(final, state[..., :64, :64].bfloat16())


@pytest.mark.parametrize("key_dim, value_dim, word", [
    (256, 256, "K (q.shape[-1]) = 256"), (192, 192, "K (q.shape[-1]) = 192"), (128, 192, "V (v.shape[-1]) = 192"),
    (256, 128, "K (q.shape[-1]) = 256")])
def test_sizes_that_cannot_be_padded_are_refused_by_name(key_dim, value_dim, word):
    problem, _, _ = make_problem(Case(key_dim, value_dim, lengths=(3,)))
    tensors = [problem.pop(n) for n in NAMES[:5]]
    for forward in (cute_kda.kda_forward, REFERENCE_FORWARD):
        with pytest.raises(NotImplementedError) as info:
            forward(*tensors, **problem)
        assert word in str(info.value), str(info.value)


def test_errors_name_the_argument_at_the_callers_dims():
    problem, _, _ = make_problem(Case(64, 64, lengths=(3,)))
    tensors = [problem.pop(n) for n in NAMES[:5]]
    cases = {"initial_state": torch.zeros(1, 2, 64, 60), "dt_bias": torch.zeros(2, 128)}
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=fr"{name} must have shape .*\[1, 2, 64, 64\]|{name} must have shape"):
            cute_kda.kda_forward(*tensors, **{**problem, name: bad})
    with pytest.raises(ValueError, match=r"out must have shape .*\[1, 3, 2, 64\]"):
        cute_kda.kda_forward(*tensors, **problem, out=torch.zeros(1, 3, 2, 128, dtype=torch.bfloat16))


def test_state_pools_at_other_head_dims_are_refused_by_name():
    """A prefill on a state pool is the engine's layout: no padding copies there."""
    problem, _, _ = make_problem(Case(64, 64, lengths=(3,), state=None))
    tensors = [problem.pop(n) for n in NAMES[:5]]
    pool = torch.zeros(4, 2, 64, 64)
    with pytest.raises(NotImplementedError, match="state_indices"):
        cute_kda.kda_forward(*tensors, **problem, initial_state=pool,
                             state_indices=torch.zeros(1, dtype=torch.int32))


def test_chunk_kda_at_head_dim_64_matches_gold():
    """FLA's keywords (K-first fp32 state, dt_bias [H*K], the softplus gate, packed sequences) at K = V = 64 through
    chunk_kda's translation and the padded call, against the gold in FLA's layout."""
    case = Case(64, 64, "softplus", lengths=(20, 0, 17))
    problem, do, dht = make_problem(case, seed=7)
    fla = dict(problem, initial_state=problem["initial_state"].transpose(-1, -2).contiguous(),
               dt_bias=problem["dt_bias"].flatten())
    leaves = {n: x.clone().requires_grad_() if x.is_floating_point() else x for n, x in fla.items()}
    o, ht = translate_fla_call(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True).run(REFERENCE_FORWARD)
    dht_kv = dht.transpose(-1, -2)
    torch.autograd.backward([o, ht], [do, dht_kv])
    p = {n: x for n, x in fla.items()}
    tensors = [p.pop(n) for n in NAMES[:5]]
    o_gold, ht_gold = gold_forward(*tensors, output_final_state=True, gate="softplus", state_layout="kv", **p)
    grads = gold_backward(*tensors, do, dht=dht_kv, gate="softplus", state_layout="kv", **p)
    assert ht.shape == (3, 2, 64, 64) and leaves["dt_bias"].grad.shape == (128,)
    assert rel_rms(o, o_gold) <= FORWARD_TOLERANCE and rel_rms(ht, ht_gold) <= FORWARD_TOLERANCE
    for n in NAMES:
        assert rel_rms(leaves[n].grad, grads[GRAD[n]]) <= SUM_TOLERANCES[GRAD[n]], n


def test_chunk_gated_delta_rule_expand_v_matches_gold():
    """GatedDeltaNet's expand_v = 2 (K = 128, V = 256) with grouped value heads, the softplus gate in the kernel and
    FLA's K-first state, through the translation and the split call."""
    case = Case(128, 256, "softplus", per_head=True, heads=1, value_heads=2, lengths=(25,))
    problem, do, dht = make_problem(case, seed=8)
    fla = dict(problem, initial_state=problem["initial_state"].transpose(-1, -2).contiguous())
    leaves = {n: x.clone().requires_grad_() if x.is_floating_point() else x for n, x in fla.items()}
    o, ht = translate_fla_gdn_call(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True).run(REFERENCE_FORWARD)
    dht_kv = dht.transpose(-1, -2)
    torch.autograd.backward([o, ht], [do, dht_kv])
    p = dict(fla)
    tensors = [p.pop(n) for n in NAMES[:5]]
    o_gold, ht_gold = gold_forward(*tensors, output_final_state=True, gate="softplus", state_layout="kv", **p)
    grads = gold_backward(*tensors, do, dht=dht_kv, gate="softplus", state_layout="kv", **p)
    assert o.shape == (1, 25, 2, 256) and ht.shape == (1, 2, 128, 256)
    assert rel_rms(o, o_gold) <= FORWARD_TOLERANCE and rel_rms(ht, ht_gold) <= FORWARD_TOLERANCE
    for n in NAMES:
        assert rel_rms(leaves[n].grad, grads[GRAD[n]]) <= SUM_TOLERANCES[GRAD[n]], n


@pytest.fixture
def any_device(monkeypatch):
    """Let the FLA verifiers take CPU tensors (their device rule is tested in test_fla_backend.py)."""
    monkeypatch.setattr(fla_backend, "_device_reason", lambda q: None)


def test_fla_verifiers_take_what_pads_and_refuse_the_rest(any_device):
    for dim, accepted in ((64, True), (100, True), (256, False)):
        problem, _, _ = make_problem(Case(dim, dim, "softplus", lengths=(3,), state=None))
        problem["dt_bias"] = problem["dt_bias"].flatten()
        verdict, reason = fla_backend.verify(**problem, use_gate_in_kernel=True)
        assert verdict == accepted and (accepted or f"K (q.shape[-1]) = {dim}" in reason), reason
    gdn, _, _ = make_problem(Case(128, 256, "none", per_head=True, heads=1, value_heads=2, lengths=(3,)))
    gdn["initial_state"] = gdn["initial_state"].transpose(-1, -2).contiguous()
    assert fla_backend.verify_gdn(**gdn) == (True, None)


@pytest.fixture
def reference_ops(monkeypatch):
    """The training ops on the reference stages (the kernels need a GPU)."""
    monkeypatch.setattr(training, "_stages", lambda: REFERENCE)


@pytest.mark.parametrize("name", ["K64_gdn_softplus_gva", "K128_V256_safe"])
def test_compiled_training_step_is_the_eager_one(reference_ops, name):
    """Under torch.compile the padding and the restore are traced around the 128 call's ops: one training op and one
    backward op, the gradients the eager call's bit for bit."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    case = CASES[name]
    problem, do, dht = make_problem(case, seed=9)
    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def step(forward):
        def run(q, k, v, g, beta, A_log, dt_bias, initial_state):
            o, ht = forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                            output_final_state=True, gate=case.gate)
            return (o.float() * do.float()).sum() + (ht * dht).sum()
        return run

    def grads(fn):
        leaves = [problem[n].detach().clone().requires_grad_() for n in NAMES]
        fn(*leaves).backward()
        return [leaf.grad for leaf in leaves]

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    eager = grads(step(REFERENCE_FORWARD))
    compiled = grads(torch.compile(step(cute_kda.kda_forward), fullgraph=True, backend=backend))
    for name_, a, b in zip(NAMES, eager, compiled):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), name_

    def count(kind, target):
        return sum(str(node.target) == target for gm in graphs[kind] for node in gm.graph.nodes)

    assert count("forward", "cute_kda.forward_train.default") == 1
    assert count("backward", "cute_kda.backward.default") == 1


INFERENCE_API_CASES = {
    "K60_softplus_varlen_bf16_state": Case(60, 60, "softplus", lengths=(20, 0, 17, 5), state=torch.bfloat16),
    "K128_V256_gdn_log_decay_gva": Case(128, 256, "none", per_head=True, heads=2, value_heads=4, lengths=(33,)),
    "K64_V256_safe_gva": Case(64, 256, heads=1, value_heads=2, lengths=(30,)),
}


def _gold_at_caller_dims(case, tensors, problem, **options):
    p = {n: x for n, x in problem.items()}
    o, state = gold_forward(*tensors, output_final_state=True, gate=case.gate, **p, **options)
    return o, state


@pytest.mark.parametrize("case", [Case(64, 64), Case(64, 64, "softplus", per_head=True, heads=1, value_heads=2,
                                                lengths=(20, 0, 1, 17), state=torch.bfloat16),
                                   Case(64, 64, "none", lengths=(33,), state=None)], ids=lambda c: f"{c.gate}")
def test_inference_at_64_runs_unpadded(gold_kernels, monkeypatch, case):
    """An inference call at K = V = 64 resolves as itself (no caller dims to restore) and the executor runs the 64
    problem, into the caller's buffers; under autograd too where :data:`cute_kda.call.NATIVE_TRAINING` says so; at any
    other small size the call runs padded to 128."""
    problem, _, _ = make_problem(case, seed=21)
    tensors = [problem.pop(n) for n in NAMES[:5]]
    with torch.no_grad():
        call = resolve(*tensors, **problem, gate=case.gate, output_final_state=True)
        out = torch.full(tensors[2].shape, 7.0, dtype=torch.bfloat16)
        o, ht = cute_kda.kda_forward(*tensors, **problem, gate=case.gate, out=out, output_final_state=True)
    assert call.caller_dims is None and call.options.problem.head_dim == 64 and not call.training
    assert [p.head_dim for p in gold_kernels] == [64] and o is out
    o_gold, ht_gold = _gold_at_caller_dims(case, tensors, problem)
    assert rel_rms(o, o_gold.bfloat16()) <= 1e-4 and rel_rms(ht, ht_gold) <= (4e-3 if case.state else 1e-6)
    leaves = [x.detach().requires_grad_() if n in ("q", "v") else x for n, x in zip(NAMES, tensors)]
    for native in (False, True):  # training at 64 pads where NATIVE_TRAINING is off
        monkeypatch.setattr(call_module, "NATIVE_TRAINING", native)
        trained = resolve(*leaves, **problem, gate=case.gate)
        assert trained.training and (trained.caller_dims is None) == native
        assert trained.options.problem.head_dim == (64 if native else 128)
    for key_dim, value_dim in ((60, 60), (64, 128), (128, 64)):
        other, _, _ = make_problem(Case(key_dim, value_dim, lengths=(5,)), seed=22)
        with torch.no_grad():
            padded = resolve(*[other.pop(n) for n in NAMES[:5]], **other)
        assert padded.caller_dims is not None and padded.options.problem.head_dim == 128


def test_segmented_inference_at_64_runs_unpadded(monkeypatch):
    """Context parallelism at K = V = 64 without autograd: the segments run the forward stage at 64 (here the
    mirrors' stages in place of the kernels'), and o and the final state meet the gold."""
    from cute_kda.executors import inference

    monkeypatch.setattr(inference, "KERNELS", REFERENCE)
    case = CASES["K64_softplus_segments"]
    problem, _, _ = make_problem(case, seed=23)
    tensors = [problem.pop(n) for n in NAMES[:5]]
    options = dict(case.options, gate=case.gate)
    with torch.no_grad():
        call = resolve(*tensors, **problem, **options, output_final_state=True)
        o, ht = cute_kda.kda_forward(*tensors, **problem, **options, output_final_state=True)
    assert call.caller_dims is None and call.options.segmentation is not None
    assert call.options.problem.head_dim == 64 and o.shape == tensors[2].shape and ht.shape == (1, 2, 64, 64)
    o_gold, ht_gold = gold_forward(*tensors, output_final_state=True, gate=case.gate, **problem)
    assert rel_rms(o, o_gold) <= FORWARD_TOLERANCE and rel_rms(ht, ht_gold) <= FORWARD_TOLERANCE


def test_warmup_lists_the_native_head_dim_64_variants():
    """``warmup_variants(head_dims=(64,))``: every kernel at 64 for every listed option, training (K2's checkpoints,
    Kernel A, Kernel B at 4 warps) and segments too, the 64 twins of the 128 list; other sizes are refused by name."""
    from dataclasses import replace

    from cute_kda.variants import GradsVariant

    both = api.warmup_variants(head_dims=(128, 64), training=True)
    at_128 = api.warmup_variants(training=True)
    assert [v for v in both if v.dim == 128] == at_128

    def twin(v):
        return replace(v, dim=64, **({"compute_warps": 4} if isinstance(v, GradsVariant) else {}))

    assert [v for v in both if v.dim == 64] == [twin(v) for v in at_128]
    with pytest.raises(ValueError, match="head_dims"):
        api.warmup_variants(head_dims=(96,))


@pytest.mark.parametrize("name", sorted(INFERENCE_API_CASES))
def test_public_inference_restores_into_caller_buffers(gold_kernels, name):
    """The public kda_forward, eager, inference: resolve pads / splits, the inference executor (here the fp64 gold on
    the 128 call: tests/test_torch_compile.py's ``gold_kernels``) runs the 128 call, and the results come back at the
    caller's dims, into out= and final_state= when given; the executor saw the 128 problem."""
    case = INFERENCE_API_CASES[name]
    problem, _, _ = make_problem(case, seed=18)
    tensors = [problem.pop(n) for n in NAMES[:5]]
    num_seqs = problem["cu_seqlens"].numel() - 1 if "cu_seqlens" in problem else tensors[0].shape[0]
    out = torch.full(tensors[2].shape, 7.0, dtype=torch.bfloat16)
    final = torch.full((num_seqs, case.value_heads, case.value_dim, case.key_dim), 7.0,
                       dtype=case.state or torch.float32)  # the dtype the call without a buffer returns
    with torch.no_grad():
        o, ht = cute_kda.kda_forward(*tensors, **problem, gate=case.gate, out=out, final_state=final)
        o_plain, ht_plain = cute_kda.kda_forward(*tensors, **problem, gate=case.gate, output_final_state=True)
    assert o is out and ht is final and o_plain.shape == out.shape and ht_plain.shape == final.shape
    assert ht_plain.dtype == (case.state or torch.float32) and o_plain.is_contiguous() and ht_plain.is_contiguous()
    assert all(problem.head_dim == 128 and problem.heads == case.value_heads * -(-case.value_dim // 128)
               for problem in gold_kernels)
    o_gold, ht_gold = _gold_at_caller_dims(case, tensors, problem)
    # the gold in fp64 on the padded call, o rounded to bf16: the caller's gold up to fp64 rounding (a bf16 tie flips)
    state_bound = 1e-6 if final.dtype == torch.float32 else 4e-3  # a bf16 state: its rounding
    assert rel_rms(out, o_gold.bfloat16()) <= 1e-4 and rel_rms(final, ht_gold) <= state_bound
    assert torch.equal(out, o_plain) and torch.equal(final, ht_plain)


def test_compiled_inference_is_one_op_at_the_callers_dims(gold_kernels):
    """Under torch.compile the padding and the restore are traced around one inference op, results as eager."""
    case = INFERENCE_API_CASES["K64_V256_safe_gva"]
    problem, _, _ = make_problem(case, seed=19)
    tensors = [problem.pop(n) for n in NAMES[:5]]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def forward(q, k, v, g, beta):
        return cute_kda.kda_forward(q, k, v, g, beta, **problem, output_final_state=True)

    with torch.no_grad():
        eager = forward(*tensors)
        compiled = torch.compile(forward, fullgraph=True, backend=backend)(*tensors)
    assert sum(str(node.target) == "cute_kda.forward.default" for gm in graphs for node in gm.graph.nodes) == 1
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert compiled[0].shape == (1, 30, 2, 256) and compiled[1].shape == (1, 2, 256, 64)


def test_fla_backend_computes_head_dim_64(any_device, gold_kernels):
    """FLA's chunk_kda dispatch at K = V = 64: the verifier takes it, the implementation runs the call (on the kernels
    compiled for 64) and hands FLA's layout back (K-first state, o at 64 columns)."""
    case = Case(64, 64, "softplus", lengths=(20, 0, 17))
    problem, _, _ = make_problem(case, seed=20)
    kwargs = dict(problem, initial_state=problem["initial_state"].transpose(-1, -2).contiguous(),
                  dt_bias=problem["dt_bias"].flatten(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    with torch.no_grad():
        assert fla_backend.verify(**kwargs) == (True, None)
        o, ht = fla_backend.chunk_kda(**kwargs)
    tensors = [problem.pop(n) for n in NAMES[:5]]
    o_gold, ht_gold = _gold_at_caller_dims(case, tensors, problem)
    assert o.shape == (1, 37, 2, 64) and ht.shape == (3, 2, 64, 64)
    assert rel_rms(o, o_gold.bfloat16()) <= 1e-4 and rel_rms(ht, ht_gold.transpose(-1, -2)) <= 1e-6


# ============================================================================ GPU tier

GPU_CASES = {  # the CPU cases at longer sequences (tails, T < 16 and empty sequences where the case packs)
    name: (case, 4 if name != "K60_softplus_varlen_bf16_state" else 12) for name, case in CASES.items()
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_public_api_matches_gold(native_training, name, device):
    """kda_forward on the kernels, training, at the caller's head dims (at 64 on the backward kernels built for it),
    against the gold."""
    case, factor = GPU_CASES[name]
    problem, do, dht = make_problem(case, seed=11, device=device, scale_lengths=factor)
    options = dict(case.options, gate=case.gate)
    result = train(cute_kda.kda_forward, problem, do, dht, **options)
    torch.cuda.synchronize()
    assert_matches_gold(case, result, gold(problem, do, dht, **options), f"gpu {name}")


INFERENCE_CASES = {  # the safe gate with grouped value heads (split ones too) runs in inference only
    **{name: CASES[name] for name in ("K64_log_decay_no_state", "K128_V256_gdn_log_decay_gva",
                                      "K60_softplus_varlen_bf16_state")},
    "K64_V256_safe_gva": Case(64, 256, heads=1, value_heads=2, lengths=(30,)),
    # K = V = 64 on the kernels compiled for 64: every gate form, GVA, tails, T < 16, empty and 1-token sequences,
    # segments (the context-parallel split of one sequence)
    **{name: CASES[name] for name in ("K64_gdn_softplus_gva", "K64_softplus_segments")},
    "K64_safe_varlen_empty_1_token": Case(64, 64, lengths=(20, 0, 1, 3, 17), state=torch.float32),
    "K64_safe_gva_bf16_state": Case(64, 64, heads=1, value_heads=4, lengths=(37, 37), state=torch.bfloat16),
    "K64_log_decay_fp32_state_short": Case(64, 64, "none", lengths=(5, 9)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(INFERENCE_CASES))
def test_inference_fills_caller_buffers(name, device):
    """Inference at the caller's dims: out= and final_state= buffers get the results the gold gives, nothing else of
    them is touched; the results without buffers are the same bits."""
    case = INFERENCE_CASES[name]
    scale = 1 if name == "K64_safe_varlen_empty_1_token" else 4  # keep its 1-token sequence
    problem, _, _ = make_problem(case, seed=12, device=device, scale_lengths=scale)
    tensors = [problem.pop(n) for n in NAMES[:5]]
    options = dict(case.options, gate=case.gate)
    num_seqs = problem["cu_seqlens"].numel() - 1 if "cu_seqlens" in problem else tensors[0].shape[0]
    out = torch.full(tensors[2].shape, 7.0, dtype=torch.bfloat16, device=device)
    final = torch.full((num_seqs, case.value_heads, case.value_dim, case.key_dim), 7.0, device=device,
                       dtype=case.state or torch.float32)  # the dtype the call without a buffer returns
    with torch.no_grad():
        o, ht = cute_kda.kda_forward(*tensors, **problem, **options, out=out, final_state=final)
        o_plain, ht_plain = cute_kda.kda_forward(*tensors, **problem, **options, output_final_state=True)
    torch.cuda.synchronize()
    assert o is out and ht is final
    assert torch.equal(out, o_plain) and torch.equal(final, ht_plain)
    p = {n: x.cpu() for n, x in problem.items()}
    o_gold, ht_gold = gold_forward(*(t.cpu() for t in tensors), output_final_state=True, **p, **gold_options(options))
    assert rel_rms(out.cpu(), o_gold) <= FORWARD_TOLERANCE and rel_rms(final.cpu(), ht_gold) <= FORWARD_TOLERANCE


@pytest.mark.gpu
def test_fla_drop_ins_on_the_kernels(device):
    """chunk_kda at K = V = 64 and chunk_gated_delta_rule at expand_v = 2, training, against the gold."""
    for case, entry, extra in (
            (Case(64, 64, "softplus", lengths=(300, 0, 57, 1)), cute_kda.chunk_kda, {}),
            (Case(128, 256, "softplus", per_head=True, heads=2, value_heads=4, lengths=(200,)),
             cute_kda.chunk_gated_delta_rule, {})):
        problem, do, dht = make_problem(case, seed=13, device=device)
        fla = dict(problem, initial_state=problem["initial_state"].transpose(-1, -2).contiguous())
        if not case.per_head:
            fla["dt_bias"] = fla["dt_bias"].flatten()
        leaves = {n: x.clone().requires_grad_() if x.is_floating_point() else x for n, x in fla.items()}
        o, ht = entry(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, **extra)
        torch.autograd.backward([o, ht], [do, dht.transpose(-1, -2)])
        torch.cuda.synchronize()
        p = {n: x.cpu() for n, x in fla.items()}
        tensors = [p.pop(n) for n in NAMES[:5]]
        o_gold, ht_gold = gold_forward(*tensors, output_final_state=True, gate="softplus", state_layout="kv", **p)
        grads = gold_backward(*tensors, do.cpu(), dht=dht.transpose(-1, -2).cpu(), gate="softplus",
                              state_layout="kv", **p)
        label = f"{entry.__name__} K{case.key_dim} V{case.value_dim}"
        assert rel_rms(o.cpu(), o_gold) <= FORWARD_TOLERANCE, label
        assert rel_rms(ht.cpu(), ht_gold) <= FORWARD_TOLERANCE, label
        for n in NAMES:
            assert rel_rms(leaves[n].grad.cpu(), grads[GRAD[n]]) <= SUM_TOLERANCES[GRAD[n]], (label, n)


@pytest.mark.gpu
def test_chunk_states_at_head_dim_64(device):
    """return_intermediate_states at K = V = 64, FLA's [B, NT, H, K, V]: the state entering chunk c is, bit for bit,
    the bf16 rounding of the final state of the same call on the first 64·c tokens (as at D = 128,
    tests/test_prefill_pool.py); o and the final state are the plain call's."""
    case = Case(64, 64, "softplus", lengths=(200,), state=None)
    problem, _, _ = make_problem(case, seed=14, device=device)
    problem["dt_bias"] = problem["dt_bias"].flatten()
    flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 output_final_state=True)
    with torch.no_grad():
        o, final, h = cute_kda.chunk_kda(**problem, **flags, return_intermediate_states=True)
        plain_o, plain_final = cute_kda.chunk_kda(**problem, **flags)
        prefixes = [cute_kda.chunk_kda(**{n: x[:, :64 * c] if n in NAMES[:5] else x for n, x in problem.items()},
                                       **flags)[1] for c in range(1, 4)]
    torch.cuda.synchronize()
    assert torch.equal(o, plain_o) and torch.equal(final, plain_final)
    assert h.shape == (1, 4, 2, 64, 64) and h.dtype == torch.bfloat16 and not h[:, 0].any()
    for c, state in enumerate(prefixes, start=1):
        assert torch.equal(h[:, c], state.to(torch.bfloat16)), c


@pytest.mark.gpu
def test_compiled_training_step_matches_eager(device):
    case = CASES["K64_gdn_softplus_gva"]
    problem, do, dht = make_problem(case, seed=15, device=device, scale_lengths=4)

    def step(q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, ht = cute_kda.kda_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                                     output_final_state=True, gate=case.gate)
        return (o.float() * do.float()).sum() + (ht * dht).sum()

    def grads(fn):
        leaves = [problem[n].detach().clone().requires_grad_() for n in NAMES]
        fn(*leaves).backward()
        return [leaf.grad for leaf in leaves]

    eager, compiled = grads(step), grads(torch.compile(step, fullgraph=True))
    torch.cuda.synchronize()
    for name, a, b in zip(NAMES, eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["K64_log_decay_no_state", "K128_V256_gdn_log_decay_gva"])
def test_compiled_inference_fills_caller_buffers(name, device):
    """Inference under torch.compile at the caller's dims (the inference op on the padded / split tensors, the
    restore traced around it): the eager call's bits, into the caller's buffers."""
    case = CASES[name]
    problem, _, _ = make_problem(case, seed=16, device=device, scale_lengths=4)
    tensors = [problem.pop(n) for n in NAMES[:5]]
    num_seqs = tensors[0].shape[0]
    shape = (num_seqs, case.value_heads, case.value_dim, case.key_dim)

    def forward(q, k, v, g, beta, out, final):
        return cute_kda.kda_forward(q, k, v, g, beta, **problem, gate=case.gate, out=out, final_state=final)

    results = []
    for fn in (forward, torch.compile(forward, fullgraph=True)):
        out = torch.empty(tensors[2].shape, dtype=torch.bfloat16, device=device)
        final = torch.empty(shape, device=device)
        with torch.no_grad():
            o, ht = fn(*tensors, out, final)
        assert o is out and ht is final
        results.append((out, final))
    torch.cuda.synchronize()
    (o_eager, ht_eager), (o_compiled, ht_compiled) = results
    assert torch.equal(o_eager, o_compiled) and torch.equal(ht_eager, ht_compiled)


FLA_CASES = {  # FLA's own head dims beside cute_kda's padded / split call, training, the softplus gate in the kernel
    "chunk_kda_K64": ("chunk_kda", Case(64, 64, "softplus", heads=4, value_heads=4, lengths=(1000,))),
    "chunk_gated_delta_rule_expand_v": ("chunk_gated_delta_rule", Case(128, 256, "softplus", per_head=True, heads=2,
                                                                      value_heads=4, lengths=(1000,))),
}


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("name", sorted(FLA_CASES))
def test_against_fla_at_its_head_dims(name, device, monkeypatch):
    """cute_kda's padded / split call and FLA's own kernels on the same inputs at FLA's head dim: o, the final state
    and every gradient no worse against the fp64 gold than FLA's (1.25×) or within the targets."""
    entry, case = FLA_CASES[name]
    fla_entry = getattr(pytest.importorskip("fla.ops.kda" if entry == "chunk_kda" else "fla.ops.gated_delta_rule"),
                        entry)
    monkeypatch.setenv("FLA_CUTE_KDA", "0")  # FLA on its own kernels, not dispatching back to cute_kda
    monkeypatch.setenv("FLA_FLASH_KDA", "0")
    problem, do, dht = make_problem(case, seed=17, device=device)
    fla = dict(problem, initial_state=problem["initial_state"].transpose(-1, -2).contiguous())
    if not case.per_head:
        fla["dt_bias"] = fla["dt_bias"].flatten()
    flags = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True)
    dht_kv = dht.transpose(-1, -2)

    def step(forward):
        leaves = {n: x.clone().requires_grad_() if x.is_floating_point() else x for n, x in fla.items()}
        o, ht = forward(**leaves, **flags)
        torch.autograd.backward([o, ht], [do, dht_kv])
        torch.cuda.synchronize()
        return {"o": o.float().cpu(), "ht": ht.float().cpu(), **{GRAD[n]: leaves[n].grad.float().cpu() for n in NAMES}}

    ours = step(getattr(cute_kda, entry))
    try:
        theirs = step(fla_entry)
    except Exception as exc:  # FLA's backward refuses some Triton builds on Hopper (its issue #640)
        pytest.skip(f"FLA's {entry} does not run here: {type(exc).__name__}: {exc}")
    p = {n: x.cpu() for n, x in fla.items()}
    tensors = [p.pop(n) for n in NAMES[:5]]
    o_gold, ht_gold = gold_forward(*tensors, output_final_state=True, gate="softplus", state_layout="kv", **p)
    want = gold_backward(*tensors, do.cpu(), dht=dht_kv.cpu(), gate="softplus", state_layout="kv", **p)
    want.update(o=o_gold, ht=ht_gold)
    bounds = {"o": FORWARD_TOLERANCE, "ht": FORWARD_TOLERANCE, **SUM_TOLERANCES}
    rows = {n: (rel_rms(ours[n], want[n]), rel_rms(theirs[n], want[n])) for n in ours}
    print(f"[head dims vs FLA] {name}: " + ", ".join(f"{n} cute_kda {a:.2e} FLA {b:.2e}" for n, (a, b) in rows.items()))
    assert all(a <= max(1.25 * b, bounds[n]) for n, (a, b) in rows.items()), rows
