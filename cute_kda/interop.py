"""DLPack in and out: the API takes any DLPack tensor and answers in the caller's framework.

Inputs are turned into torch views (``torch.from_dlpack``: no copy, same memory), the work is
done on torch tensors, and results go back through DLPack to the framework of ``q``: torch in →
torch out, CuPy in → CuPy out, JAX in → JAX out; any other DLPack producer gets torch tensors.

Streams. For torch callers the work runs on torch's current stream. For CuPy callers it runs on
CuPy's current stream (entered as a torch ``ExternalStream`` for the duration of the call), so it
is ordered with the caller's other CuPy work exactly like a CuPy kernel would be. DLPack's own
stream handshake (``__dlpack__(stream=...)``) orders the hand-over in both directions for
producers whose stream we cannot see (JAX).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class DLPackTensor(Protocol):
    """What the entry points take as a tensor: any DLPack producer (a torch tensor, a CuPy or JAX array)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[int, int]: ...

TORCH, CUPY, JAX, OTHER = "torch", "cupy", "jax", "other"


def framework_of(array: Any) -> str:
    """Which framework produced ``array``: ``"torch"``, ``"cupy"``, ``"jax"`` or ``"other"``."""
    if isinstance(array, torch.Tensor):
        return TORCH
    root = type(array).__module__.split(".")[0]
    if root == "cupy":
        return CUPY
    if root in ("jax", "jaxlib"):
        return JAX
    return OTHER


def as_torch(array: Any) -> Any:
    """A torch view of a DLPack tensor; torch tensors and None pass through, other objects too
    (validation then names the offending argument)."""
    if array is None or isinstance(array, torch.Tensor) or not hasattr(array, "__dlpack__"):
        return array
    return torch.from_dlpack(array)


def to_framework(tensor: torch.Tensor | None, framework: str) -> Any:
    """``tensor`` handed back to ``framework`` through DLPack (no copy); torch for torch/other."""
    if tensor is None or framework in (TORCH, OTHER):
        return tensor
    if framework == CUPY:
        import cupy

        return cupy.from_dlpack(tensor)
    import jax.numpy as jnp

    return jnp.from_dlpack(tensor)


@contextlib.contextmanager
def caller_stream(framework: str, array: Any) -> Iterator[None]:
    """Make torch's current stream the caller's current stream for the duration of the call.

    Only CuPy exposes its current stream; for torch nothing needs doing, for other frameworks
    DLPack's stream handshake orders the hand-over.
    """
    if framework != CUPY:
        yield
        return
    import cupy

    with cupy.cuda.Device(array.device.id):
        pointer = cupy.cuda.get_current_stream().ptr
        device = torch.device("cuda", array.device.id)
        stream = torch.cuda.default_stream(device) if pointer == 0 else torch.cuda.ExternalStream(pointer, device=device)
        with torch.cuda.stream(stream):
            yield


def answer_in_framework(array: Any, run: Callable[[], tuple]) -> tuple:
    """``run()`` (work on torch tensors, returning a tuple of tensors or None) for a caller whose arrays are
    ``array``'s: on the caller's stream, the results handed back to its framework; torch callers get
    ``run()``'s tuple as it is."""
    if isinstance(array, torch.Tensor):
        return run()
    framework = framework_of(array)
    with caller_stream(framework, array):
        return tuple(to_framework(x, framework) for x in run())
