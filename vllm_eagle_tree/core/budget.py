"""Goodput planning for a batch of draft trees (groundwork for issue 6), plain PyTorch.

Each verify step costs time that grows with the number of query rows (one per
request plus one per drafted node) and emits, in expectation, one bonus token
per request plus the sum over drafted nodes of P(node accepted). The planner
picks how many of the drafted candidates to verify so that expected emitted
tokens per second is highest, possibly zero (no speculation this step).

* :class:`LinearCost`: ``seconds = a + b * x``, least squares over a window of
  recent observations (live refinement of a start-up measurement).
* :class:`DepthCalibration`: per-depth EMA of accepted / predicted, so that
  path values (the draft's own confidence) are corrected by what the target
  actually accepts.
* :func:`plan_budget`: the best number of nodes for the batch.
* :func:`prune_to_top`: keep the batch's best ``n`` nodes by path value
  (ancestor-closed: a child's value never exceeds its parent's, ties go to the
  earlier node, which is the parent).

Used by the vLLM runner with ``"adaptive": true, "goodput": true``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from .tree import TreeBatch

__all__ = ["LinearCost", "DepthCalibration", "BudgetPlan", "plan_budget", "prune_to_top",
           "GoodputPlanner"]


@dataclass
class LinearCost:
    """``seconds(x) = a + b * x`` fitted by least squares on the last ``window`` samples."""

    a: float = 0.0
    b: float = 0.0
    window: int = 64
    _xs: deque = field(default_factory=deque, repr=False)
    _ys: deque = field(default_factory=deque, repr=False)

    def observe(self, x: float, seconds: float) -> None:
        self._xs.append(float(x))
        self._ys.append(float(seconds))
        while len(self._xs) > self.window:
            self._xs.popleft()
            self._ys.popleft()
        self._fit()

    def _fit(self) -> None:
        n = len(self._xs)
        if n == 0:
            return
        mx = sum(self._xs) / n
        my = sum(self._ys) / n
        sxx = sum((x - mx) ** 2 for x in self._xs)
        if sxx <= 0.0:  # one distinct x: keep the slope, move the intercept
            self.a = my - self.b * mx
            return
        sxy = sum((x - mx) * (y - my) for x, y in zip(self._xs, self._ys))
        self.b = max(sxy / sxx, 0.0)  # time never falls with more rows
        self.a = max(my - self.b * mx, 0.0)

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


@dataclass
class DepthCalibration:
    """Per-depth factor = EMA of (accepted nodes / predicted acceptances)."""

    max_depth: int
    decay: float = 0.9
    factors: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.factors:
            self.factors = [1.0] * self.max_depth

    def observe(self, predicted: list[float], accepted: list[int]) -> None:
        """``predicted[d-1]``: sum of calibrated probabilities of the verified
        depth-d nodes; ``accepted[d-1]``: nodes accepted at depth d."""
        for d, (p, a) in enumerate(zip(predicted, accepted)):
            if p > 1e-6:
                ratio = (a / p) * self.factors[d]  # raw probabilities' ratio
                self.factors[d] = self.decay * self.factors[d] + (1 - self.decay) * ratio

    def calibrate(self, logp: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Acceptance probability estimates from path values ``logp`` at ``depth`` (>= 1)."""
        f = torch.tensor(self.factors, dtype=torch.float32, device=logp.device)
        return (logp.float().exp() * f[(depth.long() - 1).clamp(0, self.max_depth - 1)]).clamp(0, 1)


@dataclass
class BudgetPlan:
    num_nodes: int            # drafted nodes to verify, whole batch
    tokens: float             # expected emitted tokens this step
    seconds: float            # predicted step time
    tokens_per_second: float


