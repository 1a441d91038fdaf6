#!/usr/bin/env python
"""Is a slower target forward the engine's or the moment's? An in-step replay.

For each SHAPE (vanilla, or eagle2 8x4x2 goodput pinned to plain; a fresh
in-process engine each, one after another), runs 64 greedy requests of 100
tokens at batch 64 on the deep target and, on engine steps 20-79, runs the
step's ``_model_forward`` a second time at once with the same inputs (it
rewrites the same KV values). Prints the mean real and replayed forward:
if they agree in every engine, a difference between engines is in the
engines' level at that moment, not in what runs around the forward.

    .venv/bin/python scripts/replay_forward.py vanilla plain vanilla plain
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    from vllm import SamplingParams

    from bench_baseline import _runner, _scheduler
    from bench_paired import ADAPTIVE, FORCED, start_engine
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="+", choices=["vanilla", "plain"])
    args = ap.parse_args()
    target = build(assets.DEEP_TARGET, extra_layers=60)
    prompts = assets.heldout_prompts()
    for shape in args.shapes:
        llm, _ = start_engine(target, "vanilla", None) if shape == "vanilla" \
            else start_engine(target, FORCED, "plain")
        runner = _runner(llm)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        forward = runner._model_forward
        step, real, replay = [0], [], []

        def timed(*a, **k):
            step[0] += 1
            t0 = time.perf_counter()
            out = forward(*a, **k)
            t1 = time.perf_counter()
            if 20 <= step[0] < 80:
                forward(*a, **k)
                real.append(t1 - t0)
                replay.append(time.perf_counter() - t1)
            return out

        runner._model_forward = timed
        _scheduler(llm).max_num_active_reqs = 64
        llm.generate([prompts[i % len(prompts)] for i in range(64)],
                     SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                     use_tqdm=False)
        print(f"== {shape}: real {1e3 * sum(real) / len(real):.2f} ms, "
              f"replay {1e3 * sum(replay) / len(replay):.2f} ms ({len(real)} steps)", flush=True)
        del llm, runner, forward
        gc.collect()


if __name__ == "__main__":
    main()
