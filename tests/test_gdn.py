"""``cute_kda.chunk_gated_delta_rule`` (GatedDeltaNet: a per-head gate, grouped value heads), forward and training.

CPU tier: the whole call path with the mirror in place of the kernels (``test_api.mirror_kernels``): the
translation, the per-head K1 variant key, the launch, equal to the mirror's forward and within the forward
bound of the fp64 gold; a training call takes the autograd path. GPU tier: the kernels' outputs and gradients
against the fp64 gold, and against FLA's own ``chunk_gated_delta_rule`` on the same inputs (``fla`` marker).
"""

from __future__ import annotations

import functools

import os

import pytest
import torch

import cute_kda
from cute_kda.fla_calls import translate_fla_gdn_call
from cute_kda.reference import gold_backward, gold_forward, mirror_forward, rel_rms
from cute_kda.reference.pairs import mirror_forward_pairs
from cute_kda.variants import RecurrenceVariant, pair_prefill

from test_api import GOLD_BOUND, mirror_kernels  # noqa: F401  (fixture)
from gradient_targets import TARGETS
from test_gdn_translation import make_gdn_problem

os.environ.setdefault("FLA_CUTE_KDA", "0")
D = 128


def gdn_problem(lengths, *, heads=2, value_heads=4, raw_gate=True, state="fp32", device="cpu", seed=0) -> dict:
    """``make_gdn_problem``'s inputs at D = 128 (β logits) with the call's flags: a raw gate takes
    ``use_gate_in_kernel=True`` with A_log, dt_bias ``[HV]``; the log decay neither."""
    inputs = make_gdn_problem(lengths, heads=heads, value_heads=value_heads, raw_gate=raw_gate, state=state,
                              seed=seed, dim=D)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)
    if raw_gate:
        flags["use_gate_in_kernel"] = True
    else:
        del inputs["A_log"], inputs["dt_bias"]
    return {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in {**inputs, **flags}.items()}


def gold_gdn(problem: dict):
    call = translate_fla_gdn_call(**problem)
    return call.run(lambda *t, **o: gold_forward(*t, state_layout="vk", dtype=torch.float64, **o))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the mirror on CPU uses accurate tanh/exp2/log2
@pytest.mark.parametrize("raw_gate", [True, False], ids=["softplus", "log_decay"])
def test_call_path_with_mirror_kernels(mirror_kernels, raw_gate):
    problem = gdn_problem([5, 16, 1, 30], raw_gate=raw_gate)
    o, state = cute_kda.chunk_gated_delta_rule(**problem)
    assert mirror_kernels == ["k1", "k2"]
    call = translate_fla_gdn_call(**problem)
    vsplit = RecurrenceVariant.choose_vsplit(4, call.tensors[2].shape[2], 132)  # the seam's SMs, 4 sequences
    pairs = pair_prefill(call.options["gate"], True, False, vsplit)  # the two-tile prefill's mirrors where it runs
    o_mirror, state_mirror = (mirror_forward_pairs if pairs else mirror_forward)(*call.tensors, lower_bound=-5.0,
                                                                                 **call.options)
    assert torch.equal(o, o_mirror) and torch.equal(state, state_mirror.transpose(-1, -2).float())
    o_gold, state_gold = gold_gdn(problem)
    assert state.dtype == torch.float32 and state.shape == state_gold.shape
    assert rel_rms(o, o_gold) <= GOLD_BOUND and rel_rms(state, state_gold) <= GOLD_BOUND


def test_training_takes_the_autograd_path(monkeypatch):
    """A call that autograd records goes to the training path with the per-head gate (its gradients: the CPU
    references in tests/test_autograd.py, the kernels in tests/test_bwd_grads.py)."""
    from cute_kda.executors import stages, training

    seen = []
    monkeypatch.setattr(training, "train", lambda backend, call: seen.append((backend, call)) or (call.inputs.v, None))
    problem = gdn_problem([20])
    problem["q"].requires_grad_()
    cute_kda.chunk_gated_delta_rule(**problem)
    ((backend, call),) = seen
    assert backend is stages.KERNELS and call.training and call.options.gate == "softplus"
    assert call.options.recompute  # as FLA's: no states kept for the backward (docs/perf-log.md, GDN8)
    assert call.inputs.g.shape == (1, 20, 4)


