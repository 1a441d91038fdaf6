"""Triton kernels of vllm-eagle-tree, each with its PyTorch reference beside it.

Installed as ``vllm_eagle_tree.triton_kernels`` (never as a top-level
``triton_kernels``: vLLM probes that name for OpenAI's MoE kernels).

Modules:
  tree_attention  varlen tree attention over the paged KV cache
  tree_sampling   per-node draws (temperature/top-k/top-p, Philox race) + tree walk
  kv_compaction   copy accepted paths' KV after the context, all layers at once
  dispatch        Triton on GPU tensors, references elsewhere; vLLM CPU fallbacks

The functions exported here dispatch; the ``*_triton`` / ``*_ref`` variants
live in the modules.
"""
from .dispatch import (
    compact_kv,
    kernel_backend,
    register_cpu_fallbacks,
    paged_tree_attention,
    tree_draw_tokens,
    tree_verify,
    tree_walk,
    use_triton,
)
from .kv_compaction import KVCacheTable, compact_kv_ref, compact_kv_triton
from .tree_attention import tree_attention_ref, tree_attention_triton, unpack_tree_mask
from .tree_sampling import (
    philox_exponential_noise,
    philox_uniforms,
    tree_draw_tokens_ref,
    tree_draw_tokens_triton,
    tree_verify_ref,
    tree_verify_triton,
    tree_walk_ref,
    tree_walk_triton,
)

__all__ = [
    "paged_tree_attention", "tree_draw_tokens", "tree_walk", "tree_verify", "compact_kv",
    "register_cpu_fallbacks", "use_triton", "kernel_backend",
    "KVCacheTable",
    "tree_attention_triton", "tree_attention_ref", "unpack_tree_mask",
    "tree_draw_tokens_triton", "tree_draw_tokens_ref", "tree_walk_triton", "tree_walk_ref",
    "tree_verify_triton", "tree_verify_ref", "philox_uniforms", "philox_exponential_noise",
    "compact_kv_triton", "compact_kv_ref",
]
