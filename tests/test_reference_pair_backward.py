"""The training form of the two-tile step (``cute_kda.reference.pair_backward``, planned: W2 of docs/perf-log.md v8):
a checkpoint, tile a's U and a snapshot kept a pair, Kernel B's per-tile matrices rebuilt from them. CPU only."""

from __future__ import annotations

import math

import pytest
import torch

from cute_kda.reference import gold_backward, rel_rms
from cute_kda.reference.backward import mirror_backward, mirror_bwd_scan
from cute_kda.reference.common import token_tile_map
from cute_kda.reference.mirror import mirror_prepare, mirror_recurrence
from cute_kda.reference.pair_backward import mirror_backward_pairs, tile_states_of_pairs
from cute_kda.reference.pairs import (
    mirror_bwd_scan_pairs, mirror_prepare_pairs, mirror_recurrence_pairs, pair_block_of,
)
from cute_kda.workspace import block_states_shape, pair_block_slots

from test_reference_grads import _MIRROR_CASES, DA_LOG_BOUND, GRADS, TARGETS, _problem
from test_reference_pairs import _dyadic_inputs, _inputs, _per_head_inputs

pytestmark = pytest.mark.filterwarnings("ignore:cute_kda mirror on CPU:RuntimeWarning")


def test_pair_blocks_are_distinct_and_within_their_count():
    q = torch.zeros(1, 16 * 12, 1, 8)
    cu = torch.tensor([0, 16 * 3, 16 * 3 + 5, 16 * 4, 16 * 9 + 3, 16 * 12])  # 3, 1, 1, 6 (a partial last), 2 tiles
    tile_map = token_tile_map(q, cu)
    tiles, num_seqs = tile_map.slot_exists.numel(), cu.numel() - 1
    block = pair_block_of(tile_map)
    real = torch.nonzero(tile_map.slot_exists).flatten()
    seq = torch.searchsorted(tile_map.bases[1:], real, right=True)
    pair = (real - tile_map.bases[:-1][seq]) // 2
    keys = {(int(s), int(p)): int(block[t]) for t, s, p in zip(real, seq, pair)}
    assert len(set(keys.values())) == len(keys)  # one slot a pair, two pairs never share one
    assert max(keys.values()) < pair_block_slots(tiles, num_seqs)


def _gradient_errors(got: dict, gold: dict) -> dict:
    return {n: rel_rms(got[n].float(), gold[n].float()) for n in GRADS if gold.get(n) is not None}


@pytest.mark.parametrize("case", list(_MIRROR_CASES))
def test_pair_backward_vs_gold(case):
    """Every gradient within the issue's targets and within 10 % (+ 3e-4) of today's per-tile chain on the same inputs
    (dA_log, the cancelling sum, to DA_LOG_BOUND)."""
    inputs, kw = _problem(**_MIRROR_CASES[case])
    gold = gold_backward(*inputs, **kw)
    got = mirror_backward_pairs(*inputs, **kw)
    assert set(got) == set(gold) and all((got[n] is None) == (gold[n] is None) for n in gold)
    for name in GRADS:
        if got[name] is not None:
            assert got[name].shape == gold[name].shape and got[name].isfinite().all(), name
    pair, today = _gradient_errors(got, gold), _gradient_errors(mirror_backward(*inputs, **kw), gold)
    bounds = dict(TARGETS, dA_log=DA_LOG_BOUND)
    assert all(pair[n] <= bounds[n] for n in pair), pair
    assert all(pair[n] <= 1.1 * today[n] + 3e-4 for n in pair if n != "dA_log"), (pair, today)


def test_first_pair_rebuilds_todays_matrices_bit_for_bit():
    """One pair from a bf16 h0 and dht: tile b's rebuilt state and tile a's rebuilt state gradient are today's
    checkpoint and snapshot, bit for bit (the same U_a, dv_b and
    fields; a bf16 entering matrix is its own rounding)."""
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(32, D=128)
    h0 = h0.bfloat16()
    dht = (0.1 * torch.randn(h0.shape, generator=torch.Generator().manual_seed(3))).bfloat16()
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    ws, pws = mirror_prepare(q, k, g, beta, **kw), mirror_prepare_pairs(q, k, g, beta, **kw)
    states = torch.full(block_states_shape(ws, 2, 1, 1), math.nan, dtype=torch.bfloat16)
    mirror_recurrence(ws, v, initial_state=h0, checkpoints=states, checkpoint_every=1)
    scan = mirror_bwd_scan(ws, do, dht=dht, snapshot_every=1)
    kept = [torch.full((2, 128, 128), math.nan, dtype=torch.bfloat16) for _ in range(2)]
    u_a = torch.full((2, 128, 16), math.nan, dtype=torch.bfloat16)
    mirror_recurrence_pairs(pws, v, initial_state=h0, checkpoints=kept[0], u_a=u_a)
    pair_scan = mirror_bwd_scan_pairs(pws, do, dht=dht, snapshots=kept[1])
    assert torch.equal(pair_scan.dv[:, 16:], scan.dv[:, 16:])  # tile b's step is today's (tile a's takes P and Q)
    rebuilt, rebuilt_grads = tile_states_of_pairs(ws, kept[0], kept[1], u_a, do, pair_scan.dv)
    rows = [0, 1, 3, 4]  # slot g + s of tiles 0, 1 of each head (3 slots a head: 2 tiles + 1 sequence)
    assert torch.equal(rebuilt[rows], states[rows]) and torch.equal(rebuilt_grads[rows], scan.snapshots[rows])


