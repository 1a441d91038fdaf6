#!/usr/bin/env python
"""Paired benchmark: is eagle2 adaptive at least as fast as the best of vanilla
and vLLM's EAGLE chain, at each batch size? With confidence intervals.

This machine drifts 10-20% within minutes (DESIGN.md; README, Benchmarks), so
one run of each method, or a few repeats an engine-lifetime apart
(scripts/bench_baseline.py), cannot settle differences under ~10%. Here
each batch size is measured in ROUNDS: in each round every method runs
the same cell back to back (a fresh in-process engine each, warmed with one
untimed pass at that batch size, then continuous batching at concurrency
BATCH as bench_baseline.py, on the cost-realistic deep target, EAGLE-3 head,
greedy), the order rotating from round to round. The comparison is then
*paired*: per round, adaptive's tokens/s over the round's baseline's (the
method, among vanilla and the chains, with the best mean at that batch size),
whose geometric mean and 95% t-interval (on log ratios) are reported.

    .venv/bin/python scripts/bench_paired.py --rounds 6
    .venv/bin/python scripts/bench_paired.py --batch-sizes 4 --chain-ks 4=2,3 --rounds 8
    .venv/bin/python scripts/bench_paired.py --batch-sizes 16 --shapes plain chain-2 --rounds 4
    .venv/bin/python scripts/bench_paired.py --report results/eagle2_paired.json
    .venv/bin/python scripts/bench_paired.py --report A.json B.json --out pooled.json

``--interleave``: per batch size, every method's engine is started (and
warmed with one untimed cell) once and all stay alive in this process; a
round is then one timed cell of each, back to back, so the two cells of a
pair are seconds apart instead of an engine start-up apart, and a round
costs no start-ups (more rounds in the same time). The adaptive engine
keeps what it learnt from round to round, as a long-running server does.
Engines run without vLLM's Prometheus loggers (the registry is
process-wide), so tau there is tokens per decode step counted on each
engine's scheduler.

    .venv/bin/python scripts/bench_paired.py --interleave --rounds 10

``--restart-every R`` (with ``--interleave``): all of a batch size's
engines are stopped and started afresh every R rounds, each time created
in the next order. An engine keeps its own level for its life (±5% from
one engine to the next at batch 64, ``scripts/replay_forward.py``), so
with one set of engines the pair's ratio carries those two engines'
levels in every round, and the interval cannot show it; restarting
samples it. The adaptive engine then starts from nothing at each restart,
as a restarted server does.

    .venv/bin/python scripts/bench_paired.py --interleave --restart-every 2 --rounds 8

``--output-len-spread S``: the timed requests' lengths are seeded draws in
``MAX_TOKENS x (1 +- S)``, the same for every method, as a server's
requests differ; with fixed lengths (the default) requests that start
together also finish together without speculation (the bandit's
lockstep, ``ShapeBandit``).

    .venv/bin/python scripts/bench_paired.py --interleave --batch-sizes 64 --output-len-spread 0.5

``--shapes`` adds diagnostic cells: the adaptive engine with its shape
bandit pinned to one shape (plain, chain-K, tree), which separates what a
shape costs from what choosing among them costs. They are never the
baseline.

Writes results/eagle2_paired.json (every cell, as it completes) and .png,
and prints markdown tables, the last one for keeping one setting for every
batch size: each method's worst paired ratio to a batch size's baseline.
``--report JSON`` recomputes all that from a saved run; with several JSONs
(runs of the same code), it pools their rounds per batch size and method
into ``--out`` (only methods measured in every run; rounds renumbered).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_runtime  # noqa: E402  (scripts/cpu_runtime.py)

ADAPTIVE = ("eagle2-eagle3", "8x4x2g")

# Student t 97.5% quantiles by degrees of freedom (two-sided 95% interval).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    """Two-sided 95% Student t quantile for ``df`` degrees of freedom (table,
    rounded down to the nearest tabulated df: slightly conservative)."""
    if df >= 30:
        return 1.96 if df > 120 else _T975[30]
    return _T975[max(k for k in _T975 if k <= df)]


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one sample)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """Geometric mean of ``a[r] / b[r]`` and its 95% interval (t on log ratios)."""
    logs = [math.log(x / y) for x, y in zip(a, b)]
    m, h = mean_ci(logs)
    return {"ratio": round(math.exp(m), 4), "low": round(math.exp(m - h), 4),
            "high": round(math.exp(m + h), 4), "each": [round(math.exp(x), 4) for x in logs]}


def verdict(r: dict) -> str:
    if r["low"] >= 1.0:
        return "faster"
    if r["high"] < 1.0:
        return "slower"
    return "no difference resolved"


DEFAULT_CHAIN_KS = {16: [2], 64: [2]}
"""K=3 measured 10-20% slower than K=2 at batch 16 and 64 in every run so far."""


def parse_chain_ks(items: list[str], batch_sizes: list[int]) -> dict[int, list[int]]:
    """``["1=2,3", "64=2"]`` -> {1: [2, 3], 64: [2]}; batch sizes not named get
    DEFAULT_CHAIN_KS, else [2, 3]."""
    out = {b: DEFAULT_CHAIN_KS.get(b, [2, 3]) for b in batch_sizes}
    for item in items:
        b, _, ks = item.partition("=")
        if not ks or int(b) not in out:
            raise SystemExit(f"--chain-ks {item!r}: want BATCH=K[,K...] with BATCH in "
                             f"{batch_sizes}")
        out[int(b)] = [int(k) for k in ks.split(",")]
    return out


FORCED = "eagle2-forced"


def adaptive_engine():
    """An in-process eagle2 adaptive engine (``ADAPTIVE``) on the deep target,
    with the settings of a cell, and the held-out prompts: what
    ``trace_bandit.py`` and ``chain_confidence.py`` run."""
    from vllm import LLM

    from bench_baseline import speculative_config
    from make_deep_target import build
    from vllm_eagle_tree import assets

    target = build(assets.DEEP_TARGET, extra_layers=60)
    llm = LLM(model=str(target), speculative_config=speculative_config(*ADAPTIVE),
              dtype="float32", enforce_eager=True, max_model_len=1024, disable_log_stats=True,
              seed=0, max_num_seqs=64)
    return llm, assets.heldout_prompts()


def start_engine(target, method, k, log_stats: bool = True):
    """A fresh in-process engine for one method (``method`` FORCED: the
    adaptive engine with its bandit pinned to shape ``k``). ``log_stats``
    False: no Prometheus loggers, so that several engines can live in one
    process (vLLM's metrics registry is process-wide; each engine's loggers
    would unregister the last one's)."""
    from vllm import LLM

    from bench_baseline import pin_shape, speculative_config

    spec = speculative_config(*(ADAPTIVE if method == FORCED else (method, k)))
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", enforce_eager=True,
              max_model_len=1024, disable_log_stats=not log_stats, seed=0, max_num_seqs=64)
    if method == FORCED:
        pin_shape(llm, k, "--shapes")
    return llm, spec


