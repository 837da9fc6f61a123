"""A fresh checkout's first run: the Makefile's torch choice, the package metadata, the documents the
code points readers to, and what the demo's compile report covers (CPU tier)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _make_recipe(*overrides: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "-n", "-B", ".venv/.ready", *overrides], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_makefile_takes_the_cpu_torch_without_a_gpu():
    recipe = _make_recipe("HAS_GPU=")
    torch_line = next(line for line in recipe.splitlines() if "torch==" in line)
    first, _, fallback = torch_line.partition("||")
    assert '"torch==2.13.0+cpu"' in first and "--index-url" not in first  # what pip finds as configured
    assert "--index-url https://download.pytorch.org/whl/cpu" in fallback and "torch==2.13.0+cpu" in fallback


def test_makefile_takes_the_default_torch_with_a_gpu():
    recipe = _make_recipe("HAS_GPU=1")
    torch_line = next(line for line in recipe.splitlines() if "torch==" in line)
    assert '"torch==2.13.0"' in torch_line and "+cpu" not in torch_line and "index-url" not in torch_line


def test_package_metadata_has_an_spdx_license_and_no_deprecation_warnings(tmp_path):
    code = ("import warnings; warnings.simplefilter('always'); from setuptools import build_meta; "
            f"print(build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "deprecat" not in (proc.stdout + proc.stderr).lower(), proc.stderr
    metadata = (tmp_path / proc.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata


# docs/contributing/gpu.md is the maintainers' page on building the offline GPU bundle, which starts from their
# shared tools next to the repository; every other page and docstring is for users.
MAINTAINER_PAGES = {"docs/contributing/gpu.md"}


def _user_facing_files() -> list[Path]:
    """README, examples, docs and the package sources: the tracked ones (a fresh clone's view)."""
    try:
        listed = subprocess.run(["git", "ls-files", "README.md", "examples", "docs", "cute_kda"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed if name.endswith((".py", ".md")) and name not in MAINTAINER_PAGES
            and (ROOT / name).exists()]


def test_no_pointer_outside_the_repository():
    offenders = [str(p.relative_to(ROOT)) for p in _user_facing_files() if "../shared" in p.read_text()]
    assert offenders == []


def test_every_docs_page_pointed_to_exists():
    missing = set()
    for path in _user_facing_files():
        for name in re.findall(r"docs/([\w.-]+\.md)", path.read_text()):
            if not (ROOT / "docs" / name).exists():
                missing.add(f"{path.relative_to(ROOT)} → docs/{name}")
    assert sorted(missing) == []
    design = (ROOT / "docs" / "design.md").read_text()
    for section in ("## 1. ", "## 2. ", "## 3. ", "## 4. ", "## 5. ", "## 6. "):  # cited as design.md §1 … §6
        assert section in design


def test_readme_api_block_names_every_keyword_of_kda_forward():
    import inspect

    import cute_kda

    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("cute_kda.kda_forward("):]
    block = block[: re.search(r"\n\s*\)\n", block).start()]  # up to the call's closing parenthesis
    for name in inspect.signature(cute_kda.kda_forward).parameters:
        if name not in ("q", "k", "v", "g", "beta"):
            assert f"{name}=" in block, name


def test_demo_compile_report_covers_every_kernel():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import demo
    finally:
        sys.path.pop(0)
    labels = [build.label for build in demo.kernel_builds(all_variants=False)]
    assert any(label.startswith("tile prefix") for label in labels)
    assert sum(label.startswith("K1 prepare") for label in labels) == 5  # safe gate fixed / varlen, unbounded, GDN
    assert any("softplus" in label for label in labels) and any("log decay" in label for label in labels)
    default = demo.k2_variants(False)
    assert {v[0] for v in default} == {False, True}  # varlen
    assert {v[1] for v in default} == set(demo.STATE_NAMES)  # every state dtype (None: no state)
    assert {v[2] for v in default} == {1, 2, 4}  # every V-split
    every = demo.k2_variants(True)
    assert len(set(every)) == len(every) == 54
    assert sum(label.startswith("Kernel A") for label in labels) == 2  # V-split 1 and 8
    assert sum(label.startswith("Kernel B") for label in labels) == 3  # the safe, the per-head, the per-channel gate
    assert len(demo.kernel_builds(all_variants=True)) == 5 + 1 + 54 + 2 + 3 + 1
