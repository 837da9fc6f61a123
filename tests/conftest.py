"""Test tiers: CPU tests always run; tests marked ``gpu`` need a CUDA device and are skipped without one."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


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


if not os.environ.get("CUTE_KDA_CACHE_DIR"):
    # Tests never read or fill the user's compile cache (~/.cache/cute_kda): one fresh folder per run.
    import atexit
    import shutil
    import tempfile

    _CACHE_DIR = tempfile.mkdtemp(prefix="cute_kda_test_cache_")
    os.environ["CUTE_KDA_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, True)
