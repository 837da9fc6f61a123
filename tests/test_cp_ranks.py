"""Context parallelism across processes: FLA's ``cp_context`` in ``chunk_kda`` and ``chunk_gated_delta_rule``
(``cute_kda/distributed.py``, ``RankChain`` in ``cute_kda/context_parallel.py``, the reading in
``cute_kda/fla_calls.py``).

CPU tier: 2 and 3 processes (``torch.multiprocessing``, a gloo group) run FLA-level calls on the reference backend
(the mirrors), each on its rank's share of the tokens laid out as FLA lays them out (contiguous and zigzag), with
and without initial states, KDA's safe gate and GatedDeltaNet's per-head gate with grouped value heads. Against the
unsplit call on the same backend and autograd through the fp64 gold: the output and every gradient, the final
state of each sequence (on the rank where it ends) and the state a rank hands on (against the gold of the sequence
cut there); the first rank's first interval bit-identical to the unsplit call. Half the gate channels (heads, for
GatedDeltaNet) barely decay, so the states crossing ranks carry weight: a chain combined in the wrong rank order
fails the same checks (the control). Refusals name ``cp_context``; the layout of ``build_cp_context`` on known
cases; ``benchmarks/bench_cp.py`` imports and parses its arguments.

GPU tier: ``tests/test_cp_ranks_gpu.py``.
"""

from __future__ import annotations

import datetime
import functools
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock  # torch's own dependency

import cute_kda
from cute_kda import context_parallel, distributed, fla_calls
from cute_kda.fla_calls import translate_fla_call, translate_fla_gdn_call
from cute_kda.reference import gold_backward, gold_forward, rel_rms

from gradient_targets import SAFE_GATE_TOLERANCES, TARGETS
from test_autograd import REFERENCE_FORWARD
from test_fla_compat import FLAGS, make_problem
from test_gdn import gdn_problem

pytestmark = pytest.mark.filterwarnings("ignore:cute_kda mirror on CPU:RuntimeWarning")

GOLD_BOUND = 6e-3  # o and the states against the fp64 gold, as the forward's tests hold them
UNSPLIT_BOUND = 1e-2  # the gradients against the unsplit call (rounding: the entering states pass the fp32 combine;
# dg, dbeta: their gold targets, 2e-2)
GRADIENTS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log", "dt_bias": "ddt_bias",
             "initial_state": "dh0"}
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")

CASES = {  # layout, ranks, global sequence lengths, "kda" | "gdn", initial state
    "kda_2_ranks_one_sequence_state": ("contiguous", 2, [96], "kda", True),
    # intervals of 32: rank 1 passes sequence 1 through; rank 2 holds its tail (and a dht on it) and sequence 2
    "kda_3_ranks_passing_through": ("contiguous", 3, [10, 76, 10], "kda", False),
    "gdn_3_ranks_passing_through_state": ("contiguous", 3, [10, 76, 10], "gdn", True),
    # 4 intervals of 24: rank 0 holds intervals 0 and 3, rank 1 intervals 1 and 2
    "gdn_zigzag_2_ranks_two_sequences": ("zigzag", 2, [50, 46], "gdn", False),
}
# the local sequences also cut into segments of this many tokens inside each rank (RankChain.length; on a GPU the
# heuristic picks it for long shares)
SEGMENT_TOKENS = {"kda_3_ranks_segments_inside_state": 16}
CASES["kda_3_ranks_segments_inside_state"] = ("contiguous", 3, [10, 76, 10], "kda", True)
CONTROL = "kda_3_ranks_passing_through"  # run again with the ranks' pieces combined in reverse order


# ============================================================================ the problems and one step

