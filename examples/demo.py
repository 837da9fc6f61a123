"""cute_kda demo: real work wherever it runs.

Everywhere: builds a small KDA problem (packed sequences, an fp32 initial state), runs the fp64
gold recurrence and the chunk-16 mirror of the kernels' rounding and prints how far apart they are;
runs an FLA-style ``chunk_kda`` call through the drop-in's argument translation, on the mirror.
Without a GPU: compiles the forward kernels for sm_90a and prints what the compiler made of them
(registers, spills, shared memory plan, instructions of note): both K1 variants, the varlen tile
prefix kernel, three of K2's 54 variants chosen to take every V-split, state dtype and varlen value
(``--all-variants``: all 54), and the transpose round trip. With a GPU: runs ``kda_forward``,
checks it against both references and times it.

    python examples/demo.py            # or: make demo
    python examples/demo.py --no-compile
    python examples/demo.py --all-variants   # all 54 K2 variants in the compile report instead of 3
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

D = 128
LOWER_BOUND = -5.0
NOTABLE = (
    ("TMA", "cp.async.bulk.tensor"),
    ("mma.sync", "mma.sync.aligned"),
    ("ldmatrix", "ldmatrix.sync.aligned"),
    ("stmatrix", "stmatrix.sync.aligned"),
    ("movmatrix", "movmatrix.sync.aligned"),
    ("tanh.approx", "tanh.approx.f32"),
    ("ex2.approx.ftz", "ex2.approx.ftz.f32"),
    ("mbarrier wait", "mbarrier.try_wait"),
)


def heading(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def make_problem(lengths: list[int], heads: int, device: torch.device, seed: int = 0) -> dict:
    """kda_forward inputs for packed sequences of ``lengths`` (B = 1), with an fp32 initial state."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    tokens = sum(lengths)
    bounds = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return dict(
        q=randn(1, tokens, heads, D), k=randn(1, tokens, heads, D), v=randn(1, tokens, heads, D),
        g=randn(1, tokens, heads, D), beta=randn(1, tokens, heads),
        A_log=torch.rand(heads, generator=gen, device=device), dt_bias=randn(heads, D, dtype=torch.float32),
        lower_bound=LOWER_BOUND, cu_seqlens=bounds.to(device),
        initial_state=0.1 * randn(len(lengths), heads, D, D, dtype=torch.float32), output_final_state=True,
    )


def references(problem: dict) -> tuple:
    """(gold o, gold state) in fp64 and (mirror o, mirror state), printed against each other."""
    from cute_kda.reference import gold_forward, intrinsics_exact, mirror_forward, rel_rms

    tensors = [problem[n] for n in ("q", "k", "v", "g", "beta")]
    options = {n: x for n, x in problem.items() if n not in ("q", "k", "v", "g", "beta")}
    start = time.perf_counter()
    gold = gold_forward(*tensors, **options, gate="safe", state_layout="vk")
    gold_s = time.perf_counter() - start
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # said below instead
        mirror = mirror_forward(*tensors, **options)
    mirror_s = time.perf_counter() - start
    device = tensors[0].device
    print(f"gold (fp64 token recurrence): {gold_s:.2f}s   mirror (chunk-16, kernels' rounding): {mirror_s:.2f}s")
    if not intrinsics_exact(device):
        print("  (on the CPU the mirror replaces tanh.approx/ex2.approx by accurate torch functions)")
    print(f"mirror vs gold rel-RMS: o {rel_rms(mirror[0], gold[0]):.2e}, final state {rel_rms(mirror[1], gold[1]):.2e}"
          "   (docs/design.md §5: FlashKDA's kernels measure ~5.8e-3 / 4.8e-3 at T = 2048)")
    return gold, mirror


