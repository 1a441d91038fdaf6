#!/usr/bin/env python
"""tau (tokens per target forward) of EAGLE-2 trees versus vLLM's EAGLE chain.

Runs the engine-free reference generator (vllm_eagle_tree.reference), greedy,
EOS ignored, on the held-out prompts with one head:

  chain  K = 1..--chain-max              (top_k=1, max_depth=K, num_nodes=K)
  tree   N x depth x top-k x adaptation  (TreeConfig(top_k, max_depth=depth,
                                          num_nodes=N); N excludes the root)

tau = (accepted drafted tokens + bonus tokens) / verify steps, per request
(1 + accepted / steps); the prefill's first token is not counted. Also
reported: drafted nodes per step, tau per drafted node, acceptance rate
(accepted / drafted). Greedy output is the target's own, whatever the
config, so every config decodes the same text: tau measures the draft only.

"adaptive on" = depth_threshold / width_mass / min_path_prob below
(defaults 0.05 / 0.95 / 0.01: stop deepening a request once its best
frontier path has < 5% draft probability, keep a node's smallest set of
children with 95% of its draft mass, drop nodes whose path probability is
< 1%). batch_num_nodes stays off: tau is a per-request quantity here.

The target prefill (and the draft's pass over the prompt) is shared by every
config. Examples:

    .venv/bin/python scripts/bench_tau.py                 # eagle1, full grid
    .venv/bin/python scripts/bench_tau.py --head eagle3
    .venv/bin/python scripts/bench_tau.py --quick         # ~1/10 of the work

Writes results/bench_tau[_eagle3].json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
from vllm_eagle_tree import assets  # noqa: E402
from vllm_eagle_tree.core import TreeConfig  # noqa: E402
from vllm_eagle_tree.reference import (ReferenceGenerator, SamplingParams, chain_config,  # noqa: E402
                                       load_pair)

REF_TREE = dict(N=60, depth=6, top_k=10)  # the EAGLE-2 default the goal compares


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", choices=["eagle1", "eagle3"], default="eagle1")
    ap.add_argument("--pair", help="folder with target/, eagle1-head/, eagle3-head/ (default: assets/)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32, help="requests per batch")
    ap.add_argument("--chain-max", type=int, default=8)
    ap.add_argument("--nodes", type=ints, default=[8, 16, 32, 60])
    ap.add_argument("--depths", type=ints, default=[4, 6, 8])
    ap.add_argument("--topks", type=ints, default=[4, 8, 10])
    ap.add_argument("--adaptive", default="off,on", help="off, on or off,on")
    ap.add_argument("--depth-threshold", type=float, default=0.05)
    ap.add_argument("--width-mass", type=float, default=0.95)
    ap.add_argument("--min-path-prob", type=float, default=0.01)
    ap.add_argument("--quick", action="store_true",
                    help="16 prompts x 48 tokens; trees N in {16, 60}, depth 6, top-k {4, 10}")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="JSON path (default results/bench_tau[_eagle3][_quick].json)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens = min(args.prompts, 16), min(args.new_tokens, 48)
        args.nodes, args.depths, args.topks = [16, 60], [6], [4, 10]
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.pair:
        pair = Path(args.pair)
        tdir, hdir = pair / "target", pair / ("eagle1-head" if args.head == "eagle1" else "eagle3-head")
    else:
        tdir, hdir = assets.TARGET, assets.HEADS["eagle" if args.head == "eagle1" else "eagle3"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tdir))
    prompts = [tok(t)["input_ids"] for t in assets.heldout_prompts(args.prompts)]
    target, draft = load_pair(tdir, hdir)
    gen = ReferenceGenerator(target, draft)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    adaptive_knobs = dict(depth_threshold=args.depth_threshold, width_mass=args.width_mass,
                          min_path_prob=args.min_path_prob)
    configs = [dict(kind="chain", K=k, cfg=chain_config(k)) for k in range(1, args.chain_max + 1)]
    modes = [m.strip() for m in args.adaptive.split(",") if m.strip()]
    grid = list(itertools.product(args.nodes, args.depths, args.topks, modes))
    if (REF_TREE["N"], REF_TREE["depth"], REF_TREE["top_k"], "off") not in grid:
        grid.insert(0, (REF_TREE["N"], REF_TREE["depth"], REF_TREE["top_k"], "off"))
    for N, depth, k, mode in grid:
        extra = adaptive_knobs if mode == "on" else {}
        configs.append(dict(kind="tree", N=N, depth=depth, top_k=k, adaptive=mode == "on",
                            cfg=TreeConfig(top_k=k, max_depth=depth, num_nodes=N, **extra)))

    print(f"bench_tau: head {draft.name} ({hdir}), target {tdir}", flush=True)
    print(f"  {len(prompts)} prompts x {args.new_tokens} new tokens, batch {args.batch}, "
          f"{len(configs)} configs, torch threads {torch.get_num_threads()}", flush=True)
    t0 = time.time()
    starts = [gen.start(prompts[i:i + args.batch], params) for i in range(0, len(prompts), args.batch)]
    print(f"  prefill (shared by all configs): {time.time() - t0:.1f}s", flush=True)

    rows = []
    for i, c in enumerate(configs):
        t = time.time()
        total = None
        for s0 in starts:
            state = s0.clone()
            while not state.done:
                gen.step(state, c["cfg"])
            total = state.stats if total is None else total + state.stats
        row = {key: v for key, v in c.items() if key != "cfg"}
        row.update(tau=total.tau, drafted_per_step=total.drafted_per_step,
                   tau_per_drafted_node=total.tau / total.drafted_per_step if total.drafted_per_step else None,
                   acceptance_rate=total.acceptance_rate, verify_steps=total.request_steps,
                   accepted=total.accepted, drafted_nodes=total.drafted_nodes,
                   seconds=round(time.time() - t, 2))
        rows.append(row)
        print(f"  [{i + 1}/{len(configs)}] {label(row):34s} tau {row['tau']:.3f}  "
              f"nodes/step {row['drafted_per_step']:5.1f}  accept {row['acceptance_rate']:.3f}  "
              f"({row['seconds']:.1f}s, total {time.time() - t0:.0f}s)", flush=True)

    chains = [r for r in rows if r["kind"] == "chain"]
    best_chain = max(chains, key=lambda r: r["tau"]) if chains else None
    ref = next((r for r in rows if r["kind"] == "tree" and not r["adaptive"] and r["N"] == REF_TREE["N"]
                and r["depth"] == REF_TREE["depth"] and r["top_k"] == REF_TREE["top_k"]), None)
    ratio = ref["tau"] / best_chain["tau"] if ref and best_chain else None
    summary = {
        "head": draft.name, "head_path": str(hdir), "target_path": str(tdir),
        "prompts": len(prompts), "new_tokens": args.new_tokens, "batch": args.batch,
        "greedy": True, "quick": args.quick,
        "adaptive_knobs": adaptive_knobs,
        "tau_definition": "1 + accepted drafted tokens / verify steps (per request; prefill token excluded)",
        "best_chain": best_chain, "reference_tree": ref,
        "ratio_tree_N60_d6_k10_over_best_chain": ratio,
        "goal_ratio": 1.3, "goal_met": (ratio >= 1.3) if ratio is not None else None,
        "seconds": round(time.time() - t0, 1), "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    out = Path(args.out) if args.out else ROOT / "results" / (
        "bench_tau" + ("" if args.head == "eagle1" else "_eagle3") + ("_quick" if args.quick else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")

    print()
    print(markdown(rows, draft.name, len(prompts), args.new_tokens))
    if best_chain:
        print(f"\nbest chain: K={best_chain['K']} tau {best_chain['tau']:.3f}")
    if ref and ratio is not None:
        print(f"tree (N=60, depth 6, top-k 10): tau {ref['tau']:.3f} = {ratio:.2f}x the best chain "
              f"(goal >= 1.3x: {'met' if ratio >= 1.3 else 'NOT met'})")
    print(f"wrote {out} ({time.time() - t0:.0f}s)")
    return 0


def label(r: dict) -> str:
    if r["kind"] == "chain":
        return f"chain K={r['K']}"
    return f"tree N={r['N']} depth={r['depth']} top-k={r['top_k']}" + (" adaptive" if r["adaptive"] else "")


def markdown(rows: list[dict], head: str, n_prompts: int, new_tokens: int) -> str:
    lines = [f"tau with the {head} head, greedy, {n_prompts} held-out prompts x {new_tokens} tokens",
             "",
             "| draft | N | depth | top-k | adaptive | tau | drafted nodes/step | tau / drafted node | acceptance |",
             "|---|---:|---:|---:|:---:|---:|---:|---:|---:|"]
    for r in rows:
        tpn = f"{r['tau_per_drafted_node']:.3f}" if r["tau_per_drafted_node"] is not None else "-"
        if r["kind"] == "chain":
            cols = ["chain", str(r["K"]), str(r["K"]), "1", "-"]
        else:
            cols = ["tree", str(r["N"]), str(r["depth"]), str(r["top_k"]), "on" if r["adaptive"] else "off"]
        cols += [f"{r['tau']:.3f}", f"{r['drafted_per_step']:.1f}", tpn, f"{r['acceptance_rate']:.3f}"]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
