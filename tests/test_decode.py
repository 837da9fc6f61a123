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
from ptx_checks import unread_vector_words

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


def random_pool(slots: int, HV: int, dtype: torch.dtype, device="cpu", generator=None) -> torch.Tensor:
    return (0.1 * torch.randn(slots, HV, D, D, device=device, generator=generator)).to(dtype)


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


PACKED_LENGTHS = (0, 1, 3, 8, 13, 5)  # the last a padding row (slot −1)


def packed_case(lengths, H: int, HV: int, gate: str, per_head: bool, pool_dtype: torch.dtype, *,
                verify_width: int | None = None, offsets_dtype=torch.int32, qk_l2norm: bool = True,
                beta_logits: bool = True, device="cpu", seed: int = 0) -> dict:
    """A packed call: q, k, v, g, beta ``[1, Σ lengths, ...]``, ``cu_seqlens``, a pool with spare slots, slot ids
    (a random permutation; the last sequence is padding) — ``[N]``, or ``[N, verify_width]`` with accepted counts
    cycling through 1 .. verify_width."""
    gen = torch.Generator().manual_seed(seed)
    N = len(lengths)
    step = make_step(1, sum(lengths), H, HV, gate, per_head, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
                     generator=gen)
    params = make_params(HV, gate, per_head, generator=gen)
    width = verify_width or 1
    listed = N * width
    slots = listed + 3
    indices = torch.randperm(slots, generator=gen)[:listed].int().reshape(N, width)
    indices[-1] = -1
    accepted = None
    if verify_width is None:
        indices = indices[:, 0]
    else:
        accepted = (torch.arange(N) % width + 1).int()
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=offsets_dtype)
    tensors = {**step, **params, "state_pool": random_pool(slots, HV, pool_dtype, generator=gen),
               "state_indices": indices, "num_accepted_tokens": accepted, "cu_seqlens": bounds}
    return {name: None if t is None else t.to(device) for name, t in tensors.items()}


def packed_slots(case: dict, lengths) -> tuple[list[int], list[int]]:
    """(slots a packed call may write, slots it must keep): a decode writes its live sequences' slots, a verify the
    first ``length`` entries of a live row; 0-length sequences and padding rows write nothing."""
    indices, accepted = case["state_indices"].cpu(), case["num_accepted_tokens"]
    read = read_slots(indices, None if accepted is None else accepted.cpu())
    written = []
    for n, length in enumerate(lengths):
        if length == 0 or read[n] < 0:
            continue
        row = indices[n:n + 1].flatten() if indices.dim() == 1 else indices[n, :length]
        written += [int(s) for s in row if s >= 0]
    kept = sorted(set(range(case["state_pool"].shape[0])) - set(written))
    return written, kept


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
@pytest.mark.parametrize("pool", ["fp32", "bf16"])
def test_mirror_packed_equals_gold(verify, pool):
    """Packed sequences of lengths 0, 1, 3, 8, 13 and a padding row (verify: S + 1 = 13 slots a row): the mirror's
    outputs and written states equal the fp64 recurrence to rounding; the padding row's outputs are zero; the slots
    of the 0-length sequence, the padding row and the unlisted ones keep their bits."""
    case = packed_case(PACKED_LENGTHS, 2, 4, "safe", False, DTYPES[pool], verify_width=13 if verify else None)
    gold_case = {**case, "state_pool": case["state_pool"].double()}
    before = case["state_pool"].clone()
    o = mirror_decode(**case, **options("safe", "vk"))
    o_gold = gold_decode(**gold_case, **options("safe", "vk"))
    written, kept = packed_slots(case, PACKED_LENGTHS)
    assert len(written) == (1 + 3 + 8 + 13 if verify else 4)
    padding = slice(sum(PACKED_LENGTHS[:-1]), None)
    assert torch.equal(o[:, padding], torch.zeros_like(o[:, padding]))
    live = slice(0, padding.start)
    tol = 2e-6 if pool == "fp32" else 6e-3
    assert rel_rms(case["state_pool"][written], gold_case["state_pool"][written]) < tol
    assert rel_rms(o[:, live].double(), o_gold[:, live]) < rounding_floor(o_gold[:, live]) + 2e-4
    assert torch.equal(case["state_pool"][kept], before[kept])


def test_mirror_packed_is_per_sequence():
    """A packed call computes each sequence exactly as a fixed-length call of its own (int64 offsets)."""
    lengths = (2, 0, 4)
    case = packed_case(lengths, 1, 2, "softplus", True, torch.float32, offsets_dtype=torch.int64, seed=3)
    case["state_indices"][-1] = 0  # no padding row here: every sequence live
    solo_pool = case["state_pool"].clone()
    o = mirror_decode(**case, **options("softplus", "kv"))
    start = 0
    for n, length in enumerate(lengths):
        rows = slice(start, start + length)
        start += length
        if length == 0:
            continue
        solo = {name: case[name][:, rows] for name in ("q", "k", "v", "g", "beta")}
        o_solo = mirror_decode(**solo, A_log=case["A_log"], dt_bias=case["dt_bias"], state_pool=solo_pool,
                               state_indices=case["state_indices"][n:n + 1], **options("softplus", "kv"))
        assert torch.equal(o[:, rows], o_solo)
    assert torch.equal(case["state_pool"], solo_pool)


# ============================================================================ thread map and launcher (CPU)


def test_thread_map_matches_the_mirror_order():
    from cute_kda.layouts.decode import DecodeThreadMap

    maps = [(layout, dtype, halves) for layout, dtype in itertools.product(("vk", "kv"), DTYPES)
            for halves in ((1, 2) if layout == "vk" else (1,))]
    for layout, dtype, halves in maps:
        for vsplit in DecodeThreadMap.vsplits(layout, dtype, halves):
            tmap = DecodeThreadMap(layout, dtype, vsplit, halves)
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
            # the blocks split the vectors by rows, registers numbered from the block's first row
            blocks = [tmap.block_vectors(half) for half in range(halves)]
            assert sorted(v.offset for block in blocks for v in block) == sorted(v.offset for v in tmap.state_vectors())
            for half, block in enumerate(blocks):
                assert {row for v in block for row, _ in v.registers} == set(range(tmap.block_rows))
                # a V-first block's register row r is the group's value row block_first_row + r (its v, its output)
                first = tmap.block_first_row(half)
                assert first == half * tmap.block_rows
                assert layout == "kv" or all(
                    tmap.state_base(lane, 0) + v.offset + c == (first + row) * D + tmap.channel(lane, e)
                    for lane in range(8) for v in block for c, (row, e) in enumerate(v.registers))
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
    assert DecodeVariant.choose_vsplit(512, 96, sms, "vk", "bf16", paired=True) == 2  # 64 threads of 8 rows
    assert DecodeVariant.choose_vsplit(1, 32, sms, "vk", "bf16", paired=True) == 4  # its last split: a warp


def test_choose_paired():
    """Paired where it can run and its grid (2 CTAs a head) fills 132 SMs twice at 6 CTAs: N·HV ≥ 792."""
    from cute_kda.kernels.decode import DecodeVariant

    sms = 132
    assert DecodeVariant.choose_paired(128, 32, sms, 1, False, "vk", "bf16")
    assert DecodeVariant.choose_paired(792, 1, sms, 1, False, "vk", "bf16")
    assert not DecodeVariant.choose_paired(791, 1, sms, 1, False, "vk", "bf16")
    assert not DecodeVariant.choose_paired(8, 32, sms, 1, False, "vk", "bf16")  # under two waves: plain CTAs
    cannot = ((4, True, "vk", "bf16"), (2, False, "vk", "bf16"), (None, False, "kv", "bf16"), (1, False, "kv", "bf16"),
              (1, False, "vk", "fp32"), (None, False, "vk", "fp32"), (None, True, "vk", "bf16"))
    for tokens, verify, layout, dtype in cannot:
        assert not DecodeVariant.choose_paired(512, 96, sms, tokens, verify, layout, dtype)
    # the runtime loop's decode (perf-log D8): a fixed T over 8 or int32 offsets, not int64 (spills at the cap)
    assert DecodeVariant.choose_paired(512, 96, sms, None, False, "vk", "bf16")
    assert DecodeVariant.choose_paired(512, 96, sms, None, False, "vk", "bf16", cu_seqlens="int32")
    assert not DecodeVariant.choose_paired(512, 96, sms, None, False, "vk", "bf16", cu_seqlens="int64")
    assert DecodeVariant.choose_paired(512, 96, sms, 1, False, "vk", "bf16", vsplit=4)
    assert not DecodeVariant.choose_paired(512, 96, sms, 1, False, "vk", "bf16", vsplit=8)  # 16 threads


