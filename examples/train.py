"""Train FLA's KDA language model on cute_kda, on a task only its recurrent memory can solve.

FLA's ``KDAForCausalLM`` (small by default: 2 layers, hidden 256, 2 heads of 128, vocabulary 64; the safe gate, or
Kimi-Linear's softplus gate with ``--gate softplus``) is trained with AdamW for ``--steps`` steps (600 by default,
at a constant learning rate of 3e-3). ``import cute_kda`` registers cute_kda as a backend of FLA's ``chunk_kda``, so
every training call of the model's KDA layers runs on cute_kda's kernels, forward and backward; the script counts
the calls cute_kda took and stops if any went elsewhere. ``--backend fla`` trains the same model on FLA's own
kernels (``FLA_CUTE_KDA=0``) for comparison.

The data: each row is a block of ``--block`` random tokens (32 by default) followed by the same block again.
Nothing predicts a token of the first copy (its loss cannot go below ln(vocabulary) = 4.16 for 64 tokens); a token
of the second copy is predictable only by recalling what followed the same token in the first copy, ``--block``
tokens back: the recurrent state has to hold the whole block. So the loss on the second copy falls below the loss
on the first copy only if the model learns to use its memory. The model trains on every token; the two losses are
reported apart.

What to expect with the defaults: both losses sit at ln 64 ≈ 4.16 for a plateau, then the second-copy loss falls
to about 0.1-0.2 (not 0: with 64 tokens a token often occurs twice in a block of 32, and then what followed it is
ambiguous) while the first-copy loss stays near 4.2. On an H200 (seed 0, 1200 calls, all on cute_kda) the
second-copy loss left the plateau at step 174, was below 0.5 by step 259 and ended at 0.11 against the first copy's
4.18; on FLA's kernels (``--backend fla``) at 0.22 against 4.18. The plateau's length varies with the seed: a CPU
stand-in of this run (FLA's model class and this loop, the KDA core, norms and convolutions by torch references in
fp32) reached the verdict's margin at steps 148-384 over seeds 0-5, but two of them had not finished falling by step
600 (second-copy losses 1.3 and 3.0). A shorter block learns sooner and more surely there: ``--block 16 --steps 500``
reached it at steps 92-140 on all six seeds (not yet run on a GPU). Block 64 with vocabulary 256 learned nothing in
400 steps, on the H200 and on the stand-in alike.

Writes the curves (step, loss, first-copy loss, second-copy loss) to ``--out`` (CSV) and, when matplotlib imports,
a plot beside it (PNG). The last line says whether the model recalls: whether the second-copy loss (mean of the
last tenth of the steps) is at least 0.5 nats below the first-copy loss (:func:`verdict`).

    python examples/train.py
    python examples/train.py --gate softplus
    python examples/train.py --block 16 --steps 500                # a shorter block: sooner, over more seeds
    python examples/train.py --backend fla                         # the same run on FLA's kernels

Needs a Hopper GPU and flash-linear-attention 0.6 (its model classes need ``transformers``; without it the same
blocks are built from FLA's layers, ``benchmarks/bench_model.py``'s ``LayerStackLM``).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_model import CallCounter, Size, build_model, make_batch  # noqa: E402

GATES = {"safe": "kda-safe", "softplus": "kda-softplus"}
TAIL = 0.1  # the verdict compares the means over this last fraction of the steps
RECALL_MARGIN = 0.5  # nats the second copy must fall below the first for the verdict to claim recall


def copy_masks(seq_len: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks over the ``seq_len - 1`` predictions of a row (position ``t`` predicts token ``t + 1``):
    ``first`` marks the targets inside the first copy (tokens 1 … block − 1), ``later`` the targets of the later
    copies that recall can predict (token ``j`` ≥ block with ``j % block ≠ 0``: a copy's first token follows the
    previous copy's last one, a pair the first copy does not contain)."""
    target = torch.arange(1, seq_len)
    first = target < block
    later = (target >= block) & (target % block != 0)
    return first, later


def split_losses(token_losses: torch.Tensor, first: torch.Tensor, later: torch.Tensor) -> tuple[float, float]:
    """Mean of ``token_losses`` ``[B, T - 1]`` over the ``first`` and the ``later`` prediction positions."""
    return float(token_losses[:, first].mean()), float(token_losses[:, later].mean())


