"""Context parallelism across GPUs (FLA's ``cp_context``) on the kernels: 2 processes (4 where the host has 4 GPUs),
one GPU each, NCCL, NVLink multicast off (``cute_kda.distributed.MULTICAST_OFF``), training steps through
``cute_kda.chunk_kda`` / ``cute_kda.chunk_gated_delta_rule`` on each rank's share, against the single-GPU call of the
whole problem: the first rank's first tokens (its first interval, or its first segment where the heuristic also cuts
the rank's share) bit-identical, the rest within rounding (the output, each sequence's
final state, every gradient). The CPU tier's ``tests/test_cp_ranks.py`` holds the same chain to the fp64 gold.
"""

from __future__ import annotations

import pytest
import torch

from cute_kda.context_parallel import MIN_SEGMENT_TILES
from cute_kda.numerics import CHUNK
from cute_kda.reference import rel_rms

from test_cp_ranks import GRADIENTS, assembled, entry_point, global_problem, intervals, run_ranks, step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs or more")]

OUTPUT_BOUND = 5e-3  # o and the final states against the single-GPU call
GRADIENT_BOUNDS = {"dg": 2e-2, "dbeta": 2e-2, "dA_log": 3e-2, "ddt_bias": 3e-2}  # others 1e-2; sums cancel in these

CASES = {  # layout, ranks, global sequence lengths, "kda" | "gdn", initial state
    "kda_2_ranks_T4096_state": ("contiguous", 2, [4096], "kda", True),
    "gdn_2_ranks_varlen_state": ("contiguous", 2, [1000, 2000, 1096], "gdn", True),
    "kda_zigzag_2_ranks_varlen": ("zigzag", 2, [3000, 1096], "kda", False),
    "gdn_4_ranks_passing_through": ("contiguous", 4, [300, 3500, 296], "gdn", False),
    # 32768 tokens a rank: the heuristic also cuts each rank's sequence into segments (RankChain.split)
    "kda_2_ranks_T65536_segments_inside_state": ("contiguous", 2, [65536], "kda", True),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    world = 4 if torch.cuda.device_count() >= 4 else 2
    cases = {name: case for name, case in CASES.items() if case[1] <= world}
    return run_ranks(world, cases, tmp_path_factory.mktemp("cp_gpu"), gpu=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_match_the_single_gpu_call(ranks, case):
    layout, world, lengths, kind, state = CASES[case]
    if len(ranks) < world:
        pytest.skip(f"needs {world} GPUs")
    problem, do, dht = global_problem(kind, lengths, state)
    shares = [share[case] for share in ranks[:world]]
    o, ht, grads = assembled(kind, problem, shares)
    device = torch.device("cuda", 0)
    whole = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in problem.items()}
    o_one, ht_one, grads_one = step(entry_point(kind, True), whole, do.to(device), dht.to(device))
    start, end = intervals(layout, world, problem["v"].shape[1], 0)[0]
    end = min(end, start + MIN_SEGMENT_TILES * CHUNK)  # within a first segment, where a rank cuts its share
    assert torch.equal(o[:, start:end], o_one[:, start:end])  # rank 0's first tokens: computed as on one GPU
    errors = {"o": rel_rms(o, o_one), "ht": rel_rms(ht, ht_one)}
    errors.update({GRADIENTS[name]: rel_rms(grad, grads_one[name]) for name, grad in grads.items()})
    line = f"[cp ranks gpu] {case} vs one GPU: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
    print(line)
    assert errors.pop("o") <= OUTPUT_BOUND and errors.pop("ht") <= OUTPUT_BOUND, line
    assert all(e <= GRADIENT_BOUNDS.get(n, 1e-2) for n, e in errors.items()), line
