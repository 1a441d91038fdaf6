#!/usr/bin/env python
"""Benchmark: vanilla vLLM, vLLM's own EAGLE chain and eagle2 trees, side by side.

For each target configuration (the bundled pair, and the cost-realistic deep
target from scripts/make_deep_target.py) and each method (vanilla; `eagle`
and `eagle3` chains with K = 1..6; `eagle2` / `eagle2-eagle3`: this plugin's
trees over the EAGLE-1 / EAGLE-3 head, one row per --trees entry
N x depth x top-k), one in-process vLLM engine generates
greedy completions of held-out prompts at batch sizes 1, 4, 16 and 64: by
default with continuous batching at that concurrency (at most BATCH requests
running, a finished one replaced at once, as in a server; ``--synchronized``:
rounds of BATCH requests that each wait for their slowest request).
Reported per cell: generated tokens/s (wall clock) and tau, the mean number
of tokens emitted per target forward (accepted draft tokens + 1).

    .venv/bin/python scripts/bench_baseline.py                 # full grid
    .venv/bin/python scripts/bench_baseline.py --quick         # K in {1,3,6}, batch {1,16}
    .venv/bin/python scripts/bench_baseline.py --configs deep \
        --methods vanilla eagle3 eagle2-eagle3 --trees 16x4x4 60x6x10

Writes results/baseline.json (every cell, as it completes) and
results/baseline.png, and prints a markdown table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


EAGLE2_HEADS = {"eagle2": "eagle", "eagle2-eagle3": "eagle3"}


def method_specs(methods, ks, trees=()):
    out = []
    for m in methods:
        if m == "vanilla":
            out.append(("vanilla", 0))
        elif m in EAGLE2_HEADS:
            out.extend((m, t) for t in trees)
        else:
            out.extend((m, k) for k in ks)
    return out


def speculative_config(method, k):
    """vLLM's speculative_config for a row; k is K for chains, "NxDxK" for trees."""
    from vllm_eagle_tree import assets

    if method == "vanilla":
        return None
    if method in EAGLE2_HEADS:
        label = str(k)
        goodput = label.endswith("g")
        n, d, top_k = (int(x) for x in label.rstrip("g").split("x"))
        spec = {"method": "eagle2", "model": str(assets.HEADS[EAGLE2_HEADS[method]]),
                "num_nodes": n, "max_depth": d, "top_k": top_k}
        if goodput:  # "NxDxKg": adaptive tree sized each step by the goodput planner
            spec.update(adaptive=True, goodput=True, depth_threshold=0.0, width_mass=1.0,
                        min_path_prob=0.0)
        return spec
    return {"method": method, "model": str(assets.HEADS[method]), "num_speculative_tokens": k}


def _scheduler(llm):
    """The in-process engine's scheduler (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _runner(llm):
    """The in-process engine's model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def pin_shape(llm, shape: str, option: str, others: tuple[str, ...] = ()):
    """Pin an eagle2 engine's shape bandit to ``shape`` (its windows are
    still measured) and return the runner. A shape that is not one of the
    bandit's arms exits naming ``option`` and what is allowed (``others``:
    the script's own choices besides the arms)."""
    runner = _runner(llm)
    arms = runner.tree_bandit.arms
    if shape not in arms:
        raise SystemExit(f"{option} {shape!r}: one of {', '.join([*others, *arms])}")
    runner.tree_bandit._pick = lambda bucket: shape
    return runner


def request_params(n: int, max_tokens: int, spread: float = 0.0):
    """Greedy SamplingParams for ``n`` requests, ``ignore_eos``: each generates
    ``max_tokens`` tokens, or with ``spread`` > 0 a length drawn uniformly
    from ``max_tokens * (1 +- spread)`` (seeded: every method gets the same
    lengths), as a server's requests differ in length."""
    import random

    from vllm import SamplingParams

    if spread <= 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    lo, hi = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))
    rng = random.Random(0)
    return [SamplingParams(temperature=0.0, max_tokens=rng.randint(lo, hi), ignore_eos=True)
            for _ in range(n)]


