"""A batch of draft trees, packed back to back (see CONVENTIONS.md).

One request's tree: node 0 is the root (the request's last committed token),
nodes 1..n-1 are drafted, numbered parents-first (``parent[i] < i``), so every
prefix 0..m-1 is itself a tree. A batch packs the requests' nodes back to back
with ``cu_nodes``; ``parent`` is a *local* index within the request.

Everything here is plain PyTorch on whatever device the tensors live on.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

__all__ = ["TreeBatch", "pack_bits"]


@functools.lru_cache(maxsize=8)
def _bit_weights(device: torch.device) -> torch.Tensor:
    """int64 [32]: 1 << j (cached per device; read only)."""
    return torch.ones(32, dtype=torch.int64, device=device) << torch.arange(
        32, dtype=torch.int64, device=device)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[..., n]`` mask into int32 ``[..., ceil(n/32)]`` words.

    Bit ``j % 32`` of word ``j // 32`` is ``mask[..., j]``; bit 31 is the
    sign bit, used as an ordinary bit (test it with ``(word >> b) & 1``).
    """
    n = mask.shape[-1]
    w = (n + 31) // 32
    pad = w * 32 - n
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad))
    bits = mask.reshape(*mask.shape[:-1], w, 32).to(torch.int64)
    words = (bits * _bit_weights(mask.device)).sum(-1)
    # Reinterpret the unsigned 32-bit value as two's-complement int32.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


