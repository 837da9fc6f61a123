"""cute_kda as a backend of FLA's ``chunk_kda`` and ``chunk_gated_delta_rule`` (``cute_kda/fla_backend.py``).

CPU tier: the verifier on its own (grad, device, every refusal of the translation, the call FLA's
``KimiDeltaAttention`` layer makes), the hand-over of the verifier's translation to the
implementation, the logged reasons; registration through the import hook against a stand-in
``fla`` package in a fresh process (and ``import cute_kda`` never imports FLA); with the real FLA
importable (it needs triton), the registry's order, the opt-out and a dispatched call on the CPU
with the gold recurrence behind the kernels.

GPU tier: ``fla.ops.kda.chunk_kda`` dispatches to cute_kda (bit-equal to ``cute_kda.chunk_kda``),
falls back to FLA's kernels for a training call (reason logged) and with ``FLA_CUTE_KDA=0``; the same for
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, whose training calls stay with FLA (no per-head
backward yet).
"""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cute_kda
from cute_kda import api, fla_backend

from test_fla_compat import make_problem
from test_gdn import gdn_problem
from test_torch_compile import gold_kernels  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
D = 128


def layer_call(lengths=(40,), heads=2, device="cpu", **changes):
    """The arguments FLA's KimiDeltaAttention layer passes in chunk mode (safe gate, lower_bound -5)."""
    inputs = make_problem(list(lengths), heads, device=device)
    kwargs = dict(**inputs, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=True,
                  lower_bound=-5.0, state_v_first=True)
    kwargs.update(changes)
    return kwargs


@pytest.fixture
def any_device(monkeypatch):
    """Let the verifier take CPU tensors (the device rule is tested on its own)."""
    monkeypatch.setattr(fla_backend, "_device_reason", lambda q: None)


def test_layer_call_is_accepted(any_device):
    with torch.no_grad():
        assert fla_backend.verify(**layer_call()) == (True, None)
        assert fla_backend.verify(**layer_call([17, 40, 3], state_v_first=False, output_final_state=True)) == (True, None)


def test_int32_cu_seqlens_are_taken(any_device):
    """FLA's layers unpad a masked batch into int32 cu_seqlens: the verifier takes them (no silent fallback)."""
    kwargs = layer_call([17, 40, 3])
    kwargs["cu_seqlens"] = kwargs["cu_seqlens"].to(torch.int32)
    with torch.no_grad():
        assert fla_backend.verify(**kwargs) == (True, None)


def test_fp16_inference_and_training_are_taken(any_device):
    """FLA's chunk tests run fp16: the forward kernels take it (o in fp16) and so does the training path (the backward
    kernels on bf16 copies, gradients in fp16)."""
    kwargs = {n: x.half() if n in ("q", "k", "v", "g", "beta") else x for n, x in layer_call().items()}
    with torch.no_grad():
        assert fla_backend.verify(**kwargs) == (True, None)
    kwargs["q"].requires_grad_()
    assert fla_backend.verify(**kwargs) == (True, None)


def test_training_call_is_verified_like_an_inference_call(any_device):
    """cute_kda has a backward: inputs that require grad change nothing in the verdict."""
    kwargs = layer_call()
    kwargs["q"].requires_grad_()
    kwargs["A_log"].requires_grad_()
    verdict = fla_backend.verify(**kwargs)
    with torch.no_grad():
        assert fla_backend.verify(**kwargs) == verdict


def test_cpu_tensors_are_refused():
    with torch.no_grad():
        accepted, reason = fla_backend.verify(**layer_call())
    assert not accepted and "cpu" in reason and "CUDA" in reason


