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


def _order(valid: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Per-row order: valid first, then value descending, then index ascending."""
    idx = torch.sort(value, dim=-1, descending=True, stable=True).indices
    v = torch.gather(valid, -1, idx)
    return torch.gather(idx, -1, torch.sort((~v).to(torch.int8), dim=-1, stable=True).indices)


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

    Shapes are fixed (B*k frontier rows per step, B*num_candidates candidate
    buffers). Host syncs: one per depth (stop early once no request has a
    valid frontier node) and one for the packed size at the end.
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
    map_tok = (lambda t: t) if token_map is None else (lambda t: token_map.to(device)[t])
    min_logp = math.log(cfg.min_path_prob) if cfg.min_path_prob > 0 else -math.inf
    depth_logp = math.log(cfg.depth_threshold) if cfg.depth_threshold > 0 else -math.inf

    def logprobs_of(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x.masked_fill(torch.isnan(x), -math.inf)  # keeps -inf as is

    def propose(logp: torch.Tensor, parent_value: torch.Tensor, parent_valid: torch.Tensor):
        """Top-k children of each row: tokens, values, validity."""
        top = torch.topk(logp, k, dim=-1)
        logq = top.values.clamp(max=0.0)  # a child never outranks its parent
        value = parent_value.unsqueeze(-1) + logq
        valid = parent_valid.unsqueeze(-1) & _width_mask(logq, cfg.width_mass)
        if cfg.min_path_prob > 0:
            valid &= value >= min_logp
        return map_tok(top.indices), value, valid

    # Candidate buffers, fixed size: k at depth 1, then k*k per depth, in
    # generation order (depth, frontier index, child rank).
    C = cfg.num_candidates
    c_token = torch.zeros(B, C, dtype=torch.int64, device=device)
    c_value = torch.full((B, C), -math.inf, dtype=torch.float32, device=device)
    c_valid = torch.zeros(B, C, dtype=torch.bool, device=device)
    c_parent = torch.full((B, C), -1, dtype=torch.int64, device=device)  # candidate idx, -1 = root
    c_depth = torch.zeros(B, C, dtype=torch.int32, device=device)
    c_slot = torch.full((B, C), -1, dtype=torch.int64, device=device)
    rows = torch.arange(B, device=device).unsqueeze(1)

    # Depth 1: the root's children.
    tok, val, ok = propose(logprobs_of(root_logprobs),
                           torch.zeros(B, device=device),
                           torch.ones(B, dtype=torch.bool, device=device))
    c_token[:, :k], c_value[:, :k], c_valid[:, :k] = tok, val, ok
    c_depth[:, :k] = 1
    seg_start, seg_len = 0, k

    # Ancestor masks over draft slots, grown by k columns per depth.
    anc = torch.zeros(B, k, 0, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    num_steps = 0
    for d in range(1, cfg.max_depth):
        # Frontier: the top-k depth-d candidates of each request.
        seg = slice(seg_start, seg_start + seg_len)
        pick = _order(c_valid[:, seg], c_value[:, seg])[:, :k]  # [B, k] within segment
        cand = pick + seg_start
        f_valid = c_valid[rows, cand]
        f_value = c_value[rows, cand]
        # Depth rule: a request whose best frontier value is below the threshold stops.
        best = torch.where(f_valid, f_value, -math.inf).max(dim=1).values
        f_valid = f_valid & (best >= depth_logp).unsqueeze(1)
        if not bool(f_valid.any()):
            break
        if d == 1:
            f_parent = torch.zeros(B, k, dtype=torch.int64, device=device)
            anc = eye.clone()
        else:
            # A valid node's parent was a valid node of the previous frontier,
            # so its row there holds the parent's ancestors-or-self.
            f_parent = pick // k  # index in the previous frontier
            anc = torch.cat([torch.gather(anc, 1, f_parent.unsqueeze(-1).expand(-1, -1, anc.shape[2])),
                             eye], dim=2)
            anc[:, :, :-k] &= f_valid.unsqueeze(-1)  # invalid rows: own slot only
        c_slot[rows, cand] = torch.where(
            f_valid, torch.arange(k, device=device) + (d - 1) * k, c_slot[rows, cand])
        frontier = Frontier(
            depth=d, tokens=torch.where(f_valid, c_token[rows, cand], 0), valid=f_valid, parent=f_parent,
            positions=context_len.long().unsqueeze(1) + d + torch.zeros_like(f_parent),
            values=f_value, ancestor_mask=anc)
        logp = logprobs_of(step_fn(frontier))
        num_steps += 1
        if logp.shape[:2] != (B, k):
            raise ValueError(f"step_fn must return [B, k, V]=[{B}, {k}, V], got {tuple(logp.shape)}")
        tok, val, ok = propose(logp, f_value, f_valid)  # [B, k, k]
        seg_start, seg_len = seg_start + seg_len, k * k
        seg = slice(seg_start, seg_start + seg_len)
        c_token[:, seg] = tok.reshape(B, -1)
        c_value[:, seg] = val.reshape(B, -1)
        c_valid[:, seg] = ok.reshape(B, -1)
        c_parent[:, seg] = cand.repeat_interleave(k, dim=1)
        c_depth[:, seg] = d + 1

    # Rerank: per-request order (valid, value desc, index asc); keep the top N.
    order = _order(c_valid, c_value)  # [B, C]
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(C, device=device).expand(B, C))
    keep = c_valid & (rank < cfg.num_nodes)
    if cfg.batch_num_nodes is not None:
        # One budget for the batch: global order (value desc, request, index).
        flat_keep, flat_val = keep.reshape(1, -1), c_value.reshape(1, -1)
        g_order = _order(flat_keep, flat_val)[0]
        g_rank = torch.empty_like(g_order)
        g_rank[g_order] = torch.arange(B * C, device=device)
        keep = keep & (g_rank < cfg.batch_num_nodes).view(B, C)

    # Kept candidates in per-request order become nodes 1..; node 0 is the root.
    kept_sorted = torch.gather(keep, 1, order)
    # local[b, c]: node index (1, 2, ...) of kept candidate c of request b.
    local = torch.full((B, C), -1, dtype=torch.int64, device=device)
    local.scatter_(1, order, torch.where(kept_sorted, torch.cumsum(kept_sorted, 1), -1))
    sizes = (keep.sum(1) + 1).to(torch.int32)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(sizes, 0)
    total = int(cu[-1])

    # Gather kept candidates in (request, order) sequence.
    sel_b, sel_pos = kept_sorted.nonzero(as_tuple=True)
    sel_c = order[sel_b, sel_pos]                              # candidate index
    par_c = c_parent[sel_b, sel_c]
    par_local = torch.where(par_c >= 0, local[sel_b, par_c.clamp(min=0)], 0)
    dst = cu.long()[sel_b] + local[sel_b, sel_c]               # packed index
    roots = cu.long()[:-1]

    token = torch.empty(total, dtype=torch.int64, device=device)
    parent = torch.empty(total, dtype=torch.int32, device=device)
    depth = torch.empty(total, dtype=torch.int32, device=device)
    value = torch.empty(total, dtype=torch.float32, device=device)
    draft_slot = torch.full((total,), -1, dtype=torch.int64, device=device)
    token[roots], parent[roots], depth[roots], value[roots] = root_tokens, -1, 0, 0.0
    token[dst] = c_token[sel_b, sel_c]
    parent[dst] = par_local.to(torch.int32)
    depth[dst] = c_depth[sel_b, sel_c]
    value[dst] = c_value[sel_b, sel_c]
    draft_slot[dst] = c_slot[sel_b, sel_c]
    tree = TreeBatch(cu, token, parent, depth, value, context_len.clone())
    return Expansion(tree=tree, draft_slot=draft_slot, num_steps=num_steps)