def run_engine(target, method, k, batch_sizes, max_tokens, prompts, reps_tokens,
               synchronized=False, spread=0.0):
    from vllm import LLM, SamplingParams

    from vllm_eagle_tree.metrics import spec_counters

    spec = speculative_config(method, k)
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", enforce_eager=True,
              max_model_len=1024, disable_log_stats=False, seed=0,
              max_num_seqs=max(batch_sizes))
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    cells = []
    for bs in batch_sizes:
        before, n_tok, t = spec_counters(llm), 0, time.perf_counter()
        if synchronized:
            # rounds of `bs` requests, each round waiting for its slowest request
            rounds = max(1, -(-reps_tokens // (bs * max_tokens)))
            for r in range(rounds):
                batch = [prompts[(r * bs + i) % len(prompts)] for i in range(bs)]
                outs = llm.generate(batch, request_params(bs, max_tokens, spread),
                                    use_tqdm=False)
                n_tok += sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            # continuous batching at concurrency `bs`: one call, at most `bs`
            # requests running (vLLM's max_num_active_seqs admission limit), a
            # finished request's slot refilled at once; 4 x bs requests or
            # `reps_tokens` tokens, whichever is more
            n_req = max(4 * bs, -(-reps_tokens // max_tokens))
            _scheduler(llm).max_num_active_reqs = bs
            outs = llm.generate([prompts[i % len(prompts)] for i in range(n_req)],
                                request_params(n_req, max_tokens, spread), use_tqdm=False)
            _scheduler(llm).max_num_active_reqs = max(batch_sizes)
            n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
        dt = time.perf_counter() - t
        c = spec_counters(llm) - before
        cells.append({"batch_size": bs, "tokens": n_tok, "seconds": round(dt, 3),
                      "tokens_per_s": round(n_tok / dt, 2),
                      "tau": round(c.tau, 4) if spec else 1.0,
                      "drafts": c.drafts, "draft_tokens": c.draft_tokens,
                      "accepted_tokens": c.accepted_tokens})
        if spec and spec.get("goodput"):  # what the shape bandit measured in this bucket
            from vllm_eagle_tree.core.budget import ShapeBandit

            g = llm.collective_rpc("eagle2_stats")[0]["goodput"]
            key = str(1 << ShapeBandit.bucket(bs))
            cells[-1]["bandit_tokens_per_s"] = g["arm_tokens_per_second"].get(key, {})
            cells[-1]["bandit_windows"] = g["arm_windows"].get(key, {})
    del llm
    gc.collect()
    return cells


def mean_cells(repeats):
    """Per batch size, the repeats' mean tokens/s and tau (each repeat's kept in
    ``tokens_per_s_each``)."""
    out = []
    for cells in zip(*repeats):
        c = dict(cells[-1])
        each = [x["tokens_per_s"] for x in cells]
        c["tokens_per_s"] = round(sum(each) / len(each), 2)
        c["tokens_per_s_each"] = each
        c["tau"] = round(sum(x["tau"] for x in cells) / len(cells), 4)
        out.append(c)
    return out


def _cell(c):
    each = c.get("tokens_per_s_each")
    spread = f" [{min(each):.0f}-{max(each):.0f}]" if each else ""
    return f"{c['tokens_per_s']:.0f} ({c['tau']:.2f}){spread}"


def markdown(results, batch_sizes):
    lines = []
    for cfg, rows in results["configs"].items():
        lines.append(f"\n**{cfg}** (tokens/s, tau)\n")
        lines.append("| method | K or tree (N x depth x top-k) | " + " | ".join(f"batch {b}" for b in batch_sizes) + " |")
        lines.append("|---|---|" + "---|" * len(batch_sizes))
        for row in rows:
            cells = {c["batch_size"]: c for c in row["cells"]}
            vals = [_cell(cells[b]) if b in cells else "-" for b in batch_sizes]
            lines.append(f"| {row['method']} | {row['k'] or '-'} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def plot(results, batch_sizes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = list(results["configs"])
    fig, axes = plt.subplots(2, len(cfgs), figsize=(6 * len(cfgs), 8), squeeze=False)
    for j, cfg in enumerate(cfgs):
        rows = results["configs"][cfg]
        series = {}
        for row in rows:  # vanilla, and each method at its best K per batch size
            for c in row["cells"]:
                key = row["method"]
                best = series.setdefault(key, {})
                if c["batch_size"] not in best or c["tokens_per_s"] > best[c["batch_size"]]["tokens_per_s"]:
                    best[c["batch_size"]] = dict(c, k=row["k"])
        for name, cells in series.items():
            bs = sorted(cells)
            label = name if name == "vanilla" else f"{name} (best {'tree' if name in EAGLE2_HEADS else 'K'})"
            axes[0][j].plot(bs, [cells[b]["tokens_per_s"] for b in bs], marker="o", label=label)
            axes[1][j].plot(bs, [cells[b]["tau"] for b in bs], marker="o", label=label)
        for i, yl in enumerate(("generated tokens/s", "tau (tokens per target forward)")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
            ax.set_xlabel("batch size")
            ax.set_ylabel(yl)
            ax.set_title(cfg)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["bundled", "deep"], choices=["bundled", "deep"])
    ap.add_argument("--methods", nargs="+", default=["vanilla", "eagle", "eagle3", "eagle2", "eagle2-eagle3"],
                    choices=["vanilla", "eagle", "eagle3", *EAGLE2_HEADS])
    ap.add_argument("--trees", nargs="+", default=["16x4x4", "60x6x10"],
                    help="eagle2 trees as NUM_NODESxMAX_DEPTHxTOP_K; a trailing g "
                         "(e.g. 60x6x10g) sizes the tree each step with the goodput planner")
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--output-len-spread", type=float, default=0.0, metavar="S",
                    help="each request generates a length drawn uniformly from "
                         "MAX_TOKENS * (1 +- S), seeded, the same for every method (default 0: "
                         "exactly MAX_TOKENS each, which keeps vanilla's requests in lockstep)")
    ap.add_argument("--min-tokens-per-cell", type=int, default=2048,
                    help="generated tokens per cell, at least")
    ap.add_argument("--synchronized", action="store_true",
                    help="each cell as rounds of exactly BATCH requests, each round "
                         "waiting for its slowest request (default: continuous batching "
                         "at concurrency BATCH, as a server runs)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every row this many times, round robin; cells report the mean")
    ap.add_argument("--quick", action="store_true", help="K in {1,3,6}, batch sizes {1,16}")
    ap.add_argument("--out", default=str(ROOT / "results" / "baseline.json"))
    args = ap.parse_args()
    if args.quick:
        args.ks, args.batch_sizes = [1, 3, 6], [1, 16]

    targets = {"bundled": assets.TARGET}
    if "deep" in args.configs:
        from make_deep_target import build
        targets["deep"] = build(assets.DEEP_TARGET, extra_layers=60)
    prompts = assets.heldout_prompts()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    specs = method_specs(args.methods, args.ks, args.trees)
    results = {"command": " ".join(sys.argv), "max_tokens": args.max_tokens,
               "output_len_spread": args.output_len_spread,
               "repeats": args.repeats,
               "cells": "synchronized rounds" if args.synchronized else "continuous batching",
               "batch_sizes": args.batch_sizes, "configs": {}}
    total, done, t0 = args.repeats * len(args.configs) * len(specs), 0, time.time()
    for rep in range(args.repeats):  # round robin: slow drifts of the machine hit every row
        for cfg in args.configs:
            rows = results["configs"].setdefault(cfg, [])
            for j, (method, k) in enumerate(specs):
                cells = run_engine(targets[cfg], method, k, args.batch_sizes, args.max_tokens,
                                   prompts, args.min_tokens_per_cell, args.synchronized,
                                   args.output_len_spread)
                if rep == 0:
                    rows.append({"method": method, "k": k, "cells": cells, "repeats": [cells]})
                else:
                    rows[j]["repeats"].append(cells)
                    rows[j]["cells"] = mean_cells(rows[j]["repeats"])
                done += 1
                summary = "  ".join(f"b{c['batch_size']}: {c['tokens_per_s']:.0f} tok/s tau {c['tau']:.2f}"
                                    for c in cells)
                el = time.time() - t0
                print(f"[{done}/{total}, {el / 60:.1f} min, eta {el / done * (total - done) / 60:.1f} min] "
                      f"{cfg} {method} K={k} (repeat {rep + 1}): {summary}", flush=True)
                out.write_text(json.dumps(results, indent=1) + "\n")
    png = out.with_suffix(".png")
    plot(results, args.batch_sizes, png)
    print(markdown(results, args.batch_sizes))
    print(f"\nwrote {out} and {png}")


if __name__ == "__main__":
    main()
