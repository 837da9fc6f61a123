"""The measured claim behind docs/numerics.md, "fp16 inputs" (CPU tier, ``scripts/fp16_accuracy.py``).

fp16 inputs drawn as FLA's chunk tests draw them, rounded to bf16 and run through the bf16 mirror, stay within FLA's
tolerance (o and final state 5e-3 rel-RMS against the fp64 gold on the fp16 values); the rounding of the inputs alone
is a large part of that error (what a K1 / K2 that widens fp16 exactly where it loads would not make); rounding an
fp32 β to bf16 where the call enters costs little; the mirror of the fp16 kernels (option 2 as built: fp16 widened
where bf16 is, o in fp16) is within FLA's tolerance too, with a smaller o error than the bf16 route; fp16 training
as built keeps every gradient within FLA's gradient tolerances.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FLA_TOLERANCE = 5e-3


def _script():
    spec = importlib.util.spec_from_file_location("fp16_accuracy", ROOT / "scripts" / "fp16_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gate, value_heads", [("none", 2), ("softplus", 2), ("head", 4)])
def test_fp16_inputs_through_bf16_stay_within_flas_tolerance(gate, value_heads):
    script = _script()
    case = script.Case(f"{gate} T256", 256, 2, value_heads, gate, 0.1, torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU mirror's intrinsics note
        measured = script.measure(case, seed=1)
    (o, state), (o_rounding, _) = measured["mirror"], measured["rounding"]
    assert o < FLA_TOLERANCE and state < FLA_TOLERANCE, measured
    assert 0.4 * o < o_rounding < o, measured  # the inputs' rounding: about half of the error (in quadrature)
    if "beta" in measured:  # fp32 β kept: a little better than rounded where it enters
        assert measured["beta"][0] <= o < 1.1 * measured["beta"][0], measured
    o_fp16, state_fp16 = measured["fp16"]
    assert o_fp16 < FLA_TOLERANCE and state_fp16 < FLA_TOLERANCE, measured
    assert o_fp16 < 0.9 * o, measured  # no rounding of the inputs, o's final rounding 8× finer


FLA_GRADIENT_TOLERANCE = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}


@pytest.mark.parametrize("gate, value_heads", [("softplus", 2), ("none", 2), ("head", 4)])
def test_fp16_training_stays_within_flas_gradient_tolerances(gate, value_heads):
    """docs/numerics.md, "fp16 training": against the fp64 gold gradients on the fp16 values, fp16 training as built
    (the training executor on the reference stages: the fp16 forward, then the bf16 call's backward on bf16 copies of
    dO, q, k, v, g, its forward recomputed on them) is within FLA's tolerances; it is the bf16 mirror of the whole
    backward on the inputs rounded where the call enters (to 1 %: the same chain), and the rounding of the inputs
    alone is part of its error."""
    script = _script()
    case = script.Case(f"{gate} T256", 256, 2, value_heads, gate, 0.1, torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        measured = script.measure_backward(case, seed=1)
    for name, (through_bf16, rounding, _, built) in measured.items():
        assert built < FLA_GRADIENT_TOLERANCE[name] and through_bf16 < FLA_GRADIENT_TOLERANCE[name], (name, measured)
        assert 0.3 * through_bf16 < rounding < through_bf16, (name, measured)
        assert abs(built - through_bf16) <= 0.01 * through_bf16, (name, measured)


def test_fp16_training_returns_fp16_gradients_and_recomputes_bit_identically():
    """Every gradient of an fp16 input is fp16 (dβ in β's dtype); ``recompute`` changes nothing (fp16 always
    recomputes, on the bf16 copies): the same gradients bit for bit."""
    script = _script()
    case = script.Case("softplus T100 fp16 state", 100, 2, 2, "softplus", 0.1, torch.float16)
    x = script.inputs(case, seed=2)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen).half()
    dht = torch.randn(x["initial_state"].shape, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kept, recomputed = (script.trained(x, do, dht, recompute=flag) for flag in (False, True))
    for name, grad in kept.items():
        assert grad.dtype == torch.float16, (name, grad.dtype)
        assert torch.equal(grad, recomputed[name]), name
