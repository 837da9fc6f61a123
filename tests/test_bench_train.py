"""CPU checks of ``benchmarks/bench_train.py``: its options, ratios, kernel grouping, the saved-bytes
counter on toy autograd Functions, the report, and one whole shape through ``bench_shape`` with toy
peers standing in for cute_kda and FLA (the GPU calls replaced)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

import bench_script
from bench_script import BENCHMARKS



@pytest.fixture(scope="module")
def bench():
    return bench_script.load("bench_train")


# ---------------------------------------------------------------------------------------------
# options


def test_options(bench):
    args = bench.build_parser().parse_args([])
    assert args.shapes == list(bench.SHAPES) and len(args.shapes) == 6
    assert (args.peers, args.steps, args.warmup, args.no_profile, args.out) == ("fla", 20, 3, False, None)
    args = bench.build_parser().parse_args(
        ["--shapes", " B1_T32768_H16,varlen6_H96,B1_T32768_H16 ", "--peers", "none", "--steps", "7", "--warmup", "1",
         "--no-profile", "--out", "/tmp/x.md"])
    assert args.shapes == ["B1_T32768_H16", "varlen6_H96"]  # order kept, duplicate dropped
    assert (args.peers, args.steps, args.warmup, args.no_profile, args.out) == ("none", 7, 1, True, "/tmp/x.md")
    assert args.segments is None and bench.build_parser().parse_args(["--segments", "1"]).segments == 1
    assert not args.no_gate_ahead and bench.build_parser().parse_args(["--no-gate-ahead"]).no_gate_ahead
    assert not args.split_load and bench.build_parser().parse_args(["--split-load"]).split_load
    assert not args.split_rows and bench.build_parser().parse_args(["--split-rows"]).split_rows
    assert not args.fp16_grad_stores and bench.build_parser().parse_args(["--fp16-grad-stores"]).fp16_grad_stores
    assert not args.fp16_copy_backward
    assert bench.build_parser().parse_args(["--fp16-copy-backward"]).fp16_copy_backward
    assert not args.no_slopes_ahead and bench.build_parser().parse_args(["--no-slopes-ahead"]).no_slopes_ahead
    assert not args.no_fp16_do_kernel
    assert bench.build_parser().parse_args(["--no-fp16-do-kernel"]).no_fp16_do_kernel


@pytest.mark.parametrize("argv", [["--shapes", "B1_T1_H1"], ["--shapes", ","], ["--steps", "0"], ["--warmup", "x"],
                                  ["--peers", "flashkda"], ["--profile"]])
def test_bad_options_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.build_parser().parse_args(argv)
    assert exit_info.value.code == 2


def test_default_out(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert Path(bench.default_out()).parent == tmp_path and Path(bench.default_out()).name.startswith("train-")
    monkeypatch.delenv("OUT")
    assert Path(bench.default_out()).parent == BENCHMARKS / "results"


def test_commit(bench, monkeypatch):
    monkeypatch.setenv("CUTE_KDA_COMMIT", "abc1234")
    assert bench.commit() == "abc1234"
    monkeypatch.delenv("CUTE_KDA_COMMIT")
    assert bench.commit()  # the checkout's HEAD, or "unknown" without git


def test_refuses_to_time_without_cuda(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--shapes", "B1_T8192_H96", "--peers", "none"])


def test_help_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_train.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(option in done.stdout for option in ("--shapes", "--peers", "--steps", "--warmup", "--no-profile"))


# ---------------------------------------------------------------------------------------------
# arithmetic


def test_ratio_and_goal(bench):
    assert bench.ratio(1.0, 4.0) == 0.25
    assert bench.ratio(None, 1.0) is None and bench.ratio(1.0, None) is None and bench.ratio(1.0, 0.0) is None
    assert bench.goal_cell(0.35) == "met" and bench.goal_cell(0.25) == "met"
    assert bench.goal_cell(0.42) == "not met (1.20× over)"
    assert bench.goal_cell(0.75, goal=0.5) == "not met (1.50× over)"
    assert bench.goal_cell(None) == "—"


KERNELS = [  # (name, total µs over 2 steps, launches over 2 steps)
    ("kernel_cute_kdakernelsfwd_preparePrepareKernel_object_at__Tensorgmemo1_0", 200.0, 2),
    ("kernel_cute_kdakernelstile_prefixTilePrefixKernel_object_at__0", 10.0, 2),
    ("kernel_cute_kdakernelsfwd_recurrenceFwdRecurrence_object_at__1", 1000.0, 2),
    ("kernel_cute_kdakernelsbwd_scanBwdScan_object_at__2", 1600.0, 2),
    ("kernel_cute_kdakernelsbwd_gradsBwdGrads_object_at__3", 800.0, 2),
    ("kernel_cutlass_something_new_0", 4.0, 2),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 30.0, 6),
    ("Memset (Device)", 6.0, 4),
]


def test_classify_kernel(bench):
    groups = [bench.classify_kernel(name) for name, _, _ in KERNELS]
    assert groups == ["K1 prepare", "K1 prepare", "K2 training", "Kernel A", "Kernel B", "other cute_kda",
                      "torch glue", "torch glue"]
    assert bench.GROUPS[-1] == bench.GLUE == "torch glue"


def test_kernel_breakdown(bench):
    parts = bench.kernel_breakdown(KERNELS, steps=2)
    assert list(parts) == list(bench.GROUPS)
    assert parts["K1 prepare"] == pytest.approx((0.105, 2.0))
    assert parts["K2 training"] == pytest.approx((0.5, 1.0))
    assert parts["Kernel A"] == pytest.approx((0.8, 1.0))
    assert parts["Kernel B"] == pytest.approx((0.4, 1.0))
    assert parts["other cute_kda"] == pytest.approx((0.002, 1.0))
    assert parts["torch glue"] == pytest.approx((0.018, 5.0))
    empty = bench.kernel_breakdown([], steps=5)
    assert all(value == (0.0, 0.0) for value in empty.values()) and list(empty) == list(bench.GROUPS)


def test_top_kernels(bench):
    top = bench.top_kernels(KERNELS, steps=2, n=3)
    assert [(group, ms, calls) for _, group, ms, calls in top] == [
        ("Kernel A", pytest.approx(0.8), 1.0), ("K2 training", pytest.approx(0.5), 1.0),
        ("Kernel B", pytest.approx(0.4), 1.0)]
    assert len(bench.top_kernels(KERNELS, steps=2)) == bench.TOP_KERNELS


def test_agreement(bench):
    ours = {"o": torch.ones(4), "ht": torch.ones(2), "q": torch.ones(3), "k": torch.ones(3)}
    theirs = {"o": torch.ones(4), "ht": 2 * torch.ones(2), "q": torch.ones(5), "dt_bias": torch.ones(1)}
    from cute_kda.reference import rel_rms

    result = bench.agreement(ours, theirs, rel_rms)
    assert result == {"o": 0.0, "ht": pytest.approx(0.5)}  # q: shapes differ, left out; k, dt_bias: one side only


# ---------------------------------------------------------------------------------------------
# saved bytes


class Views(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


@dataclasses.dataclass
class Holder:
    buffer: torch.Tensor
    label: str = "x"


class Toy(torch.autograd.Function):
    """Saves its input and one intermediate; keeps more as ctx attributes, the way a Function may
    keep its workspace: a plain tensor, two views of one flat buffer, a dataclass, a nested object,
    and a second reference to a saved tensor (which must not count twice)."""

    @staticmethod
    def forward(ctx, x):
        y = x * 3
        ctx.save_for_backward(x, y)
        flat = torch.zeros(100, dtype=torch.uint8)
        ctx.plain = torch.zeros(10)                                       # 40 B
        ctx.views = Views(flat[:50].view(torch.float16), flat[50:])     # one storage: 100 B
        ctx.holder = Holder(torch.zeros(3, dtype=torch.float64))         # 24 B
        ctx.nested = SimpleNamespace(inner={"deep": [torch.zeros(2)]})  # 8 B
        ctx.again = y                                                    # already saved
        ctx.scalar, ctx.flag, ctx.none = 0.5, True, None
        return y * 2

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * 6


CTX_ONLY = 40 + 100 + 24 + 8


def test_ctx_tensors_finds_every_attribute(bench):
    x = torch.ones(4, requires_grad=True)
    out = Toy.apply(x)
    found = bench.ctx_tensors([out.grad_fn, None])
    assert sum(bench.storages(found).values()) == CTX_ONLY + 16  # + y, kept twice, counted once
    assert bench.ctx_tensors([None]) == []
    plain = (x * 2).sigmoid()  # C++ nodes only: no attributes to read
    assert bench.ctx_tensors([plain.grad_fn]) == []


def test_saved_for_backward_toy(bench):
    x = torch.ones(4, requires_grad=True)  # 16 B
    other = torch.ones(8, requires_grad=True)  # 32 B, not saved

    def forward():
        s = torch.sigmoid(x)  # saves its result: 16 B beyond the inputs
        return Toy.apply(s) + other[:4], other * 1.0  # Toy saves s (the sigmoid's result) and y = 3 s (16 B)

    saved = bench.saved_for_backward(forward, [x, other])
    assert saved.total == 16 + 16 + CTX_ONLY  # s, y, ctx attributes; x and other are not saved by anyone
    assert saved.inputs == 0 and saved.ctx_only == CTX_ONLY and saved.beyond_inputs == saved.total

    def forward_saving_inputs():
        return x * other[:4], other.exp()  # mul saves both inputs (other's whole storage); exp saves its result

    saved = bench.saved_for_backward(forward_saving_inputs, [x, other])
    assert (saved.total, saved.inputs, saved.ctx_only, saved.beyond_inputs) == (16 + 32 + 32, 48, 0, 32)


def test_saved_tensors_leaves_the_backward_alone(bench):
    x = torch.arange(4.0, requires_grad=True)
    with bench.SavedTensors() as saved:
        y = (x * x).sum()
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach()) and len(saved.tensors) == 2
    z = (x * x).sum()  # outside the context: not recorded
    z.backward()
    assert len(saved.tensors) == 2


def test_count_saved(bench):
    base = torch.zeros(64, dtype=torch.uint8)
    given, extra = torch.zeros(8), torch.zeros(2)  # 32 B, 8 B
    saved = bench.count_saved([base[:4], base[10:], given], [extra, base[5:9], given[1:]], [given])
    assert (saved.total, saved.inputs, saved.ctx_only) == (64 + 32 + 8, 32, 8)


# ---------------------------------------------------------------------------------------------
# report


def _rows(bench):
    saved = bench.SavedBytes(total=3_000_000, inputs=1_000_000, ctx_only=500_000)
    fla_saved = bench.SavedBytes(total=9_000_000, inputs=1_000_000, ctx_only=0)
    breakdown = bench.kernel_breakdown(KERNELS, steps=2)
    measured = dict(
        shape="B1_T8192_H96", input_bytes=1_500_000, agreement={"o": 1e-3, "ht": 2e-4, "q": 3e-3},
        peers={"cute_kda": dict(note="", step_ms=2.0, fwd_ms=0.8, peak_bytes=4_000_000, retained_bytes=1_000_000,
                                saved=saved),
               "FLA": dict(note="", step_ms=5.0, fwd_ms=1.6, peak_bytes=16_000_000, retained_bytes=1_000_000,
                           saved=fla_saved)},
        breakdown=breakdown, top=bench.top_kernels(KERNELS, steps=2, n=2))
    failed = dict(shape="B1_T32768_H16", input_bytes=2_000_000, agreement={},
                  peers={"cute_kda": dict(note="step: NotImplementedError: no backward"),
                         "FLA": dict(note="", step_ms=3.0, fwd_ms=1.0, peak_bytes=8_000_000, retained_bytes=2_000_000,
                                     saved=fla_saved)})
    alone = dict(shape="B1_T8192_H64", input_bytes=1_000_000, agreement={},
                 peers={"cute_kda": dict(note="", step_ms=1.0, fwd_ms=0.5, peak_bytes=2_000_000,
                                         retained_bytes=1_000_000, saved=saved)})
    return [measured, failed, alone]


def test_report(bench):
    text = bench.report(_rows(bench), "python benchmarks/bench_train.py", "ENV", "abc1234", steps=20, warmup=3)
    lines = text.splitlines()
    assert lines[0].startswith("# Training step")
    assert lines[2] == "Command: `python benchmarks/bench_train.py` · commit `abc1234`"
    assert lines[4].startswith("ENV · D=128") and "medians of 20 CUDA-event-timed steps after 3 warm-up" in lines[4]
    assert "| B1_T8192_H96 | 2.000 | 5.000 | 0.40× | not met (1.14× over) | 0.800 | 1.600 | 0.50× | — |" in lines
    assert ("| B1_T32768_H16 | — | 3.000 | — | — | — | 1.000 | — | cute_kda: step: NotImplementedError: "
            "no backward |") in lines
    assert "| B1_T8192_H64 | 1.000 | — | — | — | 0.500 | — | — | — |" in lines
    # memory: per peer; ratios on cute_kda's row: beyond inputs 2.0 / 8.0 MB, peak 4 / 16 MB
    assert "| B1_T8192_H96 | cute_kda | 1.5 | 3.0 | 1.0 | 2.0 | 0.5 | 4.0 | 1.0 | 0.25× | 0.25× |" in lines
    assert "| B1_T8192_H96 | FLA | 1.5 | 9.0 | 1.0 | 8.0 | 0.0 | 16.0 | 1.0 |  |  |" in lines
    assert "| B1_T32768_H16 | cute_kda | 2.0 | — | — | — | — | — | — | — | — |" in lines
    assert "| B1_T8192_H64 | cute_kda | 1.0 | 3.0 | 1.0 | 2.0 | 0.5 | 2.0 | 1.0 | — | — |" in lines
    # breakdown: one row, the shape that was profiled; Σ = 1.825 ms of kernels against a 2.000 ms median
    row = next(line for line in lines if line.startswith("| B1_T8192_H96 | 0.105 (2) |"))
    assert row == ("| B1_T8192_H96 | 0.105 (2) | 0.500 (1) | 0.800 (1) | 0.400 (1) | 0.002 (1) | 0.018 (5) | "
                   "1.825 | 2.000 |")
    assert any(line.startswith("| B1_T8192_H96 | `kernel_cute_kdakernelsbwd_scanBwdScan") and
               line.endswith("| Kernel A | 0.800 | 1 |") for line in lines)
    assert "| B1_T8192_H96 | 1.0e-03 | 2.0e-04 | 3.0e-03 | — | — | — | — | — | — | — |" in lines
    header = next(line for line in lines if line.startswith("| shape | o | ht |"))
    assert header == "| shape | o | ht | dq | dk | dv | dg | dbeta | dA_log | ddt_bias | dh0 |"


def test_report_without_measurements(bench):
    text = bench.report([], "cmd", "ENV", "sha", steps=1, warmup=1)
    assert "Heaviest kernels" not in text and "Agreement" not in text and text.endswith("\n")


# ---------------------------------------------------------------------------------------------
# one shape end to end on the CPU, toy peers


class Kept(torch.autograd.Function):
    """Identity that keeps a buffer as a ctx attribute (as a workspace would be)."""

    @staticmethod
    def forward(ctx, x):
        ctx.workspace = torch.zeros(1000, dtype=torch.uint8)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def toy_chunk_kda(q, k, v, g, beta, *, scale, initial_state, A_log, dt_bias, lower_bound, cu_seqlens=None,
                  cu_seqlens_cpu=None, state_v_first=True, keep=False, **flags):
    """Not KDA: a cheap differentiable function of every input with FLA's signature and output shapes."""
    assert state_v_first and flags["output_final_state"] and flags["use_beta_sigmoid_in_kernel"]
    assert dt_bias.dim() == 1 and A_log.dim() == 1  # FLA's [H*K] and [H]
    heads, dim = q.shape[2], q.shape[3]
    assert (cu_seqlens is None) == (cu_seqlens_cpu is None) and len(initial_state) == (
        q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1)
    gate = lower_bound * torch.sigmoid(A_log.exp()[:, None] * (g.float() + dt_bias.view(heads, dim)))
    o = v.float() * torch.sigmoid(beta.float())[..., None] + scale * q.float() * k.float() * gate
    ht = initial_state * A_log.sum() + gate.sum(dim=(0, 1))[None, :, None, :]  # the mul saves initial_state
    if keep:
        o = Kept.apply(o)
    return o.to(v.dtype), ht


