"""Device helpers that must issue one specific PTX instruction (math, and the one global reduction Kernel B adds with).

docs/numerics.md fixes these instructions; the mirror reference evaluates the same ones through
``cute_kda.kernels.intrinsics``. Inline PTX keeps the instruction choice out of the compiler's hands.
"""

from __future__ import annotations

from cutlass import Float32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# register class and MLIR type of the 32-bit DSL types the instructions here take and return
_REGISTERS = {Float32: ("f", T.f32), Uint32: ("r", T.i32)}


def _one_instruction(ptx: str, dtype: type, *operands, side_effects: bool = False, operand_dtype: type | None = None,
                     loc=None, ip=None):
    """``ptx`` (result ``$0``, operands ``$1, $2, …``), every value a 32-bit register: the result of
    ``dtype``, the operands of ``operand_dtype`` (default ``dtype``).

    ``side_effects`` keeps a warp-collective instruction where it is (no hoisting or merging).
    """
    reg, mlir_type = _REGISTERS[dtype]
    operand_dtype = operand_dtype or dtype
    operand_reg = _REGISTERS[operand_dtype][0]
    return dtype(
        llvm.inline_asm(
            mlir_type(), [operand_dtype(x).ir_value(loc=loc, ip=ip) for x in operands], ptx,
            ",".join([f"={reg}"] + [operand_reg] * len(operands)),
            has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``tanh.approx.f32``."""
    return _one_instruction("tanh.approx.f32 $0, $1;", Float32, x, loc=loc, ip=ip)


@dsl_user_op
def ex2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``ex2.approx.ftz.f32`` (2^x, subnormals flushed)."""
    return _one_instruction("ex2.approx.ftz.f32 $0, $1;", Float32, x, loc=loc, ip=ip)


@dsl_user_op
def rcp_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``rcp.approx.ftz.f32`` (``MUFU.RCP``): the first step of ptxas' own ``rcp.rn.f32`` of ``x``
    (:func:`cute_kda.kernels.bwd_grads.safe.reciprocal_rn`)."""
    return _one_instruction("rcp.approx.ftz.f32 $0, $1;", Float32, x, loc=loc, ip=ip)


@dsl_user_op
def lg2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """``lg2.approx.f32`` (log2 x; the softplus gate takes it of 1 + 2^−|y| ∈ [1, 2])."""
    return _one_instruction("lg2.approx.f32 $0, $1;", Float32, x, loc=loc, ip=ip)


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``mul.rn.f32``: a product that neither LLVM nor ptxas may fuse into a following add."""
    return _one_instruction("mul.rn.f32 $0, $1, $2;", Float32, a, b, loc=loc, ip=ip)


@dsl_user_op
def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """``fma.rn.f32``: ``a·b + c`` rounded once, at the place the caller writes it (a dot product whose
    summation order a mirror reproduces)."""
    return _one_instruction("fma.rn.f32 $0, $1, $2, $3;", Float32, a, b, c, loc=loc, ip=ip)


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
    return _one_instruction("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", Uint32, packed, side_effects=True,
                            loc=loc, ip=ip)


@dsl_user_op
def pack_bf16x2(first: Float32, second: Float32, *, loc=None, ip=None) -> Uint32:
    """``cvt.rn.bf16x2.f32``: ``bf16(first)`` in bits 0-15 and ``bf16(second)`` in bits 16-31 of one word,
    each rounded to nearest even."""
    return _one_instruction("cvt.rn.bf16x2.f32 $0, $2, $1;", Uint32, first, second, operand_dtype=Float32,
                            loc=loc, ip=ip)


@dsl_user_op
def reduce_add_bf16x2(address: Int64, packed: Uint32, *, loc=None, ip=None) -> None:
    """``red.global.add.noftz.bf16x2``: the two bf16 halves of ``packed`` added into the two bf16 values at global
    ``address`` (4-byte aligned), each sum rounded once to nearest even, subnormals kept: onto a zero, ``a`` then
    ``b`` (either order) leave ``bf16(a + b)``, the value of an fp32 add of the two rounded once."""
    llvm.inline_asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Uint32(packed).ir_value(loc=loc, ip=ip)],
                    "red.global.add.noftz.bf16x2 [$0], $1;", "l,r,~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
