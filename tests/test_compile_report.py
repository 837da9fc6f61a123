"""cute_kda.compile_report: PTX instruction counts, ptxas resource parsing, compile on the CPU."""

from __future__ import annotations

from pathlib import Path

from cute_kda.compile_report import CompileReport, compile_with_report, parse_ptxas_log, ptxas_resources
from cute_kda.dsl import cute, cutlass

# Two entries and a non-inlined helper. ptxas keeps `spilled`'s indexed local array on the stack and
# turns `registers_only`'s into registers.
_PTX = """
.version 8.0
.target sm_90a
.address_size 64

.func (.reg .b32 %out) helper(.reg .b32 %a)
{
\t.local .align 4 .b8 buf[64];
\t.reg .b64 %rd<3>;
\t.reg .b32 %r<4>;
\tmov.u64 %rd1, buf;
\tand.b32 %r1, %a, 15;
\tmul.wide.u32 %rd2, %r1, 4;
\tadd.u64 %rd1, %rd1, %rd2;
\tst.local.u32 [%rd1], %a;
\tld.local.u32 %r2, [buf+8];
\tmov.b32 %out, %r2;
\tret;
}

.visible .entry spilled(.param .u64 p)
{
\t.reg .b64 %rd<2>;
\t.reg .b32 %r<3>;
\tld.param.u64 %rd1, [p];
\tmov.u32 %r1, %tid.x;
\t{
\t.param .b32 a0;
\t.param .b32 rv;
\tst.param.b32 [a0], %r1;
\tcall.uni (rv), helper, (a0);
\tld.param.b32 %r2, [rv];
\t}
\tst.global.u32 [%rd1], %r2;
\tret;
}

.visible .entry registers_only(.param .u64 p)
{
\t.shared .align 4 .b8 sm[256];
\t.reg .b64 %rd<2>;
\t.reg .b32 %r<3>;
\t.reg .pred %p<2>;
\tld.param.u64 %rd1, [p];
\tmov.u32 %r1, %tid.x;
\tsetp.eq.u32 %p1, %r1, 0;
\t@%p1 st.shared.u32 [sm], %r1;
\t@!%p1 st.shared.u32 [sm+4], %r1;
\tbar.sync 0;
\tld.shared.u32 %r2, [sm+4];
\tst.global.u32 [%rd1], %r2;
\tret;
}
"""


def test_count_sees_predicated_instructions():
    report = CompileReport(ptx=_PTX)
    assert report.count("st.shared.u32") == 2  # one under @%p1, one under @!%p1
    assert report.count("st.global") == 2
    assert report.has("bar.sync") and not report.has("ldmatrix")
    assert report.local_memory_ops == 2  # st.local + ld.local in the helper


def test_ptxas_resources_per_entry():
    kernels = {k.name: k for k in ptxas_resources(_PTX)}
    assert set(kernels) == {"spilled", "registers_only"}
    assert kernels["spilled"].stack_frame > 0
    assert kernels["registers_only"].stack_frame == 0
    assert kernels["registers_only"].static_smem == 256
    assert all(k.registers > 0 for k in kernels.values())
    assert CompileReport(ptx=_PTX, kernels=list(kernels.values())).spills == 0


def test_parse_matches_frames_by_name():
    # A helper's properties printed between an entry's name and its register line must not be
    # taken for the entry's.
    log = "\n".join([
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'",
        "ptxas info    : Function properties for helper",
        "    48 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads",
        "ptxas info    : Function properties for k",
        "    16 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads",
        "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem",
        "ptxas info    : Compiling entry function 'plain' for 'sm_90a'",
        "ptxas info    : Used 32 registers, used 0 barriers",
    ])
    k, plain = parse_ptxas_log(log)
    assert (k.name, k.registers, k.stack_frame, k.spill_stores, k.spill_loads, k.static_smem) == (
        "k", 255, 16, 4, 12, 1024
    )
    assert (plain.name, plain.registers, plain.stack_frame, plain.spill_stores) == ("plain", 32, 0, 0)
    assert CompileReport(ptx="", kernels=[k, plain]).spills == 16


@cute.kernel
def _iota_kernel(dst: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    dst[tidx] = cutlass.Float32(tidx)


@cute.jit
def _iota(dst: cute.Tensor, stream):
    _iota_kernel(dst).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


@cute.jit
def _iota_twice(dst: cute.Tensor, stream):
    _iota_kernel(dst).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)
    _iota_kernel(dst).launch(grid=(1, 1, 1), block=(32, 1, 1), smem=3072, stream=stream)


def test_compile_with_report_on_cpu(tmp_path, monkeypatch):
    # The DSL's default dump directory is the working directory when it was imported.
    start = Path.cwd()
    ptx_before = set(start.glob("*.ptx"))
    monkeypatch.chdir(tmp_path)
    dst = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (32,), assumed_align=16)
    compiled, report = compile_with_report(_iota, dst, cute.runtime.make_fake_stream())
    assert compiled is not None
    assert ".target sm_90a" in report.ptx
    assert report.has("st.global")
    assert len(report.kernels) == 1 and report.kernels[0].registers > 0
    assert report.spills == 0 and report.local_memory_ops == 0
    assert report.launch_smem == [0]
    assert "regs=" in report.summary()
    # the kept PTX file lands in neither working directory
    assert list(tmp_path.iterdir()) == [] and set(start.glob("*.ptx")) == ptx_before


def test_launch_smem_of_each_launch():
    """The host code's dynamic shared memory per launch, in launch order."""
    dst = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (32,), assumed_align=16)
    _, report = compile_with_report(_iota_twice, dst, cute.runtime.make_fake_stream())
    assert report.launch_smem == [0, 3072]
