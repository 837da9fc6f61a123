"""Context parallelism (``cute_kda/context_parallel.py``): sequences cut into segments that the serial scans run side by
side, the segments' states joined by the forward's and the backward's combines.

CPU tier: the heuristic and its refusals (GatedDeltaNet's B1 T32768 HV32 runs unsplit); the segment bounds; the
training chain on the reference backend (the mirrors) with segments against autograd through the fp64 gold and
against the unsplit chain (the first segment computed exactly as unsplit, the rest within rounding), through the
autograd Function, ``recompute`` and the training ops, on gates that keep half the channels from decaying so that
the states crossing the segment bounds carry weight; GatedDeltaNet's chain likewise.

GPU tier: the public API (the kernels) with segments against the fp64 gold (forward and every gradient) and against
the reference backend, the first segment bit-identical to the unsplit forward, the heuristic splitting a long
one-head call (and the result tracking the unsplit one), the segmented backward deterministic.
"""

from __future__ import annotations

import functools

import pytest
import torch

import cute_kda
from cute_kda import api, context_parallel
from cute_kda.executors import training
from cute_kda.reference.backend import REFERENCE
from cute_kda.context_parallel import MIN_SEGMENT_TILES, MIN_SEGMENTS, Segmentation, plan
from cute_kda.reference import gold_forward, rel_rms, tile_bases
from cute_kda.validation import ProblemShape

from test_autograd import INPUTS, REFERENCE_FORWARD, assert_close_to_gold, gold, make_problem, train

pytestmark = pytest.mark.filterwarnings("ignore:cute_kda mirror on CPU:RuntimeWarning")

D = 128
GOLD_BOUND = 6e-3  # o and the final state against the fp64 gold, as the forward's tests hold them


def fixed(batch, seq_len, heads):
    return ProblemShape(batch, seq_len, heads, D, batch, False)


# ============================================================================ CPU tier: the plan

@pytest.mark.parametrize("problem, sms, expected", [
    (fixed(1, 32768, 16), 132, Segmentation(1, 32768, 4096)),  # 16 chains: 8 segments of 256 tiles
    (fixed(1, 32768, 96), 132, None),  # enough chains already
    (fixed(2, 8192, 8), 132, Segmentation(2, 8192, 1024)),  # 16 chains, 8 segments of 64 tiles
    (fixed(1, 6000, 16), 132, None),  # 375 tiles: fewer than MIN_SEGMENTS segments of MIN_SEGMENT_TILES
    (fixed(1, 8192, 22), 132, Segmentation(1, 8192, 1376)),  # 6 segments (86 tiles each, the last 82)
    (fixed(1, 8192, 23), 132, None),  # 5 segments an SM's worth: not worth the extra passes
    (fixed(1, 1 << 20, 1), 132, Segmentation(1, 1 << 20, 7952)),  # 132 segments of 497 tiles (the last 429)
    (fixed(1, 32768, 32), 132, None),  # GatedDeltaNet's HV32: 32 value-head chains leave 4 SMs each
])
def test_heuristic(problem, sms, expected):
    assert plan(problem, sms) == expected
    if expected is not None:
        assert expected.per_seq >= MIN_SEGMENTS and expected.length >= MIN_SEGMENT_TILES * 16
        assert expected.length % 16 == 0 and problem.num_seqs * problem.heads * expected.per_seq <= sms


def test_explicit_segments():
    assert plan(fixed(2, 100, 4), 132, segments=3) == Segmentation(2, 100, 48)  # 7 tiles: 3, 3, 1
    assert plan(fixed(2, 100, 4), 132, segments=100) == Segmentation(2, 100, 16)  # at most one a tile
    assert plan(fixed(2, 100, 4), 132, segments=1) is None
    assert plan(fixed(1, 10, 4), 132, segments=4) is None  # one tile: nothing to split
    assert plan(fixed(1, 32768, 16), 132, vsplit=4) is None  # a fixed V-split keeps the heuristic out
    assert plan(fixed(1, 32768, 16), 132, segments=2, vsplit=4) == Segmentation(1, 32768, 16384)


@pytest.mark.parametrize("segments", [0, -2, 2.0, True, "4"])
def test_bad_segments_are_refused(segments):
    with pytest.raises(ValueError, match="segments"):
        plan(fixed(1, 64, 1), 132, segments=segments)


def test_varlen_is_not_split():
    packed = ProblemShape(1, 32768, 1, D, 2, True)
    assert plan(packed, 132) is None and plan(packed, 132, segments=1) is None
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        plan(packed, 132, segments=4)


