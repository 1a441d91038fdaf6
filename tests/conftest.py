"""Shared test set-up: one in-process vLLM engine at a time, small KV cache.

The environment is set before anything imports vLLM: the engine runs in the
test process (VLLM_ENABLE_V1_MULTIPROCESSING=0, init ~3 s instead of ~20 s),
which also makes plugin registration happen in this process.
"""
import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads TRITON_INTERPRET when it is first imported, process-wide: set it
# before anything imports triton so tests/kernels runs the kernels in the
# interpreter on CPU. vLLM's CPU build disables Triton either way.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def make_llm(**kwargs):
    """An in-process LLM on the bundled target, greedy-reproducible settings."""
    from vllm import LLM

    from vllm_eagle_tree import assets

    opts = dict(model=str(assets.TARGET), dtype="float32", enforce_eager=True,
                max_model_len=1024, disable_log_stats=False, seed=0)
    opts.update(kwargs)
    return LLM(**opts)


def free_llm(llm):
    del llm
    gc.collect()


def greedy_token_ids(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


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
