"""The boundary between the product and the teaching kernels (``teaching/``, beside the package)."""

from __future__ import annotations

import ast
from pathlib import Path

from teaching.ops import _cache, gemm, roundtrip

PACKAGE = Path(__file__).resolve().parents[1] / "cute_kda"


def _imported_modules(path: Path) -> set[str]:
    """Every absolute module name an import statement of ``path`` names, function-level ones included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_package_imports_nothing_of_teaching():
    offenders = {str(path.relative_to(PACKAGE)): sorted(name for name in _imported_modules(path)
                                                         if name.split(".")[0] == "teaching")
                 for path in PACKAGE.rglob("*.py")}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_teaching_caches_are_named_after_their_sources(monkeypatch, tmp_path):
    # cute_kda's disk-cache fingerprint covers cute_kda only: the digest in the name keeps an edited
    # teaching kernel from loading its old compile.
    digest = _cache.sources_digest()
    assert gemm._GEMM.name == f"gemm_multistage-{digest}"
    assert roundtrip._CACHE.name == f"transpose_roundtrip-{digest}"
    (tmp_path / "kernel.py").write_text("x = 1\n")
    monkeypatch.setattr(_cache, "TEACHING", tmp_path)
    _cache.sources_digest.cache_clear()
    try:
        first = _cache.sources_digest()
        _cache.sources_digest.cache_clear()
        (tmp_path / "kernel.py").write_text("x = 2\n")
        assert _cache.sources_digest() != first
    finally:
        _cache.sources_digest.cache_clear()
