"""The wheel and the sdist a user installs: built offline from a copy of the tree with setuptools' own backend (no
network, no build isolation), they carry the licence, the typing marker and the metadata pyproject.toml declares."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_IGNORED = shutil.ignore_patterns(".git", ".venv", ".gpu-*", "build", "dist", "*.egg-info", "__pycache__",
                                  ".pytest_cache", "benchmarks", "tests", "docs", "teaching", "examples")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    tree = tmp_path_factory.mktemp("tree") / "cute_kda"
    shutil.copytree(ROOT, tree, ignore=_IGNORED)
    out = tree / "dist"
    for hook in ("build_wheel", "build_sdist"):  # one process each: setuptools keeps state between the two
        script = f"import sys; from setuptools import build_meta as b; b.{hook}(sys.argv[1])"
        proc = subprocess.run([sys.executable, "-c", script, str(out)], cwd=tree, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_wheel_ships_license_typing_marker_and_metadata(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = wheel.namelist()
        assert "cute_kda/py.typed" in names
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert licenses, names
        assert b"MIT License" in wheel.read(licenses[0])
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata
    assert "Requires-Python: >=3.10" in metadata
    assert "Author: The cute_kda maintainers" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Requires-Dist: nvidia-cutlass-dsl==" in metadata
    assert not any(n.startswith(("teaching/", "tests/", "benchmarks/")) for n in names)


def test_sdist_ships_license_and_typing_marker(built):
    with tarfile.open(built["sdist"]) as sdist:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in sdist.getnames()}
    assert {"LICENSE", "cute_kda/py.typed", "pyproject.toml", "README.md"} <= names
