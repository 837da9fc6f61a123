"""Host-side facts about a CUDA device, each queried once per device (no sync, no device memory)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (a host-side property query, no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``device_index``."""
    return torch.cuda.get_device_capability(device_index)
