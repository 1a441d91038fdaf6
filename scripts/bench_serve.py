#!/usr/bin/env python
"""`vllm bench serve` against served models on loopback: vanilla, vLLM's chain, eagle2
with a fixed tree and eagle2 adaptive (``"goodput": true``).

For each method, starts `vllm serve` on 127.0.0.1 with the target (default:
the cost-realistic deep target), waits until it is healthy, runs vLLM's own
`vllm bench serve` (random dataset, greedy) at each --concurrency, stops the
server, and collects output throughput and latency from the JSON results.

    .venv/bin/python scripts/bench_serve.py                       # deep target
    .venv/bin/python scripts/bench_serve.py --target assets/target --concurrency 1 8
    .venv/bin/python scripts/bench_serve.py --methods vanilla adaptive   # a subset
    .venv/bin/python scripts/bench_serve.py --methods vanilla chain adaptive --rounds 3

With --rounds R every method is served R times, the order rotating from
round to round, and adaptive's output throughput over each other method's
is paired by round (geometric mean and 95% t-interval, as
scripts/bench_paired.py): this machine drifts 10-20% within minutes, more
than the differences measured.

--warmup-prompts N runs max(N, concurrency) other prompts untimed before
each timed run, for every method: a served eagle2 adaptive engine learns
its shapes per batch size online, which a run of a few hundred steps on a
fresh server charges to the timed requests, and a long-running server
does not pay again.

Writes results/bench_serve.json (as each server ends) and prints markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_runtime  # noqa: E402  (scripts/cpu_runtime.py)
VLLM = str(Path(sys.executable).parent / "vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc, timeout: float = 600) -> None:
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("server did not become healthy")


def specs(head: str, k: int, tree: str) -> dict[str, dict | None]:
    from vllm_eagle_tree import assets

    n, d, top_k = (int(x) for x in tree.split("x"))
    model = str(assets.HEADS[head])
    return {
        "vanilla": None,
        f"chain {head} K={k}": {"method": head, "model": model, "num_speculative_tokens": k},
        f"eagle2 {tree}": {"method": "eagle2", "model": model, "num_nodes": n, "max_depth": d,
                           "top_k": top_k},
        f"eagle2 {tree} adaptive": {"method": "eagle2", "model": model, "num_nodes": n,
                                    "max_depth": d, "top_k": top_k, "adaptive": True,
                                    "goodput": True, "depth_threshold": 0.0, "width_mass": 1.0,
                                    "min_path_prob": 0.0},
    }


def main() -> int:
    cpu_runtime.preload()  # vLLM's CPU guide, for every server too (cpu_runtime.py)
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="default: build/deep-target (built if absent)")
    ap.add_argument("--head", choices=["eagle", "eagle3"], default="eagle3")
    ap.add_argument("--k", type=int, default=3, help="chain length")
    ap.add_argument("--tree", default="8x4x2", help="eagle2 tree NUM_NODESxMAX_DEPTHxTOP_K")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every method this many times, the order rotating per round; "
                         "adaptive's ratios to the others are paired by round")
    ap.add_argument("--warmup-prompts", type=int, default=0,
                    help="before each timed run, an untimed one of max(N, concurrency) "
                         "other prompts at the same concurrency (a long-running server's state)")
    ap.add_argument("--log-dir", default=None,
                    help="keep each server's log here (vLLM's spec-decode metrics lines)")
    ap.add_argument("--methods", nargs="+", default=None,
                    choices=["vanilla", "chain", "eagle2", "adaptive"],
                    help="a subset of the methods (default: all four)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_serve.json"))
    args = ap.parse_args()

    target = args.target
    if target is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_deep_target import build

        target = str(build(assets.DEEP_TARGET, extra_layers=60))
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = {"command": " ".join(sys.argv), "runtime": cpu_runtime.describe(),
               "target": target, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    methods = specs(args.head, args.k, args.tree)
    if args.methods:
        kinds = dict(zip(["vanilla", "chain", "eagle2", "adaptive"], methods))
        methods = {kinds[m]: methods[kinds[m]] for m in args.methods}
    names = list(methods)
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            # the order rotates from round to round (the machine drifts)
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                for row in serve_and_bench(target, methods[name], args, env, Path(tmp)):
                    row = {"method": name, "round": rnd, **row}
                    results["rows"].append(row)
                    print(f"round {rnd} {name:24s} concurrency {row['concurrency']:3d}: "
                          f"{row['output_throughput']:.1f} tok/s, "
                          f"TPOT {row['mean_tpot_ms']:.1f} ms", flush=True)
                out.write_text(json.dumps(results, indent=1) + "\n")  # as each server ends
    results["paired"] = paired(results["rows"], names, args.concurrency)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + markdown(results, names, args.concurrency))
    print(f"\nwrote {out}")
    return 0


def serve_and_bench(target: str, spec: dict | None, args, env: dict, tmp: Path) -> list[dict]:
    """Start `vllm serve` with ``spec``, run `vllm bench serve` at each
    concurrency, stop the server; one row per concurrency."""
    port = free_port()
    cmd = [VLLM, "serve", target, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
           "--served-model-name", "m", "--seed", "0"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    logs = Path(args.log_dir) if args.log_dir else tmp
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / f"server-{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    rows = []
    try:
        wait_healthy(port, proc)
        for c in args.concurrency:
            res = tmp / f"{port}-{c}.json"

            def bench(num_prompts: int, seed: int) -> None:
                subprocess.run(
                    [VLLM, "bench", "serve", "--backend", "vllm", "--base-url",
                     f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", target,
                     "--dataset-name", "random", "--random-input-len", str(args.input_len),
                     "--random-output-len", str(args.output_len), "--ignore-eos",
                     "--num-prompts", str(num_prompts), "--max-concurrency", str(c),
                     "--temperature", "0", "--seed", str(seed), "--save-result",
                     "--result-dir", str(tmp), "--result-filename", res.name],
                    env=env, check=True, capture_output=True, text=True, timeout=1800)
            if args.warmup_prompts:  # untimed, other prompts (its results are overwritten)
                bench(max(args.warmup_prompts, c), seed=1)
            bench(max(args.num_prompts, 2 * c), seed=0)
            r = json.loads(res.read_text())
            rows.append({"concurrency": c, "output_throughput": r.get("output_throughput"),
                         "mean_tpot_ms": r.get("mean_tpot_ms"),
                         "mean_ttft_ms": r.get("mean_ttft_ms"), "completed": r.get("completed")})
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return rows


def paired(rows: list[dict], names: list[str], conc: list[int]) -> dict:
    """Per concurrency, eagle2 adaptive's output throughput over each other
    method's, paired by round (scripts/bench_paired.py's statistics:
    geometric mean, 95% t-interval on the log ratios)."""
    from bench_paired import paired_ratio

    adaptive = [n for n in names if n.endswith("adaptive")]
    out = {}
    if not adaptive:
        return out
    for c in conc:
        tput = {n: {r["round"]: r["output_throughput"] for r in rows
                    if r["method"] == n and r["concurrency"] == c} for n in names}
        a = tput[adaptive[0]]
        for n in names:
            rounds = sorted(set(a) & set(tput[n]))
            if n != adaptive[0] and rounds:
                out.setdefault(str(c), {})[n] = paired_ratio([a[r] for r in rounds],
                                                             [tput[n][r] for r in rounds])
    return out


def markdown(results: dict, names: list[str], conc: list[int]) -> str:
    """Mean output tokens/s and TPOT per method, and adaptive's paired ratios."""
    rows = results["rows"]
    lines = ["| method | " + " | ".join(f"concurrency {c}" for c in conc) + " |",
             "|---|" + "---|" * len(conc)]
    for n in names:
        cells = []
        for c in conc:
            mine = [r for r in rows if r["method"] == n and r["concurrency"] == c]
            if not mine:
                cells.append("-")
                continue
            tput = statistics.fmean(r["output_throughput"] for r in mine)
            tpot = statistics.fmean(r["mean_tpot_ms"] for r in mine)
            cells.append(f"{tput:.0f} tok/s, TPOT {tpot:.0f} ms")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    for other in names:
        ratios = [results.get("paired", {}).get(str(c), {}).get(other) for c in conc]
        if any(ratios):
            lines.append(f"| adaptive / {other} | " + " | ".join(
                f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" if r else "-"
                for r in ratios) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
