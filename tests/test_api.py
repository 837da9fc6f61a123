"""The public forward: accuracy against the gold recurrence, buffers, workspace reuse, streams, DLPack.

CPU tier: the framework plumbing (DLPack detection and hand-back), variant selection, the seam
of the FLA translation. GPU tier: ``kda_forward`` on real kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cute_kda
import cute_kda.call as call_module
from cute_kda import api, interop, validation
from cute_kda.executors import inference, stages
from cute_kda.fla_calls import CanonicalCall
from cute_kda.numerics import HEAD_DIM, SCAN_VSPLITS
from cute_kda.variants import CombineVariant, GradsVariant, PrepareVariant, RecurrenceVariant, ScanVariant, pair_prefill
from cute_kda.reference import gold_forward, mirror_forward, rel_rms
from cute_kda.reference.pairs import mirror_forward_pairs

D = 128
GOLD_BOUND = 6e-3
SLEEP_CYCLES = 2_000_000_000  # about a second of GPU spin: long enough to observe a busy stream


# ---------------------------------------------------------------------------------------------
# CPU tier


def test_framework_detection():
    assert interop.framework_of(torch.zeros(1)) == interop.TORCH
    assert interop.framework_of(np.zeros(1)) == interop.OTHER


def test_dlpack_input_becomes_a_torch_view():
    array = np.arange(6, dtype=np.float32)
    view = interop.as_torch(array)
    assert isinstance(view, torch.Tensor)
    view[0] = 42.0
    assert array[0] == 42.0  # same memory, no copy


def test_torch_and_non_arrays_pass_through():
    t = torch.zeros(2)
    assert interop.as_torch(t) is t and interop.as_torch(None) is None and interop.as_torch(3.0) == 3.0
    assert interop.to_framework(t, interop.TORCH) is t and interop.to_framework(t, interop.OTHER) is t
    assert interop.to_framework(None, interop.CUPY) is None


def test_answer_in_framework_hands_back_every_result():
    """Torch callers get run()'s tuple itself; other DLPack callers each result through to_framework (torch for
    a producer cute_kda does not know), None kept."""
    results = (torch.ones(2), None)
    assert interop.answer_in_framework(torch.zeros(1), lambda: results) is results
    o, state = interop.answer_in_framework(np.zeros(1), lambda: results)
    assert o is results[0] and state is None


def test_dlpack_arrays_reach_validation():
    """A numpy float32 q goes through DLPack and is refused by dtype, naming q."""
    q = np.zeros((1, 16, 2, D), dtype=np.float32)
    with pytest.raises(TypeError, match="q must be bfloat16 or float16, got float32"):
        cute_kda.kda_forward(q, q, q, q, q[..., 0], A_log=np.zeros(2, np.float32), dt_bias=np.zeros((2, D), np.float32))


def test_options_keep_an_explicit_vsplit_and_resolve_the_scale():
    q = torch.zeros(1, 64, 4, D, dtype=torch.bfloat16)
    options = call_module.options_of(validation.problem_of(q, q, None), q.device, scale=None, lower_bound=-5,
                                     qk_l2norm=True, beta_logits=False,
                                     final_state_dtype=None, vsplit=4, recompute=False, gate="safe", segments=None)
    assert options.vsplit == 4 and options.scale == D ** -0.5 and options.lower_bound == -5.0
    assert options.problem == validation.problem_of(q, q, None) and options.segmentation is None


def test_warmup_variants_cover_the_product():
    variants = api.warmup_variants(qk_l2norm=(True, False), varlen=(True,), state_modes=(None, torch.float32),
                                   vsplits=(1, 4), segments=False)
    recurrences = [v for v in variants if isinstance(v, RecurrenceVariant)]
    assert len(variants) == len(set(variants)) and len(recurrences) == 1 * 2 * 2  # varlen × modes × V-splits
    assert {(v.initial_state, v.final_state) for v in recurrences} == {(None, None), (torch.float32, torch.float32)}
    assert {(v.qk_l2norm, v.varlen) for v in variants if isinstance(v, PrepareVariant)} == {(True, True), (False, True)}


def test_workspace_cache_reuses_views_until_spec_or_buffer_changes(monkeypatch):
    """The per-(device, stream) cache hands back the same views for the same spec (CPU stand-in stream)."""
    from types import SimpleNamespace

    from cute_kda.workspace import WorkspaceSpec

    monkeypatch.setattr(api.torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=7))
    cache, cpu = inference.WorkspaceCache(), torch.device("cpu")
    small, other = WorkspaceSpec(heads=2, tiles=3), WorkspaceSpec(heads=3, tiles=2)
    first = cache.get(small, cpu)
    assert cache.get(small, cpu) is first
    swapped = cache.get(other, cpu)  # same byte size class: same buffer, new views
    assert swapped is not first and swapped.qd.shape == (6, 16, 128)
    assert swapped.qd.data_ptr() == first.qd.data_ptr()
    grown = cache.get(WorkspaceSpec(heads=64, tiles=512), cpu)  # needs a bigger buffer
    assert grown.qd.shape == (64 * 512, 16, 128)
    assert cache.get(small, cpu).qd.data_ptr() == grown.qd.data_ptr()  # carved from the new buffer
    cache.clear()
    assert cache.snapshot() == {}


def test_warmup_visits_every_selected_k1_variant():
    """``gates`` and ``gated_delta_rule`` select K1 variants (the log decay in both dtypes); K2 once per config, and
    once more in the two-tile prefill's variant where a selected gate runs it (then its K1 is the pair variant)."""
    variants = api.warmup_variants(varlen=(False,), state_modes=(None,), vsplits=(1,),
                                   gates=("safe", "softplus", "none"), gated_delta_rule=True, segments=False)
    bf16, fp32 = torch.bfloat16, torch.float32
    prepares = [(v.gate, v.g_dtype, v.per_head_gate, v.grouped) for v in variants if isinstance(v, PrepareVariant)]
    recurrences = [RecurrenceVariant(1, None, None, False)]
    if any(pair_prefill(gate, per_head, False, 1) for gate, _, per_head, _ in prepares):
        recurrences.append(RecurrenceVariant(1, None, None, False, pairs=True))
    assert [v for v in variants if isinstance(v, RecurrenceVariant)] == recurrences
    assert [v.pairs for v in variants if isinstance(v, PrepareVariant)] == [
        pair_prefill(gate, per_head, False, 1) for gate, _, per_head, _ in prepares]
    assert prepares == [("safe", bf16, False, False), ("softplus", bf16, False, False), ("none", bf16, False, False),
                        ("none", fp32, False, False), ("softplus", bf16, True, True), ("none", bf16, True, True),
                        ("none", fp32, True, True)]
    with pytest.raises(ValueError, match="gate must be one of"):
        api.warmup_variants(gates=("sigmoid",))


