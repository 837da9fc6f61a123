"""Segment combine kernel (``cute_kda/kernels/segment_combine.py``, launcher ``cute_kda/ops/segment_combine.py``):
the serial combine of a segmented call on the device, one launch a combine (docs/perf-log.md, CP6).

CPU tier: the sm_90a PTX of each kind of variant (the unrolled dot products: ``D · ROWS · D / THREADS`` fp32 FMAs a
step, three barriers, no local memory), the launch's shared memory, the argument checks. GPU tier: the kernel
against the same recurrence in fp64, over head dims, directions, boundary dtypes, sequences and segment counts; the
segmented call's combine against the CPU's torch combine (tests/test_context_parallel.py runs the segmented calls
against the gold).
"""

from __future__ import annotations

import pytest
import torch

from cute_kda.compile_report import compile_with_report
from cute_kda.layouts.segment_combine import ROWS, THREADS, smem_bytes
from cute_kda.ops import segment_combine
from cute_kda.ops._cache import TVM_FFI_OPTION
from cute_kda.variants import CombineVariant

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def combined_in_fp64(into: torch.Tensor, transitions: torch.Tensor, boundary: torch.Tensor | None, per_seq: int,
                     transpose: bool) -> torch.Tensor:
    """The combine's definition (the kernel module's doc) in fp64, sequence by sequence, out of place."""
    count, heads, dim, _ = into.shape
    adds = into.double().view(count // per_seq, per_seq, heads, dim, dim)
    steps = transitions.double().view(adds.shape)
    out = adds.clone()
    first = per_seq - 1 if transpose else 0
    out[:, first] = 0.0 if boundary is None else boundary.double()
    order = range(per_seq - 2, -1, -1) if transpose else range(1, per_seq)
    for target in order:
        source = target + 1 if transpose else target - 1
        step = steps[:, source].transpose(-1, -2) if transpose else steps[:, source]
        out[:, target] = out[:, source] @ step + adds[:, target]
    return out.view(into.shape)


# ---------------------------------------------------------------- CPU


@pytest.mark.parametrize("variant", [CombineVariant(64, False, None), CombineVariant(128, True, FP32),
                                     CombineVariant(128, False, BF16), CombineVariant(64, True, FP16)], ids=repr)
def test_ptx_unrolls_the_dot_products_without_local_memory(variant):
    from cute_kda.kernels.segment_combine import SegmentCombineKernel

    kernel = SegmentCombineKernel(variant.dim, variant.transpose)
    _, report = compile_with_report(kernel, *segment_combine.compile_arguments(variant), options=TVM_FFI_OPTION)
    print(report.summary())
    per_thread = ROWS * variant.dim // THREADS
    assert report.count("fma.rn.f32") == variant.dim * per_thread  # one step's, unrolled, in the segment loop
    assert report.count("bar.sync") == 3
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.kernels[0].registers <= 168  # 3 CTAs an SM by registers
    assert report.launch_smem == [smem_bytes(variant.dim)]


def test_arguments_are_checked():
    states = torch.zeros(4, 2, 64, 64)
    with pytest.raises(ValueError, match="into must be contiguous fp32 .* on a GPU"):
        segment_combine.combine_segments(states, states, None, 2, transpose=False)
    with pytest.raises(ValueError, match="into must be"):
        segment_combine.combine_segments(torch.zeros(4, 2, 32, 32), torch.zeros(4, 2, 32, 32), None, 2,
                                         transpose=False)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("boundary", [None, BF16, FP16, FP32], ids=["zero", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("num_seqs, per_seq", [(1, 8), (3, 5), (2, 1)])
def test_kernel_matches_fp64(dim, transpose, boundary, num_seqs, per_seq, device):
    gen = torch.Generator().manual_seed(dim + per_seq + 7 * num_seqs)
    heads = 3
    shape = (num_seqs * per_seq, heads, dim, dim)
    into = torch.randn(shape, generator=gen).to(device)
    transitions = (dim ** -0.5 * torch.randn(shape, generator=gen)).to(device)
    start = None if boundary is None else torch.randn(num_seqs, heads, dim, dim, generator=gen).to(device, boundary)
    expected = combined_in_fp64(into, transitions, start, per_seq, transpose)
    before = transitions.clone()
    segment_combine.combine_segments(into, transitions, start, per_seq, transpose=transpose)
    torch.cuda.synchronize()
    assert torch.equal(transitions, before)
    if per_seq == 1:  # nothing to combine: the boundary row alone, written exactly
        assert torch.equal(into.double(), expected)
        return
    error = ((into.double() - expected).norm() / expected.norm()).item()
    print(f"[combine] D={dim} transpose={transpose} boundary={boundary} N={num_seqs} C={per_seq}: {error:.2e}")
    assert error <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "backward"])
def test_segmented_combine_matches_the_torch_combine(transpose, device):
    """``context_parallel._combine`` launches the kernel on a GPU and runs torch's combine on the CPU: the two agree
    to fp32 rounding on the same operands (3 sequences of 4 segments, non-contiguous fp32 boundary)."""
    from cute_kda import context_parallel
    from cute_kda.context_parallel import Segmentation

    seg, heads, dim = Segmentation(3, 64, 16), 2, 64
    gen = torch.Generator().manual_seed(11)
    into = torch.randn(seg.count, heads, dim, dim, generator=gen)
    transitions = dim ** -0.5 * torch.randn(seg.count, heads, dim, dim, generator=gen)
    boundary = torch.randn(heads, seg.num_seqs, dim, dim, generator=gen).transpose(0, 1)
    on_cpu, on_gpu = into.clone(), into.to(device)
    context_parallel._combine(seg, on_cpu, transitions, boundary, transpose=transpose)
    context_parallel._combine(seg, on_gpu, transitions.to(device), boundary.to(device), transpose=transpose)
    error = ((on_gpu.cpu() - on_cpu).norm() / on_cpu.norm()).item()
    assert error <= 1e-6, error
