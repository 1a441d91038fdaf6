"""Lossless verification: exact enumeration, Monte Carlo chi-square, greedy, seeds."""
import math
import random
import zlib

import pytest
import torch

from vllm_eagle_tree.core import (TreeBatch, apply_sampling_params, draw_tokens,
                                  exponential_noise, verify, walk_chains, walk_trees)

scipy_stats = pytest.importorskip("scipy.stats")


# ----------------------------------------------------------------- helpers
def target_logits(seed, prefix, V, scale=1.5):
    """The target model: fixed random logits keyed by the token prefix."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed, tuple(prefix))).encode()))
    return (torch.randn(V, generator=g, dtype=torch.float64) * scale).float()


def brute_filter(logits, temp, k, p):
    """Independent python (float64) statement of the sampling semantics."""
    x = [float(v) for v in logits]
    V = len(x)
    if temp < 1e-5:
        m = max(x)
        out = [0.0] * V
        out[x.index(m)] = 1.0
        return out
    x = [v / temp for v in x]

    def softmax(z):
        m = max(z)
        e = [math.exp(v - m) if v != -math.inf else 0.0 for v in z]
        s = sum(e)
        return [v / s for v in e]

    if 0 < k < V:
        kth = sorted(x, reverse=True)[k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if p < 1.0:
        probs = softmax(x)
        order = sorted(range(V), key=lambda i: -x[i])
        mass, n_keep = 0.0, 0
        for i in order:
            if mass < p:
                n_keep += 1
                mass += probs[i]
        last = x[order[max(n_keep, 1) - 1]]
        x = [v if v >= last else -math.inf for v in x]
    return softmax(x)


def random_tree(rng, n, V, max_depth=4):
    """Random tree with distinct child tokens chosen uniformly (often unlikely ones)."""
    parents, tokens, depth = [-1], [rng.randrange(V)], [0]
    kids = {0: set()}
    while len(parents) < n:
        p = rng.randrange(len(parents))
        if depth[p] >= max_depth or len(kids[p]) >= V:
            continue
        t = rng.choice([x for x in range(V) if x not in kids[p]])
        kids[p].add(t)
        kids[len(parents)] = set()
        parents.append(p)
        tokens.append(t)
        depth.append(depth[p] + 1)
    return parents, tokens


def guided_tree(rng, n, V, seed, temp, k, p, max_depth=3, guided=0.7):
    """Random tree whose children are often the target's likely tokens.

    With probability ``guided`` a new child takes the most likely (filtered
    target) token not yet a child of its parent, else a uniformly random one,
    so the walk both goes deep and stops at unlikely children.
    """
    root = rng.randrange(V)
    parents, tokens, depth, paths, reach = [-1], [root], [0], [()], [1.0]
    kids = {0: set()}
    while len(parents) < n:
        if rng.random() < guided:  # grow where the walk is likely to be
            par = rng.choices(range(len(parents)), weights=[r + 1e-3 for r in reach])[0]
        else:
            par = rng.randrange(len(parents))
        free = [x for x in range(V) if x not in kids[par]]
        if depth[par] >= max_depth or not free:
            continue
        q = brute_filter(target_logits(seed, (root,) + paths[par], V).tolist(), temp, k, p)
        if rng.random() < guided:
            t = max(free, key=lambda x: (q[x], -x))
        else:
            t = rng.choice(free)
        kids[par].add(t)
        kids[len(parents)] = set()
        parents.append(par)
        tokens.append(t)
        depth.append(depth[par] + 1)
        paths.append(paths[par] + (t,))
        reach.append(reach[par] * q[t])
    return parents, tokens


def tree_logits(tree, seed, V):
    """Target logits for every node: the target at the node's path (root included)."""
    rows = []
    for b in range(tree.num_requests):
        s = int(tree.cu_nodes[b])
        root = int(tree.token[s])
        for path in tree.paths(b):
            rows.append(target_logits(seed, (root,) + path, V))
    return torch.stack(rows)


