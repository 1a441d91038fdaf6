"""The engine-free core: draft trees, the EAGLE-2 expander, lossless verification.

Plain PyTorch, no vLLM imports; conventions in CONVENTIONS.md.
"""
from .expander import (Expansion, Frontier, StepFn, TreeConfig, expand_tree,
                       expand_tree_detailed)
from .tree import TreeBatch, pack_bits
from .verification import (SAMPLING_EPS, VerifyResult, apply_sampling_params,
                           draw_tokens, expand_to_nodes, exponential_noise, verify,
                           walk_chains, walk_trees)

__all__ = [
    "TreeBatch", "pack_bits",
    "TreeConfig", "Frontier", "Expansion", "StepFn", "expand_tree", "expand_tree_detailed",
    "SAMPLING_EPS", "VerifyResult", "apply_sampling_params", "exponential_noise",
    "draw_tokens", "walk_trees", "walk_chains", "verify", "expand_to_nodes",
]
