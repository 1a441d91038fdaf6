"""Tree attention inside vLLM 0.32's CPU_ATTN backend (docs/INTEGRATION.md, step 5).

vLLM's CPU attention kernel takes no mask, so a tree cannot go through it.
:class:`TreeCPUAttentionImpl` keeps vLLM's kernel for every row (skipped when
every row of the step is a tree row) and then recomputes the rows of tree
requests over the same paged cache with the fused C++ op of
``adapter/cpu_tree_attention.cpp`` (or, where it cannot be built, the
PyTorch ``TreeAttentionPlan`` of ``adapter.cpu_tree_attention``),
overwriting them:

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

import types
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .cpu_tree_attention import TreeAttentionPlan, load_cpu_tree_op

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

    @classmethod
    def with_op_args(cls, rows: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                     tree_lens: torch.Tensor, tree_mask: torch.Tensor, block_table: torch.Tensor,
                     op_args: tuple[torch.Tensor, ...]) -> "TreeAttention":
        """As the constructor, with the fused op's index tensors given ready
        (what :meth:`_fused_args` derives from the fields: int64 rows, int32
        block table, int64 request of each row, int64 keys before the tree,
        int64 tree lengths, int32 mask; all contiguous), for a caller that
        has them at hand every step (the chain drafter: a dozen tensor ops
        less per head forward). A test holds them equal to ``_fused_args``'s."""
        attn = cls(rows=rows, cu_q_lens=cu_q_lens, seq_lens=seq_lens, tree_lens=tree_lens,
                   tree_mask=tree_mask, block_table=block_table)
        attn._op_args = op_args
        return attn

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               output: torch.Tensor) -> None:
        """Write the tree rows of ``output [N, Hq, D]`` from ``query [N, Hq, D]``.

        With the fused C++ op (``load_cpu_tree_op``) the rows are computed in
        place; otherwise the PyTorch plan (key locations, masks) is built on
        the first call and reused by every layer of the forward pass. Both
        read only ``kv_cache``, so they agree (tests compare them)."""
        op = load_cpu_tree_op()
        if op is not None and kv_cache.dtype == query.dtype == output.dtype \
                and query.stride(-1) == 1 and output.stride(-1) == 1:
            args = self.__dict__.get("_op_args")
            if args is None:
                args = self._op_args = self._fused_args()
            if args[0].numel():
                op(output, query, args[0], kv_cache, *args[1:], float(scale))
            return
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = self._plan = TreeAttentionPlan(self.block_table, self.seq_lens,
                                                  self.cu_q_lens, self.tree_mask,
                                                  kv_cache.shape[2], self.tree_lens)
        out = plan.attend(query[self.rows], kv_cache, scale)
        output[self.rows] = out.to(output.dtype)

    def _fused_args(self):
        """Per-step (layer-independent) index tensors of the fused op."""
        row_req = torch.repeat_interleave(self.cu_q_lens.long().diff())  # request of each row
        tl = self.tree_lens.long()
        return (self.rows.long().contiguous(), self.block_table.to(torch.int32).contiguous(),
                row_req.contiguous(), (self.seq_lens.long() - tl).contiguous(), tl.contiguous(),
                self.tree_mask.to(torch.int32).contiguous())


@dataclass
class TreeOnlyMetadata:
    """Attention metadata of a draft step: every row is a tree row."""

    tree: TreeAttention


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM 0.32 ``CPUAttentionBackendImpl`` plus tree rows (module docstring).

    A target layer's impl serves tree rows only while :meth:`serve_tree_rows`
    is on; off, its ``forward`` *is* vLLM's (an instance attribute bound to
    the base class's method), so steps without tree rows (plain decodes,
    chains, prefills) pay nothing for this subclass. The runner switches it
    with the step's attention metadata, before the forward that reads it.
    (Batch 1 on the deep target, 64 layers: 0.2-0.45 ms of a 31 ms forward
    in one A/B, within the noise in a re-run of
    ``scripts/ab_attention_dispatch.py``.)"""

    def serve_tree_rows(self, on: bool) -> None:
        """Route ``forward`` through the tree dispatch (on) or straight to
        vLLM's ``CPUAttentionBackendImpl.forward`` (off)."""
        if on:
            self.__dict__.pop("forward", None)
        else:
            self.forward = types.MethodType(CPUAttentionBackendImpl.forward, self)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, TreeOnlyMetadata):
            attn_metadata.tree.attend(query, kv_cache, self.scale, output)
            return output
        tree = getattr(attn_metadata, TREE_METADATA_ATTR, None)
        # every row a tree row (e.g. batch 1): vLLM's kernel would compute nothing kept
        if tree is None or tree.rows.numel() != attn_metadata.num_actual_tokens:
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                     output_scale, output_block_scale)
        if tree is not None:
            tree.attend(query, kv_cache, self.scale, output)
        return output


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """vLLM 0.32 ``CPUAttentionBackend`` whose impl also serves tree rows."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