def test_variant_rejects_what_the_kernel_cannot_run():
    from cute_kda.kernels.decode import DecodeVariant

    for bad in (dict(tokens=9), dict(tokens=0), dict(gate="tanh"), dict(vsplit=3),
                dict(state_layout="kv", state_dtype="bf16", vsplit=8), dict(cu_seqlens="int32"),
                dict(tokens=None, cu_seqlens="int16"), dict(prefetch=True), dict(tokens=None, prefetch=True),
                dict(paired=True), dict(paired=True, state_dtype="bf16", tokens=2),
                dict(paired=True, state_dtype="bf16", vsplit=8), dict(split_prep=True), dict(tokens=5, split_prep=True),
                dict(tokens=4, prefetch=True, split_prep=True), dict(tokens=None, split_prep=True),
                dict(tokens=4, cu_seqlens="int32", split_prep=True), dict(tokens=4, verify=True, cu_seqlens="int32"),
                dict(tokens=4, state_layout="kv", state_dtype="bf16", split_prep=True)):
        with pytest.raises(ValueError):
            DecodeVariant(**bad)
    DecodeVariant(tokens=None, cu_seqlens="int64")


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
        V(tokens=4, verify=True, vsplit=4, prefetch=True),
        V(state_dtype="bf16", vsplit=2, paired=True),
        V(gate="none", per_head_gate=True, state_dtype="bf16", grouped=True, vsplit=4, paired=True),
        V(state_dtype="bf16", tokens=4, verify=True, vsplit=4),
        V(gate="softplus", per_head_gate=True, state_dtype="bf16", tokens=2, grouped=True, vsplit=8),
        V(state_dtype="bf16", tokens=4, verify=True, vsplit=4, split_prep=True),
        V(tokens=4, verify=True, vsplit=4, split_prep=True),
        V(gate="none", per_head_gate=True, state_layout="kv", tokens=3, grouped=True, vsplit=2, split_prep=True),
    ]


def _prefetch_matrix():
    """The unrolled variants :meth:`DecodeVariant.choose_prefetch` loads ahead, at their most registers (the
    per-channel safe gate, l2norm, β sigmoid): T = 2 to 4, decode and verify, the V-first pools and K-first fp32."""
    from cute_kda.kernels.decode import DecodeVariant as V

    return [V(tokens=t, verify=verify, state_dtype=dtype, state_layout=layout, vsplit=4, prefetch=True)
            for t in (2, 3, 4) for verify in (False, True) for dtype, layout in (("fp32", "vk"), ("bf16", "vk"),
                                                                                   ("fp32", "kv"))
            if V.choose_prefetch(t, layout, dtype) and (t == 4 or (verify and layout == "vk"))]


def _loop_matrix():
    """The runtime token loop (``tokens`` None): fixed length over 8, packed with either offset dtype, decode and
    verify, both layouts and pool dtypes (the K-first bf16 verify holds the most registers)."""
    from cute_kda.kernels.decode import DecodeVariant as V

    return [
        V(tokens=None, vsplit=4),
        V(tokens=None, gate="softplus", state_dtype="bf16", verify=True, grouped=True, vsplit=2),
        V(tokens=None, cu_seqlens="int32", state_dtype="bf16", verify=True, grouped=True, vsplit=2),
        V(tokens=None, cu_seqlens="int32", state_dtype="bf16", vsplit=4),  # an engine's packed decode batch
        V(tokens=None, cu_seqlens="int64", gate="softplus", per_head_gate=True, state_dtype="bf16",
          state_layout="kv"),
        V(tokens=None, cu_seqlens="int32", gate="none", state_layout="kv", verify=True, qk_l2norm=False,
          beta_logits=False, vsplit=8),
        V(tokens=None, cu_seqlens="int64", state_dtype="bf16", state_layout="kv", verify=True, vsplit=4),
    ]


def _paired_loop_matrix():
    """The runtime loop's decode on the paired map (V-first bf16 pools, perf-log D8): packed on int32 offsets and a
    fixed T over 8, the safe, softplus and per-head gates, grouped value heads, V-split 2 and 4, the in-kernel
    l2norm and β sigmoid off once."""
    from cute_kda.kernels.decode import DecodeVariant as V

    return [
        V(tokens=None, cu_seqlens="int32", state_dtype="bf16", vsplit=2, paired=True),
        V(tokens=None, cu_seqlens="int32", gate="softplus", state_dtype="bf16", grouped=True, vsplit=2, paired=True),
        V(tokens=None, cu_seqlens="int32", gate="none", per_head_gate=True, state_dtype="bf16", grouped=True, vsplit=4,
          paired=True),
        V(tokens=None, state_dtype="bf16", qk_l2norm=False, beta_logits=False, vsplit=2, paired=True),
    ]


@pytest.mark.parametrize("variant", _paired_loop_matrix(), ids=lambda v: _variant_id(v))
def test_paired_loop_prefetches_the_second_block(variant):
    """The paired runtime loop's PTX: the second block's lines prefetched into L2 before the first warp barrier;
    each of its two paths (one token; a longer sequence) stores both blocks' state vectors once, plus the padding
    row's zero outputs; at most 168 registers (6 CTAs of 64 threads an SM), no spills."""
    from cute_kda.compile_report import compile_with_report
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.ops import decode as ops
    from cute_kda.ops._cache import TVM_FFI_OPTION

    _, report = compile_with_report(DecodeKernel(variant), *ops.compile_arguments(variant), options=TVM_FFI_OPTION)
    per_block = len(variant.thread_map.block_vectors(0))
    ptx = report.ptx
    assert report.count("prefetch.global.L2") == per_block
    assert ptx.rindex("prefetch.global.L2") < ptx.index("bar.warp.sync")
    assert report.count("st.global.v4.b32") == 2 * variant.thread_map.halves * per_block + 1
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].registers <= 168
    print(f"{variant}: {report.kernels[0].registers} registers")


def test_packed_verify_takes_the_split_schedule_behind_its_switch(monkeypatch):
    """``variant_of`` for a packed verify (perf-log D9): with ``SPLIT_PREP_PACKED`` on (the default), S + 1 of 2-4
    takes the ``split_prep`` schedule of S + 1 tokens (not on a K-first bf16 state, which split_prep excludes), wider
    rows and packed decodes the runtime loop; off, the runtime loop."""
    from cute_kda.ops import decode as ops

    def variant(width, layout="vk", dtype=torch.bfloat16, verify=True):
        return ops.variant_of("safe", False, dtype, layout, 64, verify, True, True, False, 4, torch.int32,
                              width=width)

    assert ops.SPLIT_PREP_PACKED  # on by default since the H200's A/B (perf-log D9)
    monkeypatch.setattr(ops, "SPLIT_PREP_PACKED", False)
    assert variant(4).tokens is None and not variant(4).split_prep
    monkeypatch.setattr(ops, "SPLIT_PREP_PACKED", True)
    for width in (2, 3, 4):
        chosen = variant(width)
        assert (chosen.tokens, chosen.split_prep, chosen.cu_seqlens, chosen.prefetch) == (width, True, "int32", False)
    assert variant(4, dtype=torch.float32).split_prep and variant(4, "kv", torch.float32).split_prep
    for other in (variant(5), variant(13), variant(1), variant(4, "kv"), variant(4, verify=False)):
        assert other.tokens is None and not other.split_prep


