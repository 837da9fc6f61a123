"""Model training benchmark: FLA's KDA and GatedDeltaNet language models trained on FLA's kernels and on cute_kda.

Issue 34, item 1. A model of FLA 0.6.0 (``KDAForCausalLM`` with Kimi-Linear's softplus gate or the safe gate,
``GatedDeltaNetForCausalLM`` with 128-dim heads and grouped value heads) is trained for ``--steps`` steps (AdamW,
bf16) twice, each time in a process of its own (clean memory, a crash stays contained):

- **FLA**: ``FLA_CUTE_KDA=0``, so FLA's dispatch keeps ``chunk_kda`` / ``chunk_gated_delta_rule`` on its own Triton
  kernels;
- **cute_kda**: ``FLA_CUTE_KDA=1``, ``import cute_kda`` registered the backend, FLA hands each call to it.

``FLA_FLASH_KDA=0`` and ``FLA_FLASH_QLA=0`` in both, so no third backend takes the calls. Both start from the same
weights (the first process builds the model on the CPU with ``--seed`` and saves its ``state_dict``; the second loads
it) and see the same batches (token ids drawn on the CPU from ``(--seed, step)``): ``--task repeat`` (default) is a
block of random tokens repeated (``--block`` tokens, half the sequence by default: the second copy is predictable only
through the recurrent memory), ``--task random`` plain random tokens. The loss is the model's own (labels = the
input ids, FLA's fused linear cross-entropy).

Measured per peer: the loss of every step; the median step time (CUDA events around forward, backward,
``optimizer.step()`` and ``zero_grad``) over the steps after ``--warmup``; the peak memory of those steps
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``) and what is held between steps (weights,
gradients' absence, AdamW's moments); how many ``chunk_kda`` / ``chunk_gated_delta_rule`` calls cute_kda's backend took
or refused (its functions in ``cute_kda.fla_backend`` wrapped). A peer that raises (FLA's own GatedDeltaNet backward
refuses Hopper on Triton < 3.7.1) is reported with its error ("could not run") and the other still runs;
``--fla-unguarded`` turns that guard of FLA's off (speed and memory only: FLA says its gradients are wrong there).
``--memory-profile`` runs one more step under ``torch.cuda.memory._record_memory_history`` and reports the bytes
live at that step's peak by where they were allocated (the first frame outside torch), to say which buffers make
a peak.

When FLA's model classes cannot import (they need ``transformers``), the same blocks are built from FLA's layers
(:class:`LayerStackLM`: embeddings, RMSNorm → KDA / GatedDeltaNet layer → residual, RMSNorm → gated MLP → residual,
final norm, FLA's fused linear cross-entropy); the report says which was built.

Sizes (``--preset``, each field overridable by ``--layers --hidden --heads --batch --seq-len --vocab``; ``--help``
lists them with their parameter counts and estimated peaks): ``issue`` 4 layers, hidden 1024, 8 heads, B8 T2048 (the
issue's measurement); ``t4k`` the same model at B16 T4096; ``t8k`` 8 layers, hidden 2048, 16 heads, B4 T8192;
``t8k-fill`` 12 layers, hidden 2048, 16 heads, B8 T8192 (tens of GiB on the 141 GB H200). The estimate is the bf16
weights, gradients and AdamW moments (8 bytes a parameter) plus 45 bytes of activations per token, layer and unit of
hidden size (calibrated on the issue's measurement of FLA: 3.69 GiB). GatedDeltaNet takes
``--heads`` value heads and ``--heads / --group`` query/key heads (``--group`` 2 by default; Qwen3-Next's ratio).

    python benchmarks/bench_model.py --preset issue --models kda-safe            # the issue's model, both peers
    python benchmarks/bench_model.py --preset t8k --models kda-safe,kda-softplus --out $OUT/model-t8k.md
    python benchmarks/bench_model.py --preset issue --models gdn --fla-unguarded
    python benchmarks/bench_model.py --preset issue --models kda-safe --memory-profile --steps 8

On a fresh H200 the first model costs FLA's Triton autotune (30-90 s) and cute_kda's first compiles (≈ 40 s); then
a step of the ``issue`` preset takes ≈ 50 ms, ``t8k`` ≈ 0.3 s, ``t8k-fill`` ≈ 0.8 s (estimates: ≈ 6 · parameters ·
tokens FLOP at ≈ 400 TFLOP/s). The markdown goes to ``--out`` (default ``$OUT/model-<date>.md`` or
``benchmarks/results/``) after every model.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from cute_kda._bench import (  # noqa: E402
    checkout_commit, dated_out, markdown_table, positive_int, publish, save)

HEAD_DIM = 128
LOWER_BOUND = -5.0  # the safe gate's bound (FLA recommends -5)
GIB = 1 << 30
PEERS = ("FLA", "cute_kda")
PEER_ENV = {"FLA": "0", "cute_kda": "1"}  # FLA_CUTE_KDA: FLA reads it on every call
OTHER_BACKENDS_OFF = {"FLA_FLASH_KDA": "0", "FLA_FLASH_QLA": "0"}
MODELS = {
    "kda-safe": "KDAForCausalLM, safe gate (safe_gate=True, lower_bound=-5)",
    "kda-softplus": "KDAForCausalLM, Kimi-Linear's softplus gate (FLA's defaults)",
    "gdn": "GatedDeltaNetForCausalLM, head dim 128, grouped value heads",
}
TASKS = ("repeat", "random")
PRECISIONS = {"bf16": "bf16 weights and AdamW", "amp": "fp32 weights, bf16 autocast"}
ACTIVATION_BYTES = 45  # per token, layer and unit of hidden size: the FLA model, 3.69 GiB at B8 T2048
IGNORE_INDEX = -100


class Size(NamedTuple):
    """A model and its batch: ``layers`` blocks of ``hidden`` units, ``heads`` heads of 128 (GatedDeltaNet: value
    heads), ``batch`` rows of ``seq_len`` tokens from a ``vocab``-token vocabulary."""

    layers: int
    hidden: int
    heads: int
    batch: int
    seq_len: int
    vocab: int = 32000

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


PRESETS = {
    "issue": (Size(4, 1024, 8, 8, 2048), "issue 34's measurement: 4.74 GiB on cute_kda, 3.69 on FLA"),
    "t4k": (Size(4, 1024, 8, 16, 4096), "the issue's model at T 4096, 4× its tokens"),
    "t8k": (Size(8, 2048, 16, 4, 8192), "a 0.5B model at T 8192"),
    "t8k-fill": (Size(12, 2048, 16, 8, 8192), "a 0.75B model at T 8192, B8: tens of GiB"),
}


def mlp_width(hidden: int) -> int:
    """FLA's ``GatedMLP`` intermediate size for ``hidden_ratio=4``: 8/3 · hidden rounded up to 256."""
    width = int(hidden * 4 * 2 / 3)
    return 256 * ((width + 255) // 256)


def parameter_count(model: str, size: Size, group: int = 2) -> int:
    """The parameters of ``model`` at ``size`` by FLA's layer definitions (the workers report the real count)."""
    h, d = size.hidden, HEAD_DIM
    if model == "gdn":
        keys, values, heads = size.heads // group * d, size.heads * d, size.heads
        # q k v, a b, A_log dt_bias, the three convolutions (width 4), g, o_norm, o
        attention = 2 * h * keys + h * values + 2 * h * heads + 2 * heads + 4 * (2 * keys + values) + h * values \
            + d + values * h
    else:
        width = size.heads * d
        # q k v, convolutions, f (low rank), b, A_log dt_bias, g (low rank, bias), o_norm, o
        attention = 3 * h * width + 4 * 3 * width + (h * d + d * width) + h * size.heads + size.heads + width \
            + (h * d + d * width + width) + d + width * h
    block = attention + 3 * h * mlp_width(h) + 2 * h
    return size.layers * block + h + 2 * size.vocab * h


def estimated_peak_gib(model: str, size: Size, group: int = 2) -> float:
    """A rough peak of a bf16 AdamW step (module docstring)."""
    weights = 8 * parameter_count(model, size, group)
    activations = ACTIVATION_BYTES * size.tokens * size.layers * size.hidden
    return (weights + activations) / GIB


def preset_table() -> str:
    rows = [[name, str(s.layers), str(s.hidden), str(s.heads), str(s.batch), str(s.seq_len),
             f"{parameter_count('kda-safe', s) / 1e6:.0f}M", f"{estimated_peak_gib('kda-safe', s):.1f}", note]
            for name, (s, note) in PRESETS.items()]
    return markdown_table(["preset", "layers", "hidden", "heads", "B", "T", "KDA params", "est. peak GiB", "note"],
                          rows)


# ---------------------------------------------------------------------------------------------
# batches (no GPU)


def make_batch(task: str, size: Size, step: int, seed: int, block: int | None = None) -> torch.Tensor:
    """int64 ``[batch, seq_len]`` token ids on the CPU, the same for every peer: ``random`` tokens, or (``repeat``) a
    random block of ``block`` tokens (default half the sequence) repeated to the sequence's length."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if task == "random":
        return torch.randint(size.vocab, (size.batch, size.seq_len), generator=gen)
    block = block or size.seq_len // 2
    blocks = torch.randint(size.vocab, (size.batch, block), generator=gen)
    return blocks.repeat(1, -(-size.seq_len // block))[:, :size.seq_len].contiguous()


# ---------------------------------------------------------------------------------------------
# the calls cute_kda took (no GPU)


class CallCounter:
    """Counts the FLA calls cute_kda's backend computed (``taken``; ``kept``: those of them with
    ``disable_recompute=True``, whose forward keeps the workspace and checkpoints for the backward) and those its
    verifier refused (``refused``, with the first reasons), by wrapping the functions of ``cute_kda.fla_backend`` its
    FLA backend class calls."""

    PAIRS = (("chunk_kda", "verify"), ("chunk_gated_delta_rule", "verify_gdn"))  # (implementation, verifier)
    MAX_REASONS = 5

    def __init__(self, module: Any) -> None:
        self.module = module
        self.taken: Counter = Counter()
        self.kept: Counter = Counter()
        self.refused: Counter = Counter()
        self.reasons: list[str] = []
        self._originals: dict[str, Callable] = {}

    def install(self) -> "CallCounter":
        for implementation, verifier in self.PAIRS:
            for name, wrap in ((implementation, self._taking), (verifier, self._judging)):
                original = getattr(self.module, name)
                self._originals[name] = original
                setattr(self.module, name, wrap(implementation, original))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(self.module, name, original)
        self._originals.clear()

    def __enter__(self) -> "CallCounter":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def _taking(self, name: str, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.taken[name] += 1
            if kwargs.get("disable_recompute"):
                self.kept[name] += 1
            return original(*args, **kwargs)

        return counted

    def _judging(self, name: str, original: Callable) -> Callable:
        def judged(*args: Any, **kwargs: Any) -> tuple[bool, str | None]:
            accepted, reason = original(*args, **kwargs)
            if not accepted:
                self.refused[name] += 1
                if len(self.reasons) < self.MAX_REASONS and reason not in self.reasons:
                    self.reasons.append(reason)
            return accepted, reason

        return judged

    def summary(self) -> dict:
        return {"taken": dict(self.taken), "kept": dict(self.kept), "refused": dict(self.refused),
                "reasons": list(self.reasons)}


# ---------------------------------------------------------------------------------------------
# the peak's origins (no GPU: a memory snapshot is a dict)


def short_path(filename: str) -> str:
    """``…/site-packages/fla/ops/kda/chunk.py`` → ``fla/ops/kda/chunk.py`` (the part from a known package or folder)."""
    for marker in ("/cute_kda/", "/fla/", "/benchmarks/", "/examples/", "/transformers/"):
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at + 1:]
    return os.path.basename(filename)


def origin(frames: list[dict]) -> str:
    """``path:function`` of the innermost frame outside torch (frames innermost first), else ``torch``."""
    for frame in frames:
        name = frame.get("filename", "")
        if "/torch/" not in name and not name.startswith("<") and name:
            return f"{short_path(name)}:{frame.get('name', '?')}"
    return "torch"


def peak_origins(snapshot: dict, top: int = 12) -> tuple[int, list[tuple[str, int]]]:
    """(peak bytes of the traced allocations, [(origin, bytes live at that peak)], largest first, at most ``top``).

    ``snapshot``: ``torch.cuda.memory._snapshot()`` with history recorded; its ``device_traces`` events ``alloc`` and
    ``free_completed`` are replayed (blocks allocated before the recording are not in them)."""
    events = [event for trace in snapshot.get("device_traces", []) for event in trace]
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    peak_at = -1
    for index, event in enumerate(events):
        if event.get("action") == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
        elif event.get("action") == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
        if total > peak:
            peak, peak_at = total, index
    live.clear()
    for event in events[:peak_at + 1]:
        if event.get("action") == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
        elif event.get("action") == "free_completed":
            live.pop(event["addr"], None)
    by_origin: Counter = Counter()
    for nbytes, frames in live.values():
        by_origin[origin(frames)] += nbytes
    return peak, by_origin.most_common(top)


# ---------------------------------------------------------------------------------------------
# models (FLA: GPU host)


def import_fla_layer(model: str) -> type:
    """FLA's attention layer class of ``model``, without ``fla.layers.__init__`` when that cannot import."""
    import importlib
    import importlib.util
    import types

    name, cls = ("fla.layers.gated_deltanet", "GatedDeltaNet") if model == "gdn" else ("fla.layers.kda",
                                                                                        "KimiDeltaAttention")
    try:
        return getattr(importlib.import_module(name), cls)
    except ImportError:
        spec = importlib.util.find_spec("fla.layers")
        package = types.ModuleType("fla.layers")  # the package without its __init__ (which imports every layer)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["fla.layers"] = package
        return getattr(importlib.import_module(name), cls)


