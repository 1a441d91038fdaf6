"""Tree attention inside vLLM 0.32's CPU_ATTN backend (docs/INTEGRATION.md, step 5).

vLLM's CPU attention kernel takes no mask, so a tree cannot go through it.
:class:`TreeCPUAttentionImpl` keeps vLLM's kernel for every row and then
recomputes the rows of tree requests with the PyTorch tree attention over
the same paged cache (``adapter.cpu_tree_attention``), overwriting them:

* target verify pass: the runner attaches a :class:`TreeAttention` to the
  step's ``CPUAttentionMetadata`` (attribute ``eagle2_tree``); vLLM's kernel
  runs first (correct for prefills and plain decodes, causal-by-index and
  therefore wrong for tree rows), then the tree rows are replaced;
* draft steps: the tree drafter passes a :class:`TreeOnlyMetadata` and only
  the tree attention runs.

KV writing is vLLM's own (``do_kv_cache_update`` runs before ``forward`` with
the step's flat slot mapping). Installed for the CPU_ATTN enum member by
``plugin.register_tree_attention_backend`` in eagle2 worker processes only;
without tree metadata the subclass behaves exactly as vLLM's backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .cpu_tree_attention import TreeAttentionPlan

__all__ = ["TreeAttention", "TreeOnlyMetadata", "TreeCPUAttentionBackend",
           "TreeCPUAttentionImpl", "TREE_METADATA_ATTR"]

TREE_METADATA_ATTR = "eagle2_tree"


@dataclass
class TreeAttention:
    """Which query rows attend as trees, and over what (one KV cache group).

    Attributes (T = tree requests):
        rows:        int64 [Q] flat query rows of the tree requests, request-major.
        cu_q_lens:   int32 [T+1] request t owns rows[cu_q_lens[t]:cu_q_lens[t+1]].
        seq_lens:    int32 [T] keys per request (context + tree keys).
        tree_lens:   int32 [T] trailing keys covered by the mask.
        tree_mask:   int32 [Q, W] bit-packed visibility of the trailing keys.
        block_table: int32 [T, max_blocks] the requests' block-table rows.
    """

    rows: torch.Tensor
    cu_q_lens: torch.Tensor
    seq_lens: torch.Tensor
    tree_lens: torch.Tensor
    tree_mask: torch.Tensor
    block_table: torch.Tensor

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               output: torch.Tensor) -> None:
        """Write the tree rows of ``output [N, Hq, D]`` from ``query [N, Hq, D]``.

        The layer-independent plan (key locations, masks) is built on the
        first call and reused by every layer of the forward pass."""
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = self._plan = TreeAttentionPlan(self.block_table, self.seq_lens,
                                                  self.cu_q_lens, self.tree_mask,
                                                  kv_cache.shape[2], self.tree_lens)
        out = plan.attend(query[self.rows], kv_cache, scale)
        output[self.rows] = out.to(output.dtype)


@dataclass
class TreeOnlyMetadata:
    """Attention metadata of a draft step: every row is a tree row."""

    tree: TreeAttention


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM 0.32 ``CPUAttentionBackendImpl`` plus tree rows (module docstring)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, TreeOnlyMetadata):
            attn_metadata.tree.attend(query, kv_cache, self.scale, output)
            return output
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        tree = getattr(attn_metadata, TREE_METADATA_ATTR, None)
        if tree is not None:
            tree.attend(query, kv_cache, self.scale, output)
        return output


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """vLLM 0.32 ``CPUAttentionBackend`` whose impl also serves tree rows."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
