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


@pytest.mark.parametrize("shift", [0.0, -4.0], ids=["gates", "weak_decay"])
@pytest.mark.parametrize("cu", [None, [0, 48, 53, 256]], ids=["fixed", "varlen_odd_tiles"])
def test_pair_scan_is_as_accurate_as_today(shift, cu):
    """Kernel A's pair step (the adjoint) against gold_backward's dv and dh0, beside today's scan mirror."""
    from cute_kda.reference import gold_backward, mirror_bwd_scan
    from cute_kda.reference.pairs import mirror_bwd_scan_pairs

    q, k, v, g, beta, A_log, dt_bias, _ = _inputs(256, shift=shift)
    cu_t = None if cu is None else torch.tensor(cu)
    N = 1 if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(v.shape, generator=gen).bfloat16()
    dht = 0.1 * torch.randn(N, v.shape[2], v.shape[3], v.shape[3], generator=gen)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, cu_seqlens=cu_t)
    gold = gold_backward(q, k, v, g, beta, do, dht=dht, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                         initial_state=torch.zeros_like(dht), cu_seqlens=cu_t)
    today = mirror_bwd_scan(mirror_prepare(q, k, g, beta, **kw), do, cu_seqlens=cu_t, dht=dht)
    pair = mirror_bwd_scan_pairs(mirror_prepare_pairs(q, k, g, beta, **kw), do, cu_seqlens=cu_t, dht=dht)
    for name in ("dv", "dh0"):
        err_today, err_pair = rel_rms(getattr(today, name), gold[name]), rel_rms(getattr(pair, name), gold[name])
        assert err_pair < 1.1 * err_today + 2e-4, (name, err_today, err_pair)
    assert rel_rms(pair.du, today.du) < 5e-3


def _per_head_inputs(T: int, shift: float, seed: int = 0, H: int = 2, HV: int = 4, D: int = 64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = (randn(1, T, H, D).bfloat16() for _ in range(2))
    v = randn(1, T, HV, D).bfloat16()
    g, beta = (randn(1, T, HV) + shift).bfloat16(), randn(1, T, HV).bfloat16()
    A_log, dt_bias = torch.log(torch.rand(HV, generator=gen) * 15 + 1), randn(HV)
    return q, k, v, g, beta, A_log, dt_bias, 0.1 * randn(1, HV, D, D)


def _assert_unbounded_pairs_as_accurate(scheme: str, inputs: tuple, cu, from_today: float) -> None:
    """The pair mirrors of an unbounded gate's ``scheme`` (softplus) against the fp64 gold beside today's mirrors; o
    within ``from_today`` of today's."""
    from cute_kda.reference import pairs
    from cute_kda.reference.gates import mirror_prepare_gates

    q, k, v, g, beta, A_log, dt_bias, h0 = inputs
    cu_t = None if cu is None else torch.tensor(cu)
    if cu_t is not None:
        h0 = h0.expand(len(cu) - 1, *h0.shape[1:]).contiguous()
    kw = dict(gate="softplus", A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_t)
    o_gold, s_gold = gold_forward(q, k, v, g, beta, **kw, initial_state=h0, output_final_state=True,
                                  state_layout="vk", dtype=torch.float64)
    o1, s1 = mirror_recurrence(mirror_prepare_gates(q, k, g, beta, scheme=scheme, **kw), v, cu_seqlens=cu_t,
                               initial_state=h0, output_final_state=True)
    prepare_pairs = getattr(pairs, f"mirror_prepare_pairs_{scheme}")
    o2, s2 = mirror_recurrence_pairs(prepare_pairs(q, k, g, beta, **kw), v, cu_seqlens=cu_t, initial_state=h0,
                                     output_final_state=True)
    err_o1, err_o2 = rel_rms(o1, o_gold), rel_rms(o2, o_gold)
    err_s1, err_s2 = rel_rms(s1, s_gold), rel_rms(s2, s_gold)
    assert err_o2 < 1.1 * err_o1 + 2e-4 and err_s2 < 1.1 * err_s1 + 2e-4, (err_o1, err_o2, err_s1, err_s2)
    assert rel_rms(o2, o1) < from_today


def _assert_lone_tile_keeps_todays_fields(scheme: str, inputs: tuple) -> None:
    from cute_kda.reference import pairs
    from cute_kda.reference.gates import mirror_prepare_gates

    q, k, v, g, beta, A_log, dt_bias, h0 = inputs
    kw = dict(gate="softplus", A_log=A_log, dt_bias=dt_bias)
    today = mirror_prepare_gates(q, k, g, beta, scheme=scheme, **kw)
    paired = getattr(pairs, f"mirror_prepare_pairs_{scheme}")(q, k, g, beta, **kw)
    assert all(torch.equal(a, b) for a, b in zip(today, paired.ws))


@pytest.mark.parametrize("shift", [0.0, -6.0], ids=["gates", "weak_decay"])
@pytest.mark.parametrize("cu", [None, [0, 48, 53, 256]], ids=["fixed", "varlen_odd_tiles"])
def test_per_head_pair_prefill_is_as_accurate_as_today(shift, cu):
    """GatedDeltaNet's per-head gate (softplus, grouped value heads): the pair workspace from the rows' decays."""
    _assert_unbounded_pairs_as_accurate("per_head", _per_head_inputs(256, shift), cu, 5e-3)


def test_per_head_lone_tile_keeps_todays_fields():
    _assert_lone_tile_keeps_todays_fields("per_head", _per_head_inputs(16, 0.0))


def _dyadic_inputs(T: int, case: str, seed: int = 0, H: int = 2, D: int = 64):
    """Kimi-Linear's softplus gate per channel: its init, g_raw of ±1000 (a third each), or a low decay."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = (randn(1, T, H, D).bfloat16() for _ in range(3))
    g, A_log, dt_bias = randn(1, T, H, D), torch.log(torch.rand(H, generator=gen) * 15 + 1), randn(H, D)
    if case == "pm1000":
        pick = torch.randint(0, 3, g.shape, generator=gen)
        g, A_log = torch.where(pick == 0, -1000.0, torch.where(pick == 1, 1000.0, g)), torch.full((H,), 3.0)
    elif case == "low_decay":
        g, A_log, dt_bias = g * 0.1 - 8.0, torch.zeros(H), torch.zeros(H, D)
    return q, k, v, g.bfloat16(), randn(1, T, H).bfloat16(), A_log, dt_bias, 0.1 * randn(1, H, D, D)


@pytest.mark.parametrize("case", ["kimi_init", "pm1000", "low_decay"])
@pytest.mark.parametrize("cu", [None, [0, 48, 53, 256]], ids=["fixed", "varlen_odd_tiles"])
def test_dyadic_pair_prefill_is_as_accurate_as_today(case, cu):
    """The per-channel unbounded gates (the dyadic K1's scheme; the pair kernel is planned): P and Q from the
    tile-relative kd_b, qd_b and kr_a, every factor ≤ 1 for any gate."""
    _assert_unbounded_pairs_as_accurate("dyadic", _dyadic_inputs(256, case), cu, 7e-3)


def test_dyadic_lone_tile_keeps_todays_fields():
    _assert_lone_tile_keeps_todays_fields("dyadic", _dyadic_inputs(16, "kimi_init"))