def fla_translation(problem: dict, gold: tuple) -> None:
    """An FLA chunk_kda call ([N, H, K, V] state, dt_bias [H*K]) through the drop-in's translation, on the mirror."""
    from cute_kda.fla_calls import translate_fla_call
    from cute_kda.reference import mirror_forward, rel_rms

    heads = problem["q"].shape[2]
    call = translate_fla_call(
        *(problem[n] for n in ("q", "k", "v", "g", "beta")),
        initial_state=problem["initial_state"].transpose(-1, -2).contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
        lower_bound=LOWER_BOUND, cu_seqlens=problem["cu_seqlens"], A_log=problem["A_log"],
        dt_bias=problem["dt_bias"].reshape(heads * D),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        o, state_kv = call.run(mirror_forward)
    print(f"FLA-style chunk_kda call (state [N,H,K,V], dt_bias [H*K]) -> kda_forward(qk_l2norm="
          f"{call.options['qk_l2norm']}, beta_logits={call.options['beta_logits']}, lower_bound="
          f"{call.options['lower_bound']}); run on the mirror:")
    print(f"  vs gold rel-RMS: o {rel_rms(o, gold[0]):.2e}, final state (back in [N,H,K,V]) "
          f"{rel_rms(state_kv, gold[1].transpose(-1, -2)):.2e}")


# ---------------------------------------------------------------------------------------------
# compile for sm_90a without a GPU


@dataclass(frozen=True)
class KernelBuild:
    """One kernel variant to compile: ``build()`` → (jit callable, arguments, smem plan or None)."""

    label: str
    build: Callable[[], tuple]


def _prepare_build(varlen: bool, gate: str = "safe", g_dtype: torch.dtype = torch.bfloat16,
                   gdn: bool = False) -> Callable[[], tuple]:
    """K1 of one gate; ``gdn``: GatedDeltaNet's per-head gate with two value heads per q/k head."""
    def build():
        from cute_kda.dsl import cute
        from cute_kda.kernels.fwd_prepare import prepare_kernel
        from cute_kda.ops import prepare as k1
        from cute_kda.ops._cache import dsl_type, to_cute_tensor
        from cute_kda.workspace import WorkspaceSpec, allocate_workspace, tiles_per_head

        lengths = [40, 9] if varlen else [49]
        heads, tokens = 2, sum(lengths)
        value_heads = 2 * heads if gdn else heads
        x = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
        g = torch.zeros(1, tokens, value_heads, *(() if gdn else (D,)), dtype=g_dtype)
        beta = torch.zeros(1, tokens, value_heads, dtype=torch.bfloat16)
        spec = WorkspaceSpec(heads=value_heads, tiles=tiles_per_head(tokens, len(lengths), varlen))
        cu_seqlens = torch.tensor([0, 40, tokens]) if varlen else None
        tile_base = torch.tensor([0, 3, 4], dtype=torch.int32) if varlen else None
        constants = gate != "none"
        args = k1.launch_arguments(
            x, x, g, beta, torch.zeros(value_heads) if constants else None,
            torch.zeros(value_heads, *(() if gdn else (D,))) if constants else None, allocate_workspace(spec, "cpu"),
            D ** -0.5, LOWER_BOUND, tokens, cu_seqlens, tile_base, cute.runtime.make_fake_stream(),
            tensor=to_cute_tensor,
        )
        kernel = prepare_kernel(varlen=varlen, gate=gate, gate_dtype=dsl_type(g_dtype), per_head_gate=gdn, grouped=gdn)
        return kernel, args, kernel.smem_budget()  # the plan the kernel's launch asks for
    return build


def _recurrence_build(varlen: bool, state: torch.dtype | None, vsplit: int,
                      state_out: object = "same") -> Callable[[], tuple]:
    """K2 with ``state`` in and ``state_out`` out (``"same"``: ``state`` at both ends)."""
    out_dtype = state if state_out == "same" else state_out

    def build():
        from cute_kda.dsl import cute, cutlass
        from cute_kda.kernels.fwd_recurrence import FwdRecurrence
        from cute_kda.layouts import k2_budget
        from cute_kda.ops import recurrence as k2
        from cute_kda.ops._cache import to_cute_tensor
        from cute_kda.workspace import WorkspaceSpec, allocate_workspace, tiles_per_head

        lengths = [40, 9] if varlen else [49]
        heads, tokens = 2, sum(lengths)
        v = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
        spec = WorkspaceSpec(heads=heads, tiles=tiles_per_head(tokens, len(lengths), varlen))

        def states(dtype):
            return None if dtype is None else torch.zeros(len(lengths), heads, D, D, dtype=dtype)
        args = k2.launch_arguments(
            v, allocate_workspace(spec, "cpu"), torch.zeros_like(v),
            cu_seqlens=torch.tensor([0, 40, tokens]) if varlen else None,
            tile_base=torch.tensor([0, 3, 4], dtype=torch.int32) if varlen else None,
            initial_state=states(state), final_state=states(out_dtype), tensor=to_cute_tensor,
        )
        dsl = {None: None, torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}
        kernel = FwdRecurrence(vsplit=vsplit, initial_state=dsl[state], final_state=dsl[out_dtype], varlen=varlen)
        return kernel, (*args, cute.runtime.make_fake_stream()), k2_budget(kernel.plan)
    return build


def _bwd_scan_build(varlen: bool, state: torch.dtype | None, vsplit: int) -> Callable[[], tuple]:
    """Kernel A (the backward's reverse scan) with dht in and dh0 out of dtype ``state``."""

    def build():
        from cute_kda.dsl import cute
        from cute_kda.kernels.bwd_scan import BwdScan
        from cute_kda.layouts import k2_budget
        from cute_kda.ops import bwd_scan as ka
        from cute_kda.ops._cache import dsl_type, to_cute_tensor
        from cute_kda.workspace import WorkspaceSpec, allocate_workspace, block_states_shape, tiles_per_head

        lengths = [40, 9] if varlen else [49]
        heads, tokens = 2, sum(lengths)
        do = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
        ws = allocate_workspace(WorkspaceSpec(heads=heads, tiles=tiles_per_head(tokens, len(lengths), varlen)), "cpu")
        states = None if state is None else torch.zeros(len(lengths), heads, D, D, dtype=state)
        args = ka.launch_arguments(
            do, ws, torch.zeros_like(do), torch.zeros_like(do),
            torch.zeros(block_states_shape(ws, heads, len(lengths)), dtype=torch.bfloat16),
            dht=states, dh0=states, cu_seqlens=torch.tensor([0, 40, tokens]) if varlen else None,
            tile_base=torch.tensor([0, 3, 4], dtype=torch.int32) if varlen else None, tensor=to_cute_tensor,
        )
        kernel = BwdScan(vsplit=vsplit, dht=dsl_type(state), dh0=dsl_type(state), varlen=varlen)
        return kernel, (*args, cute.runtime.make_fake_stream()), k2_budget(kernel.plan)
    return build


def _bwd_grads_build(varlen: bool, gate: str = "safe", per_head: bool = True) -> Callable[[], tuple]:
    """Kernel B (the backward's tile gradients): the safe gate, or an unbounded ``gate`` — GatedDeltaNet's per
    head (``per_head``) with two value heads per q/k head, or Kimi-Linear's per channel (the dyadic variant)."""

    def build():
        import cutlass

        from cute_kda.dsl import cute
        from cute_kda.kernels.bwd_grads import bwd_grads_kernel
        from cute_kda.ops import bwd_grads as kb
        from cute_kda.ops._cache import to_cute_tensor
        from cute_kda.workspace import WorkspaceSpec, allocate_workspace, block_states_shape, tiles_per_head

        lengths = [40, 9] if varlen else [49]
        gdn = per_head and gate != "safe"
        heads, tokens = 2, sum(lengths)
        value_heads = 2 * heads if gdn else heads
        qk = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
        tok = torch.zeros(1, tokens, value_heads, D, dtype=torch.bfloat16)
        g = torch.zeros(1, tokens, value_heads, dtype=torch.bfloat16) if gdn else tok
        ws = allocate_workspace(WorkspaceSpec(heads=value_heads, tiles=tiles_per_head(tokens, len(lengths), varlen)),
                                "cpu")
        states = torch.zeros(block_states_shape(ws, value_heads, len(lengths)), dtype=torch.bfloat16)
        ddt_shape, dalog_shape = kb.gate_partials_shapes(ws, value_heads, gdn)
        constants = gate != "none"
        args = kb.launch_arguments(
            qk, qk, g, tok, tok, tok, torch.zeros(value_heads) if constants else None,
            (torch.zeros(value_heads) if gdn else torch.zeros(heads, D)) if constants else None, ws, states,
            states, tok, tok, torch.zeros(1, tokens, value_heads) if gdn else tok,
            torch.zeros(1, tokens, value_heads, dtype=torch.bfloat16), torch.zeros(ddt_shape) if constants else None,
            torch.zeros(dalog_shape) if constants else None, scale=D ** -0.5, lower_bound=LOWER_BOUND,
            cu_seqlens=torch.tensor([0, 40, tokens]) if varlen else None,
            tile_base=torch.tensor([0, 3, 4], dtype=torch.int32) if varlen else None, tensor=to_cute_tensor,
        )
        kernel = bwd_grads_kernel(varlen=varlen, gate=gate, gate_dtype=cutlass.BFloat16, per_head_gate=gdn,
                                  grouped=gdn)
        return kernel, (*args, cute.runtime.make_fake_stream()), kernel.smem_budget()
    return build


def _roundtrip_build() -> tuple:
    from cute_kda.dsl import cute, cutlass
    from cute_kda.ops._cache import to_cute_tensor
    from teaching.kernels.transpose_roundtrip import TransposeRoundTrip

    x = torch.zeros(48, 2, D, dtype=torch.bfloat16)
    y = torch.zeros(3 * D, 2, 16, dtype=torch.bfloat16)
    args = (to_cute_tensor(x), to_cute_tensor(y), cutlass.Int32(1), cute.runtime.make_fake_stream())
    return TransposeRoundTrip(D), args, None


def _tile_prefix_build() -> tuple:
    from cute_kda.dsl import cute
    from cute_kda.kernels.tile_prefix import TilePrefixKernel
    from cute_kda.ops._cache import to_cute_tensor

    cu_seqlens, tile_base = torch.tensor([0, 40, 49]), torch.zeros(3, dtype=torch.int32)
    return TilePrefixKernel(), (to_cute_tensor(cu_seqlens, 8), to_cute_tensor(tile_base, 4),
                                cute.runtime.make_fake_stream()), None


STATE_NAMES = {None: "no state", torch.bfloat16: "bf16", torch.float32: "fp32"}
# K2 has 3 V-splits x 3 initial-state x 3 final-state modes x 2 (varlen or not) = 54 variants. By
# default the demo compiles three that together take every V-split, state dtype and varlen value
# once; --all-variants compiles all 54 (about a minute and a half on a CPU).
K2_DEFAULT = ((False, None, 1, None), (False, torch.bfloat16, 2, torch.bfloat16), (True, torch.float32, 4, torch.float32))


def k2_variants(all_variants: bool) -> list[tuple]:
    """(varlen, initial-state dtype, V-split, final-state dtype) of the K2 variants the report covers."""
    if not all_variants:
        return list(K2_DEFAULT)
    return [(varlen, state_in, vsplit, state_out) for varlen in (False, True) for vsplit in (1, 2, 4)
            for state_in in STATE_NAMES for state_out in STATE_NAMES]


def _k2_label(varlen: bool, state_in: torch.dtype | None, vsplit: int, state_out: torch.dtype | None) -> str:
    states = STATE_NAMES[state_in] if state_in == state_out else f"{STATE_NAMES[state_in]} in, {STATE_NAMES[state_out]} out"
    if state_in == state_out and state_in is not None:
        states += " state"
    return f"K2 recurrence ({'varlen' if varlen else 'fixed'}, {states}, vsplit {vsplit})"


def kernel_builds(all_variants: bool) -> list[KernelBuild]:
    """What the compile report covers: K1 (both variants of the safe gate, two of the unbounded gates'), the tile prefix, K2 (:func:`k2_variants`), two of
    Kernel A's 72 variants (V-split 1 and 8; the compile tier builds all), Kernel B (the safe gate, the per-head
    gate and the per-channel softplus gate), the round trip."""
    return [
        KernelBuild("K1 prepare (fixed length)", _prepare_build(varlen=False)),
        KernelBuild("K1 prepare (varlen)", _prepare_build(varlen=True)),
        KernelBuild("K1 prepare, softplus gate (fixed length)", _prepare_build(False, "softplus")),
        KernelBuild("K1 prepare, fp32 log decay (varlen)", _prepare_build(True, "none", torch.float32)),
        KernelBuild("K1 prepare, GatedDeltaNet softplus per-head gate, HV = 2H (varlen)",
                    _prepare_build(True, "softplus", gdn=True)),
        KernelBuild("tile prefix (varlen tile bases)", _tile_prefix_build),
        *(KernelBuild(_k2_label(varlen, state_in, vsplit, state_out),
                      _recurrence_build(varlen, state_in, vsplit, state_out))
          for varlen, state_in, vsplit, state_out in k2_variants(all_variants)),
        KernelBuild("Kernel A backward scan (fixed, fp32 dht/dh0, vsplit 1)", _bwd_scan_build(False, torch.float32, 1)),
        KernelBuild("Kernel A backward scan (varlen, bf16 dht/dh0, vsplit 8)", _bwd_scan_build(True, torch.bfloat16, 8)),
        KernelBuild("Kernel B tile gradients (varlen, safe gate)", _bwd_grads_build(True)),
        KernelBuild("Kernel B tile gradients, GatedDeltaNet softplus per-head gate, HV = 2H (fixed length)",
                    _bwd_grads_build(False, "softplus")),
        KernelBuild("Kernel B tile gradients, softplus gate per channel (varlen)",
                    _bwd_grads_build(True, "softplus", per_head=False)),
        KernelBuild("transpose round trip", _roundtrip_build),
    ]


def compile_kernels(all_variants: bool = False) -> None:
    from cute_kda.compile_report import compile_with_report

    if all_variants:
        print("K2: all 54 variants (V-split 1/2/4 x initial state none/bf16/fp32 x final state none/bf16/fp32 x varlen)")
    else:
        print("K2: 3 of its 54 variants, together taking every V-split, state dtype and varlen value once "
              "(--all-variants compiles all 54, as the compile tier of `make test` does)")
    for item in kernel_builds(all_variants):
        try:
            kernel, args, plan = item.build()
        except ImportError as error:
            print(f"{item.label}: not built yet ({error})")
            continue
        start = time.perf_counter()
        try:
            _, report = compile_with_report(kernel, *args)
        except FileNotFoundError as error:  # no ptxas: PTX only
            print(f"{item.label}: compiled, but no resource report ({error})")
            continue
        print(f"{item.label}: compiled for sm_90a in {time.perf_counter() - start:.1f}s")
        for res in report.kernels:
            print(f"  {res.registers} registers/thread, spills {res.spill_stores}/{res.spill_loads} B (store/load), "
                  f"stack {res.stack_frame} B, local-memory instructions {report.local_memory_ops}")
        if plan is not None:
            print(f"  shared memory (plan): {plan.total_bytes / 1024:.1f} KiB, {plan.ctas_per_sm} CTAs/SM by smem")
        counts = [f"{name} {report.count(mnemonic)}" for name, mnemonic in NOTABLE if report.count(mnemonic)]
        print(f"  PTX: {', '.join(counts) or 'none of the instructions of note (plain loads, stores, shuffles)'}")


# ---------------------------------------------------------------------------------------------
# on a GPU


def run_on_gpu(problem: dict, gold: tuple, mirror: tuple) -> None:
    import cute_kda
    from cute_kda._bench import event_median_ms
    from cute_kda.reference import rel_rms

    tensors = [problem[n] for n in ("q", "k", "v", "g", "beta")]
    options = {n: x for n, x in problem.items() if n not in ("q", "k", "v", "g", "beta")}
    start = time.perf_counter()
    o, state = cute_kda.kda_forward(*tensors, **options)
    torch.cuda.synchronize()
    print(f"kda_forward (first call, compiles K1 + K2): {time.perf_counter() - start:.1f}s")
    print(f"  vs mirror: o {rel_rms(o, mirror[0]):.2e} rel-RMS, {(o == mirror[0]).float().mean().item():.4f} of "
          f"values bit-equal; final state {rel_rms(state, mirror[1]):.2e}")
    print(f"  vs gold:   o {rel_rms(o, gold[0]):.2e}, final state {rel_rms(state, gold[1]):.2e} rel-RMS")

    for lengths, heads in (([8192], 96), ([1300, 547, 2048, 963, 271, 3063], 96), ([32768], 16)):
        big = make_problem(lengths, heads, torch.device("cuda"))
        tensors = [big[n] for n in ("q", "k", "v", "g", "beta")]
        options = {n: x for n, x in big.items() if n not in ("q", "k", "v", "g", "beta")}
        out = torch.empty_like(big["v"])
        final = torch.empty_like(big["initial_state"])
        options.update(out=out, final_state=final, output_final_state=False)
        ms = event_median_ms(lambda: cute_kda.kda_forward(*tensors, **options), reps=20, warmup_calls=1)
        label = f"T={sum(lengths)} H={heads}" + (f" ({len(lengths)} sequences)" if len(lengths) > 1 else "")
        print(f"kda_forward {label}, fp32 state in/out: {ms:.3f} ms (median of 20)")
        del big, tensors, options, out, final
    print("side by side with FLA: python benchmarks/bench_fwd.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the sm_90a compile report (CPU only)")
    parser.add_argument("--all-variants", action="store_true",
                        help="compile all 54 K2 variants instead of 3")
    args = parser.parse_args()
    has_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if has_gpu else "cpu")

    heading(f"problem: 4 packed sequences [37, 16, 75, 1], H=2, D={D}, fp32 initial state ({device})")
    problem = make_problem([37, 16, 75, 1], 2, device)
    heading("references")
    gold, mirror = references(problem)
    fla_translation(problem, gold)
    if has_gpu:
        heading("kernels on " + torch.cuda.get_device_name())
        run_on_gpu(problem, gold, mirror)
    elif not args.no_compile:
        heading("kernels compiled for sm_90a (no GPU here: compile only)")
        compile_kernels(args.all_variants)


if __name__ == "__main__":
    main()
