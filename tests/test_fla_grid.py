"""FLA's own chunk tests, as calls: each is computed by cute_kda or refused by name, and FLA's backend agrees (CPU).

The parameter grids of flash-linear-attention's ``tests/ops/test_kda.py`` and ``tests/ops/test_gdn.py`` (the chunk
tests: B, T, H, HV, D, dtype, gate flags, l2norm in the kernel, ``disable_recompute``, ``chunk_size``, packed
sequences), with the dtypes those tests give each input (fp32 β and gates, fp16 or fp32 initial states), as
training calls (their inputs require grad). For every case, and for its twin at the size and activation dtype the
kernels take (bf16, K = V = 128, everything else as FLA draws it):

- the call through ``cute_kda.chunk_kda`` / ``cute_kda.chunk_gated_delta_rule``'s translation and
  :func:`cute_kda.call.resolve` (every check before a launch, on CPU tensors; head dims below 128 padded to 128 there,
  :mod:`cute_kda.call`) is accepted exactly when
  :func:`expected_refusal` finds nothing, else refused with that error naming that argument;
- the FLA backend's verifier (device rule lifted) takes exactly the accepted calls, so FLA computes the others.

:func:`expected_refusal` is written from the support contract (docs/support.md), not from the code it checks.
No kernel runs and nothing compiles. A fixed-length call's T is cut so that B·T·HV stays within 2^16 (FLA's
T8192 H96 cases; the verdict does not depend on T).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from cute_kda import fla_backend, validation
from cute_kda.call import resolve
from cute_kda.fla_calls import translate_fla_call, translate_fla_gdn_call

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
TOKEN_HEADS = 2 ** 16  # the most B·T·HV a fixed-length case allocates


@dataclass(frozen=True)
class Case:
    """One FLA chunk test call. ``g_dtype`` / ``beta_dtype`` / ``state_dtype`` None: the activations' dtype."""

    op: str  # "kda" (chunk_kda) or "gdn" (chunk_gated_delta_rule)
    batch: int
    seq_len: int
    heads: int
    value_heads: int
    dim: int
    dtype: torch.dtype
    l2norm: bool = False
    gate_in_kernel: bool = False
    safe_gate: bool = False
    disable_recompute: bool = False
    chunk_size: int = 64
    cu_seqlens: tuple[int, ...] | None = None
    g_dtype: torch.dtype | None = FP32
    beta_dtype: torch.dtype | None = None
    state_dtype: torch.dtype | None = FP32
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    dt_bias: bool = True

    @property
    def name(self) -> str:
        packed = f"-cu{len(self.cu_seqlens) - 1}" if self.cu_seqlens else ""
        flags = "".join(f"-{flag}" for flag, on in (("l2", self.l2norm), ("gate", self.gate_in_kernel),
                                                    ("safe", self.safe_gate), ("keep", self.disable_recompute),
                                                    ("sigmoid", self.beta_sigmoid), ("neg", self.neg_eigval),
                                                    ("nobias", not self.dt_bias)) if on)
        return (f"{self.op}-B{self.batch}-T{self.seq_len}-H{self.heads}-HV{self.value_heads}-D{self.dim}"
                f"-{str(self.dtype)[6:]}{flags}{packed}-c{self.chunk_size}")


def _kda(b, t, h, hv, d, dtype, l2, gate, safe, keep, chunk=64):
    """test_kda.py::test_chunk: g fp32 log decay, or the raw gate in the activations' dtype; β in it; h0 fp32."""
    return Case("kda", b, t, h, hv, d, dtype, l2, gate, safe, keep, chunk, g_dtype=None if gate else FP32)


def _kda_packed(d, cu, gate, safe, keep, chunk=64):
    """test_kda.py::test_chunk_varlen: fp16, H = 4, one packed row, h0 fp32 per sequence."""
    return Case("kda", 1, cu[-1], 4, 4, d, FP16, False, gate, safe, keep, chunk, tuple(cu),
                g_dtype=None if gate else FP32)


def _gdn(b, t, h, hv, d, l2, **changes):
    """test_gdn.py::test_chunk and its siblings: fp16 q, k, v; fp32 β, fp32 per-head log decay, fp32 h0."""
    return Case("gdn", b, t, h, hv, d, changes.pop("dtype", FP16), l2, beta_dtype=FP32, **changes)


