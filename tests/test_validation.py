"""Every input error of the public forward, raised at the API boundary (CPU tier).

The calls go through the public ``cute_kda.kda_forward`` with CPU tensors: the structural checks
run first, so each test reaches exactly the error it provokes; a fully valid CPU call stops at
the device check (the kernels need a GPU and the public API never falls back to a reference).
"""

from __future__ import annotations

import math

import pytest
import torch

import cute_kda
from cute_kda import validation

B, T, H, D = 1, 20, 2, 128


def make_inputs(batch: int = B, seq_len: int = T, heads: int = H, dim: int = D, value_dim: int | None = None) -> dict:
    value_dim = dim if value_dim is None else value_dim
    bf16 = torch.bfloat16
    return dict(
        q=torch.randn(batch, seq_len, heads, dim, dtype=bf16),
        k=torch.randn(batch, seq_len, heads, dim, dtype=bf16),
        v=torch.randn(batch, seq_len, heads, value_dim, dtype=bf16),
        g=torch.randn(batch, seq_len, heads, dim, dtype=bf16),
        beta=torch.randn(batch, seq_len, heads, dtype=bf16),
        A_log=torch.randn(heads, dtype=torch.float32),
        dt_bias=torch.randn(heads, dim, dtype=torch.float32),
    )


def call(**changes):
    inputs = make_inputs()
    inputs.update(changes)
    q, k, v, g, beta = (inputs.pop(name) for name in ("q", "k", "v", "g", "beta"))
    return cute_kda.kda_forward(q, k, v, g, beta, **inputs)


def expect(error: type[Exception], *words: str, **changes) -> None:
    with pytest.raises(error) as info:
        call(**changes)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_valid_cpu_call_is_refused_for_the_device():
    expect(ValueError, "q must be on a CUDA device")


@pytest.mark.parametrize("name", ["q", "k", "v", "g"])
def test_activation_dtype(name):
    """fp32 activations (FLA takes them) are not implemented: named, a NotImplementedError and a TypeError."""
    x = make_inputs()[name]
    expect(validation.UnsupportedDtypeError, name, "bfloat16", "float32", **{name: x.float()})
    assert issubclass(validation.UnsupportedDtypeError, NotImplementedError)
    assert issubclass(validation.UnsupportedDtypeError, TypeError)


def fp16_inputs(**changes) -> dict:
    inputs = {name: x.half() if name in ("q", "k", "v", "g") else x for name, x in make_inputs().items()}
    inputs.update(changes)
    return inputs


def test_fp16_inference_call_reaches_the_device_check():
    """q, k, v and the raw gate all fp16 (β bf16, or fp16 / fp32 cast where it enters): the forward kernels take
    them (docs/numerics.md, "fp16 inputs"), so a CPU call stops at the device check; so do a fp16 ``out`` and an
    fp16 or fp32 log decay."""
    expect(ValueError, "q must be on a CUDA device", **fp16_inputs())
    expect(ValueError, "q must be on a CUDA device", **fp16_inputs(beta=make_inputs()["beta"].half()))
    expect(ValueError, "q must be on a CUDA device", **fp16_inputs(out=torch.zeros(B, T, H, D, dtype=torch.float16)))
    log_decay = -make_inputs()["g"].float().abs()
    for g in (log_decay, log_decay.half()):
        expect(ValueError, "q must be on a CUDA device", **fp16_inputs(gate="none", g=g, A_log=None, dt_bias=None))


def test_fp16_states_go_with_fp16_inputs():
    """An fp16 state is taken with fp16 activations (K2 widens it on load, rounds to it on store), not with bf16 ones,
    and never beside an fp32 one."""
    fp16_state, fp32_state = torch.zeros(B, H, D, D, dtype=torch.float16), torch.zeros(B, H, D, D)
    expect(ValueError, "q must be on a CUDA device", **fp16_inputs(initial_state=fp16_state))
    expect(ValueError, "q must be on a CUDA device", **fp16_inputs(initial_state=fp16_state, final_state=fp16_state))
    expect(ValueError, "q must be on a CUDA device", **fp16_inputs(initial_state=fp32_state))
    expect(validation.UnsupportedDtypeError, "final_state is float32 but initial_state is float16",
           **fp16_inputs(initial_state=fp16_state, final_state=fp32_state))
    expect(validation.UnsupportedDtypeError, "final_state is float16 but initial_state is float32",
           **fp16_inputs(initial_state=fp32_state, final_state=fp16_state))
    expect(validation.UnsupportedDtypeError, "initial_state", "float16", initial_state=fp16_state)  # bf16 inputs