def _run(inputs: tuple, kw: dict) -> tuple[dict, dict]:
    q, k, v, g, beta, A_log, dt_bias, h0 = inputs
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(v.shape, generator=gen).bfloat16()
    dht = 0.1 * torch.randn(h0.shape, generator=gen)
    kw = dict(kw, A_log=A_log, dt_bias=dt_bias, dht=dht, initial_state=h0)
    gold = gold_backward(q, k, v, g, beta, do, **kw)
    return (_gradient_errors(mirror_backward_pairs(q, k, v, g, beta, do, **kw), gold),
            _gradient_errors(mirror_backward(q, k, v, g, beta, do, **kw), gold))


# the weakest decays cost the most: each rebuilt matrix is rounded twice (the kept bf16 one, then the step's sum),
# where today's per-tile checkpoints are rounded once from K2's fp32 state (docs/numerics.md, "Two tiles a serial
# step"): at T1024 with g shifted by -8, dg 4.3e-3 → 5.4e-3 and ddt_bias 5.5e-3 → 6.6e-3 on the CPU
@pytest.mark.parametrize("name, inputs, kw, ratio", [
    ("safe_low_decay", _inputs(1024, shift=-8.0), dict(lower_bound=-5.0), 1.35),
    ("per_head_weak_decay", _per_head_inputs(512, -6.0), dict(gate="softplus"), 1.15),
    ("dyadic_low_decay", _dyadic_inputs(512, "low_decay"), dict(gate="softplus"), 1.15),
    ("dyadic_pm1000", _dyadic_inputs(256, "pm1000"), dict(gate="softplus"), 1.1),
], ids=lambda x: x if isinstance(x, str) else "")
def test_pair_backward_long_sequences(name, inputs, kw, ratio):
    pair, today = _run(inputs, kw)
    bounds = dict(TARGETS, dA_log=DA_LOG_BOUND)
    assert all(pair[n] <= bounds[n] for n in pair), pair
    assert all(pair[n] <= ratio * today[n] + 3e-4 for n in pair if n != "dA_log"), (pair, today)


def test_training_executor_runs_the_pair_form_for_a_per_head_gate(monkeypatch):
    """A recomputing call with GatedDeltaNet's per-head gate (grouped value heads) on the reference backend under
    ``PAIR_TRAINING`` at the rule's V-split: every gradient is :func:`mirror_backward_pairs`' bit for bit (the pair
    workspace of the per-head scheme, the pair chain, Kernel B's rebuild)."""
    import functools

    from cute_kda.executors import stages, training
    from cute_kda.reference.backend import REFERENCE

    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    q, k, v, g, beta, A_log, dt_bias, h0 = _per_head_inputs(83, -1.0, seed=5)
    gen = torch.Generator().manual_seed(6)
    do, dht = torch.randn(v.shape, generator=gen).bfloat16(), 0.1 * torch.randn(h0.shape, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, A_log, dt_bias, h0)]
    forward = functools.partial(training.kda_forward, backend=REFERENCE)
    o, ht = forward(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6], initial_state=leaves[7], gate="softplus",
                    output_final_state=True, recompute=True, vsplit=stages.PAIR_TRAINING_MIN_VSPLIT["per_head"])
    torch.autograd.backward([o, ht], [do, dht])
    want = mirror_backward_pairs(q, k, v, g, beta, do, dht=dht, gate="softplus", A_log=A_log, dt_bias=dt_bias,
                                 initial_state=h0)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
    for name, leaf in zip(names, leaves):
        assert torch.equal(leaf.grad, want[name].to(leaf.dtype)), name