FLA_GRID = [
    # test_kda.py::test_chunk
    _kda(1, 63, 1, 1, 64, FP16, False, False, True, False),
    _kda(2, 500, 3, 3, 60, FP16, False, False, True, True),
    _kda(2, 1000, 3, 3, 64, FP16, False, False, False, True),
    _kda(3, 1024, 4, 4, 100, FP16, False, False, False, False),
    _kda(4, 1024, 4, 4, 128, FP16, False, False, True, True),
    _kda(4, 1024, 4, 4, 128, FP16, True, False, True, False),
    _kda(2, 1500, 4, 4, 128, FP16, False, True, False, True),
    _kda(4, 2048, 8, 8, 64, FP16, False, True, True, True),
    _kda(2, 1024, 2, 4, 64, FP16, False, False, False, False),
    _kda(2, 1024, 2, 8, 64, FP16, False, True, False, False),
    _kda(2, 1024, 4, 8, 128, FP16, True, True, False, False),
    _kda(2, 160, 2, 4, 64, FP16, False, True, True, True, 32),
    _kda(2, 1024, 2, 4, 64, BF16, True, True, True, False),
    _kda(2, 1024, 2, 4, 64, BF16, False, True, False, False),
    _kda(2, 160, 2, 4, 64, BF16, False, True, True, True, 32),
    _kda(2, 1024, 2, 8, 128, BF16, True, True, False, False),
    # test_kda.py::test_chunk_varlen
    _kda_packed(60, (0, 15), True, False, False),
    _kda_packed(64, (0, 256, 500, 1000), True, False, False),
    _kda_packed(128, (0, 256, 500, 1000), False, False, False),
    _kda_packed(100, (0, 15, 100, 300, 1200, 2000), True, False, False),
    _kda_packed(256, (0, 100, 300, 1200, 3000, 4096), False, True, True),
    _kda_packed(60, (0, 31, 96, 160), True, False, True, 32),
    # test_kda.py::test_chunk_use_beta_sigmoid_in_kernel (h0 fp32, fp32 log decay)
    Case("kda", 1, 8192, 96, 96, 128, BF16, beta_sigmoid=True),
    Case("kda", 1, 8192, 96, 96, 128, BF16, beta_sigmoid=True, neg_eigval=True),
    Case("kda", 2, 96, 2, 2, 64, FP16, beta_sigmoid=True, neg_eigval=True),
    # test_gdn.py::test_chunk
    _gdn(4, 1024, 4, 4, 128, False), _gdn(2, 75, 4, 4, 64, False), _gdn(2, 500, 3, 3, 60, False),
    _gdn(2, 1000, 3, 3, 64, False), _gdn(3, 1024, 4, 4, 100, False), _gdn(4, 1024, 4, 4, 128, True),
    _gdn(2, 1500, 4, 4, 128, False), _gdn(4, 2048, 8, 8, 64, False), _gdn(2, 256, 2, 4, 64, False),
    _gdn(2, 512, 2, 8, 64, True), _gdn(2, 1024, 4, 8, 128, False),
    # test_gdn.py::test_chunk_with_chunk_size (fp32 activations)
    *(_gdn(1, 64, 2, 4, 32, False, dtype=FP32, chunk_size=c) for c in (16, 32, 64)),
    # test_gdn.py::test_chunk_beta_sigmoid_in_kernel
    _gdn(2, 500, 4, 4, 64, False, beta_sigmoid=True), _gdn(3, 1024, 4, 4, 128, True, beta_sigmoid=True, neg_eigval=True),
    _gdn(2, 1024, 4, 8, 128, False, beta_sigmoid=True, neg_eigval=True), _gdn(4, 2048, 8, 8, 64, True, beta_sigmoid=True),
    # test_gdn.py::test_chunk_varlen: the log decay and h0 in the activations' dtype
    *(_gdn(1, cu[-1], h, hv, d, False, cu_seqlens=cu, g_dtype=None, state_dtype=None)
      for h, hv, d, cu in ((4, 4, 60, (0, 15)), (4, 4, 64, (0, 256, 500, 1000)), (4, 4, 64, (0, 256, 500, 1000)),
                           (4, 4, 100, (0, 15, 100, 300, 1200, 2000)), (2, 4, 64, (0, 256, 500, 1000)),
                           (2, 8, 64, (0, 256, 500, 1000)))),
    # test_gdn.py::test_chunk_gate_in_kernel (fp32 raw gate; dt_bias or None)
    *(_gdn(b, t, h, h, d, l2, gate_in_kernel=True, dt_bias=bias)
      for b, t, h, d, bias, l2 in ((2, 75, 4, 64, True, True), (2, 500, 3, 60, False, False),
                                   (2, 1000, 3, 64, True, False), (3, 1024, 4, 100, True, True),
                                   (4, 1024, 4, 128, False, True), (4, 2048, 8, 64, True, False))),
    # test_gdn.py::test_chunk_gate_in_kernel_gqa
    *(_gdn(2, t, h, hv, d, True, gate_in_kernel=True, dt_bias=bias)
      for t, h, hv, d, bias in ((256, 2, 4, 64, True), (512, 1, 4, 64, False), (512, 2, 8, 64, True),
                                (1024, 4, 8, 128, True))),
    # test_gdn.py::test_chunk_gate_in_kernel_varlen
    *(_gdn(1, cu[-1], 4, 4, d, True, gate_in_kernel=True, dt_bias=bias, cu_seqlens=cu)
      for d, bias, cu in ((60, True, (0, 15)), (64, False, (0, 256, 500, 1000)), (64, True, (0, 256, 500, 1000)),
                          (100, True, (0, 15, 100, 300, 1200, 2000)))),
]


