"""CPU checks of ``benchmarks/bench_model.py``: its options and presets, the batches, the call counter on cute_kda's
FLA backend functions, the peak-origin replay of a memory snapshot, the training loop and a whole worker on a toy
model, a worker process that cannot build FLA's model, and the report. The GPU tier trains a tiny FLA model on both
peers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import bench_script
from bench_script import BENCHMARKS


@pytest.fixture(scope="module")
def bench():
    return bench_script.load("bench_model")


# ---------------------------------------------------------------------------------------------
# options and presets


def test_help_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_model.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    for text in ("--preset", "--models", "--peers", "--steps", "--memory-profile", "--fla-unguarded", "t8k-fill"):
        assert text in done.stdout
    assert "--worker WORKER" not in done.stdout  # internal


def test_defaults(bench):
    parser = bench.build_parser()
    args = parser.parse_args([])
    assert (args.preset, args.models, args.peers, args.steps, args.warmup) == (
        "issue", ["kda-safe", "kda-softplus", "gdn"], ["FLA", "cute_kda"], 30, 5)
    assert (args.precision, args.task, args.group, args.in_process) == ("bf16", "repeat", 2, False)
    assert bench.resolve_size(args, parser) == bench.Size(4, 1024, 8, 8, 2048)  # the model
    args = parser.parse_args(["--preset", "t8k", "--seq-len", "4096", "--vocab", "512", "--models", "gdn,kda-safe,gdn",
                              "--peers", "cute_kda,FLA"])
    assert bench.resolve_size(args, parser) == bench.Size(8, 2048, 16, 4, 4096, 512)
    assert args.models == ["gdn", "kda-safe"] and args.peers == ["FLA", "cute_kda"]  # FLA first: it saves the weights
    assert parser.parse_args(["--peers", "cute_kda"]).peers == ["cute_kda"]


@pytest.mark.parametrize("argv", [["--models", "mamba"], ["--models", ","], ["--peers", "flashkda"], ["--steps", "0"],
                                  ["--preset", "huge"], ["--precision", "fp8"], ["--task", "copy"], ["--heads", "-1"],
                                  ["--worker-timeout", "x"]])
def test_bad_options_are_refused(bench, argv):
    with pytest.raises(SystemExit) as exit_info:
        bench.build_parser().parse_args(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize("argv", [["--warmup", "30"], ["--warmup", "-1"], ["--models", "gdn", "--heads", "6",
                                                                           "--group", "4"],
                                  ["--block", "1025"]])
def test_inconsistent_options_are_refused(bench, argv, capsys):
    parser = bench.build_parser()
    with pytest.raises(SystemExit) as exit_info:
        bench.resolve_size(parser.parse_args(argv), parser)
    assert exit_info.value.code == 2


def test_refuses_to_train_without_cuda(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--models", "kda-safe"])


def test_presets(bench):
    assert set(bench.PRESETS) >= {"issue", "t4k", "t8k", "t8k-fill"}
    for name, (size, note) in bench.PRESETS.items():
        assert size.heads * bench.HEAD_DIM == size.hidden, name  # KDA's key and value width = the hidden size
        assert size.heads % 2 == 0 and size.seq_len % 64 == 0 and note, name  # GDN's default group; whole chunks
        for model in bench.MODELS:
            assert 0 < bench.estimated_peak_gib(model, size) < 0.75 * 141e9 / bench.GIB, (name, model)
    assert bench.PRESETS["issue"][0] == bench.Size(4, 1024, 8, 8, 2048)
    trainer_sizes = [size for name, (size, _) in bench.PRESETS.items() if name != "issue"]
    assert all(4096 <= size.seq_len <= 8192 for size in trainer_sizes)
    assert max(bench.estimated_peak_gib("kda-safe", size) for size in trainer_sizes) > 20  # tens of GiB
    # calibration: the FLA model measured 3.69 GiB
    assert bench.estimated_peak_gib("kda-safe", bench.PRESETS["issue"][0]) == pytest.approx(3.69, rel=0.05)
    table = bench.preset_table()
    assert table.splitlines()[0].startswith("| preset | layers |") and len(table.splitlines()) == 2 + len(bench.PRESETS)


def test_parameter_count(bench):
    size = bench.PRESETS["issue"][0]
    h, w, mlp = 1024, 8 * 128, bench.mlp_width(1024)
    assert mlp == 2816  # FLA's GatedMLP: int(1024 · 8 / 3) = 2730 → 2816
    kda = 4 * (3 * h * w + 12 * w + 2 * (h * 128 + 128 * w) + w + h * 8 + 8 + w + 128 + w * h + 3 * h * mlp + 2 * h) \
        + h + 2 * 32000 * h
    assert bench.parameter_count("kda-safe", size) == kda == bench.parameter_count("kda-softplus", size)
    assert 110e6 < kda < 130e6
    gdn = bench.parameter_count("gdn", size)  # 4 q/k heads, 8 value heads: narrower q, k, no low-rank gates
    assert 0.8 * kda < gdn < kda


# ---------------------------------------------------------------------------------------------
# batches


def test_random_batches(bench):
    size = bench.Size(1, 128, 1, 3, 100, vocab=50)
    a, b = bench.make_batch("random", size, 4, seed=1), bench.make_batch("random", size, 4, seed=1)
    assert a.shape == (3, 100) and a.dtype == torch.int64 and torch.equal(a, b)  # both peers see the same batch
    assert 0 <= int(a.min()) and int(a.max()) < 50
    assert not torch.equal(a, bench.make_batch("random", size, 5, seed=1))
    assert not torch.equal(a, bench.make_batch("random", size, 4, seed=2))


def test_repeated_blocks(bench):
    size = bench.Size(1, 128, 1, 2, 64, vocab=1000)
    ids = bench.make_batch("repeat", size, 0, seed=0)
    assert ids.shape == (2, 64) and torch.equal(ids[:, :32], ids[:, 32:])  # default block: half the row
    assert not torch.equal(ids[0, :32], ids[1, :32])
    ids = bench.make_batch("repeat", bench.Size(1, 128, 1, 2, 70, vocab=1000), 0, seed=0, block=20)
    assert ids.shape == (2, 70) and ids.is_contiguous()
    for start in (20, 40, 60):
        assert torch.equal(ids[:, start:start + 10], ids[:, :10])


# ---------------------------------------------------------------------------------------------
# the call counter


def _fake_backend_module():
    seen = []

    def verify(*args, **kwargs):
        return (False, "q is on cpu") if kwargs.get("refuse") else (True, None)

    def chunk_kda(*args, **kwargs):
        seen.append(("kda", args))
        return "o", "state"

    def chunk_gated_delta_rule(*args, **kwargs):
        seen.append(("gdn", args))
        return "o", None

    return SimpleNamespace(verify=verify, verify_gdn=verify, chunk_kda=chunk_kda,
                           chunk_gated_delta_rule=chunk_gated_delta_rule), seen


def test_call_counter_counts_taken_and_refused(bench):
    module, seen = _fake_backend_module()
    originals = dict(vars(module))
    with bench.CallCounter(module) as counter:
        assert module.verify(1, refuse=False) == (True, None)
        assert module.chunk_kda(1, 2, disable_recompute=True) == ("o", "state")
        module.chunk_kda(3)
        assert module.verify_gdn(refuse=True) == (False, "q is on cpu")
        module.verify(refuse=True)
        module.chunk_gated_delta_rule(4)
    assert counter.summary() == {"taken": {"chunk_kda": 2, "chunk_gated_delta_rule": 1}, "kept": {"chunk_kda": 1},
                                 "refused": {"chunk_gated_delta_rule": 1, "chunk_kda": 1},
                                 "reasons": ["q is on cpu"]}
    assert seen == [("kda", (1, 2)), ("kda", (3,)), ("gdn", (4,))]
    assert vars(module) == originals  # restored


def test_call_counter_sees_what_fla_backend_class_calls(bench, monkeypatch):
    """FLA reaches cute_kda through the backend class's methods, which call the module's functions by name."""
    from cute_kda import fla_backend

    module, _ = _fake_backend_module()
    for name in ("verify", "verify_gdn", "chunk_kda", "chunk_gated_delta_rule"):
        monkeypatch.setattr(fla_backend, name, getattr(module, name))
    backend = fla_backend.backend_class(object)()
    with bench.CallCounter(fla_backend) as counter:
        assert backend.chunk_kda_verifier(refuse=True)[0] is False
        assert backend.chunk_kda_verifier()[0] is True
        backend.chunk_kda(1)
        backend.chunk_gated_delta_rule_verifier()
        backend.chunk_gated_delta_rule(2)
    assert counter.taken == {"chunk_kda": 1, "chunk_gated_delta_rule": 1} and counter.refused == {"chunk_kda": 1}
    assert fla_backend.chunk_kda is module.chunk_kda  # unwrapped again


# ---------------------------------------------------------------------------------------------
# the peak's origins


def _frame(path, name):
    return {"filename": path, "line": 1, "name": name}


TORCH = _frame("/usr/lib/python3/site-packages/torch/nn/modules/module.py", "_call_impl")
STAGES = _frame("/root/repo/cute_kda/executors/stages.py", "_kernel_forward")
FLA_OPS = _frame("/usr/lib/python3/site-packages/fla/ops/kda/wy_fast.py", "recompute_w_u_fwd")


def test_origin_and_short_path(bench):
    assert bench.short_path("/x/site-packages/fla/ops/kda/chunk.py") == "fla/ops/kda/chunk.py"
    assert bench.short_path("/root/repo/cute_kda/executors/stages.py") == "cute_kda/executors/stages.py"
    assert bench.short_path("/somewhere/else.py") == "else.py"
    assert bench.origin([TORCH, STAGES, FLA_OPS]) == "cute_kda/executors/stages.py:_kernel_forward"
    assert bench.origin([TORCH, _frame("<string>", "x")]) == "torch" and bench.origin([]) == "torch"


def test_peak_origins_replays_the_trace(bench):
    def event(action, addr, size, *frames):
        return {"action": action, "addr": addr, "size": size, "frames": list(frames)}

    trace = [
        event("alloc", 1, 100, TORCH, STAGES),            # workspace: 100
        event("alloc", 2, 300, STAGES),                   # checkpoints: 400
        event("segment_alloc", 9, 4096),                  # not a block: ignored
        event("alloc", 3, 50, FLA_OPS),                   # 450: the peak
        event("free_requested", 2, 300, STAGES),          # not yet free
        event("free_completed", 2, 300, STAGES),          # 150
        event("alloc", 4, 200, FLA_OPS),                  # 350
        event("free_completed", 77, 10),                  # freed before the recording: ignored
    ]
    peak, origins = bench.peak_origins({"device_traces": [trace]})
    assert peak == 450
    assert origins == [("cute_kda/executors/stages.py:_kernel_forward", 400),
                       ("fla/ops/kda/wy_fast.py:recompute_w_u_fwd", 50)]
    assert bench.peak_origins({"device_traces": [[]]}) == (0, [])
    assert bench.peak_origins({"device_traces": [trace]}, top=1)[1] == origins[:1]


# ---------------------------------------------------------------------------------------------
# training on a toy model (CPU)


class ToyLM(torch.nn.Module):
    """A bigram model with FLA's call signature; raises at ``fail_at`` calls if given."""

    def __init__(self, vocab: int = 16, fail_at: int | None = None) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, input_ids, labels):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("chunk_bwd_dqkwg is not supported on this Triton\nmore")
        logits = self.table(input_ids)[:, :-1].float()
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:]))


