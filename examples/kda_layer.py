"""FLA's KimiDeltaAttention layer end to end: FLA's kernels against cute_kda, on the same inputs.

One ``fla.layers.kda.KimiDeltaAttention`` on random weights (the safe-gate configuration,
``safe_gate=True, lower_bound=-5``, or with ``--gate softplus`` the layer's defaults: Kimi-Linear's unbounded
softplus gate), bf16, inference. The same input goes through the layer three
times, changing only what its ``chunk_kda`` call runs on:

- FLA's Triton kernels (``FLA_CUTE_KDA=0``);
- cute_kda, reached through FLA's own backend dispatch (``import cute_kda`` registered it);
- the fp64 token recurrence (``cute_kda.reference.gold_forward``) in place of ``chunk_kda``, as the
  reference both are measured against with FLA's own test metric (``fla.utils.assert_close``: RMS
  of the difference over RMS of the reference).

FLA's tolerance, 0.005, is the one its ``tests/ops/test_kda.py`` applies to ``chunk_kda``'s output
``o``; it is checked here at the same place, on the ``o`` cute_kda's ``chunk_kda`` returns inside the
layer, against the fp64 one before rounding (FLA's kernels' ``o`` is printed beside it, not judged: at
some shapes it sits at the tolerance itself). The layer's output is compared too and printed: it passes
through the layer's bf16 gated norm and output projection after the kernel, which add their own
rounding to every run alike, so there the check is that cute_kda is no worse than FLA's kernels
(within ``LAYER_SLACK``).

Then the layer's forward is timed both ways (median ms; the layer's projections, short convolutions
and gated norm are the same in both, so the difference is the attention kernel). Needs a Hopper GPU
and flash-linear-attention 0.6 (``fla.layers``; its package ``__init__`` imports every layer, some
needing ``transformers``; when that is missing the KDA layer's module is imported on its own).

    python examples/kda_layer.py
    python examples/kda_layer.py --seq-lens 1300,547,2048 --heads 32      # packed sequences (varlen)
    python examples/kda_layer.py --gate softplus                          # Kimi-Linear's gate
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

FLA_TOLERANCE = 0.005  # FLA's tests/ops/test_kda.py: assert_close("o", ref, tri, 0.005)
LAYER_SLACK = 1.25  # the layer's output: cute_kda's error at most this times FLA's kernels' error


def import_kda_layer():
    """``fla.layers.kda.KimiDeltaAttention``, without ``fla.layers.__init__`` if that cannot import."""
    try:
        return importlib.import_module("fla.layers.kda").KimiDeltaAttention
    except ImportError as error:
        spec = importlib.util.find_spec("fla.layers") if importlib.util.find_spec("fla") else None
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"needs flash-linear-attention 0.6 (fla.layers): {error}") from error
        package = types.ModuleType("fla.layers")  # the package without its __init__ (which imports every layer)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["fla.layers"] = package
        return importlib.import_module("fla.layers.kda").KimiDeltaAttention


GATES = ("safe", "softplus")  # the layer's safe-gate configuration, or its default (Kimi-Linear's softplus gate)


def build_layer(hidden: int, heads: int, seed: int = 0, gate: str = "safe") -> torch.nn.Module:
    """The layer on random weights: ``gate="safe"`` is ``safe_gate=True, lower_bound=-5``; ``"softplus"`` the
    layer's defaults (``safe_gate=False``, no lower bound: Kimi-Linear's gate, A_log at log U(1, 16))."""
    KimiDeltaAttention = import_kda_layer()
    torch.manual_seed(seed)
    safe = gate == "safe"
    layer = KimiDeltaAttention(hidden_size=hidden, num_heads=heads, head_dim=128, mode="chunk", safe_gate=safe,
                               lower_bound=-5.0 if safe else None, layer_idx=0)
    if safe:
        with torch.no_grad():  # random but not degenerate: A_log starts at zeros in the safe-gate layer
            layer.A_log.uniform_(-1.0, 1.0)
    return layer.to("cuda", torch.bfloat16).eval()


def gold_chunk_kda(*args, fp64_outputs: list, **kwargs):
    """``chunk_kda`` by the fp64 token recurrence (the same argument translation as cute_kda's); the
    layer gets ``o`` rounded to its dtype, ``fp64_outputs`` the fp64 ``o`` in FLA's layout."""
    from cute_kda.fla_calls import translate_fla_call
    from cute_kda.reference import gold_forward

    call = translate_fla_call(*args, **kwargs)
    v = call.tensors[2]

    def forward(*tensors, **options):
        o, state = gold_forward(*tensors, **options, state_layout="vk", dtype=torch.float64)
        return o, None if state is None else state.float()

    o, state = call.run(forward)
    fp64_outputs.append(o)
    return o.to(v.dtype), state


class Run:
    """The layer's forward with its ``chunk_kda`` on FLA, on cute_kda, or on the gold recurrence."""

    def __init__(self, layer, x, cu_seqlens):
        self.layer, self.x, self.cu_seqlens = layer, x, cu_seqlens
        self.module = sys.modules[type(layer).__module__]

    def __call__(self, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output, the ``o`` its ``chunk_kda`` call returned) on ``backend``."""
        from cute_kda import fla_backend

        previous_env, previous_fn = os.environ.get("FLA_CUTE_KDA"), self.module.chunk_kda
        os.environ["FLA_CUTE_KDA"] = "0" if backend == "fla" else "1"
        kernel_outputs: list = []

        def recorded_chunk_kda(*args, **kwargs):
            if backend == "gold":
                return gold_chunk_kda(*args, fp64_outputs=kernel_outputs, **kwargs)
            result = previous_fn(*args, **kwargs)
            kernel_outputs.append(result[0])
            return result

        self.module.chunk_kda = recorded_chunk_kda
        calls = []
        implementation = fla_backend.chunk_kda
        fla_backend.chunk_kda = lambda *a, **k: calls.append(1) or implementation(*a, **k)
        try:
            kwargs = {} if self.cu_seqlens is None else {"cu_seqlens": self.cu_seqlens}
            with torch.no_grad():
                y, _, _ = self.layer(self.x, **kwargs)
        finally:
            fla_backend.chunk_kda = implementation
            self.module.chunk_kda = previous_fn
            if previous_env is None:
                os.environ.pop("FLA_CUTE_KDA", None)
            else:
                os.environ["FLA_CUTE_KDA"] = previous_env
        expected = 1 if backend == "cute_kda" else 0
        if len(calls) != expected:
            raise RuntimeError(f"{backend}: chunk_kda reached cute_kda {len(calls)} times, expected {expected} "
                               "(is the backend registered, the GPU a Hopper, the call supported?)")
        if len(kernel_outputs) != 1:
            raise RuntimeError(f"{backend}: the layer called chunk_kda {len(kernel_outputs)} times, expected once")
        return y, kernel_outputs[0]


def err_ratio(ref: torch.Tensor, other: torch.Tensor) -> float:
    """FLA's ``get_err_ratio``: RMS of the difference over RMS of the reference."""
    ref, other = ref.double(), other.double()
    return ((ref - other).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


def compare(seq_lens: list[int], heads: int, hidden: int, batch: int, reps: int, time_it: bool = True,
            gate: str = "safe") -> dict:
    """Outputs of the three runs compared, and (``time_it``) the layer's forward timed on FLA and cute_kda."""
    import cute_kda  # noqa: F401  (registers the FLA backend)
    from cute_kda import fla_backend

    layer = build_layer(hidden, heads, gate=gate)
    if not fla_backend.is_registered():
        raise RuntimeError("cute_kda is not registered with FLA's chunk_kda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    if len(seq_lens) > 1:  # packed sequences: B = 1 and cu_seqlens, as FLA's varlen layer call takes them
        x = torch.randn(1, sum(seq_lens), hidden, generator=gen, device="cuda").to(torch.bfloat16)
        cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], device="cuda")
    else:
        x = torch.randn(batch, seq_lens[0], hidden, generator=gen, device="cuda").to(torch.bfloat16)
        cu_seqlens = None
    run = Run(layer, x, cu_seqlens)
    runs = {backend: run(backend) for backend in ("fla", "cute_kda", "gold")}
    torch.cuda.synchronize()
    y = {backend: layer_out for backend, (layer_out, _) in runs.items()}
    o = {backend: kernel_out for backend, (_, kernel_out) in runs.items()}
    result = {
        "o_fla_vs_gold": err_ratio(o["gold"], o["fla"]),
        "o_cute_kda_vs_gold": err_ratio(o["gold"], o["cute_kda"]),
        "fla_vs_gold": err_ratio(y["gold"], y["fla"]),
        "cute_kda_vs_gold": err_ratio(y["gold"], y["cute_kda"]),
        "cute_kda_vs_fla": err_ratio(y["fla"], y["cute_kda"]),
        "shape": tuple(y["fla"].shape),
    }
    if time_it:
        from cute_kda._bench import event_median_ms

        for backend in ("fla", "cute_kda"):
            result[f"{backend}_ms"] = event_median_ms(lambda: run(backend), reps=reps, warmup_calls=3)
    return result


def failures(result: dict) -> list[str]:
    """What :func:`compare`'s numbers break for cute_kda: FLA's tolerance on its ``o``, and its layer
    output no worse than ``LAYER_SLACK`` times FLA's. (FLA's own ``o`` is printed, not judged: at some
    shapes FLA's kernels sit at the tolerance themselves, 5.0e-3 at T = 2048 on the H200.)"""
    found = []
    if result["o_cute_kda_vs_gold"] > FLA_TOLERANCE:
        found.append(f"cute_kda o vs fp64 {result['o_cute_kda_vs_gold']:.2e} > {FLA_TOLERANCE}")
    if result["cute_kda_vs_gold"] > LAYER_SLACK * result["fla_vs_gold"]:
        found.append(f"layer output: cute_kda {result['cute_kda_vs_gold']:.2e} > {LAYER_SLACK} × FLA's "
                     f"{result['fla_vs_gold']:.2e}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="4096", help="one length (B sequences of it) or a comma list (packed)")
    parser.add_argument("--batch", type=int, default=1, help="batch size for a single length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--gate", choices=GATES, default="safe",
                        help="safe: safe_gate=True, lower_bound=-5; softplus: the layer's defaults (Kimi-Linear's gate)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (Hopper): the layer runs FLA's and cute_kda's kernels")
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    r = compare(seq_lens, args.heads, args.hidden, args.batch, args.reps, gate=args.gate)
    configuration = "safe_gate, lower_bound=-5" if args.gate == "safe" else "the softplus gate (the layer's defaults)"
    print(f"KimiDeltaAttention(hidden={args.hidden}, heads={args.heads}, head_dim=128, {configuration}), "
          f"bf16, input {list(r['shape'])}" + (f", packed {seq_lens}" if len(seq_lens) > 1 else ""))
    print(f"chunk_kda's o inside the layer vs the fp64 recurrence (FLA's metric and tolerance, {FLA_TOLERANCE}):")
    over = "  (FLA's kernels are over FLA's tolerance here)" if r["o_fla_vs_gold"] > FLA_TOLERANCE else ""
    print(f"  FLA kernels: {r['o_fla_vs_gold']:.2e}   cute_kda: {r['o_cute_kda_vs_gold']:.2e}{over}")
    print("layer output vs the layer with the fp64 recurrence (after the bf16 gated norm and projection):")
    print(f"  FLA kernels: {r['fla_vs_gold']:.2e}   cute_kda: {r['cute_kda_vs_gold']:.2e}   "
          f"cute_kda vs FLA: {r['cute_kda_vs_fla']:.2e}")
    print(f"layer forward, median of {args.reps}: FLA {r['fla_ms']:.3f} ms, cute_kda {r['cute_kda_ms']:.3f} ms "
          f"({r['fla_ms'] / r['cute_kda_ms']:.2f}x)")
    broken = failures(r)
    if broken:
        raise SystemExit("; ".join(broken))


if __name__ == "__main__":
    main()
