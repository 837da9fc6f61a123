"""Compile cache and torch → CuTe glue shared by the launchers in ``cute_kda.ops``.

A kernel variant is compiled once per *static configuration* (the key: dtypes, flags, tile
parameters; never sizes that vary per call) and reused. The first compile of a key prints one line
to stderr; set ``CUTE_KDA_QUIET=1`` to silence it.

Launchers compile with a TVM-FFI entry point (:func:`compile_for_launch`): the compiled function
takes the torch tensors themselves and reads their DLPack descriptors in C, checking dtype, rank
and device against what it was compiled for. Converting every tensor to a DSL tensor in Python on
each call (:func:`to_cute_tensor`, ~15-20 µs a tensor) is what the compile alone needs. So each
launcher builds its arguments with one function and a ``tensor`` converter: :func:`to_cute_tensor`
for the compile, :func:`launch_tensor` (the tensor as it is) for the launch.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Hashable

QUIET_ENV = "CUTE_KDA_QUIET"
TVM_FFI_OPTION = "--enable-tvm-ffi"


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


def to_cute_tensor(tensor: Any, assumed_align: int = 16, *, leading_dim: int | None = None) -> Any:
    """DLPack-convert ``tensor`` for a compile, its shape and strides dynamic (one compile serves all sizes).

    ``assumed_align``: bytes the base address is promised to be aligned to. None stays None (an
    absent optional argument).
    """
    if tensor is None:
        return None
    from ..dsl import cute

    converted = cute.runtime.from_dlpack(tensor, assumed_align=assumed_align)
    if leading_dim is None:
        leading_dim = tensor.dim() - 1
    return converted.mark_layout_dynamic(leading_dim=leading_dim)


def launch_tensor(tensor: Any, assumed_align: int = 16) -> Any:
    """A tensor argument as a :func:`compile_for_launch` function takes it: unchanged (see the module doc)."""
    return tensor


def compile_for_launch(kernel: Any, *args: Any) -> Any:
    """``cute.compile`` with the TVM-FFI entry point, from :func:`to_cute_tensor` arguments.

    The result is called with torch tensors in place of the converted ones, Python scalars and the
    stream; the kernel code is the same as a plain compile's (checked on the PTX in the tests).
    """
    from ..dsl import cute

    return cute.compile(kernel, *args, options=TVM_FFI_OPTION)


def device_index(device: Any) -> int:
    """CUDA ordinal of a torch device (``cuda`` without an index means the current device)."""
    import torch

    return torch.cuda.current_device() if device.index is None else device.index


def current_stream(device: Any) -> Any:
    """The caller's current CUDA stream on ``device`` as a ``CUstream`` for DSL launches."""
    import torch
    from cuda.bindings import driver

    return driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
