"""Training step benchmark: cute_kda's forward + backward against FLA's chunk_kda, same inputs, one run.

Both peers get the same tensors through FLA's signature (``cute_kda.chunk_kda`` and
``fla.ops.kda.chunk_kda``, FLA kept on its own kernels by ``FLA_CUTE_KDA=0``): raw bf16 q, k, v, g
and beta logits (``use_gate_in_kernel``, ``safe_gate``, ``lower_bound=-5``,
``use_qk_l2norm_in_kernel``, ``use_beta_sigmoid_in_kernel``), fp32 ``A_log [H]`` and ``dt_bias [H*K]``
(FLA's documented shape), an fp32 v-first initial state (``state_v_first=True``) and
``output_final_state=True``; q, k, v, g, beta, A_log, dt_bias and the initial state all require grad.
``cu_seqlens`` (varlen shapes) is passed with ``cu_seqlens_cpu``, as a training loop would.
``disable_recompute`` is FLA's default (False: the backward recomputes the forward's intermediates,
in cute_kda K1 and K2) unless ``--disable-recompute`` passes True to both peers (the forward keeps
them: more memory held, a shorter backward).

What is measured, per shape of ``benchmarks/shapes.py``:

- Speed. One step = the forward, then ``torch.autograd.backward((o, ht), (dO, dht))`` with fixed
  dO (bf16) and dht (fp32): the gradient of ``sum(o·dO) + sum(ht·dht)`` without the loss's own
  kernels; the leaves' ``.grad`` are reset to None before each step. Median of ``--steps``
  CUDA-event-timed steps after ``--warmup`` untimed ones (the first compiles / autotunes), each
  step timed alone (host launch cost included, no L2 flush). The forward alone of the training
  path (grad mode on, so everything the backward needs is kept) is timed the same way.
- Memory. "saved for backward": the unique storages (``untyped_storage().nbytes()``, a view counts
  its whole buffer once) of the tensors packed by ``torch.autograd.graph.saved_tensors_hooks``
  during one forward, united with the tensors reachable from the attributes of the autograd graph's
  Python nodes (``ctx.<name> = tensor``, also inside tuples, lists, dicts, NamedTuples, dataclasses and
  plain objects nested up to three deep): buffers an autograd Function keeps outside ``save_for_backward``. Storages
  shared with the inputs are counted apart. "peak extra": ``max_memory_allocated()`` during one step
  minus ``memory_allocated()`` before it (inputs, dO, dht live; grads None; cute_kda's inference
  workspace cache cleared first so a step that uses it pays for it). "retained": what is still
  allocated after the step (the gradients and any cache).
- Breakdown (cute_kda only, unless ``--no-profile``): torch.profiler over a few steps; every CUDA
  kernel's time goes to a group by its name (:data:`KERNEL_GROUPS`, the CuTe DSL names carry the
  kernel's module and class), the rest is "torch glue"; ms per step and launches per step. The
  heaviest kernel names are listed so the grouping can be checked.
- Agreement: rel-RMS of o, ht and every gradient, cute_kda against FLA, from one more step each.

The report is printed last and written to ``--out`` (default ``$OUT/train-<date>.md`` when ``$OUT``
is set, else ``benchmarks/results/train-<date>.md``) after every shape, so a run cut short keeps
what it measured.

    python benchmarks/bench_train.py                                        # six shapes, with FLA
    python benchmarks/bench_train.py --shapes B1_T8192_H96,B1_T8192_H64 --out /tmp/train.md
    python benchmarks/bench_train.py --peers none --no-profile --steps 10   # cute_kda only
    python benchmarks/bench_train.py --shapes B1_T8192_H96 --disable-recompute   # both peers keep intermediates
    python benchmarks/bench_train.py --shapes B1_T32768_H16 --segments 1         # cute_kda without segments
    python benchmarks/bench_train.py --shapes B1_T8192_H96 --head-dim 64          # K = V = 64 beside FLA
    python benchmarks/bench_train.py --shapes B1_T8192_H96 --dtype fp16          # fp16 inputs and dO, both peers

``--head-dim 64``: cute_kda runs every kernel compiled for 64, or with ``--padded-training`` pads to 128
(``cute_kda.call.runs_native``, ``NATIVE_TRAINING``); other sizes below 128
zero-padded to 128 (the D = 128 step plus the padding copies and the gradients' slices); FLA at that head dim.

``--segments N`` runs cute_kda's canonical call (``chunk_kda``'s translation, then ``kda_forward(..., segments=N)``)
instead of ``chunk_kda``, whose context-parallel split is the heuristic's (``cute_kda.context_parallel``); 1 keeps
every sequence whole.

On a fresh H200 every shape costs FLA's Triton autotune of its forward and backward (30-60 s each)
and cute_kda's first compiles; two shapes per call stay well under the 8-minute mark:
``--shapes B1_T8192_H96,B1_T8192_H64``, ``--shapes B1_T32768_H16,B8_T4096_H32``,
``--shapes varlen6_H96,varlen1024x8_H96``.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import sys
import traceback
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton path, not its FlashKDA dispatch
os.environ.setdefault("FLA_CUTE_KDA", "0")  # nor its dispatch to cute_kda (cute_kda.fla_backend)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from cute_kda._bench import (  # noqa: E402
    SWITCHES, add_switches, apply_switches, checkout_commit, dated_out, environment, event_median_ms, markdown_table,
    positive_int, publish, save)

from shapes import D, LOWER_BOUND, SHAPES, head_dim, head_dim_note, make_inputs  # noqa: E402

GOAL = 0.35  # the training target: a cute_kda step (fwd+bwd, FLA's recompute semantics) in ≤ 0.35× FLA's time
GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype: q, k, v, g, beta and dO
AGREEMENT = ("o", "ht", *GRAD_NAMES)
PROFILE_STEPS = 5
TOP_KERNELS = 8
GLUE = "torch glue"
# (group, regex on the CUDA kernel name); first match wins, unmatched kernels are torch glue
KERNEL_GROUPS = (
    ("K1 prepare", r"fwd_prepare|PrepareKernel|tile_prefix|TilePrefix"),
    ("K2 training", r"fwd_recurrence|FwdRecurrence"),
    ("Kernel A", r"bwd_scan|BwdScan"),
    ("Kernel B", r"bwd_grads|BwdGrads"),
    ("other cute_kda", r"cute_kda|kernel_cutlass"),
)
GROUPS = tuple(group for group, _ in KERNEL_GROUPS) + (GLUE,)


# ---------------------------------------------------------------------------------------------
# arithmetic and options (no GPU)


def parse_shapes(listed: str) -> list[str]:
    """``"a,b"`` → ["a", "b"], each a key of :data:`SHAPES`, order kept, duplicates dropped."""
    names = list(dict.fromkeys(name.strip() for name in listed.split(",") if name.strip()))
    unknown = [name for name in names if name not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown or no shapes {unknown or listed!r}; choose from {list(SHAPES)}")
    return names


# the library switches a training step can flip (cute_kda._bench.SWITCHES; the command line in the report records
# them): all but GatedDeltaNet's group sums and pair partner fields, which these shapes do not run
TRAIN_SWITCHES = tuple(flag for flag in SWITCHES if flag not in ("--no-group-sum", "--no-partner-fields"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=list(SHAPES),
                        help=f"comma-separated subset of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--peers", choices=("fla", "none"), default="fla",
                        help="'none' times cute_kda alone (default: fla)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per median (default 20)")
    parser.add_argument("--warmup", type=positive_int, default=3,
                        help="untimed steps first; the first compiles / autotunes (default 3)")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown")
    parser.add_argument("--disable-recompute", action="store_true",
                        help="pass disable_recompute=True to both peers (default: FLA's False, recompute in the backward)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                        help="q, k, v, g, beta and dO in bf16 (default) or fp16 (FLA's test dtype), for both peers")
    parser.add_argument("--segments", type=positive_int, default=None,
                        help="cute_kda's context-parallel segments per sequence (default: its heuristic; 1: none)")
    parser.add_argument("--head-dim", type=head_dim, default=D,
                        help=f"K = V of every input (default {D}; cute_kda runs 64 natively, other smaller ones "
                             f"zero-padded to {D})")
    add_switches(parser, TRAIN_SWITCHES)
    parser.add_argument("--out", help="markdown file (default $OUT/train-<date>.md or benchmarks/results/)")
    return parser


def default_out(dim: int = D) -> str:
    return dated_out("train" if dim == D else f"train-d{dim}", Path(__file__).resolve().parent / "results")


def commit() -> str:
    return checkout_commit(ROOT)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None when either is missing or theirs is 0."""
    return ours / theirs if ours is not None and theirs else None