def test_run_training_on_cpu(bench):
    size = bench.Size(1, 128, 1, 4, 32, vocab=16)
    model = ToyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    result = bench.run_training(model, optimizer, lambda step: bench.make_batch("repeat", size, step, 0), steps=12,
                                warmup=2, device=torch.device("cpu"))
    assert len(result["losses"]) == len(result["step_ms"]) == 12 and result["error"] == ""
    assert result["losses"][-1] < result["losses"][0]  # the bigram table learns the repeated halves
    assert result["peak_bytes"] is None and result["held_bytes"] is None and result["reserved_bytes"] is None
    assert all(ms >= 0 for ms in result["step_ms"]) and model.table.weight.grad is None  # zero_grad(set_to_none)
    assert bench.median_after_warmup([9.0, 8.0, 1.0, 3.0, 2.0], 2) == 2.0
    assert bench.median_after_warmup([5.0], 3) == 5.0 and bench.median_after_warmup([], 1) is None


def test_run_training_keeps_what_ran_before_an_error(bench):
    size = bench.Size(1, 128, 1, 2, 16, vocab=16)
    model = ToyLM(fail_at=3)
    result = bench.run_training(model, torch.optim.AdamW(model.parameters()),
                                lambda step: bench.make_batch("random", size, step, 0), 6, 1, torch.device("cpu"))
    assert result["failed_step"] == 2 and len(result["losses"]) == 2
    assert result["error"] == "RuntimeError: chunk_bwd_dqkwg is not supported on this Triton"


