"""EAGLE-2 expander vs brute force and a port of the reference; adaptive rules."""
import math
import zlib

import pytest
import torch

from vllm_eagle_tree.core import Frontier, TreeConfig, expand_tree, expand_tree_detailed


class PathDraft:
    """A synthetic draft model: a fixed log-softmax table keyed by (request, path).

    ``dist(b, path)`` returns the float32 log-probs of the token after ``path``
    (drafted tokens after the root). ``step_fn`` plays the engine: it tracks
    the path of every draft slot from the frontier's parent pointers and
    checks the frontier it is given.
    """

    def __init__(self, B, vocab, seed=0, scale=2.5, dist=None, context_len=None):
        self.B, self.V, self.seed, self.scale = B, vocab, seed, scale
        self._dist = dist
        self.context_len = context_len if context_len is not None else [0] * B
        self.slot_path = [dict() for _ in range(B)]
        self.calls = 0

    def dist(self, b, path):
        if self._dist is not None:
            return self._dist(b, path)
        key = zlib.crc32(repr((self.seed, b, tuple(path))).encode())
        g = torch.Generator().manual_seed(key)
        x = torch.randn(self.V, generator=g, dtype=torch.float64) * self.scale
        return torch.log_softmax(x, -1).float()

    def root(self):
        return torch.stack([self.dist(b, ()) for b in range(self.B)])

    def step_fn(self, f: Frontier):
        self.calls += 1
        B, k = f.tokens.shape
        d = f.depth
        assert f.valid.shape == (B, k) and f.parent.shape == (B, k)
        assert f.ancestor_mask.shape == (B, k, d * k) and f.ancestor_mask.dtype == torch.bool
        assert f.positions.tolist() == [[c + d] * k for c in self.context_len]
        assert f.slots.tolist() == list(range((d - 1) * k, d * k))
        out = torch.full((B, k, self.V), float("nan"))  # invalid rows must be ignored
        for b in range(B):
            for j in range(k):
                if not f.valid[b, j]:
                    assert f.ancestor_mask[b, j].nonzero().squeeze(1).tolist() == [(d - 1) * k + j]
                    continue
                parent = () if d == 1 else self.slot_path[b][(d - 2) * k + int(f.parent[b, j])]
                path = parent + (int(f.tokens[b, j]),)
                assert len(path) == d
                self.slot_path[b][(d - 1) * k + j] = path
                # Path value = float32 sum of the draft's log-probs along the path
                # (log-probs above 0, from unnormalised input, count as 0).
                v = torch.zeros((), dtype=torch.float32)
                for i in range(d):
                    v = v + self.dist(b, path[:i])[path[i]].clamp(max=0.0)
                assert float(f.values[b, j]) == float(v)
                # Ancestor mask: slots whose path is a prefix of this path.
                expect = [s for s, p in self.slot_path[b].items() if path[:len(p)] == p]
                assert sorted(f.ancestor_mask[b, j].nonzero().squeeze(1).tolist()) == sorted(expect)
                out[b, j] = self.dist(b, path)
        return out


def topk_list(lp, k):
    """The draft's top-k (token, logq), by python sort (no ties in tests)."""
    vals = lp.tolist()
    order = sorted(range(len(vals)), key=lambda t: -vals[t])[:k]
    return [(t, lp[t]) for t in order]


def brute_candidates(draft, b, k, max_depth, width=None):
    """Enumerate EAGLE-2's candidate set: list of (path, float32 value)."""
    def children(path, value):
        kids = topk_list(draft.dist(b, path), k)
        w = len(kids) if width is None else width(kids)
        return [(path + (t,), value + lq) for t, lq in kids[:w]]

    cands = children((), torch.zeros((), dtype=torch.float32))
    frontier = sorted(cands, key=lambda c: -float(c[1]))[:k]
    for _ in range(1, max_depth):
        new = [c for p, v in frontier for c in children(p, v)]
        cands += new
        frontier = sorted(new, key=lambda c: -float(c[1]))[:k]
    return [(p, float(v)) for p, v in cands]


def tree_paths_values(tree, b):
    s = int(tree.cu_nodes[b])
    paths = tree.paths(b)
    vals = tree.value[s:s + len(paths)].tolist()
    return dict(zip(paths[1:], vals[1:]))


