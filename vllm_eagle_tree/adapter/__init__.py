"""The vLLM adapter: every piece of code that touches vLLM internals.

The algorithm (``vllm_eagle_tree.core``) and the kernels
(``vllm_eagle_tree.triton_kernels``) never import vLLM; this package glues
them into vLLM 0.32. Monkeypatches are *installed* only by
``vllm_eagle_tree.plugin.register``; modules here provide the replacement
functions and classes.

Modules:
  config               ``"method": "eagle2"`` in ``--speculative-config``:
                       validation, head-format detection, translation into a
                       SpeculativeConfig vLLM accepts, tree settings carried to
                       workers in ``VllmConfig.additional_config``, and the
                       single gate that refuses to start until the tree
                       runner exists.
  cpu_tree_attention   prototype of the CPU tree-verify attention and KV
                       compaction over vLLM's CPU_ATTN cache layout (not wired
                       into generation yet).

Importing this package does not import vLLM.
"""
