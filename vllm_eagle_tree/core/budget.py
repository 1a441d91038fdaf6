"""Goodput for a batch of draft trees (issue 6), plain PyTorch.

Each verify step costs time that grows with the number of query rows (one per
request plus one per drafted node) and emits, in expectation, one bonus token
per request plus the sum over drafted nodes of P(node accepted).

* :class:`ShapeBandit`: which shape each step drafts (none, the head's greedy
  chain of K tokens, or a tree), by measured emitted tokens per second.
* :class:`GoodputPlanner`: how many of a drafted tree's nodes to verify (any
  subset or each request's greedy chain, possibly none), from a verify-cost
  model and calibrated acceptance probabilities:

  * :class:`LinearCost`: ``seconds = a + b * x``, least squares over a window
    of recent observations (live refinement of a start-up measurement);
  * :class:`ValueCalibration`: acceptance by (depth, path value) bin, learned
    from the nodes the target accepted;
  * :func:`plan_budget`: the best number of nodes for the batch;
  * :func:`prune_to_top`: keep the batch's best ``n`` nodes (ancestor-closed:
    a child's score never exceeds its parent's, ties go to the earlier node,
    which is the parent); :func:`best_chains`: each request's greedy path.

Used by the vLLM runner with ``"adaptive": true, "goodput": true``.
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .tree import TreeBatch

__all__ = ["LinearCost", "DriftingCost", "ChainDraftCost", "ValueCalibration", "BudgetPlan",
           "plan_budget", "prune_to_top", "best_chains", "greedy_chain_acceptance",
           "GoodputPlanner", "ShapeBandit", "chain_length"]


@dataclass
class LinearCost:
    """``seconds(x) = a + b * x`` fitted by least squares on the last ``window`` samples
    (running sums: each observation costs the same whatever the window) and
    on every :meth:`anchor` point (never forgotten)."""

    a: float = 0.0
    b: float = 0.0
    window: int = 64
    _xs: deque = field(default_factory=deque, repr=False)
    _ys: deque = field(default_factory=deque, repr=False)
    _sums: list = field(default_factory=lambda: [0.0] * 4, repr=False)  # x, y, xx, xy
    sloped: bool = field(default=False, repr=False)  # a slope was fitted (two distinct x)
    anchors: int = field(default=0, repr=False)  # points kept for good (:meth:`anchor`)

    def anchor(self, x: float, seconds: float) -> None:
        """A point that stays in the fit for good (the start-up probe's rows,
        spread from 1 to the most a step verifies), so that a window of
        live samples all near one ``x`` (a server at a steady batch size)
        moves the line's level but cannot tilt its slope at will."""
        self._add(float(x), float(seconds), 1.0)
        self.anchors += 1
        self._fit()

    def observe(self, x: float, seconds: float) -> None:
        x, y = float(x), float(seconds)
        self._xs.append(x)
        self._ys.append(y)
        self._add(x, y, 1.0)
        while len(self._xs) > self.window:
            self._add(self._xs.popleft(), self._ys.popleft(), -1.0)
        self._fit()

    def _add(self, x: float, y: float, sign: float) -> None:
        s = self._sums
        s[0] += sign * x
        s[1] += sign * y
        s[2] += sign * x * x
        s[3] += sign * x * y

    def _fit(self) -> None:
        n = len(self._xs) + self.anchors
        if n == 0:
            return
        sx, sy, sxx, sxy = self._sums
        mx, my = sx / n, sy / n
        var = sxx - n * mx * mx
        if var <= 1e-9 * sxx:  # one distinct x: keep the slope, move the intercept
            self.a = my - self.b * mx
            return
        self.b = max((sxy - n * mx * my) / var, 0.0)  # time never falls with more rows
        self.a = my - self.b * mx
        if self.a < 0.0:  # no negative time at x = 0: the least-squares line through 0
            self.a, self.b = 0.0, max(sxy / sxx, 0.0)
        self.sloped = True

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


