"""tree_sampling kernels vs the reference: exact draws, thresholds and walks."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from _kernel_test_utils import random_tree_batch
from vllm_eagle_tree.core.verification import apply_sampling_params, expand_to_nodes, walk_trees
from vllm_eagle_tree.triton_kernels import tree_sampling as ts
from vllm_eagle_tree.triton_kernels.dispatch import tree_verify

_M32 = 0xFFFFFFFF


# ----------------------------------------------------------------- Philox
@triton.jit
def _tl_rand_kernel(Out, seed, offset_base, N: tl.constexpr):
    offs = offset_base + tl.arange(0, N).to(tl.int64)
    tl.store(Out + tl.arange(0, N), tl.rand(seed, offs))


@pytest.mark.parametrize("seed,base", [(0, 0), (123456789, 17), (2**40 + 12345, 2**33 - 5),
                                       (-7, 2**62)])
def test_torch_philox_matches_tl_rand(seed, base, device):
    """Our PyTorch Philox + uint->float conversion reproduce tl.rand bit-exactly."""
    n = 256
    out = torch.empty(n, dtype=torch.float32, device=device)
    _tl_rand_kernel[(1,)](out, seed, base, N=n)
    offs = base + torch.arange(n, dtype=torch.int64)
    r0, _, _, _ = ts.philox_4x32(seed, offs & _M32, (offs >> 32) & _M32, 0, 0)
    ref = ts.uint_to_uniform_float(r0)
    assert torch.equal(out.cpu(), ref)


def test_kernel_uniforms_match_reference(device):
    seeds = torch.tensor([0, 123456789012345, -5, 2**63 - 1], dtype=torch.int64, device=device)
    offs = torch.tensor([0, 7, 2**40 + 3, 2**32 - 1], dtype=torch.int64, device=device)
    n = 300
    out = torch.zeros(4, 4 * n, device=device)
    ts._philox_uniforms_kernel[(4,)](seeds, offs, out, 5, n, out.stride(0), BLOCK_C=128)
    for b in range(4):
        ref = ts.philox_uniforms(int(seeds[b]), int(offs[b]), torch.tensor([5]), 4 * n)[0]
        assert torch.equal(out[b].cpu(), ref)


def test_noise_is_exponential():
    """-log(u) of the Philox uniforms: mean 1, variance 1, P(E > 3) = e^-3."""
    noise = ts.philox_exponential_noise(torch.tensor([0, 40], dtype=torch.int32), 5000,
                                        torch.tensor([99]), torch.tensor([3]))
    assert noise.shape == (40, 5000)
    assert abs(noise.mean().item() - 1) < 0.02
    assert abs(noise.var().item() - 1) < 0.05
    assert abs((noise > 3).float().mean().item() - 0.0498) < 0.003
    # distinct nodes / offsets give distinct streams
    other = ts.philox_exponential_noise(torch.tensor([0, 40], dtype=torch.int32), 5000,
                                        torch.tensor([99]), torch.tensor([4]))
    assert (noise != other).float().mean() > 0.99
    assert (noise[0] != noise[1]).float().mean() > 0.99


# --------------------------------------------------------------- helpers
def _robust_top_p(xs: torch.Tensor, keep_groups: int) -> tuple[float, float]:
    """A top_p for which the kept set is unambiguous under float rounding.

    ``xs``: one row of scaled logits (-inf = removed by top-k). Tokens are
    grouped by equal value; group g (descending) is kept iff the mass of
    the groups before it is < p. Returns p halfway between the masses before
    group ``keep_groups - 1`` and before the next one, and that group's value.
    """
    x = xs.double()
    probs = torch.softmax(x, 0)
    vals = torch.unique(x[torch.isfinite(x)], sorted=True).flip(0)
    mass = torch.stack([probs[x == v].sum() for v in vals])
    before = torch.cat([mass.new_zeros(1), mass.cumsum(0)])
    g = min(keep_groups, len(vals)) - 1
    return float((before[g] + before[g + 1]) / 2), float(vals[g])


def _sampling_batch(sizes, vocab, dtype, seed, greedy_frac=0.25):
    gen = torch.Generator().manual_seed(seed)
    B = len(sizes)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(sizes).cumsum(0)
    T = int(cu[-1])
    logits = (torch.randn(T, vocab, generator=gen) * 3).to(dtype)
    temp = torch.rand(B, generator=gen) * 1.2 + 0.3
    temp[torch.rand(B, generator=gen) < greedy_frac] = 0.0
    kinds = torch.randint(0, 4, (B,), generator=gen)  # 0 plain, 1 top-k, 2 top-p, 3 both
    top_k = torch.where((kinds == 1) | (kinds == 3), torch.randint(1, 60, (B,), generator=gen), 0)
    top_p = torch.ones(B)
    # Choose each request's top_p from its first row (others just use it too).
    for b in range(B):
        if kinds[b] >= 2 and temp[b] > 0:
            xs = logits[int(cu[b])].float() / temp[b]
            if top_k[b] > 0:
                kth = xs.sort(descending=True).values[int(top_k[b]) - 1]
                xs = torch.where(xs < kth, float("-inf"), xs)
            top_p[b], _ = _robust_top_p(xs, int(torch.randint(1, 30, (), generator=gen)))
    seeds = torch.randint(-2**62, 2**62, (B,), generator=gen)
    offsets = torch.randint(0, 2**40, (B,), generator=gen)
    return dict(logits=logits, cu_nodes=cu, temperature=temp, top_k=top_k, top_p=top_p,
                seeds=seeds, offsets=offsets)


def _to(d: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


# ------------------------------------------------------------------ draws
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_draws_exact(dtype, device):
    batch = _sampling_batch([3, 1, 5, 2, 4, 3, 2], vocab=997, dtype=dtype, seed=11)
    ref = ts.tree_draw_tokens_ref(**batch)
    out = ts.tree_draw_tokens_triton(**_to(batch, device))
    assert out.dtype == torch.int64
    assert torch.equal(out.cpu(), ref)


def test_draws_gpu_block_config(device):
    """The GPU block shape (2048-wide blocks, 16 pivots) on a vocabulary smaller than a block."""
    batch = _sampling_batch([2, 3, 1, 2], vocab=1500, dtype=torch.bfloat16, seed=15, greedy_frac=0.2)
    out = ts.tree_draw_tokens_triton(**_to(batch, device), block_v=2048, num_pivots=16)
    assert torch.equal(out.cpu(), ts.tree_draw_tokens_ref(**batch))


def test_thresholds_exact(device):
    """Top-k and top-p thresholds equal the reference's smallest surviving logit."""
    batch = _sampling_batch([2] * 8, vocab=600, dtype=torch.bfloat16, seed=12, greedy_frac=0.0)
    # Force every filter kind, including top_k = 1 and ties (bf16 logits tie often).
    batch["top_k"] = torch.tensor([0, 1, 7, 0, 40, 3, 599, 1000])
    batch["top_p"] = torch.ones(8)
    cu = batch["cu_nodes"]
    for b in (3, 4, 5):
        xs = batch["logits"][int(cu[b])].float() / batch["temperature"][b]
        k = int(batch["top_k"][b])
        if k > 0:
            kth = xs.sort(descending=True).values[k - 1]
            xs = torch.where(xs < kth, float("-inf"), xs)
        batch["top_p"][b], _ = _robust_top_p(xs, [1, 5, 2][b - 3])
    thr = torch.full((16,), float("nan"), device=device)
    out = ts.tree_draw_tokens_triton(**_to(batch, device), thresholds=thr)
    thr = thr.cpu()
    temp_n = expand_to_nodes(batch["temperature"], cu)
    probs = apply_sampling_params(batch["logits"], temp_n, expand_to_nodes(batch["top_k"], cu),
                                  expand_to_nodes(batch["top_p"], cu))
    xs = batch["logits"].float() / temp_n.unsqueeze(1)
    kept_min = torch.where(probs > 0, xs, float("inf")).amin(1)
    filtered = expand_to_nodes(((batch["top_k"] > 0) & (batch["top_k"] < 600))
                               | (batch["top_p"] < 1), cu)
    assert torch.equal(thr[filtered], kept_min[filtered])
    assert torch.isneginf(thr[~filtered]).all()
    # The second row of each request: same parameters, own logits; draws agree.
    assert torch.equal(out.cpu(), ts.tree_draw_tokens_ref(**batch))


