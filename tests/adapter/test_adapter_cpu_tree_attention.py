"""Prototype CPU tree-verify attention over vLLM's CPU_ATTN KV cache.

A minimal Llama forward with the bundled target's weights runs attention
through vLLM's own CPU kernels (``cpu_attn_reshape_and_cache`` writes K/V,
``cpu_attention_with_kv_cache`` runs causal attention) and, for the verify
pass, through ``adapter.cpu_tree_attention``. Checked: the layout probe, and
that one verify forward over a batch of trees gives every node the logits of
its root-to-node path run causally (transformers' Llama and vLLM's causal
kernel as references); after accepted-path compaction, vLLM's causal kernel
decodes the next token exactly as if the path had been decoded token by token.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vllm_eagle_tree.adapter import cpu_tree_attention as cta
from vllm_eagle_tree.core import TreeBatch
from vllm_eagle_tree.heads import apply_rope, rms_norm, rope_cos_sin

BLOCK = 32  # CPU_ATTN wants multiples of 32
ATOL = 2e-4


@pytest.fixture(scope="module")
def ops():
    from vllm import _custom_ops

    return _custom_ops


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, head_size", [(32, 64), (128, 64), (64, 128), (32, 80)])
def test_layout_probe_matches_vllm_writer(dtype, block_size, head_size):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size)
    if isa not in cta.KNOWN_ISAS:
        pytest.skip(f"ISA {isa} on this CPU")
    assert cta.probe_cpu_kv_layout(dtype, block_size, head_size) == isa


def test_layout_probe_refuses_unknown_isa():
    with pytest.raises(NotImplementedError, match="amx"):
        cta.probe_cpu_kv_layout(torch.bfloat16, 32, 64, isa="amx")


def test_views_write_through(ops):
    """Writes through the views are what vLLM's own attention kernel reads."""
    torch.manual_seed(0)
    nb, h, d, n = 4, 2, 64, 70
    a = torch.zeros(nb, h, BLOCK, 2 * d)
    b = torch.zeros_like(a)
    k, v = torch.randn(n, h, d), torch.randn(n, h, d)
    slots = torch.randperm(nb * BLOCK)[:n]
    kc, vc = a.view(nb, h, 2 * BLOCK, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec")
    kview, vview = cta.cpu_kv_views(b)
    kview[slots // BLOCK, slots % BLOCK] = k
    vview[slots // BLOCK, slots % BLOCK] = v
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# A minimal Llama whose attention goes through vLLM's CPU cache
# ---------------------------------------------------------------------------
class MiniLlama:
    def __init__(self, path: str):
        from safetensors.torch import load_file

        self.cfg = json.loads((Path(path) / "config.json").read_text())
        self.w = load_file(str(Path(path) / "model.safetensors"))
        c = self.cfg
        self.num_layers = c["num_hidden_layers"]
        self.hq, self.hkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = c.get("head_dim") or c["hidden_size"] // self.hq
        self.theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 1e4))
        self.eps = c["rms_norm_eps"]
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Logits [T, V]; ``attend(layer, q, k, v)`` -> [T, Hq, D] (q, k rotated)."""
        W = self.w
        x = W["model.embed_tokens.weight"][tokens]
        cos, sin = rope_cos_sin(positions, self.d, self.theta)
        T = tokens.shape[0]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            hdn = rms_norm(x, W[p + "input_layernorm.weight"], self.eps)
            q = (hdn @ W[p + "self_attn.q_proj.weight"].T).view(T, self.hq, self.d)
            k = (hdn @ W[p + "self_attn.k_proj.weight"].T).view(T, self.hkv, self.d)
            v = (hdn @ W[p + "self_attn.v_proj.weight"].T).view(T, self.hkv, self.d)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            a = attend(i, q.contiguous(), k.contiguous(), v.contiguous())
            x = x + a.reshape(T, -1) @ W[p + "self_attn.o_proj.weight"].T
            hdn = rms_norm(x, W[p + "post_attention_layernorm.weight"], self.eps)
            mlp = F.silu(hdn @ W[p + "mlp.gate_proj.weight"].T) * (hdn @ W[p + "mlp.up_proj.weight"].T)
            x = x + mlp @ W[p + "mlp.down_proj.weight"].T
        return rms_norm(x, W["model.norm.weight"], self.eps) @ self.lm_head.T


class PagedCPUCache:
    """Per-layer CPU_ATTN caches plus one block table per request."""

    def __init__(self, model: MiniLlama, num_blocks: int, block_tables: list[list[int]]):
        self.kv = [torch.zeros(num_blocks, model.hkv, BLOCK, 2 * model.d)
                   for _ in range(model.num_layers)]
        width = max(len(b) for b in block_tables)
        self.block_table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables],
                                        dtype=torch.int32)
        self.scale = model.d ** -0.5
        self.hq = model.hq

    def slots(self, req: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        return (self.block_table[req, logical // BLOCK].long() * BLOCK + logical % BLOCK)

    def write(self, ops, layer, k, v, slot_mapping):
        kc, vc = self.kv[layer].view(*self.kv[layer].shape[:2], 2 * BLOCK, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slot_mapping, "vec")

    def causal(self, ops, layer, q, qsl, seq_lens):
        """vLLM's CPU causal attention (queries are each request's last tokens)."""
        kc, vc = self.kv[layer].view(*self.kv[layer].shape[:2], 2 * BLOCK, -1).chunk(2, dim=2)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=q.shape[1], num_kv_heads=kc.shape[1],
            head_dim=q.shape[2], seq_lens=seq_lens, dtype=q.dtype, query_start_loc=qsl,
            causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=self.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=self.block_table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
        return out


def run_causal(ops, model, cache, reqs, tokens, positions):
    """One causal step: request r gets ``tokens[r]`` at ``positions[r]`` (contiguous)."""
    toks = torch.cat(tokens)
    pos = torch.cat(positions)
    req = torch.cat([torch.full((len(t),), r) for r, t in zip(reqs, tokens)])
    slot_mapping = cache.slots(req, pos)
    lens = [len(t) for t in tokens]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([int(p[-1]) + 1 for p in positions], dtype=torch.int32)
    sub = _SubTable(cache, reqs)

    def attend(layer, q, k, v):
        cache.write(ops, layer, k, v, slot_mapping)
        return sub.causal(ops, layer, q, qsl, seq_lens)

    return model.forward(toks, pos, attend)


class _SubTable:
    """The cache restricted to some requests' block-table rows."""

    def __init__(self, cache, reqs):
        self.cache, self.reqs = cache, list(reqs)

    def causal(self, ops, layer, q, qsl, seq_lens):
        full = self.cache.block_table
        self.cache.block_table = full[self.reqs]
        try:
            return self.cache.causal(ops, layer, q, qsl, seq_lens)
        finally:
            self.cache.block_table = full


