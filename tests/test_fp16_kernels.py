"""fp16 token tensors in K1 and K2 (issue 33, option 2 of docs/numerics.md "fp16 inputs"): q, k, v and a raw gate
widened to fp32 exactly where bf16 is, o rounded to fp16 where it is rounded to bf16, the workspace unchanged.

CPU: every fp16 variant compiles for sm_90a to its bf16 twin's instructions with each bf16 widening of a token
tensor replaced by ``cvt.f32.f16`` and o's ``cvt.rn.bf16x2.f32`` by ``cvt.rn.f16x2.f32`` — nothing else moves (so
the twin's PTX checks hold for it), and nothing spills. GPU: K1 bit for bit and K2 within one ULP of the mirror on
fp16 inputs; the whole forward against the mirror and the fp64 gold at FLA's tolerance.
"""

from __future__ import annotations

import collections
import itertools
import re

import pytest
import torch
from ulp_check import assert_within_one_ulp

from cute_kda.compile_report import compile_with_report
from cute_kda.dsl import cute, cutlass
from cute_kda.kernels.fwd_prepare import prepare_kernel
from cute_kda.kernels.fwd_recurrence import FwdRecurrence
from cute_kda.layouts.smem import CHUNK
from cute_kda.ops import recurrence as k2
from cute_kda.ops._cache import dsl_type, to_cute_tensor
from cute_kda.workspace import WorkspaceSpec, workspace_views

D = 128
BF16, F16, F32 = cutlass.BFloat16, cutlass.Float16, cutlass.Float32
FLA_TOLERANCE = 5e-3  # FLA's rel-RMS tolerance for o and the final state against its reference


def _mnemonics(ptx: str) -> collections.Counter:
    """How often each PTX instruction (with its modifiers) occurs."""
    counts = collections.Counter()
    for line in ptx.splitlines():
        match = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s", line)
        if match:
            counts[match.group(1)] += 1
    return counts


def _assert_only_conversions_moved(fp16, bf16, moved: dict[str, str]) -> None:
    """``fp16``'s instructions are ``bf16``'s with ``moved``'s keys (bf16 conversions) turned into its values."""
    got, want = _mnemonics(fp16.ptx), _mnemonics(bf16.ptx)
    for bf16_form, fp16_form in moved.items():
        shift = want[bf16_form] - got[bf16_form]
        assert shift > 0, f"no {bf16_form} became {fp16_form}"
        assert got[fp16_form] - want[fp16_form] == shift, (bf16_form, fp16_form, got, want)
        for counts in (got, want):
            del counts[bf16_form], counts[fp16_form]
    assert got == want, {name: (got[name], want[name]) for name in set(got) | set(want) if got[name] != want[name]}
    assert fp16.local_memory_ops == 0 and fp16.spills == 0, fp16.summary()
    assert fp16.launch_smem == bf16.launch_smem


# ---------------------------------------------------------------- K1 (CPU)

K1_VARIANTS = {
    "safe": dict(varlen=False),
    "safe_varlen_plain_256threads": dict(varlen=True, qk_l2norm=False, beta_logits=False, num_threads=256,
                                         ctas_per_sm=5),
    "softplus_varlen": dict(varlen=True, gate="softplus"),
    "log_decay": dict(varlen=False, gate="none"),
    "log_decay_fp32": dict(varlen=True, gate="none", gate_dtype=F32),
    "gdn_softplus_varlen": dict(varlen=True, gate="softplus", per_head_gate=True, grouped=True),
    "gdn_log_decay_fp32": dict(varlen=False, gate="none", gate_dtype=F32, per_head_gate=True, grouped=True),
}


def _compile_k1(config: dict, dtype):
    from test_fwd_prepare import _compile

    kernel = prepare_kernel(**config, dtype=dtype)
    return kernel, _compile(kernel)[0]