def test_greedy_first_index_on_ties(device):
    logits = torch.zeros(3, 300, dtype=torch.bfloat16)
    logits[0, [17, 200, 250]] = 5.0     # tie across blocks: first wins
    logits[1, [255, 256]] = 2.0         # tie across a block boundary
    logits[2] = float("-inf")           # all -inf: index 0, as torch.argmax
    batch = dict(logits=logits, cu_nodes=torch.tensor([0, 3], dtype=torch.int32),
                 temperature=torch.zeros(1), top_k=torch.zeros(1, dtype=torch.int64),
                 top_p=torch.ones(1), seeds=torch.zeros(1, dtype=torch.int64), offsets=0)
    out = ts.tree_draw_tokens_triton(**_to(batch, device))
    assert out.cpu().tolist() == [17, 255, 0]
    assert torch.equal(out.cpu(), ts.tree_draw_tokens_ref(**batch))


def test_masked_logits_never_drawn(device):
    """-inf logits (e.g. a grammar mask) are never drawn, with or without filters."""
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(6, 256, generator=gen)
    allowed = torch.zeros(256, dtype=torch.bool)
    allowed[torch.randperm(256, generator=gen)[:5]] = True
    logits[:, ~allowed] = float("-inf")
    batch = dict(logits=logits, cu_nodes=torch.tensor([0, 2, 4, 6], dtype=torch.int32),
                 temperature=torch.tensor([1.0, 0.8, 1.5]), top_k=torch.tensor([0, 3, 0]),
                 top_p=torch.tensor([1.0, 1.0, 0.999]), seeds=torch.tensor([1, 2, 3]),
                 offsets=torch.tensor([0, 0, 0]))
    out = ts.tree_draw_tokens_triton(**_to(batch, device)).cpu()
    assert allowed[out].all()
    assert torch.equal(out, ts.tree_draw_tokens_ref(**batch))


