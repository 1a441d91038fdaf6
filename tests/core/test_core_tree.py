"""TreeBatch: masks, positions and packed bits against brute force; prefixes; validation."""
import random

import pytest
import torch

from vllm_eagle_tree.core import TreeBatch, pack_bits


def random_tree(rng: random.Random, n: int, vocab: int = 1000):
    """Random parents-first parent list with distinct child tokens."""
    parents, tokens = [-1], [rng.randrange(vocab)]
    used: dict[int, set] = {}
    for i in range(1, n):
        p = rng.randrange(i) if rng.random() < 0.7 else max(0, i - 1)  # mix bushy and deep
        t = rng.randrange(vocab)
        while t in used.setdefault(p, set()):
            t = rng.randrange(vocab)
        used[p].add(t)
        parents.append(p)
        tokens.append(t)
    return parents, tokens


def random_batch(seed: int, sizes):
    rng = random.Random(seed)
    ps, ts = zip(*(random_tree(rng, n) for n in sizes))
    ctx = [rng.randrange(0, 500) for _ in sizes]
    return TreeBatch.from_parents(list(ps), list(ts), context_len=ctx), list(ps), list(ts), ctx


def brute_ancestors(parents):
    n = len(parents)
    m = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            m[i][j] = True
            j = parents[j]
    return m


def brute_depth(parents):
    out = []
    for i in range(len(parents)):
        d, j = 0, parents[i]
        while j >= 0:
            d, j = d + 1, parents[j]
        out.append(d)
    return out


def brute_packed(m, n_max):
    w = (n_max + 31) // 32
    rows = []
    for row in m:
        words = []
        for k in range(w):
            v = 0
            for b in range(32):
                j = 32 * k + b
                if j < len(row) and row[j]:
                    v |= 1 << b
            if v >= 2**31:
                v -= 2**32
            words.append(v)
        rows.append(words)
    return rows


SIZE_SETS = [
    [1],
    [5],
    [1, 2, 3],
    [31, 32, 33],
    [64, 1, 65, 7],
    [63, 96, 97, 2, 40],
]