GOLD_CASES = {
    "softplus_B2_T100_H2_HV4": dict(lengths=[100, 100]),
    "softplus_varlen_empty_1_token_bf16_state": dict(lengths=[17, 0, 33, 1, 300], state="bf16"),
    "log_decay_masks_B1_T1024_H2_HV4": dict(lengths=[1024], raw_gate=False),
    "log_decay_varlen_design_H1_HV2": dict(lengths=[1300, 547, 2048, 963, 271, 3063], raw_gate=False, heads=1,
                                            value_heads=2),
    "softplus_no_gva_H4": dict(lengths=[257], heads=4, value_heads=4, state=None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GOLD_CASES))
def test_matches_gold(case):
    problem = gdn_problem(device="cuda", **GOLD_CASES[case])
    o, state = cute_kda.chunk_gated_delta_rule(**problem)
    o_ref, state_ref = gold_gdn(problem)
    err_o, err_state = rel_rms(o, o_ref), rel_rms(state, state_ref)
    line = f"[chunk_gated_delta_rule vs gold] {case}: rel-RMS o {err_o:.3e}, final state {err_state:.3e}"
    print(line)
    assert o.shape == problem["v"].shape and state.dtype == torch.float32
    assert err_o <= GOLD_BOUND and err_state <= GOLD_BOUND, line


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("raw_gate", [True, False], ids=["softplus", "log_decay"])
def test_against_fla(raw_gate):
    """Side by side with FLA's chunk_gated_delta_rule forward on the same inputs: no worse against the gold."""
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    problem = gdn_problem([1000, 3000], heads=2, value_heads=4, raw_gate=raw_gate, device="cuda")
    o, state = cute_kda.chunk_gated_delta_rule(**problem)
    o_fla, state_fla = fla_gdn(**problem)
    o_ref, state_ref = gold_gdn(problem)
    ours, theirs = (rel_rms(o, o_ref), rel_rms(state, state_ref)), (rel_rms(o_fla, o_ref), rel_rms(state_fla, state_ref))
    print(f"[GDN vs gold] raw_gate={raw_gate}: cute_kda o {ours[0]:.3e} state {ours[1]:.3e}; "
          f"FLA o {theirs[0]:.3e} state {theirs[1]:.3e}")
    assert ours[0] <= max(1.25 * theirs[0], GOLD_BOUND) and ours[1] <= max(1.25 * theirs[1], GOLD_BOUND)


# the leaves a training call can differentiate, by the name of their gradient in gold_backward's result
GDN_GRADS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log", "dt_bias": "ddt_bias",
             "initial_state": "dh0"}
TRAINING_CASES = {
    "softplus_varlen_empty_1_token_gva": dict(lengths=[300, 0, 57, 1, 200]),
    "log_decay_masks_B2_T257": dict(lengths=[257, 257], raw_gate=False),
    "softplus_no_gva_bf16_state": dict(lengths=[129], heads=4, value_heads=4, state="bf16"),
}


def _training_problem(case: str):
    problem = gdn_problem(device="cuda", **TRAINING_CASES[case])
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(problem["v"].shape, generator=gen).bfloat16().cuda()
    num_seqs, heads = (len(TRAINING_CASES[case]["lengths"]), problem["v"].shape[2])
    dht = torch.randn(num_seqs, heads, D, D, generator=gen).cuda()
    return problem, do, dht


def gdn_grads(chunk_gated_delta_rule, problem: dict, do: torch.Tensor, dht: torch.Tensor) -> dict:
    """The gradients of ``Σ o·do + Σ ht·dht`` w.r.t. every floating-point input of ``problem``, by name."""
    leaves = {n: x.detach().clone().requires_grad_() if n in GDN_GRADS and isinstance(x, torch.Tensor) else x
              for n, x in problem.items()}
    o, ht = chunk_gated_delta_rule(**leaves)
    torch.autograd.backward([o, ht], [do, dht])
    return {n: leaves[n].grad for n in GDN_GRADS if isinstance(leaves.get(n), torch.Tensor)}


def gold_gdn_grads(problem: dict, do: torch.Tensor, dht: torch.Tensor) -> dict:
    """Autograd through the fp64 gold on the translated call, handed back in the caller's layout."""
    call = translate_fla_gdn_call(**{n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in problem.items()})
    options = {n: x for n, x in call.options.items() if n != "output_final_state"}
    dht = dht.cpu().transpose(-1, -2) if call.state_k_first else dht.cpu()
    want = gold_backward(*call.tensors, do.cpu(), dht=dht, state_layout="vk", **options)
    if call.state_k_first and want["dh0"] is not None:
        want["dh0"] = want["dh0"].transpose(-1, -2)
    return {n: want[GDN_GRADS[n]] for n in GDN_GRADS if isinstance(problem.get(n), torch.Tensor)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(TRAINING_CASES))