def layer_arguments(model: str, size: Size, group: int) -> dict:
    """The attention layer's keywords, as FLA's model configs pass them."""
    if model == "gdn":
        return dict(hidden_size=size.hidden, num_heads=size.heads // group, num_v_heads=size.heads,
                    head_dim=HEAD_DIM, expand_v=1.0, mode="chunk", use_gate=True, use_short_conv=True)
    safe = model == "kda-safe"
    return dict(hidden_size=size.hidden, num_heads=size.heads, head_dim=HEAD_DIM, mode="chunk", use_short_conv=True,
                safe_gate=safe, lower_bound=LOWER_BOUND if safe else None)


class LayerStackLM(torch.nn.Module):
    """FLA's causal-LM blocks built from FLA's layers (for a host where ``fla.models`` does not import): embeddings;
    per layer RMSNorm → attention → residual, RMSNorm → gated MLP → residual; final RMSNorm; lm_head through FLA's
    fused linear cross-entropy. Linear and embedding weights ~ N(0, 0.02) as FLA initialises them."""

    def __init__(self, model: str, size: Size, group: int = 2) -> None:
        super().__init__()
        from fla.modules import FusedLinearCrossEntropyLoss, GatedMLP, RMSNorm

        attention = import_fla_layer(model)
        h = size.hidden
        self.embeddings = torch.nn.Embedding(size.vocab, h)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(dict(
                attn_norm=RMSNorm(h, eps=1e-6), attn=attention(**layer_arguments(model, size, group), layer_idx=i),
                mlp_norm=RMSNorm(h, eps=1e-6), mlp=GatedMLP(hidden_size=h, hidden_ratio=4, hidden_act="swish"),
            )) for i in range(size.layers))
        self.norm = RMSNorm(h, eps=1e-6)
        self.lm_head = torch.nn.Linear(h, size.vocab, bias=False)
        self.criterion = FusedLinearCrossEntropyLoss()
        for module in self.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        """As FLA's models: ``loss`` of the next token (``labels`` shifted inside) or, without labels, ``logits``."""
        x = self.embeddings(input_ids)
        for block in self.layers:
            x = x + block["attn"](block["attn_norm"](x))[0]
            x = x + block["mlp"](block["mlp_norm"](x))
        x = self.norm(x)
        if labels is None:
            return SimpleNamespace(loss=None, logits=self.lm_head(x))
        targets = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)), 1)
        return SimpleNamespace(loss=self.criterion(x, targets, self.lm_head.weight, None), logits=None)


