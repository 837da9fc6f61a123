"""Compile cache and torch → CuTe glue shared by the launchers in ``cute_kda.ops``.

A kernel variant is compiled once per *static configuration* (the key: dtypes, flags, tile
parameters; never sizes that vary per call) and reused: in memory for the life of the process, and
on disk across processes (:mod:`._disk_cache`: ``$CUTE_KDA_CACHE_DIR``, default
``~/.cache/cute_kda``; ``CUTE_KDA_DISK_CACHE=0`` turns it off). The first compile of a key in a
process is logged at INFO on the ``cute_kda.compile`` logger (a load from disk logs nothing): a first call that
compiles takes seconds, and ``logging.getLogger("cute_kda").setLevel(logging.INFO)`` (with a handler) shows why.

Compiles start from *fake* tensors (:func:`to_cute_tensor`: dtype, rank, alignment, the contiguous
mode; every extent and stride dynamic), never from device memory, so a variant can be compiled
without allocating anything and on a machine without a GPU. Launchers compile with a TVM-FFI entry
point (:func:`compile_for_launch`): the compiled function takes the torch tensors themselves and
reads their DLPack descriptors in C, checking dtype, rank, device type and alignment against what it
was compiled for. So each launcher builds its arguments with one function and a ``tensor``
converter: :func:`to_cute_tensor` for the compile, :func:`launch_tensor` (the tensor as it is) for
the launch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Hashable

import torch

from . import _disk_cache

logger = logging.getLogger("cute_kda.compile")
TVM_FFI_OPTION = "--enable-tvm-ffi"


class CompileCache:
    """Compiled kernel callables keyed by static configuration, in memory and on disk.

    ``stats`` counts how each key of this process was had: ``compiled`` (built here), ``loaded``
    (from the disk cache); repeated hits in memory are not counted.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._compiled: dict[Hashable, Any] = {}
        # One lock per key, so a build (seconds, or minutes waiting on another process's flock of that entry) holds
        # back only the threads that want the same key; ``_guard`` covers the dicts and the counts, never a build.
        self._key_locks: dict[Hashable, threading.Lock] = {}
        self._guard = threading.Lock()
        self.stats: Counter[str] = Counter()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The compiled callable for ``key``: from memory, else from the disk cache, else ``build()``
        (whose result is then saved to disk when it is a TVM-FFI function)."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._key_lock(key):
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._load_or_build(key, build)
                with self._guard:
                    self._compiled[key] = compiled
        return compiled

    def clear(self) -> None:
        """Forget the in-memory entries (the disk cache is left as it is)."""
        with self._guard:
            self._compiled.clear()

    def _key_lock(self, key: Hashable) -> threading.Lock:
        with self._guard:
            return self._key_locks.setdefault(key, threading.Lock())

    def _count(self, how: str) -> None:
        with self._guard:
            self.stats[how] += 1

    def _load_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        root = _disk_cache.cache_root()
        if root is None:
            return self._build(key, build, saved=None)
        entry = _disk_cache.entry_for(root, self.name, key)
        compiled = _disk_cache.load(entry)
        if compiled is not None:
            self._count("loaded")
            return compiled
        with _disk_cache.locked(entry) as have_lock:
            if have_lock:
                compiled = _disk_cache.load(entry)  # another process may have written it meanwhile
                if compiled is not None:
                    self._count("loaded")
                    return compiled
                _disk_cache.discard(entry)  # whatever is there did not verify: never trusted
            return self._build(key, build, saved=entry if have_lock else None)

    def _build(self, key: Hashable, build: Callable[[], Any], saved: _disk_cache.Entry | None) -> Any:
        start = time.perf_counter()
        compiled = build()
        seconds = time.perf_counter() - start
        self._count("compiled")
        where = ""
        if saved is not None and _disk_cache.store(saved, compiled, seconds):
            where = f", saved to {saved.obj.parent}"
        logger.info("compiled %s %s in %.1fs%s (once per configuration)", self.name, key, seconds, where)
        return launch_entry(compiled)


def launch_entry(compiled: Any) -> Any:
    """What a launch calls for a DSL compile: its TVM-FFI function, the object the disk cache loads
    back, so a fresh compile and a loaded one take one call path. The compiled object's own
    ``__call__`` puts a generated keyword-argument wrapper in front of that function (several µs a
    launch on the H200) for signatures with defaults or dataclasses, which the launchers do not need:
    they pass every argument positionally, tensors and NamedTuples of tensors. A compile with raw
    pointer arguments (converted in that ``__call__``) or without TVM-FFI is returned as it is."""
    unwrap = getattr(compiled, "__tvm_ffi_object__", None)
    function = None if unwrap is None else unwrap()
    if function is None or compiled.execution_args.has_pointer_address_arg_specs:
        return compiled
    return function


