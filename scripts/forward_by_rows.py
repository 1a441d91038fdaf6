#!/usr/bin/env python
"""The target forward's seconds at each query-row count (is it a line?).

Starts one eagle2 8x4x2 goodput engine on the deep target (EAGLE-3 head),
then, ROUNDS times, for each row count: one warm ``_dummy_run`` (attention
included, as the start-up probe's) and five timed ones; prints
``rows:least/median`` in ms per round, after the forward model at those
rows as the start-up probe left it (and its shape factors). The goodput runner's start-up probe
(``probe_verify_cost``) uses the least of 5 sweeps at 1..16 rows as the
forward model's small-row shape (``DriftingCost.set_profile``).

    .venv/bin/python scripts/forward_by_rows.py
    .venv/bin/python scripts/forward_by_rows.py --rows 1 2 3 4 5 6 7 8 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    from bench_baseline import _runner
    from bench_paired import ADAPTIVE, start_engine
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+",
                    default=list(range(1, 13)) + [16, 24, 32])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if min(args.rows) < 1:
        raise SystemExit("--rows: row counts must be >= 1")
    llm, _ = start_engine(build(assets.DEEP_TARGET, extra_layers=60), *ADAPTIVE)
    runner = _runner(llm)
    cost = runner.tree_planner.forward_cost  # as the start-up probe left it
    print("model", " ".join(f"{n}:{1e3 * cost(n):.1f}" for n in args.rows),
          f"(line {1e3 * cost.a:.1f} ms + {1e3 * cost.b:.3f} ms a row, speed {cost.speed:.3f})")
    print("probe shape", " ".join(f"{n}:{f:.3f}" for n, f in cost.profile().items()), flush=True)
    for r in range(args.rounds):
        cells = []
        for n in args.rows:
            runner._dummy_run(n, force_attention=True)  # warm
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                runner._dummy_run(n, force_attention=True)
                ts.append(time.perf_counter() - t)
            cells.append(f"{n}:{1e3 * min(ts):.1f}/{1e3 * statistics.median(ts):.1f}")
        print(f"round {r}", " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
