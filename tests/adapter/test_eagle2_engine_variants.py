"""eagle2 engines in other configurations, each built after the vanilla
reference and freed before the next (vLLM 0.32 in-process engines must not
overlap): prefix caching off with chunked prefill, a KV cache small enough to
force preemption, the EAGLE-3 head."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
from vllm import SamplingParams

from vllm_eagle_tree import assets
from vllm_helpers import (attention_dispatch_log, check_attention_dispatch,
                          check_kv_only_first_pass, free_llm, make_llm,
                          record_attention_dispatch)

from test_eagle2_engine import (GREEDY, MAX_TOKENS, PROMPTS, _speculated, assert_same, eagle2,
                                in_batches, run, spec_counters)


@pytest.fixture(scope="module")
def vanilla_greedy_200():
    llm = make_llm(max_num_seqs=32)
    out = run(llm, PROMPTS, GREEDY)
    free_llm(llm)
    return out


@pytest.mark.slow
def test_greedy_identical_prefix_caching_off_chunked(vanilla_greedy_200):
    """Prefix caching off; a 256-token budget splits prompts across steps
    (chunked prefill) and mixes prefill chunks with tree decodes. 200 prompts
    at batch sizes 1, 8 and 32."""
    llm = make_llm(speculative_config=eagle2(), max_num_seqs=32,
                   enable_prefix_caching=False, max_num_batched_tokens=256)
    try:
        for batch in (1, 8, 32):
            before = spec_counters(llm)
            got = in_batches(llm, PROMPTS, GREEDY, batch)
            assert_same(got, vanilla_greedy_200, f"batch {batch}, prefix caching off, chunked")
            _speculated(llm, before)
    finally:
        free_llm(llm)


def _metric(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def test_preemption_and_recompute(vanilla_greedy_200):
    """A KV cache far too small for the batch (12 blocks of 128 tokens for 48
    requests): requests are preempted, recomputed and resumed; output unchanged."""
    llm = make_llm(speculative_config=eagle2(), max_num_seqs=32, num_gpu_blocks_override=12,
                   enable_prefix_caching=False)
    try:
        before = spec_counters(llm)
        got = run(llm, PROMPTS[:48], GREEDY)
        preempted = _metric(llm, "vllm:num_preemptions")
        d = _speculated(llm, before)
    finally:
        free_llm(llm)
    assert preempted > 0, "the test did not cause preemption"
    assert_same(got, vanilla_greedy_200[:48], f"preemption ({preempted} preemptions, {d})")


def test_eagle3_head_greedy_identical(vanilla_greedy_200):
    """Greedy identity with the EAGLE-3 head; and its KV-only first-pass
    rows write exactly the KV its forward writes (vllm_helpers)."""
    llm = make_llm(speculative_config=eagle2("eagle3"), max_num_seqs=32)
    try:
        before = spec_counters(llm)
        got = run(llm, PROMPTS[:64], GREEDY)
        _speculated(llm, before)
        checked = llm.collective_rpc(check_kv_only_first_pass)[0]
    finally:
        free_llm(llm)
    assert_same(got, vanilla_greedy_200[:64], "EAGLE-3 head")
    assert checked > 0


def test_adaptive_trees_greedy_identical(vanilla_greedy_200):
    """"adaptive": true (depth threshold, width mass, min path probability and a
    batch-wide node budget): trees of varying size per request, same output."""
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 20,
            "max_depth": 5, "top_k": 5, "adaptive": True, "batch_num_nodes": 96}
    llm = make_llm(speculative_config=spec, max_num_seqs=32)
    try:
        before = spec_counters(llm)
        got = run(llm, PROMPTS[:64], GREEDY)
        d = _speculated(llm, before)
    finally:
        free_llm(llm)
    assert_same(got, vanilla_greedy_200[:64], "adaptive")
    # adaptation must actually shrink trees below the fixed budget
    assert d.draft_tokens < 20 * d.drafts, d


def _record_bandit_steps(worker):
    """Test hook: keep the seconds of every engine step the shape bandit is given."""
    bandit = worker.model_runner.tree_bandit
    worker.bandit_seconds = seen = []
    observe = bandit.observe

    def recorded(tokens, seconds, *args, **kwargs):
        seen.append(seconds)
        return observe(tokens, seconds, *args, **kwargs)
    bandit.observe = recorded
    return True


def _bandit_seconds(worker):
    return list(worker.bandit_seconds)


def test_goodput_budget_greedy_identical(vanilla_greedy_200, tmp_path, monkeypatch):
    """"goodput": true: each step's node budget comes from live step timings and
    calibrated path values (core/budget.py); output unchanged, the planner has
    timed steps and planned budgets. The engine's wait for the next batch
    (3 s here; a lull in a served load) is not counted in the step before it.
    VLLM_EAGLE2_TRACE gets a JSON line per shape pick."""
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 20,
            "max_depth": 5, "top_k": 5, "adaptive": True, "goodput": True}
    monkeypatch.setenv("VLLM_EAGLE2_TRACE", str(tmp_path / "trace"))
    llm = make_llm(speculative_config=spec, max_num_seqs=32)
    try:
        assert llm.collective_rpc(_record_bandit_steps) == [True]
        before = spec_counters(llm)
        got = run(llm, PROMPTS[:64], GREEDY)
        _speculated(llm, before)
        g = llm.collective_rpc("eagle2_stats")[0]["goodput"]
        picks = [json.loads(line) for line in
                 (tmp_path / f"trace.{os.getpid()}").read_text().splitlines()]
        time.sleep(3.0)
        run(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))
        seconds = llm.collective_rpc(_bandit_seconds)[0]
    finally:
        free_llm(llm)
    assert_same(got, vanilla_greedy_200[:64], "goodput")
    # the trace: a record per pick, the last one the shape in use
    assert len(picks) >= sum(sum(a.values()) for a in g["arm_windows"].values())
    arms = ["plain"] + [f"chain-{k}" for k in range(1, 6)] + ["tree"]
    assert picks[-1]["picked"] == g["arm"] and all(list(p["rates"]) == arms for p in picks)
    # the last step of the 64 prompts was given to the bandit after the wait
    assert len(seconds) > 8 and max(seconds) < 1.5, max(seconds)
    assert g["steps_timed"] > 8
    # the shape bandit measured its seed shape and at least one neighbour,
    # in tokens per second
    arms = g["arm_tokens_per_second"]
    assert max(len(a) for a in arms.values()) >= 2, arms
    assert all(r > 0 for a in arms.values() for r in a.values()) and g["arm"] in \
        ["plain", "chain-1", "chain-2", "chain-3", "chain-4", "chain-5", "tree"]
    assert g["verify_seconds_a"] >= 0 and g["verify_seconds_per_row"] >= 0
    seen = [r for row in g["acceptance_by_depth_and_value"] for r in row if r is not None]
    assert seen and all(0.0 <= r <= 1.0 for r in seen)


def test_goodput_probes_verify_cost_at_start_up(monkeypatch):
    from vllm_eagle_tree.adapter import runner as runner_module

    loads = []
    real_load = runner_module.load_cpu_tree_op

    def load():  # the fused tree attention op: built or loaded at start-up, not mid-request
        loads.append(1)
        return real_load()

    monkeypatch.setattr(runner_module, "load_cpu_tree_op", load)
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 20,
            "max_depth": 5, "top_k": 5, "adaptive": True, "goodput": True}
    llm = make_llm(speculative_config=spec, max_num_seqs=8)
    assert loads == [1]  # in-process engine: the worker's runner called it, before any request
    try:
        g = llm.collective_rpc("eagle2_stats")[0]["goodput"]
    finally:
        free_llm(llm)
    # powers of two up to max_num_seqs x (1 + max_depth) = 48, and 48; 2
    # timed runs each before any request; a forward pass costs time
    sizes = [1, 2, 4, 8, 16, 32, 48]
    assert g["steps_timed"] == 2 * len(sizes)
    assert g["forward_seconds_a"] + 48 * g["forward_seconds_per_row"] > 0
    assert g["verify_seconds_a"] + 64 * g["verify_seconds_per_row"] > 0
    # the forward model's shape at each of 1..16 rows, every chain step's
    # rows at batch 1, 2, 4, 8 (N x (1 + k), k <= 5) and the probe's sizes
    shape = g["forward_shape"]
    chains = {n * (1 + k) for n in (1, 2, 4, 8) for k in range(6)}
    assert sorted(shape) == sorted(set(range(1, 17)) | chains | set(sizes))
    assert sorted(shape)[16:] == [20, 24, 32, 40, 48]
    assert shape[48] == pytest.approx(1.0)  # relative to the largest
    assert all(0.0 < f < float("inf") for f in shape.values()), shape


def test_goodput_probe_stays_within_max_model_len():
    """max_num_seqs x (1 + max_depth) = 384 rows, over max_model_len: vLLM's
    dummy run gives each of its requests a sequence as long as all its rows,
    and its CPU attention read past the block table (a segfault at start-up,
    with vLLM's default max_num_seqs and a short max_model_len). The probe
    now stops at max_model_len."""
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 20,
            "max_depth": 5, "top_k": 5, "adaptive": True, "goodput": True}
    llm = make_llm(speculative_config=spec, max_num_seqs=64, max_model_len=128)
    try:
        g = llm.collective_rpc("eagle2_stats")[0]["goodput"]
    finally:
        free_llm(llm)
    assert max(g["forward_shape"]) == 128
    assert g["steps_timed"] == 2 * len([1, 2, 4, 8, 16, 32, 64, 128])



def _set_skip_pattern(worker, period, hold):
    """Test hook: the shape bandit picks "plain" (no drafts) on all but every
    ``period``-th step and the planner never prunes; plain steps hold their
    first-pass rows back per request (``hold``: PendingRows, as for heads
    without the KV-only path) or as whole steps (the KV-only path); every
    first-pass row the head runs is recorded as (request id, draft
    position, token), every row of a held whole step as (request id, draft
    position, token, slot, the request's slot there), and the rows
    ``TreeDrafter.write_rows`` writes are counted."""
    runner = worker.model_runner
    runner.tree_planner.warmup = 10 ** 9
    runner.hold_plain_rows = hold
    count = [0]

    def choose(batch_size, lockstep=False, horizon=1.0, **_):
        count[0] += 1
        return "tree" if count[0] % period == 0 else "plain"

    runner.tree_bandit.choose = choose
    drafter = runner.tree_drafter
    log = runner._test_first_pass_log = []
    if not hasattr(drafter, "_test_draft"):
        drafter._test_draft = drafter.draft

    flushed = runner._test_flushed = []

    def draft(reqs, *args, req_ids=None, **kwargs):
        for q, rid in zip(reqs, req_ids):
            toks = (q.pending.next_tokens if q.pending else []) + q.next_tokens
            log.extend((rid, q.context_len + j, t) for j, t in enumerate(toks))
            if q.pending is not None and not q.grow_tree:
                flushed.append(len(q.pending))
        return drafter._test_draft(reqs, *args, req_ids=req_ids, **kwargs)

    drafter.draft = draft
    written = runner._test_written = []
    write_held = drafter.write_held

    def write_held_logged(held_by_request):
        for rid, p in held_by_request.items():
            written.extend((rid, p.start + j, t) for j, t in enumerate(p.next_tokens))
        return write_held(held_by_request)

    drafter.write_held = write_held_logged
    at_once = runner._test_at_once = []

    class LoggedSteps(list):  # runner._held_steps, logging each held plain step
        def append(self, held):
            _, tokens, positions, slots = held
            bt = runner.input_batch.block_table[0].get_cpu_tensor()
            bs = runner._tree_block_size
            for i, (t, p, s) in enumerate(zip(tokens.tolist(), positions.tolist(),
                                              slots.tolist())):
                at_once.append((runner.input_batch.req_ids[i], p, t, s,
                                int(bt[i, p // bs]) * bs + p % bs))
            super().append(held)

    runner._held_steps = LoggedSteps(runner._held_steps)
    rows_written = runner._test_rows_written = [0]
    if not hasattr(drafter, "_test_write_rows"):
        drafter._test_write_rows = drafter.write_rows

    def write_rows(raw, tokens, positions, slots):
        rows_written[0] += len(tokens)
        return drafter._test_write_rows(raw, tokens, positions, slots)

    drafter.write_rows = write_rows
    # per step: [drafts scheduled?, calls of vLLM's _calc_spec_decode_metadata]
    spec_steps = runner._test_spec_steps = []
    calc, prepare = runner._calc_spec_decode_metadata, runner._prepare_inputs

    def calc_logged(*args, **kwargs):
        spec_steps[-1][1] += 1
        return calc(*args, **kwargs)

    def prepare_logged(scheduler_output, *args, **kwargs):
        spec_steps.append([bool(scheduler_output.scheduled_spec_decode_tokens), 0])
        return prepare(scheduler_output, *args, **kwargs)

    runner._calc_spec_decode_metadata = calc_logged
    runner._prepare_inputs = prepare_logged
    return True


def _first_pass_log(worker):
    r = worker.model_runner
    return (list(r._test_first_pass_log), list(r._test_flushed), list(r._test_written),
            list(r._test_at_once), len(r._pending), r._test_rows_written[0],
            len(r._held_steps), [tuple(x) for x in r._test_spec_steps])


def _run_skip_pattern(head, hold, vanilla, what):
    """16 prompts under ``_set_skip_pattern`` (a tree every 20th step, so
    held runs of 19 steps hit the cap) with ``head``, then one 1-token
    request (whatever the last step held is written on the next step,
    before its forward can reuse the blocks). Asserts the output equals
    ``vanilla`` and that something was speculated; returns the sequences
    (request id -> prompt + output tokens), a filter for this run's
    request ids (the engine suffixes them), and ``_first_pass_log``."""
    spec = {"method": "eagle2", "model": str(head), "num_nodes": 20,
            "max_depth": 5, "top_k": 5, "adaptive": True, "goodput": True}
    llm = make_llm(speculative_config=spec, max_num_seqs=8)
    try:
        assert llm.collective_rpc(_set_skip_pattern, args=(20, hold)) == [True]
        before = spec_counters(llm)
        outs = llm.generate(PROMPTS[:16], GREEDY, use_tqdm=False)
        d = _speculated(llm, before)
        llm.generate(PROMPTS[16:17], SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        logs = llm.collective_rpc(_first_pass_log)[0]
    finally:
        free_llm(llm)
    got = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
           for o in outs]
    assert_same(got, vanilla[:16], what)
    assert d.drafts < d.draft_tokens
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    ours = lambda rid: any(rid == k or rid.startswith(k + "-") for k in seqs)  # noqa: E731
    return seqs, ours, logs


def test_goodput_skipped_first_passes_are_caught_up(vanilla_greedy_200):
    """While the planner chooses no speculation, plain decodes hold back the
    head's first pass (runner ``PendingRows``) and run it, caught up, on the
    next drafting step, or without a tree once MAX_PENDING_ROWS are held;
    rows still held when a request finishes are written then
    (``TreeDrafter.write_held``, KV only). Checked exactly: the head's input
    at draft position p is the sequence's token p+1, for every position up
    to the last one it ran (no hole left by a skipped step), the rows
    written at the end cover every position after that up to the last
    token, and the output is unchanged."""
    from vllm_eagle_tree.adapter.runner import MAX_PENDING_ROWS

    seqs, ours, (log, flushed, written, at_once, *_) = _run_skip_pattern(
        assets.EAGLE1_HEAD, True, vanilla_greedy_200, "skipped first passes")
    log = [x for x in log if ours(x[0])]
    written = [x for x in written if ours(x[0])]
    by_req: dict[str, dict[int, int]] = {}
    for rid, pos, t in log:
        by_req.setdefault(rid, {})[pos] = t  # a later pass over a position wins
    assert len(by_req) == len(seqs)
    held_back = 0
    for rid, cover in by_req.items():
        (seq,) = [v for k, v in seqs.items() if rid == k or rid.startswith(k + "-")]
        # (a tree step's accepted path can run past max_tokens: ignore that tail)
        last = min(max(cover), len(seq) - 2)
        assert all(p in cover for p in range(last + 1)), f"{rid}: hole in the head's positions"
        bad = [p for p in range(last + 1) if cover[p] != seq[p + 1]]
        assert not bad, (rid, bad[:5])
        held_back += len(seq) - 2 - last
        # ... and what was still held back when it finished was written then
        tail = {pos: t for r, pos, t in written if r == rid}
        assert sorted(tail) == list(range(last + 1, len(seq) - 1)), (rid, sorted(tail), last)
        assert all(tail[p] == seq[p + 1] for p in tail), rid
    assert held_back > 0  # some requests ended with first passes still held back
    assert len(written) == held_back
    assert flushed and set(flushed) == {MAX_PENDING_ROWS}, flushed
    assert not at_once


def test_goodput_plain_steps_held_whole_and_written(vanilla_greedy_200):
    """With the KV-only path (the bundled heads), plain steps in which every
    request decodes one token are held as whole-batch tensors (runner
    ``_hold_plain_decodes``) and written in one KV-only call per up to
    MAX_PENDING_ROWS steps, before the next draft, or before the forward of
    a step whose batch changed; other plain steps go through ``draft``
    without a tree. Checked exactly: every draft position of every
    request, up to its last token, was covered (by one path or the other)
    with the sequence's next token, held rows carry the request's own slot
    for that position, every held row was written (one more step flushes
    the last ones), no PendingRows were used, and the output is unchanged."""
    seqs, ours, (log, flushed, written, at_once, pending, n_written, n_held, spec_steps) = \
        _run_skip_pattern(assets.EAGLE3_HEAD, False, vanilla_greedy_200,
                          "plain steps held whole")
    # steps without drafts take vLLM's branch for engines without
    # speculation (runner _prepare_inputs_without_drafts): no spec metadata
    assert {drafts for drafts, _ in spec_steps} == {True, False}
    assert all(calls == int(drafts) for drafts, calls in spec_steps), spec_steps[:20]
    assert pending == 0 and not flushed and not written
    bad_slots = [x for x in at_once if x[3] != x[4]]
    assert at_once and not bad_slots, bad_slots[:5]
    assert n_held == 0 and n_written == len(at_once)
    by_req: dict[str, dict[int, int]] = {}
    for rid, pos, t in log + [x[:3] for x in at_once]:
        if ours(rid):
            by_req.setdefault(rid, {})[pos] = t  # (a later pass over a position wins)
    assert len(by_req) == len(seqs)
    for rid, cover in by_req.items():
        (seq,) = [v for k, v in seqs.items() if rid == k or rid.startswith(k + "-")]
        missing = [p for p in range(len(seq) - 1) if p not in cover]
        assert not missing, (rid, missing[:5])
        bad = [p for p in range(len(seq) - 1) if cover[p] != seq[p + 1]]
        assert not bad, (rid, bad[:5])


def _force_arms(worker, arms, fast):
    """Test hook: the shape bandit's arm cycles through ``arms`` step by
    step, chain arms are drafted with (``fast``) or without the chain fast
    path, and every drafted tree is recorded as (arm, parents, tokens, values)."""
    runner = worker.model_runner
    drafter = runner.tree_drafter
    count = [0]

    def choose(batch_size, lockstep=False, horizon=1.0, **_):
        count[0] += 1
        return arms[count[0] % len(arms)]

    runner.tree_bandit.choose = choose
    drafter.chain_fast_path = fast
    if not hasattr(drafter, "_test_draft"):
        drafter._test_draft = drafter.draft
    log = runner._test_drafts = []

    def draft(reqs, *args, arm=None, **kwargs):
        out = drafter._test_draft(reqs, *args, arm=arm, **kwargs)
        log.extend((arm, *t) for t in out if t is not None)
        return out

    drafter.draft = draft
    # every ready-made set of fused-op arguments (the chain fast path's) must
    # be what TreeAttention derives from its own fields
    from vllm_eagle_tree.adapter.attention import TreeAttention
    if not hasattr(TreeAttention, "_test_with_op_args"):
        TreeAttention._test_with_op_args = TreeAttention.with_op_args
    checked = runner._test_op_args = []

    def with_op_args(*args, **kwargs):
        attn = TreeAttention._test_with_op_args(*args, **kwargs)
        derived = attn._fused_args()
        checked.append(all(a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)
                           for a, b in zip(attn._op_args, derived, strict=True)))
        return attn

    TreeAttention.with_op_args = with_op_args
    return True


def _op_args_log(worker):
    """Whether each chain-step attention's ready-made arguments equalled _fused_args's."""
    return list(worker.model_runner._test_op_args)


def _drafts_log(worker):
    return list(worker.model_runner._test_drafts)


def _record_lockstep(worker):
    """Test hook: the shape bandit always picks "plain" (which keeps a
    lockstep) and records the ``lockstep``, ``horizon``, ``waiting`` and
    ``lifetime`` the runner gives it each step."""
    runner = worker.model_runner
    log = runner._test_lockstep = []

    def choose(batch_size, lockstep=False, horizon=1.0, waiting=0, lifetime=None):
        log.append((batch_size, lockstep, horizon, waiting, lifetime))
        return "plain"

    runner.tree_bandit.choose = choose
    return True


def _lockstep_log(worker):
    """The recorded (batch size, lockstep, horizon, waiting, lifetime) since the last call."""
    log = worker.model_runner._test_lockstep
    out = list(log)
    log.clear()
    return out


def _speeds(worker):
    return list(worker.model_runner.tree_bandit.speeds)


def test_goodput_chain_arms_and_every_arm_mix(vanilla_greedy_200):
    """The chain arms' fast path (``TreeDrafter._draft_chain``, no
    ``expand_tree``) drafts exactly the chains ``expand_tree`` grows with
    top_k=1 (same tokens, parents and path values, step by step), and a batch
    whose arm changes every step (plain, every chain length, tree) keeps
    greedy output identical. And the runner tells the bandit when the batch
    is in lockstep."""
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 20,
            "max_depth": 4, "top_k": 4, "adaptive": True, "goodput": True}
    llm = make_llm(speculative_config=spec, max_num_seqs=8, enable_prefix_caching=False)
    try:
        logs = []
        for fast in (True, False):
            assert llm.collective_rpc(_force_arms, args=(["chain-3"], fast)) == [True]
            got = run(llm, PROMPTS[:16], GREEDY)
            assert_same(got, vanilla_greedy_200[:16], f"chain-3, fast path {fast}")
            logs.append(llm.collective_rpc(_drafts_log)[0])
            op_args = llm.collective_rpc(_op_args_log)[0]
            # chain-3: two head forwards a step with ready-made op arguments,
            # in the fast path and in expand_tree's step_fn alike
            assert len(op_args) > 20 and all(op_args), (len(op_args), op_args.count(False))
        # requests leave the runner at the next step: a 2-token request (one
        # chain step, no speed of its own) takes the last ones out
        run(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        speeds = llm.collective_rpc(_speeds)[0]
        arms = ["plain", "chain-1", "chain-2", "plain", "chain-3", "chain-4", "tree", "tree"]
        assert llm.collective_rpc(_force_arms, args=(arms, True)) == [True]
        (layers,) = llm.collective_rpc(record_attention_dispatch)
        before = spec_counters(llm)
        got = run(llm, PROMPTS[:32], GREEDY)
        d = _speculated(llm, before)
        mixed = llm.collective_rpc(_drafts_log)[0]
        mixed_op_args = llm.collective_rpc(_op_args_log)[0]
        dispatch = llm.collective_rpc(attention_dispatch_log)[0]
        g = llm.collective_rpc("eagle2_stats")[0]["goodput"]
        assert llm.collective_rpc(_record_lockstep) == [True]
        lockstep = []
        for lengths in ([8] * 4, [8, 8, 12, 12], [8], [8] * 12):
            run(llm, PROMPTS[:len(lengths)], [SamplingParams(temperature=0.0, max_tokens=n,
                                                             ignore_eos=True) for n in lengths])
            lockstep.append(llm.collective_rpc(_lockstep_log)[0])
    finally:
        free_llm(llm)
    fast, slow = logs
    assert len(fast) == len(slow) > 50
    for (arm, p, t, v), (arm2, p2, t2, v2) in zip(fast, slow):
        assert arm == arm2 == "chain-3" and p == p2 == [-1, 0, 1, 2] and t == t2
        assert v == pytest.approx(v2, abs=1e-5) and v[0] == 0.0
    assert_same(got, vanilla_greedy_200[:32], "arm changing every step")
    # the chain and tree arms' head forwards take ready-made op arguments
    assert len(mixed_op_args) > 50 and all(mixed_op_args), \
        (len(mixed_op_args), mixed_op_args.count(False))
    # the runner's lockstep: requests with the same number of tokens left
    # (equal max_tokens, started together) until they finish together; with
    # 8 and 12 tokens, only once the 8-token ones have finished; never alone
    same, mixed_lengths, alone, queued = lockstep
    # in lockstep the bandit gets the requests' max_tokens (the lockstep
    # work it simulates), and always the scheduler's waiting count
    assert all(x[3:] == (0, 8) for x in same), same
    assert [x[4] for x in mixed_lengths] == [None] * 8 + [12] * 4, mixed_lengths
    assert all(x[3:] == (0, None) for x in alone), alone
    assert all(x[3:] == (4, 8) for x in queued if x[0] == 8), queued
    assert all(x[3] == 0 for x in queued if x[0] == 4), queued
    # every request of the chain-3 runs (24 tokens: 6 or more chain steps)
    # left a speed: tokens emitted over the pooled estimate
    assert len(speeds) == 32 and all(0.2 < x < 4.0 for x in speeds), speeds
    assert len(same) >= 8 and all(x[:2] == (4, True) for x in same), same
    assert [x[:2] for x in mixed_lengths] == [(4, False)] * 8 + [(2, True)] * 4, mixed_lengths
    assert alone and all(x[:2] == (1, False) for x in alone), alone
    # the horizon, the work left in rounds of the batch: tokens left over
    # max_tokens, one round's worth falling a step at a time, plus (the
    # scheduler's waiting count, registration's patch) 4 requests queued
    # behind 8 running: half a round more, step for step
    rounds = [h for _, _, h, *_ in same]
    assert rounds == sorted(rounds, reverse=True) and 0 < rounds[-1] and rounds[0] <= 1
    assert len(set(round(8 * h, 6) for h in rounds)) == len(rounds)  # 1/8 a step
    assert all(round(8 * h, 6) == int(round(8 * h)) for h in rounds), rounds
    first = [x for x in queued if x[0] == 8]
    assert [x[1] for x in first] == [True] * len(first) and len(first) >= len(same)
    assert [h - 0.5 for _, _, h, *_ in first[:len(rounds)]] == pytest.approx(rounds), first
    assert {a for a, *_ in mixed} == set(arms) - {"plain"}
    assert d.drafts > 0
    # every target layer's attention takes the tree dispatch exactly in the
    # forwards with tree rows (vLLM's own forward in the others: plain, chains)
    check_attention_dispatch(dispatch, layers)
    assert g["last_plan"] is not None  # the tree arm's trees were sized by the planner
