#!/usr/bin/env python
"""One eagle2 adaptive engine with the shape bandit forced to one shape, to
compare shapes with vanilla and vLLM's chain outside the bandit's choices.

    .venv/bin/python scripts/bench_shapes.py --shape plain --batch 64 --requests 128
    .venv/bin/python scripts/bench_shapes.py --shape chain-3 --batch 1 --requests 8
    .venv/bin/python scripts/bench_shapes.py --shape vanilla --batch 64 --requests 128
    .venv/bin/python scripts/bench_shapes.py --shape vllm-chain-2 --batch 64 --requests 128
    .venv/bin/python scripts/bench_shapes.py --shape chain-1 --batch 16 --requests 32 --step-log /tmp/s.json

Deep target, EAGLE-3 head, greedy, 64 tokens per request, continuous
batching at concurrency --batch (as scripts/bench_baseline.py). ``--shape
free`` leaves the bandit alone. Prints tokens/s and, for eagle2, the
bandit's measured rates per bucket and shape (a forced shape is still
measured, so its measured rate can be held against the real one).
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
    from vllm import LLM, SamplingParams

    from bench_baseline import _runner, _scheduler, pin_shape, speculative_config
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True,
                    help="plain, chain-K, tree, free (eagle2 8x4x2 adaptive), vanilla, vllm-chain-K")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--step-log", metavar="JSON",
                    help="eagle2 shapes: write every engine step (requests, query rows, prefill "
                         "rows, seconds, emitted tokens) and print where the time went")
    args = ap.parse_args()

    if args.shape == "vanilla":
        spec = None
    elif args.shape.startswith("vllm-chain-"):
        spec = speculative_config("eagle3", int(args.shape.rsplit("-", 1)[1]))
    else:
        spec = speculative_config("eagle2-eagle3", "8x4x2g")
    target = build(assets.DEEP_TARGET, extra_layers=60)
    prompts = assets.heldout_prompts()
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", enforce_eager=True,
              max_model_len=1024, disable_log_stats=False, seed=0, max_num_seqs=64)
    bandit = runner = None
    if spec is not None and spec["method"] == "eagle2":
        runner = _runner(llm)
        bandit = runner.tree_bandit
        if args.shape != "free":
            pin_shape(llm, args.shape, "--shape", others=("vanilla", "vllm-chain-K", "free"))
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    steps = []
    if args.step_log and runner is not None:
        steps = log_steps(runner)
    _scheduler(llm).max_num_active_reqs = args.batch
    t = time.perf_counter()
    outs = llm.generate([prompts[i % len(prompts)] for i in range(args.requests)], params,
                        use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.shape} batch {args.batch}, {args.requests} requests: {n / dt:.1f} tok/s")
    if bandit is not None:
        print("bandit tokens/s:", json.dumps(bandit.summary()))
        print("bandit windows:", json.dumps(bandit.window_counts()))
        cost = bandit.verify_cost
        print(f"bandit forward model: {1e3 * cost.a:.1f} ms + {1e3 * cost.b:.3f} ms per row "
              f"(speed {getattr(cost, 'speed', 1.0):.3f})")
        print("bandit model:", json.dumps(bandit.model_summary()))
        st = runner.tree_stats
        print(f"drafted steps {st['steps']}, accepted per depth {st['accepted_per_depth']}, "
              f"drafted per depth {st['drafted_per_depth']}")
    if steps:
        Path(args.step_log).write_text(json.dumps(steps) + "\n")
        full = [x for x in steps if x["requests"] >= 0.8 * args.batch]
        parts = {"full batch, no prefill rows": [x for x in full if x["prefill_rows"] == 0],
                 "full batch, prefill rows": [x for x in full if x["prefill_rows"] > 0],
                 "below 80% of the batch": [x for x in steps if x["requests"] < 0.8 * args.batch]}
        for name, xs in parts.items():
            sec = sum(x["seconds"] for x in xs)
            tok = sum(x["emitted"] for x in xs)
            print(f"{name:28s}: {len(xs):4d} steps, {sec:6.2f} s, {tok:5d} tokens"
                  + (f", {tok / sec:6.1f} tok/s" if sec > 0 else ""))


def log_steps(runner) -> list[dict]:
    """Times every engine step of ``runner`` (from one ``_prepare_inputs`` to
    the next), on the instance only: a benchmark hook, like the tests' hooks."""
    steps: list[dict] = []
    cur: dict = {}
    prepare = runner._prepare_inputs

    def timed(scheduler_output, num_scheduled_tokens):
        now = time.perf_counter()
        if cur:
            forward = runner._step_forward  # the target forward's seconds, None: not timed
            steps.append(dict(cur, seconds=now - cur.pop("t0"), emitted=runner._step_emitted,
                              forward=forward, model=runner.tree_bandit.verify_cost(cur["rows"])))
        out = prepare(scheduler_output, num_scheduled_tokens)
        cur.clear()  # the runner has just counted this step's prefill rows for its bandit
        cur.update(t0=now, requests=len(scheduler_output.num_scheduled_tokens),
                   rows=scheduler_output.total_num_scheduled_tokens,
                   prefill_rows=runner._step_prefill_rows, arm=runner._draft_arm)
        return out

    runner._prepare_inputs = timed
    return steps


if __name__ == "__main__":
    main()
