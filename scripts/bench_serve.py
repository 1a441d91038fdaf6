#!/usr/bin/env python
"""`vllm bench serve` against served models on loopback: vanilla, vLLM's chain, eagle2
with a fixed tree and eagle2 adaptive (``"goodput": true``).

For each method, starts `vllm serve` on 127.0.0.1 with the target (default:
the cost-realistic deep target), waits until it is healthy, runs vLLM's own
`vllm bench serve` (random dataset, greedy) at each --concurrency, stops the
server, and collects output throughput and latency from the JSON results.

    .venv/bin/python scripts/bench_serve.py                       # deep target
    .venv/bin/python scripts/bench_serve.py --target assets/target --concurrency 1 8

Writes results/bench_serve.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_serve.json"))
    args = ap.parse_args()

    target = args.target
    if target is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_deep_target import build

        target = str(build(assets.DEEP_TARGET, extra_layers=60))
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = {"command": " ".join(sys.argv), "target": target, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in specs(args.head, args.k, args.tree).items():
            port = free_port()
            cmd = [VLLM, "serve", target, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
                   "--served-model-name", "m", "--seed", "0"]
            if spec:
                cmd += ["--speculative-config", json.dumps(spec)]
            log = open(Path(tmp) / f"server-{port}.log", "w")
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                wait_healthy(port, proc)
                for c in args.concurrency:
                    res = Path(tmp) / f"{port}-{c}.json"
                    subprocess.run(
                        [VLLM, "bench", "serve", "--backend", "vllm", "--base-url",
                         f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", target,
                         "--dataset-name", "random", "--random-input-len", str(args.input_len),
                         "--random-output-len", str(args.output_len), "--ignore-eos",
                         "--num-prompts", str(max(args.num_prompts, 2 * c)),
                         "--max-concurrency", str(c), "--temperature", "0", "--seed", "0",
                         "--save-result", "--result-dir", tmp, "--result-filename", res.name],
                        env=env, check=True, capture_output=True, text=True, timeout=1800)
                    r = json.loads(res.read_text())
                    row = {"method": name, "concurrency": c,
                           "output_throughput": r.get("output_throughput"),
                           "mean_tpot_ms": r.get("mean_tpot_ms"),
                           "mean_ttft_ms": r.get("mean_ttft_ms"),
                           "completed": r.get("completed")}
                    results["rows"].append(row)
                    print(f"{name:24s} concurrency {c:3d}: {row['output_throughput']:.1f} tok/s, "
                          f"TPOT {row['mean_tpot_ms']:.1f} ms", flush=True)
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                log.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    conc = args.concurrency
    print("\n| method | " + " | ".join(f"concurrency {c}" for c in conc) + " |")
    print("|---|" + "---|" * len(conc))
    for name in dict.fromkeys(r["method"] for r in results["rows"]):
        cells = {r["concurrency"]: r for r in results["rows"] if r["method"] == name}
        print(f"| {name} | " + " | ".join(
            f"{cells[c]['output_throughput']:.0f} tok/s, TPOT {cells[c]['mean_tpot_ms']:.0f} ms"
            if c in cells else "-" for c in conc) + " |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