@pytest.mark.parametrize("name", ["k", "v", "g", "out"])
def test_mixed_bf16_and_fp16_are_refused_by_name(name):
    """One call, one activation dtype: a bf16 tensor among fp16 ones (or the reverse) is named with q's dtype."""
    bf16 = make_inputs()[name] if name != "out" else torch.zeros(B, T, H, D, dtype=torch.bfloat16)
    expect(validation.UnsupportedDtypeError, f"{name} is bfloat16 but q is float16", **fp16_inputs(**{name: bf16}))
    expect(validation.UnsupportedDtypeError, f"{name} is float16 but q is bfloat16", **{name: bf16.half()})
    log_decay = -make_inputs()["g"].float().abs()
    expect(validation.UnsupportedDtypeError, "g is bfloat16 but q is float16",
           **fp16_inputs(gate="none", g=log_decay.bfloat16(), A_log=None, dt_bias=None))


def test_fp16_training_call_reaches_the_device_check():
    """fp16 trains (the backward kernels run on bf16 copies, docs/numerics.md, "fp16 training"): a call autograd
    records passes every dtype check and stops at the device check, as a bf16 one."""
    inputs = fp16_inputs()
    inputs["q"].requires_grad_()
    expect(ValueError, "q must be on a CUDA device", **inputs)


def test_activation_of_another_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="q must be bfloat16 or float16, got float64") as info:
        call(q=make_inputs()["q"].double())
    assert not isinstance(info.value, NotImplementedError)


@pytest.mark.parametrize("name, dtype", [("beta", torch.float32), ("beta", torch.float16),
                                         ("A_log", torch.bfloat16), ("dt_bias", torch.bfloat16),
                                         ("A_log", torch.float16)])
def test_small_inputs_are_converted_where_they_enter(name, dtype):
    """β in fp16 / fp32 and the gate parameters in bf16 / fp16 are cast on entry: the call reaches the device check."""
    x = make_inputs()[name]
    expect(ValueError, "q must be on a CUDA device", **{name: x.to(dtype)})


@pytest.mark.parametrize("name", ["beta", "A_log"])
def test_small_inputs_of_another_dtype_are_named(name):
    x = make_inputs()[name]
    expect(TypeError, name, "float64", **{name: x.double()})


def test_fp16_state_is_not_implemented():
    state = torch.zeros(B, H, D, D, dtype=torch.float16)
    expect(validation.UnsupportedDtypeError, "initial_state", "float16", initial_state=state)


@pytest.mark.parametrize("name", ["q", "v", "A_log", "initial_state", "cu_seqlens"])
def test_not_a_tensor(name):
    expect(TypeError, name, "tensor", **{name: [1.0, 2.0]})


@pytest.mark.parametrize("entry", [cute_kda.chunk_kda, cute_kda.chunk_gated_delta_rule])
def test_fla_entry_names_a_q_that_is_no_array(entry):
    """A q that is neither a torch tensor nor a DLPack array is named (not handed to the framework bridge)."""
    inputs = make_inputs()
    with pytest.raises(TypeError, match="q must be a tensor"):
        entry([1.0, 2.0], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])


@pytest.mark.parametrize(
    "name, shape",
    [
        ("k", (B, T + 1, H, D)),
        ("v", (B, T + 1, H, D)),
        ("g", (B, T, H, D, 1)),
        ("beta", (B, T, H, 1)),
        ("A_log", (H + 1,)),
        ("dt_bias", (H * D,)),
    ],
)
def test_shape(name, shape):
    dtype = make_inputs()[name].dtype
    expect(ValueError, name, str(list(shape)), **{name: torch.zeros(shape, dtype=dtype)})


def test_q_rank():
    expect(ValueError, "q", "4-D", q=torch.zeros(T, H, D, dtype=torch.bfloat16))


def test_empty_sequence():
    inputs = make_inputs(seq_len=0)
    expect(ValueError, "T = q.shape[1] is 0", **inputs)


@pytest.mark.parametrize("key_dim, value_dim", [(64, 64), (32, 32), (60, 60), (100, 100), (128, 64), (64, 128),
                                                (128, 256), (64, 256), (1, 1)])
def test_head_dims_that_pad_or_split_are_taken(key_dim, value_dim):
    """K, V <= 128 (zero-padded to 128) and V a multiple of 128 (split into heads of 128): checked at the caller's
    sizes, then the 128 call reaches the device check (cute_kda.call; tests/test_head_dims.py computes them)."""
    expect(ValueError, "q must be on a CUDA device", **make_inputs(dim=key_dim, value_dim=value_dim))