def plan_budget(accept_prob: torch.Tensor, num_requests: int, verify_cost: LinearCost,
                draft_seconds: float = 0.0, max_nodes: int | None = None) -> BudgetPlan:
    """Best number of candidate nodes to verify for the batch.

    ``accept_prob``: calibrated acceptance probability of every candidate node
    (any order). Verifying the top ``n`` costs ``verify_cost(num_requests + n)``
    plus ``draft_seconds`` when ``n > 0`` and is expected to emit
    ``num_requests + sum(top n probabilities)`` tokens. ``n = 0`` is plain
    decoding.
    """
    p = torch.sort(accept_prob.reshape(-1).float(), descending=True).values
    if max_nodes is not None:
        p = p[:max_nodes]
    cum = torch.cat([torch.zeros(1), torch.cumsum(p.cpu(), 0)])
    n = torch.arange(cum.numel(), dtype=torch.float32)
    seconds = verify_cost.a + verify_cost.b * (num_requests + n) + (n > 0).float() * draft_seconds
    tokens = num_requests + cum
    rate = tokens / seconds.clamp(min=1e-12)
    best = int(torch.argmax(rate))  # first maximum: the smallest budget among equals
    return BudgetPlan(num_nodes=best, tokens=float(tokens[best]), seconds=float(seconds[best]),
                      tokens_per_second=float(rate[best]))


def prune_to_top(tree: TreeBatch, keep: int,
                 request_offset: torch.Tensor | None = None) -> TreeBatch:
    """The batch's ``keep`` best drafted nodes by path value, roots always kept.

    ``request_offset`` (float [B], optional) is added to every value of a
    request (e.g. the log of its calibration factor), moving budget between
    requests. Ancestor-closed: order is (score descending, global index
    ascending) and a child's score is at most its parent's (same offset),
    which comes first in the packed order, so a kept node's parent is kept.
    """
    is_root = tree.parent < 0
    total = tree.total
    keep = max(0, min(keep, total - tree.num_requests))
    value = tree.value
    if request_offset is not None:
        value = value + request_offset.float()[tree.request_index.long()]
    score = torch.where(is_root, torch.full_like(value, math.inf), value)
    order = sorted(range(total), key=lambda i: (-float(score[i]), i))
    kept = torch.zeros(total, dtype=torch.bool)
    kept[order[: tree.num_requests + keep]] = True
    parents, tokens, values, ctx = [], [], [], []
    cu = tree.cu_nodes.tolist()
    par = tree.parent.tolist()
    for b in range(tree.num_requests):
        local = [i for i in range(cu[b], cu[b + 1]) if kept[i]]
        new_index = {g - cu[b]: j for j, g in enumerate(local)}
        p_b = []
        for g in local:
            p = par[g]
            if p >= 0 and p not in new_index:
                raise AssertionError("prune_to_top: kept a node without its parent")
            p_b.append(-1 if p < 0 else new_index[p])
        parents.append(p_b)
        tokens.append([int(tree.token[g]) for g in local])
        values.append([float(tree.value[g]) for g in local])
    return TreeBatch.from_parents(parents, tokens, tree.context_len.tolist(), values)