def fla_causal_lm(model: str, size: Size, group: int = 2) -> torch.nn.Module:
    """FLA's ``KDAForCausalLM`` / ``GatedDeltaNetForCausalLM`` for ``size`` (on the CPU, FLA's initialisation)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM

    common = dict(hidden_size=size.hidden, num_hidden_layers=size.layers, vocab_size=size.vocab, use_cache=False)
    if model == "gdn":
        arguments = layer_arguments(model, size, group)
        config = GatedDeltaNetConfig(**common, num_heads=arguments["num_heads"], num_v_heads=size.heads,
                                     head_dim=HEAD_DIM, expand_v=1.0, fuse_cross_entropy=False,
                                     fuse_linear_cross_entropy=True)  # the loss KDA's model uses in training
        return GatedDeltaNetForCausalLM(config)
    safe = model == "kda-safe"
    return KDAForCausalLM(KDAConfig(**common, num_heads=size.heads, head_dim=HEAD_DIM, safe_gate=safe,
                                    lower_bound=LOWER_BOUND if safe else None))


def build_model(model: str, size: Size, group: int = 2) -> tuple[torch.nn.Module, str]:
    """(the model, what was built): FLA's model class, else :class:`LayerStackLM` when ``fla.models`` does not import
    or its config refuses the installed ``transformers`` (a version FLA was not written for)."""
    try:
        return fla_causal_lm(model, size, group), "FLA's model class"
    except (ImportError, AttributeError, TypeError) as error:
        return LayerStackLM(model, size, group), f"LayerStackLM from FLA's layers (fla.models: {_first_line(error)})"


def unguard_fla_backward() -> str:
    """Turn off FLA's refusal of its gated ``chunk_bwd_dqkwg`` on Hopper with Triton < 3.7.1 (FLA #640) so that its
    GatedDeltaNet backward runs; returns the note for the report."""
    from fla.ops.common import chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return "FLA's Triton guard (#640) off: speed and memory only, FLA says its gradients are wrong on this Triton"


def state_checksum(model: torch.nn.Module) -> float:
    """Σ of every parameter in float64: the same start on both peers."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters()))