def check_tree(tree, root_tokens, context_len):
    tree.validate()
    assert tree.token[tree.cu_nodes[:-1].long()].tolist() == list(root_tokens)
    assert tree.context_len.tolist() == list(context_len)
    for b in range(tree.num_requests):
        s, e = int(tree.cu_nodes[b]), int(tree.cu_nodes[b + 1])
        v = tree.value[s:e]
        # Best value first; children never above parents.
        assert torch.all(v[1:-1] >= v[2:]) if e - s > 2 else True
        par = tree.parent[s + 1:e].long()
        assert torch.all(v[1:] <= v[par])


def run(draft, cfg, ctx=None):
    B = draft.B
    roots = [100 + b for b in range(B)]
    ctx = ctx if ctx is not None else draft.context_len
    exp = expand_tree_detailed(cfg, torch.tensor(roots), draft.root(), draft.step_fn,
                               context_len=torch.tensor(ctx))
    check_tree(exp.tree, roots, ctx)
    return exp


@pytest.mark.parametrize("B,V,k,D,N", [
    (1, 12, 3, 4, 10),
    (3, 20, 4, 4, 25),
    (2, 9, 3, 5, 200),   # N larger than the candidate count: keep them all
    (4, 16, 2, 6, 7),
    (2, 10, 1, 5, 3),    # k = 1: a chain
])
def test_expander_matches_bruteforce_topN(B, V, k, D, N):
    ctx = [5 * b + 3 for b in range(B)]
    draft = PathDraft(B, V, seed=B * 1000 + V, context_len=ctx)
    exp = run(draft, TreeConfig(top_k=k, max_depth=D, num_nodes=N))
    tree = exp.tree
    assert exp.num_steps == D - 1 == draft.calls
    for b in range(B):
        cands = brute_candidates(draft, b, k, D)
        assert len(cands) == k + (D - 1) * k * k
        best = sorted(cands, key=lambda c: -c[1])[:N]
        got = tree_paths_values(tree, b)
        assert set(got) == {p for p, _ in best}
        for p, v in best:
            assert got[p] == v  # bit-exact float32 path value
        # Draft slots: nodes that went through the draft carry their slot.
        s, e = int(tree.cu_nodes[b]), int(tree.cu_nodes[b + 1])
        for i, p in enumerate(tree.paths(b)[1:], start=1):
            slot = int(exp.draft_slot[s + i])
            if slot >= 0:
                assert draft.slot_path[b][slot] == p
            else:
                assert p not in draft.slot_path[b].values()
        assert int(exp.draft_slot[s]) == -1


