"""A small continuous-batching engine on FLA's KDA layer, serving from one cute_kda state pool.

Requests arrive over time, each with a prompt and a number of tokens to generate; they are admitted while pool
slots are free and release their slots when they finish, so slots are reused. Every engine step runs, on the one
``[slots, HV, V, K]`` fp32 pool (V-first, as FLA's layers keep it):

- **chunked prefill**: up to ``--chunk`` prompt tokens of every prefilling request, packed (``cu_seqlens``),
  through ``cute_kda.chunk_kda(..., initial_state=pool, state_indices=slots)``: each sequence starts from its slot
  and its final state is written back in place (no gather, no scatter);
- **a decode step** (``cute_kda.fused_recurrent_kda(..., ssm_state_indices=slots, inplace_final_state=True)``),
  one token per generating request, or, at random, **a speculative verify**: 1 + S tokens per request on a
  ``[N, 1 + S]`` slot matrix with ``num_accepted_tokens`` from the previous verify, and a random number of the
  drafts accepted afterwards. The batch is padded to a fixed size with slot −1 rows (as engines do for CUDA
  graphs); their outputs must come back zero.

The layer (``fla.layers.kda.KimiDeltaAttention``, random weights, safe gate, no short convolution so that the
recurrent state is the whole per-request state) supplies the projections into q, k, v, g, β and, after the
kernel, the gated norm and output projection. There is no language model around it: each generated position's
hidden state is random.

The check: every output row ``o`` of every call is compared with a per-request fp64 token recurrence
(``cute_kda.reference.gold_forward``) run from the request's own fp64 state, which advances by exactly the tokens
the engine kept (the accepted prefix of a verify). The relative RMS error of each call's rows per request must
stay under ``TOLERANCE``; padding rows must be zero. Tokens/s counts the engine's own work (projections,
kernels, output projection), timed with the device synchronised around each call, without the checks; the workload
runs once unchecked first so that no kernel compiles inside the timed run.

    python examples/serve.py
    python examples/serve.py --requests 64 --slots 48 --batch 32 --chunk 512

Needs a Hopper GPU and flash-linear-attention 0.6 (``pip install .[fla]``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cute_kda  # noqa: E402
from cute_kda.reference import gold_forward  # noqa: E402
from kda_layer import import_kda_layer  # noqa: E402

D = 128
LOWER_BOUND = -5.0
TOLERANCE = 1e-2  # relative RMS of one call's o rows of one request against the fp64 recurrence (bf16 o: ≈ 2e-3)
GATE_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=LOWER_BOUND, state_v_first=True)


@dataclass
class Request:
    """One request: its prompt's hidden states, how many tokens it still generates, its pool slots (``1 + S``:
    column ``accepted − 1`` holds its state) and its fp64 reference state ``[HV, V, K]``."""

    rid: int
    prompt: torch.Tensor
    generate: int
    slots: list[int] = field(default_factory=list)
    prefilled: int = 0
    accepted: int = 1
    state64: torch.Tensor | None = None

    @property
    def slot(self) -> int:
        return self.slots[self.accepted - 1]


class Engine:
    def __init__(self, layer, args, check: bool = True):
        self.layer, self.args, self.checking = layer, args, check
        self.heads = layer.num_heads
        self.value_heads = layer.num_v_heads
        self.width = 1 + args.drafts  # slots a request holds: the verify's 1 + S states
        self.pool = torch.zeros(args.slots * self.width, self.value_heads, D, D, dtype=torch.float32, device="cuda")
        self.free = list(range(self.pool.shape[0]))
        self.errors: list[float] = []
        self.tokens = {"prefill": 0, "decode": 0, "verify": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0, "verify": 0.0}
        self.calls = {"prefill": 0, "decode": 0, "verify": 0}
        self.out = torch.empty(1, args.batch * self.width, self.value_heads, D, dtype=torch.bfloat16, device="cuda")

    # ---- the layer around the kernel

    def project(self, x: torch.Tensor):
        """x ``[1, T, hidden]`` → q, k ``[1, T, H, K]``, v, g ``[1, T, HV, ·]``, beta ``[1, T, HV]`` (the layer's
        forward up to its kernel call, with ``use_short_conv=False``)."""
        layer = self.layer
        q, k, v = (F.silu(proj(x)) for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
        q, k = (t.unflatten(-1, (self.heads, D)) for t in (q, k))
        return q, k, v.unflatten(-1, (self.value_heads, D)), layer.f_proj(x).unflatten(-1, (self.value_heads, D)), \
            layer.b_proj(x)

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer's gated norm and output projection after the kernel."""
        layer = self.layer
        gate = layer.g_proj(x).unflatten(-1, (self.value_heads, D))
        return layer.o_proj(layer.o_norm(o, gate).flatten(-2))

    # ---- the reference

    def check(self, request: Request, inputs: tuple, o: torch.Tensor, keep: int) -> None:
        """Compare ``o`` (``[T, HV, V]``) with the fp64 recurrence from the request's state; advance that state by
        the first ``keep`` tokens (unchecked engine: nothing)."""
        if not self.checking:
            return
        q, k, v, g, beta = (t.unsqueeze(0) for t in inputs)
        flags = dict(gate="safe", A_log=self.layer.A_log, dt_bias=self.layer.dt_bias, lower_bound=LOWER_BOUND,
                     state_layout="vk", output_final_state=True)
        o64, _ = gold_forward(q, k, v, g, beta, initial_state=request.state64[None], **flags)
        reference = o64[0]
        error = ((o.double() - reference).square().mean() / reference.square().mean().clamp_min(1e-30)).sqrt().item()
        self.errors.append(error)
        if not error <= TOLERANCE:
            raise SystemExit(f"request {request.rid}: o off the fp64 recurrence by {error:.2e} (rel RMS)")
        _, state = gold_forward(*(t[:, :keep] for t in (q, k, v, g, beta)), initial_state=request.state64[None],
                                **flags)
        request.state64 = state[0]

    # ---- engine steps

    def admit(self, request: Request) -> bool:
        if len(self.free) < self.width:
            return False
        request.slots = [self.free.pop() for _ in range(self.width)]
        self.pool[request.slot].zero_()  # a new sequence starts from zero
        request.state64 = torch.zeros(self.value_heads, D, D, dtype=torch.float64, device="cuda")
        return True

    def release(self, request: Request) -> None:
        self.free.extend(request.slots)

    def timed(self, kind: str, tokens: int, fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        self.seconds[kind] += time.perf_counter() - start
        self.tokens[kind] += tokens
        self.calls[kind] += 1
        return result

    def prefill(self, requests: list[Request]) -> None:
        """One chunk of every prefilling request, packed, on the pool."""
        pieces = [r.prompt[r.prefilled:r.prefilled + self.args.chunk] for r in requests]
        lengths = [len(p) for p in pieces]
        cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        slots = torch.tensor([r.slot for r in requests], dtype=torch.int32, device="cuda")
        x = torch.cat(pieces)[None]
        layer = self.layer

        def run():
            q, k, v, g, beta = self.project(x)
            o, _ = cute_kda.chunk_kda(q, k, v, g, beta, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                      initial_state=self.pool, state_indices=slots, cu_seqlens=cu_seqlens,
                                      safe_gate=True, **GATE_FLAGS)
            self.finish(x, o)
            return (q, k, v, g, beta), o

        inputs, o = self.timed("prefill", sum(lengths), run)
        start = 0
        for request, length in zip(requests, lengths):
            rows = slice(start, start + length)
            self.check(request, tuple(t[0, rows] for t in inputs), o[0, rows], keep=length)
            request.prefilled += length
            start += length

    def generate(self, requests: list[Request], verify: bool) -> None:
        """One decode step (T = 1) or one verify (T = 1 + S) of every generating request, the batch padded to
        ``--batch`` rows with slot −1."""
        tokens = self.width if verify else 1
        rows = self.args.batch
        real = len(requests)
        hidden = self.layer.hidden_size
        x = torch.randn(rows, tokens, hidden, dtype=torch.bfloat16, device="cuda")
        if verify:
            table = [r.slots for r in requests] + [[-1] * tokens] * (rows - real)
            accepted = [r.accepted for r in requests] + [1] * (rows - real)
            slot_ids = torch.tensor(table, dtype=torch.int32, device="cuda")
            num_accepted = torch.tensor(accepted, dtype=torch.int32, device="cuda")
        else:
            slot_ids = torch.tensor([r.slot for r in requests] + [-1] * (rows - real), dtype=torch.int32,
                                    device="cuda")
            num_accepted = None
        out = self.out[:, :rows * tokens].view(rows, tokens, self.value_heads, D)
        layer = self.layer

        def run():
            q, k, v, g, beta = self.project(x)
            o, _ = cute_kda.fused_recurrent_kda(
                q, k, v, g, beta, A_log=layer.A_log, dt_bias=layer.dt_bias, initial_state=self.pool,
                ssm_state_indices=slot_ids, num_accepted_tokens=num_accepted, inplace_final_state=True, out=out,
                **GATE_FLAGS)
            self.finish(x, o)
            return (q, k, v, g, beta), o

        kind = "verify" if verify else "decode"
        inputs, o = self.timed(kind, real * tokens, run)
        if self.checking and real < rows and o[real:].abs().max().item() != 0:
            raise SystemExit(f"{kind}: a padding row's output is not zero")
        for n, request in enumerate(requests):
            keep = random.randint(1, tokens) if verify else 1  # the drafts the (imaginary) sampler accepts
            self.check(request, tuple(t[n] for t in inputs), o[n], keep=keep)
            request.accepted = keep if verify else request.accepted
            request.generate -= keep


def serve(layer, args, check: bool) -> tuple[Engine, int]:
    """The whole workload of ``args`` (its seed fixes arrivals, lengths, drafts' acceptance) through one engine."""
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    waiting = [Request(rid, torch.randn(random.randint(1, 700), args.hidden, dtype=torch.bfloat16, device="cuda"),
                       random.randint(1, 40)) for rid in range(args.requests)]
    engine = Engine(layer, args, check)
    running: list[Request] = []
    steps = 0
    with torch.inference_mode():
        while waiting or running:
            while waiting and engine.admit(waiting[0]):
                running.append(waiting.pop(0))
            prefilling = [r for r in running if r.prefilled < len(r.prompt)]
            if prefilling:
                engine.prefill(prefilling)
            generating = [r for r in running if r.prefilled == len(r.prompt) and r.generate > 0][:args.batch]
            if generating:
                engine.generate(generating, verify=random.random() < 0.5)
            for request in [r for r in running if r.prefilled == len(r.prompt) and r.generate <= 0]:
                engine.release(request)
                running.remove(request)
            steps += 1
    return engine, steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--slots", type=int, default=16, help="requests the pool holds at once")
    parser.add_argument("--batch", type=int, default=16, help="decode rows per step (padded with slot -1)")
    parser.add_argument("--chunk", type=int, default=256, help="prompt tokens per request and prefill step")
    parser.add_argument("--drafts", type=int, default=3, help="S: draft tokens of a speculative verify")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("serve.py needs a CUDA GPU (Hopper)")
    torch.manual_seed(args.seed)
    KimiDeltaAttention = import_kda_layer()
    layer = KimiDeltaAttention(hidden_size=args.hidden, num_heads=args.heads, head_dim=D, mode="chunk",
                               use_short_conv=False, safe_gate=True, lower_bound=LOWER_BOUND, layer_idx=0)
    with torch.no_grad():
        layer.A_log.uniform_(-1.0, 1.0)  # random but not degenerate (the safe-gate layer starts at zeros)
    layer = layer.to("cuda", torch.bfloat16).eval()
    layer.A_log.data = layer.A_log.data.float()  # the gate parameters stay fp32, as in a trained model
    layer.dt_bias.data = layer.dt_bias.data.float()

    serve(layer, args, check=False)  # the same workload once unchecked: every kernel variant compiled before timing
    engine, steps = serve(layer, args, check=True)
    print(f"{args.requests} requests served in {steps} engine steps on a pool of {engine.pool.shape[0]} slots "
          f"({args.slots} requests × {engine.width} slots), HV={engine.value_heads}, batch {args.batch} (padded)")
    for kind in ("prefill", "decode", "verify"):
        if engine.calls[kind]:
            rate = engine.tokens[kind] / engine.seconds[kind]
            print(f"  {kind:8s} {engine.calls[kind]:4d} calls, {engine.tokens[kind]:6d} tokens, {rate:10.0f} tokens/s")
    print(f"every o checked against the fp64 recurrence: {len(engine.errors)} comparisons, worst rel RMS "
          f"{max(engine.errors):.2e} (tolerance {TOLERANCE:.0e}); padding rows zero")


if __name__ == "__main__":
    main()
