"""PTX checks shared by the compile tests: the two band-scan kernels' (K2 and Kernel A) band copies, and the words a
vector load brings that nothing reads."""

from __future__ import annotations

import re


def assert_band_image_copies(report, warp_cols: int, dim: int) -> None:
    """The kept band matrix (Kernel A's snapshot, K2's checkpoint) leaves as D / 8 one-dimensional bulk copies of
    ``warp_cols · 16`` bytes in one run after an ``elect.sync``, committed as one bulk group; every bulk group's
    shared-memory read is waited for."""
    lines = report.ptx.splitlines()
    copies = [i for i, line in enumerate(lines) if "cp.async.bulk.global.shared::cta.bulk_group" in line]
    assert len(copies) == dim // 8 and copies == list(range(copies[0], copies[0] + dim // 8))
    before = lines[max(0, copies[0] - 24): copies[0]]
    assert any("elect.sync" in line for line in before)
    sizes = {lines[i].split(",")[-1].strip(" ;") for i in copies}
    assert len(sizes) == 1
    size = sizes.pop()
    assert size == str(warp_cols * 16) or any(line.split() == ["mov.b32", f"{size},", f"{warp_cols * 16};"]
                                              for line in before), size
    assert "cp.async.bulk.commit_group" in lines[copies[-1] + 1]
    assert report.count("cp.async.bulk.wait_group.read") == report.count("cp.async.bulk.commit_group")


def unread_vector_words(ptx: str) -> list[str]:
    """The registers of global vector loads (``ld.global….v2 / .v4 {…}``) that no other instruction names: data a
    kernel moves and then never uses (a row's operand read from the wrong register, say; LLVM drops a scalar load
    whose value nothing reads, but keeps the vector it comes in)."""
    unread = []
    for load in re.finditer(r"^\s*(?:@!?%\w+\s+)?ld\.global[.\w]*\s+\{([^}]*)\}", ptx, re.M):
        for register in (name.strip() for name in load.group(1).split(",")):
            if len(re.findall(re.escape(register) + r"\b", ptx)) < 2:
                unread.append(register)
    return unread
