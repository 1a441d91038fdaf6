"""vllm-eagle-tree: EAGLE-2 dynamic draft trees for vLLM speculative decoding.

Layout:
  core/      the algorithm (tree, expander, verification) in plain PyTorch,
             no vLLM imports
  plugin.py  vLLM's plugin entry point and every monkeypatch
"""
__version__ = "0.1.0"
