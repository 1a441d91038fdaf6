"""EAGLE-2 dynamic draft-tree expansion, engine-free (DESIGN.md section 3).

The draft model is a callback, so this module never touches an engine:

1. Root: the caller gives the draft's first distribution (``root_logprobs``,
   the head's output at the root). Its top-k tokens are the depth-1
   candidates, value = log q.
2. For each depth d = 1 .. max_depth-1: the *frontier* (the top-k depth-d
   candidates of each request, by path value) goes through ``step_fn`` at
   once: B*k rows, fixed shape, with a validity mask. Each frontier node
   proposes its top-k tokens; child value = parent value + log q(child).
   All k*k children are candidates at depth d+1.
3. Rerank: of all candidates of all depths, keep the top N by value
   (N = ``num_nodes`` drafted nodes, root excluded). Values never increase
   along a path and ties go to the earlier candidate (smaller depth first),
   so a parent always ranks before its children: the kept set is
   ancestor-closed.

The returned tree lists a request's nodes best-value first (ties: smaller
depth, then earlier candidate). That order is parents-first, and any prefix
of it is the best subtree of that size, so truncating a tree keeps its most
valuable nodes.

Mapping to the EAGLE reference (``Model.topK_genrate``, arguments
``total_token``, ``depth``, ``top_k``): ``top_k = top_k``,
``max_depth = depth + 1`` (its loop runs ``depth`` draft steps after the
root), ``num_nodes = total_token - 1``. See :meth:`TreeConfig.from_reference`.

Adaptive knobs beyond EAGLE-2 (each off by default, and then the result is
exactly EAGLE-2): ``depth_threshold`` (per-request depth), ``width_mass``
(per-node width), ``min_path_prob`` (drop hopeless nodes),
``batch_num_nodes`` (one node budget shared by the batch).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .tree import TreeBatch

__all__ = ["TreeConfig", "Frontier", "Expansion", "StepFn", "expand_tree", "expand_tree_detailed"]


@dataclass(frozen=True)
class TreeConfig:
    """All knobs of the tree expander.

    Plain EAGLE-2:
        top_k:      children proposed per node and frontier width (>= 1).
        max_depth:  deepest drafted node (>= 1); max_depth - 1 draft steps
                    run after the root distribution.
        num_nodes:  N, drafted nodes per request, root excluded (>= 0). With
                    ``batch_num_nodes`` set it is the per-request cap.

    Confidence-driven adaptation (the defaults switch each one off):
        depth_threshold: in [0, 1]. A request stops growing once its best
                    frontier value < log(depth_threshold). 0 = off.
        width_mass: in (0, 1]. A node keeps its smallest set of top children
                    whose cumulative draft probability >= width_mass (at
                    least 1, at most top_k). 1.0 = off (always top_k).
        min_path_prob: in [0, 1]. Nodes with path value < log(min_path_prob)
                    are neither drafted further nor kept; a request whose best
                    path is below it drafts zero nodes. 0 = off.
        batch_num_nodes: None (off) or >= 0. One budget for the whole batch:
                    the global top-``batch_num_nodes`` candidates by value,
                    each request capped at ``num_nodes``.
    """

    top_k: int = 10
    max_depth: int = 6
    num_nodes: int = 60
    depth_threshold: float = 0.0
    width_mass: float = 1.0
    min_path_prob: float = 0.0
    batch_num_nodes: int | None = None

    def __post_init__(self) -> None:
        def need_int(name: str, lo: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"TreeConfig.{name} must be an int >= {lo}, got {v!r}")

        need_int("top_k", 1)
        need_int("max_depth", 1)
        need_int("num_nodes", 0)
        if self.batch_num_nodes is not None:
            need_int("batch_num_nodes", 0)

        def need_float(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
            if ok:
                ok = (lo < v if lo_open else lo <= v) and v <= hi
            if not ok:
                rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
                raise ValueError(f"TreeConfig.{name} must be a float in {rng}, got {v!r}")

        need_float("depth_threshold", 0.0, 1.0)
        need_float("width_mass", 0.0, 1.0, lo_open=True)
        need_float("min_path_prob", 0.0, 1.0)

    @classmethod
    def from_reference(cls, total_token: int = 60, depth: int = 5, top_k: int = 10,
                       **adaptive) -> "TreeConfig":
        """Config equal to the EAGLE reference's (total_token, depth, top_k)."""
        return cls(top_k=top_k, max_depth=depth + 1, num_nodes=total_token - 1, **adaptive)

    @property
    def num_candidates(self) -> int:
        """Candidates per request: k at depth 1, k*k at each deeper depth."""
        return self.top_k + (self.max_depth - 1) * self.top_k * self.top_k

    @property
    def max_tree_size(self) -> int:
        """Upper bound on nodes per request, root included."""
        return 1 + min(self.num_nodes, self.num_candidates)