@dataclass
class TreeBatch:
    """Trees of B requests, nodes packed parents-first per request.

    Attributes (``total = cu_nodes[-1]``):
        cu_nodes:    int32 [B+1], request b owns nodes cu_nodes[b]:cu_nodes[b+1].
        token:       int64 [total], the token of each node (node 0: the root).
        parent:      int32 [total], local parent index, -1 for roots.
        depth:       int32 [total], 0 for roots.
        value:       float32 [total], path value (sum of draft log-probs
                     from the root; 0 for roots).
        context_len: int32 [B], tokens of the request already in the KV cache.

    A batch is never modified in place: its derived shapes and indices
    (``total``, ``sizes``, ``request_index``, ``global_parent``, ...) are
    computed once, on first use, and shared by every caller (read only). At
    a handful of nodes each is a few tensor ops of ~5 us on a CPU, and the
    runner, the verifier and KV compaction each ask for them again within one
    step.
    """

    cu_nodes: torch.Tensor
    token: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    value: torch.Tensor
    context_len: torch.Tensor

    # ------------------------------------------------------------------ build
    @classmethod
    def from_parents(
        cls,
        parents: Sequence[Sequence[int]],
        tokens: Sequence[Sequence[int]],
        context_len: Sequence[int] | torch.Tensor | None = None,
        values: Sequence[Sequence[float]] | None = None,
        device: torch.device | str | None = None,
    ) -> "TreeBatch":
        """Build a batch from per-request parent and token lists, checked as
        :meth:`validate` checks (parents first, root parent -1, distinct child
        tokens, context lengths >= 0; depths are derived).

        ``parents[b][0]`` must be -1 (the root); depths are derived. Values
        default to 0 (unknown), context lengths to 0.
        """
        if len(parents) != len(tokens):
            raise ValueError(f"got {len(parents)} parent lists but {len(tokens)} token lists")
        sizes = [len(p) for p in parents]
        for b, (p, t) in enumerate(zip(parents, tokens)):
            if len(p) != len(t):
                raise ValueError(f"request {b}: {len(p)} parents but {len(t)} tokens")
            if len(p) == 0:
                raise ValueError(f"request {b}: a tree needs at least its root node")
            if p[0] != -1:
                raise ValueError(f"request {b}: node 0 is the root and must have parent -1, got {p[0]}")
            for i in range(1, len(p)):
                if not 0 <= p[i] < i:
                    raise ValueError(
                        f"request {b}: node {i} has parent {p[i]}; parents must come "
                        f"first (0 <= parent < node)")
            children: set[tuple[int, int]] = set()
            for i in range(1, len(p)):
                if (p[i], t[i]) in children:
                    raise ValueError(
                        f"request {b}: node {p[i]} has two children with token {t[i]}; "
                        f"child tokens of a node must be distinct")
                children.add((p[i], t[i]))
        depth: list[int] = []
        for p in parents:
            d = [0] * len(p)
            for i in range(1, len(p)):
                d[i] = d[p[i]] + 1
            depth.extend(d)
        cu = [0]
        for n in sizes:
            cu.append(cu[-1] + n)
        flat_vals = [float(v) for vs in values for v in vs] if values is not None else [0.0] * cu[-1]
        if len(flat_vals) != cu[-1]:
            raise ValueError(f"values give {len(flat_vals)} entries for {cu[-1]} nodes")
        if context_len is None:
            context_len = [0] * len(parents)
        if isinstance(context_len, torch.Tensor):
            ctx = context_len.to(dtype=torch.int32, device=device).reshape(-1).clone()
            negative = bool((ctx < 0).any())
        else:  # a list (the runner's, every step): checked without tensor ops
            ctx = torch.tensor(context_len, dtype=torch.int32, device=device).reshape(-1)
            negative = any(c < 0 for c in context_len)
        if negative:
            raise ValueError("context_len must be >= 0")
        tree = cls(
            cu_nodes=torch.tensor(cu, dtype=torch.int32, device=device),
            token=torch.tensor([int(x) for t in tokens for x in t], dtype=torch.int64, device=device),
            parent=torch.tensor([int(x) for p in parents for x in p], dtype=torch.int32, device=device),
            depth=torch.tensor(depth, dtype=torch.int32, device=device),
            value=torch.tensor(flat_vals, dtype=torch.float32, device=device),
            context_len=ctx,
        )
        # Every invariant validate() checks holds by construction or was checked
        # above (per-step cost: the runner builds one batch every step). The
        # shapes known here are cached now rather than read back from tensors.
        tree.__dict__["total"] = cu[-1]
        tree.__dict__["max_depth"] = max(depth, default=0)
        return tree

    @classmethod
    def cat(cls, trees: Sequence["TreeBatch"]) -> "TreeBatch":
        """Concatenate batches request-wise (B = sum of the parts' B)."""
        if not trees:
            raise ValueError("cat() needs at least one TreeBatch")
        sizes = torch.cat([t.sizes for t in trees])
        cu = torch.zeros(len(sizes) + 1, dtype=torch.int32, device=sizes.device)
        cu[1:] = torch.cumsum(sizes, 0)
        return cls(
            cu_nodes=cu,
            token=torch.cat([t.token for t in trees]),
            parent=torch.cat([t.parent for t in trees]),
            depth=torch.cat([t.depth for t in trees]),
            value=torch.cat([t.value for t in trees]),
            context_len=torch.cat([t.context_len for t in trees]),
        )

    def repeat(self, copies: int) -> "TreeBatch":
        """The batch repeated ``copies`` times (request order b0..bB-1, b0..)."""
        sizes = self.sizes.repeat(copies)
        cu = torch.zeros(len(sizes) + 1, dtype=torch.int32, device=sizes.device)
        cu[1:] = torch.cumsum(sizes, 0)
        return TreeBatch(cu, self.token.repeat(copies), self.parent.repeat(copies),
                         self.depth.repeat(copies), self.value.repeat(copies),
                         self.context_len.repeat(copies))

    # ---------------------------------------------------------------- shapes
    @property
    def num_requests(self) -> int:
        return self.cu_nodes.numel() - 1

    @cached_property
    def total(self) -> int:
        """Number of nodes in the batch (``cu_nodes[-1]``)."""
        return int(self.cu_nodes[-1])

    @cached_property
    def sizes(self) -> torch.Tensor:
        """int32 [B]: nodes per request, root included."""
        return (self.cu_nodes[1:] - self.cu_nodes[:-1]).to(torch.int32)

    @cached_property
    def max_size(self) -> int:
        return int(self.sizes.max()) if self.num_requests else 0

    @cached_property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.total else 0

    @cached_property
    def request_index(self) -> torch.Tensor:
        """int64 [total]: the request each node belongs to."""
        return torch.repeat_interleave(
            torch.arange(self.num_requests, device=self.cu_nodes.device),
            self.sizes.long(), output_size=self.total)

    @cached_property
    def local_index(self) -> torch.Tensor:
        """int64 [total]: index of each node within its request."""
        req = self.request_index
        return torch.arange(self.total, device=req.device) - self.cu_nodes.long()[req]

    @cached_property
    def global_parent(self) -> torch.Tensor:
        """int64 [total]: packed index of each node's parent, -1 for roots."""
        off = self.cu_nodes.long()[self.request_index]
        par = self.parent.long()
        return torch.where(par >= 0, par + off, par)

    @property
    def positions(self) -> torch.Tensor:
        """int64 [total]: ``context_len + depth`` (not the flattened index)."""
        return self.context_len.long()[self.request_index] + self.depth.long()

    @property
    def slots(self) -> torch.Tensor:
        """int64 [total]: logical KV slot ``context_len + local index``."""
        return self.context_len.long()[self.request_index] + self.local_index

    # ----------------------------------------------------------------- masks
    def _ancestor_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) packed index pairs with col an ancestor-or-self of row."""
        gpar = self.global_parent
        rows, cols = [], []
        cur = torch.arange(self.total, device=gpar.device)
        alive = torch.ones_like(cur, dtype=torch.bool)
        for _ in range(self.max_depth + 1):
            rows.append(torch.nonzero(alive).squeeze(1))
            cols.append(cur[alive])
            nxt = gpar[cur.clamp(min=0)]
            alive = alive & (nxt >= 0)
            cur = torch.where(alive, nxt, cur)
        return torch.cat(rows), torch.cat(cols)

    def block_mask(self) -> torch.Tensor:
        """bool [total, total]: block-diagonal ancestor-or-self mask."""
        r, c = self._ancestor_pairs()
        m = torch.zeros(self.total, self.total, dtype=torch.bool, device=self.token.device)
        m[r, c] = True
        return m

    def ancestor_masks(self) -> torch.Tensor:
        """bool [B, n_max, n_max]: per-request dense masks, zero-padded.

        ``mask[b, i, j]`` is True iff local node j is ancestor-or-self of i.
        """
        r, c = self._ancestor_pairs()
        req = self.request_index
        loc = self.local_index
        n = self.max_size
        m = torch.zeros(self.num_requests, n, n, dtype=torch.bool, device=self.token.device)
        m[req[r], loc[r], loc[c]] = True
        return m

    def ancestor_mask(self, b: int) -> torch.Tensor:
        """bool [n_b, n_b]: the dense mask of request b."""
        n = int(self.sizes[b])
        return self.ancestor_masks()[b, :n, :n]

    def packed_mask(self) -> torch.Tensor:
        """int32 [total, W], W = ceil(n_max / 32): bit-packed ancestor mask.

        Row i (packed) holds request-local columns: bit ``j % 32`` of word
        ``j // 32`` is set iff local node j is ancestor-or-self of node i.
        Built on the host with Python integers as bit sets (a node's set is
        its parent's plus its own bit; parents come first): one pass over the
        nodes instead of a tensor op per depth, which cost ~0.5 ms at batch 1
        on a CPU host.
        """
        cu, par = self.cu_nodes.tolist(), self.parent.tolist()
        w = (self.max_size + 31) // 32
        words: list[int] = []
        for s, e in zip(cu, cu[1:]):
            bits: list[int] = []
            for i in range(e - s):
                p = par[s + i]
                bits.append((bits[p] if p >= 0 else 0) | (1 << i))
            for m in bits:
                for j in range(w):
                    word = (m >> (32 * j)) & 0xFFFFFFFF
                    words.append(word - (1 << 32) if word >= 1 << 31 else word)
        return torch.tensor(words, dtype=torch.int32,
                            device=self.token.device).view(self.total, w)

    # ---------------------------------------------------------- sub-batches
    def prefix(self, sizes: Sequence[int] | torch.Tensor) -> "TreeBatch":
        """Keep the first ``sizes[b]`` nodes of each request (1 <= sizes[b] <= n_b).

        Parents-first order makes every prefix a valid tree.
        """
        sizes = torch.as_tensor(sizes, dtype=torch.int64, device=self.cu_nodes.device).reshape(-1)
        if sizes.numel() != self.num_requests:
            raise ValueError(f"prefix() needs {self.num_requests} sizes, got {sizes.numel()}")
        if bool((sizes < 1).any()) or bool((sizes > self.sizes.long()).any()):
            raise ValueError(
                f"prefix sizes must be in [1, n_b] (the root always stays); got "
                f"{sizes.tolist()} for tree sizes {self.sizes.tolist()}")
        keep = self.local_index < sizes[self.request_index]
        cu = torch.zeros(self.num_requests + 1, dtype=torch.int32, device=sizes.device)
        cu[1:] = torch.cumsum(sizes, 0)
        return TreeBatch(cu, self.token[keep], self.parent[keep], self.depth[keep],
                         self.value[keep], self.context_len.clone())

    def request(self, b: int) -> "TreeBatch":
        """Request b alone, as a batch of one (node tensors are views)."""
        if not 0 <= b < self.num_requests:
            raise IndexError(f"request {b} out of range for a batch of {self.num_requests}")
        s, e = int(self.cu_nodes[b]), int(self.cu_nodes[b + 1])
        cu = torch.tensor([0, e - s], dtype=torch.int32, device=self.cu_nodes.device)
        return TreeBatch(cu, self.token[s:e], self.parent[s:e], self.depth[s:e],
                         self.value[s:e], self.context_len[b:b + 1])

    def children(self, b: int, i: int) -> list[int]:
        """Local indices of the children of local node i of request b."""
        s, e = int(self.cu_nodes[b]), int(self.cu_nodes[b + 1])
        return torch.nonzero(self.parent[s:e] == i).squeeze(1).tolist()

    def children_lists(self) -> list[list[list[int]]]:
        """``out[b][i]``: local children of node i of request b, in node order."""
        out = []
        for b in range(self.num_requests):
            s, e = int(self.cu_nodes[b]), int(self.cu_nodes[b + 1])
            ch: list[list[int]] = [[] for _ in range(e - s)]
            for i, p in enumerate(self.parent[s:e].tolist()):
                if p >= 0:
                    ch[p].append(i)
            out.append(ch)
        return out

    def paths(self, b: int) -> list[tuple[int, ...]]:
        """Token path (root excluded) of every local node of request b."""
        s, e = int(self.cu_nodes[b]), int(self.cu_nodes[b + 1])
        par, tok = self.parent[s:e].tolist(), self.token[s:e].tolist()
        out: list[tuple[int, ...]] = [()]
        for i in range(1, e - s):
            out.append(out[par[i]] + (tok[i],))
        return out

    def to(self, device: torch.device | str) -> "TreeBatch":
        return TreeBatch(*(getattr(self, f).to(device) for f in
                           ("cu_nodes", "token", "parent", "depth", "value", "context_len")))

    # ------------------------------------------------------------ validation
    def validate(self) -> "TreeBatch":
        """Check every invariant of CONVENTIONS.md; raise ValueError if broken.

        Checks shapes, ``cu_nodes`` (starts at 0, every request has a root),
        parents-first order, root parent -1, depth = parent depth + 1,
        distinct child tokens per node, non-negative context lengths.
        Returns self.
        """
        cu = self.cu_nodes
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"cu_nodes must be 1-D [B+1], got shape {tuple(cu.shape)}")
        if int(cu[0]) != 0:
            raise ValueError(f"cu_nodes[0] must be 0, got {int(cu[0])}")
        sizes = cu[1:].long() - cu[:-1].long()
        if bool((sizes < 1).any()):
            b = int(torch.nonzero(sizes < 1)[0])
            raise ValueError(f"request {b} has {int(sizes[b])} nodes; every tree needs its root")
        total = int(cu[-1])
        for name in ("token", "parent", "depth", "value"):
            t = getattr(self, name)
            if t.dim() != 1 or t.numel() != total:
                raise ValueError(f"{name} must be 1-D of length cu_nodes[-1]={total}, "
                                 f"got shape {tuple(t.shape)}")
        if self.value.dtype != torch.float32:
            raise ValueError(f"value must be float32, got {self.value.dtype}")
        if self.context_len.dim() != 1 or self.context_len.numel() != self.num_requests:
            raise ValueError(f"context_len must be [B]={self.num_requests}, "
                             f"got shape {tuple(self.context_len.shape)}")
        if bool((self.context_len < 0).any()):
            raise ValueError("context_len must be >= 0")
        if total == 0:
            return self
        req = self.request_index
        loc = self.local_index
        par = self.parent.long()
        is_root = loc == 0
        bad = is_root & (par != -1)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"request {int(req[i])}: node 0 is the root and must have "
                             f"parent -1, got {int(par[i])}")
        bad = ~is_root & ((par < 0) | (par >= loc))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"request {int(req[i])}: node {int(loc[i])} has parent "
                             f"{int(par[i])}; parents must come first (0 <= parent < node)")
        dep = self.depth.long()
        bad = is_root & (dep != 0)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"request {int(req[i])}: root depth must be 0, got {int(dep[i])}")
        gpar = self.global_parent
        bad = ~is_root & (dep != dep[gpar.clamp(min=0)] + 1)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"request {int(req[i])}: node {int(loc[i])} has depth {int(dep[i])} but its "
                f"parent {int(par[i])} has depth {int(dep[gpar[i]])} (want parent depth + 1)")
        # Distinct child tokens: sort (parent, token) pairs of non-roots.
        nz = torch.nonzero(~is_root).squeeze(1)
        if nz.numel() > 1:
            key = torch.stack([gpar[nz], self.token[nz].long()], 1)
            key, order = torch.unique(key, dim=0, return_inverse=True)
            if key.shape[0] != nz.numel():
                counts = torch.bincount(order)
                dup = int(torch.nonzero(counts > 1)[0])
                g, tok = int(key[dup, 0]), int(key[dup, 1])
                raise ValueError(
                    f"request {int(req[g])}: node {int(loc[g])} has two children with token "
                    f"{tok}; child tokens of a node must be distinct")
        return self