@pytest.mark.parametrize("name", list(K1_VARIANTS))
def test_k1_fp16_widens_where_bf16_does(name):
    """q, k (and a raw gate or a log decay in q's dtype) are widened by ``cvt.f32.f16`` where the bf16 twin widens
    bf16; only β (bf16) keeps its one ``cvt.f32.bf16``; every other instruction count, the registers' fit and the
    shared memory are the twin's."""
    kernel, fp16 = _compile_k1(K1_VARIANTS[name], F16)
    _, bf16 = _compile_k1(K1_VARIANTS[name], BF16)
    assert kernel.dtype is F16 and kernel.gate_dtype is K1_VARIANTS[name].get("gate_dtype", F16)
    _assert_only_conversions_moved(fp16, bf16, {"cvt.f32.bf16": "cvt.f32.f16"})
    assert fp16.count("cvt.f32.bf16") == 1  # β's
    (entry,) = fp16.kernels
    assert entry.registers * kernel.num_threads * kernel.ctas_per_sm <= 65536, fp16.summary()


def test_k1_refuses_mixed_dtypes():
    with pytest.raises(ValueError, match="q's dtype"):
        prepare_kernel(varlen=False, dtype=F16, gate_dtype=BF16)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        prepare_kernel(varlen=False, dtype=F32)


# ---------------------------------------------------------------- K2 (CPU)

K2_VARIANTS = [  # (vsplit, initial state, final state, varlen, the training forward's checkpoints)
    (1, None, None, False, False), (1, torch.float32, torch.float32, False, False),
    (2, torch.bfloat16, torch.float32, True, False), (4, torch.bfloat16, torch.bfloat16, True, False),
    (4, None, torch.float32, False, False), (1, torch.float32, torch.float32, True, True),
    (4, torch.bfloat16, None, False, True), (2, None, None, True, True),  # fp16 training's forwards
]
FP16_STATE_VARIANTS = [(1, torch.float16, torch.float16, True, False), (2, None, torch.float16, False, False),
                       (4, torch.float16, None, True, False), (2, torch.float16, torch.float16, False, True)]


def _variant_id(v) -> str:
    states = (str(s).replace("torch.", "") for s in v[1:3])
    return "vs{}-{}-{}-{}{}".format(v[0], *states, "varlen" if v[3] else "fixed", "-checkpoints" if v[4] else "")


def _compile_k2(dtype, vsplit, state_in, state_out, varlen, checkpoints):
    heads, num_seqs = 2, 3
    batch, steps = (1, 80) if varlen else (num_seqs, 24)
    v = torch.zeros(batch, steps, heads, D, dtype=dtype)
    spec = WorkspaceSpec(heads=heads, tiles=8)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))

    def state(state_dtype):
        return None if state_dtype is None else torch.zeros(num_seqs, heads, D, D, dtype=state_dtype)

    from cute_kda.workspace import block_states_shape

    arguments = k2.launch_arguments(
        v, ws, torch.zeros_like(v), cu_seqlens=torch.tensor([0, 20, 20, 80]) if varlen else None,
        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None, initial_state=state(state_in),
        final_state=state(state_out), tensor=to_cute_tensor,
        checkpoints=torch.zeros(block_states_shape(ws, heads, num_seqs), dtype=torch.bfloat16) if checkpoints else None,
    )
    kernel = FwdRecurrence(vsplit=vsplit, initial_state=dsl_type(state_in), final_state=dsl_type(state_out),
                           varlen=varlen, checkpoints=checkpoints, dtype=dsl_type(dtype))
    return kernel, compile_with_report(kernel, *arguments, cute.runtime.make_fake_stream())[1]


@pytest.mark.parametrize("variant", K2_VARIANTS, ids=_variant_id)
def test_k2_fp16_widens_v_and_rounds_o(variant):
    """v is widened by ``cvt.f32.f16`` where the bf16 twin widens bf16, o leaves by ``cvt.rn.f16x2.f32`` (one per
    pair of its C fragment: 2 a mma atom) where the twin's leaves by ``cvt.rn.bf16x2.f32``; u, U and the state keep
    their bf16 roundings and every other instruction is the twin's."""
    kernel, fp16 = _compile_k2(torch.float16, *variant)
    _, bf16 = _compile_k2(torch.bfloat16, *variant)
    atoms = kernel.warp_cols // 8
    assert fp16.count("cvt.rn.f16x2.f32") == 2 * atoms
    assert bf16.count("cvt.rn.bf16x2.f32") - fp16.count("cvt.rn.bf16x2.f32") == 2 * atoms
    assert fp16.count("cvt.f32.f16") > 0
    _assert_only_conversions_moved(fp16, bf16, {"cvt.f32.bf16": "cvt.f32.f16", "cvt.rn.bf16x2.f32": "cvt.rn.f16x2.f32"})
    assert len(fp16.kernels) == 1 and fp16.kernels[0].stack_frame == 0