def goal_cell(value: float | None, goal: float = GOAL) -> str:
    if value is None:
        return "—"
    return "met" if value <= goal else f"not met ({value / goal:.2f}× over)"


def classify_kernel(name: str) -> str:
    """The :data:`KERNEL_GROUPS` group of a CUDA kernel name, :data:`GLUE` when none matches."""
    for group, pattern in KERNEL_GROUPS:
        if re.search(pattern, name):
            return group
    return GLUE


def kernel_breakdown(kernels: Iterable[tuple[str, float, int]], steps: int) -> dict[str, tuple[float, float]]:
    """(name, total µs, launches) over ``steps`` steps → group → (ms per step, launches per step), every
    group of :data:`GROUPS` present (zero when unseen)."""
    totals = {group: [0.0, 0] for group in GROUPS}
    for name, us, count in kernels:
        cell = totals[classify_kernel(name)]
        cell[0] += us
        cell[1] += count
    return {group: (us / 1e3 / steps, count / steps) for group, (us, count) in totals.items()}


def top_kernels(kernels: Iterable[tuple[str, float, int]], steps: int, n: int = TOP_KERNELS) -> list[tuple]:
    """The ``n`` heaviest kernels: (name, group, ms per step, launches per step), heaviest first."""
    ranked = sorted(kernels, key=lambda kernel: -kernel[1])[:n]
    return [(name, classify_kernel(name), us / 1e3 / steps, count / steps) for name, us, count in ranked]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:120]


