"""A prefill on a state pool (issue 32): K2 reads and writes states by slot id, and stores prefix checkpoints.

CPU tier: the pool variants of K2 compile for sm_90a without spills and add to their plain variant only the slot
look-ups and the checkpoint stores; the API refuses malformed pool arguments naming them (slot values only under
``CUTE_KDA_DEBUG_CHECKS=1``); the resolved call carries the pool. GPU tier: the kernel path is bit-identical to
gather → ``kda_forward`` → scatter (:mod:`cute_kda.reference.pool`), padding rows and unlisted slots untouched, each
prefix checkpoint equal to the final state of the prefill stopped there; ``chunk_kda`` takes a pool.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import cute_kda
from cute_kda import call as call_module
from cute_kda.reference.pool import gather_states, prefill_on_pool

D = 128
VSPLITS = (1, 2, 4)


# ============================================================================ CPU: compiles


def _compile_args(vsplit, pool_dtype, varlen, prefix):
    from cute_kda.ops import recurrence as k2
    from cute_kda.ops._cache import to_cute_tensor
    from cute_kda.workspace import WorkspaceSpec, workspace_views

    heads, num_seqs = 2, 3
    batch, steps = (1, 80) if varlen else (num_seqs, 24)
    v = torch.zeros(batch, steps, heads, D, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=heads, tiles=8)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    pool = torch.zeros(5, heads, D, D, dtype=pool_dtype)
    return k2.launch_arguments(
        v, ws, torch.zeros_like(v), cu_seqlens=torch.tensor([0, 20, 20, 80]) if varlen else None,
        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None, initial_state=pool,
        final_state=pool, state_indices=torch.zeros(num_seqs, dtype=torch.int32),
        checkpoint_indices=torch.zeros(num_seqs, 2, dtype=torch.int32) if prefix else None, tensor=to_cute_tensor,
    )


_COMPILED: dict = {}


def _compiled(vsplit, dtype, varlen, prefix=0, pool=True):
    key = (vsplit, dtype, varlen, prefix, pool)
    if key not in _COMPILED:
        from cute_kda.compile_report import compile_with_report
        from cute_kda.dsl import cute
        from cute_kda.kernels.fwd_recurrence import FwdRecurrence
        from cute_kda.ops._cache import dsl_type

        state = dsl_type(dtype)
        kernel = FwdRecurrence(vsplit=vsplit, initial_state=state, final_state=state, varlen=varlen, state_pool=pool,
                               prefix_checkpoint_every=prefix)
        arguments = _compile_args(vsplit, dtype, varlen, prefix)
        if not pool:  # the plain variant of the same dtypes: no slot ids (then the cross blocks, None here)
            arguments = arguments[:-4] + (None, None) + arguments[-2:]
        _, report = compile_with_report(kernel, *arguments, cute.runtime.make_fake_stream())
        _COMPILED[key] = (kernel, report)
    return _COMPILED[key]


# every (vsplit, pool dtype) with and without checkpoints, varlen alternating: 12 compiles of ~2 s
POOL_VARIANTS = [(vsplit, dtype, (i + j) % 2 == 1, prefix) for i, (vsplit, dtype) in
                 enumerate(itertools.product(VSPLITS, (torch.bfloat16, torch.float32)))
                 for j, prefix in enumerate((0, 64))]


@pytest.mark.parametrize("variant", POOL_VARIANTS, ids=lambda v: "vs{}-{}-{}-prefix{}".format(
    v[0], str(v[1]).replace("torch.", ""), "varlen" if v[2] else "fixed", v[3]))
def test_pool_variant_compiles(variant):
    """No spills or local memory; the products, the TMA traffic and the state rounding are the plain variant's; a
    checkpoint variant adds one store per fp32 state element of the lane (in the pool's width) and nothing else."""
    vsplit, dtype, varlen, prefix = variant
    kernel, report = _compiled(*variant)
    _, plain = _compiled(vsplit, dtype, varlen, pool=False)
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == plain.launch_smem
    for mnemonic in ("mma.sync", "movmatrix", "ldmatrix", "stmatrix", "mul.rn.f32", "cp.async.bulk.tensor",
                     "cvt.rn.bf16x2.f32"):
        assert report.count(mnemonic) == plain.count(mnemonic), mnemonic
    elements = D * kernel.warp_cols // 32  # fp32 state elements per lane
    store = "st.global.b32" if dtype == torch.float32 else "st.global.b16"
    extra = report.count(store) - plain.count(store)
    assert extra == (elements if prefix else 0)
    print(f"{variant}: {report.kernels[0].registers} registers (plain {plain.kernels[0].registers})")


def test_pool_variant_arguments_are_refused_without_a_pool():
    from cute_kda.dsl import cutlass
    from cute_kda.kernels.fwd_recurrence import FwdRecurrence

    fp32 = cutlass.Float32
    with pytest.raises(ValueError, match="state_pool"):
        FwdRecurrence(initial_state=None, final_state=fp32, state_pool=True)
    with pytest.raises(ValueError, match="state_pool"):
        FwdRecurrence(initial_state=fp32, final_state=cutlass.BFloat16, state_pool=True)
    with pytest.raises(ValueError, match="prefix_checkpoint_every"):
        FwdRecurrence(initial_state=fp32, final_state=fp32, prefix_checkpoint_every=64)
    with pytest.raises(ValueError, match="prefix_checkpoint_every"):
        FwdRecurrence(initial_state=fp32, final_state=fp32, state_pool=True, prefix_checkpoint_every=48)


# ============================================================================ CPU: validation and the resolved call


B, T, H = 2, 40, 2


def _inputs(batch=B, seq_len=T, heads=H, device="cpu"):
    bf16 = torch.bfloat16
    return dict(
        q=torch.randn(batch, seq_len, heads, D, dtype=bf16, device=device),
        k=torch.randn(batch, seq_len, heads, D, dtype=bf16, device=device),
        v=torch.randn(batch, seq_len, heads, D, dtype=bf16, device=device),
        g=torch.randn(batch, seq_len, heads, D, dtype=bf16, device=device),
        beta=torch.randn(batch, seq_len, heads, dtype=bf16, device=device),
        A_log=torch.randn(heads, dtype=torch.float32, device=device),
        dt_bias=torch.randn(heads, D, dtype=torch.float32, device=device),
    )


def _pool_call(**changes):
    arguments = _inputs()
    arguments.update(initial_state=torch.zeros(6, H, D, D), state_indices=torch.tensor([3, -1], dtype=torch.int32))
    arguments.update(changes)
    arguments = {name: value for name, value in arguments.items() if value is not None or name == "initial_state"}
    q, k, v, g, beta = (arguments.pop(name) for name in ("q", "k", "v", "g", "beta"))
    return call_module.resolve(q, k, v, g, beta, **arguments)


def test_resolved_call_carries_the_pool():
    pool = torch.zeros(6, H, D, D, dtype=torch.bfloat16)
    slots = torch.tensor([3, -1], dtype=torch.int32)
    checkpoints = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)
    call = _pool_call(initial_state=pool, state_indices=slots, checkpoint_every=64, checkpoint_indices=checkpoints,
                      output_final_state=False)
    assert call.inputs.initial_state is pool and call.final_state is pool
    assert call.inputs.state_indices is slots and call.inputs.checkpoint_indices is checkpoints
    assert call.options.checkpoint_every == 64 and call.options.final_state_dtype == torch.bfloat16
    assert call.options.segmentation is None and not call.training
    plain = call_module.resolve(*(_inputs()[n] for n in ("q", "k", "v", "g", "beta")),
                                A_log=torch.zeros(H), dt_bias=torch.zeros(H, D))
    assert plain.inputs.state_indices is None and plain.options.checkpoint_every == 0


