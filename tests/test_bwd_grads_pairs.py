"""Kernel B in the two-tile training form (``GradsVariant.pair_rebuild``, ``cute_kda.kernels.bwd_grads.pairs``; W2 of
docs/perf-log.md): the states kept a pair of tiles, each CTA rebuilding the matrix of its tile's other end. CPU: the
plan, the compiled variants against the per-tile ones, the refusals and the launcher's checks; GPU: the kernel against
its mirror (``reference.pair_backward.tile_states_of_pairs`` then ``mirror_bwd_grads``) and against the per-tile
kernel fed the mirror's rebuilt matrices."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from test_bwd_grads import GUARD, MIRROR_TOL
from test_fwd_recurrence import _assert_guards_untouched, _guarded, _problem

from cute_kda.dsl import cute, cutlass
from cute_kda.executors import stages
from cute_kda.layouts import bwd_grads as plan
from cute_kda.ops import bwd_grads as kb
from cute_kda.variants import GradsVariant
from cute_kda.workspace import (
    WorkspaceSpec, block_states_shape, pair_blocks_shape, pair_u_shape, states_to_images, workspace_views,
)

D = 128


# ============================================================================ plan and compile (CPU)


@pytest.mark.parametrize("scheme,budget", [("safe", plan.smem_budget), ("per_head", plan.per_head_smem_budget)])
@pytest.mark.parametrize("dim,warps", [(D, 8), (D, 4), (64, 4)])
def test_partner_buffers_hold_the_partners_tiles(scheme, budget, dim, warps):
    """The partner's tiles take four distinct 1 KiB-aligned tile-sized (or larger) buffers of the plan, none of the
    inputs phase 1 loads or the state images; U_a's ``[D, 16]`` rows fit a tile."""
    layout = {row.split()[0]: row.split() for row in budget(warps, dim).describe().splitlines()[3:-1]}
    tile = 16 * dim * 2
    starts = []
    for name in plan.PARTNER_BUFFERS[scheme]:
        row = layout[name]
        size, offset = int(row[4]), int(row[6])
        assert size >= tile and offset % 1024 == 0, (name, size, offset)
        starts.append((offset, offset + size))
    for (a0, a1), (b0, b1) in itertools.combinations(sorted(starts), 2):
        assert a1 <= b0
    loaded = ("q", "k", "do", "state", "state_grad", "inv", "beta", "dgt") + (("g",) if scheme == "safe" else ())
    for name in loaded:
        key = next(k for k in layout if k.split(".")[-1] == name)
        lo, hi = int(layout[key][6]), int(layout[key][6]) + int(layout[key][4])
        assert all(hi <= s or lo >= e for s, e in starts), name
    assert plan.partner_load_bytes(plan.PAIR_A_TILES, dim) == 4 * tile
    assert plan.partner_load_bytes(plan.PAIR_B_TILES, dim) == 2 * tile == dim * 16 * 2 + tile


def _variant(pair: bool, *, varlen=False, per_head=False, warps=8, dim=D) -> GradsVariant:
    gate = "softplus" if per_head else "safe"
    return GradsVariant(varlen, True, True, gate, torch.bfloat16, per_head, per_head, warps, dim=dim,
                        pair_rebuild=pair, **kb.switches(gate, per_head, warps))


_REPORTS: dict = {}


def _report(variant: GradsVariant):
    if variant not in _REPORTS:
        from cute_kda.compile_report import compile_with_report

        _REPORTS[variant] = compile_with_report(kb.variant_kernel(variant), *kb.compile_arguments(variant))[1]
    return _REPORTS[variant]


@pytest.mark.parametrize("options", [dict(), dict(varlen=True), dict(per_head=True), dict(per_head=True, varlen=True),
                                     dict(warps=4), dict(dim=64, warps=4)],
                         ids=["safe", "safe-varlen", "per_head", "per_head-varlen", "safe-4warps", "safe-D64"])