def test_segment_bounds():
    seg = Segmentation(2, 100, 48)
    assert seg.per_seq == 3 and seg.count == 6
    assert seg.cu_seqlens().tolist() == [0, 48, 96, 100, 148, 196, 200]
    assert seg.problem(4, D) == ProblemShape(1, 200, 4, D, 6, True)
    states = torch.arange(6.0)
    assert seg.first(states).tolist() == [0.0, 3.0] and seg.last(states).tolist() == [2.0, 5.0]
    # the tile bases the device prefix would compute from the bounds: 3 + 3 + 1 tiles a sequence
    assert seg.tile_bases().dtype == torch.int32
    assert seg.tile_bases().tolist() == [0, 3, 6, 7, 10, 13, 14]
    assert torch.equal(seg.tile_bases(), tile_bases(seg.cu_seqlens(), 200, 1))


# ============================================================================ CPU tier: the chain on the mirrors

def low_decay(problem):
    """The problem with every other channel's gate pushed into the sigmoid's floor (decay ≈ 1 a token): states
    carry across many segments there, while the other channels keep make_problem's saturating gates."""
    g = problem["g"].float()
    g[..., ::2] = g[..., ::2] / 4 - 10
    return {**problem, "g": g.bfloat16()}


CPU_CASES = {  # lengths, make_problem keywords, segments, recompute
    "B2_T100_fp32_state_3_segments": ([100, 100], dict(state=torch.float32), 3, False),
    "B1_T90_bf16_state_4_segments_recompute": ([90], dict(state=torch.bfloat16), 4, True),
    "B1_T64_no_state_4_segments": ([64], {}, 4, False),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_reference_segments_match_gold(case):
    lengths, make, segments, recompute = CPU_CASES[case]
    problem, do, dht = make_problem(lengths, **make, seed=3)
    problem = low_decay(problem)
    o, ht, grads = train(REFERENCE_FORWARD, problem, do=do, dht=dht, segments=segments, recompute=recompute)
    p = dict(problem)
    tokens = [p.pop(n) for n in ("q", "k", "v", "g", "beta")]
    o_gold, ht_gold = gold_forward(*tokens, output_final_state=True, **p)
    assert o.shape == problem["v"].shape and ht.shape == dht.shape
    assert rel_rms(o, o_gold) <= GOLD_BOUND and rel_rms(ht, ht_gold) <= GOLD_BOUND
    assert_close_to_gold(grads, gold(problem, do, dht), problem, f"{case} segmented")


def test_reference_segments_change_only_what_crosses_a_bound():
    """The first segment of each sequence is the unsplit chain's, bit for bit; later ones differ (the entering
    states come through the fp32 combine), by rounding only."""
    problem, do, dht = make_problem([100, 100], state=torch.float32, seed=4)
    problem = low_decay(problem)
    split = train(REFERENCE_FORWARD, problem, do=do, dht=dht, segments=3)
    whole = train(REFERENCE_FORWARD, problem, do=do, dht=dht, segments=1)
    length = plan(fixed(2, 100, 2), 0, segments=3).length
    assert torch.equal(split[0][:, :length], whole[0][:, :length])
    assert not torch.equal(split[0], whole[0])
    assert rel_rms(split[0], whole[0]) <= GOLD_BOUND and rel_rms(split[1], whole[1]) <= GOLD_BOUND
    for name in INPUTS:
        assert rel_rms(split[2][name], whole[2][name]) <= 1e-2, name


def test_results_own_their_memory():
    """The final state and dh0 of a segmented call are copies, not views of the per-segment buffers (a view would
    keep every segment's state alive as long as the result)."""
    problem, do, dht = make_problem([64], state=torch.float32)
    _, ht, grads = train(REFERENCE_FORWARD, problem, do=do, dht=dht, segments=4)
    for t in (ht, grads["initial_state"]):
        assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _combine_against_out_of_place(num_seqs, transpose):
    """(``_combine``'s result, the same combine by out-of-place ``torch.baddbmm`` on the same segment-major batches)
    for random fp32 operands: 4 segments of 2 heads at D = 64."""
    seg, heads, dim = Segmentation(num_seqs, 64, 16), 2, 64
    gen = torch.Generator().manual_seed(5)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen)

    local = randn(seg.count, heads, dim, dim)
    transitions = randn(seg.count, heads, dim, dim, scale=dim ** -0.5)
    boundary = randn(num_seqs, heads, dim, dim)
    by_segment = [t.view(num_seqs, seg.per_seq, heads, dim, dim).transpose(0, 1).reshape(
        seg.per_seq, num_seqs * heads, dim, dim) for t in (local, transitions)]
    adds, steps = by_segment
    steps = steps.transpose(-1, -2) if transpose else steps
    states = [None] * seg.per_seq
    first, order = (seg.per_seq - 1, range(seg.per_seq - 2, -1, -1)) if transpose else (0, range(1, seg.per_seq))
    states[first] = boundary.reshape(num_seqs * heads, dim, dim)
    for target in order:
        source = target + 1 if transpose else target - 1
        states[target] = torch.baddbmm(adds[source], states[source], steps[source])
    expected = torch.stack(states).view(seg.per_seq, num_seqs, heads, dim, dim).transpose(0, 1).reshape(local.shape)
    into = torch.empty_like(local)  # the addends where the combine adds them: H[c − 1] at X[c], L[c] at G[c − 1]
    rows = seg.by_sequence(into)
    if transpose:
        rows[:, :-1] = seg.by_sequence(local)[:, 1:]
    else:
        rows[:, 1:] = seg.by_sequence(local)[:, :-1]
    context_parallel._combine(seg, into, transitions, boundary, transpose=transpose)
    return into, expected


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_combine_in_place_has_the_out_of_place_bits(num_seqs, transpose):
    """The combine adds each segment's GEMM in place (``baddbmm_``): the bits of ``torch.baddbmm`` into a fresh
    tensor, the form that copied the addend first (docs/perf-log.md, CP-host). On a GPU the combine is cute_kda's
    kernel (tests/test_segment_combine.py)."""
    into, expected = _combine_against_out_of_place(num_seqs, transpose)
    assert torch.equal(into, expected)


