"""Device math helpers that must issue one specific PTX instruction.

docs/numerics.md fixes these instructions; the mirror reference evaluates the same ones through
``cute_kda.kernels.intrinsics``. Inline PTX keeps the instruction choice out of the compiler's hands.
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``tanh.approx.f32``."""
    return Float32(
        llvm.inline_asm(
            T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;", "=f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def ex2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``ex2.approx.ftz.f32`` (2^x, subnormals flushed)."""
    return Float32(
        llvm.inline_asm(
            T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def sigmoid_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``0.5·tanh.approx(0.5·x) + 0.5`` — one rounding (0.5·t is exact), as docs/numerics.md states."""
    half = Float32(0.5)
    return tanh_approx(half * Float32(x), loc=loc, ip=ip) * half + half


@dsl_user_op
def movmatrix_trans(packed: Uint32, *, loc=None, ip=None) -> Uint32:
    """``movmatrix.sync.aligned.m8n8.trans.b16`` on one 32-bit register (two b16 values).

    Warp-collective. With an 8×8 b16 matrix held in the mma row-fragment order (lane ``t`` holds
    row ``t // 4``, columns ``2·(t % 4)`` and ``2·(t % 4) + 1``), every lane receives its
    fragment of the transpose in the same order: the C→B fragment transpose of an mma tile.
    """
    return Uint32(
        llvm.inline_asm(
            T.i32(), [Uint32(packed).ir_value(loc=loc, ip=ip)],
            "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
