"""Helpers for tests that run vLLM engines (imported as a plain module:
pytest puts tests/ on sys.path; the repository root must NOT be on it,
or `triton_kernels/` would shadow the top-level name vLLM probes)."""
import gc


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