def test_pair_rebuild_variant_compiles(options):
    """Against the per-tile variant: tile a's two products and tile b's one, 16-token contractions over the warp's
    value rows and every key column; the partner's four (a) or one (b) TMA tiles and U_a's bulk copy; two more
    barriers (after the partner's invalid rows are zeroed, after the rebuild); the same shared memory, no spills."""
    plain, pair = _report(_variant(False, **options)), _report(_variant(True, **options))
    dim, warps = options.get("dim", D), options.get("warps", 8)
    atoms = (dim // warps // 16) * (dim // 8)  # m16n8k16 a warp's rows and every key column take, a product
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    assert pair.count(mma) - plain.count(mma) == 3 * atoms
    assert pair.count("cp.async.bulk.tensor") - plain.count("cp.async.bulk.tensor") == 5
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    assert pair.count(bulk) - plain.count(bulk) == 1
    assert pair.count("bar.sync") - plain.count("bar.sync") == 2
    assert pair.count("stmatrix") - plain.count("stmatrix") == 2 * atoms // 2  # a 16 × 16 block each, tiles a and b
    assert pair.local_memory_ops == 0 and pair.spills == 0 and pair.kernels[0].stack_frame == 0
    assert pair.launch_smem == plain.launch_smem
    print(f"{options}: {plain.kernels[0].registers} → {pair.kernels[0].registers} registers")


def _operand_probe_mismatches(dim: int, operand: str) -> int:
    """Lanes whose ``ldmatrix.trans`` rows miss the bytes the layout puts them at: the rebuild's A operand (16 value
    rows of a partner tile's transposed face: dO_bᵀ, dv_bᵀ) or B operand (a 64-column pass: qd_b, kd_b, kr_a), the
    K_SW128 face through a pointer swizzle sliced by a runtime block index, as ``PairRebuild.rebuild_band`` reads them
    (a one-warp probe's PTX evaluated lane by lane, ``tests/ptx_addresses.py``; the band-scan kernels' probes in
    ``tests/test_smem_addresses.py``)."""
    import tempfile

    from cutlass.memory import SmemAllocator
    from ptx_addresses import matrix_addresses

    from cute_kda.kernels.bwd_grads.pairs import REBUILD_COLUMNS
    from cute_kda.kernels.common.copy import Operand, ldmatrix_copy, make_fragment, smem_tensor, warp_tiled_mma
    from cute_kda.layouts.analysis import evaluate_layout, run_traced
    from cute_kda.layouts.smem import sw128_tile_transposed
    from cute_kda.ops._cache import to_cute_tensor

    bf16, cols = cutlass.BFloat16, min(dim, REBUILD_COLUMNS)
    which = Operand.A if operand == "a" else Operand.B
    tile = (16, 16) if which is Operand.A else (cols, 16)
    blocks = dim // tile[0]
    size = run_traced(lambda: int(cute.cosize(sw128_tile_transposed(16, dim).outer)))

    # the annotation as an object: this module's postponed annotations would hand cute.struct a string
    Storage = cute.struct(type("Storage", (), {"__annotations__": {
        "buf": cute.struct.Align[cute.struct.MemRange[bf16, size], 1024]}}))

    class Probe:
        @cute.jit
        def __call__(self, out: cute.Tensor, block: cutlass.Int32, stream):
            self.kernel(out, block).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, out: cute.Tensor, block: cutlass.Int32):
            lane = cute.arch.lane_idx()
            storage = SmemAllocator().allocate(Storage)
            face = smem_tensor(storage.buf.data_ptr(), sw128_tile_transposed(16, dim), bf16)
            mma = warp_tiled_mma(bf16, cutlass.Float32, cols)
            copy = ldmatrix_copy(mma, which, True)
            thr = copy.get_slice(lane)
            frag = make_fragment(mma, which, bf16, tile=tile)
            cute.copy(copy, thr.partition_S(cute.local_tile(face, tile, (block, 0))), thr.retile(frag))
            words = cute.recast_tensor(frag, cutlass.Uint32)
            for i in cutlass.range_constexpr(cute.size(words)):
                out[lane * cute.size(words) + i] = words[i]

    out = to_cute_tensor(torch.zeros(32 * 64, dtype=torch.int32), 16)
    with tempfile.TemporaryDirectory() as dump_dir:
        ptx = cute.compile(Probe(), out, cutlass.Int32(0), cute.runtime.make_fake_stream(),
                           options=f"--keep-ptx --dump-dir={dump_dir}").__ptx__

    def expected():
        layout = sw128_tile_transposed(16, dim)
        table = evaluate_layout(layout, 2).bytes
        mma = warp_tiled_mma(bf16, cutlass.Float32, cols)
        thr_copy = ldmatrix_copy(mma, which, True)
        ident = cute.make_identity_tensor((dim, 16))
        rows = {}
        for block in range(blocks):
            for lane in range(32):
                part = thr_copy.get_slice(lane).partition_S(cute.local_tile(ident, tile, (block, 0)))
                rows[(block, lane)] = [int(table[tuple(part[i])]) for i in range(0, cute.size(part), 8)]
        return rows

    return sum(matrix_addresses(ptx, lane, [0, block]) != want for (block, lane), want in run_traced(expected).items())


