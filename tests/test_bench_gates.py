"""CPU checks of ``benchmarks/bench_gates.py``: its rows, its inputs for each gate form, the table."""

from __future__ import annotations

import pytest
import torch

import bench_script


@pytest.fixture(scope="module")
def bench():
    return bench_script.load("bench_gates")


def test_rows_cover_kimi_linear_and_the_log_decay(bench):
    assert set(bench.ROWS) == set(bench.ALL_SHAPES)
    assert {bench.ROWS[name] for name in bench.KIMI_SHAPES} == {"softplus"}
    assert all(bench.ALL_SHAPES[name].heads == 32 for name in bench.KIMI_SHAPES)
    assert bench.ROWS["B1_T8192_H96"] == "log_decay"
    assert {bench.ROWS[name] for name in bench.GDN_SHAPES} == {"gdn_softplus", "gdn_log_decay"}


def test_gdn_inputs_are_a_chunk_gated_delta_rule_call(bench, monkeypatch):
    import inspect

    from cute_kda.api import chunk_gated_delta_rule

    monkeypatch.setitem(bench.GDN_SHAPES, "tiny", ((20, 9), 2, 4))
    for gate in ("gdn_softplus", "gdn_log_decay"):
        kwargs = bench.gate_inputs("tiny", gate, torch.device("cpu"))
        inspect.signature(chunk_gated_delta_rule).bind(**kwargs)
        assert kwargs["g"].shape == (1, 29, 4) and kwargs["v"].shape[2] == 4 and kwargs["q"].shape[2] == 2
        assert (gate == "gdn_log_decay") == (kwargs["g"].dtype == torch.float32)


def test_inputs_per_gate(bench, monkeypatch):
    small = bench.ALL_SHAPES["kimi_varlen6_H32"].__class__((40, 9), 2, varlen=True)
    monkeypatch.setitem(bench.ALL_SHAPES, "tiny", small)
    softplus = bench.gate_inputs("tiny", "softplus", torch.device("cpu"))
    assert softplus["g"].dtype == torch.bfloat16 and softplus["A_log"].exp().min() >= 1
    log_decay = bench.gate_inputs("tiny", "log_decay", torch.device("cpu"))
    assert log_decay["g"].dtype == torch.float32 and (log_decay["g"] <= 0).all()
    assert log_decay["A_log"] is None and log_decay["dt_bias"] is None
    # the log decay is the softplus gate of the same raw inputs
    x = softplus["g"].float() + softplus["dt_bias"]
    torch.testing.assert_close(log_decay["g"], -softplus["A_log"].exp()[:, None] * torch.nn.functional.softplus(x))


def test_table(bench):
    rows = [dict(shape="kimi_T4096_H32", gate="softplus", ms={"cute_kda": 0.5, "FLA chunk_kda": 1.0},
                 err=(1e-3, 2e-3)),
            dict(shape="B1_T8192_H96", gate="log_decay", ms={"cute_kda": 1.0}, err=None)]
    table = bench.markdown(rows).splitlines()
    assert "2.00×" in table[2] and "1.0e-03 / 2.0e-03" in table[2]
    assert table[3].count("—") == 3


def test_train_table_reports_a_peer_that_cannot_train(bench):
    rows = [dict(shape="gdn_T8192_H16_HV32", gate="gdn_softplus", ms={"cute_kda": 2.0, "FLA chunk_kda": 4.0},
                 err=(3e-3, 4e-3), notes={}),
            dict(shape="gdn_varlen6_H16_HV32", gate="gdn_log_decay", ms={"cute_kda": 1.5}, err=None,
                 notes={"FLA chunk_kda": "RuntimeError: refused"})]
    table = bench.train_markdown(rows).splitlines()
    assert "0.50×" in table[2] and "3.0e-03 / 4.0e-03" in table[2]
    assert "FLA chunk_kda: RuntimeError: refused" in table[3] and "1.500" in table[3]


