"""fp16 → bf16 rounding pass (``cute_kda/kernels/round_bf16.py``, launcher ``cute_kda/ops/round_bf16.py``): fp16
training's dO under ``training.FP16_DO_KERNEL``.

CPU tier: the sm_90a PTX (16-byte loads and stores, one ``cvt.rn.bf16x2.f32`` a pair, no local memory); the
launcher's fallback to torch's cast (CPU tensors) and its argument checks. GPU tier: bit-identical to
``x.to(torch.bfloat16)`` on every fp16 bit pattern but the NaNs (NaN stays NaN), over sizes with tails, odd
alignment and strides (torch's cast there) and B1 T8192 H96 V128; ``out=``; the caller's stream. The training
wiring: tests/test_fp16_training.py.
"""

from __future__ import annotations

import pytest
import torch

from cute_kda.compile_report import compile_with_report
from cute_kda.ops import round_bf16
from cute_kda.ops._cache import TVM_FFI_OPTION
from cute_kda.variants import RoundVariant

BF16, FP16 = torch.bfloat16, torch.float16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def every_fp16() -> torch.Tensor:
    """The 65536 fp16 bit patterns, in order (NaNs included)."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(FP16)


# ---------------------------------------------------------------- CPU


def test_ptx_moves_16_bytes_a_thread_and_rounds_pairs():
    from cute_kda.kernels.round_bf16 import RoundBf16Kernel

    variant = RoundVariant()
    kernel = RoundBf16Kernel(variant.num_threads, variant.vectors)
    _, report = compile_with_report(kernel, *round_bf16.compile_arguments(), options=TVM_FFI_OPTION)
    print(report.summary())
    runs = variant.vectors
    assert report.count("ld.global.v4.b32") == runs and report.count("st.global.v4.b32") == runs
    assert report.count("cvt.rn.bf16x2.f32") == 4 * runs and report.count("cvt.f32.f16") == 8 * runs
    assert not report.has("ld.global.b16") and not report.has("st.global.b16")  # no scalar element moves
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.kernels[0].registers <= 40


def test_cpu_tensors_take_torchs_cast():
    x = every_fp16()
    assert not round_bf16.on_the_kernel(x, torch.empty_like(x, dtype=BF16))
    finite = x[~x.isnan()]
    assert torch.equal(bits(round_bf16.round_to_bf16(finite)), bits(finite.to(BF16)))
    out = torch.empty(3, 5, dtype=BF16)
    y = torch.randn(3, 5).half()
    assert round_bf16.round_to_bf16(y, out) is out and torch.equal(bits(out), bits(y.to(BF16)))


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="fp16"):
        round_bf16.round_to_bf16(torch.zeros(8, dtype=BF16))
    with pytest.raises(ValueError, match="out must be bf16"):
        round_bf16.round_to_bf16(torch.zeros(8, dtype=FP16), torch.zeros(8, dtype=FP16))
    with pytest.raises(ValueError, match="out must be bf16"):
        round_bf16.round_to_bf16(torch.zeros(8, dtype=FP16), torch.zeros(16, dtype=BF16))


def test_warmup_lists_the_pass_for_fp16_training_under_the_switch(monkeypatch):
    """``FP16_DO_KERNEL``: fp16 training lists the pass (compiled by this launcher); bf16, inference and the switch
    off do not."""
    from cute_kda.api import _launchers_by_variant, warmup_variants
    from cute_kda.executors import training

    selection = dict(varlen=(False,), state_modes=(None,), vsplits=(1,), segments=False)
    monkeypatch.setattr(training, "FP16_DO_KERNEL", False)
    assert RoundVariant() not in warmup_variants(dtypes=(FP16,), training=True, **selection)
    monkeypatch.setattr(training, "FP16_DO_KERNEL", True)
    assert RoundVariant() in warmup_variants(dtypes=(FP16,), training=True, **selection)
    assert RoundVariant() not in warmup_variants(dtypes=(BF16,), training=True, **selection)
    assert RoundVariant() not in warmup_variants(dtypes=(FP16,), **selection)
    assert _launchers_by_variant()[RoundVariant] is round_bf16


# ---------------------------------------------------------------- GPU


def launched(monkeypatch) -> list:
    """The variants the launcher compiles or looks up from now on (one per kernel launch)."""
    calls = []
    compiled = round_bf16.compiled_variant
    monkeypatch.setattr(round_bf16, "compiled_variant", lambda v, i: calls.append(v) or compiled(v, i))
    return calls


@pytest.mark.gpu
def test_every_fp16_value_rounds_as_torch(device, monkeypatch):
    """Every bit pattern but the NaNs (±0, subnormals, ±inf, the ties) as torch's cast; NaNs stay NaNs."""
    calls = launched(monkeypatch)
    x = every_fp16().to(device)
    got = round_bf16.round_to_bf16(x)
    assert calls == [RoundVariant()]
    nan = x.isnan()
    assert int(nan.sum()) == 2 * 1023 and torch.equal(got.isnan(), nan)
    assert torch.equal(bits(got[~nan]), bits(x[~nan].to(BF16)))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8, 16, 2040, 2048, 8200, 1 << 20, 3 * (1 << 20) + 8])
def test_sizes_on_the_kernel(device, monkeypatch, n):
    """Sizes around a CTA's 8192 elements (one partial CTA, one partial thread's runs) and several waves."""
    calls = launched(monkeypatch)
    x = (torch.randn(n, device=device) * 1e3).half()
    canary = torch.full((n + 16,), -7.0, dtype=BF16, device=device)
    out = canary[:n]
    assert round_bf16.round_to_bf16(x, out) is out and calls == [RoundVariant()]
    assert torch.equal(bits(out), bits(x.to(BF16))) and bool((canary[n:] == -7.0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["tail", "misaligned", "strided", "empty"])
def test_what_the_kernel_does_not_take_goes_to_torch(device, monkeypatch, case):
    """n % 8 ≠ 0, an address off 16 bytes, a non-contiguous view, no elements: torch's cast, the same bits."""
    calls = launched(monkeypatch)
    base = (torch.randn(4, 1030, device=device) * 100).half()
    x = {"tail": base[0, :1027], "misaligned": base.view(-1)[3:3 + 2048], "strided": base[:, :1024].t(),
         "empty": base[:0]}[case]
    got = round_bf16.round_to_bf16(x)
    assert calls == [] and got.is_contiguous() and got.shape == x.shape
    assert torch.equal(bits(got), bits(x.to(BF16)))


@pytest.mark.gpu
def test_a_training_sized_do(device, monkeypatch):
    """B1 T8192 H96 V128 (100 M elements), fp16 training's dO at the benchmark shape."""
    calls = launched(monkeypatch)
    x = torch.randn(1, 8192, 96, 128, device=device).half()
    got = round_bf16.round_to_bf16(x)
    assert calls == [RoundVariant()] and got.shape == x.shape
    assert torch.equal(bits(got), bits(x.to(BF16)))


@pytest.mark.gpu
def test_runs_on_the_callers_stream(device):
    x = torch.randn(1 << 22, device=device).half()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        got = round_bf16.round_to_bf16(x)
        expected = x.to(BF16)
        same = torch.equal(bits(got), bits(expected))
    assert same