def test_loop_matrix_covers_offsets_and_modes():
    matrix = _loop_matrix()
    assert {v.bounded_loop for v in matrix} == {False, True}
    assert {v.cu_seqlens for v in matrix} == {None, "int32", "int64"}
    assert {(v.cu_seqlens is None, v.verify) for v in matrix} == {(a, b) for a in (False, True) for b in (False, True)}
    assert {(v.state_layout, v.state_dtype) for v in matrix} == {(a, b) for a in ("vk", "kv") for b in DTYPES}


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


def test_choose_prefetch():
    from cute_kda.kernels.decode import DecodeVariant

    assert [t for t in (None, 1, 2, 3, 4, 5, 8) if DecodeVariant.choose_prefetch(t, "vk", "fp32")] == [2, 3, 4]
    assert DecodeVariant.choose_prefetch(4, "vk", "bf16") and DecodeVariant.choose_prefetch(4, "kv", "fp32")
    assert not DecodeVariant.choose_prefetch(4, "kv", "bf16")  # 255 registers without it


@pytest.mark.parametrize("variant", _prefetch_matrix(), ids=lambda v: _variant_id(v))
def test_prefetch_variants_load_every_token_before_the_math(variant):
    """Every token's inputs (and a verify's slot ids) are loaded before the first token's math: no global load
    after the first shuffle of the dot products; no spills at up to 255 registers."""
    import re

    from cute_kda.compile_report import compile_with_report
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.ops import decode as ops
    from cute_kda.ops._cache import TVM_FFI_OPTION

    _, report = compile_with_report(DecodeKernel(variant), *ops.compile_arguments(variant), options=TVM_FFI_OPTION)
    first_math = report.ptx.index("shfl.sync")
    assert not re.search(r"ld\.global", report.ptx[first_math:])
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    print(f"{variant}: {report.kernels[0].registers} registers")


@pytest.mark.parametrize("variant", [v for v in _compile_matrix() if v.paired], ids=lambda v: _variant_id(v))
def test_paired_prefetches_the_second_block_beside_the_first(variant):
    """The PTX of a paired variant: the second block's lines prefetched into L2 and the first block's vectors loaded
    together, before a warp barrier (ptxas moves no memory operation across it); the first block's state stored
    before the second block's loads, which follow a warp barrier; at most 168 registers (6 CTAs of 64 threads an
    SM), no spills."""
    from cute_kda.compile_report import compile_with_report
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.ops import decode as ops
    from cute_kda.ops._cache import TVM_FFI_OPTION

    _, report = compile_with_report(DecodeKernel(variant), *ops.compile_arguments(variant), options=TVM_FFI_OPTION)
    tmap = variant.thread_map
    per_block = len(tmap.block_vectors(0))
    lines = [line.split()[0] for line in report.ptx.splitlines() if line.strip()
             and line.split()[0].startswith(("prefetch.", "ld.global.v4.b32", "st.global.v4.b32", "bar.warp.sync"))]
    first = lines.index("prefetch.global.L2")
    state = lines[first:lines.index("st.global.v4.b32", first) + 2 * per_block + 2]
    expected = (["prefetch.global.L2"] * per_block + ["ld.global.v4.b32"] * per_block + ["bar.warp.sync"]
                + ["st.global.v4.b32"] * per_block + ["bar.warp.sync"] + ["ld.global.v4.b32"] * per_block)
    assert state[:len(expected)] == expected, state
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].registers <= 168
    print(f"{variant}: {report.kernels[0].registers} registers")


def test_choose_split_prep():
    from cute_kda.kernels.decode import DecodeVariant

    assert [t for t in (None, 1, 2, 3, 4, 5, 8) if DecodeVariant.choose_split_prep(t, "vk", "bf16")] == [2, 3, 4]
    assert DecodeVariant.choose_split_prep(4, "kv", "fp32") and DecodeVariant.choose_split_prep(4, "vk", "fp32")
    assert not DecodeVariant.choose_split_prep(4, "kv", "bf16")  # spills at the 168-register cap


def _packed_split_matrix():
    """Packed verifies on the ``split_prep`` schedule of S + 1 tokens (perf-log D9): both offset dtypes, both pool
    dtypes and layouts it takes, the three gates, grouped value heads, S + 1 of 2 and 4."""
    from cute_kda.kernels.decode import DecodeVariant as V

    return [
        V(tokens=4, verify=True, cu_seqlens="int32", state_dtype="bf16", vsplit=4, split_prep=True),
        V(tokens=4, verify=True, cu_seqlens="int64", gate="softplus", state_dtype="bf16", grouped=True, vsplit=4,
          split_prep=True),
        V(tokens=2, verify=True, cu_seqlens="int32", gate="none", per_head_gate=True, state_dtype="bf16", vsplit=4,
          split_prep=True),
        V(tokens=4, verify=True, cu_seqlens="int32", state_layout="kv", vsplit=4, split_prep=True),
    ]


@pytest.mark.parametrize("variant", [v for v in _compile_matrix() if v.split_prep] + _packed_split_matrix(),
                         ids=lambda v: _variant_id(v))
def test_split_prep_prepares_each_token_once(variant):
    """The PTX of a ``split_prep`` variant: one token's preparation a thread (the gate's sigmoid and 2^x once a
    channel, β's sigmoid once, one l2norm pair), every token's q̂, k̂, decay (one a per-head gate) and β taken by
    indexed shuffles from the group that prepared it; every input loaded before the first shuffle (as
    ``prefetch``); at most 168 registers (6 CTAs of 64 threads an SM, D6), no spills. A packed one (D9) the same,
    its tokens past a sequence's length run and not stored."""
    import re

    from cute_kda.compile_report import compile_with_report
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.layouts.decode import CHANNELS
    from cute_kda.ops import decode as ops
    from cute_kda.ops._cache import TVM_FFI_OPTION

    _, report = compile_with_report(DecodeKernel(variant), *ops.compile_arguments(variant), options=TVM_FFI_OPTION)
    ptx = report.ptx
    decays = 1 if variant.per_head_gate else CHANNELS
    assert report.count("shfl.sync.idx") == variant.tokens * (2 * CHANNELS + decays + 1)
    gate_sigmoids = decays if variant.gate == "safe" else 0
    assert report.count("tanh.approx") == gate_sigmoids + variant.beta_logits
    l2norms = 2 if variant.qk_l2norm else 0  # q and k, a butterfly each
    assert report.count("shfl.sync.bfly") == 3 * (l2norms + 2 * variant.thread_map.rows * variant.tokens)
    assert not re.search(r"ld\.global", ptx[ptx.index("shfl.sync"):])
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].registers <= 168
    print(f"{variant}: {report.kernels[0].registers} registers")


def _scalar_loads(variant) -> int:
    """Non-vector global loads the kernel may issue: slot ids (and accepted counts), the two offsets of a packed
    sequence, β, A_log and a per-head gate with its dt_bias; everything else moves in vectors. The runtime loop
    loads a token's inputs at two sites (the first token, the next one inside the loop)."""
    t = variant.tokens or 2
    indices = 2 + (variant.tokens or 1) if variant.verify else 1  # prefetch: T ids, the count, one id past T
    offsets = 0 if variant.cu_seqlens is None else 2
    constants = variant.gate != "none"
    return indices + offsets + t + constants + variant.per_head_gate * (t + constants)


def _variant_id(v) -> str:
    return (f"{v.gate}{'-head' if v.per_head_gate else ''}-{v.state_dtype}-{v.state_layout}-T{v.tokens or 'n'}"
            f"{'-verify' if v.verify else ''}{'' if v.qk_l2norm else '-nol2'}{'' if v.beta_logits else '-nosig'}"
            f"{'-gva' if v.grouped else ''}-vs{v.vsplit}{'' if v.cu_seqlens is None else '-' + v.cu_seqlens}"
            f"{'-prefetch' if v.prefetch else ''}{'-paired' if v.paired else ''}"
            f"{'-splitprep' if v.split_prep else ''}")


