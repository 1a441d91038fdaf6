"""eagle2 inside vLLM (in-process engines on CPU): greedy output identical to
vLLM without speculation in every batch shape and scheduler situation the
issue names, stops inside accepted paths, per-request fallbacks.

Engines are module-scoped and compared with a vanilla engine built with the
same settings (dtype float32, enforce_eager), so any difference is the tree
path's. Every test also checks that speculation really happened.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from vllm_eagle_tree import assets
from vllm_helpers import (attention_dispatch_log, check_attention_dispatch,
                          check_kv_only_first_pass, free_llm, make_llm,
                          record_attention_dispatch)

PROMPTS = assets.heldout_prompts(200)
MAX_TOKENS = 24
TREE = {"num_nodes": 20, "max_depth": 5, "top_k": 5}


def eagle2(head: str = "eagle", **tree) -> dict:
    return {"method": "eagle2", "model": str(assets.HEADS[head]), **(tree or TREE)}


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]


def in_batches(llm, prompts, params, batch):
    out = []
    for i in range(0, len(prompts), batch):
        out += run(llm, prompts[i:i + batch], params)
    return out


def assert_same(got, want, what=""):
    assert len(got) == len(want)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if bad:
        i = bad[0]
        raise AssertionError(f"{what}: {len(bad)} of {len(want)} outputs differ, first #{i}:\n"
                             f"eagle2:  {got[i]}\nvanilla: {want[i]}")


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _stop_params(long_):
    """Per prompt: max_tokens, a stop token id, a stop string (all taken from
    inside the vanilla continuation, so they fall inside accepted paths), or
    EOS honoured."""
    params = []
    for i, (ids, text, _) in enumerate(long_):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=5 + i % 11, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                         stop_token_ids=[ids[3 + i % 9]], ignore_eos=True))
        elif kind == 2:
            stop = text[len(text) // 3: len(text) // 3 + 3]
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                         stop=[stop] if stop.strip() else None, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=64))  # EOS honoured
    return params


FALLBACK_KINDS = [
    dict(),
    dict(repetition_penalty=1.3),
    dict(logprobs=2),
    dict(presence_penalty=0.5, frequency_penalty=0.5),
    dict(min_tokens=10),
    dict(bad_words=["def"]),
    dict(prompt_logprobs=1),  # not a fallback: computed at prefill, tree requests keep it
    dict(structured_outputs=StructuredOutputsParams(choice=["True", "False", "None"])),
]
FALLBACK_PROMPTS = PROMPTS[60:84]
FALLBACK_PARAMS = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  **FALLBACK_KINDS[i % len(FALLBACK_KINDS)])
                   for i in range(len(FALLBACK_PROMPTS))]
PREFIX_PROMPTS = ["".join(PROMPTS[100:112]) + p[:40] for p in PROMPTS[2:18]]  # ~700 tokens
STOP_PROMPTS = PROMPTS[20:52]
ABORT_PROMPTS = PROMPTS[90:106]


@pytest.fixture(scope="module")
def vanilla():
    """Everything this module compares against, from vLLM without speculation.

    vLLM 0.32 in-process engines share process-global state (distributed
    groups, Prometheus collectors), so two live engines in one process
    interfere: all vanilla results are computed up front in one engine that
    is freed before the tree engine is built."""
    llm = make_llm(max_num_seqs=32)
    r = {}
    r["greedy"] = run(llm, PROMPTS, GREEDY)
    r["prefix"] = run(llm, PREFIX_PROMPTS, GREEDY)
    r["prefix_cont"] = run(llm, [p + o[1] for p, o in zip(PREFIX_PROMPTS, r["prefix"])], GREEDY)
    r["stop_params"] = _stop_params(run(llm, STOP_PROMPTS, GREEDY))
    r["stops"] = run(llm, STOP_PROMPTS, r["stop_params"])
    r["fallback"] = llm.generate(FALLBACK_PROMPTS, FALLBACK_PARAMS, use_tqdm=False)
    r["abort"] = run(llm, ABORT_PROMPTS, GREEDY)
    free_llm(llm)
    return r.__getitem__


@pytest.fixture(scope="module")
def vanilla_greedy_200(vanilla):
    return vanilla("greedy")


@pytest.fixture(scope="module")
def tree_llm(vanilla):
    llm = make_llm(speculative_config=eagle2(), max_num_seqs=32)
    yield llm
    free_llm(llm)


def tree_stats(llm) -> dict:
    """The tree runner's own counters (per engine; vLLM's Prometheus metrics are
    process-global and belong to the engine built last)."""
    return llm.collective_rpc("eagle2_stats")[0]


def spec_counters(llm):
    s = tree_stats(llm)
    return (s["tree_requests"], s["nodes"], sum(s["accepted_per_depth"]))


def _speculated(llm, before):
    after = spec_counters(llm)
    d = SimpleNamespace(drafts=after[0] - before[0], draft_tokens=after[1] - before[1],
                        accepted_tokens=after[2] - before[2])
    assert d.drafts > 0 and d.accepted_tokens > 0, f"no speculation happened: {d}"
    return d


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_greedy_identical_prefix_caching_on(tree_llm, vanilla_greedy_200, batch):
    before = spec_counters(tree_llm)
    got = in_batches(tree_llm, PROMPTS, GREEDY, batch)
    assert_same(got, vanilla_greedy_200, f"batch {batch}, prefix caching on")
    d = _speculated(tree_llm, before)
    # A tree verifies more than one node per step and accepts more than a
    # one-token chain could (tau > 1 + acceptance of a single draft).
    assert d.draft_tokens > d.drafts


def test_prefix_cache_hits_stay_lossless(tree_llm, vanilla):
    """Prompts sharing a ~700-token prefix, run twice: the second time most of
    each prompt comes from cached blocks written while trees were verified
    (slots of rejected nodes must never have become cached content); then
    continuations of the generated text, whose cached blocks hold KV written
    by tree verification and compaction."""
    before = spec_counters(tree_llm)
    first = run(tree_llm, PREFIX_PROMPTS, GREEDY)
    outs = tree_llm.generate(PREFIX_PROMPTS, GREEDY, use_tqdm=False)
    assert min(o.num_cached_tokens for o in outs) >= 256, "no prefix cache hits"
    second = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
              for o in outs]
    assert_same(first, vanilla("prefix"), "first pass")
    assert_same(second, vanilla("prefix"), "second pass (prefix cache hits)")
    cont = [p + o[1] for p, o in zip(PREFIX_PROMPTS, vanilla("prefix"))]
    assert_same(run(tree_llm, cont, GREEDY), vanilla("prefix_cont"), "continuations")
    _speculated(tree_llm, before)


# ---------------------------------------------------------------- stops
def test_stops_inside_accepted_paths(tree_llm, vanilla):
    """EOS, stop token ids, stop strings and max_tokens that fall inside an
    accepted path end the request exactly where vanilla vLLM ends it."""
    before = spec_counters(tree_llm)
    got = run(tree_llm, STOP_PROMPTS, vanilla("stop_params"))
    want = vanilla("stops")
    assert_same(got, want, "stops")
    reasons = {w[2] for w in want}
    assert "stop" in reasons and "length" in reasons
    _speculated(tree_llm, before)


# ------------------------------------------------------------ fallbacks
def test_unsupported_sampling_falls_back_per_request(tree_llm, vanilla):
    """Requests with penalties, logprobs, min_tokens, bad words or structured
    output run without drafts in the same batch as tree requests; prompt
    logprobs work on tree requests; everyone's output equals vanilla vLLM's
    (logprobs and prompt logprobs included)."""
    before = spec_counters(tree_llm)
    outs = tree_llm.generate(FALLBACK_PROMPTS, FALLBACK_PARAMS, use_tqdm=False)
    for i, (o, w) in enumerate(zip(outs, vanilla("fallback"))):
        kind = FALLBACK_KINDS[i % len(FALLBACK_KINDS)]
        assert list(o.outputs[0].token_ids) == list(w.outputs[0].token_ids), (i, kind)
        if FALLBACK_PARAMS[i].logprobs:
            for a, b in zip(o.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
        if FALLBACK_PARAMS[i].prompt_logprobs:
            assert len(o.prompt_logprobs) == len(w.prompt_logprobs) > 1
            for a, b in zip(o.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
        if FALLBACK_PARAMS[i].structured_outputs is not None:
            assert o.outputs[0].text.startswith(("True", "False", "None"))  # grammar applied
    _speculated(tree_llm, before)


@pytest.mark.parametrize("params", [dict(min_p=0.1), dict(logit_bias={5: 1.0})])
def test_params_vllm_refuses_with_speculation_are_refused(tree_llm, params):
    """min_p and logit_bias: vLLM refuses them with any speculative decoding
    (SamplingParams._validate_spec_decode); eagle2 keeps that clear error at
    submission rather than ignoring them."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        tree_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, **params), use_tqdm=False)