def _fake_cuda(bench, monkeypatch):
    memory = {"now": 0}
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(bench.torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(bench.torch.cuda, "memory_allocated", lambda *a, **k: memory["now"])
    monkeypatch.setattr(bench.torch.cuda, "max_memory_allocated", lambda *a, **k: memory["now"] + 5_000_000)

    def fake_median(fn, reps, warmup_calls=3, flush_l2=False):
        for _ in range(warmup_calls + reps):
            fn()
        return 1.25

    monkeypatch.setattr(bench, "event_median_ms", fake_median)
    def fake_profile(step, steps):
        for _ in range(steps):
            step()
        return KERNELS

    monkeypatch.setattr(bench, "profile_kernels", fake_profile)


@pytest.mark.parametrize("lengths,varlen", [((32,), False), ((20, 12), True)])
def test_bench_shape_on_cpu(bench, monkeypatch, lengths, varlen):
    _fake_cuda(bench, monkeypatch)
    name = "tiny_varlen" if varlen else "tiny"
    monkeypatch.setitem(bench.SHAPES, name, type(bench.SHAPES["B1_T8192_H96"])(lengths, 2, varlen=varlen))

    def forwards(problem, peers, segments=None):
        leaves, kwargs = problem["leaves"], problem["kwargs"]
        tensors = [leaves[key] for key in ("q", "k", "v", "g", "beta")]
        runs = {"cute_kda": lambda: toy_chunk_kda(*tensors, keep=True, **kwargs)}
        if peers == "fla":
            runs["FLA"] = lambda: toy_chunk_kda(*[t * 1 for t in tensors], **kwargs)
        return runs

    monkeypatch.setattr(bench, "peer_forwards", forwards)
    args = bench.build_parser().parse_args(["--shapes", name, "--steps", "2", "--warmup", "1"])
    row = bench.bench_shape(name, args, device=torch.device("cpu"))
    ours, fla = row["peers"]["cute_kda"], row["peers"]["FLA"]
    assert ours["note"] == "" and fla["note"] == ""
    assert ours["step_ms"] == fla["fwd_ms"] == 1.25 and ours["peak_bytes"] == 5_000_000
    tokens, heads, seqs = sum(lengths), 2, len(lengths)
    token_bytes = tokens * heads * 128 * 2
    state_bytes = seqs * heads * 128 * 128 * 4
    inputs = 4 * token_bytes + tokens * heads * 2 + heads * 4 + heads * 128 * 4 + state_bytes
    assert row["input_bytes"] == inputs + (8 * (seqs + 1) if varlen else 0)
    assert ours["saved"].ctx_only == 1000 and fla["saved"].ctx_only == 0
    assert ours["saved"].inputs == fla["saved"].inputs == state_bytes  # of the inputs, only initial_state is saved
    assert fla["saved"].total == ours["saved"].total - 1000  # the same toy, less the kept workspace
    assert set(row["agreement"]) == set(bench.AGREEMENT)
    assert row["agreement"]["o"] == row["agreement"]["q"] == 0.0  # the same toy on both sides
    assert list(row["breakdown"]) == list(bench.GROUPS) and row["top"][0][1] == "Kernel A"
    text = bench.report([row], "cmd", "ENV", "sha", 2, 1)
    assert f"| {name} | 1.250 | 1.250 | 1.00× | not met (2.86× over) |" in text


def test_disable_recompute_reaches_both_peers_and_the_report(bench, monkeypatch):
    monkeypatch.setitem(bench.SHAPES, "tiny", type(bench.SHAPES["B1_T8192_H96"])((16,), 1))
    cpu = torch.device("cpu")
    assert bench.make_problem("tiny", cpu, disable_recompute=True)["kwargs"]["disable_recompute"] is True
    assert bench.make_problem("tiny", cpu)["kwargs"]["disable_recompute"] is False  # FLA's default
    assert bench.build_parser().parse_args(["--disable-recompute"]).disable_recompute
    assert "disable_recompute=True for both peers" in bench.report([], "cmd", "ENV", "sha", 1, 1, True)


def test_fp16_reaches_the_inputs_and_the_report(bench, monkeypatch):
    monkeypatch.setitem(bench.SHAPES, "tiny", type(bench.SHAPES["B1_T8192_H96"])((16,), 1))
    assert bench.build_parser().parse_args([]).dtype == "bf16"
    args = bench.build_parser().parse_args(["--dtype", "fp16"])
    problem = bench.make_problem("tiny", torch.device("cpu"), dtype=bench.DTYPES[args.dtype])
    assert {problem["leaves"][n].dtype for n in ("q", "k", "v", "g", "beta")} == {torch.float16}
    assert problem["do"].dtype == torch.float16 and problem["leaves"]["A_log"].dtype == torch.float32
    text = bench.report([], "cmd", "ENV", "sha", 1, 1, dtype="fp16")
    assert "fp16 q/k/v/g/beta" in text and "fixed dO fp16" in text


def test_bench_shape_keeps_going_when_ours_fails(bench, monkeypatch):
    _fake_cuda(bench, monkeypatch)
    monkeypatch.setitem(bench.SHAPES, "tiny", type(bench.SHAPES["B1_T8192_H96"])((16,), 1))

    def broken(*args, **kwargs):
        raise NotImplementedError("inputs that require grad are not supported yet")

    def forwards(problem, peers, segments=None):
        leaves, kwargs = problem["leaves"], problem["kwargs"]
        tensors = [leaves[key] for key in ("q", "k", "v", "g", "beta")]
        return {"cute_kda": lambda: broken(), "FLA": lambda: toy_chunk_kda(*tensors, **kwargs)}

    monkeypatch.setattr(bench, "peer_forwards", forwards)
    args = bench.build_parser().parse_args(["--shapes", "tiny", "--steps", "1", "--warmup", "1"])
    row = bench.bench_shape("tiny", args, device=torch.device("cpu"))
    assert row["peers"]["cute_kda"]["note"].startswith("step: NotImplementedError: inputs that require grad")
    assert row["peers"]["FLA"]["step_ms"] == 1.25 and row["agreement"] == {} and "breakdown" not in row
    assert "| tiny | — | 1.250 | — | — |" in bench.report([row], "cmd", "ENV", "sha", 1, 1)


def test_head_dim_reaches_the_inputs_the_scale_and_the_report(bench, monkeypatch):
    """``--head-dim 64``: K = V = 64 inputs for both peers, FLA's default scale of that K, the report says whether
    cute_kda runs its D = 64 kernels or pads; other sizes are refused by the parser."""
    monkey = dict(bench.SHAPES)
    try:
        bench.SHAPES["tiny"] = type(bench.SHAPES["B1_T8192_H96"])((16,), 2)
        problem = bench.make_problem("tiny", torch.device("cpu"), dim=64)
    finally:
        bench.SHAPES.clear()
        bench.SHAPES.update(monkey)
    leaves = problem["leaves"]
    assert leaves["q"].shape == (1, 16, 2, 64) and leaves["dt_bias"].shape == (128,)
    assert leaves["initial_state"].shape == (1, 2, 64, 64) and problem["kwargs"]["scale"] == 64 ** -0.5
    assert bench.build_parser().parse_args(["--head-dim", "64"]).head_dim == 64
    assert "D=64 (cute_kda: native D = 64 kernels)" in bench.report([], "cmd", "ENV", "sha", 1, 1, head_dim=64)
    monkeypatch.setattr(importlib.import_module("cute_kda.call"), "NATIVE_TRAINING", False)  # --padded-training
    assert "D=64 (cute_kda: zero-padded to 128)" in bench.report([], "cmd", "ENV", "sha", 1, 1, head_dim=64)
    assert "D=60 (cute_kda: zero-padded to 128)" in bench.report([], "cmd", "ENV", "sha", 1, 1, head_dim=60)
    assert os.path.basename(bench.default_out(64)).startswith("train-d64-")
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--head-dim", "256"])
