"""Engine-free reference: EAGLE-2 tree speculative decoding on plain PyTorch.

No vLLM import. See :mod:`vllm_eagle_tree.reference.generator`.
"""
from .generator import (DecodeState, DraftModel, GenerationStats, KVCache, ReferenceGenerator,
                        RequestOutput, SamplingParams, TargetModel, chain_config,
                        load_pair)

__all__ = ["DecodeState", "DraftModel", "GenerationStats", "KVCache", "ReferenceGenerator",
           "RequestOutput", "SamplingParams", "TargetModel", "chain_config", "load_pair"]
