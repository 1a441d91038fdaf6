#!/usr/bin/env python
"""Time the fused CPU tree attention op (one layer's call) on the deep
target's shapes: fp32, 4 query heads over 2 KV heads of 64, block size 16;
``--batch`` requests, each a tree of ``--nodes`` rows (random ancestor
masks over a random parent array) after ``--context`` keys. Prints the
median microseconds per call of the op built from this checkout and, with
``--baseline-source FILE`` (e.g. the .cpp of an earlier commit, from
``git show REV:vllm_eagle_tree/adapter/cpu_tree_attention.cpp``), of that
source built under another library name; and their largest difference
from the PyTorch reference. A verify forward on the deep target calls the
op once per layer (64).

    git show HEAD~1:vllm_eagle_tree/adapter/cpu_tree_attention.cpp > /tmp/base.cpp
    .venv/bin/python scripts/bench_tree_op.py --batch 1 4 16 64 --nodes 5 12 \
        --context 64 200 --baseline-source /tmp/base.cpp --out results/tree_op.json

(every combination of the lists).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_eagle_tree.adapter import cpu_tree_attention as cta
from vllm_eagle_tree.adapter.attention import TreeAttention
from vllm_eagle_tree.core.tree import TreeBatch


def build_case(batch: int, nodes: int, context: int, gen: torch.Generator):
    Hq, Hkv, D, bs = 4, 2, 64, 16
    per_req = -(-(context + nodes) // bs)
    nb = batch * per_req + 1
    kv = torch.randn(nb, Hkv, bs, 2 * D, generator=gen)
    bt = torch.randperm(nb - 1, generator=gen)[: batch * per_req].view(batch, per_req).int() + 1
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
               for _ in range(batch)]
    tree = TreeBatch.from_parents(parents, [list(range(nodes))] * batch,
                                  context_len=[context] * batch)
    q = torch.randn(tree.total, Hq, D, generator=gen)
    attn = TreeAttention(rows=torch.arange(tree.total), cu_q_lens=tree.cu_nodes,
                         seq_lens=(tree.context_len + tree.sizes).to(torch.int32),
                         tree_lens=tree.sizes.to(torch.int32), tree_mask=tree.packed_mask(),
                         block_table=bt)
    return q, kv, attn


def time_op(op, q, kv, attn, calls: int, repeats: int) -> tuple[float, torch.Tensor]:
    args = attn._fused_args()
    out = torch.zeros_like(q)
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            op(out, q, args[0], kv, *args[1:], 0.125)
        best.append((time.perf_counter() - t) / calls)
    return 1e6 * statistics.median(best), out


def load_baseline(src: Path):
    from torch.utils.cpp_extension import load

    text = src.read_text().replace("TORCH_LIBRARY(eagle_tree,", "TORCH_LIBRARY(eagle_tree_base,") \
        .replace("TORCH_LIBRARY_IMPL(eagle_tree,", "TORCH_LIBRARY_IMPL(eagle_tree_base,")
    d = Path(tempfile.mkdtemp())
    (d / "base.cpp").write_text(text)
    load(name="eagle_tree_base_op", sources=[str(d / "base.cpp")], **cta.CPU_OP_BUILD_FLAGS,
         is_python_module=False, verbose=False)
    return torch.ops.eagle_tree_base.tree_attention


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--nodes", type=int, nargs="+", default=[5])
    ap.add_argument("--context", type=int, nargs="+", default=[200])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline-source", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ops = {"this": cta.load_cpu_tree_op()}
    if args.baseline_source:
        ops["baseline"] = load_baseline(args.baseline_source)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b, n, c in itertools.product(args.batch, args.nodes, args.context):
        q, kv, attn = build_case(b, n, c, gen)
        plan = cta.TreeAttentionPlan(attn.block_table, attn.seq_lens, attn.cu_q_lens,
                                     attn.tree_mask, kv.shape[2], attn.tree_lens)
        ref = plan.attend(q, kv, 0.125)
        row = {"batch": b, "nodes": n, "context": c,
               "threads": torch.get_num_threads()}
        for name, op in ops.items():
            us, out = time_op(op, q, kv, attn, args.calls, args.repeats)
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_max_abs_err"] = float((out - ref).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