def test_training_after_an_inference_mode_call_of_the_same_split():
    """The segment bounds and identities are kept per split: made by a call under ``torch.inference_mode()``, they
    must still be tensors a later training call of the same split can save for its backward."""
    context_parallel._KEPT.clear()
    context_parallel._segment_bounds.cache_clear()
    problem, do, dht = make_problem([48], state=torch.float32, seed=9)
    with torch.inference_mode():
        REFERENCE_FORWARD(**{n: t.detach() for n, t in problem.items()}, output_final_state=True, segments=3)
    o, _, grads = train(REFERENCE_FORWARD, problem, do=do, dht=dht, segments=3)
    assert not o.is_inference() and all(g is not None for g in grads.values())


def test_segments_run_the_extra_passes(monkeypatch):
    """A segmented call makes the segment states once (the forward) and scans twice; ``recompute`` reuses the kept
    segment states instead of making them again."""
    made, scans = [], []
    segment_states, exiting = context_parallel.segment_states, context_parallel.exiting_gradients
    monkeypatch.setattr(context_parallel, "segment_states", lambda *a: made.append(1) or segment_states(*a))
    monkeypatch.setattr(context_parallel, "exiting_gradients", lambda *a: scans.append(1) or exiting(*a))
    problem, do, dht = make_problem([40], state=torch.float32)
    train(REFERENCE_FORWARD, problem, do=do, dht=dht, segments=2, recompute=True)
    assert made == [1] and scans == [1]


def test_training_ops_split_as_the_function_does(monkeypatch):
    """The training ops (torch.compile's path) on the reference stages give what the autograd Function gives."""
    monkeypatch.setattr(training, "_stages", lambda: REFERENCE)
    problem, do, dht = make_problem([50, 50], state=torch.float32, seed=5)

    def ops_forward(q, k, v, g, beta, *, A_log, dt_bias, initial_state, output_final_state, segments):
        return api._traced(q, k, v, g, beta, scale=None, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                                     initial_state=initial_state, output_final_state=output_final_state,
                                     cu_seqlens=None, out=None, final_state=None, vsplit=None, qk_l2norm=True,
                                     beta_logits=True, segments=segments)

    by_ops = train(ops_forward, problem, do=do, dht=dht, segments=3)
    by_function = train(REFERENCE_FORWARD, problem, do=do, dht=dht, segments=3)
    assert torch.equal(by_ops[0], by_function[0]) and torch.equal(by_ops[1], by_function[1])
    for name in INPUTS:
        assert torch.equal(by_ops[2][name], by_function[2][name]), name


