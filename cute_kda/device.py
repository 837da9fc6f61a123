"""Host-side facts about a CUDA device, each queried once per device (no sync, no device memory)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (a host-side property query, no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def available_sms(device: torch.device) -> int:
    """The SMs of a CUDA ``device`` (:func:`sm_count`); 0 elsewhere (the reference stages: nothing runs side by
    side there)."""
    return sm_count(device.index) if device.type == "cuda" else 0


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``device_index``."""
    return torch.cuda.get_device_capability(device_index)


SUPPORTED_ARCH = (9, 0)  # the kernels are built for sm_90a (Hopper: H100, H200, H20)


def unsupported_reason(device_index: int) -> str | None:
    """Why the kernels cannot run on CUDA device ``device_index`` (its compute capability is not sm_90), or None."""
    major, minor = capability(device_index)
    if (major, minor) != SUPPORTED_ARCH:
        return (f"cute_kda's kernels are built for sm_90a (Hopper: H100, H200, H20); cuda:{device_index} is "
                f"sm_{major}{minor} ({torch.cuda.get_device_name(device_index)})")
    return None


def check_supported(device: torch.device) -> None:
    """Raise ``RuntimeError`` before anything compiles or launches on a device the kernels do not support (a host
    query, cached per device)."""
    if device.type != "cuda":
        return  # validation.check_on_cuda names that error
    reason = unsupported_reason(torch.cuda.current_device() if device.index is None else device.index)
    if reason is not None:
        raise RuntimeError(reason)
