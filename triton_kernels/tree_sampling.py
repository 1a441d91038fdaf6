"""Batched tree verification: one draw per node, then the walk (CONVENTIONS.md).

Semantics are those of ``vllm_eagle_tree.core.verification`` (vLLM 0.32's
sampler): per request temperature, then top-k (ties with the k-th largest
kept), then top-p on the renormalised distribution (smallest set of largest
tokens whose mass reaches p, ties kept), then one draw per node by the
exponential race ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)``; greedy rows
(temperature < 1e-5) take ``argmax(logits)``. The walk follows the draws
from the root.

Random numbers. Node i (local index) of request b uses Philox-4x32-10, the
generator of ``tl.rand``/``tl.randint`` (``tl.philox``), keyed by the
request's 64-bit seed, with the counter

    (c0, c1, c2, c3) = (v mod V4, i, offset_b & 0xffffffff, offset_b >> 32),
    V4 = ceil(V / 4),

and takes output word ``v // V4`` of the four; the word becomes a uniform
``u`` in [0, 1) by ``tl.uint_to_uniform_float`` and the noise is
``E = -log(u)`` (``u = 0`` gives ``E = inf``: that token cannot win). Each
counter feeds four tokens (one per quarter of the vocabulary), so Philox
runs V/4 times per row. ``offset_b`` is the caller's per-step counter:
advance it by at least 1 per verification step (any unique value works;
node and vocabulary index have their own counter words). The reference
(:func:`philox_uniforms`) regenerates the same uniforms bit-exactly in
PyTorch.

Kernel (one program per node row, streaming over the vocabulary in blocks,
never materialising a float32 copy of the row):
  * greedy row: one pass, argmax (first index among equal maxima);
  * top-k: the k-th largest scaled logit found exactly by a multi-pivot
    bisection over the order-preserving int32 image of float32 (each pass
    counts ``x >= pivot`` for NUM_PIVOTS pivots at once, ~7-9 passes);
  * top-p: one pass for max / normaliser over the top-k survivors, then the
    same bisection on "mass strictly above the pivot < p * Z";
  * draw pass: ``argmax(x/T - log E)`` over the survivors (the log of
    ``p/E``; the normaliser cancels), first index among equal scores.
The walk is a second, tiny kernel (one program per request).

Where the kernel can differ from the reference: only through float rounding
(kernel: block-wise fp32 sums and Triton's exp/log; reference: torch's fp32
softmax and cumsum over the sorted row). Top-k thresholds, greedy argmax and
the uniforms are exact. The top-p threshold can differ when the mass above
some token lies within ~1e-6 (relative) of p, and a draw can differ when the
two best race scores are that close; both need near-ties that random inputs
practically never produce (tests choose top_p between cumulative masses).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_eagle_tree.core.tree import TreeBatch
from vllm_eagle_tree.core.verification import (
    SAMPLING_EPS,
    VerifyResult,
    apply_sampling_params,
    draw_tokens,
    expand_to_nodes,
    walk_trees,
)

from ._common import cdiv, interpret_mode, next_pow2

__all__ = [
    "tree_draw_tokens_triton", "tree_walk_triton", "tree_verify_triton",
    "tree_draw_tokens_ref", "tree_walk_ref", "tree_verify_ref",
    "philox_4x32", "philox_uniforms", "philox_exponential_noise",
]

_M32 = 0xFFFFFFFF
_UNIFORM_SCALE = 4.6566127342e-10  # tl.uint_to_uniform_float, 32-bit case


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------
@triton.jit
def _float_to_key(x):
    """float32 -> int32 with the same order (-0.0 sorts just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_to_float(k):
    bits = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_scaled(lrow, v, ok, temp):
    x = tl.load(lrow + v, mask=ok, other=float("-inf")).to(tl.float32)
    # div_rn: correctly rounded, as torch's `logits / temperature`.
    return tl.math.div_rn(x, temp)


@triton.jit
def _philox_uniform4(seed, c, node, c2, c3):
    """Four uniforms in [0, 1) per counter c (a block of int32 >= 0)."""
    c0 = c.to(tl.uint32)
    z = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, z + node.to(tl.uint32), z + c2, z + c3)
    return (tl.uint_to_uniform_float(r0), tl.uint_to_uniform_float(r1),
            tl.uint_to_uniform_float(r2), tl.uint_to_uniform_float(r3))


