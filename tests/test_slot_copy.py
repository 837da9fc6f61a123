"""``benchmarks/slot_copy.py``, the copy with a decode's memory pattern that ``bench_decode.py --slot-copy`` times:
its sm_90a code (CPU) and that it moves the listed slots' state onto itself unchanged (GPU)."""

from __future__ import annotations

import pytest
import torch

import bench_script


@pytest.fixture(scope="module")
def slot_copy():
    return bench_script.load("slot_copy")


@pytest.mark.parametrize("element_bytes", [2, 4], ids=["bf16", "fp32"])
def test_every_load_goes_out_before_the_first_store(slot_copy, element_bytes):
    """16 KB a CTA of 64 threads: 16 vector loads a thread, then a warp barrier (ptxas moves no memory operation
    across it), then the 16 vector stores; the run-time XOR keeps the stores (and so the loads) in the code."""
    from cute_kda.compile_report import compile_with_report
    from cute_kda.ops._cache import TVM_FFI_OPTION

    kernel = slot_copy.SlotCopyKernel(element_bytes, element_bytes, 64)
    _, report = compile_with_report(kernel, *slot_copy.compile_arguments(), options=TVM_FFI_OPTION)
    memory = [line.split()[0] for line in report.ptx.splitlines()
              if line.strip().startswith(("ld.global.v4", "st.global.v4", "bar.warp.sync"))]
    assert kernel.vectors == 16
    assert memory == ["ld.global.v4.b32"] * 16 + ["bar.warp.sync"] + ["st.global.v4.b32"] * 16
    assert report.spills == 0 and report.local_memory_ops == 0


def test_a_band_must_split_into_whole_vectors(slot_copy):
    with pytest.raises(ValueError, match="does not split"):
        slot_copy.SlotCopyKernel(2, 8, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_pool_keeps_its_bits(slot_copy, dtype):
    pool = torch.randn(9, 4, 128, 128, device="cuda").to(dtype)
    before = pool.clone()
    ids = torch.tensor([3, -1, 0, 7, 5], dtype=torch.int32, device="cuda")
    slot_copy.slot_copy(pool, ids)()
    torch.cuda.synchronize()
    assert torch.equal(pool.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