def run_tree_verify(ops, model, cache, trees: TreeBatch):
    """One verify forward over a batch of trees (all requests of the cache, in order)."""
    req = trees.request_index
    slot_mapping = cache.slots(req, trees.slots)  # flattened order: context_len + i
    positions = trees.positions                   # context_len + depth
    mask = trees.packed_mask()
    seq_lens = (trees.context_len + trees.sizes).to(torch.int32)

    def attend(layer, q, k, v):
        cache.write(ops, layer, k, v, slot_mapping)
        return cta.cpu_tree_attention(q, cache.kv[layer], cache.block_table, seq_lens,
                                      trees.cu_nodes, mask, cache.scale)

    return model.forward(trees.token, positions, attend)


# ---------------------------------------------------------------------------
# The verify forward equals each node's path run causally
# ---------------------------------------------------------------------------
PROMPT_LENS = (45, 29)
PARENTS = ([-1, 0, 0, 1, 1, 2, 3, 6, 0, 5, 3],   # depth up to 4, several branches
           [-1, 0, 1, 1, 0, 2, 5])


@pytest.fixture(scope="module")
def setup(pair, ops):
    torch.manual_seed(0)
    model = MiniLlama(pair[0])
    V = model.lm_head.shape[0]
    prompts = [torch.randint(1, V, (n,)) for n in PROMPT_LENS]
    tokens = []
    for parents in PARENTS:  # distinct child tokens per parent
        toks = [0] * len(parents)
        for i in range(1, len(parents)):
            toks[i] = int(torch.randint(1, V, ()))
            while toks[i] in [toks[j] for j in range(1, i) if parents[j] == parents[i]]:
                toks[i] = int(torch.randint(1, V, ()))
        tokens.append(toks)
    ctx = [n - 1 for n in PROMPT_LENS]
    for b, p in enumerate(prompts):
        tokens[b][0] = int(p[-1])  # root: the last committed token, not yet in the cache
    trees = TreeBatch.from_parents(PARENTS, tokens, context_len=ctx)
    # Shuffled physical blocks, disjoint per request, one spare block each.
    perm = torch.randperm(16).tolist()
    need = [(c + len(t)) // BLOCK + 2 for c, t in zip(ctx, tokens)]
    tables = [perm[:need[0]], perm[need[0]:need[0] + need[1]]]
    cache = PagedCPUCache(model, 16, tables)
    # Prefill the context with vLLM's causal kernel.
    run_causal(ops, model, cache, [0, 1], [p[:-1] for p in prompts],
               [torch.arange(c) for c in ctx])
    return model, cache, prompts, trees


@pytest.fixture(scope="module")
def hf_model(pair):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()


@torch.no_grad()
def hf_last_logits(hf, seq: list[int]) -> torch.Tensor:
    return hf(torch.tensor([seq])).logits[0, -1]


@torch.no_grad()
def test_verify_forward_matches_causal_paths(ops, setup, hf_model):
    model, cache, prompts, trees = setup
    logits = run_tree_verify(ops, model, cache, trees)
    assert logits.shape[0] == trees.total
    checked = 0
    for b in range(trees.num_requests):
        s = int(trees.cu_nodes[b])
        for i, path in enumerate(trees.paths(b)):
            seq = prompts[b].tolist() + list(path)  # prompt (root last) + drafted path
            ref = hf_last_logits(hf_model, seq)
            got = logits[s + i]
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4)
            assert int(got.argmax()) == int(ref.argmax())
            checked += 1
    assert checked == trees.total


