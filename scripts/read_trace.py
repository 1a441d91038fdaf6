#!/usr/bin/env python
"""Summarise a shape-bandit trace (``VLLM_EAGLE2_TRACE=PATH``: one JSON line
per pick, ``ShapeBandit.trace_record``, in ``PATH.<pid>``).

Per batch size (the picks' bucket): how many picks chose each shape (and,
of those made while the batch was in lockstep, each shape), which shape
the bandit held best and how often that changed, and the cost
model's predicted step increment of one more chain depth
(``step_ms[chain-(k+1)] - step_ms[chain-k]``: the forward line's per-row
slope plus the drafting line's per-depth slope, both at the speed of the
moment) as min / 10% / median / 90% / max over the picks. A model that
holds its shape keeps that increment near the step profile's (draft one
more depth + verify one more row); one that wanders ranks the chains by
its own noise.

    .venv/bin/python scripts/read_trace.py /tmp/t/il.12345 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict


def quantiles(xs: list[float]) -> dict:
    """min, 10%, median, 90%, max (nearest rank) of ``xs``."""
    xs = sorted(xs)
    n = len(xs)
    return {"n": n, "min": xs[0], "p10": xs[n // 10], "median": xs[n // 2],
            "p90": xs[(9 * n) // 10], "max": xs[-1]}


def summarise(records: list[dict]) -> dict:
    """Per batch size (str): picks per shape, best per shape, switches of
    the best shape, and the per-depth step increments' quantiles (ms)."""
    by_batch: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_batch[r["batch"]].append(r)
    out = {}
    for batch in sorted(by_batch):
        recs = by_batch[batch]
        increments: dict[int, list[float]] = defaultdict(list)
        for r in recs:
            ms = r["step_ms"]
            k = 1
            while f"chain-{k + 1}" in ms:
                lo, hi = ms.get(f"chain-{k}"), ms[f"chain-{k + 1}"]
                if lo is not None and hi is not None:
                    increments[k].append(round(hi - lo, 4))
                k += 1
        bests = [r["best"] for r in recs if r["best"] is not None]
        out[str(batch)] = {
            "picks": len(recs),
            "picked": dict(Counter(r["picked"] for r in recs).most_common()),
            # traces from before the lockstep flag have none: no lockstep picks
            "picked_in_lockstep": dict(Counter(
                r["picked"] for r in recs if r.get("lockstep")).most_common()),
            "best": dict(Counter(bests).most_common()),
            "best_switches": sum(a != b for a, b in zip(bests, bests[1:])),
            "depth_increment_ms": {f"chain-{k}->chain-{k + 1}": quantiles(v)
                                   for k, v in sorted(increments.items())},
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="+", help="trace files (PATH.<pid>)")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args()
    records = [json.loads(line) for path in args.trace for line in open(path) if line.strip()]
    summary = summarise(records)
    for batch, s in summary.items():
        print(f"batch {batch}: {s['picks']} picks; picked {s['picked']} (in lockstep "
              f"{s['picked_in_lockstep']}); best {s['best']} ({s['best_switches']} switches)")
        for step, q in s["depth_increment_ms"].items():
            print(f"  {step}: min {q['min']:.2f} p10 {q['p10']:.2f} median {q['median']:.2f} "
                  f"p90 {q['p90']:.2f} max {q['max']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
