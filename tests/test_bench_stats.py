"""The statistics scripts/bench_paired.py draws its verdict from."""
import math
import runpy
import statistics

import pytest

from vllm_eagle_tree import assets

bp = runpy.run_path(str(assets.ROOT / "scripts" / "bench_paired.py"), run_name="not_main")


def test_mean_ci_is_the_t_interval():
    xs = [10.0, 12.0, 11.0, 15.0]
    m, h = bp["mean_ci"](xs)
    assert m == statistics.fmean(xs)
    assert h == pytest.approx(3.182 * statistics.stdev(xs) / 2)  # t(0.975, df=3), sqrt(4)
    assert bp["mean_ci"]([5.0]) == (5.0, 0.0)
    assert bp["t975"](11) == 2.228 and bp["t975"](500) == 1.96  # df 11 rounds down to 10


def test_paired_ratio_removes_a_shared_drift():
    """Each round's pair shares the machine's speed: the paired ratio is
    exact even when the rounds differ by 30%, and the verdict follows its interval."""
    drift = [1.0, 0.7, 1.3, 0.9]
    base = [100 * d for d in drift]
    r = bp["paired_ratio"]([97 * d for d in drift], base)
    assert r["ratio"] == pytest.approx(0.97) and r["low"] == r["high"] == pytest.approx(0.97)
    assert bp["verdict"](r) == "slower"
    r = bp["paired_ratio"]([103 * d for d in drift], base)
    assert bp["verdict"](r) == "faster"
    r = bp["paired_ratio"]([98, 73, 131, 91], base)  # +-2-4% either way: unresolved
    assert r["low"] < 1.0 < r["high"] and bp["verdict"](r) == "no difference resolved"
    logs = [math.log(a / b) for a, b in zip([98, 73, 131, 91], base)]
    assert r["ratio"] == pytest.approx(math.exp(statistics.fmean(logs)), abs=1e-4)


def test_summary_picks_the_best_mean_baseline():
    cells = {"vanilla": [{"tokens_per_s": x} for x in (100, 90, 110)],
             "vLLM eagle3 K=2": [{"tokens_per_s": x} for x in (120, 100, 125)],
             "eagle2 adaptive": [{"tokens_per_s": x} for x in (118, 99, 126)]}
    s = bp["summarize"](cells)
    assert s["baseline"] == "vLLM eagle3 K=2"
    assert s["adaptive_over_baseline"]["each"] == [round(118 / 120, 4), 0.99, 1.008]
    assert s["adaptive_over_vanilla"]["ratio"] > 1.1


def test_chain_ks_are_checked():
    assert bp["parse_chain_ks"](["1=2,3,4"], [1, 4, 16]) == {1: [2, 3, 4], 4: [2, 3], 16: [2]}
    with pytest.raises(SystemExit, match="BATCH=K"):
        bp["parse_chain_ks"](["8=2"], [1, 16])


def test_forced_shapes_are_never_the_baseline():
    cells = {"vanilla": [{"tokens_per_s": x} for x in (100, 90, 110)],
             "eagle2 chain-2 (forced)": [{"tokens_per_s": x} for x in (150, 140, 160)],
             "eagle2 adaptive": [{"tokens_per_s": x} for x in (120, 99, 121)]}
    s = bp["summarize"](cells)
    assert s["baseline"] == "vanilla"
    assert s["over_baseline"]["eagle2 chain-2 (forced)"]["each"] == [1.5, round(140 / 90, 4),
                                                                     round(160 / 110, 4)]
    assert bp["label"](bp["FORCED"], "plain") == "eagle2 plain (forced)"


