"""CPU checks of ``benchmarks/probe_step_host.py``: its options, and that it refuses to time without CUDA."""

from __future__ import annotations

import argparse
import importlib

import pytest

import bench_script


@pytest.fixture(scope="module")
def probe():
    return bench_script.load("probe_step_host")


def test_options(probe):
    args = probe.build_parser().parse_args([])
    assert (args.shape, args.segments, args.steps, args.out) == ("B1_T32768_H16", [None, 1], 10, None)
    args = probe.build_parser().parse_args(["--shape", "B1_T8192_H96", "--segments", "auto, 8", "--steps", "3"])
    assert (args.shape, args.segments, args.steps, args.cprofile) == ("B1_T8192_H96", [None, 8], 3, None)
    assert probe.build_parser().parse_args(["--cprofile", "5"]).cprofile == 5
    assert (args.head_dim, probe.build_parser().parse_args(["--head-dim", "64"]).head_dim) == (128, 64)
    for bad in ("0", "x", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            probe.parse_segments(bad)
    assert [probe.label(s) for s in (None, 4)] == ["heuristic", "segments=4"]


def test_refuses_to_time_without_cuda(probe, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main([])


def double(x):
    """What the wrapper tests wrap: a result, or an exception for a negative ``x``."""
    if x < 0:
        raise ValueError("negative")
    return 2 * x


def check_wrapped(wrapped) -> None:
    """``wrapped`` (a wrapper of :func:`double`) keeps the name, passes the result and the exception on."""
    assert wrapped(3) == 6 and wrapped.__name__ == "double"
    with pytest.raises(ValueError, match="negative"):
        wrapped(-1)


def test_timers_count_calls_and_time(probe):
    """``--timers``: a wrapped function is timed inclusively and counted, its result and exceptions passed on."""
    assert not probe.build_parser().parse_args([]).timers and probe.build_parser().parse_args(["--timers"]).timers
    timers = probe.HostTimers()

    check_wrapped(timers.wrap("double", double))
    seconds, calls = timers.snapshot()["double"]
    assert calls == 2 and seconds >= 0.0


def test_launch_stamps_mark_in_order(probe):
    """``--launch-times``: a stamped function marks its entry and exit in host order from the step's start, its result
    and exceptions passed on; the table keeps the steps whose events came in the first step's order."""
    assert probe.build_parser().parse_args(["--launch-times"]).launch_times
    stamps = probe.LaunchStamps()

    stamps.begin()
    check_wrapped(stamps.wrap("double", double))
    events = [event for event, _ in stamps.stamps]
    assert events == ["double in", "double out", "double in", "double out"]
    times = [us for _, us in stamps.stamps]
    assert times == sorted(times) and times[0] >= 0.0
    steps = [[("a", 1.0), ("b", 5.0)], [("a", 3.0), ("b", 7.0)], [("a", 100.0)], [("a", 2.0), ("b", 6.0)]]
    assert probe.launch_rows(steps) == [["`a`", "2.0"], ["`b`", "6.0"]]
    for module, name in probe.STAMPED:  # each stamped function exists where the probe looks for it
        assert callable(getattr(importlib.import_module(module), name)), (module, name)


def test_wrappers_reach_every_namespace_and_each_compiled_kernel_once(probe, monkeypatch):
    """``install_wrappers`` replaces a function in every loaded cute_kda namespace that holds it (and nowhere else);
    ``wrap_compiled`` makes the compile cache hand out one wrapper a compiled kernel, named by its cache."""
    import types

    from cute_kda.ops._cache import CompileCache

    holder, other = types.ModuleType("cute_kda._probe_holder"), types.ModuleType("elsewhere_probe_holder")
    holder.double = other.double = double
    monkeypatch.setitem(probe.sys.modules, holder.__name__, holder)
    monkeypatch.setitem(probe.sys.modules, other.__name__, other)
    wrapper = probe.LaunchStamps().wrap("double", double)
    probe.install_wrappers({double: wrapper})
    assert holder.double is wrapper and other.double is double

    monkeypatch.setattr(CompileCache, "get", lambda cache, key, build: build())
    made = []
    probe.wrap_compiled(lambda name, compiled: made.append(name) or (lambda *args: (name, compiled(*args))))
    cache = CompileCache("probe_test")
    first, again = cache.get("k", lambda: double), cache.get("k", lambda: double)
    assert first is again and made == ["probe_test"] and first(3) == ("probe_test", 6)
