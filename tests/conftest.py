"""Test tiers: CPU tests always run; tests marked ``gpu`` need a CUDA device and are skipped without one."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_KDA_QUIET", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    import torch

    return torch.device("cuda")


@pytest.fixture(autouse=True)
def _seeded_rng():
    """Every test starts from the same global RNG state, so a failure reproduces run to run."""
    import numpy as np
    import torch

    torch.manual_seed(20261129)
    np.random.seed(20261129)