def agreement(ours: dict, theirs: dict, rel: Callable) -> dict[str, float]:
    """name → ``rel(ours[name], theirs[name])`` for the :data:`AGREEMENT` names both have; a pair that
    ``rel`` refuses (shapes differ) is left out with a line on stderr."""
    result = {}
    for key in AGREEMENT:
        if key in ours and key in theirs:
            try:
                result[key] = rel(ours[key], theirs[key])
            except (ValueError, RuntimeError) as error:
                print(f"agreement of {key}: {_first_line(error)}", file=sys.stderr)
    return result


# ---------------------------------------------------------------------------------------------
# bytes saved for backward (no GPU needed)


class SavedTensors:
    """Context manager: every tensor autograd packs for backward while it is active, in ``.tensors``
    (the pack hook returns the tensor itself, so the backward is unchanged)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tensors.append(tensor)
        return tensor

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _collect(value, found: list, seen: set, depth: int) -> None:
    """Tensors in ``value``: itself, or inside containers / NamedTuples / dataclasses / plain objects."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return
    if depth <= 0 or value is None or isinstance(value, (str, bytes, int, float, bool, complex, type)):
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    elif is_dataclass(value):
        items = [getattr(value, f.name, None) for f in fields(value)]
    elif callable(value) or type(value).__module__ in ("builtins", "torch") or not hasattr(value, "__dict__"):
        return  # functions, modules, devices, dtypes, streams ...
    else:
        items = list(vars(value).values())
    for item in items:
        _collect(item, found, seen, depth - 1)


