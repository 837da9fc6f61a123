"""cute_kda: Kimi Delta Attention kernels for Hopper in the CUTLASS CuTe DSL.

Importing the package needs neither a GPU nor a CUDA driver; kernels compile on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

_API = ("kda_forward", "chunk_kda", "warmup")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'cute_kda' has no attribute {name!r}")


__all__ = list(_API)
