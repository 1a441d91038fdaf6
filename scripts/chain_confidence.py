#!/usr/bin/env python
"""Would chains that stop early where the head is unsure beat a fixed K?

Runs the eagle2 adaptive engine (deep target, EAGLE-3 head, greedy, 64
tokens a request, concurrency BATCH) with the shape bandit cycling through
chain-1 .. chain-MAX (so that its cost model measures every length) and
records, for every verified chain of MAX tokens, the head's path values
(log of the product of its top-1 probabilities down to each depth) and how
many of its tokens the target accepted. Then prints:

* acceptance by depth and path-probability bin (how well the head's
  confidence predicts acceptance), and
* tokens/s of each fixed K and of "stop at the first depth whose path
  probability is under THRESHOLD", simulated on those chains: greedy
  verification of a chain cut at k accepts min(accepted, k) (its first k
  tokens are the same), and a step of chain-k costs what the bandit's
  cost model (fitted live in this run) predicts for it.

    .venv/bin/python scripts/chain_confidence.py --batch 1 --requests 24

Writes the figures as JSON (``--out``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

BINS = 5  # path-probability bins of width 1 / BINS
THRESHOLDS = (0.02, 0.05, 0.1, 0.2, 0.3)


def main():
    from bench_baseline import _runner, _scheduler, request_params
    from bench_paired import adaptive_engine

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "results" / "chain_confidence.json"))
    args = ap.parse_args()

    llm, prompts = adaptive_engine()
    runner = _runner(llm)
    bandit = runner.tree_bandit
    top = len(bandit.reached)  # max_depth
    cycle = itertools.cycle([f"chain-{k}" for k in range(1, top + 1)])
    bandit._pick = lambda b: next(cycle)
    chains: list[tuple[list[float], int]] = []  # (path values, accepted) of chains of `top`
    sample = runner._sample

    def recording(*a, **k):  # an instance attribute: this engine only
        out = sample(*a, **k)
        step = runner._tree_step
        for j, i in enumerate(step.batch_index):
            if len(step.values[j]) == top + 1 and not math.isnan(step.values[j][-1]):
                chains.append((step.values[j], len(step.accepted[i][0])))
        return out

    runner._sample = recording
    _scheduler(llm).max_num_active_reqs = args.batch
    llm.generate([prompts[i % len(prompts)] for i in range(args.requests)],
                 request_params(args.requests, 64), use_tqdm=False)

    b = bandit.bucket(args.batch)
    step_s = {k: bandit.model_seconds(b, f"chain-{k}") / args.batch for k in range(1, top + 1)}
    by_depth = []
    for d in range(1, top + 1):
        bins = [[0, 0] for _ in range(BINS)]  # chains that reached depth d, and accepted it
        for values, acc in chains:
            if acc >= d - 1:
                row = bins[min(int(math.exp(values[d]) * BINS), BINS - 1)]
                row[0] += 1
                row[1] += acc >= d
        by_depth.append([{"p": f"{i / BINS:.1f}-{(i + 1) / BINS:.1f}", "chains": n,
                          "accepted": round(a / n, 3) if n else None}
                         for i, (n, a) in enumerate(bins)])

    def rate(cut) -> tuple[float, float]:  # tokens per step, tokens/s
        ks = [cut(values) for values, _ in chains]
        tokens = sum(1 + min(acc, k) for (_, acc), k in zip(chains, ks))
        return tokens / len(chains), tokens / sum(step_s[k] for k in ks)

    def stop_under(th):
        def cut(values):
            k = 1
            while k < top and math.exp(values[k + 1]) >= th:
                k += 1
            return k
        return cut

    policies = {f"fixed K={k}": (lambda v, k=k: k) for k in range(1, top + 1)}
    policies.update({f"stop under p={th}": stop_under(th) for th in THRESHOLDS})
    rates = {name: rate(cut) for name, cut in policies.items()}
    print(f"{len(chains)} chains of {top} at batch {args.batch}; model step ms per request:",
          {k: round(1e3 * s, 2) for k, s in step_s.items()})
    for d, row in enumerate(by_depth, 1):
        print(f"depth {d}: " + "  ".join(f"p {c['p']}: {c['chains']} chains, accepted "
                                         f"{c['accepted']}" for c in row if c["chains"]))
    for name, (tps, r) in rates.items():
        print(f"{name:22s} {tps:.3f} tokens a step  {r:.2f} tok/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "batch": args.batch, "requests": args.requests, "chains": len(chains),
        "step_ms_per_request": {k: 1e3 * s for k, s in step_s.items()},
        "acceptance_by_depth_and_path_probability": by_depth,
        "policies": {n: {"tokens_per_step": t, "tokens_per_s": r} for n, (t, r) in rates.items()},
    }, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
