"""Print the support matrix of cute_kda's entry points, measured from the code: each cell is a small call on CPU
tensors taken through the entry's argument translation and :func:`cute_kda.call.resolve` (every check a real call
makes before it launches anything). ✓: accepted; ✗: refused with an error naming what is not supported.

    python3 scripts/support_matrix.py            # the markdown table docs/support.md holds

``tests/test_support_matrix.py`` regenerates the table and compares it with the docs, so they cannot drift.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cute_kda.call import resolve  # noqa: E402
from cute_kda.fla_calls import translate_fla_call, translate_fla_gdn_call  # noqa: E402

ENTRIES = (  # (entry point, gate)
    ("kda_forward", "safe"), ("kda_forward", "softplus"), ("kda_forward", "none"),
    ("chunk_kda", "safe"), ("chunk_kda", "softplus"), ("chunk_kda", "none"),
    ("chunk_gated_delta_rule", "softplus"), ("chunk_gated_delta_rule", "none"),
)
COLUMNS = {  # column title → the change from the base call (B = 2, T = 33, H = 2, bf16, K = V = 128, inference)
    "inference": {},
    "training": {"training": True},
    "packed sequences (int32 / int64 cu_seqlens)": {"packed": True},
    "grouped value heads": {"value_heads": 4},
    "grouped value heads, training": {"value_heads": 4, "training": True},
    "fp32 initial state": {"state": torch.float32},
    "bf16 initial state": {"state": torch.bfloat16},
    "fp16 initial state": {"state": torch.float16},
    "fp32 β": {"beta_dtype": torch.float32},
    "fp16 inputs": {"dtype": torch.float16},
    "fp16 inputs, training": {"dtype": torch.float16, "training": True},
    "head dim 64 (native kernels)": {"dim": 64},
    "K = 128, V = 256 (split)": {"value_dim": 256},
    "head dim 64, training": {"dim": 64, "training": True},
    "head dim 256": {"dim": 256},
}


def _tensors(gate: str, *, per_head: bool, heads: int = 2, value_heads: int = 2, dim: int = 128, value_dim: int = 128,
             dtype: torch.dtype = torch.bfloat16, beta_dtype: torch.dtype | None = None, packed: bool = False) -> dict:
    batch, seq_len = (1, 66) if packed else (2, 33)
    g_shape = (batch, seq_len, value_heads) if per_head else (batch, seq_len, value_heads, dim)
    t = dict(q=torch.zeros(batch, seq_len, heads, dim, dtype=dtype), k=torch.zeros(batch, seq_len, heads, dim, dtype=dtype),
             v=torch.zeros(batch, seq_len, value_heads, value_dim, dtype=dtype), g=torch.zeros(g_shape, dtype=dtype),
             beta=torch.zeros(batch, seq_len, value_heads, dtype=beta_dtype or dtype))
    if gate != "none":
        t["A_log"] = torch.zeros(value_heads)
        t["dt_bias"] = torch.zeros(value_heads if per_head else (value_heads, dim))
    return t


def _call(entry: str, gate: str, *, training: bool = False, packed: bool = False, value_heads: int = 2,
          state: torch.dtype | None = None, dtype: torch.dtype = torch.bfloat16, dim: int = 128,
          value_dim: int | None = None, beta_dtype: torch.dtype | None = None, cu_dtype: torch.dtype = torch.int64
          ) -> None:
    """Resolve one call; raises what the call would raise before any launch. ``value_dim`` None: ``dim``."""
    gdn = entry == "chunk_gated_delta_rule"
    value_dim = dim if value_dim is None else value_dim
    t = _tensors(gate, per_head=gdn, value_heads=value_heads, dim=dim, value_dim=value_dim, dtype=dtype,
                 beta_dtype=beta_dtype, packed=packed)
    num_seqs = 2
    cu_seqlens = torch.tensor([0, 33, 66], dtype=cu_dtype) if packed else None
    inner = (value_dim, dim) if entry == "kda_forward" else (dim, value_dim)  # v-first, FLA's default K-first
    h0 = None if state is None else torch.zeros(num_seqs, value_heads, *inner, dtype=state)
    if entry == "kda_forward":
        canonical = dict(t, gate=gate, initial_state=h0, cu_seqlens=cu_seqlens)
    else:
        flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, initial_state=h0,
                     cu_seqlens=cu_seqlens, use_gate_in_kernel=gate != "none")
        if gdn:
            made = translate_fla_gdn_call(**t, **flags)
        else:
            if gate == "safe":
                flags.update(safe_gate=True, lower_bound=-5.0)
            made = translate_fla_call(**t, **flags)
        q, k, v, g, beta = made.tensors
        canonical = dict(q=q, k=k, v=v, g=g, beta=beta, **made.options)
    resolve(**canonical, training=training)


def _accepts(entry: str, gate: str, change: dict) -> bool:
    try:
        _call(entry, gate, **change)
        if change.get("packed"):
            _call(entry, gate, **change, cu_dtype=torch.int32)
    except (TypeError, ValueError, NotImplementedError):
        return False
    return True


def matrix(accepts: Callable[[str, str, dict], bool] = _accepts) -> list[tuple[str, str, list[bool]]]:
    """(entry point, gate, one flag per :data:`COLUMNS` column) for every row of :data:`ENTRIES`."""
    return [(entry, gate, [accepts(entry, gate, change) for change in COLUMNS.values()]) for entry, gate in ENTRIES]


def markdown() -> str:
    """The support matrix as a markdown table."""
    header = "| entry point | gate | " + " | ".join(COLUMNS) + " |"
    rule = "|" + "---|" * (len(COLUMNS) + 2)
    rows = [f"| `{entry}` | {gate} | " + " | ".join("✓" if ok else "✗" for ok in flags) + " |"
            for entry, gate, flags in matrix()]
    return "\n".join([header, rule, *rows])


if __name__ == "__main__":
    print(markdown())