def test_train_steps_on_the_cpu_through_a_stand_in(bench, monkeypatch):
    """``train_row``'s step on the CPU: every floating input a leaf, fwd+bwd per call, a raising peer noted."""
    monkeypatch.setitem(bench.GDN_SHAPES, "tiny", ((20,), 1, 2))
    monkeypatch.setitem(bench.ROWS, "tiny", "gdn_softplus")

    def differentiable(**kwargs):
        o = kwargs["v"] * kwargs["q"].sum() + kwargs["g"].sum() + kwargs["A_log"].sum() + kwargs["dt_bias"].sum()
        return o, kwargs["initial_state"] * kwargs["beta"].sum()

    def refuses(**kwargs):
        raise RuntimeError("no backward here")

    monkeypatch.setattr(bench, "peers", lambda inputs, gate, train, **_: {"cute_kda": lambda: differentiable(**inputs),
                                                               "FLA chunk_kda": lambda: refuses(**inputs)})
    monkeypatch.setattr(bench, "median_ms", lambda fn, warmup, rep: (fn(), 1.25)[1])
    row = bench.train_row("tiny", "gdn_softplus", torch.device("cpu"), 1, 1)
    assert row["ms"] == {"cute_kda": 1.25} and row["notes"]["FLA chunk_kda"].startswith("RuntimeError")


def test_train_row_with_fla_unguarded_times_without_comparing(bench, monkeypatch):
    """With FLA's Triton guard off its gradients are not trusted: timed, noted, no rel-RMS."""
    monkeypatch.setitem(bench.GDN_SHAPES, "tiny", ((20,), 1, 2))
    monkeypatch.setitem(bench.ROWS, "tiny", "gdn_softplus")

    def differentiable(**kwargs):
        return kwargs["v"] * kwargs["q"].sum(), kwargs["initial_state"] * kwargs["beta"].sum()

    monkeypatch.setattr(bench, "peers", lambda inputs, gate, train, **_: {"cute_kda": lambda: differentiable(**inputs),
                                                               "FLA chunk_kda": lambda: differentiable(**inputs)})
    monkeypatch.setattr(bench, "median_ms", lambda fn, warmup, rep: (fn(), 1.25)[1])
    row = bench.train_row("tiny", "gdn_softplus", torch.device("cpu"), 1, 1, fla_note="guard off: speed only")
    assert row["ms"] == {"cute_kda": 1.25, "FLA chunk_kda": 1.25} and row["err"] is None
    assert "FLA chunk_kda: guard off: speed only" in bench.train_markdown([row])


def test_peers_option_times_only_the_named_peers(bench, monkeypatch):
    """``--peers cute_kda`` leaves FLA's call out of a row (its first step may autotune for minutes)."""
    monkeypatch.setitem(bench.GDN_SHAPES, "tiny", ((20,), 1, 2))
    monkeypatch.setitem(bench.ROWS, "tiny", "gdn_softplus")

    def differentiable(**kwargs):
        return kwargs["v"] * kwargs["q"].sum(), kwargs["initial_state"] * kwargs["beta"].sum()

    def never(**kwargs):
        raise AssertionError("FLA was called")

    monkeypatch.setattr(bench, "peers", lambda inputs, gate, train, **_: {"cute_kda": lambda: differentiable(**inputs),
                                                               "FLA chunk_kda": lambda: never(**inputs)})
    monkeypatch.setattr(bench, "median_ms", lambda fn, warmup, rep: (fn(), 1.25)[1])
    row = bench.train_row("tiny", "gdn_softplus", torch.device("cpu"), 1, 1, only=("cute_kda",))
    assert row["ms"] == {"cute_kda": 1.25} and row["notes"] == {}


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_gdn_peer_recomputes_as_fla_unless_told(bench, monkeypatch, disable_recompute):
    """cute_kda's GatedDeltaNet call keeps FLA's semantics (no states kept for the backward) unless
    ``--gdn-disable-recompute`` passes cute_kda's ``disable_recompute=True``."""
    import cute_kda

    seen = []
    monkeypatch.setattr(cute_kda, "chunk_gated_delta_rule", lambda **kwargs: seen.append(kwargs))
    bench.gdn_peers({"q": None}, disable_recompute)["cute_kda"]()
    assert seen == [{"q": None, **({"disable_recompute": True} if disable_recompute else {})}]


def test_training_peers_let_autograd_allocate(bench, monkeypatch):
    """A KDA row's cute_kda call under ``--train`` asks for the final state instead of passing out= buffers."""
    import cute_kda

    small = bench.ALL_SHAPES["kimi_varlen6_H32"].__class__((40, 9), 2, varlen=True)
    monkeypatch.setitem(bench.ALL_SHAPES, "tiny", small)
    inputs = bench.gate_inputs("tiny", "softplus", torch.device("cpu"))
    calls = []
    monkeypatch.setattr(cute_kda, "kda_forward", lambda *tensors, **kwargs: calls.append(kwargs))
    for train in (False, True):
        bench.peers(inputs, "softplus", train=train)["cute_kda"]()
    inference, training = calls
    assert "out" in inference and "out" not in training and training["output_final_state"]
