#!/usr/bin/env python
"""What goodput's timing broadcast costs under tensor parallelism.

With ``"goodput": true`` and TP > 1 every rank learns rank 0's step timings
(``TreeRunnerMixin._shared``: one broadcast of three floats over the TP
group's CPU group at the start of each engine step). This runs eagle2
goodput at TP=2 on vLLM's ``mp`` executor (two CPU workers, one core each)
over the bundled pair, times every ``_shared`` call in both workers, and
prints the calls, their median and 90th percentile and their total against
the run's wall time. The time includes each rank's wait for the other (the
ranks' skew, which their next collective would absorb anyway).

    .venv/bin/python scripts/tp_shared_cost.py --prompts 32 --max-tokens 48
"""
from __future__ import annotations

import argparse
import json
import os
import time

# before vLLM is imported: workers in their own processes, one core each;
# collective_rpc with a callable needs insecure serialization
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def wrap(worker):
    """In each worker: time every ``_shared`` call of its runner."""
    runner = worker.model_runner
    shared = runner._shared
    runner.shared_seconds = []

    def timed(values):
        t = time.perf_counter()
        try:
            return shared(values)
        finally:
            runner.shared_seconds.append(time.perf_counter() - t)

    runner._shared = timed
    return True


def read(worker):
    xs = sorted(worker.model_runner.shared_seconds)
    if not xs:
        return {"calls": 0}
    return {"calls": len(xs), "median_ms": 1e3 * xs[len(xs) // 2],
            "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))], "total_s": sum(xs)}


def main():
    from vllm import LLM, SamplingParams

    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 8,
            "max_depth": 4, "top_k": 2, "adaptive": True, "goodput": True}
    llm = LLM(model=str(assets.TARGET), dtype="float32", enforce_eager=True, max_model_len=512,
              tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config=spec, seed=0)
    llm.collective_rpc(wrap)
    prompts = assets.heldout_prompts(args.prompts)
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                         ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    ranks = llm.collective_rpc(read)
    print(json.dumps({"wall_s": wall, "ranks": ranks}))
    for rank, r in enumerate(ranks):
        if r["calls"]:
            print(f"rank {rank}: {r['calls']} broadcasts, median {r['median_ms']:.2f} ms, "
                  f"p90 {r['p90_ms']:.2f} ms, total {1e3 * r['total_s']:.0f} ms "
                  f"of a {wall:.2f} s run")


if __name__ == "__main__":
    main()