def twin(case: Case) -> Case:
    """The same call at the size and activation dtype the kernels take: bf16, K = V = 128 (a raw gate drawn in the
    activations' dtype follows them; the other inputs keep FLA's dtypes)."""
    return replace(case, dim=128, dtype=BF16)


CASES = {case.name: case for case in FLA_GRID} | {f"{twin(case).name}-twin": twin(case) for case in FLA_GRID}


def expected_refusal(case: Case) -> tuple[type[Exception], tuple[str, ...]] | None:
    """What the support contract refuses in ``case`` (the error and words naming the argument), or None."""
    if case.neg_eigval:
        return NotImplementedError, ("allow_neg_eigval",)
    if case.dim > 128:  # smaller head dims run zero-padded to 128 (cute_kda.call, "Head dims")
        return NotImplementedError, (f"K (q.shape[-1]) = {case.dim}",)
    if case.dtype == FP32:
        return validation.UnsupportedDtypeError, ("q must be bfloat16 or float16", "float32")
    g_dtype, name = case.g_dtype or case.dtype, str(case.dtype)[6:]
    if g_dtype not in (case.dtype, FP32):  # the other 16-bit dtype: one dtype per call
        return validation.UnsupportedDtypeError, (f"g is {str(g_dtype)[6:]} but q is {name}",)
    if g_dtype == FP32 and case.gate_in_kernel:  # a raw gate in q's dtype; a log decay in it or fp32
        return validation.UnsupportedDtypeError, (f"g must be {name}", "float32")
    bounded = case.op == "kda" and case.gate_in_kernel and case.safe_gate
    if bounded and case.value_heads != case.heads:  # every call here trains
        return NotImplementedError, ("grouped value heads",)
    return None