def test_one_setting_is_the_worst_ratio_over_batch_sizes():
    """A method measured at every batch size gets its paired ratio to each
    size's baseline (1 where it is the baseline) and the worst of them;
    methods missing at some batch size are left out."""
    def cells(**methods):
        return {n: [{"tokens_per_s": x} for x in xs] for n, xs in methods.items()}
    by_batch = {
        "1": cells(vanilla=[30, 30], **{"vLLM eagle3 K=3": [60, 50],
                                         "eagle2 adaptive": [57, 50]}),
        "64": cells(vanilla=[400, 440], **{"eagle2 adaptive": [380, 440]}),
    }
    results = {"batch_sizes": {b: {"cells": c, "summary": bp["summarize"](c)}
                               for b, c in by_batch.items()}}
    one = bp["one_setting"](results)
    assert set(one) == {"vanilla", "eagle2 adaptive"}  # K=3 ran at batch 1 only
    assert one["vanilla"]["per_batch"] == {"1": 0.5477, "64": 1.0}  # sqrt(0.5 * 0.6)
    assert one["vanilla"]["worst"] == 0.5477 and one["vanilla"]["worst_at"] == 1
    assert one["eagle2 adaptive"]["per_batch"] == {"1": round(math.sqrt(0.95), 4),
                                                   "64": round(math.sqrt(0.95), 4)}
    assert "worst" in bp["markdown"](dict(results, one_setting=one))


