"""Test tiers: CPU tests always run; tests marked ``gpu`` need a CUDA device and are skipped without one."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _share_the_cores_among_xdist_workers() -> None:
    """Give each xdist worker its share of the cores, not all of them.

    Torch starts one OpenMP thread per core in every process, and OpenMP threads spin at each barrier; with N workers
    that is N times as many spinning threads as cores, and a token loop of small parallel ops (the fp64 gold on the
    CPU) then waits on descheduled threads at every op: 4 workers x 2 threads on 2 cores ran the gold of
    ``test_public_api_matches_gold[varlen_empty_and_short_bf16_state]`` in 90-110 s each, against 5-7 s with one thread
    each. Runs before torch is imported (OMP_NUM_THREADS) and sets torch's count too (it may be imported already).
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return
    threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ.setdefault(name, threads)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores_among_xdist_workers()


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