@pytest.mark.parametrize("variant", FP16_STATE_VARIANTS, ids=_variant_id)
def test_k2_fp16_states_pass_through_the_staging(variant):
    """An fp16 state takes an fp32 state's way, through the staging buffer (the same shared memory): widened by
    ``cvt.f32.f16`` into the fp32 registers on load (besides its bf16 rounding for the state buffer), and every fp32
    state element a lane holds rounded once by ``cvt.rn.f16.f32`` on store; nothing spills."""
    as_fp32 = tuple(torch.float32 if dtype is torch.float16 else dtype for dtype in variant[1:3])
    kernel, fp16 = _compile_k2(torch.float16, *variant)
    _, fp32 = _compile_k2(torch.float16, variant[0], *as_fp32, *variant[3:])
    lane_elements = (D // 16) * (16 * kernel.warp_cols // 32)  # the warp's [K, cols] fp32 state, per lane
    assert kernel.staging is cutlass.Float16 and kernel.plan.state_io_fp32
    assert fp16.count("cvt.rn.f16.f32") == (lane_elements if variant[2] is torch.float16 else 0)
    assert fp32.count("cvt.rn.f16.f32") == 0
    widened = fp16.count("cvt.f32.f16") - fp32.count("cvt.f32.f16")
    assert widened >= (lane_elements if variant[1] is torch.float16 else 0) and (widened > 0) == (variant[1] is not None)
    assert fp16.local_memory_ops == 0 and fp16.spills == 0 and fp16.kernels[0].stack_frame == 0, fp16.summary()
    assert fp16.launch_smem == fp32.launch_smem


def test_k2_refuses_fp16_beside_fp32_states():
    with pytest.raises(ValueError, match="staging"):
        FwdRecurrence(initial_state=F16, final_state=F32)


# ---------------------------------------------------------------- Kernel B's fp16 gradient stores (CPU)

KB_GRAD_VARIANTS = {  # the benchmark's safe gate (8 warps, gate_ahead) and a per-channel unbounded gate's dg
    "safe_fixed": dict(varlen=False, gate="safe", compute_warps=8, gate_ahead=True),
    "softplus_varlen": dict(varlen=True, gate="softplus", compute_warps=8, gate_ahead=True),
}
STORE_FORMS = ("st.global.b32", "st.global.v2.b16")  # a pair of gradients: one 32-bit store (or two halves packed)


def _compile_kernel_b(config: dict, grad_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16):
    """Kernel B of ``config`` with q, k, v and the raw gate in ``dtype`` and dq, dk, dg (a per-head gate's dq, dk)
    stored in ``grad_dtype``: the kernel and its compile report."""
    from test_bwd_grads import _LAUNCH_ORDER, _dyadic_buffers, _per_head_buffers

    from cute_kda.kernels.bwd_grads import bwd_grads_kernel
    from cute_kda.ops import bwd_grads as kb

    per_head = config.get("per_head_gate", False)
    dim = config.get("dim", D)
    buffers = (_per_head_buffers if per_head else _dyadic_buffers)("softplus", grouped=False, varlen=config["varlen"],
                                                                   dim=dim)
    buffers.update({n: buffers[n].to(dtype) for n in ("q", "k", "v", "g")})
    buffers.update({n: buffers[n].to(grad_dtype) for n in ("dq", "dk") + (() if per_head else ("dg",))})
    if config["gate"] == "safe":
        buffers["dt_bias"] = torch.zeros(buffers["v"].shape[2], dim)
    kernel = bwd_grads_kernel(**config, gate_dtype=dsl_type(dtype), grad_dtype=dsl_type(grad_dtype),
                              dtype=dsl_type(dtype))
    arguments = kb.launch_arguments(*(buffers[name] for name in _LAUNCH_ORDER), scale=dim ** -0.5, lower_bound=-5.0,
                                    cu_seqlens=buffers["cu_seqlens"], tile_base=buffers["tile_base"],
                                    tensor=to_cute_tensor)
    return kernel, compile_with_report(kernel, *arguments, cute.runtime.make_fake_stream())[1]


@pytest.mark.parametrize("name", list(KB_GRAD_VARIANTS))
def test_kernel_b_stores_fp16_gradients_as_the_copy_route_converts(name):
    """dq, dk and dg stored in fp16 as ``f16(f32(bf16 value))``: every bf16 rounding of the twin stays (as many
    roundings, paired or not), each stored value is widened once more (``cvt.f32.bf16``) and rounded once to fp16
    (``cvt.rn.f16x2.f32`` a pair of dq / dk, ``cvt.rn.f16.f32`` a dg), as many global stores; nothing else moves
    (besides a ``mov.b32`` of the pairs' packing), nothing spills, the registers and shared memory are the twin's."""
    kernel, fp16 = _compile_kernel_b(KB_GRAD_VARIANTS[name], torch.float16)
    _, bf16 = _compile_kernel_b(KB_GRAD_VARIANTS[name], torch.bfloat16)
    assert kernel.grad_dtype is F16
    got, want = _mnemonics(fp16.ptx), _mnemonics(bf16.ptx)
    converted = 2 * got["cvt.rn.f16x2.f32"] + got["cvt.rn.f16.f32"]
    pair_stores = kernel.band * CHUNK // 32  # dq's (dk's) pairs a thread stores: 2 · (values / 2)
    assert got["cvt.rn.f16x2.f32"] == pair_stores and got["cvt.rn.f16.f32"] > 0  # dq, dk; dg
    assert got["cvt.f32.bf16"] - want["cvt.f32.bf16"] == converted
    rounded = [c["cvt.rn.bf16.f32"] + 2 * c["cvt.rn.bf16x2.f32"] for c in (got, want)]  # values rounded to bf16
    assert rounded[0] == rounded[1]
    assert sum(got[f] for f in STORE_FORMS) == sum(want[f] for f in STORE_FORMS)
    moved = {"cvt.f32.bf16", "cvt.rn.f16x2.f32", "cvt.rn.f16.f32", "cvt.rn.bf16.f32", "cvt.rn.bf16x2.f32", "mov.b32",
             *STORE_FORMS}
    assert {n: got[n] for n in got if n not in moved} == {n: want[n] for n in want if n not in moved}
    assert abs(got["mov.b32"] - want["mov.b32"]) <= 2
    assert fp16.local_memory_ops == 0 and fp16.spills == 0, fp16.summary()
    assert fp16.kernels[0].registers == bf16.kernels[0].registers and fp16.launch_smem == bf16.launch_smem


@pytest.mark.parametrize("vsplit", [1, 4])
def test_kernel_a_stores_fp16_dv_as_the_copy_route_converts(vsplit):
    """dv stored in fp16 as ``f16(f32(bf16(β·du)))``: the twin's bf16 roundings stay (−dv feeds G5 as bf16), each
    dv value is widened once more (``cvt.f32.bf16``) and a pair rounded to fp16 by one ``cvt.rn.f16x2.f32`` (a
    mma atom's C fragment holds 2 pairs), the pairs' packing moves (``mov.b32``, at most one a pair); the same stmatrix
    and TMA stores, nothing spills, the shared memory is the twin's."""
    from cute_kda.kernels.bwd_scan import BwdScan
    from cute_kda.ops import bwd_scan as ka

    heads, num_seqs = 2, 3
    do = torch.zeros(1, 80, heads, D, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=8)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    from cute_kda.workspace import block_states_shape

    snapshots = torch.zeros(block_states_shape(ws, heads, num_seqs), dtype=torch.bfloat16)

    def compiled(dv_dtype):
        kernel = BwdScan(vsplit=vsplit, dht=F32, varlen=True, dv_dtype=dsl_type(dv_dtype))
        arguments = ka.launch_arguments(do, ws, do.to(dv_dtype), do, snapshots, dht=torch.zeros(num_seqs, heads, D, D),
                                        dh0=None, cu_seqlens=torch.tensor([0, 20, 20, 80]),
                                        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32), tensor=to_cute_tensor)
        return kernel, compile_with_report(kernel, *arguments, cute.runtime.make_fake_stream())[1]

    kernel, fp16 = compiled(torch.float16)
    _, bf16 = compiled(torch.bfloat16)
    assert kernel.dv_dtype is F16
    got, want = _mnemonics(fp16.ptx), _mnemonics(bf16.ptx)
    pairs = kernel.warp_cols // 8 * 2  # a lane's dv pairs: 2 a mma atom of 8 columns
    assert got["cvt.rn.f16x2.f32"] == pairs and got["cvt.f32.bf16"] - want["cvt.f32.bf16"] == 2 * pairs
    assert abs(got["mov.b32"] - want["mov.b32"]) <= pairs
    moved = {"cvt.rn.f16x2.f32", "cvt.f32.bf16", "mov.b32"}
    assert {n: got[n] for n in got if n not in moved} == {n: want[n] for n in want if n not in moved}
    assert fp16.local_memory_ops == 0 and fp16.spills == 0, fp16.summary()
    assert fp16.launch_smem == bf16.launch_smem