def test_warmup_lists_the_pool_prefill_of_each_k2_the_gates_run():
    """A prefill on a pool runs K2's pool variant: the two-tile one for the safe gate where it runs (a split K2: V-split
    4), today's at V-split 1 and for the other gates."""
    bf16 = torch.bfloat16
    pools = lambda gates, split: {v.pairs for v in api.warmup_variants(  # noqa: E731
        varlen=(True,), state_modes=(None,), vsplits=(split,), gates=gates, segments=False, state_pools=(bf16,))
        if isinstance(v, RecurrenceVariant) and v.state_pool}
    assert pools(("safe",), 4) == {SAFE_PAIRS} and pools(("softplus",), 4) == {False}
    assert pools(("safe", "softplus"), 4) == {False, SAFE_PAIRS} and pools(("safe",), 1) == {False}


def test_warmup_lists_the_passes_of_a_recomputation_side_by_side(monkeypatch):
    """Under ``SPLIT_RECOMPUTE`` ``training`` lists the segment passes (varlen K2): the forward's at the call's V-split
    with an fp32 state beside the caller's (an fp16 one widened), the recomputation's at V-split 1 with checkpoints,
    from the caller's state and from an fp32 one; on pairs where ``PAIR_TRAINING`` takes the V-split."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

    def segment_passes(**options):
        return {v for v in api.warmup_variants(varlen=(False,), vsplits=(4,), training=True, segments=False,
                                               **options) if isinstance(v, RecurrenceVariant) and v.varlen}

    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", False)
    assert segment_passes(state_modes=(bf16,)) == set()
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING", False)
    forward = {RecurrenceVariant(4, first, last, True, False) for first, last in ((bf16, fp32), (fp32, fp32),
                                                                                   (fp32, bf16))}
    recompute = {RecurrenceVariant(1, first, None, True, True, token_outputs=not stages.STATES_ONLY_PASSES)
                 for first in (bf16, fp32)}
    assert segment_passes(state_modes=(bf16,)) == forward | recompute
    widened = segment_passes(state_modes=(fp16,), dtypes=(fp16,))
    assert RecurrenceVariant(4, fp32, fp32, True, False, dtype=fp16) in widened
    assert RecurrenceVariant(1, fp16, None, True, True, dtype=fp16,
                             token_outputs=not stages.STATES_ONLY_PASSES) in widened
    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    assert {v.pairs for v in segment_passes(state_modes=(bf16,))} == {False, True}


def test_warmup_with_training_visits_the_backward_variants(monkeypatch):
    """``training``: K2 with checkpoints per config, Kernel A per (V-split of its own, dht, dh0, varlen), Kernel B per
    gate that trains (GatedDeltaNet's also with ``group_sum``); without it none of them."""
    fp32 = torch.float32
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", False)  # its segment passes: listed apart

    def kinds(**options):
        variants = api.warmup_variants(**options)
        return ([v.checkpoints for v in variants if isinstance(v, RecurrenceVariant) and not v.pairs],
                [(v.vsplit, v.dht, v.dh0) for v in variants if isinstance(v, ScanVariant)],
                [(v.gate, v.per_head_gate, v.group_sum) for v in variants if isinstance(v, GradsVariant)])

    assert kinds(varlen=(False,), state_modes=(fp32,), vsplits=(1,), gates=("safe", "softplus"), segments=False) == (
        [False], [], [])
    recurrences, scans, grads = kinds(varlen=(False,), state_modes=(fp32,), vsplits=(1,), gates=("safe", "softplus"),
                                      gated_delta_rule=True, training=True, segments=False)
    assert recurrences == [False, True, True]  # the forward, its training variant, the backward's recomputation
    for states_only in (True, False):  # the recomputation forms no o under STATES_ONLY_PASSES
        monkeypatch.setattr(stages, "STATES_ONLY_PASSES", states_only)
        recompute = [v for v in api.warmup_variants(varlen=(False,), state_modes=(fp32,), vsplits=(1,), training=True,
                                                    segments=False) if isinstance(v, RecurrenceVariant)][-1]
        assert recompute == RecurrenceVariant(1, fp32, None, False, True, token_outputs=not states_only)
    assert sorted(scans, key=repr) == sorted([(1, fp32, fp32), (1, None, fp32)], key=repr)
    # GatedDeltaNet's per-head gate: per value head, and with its pairs of value heads added by Kernel B
    assert sorted(grads) == [("safe", False, False), ("softplus", False, False), ("softplus", True, False),
                             ("softplus", True, True)]
    _, scans, _ = kinds(varlen=(False,), state_modes=(None,), training=True, segments=False)
    assert {v for v, _, _ in scans} == set(SCAN_VSPLITS)  # Kernel A's own V-splits, 8 included


def test_warmup_covers_the_segmented_variants(monkeypatch):
    """``segments`` (on by default): the packed segments' K2 passes (varlen, V-split 1, fp32 states), and with
    ``training`` the checkpoint pass and Kernel A's two passes, the first without token outputs."""
    fp32 = torch.float32
    monkeypatch.setattr(stages, "STATES_ONLY_PASSES", True)
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", False)  # its passes listed apart (the next test but one)
    variants = api.warmup_variants(varlen=(False,), state_modes=(None,), vsplits=(2,))
    states_only = dict(token_outputs=False)  # the passes for the segment states form no o
    assert [v for v in variants if isinstance(v, RecurrenceVariant)] == [
        RecurrenceVariant(2, None, None, False, pairs=SAFE_PAIRS),
        RecurrenceVariant(1, None, fp32, True, **states_only), RecurrenceVariant(1, fp32, fp32, True, **states_only),
        RecurrenceVariant(1, fp32, fp32, True), RecurrenceVariant(1, fp32, None, True)]
    variants = api.warmup_variants(varlen=(False,), state_modes=(None,), vsplits=(2,), training=True)
    recurrences = [v for v in variants if isinstance(v, RecurrenceVariant)]
    scans = [v for v in variants if isinstance(v, ScanVariant)]
    assert recurrences[-3:] == [RecurrenceVariant(1, fp32, fp32, True, True),
                                RecurrenceVariant(1, fp32, None, True, True),
                                RecurrenceVariant(1, fp32, None, True, True, token_outputs=False)]
    assert scans[-3:] == [ScanVariant(1, None, fp32, True, token_outputs=False), ScanVariant(1, fp32, fp32, True),
                          ScanVariant(1, fp32, None, True)]
    combines = [v for v in variants if isinstance(v, CombineVariant)]
    assert combines == [CombineVariant(HEAD_DIM, False, None), CombineVariant(HEAD_DIM, True, None)]
    variants = api.warmup_variants(varlen=(False,), state_modes=(torch.bfloat16, fp32), head_dims=(64,))
    assert [v for v in variants if isinstance(v, CombineVariant)] == [
        CombineVariant(64, False, torch.bfloat16), CombineVariant(64, False, fp32)]


def test_warmup_with_pair_training_lists_the_pair_backward(monkeypatch):
    """Under ``PAIR_TRAINING`` ``training`` adds the two-tile form's backward where its rule takes the V-split: K1's
    pair variant (a per-head gate's also with the partners' fields), the training pair K2 (checkpoints, no final
    state), Kernel A's pair scan and Kernel B's ``pair_rebuild`` (GatedDeltaNet's with ``group_sum`` too); at V-splits
    under the rule's, none of it."""
    fp32 = torch.float32
    options = dict(varlen=(False,), state_modes=(fp32,), gates=("safe", "softplus"), gated_delta_rule=True,
                   training=True, segments=False)
    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    monkeypatch.setattr(stages, "STATES_ONLY_PASSES", False)
    least = stages.PAIR_TRAINING_MIN_VSPLIT["safe"]
    variants = api.warmup_variants(vsplits=(least,), **options)
    assert RecurrenceVariant(least, fp32, None, False, True, pairs=True) in variants
    assert {(v.vsplit, v.dht, v.dh0) for v in variants if isinstance(v, ScanVariant) and v.pairs} == {
        (least, fp32, fp32), (least, None, fp32)}
    assert all(v.snapshot_every == 2 for v in variants if isinstance(v, ScanVariant) and v.pairs)
    assert sorted((v.gate, v.per_head_gate, v.group_sum) for v in variants
                  if isinstance(v, GradsVariant) and v.pair_rebuild) == [
        ("safe", False, False), ("softplus", True, False), ("softplus", True, True)]
    assert any(isinstance(v, PrepareVariant) and v.pairs and v.gate == "safe" for v in variants)
    # the recomputation's K1 pair variant with the pair partners' fields: the per-head gate's only
    assert sorted((v.gate, v.per_head_gate) for v in variants if isinstance(v, PrepareVariant) and v.partner_fields) \
        == [("softplus", True)]
    below = api.warmup_variants(vsplits=(1, 2), **options)
    assert not any(getattr(v, "pair_rebuild", False) or (isinstance(v, ScanVariant) and v.pairs) for v in below)
    monkeypatch.setattr(stages, "STATES_ONLY_PASSES", True)  # the recomputation's pair K2 then forms no o
    assert RecurrenceVariant(least, fp32, None, False, True, pairs=True, token_outputs=False) in api.warmup_variants(
        vsplits=(least,), **options)
    monkeypatch.setattr(stages, "PAIR_TRAINING", False)
    assert not any(getattr(v, "pair_rebuild", False) for v in api.warmup_variants(vsplits=(least,), **options))


def test_warmup_compiles_each_listed_variant_with_its_launcher(monkeypatch):
    from cute_kda.ops import bwd_grads, bwd_scan, prepare, recurrence, segment_combine

    compiled = []
    monkeypatch.setattr(api.torch.cuda, "is_available", lambda: True)
    for module in (prepare, recurrence, bwd_scan, bwd_grads, segment_combine):
        monkeypatch.setattr(module, "compile_variant",
                            lambda variant, device, module=module: compiled.append((module, variant, device)))
    options = dict(varlen=(True,), state_modes=(torch.float32,), vsplits=(2,), gates=("softplus",), training=True)
    count = cute_kda.warmup(device="cuda:0", **options)
    expected = api.warmup_variants(**options)
    assert count == len(expected) and [variant for _, variant, _ in compiled] == expected
    kinds = {PrepareVariant: prepare, RecurrenceVariant: recurrence, ScanVariant: bwd_scan, GradsVariant: bwd_grads,
             CombineVariant: segment_combine}
    assert all(module is kinds[type(variant)] and device == torch.device("cuda", 0)
               for module, variant, device in compiled)


@pytest.mark.parametrize("gate, per_head, grads, inputs", [
    ("safe", False, torch.bfloat16, torch.bfloat16), ("softplus", True, torch.bfloat16, torch.bfloat16),
    ("none", False, torch.bfloat16, torch.bfloat16), ("safe", False, torch.float16, torch.bfloat16),
    ("safe", False, torch.float16, torch.float16), ("safe", False, torch.bfloat16, "pairs"),
    ("softplus", True, torch.bfloat16, "pairs")],
    ids=["safe", "per_head", "per_channel_log_decay", "safe_fp16_grads", "safe_fp16_inputs", "safe_pair_rebuild",
         "per_head_pair_rebuild"])
def test_compile_bwd_grads_builds_the_key_a_call_uses(monkeypatch, gate, per_head, grads, inputs):
    """The ahead-of-time Kernel B compile (``meta`` tensors) hands the same variant to the cache as a call on its
    buffers does; "pairs": the two-tile form's (``pair_rebuild``: pair states, tile a's U, dv, a partner workspace)."""
    import contextlib

    from cute_kda.layouts.bwd_grads import DEFAULT_WARPS
    from cute_kda.ops import bwd_grads as kb

    seen = []
    monkeypatch.setattr(kb, "compiled_variant", lambda variant, index, tensors, options: seen.append(
        (variant, tensors, options)) or (lambda *args: None))
    monkeypatch.setattr(kb, "current_stream", lambda device: "stream")
    monkeypatch.setattr(kb, "device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    pairs = inputs == "pairs"
    inputs = torch.bfloat16 if pairs else inputs
    kb.compile_variant(GradsVariant(True, True, False, gate, inputs, per_head, per_head, DEFAULT_WARPS,
                                    grad_dtype=grads, dtype=inputs, pair_rebuild=pairs,
                                    **kb.switches(gate, per_head, DEFAULT_WARPS)), "cuda:0")
    (variant, tensors, options), = seen
    assert all(t is None or t.device.type == "meta" for t in tensors if isinstance(t, torch.Tensor))
    assert (options["pair"] is not None) == pairs and (not pairs or options["pair"].u_a.device.type == "meta")
    names = ("q", "k", "g", "v", "do", "du", "A_log", "dt_bias", "ws", "states", "state_grads", "dq", "dk", "dg",
             "dbeta", "ddt_partial", "dalog_partial")
    kb.bwd_grads(**dict(zip(names, tensors)), **options, qk_l2norm=True, beta_logits=False, gate=gate)
    assert seen[1][0] == variant


@pytest.mark.parametrize("dv_dtype", [torch.bfloat16, torch.float16], ids=["bf16_dv", "fp16_dv"])
def test_compile_bwd_scan_builds_the_key_a_call_uses(monkeypatch, dv_dtype):
    import contextlib

    from cute_kda.ops import bwd_scan as ka

    seen = []
    monkeypatch.setattr(ka, "compiled_variant", lambda variant, index, tensors: seen.append((variant, tensors)) or (
        lambda *args: None))
    monkeypatch.setattr(ka, "current_stream", lambda device: "stream")
    monkeypatch.setattr(ka, "device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    ka.compile_variant(ScanVariant(8, None, torch.bfloat16, True, dv_dtype=dv_dtype), "cuda:0")
    (variant, tensors), = seen
    assert tensors["do"].device.type == "meta"
    ka.bwd_scan(**tensors, vsplit=8)
    assert seen[1][0] == variant


def test_warmup_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(api.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"warmup\(\) needs a CUDA device"):
        cute_kda.warmup()
    with pytest.raises(ValueError, match="CUDA device, got device=cpu"):
        cute_kda.warmup(device="cpu")


def test_host_path_keeps_what_it_can(monkeypatch):
    """Per-call host work kept across calls: CUstream wrappers per handle, no device switch when the device is
    current."""
    import contextlib

    from cute_kda.ops import _cache

    assert _cache.cu_stream(12345) is _cache.cu_stream(12345)
    assert isinstance(_cache.on_device(torch.device("cuda")), contextlib.nullcontext)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert isinstance(_cache.on_device(torch.device("cuda", 1)), contextlib.nullcontext)
    assert isinstance(_cache.on_device(torch.device("cuda", 0)), torch.cuda.device)


def test_canonical_call_runs_any_forward_and_restores_kv_layout():
    state_vk = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4)
    call = CanonicalCall(tensors=(torch.zeros(1),), options={"flag": 1}, state_k_first=True)
    seen = {}

    def forward(x, **options):
        seen.update(options)
        return x, state_vk

    o, state = call.run(forward)
    assert seen == {"flag": 1}
    assert torch.equal(state, state_vk.transpose(-1, -2)) and state.is_contiguous()


@pytest.fixture
def mirror_kernels(monkeypatch):
    """kda_forward's launch path on the CPU with the mirror standing in for the compiled K1 and K2.

    Exercises the plumbing between validation and the launches (workspace size, tile bases, flags,
    state dtypes, output buffers, K2's real argument tuple) with the variants' real signatures; K1's
    argument bundle is taken as the API hands it over (its conversion is tested with the kernels).
    A test-only seam.
    """
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.reference import mirror, mirror_prepare_gates, tile_bases
    from cute_kda.reference.pairs import (
        PairWorkspace, mirror_prepare_pairs, mirror_prepare_pairs_per_head, mirror_recurrence_pairs,
    )
    from cute_kda.reference.pool import gather_states
    from cute_kda.workspace import Workspace

    launches = []

    from cute_kda.ops import _cache

    class CpuWorkspaces(inference.WorkspaceCache):
        def get(self, spec, device, stream=None):
            assert stream == 7  # the one stream look-up of the call, handed on
            return super().get(spec, device, stream)

    def prepare_variant(variant, index):
        varlen, qk_l2norm, beta_logits, gate, g_dtype, per_head_gate, grouped = (
            variant.varlen, variant.qk_l2norm, variant.beta_logits, variant.gate, variant.g_dtype,
            variant.per_head_gate, variant.grouped)

        def prepare(q, k, g, beta, A_log, dt_bias, tiles, scalars, seq_len, cu_seqlens, tile_base, stream):
            scale, lower_bound = scalars
            ws, cross = tiles  # the seam's workspace_arguments: the fields and the pair variant's cross blocks
            assert (cross is not None) == variant.pairs
            assert stream == ("CUstream", 7)
            assert (cu_seqlens is None) == (tile_base is None) == (not varlen) and seq_len == q.shape[1]
            assert g.dtype == g_dtype and per_head_gate == (g.dim() == 3) and grouped == (beta.shape[2] != q.shape[2])
            if variant.pairs:  # the two-tile prefill's K1, of its scheme
                options = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                               cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits)
                done = (mirror_prepare_pairs_per_head(q, k, g, beta, gate=gate, **options) if per_head_gate
                        else mirror_prepare_pairs(q, k, g, beta, **options))
                filled = done.ws
                for block, value in zip(cross, (done.cross_kd, done.cross_qd)):
                    block.copy_(value)
            elif gate == "safe":
                filled = mirror.mirror_prepare(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                               scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm,
                                               beta_logits=beta_logits)
            else:  # the unbounded gates' K1 (scheme "dyadic"; "per_head" for a per-head gate)
                filled = mirror_prepare_gates(q, k, g, beta, gate=gate, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                              cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
                                              scheme="per_head" if per_head_gate else "dyadic")
            for field, value in zip(ws, filled):
                assert field.shape == value.shape  # the API sized the workspace as K1 fills it
                field.copy_(value)
            launches.append("k1")

        return prepare

    def recurrence_variant(variant, index, arguments):
        vsplit, initial_dtype, final_dtype, varlen = (variant.vsplit, variant.initial_state, variant.final_state,
                                                      variant.varlen)
        assert vsplit in validation_vsplits() and not variant.checkpoints

        def recurrence(v, out, *fields_states_and_bases):
            (*fields, initial_state, final_state, cu_seqlens, tile_base, _, state_indices, checkpoint_indices,
             cross_kd, cross_qd, u_a, stream) = fields_states_and_bases
            assert (cross_kd is not None) == (cross_qd is not None) == variant.pairs and u_a is None

            def run_mirror(**states):
                if variant.pairs:
                    return mirror_recurrence_pairs(PairWorkspace(Workspace(*fields), cross_kd, cross_qd), v,
                                                   cu_seqlens=cu_seqlens, **states)
                return mirror.mirror_recurrence(Workspace(*fields), v, cu_seqlens=cu_seqlens, **states)

            assert stream == ("CUstream", 7)  # K2 launches on the call's one stream look-up too
            assert (cu_seqlens is not None) == varlen and (tile_base is not None) == varlen
            assert (initial_dtype, final_dtype) == tuple(None if s is None else s.dtype
                                                         for s in (initial_state, final_state))
            assert (state_indices is not None) == variant.state_pool
            assert (checkpoint_indices is not None) == (variant.prefix_checkpoint_every > 0)
            if variant.state_pool:  # one pool in and out: gather, the mirror, scatter (prefix checkpoints not emulated)
                assert initial_state is final_state
                k2_pool_launches.append((variant, state_indices, checkpoint_indices))
                entering = gather_states(initial_state, state_indices)
                o, state = run_mirror(initial_state=entering, output_final_state=True, state_dtype=initial_state.dtype)
                out.copy_(o)
                for n, slot in enumerate(state_indices.tolist()):
                    if slot >= 0:
                        final_state[slot] = state[n]
                launches.append("k2")
                return
            o, state = run_mirror(initial_state=initial_state, output_final_state=final_state is not None,
                                  state_dtype=torch.float32 if final_state is None else final_state.dtype)
            out.copy_(o)
            if final_state is not None:
                final_state.copy_(state)
            launches.append("k2")

        return recurrence

    monkeypatch.setattr(api.validation, "check_on_cuda", lambda name, tensor: None)
    monkeypatch.setattr(api.validation, "device_cu_seqlens", lambda cu_seqlens, device, total: cu_seqlens)
    monkeypatch.setattr(inference, "sm_count", lambda index: 132)
    monkeypatch.setattr(inference, "WORKSPACES", CpuWorkspaces())
    monkeypatch.setattr(k1, "tile_bases", lambda cu_seqlens, stream=None: tile_bases(cu_seqlens, 0, 1))
    monkeypatch.setattr(_cache, "current_stream_handle", lambda index: 7)
    monkeypatch.setattr(_cache, "cu_stream", lambda handle: ("CUstream", handle))
    monkeypatch.setattr(k1, "launch", lambda compiled, *arguments: compiled(*arguments))  # K1's arguments as handed
    monkeypatch.setattr(k1, "workspace_arguments", lambda ws, cross=None: (ws, cross))
    monkeypatch.setattr(k2, "workspace_arguments",
                        lambda ws, cross=None: (tuple(ws), (None, None) if cross is None else tuple(cross)))
    monkeypatch.setattr(k1, "fp32_scalars", lambda scale, lower_bound: (scale, lower_bound))
    monkeypatch.setattr(k1, "compiled_variant", prepare_variant)
    monkeypatch.setattr(k2, "compiled_variant", recurrence_variant)
    return launches


def validation_vsplits():
    from cute_kda.validation import SUPPORTED_VSPLITS

    return SUPPORTED_VSPLITS


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the mirror on CPU uses accurate tanh/exp2
@pytest.mark.parametrize("lengths, state", [([40, 40], torch.float32), ([5, 16, 1, 30], torch.bfloat16), ([19], None)])
def test_launch_path_with_mirror_kernels(mirror_kernels, lengths, state):
    inputs = make_inputs(lengths, 2, torch.device("cpu"))
    h0 = None if state is None else initial_state(lengths, 2, state, torch.device("cpu"))
    o, final = cute_kda.kda_forward(**inputs, lower_bound=-3.0, initial_state=h0, output_final_state=True)
    o_ref, final_ref = SAFE_MIRROR(**inputs, lower_bound=-3.0, initial_state=h0, output_final_state=True)
    assert mirror_kernels == ["k1", "k2"]
    assert torch.equal(o, o_ref)
    assert final.dtype == (state or torch.float32) and torch.equal(final, final_ref)


k2_pool_launches: list = []  # (variant, state_indices, checkpoint_indices) of the pool launches the seam saw
SAFE_PAIRS = pair_prefill("safe", False, False, 4)  # a safe-gate prefill of few chains (V-split 4): two tiles a step
SAFE_MIRROR = mirror_forward_pairs if SAFE_PAIRS else mirror_forward  # what a safe-gate prefill computes


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("lengths, dtype", [([40, 40, 40], torch.float32), ([5, 70, 1, 30], torch.bfloat16)])
def test_pool_launch_path_with_mirror_kernels(mirror_kernels, lengths, dtype):
    """A prefill on a state pool goes to K2's pool variant with the pool as its one state tensor and the slot ids as
    given (the seam emulates the kernel by gather → mirror → scatter); prefix checkpoints select their variant."""
    from cute_kda.reference.pool import prefill_on_pool

    inputs = make_inputs(lengths, 2, torch.device("cpu"))
    pool = (0.1 * torch.randn(9, 2, D, D)).to(dtype)
    slots = torch.tensor([7, -1, 0, 3][:len(lengths)], dtype=torch.int32)
    o_ref, pool_ref = prefill_on_pool(SAFE_MIRROR, **inputs, pool=pool, state_indices=slots)
    k2_pool_launches.clear()
    o, state = cute_kda.kda_forward(**inputs, initial_state=pool, state_indices=slots)
    assert state is pool and mirror_kernels == ["k1", "k2"]
    assert torch.equal(o, o_ref) and torch.equal(pool, pool_ref)
    (variant, given_slots, given_checkpoints), = k2_pool_launches
    assert variant.state_pool and variant.prefix_checkpoint_every == 0 and given_slots is slots
    assert given_checkpoints is None and (variant.initial_state, variant.final_state) == (dtype, dtype)
    checkpoints = torch.full((len(lengths), 2), -1, dtype=torch.int32)
    cute_kda.kda_forward(**inputs, initial_state=pool, state_indices=slots, checkpoint_every=128,
                         checkpoint_indices=checkpoints)
    variant, _, given_checkpoints = k2_pool_launches[-1]
    assert variant.prefix_checkpoint_every == 128 and given_checkpoints is checkpoints


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_launch_path_fills_caller_buffers(mirror_kernels):
    inputs = make_inputs([33], 2, torch.device("cpu"), beta_logits=False, normalized_qk=True)
    out = torch.empty_like(inputs["v"])
    final = torch.empty(1, 2, D, D, dtype=torch.bfloat16)
    o, state = cute_kda.kda_forward(**inputs, out=out, final_state=final, beta_logits=False, qk_l2norm=False)
    o_ref, final_ref = SAFE_MIRROR(**inputs, lower_bound=-5.0, output_final_state=True, state_dtype=torch.bfloat16,
                                   beta_logits=False, qk_l2norm=False)
    assert o is out and state is final
    assert torch.equal(out, o_ref) and torch.equal(final, final_ref)


@pytest.mark.parametrize("capability, name", [((8, 0), "A100"), ((10, 0), "B200"), ((12, 0), "RTX 5090")])
def test_device_check_names_the_capability(monkeypatch, capability, name):
    import cute_kda.device

    monkeypatch.setattr(cute_kda.device, "capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"NVIDIA {name}")
    major, minor = capability
    with pytest.raises(RuntimeError, match=rf"built for sm_90a .*cuda:1 is sm_{major}{minor} \(NVIDIA {name}\)"):
        cute_kda.device.check_supported(torch.device("cuda", 1))
    monkeypatch.setattr(cute_kda.device, "capability", lambda index: (9, 0))
    cute_kda.device.check_supported(torch.device("cuda", 1))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_device_is_checked_before_any_compile(mirror_kernels, monkeypatch):
    """The inference executor asks for the device check before it builds (compiles) a launch plan; a refusal
    stops the call there."""
    from cute_kda.ops import prepare as k1

    def refuse(device):
        raise RuntimeError("sm_100")

    monkeypatch.setattr(inference, "check_supported", refuse)
    monkeypatch.setattr(k1, "compiled_variant", lambda *a: pytest.fail("compiled before the device check"))
    inference.WORKSPACES.clear()
    with pytest.raises(RuntimeError, match="sm_100"):
        cute_kda.kda_forward(**make_inputs([40], 2, torch.device("cpu")))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_launch_plans_are_kept_per_configuration(mirror_kernels, monkeypatch):
    """A call's configuration builds its launch plan once (the compiled variants are looked up then, not per
    call) and gives the same results from the kept plan; a flipped ``variants.PAIR_PREFILL`` builds a plan of its
    own (a plan is keyed by the switch its build reads); a larger problem grows the buffer and drops the plans
    on the old one; ``clear`` drops them all."""
    from cute_kda.ops import prepare as k1

    builds = []
    variant = k1.compiled_variant
    monkeypatch.setattr(k1, "compiled_variant", lambda *key: builds.append(key) or variant(*key))
    small, large = (make_inputs(lengths, 2, torch.device("cpu")) for lengths in ([40], [4000]))
    first = cute_kda.kda_forward(**small, output_final_state=True)
    again = cute_kda.kda_forward(**small, output_final_state=True)
    assert len(builds) == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    cute_kda.kda_forward(**small, output_final_state=True, vsplit=2)  # another configuration, the same buffer
    assert len(builds) == 2 and len(inference.WORKSPACES._plans[(None, 7)]) == 2
    default = cute_kda.variants.PAIR_PREFILL
    monkeypatch.setattr(cute_kda.variants, "PAIR_PREFILL", not default)
    cute_kda.kda_forward(**small, output_final_state=True, vsplit=2)  # a plan keeps the switch it was built on
    assert len(builds) == 3 and builds[-1][0].pairs != builds[-2][0].pairs
    monkeypatch.setattr(cute_kda.variants, "PAIR_PREFILL", default)
    cute_kda.kda_forward(**large)
    assert len(builds) == 4 and len(inference.WORKSPACES._plans[(None, 7)]) == 1  # the grown buffer's plan only
    inference.WORKSPACES.clear()
    assert not inference.WORKSPACES._plans
    assert all(torch.equal(a, b) for a, b in zip(first, cute_kda.kda_forward(**small, output_final_state=True)))
    assert len(builds) == 5


def gate_inputs(case: str, lengths, heads, device, seed: int = 0) -> tuple[dict, str]:
    """kda_forward inputs for one unbounded-gate case (docs/numerics.md, "Unbounded gates") and the gate."""
    inputs = make_inputs(lengths, heads, device, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    shape = inputs["g"].shape
    raw = torch.randn(shape, generator=gen, device=device)
    if case == "softplus_kimi_init":  # exp(A_log) ~ U(1, 16), g_raw ~ N(0, 1)
        inputs["A_log"] = torch.log(torch.rand(heads, generator=gen, device=device) * 15 + 1)
        inputs["g"] = raw.bfloat16()
        return inputs, "softplus"
    if case == "softplus_pm1000":  # g_raw of ±1000 and N(0, 1), a third each, A_log = 3
        pick = torch.randint(0, 3, shape, generator=gen, device=device)
        inputs["g"] = torch.where(pick == 0, -1000.0, torch.where(pick == 1, 1000.0, raw)).bfloat16()
        inputs["A_log"] = torch.full((heads,), 3.0, device=device)
        return inputs, "softplus"
    if case == "softplus_low_decay":  # decay ≈ e^−3e-4 a token
        inputs["g"] = (raw * 0.1 - 8.0).bfloat16()
        inputs["A_log"] = torch.zeros(heads, device=device)
        inputs["dt_bias"] = torch.zeros(heads, D, device=device)
        return inputs, "softplus"
    dtype = torch.float32 if case == "log_decay_fp32" else torch.bfloat16
    decay = -torch.nn.functional.softplus(raw) * torch.rand(heads, 1, generator=gen, device=device)
    masked = torch.rand(shape, generator=gen, device=device) < 0.05  # 5 % of the entries at −1000
    inputs["g"] = torch.where(masked, -1000.0, decay).to(dtype)
    inputs["A_log"] = inputs["dt_bias"] = None
    return inputs, "none"


UNBOUNDED_CPU_CASES = {
    "softplus_pm1000": dict(lengths=[40, 40], state=torch.float32),
    "log_decay_fp32": dict(lengths=[5, 16, 1, 30], state=torch.bfloat16),
    "log_decay_bf16": dict(lengths=[19], state=None),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", sorted(UNBOUNDED_CPU_CASES))
def test_unbounded_gates_through_the_launch_path(mirror_kernels, case):
    """The gate reaches K1's variant key and the launch arguments (A_log / dt_bias None for a log decay):
    the API's result equals the mirror's for the same gate, and the gold's to the forward bound."""
    spec = UNBOUNDED_CPU_CASES[case]
    inputs, gate = gate_inputs(case, spec["lengths"], 2, torch.device("cpu"))
    h0 = None if spec["state"] is None else initial_state(spec["lengths"], 2, spec["state"], torch.device("cpu"))
    o, final = cute_kda.kda_forward(**inputs, gate=gate, initial_state=h0, output_final_state=True)
    o_ref, final_ref = mirror_forward(**inputs, lower_bound=-5.0, gate=gate, initial_state=h0,
                                      output_final_state=True)
    assert mirror_kernels == ["k1", "k2"]
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    o_gold, final_gold = gold(inputs, gate=gate, initial_state=h0, output_final_state=True)
    assert rel_rms(o, o_gold) <= GOLD_BOUND and rel_rms(final, final_gold) <= GOLD_BOUND


# ---------------------------------------------------------------------------------------------
# GPU tier


def make_inputs(lengths, heads, device, *, seed=0, beta_logits=True, normalized_qk=False):
    """kda_forward inputs: B equal sequences, or one packed row (with cu_seqlens) when lengths vary."""
    gen = torch.Generator(device=device).manual_seed(seed)
    varlen = len(set(lengths)) > 1
    batch, seq_len = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, k = randn(batch, seq_len, heads, D, dtype=torch.float32), randn(batch, seq_len, heads, D, dtype=torch.float32)
    if normalized_qk:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    beta = randn(batch, seq_len, heads) if beta_logits else torch.rand(
        batch, seq_len, heads, generator=gen, device=device).to(torch.bfloat16)
    inputs = dict(
        q=q.to(torch.bfloat16), k=k.to(torch.bfloat16), v=randn(batch, seq_len, heads, D),
        g=randn(batch, seq_len, heads, D), beta=beta,
        A_log=torch.rand(heads, generator=gen, device=device), dt_bias=randn(heads, D, dtype=torch.float32),
    )
    if varlen:
        inputs["cu_seqlens"] = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64, device=device)
    return inputs


def initial_state(lengths, heads, dtype, device, seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (0.1 * torch.randn(len(lengths), heads, D, D, generator=gen, device=device)).to(dtype)


def gold(inputs, *, gate: str = "safe", **options):
    names = ("q", "k", "v", "g", "beta")
    rest = {name: value for name, value in inputs.items() if name not in names}
    return gold_forward(*(inputs[n] for n in names), **rest, **options, gate=gate, state_layout="vk")


GOLD_CASES = {
    "B2_T100_H4": dict(lengths=[100, 100], heads=4),
    "B1_T1024_H4_fp32_state": dict(lengths=[1024], heads=4, state=torch.float32),
    "B1_T257_H2_bf16_state": dict(lengths=[257], heads=2, state=torch.bfloat16),
    "varlen_short_fp32_state": dict(lengths=[17, 33, 65, 300, 1], heads=4, state=torch.float32),
    "varlen_design_H2_state_out": dict(lengths=[1300, 547, 2048, 963, 271, 3063], heads=2, final_only=True),
    "B1_T300_H2_beta_activated_no_l2norm": dict(lengths=[300], heads=2, beta_logits=False, qk_l2norm=False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GOLD_CASES))
def test_kda_forward_matches_gold(case, device):
    spec = dict(GOLD_CASES[case])
    lengths, heads = spec["lengths"], spec["heads"]
    qk_l2norm, beta_logits = spec.get("qk_l2norm", True), spec.get("beta_logits", True)
    inputs = make_inputs(lengths, heads, device, beta_logits=beta_logits, normalized_qk=not qk_l2norm)
    state_dtype = spec.get("state")
    h0 = None if state_dtype is None else initial_state(lengths, heads, state_dtype, device)
    wants_state = h0 is not None or spec.get("final_only", False)
    o, state = cute_kda.kda_forward(**inputs, initial_state=h0, output_final_state=wants_state,
                                    qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    o_ref, state_ref = gold(inputs, initial_state=h0, output_final_state=wants_state,
                            qk_l2norm=qk_l2norm, beta_logits=beta_logits)
    err_o = rel_rms(o, o_ref)
    line = f"[kda_forward vs gold] {case}: rel-RMS o {err_o:.3e}"
    assert o.dtype == torch.bfloat16 and o.shape == inputs["v"].shape
    if wants_state:
        assert state.dtype == (state_dtype or torch.float32) and state.shape == (len(lengths), heads, D, D)
        err_state = rel_rms(state, state_ref)
        line += f", final state {err_state:.3e}"
        assert err_state <= GOLD_BOUND, line
    else:
        assert state is None
    print(line)
    assert err_o <= GOLD_BOUND, line


UNBOUNDED_GOLD_CASES = {
    "softplus_kimi_init_B2_T100_H4_fp32_state": ("softplus_kimi_init", dict(lengths=[100, 100], heads=4,
                                                                           state=torch.float32)),
    "softplus_pm1000_B1_T257_H2": ("softplus_pm1000", dict(lengths=[257], heads=2, state=torch.float32)),
    "softplus_low_decay_B1_T1024_H2": ("softplus_low_decay", dict(lengths=[1024], heads=2, state=torch.float32)),
    "log_decay_bf16_varlen_empty_1_token": ("log_decay_bf16", dict(lengths=[17, 0, 33, 1, 300], heads=4,
                                                                   state=torch.bfloat16)),
    "log_decay_fp32_B1_T1024_H4": ("log_decay_fp32", dict(lengths=[1024], heads=4, state=None)),
    "log_decay_fp32_varlen_design_H2": ("log_decay_fp32", dict(lengths=[1300, 547, 2048, 963, 271, 3063], heads=2,
                                                               state=torch.float32)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(UNBOUNDED_GOLD_CASES))
def test_unbounded_gates_match_gold(case, device):
    """The softplus gate and a precomputed log decay (±1000, −1000 masks, low decay) against the fp64 gold."""
    gate_case, spec = UNBOUNDED_GOLD_CASES[case]
    inputs, gate = gate_inputs(gate_case, spec["lengths"], spec["heads"], device)
    h0 = None if spec["state"] is None else initial_state(spec["lengths"], spec["heads"], spec["state"], device)
    o, state = cute_kda.kda_forward(**inputs, gate=gate, initial_state=h0, output_final_state=True)
    o_ref, state_ref = gold(inputs, gate=gate, initial_state=h0, output_final_state=True)
    err_o, err_state = rel_rms(o, o_ref), rel_rms(state, state_ref)
    line = f"[kda_forward vs gold] {case}: rel-RMS o {err_o:.3e}, final state {err_state:.3e}"
    print(line)
    assert torch.isfinite(o.float()).all() and torch.isfinite(state.float()).all(), line
    assert err_o <= GOLD_BOUND and err_state <= GOLD_BOUND, line


@pytest.mark.gpu
@pytest.mark.parametrize("vsplit", [1, 2, 4])
def test_every_vsplit_matches_gold(vsplit, device):
    inputs = make_inputs([200], 2, device)
    h0 = initial_state([200], 2, torch.float32, device)
    o, state = cute_kda.kda_forward(**inputs, initial_state=h0, output_final_state=True, vsplit=vsplit)
    o_ref, state_ref = gold(inputs, initial_state=h0, output_final_state=True)
    print(f"[kda_forward vs gold] vsplit={vsplit}: rel-RMS o {rel_rms(o, o_ref):.3e}, state {rel_rms(state, state_ref):.3e}")
    assert rel_rms(o, o_ref) <= GOLD_BOUND and rel_rms(state, state_ref) <= GOLD_BOUND


@pytest.mark.gpu
def test_buffers_are_written_in_place(device):
    inputs = make_inputs([64, 64], 2, device)
    out = torch.full_like(inputs["v"], float("nan"))
    final = torch.full((2, 2, D, D), float("nan"), device=device, dtype=torch.bfloat16)
    o, state = cute_kda.kda_forward(**inputs, out=out, final_state=final)
    assert o is out and state is final
    expected, expected_state = cute_kda.kda_forward(**inputs, output_final_state=True)
    assert torch.equal(out, expected)
    assert torch.equal(final, expected_state.bfloat16())  # the bf16 final state is the fp32 one rounded


@pytest.mark.gpu
def test_cpu_cu_seqlens_equals_device_cu_seqlens(device):
    inputs = make_inputs([40, 7, 90], 2, device)
    on_device, _ = cute_kda.kda_forward(**inputs)
    on_host, _ = cute_kda.kda_forward(**{**inputs, "cu_seqlens": inputs["cu_seqlens"].cpu()})
    assert torch.equal(on_device, on_host)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["device", "host"])
def test_int32_cu_seqlens_equals_int64(device, where):
    """int32 cu_seqlens (FLA's padded batches) give the int64 call's output and final state bit for bit."""
    inputs = make_inputs([40, 0, 7, 90], 2, device)
    expected = cute_kda.kda_forward(**inputs, output_final_state=True)
    narrow = inputs["cu_seqlens"].to(torch.int32)
    got = cute_kda.kda_forward(**{**inputs, "cu_seqlens": narrow if where == "device" else narrow.cpu()},
                               output_final_state=True)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.gpu
def test_debug_checks_read_device_cu_seqlens(device, monkeypatch):
    inputs = make_inputs([40, 7, 90], 2, device)
    inputs["cu_seqlens"] = torch.tensor([0, 40, 30, 137], dtype=torch.int64, device=device)
    monkeypatch.setenv("CUTE_KDA_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match="cu_seqlens must not decrease"):
        cute_kda.kda_forward(**inputs)


@pytest.mark.gpu
def test_workspace_is_reused_and_grows(device):
    key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    inference.WORKSPACES.clear()
    cute_kda.kda_forward(**make_inputs([512], 4, device))
    first = inference.WORKSPACES.snapshot()[key]
    cute_kda.kda_forward(**make_inputs([512], 4, device, seed=3))
    cute_kda.kda_forward(**make_inputs([100], 2, device))
    assert inference.WORKSPACES.snapshot()[key] == first  # same buffer: reused, not shrunk
    cute_kda.kda_forward(**make_inputs([4096], 8, device))
    grown = inference.WORKSPACES.snapshot()[key]
    assert grown[1] > first[1]


def staged_call_on_busy_stream(inputs, launch_stream: torch.cuda.Stream, run):
    """Spin ``launch_stream``, copy the inputs on it after the spin, then ``run`` the forward there.

    Returns (result, whether the stream was still busy when ``run`` returned, whether the default
    stream was idle then). Work issued elsewhere would read the zero-filled staging buffers (a
    non-blocking stream does not wait for the spin) or block the default stream behind it.
    """
    staged = {name: torch.zeros_like(x) for name, x in inputs.items()}
    torch.cuda.synchronize()
    with torch.cuda.stream(launch_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        for name, x in inputs.items():
            staged[name].copy_(x)
        result = run(staged)
        still_busy = not launch_stream.query()
        default_idle = torch.cuda.default_stream().query()
    launch_stream.synchronize()
    return result, still_busy, default_idle


@pytest.mark.gpu
def test_side_stream_is_honoured_without_host_sync(device):
    inputs = make_inputs([300, 20, 180], 4, device)
    expected, _ = cute_kda.kda_forward(**inputs)  # compiles the variant, default stream
    side = torch.cuda.Stream(device)
    o, still_busy, default_idle = staged_call_on_busy_stream(
        inputs, side, lambda staged: cute_kda.kda_forward(**staged)[0])
    assert still_busy, "kda_forward waited for the stream (a host sync in the hot path)"
    assert default_idle, "work was queued behind the side stream on the default stream"
    assert torch.equal(o, expected)


@pytest.mark.gpu
def test_cupy_arrays_give_the_torch_result(device):
    cupy = pytest.importorskip("cupy")
    inputs = make_inputs([130, 61], 2, device)
    h0 = initial_state([130, 61], 2, torch.float32, device)
    expected, expected_state = cute_kda.kda_forward(**inputs, initial_state=h0, output_final_state=True)
    as_cupy = {name: cupy.from_dlpack(x) for name, x in inputs.items()}
    o, state = cute_kda.kda_forward(**as_cupy, initial_state=cupy.from_dlpack(h0), output_final_state=True)
    assert isinstance(o, cupy.ndarray) and isinstance(state, cupy.ndarray)
    assert torch.equal(torch.from_dlpack(o), expected)
    assert torch.equal(torch.from_dlpack(state), expected_state)


@pytest.mark.gpu
def test_cupy_current_stream_is_honoured(device):
    cupy = pytest.importorskip("cupy")
    inputs = make_inputs([256], 2, device)
    expected, _ = cute_kda.kda_forward(**inputs)
    cupy_stream = cupy.cuda.Stream(non_blocking=True)
    launch_stream = torch.cuda.ExternalStream(cupy_stream.ptr, device=device)

    def run(staged):
        with cupy_stream:  # the caller's current CuPy stream; torch's current stream is not consulted
            with torch.cuda.stream(torch.cuda.default_stream(device)):
                return cute_kda.kda_forward(**{name: cupy.from_dlpack(x) for name, x in staged.items()})[0]

    o, still_busy, default_idle = staged_call_on_busy_stream(inputs, launch_stream, run)
    assert still_busy and default_idle
    assert torch.equal(torch.from_dlpack(o), expected)


@pytest.mark.gpu
def test_warmup_compiles_selected_variants(device):
    selection = dict(varlen=(False,), state_modes=(None, torch.float32), vsplits=(1,))
    count = cute_kda.warmup(device=device, **selection)
    assert count == len(api.warmup_variants(**selection))


@pytest.mark.gpu
@pytest.mark.slow
def test_warmup_for_training_leaves_a_step_nothing_to_compile(device):
    """After ``warmup(training=True)`` a training step finds every kernel it launches compiled (the caches do not
    grow)."""
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.ops import bwd_scan as ka
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2

    cute_kda.warmup(device=device, varlen=(False,), state_modes=(torch.float32,), training=True)
    caches = (k1._PREPARE, k2._CACHE, ka._CACHE, kb._CACHE)
    sizes = [len(cache) for cache in caches]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 4, 128, generator=gen).bfloat16().to(device).requires_grad_() for _ in range(3))
    g = torch.randn(1, 300, 4, 128, generator=gen).bfloat16().to(device).requires_grad_()
    beta = torch.randn(1, 300, 4, generator=gen).bfloat16().to(device).requires_grad_()
    h0 = torch.randn(1, 4, 128, 128, generator=gen).to(device).requires_grad_()
    o, ht = cute_kda.kda_forward(q, k, v, g, beta, A_log=torch.zeros(4, device=device),
                                 dt_bias=torch.zeros(4, 128, device=device), initial_state=h0, output_final_state=True)
    (o.float().square().sum() + ht.sum()).backward()
    torch.cuda.synchronize()
    assert [len(cache) for cache in caches] == sizes
