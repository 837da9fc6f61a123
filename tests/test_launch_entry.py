"""The launchers compile a TVM-FFI entry point (``cute_kda.ops._cache.compile_for_launch``) so a call
takes torch tensors without converting them in Python. These CPU tests check that this entry wraps
the very kernel the compile tier inspects: same PTX as a plain compile of the same arguments, built
by each launcher's own argument function."""

from __future__ import annotations

import pytest
import torch

from cute_kda.compile_report import compile_with_report
from cute_kda.dsl import cute, cutlass
from cute_kda.ops._cache import TVM_FFI_OPTION, dsl_type, to_cute_tensor
from cute_kda.workspace import WorkspaceSpec, allocate_workspace, tiles_per_head

D = 128


def _same_kernel(kernel, *args) -> None:
    _, plain = compile_with_report(kernel, *args)
    entry, launch = compile_with_report(kernel, *args, options=TVM_FFI_OPTION)
    assert launch.ptx == plain.ptx
    assert type(entry).__name__.startswith("TVMFFI")  # the torch-taking entry, not the DSL executor


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_prepare_entry(varlen):
    from cute_kda.kernels.fwd_prepare import prepare_kernel
    from cute_kda.ops.prepare import launch_arguments

    heads, tokens = 2, 40
    q = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 17, tokens]) if varlen else None
    tile_base = torch.tensor([0, 2, 4], dtype=torch.int32) if varlen else None
    spec = WorkspaceSpec(heads=heads, tiles=tiles_per_head(tokens, 2 if varlen else 1, varlen))
    ws = allocate_workspace(spec, "cpu")
    args = launch_arguments(q, q, q, q[..., 0].contiguous(), torch.zeros(heads), torch.zeros(heads, D), ws, D ** -0.5,
                        -5.0, tokens, cu_seqlens, tile_base, cute.runtime.make_fake_stream(), tensor=to_cute_tensor)
    _same_kernel(prepare_kernel(varlen=varlen), *args)


@pytest.mark.parametrize("gate,dtype", [("softplus", torch.bfloat16), ("none", torch.float32)])
def test_prepare_entry_unbounded_gates(gate, dtype):
    """The unbounded gates' K1 takes g in its own dtype and, for a log decay, no A_log / dt_bias (None)."""
    from cute_kda.kernels.fwd_prepare import prepare_kernel
    from cute_kda.ops.prepare import launch_arguments

    heads, tokens = 2, 40
    q = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
    constants = gate != "none"
    spec = WorkspaceSpec(heads=heads, tiles=tiles_per_head(tokens, 1, False))
    args = launch_arguments(q, q, q.to(dtype), q[..., 0].contiguous(), torch.zeros(heads) if constants else None,
                            torch.zeros(heads, D) if constants else None, allocate_workspace(spec, "cpu"), D ** -0.5,
                            -5.0, tokens, None, None, cute.runtime.make_fake_stream(), tensor=to_cute_tensor)
    _same_kernel(prepare_kernel(varlen=False, gate=gate, gate_dtype=dsl_type(dtype)), *args)


@pytest.mark.parametrize("vsplit, state", [(1, None), (4, torch.float32)], ids=["vs1-none", "vs4-fp32"])
def test_recurrence_entry(vsplit, state):
    from cute_kda.kernels.fwd_recurrence import FwdRecurrence
    from cute_kda.ops import recurrence as k2

    heads, num_seqs, tokens = 2, 2, 40
    v = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
    states = None if state is None else torch.zeros(num_seqs, heads, D, D, dtype=state)
    ws = allocate_workspace(WorkspaceSpec(heads=heads, tiles=4), "cpu")
    args = k2.launch_arguments(v, ws, torch.zeros_like(v), cu_seqlens=torch.tensor([0, 17, tokens]),
                               tile_base=torch.tensor([0, 2, 4], dtype=torch.int32), initial_state=states,
                               final_state=states, tensor=to_cute_tensor)
    dtype = None if state is None else cutlass.Float32
    kernel = FwdRecurrence(vsplit=vsplit, initial_state=dtype, final_state=dtype, varlen=True)
    _same_kernel(kernel, *args, cute.runtime.make_fake_stream())


def test_tile_prefix_entry():
    from cute_kda.kernels.tile_prefix import TilePrefixKernel

    _same_kernel(TilePrefixKernel(), to_cute_tensor(torch.tensor([0, 5, 40]), 8),
                 to_cute_tensor(torch.zeros(3, dtype=torch.int32), 4), cute.runtime.make_fake_stream())


def test_roundtrip_entry():
    from teaching.kernels.transpose_roundtrip import TransposeRoundTrip

    x = torch.zeros(48, 2, D, dtype=torch.bfloat16)
    y = torch.zeros(3 * D, 2, 16, dtype=torch.bfloat16)
    _same_kernel(TransposeRoundTrip(D), to_cute_tensor(x), to_cute_tensor(y), 1, cute.runtime.make_fake_stream())
