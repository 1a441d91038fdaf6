#!/usr/bin/env python
"""Trace the shape bandit's picks in a free eagle2 adaptive engine.

Deep target, EAGLE-3 head, greedy, as ``scripts/bench_paired.py`` runs a
cell: a warm pass of BATCH requests (32 tokens), then REQUESTS requests of
64 tokens at concurrency BATCH. Every time the bandit picks a shape it
prints one ``PICK`` line: the bucket (log2 of the batch size), the shape
picked, the model's predicted tokens/s of plain, chain-1 and chain-2, the
forward model's speed factor, its line (ms + ms per row), and the bucket's
measured parts (ms outside the forward per shape family; drafting per
chain length). At the end: tokens/s, windows per bucket and shape, and the
model summary.

    .venv/bin/python scripts/trace_bandit.py --batch 16 --requests 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def main():
    from bench_baseline import _runner, _scheduler, request_params
    from bench_paired import adaptive_engine

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    args = ap.parse_args()

    llm, prompts = adaptive_engine()
    bandit = _runner(llm).tree_bandit
    cost = bandit.verify_cost
    pick = bandit._pick

    def traced(b):  # an instance attribute: this engine only
        arm = pick(b)
        rates = {a: bandit.rate(b, a) for a in ("plain", "chain-1", "chain-2")}
        print("PICK", b, arm, {a: round(r, 1) if r else None for a, r in rates.items()},
              f"speed {cost.speed:.3f}", f"line {1e3 * cost.line.a:.2f} ms + "
              f"{1e3 * cost.line.b:.3f} ms/row",
              {k: round(1e3 * v, 2) for k, v in bandit._other.get(b, {}).items()},
              {k: round(1e3 * bandit.draft_seconds(b, k), 2) for k in bandit._draft.get(b, ())},
              flush=True)
        return arm

    bandit._pick = traced
    _scheduler(llm).max_num_active_reqs = args.batch
    print(f"PROBE line {1e3 * cost.line.a:.2f} ms + {1e3 * cost.line.b:.3f} ms/row")
    llm.generate([prompts[-1 - i % len(prompts)] for i in range(args.batch)],
                 request_params(args.batch, 32), use_tqdm=False)
    print("WARM DONE")
    t = time.perf_counter()
    outs = llm.generate([prompts[i % len(prompts)] for i in range(args.requests)],
                        request_params(args.requests, 64), use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"RESULT {n / dt:.1f} tok/s, windows {json.dumps(bandit.window_counts())}")
    print("MODEL", json.dumps(bandit.model_summary()))


if __name__ == "__main__":
    main()
