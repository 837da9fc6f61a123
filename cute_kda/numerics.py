"""The problem's constants and the host-side scalars of the numerics contract (docs/numerics.md).

Every module takes from here the chunk length (tokens per tile), the head dim, the V-splits of the scans and
the state images' run length, so each is defined once (this module imports nothing of the DSL, so validation,
the workspace format and the layouts can all use it). The fp32 scalars are computed in double, rounded once to
fp32; the K1 kernel, its launcher and the mirror reference take them from here."""

from __future__ import annotations

import struct
from math import e, log, log2


def f32(value: float) -> float:
    """``value`` rounded once to fp32, as a Python float that fp32 holds exactly."""
    return struct.unpack("f", struct.pack("f", value))[0]


CHUNK = 16  # tokens per tile: the chunk length the contract, the workspace and every kernel are written for
HEAD_DIM = 128  # K = V: the head dim the kernels and layouts are written for
SUPPORTED_HEAD_DIMS = (HEAD_DIM,)
# K = V that the forward kernels (K1, K2) are compiled for; an inference call at 64 runs them natively, other sizes
# (and training at 64, until the backward kernels take it) run zero-padded to 128 (cute_kda.call, "Head dims")
NATIVE_HEAD_DIMS = (64, HEAD_DIM)
SUPPORTED_VSPLITS = (1, 2, 4)  # K2: CTAs per (sequence, head), each owning D / vsplit value columns
SCAN_VSPLITS = (1, 2, 4, 8)  # Kernel A: K2's skeleton, one split more
IMAGE_RUN = 8  # elements of one 16-byte (bf16) run of a state image: a row of a K_INTER core matrix
ROUND_RUN = 8  # fp16 elements of one 16-byte load of the dO rounding pass (kernels/round_bf16.py)
LOG2E = f32(log2(e))
LN2 = f32(log(2.0))  # the backward: d 2^x / dx = ln2 · 2^x
EPS = f32(1e-6)  # l2norm: x · rsqrt(Σx² + EPS)

# the gate forms (docs/numerics.md): "safe" lower_bound · sigmoid(e^A · (g + dt_bias)); "softplus"
# −e^A · softplus(g + dt_bias) (unbounded below); "none": g is the log decay itself (any value ≤ 0)
GATES = ("safe", "softplus", "none")
# the unbounded gates' K1: straddle levels of blocks of 16, 8, 4 and 2 rows (docs/numerics.md, "dyadic")
DYADIC_BLOCKS = (CHUNK, CHUNK // 2, CHUNK // 4, CHUNK // 8)
# how the kernels compute a gate (docs/numerics.md): "safe" the bounded gate's decayed operands; "dyadic" the
# per-channel unbounded gates' straddle levels; "per_head" one decay per (token, head) and the pair decays E
GATE_SCHEMES = ("safe", "dyadic", "per_head")


def gate_scheme(gate: str, per_head_gate: bool) -> str:
    """The scheme (:data:`GATE_SCHEMES`) that computes ``gate`` per channel, or per head with ``per_head_gate``."""
    if gate == "safe":
        if per_head_gate:
            raise ValueError("a per-head gate (GatedDeltaNet's) takes gate 'softplus' or 'none'")
        return "safe"
    return "per_head" if per_head_gate else "dyadic"


def gate_constant(lower_bound: float) -> float:
    """``c_gate = f32(lower_bound · log2(e))``: the base-2 gate is ``c_gate · sigmoid(...)``."""
    return f32(lower_bound * log2(e))
