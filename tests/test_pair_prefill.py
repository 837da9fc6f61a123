"""The two-tile prefill (docs/numerics.md, "Two tiles a serial step"): K2's pair variant
(``cute_kda.kernels.fwd_recurrence_pairs.PairRecurrence``) compiled on the CPU; on a GPU against its mirror
(``cute_kda.reference.pairs.mirror_recurrence_pairs``) on the mirror's pair workspace, and K1's pair variant + K2's
pair variant against the fp64 gold beside today's kernels. K1's pair variant against its mirror:
tests/test_fwd_prepare.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_fwd_recurrence import (
    CHUNK, D, MIRROR_TOL, STATE, TOL, VSPLITS, _assert_guards_untouched, _guarded, _initial_state, _problem,
)
from ulp_check import assert_within_one_ulp

from cute_kda.dsl import cute
from cute_kda.kernels.fwd_recurrence_pairs import PAIR_INPUT_STAGES, PairRecurrence
from cute_kda.layouts import budget
from cute_kda.layouts.fwd_recurrence import CROSS_FIELDS, RecurrenceSmemPlan
from cute_kda.ops import recurrence as k2
from cute_kda.ops._cache import dsl_type, to_cute_tensor
from cute_kda.workspace import (CrossBlocks, WorkspaceSpec, images_to_states, pair_blocks_shape, pair_u_shape,
                                workspace_views)

# ============================================================================ compile (CPU)

COMPILED = [(vsplit, *states, varlen, D) for vsplit, states, varlen in itertools.product(
    VSPLITS, (("none", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")), (False, True))]
COMPILED += [(1, "fp32", "fp32", True, 64), (2, "bf16", "bf16", False, 64), (4, "none", "fp32", True, 64)]


def _variant_id(variant) -> str:
    vsplit, state_in, state_out, varlen, dim = variant
    return f"vs{vsplit}-{state_in}-{state_out}-{'varlen' if varlen else 'fixed'}-D{dim}"


PAIR_HEADS, PAIR_SEQS = 2, 3


def pair_buffers(dim: int, varlen: bool) -> tuple:
    """A compile's token tensor (zeros; three sequences of 24 tokens, or packed as 20, 0, 60), pair workspace and
    cross blocks, two heads (the K2 and Kernel A pair tests)."""
    batch, steps = (1, 80) if varlen else (PAIR_SEQS, 24)
    tokens = torch.zeros(batch, steps, PAIR_HEADS, dim, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=PAIR_HEADS, tiles=8, dim=dim)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    cross = CrossBlocks(*(torch.zeros(spec.rows, CHUNK, CHUNK, dtype=torch.bfloat16) for _ in CROSS_FIELDS))
    return tokens, ws, cross


def _compile_args(vsplit, state_in, state_out, varlen, dim, training=False, token_outputs=True):
    heads, num_seqs = PAIR_HEADS, PAIR_SEQS
    v, ws, cross = pair_buffers(dim, varlen)
    checkpoints = u_a = None
    if training:
        checkpoints, u_a = (torch.zeros(shape(ws, heads, num_seqs), dtype=torch.bfloat16)
                            for shape in (pair_blocks_shape, pair_u_shape))

    def state(name):
        return None if STATE[name] is None else torch.zeros(num_seqs, heads, dim, dim, dtype=STATE[name])

    return k2.launch_arguments(
        v, ws, torch.zeros_like(v) if token_outputs else None,
        cu_seqlens=torch.tensor([0, 20, 20, 80]) if varlen else None,
        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None,
        initial_state=state(state_in), final_state=state(state_out), checkpoints=checkpoints, cross=cross, u_a=u_a,
        tensor=to_cute_tensor,
    )


@pytest.mark.parametrize("variant", COMPILED, ids=_variant_id)
def test_pair_variant_compiles(variant):
    """The pair step's code and the lone tile's (K2's step), no spills, the plan's shared memory."""
    from cute_kda.compile_report import compile_with_report

    vsplit, state_in, state_out, varlen, dim = variant
    kernel = PairRecurrence(vsplit=vsplit, initial_state=dsl_type(STATE[state_in]),
                            final_state=dsl_type(STATE[state_out]), varlen=varlen, dim=dim)
    _, report = compile_with_report(kernel, *_compile_args(*variant), cute.runtime.make_fake_stream())
    atoms, k_steps = kernel.warp_cols // 8, dim // CHUNK
    # the pair: Phase 1 of both tiles, INV, Mqk of both, P and Q, Phase 6 with both tiles; the lone tile: K2's
    pair_step, lone_step = 6 * k_steps + 6, 3 * k_steps + 2
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == (pair_step + lone_step) * atoms
    assert report.count("mul.rn.f32") == 2 * k_steps * 4 * atoms and report.count("fma.rn.f32") == 0
    assert report.count("movmatrix.sync.aligned.m8n8.trans.b16") == (2 + 1) * 2 * 2 * atoms  # u, U a tile
    # TMA loads of a stage: v, kd, qd, kr, gT, β, INV, Mqk and the cross blocks; the state's
    loads = report.count("cp.async.bulk.tensor.2d.shared::cta.global") + sum(
        report.count(f"cp.async.bulk.tensor.{n}d.shared::cta.global") for n in (3, 4, 5))
    assert loads == 10 + (state_in != "none")
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == [kernel.plan.total_bytes] == [budget.k2_budget(kernel.plan).total_bytes]
    print(f"{variant}: {report.kernels[0].registers} registers, {kernel.plan.total_bytes} B smem")


@pytest.mark.parametrize("pool_dtype,prefix", [(torch.float32, 64), (torch.bfloat16, 0)], ids=["fp32_prefix", "bf16"])
def test_pair_pool_variant_compiles(pool_dtype, prefix):
    """The serving prefill on a state pool (slot ids, prefix checkpoints after a pair that ends a C-block) and fp16
    tokens: no spills."""
    from cute_kda.compile_report import compile_with_report

    heads, num_seqs = 2, 3
    v = torch.zeros(1, 80, heads, D, dtype=torch.float16)
    spec = WorkspaceSpec(heads=heads, tiles=8)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    cross = CrossBlocks(*(torch.zeros(spec.rows, CHUNK, CHUNK, dtype=torch.bfloat16) for _ in CROSS_FIELDS))
    pool = torch.zeros(5, heads, D, D, dtype=pool_dtype)
    arguments = k2.launch_arguments(
        v, ws, torch.zeros_like(v), cu_seqlens=torch.tensor([0, 20, 20, 80]),
        tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32), initial_state=pool, final_state=pool,
        state_indices=torch.zeros(num_seqs, dtype=torch.int32),
        checkpoint_indices=torch.zeros(num_seqs, 2, dtype=torch.int32) if prefix else None, cross=cross,
        tensor=to_cute_tensor)
    state = dsl_type(pool_dtype)
    kernel = PairRecurrence(vsplit=2, initial_state=state, final_state=state, varlen=True, state_pool=True,
                            prefix_checkpoint_every=prefix, dtype=dsl_type(torch.float16))
    _, report = compile_with_report(kernel, *arguments, cute.runtime.make_fake_stream())
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == [kernel.plan.total_bytes]
    print(f"pool {pool_dtype} prefix {prefix}: {report.kernels[0].registers} registers")


def test_pair_plan_holds_the_cross_blocks():
    plan = RecurrenceSmemPlan(vsplit=2, pairs=True, input_stages=PAIR_INPUT_STAGES)
    today = RecurrenceSmemPlan(vsplit=2, input_stages=PAIR_INPUT_STAGES)
    assert plan.stage_tx_bytes == today.stage_tx_bytes + 2 * CHUNK * CHUNK * 2
    assert {name: offset for name, offset in plan.union_offsets().items() if name not in CROSS_FIELDS}.keys() \
        == today.union_offsets().keys()
    assert PairRecurrence(vsplit=2).plan.pairs


TRAINING = [(1, "fp32", "fp32", False, D), (1, "bf16", "bf16", False, D), (2, "bf16", "bf16", True, D),
            (4, "none", "fp32", False, D), (1, "none", "fp32", True, 64), (4, "none", "none", False, 64)]
# the pair step at V-split 1 sits at the 255-register limit: with a bf16 initial state on packed sequences ptxas
# spills 8 bytes (docs/perf-log.md v11; every other state pair, length mode and V-split: none)
TRAINING_SPILLS = {(1, "bf16", "bf16", True, D): 8, (1, "bf16", "fp32", True, D): 8}
TRAINING += list(TRAINING_SPILLS)


@pytest.mark.parametrize("variant", TRAINING, ids=_variant_id)
def test_pair_training_variant_compiles(variant):
    """The training variant (a checkpoint and tile a's U a pair): each traced step (the pair's, the lone tile's)
    keeps the state by D / 8 bulk copies where the warp's band is 32 columns or more, else by 32-bit stores of its B
    fragment; U by 32-bit stores of the B fragment Phase 6 reads (the pair's step only); no spills but the known
    ones (TRAINING_SPILLS)."""
    from cute_kda.compile_report import compile_with_report

    vsplit, state_in, state_out, varlen, dim = variant
    kernel = PairRecurrence(vsplit=vsplit, initial_state=dsl_type(STATE[state_in]),
                            final_state=dsl_type(STATE[state_out]), varlen=varlen, dim=dim, checkpoints=True)
    _, report = compile_with_report(kernel, *_compile_args(*variant, training=True), cute.runtime.make_fake_stream())
    cols, bodies = kernel.warp_cols, 2
    u_words = cols // 8 * 2
    if kernel.image_by_bulk:
        assert report.count("cp.async.bulk.global.shared::cta") == bodies * dim // 8
        assert report.count("st.global.b32") == u_words
    else:
        assert report.count("cp.async.bulk.global.shared::cta") == 0
        assert report.count("st.global.b32") == bodies * cols * dim // 64 + u_words
    spills = TRAINING_SPILLS.get(variant, 0)
    assert report.spills <= spills and (spills or report.local_memory_ops == 0 and report.kernels[0].stack_frame == 0)
    assert report.launch_smem == [kernel.plan.total_bytes]
    print(f"training {variant}: {report.kernels[0].registers} registers, {report.spills} bytes spilled")


# the backward's recomputation under STATES_ONLY_PASSES (a checkpoint and U a pair, no final state, no o)
STATE_PASSES = [(1, "fp32", "none", False, D), (1, "bf16", "none", True, D), (2, "none", "none", True, D),
                (4, "fp32", "none", False, D), (4, "bf16", "none", True, 64)]


@pytest.mark.parametrize("variant", STATE_PASSES, ids=_variant_id)
def test_pair_state_pass_compiles(variant):
    """``token_outputs=False``: the training pair step less o's — its input stage without qd, Mqk and Q (the plan's
    fields, so the transaction count is what the load warp moves: −(16·D + 2·16·16)·2 bytes), no o store, Phase 1
    without ``qd·S``, no ``Q·U_a`` or ``Mqk·U``; the kept state and U written as with o; no spills (the variant with o
    spills 8 bytes at V-split 1 with a bf16 state on packed sequences)."""
    from cute_kda.compile_report import compile_with_report

    vsplit, state_in, state_out, varlen, dim = variant
    kernels, reports = [], []
    for outputs in (False, True):
        kernel = PairRecurrence(vsplit=vsplit, initial_state=dsl_type(STATE[state_in]),
                                final_state=dsl_type(STATE[state_out]), varlen=varlen, dim=dim, checkpoints=True,
                                token_outputs=outputs)
        args = _compile_args(*variant, training=True, token_outputs=outputs)
        kernels.append(kernel)
        reports.append(compile_with_report(kernel, *args, cute.runtime.make_fake_stream())[1])
    (kernel, full_kernel), (report, full) = kernels, reports
    assert set(full_kernel.plan.input_field_bytes()) - set(kernel.plan.input_field_bytes()) == {"qd", "mqk", "cross_qd"}
    assert kernel.plan.stage_tx_bytes == full_kernel.plan.stage_tx_bytes - (CHUNK * dim + 2 * CHUNK * CHUNK) * 2
    loads = "cp.async.bulk.tensor.{}d.shared::cta.global"
    # per stage: gT, β (2-D), kd, kr (3-D), INV, P (4-D), v (5-D); the initial state (5-D)
    assert {dims: report.count(loads.format(dims)) for dims in (2, 3, 4, 5)} == {
        2: 2, 3: 2, 4: 2, 5: 1 + (state_in != "none")}
    assert report.count("cp.async.bulk.tensor.5d.global.shared::cta") == 0  # no o, no final state
    atoms, k_steps, bodies = kernel.warp_cols // 8, dim // CHUNK, 2  # the pair's step and the lone tile's
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    # qd·S of each tile, Q·U_a (tile b), Mqk·U of each tile: the pair's body 2 (k_steps + 1) + 1, the lone's k_steps + 1
    assert full.count(mma) - report.count(mma) == ((2 * (k_steps + 1) + 1) + (k_steps + 1)) * atoms
    for mnemonic in ("cp.async.bulk.global.shared::cta", "st.global.b32", "movmatrix"):
        assert report.count(mnemonic) == full.count(mnemonic), mnemonic
    assert bodies == 2 and report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == [kernel.plan.total_bytes] and kernel.plan.total_bytes < full_kernel.plan.total_bytes
    print(f"states only {variant}: {report.kernels[0].registers} registers (with o {full.kernels[0].registers}), "
          f"{kernel.plan.total_bytes} B ({full_kernel.plan.total_bytes})")


def test_pair_state_pass_needs_its_checkpoints():
    """``out=None`` with the cross blocks: the two-tile step keeps its states by checkpoints (and U), not by a final
    state alone."""
    v, ws, cross = pair_buffers(D, False)
    final = torch.zeros(PAIR_SEQS, PAIR_HEADS, D, D)
    with pytest.raises(ValueError, match="with cross: checkpoints"):
        k2.recurrence(v, ws, None, cu_seqlens=None, final_state=final, cross=cross)


def test_recurrence_checks_the_pair_training_buffers():
    v = torch.zeros(1, 32, 1, D, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=1, tiles=2)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    cross = CrossBlocks(*(torch.zeros(2, CHUNK, CHUNK, dtype=torch.bfloat16) for _ in CROSS_FIELDS))
    checkpoints = torch.zeros(pair_blocks_shape(ws, 1, 1), dtype=torch.bfloat16)
    u_a = torch.zeros(pair_u_shape(ws, 1, 1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="u_a comes with"):
        k2.recurrence(v, ws, v, cross=cross, checkpoints=checkpoints, vsplit=1)
    with pytest.raises(ValueError, match="u_a comes with"):
        k2.recurrence(v, ws, v, checkpoints=torch.zeros(3, D, D, dtype=torch.bfloat16), u_a=u_a, vsplit=1)
    with pytest.raises(ValueError, match=r"checkpoints must be bfloat16 \(1, 128, 128\)"):
        k2.recurrence(v, ws, v, cross=cross, checkpoints=torch.zeros(3, D, D, dtype=torch.bfloat16), u_a=u_a,
                      vsplit=1)
    with pytest.raises(ValueError, match=r"u_a must be bfloat16 \(1, 128, 16\)"):
        k2.recurrence(v, ws, v, cross=cross, checkpoints=checkpoints, u_a=u_a.float(), vsplit=1)


# ============================================================================ GPU


def mirror_pair_workspace(problem, lengths) -> tuple:
    """The mirror's pair workspace of ``problem`` (``_problem``'s tensors, the safe gate; ``lengths`` packed, or None),
    with its ``cu_seqlens`` and sequence count."""
    from cute_kda.reference.pairs import mirror_prepare_pairs

    q, k, v, g, beta, A_log, bias = problem
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device=q.device)
    pws = mirror_prepare_pairs(q, k, g, beta, A_log=A_log, dt_bias=bias, lower_bound=-5.0, cu_seqlens=cu)
    return pws, cu, q.shape[0] if lengths is None else len(lengths)


def _run_pairs(problem, *, lengths=None, state_in="none", state_out="fp32", vsplit=None, seed=0, kept=None):
    """The mirror's pair workspace, then K2's pair variant into guarded buffers; returns (o, final, pws, cu, init).
    ``kept``: a list that receives the training variant's checkpoints and U rows (NaN where not written): that
    variant runs."""
    q, v = problem[0], problem[2]
    device = q.device
    B, T, H, dim = q.shape
    pws, cu, N = mirror_pair_workspace(problem, lengths)
    init = _initial_state(state_in, N, H, seed, device, dim)
    out, out_buf = _guarded((B, T, H, dim), torch.bfloat16, device, axis=1, pad=CHUNK)
    final = final_buf = None
    if STATE[state_out] is not None:
        final, final_buf = _guarded((N, H, dim, dim), STATE[state_out], device, axis=0, pad=1)
    checkpoints = u_a = None
    if kept is not None:
        checkpoints, u_a = (torch.full(shape(pws.ws, H, N), float("nan"), dtype=torch.bfloat16, device=device)
                            for shape in (pair_blocks_shape, pair_u_shape))
        kept.extend((checkpoints, u_a))
    k2.recurrence(v, pws.ws, out, cu_seqlens=cu, initial_state=init, final_state=final, vsplit=vsplit,
                  cross=CrossBlocks(pws.cross_kd, pws.cross_qd), checkpoints=checkpoints, u_a=u_a)
    torch.cuda.synchronize()
    _assert_guards_untouched(out_buf, axis=1, pad=CHUNK)
    if final is not None:
        _assert_guards_untouched(final_buf, axis=0, pad=1)
    assert not out.isnan().any(), "an output row was not written"
    return out, final, pws, cu, init


def _mirror_pairs(problem, pws, cu, init, state_out):
    from cute_kda.reference.pairs import mirror_recurrence_pairs

    return mirror_recurrence_pairs(pws, problem[2], cu_seqlens=cu, initial_state=init, output_final_state=True,
                                   state_dtype=STATE[state_out] or torch.float32)


ALL_DIMS = pytest.mark.parametrize("dim", [D, 64], ids=["D128", "D64"])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 17, 32])
@pytest.mark.parametrize("state_in,state_out", [("bf16", "bf16"), ("fp32", "fp32"), ("none", "fp32")])
@ALL_DIMS
def test_one_pair_within_one_ulp_of_the_mirror(T, state_in, state_out, dim):
    """A lone tile (T ≤ 16) or one pair (17, 32): one step, so the kernel is within an ULP of the mirror."""
    problem = _problem(2, T, 3, seed=T, dim=dim)
    o, final, pws, cu, init = _run_pairs(problem, state_in=state_in, state_out=state_out, seed=T)
    o_ref, final_ref = _mirror_pairs(problem, pws, cu, init, state_out)
    assert_within_one_ulp(f"T={T} o", o, o_ref)
    assert_within_one_ulp(f"T={T} state", final, final_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300, 33]], ids=["B2xT300", "varlen"])
@pytest.mark.parametrize("vsplit", VSPLITS)
@ALL_DIMS
def test_many_pairs_track_the_mirror(lengths, vsplit, dim):
    from cute_kda.reference import rel_rms

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=11, dim=dim)
    o, final, pws, cu, init = _run_pairs(problem, lengths=lengths, state_in="fp32", state_out="fp32", vsplit=vsplit,
                                         seed=11)
    o_ref, final_ref = _mirror_pairs(problem, pws, cu, init, "fp32")
    err_o, err_s = rel_rms(o, o_ref), rel_rms(final, final_ref)
    print(f"vs mirror: o {err_o:.2e} state {err_s:.2e}")
    assert err_o <= MIRROR_TOL and err_s <= MIRROR_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300, 33], [32]], ids=["B2xT300", "varlen", "one_pair"])
@pytest.mark.parametrize("vsplit", VSPLITS)
@ALL_DIMS
def test_pair_training_keeps_the_mirrors_matrices(lengths, vsplit, dim):
    """The training variant: o and the final state are the inference variant's bit for bit; its checkpoints and U
    rows are the mirror's (``mirror_recurrence_pairs`` keeping them) in the same rows, the others untouched; one
    pair from a bf16 state: the checkpoint is that state and U within an ULP."""
    from cute_kda.reference import rel_rms
    from cute_kda.reference.pairs import mirror_recurrence_pairs

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=13, dim=dim)
    runs = {}
    for training in (False, True):
        kept = [] if training else None
        runs[training] = _run_pairs(problem, lengths=lengths, state_in="bf16", state_out="fp32", vsplit=vsplit,
                                    seed=13, kept=kept), kept
    (o, final, pws, cu, init), (checkpoints, u_a) = runs[True]
    assert torch.equal(o.view(torch.int16), runs[False][0][0].view(torch.int16))
    assert torch.equal(final, runs[False][0][1])
    ref = [torch.full_like(t, float("nan")) for t in (checkpoints, u_a)]
    mirror_recurrence_pairs(pws, problem[2], cu_seqlens=cu, initial_state=init, checkpoints=ref[0], u_a=ref[1])
    # the kernel keeps state images (their [K, V] matrices by images_to_states), the mirror [K, V] matrices
    for name, got, want in (("checkpoints", images_to_states(checkpoints), ref[0]), ("u_a", u_a, ref[1])):
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: rows written differ from the mirror's"
        written = ~want.isnan()
        if lengths == [32]:
            assert_within_one_ulp(name, got[written], want[written])
        else:
            err = rel_rms(got[written].float(), want[written].float())
            print(f"{name} vs mirror: {err:.2e}")
            assert err <= MIRROR_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300, 33]], ids=["B2xT300", "varlen"])
@pytest.mark.parametrize("vsplit", VSPLITS)
@ALL_DIMS
def test_pair_state_pass_keeps_the_same_states(lengths, vsplit, dim):
    """The training pair step without token outputs (``out=None``, the backward's recomputation under
    ``STATES_ONLY_PASSES``) keeps the checkpoints and U rows of the step with o bit for bit, the rows it does not own
    left poisoned."""
    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    problem = _problem(B, T, 2, seed=17, dim=dim)
    kept = []
    _, _, pws, cu, init = _run_pairs(problem, lengths=lengths, state_in="fp32", state_out="none", vsplit=vsplit,
                                     seed=17, kept=kept)
    H, N = problem[0].shape[2], init.shape[0]
    alone = [torch.full(shape(pws.ws, H, N), float("nan"), dtype=torch.bfloat16, device=init.device)
             for shape in (pair_blocks_shape, pair_u_shape)]
    k2.recurrence(problem[2], pws.ws, None, cu_seqlens=cu, initial_state=init, vsplit=vsplit,
                  cross=CrossBlocks(pws.cross_kd, pws.cross_qd), checkpoints=alone[0], u_a=alone[1])
    torch.cuda.synchronize()
    for name, got, want in zip(("checkpoints", "u_a"), alone, kept):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


@pytest.mark.gpu
@ALL_DIMS
def test_pair_vsplits_are_bit_identical(dim):
    lengths = [300, 0, 17, 1, 64, 33]
    problem = _problem(1, sum(lengths), 3, seed=5, dim=dim)
    results = [_run_pairs(problem, lengths=lengths, state_in="fp32", state_out="fp32", vsplit=s, seed=5)[:2]
               for s in VSPLITS]
    for o, final in results[1:]:
        assert torch.equal(o.view(torch.int16), results[0][0].view(torch.int16))
        assert torch.equal(final, results[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [1300, 547, 2048, 963, 271, 3063], [0, 5, 16, 33]],
                         ids=["B2xT1024", "mixed", "0-5-16-33"])
@pytest.mark.parametrize("state_in,state_out", [("none", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")])
@ALL_DIMS
def test_pair_prefill_is_as_accurate_as_today(lengths, state_in, state_out, dim):
    """K1's and K2's pair variants end to end against the fp64 gold: within TOL, or 1.1 × today's kernels' error
    (the pair step moves the rounding, numerics.md)."""
    from cute_kda.ops.prepare import prepare
    from cute_kda.reference import gold_forward, rel_rms
    from cute_kda.workspace import allocate_cross_blocks, allocate_workspace, tiles_per_head

    B, T = (2, 1024) if lengths is None else (1, sum(lengths))
    q, k, v, g, beta, A_log, bias = problem = _problem(B, T, 2, seed=3, dim=dim)
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    N = B if lengths is None else len(lengths)
    init = _initial_state(state_in, N, 2, 3, "cuda", dim)
    spec = WorkspaceSpec(heads=2, tiles=tiles_per_head(B * T, N, cu is not None), dim=dim)
    results = {}
    for pairs in (False, True):
        ws, cross = allocate_workspace(spec, "cuda"), allocate_cross_blocks(spec, "cuda") if pairs else None
        out = torch.empty_like(v)
        final = None if STATE[state_out] is None else torch.empty(N, 2, dim, dim, dtype=STATE[state_out],
                                                                  device="cuda")
        prepare(q, k, g, beta, A_log, bias, ws, scale=dim ** -0.5, lower_bound=-5.0, cu_seqlens=cu, cross=cross)
        k2.recurrence(v, ws, out, cu_seqlens=cu, initial_state=init, final_state=final, cross=cross)
        results[pairs] = out, final
    o_gold, final_gold = gold_forward(*problem[:5], A_log=A_log, dt_bias=bias, lower_bound=-5.0, cu_seqlens=cu,
                                      initial_state=init, output_final_state=True)
    for index, gold in ((0, o_gold), (1, final_gold)):
        if results[True][index] is None:
            continue
        today, pair = rel_rms(results[False][index], gold), rel_rms(results[True][index], gold)
        print(f"{'o' if index == 0 else 'state'}: today {today:.2e}, pairs {pair:.2e}")
        assert pair <= max(TOL, 1.1 * today)
