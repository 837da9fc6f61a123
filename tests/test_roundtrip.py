"""The transpose round trip: TMA views, fragment bookkeeping, compiled PTX (CPU), bit-exact result (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_kda.compile_report import compile_with_report
from cute_kda.dsl import cute, cutlass
from cute_kda.kernels.common.copy import Operand, make_fragment, warp_tiled_mma
from cute_kda.layouts import smem, tma
from teaching.kernels.transpose_roundtrip import TransposeRoundTrip
from teaching.ops.roundtrip import transpose_tiles, transpose_tiles_reference

D = 128
CHUNK = 16


# ---------------------------------------------------------------- layouts, evaluated on the host


def _evaluate(build):
    """Run ``build()`` inside a host-side CuTe trace and return what it returns (Python values)."""
    out = []

    @cute.jit
    def trace():
        out.append(build())

    trace()
    return out[0]


def _offsets(layout_fn, shape):
    """``layout(i, j)`` for every coordinate of a 2-D ``shape`` (or ``(i, j, s)`` for a 3-D one)."""

    def build():
        layout = layout_fn()
        return {c: layout(c) for c in np.ndindex(*shape)}

    return _evaluate(build)


def test_contiguous_col_run():
    runs = _evaluate(lambda: (
        tma.contiguous_col_run(smem.chunk_operand()),
        tma.contiguous_col_run(smem.operand_tile(D, CHUNK)),
        tma.contiguous_col_run(tma.operand_tile_staged(CHUNK, D, 3)),
    ))
    assert runs == (8, 8, 8)
    with pytest.raises(ValueError, match="not contiguous"):
        _evaluate(lambda: tma.contiguous_col_run(smem.chunk_operand_transposed()))


@pytest.mark.parametrize("rows,cols,stages", [(CHUNK, D, 2), (D, CHUNK, 3)])
def test_staged_views_are_transpose_dual(rows, cols, stages):
    k_inter = _offsets(lambda: tma.operand_tile_staged(rows, cols, stages), (rows, cols, stages))
    mn_inter = _offsets(lambda: tma.operand_tile_transposed_staged(rows, cols, stages), (cols, rows, stages))
    assert all(k_inter[(i, j, s)] == mn_inter[(j, i, s)] for i, j, s in k_inter)
    # stage s is the unstaged tile shifted by one tile size
    tile = _offsets(lambda: smem.operand_tile(rows, cols), (rows, cols))
    assert all(k_inter[(i, j, s)] == tile[(i, j)] + s * rows * cols for i, j, s in k_inter)


def test_head_tile_view_addresses_one_head():
    """The split gmem view reaches the same element as ``x[row, head, col]``."""
    tokens, heads = 40, 3

    def build():
        x = cute.make_tensor(
            cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.gmem),
            cute.make_layout((tokens, heads, D), stride=(heads * D, D, 1)),
        )
        view = tma.head_tile_view(x, D, 8).layout
        coords = [(r, c, h) for r in (0, 17, 39) for c in (0, 7, 8, 127) for h in range(heads)]
        return {(r, c, h): view((r, (c % 8, c // 8), h)) for r, c, h in coords}

    for (r, c, h), offset in _evaluate(build).items():
        assert offset == (r * heads + h) * D + c


# ---------------------------------------------------------------- fragment bookkeeping (host model)


def _tv_tables():
    """(lane, value) → tile coordinate of the warp MMA's C fragment (m, n) and B fragment (n, k)."""

    def build():
        mma = warp_tiled_mma()
        c_tv, b_tv = mma.tv_layout_C_tiled, mma.tv_layout_B_tiled
        sizes = (cute.size(make_fragment(mma, Operand.C)), cute.size(make_fragment(mma, Operand.B)))
        c = {(t, v): divmod(c_tv((t, v)), CHUNK)[::-1] for t in range(32) for v in range(sizes[0])}
        b = {(t, v): divmod(b_tv((t, v)), CHUNK)[::-1] for t in range(32) for v in range(sizes[1])}
        return c, b

    return _evaluate(build)


