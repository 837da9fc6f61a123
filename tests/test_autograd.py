"""Autograd of ``kda_forward`` / ``chunk_kda`` (the training executor ``cute_kda/executors/training.py``, its
autograd Function and its custom ops).

CPU tier: the ``torch.autograd.Function`` on the reference backend (the mirrors of the kernels,
``REFERENCE``, named by each test) against ``gold_backward`` (fp64 autograd through the token
recurrence) and bit for bit against ``mirror_backward`` (the same chain); which inputs get gradients
(subsets of requires_grad, Kernel B skipped when no token or gate gradient is needed), the final state's
gradient flowing in, initial-state gradients in both layouts and dtypes, varlen with an empty sequence,
FLA's keyword names through ``chunk_kda``'s translation; the errors (double backward, caller buffers,
the public API on CPU tensors); the inference path left alone; the training ops' fake implementations,
their registration (``opcheck``) and a ``torch.compile(fullgraph=True)`` training step on the reference
stages; the FLA verifier taking training calls.

GPU tier: the public API on the kernels against ``gold_backward`` (rel-RMS: dq dk dv dh0 ≤ 8e-3, dg dbeta
≤ 2e-2, dA_log ddt_bias ≤ 8e-3), against the reference backend on the same GPU, two backward runs
bit-identical, the workspace memory released, a compiled training step equal to eager, FLA's dispatch of a
training call.
"""

from __future__ import annotations

import functools
import inspect
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_kda
import cute_kda.context_parallel
from cute_kda import api, fla_backend, validation
from cute_kda.call import INPUT_NAMES
from cute_kda.validation import check_trainable
from cute_kda.executors import inference, stages, training
from cute_kda.reference.backend import REFERENCE
from cute_kda.reference import gold_backward, rel_rms
from cute_kda.reference.backward import mirror_backward
from cute_kda.workspace import (SNAPSHOT_TILES, WorkspaceSpec, block_states_shape, images_to_states, snapshot_slots,
                                states_to_images, tiles_per_head)

from gradient_targets import SAFE_GATE_TOLERANCES as TOLS
from gradient_targets import TARGETS
from test_fla_compat import FLAGS
from test_fla_compat import make_problem as make_fla_problem

pytestmark = pytest.mark.filterwarnings("ignore:cute_kda mirror on CPU:RuntimeWarning")