# ---------------------------------------------------------------------------------------------
# training (any device; the CPU tests run it on a toy model)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(``fn()``, its milliseconds): CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)
    begin = time.perf_counter()
    result = fn()
    return result, 1e3 * (time.perf_counter() - begin)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor,
               autocast: bool = False) -> torch.Tensor:
    """Forward (labels = the input ids), backward, AdamW step, gradients to None; the loss, detached."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_training(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Callable[[int], torch.Tensor],
                 steps: int, warmup: int, device: torch.device, autocast: bool = False,
                 memory_profile: bool = False) -> dict:
    """``steps`` steps on ``batch(step)``: losses, step ms (all steps), the peak over the steps after ``warmup`` and
    what was held before them (CUDA only); a step that raises ends the run with ``error`` and ``failed_step``.
    ``memory_profile``: one more step recorded, its peak's origins in ``origins``."""
    cuda = device.type == "cuda"
    result: dict = dict(losses=[], step_ms=[], error="", failed_step=None, peak_bytes=None, held_bytes=None,
                        reserved_bytes=None)
    for step in range(steps):
        if step == min(warmup, steps - 1) and cuda:
            torch.cuda.synchronize()
            result["held_bytes"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()  # the allocated and the reserved peak
        try:
            input_ids = batch(step).to(device)
            loss, ms = timed(lambda: train_step(model, optimizer, input_ids, autocast), device)
        except Exception as error:  # noqa: BLE001 - reported, the other peer still runs
            traceback.print_exc()
            result.update(error=_first_line(error), failed_step=step)
            return result
        result["losses"].append(float(loss))
        result["step_ms"].append(ms)
        print(f"step {step}: loss {float(loss):.4f}, {ms:.1f} ms", file=sys.stderr)
    if cuda:
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
        result["reserved_bytes"] = torch.cuda.max_memory_reserved()  # what the allocator took from the device
    if memory_profile and cuda:
        input_ids = batch(steps).to(device)
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        try:
            train_step(model, optimizer, input_ids, autocast)
            torch.cuda.synchronize()
            result["profile_peak"], result["origins"] = peak_origins(torch.cuda.memory._snapshot())
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    return result


def median_after_warmup(step_ms: list[float], warmup: int) -> float | None:
    timed_steps = step_ms[warmup:] or step_ms[-1:]
    return statistics.median(timed_steps) if timed_steps else None


# ---------------------------------------------------------------------------------------------
# one peer (a worker process on the GPU host)


def worker(spec: dict) -> dict:
    """Train one peer as ``spec`` says (written by :func:`peer_spec`); the result dict, also written to
    ``spec["result_path"]``."""
    size = Size(**spec["size"])
    result: dict = dict(peer=spec["peer"], error="", note="", losses=[], step_ms=[])
    import cute_kda  # noqa: F401  (registers its FLA backend; FLA_CUTE_KDA decides whether FLA uses it)
    from cute_kda import fla_backend

    counter = CallCounter(fla_backend).install()
    try:
        torch.manual_seed(spec["seed"])
        model, result["built"] = build_model(spec["model"], size, spec["group"])
        init = Path(spec["init_path"])
        if init.exists():
            model.load_state_dict(torch.load(init))
        else:
            torch.save(model.state_dict(), init)
        result["checksum"] = state_checksum(model)
        result["params"] = sum(p.numel() for p in model.parameters())
        if spec["fla_unguarded"] and spec["peer"] == "FLA":
            result["note"] = unguard_fla_backward()
        device = torch.device(spec.get("device", "cuda"))
        autocast = spec["precision"] == "amp"
        model.to(device, torch.float32 if autocast else torch.bfloat16).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.1)
        result.update(run_training(
            model, optimizer, lambda step: make_batch(spec["task"], size, step, spec["seed"], spec["block"]),
            spec["steps"], spec["warmup"], device, autocast, spec["memory_profile"]))
    except Exception as error:  # noqa: BLE001 - the parent reports it
        traceback.print_exc()
        result["error"] = _first_line(error)
    finally:
        counter.uninstall()
    result["calls"] = counter.summary()
    Path(spec["result_path"]).write_text(json.dumps(result))
    return result


