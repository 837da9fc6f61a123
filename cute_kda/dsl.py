"""Single place that imports the CUTLASS CuTe DSL.

The DSL reads ``CUTE_DSL_ARCH`` when it is first imported; on a machine without a GPU it cannot
detect the architecture, so we default it to ``sm_90a`` (every kernel here targets Hopper and the
H200 is sm_90a, so the default is also right on the GPU). Import ``cutlass`` through this module,
never directly, so that the order is always right.
"""

from __future__ import annotations

import os

TARGET_ARCH = "sm_90a"
os.environ.setdefault("CUTE_DSL_ARCH", TARGET_ARCH)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

__all__ = ["TARGET_ARCH", "cutlass", "cute"]