@torch.no_grad()
def test_verify_forward_matches_vllm_causal_kernel(ops, setup):
    """Same check with vLLM's own causal CPU kernel as the reference: each
    node's path decoded causally in a fresh cache."""
    model, cache, prompts, trees = setup
    logits = run_tree_verify(ops, model, cache, trees)
    for b in range(trees.num_requests):
        s = int(trees.cu_nodes[b])
        for i, path in enumerate(trees.paths(b)):
            seq = torch.tensor(prompts[b].tolist() + list(path))
            fresh = PagedCPUCache(model, 8, [[3, 1, 6, 0, 2]])
            ref = run_causal(ops, model, fresh, [0], [seq], [torch.arange(len(seq))])[-1]
            torch.testing.assert_close(logits[s + i], ref, atol=ATOL, rtol=1e-4)


@torch.no_grad()
def test_compaction_then_causal_decode(ops, setup, hf_model):
    """Accept a path, compact the KV of every layer, then decode the bonus token
    with vLLM's causal kernel: it must see the accepted path at contiguous slots."""
    model, cache, prompts, trees = setup
    run_tree_verify(ops, model, cache, trees)  # (re)writes the tree K/V
    accepted = [[1, 3, 6, 7], []]              # request 0: depth 4; request 1: nothing
    num_acc = torch.tensor([len(a) for a in accepted])
    acc_nodes = torch.full((2, 4), -1, dtype=torch.int64)
    for b, a in enumerate(accepted):
        acc_nodes[b, :len(a)] = torch.tensor(a, dtype=torch.int64)
    ctx = trees.context_len
    cta.cpu_compact_kv(cache.kv, cache.block_table, ctx, num_acc, acc_nodes)

    bonus = [17, 23]
    toks, pos, seqs = [], [], []
    for b in range(2):
        s = int(trees.cu_nodes[b])
        path = [int(trees.token[s + i]) for i in accepted[b]]
        seqs.append(prompts[b].tolist() + path + [bonus[b]])
        toks.append(torch.tensor([bonus[b]]))
        pos.append(torch.tensor([int(ctx[b]) + 1 + len(path)]))
    logits = run_causal(ops, model, cache, [0, 1], toks, pos)
    for b in range(2):
        ref = hf_last_logits(hf_model, seqs[b])
        torch.testing.assert_close(logits[b], ref, atol=ATOL, rtol=1e-4)