@pytest.mark.parametrize("dim", [D, 64])
@pytest.mark.parametrize("operand", ["a", "b"])
def test_rebuild_operands_address_their_bytes(operand, dim):
    assert _operand_probe_mismatches(dim, operand) == 0


def test_pair_rebuild_refusals():
    from cute_kda.kernels.bwd_grads import bwd_grads_kernel

    fp16 = dict(dtype=cutlass.Float16, gate_dtype=cutlass.Float16)
    for config in (dict(gate="softplus"), dict(split_load=True), fp16):
        options = dict(varlen=False, pair_rebuild=True, **config)
        with pytest.raises(ValueError, match="pair_rebuild"):
            bwd_grads_kernel(**options)


_HEADS, _SEQS, _T = 2, 2, 40


def _cpu_arguments(pair: bool = True) -> tuple[list, dict]:
    """``bwd_grads``' arguments as CPU zeros (B = N = 2, T = 40, H = 2, 6 tiles), the states a pair's with ``pair``."""
    tok = torch.zeros(_SEQS, _T, _HEADS, D, dtype=torch.bfloat16)
    spec = WorkspaceSpec(heads=_HEADS, tiles=6)
    ws = workspace_views(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    shape = (pair_blocks_shape if pair else block_states_shape)(ws, _HEADS, _SEQS)
    states = torch.zeros(shape, dtype=torch.bfloat16)
    ddt, dalog = (torch.zeros(s) for s in kb.gate_partials_shapes(ws, _HEADS))
    args = [tok, tok, tok, tok, tok, tok, ws, states, states, torch.zeros(_HEADS), torch.zeros(_HEADS, D), tok, tok,
            tok, torch.zeros(_SEQS, _T, _HEADS, dtype=torch.bfloat16), ddt, dalog]
    pair_tensors = kb.PairTensors(torch.zeros(pair_u_shape(ws, _HEADS, _SEQS), dtype=torch.bfloat16), tok, ws)
    return args, dict(scale=0.1, lower_bound=-5.0, pair=pair_tensors if pair else None)


def test_launcher_keys_pair_rebuild_and_checks_the_pair_tensors(monkeypatch):
    seen = []
    monkeypatch.setattr(kb, "compiled_variant", lambda variant, index, tensors, options: seen.append(
        (variant, options["pair"])) or (lambda *args: seen.append(args)))
    monkeypatch.setattr(kb, "current_stream", lambda device: "stream")
    monkeypatch.setattr(kb, "device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    args, options = _cpu_arguments()
    kb.bwd_grads(*args, **options)
    (variant, pair), launch = seen
    assert variant.pair_rebuild and pair is options["pair"] and launch[-2] is not None and len(launch) == 11
    seen.clear()
    kb.bwd_grads(*_cpu_arguments(pair=False)[0], scale=0.1, lower_bound=-5.0)
    assert not seen[0][0].pair_rebuild and seen[1][-2] is None
    bad = {"states": lambda a, o: a.__setitem__(7, torch.zeros(block_states_shape(a[6], _HEADS, _SEQS),
                                                               dtype=torch.bfloat16)),
           "pair.u_a": lambda a, o: o.update(pair=o["pair"]._replace(u_a=o["pair"].u_a[:, :, :8])),
           "pair.dv": lambda a, o: o.update(pair=o["pair"]._replace(dv=o["pair"].dv.float())),
           "pair.ws.kr": lambda a, o: o.update(pair=o["pair"]._replace(ws=o["pair"].ws._replace(
               kr=o["pair"].ws.kr[1:]))),
           "bf16 q": lambda a, o: a.__setitem__(0, a[0].half()) or [a.__setitem__(i, a[i].half()) for i in (1, 2, 3)]}
    for name, spoil in bad.items():
        args, options = _cpu_arguments()
        spoil(args, options)
        with pytest.raises(ValueError, match=name.replace(".", "\\.")):
            kb.bwd_grads(*args, **options)


# ============================================================================ GPU: against the mirror


def _pair_chain(per_head: bool, lengths: list[int] | None, B: int, T: int, dim: int, seed: int = 0):
    """Kernel B's inputs in the pair form: the kernels' tile K1 workspace (the partner fields), then the pair
    mirrors on the GPU for the kept matrices, U_a, du and dv; and the mirror's per-tile matrices rebuilt from them."""
    from test_reference_pairs import _per_head_inputs

    from cute_kda.ops import prepare as k1
    from cute_kda.reference.pair_backward import tile_states_of_pairs
    from cute_kda.reference.pairs import (
        mirror_bwd_scan_pairs, mirror_prepare_pairs, mirror_prepare_pairs_per_head, mirror_recurrence_pairs,
    )
    from cute_kda.workspace import allocate_workspace, pair_block_slots, tiles_per_head

    device = torch.device("cuda")
    total = B * T
    if per_head:
        q, k, v, g, beta, A_log, dt_bias, _ = (t.to(device) for t in _per_head_inputs(total, -1.0, seed, D=dim))
        if lengths is None:
            q, k, v, g, beta = (t.reshape(B, T, *t.shape[2:]) for t in (q, k, v, g, beta))
        gate = "softplus"
    else:
        q, k, v, g, beta, A_log, dt_bias = _problem(1 if lengths else B, total if lengths else T, 2, seed=seed,
                                                    dim=dim)
        gate = "safe"
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    heads, num_seqs = v.shape[2], (B if lengths is None else len(lengths))
    gen = torch.Generator().manual_seed(seed + 9)
    do = torch.randn(v.shape, generator=gen).bfloat16().to(device)
    h0 = (0.3 * torch.randn(num_seqs, heads, dim, dim, generator=gen)).to(device)
    dht = (0.3 * torch.randn(num_seqs, heads, dim, dim, generator=gen)).to(device)
    options = dict(A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)
    scale = dim ** -0.5
    tiles = tiles_per_head(q.shape[0] * q.shape[1], num_seqs, cu is not None)
    ws = allocate_workspace(WorkspaceSpec(heads=heads, tiles=tiles, dim=dim), device)
    tile_base = None if cu is None else k1.tile_bases(cu)
    k1.prepare(q, k, g, beta, A_log, dt_bias, ws, scale=scale, lower_bound=-5.0, cu_seqlens=cu, tile_base=tile_base,
               gate=gate)
    if per_head:
        pws = mirror_prepare_pairs_per_head(q, k, g, beta, gate=gate, **options)
    else:
        pws = mirror_prepare_pairs(q, k, g, beta, lower_bound=-5.0, **options)
    rows = heads * pair_block_slots(tiles, num_seqs)
    checkpoints, snapshots = (torch.full((rows, dim, dim), math.nan, dtype=torch.bfloat16, device=device)
                              for _ in range(2))
    u_a = torch.full((rows, dim, 16), math.nan, dtype=torch.bfloat16, device=device)
    mirror_recurrence_pairs(pws, v, cu_seqlens=cu, initial_state=h0, checkpoints=checkpoints, u_a=u_a)
    scan = mirror_bwd_scan_pairs(pws, do, cu_seqlens=cu, dht=dht, snapshots=snapshots)
    states, state_grads = tile_states_of_pairs(ws, checkpoints, snapshots, u_a, do, scan.dv, cu_seqlens=cu)
    inputs = (q, k, g, v, do, scan.du.contiguous())
    return inputs, ws, (checkpoints, snapshots, u_a, scan.dv.contiguous()), (states, state_grads), dict(
        options, gate=gate, scale=scale, tile_base=tile_base, beta=beta)


def _run_kernel(inputs, ws, states, state_grads, options, pair=None) -> dict:
    q, k, g, v, do, du = inputs
    device, (B, T, heads, dim) = q.device, v.shape
    per_head = g.dim() == 3
    raw = {}
    for name in ("dq", "dk"):
        raw[name], raw[name + "_buf"] = _guarded((B, T, heads, dim), torch.bfloat16, device, axis=0, pad=GUARD)
    raw["dg"], raw["dg_buf"] = _guarded((B, T, heads) if per_head else (B, T, heads, dim),
                                        torch.float32 if per_head else torch.bfloat16, device, axis=0, pad=GUARD)
    raw["dbeta"], raw["dbeta_buf"] = _guarded((B, T, heads), torch.bfloat16, device, axis=0, pad=GUARD)
    ddt, dalog = (torch.full(s, math.nan, device=device) for s in kb.gate_partials_shapes(ws, heads, per_head))
    kb.bwd_grads(q, k, g, v, do, du, ws, states_to_images(states), states_to_images(state_grads), options["A_log"],
                 options["dt_bias"], raw["dq"], raw["dk"], raw["dg"], raw["dbeta"], ddt, dalog, scale=options["scale"],
                 lower_bound=-5.0, cu_seqlens=options["cu_seqlens"], tile_base=options["tile_base"],
                 gate=options["gate"], pair=pair)
    torch.cuda.synchronize()
    for name in ("dq", "dk", "dg", "dbeta"):
        _assert_guards_untouched(raw.pop(name + "_buf"), axis=0, pad=GUARD)
        assert not raw[name].isnan().any(), f"a {name} row was not written"
    assert not ddt.isnan().any() and not dalog.isnan().any()
    summed = {name: stages.group_sum(raw[name], q.shape[2]) for name in ("dq", "dk")}  # the mirror's group sums
    return dict(raw, **summed, dA_log=dalog.sum(1), ddt_bias=ddt.sum(1))


GRADS = ("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias")
# (per_head, lengths, B, T): a partial last tile of its own (T = 100: pairs of tiles 0-5, tile 6 lone), and packed
# sequences with a pair whose tile b is partial (20), a lone full tile (48), a lone partial one (5)
PAIR_CASES = {
    "safe_fixed": (False, None, 2, 100), "safe_varlen": (False, [20, 48, 5, 70], 1, 143),
    "per_head_fixed": (True, None, 2, 100), "per_head_varlen": (True, [20, 48, 5, 70], 1, 143),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [D, 64], ids=["D128", "D64"])
@pytest.mark.parametrize("case", sorted(PAIR_CASES))
def test_pair_rebuild_tracks_its_mirror(case, dim):
    """The kernel on the kept pair matrices against the mirror (``tile_states_of_pairs``, ``mirror_bwd_grads``) within
    Kernel B's mirror bound, and against the per-tile kernel fed the mirror's rebuilt matrices within a tenth of it
    (the two differ where the rebuilt matrix's bf16 rounding does: a tensor-core sum against the mirror's exact one);
    a wrong partner, role or slot shows as O(1) or NaN (the kept buffers' unused rows are NaN)."""
    from cute_kda.reference import rel_rms
    from cute_kda.reference.backward import mirror_bwd_grads

    per_head, lengths, B, T = PAIR_CASES[case]
    inputs, ws, (checkpoints, snapshots, u_a, dv), (states, state_grads), options = _pair_chain(
        per_head, lengths, B, T, dim)
    got = _run_kernel(inputs, ws, checkpoints, snapshots, options, pair=kb.PairTensors(u_a, dv, ws))
    per_tile = _run_kernel(inputs, ws, states, state_grads, options)
    q, k, g, v, do, du = inputs
    ref = mirror_bwd_grads(q, k, g, options["beta"], v, do, du, ws, states, state_grads, gate=options["gate"],
                           A_log=options["A_log"], dt_bias=options["dt_bias"], scale=options["scale"],
                           cu_seqlens=options["cu_seqlens"])
    vs_mirror = {n: rel_rms(got[n].float(), getattr(ref, n).float()) for n in GRADS}
    vs_per_tile = {n: rel_rms(got[n].float(), per_tile[n].float()) for n in GRADS}
    print(f"{case} D={dim}: vs mirror " + ", ".join(f"{n} {e:.2e}" for n, e in vs_mirror.items())
          + "; vs the per-tile kernel " + ", ".join(f"{n} {e:.2e}" for n, e in vs_per_tile.items()))
    assert all(e <= MIRROR_TOL for e in vs_mirror.values()), vs_mirror
    assert all(e <= MIRROR_TOL / 10 for e in vs_per_tile.values()), vs_per_tile
