"""vllm-eagle-tree: EAGLE-2 dynamic draft trees for vLLM speculative decoding.

Layout:
  core/      the algorithm (tree, expander, verification) in plain PyTorch,
             no vLLM imports
  plugin.py  vLLM's plugin entry point and every monkeypatch
"""
__version__ = "0.1.0"

LOGGER_NAME = "vllm.eagle_tree"
"""Every module's logger: a child of vLLM's ``vllm`` logger, so that the
plugin's lines come out in vLLM's format and stream and follow its settings
(``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``, a logging config file).
A logger outside ``vllm`` has no handler: its INFO lines (the goodput probe's
result) were never shown, and its warnings came out unformatted."""