def test_aborted_requests_mid_batch(tree_llm, vanilla):
    """Requests aborted while others are mid-tree do not disturb the others."""
    engine = tree_llm.llm_engine
    prompts = ABORT_PROMPTS
    ids = [f"abort-test-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, GREEDY)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            engine.abort_request(ids[::3])
    kept = [i for i in range(len(ids)) if i % 3]
    want = vanilla("abort")
    assert [done[ids[i]] for i in kept] == [want[i][0] for i in kept]
    assert not any(ids[i] in done and len(done[ids[i]]) == MAX_TOKENS for i in range(0, 16, 3))


def _vllm_spec_metrics(llm):
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None}
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = list(m.values)
    return out


def test_vllm_spec_metrics_describe_the_trees(tree_llm):
    """vLLM's spec-decode counters stay meaningful with trees and equal the tree
    runner's own counts: drafts = request-steps verified with a tree, draft
    tokens = drafted nodes, accepted = accepted nodes, accepted_per_pos[d-1] =
    request-steps that accepted a node at depth d (nothing beyond max_depth).
    tree_llm is the engine built last in this module, so vLLM's process-global
    collectors are its own."""
    m0, s0 = _vllm_spec_metrics(tree_llm), tree_stats(tree_llm)
    run(tree_llm, PROMPTS[150:182], GREEDY)
    m1, s1 = _vllm_spec_metrics(tree_llm), tree_stats(tree_llm)
    assert m1["drafts"] - m0["drafts"] == s1["tree_requests"] - s0["tree_requests"] > 0
    assert m1["draft_tokens"] - m0["draft_tokens"] == s1["nodes"] - s0["nodes"]
    acc = [a - b for a, b in zip(s1["accepted_per_depth"], s0["accepted_per_depth"])]
    assert m1["accepted"] - m0["accepted"] == sum(acc) > 0
    per_pos = [a - b for a, b in zip(m1["per_pos"], m0["per_pos"])]
    depth = TREE["max_depth"]
    assert per_pos[:depth] == acc
    assert not any(per_pos[depth:])
    drafted = [a - b for a, b in zip(s1["drafted_per_depth"], s0["drafted_per_depth"])]
    assert sum(drafted) == s1["nodes"] - s0["nodes"]
    assert all(a <= d for a, d in zip(acc, drafted))


def test_kv_only_first_pass_rows_write_the_heads_kv(tree_llm):
    """EAGLE-1 head: a first pass's KV-only rows (``TreeDrafter._write_kv``)
    write exactly the draft KV of the head's forward, and a first pass split
    into KV-only rows plus last rows drafts what one forward drafts
    (vllm_helpers.check_kv_only_first_pass; the EAGLE-3 head is checked in
    test_eagle2_engine_variants)."""
    assert tree_llm.collective_rpc(check_kv_only_first_pass)[0] > 0


def test_target_attention_takes_the_tree_dispatch_only_with_tree_rows(tree_llm, vanilla):
    """Steps without tree rows (a request's first decode, no drafts yet) run
    vLLM's own attention forward in every target layer; steps with tree rows
    the tree dispatch, switched with the step's metadata; output identical."""
    (layers,) = tree_llm.collective_rpc(record_attention_dispatch)
    got = in_batches(tree_llm, PROMPTS[:16], GREEDY, 8)
    log = tree_llm.collective_rpc(attention_dispatch_log)[0]
    assert_same(got, vanilla("greedy")[:16], "dispatch switched per step")
    check_attention_dispatch(log, layers, need_tree_rows=True)
