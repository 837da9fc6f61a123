"""Decode / speculative verify on a state pool (issue 32): the mirror against the fp64 recurrence (CPU), the
kernel's variants compiled for sm_90a with PTX checks (CPU), the kernel against the mirror and the fp64
recurrence (GPU tier)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from cute_kda.reference import rel_rms
from cute_kda.reference.decode import channel_order, gold_decode, mirror_decode, read_slots

D = 128
SCALE = D ** -0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _quiet_cpu_intrinsics():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="cute_kda mirror on CPU")
        yield


def make_step(N: int, T: int, H: int, HV: int, gate: str, per_head: bool, *, qk_l2norm: bool = True,
              beta_logits: bool = True, device="cpu", generator=None) -> dict:
    """Inputs of one call (bf16 tokens, fp32 gate parameters), drawn as a model produces them."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    k = randn(N, T, H, D)
    if not qk_l2norm:  # the recurrence is stable for ‖k‖ ≤ 1 and β ≤ 1
        k = k / k.norm(dim=-1, keepdim=True)
    gate_shape = (N, T, HV) if per_head else (N, T, HV, D)
    g = randn(*gate_shape)
    if gate == "none":
        g = torch.nn.functional.logsigmoid(g + 2.0)
    beta = randn(N, T, HV)
    if not beta_logits:
        beta = torch.sigmoid(beta)
    return dict(q=randn(N, T, H, D).bfloat16(), k=k.bfloat16(), v=randn(N, T, HV, D).bfloat16(), g=g.bfloat16(),
                beta=beta.bfloat16())


def make_params(HV: int, gate: str, per_head: bool, device="cpu", generator=None) -> dict:
    """A_log fp32 ``[HV]`` (Kimi's init: log U(1, 16)), dt_bias fp32 ``[HV, 128]`` or ``[HV]``; None for "none"."""
    if gate == "none":
        return dict(A_log=None, dt_bias=None)
    a_log = torch.log(torch.rand(HV, generator=generator, device=device) * 15 + 1)
    bias_shape = (HV,) if per_head else (HV, D)
    return dict(A_log=a_log, dt_bias=0.1 * torch.randn(*bias_shape, generator=generator, device=device))


def options(gate: str, layout: str, *, qk_l2norm: bool = True, beta_logits: bool = True) -> dict:
    return dict(gate=gate, scale=SCALE, lower_bound=-5.0, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
                state_layout=layout)


