"""cute_kda: Kimi Delta Attention kernels for Hopper in the CUTLASS CuTe DSL.

Importing the package needs neither a GPU nor a CUDA driver; kernels compile on first use. Entry points:
:func:`kda_forward`, :func:`chunk_kda` (FLA's KDA signature), :func:`chunk_gated_delta_rule` (FLA's
GatedDeltaNet signature), :func:`warmup`. With flash-linear-attention installed, ``fla.ops.kda.chunk_kda``
dispatches the calls cute_kda computes here (:mod:`cute_kda.fla_backend`; ``FLA_CUTE_KDA=0`` opts out).
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import fla_backend as _fla_backend  # noqa: E402  (stdlib only: registers with FLA if and when it is imported)

_fla_backend.install()

_API = ("kda_forward", "chunk_kda", "chunk_gated_delta_rule", "warmup")


def __getattr__(name: str):
    if name in _API:
        from . import api

        value = globals()[name] = getattr(api, name)  # later look-ups skip this hook
        return value
    raise AttributeError(f"module 'cute_kda' has no attribute {name!r}")


__all__ = list(_API)
