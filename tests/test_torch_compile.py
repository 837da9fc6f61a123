"""``torch.compile`` of code that calls ``kda_forward`` / ``chunk_kda``: the ``cute_kda::forward``
custom op (``cute_kda/executors/inference.py``).

CPU tier: the fake implementation's shapes and dtypes under ``FakeTensorMode``; ``opcheck`` of the
op; ``torch.compile(fullgraph=True)`` of a module calling each entry traces one graph holding the op
(no graph break) and answers as eager; the eager path never enters the dispatcher. The kernels are
replaced on the CPU by the fp64 gold recurrence behind ``inference.run`` (a test-only seam).

GPU tier: the same compiled modules on the real kernels, bit-equal to eager, and a CUDA-graph
replay of the compiled forward.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_kda
from cute_kda import api
from cute_kda.executors import inference
from cute_kda.reference import gold_forward

D = 128


def make_inputs(lengths, heads=2, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    varlen = len(lengths) > 1
    batch, tokens = (1, sum(lengths)) if varlen else (1, lengths[0])

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    inputs = dict(q=randn(batch, tokens, heads, D), k=randn(batch, tokens, heads, D), v=randn(batch, tokens, heads, D),
                  g=randn(batch, tokens, heads, D), beta=randn(batch, tokens, heads),
                  A_log=torch.rand(heads, generator=gen, device=device),
                  dt_bias=randn(heads, D, dtype=torch.float32))
    if varlen:
        inputs["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    return inputs


@pytest.fixture
def gold_kernels(monkeypatch):
    """The inference executor (``inference.run``) by the gold recurrence on the CPU, with the real resolution in
    front and the kernels' output dtypes and buffers: what the op's real implementation calls."""
    calls = []

    def run(call):
        x, options = call.inputs, call.options
        calls.append(options.problem)
        wants = options.final_state_dtype is not None
        o, state = gold_forward(x.q, x.k, x.v, x.g, x.beta, scale=options.scale, gate=options.gate, A_log=x.A_log,
                                dt_bias=x.dt_bias, lower_bound=options.lower_bound, qk_l2norm=options.qk_l2norm,
                                beta_logits=options.beta_logits, initial_state=x.initial_state,
                                output_final_state=wants, cu_seqlens=x.cu_seqlens)
        o = o.to(torch.bfloat16)
        if call.out is not None:
            o = call.out.copy_(o)
        if wants:
            if call.final_state is None:  # a buffer of run's own: contiguous, like the kernels' [N, H, V, K]
                state = state.to(options.final_state_dtype, memory_format=torch.contiguous_format)
            else:
                state = call.final_state.copy_(state)
        return o, state

    monkeypatch.setattr(inference, "run", run)
    return calls


class OneGraph:
    """A ``torch.compile`` backend that records the graphs it is handed and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def op_count(self) -> int:
        return sum(str(node.target) == "cute_kda.forward.default" for gm in self.graphs for node in gm.graph.nodes)


# ---------------------------------------------------------------------------------------------
# CPU tier


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.float32], ids=["none", "bf16", "fp32"])
def test_fake_impl_gives_exact_shapes_and_dtypes(varlen, state_dtype):
    with FakeTensorMode():
        batch, tokens, heads = (1, 70, 3) if varlen else (2, 35, 3)
        q = torch.empty(batch, tokens, heads, D, dtype=torch.bfloat16)
        beta = torch.empty(batch, tokens, heads, dtype=torch.bfloat16)
        cu = torch.empty(5, dtype=torch.int64) if varlen else None
        o, state = torch.ops.cute_kda.forward(q, q, q, q, beta, torch.empty(heads), torch.empty(heads, D), None, cu,
                                              0.1, -5.0, state_dtype, None, True, True, "safe", None)
    assert o.shape == (batch, tokens, heads, D) and o.dtype == torch.bfloat16
    if state_dtype is None:
        assert state.numel() == 0
    else:
        assert state.shape == ((4 if varlen else batch), heads, D, D) and state.dtype == state_dtype


