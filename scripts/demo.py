#!/usr/bin/env python
"""The main job: vLLM with speculative decoding on the bundled model pair.

Generates greedy completions of held-out Python prompts with `LLM(...)` and
prints generated tokens/s and tau (mean tokens emitted per target forward:
accepted draft tokens + 1). Run it through `bash scripts/demo.sh`, which
sets up `.venv` first.

    python scripts/demo.py                      # eagle2 tree over the EAGLE-1 head
    python scripts/demo.py --head eagle3 --num-nodes 32 --max-depth 5 --top-k 8
    python scripts/demo.py --method eagle --k 3 # vLLM's own EAGLE chain, K=3
    python scripts/demo.py --method none        # no speculation
"""
import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_runtime  # noqa: E402  (scripts/cpu_runtime.py, beside this script)


def main():
    cpu_runtime.preload()  # vLLM's CPU guide: TCMalloc and Intel OpenMP (cpu_runtime.py)
    from vllm_eagle_tree import assets
    from vllm_eagle_tree.metrics import spec_counters

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle2", choices=["none", "eagle", "eagle3", "eagle2"],
                    help="eagle2: this plugin's tree; eagle/eagle3: vLLM's chain; none")
    ap.add_argument("--head", default="eagle", choices=["eagle", "eagle3"],
                    help="draft head for eagle2 (EAGLE-1 or EAGLE-3 format)")
    ap.add_argument("--k", type=int, default=3, help="chain length (eagle/eagle3)")
    ap.add_argument("--num-nodes", type=int, default=60, help="eagle2: drafted nodes per tree")
    ap.add_argument("--max-depth", type=int, default=6, help="eagle2: deepest node")
    ap.add_argument("--top-k", type=int, default=10, help="eagle2: children per node")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--target", default=str(assets.TARGET))
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    spec = None
    if args.method == "eagle2":
        spec = {"method": "eagle2", "model": str(assets.HEADS[args.head]),
                "num_nodes": args.num_nodes, "max_depth": args.max_depth, "top_k": args.top_k}
    elif args.method != "none":
        spec = {"method": args.method, "model": str(assets.HEADS[args.method]),
                "num_speculative_tokens": args.k}
    llm = LLM(model=args.target, speculative_config=spec, dtype="float32", enforce_eager=True,
              max_model_len=1024, disable_log_stats=False, seed=0)
    prompts = assets.heldout_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    before = spec_counters(llm)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    c = spec_counters(llm) - before
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    print("\n--- sample ---")
    print(prompts[0] + outs[0].outputs[0].text)
    print("--- result ---")
    what = (f"tree N={args.num_nodes} depth={args.max_depth} top_k={args.top_k} head={args.head}"
            if args.method == "eagle2" else f"k={args.k if spec else 0}")
    print(f"method={args.method} {what} prompts={len(prompts)} "
          f"generated={n_tok} tokens in {dt:.2f}s: {n_tok / dt:.1f} tokens/s")
    if spec:
        print(f"mean accepted tokens per step (tau, incl. bonus) = {c.tau:.3f}; "
              f"draft acceptance rate = {c.acceptance_rate:.3f} over {c.drafts} steps; "
              f"mean drafted nodes per step = {c.draft_tokens / max(c.drafts, 1):.1f}")
    rt = cpu_runtime.describe()
    print(f"runtime: malloc={rt['malloc']} openmp={rt['openmp']} (vLLM's CPU guide: tcmalloc, intel; "
          "scripts/cpu_runtime.py)")


if __name__ == "__main__":
    main()