def test_non_hopper_gpu_is_refused(monkeypatch):
    import cute_kda.device

    monkeypatch.setattr(cute_kda.device, "capability", lambda index: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA B200")
    reason = fla_backend._device_rule(torch.device("cuda", 0))
    assert "sm_90a" in reason and "sm_100" in reason and "B200" in reason
    monkeypatch.setattr(cute_kda.device, "capability", lambda index: (9, 0))
    assert fla_backend._device_rule(torch.device("cuda", 1)) is None


REFUSED = {
    "negative eigenvalues": (dict(allow_neg_eigval=True), "allow_neg_eigval"),
    "intermediate states of packed sequences without cu_seqlens_cpu": ("packed_states", "cu_seqlens_cpu"),
    "context parallel": (dict(cp_context=object()), "cp_context"),
    "graph mode": (dict(use_graph=True), "use_graph"),
    "bf16 state": (dict(initial_state=torch.zeros(1, 2, D, D, dtype=torch.bfloat16)), "initial_state must be float32"),
    "bf16 and fp16 mixed": ("fp16_q", "k is bfloat16 but q is float16"),
    "head dim 256": ("dim256", "K (q.shape[-1]) = 256 is not supported"),
    "misaligned q": ("misaligned", "16-byte boundary"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_calls_cute_kda_does_not_compute_are_refused(any_device, case):
    changes, words = REFUSED[case]
    kwargs = layer_call()
    if changes == "fp16_q":
        kwargs["q"] = kwargs["q"].half()
    elif changes == "dim256":  # head dims up to 128 run padded (tests/test_head_dims.py); 256 is FLA's
        kwargs = {n: torch.cat([x, x], -1) if n in ("q", "k", "g") else x for n, x in kwargs.items()}
        kwargs["dt_bias"] = kwargs["dt_bias"].view(2, 1, D).expand(2, 2, D).reshape(-1)
    elif changes == "packed_states":
        kwargs = layer_call([17, 40], return_intermediate_states=True)
    elif changes == "misaligned":
        q = kwargs["q"]
        kwargs["q"] = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    else:
        kwargs.update(changes)
    with torch.no_grad():
        accepted, reason = fla_backend.verify(**kwargs)
    assert not accepted and words in reason, reason


UNBOUNDED_GATES = {"softplus gate": dict(lower_bound=None, safe_gate=False),
                   "precomputed decay": dict(use_gate_in_kernel=False)}


@pytest.mark.parametrize("case", sorted(UNBOUNDED_GATES))
def test_unbounded_gates_are_taken_for_training_too(any_device, case):
    """The softplus gate and a precomputed log decay per channel: inference and training calls are cute_kda's."""
    kwargs = layer_call(**UNBOUNDED_GATES[case])
    if case == "precomputed decay":
        kwargs["g"] = -torch.rand(kwargs["g"].shape)  # the log decay, fp32
    with torch.no_grad():
        assert fla_backend.verify(**kwargs) == (True, None)
    kwargs["k"].requires_grad_()
    assert fla_backend.verify(**kwargs) == (True, None)


def test_every_distinct_reason_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(fla_backend, "_logged_reasons", set())
    caplog.set_level(logging.INFO, logger="cute_kda.fla_backend")
    with torch.no_grad():
        for _ in range(3):
            fla_backend.verify(**layer_call())  # CPU: refused by device
        monkeypatch.setattr(fla_backend, "_device_reason", lambda q: None)
        fla_backend.verify(**layer_call(allow_neg_eigval=True))
    messages = [r.getMessage() for r in caplog.records if r.name == "cute_kda.fla_backend"]
    assert len(messages) == 2 and all("FLA computes it" in m for m in messages)


def test_implementation_reuses_the_verifiers_translation(any_device, gold_kernels, monkeypatch):
    kwargs = layer_call([9, 30], state_v_first=False, output_final_state=True,
                        initial_state=0.1 * torch.randn(2, 2, D, D))
    calls = []
    translate = api.translate_fla_call
    monkeypatch.setattr(api, "translate_fla_call", lambda *a, **k: calls.append(1) or translate(*a, **k))
    with torch.no_grad():
        assert fla_backend.verify(**kwargs) == (True, None)
        o, state = fla_backend.chunk_kda(**kwargs)
        expected = cute_kda.chunk_kda(**kwargs)
    assert len(calls) == 2  # once in the verifier, once for `expected`: the implementation reused it
    assert torch.equal(o, expected[0]) and torch.equal(state, expected[1]) and state.shape == (2, 2, D, D)
    with torch.no_grad():  # without a pending translation (or for another call) it translates itself
        fla_backend.chunk_kda(**kwargs)
    assert len(calls) == 3


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_backend_keeps_flas_recompute_choice(any_device, monkeypatch, disable_recompute):
    """FLA's ``disable_recompute`` reaches the forward as ``recompute`` through the backend as through
    ``cute_kda.chunk_kda`` (FLA's default False: keep nothing beyond the inputs for the backward)."""
    seen = []
    monkeypatch.setattr(api, "kda_forward", lambda *a, recompute=False, **k: seen.append(recompute) or (None, None))
    kwargs = layer_call([20], disable_recompute=disable_recompute)
    assert fla_backend.verify(**kwargs) == (True, None)
    fla_backend.chunk_kda(**kwargs)
    assert seen == [not disable_recompute]


@pytest.mark.parametrize("changes, recompute", [({}, True), (dict(disable_recompute=True), False)],
                         ids=["fla_default", "disable_recompute"])
def test_gdn_training_keeps_flas_memory_semantics(any_device, monkeypatch, changes, recompute):
    """FLA's ``chunk_gated_delta_rule`` keeps no states for its backward (it recomputes them), so neither does
    cute_kda's by default: the forward runs as ``kda_forward(recompute=True)``, through the backend as through
    ``cute_kda.chunk_gated_delta_rule``; ``disable_recompute=True`` (cute_kda's extension) keeps them."""
    seen = []
    monkeypatch.setattr(api, "kda_forward", lambda *a, recompute=False, **k: seen.append(recompute) or (None, None))
    problem = gdn_problem([20], raw_gate=True)
    assert fla_backend.verify_gdn(**problem, **changes) == (True, None)
    fla_backend.chunk_gated_delta_rule(**problem, **changes)
    cute_kda.chunk_gated_delta_rule(**problem, **changes)
    assert seen == [recompute, recompute]


def test_gdn_inference_and_training_calls_are_accepted(any_device):
    problem = gdn_problem([40, 9], raw_gate=True)
    with torch.no_grad():
        assert fla_backend.verify_gdn(**problem) == (True, None)
        assert fla_backend.verify_gdn(**gdn_problem([40], raw_gate=False)) == (True, None)
        problem_no_bias = dict(problem, dt_bias=None)
        assert fla_backend.verify_gdn(**problem_no_bias) == (True, None)
    problem["q"].requires_grad_()
    assert fla_backend.verify_gdn(**problem) == (True, None)  # the per-head gate trains (Kernel B per head)


@pytest.mark.parametrize("changes, words", [
    (dict(allow_neg_eigval=True), "allow_neg_eigval"),
    (dict(cp_context=object()), "cp_context"),
    (dict(chunk_size=128), "chunk_size"),
    (dict(made_up_flag=1), "made_up_flag"),
])
def test_gdn_refusals_name_the_flag(any_device, changes, words):
    with torch.no_grad():
        accepted, reason = fla_backend.verify_gdn(**gdn_problem([20]), **changes)
    assert not accepted and words in reason, reason


def test_gdn_implementation_reuses_the_verifiers_translation(any_device, gold_kernels, monkeypatch):
    problem = gdn_problem([9, 30], raw_gate=True)
    calls = []
    translate = api.translate_fla_gdn_call
    monkeypatch.setattr(api, "translate_fla_gdn_call", lambda *a, **k: calls.append(1) or translate(*a, **k))
    with torch.no_grad():
        assert fla_backend.verify_gdn(**problem) == (True, None)
        o, state = fla_backend.chunk_gated_delta_rule(**problem)
        expected = cute_kda.chunk_gated_delta_rule(**problem)
        assert len(calls) == 2  # once in the verifier, once for `expected`: the implementation reused it
        assert torch.equal(o, expected[0]) and torch.equal(state, expected[1])
        assert fla_backend.verify(**layer_call()) == (True, None)  # a chunk_kda translation pending ...
        fla_backend.chunk_gated_delta_rule(**problem)  # ... is not taken for this call
    assert len(calls) == 3


STUB_FLA = {
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "",
    "fla/ops/kda/__init__.py": "def chunk_kda(*args, **kwargs):\n    return 'fla'\n",
    "fla/ops/gated_delta_rule/__init__.py": "def chunk_gated_delta_rule(*args, **kwargs):\n    return 'fla'\n",
    "fla/backends.py": textwrap.dedent("""
        REGISTERED = []

        class BaseBackend:
            pass

        def register(entry_point):
            def decorator(implementation):
                REGISTERED.append((entry_point, implementation))
                return implementation
            return decorator
    """),
}

HOOK_CHECK = textwrap.dedent("""
    import sys
    sys.path[:0] = [{stub!r}, {root!r}]
    if {fla_first}:
        import fla.ops.kda
    import cute_kda
    from cute_kda import fla_backend
    fla_backend_hooked = lambda: fla_backend._HOOK in sys.meta_path
    assert {fla_first} or "fla" not in sys.modules, "import cute_kda imported FLA"
    import fla.ops.kda
    from fla.backends import REGISTERED
    (entry, cls), (operation, recurrent) = REGISTERED
    assert entry is fla.ops.kda.chunk_kda
    assert operation == "kda" and hasattr(recurrent(), "fused_recurrent_kda_fwd_verifier")
    assert recurrent.priority == cls.priority
    backend = cls()
    print(cls.backend_type, cls.priority, cls.env_var, cls.package_name, hasattr(backend, "chunk_kda_verifier"))
    import fla.ops.gated_delta_rule
    (_, _), (_, _), (entry, cls) = REGISTERED
    assert entry == "gated_delta_rule" and hasattr(cls(), "chunk_gated_delta_rule_verifier")
    print(cls.priority, fla_backend_hooked())
""")


@pytest.mark.parametrize("fla_first", [False, True], ids=["cute_kda_first", "fla_first"])
def test_import_hook_registers_with_fla(tmp_path, fla_first):
    for name, text in STUB_FLA.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    code = HOOK_CHECK.format(stub=str(tmp_path), root=str(ROOT), fla_first=fla_first)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cute_kda", "2", "FLA_CUTE_KDA", "cute_kda", "True", "4", "False"]


def test_importing_cute_kda_without_fla_works():
    code = ("import sys; import importlib.util as u; import cute_kda; from cute_kda import fla_backend; "
            "print(u.find_spec('fla') is None or 'fla' not in sys.modules, fla_backend.is_registered())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "True"


# ---------------------------------------------------------------------------------------------
# with the real FLA (needs triton): the registry


def _registry():
    fla_kda = pytest.importorskip("fla.ops.kda")
    backends = pytest.importorskip("fla.backends")
    return fla_kda, backends._function_registries[inspect.unwrap(fla_kda.chunk_kda)]


def test_real_registry_orders_cute_kda_before_flash_kda(monkeypatch):
    _, registry = _registry()
    order = [b.backend_type for b in registry._get_sorted_backends()]
    assert "cute_kda" in order
    if "flash_kda" in order:
        assert order.index("cute_kda") < order.index("flash_kda")
    ours = next(b for b in registry._get_sorted_backends() if b.backend_type == "cute_kda")
    monkeypatch.delenv("FLA_CUTE_KDA", raising=False)
    assert ours.is_available() and ours.is_enabled()
    monkeypatch.setenv("FLA_CUTE_KDA", "0")
    assert not ours.is_enabled()


def _gdn_registry():
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")
    backends = pytest.importorskip("fla.backends")
    return fla_gdn, backends._get_operation_registry("gated_delta_rule")


def test_real_gdn_registry_puts_cute_kda_behind_flash_qla(monkeypatch):
    _, registry = _gdn_registry()
    backends = registry._get_sorted_backends()
    order = [b.backend_type for b in backends]
    assert "cute_kda" in order
    if "flash_qla" in order:
        assert order.index("flash_qla") < order.index("cute_kda")
    ours = next(b for b in backends if b.backend_type == "cute_kda")
    assert ours.priority == fla_backend.GDN_PRIORITY
    monkeypatch.setenv("FLA_CUTE_KDA", "0")
    assert not ours.is_enabled()


def test_real_gdn_dispatch_reaches_cute_kda_on_the_cpu(any_device, gold_kernels, monkeypatch):
    fla_gdn, _ = _gdn_registry()
    monkeypatch.delenv("FLA_CUTE_KDA", raising=False)
    problem = gdn_problem([33])
    with torch.no_grad():
        o, state = fla_gdn.chunk_gated_delta_rule(**problem)
        expected = cute_kda.chunk_gated_delta_rule(**problem)
    assert len(gold_kernels) == 2 and torch.equal(o, expected[0]) and torch.equal(state, expected[1])


def test_real_dispatch_reaches_cute_kda_on_the_cpu(any_device, gold_kernels, monkeypatch):
    fla_kda, _ = _registry()
    monkeypatch.delenv("FLA_CUTE_KDA", raising=False)  # test_fla_compat (imported above) turns the dispatch off
    kwargs = layer_call([33])
    with torch.no_grad():
        o, state = fla_kda.chunk_kda(**kwargs)
        expected, _ = cute_kda.chunk_kda(**kwargs)
    assert len(gold_kernels) == 2 and state is None and torch.equal(o, expected)


# ---------------------------------------------------------------------------------------------
# GPU tier: live dispatch


# the entry points FLA and cute_kda share, by name: (FLA's module of it, the call's inputs on a device)
DISPATCHED = {
    "chunk_kda": (lambda: _registry()[0],
                  lambda device: layer_call([1300, 547, 2048], heads=4, device=device, output_final_state=True)),
    "chunk_gated_delta_rule": (lambda: _gdn_registry()[0], lambda device: gdn_problem([1300, 547, 2048], device=device)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(DISPATCHED))
def test_fla_dispatches_inference_to_cute_kda(device, monkeypatch, name):
    registry, inputs = DISPATCHED[name]
    fla_module = registry()
    monkeypatch.delenv("FLA_CUTE_KDA", raising=False)
    ran = []
    implementation = getattr(fla_backend, name)
    monkeypatch.setattr(fla_backend, name, lambda *a, **k: ran.append(1) or implementation(*a, **k))
    kwargs = inputs(device)
    with torch.no_grad():
        o, state = getattr(fla_module, name)(**kwargs)
        expected, expected_state = getattr(cute_kda, name)(**kwargs)
    torch.cuda.synchronize()
    assert ran == [1]
    assert torch.equal(o, expected) and torch.equal(state, expected_state)


@pytest.mark.gpu
def test_opt_out_runs_fla(device, monkeypatch):
    fla_kda, _ = _registry()
    ran = []
    monkeypatch.setattr(fla_backend, "chunk_kda", lambda *a, **k: ran.append(1))
    monkeypatch.setenv("FLA_CUTE_KDA", "0")
    with torch.no_grad():
        o, _ = fla_kda.chunk_kda(**layer_call([200], device=device))
    assert ran == [] and o.shape == (1, 200, 2, D)


@pytest.mark.gpu
def test_fla_dispatches_gdn_training_and_honours_the_opt_out(device, monkeypatch):
    fla_gdn, _ = _gdn_registry()
    monkeypatch.delenv("FLA_CUTE_KDA", raising=False)
    ran = []
    implementation = fla_backend.chunk_gated_delta_rule
    monkeypatch.setattr(fla_backend, "chunk_gated_delta_rule", lambda *a, **k: ran.append(1) or implementation(*a, **k))
    problem = gdn_problem([200], device=device, raw_gate=False)
    problem["v"].requires_grad_()
    o, _ = fla_gdn.chunk_gated_delta_rule(**problem)
    o.float().square().sum().backward()
    assert ran == [1] and problem["v"].grad is not None and problem["v"].grad.isfinite().all()
    monkeypatch.setenv("FLA_CUTE_KDA", "0")
    problem["v"].requires_grad_(False)
    with torch.no_grad():
        o, _ = fla_gdn.chunk_gated_delta_rule(**problem)
    assert ran == [1] and o.shape == (1, 200, 4, D)


@pytest.mark.gpu
@pytest.mark.fla
def test_fla_layer_on_a_padded_batch_runs_on_cute_kda(device, monkeypatch):
    """FLA's KimiDeltaAttention on a right-padded batch (``attention_mask``): FLA unpads it into int32 cu_seqlens;
    the call goes to cute_kda (counted) and the valid tokens' outputs agree with FLA's kernels (FLA_CUTE_KDA=0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kda_layer_example", ROOT / "examples" / "kda_layer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    layer = example.build_layer(hidden=512, heads=4)
    lengths = (96, 61, 17)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    x = torch.randn(len(lengths), max(lengths), 512, device=device, dtype=torch.bfloat16)
    ran = []
    implementation = fla_backend.chunk_kda
    monkeypatch.setattr(fla_backend, "chunk_kda",
                        lambda *a, **k: ran.append(fla_backend._bind(a, k).get("cu_seqlens")) or implementation(*a, **k))
    with torch.no_grad():
        monkeypatch.setenv("FLA_CUTE_KDA", "0")
        expected = layer(x, attention_mask=mask)[0]
        assert ran == []
        monkeypatch.delenv("FLA_CUTE_KDA")
        got = layer(x, attention_mask=mask)[0]
    assert len(ran) == 1 and ran[0] is not None and ran[0].dtype == torch.int32
    valid = mask.bool()
    error = ((got[valid].float() - expected[valid].float()).square().mean().sqrt()
             / expected[valid].float().square().mean().sqrt()).item()
    print(f"[fla layer, padded batch] rel-RMS against FLA's kernels {error:.2e}")
    assert error <= 1e-2