def test_a_strided_view_of_a_larger_cache_is_a_pool():
    cache = torch.zeros(3, 8, H + 1, D, D)  # [layers, slots, heads + 1, V, K]
    pool = cache[1, :, 1:]  # slot stride (H + 1)·V·K, a view
    assert not pool.is_contiguous()
    assert _pool_call(initial_state=pool).final_state is pool


@pytest.mark.parametrize("changes,error,match", [
    (dict(initial_state=torch.zeros(6, H, D, D, dtype=torch.float16)), TypeError, "initial_state"),
    (dict(initial_state=torch.zeros(6, H + 1, D, D)), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(0, H, D, D)), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(6, H, D, D).transpose(-1, -2)), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(6, H, D, D + 4)[..., :D]), ValueError, "initial_state"),
    (dict(initial_state=torch.zeros(6, H, D, D)[:, :, :-1]), ValueError, "initial_state"),
    (dict(initial_state=None), ValueError, "initial_state"),
    (dict(state_indices=torch.tensor([3, -1])), TypeError, "state_indices"),
    (dict(state_indices=torch.tensor([3, -1, 2], dtype=torch.int32)), ValueError, "state_indices"),
    (dict(state_indices=torch.tensor([[3, -1]], dtype=torch.int32)), ValueError, "state_indices"),
    (dict(state_indices=[3, -1]), TypeError, "state_indices"),
    (dict(checkpoint_every=32, checkpoint_indices=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     "checkpoint_every"),
    (dict(checkpoint_every=0, checkpoint_indices=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     "checkpoint_every"),
    (dict(checkpoint_every=64.0, checkpoint_indices=torch.zeros(2, 1, dtype=torch.int32)), TypeError,
     "checkpoint_every"),
    (dict(checkpoint_every=64), ValueError, "checkpoint_every needs checkpoint_indices"),
    (dict(checkpoint_indices=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "checkpoint_indices needs"),
    (dict(checkpoint_every=64, checkpoint_indices=torch.zeros(2, 1, dtype=torch.int64)), TypeError,
     "checkpoint_indices"),
    (dict(checkpoint_every=64, checkpoint_indices=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
     "checkpoint_indices"),
    (dict(checkpoint_every=64, checkpoint_indices=torch.zeros(2, dtype=torch.int32)), ValueError,
     "checkpoint_indices"),
    (dict(state_indices=None, checkpoint_every=64, checkpoint_indices=torch.zeros(2, 1, dtype=torch.int32)),
     ValueError, "state_indices"),
    (dict(final_state=torch.zeros(6, H, D, D)), ValueError, "final_state"),
    (dict(segments=2), NotImplementedError, "segments"),
])
def test_bad_pool_arguments_name_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        _pool_call(**changes)


def test_pool_calls_do_not_train():
    with pytest.raises(NotImplementedError, match="state_indices"):
        _pool_call(q=_inputs()["q"].requires_grad_())
    with pytest.raises(NotImplementedError, match="state_indices"):
        _pool_call(initial_state=torch.zeros(6, H, D, D, requires_grad=True))


@pytest.mark.parametrize("slots,checkpoints,match", [
    ([6, -1], None, r"state_indices\[0\] = 6"),
    ([0, -2], None, r"state_indices\[1\] = -2"),
    ([2, 2], None, r"state_indices\[1\] = 2 repeats state_indices\[0\]"),
    ([2, 1], [[-1, 1], [-1, -1]], r"checkpoint_indices\[0, 1\] = 1 repeats state_indices\[1\]"),
    ([2, 1], [[3, 3], [-1, -1]], r"checkpoint_indices\[0, 1\] = 3 repeats"),
    ([2, 1], [[3, 9], [-1, -1]], r"checkpoint_indices\[0, 1\] = 9"),
])
def test_slot_values_are_checked_only_under_the_debug_switch(monkeypatch, slots, checkpoints, match):
    changes = dict(state_indices=torch.tensor(slots, dtype=torch.int32))
    if checkpoints is not None:
        changes.update(checkpoint_every=64, checkpoint_indices=torch.tensor(checkpoints, dtype=torch.int32))
    monkeypatch.delenv("CUTE_KDA_DEBUG_CHECKS", raising=False)
    _pool_call(**changes)  # trusted: the values are not read
    monkeypatch.setenv("CUTE_KDA_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=match):
        _pool_call(**changes)


def test_fla_drop_ins_take_pools():
    from cute_kda.fla_calls import translate_fla_call, translate_fla_gdn_call

    x = _inputs()
    pool, slots = torch.zeros(6, H, D, D, dtype=torch.bfloat16), torch.tensor([3, -1], dtype=torch.int32)
    flags = dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"])
    kda = translate_fla_call(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, state_indices=slots,
                             state_v_first=True, **flags)
    assert kda.options["initial_state"] is pool and kda.options["state_indices"] is slots
    assert not kda.state_k_first and not kda.k_first_pool
    k_first = translate_fla_call(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, state_indices=slots,
                                 **flags)
    assert k_first.k_first_pool and not k_first.state_k_first
    gdn = translate_fla_gdn_call(x["q"], x["k"], x["v"], x["g"][..., 0], x["beta"], initial_state=pool,
                                 state_indices=slots, checkpoint_every=64,
                                 checkpoint_indices=torch.zeros(2, 1, dtype=torch.int32), state_v_first=True)
    assert gdn.pool and not gdn.k_first_pool and gdn.options["checkpoint_every"] == 64
    assert gdn.run(lambda *t, **o: (t[2], o["initial_state"]))[1] is pool  # the pool comes back as it is


@pytest.mark.parametrize("slot_list,checkpoint_list", [
    ([4, -1, 0], [[2, -1], [5, 6], [1, 7]]),
    ([-1, -1, -1], None),
    ([-1, -1, -1], [[-1, -1], [3, -1], [-1, -1]]),
])
def test_k_first_pool_is_staged_through_a_v_first_one(slot_list, checkpoint_list):
    """A stand-in forward updates the v-first staging pool as K2 would (listed rows only; checkpoint row 1 of each
    sequence is not reached): the K-first pool gets exactly those rows, transposed, in their slots; every other slot
    keeps its bits."""
    from cute_kda.k_first_pool import run_on_k_first_pool

    pool = torch.randn(9, H, D, D)
    before = pool.clone()
    slots = torch.tensor(slot_list, dtype=torch.int32)
    checkpoints = None if checkpoint_list is None else torch.tensor(checkpoint_list, dtype=torch.int32)
    seen = {}

    def forward(*tensors, initial_state, state_indices, checkpoint_indices=None, **options):
        seen.update(staged=initial_state.clone(), options=options)
        for n, row in enumerate(state_indices.tolist()):
            if row >= 0:
                initial_state[row] = initial_state[row] * 2 + n
        if checkpoint_indices is not None:
            for n, row in enumerate(checkpoint_indices[:, 0].tolist()):
                if row >= 0 and state_indices[n] >= 0:
                    initial_state[row] = -float(n + 1)
        return tensors[0], initial_state

    options = dict(initial_state=pool, state_indices=slots, checkpoint_indices=checkpoints, gate="none")
    o, returned = run_on_k_first_pool(forward, (torch.zeros(1),), options)
    assert returned is pool and seen["options"] == {"gate": "none"}
    expected = before.clone()
    for n, slot in enumerate(slot_list):
        if slot >= 0:
            assert torch.equal(seen["staged"][n], before[slot].transpose(-1, -2))  # gathered v-first
            expected[slot] = before[slot] * 2 + n
        else:
            assert not seen["staged"][n].any()
    if checkpoint_list is not None:
        for n, (first, _) in enumerate(checkpoint_list):
            if first >= 0 and slot_list[n] >= 0:
                expected[first] = -float(n + 1)
    assert torch.equal(pool, expected)


def test_reference_gathers_zeros_for_padding_rows():
    pool = torch.randn(4, H, D, D)
    gathered = gather_states(pool, torch.tensor([2, -1, 0], dtype=torch.int32))
    assert torch.equal(gathered[0], pool[2]) and torch.equal(gathered[2], pool[0])
    assert not gathered[1].any()


# ============================================================================ GPU


def _random_inputs(lengths, heads, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    varlen = len(set(lengths)) > 1
    batch, seq_len = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    inputs = dict(q=randn(batch, seq_len, heads, D), k=randn(batch, seq_len, heads, D), v=randn(batch, seq_len, heads, D),
                  g=randn(batch, seq_len, heads, D), beta=randn(batch, seq_len, heads),
                  A_log=torch.rand(heads, generator=gen, device=device), dt_bias=randn(heads, D, dtype=torch.float32))
    if varlen:
        inputs["cu_seqlens"] = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64, device=device)
    return inputs


def _guarded_pool(slots, heads, dtype, device, seed=1):
    """A strided pool (every other slot of a cache, one extra head) and the cache: what is not the pool is a guard."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = (0.1 * torch.randn(2 * slots, heads + 1, D, D, generator=gen, device=device)).to(dtype)
    return cache[::2, 1:], cache


def _split(inputs):
    tensors = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    return tensors, {n: x for n, x in inputs.items() if n not in ("q", "k", "v", "g", "beta")}


POOL_CASES = {
    "fixed_B3_T200_padding": dict(lengths=[200, 200, 200], slots=[5, -1, 2]),
    "varlen_padding": dict(lengths=[17, 300, 64, 129, 1], slots=[-1, 7, 0, 3, 4]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_prefill_on_pool_is_gather_prefill_scatter(device, case, dtype):
    lengths, slot_list, heads = POOL_CASES[case]["lengths"], POOL_CASES[case]["slots"], 4
    tensors, options = _split(_random_inputs(lengths, heads, device))
    pool, cache = _guarded_pool(8, heads, dtype, device)
    before = cache.clone()
    slots = torch.tensor(slot_list, dtype=torch.int32, device=device)
    expected_out, expected_pool = prefill_on_pool(cute_kda.kda_forward, *tensors, pool=pool, state_indices=slots,
                                                  **options)
    out, state = cute_kda.kda_forward(*tensors, initial_state=pool, state_indices=slots, **options)
    torch.cuda.synchronize()
    assert state is pool
    assert torch.equal(out, expected_out)  # padding rows too: the zero-state prefill's outputs
    assert torch.equal(pool, expected_pool)  # listed slots written, every other slot as it was
    guard = before.clone()
    guard[::2, 1:] = pool
    assert torch.equal(cache, guard)  # the rest of the cache untouched, bit for bit


CHECKPOINT_CASES = {
    "varlen_C64": dict(lengths=[64 * 3 + 5, 128, 37, 256], every=64,
                       checkpoints=[[8, 9, 10, 11], [12, -1, 13, 14], [15, 16, 17, 18], [19, 20, 21, 22]]),
    "fixed_C128_padding": dict(lengths=[300, 300], every=128, slots=[-1, 1], checkpoints=[[8, 9, 10], [-1, 11, 12]]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
@pytest.mark.parametrize("vsplit", [1, 4])
def test_prefix_checkpoints_are_the_stopped_prefills_final_states(device, case, dtype, vsplit):
    """Checkpoint [n, j] = the final state of the prefill of the first (j + 1)·C tokens of sequence n: the same chain
    of tiles, so bit for bit (at a fixed V-split: the reference's short calls would pick another)."""
    spec = CHECKPOINT_CASES[case]
    lengths, heads = spec["lengths"], 2
    tensors, options = _split(_random_inputs(lengths, heads, device, seed=3))
    pool, cache = _guarded_pool(24, heads, dtype, device)
    before = cache.clone()
    slots = torch.tensor(spec.get("slots", list(range(len(lengths)))), dtype=torch.int32, device=device)
    checkpoints = torch.tensor(spec["checkpoints"], dtype=torch.int32, device=device)
    expected_out, expected_pool = prefill_on_pool(
        cute_kda.kda_forward, *tensors, pool=pool, state_indices=slots, checkpoint_every=spec["every"],
        checkpoint_indices=checkpoints, vsplit=vsplit, **options)
    out, _ = cute_kda.kda_forward(*tensors, initial_state=pool, state_indices=slots, checkpoint_every=spec["every"],
                                  checkpoint_indices=checkpoints, vsplit=vsplit, **options)
    torch.cuda.synchronize()
    assert torch.equal(out, expected_out)
    for slot in range(pool.shape[0]):
        assert torch.equal(pool[slot], expected_pool[slot]), f"slot {slot}"
    guard = before.clone()
    guard[::2, 1:] = pool
    assert torch.equal(cache, guard)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_kda_and_gdn_take_a_pool(device, dtype):
    lengths, heads = [70, 200, 33], 2
    x = _random_inputs(lengths, heads, device, seed=5)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    checkpoints = torch.tensor([[5], [6], [-1]], dtype=torch.int32, device=device)
    pools = [_guarded_pool(8, heads, dtype, device)[0] for _ in range(3)]
    pool_args = dict(state_indices=slots, checkpoint_every=64, checkpoint_indices=checkpoints)
    fla = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
               cu_seqlens=x["cu_seqlens"])
    o, state = cute_kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pools[0],
                                  use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=x["A_log"],
                                  dt_bias=x["dt_bias"], **fla, **pool_args)
    expected, _ = cute_kda.kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                       dt_bias=x["dt_bias"], cu_seqlens=x["cu_seqlens"], initial_state=pools[1],
                                       **pool_args)
    torch.cuda.synchronize()
    assert state is pools[0] and torch.equal(o, expected) and torch.equal(pools[0], pools[1])
    g_head = -torch.rand(x["beta"].shape, device=device)  # GatedDeltaNet: a log decay per head
    o, state = cute_kda.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g_head, x["beta"], initial_state=pools[2],
                                               **fla, **pool_args)
    gathered = gather_states(_guarded_pool(8, heads, dtype, device)[0], slots)
    reference, final = cute_kda.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g_head, x["beta"],
                                                       initial_state=gathered, output_final_state=True, **fla)
    torch.cuda.synchronize()
    assert state is pools[2] and torch.equal(o, reference)
    assert torch.equal(pools[2][0].float(), final[2]) and torch.equal(pools[2][2].float(), final[0])


