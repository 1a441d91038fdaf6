"""compact_kv_triton vs compact_kv_ref: bit-exact KV, untouched slots untouched."""
from __future__ import annotations

import pytest
import torch

from _kernel_test_utils import paged_layout, random_tree_batch
from vllm_eagle_tree.core.verification import walk_trees
from vllm_eagle_tree.triton_kernels import kv_compaction as kc
from vllm_eagle_tree.triton_kernels.dispatch import compact_kv

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _random_cache(shape, dtype, gen):
    """Random values with NaN poison sprinkled in (payloads must survive the copy)."""
    if dtype.is_floating_point and dtype.itemsize >= 2:
        x = torch.randn(shape, generator=gen).to(dtype)
        x.view(-1)[torch.randperm(x.numel(), generator=gen)[: x.numel() // 10]] = float("nan")
        return x
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return raw.view(dtype) if dtype != torch.uint8 else raw


def _sequential_oracle(key_caches, value_caches, bt, ctx, na, an, page):
    """The CONVENTIONS rule, one slot at a time, increasing depth."""
    for b in range(len(na)):
        for d in range(1, int(na[b]) + 1):
            src, dst = int(ctx[b]) + int(an[b, d - 1]), int(ctx[b]) + d
            for c in list(key_caches) + list(value_caches):
                c[bt[b, dst // page], dst % page] = c[bt[b, src // page], src % page].clone()


def _case(sizes, ctxs, accepted, layers, heads, head_dim, page, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    seq = [c + n for c, n in zip(ctxs, sizes)]
    bt, num_blocks, _ = paged_layout(seq, page, gen)
    shape = (num_blocks, page, heads, head_dim)
    keys = [_random_cache(shape, dtype, gen) for _ in range(layers)]
    vals = [_random_cache(shape, dtype, gen) for _ in range(layers)]
    D = max([len(a) for a in accepted] + [1])
    an = torch.full((len(sizes), D), -1, dtype=torch.int64)
    for b, a in enumerate(accepted):
        an[b, : len(a)] = torch.tensor(a, dtype=torch.int64)
    na = torch.tensor([len(a) for a in accepted], dtype=torch.int64)
    return keys, vals, bt, torch.tensor(ctxs, dtype=torch.int32), na, an


def _run_and_compare(keys, vals, bt, ctx, na, an, device, use_table=True):
    page = keys[0].shape[1]
    exp_k = [k.clone() for k in keys]
    exp_v = [v.clone() for v in vals]
    kc.compact_kv_ref((exp_k, exp_v), bt, ctx, na, an)
    # The reference agrees with the slot-by-slot rule.
    seq_k = [k.clone() for k in keys]
    seq_v = [v.clone() for v in vals]
    _sequential_oracle(seq_k, seq_v, bt, ctx, na, an, page)
    for a, b in zip(exp_k + exp_v, seq_k + seq_v):
        assert torch.equal(_bits(a), _bits(b))
    dk = [k.to(device) for k in keys]
    dv = [v.to(device) for v in vals]
    caches = kc.KVCacheTable(dk, dv) if use_table else (dk, dv)
    kc.compact_kv_triton(caches, bt.to(device), ctx.to(device), na.to(device), an.to(device))
    for a, b in zip(dk + dv, exp_k + exp_v):
        assert torch.equal(_bits(a.cpu()), _bits(b))
    # Only the destination slots changed (compare against the inputs).
    changed = torch.zeros(keys[0].shape[:2], dtype=torch.bool)
    for b in range(len(na)):
        for d in range(1, int(na[b]) + 1):
            s = int(ctx[b]) + d
            changed[bt[b, s // page], s % page] = True
    for a, orig in zip(dk + dv, keys + vals):
        same = (_bits(a.cpu()) == _bits(orig)).flatten(2).all(-1)
        assert same[~changed].all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compaction_exact(dtype, device):
    # Requests: a branchy path, nothing accepted, an in-order prefix (no-op
    # copies), a shifted chain whose sources and destinations overlap
    # (dst 1 <- 2, 2 <- 3, 3 <- 4: wrong if copied in the wrong order), a
    # path crossing block boundaries with context 0.
    sizes = [12, 5, 6, 8, 20]
    ctxs = [3, 9, 14, 5, 0]
    accepted = [[2, 5, 11], [], [1, 2, 4], [2, 3, 4, 7], [1, 6, 9, 13, 19]]
    case = _case(sizes, ctxs, accepted, layers=3, heads=2, head_dim=16, page=4, dtype=dtype, seed=1)
    _run_and_compare(*case, device=device)


def test_overlap_order_matters(device):
    """Sanity of the test itself: copying in decreasing depth would differ."""
    keys, vals, bt, ctx, na, an = _case([8], [2], [[2, 3, 4, 5]], 1, 1, 8, 4, torch.float32, seed=2)
    fwd = [keys[0].clone()]
    kc.compact_kv_ref((fwd, [vals[0].clone()]), bt, ctx, na, an)
    bwd = keys[0].clone()
    for d in range(4, 0, -1):
        src, dst = 2 + int(an[0, d - 1]), 2 + d
        bwd[bt[0, dst // 4], dst % 4] = bwd[bt[0, src // 4], src % 4]
    assert not torch.equal(fwd[0], bwd)
    _run_and_compare(keys, vals, bt, ctx, na, an, device=device)


def test_vllm_stacked_layout_and_fp8_bytes(device):
    """FlashAttention-style [2, num_blocks, block_size, H, D] layers; 1-byte elements."""
    gen = torch.Generator().manual_seed(3)
    sizes, ctxs = [7, 10], [6, 17]
    seq = [c + n for c, n in zip(ctxs, sizes)]
    bt, num_blocks, _ = paged_layout(seq, 16, gen)
    layers = [torch.randint(0, 256, (2, num_blocks, 16, 2, 32), generator=gen, dtype=torch.uint8)
              for _ in range(2)]
    if hasattr(torch, "float8_e4m3fn"):
        layers = [x.view(torch.float8_e4m3fn) for x in layers]
    na = torch.tensor([3, 2])
    an = torch.tensor([[1, 4, 6], [3, 9, -1]])
    ctx = torch.tensor(ctxs, dtype=torch.int32)
    expected = [x.clone() for x in layers]
    kc.compact_kv_ref(([x[0] for x in expected], [x[1] for x in expected]), bt, ctx, na, an)
    dev_layers = [x.to(device) for x in layers]
    table = kc.KVCacheTable.from_stacked(dev_layers)
    kc.compact_kv_triton(table, bt.to(device), ctx.to(device), na.to(device), an.to(device))
    for a, b in zip(dev_layers, expected):
        assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


def test_from_walk_output(device):
    """End to end with accepted paths produced by the core walk."""
    gen = torch.Generator().manual_seed(4)
    sizes = [9, 30, 4]
    tree = random_tree_batch(sizes, vocab=200, gen=gen, context_len=[5, 0, 40], chain_bias=0.7)
    children = tree.children_lists()
    draws = torch.randint(0, 200, (tree.total,), generator=gen)
    for b in range(3):
        s = int(tree.cu_nodes[b])
        for i, ch in enumerate(children[b]):
            if ch:
                draws[s + i] = tree.token[s + ch[-1]]
    res = walk_trees(draws, tree)
    assert res.num_accepted.max() >= 2
    seq = (tree.context_len + tree.sizes).tolist()
    bt, num_blocks, _ = paged_layout(seq, 8, gen)
    keys = [_random_cache((num_blocks, 8, 2, 16), torch.bfloat16, gen) for _ in range(2)]
    vals = [_random_cache((num_blocks, 8, 2, 16), torch.bfloat16, gen) for _ in range(2)]
    _run_and_compare(keys, vals, bt, tree.context_len, res.num_accepted, res.accepted_nodes,
                     device=device, use_table=False)


def test_dispatch_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("VLLM_EAGLE_TREE_KERNELS", "auto")
    keys, vals, bt, ctx, na, an = _case([6], [3], [[2, 5]], 2, 1, 8, 4, torch.float32, seed=5)
    exp_k, exp_v = [k.clone() for k in keys], [v.clone() for v in vals]
    kc.compact_kv_ref((exp_k, exp_v), bt, ctx, na, an)
    monkeypatch.setattr(kc, "compact_kv_triton", None)  # must not be called on CPU
    compact_kv((keys, vals), bt, ctx, na, an)
    for a, b in zip(keys + vals, exp_k + exp_v):
        assert torch.equal(_bits(a), _bits(b))