@pytest.mark.parametrize("key_dim, value_dim, word", [(256, 256, "K (q.shape[-1]) = 256"),
                                                     (192, 128, "K (q.shape[-1]) = 192"),
                                                     (128, 192, "V (v.shape[-1]) = 192"),
                                                     (64, 200, "V (v.shape[-1]) = 200")])
def test_head_dim_not_supported(key_dim, value_dim, word):
    """K > 128, and V > 128 that is not a multiple of 128: refused by size, so FLA's backend computes them."""
    with pytest.raises(NotImplementedError) as info:
        call(**make_inputs(dim=key_dim, value_dim=value_dim))
    assert word in str(info.value) and "head dims up to 128" in str(info.value)


@pytest.mark.parametrize("name, shape", [("initial_state", (B, H, 64, 60)), ("final_state", (B, H, 60, 64)),
                                         ("dt_bias", (H, 128)), ("out", (B, T, H, 128))])
def test_padded_call_shapes_are_named_at_the_callers_dims(name, shape):
    """A call at K = V = 64 names a wrong shape with the caller's sizes (checked before any padding)."""
    dtype = torch.bfloat16 if name == "out" else torch.float32
    expect(ValueError, name, str(list(shape)), **{**make_inputs(dim=64), name: torch.zeros(shape, dtype=dtype)})


@pytest.mark.parametrize("name", ["q", "k", "v", "g"])
def test_not_contiguous(name):
    x = make_inputs()[name]
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, head-major storage
    expect(ValueError, name, "contiguous", **{name: strided})


def test_misaligned():
    storage = torch.zeros(B * T * H * D + 1, dtype=torch.bfloat16)
    expect(ValueError, "q", "16-byte", q=storage[1:].view(B, T, H, D))