@dataclass
class Frontier:
    """What one draft step needs: the k frontier nodes of each request.

    Draft slots: the j-th frontier node of depth d has draft slot
    ``(d - 1) * k + j`` of its request (the engine writes that node's draft
    KV there; the root's KV is part of the context).

    Attributes:
        depth:     depth of all frontier nodes (1 .. max_depth-1).
        tokens:    int64 [B, k] input token of each node (0 where invalid).
        valid:     bool [B, k]; invalid rows are padding, their output is ignored.
        parent:    int64 [B, k] index of the parent in the previous frontier
                   (0 at depth 1: the root). Gather the parent's draft hidden
                   state with it.
        positions: int64 [B, k] ``context_len + depth``.
        values:    float32 [B, k] path values.
        ancestor_mask: bool [B, k, d*k] over draft slots 0..d*k-1: True at
                   the slots of the node's drafted ancestors and its own slot
                   (invalid rows: own slot only). Context and root are always
                   visible and not in the mask.
    """

    depth: int
    tokens: torch.Tensor
    valid: torch.Tensor
    parent: torch.Tensor
    positions: torch.Tensor
    values: torch.Tensor
    ancestor_mask: torch.Tensor

    @property
    def slots(self) -> torch.Tensor:
        """int64 [k]: draft slots of this frontier (same for every request)."""
        k = self.tokens.shape[1]
        return torch.arange(k, device=self.tokens.device) + (self.depth - 1) * k


StepFn = Callable[[Frontier], torch.Tensor]
"""``step_fn(frontier) -> logprobs [B, k, V]``: the draft's normalised
log-probabilities (log_softmax) for the token after each frontier node."""


@dataclass
class Expansion:
    """Result of :func:`expand_tree_detailed`.

    Attributes:
        tree:       the draft trees.
        draft_slot: int64 [total]: draft slot of each node (see
                    :class:`Frontier`), -1 for roots and for nodes never run
                    through the draft (leaves of the last step).
        num_steps:  number of ``step_fn`` calls made.
    """

    tree: TreeBatch
    draft_slot: torch.Tensor
    num_steps: int


def _width_mask(logq: torch.Tensor, width_mass: float) -> torch.Tensor:
    """Children kept by the width rule; ``logq`` [..., k] sorted descending.

    Child r is kept iff the draft mass of the children ranked above it is
    < width_mass: the smallest top set reaching width_mass (at least 1).
    """
    if width_mass >= 1.0:
        return torch.ones_like(logq, dtype=torch.bool)
    before = torch.cumsum(logq.exp(), -1)
    before = torch.cat([torch.zeros_like(before[..., :1]), before[..., :-1]], dim=-1)
    return before < width_mass  # rank 0: 0 < width_mass, always kept


def expand_tree(
    config: TreeConfig,
    root_tokens: torch.Tensor,
    root_logprobs: torch.Tensor,
    step_fn: StepFn,
    context_len: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
) -> TreeBatch:
    """Grow one EAGLE-2 draft tree per request; see :func:`expand_tree_detailed`."""
    return expand_tree_detailed(config, root_tokens, root_logprobs, step_fn,
                                context_len, token_map).tree