# ---------------------------------------------------------------- Kernel B reading fp16 inputs (CPU)

KB_INPUT_VARIANTS = {  # the benchmark's safe gate, a per-channel and a per-head unbounded gate (each scheme)
    "safe_fixed": dict(varlen=False, gate="safe", compute_warps=8, gate_ahead=True),
    "softplus_varlen": dict(varlen=True, gate="softplus", compute_warps=8, gate_ahead=True),
    "gdn_softplus_varlen": dict(varlen=True, gate="softplus", per_head_gate=True, compute_warps=8),
    "safe_varlen_d64": dict(varlen=True, gate="safe", compute_warps=4, gate_ahead=True, dim=64),
}


@pytest.mark.parametrize("name", list(KB_INPUT_VARIANTS))
def test_kernel_b_widens_fp16_inputs_where_bf16_does(name):
    """q, k, v and the raw gate in fp16: each is widened by ``cvt.f32.f16`` where the bf16 twin widens bf16 (the
    recompute's K1 instructions, v in ``w = v − kd·S``, the l2norm backward's q, k); the same TMA tiles, ``ldmatrix``
    and loads (16-bit either way); dO, du, the workspace and the state images keep their bf16 widenings; every other
    instruction count, the registers' fit and the shared memory are the twin's, nothing spills."""
    kernel, fp16 = _compile_kernel_b(KB_INPUT_VARIANTS[name], torch.float16, torch.float16)
    _, bf16 = _compile_kernel_b(KB_INPUT_VARIANTS[name], torch.float16, torch.bfloat16)
    assert kernel.dtype is F16 and kernel.gate_dtype is F16
    _assert_only_conversions_moved(fp16, bf16, {"cvt.f32.bf16": "cvt.f32.f16"})
    assert fp16.count("cvt.f32.bf16") > 0  # dO, du, the states
    (entry,) = fp16.kernels
    assert entry.registers * kernel.num_threads * kernel.ctas_per_sm <= 65536, fp16.summary()


