#!/usr/bin/env python
"""Where an engine step's time goes: vanilla, vLLM's chain, or one eagle2 shape.

For each SHAPE (run one after another in this process, a fresh in-process
engine each), wraps the model runner's step methods (and, for eagle2, the
drafter's, planner's and bandit's) with wall-clock timers, generates
REQUESTS greedy completions of 64 tokens at concurrency BATCH on the deep
target with the EAGLE-3 head, and prints per method: total seconds, calls
and milliseconds per call. Nested methods are included in their callers
(``execute_model`` contains ``_model_forward``; ``sample_tokens`` contains
``_sample`` and ``propose_draft_token_ids``).

    .venv/bin/python scripts/profile_steps.py --batch 4 --requests 24 vllm-chain-2 chain-2
    .venv/bin/python scripts/profile_steps.py --batch 16 --requests 48 vanilla plain vanilla plain

Shapes: vanilla, vllm-chain-K, an eagle2 8x4x2 adaptive engine with the
shape bandit forced to plain, chain-K or tree (``free`` leaves it alone),
or a fixed eagle2 tree ``fixed-NxDxK`` (e.g. fixed-16x4x4: N nodes, depth
D, top-k K, no planner).
Alternate shapes (A B A B) to see the machine's drift. ``--keep-alive``:
one engine per distinct shape, all started (and warmed) before the first
run and kept alive, as ``bench_paired.py --interleave`` has them:

    .venv/bin/python scripts/profile_steps.py --keep-alive --batch 64 --requests 128 vanilla plain vanilla plain

Timers cost a few microseconds per call; each also counts the minor page faults
inside its method (faults/call: glibc handing freed memory back and faulting
it in again). Python's garbage collections are listed too
("gc collections, gen N": they run inside whatever method allocates).

``--cprofile N``: also run cProfile inside the runner's step methods outside
the target forward (``_prepare_inputs``, ``_build_attention_metadata``,
``_sample``, ``propose_draft_token_ids``) and print each run's N functions
of most cumulative time there (the forward itself is not profiled; the
methods' timings then include the profiler's overhead):

    .venv/bin/python scripts/profile_steps.py --batch 1 --requests 8 --cprofile 40 chain-2
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import re
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_runtime  # noqa: E402  (scripts/cpu_runtime.py)

RUNNER = ("execute_model", "_prepare_inputs", "_build_attention_metadata", "_model_forward",
          "sample_tokens", "_sample", "propose_draft_token_ids", "_bookkeeping_sync",
          "_calc_spec_decode_metadata", "_learn_last_step", "_lockstep_horizon",
          "_hold_plain_decodes", "_flush_held_steps")
TREE_DRAFTER = ("draft", "_run", "_write_kv", "_draft_chain", "_logprobs")
PLANNER = ("observe_acceptance", "observe_verify", "prune")
BANDIT = ("choose", "observe", "observe_chain", "_pick", "_lockstep_run", "trace_record")
VLLM_DRAFTER = ("propose",)
PROFILED = ("_prepare_inputs", "_build_attention_metadata", "_sample", "propose_draft_token_ids")
SCHEDULER = ("schedule", "update_from_output")


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.faults: dict[str, int] = {}  # minor page faults inside each method

    def wrap(self, obj, names, prefix=""):
        """Time ``obj.<name>`` for each name it has (an instance attribute
        shadowing the method: this engine only)."""
        for name in names:
            f = getattr(obj, name, None)
            if f is None or not callable(f):
                continue
            key = prefix + name

            def timed(*a, _f=f, _k=key, **k):
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.seconds[_k] = self.seconds.get(_k, 0.0) + time.perf_counter() - t
                    self.calls[_k] = self.calls.get(_k, 0) + 1
                    self.faults[_k] = (self.faults.get(_k, 0)
                                       + resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            setattr(obj, name, timed)

    def clear(self):
        self.seconds.clear()
        self.calls.clear()
        self.faults.clear()

    def gc_callback(self, phase, info):
        """``gc.callbacks`` hook: Python's cyclic collections, by generation
        (they run wherever an allocation crosses a threshold, e.g. inside
        the model forward, so they hide in whichever method was running)."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif getattr(self, "_gc_start", None) is not None:
            key = f"gc collections, gen {info['generation']}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - self._gc_start
            self.calls[key] = self.calls.get(key, 0) + 1
            self._gc_start = None


