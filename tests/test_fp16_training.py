"""fp16 training (issue 33; docs/numerics.md, "fp16 training"): the fp16 forward kernels, then by default
(``training.FP16_NATIVE_BACKWARD``) the fp16 forward's own backward on the inputs as given, or on the copy route the
bf16 backward kernels on bf16 copies of dO, q, k, v and an fp16 g made in the training executor's backward; every
gradient of an fp16 input in fp16. The tests below name the route they pin.

CPU tier: the kernel stages with their launchers replaced by the mirrors (the real launchers' buffer checks run, so
Kernel A and Kernel B are handed bf16) equal the reference backend's chain bit for bit; the compiled training step
(one op each way) equals eager bit for bit; ``opcheck`` of the training ops on fp16; GatedDeltaNet's FLA call (fp32 β,
fp16 state) hands each gradient back in its input's dtype; K = V = 64 (zero-padded) against the fp64 gold; the bytes
kept for the backward are the bf16 call's. The accuracy against the fp64 gold on the CPU:
``tests/test_fp16_accuracy.py``.

GPU tier: ``cute_kda.kda_forward`` on the kernels against autograd through the fp64 gold on the fp16 values (FLA's
tolerances: dq dk dv dh0 8e-3, dg dβ 2e-2; dA_log, ddt_bias as the bf16 tests hold them) over gates, tails,
T < 16, varlen with empty and 1-token sequences, grouped value heads, fp16 / fp32 states, ``recompute``, a
segmented call and K = V = 64; ``recompute`` bit-identical; the backward kernels' fp16 gradient stores
(``training.FP16_GRAD_STORES``) bit-identical to the copy route (on the CPU too, on the mirrors); the compiled step
equal to eager;
``chunk_gated_delta_rule`` on FLA's fp16 inputs.

``training.FP16_NATIVE_BACKWARD`` (the backward on the fp16 inputs, stage 4 of docs/numerics.md's "fp16 training"):
on the CPU the launchers are handed fp16 (K1 again, Kernel B's q, k, v, g) and the gradients are the reference
backend's bit for bit (a segmented call reusing its segment states), within FLA's tolerances of the gold and no
farther from it than the copy route's; on the GPU the gold checks over the same cases.

``training.FP16_DO_KERNEL`` (dO rounded by ``cute_kda.ops.round_bf16``; the kernel itself: tests/test_round_bf16.py):
on the CPU Kernel A and Kernel B get the one rounded tensor, ``do.to(bf16)``'s bits; on the GPU the gold checks and
the gradients bit-identical to torch's cast.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import cute_kda
from cute_kda.executors import stages, training
from cute_kda.fla_calls import translate_fla_gdn_call
from cute_kda.reference import gold_backward, rel_rms
from cute_kda.reference.backend import REFERENCE

from gradient_targets import SAFE_GATE_TOLERANCES, TARGETS
from test_autograd import (  # noqa: F401  (fixtures)
    INPUTS, REFERENCE_FORWARD, Graphs, _grads_of, _op_arguments, _step, launchers_on_mirrors, make_problem,
    reference_ops, train,
)

pytestmark = pytest.mark.filterwarnings("ignore:cute_kda mirror on CPU:RuntimeWarning")

D = 128
FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def fp16_problem(lengths, *, state=FP16, **options):
    """:func:`test_autograd.make_problem` with q, k, v, g (and β) in fp16, the state in ``state``; do fp16."""
    problem, do, dht = make_problem(lengths, state=state, **options)
    problem = {n: x.half() if n in ("q", "k", "v", "g", "beta") else x for n, x in problem.items()}
    return problem, do.half(), dht


# ---------------------------------------------------------------- CPU


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_kernel_stages_hand_the_backward_kernels_bf16(launchers_on_mirrors, recompute, monkeypatch):
    """The copy route (``FP16_NATIVE_BACKWARD`` off): fp16 q, k, v, g, β, state and do through KERNELS: the forward's
    K1 / K2 get the fp16 tensors and keep nothing, the backward runs K1 / K2 again, Kernel A and Kernel B on bf16
    (their launchers' checks pass), and every gradient is fp16 and the reference backend's bit for bit, whatever
    ``recompute`` says."""
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", False)
    problem, do, dht = fp16_problem([20, 0, 17, 5, 1])
    launchers_on_mirrors.beta = problem["beta"].bfloat16()  # β enters rounded to bf16
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    o, ht, grads = train(forward, problem, do=do, dht=dht.half(), recompute=recompute)
    o_ref, ht_ref, expected = train(REFERENCE_FORWARD, problem, do=do, dht=dht.half(), recompute=recompute)
    assert launchers_on_mirrors.calls == ["tile_bases", "prepare", "recurrence", "prepare", "recurrence", "bwd_scan",
                                          "bwd_grads"]
    assert o.dtype == ht.dtype == FP16 and torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    for name in expected:
        assert grads[name].dtype == problem[name].dtype, (name, grads[name].dtype)
        assert torch.equal(grads[name], expected[name]), name
    assert {grads[n].dtype for n in ("q", "k", "v", "g", "beta", "initial_state")} == {FP16}


def test_fp16_gradient_stores_give_the_copy_routes_bits(launchers_on_mirrors, monkeypatch):
    """``FP16_GRAD_STORES``: Kernel A is handed an fp16 dv, Kernel B fp16 dq, dk, dg (their launchers' checks pass)
    and every gradient is the copy route's bit for bit (the mirrors' bf16 values converted, as the kernels store
    them)."""
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.ops import bwd_scan as ka

    problem, do, dht = fp16_problem([20, 0, 17, 5, 1])
    launchers_on_mirrors.beta = problem["beta"].bfloat16()
    handed = []
    check = kb._check_buffers
    monkeypatch.setattr(kb, "_check_buffers", lambda *a: handed.append((a[9].dtype, a[10].dtype, a[11].dtype))
                        or check(*a))
    check_scan = ka._check_buffers
    monkeypatch.setattr(ka, "_check_buffers", lambda *a: handed.append(a[2].dtype) or check_scan(*a))
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", False)  # the copy route, with and without the stores
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    copied = train(forward, problem, do=do, dht=dht.half())[2]
    monkeypatch.setattr(training, "FP16_GRAD_STORES", True)
    stored = train(forward, problem, do=do, dht=dht.half())[2]
    reference = train(REFERENCE_FORWARD, problem, do=do, dht=dht.half())[2]
    assert handed == [BF16, (BF16,) * 3, FP16, (FP16,) * 3]
    for name in copied:
        assert stored[name].dtype == problem[name].dtype, name
        assert torch.equal(stored[name], copied[name]) and torch.equal(stored[name], reference[name]), name


def test_native_backward_hands_the_kernels_the_fp16_inputs(launchers_on_mirrors, monkeypatch):
    """``FP16_NATIVE_BACKWARD``: the backward's K1 and K2 get the fp16 q, k, g, v and the fp16 state again, Kernel B
    fp16 q, k, v, g beside the bf16 dO (its launcher's checks pass) and stores fp16 dq, dk, dg, Kernel A an fp16 dv;
    every gradient fp16 and the reference backend's under the switch bit for bit (the same chain on the mirrors)."""
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.ops import prepare as k1

    problem, do, dht = fp16_problem([20, 0, 17, 5, 1])
    launchers_on_mirrors.beta = problem["beta"].bfloat16()
    handed = []
    check = kb._check_buffers
    monkeypatch.setattr(kb, "_check_buffers", lambda *a: handed.append(tuple(t.dtype for t in a[:5] + a[9:12]))
                        or check(*a))
    prepare = k1.prepare
    monkeypatch.setattr(k1, "prepare", lambda q, *a, **o: handed.append(q.dtype) or prepare(q, *a, **o))
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", True)
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    o, ht, grads = train(forward, problem, do=do, dht=dht.half())
    o_ref, ht_ref, expected = train(REFERENCE_FORWARD, problem, do=do, dht=dht.half())
    assert handed == [FP16, FP16, (FP16, FP16, FP16, FP16, BF16, FP16, FP16, FP16)]  # q k g v do; dq dk dg
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    for name in expected:
        assert grads[name].dtype == problem[name].dtype and torch.equal(grads[name], expected[name]), name


def test_native_backward_is_the_fp16_forwards_gradient():
    """On the mirrors: under ``FP16_NATIVE_BACKWARD`` the gradients are within FLA's tolerances of the fp64 gold on
    the fp16 values and, without the inputs' rounding to bf16, no farther from it than the copy route's in the RMS
    over the token gradients (docs/numerics.md, "fp16 training", stage 4); they differ from the copy route's."""
    gen = torch.Generator().manual_seed(3)  # FLA's draws (fp16 values bf16 cannot hold), as gpu_problem's
    lengths = [96, 0, 61, 1]
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    q, k, v = (torch.rand(1, cu[-1], 2, D, generator=gen).half() for _ in range(3))
    p = dict(q=q, k=k, v=v, g=(torch.randn(1, cu[-1], 2, D, generator=gen) * 4).half(),
             beta=torch.randn(1, cu[-1], 2, generator=gen).half(), A_log=torch.rand(2, generator=gen) - 0.5,
             dt_bias=torch.randn(2, D, generator=gen),
             initial_state=(0.1 * torch.randn(len(lengths), 2, D, D, generator=gen)).half(), cu_seqlens=cu)
    do = torch.randn(v.shape, generator=gen).half()
    dht = torch.randn(len(lengths), 2, D, D, generator=gen).half()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "FP16_NATIVE_BACKWARD", False)
        copied = train(REFERENCE_FORWARD, p, do=do, dht=dht, lower_bound=-5.0)[2]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "FP16_NATIVE_BACKWARD", True)
        native = train(REFERENCE_FORWARD, p, do=do, dht=dht, lower_bound=-5.0)[2]
    want = gold_backward(*(p[n] for n in ("q", "k", "v", "g", "beta")), do, dht=dht, A_log=p["A_log"],
                         dt_bias=p["dt_bias"], initial_state=p["initial_state"], cu_seqlens=cu, lower_bound=-5.0,
                         state_layout="vk")
    names = dict(zip(INPUTS, ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")))
    errors = {route: {names[n]: rel_rms(grads[n], want[names[n]]) for n in grads}
              for route, grads in (("copied", copied), ("native", native))}
    print(errors)
    assert all(e <= SAFE_GATE_TOLERANCES[n] for n, e in errors["native"].items()), errors
    tokens = ("dq", "dk", "dv", "dg")
    assert sum(errors["native"][n] ** 2 for n in tokens) <= sum(errors["copied"][n] ** 2 for n in tokens), errors
    assert not torch.equal(native["q"], copied["q"])


SEGMENTED_BACKWARD_CALLS = {  # the backward's launches after the forward's K1 and three K2 segments
    # the copy route: K1 and the three K2 passes again on bf16 (its segment states too)
    "copy_route": (False, ["prepare", *["recurrence"] * 3]),
    # the native backward: one K2 pass on the fp16 inputs with the forward's own segment states
    "native": (True, ["prepare", "recurrence"]),
}


@pytest.mark.parametrize("route", list(SEGMENTED_BACKWARD_CALLS))
def test_segmented_fp16_call_on_the_kernel_stages(launchers_on_mirrors, monkeypatch, route):
    """A segmented fp16 call (context parallelism) on either route of ``FP16_NATIVE_BACKWARD``: the packed segments
    through the same launchers, the backward's recompute as :data:`SEGMENTED_BACKWARD_CALLS` says, Kernel A twice and
    Kernel B; every gradient fp16 and the reference backend's under the same switch bit for bit."""
    native, recompute_calls = SEGMENTED_BACKWARD_CALLS[route]
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", native)
    problem, do, dht = fp16_problem([48, 48])
    launchers_on_mirrors.beta = problem["beta"].bfloat16().reshape(1, -1, problem["beta"].shape[2])
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    o, ht, grads = train(forward, problem, do=do, dht=dht.half(), segments=3)
    o_ref, ht_ref, expected = train(REFERENCE_FORWARD, problem, do=do, dht=dht.half(), segments=3)
    assert launchers_on_mirrors.calls == ["prepare", *["recurrence"] * 3, *recompute_calls, "bwd_scan", "bwd_scan",
                                          "bwd_grads"]
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref) and ht.dtype == FP16
    for name in expected:
        assert grads[name].dtype == problem[name].dtype and torch.equal(grads[name], expected[name]), name


def test_recompute_gives_the_same_fp16_gradients():
    """fp16 always recomputes (on the bf16 copies): ``recompute`` changes nothing."""
    problem, do, dht = fp16_problem([33, 33])
    kept = train(REFERENCE_FORWARD, problem, do=do, dht=dht.half())[2]
    again = train(REFERENCE_FORWARD, problem, do=do, dht=dht.half(), recompute=True)[2]
    for name in kept:
        assert torch.equal(kept[name], again[name]), name


@pytest.mark.parametrize("state", [FP16, FP32], ids=["fp16_state", "fp32_state"])
def test_compiled_fp16_training_step_is_one_op_each_way(reference_ops, state):
    problem, do, dht = fp16_problem([40], state=state)
    dht = dht.to(state)
    eager = _grads_of(_step(REFERENCE_FORWARD, do, dht), problem)
    graphs = Graphs()
    compiled = _grads_of(torch.compile(_step(cute_kda.kda_forward, do, dht), fullgraph=True, backend=graphs.backend),
                         problem)
    for name, a, b in zip(INPUTS, eager, compiled):
        assert a.dtype == b.dtype == problem[name].dtype and torch.equal(a, b), name
    assert Graphs.count(graphs.forward, "cute_kda.forward_train.default") == 1
    assert Graphs.count(graphs.backward, "cute_kda.backward.default") == 1


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_opcheck_fp16_training_ops(reference_ops, recompute):
    problem, do, dht = fp16_problem([20, 17])
    problem["beta"] = problem["beta"].bfloat16()  # the op takes β as the kernels do (the traced call casts it)
    leaves = {n: x.detach().clone().requires_grad_() if x.is_floating_point() else x for n, x in problem.items()}
    torch.library.opcheck(training.forward_train_op, _op_arguments(leaves, recompute),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    _, _, ws, checkpoints, tile_base, _ = training.forward_train_op(*_op_arguments(problem, recompute))
    p = problem
    args = (do, dht.half(), *(p[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), p["initial_state"],
            p["cu_seqlens"], ws, checkpoints, tile_base, None, D ** -0.5, -5.0, True, True, FP16, True, recompute,
            "safe", None, None)
    torch.library.opcheck(training.backward_op, args)
    grads = training.backward_op(*args)
    assert [t.dtype for t in grads[:4]] == [FP16] * 4 and grads[4].dtype == BF16 and grads[7].dtype == FP16


def test_gated_delta_rule_fla_call_trains_on_fp16():
    """FLA's GatedDeltaNet test inputs: fp16 q, k, v, an fp32 log decay, fp32 β, an fp16 state; each gradient in its
    input's dtype, within FLA's tolerances of the fp64 gold on those values."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.rand(1, 80, 2, D, generator=gen).half().requires_grad_() for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.rand(1, 80, 2, generator=gen)).requires_grad_()
    beta = torch.rand(1, 80, 2, generator=gen).requires_grad_()
    h0 = (0.1 * torch.randn(1, 2, D, D, generator=gen)).half().requires_grad_()
    do = torch.randn(1, 80, 2, D, generator=gen).half()
    call = translate_fla_gdn_call(q, k, v, g, beta, initial_state=h0, output_final_state=True, scale=0.1,
                                  use_qk_l2norm_in_kernel=True)
    o, ht = call.run(functools.partial(training.kda_forward, backend=REFERENCE))
    assert o.dtype == FP16 and ht.dtype == FP32
    dht = torch.randn(ht.shape, generator=gen)
    torch.autograd.backward([o, ht], [do, dht])
    assert [t.grad.dtype for t in (q, k, v, g, beta, h0)] == [FP16, FP16, FP16, FP32, FP32, FP16]
    gold = gold_backward(q, k, v, g, beta, do, dht=dht, initial_state=h0, gate="none", scale=0.1, qk_l2norm=True,
                         beta_logits=False, state_layout="kv")
    errors = {name: rel_rms(t.grad, gold[name])
              for name, t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), (q, k, v, g, beta, h0))}
    assert all(error <= TARGETS[name] for name, error in errors.items()), errors


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_fp16_training_at_head_dim_64(gate):
    """fp16 at K = V = 64 (FLA's commonest size after 128): natively at 64 (every kernel takes it), the fp16
    forward, the backward on bf16 copies; fp16 gradients at the caller's size within FLA's tolerances of the gold."""
    gen = torch.Generator().manual_seed(9)
    lengths = [40, 0, 1, 60]
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    q, k, v = (torch.rand(1, 101, 2, 64, generator=gen).half() for _ in range(3))
    tensors = dict(q=q, k=k, v=v, g=(torch.randn(1, 101, 2, 64, generator=gen) * 4).half(),
                   beta=torch.randn(1, 101, 2, generator=gen).half(), A_log=torch.rand(2, generator=gen) - 0.5,
                   dt_bias=torch.randn(2, 64, generator=gen),
                   initial_state=(0.1 * torch.randn(4, 2, 64, 64, generator=gen)).half())
    do = torch.randn(v.shape, generator=gen).half()
    dht = torch.randn(4, 2, 64, 64, generator=gen)
    leaves = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    o, ht = REFERENCE_FORWARD(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), A_log=leaves["A_log"],
                              dt_bias=leaves["dt_bias"], initial_state=leaves["initial_state"], gate=gate,
                              cu_seqlens=cu, output_final_state=True)
    assert o.shape == v.shape and o.dtype == ht.dtype == FP16
    torch.autograd.backward([o, ht], [do, dht.half()])
    want = gold_backward(*(tensors[n] for n in ("q", "k", "v", "g", "beta")), do, dht=dht.half(), gate=gate,
                         A_log=tensors["A_log"], dt_bias=tensors["dt_bias"], initial_state=tensors["initial_state"],
                         cu_seqlens=cu, state_layout="vk", **({"lower_bound": -5.0} if gate == "safe" else {}))
    names = dict(zip(INPUTS, ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")))
    tolerances = SAFE_GATE_TOLERANCES if gate == "safe" else TARGETS
    errors = {}
    for name, leaf in leaves.items():
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        errors[names[name]] = rel_rms(leaf.grad, want[names[name]])
    assert all(e <= tolerances[n] for n, e in errors.items()), errors


# ---------------------------------------------------------------- GPU: the kernels against the fp64 gold

def test_do_kernel_hands_kernel_a_and_b_the_rounded_do(launchers_on_mirrors, monkeypatch):
    """``FP16_DO_KERNEL``: the fp16 dO goes through the rounding launcher once (a torch stand-in here), and Kernel A
    and Kernel B are handed that one bf16 tensor, ``do.to(bf16)`` bit for bit; every gradient as with the switch
    off (bf16 dO: the switch never calls it)."""
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.ops import bwd_scan as ka
    from cute_kda.ops import round_bf16

    problem, do, dht = fp16_problem([20, 0, 17, 5, 1])
    launchers_on_mirrors.beta = problem["beta"].bfloat16()
    rounded, handed = [], []
    monkeypatch.setattr(round_bf16, "round_to_bf16", lambda x: rounded.append(x.to(torch.bfloat16)) or rounded[-1])
    check_scan, check_grads = ka._check_buffers, kb._check_buffers
    monkeypatch.setattr(ka, "_check_buffers", lambda *a: handed.append(a[0]) or check_scan(*a))
    monkeypatch.setattr(kb, "_check_buffers", lambda *a: handed.append(a[4]) or check_grads(*a))
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    monkeypatch.setattr(training, "FP16_DO_KERNEL", False)
    off = train(forward, problem, do=do, dht=dht.half())[2]
    assert rounded == [] and len(handed) == 2
    monkeypatch.setattr(training, "FP16_DO_KERNEL", True)
    handed.clear()
    on = train(forward, problem, do=do, dht=dht.half())[2]
    assert len(rounded) == 1 and len(handed) == 2
    assert all(t.dtype == BF16 and t.data_ptr() == rounded[0].data_ptr() for t in handed)
    assert torch.equal(handed[0].reshape(-1).view(torch.int16), do.bfloat16().reshape(-1).view(torch.int16))
    for name in off:
        assert torch.equal(on[name], off[name]), name
    bf16_problem = {n: t.bfloat16() if t.dtype == FP16 else t for n, t in problem.items()}
    train(forward, bf16_problem, do=do.bfloat16(), dht=dht)
    assert len(rounded) == 1


GPU_CASES = {  # gate, per-head gate, value heads, lengths (None: B2 T1000), state dtype, options
    "safe_B2_T1000": ("safe", False, 2, None, None, {}),
    "safe_varlen_fp16_state": ("safe", False, 2, [1, 0, 15, 16, 17, 1000, 333], FP16, {}),
    "safe_T7_fp16_state": ("safe", False, 2, [7], FP16, {}),
    "softplus_varlen_fp32_state": ("softplus", False, 2, [300, 1, 700], FP32, {}),
    "softplus_grouped_fp16_state": ("softplus", False, 4, [257, 64], FP16, {}),
    "log_decay_fp32_g": ("none", False, 2, None, BF16, {}),
    "log_decay_fp16_g_fp16_state": ("none", False, 2, [513, 0, 200], FP16, {"fp16_g": True}),
    "gdn_softplus_grouped": ("softplus", True, 4, [513, 64, 2], FP32, {}),
    "gdn_log_decay_fp16_state": ("none", True, 2, [100, 0, 17, 700], FP16, {}),
    "safe_recompute_fp16_state": ("safe", False, 2, [300, 700], FP16, {"recompute": True}),
    "safe_segmented_fp16_state": ("safe", False, 2, None, FP16, {"segments": 4}),
    "softplus_head_dim_64_varlen": ("softplus", False, 2, [1, 0, 15, 16, 17, 1000, 333], FP16, {"dim": 64}),
    "gdn_head_dim_64_grouped": ("none", True, 4, [513, 64, 2], FP32, {"dim": 64}),
}


def gpu_problem(case: str, device) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """(tensors on the CPU, kda_forward's options, do fp16, dht fp32) of a :data:`GPU_CASES` case: FLA's draws
    (q, k, v uniform in [0, 1) fp16, β logits fp16, the raw gate ``4·randn`` fp16 or the log decay
    ``logsigmoid(randn)``, the state ``0.1·randn``)."""
    gate, per_head, value_heads, lengths, state, extra = GPU_CASES[case]
    gen = torch.Generator().manual_seed(11)
    batch, steps = (2, 1000) if lengths is None else (1, sum(lengths))
    num_seqs, dim = batch if lengths is None else len(lengths), extra.get("dim", D)
    q, k = (torch.rand(batch, steps, 2, dim, generator=gen).half() for _ in range(2))  # grouped: HV = 4
    v = torch.rand(batch, steps, value_heads, dim, generator=gen).half()
    gate_shape = (batch, steps, value_heads) if per_head else (batch, steps, value_heads, dim)
    if gate == "none":
        g = torch.nn.functional.logsigmoid(torch.randn(gate_shape, generator=gen))
        g = g.half() if extra.get("fp16_g") else g
    else:
        g = (torch.randn(gate_shape, generator=gen) * 4).half()
    tensors = dict(q=q, k=k, v=v, g=g, beta=torch.randn(batch, steps, value_heads, generator=gen).half())
    if gate != "none":
        tensors["A_log"] = torch.rand(value_heads, generator=gen) - 0.5
        tensors["dt_bias"] = torch.randn(gate_shape[2:], generator=gen)
    if state is not None:
        tensors["initial_state"] = (0.1 * torch.randn(num_seqs, value_heads, dim, dim, generator=gen)).to(state)
    options = dict(gate=gate, output_final_state=True, recompute=extra.get("recompute", False),
                   segments=extra.get("segments"))
    if gate == "safe":
        options["lower_bound"] = -5.0
    if lengths is not None:
        options["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(lengths)])
    do = torch.randn(v.shape, generator=gen).half()
    dht = torch.randn(num_seqs, value_heads, dim, dim, generator=gen)
    return tensors, options, do, dht


def errors_against_gold(tensors: dict, options: dict, do: torch.Tensor, dht: torch.Tensor, device) -> tuple:
    """(o, {gradient name: rel-RMS against autograd through the fp64 gold on ``tensors``' values}, the gold) of
    ``cute_kda.kda_forward`` on ``device``, every gradient checked for its input's dtype and shape."""
    leaves = {n: t.detach().to(device).requires_grad_() for n, t in tensors.items()}
    cu = options.get("cu_seqlens")
    o, ht = cute_kda.kda_forward(*(leaves[n] for n in ("q", "k", "v", "g", "beta")),
                                 **{n: leaves[n] for n in leaves if n not in ("q", "k", "v", "g", "beta")},
                                 **{**options, "cu_seqlens": None if cu is None else cu.to(device)})
    torch.autograd.backward([o, ht], [do.to(device), dht.to(device, ht.dtype)])
    gold_options = {n: options[n] for n in ("gate", "lower_bound", "cu_seqlens") if n in options}
    want = gold_backward(tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"], do, dht=dht,
                         A_log=tensors.get("A_log"), dt_bias=tensors.get("dt_bias"),
                         initial_state=tensors.get("initial_state"), qk_l2norm=True, beta_logits=True,
                         state_layout="vk", **gold_options)
    names = dict(zip(INPUTS, ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")))
    errors = {}
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        errors[names[name]] = rel_rms(leaf.grad.cpu(), want[names[name]])
    return o, errors, want


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fp16_training_matches_the_gold(case, device, monkeypatch):
    """The copy route (``FP16_NATIVE_BACKWARD`` off): every gradient of an fp16 input fp16, in its input's shape, within FLA's tolerances of autograd through the
    fp64 gold on the fp16 values. dA_log and ddt_bias (not in FLA's list) are held to the bf16 tests' targets, or,
    where a per-head sum cancels past them, to 1.25× the triangle bound of the bf16 call the backward is: bf16
    training's error on the inputs rounded to bf16 (against the gold on those) plus the rounding's own (that gold
    against the gold on the fp16 values)."""
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", False)
    assert_within_the_golds_tolerances(case, device, "fp16 training")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fp16_native_backward_matches_the_gold(case, device, monkeypatch):
    """``FP16_NATIVE_BACKWARD`` (the default; the backward on the fp16 inputs: the recompute's fp16 K1 / K2, Kernel B reading
    fp16 q, k, v, g; docs/numerics.md, "fp16 training", stage 4): :func:`test_fp16_training_matches_the_gold`'s
    checks."""
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", True)
    assert_within_the_golds_tolerances(case, device, "fp16 native backward")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fp16_do_kernel_matches_the_gold(case, device, monkeypatch):
    """``FP16_DO_KERNEL`` (fp16 dO rounded by cute_kda's kernel, on the default native backward):
    :func:`test_fp16_training_matches_the_gold`'s checks, and the gradients bit-identical to the switch off."""
    tensors, options, do, dht = gpu_problem(case, device)
    cast = kernel_grads(tensors, options, do, dht, device)
    monkeypatch.setattr(training, "FP16_DO_KERNEL", True)
    assert_within_the_golds_tolerances(case, device, "fp16 dO kernel")
    rounded = kernel_grads(tensors, options, do, dht, device)
    for name in cast:
        assert rounded[name].dtype == cast[name].dtype and torch.equal(rounded[name], cast[name]), name


def assert_within_the_golds_tolerances(case: str, device, label: str) -> None:
    """:func:`test_fp16_training_matches_the_gold`'s checks of ``case`` (printed under ``label``)."""
    tensors, options, do, dht = gpu_problem(case, device)
    o, errors, want = errors_against_gold(tensors, options, do, dht, device)
    assert o.dtype == FP16
    print(f"[{label} vs gold] {case}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    tolerances = SAFE_GATE_TOLERANCES if options["gate"] == "safe" else TARGETS
    over = {n for n in ("dA_log", "ddt_bias") if errors.get(n, 0.0) > tolerances[n]}
    if over:
        rounded = {n: (t.float() if n == "initial_state" else t.bfloat16()) if t.dtype == FP16 else t
                   for n, t in tensors.items()}  # an fp16 state widened (exact): bf16 inputs take fp32 / bf16 ones
        _, bf16_errors, rounded_want = errors_against_gold(rounded, options, do.bfloat16(), dht, device)
        bound = {n: bf16_errors[n] + rel_rms(rounded_want[n], want[n]) for n in over}
        print(f"[bf16 training vs gold, + rounding] {case}: " + ", ".join(f"{n} {bound[n]:.2e}" for n in sorted(over)))
        tolerances = {**tolerances, **{n: max(tolerances[n], 1.25 * bound[n]) for n in over}}
    assert all(e <= tolerances[n] for n, e in errors.items()), errors


def kernel_grads(tensors: dict, options: dict, do: torch.Tensor, dht: torch.Tensor, device) -> dict:
    """{input name: its gradient} of ``cute_kda.kda_forward`` on ``device`` (the GPU's kernels)."""
    leaves = {n: t.detach().to(device).requires_grad_() for n, t in tensors.items()}
    cu = options.get("cu_seqlens")
    o, ht = cute_kda.kda_forward(*(leaves[n] for n in ("q", "k", "v", "g", "beta")),
                                 **{n: leaves[n] for n in leaves if n not in ("q", "k", "v", "g", "beta")},
                                 **{**options, "cu_seqlens": None if cu is None else cu.to(device)})
    torch.autograd.backward([o, ht], [do.to(device), dht.to(device, ht.dtype)])
    return {n: leaf.grad for n, leaf in leaves.items()}


@pytest.mark.gpu
def test_fp16_recompute_is_bit_identical_on_the_kernels(device):
    tensors, options, do, dht = gpu_problem("safe_varlen_fp16_state", device)
    kept = kernel_grads(tensors, {**options, "recompute": False}, do, dht, device)
    again = kernel_grads(tensors, {**options, "recompute": True}, do, dht, device)
    for name in kept:
        assert torch.equal(kept[name], again[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fp16_gradient_stores_are_bit_identical_on_the_kernels(case, device, monkeypatch):
    """``FP16_GRAD_STORES`` (Kernel A storing dv, Kernel B dq, dk, dg in fp16) gives the copy route's gradients bit
    for bit (grouped value heads and fp32 gates keep the copy route for dq, dk, dg); both on the copy route
    (``FP16_NATIVE_BACKWARD`` off, which stores fp16 itself)."""
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", False)
    tensors, options, do, dht = gpu_problem(case, device)
    copied = kernel_grads(tensors, options, do, dht, device)
    monkeypatch.setattr(training, "FP16_GRAD_STORES", True)
    stored = kernel_grads(tensors, options, do, dht, device)
    for name in copied:
        assert stored[name].dtype == copied[name].dtype and torch.equal(stored[name], copied[name]), name


@pytest.mark.gpu
def test_compiled_fp16_training_step_matches_eager(device):
    tensors, options, do, dht = gpu_problem("safe_T7_fp16_state", device)
    problem = {n: t.to(device) for n, t in tensors.items()}
    do, dht = do.to(device), dht.to(device, FP16)
    eager = _grads_of(_step(cute_kda.kda_forward, do, dht), problem)
    compiled = _grads_of(torch.compile(_step(cute_kda.kda_forward, do, dht), fullgraph=True), problem)
    torch.cuda.synchronize()
    for name, a, b in zip(INPUTS, eager, compiled):
        assert a.dtype == b.dtype == problem[name].dtype and torch.equal(a, b), name


@pytest.mark.gpu
def test_chunk_gated_delta_rule_trains_on_flas_fp16_inputs(device):
    """GatedDeltaNet as FLA's tests call it (fp16 q, k, v, fp32 log decay and β, fp16 ``[N, HV, K, V]`` state,
    varlen): fp16 gradients (fp32 for g and β) within FLA's tolerances of the gold."""
    gen = torch.Generator().manual_seed(5)
    lengths = [100, 0, 1, 700]
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    q, k, v = (torch.rand(1, cu[-1], 2, D, generator=gen).half() for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.rand(1, cu[-1], 2, generator=gen))
    beta = torch.rand(1, cu[-1], 2, generator=gen)
    h0 = torch.randn(len(lengths), 2, D, D, generator=gen).half()
    do = torch.randn(v.shape, generator=gen).half()
    dht = torch.randn(h0.shape, generator=gen)
    cpu = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    leaves = {n: t.to(device).requires_grad_() for n, t in cpu.items()}
    o, ht = cute_kda.chunk_gated_delta_rule(**leaves, scale=0.1, output_final_state=True, cu_seqlens=cu.to(device),
                                            use_qk_l2norm_in_kernel=True)
    torch.autograd.backward([o, ht], [do.to(device), dht.to(device, ht.dtype)])
    want = gold_backward(q, k, v, g, beta, do, dht=dht, initial_state=h0, gate="none", scale=0.1, qk_l2norm=True,
                         beta_logits=False, state_layout="kv", cu_seqlens=cu)
    names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0")
    errors = {names[n]: rel_rms(leaf.grad.cpu(), want[names[n]]) for n, leaf in leaves.items()}
    print(f"[fp16 GatedDeltaNet vs gold] " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert [leaves[n].grad.dtype for n in cpu] == [FP16, FP16, FP16, FP32, FP32, FP16]
    assert all(e <= TARGETS[n] for n, e in errors.items()), errors


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_fp16_keeps_what_bf16_keeps_under_recompute(recompute):
    """Between forward and backward an fp16 call keeps, whatever ``recompute`` says, what a bf16 call keeps under
    ``recompute``, byte for byte (the inputs as given, the initial state; no workspace, no checkpoints): the bf16
    copies are made in the backward only."""
    def saved(problem, recompute):
        kept = []

        def pack(t):
            kept.append(t)
            return t

        leaves = {n: x.detach().clone().requires_grad_() if x.is_floating_point() else x for n, x in problem.items()}
        tokens = [leaves.pop(n) for n in ("q", "k", "v", "g", "beta")]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            REFERENCE_FORWARD(*tokens, **leaves, output_final_state=True, recompute=recompute)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
        return [tuple(t.shape) for t in kept], sum(storages.values())

    half, _, _ = fp16_problem([20, 17])
    full = {n: x.bfloat16() if n in ("q", "k", "v", "g", "beta", "initial_state") else x for n, x in half.items()}
    assert saved(half, recompute) == saved(full, True)
