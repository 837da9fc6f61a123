"""The compile caches of the teaching launchers: cute_kda's cache, with this folder's sources in the name.

cute_kda's disk cache keeps compiled kernels under a fingerprint of cute_kda's own sources, so an edit
there compiles afresh. The teaching kernels sit outside that package: without more, an edited teaching
kernel would load its old compile from disk. Each cache name therefore carries a digest of the
teaching sources (every ``*.py`` under ``teaching/``), and an edit here starts new entries too.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from cute_kda.ops._cache import CompileCache

TEACHING = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """SHA-256 (hex, first 12 digits) over the paths and contents of the teaching sources."""
    digest = hashlib.sha256()
    for path in sorted(TEACHING.rglob("*.py")):
        content = path.read_bytes()
        digest.update(path.relative_to(TEACHING).as_posix().encode() + b"\0")
        digest.update(len(content).to_bytes(8, "little") + content)
    return digest.hexdigest()[:12]


def teaching_cache(name: str) -> CompileCache:
    """A :class:`~cute_kda.ops._cache.CompileCache` named ``<name>-<sources digest>``."""
    return CompileCache(f"{name}-{sources_digest()}")