def random_pool(slots: int, HV: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    return (0.1 * torch.randn(slots, HV, D, D, device=device)).to(dtype)


def rounding_floor(o_gold: torch.Tensor) -> float:
    """rel-RMS of o's own bf16 rounding: what any bf16 output is off by at best."""
    return rel_rms(o_gold.bfloat16(), o_gold)


# ============================================================================ reference (CPU)


def test_channel_order_is_a_permutation():
    for layout, dtype in itertools.product(("vk", "kv"), DTYPES.values()):
        order = channel_order(layout, dtype)
        assert order.shape == (8, 16) and sorted(order.flatten().tolist()) == list(range(D))
    # V-first: 8 lanes cover 128 contiguous bytes of a row per vector load
    assert channel_order("vk", torch.float32)[:, :4].flatten().tolist() == list(range(32))
    assert channel_order("vk", torch.bfloat16)[:, :8].flatten().tolist() == list(range(64))


CASES = list(itertools.product(("safe", "softplus", "none"), (False, True), ("fp32", "bf16"), ("vk", "kv")))


@pytest.mark.parametrize("gate,per_head,pool,layout", CASES, ids=lambda x: str(x))
def test_mirror_chain_equals_gold(gate, per_head, pool, layout):
    """12 chained decode steps, GVA (H 2, HV 4), a padding row: the mirror's states and outputs equal the fp64
    recurrence to rounding; the padding row's outputs are zero and unlisted slots keep their bits."""
    gen = torch.Generator().manual_seed(7)
    N, H, HV, slots = 3, 2, 4, 6
    params = make_params(HV, gate, per_head, generator=gen)
    mirror_pool = random_pool(slots, HV, DTYPES[pool])
    gold_pool = mirror_pool.double()
    untouched = mirror_pool.clone()
    indices = torch.tensor([4, -1, 1], dtype=torch.int32)
    worst_o = 0.0
    for _ in range(12):
        step = make_step(N, 1, H, HV, gate, per_head, generator=gen)
        o = mirror_decode(**step, **params, state_pool=mirror_pool, state_indices=indices, **options(gate, layout))
        o_gold = gold_decode(**step, **params, state_pool=gold_pool, state_indices=indices, **options(gate, layout))
        assert torch.equal(o[1], torch.zeros_like(o[1]))
        live = o_gold[[0, 2]]
        worst_o = max(worst_o, rel_rms(o[[0, 2]].double(), live) - rounding_floor(live))
    state_error = rel_rms(mirror_pool[[4, 1]], gold_pool[[4, 1]])
    for slot in (0, 2, 3, 5):
        assert torch.equal(mirror_pool[slot], untouched[slot])
    if pool == "fp32":
        assert state_error < 2e-6 and worst_o < 2e-4, (state_error, worst_o)
    else:  # a bf16 pool is rounded on every store
        assert state_error < 6e-3 and worst_o < 5e-3, (state_error, worst_o)


@pytest.mark.parametrize("pool,layout", [("fp32", "vk"), ("bf16", "kv")])
def test_mirror_verify_every_accepted_count(pool, layout):
    """Verify with T = 4: rows with every accepted count 1..4, a padding row, a −1 inside a row's slots;
    the slots written and read are the contract's, each equal to the fp64 recurrence to rounding."""
    gen = torch.Generator().manual_seed(11)
    T, H, HV, slots = 4, 1, 2, 24
    accepted = torch.tensor([1, 2, 3, 4, 2, 3], dtype=torch.int32)
    indices = torch.arange(6 * T, dtype=torch.int32).reshape(6, T)
    indices[4] = -1  # padding row: its read slot (accepted − 1) is −1
    indices[5, 3] = -1  # the state after token 3 of row 5 is not kept
    mirror_pool = random_pool(slots, HV, DTYPES[pool])
    gold_pool = mirror_pool.double()
    before = mirror_pool.clone()
    step = make_step(6, T, H, HV, "safe", False, generator=gen)
    params = make_params(HV, "safe", False, generator=gen)
    o = mirror_decode(**step, **params, state_pool=mirror_pool, state_indices=indices,
                      num_accepted_tokens=accepted, **options("safe", layout))
    o_gold = gold_decode(**step, **params, state_pool=gold_pool, state_indices=indices,
                         num_accepted_tokens=accepted, **options("safe", layout))
    assert torch.equal(o[4], torch.zeros_like(o[4]))
    live = [0, 1, 2, 3, 5]
    tol = 2e-6 if pool == "fp32" else 6e-3
    written = [int(s) for s in indices[live].flatten() if s >= 0]
    assert rel_rms(mirror_pool[written], gold_pool[written]) < tol
    assert rel_rms(o[live].double(), o_gold[live]) < rounding_floor(o_gold[live]) + 2e-4
    for slot in set(range(slots)) - set(written):
        assert torch.equal(mirror_pool[slot], before[slot]), slot
    # the state read by a row is the one its accepted count names: the gold from that slot alone agrees
    read = read_slots(indices, accepted)
    assert read.tolist() == [0, 5, 10, 15, -1, 22]


def test_mirror_without_l2norm_or_beta_logits():
    gen = torch.Generator().manual_seed(3)
    N, H, HV = 2, 2, 2
    pool = random_pool(2, HV, torch.float32)
    gold_pool = pool.double()
    indices = torch.tensor([1, 0], dtype=torch.int32)
    opts = options("softplus", "vk", qk_l2norm=False, beta_logits=False)
    params = make_params(HV, "softplus", False, generator=gen)
    for _ in range(6):
        step = make_step(N, 2, H, HV, "softplus", False, qk_l2norm=False, beta_logits=False, generator=gen)
        o = mirror_decode(**step, **params, state_pool=pool, state_indices=indices, **opts)
        o_gold = gold_decode(**step, **params, state_pool=gold_pool, state_indices=indices, **opts)
    assert rel_rms(pool, gold_pool) < 2e-6
    assert rel_rms(o.double(), o_gold) < rounding_floor(o_gold) + 2e-4


def test_mirror_long_chain():
    """200 chained steps of the fp32 pool stay at fp32 rounding from the fp64 recurrence."""
    gen = torch.Generator().manual_seed(5)
    H = HV = 2
    pool = random_pool(1, HV, torch.float32)
    gold_pool = pool.double()
    indices = torch.tensor([0], dtype=torch.int32)
    params = make_params(HV, "safe", True, generator=gen)
    for _ in range(200):
        step = make_step(1, 1, H, HV, "safe", True, generator=gen)
        mirror_decode(**step, **params, state_pool=pool, state_indices=indices, **options("safe", "kv"))
        gold_decode(**step, **params, state_pool=gold_pool, state_indices=indices, **options("safe", "kv"))
    assert rel_rms(pool, gold_pool) < 5e-6


# ============================================================================ thread map and launcher (CPU)


def test_thread_map_matches_the_mirror_order():
    from cute_kda.layouts.decode import DecodeThreadMap

    for layout, dtype in itertools.product(("vk", "kv"), DTYPES):
        for vsplit in DecodeThreadMap.vsplits(layout, dtype):
            tmap = DecodeThreadMap(layout, dtype, vsplit)
            order = [[tmap.channel(lane, e) for e in range(16)] for lane in range(8)]
            assert order == channel_order(layout, DTYPES[dtype]).tolist()
            # the vectors cover the thread's rows × channel slots once, and sit where the channels say
            seen = set()
            for vector in tmap.state_vectors():
                assert len(vector.registers) == tmap.vector
                for c, (row, e) in enumerate(vector.registers):
                    seen.add((row, e))
                    for lane in range(8):
                        value, channel = (row, tmap.channel(lane, e))
                        expected = value * D + channel if layout == "vk" else channel * D + value
                        assert tmap.state_base(lane, 0) + vector.offset + c == expected
            assert seen == {(r, e) for r in range(tmap.rows) for e in range(16)}
            runs = [(run.first + c, run.offset + c) for run in tmap.channel_runs() for c in range(run.length)]
            for lane in range(8):
                assert [tmap.lane_channel_base(lane) + off for _, off in sorted(runs)] == order[lane]
            assert tmap.threads * tmap.rows // 8 * vsplit == D


def test_choose_vsplit():
    from cute_kda.kernels.decode import DecodeVariant

    sms = 132
    assert DecodeVariant.choose_vsplit(1, 32, sms) == 8  # 256 CTAs of one warp
    assert DecodeVariant.choose_vsplit(1, 96, sms) == 4  # 384 CTAs of 64 threads
    assert DecodeVariant.choose_vsplit(512, 96, sms) == 4
    assert DecodeVariant.choose_vsplit(512, 96, sms, "kv", "bf16") == 2  # 64 threads: 32 columns of 8
    assert DecodeVariant.choose_vsplit(1, 4, sms, "kv", "bf16") == 4  # a K-first bf16 band needs 32 columns


def test_variant_rejects_what_the_kernel_cannot_run():
    from cute_kda.kernels.decode import DecodeVariant

    for bad in (dict(tokens=9), dict(gate="tanh"), dict(vsplit=3), dict(state_layout="kv", state_dtype="bf16",
                                                                         vsplit=8)):
        with pytest.raises(ValueError):
            DecodeVariant(**bad)


# ============================================================================ sm_90a compile (CPU)

def _compile_matrix():
    """Every value of every axis, a few times, in 8 variants (a T = 8 verify among them)."""
    from cute_kda.kernels.decode import DecodeVariant as V

    return [
        V(),
        V(gate="softplus", state_dtype="bf16", grouped=True, vsplit=2),
        V(gate="none", per_head_gate=True, state_layout="kv", vsplit=8),
        V(per_head_gate=True, state_dtype="bf16", state_layout="kv", tokens=4, verify=True, grouped=True, vsplit=4),
        V(gate="softplus", per_head_gate=True, tokens=4, verify=True, qk_l2norm=False, beta_logits=False, vsplit=8),
        V(gate="none", state_dtype="bf16", tokens=2, qk_l2norm=False, vsplit=4),
        V(state_layout="kv", tokens=8, verify=True, grouped=True, vsplit=2),
        V(gate="softplus", state_dtype="bf16", state_layout="kv", beta_logits=False),
    ]


def test_compile_matrix_covers_every_axis_value():
    from dataclasses import fields

    from cute_kda.kernels.decode import DecodeVariant

    matrix = _compile_matrix()
    for field in fields(DecodeVariant):
        values = {getattr(v, field.name) for v in matrix}
        if field.type in ("bool", bool):
            assert values == {False, True}, field.name
    assert {v.gate for v in matrix} == {"safe", "softplus", "none"}
    assert {v.vsplit for v in matrix} == {1, 2, 4, 8} and max(v.tokens for v in matrix) == 8


def _scalar_loads(variant) -> int:
    """Non-vector global loads the kernel may issue: slot ids (and accepted counts), β, A_log and a per-head
    gate with its dt_bias; everything else moves in vectors."""
    t = variant.tokens
    indices = 2 + t if variant.verify else 1
    constants = variant.gate != "none"
    return indices + t + constants + variant.per_head_gate * (t + constants)


@pytest.mark.parametrize("variant", _compile_matrix(), ids=lambda v: (
    f"{v.gate}{'-head' if v.per_head_gate else ''}-{v.state_dtype}-{v.state_layout}-T{v.tokens}"
    f"{'-verify' if v.verify else ''}{'' if v.qk_l2norm else '-nol2'}{'' if v.beta_logits else '-nosig'}"
    f"{'-gva' if v.grouped else ''}-vs{v.vsplit}"))
def test_variant_compiles(variant):
    """The launcher's own compile arguments (meta tensors): the state moves in 16-byte vectors only, read once
    and written once per kept state; the token operands in vectors; no local memory, no spills."""
    import re

    from cute_kda.compile_report import compile_with_report
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.ops import decode as ops
    from cute_kda.ops._cache import TVM_FFI_OPTION

    kernel = DecodeKernel(variant)
    _, report = compile_with_report(kernel, *ops.compile_arguments(variant), options=TVM_FFI_OPTION)
    tmap = variant.thread_map
    vectors = len(tmap.state_vectors())
    writes = variant.tokens if variant.verify else 1
    wide_outputs = 2 * variant.tokens if tmap.rows * 2 == 16 else 0  # o rows of 16 bytes (and the zero rows)
    assert report.count("st.global.v4.b32") == vectors * writes + wide_outputs
    assert report.count("ld.global.v4.b32") >= vectors
    scalar_stores = re.findall(r"^\s*(?:@%p\d+\s+)?st\.global\.[bfsu]\d+", report.ptx, re.M)
    assert not scalar_stores  # outputs too are one vector a row group
    scalar_loads = re.findall(r"^\s*(?:@%p\d+\s+)?ld\.global\.(?:nc\.)?[bfsu]\d+", report.ptx, re.M)
    assert len(scalar_loads) <= _scalar_loads(variant), scalar_loads
    # the dot products and the update: one fma per state element each; the decay one mul.rn
    elements = tmap.rows * 16 * variant.tokens
    assert report.count("fma.rn.f32") >= 3 * elements - 2 * tmap.rows * variant.tokens
    assert report.count("mul.rn.f32") >= elements
    assert report.local_memory_ops == 0
    assert len(report.kernels) == 1 and report.spills == 0 and report.kernels[0].stack_frame == 0
    print(f"{variant}: {report.kernels[0].registers} registers, {tmap.threads} threads")
