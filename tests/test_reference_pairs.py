"""The planned two-tile prefill's mirrors (``cute_kda.reference.pairs``) against the fp64 recurrence and today's
one-tile mirror (docs/numerics.md, "Two tiles a serial step"). CPU only."""

from __future__ import annotations

import pytest
import torch

from cute_kda.reference import gold_forward, rel_rms
from cute_kda.reference.mirror import mirror_prepare, mirror_recurrence
from cute_kda.reference.pairs import mirror_prepare_pairs, mirror_recurrence_pairs, pair_roles
from cute_kda.reference.common import token_tile_map


def _inputs(T: int, H: int = 2, D: int = 64, shift: float = 0.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = (randn(1, T, H, D).bfloat16() for _ in range(3))
    g = (randn(1, T, H, D) + shift).bfloat16()
    beta = randn(1, T, H).bfloat16()
    A_log, dt_bias = torch.rand(H, generator=gen), torch.rand(H, D, generator=gen)
    h0 = 0.1 * randn(1, H, D, D)
    return q, k, v, g, beta, A_log, dt_bias, h0


def test_pair_roles_follow_each_sequence():
    q = torch.zeros(1, 16 * 8, 1, 8)
    cu = torch.tensor([0, 16 * 3, 16 * 3 + 5, 16 * 8])  # 3 tiles, 1 tile, 4 tiles (the last a partial 11 rows + …)
    tile_map = token_tile_map(q, cu)
    is_a, is_b = pair_roles(tile_map, tile_map.slot_exists.numel())
    # sequence 0: (0, 1) and the lone 2; sequence 1: the lone 3; sequence 2 (4 tiles from slot 4): (4, 5), (6, 7)
    assert is_a.tolist()[:8] == [True, False, False, False, True, False, True, False]
    assert is_b.tolist()[:8] == [False, True, False, False, False, True, False, True]


@pytest.mark.parametrize("shift", [0.0, -4.0], ids=["gates", "weak_decay"])
@pytest.mark.parametrize("cu", [None, [0, 48, 53, 256]], ids=["fixed", "varlen_odd_tiles"])
def test_pair_prefill_is_as_accurate_as_today(shift, cu):
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(256, shift=shift)
    cu_t = None if cu is None else torch.tensor(cu)
    if cu_t is not None:
        h0 = h0.expand(len(cu) - 1, *h0.shape[1:]).contiguous()
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, cu_seqlens=cu_t)
    o_gold, s_gold = gold_forward(*(t.double() for t in (q, k, v, g, beta)), A_log=A_log.double(),
                                  dt_bias=dt_bias.double(), lower_bound=-5.0, initial_state=h0.double(),
                                  output_final_state=True, cu_seqlens=cu_t)
    o1, s1 = mirror_recurrence(mirror_prepare(q, k, g, beta, **kw), v, cu_seqlens=cu_t, initial_state=h0,
                               output_final_state=True)
    o2, s2 = mirror_recurrence_pairs(mirror_prepare_pairs(q, k, g, beta, **kw), v, cu_seqlens=cu_t,
                                     initial_state=h0, output_final_state=True)
    err_o1, err_o2 = rel_rms(o1, o_gold), rel_rms(o2, o_gold)
    err_s1, err_s2 = rel_rms(s1, s_gold), rel_rms(s2, s_gold)
    assert err_o2 < 1.1 * err_o1 + 2e-4 and err_s2 < 1.1 * err_s1 + 2e-4, (err_o1, err_o2, err_s1, err_s2)
    assert rel_rms(o2, o1) < 5e-3


def test_a_single_tile_sequence_runs_todays_step():
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(16)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    o1, s1 = mirror_recurrence(mirror_prepare(q, k, g, beta, **kw), v, initial_state=h0, output_final_state=True)
    o2, s2 = mirror_recurrence_pairs(mirror_prepare_pairs(q, k, g, beta, **kw), v, initial_state=h0,
                                     output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
