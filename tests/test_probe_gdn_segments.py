"""CPU checks of ``benchmarks/probe_gdn_segments.py``: its options, and that it refuses to time without CUDA."""

from __future__ import annotations

import argparse

import pytest

import bench_script


@pytest.fixture(scope="module")
def probe():
    return bench_script.load("probe_gdn_segments")


def test_options(probe):
    args = probe.build_parser().parse_args([])
    assert (args.shape, args.segments) == ("gdn_T32768_H16_HV32", [0, 4, 8])
    args = probe.build_parser().parse_args(["--shape", "gdn_T8192_H16_HV32", "--segments", "0,4"])
    assert (args.shape, args.segments) == ("gdn_T8192_H16_HV32", [0, 4])
    assert not args.disable_recompute and probe.build_parser().parse_args(["--disable-recompute"]).disable_recompute
    assert not (args.no_pair_training or args.no_states_only_passes or args.no_split_recompute)
    switched = probe.build_parser().parse_args(["--no-pair-training", "--no-states-only-passes"])
    assert switched.no_pair_training and switched.no_states_only_passes
    for bad in ("-1", "x", "4,"):
        with pytest.raises(argparse.ArgumentTypeError):
            probe.segment_counts(bad)


def test_switches_set_the_library_switches(probe, monkeypatch):
    """The flags the GatedDeltaNet scripts share with bench_train (``cute_kda._bench.SWITCHES``) set the library's
    switches they name, and only the ones given."""
    from cute_kda._bench import apply_switches
    from cute_kda.executors import stages
    from cute_kda.ops import bwd_grads

    for module, name in ((stages, "PAIR_TRAINING"), (stages, "STATES_ONLY_PASSES"), (bwd_grads, "GROUP_SUM")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    before = stages.STATES_ONLY_PASSES, bwd_grads.GROUP_SUM
    apply_switches(probe.build_parser().parse_args(["--no-pair-training"]), probe.GDN_SWITCHES)
    assert not stages.PAIR_TRAINING and (stages.STATES_ONLY_PASSES, bwd_grads.GROUP_SUM) == before
    apply_switches(probe.build_parser().parse_args(["--no-group-sum", "--no-states-only-passes"]), probe.GDN_SWITCHES)
    assert not stages.STATES_ONLY_PASSES and not bwd_grads.GROUP_SUM


def test_refuses_to_time_without_cuda(probe, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main([])