def _dsl_type(dtype: Any) -> Any:
    from ..dsl import cutlass

    types = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32,
             torch.int64: cutlass.Int64, torch.int32: cutlass.Int32, torch.int16: cutlass.Int16,
             torch.int8: cutlass.Int8, torch.uint8: cutlass.Uint8}
    try:
        return types[dtype]
    except KeyError:
        raise TypeError(f"no CuTe DSL element type for {dtype}") from None


def to_cute_tensor(tensor: Any, assumed_align: int = 16, *, leading_dim: int | None = None,
                   memspace: Any = None) -> Any:
    """A fake DSL tensor describing ``tensor`` for a compile: no memory is touched.

    It keeps ``tensor``'s dtype and rank; every extent and stride is dynamic (one compile serves all
    sizes) except the stride of ``leading_dim`` (default: the last mode), which is 1, the other
    modes row-major around it — a C-contiguous tensor, as the launchers pass. ``tensor`` may live
    anywhere, ``meta`` included. ``assumed_align``: bytes the base address is promised to be
    aligned to. ``memspace``: the DSL address space, default global memory (the compiled entry then
    takes CUDA tensors); :func:`dlpack_tensor` gives the DLPack description of a real tensor
    instead. None stays None (an absent optional argument).
    """
    if tensor is None:
        return None
    from ..dsl import cute

    ndim = tensor.dim()
    leading = ndim - 1 if leading_dim is None else leading_dim
    outer = [d for d in range(ndim) if d != leading]  # row-major: the last of these is the next inner
    order = [0] * ndim
    for rank, mode in enumerate(reversed(outer), start=1):
        order[mode] = rank
    options = {} if memspace is None else {"memspace": memspace}
    return cute.runtime.make_fake_compact_tensor(
        _dsl_type(tensor.dtype), tuple(cute.sym_int() for _ in range(ndim)), stride_order=tuple(order),
        assumed_align=assumed_align, **options,
    )


def dlpack_tensor(tensor: Any, assumed_align: int = 16, *, leading_dim: int | None = None) -> Any:
    """``tensor`` DLPack-converted for a compile, its shape and strides dynamic (the description the
    launchers compiled from before :func:`to_cute_tensor` made them fake: generic address space,
    the device of ``tensor``). Kept for tests that compare the two."""
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
    """``cute.compile`` with the TVM-FFI entry point, from :func:`to_cute_tensor` arguments and a
    fake stream (``cute.runtime.make_fake_stream()``) or a real one.

    The result is called with torch tensors in place of the converted ones, Python scalars and the
    stream; the kernel code is the same as a plain compile's (checked on the PTX in the tests).
    """
    from ..dsl import cute

    return cute.compile(kernel, *args, options=TVM_FFI_OPTION)


def dsl_type(dtype: Any) -> Any:
    """The DSL element type of a torch dtype the kernels take (bf16, fp16, fp32; None stays None: no tensor)."""
    from ..dsl import cutlass

    return {None: None, torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32}[dtype]


def device_index(device: Any) -> int:
    """CUDA ordinal of a torch device (``cuda`` without an index means the current device)."""
    return torch.cuda.current_device() if device.index is None else device.index


def fake_stream() -> Any:
    """A stream placeholder for compiles (the compiled entry takes the real stream per call)."""
    from ..dsl import cute

    return cute.runtime.make_fake_stream()


def current_stream_handle(index: int) -> int:
    """The raw handle of torch's current CUDA stream on device ``index`` (no ``torch.cuda.Stream``
    object is built: the lookup torch's own compiled code uses)."""
    return torch._C._cuda_getCurrentRawStream(index)


_CUSTREAMS: dict[int, Any] = {}


def cu_stream(handle: int) -> Any:
    """A ``CUstream`` for a raw stream handle, built once per handle (it only wraps the value)."""
    stream = _CUSTREAMS.get(handle)
    if stream is None:
        from cuda.bindings import driver

        stream = _CUSTREAMS[handle] = driver.CUstream(handle)
    return stream


def current_stream(device: Any) -> Any:
    """The caller's current CUDA stream on ``device`` as a ``CUstream`` for DSL launches."""
    return cu_stream(current_stream_handle(device_index(device)))


_ALREADY_CURRENT = contextlib.nullcontext()  # reusable: it holds no state


def on_device(device: Any) -> Any:
    """A context that makes ``device`` current: a no-op when it already is (the common case), else
    ``torch.cuda.device(device)``."""
    if device.index is None or device.index == torch.cuda.current_device():
        return _ALREADY_CURRENT
    return torch.cuda.device(device)
