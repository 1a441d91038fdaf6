"""Tree attention over vLLM's paged KV cache: one verify (or draft-tree) pass.

Layout (CONVENTIONS.md):
  * queries: each request's nodes packed back to back, ``q [total_q, Hq, D]``,
    ``cu_q_lens int32 [B+1]``;
  * keys/values: vLLM's GPU paged layout ``[num_blocks, block_size, Hkv, D]``
    with ``block_table int32 [B, max_blocks]``, ``seq_lens [B]``; logical slot
    s of request b lives at ``block_table[b, s // block_size]``,
    row ``s % block_size``;
  * the last ``tree_len`` slots of each request (default: its number of
    queries, i.e. the tree nodes themselves, which vLLM wrote before
    attention) are *tree keys*; the ``seq_len - tree_len`` slots before them
    are *context*;
  * context keys are visible to every query (the context part never reads
    the mask); tree key j (slot ``ctx_len + j``) is visible to query row i
    iff bit ``j % 32`` of word ``j // 32`` of ``tree_mask[i]`` is set
    (``int32 [total_q, W]``, the bit-packed ancestor mask).

Kernel design (for H100/H200): one program per (request, q tile, kv head,
context split). The GQA group is folded into the M dimension of the tile
(row m = node * GROUP_PAD + g), so each K/V tile is loaded once for the
whole group and ``tl.dot`` sees M = BLOCK_NODES * GROUP_PAD rows. Online
softmax in fp32 (base-2 exponentials). When the grid would be too small to
fill the GPU (small batch, long context), the context is split over
several programs (flash-decoding) and a second small kernel merges the
partial results by their log-sum-exp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpret_mode, next_pow2, num_sms

__all__ = ["tree_attention_triton", "tree_attention_ref", "unpack_tree_mask"]

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------
@triton.jit
def _round_bf16(x):
    """fp32 -> fp32 holding the round-to-nearest-even bf16 value.

    Used only under the interpreter, whose fp32 -> bf16 cast truncates;
    compiled Triton rounds to nearest already.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = bits & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _attn_tile(q, k, v, qk_scale, visible, m_i, l_i, acc,
               UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key tile. qk in the log2 domain."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no visible key yet keeps m = -inf: shift by 0 so
    # that exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = nan.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(k_head, v_head, bt_row, slot, ok, offs_d, d_ok,
                  stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                  PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V rows of the logical ``slot``s (rows where ``ok``) from the paged cache."""
    page = tl.load(bt_row + slot // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    row = slot % PAGE_SIZE
    ld_mask = ok[:, None] & d_ok[None, :]
    k = tl.load(k_head + page[:, None] * stride_kb + row[:, None] * stride_ks
                + offs_d[None, :] * stride_kd, mask=ld_mask, other=0.0)
    v = tl.load(v_head + page[:, None] * stride_vb + row[:, None] * stride_vs
                + offs_d[None, :] * stride_vd, mask=ld_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _tree_attn_fwd_kernel(
    Q, KCache, VCache, Out, TreeMask, BlockTable, SeqLens, CuQLens, TreeLens,
    PartO, PartLse,
    sm_scale, num_q_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_mt, stride_bt,
    stride_pos, stride_pot, stride_poh,
    stride_pls, stride_plt,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_NODES: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HAS_TREE_LENS: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BF16: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_NODES * GROUP_PAD
    pid0 = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = pid0 // num_q_tiles
    tile = pid0 % num_q_tiles

    q_start = tl.load(CuQLens + b)
    n_q = tl.load(CuQLens + b + 1) - q_start
    node0 = tile * BLOCK_NODES
    if node0 >= n_q:
        return
    seq_len = tl.load(SeqLens + b)
    if HAS_TREE_LENS:
        tree_len = tl.load(TreeLens + b)
        tree_end = tree_len
    else:
        tree_len = n_q
        # Parents-first numbering: the ancestors of nodes < node0 + BLOCK_NODES
        # all have smaller indices, so later tree keys are masked anyway.
        tree_end = tl.minimum(n_q, node0 + BLOCK_NODES)
    ctx_len = seq_len - tree_len

    offs_m = tl.arange(0, BLOCK_M)
    node = node0 + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (node < n_q) & (g < GROUP)
    head = kvh * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_row = (q_start + node).to(tl.int64)

    q = tl.load(Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = BlockTable + b.to(tl.int64) * stride_bt
    k_head = KCache + kvh * stride_kh
    v_head = VCache + kvh * stride_vh

    # ---- context keys: always visible, no mask read ------------------------
    n_ctx_tiles = tl.cdiv(ctx_len, BLOCK_N)
    per_split = tl.cdiv(n_ctx_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_ctx_tiles)
    for t in range(t_lo, t_hi):
        slot = t * BLOCK_N + offs_n
        kv_ok = slot < ctx_len
        k, v = _load_kv_tile(k_head, v_head, bt_row, slot, kv_ok, offs_d, d_ok,
                             stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                             PAGE_SIZE, UPCAST)
        m_i, l_i, acc = _attn_tile(q, k, v, qk_scale, kv_ok[None, :], m_i, l_i, acc,
                                   UPCAST, DOT_PRECISION)

    # ---- tree keys: ancestor mask (the last split only) --------------------
    if split == num_splits - 1:
        for t in range(0, tl.cdiv(tree_end, BLOCK_N)):
            j = t * BLOCK_N + offs_n
            j_ok = j < tree_end
            k, v = _load_kv_tile(k_head, v_head, bt_row, ctx_len + j, j_ok, offs_d, d_ok,
                                 stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                                 PAGE_SIZE, UPCAST)
            words = tl.load(TreeMask + q_row[:, None] * stride_mt + (j // 32)[None, :],
                            mask=row_ok[:, None] & j_ok[None, :], other=0)
            visible = ((words >> (j % 32)[None, :]) & 1) != 0
            m_i, l_i, acc = _attn_tile(q, k, v, qk_scale, visible, m_i, l_i, acc,
                                       UPCAST, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    st_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(PartO + split * stride_pos + q_row[:, None] * stride_pot
                 + head[:, None] * stride_poh + offs_d[None, :], o, mask=st_mask)
        tl.store(PartLse + split * stride_pls + q_row * stride_plt + head, lse, mask=row_ok)
    else:
        if RNE_BF16:
            o = _round_bf16(o)
        tl.store(Out + q_row[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :] * stride_od, o.to(Out.dtype.element_ty), mask=st_mask)


@triton.jit
def _tree_attn_combine_kernel(
    PartO, PartLse, Out, num_splits,
    stride_pos, stride_pot, stride_poh,
    stride_pls, stride_plt,
    stride_ot, stride_oh, stride_od,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Merge the context splits of one (query row, head): weights 2^(lse - max)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(PartLse + offs_s * stride_pls + t * stride_plt + h, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(PartO + offs_s[:, None] * stride_pos + t * stride_pot + h * stride_poh
                + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    den = tl.sum(w, 0)
    den = tl.where(den > 0.0, den, 1.0)
    o = tl.sum(w[:, None] * o, 0) / den
    if RNE_BF16:
        o = _round_bf16(o)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d * stride_od,
             o.to(Out.dtype.element_ty), mask=d_ok)


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------
def _pick_config(group_pad: int, head_dim_pad: int, max_q: int, dtype: torch.dtype,
                 interpret: bool) -> dict:
    if interpret:
        # Small tiles: the interpreter's cost grows with tile volume.
        block_nodes = max(1, min(next_pow2(max_q), 16 // group_pad))
        return dict(BLOCK_NODES=block_nodes, BLOCK_N=16, num_warps=4, num_stages=1)
    # M = BLOCK_NODES * GROUP_PAD rows (the GQA group folded in); tl.dot needs M >= 16.
    if dtype == torch.float32:
        # fp32 (tests only): IEEE fp32 dots have no tensor-core path; keep
        # tiles small so registers and shared memory stay within limits.
        block_nodes = max(16 // group_pad, 1, min(next_pow2(max_q), 64 // group_pad))
        return dict(BLOCK_NODES=block_nodes, BLOCK_N=32, num_warps=4, num_stages=1)
    target_m = 64 if max_q * group_pad <= 64 else 128
    block_nodes = max(16 // group_pad, 1, min(next_pow2(max_q), target_m // group_pad))
    block_m = block_nodes * group_pad
    block_n = 64 if head_dim_pad <= 128 and block_m <= 64 else 32
    num_warps = 4 if block_m <= 64 else 8
    return dict(BLOCK_NODES=block_nodes, BLOCK_N=block_n, num_warps=num_warps, num_stages=2)


def tree_attention_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    tree_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    max_q_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton tree attention. Arguments as :func:`tree_attention_ref`.

    Host-side hints (avoid a device sync when given): ``max_q_len`` (largest
    number of queries of a request, sizes the grid), ``max_seq_len`` (used
    only to choose ``num_splits``). ``num_splits`` forces the number of
    context splits; ``config`` overrides the tile configuration
    (BLOCK_NODES, BLOCK_N, num_warps, num_stages).
    """
    total_q, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    B = cu_q_lens.numel() - 1
    if out is None:
        out = torch.empty_like(q)
    if total_q == 0 or B == 0:
        return out
    interpret = interpret_mode()
    group = num_q_heads // num_kv_heads
    group_pad = next_pow2(group)
    head_dim_pad = next_pow2(head_dim)
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
    cfg = _pick_config(group_pad, head_dim_pad, max_q_len, q.dtype, interpret)
    if config:
        cfg.update(config)
    num_q_tiles = cdiv(max_q_len, cfg["BLOCK_NODES"])
    grid_base = B * num_q_tiles * num_kv_heads
    if num_splits is None:
        num_splits = 1
        if q.is_cuda and not interpret:
            sms = num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
            if grid_base < sms:
                if max_seq_len is None:
                    max_seq_len = int(seq_lens.max())
                # At least 4 key tiles per split; at most 2 waves of programs.
                by_len = max(1, cdiv(max_seq_len, 4 * cfg["BLOCK_N"]))
                num_splits = max(1, min(cdiv(2 * sms, grid_base), by_len, 32))
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    if split:
        part_o = torch.empty(num_splits, total_q, num_q_heads, head_dim_pad,
                             dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, total_q, num_q_heads, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = q.new_empty(1, 1, 1, dtype=torch.float32)
    tl_arg = tree_lens if tree_lens is not None else seq_lens  # placeholder when unused
    dot_precision = "ieee" if q.dtype == torch.float32 else None
    rne = interpret and out.dtype == torch.bfloat16
    grid = (B * num_q_tiles, num_kv_heads, num_splits)
    _tree_attn_fwd_kernel[grid](
        q, key_cache, value_cache, out, tree_mask, block_table, seq_lens, cu_q_lens, tl_arg,
        part_o, part_lse,
        float(sm_scale), num_q_tiles,
        q.stride(0), q.stride(1), q.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        tree_mask.stride(0), block_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_NODES=cfg["BLOCK_NODES"], BLOCK_N=cfg["BLOCK_N"],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        HAS_TREE_LENS=tree_lens is not None, SPLIT=split,
        UPCAST=interpret, DOT_PRECISION=dot_precision, RNE_BF16=rne,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split:
        _tree_attn_combine_kernel[(total_q, num_q_heads)](
            part_o, part_lse, out, num_splits,
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            SPLITS_PAD=next_pow2(num_splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            RNE_BF16=rne, num_warps=4,
        )
    return out


# --------------------------------------------------------------------------
# PyTorch reference (the CPU path and the test oracle)
# --------------------------------------------------------------------------
def unpack_tree_mask(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[..., W]`` bit-packed rows -> bool ``[..., n]`` (bit j%32 of word j//32)."""
    j = torch.arange(n, device=words.device)
    return ((words[..., j // 32] >> (j % 32).to(words.dtype)) & 1).bool()


def tree_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: float,
    tree_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    **_hints,
) -> torch.Tensor:
    """Tree attention, one request at a time with a dense mask.

    Args:
        q:           [total_q, Hq, D] queries, request b's rows cu_q_lens[b]:cu_q_lens[b+1].
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] paged caches.
        block_table: int32 [B, max_blocks] physical block of each logical block.
        seq_lens:    int [B] keys per request (context + tree keys).
        cu_q_lens:   int32 [B+1].
        tree_mask:   int32 [total_q, W] packed visibility of the tree keys.
        sm_scale:    softmax scale.
        tree_lens:   int [B] number of trailing tree keys (default: queries per request).
        out:         optional output buffer [total_q, Hq, D].
        compute_dtype: float32 (default) or float64.

    Returns ``out`` in q's dtype. Extra keyword hints of the Triton version
    (max_q_len, ...) are accepted and ignored.
    """
    total_q, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    lens = seq_lens.tolist()
    tls = tree_lens.tolist() if tree_lens is not None else None
    for b in range(len(cu) - 1):
        qs, qe = cu[b], cu[b + 1]
        n = qe - qs
        if n == 0:
            continue
        L = lens[b]
        tree_len = n if tls is None else tls[b]
        ctx = L - tree_len
        slots = torch.arange(L, device=key_cache.device)
        pages = block_table[b].long()[slots // page_size]
        rows = slots % page_size
        k = key_cache[pages, rows].to(compute_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = value_cache[pages, rows].to(compute_dtype).repeat_interleave(group, dim=1)
        visible = torch.ones(n, L, dtype=torch.bool, device=q.device)
        visible[:, ctx:] = unpack_tree_mask(tree_mask[qs:qe], tree_len)
        s = torch.einsum("nhd,lhd->hnl", q[qs:qe].to(compute_dtype), k) * sm_scale
        s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[qs:qe] = torch.einsum("hnl,lhd->nhd", p, v).to(out.dtype)
    return out
