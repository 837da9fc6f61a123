"""Compile cache and torch → CuTe glue shared by the launchers in ``cute_kda.ops``.

A kernel variant is compiled once per *static configuration* (the key: dtypes, flags, tile
parameters; never sizes that vary per call) and reused. The first compile of a key prints one line
to stderr; set ``CUTE_KDA_QUIET=1`` to silence it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Hashable

QUIET_ENV = "CUTE_KDA_QUIET"


class CompileCache:
    """Compiled kernel callables keyed by static configuration."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._compiled: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The compiled callable for ``key``, building it with ``build()`` on first use."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                start = time.perf_counter()
                compiled = build()
                self._compiled[key] = compiled
                if os.environ.get(QUIET_ENV, "") in ("", "0"):
                    print(
                        f"cute_kda: compiled {self.name} {key} in {time.perf_counter() - start:.1f}s "
                        f"(once per configuration; {QUIET_ENV}=1 silences this)",
                        file=sys.stderr,
                    )
        return compiled


def to_cute_tensor(tensor: Any, *, assumed_align: int = 16, leading_dim: int | None = None) -> Any:
    """DLPack-convert ``tensor`` for a launch, its shape and strides dynamic (one compile serves all sizes)."""
    from cutlass.cute.runtime import from_dlpack

    converted = from_dlpack(tensor, assumed_align=assumed_align)
    if leading_dim is None:
        leading_dim = tensor.dim() - 1
    return converted.mark_layout_dynamic(leading_dim=leading_dim)


def device_index(device: Any) -> int:
    """CUDA ordinal of a torch device (``cuda`` without an index means the current device)."""
    import torch

    return torch.cuda.current_device() if device.index is None else device.index


def current_stream(device: Any) -> Any:
    """The caller's current CUDA stream on ``device`` as a ``CUstream`` for DSL launches."""
    import torch
    from cuda.bindings import driver

    return driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
