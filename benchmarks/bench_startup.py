"""Time to the first result of a new process: cold (empty compile cache) against warm (the cache the
cold process left), for ``kda_forward`` and for ``warmup()`` of the common variants.

Each measurement is a fresh Python process, timed from its start (before ``import torch``) to the
synchronised first result; the compile cache lives in a temporary folder (``CUTE_KDA_CACHE_DIR``)
that the cold run starts empty. Rows:

- ``first call``: B1 T1024 H16 ``kda_forward`` with an fp32 initial and final state (K1 + K2), and
  the same with packed sequences (K1 varlen + the tile prefix + K2 varlen);
- ``warmup()``: the default ``warmup(state_modes=(None, torch.float32))`` (K1 and K2 for fixed and
  packed sequences, no state and fp32 state, every V-split).

    python benchmarks/bench_startup.py                # writes <date>-startup.md under $OUT or benchmarks/results/
    python benchmarks/bench_startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = textwrap.dedent("""
    import time
    start = time.perf_counter()
    import json, sys
    sys.path.insert(0, {root!r})
    import torch
    import cute_kda
    from cute_kda.ops import prepare, recurrence
    imported = time.perf_counter() - start
    case = {case!r}
    device = torch.device("cuda")
    if case == "warmup":
        count = cute_kda.warmup(state_modes=(None, torch.float32))
    else:
        gen = torch.Generator(device=device).manual_seed(0)
        lengths = [1024] if case == "fixed" else [300, 700, 24]
        tokens, heads = sum(lengths), 16
        x = lambda *s: torch.randn(*s, generator=gen, device=device).to(torch.bfloat16)
        q, k, v, g = (x(1, tokens, heads, 128) for _ in range(4))
        cu = None if case == "fixed" else torch.tensor([0, 300, 1000, 1024], device=device)
        h0 = torch.zeros(len(lengths), heads, 128, 128, device=device)
        o, s = cute_kda.kda_forward(q, k, v, g, x(1, tokens, heads), A_log=torch.zeros(heads, device=device),
                                    dt_bias=torch.zeros(heads, 128, device=device), cu_seqlens=cu,
                                    initial_state=h0, output_final_state=True)
        count = 1
    torch.cuda.synchronize()
    caches = (prepare._PREPARE, prepare._TILE_PREFIX, recurrence._CACHE)
    stats = {{key: sum(c.stats[key] for c in caches) for key in ("compiled", "loaded")}}
    print(json.dumps({{"total": time.perf_counter() - start, "import": imported, "count": count, **stats}}))
""")

CASES = {"fixed": "first call, B1 T1024 H16, fp32 state", "varlen": "first call, 3 packed sequences, H16, fp32 state",
         "warmup": "warmup(state_modes=(None, fp32))"}


def run(case: str, cache_dir: str) -> dict:
    env = {**os.environ, "CUTE_KDA_CACHE_DIR": cache_dir}
    env.pop("CUTE_KDA_DISK_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), case=case)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from cute_kda._bench import environment, markdown_table, publish

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="warm runs per case (the cold run is one)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--out", help="markdown file (default: $OUT or benchmarks/results/<date>-startup.md)")
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="cute_kda_startup_") as cache_dir:
            cold = run(case, cache_dir)
            warm = [run(case, cache_dir) for _ in range(args.repeats)]
        best = min(warm, key=lambda r: r["total"])
        rows.append([CASES[case], f"{cold['total']:.2f}", f"{best['total']:.2f}", f"{cold['import']:.2f}",
                     f"{cold['total'] / best['total']:.1f}×", f"{cold['compiled']} / {cold['loaded']}",
                     f"{best['compiled']} / {best['loaded']}"])
        print(rows[-1], flush=True)
    import cute_kda  # noqa: F401  (for the environment line)

    table = markdown_table(["case", "cold process (s)", "warm process (s)", "import (s)", "cold / warm",
                            "cold: compiled / loaded", "warm: compiled / loaded"], rows)
    text = (f"# Time to the first result of a new process, cold vs warm compile cache\n\n"
            f"{environment('cutlass', 'tvm_ffi', labels={'cutlass': 'cutlass-dsl'})}\n\n"
            f"Command: `python3 benchmarks/bench_startup.py --repeats {args.repeats}`. Each cell is one fresh "
            f"process, timed from its start to the synchronised first result (warm: the best of "
            f"{args.repeats}); the cache folder starts empty for the cold run.\n\n{table}\n")
    out = args.out or os.path.join(os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"),
                                   f"{datetime.date.today()}-startup.md")
    publish(text, out)


if __name__ == "__main__":
    main()