class DriftingCost:
    """``seconds(x) = speed * (a + b * x)``: a line fitted over a long window
    of decode forwards (its shape, how the target forward grows with query
    rows ``x``), times the machine's current speed, an EMA over the last
    decode forwards of observed / fitted seconds, which moves the cost of
    every ``x`` alike (this machine drifts 10-20% within minutes).

    Decode forwards only (and the start-up probe): a prefill chunk's rows
    cost less than a decode step's, whose every row attends to its request's
    whole context, and a line over all forwards is dominated by prefills (on
    the AVX2 machine it put 1.36 ms per row where decode steps cost ~1.8
    between 64 and 128 rows, so chain-1 looked 4% faster than plain at batch
    64 where it is not). A long window, because a line fitted on the last
    64 steps follows the drift, and when those steps come in two groups of
    rows (plain's N, chain-1's 2N, a few windows each) one slow window tilts
    its slope.

    The forward is not a line: on the deep target (AVX-512 Intel host,
    ``_dummy_run``, ``scripts/forward_by_rows.py``) 1-5 rows cost 30-33 ms,
    6-8 rows 35-38 ms (+2 ms a row: oneDNN at tiny M), 16 rows ~51 ms, 32
    ~68 ms (~1.1 ms a row), then ~0.55 ms a row up to 320 (83-86 ms at 64,
    122-125 at 128, 190-195 at 256). A line through every probe point and
    live forward reads ~0.8 ms a row, and at batch 16 put chain-1's forward
    (32 rows) at 1.23x plain's (16 rows) where live forwards took 1.36x:
    chain-1 was predicted 21% faster than plain there, and its full-batch
    steps ran 13% faster (``scripts/bench_shapes.py --shape plain,chain-1
    --batch 16 --requests 64``). The line through the start-up probe alone
    reads ~0.55 ms a row at few rows, so chain-4 at batch 1 (5 rows) looked
    cheaper against chain-3 (4 rows) than it is. :meth:`set_profile` takes
    the probe's seconds at every row count the bandit predicts (the
    runner's ``profile_sizes``) once, at start-up, as a fixed factor on the
    line (:meth:`shape`), relative to the largest; live forwards move the
    speed, and correct the factor only where the query rows have just
    changed (:meth:`observe`). The dummy forward is not a decode
    step (its rows are one-token requests with no context): at start-up it
    put 32 rows at 1.24x 16 rows, twice, where live decode steps at batch
    16 (16 requests of 1 and of 2 rows) took 1.32-1.36x."""

    def __init__(self, window: int = 1024, speed_decay: float = 0.8, learn: float = 0.2):
        self.line = LinearCost(window=window)
        self.speed = 1.0
        self.speed_decay = speed_decay
        self.learn = learn  # step size of the factor's live correction (observe)
        self._profile_x: list[int] = []  # row counts with a shape factor (set_profile)
        self._profile_f: list[float] = []
        self._last_x: float | None = None  # the last live decode forward's rows

    def set_profile(self, seconds: dict[int, float]) -> None:
        """The probe's seconds by row count (``{rows: seconds}``, e.g. the
        least of a few timed forwards at each row count) as a fixed
        factor on the line: made non-decreasing in rows (pooling adjacent
        violators: more rows never cost less, so a dip is noise), then
        taken relative to the largest row count given, where the factor is
        1 (the line's level there is left alone, and there is no step past
        it). Read in between by linear interpolation; 1 above the largest
        row count."""
        self._profile_x, self._profile_f = [], []
        xs = sorted(int(x) for x in seconds)
        if not xs or any(self.line(x) <= 0.0 for x in xs):
            return
        blocks: list[list[float]] = []  # [sum, count] of pooled adjacent values
        for x in xs:
            blocks.append([float(seconds[x]), 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                tot, cnt = blocks.pop()
                blocks[-1][0] += tot
                blocks[-1][1] += cnt
        ys = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
        if ys[-1] <= 0.0:
            return
        top = xs[-1]
        self._profile_x = xs
        self._profile_f = [y / ys[-1] * self.line(top) / self.line(x) for x, y in zip(xs, ys)]

    def profile(self) -> dict[int, float]:
        """The factor at each row count :meth:`set_profile` was given, live
        corrections included (empty: none)."""
        return dict(zip(self._profile_x, self._profile_f))

    def _knots(self, x: float) -> list[tuple[int, float]]:
        """The profile's knots around ``x`` and their interpolation weights."""
        xs = self._profile_x
        if x >= xs[-1]:
            return [(len(xs) - 1, 1.0)]
        if x <= xs[0]:
            return [(0, 1.0)]
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def shape(self, x: float) -> float:
        """The factor on the line at ``x`` rows (1 without a profile; the
        largest row count's above it)."""
        if not self._profile_x:
            return 1.0
        return sum(w * self._profile_f[i] for i, w in self._knots(x))

    def observe(self, x: float, seconds: float, decode: bool = True,
                anchor: bool = False) -> None:
        """A timed forward of ``x`` query rows; ``decode``: it has no prefill
        rows (others are ignored); ``anchor``: a start-up probe point, kept
        in the line for good (:meth:`LinearCost.anchor`). Live forwards
        enter the line only while there is no profile: with one, the line
        is the probe's, the profile its shape at every row count, and live
        forwards move the speed (its level), and the factor as follows
        (points piled at one row count, a steady batch on one arm, tilted
        the line there, and with it the profile's ratios).

        A live forward whose rows differ by over 20% from the last one's
        (an arm changed: plain's N rows, chain-1's 2N) also corrects the
        factor: the speed of the moment was set by the other rows, so
        ``seconds / (speed x model)`` is how far the model's ratio between
        the two is off, drift aside, and each knot around ``x`` moves by
        ``learn`` x its weight of that (in log). Within a run of one row
        count nothing is learnt (the speed follows the drift, and the factor
        would take the forward's noise as a random walk): at a steady batch
        on one arm the profile's ratios are kept."""
        if not decode:
            return
        shape = 1.0 if anchor else self.shape(x)
        fitted = self.line(x) * shape
        if not anchor and self._profile_x and fitted > 0.0 and self._last_x is not None \
                and not self._last_x / 1.2 <= x <= 1.2 * self._last_x:
            step = self.learn * math.log(seconds / (self.speed * fitted))
            for i, w in self._knots(x):
                self._profile_f[i] *= math.exp(w * step)
            shape = self.shape(x)
        if not anchor:
            self._last_x = x
        if anchor:
            self.line.anchor(x, seconds)
        elif not self._profile_x:
            self.line.observe(x, seconds)
        fitted = self.line(x) * shape
        if fitted > 0.0:
            self.speed = self.speed_decay * self.speed + (1 - self.speed_decay) * seconds / fitted

    @property
    def a(self) -> float:
        return self.speed * self.line.a

    @property
    def b(self) -> float:
        return self.speed * self.line.b

    def __call__(self, x: float) -> float:
        return self.speed * self.line(x) * self.shape(x)


class ChainDraftCost:
    """Drafting seconds of one chain-k step at the machine's speed 1
    (:class:`ShapeBandit` divides by :class:`DriftingCost`'s speed before
    it stores, and multiplies back when it predicts): a line ``a + b x k``
    fitted over the last ``window`` chain windows of every length, since
    chain-k drafts with the first pass and k - 1 head forwards over the
    batch. Until two lengths have run, proportional to k (the measured
    seconds per depth); once fitted, a window of one length only moves the
    line's intercept.

    Not one EMA per length: over a few windows each, they were noisy by
    about one depth's cost. At batch 1 (AVX-512, ``scripts/trace_bandit.py
    --batch 1 --requests 32``) chain-3's EMA read 7.23 ms after one slow
    window and chain-4's 7.09, where the step profile put them at 4.8 and
    5.9 ms, so chain-4 was predicted the cheaper to draft."""

    def __init__(self, window: int = 256):
        self.line = LinearCost(window=window)
        self.lengths: set[int] = set()  # chain lengths measured (ever)

    def observe(self, k: int, seconds: float) -> None:
        self.line.observe(k, seconds)
        self.lengths.add(k)

    def __contains__(self, k: int) -> bool:
        return k in self.lengths

    def __iter__(self):
        return iter(sorted(self.lengths))

    def __len__(self) -> int:
        return len(self.lengths)

    def __call__(self, k: int) -> float:
        if self.line.sloped:
            return self.line(k)
        s = self.line._sums  # one length so far: seconds per depth x k
        return k * s[1] / s[0] if s[0] > 0 else 0.0


@dataclass
class ValueCalibration:
    """P(node accepted) from its depth and path value, learned from verify outcomes.

    The draft head's own probabilities are often far from the target's
    acceptance (the bundled EAGLE-3 head is under-confident by 2-3x at depth
    1), and one factor per depth cannot fix that for siblings, of which at
    most one is accepted. So nodes are binned by (depth, path value in steps
    of ``bin_width`` nats) and each bin estimates accepted / verified, with
    ``prior`` pseudo-observations at the node's draft probability times the
    head's overall ratio of accepted to predicted (so bins not verified yet,
    e.g. deeper ones, start from what the head is worth on average rather
    than from its raw, possibly under-confident, probabilities), and
    exponential forgetting (``decay`` per observed step).
    """

    max_depth: int
    bin_width: float = 0.5
    num_bins: int = 16
    prior: float = 1.0
    decay: float = 0.995

    def __post_init__(self) -> None:
        self.seen = torch.zeros(self.max_depth, self.num_bins)
        self.accepted = torch.zeros(self.max_depth, self.num_bins)
        self.total_accepted = 0.0
        self.total_predicted = 0.0  # sum of raw draft probabilities

    @property
    def ratio(self) -> float:
        """Overall accepted / raw draft probability (1 before any observation)."""
        return (self.total_accepted + 1.0) / (self.total_predicted + 1.0)

    def _bin(self, v: float, dd: int) -> tuple[int, int]:
        """(depth row, value bin) of a node; -inf falls in the lowest-value bin."""
        d = min(max(int(dd) - 1, 0), self.max_depth - 1)
        b = self.num_bins - 1 if v == -math.inf else \
            min(max(math.floor(-v / self.bin_width), 0), self.num_bins - 1)
        return d, b

    def observe(self, value, depth, accepted) -> None:
        """One step's verified nodes: path values, depths (>= 1), accepted (bool);
        tensors or Python lists. (Binned with tensor ops, as :meth:`_bin` does:
        a constant dozen ops whatever the batch.)"""
        value = torch.as_tensor(value, dtype=torch.float32)
        depth = torch.as_tensor(depth, dtype=torch.int64)
        accepted = torch.as_tensor(accepted, dtype=torch.float32)
        self.seen *= self.decay
        self.accepted *= self.decay
        self.total_accepted = self.decay * self.total_accepted + float(accepted.sum())
        self.total_predicted = self.decay * self.total_predicted + float(value.exp().sum())
        d = (depth - 1).clamp(0, self.max_depth - 1)
        b = (-value / self.bin_width).floor().clamp(0, self.num_bins - 1).long()  # -inf: last
        self.seen.index_put_((d, b), torch.ones(d.numel()), accumulate=True)
        self.accepted.index_put_((d, b), accepted, accumulate=True)

    def calibrate(self, value: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """float32: estimated acceptance of nodes of these path values and depths."""
        return torch.tensor(self.calibrated(value.tolist(), depth.tolist()), dtype=torch.float32)

    def calibrated(self, value: list[float], depth: list[int]) -> list[float]:
        """:meth:`calibrate` on Python lists (a tree's few nodes: no tensor ops
        but reading the two tables; NaN values give NaN)."""
        seen, accepted = self.seen.tolist(), self.accepted.tolist()
        ratio, w = self.ratio, self.prior
        out = []
        for v, dd in zip(value, depth):
            if math.isnan(v):
                out.append(math.nan)
                continue
            d, b = self._bin(v, dd)
            prior = min(max(math.exp(v) * ratio, 0.0), 1.0)
            out.append(min(max((accepted[d][b] + w * prior) / (seen[d][b] + w), 0.0), 1.0))
        return out

    def table(self) -> list[list[float | None]]:
        """Estimated acceptance per [depth][bin] (None: no observation yet)."""
        rate = self.accepted / self.seen.clamp(min=1e-9)
        return [[round(float(r), 4) if float(n) > 0.5 else None for r, n in zip(rr, nn)]
                for rr, nn in zip(rate, self.seen)]


@dataclass
class BudgetPlan:
    num_nodes: int            # drafted nodes to verify, whole batch
    tokens: float             # expected emitted tokens this step
    seconds: float            # predicted step time
    tokens_per_second: float
    chain: bool = False       # the nodes are each request's greedy path (no tree mask)


def plan_budget(accept_prob: torch.Tensor, num_requests: int,
                verify_cost: Callable[[float], float], overhead_seconds: float = 0.0,
                max_nodes: int | None = None, other_rows: int = 0) -> BudgetPlan:
    """Best number of candidate nodes to verify for the batch.

    ``accept_prob``: calibrated acceptance probability of every candidate node
    (any order; NaN counts as 0). ``verify_cost``: the target forward's
    seconds at a number of query rows (a :class:`LinearCost`, or the
    shaped :class:`DriftingCost`). Verifying the top ``n`` costs
    ``verify_cost(other_rows + num_requests + n)`` plus ``overhead_seconds``
    (what a step verifying any node pays on top, e.g. a tree mask's extra
    cost) when ``n > 0`` and is expected to emit ``num_requests + sum(top n
    probabilities)`` tokens. ``n = 0`` is plain decoding; of equal rates the
    smallest budget wins. (Python floats, not tensor ops: a step's
    candidates are a few dozen, and each op costs ~5 us on a CPU host.)
    """
    p = sorted((0.0 if math.isnan(x) else x for x in accept_prob.reshape(-1).tolist()),
               reverse=True)
    if max_nodes is not None:
        p = p[:max_nodes]
    rows = other_rows + num_requests
    tokens = float(num_requests)
    best = (0, tokens, verify_cost(rows))
    best_rate = tokens / max(best[2], 1e-12)
    for n, q in enumerate(p, start=1):
        tokens += q
        seconds = verify_cost(rows + n) + overhead_seconds
        rate = tokens / max(seconds, 1e-12)
        if rate > best_rate:
            best, best_rate = (n, tokens, seconds), rate
    return BudgetPlan(num_nodes=best[0], tokens=best[1], seconds=best[2],
                      tokens_per_second=best_rate)


def _greedy_paths(cu: list[int], parent: list[int], value: list[float]) -> list[bool]:
    """Per packed node: whether it is on its request's greedy path (the
    child of highest value at every depth, the first one on ties)."""
    on = [False] * len(parent)
    best: dict[int, int] = {}  # packed node -> its best child
    for s, e in zip(cu, cu[1:]):
        for i in range(s + 1, e):
            p = s + parent[i]
            if p not in best or value[i] > value[best[p]]:
                best[p] = i
        cur = s
        on[cur] = True
        while cur in best:
            cur = best[cur]
            on[cur] = True
    return on


def best_chains(tree: TreeBatch) -> torch.Tensor:
    """bool [total]: each request's greedy path (root, then at every depth the
    child of highest path value, the first one on ties): the chain a chain
    drafter would have proposed."""
    return torch.tensor(_greedy_paths(tree.cu_nodes.tolist(), tree.parent.tolist(),
                                      tree.value.tolist()), dtype=torch.bool)


def greedy_chain_acceptance(tree: TreeBatch, num_accepted: torch.Tensor,
                            accepted_nodes: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per request of a verified batch: how long the head's greedy chain
    inside its tree is (:func:`best_chains`, root excluded) and how many of
    its nodes the accepted path covers (both are root paths, so the covered
    nodes are the chain's first ones). ``accepted_nodes`` [B, >= max
    accepted]: request-local indices, as ``core.verify`` returns them."""
    cu = tree.cu_nodes.tolist()
    on = _greedy_paths(cu, tree.parent.tolist(), tree.value.tolist())
    nodes = accepted_nodes.tolist()
    drafted, covered = [], []
    for b, n in enumerate(num_accepted.reshape(-1).tolist()):
        s, e = cu[b], cu[b + 1]
        drafted.append(sum(on[s:e]) - 1)
        covered.append(sum(on[s + i] for i in nodes[b][:n]))
    return drafted, covered


def prune_to_top(tree: TreeBatch, keep: int,
                 request_offset: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None,
                 score: torch.Tensor | None = None) -> TreeBatch:
    """The batch's ``keep`` best drafted nodes by path value, roots always kept.

    ``request_offset`` (float [B], optional) is added to every value of a
    request (e.g. the log of its calibration factor), moving budget between
    requests. ``allowed`` (bool [total], optional, ancestor-closed, e.g.
    :func:`best_chains`) limits the candidates. ``score`` (float [total],
    optional, never above the parent's) ranks the nodes instead of the path
    values. Ancestor-closed: order is
    (score descending, global index ascending) and a child's score is at most
    its parent's (same offset), which comes first in the packed order, so a
    kept node's parent is kept.
    """
    is_root = tree.parent < 0
    total = tree.total
    keep = max(0, min(keep, total - tree.num_requests))
    value = tree.value if score is None else score.float()
    if request_offset is not None:
        value = value + request_offset.float()[tree.request_index.long()]
    score = torch.where(is_root, torch.full_like(value, math.inf), value)
    if allowed is not None:
        keep = min(keep, int((allowed & ~is_root).sum()))
        score = torch.where(allowed | is_root, score, torch.full_like(score, -math.inf))
    s = score.tolist()
    order = sorted(range(total), key=lambda i: (-s[i], i))
    kept = [False] * total
    for i in order[: tree.num_requests + keep]:
        kept[i] = True
    parents, tokens, values = [], [], []
    cu = tree.cu_nodes.tolist()
    par, tok, val = tree.parent.tolist(), tree.token.tolist(), tree.value.tolist()
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
        tokens.append([tok[g] for g in local])
        values.append([val[g] for g in local])
    return TreeBatch.from_parents(parents, tokens, tree.context_len.tolist(), values)


class GoodputPlanner:
    """Chooses each step's batch node budget from live costs and calibrated values.

    The engine reports, every step: the verify forward's wall time with its
    number of query rows (:meth:`observe_verify`), the drafting time
    (:meth:`observe_draft`) and, per verified tree, its nodes and accepted
    paths (:meth:`observe_acceptance`). :meth:`prune` then keeps the
    goodput-optimal subset of the freshly drafted nodes, and
    :meth:`draft_depth` says how deep to draft next.
    Until ``warmup`` verify steps have been timed, trees are left as drafted.
    """

    def __init__(self, max_depth: int, warmup: int = 8, window: int = 64, decay: float = 0.9):
        self.verify_cost = LinearCost(window=window)  # steps without trees: seconds vs rows
        self.forward_cost = DriftingCost()  # the same steps, for the shape bandit
        self.tree_overhead = 0.0  # EMA: extra seconds of a verify step that holds trees
        self.calibration = ValueCalibration(max_depth=max_depth)
        self.draft_seconds = 0.0
        self.warmup = warmup
        self.steps_timed = 0
        self.last_plan: BudgetPlan | None = None
        self.request_factor: dict[str, float] = {}  # per-request EMA accepted / predicted
        self.kept_depth: int | None = None  # deepest node the last plan kept
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

    def observe_verify(self, query_rows: int, seconds: float, tree_rows: int = 0,
                       decode: bool = True, probe: bool = False) -> None:
        """A verify forward's wall time. Steps without trees (prefills, plain
        decodes, the start-up probe) fit the per-row cost; steps with trees
        update the extra cost a tree step carries on top (tree attention).
        ``decode``: the step has no prefill rows. ``probe``: a start-up probe
        forward, whose point both lines keep for good: a server at a steady
        batch size verifies a few row counts only (batch 1: 1 to 5 rows),
        and a line fitted on those alone takes its slope from the machine's
        drift. (In a 40-minute run at batch 1 the bandit's cost of a chain
        one deeper, ~1.2 ms in step profiles, wandered from 0.5 to 4 ms and
        it followed it between chain-2 and chain-4. With the probe's points
        kept, the same 40-minute run on the AVX2 kind held that figure
        within 2.2-3.2 ms over 2117 picks, ``scripts/read_trace.py``; this
        host's steps take about twice as long. That was a different host,
        not an A/B on one, but the drafting line, ChainDraftCost, which adds
        to the same figure, was left unchanged.)"""
        if probe:
            self.verify_cost.anchor(query_rows, seconds)
            self.forward_cost.observe(query_rows, seconds, anchor=True)
        elif tree_rows == 0:
            self.verify_cost.observe(query_rows, seconds)
            self.forward_cost.observe(query_rows, seconds, decode=decode)
        else:
            extra = max(seconds - self.step_cost(query_rows), 0.0)
            self.tree_overhead = extra if self.tree_overhead == 0.0 else \
                0.9 * self.tree_overhead + 0.1 * extra
        self.steps_timed += 1

    def observe_draft(self, seconds: float) -> None:
        """A step's drafting time (reported in ``eagle2_stats``; :meth:`prune`
        does not weigh it: by then it is spent)."""
        self.draft_seconds = seconds if self.draft_seconds == 0.0 else \
            0.9 * self.draft_seconds + 0.1 * seconds

    def observe_acceptance(self, tree: TreeBatch, num_accepted: torch.Tensor,
                           accepted_nodes: torch.Tensor, req_ids=None) -> None:
        """Learn from one verified batch: ``accepted_nodes`` [B, >= max accepted]
        (request-local indices, from ``core.verify``) are the accepted paths.
        Updates the value calibration and, with ``req_ids``, each request's own
        factor (so requests whose drafts the target keeps accepting, such as
        code, earn larger trees than requests it keeps rejecting). Nodes with
        unknown path values (NaN) are skipped."""
        cu, par = tree.cu_nodes.tolist(), tree.parent.tolist()
        val, dep = tree.value.tolist(), tree.depth.tolist()
        acc = num_accepted.reshape(-1).tolist()
        paths = accepted_nodes.tolist()
        hit = {cu[b] + n for b, path in enumerate(paths) for n in path[:int(acc[b])]}
        drafted = [g for g in range(len(par)) if par[g] >= 0 and not math.isnan(val[g])]
        if not drafted:
            return
        value, depth = [val[g] for g in drafted], [dep[g] for g in drafted]
        if req_ids is not None:
            req = tree.request_index.tolist()
            per_req = [0.0] * (len(cu) - 1)
            for g, p in zip(drafted, self.calibration.calibrated(value, depth)):
                per_req[req[g]] += p
            for r, n, pr in zip(req_ids, acc, per_req):
                if pr > 1e-6:
                    ratio = min(max(n / pr, 0.05), 20.0)
                    old = self.request_factor.get(r, 1.0)
                    self.request_factor[r] = self.decay * old + (1 - self.decay) * ratio
        self.calibration.observe(value, depth, [g in hit for g in drafted])

    def accept_prob(self, tree: TreeBatch, req_ids=None) -> torch.Tensor:
        """float [total]: each node's estimated acceptance probability (calibrated,
        times its request's factor, never above its parent's; roots 1)."""
        rf = [1.0] * tree.num_requests if req_ids is None else \
            [self.request_factor.get(r, 1.0) for r in req_ids]
        cu, par = tree.cu_nodes.tolist(), tree.parent.tolist()
        q = self.calibration.calibrated(tree.value.tolist(), tree.depth.tolist())
        p = [1.0] * len(par)
        for b, (s, e) in enumerate(zip(cu, cu[1:])):
            for i in range(s + 1, e):  # parents first
                x = min(max(q[i] * rf[b], 0.0), 1.0)
                p[i] = x if math.isnan(x) or x <= p[s + par[i]] else p[s + par[i]]
        return torch.tensor(p, dtype=torch.float32)

    def prune(self, tree: TreeBatch, other_rows: int = 0, req_ids=None) -> TreeBatch:
        """``tree`` cut to the best budget; ``other_rows``: query rows of the
        step that are not trees (prefill chunks, plain decodes); ``req_ids``:
        the trees' request ids, for per-request calibration."""
        if self.steps_timed < self.warmup:
            return tree
        drafted = tree.parent >= 0
        p_all = self.accept_prob(tree, req_ids)
        p = p_all[drafted]
        cost = self.step_cost
        # Two shapes: any ancestor-closed subset (pays the tree-step overhead,
        # i.e. tree attention), or each request's greedy chain (a causal mask:
        # no overhead). The faster wins; ties go to the chain. The drafting is
        # done and paid whatever is kept, so it is not weighed here (charged
        # to every plan that kept a node, it cut unconfident trees to nothing:
        # 72 of 493 tree-arm steps verified no drafts at batch 1); whether to
        # draft at all is the shape bandit's pick, which counts drafting.
        chain = best_chains(tree)
        as_tree = plan_budget(p, tree.num_requests, cost, self.tree_overhead,
                              other_rows=other_rows)
        as_chain = plan_budget(p[chain[drafted]], tree.num_requests, cost, 0.0,
                               other_rows=other_rows)
        as_chain.chain = True
        plan = as_chain if as_chain.tokens_per_second >= as_tree.tokens_per_second else as_tree
        self.last_plan = plan
        if plan.num_nodes == 0:
            self.kept_depth = 0
            return prune_to_top(tree, 0)
        pruned = prune_to_top(tree, plan.num_nodes, score=p_all.clamp(min=1e-30).log(),
                              allowed=chain if plan.chain else None)
        self.kept_depth = int(pruned.depth.max())
        return pruned

    def step_cost(self, query_rows: float) -> float:
        """The target forward's seconds at ``query_rows`` as trees are sized
        against: the shaped forward model (:class:`DriftingCost`, the shape
        bandit's) once the start-up probe gave it a profile, else the line
        ``verify_cost``. The forward is not a line at few rows (AVX2 host,
        ``scripts/forward_by_rows.py``: 29.5-30 ms at 3 to 6 rows, then ~+1 ms
        a row), and the line's 0.87 ms a row charged a batch-1 tree ~3% of
        its step for each node the forward carries at no cost."""
        if self.forward_cost.profile():
            return self.forward_cost(query_rows)
        return self.verify_cost(query_rows)

    def draft_depth(self, max_depth: int) -> int:
        """How deep to draft this step: one level past the deepest node the
        last plan kept (so depth can grow back), at most ``max_depth``."""
        if self.steps_timed < self.warmup or self.kept_depth is None:
            return max_depth
        return max(1, min(max_depth, self.kept_depth + 1))


def chain_length(arm: str | None) -> int | None:
    """K of a :class:`ShapeBandit` arm "chain-K" (None: any other arm, or no arm)."""
    return int(arm[len("chain-"):]) if arm is not None and arm.startswith("chain-") else None


class ShapeBandit:
    """Chooses the drafting shape by measured goodput: "plain" (no drafts),
    "chain-K" (the head's greedy chain of K tokens) for K = 1..max_depth, or
    "tree" (the configured tree, sized per step by :class:`GoodputPlanner`).

    Measure, don't guess: each arm's rate is emitted tokens per second of
    whole engine steps (drafting, verification, scheduling and everything
    else a prediction would miss), from EMAs per batch-size bucket (nearest
    power of two, with hysteresis) of seconds, requests and tokens per
    step, since what pays at batch 1 does not at batch 64. An arm is kept
    for a window of ``window - 1`` counted steps, after one step that is not
    counted (it verifies the previous arm's drafts). Only steps without
    prefill rows are counted while there are any: prompts arrive in bursts
    (a round of requests finishing together), cost the same whatever the
    arm, and a step that carries one is several times slower than the
    steps around it, which made the arm that happened to run then look
    slow (and the arm whose prefill share was overestimated look fast). A
    window with no such step (prompts in every step) ends after
    ``4 * window`` steps and counts them all, with the prefill share the
    caller took out. A chain arm's tokens per request are not taken from its few
    steps (1 to K+1 tokens each: too noisy to rank arms on) but from the
    head's acceptance along its greedy chain, pooled over every verified
    chain of every bucket (acceptance does not depend on the batch size):
    ``1 + sum_d prod_{j <= d} q_j`` with ``q_j`` = P(depth j accepted | depth
    j-1 accepted) (:meth:`observe_chain`), each one standard error
    optimistic (:meth:`chain_tokens`). Nor, given a model of the target
    forward's cost (a :class:`DriftingCost`) and timed forwards, are plain's
    and the chains' seconds: a step is predicted as the model's forward at
    its query rows plus what the arm measured outside the forward and its
    drafting (:meth:`model_seconds`), so that the machine's drift, which
    moves every arm alike, no longer ranks the arms, and a chain-k never
    run is predicted too. So is the tree, once it has run in the bucket:
    its tokens per request are its greedy chain's, from the same pooled
    acceptance, plus what the rest of the tree adds over that chain,
    remembered over ~1000 trees (:meth:`tree_tokens`), its step from the
    same model, with its forward as the
    measured ratio to the line at its query rows (tree attention costs
    extra) at its measured rows per request (the planner sizes trees),
    plus its own time outside the forward and drafting: a tree window
    measured in a quick moment no longer outranks the chains once the
    machine is back to its speed (on the AVX2 machine at batch 4 it came
    within 0.1% of the best chain that way and ran more windows, each
    15-20% slower).

    A window's rate leaves out what speculating costs outside the decode
    steps it counts when the batch is in *lockstep*: requests that all have
    the same number of tokens left (fixed output lengths, ``ignore_eos``,
    as benchmarks send them) and would all finish in the same step under
    plain decoding, the next round's prompts then prefilled together in
    one step. Speculating breaks that for good (accepted lengths differ):
    requests finish one by one, and a burst of them ends in a drain at
    falling batch sizes. (Measured with the shape forced, batch 16, 64
    requests of 64 tokens, AVX2, ``scripts/bench_shapes.py --step-log``:
    chain-1's full-batch steps without prefill rows were 20% faster than
    plain's, its whole run 2% faster; its drain, 49 steps at 52 tok/s, cost
    13% of the run. The bandit drains on deeper chains, which lose less:
    in ``scripts/bench_paired.py --interleave`` cells on the same host,
    vLLM's K=2 ran 0.97x to 1.10x vanilla, with the bandit's chain-1
    windows 6-15% faster than its plain ones.)
    So while the batch is in lockstep (:meth:`choose`) the arms are ranked
    by :meth:`lockstep_rate`, each speculative arm's rate over the work
    still to do (the batch's tokens left and the requests queued behind
    it) with that drain at its end (simulated from finished requests'
    speeds: the slow ones finish last, :meth:`_lockstep_run`), and with plain best no other arm is
    explored (one window of it would break the lockstep). On the AVX-512
    host, batch 16, 64 requests of 64 tokens (4 rounds), chain-1's
    full-batch steps ran 13% faster than plain's and its whole run 2-4%
    slower; with that run's step times, its drain over 4 rounds takes ~6%
    off its rate, which leaves it within the margin of plain (in the
    interleaved benchmark the model's own figures put chain-2 above plain
    at the first pick, and it ran). At batch 4, 8 rounds, the same
    estimate keeps most of chain-3's lead (~27% to ~20%). Once the lockstep is gone
    (requests of different lengths, as a server's are, or broken already)
    there is nothing left to lose: arms are ranked by :meth:`rate`. Either
    way a more speculative arm must be ``margin`` (2%) faster than the best
    less speculative one (a smaller difference may be noise), and in
    lockstep faster than plain by ``lockstep_margin`` (10%, :meth:`best`).

    Exploring costs throughput, so it is a local search over the arms in
    order of how much they speculate (plain < chain-1 < ... < chain-D <
    tree), along which the rate rises then falls:

    * a bucket not measured yet starts from the best arm of the nearest
      measured bucket (else chain-1; plain in lockstep, then chain-1 once
      if no bucket has measured a chain's parts, so it can be predicted);
    * while a neighbour of the bucket's best arm is unmeasured, it is tried
      (so the search walks uphill and stops at a peak), and so is the next
      arm past a neighbour measured within ``margin`` (2%) of the bar it
      must clear to be chosen (:meth:`_gap`: a difference that small may be
      noise, not a slope; a wider margin sent the search through every arm
      at batch 16, where all were within 15%). The bar includes the
      margins of :meth:`best`: with plain best, chain-2 is only tried if
      chain-1 came within 2% of beating plain by its margin (measuring
      against plain itself walked through chain-2..4 at batch 64, each
      20-40% slower than plain);
    * in lockstep with plain best, nothing else is tried (above);
    * plain is measured in every bucket (unless the model predicts it from
      a nearby bucket's) and always re-measured like a neighbour (at batch
      16 a run started from chain-2, measured chain-1 slower in a slow
      moment and never tried plain, the fastest there);
    * while a chain is best, a tree measured in the bucket is a neighbour
      too (otherwise only chain-D's: at batch 1 a tree measured on a fresh
      engine's first prompt was never run again once chain-2 led);
    * once the best arm has run in the bucket, a neighbouring chain that
      has never run there (the model predicts it from query rows and
      drafting depths the bucket has not run, or, next to plain, from
      another bucket's measured parts) is run once;
    * then the best arm is kept, and a neighbour (other than, while a chain
      is best, a shorter chain the model predicts from its own measured
      drafting: the best chain verifies every depth it has, not a longer
      chain's last, :meth:`_predicted`) is re-measured once its turn
      comes: after ``explore_every`` windows, times ``(1 + gap / 0.05) **
      2`` where ``gap`` is how much faster it must get to be chosen,
      margins included (:meth:`_gap`): a neighbour
      within 2% is revisited every 16 windows, one that needs 20% every
      200 (~40 s at batch 1), costing 0.1%. Squared, not linear (every 5 x
      8 windows at 20%): the arms far from the best are those the model
      already predicts well (plain, the chains) or whose one window is
      costly (the tree at batch 1, 40% slower), and at batch 1 (AVX-512,
      ``scripts/trace_bandit.py --batch 1 --requests 32``) their
      re-measurements took ~1.5% of a run's steps. Linear, though, for an
      arm run in one window only: one window is one noisy sample (a fresh
      engine's tree window runs during the planner's warm-up, on the first
      prompt's text), and its second costs one window per bucket.
    """

    def __init__(self, max_depth: int, window: int = 4, explore_every: int = 8,
                 decay: float = 0.7, margin: float = 0.02, speculation_margin: float = 0.10,
                 lockstep_margin: float = 0.10, lockstep_optimism: float = -1.0,
                 verify_cost: LinearCost | DriftingCost | None = None):
        # the target forward's seconds vs query rows: scales steps to the
        # bucket's size, and predicts plain and chain steps (model_seconds)
        self.verify_cost = verify_cost
        self.arms = ["plain"] + [f"chain-{k}" for k in range(1, max_depth + 1)] + ["tree"]
        self.window = window
        self.explore_every = explore_every
        self.decay = decay
        self.margin = margin
        self.speculation_margin = speculation_margin
        self.lockstep_margin = lockstep_margin
        # standard errors of acceptance lockstep_rate takes (negative: pessimistic)
        self.lockstep_optimism = lockstep_optimism
        # bucket -> arm -> [tokens, seconds, windows, requests] (per-step EMAs;
        # windows: a count)
        self.stats: dict[int, dict[str, list[float]]] = {}
        # the cost model's measured parts (model_seconds), per-step EMAs:
        # bucket -> "plain" / "chain" -> seconds outside the target forward
        # and drafting (every chain length pooled); bucket -> chain drafting
        self._other: dict[int, dict[str, float]] = {}
        self._draft: dict[int, ChainDraftCost] = {}
        # bucket -> the tree's measured parts, per-step EMAs: "ratio" (its
        # forward over the model's at its rows), "rows" per request,
        # "other" (outside the forward and drafting) and "draft" seconds
        self._tree: dict[int, dict[str, float]] = {}
        # bucket -> the tree's tokens (observe_tree), decayed per tree:
        # [trees, tokens its accepted paths added over their greedy chains,
        #  trees whose greedy chain was 0, 1, ..., max_depth nodes long]
        self._tree_tokens: dict[int, list[float]] = {}
        self._waited: dict[int, dict[str, int]] = {}  # bucket -> neighbour -> windows since measured
        self._closed: dict[int, int] = {}  # bucket -> windows measured in it
        self._last: dict[int, dict[str, int]] = {}  # bucket -> arm -> its last window's number
        self.reached = [0.0] * max_depth   # chains whose depth d was verified, d-1 accepted
        self.accepted = [0.0] * max_depth  # ... and depth d accepted too
        self.current = "chain-1"
        self.lockstep = False  # whether the batch of the last choose() was in lockstep
        self.horizon = 1.0  # its work left in rounds of the batch (choose)
        self.waiting = 0  # requests queued behind the batch (choose)
        self.lifetime: float | None = None  # in lockstep, its requests' max_tokens (choose)
        # _once_per_pick's values while one choose() picks (None: not picking)
        self._pick_memo: dict[tuple, object] | None = None
        self._orders: dict[int, list[int]] = {}  # requests -> _lockstep_schedule's dealing order
        # the last finished requests' speeds: tokens they emitted on chain
        # steps over the tokens the pooled acceptance expected of those steps
        # (observe_request_speed; lockstep_rate simulates drains with them)
        self.speeds: list[float] = []
        self._bucket = -1  # no window yet (every batch size is >= 0.75 octaves from it)
        # this window: [tokens, seconds, counted steps, requests] of its steps
        # without prefill rows ("clean") and of the others; and its steps so far
        self._acc = self._empty_window()
        self._steps = 0
        self._skip = False
        # called with a dict per pick (trace_record), e.g. the runner's
        # VLLM_EAGLE2_TRACE file; None: no tracing
        self.trace: Callable[[dict], None] | None = None

    @staticmethod
    def _empty_window() -> dict[str, list[float]]:
        # [tokens, seconds, counted steps, requests, drafting s, other s,
        #  steps with the forward timed, forward / model's forward at the
        #  step's rows, query rows per request]
        return {"clean": [0.0, 0.0, 0, 0.0, 0.0, 0.0, 0, 0.0, 0.0],
                "prefill": [0.0, 0.0, 0, 0.0, 0.0, 0.0, 0, 0.0, 0.0]}

    @staticmethod
    def bucket(batch_size: int) -> int:
        """The nearest power of two's exponent (batch 45..90 -> 6, i.e. "64")."""
        return round(math.log2(max(int(batch_size), 1)))

    def _sticky_bucket(self, batch_size: int) -> int:
        """:meth:`bucket`, with hysteresis: a batch that drifts around a bucket
        boundary (requests finishing and being replaced) stays in the current
        bucket until it is 0.75 octaves away from it."""
        x = math.log2(max(int(batch_size), 1))
        return self._bucket if abs(x - self._bucket) < 0.75 else round(x)

    def observe_chain(self, drafted: list[int], accepted: list[int], decay: float = 0.999) -> None:
        """One verify step's greedy chains: drafted length and accepted count
        per request. Earlier chains weigh ``decay`` per chain observed since
        (a memory of ~1 / (1 - decay) = 1000 chains at any batch size).

        Not per step, and not ~100 chains: with 0.99 per step, batch 1 kept
        ~100 chains, about the last one or two requests, and the estimates
        swung with their text (chain-4's expected tokens 1.6 to 4.7 within
        one run) a few dozen steps late; the best arm flipped between
        chain-2, chain-3 and chain-4 with them (AVX-512, bench_paired
        trace: 164, 374 and 518 windows of ~1100), and the free bandit
        took 414 engine steps where chain-3 alone took 396
        (``profile_steps.py --batch 1 --requests 12 chain-3 free``), 4%
        slower. A lagged pooled estimate cannot follow a request's text;
        the tree arm's planner does that, per request and per node, from
        the draft's own confidence."""
        f = decay ** len(drafted)
        self.reached = [f * x for x in self.reached]
        self.accepted = [f * x for x in self.accepted]
        for k, n in zip(drafted, accepted):
            for d in range(min(n + 1, k, len(self.reached))):  # depth d+1 was reached
                self.reached[d] += 1.0
                self.accepted[d] += float(n > d)

    def chain_tokens(self, k: int, optimism: float = 1.0) -> float:
        """Expected tokens a request emits per step on chain-k (accepted + bonus).
        Unobserved depths lean on the depth above (2 pseudo-observations).

        Each depth's acceptance is taken ``optimism`` standard errors
        optimistic, ``q + sqrt(n q (1 - q)) / (n + 2)`` after ``n`` chains
        reached it. Acceptance is only learnt while drafting, and depth d
        only while chains of d or more run, so an estimate made low by a
        few unlucky chains kept the arms that would correct it from running.
        Served on a fresh server, the first window (``vllm bench serve``'s
        random test prompt) accepted 0 of 3: with depth 1 unlifted, plain
        then ran 22 windows at batch 1 while vLLM's chain emitted ~1.9
        tokens a step; with depth 1 lifted but not depth 2, a first chain-2
        window that accepted nothing kept chain-1 for ~30 windows. The bound
        shrinks as chains are verified (0.05 after 100 at q = 0.45), and is
        0 at a depth no chain has reached (nothing to be optimistic about:
        the prior is the depth above)."""
        total, alive, q = 1.0, 1.0, 0.5
        for d in range(k):
            n = self.reached[d]
            q = (self.accepted[d] + 2.0 * q) / (n + 2.0)
            alive *= min(max(q + optimism * math.sqrt(n * q * (1.0 - q)) / (n + 2.0), 0.0), 1.0)
            total += alive
        return total

    def observe_tree(self, drafted: list[int], covered: list[int], accepted: list[int],
                     decay: float = 0.999) -> None:
        """One verify step of the tree arm, per request: how long the head's
        greedy chain inside its (pruned) tree was, how many of that chain's
        nodes the accepted path covers, and how many tokens were accepted
        (:func:`greedy_chain_acceptance`; the step's bucket is the current
        window's). Earlier trees weigh ``decay`` per tree since, as chains
        do (:meth:`observe_chain`)."""
        b = self._bucket
        st = self._tree_tokens.setdefault(b, [0.0, 0.0] + [0.0] * (len(self.reached) + 1))
        f = decay ** len(drafted)
        st[:] = [f * x for x in st]
        for k, c, n in zip(drafted, covered, accepted):
            st[0] += 1.0
            st[1] += float(max(n - c, 0))
            st[2 + min(max(k, 0), len(self.reached))] += 1.0

    def tree_tokens(self, bucket: int, optimism: float = 1.0) -> float | None:
        """Expected tokens a request emits per step on the tree arm in
        ``bucket`` (None: no tree verified there): 1 (the bonus token), plus
        the expected accepted length of its greedy chain at the lengths that
        chain had (the pooled chain acceptance of :meth:`chain_tokens`,
        ``optimism`` standard errors optimistic as for the chains), plus the
        mean number of tokens its accepted paths added over that chain.

        Not the tree's own windows' tokens per step: an EMA over a few
        windows (0.7 a window) follows the text of the request the tree last
        ran on, while the chains are ranked on ~1000 chains of pooled
        acceptance. Pinned at batch 1 (AVX-512 Intel host,
        ``scripts/bench_shapes.py --shape chain-3,chain-4,tree --batch 1``)
        the tree's steps emitted 2.10 tokens and its windows' estimate read
        1.52 (the last request's end, 5 tokens in 3 steps), so it was
        predicted 25% slower than it ran; at batch 2 (a drain, a few
        windows) it was the best arm in 10 of 24 picks of the interleaved
        run on that host (``bench_paired.py --interleave``). With
        the greedy chain's part from the pooled acceptance, the tree and the
        chains are ranked on the same memory of the text."""
        st = self._tree_tokens.get(bucket)
        if st is None or st[0] <= 0.0:
            return None
        chain = sum(w * (self.chain_tokens(k, optimism) - 1.0)
                    for k, w in enumerate(st[2:]) if w > 0.0)
        return 1.0 + (chain + st[1]) / st[0]

    @staticmethod
    def _nearest(table: dict, bucket: int, key=None):
        """``table[b]`` of the bucket nearest ``bucket`` (itself first) that
        has ``key`` (any entry when None); None: no such bucket."""
        have = [b for b, v in table.items() if (v if key is None else key in v)]
        return table[min(have, key=lambda b: (abs(b - bucket), b))] if have else None

    def _speed(self) -> float:
        """The machine's speed of the moment as the forward model sees it
        (:class:`DriftingCost`'s observed / fitted EMA; 1 for any other model)."""
        return getattr(self.verify_cost, "speed", 1.0)

    def draft_seconds(self, bucket: int, k: int) -> float:
        """Drafting seconds per step of chain-k in ``bucket``: the bucket's
        :class:`ChainDraftCost` (a line over k fitted on its chain windows
        of every length, at speed 1), else 0, times the machine's speed of
        the moment. A bucket with no chain measured yet borrows the nearest
        bucket's (the head's forwards cost about the same at any batch size
        here: few rows, one layer).

        Stored at speed 1 (:meth:`_speed`, taken out when stored, put back
        here), as the forward is: a length not run for a while otherwise
        kept a slower or quicker moment's seconds, and the machine drifts
        (±10% within a run) by about one depth's cost."""
        measured = self._nearest(self._draft, bucket)
        return 0.0 if measured is None else measured(k) * self._speed()

    def model_seconds(self, bucket: int, arm: str) -> float | None:
        """Predicted seconds of one step of ``arm`` at the bucket's batch size
        N (its power of two): the verify-cost model at N query rows (plain)
        or N x (1 + k) (chain-k), plus what the arm's steps measured outside
        the forward (scheduling, sampling, ...; chains pooled) and chain-k's
        drafting (:meth:`draft_seconds`). The measured parts of a bucket that
        has not run the arm yet are the nearest bucket's: so a bucket the
        batch enters (a run's drain passes through 8, 4, 2, 1) starts from
        the shape the model predicts best there, not from a search that
        measures plain first. The tree: its forward ratio times the model at
        N x its rows per request, plus its time outside the forward and its
        drafting, all measured in this bucket (a tree's size depends on the
        batch size, so none are borrowed). None: no verify-cost model, or
        nothing measured yet."""
        k = chain_length(arm)
        if self.verify_cost is None:
            return None
        if arm == "tree":
            t = self._tree.get(bucket)
            if t is None:
                return None
            n = float(1 << bucket)
            return t["ratio"] * self.verify_cost(n * t["rows"]) + t["other"] + t["draft"]
        if k is None and arm != "plain":
            return None
        key = "plain" if k is None else "chain"
        others = self._nearest(self._other, bucket, key)
        if others is None:
            return None
        other = others[key]
        n = float(1 << bucket)
        if k is None:
            return self.verify_cost(n) + other
        return self.verify_cost(n * (1 + k)) + other + self.draft_seconds(bucket, k)

    def rate(self, bucket: int, arm: str, optimism: float = 1.0) -> float | None:
        """Emitted tokens per second of ``arm`` in ``bucket`` (None: not measured).
        ``optimism``: of the expected tokens (:meth:`chain_tokens`,
        :meth:`tree_tokens`).

        Plain and chain arms, with a verify-cost model and timed forwards:
        ``N x tokens per request / model_seconds``, a chain-k predicted
        for every k once any chain has run in the bucket (or a nearby
        one). The target forward, most of a step and what drifts with the
        machine, comes from one model fitted on every recent decode forward
        (so a slow moment moves every arm alike); the rest is measured per
        arm and small. So arms
        are ranked with little noise, not by their own few windows: a
        chain-2 window measured 10% slow in a slow moment no longer left
        chain-1 chosen for the rest of a run (issue 6, batch 16 on AVX2),
        nor did chain-1 windows measured fast in a quick one choose it
        over plain at batch 64. The tree by the model's step and
        :meth:`tree_tokens` (its own windows' tokens per request where it
        has no verified trees to go on); every arm without a model by its
        own windows."""
        k = chain_length(arm)
        seconds = self.model_seconds(bucket, arm)
        st = self.stats.get(bucket, {}).get(arm)
        if seconds is not None and (arm != "tree" or (st is not None and st[3] > 0)):
            if arm == "tree":
                tokens = self.tree_tokens(bucket, optimism)
                tokens = st[0] / st[3] if tokens is None else tokens
            else:
                tokens = 1.0 if k is None else self.chain_tokens(k, optimism)
            return (1 << bucket) * tokens / max(seconds, 1e-12)
        if st is None or st[1] <= 0:
            return None
        if k is not None:
            return st[3] * self.chain_tokens(k, optimism) / st[1]
        return st[0] / st[1]

    def lockstep_rate(self, bucket: int, arm: str) -> float | None:
        """:meth:`rate`, over the work left to a batch in lockstep (``horizon``
        rounds of it, :meth:`choose`) when that work ends in the drain
        speculating leaves (the class docstring). Once finished requests'
        speeds are known, that work is simulated (:meth:`_lockstep_run`,
        plain's too); until then, this model of it. Once requests finish one
        by one and are replaced as they go, they soon finish at any step,
        and the last round drains from N requests to 0 over about one
        request's lifetime (L / tau steps; at batch 16 on this host, 4
        rounds of 64 tokens on chain-1, 53 partial steps where a lifetime
        was 41): its half-round of tokens is emitted at half the batch, in
        L / tau steps of t(N / 2) where a full batch would take half as
        many of t(N). Over H rounds the arm's steps then take
        (L / tau) x (H t(N) + t(N / 2) - t(N) / 2) instead of
        (L / tau) x H t(N), and the rate is ``rate x t(N) / (t(N) +
        (t(N / 2) - t(N) / 2) / H)`` (L cancels; H taken as at least one
        round, since a lockstep broken late still drains; one round that
        speculates from its start drains less, so this leans to plain
        there). t: :meth:`model_seconds`, with the forward at half the rows
        (the time outside the forward and drafting hardly depends on the
        batch: 3.7 ms a step at batch 1, 4.6 at 16, chain-1). Plain's own
        rate (nothing to drain); an arm without a model: its rate over
        ``1 + speculation_margin``.

        Without the optimism of :meth:`rate` (each depth's acceptance one
        standard error high, there so that arms are tried again): a
        speculative window breaks the lockstep for good, so there is
        nothing to learn by trying it, only the lockstep to lose. At batch
        64 on the AVX-512 host (``scripts/bench_shapes.py --shape
        plain,chain-1 --rounds 2 --batch 64 --requests 256``) chain-1's
        full-batch steps ran 3.8% faster than plain's and its whole runs
        3.3% slower; the optimistic lockstep rate had put it 2.8% above
        plain (over the margin) in a fresh engine's first timed batch, the
        unbiased one 1.9% (under it).

        Nor unbiased: ``lockstep_optimism`` (-1) standard errors, each
        depth's acceptance one standard error low, a lower bound for a
        choice that cannot be taken back. A fresh engine's first lockstep
        batch is picked on the few chains its warm-up verified: at batch 16
        (AVX-512 AMD, ``bench_paired.py --interleave --restart-every 2``)
        one restarted engine put chain-1 at 1.104x plain on them, just over
        the lockstep margin, and its cell ran chains at 0.96 of vanilla;
        the warm-up's prompts had accepted more than the cell's (1.66
        tokens a step expected, 1.55 measured)."""
        r = self.rate(bucket, arm, optimism=self.lockstep_optimism)
        if r is None:
            return r
        run = self._lockstep_run(bucket, arm)
        if run is not None:
            return run
        if arm == "plain":
            return r
        t = self.model_seconds(bucket, arm)
        if t is None:
            return r / (1.0 + self.speculation_margin)
        n = float(1 << bucket)
        k = chain_length(arm)
        tree = self._tree.get(bucket, {})
        rows = n * (1 + k) if k is not None else n * tree["rows"]
        ratio = 1.0 if k is not None else tree["ratio"]
        half = t - ratio * (self.verify_cost(rows) - self.verify_cost(rows / 2))
        return r * t / (t + max(half - 0.5 * t, 0.0) / max(self.horizon, 1.0))

    MIN_SPEEDS = 16
    """Finished requests' speeds needed before :meth:`_lockstep_run`
    simulates a lockstep's work (until then, :meth:`lockstep_rate`'s model)."""

    MAX_ROUNDS = 8
    """Rounds of the batch a lockstep simulation runs at most (the queue
    beyond them is left out: its drain weighs less and less)."""

    def observe_request_speed(self, speed: float) -> None:
        """A finished request's speed: the tokens it emitted on chain steps
        over what the pooled chain acceptance expected of those steps
        (:meth:`chain_tokens`; 1: as fast as the average request). The last
        256 are kept for :meth:`_lockstep_run`."""
        self.speeds = self.speeds[-255:] + [float(speed)]

    def _lockstep_run(self, bucket: int, arm: str) -> float | None:
        """Emitted tokens per second of the lockstep's work left on ``arm``,
        simulated: the batch's N requests with the tokens they have left,
        then the queued ones (``waiting``, :meth:`choose`; at most
        :attr:`MAX_ROUNDS` rounds in all) with ``lifetime`` tokens each,
        each taking its tokens over (its speed x the arm's tokens per
        step) steps, a queued request starting on the first slot freed;
        the steps' seconds are the model's (:meth:`model_seconds` parts) at
        the number of requests running. Each request's speed is a quantile
        of the finished requests' (:meth:`observe_request_speed`), the
        quantiles dealt in a fixed shuffled order (the same on every TP
        rank). Plain: every request's speed is 1 and tokens per step 1.
        None: no lifetime (not in lockstep), fewer than :attr:`MIN_SPEEDS`
        speeds, or no model for the arm.

        Why: requests' acceptance differs by their text (a fast one emits
        2.5 tokens a chain-2 step where a slow one emits 1.3), so a
        lockstep broken by speculation does not finish evenly over one
        lifetime at half the batch, as :meth:`lockstep_rate`'s model had
        it: the slowest requests finish last, at a small batch. At batch
        16, 32 requests of 64 tokens (AVX2, ``scripts/bench_shapes.py
        --shape plain,chain-1,chain-2 --rounds 2 --batch 16 --requests
        32``) the first round's requests finished from step 24 to step 54,
        the drains took 47 steps a round (1.3 lifetimes) down to batch 1,
        and chain-1 and chain-2, whose full-batch steps ran 8% and 11%
        faster than plain's, ran whole runs 4% to 8% slower; at batch 4,
        8 rounds, their drains cost about half what that model said."""
        if self.lifetime is None or len(self.speeds) < self.MIN_SPEEDS \
                or self.verify_cost is None:
            return None
        n = 1 << bucket
        k = chain_length(arm)
        if arm == "plain":
            tau = 1.0
            seconds = self.model_seconds(bucket, arm)
            if seconds is None:
                return None
            fixed = seconds - self.verify_cost(float(n))
            step = [fixed + self.verify_cost(float(m)) for m in range(n + 1)]
        elif k is not None:
            seconds = self.model_seconds(bucket, arm)
            if seconds is None:
                return None
            tau = self.chain_tokens(k, optimism=self.lockstep_optimism)
            fixed = seconds - self.verify_cost(float(n * (1 + k)))
            step = [fixed + self.verify_cost(float(m * (1 + k))) for m in range(n + 1)]
        else:
            t = self._tree.get(bucket)
            tau = self.tree_tokens(bucket, self.lockstep_optimism)
            if t is None or tau is None:
                return None
            fixed = t["other"] + t["draft"]
            step = [fixed + t["ratio"] * self.verify_cost(m * t["rows"]) for m in range(n + 1)]
        if tau <= 0.0:
            return None
        work, busy = self._lockstep_schedule(n, plain=arm == "plain")
        # the schedule at tau 1, its times over tau: steps with r running x their seconds
        total = sum(steps * step[r] for r, steps in enumerate(busy) if r > 0 and steps > 0.0) / tau
        return work / total if total > 0.0 else None

    def _lockstep_schedule(self, n: int, plain: bool) -> tuple[float, list[float]]:
        """:meth:`_lockstep_run`'s requests at one token a step (tau 1): the
        tokens of all the work, and the steps run with r requests running
        (index r, 0..n). An arm's own tau scales every start and end alike,
        so each arm's steps are these over its tau; plain's requests all
        have speed 1, every other arm's the same quantiles. Within one
        :meth:`choose`'s pick the two schedules are computed once."""
        return self._once_per_pick(("schedule", n, plain),
                                   lambda: self._schedule_requests(n, plain))

    def _schedule_requests(self, n: int, plain: bool) -> tuple[float, list[float]]:
        """:meth:`_lockstep_schedule`, computed."""
        L = float(self.lifetime)
        left = max(self.horizon - self.waiting / n, 0.0) * L  # tokens left per running request
        queued = min(self.waiting, max(self.MAX_ROUNDS - 1, 0) * n)
        work = [left] * n + [L] * queued
        m = len(work)
        if plain:
            speeds = [1.0] * m
        else:
            order = self._orders.get(m)
            if order is None:
                order = list(range(m))
                random.Random(m).shuffle(order)
                self._orders[m] = order
            ranked = sorted(self.speeds)
            speeds = [ranked[min(int((q + 0.5) * len(ranked) / m), len(ranked) - 1)]
                      for q in order]
        # each request's steps; a queued one starts on the first slot freed
        free: list[float] = []  # the running requests' ends (a heap)
        spans = []
        for i, tokens in enumerate(work):
            start = heapq.heappop(free) if i >= n else 0.0
            end = start + tokens / max(speeds[i], 1e-6)
            spans.append((start, end))
            heapq.heappush(free, end)
        edges = sorted({x for span in spans for x in span})
        events = [(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans]
        events.sort()
        busy = [0.0] * (n + 1)
        running, j = 0, 0
        for a, b in zip(edges, edges[1:]):
            while j < len(events) and events[j][0] <= a:
                running += events[j][1]
                j += 1
            busy[min(max(running, 0), n)] += b - a
        return sum(work), busy

    def _once_per_pick(self, key: tuple, compute):
        """``compute()``, once per ``key`` while one :meth:`choose` picks (and
        traces) an arm: nothing a ranking rate or a lockstep schedule
        depends on changes in between. Outside a pick, computed each time."""
        memo = self._pick_memo
        if memo is None:
            return compute()
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def _ranked(self, bucket: int, arm: str) -> float | None:
        """The rate arms are ranked by: :meth:`lockstep_rate` in lockstep,
        else :meth:`rate`. Within one :meth:`choose`'s pick each is computed
        once (a lockstep simulation is ~0.1 ms; a pick and its trace record
        asked for each up to three times: 0.6 + 1.0 ms a window at batch 16)."""
        return self._once_per_pick(
            (bucket, arm),
            lambda: self.lockstep_rate(bucket, arm) if self.lockstep else self.rate(bucket, arm))

    def best(self, bucket: int) -> str | None:
        """The bucket's fastest measured arm (None: nothing measured) by
        :meth:`_ranked`, in order of how much they speculate, where a more
        speculative arm must be ``margin`` faster than the best less
        speculative one (see the class docstring); in lockstep, faster than
        plain by ``lockstep_margin``.

        In lockstep a speculative pick cannot be taken back (it breaks the
        lockstep for good), and :meth:`_lockstep_run`'s simulation leaves
        out what the queued prompts cost when they are prefilled one by one
        among the decodes, and rests on one moment's forward model. At batch
        16 on AVX2 (``scripts/bench_paired.py --interleave --restart-every
        2 --batch-sizes 4 16 64 --rounds 6``) it put chain-1 2-8% over
        plain at the cells' first picks in 4 of 6 rounds, and those rounds
        ran 0.83-0.97 of vanilla where the plain ones ran 0.96-0.98; at
        batch 4 it puts chain-2 ~27% over plain, which holds (1.3x
        vanilla)."""
        best, best_rate = None, 0.0
        for a in self.arms:
            r = self._ranked(bucket, a)
            m = self.lockstep_margin if self.lockstep and best == "plain" else self.margin
            if r is not None and (best is None or r > (1.0 + m) * best_rate):
                best, best_rate = a, r
        return best

    def _seed(self, bucket: int) -> str:
        if self.lockstep:
            return "plain"  # the one arm that keeps the lockstep (and measures the base)
        measured = sorted((abs(b - bucket), b) for b in self.stats if self.best(b) is not None)
        return self.best(measured[0][1]) if measured else "chain-1"

    def _gap(self, b: int, best: str, rival: str) -> float:
        """How much faster ``rival`` must get to replace ``best`` (a fraction;
        0: it is there) by :meth:`_ranked`, the margin of :meth:`best`
        included (in lockstep, a speculative arm's drain too: each window of
        it costs the lockstep)."""
        r, rb = self._ranked(b, rival), self._ranked(b, best)
        if self.arms.index(rival) > self.arms.index(best):
            bar = (1.0 + self.margin) * rb
        else:
            bar = rb / (1.0 + self.margin)
        return max(1.0 - r / bar, 0.0)

    def _predicted(self, b: int, arm: str, best: str, known: float = 100.0) -> bool:
        """Whether ``arm`` is a chain whose rate the cost model predicts in
        bucket ``b`` from its own measured drafting time and from depths
        the best chain ``best`` verifies: while ``best`` runs, re-measuring
        it would only refresh the chains' pooled time outside the forward,
        which ``best``'s windows keep fresh anyway.

        Not a longer chain: its deepest depth's acceptance is only learnt
        while chains that deep run, so while a shorter chain leads it is
        what a few early windows left (or the prior, the depth above).
        Served at batch 1 (AVX-512, ``scripts/bench_serve.py`` traced, issue
        6), chain-2 led for 264 windows with chain-3 predicted within 1% of
        its bar on depth 3's prior, and chain-3 was never run again; its
        own early windows had measured 94-107 tok/s against chain-2's
        76-77. So a longer chain counts as predicted only once ``known``
        (100) of the chains in memory reached its last depth (its acceptance
        then known to about ±0.05, one standard error); until then it is
        re-measured on the gap schedule. (Batch 16 keeps that many: ~64
        chains a window.)"""
        k, kb = chain_length(arm), chain_length(best)
        if k is None or kb is None or self.model_seconds(b, arm) is None \
                or k not in self._draft.get(b, {}):
            return False
        return k < kb or self.reached[k - 1] >= known  # chain-k's last depth

    def _pick(self, b: int) -> str:
        best = self.best(b)
        if best is None:
            return self._seed(b)
        if best == "plain" and self.lockstep:
            # exploring would break the lockstep (class docstring), unless
            # no chain is predicted at all yet (a fresh engine whose first
            # batch is in lockstep): then chain-1 runs once, or it never would
            return "chain-1" if "chain-1" in self.arms and self.rate(b, "chain-1") is None \
                else "plain"
        i = self.arms.index(best)
        neighbours = [self.arms[j] for j in (i - 1, i + 1) if 0 <= j < len(self.arms)]
        if "plain" not in neighbours and best != "plain":
            # plain is always a rival: it is the baseline, and noise can make
            # the arm between it and the best look slower than both
            if self.rate(b, "plain") is None:
                return "plain"
            neighbours.append("plain")
        if chain_length(best) is not None and "tree" not in neighbours \
                and self.rate(b, "tree") is not None:
            # while a chain leads, a tree measured in the bucket is a rival
            # too: its rate rests on its own few windows (its forward ratio,
            # rows, drafting, what it adds over its greedy chain), while the
            # chains share one pooled model. Otherwise reached only through
            # chain-D, it ran in a fresh engine's first windows (planner
            # warm-up, the first prompt's text) and never again once chain-2
            # led: at batch 1 (AVX2, bench_paired.py --restart-every 1) 3 of
            # 929 windows, predicted 15% under chain-2, where pinned it ran
            # -4% to +3% of chain-2. (Its re-measurements wait by its gap.)
            neighbours.append("tree")
        for step in (-1, 1):  # walk on past arms within `margin` of their bar (noise)
            j = i + step
            while 0 <= j < len(self.arms):
                if self.rate(b, self.arms[j]) is None:
                    return self.arms[j]
                if self._gap(b, best, self.arms[j]) > self.margin:
                    break
                j += step
        ran = self.stats.get(b, {})
        if best in ran:
            for n in neighbours:
                if chain_length(n) is not None and n not in ran:
                    # a chain the model predicts from rows and drafting this
                    # bucket has never run (or, next to plain, from another
                    # bucket's measured parts): run it once (batch 4, AVX2: a
                    # fresh bucket on chain-1 predicted chain-2 2% short and
                    # stayed on chain-1 for ~8 of ~70 windows until chain-2's
                    # turn came, which then won the rest; served, a bucket
                    # kept plain for a whole run on chain parts borrowed from
                    # one measured badly)
                    return n
        waited = self._waited.setdefault(b, {})
        due = []
        for n in neighbours:
            if self._predicted(b, n, best):
                continue  # the best chain's windows refresh the base it shares
            waited[n] = waited.get(n, 0) + 1
            # an arm run in one window only is one noisy sample (at a fresh
            # engine: the planner's warm-up, the first prompt's text): its
            # second window waits by the gap, not its square (batch 1, AVX2:
            # a tree first measured 18% under chain-2 waited ~200 windows
            # of a ~300-window engine, and ran level with chain-2 when it
            # came)
            power = 1 if ran.get(n, (0, 0, 0))[2] == 1 else 2
            if waited[n] >= self.explore_every * (1.0 + self._gap(b, best, n) / 0.05) ** power:
                due.append((waited[n], n))
        if due:
            n = max(due)[1]
            waited[n] = 0
            return n
        return best

    def choose(self, batch_size: int, lockstep: bool = False, horizon: float = 1.0,
               waiting: int = 0, lifetime: float | None = None) -> str:
        """The arm for this step's drafts. ``lockstep``: whether the batch's
        requests would all finish in the same step under plain decoding (the
        class docstring); a window ends early when the batch gains it (a new
        round of prompts, prefilled together), so that a speculative arm
        picked out of lockstep does not break it. ``horizon``: in lockstep,
        the work left in rounds of this batch (tokens left over each
        request's ``max_tokens``, plus the requests waiting over the batch
        size), over which :meth:`lockstep_rate` spreads the drain.
        ``waiting``: requests queued behind the batch; ``lifetime``: in
        lockstep, the tokens a request of it is given (``max_tokens``; both
        for :meth:`_lockstep_run`)."""
        b = self._sticky_bucket(batch_size)
        gained = lockstep and not self.lockstep
        self.waiting = waiting
        self.lifetime = lifetime if lockstep else None
        self.lockstep = lockstep
        self.horizon = horizon
        if b == self._bucket and not gained and self._acc["clean"][2] < self.window - 1 \
                and self._steps < 4 * self.window:
            self._steps += 1
            return self.current
        closed = self.current, self._bucket, self._acc["clean"][:3]
        self._close_window()
        self._bucket = b
        self._pick_memo = {}
        try:
            self.current = self._pick(b)
            self._steps = 1
            self._skip = True  # the window's first observation carries the previous arm's drafts
            if self.trace is not None:
                self.trace(self.trace_record(*closed))
        finally:
            self._pick_memo = None
        return self.current

    def trace_record(self, closed: str, closed_bucket: int, window: list[float]) -> dict:
        """What a pick was made from: the window that just closed (its shape,
        batch-size bucket, tokens, seconds and counted steps without prefill
        rows, scaled to the bucket's batch size), the shape picked and its
        bucket, whether the batch was in lockstep (and then the work left,
        and every shape's :meth:`lockstep_rate`, by which they were ranked),
        every shape's rate (tokens/s; measured or predicted, None: neither), the model's
        predicted step seconds (and, for plain and the chains, its forward
        and drafting parts), and the chains' expected tokens per request."""
        b = self._bucket
        rates = {a: self.rate(b, a) for a in self.arms}
        seconds = {a: self.model_seconds(b, a) for a in self.arms}
        ranked = {a: self._ranked(b, a) for a in self.arms} if self.lockstep else None
        return {
            "closed": {"shape": closed, "batch": 1 << closed_bucket if closed_bucket >= 0 else None,
                       "tokens": round(window[0], 2), "seconds": round(window[1], 5),
                       "steps": int(window[2])},
            "picked": self.current, "batch": 1 << b, "best": self.best(b),
            "lockstep": self.lockstep, "horizon": round(self.horizon, 3) if self.lockstep else None,
            "rates": {a: None if r is None else round(r, 2) for a, r in rates.items()},
            # in lockstep the arms are ranked by lockstep_rate, not rate
            "lockstep_rates": None if ranked is None else
            {a: None if r is None else round(r, 2) for a, r in ranked.items()},
            "step_ms": {a: None if x is None else round(1e3 * x, 2) for a, x in seconds.items()},
            # step_ms's parts for plain and the chains: the forward model at
            # the arm's rows, and the chains' drafting (None: no model)
            "forward_ms": None if self.verify_cost is None else
            {a: round(1e3 * self.verify_cost(float((1 << b) * (1 + (chain_length(a) or 0)))),
                      2) for a in self.arms if a != "tree"},
            "draft_ms": [round(1e3 * self.draft_seconds(b, k), 2)
                         for k in range(1, len(self.reached) + 1)],
            "chain_tokens": [round(self.chain_tokens(k), 3) for k in range(1, len(self.reached) + 1)],
            "speeds": len(self.speeds),
        }

    def observe(self, tokens: float, seconds: float, requests: float | None = None,
                prefill: bool = False, rows: int | None = None, draft: float = 0.0,
                forward: float | None = None) -> None:
        """One finished engine step under the current arm: tokens its decodes
        emitted, seconds (prefill's share taken out by the caller), decoding
        requests (default: ``tokens``), whether it carried prefill rows, the
        decoding requests' query rows, the seconds it spent drafting and in
        the target forward (None: not timed).

        With ``rows`` and a ``verify_cost``, a step of ``n`` requests is
        scaled to the bucket's batch size ``N`` (its power of two) before it
        is counted: tokens x N / n, and seconds plus the verify cost of the
        rows the missing (or extra) requests would add, ``verify_cost.b x
        rows / n x (N - n)``. A bucket holds batch sizes from 0.6x to 1.7x
        its own (hysteresis), and a run's drain passes through them:
        unscaled, plain measured at batch 10 in bucket 16 looks 28% slower
        than at 16 (a step of 20 ms + 0.65 ms per row, as measured live)."""
        if self._skip:
            self._skip = False
            return
        other = None if forward is None else max(seconds - forward - draft, 0.0)
        ratio = per_request = 0.0  # the tree's model parts (_close_window): tree windows only
        if self.current == "tree" and forward is not None and rows and requests \
                and self.verify_cost is not None:
            fitted = self.verify_cost(rows)
            ratio = forward / fitted if fitted > 0.0 else 0.0
            per_request = rows / float(requests)
        if rows is not None and requests and self.verify_cost is not None and self._bucket >= 0:
            n, size = float(requests), float(1 << self._bucket)
            tokens = tokens * size / n
            seconds = max(seconds + self.verify_cost.b * rows / n * (size - n), 0.1 * seconds)
            draft = draft * size / n  # one head forward over the batch per depth
            requests = size
        acc = self._acc["prefill" if prefill else "clean"]
        acc[0] += tokens
        acc[1] += seconds
        acc[2] += 1
        acc[3] += tokens if requests is None else requests
        acc[4] += draft
        if other is not None:
            acc[5] += other
            acc[6] += 1
            acc[7] += ratio
            acc[8] += per_request

    def _close_window(self) -> None:
        clean = self._acc["clean"]
        tok, sec, n, req, draft, other, timed, ratio, per_request = \
            clean if clean[2] > 0 else self._acc["prefill"]
        timed *= clean[2] > 0  # the model learns from steps without prefill rows only
        self._acc = self._empty_window()
        if n <= 0 or sec <= 0:
            return
        b, arm = self._bucket, self.current
        k = chain_length(arm)
        if self.verify_cost is not None and timed == n and (k is not None or arm == "plain"):
            # the model's measured parts (model_seconds)
            if k is not None:  # at speed 1 (draft_seconds)
                self._draft.setdefault(b, ChainDraftCost()).observe(k, draft / n / self._speed())
            others = self._other.setdefault(b, {})
            key = "plain" if k is None else "chain"
            others[key] = self._ema(others.get(key), other / n)
        number = self._closed[b] = self._closed.get(b, 0) + 1
        last = self._last.setdefault(b, {})
        age = number - last.get(arm, number) - 1  # windows of other arms since its last
        last[arm] = number
        # an arm re-measured after `age` windows of others: its old value is
        # as stale as it is old (the machine drifts, the planner learns), so
        # it weighs decay ** (1 + age / explore_every) (0.34 after 16
        # windows) rather than decay: one unlucky first window no longer
        # keeps a rival down through its rare re-measurements
        a = self.decay ** (1.0 + age / self.explore_every)
        if self.verify_cost is not None and timed == n and arm == "tree" and ratio > 0.0:
            parts = {"ratio": ratio / n, "rows": per_request / n, "other": other / n,
                     "draft": draft / n}
            old = self._tree.get(b)
            self._tree[b] = parts if old is None else \
                {key: a * old[key] + (1 - a) * x for key, x in parts.items()}
        st = self.stats.setdefault(b, {}).get(arm)
        if st is None:
            self.stats[b][arm] = [tok / n, sec / n, 1, req / n]
        else:
            st[0] = a * st[0] + (1 - a) * tok / n
            st[1] = a * st[1] + (1 - a) * sec / n
            st[2] += 1
            st[3] = a * st[3] + (1 - a) * req / n

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else self.decay * old + (1 - self.decay) * x

    def summary(self) -> dict:
        """Measured tokens/s per batch-size bucket (its power of two) and arm."""
        return {str(1 << b): {a: round(self.rate(b, a), 2) for a, st in arms.items() if st[1] > 0}
                for b, arms in self.stats.items()}

    def model_summary(self) -> dict:
        """Per batch-size bucket the bandit has run in: the model's predicted
        tokens/s of plain, every chain length and the tree (once it has run
        there), and its measured parts (seconds per step outside the
        forward, drafting per chain length; the tree's forward ratio, rows
        per request, time outside the forward and drafting)."""
        out = {}
        for b in sorted(self.stats):
            rates = {a: self.rate(b, a) for a in self.arms}
            out[str(1 << b)] = {
                "predicted": {a: round(r, 2) for a, r in rates.items()
                              if r is not None and self.model_seconds(b, a) is not None},
                "other_ms": {k: round(1e3 * v, 2) for k, v in self._other.get(b, {}).items()},
                "draft_ms": {k: round(1e3 * self.draft_seconds(b, k), 2)
                             for k in self._draft.get(b, {})}}
            if b in self._tree:
                t = self._tree[b]
                out[str(1 << b)]["tree"] = {
                    "forward_ratio": round(t["ratio"], 3), "rows_per_request": round(t["rows"], 2),
                    "other_ms": round(1e3 * t["other"], 2), "draft_ms": round(1e3 * t["draft"], 2)}
        return out

    def window_counts(self) -> dict:
        """Measured windows per batch-size bucket and arm (how often each ran)."""
        return {str(1 << b): {a: int(st[2]) for a, st in arms.items()}
                for b, arms in self.stats.items()}