def peer_spec(args: argparse.Namespace, model: str, size: Size, peer: str, workdir: Path) -> dict:
    """What a worker needs (JSON-able)."""
    tag = f"{model}-{size.layers}x{size.hidden}-h{size.heads}-b{size.batch}-t{size.seq_len}-v{size.vocab}-s{args.seed}"
    return dict(model=model, size=size._asdict(), peer=peer, device="cuda", steps=args.steps, warmup=args.warmup,
                lr=args.lr, precision=args.precision, task=args.task, block=args.block, seed=args.seed,
                group=args.group, fla_unguarded=args.fla_unguarded, memory_profile=args.memory_profile,
                init_path=str(workdir / f"{tag}-init.pt"), result_path=str(workdir / f"{tag}-{peer}.json"))


def run_peer(spec: dict, in_process: bool, timeout: int) -> dict:
    """One peer's result: in a fresh process (the default) or in this one, with its backend chosen by the
    environment."""
    env = {**OTHER_BACKENDS_OFF, "FLA_CUTE_KDA": PEER_ENV[spec["peer"]]}
    if in_process:
        os.environ.update(env)
        return worker(spec)
    spec_path = Path(spec["result_path"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    Path(spec["result_path"]).unlink(missing_ok=True)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
                              env={**os.environ, **env}, timeout=timeout)
        rc = done.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    try:
        return json.loads(Path(spec["result_path"]).read_text())
    except (OSError, ValueError):
        return dict(peer=spec["peer"], error=f"worker ended (rc {rc}) without a result", note="", losses=[],
                    step_ms=[])


# ---------------------------------------------------------------------------------------------
# report (no GPU)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


def _gib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.2f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "—" if ours is None or not theirs else f"{ours / theirs:.2f}×"


def _calls(result: dict) -> str:
    calls = result.get("calls")
    if not calls:
        return "—"
    kept = sum(calls.get("kept", {}).values())
    return f"{sum(calls['taken'].values())} / {sum(calls['refused'].values())}" + (f" ({kept} kept)" if kept else "")


def peers_table(row: dict, warmup: int) -> str:
    fla = row["peers"].get("FLA") or {}
    fla_ms = median_after_warmup(fla.get("step_ms", []), warmup)
    head = ["peer", "ran", "median step ms", "step / FLA", "peak GiB", "peak / FLA", "held between steps GiB",
            "step's peak above held GiB", "peak reserved GiB", "calls to cute_kda (taken / refused)", "last loss",
            "note"]
    table = []
    for peer, result in row["peers"].items():
        ms = median_after_warmup(result.get("step_ms", []), warmup)
        peak, held = result.get("peak_bytes"), result.get("held_bytes")
        ran = "yes" if not result.get("error") else (
            f"{peer} could not run" + (f" (step {result['failed_step']})" if result.get("failed_step") is not None
                                       else "") + f": {result['error']}")
        losses = result.get("losses") or []
        table.append([peer, ran, "—" if ms is None else f"{ms:.1f}", _ratio(ms, fla_ms) if peer != "FLA" else "",
                      _gib(peak), _ratio(peak, fla.get("peak_bytes")) if peer != "FLA" else "", _gib(held),
                      _gib(peak - held if peak is not None and held is not None else None),
                      _gib(result.get("reserved_bytes")), _calls(result),
                      f"{losses[-1]:.4f}" if losses else "—", result.get("note") or "—"])
    return markdown_table(head, table)


def loss_rows(losses: dict[str, list[float]], every: int = 1) -> list[list[str]]:
    """step, each peer's loss, cute_kda − FLA (where both have it)."""
    peers = list(losses)
    length = max((len(values) for values in losses.values()), default=0)
    rows = []
    for step in range(0, length, every):
        cells = [f"{losses[p][step]:.4f}" if step < len(losses[p]) else "—" for p in peers]
        both = all(step < len(losses.get(p, [])) for p in PEERS)
        diff = f"{losses['cute_kda'][step] - losses['FLA'][step]:+.4f}" if both else "—"
        rows.append([str(step), *cells, diff])
    return rows


def loss_agreement(losses: dict[str, list[float]]) -> str:
    """max and mean |cute_kda − FLA| over the steps both ran, and the largest relative to FLA's loss."""
    pairs = list(zip(losses.get("FLA", []), losses.get("cute_kda", [])))
    if not pairs:
        return "no common steps"
    gaps = [abs(ours - theirs) for theirs, ours in pairs]
    relative = max((gap / abs(theirs) for gap, (theirs, _) in zip(gaps, pairs) if theirs), default=0.0)
    return (f"over {len(pairs)} steps |cute_kda − FLA| max {max(gaps):.4f}, mean {statistics.mean(gaps):.4f}, "
            f"max relative {relative:.2e}")


def origins_table(row: dict) -> str | None:
    found = {peer: dict(result.get("origins") or ()) for peer, result in row["peers"].items()}
    if not any(found.values()):
        return None
    names = sorted({name for origins in found.values() for name in origins},
                   key=lambda name: -max(origins.get(name, 0) for origins in found.values()))
    table = [[f"`{name}`", *(f"{found[peer].get(name, 0) / 1e6:.1f}" for peer in found)] for name in names]
    peaks = [f"{(row['peers'][peer].get('profile_peak') or 0) / 1e6:.1f}" for peer in found]
    table.append(["**traced peak**", *peaks])
    return markdown_table(["allocated at", *(f"{peer} MB" for peer in found)], table)


def model_section(row: dict, warmup: int, expected_calls: int) -> str:
    size: Size = row["size"]
    first = next(iter(row["peers"].values()), {})
    checksums = {peer: result.get("checksum") for peer, result in row["peers"].items()}
    same_start = len({c for c in checksums.values() if c is not None}) <= 1
    losses = {peer: result.get("losses") or [] for peer, result in row["peers"].items()}
    every = max(1, max((len(v) for v in losses.values()), default=0) // 40)
    parts = [
        f"## {row['model']}: {MODELS[row['model']]}",
        f"{size.layers} layers, hidden {size.hidden}, {size.heads} heads of {HEAD_DIM}"
        + (f" ({size.heads // row['group']} q/k heads)" if row["model"] == "gdn" else "")
        + f", vocab {size.vocab}, B{size.batch} T{size.seq_len}; {first.get('built', '—')}; "
        f"{first.get('params', parameter_count(row['model'], size, row['group'])) / 1e6:.1f}M parameters; "
        f"initial weights {'identical' if same_start else 'DIFFERENT'} (Σ {checksums}); a run makes "
        f"{expected_calls} {'chunk_gated_delta_rule' if row['model'] == 'gdn' else 'chunk_kda'} calls (one a layer "
        "and forward), all of them cute_kda's on its peer and none on FLA's",
        peers_table(row, warmup),
        f"Loss: {loss_agreement(losses)}.",
        markdown_table(["step", *losses, "cute_kda − FLA"], loss_rows(losses, every)),
    ]
    origins = origins_table(row)
    if origins:
        parts += ["Bytes live at the peak of one more step (recorded allocations, by the first frame outside torch):",
                  origins]
    return "\n\n".join(parts)


def report(rows: list[dict], args: argparse.Namespace, command: str, env: str, sha: str) -> str:
    head = [
        "# Model training: FLA's kernels vs cute_kda behind FLA's dispatch",
        f"Command: `{command}` · commit `{sha}`",
        f"{env} · {args.precision} ({PRECISIONS[args.precision]}), "
        f"AdamW lr {args.lr} betas (0.9, 0.95) weight decay 0.1; task {args.task}"
        + (f" (block {args.block or 'T/2'})" if args.task == "repeat" else "")
        + f", seed {args.seed}; {args.steps} steps, timing and peak over the {args.steps - args.warmup} after "
        f"{args.warmup} warm-up steps; each peer in {'this process' if args.in_process else 'a process of its own'}; "
        "GiB = 2³⁰ bytes; ratios cute_kda / FLA (< 1: cute_kda smaller or faster).",
    ]
    sections = [model_section(row, args.warmup, row["size"].layers * (args.steps + args.memory_profile))
                for row in rows]
    return "\n\n".join(head + sections) + "\n"


def plot_losses(rows: list[dict], path: Path) -> bool:
    """The loss curves, one panel per model, into ``path`` (PNG); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    for axis, row in zip(axes[0], rows):
        for peer, result in row["peers"].items():
            axis.plot(result.get("losses") or [], label=peer)
        axis.set(title=row["model"], xlabel="step", ylabel="loss")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# options and main


def parse_models(listed: str) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in listed.split(",") if name.strip()))
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown or no models {unknown or listed!r}; choose from {list(MODELS)}")
    return names


def parse_peers(listed: str) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in listed.split(",") if name.strip()))
    if not names or any(name not in PEERS for name in names):
        raise argparse.ArgumentTypeError(f"peers are a subset of {list(PEERS)}, got {listed!r}")
    return [peer for peer in PEERS if peer in names]  # FLA first: it writes the initial weights


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="presets:\n" + preset_table(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="issue", help="model and batch size (default issue)")
    for name, meaning in (("layers", "blocks"), ("hidden", "hidden size"), ("heads", "heads of 128 (GDN: value heads)"),
                          ("batch", "rows"), ("seq-len", "tokens a row"), ("vocab", "vocabulary")):
        parser.add_argument(f"--{name}", type=positive_int, help=f"{meaning} (default: the preset's)")
    parser.add_argument("--models", type=parse_models, default=list(MODELS),
                        help=f"comma-separated subset of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--peers", type=parse_peers, default=list(PEERS), help="FLA,cute_kda (default both)")
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing and the peak (default 5)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--precision", choices=("bf16", "amp"), default="bf16",
                        help="bf16: bf16 weights and optimizer (default); amp: fp32 weights, bf16 autocast")
    parser.add_argument("--task", choices=TASKS, default="repeat", help="repeat: a repeated random block (default)")
    parser.add_argument("--block", type=positive_int, help="repeat: block length (default T/2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group", type=positive_int, default=2, help="GDN: value heads per q/k head (default 2)")
    parser.add_argument("--fla-unguarded", action="store_true",
                        help="turn FLA's Triton guard (#640) of its GatedDeltaNet backward off (speed and memory only)")
    parser.add_argument("--memory-profile", action="store_true",
                        help="one more step recorded: the bytes live at its peak by where they were allocated")
    parser.add_argument("--plot", action="store_true", help="also a PNG of the loss curves beside --out (matplotlib)")
    parser.add_argument("--in-process", action="store_true", help="run the peers in this process, one after the other")
    parser.add_argument("--worker-timeout", type=positive_int, default=540,
                        help="seconds per peer process (default 540)")
    parser.add_argument("--workdir", help="initial weights and worker results (default: a temporary folder)")
    parser.add_argument("--out", help="markdown file (default $OUT/model-<date>.md or benchmarks/results/)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def resolve_size(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Size:
    """The preset with the options given over it, checked."""
    size = PRESETS[args.preset][0]
    given = {field: getattr(args, field) for field in ("layers", "hidden", "heads", "batch", "seq_len", "vocab")
             if getattr(args, field) is not None}
    size = size._replace(**given)
    if "gdn" in args.models and size.heads % args.group:
        parser.error(f"--heads {size.heads} is not a multiple of --group {args.group} (GatedDeltaNet's value heads)")
    if args.task == "repeat" and args.block and 2 * args.block > size.seq_len:
        parser.error(f"--block {args.block} leaves no second copy in {size.seq_len} tokens")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    return size


def default_out() -> str:
    return dated_out("model", Path(__file__).resolve().parent / "results")


def commit() -> str:
    return checkout_commit(ROOT)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return
    size = resolve_size(args, parser)
    if not torch.cuda.is_available():
        sys.exit("bench_model needs a CUDA GPU (Hopper): nothing trained")
    from cute_kda._bench import environment

    out = args.out or default_out()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-model-"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", *(sys.argv if argv is None else ["benchmarks/bench_model.py", *argv])])
    env, sha = environment("fla", "triton", "transformers"), commit()
    rows: list[dict] = []
    for model in args.models:
        row = dict(model=model, size=size, group=args.group, peers={})
        for peer in args.peers:
            print(f"== {model} on {peer}", file=sys.stderr)
            row["peers"][peer] = run_peer(peer_spec(args, model, size, peer, workdir), args.in_process,
                                          args.worker_timeout)
        rows.append(row)
        save(report(rows, args, command, env, sha), out)  # after every model
    if args.plot and not plot_losses(rows, Path(out).with_suffix(".png")):
        print("no matplotlib: no plot", file=sys.stderr)
    publish(report(rows, args, command, env, sha), out)


if __name__ == "__main__":
    main()
