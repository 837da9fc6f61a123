"""The forward as a ``torch.library`` custom op, so ``torch.compile`` can trace calls of
:func:`cute_kda.kda_forward` and :func:`cute_kda.chunk_kda` without a graph break.

``torch.ops.cute_kda.forward`` is registered when ``cute_kda`` is imported, with a fake (meta)
implementation that gives the exact output shapes and dtypes; its real implementation is the eager
forward (``cute_kda.api._forward``: validation, variant choice, K1, K2 on the current stream). The
public functions route through the op only while Dynamo traces (``torch.compiler.is_compiling()``):
an eager call never meets the dispatcher and keeps its host cost, and DLPack/CuPy/JAX inputs keep
going through the eager path.

What the traced path changes: caller buffers (``out=``, ``final_state=``) are filled by a copy of the
op's result, and the checks that need real memory (alignment, device) run when the compiled graph
runs, inside the op. There is no backward yet: inputs that require grad raise the same
``NotImplementedError`` at trace time; ``torch.library.register_autograd`` joins the op once the
backward kernels exist.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import validation

OP_NAME = "cute_kda::forward"


@torch.library.custom_op(OP_NAME, mutates_args=())
def forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], scale: float, lower_bound: float, final_state_dtype: Optional[torch.dtype],
    vsplit: int, qk_l2norm: bool, beta_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_forward`` on torch tensors; ``final_state_dtype`` None means no final state (then the
    second output is an empty tensor), ``vsplit`` 0 means the heuristic."""
    from . import api

    final_state = None
    if final_state_dtype is not None:
        shape = _state_shape(q, v, cu_seqlens)
        final_state = torch.empty(shape, dtype=final_state_dtype, device=q.device)
    o, state = api._forward(
        q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        initial_state=initial_state, output_final_state=False, cu_seqlens=cu_seqlens, out=None,
        final_state=final_state, vsplit=vsplit or None, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
    )
    return o, (state if state is not None else q.new_empty((0,)))


@forward_op.register_fake
def _forward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                  final_state_dtype, vsplit, qk_l2norm, beta_logits):
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    if final_state_dtype is None:
        return o, q.new_empty((0,))
    return o, q.new_empty(_state_shape(q, v, cu_seqlens), dtype=final_state_dtype)


def _state_shape(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple:
    """``[N, H, V, K]``: N sequences (B, or the packed count of ``cu_seqlens``)."""
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (num_seqs, q.shape[2], v.shape[3], q.shape[3])


def kda_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
    initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None,
    out: torch.Tensor | None, final_state: torch.Tensor | None, vsplit: int | None, qk_l2norm: bool,
    beta_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`cute_kda.kda_forward` as Dynamo traces it: the same arguments and results, one op."""
    validation.check_grad_free({"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log,
                                "dt_bias": dt_bias, "initial_state": initial_state})
    validation.check_lower_bound(lower_bound)
    validation.check_vsplit(vsplit)
    validation.check_is_tensor("q", q)
    scale = q.shape[-1] ** -0.5 if scale is None else validation.check_scale(scale)
    wants_state = final_state is not None or output_final_state
    state_dtype = None
    if wants_state:
        state_dtype = (final_state.dtype if final_state is not None
                       else torch.float32 if initial_state is None else initial_state.dtype)
    o, state = forward_op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, float(scale),
                          float(lower_bound), state_dtype, vsplit or 0, bool(qk_l2norm), bool(beta_logits))
    if out is not None:
        out.copy_(o)
        o = out
    if final_state is not None:
        final_state.copy_(state)
        return o, final_state
    return o, (state if wants_state else None)


def chunk_kda(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`cute_kda.chunk_kda` as Dynamo traces it: the FLA translation, then :func:`kda_forward`."""
    from . import api

    call = api.translate_fla_call(*args, **kwargs)
    return call.run(lambda *tensors, **options: kda_forward(
        *tensors, out=None, final_state=None, vsplit=None, **options))