def _spec(bench, tmp_path, peer, **changes):
    parser = bench.build_parser()
    args = parser.parse_args(["--steps", "4", "--warmup", "1", "--vocab", "16", "--seq-len", "32", "--batch", "2",
                              "--lr", "0.05"])
    spec = bench.peer_spec(args, "kda-safe", bench.resolve_size(args, parser), peer, tmp_path)
    return {**spec, "device": "cpu", **changes}


def test_worker_on_cpu_shares_the_initial_weights(bench, monkeypatch, tmp_path):
    built = []

    def toy_build(model, size, group=2):
        torch.manual_seed(len(built))  # a different draw each time: the saved weights must win
        built.append(model)
        return ToyLM(size.vocab), "toy"

    monkeypatch.setattr(bench, "build_model", toy_build)
    for name in ("FLA_CUTE_KDA", "FLA_FLASH_KDA", "FLA_FLASH_QLA"):  # run_peer sets them in this process
        monkeypatch.delenv(name, raising=False)
    first = bench.run_peer(_spec(bench, tmp_path, "FLA"), in_process=True, timeout=60)
    assert os.environ["FLA_CUTE_KDA"] == "0" and os.environ["FLA_FLASH_KDA"] == "0"
    second = bench.run_peer(_spec(bench, tmp_path, "cute_kda"), in_process=True, timeout=60)
    assert os.environ["FLA_CUTE_KDA"] == "1"
    for result in (first, second):
        assert result["error"] == "" and result["built"] == "toy" and len(result["losses"]) == 4
        assert result["calls"] == {"taken": {}, "kept": {}, "refused": {}, "reasons": []}
        assert result["params"] == 16 * 16
    assert first["checksum"] == second["checksum"] and first["losses"] == second["losses"]
    saved = json.loads(Path(_spec(bench, tmp_path, "cute_kda")["result_path"]).read_text())
    assert saved["losses"] == second["losses"]