def ctx_tensors(roots: Iterable, depth: int = 3) -> list[torch.Tensor]:
    """Tensors held in the attributes of the Python nodes (autograd Function contexts) of the graph
    reachable from ``roots`` (``grad_fn`` nodes or None): what a Function keeps as ``ctx.<name>``."""
    found: list[torch.Tensor] = []
    seen_nodes, seen_values = set(), set()
    stack = [root for root in roots if root is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        attributes = getattr(node, "__dict__", None)  # C++ nodes have none
        if attributes:
            for value in attributes.values():
                _collect(value, found, seen_values, depth)
        stack.extend(child for child, _ in getattr(node, "next_functions", ()) if child is not None)
    return found


def storages(tensors: Iterable[torch.Tensor]) -> dict[tuple, int]:
    """(device, storage address) → storage bytes of every distinct storage behind ``tensors``."""
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        found[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return found


class SavedBytes(NamedTuple):
    """Unique storage bytes kept for the backward: ``total`` (packed ∪ ctx attributes), the part that
    is the inputs' own storage, and the part held only in ctx attributes."""

    total: int
    inputs: int
    ctx_only: int

    @property
    def beyond_inputs(self) -> int:
        return self.total - self.inputs


def count_saved(packed: Iterable[torch.Tensor], kept: Iterable[torch.Tensor],
                inputs: Iterable[torch.Tensor]) -> SavedBytes:
    """:class:`SavedBytes` of the tensors ``packed`` by the hooks and ``kept`` in ctx attributes."""
    packed, kept, given = storages(packed), storages(kept), storages(inputs)
    union = {**packed, **kept}
    return SavedBytes(total=sum(union.values()), inputs=sum(n for key, n in union.items() if key in given),
                      ctx_only=sum(n for key, n in kept.items() if key not in packed))


def saved_for_backward(forward: Callable[[], tuple], inputs: Iterable[torch.Tensor]) -> SavedBytes:
    """:class:`SavedBytes` of one call of ``forward`` (grad mode on), its outputs dropped after."""
    with torch.enable_grad(), SavedTensors() as saved:
        outputs = forward()
    outputs = [x for x in outputs if isinstance(x, torch.Tensor)]
    kept = ctx_tensors(x.grad_fn for x in outputs)
    result = count_saved(saved.tensors, kept, inputs)
    del outputs, kept, saved
    return result


# ---------------------------------------------------------------------------------------------
# report (no GPU)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _mb(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 1e6:.1f}"


def _peer(row: dict, peer: str) -> dict:
    return row["peers"].get(peer) or {}


def speed_table(rows: list[dict]) -> str:
    head = ["shape", "cute_kda fwd+bwd ms", "FLA fwd+bwd ms", "cute_kda / FLA", f"goal ≤ {GOAL}×",
            "cute_kda fwd ms", "FLA fwd ms", "fwd cute_kda / FLA", "notes"]
    table = []
    for row in rows:
        ours, fla = _peer(row, "cute_kda"), _peer(row, "FLA")
        step = ratio(ours.get("step_ms"), fla.get("step_ms"))
        notes = "; ".join(f"{peer}: {info['note']}" for peer, info in row["peers"].items() if info.get("note"))
        table.append([row["shape"], _ms(ours.get("step_ms")), _ms(fla.get("step_ms")), _x(step), goal_cell(step),
                      _ms(ours.get("fwd_ms")), _ms(fla.get("fwd_ms")),
                      _x(ratio(ours.get("fwd_ms"), fla.get("fwd_ms"))), notes or "—"])
    return markdown_table(head, table)


def memory_table(rows: list[dict]) -> str:
    head = ["shape", "peer", "inputs MB", "saved for bwd MB", "of it inputs MB", "beyond inputs MB",
            "in ctx attributes only MB", "peak extra MB (fwd+bwd)", "retained after step MB",
            "beyond inputs, cute_kda / FLA", "peak extra, cute_kda / FLA"]
    table = []
    for row in rows:
        fla = _peer(row, "FLA")
        for peer, info in row["peers"].items():
            saved = info.get("saved")
            ratios = ["", ""]
            if peer == "cute_kda":
                theirs = fla.get("saved")
                ratios = [_x(ratio(saved.beyond_inputs if saved else None, theirs.beyond_inputs if theirs else None)),
                          _x(ratio(info.get("peak_bytes"), fla.get("peak_bytes")))]
            table.append([row["shape"], peer, _mb(row.get("input_bytes")), _mb(saved.total if saved else None),
                          _mb(saved.inputs if saved else None), _mb(saved.beyond_inputs if saved else None),
                          _mb(saved.ctx_only if saved else None), _mb(info.get("peak_bytes")),
                          _mb(info.get("retained_bytes")), *ratios])
    return markdown_table(head, table)


def breakdown_table(rows: list[dict]) -> str:
    head = ["shape", *GROUPS, "kernels Σ", "step median (events)"]
    table = []
    for row in rows:
        parts = row.get("breakdown")
        if not parts:
            continue
        cells = [f"{ms:.3f} ({calls:g})" for ms, calls in (parts[group] for group in GROUPS)]
        total = sum(ms for ms, _ in parts.values())
        table.append([row["shape"], *cells, f"{total:.3f}", _ms(_peer(row, "cute_kda").get("step_ms"))])
    return markdown_table(head, table)


def kernels_table(rows: list[dict]) -> str:
    head = ["shape", "kernel (first 90 characters)", "group", "ms / step", "launches / step"]
    table = [[row["shape"], f"`{name[:90]}`", group, f"{ms:.3f}", f"{calls:g}"]
             for row in rows for name, group, ms, calls in row.get("top") or ()]
    return markdown_table(head, table)


def agreement_table(rows: list[dict]) -> str:
    labels = {"o": "o", "ht": "ht", "initial_state": "dh0"}
    head = ["shape", *(labels.get(name, "d" + name) for name in AGREEMENT)]
    table = [[row["shape"], *(f"{row['agreement'][name]:.1e}" if name in row["agreement"] else "—"
                              for name in AGREEMENT)]
             for row in rows if row.get("agreement")]
    return markdown_table(head, table)


def report(rows: list[dict], command: str, env: str, sha: str, steps: int, warmup: int,
           disable_recompute: bool = False, segments: int | None = None, head_dim: int = D,
           dtype: str = "bf16") -> str:
    parts = [
        "# Training step (forward + backward): cute_kda vs FLA chunk_kda",
        f"Command: `{command}` · commit `{sha}`",
        f"{env} · D={head_dim}{head_dim_note(head_dim, training=True)}, "
        f"{dtype} q/k/v/g/beta (raw; gate, l2norm and β-sigmoid in-kernel, safe_gate, "
        f"lower_bound={LOWER_BOUND}), fp32 A_log/dt_bias/initial state (v-first), all requiring grad; "
        f"disable_recompute={disable_recompute} for both peers; cute_kda's context-parallel segments: "
        f"{'its heuristic' if segments is None else segments}; "
        f"step = forward + backward of sum(o·dO) + sum(ht·dht), fixed dO {dtype} / dht fp32; medians of {steps} "
        f"CUDA-event-timed steps after {warmup} warm-up steps; ratios cute_kda / FLA (< 1: cute_kda faster)",
        speed_table(rows),
        "Memory (MB = 10⁶ bytes). Saved for bwd: unique storages packed by saved_tensors_hooks during one "
        "forward ∪ tensors kept as attributes of the graph's autograd-Function contexts; \"in ctx attributes "
        "only\" is the part outside save_for_backward. Peak extra: max_memory_allocated during one fwd+bwd "
        "minus memory_allocated before it (inputs, dO, dht live, grads None, cute_kda's workspace cache "
        "cleared); retained: still allocated after the step (gradients, caches).",
        memory_table(rows),
    ]
    if any(row.get("breakdown") for row in rows):
        parts += [f"cute_kda step by kernel group (torch.profiler over {PROFILE_STEPS} steps): ms per step "
                  "(launches per step); torch glue = every kernel no group claims (copies, casts, reductions, "
                  "memsets). Σ below the step median is host / launch gap.",
                  breakdown_table(rows), "Heaviest kernels (to check the grouping):", kernels_table(rows)]
    if any(row.get("agreement") for row in rows):
        parts += ["Agreement: rel-RMS of cute_kda against FLA (one step each, same inputs):", agreement_table(rows)]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------
# measuring (GPU)


def make_problem(name: str, device: torch.device, disable_recompute: bool = False, dim: int = D,
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """Inputs of ``name`` at head dim ``dim`` as autograd leaves (dt_bias flattened to FLA's [H*K]; q, k, v, g, beta
    and dO in ``dtype``), fixed dO / dht, the kwargs (FLA's ``disable_recompute`` as given)."""
    shape = SHAPES[name]
    inputs = make_inputs(shape, device, dim=dim)
    inputs["dt_bias"] = inputs["dt_bias"].reshape(-1).contiguous()
    for key in ("q", "k", "v", "g", "beta"):
        inputs[key] = inputs[key].to(dtype)
    leaves = {key: inputs[key].requires_grad_() for key in GRAD_NAMES}
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(inputs["v"].shape, generator=gen, device=device).to(dtype)
    dht = 0.1 * torch.randn(inputs["initial_state"].shape, generator=gen, device=device)
    cu_seqlens = inputs["cu_seqlens"]
    kwargs = dict(
        scale=dim ** -0.5, initial_state=leaves["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
        A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], state_v_first=True, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=None if cu_seqlens is None else cu_seqlens.cpu(), disable_recompute=disable_recompute,
    )
    input_tensors = [*leaves.values()] + ([cu_seqlens] if cu_seqlens is not None else [])
    return dict(leaves=leaves, do=do, dht=dht, kwargs=kwargs, inputs=input_tensors,
                input_bytes=sum(storages(input_tensors).values()))


def peer_forwards(problem: dict, peers: str, segments: int | None = None) -> dict[str, Callable[[], tuple]]:
    """name → zero-argument forward (o, ht) through FLA's signature; FLA left out when absent or not asked.
    ``segments``: cute_kda's context-parallel split (None: ``chunk_kda``, its heuristic)."""
    import cute_kda
    from cute_kda.fla_calls import translate_fla_call

    leaves, kwargs = problem["leaves"], problem["kwargs"]
    tensors = [leaves[key] for key in ("q", "k", "v", "g", "beta")]
    runs = {"cute_kda": lambda: cute_kda.chunk_kda(*tensors, **kwargs)}
    if segments is not None:

        def split_forward() -> tuple:
            call = translate_fla_call(*tensors, **kwargs)
            return call.run(lambda *t, **options: cute_kda.kda_forward(*t, **options, recompute=call.recompute,
                                                                       segments=segments))

        runs["cute_kda"] = split_forward
    if peers == "fla":
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda

            runs["FLA"] = lambda: fla_chunk_kda(*tensors, **kwargs)
        except ImportError as error:
            print(f"FLA not importable, skipped: {error}", file=sys.stderr)
    return runs


def run_step(forward: Callable[[], tuple], problem: dict) -> tuple:
    """One training step: grads reset, forward, backward with the fixed dO / dht; returns (o, ht) detached."""
    for leaf in problem["leaves"].values():
        leaf.grad = None
    with torch.enable_grad():
        o, ht = forward()
        torch.autograd.backward((o, ht), (problem["do"], problem["dht"]))
    return o.detach(), ht.detach()


def _clear_cute_kda_cache() -> None:
    try:
        from cute_kda.executors.inference import WORKSPACES
    except ImportError:
        return
    WORKSPACES.clear()


def step_memory(forward: Callable[[], tuple], problem: dict, clear_cache: bool) -> tuple[int, int]:
    """(peak extra bytes, retained bytes) of one step, over what is allocated before it."""
    for leaf in problem["leaves"].values():
        leaf.grad = None
    if clear_cache:
        _clear_cute_kda_cache()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_step(forward, problem)  # outputs dropped on return
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base


def profile_kernels(step: Callable[[], object], steps: int) -> list[tuple[str, float, int]]:
    """(kernel name, total device µs, launches) of every CUDA kernel of ``steps`` calls of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return [(event.key, float(event.device_time_total), int(event.count)) for event in prof.key_averages()
            if event.device_type == cuda]


def snapshot(forward: Callable[[], tuple], problem: dict) -> dict[str, torch.Tensor]:
    """o, ht and every leaf's gradient after one step, cloned."""
    o, ht = run_step(forward, problem)
    result = {"o": o.clone(), "ht": ht.clone()}
    for key, leaf in problem["leaves"].items():
        if leaf.grad is not None:
            result[key] = leaf.grad.detach().clone()
        leaf.grad = None
    return result


def bench_peer(peer: str, forward: Callable[[], tuple], problem: dict, args, keep: dict) -> dict:
    """Speed, memory and saved bytes of one peer; ``keep[peer]`` gets its outputs and gradients."""
    info: dict = dict(note="")
    step = lambda: run_step(forward, problem)  # noqa: E731
    stage = "step"
    try:
        info["step_ms"] = event_median_ms(step, reps=args.steps, warmup_calls=args.warmup)
        stage = "forward"
        with torch.enable_grad():
            info["fwd_ms"] = event_median_ms(forward, reps=args.steps, warmup_calls=1)
        stage = "memory"
        info["peak_bytes"], info["retained_bytes"] = step_memory(forward, problem, clear_cache=peer == "cute_kda")
        stage = "saved bytes"
        info["saved"] = saved_for_backward(forward, problem["inputs"])
        stage = "agreement step"
        keep[peer] = snapshot(forward, problem)
        print(f"{peer:9s} step {info['step_ms']:.3f} ms, forward {info['fwd_ms']:.3f} ms, peak extra "
              f"{info['peak_bytes'] / 1e6:.1f} MB, saved {info['saved'].total / 1e6:.1f} MB", file=sys.stderr)
    except Exception as error:  # keep the other peer's numbers
        traceback.print_exc()
        info["note"] = f"{stage}: {_first_line(error)}"
    for leaf in problem["leaves"].values():
        leaf.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    return info


def bench_shape(name: str, args, device: torch.device | None = None) -> dict:
    """Every measurement of one shape (``device``: CUDA by default; the CPU tests pass theirs)."""
    from cute_kda.reference import rel_rms

    print(f"== {name}", file=sys.stderr)
    problem = make_problem(name, device or torch.device("cuda"), args.disable_recompute, args.head_dim,
                           DTYPES[args.dtype])
    forwards = peer_forwards(problem, args.peers, args.segments)
    row: dict = dict(shape=name, input_bytes=problem["input_bytes"], peers={}, agreement={})
    keep: dict = {}
    for peer, forward in forwards.items():
        row["peers"][peer] = bench_peer(peer, forward, problem, args, keep)
    if args.peers == "fla" and "FLA" not in forwards:
        row["peers"]["FLA"] = dict(note="not installed")
    if "cute_kda" in keep and "FLA" in keep:
        row["agreement"] = agreement(keep["cute_kda"], keep["FLA"], rel_rms)
    keep.clear()
    if not args.no_profile and "step_ms" in row["peers"]["cute_kda"]:
        try:
            kernels = profile_kernels(lambda: run_step(forwards["cute_kda"], problem), PROFILE_STEPS)
            row["breakdown"] = kernel_breakdown(kernels, PROFILE_STEPS)
            row["top"] = top_kernels(kernels, PROFILE_STEPS)
        except Exception as error:
            traceback.print_exc()
            row["peers"]["cute_kda"]["note"] += f" profile: {_first_line(error)}"
    del problem, forwards
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_train needs a CUDA GPU (Hopper): nothing timed")
    apply_switches(args, TRAIN_SWITCHES)
    out = args.out or default_out(args.head_dim)
    command = shlex.join(["python", *(sys.argv if argv is None else ["benchmarks/bench_train.py", *argv])])
    env = environment("cutlass", "fla", "triton", labels={"cutlass": "cutlass-dsl"})
    sha = commit()
    rows: list[dict] = []
    options = (args.disable_recompute, args.segments, args.head_dim, args.dtype)
    text = report(rows, command, env, sha, args.steps, args.warmup, *options)
    for name in args.shapes:
        rows.append(bench_shape(name, args))
        text = report(rows, command, env, sha, args.steps, args.warmup, *options)
        save(text, out)  # after every shape
    publish(text, out)


if __name__ == "__main__":
    main()