@torch.no_grad()
def expand_tree_detailed(
    config: TreeConfig,
    root_tokens: torch.Tensor,
    root_logprobs: torch.Tensor,
    step_fn: StepFn,
    context_len: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
) -> Expansion:
    """Grow one EAGLE-2 draft tree per request.

    Args:
        config:        the knobs.
        root_tokens:   int [B], each request's root token (its last committed token).
        root_logprobs: float [B, V], the draft's log-probabilities at the root.
        step_fn:       the draft model, ``step_fn(frontier) -> logprobs [B, k, V]``.
        context_len:   int [B], tokens in the KV cache (root position); default 0.
        token_map:     optional int64 [V] draft-vocab index -> token id (for
                       heads with a reduced draft vocabulary); default identity.

    Returns:
        An :class:`Expansion` holding the :class:`TreeBatch`, best-value first.

    The draft's distributions stay tensors (top-k, path values in float32);
    the candidates, a few per request and depth, are ranked and linked in
    Python lists: at the batch sizes where trees pay, each tensor op costs
    ~5 us on a CPU host and the bookkeeping, as fixed-shape tensor ops, took
    ~0.9 ms a tree at batch 1, more than the head's forward. Frontiers keep a
    fixed shape (B*k rows, with a validity mask). Host reads: the top-k of
    each depth.
    """
    cfg = config
    device = root_logprobs.device
    if root_logprobs.dim() != 2:
        raise ValueError(f"root_logprobs must be [B, V], got shape {tuple(root_logprobs.shape)}")
    B, V = root_logprobs.shape
    k = cfg.top_k
    if V < k:
        raise ValueError(f"top_k={k} exceeds the draft vocabulary size {V}")
    root_tokens = root_tokens.reshape(-1).to(device=device, dtype=torch.int64)
    if root_tokens.numel() != B:
        raise ValueError(f"root_tokens has {root_tokens.numel()} entries for B={B}")
    if context_len is None:
        context_len = torch.zeros(B, dtype=torch.int32, device=device)
    context_len = context_len.reshape(-1).to(device=device, dtype=torch.int32)
    min_logp = math.log(cfg.min_path_prob) if cfg.min_path_prob > 0 else -math.inf
    depth_logp = math.log(cfg.depth_threshold) if cfg.depth_threshold > 0 else -math.inf

    def propose(logp: torch.Tensor, parent_value: torch.Tensor):
        """Top-k children of each row: tokens, values, whether the width
        and path-probability rules keep them (lists shaped as ``logp[..., :k]``)."""
        logp = logp.float()
        top = torch.topk(logp.masked_fill(torch.isnan(logp), -math.inf), k, dim=-1)
        logq = top.values.clamp(max=0.0)  # a child never outranks its parent
        value = parent_value.unsqueeze(-1) + logq
        ok = _width_mask(logq, cfg.width_mass)
        if cfg.min_path_prob > 0:
            ok = ok & (value >= min_logp)
        tok = top.indices if token_map is None else token_map.to(device)[top.indices]
        return tok.tolist(), value.tolist(), ok.tolist()

    # Candidates per request, in generation order (depth, frontier index,
    # child rank): token, path value, valid, parent candidate (-1: the root),
    # depth, draft slot (-1: never run through the draft).
    c_token: list[list[int]] = [[] for _ in range(B)]
    c_value: list[list[float]] = [[] for _ in range(B)]
    c_valid: list[list[bool]] = [[] for _ in range(B)]
    c_parent: list[list[int]] = [[] for _ in range(B)]
    c_depth: list[list[int]] = [[] for _ in range(B)]
    c_slot: list[list[int]] = [[] for _ in range(B)]

    def add(b: int, toks, vals, oks, parent: int, parent_valid: bool, depth: int) -> None:
        c_token[b].extend(toks)
        c_value[b].extend(vals)
        c_valid[b].extend(parent_valid and ok for ok in oks)
        c_parent[b].extend([parent] * len(toks))
        c_depth[b].extend([depth] * len(toks))
        c_slot[b].extend([-1] * len(toks))

    def best_candidates(b: int, n: int, start: int = 0, valid_only: bool = False) -> list[int]:
        """Request b's ``n`` best candidates from ``start`` on: valid first,
        then value descending, then generation order."""
        val, ok = c_value[b], c_valid[b]
        cands = range(start, len(val))
        if valid_only:
            return heapq.nsmallest(n, (c for c in cands if ok[c]), key=lambda c: (-val[c], c))
        return heapq.nsmallest(n, cands, key=lambda c: (not ok[c], -val[c], c))

    # Depth 1: the root's children.
    tok, val, ok = propose(root_logprobs, torch.zeros(B, device=device))
    for b in range(B):
        add(b, tok[b], val[b], ok[b], -1, True, 1)
    seg_start = 0
    ctx = context_len.tolist()

    # Ancestor masks over draft slots, grown by k columns per depth.
    anc = torch.zeros(B, k, 0, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    num_steps = 0
    for d in range(1, cfg.max_depth):
        # Frontier: the top-k depth-d candidates of each request.
        cand = [best_candidates(b, k, seg_start) for b in range(B)]
        f_valid = [[c_valid[b][c] for c in cand[b]] for b in range(B)]
        for b in range(B):  # depth rule: a request whose best frontier value is too low stops
            best = max((c_value[b][c] for c, v in zip(cand[b], f_valid[b]) if v), default=-math.inf)
            if not best >= depth_logp:
                f_valid[b] = [False] * k
        if not any(any(v) for v in f_valid):
            break
        # index in the previous frontier (0 at depth 1: the root)
        parent = torch.tensor([[0 if d == 1 else (c - seg_start) // k for c in cand[b]]
                               for b in range(B)], dtype=torch.int64, device=device)
        valid = torch.tensor(f_valid, dtype=torch.bool, device=device)
        # A valid node's parent was a valid node of the previous frontier,
        # so its row there holds the parent's ancestors-or-self; invalid
        # rows see their own slot only.
        anc = torch.cat([torch.gather(anc, 1, parent.unsqueeze(-1).expand(-1, -1, anc.shape[2]))
                         & valid.unsqueeze(-1), eye], dim=2)
        for b in range(B):
            for j, c in enumerate(cand[b]):
                if f_valid[b][j]:
                    c_slot[b][c] = (d - 1) * k + j
        f_value = torch.tensor([[c_value[b][c] for c in cand[b]] for b in range(B)],
                               dtype=torch.float32, device=device)
        frontier = Frontier(
            depth=d,
            tokens=torch.tensor([[c_token[b][c] if v else 0 for c, v in zip(cand[b], f_valid[b])]
                                 for b in range(B)], dtype=torch.int64, device=device),
            valid=valid, parent=parent,
            positions=(context_len.long() + d).unsqueeze(1).expand(B, k).clone(),
            values=f_value, ancestor_mask=anc)
        logp = step_fn(frontier)
        num_steps += 1
        if logp.shape[:2] != (B, k):
            raise ValueError(f"step_fn must return [B, k, V]=[{B}, {k}, V], got {tuple(logp.shape)}")
        tok, val, ok = propose(logp, f_value)  # [B][k][k]
        seg_start = len(c_value[0])
        for b in range(B):
            for j, c in enumerate(cand[b]):
                add(b, tok[b][j], val[b][j], ok[b][j], c, f_valid[b][j], d + 1)

    # Rerank: per request (valid, value desc, generation order); keep the top N.
    kept = [best_candidates(b, cfg.num_nodes, valid_only=True) for b in range(B)]
    if cfg.batch_num_nodes is not None:
        # One budget for the batch: global order (value desc, request, index).
        flat = sorted(((b, c) for b in range(B) for c in kept[b]),
                      key=lambda bc: (-c_value[bc[0]][bc[1]], bc[0], bc[1]))
        chosen = set(flat[:cfg.batch_num_nodes])
        kept = [[c for c in kept[b] if (b, c) in chosen] for b in range(B)]

    # Kept candidates in per-request order become nodes 1..; node 0 is the root.
    roots = root_tokens.tolist()
    token, parent, depth, value, draft_slot, cu = [], [], [], [], [], [0]
    for b in range(B):
        local = {c: i for i, c in enumerate(kept[b], start=1)}
        token.append(roots[b])
        parent.append(-1)
        depth.append(0)
        value.append(0.0)
        draft_slot.append(-1)
        for c in kept[b]:
            token.append(c_token[b][c])
            parent.append(local.get(c_parent[b][c], 0))
            depth.append(c_depth[b][c])
            value.append(c_value[b][c])
            draft_slot.append(c_slot[b][c])
        cu.append(len(token))
    tree = TreeBatch(
        cu_nodes=torch.tensor(cu, dtype=torch.int32, device=device),
        token=torch.tensor(token, dtype=torch.int64, device=device),
        parent=torch.tensor(parent, dtype=torch.int32, device=device),
        depth=torch.tensor(depth, dtype=torch.int32, device=device),
        value=torch.tensor(value, dtype=torch.float32, device=device),
        context_len=context_len.clone())
    return Expansion(tree=tree,
                     draft_slot=torch.tensor(draft_slot, dtype=torch.int64, device=device),
                     num_steps=num_steps)
