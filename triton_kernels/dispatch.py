"""One dispatch layer: Triton on GPU tensors, the PyTorch references elsewhere.

``VLLM_EAGLE_TREE_KERNELS`` overrides the choice: ``auto`` (default),
``reference`` (always the references) or ``triton`` (always the Triton
launchers, e.g. on CPU tensors under ``TRITON_INTERPRET=1`` for debugging).

:func:`register_cpu_fallbacks` additionally registers the references as
overrides of the Triton kernels themselves through vLLM's
``vllm.triton_utils.dispatcher.register_kernels`` (vLLM 0.32), the mechanism
``CpuPlatform.register_triton_kernel_overrides`` uses for vLLM's own
kernels, so that a direct ``kernel[grid](...)`` launch on a machine without
a Triton GPU backend runs the reference instead. vLLM is imported only
inside that function.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch

from ._common import triton_gpu_backend
from . import kv_compaction as _kvc
from . import tree_attention as _attn
from . import tree_sampling as _samp

__all__ = [
    "kernel_backend", "use_triton",
    "paged_tree_attention", "tree_draw_tokens", "tree_walk", "tree_verify", "compact_kv",
    "register_cpu_fallbacks",
]

_ENV = "VLLM_EAGLE_TREE_KERNELS"


def kernel_backend() -> str:
    """'auto', 'triton' or 'reference' (from VLLM_EAGLE_TREE_KERNELS)."""
    mode = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"{_ENV} must be auto, triton or reference; got {mode!r}")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors on ``t``'s device."""
    mode = kernel_backend()
    if mode != "auto":
        return mode == "triton"
    return t.is_cuda and triton_gpu_backend() is not None


def paged_tree_attention(q, key_cache, value_cache, block_table, seq_lens, cu_q_lens, tree_mask,
                   sm_scale, tree_lens=None, out=None, **hints) -> torch.Tensor:
    """Tree attention (see tree_attention.tree_attention_ref for the arguments)."""
    fn = _attn.tree_attention_triton if use_triton(q) else _attn.tree_attention_ref
    return fn(q, key_cache, value_cache, block_table, seq_lens, cu_q_lens, tree_mask,
              sm_scale, tree_lens, out, **hints)


def tree_draw_tokens(logits, cu_nodes, temperature, top_k, top_p, seeds, offsets) -> torch.Tensor:
    """One draw per node (see tree_sampling.tree_draw_tokens_ref)."""
    fn = _samp.tree_draw_tokens_triton if use_triton(logits) else _samp.tree_draw_tokens_ref
    return fn(logits, cu_nodes, temperature, top_k, top_p, seeds, offsets)


def tree_walk(draws, tree, *, max_depth: int | None = None, max_nodes: int | None = None):
    """Walk the trees along the draws -> core.verification.VerifyResult."""
    if use_triton(draws):
        return _samp.tree_walk_triton(draws, tree, max_depth=max_depth, max_nodes=max_nodes)
    return _samp.tree_walk_ref(draws, tree, max_depth=max_depth)


def tree_verify(logits, tree, temperature, top_k, top_p, seeds, offsets, *,
                max_depth: int | None = None, max_nodes: int | None = None):
    """Draw and walk (see tree_sampling.tree_verify_ref) -> VerifyResult."""
    if use_triton(logits):
        return _samp.tree_verify_triton(logits, tree, temperature, top_k, top_p, seeds, offsets,
                                        max_depth=max_depth, max_nodes=max_nodes)
    return _samp.tree_verify_ref(logits, tree, temperature, top_k, top_p, seeds, offsets,
                                 max_depth=max_depth)


def compact_kv(caches, block_table, context_lens, num_accepted, accepted_nodes) -> None:
    """In-place KV compaction of all layers (see kv_compaction.compact_kv_ref)."""
    dev_t = block_table
    fn = _kvc.compact_kv_triton if use_triton(dev_t) else _kvc.compact_kv_ref
    fn(caches, block_table, context_lens, num_accepted, accepted_nodes)


# --------------------------------------------------------------------------
# Kernel-level CPU fallbacks through vLLM's dispatcher
# --------------------------------------------------------------------------
def _arg_names(kernel: Any) -> list[str]:
    names = getattr(kernel, "arg_names", None)
    if names is None:
        names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
    return list(names)


def _bound(kernel: Any, impl: Callable[[dict], None]) -> Callable[..., None]:
    """Adapt ``impl(named_args)`` to a launch ``kernel[grid](*args, **kwargs)``."""
    names = _arg_names(kernel)

    def launch(*args, **kwargs):
        named = dict(zip(names, args))
        named.update(kwargs)
        impl(named)

    launch.__name__ = f"{getattr(kernel, '__name__', 'kernel')}_reference"
    return launch


