"""tree_attention_triton vs tree_attention_ref (and the reference vs a dense oracle)."""
from __future__ import annotations

import math

import pytest
import torch

from _kernel_test_utils import paged_layout, random_tree_batch
from vllm_eagle_tree.triton_kernels import tree_attention as ta
from vllm_eagle_tree.triton_kernels.dispatch import paged_tree_attention


def _make_case(sizes, ctxs, num_q_heads, num_kv_heads, head_dim, page, dtype, seed,
               device, strided_q=False):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree_batch(sizes, vocab=1000, gen=gen, context_len=ctxs)
    mask = tree.packed_mask()
    seq = [c + n for c, n in zip(ctxs, sizes)]
    bt, num_blocks, spare = paged_layout(seq, page, gen)
    shape = (num_blocks, page, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    # Blocks no request owns: poison, any stray read shows up as NaN.
    kc[spare] = float("nan")
    vc[spare] = float("nan")
    total = sum(sizes)
    if strided_q:  # q as a view of a fused qkv projection, as vLLM passes it
        qkv = torch.randn(total, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        q = qkv.to(dtype)[:, : num_q_heads * head_dim].view(total, num_q_heads, head_dim)
    else:
        q = torch.randn(total, num_q_heads, head_dim, generator=gen).to(dtype)
    args = dict(q=q, key_cache=kc, value_cache=vc, block_table=bt,
                seq_lens=torch.tensor(seq, dtype=torch.int32), cu_q_lens=tree.cu_nodes,
                tree_mask=mask, sm_scale=1.0 / math.sqrt(head_dim))
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return tree, args


def _check(args, tol, **kw):
    ref = ta.tree_attention_ref(**args, compute_dtype=torch.float64,
                                out=torch.empty(args["q"].shape, dtype=torch.float64,
                                                device=args["q"].device))
    out = ta.tree_attention_triton(**args, **kw)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# (sizes, context lens, Hq, Hkv, head_dim, page size)
CASES = [
    ([5, 1, 20], [0, 17, 40], 4, 4, 64, 16),      # GQA 1, empty context, single node
    ([1, 9], [33, 0], 8, 2, 128, 8),              # GQA 4, head_dim 128, page 8
    ([3, 12], [15, 16], 16, 2, 64, 16),           # GQA 8, context at block boundaries
    ([65, 2], [20, 5], 4, 1, 64, 16),             # maximal tree: 65 nodes -> 3 mask words
    ([6, 4], [31, 3], 6, 2, 64, 5),               # GQA 3 (padded group), odd page size
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-ctx{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-p{c[5]}")
def test_fp32(case, device):
    sizes, ctxs, hq, hkv, d, page = case
    _, args = _make_case(sizes, ctxs, hq, hkv, d, page, torch.float32, seed=len(sizes) + d, device=device)
    _check(args, tol=2e-5)


def test_context_splits(device):
    """Flash-decoding path: context split over programs, merged by LSE."""
    _, args = _make_case([7, 3, 1], [50, 0, 21], 8, 2, 64, 16, torch.float32, seed=3, device=device)
    for splits in (2, 3):
        _check(args, tol=2e-5, num_splits=splits)


@pytest.mark.parametrize("cfg", [dict(BLOCK_NODES=16, BLOCK_N=64, num_warps=4, num_stages=2),
                                 dict(BLOCK_NODES=32, BLOCK_N=32, num_warps=8, num_stages=2)],
                         ids=["m64n64", "m128n32"])
def test_gpu_tile_configs(cfg, device):
    """The GPU tile shapes (several q tiles per request, 4-page key tiles)."""
    _, args = _make_case([37, 5, 20], [70, 130, 0], 8, 2, 128, 16, torch.float32, seed=9,
                         device=device)
    _check(args, tol=2e-5, config=cfg)


def test_strided_q(device):
    _, args = _make_case([4, 6], [9, 18], 8, 2, 64, 16, torch.float32, seed=4, device=device,
                         strided_q=True)
    assert not args["q"].is_contiguous()
    _check(args, tol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype, device, interpret):
    """Half inputs vs the reference on the same half values, upcast.

    The interpreter computes in fp32 (its bf16 arithmetic is wrong), so only
    the output rounding differs; compiled, P is rounded to the input dtype
    before P @ V, as in every flash-attention kernel.
    """
    _, args = _make_case([7, 9], [30, 0], 8, 2, 128, 16, dtype, seed=5, device=device)
    eps = torch.finfo(dtype).eps
    _check(args, tol=2 * eps if interpret else 8 * eps)
    _check(args, tol=2 * eps if interpret else 8 * eps, num_splits=2)


def test_tree_lens_draft_pass(device):
    """Draft-tree pass: queries are only the newest nodes, tree keys are all nodes so far."""
    gen = torch.Generator().manual_seed(6)
    tree = random_tree_batch([10, 6], vocab=100, gen=gen, context_len=[12, 0])
    full_mask = tree.packed_mask()
    # Queries: the last 3 nodes of request 0, the last 2 of request 1.
    q_rows = [7, 8, 9, 14, 15]
    n_q = [3, 2]
    seq = [12 + 10, 0 + 6]
    bt, num_blocks, spare = paged_layout(seq, 4, gen)
    kc = torch.randn(num_blocks, 4, 2, 64, generator=gen)
    vc = torch.randn(num_blocks, 4, 2, 64, generator=gen)
    q = torch.randn(5, 4, 64, generator=gen)
    args = dict(q=q, key_cache=kc, value_cache=vc, block_table=bt,
                seq_lens=torch.tensor(seq, dtype=torch.int32),
                cu_q_lens=torch.tensor([0, 3, 5], dtype=torch.int32),
                tree_mask=full_mask[q_rows].contiguous(), sm_scale=0.125,
                tree_lens=torch.tensor([10, 6], dtype=torch.int32))
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    _check(args, tol=2e-5)
    # Against the verify pass: the same queries inside the full verify batch.
    full = dict(args, tree_mask=full_mask.to(device), tree_lens=None,
                cu_q_lens=tree.cu_nodes.to(device),
                q=torch.zeros(16, 4, 64, device=device).index_copy_(
                    0, torch.tensor(q_rows, device=device), args["q"]))
    whole = ta.tree_attention_ref(**full)
    part = ta.tree_attention_triton(**args)
    torch.testing.assert_close(part, whole[q_rows], atol=2e-5, rtol=2e-5)


def test_reference_matches_dense_sdpa():
    """The reference itself vs torch SDPA with an explicit dense mask (one request)."""
    gen = torch.Generator().manual_seed(7)
    tree = random_tree_batch([9], vocab=100, gen=gen, context_len=[13])
    seq = [22]
    bt, num_blocks, _ = paged_layout(seq, 4, gen)
    kc = torch.randn(num_blocks, 4, 2, 32, generator=gen, dtype=torch.float64)
    vc = torch.randn(num_blocks, 4, 2, 32, generator=gen, dtype=torch.float64)
    q = torch.randn(9, 4, 32, generator=gen, dtype=torch.float64)
    out = ta.tree_attention_ref(q, kc, vc, bt, torch.tensor(seq), tree.cu_nodes, tree.packed_mask(),
                                0.3, compute_dtype=torch.float64)
    slots = torch.arange(22)
    k = kc[bt[0].long()[slots // 4], slots % 4].repeat_interleave(2, 1).transpose(0, 1)
    v = vc[bt[0].long()[slots // 4], slots % 4].repeat_interleave(2, 1).transpose(0, 1)
    dense = torch.ones(9, 22, dtype=torch.bool)
    dense[:, 13:] = tree.ancestor_mask(0)
    exp = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=dense, scale=0.3).transpose(0, 1)
    torch.testing.assert_close(out, exp)


def test_dispatch_uses_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("VLLM_EAGLE_TREE_KERNELS", "auto")
    _, args = _make_case([3, 2], [4, 5], 4, 2, 64, 16, torch.float32, seed=8, device="cpu")
    called = []
    monkeypatch.setattr(ta, "tree_attention_triton", lambda *a, **k: called.append(1))
    out = paged_tree_attention(**args)
    assert not called
    torch.testing.assert_close(out, ta.tree_attention_ref(**args))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fuzz(seed, device):
    gen = torch.Generator().manual_seed(100 + seed)
    B = int(torch.randint(1, 5, (), generator=gen))
    sizes = torch.randint(1, 40, (B,), generator=gen).tolist()
    ctxs = torch.randint(0, 90, (B,), generator=gen).tolist()
    hkv = int(torch.randint(1, 3, (), generator=gen))
    group = [1, 4, 8][seed % 3]
    d = [64, 128][seed % 2]
    page = [8, 16, 32][seed % 3]
    _, args = _make_case(sizes, ctxs, hkv * group, hkv, d, page, torch.float32, seed=seed,
                         device=device)
    _check(args, tol=2e-5, num_splits=1 + seed % 3)
