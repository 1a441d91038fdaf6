#!/usr/bin/env python
"""Cost of the head's whole forward (``TreeDrafter._run``) against KV-only
rows (``TreeDrafter._write_kv``) for N rows, one per request at 100 keys of
context, in an eagle2 engine on the deep target with the bundled EAGLE-3
head: what ``proposer.KV_ONLY_MIN_ROWS`` is set from.

    .venv/bin/python scripts/bench_kv_only.py        # ~1 min

Prints milliseconds per call for each N (mean of 20 calls after one warm-up).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 1024)
CONTEXT = 100


def measure(worker, repeats: int = 20):
    """Worker side: (rows, 'forward' | 'kv-only', ms per call) for each N. Writes
    only into the last 400 blocks of the head's cache (the engine is idle)."""
    import torch

    from vllm_eagle_tree.adapter.attention import TreeAttention
    from vllm_eagle_tree.adapter.proposer import full_mask

    d = worker.model_runner.tree_drafter
    kv = d._kv_layer.self_attn.attn.kv_cache
    bs, nb = d.block_size, kv.shape[0]
    per = -(-(CONTEXT + 1) // bs)
    hidden = d.model.model.fc.input_size // 3 if d.is_eagle3 else d.model.model.fc.input_size // 2
    out = []
    for n in ROWS:
        bt = torch.tensor([[nb - 1 - (i * per + j) % 400 for j in range(per)] for i in range(n)],
                          dtype=torch.int32)
        tokens, pos = torch.randint(0, 4000, (n,)), torch.full((n,), CONTEXT)
        slots = bt[:, CONTEXT // bs].long() * bs + CONTEXT % bs
        feats = torch.randn(n, hidden)
        attn = TreeAttention(rows=torch.arange(n), cu_q_lens=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.full((n,), CONTEXT + 1, dtype=torch.int32),
                             tree_lens=torch.ones(n, dtype=torch.int32),
                             tree_mask=full_mask(n, 1), block_table=bt)
        with torch.inference_mode():
            for name, f in (("forward", lambda: d._run(tokens, pos, feats, slots, attn)),
                            ("kv-only", lambda: d._write_kv(tokens, pos, feats, slots))):
                f()
                t = time.perf_counter()
                for _ in range(repeats):
                    f()
                out.append((n, name, 1e3 * (time.perf_counter() - t) / repeats))
    return out


def main():
    from vllm import LLM

    from bench_baseline import speculative_config
    from make_deep_target import build
    from vllm_eagle_tree import assets

    target = build(assets.DEEP_TARGET, extra_layers=60)
    llm = LLM(model=str(target), speculative_config=speculative_config("eagle2-eagle3", "8x4x2g"),
              dtype="float32", enforce_eager=True, max_model_len=1024, seed=0, max_num_seqs=64)
    print("| rows | head forward (ms) | KV-only (ms) |\n|---|---|---|")
    res = llm.collective_rpc(measure)[0]
    by = {(n, k): ms for n, k, ms in res}
    for n in ROWS:
        print(f"| {n} | {by[(n, 'forward')]:.3f} | {by[(n, 'kv-only')]:.3f} |")


if __name__ == "__main__":
    main()
