"""Host time of the tree bookkeeping a speculative step does outside the models.

On a CPU host every small torch op costs ~5 us, and at batch 1 a tree step
runs a few dozen of them around two forwards of ~50 ms: the expander's
candidate ranking, the planner's pruning, the packed ancestor mask the
attention reads, the greedy walk that verifies, and the calibration update.
This times each on synthetic trees (a random draft distribution stands in
for the head, so no model is loaded), at batch 1 (the 8x4x2 tree the
benchmarks run) and at batch 64 (60-node trees), single-threaded, the best
of a few repeats of many calls. Also the KV compaction of the accepted
paths (each request's path taken from the greedy walk), over 65 layer
caches shaped as the deep target's and its head's (2 KV heads of 64, block
size 16) in one buffer as vLLM allocates them: the CPU path
(``CPUKVCompaction``) and the PyTorch reference on the key/value views.
Run it at two commits to compare::

    .venv/bin/python scripts/bench_host_ops.py --out results/host_ops_<commit>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from vllm_eagle_tree.adapter.cpu_tree_attention import CPUKVCompaction, cpu_kv_views
from vllm_eagle_tree.core.budget import GoodputPlanner
from vllm_eagle_tree.core.expander import TreeConfig, expand_tree
from vllm_eagle_tree.core.verification import verify
from vllm_eagle_tree.triton_kernels.kv_compaction import compact_kv_ref

VOCAB = 4096


def draft_step_fn(gen: torch.Generator):
    """A stand-in head: peaked random log-probabilities, drawn once per frontier
    shape and then returned as they are (so the timings are the bookkeeping's)."""
    drawn: dict[tuple[int, int], torch.Tensor] = {}

    def step_fn(frontier):
        shape = tuple(frontier.tokens.shape)
        if shape not in drawn:
            drawn[shape] = torch.log_softmax(3.0 * torch.randn(*shape, VOCAB, generator=gen), -1)
        return drawn[shape]
    return step_fn


def best_of(fn, calls: int, repeats: int = 5) -> float:
    """Milliseconds per call: the best of ``repeats`` runs of ``calls`` calls."""
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return 1e3 * best


def case(batch: int, cfg: TreeConfig, calls: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    step_fn = draft_step_fn(gen)
    roots = torch.randint(0, VOCAB, (batch,), generator=gen)
    root_logp = torch.log_softmax(3.0 * torch.randn(batch, VOCAB, generator=gen), -1)
    ctx = torch.full((batch,), 100, dtype=torch.int32)
    tree = expand_tree(cfg, roots, root_logp, step_fn, context_len=ctx)
    planner = GoodputPlanner(max_depth=cfg.max_depth, warmup=0)
    for rows in (batch, 2 * batch, 4 * batch, 8 * batch):  # a verify-cost line to plan with
        planner.observe_verify(rows, 0.05 + 0.001 * rows)
    planner.observe_draft(0.003)
    req_ids = [f"r{i}" for i in range(batch)]
    logits = torch.randn(tree.total, VOCAB, generator=gen)
    zeros = torch.zeros(batch)
    greedy = verify(tree, logits, zeros, torch.zeros(batch, dtype=torch.int64), torch.ones(batch))
    # a step's tree is new: its derived indices (cached on first use) are not there yet
    fresh = lambda: dataclasses.replace(tree)  # noqa: E731
    copy_ms = best_of(fresh, calls)
    return {
        "nodes_per_tree": tree.total / batch,
        "expand_ms": best_of(lambda: expand_tree(cfg, roots, root_logp, step_fn,
                                                 context_len=ctx), calls),
        "prune_ms": best_of(lambda: planner.prune(fresh(), req_ids=req_ids), calls) - copy_ms,
        "packed_mask_ms": best_of(lambda: fresh().packed_mask(), calls) - copy_ms,
        "verify_greedy_ms": best_of(lambda: verify(fresh(), logits, zeros,
                                                   torch.zeros(batch, dtype=torch.int64),
                                                   torch.ones(batch)), calls) - copy_ms,
        "observe_acceptance_ms": best_of(lambda: planner.observe_acceptance(
            fresh(), greedy.num_accepted, greedy.accepted_nodes, req_ids), calls) - copy_ms,
        **compaction(tree, greedy, calls),
    }


def compaction(tree, walk, calls: int, layers: int = 65, heads: int = 2, head_size: int = 64,
               block: int = 16) -> dict[str, float]:
    """KV compaction of the walk's accepted paths: the CPU path and the
    reference, over ``layers`` caches in one buffer."""
    B = tree.num_requests
    per_req = (int(tree.context_len.max()) + int(tree.cu_nodes.diff().max())) // block + 2
    shape = (B * per_req, heads, block, 2 * head_size)
    buf = torch.zeros(layers, *shape)
    caches = list(buf.unbind(0))
    bt = torch.arange(B * per_req, dtype=torch.int32).view(B, per_req)
    num_acc = walk.num_accepted.clamp(min=1)  # at least one node moves in every request
    nodes = walk.accepted_nodes.clone()
    nodes[:, 0] = torch.where(walk.num_accepted > 0, nodes[:, 0], 1)
    cpu = CPUKVCompaction(caches)
    views = [cpu_kv_views(c) for c in caches]
    ref = ([k for k, _ in views], [v for _, v in views])
    return {
        "compact_kv_cpu_ms": best_of(lambda: cpu(bt, tree.context_len, num_acc, nodes), calls),
        "compact_kv_reference_ms": best_of(
            lambda: compact_kv_ref(ref, bt, tree.context_len, num_acc, nodes), calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the table as JSON")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = {
        "batch 1, 8x4x2 tree": (1, TreeConfig(top_k=2, max_depth=4, num_nodes=8), 400),
        "batch 64, 60x6x10 trees": (64, TreeConfig(top_k=10, max_depth=6, num_nodes=60), 10),
    }
    table = {}
    for name, (batch, cfg, calls) in cases.items():
        table[name] = row = case(batch, cfg, calls)
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