def test_kernel_b_refuses_mixed_input_dtypes():
    from cute_kda.kernels.bwd_grads import bwd_grads_kernel

    with pytest.raises(ValueError, match="q's dtype"):
        bwd_grads_kernel(varlen=False, gate="safe", dtype=F16, gate_dtype=BF16)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        bwd_grads_kernel(varlen=False, gate="safe", dtype=F32, gate_dtype=F32)


def test_kernel_b_refuses_fp16_gradients_of_grouped_heads():
    from cute_kda.kernels.bwd_grads import bwd_grads_kernel

    with pytest.raises(ValueError, match="fp16 without grouped"):
        bwd_grads_kernel(varlen=False, gate="softplus", grouped=True, grad_dtype=F16)


def test_warmup_lists_the_fp16_variants(monkeypatch):
    """``dtypes`` lists K1 and K2 per activation dtype (an fp16 log decay beside the fp32 one); with ``training`` K2's
    checkpoint variants in fp16 too and, on the copy route (``FP16_NATIVE_BACKWARD`` off), the backward's bf16
    variants, which fp16 training then runs on bf16 copies (an fp16 state's dht / dh0 in fp32, a raw fp16 gate as
    bf16)."""
    from cute_kda.api import warmup_variants
    from cute_kda.executors import training

    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", False)
    from cute_kda.variants import CombineVariant, GradsVariant, PrepareVariant, RecurrenceVariant, ScanVariant

    fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
    selection = dict(varlen=(False,), state_modes=(fp16,), vsplits=(1,), gates=("safe", "none"), segments=True)
    variants = warmup_variants(dtypes=(fp16,), **selection)
    prepares = {(v.gate, v.g_dtype, v.dtype) for v in variants if isinstance(v, PrepareVariant)}
    assert prepares == {("safe", fp16, fp16), ("none", fp16, fp16), ("none", fp32, fp16)}
    recurrences = [v for v in variants if isinstance(v, RecurrenceVariant)]
    assert {v.dtype for v in recurrences} == {fp16} and RecurrenceVariant(1, fp16, fp16, False, dtype=fp16) in recurrences
    assert not any(isinstance(v, (ScanVariant, GradsVariant)) for v in variants)
    assert not any(v.checkpoints for v in recurrences)
    trained = warmup_variants(dtypes=(fp16,), training=True, **selection)
    assert set(variants) < set(trained)
    assert RecurrenceVariant(1, fp16, fp16, False, True, dtype=fp16) in trained
    assert RecurrenceVariant(1, fp32, fp32, True, True, dtype=fp16) in trained  # a segmented call's training pass
    # a segmented call's combines: forward from the fp16 initial state, backward from dht (fp32 for an fp16 state)
    assert CombineVariant(128, False, fp16) in variants
    assert CombineVariant(128, True, fp32) in trained and CombineVariant(128, True, fp16) not in trained
    scans = {(v.dht, v.dh0) for v in trained if isinstance(v, ScanVariant) and not v.varlen}
    assert scans == {(fp32, fp32), (None, fp32)}
    grads = {(v.gate, v.g_dtype) for v in trained if isinstance(v, GradsVariant)}
    assert grads == {("safe", bf16), ("none", bf16), ("none", fp32)}
    both = warmup_variants(dtypes=(bf16, fp16), training=True, **selection)
    assert set(trained) <= set(both)