def test_worker_process_reports_what_stopped_it(bench, tmp_path):
    """A real worker process on this machine: FLA is not installed, so the model cannot be built; the error comes
    back as the peer's result, not as a crash of the benchmark."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("FLA is installed here: the worker would build the model")
    result = bench.run_peer(_spec(bench, tmp_path, "cute_kda"), in_process=False, timeout=300)
    assert result["peer"] == "cute_kda" and "fla" in result["error"] and result["losses"] == []


def test_run_peer_without_a_result(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=-9))
    result = bench.run_peer(_spec(bench, tmp_path, "FLA"), in_process=False, timeout=5)
    assert result["error"] == "worker ended (rc -9) without a result"


# ---------------------------------------------------------------------------------------------
# report


def _row(bench):
    size = bench.Size(4, 1024, 8, 8, 2048)
    fla = dict(peer="FLA", error="", note="", built="FLA's model class", params=119_000_000, checksum=1.5,
               losses=[10.4, 10.0, 9.5, 9.0], step_ms=[900.0, 50.0, 40.0, 60.0], peak_bytes=int(3.69 * 2**30),
               held_bytes=2**30, reserved_bytes=4 * 2**30, calls={"taken": {}, "refused": {}, "reasons": []},
               origins=[["fla/ops/kda/wy_fast.py:recompute_w_u_fwd", 2_000_000]], profile_peak=3_000_000)
    ours = dict(peer="cute_kda", error="", note="", built="FLA's model class", params=119_000_000, checksum=1.5,
                losses=[10.4, 10.01, 9.52, 9.03], step_ms=[2000.0, 40.0, 30.0, 45.0], peak_bytes=int(4.74 * 2**30),
                held_bytes=2**30, reserved_bytes=5 * 2**30,
                calls={"taken": {"chunk_kda": 16}, "kept": {"chunk_kda": 2}, "refused": {}, "reasons": []},
                origins=[["cute_kda/executors/stages.py:_kernel_forward", 5_000_000]], profile_peak=6_000_000)
    return dict(model="kda-safe", size=size, group=2, peers={"FLA": fla, "cute_kda": ours})


def test_report(bench):
    args = bench.build_parser().parse_args(["--steps", "4", "--warmup", "1"])
    text = bench.report([_row(bench)], args, "python benchmarks/bench_model.py", "ENV", "abc1234")
    lines = text.splitlines()
    assert lines[0].startswith("# Model training") and lines[2].endswith("commit `abc1234`")
    assert lines[4].startswith("ENV · bf16 (bf16 weights and AdamW)")
    assert "timing and peak over the 3 after 1" in lines[4]
    assert "## kda-safe: KDAForCausalLM, safe gate (safe_gate=True, lower_bound=-5)" in lines
    assert any("initial weights identical" in line and "119.0M parameters" in line
               and "a run makes 16 chunk_kda calls" in line for line in lines)
    # medians over steps 1-3: FLA 50.0, cute_kda 40.0; peaks 3.69 / 4.74 GiB, held 1 GiB
    assert "| FLA | yes | 50.0 |  | 3.69 |  | 1.00 | 2.69 | 4.00 | 0 / 0 | 9.0000 | — |" in lines
    ours = "| cute_kda | yes | 40.0 | 0.80× | 4.74 | 1.28× | 1.00 | 3.74 | 5.00 | 16 / 0 (2 kept) | 9.0300 | — |"
    assert ours in lines
    assert "| 2 | 9.5000 | 9.5200 | +0.0200 |" in lines
    agreement = next(line for line in lines if line.startswith("Loss: over 4 steps"))
    assert "max 0.0300" in agreement and "mean 0.0150" in agreement
    assert "| `cute_kda/executors/stages.py:_kernel_forward` | 0.0 | 5.0 |" in lines
    assert "| **traced peak** | 3.0 | 6.0 |" in lines


def test_report_of_a_peer_that_could_not_run(bench):
    row = _row(bench)
    row["model"] = "gdn"
    row["peers"]["FLA"] = dict(peer="FLA", error="RuntimeError: not supported on Triton 3.6", failed_step=0,
                               note="", losses=[], step_ms=[])
    row["peers"]["cute_kda"]["checksum"] = 2.0
    args = bench.build_parser().parse_args(["--steps", "4", "--warmup", "1", "--precision", "amp"])
    text = bench.report([row], args, "cmd", "ENV", "sha")
    assert "| FLA | FLA could not run (step 0): RuntimeError: not supported on Triton 3.6 | — |" in text
    assert "| cute_kda | yes | 40.0 | — | 4.74 | — |" in text
    assert "(4 q/k heads)" in text and "fp32 weights, bf16 autocast" in text
    assert "a run makes 16 chunk_gated_delta_rule calls" in text
    assert "Loss: no common steps." in text and "initial weights identical" in text  # FLA has no checksum


def test_loss_rows_and_agreement(bench):
    losses = {"FLA": [3.0, 2.0, 1.0], "cute_kda": [3.0, 2.5]}
    assert bench.loss_rows(losses) == [["0", "3.0000", "3.0000", "+0.0000"], ["1", "2.0000", "2.5000", "+0.5000"],
                                       ["2", "1.0000", "—", "—"]]
    assert bench.loss_rows(losses, every=2)[1][0] == "2"
    assert bench.loss_agreement(losses) == ("over 2 steps |cute_kda − FLA| max 0.5000, mean 0.2500, "
                                            "max relative 2.50e-01")
    assert bench.loss_agreement({"FLA": [0.0], "cute_kda": [0.0]}).endswith("max relative 0.00e+00")
    assert bench.loss_agreement({"cute_kda": [1.0]}) == "no common steps"


# ---------------------------------------------------------------------------------------------
# GPU tier: a tiny model on both peers


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["kda-safe", "kda-softplus"])
def test_tiny_model_trains_on_both_peers(bench, model, tmp_path):
    pytest.importorskip("fla")
    out = tmp_path / "model.md"
    bench.main(["--models", model, "--layers", "2", "--hidden", "256", "--heads", "2", "--batch", "2", "--seq-len",
                "512", "--vocab", "1024", "--steps", "6", "--warmup", "2", "--workdir", str(tmp_path),
                "--out", str(out)])
    text = out.read_text()
    print(text)
    assert "| FLA | yes |" in text and "| cute_kda | yes |" in text and "initial weights identical" in text
    assert "| 12 / 0 |" in text  # 2 layers × 6 steps went to cute_kda
    assert "| 0 / 0 |" in text  # none on FLA's run


def test_main_writes_the_report_after_every_model(bench, monkeypatch, tmp_path):
    """main's loop with the peers' results canned: FLA first, every model in the report, the file written."""
    import cute_kda._bench

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cute_kda._bench, "environment", lambda *modules, **labels: "ENV")
    calls = []

    def canned(spec, in_process, timeout):
        calls.append((spec["model"], spec["peer"], spec["size"]["seq_len"], timeout))
        return dict(_row(bench)["peers"][spec["peer"]])

    monkeypatch.setattr(bench, "run_peer", canned)
    out = tmp_path / "model.md"
    bench.main(["--models", "gdn,kda-softplus", "--seq-len", "4096", "--steps", "4", "--warmup", "1",
                "--worker-timeout", "100", "--workdir", str(tmp_path / "w"), "--out", str(out)])
    assert calls == [("gdn", "FLA", 4096, 100), ("gdn", "cute_kda", 4096, 100), ("kda-softplus", "FLA", 4096, 100),
                     ("kda-softplus", "cute_kda", 4096, 100)]
    text = out.read_text()
    assert "## gdn: GatedDeltaNetForCausalLM" in text and "## kda-softplus: KDAForCausalLM" in text
    assert "--seq-len 4096" in text.splitlines()[2] and (tmp_path / "w").is_dir()
