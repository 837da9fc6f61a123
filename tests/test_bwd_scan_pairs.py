"""Kernel A's two-tile scan (``cute_kda.kernels.bwd_scan_pairs.PairBwdScan``, the training form planned as W2 of
docs/perf-log.md v8): sm_90a compile checks (CPU), the launcher's checks, and on a GPU the kernel against its mirror
(``cute_kda.reference.pairs.mirror_bwd_scan_pairs`` keeping a snapshot a pair) on the mirror's pair workspace.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_bwd_scan import CHUNK, D, MIRROR_TOL, _dht
from test_fwd_recurrence import STATE, _assert_guards_untouched, _guarded, _problem
from test_pair_prefill import PAIR_HEADS, PAIR_SEQS, mirror_pair_workspace, pair_buffers
from ulp_check import assert_within_one_ulp

from cute_kda.dsl import cute
from cute_kda.kernels.bwd_scan_pairs import PairBwdScan
from cute_kda.layouts.bwd_scan import SCAN_VSPLITS
from cute_kda.ops import bwd_scan as ka
from cute_kda.ops._cache import dsl_type, to_cute_tensor
from cute_kda.workspace import CrossBlocks, images_to_states, pair_blocks_shape

# ============================================================================ compile (CPU)

COMPILED = [(vsplit, "fp32", "fp32", varlen, D) for vsplit, varlen in itertools.product(SCAN_VSPLITS, (False, True))]
COMPILED += [(1, "bf16", "bf16", False, D), (2, "none", "fp32", True, D), (1, "fp32", "fp32", True, 64),
             (4, "none", "bf16", False, 64), (8, "fp32", "fp32", False, 64)]


def _variant_id(variant) -> str:
    vsplit, dht, dh0, varlen, dim = variant
    return f"vs{vsplit}-{dht}-{dh0}-{'varlen' if varlen else 'fixed'}-D{dim}"


def _buffers(dim: int, varlen: bool):
    do, ws, cross = pair_buffers(dim, varlen)
    snapshots = torch.zeros(pair_blocks_shape(ws, PAIR_HEADS, PAIR_SEQS), dtype=torch.bfloat16)
    return do, ws, cross, snapshots, PAIR_SEQS, PAIR_HEADS


@pytest.mark.parametrize("variant", COMPILED, ids=_variant_id)
def test_pair_scan_compiles(variant):
    """Each traced step (the lone tile's, the pair's): G1, G2, G3 and the combine of its tiles plus the pair's two
    cross products; the snapshot by D / 8 bulk copies for bands of 32 columns a warp, else 32-bit stores of the B
    fragment; TMA loads of a stage with the cross blocks; no spills."""
    from cute_kda.compile_report import compile_with_report

    vsplit, dht, dh0, varlen, dim = variant
    do, ws, cross, snapshots, num_seqs, heads = _buffers(dim, varlen)

    def state(name):
        return None if STATE[name] is None else torch.zeros(num_seqs, heads, dim, dim, dtype=STATE[name])

    arguments = ka.launch_arguments(do, ws, do, do, snapshots, dht=state(dht), dh0=state(dh0),
                                    cu_seqlens=torch.tensor([0, 20, 20, 80]) if varlen else None,
                                    tile_base=torch.zeros(num_seqs + 1, dtype=torch.int32) if varlen else None,
                                    cross=cross, tensor=to_cute_tensor)
    kernel = PairBwdScan(vsplit=vsplit, dht=dsl_type(STATE[dht]), dh0=dsl_type(STATE[dh0]), varlen=varlen, dim=dim)
    _, report = compile_with_report(kernel, *arguments, cute.runtime.make_fake_stream())
    atoms, k_steps, cols = kernel.warp_cols // 8, dim // CHUNK, kernel.warp_cols
    lone, pair = 1 + k_steps + 1 + 2 * k_steps, 2 * (1 + k_steps + 1 + 2 * k_steps) + 2
    assert report.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == (lone + pair) * atoms
    if kernel.image_by_bulk:
        assert report.count("cp.async.bulk.global.shared::cta") == 2 * dim // 8
    else:
        assert report.count("st.global.b32") == 2 * cols * dim // 64
    loads = sum(report.count(f"cp.async.bulk.tensor.{n}d.shared::cta.global") for n in (2, 3, 4, 5))
    assert loads == 10 + (dht != "none")  # dO, kd, qd, kr, gT, β, INV, Mqk, the cross blocks; dht's
    assert report.local_memory_ops == 0 and report.spills == 0 and report.kernels[0].stack_frame == 0
    assert report.launch_smem == [kernel.plan.total_bytes] and kernel.plan.pairs
    print(f"{variant}: {report.kernels[0].registers} registers, {kernel.plan.total_bytes} B smem")


def test_pair_scan_refuses_other_forms():
    for config in (dict(snapshot_every=1), dict(split_accumulator=True), dict(token_outputs=False,
                                                                               dh0=dsl_type(torch.float32))):
        with pytest.raises(ValueError, match="a snapshot a pair"):
            PairBwdScan(vsplit=1, **config)


def test_launcher_checks_the_pair_scan_buffers():
    do, ws, cross, snapshots, num_seqs, heads = _buffers(D, False)
    with pytest.raises(ValueError, match="snapshot_every=2"):
        ka.bwd_scan(do, ws, do, do, snapshots, cross=cross)
    with pytest.raises(ValueError, match=r"snapshots must be bfloat16 \(10, 128, 128\)"):
        ka.bwd_scan(do, ws, do, do, snapshots[:-1], cross=cross, snapshot_every=2)


def test_launcher_takes_token_gradients_with_a_free_batch_stride():
    """dv and du may be views of buffers padded along the tokens (the GPU tests' guarded buffers); any other
    stride, or a base off 16 bytes, is refused by name."""
    do, ws, _, snapshots, num_seqs, heads = _buffers(D, False)
    padded = torch.zeros(do.shape[0], do.shape[1] + 32, *do.shape[2:], dtype=do.dtype).narrow(1, 16, do.shape[1])
    ka._check_buffers(do, ws, padded, padded, snapshots, None, None, num_seqs, 2, True)
    swapped = torch.zeros(do.shape[0], do.shape[2], do.shape[1], do.shape[3], dtype=do.dtype).transpose(1, 2)
    with pytest.raises(ValueError, match="du must be C-contiguous past its first mode"):
        ka._check_buffers(do, ws, padded, swapped, snapshots, None, None, num_seqs, 2, True)
    shifted = torch.zeros(do.numel() + 1, dtype=do.dtype)[1:].view(do.shape)  # a base 2 bytes off 16
    with pytest.raises(ValueError, match="dv"):
        ka._check_buffers(do, ws, shifted, padded, snapshots, None, None, num_seqs, 2, True)
    with pytest.raises(ValueError, match="snapshots must be C-contiguous"):
        ka._check_buffers(do, ws, padded, padded, snapshots.transpose(1, 2), None, None, num_seqs, 2, True)


# ============================================================================ GPU


def _run_pairs(problem, *, lengths=None, dht="fp32", dh0="fp32", vsplit=None, seed=0):
    """The mirror's pair workspace, then the pair scan into guarded buffers (snapshot rows poisoned)."""
    device = problem[0].device
    B, T, H, dim = problem[0].shape
    pws, cu, N = mirror_pair_workspace(problem, lengths)
    do = torch.randn(B, T, H, dim, generator=torch.Generator().manual_seed(seed + 3)).bfloat16().to(device)
    dht_in = _dht(dht, N, H, seed, device, dim)
    dv, dv_buf = _guarded((B, T, H, dim), torch.bfloat16, device, axis=1, pad=CHUNK)
    du, du_buf = _guarded((B, T, H, dim), torch.bfloat16, device, axis=1, pad=CHUNK)
    snaps, snaps_buf = _guarded(pair_blocks_shape(pws.ws, H, N), torch.bfloat16, device, axis=0, pad=1)
    dh0_out, dh0_buf = _guarded((N, H, dim, dim), STATE[dh0], device, axis=0, pad=1)
    ka.bwd_scan(do, pws.ws, dv, du, snaps, cu_seqlens=cu, dht=dht_in, dh0=dh0_out, vsplit=vsplit,
                snapshot_every=2, cross=CrossBlocks(pws.cross_kd, pws.cross_qd))
    torch.cuda.synchronize()
    for buf, axis, pad in ((dv_buf, 1, CHUNK), (du_buf, 1, CHUNK), (snaps_buf, 0, 1), (dh0_buf, 0, 1)):
        _assert_guards_untouched(buf, axis, pad)
    assert not dv.isnan().any() and not du.isnan().any(), "a dv/du row was not written"
    return dict(dv=dv, du=du, snapshots=images_to_states(snaps), dh0=dh0_out, pws=pws, do=do, dht=dht_in, cu=cu)


def _mirror_pairs(run):
    from cute_kda.reference.pairs import mirror_bwd_scan_pairs

    snapshots = torch.full_like(run["snapshots"], float("nan"))
    ref = mirror_bwd_scan_pairs(run["pws"], run["do"], cu_seqlens=run["cu"], dht=run["dht"], snapshots=snapshots)
    return ref, snapshots


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 17, 32])
@pytest.mark.parametrize("dht,dh0", [("bf16", "bf16"), ("fp32", "fp32"), ("none", "fp32")])
@pytest.mark.parametrize("dim", [D, 64], ids=["D128", "D64"])
def test_one_pair_within_one_ulp_of_the_mirror(T, dht, dh0, dim):
    """A lone tile (T ≤ 16) or one pair: one step, so the kernel is within an ULP of the mirror (tile a's du and dv
    within two at row scale: its dU sums four products in another order than the mirror's exact sum, and a one-ULP
    dU moves du, then dv; the H200 measured 2.0 at D = 64, T = 17); the snapshot is bf16(dht) itself, the other rows
    untouched."""
    problem = _problem(2, T, 3, seed=T, dim=dim)
    run = _run_pairs(problem, dht=dht, dh0=dh0, seed=T)
    ref, snapshots = _mirror_pairs(run)
    for name in ("dv", "du"):
        assert_within_one_ulp(f"T={T} {name}", run[name], getattr(ref, name), row_ulps=1.0 if T <= 16 else 2.0)
    assert_within_one_ulp(f"T={T} dh0", run["dh0"].float(), ref.dh0.to(run["dh0"].dtype).float())
    same = (run["snapshots"].view(torch.int16) == snapshots.view(torch.int16)) | (
        run["snapshots"].isnan() & snapshots.isnan())
    assert bool(same.all())


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [40, 0, 97, 16, 300, 33]], ids=["B2xT300", "varlen"])
@pytest.mark.parametrize("vsplit", SCAN_VSPLITS)
@pytest.mark.parametrize("dim", [D, 64], ids=["D128", "D64"])
def test_many_pairs_track_the_mirror(lengths, vsplit, dim):
    from cute_kda.reference import rel_rms

    B, T = (2, 300) if lengths is None else (1, sum(lengths))
    run = _run_pairs(_problem(B, T, 2, seed=11, dim=dim), lengths=lengths, vsplit=vsplit, seed=11)
    ref, snapshots = _mirror_pairs(run)
    assert torch.equal(run["snapshots"].isnan(), snapshots.isnan()), "snapshot rows written differ from the mirror's"
    written = ~snapshots.isnan()
    errors = {name: rel_rms(run[name].float(), getattr(ref, name).float()) for name in ("dv", "du", "dh0")}
    errors["snapshots"] = rel_rms(run["snapshots"][written].float(), snapshots[written].float())
    print(f"vs mirror: {errors}")
    assert all(e <= MIRROR_TOL for e in errors.values()), errors


@pytest.mark.gpu
def test_pair_scan_vsplits_are_bit_identical():
    lengths = [300, 0, 17, 1, 64, 33]
    problem = _problem(1, sum(lengths), 3, seed=5)
    runs = [_run_pairs(problem, lengths=lengths, vsplit=s, seed=5) for s in SCAN_VSPLITS]
    for run in runs[1:]:
        for name in ("dv", "du", "snapshots"):
            assert torch.equal(run[name].view(torch.int16), runs[0][name].view(torch.int16)), name
        assert torch.equal(run["dh0"], runs[0]["dh0"])