def test_seeds_and_offsets_change_draws(device):
    batch = _sampling_batch([16], vocab=64, dtype=torch.float32, seed=14, greedy_frac=0.0)
    batch.update(temperature=torch.tensor([5.0]), top_k=torch.zeros(1, dtype=torch.int64),
                 top_p=torch.ones(1))
    a = ts.tree_draw_tokens_triton(**_to(batch, device)).cpu()
    b = ts.tree_draw_tokens_triton(**_to(dict(batch, offsets=batch["offsets"] + 1), device)).cpu()
    c = ts.tree_draw_tokens_triton(**_to(dict(batch, seeds=batch["seeds"] + 1), device)).cpu()
    again = ts.tree_draw_tokens_triton(**_to(batch, device)).cpu()
    assert torch.equal(a, again)
    assert (a != b).sum() >= 8 and (a != c).sum() >= 8


# ------------------------------------------------------------------- walk
def _draws_following(tree, vocab, gen, follow=0.8):
    """Draws that pick a random child's token with probability ``follow``."""
    children = tree.children_lists()
    draws = torch.randint(0, vocab, (tree.total,), generator=gen)
    for b in range(tree.num_requests):
        s = int(tree.cu_nodes[b])
        for i, ch in enumerate(children[b]):
            if ch and torch.rand((), generator=gen) < follow:
                c = ch[int(torch.randint(0, len(ch), (), generator=gen))]
                draws[s + i] = tree.token[s + c]
    return draws