@pytest.mark.parametrize("raw_gate", [True, False], ids=["softplus", "log_decay"])
def test_reference_segments_of_gated_delta_rule_match_gold(raw_gate):
    """GatedDeltaNet (a per-head gate, grouped value heads: 2 q/k heads, 4 value heads) split 3 ways on the mirrors:
    every gradient FLA fills within issue 10's targets of the fp64 gold."""
    from cute_kda.fla_calls import translate_fla_gdn_call

    from gradient_targets import TARGETS
    from test_gdn import GDN_GRADS, gdn_grads, gdn_problem, gold_gdn_grads

    problem = gdn_problem([96, 96], raw_gate=raw_gate)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(problem["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(2, problem["v"].shape[2], D, D, generator=gen)

    def split_gdn(**leaves):
        return translate_fla_gdn_call(**leaves).run(functools.partial(REFERENCE_FORWARD, segments=3))

    grads = gdn_grads(split_gdn, problem, do, dht)
    want = gold_gdn_grads(problem, do, dht)
    errors = {GDN_GRADS[n]: rel_rms(grad, want[n]) for n, grad in grads.items()}
    print(f"[segments] GatedDeltaNet {'softplus' if raw_gate else 'log decay'}: "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(e <= TARGETS[n] for n, e in errors.items()), errors


def test_gated_delta_rule_at_T32768_HV32_runs_unsplit_at_vsplit_4():
    """GatedDeltaNet B1 T32768 H16 HV32 (issue 34's row): the plan counts value heads (the chains, the states and the
    workspace are per value head), 32 chains leave 4 SMs each, fewer than MIN_SEGMENTS, so the call runs unsplit, K2
    and Kernel A at V-split 4 (128 CTAs each). Forced segments trade that V-split for segments at the same CTA count:
    4 segments run both scans at V-split 1 (docs/perf-log.md GDN4: measured slower)."""
    from cute_kda.validation import problem_of
    from cute_kda.variants import RecurrenceVariant, ScanVariant

    q = torch.empty((1, 32768, 16, D), dtype=torch.bfloat16, device="meta")
    v = torch.empty((1, 32768, 32, D), dtype=torch.bfloat16, device="meta")
    problem = problem_of(q, v, None)
    assert problem == fixed(1, 32768, 32)
    assert plan(problem, 132) is None
    assert plan(problem._replace(heads=16), 132) == Segmentation(1, 32768, 4096)  # had it counted q's heads
    assert RecurrenceVariant.choose_vsplit(1, 32, 132) == 4 and ScanVariant.choose_vsplit(1, 32, 132) == 4
    forced = plan(problem, 132, segments=4)
    assert forced == Segmentation(1, 32768, 8192)
    assert RecurrenceVariant.choose_vsplit(forced.count, 32, 132) == 1
    assert ScanVariant.choose_vsplit(forced.count, 32, 132) == 1


def test_reference_segments_of_gated_delta_rule_track_the_unsplit_chain():
    """GatedDeltaNet (per-head softplus gate, 2 q/k heads, 4 value heads) split 3 ways on the mirrors against the same
    call unsplit, with a weak decay (A_log = −4.6: ≈ 1 % a token) so that states carry across the bounds: the first
    segment's output is the unsplit chain's bit for bit, the rest differ by rounding only (the entering states come
    through the fp32 combine), every gradient within 1e-2 of the unsplit one and within issue 10's targets of the
    fp64 gold (the gold test above runs Qwen3-Next-like decays, under which little crosses a bound)."""
    from cute_kda.fla_calls import translate_fla_gdn_call

    from gradient_targets import TARGETS
    from test_gdn import GDN_GRADS, gdn_grads, gdn_problem, gold_gdn_grads

    problem = gdn_problem([96, 96])
    problem["A_log"] = torch.full_like(problem["A_log"], -4.6)
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(problem["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(2, problem["v"].shape[2], D, D, generator=gen)

    def gdn(segments):
        def run(**leaves):
            return translate_fla_gdn_call(**leaves).run(functools.partial(REFERENCE_FORWARD, segments=segments))
        return run

    outputs = {}

    def kept(segments):
        def run(**leaves):
            outputs[segments] = gdn(segments)(**leaves)
            return outputs[segments]
        return run

    split = gdn_grads(kept(3), problem, do, dht)
    whole = gdn_grads(kept(1), problem, do, dht)
    length = plan(fixed(2, 96, 4), 0, segments=3).length
    (o_split, ht_split), (o_whole, ht_whole) = outputs[3], outputs[1]
    assert torch.equal(o_split[:, :length], o_whole[:, :length])
    assert not torch.equal(o_split, o_whole)  # the later segments start from carried states
    assert rel_rms(o_split, o_whole) <= GOLD_BOUND and rel_rms(ht_split, ht_whole) <= GOLD_BOUND
    errors = {name: rel_rms(split[name], whole[name]) for name in whole}
    print("[segments] GatedDeltaNet split vs unsplit: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(e <= 1e-2 for e in errors.values()), errors
    want = gold_gdn_grads(problem, do, dht)
    gold_errors = {GDN_GRADS[n]: rel_rms(grad, want[n]) for n, grad in split.items()}
    print("[segments] GatedDeltaNet split vs gold: " + ", ".join(f"{n} {e:.2e}" for n, e in gold_errors.items()))
    assert all(e <= TARGETS[n] for n, e in gold_errors.items()), gold_errors


def test_bad_segments_name_the_argument():
    problem, do, _ = make_problem([40])
    with pytest.raises(ValueError, match="segments"):
        train(REFERENCE_FORWARD, problem, do=do, segments=0)
    packed, do, _ = make_problem([20, 17])
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        train(REFERENCE_FORWARD, packed, do=do, segments=2)


# ============================================================================ GPU tier

GPU_CASES = {  # lengths, heads, make_problem keywords, kda_forward keywords
    "B2_T1000_H2_fp32_state_4_segments": ([1000, 1000], 2, dict(state=torch.float32), dict(segments=4)),
    "B1_T777_H3_bf16_state_5_segments": ([777], 3, dict(state=torch.bfloat16), dict(segments=5)),
    "B1_T600_H2_softplus_3_segments": ([600], 2, {}, dict(segments=3, gate="softplus")),
}


def _gpu_problem(case, device):
    lengths, heads, make, options = GPU_CASES[case]
    problem, do, dht = make_problem(lengths, heads, **make, device=device, seed=21)
    return low_decay(problem), do, dht, dict(options)


def _cpu(tensors):
    return {n: x.cpu() for n, x in tensors.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_public_api_segments_match_gold(case, device):
    problem, do, dht, options = _gpu_problem(case, device)
    o, ht, grads = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    torch.cuda.synchronize()
    gate = options.pop("gate", "safe")
    p = _cpu(problem)
    tokens = [p.pop(n) for n in ("q", "k", "v", "g", "beta")]
    o_gold, ht_gold = gold_forward(*tokens, output_final_state=True, gate=gate, **p)
    err_o, err_ht = rel_rms(o.cpu(), o_gold), rel_rms(ht.cpu(), ht_gold)
    print(f"[segments] {case}: o {err_o:.2e}, final state {err_ht:.2e}")
    assert err_o <= GOLD_BOUND and err_ht <= GOLD_BOUND
    expected = gold(_cpu(problem), do.cpu(), dht.cpu(), gate=gate)
    assert_close_to_gold(_cpu(grads), expected, _cpu(problem), f"{case} segmented")


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_public_api_segments_near_the_reference_backend(case, device):
    problem, do, dht, options = _gpu_problem(case, device)
    _, _, grads = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    _, _, mirrored = train(REFERENCE_FORWARD, problem, do=do, dht=dht, **options)
    torch.cuda.synchronize()
    assert_close_to_gold(grads, mirrored, problem, f"{case} vs reference backend")


@pytest.mark.gpu
@pytest.mark.parametrize("state", [None, torch.bfloat16, torch.float32], ids=["none", "bf16", "fp32"])
def test_inference_first_segment_is_the_unsplit_forward(state, device, monkeypatch):
    """Per tile, the first segment's outputs are the unsplit call's bits; the unsplit call's default two-tile
    prefill (``variants.PAIR_PREFILL``, which a segmented call never runs) rounds otherwise and is held to the
    bound only."""
    problem, _, _ = make_problem([700, 700], 2, state=state, device=device, seed=22)
    problem = low_decay(problem)
    with torch.no_grad():
        split = cute_kda.kda_forward(**problem, output_final_state=True, segments=4)
        whole = cute_kda.kda_forward(**problem, output_final_state=True, segments=1)
        monkeypatch.setattr("cute_kda.variants.PAIR_PREFILL", False)
        per_tile = cute_kda.kda_forward(**problem, output_final_state=True, segments=1)
    length = plan(fixed(2, 700, 2), 0, segments=4).length
    assert torch.equal(split[0][:, :length], per_tile[0][:, :length])
    assert split[1].dtype == whole[1].dtype == (state or torch.float32)
    assert rel_rms(split[0], whole[0]) <= GOLD_BOUND and rel_rms(split[1], whole[1]) <= GOLD_BOUND


@pytest.mark.gpu
def test_inference_fills_caller_buffers(device):
    problem, _, _ = make_problem([300], 2, state=torch.bfloat16, device=device, seed=23)
    out = torch.empty_like(problem["v"])
    final = torch.empty_like(problem["initial_state"])
    with torch.no_grad():
        o, state = cute_kda.kda_forward(**problem, out=out, final_state=final, segments=3)
        o_ref, state_ref = cute_kda.kda_forward(**problem, output_final_state=True, segments=3)
    assert o is out and state is final
    assert torch.equal(out, o_ref) and torch.equal(final, state_ref)


@pytest.mark.gpu
def test_heuristic_splits_a_long_one_head_call(device, monkeypatch):
    """B1 T65536 H1: 4096 tiles on one chain; the heuristic cuts it (the SMs' worth of segments of ≥ 64 tiles) and
    the result tracks the unsplit forward."""
    problem, _, _ = make_problem([65536], 1, state=torch.float32, device=device, seed=24)
    problem = low_decay(problem)
    made = []
    segment_states = context_parallel.segment_states
    monkeypatch.setattr(context_parallel, "segment_states", lambda *a: made.append(a[0]) or segment_states(*a))
    with torch.no_grad():
        split = cute_kda.kda_forward(**problem, output_final_state=True)
        whole = cute_kda.kda_forward(**problem, output_final_state=True, segments=1)
    assert len(made) == 1 and made[0].per_seq >= MIN_SEGMENTS
    errors = rel_rms(split[0], whole[0]), rel_rms(split[1], whole[1])
    print(f"[segments] heuristic {made[0]}: o {errors[0]:.2e}, final state {errors[1]:.2e} against unsplit")
    assert max(errors) <= GOLD_BOUND


@pytest.mark.gpu
def test_segmented_backward_is_deterministic(device):
    problem, do, dht, options = _gpu_problem("B1_T777_H3_bf16_state_5_segments", device)
    first = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    second = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    torch.cuda.synchronize()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name in INPUTS:
        assert torch.equal(first[2][name], second[2][name]), name


@pytest.mark.gpu
def test_states_only_passes_keep_every_bit(device, monkeypatch):
    """``STATES_ONLY_PASSES`` (docs/perf-log.md v13): a segmented call's passes for the segment states and a
    recomputing backward's K2 pass run without o; the inference outputs, the training outputs and every gradient are
    the bits of the passes with o."""
    from cute_kda.executors import stages

    problem, do, dht, options = _gpu_problem("B1_T777_H3_bf16_state_5_segments", device)
    runs = {}
    for states_only in (False, True):
        monkeypatch.setattr(stages, "STATES_ONLY_PASSES", states_only)
        with torch.no_grad():
            inference = cute_kda.kda_forward(**problem, output_final_state=True, **options)
        runs[states_only] = (inference, train(cute_kda.kda_forward, problem, do=do, dht=dht, recompute=True, **options))
    torch.cuda.synchronize()
    (inference, (o, ht, grads)), (inference_so, (o_so, ht_so, grads_so)) = runs[False], runs[True]
    assert all(torch.equal(a, b) for a, b in zip(inference, inference_so))
    assert torch.equal(o, o_so) and torch.equal(ht, ht_so)
    for name in INPUTS:
        assert torch.equal(grads[name], grads_so[name]), name


def test_symbolic_sizes_are_planned_without_the_caches():
    """A trace's symbolic sizes (torch 2.11's SymInt is unhashable) are planned and resolved uncached: the plan and
    the call's options come out as for plain ints, and nothing keyed on them is kept."""
    from cute_kda.call import _OPTIONS, options_of
    from cute_kda.context_parallel import plan
    from cute_kda.validation import ProblemShape

    class Symbolic(int):
        __hash__ = None  # as torch 2.11's SymInt: no hash

    plain = ProblemShape(1, 4096, 2, 128, 1, False)
    traced = ProblemShape(1, Symbolic(4096), 2, 128, 1, False)
    assert not traced.concrete and plain.concrete
    assert plan(traced, 132, 3) == plan(plain, 132, 3) is not None
    kept = dict(_OPTIONS)
    options = options_of(traced, torch.device("cpu"), scale=None, lower_bound=-5.0, qk_l2norm=True, beta_logits=True,
                         final_state_dtype=None, vsplit=None, recompute=False, gate="safe", segments=3)
    assert options.segmentation == plan(plain, 0, 3) and _OPTIONS == kept