def exact_tree_outcomes(tree, probs):
    """Enumerate the walk of a single-request tree: {(last node, bonus): prob}.

    P = product over visited nodes of the (filtered) target probability of the
    token that moves on, times the last node's probability of the bonus token.
    """
    probs = probs.double()
    par, tok = tree.parent.tolist(), tree.token.tolist()
    n, V = probs.shape
    children = [[] for _ in range(n)]
    for i in range(1, n):
        children[par[i]].append(i)
    reach = [1.0] + [0.0] * (n - 1)
    for i in range(1, n):
        reach[i] = reach[par[i]] * float(probs[par[i], tok[i]])
    out = {}
    for i in range(n):
        child_tokens = {tok[c] for c in children[i]}
        for t in range(V):
            if t not in child_tokens:
                out[(i, t)] = reach[i] * float(probs[i, t])
    return out


def sequential_distribution(seed, root, tree_paths, V, temp, k, p):
    """Sequential sampling from the target: {emitted sequence: prob}.

    Sample token after token from the filtered target at the current prefix;
    stop (the token is emitted, then the step ends) as soon as the prefix is no
    longer a tree path. Uses only the target function and brute_filter.
    """
    paths = set(tree_paths)
    out = {}

    def rec(prefix, prob):
        q = brute_filter(target_logits(seed, (root,) + prefix, V).tolist(), temp, k, p)
        for t in range(V):
            if q[t] == 0.0:
                continue
            nxt = prefix + (t,)
            if nxt in paths:
                rec(nxt, prob * q[t])
            else:
                out[nxt] = out.get(nxt, 0.0) + prob * q[t]

    rec((), 1.0)
    return out


CONFIGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),
    (1.7, -1, 1.0),
    (1.0, 3, 1.0),
    (1.0, 0, 0.7),
    (0.8, 4, 0.9),
    (1.3, 3, 0.6),
    (0.5, 5, 0.8),
]


# -------------------------------------------------------------- exactness
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_exact_enumeration_equals_sequential_sampling(ci):
    temp, k, p = CONFIGS[ci]
    for trial in range(3):
        rng = random.Random(100 * ci + trial)
        V = rng.choice([5, 6, 8])
        seed = 1000 * ci + trial
        if trial == 0:
            parents, tokens = random_tree(rng, rng.randrange(2, 14), V)
        else:
            parents, tokens = guided_tree(rng, rng.randrange(4, 14), V, seed, temp, k, p,
                                          max_depth=4)
        tree = TreeBatch.from_parents([parents], [tokens], context_len=[rng.randrange(50)])
        logits = tree_logits(tree, seed, V)
        n = tree.total
        probs = apply_sampling_params(logits, torch.full((n,), temp), torch.full((n,), k),
                                      torch.full((n,), p))
        # apply_sampling_params agrees with the independent statement row by row.
        for i in range(n):
            expect = brute_filter(logits[i].tolist(), temp, k, p)
            assert torch.allclose(probs[i].double(), torch.tensor(expect, dtype=torch.float64),
                                  atol=1e-6, rtol=0)
        outcomes = exact_tree_outcomes(tree, probs)
        paths = tree.paths(0)
        joint = {}
        for (i, t), pr in outcomes.items():
            seq = paths[i] + (t,)
            joint[seq] = joint.get(seq, 0.0) + pr
        seq_dist = sequential_distribution(seed, tokens[0], paths[1:], V, temp, k, p)
        assert abs(sum(joint.values()) - 1.0) < 1e-6
        keys = set(joint) | set(seq_dist)
        for key in keys:
            assert abs(joint.get(key, 0.0) - seq_dist.get(key, 0.0)) < 1e-6, key
        # (number accepted, sequence): len(seq) - 1 accepted, and they are the tree's path.
        for (i, t) in outcomes:
            assert len(paths[i] + (t,)) - 1 == int(tree.depth[i])


def chi_square_against_exact(tree, logits, temp, k, p, draws=100_000, seed=0):
    """Run verify() on `draws` copies of a one-request tree; chi-square vs exact."""
    big = tree.repeat(draws)
    big_logits = logits.repeat(draws, 1)
    torch.manual_seed(seed)
    res = verify(big, big_logits, torch.full((draws,), temp), torch.full((draws,), k),
                 torch.full((draws,), p))
    return chi_square_of_results(res, torch.arange(draws), tree, logits, temp, k, p)