def fla_arguments(case: Case) -> dict:
    """The keyword arguments the FLA test passes, as zero tensors that require grad (values are never read, but
    for ``cu_seqlens``)."""
    seq_len = case.seq_len if case.cu_seqlens else min(case.seq_len, TOKEN_HEADS // (case.batch * case.value_heads))
    b, h, hv, d = case.batch, case.heads, case.value_heads, case.dim
    num_seqs = len(case.cu_seqlens) - 1 if case.cu_seqlens else b
    per_head = case.op == "gdn"

    def leaf(*shape, dtype=None):
        return torch.zeros(*shape, dtype=dtype or case.dtype).requires_grad_()

    kwargs = dict(q=leaf(b, seq_len, h, d), k=leaf(b, seq_len, h, d), v=leaf(b, seq_len, hv, d),
                  g=leaf(*((b, seq_len, hv) if per_head else (b, seq_len, hv, d)), dtype=case.g_dtype),
                  beta=leaf(b, seq_len, hv, dtype=case.beta_dtype), scale=0.1, output_final_state=True,
                  use_qk_l2norm_in_kernel=case.l2norm, use_gate_in_kernel=case.gate_in_kernel,
                  use_beta_sigmoid_in_kernel=case.beta_sigmoid, allow_neg_eigval=case.neg_eigval,
                  chunk_size=case.chunk_size)
    if case.state_dtype is not None:
        kwargs["initial_state"] = leaf(num_seqs, hv, d, d, dtype=case.state_dtype)
    if case.cu_seqlens:
        kwargs["cu_seqlens"] = torch.tensor(case.cu_seqlens, dtype=torch.int64)
        if case.op == "kda":
            kwargs["cu_seqlens_cpu"] = kwargs["cu_seqlens"]
    if case.gate_in_kernel:
        kwargs["A_log"] = leaf(hv, dtype=FP32)
        kwargs["dt_bias"] = leaf(hv if per_head else hv * d, dtype=FP32) if case.dt_bias else None
    if case.op == "kda":
        kwargs.update(safe_gate=case.safe_gate, lower_bound=-5.0 if case.safe_gate else None,
                      disable_recompute=case.disable_recompute)
    return kwargs


def resolve_like_the_entry(case: Case, kwargs: dict) -> None:
    """What ``cute_kda.chunk_kda`` / ``chunk_gated_delta_rule`` do before launching anything."""
    if case.op == "kda":
        call = translate_fla_call(**kwargs)
        resolve(*call.tensors, recompute=call.recompute, **call.options)
    else:
        call = translate_fla_gdn_call(**kwargs)
        resolve(*call.tensors, **call.options)


@pytest.fixture
def any_device(monkeypatch):
    """Let the verifier take CPU tensors (its device rule is tested in test_fla_backend.py)."""
    monkeypatch.setattr(fla_backend, "_device_reason", lambda q: None)


def test_the_grid_holds_flas_cases():
    """63 of FLA's chunk cases (two pairs differ only in values: one name each) and their twins; FLA's own cases are
    computed as FLA draws them, bf16 and fp16 (fp16 training on bf16 copies of what the backward kernels read), head
    dims below 128 zero-padded to 128, but for the safe gate's grouped value heads in training, fp32 raw gates beside
    fp16 activations, fp32 activations, head dim 256 and allow_neg_eigval; and so are a third of the twins."""
    assert len(FLA_GRID) == 63
    accepted = [name for name, case in CASES.items() if expected_refusal(case) is None]
    assert sorted(name for name in accepted if not name.endswith("-twin")) == [
        "gdn-B1-T1000-H2-HV4-D64-float16-cu3-c64", "gdn-B1-T1000-H2-HV8-D64-float16-cu3-c64",
        "gdn-B1-T1000-H4-HV4-D64-float16-cu3-c64", "gdn-B1-T15-H4-HV4-D60-float16-cu1-c64",
        "gdn-B1-T2000-H4-HV4-D100-float16-cu5-c64", "gdn-B2-T1000-H3-HV3-D64-float16-c64",
        "gdn-B2-T1024-H4-HV8-D128-float16-c64", "gdn-B2-T1500-H4-HV4-D128-float16-c64",
        "gdn-B2-T256-H2-HV4-D64-float16-c64", "gdn-B2-T500-H3-HV3-D60-float16-c64",
        "gdn-B2-T500-H4-HV4-D64-float16-sigmoid-c64", "gdn-B2-T512-H2-HV8-D64-float16-l2-c64",
        "gdn-B2-T75-H4-HV4-D64-float16-c64", "gdn-B3-T1024-H4-HV4-D100-float16-c64",
        "gdn-B4-T1024-H4-HV4-D128-float16-c64", "gdn-B4-T1024-H4-HV4-D128-float16-l2-c64",
        "gdn-B4-T2048-H8-HV8-D64-float16-c64", "gdn-B4-T2048-H8-HV8-D64-float16-l2-sigmoid-c64",
        "kda-B1-T1000-H4-HV4-D128-float16-cu3-c64", "kda-B1-T1000-H4-HV4-D64-float16-gate-cu3-c64",
        "kda-B1-T15-H4-HV4-D60-float16-gate-cu1-c64", "kda-B1-T160-H4-HV4-D60-float16-gate-keep-cu3-c32",
        "kda-B1-T2000-H4-HV4-D100-float16-gate-cu5-c64", "kda-B1-T63-H1-HV1-D64-float16-safe-c64",
        "kda-B1-T8192-H96-HV96-D128-bfloat16-sigmoid-c64", "kda-B2-T1000-H3-HV3-D64-float16-keep-c64",
        "kda-B2-T1024-H2-HV4-D64-bfloat16-gate-c64", "kda-B2-T1024-H2-HV4-D64-float16-c64",
        "kda-B2-T1024-H2-HV8-D128-bfloat16-l2-gate-c64", "kda-B2-T1024-H2-HV8-D64-float16-gate-c64",
        "kda-B2-T1024-H4-HV8-D128-float16-l2-gate-c64", "kda-B2-T1500-H4-HV4-D128-float16-gate-keep-c64",
        "kda-B2-T500-H3-HV3-D60-float16-safe-keep-c64", "kda-B3-T1024-H4-HV4-D100-float16-c64",
        "kda-B4-T1024-H4-HV4-D128-float16-l2-safe-c64", "kda-B4-T1024-H4-HV4-D128-float16-safe-keep-c64",
        "kda-B4-T2048-H8-HV8-D64-float16-gate-safe-keep-c64"]
    assert len(accepted) >= len(CASES) // 3


@pytest.mark.parametrize("name", sorted(CASES))
def test_fla_case_is_computed_or_refused_by_name(any_device, name):
    case = CASES[name]
    kwargs = fla_arguments(case)
    refusal = expected_refusal(case)
    verify = fla_backend.verify if case.op == "kda" else fla_backend.verify_gdn
    accepted, reason = verify(**kwargs)
    if refusal is None:
        resolve_like_the_entry(case, kwargs)
        assert (accepted, reason) == (True, None)
        return
    error, words = refusal
    with pytest.raises(error) as info:
        resolve_like_the_entry(case, kwargs)
    assert all(word in str(info.value) for word in words), str(info.value)
    assert not accepted and all(word in reason for word in words), reason


# ---------------------------------------------------------------------------------------------
# what enters converted: the gradient comes back in the caller's dtype


def test_fp32_beta_and_fp16_state_enter_converted_and_train():
    """FLA's GatedDeltaNet tests pass fp32 β and fp16 states: β is rounded to bf16, the state widened to fp32 where the
    call enters; autograd hands each gradient back in its input's dtype, equal to the converted input's gradient."""
    from cute_kda.executors import training
    from cute_kda.reference.backend import REFERENCE

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 128, generator=gen).bfloat16() for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 40, 2, generator=gen))
    beta = torch.rand(1, 40, 2, generator=gen).requires_grad_()
    h0 = (0.1 * torch.randn(1, 2, 128, 128, generator=gen)).half().requires_grad_()
    do = torch.randn(1, 40, 2, 128, generator=gen).bfloat16()

    def forward(*tensors, **options):
        return training.kda_forward(*tensors, backend=REFERENCE, **options)

    def run(beta_in, h0_in):
        call = translate_fla_gdn_call(q, k, v, g, beta_in, initial_state=h0_in, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        o, ht = call.run(forward)
        (o.float() * do.float()).sum().add(ht.sum()).backward()
        return o, ht

    o, ht = run(beta, h0)
    assert beta.grad.dtype == torch.float32 and h0.grad.dtype == torch.float16 and ht.dtype == torch.float32
    beta16, h032 = beta.detach().bfloat16().requires_grad_(), h0.detach().float().requires_grad_()
    o_ref, ht_ref = run(beta16, h032)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    assert torch.equal(beta.grad, beta16.grad.float()) and torch.equal(h0.grad, h032.grad.half())


def test_low_precision_gate_parameters_enter_converted(any_device):
    """bf16 ``A_log`` / ``dt_bias`` are widened to fp32 (exact) by ``chunk_kda``'s translation and the verifier takes the
    call."""
    case = twin(FLA_GRID[6])  # KDA, the softplus gate
    kwargs = fla_arguments(case)
    kwargs["A_log"], kwargs["dt_bias"] = (kwargs[n].detach().bfloat16().requires_grad_() for n in ("A_log", "dt_bias"))
    assert fla_backend.verify(**kwargs) == (True, None)
    call = translate_fla_call(**kwargs)
    assert call.options["A_log"].dtype == call.options["dt_bias"].dtype == torch.float32
    assert call.tensors[4].dtype == torch.bfloat16


def test_kda_forward_converts_beta_and_gate_parameters_and_trains():
    """``kda_forward``'s resolution casts an fp32 β and bf16 ``A_log`` / ``dt_bias`` (off its one-pass path); the
    gradients come back in those dtypes, equal to the converted inputs' gradients."""
    from cute_kda.executors import training
    from cute_kda.reference.backend import REFERENCE

    gen = torch.Generator().manual_seed(1)
    q, k, v, g = (torch.randn(1, 33, 2, 128, generator=gen).bfloat16() for _ in range(4))
    do = torch.randn(1, 33, 2, 128, generator=gen).bfloat16()
    given = dict(beta=torch.randn(1, 33, 2, generator=gen), A_log=torch.randn(2, generator=gen).bfloat16(),
                 dt_bias=torch.randn(2, 128, generator=gen).bfloat16())
    converted = dict(beta=given["beta"].bfloat16(), A_log=given["A_log"].float(), dt_bias=given["dt_bias"].float())
    outputs = []
    for leaves in (given, converted):
        for x in leaves.values():
            x.requires_grad_()
        o, _ = training.kda_forward(q, k, v, g, leaves["beta"], A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
                                    backend=REFERENCE)
        (o.float() * do.float()).sum().backward()
        outputs.append(o)
    assert torch.equal(*outputs)
    for name, x in given.items():
        assert x.grad.dtype == x.dtype and torch.equal(x.grad, converted[name].grad.to(x.dtype)), name
