"""Lossless tree verification in plain PyTorch (DESIGN.md section 3).

Each node draws one token from the target distribution at that node, after the
request's temperature, top-k and top-p (argmax when greedy). The walk starts at
the root and moves to the child whose token equals the current node's draw;
when no child matches, the draw is the correction (bonus) token. Every visited
node uses its own independent draw, so the emitted tokens are distributed
exactly as sequential sampling from the target.

This module is also the CPU reference for the fused Triton sampling kernel:
:func:`apply_sampling_params`, :func:`exponential_noise`, :func:`draw_tokens`
and :func:`walk_trees` define the semantics the kernel must match.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from .tree import TreeBatch

__all__ = [
    "SAMPLING_EPS", "VerifyResult", "apply_sampling_params", "exponential_noise",
    "draw_tokens", "walk_trees", "walk_chains", "verify", "expand_to_nodes",
]

SAMPLING_EPS = 1e-5
"""Rows with temperature below this are greedy (vLLM's ``_SAMPLING_EPS``)."""


@dataclass
class VerifyResult:
    """Outcome of verifying a batch of trees.

    Attributes (D = the batch's maximum tree depth):
        num_accepted:    int64 [B], drafted nodes accepted (0..depth).
        accepted_nodes:  int64 [B, D], local indices in depth order, -1 padded.
        accepted_tokens: int64 [B, D], their tokens, -1 padded.
        bonus_token:     int64 [B], the last accepted node's draw (the
                         correction token when the walk stopped early).
    """

    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    accepted_tokens: torch.Tensor
    bonus_token: torch.Tensor

    def emitted(self, b: int) -> list[int]:
        """Tokens request b emits this step: accepted tokens, then the bonus."""
        n = int(self.num_accepted[b])
        return self.accepted_tokens[b, :n].tolist() + [int(self.bonus_token[b])]


def apply_sampling_params(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Target probabilities after temperature, then top-k, then top-p.

    Args:
        logits:      [T, V] any float dtype (computed in float32).
        temperature: float32 [T]; rows with temperature < SAMPLING_EPS are greedy.
        top_k:       int [T]; k <= 0 or k >= V means off.
        top_p:       float32 [T] in (0, 1]; 1.0 means off.

    Returns:
        float32 [T, V]: the distribution each row's draw comes from. Greedy
        rows are one-hot on ``argmax(logits)`` (first index among equal
        maxima), ignoring top-k/top-p, as vLLM's sampler does.

    Semantics (vLLM 0.32 ``Sampler`` + ``apply_top_k_top_p_pytorch``):
        * temperature: ``logits / temperature``.
        * top-k: keep tokens whose logit >= the k-th largest logit; tokens
          tied with the k-th are all kept (so more than k may survive).
        * top-p, on the softmax of the top-k-filtered logits: walk tokens by
          descending probability and keep a token while the mass of the
          tokens strictly before it (exclusive float32 cumsum) is < p; that is the
          smallest set with mass >= p, always at least one token. Tokens
          tied (equal logit) with the last kept token are kept too. vLLM
          breaks such ties by its unstable sort order; this reference is
          order-independent instead.
        * the result is the softmax over the surviving tokens.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    T, V = logits.shape
    x = logits.float()
    temperature = temperature.to(device=x.device, dtype=torch.float32).reshape(T)
    top_k = top_k.to(device=x.device, dtype=torch.int64).reshape(T)
    top_p = top_p.to(device=x.device, dtype=torch.float32).reshape(T)
    greedy = temperature < SAMPLING_EPS
    x = x / torch.where(greedy, 1.0, temperature).unsqueeze(1)

    # Top-k: threshold at the k-th largest logit.
    k_on = (top_k > 0) & (top_k < V) & ~greedy
    if bool(k_on.any()):
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        kth = sorted_x.gather(1, (top_k.clamp(1, V) - 1).unsqueeze(1))
        x = torch.where(k_on.unsqueeze(1) & (x < kth), -torch.inf, x)

    # Top-p on the renormalised distribution.
    p_on = (top_p < 1.0) & ~greedy
    if bool(p_on.any()):
        probs = torch.softmax(x, dim=-1)
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        sorted_p = probs.gather(1, idx)
        before = torch.cumsum(sorted_p, dim=-1)
        before = torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1]], dim=1)
        n_keep = (before < top_p.unsqueeze(1)).sum(-1).clamp(min=1)
        # Threshold: the logit of the last kept token (ties kept too).
        last = sorted_x.gather(1, (n_keep - 1).unsqueeze(1))
        x = torch.where(p_on.unsqueeze(1) & (x < last), -torch.inf, x)

    probs = torch.softmax(x, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.float().argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def exponential_noise(
    cu_nodes: torch.Tensor,
    vocab: int,
    generators: Sequence[torch.Generator | None],
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Exp(1) noise ``[T, vocab]`` float32, each request's rows from its own generator.

    Request b's rows ``cu_nodes[b]:cu_nodes[b+1]`` are filled, in row-major
    order, by ``generators[b]`` (a per-request seed), or by the default
    generator of ``device`` when it is None (one call for all such rows, as
    vLLM does).
    """
    B = cu_nodes.numel() - 1
    if len(generators) != B:
        raise ValueError(f"need one generator (or None) per request: {B}, got {len(generators)}")
    device = cu_nodes.device if device is None else device
    total = int(cu_nodes[-1])
    noise = torch.empty(total, vocab, dtype=torch.float32, device=device)
    if any(g is None for g in generators):
        noise.exponential_()
    bounds = cu_nodes.tolist()
    for b, g in enumerate(generators):
        if g is not None and bounds[b + 1] > bounds[b]:
            noise[bounds[b]:bounds[b + 1]].exponential_(generator=g)
    return noise


def draw_tokens(
    logits: torch.Tensor,
    probs: torch.Tensor,
    noise: torch.Tensor,
    greedy_mask: torch.Tensor,
) -> torch.Tensor:
    """One token per row: ``argmax(probs / noise)``, or ``argmax(logits)`` if greedy.

    With Exp(1) noise the race ``argmax_i p_i / E_i`` picks i with
    probability exactly p_i. Noise is clamped to >= the smallest normal
    float32 so that a zero draw cannot produce 0/0.

    Returns int64 [T].
    """
    scores = probs.float() / noise.float().clamp(min=torch.finfo(torch.float32).tiny)
    sampled = scores.argmax(-1)
    greedy = logits.float().argmax(-1)
    return torch.where(greedy_mask.to(sampled.device), greedy, sampled)


def walk_trees(draws: torch.Tensor, tree: TreeBatch) -> VerifyResult:
    """Follow each request's draws from its root (CONVENTIONS.md, Verification).

    ``draws``: int [total], one draw per node. From ``cur = root``, while a
    child c of cur has ``token[c] == draws[cur]``, accept c. Child tokens are
    distinct, so at most one child matches. (A walk over Python lists: a
    step's trees are a few nodes each, and per-depth tensor ops cost more
    than the walk on a CPU host.)
    """
    B, T = tree.num_requests, tree.total
    device = tree.token.device
    draw = draws.reshape(T).tolist()
    cu, par, tok = tree.cu_nodes.tolist(), tree.parent.tolist(), tree.token.tolist()
    D = tree.max_depth
    nodes = [[-1] * D for _ in range(B)]
    tokens = [[-1] * D for _ in range(B)]
    num, bonus = [0] * B, [0] * B
    for b in range(B):
        s, e = cu[b], cu[b + 1]
        child = {(par[g], tok[g]): g - s for g in range(s + 1, e)}  # (parent, token) -> node
        cur, n = 0, 0
        while (cur, draw[s + cur]) in child:
            cur = child[(cur, draw[s + cur])]
            nodes[b][n], tokens[b][n] = cur, tok[s + cur]
            n += 1
        num[b], bonus[b] = n, draw[s + cur]
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return VerifyResult(
        num_accepted=as_tensor(num),
        accepted_nodes=as_tensor(nodes).reshape(B, D),
        accepted_tokens=as_tensor(tokens).reshape(B, D),
        bonus_token=as_tensor(bonus),
    )


def walk_chains(draws: torch.Tensor, tree: TreeBatch, length: int) -> VerifyResult:
    """:func:`walk_trees` for a batch whose every tree is a chain of ``length``
    nodes (node i's parent is i - 1; the shape bandit's chain arms): the
    accepted path is the longest run of drafted nodes whose token equals the
    draw at its parent, found without :func:`walk_trees`' child lookups.
    Same result as :func:`walk_trees` (a test holds them equal). A Python
    loop over two lists, not tensor ops: in an engine step a dozen small
    tensor ops (the previous version) cost ~170 us at batch 1 on a 2-core
    host, the loop a few us a request."""
    B = tree.num_requests
    if tree.total != B * length:
        raise ValueError(f"walk_chains: {tree.total} nodes are not {B} chains of {length}")
    draw, tok = draws.reshape(-1).tolist(), tree.token.tolist()
    D = length - 1
    nodes, tokens, num, bonus = [], [], [], []
    for s in range(0, B * length, length):
        n = 0
        while n < D and tok[s + n + 1] == draw[s + n]:
            n += 1
        num.append(n)
        bonus.append(draw[s + n])
        nodes.append(list(range(1, n + 1)) + [-1] * (D - n))
        tokens.append(tok[s + 1:s + n + 1] + [-1] * (D - n))
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=tree.token.device)
    return VerifyResult(
        num_accepted=as_tensor(num),
        accepted_nodes=as_tensor(nodes).reshape(B, D),
        accepted_tokens=as_tensor(tokens).reshape(B, D),
        bonus_token=as_tensor(bonus),
    )


def expand_to_nodes(per_request: torch.Tensor, cu_nodes: torch.Tensor) -> torch.Tensor:
    """Repeat a per-request tensor [B, ...] to per-node [total, ...]."""
    sizes = (cu_nodes[1:] - cu_nodes[:-1]).long().to(per_request.device)
    return torch.repeat_interleave(per_request, sizes, dim=0, output_size=int(cu_nodes[-1]))


def verify(
    tree: TreeBatch,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator | None] | None = None,
    chain_length: int | None = None,
) -> VerifyResult:
    """Verify a batch of trees against the target's logits, losslessly.

    Args:
        tree:        the draft trees.
        logits:      [total, V] target logits, row i = distribution after node i.
        temperature: float32 [B]; < SAMPLING_EPS means greedy.
        top_k:       int [B]; <= 0 or >= V means off.
        top_p:       float32 [B]; 1.0 means off.
        generators:  per-request torch.Generator or None (default RNG);
                     None for all means all default.
        chain_length: set when every tree is a chain of this many nodes:
                     the walk is :func:`walk_chains` (same result, cheaper).
    """
    B = tree.num_requests
    if logits.dim() != 2 or logits.shape[0] != tree.total:
        raise ValueError(f"logits must be [total={tree.total}, V], got {tuple(logits.shape)}")
    if generators is None:
        generators = [None] * B

    def walk(draws):
        return walk_trees(draws, tree) if chain_length is None else \
            walk_chains(draws, tree, chain_length)

    # (on a CPU tensor, read through numpy: three tensor ops cost ~35 us a step)
    greedy = bool((temperature.numpy() < SAMPLING_EPS).all()) if temperature.device.type == "cpu" \
        else bool((temperature.reshape(B) < SAMPLING_EPS).all())
    if greedy:
        # All greedy: every draw is the argmax; no noise, no distribution needed.
        return walk(logits.float().argmax(-1))
    cu = tree.cu_nodes
    temp_n = expand_to_nodes(temperature.reshape(B).float(), cu)
    probs = apply_sampling_params(logits, temp_n,
                                  expand_to_nodes(top_k.reshape(B), cu),
                                  expand_to_nodes(top_p.reshape(B).float(), cu))
    noise = exponential_noise(cu, logits.shape[1], generators, device=logits.device)
    draws = draw_tokens(logits, probs, noise, temp_n < SAMPLING_EPS)
    return walk(draws)