@pytest.mark.parametrize("seed", range(3))
def test_walk_exact(seed, device):
    gen = torch.Generator().manual_seed(20 + seed)
    sizes = [1, 2, 65, 9, 30, 5][: 3 + seed]
    tree = random_tree_batch(sizes, vocab=500, gen=gen, chain_bias=0.5)
    draws = _draws_following(tree, 500, gen)
    ref = walk_trees(draws, tree)
    out = ts.tree_walk_triton(draws.to(device), tree.to(device))
    for f in ("num_accepted", "accepted_nodes", "accepted_tokens", "bonus_token"):
        assert torch.equal(getattr(out, f).cpu(), getattr(ref, f)), f
    assert ref.num_accepted.max() >= 2  # the walk actually went somewhere
    # Wider output (padding) and a cut at depth 1, against the reference's.
    for md in (tree.max_depth + 3, 1):
        r = ts.tree_walk_ref(draws, tree, max_depth=md)
        o = ts.tree_walk_triton(draws.to(device), tree.to(device), max_depth=md)
        for f in ("num_accepted", "accepted_nodes", "accepted_tokens", "bonus_token"):
            assert torch.equal(getattr(o, f).cpu(), getattr(r, f)), (md, f)


def test_verify_end_to_end(device):
    """Draw + walk on trees whose children are the target's likely tokens."""
    gen = torch.Generator().manual_seed(30)
    sizes = [4, 1, 7, 3]
    tree = random_tree_batch(sizes, vocab=300, gen=gen, chain_bias=0.6)
    batch = _sampling_batch(sizes, vocab=300, dtype=torch.float32, seed=31, greedy_frac=0.5)
    logits = batch["logits"]
    # Make each node's children tokens likely under the target.
    children = tree.children_lists()
    for b in range(tree.num_requests):
        s = int(tree.cu_nodes[b])
        for i, ch in enumerate(children[b]):
            for c in ch:
                logits[s + i, int(tree.token[s + c])] += 8.0
    args = dict(temperature=batch["temperature"], top_k=batch["top_k"],
                top_p=torch.ones(len(sizes)), seeds=batch["seeds"], offsets=batch["offsets"])
    ref = ts.tree_verify_ref(logits, tree, **args)
    out = ts.tree_verify_triton(logits.to(device), tree.to(device), **_to(args, device))
    for f in ("num_accepted", "accepted_nodes", "accepted_tokens", "bonus_token"):
        assert torch.equal(getattr(out, f).cpu(), getattr(ref, f)), f
    assert ref.num_accepted.sum() > 0
    # The dispatch layer picks the reference for CPU tensors.
    disp = tree_verify(logits, tree, **args)
    assert torch.equal(disp.accepted_nodes, ref.accepted_nodes)


@pytest.mark.slow
def test_large_vocab_streaming(device):
    """256k+ vocabulary: streamed in blocks, same draws and thresholds."""
    vocab = 256 * 1024 + 3
    gen = torch.Generator().manual_seed(40)
    logits = (torch.randn(3, vocab, generator=gen) * 4).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    xs = logits[2].float() / 0.9
    kth = xs.sort(descending=True).values[49]
    top_p, _ = _robust_top_p(torch.where(xs < kth, float("-inf"), xs), 12)
    batch = dict(logits=logits, cu_nodes=cu, temperature=torch.tensor([0.0, 1.1, 0.9]),
                 top_k=torch.tensor([0, 0, 50]), top_p=torch.tensor([1.0, 1.0, top_p]),
                 seeds=torch.tensor([5, 6, 7]), offsets=torch.tensor([1, 2, 3]))
    out = ts.tree_draw_tokens_triton(**_to(batch, device), block_v=4096)
    assert torch.equal(out.cpu(), ts.tree_draw_tokens_ref(**batch))