def test_warmup_lists_the_fp16_gradient_twins_under_the_switch(monkeypatch):
    """On the copy route, under ``FP16_GRAD_STORES`` an fp16 selection lists Kernel A with an fp16 dv beside every bf16 one and Kernel B
    with fp16 gradients for the per-channel gates in q's dtype (not the fp32 log decay's); bf16 alone lists none."""
    from cute_kda.api import warmup_variants
    from cute_kda.executors import training
    from cute_kda.variants import GradsVariant, ScanVariant

    fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
    selection = dict(varlen=(False,), state_modes=(fp16,), vsplits=(1,), gates=("safe", "none"), segments=True,
                     training=True)
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", False)  # the copy route, where the stores are a choice
    off = warmup_variants(dtypes=(fp16,), **selection)
    monkeypatch.setattr(training, "FP16_GRAD_STORES", True)
    on = warmup_variants(dtypes=(fp16,), **selection)
    assert set(off) < set(on)
    bf16_only = warmup_variants(dtypes=(bf16,), **selection)
    assert not any(getattr(v, "dv_dtype", bf16) == fp16 or getattr(v, "grad_dtype", bf16) == fp16 for v in bf16_only)
    scans = [v for v in on if isinstance(v, ScanVariant)]
    twins = [v for v in scans if v.dv_dtype == fp16]
    assert twins and len(twins) == len(scans) - len(twins)
    grads = {(v.gate, v.g_dtype, v.grad_dtype) for v in on if isinstance(v, GradsVariant)}
    assert grads == {("safe", bf16, bf16), ("none", bf16, bf16), ("none", fp32, bf16), ("safe", bf16, fp16),
                     ("none", bf16, fp16)}


def test_warmup_lists_kernel_b_on_fp16_inputs_under_the_native_switch(monkeypatch):
    """Under ``FP16_NATIVE_BACKWARD`` an fp16 selection lists Kernel B reading fp16 inputs for each fp16 gate form
    (fp16 gradients but for the fp32 log decay's) and Kernel A's fp16 dv twins; bf16 alone lists none."""
    from cute_kda.api import warmup_variants
    from cute_kda.executors import training
    from cute_kda.variants import GradsVariant, ScanVariant

    fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
    selection = dict(varlen=(False,), state_modes=(fp16,), vsplits=(1,), gates=("safe", "none"), segments=True,
                     training=True)
    monkeypatch.setattr(training, "FP16_NATIVE_BACKWARD", True)
    on = warmup_variants(dtypes=(fp16,), **selection)
    native = {(v.gate, v.g_dtype, v.grad_dtype) for v in on if isinstance(v, GradsVariant) and v.dtype == fp16}
    assert native == {("safe", fp16, fp16), ("none", fp16, fp16), ("none", fp32, bf16)}
    assert any(v.dv_dtype == fp16 for v in on if isinstance(v, ScanVariant))
    bf16_only = warmup_variants(dtypes=(bf16,), **selection)
    assert not any(getattr(v, "dtype", bf16) == fp16 or getattr(v, "grad_dtype", bf16) == fp16
                   or getattr(v, "dv_dtype", bf16) == fp16 for v in bf16_only)