def test_opcheck(gold_kernels):
    inputs = make_inputs([37, 20])
    h0 = 0.1 * torch.randn(2, 2, D, D)
    args = (*(inputs[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), h0, inputs["cu_seqlens"],
            D ** -0.5, -5.0, torch.float32, None, True, True, "safe", None)
    torch.library.opcheck(inference.forward_op, args, test_utils=("test_schema", "test_faketensor"))


def test_opcheck_log_decay_without_gate_constants(gold_kernels):
    """gate "none": A_log and dt_bias are None in the op's schema too."""
    inputs = make_inputs([37, 20])
    g = -torch.rand(inputs["g"].shape)
    args = (*(inputs[n] for n in ("q", "k", "v")), g, inputs["beta"], None, None, None, inputs["cu_seqlens"],
            D ** -0.5, -5.0, torch.float32, None, True, True, "none", None)
    torch.library.opcheck(inference.forward_op, args, test_utils=("test_schema", "test_faketensor"))


class Layer(torch.nn.Module):
    """A small module around the forward: projections in, the op, a reduction out."""

    def __init__(self, heads=2):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.dt_bias = torch.nn.Parameter(torch.zeros(heads, D), requires_grad=False)

    def forward(self, q, k, v, g, beta, h0, cu_seqlens):
        o, state = cute_kda.kda_forward(q * 2, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias,
                                        initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
        return o.float().relu(), state * 2


class FlaLayer(torch.nn.Module):
    def forward(self, q, k, v, g, beta, A_log, dt_bias, h0):
        return cute_kda.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias.reshape(-1), initial_state=h0,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0)


def _compare(eager, compiled):
    for a, b in zip(eager, compiled):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_compiled_module_is_one_graph_and_matches_eager(gold_kernels, varlen):
    inputs = make_inputs([30, 19] if varlen else [40])
    n = 2 if varlen else 1
    args = (*(inputs[x] for x in ("q", "k", "v", "g", "beta")), 0.1 * torch.randn(n, 2, D, D),
            inputs.get("cu_seqlens"))
    module = Layer()
    backend = OneGraph()
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    with torch.no_grad():
        _compare(module(*args), compiled(*args))
    assert len(backend.graphs) == 1 and backend.op_count() == 1


def test_compiled_chunk_kda_with_fla_layout_state(gold_kernels):
    inputs = make_inputs([33])
    h0 = 0.1 * torch.randn(1, 2, D, D)  # FLA's [N, H, K, V]
    args = (*(inputs[x] for x in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), h0)
    backend = OneGraph()
    module = FlaLayer()
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    with torch.no_grad():
        eager = module(*args)
        _compare(eager, compiled(*args))
    assert backend.op_count() == 1 and eager[1].shape == (1, 2, D, D)


class GdnLayer(torch.nn.Module):
    """GatedDeltaNet through cute_kda.chunk_gated_delta_rule: a per-head log decay, two value heads per q/k head."""

    def forward(self, q, k, v, g, beta, h0):
        return cute_kda.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def test_compiled_gated_delta_rule_is_one_graph(gold_kernels):
    """The per-head gate, grouped value heads and gate "none" (A_log, dt_bias None) through the op."""
    inputs = make_inputs([33])
    q, k = inputs["q"][:, :, :1].contiguous(), inputs["k"][:, :, :1].contiguous()  # H = 1, HV = 2
    g = -torch.rand(inputs["beta"].shape)  # [B, T, HV], fp32
    args = (q, k, inputs["v"], g, inputs["beta"], 0.1 * torch.randn(1, 2, D, D))
    backend = OneGraph()
    module = GdnLayer()
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    with torch.no_grad():
        _compare(module(*args), compiled(*args))
    assert backend.op_count() == 1 and gold_kernels[-1].heads == 2


def test_compiled_call_fills_caller_buffers(gold_kernels):
    inputs = make_inputs([21])

    def fn(out, final):
        return cute_kda.kda_forward(**inputs, out=out, final_state=final)

    out, final = torch.empty_like(inputs["v"]), torch.empty(1, 2, D, D, dtype=torch.bfloat16)
    expected = fn(torch.empty_like(out), torch.empty_like(final))
    o, state = torch.compile(fn, fullgraph=True, backend="eager")(out, final)
    assert o is out and state is final
    assert torch.equal(out, expected[0]) and torch.equal(final, expected[1])


def test_compiled_call_without_state_returns_none(gold_kernels):
    inputs = make_inputs([21])
    o, state = torch.compile(lambda: cute_kda.kda_forward(**inputs), fullgraph=True, backend="eager")()
    assert state is None and o.shape == inputs["v"].shape


def test_eager_calls_skip_the_dispatcher(gold_kernels, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(inference, "forward_op", must_not_run)
    monkeypatch.setattr(api, "_traced", must_not_run)
    inputs = make_inputs([21])
    o, _ = cute_kda.kda_forward(**inputs)
    assert o.dtype == torch.bfloat16 and len(gold_kernels) == 1


# ---------------------------------------------------------------------------------------------
# GPU tier


def _gpu_args(varlen, device):
    inputs = make_inputs([300, 57, 200] if varlen else [500], heads=4, device=device)
    n = 3 if varlen else 1
    h0 = 0.1 * torch.randn(n, 4, D, D, device=device)
    return (*(inputs[x] for x in ("q", "k", "v", "g", "beta")), h0, inputs.get("cu_seqlens"))


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_compiled_module_matches_eager_on_the_kernels(varlen, device):
    module = Layer(heads=4).to(device)
    args = _gpu_args(varlen, device)
    backend = OneGraph()
    with torch.no_grad():
        eager = module(*args)
        compiled = torch.compile(module, fullgraph=True, backend=backend)(*args)
        inductor = torch.compile(Layer(heads=4).to(device), fullgraph=True)(*args)
    torch.cuda.synchronize()
    _compare(eager, compiled)
    _compare(eager, inductor)
    assert backend.op_count() == 1


@pytest.mark.gpu
def test_compiled_chunk_kda_matches_eager_on_the_kernels(device):
    inputs = make_inputs([400], heads=4, device=device)
    h0 = 0.1 * torch.randn(1, 4, D, D, device=device)
    args = (*(inputs[x] for x in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), h0)
    with torch.no_grad():
        eager = FlaLayer()(*args)
        compiled = torch.compile(FlaLayer(), fullgraph=True)(*args)
    torch.cuda.synchronize()
    _compare(eager, compiled)


@pytest.mark.gpu
def test_compiled_forward_replays_in_a_cuda_graph(device):
    module = Layer(heads=4).to(device)
    args = _gpu_args(False, device)
    compiled = torch.compile(module, fullgraph=True)
    with torch.no_grad():
        expected = module(*args)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(*args)  # compiles and warms up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = compiled(*args)
        graph.replay()
    torch.cuda.synchronize()
    _compare(expected, captured)