def test_pool_joins_rounds_of_several_runs(tmp_path):
    """Pooled runs: every method measured in every run gets all its cells,
    rounds renumbered after the earlier runs'; a method one run lacks is
    left out; the pooled paired ratio is the one over all rounds."""
    import json

    def run(rounds, extra=False):
        cells = {"vanilla": [], "eagle2 adaptive": []}
        if extra:
            cells["vLLM eagle3 K=3"] = []
        for r, (van, ours) in enumerate(rounds):
            cells["vanilla"].append({"tokens_per_s": van, "round": r})
            cells["eagle2 adaptive"].append({"tokens_per_s": ours, "round": r})
            if extra:
                cells["vLLM eagle3 K=3"].append({"tokens_per_s": 1.0, "round": r})
        return {"command": "x", "rounds": len(rounds), "max_tokens": 64,
                "min_tokens_per_cell": 2048, "batch_sizes": {"4": {"cells": cells}}}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run([(100, 90), (80, 76)], extra=True)))
    b.write_text(json.dumps(run([(120, 126)])))
    pooled = bp["pool"]([a, b])
    cells = pooled["batch_sizes"]["4"]["cells"]
    assert set(cells) == {"vanilla", "eagle2 adaptive"}
    assert [c["round"] for c in cells["vanilla"]] == [0, 1, 2]
    assert [c["tokens_per_s"] for c in cells["eagle2 adaptive"]] == [90, 76, 126]
    assert pooled["rounds"] == 3
    r = bp["summarize"](cells)["adaptive_over_baseline"]
    assert r["ratio"] == pytest.approx((0.9 * 0.95 * 1.05) ** (1 / 3), abs=1e-4)
    c = run([(1, 1)])
    c["max_tokens"] = 32
    (tmp_path / "c.json").write_text(json.dumps(c))
    with pytest.raises(SystemExit, match="max_tokens"):
        bp["pool"]([a, tmp_path / "c.json"])
    d = run([(1, 1)])
    d["interleaved"] = True
    (tmp_path / "d.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="interleave"):
        bp["pool"]([a, tmp_path / "d.json"])  # one engine start-up per cell, and live engines
    assert bp["pool"]([tmp_path / "d.json", tmp_path / "d.json"])["interleaved"] is True
    e = run([(1, 1)])
    e["output_len_spread"] = 0.5
    (tmp_path / "e.json").write_text(json.dumps(e))
    with pytest.raises(SystemExit, match="output-len-spread"):
        bp["pool"]([a, tmp_path / "e.json"])  # runs before the option had none: 0
    assert bp["pool"]([tmp_path / "e.json", tmp_path / "e.json"])["output_len_spread"] == 0.5


def test_read_trace_counts_picks_switches_and_depth_increments():
    """scripts/read_trace.py: per batch size, picks and best shapes counted,
    switches of the best, and chain-(k+1) - chain-k predicted step ms."""
    rt = runpy.run_path(str(assets.ROOT / "scripts" / "read_trace.py"), run_name="not_main")

    def rec(batch, picked, best, c1, c2, c3, lockstep=False):
        return {"batch": batch, "picked": picked, "best": best, "lockstep": lockstep,
                "step_ms": {"plain": 10.0, "chain-1": c1, "chain-2": c2, "chain-3": c3,
                            "tree": None}}

    records = [rec(1, "chain-1", None, None, None, None),
               rec(1, "chain-2", "chain-2", 11.0, 12.0, 13.5),
               rec(4, "plain", "plain", 20.0, 21.0, 22.0, lockstep=True),
               rec(4, "chain-1", "plain", 20.0, 21.0, 22.0),
               rec(1, "chain-3", "chain-3", 11.0, 13.0, 14.0),
               rec(1, "chain-2", "chain-2", 11.0, 12.5, 14.0)]
    s = rt["summarise"](records)
    assert list(s) == ["1", "4"]
    one = s["1"]
    assert one["picks"] == 4 and one["picked"] == {"chain-2": 2, "chain-1": 1, "chain-3": 1}
    assert one["best"] == {"chain-2": 2, "chain-3": 1} and one["best_switches"] == 2
    inc = one["depth_increment_ms"]
    assert inc["chain-1->chain-2"] == {"n": 3, "min": 1.0, "p10": 1.0, "median": 1.5,
                                       "p90": 2.0, "max": 2.0}
    assert inc["chain-2->chain-3"]["min"] == 1.0 and inc["chain-2->chain-3"]["max"] == 1.5
    assert s["4"]["best_switches"] == 0 and s["4"]["depth_increment_ms"]["chain-2->chain-3"]["n"] == 2
    assert one["picked_in_lockstep"] == {} and s["4"]["picked_in_lockstep"] == {"plain": 1}
    assert s["4"]["picked"] == {"plain": 1, "chain-1": 1}


def test_bench_shapes_measures_a_shape_on_its_own_full_batch_steps():
    """scripts/bench_shapes.py with several shapes: a shape's line counts only
    the steps that verify its drafts with the whole batch decoding and no
    prompt rows, and tokens/s over its whole runs."""
    bs = runpy.run_path(str(assets.ROOT / "scripts" / "bench_shapes.py"), run_name="not_main")

    def step(shape, arm, requests=4, prefill=0, seconds=0.05, forward=0.04, draft=0.004,
             emitted=8, rows=8, model=0.038):
        return {"shape": shape, "arm": arm, "requests": requests, "prefill_rows": prefill,
                "seconds": seconds, "forward": forward, "draft": draft, "emitted": emitted,
                "rows": rows, "model": model}

    steps = [step("chain-1", "plain", seconds=9.0),            # verifies plain's drafts
             step("chain-1", "chain-1"),
             step("chain-1", "chain-1", seconds=0.07, forward=0.05, emitted=6, rows=8),
             step("chain-1", "chain-1", requests=3, seconds=9.0),  # the drain
             step("chain-1", "chain-1", prefill=30, seconds=9.0),  # prompt rows
             step("chain-1", "chain-1", forward=None, seconds=9.0),  # not timed
             step("plain", "chain-1", seconds=9.0)]               # another shape's run
    row = bs["measured_row"](steps, [(256, 2.0), (256, 1.0)], "chain-1", batch=4)
    assert row["steps"] == 2
    assert row["tok_s"] == pytest.approx(512 / 3.0)
    assert row["rounds"] == [128.0, 256.0]
    assert row["step_ms"] == pytest.approx(60.0)
    assert row["forward_ms"] == pytest.approx(45.0)
    assert row["model_forward_ms"] == pytest.approx(38.0)
    assert row["draft_ms"] == pytest.approx(4.0)
    assert row["other_ms"] == pytest.approx(11.0)
    assert row["tokens_per_request"] == pytest.approx(14 / 8)
    empty = bs["measured_row"](steps, [(64, 1.0)], "chain-2", batch=4)
    assert empty == {"tok_s": 64.0, "rounds": [64.0], "steps": 0}
