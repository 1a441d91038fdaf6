"""Shared builders for the kernel tests (random trees, paged caches)."""
from __future__ import annotations

import torch

from vllm_eagle_tree.core.tree import TreeBatch


def random_parents(n: int, gen: torch.Generator, chain_bias: float = 0.0) -> list[int]:
    """A random parents-first tree of n nodes (parent[i] < i)."""
    par = [-1]
    for i in range(1, n):
        if chain_bias and torch.rand((), generator=gen) < chain_bias:
            par.append(i - 1)
        else:
            par.append(int(torch.randint(0, i, (), generator=gen)))
    return par


def random_tree_batch(sizes, vocab: int, gen: torch.Generator, context_len=None,
                      chain_bias: float = 0.3) -> TreeBatch:
    """Trees with all-distinct node tokens (so sibling tokens are distinct)."""
    parents = [random_parents(n, gen, chain_bias) for n in sizes]
    tokens = []
    for n in sizes:
        tokens.append(torch.randperm(vocab, generator=gen)[:n].tolist())
    return TreeBatch.from_parents(parents, tokens, context_len=context_len)


def paged_layout(seq_lens, page: int, gen: torch.Generator, spare_blocks: int = 3):
    """A shuffled block table covering seq_lens.

    Returns (block_table int32 [B, max_blocks + 1], num_blocks, spare) where
    ``spare`` lists the physical blocks no request owns; unused table entries
    point at spare[0], so tests can poison spare blocks to catch stray reads.
    """
    nblk = [max(1, -(-s // page)) for s in seq_lens]
    num_blocks = sum(nblk) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    spare = perm[sum(nblk):].tolist()
    bt = torch.full((len(seq_lens), max(nblk) + 1), spare[0], dtype=torch.int32)
    k = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[k:k + n].to(torch.int32)
        k += n
    return bt, num_blocks, spare