def token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each next-token prediction, fp32 ``[B, T - 1]``."""
    predictions = logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(predictions.transpose(1, 2), input_ids[:, 1:], reduction="none")


def verdict(history: list[tuple[int, float, float, float]]) -> tuple[bool, str]:
    """(whether the model recalls, the line saying so), from the means over the last :data:`TAIL` of the steps.

    Recall is claimed only when the second-copy loss is at least :data:`RECALL_MARGIN` (0.5 nats) below the
    first-copy loss. Without recall the two copies sit at the same loss: the H200 run that learned nothing (block 64,
    vocabulary 256, 400 steps) ended with both tail means at 5.549, and its logged losses never moved more than
    0.05 from step to step, so noise cannot open a gap of 0.5. With recall the second copy falls by nats towards 0,
    while the first copy cannot fall below ln(vocabulary) ≥ ln 2 = 0.69: the margin is reachable for any
    vocabulary."""
    tail = history[-max(1, int(len(history) * TAIL)):]
    first = sum(row[2] for row in tail) / len(tail)
    later = sum(row[3] for row in tail) / len(tail)
    recalls = later <= first - RECALL_MARGIN
    meaning = ("recalls the block from its recurrent memory" if recalls else
               f"does not recall the block (that needs the second copy {RECALL_MARGIN} nats below the first)")
    return recalls, (f"second-copy loss {later:.3f}, first-copy loss {first:.3f} (gap {first - later:.3f}) over the "
                     f"last {len(tail)} steps: the model {meaning}")


def write_csv(path: Path, history: list[tuple[int, float, float, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "first_copy_loss", "second_copy_loss"])
        writer.writerows(history)


def plot(path: Path, history: list[tuple[int, float, float, float]], title: str) -> bool:
    """The curves into ``path`` (PNG); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [row[0] for row in history]
    fig, axis = plt.subplots(figsize=(7, 4))
    for column, label in ((1, "all tokens"), (2, "first copy"), (3, "second copy")):
        axis.plot(steps, [row[column] for row in history], label=label)
    axis.set(title=title, xlabel="step", ylabel="cross-entropy")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def train(args: argparse.Namespace, device: str = "cuda") -> list[tuple[int, float, float, float]]:
    """The training run of ``args`` on ``device``: (step, loss, first-copy loss, second-copy loss) per step."""
    os.environ.update(FLA_CUTE_KDA="1" if args.backend == "cute_kda" else "0", FLA_FLASH_KDA="0")
    import cute_kda  # noqa: F401  (registers cute_kda as FLA's chunk_kda backend)
    from cute_kda import fla_backend

    size = Size(args.layers, args.heads * 128, args.heads, args.batch, 2 * args.block, args.vocab)
    torch.manual_seed(args.seed)
    model, built = build_model(GATES[args.gate], size)
    print(f"{built}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {args.layers} layers, "
          f"hidden {size.hidden}, {args.heads} heads of 128, {args.gate} gate; rows of 2 × {args.block} tokens")
    model.to(device).train()  # fp32 weights; bf16 compute under autocast
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    first, later = copy_masks(size.seq_len, args.block)
    history = []
    with CallCounter(fla_backend) as counter:
        for step in range(args.steps):
            input_ids = make_batch("repeat", size, step, args.seed, args.block).to(device)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                logits = model(input_ids=input_ids).logits
            losses = token_losses(logits, input_ids)
            loss = losses.mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append((step, float(loss.detach()), *split_losses(losses.detach(), first, later)))
            if step % args.log == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {history[-1][1]:.3f}  first copy {history[-1][2]:.3f}  "
                      f"second copy {history[-1][3]:.3f}")
    taken = sum(counter.taken.values())
    if args.backend == "cute_kda" and taken != args.steps * args.layers:
        raise SystemExit(f"cute_kda took {taken} of the {args.steps * args.layers} chunk_kda calls "
                         f"(refusals: {counter.reasons or 'none'}; is the GPU a Hopper?)")
    print(f"chunk_kda calls computed by cute_kda: {taken}")
    return history


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cute_kda", "fla"), default="cute_kda",
                        help="which kernels FLA's chunk_kda runs (default cute_kda)")
    parser.add_argument("--gate", choices=list(GATES), default="safe", help="KDA's gate (default safe)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2, help="heads of 128 (hidden = 128 · heads)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--block", type=int, default=32, help="tokens a copy; a row is two copies (default 32)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=int, default=25, help="print every this many steps")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "train-loss.csv"),
                        help="CSV of the curves; the PNG goes beside it (default $OUT/train-loss.csv or ./)")
    return parser


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("layers", "heads", "vocab", "batch", "steps", "log", "lr"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.block < 2:
        parser.error(f"--block must be at least 2, got {args.block}")


def main(argv: list[str] | None = None) -> bool:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(args, parser)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (Hopper): cute_kda's kernels train the model")
    history = train(args)
    out = Path(args.out)
    write_csv(out, history)
    title = f"KDA ({args.gate} gate) on {args.backend}: a block of {args.block} random tokens, repeated"
    plotted = plot(out.with_suffix(".png"), history, title)
    print(f"curves: {out}" + (f", {out.with_suffix('.png')}" if plotted else " (no matplotlib: no plot)"))
    recalls, line = verdict(history)
    print(line)
    return recalls


if __name__ == "__main__":
    main()
