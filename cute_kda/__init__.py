"""cute_kda: Kimi Delta Attention kernels for Hopper in the CUTLASS CuTe DSL.

Importing the package needs neither a GPU nor a CUDA driver; kernels compile on first use. Entry points:
:func:`kda_forward`, :func:`chunk_kda` (FLA's KDA signature), :func:`chunk_gated_delta_rule` (FLA's
GatedDeltaNet signature), :func:`warmup`; for serving, :func:`fused_recurrent_kda` and
:func:`fused_recurrent_gated_delta_rule` (FLA's decode entry points on a state pool, :mod:`cute_kda.serving`).
With flash-linear-attention installed, ``fla.ops.kda.chunk_kda`` and ``fused_recurrent_kda_fwd`` dispatch the
calls cute_kda computes here (:mod:`cute_kda.fla_backend`; ``FLA_CUTE_KDA=0`` opts out).
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import fla_backend as _fla_backend  # noqa: E402  (stdlib only: registers with FLA if and when it is imported)

_fla_backend.install()

_API = ("kda_forward", "chunk_kda", "chunk_gated_delta_rule", "warmup")
_SERVING = ("fused_recurrent_kda", "fused_recurrent_gated_delta_rule")


def __getattr__(name: str):
    if name in _API or name in _SERVING:
        import importlib

        module = importlib.import_module(".api" if name in _API else ".serving", __name__)
        value = globals()[name] = getattr(module, name)  # later look-ups skip this hook
        return value
    raise AttributeError(f"module 'cute_kda' has no attribute {name!r}")


__all__ = list(_API + _SERVING)