def reference_topk_generate(draft, b, total_token, depth, top_k):
    """Port of EAGLE's ``Model.topK_genrate`` (eagle/model/cnets.py) tensor logic,
    with the draft forward replaced by the path table. Returns the drafted paths."""
    total_tokens = total_token - 1
    last_p = draft.dist(b, ())
    top = torch.topk(last_p, top_k, dim=-1)
    topk_index, topk_p = top.indices, top.values
    scores = topk_p
    scores_list = [scores[None]]
    parents_list = [torch.zeros(1, dtype=torch.long)]
    ss_token = [topk_index[None]]
    cur_paths = [(t,) for t in topk_index.tolist()]
    topk_cs_index = torch.arange(top_k)
    for i in range(depth):
        bias1 = top_k if i > 0 else 0
        bias2 = max(0, i - 1)
        bias = 1 + top_k ** 2 * bias2 + bias1
        parents_list.append(topk_cs_index + bias)
        last_p = torch.stack([draft.dist(b, p) for p in cur_paths])
        top = torch.topk(last_p, top_k, dim=-1)
        topk_index, topk_p = top.indices, top.values
        cu_scores = topk_p + scores[:, None]
        topk_cs = torch.topk(cu_scores.view(-1), top_k, dim=-1)
        topk_cs_index, topk_cs_p = topk_cs.indices, topk_cs.values
        scores = topk_cs_p
        out_ids = topk_cs_index // top_k
        input_ids = topk_index.view(-1)[topk_cs_index]
        cur_paths = [cur_paths[o] + (t,) for o, t in zip(out_ids.tolist(), input_ids.tolist())]
        ss_token.append(topk_index)
        scores_list.append(cu_scores)
    scores_list = torch.cat(scores_list, dim=0).view(-1)
    ss_token_list = torch.cat(ss_token, dim=0).view(-1)
    top_scores_index = torch.sort(torch.topk(scores_list, total_tokens, dim=-1).indices).values
    draft_tokens = ss_token_list[top_scores_index].tolist()
    draft_parents = torch.cat(parents_list, dim=0)[top_scores_index // top_k].long()
    mask_index = torch.searchsorted(top_scores_index, draft_parents - 1, right=False)
    mask_index[draft_parents == 0] = -1
    mask_index = (mask_index + 1).tolist()
    paths = [()]
    for i in range(total_tokens):
        paths.append(paths[mask_index[i]] + (draft_tokens[i],))
    return set(paths[1:])


@pytest.mark.parametrize("total_token,depth,top_k,V", [(60, 5, 10, 40), (20, 3, 4, 16), (8, 6, 2, 10)])
def test_expander_equals_reference_port(total_token, depth, top_k, V):
    draft = PathDraft(2, V, seed=7 + depth)
    cfg = TreeConfig.from_reference(total_token=total_token, depth=depth, top_k=top_k)
    assert cfg.max_depth == depth + 1 and cfg.num_nodes == total_token - 1
    tree = run(draft, cfg).tree
    for b in range(2):
        assert set(tree.paths(b)[1:]) == reference_topk_generate(draft, b, total_token, depth, top_k)
        assert tree.sizes[b] == total_token


def test_adaptation_off_is_plain_eagle2():
    B, V, k, D, N = 3, 14, 3, 4, 12
    draft = PathDraft(B, V, seed=3)
    plain = run(draft, TreeConfig(top_k=k, max_depth=D, num_nodes=N)).tree
    explicit_off = [
        TreeConfig(top_k=k, max_depth=D, num_nodes=N, depth_threshold=0.0, width_mass=1.0,
                   min_path_prob=0.0, batch_num_nodes=None),
        # A batch budget of B*N with enough candidates everywhere = per-request top N.
        TreeConfig(top_k=k, max_depth=D, num_nodes=N, batch_num_nodes=B * N),
    ]
    for cfg in explicit_off:
        t = run(PathDraft(B, V, seed=3), cfg).tree
        for f in ("cu_nodes", "token", "parent", "depth", "value"):
            assert torch.equal(getattr(t, f), getattr(plain, f)), f


def const_draft(B, V, dists):
    """A draft whose distribution depends only on the request: dists[b] (probs)."""
    tables = []
    for p in dists:
        p = torch.tensor(p, dtype=torch.float64)
        p = torch.cat([p, torch.full((V - len(p),), (1 - p.sum()) / max(V - len(p), 1))])
        tables.append(torch.log(p / p.sum()).float())
    return PathDraft(B, V, dist=lambda b, path: tables[b])


def test_adaptive_depth_confident_deep_hard_shallow():
    V, k, D = 16, 2, 10
    # Request 0: the top child has probability 0.8 at every node; request 1: flat.
    dists = [[0.8, 0.1], [1.0 / V] * V]
    cfg = TreeConfig(top_k=k, max_depth=D, num_nodes=1000, depth_threshold=0.3)
    exp = run(const_draft(2, V, dists), cfg)
    depth = [int(exp.tree.request(b).depth.max()) for b in range(2)]
    # Frontier at depth d has best value log(0.8**d); it grows iff 0.8**d >= 0.3,
    # so the deepest nodes are at the first d with 0.8**d < 0.3.
    expect0 = next(d for d in range(1, 100) if 0.8 ** d < 0.3)
    assert expect0 == 6
    assert depth == [expect0, 1]
    assert exp.num_steps == expect0 - 1  # both stopped: no more draft steps
    # The rule is per request, not per node: while the request grows, its whole
    # frontier (weak nodes too, e.g. value log(0.8 * 0.1)) is expanded.
    assert (exp.tree.sizes - 1).tolist() == [k + (expect0 - 1) * k * k, k]
    # Off: both reach max_depth.
    plain = run(const_draft(2, V, dists), TreeConfig(top_k=k, max_depth=D, num_nodes=1000))
    assert [int(plain.tree.request(b).depth.max()) for b in range(2)] == [D, D]
    # Threshold 1.0: nothing below the root's children grows.
    shallow = run(const_draft(2, V, dists),
                  TreeConfig(top_k=k, max_depth=D, num_nodes=1000, depth_threshold=1.0))
    assert shallow.tree.max_depth == 1 and shallow.num_steps == 0


def test_adaptive_width_follows_confidence():
    V, k, D = 8, 4, 3
    dists = [
        [0.9, 0.05, 0.03],          # peaked: 1 child reaches 0.8
        [0.5, 0.35, 0.1],           # 2 children reach 0.8
        [0.5, 0.2, 0.15],           # 3 children
        [(1 - 0.01 * i) / sum(1 - 0.01 * j for j in range(V)) for i in range(V)],
        # nearly flat (no ties): needs 7 > k children, capped at k = 4
    ]
    want = [1, 2, 3, 4]
    cfg = TreeConfig(top_k=k, max_depth=D, num_nodes=10_000, width_mass=0.8)
    tree = run(const_draft(4, V, dists), cfg).tree
    for b in range(4):
        counts = [len(c) for c in tree.children_lists()[b]]
        assert counts[0] == want[b]
        assert set(counts) <= {0, want[b]}
        # Same node set as brute-force enumeration with the width rule.
        draft = const_draft(4, V, dists)
        cands = brute_candidates(draft, b, k, D, width=lambda kids: want[b])
        assert set(tree.paths(b)[1:]) == {p for p, _ in cands}
    # Off (width_mass = 1): every expanded node has k children.
    plain = run(const_draft(4, V, dists), TreeConfig(top_k=k, max_depth=D, num_nodes=10_000)).tree
    for b in range(4):
        assert len(plain.children(b, 0)) == k


def test_width_rule_exact_boundary():
    # Cumulative mass exactly reaches width_mass after 2 children: keep 2.
    V, k = 8, 4
    dists = [[0.5, 0.25, 0.125, 0.0625]]
    for mass, want in [(0.5, 1), (0.75, 2), (0.76, 3), (0.875, 3), (0.9, 4), (1.0, 4)]:
        cfg = TreeConfig(top_k=k, max_depth=1, num_nodes=10, width_mass=mass)
        tree = run(const_draft(1, V, dists), cfg).tree
        assert len(tree.children(0, 0)) == want, mass


def test_min_path_prob_is_plain_filtered_and_hopeless_gets_zero():
    B, V, k, D, N = 3, 12, 3, 4, 30
    plain = run(PathDraft(B, V, seed=11), TreeConfig(top_k=k, max_depth=D, num_nodes=N)).tree
    mp = 0.02
    cut = run(PathDraft(B, V, seed=11),
              TreeConfig(top_k=k, max_depth=D, num_nodes=N, min_path_prob=mp)).tree
    for b in range(B):
        want = {p for p, v in tree_paths_values(plain, b).items() if v >= math.log(mp)}
        got = tree_paths_values(cut, b)
        assert set(got) == want
        assert all(v >= math.log(mp) for v in got.values())
    # A hopeless request (flat over a large vocab) drafts nothing.
    V = 64
    dists = [[0.9, 0.05], [1.0 / V] * V]
    tree = run(const_draft(2, V, dists),
               TreeConfig(top_k=4, max_depth=4, num_nodes=20, min_path_prob=0.05)).tree
    assert tree.sizes.tolist()[1] == 1
    assert tree.sizes.tolist()[0] > 1


@pytest.mark.parametrize("budget,cap", [(12, 8), (5, 8), (40, 6), (0, 8), (100, 100)])
def test_batch_budget_is_global_topN_with_cap(budget, cap):
    V, k, D = 64, 3, 4
    dists = [[0.9, 0.05, 0.02], [0.5, 0.3, 0.1], [1.0 / V] * V]
    mp = 0.05
    cfg = TreeConfig(top_k=k, max_depth=D, num_nodes=cap, min_path_prob=mp, batch_num_nodes=budget)
    tree = run(const_draft(3, V, dists), cfg).tree
    # Candidate set, independent of the budget: every valid candidate.
    every = run(const_draft(3, V, dists),
                TreeConfig(top_k=k, max_depth=D, num_nodes=10_000, min_path_prob=mp)).tree
    eligible = []
    for b in range(3):
        pv = sorted(tree_paths_values(every, b).items(), key=lambda x: (-x[1], len(x[0])))
        eligible += [(v, b, p) for p, v in pv[:cap]]
    # Ties broken by request, then by generation order (a parent before its child).
    eligible.sort(key=lambda x: (-x[0], x[1], len(x[2])))
    chosen = eligible[:budget]
    drafted = (tree.sizes - 1).tolist()
    assert sum(drafted) == min(budget, len(eligible))
    assert all(n <= cap for n in drafted)
    assert drafted[2] == 0  # hopeless request
    for b in range(3):
        assert set(tree_paths_values(tree, b)) == {p for _, bb, p in chosen if bb == b}


def test_batch_budget_allocates_by_value():
    V, k, D = 32, 4, 5
    dists = [[0.95, 0.03], [0.4, 0.3, 0.2], [0.6, 0.2, 0.1]]
    cfg = TreeConfig(top_k=k, max_depth=D, num_nodes=50, batch_num_nodes=15)
    tree = run(const_draft(3, V, dists), cfg).tree
    drafted = (tree.sizes - 1).tolist()
    assert sum(drafted) == 15
    # The confident request takes the most nodes; every kept value beats every dropped one.
    every = run(const_draft(3, V, dists), TreeConfig(top_k=k, max_depth=D, num_nodes=50)).tree
    kept = [v for b in range(3) for v in tree_paths_values(tree, b).values()]
    dropped = [v for b in range(3) for p, v in tree_paths_values(every, b).items()
               if p not in tree_paths_values(tree, b)]
    assert min(kept) >= max(dropped)
    assert drafted[0] == max(drafted)


@pytest.mark.parametrize("N", [1, 3, 8, 100])
def test_ties_and_unnormalised_draft_stay_closed(N):
    """Exact ties (a certain token: log q = 0, children as good as parents; -inf
    siblings) and slightly positive 'log-probs' still give valid, closed trees."""
    V, k, D = 6, 3, 4
    sure = torch.log(torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    draft = PathDraft(2, V, dist=lambda b, path: sure if b == 0 else torch.full((V,), 0.25))
    exp = run(draft, TreeConfig(top_k=k, max_depth=D, num_nodes=N))
    t0 = exp.tree.request(0)
    # The certain chain (value 0 at every depth) comes first, parents first.
    chain = min(N, D)
    assert t0.paths(0)[1:chain + 1] == [(1,) * d for d in range(1, chain + 1)]
    assert t0.value[:chain + 1].tolist() == [0.0] * (chain + 1)
    assert exp.tree.sizes.tolist() == [1 + min(N, k + (D - 1) * k * k)] * 2


def test_num_nodes_zero_and_token_map():
    draft = PathDraft(2, 10, seed=5)
    tree = run(draft, TreeConfig(top_k=3, max_depth=3, num_nodes=0)).tree
    assert tree.sizes.tolist() == [1, 1] and tree.token.tolist() == [100, 101]
    # token_map maps draft-vocab indices to target ids (reduced draft vocab).
    V = 10
    tmap = torch.arange(V) * 7 + 1000
    draft = PathDraft(1, V, seed=9)
    seen = []

    def step(f):
        seen.append(f.tokens[f.valid].tolist())
        inv = {int(t): i for i, t in enumerate(tmap.tolist())}
        out = torch.full((1, 3, V), float("nan"))
        for j in range(3):
            if f.valid[0, j]:
                # Only depth 1 here; map back to draft indices for the table.
                out[0, j] = draft.dist(0, (inv[int(f.tokens[0, j])],))
        return out

    t = expand_tree(TreeConfig(top_k=3, max_depth=2, num_nodes=100), torch.tensor([1]),
                    draft.root(), step, token_map=tmap)
    plain = expand_tree(TreeConfig(top_k=3, max_depth=2, num_nodes=100), torch.tensor([1]),
                        draft.root(), draft.step_fn)
    assert torch.equal(t.token[1:], tmap[plain.token[1:]])
    assert torch.equal(t.parent, plain.parent) and torch.equal(t.value, plain.value)
    assert all(x >= 1000 for x in seen[0])


def test_bad_inputs():
    draft = PathDraft(1, 4, seed=1)
    with pytest.raises(ValueError, match="top_k=5 exceeds the draft vocabulary size 4"):
        expand_tree(TreeConfig(top_k=5), torch.tensor([0]), draft.root(), draft.step_fn)


@pytest.mark.parametrize("kw,msg", [
    (dict(top_k=0), r"TreeConfig.top_k must be an int >= 1, got 0"),
    (dict(top_k=2.0), r"TreeConfig.top_k must be an int >= 1"),
    (dict(max_depth=0), r"TreeConfig.max_depth must be an int >= 1"),
    (dict(num_nodes=-1), r"TreeConfig.num_nodes must be an int >= 0"),
    (dict(batch_num_nodes=-3), r"TreeConfig.batch_num_nodes must be an int >= 0"),
    (dict(depth_threshold=1.5), r"TreeConfig.depth_threshold must be a float in \[0.0, 1.0\]"),
    (dict(depth_threshold=float("nan")), r"TreeConfig.depth_threshold"),
    (dict(width_mass=0.0), r"TreeConfig.width_mass must be a float in \(0.0, 1.0\]"),
    (dict(min_path_prob=-0.1), r"TreeConfig.min_path_prob must be a float in \[0.0, 1.0\]"),
])
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TreeConfig(**kw)