# ============================================================================ FLA's return_intermediate_states


def test_intermediate_states_translate_to_chunk_states():
    from cute_kda.fla_calls import translate_fla_call

    x = _inputs()
    flags = dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"])
    call = translate_fla_call(x["q"], x["k"], x["v"], x["g"], x["beta"], return_intermediate_states=True,
                              chunk_size=32, **flags)
    assert call.chunk_states == 32 and call.cu_seqlens_cpu is None
    packed = [t[:1].reshape(1, -1, *t.shape[2:]) for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])]
    with pytest.raises(NotImplementedError, match="cu_seqlens_cpu"):
        translate_fla_call(*packed, return_intermediate_states=True, cu_seqlens=torch.tensor([0, 7, T]), **flags)
    cpu_bounds = torch.tensor([0, 7, T])
    call = translate_fla_call(*packed, return_intermediate_states=True, cu_seqlens=cpu_bounds,
                              cu_seqlens_cpu=cpu_bounds, **flags)
    assert call.chunk_states == 64 and call.cu_seqlens_cpu is cpu_bounds


INTERMEDIATE_CASES = {
    "fixed_B2_T200_chunk64": dict(lengths=[200, 200], chunk=64, v_first=False),
    "varlen_chunk64_v_first": dict(lengths=[70, 200, 33], chunk=64, v_first=True),
    "fixed_B1_T96_chunk32": dict(lengths=[96], chunk=32, v_first=False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(INTERMEDIATE_CASES))
def test_intermediate_states_are_the_states_entering_each_chunk(device, case):
    """h[.., c, ..] (bf16) = the bf16 rounding of the fp32 final state of the prefill of the first c·chunk tokens
    (the initial state for c = 0): bit for bit, the same tile chain; o and the final state are the plain call's."""
    spec = INTERMEDIATE_CASES[case]
    lengths, chunk, heads = spec["lengths"], spec["chunk"], 2
    x = _random_inputs(lengths, heads, device, seed=7)
    gen = torch.Generator(device=device).manual_seed(8)
    initial = 0.1 * torch.randn(len(lengths), heads, D, D, generator=gen, device=device)  # [N, H, V, K]
    cu = x.get("cu_seqlens")
    fla = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"],
               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=spec["v_first"],
               output_final_state=True, chunk_size=chunk)
    if cu is not None:
        fla.update(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    tensors = [x[n] for n in ("q", "k", "v", "g", "beta")]
    caller_initial = initial if spec["v_first"] else initial.transpose(-1, -2).contiguous()  # the caller's layout
    with torch.inference_mode():
        o, final, h = cute_kda.chunk_kda(*tensors, initial_state=caller_initial, return_intermediate_states=True,
                                         **fla)
        plain_o, plain_final = cute_kda.chunk_kda(*tensors, initial_state=caller_initial, **fla)
    if not spec["v_first"]:
        h = h.transpose(-1, -2)  # FLA's [K, V] → [V, K], as kda_forward's states below
    torch.cuda.synchronize()
    assert torch.equal(o, plain_o) and torch.equal(final, plain_final)
    varlen = cu is not None
    assert h.dtype == torch.bfloat16
    rows = 1 if varlen else len(lengths)
    assert h.shape == (rows, sum(-(-n // chunk) for n in lengths) // rows, heads, D, D)
    flat = h.reshape(-1, heads, D, D)
    row = 0
    for n, (b, start, length) in enumerate(sequence_bounds_of(lengths, varlen)):
        for c in range(-(-length // chunk)):
            expected = initial[n]
            if c:
                cut = [t[b:b + 1, start:start + c * chunk].clone() for t in tensors]  # aligned copies
                with torch.inference_mode():
                    _, expected = cute_kda.kda_forward(*cut, A_log=x["A_log"], dt_bias=x["dt_bias"],
                                                       initial_state=initial[n:n + 1], output_final_state=True)
                expected = expected[0]
            assert torch.equal(flat[row], expected.to(torch.bfloat16)), f"sequence {n} chunk {c}"
            row += 1


def sequence_bounds_of(lengths, varlen):
    """(batch row, first token, length) of each sequence of :func:`_random_inputs`."""
    if not varlen:
        return [(b, 0, lengths[0]) for b in range(len(lengths))]
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    return [(0, start, length) for start, length in zip(starts, lengths)]


def test_warmup_lists_the_pool_variants():
    from cute_kda.api import warmup_variants
    from cute_kda.variants import RecurrenceVariant, pair_prefill

    plain = warmup_variants(varlen=(True,), vsplits=(2,))
    pools = warmup_variants(varlen=(True,), vsplits=(2,), state_pools=(torch.float32,), checkpoint_every=(128,))
    assert pools[:len(plain)] == plain
    pairs = pair_prefill("safe", False, False, 2)  # the safe gate's prefill at V-split 2: two tiles a step if it pays
    assert pools[len(plain):] == [RecurrenceVariant(2, torch.float32, torch.float32, True, False, True, every,
                                                    pairs=pairs) for every in (0, 128)]


@pytest.mark.parametrize("vsplit", [1, 4], ids=["tiles", "pairs"])
@pytest.mark.parametrize("lengths,chunk", [([40, 40], 32), ([17, 0, 70, 64], 64)])
def test_chunk_states_are_picked_from_the_checkpoint_rows(monkeypatch, lengths, chunk, vsplit):
    """The index arithmetic of run_keeping_chunk_states: the state entering global tile g of sequence n is checkpoint
    row ``head · slots + g + n``; on the two-tile prefill's chain (the safe gate at V-split 4) the state entering the
    pair there is row ``head · slots + (g + n) // 2``; image r is filled with r here (a constant matrix, its own
    transpose)."""
    from cute_kda.executors import inference
    from cute_kda.executors.stages import Backend, ForwardResult, Saved
    from cute_kda.variants import pair_prefill

    varlen = len(set(lengths)) > 1
    x = _inputs(batch=1 if varlen else len(lengths), seq_len=sum(lengths) if varlen else lengths[0])
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()]) if varlen else None
    tiles = [-(-n // 16) for n in lengths]
    tile_base = np.cumsum([0, *tiles]).tolist()
    slots = sum(tiles) + len(lengths) + 3  # a few unused rows, as a larger workspace leaves

    def forward(inputs, options, *vsplit_of_pairs):
        rows = torch.arange(H * slots, dtype=torch.float32).view(-1, 1, 1).expand(-1, D, D)
        return ForwardResult(inputs.v, None, Saved(None, rows.to(torch.bfloat16).contiguous(), None))

    pairs = pair_prefill("safe", False, False, vsplit)
    monkeypatch.setattr(inference, "k2_vsplit", lambda options, device: vsplit)
    monkeypatch.setattr(inference, "KERNELS", Backend("rows", forward, None, None))
    monkeypatch.setattr(inference, "pair_forward", forward if pairs else None)
    tensors = [x[n] for n in ("q", "k", "v", "g", "beta")]
    call = call_module.resolve(*tensors, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu, segments=1,
                               training=False)
    _, _, h = inference.run_keeping_chunk_states(call, chunk, cu)
    starts = [(n, tile_base[n] + c * (chunk // 16)) for n, length in enumerate(lengths)
              for c in range(-(-length // chunk))]
    expected = [(tile + n) // 2 if pairs else tile + n for n, tile in starts]
    flat = h.reshape(-1, H, D, D).float()
    assert h.shape[0] == (1 if varlen else len(lengths)) and flat.shape[0] == len(expected)
    for i, row in enumerate(expected):
        for head in range(H):
            assert (flat[i, head] == head * slots + row).all(), (i, head)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_k_first_pool_equals_the_v_first_pool(device, dtype):
    """chunk_kda on FLA's default K-first pool (staged through a v-first one) = the same call on the v-first pool:
    the same slots written with the same bits, transposed; the other slots untouched."""
    lengths, heads = [70, 200, 33, 128], 2
    x = _random_inputs(lengths, heads, device, seed=9)
    slots = torch.tensor([2, -1, 0, 6], dtype=torch.int32, device=device)
    checkpoints = torch.tensor([[5, -1], [7, 8], [-1, -1], [1, 3]], dtype=torch.int32, device=device)
    v_first = _guarded_pool(9, heads, dtype, device)[0]
    k_first = v_first.transpose(-1, -2).contiguous()
    flags = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"],
                 use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, cu_seqlens=x["cu_seqlens"],
                 state_indices=slots, checkpoint_every=64, checkpoint_indices=checkpoints)
    tensors = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o_v, _ = cute_kda.chunk_kda(*tensors, initial_state=v_first, state_v_first=True, **flags)
    o_k, returned = cute_kda.chunk_kda(*tensors, initial_state=k_first, **flags)
    torch.cuda.synchronize()
    assert returned is k_first and torch.equal(o_k, o_v)
    assert torch.equal(k_first.transpose(-1, -2), v_first)