@pytest.mark.parametrize("variant", _compile_matrix() + _loop_matrix(), ids=_variant_id)
def test_variant_compiles(variant):
    """The launcher's own compile arguments (meta tensors): the state moves in 16-byte vectors only, read once
    and written once per kept state; the token operands in vectors, every word of them read (a paired group's
    second block once took its v from the first block's rows, leaving half of the v vector unread); no local
    memory, no spills."""
    import re

    from cute_kda.compile_report import compile_with_report
    from cute_kda.kernels.decode import DecodeKernel
    from cute_kda.ops import decode as ops
    from cute_kda.ops._cache import TVM_FFI_OPTION

    kernel = DecodeKernel(variant)
    _, report = compile_with_report(kernel, *ops.compile_arguments(variant), options=TVM_FFI_OPTION)
    tmap = variant.thread_map
    vectors = len(tmap.state_vectors())
    tokens = variant.tokens or 1  # the runtime loop's body is one token's code
    writes = tokens if variant.verify else 1
    wide_outputs = 2 * tokens if tmap.rows * 2 == 16 else 0  # o rows of 16 bytes (and the zero rows)
    if variant.paired:
        wide_outputs = 1  # the zero row; each block stores its own 4 outputs (8 bytes) as soon as they are made
    assert report.count("st.global.v4.b32") == vectors * writes + wide_outputs
    assert report.count("ld.global.v4.b32") >= vectors
    scalar_stores = re.findall(r"^\s*(?:@%p\d+\s+)?st\.global\.[bfsu]\d+", report.ptx, re.M)
    assert not scalar_stores  # outputs too are one vector a row group
    scalar_loads = re.findall(r"^\s*(?:@%p\d+\s+)?ld\.global\.(?:nc\.)?[bfsu]\d+", report.ptx, re.M)
    assert len(scalar_loads) <= _scalar_loads(variant), scalar_loads
    assert not unread_vector_words(report.ptx)
    # the dot products and the update: one fma per state element each; the decay one mul.rn
    elements = tmap.rows * 16 * tokens
    assert report.count("fma.rn.f32") >= 3 * elements - 2 * tmap.rows * tokens
    assert report.count("mul.rn.f32") >= elements
    assert report.local_memory_ops == 0
    assert len(report.kernels) == 1 and report.spills == 0 and report.kernels[0].stack_frame == 0
    if variant.bounded_loop:  # 6 CTAs of 64 threads an SM (perf-log D7)
        assert report.kernels[0].registers <= 168
    print(f"{variant}: {report.kernels[0].registers} registers, {tmap.threads} threads")


# ============================================================================ kernel (GPU tier)


def _case(variant, N: int = 5, extra_slots: int = 3, seed: int = 0, device="cuda", tokens: int | None = None) -> dict:
    """Inputs, a random pool and slot ids for ``variant`` (``tokens``: T of a runtime-loop variant): row 1 is
    padding; in a verify, row 3 keeps no state after its last token (−1) and the accepted counts cycle through
    1 .. T."""
    gen = torch.Generator().manual_seed(seed)
    T, HV = variant.tokens or tokens, 4
    H = 2 if variant.grouped else HV
    step = make_step(N, T, H, HV, variant.gate, variant.per_head_gate, qk_l2norm=variant.qk_l2norm,
                     beta_logits=variant.beta_logits, generator=gen)
    params = make_params(HV, variant.gate, variant.per_head_gate, generator=gen)
    listed = N * T if variant.verify else N
    slots = listed + extra_slots
    order = torch.randperm(slots, generator=gen)[:listed].int()
    accepted = None
    if variant.verify:
        indices = order.reshape(N, T)
        indices[1] = -1
        indices[3, T - 1] = -1
        accepted = (torch.arange(N) % T + 1).int()
        accepted[3] = 1
    else:
        indices = order
        indices[1] = -1
    pool = random_pool(slots, HV, DTYPES[variant.state_dtype], generator=gen)
    tensors = {**step, **params, "state_pool": pool, "state_indices": indices, "num_accepted_tokens": accepted}
    return {name: None if t is None else t.to(device) for name, t in tensors.items()}


def _run_kernel(case: dict, variant, out=None) -> torch.Tensor:
    from cute_kda.ops.decode import decode

    return decode(**case, **_kernel_options(variant), out=out, vsplit=variant.vsplit)


def _kernel_options(variant) -> dict:
    return dict(gate=variant.gate, scale=SCALE, lower_bound=-5.0, qk_l2norm=variant.qk_l2norm,
                beta_logits=variant.beta_logits, state_layout=variant.state_layout)


def _run_mirror(case: dict, variant) -> torch.Tensor:
    return mirror_decode(**case, **options(variant.gate, variant.state_layout, qk_l2norm=variant.qk_l2norm,
                                           beta_logits=variant.beta_logits))