def test_device_mismatch():
    expect(ValueError, "k is on meta", k=torch.empty(B, T, H, D, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("value", [-5.5, 0.0, 0.5, math.nan, -math.inf])
def test_lower_bound_range(value):
    expect(ValueError, "lower_bound", "[-5.0, 0.0)", lower_bound=value)


def test_lower_bound_edges_accepted():
    for value in (-5.0, -1e-6):
        expect(ValueError, "CUDA device", lower_bound=value)


@pytest.mark.parametrize("value", [torch.tensor(-1.0), True, "-1"])
def test_lower_bound_type(value):
    expect(TypeError, "lower_bound", "Python float", lower_bound=value)


@pytest.mark.parametrize("value, error", [(math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError),
                                          (torch.tensor(0.1), TypeError), (0.0, ValueError), (-0.0, ValueError),
                                          (1, TypeError), (0, TypeError), (True, TypeError)])
def test_scale(value, error):
    expect(error, "scale", scale=value)


def test_scale_messages_say_what_to_pass():
    expect(TypeError, "scale must be a Python float, got int 1", "1.0", scale=1)
    expect(ValueError, "non-zero", scale=0.0)


@pytest.mark.parametrize("value", [0.5, -0.25, 1e-3])
def test_scale_floats_accepted(value):
    expect(ValueError, "CUDA device", scale=value)


@pytest.mark.parametrize("value", [0, 3, 8, True])
def test_vsplit(value):
    expect(ValueError, "vsplit", vsplit=value)


def packed(lengths: list[int]) -> dict:
    inputs = make_inputs(seq_len=sum(lengths))
    inputs["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return inputs


def test_cu_seqlens_valid_on_cpu_reaches_device_check():
    expect(ValueError, "CUDA device", **packed([5, 0, 17]))


@pytest.mark.parametrize("dtype", [torch.int16, torch.float32])
def test_cu_seqlens_dtype(dtype):
    inputs = packed([5, 15])
    inputs["cu_seqlens"] = inputs["cu_seqlens"].to(dtype)
    expect(TypeError, "cu_seqlens", "int32", "int64", **inputs)


def test_cu_seqlens_int32_taken():
    """int32 (FLA's unpadding builds it) passes the checks as int64 does: the CPU call reaches the device check."""
    inputs = packed([5, 0, 17])
    inputs["cu_seqlens"] = inputs["cu_seqlens"].to(torch.int32)
    expect(ValueError, "CUDA device", **inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_device_cu_seqlens_widens_int32(where):
    """An int32 cu_seqlens, on the host or the device, reaches the kernels as int64 on the device."""
    bounds = torch.tensor([0, 5, 5, 22], dtype=torch.int32, device=where)
    staged = validation.device_cu_seqlens(bounds, torch.device("cuda"), 22)
    assert staged.dtype == torch.int64 and staged.is_cuda and staged.cpu().tolist() == bounds.cpu().tolist()


@pytest.mark.parametrize(
    "bounds, words",
    [
        ([[0, 5], [5, 20]], ("cu_seqlens", "1-D")),
        ([0], ("cu_seqlens", "at least 2")),
        ([1, 5, 20], ("cu_seqlens must start at 0", "got 1")),
        ([0, 5, 19], ("cu_seqlens must end at T = 20", "got 19")),
        ([0, 12, 5, 20], ("cu_seqlens must not decrease", "cu_seqlens[2] = 5")),
    ],
)
def test_cu_seqlens_values(bounds, words):
    inputs = make_inputs()
    inputs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int64)
    expect(ValueError, *words, **inputs)


def test_cu_seqlens_needs_batch_one():
    inputs = make_inputs(batch=2, seq_len=10)
    inputs["cu_seqlens"] = torch.tensor([0, 4, 10], dtype=torch.int64)
    expect(ValueError, "batch size 1", "B = 2", **inputs)


@pytest.mark.parametrize("name", ["initial_state", "final_state"])
def test_state_dtype(name):
    expect(TypeError, name, "bfloat16 or float32", **{name: torch.zeros(B, H, D, D, dtype=torch.float16)})


@pytest.mark.parametrize("name", ["initial_state", "final_state"])
def test_state_shape(name):
    expect(ValueError, name, "[N, H, V, K]", str([B, H, D, D]), **{name: torch.zeros(B + 1, H, D, D)})


def test_state_shape_follows_cu_seqlens():
    inputs = packed([5, 15])
    inputs["initial_state"] = torch.zeros(1, H, D, D)
    expect(ValueError, "initial_state", str([2, H, D, D]), **inputs)


def test_state_not_contiguous():
    expect(ValueError, "initial_state", "contiguous", initial_state=torch.zeros(B, H, D, D).transpose(-1, -2))


def test_out_buffer():
    expect(TypeError, "out", "bfloat16", out=torch.zeros(B, T, H, D))
    expect(ValueError, "out", "[B, T, HV, V]", out=torch.zeros(B, T, H + 1, D, dtype=torch.bfloat16))


def test_training_call_reaches_the_device_check():
    """Inputs that require grad are a training call (cute_kda.autograd): validated like any other."""
    q = make_inputs()["q"].requires_grad_()
    A_log = make_inputs()["A_log"].requires_grad_()
    expect(ValueError, "CUDA device", q=q, A_log=A_log)


def test_training_call_refuses_output_buffers():
    inputs = make_inputs()
    expect(NotImplementedError, "out= buffer is not supported when inputs require grad",
           q=inputs["q"].requires_grad_(), out=torch.empty_like(inputs["v"]))


def test_requires_grad_under_no_grad_is_fine():
    q = make_inputs()["q"].requires_grad_()
    with torch.no_grad():
        expect(ValueError, "CUDA device", q=q)


def test_cu_seqlens_values_checker_names_its_argument():
    with pytest.raises(ValueError, match="cu_seqlens_cpu must end at T = 9"):
        validation.check_cu_seqlens_values(torch.tensor([0, 4, 8]), 9, name="cu_seqlens_cpu")


@pytest.mark.parametrize("extra", [
    {}, dict(initial_state=torch.zeros(B, H, D, D)), dict(scale=0.3, vsplit=2, lower_bound=-1.0),
    dict(initial_state=torch.zeros(B, H, D, D, dtype=torch.bfloat16), final_state=torch.zeros(B, H, D, D),
         out=torch.zeros(B, T, H, D, dtype=torch.bfloat16)),
])
def test_plain_call_takes_the_one_pass_check(monkeypatch, extra):
    """A valid call without cu_seqlens passes the one-pass check (the host-cost path) with the problem the
    detailed checks give; every error test above goes through the detailed ones (the one-pass check
    answered None there, else the call would have reached the device check)."""
    inputs = make_inputs()
    inputs.update(extra)
    options = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=inputs.get("lower_bound", -5.0),
                   scale=inputs.get("scale"), initial_state=inputs.get("initial_state"),
                   final_state=inputs.get("final_state"), out=inputs.get("out"), vsplit=inputs.get("vsplit"),
                   gate="safe")
    tensors = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    fast = validation.plain_forward(*tensors, cu_seqlens=None, **options)
    assert fast == validation.validate_forward(*tensors, **options)
    monkeypatch.setattr(validation, "plain_forward", lambda *args: None)
    assert validation.validate_forward(*tensors, **options) == fast == validation.ProblemShape(B, T, H, D, B, False)


# ---------------------------------------------------------------- gate forms


def test_unknown_gate():
    expect(ValueError, "gate must be one of", "softplus", gate="sigmoid")


def test_softplus_gate_passes_structure_and_needs_its_constants():
    expect(ValueError, "q must be on a CUDA device", gate="softplus", lower_bound=-9.0)  # lower_bound is not read
    expect(TypeError, "gate='softplus' needs A_log", gate="softplus", A_log=None)
    expect(TypeError, "g", "bfloat16", gate="softplus", g=make_inputs()["g"].float())


def test_log_decay_takes_bf16_or_fp32_and_no_constants():
    log_decay = -make_inputs()["g"].float().abs()
    expect(ValueError, "q must be on a CUDA device", gate="none", g=log_decay, A_log=None, dt_bias=None)
    expect(ValueError, "q must be on a CUDA device", gate="none", g=log_decay.bfloat16(), A_log=None, dt_bias=None)
    expect(ValueError, "pass A_log and dt_bias=None", gate="none", g=log_decay)
    expect(validation.UnsupportedDtypeError, "g is float16 but q is bfloat16", gate="none", g=log_decay.half(),
           A_log=None, dt_bias=None)
    expect(ValueError, "g must have shape", gate="none", g=log_decay[..., :64].contiguous(), A_log=None, dt_bias=None)


@pytest.mark.parametrize("gate", ["softplus", "none"])
def test_unbounded_gates_train(gate, monkeypatch):
    """A per-channel unbounded gate under grad takes the training path (Kernel B's dyadic variant)."""
    from cute_kda.executors import training

    seen = []
    monkeypatch.setattr(training, "train", lambda backend, call: seen.append(call.options.gate) or (call.inputs.v, None))
    inputs = make_inputs()
    if gate == "none":
        inputs.update(g=-inputs["g"].float().abs(), A_log=None, dt_bias=None)
    inputs["q"].requires_grad_()
    q, k, v, g, beta = (inputs.pop(name) for name in ("q", "k", "v", "g", "beta"))
    cute_kda.kda_forward(q, k, v, g, beta, gate=gate, **inputs)
    assert seen == [gate]


def test_grouped_value_heads():
    """HV a multiple of H: v, g, beta, A_log, dt_bias and the states per value head; else a ValueError."""
    wide = make_inputs(heads=2 * H)
    grouped = dict(v=wide["v"], g=wide["g"], beta=wide["beta"], A_log=wide["A_log"], dt_bias=wide["dt_bias"])
    expect(ValueError, "q must be on a CUDA device", **grouped)
    expect(ValueError, "multiple of q's H = 2", v=make_inputs(heads=3)["v"])
    expect(ValueError, "beta", "[B, T, HV]", **{**grouped, "beta": make_inputs()["beta"]})
    expect(ValueError, "initial_state", **grouped, initial_state=torch.zeros(B, H, D, D))
    wide["v"].requires_grad_()
    with pytest.raises(NotImplementedError, match="grouped value heads"):
        cute_kda.kda_forward(make_inputs()["q"], make_inputs()["k"], **grouped)


def test_per_head_gate_takes_the_unbounded_gates():
    inputs = make_inputs()
    per_head = -inputs["g"][..., 0].float().abs()
    expect(ValueError, "q must be on a CUDA device", gate="none", g=per_head, A_log=None, dt_bias=None)
    expect(ValueError, "q must be on a CUDA device", gate="softplus", g=per_head.bfloat16(),
           dt_bias=torch.zeros(H))
    expect(ValueError, "dt_bias", "[HV] (per-head gate)", gate="softplus", g=per_head.bfloat16())
    expect(ValueError, "g", "[B, T, HV, K]", g=per_head.bfloat16())  # the safe gate is per channel


def test_unbounded_gates_refuse_g_past_32_bit_offsets():
    """K1 reads a per-channel unbounded gate with 32-bit element offsets (meta tensors: no memory)."""
    meta, bf16 = torch.device("meta"), torch.bfloat16
    tokens, heads = 2 ** 31 // (2 * D) + 16, 2  # B·T·H·K just past 2^31
    x = torch.empty(1, tokens, heads, D, dtype=bf16, device=meta)
    beta = torch.empty(1, tokens, heads, dtype=bf16, device=meta)
    args = dict(A_log=torch.empty(heads, device=meta), dt_bias=torch.empty(heads, D, device=meta), lower_bound=-5.0,
                scale=None)
    with pytest.raises(NotImplementedError, match="32-bit element offsets"):
        validation.validate_forward(x, x, x, x, beta, gate="softplus", **args)
    assert validation.validate_forward(x, x, x, x, beta, gate="safe", **args).seq_len == tokens  # TMA-loaded g