def _movmatrix(fragment):
    """``movmatrix.m8n8.trans.b16`` on each 32-bit register (PTX ISA semantics) of a [32, 8] fragment.

    Register ``i`` of lane ``l`` holds row ``l // 4``, columns ``2(l % 4)``, ``+1`` of an 8×8 matrix;
    lane ``l`` receives the same positions of its transpose.
    """
    out = np.empty_like(fragment)
    for lane in range(32):
        row, col = lane // 4, 2 * (lane % 4)
        for reg in range(fragment.shape[1] // 2):
            for e in range(2):
                src_row, src_col = col + e, row  # transpose
                out[lane, 2 * reg + e] = fragment[4 * src_row + src_col // 2, 2 * reg + src_col % 2]
    return out


def test_movmatrix_model_transposes_an_8x8_block():
    matrix = np.arange(64).reshape(8, 8)
    in_order = np.array([matrix[lane // 4, 2 * (lane % 4): 2 * (lane % 4) + 2] for lane in range(32)])
    out_order = np.array([matrix.T[lane // 4, 2 * (lane % 4): 2 * (lane % 4) + 2] for lane in range(32)])
    np.testing.assert_array_equal(_movmatrix(in_order), out_order)


def _model_round_trip(transposed_views: bool, use_movmatrix: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Model the kernel's byte movement with the DSL's own layouts; return (x tile, y tile)."""
    c_tv, b_tv = _tv_tables()
    x_k = _offsets(smem.chunk_operand, (CHUNK, D))  # K_INTER [16, D]: TMA-load destination
    x_mn = _offsets(smem.chunk_operand_transposed, (D, CHUNK))  # its MN_INTER [D, 16] face
    y_k = _offsets(lambda: smem.operand_tile(D, CHUNK), (D, CHUNK))  # K_INTER [D, 16]: TMA-store source
    y_mn = _offsets(lambda: smem.operand_tile_transposed(D, CHUNK), (CHUNK, D))  # its MN_INTER face

    x = np.random.default_rng(0).integers(0, 2**16, size=(CHUNK, D))
    x_smem = np.empty(CHUNK * D, dtype=np.int64)
    for (r, c), offset in x_k.items():
        x_smem[offset] = x[r, c]
    y_smem = np.full(D * CHUNK, -1, dtype=np.int64)
    for block in range(D // 16):
        # ldmatrix: C fragment of the 16×16 source block
        c_frag = np.empty((32, 8), dtype=np.int64)
        for (t, v), (m, n) in c_tv.items():
            offset = x_mn[(16 * block + m, n)] if transposed_views else x_k[(m, 16 * block + n)]
            c_frag[t, v] = x_smem[offset]
        b_frag = _movmatrix(c_frag) if use_movmatrix else c_frag
        # stmatrix: B fragment into the 16×16 target block
        for (t, v), (n, k) in b_tv.items():
            offset = y_mn[(n, 16 * block + k)] if transposed_views else y_k[(16 * block + n, k)]
            y_smem[offset] = b_frag[t, v]
    y = np.array([[y_smem[y_k[(i, j)]] for j in range(CHUNK)] for i in range(D)])
    return x, y


@pytest.mark.parametrize("transposed_views", [True, False])
def test_fragment_model_transposes(transposed_views):
    x, y = _model_round_trip(transposed_views)
    np.testing.assert_array_equal(y, x.T)


def test_fragment_model_needs_movmatrix():
    x, y = _model_round_trip(True, use_movmatrix=False)
    assert not np.array_equal(y, x.T)


# ---------------------------------------------------------------- compiled PTX (CPU)


def _compile(kernel: TransposeRoundTrip, dtype=cutlass.BFloat16):
    """Compile ``kernel`` for fake ``x [T, H, D]`` / ``y [T', H, 16]`` (dynamic T, T', H) with a report."""
    heads = cute.sym_int()
    x, y = (
        cute.runtime.make_fake_compact_tensor(
            dtype, (cute.sym_int(), heads, cols), stride_order=(2, 1, 0), assumed_align=16
        )
        for cols in (kernel.dim, CHUNK)
    )
    _, report = compile_with_report(kernel, x, y, cutlass.Int32(1), cute.runtime.make_fake_stream())
    return report


@pytest.fixture(scope="module", params=[True, False], ids=["mn_views", "k_views"])
def compiled_report(request):
    kernel = TransposeRoundTrip(D, transposed_views=request.param)
    return request.param, kernel, _compile(kernel)


def test_ptx_uses_every_primitive(compiled_report):
    transposed_views, kernel, report = compiled_report
    trans = ".trans" if transposed_views else ""
    # one 4-D TMA instruction per tile each way (the split head-tile view)
    assert report.count("cp.async.bulk.tensor.4d.shared::cta.global") == 1
    assert report.count("cp.async.bulk.tensor.4d.global.shared::cta") == 1
    assert report.has("mbarrier.try_wait") and report.has("mbarrier.arrive.expect_tx")
    assert report.count(f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16") == kernel.blocks_per_warp
    assert report.count("movmatrix.sync.aligned.m8n8.trans.b16") == 4 * kernel.blocks_per_warp
    assert report.count(f"stmatrix.sync.aligned.m8n8.x4{trans}.shared.b16") == kernel.blocks_per_warp
    assert report.has("fence.proxy.async.shared::cta")
    # the DSL does not elect the issuing lane of a TMA store; tma_store_tiles must
    lines = report.ptx.splitlines()
    store = next(i for i, line in enumerate(lines) if "cp.async.bulk.tensor.4d.global.shared::cta" in line)
    assert any("elect.sync" in line for line in lines[store - 8: store])


@pytest.mark.parametrize(
    "dim,dtype,stages,transposed_views",
    [(D, cutlass.Float16, (1, 1), True), (D, cutlass.BFloat16, (3, 2), False),
     (64, cutlass.Float16, (2, 2), True)],
)
def test_variants_compile(dim, dtype, stages, transposed_views):
    """Other configurations (as the GPU tests launch) compile, one TMA per tile, no local memory."""
    kernel = TransposeRoundTrip(dim, dtype, *stages, transposed_views)
    report = _compile(kernel, dtype)
    assert report.count("cp.async.bulk.tensor") == 2
    assert report.count("movmatrix") == 4 * kernel.blocks_per_warp
    assert report.local_memory_ops == 0 and report.spills == 0


def test_no_local_memory(compiled_report):
    _, _, report = compiled_report
    assert report.local_memory_ops == 0
    assert len(report.kernels) == 1
    assert report.spills == 0 and report.kernels[0].stack_frame == 0


# ---------------------------------------------------------------- torch reference and launcher (CPU)


def test_reference_is_the_tile_transpose():
    x = torch.randn(40, 3, D).to(torch.bfloat16)  # 2 full tiles and a tail of 8 tokens
    y = transpose_tiles_reference(x)
    assert y.shape == (3 * D, 3, CHUNK)
    for t in range(3):
        for h in range(3):
            tile = torch.zeros(CHUNK, D, dtype=x.dtype)
            rows = x[CHUNK * t: CHUNK * (t + 1), h]
            tile[: rows.shape[0]] = rows
            assert torch.equal(y[D * t: D * (t + 1), h], tile.T)


def test_launcher_rejects_cpu_tensors():
    with pytest.raises(TypeError, match="CUDA"):
        transpose_tiles(torch.zeros(16, 1, D, dtype=torch.bfloat16))


# ---------------------------------------------------------------- GPU


def _random_bits(shape, dtype, seed):
    """Random 16-bit patterns of every kind (NaNs and infinities included): only bits are compared."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("transposed_views", [True, False], ids=["mn_views", "k_views"])
@pytest.mark.parametrize(
    "tokens,heads,tiles_per_cta,stages",
    [(16, 1, 1, (1, 1)), (112, 3, 1, (2, 2)), (112, 3, 3, (2, 2)), (100, 5, 7, (3, 2)), (400, 2, 25, (1, 1))],
    ids=lambda case: "x".join(map(str, case)) if isinstance(case, tuple) else str(case),
)
def test_round_trip_bit_exact(device, dtype, transposed_views, tokens, heads, tiles_per_cta, stages):
    x = _random_bits((tokens, heads, D), dtype, seed=tokens * heads).to(device)
    out = torch.full(((tokens + CHUNK - 1) // CHUNK * D, heads, CHUNK), -1, dtype=torch.int16, device=device)
    out = out.view(dtype)  # 0xFFFF: a NaN pattern the kernel must overwrite everywhere
    y = transpose_tiles(
        x, tiles_per_cta=tiles_per_cta, load_stages=stages[0], store_stages=stages[1],
        transposed_views=transposed_views, out=out,
    )
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    expected = transpose_tiles_reference(x)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.gpu
def test_round_trip_of_a_bthd_view(device):
    """Heads of a [B, T, H, D] tensor seen as [B·T, H, D] (the K1/K2 input view)."""
    x4 = _random_bits((2, 48, 4, D), torch.bfloat16, seed=7).to(device)
    x = x4.view(2 * 48, 4, D)
    y = transpose_tiles(x, tiles_per_cta=2)
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), transpose_tiles_reference(x).view(torch.int16))