def _fla_fp16_cases() -> list[str]:
    from test_fla_grid import CASES

    return sorted(name for name, case in CASES.items()
                  if case.dtype == torch.float16 and case.dim == D and not case.neg_eigval)


@pytest.mark.parametrize("name", _fla_fp16_cases())
def test_flas_fp16_chunk_cases_run_on_the_kernels_as_inference(monkeypatch, name):
    """FLA's own fp16 chunk tests (K = V = 128), called without autograd, are taken by the FLA backends (no silent
    fallback) — but for a raw gate in fp32 beside fp16 activations, refused by name (FLA computes it)."""
    from cute_kda import fla_backend
    from test_fla_grid import CASES, fla_arguments

    monkeypatch.setattr(fla_backend, "_device_reason", lambda q: None)
    case = CASES[name]
    verify = fla_backend.verify if case.op == "kda" else fla_backend.verify_gdn
    with torch.no_grad():
        accepted, reason = verify(**fla_arguments(case))
    if case.gate_in_kernel and case.g_dtype == torch.float32:
        assert not accepted and "g must be float16, got float32" in reason, reason
    else:
        assert (accepted, reason) == (True, None)


# ---------------------------------------------------------------- GPU: against the mirror and the gold


def _fp16_problem(batch, steps, heads, value_heads=None, *, gate="safe", per_head=False, seed=0, device="cuda"):
    """fp16 q, k, v, raw gate (or fp32 log decay), bf16 β logits, fp32 A_log, dt_bias; FLA's draws for q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    value_heads = value_heads or heads
    q, k = (torch.rand(batch, steps, heads, D, generator=gen).half() for _ in range(2))
    v = torch.rand(batch, steps, value_heads, D, generator=gen).half()
    gate_shape = (batch, steps, value_heads) if per_head else (batch, steps, value_heads, D)
    if gate == "none":
        g = torch.nn.functional.logsigmoid(torch.randn(gate_shape, generator=gen))
    else:
        g = (torch.randn(gate_shape, generator=gen) * 4).half()
    beta = torch.randn(batch, steps, value_heads, generator=gen).bfloat16()
    A_log = torch.rand(value_heads, generator=gen) - 0.5 if gate != "none" else None
    dt_bias = torch.randn(gate_shape[2:], generator=gen) if gate != "none" else None
    return {name: None if t is None else t.to(device)
            for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias).items()}


K1_GPU_CASES = {  # (gate, per-head gate, value heads per q/k head, mirror scheme)
    "safe": ("safe", False, 1, None),
    "softplus": ("softplus", False, 1, "dyadic"),
    "log_decay_fp32": ("none", False, 1, "dyadic"),
    "gdn_softplus_grouped": ("softplus", True, 2, "per_head"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(K1_GPU_CASES))
@pytest.mark.parametrize("lengths", [None, [17, 0, 300, 1, 64]], ids=["B2xT97", "varlen"])
def test_k1_fp16_matches_the_mirror(case, lengths):
    """K1 on fp16 inputs writes the mirror's workspace (qd, kd, kr, gT, β bit for bit; INV, Mqk within one ULP)."""
    from test_fwd_prepare import _assert_matches, _run

    gate, per_head, group, scheme = K1_GPU_CASES[case]
    batch, steps = (2, 97) if lengths is None else (1, sum(lengths))
    x = _fp16_problem(batch, steps, 2, 2 * group, gate=gate, per_head=per_head, seed=3)
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    ws, ref, exists = _run(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], cu_seqlens=cu, gate=gate,
                           scheme=scheme)
    _assert_matches(ws, ref, exists, f"fp16 {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("state", [torch.float32, torch.float16])
@pytest.mark.parametrize("steps", [1, 7, 16])
def test_k2_fp16_single_tile_within_one_ulp_of_the_mirror(steps, state):
    from cute_kda.reference import mirror_prepare, mirror_recurrence

    x = _fp16_problem(2, steps, 3, seed=steps)
    ws = mirror_prepare(x["q"], x["k"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"])
    init = (torch.randn(2, 3, D, D, device="cuda") * 0.5).to(state)
    out = torch.full_like(x["v"], float("nan"))
    final = torch.empty_like(init)
    k2.recurrence(x["v"], ws, out, initial_state=init, final_state=final)
    o_ref, final_ref = mirror_recurrence(ws, x["v"], initial_state=init, output_final_state=True, state_dtype=state)
    assert out.dtype == torch.float16 and not out.isnan().any()
    assert_within_one_ulp(f"T={steps} o", out, o_ref)
    assert_within_one_ulp(f"T={steps} state", final, final_ref)


GPU_FORWARD_CASES = {  # gate, per-head gate, value heads, lengths (None: B2 T1000), initial state dtype
    "safe_fixed": ("safe", False, 2, None, None),
    "safe_varlen_fp32_state": ("safe", False, 2, [1, 0, 15, 16, 17, 1000, 333], torch.float32),
    "softplus_varlen": ("softplus", False, 2, [300, 1, 700], torch.bfloat16),
    "log_decay_fp32": ("none", False, 2, None, torch.float32),
    "gdn_grouped": ("softplus", True, 4, [513, 64, 2], torch.float32),
    "safe_fp16_state": ("safe", False, 2, None, torch.float16),
    "gdn_varlen_fp16_state": ("none", True, 2, [100, 0, 17, 700], torch.float16),
    "safe_segmented_fp16_state": ("safe", False, 2, None, torch.float16),  # context parallel (segments=4)
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_FORWARD_CASES))
def test_fp16_forward_matches_the_mirror_and_the_gold(case):
    """``kda_forward`` on fp16 q, k, v (o in fp16) against the fp16 mirror (rel-RMS 2e-3, the K2 tests' drift
    bound) and the fp64 gold on the fp16 values (FLA's 5e-3)."""
    import cute_kda
    from cute_kda.reference import gold_forward, mirror_forward, rel_rms
    from cute_kda.reference.pairs import mirror_forward_pairs
    from cute_kda.device import sm_count
    from cute_kda.variants import RecurrenceVariant, pair_prefill

    gate, per_head, value_heads, lengths, state_dtype = GPU_FORWARD_CASES[case]
    batch, steps = (2, 1000) if lengths is None else (1, sum(lengths))
    x = _fp16_problem(batch, steps, 2, value_heads, gate=gate, per_head=per_head, seed=7)
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    num_seqs = batch if lengths is None else len(lengths)
    init = None
    if state_dtype is not None:
        init = (torch.randn(num_seqs, value_heads, D, D, device="cuda") * 0.1).to(state_dtype)
    options = dict(gate=gate, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu, initial_state=init)
    segments = 4 if "segmented" in case else None
    with torch.inference_mode():
        o, final = cute_kda.kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                        segments=segments, **options)
    assert o.dtype == torch.float16 and final.dtype == (state_dtype or torch.float32)
    tensors = [x[name] for name in ("q", "k", "v", "g", "beta")]
    vsplit = RecurrenceVariant.choose_vsplit(num_seqs, value_heads, sm_count(0))  # the call's, and its K2's
    pairs = pair_prefill(gate, per_head, segments is not None, vsplit)  # the two-tile prefill's mirrors where it runs
    mirror = (mirror_forward_pairs if pairs else mirror_forward)(*tensors, output_final_state=True,
                                                                 state_dtype=final.dtype, **options)
    gold = gold_forward(*tensors, output_final_state=True, **options)
    errors = dict(o_mirror=rel_rms(o, mirror[0]), state_mirror=rel_rms(final, mirror[1]),
                  o_gold=rel_rms(o, gold[0]), state_gold=rel_rms(final, gold[1]))
    print(case, {name: f"{error:.2e}" for name, error in errors.items()})
    assert errors["o_mirror"] <= 2e-3 and errors["state_mirror"] <= 2e-3, errors
    assert errors["o_gold"] <= FLA_TOLERANCE and errors["state_gold"] <= FLA_TOLERANCE, errors