def global_problem(kind: str, lengths: list[int], state: bool) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """FLA-level arguments of the whole group's call (one packed row, ``cu_seqlens``), every other gate channel
    (KDA) or value head (GatedDeltaNet) held at a decay ≈ 1, with ``do`` and ``dht`` (K-first, FLA's layout)."""
    if kind == "kda":
        problem = make_problem(lengths, state="kv" if state else None, seed=11)
        problem = {**problem, **FLAGS, "output_final_state": True}
    else:
        problem = gdn_problem(lengths, raw_gate=True, state="fp32" if state else None, seed=11)
    problem["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    problem = {name: x.reshape(1, -1, *x.shape[2:]) if name in TOKEN_INPUTS else x for name, x in problem.items()}
    g = problem["g"].clone()
    g[..., ::2] = -12.0  # sigmoid / softplus of it ≈ 0: no decay there
    problem["g"] = g
    gen = torch.Generator().manual_seed(12)
    value_heads, dim = problem["v"].shape[2:]
    do = torch.randn(problem["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(len(lengths), value_heads, problem["q"].shape[3], dim, generator=gen)
    return problem, do, dht


def translation(kind: str):
    return translate_fla_call if kind == "kda" else translate_fla_gdn_call


def entry_point(kind: str, gpu: bool):
    """The FLA-signature call of ``kind``: the public one (the kernels) on a GPU, else the translation run on the
    reference backend."""
    if gpu:
        return cute_kda.chunk_kda if kind == "kda" else cute_kda.chunk_gated_delta_rule

    def on_the_mirrors(**arguments):  # chunk_kda's recompute (FLA's default: the backward reruns the forward)
        call = translation(kind)(**arguments)
        return call.run(functools.partial(REFERENCE_FORWARD, recompute=getattr(call, "recompute", False)))

    return on_the_mirrors


def step(entry, arguments: dict, do: torch.Tensor, dht: torch.Tensor) -> tuple:
    """One training step of ``entry`` (an FLA-signature call): (o, final state, {input: gradient}) of
    ``Σ o·do + Σ ht·dht``, on the CPU."""
    leaves = {name: x.detach().clone().requires_grad_() if name in GRADIENTS and isinstance(x, torch.Tensor) else x
              for name, x in arguments.items()}
    o, ht = entry(**leaves)
    torch.autograd.backward([o, ht], [do, dht])
    return o.detach().cpu(), ht.detach().cpu(), {name: leaves[name].grad.cpu() for name in GRADIENTS if name in leaves}


def intervals(layout: str, world: int, total: int, rank: int) -> list[tuple[int, int]]:
    """The token intervals rank ``rank`` holds, in its local order."""
    slots = world if layout == "contiguous" else 2 * world
    length = total // slots
    own = (rank,) if layout == "contiguous" else (rank, slots - 1 - rank)
    return [(slot * length, (slot + 1) * length) for slot in own]


def local_sequences(bounds: list[int], spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """(the global sequence of every local sequence, whether it ends in its interval)."""
    ids, ending = [], []
    for start, end in spans:
        for n in range(len(bounds) - 1):
            if bounds[n] < end and bounds[n + 1] > start:
                ids.append(n)
                ending.append(bounds[n + 1] <= end)
    return ids, ending


def rank_step(case: tuple, rank: int, group: dist.ProcessGroup, device: torch.device, length: int = 0) -> dict:
    """This rank's share of ``case`` (a :data:`CASES` row) in ``group`` (its first ranks): its call with
    ``cp_context`` (its local sequences cut into segments of ``length`` tokens when given) and what the checks
    need."""
    if length:
        read = fla_calls.rank_chain_of
        fla_calls.rank_chain_of = lambda context: read(context)._replace(length=length)
        try:
            return rank_step(case, rank, group, device)
        finally:
            fla_calls.rank_chain_of = read
    layout, world, lengths, kind, state = case
    problem, do, dht = global_problem(kind, lengths, state)
    bounds = problem["cu_seqlens"].tolist()
    spans = intervals(layout, world, bounds[-1], rank)
    tokens = torch.cat([torch.arange(start, end) for start, end in spans])
    ids, ending = local_sequences(bounds, spans)
    local = {name: x[:, tokens] if name in TOKEN_INPUTS else x for name, x in problem.items() if name != "cu_seqlens"}
    if "initial_state" in problem:
        local["initial_state"] = problem["initial_state"][ids]
    local = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in local.items()}
    local["cp_context"] = distributed.build_cp_context(problem["cu_seqlens"].to(device), group, layout)
    local_dht = dht[ids] * torch.tensor(ending, dtype=dht.dtype)[:, None, None, None]  # a handed-on state: none
    o, ht, grads = step(entry_point(kind, device.type == "cuda"), local, do[:, tokens].to(device),
                        local_dht.to(device))
    return dict(o=o, ht=ht, grads=grads, tokens=tokens, ids=ids, ending=ending)


def refusals(rank: int, world: int) -> dict:
    """The error of each malformed ``cp_context`` (the same on every rank: none reaches a collective)."""
    problem, _, _ = global_problem("kda", [96 * world], False)
    share = {name: x[:, rank * 96:(rank + 1) * 96] if name in TOKEN_INPUTS else x
             for name, x in problem.items() if name != "cu_seqlens"}
    context = distributed.build_cp_context(problem["cu_seqlens"], dist.group.WORLD)
    bad = {
        "layout": dict(layout="diagonal"),
        "pre_num_ranks": dict(pre_num_ranks=world),
        "post_num_ranks": dict(post_num_ranks=-1),
        "front_num_seqs": dict(layout="zigzag", front_num_seqs=0),
        "cu_seqlens_cpu": dict(cu_seqlens_cpu=torch.tensor([0, 48, 96])),
    }
    errors = {}
    for label, changes in {**bad, "tokens": {}}.items():
        arguments = dict(share, cp_context=distributed.CPContext(**{**vars(context), **changes}))
        if label == "tokens":  # the rank's share is 96 tokens: a call with 95 is not it
            arguments.update({name: x[:, :95] for name, x in share.items() if name in TOKEN_INPUTS})
        try:
            step(entry_point("kda", False), arguments, torch.zeros(1, arguments["v"].shape[1], 2, 128).bfloat16(),
                 torch.zeros(1, 2, 128, 128))
            errors[label] = None
        except (TypeError, ValueError, NotImplementedError) as error:
            errors[label] = (type(error).__name__, str(error))
    return errors


def _ranks(rank: int, world: int, cases: dict, out: str, gpu: bool) -> None:
    """One process of a group of ``world``: every case of ``cases`` on the group's first ranks that it names (on GPU
    ``rank`` over NCCL when ``gpu``, else on the CPU over gloo, with the control and the refusals), saved to
    ``out``."""
    warnings.filterwarnings("ignore", "cute_kda mirror on CPU")
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        distributed.keep_multicast_off()
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the group shares the CPU tier's cores
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        groups = {size: dist.new_group(list(range(size))) for size in sorted({case[1] for case in cases.values()})}
        results = {name: rank_step(case, rank, groups[case[1]], device, SEGMENT_TOKENS.get(name, 0))
                   for name, case in cases.items() if rank < case[1]}
        if not gpu and CONTROL in cases:
            in_order = context_parallel.RankChain._in_chain_order
            context_parallel.RankChain._in_chain_order = lambda chain, gathered: in_order(chain, gathered.flip(0))
            try:
                results["control"] = rank_step(cases[CONTROL], rank, groups[cases[CONTROL][1]], device)
            finally:
                context_parallel.RankChain._in_chain_order = in_order
        if not gpu:
            results["refusals"] = refusals(rank, world)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, cases: dict, out, gpu: bool = False) -> list[dict]:
    """Each rank's results of ``cases`` (rows of :data:`CASES` for ``world`` ranks or fewer) from one group of
    ``world`` processes."""
    mp.spawn(_ranks, args=(world, cases, str(out), gpu), nprocs=world, join=True)
    return [torch.load(os.path.join(out, f"rank{rank}.pt"), weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, request) -> list[dict]:
    """Each rank's results: one group of processes for every case (spawning costs more than the cases), once per
    session: pytest-xdist workers share the folder above their own and the first to come runs the group."""
    world = max(case[1] for case in CASES.values())
    if not hasattr(request.config, "workerinput"):
        return run_ranks(world, CASES, tmp_path_factory.mktemp("cp"))
    shared = tmp_path_factory.getbasetemp().parent / "cp_ranks"
    with FileLock(f"{shared}.lock"):
        if not (shared / "done").exists():
            shared.mkdir(exist_ok=True)
            run_ranks(world, CASES, shared)
            (shared / "done").touch()
    return [torch.load(shared / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


# ============================================================================ the checks

def gold_of(kind: str, problem: dict, do: torch.Tensor, dht: torch.Tensor) -> tuple:
    """(o, final state, {input: gradient}) of the fp64 gold on the translated call, in FLA's shapes and layouts."""
    call = translation(kind)(**problem)
    options = {n: x for n, x in call.options.items() if n != "output_final_state"}
    o, ht = gold_forward(*call.tensors, state_layout="vk", output_final_state=True, **options)
    want = gold_backward(*call.tensors, do, dht=dht.transpose(-1, -2), state_layout="vk", **options)
    grads = {name: want[GRADIENTS[name]] for name in GRADIENTS if name in problem}
    grads["dt_bias"] = grads["dt_bias"].reshape(problem["dt_bias"].shape)
    if "initial_state" in grads:
        grads["initial_state"] = grads["initial_state"].transpose(-1, -2)
    return o, ht.transpose(-1, -2), grads


def assembled(kind: str, problem: dict, shares: list[dict]) -> tuple:
    """The ranks' results as the unsplit call's: tokens in place, each sequence's final state from the rank where it
    ends, the replicated parameters' and the initial states' gradients summed over the ranks."""
    o = torch.empty(problem["v"].shape, dtype=torch.bfloat16)
    ht = torch.full((len(problem["cu_seqlens"]) - 1, *shares[0]["ht"].shape[1:]), float("nan"))
    grads = {name: torch.zeros_like(problem[name], dtype=shares[0]["grads"][name].dtype)
             for name in shares[0]["grads"]}
    for share in shares:
        o[:, share["tokens"]] = share["o"]
        for row, (n, ends) in enumerate(zip(share["ids"], share["ending"])):
            if ends:
                ht[n] = share["ht"][row]
        for name, grad in share["grads"].items():
            if name in TOKEN_INPUTS:
                grads[name][:, share["tokens"]] = grad
            elif name == "initial_state":
                grads[name].index_add_(0, torch.tensor(share["ids"]), grad)
            else:
                grads[name] += grad
    return o, ht, grads


def handed_on_states(kind: str, problem: dict, layout: str, world: int, shares: list[dict]) -> list[tuple]:
    """(a rank's final state of a sequence it hands on, the gold state of that sequence cut at the rank's end)."""
    bounds = problem["cu_seqlens"].tolist()
    pairs = []
    for rank, share in enumerate(shares):
        rows = [(n, end) for start, end in intervals(layout, world, bounds[-1], rank)
                for n in local_sequences(bounds, [(start, end)])[0]]
        for row, (n, end) in enumerate(rows):
            if share["ending"][row]:
                continue
            cut = {name: x[:, bounds[n]:end] if name in TOKEN_INPUTS else x for name, x in problem.items()}
            cut["cu_seqlens"] = torch.tensor([0, end - bounds[n]])
            if "initial_state" in problem:
                cut["initial_state"] = problem["initial_state"][n:n + 1]
            _, state = translation(kind)(**cut).run(lambda *t, **o: gold_forward(*t, state_layout="vk", **o))
            pairs.append((share["ht"][row], state[0].float()))  # the translation hands it back K-first
    assert pairs or world == 1
    return pairs


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_match_the_unsplit_call_and_the_gold(ranks, case):
    layout, world, lengths, kind, _ = CASES[case]
    problem, do, dht = global_problem(kind, lengths, CASES[case][4])
    shares = ranks[:world]
    o, ht, grads = assembled(kind, problem, [share[case] for share in shares])
    o_unsplit, ht_unsplit, grads_unsplit = step(entry_point(kind, False), problem, do, dht)
    o_gold, ht_gold, grads_gold = gold_of(kind, problem, do, dht)
    start, end = intervals(layout, world, problem["v"].shape[1], 0)[0]
    first = shares[0][case]["tokens"][: SEGMENT_TOKENS.get(case, end - start)]
    assert torch.equal(o[:, first], o_unsplit[:, first])  # the first rank's first interval: computed as unsplit
    errors = {"o": rel_rms(o, o_gold), "ht": rel_rms(ht, ht_gold)}
    errors.update({GRADIENTS[name]: rel_rms(grads[name], grads_gold[name]) for name in grads_gold})
    line = f"[cp ranks] {case} vs gold: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
    print(line)
    assert errors.pop("o") <= GOLD_BOUND and errors.pop("ht") <= GOLD_BOUND, line
    # the gate gradients of these inputs (half the channels or heads at g = −12, where dg is tiny and dA_log, ddt_bias
    # sums that cancel) miss issue 10's targets unsplit too (GatedDeltaNet's dg, dA_log, ddt_bias 1-4e-2 on the
    # mirror): held to the targets or to 1.5 times the unsplit call's own error
    tolerances = SAFE_GATE_TOLERANCES if kind == "kda" else TARGETS
    for name, want in grads_gold.items():
        unsplit = 1.5 * rel_rms(grads_unsplit[name], want)
        assert errors[GRADIENTS[name]] <= max(tolerances[GRADIENTS[name]], unsplit), line
    assert rel_rms(o, o_unsplit) <= GOLD_BOUND and rel_rms(ht, ht_unsplit) <= GOLD_BOUND
    for name, grad in grads.items():
        assert grad.dtype == problem[name].dtype and grad.shape == problem[name].shape, name
        if name not in ("A_log", "dt_bias"):  # sums over every token that cancel: held to the gold above only
            assert rel_rms(grad, grads_unsplit[name]) <= max(UNSPLIT_BOUND, TARGETS[GRADIENTS[name]]), name
    for state, want in handed_on_states(kind, problem, layout, world, [share[case] for share in shares]):
        assert rel_rms(state, want) <= GOLD_BOUND


def test_a_chain_in_the_wrong_rank_order_fails_the_checks(ranks):
    """The control: the same call with the gathered pieces combined in reverse rank order is far from the gold."""
    layout, world, lengths, kind, state = CASES[CONTROL]
    problem, do, dht = global_problem(kind, lengths, state)
    o, _, grads = assembled(kind, problem, [share["control"] for share in ranks[:world]])
    o_gold, _, grads_gold = gold_of(kind, problem, do, dht)
    assert rel_rms(o, o_gold) > 10 * GOLD_BOUND and rel_rms(grads["q"], grads_gold["q"]) > 10 * TARGETS["dq"]


@pytest.mark.parametrize("field", ["layout", "pre_num_ranks", "post_num_ranks", "front_num_seqs", "cu_seqlens_cpu",
                                   "tokens"])
def test_malformed_contexts_are_refused_naming_the_field(ranks, field):
    for share in ranks:
        error = share["refusals"][field]
        assert error is not None and "cp_context" in error[1], (field, error)
        assert error[0] == "ValueError", error


@pytest.mark.parametrize("cp_context, words", [
    (object(), "cp_context must be a context-parallel context"),
    (distributed.CPContext(object(), torch.tensor([0, 16]), torch.tensor([0, 16])), "cp_context.group"),
    (distributed.CPContext(None, torch.tensor([0.0, 16.0]), torch.tensor([0, 16])), "cp_context.cu_seqlens"),
])
def test_cp_context_that_is_not_one_is_refused(cp_context, words):
    kda, _, _ = global_problem("kda", [16], False)
    gdn, _, _ = global_problem("gdn", [16], False)
    for translate, problem in ((translate_fla_call, kda), (translate_fla_gdn_call, gdn)):
        arguments = {name: x for name, x in problem.items() if name != "cu_seqlens"}
        with pytest.raises((TypeError, ValueError), match=words):
            translate(**arguments, cp_context=cp_context)


def test_a_context_without_a_group_is_a_plain_call_on_its_bounds():
    """As in FLA: no group, no exchange; the context's local bounds replace the call's."""
    problem, _, _ = global_problem("kda", [10, 22], False)
    bounds = problem.pop("cu_seqlens")
    call = translate_fla_call(**problem, cu_seqlens=torch.tensor([0, 32]),
                              cp_context=distributed.CPContext(None, bounds, bounds))
    assert call.options["cu_seqlens"] is bounds and "segments" not in call.options


@pytest.mark.parametrize("flags, words", [
    (dict(return_intermediate_states=True), "return_intermediate_states"),
    (dict(state_indices=torch.zeros(1, dtype=torch.int32)), "state pool"),
])
def test_cp_context_with_what_it_cannot_take_is_refused(flags, words):
    problem, _, _ = global_problem("kda", [16], False)
    context = distributed.CPContext(None, problem.pop("cu_seqlens"), torch.tensor([0, 16]))
    with pytest.raises(NotImplementedError, match=words):
        translate_fla_call(**problem, **flags, cp_context=context)


@pytest.mark.parametrize("layout, world, lengths, expected", [
    # contiguous: (local bounds, pre, post) per rank
    ("contiguous", 3, [20, 150, 22], [([0, 20, 64], 0, 2), ([0, 64], 1, 1), ([0, 42, 64], 2, 0)]),
    ("contiguous", 2, [96, 0, 96], [([0, 96], 0, 0), ([0, 96], 0, 0)]),  # bounds on the cut, an empty sequence
    # zigzag over 2 ranks: 4 intervals of 48; rank 0 holds 0 and 3, rank 1 holds 1 and 2
    ("zigzag", 2, [100, 92], [([0, 48, 96], (0, 1), (2, 0)), ([0, 48, 52, 96], (1, 2), (1, 1))]),
])
def test_build_cp_context_lays_the_tokens_out_as_fla(layout, world, lengths, expected):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for rank, (bounds, pre, post) in enumerate(expected):
        context = distributed.build_cp_context(cu_seqlens, None, layout, world_size=world, rank=rank)
        assert context.cu_seqlens.tolist() == bounds and context.cu_seqlens.dtype == torch.int32
        if layout == "contiguous":
            assert (context.pre_num_ranks, context.post_num_ranks) == (pre, post)
            assert (context.is_first_rank, context.is_last_rank) == (pre == 0, post == 0)
        else:
            assert (context.pre_num_ranks_by_part, context.post_num_ranks_by_part) == (pre, post)
            assert context.front_num_seqs == 1 and context.part_len == 48


def test_build_cp_context_refuses_a_total_that_does_not_split():
    with pytest.raises(ValueError, match="multiple"):
        distributed.build_cp_context(torch.tensor([0, 100]), None, world_size=3, rank=0)
    with pytest.raises(ValueError, match="layout"):
        distributed.build_cp_context(torch.tensor([0, 96]), None, "ring", world_size=3, rank=0)


def test_bench_cp_imports_and_parses_its_arguments():
    import bench_script

    bench = bench_script.load("bench_cp")
    args = bench.parse_args(["--tokens", "131072", "--gdn", "--no-fla", "--backward"])
    assert args.tokens == [131072] and args.gdn and not args.fla and args.backward
    defaults = bench.parse_args([])
    assert defaults.tokens == [131072, 262144, 524288, 1048576] and defaults.heads == 16
    assert bench.MULTICAST_OFF == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    for gdn, translate in ((False, translate_fla_call), (True, translate_fla_gdn_call)):  # its calls translate
        args = bench.parse_args(["--heads", "2"] + (["--gdn"] if gdn else []))
        share = bench.inputs(args, 64, 1, torch.device("cpu"))
        context = distributed.CPContext(None, torch.tensor([0, 64]), torch.tensor([0, 64]))
        assert translate(**share, cp_context=context).tensors[2].shape == (1, 64, 4 if gdn else 2, 128)


def test_a_long_share_is_also_cut_inside_the_rank():
    """On a GPU a rank's share with few (sequence, head) chains is cut into segments as one GPU cuts a sequence
    (``plan``'s heuristic); the stages see the segments, the caller its local sequences."""
    chain = context_parallel.RankChain(None, 2, 2, (context_parallel.ChainPart(1, 0, 0, 1, 0),), (0, 131072))
    split = chain.split(132, 16, None)
    assert split.length == 16384 and split.count == 8 and split.cu_seqlens().tolist()[:3] == [0, 16384, 32768]
    assert chain.split(132, 16, 4) is chain and chain.split(0, 16, None) is chain  # a fixed V-split; the CPU
    short = chain._replace(bounds=(0, 2048))
    assert short.split(132, 16, None) is short
    two = context_parallel.RankChain(None, 2, 2, (context_parallel.ChainPart(0, 0, 1, 0, 1),), (0, 40, 100), 32)
    assert two.cu_seqlens().tolist() == [0, 32, 40, 72, 100] and two.tile_bases().tolist() == [0, 2, 3, 5, 7]
    assert two.last(torch.arange(4.0)).tolist() == [1.0, 3.0] and two.first(torch.arange(4.0)).tolist() == [0.0, 2.0]