@triton.jit
def _race_quarter(lrow, c, q, V, V4, temp, thr, u, best, bidx):
    """Race step for vocabulary quarter q of a counter block: update (best, bidx)."""
    v = q * V4 + c
    ok = (c < V4) & (v < V)
    xs = _load_scaled(lrow, v, ok, temp)
    # E = -log(u); u = 0 gives E = inf (score -inf).
    u_pos = u > 0.0
    e = -tl.log(tl.where(u_pos, u, 0.5))
    score = xs - tl.log(e)
    keep = ok & u_pos & (xs >= thr)
    score = tl.where(keep, score, float("-inf"))
    bm = tl.max(score, 0)
    bi = tl.min(tl.where(score == bm, v, V), 0)
    better = (bm > best) | ((bm == best) & (bi < bidx))
    return tl.where(better, bm, best), tl.where(better, bi, bidx)


@triton.jit
def _tree_draw_kernel(
    Logits, ReqIdx, CuNodes, Temp, TopK, TopP, Seeds, Offsets, Draws, Thresholds,
    V, stride_l,
    BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr, STORE_THR: tl.constexpr,
):
    pid = tl.program_id(0)
    lrow = Logits + pid.to(tl.int64) * stride_l
    b = tl.load(ReqIdx + pid)
    node = pid - tl.load(CuNodes + b)
    temp = tl.load(Temp + b).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)

    if temp < 1e-5:
        # ---- greedy: argmax of the raw logits, first index -----------------
        best = tl.full([], float("-inf"), tl.float32)
        bidx = tl.full([], 0, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            x = tl.load(lrow + v, mask=v < V, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, 0)
            bi = tl.min(tl.where(x == bm, v, V), 0)
            better = bm > best
            best = tl.where(better, bm, best)
            bidx = tl.where(better, bi, bidx)
        tl.store(Draws + pid, bidx.to(tl.int64))
    else:
        k = tl.load(TopK + b).to(tl.int32)
        top_p = tl.load(TopP + b).to(tl.float32)
        use_k = (k > 0) & (k < V)
        use_p = top_p < 1.0
        j = tl.arange(0, NUM_PIVOTS).to(tl.int64)
        thr = tl.full([], float("-inf"), tl.float32)

        if use_k:
            # Largest key K with count(x >= val(K)) >= k: that value is the
            # k-th largest logit. Pivots in (lo, hi]; count is non-increasing.
            lo = _float_to_key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
            hi = _float_to_key(tl.full([], float("inf"), tl.float32)).to(tl.int64)
            while lo < hi:
                piv = lo + 1 + ((hi - lo - 1) * (j + 1)) // (NUM_PIVOTS + 1)
                piv_f = _key_to_float(piv.to(tl.int32))
                cnt = tl.zeros([NUM_PIVOTS], tl.int32)
                for v0 in range(0, V, BLOCK_V):
                    v = v0 + offs
                    ok = v < V
                    xs = _load_scaled(lrow, v, ok, temp)
                    ge = (xs[:, None] >= piv_f[None, :]) & ok[:, None]
                    cnt += tl.sum(ge.to(tl.int32), 0)
                good = cnt >= k
                lo = tl.maximum(lo, tl.max(tl.where(good, piv, lo), 0))
                hi = tl.minimum(hi, tl.min(tl.where(good, hi, piv - 1), 0))
            thr = _key_to_float(lo.to(tl.int32))

        if use_p:
            # Max and normaliser of the survivors of top-k.
            m = tl.full([], float("-inf"), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                v = v0 + offs
                xs = _load_scaled(lrow, v, v < V, temp)
                m = tl.maximum(m, tl.max(xs, 0))
            z = tl.zeros([], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                v = v0 + offs
                ok = v < V
                xs = _load_scaled(lrow, v, ok, temp)
                z += tl.sum(tl.where(ok & (xs >= thr), tl.exp(xs - m), 0.0), 0)
            target = top_p * z
            # Smallest key K (<= key(max)) whose strictly-greater mass < p*Z:
            # the logit of the last kept token. Pivots in [lo, hi); the mass
            # is non-increasing in the pivot. hi = key(max) is the fallback
            # (at least one token survives).
            lo = _float_to_key(thr).to(tl.int64)
            hi = _float_to_key(m).to(tl.int64)
            while lo < hi:
                piv = lo + ((hi - lo) * (j + 1)) // (NUM_PIVOTS + 1)
                piv_f = _key_to_float(piv.to(tl.int32))
                mass = tl.zeros([NUM_PIVOTS], tl.float32)
                for v0 in range(0, V, BLOCK_V):
                    v = v0 + offs
                    ok = v < V
                    xs = _load_scaled(lrow, v, ok, temp)
                    e = tl.where(ok & (xs >= thr), tl.exp(xs - m), 0.0)
                    gt = xs[:, None] > piv_f[None, :]
                    mass += tl.sum(tl.where(gt, e[:, None], 0.0), 0)
                good = mass < target
                hi = tl.minimum(hi, tl.min(tl.where(good, piv, hi), 0))
                lo = tl.maximum(lo, tl.max(tl.where(good, lo, piv + 1), 0))
            thr = _key_to_float(lo.to(tl.int32))
        if STORE_THR:
            tl.store(Thresholds + pid, thr)

        # ---- the race over the survivors -----------------------------------
        seed = tl.load(Seeds + b).to(tl.int64)
        off = tl.load(Offsets + b).to(tl.int64)
        c2 = (off & 0xFFFFFFFF).to(tl.uint32)
        c3 = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
        V4 = tl.cdiv(V, 4)
        BLOCK_C: tl.constexpr = BLOCK_V // 4
        offs_c = tl.arange(0, BLOCK_C)
        best = tl.full([], float("-inf"), tl.float32)
        bidx = tl.full([], 0, tl.int32)
        for c0 in range(0, V4, BLOCK_C):
            c = c0 + offs_c
            u0, u1, u2, u3 = _philox_uniform4(seed, c, node, c2, c3)
            best, bidx = _race_quarter(lrow, c, 0, V, V4, temp, thr, u0, best, bidx)
            best, bidx = _race_quarter(lrow, c, 1, V, V4, temp, thr, u1, best, bidx)
            best, bidx = _race_quarter(lrow, c, 2, V, V4, temp, thr, u2, best, bidx)
            best, bidx = _race_quarter(lrow, c, 3, V, V4, temp, thr, u3, best, bidx)
        tl.store(Draws + pid, bidx.to(tl.int64))


@triton.jit
def _tree_walk_kernel(
    Draws, Parent, Token, CuNodes,
    NumAcc, AccNodes, AccTokens, Bonus,
    max_depth, stride_an, stride_at,
    BLOCK: tl.constexpr, DEPTH_PAD: tl.constexpr,
):
    """Walk one request's tree: from the root, move to the child whose token
    equals the current node's draw. Children have larger indices than their
    parent (parents-first), which also bounds the loop."""
    b = tl.program_id(0)
    s = tl.load(CuNodes + b)
    n = tl.load(CuNodes + b + 1) - s
    idx = tl.arange(0, BLOCK)
    ok = idx < n
    par = tl.load(Parent + s + idx, mask=ok, other=-2)
    tok = tl.load(Token + s + idx, mask=ok, other=-1).to(tl.int64)
    drw = tl.load(Draws + s + idx, mask=ok, other=-1).to(tl.int64)
    cur = b * 0
    nacc = b * 0
    dcur = tl.sum(tl.where(idx == 0, drw, 0), 0)
    go = n > 1
    while go:
        match = ok & (par == cur) & (tok == dcur) & (idx > cur)
        c = tl.min(tl.where(match, idx, BLOCK), 0)
        go = (c < BLOCK) & (nacc < max_depth)
        tl.store(AccNodes + b * stride_an + nacc, c.to(tl.int64), mask=go)
        tl.store(AccTokens + b * stride_at + nacc,
                 tl.sum(tl.where(idx == c, tok, 0), 0), mask=go)
        cur = tl.where(go, c, cur)
        dcur = tl.where(go, tl.sum(tl.where(idx == c, drw, 0), 0), dcur)
        nacc = tl.where(go, nacc + 1, nacc)
    offs_d = tl.arange(0, DEPTH_PAD)
    pad = (offs_d >= nacc) & (offs_d < max_depth)
    tl.store(AccNodes + b * stride_an + offs_d, tl.full([DEPTH_PAD], -1, tl.int64), mask=pad)
    tl.store(AccTokens + b * stride_at + offs_d, tl.full([DEPTH_PAD], -1, tl.int64), mask=pad)
    tl.store(NumAcc + b, nacc.to(tl.int64))
    tl.store(Bonus + b, dcur)


@triton.jit
def _philox_uniforms_kernel(Seeds, Offsets, Out, node, n_counters, stride_o,
                            BLOCK_C: tl.constexpr):
    """Test helper: the uniforms the draw kernel uses, [4, n_counters] per row."""
    b = tl.program_id(0)
    seed = tl.load(Seeds + b).to(tl.int64)
    off = tl.load(Offsets + b).to(tl.int64)
    c2 = (off & 0xFFFFFFFF).to(tl.uint32)
    c3 = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    nd = b * 0 + node
    for c0 in range(0, n_counters, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = c < n_counters
        u0, u1, u2, u3 = _philox_uniform4(seed, c, nd, c2, c3)
        base = Out + b * stride_o
        tl.store(base + c, u0, mask=ok)
        tl.store(base + n_counters + c, u1, mask=ok)
        tl.store(base + 2 * n_counters + c, u2, mask=ok)
        tl.store(base + 3 * n_counters + c, u3, mask=ok)


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------
def _per_request(x, B: int, dtype: torch.dtype, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        return torch.full((B,), x, dtype=dtype, device=device)
    x = x.to(device=device, dtype=dtype).reshape(-1)
    if x.numel() == 1 and B != 1:
        x = x.expand(B)
    return x.contiguous()


def tree_draw_tokens_triton(
    logits: torch.Tensor,
    cu_nodes: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor | int,
    *,
    block_v: int | None = None,
    num_pivots: int | None = None,
    thresholds: torch.Tensor | None = None,
) -> torch.Tensor:
    """One draw per node (int64 [total]); arguments as :func:`tree_draw_tokens_ref`.

    ``thresholds`` (float32 [total], optional, for tests): receives each
    sampled row's survivor threshold (survivors: scaled logit >= it; -inf
    when no top-k/top-p); greedy rows are left untouched.
    """
    T, V = logits.shape
    B = cu_nodes.numel() - 1
    dev = logits.device
    draws = torch.empty(T, dtype=torch.int64, device=dev)
    if T == 0:
        return draws
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    cu = cu_nodes.to(device=dev, dtype=torch.int32)
    req = torch.searchsorted(cu[1:].contiguous(), torch.arange(T, device=dev, dtype=torch.int32),
                             right=True).to(torch.int32)
    interpret = interpret_mode()
    if block_v is None:
        block_v = min(256 if interpret else 2048, max(16, next_pow2(V)))
    if num_pivots is None:
        num_pivots = 8 if interpret else 16
    _tree_draw_kernel[(T,)](
        logits, req, cu,
        _per_request(temperature, B, torch.float32, dev),
        _per_request(top_k, B, torch.int32, dev),
        _per_request(top_p, B, torch.float32, dev),
        _per_request(seeds, B, torch.int64, dev),
        _per_request(offsets, B, torch.int64, dev),
        draws, thresholds if thresholds is not None else draws, V, logits.stride(0),
        BLOCK_V=block_v, NUM_PIVOTS=num_pivots, STORE_THR=thresholds is not None,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return draws


def tree_walk_triton(
    draws: torch.Tensor,
    tree: TreeBatch,
    *,
    max_depth: int | None = None,
    max_nodes: int | None = None,
) -> VerifyResult:
    """Walk every tree along its draws; output as ``core.verification.walk_trees``.

    ``max_depth`` (columns of the outputs) defaults to ``tree.max_depth``
    and ``max_nodes`` to ``tree.max_size`` (each a device sync when not
    given). A walk is cut at ``max_depth`` accepted nodes.
    """
    B = tree.num_requests
    dev = tree.token.device
    if max_depth is None:
        max_depth = tree.max_depth
    if max_nodes is None:
        max_nodes = tree.max_size
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    acc_nodes = torch.empty(B, max_depth, dtype=torch.int64, device=dev)
    acc_tokens = torch.empty(B, max_depth, dtype=torch.int64, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        _tree_walk_kernel[(B,)](
            draws.reshape(-1), tree.parent, tree.token, tree.cu_nodes,
            num_acc, acc_nodes, acc_tokens, bonus,
            max_depth, max(acc_nodes.stride(0), 1), max(acc_tokens.stride(0), 1),
            BLOCK=max(16, next_pow2(max_nodes)), DEPTH_PAD=max(16, next_pow2(max_depth)),
            num_warps=1,
        )
    return VerifyResult(num_accepted=num_acc, accepted_nodes=acc_nodes,
                        accepted_tokens=acc_tokens, bonus_token=bonus)


def tree_verify_triton(
    logits: torch.Tensor,
    tree: TreeBatch,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor | int,
    *,
    max_depth: int | None = None,
    max_nodes: int | None = None,
) -> VerifyResult:
    """Draw every node and walk every tree (two launches). See :func:`tree_verify_ref`."""
    draws = tree_draw_tokens_triton(logits, tree.cu_nodes, temperature, top_k, top_p,
                                    seeds, offsets)
    return tree_walk_triton(draws, tree, max_depth=max_depth, max_nodes=max_nodes)


# --------------------------------------------------------------------------
# PyTorch reference (the CPU path and the test oracle)
# --------------------------------------------------------------------------
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for uint32 values held in int64 (no overflow)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_lo = a * b_lo  # < 2^48
    p_hi = a * b_hi  # < 2^48
    high = ((p_lo >> 16) + p_hi) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    return high, low


def philox_4x32(seed, c0, c1, c2, c3, n_rounds: int = 10):
    """Triton's ``tl.philox`` (philox_impl, 32-bit) in PyTorch on int64 tensors.

    ``seed`` int64 (tensor or int, two's complement as in Triton's cast to
    uint64); ``c0..c3`` uint32 values in int64 tensors (broadcastable).
    Returns the four uint32 output words as int64 tensors.
    """
    dev = next((c.device for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None)
    seed = torch.as_tensor(seed, dtype=torch.int64, device=dev)
    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    c0, c1, c2, c3 = torch.broadcast_tensors(
        *(torch.as_tensor(c, dtype=torch.int64, device=dev) & _M32 for c in (c0, c1, c2, c3)))
    for _ in range(n_rounds):
        hi_b, lo_b = _mul32(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def uint_to_uniform_float(r: torch.Tensor) -> torch.Tensor:
    """``tl.uint_to_uniform_float`` for uint32 words held in int64: float32 in [0, 1)."""
    x = torch.where(r >= 2**31, r - 2**32, r)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)          # ~x
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=r.device)


def philox_uniforms(seed: int, offset: int, nodes: torch.Tensor, vocab: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [len(nodes), vocab]: the kernel's uniforms for these local node indices.

    Integer-exact on any device (int64 arithmetic, no overflow), so CPU and
    GPU give the same bits.
    """
    device = nodes.device if device is None else device
    v4 = cdiv(vocab, 4)
    c0 = torch.arange(v4, dtype=torch.int64, device=device).unsqueeze(0)
    c1 = nodes.to(device=device, dtype=torch.int64).unsqueeze(1)
    offset = int(offset)
    words = philox_4x32(int(seed), c0, c1, offset & _M32, (offset >> 32) & _M32)
    return uint_to_uniform_float(torch.cat(words, dim=1)[:, :vocab])


def philox_exponential_noise(
    cu_nodes: torch.Tensor, vocab: int, seeds: torch.Tensor, offsets: torch.Tensor,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Exp(1) noise [total, vocab] float32 exactly as the kernel makes it: ``-log(u)``.

    Computed on ``device`` (default: cu_nodes' device), one request at a time.
    """
    device = cu_nodes.device if device is None else torch.device(device)
    bounds = cu_nodes.tolist()
    B = len(bounds) - 1
    seeds = _per_request(seeds, B, torch.int64, "cpu").tolist()
    offsets = _per_request(offsets, B, torch.int64, "cpu").tolist()
    out = torch.empty(bounds[-1], vocab, dtype=torch.float32, device=device)
    for b in range(B):
        n = bounds[b + 1] - bounds[b]
        if n:
            u = philox_uniforms(seeds[b], offsets[b], torch.arange(n, device=device), vocab)
            out[bounds[b]:bounds[b + 1]] = -torch.log(u)
    return out


def tree_draw_tokens_ref(
    logits: torch.Tensor,
    cu_nodes: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor | int,
    **_hints,
) -> torch.Tensor:
    """One draw per node, int64 [total].

    Args:
        logits:      [total, V] target logits (fp32/bf16/fp16), row i = after node i.
        cu_nodes:    int32 [B+1].
        temperature: float [B]; < 1e-5 means greedy.
        top_k:       int [B]; <= 0 or >= V means off.
        top_p:       float [B]; 1.0 means off.
        seeds:       int64 [B] per-request Philox seeds.
        offsets:     int64 [B] (or an int for all) per-step Philox offsets.
    """
    B = cu_nodes.numel() - 1
    dev = logits.device
    temp_n = expand_to_nodes(_per_request(temperature, B, torch.float32, dev), cu_nodes.to(dev))
    k_n = expand_to_nodes(_per_request(top_k, B, torch.int64, dev), cu_nodes.to(dev))
    p_n = expand_to_nodes(_per_request(top_p, B, torch.float32, dev), cu_nodes.to(dev))
    probs = apply_sampling_params(logits, temp_n, k_n, p_n)
    noise = philox_exponential_noise(cu_nodes, logits.shape[1], seeds, offsets, device=dev)
    return draw_tokens(logits, probs, noise, temp_n < SAMPLING_EPS)


def tree_walk_ref(draws: torch.Tensor, tree: TreeBatch, *, max_depth: int | None = None,
                  **_hints) -> VerifyResult:
    """``core.verification.walk_trees``, widened/cut to ``max_depth`` columns if given."""
    res = walk_trees(draws, tree)
    if max_depth is not None and max_depth != res.accepted_nodes.shape[1]:
        D = res.accepted_nodes.shape[1]
        if max_depth > D:
            pad = torch.full((tree.num_requests, max_depth - D), -1, dtype=torch.int64,
                             device=res.accepted_nodes.device)
            res.accepted_nodes = torch.cat([res.accepted_nodes, pad], 1)
            res.accepted_tokens = torch.cat([res.accepted_tokens, pad], 1)
        else:
            # Cut walks at max_depth, as the kernel does.
            res.accepted_nodes = res.accepted_nodes[:, :max_depth].contiguous()
            res.accepted_tokens = res.accepted_tokens[:, :max_depth].contiguous()
            res.num_accepted = (res.accepted_nodes >= 0).sum(1)
            last = torch.where(res.num_accepted > 0,
                               res.accepted_nodes.gather(1, (res.num_accepted - 1).clamp(min=0)
                                                         .unsqueeze(1)).squeeze(1), 0)
            res.bonus_token = draws.to(torch.int64).reshape(-1)[tree.cu_nodes[:-1].long() + last]
    return res


def tree_verify_ref(
    logits: torch.Tensor,
    tree: TreeBatch,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor | int,
    *,
    max_depth: int | None = None,
    **_hints,
) -> VerifyResult:
    """Verify a batch of trees with the kernel's random numbers (core functions)."""
    draws = tree_draw_tokens_ref(logits, tree.cu_nodes, temperature, top_k, top_p, seeds, offsets)
    return tree_walk_ref(draws, tree, max_depth=max_depth)