def _arm_windows(llm, bs) -> dict:
    from vllm_eagle_tree.core.budget import ShapeBandit

    g = llm.collective_rpc("eagle2_stats")[0]["goodput"]
    return dict(g["arm_windows"].get(str(1 << ShapeBandit.bucket(bs)), {}))


class StepCounter:
    """Counts, on an in-process engine's scheduler, the decode steps of
    running requests (``scheduled_cached_reqs``: a request's steps after its
    prompt), so that tokens per decode step (tau) is known without vLLM's
    process-wide metrics. Prompts here are one chunk, so every cached
    request's step is a decode step."""

    def __init__(self, llm):
        from bench_baseline import _scheduler

        sched = _scheduler(llm)
        self.steps = 0
        schedule = sched.schedule

        def counted(*a, **kw):
            out = schedule(*a, **kw)
            self.steps += len(out.scheduled_cached_reqs.req_ids)
            return out
        sched.schedule = counted


def burst(llm, spec, bs, max_tokens, prompts, min_tokens, counter: StepCounter | None = None,
          warm: bool = True, spread: float = 0.0) -> dict:
    """Time one cell on a live engine: concurrency ``bs``, max(4 x bs,
    min_tokens / max_tokens) requests of ``max_tokens`` greedy tokens
    (``warm``: after an untimed pass of ``bs`` requests; ``spread``: seeded
    lengths in ``max_tokens x (1 +- spread)`` instead, the same for every
    method, ``bench_baseline.request_params``). tau: from vLLM's
    counters, or with ``counter``, tokens per decode step after each
    request's first token."""
    from bench_baseline import _scheduler, request_params
    from vllm_eagle_tree.metrics import spec_counters

    _scheduler(llm).max_num_active_reqs = bs
    if warm:
        w = [prompts[-1 - i % len(prompts)] for i in range(bs)]
        llm.generate(w, request_params(bs, max_tokens // 2), use_tqdm=False)
    n_req = max(4 * bs, -(-min_tokens // max_tokens))
    goodput = bool(spec and spec.get("goodput"))
    windows = _arm_windows(llm, bs) if goodput else {}
    steps = counter.steps if counter else 0
    before = None if counter else spec_counters(llm)
    t = time.perf_counter()
    outs = llm.generate([prompts[i % len(prompts)] for i in range(n_req)],
                        request_params(n_req, max_tokens, spread), use_tqdm=False)
    dt = time.perf_counter() - t
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    if counter:
        tau = (n_tok - n_req) / max(counter.steps - steps, 1)
    else:
        tau = (spec_counters(llm) - before).tau if spec else 1.0
    cell = {"tokens": n_tok, "seconds": round(dt, 3), "tokens_per_s": round(n_tok / dt, 2),
            "tau": round(tau, 4)}
    if goodput:  # this cell's windows per arm (the engine's totals minus those before)
        after = _arm_windows(llm, bs)
        cell["bandit_windows"] = {a: n - windows.get(a, 0) for a, n in after.items()
                                  if n - windows.get(a, 0)}
    return cell


def run_cell(target, method, k, bs, max_tokens, prompts, min_tokens, spread=0.0) -> dict:
    """One fresh engine: an untimed pass of ``bs`` requests, then the timed cell."""
    llm, spec = start_engine(target, method, k)
    cell = burst(llm, spec, bs, max_tokens, prompts, min_tokens, spread=spread)
    del llm
    gc.collect()
    return cell


def label(method, k) -> str:
    if method == "vanilla":
        return "vanilla"
    if method == FORCED:
        return f"eagle2 {k} (forced)"
    if method == ADAPTIVE[0]:
        return "eagle2 adaptive"
    return f"vLLM {method} K={k}"


def summarize(cells: dict[str, list[dict]]) -> dict:
    """Per method mean/CI; the baseline (best non-adaptive mean); the paired ratio."""
    out = {"methods": {}}
    for name, cs in cells.items():
        xs = [c["tokens_per_s"] for c in cs]
        m, h = mean_ci(xs)
        out["methods"][name] = {"mean": round(m, 2), "ci95": round(h, 2), "each": xs}
    others = {n: v for n, v in out["methods"].items()
              if n != label(*ADAPTIVE) and not n.endswith("(forced)")}
    ours = out["methods"].get(label(*ADAPTIVE))
    if others and ours and len(ours["each"]) == len(next(iter(others.values()))["each"]):
        best = max(others, key=lambda n: others[n]["mean"])
        r = paired_ratio(ours["each"], others[best]["each"])
        out["baseline"] = best
        out["adaptive_over_baseline"] = dict(r, verdict=verdict(r))
        if "vanilla" in others and best != "vanilla":
            out["adaptive_over_vanilla"] = paired_ratio(ours["each"], others["vanilla"]["each"])
        # every other method against the same baseline (forced shapes: what a shape costs)
        out["over_baseline"] = {n: paired_ratio(v["each"], others[best]["each"])
                                for n, v in out["methods"].items() if n != best}
    return out


def one_setting(results) -> dict:
    """For each method measured at every batch size: its paired ratio to each
    batch size's baseline (the baseline itself: 1) and the worst of them,
    i.e. what a user who keeps one configuration for every load gives up
    against the best choice for each load."""
    sums = {b: res.get("summary", {}) for b, res in results["batch_sizes"].items()}
    if not sums or any("baseline" not in s for s in sums.values()):
        return {}
    names = set.intersection(*(set(s["methods"]) for s in sums.values()))
    out = {}
    for n in sorted(names):
        per = {b: 1.0 if s["baseline"] == n else s["over_baseline"][n]["ratio"]
               for b, s in sums.items()}
        worst = min(per, key=per.get)
        out[n] = {"per_batch": per, "worst": per[worst], "worst_at": int(worst)}
    return out


def markdown(results) -> str:
    lines = ["| batch | method | tokens/s (mean ± 95% CI) | per round |", "|---|---|---|---|"]
    for b, res in results["batch_sizes"].items():
        s = res["summary"]
        for name, v in s["methods"].items():
            star = " (baseline)" if name == s.get("baseline") else ""
            lines.append(f"| {b} | {name}{star} | {v['mean']:.0f} ± {v['ci95']:.0f} | "
                         + ", ".join(f"{x:.0f}" for x in v["each"]) + " |")
    lines += ["", "| batch | baseline | adaptive / baseline, paired (95% CI) | verdict |"
              " adaptive / vanilla |", "|---|---|---|---|---|"]
    for b, res in results["batch_sizes"].items():
        s = res["summary"]
        r = s.get("adaptive_over_baseline")
        if r:
            v = s.get("adaptive_over_vanilla", r if s["baseline"] == "vanilla" else None)
            lines.append(f"| {b} | {s['baseline']} | {r['ratio']:.3f} [{r['low']:.3f}, "
                         f"{r['high']:.3f}] | {r['verdict']} | "
                         + (f"{v['ratio']:.2f}x" if v else "-") + " |")
    one = results.get("one_setting") or {}
    if one:
        bss = list(results["batch_sizes"])
        lines += ["", "| one setting for every batch size | "
                  + " | ".join(f"/ baseline at {b}" for b in bss) + " | worst |",
                  "|---|" + "---|" * (len(bss) + 1)]
        for n, v in sorted(one.items(), key=lambda kv: -kv[1]["worst"]):
            lines.append(f"| {n} | " + " | ".join(f"{v['per_batch'][b]:.3f}" for b in bss)
                         + f" | {v['worst']:.3f} (batch {v['worst_at']}) |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bss = [int(b) for b in results["batch_sizes"]]
    names = []
    for res in results["batch_sizes"].values():
        names += [n for n in res["summary"]["methods"] if n not in names]
    for n in names:
        xs, ys, es = [], [], []
        for b, res in results["batch_sizes"].items():
            v = res["summary"]["methods"].get(n)
            if v:
                xs.append(int(b))
                ys.append(v["mean"])
                es.append(v["ci95"])
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(bss, [str(b) for b in bss])
    ax.set_xlabel("batch size (concurrency)")
    ax.set_ylabel("generated tokens/s (mean, 95% CI)")
    ax.set_title(f"deep target, EAGLE-3 head, {results['rounds']} paired rounds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    cpu_runtime.preload()  # vLLM's CPU guide: TCMalloc and Intel OpenMP (cpu_runtime.py)
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--chain-ks", nargs="*", default=[], metavar="BATCH=K,K",
                    help="vLLM chain lengths per batch size (default 2 and 3; 2 only at 16 "
                         "and 64, where K=3 measured 10-20%% slower than K=2 in every run)")
    ap.add_argument("--shapes", nargs="*", default=[],
                    help="diagnostic cells: the adaptive engine pinned to these shapes")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--interleave", action="store_true",
                    help="per batch size, start every method's engine once and keep them all "
                         "alive; a round is one timed cell of each, back to back (seconds "
                         "apart, not an engine start-up apart)")
    ap.add_argument("--restart-every", type=int, default=0, metavar="R",
                    help="with --interleave: start every engine afresh every R rounds, "
                         "each time in the next creation order (default 0: never), so that "
                         "an engine's own level (±5%% from one engine to the next) is "
                         "sampled R rounds at a time instead of kept for the whole run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-tokens-per-cell", type=int, default=2048)
    ap.add_argument("--output-len-spread", type=float, default=0.0, metavar="S",
                    help="timed requests of seeded random lengths in MAX_TOKENS x (1 +- S), "
                         "the same for every method (default 0: all MAX_TOKENS long, which "
                         "keeps requests in lockstep without speculation)")
    ap.add_argument("--out", default=str(ROOT / "results" / "eagle2_paired.json"))
    ap.add_argument("--report", metavar="JSON", nargs="+",
                    help="run nothing: recompute the summaries of a saved run, rewrite it "
                         "and its plot, print the tables; several runs: pool them into --out")
    args = ap.parse_args()
    if args.report:
        if len(args.report) == 1:
            report(Path(args.report[0]))
            return
        out = Path(args.out)
        if out.resolve() in {Path(r).resolve() for r in args.report}:
            raise SystemExit(f"--out {out}: pooling would overwrite one of the --report inputs")
        report(out, pool([Path(r) for r in args.report]))
        return
    if args.restart_every and not args.interleave:
        raise SystemExit("--restart-every needs --interleave (without it every cell is a "
                         "fresh engine already)")
    if args.restart_every < 0:
        raise SystemExit(f"--restart-every {args.restart_every}: want 0 (never) or more rounds")
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2 (a confidence interval needs two)")
    chain_ks = parse_chain_ks(args.chain_ks, args.batch_sizes)

    target = build(assets.DEEP_TARGET, extra_layers=60)
    prompts = assets.heldout_prompts()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"command": " ".join(sys.argv), "runtime": cpu_runtime.describe(),
               "rounds": args.rounds,
               "max_tokens": args.max_tokens, "min_tokens_per_cell": args.min_tokens_per_cell,
               "output_len_spread": args.output_len_spread,
               "interleaved": args.interleave, "restart_every": args.restart_every,
               "batch_sizes": {}}
    total = args.rounds * sum(len(chain_ks[b]) + 2 + len(args.shapes) for b in args.batch_sizes)
    done, t0 = 0, time.time()
    for bs in args.batch_sizes:
        specs = [("vanilla", 0)] + [("eagle3", k) for k in chain_ks[bs]] + [ADAPTIVE] \
            + [(FORCED, s) for s in args.shapes]
        res = results["batch_sizes"].setdefault(str(bs), {"cells": {label(*s): [] for s in specs}})
        live = {}
        for r in range(args.rounds):
            if args.interleave and (not live or (args.restart_every
                                                 and r % args.restart_every == 0)):
                # every engine (re)started and warmed before the round; a
                # restart starts them in the next order (who is created first)
                live.clear()
                llm = spec = counter = None
                gc.collect()
                start = r // args.restart_every if args.restart_every else 0
                for method, k in specs[start % len(specs):] + specs[:start % len(specs)]:
                    llm, spec = start_engine(target, method, k, log_stats=False)
                    counter = StepCounter(llm)
                    burst(llm, spec, bs, args.max_tokens, prompts, 0, counter)  # warm-up cell
                    live[(method, k)] = (llm, spec, counter)
            order = specs[r % len(specs):] + specs[:r % len(specs)]  # rotate who goes first
            for method, k in order:
                if args.interleave:
                    llm, spec, counter = live[(method, k)]
                    cell = burst(llm, spec, bs, args.max_tokens, prompts,
                                 args.min_tokens_per_cell, counter, warm=False,
                                 spread=args.output_len_spread)
                else:
                    cell = run_cell(target, method, k, bs, args.max_tokens, prompts,
                                    args.min_tokens_per_cell, args.output_len_spread)
                cell["round"] = r
                res["cells"][label(method, k)].append(cell)
                done += 1
                el = time.time() - t0
                print(f"[{done}/{total}, {el / 60:.1f} min, eta {el / done * (total - done) / 60:.1f}"
                      f" min] batch {bs} round {r + 1}: {label(method, k)} "
                      f"{cell['tokens_per_s']:.1f} tok/s tau {cell['tau']:.2f}", flush=True)
            res["summary"] = summarize(res["cells"]) if r >= 1 else {}
            out.write_text(json.dumps(results, indent=1) + "\n")
        live.clear()  # this batch size's engines (and the loop's last references)
        llm = spec = counter = None
        gc.collect()
    report(out, results)


def pool(paths: list[Path]) -> dict:
    """The rounds of several saved runs as one run: per batch size, each
    method measured in every run that has that batch size gets all their
    cells, rounds renumbered in order."""
    runs = []
    for p in paths:
        if not p.is_file():
            raise SystemExit(f"--report {p}: no such file")
        runs.append(json.loads(p.read_text()))
    pooled = {"command": " | ".join(r["command"] for r in runs), "pooled": [str(p) for p in paths],
              "rounds": 0, "max_tokens": runs[0]["max_tokens"],
              "min_tokens_per_cell": runs[0]["min_tokens_per_cell"], "batch_sizes": {}}
    if any(r["max_tokens"] != pooled["max_tokens"] for r in runs):
        raise SystemExit("--report: the runs differ in max_tokens; their rounds cannot be pooled")
    if len({r.get("output_len_spread", 0.0) for r in runs}) > 1:
        raise SystemExit("--report: the runs differ in --output-len-spread; their rounds cannot "
                         "be pooled")
    pooled["output_len_spread"] = runs[0].get("output_len_spread", 0.0)
    if len({bool(r.get("interleaved")) for r in runs}) > 1:
        raise SystemExit("--report: some runs are --interleave and some are not; their rounds "
                         "cannot be pooled")
    pooled["interleaved"] = bool(runs[0].get("interleaved"))
    for bs in sorted({b for r in runs for b in r["batch_sizes"]}, key=int):
        have = [r["batch_sizes"][bs]["cells"] for r in runs if bs in r["batch_sizes"]]
        methods = [m for m in have[0] if all(m in cells for cells in have[1:])]
        merged: dict[str, list[dict]] = {m: [] for m in methods}
        offset = 0
        for cells in have:
            n = max((c["round"] + 1 for m in methods for c in cells[m]), default=0)
            for m in methods:
                merged[m] += [dict(c, round=c["round"] + offset) for c in cells[m]]
            offset += n
        pooled["batch_sizes"][bs] = {"cells": merged}
        pooled["rounds"] = max(pooled["rounds"], offset)
    return pooled


def report(path: Path, results: dict | None = None) -> None:
    """Summaries (per batch size and across them), JSON, plot, markdown."""
    if results is None:
        if not path.is_file():
            raise SystemExit(f"--report {path}: no such file")
        results = json.loads(path.read_text())
    for res in results["batch_sizes"].values():
        res["summary"] = summarize(res["cells"])
    results["one_setting"] = one_setting(results)
    path.write_text(json.dumps(results, indent=1) + "\n")
    png = path.with_suffix(".png")
    plot(results, png)
    print(markdown(results))
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