class GoodputPlanner:
    """Chooses each step's batch node budget from live costs and calibrated values.

    The engine reports, every step: the verify forward's wall time with its
    number of query rows (:meth:`observe_verify`), the drafting time
    (:meth:`observe_draft`) and, per verified tree, the nodes' depths, path
    values and accepted counts (:meth:`observe_acceptance`). :meth:`prune`
    then keeps the goodput-optimal number of the freshly drafted nodes.
    Until ``warmup`` verify steps have been timed, trees are left as drafted.
    """

    def __init__(self, max_depth: int, warmup: int = 8, window: int = 64, decay: float = 0.9):
        self.verify_cost = LinearCost(window=window)  # steps without trees: seconds vs rows
        self.tree_overhead = 0.0  # EMA: extra seconds of a verify step that holds trees
        self.calibration = DepthCalibration(max_depth=max_depth, decay=decay)
        self.draft_seconds = 0.0
        self.warmup = warmup
        self.steps_timed = 0
        self.last_plan: BudgetPlan | None = None
        self.probe_every = 8
        self._skipped = 0
        self.request_factor: dict[str, float] = {}  # per-request EMA accepted / predicted
        self.decay = decay

    def _request_factors(self, req_ids, B: int) -> torch.Tensor:
        if req_ids is None:
            return torch.ones(B)
        return torch.tensor([self.request_factor.get(r, 1.0) for r in req_ids])

    def forget(self, live_req_ids) -> None:
        """Drop the factors of requests that are gone."""
        live = set(live_req_ids)
        for r in [r for r in self.request_factor if r not in live]:
            del self.request_factor[r]

    def skip_drafting(self) -> bool:
        """True while the last plan was "no speculation": the engine then skips
        tree expansion (the cost the plan assumed saved), re-drafting every
        ``probe_every`` steps to re-plan."""
        if self.last_plan is None or self.last_plan.num_nodes > 0:
            self._skipped = 0
            return False
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return False
        return True

    def observe_verify(self, query_rows: int, seconds: float, tree_rows: int = 0) -> None:
        """A verify forward's wall time. Steps without trees (prefills, plain
        decodes, the start-up probe) fit the per-row cost; steps with trees
        update the extra cost a tree step carries on top (tree attention)."""
        if tree_rows == 0:
            self.verify_cost.observe(query_rows, seconds)
        else:
            extra = max(seconds - self.verify_cost(query_rows), 0.0)
            self.tree_overhead = extra if self.tree_overhead == 0.0 else \
                0.9 * self.tree_overhead + 0.1 * extra
        self.steps_timed += 1

    def observe_draft(self, seconds: float) -> None:
        self.draft_seconds = seconds if self.draft_seconds == 0.0 else \
            0.9 * self.draft_seconds + 0.1 * seconds

    def observe_acceptance(self, tree: TreeBatch, num_accepted: torch.Tensor,
                           req_ids=None) -> None:
        """Update the per-depth factors and, with ``req_ids``, each request's own
        factor (so requests whose drafts the target keeps accepting, such as
        code, earn larger trees than requests it keeps rejecting)."""
        D = self.calibration.max_depth
        drafted = tree.parent >= 0
        p = self.calibration.calibrate(tree.value[drafted], tree.depth[drafted])
        d = tree.depth[drafted].long().clamp(1, D) - 1
        predicted = torch.zeros(D).index_add_(0, d, p.float()).tolist()
        acc = num_accepted.reshape(-1).long()
        accepted = [int((acc >= k).sum()) for k in range(1, D + 1)]
        if req_ids is not None:
            per_req = torch.zeros(tree.num_requests).index_add_(
                0, tree.request_index[drafted].long(), p.float())
            for b, r in enumerate(req_ids):
                if float(per_req[b]) > 1e-6:
                    ratio = min(max(int(acc[b]) / float(per_req[b]), 0.05), 20.0)
                    old = self.request_factor.get(r, 1.0)
                    self.request_factor[r] = self.decay * old + (1 - self.decay) * ratio
        self.calibration.observe(predicted, accepted)

    def prune(self, tree: TreeBatch, other_rows: int = 0, req_ids=None) -> TreeBatch:
        """``tree`` cut to the best budget; ``other_rows``: query rows of the
        step that are not trees (prefill chunks, plain decodes); ``req_ids``:
        the trees' request ids, for per-request calibration."""
        if self.steps_timed < self.warmup:
            return tree
        drafted = tree.parent >= 0
        rf = self._request_factors(req_ids, tree.num_requests)
        p = (self.calibration.calibrate(tree.value[drafted], tree.depth[drafted])
             * rf[tree.request_index[drafted].long()]).clamp(0, 1)
        cost = LinearCost(a=self.verify_cost(other_rows), b=self.verify_cost.b)
        self.last_plan = plan_budget(p, tree.num_requests, cost,
                                     self.draft_seconds + self.tree_overhead)
        if self.last_plan.num_nodes >= int(drafted.sum()):
            return tree
        return prune_to_top(tree, self.last_plan.num_nodes, request_offset=rf.log())