def main():
    cpu_runtime.preload()  # vLLM's CPU guide: TCMalloc and Intel OpenMP (cpu_runtime.py)
    from vllm import LLM, SamplingParams

    from bench_baseline import _runner, _scheduler, pin_shape, speculative_config
    from make_deep_target import build
    from vllm_eagle_tree import assets

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--keep-alive", action="store_true",
                    help="start one engine per distinct shape first and keep them all alive "
                         "(as bench_paired --interleave), then run the shapes in order")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="cProfile the runner's step methods outside the forward and print "
                         "the N functions of most cumulative time per run (0: off)")
    ap.add_argument("--cprofile-sort", default="cumulative", choices=("cumulative", "tottime"),
                    help="order of --cprofile's list (tottime: time in the function itself)")
    ap.add_argument("--cprofile-only", default=None, metavar="REGEX",
                    help="list only functions whose file:line(name) matches REGEX, "
                         "e.g. vllm_eagle_tree (before the N cut)")
    ap.add_argument("--cprofile-dump", default=None, metavar="PREFIX",
                    help="also write each run's raw profile to PREFIX.<run>.<shape>.prof "
                         "(for pstats: callers, callees)")
    args = ap.parse_args()
    for shape in args.shapes:  # checked before any engine starts
        if shape.startswith("fixed-") and not re.fullmatch(r"fixed-\d+x\d+x\d+", shape):
            raise SystemExit(f"shape {shape!r}: a fixed tree is fixed-NxDxK, e.g. fixed-16x4x4")

    target = build(assets.DEEP_TARGET, extra_layers=60)
    prompts = assets.heldout_prompts()

    def start(shape):
        """A warmed engine for ``shape`` with its runner's methods timed."""
        if shape == "vanilla":
            spec = None
        elif shape.startswith("vllm-chain-"):
            spec = speculative_config("eagle3", int(shape.rsplit("-", 1)[1]))
        elif shape.startswith("fixed-"):  # a fixed eagle2 tree, e.g. fixed-16x4x4
            spec = speculative_config("eagle2-eagle3", shape[len("fixed-"):])
        else:
            spec = speculative_config("eagle2-eagle3", "8x4x2g")
        # several live engines: no Prometheus loggers (vLLM's metrics
        # registry is process-wide), as bench_paired --interleave
        llm = LLM(model=str(target), speculative_config=spec, dtype="float32",
                  enforce_eager=True, max_model_len=1024, disable_log_stats=args.keep_alive,
                  seed=0, max_num_seqs=64)
        runner = _runner(llm)
        eagle2 = spec is not None and spec["method"] == "eagle2"
        if eagle2 and shape != "free" and not shape.startswith("fixed-"):
            pin_shape(llm, shape, "shape",
                      others=("vanilla", "vllm-chain-K", "free", "fixed-NxDxK"))
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        timers = Timers()
        if args.cprofile:  # inside the Timers' wrappers: the timers themselves are not profiled
            timers.profile = cProfile.Profile()
            for name in PROFILED:
                f = getattr(runner, name)

                def profiled(*a, _f=f, **k):
                    timers.profile.enable()
                    try:
                        return _f(*a, **k)
                    finally:
                        timers.profile.disable()
                setattr(runner, name, profiled)
        timers.wrap(runner, RUNNER)
        timers.wrap(_scheduler(llm), SCHEDULER, "scheduler.")
        if eagle2:
            timers.wrap(runner.tree_drafter, TREE_DRAFTER, "drafter.")
            if runner.tree_planner is not None:  # fixed trees have no planner or bandit
                timers.wrap(runner.tree_planner, PLANNER, "planner.")
                timers.wrap(runner.tree_bandit, BANDIT, "bandit.")
        elif spec is not None:
            timers.wrap(runner.drafter, VLLM_DRAFTER, "drafter.")
        return llm, timers

    def tree_counts(llm):
        """The runner's cumulative (verify steps, tree requests, drafted
        nodes, accepted nodes); None for engines without eagle2."""
        runner = _runner(llm)
        st = getattr(runner, "tree_stats", None)
        if st is None:
            return None
        return (st["steps"], st["tree_requests"], st["nodes"], sum(st["accepted_per_depth"]))

    def run(shape, llm, timers):
        timers.clear()
        before = tree_counts(llm)
        _scheduler(llm).max_num_active_reqs = args.batch
        gc.callbacks.append(timers.gc_callback)
        faults = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        outs = llm.generate([prompts[i % len(prompts)] for i in range(args.requests)],
                            SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                            use_tqdm=False)
        dt = time.perf_counter() - t
        faults_after = resource.getrusage(resource.RUSAGE_SELF)
        gc.callbacks.remove(timers.gc_callback)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"== {shape}, batch {args.batch}: {n / dt:.1f} tok/s, {dt:.2f} s, "
              f"{timers.calls.get('execute_model', 0)} engine steps, "
              f"{faults_after.ru_minflt - faults.ru_minflt} minor page faults, "
              f"{faults_after.ru_nivcsw - faults.ru_nivcsw} involuntary context switches")
        after = tree_counts(llm)
        if after is not None and after[1] > before[1]:
            _, reqs, nodes, acc = (x - y for x, y in zip(after, before))
            print(f"   trees: {reqs} verified, {nodes / reqs:.2f} drafted nodes and "
                  f"{acc / reqs:.3f} accepted a tree")
        # the wall time no timed method holds: engine-core output processing,
        # the LLM's request and output bookkeeping
        timed = sum(timers.seconds.get(k, 0.0) for k in
                    ("execute_model", "sample_tokens", "scheduler.schedule",
                     "scheduler.update_from_output"))
        steps = max(timers.calls.get("execute_model", 0), 1)
        timers.seconds["(outside the timed top-level methods)"] = dt - timed
        timers.calls["(outside the timed top-level methods)"] = steps
        for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
            c = timers.calls[k]
            f = timers.faults.get(k)
            print(f"   {k:38s} {v:7.3f} s {c:6d} calls {1e3 * v / c:7.2f} ms/call"
                  + ("" if f is None else f" {f / c:8.1f} faults/call"))
        if args.cprofile:
            text = io.StringIO()
            restrict = ([args.cprofile_only] if args.cprofile_only else []) + [args.cprofile]
            pstats.Stats(timers.profile, stream=text).sort_stats(args.cprofile_sort).print_stats(
                *restrict)
            print(text.getvalue())
            if args.cprofile_dump:
                run.count = getattr(run, "count", 0) + 1
                timers.profile.dump_stats(f"{args.cprofile_dump}.{run.count}.{shape}.prof")
            timers.profile = cProfile.Profile()

    if args.keep_alive:  # one engine per distinct shape, all alive, then the runs in order
        live = {}
        for shape in args.shapes:
            if shape not in live:
                live[shape] = start(shape)
        for shape in args.shapes:
            run(shape, *live[shape])
    else:
        for shape in args.shapes:
            llm, timers = start(shape)
            run(shape, llm, timers)
            del llm, timers
            gc.collect()

if __name__ == "__main__":
    main()