def test_training_matches_gold(case):
    """A training call through ``chunk_gated_delta_rule``: every gradient FLA fills, in its input's dtype and
    shape, within issue 10's targets of autograd through the fp64 gold."""
    problem, do, dht = _training_problem(case)
    grads = gdn_grads(cute_kda.chunk_gated_delta_rule, problem, do, dht)
    want = gold_gdn_grads(problem, do, dht)
    errors = {}
    for name, grad in grads.items():
        assert grad.dtype == problem[name].dtype and grad.shape == problem[name].shape, name
        errors[GDN_GRADS[name]] = rel_rms(grad.cpu(), want[name])
    print(f"[chunk_gated_delta_rule gradients vs gold] {case}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(e <= TARGETS[n] for n, e in errors.items()), errors


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(TRAINING_CASES))
def test_recompute_keeps_every_bit(case, monkeypatch):
    """The default call keeps no states for the backward (it recomputes them, as FLA's does; docs/perf-log.md, GDN8):
    recomputed per tile, every gradient is the bits of ``disable_recompute=True``, which keeps them. (Where the
    recomputation runs the two-tile form, ``PAIR_TRAINING``, its rounding is the pair form's:
    :func:`test_pair_training_matches_gold`.)"""
    from cute_kda.executors import stages

    monkeypatch.setattr(stages, "PAIR_TRAINING", False)
    problem, do, dht = _training_problem(case)
    kept = functools.partial(cute_kda.chunk_gated_delta_rule, disable_recompute=True)
    grads, kept_grads = (gdn_grads(forward, problem, do, dht) for forward in (cute_kda.chunk_gated_delta_rule, kept))
    assert grads.keys() == kept_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(TRAINING_CASES))
def test_pair_training_matches_gold(case, monkeypatch):
    """The default (recomputing) call under ``PAIR_TRAINING``, whose rule these few chains meet (K2 at V-split 4): the
    two-tile backward's gradients within the same targets of the gold, the same bits twice, and the backward did run
    on pairs (Kernel B keyed ``pair_rebuild`` for the per-head gate)."""
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.executors import stages

    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    seen = []
    launch = kb.compiled_variant
    monkeypatch.setattr(kb, "compiled_variant", lambda variant, *a: seen.append(variant) or launch(variant, *a))
    problem, do, dht = _training_problem(case)
    grads = gdn_grads(cute_kda.chunk_gated_delta_rule, problem, do, dht)
    again = gdn_grads(cute_kda.chunk_gated_delta_rule, problem, do, dht)
    want = gold_gdn_grads(problem, do, dht)
    assert seen and all(variant.pair_rebuild for variant in seen)
    errors = {GDN_GRADS[n]: rel_rms(grad.cpu(), want[n]) for n, grad in grads.items()}
    print(f"[chunk_gated_delta_rule pair training vs gold] {case}: "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(torch.equal(grads[n], again[n]) for n in grads)
    assert all(e <= TARGETS[n] for n, e in errors.items()), errors


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("raw_gate", [True, False], ids=["softplus", "log_decay"])
def test_training_against_fla(raw_gate):
    """Gradients side by side with FLA's chunk_gated_delta_rule on the same inputs: no worse against the gold."""
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    problem = gdn_problem([1000, 3000], heads=2, value_heads=4, raw_gate=raw_gate, device="cuda")
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(problem["v"].shape, generator=gen).bfloat16().cuda()
    dht = torch.randn(2, 4, D, D, generator=gen).cuda()
    ours = gdn_grads(cute_kda.chunk_gated_delta_rule, problem, do, dht)
    want = gold_gdn_grads(problem, do, dht)
    try:
        theirs = gdn_grads(fla_gdn, problem, do, dht)
    except Exception as exc:  # FLA's backward refuses some Triton builds on Hopper (its issue #640)
        pytest.skip(f"FLA's chunk_gated_delta_rule backward does not run here: {type(exc).__name__}: {exc}")
    rows = {GDN_GRADS[n]: (rel_rms(ours[n].cpu(), want[n]), rel_rms(theirs[n].cpu(), want[n])) for n in ours}
    print(f"[GDN gradients vs gold] raw_gate={raw_gate}: "
          + ", ".join(f"{n} cute_kda {a:.2e} FLA {b:.2e}" for n, (a, b) in rows.items()))
    assert all(a <= max(1.25 * b, TARGETS[n]) for n, (a, b) in rows.items()), rows
