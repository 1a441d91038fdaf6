"""Shared test set-up: one in-process vLLM engine at a time, small KV cache.

The environment is set before anything imports vLLM: the engine runs in the
test process (VLLM_ENABLE_V1_MULTIPROCESSING=0, init ~3 s instead of ~20 s),
which also makes plugin registration happen in this process.
"""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads TRITON_INTERPRET when it is first imported, process-wide: set it
# before anything imports triton so tests/kernels runs the kernels in the
# interpreter on CPU. vLLM's CPU build disables Triton either way.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vllm_helpers import free_llm, greedy_token_ids, make_llm  # noqa: E402


_VANILLA_CACHE: dict = {}


@pytest.fixture(scope="session")
def vanilla_greedy():
    """Greedy token ids of vLLM without speculation (same mode, enforce_eager),
    computed once per (prompts, max_tokens) and shared by every test."""

    def get(prompts, max_tokens):
        key = (tuple(prompts), max_tokens)
        if key not in _VANILLA_CACHE:
            llm = make_llm()
            _VANILLA_CACHE[key] = greedy_token_ids(llm, prompts, max_tokens)
            free_llm(llm)
        return _VANILLA_CACHE[key]

    return get
