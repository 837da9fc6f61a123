"""Issue 34's model peak (docs/perf-log.md, M1): the training executor keeps no buffer of a call past its backward.

Two chained calls (two layers of a model) through :func:`cute_kda.executors.training.kda_forward` on the reference
stages, each stage's result tracked by weak references: after the backward, every tensor a stage made is freed (the
recomputed workspace and checkpoints, Kernel A's snapshots, the gradients' buffers once autograd has summed them),
except the outputs the caller still holds. A retained workspace and checkpoints per layer is one of the two causes
that fit the +1.1 GB measured on the H200; this rules it out for the executor (not for the kernels' launchers)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from cute_kda.executors import stages, training
from cute_kda.executors.stages import Backend
from cute_kda.reference.backend import REFERENCE


def tracking(backend: Backend, made: list) -> Backend:
    """``backend`` whose stages record (stage.field, weak reference) for every tensor of their results."""

    def walk(value, path: str) -> None:
        if isinstance(value, torch.Tensor):
            made.append((path, weakref.ref(value)))
        elif isinstance(value, tuple):
            for name, item in zip(getattr(value, "_fields", range(len(value))), value):
                walk(item, f"{path}.{name}")

    def wrap(stage, name: str):
        def tracked(*args, **kwargs):
            result = stage(*args, **kwargs)
            walk(result, name)
            return result

        return tracked

    return Backend("tracked", wrap(backend.forward, "forward"), wrap(backend.scan, "scan"),
                   wrap(backend.grads, "grads"))


@pytest.mark.filterwarnings("ignore:cute_kda mirror on CPU")
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_no_stage_buffer_outlives_the_backward(recompute):
    made: list = []
    backend = tracking(REFERENCE, made)
    gen = torch.Generator().manual_seed(0)
    shape = (1, 32, 2, 128)
    q, k, v, g = (torch.randn(shape, generator=gen).bfloat16().requires_grad_() for _ in range(4))
    beta = torch.randn(shape[:3], generator=gen).bfloat16().requires_grad_()
    A_log, dt_bias = torch.zeros(2, requires_grad=True), torch.zeros(2, 128, requires_grad=True)
    layer = dict(backend=backend, A_log=A_log, dt_bias=dt_bias, recompute=recompute)
    first, _ = training.kda_forward(q, k, v, g, beta, **layer)
    second, _ = training.kda_forward(q, k, first, g, beta, **layer)
    kept_before = {path for path, ref in made if ref() is not None}
    if not recompute:
        assert {"forward.saved.workspace", "forward.saved.checkpoints"} <= kept_before  # held for the backward
    second.float().square().sum().backward()
    gc.collect()
    held = {t.untyped_storage().data_ptr() for t in (first, second)}  # the outputs (views of the stages' out)
    alive = [path for path, ref in made if ref() is not None and ref().untyped_storage().data_ptr() not in held]
    assert alive == [], f"buffers still alive after the backward: {alive}"
    assert q.grad is not None and A_log.grad is not None
    stages = {path.split(".")[0] for path, _ in made}
    assert stages == {"forward", "scan", "grads"}  # the backward ran every stage (and, recomputing, the forward again)
    assert sum(path == "forward.out" for path, _ in made) == 2  # the recomputation forms no o


@pytest.mark.parametrize("group", [2, 4])
def test_group_sum_rounds_the_fp32_sum_once(group):
    """Grouped value heads' dq, dk: the per-value-head bf16 gradients summed per q/k head in fp32 and rounded once
    (a group of two by one elementwise add); values spread over 16 binades, where a sum of two is exact in fp32."""
    gen = torch.Generator().manual_seed(group)
    t = (torch.randn(2, 33, 3 * group, 128, generator=gen) * 2.0 ** torch.randint(-8, 8, (2, 33, 3 * group, 128),
                                                                                     generator=gen)).bfloat16()
    got = stages.group_sum(t, 3)
    exact = t.double().view(2, 33, 3, group, 128).sum(3)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 33, 3, 128)
    if group == 2:  # a sum of two bf16 values is exact in fp32: the result is the exact sum rounded once
        assert torch.equal(got, exact.bfloat16())
    else:
        assert torch.allclose(got.double(), exact, rtol=2 ** -7, atol=0)
    assert stages.group_sum(t, 3 * group) is t