def _attn_fwd_impl(a: dict) -> None:
    o = _attn.tree_attention_ref(
        a["Q"], a["KCache"], a["VCache"], a["BlockTable"], a["SeqLens"], a["CuQLens"],
        a["TreeMask"], a["sm_scale"], a["TreeLens"] if a.get("HAS_TREE_LENS") else None)
    if a.get("SPLIT"):
        # One "split" holds the whole result; the combine launch (also
        # overridden, or the real one) then reproduces it.
        d = o.shape[-1]
        a["PartO"].zero_()
        a["PartO"][0, :, :, :d] = o.float()
        a["PartLse"].fill_(float("-inf"))
        a["PartLse"][0] = 0.0
    else:
        a["Out"].copy_(o)


def _attn_combine_impl(a: dict) -> None:
    n = int(a["num_splits"])
    lse = a["PartLse"][:n]                              # [S, T, H], log2 domain
    m = lse.amax(0, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(lse - m)
    den = w.sum(0).clamp(min=torch.finfo(torch.float32).tiny)
    d = a["Out"].shape[-1]
    o = (w.unsqueeze(-1) * a["PartO"][:n, :, :, :d]).sum(0) / den.unsqueeze(-1)
    a["Out"].copy_(o)


def _draw_impl(a: dict) -> None:
    a["Draws"].copy_(_samp.tree_draw_tokens_ref(
        a["Logits"], a["CuNodes"], a["Temp"], a["TopK"], a["TopP"], a["Seeds"], a["Offsets"]))


def _walk_impl(a: dict) -> None:
    from vllm_eagle_tree.core.tree import TreeBatch
    cu, par = a["CuNodes"], a["Parent"]
    total = par.numel()
    req = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device),
                                  (cu[1:] - cu[:-1]).long(), output_size=total)
    gpar = torch.where(par >= 0, par.long() + cu.long()[req], -1)
    depth = torch.zeros(total, dtype=torch.int64, device=par.device)
    for _ in range(int((cu[1:] - cu[:-1]).max()) if total else 0):
        depth = torch.where(gpar >= 0, depth[gpar.clamp(min=0)] + 1, 0)
    tree = TreeBatch(cu, a["Token"], par, depth.to(torch.int32),
                     torch.zeros(total, dtype=torch.float32, device=par.device),
                     torch.zeros(cu.numel() - 1, dtype=torch.int32, device=par.device))
    res = _samp.tree_walk_ref(a["Draws"], tree, max_depth=int(a["max_depth"]))
    a["NumAcc"].copy_(res.num_accepted)
    a["AccNodes"].copy_(res.accepted_nodes)
    a["AccTokens"].copy_(res.accepted_tokens)
    a["Bonus"].copy_(res.bonus_token)


def _compact_impl(a: dict) -> None:
    table = _kvc._TABLES.get(a["PtrTable"].data_ptr())
    if table is None:
        raise RuntimeError("KV compaction fallback: unknown pointer table (build it with "
                           "KVCacheTable and keep it alive)")
    _kvc.compact_kv_ref(table, a["BlockTable"], a["ContextLens"], a["NumAccepted"],
                        a["AcceptedNodes"])


_FALLBACKS: dict[str, tuple[Any, Callable[[dict], None]]] = {
    "tree_attention._tree_attn_fwd_kernel": (_attn, _attn_fwd_impl),
    "tree_attention._tree_attn_combine_kernel": (_attn, _attn_combine_impl),
    "tree_sampling._tree_draw_kernel": (_samp, _draw_impl),
    "tree_sampling._tree_walk_kernel": (_samp, _walk_impl),
    "kv_compaction._kv_compact_kernel": (_kvc, _compact_impl),
}
_registered = False


def register_cpu_fallbacks(force: bool = False) -> bool:
    """Register the references as vLLM kernel overrides (vLLM 0.32 dispatcher).

    Like ``CpuPlatform.register_triton_kernel_overrides`` it does nothing
    when vLLM sees a usable Triton (``vllm.triton_utils.HAS_TRITON``) unless
    ``force``. It also does nothing under ``TRITON_INTERPRET=1``, where the
    caller asked for the Triton kernels themselves in the interpreter (the
    kernel tests run in the same process as tests that load the plugin).
    Idempotent. Returns True if the overrides are registered.
    """
    global _registered
    if _registered:
        return True
    if not force and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import register_kernels

    if HAS_TRITON and not force:
        return False
    pkg = __name__.rsplit(".", 1)[0]  # vllm_eagle_tree.triton_kernels
    overrides = {}
    for name, (module, impl) in _FALLBACKS.items():
        kernel = getattr(module, name.rsplit(".", 1)[1])
        overrides[f"{pkg}.{name}"] = _bound(kernel, impl)
    register_kernels(overrides)
    _registered = True
    return True
