"""The approximate-intrinsic kernels: sm_90a compile checks (CPU) and results on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

OPS = ("tanh", "ex2", "lg2")
INSTRUCTION = {"tanh": "tanh.approx.f32", "ex2": "ex2.approx.ftz.f32", "lg2": "lg2.approx.f32"}

# PTX ISA: tanh.approx.f32 has a maximum relative error of 2^-11 (we allow 2^-10.5);
# ex2.approx.f32 is within 2 ulp of the correctly rounded result (2 ulp ≤ 2^-22 relative; we allow 2^-21).
TANH_REL_TOL = 2.0 ** -10.5
EX2_REL_TOL = 2.0 ** -21
# lg2.approx.f32: the PTX ISA gives a maximum absolute error of 2^-22 on [0.5, 2] (the softplus gate's
# argument 1 + 2^−|y| lies in [1, 2]); we allow 2^-21
LG2_ABS_TOL = 2.0 ** -21


@pytest.mark.parametrize("op", OPS)
def test_compiles_to_the_instruction(op):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from cute_kda.compile_report import compile_with_report
    from cute_kda.dsl import cute, cutlass
    from cute_kda.kernels.intrinsics import ApproxIntrinsicKernel

    n = cute.sym_int()
    src = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=4)
    dst = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=4)
    _, report = compile_with_report(ApproxIntrinsicKernel(op), src, dst, make_fake_stream())
    assert report.count(INSTRUCTION[op]) == 1
    assert not any(report.has(other) for name, other in INSTRUCTION.items() if name != op)
    assert report.local_memory_ops == 0
    assert report.spills == 0


def test_launcher_compile_arguments_are_accepted():
    """The launcher's own compile (TVM-FFI entry, dynamic 1-D layout, 4-byte alignment) succeeds."""
    from cutlass.cute.runtime import make_fake_stream

    from cute_kda.ops.intrinsics import _compile

    x = torch.randn(1001)[1:]  # a view that does not start on a 16-byte boundary
    compiled = _compile("ex2", x, torch.empty_like(x), make_fake_stream())
    assert callable(compiled)


def test_unknown_op_is_rejected():
    from cute_kda.kernels.intrinsics import ApproxIntrinsicKernel

    with pytest.raises(ValueError):
        ApproxIntrinsicKernel("exp")


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (approx.double() - exact).abs() / exact.abs().clamp_min(1e-300)


@pytest.mark.gpu
def test_tanh_approx_accuracy(device):
    from cute_kda.ops.intrinsics import tanh_approx

    x = torch.cat([torch.linspace(-20, 20, 1 << 20, device=device), torch.randn(12345, device=device) * 3,
                   torch.tensor([0.0, -0.0, 1e30, -1e30, math.inf, -math.inf], device=device)])
    y = tanh_approx(x)
    exact = torch.tanh(x.double())
    finite = x.isfinite() & (x != 0)
    rel = _relative_error(y[finite], exact[finite])
    print(f"tanh.approx.f32 max relative error {rel.max().item():.3e} (2^{math.log2(rel.max().item()):.2f})")
    assert rel.max().item() <= TANH_REL_TOL
    assert torch.equal(y[~finite], exact[~finite].float())
    assert not torch.equal(y, torch.tanh(x)), "identical to torch.tanh: is the approximate instruction in use?"


@pytest.mark.gpu
def test_ex2_approx_accuracy_and_ftz(device):
    from cute_kda.ops.intrinsics import ex2_approx

    # the normal-result range of fp32: 2^x overflows past 128 and is subnormal (flushed) below -126
    x = torch.cat([torch.linspace(-125.9, 127.9, 1 << 20, device=device),
                   (torch.randn(12345, device=device) * 30).clamp(-125.9, 127.9)])
    y = ex2_approx(x)
    rel = _relative_error(y, torch.exp2(x.double()))
    print(f"ex2.approx.ftz.f32 max relative error {rel.max().item():.3e} (2^{math.log2(rel.max().item()):.2f})")
    assert rel.max().item() <= EX2_REL_TOL
    # ftz: results below the smallest normal are flushed; subnormal inputs count as 0
    special = torch.tensor([-127.5, -140.0, -1000.0, 1e-40, -1e-40, -math.inf, math.inf, 0.0], device=device)
    expected = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 0.0, math.inf, 1.0], device=device)
    assert torch.equal(ex2_approx(special), expected)


