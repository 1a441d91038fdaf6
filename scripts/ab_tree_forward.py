#!/usr/bin/env python
"""What does tree attention cost in a verify forward? An in-step A/B.

An eagle2 engine pinned to SHAPE (default ``tree``) runs greedy requests at
``--batch`` on the deep target. On each engine step with tree rows, the
step's ``_model_forward`` also runs once more with every target layer's
attention straight through vLLM's kernel (``serve_tree_rows(False)``: the
same query rows and metadata, attended causally by index, so its output is
wrong and discarded). Odd steps run vLLM's replay before the real forward,
even steps after it, followed then by a tree replay that rewrites the tree
slots' KV as the real forward wrote it; so the text and the KV stay exact.
Prints the median real (tree) forward and vLLM's replay: their difference
is what the tree attention (the fused op, its Python dispatch) costs over
vLLM's attention for the same rows, at the same moment.

    .venv/bin/python scripts/ab_tree_forward.py                 # tree, batch 1
    .venv/bin/python scripts/ab_tree_forward.py --batch 4 --requests 16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    from vllm import SamplingParams

    from bench_baseline import _runner, _scheduler
    from bench_paired import FORCED, start_engine
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", default="tree", help="an arm of the shape bandit")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="write the per-step times as JSON")
    args = ap.parse_args()
    target = build(assets.DEEP_TARGET, extra_layers=60)
    prompts = assets.heldout_prompts()
    llm, _ = start_engine(target, FORCED, args.shape)
    runner = _runner(llm)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    forward = runner._model_forward  # the runner's: times the step for the planner
    owner = next(c for c in type(runner).__mro__ if "_model_forward" in c.__dict__
                 and c.__module__.startswith("vllm_eagle_tree"))
    raw = super(owner, runner)._model_forward  # vLLM's: the replays, untimed
    real, vllm, rows, step = [], [], [], [0]

    def serve(on: bool):
        for impl in runner._target_attn_impls:
            impl.serve_tree_rows(on)

    def timed_vllm(*a, **k):
        serve(False)
        try:
            t = time.perf_counter()
            raw(*a, **k)
            vllm.append(time.perf_counter() - t)
        finally:
            serve(True)

    def ab(*a, **k):
        if not runner._tree_rows_on:
            return forward(*a, **k)
        step[0] += 1
        first = step[0] % 2 == 1
        if first:
            timed_vllm(*a, **k)
        t = time.perf_counter()
        out = forward(*a, **k)
        real.append(time.perf_counter() - t)
        if not first:
            timed_vllm(*a, **k)
            raw(*a, **k)  # the tree slots' KV as the real forward wrote it
        ts = runner._tree_step
        rows.append(sum(len(ts.trees[b][0]) for b in ts.masked))
        return out

    runner._model_forward = ab
    _scheduler(llm).max_num_active_reqs = args.batch
    llm.generate([prompts[i % len(prompts)] for i in range(args.requests)],
                 SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                 use_tqdm=False)
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    diffs = [1e3 * (a - b) for a, b in zip(real, vllm)]
    res = {"shape": args.shape, "batch": args.batch, "steps": len(real),
           "tree_nodes_mean": sum(rows) / max(1, len(rows)),
           "real_tree_ms": med(real), "vllm_replay_ms": med(vllm),
           "median_diff_ms": statistics.median(diffs) if diffs else None}
    print(json.dumps(res, indent=1), flush=True)
    if args.out:
        res.update(real=real, vllm=vllm, rows=rows)
        args.out.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
