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
                       single gate that installs the tree worker (or refuses
                       to start on a platform without one).
  worker, runner       the CPU worker and V1 model runner that run trees.
  proposer             the tree drafter driving vLLM's EAGLE head.
  attention            the CPU_ATTN backend subclass that serves tree rows.
  cpu_tree_attention   tree attention (fused C++ op in cpu_tree_attention.cpp,
                       PyTorch plan) and KV compaction over vLLM's CPU_ATTN
                       cache layout.

Importing this package does not import vLLM.
"""
