"""Compile a CuTe DSL kernel for sm_90a (no GPU needed) and report what the compiler made of it.

Used by the CPU compile tier (tests assert on the PTX and the resource use), by the demo, and by
anyone reading a kernel's cost before spending GPU time. Resource use comes from running the CUDA
toolkit's ``ptxas -v`` for sm_90a on the PTX the DSL produced (the DSL does not expose its own
ptxas report); registers, spills and stack frame are what the machine code will use.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

from .dsl import TARGET_ARCH, cute

# The DSL's launch configuration in the host IR: (grid[3], block[3], dynamic smem bytes, stream, attributes, count)
LAUNCH_CONFIG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


@dataclass
class KernelResources:
    """``ptxas -v`` figures for one kernel entry."""

    name: str
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    static_smem: int


@dataclass
class CompileReport:
    """PTX text plus per-kernel resources of one compiled DSL function.

    ``launch_smem``: dynamic shared-memory bytes of each kernel launch in the host code, in order
    (:func:`launch_smem_bytes`).
    """

    ptx: str
    kernels: list[KernelResources] = field(default_factory=list)
    launch_smem: list[int] = field(default_factory=list)

    def count(self, mnemonic: str) -> int:
        """Occurrences of a PTX instruction prefix, e.g. ``"ldmatrix.sync.aligned"``."""
        return len(re.findall(r"^\s*(?:@!?%?\w+\s+)?" + re.escape(mnemonic), self.ptx, re.M))

    def has(self, mnemonic: str) -> bool:
        return self.count(mnemonic) > 0

    @property
    def local_memory_ops(self) -> int:
        """``ld.local`` / ``st.local`` in the PTX (register arrays the compiler could not keep)."""
        return self.count("ld.local") + self.count("st.local")

    @property
    def spills(self) -> int:
        return sum(k.spill_stores + k.spill_loads for k in self.kernels)

    def summary(self) -> str:
        rows = [
            f"{k.name[:60]:60s} regs={k.registers:3d} stack={k.stack_frame}B "
            f"spill={k.spill_stores}/{k.spill_loads}B static_smem={k.static_smem}B"
            for k in self.kernels
        ]
        return "\n".join(rows)


def find_ptxas() -> str:
    """Path of the CUDA toolkit's ptxas (``$PTXAS``, ``PATH``, then ``/usr/local/cuda/bin``)."""
    for candidate in (os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if candidate and os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(
        "ptxas not found: install the CUDA toolkit (12.8+) or set PTXAS=/path/to/ptxas; "
        "the compile tier needs it to report registers and spills"
    )


def ptxas_resources(ptx: str, arch: str = TARGET_ARCH) -> list[KernelResources]:
    """Run ``ptxas -v`` on ``ptx`` and parse its per-entry resource lines."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [find_ptxas(), f"-arch={arch}", "-v", "-o", os.path.join(tmp, "k.cubin"), src],
            capture_output=True, text=True,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{proc.stderr}")
    return parse_ptxas_log(proc.stderr)


def parse_ptxas_log(log: str) -> list[KernelResources]:
    """Per-entry resources from a ``ptxas -v`` log, in the order ptxas compiled the entries.

    A "Function properties for NAME" block gives NAME's stack frame and spills; ptxas also prints
    such blocks for non-entry functions, anywhere in the log, so frames are matched by name.
    """
    frames: dict[str, tuple[int, int, int]] = {}
    used: list[tuple[str, int, int]] = []  # (entry, registers, static smem)
    entry = properties_of = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = m.group(1)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            properties_of = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and properties_of is not None:
            frames[properties_of] = tuple(int(x) for x in m.groups())
            properties_of = None
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            smem = re.search(r"(\d+) bytes smem", line)
            used.append((entry, int(m.group(1)), int(smem.group(1)) if smem else 0))
            entry = None
    kernels = []
    for name, registers, static_smem in used:
        stack_frame, spill_stores, spill_loads = frames.get(name, (0, 0, 0))
        kernels.append(KernelResources(
            name=name, registers=registers, stack_frame=stack_frame,
            spill_stores=spill_stores, spill_loads=spill_loads, static_smem=static_smem,
        ))
    return kernels


def launch_smem_bytes(host_ir: str) -> list[int]:
    """Dynamic shared-memory bytes of every kernel launch in the host IR of a compiled DSL function.

    The launcher stores a constant (what the kernel's ``SmemAllocator`` took) into field 2 of the
    launch configuration; SSA names are per function, so each function is read on its own.
    """
    found = []
    for body in host_ir.split("llvm.func ")[1:]:
        constants = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((\d+) : i64\) : i64", body))
        stored = {ptr: value for value, ptr in re.findall(r"llvm\.store (%\w+), (%\w+) : i64, !llvm\.ptr", body)}
        for config_field in re.findall(r"(%\w+) = llvm\.getelementptr %\w+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, "
                                       + re.escape(LAUNCH_CONFIG), body):
            found.append(int(constants[stored[config_field]]))
    return found


def compile_with_report(jit_fn: Any, *args: Any, options: str = "", **kwargs: Any) -> tuple[Any, CompileReport]:
    """``cute.compile`` ``jit_fn(*args)`` for sm_90a, keeping the PTX; return (compiled, report).

    ``args`` may be fake tensors (``cute.runtime.make_fake_compact_tensor``) and fake streams, so
    this runs on a machine without a GPU. ``options``: further compile options (e.g. the launchers'
    ``--enable-tvm-ffi``). The DSL writes the kept PTX file into a temporary directory (by default
    it would land in the working directory); the text stays in the report.
    """
    with tempfile.TemporaryDirectory() as dump_dir:
        compiled = cute.compile(jit_fn, *args, options=f"--keep-ptx --dump-dir={dump_dir} {options}", **kwargs)
        ptx = compiled.__ptx__
    return compiled, CompileReport(ptx=ptx, kernels=ptxas_resources(ptx),
                                   launch_smem=launch_smem_bytes(str(compiled.ir_module)))
