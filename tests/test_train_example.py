"""CPU checks of ``examples/train.py``: its options, the masks of the repeated-block task against the batches it
trains on, the per-token losses, the verdict and the CSV. The GPU tier trains FLA's KDA model through cute_kda."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train  # noqa: E402


def test_help_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(option in done.stdout for option in ("--backend", "--gate", "--block", "--steps", "--out"))


@pytest.mark.parametrize("argv", [["--backend", "triton"], ["--gate", "relu"], ["--steps", "x"]])
def test_bad_options_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit) as exit_info:
        train.build_parser().parse_args(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize("argv", [["--block", "1"], ["--steps", "0"], ["--heads", "0"], ["--lr", "-1"]])
def test_bad_values_are_refused(argv, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before anything runs
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2


def test_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        train.main([])


def test_copy_masks_two_copies():
    first, later = train.copy_masks(8, 4)  # tokens 0..7 = block 0..3 twice; position t predicts token t + 1
    assert first.tolist() == [True, True, True, False, False, False, False]     # targets 1, 2, 3
    assert later.tolist() == [False, False, False, False, True, True, True]     # targets 5, 6, 7 (not 4)
    assert not (first & later).any()


def test_copy_masks_more_copies():
    first, later = train.copy_masks(12, 4)
    targets = torch.arange(1, 12)
    assert targets[first].tolist() == [1, 2, 3]
    assert targets[later].tolist() == [5, 6, 7, 9, 10, 11]  # each copy's first token is left out


def test_masks_match_the_batches():
    """On the batches the example trains on, every target under ``later`` repeats the token one block back and the
    token before it repeats too: recall can predict it; no target under ``first`` has an earlier occurrence of its
    context to recall."""
    size = train.Size(1, 256, 2, 4, 64, vocab=10_000)
    ids = train.make_batch("repeat", size, step=3, seed=0, block=32)
    first, later = train.copy_masks(64, 32)
    targets = torch.arange(1, 64)
    for t in targets[later].tolist():
        assert torch.equal(ids[:, t], ids[:, t - 32]) and torch.equal(ids[:, t - 1], ids[:, t - 33])
    assert int(first.sum()) == int(later.sum()) == 31


def test_token_losses_and_split():
    vocab, ids = 8, torch.tensor([[1, 2, 3, 1, 2, 3]])
    uniform = torch.zeros(1, 6, vocab)
    losses = train.token_losses(uniform, ids)
    assert losses.shape == (1, 5) and torch.allclose(losses, torch.full((1, 5), math.log(vocab)))
    oracle = torch.full((1, 6, vocab), -1e4)
    oracle[0, torch.arange(5), ids[0, 1:]] = 0.0  # certain of every next token
    assert float(train.token_losses(oracle.bfloat16(), ids).max()) == pytest.approx(0.0, abs=1e-3)
    first, later = train.copy_masks(6, 3)
    mixed = torch.where(later, 0.0, math.log(vocab))[None]  # recall works on the second copy only
    assert train.split_losses(mixed, first, later) == (pytest.approx(math.log(vocab)), 0.0)


def test_verdict():
    history = [(step, 5.0, 5.5, 5.5 - 0.01 * step) for step in range(100)]
    recalls, line = train.verdict(history)  # last 10 steps: second copy 4.555 on average, 0.945 below the first
    assert recalls and line.startswith("second-copy loss 4.555, first-copy loss 5.500 (gap 0.945) over the last 10 "
                                       "steps: the model recalls")
    recalls, line = train.verdict([(0, 5.0, 5.5, 5.6)])
    assert not recalls and "does not recall" in line and "over the last 1 steps" in line


def test_verdict_needs_the_margin():
    """The H200 run that learned nothing ended with both copies at 5.549: a lower mean by noise is no recall."""
    flat = [(step, 5.549, 5.5492, 5.5490) for step in range(400)]
    recalls, line = train.verdict(flat)
    assert not recalls and "(gap 0.000)" in line and "does not recall" in line
    just_short = [(step, 5.0, 5.5, 5.5 - 0.9 * train.RECALL_MARGIN) for step in range(40)]
    assert not train.verdict(just_short)[0]
    at_margin = [(step, 5.0, 5.5, 5.5 - train.RECALL_MARGIN) for step in range(40)]
    assert train.verdict(at_margin)[0]


def test_write_csv(tmp_path):
    path = tmp_path / "deep" / "train-loss.csv"
    train.write_csv(path, [(0, 5.0, 5.5, 5.4), (1, 4.0, 5.5, 3.0)])
    rows = list(csv.reader(path.open()))
    assert rows == [["step", "loss", "first_copy_loss", "second_copy_loss"], ["0", "5.0", "5.5", "5.4"],
                    ["1", "4.0", "5.5", "3.0"]]
    assert train.plot(tmp_path / "x.png", [(0, 5.0, 5.5, 5.4)], "t") == (tmp_path / "x.png").exists()


class ToyLM(torch.nn.Module):
    """Bigram logits through FLA's model signature (no labels: ``.logits``)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids):
        return type("Output", (), {"logits": self.table(input_ids)})()


@pytest.fixture
def toy_model(monkeypatch):
    """``build_model`` replaced by a toy; the backend variables train() sets restored afterwards."""
    for name in ("FLA_CUTE_KDA", "FLA_FLASH_KDA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(train, "build_model", lambda model, size: (ToyLM(size.vocab), "toy"))


def test_training_loop_on_cpu(toy_model, capsys):
    args = train.build_parser().parse_args(["--backend", "fla", "--steps", "30", "--vocab", "16", "--block", "8",
                                            "--batch", "8", "--log", "10", "--lr", "0.1"])
    history = train.train(args, device="cpu")
    assert [row[0] for row in history] == list(range(30)) and os.environ["FLA_CUTE_KDA"] == "0"
    assert history[-1][1] < history[0][1]  # a bigram table learns the repeated half a little
    out = capsys.readouterr().out
    assert "step   10" in out and "step   29" in out and "chunk_kda calls computed by cute_kda: 0" in out


def test_training_stops_when_calls_miss_cute_kda(toy_model):
    args = train.build_parser().parse_args(["--steps", "2", "--vocab", "16", "--block", "4", "--batch", "2"])
    with pytest.raises(SystemExit, match="cute_kda took 0 of the 4 chunk_kda calls"):
        train.train(args, device="cpu")


@pytest.mark.gpu
def test_example_trains_on_cute_kda(tmp_path):
    """The defaults' run learns to recall the block (the verdict's margin); raises if a chunk_kda call did not reach
    cute_kda."""
    pytest.importorskip("fla")
    out = tmp_path / "loss.csv"
    recalls = train.main(["--out", str(out)])
    rows = list(csv.reader(out.open()))
    print(f"last row {rows[-1]}")
    assert len(rows) == 1 + train.build_parser().parse_args([]).steps
    assert recalls, f"the second copy did not fall 0.5 nats below the first; last row {rows[-1]}"
