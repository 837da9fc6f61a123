"""Hash the sm_90a PTX of every kernel variant the package ships, on the CPU: a refactor check.

Compiles each variant of K1 (``kernels/fwd_prepare/``), K2 (``kernels/fwd_recurrence.py``), Kernel A
(``kernels/bwd_scan.py``), Kernel B (``kernels/bwd_grads/``) and the varlen tile prefix
(``kernels/tile_prefix.py``) from fake tensors (``meta`` tensors through the launchers' own
``launch_arguments``, so ranks, dtypes and alignments are what ships) and prints
``{variant: sha256 of the normalized PTX}`` as JSON. Run it before and after a change that should not change
the code (``--out`` both, then ``--compare``): equal hashes mean byte-identical PTX up to the normalization.

The variants: every combination the launchers can key (``ops/*.compiled_variant``) and ``api.warmup`` visits,
plus the knobs only tests and benchmarks set (K1's 256 threads, Kernel A's tuning grid of
``benchmarks/explore_bwd_scan.py``, K2's and Kernel A's blocks of 4 tiles, Kernel B at 4 warps), K1's and K2's
pair variants (the two-tile prefill: ``k1/pairs/…``, ``k2/pairs/…``; the training form's K1 with the pair partners'
fields, ``k1/pairs/partners/…``, and K2, ``k2/pairs/training/…``
and ``k2/pairs/states/…`` without o, Kernel A's two-tile scan, ``ka/pairs/…``, Kernel B's rebuild,
``kb/…/pair_rebuild``), K2's passes for their states alone
(``k2/states/…``: the backward's recomputation, a segmented call's segment-state passes), and the fp16
forward (``k1/fp16/…``, ``k2/fp16/…``, with checkpoints for training; no pools; fp16 training's backward runs the
bf16 Kernel A and Kernel B variants, or under ``FP16_NATIVE_BACKWARD`` Kernel B on fp16 inputs, ``kb/fp16/…`` at 8
warps; grouped value heads also with ``…/group_sum``), and the K = V = 64 forward (``k1/d64/…``, ``k2/d64/…``:
inference).

Normalized (everything else is hashed as the compiler wrote it):

- debug and line information: ``.loc`` and ``.file`` lines, and ``.section .debug_*`` blocks (DWARF);
- the names of the ``.entry`` functions, which the DSL mangles from the Python module, class and method
  names and the kernel's arguments: each becomes ``kernel_<i>`` (``i`` its order in the PTX), everywhere it
  occurs (its ``_param_<n>`` names included).

Usage::

    PYTHONPATH=$PWD python scripts/ptx_hashes.py --out before.json [--only k1/] [--jobs 2]
    PYTHONPATH=$PWD python scripts/ptx_hashes.py --out after.json --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STATES = ("none", "bf16", "fp32")
FLAGS = list(itertools.product((False, True), (True, False), (True, False)))  # varlen, qk_l2norm, beta_logits
# gate forms: (gate, g dtype, per-head gate)
PER_CHANNEL_GATES = [("safe", "bf16", False), ("softplus", "bf16", False), ("none", "bf16", False),
                     ("none", "fp32", False)]
PER_HEAD_GATES = [("softplus", "bf16", True), ("none", "bf16", True), ("none", "fp32", True)]
FP16_STATES = ("none", "bf16", "fp32", "fp16")  # K2's fp16 variants: states of every kind, fp16 not beside fp32
SCAN_TUNING_GRID = {1: (4, 8), 2: (4, 8), 4: (4,), 8: (2,)}  # benchmarks/explore_bwd_scan.py's GRID

_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug\w*\s*\{.*?^\s*\}\s*$\n?", re.M | re.S)
_DEBUG_LINE = re.compile(r"^\s*\.(?:loc|file)\b.*$\n?", re.M)
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)")


def normalize(ptx: str) -> str:
    """``ptx`` without debug / line information and with its entry names replaced (module docstring)."""
    ptx = _DEBUG_SECTION.sub("", ptx)
    ptx = _DEBUG_LINE.sub("", ptx)
    names = list(dict.fromkeys(_ENTRY.findall(ptx)))
    for index, name in sorted(enumerate(names), key=lambda item: -len(item[1])):
        ptx = ptx.replace(name, f"kernel_{index}")
    return ptx


def _label(flag: bool, yes: str, no: str) -> str:
    return yes if flag else no


def _flags_label(varlen: bool, qk_l2norm: bool, beta_logits: bool) -> str:
    return "/".join((_label(varlen, "varlen", "fixed"), _label(qk_l2norm, "l2norm", "raw_qk"),
                     _label(beta_logits, "beta_logits", "beta")))


def _gate_label(gate: str, g_dtype: str, per_head: bool, grouped: bool) -> str:
    return f"{gate}-{g_dtype}" + _label(per_head, "-per_head", "") + _label(grouped, "-grouped", "")


def variants() -> dict[str, tuple]:
    """Every variant: name → (kernel, its keyword arguments), in a stable order."""
    found: dict[str, tuple] = {}
    for gate, g_dtype, per_head in PER_CHANNEL_GATES + PER_HEAD_GATES:
        for grouped in (False, True):
            for flags in FLAGS:
                name = f"k1/{_gate_label(gate, g_dtype, per_head, grouped)}/{_flags_label(*flags)}"
                found[name] = ("k1", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate=gate,
                                             g_dtype=g_dtype, per_head_gate=per_head, grouped=grouped))
    for varlen in (False, True):  # tests/test_fwd_prepare.py's 256-thread safe-gate K1
        found[f"k1/safe-bf16/{_flags_label(varlen, True, True)}/256threads"] = (
            "k1", dict(varlen=varlen, qk_l2norm=True, beta_logits=True, gate="safe", g_dtype="bf16",
                       per_head_gate=False, grouped=False, num_threads=256, ctas_per_sm=5))
    for dim, flags in itertools.product((D, 64), FLAGS):  # the pair workspace of the two-tile serial step
        found[f"k1/pairs/d{dim}/{_flags_label(*flags)}"] = (
            "k1", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate="safe", g_dtype="bf16",
                       per_head_gate=False, grouped=False, dim=dim, pairs=True))
        for gate, g_dtype, per_head in PER_HEAD_GATES:  # and of the per-head gates, grouped value heads
            found[f"k1/pairs/d{dim}/{_gate_label(gate, g_dtype, per_head, True)}/{_flags_label(*flags)}"] = (
                "k1", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate=gate, g_dtype=g_dtype,
                           per_head_gate=True, grouped=True, dim=dim, pairs=True))
            # the training form's recomputation: the pair partners' fields too
            found[f"k1/pairs/partners/d{dim}/{_gate_label(gate, g_dtype, per_head, True)}/{_flags_label(*flags)}"] = (
                "k1", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate=gate, g_dtype=g_dtype,
                           per_head_gate=True, grouped=True, dim=dim, pairs=True, partners=True))
    for vsplit, initial, final, varlen, checkpoints in itertools.product((1, 2, 4), STATES, STATES, (False, True),
                                                                       (False, True)):
        name = f"k2/vs{vsplit}/{initial}-{final}/{_label(varlen, 'varlen', 'fixed')}" + _label(
            checkpoints, "/checkpoints", "")
        found[name] = ("k2", dict(vsplit=vsplit, initial=initial, final=final, varlen=varlen, checkpoints=checkpoints))
    for varlen in (False, True):
        found[f"k2/vs1/fp32-fp32/{_label(varlen, 'varlen', 'fixed')}/checkpoints/every4"] = (
            "k2", dict(vsplit=1, initial="fp32", final="fp32", varlen=varlen, checkpoints=True, checkpoint_every=4))
    for vsplit, pool, varlen, every in itertools.product((1, 2, 4), ("bf16", "fp32"), (False, True), (0, 64)):
        found[f"k2/vs{vsplit}/{pool}-pool/{_label(varlen, 'varlen', 'fixed')}" + (f"/prefix{every}" if every else "")] = (
            "k2", dict(vsplit=vsplit, initial=pool, final=pool, varlen=varlen, checkpoints=False, state_pool=True,
                       prefix_checkpoint_every=every))
    for vsplit, dht, dh0, varlen, every in itertools.product((1, 2, 4, 8), STATES, STATES, (False, True), (1, 4)):
        base = f"ka/vs{vsplit}/{dht}-{dh0}/{_label(varlen, 'varlen', 'fixed')}/every{every}"
        found[base] = ("ka", dict(vsplit=vsplit, dht=dht, dh0=dh0, varlen=varlen, snapshot_every=every))
        if dh0 != "none":  # the context-parallel backward's local pass
            found[base + "/no_token_outputs"] = ("ka", dict(vsplit=vsplit, dht=dht, dh0=dh0, varlen=varlen,
                                                            snapshot_every=every, token_outputs=False))
    for dim, vsplit, (dht, dh0), varlen in itertools.product((D, 64), (1, 2, 4, 8), (("fp32", "fp32"), ("bf16", "bf16"),
                                                                                   ("none", "fp32")), (False, True)):
        found[f"ka/pairs/d{dim}/vs{vsplit}/{dht}-{dh0}/{_label(varlen, 'varlen', 'fixed')}"] = (
            "ka", dict(vsplit=vsplit, dht=dht, dh0=dh0, varlen=varlen, snapshot_every=2, dim=dim, pairs=True))
    for vsplit, warps_grid in SCAN_TUNING_GRID.items():
        for warps, stages, split in itertools.product(warps_grid, (2, 4), (False, True)):
            name = f"ka/vs{vsplit}/fp32-fp32/varlen/every1/warps{warps}-stages{stages}" + _label(split, "-split", "")
            found[name] = ("ka", dict(vsplit=vsplit, dht="fp32", dh0="fp32", varlen=True, snapshot_every=1,
                                      compute_warps=warps, output_stages=stages, split_accumulator=split))
    for gate, g_dtype, per_head in PER_CHANNEL_GATES + PER_HEAD_GATES:
        for grouped in (False, True) if gate != "safe" else (False,):
            for flags in FLAGS:
                for warps in (8, 4):
                    name = f"kb/{_gate_label(gate, g_dtype, per_head, grouped)}/{_flags_label(*flags)}/warps{warps}"
                    found[name] = ("kb", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate=gate,
                                              g_dtype=g_dtype, per_head_gate=per_head, grouped=grouped,
                                              compute_warps=warps))
                    if grouped:  # a pair of value heads added by the kernel (GradsVariant.group_sum)
                        found[name + "/group_sum"] = ("kb", {**found[name][1], "group_sum": True})
                    # the two-tile training form (GradsVariant.pair_rebuild) as the step runs it: the default warps,
                    # GatedDeltaNet's pairs of value heads added by the kernel
                    if warps == 8 and (gate == "safe" or (per_head and grouped)):
                        base = name + ("/group_sum" if grouped else "")
                        found[base + "/pair_rebuild"] = ("kb", {**found[base][1], "pair_rebuild": True})
    for gate, g_dtype, per_head in PER_CHANNEL_GATES + PER_HEAD_GATES:  # fp16 inputs (inference): K1 and K2
        g_dtype = "fp16" if g_dtype == "bf16" else g_dtype
        for grouped, flags in itertools.product((False, True), FLAGS):
            name = f"k1/fp16/{_gate_label(gate, g_dtype, per_head, grouped)}/{_flags_label(*flags)}"
            found[name] = ("k1", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate=gate, g_dtype=g_dtype,
                                      per_head_gate=per_head, grouped=grouped, dtype="fp16"))
    for vsplit, initial, final, varlen, checkpoints in itertools.product((1, 2, 4), FP16_STATES, FP16_STATES,
                                                                         (False, True), (False, True)):
        if {initial, final} != {"fp16", "fp32"}:  # checkpoints: fp16 training's forward
            name = f"k2/fp16/vs{vsplit}/{initial}-{final}/{_label(varlen, 'varlen', 'fixed')}"
            found[name + ("/checkpoints" if checkpoints else "")] = (
                "k2", dict(vsplit=vsplit, initial=initial, final=final, varlen=varlen, checkpoints=checkpoints,
                           dtype="fp16"))
    for gate, g_dtype, per_head in PER_CHANNEL_GATES + PER_HEAD_GATES:  # fp16 training's own backward: Kernel B
        g_dtype = "fp16" if g_dtype == "bf16" else g_dtype  # on fp16 inputs, fp16 gradients where it stores them
        for grouped in (False, True) if gate != "safe" else (False,):
            grads = "fp16" if g_dtype == "fp16" and not grouped else "bf16"
            for flags in FLAGS:
                name = f"kb/fp16/{_gate_label(gate, g_dtype, per_head, grouped)}/{_flags_label(*flags)}/warps8"
                found[name] = ("kb", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate=gate,
                                          g_dtype=g_dtype, per_head_gate=per_head, grouped=grouped, compute_warps=8,
                                          dtype="fp16", grads=grads))
    for gate, g_dtype, per_head in PER_CHANNEL_GATES + PER_HEAD_GATES:  # K = V = 64 (inference): K1 and K2
        for grouped, flags in itertools.product((False, True), FLAGS):
            found[f"k1/d64/{_gate_label(gate, g_dtype, per_head, grouped)}/{_flags_label(*flags)}"] = (
                "k1", dict(zip(("varlen", "qk_l2norm", "beta_logits"), flags), gate=gate, g_dtype=g_dtype,
                           per_head_gate=per_head, grouped=grouped, dim=64))
    for vsplit, initial, final, varlen in itertools.product((1, 2, 4), STATES, STATES, (False, True)):
        found[f"k2/d64/vs{vsplit}/{initial}-{final}/{_label(varlen, 'varlen', 'fixed')}"] = (
            "k2", dict(vsplit=vsplit, initial=initial, final=final, varlen=varlen, checkpoints=False, dim=64))
    pair_states = (("none", "fp32"), ("bf16", "bf16"), ("fp32", "fp32"))
    for dim, vsplit, (initial, final), varlen in itertools.product((D, 64), (1, 2, 4), pair_states, (False, True)):
        found[f"k2/pairs/d{dim}/vs{vsplit}/{initial}-{final}/{_label(varlen, 'varlen', 'fixed')}"] = (
            "k2", dict(vsplit=vsplit, initial=initial, final=final, varlen=varlen, checkpoints=False, dim=dim,
                       pairs=True))
    for dim, vsplit, varlen in itertools.product((D, 64), (1, 2, 4), (False, True)):  # a checkpoint and U a pair
        found[f"k2/pairs/training/d{dim}/vs{vsplit}/{_label(varlen, 'varlen', 'fixed')}"] = (
            "k2", dict(vsplit=vsplit, initial="fp32", final="fp32", varlen=varlen, checkpoints=True, dim=dim,
                       pairs=True))
    # the two-tile form's recomputation for its states alone (a checkpoint and U a pair, no final state, no o)
    for dim, vsplit, initial, varlen in itertools.product((D, 64), (1, 2, 4), STATES, (False, True)):
        found[f"k2/pairs/states/d{dim}/vs{vsplit}/{initial}-none/{_label(varlen, 'varlen', 'fixed')}"] = (
            "k2", dict(vsplit=vsplit, initial=initial, final="none", varlen=varlen, checkpoints=True, dim=dim,
                       pairs=True, token_outputs=False))
    # passes for their states alone (no o): the backward's recomputation (checkpoints, no final state; fp16 training's
    # on the fp16 inputs) and a segmented call's passes for the segment states (a final state)
    for dim, vsplit, initial, varlen, dtype in itertools.product((D, 64), (1, 2, 4), STATES, (False, True),
                                                                 ("bf16", "fp16")):
        if dtype == "bf16" or dim == D:
            name = f"k2/states/{dtype}/d{dim}/vs{vsplit}/{initial}-none/{_label(varlen, 'varlen', 'fixed')}/checkpoints"
            found[name] = ("k2", dict(vsplit=vsplit, initial=initial, final="none", varlen=varlen, checkpoints=True,
                                      dim=dim, dtype=dtype, token_outputs=False))
    for dim, initial, dtype in itertools.product((D, 64), ("none", "fp32"), ("bf16", "fp16")):
        found[f"k2/states/{dtype}/d{dim}/vs1/{initial}-fp32/varlen"] = (
            "k2", dict(vsplit=1, initial=initial, final="fp32", varlen=True, checkpoints=False, dim=dim, dtype=dtype,
                       token_outputs=False))
    for pool, every in (("bf16", 0), ("fp32", 64)):  # the serving prefill on a pool, two tiles a step
        found[f"k2/pairs/pool-{pool}/prefix{every}"] = (
            "k2", dict(vsplit=2, initial=pool, final=pool, varlen=True, checkpoints=False, state_pool=True,
                       prefix_checkpoint_every=every, pairs=True))
    found["tile_prefix"] = ("tile_prefix", {})
    return found


# ------------------------------------------------------------------------------ compiles (in the workers)


def _torch_dtype(name: str | None) -> Any:
    import torch

    return {"none": None, None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _meta(*shape: int, dtype: Any = None) -> Any:
    import torch

    return torch.empty(shape, dtype=torch.bfloat16 if dtype is None else dtype, device="meta")


def _segmentation(varlen: bool, num_seqs: int) -> tuple:
    import torch

    if not varlen:
        return None, None
    return _meta(num_seqs + 1, dtype=torch.int64), _meta(num_seqs + 1, dtype=torch.int32)


def _workspace(heads: int, tiles: int, dim: int = 128) -> Any:
    from cute_kda.workspace import WorkspaceSpec, allocate_workspace

    return allocate_workspace(WorkspaceSpec(heads=heads, tiles=tiles, dim=dim), "meta")


D, T, HEADS, NUM_SEQS = 128, 32, 2, 2


def _k1(varlen: bool, qk_l2norm: bool, beta_logits: bool, gate: str, g_dtype: str, per_head_gate: bool,
        grouped: bool, dtype: str = "bf16", dim: int = D, pairs: bool = False, partners: bool = False,
        **tuning: int) -> tuple:
    import torch

    from cute_kda.kernels.fwd_prepare import prepare_kernel
    from cute_kda.workspace import WorkspaceSpec, allocate_cross_blocks, allocate_partner_fields
    from cute_kda.ops._cache import dsl_type, fake_stream, to_cute_tensor
    from cute_kda.ops.prepare import launch_arguments

    kernel = prepare_kernel(varlen=varlen, qk_l2norm=qk_l2norm, beta_logits=beta_logits, gate=gate,
                            dtype=dsl_type(_torch_dtype(dtype)), gate_dtype=dsl_type(_torch_dtype(g_dtype)),
                            per_head_gate=per_head_gate, grouped=grouped, dim=dim, pairs=pairs, **tuning)
    qk_heads = 1 if grouped else HEADS
    channels = () if per_head_gate else (dim,)
    q = _meta(1, T, qk_heads, dim, dtype=_torch_dtype(dtype))
    g = _meta(1, T, HEADS, *channels, dtype=_torch_dtype(g_dtype))
    constants = gate != "none"
    a_log = _meta(HEADS, dtype=torch.float32) if constants else None
    dt_bias = _meta(HEADS, *channels, dtype=torch.float32) if constants else None
    cu_seqlens, tile_base = _segmentation(varlen, NUM_SEQS)
    spec = WorkspaceSpec(heads=HEADS, tiles=4, dim=dim)
    cross = allocate_cross_blocks(spec, "meta") if pairs else None
    return kernel, launch_arguments(q, q, g, _meta(1, T, HEADS), a_log, dt_bias, _workspace(HEADS, 4, dim), dim ** -0.5,
                                    -5.0, T, cu_seqlens, tile_base, fake_stream(), tensor=to_cute_tensor, cross=cross,
                                    partners=allocate_partner_fields(spec, "meta") if partners else None)


def _k2(vsplit: int, initial: str, final: str, varlen: bool, checkpoints: bool, checkpoint_every: int = 1,
        state_pool: bool = False, prefix_checkpoint_every: int = 0, dtype: str = "bf16", dim: int = D,
        pairs: bool = False, token_outputs: bool = True) -> tuple:
    import torch

    from cute_kda.kernels.fwd_recurrence import FwdRecurrence
    from cute_kda.kernels.fwd_recurrence_pairs import PairRecurrence
    from cute_kda.ops._cache import dsl_type, fake_stream, to_cute_tensor
    from cute_kda.ops.recurrence import launch_arguments
    from cute_kda.workspace import CrossBlocks, block_states_shape, pair_blocks_shape, pair_u_shape

    every = {"token_outputs": token_outputs}
    if not pairs:  # the pair variant keeps one a pair
        every["checkpoint_every"] = checkpoint_every
    kernel = (PairRecurrence if pairs else FwdRecurrence)(vsplit=vsplit, initial_state=dsl_type(_torch_dtype(initial)),
                           final_state=dsl_type(_torch_dtype(final)), varlen=varlen, checkpoints=checkpoints,
                           state_pool=state_pool, prefix_checkpoint_every=prefix_checkpoint_every,
                           dtype=dsl_type(_torch_dtype(dtype)), dim=dim, **every)
    v, ws = _meta(1, T, HEADS, dim, dtype=_torch_dtype(dtype)), _workspace(HEADS, 4, dim)
    cu_seqlens, tile_base = _segmentation(varlen, NUM_SEQS)

    def state(name: str) -> Any:
        dtype = _torch_dtype(name)
        return None if dtype is None else _meta(NUM_SEQS, HEADS, dim, dim, dtype=dtype)

    kept = u_a = None
    if checkpoints:
        kept = _meta(*(pair_blocks_shape if pairs else block_states_shape)(ws, HEADS, NUM_SEQS))
        u_a = _meta(*pair_u_shape(ws, HEADS, NUM_SEQS)) if pairs else None
    slots = _meta(NUM_SEQS, dtype=torch.int32) if state_pool else None
    prefix_slots = _meta(NUM_SEQS, 2, dtype=torch.int32) if prefix_checkpoint_every else None
    out = v if token_outputs else None
    arguments = launch_arguments(v, ws, out, cu_seqlens=cu_seqlens, tile_base=tile_base, initial_state=state(initial),
                                 final_state=state(final), checkpoints=kept, state_indices=slots,
                                 checkpoint_indices=prefix_slots, tensor=to_cute_tensor, u_a=u_a,
                                 cross=CrossBlocks(*(torch.empty_like(ws.inv) for _ in range(2))) if pairs else None)
    return kernel, (*arguments, fake_stream())


def _ka(vsplit: int, dht: str, dh0: str, varlen: bool, snapshot_every: int, token_outputs: bool = True,
        dim: int = D, pairs: bool = False, **tuning: Any) -> tuple:
    import torch

    from cute_kda.kernels.bwd_scan import BwdScan
    from cute_kda.kernels.bwd_scan_pairs import PairBwdScan
    from cute_kda.ops._cache import dsl_type, fake_stream, to_cute_tensor
    from cute_kda.ops.bwd_scan import launch_arguments
    from cute_kda.workspace import CrossBlocks, block_states_shape, pair_blocks_shape

    kernel = (PairBwdScan if pairs else BwdScan)(
        vsplit=vsplit, dht=dsl_type(_torch_dtype(dht)), dh0=dsl_type(_torch_dtype(dh0)), varlen=varlen,
        snapshot_every=snapshot_every, token_outputs=token_outputs, dim=dim, **tuning)
    do, ws = _meta(1, T, HEADS, dim), _workspace(HEADS, 4, dim)
    cu_seqlens, tile_base = _segmentation(varlen, NUM_SEQS)

    def state(name: str) -> Any:
        dtype = _torch_dtype(name)
        return None if dtype is None else _meta(NUM_SEQS, HEADS, dim, dim, dtype=dtype)

    shape = pair_blocks_shape(ws, HEADS, NUM_SEQS) if pairs else block_states_shape(ws, HEADS, NUM_SEQS, snapshot_every)
    cross = CrossBlocks(*(torch.empty_like(ws.inv) for _ in range(2))) if pairs else None
    arguments = launch_arguments(do, ws, do, do, _meta(*shape), dht=state(dht), dh0=state(dh0), cu_seqlens=cu_seqlens,
                                 tile_base=tile_base, cross=cross, tensor=to_cute_tensor)
    return kernel, (*arguments, fake_stream())


def _kb(varlen: bool, qk_l2norm: bool, beta_logits: bool, gate: str, g_dtype: str, per_head_gate: bool,
        grouped: bool, compute_warps: int, dtype: str = "bf16", grads: str = "bf16", group_sum: bool = False,
        pair_rebuild: bool = False) -> tuple:
    import torch

    from cute_kda.kernels.bwd_grads import bwd_grads_kernel
    from cute_kda.ops._cache import dsl_type, fake_stream, to_cute_tensor
    from cute_kda.ops.bwd_grads import PairTensors, gate_partials_shapes, launch_arguments
    from cute_kda.workspace import block_states_shape, pair_blocks_shape, pair_u_shape

    kernel = bwd_grads_kernel(varlen=varlen, qk_l2norm=qk_l2norm, beta_logits=beta_logits,
                              compute_warps=compute_warps, gate=gate, gate_dtype=dsl_type(_torch_dtype(g_dtype)),
                              per_head_gate=per_head_gate, grouped=grouped, dtype=dsl_type(_torch_dtype(dtype)),
                              grad_dtype=dsl_type(_torch_dtype(grads)), group_sum=group_sum,
                              pair_rebuild=pair_rebuild)
    f32, inputs, stored = torch.float32, _torch_dtype(dtype), _torch_dtype(grads)
    qk, tokens, ws = _meta(1, T, 1 if grouped else HEADS, D, dtype=inputs), _meta(1, T, HEADS, D), _workspace(HEADS, 4)
    values = _meta(1, T, HEADS, D, dtype=inputs)
    grad_tokens = _meta(1, T, HEADS // 2 if group_sum else HEADS, D, dtype=stored)  # group_sum: per q/k head
    channels = () if per_head_gate else (D,)
    states = _meta(*(pair_blocks_shape if pair_rebuild else block_states_shape)(ws, HEADS, NUM_SEQS))
    pair = PairTensors(_meta(*pair_u_shape(ws, HEADS, NUM_SEQS)), tokens, ws) if pair_rebuild else None
    ddt_shape, dalog_shape = gate_partials_shapes(ws, HEADS, per_head_gate)
    constants = gate != "none"
    cu_seqlens, tile_base = _segmentation(varlen, NUM_SEQS)
    arguments = launch_arguments(
        qk, qk, _meta(1, T, HEADS, *channels, dtype=_torch_dtype(g_dtype)), values, tokens, tokens,
        _meta(HEADS, dtype=f32) if constants else None, _meta(HEADS, *channels, dtype=f32) if constants else None,
        ws, states, states, grad_tokens, grad_tokens,
        _meta(1, T, HEADS, *channels, dtype=f32 if per_head_gate else stored),
        _meta(1, T, HEADS), _meta(*ddt_shape, dtype=f32) if constants else None,
        _meta(*dalog_shape, dtype=f32) if constants else None, scale=D ** -0.5, lower_bound=-5.0,
        cu_seqlens=cu_seqlens, tile_base=tile_base, pair=pair, tensor=to_cute_tensor)
    return kernel, (*arguments, fake_stream())


def _tile_prefix() -> tuple:
    import torch

    from cute_kda.kernels.tile_prefix import TilePrefixKernel
    from cute_kda.ops._cache import fake_stream, to_cute_tensor

    return TilePrefixKernel(), (to_cute_tensor(_meta(3, dtype=torch.int64), 8),
                                to_cute_tensor(_meta(3, dtype=torch.int32), 4), fake_stream())


BUILDERS: dict[str, Callable[..., tuple]] = {"k1": _k1, "k2": _k2, "ka": _ka, "kb": _kb, "tile_prefix": _tile_prefix}


def ptx_hash(item: tuple[str, tuple]) -> tuple[str, str, float]:
    """(name, sha256 of the normalized PTX, compile seconds) of one variant."""
    from cute_kda.dsl import cute

    name, (kind, keywords) = item
    start = time.perf_counter()
    kernel, arguments = BUILDERS[kind](**keywords)
    with tempfile.TemporaryDirectory() as dump_dir:  # --keep-ptx writes a file; keep it out of the tree
        compiled = cute.compile(kernel, *arguments, options=f"--keep-ptx --dump-dir={dump_dir}")
        ptx = compiled.__ptx__
    return name, hashlib.sha256(normalize(ptx).encode()).hexdigest(), time.perf_counter() - start


def compare(hashes: dict[str, str], baseline: dict[str, str]) -> int:
    """Print the differences; return the number of variants that differ or are missing on either side."""
    same = sorted(name for name in hashes if baseline.get(name) == hashes[name])
    changed = sorted(name for name in hashes if name in baseline and baseline[name] != hashes[name])
    new = sorted(set(hashes) - set(baseline))
    missing = sorted(set(baseline) - set(hashes))
    for label, names in (("different", changed), ("not in the baseline", new), ("not compiled here", missing)):
        for name in names:
            print(f"{label}: {name}")
    print(f"{len(same)} identical, {len(changed)} different, {len(new)} new, {len(missing)} not compiled here")
    return len(changed) + len(new) + len(missing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here (else print it)")
    parser.add_argument("--only", default="", help="only the variants whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--compare", help="a baseline JSON: report identical / different variants, exit 1 on any "
                                          "difference (with --only, only the selected variants are compared)")
    parser.add_argument("--list", action="store_true", help="print the variant names and exit")
    args = parser.parse_args()
    selected = {name: spec for name, spec in variants().items() if args.only in name}
    if args.list:
        print("\n".join(selected))
        return
    start = time.perf_counter()
    items = list(selected.items())
    if args.jobs > 1:  # spawn: the DSL's MLIR context is not fork-safe
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(ptx_hash, items, chunksize=1)
    else:
        results = [ptx_hash(item) for item in items]
    hashes = {name: digest for name, digest, _ in results}
    slowest = max(results, key=lambda r: r[2], default=("", "", 0.0))
    print(f"{len(hashes)} variants in {time.perf_counter() - start:.0f} s "
          f"(slowest {slowest[0]}: {slowest[2]:.1f} s)", file=sys.stderr)
    text = json.dumps(hashes, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    elif not args.compare:
        print(text)
    if args.compare:
        baseline = json.loads(Path(args.compare).read_text())
        if args.only:
            baseline = {name: digest for name, digest in baseline.items() if args.only in name}
        sys.exit(1 if compare(hashes, baseline) else 0)


if __name__ == "__main__":
    main()
