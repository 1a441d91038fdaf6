#!/usr/bin/env python
"""One eagle2 adaptive engine with the shape bandit forced to one shape, to
compare shapes with vanilla and vLLM's chain outside the bandit's choices.

    .venv/bin/python scripts/bench_shapes.py --shape plain --batch 64 --requests 128
    .venv/bin/python scripts/bench_shapes.py --shape chain-3 --batch 1 --requests 8
    .venv/bin/python scripts/bench_shapes.py --shape vanilla --batch 64 --requests 128
    .venv/bin/python scripts/bench_shapes.py --shape vllm-chain-2 --batch 64 --requests 128
    .venv/bin/python scripts/bench_shapes.py --shape chain-1 --batch 16 --requests 32 --step-log /tmp/s.json
    .venv/bin/python scripts/bench_shapes.py --shape plain,chain-1,chain-2,chain-3 --rounds 3 \
        --batch 16 --requests 48 --output-len-spread 0.5 --out results/X.json

Deep target, EAGLE-3 head, greedy, 64 tokens per request, continuous
batching at concurrency --batch (as scripts/bench_baseline.py). ``--shape
free`` leaves the bandit alone. Prints tokens/s and, for eagle2, the
bandit's measured rates per bucket and shape (a forced shape is still
measured, so its measured rate can be held against the real one).

Several eagle2 shapes (comma-separated) share one engine: each round runs
every shape's requests once, the order rotating, and every step is timed
(written out with ``--step-log``). Per shape it prints, over its full-batch steps
without prefill rows, the mean step, the target forward measured and the
bandit's forward model at the step's query rows, drafting, and tokens per
request, next to the bandit's predicted step and tokens per request for
that shape: whether the cost model ranks the shapes as they ran.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def main():
    from vllm import LLM, SamplingParams

    from bench_baseline import _runner, _scheduler, pin_shape, request_params, speculative_config
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True,
                    help="plain, chain-K, tree, free (the --tree engine, bandit unpinned), "
                         "vanilla, vllm-chain-K")
    ap.add_argument("--tree", default="8x4x2g", metavar="NxDxK[g]",
                    help="the eagle2 engine's tree (N nodes, depth D, top-k K; g: sized each "
                         "step by the goodput planner, with the shape bandit; without g a "
                         "fixed tree, --shape free only), default 8x4x2g as bench_paired.py")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1,
                    help="with several shapes: rounds of every shape, the order rotating")
    ap.add_argument("--output-len-spread", type=float, default=0.0,
                    help="output lengths drawn from 64 x (1 +- S), seeded, the same for every "
                         "shape (as bench_paired.py); 0: 64 each (lockstep)")
    ap.add_argument("--out", metavar="JSON", help="with several shapes: write the per-shape table")
    ap.add_argument("--step-log", metavar="JSON",
                    help="eagle2 shapes: write every engine step (requests, query rows, prefill "
                         "rows, seconds, emitted tokens) and print where the time went")
    args = ap.parse_args()
    shapes = args.shape.split(",")
    if len(shapes) > 1:
        bad = [x for x in shapes if x in ("vanilla", "free") or x.startswith("vllm-chain-")]
        if bad:
            raise SystemExit(f"--shape {args.shape!r}: several shapes must all be eagle2 shapes "
                             f"(plain, chain-K, tree), not {', '.join(bad)}")
        args.shape = shapes[0]
    elif args.rounds != 1 or args.out:
        raise SystemExit("--rounds and --out compare several shapes: give --shape a "
                         "comma-separated list of eagle2 shapes (e.g. plain,chain-1,chain-2)")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be 1 or more")

    if args.shape == "vanilla":
        spec = None
    elif args.shape.startswith("vllm-chain-"):
        spec = speculative_config("eagle3", int(args.shape.rsplit("-", 1)[1]))
    else:
        if not re.fullmatch(r"\d+x\d+x\d+g?", args.tree):
            raise SystemExit(f"--tree {args.tree!r}: NxDxK or NxDxKg (e.g. 16x5x4g)")
        if not args.tree.endswith("g") and args.shape != "free":
            raise SystemExit(f"--tree {args.tree!r} is a fixed tree, which has no shapes to "
                             f"pin: use --shape free with it, or a goodput tree ({args.tree}g)")
        spec = speculative_config("eagle2-eagle3", args.tree)
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
    params = request_params(args.requests, 64, args.output_len_spread)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    if len(shapes) > 1:
        return compare_shapes(llm, runner, shapes, args, prompts, params)
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


def compare_shapes(llm, runner, shapes, args, prompts, params):
    """Several pinned shapes on one engine, in rotating rounds (module docstring)."""
    from vllm import SamplingParams

    from bench_baseline import _scheduler, pin_shape
    from vllm_eagle_tree.core.budget import chain_length

    bandit = runner.tree_bandit
    bucket = bandit.bucket(args.batch)
    _scheduler(llm).max_num_active_reqs = args.batch
    for shape in shapes:  # untimed: a shape's first steps carry one-time costs
        pin_shape(llm, shape, "--shape", others=())
        llm.generate([prompts[i % len(prompts)] for i in range(args.batch)],
                     SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    steps = log_steps(runner)
    runs = {s: [] for s in shapes}  # shape -> [(tokens, seconds)] per round
    for r in range(args.rounds):
        for shape in shapes[r % len(shapes):] + shapes[:r % len(shapes)]:
            pin_shape(llm, shape, "--shape", others=())
            first = len(steps)
            t = time.perf_counter()
            outs = llm.generate([prompts[i % len(prompts)] for i in range(args.requests)],
                                params, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[shape].append((n, dt))
            for x in steps[first:]:
                x["shape"] = shape
            print(f"round {r + 1}: {shape} {n / dt:.1f} tok/s", flush=True)
    table = {}
    print(f"batch {args.batch}: full-batch steps without prefill rows (ms per step; "
          f"tokens per request per step), measured and as the bandit predicts them")
    for shape in shapes:
        row = measured_row(steps, runs[shape], shape, args.batch)
        pred = bandit.model_seconds(bucket, shape)
        k = chain_length(shape)
        row["predicted_step_ms"] = None if pred is None else 1e3 * pred
        # the bandit's expected tokens (each depth's acceptance one standard
        # error optimistic) and the plain estimate (optimism 0); the tree's
        # are its greedy chain's plus what the tree added (ShapeBandit.tree_tokens)
        for key, optimism in (("predicted", 1.0), ("estimated", 0.0)):
            row[f"{key}_tokens_per_request"] = 1.0 if shape == "plain" else \
                bandit.tree_tokens(bucket, optimism) if shape == "tree" else \
                None if k is None else bandit.chain_tokens(k, optimism=optimism)
        row["predicted_tok_s"] = bandit.rate(bucket, shape)
        row["parts"] = run_parts([x for x in steps if x.get("shape") == shape], args.batch)
        table[shape] = row
        fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
        print(f"  {shape:8s} {row['tok_s']:6.1f} tok/s ({row['steps']} steps): step "
              f"{fmt(row.get('step_ms'))} (predicted {fmt(row['predicted_step_ms'])}), forward "
              f"{fmt(row.get('forward_ms'))} at {fmt(row.get('rows'), '{:.0f}')} rows (model "
              f"{fmt(row.get('model_forward_ms'))}), drafting {fmt(row.get('draft_ms'))}, "
              f"other {fmt(row.get('other_ms'))}; tokens "
              f"{fmt(row.get('tokens_per_request'), '{:.3f}')} (predicted "
              f"{fmt(row['predicted_tokens_per_request'], '{:.3f}')}, without optimism "
              f"{fmt(row['estimated_tokens_per_request'], '{:.3f}')}); predicted "
              f"{fmt(row['predicted_tok_s'])} tok/s")
    cost = bandit.verify_cost
    print(f"bandit forward model now: {1e3 * cost.a:.1f} ms + {1e3 * cost.b:.3f} ms per row "
          f"(speed {getattr(cost, 'speed', 1.0):.3f}), shape factor by rows "
          + json.dumps({k: round(v, 3) for k, v in getattr(cost, 'profile', dict)().items()}))
    print("bandit model:", json.dumps(bandit.model_summary()))
    sp = sorted(bandit.speeds)
    if sp:
        print(f"finished requests' speeds (tokens over the pooled estimate, chain steps): "
              f"{len(sp)}, min {sp[0]:.2f} p10 {sp[len(sp) // 10]:.2f} median "
              f"{sp[len(sp) // 2]:.2f} p90 {sp[(9 * len(sp)) // 10]:.2f} max {sp[-1]:.2f}")
    print("where the runs' time went, per shape (all its rounds; the drain: steps at under "
          "the full batch, its excess over their tokens at the full-batch steps' rate)")
    for shape in shapes:
        parts = table[shape]["parts"]
        print(f"  {shape:8s} " + "; ".join(
            f"{name} {p['steps']} steps {p['seconds']:.2f} s {p['tokens']} tokens"
            for name, p in parts.items() if name != "drain_excess_s")
            + f"; drain excess {parts['drain_excess_s']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"batch": args.batch, "requests": args.requests, "rounds": args.rounds,
             "output_len_spread": args.output_len_spread, "shapes": table,
             "model": bandit.model_summary()}, indent=1) + "\n")
    if args.step_log:
        Path(args.step_log).write_text(json.dumps(steps) + "\n")


def run_parts(steps: list[dict], batch: int) -> dict:
    """Where a shape's runs went: its steps with the whole batch decoding
    and no prompt rows ("full"), those with prompt rows ("prefill"), those
    at fewer requests ("drain": the end of a burst, or a request that left
    and was not yet replaced), each as steps, seconds and tokens, and the
    drain's excess over its tokens at the full steps' rate (seconds)."""
    groups = {"full": [x for x in steps if x["requests"] >= batch and x["prefill_rows"] == 0],
              "prefill": [x for x in steps if x["prefill_rows"] > 0],
              "drain": [x for x in steps if x["requests"] < batch and x["prefill_rows"] == 0]}
    out = {name: {"steps": len(xs), "seconds": round(sum(x["seconds"] for x in xs), 3),
                  "tokens": sum(x["emitted"] for x in xs)} for name, xs in groups.items()}
    full, drain = out["full"], out["drain"]
    rate = full["tokens"] / full["seconds"] if full["seconds"] > 0 else None
    out["drain_excess_s"] = round(drain["seconds"] - drain["tokens"] / rate, 3) if rate else 0.0
    return out


def measured_row(steps: list[dict], runs: list[tuple[int, float]], shape: str,
                 batch: int) -> dict:
    """One shape's measured line of :func:`compare_shapes`: tokens/s over its
    runs ((tokens, seconds) per round) and, over its own steps (``arm``: the
    drafts they verify are the shape's; a round's first step verifies the
    previous shape's) with the whole batch decoding and no prompt rows, the
    mean step, target forward, the forward model at the step's rows,
    drafting, the rest, query rows and tokens per request per step."""
    xs = [x for x in steps if x.get("shape") == shape and x["arm"] == shape
          and x["requests"] == batch and x["prefill_rows"] == 0 and x["forward"] is not None]
    tok = sum(n for n, _ in runs)
    sec = sum(dt for _, dt in runs)
    row = {"tok_s": tok / sec, "rounds": [n / dt for n, dt in runs], "steps": len(xs)}
    if xs:
        def mean(key):
            return sum(x[key] for x in xs) / len(xs)
        row.update(step_ms=1e3 * mean("seconds"), forward_ms=1e3 * mean("forward"),
                   model_forward_ms=1e3 * mean("model"), draft_ms=1e3 * mean("draft"),
                   other_ms=1e3 * (mean("seconds") - mean("forward") - mean("draft")),
                   rows=mean("rows"),
                   tokens_per_request=sum(x["emitted"] for x in xs)
                   / sum(x["requests"] for x in xs))
    return row


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
                              forward=forward, model=runner.tree_bandit.verify_cost(cur["rows"]),
                              draft=runner._step_draft))
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
