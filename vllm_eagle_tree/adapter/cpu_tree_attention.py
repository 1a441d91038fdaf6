"""Tree-verify attention and accepted-path KV compaction on vLLM 0.32's
CPU_ATTN KV cache (docs/INTEGRATION.md, step 4), used by ``adapter.attention``
and ``adapter.runner``. Tree attention has two implementations that tests
hold equal: the fused C++ op (``cpu_tree_attention.cpp``,
:func:`load_cpu_tree_op`) and the PyTorch :class:`TreeAttentionPlan`.

The CPU_ATTN cache of one attention layer is a contiguous tensor of nominal
shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(``CPUAttentionBackend.get_kv_cache_shape``). ``CPUAttentionBackendImpl``
views it as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and
``chunk(2, dim=2)``s it into a key half and a value half per (block, head).
What vLLM's C++ writer ``cpu_attn_reshape_and_cache`` puts there depends on the
ISA picked by ``cpu_attn._get_attn_isa``. Measured for the ``vec`` and
``vec16`` ISAs (x86 without AMX, any dtype; AMX is used only for bf16 on
AMX CPUs): per (block, head) the first ``block_size * head_size`` elements
hold the keys **transposed**, ``[head_size, block_size]`` (slot fastest), and
the next ``block_size * head_size`` the values ``[block_size, head_size]``.
That differs from the GPU layout ``[num_blocks, block_size, num_kv_heads,
head_size]`` the Triton kernels and their PyTorch references are written
for. :func:`cpu_kv_views` returns strided views of a CPU_ATTN cache in that
GPU layout (no copy; writes through them land in vLLM's cache), so the
references ``tree_attention_ref`` and ``compact_kv_ref`` run on vLLM's CPU
cache unchanged. :func:`probe_cpu_kv_layout` checks the assumption against
vLLM's own writer for a (dtype, block size, head size, ISA) and is meant to
run once at start-up; it refuses layouts it does not know (AMX).

Conventions (CONVENTIONS.md): a request's tree nodes are written, in
flattened parents-first order, to logical slots ``context_len + i`` (what
vLLM's slot mapping does when positions are *not* altered before
``compute_slot_mapping``), while their rotary positions are
``context_len + depth``; query row i sees every context slot and tree slot j
iff j is an ancestor-or-self of i (bit-packed ``tree_mask``).
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from vllm_eagle_tree import LOGGER_NAME

__all__ = ["cpu_kv_views", "probe_cpu_kv_layout", "cpu_tree_attention", "cpu_compact_kv",
           "CPUKVCompaction", "padded_tree_attention", "TreeAttentionPlan", "load_cpu_tree_op",
           "KNOWN_ISAS", "CPU_KERNEL_ENV"]

CPU_KERNEL_ENV = "EAGLE_TREE_CPU_KERNEL"
"""Set to ``0`` to skip the fused C++ op and use the PyTorch plan (slower)."""

KNOWN_ISAS = ("vec", "vec16")
"""CPU_ATTN ISAs whose cache layout :func:`cpu_kv_views` decodes (measured)."""


logger = logging.getLogger(LOGGER_NAME)


# compiler flags of the fused op's build (also scripts/bench_tree_op.py's
# baseline build, so that the two are compared as built alike)
CPU_OP_BUILD_FLAGS = dict(extra_cflags=["-O3", "-march=native", "-fopenmp"],
                          extra_ldflags=["-fopenmp"])


@functools.lru_cache(maxsize=None)
def load_cpu_tree_op():
    """The fused C++ tree attention ``torch.ops.eagle_tree.tree_attention``
    (``cpu_tree_attention.cpp``), built on first use with
    ``torch.utils.cpp_extension`` (about a minute; cached under
    ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), or None
    when :data:`CPU_KERNEL_ENV` is ``0`` or the build fails (a warning says
    why; the PyTorch :class:`TreeAttentionPlan` is then used, same results,
    several times slower)."""
    if os.environ.get(CPU_KERNEL_ENV, "1") == "0":
        return None
    if hasattr(torch.ops, "eagle_tree") and hasattr(torch.ops.eagle_tree, "tree_attention"):
        return torch.ops.eagle_tree.tree_attention
    try:
        from torch.utils.cpp_extension import load

        load(name="eagle_tree_cpu_tree_attention",
             sources=[str(Path(__file__).with_suffix(".cpp"))],
             **CPU_OP_BUILD_FLAGS, is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, ...
        logger.warning("eagle2: could not build the fused CPU tree attention (%s: %s); using the "
                       "PyTorch plan, which gives the same results more slowly. Set %s=0 to "
                       "skip the build.", type(e).__name__, str(e).splitlines()[0][:300]
                       if str(e) else "", CPU_KERNEL_ENV)
        return None
    return torch.ops.eagle_tree.tree_attention


def cpu_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, block_size, num_kv_heads, head_size]``
    of one layer's CPU_ATTN cache ``[num_blocks, num_kv_heads, block_size, 2*head_size]``.

    Valid for the ``vec`` / ``vec16`` ISAs (see the module docstring and
    :func:`probe_cpu_kv_layout`). The views share memory with ``kv_cache``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"expected a CPU_ATTN cache [num_blocks, num_kv_heads, block_size, "
                         f"2*head_size], got shape {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("the CPU_ATTN cache tensor must be contiguous")
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    per_head = 2 * bs * d
    base = kv_cache.storage_offset()
    key = kv_cache.as_strided((nb, bs, h, d), (h * per_head, 1, per_head, bs), base)
    value = kv_cache.as_strided((nb, bs, h, d), (h * per_head, d, per_head, 1), base + bs * d)
    return key, value


@functools.lru_cache(maxsize=None)
def probe_cpu_kv_layout(dtype: torch.dtype, block_size: int, head_size: int,
                        isa: str | None = None, num_kv_heads: int = 2) -> str:
    """Check :func:`cpu_kv_views` against vLLM's writer; return the ISA checked.

    Writes distinct keys and values with ``vllm._custom_ops.cpu_attn_reshape_and_cache``
    into a scratch cache and reads them back through the views. Raises
    ``NotImplementedError`` for an ISA or layout the views do not decode.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if isa is None:
        isa = _get_attn_isa(dtype, block_size, head_size)
    if isa not in KNOWN_ISAS:
        raise NotImplementedError(
            f"CPU_ATTN ISA {isa!r} (dtype {dtype}, block_size {block_size}) stores the KV cache "
            f"in a layout the eagle2 CPU tree attention does not decode; known: {KNOWN_ISAS}")
    nb = 2
    kv = torch.zeros(nb, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv.view(nb, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    n = nb * block_size
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(n, generator=gen)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    kview, vview = cpu_kv_views(kv)
    page, row = slots // block_size, slots % block_size
    if not (torch.equal(kview[page, row], k) and torch.equal(vview[page, row], v)):
        raise NotImplementedError(
            f"vLLM's CPU_ATTN cache layout for ISA {isa!r} (dtype {dtype}, block_size "
            f"{block_size}, head_size {head_size}) is not the one cpu_kv_views decodes")
    return isa


def cpu_tree_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    tree_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention of ``query [total_q, Hq, D]`` over one layer's CPU_ATTN cache.

    Arguments and result as ``triton_kernels.tree_attention_ref`` (``seq_lens``
    = context + tree keys per request, ``tree_mask`` int32 ``[total_q, W]``
    over the trailing ``tree_lens`` keys), with the cache given as vLLM's CPU
    tensor. The tree nodes' K/V must already be in the cache (vLLM's
    ``do_kv_cache_update`` runs before attention). See :class:`TreeAttentionPlan`
    to reuse the layer-independent work across layers.
    """
    page = kv_cache.shape[2]
    plan = TreeAttentionPlan(block_table, seq_lens, cu_q_lens, tree_mask, page, tree_lens)
    return plan.attend(query, kv_cache, scale, out)


class TreeAttentionPlan:
    """The layer-independent part of a batched tree attention, built once per step.

    Requests are padded to the longest query (``nmax``) and key range
    (``lmax``): ``pages``/``rows`` [B, lmax] locate every key in the paged
    cache, ``visible`` [B, 1, nmax, lmax] is context-or-ancestor, ``src``
    [B, nmax] maps padded query rows to packed ones. :meth:`attend` then costs
    one K/V gather and one ``scaled_dot_product_attention`` per layer.
    Numerically the reference ``tree_attention_ref`` (tests compare them).
    """

    def __init__(self, block_table, seq_lens, cu_q_lens, tree_mask, page_size, tree_lens=None):
        from vllm_eagle_tree.triton_kernels.tree_attention import unpack_tree_mask

        device = block_table.device
        cu = cu_q_lens.to(device=device, dtype=torch.long)
        n = cu[1:] - cu[:-1]
        L = seq_lens.to(device=device, dtype=torch.long)
        tl = n if tree_lens is None else tree_lens.to(device=device, dtype=torch.long)
        ctx = L - tl
        B = L.numel()
        self.empty = B == 0 or int(cu[-1]) == 0
        if self.empty:
            return
        total_q = int(cu[-1])
        nmax, lmax = int(n.max()), int(L.max())
        slots = torch.arange(lmax, device=device)
        blk = (slots // page_size).clamp(max=block_table.shape[1] - 1)
        nblk = -(-lmax // page_size)
        self.blocks = block_table.long()[:, blk[::page_size][:nblk]]  # [B, nblk]
        self.pages = block_table.long()[:, blk]
        self.rows = (slots % page_size).expand(B, lmax)
        qi = torch.arange(nmax, device=device)
        self.real = qi.unsqueeze(0) < n.unsqueeze(1)  # [B, nmax]
        self.src = (cu[:-1].unsqueeze(1) + qi.unsqueeze(0)).clamp(max=total_q - 1)
        self.dst = self.src[self.real]
        rel = slots.unsqueeze(0) - ctx.unsqueeze(1)  # [B, lmax] tree-key index
        wmax = max(int(tl.max()), 1)
        bits = unpack_tree_mask(tree_mask.to(device)[self.src.reshape(-1)], wmax).view(B, nmax, -1)
        in_tree = (rel >= 0) & (slots.unsqueeze(0) < L.unsqueeze(1))
        tree_vis = torch.gather(bits, 2, rel.clamp(0, wmax - 1).unsqueeze(1).expand(B, nmax, lmax))
        visible = (rel < 0).unsqueeze(1) | (in_tree.unsqueeze(1) & tree_vis)
        visible |= ~self.real.unsqueeze(2)  # padding rows see everything (output dropped)
        self.visible = visible.unsqueeze(1)
        self.shape = (B, nmax, lmax)

    def attend_views(self, q, key_cache, value_cache, scale, out=None):
        """``q [total_q, Hq, D]`` over caches ``[num_blocks, block_size, Hkv, D]``."""
        if self.empty:
            return torch.empty_like(q) if out is None else out
        k = key_cache[self.pages, self.rows].transpose(1, 2)  # [B, Hkv, lmax, D]
        v = value_cache[self.pages, self.rows].transpose(1, 2)
        return self._attend_keys(q, k, v, scale, out)

    def attend(self, q, kv_cache, scale, out=None):
        """``q`` over one layer's CPU_ATTN cache tensor (the ``vec`` layout of
        :func:`cpu_kv_views`): whole blocks are copied out (one contiguous
        ``index_select``), which is far cheaper than gathering single slots
        through the strided views."""
        if self.empty:
            return torch.empty_like(q) if out is None else out
        B, nmax, lmax = self.shape
        nb, h, bs, two_d = kv_cache.shape
        d = two_d // 2
        nblk = self.blocks.shape[1]
        blocks = kv_cache.index_select(0, self.blocks.reshape(-1)).view(B, nblk, h, 2, bs * d)
        # per (block, head): keys transposed [D, bs], then values [bs, D]
        k = blocks[:, :, :, 0].view(B, nblk, h, d, bs).permute(0, 2, 1, 4, 3)
        v = blocks[:, :, :, 1].view(B, nblk, h, bs, d).permute(0, 2, 1, 3, 4)
        k = k.reshape(B, h, nblk * bs, d)[:, :, :lmax]
        v = v.reshape(B, h, nblk * bs, d)[:, :, :lmax]
        return self._attend_keys(q, k, v, scale, out)

    def _attend_keys(self, q, k, v, scale, out):
        """SDPA of the padded queries over gathered keys/values ``[B, Hkv, lmax, D]``;
        writes the real rows of ``out`` (allocated if None)."""
        if out is None:
            out = torch.empty_like(q)
        # contiguous fp32 keys: SDPA is several times slower on strided ones (measured)
        k, v = k.float().contiguous(), v.float().contiguous()
        qp = q[self.src].float().transpose(1, 2)  # [B, Hq, nmax, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qp, k, v, attn_mask=self.visible, scale=scale, enable_gqa=q.shape[1] > k.shape[1])
        out[self.dst] = o.transpose(1, 2)[self.real].to(out.dtype)
        return out


def padded_tree_attention(q, key_cache, value_cache, block_table, seq_lens, cu_q_lens,
                          tree_mask, scale, tree_lens=None, out=None):
    """Batched form of ``tree_attention_ref`` (same arguments, caches
    ``[num_blocks, block_size, Hkv, D]``) through :class:`TreeAttentionPlan`."""
    plan = TreeAttentionPlan(block_table, seq_lens, cu_q_lens, tree_mask, key_cache.shape[1],
                             tree_lens)
    return plan.attend_views(q, key_cache, value_cache, scale, out)


class CPUKVCompaction:
    """Moves each request's accepted path to the slots right after its
    context, in every given CPU_ATTN layer cache, in place (CONVENTIONS.md,
    KV compaction); built once per runner over vLLM's per-layer CPU tensors
    (target and draft layers alike: they share the block table when they
    share a KV cache group).

    Same result as ``triton_kernels.compact_kv_ref`` on :func:`cpu_kv_views`
    (a test holds them equal), in two ops per allocation: the elements of
    every moved slot's keys and values (each head's keys are stored
    ``[head_size, block_size]``, its values ``[block_size, head_size]``, see
    :func:`cpu_kv_views`) are found once as offsets into the layer's
    storage, and the layers sharing one allocation (vLLM allocates a KV
    cache group's layers together) are moved by one ``index_select`` and one
    ``index_copy_`` (every source is read before any destination is
    written). The reference's advanced indexing on the views, four ops a
    layer, took 2.5-3.4 ms a compaction at batch 1 on the 65 layers of the
    deep target and its head (AVX2 host); ``scripts/bench_host_ops.py``
    times this at 0.34 against the reference's 2.08 ms at batch 1, 21
    against 136 ms at batch 64.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor]):
        self.shape = tuple(kv_caches[0].shape) if kv_caches else None
        groups: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for kv in kv_caches:
            if kv.dim() != 4 or tuple(kv.shape) != self.shape or not kv.is_contiguous():
                raise ValueError(f"expected contiguous CPU_ATTN caches of one shape "
                                 f"[num_blocks, num_kv_heads, block_size, 2*head_size], got "
                                 f"{[tuple(c.shape) for c in kv_caches]}")
            groups.setdefault((kv.untyped_storage().data_ptr(), kv.dtype), []).append(kv)
        self.groups = []  # (flat view over the group's layers, each layer's offset in it)
        for group in groups.values():
            lo = min(kv.storage_offset() for kv in group)
            span = max(kv.storage_offset() for kv in group) + group[0].numel() - lo
            at = torch.tensor([kv.storage_offset() - lo for kv in group], dtype=torch.long)
            self.groups.append((group[0].as_strided((span,), (1,), lo), at.unsqueeze(1)))

    def __call__(self, block_table: torch.Tensor, context_lens: torch.Tensor,
                 num_accepted: torch.Tensor, accepted_nodes: torch.Tensor) -> None:
        """Arguments as ``triton_kernels.compact_kv_ref`` (its ``caches`` are
        this object's)."""
        if self.shape is None:
            return
        _, h, bs, two_d = self.shape
        na = num_accepted.tolist()
        keep = [b for b, n in enumerate(na) if n > 0]
        if not keep:
            return
        ctx = context_lens.tolist()
        nodes = accepted_nodes.tolist()
        src, dst = [], []
        for b in keep:
            src.extend(ctx[b] + int(x) for x in nodes[b][:na[b]])
            dst.extend(range(ctx[b] + 1, ctx[b] + 1 + na[b]))
        req = torch.tensor([b for b in keep for _ in range(na[b])], dtype=torch.long)
        bt = block_table.long()
        d = two_d // 2
        per_head = 2 * bs * d  # one head's keys then values in one block
        j = torch.arange(d, dtype=torch.long)
        heads = torch.arange(h, dtype=torch.long) * per_head

        def elements(slots: list[int]) -> torch.Tensor:
            # offsets of the slots' keys (column r of [d, bs]) and values (row r of [bs, d])
            s = torch.tensor(slots, dtype=torch.long)
            r = (s % bs).view(-1, 1, 1)
            base = (bt[req, s // bs] * (h * per_head)).view(-1, 1, 1) + heads.view(1, -1, 1)
            return torch.cat([base + j * bs + r, base + bs * d + r * d + j], -1).reshape(1, -1)

        src_el, dst_el = elements(src), elements(dst)
        for flat, at in self.groups:
            flat.index_copy_(0, (at + dst_el).reshape(-1),
                             flat.index_select(0, (at + src_el).reshape(-1)))


def cpu_compact_kv(
    kv_caches: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    num_accepted: torch.Tensor,
    accepted_nodes: torch.Tensor,
) -> None:
    """:class:`CPUKVCompaction` of ``kv_caches``, once."""
    CPUKVCompaction(kv_caches)(block_table, context_lens, num_accepted, accepted_nodes)