def chi_square_of_results(res, rows, tree, logits, temp, k, p):
    """Chi-square p-value of the outcomes of requests ``rows`` (copies of ``tree``)."""
    n, V = logits.shape
    draws = len(rows)
    probs = apply_sampling_params(logits, torch.full((n,), temp), torch.full((n,), k),
                                  torch.full((n,), p))
    exact = exact_tree_outcomes(tree, probs)
    expected = torch.zeros(n * V, dtype=torch.float64)
    for (i, t), pr in exact.items():
        expected[i * V + t] = pr
    na = res.num_accepted[rows]
    nodes = res.accepted_nodes[rows]
    last = torch.where(na > 0, nodes.gather(1, (na - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0)
    # Accepted tokens are the tree tokens along the path of the last node.
    paths = tree.paths(0)
    for j in range(0, draws, 9973):
        b = int(rows[j])
        assert res.accepted_tokens[b, :int(na[j])].tolist() == list(paths[int(last[j])])
    counts = torch.bincount(last * V + res.bonus_token[rows], minlength=n * V).double()
    assert int(counts.sum()) == draws
    # Impossible outcomes (filtered tokens, a child's token as bonus) never happen.
    assert counts[expected == 0].sum() == 0
    exp_counts = expected * draws
    big_bins = exp_counts >= 5
    # The case must be informative: several likely outcomes, deep acceptance.
    assert int(big_bins.sum()) >= 4
    assert float((na >= 2).double().mean()) > 0.05
    obs = torch.cat([counts[big_bins], counts[~big_bins & (expected > 0)].sum().reshape(1)])
    ex = torch.cat([exp_counts[big_bins], exp_counts[~big_bins & (expected > 0)].sum().reshape(1)])
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    ex = ex * (obs.sum() / ex.sum())  # float rounding only
    if len(obs) < 2:
        return 1.0
    return float(scipy_stats.chisquare(obs.numpy(), ex.numpy()).pvalue)


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_verify_monte_carlo_chi_square(ci):
    temp, k, p = CONFIGS[ci]
    rng = random.Random(17 + ci)
    V = 8
    parents, tokens = guided_tree(rng, 12, V, 555 + ci, temp, k, p, max_depth=3, guided=0.6)
    tree = TreeBatch.from_parents([parents], [tokens])
    logits = tree_logits(tree, 555 + ci, V)
    pv = chi_square_against_exact(tree, logits, temp, k, p, seed=ci)
    assert pv > 1e-3, pv


def test_verify_mixed_batch_per_request_params():
    """One batch, two trees with different sizes and sampling params, interleaved."""
    V, R = 8, 50_000
    cfgs = [CONFIGS[3], CONFIGS[5]]  # (1.0, k=3) and (0.8, k=4, p=0.9)
    trees, logits = [], []
    for i, (temp, k, p) in enumerate(cfgs):
        rng = random.Random(17 + [3, 5][i])
        parents, tokens = guided_tree(rng, [12, 7][i], V, 901 + i, temp, k, p, max_depth=3, guided=0.6)
        trees.append(TreeBatch.from_parents([parents], [tokens]))
        logits.append(tree_logits(trees[-1], 901 + i, V))
    big = TreeBatch.cat(trees).repeat(R)
    big_logits = torch.cat(logits).repeat(R, 1)
    temp = torch.tensor([c[0] for c in cfgs]).repeat(R)
    k = torch.tensor([c[1] for c in cfgs]).repeat(R)
    p = torch.tensor([c[2] for c in cfgs]).repeat(R)
    torch.manual_seed(5)
    res = verify(big, big_logits, temp, k, p)
    for i, (t, kk, pp) in enumerate(cfgs):
        pv = chi_square_of_results(res, torch.arange(i, 2 * R, 2), trees[i], logits[i], t, kk, pp)
        assert pv > 1e-3, (i, pv)


def test_monte_carlo_catches_a_biased_walk():
    """Sanity check of the harness: a walk that reuses the root's draw fails."""
    V = 6
    tree = TreeBatch.from_parents([[-1, 0, 1, 0]], [[0, 2, 3, 4]])
    logits = torch.zeros(4, V)
    logits[0, 2] = 1.0
    logits[1, 3] = 1.0
    draws, n = 100_000, 4
    big = tree.repeat(draws)
    torch.manual_seed(1)
    probs = apply_sampling_params(logits.repeat(draws, 1), torch.ones(draws * n),
                                  torch.zeros(draws * n), torch.ones(draws * n))
    noise = exponential_noise(big.cu_nodes, V, [None] * draws)
    d = draw_tokens(logits.repeat(draws, 1), probs, noise, torch.zeros(draws * n, dtype=torch.bool))
    # Biased: node 1 reuses node 0's noise (correlated draws).
    d_biased = d.clone().view(draws, n)
    d_biased[:, 1] = (probs.view(draws, n, V)[:, 1] / noise.view(draws, n, V)[:, 0]).argmax(-1)
    res = walk_trees(d_biased.view(-1), big)
    exact = exact_tree_outcomes(tree, probs[:n])
    na = res.num_accepted
    last = torch.where(na > 0, res.accepted_nodes.gather(1, (na - 1).clamp(min=0).unsqueeze(1))
                       .squeeze(1), 0)
    counts = torch.bincount(last * V + res.bonus_token, minlength=n * V).double()
    expected = torch.zeros(n * V, dtype=torch.float64)
    for (i, t), pr in exact.items():
        expected[i * V + t] = pr
    keep = expected * draws >= 5
    pv = scipy_stats.chisquare(counts[keep].numpy(),
                               (expected[keep] * counts[keep].sum() / expected[keep].sum()).numpy()).pvalue
    assert pv < 1e-6


# ------------------------------------------------------------------ greedy
def test_greedy_returns_argmax_path():
    V = 8
    # Root 0; its children 1 (token 3), 2 (token 5); node 1's children 3 (token 6), 4 (token 1);
    # node 3's child 5 (token 2).
    tree = TreeBatch.from_parents([[-1, 0, 0, 1, 1, 3], [-1, 0]], [[7, 3, 5, 6, 1, 2], [4, 0]])
    logits = torch.randn(8, V)
    argmax = {0: 3, 1: 6, 3: 4, 6: 5}  # row -> argmax token
    for row, t in argmax.items():
        logits[row, t] = 10.0
    res = verify(tree, logits, torch.tensor([0.0, 0.0]), torch.tensor([2, 0]),
                 torch.tensor([0.5, 1.0]))
    # Request 0: root argmax 3 -> node 1; argmax 6 -> node 3; argmax 4 is not node 5's token 2.
    assert res.num_accepted.tolist() == [2, 0]
    assert res.accepted_nodes.tolist() == [[1, 3, -1], [-1, -1, -1]]
    assert res.accepted_tokens.tolist() == [[3, 6, -1], [-1, -1, -1]]
    assert res.bonus_token.tolist() == [4, 5]  # request 1: row 6's argmax 5 is not child token 0
    assert res.emitted(0) == [3, 6, 4]
    # Greedy ignores generators and repeats exactly.
    g = [torch.Generator().manual_seed(1), None]
    res2 = verify(tree, logits, torch.tensor([1e-6, 0.0]), torch.tensor([0, 0]),
                  torch.tensor([1.0, 1.0]), g)
    assert torch.equal(res2.bonus_token, res.bonus_token)
    assert torch.equal(res2.accepted_nodes, res.accepted_nodes)


def test_greedy_ties_take_first_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    probs = apply_sampling_params(logits, torch.zeros(1), torch.zeros(1), torch.ones(1))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    d = draw_tokens(logits, probs, torch.ones(1, 4), torch.tensor([True]))
    assert d.tolist() == [1]


# ------------------------------------------------------------------- walk
@pytest.mark.parametrize("length", [1, 2, 4, 7])
def test_walk_chains_equals_walk_trees(length):
    """The chain arms' walk gives walk_trees' result exactly: draws that match
    the chain for a random number of depths, then anything."""
    g = torch.Generator().manual_seed(length)
    for _ in range(30):
        B = int(torch.randint(1, 9, (1,), generator=g))
        tok = torch.randint(0, 5, (B, length), generator=g)
        draws = torch.randint(0, 5, (B, length), generator=g)
        for b in range(B):  # match a random prefix, so that long accepts occur
            m = int(torch.randint(0, length, (1,), generator=g))
            draws[b, :m] = tok[b, 1:m + 1]
        tree = TreeBatch.from_parents([[-1] + list(range(length - 1))] * B, tok.tolist())
        want, got = walk_trees(draws.reshape(-1), tree), walk_chains(draws.reshape(-1), tree, length)
        for f in ("num_accepted", "accepted_nodes", "accepted_tokens", "bonus_token"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f
    with pytest.raises(ValueError, match="not 2 chains of 3"):
        walk_chains(torch.zeros(4), TreeBatch.from_parents([[-1, 0]] * 2, [[1, 2]] * 2), 3)


def test_verify_with_chain_length_is_verify():
    """verify(..., chain_length=) draws the same tokens (same noise, seeded
    generators) and accepts the same paths, greedy and sampled."""
    B, n, V = 5, 4, 6
    g = torch.Generator().manual_seed(0)
    tree = TreeBatch.from_parents([[-1, 0, 1, 2]] * B,
                                  torch.randint(0, V, (B, n), generator=g).tolist())
    logits = torch.randn(B * n, V, generator=g) * 3
    for temp in (0.0, 0.7):
        t = torch.full((B,), temp)
        k, p = torch.zeros(B, dtype=torch.int64), torch.ones(B)
        a = verify(tree, logits, t, k, p, [torch.Generator().manual_seed(b) for b in range(B)])
        c = verify(tree, logits, t, k, p, [torch.Generator().manual_seed(b) for b in range(B)],
                   chain_length=n)
        for f in ("num_accepted", "accepted_nodes", "accepted_tokens", "bonus_token"):
            assert torch.equal(getattr(a, f), getattr(c, f)), (temp, f)


def test_walk_trees_handmade():
    tree = TreeBatch.from_parents(
        [[-1, 0, 0, 1, 2, 4], [-1], [-1, 0, 1, 2]],
        [[9, 1, 2, 3, 1, 4], [5], [6, 7, 8, 9]], context_len=[10, 20, 30])
    # Request 0: root draws 2 -> node 2; node 2 draws 1 -> node 4; node 4 draws 4 -> node 5;
    # node 5 draws 0 (leaf) -> bonus 0. Request 1: root only. Request 2: root draws 7 -> node 1,
    # node 1 draws 3 (not 8) -> bonus 3.
    draws = torch.tensor([2, 0, 1, 0, 4, 0,  11,  7, 3, 0, 0])
    res = walk_trees(draws, tree)
    assert res.num_accepted.tolist() == [3, 0, 1]
    assert res.accepted_nodes.tolist() == [[2, 4, 5], [-1, -1, -1], [1, -1, -1]]
    assert res.accepted_tokens.tolist() == [[2, 1, 4], [-1, -1, -1], [7, -1, -1]]
    assert res.bonus_token.tolist() == [0, 11, 3]
    # KV compaction: the accepted node at depth d sits at index >= d.
    for b in range(3):
        for d, i in enumerate(res.accepted_nodes[b, :int(res.num_accepted[b])].tolist(), 1):
            assert i >= d


# ----------------------------------------------------------- sampling params
def test_sampling_params_ties_and_rows():
    logits = torch.tensor([
        [3.0, 2.0, 2.0, 1.0],   # top-k 2: the tie at the 2nd value keeps 3 tokens
        [2.0, 2.0, 1.0, 0.0],   # top-p 0.3: token 0 reaches it, tied token 1 kept too
        [0.0, 1.0, 2.0, 3.0],   # top-k 1
        [0.0, 1.0, 2.0, 3.0],   # k >= V and k <= 0 are off, p = 1 is off
        [0.0, 1.0, 2.0, 3.0],
    ])
    temp = torch.tensor([1.0, 1.0, 0.5, 1.0, 2.0])
    k = torch.tensor([2, 0, 1, 4, -1])
    p = torch.tensor([1.0, 0.3, 1.0, 1.0, 1.0])
    probs = apply_sampling_params(logits, temp, k, p)
    assert (probs[0] > 0).tolist() == [True, True, True, False]
    assert (probs[1] > 0).tolist() == [True, True, False, False]
    assert probs[2].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert torch.allclose(probs[3], torch.softmax(logits[3], -1))
    assert torch.allclose(probs[4], torch.softmax(logits[4] / 2, -1))
    for i in range(5):
        expect = brute_filter(logits[i].tolist(), float(temp[i]), int(k[i]), float(p[i]))
        assert torch.allclose(probs[i].double(), torch.tensor(expect, dtype=torch.float64), atol=1e-7)
    # top-p keeps the smallest set reaching p: probs 0.5, 0.3, 0.2 with p = 0.8 keeps 2,
    # with p = 0.81 keeps 3; a tiny p keeps exactly one token.
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3))
    pr = apply_sampling_params(lg, torch.ones(3), torch.zeros(3), torch.tensor([0.79, 0.81, 1e-9]))
    assert (pr > 0).sum(-1).tolist() == [2, 3, 1]


def test_sampling_params_match_vllm_pytorch_path():
    """Cross-check against vLLM 0.32's apply_top_k_top_p_pytorch (tie-free logits)."""
    tk = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(0)
    T, V = 64, 50
    logits = torch.randn(T, V, generator=g) * 3
    temp = torch.rand(T, generator=g) * 1.5 + 0.3
    k = torch.randint(-2, V + 3, (T,), generator=g)
    p = torch.where(torch.rand(T, generator=g) < 0.3, 1.0, torch.rand(T, generator=g) * 0.95 + 0.02)
    ours = apply_sampling_params(logits, temp, k, p)
    x = logits / temp.unsqueeze(1)
    k_vllm = torch.where((k > 0) & (k < V), k, V)  # vLLM stores "off" as vocab_size
    ref = tk.apply_top_k_top_p_pytorch(x.clone(), k_vllm.to(torch.int32), p)
    assert torch.allclose(ours, torch.softmax(ref, -1), atol=1e-6)
    assert torch.equal(ours > 0, torch.softmax(ref, -1) > 0)


# ------------------------------------------------------------------- seeds
def test_per_request_seeds_reproduce_exactly():
    V = 8
    rng = random.Random(3)
    trees = [random_tree(rng, n, V) for n in (6, 9, 4)]
    tree = TreeBatch.from_parents([t[0] for t in trees], [t[1] for t in trees])
    logits = torch.randn(tree.total, V)
    temp, k, p = torch.tensor([1.0, 0.7, 1.2]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 0.9, 0.8])

    def gens(seeds):
        return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

    noise = exponential_noise(tree.cu_nodes, V, gens([11, 22, 33]))
    for b, s in enumerate([11, 22, 33]):
        lo, hi = int(tree.cu_nodes[b]), int(tree.cu_nodes[b + 1])
        want = torch.empty(hi - lo, V).exponential_(generator=torch.Generator().manual_seed(s))
        assert torch.equal(noise[lo:hi], want)
    runs = []
    for _ in range(2):
        runs.append(verify(tree, logits, temp, k, p, gens([11, 22, 33])))
    for f in ("num_accepted", "accepted_nodes", "accepted_tokens", "bonus_token"):
        assert torch.equal(getattr(runs[0], f), getattr(runs[1], f))
    # Request 1 alone, or next to unseeded requests, draws exactly the same.
    draws_all = []
    for seeds, order in (([22], [1]), ([None, 22, None], [0, 1, 2]), ([22, 5], [1, 0])):
        sub = TreeBatch.cat([tree.request(b) for b in order])
        sub_logits = torch.cat([logits[int(tree.cu_nodes[b]):int(tree.cu_nodes[b + 1])] for b in order])
        res = verify(sub, sub_logits, temp[order], k[order], p[order], gens(seeds))
        j = order.index(1)
        draws_all.append((res.accepted_nodes[j].tolist(), int(res.bonus_token[j])))
    assert draws_all[0] == draws_all[1] == draws_all[2]
    assert draws_all[0][1] == int(runs[0].bonus_token[1])


def test_seeds_change_draws():
    """Different seeds give different draws (the generator is really used)."""
    V, R = 8, 64
    tree = TreeBatch.from_parents([[-1]], [[0]]).repeat(R)
    logits = torch.zeros(R, V)
    a = verify(tree, logits, torch.ones(R), torch.zeros(R), torch.ones(R),
               [torch.Generator().manual_seed(i) for i in range(R)])
    b = verify(tree, logits, torch.ones(R), torch.zeros(R), torch.ones(R),
               [torch.Generator().manual_seed(1000 + i) for i in range(R)])
    assert not torch.equal(a.bonus_token, b.bonus_token)
    c = verify(tree, logits, torch.ones(R), torch.zeros(R), torch.ones(R),
               [torch.Generator().manual_seed(i) for i in range(R)])
    assert torch.equal(a.bonus_token, c.bonus_token)