def assert_matches_mirror(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32: equal to rounding (the mirror's fma is one double rounding off in ~1 of 2^29 cases); bf16: equal
    but for rare last-bit flips of such cases."""
    if actual.dtype == torch.float32:
        assert rel_rms(actual, expected) <= 1e-6, (what, rel_rms(actual, expected))
        return
    differ = (actual != expected).float().mean().item()
    assert differ <= 1e-2 and rel_rms(actual.float(), expected.float()) <= 2e-3, (what, differ)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _compile_matrix(), ids=_variant_id)
def test_kernel_matches_mirror(monkeypatch, request, variant):
    """Each compiled variant: o and every slot of the pool as the mirror has them (padding row zero, the caller's
    ``out`` filled, unlisted slots untouched in both). The launcher's switches follow the variant's ``paired``,
    and ``split_prep`` (a paired call at any size), and the launched kernel has them."""
    from cute_kda.kernels.decode import DecodeVariant
    from cute_kda.ops import decode as ops

    launched = []
    build = ops.compiled_variant
    monkeypatch.setattr(ops, "compiled_variant", lambda v, index: launched.append(v) or build(v, index))
    monkeypatch.setattr(ops, "PAIRED", variant.paired)
    monkeypatch.setattr(ops, "SPLIT_PREP", variant.split_prep)
    if variant.paired:
        monkeypatch.setattr(DecodeVariant, "choose_paired", classmethod(lambda cls, *a: True))
    ops.launch_plan.cache_clear()
    request.addfinalizer(ops.launch_plan.cache_clear)
    case = _case(variant)
    expected_pool = case["state_pool"].clone()
    expected = _run_mirror({**case, "state_pool": expected_pool}, variant)
    out = torch.full_like(expected, float("nan"))
    got = _run_kernel(case, variant, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert_matches_mirror(got, expected, "o")
    assert_matches_mirror(case["state_pool"], expected_pool, "pool")
    assert [(v.paired, v.split_prep) for v in launched] == [(variant.paired, variant.split_prep)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_padding_rows_and_unlisted_slots_untouched(verify, dtype):
    """A guard pool (a pattern of random bits, NaNs included, one guard slot on each side of the pool): after the
    call every slot not listed, and both guards, keep their bits; padding rows' outputs are zero."""
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(state_dtype=dtype, state_layout="kv" if verify else "vk", tokens=4 if verify else 1,
                            verify=verify, vsplit=2)
    case = _case(variant, N=6, extra_slots=9)
    pool = case["state_pool"]
    guarded = torch.empty(pool.shape[0] + 2, *pool.shape[1:], dtype=pool.dtype, device=pool.device)
    _bits(guarded).copy_(torch.randint(-2**15, 2**15, guarded.shape, device=pool.device, dtype=torch.int32))
    listed = case["state_indices"].flatten()
    listed = listed[listed >= 0].long()
    guarded[1:-1][listed] = pool[listed]  # the listed slots hold real states; the others, the pattern
    before = guarded.clone()
    case["state_pool"] = guarded[1:-1]
    out = _run_kernel(case, variant)
    torch.cuda.synchronize()
    unlisted = torch.ones(pool.shape[0] + 2, dtype=torch.bool, device=pool.device)
    unlisted[listed + 1] = False
    assert torch.equal(_bits(guarded[unlisted]), _bits(before[unlisted]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out.float()).all()


@pytest.mark.gpu
def test_verify_every_accepted_count():
    """T = 4: one row per accepted count 1 .. 4 — the state read is the named slot's, every token's state lands in
    its slot (the mirror's, itself checked against the fp64 recurrence on the CPU)."""
    from cute_kda.kernels.decode import DecodeVariant

    for layout, dtype in (("vk", "fp32"), ("kv", "bf16")):
        variant = DecodeVariant(state_dtype=dtype, state_layout=layout, tokens=4, verify=True, vsplit=4)
        case = _case(variant, N=4, extra_slots=2, seed=5)
        case["state_indices"] = torch.arange(16, dtype=torch.int32, device="cuda").reshape(4, 4)
        case["num_accepted_tokens"] = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device="cuda")
        case["state_pool"] = random_pool(18, 4, DTYPES[dtype], device="cuda")
        expected_pool = case["state_pool"].clone()
        expected = _run_mirror({**case, "state_pool": expected_pool}, variant)
        got = _run_kernel(case, variant)
        torch.cuda.synchronize()
        assert_matches_mirror(got, expected, "o")
        assert_matches_mirror(case["state_pool"], expected_pool, "pool")


@pytest.mark.gpu
def test_verify_with_slot_ids_wider_than_its_tokens():
    """T = 2 on slot ids ``[N, 4]`` (S = 3): every accepted count 1 .. 4, the entering slot past T included (the
    launcher's prefetch variant selects among the ids it loaded and loads the rest)."""
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(tokens=2, verify=True, vsplit=4)
    case = _case(variant, N=4, extra_slots=2, seed=9)
    case["state_indices"] = torch.arange(16, dtype=torch.int32, device="cuda").reshape(4, 4)
    case["num_accepted_tokens"] = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device="cuda")
    case["state_pool"] = random_pool(18, 4, torch.float32, device="cuda")
    expected_pool = case["state_pool"].clone()
    expected = _run_mirror({**case, "state_pool": expected_pool}, variant)
    got = _run_kernel(case, variant)
    torch.cuda.synchronize()
    assert_matches_mirror(got, expected, "o")
    assert_matches_mirror(case["state_pool"], expected_pool, "pool")


@pytest.mark.gpu
@pytest.mark.parametrize("gate,per_head,dtype,layout", [
    ("safe", False, "fp32", "vk"), ("softplus", True, "bf16", "kv"), ("none", False, "fp32", "kv"),
    ("softplus", False, "bf16", "vk"),
])
def test_chain_of_1000_decode_steps_tracks_fp64(gate, per_head, dtype, layout):
    """1000 chained decode steps (GVA, a padding row): o of every step and the final states within 5e-3 rel-RMS
    of the fp64 recurrence on an fp64 pool."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    N, H, HV, slots = 3, 2, 4, 5
    opts = options(gate, layout)
    params = make_params(HV, gate, per_head, device="cuda", generator=gen)
    pool = random_pool(slots, HV, DTYPES[dtype], device="cuda")
    gold_pool = pool.double()
    indices = torch.tensor([3, -1, 0], dtype=torch.int32, device="cuda")
    from cute_kda.ops.decode import decode

    worst_o = 0.0
    for _ in range(1000):
        step = make_step(N, 1, H, HV, gate, per_head, device="cuda", generator=gen)
        o = decode(**step, **params, state_pool=pool, state_indices=indices, **{
            "gate": gate, "scale": SCALE, "lower_bound": -5.0, "state_layout": layout})
        o_gold = gold_decode(**step, **params, state_pool=gold_pool, state_indices=indices, **opts)
        worst_o = max(worst_o, rel_rms(o[[0, 2]], o_gold[[0, 2]]))
    state_error = rel_rms(pool[[3, 0]], gold_pool[[3, 0]])
    assert worst_o <= 5e-3 and state_error <= 5e-3, (worst_o, state_error)
    print(f"{gate} {per_head} {dtype} {layout}: worst o {worst_o:.2e}, state {state_error:.2e}")


@pytest.mark.gpu
def test_vsplits_are_bit_identical():
    """A row's sums do not depend on the band it sits in: every V-split gives the same bits."""
    from cute_kda.kernels.decode import DecodeVariant
    from cute_kda.layouts.decode import DecodeThreadMap

    for layout, dtype in (("vk", "fp32"), ("kv", "bf16")):
        results = []
        for vsplit in DecodeThreadMap.vsplits(layout, dtype):
            variant = DecodeVariant(state_dtype=dtype, state_layout=layout, tokens=2, vsplit=vsplit)
            case = _case(variant, seed=9)
            out = _run_kernel(case, variant)
            results.append((out, case["state_pool"]))
        torch.cuda.synchronize()
        for out, pool in results[1:]:
            assert torch.equal(out, results[0][0]) and torch.equal(_bits(pool), _bits(results[0][1]))


@pytest.mark.gpu
def test_pool_over_two_to_the_31_elements():
    """A bf16 pool of 8200 slots × 16 heads (2.15e9 elements, 4.3 GB): the last slot is read and written at its
    64-bit offset, and nothing else moves."""
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(state_dtype="bf16", vsplit=4)
    slots, HV = 8200, 16
    assert slots * HV * D * D > 2**31
    gen = torch.Generator().manual_seed(2)
    step = {name: t.cuda() for name, t in make_step(2, 1, HV, HV, "safe", False, generator=gen).items()}
    params = {name: t.cuda() for name, t in make_params(HV, "safe", False, generator=gen).items()}
    pool = torch.zeros(slots, HV, D, D, dtype=torch.bfloat16, device="cuda")
    pool[[slots - 1, 7]] = random_pool(2, HV, torch.bfloat16, device="cuda")
    small = pool[[slots - 1, 7]].clone()
    indices = torch.tensor([slots - 1, 7], dtype=torch.int32, device="cuda")
    got = _run_kernel({**step, **params, "state_pool": pool, "state_indices": indices, "num_accepted_tokens": None},
                      variant)
    expected = _run_mirror({**step, **params, "state_pool": small, "num_accepted_tokens": None,
                            "state_indices": torch.tensor([0, 1], dtype=torch.int32, device="cuda")}, variant)
    torch.cuda.synchronize()
    assert_matches_mirror(got, expected, "o")
    assert_matches_mirror(pool[[slots - 1, 7]], small, "pool")
    pool[[slots - 1, 7]] = 0
    assert pool.count_nonzero().item() == 0


@pytest.mark.gpu
def test_steady_decode_loop_replays_in_a_cuda_graph_without_allocating():
    """A serving step captured once: three decode calls (T = 1, the same slots, each step's inputs in its own static
    buffers) and a packed verify, caller ``out``, the pool updated in place. Two replays give the bits of two eager
    rounds on a copy of the pool, and neither the capture nor the replays allocate (torch's allocation count)."""
    from cute_kda.kernels.decode import DecodeVariant
    from cute_kda.ops.decode import decode

    decode_variant = DecodeVariant(vsplit=4)
    steps = [_case(decode_variant, N=4, extra_slots=0, seed=s) for s in range(3)]
    pool = steps[0]["state_pool"]
    for step in steps:
        step["state_indices"] = steps[0]["state_indices"]
    verify = packed_case((2, 0, 4, 1), 4, 4, "safe", False, torch.float32, verify_width=4, device="cuda", seed=6)
    verify_pool = verify.pop("state_pool")
    calls = [({**step, "state_pool": pool}, _kernel_options(decode_variant)) for step in steps]
    calls.append(({**verify, "state_pool": verify_pool}, options("safe", "vk")))
    outs = [torch.empty(*case["v"].shape[:3], D, dtype=torch.bfloat16, device="cuda") for case, _ in calls]

    def serve(pools: dict):
        for (case, opts), out in zip(calls, outs):
            decode(**{**case, "state_pool": pools[id(case["state_pool"])]}, **opts, out=out)

    eager_pools = {id(pool): pool.clone(), id(verify_pool): verify_pool.clone()}
    own_pools = {id(pool): pool, id(verify_pool): verify_pool}
    eager_outs = []
    for _ in range(2):  # the first round also compiles every variant before the capture
        serve(eager_pools)
        eager_outs.append([out.clone() for out in outs])

    def allocations() -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_stats()["allocation.all.allocated"]

    spare_pools = {key: pool.clone() for key, pool in eager_pools.items()}
    before = allocations()
    serve(spare_pools)  # a steady eager round allocates nothing
    assert allocations() == before, "an eager round allocated"
    scratch = torch.zeros(1, device="cuda")
    before = allocations()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        scratch.add_(1)
    torch_own = allocations() - before  # what a capture allocates by itself (2 on the H200 run: its RNG state)
    before = allocations()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        serve(own_pools)
    assert allocations() - before == torch_own, "the capture allocated"
    for expected in eager_outs:
        before = allocations()
        graph.replay()
        assert allocations() == before, "a replay allocated"
        assert all(torch.equal(out, want) for out, want in zip(outs, expected))  # (torch.equal allocates)
    for key, own in own_pools.items():
        assert torch.equal(_bits(own), _bits(eager_pools[key]))


@pytest.mark.gpu
def test_strided_views_give_the_contiguous_result():
    """A pool view with padded slot and head strides and q, k, v split from one fused projection: the same bits as
    contiguous copies."""
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(tokens=2, verify=True, grouped=True, vsplit=4)
    case = _case(variant, seed=8)
    N, T, H, HV = case["q"].shape[0], 2, case["q"].shape[2], case["v"].shape[2]
    fused = torch.empty(N, T, 2 * H + HV + 1, D, dtype=torch.bfloat16, device="cuda")
    views = {"q": fused[:, :, :H], "k": fused[:, :, H:2 * H], "v": fused[:, :, 2 * H:2 * H + HV]}
    for name, view in views.items():
        view.copy_(case[name])
    pool = case["state_pool"]
    padded = torch.zeros(pool.shape[0], HV + 1, D, D, dtype=pool.dtype, device="cuda")[:, 1:]
    padded.copy_(pool)
    strided = {**case, **views, "state_pool": padded}
    assert not any(strided[name].is_contiguous() for name in ("q", "k", "v", "state_pool"))
    expected = _run_kernel(case, variant)
    got = _run_kernel(strided, variant)
    torch.cuda.synchronize()
    assert torch.equal(got, expected) and torch.equal(_bits(padded.contiguous()), _bits(pool))


def _guarded(pool: torch.Tensor, listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(guarded, view): ``pool`` inside one guard slot on each side, every slot not ``listed`` (and the guards) a
    pattern of random bits (NaNs included); ``view`` the pool the kernel gets."""
    guarded = torch.empty(pool.shape[0] + 2, *pool.shape[1:], dtype=pool.dtype, device=pool.device)
    _bits(guarded).copy_(torch.randint(-2**15, 2**15, guarded.shape, device=pool.device, dtype=torch.int32))
    guarded[1:-1][listed] = pool[listed]
    return guarded, guarded[1:-1]


def _packed_variants():
    return [v for v in _loop_matrix() if v.cu_seqlens is not None]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _packed_variants(), ids=_variant_id)
def test_packed_kernel_matches_mirror_and_fp64(variant):
    """Packed sequences of lengths 0, 1, 3, 8, 13 and a padding row of 5 (verify: S + 1 = 13 slots a row, accepted
    counts cycling): o and the written states as the mirror has them and within 5e-3 of the fp64 recurrence; the
    padding row's outputs zero; on a guard pool, every slot not written (the 0-length sequence's, the padding
    row's, the unlisted ones) and both guards keep their bits; every output row written (o poisoned with NaN)."""
    H = 2 if variant.grouped else 4
    offsets = torch.int32 if variant.cu_seqlens == "int32" else torch.int64
    case = packed_case(PACKED_LENGTHS, H, 4, variant.gate, variant.per_head_gate, DTYPES[variant.state_dtype],
                       verify_width=13 if variant.verify else None, offsets_dtype=offsets,
                       qk_l2norm=variant.qk_l2norm, beta_logits=variant.beta_logits, device="cuda", seed=21)
    written, kept = packed_slots(case, PACKED_LENGTHS)
    listed = case["state_indices"].flatten()
    guarded, case["state_pool"] = _guarded(case["state_pool"], listed[listed >= 0].long())
    before = guarded.clone()
    expected_pool = case["state_pool"].clone()
    expected = _run_mirror({**case, "state_pool": expected_pool}, variant)
    gold_pool = case["state_pool"].double()
    o_gold = gold_decode(**{**case, "state_pool": gold_pool}, **options(
        variant.gate, variant.state_layout, qk_l2norm=variant.qk_l2norm, beta_logits=variant.beta_logits))
    out = torch.full_like(expected, float("nan"))
    got = _run_kernel(case, variant, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    padding = slice(sum(PACKED_LENGTHS[:-1]), None)
    assert torch.equal(got[:, padding], torch.zeros_like(got[:, padding]))
    assert_matches_mirror(got, expected, "o")
    assert_matches_mirror(case["state_pool"][written], expected_pool[written], "pool")
    kept_rows = torch.tensor([0] + [s + 1 for s in kept] + [guarded.shape[0] - 1], device="cuda")
    assert torch.equal(_bits(guarded[kept_rows]), _bits(before[kept_rows]))
    live = slice(0, padding.start)
    o_error = rel_rms(got[:, live], o_gold[:, live])
    state_error = rel_rms(case["state_pool"][written], gold_pool[written])
    assert o_error <= 5e-3 and state_error <= 5e-3, (o_error, state_error)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _paired_loop_matrix(), ids=_variant_id)
def test_paired_loop_has_the_loops_bits(monkeypatch, request, variant):
    """The paired runtime loop (``PAIRED_LOOP``, perf-log D8) against the plain one on packed sequences of lengths 0,
    1, 3, 8, 13 and a padding row (a fixed-length variant: five rows of 13 tokens, one padding): the same
    arithmetic a row, so the same bits in o and in every slot of a guard pool; the launcher picked the paired
    variant."""
    from cute_kda.kernels.decode import DecodeVariant

    monkeypatch.setattr(DecodeVariant, "choose_paired", classmethod(lambda cls, *a, **k: True))
    if variant.cu_seqlens is None:
        case = _case(variant, N=5, seed=23, tokens=13)
    else:
        case = packed_case(PACKED_LENGTHS, 2 if variant.grouped else 4, 4, variant.gate, variant.per_head_gate,
                           DTYPES[variant.state_dtype], offsets_dtype=torch.int32, qk_l2norm=variant.qk_l2norm,
                           beta_logits=variant.beta_logits, device="cuda", seed=23)
    settings = [dict(PAIRED_LOOP=False), dict(PAIRED_LOOP=True)]
    launched, ((loop_out, loop_pool), (out, pool)) = _run_under_switches(monkeypatch, request, variant, case, settings,
                                                                         guard=True)
    assert [v.paired for v in launched] == [False, True]
    assert torch.equal(out, loop_out) and torch.equal(_bits(pool), _bits(loop_pool))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", _packed_split_matrix(), ids=_variant_id)
def test_packed_split_verify_has_the_loops_bits(monkeypatch, request, variant):
    """A packed verify on the ``split_prep`` schedule (``SPLIT_PREP_PACKED``, perf-log D9) against the runtime loop
    on sequences of lengths 0, 1, 3, S + 1, 2 and a padding row (S + 1 slots a row, accepted counts cycling): the
    same arithmetic a token, so the same bits in o and in every slot of a guard pool; the launcher picked the split
    variant; o and the written states within 5e-3 of the fp64 recurrence."""
    width = variant.tokens
    lengths = (0, 1, min(3, width), width, 2, width)  # the last a padding row
    H = 2 if variant.grouped else 4
    offsets = torch.int32 if variant.cu_seqlens == "int32" else torch.int64
    case = packed_case(lengths, H, 4, variant.gate, variant.per_head_gate, DTYPES[variant.state_dtype],
                       verify_width=width, offsets_dtype=offsets, device="cuda", seed=29)
    written, _ = packed_slots(case, lengths)
    gold_pool = case["state_pool"].double()
    o_gold = gold_decode(**{**case, "state_pool": gold_pool}, **options(variant.gate, variant.state_layout))
    settings = [dict(SPLIT_PREP_PACKED=False), dict(SPLIT_PREP_PACKED=True)]
    launched, ((loop_out, loop_pool), (out, pool)) = _run_under_switches(monkeypatch, request, variant, case, settings,
                                                                         guard=True)
    assert [(v.tokens, v.split_prep) for v in launched] == [(None, False), (width, True)]
    assert torch.equal(out, loop_out) and torch.equal(_bits(pool), _bits(loop_pool))
    live = slice(0, sum(lengths[:-1]))
    assert rel_rms(out[:, live], o_gold[:, live]) <= 5e-3
    assert rel_rms(pool[1:-1][written], gold_pool[written]) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_fixed_length_over_eight_tokens(verify):
    """T = 13 (decode) and 11 (verify, every accepted count among the rows) at a fixed length: the runtime loop as
    the mirror has it, within 5e-3 of the fp64 recurrence, the padding row zero."""
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(tokens=None, verify=verify, state_dtype="bf16" if verify else "fp32", grouped=verify,
                            vsplit=2)
    T = 11 if verify else 13
    case = _case(variant, N=5, seed=13, tokens=T)
    gold_pool = case["state_pool"].double()
    expected_pool = case["state_pool"].clone()
    expected = _run_mirror({**case, "state_pool": expected_pool}, variant)
    o_gold = gold_decode(**{**case, "state_pool": gold_pool}, **options(variant.gate, variant.state_layout))
    got = _run_kernel(case, variant)
    torch.cuda.synchronize()
    assert got.shape[1] == T and torch.equal(got[1], torch.zeros_like(got[1]))
    assert_matches_mirror(got, expected, "o")
    assert_matches_mirror(case["state_pool"], expected_pool, "pool")
    live = [0, 2, 3, 4]
    assert rel_rms(got[live], o_gold[live]) <= 5e-3
    assert rel_rms(case["state_pool"], gold_pool) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_runtime_loop_has_the_unrolled_bits(verify):
    """Five sequences of 4 tokens (a padding row), packed (the runtime loop) and as a fixed T = 4 call (unrolled):
    the same arithmetic, so the same bits in o and in the pool."""
    from cute_kda.kernels.decode import DecodeVariant

    unrolled = DecodeVariant(tokens=4, verify=verify, state_layout="kv", vsplit=4)
    case = _case(unrolled, N=5, seed=17)
    packed = {**case, "state_pool": case["state_pool"].clone(),
              "cu_seqlens": torch.arange(0, 21, 4, dtype=torch.int32, device="cuda")}
    for name in ("q", "k", "v", "g", "beta"):
        packed[name] = case[name].reshape(1, 20, *case[name].shape[2:])
    fixed = _run_kernel(case, unrolled)
    looped = _run_kernel(packed, unrolled)  # the launcher picks the loop from cu_seqlens
    torch.cuda.synchronize()
    assert torch.equal(looped.reshape(fixed.shape), fixed)
    assert torch.equal(_bits(packed["state_pool"]), _bits(case["state_pool"]))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype", [("vk", "fp32"), ("vk", "bf16"), ("kv", "fp32")])
@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_prefetch_has_the_same_bits(monkeypatch, request, verify, layout, dtype):
    """T = 4 with every token loaded ahead (the launcher's choice) and without: the same arithmetic, so the same
    bits in o and in the pool."""
    from cute_kda.kernels.decode import DecodeVariant
    from cute_kda.ops import decode as ops

    variant = DecodeVariant(tokens=4, verify=verify, state_layout=layout, state_dtype=dtype, vsplit=4)
    case = _case(variant, N=5, seed=23)
    plain = {**case, "state_pool": case["state_pool"].clone()}
    ahead = _run_kernel(case, variant)
    ops.launch_plan.cache_clear()
    request.addfinalizer(ops.launch_plan.cache_clear)
    monkeypatch.setattr(DecodeVariant, "choose_prefetch", staticmethod(lambda *a: False))
    without = _run_kernel(plain, variant)
    torch.cuda.synchronize()
    assert torch.equal(ahead, without)
    assert torch.equal(_bits(case["state_pool"]), _bits(plain["state_pool"]))


@pytest.mark.gpu
@pytest.mark.parametrize("gate,per_head", [("safe", False), ("none", True)])
def test_paired_has_the_same_bits(monkeypatch, request, gate, per_head):
    """One-token bf16 decode (a padding row among the sequences) on the paired variant and on the plain one: the
    same arithmetic a row, so the same bits in o and in the pool."""
    from cute_kda.kernels.decode import DecodeVariant
    from cute_kda.ops import decode as ops

    variant = DecodeVariant(gate=gate, per_head_gate=per_head, state_dtype="bf16", grouped=per_head, vsplit=2)
    case = _case(variant, N=7, seed=29)
    plain = {**case, "state_pool": case["state_pool"].clone()}
    compiled = []
    build = ops.compiled_variant
    monkeypatch.setattr(ops, "compiled_variant", lambda v, index: compiled.append(v) or build(v, index))
    ops.launch_plan.cache_clear()
    request.addfinalizer(ops.launch_plan.cache_clear)
    monkeypatch.setattr(ops, "PAIRED", True)
    monkeypatch.setattr(DecodeVariant, "choose_paired", classmethod(lambda cls, *a: True))
    paired = _run_kernel(case, variant)
    ops.launch_plan.cache_clear()
    monkeypatch.setattr(ops, "PAIRED", False)
    without = _run_kernel(plain, variant)
    torch.cuda.synchronize()
    assert [v.paired for v in compiled] == [True, False]
    assert torch.equal(paired, without) and torch.equal(paired[1], torch.zeros_like(paired[1]))
    assert torch.equal(_bits(case["state_pool"]), _bits(plain["state_pool"]))


def _run_under_switches(monkeypatch, request, variant, case, settings: list[dict], guard: bool = False
                        ) -> tuple[list, list]:
    """``case`` run once under each of ``settings`` (the launcher's module switches), each run on its own copy of the
    pool; with ``guard``, a copy of one guard pool (:func:`_guarded`: the unlisted slots and both guards random bits)
    whose inner view the kernel gets. Returns the variants the launcher compiled and each run's (o, pool), the pool
    with its guards where ``guard``."""
    from cute_kda.ops import decode as ops

    compiled = []
    build = ops.compiled_variant
    monkeypatch.setattr(ops, "compiled_variant", lambda v, index: compiled.append(v) or build(v, index))
    request.addfinalizer(ops.launch_plan.cache_clear)
    pool = case["state_pool"]
    if guard:
        listed = case["state_indices"].flatten()
        pool, _ = _guarded(pool, listed[listed >= 0].long())
    results = []
    for switches in settings:
        ops.launch_plan.cache_clear()
        for name, value in switches.items():
            monkeypatch.setattr(ops, name, value)
        copy = pool.clone()
        results.append((_run_kernel({**case, "state_pool": copy[1:-1] if guard else copy}, variant), copy))
    torch.cuda.synchronize()
    return compiled, results


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype", [("vk", "fp32"), ("vk", "bf16"), ("kv", "fp32")])
@pytest.mark.parametrize("tokens,verify", [(4, True), (3, False)], ids=["verify4", "decode3"])
def test_split_prep_has_the_same_bits(monkeypatch, request, tokens, verify, layout, dtype):
    """Tokens prepared once a warp and shared by shuffles (``split_prep``) and once a group (``prefetch``): the same
    arithmetic a value, so the same bits in o and in the pool (a padding row and a −1 slot among them)."""
    from cute_kda.kernels.decode import DecodeVariant

    variant = DecodeVariant(tokens=tokens, verify=verify, state_layout=layout, state_dtype=dtype, vsplit=4)
    settings = [dict(SPLIT_PREP=True), dict(SPLIT_PREP=False)]
    compiled, results = _run_under_switches(monkeypatch, request, variant, _case(variant, N=5, seed=37), settings)
    assert [(v.split_prep, v.prefetch) for v in compiled] == [(True, False), (False, True)]
    (split_out, split_pool), (out, pool) = results
    assert torch.equal(split_out, out) and torch.equal(_bits(split_pool), _bits(pool))


def test_launcher_picks_paired_where_it_pays(monkeypatch, request):
    """With :data:`~cute_kda.ops.decode.PAIRED` on, a one-token bf16 V-first decode whose grid fills the SMs twice
    takes the paired variant at its own V-split; a verify, an fp32 pool, a small grid do not; off, none does."""
    from cute_kda.ops import decode as ops

    calls = []
    ops.launch_plan.cache_clear()
    request.addfinalizer(ops.launch_plan.cache_clear)
    monkeypatch.setattr(ops, "compiled_variant", lambda variant, index: (lambda *a: calls.append(variant)))
    monkeypatch.setattr(ops, "device_index", lambda device: 0)
    monkeypatch.setattr(ops, "check_supported", lambda device: None)
    monkeypatch.setattr(ops, "sm_count", lambda index: 2)  # paired from N·HV ≥ 12
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setitem(ops._CUSTREAMS, 7, "stream")
    monkeypatch.setattr(ops, "on_device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(ops, "PAIRED", True)

    def call(N, dtype=torch.bfloat16, T=1, verify=False):
        step = make_step(N, T, 4, 4, "safe", False)
        indices = torch.arange(N * T if verify else N, dtype=torch.int32)
        ops.decode(**step, **make_params(4, "safe", False), state_pool=random_pool(N * T, 4, dtype),
                   state_indices=indices.reshape(N, T) if verify else indices,
                   num_accepted_tokens=torch.ones(N, dtype=torch.int32) if verify else None, gate="safe", scale=0.1)
        return calls[-1]

    assert (call(3).paired, call(3).vsplit) == (True, 2)  # its own split: 64 threads of 8 rows
    assert not call(2).paired and not call(3, torch.float32).paired and not call(3, T=4, verify=True).paired
    ops.launch_plan.cache_clear()
    monkeypatch.setattr(ops, "PAIRED", False)
    assert not call(3).paired


def test_launcher_picks_the_variant_and_passes_the_kernel_arguments(monkeypatch, request):
    """The launcher's host path on CPU tensors (the compiled function recorded, not run): the variant follows
    the tensors (per-head gate from g's rank, verify from the slot ids' rank, GVA from H < HV), the scalars are
    fp32-rounded, ``out`` is allocated once when not given, and the arguments are the kernel's."""
    from cute_kda.numerics import f32, gate_constant
    from cute_kda.ops import decode as ops

    calls = []
    ops.launch_plan.cache_clear()  # the plans keep their compiled kernel: none made with the stand-in may outlive it
    request.addfinalizer(ops.launch_plan.cache_clear)
    monkeypatch.setattr(ops, "compiled_variant", lambda variant, index: (lambda *a: calls.append((variant, a))))
    monkeypatch.setattr(ops, "device_index", lambda device: 0)
    monkeypatch.setattr(ops, "check_supported", lambda device: None)  # no CUDA device here
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setitem(ops._CUSTREAMS, 7, "stream")
    monkeypatch.setattr(ops, "on_device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(ops, "auto_vsplit", lambda *a: 2)
    monkeypatch.setattr(ops, "sm_count", lambda index: 132)  # H200's count, for the paired rule
    step = make_step(3, 4, 2, 4, "softplus", True)
    params = make_params(4, "softplus", True)
    pool = random_pool(12, 4, torch.bfloat16)
    indices = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    accepted = torch.ones(3, dtype=torch.int32)
    out = ops.decode(**step, **params, state_pool=pool, state_indices=indices, num_accepted_tokens=accepted,
                     gate="softplus", scale=0.1, lower_bound=-3.0, state_layout="kv")
    (variant, args), = calls
    assert variant == ops.variant_of("softplus", True, torch.bfloat16, "kv", 4, True, True, True, True, 2)
    assert (variant.per_head_gate, variant.verify, variant.grouped, variant.tokens, variant.vsplit) == (
        True, True, True, 4, 2)
    inputs, pool_arg, indices_arg, accepted_arg, offsets_arg, out_arg, scale, c_gate, stream = args
    assert inputs.q is step["q"] and inputs.g is step["g"] and inputs.dt_bias is params["dt_bias"]
    assert pool_arg is pool and indices_arg is indices and accepted_arg is accepted and out_arg is out
    assert offsets_arg is None
    assert out.shape == (3, 4, 4, D) and out.dtype == torch.bfloat16
    assert (scale, c_gate, stream) == (f32(0.1), gate_constant(-3.0), "stream")

    # over 8 tokens: the runtime loop; packed: the loop with the offsets' dtype, N from the slot ids, o [1, T, ...]
    long_step = make_step(2, 11, 4, 4, "safe", False)
    ops.decode(**long_step, **make_params(4, "safe", False), state_pool=pool.float(),
               state_indices=torch.tensor([0, 1], dtype=torch.int32), gate="safe", scale=0.1)
    assert calls[-1][0] == ops.variant_of("safe", False, torch.float32, "vk", 11, False, True, True, False, 2)
    assert calls[-1][0].tokens is None and calls[-1][0].cu_seqlens is None
    packed = make_step(1, 7, 4, 4, "safe", False)
    offsets = torch.tensor([0, 3, 3, 7], dtype=torch.int64)
    out = ops.decode(**packed, **make_params(4, "safe", False), state_pool=pool.float(),
                     state_indices=torch.tensor([0, 1, 2], dtype=torch.int32), gate="safe", scale=0.1,
                     cu_seqlens=offsets)
    variant, args = calls[-1]
    assert (variant.tokens, variant.cu_seqlens, variant.verify) == (None, "int64", False)
    assert args[4] is offsets and out.shape == (1, 7, 4, D)


def test_launcher_checks_the_device_before_any_compile(monkeypatch, request):
    """A device that is not sm_90 is refused by name at the first call of a configuration, before a compile."""
    import cute_kda.device
    from cute_kda.ops import decode as ops

    ops.launch_plan.cache_clear()
    request.addfinalizer(ops.launch_plan.cache_clear)
    monkeypatch.setattr(cute_kda.device, "capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100")
    monkeypatch.setattr(ops, "device_index", lambda device: 0)
    monkeypatch.setattr(ops, "compiled_variant", lambda *a: pytest.fail("compiled before the device check"))
    step = make_step(2, 1, 4, 4, "safe", False)
    with pytest.raises(RuntimeError, match=r"built for sm_90a .*cuda:0 is sm_80 \(NVIDIA A100\)"):
        ops.decode(**step, **make_params(4, "safe", False), state_pool=random_pool(4, 4, torch.float32),
                   state_indices=torch.tensor([0, 1], dtype=torch.int32), gate="safe", scale=0.1)
