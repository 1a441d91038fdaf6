#!/usr/bin/env python
"""A/B in one engine: the target layers' attention through the tree dispatch
(TreeCPUAttentionImpl.forward) or straight to vLLM's forward
(serve_tree_rows(False)), alternating runs; prints the median target
forward of each. Behind the README's "0.2-0.45 ms of a 31 ms forward".

    .venv/bin/python scripts/ab_attention_dispatch.py            # chain-3, batch 1
    .venv/bin/python scripts/ab_attention_dispatch.py chain-2 --batch 4
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
    from vllm import LLM, SamplingParams

    from bench_baseline import _scheduler, pin_shape, speculative_config
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", default="chain-3", help="a chain or plain shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args()
    target = build(assets.DEEP_TARGET, extra_layers=60)
    prompts = assets.heldout_prompts()
    llm = LLM(model=str(target), speculative_config=speculative_config("eagle2-eagle3", "8x4x2g"),
              dtype="float32", enforce_eager=True, max_model_len=1024, seed=0, max_num_seqs=64)
    runner = pin_shape(llm, args.shape, "shape")
    impls, runner._target_attn_impls = runner._target_attn_impls, []  # this script switches them
    times, inner = [], runner._model_forward

    def timed(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        times.append(time.perf_counter() - t)
        return out
    runner._model_forward = timed
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    _scheduler(llm).max_num_active_reqs = args.batch
    res = {"dispatch": [], "vllm": []}
    for r in range(args.runs):
        mode = "dispatch" if r % 2 == 0 else "vllm"
        for impl in impls:
            impl.serve_tree_rows(mode == "dispatch")
        times.clear()
        llm.generate(prompts[:4 * args.batch],
                     SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                     use_tqdm=False)
        res[mode].append(1e3 * statistics.median(times))
        print(f"{mode}: {len(times)} forwards, median {res[mode][-1]:.2f} ms", flush=True)
    print({k: [round(x, 2) for x in v] for k, v in res.items()})


if __name__ == "__main__":
    main()