def _random_tree_requests(g, B, nb, max_q, max_ctx, wide):
    """B requests of random trees for the batched-attention tests: query rows
    n (1..max_q-1), trailing tree keys tl (n, or wider when ``wide``, as in
    draft steps), contexts ctx, block tables over ``nb`` blocks, cu_q_lens
    and bit-packed masks (each row sees itself plus random other tree keys)."""
    from vllm_eagle_tree.core.tree import pack_bits

    n = torch.randint(1, max_q, (B,), generator=g)
    tl = n + torch.randint(0, 6, (B,), generator=g) * int(wide)
    ctx = torch.randint(0, max_ctx, (B,), generator=g)
    bt = torch.stack([torch.randperm(nb, generator=g)[:8] for _ in range(B)]).int()
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(n, 0)
    masks = []
    for b in range(B):
        m = torch.rand(int(n[b]), int(tl[b]), generator=g) < 0.5
        m[torch.arange(int(n[b])), int(tl[b]) - int(n[b]) + torch.arange(int(n[b]))] = True
        masks.append(pack_bits(torch.nn.functional.pad(m, (0, int(tl.max()) - int(tl[b])))))
    return tl, ctx, bt, cu, torch.cat(masks)



@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_cpu_compaction_equals_reference(seed, shared):
    """The CPU path's flat-row compaction moves exactly what the reference
    moves on the key and value views, in every layer, and nothing else
    (random paths over block boundaries, overlapping source and destination
    ranges, requests with nothing accepted, permuted block tables), layers
    in tensors of their own or, as vLLM allocates them, views of one buffer
    (with a gap between layers that must stay untouched)."""
    from vllm_eagle_tree.triton_kernels.kv_compaction import compact_kv_ref

    g = torch.Generator().manual_seed(seed)
    B, nb, h, bs, d, layers, D = 6, 48, 2, 16, 8, 3, 6
    if shared:
        size = nb * h * bs * 2 * d
        buf = torch.randn(layers * (size + 5), generator=g)
        caches = [buf[i * (size + 5):i * (size + 5) + size].view(nb, h, bs, 2 * d)
                  for i in range(layers)]
        before = buf.clone()
    else:
        caches = [torch.randn(nb, h, bs, 2 * d, generator=g) for _ in range(layers)]
    bt = torch.randperm(nb, generator=g).view(B, 8).to(torch.int32)  # requests own blocks
    ctx = torch.randint(0, 100, (B,), generator=g)
    num_acc = torch.randint(0, D + 1, (B,), generator=g)
    num_acc[seed % B] = 0
    nodes = torch.full((B, D), -1, dtype=torch.int64)
    for b in range(B):  # a root path: node indices increasing, each in a 12-node tree
        n = int(num_acc[b])
        nodes[b, :n] = torch.randperm(12, generator=g)[:n].sort().values + 1
    want = [c.clone() for c in caches]
    views = [cta.cpu_kv_views(c) for c in want]
    compact_kv_ref(([k for k, _ in views], [v for _, v in views]), bt, ctx, num_acc, nodes)
    assert any(not torch.equal(w, c) for w, c in zip(want, caches))  # something moved
    cta.cpu_compact_kv(caches, bt, ctx, num_acc, nodes)
    for w, c in zip(want, caches):
        assert torch.equal(w, c)
    if shared:
        gaps = torch.ones(buf.numel(), dtype=torch.bool)
        for i in range(layers):
            gaps[i * (size + 5):i * (size + 5) + size] = False
        assert torch.equal(buf[gaps], before[gaps])

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padded_tree_attention_equals_reference(seed):
    """The batched CPU path equals the per-request reference (random trees,
    GQA, contexts across block boundaries, trailing tree_lens wider than the
    queries as in draft steps)."""
    from vllm_eagle_tree.adapter.cpu_tree_attention import padded_tree_attention
    from vllm_eagle_tree.triton_kernels.tree_attention import tree_attention_ref

    g = torch.Generator().manual_seed(seed)
    B, page, hkv, group, d, nb = 5, 16, 2, 3, 8, 40
    kc = torch.randn(nb, page, hkv, d, generator=g)
    vc = torch.randn(nb, page, hkv, d, generator=g)
    tl, ctx, bt, cu, mask = _random_tree_requests(g, B, nb, max_q=9, max_ctx=70, wide=seed % 2)
    L = ctx + tl
    q = torch.randn(int(cu[-1]), hkv * group, d, generator=g)
    ref = tree_attention_ref(q, kc, vc, bt, L, cu, mask, 0.3, tree_lens=tl)
    got = padded_tree_attention(q, kc, vc, bt, L, cu, mask, 0.3, tree_lens=tl)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group, d, max_q, max_ctx", [(2, 64, 12, 90), (3, 36, 40, 60)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fused_cpu_op_equals_reference(seed, dtype, group, d, max_q, max_ctx):
    """The fused C++ op (cpu_tree_attention.cpp) on vLLM's CPU_ATTN cache
    layout equals the per-request reference and the PyTorch plan: random
    trees, GQA, contexts across block boundaries and empty contexts, tree_lens
    wider than the queries (draft steps), tree rows scattered among other rows
    of the query/output tensors, which it must leave untouched. The second
    shape: three query heads a KV head and a head size of 36 (neither a
    multiple of the op's four queries or eight lanes), trees of up to 39 rows
    (several row tiles of a request; masks over more than 32 tree keys)."""
    from vllm_eagle_tree.adapter.attention import TreeAttention
    from vllm_eagle_tree.triton_kernels.tree_attention import tree_attention_ref

    op = cta.load_cpu_tree_op()
    assert op is not None, "the fused CPU tree attention did not build (see the warning)"
    g = torch.Generator().manual_seed(seed)
    B, page, hkv, nb = 5, [16, 32][seed % 2], 2, 40
    kv = torch.randn(nb, hkv, page, 2 * d, generator=g).to(dtype)
    kc, vc = cta.cpu_kv_views(kv)
    tl, ctx, bt, cu, mask = _random_tree_requests(g, B, nb, max_q=max_q, max_ctx=max_ctx,
                                                  wide=seed % 2)
    ctx[0] = 0
    L = ctx + tl
    Q = int(cu[-1])
    N = Q + 7
    rows = torch.randperm(N, generator=g)[:Q].sort().values
    q = torch.randn(N, hkv * group, d, generator=g).to(dtype)
    ref = tree_attention_ref(q[rows].float(), kc.float(), vc.float(), bt, L, cu, mask, 0.3,
                             tree_lens=tl)
    attn = TreeAttention(rows=rows, cu_q_lens=cu, seq_lens=L.int(), tree_lens=tl.int(),
                         tree_mask=mask, block_table=bt)
    out = torch.full((N, hkv * group, d), 7.0, dtype=dtype)
    attn.attend(q, kv, 0.3, out)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert bool(((ctx + tl) <= bt.shape[1] * page).all())
    if max_q > 33:
        assert int((cu.diff() > 16).sum()) > 0 and mask.shape[1] > 1  # what the shape is for
    torch.testing.assert_close(out[rows].float(), ref, **tol)
    others = torch.ones(N, dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others] == 7.0)
    plan = cta.TreeAttentionPlan(bt, L, cu, mask, page, tl).attend(q[rows], kv, 0.3)
    torch.testing.assert_close(out[rows].float(), plan.float(), **tol)


def test_fused_cpu_op_can_be_switched_off(monkeypatch):
    """EAGLE_TREE_CPU_KERNEL=0 selects the PyTorch plan (same results)."""
    cta.load_cpu_tree_op.cache_clear()
    monkeypatch.setenv(cta.CPU_KERNEL_ENV, "0")
    try:
        assert cta.load_cpu_tree_op() is None
    finally:
        cta.load_cpu_tree_op.cache_clear()
