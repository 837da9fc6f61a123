"""The ULP checker used by the kernel tests must pass what it claims and fail the rest."""

import pytest
import torch
from ulp_check import assert_within_one_ulp, bf16_ulps, row_scale_ulps


def test_ulps_count_neighbouring_bf16_values():
    x = torch.tensor([1.0, -1.0, 0.0, 3.0e38], dtype=torch.bfloat16)
    up = (x.view(torch.int16) + 1).view(torch.bfloat16)
    assert bf16_ulps(x, up).tolist() == [1, 1, 1, 1]
    assert bf16_ulps(torch.tensor([0.0]), torch.tensor([-0.0])).tolist() == [0]


def test_cancelled_entry_is_judged_at_row_scale():
    want = torch.tensor([[1.0, 2.0 ** -12]])
    got = torch.tensor([[1.0, 2.0 ** -12 * 1.5]])  # 64 of its own ulps, 1/128 ulp of the row's 1.0
    assert int(bf16_ulps(got, want).max()) == 64
    assert float(row_scale_ulps(got, want).max()) == pytest.approx(2.0 ** -13 / 2.0 ** -7)
    assert_within_one_ulp("cancelled", got.repeat(1, 1), want)


def test_real_errors_fail():
    want = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    got = want.clone()
    got[3, 5] += 0.1 * want[3].abs().max()  # 10 % of the row's largest entry: ~25 ulps at row scale
    with pytest.raises(AssertionError, match="row scale"):
        assert_within_one_ulp("one bad entry", got, want)
    got = (want.bfloat16().view(torch.int16) + 2).view(torch.bfloat16).float()  # everything 2 ulp off
    with pytest.raises(AssertionError, match="beyond 1 ulp"):
        assert_within_one_ulp("all 2 ulp", got, want)


def test_identical_infinities_are_equal():
    x = torch.tensor([[float("inf"), 1.0]])
    assert_within_one_ulp("inf", x, x.clone())