@pytest.mark.parametrize("sizes", SIZE_SETS)
@pytest.mark.parametrize("seed", [0, 1])
def test_masks_positions_packed_match_bruteforce(sizes, seed):
    tree, ps, ts, ctx = random_batch(seed * 100 + len(sizes), sizes)
    assert tree.cu_nodes.tolist() == [0] + list(torch.cumsum(torch.tensor(sizes), 0).tolist())
    assert tree.cu_nodes.dtype == torch.int32 and tree.context_len.dtype == torch.int32
    n_max = max(sizes)
    total = sum(sizes)
    block = torch.zeros(total, total, dtype=torch.bool)
    dense = torch.zeros(len(sizes), n_max, n_max, dtype=torch.bool)
    packed_rows, positions, depths = [], [], []
    off = 0
    for b, p in enumerate(ps):
        m = brute_ancestors(p)
        n = len(p)
        mt = torch.tensor(m, dtype=torch.bool)
        dense[b, :n, :n] = mt
        block[off:off + n, off:off + n] = mt
        packed_rows += brute_packed(m, n_max)
        d = brute_depth(p)
        depths += d
        positions += [ctx[b] + x for x in d]
        assert torch.equal(tree.ancestor_mask(b), mt)
        assert tree.paths(b)[-1] == tuple(ts[b][j] for j in sorted(
            j for j in range(1, n) if m[n - 1][j]))
        off += n
    assert tree.depth.tolist() == depths
    assert tree.positions.tolist() == positions
    assert torch.equal(tree.ancestor_masks(), dense)
    assert torch.equal(tree.block_mask(), block)
    packed = tree.packed_mask()
    assert packed.dtype == torch.int32
    assert packed.shape == (total, (n_max + 31) // 32)
    assert packed.tolist() == packed_rows
    # pack_bits of the dense per-node rows gives the same words.
    rows = dense[tree.request_index, tree.local_index]
    assert torch.equal(pack_bits(rows), packed)
    # Test bits the way a kernel does: (word >> b) & 1.
    j = torch.arange(n_max)
    bits = (packed[:, j // 32] >> (j % 32)) & 1
    assert torch.equal(bits.bool(), rows)
    # Slots are context_len + flattened local index (not depth).
    assert tree.slots.tolist() == [ctx[b] + i for b, n in enumerate(sizes) for i in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_ancestor_closure(seed):
    tree, ps, _, _ = random_batch(seed, [40, 70, 3])
    m = tree.block_mask()
    gpar = tree.global_parent
    for i in range(tree.total):
        p = int(gpar[i])
        expect = torch.zeros(tree.total, dtype=torch.bool)
        expect[i] = True
        if p >= 0:
            expect |= m[p]
        assert torch.equal(m[i], expect)
    # Ancestors of an ancestor are ancestors (transitive closure).
    mi = m.int()
    assert torch.equal(((mi @ mi) > 0), m)


@pytest.mark.parametrize("seed", range(3))
def test_every_prefix_is_valid(seed):
    rng = random.Random(seed)
    sizes = [1, 33, 66, 10]
    tree, ps, ts, ctx = random_batch(seed + 50, sizes)
    full = tree.ancestor_masks()
    for _ in range(20):
        cut = [rng.randint(1, n) for n in sizes]
        sub = tree.prefix(cut).validate()
        assert sub.sizes.tolist() == cut
        for b, n in enumerate(cut):
            assert torch.equal(sub.ancestor_mask(b), full[b, :n, :n])
            assert sub.paths(b) == tree.paths(b)[:n]
        expect = TreeBatch.from_parents([p[:n] for p, n in zip(ps, cut)],
                                        [t[:n] for t, n in zip(ts, cut)], ctx)
        assert torch.equal(sub.packed_mask(), expect.packed_mask())
        assert torch.equal(sub.positions, expect.positions)
    # Each single-node prefix as well.
    for b, n in enumerate(sizes):
        for m in range(1, n + 1):
            cut = list(sizes)
            cut[b] = m
            tree.prefix(cut).validate()
    with pytest.raises(ValueError, match="prefix sizes"):
        tree.prefix([0, 1, 1, 1])
    with pytest.raises(ValueError, match="prefix sizes"):
        tree.prefix([2, 1, 1, 1])


def test_views_children_cat_repeat():
    tree = TreeBatch.from_parents([[-1, 0, 0, 1, 1, 2], [-1, 0]],
                                  [[9, 1, 2, 3, 4, 5], [7, 8]], context_len=[4, 2])
    assert tree.children(0, 0) == [1, 2]
    assert tree.children(0, 1) == [3, 4]
    assert tree.children(0, 5) == []
    assert tree.children_lists() == [[[1, 2], [3, 4], [5], [], [], []], [[1], []]]
    r1 = tree.request(1)
    assert r1.token.tolist() == [7, 8] and r1.context_len.tolist() == [2]
    assert r1.positions.tolist() == [2, 3]
    both = TreeBatch.cat([tree.request(1), tree.request(0)]).validate()
    assert both.cu_nodes.tolist() == [0, 2, 8]
    assert both.token.tolist() == [7, 8, 9, 1, 2, 3, 4, 5]
    rep = tree.repeat(3).validate()
    assert rep.num_requests == 6 and rep.total == 24
    assert torch.equal(rep.packed_mask()[8:16], tree.packed_mask())
    assert tree.max_depth == 2 and tree.max_size == 6


@pytest.mark.parametrize("parents,tokens,msg", [
    ([[0, 0]], [[1, 2]], "root and must have parent -1"),
    ([[-1, 1]], [[1, 2]], "parents must come first"),
    ([[-1, 0, 3, 0]], [[1, 2, 3, 4]], "parents must come first"),
    ([[-1, 0, 0]], [[1, 5, 5]], "two children with token 5"),
    ([[-1, 0], []], [[1, 2], []], "at least its root"),
    ([[-1, 0]], [[1]], "2 parents but 1 tokens"),
])
def test_from_parents_errors(parents, tokens, msg):
    with pytest.raises(ValueError, match=msg):
        TreeBatch.from_parents(parents, tokens)


def test_validate_errors():
    good = TreeBatch.from_parents([[-1, 0, 1], [-1, 0, 0]], [[1, 2, 3], [4, 5, 6]])

    def broken(**kw):
        t = TreeBatch(**{f: getattr(good, f).clone() for f in
                         ("cu_nodes", "token", "parent", "depth", "value", "context_len")})
        for name, fn in kw.items():
            fn(getattr(t, name))
        return t

    with pytest.raises(ValueError, match=r"request 0: node 2 has depth 1 but its parent 1 has depth 1"):
        broken(depth=lambda d: d.__setitem__(2, 1)).validate()
    with pytest.raises(ValueError, match="request 1: node 0 is the root"):
        broken(parent=lambda p: p.__setitem__(3, 0)).validate()
    with pytest.raises(ValueError, match="request 0: node 2 has parent 2; parents must come first"):
        broken(parent=lambda p: p.__setitem__(2, 2)).validate()
    with pytest.raises(ValueError, match="request 1: node 0 has two children with token 5"):
        broken(token=lambda t: t.__setitem__(5, 5)).validate()
    with pytest.raises(ValueError, match="root depth must be 0"):
        broken(depth=lambda d: d.__setitem__(3, 1)).validate()
    with pytest.raises(ValueError, match="every tree needs its root"):
        broken(cu_nodes=lambda c: c.__setitem__(1, 0)).validate()
    with pytest.raises(ValueError, match="context_len must be >= 0"):
        broken(context_len=lambda c: c.__setitem__(0, -1)).validate()
    bad = broken()
    bad.value = bad.value[:-1]
    with pytest.raises(ValueError, match="value must be 1-D of length"):
        bad.validate()
    # A tree whose children share a token under different parents is fine.
    TreeBatch.from_parents([[-1, 0, 0, 1, 2]], [[1, 2, 3, 7, 7]])


@pytest.mark.parametrize("seed", range(6))
def test_from_parents_checks_what_validate_checks(seed):
    """from_parents checks in one Python pass (it runs every engine step) and
    does not re-run validate(): every batch it builds passes validate(), and a
    duplicate child token or a negative context is refused by both alike."""
    tree, ps, ts, ctx = random_batch(seed, [1, 2, 7, 20, 33])
    tree.validate()
    b = 4
    kids = [i for i, p in enumerate(ps[b]) if p == 0]
    assert len(kids) >= 2
    dup = [list(t) for t in ts]
    dup[b][kids[-1]] = dup[b][kids[0]]
    msg = f"request {b}: node 0 has two children with token {dup[b][kids[0]]}"
    with pytest.raises(ValueError, match=msg):
        TreeBatch.from_parents(ps, dup, context_len=ctx)
    bad = TreeBatch(tree.cu_nodes, torch.tensor([x for t in dup for x in t]), tree.parent,
                    tree.depth, tree.value, tree.context_len)
    with pytest.raises(ValueError, match=msg):
        bad.validate()
    with pytest.raises(ValueError, match="context_len must be >= 0"):
        TreeBatch.from_parents(ps, ts, context_len=[-1] + ctx[1:])