@pytest.mark.gpu
def test_lg2_approx_accuracy(device):
    from cute_kda.ops.intrinsics import lg2_approx

    x = torch.linspace(1.0, 2.0, 1 << 20, device=device)
    err = (lg2_approx(x).double() - torch.log2(x.double())).abs()
    print(f"lg2.approx.f32 max absolute error on [1, 2] {err.max().item():.3e}")
    assert err.max().item() <= LG2_ABS_TOL
    assert lg2_approx(torch.ones(1, device=device)).item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_shape_strides_and_stream(device, op):
    from cute_kda.ops import intrinsics

    launch = getattr(intrinsics, f"{op}_approx")
    base = torch.randn(64, 33, device=device)
    if op == "lg2":
        base = base.abs() + 0.5  # log2 of a negative is NaN, which torch.equal never finds equal
    strided = base[:, 1::2]  # non-contiguous
    expected = launch(strided.contiguous())
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        got = launch(strided)
    stream.synchronize()
    assert got.shape == strided.shape
    assert torch.equal(got, expected)
    assert launch(torch.empty(0, 5, device=device)).shape == (0, 5)
    with pytest.raises(TypeError):
        launch(base.double())


@pytest.mark.gpu
def test_mirror_uses_the_kernels(device):
    """The mirror's intrinsic path on a GPU is the DSL kernel, bit for bit, and differs from torch."""
    from cute_kda.ops import intrinsics
    from cute_kda.reference import common

    assert common.intrinsics_exact(device)
    assert common.INTRINSICS_EXACT
    x = torch.randn(1 << 16, device=device) * 8
    assert torch.equal(common.tanh_approx(x), intrinsics.tanh_approx(x))
    assert torch.equal(common.ex2_approx(x), intrinsics.ex2_approx(x))
    assert torch.equal(common.lg2_approx(x.abs() + 1), intrinsics.lg2_approx(x.abs() + 1))
    assert torch.equal(common.sigmoid_approx(x), intrinsics.tanh_approx(x * 0.5) * 0.5 + 0.5)
    assert not torch.equal(common.sigmoid_approx(x), torch.tanh(x * 0.5) * 0.5 + 0.5)


@pytest.mark.gpu
def test_mirror_workspace_gates_match_direct_launches(device):
    """gT and β in the mirror's workspace equal the contract's formulas evaluated with direct launches."""
    from cute_kda.ops.intrinsics import ex2_approx, tanh_approx
    from cute_kda.reference import mirror_prepare

    torch.manual_seed(0)
    T, H, D, lower_bound = 32, 2, 128, -5.0
    q, k = (torch.randn(1, T, H, D, device=device).bfloat16() for _ in range(2))
    g = (torch.rand(1, T, H, D, device=device) * 16 - 8).bfloat16()
    beta = torch.randn(1, T, H, device=device).bfloat16()
    A_log = torch.rand(H, device=device)
    dt_bias = torch.randn(H, D, device=device)
    ws = mirror_prepare(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)

    log2e = torch.tensor(math.log2(math.e), dtype=torch.float64).float().item()
    c_gate = torch.tensor(lower_bound * math.log2(math.e), dtype=torch.float64).float().item()
    e_a = ex2_approx(A_log * log2e)
    x = e_a[:, None] * (g[0].float() + dt_bias)  # [T, H, D]
    gp = (tanh_approx(x * 0.5) * 0.5 + 0.5) * c_gate
    tiles = gp.view(T // 16, 16, H, D)
    G_last = tiles[:, 0]
    for r in range(1, 16):
        G_last = G_last + tiles[:, r]
    expected_gt = ex2_approx(G_last).permute(1, 0, 2).reshape(H * T // 16, D)
    assert torch.equal(ws.gt, expected_gt)
    expected_beta = (tanh_approx(beta[0].float() * 0.5) * 0.5 + 0.5).view(T // 16, 16, H).permute(2, 0, 1)
    assert torch.equal(ws.beta, expected_beta.reshape(H * T // 16, 16))