D = 128
INPUTS = INPUT_NAMES  # q k v g beta A_log dt_bias initial_state
GRAD = dict(zip(INPUTS, ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")))
# rel-RMS vs the fp64 gold: the safe gate's tests hold dA_log to dg's bound (1.1e-2 on B2_T129_H2_no_state below)
REFERENCE_FORWARD = functools.partial(training.kda_forward, backend=REFERENCE)


def make_problem(lengths, heads=2, *, packed=None, state=None, device="cpu", seed=0, beta_logits=True,
                 normalized_qk=False):
    """Canonical inputs (kda_forward's contract): B = len(lengths) equal sequences, or one packed row
    (``cu_seqlens``) when the lengths differ or ``packed``. Gates saturate both ways (g in [-8, 8)); the
    upstream gradients ``do`` (bf16) and ``dht`` (fp32 ``[N, H, V, K]``) come along; ``state``: None or the
    initial state's dtype."""
    gen = torch.Generator().manual_seed(seed)
    packed = len(set(lengths)) > 1 if packed is None else packed
    batch, seq_len = (1, sum(lengths)) if packed else (len(lengths), lengths[0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(batch, seq_len, heads, D), randn(batch, seq_len, heads, D)
    if normalized_qk:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    beta = 2 * randn(batch, seq_len, heads) if beta_logits else torch.rand(batch, seq_len, heads, generator=gen)
    g = torch.rand(batch, seq_len, heads, D, generator=gen) * 16 - 8
    p = dict(q=q, k=k, v=randn(batch, seq_len, heads, D), g=g, beta=beta)
    p = {name: x.to(torch.bfloat16) for name, x in p.items()}
    p.update(A_log=torch.rand(heads, generator=gen) - 0.5, dt_bias=randn(heads, D))
    if state is not None:
        p["initial_state"] = (0.5 * randn(len(lengths), heads, D, D)).to(state)
    if packed:
        p["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    do = randn(batch, seq_len, heads, D).to(torch.bfloat16)
    dht = randn(len(lengths), heads, D, D)
    return {name: x.to(device) for name, x in p.items()}, do.to(device), dht.to(device)


def per_head_gate(problem):
    """Turn :func:`make_problem`'s ``problem`` to GatedDeltaNet's per-head softplus gate, in place: g, ``dt_bias``
    one value a head, ``A_log`` = log(1 + 15·U(0, 1)) a head, on q's device."""
    heads, device = problem["q"].shape[2], problem["q"].device
    problem.update(g=problem["g"][..., 0].contiguous(), A_log=torch.log(1 + 15 * torch.rand(heads, device=device)),
                   dt_bias=problem["dt_bias"][:, 0].contiguous())


def train(forward, problem, *, requires=INPUTS, do=None, dht=None, output_final_state=None, **options):
    """One step: leaves of ``problem`` (those named in ``requires`` require grad), ``forward``, backward of
    ``Σ o·do + Σ ht·dht`` (a None term is left out). Returns (o, ht, {input name: its .grad})."""
    leaves = {name: (x.detach().clone().requires_grad_(name in requires) if x.is_floating_point() else x)
              for name, x in problem.items()}
    q, k, v, g, beta = (leaves.pop(name) for name in ("q", "k", "v", "g", "beta"))
    if output_final_state is None:
        output_final_state = dht is not None
    o, ht = forward(q, k, v, g, beta, output_final_state=output_final_state, **leaves, **options)
    outputs, grads = [], []
    if do is not None:
        outputs, grads = [o], [do]
    if dht is not None:
        outputs, grads = [*outputs, ht], [*grads, dht]
    torch.autograd.backward(outputs, grads)
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, **leaves)
    return o, ht, {name: tensors[name].grad for name in INPUTS if name in tensors}


def gold(problem, do, dht, *, state_layout="vk", **options):
    """``gold_backward`` of the canonical problem (safe gate), keyed by input name."""
    p = dict(problem)
    result = gold_backward(p.pop("q"), p.pop("k"), p.pop("v"), p.pop("g"), p.pop("beta"), do, dht=dht,
                           state_layout=state_layout, **p, **options)
    return {name: result[GRAD[name]] for name in INPUTS if result[GRAD[name]] is not None}


def assert_close_to_gold(grads, expected, problem, label):
    errors = {name: rel_rms(grads[name], expected[name]) for name in expected}
    line = f"[autograd] {label}: " + ", ".join(f"{GRAD[n]} {e:.2e}" for n, e in errors.items())
    print(line)
    for name, error in errors.items():
        assert error <= TOLS[GRAD[name]], line
        assert grads[name].dtype == problem[name].dtype and grads[name].shape == problem[name].shape, name


# ============================================================================ CPU tier

# (lengths, make_problem keywords, options of the call): one row per concern
CASES = {
    "B2_T37_no_state": ([37, 37], {}, {}),
    "B1_T40_fp32_state_dht": ([40], dict(state=torch.float32), dict(dht=True)),
    "varlen_empty_seq_bf16_state_dht": ([20, 0, 17, 5], dict(state=torch.bfloat16), dict(dht=True)),
    "T33_no_l2norm_beta_activated": ([33], dict(state=torch.float32, beta_logits=False, normalized_qk=True),
                                     dict(dht=True, qk_l2norm=False, beta_logits=False, scale=0.25,
                                          lower_bound=-2.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_backend_matches_gold(case):
    lengths, make, options = CASES[case]
    problem, do, dht = make_problem(lengths, **make)
    options = dict(options)
    dht = dht if options.pop("dht", False) else None
    o, ht, grads = train(REFERENCE_FORWARD, problem, do=do, dht=dht, **options)
    assert o.dtype == torch.bfloat16 and (ht is None) == (dht is None)
    assert set(grads) == set(problem) - {"cu_seqlens"}
    assert all(grad.is_contiguous() for grad in grads.values())
    assert_close_to_gold(grads, gold(problem, do, dht, **options), problem, case)


def test_reference_backend_is_the_mirror_chain():
    """The Function on the reference stages computes exactly mirror_backward's chain."""
    problem, do, dht = make_problem([20, 0, 17, 5], state=torch.float32)
    _, _, grads = train(REFERENCE_FORWARD, problem, do=do, dht=dht)
    p = dict(problem)
    expected = mirror_backward(p.pop("q"), p.pop("k"), p.pop("v"), p.pop("g"), p.pop("beta"), do, dht=dht, **p)
    for name in grads:
        assert torch.equal(grads[name], expected[GRAD[name]]), name


class Recording:
    """The reference stages, recording what each is handed."""

    def __init__(self):
        self.calls = []
        self.backend = stages.Backend("recording", self._forward, self._scan, self._grads)

    def _forward(self, x, options, segment_states=None, token_outputs=True):
        self.calls.append(("forward", options, token_outputs))
        return REFERENCE.forward(x, options, segment_states, token_outputs)

    def _scan(self, x, options, saved, do, dht, dh0_dtype, dv_dtype):
        self.calls.append(("scan", do, dht, dh0_dtype))
        return REFERENCE.scan(x, options, saved, do, dht, dh0_dtype, dv_dtype)

    def _grads(self, x, options, saved, do, scan, grad_dtype):
        self.calls.append(("grads",))
        return REFERENCE.grads(x, options, saved, do, scan, grad_dtype)

    def forward(self, *args, **kwargs):
        return training.kda_forward(*args, backend=self.backend, **kwargs)

    def stages(self):
        return [call[0] for call in self.calls]


@pytest.fixture(scope="module")
def full_run():
    """Every input requiring grad, on one problem with an fp32 initial state and dht."""
    problem, do, dht = make_problem([25, 17], state=torch.float32)
    return problem, do, dht, train(REFERENCE_FORWARD, problem, do=do, dht=dht)[2]


SUBSETS = [("v",), ("initial_state",), ("v", "initial_state"), ("q", "A_log"), ("g", "dt_bias", "initial_state"),
           ("beta",), ("k",)]


@pytest.mark.parametrize("subset", SUBSETS, ids="-".join)
def test_requires_grad_subsets(full_run, subset):
    """Only the inputs that require grad get one, equal to the all-inputs run; Kernel B runs only for a
    token or gate gradient, Kernel A asks for dh0 only when initial_state requires grad."""
    problem, do, dht, expected = full_run
    recording = Recording()
    _, _, grads = train(recording.forward, problem, requires=subset, do=do, dht=dht)
    for name in INPUTS:
        if name in subset:
            assert torch.equal(grads[name], expected[name]), name
        else:
            assert grads[name] is None, name
    needs_b = bool(set(subset) - {"v", "initial_state"})
    assert recording.stages() == ["forward", "scan", *(["grads"] if needs_b else [])]
    assert recording.calls[1][3] == (torch.float32 if "initial_state" in subset else None)


@pytest.mark.parametrize("lengths, state", [([25, 17], torch.float32), ([20, 0, 17, 5], torch.bfloat16), ([40], None)],
                         ids=["varlen_fp32_state", "varlen_empty_bf16_state", "no_state"])
def test_recompute_gives_the_same_gradients_and_keeps_nothing(lengths, state):
    """``recompute=True``: the forward keeps no workspace or checkpoints, the backward runs the forward
    stage again (without o or a final state) before the scan, and every gradient equals the default path's."""
    problem, do, dht = make_problem(lengths, state=state)
    dht = dht if state is not None else None
    _, _, expected = train(REFERENCE_FORWARD, problem, do=do, dht=dht)
    recording = Recording()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        _, _, grads = train(recording.forward, problem, do=do, dht=dht, recompute=True)
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name
    assert recording.stages() == ["forward", "forward", "scan", "grads"]
    (_, first, first_outputs), (_, again, again_outputs) = recording.calls[:2]
    assert first.recompute and not again.recompute and again.final_state_dtype is None
    assert first_outputs and not again_outputs
    assert not any(t.dtype == torch.uint8 or t.dim() == 3 and t.shape[-1] == D for t in kept)  # no workspace, states
    if state is not None:
        assert any(t is not None and t.shape == problem["initial_state"].shape for t in kept)  # h0, for the rerun


def test_chunk_kda_maps_fla_disable_recompute():
    """FLA's ``disable_recompute`` keeps its meaning: False (its default) recomputes in the backward."""
    problem, _, _ = make_problem([20])
    p = {name: problem[name] for name in ("q", "k", "v", "g", "beta")}
    fla = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=problem["A_log"],
               dt_bias=problem["dt_bias"])
    assert api.translate_fla_call(*p.values(), **fla).recompute
    assert not api.translate_fla_call(*p.values(), disable_recompute=True, **fla).recompute


def test_no_input_requires_grad_still_records_on_the_reference_path():
    """training.kda_forward always goes through the Function; the outputs do not require grad then."""
    problem, _, _ = make_problem([20])
    o, _ = REFERENCE_FORWARD(**problem)
    assert not o.requires_grad and o.shape == problem["v"].shape


def test_final_state_only_loss():
    """dO is None (the output is unused): the scan gets zeros; the gradients are the gold's with dO = 0."""
    problem, do, dht = make_problem([30], state=torch.float32)
    recording = Recording()
    _, _, grads = train(recording.forward, problem, do=None, dht=dht)
    scan = recording.calls[1]
    assert torch.equal(scan[1], torch.zeros_like(do)) and torch.equal(scan[2], dht)
    assert_close_to_gold(grads, gold(problem, torch.zeros_like(do), dht), problem, "final state only")


def test_unused_final_state_gives_no_dht():
    problem, do, _ = make_problem([30], state=torch.bfloat16)
    recording = Recording()
    _, ht, grads = train(recording.forward, problem, do=do, output_final_state=True)
    assert ht is not None and ht.dtype == torch.bfloat16 and recording.calls[1][2] is None
    assert_close_to_gold(grads, gold(problem, do, None), problem, "unused final state")


def test_upstream_gradients_of_any_layout_reach_the_kernels_dense():
    """A non-contiguous dO and a misaligned dht arrive contiguous and 16-byte aligned."""
    problem, do, dht = make_problem([20], state=torch.float32)
    recording = Recording()
    leaves = {name: x.clone().requires_grad_() for name, x in problem.items()}
    o, ht = recording.forward(**leaves, output_final_state=True)
    strided_do = do.transpose(1, 2).contiguous().transpose(1, 2)
    padded = torch.cat([torch.zeros(1, dtype=torch.float32), dht.flatten()])
    offset_dht = padded[1:].view_as(dht)  # 4 bytes past an aligned start
    assert not strided_do.is_contiguous() and offset_dht.data_ptr() % 16
    torch.autograd.backward([o, ht], [strided_do, offset_dht])
    _, seen_do, seen_dht, _ = recording.calls[1]
    assert seen_do.is_contiguous() and torch.equal(seen_do, do)
    assert seen_dht.is_contiguous() and seen_dht.data_ptr() % 16 == 0 and torch.equal(seen_dht, dht)


def test_inputs_that_are_not_leaves():
    problem, do, _ = make_problem([20])
    x = problem["q"].float().requires_grad_()
    o, _ = REFERENCE_FORWARD(x.bfloat16() * 2, *(problem[n] for n in ("k", "v", "g", "beta")),
                             A_log=problem["A_log"], dt_bias=problem["dt_bias"])
    o.backward(do)
    p = dict(problem, q=problem["q"] * 2)
    expected = gold(p, do, None)["q"] * 2
    assert x.grad.dtype == torch.float32 and rel_rms(x.grad, expected) <= TOLS["dq"]


# --------------------------------------------------------------------------- the kernel stages' wiring

@pytest.fixture
def launchers_on_mirrors(monkeypatch):
    """The kernel backend on the CPU: each launcher it calls (K1, the tile bases, K2, Kernel A, Kernel B)
    replaced by its mirror, after binding the call to the real launcher's signature and, for Kernel A and
    Kernel B, running the real launcher's buffer checks. Kernel B takes no raw beta (β comes from the
    workspace), so its mirror gets the problem's beta from ``fakes.beta``. The two-tile form's launches (``cross``,
    ``u_a``, ``pair``: ``stages.PAIR_TRAINING``) run the pair mirrors."""
    from cute_kda.ops import bwd_grads as kb
    from cute_kda.ops import bwd_scan as ka
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.reference import mirror, mirror_bwd_scan, mirror_prepare_gates, tile_bases
    from cute_kda.reference.backward import mirror_bwd_grads
    from cute_kda.reference.pair_backward import tile_states_of_pairs
    from cute_kda.reference.common import token_tile_map
    from cute_kda.reference.pairs import (
        PairWorkspace, mirror_bwd_scan_pairs, mirror_prepare_pairs, mirror_prepare_pairs_per_head,
        mirror_recurrence_pairs, pair_roles,
    )
    from cute_kda.workspace import PartnerFields, pair_blocks_shape, pair_u_shape

    fakes = type("Fakes", (), {"calls": [], "beta": None, "cu_seqlens_dtypes": [], "k2_outputs": [],
                               "segment_vsplits": []})()

    def fake(module, name):
        signature = inspect.signature(getattr(module, name))

        def install(body):
            def launcher(*args, **kwargs):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                fakes.calls.append(name)
                if bound.arguments.get("cu_seqlens") is not None:
                    fakes.cu_seqlens_dtypes.append(bound.arguments["cu_seqlens"].dtype)
                return body(**bound.arguments)

            monkeypatch.setattr(module, name, launcher)

        return install

    def num_seqs(x, cu_seqlens):
        return x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1

    @fake(k1, "tile_bases")
    def _(cu_seqlens, stream):
        return tile_bases(cu_seqlens, 0, 1)

    @fake(k1, "prepare")
    def _(q, k, g, beta, A_log, dt_bias, ws, scale, lower_bound, cu_seqlens, tile_base, qk_l2norm, beta_logits,
          gate, stream, cross, partners):
        per_head = g.dim() == 3  # the safe gate, or GatedDeltaNet's per-head one
        assert gate == ("softplus" if per_head else "safe")
        assert tile_base is None if cu_seqlens is None else torch.equal(tile_base, tile_bases(cu_seqlens, 0, 1))
        options = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, cu_seqlens=cu_seqlens, qk_l2norm=qk_l2norm,
                       beta_logits=beta_logits)
        if per_head:
            today = mirror_prepare_gates(q, k, g, beta, scheme="per_head", gate=gate, **options)
            pairs = None if cross is None else mirror_prepare_pairs_per_head(q, k, g, beta, gate=gate, **options)
        else:
            today = mirror.mirror_prepare(q, k, g, beta, lower_bound=lower_bound, **options)
            pairs = None if cross is None else mirror_prepare_pairs(q, k, g, beta, lower_bound=lower_bound, **options)
        fields = today if cross is None else pairs.ws
        for field, value in zip((*ws, *(cross or ())), (*fields, *(() if cross is None else pairs[1:]))):
            field.copy_(value)
        if partners is not None:  # the kernel's slots: tile b's qd, kd, the others' kr, every tile's gT
            tile_map = token_tile_map(q, cu_seqlens)
            is_b = pair_roles(tile_map, tile_map.slot_exists.numel())[1]
            owned = dict(qd=is_b, kd=is_b, kr=tile_map.slot_exists & ~is_b, gt=tile_map.slot_exists)
            for name, where in owned.items():
                where = where.repeat(beta.shape[2])
                getattr(partners, name)[where] = getattr(today, name)[where]

    @fake(k2, "recurrence")
    def _(v, ws, out, cu_seqlens, tile_base, initial_state, final_state, vsplit, checkpoints, cross, u_a, stream):
        assert vsplit is None or vsplit in validation.SUPPORTED_VSPLITS
        if tile_base is not None and v.shape[0] == 1 and cu_seqlens.numel() == 2 and \
                not (cu_seqlens[0] == 0 and cu_seqlens[1] == v.shape[1]):
            return segment_of_one_sequence(v, ws, out, cu_seqlens, tile_base, initial_state, final_state, vsplit,
                                           checkpoints, cross, u_a)
        recurrence_on_mirrors(v, ws, out, cu_seqlens, initial_state, final_state, checkpoints, cross, u_a)

    def segment_of_one_sequence(v, ws, out, cu_seqlens, tile_base, initial_state, final_state, vsplit, checkpoints,
                                cross, u_a):
        """A pass over one segment of a sequence (``stages.chain_in_segments``: its token and tile bounds, the unsplit
        workspace, kept rows and o): the mirror on the segment alone, its kept rows and o put where the kernel puts
        them (the segment's tiles, the sequence's slots)."""
        (first, end), (tile0, tile_end) = cu_seqlens.tolist(), tile_base.tolist()
        heads, tiles = v.shape[2], ws.qd.shape[0] // v.shape[2]
        fakes.segment_vsplits.append(vsplit)

        def part(t):  # the segment's tiles of every head
            return t.view(heads, tiles, *t.shape[1:])[:, tile0:tile_end].reshape(-1, *t.shape[1:])

        part_ws = type(ws)(*(part(t) for t in ws))
        part_cross = None if cross is None else type(cross)(*(part(t) for t in cross))
        part_kept = part_u = None
        if checkpoints is not None:
            shape = block_states_shape if cross is None else pair_blocks_shape
            part_kept = checkpoints.new_empty(shape(part_ws, heads, 1))
            part_u = None if u_a is None else u_a.new_empty(pair_u_shape(part_ws, heads, 1))
        part_out = None if out is None else out.new_empty((1, end - first, *out.shape[2:]))
        recurrence_on_mirrors(v[:, first:end], part_ws, part_out, None, initial_state, final_state, part_kept,
                              part_cross, part_u)
        if part_out is not None:
            out[:, first:end] = part_out
        # the segment's slot t is the sequence's slot tile0 + t (a pair's: tile0 / 2 + t, tile0 even)
        offset, owned = (tile0, tile_end - tile0) if cross is None else (tile0 // 2, (tile_end - tile0 + 1) // 2)
        for whole, piece in ((checkpoints, part_kept), (u_a, part_u)):
            if piece is not None:
                whole.view(heads, -1, *whole.shape[1:])[:, offset:offset + owned] = \
                    piece.view(heads, -1, *piece.shape[1:])[:, :owned]

    def recurrence_on_mirrors(v, ws, out, cu_seqlens, initial_state, final_state, checkpoints, cross, u_a):
        # the two-tile chain keeps tile a's U beside its checkpoints (PAIR_TRAINING's recomputation), as the
        # launcher says
        assert (u_a is not None) == (cross is not None and checkpoints is not None)
        assert out is not None or checkpoints is not None or final_state is not None  # the launcher's own rule
        fakes.k2_outputs.append(out is not None)
        kept = None
        if checkpoints is not None:  # the training pass (a segmented call's extra passes keep none)
            assert checkpoints.dtype == torch.bfloat16
            shape = block_states_shape if cross is None else pair_blocks_shape
            assert checkpoints.shape == shape(ws, v.shape[2], num_seqs(v, cu_seqlens))
            kept = torch.full_like(checkpoints, float("nan"))
        common = dict(cu_seqlens=cu_seqlens, initial_state=initial_state, output_final_state=final_state is not None,
                      state_dtype=torch.float32 if final_state is None else final_state.dtype, checkpoints=kept)
        if cross is None:
            o, state = mirror.mirror_recurrence(ws, v, **common)
        else:
            o, state = mirror_recurrence_pairs(PairWorkspace(ws, *cross), v, u_a=u_a, **common)
        if kept is not None:
            written = ~kept.isnan().flatten(1).all(1)  # the kernel keeps state images, in the rows it owns
            checkpoints[written] = states_to_images(kept[written])
        if out is not None:  # a pass for its states alone forms no o
            out.copy_(o)
        if final_state is not None:
            final_state.copy_(state)

    @fake(ka, "bwd_scan")
    def _(do, ws, dv, du, snapshots, cu_seqlens, tile_base, dht, dh0, vsplit, tuning, token_outputs, snapshot_every,
          cross):
        # Kernel B reads a snapshot a tile (today's scan), or a pair in the two-tile form
        assert snapshot_every == (SNAPSHOT_TILES if cross is None else 2)
        ka._check_buffers(do, ws, dv, du, snapshots, dht, dh0, num_seqs(do, cu_seqlens), snapshot_every,
                          cross is not None)
        if cross is None:
            scan = mirror_bwd_scan(ws, do, cu_seqlens=cu_seqlens, dht=dht, snapshot_every=snapshot_every,
                                   dh0_dtype=torch.float32 if dh0 is None else dh0.dtype)
        else:
            kept = torch.full(snapshots.shape, float("nan"), dtype=torch.bfloat16)
            result = mirror_bwd_scan_pairs(PairWorkspace(ws, *cross), do, cu_seqlens=cu_seqlens, dht=dht,
                                           snapshots=kept)
            scan = types.SimpleNamespace(dv=result.dv, du=result.du, dh0=result.dh0, snapshots=kept)
        outputs = ((dv, scan.dv), (du, scan.du), (snapshots, states_to_images(scan.snapshots))) if token_outputs \
            else ()  # without token outputs the kernel writes dh0 alone
        for buffer, value in (*outputs, (dh0, scan.dh0)):
            if buffer is not None:
                buffer.copy_(value)

    @fake(kb, "bwd_grads")
    def _(q, k, g, v, do, du, ws, states, state_grads, A_log, dt_bias, dq, dk, dg, dbeta, ddt_partial,
          dalog_partial, scale, lower_bound, cu_seqlens, tile_base, qk_l2norm, beta_logits, compute_warps, gate,
          pair):
        assert compute_warps is None  # the autograd layer leaves the tuning knob at its default
        assert gate == ("softplus" if g.dim() == 3 else "safe")
        kb._check_buffers(q, k, g, v, do, du, ws, states, state_grads, dq, dk, dg, dbeta, ddt_partial,
                          dalog_partial, num_seqs(q, cu_seqlens), gate, pair)
        states, state_grads = images_to_states(states), images_to_states(state_grads)
        if pair is not None:  # the kernel rebuilds each tile's other end from the pair's matrices
            states, state_grads = tile_states_of_pairs(pair.ws, states, state_grads, pair.u_a, do, pair.dv,
                                                       cu_seqlens=cu_seqlens)
            if isinstance(pair.ws, PartnerFields):  # ws is the pair workspace
                # the kernel takes INV and β of it and forms each tile's own qd, kd, kr, gT, which the per-head gate's
                # mirror reads from its workspace: those of the pair workspace where the pair leaves them, else the
                # partner fields'
                is_b = pair_roles(token_tile_map(q, cu_seqlens), ws.gt.shape[0] // v.shape[2])[1].repeat(v.shape[2])
                ws = ws._replace(**{name: torch.where(is_b.view(-1, *[1] * (own.dim() - 1)) == (name in ("qd", "kd")),
                                                      getattr(pair.ws, name), own)
                                    for name, own in zip(("qd", "kd", "kr", "gt"), ws[:4])})
        grads = mirror_bwd_grads(q, k, g, fakes.beta, v, do, du, ws, states, state_grads, A_log=A_log,
                                 dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                                 qk_l2norm=qk_l2norm, beta_logits=beta_logits, gate=gate)
        for buffer, value in ((dq, grads.dq), (dk, grads.dk), (dg, grads.dg), (dbeta, grads.dbeta)):
            buffer.copy_(value)
        ddt_partial.zero_()[:, 0] = grads.ddt_bias  # the whole sum in the first tile's slot
        dalog_partial.zero_()[:, 0] = grads.dA_log

    monkeypatch.setattr(validation, "check_on_cuda", lambda name, tensor: None)
    monkeypatch.setattr(cute_kda.context_parallel, "sm_count", lambda index: 132)
    return fakes


@pytest.mark.parametrize("lengths,state", [([20, 0, 17, 5], torch.bfloat16), ([33, 33], torch.float32),
                                           ([24], None)], ids=["varlen_bf16", "B2_fp32", "B1_no_state"])
def test_kernel_stages_hand_the_launchers_what_they_check(launchers_on_mirrors, lengths, state):
    """KERNELS' forward, scan and grads: the launchers' signatures, their buffer checks, the gradients each
    output becomes (bit for bit the reference backend's chain)."""
    problem, do, dht = make_problem(lengths, state=state)
    dht = dht if state is not None else None
    launchers_on_mirrors.beta = problem["beta"]
    _, _, grads = train(functools.partial(training.kda_forward, backend=stages.KERNELS), problem, do=do, dht=dht)
    _, _, expected = train(REFERENCE_FORWARD, problem, do=do, dht=dht)
    varlen = "cu_seqlens" in problem
    assert launchers_on_mirrors.calls == [*(["tile_bases"] if varlen else []), "prepare", "recurrence", "bwd_scan",
                                          "bwd_grads"]
    assert launchers_on_mirrors.k2_outputs == [True]
    for name in expected:
        assert grads[name].dtype == expected[name].dtype and torch.equal(grads[name], expected[name]), name


@pytest.mark.parametrize("states_only", [True, False], ids=["states_only", "with_o"])
def test_kernel_stages_recompute_without_o(launchers_on_mirrors, monkeypatch, states_only):
    """A recomputing step on the kernel backend: under ``STATES_ONLY_PASSES`` the backward's K2 pass keeps its
    checkpoints and forms no o (the launcher gets ``out=None``), else it writes o to a scratch; the gradients are the
    reference backend's, bit for bit, either way."""
    monkeypatch.setattr(stages, "STATES_ONLY_PASSES", states_only)
    problem, do, dht = make_problem([25, 17], state=torch.float32)
    launchers_on_mirrors.beta = problem["beta"]
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    _, _, grads = train(forward, problem, do=do, dht=dht, recompute=True)
    _, _, expected = train(REFERENCE_FORWARD, problem, do=do, dht=dht, recompute=True)
    # the recomputation reuses the forward's tile bases
    assert launchers_on_mirrors.calls == ["tile_bases", "prepare", "recurrence", "prepare", "recurrence", "bwd_scan",
                                          "bwd_grads"]
    assert launchers_on_mirrors.k2_outputs == [True, not states_only]
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name


# the two-tile training form (stages.PAIR_TRAINING): a V-split that takes it, cases with a pair whose tile b is
# partial, lone tiles (full and partial), an empty sequence, with and without an initial state
PAIR_CASES = {"varlen_bf16": ([20, 0, 48, 5, 70], torch.bfloat16), "B2_fp32": ([50, 50], torch.float32),
              "B1_no_state": ([33], None)}


@pytest.mark.parametrize("case", sorted(PAIR_CASES))
def test_pair_training_is_the_pair_mirror_chain(monkeypatch, case):
    """The reference backend under ``PAIR_TRAINING`` (a recomputing step, the V-split of the rule): every gradient
    is :func:`~cute_kda.reference.pair_backward.mirror_backward_pairs`' bit for bit (the pair form's chain) and within
    the gold's bounds; o is the pair chain's, as the inference prefill forms it; a keeping call, a V-split under the
    rule's and the switch off stay per tile."""
    from cute_kda.reference.pair_backward import mirror_backward_pairs
    from cute_kda.reference.pairs import mirror_prepare_pairs, mirror_recurrence_pairs

    lengths, state = PAIR_CASES[case]
    problem, do, dht = make_problem(lengths, state=state)
    dht = dht if state is not None else None
    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    vsplit = stages.PAIR_TRAINING_MIN_VSPLIT["safe"]
    o, _, grads = train(REFERENCE_FORWARD, problem, do=do, dht=dht, recompute=True, vsplit=vsplit)
    p = dict(problem)
    dht_as_given = None if dht is None else dht.to(state)  # autograd hands dht over in the final state's dtype
    expected = mirror_backward_pairs(p.pop("q"), p.pop("k"), p.pop("v"), p.pop("g"), p.pop("beta"), do,
                                     dht=dht_as_given, **p)
    for name in grads:
        assert torch.equal(grads[name], expected[GRAD[name]].to(grads[name].dtype)), name
    assert_close_to_gold(grads, gold(problem, do, dht), problem, f"pairs {case}")
    p = dict(problem)
    chain = mirror_prepare_pairs(p["q"], p["k"], p["g"], p["beta"], A_log=p["A_log"], dt_bias=p["dt_bias"],
                                 cu_seqlens=p.get("cu_seqlens"))
    o_pairs, _ = mirror_recurrence_pairs(chain, p["v"], cu_seqlens=p.get("cu_seqlens"),
                                         initial_state=p.get("initial_state"), state_layout="vk")
    assert torch.equal(o.detach(), o_pairs)
    _, _, per_tile = train(REFERENCE_FORWARD, problem, do=do, dht=dht, recompute=True, vsplit=vsplit // 2)
    _, _, kept = train(REFERENCE_FORWARD, problem, do=do, dht=dht, vsplit=vsplit)
    monkeypatch.setattr(stages, "PAIR_TRAINING", False)
    _, _, off = train(REFERENCE_FORWARD, problem, do=do, dht=dht, recompute=True, vsplit=vsplit)
    assert all(torch.equal(per_tile[n], kept[n]) and torch.equal(per_tile[n], off[n]) for n in per_tile)
    assert any(not torch.equal(per_tile[n], grads[n]) for n in grads)  # the pair form's rounding differs


@pytest.mark.parametrize("states_only", [False, True], ids=["with_o", "states_only"])
def test_kernel_stages_train_on_pairs(launchers_on_mirrors, monkeypatch, states_only):
    """A recomputing step on the kernel backend under ``PAIR_TRAINING``: the forward runs the pair chain (K1's and K2's
    pair variants), the backward it again keeping a state and U_a a pair (without o under ``STATES_ONLY_PASSES``), K1,
    Kernel A's pair scan and Kernel B's rebuild (the launchers' checks pass); o and the gradients are the reference
    backend's pair form's, bit for bit."""
    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    monkeypatch.setattr(stages, "STATES_ONLY_PASSES", states_only)
    problem, do, dht = make_problem([20, 0, 48, 5, 70], state=torch.float32)
    launchers_on_mirrors.beta = problem["beta"]
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    options = dict(do=do, dht=dht, recompute=True, vsplit=stages.PAIR_TRAINING_MIN_VSPLIT["safe"])
    o, _, grads = train(forward, problem, **options)
    o_expected, _, expected = train(REFERENCE_FORWARD, problem, **options)
    assert launchers_on_mirrors.calls == ["tile_bases", "prepare", "recurrence", "prepare", "recurrence", "prepare",
                                          "bwd_scan", "bwd_grads"]
    assert launchers_on_mirrors.k2_outputs == [True, not states_only]
    assert torch.equal(o, o_expected)
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the mirrors on the CPU use accurate tanh / exp2 / log2
@pytest.mark.parametrize("partner_fields", [True, False], ids=["partner_fields", "second_k1"])
@pytest.mark.parametrize("states_only", [False, True], ids=["with_o", "states_only"])
def test_kernel_stages_train_per_head_gates_on_pairs(launchers_on_mirrors, monkeypatch, states_only, partner_fields):
    """GatedDeltaNet's per-head gate under ``PAIR_TRAINING``: the recomputation's K1 pair variant also writes the pair
    partners' fields (``partners``), so no per-tile K1 runs in the backward and Kernel B reads INV and β of the pair
    workspace (without ``PARTNER_FIELDS``, K1 once more); o and the gradients are the reference backend's (which
    recomputes per tile), bit for bit."""
    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    monkeypatch.setattr(stages, "STATES_ONLY_PASSES", states_only)
    monkeypatch.setattr(stages, "PARTNER_FIELDS", partner_fields)
    problem, do, dht = make_problem([20, 0, 48, 5, 70], state=torch.float32)
    per_head_gate(problem)
    launchers_on_mirrors.beta = problem["beta"]
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    options = dict(do=do, dht=dht, recompute=True, vsplit=stages.PAIR_TRAINING_MIN_VSPLIT["per_head"], gate="softplus")
    o, _, grads = train(forward, problem, **options)
    o_expected, _, expected = train(REFERENCE_FORWARD, problem, **options)
    again = [] if partner_fields else ["prepare"]
    assert launchers_on_mirrors.calls == ["tile_bases", "prepare", "recurrence", "prepare", "recurrence", *again,
                                          "bwd_scan", "bwd_grads"]
    assert launchers_on_mirrors.k2_outputs == [True, not states_only]
    assert torch.equal(o, o_expected)
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name


# the recomputation side by side (stages.SPLIT_RECOMPUTE): B1 T250 (16 tiles, the last partial) on 8 SMs of two
# heads, segments of at least 2 tiles: four segments of 4 tiles
SPLIT_FORMS = {"per_tile": ("safe", False), "pairs_safe": ("safe", True), "pairs_per_head": ("softplus", True)}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the mirrors on the CPU use accurate tanh / exp2 / log2
@pytest.mark.parametrize("state", [None, torch.float32, torch.bfloat16], ids=["no_state", "fp32", "bf16"])
@pytest.mark.parametrize("form", sorted(SPLIT_FORMS))
def test_kernel_stages_recompute_side_by_side(launchers_on_mirrors, monkeypatch, form, state):
    """A recomputing call of one sequence under ``SPLIT_RECOMPUTE``: the forward runs K2 a segment after the other
    (each a call over the segment's bounds, the call's V-split), the backward's recomputation the segments side by
    side at V-split 1 from the kept states; o, the final state and every gradient are the unsplit call's (the
    reference backend's) bit for bit, per tile and on pairs."""
    gate, pairs = SPLIT_FORMS[form]
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING", pairs)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    monkeypatch.setattr(stages, "available_sms", lambda device: 8)
    monkeypatch.setattr(cute_kda.context_parallel, "MIN_SEGMENT_TILES", 2)
    problem, do, dht = make_problem([250], state=state)
    options = dict(do=do, dht=dht if state is not None else None, recompute=True)
    if gate == "softplus":  # GatedDeltaNet's per-head gate
        per_head_gate(problem)
        options.update(gate="softplus")
    if pairs:
        options.update(vsplit=stages.PAIR_TRAINING_MIN_VSPLIT["safe" if gate == "safe" else "per_head"])
    launchers_on_mirrors.beta = problem["beta"]
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    o, ht, grads = train(forward, problem, **options)
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", False)
    o_expected, ht_expected, expected = train(REFERENCE_FORWARD, problem, **options)
    second_k1 = ["prepare"] if pairs and gate == "safe" else []
    assert launchers_on_mirrors.calls == ["prepare", *["recurrence"] * 4, "prepare", *["recurrence"] * 4,
                                          *second_k1, "bwd_scan", "bwd_grads"]
    assert launchers_on_mirrors.segment_vsplits == [options.get("vsplit")] * 4 + [1] * 4
    assert torch.equal(o, o_expected)
    assert (ht is None) == (ht_expected is None) and (ht is None or torch.equal(ht, ht_expected))
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name


def test_recompute_split_rule(monkeypatch):
    """Which calls recompute side by side: one fixed-length sequence, unsplit, recomputing, whose chains leave room for
    ``RECOMPUTE_MIN_SEGMENTS`` segments of an even number of tiles, at least ``MIN_SEGMENT_TILES``; kept states must
    fit."""
    from cute_kda.call import options_of
    from cute_kda.validation import ProblemShape

    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", True)
    monkeypatch.setattr(stages, "available_sms", lambda device: 132)
    cpu = torch.device("cpu")

    def split(batch=1, seq_len=32768, heads=32, varlen=False, recompute=True, segments=1):
        problem = ProblemShape(batch, seq_len, heads, 128, batch, varlen)
        options = options_of(problem, cpu, None, -5.0, True, True, None, None, recompute, "safe", segments)
        return stages.recompute_split(options, cpu)

    gdn = split()  # GatedDeltaNet B1 T32768 HV32: four segments of 512 tiles
    assert (gdn.count, gdn.length) == (4, 512 * 16)
    assert split(seq_len=8192, heads=16).count == 8
    assert split(seq_len=4112).length == 66 * 16  # 257 tiles: quarters of 65 rounded to even
    # fewer than RECOMPUTE_MIN_SEGMENTS segments: too many chains (KDA B1 T8192 H64, H96), too few tiles
    for refused in (dict(heads=64), dict(heads=96), dict(batch=2), dict(varlen=True), dict(recompute=False),
                    dict(seq_len=4080)):
        assert split(**refused) is None, refused
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", False)
    assert split() is None
    problem = ProblemShape(1, 32768, 32, 128, 1, False)
    options = options_of(problem, cpu, None, -5.0, True, True, None, None, False, "safe", 1)
    kept = torch.empty(1, 3, 32, 128, 128)
    assert stages.recompute_split(options, cpu, kept) == gdn  # the backward follows the forward's kept states
    with pytest.raises(ValueError, match="do not fit"):
        stages.recompute_split(options, cpu, kept[:, :2])


def test_kernel_stages_take_int32_cu_seqlens_as_int64(launchers_on_mirrors):
    """An int32 cu_seqlens reaches every launcher widened to int64, and the step is the int64 call's, bit for bit."""
    problem, do, dht = make_problem([20, 0, 17, 5], state=torch.bfloat16)
    launchers_on_mirrors.beta = problem["beta"]
    forward = functools.partial(training.kda_forward, backend=stages.KERNELS)
    o, ht, expected = train(forward, problem, do=do, dht=dht)
    launchers_on_mirrors.cu_seqlens_dtypes.clear()
    narrow = {**problem, "cu_seqlens": problem["cu_seqlens"].to(torch.int32)}
    o32, ht32, grads = train(forward, narrow, do=do, dht=dht)
    assert launchers_on_mirrors.cu_seqlens_dtypes == [torch.int64] * 5  # tile prefix, K1, K2, Kernel A, Kernel B
    assert torch.equal(o32, o) and torch.equal(ht32, ht)
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name


@pytest.mark.parametrize("states_only", [True, False], ids=["states_only", "with_o"])
@pytest.mark.parametrize("lengths,state,recompute", [([48, 48], torch.float32, False), ([40], None, True)],
                         ids=["B2_fp32", "B1_no_state_recompute"])
def test_kernel_stages_of_a_segmented_call(launchers_on_mirrors, monkeypatch, lengths, state, recompute, states_only):
    """A segmented call on the kernel backend: the launchers see the packed segments (K2 three times in the
    forward, once more in a recomputing backward — under ``STATES_ONLY_PASSES`` the forward's two passes for the
    segment states and the recomputation without o —, Kernel A twice, the first without token outputs; no tile-prefix
    launch: the segmentation's tile bases are known on the host), and every gradient is the reference backend's, bit
    for bit."""
    monkeypatch.setattr(stages, "STATES_ONLY_PASSES", states_only)
    problem, do, dht = make_problem(lengths, state=state)
    dht = dht if state is not None else None
    launchers_on_mirrors.beta = problem["beta"].reshape(1, -1, problem["beta"].shape[2])
    options = dict(segments=3, recompute=recompute)
    o, ht, grads = train(functools.partial(training.kda_forward, backend=stages.KERNELS), problem, do=do, dht=dht,
                         **options)
    o_ref, ht_ref, expected = train(REFERENCE_FORWARD, problem, do=do, dht=dht, **options)
    forward = ["prepare", "recurrence", "recurrence", "recurrence"]  # the tile bases come from the host
    again = ["prepare", "recurrence"] if recompute else []
    assert launchers_on_mirrors.calls == [*forward, *again, "bwd_scan", "bwd_scan", "bwd_grads"]
    unread = not states_only  # a pass whose o nobody reads
    assert launchers_on_mirrors.k2_outputs == [unread, unread, True, *([unread] if recompute else [])]
    assert torch.equal(o, o_ref) and (ht is None or torch.equal(ht, ht_ref))
    for name in expected:
        assert grads[name].dtype == expected[name].dtype and torch.equal(grads[name], expected[name]), name


@pytest.mark.parametrize("state", [None, torch.bfloat16], ids=["no_state", "bf16_state"])
def test_segmented_inference_path(launchers_on_mirrors, state):
    """The public inference call split into segments (mirrored launchers on the CPU): the reference's split forward
    bit for bit, the final state in the initial state's dtype (fp32 without one), and caller buffers filled."""
    problem, _, _ = make_problem([48, 48], state=state)
    with torch.no_grad():
        o, ht = cute_kda.kda_forward(**problem, output_final_state=True, segments=3)
        o_ref, ht_ref = REFERENCE_FORWARD(**problem, output_final_state=True, segments=3)
        out, final = torch.empty_like(o), torch.empty_like(ht)
        o_buf, ht_buf = cute_kda.kda_forward(**problem, out=out, final_state=final, segments=3)
    assert ht.dtype == (state or torch.float32) and ht.shape == (2, 2, D, D) and ht.is_contiguous()
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    assert o_buf is out and ht_buf is final and torch.equal(out, o) and torch.equal(final, ht)


# --------------------------------------------------------------------------- chunk_kda's translation

# (FLA problem keywords, chunk_kda keywords): FLA's names, each state layout
FLA_CASES = {
    "kv_state": (dict(lengths=[37], state="kv"), dict(output_final_state=True)),
    "v_first_state": (dict(lengths=[21, 21], state="vk"), dict(output_final_state=True, state_v_first=True)),
    "transpose_state_layout": (dict(lengths=[19], state="vk"), dict(output_final_state=True,
                                                                    transpose_state_layout=True)),
    "varlen_kv_state": (dict(lengths=[5, 16, 1, 17], state="kv"), dict(output_final_state=True)),
    "varlen_no_state": (dict(lengths=[9, 33]), dict(lower_bound=-3.0)),
    "beta_activated_no_l2norm": (dict(lengths=[23], beta_logits=False, normalized_qk=True),
                                 dict(use_beta_sigmoid_in_kernel=False, use_qk_l2norm_in_kernel=False, scale=0.3)),
}


@pytest.mark.parametrize("case", sorted(FLA_CASES))
def test_chunk_kda_translation_matches_gold(case):
    """FLA's keywords through chunk_kda's translation and the Function: every gradient in the caller's
    shape, dtype and layout (A_log [H], dt_bias [H*K], states [N, H, K, V] unless state_v_first)."""
    make, extra = FLA_CASES[case]
    inputs = make_fla_problem(**make, seed=3)
    kwargs = {**FLAGS, **extra}
    v_first = kwargs.get("state_v_first", False) or kwargs.get("transpose_state_layout", False)
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(inputs["v"].shape, generator=gen).bfloat16()
    states = kwargs.get("output_final_state", False)
    dht = torch.randn(len(make["lengths"]), inputs["q"].shape[2], D, D, generator=gen) if states else None
    leaves = {n: x.clone().requires_grad_() if x.is_floating_point() else x for n, x in inputs.items()}
    o, ht = api.translate_fla_call(**leaves, **kwargs).run(REFERENCE_FORWARD)
    assert ht is None if dht is None else (ht.dtype == torch.float32 and ht.shape == dht.shape)
    torch.autograd.backward([o] + ([ht] if dht is not None else []), [do] + ([dht] if dht is not None else []))
    grads = {n: leaves[n].grad for n in inputs if n != "cu_seqlens"}

    p = dict(inputs)
    expected = gold_backward(
        p.pop("q"), p.pop("k"), p.pop("v"), p.pop("g"), p.pop("beta"), do, dht=dht, scale=kwargs.get("scale"),
        A_log=p.pop("A_log"), dt_bias=p.pop("dt_bias"), lower_bound=kwargs["lower_bound"],
        qk_l2norm=kwargs["use_qk_l2norm_in_kernel"], beta_logits=kwargs["use_beta_sigmoid_in_kernel"],
        initial_state=p.pop("initial_state", None), state_layout="vk" if v_first else "kv",
        cu_seqlens=p.pop("cu_seqlens", None),
    )
    expected = {n: expected[GRAD[n]] for n in grads}
    assert_close_to_gold(grads, expected, inputs, f"chunk_kda {case}")
    assert grads["dt_bias"].shape == (inputs["q"].shape[2] * D,)


def test_chunk_kda_without_A_log_and_dt_bias():
    inputs = make_fla_problem([20], seed=5)
    del inputs["A_log"], inputs["dt_bias"]
    leaves = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    o, _ = api.translate_fla_call(**leaves, **FLAGS).run(REFERENCE_FORWARD)
    o.float().sum().backward()
    assert all(leaves[n].grad is not None and leaves[n].grad.dtype == torch.bfloat16 for n in leaves)


# --------------------------------------------------------------------------- what is refused

def test_double_backward_is_refused():
    problem, do, _ = make_problem([20])
    q = problem["q"].clone().requires_grad_()
    o, _ = REFERENCE_FORWARD(q, *(problem[n] for n in ("k", "v", "g", "beta")), A_log=problem["A_log"],
                             dt_bias=problem["dt_bias"])
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad((o.float() * do.float()).sum(), q, create_graph=True)


@pytest.mark.parametrize("buffers", [("out",), ("final_state",), ("out", "final_state")], ids="+".join)
def test_caller_buffers_are_refused_under_autograd(buffers):
    problem, _, _ = make_problem([20])
    given = dict(out=torch.empty_like(problem["v"]), final_state=torch.empty(1, 2, D, D))
    q = problem.pop("q").requires_grad_()
    with pytest.raises(NotImplementedError, match=" and ".join(buffers) + "= buffer"):
        REFERENCE_FORWARD(q, **problem, **{b: given[b] for b in buffers})


def test_public_api_on_cpu_still_needs_cuda():
    """The public entries never take the reference stages: CPU tensors that require grad get the device error."""
    problem, _, _ = make_problem([20])
    problem["k"].requires_grad_()
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        cute_kda.kda_forward(**problem)
    inputs = make_fla_problem([20], state="kv")
    inputs["initial_state"].requires_grad_()
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        cute_kda.chunk_kda(**FLAGS, **inputs, output_final_state=True)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        training.kda_forward(**problem, backend=stages.KERNELS)


def test_unsupported_flags_are_refused_under_grad():
    inputs = make_fla_problem([20])
    inputs["q"].requires_grad_()
    with pytest.raises(NotImplementedError, match="allow_neg_eigval"):
        cute_kda.chunk_kda(**FLAGS, allow_neg_eigval=True, **inputs)
    q = torch.zeros(1, 20, 1, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 20, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="grouped value heads .* with the safe gate have no backward"):
        check_trainable("safe", q, v)
    for gate in ("softplus", "none"):  # the unbounded gates train with grouped value heads
        check_trainable(gate, q, v)


def test_per_channel_unbounded_gates_take_the_autograd_path(recorded_training):
    """chunk_kda's per-channel softplus gate and log decay under grad go to the kernels' training path (Kernel B's
    dyadic variant)."""
    inputs = make_fla_problem([20])
    inputs["q"].requires_grad_()
    cute_kda.chunk_kda(**{**FLAGS, "use_gate_in_kernel": False}, **inputs)
    cute_kda.chunk_kda(**{**FLAGS, "lower_bound": None, "safe_gate": False}, **inputs)
    assert [(backend, call.options.gate) for backend, call in recorded_training] == [
        (stages.KERNELS, "none"), (stages.KERNELS, "softplus")]


@pytest.fixture
def recorded_training(monkeypatch):
    """api's training entry replaced by a recorder (no kernels needed)."""
    calls = []

    def record(backend, call):
        calls.append((backend, call))
        return "recorded", None

    monkeypatch.setattr(training, "train", record)
    return calls


def test_public_api_routes_recorded_calls_to_the_kernels(recorded_training):
    problem, _, _ = make_problem([20])
    problem["A_log"].requires_grad_()
    assert cute_kda.kda_forward(**problem) == ("recorded", None)
    (backend, call), = recorded_training
    assert backend is stages.KERNELS and call.training and call.options.problem.seq_len == 20
    assert call.options.final_state_dtype is None


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "detached"])
def test_inference_calls_keep_the_inference_path(recorded_training, mode):
    problem, _, _ = make_problem([20])
    if mode != "detached":
        problem["q"].requires_grad_()
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with context(), pytest.raises(ValueError, match="CUDA device"):
        cute_kda.kda_forward(**problem)
    assert recorded_training == []


def test_needs_autograd():
    t = torch.zeros(1, requires_grad=True)
    assert validation.needs_autograd(None, torch.zeros(1), t)
    assert not validation.needs_autograd(None, torch.zeros(1), 3.0)
    with torch.no_grad():
        assert not validation.needs_autograd(t)


# --------------------------------------------------------------------------- torch.library ops

def _fake_inputs(varlen, heads=3):
    batch, tokens = (1, 70) if varlen else (2, 35)
    q = torch.empty(batch, tokens, heads, D, dtype=torch.bfloat16)
    beta = torch.empty(batch, tokens, heads, dtype=torch.bfloat16)
    cu = torch.empty(5, dtype=torch.int64) if varlen else None
    return q, beta, cu, torch.empty(heads), torch.empty(heads, D)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.float32], ids=["none", "bf16", "fp32"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_forward_train_fake_shapes(varlen, state_dtype, recompute):
    """The final state takes the initial state's dtype (``state_dtype``; None: no state in or out)."""
    with FakeTensorMode():
        q, beta, cu, A_log, dt_bias = _fake_inputs(varlen)
        batch, tokens, heads = q.shape[:3]
        num_seqs = 4 if varlen else batch
        h0 = None if state_dtype is None else torch.empty(num_seqs, heads, D, D, dtype=state_dtype)
        o, state, ws, checkpoints, tile_base, segment_states = torch.ops.cute_kda.forward_train(
            q, q, q, q, beta, A_log, dt_bias, h0, cu, 0.1, -5.0, state_dtype is not None, None, True, True, recompute,
            "safe", None)
    tiles = tiles_per_head(batch * tokens, num_seqs, varlen)
    assert o.shape == q.shape and o.dtype == torch.bfloat16
    assert (state.numel() == 0) if state_dtype is None else (state.shape == (num_seqs, heads, D, D)
                                                              and state.dtype == state_dtype)
    assert ws.dtype == torch.uint8 and checkpoints.dtype == torch.bfloat16
    if recompute:  # nothing kept: the backward recomputes it
        assert ws.numel() == 0 and checkpoints.numel() == 0
    else:
        assert ws.shape == (WorkspaceSpec(heads=heads, tiles=tiles).nbytes,)
        assert checkpoints.shape == (heads * snapshot_slots(tiles, num_seqs), D, D)
    assert tile_base.dtype == torch.int32 and tile_base.shape == ((num_seqs + 1,) if varlen else (0,))
    assert segment_states.numel() == 0  # a call on the CPU is split only when it asks


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_forward_train_fake_shapes_of_a_segmented_call(recompute):
    """Segments ask for the packed problem's workspace, checkpoints and tile_base (2 × 35 tokens in segments of
    16: 3 a sequence), and the segment states."""
    with FakeTensorMode():
        q, beta, cu, A_log, dt_bias = _fake_inputs(False)
        o, state, ws, checkpoints, tile_base, segment_states = torch.ops.cute_kda.forward_train(
            q, q, q, q, beta, A_log, dt_bias, None, cu, 0.1, -5.0, True, None, True, True, recompute, "safe", 3)
    heads, segments = q.shape[2], 6
    tiles = tiles_per_head(70, segments, True)
    assert o.shape == q.shape and state.shape == (2, heads, D, D)
    assert segment_states.shape == (2, segments, heads, D, D) and segment_states.dtype == torch.float32
    assert tile_base.shape == (segments + 1,)
    if not recompute:
        assert ws.shape == (WorkspaceSpec(heads=heads, tiles=tiles).nbytes,)
        assert checkpoints.shape == (heads * snapshot_slots(tiles, segments), D, D)


def test_forward_train_fake_shapes_of_a_recomputation_side_by_side(monkeypatch):
    """A recomputing call of one sequence that the backward recomputes side by side (``stages.recompute_split``: here
    B1 T250 of two heads on 8 SMs, four segments) keeps the fp32 states entering segments 1 … 3, as the op's fake
    says; the same call keeping its states keeps none of them."""
    monkeypatch.setattr(stages, "available_sms", lambda device: 8)
    monkeypatch.setattr(cute_kda.context_parallel, "MIN_SEGMENT_TILES", 2)
    for recompute in (True, False):
        with FakeTensorMode():
            q, beta = torch.empty(1, 250, 2, D, dtype=torch.bfloat16), torch.empty(1, 250, 2, dtype=torch.bfloat16)
            *_, segment_states = torch.ops.cute_kda.forward_train(
                q, q, q, q, beta, torch.empty(2), torch.empty(2, D), None, None, 0.1, -5.0, True, None, True, True,
                recompute, "safe", None)
        expected = (1, 3, 2, D, D) if recompute else (0,)
        assert segment_states.shape == expected and segment_states.dtype == torch.float32


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("dh0_dtype", [None, torch.bfloat16, torch.float32], ids=["no_dh0", "bf16", "fp32"])
@pytest.mark.parametrize("token_grads", [False, True], ids=["scan_only", "token_grads"])
def test_backward_fake_shapes(varlen, dh0_dtype, token_grads):
    with FakeTensorMode():
        q, beta, cu, A_log, dt_bias = _fake_inputs(varlen)
        ws, checkpoints = torch.empty(64, dtype=torch.uint8), torch.empty(8, D, D, dtype=torch.bfloat16)
        tile_base = torch.empty(5, dtype=torch.int32) if varlen else None
        grads = torch.ops.cute_kda.backward(q, None, q, q, q, q, beta, A_log, dt_bias, None, cu, ws, checkpoints,
                                            tile_base, None, 0.1, -5.0, True, True, dh0_dtype, token_grads, False,
                                            "safe", None, None)
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = grads
    assert dv.shape == q.shape and dv.dtype == torch.bfloat16
    for grad, like in ((dq, q), (dk, q), (dg, q), (dbeta, beta), (dA_log, A_log), (ddt_bias, dt_bias)):
        assert (grad.shape == like.shape and grad.dtype == like.dtype) if token_grads else grad.numel() == 0
    num_seqs = 4 if varlen else q.shape[0]
    assert dh0.numel() == 0 if dh0_dtype is None else (dh0.shape == (num_seqs, 3, D, D) and dh0.dtype == dh0_dtype)


@pytest.fixture
def reference_ops(monkeypatch):
    """The training ops on the reference stages (the kernels need a GPU)."""
    monkeypatch.setattr(training, "_stages", lambda: REFERENCE)


def _op_arguments(problem, recompute=False, segments=0):
    p = problem
    return (*(p[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), p.get("initial_state"),
            p.get("cu_seqlens"), D ** -0.5, -5.0, True, None, True, True, recompute, p.get("gate", "safe"),
            segments or None)


OP_PROBLEMS = {"varlen": ([20, 17], 0), "segmented": ([40, 40], 2)}  # (lengths, segments)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("case", sorted(OP_PROBLEMS))
def test_opcheck_forward_train(reference_ops, recompute, case):
    lengths, segments = OP_PROBLEMS[case]
    problem, _, _ = make_problem(lengths, state=torch.float32)
    leaves = {n: x.requires_grad_() if x.is_floating_point() else x for n, x in problem.items()}
    # no test_aot_dispatch: checkpoint slots that are no tile hold NaN, which never compares equal
    torch.library.opcheck(training.forward_train_op, _op_arguments(leaves, recompute, segments),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("case", sorted(OP_PROBLEMS))
def test_opcheck_backward(reference_ops, recompute, case):
    lengths, segments = OP_PROBLEMS[case]
    problem, do, dht = make_problem(lengths, state=torch.bfloat16)
    _, _, ws, checkpoints, tile_base, segment_states = training.forward_train_op(
        *_op_arguments(problem, recompute, segments))
    p = problem
    args = (do, dht, *(p[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), p["initial_state"],
            p.get("cu_seqlens"), ws, checkpoints, tile_base if tile_base.numel() else None,
            segment_states if segment_states.numel() else None, D ** -0.5, -5.0, True, True, torch.bfloat16, True,
            recompute, "safe", None, segments or None)
    torch.library.opcheck(training.backward_op, args)


class Graphs:
    """An aot_autograd backend that records the forward and backward graphs and runs them as they are."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.forward, self.backward = [], []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward))

    @staticmethod
    def _keep(graphs):
        from torch._functorch.aot_autograd import make_boxed_func

        def compiler(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    @staticmethod
    def count(graphs, target):
        return sum(str(node.target) == target for gm in graphs for node in gm.graph.nodes)


def _step(forward, do, dht):
    def step(q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True)
        return (o.float() * do.float()).sum() + (ht * dht).sum()

    return step


def _grads_of(step, problem):
    leaves = [problem[n].detach().clone().requires_grad_() for n in INPUTS]
    step(*leaves).backward()
    return [leaf.grad for leaf in leaves]


def test_compiled_training_step_is_one_op_each_way(reference_ops):
    problem, do, dht = make_problem([40], state=torch.float32)
    eager = _grads_of(_step(REFERENCE_FORWARD, do, dht), problem)
    graphs = Graphs()
    compiled = _grads_of(torch.compile(_step(cute_kda.kda_forward, do, dht), fullgraph=True, backend=graphs.backend),
                         problem)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert Graphs.count(graphs.forward, "cute_kda.forward_train.default") == 1
    assert Graphs.count(graphs.backward, "cute_kda.backward.default") == 1


def test_compiled_segmented_training_step(reference_ops):
    """A split call under torch.compile: still one op each way, the segments reaching the ops, the gradients the
    eager split call's bit for bit."""
    problem, do, dht = make_problem([40, 40], state=torch.float32)
    eager = _grads_of(_step(functools.partial(REFERENCE_FORWARD, segments=3), do, dht), problem)
    graphs = Graphs()
    step = _step(functools.partial(cute_kda.kda_forward, segments=3), do, dht)
    compiled = _grads_of(torch.compile(step, fullgraph=True, backend=graphs.backend), problem)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert Graphs.count(graphs.forward, "cute_kda.forward_train.default") == 1
    assert Graphs.count(graphs.backward, "cute_kda.backward.default") == 1
    unsplit = _grads_of(_step(REFERENCE_FORWARD, do, dht), problem)
    assert any(not torch.equal(a, b) for a, b in zip(eager, unsplit))  # the split reached the stages


def test_compiled_training_step_across_sizes(reference_ops):
    """With dynamic shapes the fake implementations size the workspace and checkpoints symbolically: one
    compiled step serves varlen batches of other lengths and counts."""
    def step(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, do, dht):
        o, ht = cute_kda.kda_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                     output_final_state=True, cu_seqlens=cu_seqlens)
        return (o.float() * do.float()).sum() + (ht * dht).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for lengths in ([20, 17], [30, 5, 9]):
        problem, do, dht = make_problem(lengths, state=torch.float32)
        grads = []
        for fn in (compiled, _step_varlen_eager):
            leaves = [problem[n].detach().clone().requires_grad_() for n in INPUTS]
            fn(*leaves, problem["cu_seqlens"], do, dht).backward()
            grads.append([leaf.grad for leaf in leaves])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), lengths


def _step_varlen_eager(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, do, dht):
    o, ht = REFERENCE_FORWARD(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                              output_final_state=True, cu_seqlens=cu_seqlens)
    return (o.float() * do.float()).sum() + (ht * dht).sum()


def test_compiled_chunk_kda_training_step(reference_ops):
    inputs = make_fla_problem([17, 30], state="kv", seed=6)

    def step(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens):
        o, ht = cute_kda.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                   output_final_state=True, cu_seqlens=cu_seqlens, **FLAGS)
        return o.float().square().sum() + ht.sum()

    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

    def grads(fn):
        leaves = [inputs[n].clone().requires_grad_() for n in names]
        fn(*leaves, inputs["cu_seqlens"]).backward()
        return [leaf.grad for leaf in leaves]

    def eager_step(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens):
        o, ht = api.translate_fla_call(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                       output_final_state=True, cu_seqlens=cu_seqlens, **FLAGS).run(REFERENCE_FORWARD)
        return o.float().square().sum() + ht.sum()

    for a, b in zip(grads(eager_step), grads(torch.compile(step, fullgraph=True, backend="aot_eager"))):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_compiled_call_refuses_buffers_under_grad(reference_ops):
    problem, _, _ = make_problem([20])
    problem["q"].requires_grad_()
    out = torch.empty_like(problem["v"])
    with pytest.raises(Exception, match="out= buffer is not supported"):
        torch.compile(lambda: cute_kda.kda_forward(**problem, out=out), fullgraph=True, backend="eager")()


def _ops_forward(q, k, v, g, beta, *, scale=None, A_log, dt_bias, lower_bound=-5.0, initial_state=None,
                 output_final_state=False, cu_seqlens=None, qk_l2norm=True, beta_logits=True):
    """The traced path's ``kda_forward`` (the training ops), called eagerly."""
    return api._traced(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                 initial_state=initial_state, output_final_state=output_final_state,
                                 cu_seqlens=cu_seqlens, out=None, final_state=None, vsplit=None, qk_l2norm=qk_l2norm,
                                 beta_logits=beta_logits)


@pytest.mark.parametrize("subset", [("v", "initial_state"), ("g", "A_log"), INPUTS], ids="-".join)
def test_op_path_gradient_subsets(reference_ops, full_run, subset):
    """Through the ops' registered autograd, only the inputs that require grad get one, equal to the
    Function's."""
    problem, do, dht, expected = full_run
    _, _, grads = train(_ops_forward, problem, requires=subset, do=do, dht=dht)
    for name in INPUTS:
        assert (grads[name] is None) if name not in subset else torch.equal(grads[name], expected[name]), name


def test_op_backward_refuses_double_backward(reference_ops):
    problem, do, _ = make_problem([20])
    q = problem.pop("q").requires_grad_()
    o, _ = _ops_forward(q, *(problem.pop(n) for n in ("k", "v", "g", "beta")), **problem)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad((o.float() * do.float()).sum(), q, create_graph=True)


# --------------------------------------------------------------------------- FLA's dispatch

def test_fla_verifier_takes_training_calls(monkeypatch):
    monkeypatch.setattr(fla_backend, "_device_reason", lambda q: None)
    inputs = make_fla_problem([40], state="kv")
    inputs["q"].requires_grad_()
    inputs["A_log"].requires_grad_()
    kwargs = dict(**inputs, output_final_state=True, **FLAGS)
    assert fla_backend.verify(**kwargs) == (True, None)
    with torch.no_grad():
        assert fla_backend.verify(**kwargs) == (True, None)


# ============================================================================ GPU tier

GPU_CASES = {
    "B1_T300_H4_fp32_state": (dict(lengths=[300], heads=4, state=torch.float32), dict(dht=True)),
    "varlen_empty_and_short_bf16_state": (dict(lengths=[300, 0, 57, 1, 200], heads=4, state=torch.bfloat16),
                                          dict(dht=True)),
    "B2_T129_H2_no_state": (dict(lengths=[129, 129], heads=2), {}),
    "B1_T200_no_l2norm_beta_activated": (dict(lengths=[200], heads=2, state=torch.float32, beta_logits=False,
                                              normalized_qk=True),
                                         dict(dht=True, qk_l2norm=False, beta_logits=False, scale=0.2,
                                              lower_bound=-1.0)),
}


def _gpu_case(case, device):
    make, options = GPU_CASES[case]
    problem, do, dht = make_problem(**make, device=device, seed=11)
    if "cu_seqlens" in problem:
        problem["cu_seqlens"] = problem["cu_seqlens"].to(device)
    options = dict(options)
    return problem, do, dht if options.pop("dht", False) else None, options


def _cpu(problem):
    return {n: x.cpu() for n, x in problem.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_public_api_matches_gold(case, device):
    problem, do, dht, options = _gpu_case(case, device)
    _, _, grads = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    torch.cuda.synchronize()
    expected = gold(_cpu(problem), do.cpu(), None if dht is None else dht.cpu(), **options)
    assert_close_to_gold({n: g.cpu() for n, g in grads.items()}, expected, _cpu(problem), case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_kernels_near_the_reference_backend(case, device):
    """The kernels against the mirrors of their rounding on the same GPU (bit-faithful intrinsics there)."""
    problem, do, dht, options = _gpu_case(case, device)
    _, _, grads = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    _, _, mirrored = train(REFERENCE_FORWARD, problem, do=do, dht=dht, **options)
    torch.cuda.synchronize()
    assert_close_to_gold(grads, mirrored, problem, f"{case} vs reference backend")


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_pair_training_on_the_kernels(case, device, monkeypatch):
    """``PAIR_TRAINING`` (a recomputing step at the rule's V-split): the kernels' two-tile backward near the reference
    backend's (the pair mirrors, ``tile_states_of_pairs``) within the gold's bounds, the gold's bounds held, the same
    bits twice; o the inference call's (the two-tile prefill) bit for bit."""
    monkeypatch.setattr(stages, "PAIR_TRAINING", True)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    problem, do, dht, options = _gpu_case(case, device)
    options = dict(options, recompute=True, vsplit=stages.PAIR_TRAINING_MIN_VSPLIT["safe"])
    o, _, grads = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    again = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)[2]
    _, _, mirrored = train(REFERENCE_FORWARD, problem, do=do, dht=dht, **options)
    with torch.no_grad():
        o_inference, _ = cute_kda.kda_forward(*(problem[n] for n in ("q", "k", "v", "g", "beta")), **{
            n: x for n, x in problem.items() if n not in ("q", "k", "v", "g", "beta")},
            **{n: x for n, x in options.items() if n != "recompute"})
    torch.cuda.synchronize()
    assert torch.equal(o.detach(), o_inference)
    assert all(torch.equal(grads[n], again[n]) for n in grads)
    assert_close_to_gold(grads, mirrored, problem, f"{case} pairs vs reference backend")
    expected = gold(_cpu(problem), do.cpu(), None if dht is None else dht.cpu(), **{
        n: x for n, x in options.items() if n not in ("recompute", "vsplit")})
    assert_close_to_gold({n: g.cpu() for n, g in grads.items()}, expected, _cpu(problem), f"{case} pairs")


# the recomputation side by side on the kernels: B1 T4100 (257 tiles, the last partial) of two heads: four segments
# of 64 or 66 tiles on any GPU of 8 SMs or more
SPLIT_GPU_CASES = {"per_tile_fp32": ("safe", False, torch.float32), "per_tile_bf16_no_state": ("safe", False, None),
                   "pairs_safe_bf16": ("safe", True, torch.bfloat16), "pairs_per_head_fp32": ("softplus", True,
                                                                                                torch.float32),
                   "per_tile_fp16": ("safe", False, torch.float16)}  # fp16 inputs and states


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SPLIT_GPU_CASES))
def test_recompute_side_by_side_is_the_unsplit_call(case, device, monkeypatch):
    """``SPLIT_RECOMPUTE`` on the kernels: the forward's K2 a segment after the other, the backward's recomputation
    side by side (a stream a segment, V-split 1); o, the final state and every gradient the unsplit recomputing
    call's, bit for bit (per tile and on pairs, under ``PAIR_TRAINING``)."""
    gate, pairs, state = SPLIT_GPU_CASES[case]
    monkeypatch.setattr(stages, "PAIR_TRAINING", pairs)
    monkeypatch.setattr(stages, "PAIR_TRAINING_SCHEMES", ("safe", "per_head"))
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", False)  # the unsplit baseline (on by default)
    problem, do, dht = make_problem([4100], state=state, device=device)
    if state == torch.float16:  # an fp16 call: its states beside the fp32 ones widened, the final one rounded back
        problem.update({n: problem[n].half() for n in ("q", "k", "v", "g")})
        do, dht = do.half(), dht.half()
    options = dict(do=do, dht=dht if state is not None else None, recompute=True)
    if gate == "softplus":
        per_head_gate(problem)
        options.update(gate="softplus")
    if pairs:
        options.update(vsplit=stages.PAIR_TRAINING_MIN_VSPLIT["safe" if gate == "safe" else "per_head"])
    o_unsplit, ht_unsplit, unsplit = train(cute_kda.kda_forward, problem, **options)
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", True)
    split = stages.recompute_split(resolve_options(problem, options), torch.device(device))
    assert split is not None and split.count == 4
    o, ht, grads = train(cute_kda.kda_forward, problem, **options)
    torch.cuda.synchronize()
    assert torch.equal(o, o_unsplit)
    assert (ht is None) == (ht_unsplit is None) and (ht is None or torch.equal(ht, ht_unsplit))
    for name in unsplit:
        assert torch.equal(grads[name], unsplit[name]), name


# recomputing training steps whose host paths could hide a synchronisation: the recomputation side by side (side
# streams), packed sequences whose bounds live on the device, a segmented call, the per-head gate's two-tile form
NO_SYNC_CASES = {"side_by_side": ([4100], {}), "packed_on_device": ([300, 17, 700], {}),
                 "segmented": ([4100], dict(segments=4)),
                 "per_head_pairs": ([600], dict(gate="softplus", vsplit=stages.PAIR_TRAINING_MIN_VSPLIT["per_head"]))}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(NO_SYNC_CASES))
def test_training_step_does_not_synchronise(case, device, monkeypatch):
    """After a warm-up step (compiles, kept bounds and streams), a recomputing step, forward and backward, calls
    nothing that waits for the GPU: torch's sync debug mode raises on a blocking copy, ``.item()`` or a stream
    synchronisation."""
    lengths, extra = NO_SYNC_CASES[case]
    monkeypatch.setattr(stages, "SPLIT_RECOMPUTE", True)
    problem, do, dht = make_problem(lengths, state=torch.float32, device=device)
    options = dict(do=do, dht=dht, recompute=True, **extra)
    if extra.get("gate") == "softplus":
        per_head_gate(problem)
    train(cute_kda.kda_forward, problem, **options)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train(cute_kda.kda_forward, problem, **options)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def resolve_options(problem, options):
    """The resolved options of a training call of ``problem`` with ``options`` (train's keywords)."""
    from cute_kda.call import resolve

    tensors = {n: x for n, x in problem.items() if n not in ("q", "k", "v", "g", "beta")}
    keywords = {n: x for n, x in options.items() if n not in ("do", "dht")}
    return resolve(*(problem[n] for n in ("q", "k", "v", "g", "beta")), **tensors, **keywords, training=True).options


@pytest.mark.gpu
def test_public_chunk_kda_matches_gold(device):
    inputs = make_fla_problem([300, 0, 57, 200], heads=4, state="kv", seed=12)
    leaves = {n: x.to(device).requires_grad_() if x.is_floating_point() else x.to(device) for n, x in inputs.items()}
    gen = torch.Generator().manual_seed(13)
    do = torch.randn(inputs["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(inputs["initial_state"].shape, generator=gen)
    o, ht = cute_kda.chunk_kda(**leaves, output_final_state=True, **FLAGS)
    torch.autograd.backward([o, ht], [do.to(device), dht.to(device)])
    torch.cuda.synchronize()
    p = dict(inputs)
    expected = gold_backward(p.pop("q"), p.pop("k"), p.pop("v"), p.pop("g"), p.pop("beta"), do, dht=dht,
                             A_log=p.pop("A_log"), dt_bias=p.pop("dt_bias"), initial_state=p.pop("initial_state"),
                             state_layout="kv", cu_seqlens=p.pop("cu_seqlens"), lower_bound=FLAGS["lower_bound"])
    grads = {n: leaves[n].grad.cpu() for n in INPUTS}
    assert_close_to_gold(grads, {n: expected[GRAD[n]] for n in INPUTS}, inputs, "chunk_kda varlen kv state")


@pytest.mark.gpu
def test_backward_is_deterministic(device):
    problem, do, dht, options = _gpu_case("varlen_empty_and_short_bf16_state", device)
    first = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)[2]
    second = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)[2]
    torch.cuda.synchronize()
    for name in INPUTS:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.gpu
def test_training_step_releases_its_memory(device):
    """After the backward and once the outputs are dropped, nothing of the step stays allocated (the fresh
    workspace and the checkpoints go with the graph; K1 keeps no reference to them)."""
    problem, do, dht, options = _gpu_case("B1_T300_H4_fp32_state", device)
    train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)  # compiles, fills the caches
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    result = train(cute_kda.kda_forward, problem, do=do, dht=dht, **options)
    del result
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) == before


@pytest.mark.gpu
def test_compiled_training_step_matches_eager(device):
    problem, do, dht, _ = _gpu_case("B1_T300_H4_fp32_state", device)
    step = _step(cute_kda.kda_forward, do, dht)
    eager = _grads_of(step, problem)
    compiled = _grads_of(torch.compile(_step(cute_kda.kda_forward, do, dht), fullgraph=True), problem)
    torch.cuda.synchronize()
    for name, a, b in zip(INPUTS, eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.gpu
def test_fla_dispatches_training_calls(device, monkeypatch):
    fla_kda = pytest.importorskip("fla.ops.kda")
    monkeypatch.delenv("FLA_CUTE_KDA", raising=False)
    assert fla_backend.is_registered() or fla_backend.register()
    inputs = make_fla_problem([300], heads=4, state="kv", seed=14)

    def grads(chunk_kda):
        leaves = {n: x.to(device).requires_grad_() for n, x in inputs.items()}
        o, ht = chunk_kda(**leaves, output_final_state=True, **FLAGS)
        (o.float().square().sum() + ht.sum()).backward()
        return [leaves[n].grad for n in inputs]

    ran = []
    implementation = fla_backend.chunk_kda
    monkeypatch.setattr(fla_backend, "chunk_kda", lambda *a, **k: ran.append(1) or implementation(*a, **k))
    dispatched = grads(fla_kda.chunk_kda)
    direct = grads(cute_kda.chunk_kda)
    torch.cuda.synchronize()
    assert ran == [1]
    for a, b in zip(dispatched, direct):
        assert torch.equal(a, b)


def _train_unbounded(case: str, backend: stages.Backend, device: torch.device) -> None:
    """An unbounded gate (GatedDeltaNet's per head, or per channel) of ``BACKWARD_CASES`` through
    ``training.kda_forward`` on ``backend``: every gradient autograd hands back, in the input's dtype and shape,
    against autograd through the fp64 gold (issue 10's targets; dq and dk summed over each group of value heads)."""
    from test_reference_gates import BACKWARD_CASES, _backward_problem

    spec = BACKWARD_CASES[case]
    (q, k, v, g, beta, do), options = _backward_problem(spec["kind"], **{n: x for n, x in spec.items() if n != "kind"})
    dht = options.pop("dht")
    gate, A_log, dt_bias = options.pop("gate"), options.pop("A_log"), options.pop("dt_bias")
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
              "initial_state": options["initial_state"]}
    leaves = {n: (t.to(device).requires_grad_() if t is not None else None) for n, t in inputs.items()}
    cu_seqlens = options["cu_seqlens"]
    o, ht = training.kda_forward(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), A_log=leaves["A_log"],
                                 dt_bias=leaves["dt_bias"], initial_state=leaves["initial_state"], gate=gate,
                                 cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device),
                                 output_final_state=True, backend=backend)
    torch.autograd.backward([o, ht], [do.to(device), dht.to(device)])
    want = gold_backward(q, k, v, g, beta, do, dht=dht, gate=gate, A_log=A_log, dt_bias=dt_bias, **options)
    names = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log", "dt_bias": "ddt_bias",
             "initial_state": "dh0"}
    errors = {}
    for name, leaf in leaves.items():
        if leaf is None:
            continue
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        errors[names[name]] = rel_rms(leaf.grad.cpu(), want[names[name]])
    print(f"[{backend.name} vs gold] {case}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(e <= TARGETS[n] for n, e in errors.items()), errors


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the mirrors on the CPU use accurate tanh / exp2 / log2
@pytest.mark.parametrize("case", ["gdn_softplus_gva_varlen", "gdn_masks_small_dht", "softplus_kimi_init",
                                  "softplus_gva_varlen_empty_1_token"])
def test_unbounded_gate_trains_through_the_reference_stages(case):
    """The training path's stages by the mirrors (K1's per-head or dyadic scheme, K2 with checkpoints, Kernel A,
    :func:`~cute_kda.reference.mirror_bwd_grads_gates`)."""
    _train_unbounded(case, REFERENCE, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gdn_softplus_gva_varlen", "gdn_masks_small_dht"])
def test_per_head_gate_trains_on_the_kernels(case, device):
    _train_unbounded(case, stages.KERNELS, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["softplus_kimi_init", "softplus_gva_varlen_empty_1_token", "log_decay_masks",
                                  "softplus_pm1000"])
def test_per_channel_unbounded_gate_trains_on_the_kernels(case, device):
    """Kimi-Linear's softplus gate and a log decay per channel: K1's dyadic scheme, Kernel B's dyadic variant."""
    _train_unbounded(case, stages.KERNELS, device)


def unbounded_gate_problem(gate: str) -> tuple[dict, dict]:
    """FLA-style inputs and flags for chunk_kda's unbounded gates: ``"softplus"`` (FLA's ``safe_gate=False``, no
    lower bound: the raw bf16 g with A_log, dt_bias) or ``"none"`` (``use_gate_in_kernel=False``: g the fp32 log
    decay ``−exp(A_log)·softplus(g + dt_bias)`` of the same draw, with a −1000 mask on some channels)."""
    inputs = make_fla_problem([300, 0, 57, 200], heads=4, state="kv", seed=15)
    if gate == "softplus":
        return inputs, {**FLAGS, "safe_gate": False, "lower_bound": None}
    A_log, dt_bias = inputs.pop("A_log"), inputs.pop("dt_bias")
    log_decay = -A_log.exp()[:, None] * F.softplus(inputs["g"].float() + dt_bias.view(A_log.numel(), -1))
    masked = torch.rand(log_decay.shape, generator=torch.Generator().manual_seed(17)) < 0.01
    inputs["g"] = torch.where(masked, torch.full_like(log_decay, -1000.0), log_decay)
    return inputs, {**FLAGS, "use_gate_in_kernel": False, "safe_gate": False, "lower_bound": None}


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("gate", ["softplus", "none"])
def test_unbounded_gate_gradients_against_fla(gate, device):
    """chunk_kda with the softplus gate (FLA's ``safe_gate=False``) and with a precomputed log decay
    (``use_gate_in_kernel=False``), cute_kda and FLA on the same inputs, each against autograd through the fp64
    gold: ours no worse (within 1.25×, or within target)."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    inputs, flags = unbounded_gate_problem(gate)
    leaves_named = [n for n in INPUTS if n in inputs]
    gen = torch.Generator().manual_seed(16)
    do = torch.randn(inputs["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(inputs["initial_state"].shape, generator=gen)

    def grads(chunk_kda):
        leaves = {n: x.to(device).detach().requires_grad_() if x.is_floating_point() else x.to(device)
                  for n, x in inputs.items()}
        o, ht = chunk_kda(**leaves, output_final_state=True, **flags)
        torch.autograd.backward([o, ht], [do.to(device), dht.to(device)])
        return {n: leaves[n].grad.cpu() for n in leaves_named}

    ours, theirs = grads(cute_kda.chunk_kda), grads(fla_kda.chunk_kda)
    p = dict(inputs)
    want = gold_backward(p.pop("q"), p.pop("k"), p.pop("v"), p.pop("g"), p.pop("beta"), do, dht=dht, gate=gate,
                         A_log=p.pop("A_log", None), dt_bias=p.pop("dt_bias", None),
                         initial_state=p.pop("initial_state"), state_layout="kv", cu_seqlens=p.pop("cu_seqlens"))
    rows = {n: (rel_rms(ours[n], want[GRAD[n]]), rel_rms(theirs[n], want[GRAD[n]])) for n in leaves_named}
    print(f"[{gate} gate gradients vs gold] " + ", ".join(f"{GRAD[n]} cute_kda {a:.2e} FLA {b:.2e}"
                                                          for n, (a, b) in rows.items()))
    assert all(a <= max(1.25 * b, TARGETS[GRAD[n]]) for n, (a, b) in rows.items()), rows


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_compiled_per_head_training_step_matches_eager(reference_ops):
    """GatedDeltaNet's per-head gate with grouped value heads under torch.compile: one training op each way, the
    gradients equal to eager's (both on the reference stages)."""
    from test_reference_gates import BACKWARD_CASES, _backward_problem

    spec = BACKWARD_CASES["gdn_softplus_gva_varlen"]
    (q, k, v, g, beta, do), options = _backward_problem(spec["kind"], **{n: x for n, x in spec.items() if n != "kind"})
    dht, cu_seqlens = options["dht"], options["cu_seqlens"]

    def step(forward):
        def run(q, k, v, g, beta, A_log, dt_bias, h0):
            o, ht = forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu_seqlens, gate="softplus")
            return (o.float() * do.float()).sum() + (ht * dht).sum()
        return run

    def grads_of(run):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, options["A_log"], options["dt_bias"],
                                                                 options["initial_state"])]
        run(*leaves).backward()
        return [leaf.grad for leaf in leaves]

    eager = grads_of(step(REFERENCE_FORWARD))
    graphs = Graphs()
    compiled = grads_of(torch.compile(step(cute_kda.kda_forward), fullgraph=True, backend=graphs.backend))
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert Graphs.count(graphs.forward, "cute_kda.forward_train.default") == 1
    assert Graphs.count(graphs.backward, "cute_kda.backward.default") == 1
