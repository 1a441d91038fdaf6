"""KV compaction after verification (CONVENTIONS.md, "KV compaction").

For every request, the accepted node at depth d (1 <= d <= num_accepted)
moves from logical slot ``context_len + accepted_nodes[d-1]`` to slot
``context_len + d`` (the root stays at ``context_len``), in every layer, for
K and V, in vLLM's paged layout: logical slot s of request b is row
``s % block_size`` of physical block ``block_table[b, s // block_size]`` of a
``[num_blocks, block_size, num_kv_heads, head_dim]`` cache.

All layers go in one launch: a :class:`KVCacheTable` holds an int64 tensor of
the layers' base addresses (K caches then V caches), which the kernel turns
back into pointers (``tl.load(table + i).to(tl.pointer_type(...))``; this
works compiled and in the interpreter on CPU tensors). Every cache in a table
must share dtype, shape and strides (true for vLLM's per-layer views; build a
separate table for a draft model with another geometry). Bytes are copied
as same-width integers, so the copy is bit-exact for any dtype (NaN
payloads included).

Why the in-place copy is safe although source and destination ranges
overlap: accepted nodes are numbered parents-first, so ``a[d-1] >= d`` and
``a`` increases with d. The destination ``context_len + d`` can only be the
source of a depth d' <= d (``a[d'-1] = d`` needs ``d' <= d``); d' = d is a
no-op (skipped). One program copies the whole path of one (request, layer,
K/V, element chunk) in increasing depth, so every slot is read (at depth d')
before it is overwritten (at depth d > d'); later depths read slots
``> context_len + d`` that nothing has written yet. Each element position is
handled by the same thread in every iteration (same offsets, same layout),
so the read-before-write order is that thread's program order. Software
pipelining may hoist later loads earlier, never a load after a later
store, and hoisted loads only read not-yet-written slots. Different
programs touch disjoint bytes.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpret_mode, next_pow2

__all__ = ["KVCacheTable", "compact_kv_triton", "compact_kv_ref"]

_INT_OF_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_TABLES: "weakref.WeakValueDictionary[int, KVCacheTable]" = weakref.WeakValueDictionary()


class KVCacheTable:
    """Base addresses of a model's per-layer K and V caches, for one-launch kernels.

    Build once (the caches do not move) and reuse every step. Holds the
    tensors too, so they outlive the table.
    """

    def __init__(self, key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]):
        key_caches, value_caches = list(key_caches), list(value_caches)
        if len(key_caches) != len(value_caches) or not key_caches:
            raise ValueError("need the same non-zero number of key and value caches")
        ref = key_caches[0]
        if ref.dim() != 4:
            raise ValueError(f"caches must be [num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {tuple(ref.shape)}")
        for c in key_caches + value_caches:
            if c.shape != ref.shape or c.stride() != ref.stride() or c.dtype != ref.dtype \
                    or c.device != ref.device:
                raise ValueError("all caches of a KVCacheTable need the same shape, strides, "
                                 "dtype and device")
        if ref.element_size() not in _INT_OF_SIZE:
            raise ValueError(f"unsupported cache element size {ref.element_size()}")
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.ptrs = torch.tensor([c.data_ptr() for c in key_caches + value_caches],
                                 dtype=torch.int64, device=ref.device)
        _TABLES[self.ptrs.data_ptr()] = self

    @classmethod
    def from_stacked(cls, kv_caches: Sequence[torch.Tensor]) -> "KVCacheTable":
        """From vLLM FlashAttention-style per-layer tensors ``[2, num_blocks, block_size, H, D]``."""
        return cls([kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches])

    @property
    def num_layers(self) -> int:
        return len(self.key_caches)

    @property
    def block_size(self) -> int:
        return self.key_caches[0].shape[1]


def _as_table(caches) -> KVCacheTable:
    if isinstance(caches, KVCacheTable):
        return caches
    key_caches, value_caches = caches
    return KVCacheTable(key_caches, value_caches)


# --------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------
@triton.jit
def _kv_compact_kernel(
    PtrTable, BlockTable, ContextLens, NumAccepted, AcceptedNodes,
    stride_bt, stride_an,
    stride_blk, stride_slot, stride_h, stride_d,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SLOT_ELEMS: tl.constexpr,
    BLOCK_E: tl.constexpr, ELEM: tl.constexpr,
):
    b = tl.program_id(0)
    cache = tl.program_id(1)      # layer l: K = l, V = num_layers + l
    chunk = tl.program_id(2)
    n_acc = tl.load(NumAccepted + b).to(tl.int32)
    if n_acc == 0:
        return
    ctx = tl.load(ContextLens + b).to(tl.int32)
    base = tl.load(PtrTable + cache).to(tl.pointer_type(ELEM))
    e = chunk * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < SLOT_ELEMS
    off_e = (e // HEAD_DIM).to(tl.int64) * stride_h + (e % HEAD_DIM).to(tl.int64) * stride_d
    bt_row = BlockTable + b.to(tl.int64) * stride_bt
    an_row = AcceptedNodes + b.to(tl.int64) * stride_an
    # Increasing depth: see the module docstring for why this order is safe.
    for d in range(1, n_acc + 1):
        src = ctx + tl.load(an_row + d - 1).to(tl.int32)
        dst = ctx + d
        if src != dst:
            src_page = tl.load(bt_row + src // PAGE_SIZE).to(tl.int64)
            dst_page = tl.load(bt_row + dst // PAGE_SIZE).to(tl.int64)
            x = tl.load(base + src_page * stride_blk + (src % PAGE_SIZE) * stride_slot + off_e,
                        mask=e_ok)
            tl.store(base + dst_page * stride_blk + (dst % PAGE_SIZE) * stride_slot + off_e, x,
                     mask=e_ok)


def compact_kv_triton(
    caches,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    num_accepted: torch.Tensor,
    accepted_nodes: torch.Tensor,
) -> None:
    """In-place compaction of all layers in one launch. Arguments as :func:`compact_kv_ref`."""
    table = _as_table(caches)
    B = num_accepted.numel()
    if B == 0:
        return
    ref = table.key_caches[0]
    _, page, heads, head_dim = ref.shape
    slot_elems = heads * head_dim
    block_e = min(next_pow2(slot_elems), 256 if interpret_mode() else 2048)
    grid = (B, 2 * table.num_layers, cdiv(slot_elems, block_e))
    _kv_compact_kernel[grid](
        table.ptrs, block_table, context_lens, num_accepted, accepted_nodes,
        block_table.stride(0), max(accepted_nodes.stride(0), 1),
        ref.stride(0), ref.stride(1), ref.stride(2), ref.stride(3),
        PAGE_SIZE=page, HEAD_DIM=head_dim, SLOT_ELEMS=slot_elems,
        BLOCK_E=block_e, ELEM=_INT_OF_SIZE[ref.element_size()],
        num_warps=4,
    )


# --------------------------------------------------------------------------
# PyTorch reference (the CPU path and the test oracle)
# --------------------------------------------------------------------------
def compact_kv_ref(
    caches,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    num_accepted: torch.Tensor,
    accepted_nodes: torch.Tensor,
) -> None:
    """Copy each request's accepted path to the slots right after its context, in place.

    Args:
        caches:         a :class:`KVCacheTable`, or ``(key_caches, value_caches)``
                        lists of ``[num_blocks, block_size, Hkv, D]`` tensors.
        block_table:    int32 [B, max_blocks].
        context_lens:   int [B] (vLLM's num_computed_tokens before this step).
        num_accepted:   int [B] accepted drafted nodes.
        accepted_nodes: int [B, D] local node indices in depth order (-1 padded).

    All sources are gathered before any destination is written, so
    overlapping ranges are safe.
    """
    if isinstance(caches, KVCacheTable):
        key_caches, value_caches = caches.key_caches, caches.value_caches
    else:
        key_caches, value_caches = caches
    page = key_caches[0].shape[1]
    ctx_l = context_lens.tolist()
    na_l = num_accepted.tolist()
    for b in range(num_accepted.numel()):
        n = int(na_l[b])
        if n == 0:
            continue
        ctx = int(ctx_l[b])
        src = ctx + accepted_nodes[b, :n].long().to(block_table.device)
        dst = ctx + torch.arange(1, n + 1, device=block_table.device)
        bt = block_table[b].long()
        sp, sr = bt[src // page], src % page
        dp, dr = bt[dst // page], dst % page
        for c in list(key_caches) + list(value_caches):
            rows = c[sp, sr].clone()
            c[dp, dr] = rows
